// vocab_parallel/linear_ce.cu — fce_vp_linear_ce's token-chunk plan on CUDA: the
// vocabulary-parallel fused linear + CE (docs/semantics.md rules 13, 16) with the logits of this
// rank's shard made ONCE (6·N·D·V_s FLOPs), the all-gather of each chunk's statistics issued
// through the caller's function between the chunk's statistics and its gradient. Why it is
// fast: fce_linear_ce's token-chunk steps on the shard with 32 bytes per row and rank gathered
// in between, where the two-phase calls make the logits twice (8·N·D·V_s).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/ce/rows.cuh"
#include "cuda/linear/chunk_args.cuh"
#include "cuda/linear/kernels.cuh"
#include "cuda/linear/plan.cuh"
#include "cuda/vocab_parallel/kernels.cuh"
#include "cuda/vocab_parallel/linear_plan.cuh"
#include "internal.h"

// fce_linear_ce's token-chunk plans (linear/linear_ce.cu), planned for a shard ⌈vocab_total / ranks⌉
// wide so that every rank takes the same chunks (vocab_parallel/linear_plan.cu: fused_plan). Per chunk c of
// rc rows [r0, r0 + rc):
//   1. Z_c = h_c·W_sᵀ + b_s          logits_gemm (dtype, float32 accumulation), as fce_linear_ce
//   2. this rank's statistics        launch_vp_stats on Z_c into own[r0 : r0 + rc] (phase 1)
//   3. all_gather(own[r0 ..], gathered_c [ranks, rc, FCE_VP_STATS], rc·FCE_VP_STATS)
//   4. the combination               launch_vp_combine on gathered_c for rows [r0, r0 + rc): the
//                                    row statistics (M, log S, t), row losses, lse, argmax, flags
//   5. ∂Z_c in place                 launch_ce_rows backward on the column slice [vocab_start,
//                                    vocab_start + V_s) of vocab_total (then NaN rows of an
//                                    inconsistent tiling), exactly fce_vp_backward's gradient
//   6. ∂h_c = ∂Z_c·W_s               this rank's partial ∂h rows, straight into grad_hidden (of
//                                    grad_hidden_dtype; K = V_s, no accumulation across chunks)
//   7. ∂W_s (+)= ∂Z_cᵀ·h_c, ∂b_s     as fce_linear_ce's kChunked / kChunked16 (16-bit: in place,
//                                    at most max_chunks16 chunks; float32: the caller's)
// then the fixed-order loss reduction (launch_ce_finalize) over the row losses: the same
// per-row values and the same reduction as fce_vp_loss on the same statistics.
// One stream (the collective is the caller's, on that stream), no allocation, no host
// synchronisation: graph-capturable when the caller's all-gather is. The ABI layer has checked
// every argument, the device pointers included, and chosen this plan (cuda_vp_linear_ce_chunked).

