// vocab_parallel/vocab_parallel.cu — the CUDA backend of fce_vp_stats, fce_vp_loss and fce_vp_backward
// (docs/semantics.md rule 16): the workspace, and the order of the launches on the caller's stream.
// The kernels and what they compute: vocab_parallel/kernels.cu (phase 1, the stats of a shard; phase 3, the
// combination of the gathered stats). The ABI layer has checked every argument, the device
// pointers included (cuda_check_pointers); every message starts with p.fn.
//
// cuda_vp_stats: launch_vp_weights (class weights only) → launch_vp_stats (with class
// probabilities, their sums u_r and W_r after it: vocab_parallel/soft.cu); under
// options->batch_invariant launch_vp_stats runs vocab_parallel/exact.cu's kernel alone.
// cuda_vp (loss): launch_ce_denominators (D, n from the targets) → combine → launch_ce_finalize.
// cuda_vp (backward): launch_ce_denominators → combine (row statistics) → launch_ce_rows in
// backward mode on the shard as a column slice [vocab_start, vocab_start + vocab_local) of rows
// of vocab_total classes with stats_in: exactly the gradient of rule 9 with m = M, log s = log S
// (the one-hot term only where the target lies in the shard); with class probabilities the
// stream kernel's rule 19 gradient over the shard's q, Q = Ω of the combination.
// Everything on the caller's stream, no allocation, no host synchronisation: graph-capturable;
// every reduction has a fixed order: deterministic.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/ce/rows.cuh"
#include "cuda/vocab_parallel/kernels.cuh"
#include "internal.h"

namespace fce {

// ============================================================== the calls ====
namespace {

constexpr size_t kWsAlign = 256;
size_t align_up(size_t x) { return (x + kWsAlign - 1) / kWsAlign * kWsAlign; }

// Workspace of fce_vp_loss / fce_vp_backward (offsets from the caller's 16-byte aligned pointer):
//   [0, 256)                 CeDenoms (D, Ω, n of the whole problem)
//   loss:     row losses (mean/sum; none writes the caller's loss), row z-loss terms (λ ≠ 0),
//             row correctness (mean/sum, for options->accuracy), align(rows·4) each
//   backward: the combined row statistics CeRowStats [rows] (16 bytes each)
// The same for any argmax / accuracy / lse / z_loss request (the query sees only the options).
struct VpWsLayout {
  size_t denoms = 0, stats = 0, row_loss = 0, row_zloss = 0, row_correct = 0, total = 0;
  bool has_row_loss = false, has_row_zloss = false, has_row_correct = false;
};
VpWsLayout vp_ws_layout(const CeOptions& opt, int64_t rows, bool backward) {
  VpWsLayout l;
  const size_t n = static_cast<size_t>(rows < 0 ? 0 : rows);
  size_t off = align_up(sizeof(cuda::CeDenoms));
  if (backward) {
    l.stats = off;
    off += align_up(n * sizeof(cuda::CeRowStats));
  } else {
    const bool none = opt.reduction == FCE_REDUCTION_NONE;
    if (!none) {
      l.has_row_loss = true;
      l.row_loss = off;
      off += align_up(n * sizeof(float));
    }
    if (opt.z_loss_scale != 0.f) {
      l.has_row_zloss = true;
      l.row_zloss = off;
      off += align_up(n * sizeof(float));
    }
    if (!none) {
      l.has_row_correct = true;
      l.row_correct = off;
      off += align_up(n * sizeof(float));
    }
  }
  l.total = off;
  return l;
}

bool dtype_ok(int dtype) {
  return dtype == FCE_FLOAT32 || dtype == FCE_FLOAT16 || dtype == FCE_BFLOAT16;
}

}  // namespace

fce_status cuda_vp_stats(const VpStatsProblem& p) {
  const char* fn = p.fn;
  const CeOptions& opt = p.opt;
  if (!dtype_ok(opt.dtype))
    return fail(FCE_ERROR_INTERNAL, "%s: dtype %d reached the CUDA backend", fn, opt.dtype);
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  if (opt.class_weights && !opt.batch_invariant)  // (the exact statistics sum them per row)
    FCE_TRY(cuda::launch_vp_weights(fn, opt, p.rows, p.vocab_start, p.vocab_local, p.stats,
                                    stream));
  cuda::VpStatsArgs a{};
  a.fn = fn;
  a.opt = opt;
  a.row_begin = 0;
  a.row_count = p.rows;
  a.logits = p.logits;
  a.logits_dtype = opt.dtype;
  a.row_stride = p.row_stride;
  a.vocab_total = p.vocab_total;
  a.vocab_start = p.vocab_start;
  a.vocab_local = p.vocab_local;
  a.targets = p.targets;
  a.stats = p.stats;
  a.weight_written = opt.class_weights != nullptr;
  return cuda::launch_vp_stats(a, stream);
}

size_t cuda_vp_workspace_size(const CeOptions& opt, int64_t /*ranks*/, int64_t rows,
                              int64_t /*vocab_total*/, int64_t /*vocab_local*/, bool backward) {
  return vp_ws_layout(opt, rows, backward).total;
}

fce_status cuda_vp(const VpProblem& p) {
  const bool backward = p.backward;
  const char* fn = p.fn;
  const CeOptions& opt = p.opt;

  // ---- everything that can fail before any work is enqueued
  if (!dtype_ok(opt.dtype))
    return fail(FCE_ERROR_INTERNAL, "%s: dtype %d reached the CUDA backend", fn, opt.dtype);
  const VpWsLayout ws = vp_ws_layout(opt, p.rows, backward);
  if (p.workspace_bytes < ws.total)
    return fail(FCE_ERROR_WORKSPACE_TOO_SMALL, "%s: workspace_bytes (%zu) is less than %zu", fn,
                p.workspace_bytes, ws.total);
  if (!p.workspace)
    return fail(FCE_ERROR_NULL_POINTER, "%s: workspace is NULL (%zu bytes needed)", fn, ws.total);
  if (!backward && !p.loss) return fail(FCE_ERROR_NULL_POINTER, "%s: loss is NULL", fn);
  if (backward && !p.logits) return fail(FCE_ERROR_NULL_POINTER, "%s: logits is NULL", fn);
  if (backward && !p.grad) return fail(FCE_ERROR_NULL_POINTER, "%s: grad_logits is NULL", fn);

  char* base = static_cast<char*>(p.workspace);
  auto* denoms = reinterpret_cast<cuda::CeDenoms*>(base + ws.denoms);
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);

