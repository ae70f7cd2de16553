// linear_distill.cpp — fce_linear_distill on the CPU, linear_ce.cpp's way: one chunk of token
// rows at a time, the student's z = h·Wᵀ and the teacher's z' = h'·W'ᵀ in float32 by
// cblas_sgemm (linear_chunks.h), distill_row.h on the chunk (the student's gradient over its
// logits, in place), then ∂h = ∂z·W and ∂W (+)= ∂zᵀ·h accumulated in float32. The chunk's rows
// depend on the sizes only, so every workspace of at least min_bytes gives the same result bit
// for bit; its buffers live in the workspace when it holds optimal_bytes, else in host memory.
#include <new>
#include <vector>

#include "cpu/blas.h"
#include "distill_row.h"
#include "distill_chunks.h"

namespace fce {

using namespace cpu;

void cpu_linear_distill_workspace_size(const DistillOptions& opt, int64_t rows, int64_t hidden,
                                       int64_t teacher_hidden, int64_t vocab, bool with_grad,
                                       size_t* min_bytes, size_t* optimal_bytes) {
  distill_chunk_sizes(opt.dtype, rows, hidden, teacher_hidden, vocab, with_grad, min_bytes,
                      optimal_bytes);
}

fce_status cpu_linear_distill(const LinearDistillProblem& p) {
  const int64_t R = chunk_rows(p.rows, p.vocab);
  FCE_TRY(check_blas_sizes(p.fn, "vocab", p.vocab, p.hidden, p.hidden_row_stride,
                           p.teacher_hidden_row_stride));
  const int dtype = p.opt.dtype;
  const bool with_grad = p.with_grad();
  try {
    // Everything is allocated before any output is written.
    const DistillSetup d = make_distill_setup(p.opt, p.rows, p.vocab, p.targets, p.grad_output);
    DistillScratch scratch(p.vocab, R);
    std::vector<double> losses(size_t(p.rows), 0.0);
    const DistillInputs in = distill_inputs(p, p.vocab);
    DistillBuffers chunk(distill_layout(dtype, R, p.hidden, p.teacher_hidden, p.vocab, with_grad),
                         p.workspace, p.workspace_bytes);
    WeightGrads weight_grads(p.grad_weight_fp32 ? FCE_FLOAT32 : dtype, p.grad_weight, nullptr,
                             p.accumulate, p.vocab, p.hidden);

    for (int64_t r0 = 0; r0 < p.rows; r0 += R) {
      const int64_t count = std::min(R, p.rows - r0);
      int64_t ldh = 0;
      const float* h = distill_logits(in, r0, count, chunk, &ldh);

      DistillRows job;
      job.first = r0;
      job.count = count;
      job.student = chunk.logits;
      job.student_stride = p.vocab;
      job.teacher = chunk.teacher_logits;
      job.teacher_stride = p.vocab;
      job.dtype = FCE_FLOAT32;
      job.grad = with_grad ? chunk.logits : nullptr;  // ∂z over z, in place
      job.grad_stride = p.vocab;
      job.grad_dtype = FCE_FLOAT32;
      job.losses = &losses;
      job.lse = p.lse;
      run_distill_rows(d, job, scratch);
      if (!with_grad) continue;

      if (p.grad_hidden)
        grad_hidden_chunk(dtype, p.grad_hidden, chunk.logits, in.W, r0, count, p.hidden, p.vocab,
                          chunk.grad_hidden);
      weight_grads.add(chunk.logits, h, ldh, count);
    }

    weight_grads.store();
    write_distill_loss(d, losses, p.loss);
    return FCE_SUCCESS;
  } catch (const std::bad_alloc&) {
    return fail(FCE_ERROR_OUT_OF_MEMORY,
                "%s (CPU): out of host memory (rows %lld, hidden %lld, vocab %lld)", p.fn,
                (long long)p.rows, (long long)p.hidden, (long long)p.vocab);
  }
}

}  // namespace fce
