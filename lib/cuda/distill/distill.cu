// distill/distill.cu — fce_distill on the CUDA backend (docs/semantics.md rule 20): the count of
// the rows that count, the row kernel over the student's and the teacher's rows (one block per
// row; the gradient in the same call), then the fixed-order reduction of the row losses. The
// workspace holds the count and the row losses (distill/kernels.cuh's Head): no allocation, no
// host synchronisation, graph-capturable.
#include "cuda/distill/kernels.cuh"

namespace fce {

size_t cuda_distill_workspace_size(const DistillOptions& opt, int64_t rows, int64_t) {
  return sat_add(cuda::distill::head_bytes(rows, opt.reduction), 256);  // + alignment slack
}

fce_status cuda_distill(const DistillProblem& p) {
  using namespace cuda::distill;
  cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p.workspace) + uintptr_t(255)) &
                                       ~uintptr_t(255));
  const Head h = head_at(base, p.rows, p.opt.reduction);
  const bool none = p.opt.reduction == FCE_REDUCTION_NONE;
  FCE_TRY(launch_count(p.fn, p.opt, p.rows, p.targets, h.n, s));
  const RowsArgs a = rows_args(p, h, 0, p.rows, p.logits, p.row_stride, p.teacher,
                               p.teacher_row_stride, p.grad, p.grad_row_stride);
  FCE_TRY(launch_rows(a, s));
  if (none) return FCE_SUCCESS;
  return launch_reduce(p.fn, p.opt.reduction, p.rows, h.row_loss, h.n, p.loss, s);
}

}  // namespace fce
