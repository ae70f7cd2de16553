// api_linear.cpp — the C ABI of the fused linear + cross-entropy: fce_linear_ce and its
// workspace query. Every argument is checked (validate.h) and named when wrong before anything
// is written; then the problem goes to a backend.
#include "validate.h"

namespace {

using fce::fail;
using namespace fce::abi;

void linear_workspace(const fce_options& o, const fce::CeOptions& opt, int64_t rows,
                      int64_t hidden, int64_t vocab, bool with_grad, size_t* min_bytes,
                      size_t* optimal_bytes) {
  const bool fp32 = o.grad_weight_fp32 != 0;
  if (rows == 0)  // the empty problem: nothing computed
    *min_bytes = *optimal_bytes = 0;
  else if (o.backend == FCE_BACKEND_CPU)
    fce::cpu_linear_ce_workspace_size(opt, rows, hidden, vocab, with_grad, fp32, min_bytes,
                                      optimal_bytes);
  else
    fce::cuda_linear_ce_workspace_size(opt, rows, hidden, vocab, with_grad, fp32, min_bytes,
                                       optimal_bytes);
}

}  // namespace

extern "C" {

FCE_API fce_status fce_linear_ce_workspace_size(const fce_options* options, int64_t rows,
                                                int64_t hidden, int64_t vocab, int with_grad,
                                                size_t* min_bytes, size_t* optimal_bytes) {
  const char* fn = "fce_linear_ce_workspace_size";
  fce_options o;
  FCE_TRY(begin_call(fn, options, &o));
  fce::CeOptions opt;
  FCE_TRY(check_options(fn, &o, rows, vocab, &opt));
  FCE_TRY(check_hidden(fn, hidden));
  FCE_TRY(check_size_outputs(fn, min_bytes, optimal_bytes));
  size_t lo = 0, hi = 0;
  linear_workspace(o, opt, rows, hidden, vocab, with_grad != 0, &lo, &hi);
  write_sizes(min_bytes, optimal_bytes, lo, hi);
  return FCE_SUCCESS;
}

FCE_API fce_status fce_linear_ce(const fce_options* options, int64_t rows, int64_t hidden,
                                 int64_t vocab, const void* hidden_states, const void* weight,
                                 const void* bias, const void* targets,
                                 const fce_outputs* outputs, const fce_gradients* gradients,
                                 void* workspace, size_t workspace_bytes, void* stream) {
  const char* fn = "fce_linear_ce";
  CallArgs a;
  FCE_TRY(begin_compute(fn, options, nullptr, false, outputs, gradients,
                        {OutputsUse::kLoss, GradientsUse::kLinear, false}, &a));
  const fce_options local = a.o;
  const fce_outputs& out = a.out;
  const fce_gradients& g = a.g;
  float* loss = out.loss;
  float* z_loss = out.z_loss;
  void* grad_hidden = g.grad_hidden;
  void* grad_weight = g.grad_weight;
  void* grad_bias = g.grad_bias;
  const fce_options* o = &local;
  fce::LinearCeProblem p{};
  FCE_TRY(check_options(fn, o, rows, vocab, &p.opt));
  FCE_TRY(refuse_soft_accuracy(fn, *o, out));
  FCE_TRY(check_hidden(fn, hidden));
  const Entries e(*o, rows);
  const bool empty = rows == 0;  // per-row buffers of no elements may be NULL
  FCE_TRY(check_required(fn, {{"hidden_states", hidden_states, empty},
                              {"weight", weight},
                              {"targets", targets, empty},
                              {"outputs->loss", loss, e.reduced_floats() == 0}}));
  if (grad_bias && !bias)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: gradients->grad_bias is given but bias is NULL",
                fn);
  FCE_TRY(check_stride(fn, "options->hidden_row_stride", o->hidden_row_stride, hidden,
                       &p.hidden_row_stride));
  // One row has no "next row": its stride is never used, whatever it is (the header allows any
  // stride >= hidden), so the backends see the dense value (BLAS and cuBLASLt take int ones).
  if (rows == 1) p.hidden_row_stride = hidden;
  const size_t gw_size = o->grad_weight_fp32 ? 4 : e.esize;
  const int64_t h_bytes = span_bytes(rows, hidden, p.hidden_row_stride, e.esize);
  const int64_t w_bytes = span_bytes(vocab, hidden, hidden, 4);  // largest: f32 grad_weight
  const int64_t gh_bytes = span_bytes(rows, hidden, hidden, e.esize);
  const int64_t q_bytes = e.soft ? span_bytes(rows, vocab, vocab, e.tsize) : 0;
  if (h_bytes < 0 || w_bytes < 0 || gh_bytes < 0 || q_bytes < 0 || rows > kMaxBytes / 8)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: the sizes (rows %lld, hidden %lld, vocab %lld) overflow a 64-bit byte "
                "offset",
                fn, (long long)rows, (long long)hidden, (long long)vocab);
  const uint64_t vd = static_cast<uint64_t>(vocab) * static_cast<uint64_t>(hidden);
  const uint64_t v = static_cast<uint64_t>(vocab);
  const fce::Arg args[] = {
      {"hidden_states", hidden_states, static_cast<uint64_t>(h_bytes), e.esize, false},
      {"weight", weight, vd * e.esize, e.esize, false},
      {"bias", bias, v * e.esize, e.esize, false},
      e.targets(targets, vocab),
      e.class_weights(vocab),
      e.grad_output(g.grad_output),
      e.loss(loss),
      e.lse(out.lse, true),
      z_loss_arg(z_loss),
      {"gradients->grad_hidden", grad_hidden, static_cast<uint64_t>(gh_bytes), e.esize, true},
      {"gradients->grad_weight", grad_weight, vd * gw_size, gw_size, true},
      {"gradients->grad_bias", grad_bias, v * gw_size, gw_size, true},
      error_flags_arg(out.error_flags),
      workspace_arg(workspace, workspace_bytes),
      e.argmax(out.argmax),
      e.accuracy(out.accuracy),
      e.entropy(out.entropy),
      e.grad_lse(g.grad_lse),
      e.grad_entropy(g.grad_entropy),
  };
  const bool with_grad = grad_hidden || grad_weight || grad_bias;
  FCE_TRY(check_row_grads_have_gradient(
      fn, g, with_grad, "gradients->grad_hidden, grad_weight and grad_bias"));
  FCE_TRY(check_args(fn, args));
  size_t min_bytes = 0, optimal_bytes = 0;
  linear_workspace(*o, p.opt, rows, hidden, vocab, with_grad, &min_bytes, &optimal_bytes);
  FCE_TRY(check_workspace(fn, min_bytes, workspace, workspace_bytes));
  if (empty)  // the reduced outputs are 0, and so are ∂W and ∂b (sums over no rows)
    return empty_problem(fn, *o, args,
                         {e.reduced_zeros(loss), {z_loss, 4}, e.reduced_zeros(out.accuracy),
                          weight_grad_zeros(*o, grad_weight, vd * gw_size),
                          weight_grad_zeros(*o, grad_bias, v * gw_size)},
                         stream);
  p.fn = fn;
  p.rows = rows;
  p.hidden = hidden;
  p.vocab = vocab;
  set_linear_inputs(&p, hidden_states, weight, bias, targets);
  set_loss_outputs(&p, out);
  set_row_terms(&p, out, g);
  set_linear_grads(&p, *o, grad_hidden, grad_weight, grad_bias);
  p.grad_output = g.grad_output;
  p.error_flags = out.error_flags;
  set_workspace(&p, workspace, workspace_bytes, stream);
  return dispatch(*o, args, p, fce::cpu_linear_ce, fce::cuda_linear_ce);
}

}  // extern "C"
