// api_vp_linear_distill.cpp — the C ABI of the vocabulary-parallel distillation from hidden
// states (docs/semantics.md rule 22): fce_vp_linear_distill_stats (each round),
// fce_vp_linear_distill_backward and their workspace queries. The options, the teacher, the
// rounds and the refusals are fce_vp_distill_*'s (api_distill.h), the linear layer's sizes and
// gradients fce_vp_linear_*'s and fce_linear_distill's (validate.h); every argument is checked
// and named when wrong before anything is written, then the problem goes to a backend.
#include "api_distill.h"
#include "vp_distill.h"

namespace {

using fce::fail;
using namespace fce::abi;

// The backends' workspace (both calls; the query of the statistics knows no ranks and passes 1).
void vpld_workspace(const fce_options& o, const fce::DistillOptions& opt, int64_t rows,
                    int64_t hidden, int64_t teacher_hidden, int64_t vocab_local, bool backward,
                    size_t* min_bytes, size_t* optimal_bytes) {
  if (rows == 0)  // the empty problem: nothing computed
    *min_bytes = *optimal_bytes = 0;
  else if (o.backend == FCE_BACKEND_CPU)
    fce::cpu_linear_distill_workspace_size(opt, rows, hidden, teacher_hidden, vocab_local, backward,
                                           min_bytes, optimal_bytes);
  else
    fce::cuda_vp_linear_distill_workspace_size(opt, rows, hidden, teacher_hidden, vocab_local,
                                               backward, min_bytes, optimal_bytes);
}

// hidden and teacher->hidden, then (the compute calls) the hidden states' strides into p (one
// row has no stride) and the bytes of both hidden states; the shards [vocab_local, hidden] and
// [vocab_local, teacher->hidden] and a float32 [rows, hidden] must fit a 64-bit byte offset too.
fce_status check_hidden_sizes(const char* fn, const fce_teacher& t, int64_t hidden) {
  FCE_TRY(check_hidden(fn, hidden));
  return check_teacher_hidden(fn, t);
}
fce_status check_linear_spans(const char* fn, const fce_options& o, const fce_teacher& t,
                              fce::VpLinearDistillProblem* p, uint64_t* h_bytes,
                              uint64_t* th_bytes) {
  FCE_TRY(check_stride(fn, "options->hidden_row_stride", o.hidden_row_stride, p->hidden,
                       &p->hidden_row_stride));
  FCE_TRY(check_stride(fn, "teacher->hidden_row_stride", t.hidden_row_stride, t.hidden,
                       &p->teacher_hidden_row_stride, "teacher->hidden"));
  if (p->rows == 1) {  // one row has no next row: the dense stride (BLAS and cuBLASLt take int)
    p->hidden_row_stride = p->hidden;
    p->teacher_hidden_row_stride = t.hidden;
  }
  const size_t e = fce::dtype_size(o.dtype);
  const int64_t h = span_bytes(p->rows, p->hidden, p->hidden_row_stride, e);
  const int64_t th = span_bytes(p->rows, t.hidden, p->teacher_hidden_row_stride, e);
  const int64_t w = span_bytes(p->vocab_local, p->hidden, p->hidden, 4);
  const int64_t tw = span_bytes(p->vocab_local, t.hidden, t.hidden, 4);
  const int64_t gh = span_bytes(p->rows, p->hidden, p->hidden, 4);
  if (h < 0 || th < 0 || w < 0 || tw < 0 || gh < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: the sizes (rows %lld, hidden %lld, teacher->hidden %lld, vocab_local %lld) "
                "overflow a 64-bit byte offset",
                fn, (long long)p->rows, (long long)p->hidden, (long long)t.hidden,
                (long long)p->vocab_local);
  *h_bytes = static_cast<uint64_t>(h);
  *th_bytes = static_cast<uint64_t>(th);
  p->teacher_hidden = t.hidden;
  return FCE_SUCCESS;
}

// The linear layer takes no bias (as fce_linear_distill): the argument is there for the
// signature of fce_vp_linear_stats / fce_vp_linear_backward, and must be NULL.
fce_status refuse_bias(const char* fn, const void* bias) {
  if (!bias) return FCE_SUCCESS;
  return fail(FCE_ERROR_UNSUPPORTED,
              "%s: bias is not supported by %s (the distillation's linear layers have none: pass "
              "NULL)",
              fn, fn);
}

// The problem's step (set_vp_step, as the other vocabulary-parallel calls) and its inputs.
void set_inputs(fce::VpLinearDistillProblem* p, const char* fn, bool backward, int64_t ranks,
                int64_t vocab_total, int64_t vocab_start, const void* targets,
                const float* gathered, const void* hidden_states, const void* weight,
                const fce_teacher& t) {
  set_vp_step(p, fn, backward, ranks, p->rows, vocab_total, vocab_start, p->vocab_local, targets,
              gathered);
  p->hidden_states = hidden_states;
  p->weight = weight;
  p->teacher_hidden_states = t.hidden_states;
  p->teacher_weight = t.weight;
}

}  // namespace

