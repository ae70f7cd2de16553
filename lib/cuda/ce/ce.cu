// ce/ce.cu — the CUDA backend of fce_forward / fce_backward / fce_backward_rescale: carves the
// workspace and enqueues the three steps on the caller's stream (the ABI layer has checked every
// argument, the device pointers included: cuda_check_pointers, common/device_pointers.cu):
//   1. launch_ce_denominators   D and Ω over all rows (needed by mean and by weighted smoothing)
//   2. launch_ce_rows           row losses, lse, z-loss terms, the gradient (one pass)
//   3. launch_ce_finalize       the fixed-order reduced loss / z-loss (forward)
// No allocation, no synchronisation, nothing on another stream: graph-capturable. Every message
// starts with p.fn, the public function.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/ce/rows.cuh"
#include "internal.h"

namespace fce {
namespace {

constexpr size_t kWsAlign = 256;

size_t align_up(size_t x) { return (x + kWsAlign - 1) / kWsAlign * kWsAlign; }

// Workspace layout (offsets from the caller's pointer, which is 16-byte aligned):
//   [0, 256)                         CeDenoms
//   [256, 256 + align(rows·4))       row losses (forward, mean/sum; none uses the caller's loss)
//   [.., .. + align(rows·4))         row z-loss terms (forward, λ ≠ 0)
//   [.., .. + align(rows·4))         row correctness (forward, mean/sum, for options->accuracy;
//                                    none writes the caller's accuracy rows)
// The size does not depend on whether argmax / accuracy are asked for (the query has only the
// options struct, which carries those pointers: asked or not, the size is the same).
struct WsLayout {
  size_t denoms = 0, row_loss = 0, row_zloss = 0, row_correct = 0, total = 0;
  bool has_row_loss = false, has_row_zloss = false, has_row_correct = false;
};
WsLayout ws_layout(const CeOptions& opt, int64_t rows, bool backward) {
  WsLayout l;
  size_t off = align_up(sizeof(cuda::CeDenoms));
  const size_t row_bytes = align_up(static_cast<size_t>(rows < 0 ? 0 : rows) * sizeof(float));
  if (!backward && opt.reduction != FCE_REDUCTION_NONE) {
    l.has_row_loss = true;
    l.row_loss = off;
    off += row_bytes;
  }
  if (!backward && opt.z_loss_scale != 0.f) {
    l.has_row_zloss = true;
    l.row_zloss = off;
    off += row_bytes;
  }
  if (!backward && opt.reduction != FCE_REDUCTION_NONE) {
    l.has_row_correct = true;
    l.row_correct = off;
    off += row_bytes;
  }
  l.total = off;
  return l;
}

}  // namespace

size_t cuda_ce_workspace_size(const CeOptions& opt, int64_t rows, int64_t /*vocab*/,
                              bool backward) {
  return ws_layout(opt, rows, backward).total;
}

fce_status cuda_ce(const CeProblem& p) {
  // fce_backward_rescale runs the forward's kernels in rescale mode (no outputs but the gradient)
  const bool backward = p.mode == CeMode::kBackward;
  const bool rescale = p.mode == CeMode::kRescale;
  const bool outputs = p.mode == CeMode::kForward;
  const char* fn = p.fn;
  const CeOptions& opt = p.opt;

  // ---- everything that can fail before any work is enqueued (the backward and the rescale
  // share the backward's workspace: no per-row outputs)
  const WsLayout ws = ws_layout(opt, p.rows, !outputs);
  if (p.workspace_bytes < ws.total)
    return fail(FCE_ERROR_WORKSPACE_TOO_SMALL, "%s: workspace_bytes (%zu) is less than %zu", fn,
                p.workspace_bytes, ws.total);
  if (!p.workspace)
    return fail(FCE_ERROR_NULL_POINTER, "%s: workspace is NULL (%zu bytes needed)", fn, ws.total);
  if (outputs && !p.loss)
    return fail(FCE_ERROR_NULL_POINTER, "%s: loss is NULL", fn);
  if (!outputs && !p.grad)
    return fail(FCE_ERROR_NULL_POINTER, "%s: grad_logits is NULL", fn);
  if (backward && !p.lse_in)
    return fail(FCE_ERROR_NULL_POINTER, "%s: lse is NULL", fn);

  char* base = static_cast<char*>(p.workspace);
  auto* denoms = reinterpret_cast<cuda::CeDenoms*>(base + ws.denoms);
  const bool none = opt.reduction == FCE_REDUCTION_NONE;
  float* row_loss = nullptr;
  float* row_zloss = nullptr;  // λ = 0: no z-loss terms
  float* row_correct = nullptr;
  if (outputs) {
    row_loss = none ? p.loss : reinterpret_cast<float*>(base + ws.row_loss);
    if (ws.has_row_zloss && (!none || p.z_loss))
      row_zloss = reinterpret_cast<float*>(base + ws.row_zloss);
    if (p.accuracy) row_correct = none ? p.accuracy : reinterpret_cast<float*>(base + ws.row_correct);
  }
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);

  // ---- 1. denominators (all rows, before any row needs k = g / D)
  // (fce_backward_rescale: nothing when the upstream gradient reads 1, as the rows then do)
  if (fce_status st = cuda::launch_ce_denominators(fn, opt, p.rows, p.vocab, p.targets, denoms,
                                                   stream, rescale ? p.grad_output : nullptr))
    return st;

  // ---- 2. the rows
  cuda::CeRowsArgs a =
      cuda::all_rows_args(fn, opt, p.rows, p.vocab, p.logits, p.row_stride, p.grad,
                          p.grad_row_stride, p.targets, denoms, p.grad_output);
  a.lse_in = backward ? p.lse_in : nullptr;
  a.row_loss = row_loss;
  a.row_zloss = row_zloss;
  a.lse_out = outputs ? p.lse : nullptr;
  a.argmax_out = outputs ? p.argmax : nullptr;
  a.row_correct = row_correct;
  a.error_flags = p.error_flags;
  a.rescale = rescale;
  a.after_denominators = true;
  a.entropy_out = outputs ? p.entropy : nullptr;  // (rescale: the ABI refuses these three)
  a.grad_lse = p.grad_lse;
  a.grad_entropy = p.grad_entropy;
  if (fce_status st = cuda::launch_ce_rows(a, stream)) return st;

  // ---- 3. the reduced loss, z-loss and accuracy (forward); for none the rows are the outputs
  if (outputs) {
    float* loss_out = none ? nullptr : p.loss;
    float* acc_out = none ? nullptr : p.accuracy;
    if (fce_status st = cuda::launch_ce_finalize(fn, opt, p.rows, row_loss, row_zloss, row_correct,
                                                 denoms, loss_out, p.z_loss, acc_out, stream,
                                                 /*pdl=*/true))
      return st;
  }
  return FCE_SUCCESS;
}

}  // namespace fce