  // ---- 1. D, Ω, n from the targets (the whole vocabulary's class weights)
  FCE_TRY(cuda::launch_ce_denominators(fn, opt, p.rows, p.vocab_total, p.targets, denoms, stream));

  cuda::VpCombineArgs c{};
  c.fn = fn;
  c.opt = opt;
  c.ranks = p.ranks;
  c.rows = p.rows;
  c.vocab_total = p.vocab_total;
  c.targets = p.targets;
  c.gathered = p.gathered;
  c.error_flags = p.error_flags;

  if (!backward) {
    // ---- 2. the combination: per-row losses, lse, argmax, correctness
    const bool none = opt.reduction == FCE_REDUCTION_NONE;
    float* row_loss = none ? p.loss : reinterpret_cast<float*>(base + ws.row_loss);
    float* row_zloss = (ws.has_row_zloss && (!none || p.z_loss))
                           ? reinterpret_cast<float*>(base + ws.row_zloss) : nullptr;
    float* row_correct = !p.accuracy ? nullptr
                         : none ? p.accuracy : reinterpret_cast<float*>(base + ws.row_correct);
    c.row_loss = row_loss;
    c.row_zloss = row_zloss;
    c.lse = p.lse;
    c.argmax = p.argmax;
    c.row_correct = row_correct;
    c.entropy = p.entropy;
    FCE_TRY(cuda::launch_vp_combine(c, stream));
    // ---- 3. the fixed-order reduction (for none the rows are the outputs: only z_loss left)
    FCE_TRY(cuda::launch_ce_finalize(fn, opt, p.rows, row_loss, row_zloss, row_correct, denoms,
                                     none ? nullptr : p.loss, p.z_loss,
                                     none ? nullptr : p.accuracy, stream));
    return FCE_SUCCESS;
  }

  // ---- 2. the combination: the row statistics of the gradient
  auto* stats = reinterpret_cast<cuda::CeRowStats*>(base + ws.stats);
  c.stats_out = stats;
  FCE_TRY(cuda::launch_vp_combine(c, stream));

  // ---- 3. the shard's gradient: the backward row kernel on a column slice of the vocabulary
  cuda::CeRowsArgs a =
      cuda::all_rows_args(fn, opt, p.rows, p.vocab_local, p.logits, p.row_stride, p.grad,
                          p.grad_row_stride, p.targets, denoms, p.grad_output);
  a.vocab_total = p.vocab_total;
  a.col_begin = p.vocab_start;
  a.stats_in = stats;
  if (opt.soft_targets) a.q_row_stride = p.vocab_local;  // this rank's shard of q, from column 0
  a.error_flags = p.error_flags;
  a.grad_lse = p.grad_lse;  // rule 18's terms: the stream kernel's ROWT backward
  a.grad_entropy = p.grad_entropy;
  FCE_TRY(cuda::launch_ce_rows(a, stream));
  // ---- 4. ignored rows of an inconsistent tiling: NaN as well (the row kernel wrote 0)
  return cuda::launch_vp_nan_rows(fn, stats, p.rows, p.grad, opt.dtype, p.vocab_local,
                                  p.grad_row_stride, stream, opt.vp_entropy);
}

}  // namespace fce