extern "C" {

FCE_API fce_status fce_vp_linear_distill_stats_workspace_size(
    const fce_options* options, const fce_teacher* teacher, int64_t rows, int64_t hidden,
    int64_t vocab_local, size_t* min_bytes, size_t* optimal_bytes) {
  const char* fn = "fce_vp_linear_distill_stats_workspace_size";
  fce_options o;
  FCE_TRY(begin_call(fn, options, &o));
  if (vocab_local < 1 || vocab_local > kMaxVocab)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: vocab_local (%lld) must be in [1, 2^31-1]", fn,
                (long long)vocab_local);
  fce_teacher t;
  fce::DistillOptions opt;
  FCE_TRY(check_vp_distill_common(fn, &o, teacher, rows, vocab_local, TeacherFields::kLinear, &t,
                                  &opt));
  FCE_TRY(check_hidden_sizes(fn, t, hidden));
  FCE_TRY(check_vp_rows(fn, rows, nullptr));
  FCE_TRY(check_size_outputs(fn, min_bytes, optimal_bytes));
  size_t lo = 0, hi = 0;
  vpld_workspace(o, opt, rows, hidden, t.hidden, vocab_local, false, &lo, &hi);
  write_sizes(min_bytes, optimal_bytes, lo, hi);
  return FCE_SUCCESS;
}

FCE_API fce_status fce_vp_linear_distill_stats(
    const fce_options* options, const fce_teacher* teacher, const fce_vp_shard* shard,
    int32_t round, int64_t rows, int64_t hidden, const void* hidden_states, const void* weight,
    const void* bias, const float* previous, float* stats, void* workspace, size_t workspace_bytes,
    void* stream) {
  const char* fn = "fce_vp_linear_distill_stats";
  fce_options local;
  fce_teacher t;
  fce::VpLinearDistillProblem p{};
  FCE_TRY(begin_vp_stats(fn, options, teacher, shard, round, rows, previous, TeacherFields::kLinear,
                         &local, &t, &p.opt));
  const fce_options* o = &local;
  const int64_t ranks = shard->ranks, vocab_total = shard->vocab_total,
                vocab_start = shard->vocab_start, vocab_local = shard->vocab_local;
  FCE_TRY(check_hidden_sizes(fn, t, hidden));
  FCE_TRY(refuse_bias(fn, bias));
  const bool empty = rows == 0;  // per-row buffers of no elements may be NULL
  FCE_TRY(check_required(fn, {{"hidden_states", hidden_states, empty},
                              {"weight", weight},
                              {"teacher->hidden_states", t.hidden_states, empty},
                              {"teacher->weight", t.weight},
                              {"previous", previous, empty || round == 1},
                              {"stats", stats, empty}}));
  p.rows = rows;
  p.hidden = hidden;
  p.vocab_local = vocab_local;
  uint64_t h_bytes = 0, th_bytes = 0;
  FCE_TRY(check_linear_spans(fn, *o, t, &p, &h_bytes, &th_bytes));
  const Entries e(*o, rows);
  const uint64_t v = static_cast<uint64_t>(vocab_local);
  const fce::Arg args[] = {
      {"hidden_states", hidden_states, h_bytes, e.esize, false},
      {"weight", weight, v * static_cast<uint64_t>(hidden) * e.esize, e.esize, false},
      {"teacher->hidden_states", t.hidden_states, th_bytes, e.esize, false},
      {"teacher->weight", t.weight, v * static_cast<uint64_t>(t.hidden) * e.esize, e.esize, false},
      vp_distill_gathered_arg("previous", round == 2 ? previous : nullptr, ranks, rows),
      e.stats(stats),
      workspace_arg(workspace, workspace_bytes),
  };
  FCE_TRY(check_args(fn, args));
  size_t min_bytes = 0, optimal_bytes = 0;
  vpld_workspace(*o, p.opt, rows, hidden, t.hidden, vocab_local, false, &min_bytes, &optimal_bytes);
  FCE_TRY(check_workspace(fn, min_bytes, workspace, workspace_bytes));
  if (empty) return empty_problem(fn, *o, args, {}, stream);  // no row: nothing to write
  set_inputs(&p, fn, false, ranks, vocab_total, vocab_start, nullptr, nullptr, hidden_states,
             weight, t);
  p.round = round;
  p.previous = previous;
  p.stats = stats;
  p.grad_hidden_dtype = FCE_FLOAT32;
  set_workspace(&p, workspace, workspace_bytes, stream);
  return dispatch(*o, args, p, fce::cpu_vp_linear_distill, fce::cuda_vp_linear_distill);
}