namespace fce {

bool cuda_vp_linear_ce_chunked(const CeOptions& opt, int64_t ranks, int64_t rows, int64_t hidden,
                               int64_t vocab_total, int64_t width, bool need_dw, bool dw_fp32,
                               size_t workspace_bytes, size_t* threshold, size_t* need) {
  const int64_t plan_width = (vocab_total + ranks - 1) / ranks;
  cuda::vp_plan::FusedPlan fp;
  const bool ok = cuda::vp_plan::fused_plan(opt, ranks, rows, hidden, plan_width, width, need_dw,
                                            dw_fp32, workspace_bytes, &fp);
  *threshold = fp.threshold;
  *need = ok ? fp.total : SIZE_MAX;
  return ok;
}

fce_status cuda_vp_linear_ce(const VpLinearCeProblem& P) {
  using namespace cuda;
  using namespace cuda::linear;
  const VpLinearProblem& p = P.lin;
  const char* fn = p.fn;
  const CeOptions& opt = p.opt;
  const int dtype = opt.dtype;
  if (dtype != FCE_FLOAT32 && dtype != FCE_FLOAT16 && dtype != FCE_BFLOAT16)
    return fail(FCE_ERROR_INTERNAL, "%s: dtype %d reached the CUDA backend", fn, dtype);
  const int64_t N = p.rows, D = p.hidden, Vs = p.vocab_local, hs = p.hidden_row_stride;
  const int64_t P_ = p.ranks;
  const bool dw_fp32 = p.grad_weight_fp32 || dtype == FCE_FLOAT32;
  const int grad_w_dtype = dw_fp32 ? FCE_FLOAT32 : dtype;
  const size_t e = dtype_size(dtype);

  // ---- everything that can fail before any work is enqueued
  vp_plan::FusedPlan fp;
  if (!vp_plan::fused_plan(opt, P_, N, D, (p.vocab_total + P_ - 1) / P_, Vs,
                           p.grad_weight != nullptr, dw_fp32, p.workspace_bytes, &fp))
    return fail(FCE_ERROR_INTERNAL, "%s: the token-chunk plan does not apply", fn);
  if (fp.total > p.workspace_bytes)
    return fail(FCE_ERROR_WORKSPACE_TOO_SMALL,
                "%s: workspace_bytes (%zu) is too small for this rank's shard (vocab_local %lld, "
                "wider than vocab_total / ranks): the token-chunk plan every rank takes at this "
                "size needs %zu bytes here",
                fn, p.workspace_bytes, static_cast<long long>(Vs), fp.total);
  if (!p.workspace)
    return fail(FCE_ERROR_NULL_POINTER, "%s: workspace is NULL (%zu bytes needed)", fn, fp.total);
  if (p.grad_hidden_dtype != FCE_FLOAT32 && p.grad_hidden_dtype != dtype)
    return fail(FCE_ERROR_INTERNAL, "%s: grad_hidden_dtype %d reached the CUDA backend", fn,
                p.grad_hidden_dtype);

  // ---- carve the workspace
  const Plan& plan = fp.lin;
  char* base = aligned_base(p.workspace);
  float* own = reinterpret_cast<float*>(base + fp.own);            // [N, 8]
  float* gathered = reinterpret_cast<float*>(base + fp.gathered);  // per chunk [P, rc, 8]
  CeRowStats* rowstats = reinterpret_cast<CeRowStats*>(base + fp.rowstats);
  // fce_linear_ce's slices, after those three
  const ChunkSlices cs = chunk_slices(plan.layout, base + fp.lin_at, opt, P.loss,
                                      P.z_loss != nullptr, P.accuracy, p.bias != nullptr);
  const bool none = opt.reduction == FCE_REDUCTION_NONE;
  const int64_t ldz = (Vs + kVocabPad - 1) / kVocabPad * kVocabPad;
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const char* hidden = static_cast<const char*>(p.hidden_states);

  // ---- D, Ω, n of the whole problem; the bias in dtype at a 256-byte aligned address; the
  // class-weighted W_r of every row (the same bits in each)
  FCE_TRY(launch_ce_denominators(fn, opt, N, p.vocab_total, p.targets, cs.denoms, stream));
  if (p.bias) FCE_TRY(launch_convert(fn, p.bias, dtype, cs.bias, dtype, Vs, stream));
  if (opt.class_weights)
    FCE_TRY(launch_vp_weights(fn, opt, N, p.vocab_start, Vs, own, stream));

  for (int64_t c = 0; c < plan.chunks; ++c) {
    const int64_t r0 = c * plan.chunk_rows;
    const int64_t rc = std::min(plan.chunk_rows, N - r0);
    const void* h_c = hidden + static_cast<size_t>(r0) * static_cast<size_t>(hs) * e;
    float* send = own + r0 * FCE_VP_STATS;
    float* recv = gathered + r0 * P_ * FCE_VP_STATS;

    // 1. Z_c[rc, Vs] = h_c · W_sᵀ + b_s
    FCE_TRY(logits_gemm(fn, dtype, rc, Vs, D, h_c, hs, p.weight, cs.bias, cs.z, ldz, cs.lt,
                        plan.lt_bytes, stream));

    // 2. this rank's statistics of the chunk's rows
    FCE_TRY(launch_vp_stats(vp_chunk_stats_args(fn, opt, r0, rc, cs.z, ldz, p.vocab_total,
                                                p.vocab_start, Vs, p.targets, own),
                            stream));

    // 3. the caller's all-gather of the chunk's statistics
    const fce_status st = P.all_gather(P.context, send, recv, rc * FCE_VP_STATS, p.stream);
    if (st != FCE_SUCCESS)
      return fail(st, "%s: all_gather returned %s (token chunk [%lld, %lld) of %lld rows)", fn,
                  fce_status_string(st), static_cast<long long>(r0),
                  static_cast<long long>(r0 + rc), static_cast<long long>(N));

    // 4. the combination of the chunk's rows
    VpCombineArgs cb{};
    cb.fn = fn;
    cb.opt = opt;
    cb.ranks = P_;
    cb.rows = rc;
    cb.row_begin = r0;
    cb.vocab_total = p.vocab_total;
    cb.targets = p.targets;
    cb.gathered = recv;
    cb.stats_out = rowstats;
    cb.row_loss = cs.row_loss;
    cb.row_zloss = cs.row_zloss;
    cb.lse = P.lse;
    cb.argmax = P.argmax;
    cb.row_correct = cs.row_correct;
    cb.error_flags = p.error_flags;
    cb.entropy = P.entropy;
    FCE_TRY(launch_vp_combine(cb, stream));

    // 5. ∂Z_c in place: the backward row kernel on the shard's column slice (rule 18's terms)
    CeRowsArgs ra = slice_backward_args(fn, opt, N, r0, rc, p.vocab_total, p.vocab_start, Vs,
                                        cs.z, ldz, p.targets, cs.denoms, p.grad_output, rowstats);
    ra.grad_lse = p.grad_lse;
    ra.grad_entropy = p.grad_entropy;
    FCE_TRY(launch_ce_rows(ra, stream));
    FCE_TRY(launch_vp_nan_rows(fn, rowstats + r0, rc, cs.z, dtype, Vs, ldz, stream,
                               opt.vp_entropy));

    // 6-7. this rank's ∂h_c = ∂Z_c · W_s (grad_hidden_dtype), ∂W_s (+)= ∂Z_cᵀ · h_c, ∂b_s:
    // fce_linear_ce's very steps 3-5 (chunk_grads)
    FCE_TRY(chunk_grads(chunk_grads_args(p, dtype, p.grad_hidden_dtype, grad_w_dtype, Vs, cs, ldz,
                                         plan.lt_bytes, r0, rc),
                        stream));
  }

  // ---- a 16-bit ∂b out of its float32 accumulator (one rounding, + the old value)
  if (p.grad_bias && !dw_fp32)
    FCE_TRY(launch_store_accumulator(fn, cs.db32, p.grad_bias, grad_w_dtype, Vs, p.accumulate,
                                     stream));

  // ---- the reduced loss, z-loss and accuracy, fixed order (none: the rows are the outputs)
  return launch_ce_finalize(fn, opt, N, cs.row_loss, cs.row_zloss, cs.row_correct, cs.denoms,
                            none ? nullptr : P.loss, P.z_loss, none ? nullptr : P.accuracy,
                            stream);
}

}  // namespace fce
