// vocab_parallel/linear_distill.cu — fce_vp_linear_distill_stats and
// fce_vp_linear_distill_backward on the CUDA backend (docs/semantics.md rule 22): fce_linear_distill's
// token chunks (distill/linear_plan.cuh) over this rank's weight shards W_s [vocab_local, hidden]
// and W'_s [vocab_local, teacher->hidden]. Per chunk of rows, the student's Z_c = h_c·W_sᵀ and the
// teacher's Z'_c = h'_c·W'_sᵀ in the dtype, then the vocabulary-parallel distillation's own row
// kernels (vocab_parallel/distill.cu) on the chunk's rows of the call: the statistics of the
// round, or ∂Z_c over Z_c followed by ∂h_c (this rank's partial, of grad_hidden_dtype) and
// ∂W_s (+)= ∂Z_cᵀ·h_c (chunk_grads). The workspace is fce_linear_distill's plan for the shard
// with the Head of reduction none (n, the backward's count of the rows that count, recounted
// per chunk: one small kernel over the targets). One stream, no allocation, no host
// synchronisation: graph-capturable.
#include <algorithm>

#include "cuda/distill/linear_plan.cuh"
#include "cuda/linear/plan.cuh"
#include "vp_distill.h"

namespace fce {
namespace {

// The plan's options: the Head holds n alone (no row losses: the loss is fce_vp_distill_loss's).
DistillOptions plan_options(const DistillOptions& opt) {
  DistillOptions o = opt;
  o.reduction = FCE_REDUCTION_NONE;
  return o;
}

}  // namespace

void cuda_vp_linear_distill_workspace_size(const DistillOptions& opt, int64_t rows, int64_t,
                                           int64_t, int64_t vocab_local, bool, size_t* min_bytes,
                                           size_t* optimal_bytes) {
  cuda::distill::linear_plan_sizes(plan_options(opt), rows, vocab_local, min_bytes, optimal_bytes);
}

fce_status cuda_vp_linear_distill(const VpLinearDistillProblem& p) {
  using namespace cuda::distill;
  const char* fn = p.fn;
  const int64_t N = p.rows, Vs = p.vocab_local;
  const int dtype = p.opt.dtype;
  const DistillOptions popt = plan_options(p.opt);
  LinearPlan plan;
  if (!choose_linear_plan(popt, N, Vs, p.workspace_bytes, &plan)) {
    size_t lo = 0, full = 0;
    linear_plan_sizes(popt, N, Vs, &lo, &full);
    return fail(FCE_ERROR_WORKSPACE_TOO_SMALL,
                "%s: workspace_bytes (%zu) is too small: the CUDA backend needs at least %zu bytes "
                "for these sizes (%zu for full speed)",
                fn, p.workspace_bytes, lo, full);
  }
  if (p.backward) {
    const bool dw16 = p.grad_weight && !p.grad_weight_fp32 && dtype != FCE_FLOAT32;
    FCE_TRY(check_linear_dw16(fn, popt, N, Vs, plan, dw16));
  }
  cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  char* base = cuda::linear::aligned_base(p.workspace);
  const LinearChunks lc = chunks_of(p, Vs, p.grad_hidden_dtype, base, plan);
  const bool with_grad = p.grad_hidden || p.grad_weight;
  for (int64_t c = 0; c < plan.chunks; ++c) {
    const int64_t r0 = c * plan.chunk_rows, rc = std::min(plan.chunk_rows, N - r0);
    FCE_TRY(chunk_logits(lc, r0, rc, s));
    if (!p.backward) {
      FCE_TRY(cuda_vp_distill_stats(vd_stats_chunk(p, p.opt, r0, rc, lc.zs, lc.zt, lc.ldz)));
      continue;
    }
    // ∂Z_c over Z_c; the workspace: the plan's Head (n)
    FCE_TRY(cuda_vp_distill(
        vd_backward_chunk(p, p.opt, r0, rc, lc.zs, lc.zt, lc.ldz, base, plan.head)));
    if (with_grad) FCE_TRY(chunk_grads(lc, r0, rc, c == 0, s));
  }
  return FCE_SUCCESS;
}

}  // namespace fce