FCE_API fce_status fce_vp_linear_distill_backward_workspace_size(
    const fce_options* options, const fce_teacher* teacher, int64_t ranks, int64_t rows,
    int64_t hidden, int64_t vocab_total, int64_t vocab_local, int32_t grad_hidden_dtype,
    size_t* min_bytes, size_t* optimal_bytes) {
  const char* fn = "fce_vp_linear_distill_backward_workspace_size";
  fce_options o;
  FCE_TRY(begin_call(fn, options, &o));
  FCE_TRY(check_vp_vocab(fn, vocab_total, 0, vocab_local, false));
  fce_teacher t;
  fce::DistillOptions opt;
  FCE_TRY(check_vp_distill_common(fn, &o, teacher, rows, vocab_total, TeacherFields::kLinear, &t,
                                  &opt));
  FCE_TRY(check_hidden_sizes(fn, t, hidden));
  FCE_TRY(check_vp_rows(fn, rows, &ranks));
  FCE_TRY(check_grad_hidden_dtype(fn, grad_hidden_dtype, o.dtype));
  FCE_TRY(check_size_outputs(fn, min_bytes, optimal_bytes));
  size_t lo = 0, hi = 0;
  vpld_workspace(o, opt, rows, hidden, t.hidden, vocab_local, true, &lo, &hi);
  write_sizes(min_bytes, optimal_bytes, lo, hi);
  return FCE_SUCCESS;
}

