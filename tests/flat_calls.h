// flat_calls.h — the suites' way of calling the compute calls: one flat argument list per call
// (every input, output and gradient by position, in the order the suites were written in), packed
// here into the fce_outputs, fce_gradients and fce_vp_shard structures the ABI takes. What the
// structures themselves must hold, and what is refused, is tested against the C calls directly
// (test_api.cpp); everything else goes through these.
//
// TestOptions is fce_options plus the two outputs the suites set beside the options (argmax and
// accuracy): the calls that write them take them from there into fce_outputs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusedce.h"

struct TestOptions : fce_options {
  int64_t* argmax = nullptr;
  float* accuracy = nullptr;
};

namespace flat {

// The outputs of a loss call; of a gradient-only call (flags only: error_flags alone).
inline fce_outputs outputs(const TestOptions* o, float* loss, float* lse, float* z_loss,
                           uint32_t* error_flags) {
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss;
  out.lse = lse;
  out.z_loss = z_loss;
  out.argmax = o ? o->argmax : nullptr;
  out.accuracy = o ? o->accuracy : nullptr;
  out.error_flags = error_flags;
  return out;
}
inline fce_outputs flags_only(uint32_t* error_flags) {
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.error_flags = error_flags;
  return out;
}
inline fce_gradients logit_grads(void* grad_logits, const float* grad_output) {
  fce_gradients g = FCE_GRADIENTS_INIT;
  g.grad_logits = grad_logits;
  g.grad_output = grad_output;
  return g;
}
inline fce_gradients linear_grads(void* grad_hidden, void* grad_weight, void* grad_bias,
                                  const float* grad_output,
                                  int32_t grad_hidden_dtype = FCE_FLOAT32) {
  fce_gradients g = FCE_GRADIENTS_INIT;
  g.grad_hidden = grad_hidden;
  g.grad_weight = grad_weight;
  g.grad_bias = grad_bias;
  g.grad_output = grad_output;
  g.grad_hidden_dtype = grad_hidden_dtype;
  return g;
}
inline fce_vp_shard shard(int64_t ranks, int64_t vocab_total, int64_t vocab_start,
                          int64_t vocab_local) {
  return fce_vp_shard{ranks, vocab_total, vocab_start, vocab_local, nullptr, nullptr};
}

inline fce_status forward(const TestOptions* o, int64_t rows, int64_t vocab, const void* logits,
                          const void* targets, float* loss, float* lse, float* z_loss,
                          void* grad_logits, const float* grad_output, uint32_t* error_flags,
                          void* workspace, size_t workspace_bytes, void* stream) {
  const fce_outputs out = outputs(o, loss, lse, z_loss, error_flags);
  const fce_gradients g = logit_grads(grad_logits, grad_output);
  return fce_forward(o, rows, vocab, logits, targets, &out, &g, workspace, workspace_bytes,
                     stream);
}

inline fce_status backward(const TestOptions* o, int64_t rows, int64_t vocab, const void* logits,
                           const void* targets, const float* lse, const float* grad_output,
                           void* grad_logits, uint32_t* error_flags, void* workspace,
                           size_t workspace_bytes, void* stream) {
  const fce_outputs out = flags_only(error_flags);
  const fce_gradients g = logit_grads(grad_logits, grad_output);
  return fce_backward(o, rows, vocab, logits, targets, lse, &out, &g, workspace, workspace_bytes,
                      stream);
}

inline fce_status backward_rescale(const TestOptions* o, int64_t rows, int64_t vocab,
                                   const void* logits, const void* targets, const float* lse,
                                   const float* grad_output, void* grad_logits,
                                   uint32_t* error_flags, void* workspace,
                                   size_t workspace_bytes, void* stream) {
  const fce_outputs out = flags_only(error_flags);
  const fce_gradients g = logit_grads(grad_logits, grad_output);
  return fce_backward_rescale(o, rows, vocab, logits, targets, lse, &out, &g, workspace,
                              workspace_bytes, stream);
}

inline fce_status linear_ce(const TestOptions* o, int64_t rows, int64_t hidden, int64_t vocab,
                            const void* hidden_states, const void* weight, const void* bias,
                            const void* targets, float* loss, float* lse, float* z_loss,
                            void* grad_hidden, void* grad_weight, void* grad_bias,
                            const float* grad_output, uint32_t* error_flags, void* workspace,
                            size_t workspace_bytes, void* stream) {
  const fce_outputs out = outputs(o, loss, lse, z_loss, error_flags);
  const fce_gradients g = linear_grads(grad_hidden, grad_weight, grad_bias, grad_output);
  return fce_linear_ce(o, rows, hidden, vocab, hidden_states, weight, bias, targets, &out, &g,
                       workspace, workspace_bytes, stream);
}

inline fce_status vp_stats(const TestOptions* o, int64_t rows, int64_t vocab_total,
                           int64_t vocab_start, int64_t vocab_local, const void* logits,
                           const void* targets, float* stats, void* stream) {
  const fce_vp_shard s = shard(1, vocab_total, vocab_start, vocab_local);
  return fce_vp_stats(o, &s, rows, logits, targets, stats, stream);
}

inline fce_status vp_loss(const TestOptions* o, int64_t ranks, int64_t rows, int64_t vocab_total,
                          const void* targets, const float* gathered_stats, float* loss,
                          float* lse, float* z_loss, uint32_t* error_flags, void* workspace,
                          size_t workspace_bytes, void* stream) {
  const fce_vp_shard s = shard(ranks, vocab_total, 0, vocab_total);
  const fce_outputs out = outputs(o, loss, lse, z_loss, error_flags);
  return fce_vp_loss(o, &s, rows, targets, gathered_stats, &out, workspace, workspace_bytes,
                     stream);
}

inline fce_status vp_backward(const TestOptions* o, int64_t ranks, int64_t rows,
                              int64_t vocab_total, int64_t vocab_start, int64_t vocab_local,
                              const void* logits, const void* targets,
                              const float* gathered_stats, const float* grad_output,
                              void* grad_logits, void* workspace, size_t workspace_bytes,
                              void* stream) {
  const fce_vp_shard s = shard(ranks, vocab_total, vocab_start, vocab_local);
  const fce_gradients g = logit_grads(grad_logits, grad_output);
  return fce_vp_backward(o, &s, rows, logits, targets, gathered_stats, &g, workspace,
                         workspace_bytes, stream);
}

inline fce_status vp_linear_stats(const TestOptions* o, int64_t rows, int64_t hidden,
                                  int64_t vocab_total, int64_t vocab_start, int64_t vocab_local,
                                  const void* hidden_states, const void* weight, const void* bias,
                                  const void* targets, float* stats, void* workspace,
                                  size_t workspace_bytes, void* stream) {
  const fce_vp_shard s = shard(1, vocab_total, vocab_start, vocab_local);
  return fce_vp_linear_stats(o, &s, rows, hidden, hidden_states, weight, bias, targets, stats,
                             workspace, workspace_bytes, stream);
}

inline fce_status vp_linear_backward(const TestOptions* o, int64_t ranks, int64_t rows,
                                     int64_t hidden, int64_t vocab_total, int64_t vocab_start,
                                     int64_t vocab_local, const void* hidden_states,
                                     const void* weight, const void* bias, const void* targets,
                                     const float* gathered_stats, const float* grad_output,
                                     void* grad_hidden, int32_t grad_hidden_dtype,
                                     void* grad_weight, void* grad_bias, void* workspace,
                                     size_t workspace_bytes, void* stream) {
  const fce_vp_shard s = shard(ranks, vocab_total, vocab_start, vocab_local);
  const fce_gradients g =
      linear_grads(grad_hidden, grad_weight, grad_bias, grad_output, grad_hidden_dtype);
  return fce_vp_linear_backward(o, &s, rows, hidden, hidden_states, weight, bias, targets,
                                gathered_stats, &g, workspace, workspace_bytes, stream);
}

inline fce_status vp_linear_ce(const TestOptions* o, int64_t ranks, int64_t rows, int64_t hidden,
                               int64_t vocab_total, int64_t vocab_start, int64_t vocab_local,
                               const void* hidden_states, const void* weight, const void* bias,
                               const void* targets, float* loss, float* lse, float* z_loss,
                               const float* grad_output, void* grad_hidden,
                               int32_t grad_hidden_dtype, void* grad_weight, void* grad_bias,
                               uint32_t* error_flags, fce_vp_all_gather_fn all_gather,
                               void* context, void* workspace, size_t workspace_bytes,
                               void* stream) {
  fce_vp_shard s = shard(ranks, vocab_total, vocab_start, vocab_local);
  s.all_gather = all_gather;
  s.context = context;
  const fce_outputs out = outputs(o, loss, lse, z_loss, error_flags);
  const fce_gradients g =
      linear_grads(grad_hidden, grad_weight, grad_bias, grad_output, grad_hidden_dtype);
  return fce_vp_linear_ce(o, &s, rows, hidden, hidden_states, weight, bias, targets, &out, &g,
                          workspace, workspace_bytes, stream);
}

}  // namespace flat
