// distill/kernels.cuh — the kernels of the distillation calls (docs/semantics.md rule 20),
// launched by distill/distill.cu (fce_distill) and distill/linear_distill.cu (each token chunk
// of fce_linear_distill; the vocabulary-parallel distillation, vocab_parallel/distill.cu, takes
// the count, the reduction and counted): the count of the rows that count, the row kernel (loss, lse and the
// student's gradient, one block per row), and the fixed-order reduction of the row losses.
#pragma once

#include <cuda_runtime.h>

#include "distill.h"

namespace fce {
namespace cuda {
namespace distill {

// The workspace both calls start with (256-byte aligned base): n (the counted rows) as float32,
// then the row losses [rows] for mean and sum.
struct Head {
  float* n;
  float* row_loss;  // nullptr for reduction none (the caller's loss holds them)
};
size_t head_bytes(int64_t rows, int reduction);  // a multiple of 256
Head head_at(char* base, int64_t rows, int reduction);

// Whether row r counts: every row without targets, else a row whose target is not ignore.
__device__ __forceinline__ bool counted(const void* targets, bool int64, int64_t ignore,
                                        int64_t r) {
  if (!targets) return true;
  const int64_t y = int64 ? static_cast<const int64_t*>(targets)[r]
                          : int64_t(static_cast<const int32_t*>(targets)[r]);
  return y != ignore;
}

// *n = the number of rows whose target is not ignore_index (rows when targets is nullptr).
fce_status launch_count(const char* fn, const DistillOptions& opt, int64_t rows,
                        const void* targets, float* n, cudaStream_t s);

// Rows [first, first + count) of the problem: student rows (dtype, ld apart), teacher rows,
// the gradient (may be the student rows; nullptr: none). targets, row_loss, lse and a per-row
// grad_output are indexed by problem row; row_loss gets 0 for rows not counted.
struct RowsArgs {
  const char* fn;
  DistillOptions opt;
  int64_t first, count, vocab;
  const void* student;
  int64_t student_ld;
  const void* teacher;
  int64_t teacher_ld;
  void* grad;
  int64_t grad_ld;
  const void* targets;
  const float* n;            // device: the counted rows
  const float* grad_output;  // nullptr = 1
  float* row_loss;           // [rows]
  float* lse;                // optional [rows]
};
fce_status launch_rows(const RowsArgs& a, cudaStream_t s);

// The RowsArgs of rows [first, first + count) of call p (a DistillProblem or a
// LinearDistillProblem): the call's fields from p and the head h, the rows' buffers as given.
template <class Problem>
RowsArgs rows_args(const Problem& p, const Head& h, int64_t first, int64_t count,
                   const void* student, int64_t student_ld, const void* teacher, int64_t teacher_ld,
                   void* grad, int64_t grad_ld) {
  RowsArgs a;
  a.fn = p.fn;
  a.opt = p.opt;
  a.first = first;
  a.count = count;
  a.vocab = p.vocab;
  a.student = student;
  a.student_ld = student_ld;
  a.teacher = teacher;
  a.teacher_ld = teacher_ld;
  a.grad = grad;
  a.grad_ld = grad_ld;
  a.targets = p.targets;
  a.n = h.n;
  a.grad_output = p.grad_output;
  a.row_loss = p.opt.reduction == FCE_REDUCTION_NONE ? p.loss : h.row_loss;
  a.lse = p.lse;
  return a;
}

// loss[0] = Σ row_loss in a fixed order, divided by *n for mean (0 when n is 0 and the sum is
// finite).
fce_status launch_reduce(const char* fn, int reduction, int64_t rows, const float* row_loss,
                         const float* n, float* loss, cudaStream_t s);

}  // namespace distill
}  // namespace cuda
}  // namespace fce
