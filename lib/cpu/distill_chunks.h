// distill_chunks.h — the token chunks of the CPU's linear distillations (linear_distill.cpp,
// vp_linear_distill.cpp): linear_chunks.h's buffers of the student, then the teacher's logits
// and, for a 16-bit dtype, its hidden rows as float32. As there, the chunk's rows depend on the
// sizes only; its buffers live in the workspace when it holds them all, else in host memory.
#pragma once

#include <climits>
#include <cstdint>
#include <vector>

#include "linear_chunks.h"

namespace fce {
namespace cpu {

// The chunk's buffers: the student's (linear_chunks.h's layout), then the teacher's logits and,
// for a 16-bit dtype, its hidden rows as float32.
struct DistillLayout {
  ChunkLayout student;
  size_t teacher_logits, teacher_hidden;
  size_t total() const { return student.total() + teacher_logits + teacher_hidden; }
};

inline DistillLayout distill_layout(int dtype, int64_t rows, int64_t hidden, int64_t teacher_hidden,
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

// min_bytes: a chunk of one row; optimal_bytes: the chunk of chunk_rows (every row's buffers in
// the workspace).
inline void distill_chunk_sizes(int dtype, int64_t rows, int64_t hidden, int64_t teacher_hidden,
                                int64_t vocab, bool with_grad, size_t* min_bytes,
                                size_t* optimal_bytes) {
  const DistillLayout one = distill_layout(dtype, 1, hidden, teacher_hidden, vocab, with_grad);
  const DistillLayout chunk =
      distill_layout(dtype, chunk_rows(rows, vocab), hidden, teacher_hidden, vocab, with_grad);
  if (min_bytes) *min_bytes = one.total();
  if (optimal_bytes) *optimal_bytes = chunk.total();
}

// BLAS takes int sizes: FCE_ERROR_UNSUPPORTED naming the call (vocab_name: "vocab" or
// "vocab_local") when one does not fit.
inline fce_status check_blas_sizes(const char* fn, const char* vocab_name, int64_t vocab,
                                   int64_t hidden, int64_t hidden_row_stride,
                                   int64_t teacher_hidden_row_stride) {
  if (vocab <= INT_MAX && hidden <= INT_MAX && hidden_row_stride <= INT_MAX &&
      teacher_hidden_row_stride <= INT_MAX)
    return FCE_SUCCESS;
  return fail(FCE_ERROR_UNSUPPORTED,
              "%s (CPU): BLAS takes int sizes: %s %lld, hidden %lld, hidden_row_stride %lld, "
              "teacher->hidden_row_stride %lld must be at most %d",
              fn, vocab_name, (long long)vocab, (long long)hidden, (long long)hidden_row_stride,
              (long long)teacher_hidden_row_stride, INT_MAX);
}

// What a linear distillation's chunks are made from: both sides' hidden states (their dtype and
// strides) and weights (as float32, 16-bit ones widened once per call).
struct DistillInputs {
  int dtype;
  int64_t vocab, hidden, teacher_hidden;
  const void* hidden_states;
  int64_t hidden_row_stride;
  const void* teacher_hidden_states;
  int64_t teacher_hidden_row_stride;
  FloatMatrix W, Wt;  // [vocab, hidden], [vocab, teacher_hidden]
};

// The inputs of call p (a LinearDistillProblem, or a VpLinearDistillProblem over its shard of
// `vocab` classes).
template <class Problem>
DistillInputs distill_inputs(const Problem& p, int64_t vocab) {
  const int dtype = p.opt.dtype;
  return {dtype,
          vocab,
          p.hidden,
          p.teacher_hidden,
          p.hidden_states,
          p.hidden_row_stride,
          p.teacher_hidden_states,
          p.teacher_hidden_row_stride,
          as_float(dtype, p.weight, vocab, p.hidden),
          as_float(dtype, p.teacher_weight, vocab, p.teacher_hidden)};
}

// The student's and the teacher's logits of rows [r0, r0 + count) into chunk.logits and
// chunk.teacher_logits ([count, vocab] each); returns the student's hidden rows as float32, *ldh
// apart (for ∂W).
inline const float* distill_logits(const DistillInputs& in, int64_t r0, int64_t count,
                                   const DistillBuffers& chunk, int64_t* ldh) {
  int64_t ldt = 0;
  const float* h = hidden_chunk(in.dtype, in.hidden_states, in.hidden_row_stride, in.hidden, r0,
                                count, chunk.hidden, ldh);
  const float* ht = hidden_chunk(in.dtype, in.teacher_hidden_states, in.teacher_hidden_row_stride,
                                 in.teacher_hidden, r0, count, chunk.teacher_hidden, &ldt);
  logits_chunk(h, *ldh, in.W, nullptr, count, in.hidden, in.vocab, chunk.logits);
  logits_chunk(ht, ldt, in.Wt, nullptr, count, in.teacher_hidden, in.vocab, chunk.teacher_logits);
  return h;
}

}  // namespace cpu
}  // namespace fce
