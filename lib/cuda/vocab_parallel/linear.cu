// vocab_parallel/linear.cu — the CUDA backend of fce_vp_linear_stats and fce_vp_linear_backward:
// the vocabulary-parallel fused linear + CE (docs/semantics.md rules 13, 16) over this rank's
// weight rows W_s = W[vocab_start : vocab_start + vocab_local, :] (and bias b_s), never holding
// more of z = h·W_sᵀ + b_s than the caller's workspace. Why it is fast: both phases are
// fce_linear_ce's own plans on the shard (cuBLASLt GEMMs, the row kernels between them): phase 1
// its loss-only token chunks (2·N·D·V_s FLOPs), phase 3 its vocabulary-sliced gradient pass
// (6·N·D·V_s). One stream, no allocation, no host synchronisation: graph-capturable.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/ce/rows.cuh"
#include "cuda/linear/kernels.cuh"
#include "cuda/linear/plan.cuh"
#include "cuda/vocab_parallel/kernels.cuh"
#include "cuda/vocab_parallel/linear_plan.cuh"
#include "internal.h"

// Phase 1 (fce_vp_linear_stats), 2·N·D·V_s FLOPs: fce_linear_ce's loss-only plan for a [N, D] ×
// [V_s, D] problem (linear/plan.cuh: plan_mode(kChunked), the same workspace arithmetic, query
// and chunk sizes): per token chunk of Nc rows, Z_c = h_c·W_sᵀ + b_s in the dtype (logits_gemm:
// cuBLASLt, float32 accumulation, the bias in the epilogue, as fce_linear_ce makes its logits),
// then the phase-1 stats kernel (vocab_parallel/kernels.cu) on Z_c's rows into stats. With class weights
// W_r (the same for every row) is written once by launch_vp_weights.
//
// Phase 3 (fce_vp_linear_backward), 6·N·D·V_s FLOPs: the combine kernel turns gathered_stats into
// the row statistics (M, log S, t) in the workspace, then fce_linear_ce's vocab-sliced gradient
// pass (linear/plan.cuh: slice_pass, the very function fce_linear_ce runs) over the shard's
// columns as a column slice [vocab_start, vocab_start + V_s) of the vocab_total classes: per
// slice of Vc columns for all N rows, Z_s again, ∂Z_s in place from the statistics, ∂W_s in ONE
// GEMM over all rows (one rounding; beta = accumulate), ∂h += ∂Z_s·W_s in float32 (the caller's
// grad_hidden itself when grad_hidden_dtype is FCE_FLOAT32, else a float32 [N, D] workspace
// buffer stored once at the end), ∂b_s by fixed-order column sums straight into grad_bias
// (+ its old value with accumulate: the same single rounding as fce_linear_ce's store).
//   Workspace (from a 256-byte aligned base): CeDenoms | CeRowStats [N] | bias copy [V_s] in
//   dtype | float32 ∂h [N, D] (only for a 16-bit grad_hidden_dtype) | cuBLASLt workspace |
//   logits scratch [N, Vc] in dtype. Nothing of size [V, D]. The minimum takes Vc = 64 and 4 MiB
//   for cuBLASLt; the full-speed size takes slices of up to 1 GiB of logits (all of the shard when
//   that fits) and 16 MiB for cuBLASLt. The plan (Vc, the cuBLASLt workspace) is a function of the
//   sizes, the options, grad_hidden_dtype and workspace_bytes only: bitwise deterministic for a
//   given workspace size. The plan arithmetic and the size query: vocab_parallel/linear_plan.cu.
// One stream, no allocation, no host synchronisation (after the first call's cuBLASLt handle):
// graph-capturable. The ABI layer has checked every argument, the device pointers included
// (cuda_check_pointers); every message starts with p.fn.

