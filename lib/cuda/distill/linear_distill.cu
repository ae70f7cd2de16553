// distill/linear_distill.cu — fce_linear_distill on the CUDA backend (docs/semantics.md rule
// 19), fce_linear_ce's token-chunk plan for two logits: per chunk of rows, the student's
// Z_c = h_c · Wᵀ and the teacher's Z'_c = h'_c · W'ᵀ into the workspace (linear/plan.cuh's
// logits_gemm, dtype, float32 accumulation), the distillation row kernel writing ∂Z_c in place
// over Z_c, then ∂h_c and ∂W (+)= by linear/plan.cuh's chunk_grads, as fce_linear_ce does. A
// 16-bit grad_weight follows fce_linear_ce's chunk rule (linear::max_chunks16); where that
// would take fce_linear_ce's vocabulary-sliced plan, the call is refused. No allocation, no
// host synchronisation, graph-capturable.
#include <algorithm>

#include "cuda/distill/kernels.cuh"
#include "cuda/linear/plan.cuh"

namespace fce {
namespace {

using cuda::linear::kAlign;

constexpr int64_t kMinRows = 16;  // the smallest chunk (a few MiB at large vocabularies)

struct Plan {
  int64_t chunk_rows = 0, chunks = 0;
  size_t lt_bytes = 0, z_bytes = 0, head = 0, total = 0;
};

size_t z_bytes_of(int64_t rows, int64_t vocab, size_t elem) {
  const int64_t pad = cuda::linear::kVocabPad;
  const size_t vp = size_t((vocab + pad - 1) / pad * pad);
  return sat_round_up(sat_mul(sat_mul(size_t(rows), vp), elem), kAlign);
}

Plan plan_of(const DistillOptions& opt, int64_t rows, int64_t vocab, int64_t chunk_rows,
             size_t lt_bytes) {
  Plan p;
  p.chunk_rows = chunk_rows;
  p.chunks = (rows + chunk_rows - 1) / chunk_rows;
  p.lt_bytes = lt_bytes;
  p.z_bytes = z_bytes_of(chunk_rows, vocab, dtype_size(opt.dtype));
  p.head = cuda::distill::head_bytes(rows, opt.reduction);
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

// The plan in workspace_bytes: the largest chunk (up to the full-speed one) with the largest
// cuBLASLt workspace that fits; false when even the smallest does not.
bool choose(const DistillOptions& opt, int64_t rows, int64_t vocab, size_t workspace_bytes,
            Plan* out) {
  const size_t elem = dtype_size(opt.dtype);
  const int64_t full = full_rows(rows, vocab, elem), least = std::min(rows, kMinRows);
  for (size_t lt : cuda::linear::kLtWorkspaceSizes) {
    const Plan base = plan_of(opt, rows, vocab, least, lt);
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

}  // namespace

void cuda_linear_distill_workspace_size(const DistillOptions& opt, int64_t rows, int64_t, int64_t,
                                        int64_t vocab, bool, bool, size_t* min_bytes,
                                        size_t* optimal_bytes) {
  const int64_t least = std::min(rows, kMinRows);
  *min_bytes = plan_of(opt, rows, vocab, least, cuda::linear::kLtWorkspaceMin).total;
  *optimal_bytes = plan_of(opt, rows, vocab, full_rows(rows, vocab, dtype_size(opt.dtype)),
                           cuda::linear::kLtWorkspaceFull)
                       .total;
}

fce_status cuda_linear_distill(const LinearDistillProblem& p) {
  using namespace cuda::distill;
  const char* fn = p.fn;
  const int64_t N = p.rows, V = p.vocab, D = p.hidden, Dt = p.teacher_hidden;
  const int dtype = p.opt.dtype;
  const size_t e = dtype_size(dtype);
  Plan plan;
  if (!choose(p.opt, N, V, p.workspace_bytes, &plan))
    return fail(FCE_ERROR_WORKSPACE_TOO_SMALL, "%s: workspace_bytes (%zu) is too small", fn,
                p.workspace_bytes);
  const bool dw16 = p.grad_weight && !p.grad_weight_fp32 && dtype != FCE_FLOAT32;
  const int64_t k16 = cuda::linear::max_chunks16(N, V);
  if (dw16 && plan.chunks > k16) {
    const int64_t need_rows = (N + k16 - 1) / k16;
    const Plan need = plan_of(p.opt, N, V, need_rows, cuda::linear::kLtWorkspaceFull);
    if (need_rows <= full_rows(N, V, e) || need.total <= cuda::linear::kChunkBudget * 2)
      return fail(FCE_ERROR_UNSUPPORTED,
                  "%s: a 16-bit grad_weight over %lld token chunks (at most %lld for these "
                  "sizes) would need fce_linear_ce's vocabulary-sliced plan, which the "
                  "distillation does not have: give at least %zu bytes of workspace (the "
                  "query's optimal_bytes is %zu), or set options->grad_weight_fp32",
                  fn, (long long)plan.chunks, (long long)k16, need.total,
                  plan_of(p.opt, N, V, full_rows(N, V, e), cuda::linear::kLtWorkspaceFull).total);
    return fail(FCE_ERROR_UNSUPPORTED,
                "%s: a 16-bit grad_weight over %lld rows of %lld classes needs more than %lld "
                "token chunks (fce_linear_ce's vocabulary-sliced plan, which the distillation "
                "does not have): set options->grad_weight_fp32",
                fn, (long long)N, (long long)V, (long long)k16);
  }
  cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  char* base = cuda::linear::aligned_base(p.workspace);
  const Head h = head_at(base, N, p.opt.reduction);
  char* lt = base + plan.head;
  char* zs = lt + plan.lt_bytes;
  char* zt = zs + plan.z_bytes;
  const int64_t pad = cuda::linear::kVocabPad;
  const int64_t ldz = (V + pad - 1) / pad * pad;  // rows of Z_c padded as fce_linear_ce's
  const bool none = p.opt.reduction == FCE_REDUCTION_NONE;
  const bool with_grad = p.with_grad();
  FCE_TRY(launch_count(fn, p.opt, N, p.targets, h.n, s));
  for (int64_t c = 0; c < plan.chunks; ++c) {
    const int64_t r0 = c * plan.chunk_rows, rc = std::min(plan.chunk_rows, N - r0);
    const void* h_c =
        static_cast<const char*>(p.hidden_states) + size_t(r0) * p.hidden_row_stride * e;
    const void* ht_c = static_cast<const char*>(p.teacher_hidden_states) +
                       size_t(r0) * p.teacher_hidden_row_stride * e;
    FCE_TRY(cuda::linear::logits_gemm(fn, dtype, rc, V, D, h_c, p.hidden_row_stride, p.weight,
                                      nullptr, zs, ldz, lt, plan.lt_bytes, s));
    FCE_TRY(cuda::linear::logits_gemm(fn, dtype, rc, V, Dt, ht_c, p.teacher_hidden_row_stride,
                                      p.teacher_weight, nullptr, zt, ldz, lt, plan.lt_bytes, s));
    // ∂Z_c over Z_c, in place
    const RowsArgs a = rows_args(p, h, r0, rc, zs, ldz, zt, ldz, with_grad ? zs : nullptr, ldz);
    FCE_TRY(launch_rows(a, s));
    if (!with_grad) continue;
    cuda::linear::ChunkGrads g{};
    g.fn = fn;
    g.dtype = dtype;
    g.rc = rc;
    g.cols = V;
    g.hidden = D;
    g.dz = zs;
    g.ldz = ldz;
    g.h_c = h_c;
    g.hs = p.hidden_row_stride;
    g.weight = p.weight;
    g.grad_hidden =
        p.grad_hidden ? static_cast<char*>(p.grad_hidden) + size_t(r0) * size_t(D) * e : nullptr;
    g.grad_hidden_dtype = dtype;
    g.grad_weight = p.grad_weight;
    g.grad_weight_dtype = p.grad_weight_fp32 ? FCE_FLOAT32 : dtype;
    g.first = c == 0;
    g.accumulate = p.accumulate;
    g.lt_ws = lt;
    g.lt_bytes = plan.lt_bytes;
    FCE_TRY(cuda::linear::chunk_grads(g, s));
  }
  if (none) return FCE_SUCCESS;
  return launch_reduce(fn, p.opt.reduction, N, h.row_loss, h.n, p.loss, s);
}

}  // namespace fce
