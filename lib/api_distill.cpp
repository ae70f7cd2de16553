// api_distill.cpp — the C ABI of the distillation calls: fce_distill, fce_linear_distill and
// their workspace queries (docs/semantics.md rule 20). Every argument is checked (validate.h)
// and named when wrong before anything is written; then the problem goes to a backend.
#include <cmath>
#include <cstring>

#include "api_distill.h"

namespace fce {
namespace abi {

// The caller's teacher into *t: its struct_size must be a version's, reserved0 0, the
// divergence one of fce_divergence, beta in [0, 1] and the temperature finite and > 0.
fce_status read_teacher(const char* fn, const fce_teacher* teacher, fce_teacher* t) {
  static_assert(sizeof(fce_teacher) == FCE_TEACHER_SIZE_V1_0, "fce_teacher changed size");
  if (!teacher) return fail(FCE_ERROR_NULL_POINTER, "%s: teacher is NULL", fn);
  const size_t size = teacher->struct_size;
  if (size > sizeof(fce_teacher))
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: teacher->struct_size (%zu) is larger than this library's struct (%zu): the "
                "caller's header is newer than the library (version %u)",
                fn, size, sizeof(fce_teacher), (unsigned)FCE_VERSION_NUMBER);
  if (size != FCE_TEACHER_SIZE_V1_0)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: teacher->struct_size (%zu) is not the size of any version (%d in 1.0): "
                "initialise it with FCE_TEACHER_INIT",
                fn, size, FCE_TEACHER_SIZE_V1_0);
  const fce_teacher defaults = FCE_TEACHER_INIT;
  *t = defaults;
  std::memcpy(t, teacher, size);
  if (t->reserved0 != 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: teacher->reserved0 (%d) must be 0", fn,
                t->reserved0);
  if (t->divergence != FCE_DIVERGENCE_FORWARD_KL && t->divergence != FCE_DIVERGENCE_REVERSE_KL &&
      t->divergence != FCE_DIVERGENCE_JSD)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: teacher->divergence (%d) is not an fce_divergence",
                fn, t->divergence);
  if (!(t->beta >= 0.0f && t->beta <= 1.0f))
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: teacher->beta (%g) must be in [0, 1]", fn,
                (double)t->beta);
  if (!(t->temperature > 0.0f) || !std::isfinite(t->temperature))
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: teacher->temperature (%g) must be finite and > 0",
                fn, (double)t->temperature);
  return FCE_SUCCESS;
}

// The options every call shares (check_options), then those a distillation does not take:
// FCE_ERROR_UNSUPPORTED naming the call and the field.
fce_status check_distill_options(const char* fn, const fce_options* o, const fce_teacher& t,
                                 int64_t rows, int64_t vocab, fce::DistillOptions* out) {
  fce::CeOptions ce;
  FCE_TRY(check_options(fn, o, rows, vocab, &ce));
  FCE_TRY(refuse_soft_targets(fn, *o));
  FCE_TRY(refuse_batch_invariant(fn, ce));
  const struct {
    const char* name;
    bool set;
  } refused[] = {{"class_weights", o->class_weights != nullptr},
                 {"label_smoothing", o->label_smoothing != 0.0f},
                 {"z_loss_scale", o->z_loss_scale != 0.0f},
                 {"token_scaling", o->token_scaling != 0},
                 {"shift_seq_len", o->shift_seq_len != 0}};
  for (const auto& r : refused)
    if (r.set)
      return fail(FCE_ERROR_UNSUPPORTED,
                  "%s: options->%s is not supported by %s (a distillation has no target class%s)",
                  fn, r.name, fn,
                  std::strcmp(r.name, "shift_seq_len") == 0 ? ": pass the shifted targets" : "");
  out->dtype = ce.dtype;
  out->targets_int64 = ce.targets_int64;
  out->reduction = ce.reduction;
  out->ignore_index = ce.ignore_index;
  out->softcap = ce.softcap;
  out->logit_scale = ce.logit_scale;
  out->divergence = t.divergence;
  out->beta = t.beta;
  out->temperature = t.temperature;
  return FCE_SUCCESS;
}

// The outputs and gradients a distillation does not write.
fce_status refuse_outputs(const char* fn, const fce_outputs& out, const fce_gradients& g) {
  const struct {
    const char* name;
    const void* ptr;
  } refused[] = {{"outputs->z_loss", out.z_loss},      {"outputs->argmax", out.argmax},
                 {"outputs->accuracy", out.accuracy},  {"outputs->entropy", out.entropy},
                 {"gradients->grad_lse", g.grad_lse},  {"gradients->grad_entropy", g.grad_entropy},
                 {"gradients->grad_bias", g.grad_bias}};
  for (const auto& r : refused)
    if (r.ptr) return fail(FCE_ERROR_UNSUPPORTED, "%s: %s is not supported by %s", fn, r.name, fn);
  return FCE_SUCCESS;
}

