// linear_distill.cpp — fce_linear_distill on the CPU, linear_ce.cpp's way: one chunk of token
// rows at a time, the student's z = h·Wᵀ and the teacher's z' = h'·W'ᵀ in float32 by
// cblas_sgemm (linear_chunks.h), distill_row.h on the chunk (the student's gradient over its
// logits, in place), then ∂h = ∂z·W and ∂W (+)= ∂zᵀ·h accumulated in float32. The chunk's rows
// depend on the sizes only, so every workspace of at least min_bytes gives the same result bit
// for bit; its buffers live in the workspace when it holds optimal_bytes, else in host memory.
#include <climits>
#include <new>
#include <vector>

#include "cpu/blas.h"
#include "distill_row.h"
#include "linear_chunks.h"

namespace fce {
namespace {

using namespace cpu;

// The chunk's buffers: the student's (linear_chunks.h's layout), then the teacher's logits and,
// for a 16-bit dtype, its hidden rows as float32.
struct DistillLayout {
  ChunkLayout student;
  size_t teacher_logits, teacher_hidden;
  size_t total() const { return student.total() + teacher_logits + teacher_hidden; }
};

DistillLayout distill_layout(int dtype, int64_t rows, int64_t hidden, int64_t teacher_hidden,
                             int64_t vocab, bool with_grad) {
  DistillLayout l;
  l.student = chunk_layout(dtype, rows, hidden, vocab, with_grad && dtype != FCE_FLOAT32);
  l.teacher_logits = align16(size_t(rows) * size_t(vocab) * 4);
  l.teacher_hidden = dtype != FCE_FLOAT32 ? align16(size_t(rows) * size_t(teacher_hidden) * 4) : 0;
  return l;
}

struct DistillBuffers {
  float *logits, *hidden, *grad_hidden, *teacher_logits, *teacher_hidden;
  std::vector<float> host;
  DistillBuffers(const DistillLayout& l, void* workspace, size_t workspace_bytes) {
    char* base = static_cast<char*>(workspace);
    if (workspace_bytes < l.total()) {
      host.resize(l.total() / 4);
      base = reinterpret_cast<char*>(host.data());
    }
    logits = reinterpret_cast<float*>(base);
    hidden = reinterpret_cast<float*>(base + l.student.logits);
    grad_hidden = reinterpret_cast<float*>(base + l.student.logits + l.student.hidden);
    teacher_logits = reinterpret_cast<float*>(base + l.student.total());
    teacher_hidden = reinterpret_cast<float*>(base + l.student.total() + l.teacher_logits);
  }
};

}  // namespace

void cpu_linear_distill_workspace_size(const DistillOptions& opt, int64_t rows, int64_t hidden,
                                       int64_t teacher_hidden, int64_t vocab, bool with_grad,
                                       size_t* min_bytes, size_t* optimal_bytes) {
  const DistillLayout one = distill_layout(opt.dtype, 1, hidden, teacher_hidden, vocab, with_grad);
  const DistillLayout chunk =
      distill_layout(opt.dtype, chunk_rows(rows, vocab), hidden, teacher_hidden, vocab, with_grad);
  if (min_bytes) *min_bytes = one.total();
  if (optimal_bytes) *optimal_bytes = chunk.total();
}

fce_status cpu_linear_distill(const LinearDistillProblem& p) {
  const int64_t R = chunk_rows(p.rows, p.vocab);
  if (p.vocab > INT_MAX || p.hidden > INT_MAX || p.hidden_row_stride > INT_MAX ||
      p.teacher_hidden_row_stride > INT_MAX)
    return fail(FCE_ERROR_UNSUPPORTED,
                "%s (CPU): BLAS takes int sizes: vocab %lld, hidden %lld, "
                "hidden_row_stride %lld, teacher->hidden_row_stride %lld must be at most %d",
                p.fn, (long long)p.vocab, (long long)p.hidden, (long long)p.hidden_row_stride,
                (long long)p.teacher_hidden_row_stride, INT_MAX);
  const int dtype = p.opt.dtype;
  const bool with_grad = p.with_grad();
  try {
    // Everything is allocated before any output is written.
    const DistillSetup d = make_distill_setup(p.opt, p.rows, p.vocab, p.targets, p.grad_output);
    DistillScratch scratch(p.vocab, R);
    std::vector<double> losses(size_t(p.rows), 0.0);
    const FloatMatrix W = as_float(dtype, p.weight, p.vocab, p.hidden);
    const FloatMatrix Wt = as_float(dtype, p.teacher_weight, p.vocab, p.teacher_hidden);
    DistillBuffers chunk(distill_layout(dtype, R, p.hidden, p.teacher_hidden, p.vocab, with_grad),
                         p.workspace, p.workspace_bytes);
    WeightGrads weight_grads(p.grad_weight_fp32 ? FCE_FLOAT32 : dtype, p.grad_weight, nullptr,
                             p.accumulate, p.vocab, p.hidden);

    for (int64_t r0 = 0; r0 < p.rows; r0 += R) {
      const int64_t count = std::min(R, p.rows - r0);
      int64_t ldh = 0, ldt = 0;
      const float* h = hidden_chunk(dtype, p.hidden_states, p.hidden_row_stride, p.hidden, r0,
                                    count, chunk.hidden, &ldh);
      const float* ht = hidden_chunk(dtype, p.teacher_hidden_states, p.teacher_hidden_row_stride,
                                     p.teacher_hidden, r0, count, chunk.teacher_hidden, &ldt);
      logits_chunk(h, ldh, W, nullptr, count, p.hidden, p.vocab, chunk.logits);
      logits_chunk(ht, ldt, Wt, nullptr, count, p.teacher_hidden, p.vocab, chunk.teacher_logits);

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
        grad_hidden_chunk(dtype, p.grad_hidden, chunk.logits, W, r0, count, p.hidden, p.vocab,
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