namespace fce {
namespace cuda {
namespace {

using linear::aligned_base;
using vp_plan::BwdLayout;
using vp_plan::BwdPlan;
using vp_plan::BwdSizes;

// The slice pass's fix_dz: the ignored rows of an inconsistent tiling get a NaN ∂Z row too (so
// that their ∂h rows, ∂W and ∂b are NaN, as every other gradient of such a call).
struct NanRows {
  const char* fn;
  const CeRowStats* stats;
  int dtype;
  bool by_t;  // the statistics of options->vp_entropy
};
fce_status nan_rows(const void* ctx, void* dz, int64_t rows, int64_t cols, int64_t ld,
                    cudaStream_t s) {
  const NanRows* c = static_cast<const NanRows*>(ctx);
  return launch_vp_nan_rows(c->fn, c->stats, rows, dz, c->dtype, cols, ld, s, c->by_t);
}

fce_status vp_linear_stats(const VpLinearProblem& p) {
  const char* fn = p.fn;
  const CeOptions& opt = p.opt;
  const int dtype = opt.dtype;
  const int64_t N = p.rows, D = p.hidden, Vs = p.vocab_local, hs = p.hidden_row_stride;
  const size_t e = dtype_size(dtype);

  const linear::Sizes s = vp_plan::stats_sizes(opt, N, D, Vs);
  linear::Plan plan;
  if (!linear::plan_mode(s, linear::Mode::kChunked, p.workspace_bytes, &plan)) {
    const size_t lo = linear::min_workspace(s, false, true);
    const size_t full = std::max(lo, linear::optimal_workspace(s, false, true));
    return fail(FCE_ERROR_WORKSPACE_TOO_SMALL,
                "%s: workspace_bytes (%zu) is too small: the CUDA backend needs at least %zu bytes "
                "for these sizes (%zu for full speed)",
                fn, p.workspace_bytes, lo, full);
  }
  if (!p.workspace)
    return fail(FCE_ERROR_NULL_POINTER, "%s: workspace is NULL (%zu bytes needed)", fn,
                plan.layout.total);

  const linear::Layout& L = plan.layout;
  char* base = aligned_base(p.workspace);
  void* bias_ws = p.bias ? static_cast<void*>(base + L.bias) : nullptr;
  void* lt_ws = base + L.lt;
  void* z = base + L.z;  // Z_c [rc, ldz] in dtype
  const int64_t ldz = s.vocab_padded;
  const char* hidden = static_cast<const char*>(p.hidden_states);
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);

  if (opt.class_weights)
    FCE_TRY(launch_vp_weights(fn, opt, N, p.vocab_start, Vs, p.stats, stream));
  if (p.bias) FCE_TRY(launch_convert(fn, p.bias, dtype, bias_ws, dtype, Vs, stream));

  for (int64_t c = 0; c < plan.chunks; ++c) {
    const int64_t r0 = c * plan.chunk_rows;
    const int64_t rc = std::min(plan.chunk_rows, N - r0);
    const void* h_c = hidden + static_cast<size_t>(r0) * static_cast<size_t>(hs) * e;
    // Z_c[rc, Vs] = h_c · W_sᵀ + b_s   (dtype, float32 accumulation, ld = ldz)
    FCE_TRY(linear::logits_gemm(fn, dtype, rc, Vs, D, h_c, hs, p.weight, bias_ws, z, ldz, lt_ws,
                                plan.lt_bytes, stream));
    FCE_TRY(launch_vp_stats(vp_chunk_stats_args(fn, opt, r0, rc, z, ldz, p.vocab_total,
                                                p.vocab_start, Vs, p.targets, p.stats),
                            stream));
  }
  return FCE_SUCCESS;
}

fce_status vp_linear_backward(const VpLinearProblem& p) {
  const char* fn = p.fn;
  const CeOptions& opt = p.opt;
  const int dtype = opt.dtype;
  const int64_t N = p.rows, D = p.hidden, Vs = p.vocab_local;
  const bool dw_fp32 = p.grad_weight_fp32 || dtype == FCE_FLOAT32;
  const int grad_w_dtype = dw_fp32 ? FCE_FLOAT32 : dtype;  // of grad_weight and grad_bias

  if (p.grad_hidden_dtype != FCE_FLOAT32 && p.grad_hidden_dtype != dtype)
    return fail(FCE_ERROR_INTERNAL, "%s: grad_hidden_dtype %d reached the CUDA backend", fn,
                p.grad_hidden_dtype);
  if (!p.grad_hidden && !p.grad_weight && !p.grad_bias)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: grad_hidden, grad_weight and grad_bias are all NULL (nothing to compute)", fn);

  const BwdSizes s = vp_plan::bwd_sizes(opt, N, D, Vs, p.grad_hidden_dtype);
  BwdPlan plan;
  if (!vp_plan::bwd_plan(s, p.workspace_bytes, &plan)) {
    const size_t lo = vp_plan::bwd_min_workspace(s);
    const size_t full = std::max(lo, vp_plan::bwd_optimal_workspace(s));
    return fail(FCE_ERROR_WORKSPACE_TOO_SMALL,
                "%s: workspace_bytes (%zu) is too small: the CUDA backend needs at least %zu bytes "
                "for these sizes (%zu for full speed)",
                fn, p.workspace_bytes, lo, full);
  }
  if (!p.workspace)
    return fail(FCE_ERROR_NULL_POINTER, "%s: workspace is NULL (%zu bytes needed)", fn,
                plan.layout.total);

  const BwdLayout& L = plan.layout;
  char* base = aligned_base(p.workspace);
  CeDenoms* denoms = reinterpret_cast<CeDenoms*>(base + L.denoms);
  CeRowStats* stats = reinterpret_cast<CeRowStats*>(base + L.stats);
  void* bias_ws = p.bias ? static_cast<void*>(base + L.bias) : nullptr;
  // ∂h: the caller's float32 grad_hidden is the accumulator; a 16-bit one gets a float32 one
  float* dh = nullptr;
  if (p.grad_hidden)
    dh = s.dh32 ? reinterpret_cast<float*>(base + L.dh) : static_cast<float*>(p.grad_hidden);
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);