// The teacher fields of the other call must be absent (NULL, 0).
fce_status check_teacher_fields(const char* fn, const fce_teacher& t, bool linear) {
  const struct {
    const char* name;
    bool set;
  } other[] = {{"logits", linear && t.logits},
               {"row_stride", linear && t.row_stride != 0},
               {"hidden_states", !linear && t.hidden_states},
               {"weight", !linear && t.weight},
               {"hidden", !linear && t.hidden != 0},
               {"hidden_row_stride", !linear && t.hidden_row_stride != 0}};
  for (const auto& f : other)
    if (f.set)
      return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: teacher->%s is set, but %s does not read it", fn,
                  f.name, fn);
  return FCE_SUCCESS;
}

fce_status check_teacher_hidden(const char* fn, const fce_teacher& t) {
  if (t.hidden < 1 || t.hidden > kMaxVocab)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: teacher->hidden (%lld) must be in [1, 2^31-1]", fn,
                (long long)t.hidden);
  return FCE_SUCCESS;
}

}  // namespace abi
}  // namespace fce

namespace {

using fce::fail;
using namespace fce::abi;

size_t distill_workspace(const fce_options& o, const fce::DistillOptions& opt, int64_t rows,
                         int64_t vocab) {
  if (rows == 0) return 0;
  return o.backend == FCE_BACKEND_CPU ? fce::cpu_distill_workspace_size(opt, rows, vocab)
                                      : fce::cuda_distill_workspace_size(opt, rows, vocab);
}

void linear_workspace(const fce_options& o, const fce::DistillOptions& opt, int64_t rows,
                      int64_t hidden, int64_t teacher_hidden, int64_t vocab, bool with_grad,
                      size_t* min_bytes, size_t* optimal_bytes) {
  if (rows == 0) *min_bytes = *optimal_bytes = 0;
  else if (o.backend == FCE_BACKEND_CPU)
    fce::cpu_linear_distill_workspace_size(opt, rows, hidden, teacher_hidden, vocab, with_grad,
                                           min_bytes, optimal_bytes);
  else
    fce::cuda_linear_distill_workspace_size(opt, rows, hidden, teacher_hidden, vocab, with_grad,
                                            o.grad_weight_fp32 != 0, min_bytes, optimal_bytes);
}

// A workspace query's start: the options, the teacher and the options a distillation takes.
fce_status begin_query(const char* fn, const fce_options* options, const fce_teacher* teacher,
                       int64_t rows, int64_t vocab, fce_options* o, fce_teacher* t,
                       fce::DistillOptions* opt) {
  FCE_TRY(begin_call(fn, options, o));
  FCE_TRY(read_teacher(fn, teacher, t));
  return check_distill_options(fn, o, *t, rows, vocab, opt);
}

}  // namespace

