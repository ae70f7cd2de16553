// distill.cpp — fce_distill on the CPU: every row by distill_row.h (in double), rows on threads,
// the reduction in row order. The reference backend and the oracle of the GPU tests.
#include <new>
#include <vector>

#include "distill_row.h"

namespace fce {

// Scratch lives in host memory (two double rows per thread, one double per row).
size_t cpu_distill_workspace_size(const DistillOptions&, int64_t, int64_t) { return 0; }

fce_status cpu_distill(const DistillProblem& p) {
  using namespace cpu;
  try {
    const DistillSetup d = make_distill_setup(p.opt, p.rows, p.vocab, p.targets, p.grad_output);
    DistillScratch scratch(p.vocab, p.rows);
    std::vector<double> losses(size_t(p.rows), 0.0);
    DistillRows job;
    job.first = 0;
    job.count = p.rows;
    job.student = p.logits;
    job.student_stride = p.row_stride;
    job.teacher = p.teacher;
    job.teacher_stride = p.teacher_row_stride;
    job.dtype = p.opt.dtype;
    job.grad = p.grad;
    job.grad_stride = p.grad_row_stride;
    job.grad_dtype = p.opt.dtype;
    job.losses = &losses;
    job.lse = p.lse;
    run_distill_rows(d, job, scratch);
    write_distill_loss(d, losses, p.loss);
    return FCE_SUCCESS;
  } catch (const std::bad_alloc&) {
    return fail(FCE_ERROR_OUT_OF_MEMORY,
                "%s (CPU): out of host memory for %lld rows of %lld classes", p.fn,
                (long long)p.rows, (long long)p.vocab);
  }
}

}  // namespace fce