  // ---- D, Ω, n of the whole problem; the bias in dtype at a 256-byte aligned address
  FCE_TRY(launch_ce_denominators(fn, opt, N, p.vocab_total, p.targets, denoms, stream));
  if (p.bias) FCE_TRY(launch_convert(fn, p.bias, dtype, bias_ws, dtype, Vs, stream));

  // ---- the row statistics (M, log S, t) from the gathered shards (flags: out of range, tiling)
  VpCombineArgs c{};
  c.fn = fn;
  c.opt = opt;
  c.ranks = p.ranks;
  c.rows = N;
  c.vocab_total = p.vocab_total;
  c.targets = p.targets;
  c.gathered = p.gathered;
  c.stats_out = stats;
  c.error_flags = p.error_flags;
  FCE_TRY(launch_vp_combine(c, stream));

  // ---- fce_linear_ce's vocab-sliced gradient pass over the shard's columns
  linear::SlicePass sp{};
  sp.fn = fn;
  sp.opt = opt;
  sp.rows = N;
  sp.hidden = D;
  sp.hidden_row_stride = p.hidden_row_stride;
  sp.cols = Vs;
  sp.col_offset = p.vocab_start;
  sp.vocab_total = p.vocab_total;
  sp.hidden_states = p.hidden_states;
  sp.weight = p.weight;
  sp.bias = bias_ws;
  sp.targets = p.targets;
  sp.q_row_stride = opt.soft_targets ? Vs : 0;  // this rank's shard of q [N, Vs]
  sp.denoms = denoms;
  sp.grad_output = p.grad_output;
  sp.stats = stats;
  sp.z = base + L.z;
  sp.slice_cols = plan.slice_cols;
  sp.slices = plan.slices;
  sp.lt_ws = base + L.lt;
  sp.lt_bytes = plan.lt_bytes;
  sp.grad_weight = p.grad_weight;
  sp.grad_weight_dtype = grad_w_dtype;
  sp.accumulate = p.accumulate;
  sp.dh = dh;
  sp.db = p.grad_bias;  // each slice's columns complete: straight into grad_bias
  sp.db_dtype = grad_w_dtype;
  sp.db_add_old = p.accumulate;
  const NanRows fix{fn, stats, dtype, opt.vp_entropy};
  sp.fix_dz = nan_rows;
  sp.fix_ctx = &fix;
  sp.grad_lse = p.grad_lse;
  sp.grad_entropy = p.grad_entropy;
  FCE_TRY(linear::slice_pass(sp, stream));

  // ---- a 16-bit grad_hidden out of its float32 accumulator (one rounding)
  if (p.grad_hidden && s.dh32)
    FCE_TRY(launch_store_accumulator(fn, dh, p.grad_hidden, p.grad_hidden_dtype, N * D, false,
                                     stream));
  return FCE_SUCCESS;
}

}  // namespace
}  // namespace cuda

fce_status cuda_vp_linear(const VpLinearProblem& p) {
  const int dtype = p.opt.dtype;
  if (dtype != FCE_FLOAT32 && dtype != FCE_FLOAT16 && dtype != FCE_BFLOAT16)
    return fail(FCE_ERROR_INTERNAL, "%s: dtype %d reached the CUDA backend", p.fn, dtype);
  return p.backward ? cuda::vp_linear_backward(p) : cuda::vp_linear_stats(p);
}

}  // namespace fce
