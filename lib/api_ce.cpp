// api_ce.cpp — the C ABI of the cross-entropy over given logits: fce_forward, fce_backward,
// fce_backward_rescale and their workspace queries. Every argument is checked (validate.h) and
// named when wrong before anything is written; then the problem goes to a backend.
#include "validate.h"

namespace {

using fce::fail;
using namespace fce::abi;

size_t ce_workspace(const fce_options& o, const fce::CeOptions& opt, int64_t rows, int64_t vocab,
                    bool backward) {
  if (rows == 0) return 0;  // the empty problem: nothing computed
  return o.backend == FCE_BACKEND_CPU ? fce::cpu_ce_workspace_size(opt, rows, vocab, backward)
                                      : fce::cuda_ce_workspace_size(opt, rows, vocab, backward);
}

fce_status ce_workspace_query(const char* fn, const fce_options* options, int64_t rows,
                              int64_t vocab, bool backward, size_t* bytes) {
  fce_options o;
  FCE_TRY(begin_call(fn, options, &o));
  fce::CeOptions opt;
  FCE_TRY(check_options(fn, &o, rows, vocab, &opt));
  FCE_TRY(check_size_output(fn, bytes));
  *bytes = ce_workspace(o, opt, rows, vocab, backward);
  return FCE_SUCCESS;
}

// Shared by fce_forward (mode kForward; outputs->loss checked here, where its size is known),
// fce_backward and fce_backward_rescale (lse_in set, out holding error_flags alone), once each
// entry point has read its structs and checked its own required pointers.
fce_status ce_call(const char* fn, fce::CeMode mode, const CallArgs& a, int64_t rows,
                   int64_t vocab, const void* logits, const void* targets, const float* lse_in,
                   void* workspace, size_t workspace_bytes, void* stream) {
  const bool forward = mode == fce::CeMode::kForward;
  const fce_outputs& out = a.out;
  const fce_gradients& g = a.g;
  float* loss = out.loss;
  float* z_loss = out.z_loss;
  void* grad = g.grad_logits;
  const float* grad_output = g.grad_output;
  uint32_t* error_flags = out.error_flags;
  const fce_options* o = &a.o;
  fce::CeProblem p{};
  FCE_TRY(check_options(fn, o, rows, vocab, &p.opt));
  FCE_TRY(refuse_soft_accuracy(fn, *o, out));
  if (mode == fce::CeMode::kRescale && o->reduction == FCE_REDUCTION_NONE)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->reduction is FCE_REDUCTION_NONE: a per-row upstream gradient "
                "needs fce_backward", fn);
  const Entries e(*o, rows);
  const bool empty = rows == 0;  // per-row buffers of no elements may be NULL
  if (forward) FCE_TRY(check_required(fn, {{"outputs->loss", loss, e.reduced_floats() == 0}}));
  FCE_TRY(check_required(fn, {{"logits", logits, empty}, {"targets", targets, empty}}));
  FCE_TRY(check_stride(fn, "options->row_stride", o->row_stride, vocab, &p.row_stride));
  FCE_TRY(
      check_stride(fn, "options->grad_row_stride", o->grad_row_stride, vocab, &p.grad_row_stride));
  // docs/semantics.md rule 21: a CUDA row kernel splits a row by its 16-byte vectors, so a
  // row's sum order follows its address; under batch_invariant every row must start aligned.
  if (p.opt.batch_invariant && o->backend == FCE_BACKEND_CUDA && rows > 0 &&
      ((reinterpret_cast<uintptr_t>(logits) & 15) != 0 ||
       (static_cast<uint64_t>(p.row_stride) * e.esize & 15) != 0))
    return fail(FCE_ERROR_UNSUPPORTED,
                "%s: options->batch_invariant needs every row of logits 16-byte aligned on the "
                "CUDA backend (logits %p, row stride %lld elements of %zu bytes): pad the row "
                "stride to a multiple of %zu elements",
                fn, logits, (long long)p.row_stride, e.esize, 16 / e.esize);
  const int64_t logits_bytes = span_bytes(rows, vocab, p.row_stride, e.esize);
  const int64_t grad_bytes = grad ? span_bytes(rows, vocab, p.grad_row_stride, e.esize) : 0;
  if (logits_bytes < 0 || grad_bytes < 0 || rows > kMaxBytes / 8)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: rows (%lld) x row stride overflows a 64-bit byte offset", fn,
                (long long)rows);
  const fce::Arg args[] = {
      {"logits", logits, static_cast<uint64_t>(logits_bytes), e.esize, false},
      e.targets(targets, vocab),
      e.class_weights(vocab),
      e.grad_output(grad_output),
      e.lse(lse_in, false),
      e.loss(loss),
      e.lse(out.lse, true),
      z_loss_arg(z_loss),
      {"gradients->grad_logits", grad, static_cast<uint64_t>(grad_bytes), e.esize, true},
      error_flags_arg(error_flags),
      workspace_arg(workspace, workspace_bytes),
      e.argmax(out.argmax),  // NULL for the backward calls (read_outputs kFlagsOnly)
      e.accuracy(out.accuracy),
      e.entropy(out.entropy),  // NULL for the backward calls
      e.grad_lse(g.grad_lse),  // NULL for fce_backward_rescale
      e.grad_entropy(g.grad_entropy),  // fce_forward only
  };
  // grad_logits may be logits itself (same start, same stride); any other overlap is an error,
  // an output inside the logits of an in-place call included.
  const InPlace in_place{p.row_stride, p.grad_row_stride};
  FCE_TRY(check_args(fn, args, &in_place));
  FCE_TRY(check_workspace(fn, ce_workspace(*o, p.opt, rows, vocab, !forward), workspace,
                          workspace_bytes));
  if (empty)  // the forward's reduced outputs are 0; the gradient has no element
    return empty_problem(fn, *o, args,
                         {e.reduced_zeros(loss), {z_loss, 4},
                          e.reduced_zeros(out.accuracy)},
                         stream);
  p.fn = fn;
  p.mode = mode;
  p.rows = rows;
  p.vocab = vocab;
  p.logits = logits;
  p.targets = targets;
  if (forward) set_loss_outputs(&p, out);  // the backward calls: all NULL
  set_row_terms(&p, out, g);
  p.grad = grad;
  p.grad_output = grad_output;
  p.lse_in = lse_in;
  p.error_flags = error_flags;
  set_workspace(&p, workspace, workspace_bytes, stream);
  return dispatch(*o, args, p, fce::cpu_ce, fce::cuda_ce);
}

}  // namespace

