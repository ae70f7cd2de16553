// vp_linear_distill.cpp — fce_vp_linear_distill_stats and fce_vp_linear_distill_backward on the
// CPU: fce_linear_distill's token chunks (distill_chunks.h) over this rank's weight shards, each
// chunk's logits then put through the vocabulary-parallel distillation's own rows
// (vp_distill.cpp, the chunk's rows of the call): the statistics, or the student's gradient over
// its logits in place followed by the chunk's share of ∂h = ∂z·W_s and ∂W_s (+)= ∂zᵀ·h, summed in
// float32. The chunk's rows depend on the sizes only, so every workspace of at least min_bytes
// gives the same result bit for bit.
#include <new>
#include <vector>

#include "distill_chunks.h"
#include "vp_distill.h"

namespace fce {

using namespace cpu;

namespace {

fce_status run(const VpLinearDistillProblem& p) {
  const int64_t Vs = p.vocab_local, R = chunk_rows(p.rows, Vs);
  const int dtype = p.opt.dtype;
  DistillOptions opt32 = p.opt;  // the chunk's logits are float32
  opt32.dtype = FCE_FLOAT32;
  // The call's buffers are allocated before any output is written (the rows' scratch, per
  // chunk, is vp_distill.cpp's).
  const DistillInputs in = distill_inputs(p, Vs);
  DistillBuffers chunk(distill_layout(dtype, R, p.hidden, p.teacher_hidden, Vs, p.backward),
                       p.workspace, p.workspace_bytes);
  WeightGrads weight_grads(p.grad_weight_fp32 ? FCE_FLOAT32 : dtype, p.grad_weight, nullptr,
                           p.accumulate, Vs, p.hidden);
  for (int64_t r0 = 0; r0 < p.rows; r0 += R) {
    const int64_t count = std::min(R, p.rows - r0);
    int64_t ldh = 0;
    const float* h = distill_logits(in, r0, count, chunk, &ldh);
    if (!p.backward) {
      FCE_TRY(cpu_vp_distill_stats(
          vd_stats_chunk(p, opt32, r0, count, chunk.logits, chunk.teacher_logits, Vs)));
      continue;
    }
    FCE_TRY(cpu_vp_distill(vd_backward_chunk(p, opt32, r0, count, chunk.logits,
                                             chunk.teacher_logits, Vs, nullptr, 0)));
    if (p.grad_hidden)  // this rank's partial ∂h, of grad_hidden_dtype
      grad_hidden_chunk(p.grad_hidden_dtype, p.grad_hidden, chunk.logits, in.W, r0, count, p.hidden,
                        Vs, chunk.grad_hidden);
    weight_grads.add(chunk.logits, h, ldh, count);
  }
  weight_grads.store();
  return FCE_SUCCESS;
}

}  // namespace

fce_status cpu_vp_linear_distill(const VpLinearDistillProblem& p) {
  FCE_TRY(check_blas_sizes(p.fn, "vocab_local", p.vocab_local, p.hidden, p.hidden_row_stride,
                           p.teacher_hidden_row_stride));
  try {
    return run(p);
  } catch (const std::bad_alloc&) {
    return fail(FCE_ERROR_OUT_OF_MEMORY,
                "%s (CPU): out of host memory (rows %lld, hidden %lld, vocab_local %lld)", p.fn,
                (long long)p.rows, (long long)p.hidden, (long long)p.vocab_local);
  }
}

}  // namespace fce
