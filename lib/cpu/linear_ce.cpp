// linear_ce.cpp — fused linear + cross-entropy on the CPU: z = h·Wᵀ + b, one chunk of token rows
// at a time (the N×V logits exist whole only when N fits one chunk), then ce_row.h's row-by-row
// cross-entropy on the chunk, then the gradients (docs/semantics.md rule 13): ∂h = ∂z·W, ∂W (+)= ∂zᵀ·h
// accumulated in float32, ∂b (+)= Σ_r ∂z_r. The GEMMs are OpenBLAS cblas_sgemm in float32: float32 inputs are used as
// they are; float16/bfloat16 ones are widened (W and b once per call, in host memory; h chunk by
// chunk); the per-row cross-entropy is ce_row.h's (float32 vectorised, sums in double).
//
// Under options->batch_invariant the logits and ∂h come from linear_chunks.h's per-row products
// in a fixed order instead of BLAS (docs/semantics.md rule 21); ∂W stays a GEMM.
// The chunk has a fixed number of rows that depends on the problem sizes only, never on the
// workspace, so every workspace of at least min_bytes gives bit for bit the same result (BLAS
// results depend on the shapes they are called with, ∂W on how its sum over rows is split). The
// chunk's buffers live in the workspace when it holds optimal_bytes, else in host memory.
#include <climits>
#include <new>
#include <vector>

#include "ce_row.h"
#include "cpu/blas.h"
#include "linear_chunks.h"

namespace fce {
namespace {

using namespace cpu;

}  // namespace

void cpu_linear_ce_workspace_size(const CeOptions& opt, int64_t rows, int64_t hidden, int64_t vocab,
                                  bool with_grad, bool /*grad_weight_fp32*/, size_t* min_bytes,
                                  size_t* optimal_bytes) {
  const ChunkLayout one_row = chunk_layout(opt.dtype, 1, hidden, vocab, with_grad && opt.dtype != FCE_FLOAT32);
  const ChunkLayout chunk =
      chunk_layout(opt.dtype, chunk_rows(rows, vocab), hidden, vocab,
                   with_grad && opt.dtype != FCE_FLOAT32);
  if (min_bytes) *min_bytes = one_row.total();
  if (optimal_bytes) *optimal_bytes = chunk.total();
}

fce_status cpu_linear_ce(const LinearCeProblem& p) {
  const int64_t R = chunk_rows(p.rows, p.vocab);
  if (p.vocab > INT_MAX || p.hidden > INT_MAX || p.hidden_row_stride > INT_MAX)
    return fail(FCE_ERROR_UNSUPPORTED,
                "%s (CPU): BLAS takes int sizes: vocab %lld, hidden %lld, "
                "hidden_row_stride %lld must be at most %d",
                p.fn, (long long)p.vocab, (long long)p.hidden, (long long)p.hidden_row_stride,
                INT_MAX);
  const int dtype = p.opt.dtype;
  const int grad_weight_dtype = p.grad_weight_fp32 ? FCE_FLOAT32 : dtype;
  const bool with_grad = p.with_grad();
  try {
    // Everything is allocated before any output is written.
    const CeSetup setup = make_setup(p.opt, p.rows, p.vocab, p.targets, p.grad_output,
                                     p.entropy != nullptr, p.grad_lse, p.grad_entropy);
    RowScratch scratch(setup, R);
    RowResults results(p.rows, p.accuracy != nullptr);
    const FloatMatrix W = as_float(dtype, p.weight, p.vocab, p.hidden);
    const FloatMatrix b = p.bias ? as_float(dtype, p.bias, 1, p.vocab) : FloatMatrix();
    ChunkBuffers chunk(chunk_layout(dtype, R, p.hidden, p.vocab, with_grad && dtype != FCE_FLOAT32), p.workspace,
                       p.workspace_bytes);
    WeightGrads weight_grads(grad_weight_dtype, p.grad_weight, p.grad_bias, p.accumulate, p.vocab,
                             p.hidden);

    bool invalid_seen = false;
    for (int64_t r0 = 0; r0 < p.rows; r0 += R) {
      const int64_t count = std::min(R, p.rows - r0);
      int64_t ldh = 0;
      const float* h = hidden_chunk(dtype, p.hidden_states, p.hidden_row_stride, p.hidden, r0, count,
                                    chunk.hidden, &ldh);
      if (p.opt.batch_invariant)
        logits_rows_fixed(h, ldh, W, b.data(), count, p.hidden, p.vocab, chunk.logits);
      else
        logits_chunk(h, ldh, W, b.data(), count, p.hidden, p.vocab, chunk.logits);

      RowsJob job;
      job.first_row = r0;
      job.count = count;
      job.logits = chunk.logits;
      job.logits_stride = p.vocab;
      job.logits_dtype = FCE_FLOAT32;
      job.grad = with_grad ? chunk.logits : nullptr;  // ∂z over z, in place
      job.grad_stride = p.vocab;
      job.grad_dtype = FCE_FLOAT32;
      job.lse_in = nullptr;
      job.lse_out = p.lse;
      job.entropy_out = p.entropy;
      job.argmax = p.argmax;
      job.results = &results;
      invalid_seen |= run_rows(setup, job, scratch);
      if (!with_grad) continue;

      const float* dz = chunk.logits;
      if (p.grad_hidden && p.opt.batch_invariant)
        grad_hidden_rows_fixed(dtype, p.grad_hidden, dz, W, r0, count, p.hidden, p.vocab,
                               chunk.grad_hidden);
      else if (p.grad_hidden)
        grad_hidden_chunk(dtype, p.grad_hidden, dz, W, r0, count, p.hidden, p.vocab,
                          chunk.grad_hidden);
      weight_grads.add(dz, h, ldh, count);
    }

    weight_grads.store();
    write_reduction(setup, results, p.loss, p.z_loss, p.accuracy);
    if (invalid_seen && p.error_flags) *p.error_flags |= FCE_FLAG_TARGET_OUT_OF_RANGE;
    return FCE_SUCCESS;
  } catch (const std::bad_alloc&) {
    return fail(FCE_ERROR_OUT_OF_MEMORY,
                "%s (CPU): out of host memory (rows %lld, hidden %lld, vocab %lld)", p.fn,
                (long long)p.rows, (long long)p.hidden, (long long)p.vocab);
  }
}

}  // namespace fce
