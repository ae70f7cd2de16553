// ce.cpp — cross-entropy over given logits on the CPU: fce_forward (loss, lse, z-loss and, with a
// gradient buffer, the gradient in the same pass) and fce_backward (the gradient from the saved
// lse). The reference backend and the oracle of the GPU tests: every row in double (ce_row.h),
// rows on threads, the reduction in row order.
#include <new>
#include <vector>

#include "ce_row.h"

namespace fce {

// Scratch lives in host memory (one double row per thread, one double per row for the loss).
size_t cpu_ce_workspace_size(const CeOptions&, int64_t, int64_t, bool) { return 0; }

// fce_backward_rescale's cheap cases: the upstream scalar g is 1 (nothing to do) or scales
// exactly (0, ±2^k: each element times g, one float32 product, as the CUDA kernel). Returns
// false when the gradient has to be computed again.
bool rescale_in_place(const CeProblem& p) {
  using namespace cpu;
  const float g = *p.grad_output;
  if (g == 1.0f) return true;
  if (!exact_scale(g)) return false;
  parallel_for(p.rows, thread_count(p.rows, std::max<int64_t>(1, (int64_t(1) << 16) / p.vocab)),
               [&](int64_t begin, int64_t end, int) {
                 const size_t esize = dtype_size(p.opt.dtype);
                 for (int64_t r = begin; r < end; ++r) {
                   void* row = static_cast<char*>(p.grad) + size_t(r) * p.grad_row_stride * esize;
                   for (int64_t j = 0; j < p.vocab; ++j)
                     store_float(p.opt.dtype, row, j, load_float(p.opt.dtype, row, j) * g);
                 }
               });
  return true;
}

fce_status cpu_ce(const CeProblem& p) {
  using namespace cpu;
  if (p.rescale && rescale_in_place(p)) return FCE_SUCCESS;
  const bool forward = p.lse_in == nullptr;
  try {
    const CeSetup setup = make_setup(p.opt, p.rows, p.vocab, p.targets, p.grad_output);
    RowScratch scratch(p.vocab, p.rows);
    std::vector<double> row_loss(forward ? size_t(p.rows) : 0);
    std::vector<double> row_z_loss(forward ? size_t(p.rows) : 0);

    RowsJob job;
    job.first_row = 0;
    job.count = p.rows;
    job.logits = p.logits;
    job.logits_stride = p.row_stride;
    job.logits_dtype = p.opt.dtype;
    job.grad = p.grad;
    job.grad_stride = p.grad_row_stride;
    job.grad_dtype = p.opt.dtype;
    job.lse_in = p.lse_in;
    job.lse_out = forward ? p.lse : nullptr;
    job.row_loss = forward ? row_loss.data() : nullptr;
    job.row_z_loss = forward ? row_z_loss.data() : nullptr;
    const bool invalid_seen = run_rows(setup, job, scratch);

    if (forward) write_reduction(setup, row_loss.data(), row_z_loss.data(), p.loss, p.z_loss);
    if (invalid_seen && p.error_flags) *p.error_flags |= FCE_FLAG_TARGET_OUT_OF_RANGE;
    return FCE_SUCCESS;
  } catch (const std::bad_alloc&) {
    return fail(FCE_ERROR_INTERNAL, "%s (CPU): out of host memory for %lld rows of %lld classes",
                forward ? "fce_forward" : "fce_backward", (long long)p.rows, (long long)p.vocab);
  }
}

}  // namespace fce
