// distill/linear_distill.cu — fce_linear_distill on the CUDA backend (docs/semantics.md rule
// 19), fce_linear_ce's token-chunk plan for two logits: per chunk of rows, the student's
// Z_c = h_c · Wᵀ and the teacher's Z'_c = h'_c · W'ᵀ into the workspace (linear/plan.cuh's
// logits_gemm, dtype, float32 accumulation), the distillation row kernel writing ∂Z_c in place
// over Z_c, then ∂h_c and ∂W (+)= by linear/plan.cuh's chunk_grads, as fce_linear_ce does. A
// 16-bit grad_weight follows fce_linear_ce's chunk rule (linear::max_chunks16); where that
// would take fce_linear_ce's vocabulary-sliced plan, the call is refused. The plan and a
// chunk's GEMMs are distill/linear_plan.cuh's, fce_vp_linear_distill_*'s too. No allocation, no
// host synchronisation, graph-capturable.
#include <algorithm>

#include "cuda/distill/kernels.cuh"
#include "cuda/distill/linear_plan.cuh"
#include "cuda/linear/plan.cuh"

namespace fce {
namespace cuda {
namespace distill {
namespace {

using cuda::linear::kAlign;

constexpr int64_t kMinRows = 16;  // the smallest chunk (a few MiB at large vocabularies)

size_t z_bytes_of(int64_t rows, int64_t vocab, size_t elem) {
  return sat_round_up(sat_mul(sat_mul(size_t(rows), size_t(linear_ldz(vocab))), elem), kAlign);
}

LinearPlan plan_of(const DistillOptions& opt, int64_t rows, int64_t vocab, int64_t chunk_rows,
                   size_t lt_bytes) {
  LinearPlan p;
  p.chunk_rows = chunk_rows;
  p.chunks = (rows + chunk_rows - 1) / chunk_rows;
  p.lt_bytes = lt_bytes;
  p.z_bytes = z_bytes_of(chunk_rows, vocab, dtype_size(opt.dtype));
  p.head = head_bytes(rows, opt.reduction);
  p.total = sat_add(sat_add(sat_add(p.head, lt_bytes), sat_mul(2, p.z_bytes)), kAlign);
  return p;
}

// The full-speed chunk: as many rows as two logits buffers within the chunk budget hold (at
// most kMaxChunkRows), balanced over the rows.
int64_t full_rows(int64_t rows, int64_t vocab, size_t elem) {
  const size_t per_row = 2 * z_bytes_of(1, vocab, elem);
  int64_t most = int64_t(std::max<size_t>(1, cuda::linear::kChunkBudget / per_row));
  most = std::min({most, rows, cuda::linear::kMaxChunkRows});
  return cuda::linear::balanced(rows, most,
                                most >= cuda::linear::kRowQuantum ? cuda::linear::kRowQuantum : 1);
}

}  // namespace

int64_t linear_ldz(int64_t vocab) {
  const int64_t pad = cuda::linear::kVocabPad;
  return (vocab + pad - 1) / pad * pad;  // rows of Z_c padded as fce_linear_ce's
}

void linear_plan_sizes(const DistillOptions& opt, int64_t rows, int64_t vocab, size_t* min_bytes,
                       size_t* optimal_bytes) {
  const int64_t least = std::min(rows, kMinRows);
  *min_bytes = plan_of(opt, rows, vocab, least, cuda::linear::kLtWorkspaceMin).total;
  *optimal_bytes = plan_of(opt, rows, vocab, full_rows(rows, vocab, dtype_size(opt.dtype)),
                           cuda::linear::kLtWorkspaceFull)
                       .total;
}

bool choose_linear_plan(const DistillOptions& opt, int64_t rows, int64_t vocab,
                        size_t workspace_bytes, LinearPlan* out) {
  const size_t elem = dtype_size(opt.dtype);
  const int64_t full = full_rows(rows, vocab, elem), least = std::min(rows, kMinRows);
  for (size_t lt : cuda::linear::kLtWorkspaceSizes) {
    const LinearPlan base = plan_of(opt, rows, vocab, least, lt);
    if (base.total > workspace_bytes) continue;
    const size_t per_row = 2 * z_bytes_of(1, vocab, elem) + 2 * kAlign;
    int64_t rc = least + int64_t((workspace_bytes - base.total) / per_row);
    rc = std::max(least, std::min(rc, full));
    while (rc > least && plan_of(opt, rows, vocab, rc, lt).total > workspace_bytes) --rc;
    rc = cuda::linear::balanced(rows, rc, 1);
    *out = plan_of(opt, rows, vocab, rc, lt);
    return out->total <= workspace_bytes;
  }
  return false;
}

fce_status check_linear_dw16(const char* fn, const DistillOptions& opt, int64_t rows, int64_t vocab,
                             const LinearPlan& plan, bool dw16) {
  const int64_t N = rows, V = vocab;
  const size_t e = dtype_size(opt.dtype);
  const int64_t k16 = cuda::linear::max_chunks16(N, V);
  if (!dw16 || plan.chunks <= k16) return FCE_SUCCESS;
  const int64_t need_rows = (N + k16 - 1) / k16;
  const LinearPlan need = plan_of(opt, N, V, need_rows, cuda::linear::kLtWorkspaceFull);
  if (need_rows <= full_rows(N, V, e) || need.total <= cuda::linear::kChunkBudget * 2)
    return fail(FCE_ERROR_UNSUPPORTED,
                "%s: a 16-bit grad_weight over %lld token chunks (at most %lld for these "
                "sizes) would need fce_linear_ce's vocabulary-sliced plan, which the "
                "distillation does not have: give at least %zu bytes of workspace (the "
                "query's optimal_bytes is %zu), or set options->grad_weight_fp32",
                fn, (long long)plan.chunks, (long long)k16, need.total,
                plan_of(opt, N, V, full_rows(N, V, e), cuda::linear::kLtWorkspaceFull).total);
  return fail(FCE_ERROR_UNSUPPORTED,
              "%s: a 16-bit grad_weight over %lld rows of %lld classes needs more than %lld "
              "token chunks (fce_linear_ce's vocabulary-sliced plan, which the distillation "
              "does not have): set options->grad_weight_fp32",
              fn, (long long)N, (long long)V, (long long)k16);
}

void set_chunk_buffers(LinearChunks* c, char* base, const LinearPlan& plan) {
  c->lt = base + plan.head;
  c->lt_bytes = plan.lt_bytes;
  c->zs = c->lt + plan.lt_bytes;
  c->zt = static_cast<char*>(c->zs) + plan.z_bytes;
  c->ldz = linear_ldz(c->vocab);
}

fce_status chunk_logits(const LinearChunks& c, int64_t r0, int64_t rc, cudaStream_t s) {
  const size_t e = dtype_size(c.dtype);
  const void* h_c =
      static_cast<const char*>(c.hidden_states) + size_t(r0) * size_t(c.hidden_row_stride) * e;
  const void* ht_c = static_cast<const char*>(c.teacher_hidden_states) +
                     size_t(r0) * size_t(c.teacher_hidden_row_stride) * e;
  FCE_TRY(cuda::linear::logits_gemm(c.fn, c.dtype, rc, c.vocab, c.hidden, h_c, c.hidden_row_stride,
                                    c.weight, nullptr, c.zs, c.ldz, c.lt, c.lt_bytes, s));
  return cuda::linear::logits_gemm(c.fn, c.dtype, rc, c.vocab, c.teacher_hidden, ht_c,
                                   c.teacher_hidden_row_stride, c.teacher_weight, nullptr, c.zt,
                                   c.ldz, c.lt, c.lt_bytes, s);
}

fce_status chunk_grads(const LinearChunks& c, int64_t r0, int64_t rc, bool first, cudaStream_t s) {
  const size_t e = dtype_size(c.dtype);
  cuda::linear::ChunkGrads g{};
  g.fn = c.fn;
  g.dtype = c.dtype;
  g.rc = rc;
  g.cols = c.vocab;
  g.hidden = c.hidden;
  g.dz = c.zs;
  g.ldz = c.ldz;
  g.h_c = static_cast<const char*>(c.hidden_states) + size_t(r0) * size_t(c.hidden_row_stride) * e;
  g.hs = c.hidden_row_stride;
  g.weight = c.weight;
  g.grad_hidden = c.grad_hidden
                      ? static_cast<char*>(c.grad_hidden) +
                            size_t(r0) * size_t(c.hidden) * dtype_size(c.grad_hidden_dtype)
                      : nullptr;
  g.grad_hidden_dtype = c.grad_hidden_dtype;
  g.grad_weight = c.grad_weight;
  g.grad_weight_dtype = c.grad_weight_dtype;
  g.first = first;
  g.accumulate = c.accumulate;
  g.lt_ws = c.lt;
  g.lt_bytes = c.lt_bytes;
  return cuda::linear::chunk_grads(g, s);
}

}  // namespace distill
}  // namespace cuda

void cuda_linear_distill_workspace_size(const DistillOptions& opt, int64_t rows, int64_t, int64_t,
                                        int64_t vocab, bool, bool, size_t* min_bytes,
                                        size_t* optimal_bytes) {
  cuda::distill::linear_plan_sizes(opt, rows, vocab, min_bytes, optimal_bytes);
}

fce_status cuda_linear_distill(const LinearDistillProblem& p) {
  using namespace cuda::distill;
  const char* fn = p.fn;
  const int64_t N = p.rows, V = p.vocab;
  LinearPlan plan;
  if (!choose_linear_plan(p.opt, N, V, p.workspace_bytes, &plan))
    return fail(FCE_ERROR_WORKSPACE_TOO_SMALL, "%s: workspace_bytes (%zu) is too small", fn,
                p.workspace_bytes);
  const bool dw16 = p.grad_weight && !p.grad_weight_fp32 && p.opt.dtype != FCE_FLOAT32;
  FCE_TRY(check_linear_dw16(fn, p.opt, N, V, plan, dw16));
  cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  char* base = cuda::linear::aligned_base(p.workspace);
  const Head h = head_at(base, N, p.opt.reduction);
  const LinearChunks lc = chunks_of(p, V, p.opt.dtype, base, plan);
  const bool none = p.opt.reduction == FCE_REDUCTION_NONE;
  const bool with_grad = p.with_grad();
  FCE_TRY(launch_count(fn, p.opt, N, p.targets, h.n, s));
  for (int64_t c = 0; c < plan.chunks; ++c) {
    const int64_t r0 = c * plan.chunk_rows, rc = std::min(plan.chunk_rows, N - r0);
    FCE_TRY(chunk_logits(lc, r0, rc, s));
    // ∂Z_c over Z_c, in place
    const RowsArgs a =
        rows_args(p, h, r0, rc, lc.zs, lc.ldz, lc.zt, lc.ldz, with_grad ? lc.zs : nullptr, lc.ldz);
    FCE_TRY(launch_rows(a, s));
    if (with_grad) FCE_TRY(chunk_grads(lc, r0, rc, c == 0, s));
  }
  if (none) return FCE_SUCCESS;
  return launch_reduce(fn, p.opt.reduction, N, h.row_loss, h.n, p.loss, s);
}

}  // namespace fce