extern "C" {

FCE_API fce_status fce_forward_workspace_size(const fce_options* options, int64_t rows,
                                              int64_t vocab, size_t* workspace_bytes) {
  return ce_workspace_query("fce_forward_workspace_size", options, rows, vocab, false,
                            workspace_bytes);
}

FCE_API fce_status fce_backward_workspace_size(const fce_options* options, int64_t rows,
                                               int64_t vocab, size_t* workspace_bytes) {
  return ce_workspace_query("fce_backward_workspace_size", options, rows, vocab, true,
                            workspace_bytes);
}

FCE_API fce_status fce_forward(const fce_options* options, int64_t rows, int64_t vocab,
                               const void* logits, const void* targets,
                               const fce_outputs* outputs, const fce_gradients* gradients,
                               void* workspace, size_t workspace_bytes, void* stream) {
  const char* fn = "fce_forward";
  CallArgs a;
  FCE_TRY(begin_compute(fn, options, nullptr, false, outputs, gradients, kLossCall, &a));
  FCE_TRY(check_row_grads_have_gradient(fn, a.g, a.g.grad_logits != nullptr,
                                        "gradients->grad_logits"));
  return ce_call(fn, fce::CeMode::kForward, a, rows, vocab, logits, targets, nullptr, workspace,
                 workspace_bytes, stream);
}

FCE_API fce_status fce_backward(const fce_options* options, int64_t rows, int64_t vocab,
                                const void* logits, const void* targets, const float* lse,
                                const fce_outputs* outputs, const fce_gradients* gradients,
                                void* workspace, size_t workspace_bytes, void* stream) {
  const char* fn = "fce_backward";
  CallArgs a;
  FCE_TRY(begin_compute(fn, options, nullptr, false, outputs, gradients, kLogitsGradCall, &a));
  FCE_TRY(refuse_row_grads(fn, a.g, true,
                           " (it needs each row's mean logit, which only a pass over the whole "
                           "row makes): use fce_forward with gradients->grad_logits"));
  FCE_TRY(check_required(
      fn, {{"lse", lse, rows == 0}, {"gradients->grad_logits", a.g.grad_logits, rows == 0}}));
  return ce_call(fn, fce::CeMode::kBackward, a, rows, vocab, logits, targets, lse, workspace,
                 workspace_bytes, stream);
}

FCE_API fce_status fce_backward_rescale(const fce_options* options, int64_t rows, int64_t vocab,
                                        const void* logits, const void* targets,
                                        const float* lse, const fce_outputs* outputs,
                                        const fce_gradients* gradients, void* workspace,
                                        size_t workspace_bytes, void* stream) {
  const char* fn = "fce_backward_rescale";
  CallArgs a;
  FCE_TRY(begin_compute(fn, options, nullptr, false, outputs, gradients, kLogitsGradCall, &a));
  FCE_TRY(refuse_row_grads(fn, a.g, false,
                           " (it scales the loss's gradient only): use fce_forward with the "
                           "upstream gradients, or fce_backward for grad_lse"));
  const fce_gradients& g = a.g;
  FCE_TRY(check_required(
      fn, {{"lse", lse, rows == 0}, {"gradients->grad_logits", g.grad_logits, rows == 0}}));
  if (a.o.reduction == FCE_REDUCTION_NONE)  // (before grad_output, which is then no scalar)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->reduction is FCE_REDUCTION_NONE: a per-row upstream gradient "
                "needs fce_backward", fn);
  if (!g.grad_output)
    return fail(FCE_ERROR_NULL_POINTER,
                "%s: gradients->grad_output is NULL (the upstream scalar)", fn);
  if (rows > 0 && g.grad_logits == logits)  // (no row: two pointers to nothing, whatever they are)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: gradients->grad_logits is logits: a gradient written over the logits "
                "cannot be recomputed; scale it with fce_scale_gradient", fn);
  return ce_call(fn, fce::CeMode::kRescale, a, rows, vocab, logits, targets, lse, workspace,
                 workspace_bytes, stream);
}

}  // extern "C"