extern "C" {

FCE_API fce_status fce_distill_workspace_size(const fce_options* options,
                                              const fce_teacher* teacher, int64_t rows,
                                              int64_t vocab, size_t* workspace_bytes) {
  const char* fn = "fce_distill_workspace_size";
  fce_options o;
  fce_teacher t;
  fce::DistillOptions opt;
  FCE_TRY(begin_query(fn, options, teacher, rows, vocab, &o, &t, &opt));
  FCE_TRY(check_size_output(fn, workspace_bytes));
  *workspace_bytes = distill_workspace(o, opt, rows, vocab);
  return FCE_SUCCESS;
}

FCE_API fce_status fce_distill(const fce_options* options, const fce_teacher* teacher, int64_t rows,
                               int64_t vocab, const void* logits, const void* targets,
                               const fce_outputs* outputs, const fce_gradients* gradients,
                               void* workspace, size_t workspace_bytes, void* stream) {
  const char* fn = "fce_distill";
  CallArgs a;
  FCE_TRY(begin_compute(fn, options, nullptr, false, outputs, gradients, kLossCall, &a));
  fce_teacher t;
  FCE_TRY(read_teacher(fn, teacher, &t));
  const fce_options* o = &a.o;
  fce::DistillProblem p{};
  FCE_TRY(check_distill_options(fn, o, t, rows, vocab, &p.opt));
  FCE_TRY(refuse_outputs(fn, a.out, a.g));
  FCE_TRY(check_teacher_fields(fn, t, false));
  const Entries e(*o, rows);
  const bool empty = rows == 0;
  FCE_TRY(check_required(fn, {{"outputs->loss", a.out.loss, e.reduced_floats() == 0},
                              {"logits", logits, empty},
                              {"teacher->logits", t.logits, empty}}));
  FCE_TRY(check_stride(fn, "options->row_stride", o->row_stride, vocab, &p.row_stride));
  FCE_TRY(check_stride(fn, "teacher->row_stride", t.row_stride, vocab, &p.teacher_row_stride));
  FCE_TRY(
      check_stride(fn, "options->grad_row_stride", o->grad_row_stride, vocab, &p.grad_row_stride));
  void* grad = a.g.grad_logits;
  const int64_t logits_bytes = span_bytes(rows, vocab, p.row_stride, e.esize);
  const int64_t teacher_bytes = span_bytes(rows, vocab, p.teacher_row_stride, e.esize);
  const int64_t grad_bytes = grad ? span_bytes(rows, vocab, p.grad_row_stride, e.esize) : 0;
  if (logits_bytes < 0 || teacher_bytes < 0 || grad_bytes < 0 || rows > kMaxBytes / 8)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: rows (%lld) x row stride overflows a 64-bit byte offset", fn, (long long)rows);
  const fce::Arg args[] = {
      {"logits", logits, static_cast<uint64_t>(logits_bytes), e.esize, false},
      {"teacher->logits", t.logits, static_cast<uint64_t>(teacher_bytes), e.esize, false},
      e.targets(targets),
      e.grad_output(a.g.grad_output),
      e.loss(a.out.loss),
      e.lse(a.out.lse, true),
      {"gradients->grad_logits", grad, static_cast<uint64_t>(grad_bytes), e.esize, true},
      error_flags_arg(a.out.error_flags),
      workspace_arg(workspace, workspace_bytes),
  };
  const InPlace in_place{p.row_stride, p.grad_row_stride};
  FCE_TRY(check_args(fn, args, &in_place));
  FCE_TRY(
      check_workspace(fn, distill_workspace(*o, p.opt, rows, vocab), workspace, workspace_bytes));
  if (empty) return empty_problem(fn, *o, args, {e.reduced_zeros(a.out.loss)}, stream);
  p.fn = fn;
  p.rows = rows;
  p.vocab = vocab;
  p.logits = logits;
  p.teacher = t.logits;
  p.targets = targets;
  p.loss = a.out.loss;
  p.lse = a.out.lse;
  p.grad = grad;
  p.grad_output = a.g.grad_output;
  set_workspace(&p, workspace, workspace_bytes, stream);
  return dispatch(*o, args, p, fce::cpu_distill, fce::cuda_distill);
}

FCE_API fce_status fce_linear_distill_workspace_size(const fce_options* options,
                                                     const fce_teacher* teacher, int64_t rows,
                                                     int64_t hidden, int64_t vocab, int with_grad,
                                                     size_t* min_bytes, size_t* optimal_bytes) {
  const char* fn = "fce_linear_distill_workspace_size";
  fce_options o;
  fce_teacher t;
  fce::DistillOptions opt;
  FCE_TRY(begin_query(fn, options, teacher, rows, vocab, &o, &t, &opt));
  FCE_TRY(check_hidden(fn, hidden));
  FCE_TRY(check_teacher_hidden(fn, t));
  FCE_TRY(check_size_outputs(fn, min_bytes, optimal_bytes));
  size_t lo = 0, hi = 0;
  linear_workspace(o, opt, rows, hidden, t.hidden, vocab, with_grad != 0, &lo, &hi);
  write_sizes(min_bytes, optimal_bytes, lo, hi);
  return FCE_SUCCESS;
}

FCE_API fce_status fce_linear_distill(const fce_options* options, const fce_teacher* teacher,
                                      int64_t rows, int64_t hidden, int64_t vocab,
                                      const void* hidden_states, const void* weight,
                                      const void* targets, const fce_outputs* outputs,
                                      const fce_gradients* gradients, void* workspace,
                                      size_t workspace_bytes, void* stream) {
  const char* fn = "fce_linear_distill";
  CallArgs a;
  FCE_TRY(begin_compute(fn, options, nullptr, false, outputs, gradients,
                        {OutputsUse::kLoss, GradientsUse::kLinear, false}, &a));
  fce_teacher t;
  FCE_TRY(read_teacher(fn, teacher, &t));
  const fce_options* o = &a.o;
  fce::LinearDistillProblem p{};
  FCE_TRY(check_distill_options(fn, o, t, rows, vocab, &p.opt));
  FCE_TRY(refuse_outputs(fn, a.out, a.g));
  FCE_TRY(check_teacher_fields(fn, t, true));
  FCE_TRY(check_hidden(fn, hidden));
  FCE_TRY(check_teacher_hidden(fn, t));
  const Entries e(*o, rows);
  const bool empty = rows == 0;
  FCE_TRY(check_required(fn, {{"hidden_states", hidden_states, empty},
                              {"weight", weight},
                              {"teacher->hidden_states", t.hidden_states, empty},
                              {"teacher->weight", t.weight},
                              {"outputs->loss", a.out.loss, e.reduced_floats() == 0}}));
  FCE_TRY(check_stride(fn, "options->hidden_row_stride", o->hidden_row_stride, hidden,
                       &p.hidden_row_stride));
  FCE_TRY(check_stride(fn, "teacher->hidden_row_stride", t.hidden_row_stride, t.hidden,
                       &p.teacher_hidden_row_stride, "teacher->hidden"));
  if (rows == 1) {  // one row has no next row: the dense stride (BLAS and cuBLASLt take int)
    p.hidden_row_stride = hidden;
    p.teacher_hidden_row_stride = t.hidden;
  }
  void* grad_hidden = a.g.grad_hidden;
  void* grad_weight = a.g.grad_weight;
  const size_t gw_size = o->grad_weight_fp32 ? 4 : e.esize;
  const int64_t h_bytes = span_bytes(rows, hidden, p.hidden_row_stride, e.esize);
  const int64_t th_bytes = span_bytes(rows, t.hidden, p.teacher_hidden_row_stride, e.esize);
  const int64_t w_bytes = span_bytes(vocab, hidden, hidden, 4);
  const int64_t tw_bytes = span_bytes(vocab, t.hidden, t.hidden, 4);
  const int64_t gh_bytes = span_bytes(rows, hidden, hidden, e.esize);
  if (h_bytes < 0 || th_bytes < 0 || w_bytes < 0 || tw_bytes < 0 || gh_bytes < 0 ||
      rows > kMaxBytes / 8)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: the sizes (rows %lld, hidden %lld, teacher->hidden %lld, vocab %lld) "
                "overflow a 64-bit byte offset",
                fn, (long long)rows, (long long)hidden, (long long)t.hidden, (long long)vocab);
  const uint64_t vd = static_cast<uint64_t>(vocab) * static_cast<uint64_t>(hidden);
  const uint64_t vtd = static_cast<uint64_t>(vocab) * static_cast<uint64_t>(t.hidden);
  const fce::Arg args[] = {
      {"hidden_states", hidden_states, static_cast<uint64_t>(h_bytes), e.esize, false},
      {"weight", weight, vd * e.esize, e.esize, false},
      {"teacher->hidden_states", t.hidden_states, static_cast<uint64_t>(th_bytes), e.esize, false},
      {"teacher->weight", t.weight, vtd * e.esize, e.esize, false},
      e.targets(targets),
      e.grad_output(a.g.grad_output),
      e.loss(a.out.loss),
      e.lse(a.out.lse, true),
      {"gradients->grad_hidden", grad_hidden, static_cast<uint64_t>(gh_bytes), e.esize, true},
      {"gradients->grad_weight", grad_weight, vd * gw_size, gw_size, true},
      error_flags_arg(a.out.error_flags),
      workspace_arg(workspace, workspace_bytes),
  };
  FCE_TRY(check_args(fn, args));
  const bool with_grad = grad_hidden || grad_weight;
  size_t min_bytes = 0, optimal_bytes = 0;
  linear_workspace(*o, p.opt, rows, hidden, t.hidden, vocab, with_grad, &min_bytes, &optimal_bytes);
  FCE_TRY(check_workspace(fn, min_bytes, workspace, workspace_bytes));
  if (empty)  // the reduced loss is 0, and so is ∂W (a sum over no rows)
    return empty_problem(
        fn, *o, args,
        {e.reduced_zeros(a.out.loss), weight_grad_zeros(*o, grad_weight, vd * gw_size)}, stream);
  p.fn = fn;
  p.rows = rows;
  p.hidden = hidden;
  p.vocab = vocab;
  p.teacher_hidden = t.hidden;
  p.hidden_states = hidden_states;
  p.weight = weight;
  p.teacher_hidden_states = t.hidden_states;
  p.teacher_weight = t.weight;
  p.targets = targets;
  p.loss = a.out.loss;
  p.lse = a.out.lse;
  p.grad_hidden = grad_hidden;
  p.grad_weight = grad_weight;
  p.grad_weight_fp32 = o->grad_weight_fp32 != 0;
  p.accumulate = o->accumulate != 0;
  p.grad_output = a.g.grad_output;
  set_workspace(&p, workspace, workspace_bytes, stream);
  return dispatch(*o, args, p, fce::cpu_linear_distill, fce::cuda_linear_distill);
}

}  // extern "C"