FCE_API fce_status fce_vp_linear_distill_backward(
    const fce_options* options, const fce_teacher* teacher, const fce_vp_shard* shard, int64_t rows,
    int64_t hidden, const void* hidden_states, const void* weight, const void* bias,
    const void* targets, const float* gathered_stats, const fce_gradients* gradients,
    void* workspace, size_t workspace_bytes, void* stream) {
  const char* fn = "fce_vp_linear_distill_backward";
  CallArgs a;
  FCE_TRY(begin_compute(fn, options, shard, true, nullptr, gradients,
                        {OutputsUse::kFlagsOnly, GradientsUse::kVpLinear, true}, &a));
  const fce_options* o = &a.o;
  const auto [ranks, vocab_total, vocab_start, vocab_local, gather, context] = a.shard;
  FCE_TRY(check_vp_vocab(fn, vocab_total, vocab_start, vocab_local, true));
  fce::VpLinearDistillProblem p{};
  fce_teacher t;
  FCE_TRY(check_vp_distill_common(fn, o, teacher, rows, vocab_total, TeacherFields::kLinear, &t,
                                  &p.opt));
  FCE_TRY(refuse_outputs(fn, a.out, a.g));
  FCE_TRY(check_vp_rows(fn, rows, &ranks));
  FCE_TRY(check_hidden_sizes(fn, t, hidden));
  FCE_TRY(refuse_bias(fn, bias));
  const int32_t grad_hidden_dtype = a.g.grad_hidden_dtype;
  FCE_TRY(check_grad_hidden_dtype(fn, grad_hidden_dtype, o->dtype));
  void* grad_hidden = a.g.grad_hidden;
  void* grad_weight = a.g.grad_weight;
  const bool empty = rows == 0;  // per-row buffers of no elements may be NULL
  FCE_TRY(check_required(fn, {{"hidden_states", hidden_states, empty},
                              {"weight", weight},
                              {"teacher->hidden_states", t.hidden_states, empty},
                              {"teacher->weight", t.weight},
                              {"gathered_stats", gathered_stats, empty}}));
  // (with no row, a grad_hidden of no element may be NULL: both NULL is then no error)
  if (!empty && !grad_hidden && !grad_weight)
    return fail(FCE_ERROR_NULL_POINTER,
                "%s: gradients->grad_hidden and ->grad_weight are both NULL: at least one "
                "gradient is needed",
                fn);
  p.rows = rows;
  p.hidden = hidden;
  p.vocab_local = vocab_local;
  uint64_t h_bytes = 0, th_bytes = 0;
  FCE_TRY(check_linear_spans(fn, *o, t, &p, &h_bytes, &th_bytes));
  const Entries e(*o, rows);
  const size_t gw_size = o->grad_weight_fp32 ? 4 : e.esize;
  const size_t gh_size = fce::dtype_size(grad_hidden_dtype);
  const uint64_t v = static_cast<uint64_t>(vocab_local);
  const uint64_t vd = v * static_cast<uint64_t>(hidden);
  const uint64_t nd = static_cast<uint64_t>(rows) * static_cast<uint64_t>(hidden);
  const fce::Arg args[] = {
      {"hidden_states", hidden_states, h_bytes, e.esize, false},
      {"weight", weight, vd * e.esize, e.esize, false},
      {"teacher->hidden_states", t.hidden_states, th_bytes, e.esize, false},
      {"teacher->weight", t.weight, v * static_cast<uint64_t>(t.hidden) * e.esize, e.esize, false},
      e.targets(targets),
      vp_distill_gathered_arg("gathered_stats", gathered_stats, ranks, rows),
      e.grad_output(a.g.grad_output),
      {"gradients->grad_hidden", grad_hidden, nd * gh_size, gh_size, true},
      {"gradients->grad_weight", grad_weight, vd * gw_size, gw_size, true},
      workspace_arg(workspace, workspace_bytes),
  };
  FCE_TRY(check_args(fn, args));
  size_t min_bytes = 0, optimal_bytes = 0;
  vpld_workspace(*o, p.opt, rows, hidden, t.hidden, vocab_local, true, &min_bytes, &optimal_bytes);
  FCE_TRY(check_workspace(fn, min_bytes, workspace, workspace_bytes));
  if (empty)  // ∂W is 0 (a sum over no rows): written, or with accumulate left as it is
    return empty_problem(fn, *o, args, {weight_grad_zeros(*o, grad_weight, vd * gw_size)}, stream);
  set_inputs(&p, fn, true, ranks, vocab_total, vocab_start, targets, gathered_stats, hidden_states,
             weight, t);
  p.grad_output = a.g.grad_output;
  p.grad_hidden = grad_hidden;
  p.grad_hidden_dtype = grad_hidden_dtype;
  p.grad_weight = grad_weight;
  p.grad_weight_fp32 = o->grad_weight_fp32 != 0;
  p.accumulate = o->accumulate != 0;
  set_workspace(&p, workspace, workspace_bytes, stream);
  return dispatch(*o, args, p, fce::cpu_vp_linear_distill, fce::cuda_vp_linear_distill);
}

}  // extern "C"
