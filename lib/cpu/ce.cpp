// ce.cpp — cross-entropy over given logits on the CPU: fce_forward (loss, lse, z-loss, argmax,
// accuracy and, with a gradient buffer, the gradient in the same pass), fce_backward (the
// gradient from the saved lse) and fce_backward_rescale. The reference backend and the oracle of
// the GPU tests: every row by ce_row.h (float32 vectorised with the
// sums in double; in double with logit_scale or softcap), rows on threads, the reduction in row order.
#include <memory>
#include <new>
#include <vector>

#include "ce_row.h"

namespace fce {

// Scratch lives in host memory (one double row per thread, a few doubles per row).
size_t cpu_ce_workspace_size(const CeOptions&, int64_t, int64_t, bool) { return 0; }

namespace {

// fce_backward_rescale's cheap cases (docs/semantics.md rule 14): the upstream scalar g is 1 (nothing to do)
// or scales exactly (0, ±2^k: each element of a scored row times g, one float32 product, as the
// CUDA kernel). Ignored rows keep the +0 fce_forward wrote (a negative g would make it −0) and
// invalid rows their NaN. Returns false when the gradient has to be computed again.
bool rescale_in_place(const CeProblem& p, const cpu::CeSetup& setup) {
  using namespace cpu;
  const float g = *p.grad_output;
  if (g == 1.0f) return true;
  if (!exact_scale(g)) return false;
  parallel_for(p.rows, thread_count(p.rows, std::max<int64_t>(1, (int64_t(1) << 16) / p.vocab)),
               [&](int64_t begin, int64_t end, int) {
                 const size_t esize = dtype_size(p.opt.dtype);
                 for (int64_t r = begin; r < end; ++r) {
                   if (row_target(setup, r).kind != RowKind::kScored) continue;
                   void* row = static_cast<char*>(p.grad) + size_t(r) * p.grad_row_stride * esize;
                   for (int64_t j = 0; j < p.vocab; ++j)
                     store_float(p.opt.dtype, row, j, load_float(p.opt.dtype, row, j) * g);
                 }
               });
  return true;
}

}  // namespace

fce_status cpu_ce(const CeProblem& p) {
  using namespace cpu;
  // fce_backward_rescale computes again what fce_forward computes (docs/semantics.md rule 14: bit for bit),
  // not fce_backward's gradient from the saved lse.
  const bool rescale = p.mode == CeMode::kRescale;
  const bool forward = p.mode != CeMode::kBackward;
  try {
    // (fce_backward_rescale is given no entropy or its gradients: refused by the ABI layer)
    const CeSetup setup =
        make_setup(p.opt, p.rows, p.vocab, p.targets, p.grad_output,
                   p.mode == CeMode::kForward && p.entropy, p.grad_lse, p.grad_entropy);
    if (rescale && rescale_in_place(p, setup)) return FCE_SUCCESS;
    const bool outputs = p.mode == CeMode::kForward;  // the backward calls write grad only
    RowScratch scratch(setup, p.rows);
    std::unique_ptr<RowResults> results;
    if (outputs) results.reset(new RowResults(p.rows, p.accuracy != nullptr));

    RowsJob job;
    job.first_row = 0;
    job.count = p.rows;
    job.logits = p.logits;
    job.logits_stride = p.row_stride;
    job.logits_dtype = p.opt.dtype;
    job.grad = p.grad;
    job.grad_stride = p.grad_row_stride;
    job.grad_dtype = p.opt.dtype;
    job.lse_in = forward ? nullptr : p.lse_in;
    job.lse_out = outputs ? p.lse : nullptr;
    job.entropy_out = outputs ? p.entropy : nullptr;
    job.argmax = outputs ? p.argmax : nullptr;
    job.results = results.get();
    const bool invalid_seen = run_rows(setup, job, scratch);

    if (outputs) write_reduction(setup, *results, p.loss, p.z_loss, p.accuracy);
    if (invalid_seen && p.error_flags) *p.error_flags |= FCE_FLAG_TARGET_OUT_OF_RANGE;
    return FCE_SUCCESS;
  } catch (const std::bad_alloc&) {
    return fail(FCE_ERROR_OUT_OF_MEMORY,
                "%s (CPU): out of host memory for %lld rows of %lld classes", p.fn,
                (long long)p.rows, (long long)p.vocab);
  }
}

}  // namespace fce
