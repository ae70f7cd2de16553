// api_vp_distill.cpp — the C ABI of the vocabulary-parallel distillation (docs/semantics.md rule
// 22): fce_vp_distill_rounds, fce_vp_distill_stats (each round), fce_vp_distill_loss and
// fce_vp_distill_backward and their workspace queries. The options, the teacher and the
// refusals are fce_distill's (api_distill.h), the sizes and the statistics the fce_vp_* calls'
// (validate.h); every argument is checked and named when wrong before anything is written, then
// the problem goes to a backend.
#include "api_distill.h"
#include "vp_distill.h"

namespace {

using fce::fail;
using namespace fce::abi;

static_assert(FCE_VP_DISTILL_STATS * 4 == kStatsBytes, "the statistics' rows of 32 bytes");

size_t vd_workspace(const fce_options& o, const fce::DistillOptions& opt, int64_t ranks,
                    int64_t rows, bool backward) {
  if (rows == 0) return 0;
  return o.backend == FCE_BACKEND_CPU
             ? fce::cpu_vp_distill_workspace_size(opt, ranks, rows, backward)
             : fce::cuda_vp_distill_workspace_size(opt, ranks, rows, backward);
}

// The bytes of a shard [rows, vocab_local], stride apart, or an error when they overflow.
fce_status shard_bytes(const char* fn, const char* name, int64_t rows, int64_t vocab_local,
                       int64_t stride, size_t esize, uint64_t* bytes) {
  const int64_t b = span_bytes(rows, vocab_local, stride, esize);
  if (b < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: rows (%lld) x the row stride of %s overflows a 64-bit byte offset", fn,
                (long long)rows, name);
  *bytes = static_cast<uint64_t>(b);
  return FCE_SUCCESS;
}

// The two workspace queries (backward: vocab_local is an argument).
fce_status workspace_query(const char* fn, const fce_options* options, const fce_teacher* teacher,
                           int64_t ranks, int64_t rows, int64_t vocab_total, int64_t vocab_local,
                           bool backward, size_t* bytes) {
  fce_options o;
  FCE_TRY(begin_call(fn, options, &o));
  if (backward) FCE_TRY(check_vp_vocab(fn, vocab_total, 0, vocab_local, false));
  else FCE_TRY(check_vocab_total(fn, vocab_total));
  fce_teacher t;
  fce::DistillOptions opt;
  FCE_TRY(check_vp_distill_common(fn, &o, teacher, rows, vocab_total,
                                  backward ? TeacherFields::kLogits : TeacherFields::kAny, &t,
                                  &opt));
  FCE_TRY(check_vp_rows(fn, rows, &ranks));
  FCE_TRY(check_size_output(fn, bytes));
  *bytes = vd_workspace(o, opt, ranks, rows, backward);
  return FCE_SUCCESS;
}

}  // namespace

namespace fce {
namespace abi {

fce_status check_vp_distill_common(const char* fn, const fce_options* o, const fce_teacher* teacher,
                                   int64_t rows, int64_t vocab_total, TeacherFields fields,
                                   fce_teacher* t, DistillOptions* opt) {
  FCE_TRY(read_teacher(fn, teacher, t));
  FCE_TRY(check_distill_options(fn, o, *t, rows, vocab_total, opt));
  if (o->vp_entropy != 0)
    return fail(FCE_ERROR_UNSUPPORTED, "%s: options->vp_entropy is not supported by %s", fn, fn);
  if (fields == TeacherFields::kAny) return FCE_SUCCESS;
  return check_teacher_fields(fn, *t, fields == TeacherFields::kLinear);
}

int vp_distill_rounds(const fce_teacher& t) {
  return vd_rounds(vd_divergence(t.divergence, t.beta));
}

fce_status check_vp_round(const char* fn, const fce_teacher& t, int32_t round,
                          const float* previous) {
  const int rounds = vp_distill_rounds(t);
  if (round < 1 || round > rounds)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: round (%d) must be in [1, %d]: the teacher's divergence needs %d round%s of "
                "statistics (fce_vp_distill_rounds)",
                fn, (int)round, rounds, rounds, rounds == 1 ? "" : "s");
  if (round == 1 && previous)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: previous is given in round 1 (it is the gathered statistics of round 1, "
                "read by round 2: pass NULL)",
                fn);
  return FCE_SUCCESS;
}

fce_status begin_vp_stats(const char* fn, const fce_options* options, const fce_teacher* teacher,
                          const fce_vp_shard* shard, int32_t round, int64_t rows,
                          const float* previous, TeacherFields fields, fce_options* o,
                          fce_teacher* t, DistillOptions* opt) {
  FCE_TRY(begin_call(fn, options, o));
  FCE_TRY(check_shard(fn, shard));
  FCE_TRY(check_vp_vocab(fn, shard->vocab_total, shard->vocab_start, shard->vocab_local, true));
  FCE_TRY(check_vp_distill_common(fn, o, teacher, rows, shard->vocab_total, fields, t, opt));
  FCE_TRY(check_vp_round(fn, *t, round, previous));
  return check_vp_rows(fn, rows, round == 2 ? &shard->ranks : nullptr);
}

Arg vp_distill_gathered_arg(const char* name, const float* p, int64_t ranks, int64_t rows) {
  return {name, p, static_cast<uint64_t>(ranks) * static_cast<uint64_t>(rows) * kStatsBytes, 16,
          false};
}

}  // namespace abi
}  // namespace fce

extern "C" {

FCE_API fce_status fce_vp_distill_rounds(const fce_teacher* teacher, int32_t* rounds) {
  const char* fn = "fce_vp_distill_rounds";
  fce::clear_error();
  fce_teacher t;
  FCE_TRY(read_teacher(fn, teacher, &t));
  FCE_TRY(check_required(fn, {{"rounds", rounds}}));
  *rounds = vp_distill_rounds(t);
  return FCE_SUCCESS;
}

FCE_API fce_status fce_vp_distill_stats(const fce_options* options, const fce_teacher* teacher,
                                        const fce_vp_shard* shard, int32_t round, int64_t rows,
                                        const void* logits, const float* previous, float* stats,
                                        void* stream) {
  const char* fn = "fce_vp_distill_stats";
  fce_options local;
  fce_teacher t;
  fce::VpDistillStatsProblem p{};
  FCE_TRY(begin_vp_stats(fn, options, teacher, shard, round, rows, previous, TeacherFields::kLogits,
                         &local, &t, &p.opt));
  const fce_options* o = &local;
  const int64_t ranks = shard->ranks, vocab_total = shard->vocab_total,
                vocab_start = shard->vocab_start, vocab_local = shard->vocab_local;
  const bool empty = rows == 0;  // per-row buffers of no elements may be NULL
  FCE_TRY(check_required(fn, {{"logits", logits, empty},
                              {"teacher->logits", t.logits, empty},
                              {"previous", previous, empty || round == 1},
                              {"stats", stats, empty}}));
  FCE_TRY(check_stride(fn, "options->row_stride", o->row_stride, vocab_local, &p.row_stride,
                       "vocab_local"));
  FCE_TRY(check_stride(fn, "teacher->row_stride", t.row_stride, vocab_local, &p.teacher_row_stride,
                       "vocab_local"));
  const Entries e(*o, rows);
  uint64_t logits_bytes = 0, teacher_bytes = 0;
  FCE_TRY(shard_bytes(fn, "logits", rows, vocab_local, p.row_stride, e.esize, &logits_bytes));
  FCE_TRY(shard_bytes(fn, "teacher->logits", rows, vocab_local, p.teacher_row_stride, e.esize,
                      &teacher_bytes));
  const fce::Arg args[] = {
      {"logits", logits, logits_bytes, e.esize, false},
      {"teacher->logits", t.logits, teacher_bytes, e.esize, false},
      vp_distill_gathered_arg("previous", round == 2 ? previous : nullptr, ranks, rows),
      e.stats(stats),
  };
  FCE_TRY(check_args(fn, args));
  if (empty) return empty_problem(fn, *o, args, {}, stream);  // no row: nothing to write
  p.fn = fn;
  p.round = round;
  p.ranks = ranks;
  p.rows = rows;
  p.vocab_total = vocab_total;
  p.vocab_start = vocab_start;
  p.vocab_local = vocab_local;
  p.first = 0;
  p.count = rows;
  p.logits = logits;
  p.teacher = t.logits;
  p.previous = previous;
  p.stats = stats;
  p.stream = stream;
  return dispatch(*o, args, p, fce::cpu_vp_distill_stats, fce::cuda_vp_distill_stats);
}

FCE_API fce_status fce_vp_distill_loss_workspace_size(const fce_options* options,
                                                      const fce_teacher* teacher, int64_t ranks,
                                                      int64_t rows, int64_t vocab_total,
                                                      size_t* workspace_bytes) {
  return workspace_query("fce_vp_distill_loss_workspace_size", options, teacher, ranks, rows,
                         vocab_total, 0, false, workspace_bytes);
}

FCE_API fce_status fce_vp_distill_loss(const fce_options* options, const fce_teacher* teacher,
                                       const fce_vp_shard* shard, int64_t rows, const void* targets,
                                       const float* gathered_stats, const fce_outputs* outputs,
                                       void* workspace, size_t workspace_bytes, void* stream) {
  const char* fn = "fce_vp_distill_loss";
  CallArgs a;
  FCE_TRY(begin_compute(fn, options, shard, true, outputs, nullptr, kLossCall, &a));
  const fce_options* o = &a.o;
  const int64_t ranks = a.shard.ranks, vocab_total = a.shard.vocab_total;
  FCE_TRY(check_vocab_total(fn, vocab_total));
  fce::VpDistillProblem p{};
  fce_teacher t;
  FCE_TRY(
      check_vp_distill_common(fn, o, teacher, rows, vocab_total, TeacherFields::kAny, &t, &p.opt));
  FCE_TRY(refuse_outputs(fn, a.out, a.g));
  FCE_TRY(check_vp_rows(fn, rows, &ranks));
  const Entries e(*o, rows);
  const bool empty = rows == 0;
  FCE_TRY(check_required(fn, {{"gathered_stats", gathered_stats, empty},
                              {"outputs->loss", a.out.loss, e.reduced_floats() == 0}}));
  const fce::Arg args[] = {
      e.targets(targets),
      vp_distill_gathered_arg("gathered_stats", gathered_stats, ranks, rows),
      e.loss(a.out.loss),
      e.lse(a.out.lse, true),
      error_flags_arg(a.out.error_flags),
      workspace_arg(workspace, workspace_bytes),
  };
  FCE_TRY(check_args(fn, args));
  FCE_TRY(
      check_workspace(fn, vd_workspace(*o, p.opt, ranks, rows, false), workspace, workspace_bytes));
  if (empty) return empty_problem(fn, *o, args, {e.reduced_zeros(a.out.loss)}, stream);
  set_vp_step(&p, fn, false, ranks, rows, vocab_total, 0, 0, targets, gathered_stats);
  p.loss = a.out.loss;
  p.lse = a.out.lse;
  p.error_flags = a.out.error_flags;
  set_workspace(&p, workspace, workspace_bytes, stream);
  return dispatch(*o, args, p, fce::cpu_vp_distill, fce::cuda_vp_distill);
}

FCE_API fce_status fce_vp_distill_backward_workspace_size(const fce_options* options,
                                                          const fce_teacher* teacher, int64_t ranks,
                                                          int64_t rows, int64_t vocab_total,
                                                          int64_t vocab_local,
                                                          size_t* workspace_bytes) {
  return workspace_query("fce_vp_distill_backward_workspace_size", options, teacher, ranks, rows,
                         vocab_total, vocab_local, true, workspace_bytes);
}

FCE_API fce_status fce_vp_distill_backward(const fce_options* options, const fce_teacher* teacher,
                                           const fce_vp_shard* shard, int64_t rows,
                                           const void* logits, const void* targets,
                                           const float* gathered_stats,
                                           const fce_gradients* gradients, void* workspace,
                                           size_t workspace_bytes, void* stream) {
  const char* fn = "fce_vp_distill_backward";
  CallArgs a;
  FCE_TRY(begin_compute(fn, options, shard, true, nullptr, gradients, kLogitsGradCall, &a));
  const fce_options* o = &a.o;
  const auto [ranks, vocab_total, vocab_start, vocab_local, gather, context] = a.shard;
  FCE_TRY(check_vp_vocab(fn, vocab_total, vocab_start, vocab_local, true));
  fce::VpDistillProblem p{};
  fce_teacher t;
  FCE_TRY(check_vp_distill_common(fn, o, teacher, rows, vocab_total, TeacherFields::kLogits, &t,
                                  &p.opt));
  FCE_TRY(refuse_outputs(fn, a.out, a.g));
  FCE_TRY(check_vp_rows(fn, rows, &ranks));
  void* grad = a.g.grad_logits;
  const bool empty = rows == 0;
  FCE_TRY(check_required(fn, {{"logits", logits, empty},
                              {"teacher->logits", t.logits, empty},
                              {"gathered_stats", gathered_stats, empty},
                              {"gradients->grad_logits", grad, empty}}));
  FCE_TRY(check_stride(fn, "options->row_stride", o->row_stride, vocab_local, &p.row_stride,
                       "vocab_local"));
  FCE_TRY(check_stride(fn, "teacher->row_stride", t.row_stride, vocab_local, &p.teacher_row_stride,
                       "vocab_local"));
  FCE_TRY(check_stride(fn, "options->grad_row_stride", o->grad_row_stride, vocab_local,
                       &p.grad_row_stride, "vocab_local"));
  const Entries e(*o, rows);
  uint64_t logits_bytes = 0, teacher_bytes = 0, grad_bytes = 0;
  FCE_TRY(shard_bytes(fn, "logits", rows, vocab_local, p.row_stride, e.esize, &logits_bytes));
  FCE_TRY(shard_bytes(fn, "teacher->logits", rows, vocab_local, p.teacher_row_stride, e.esize,
                      &teacher_bytes));
  FCE_TRY(shard_bytes(fn, "gradients->grad_logits", rows, vocab_local, p.grad_row_stride, e.esize,
                      &grad_bytes));
  const fce::Arg args[] = {
      {"logits", logits, logits_bytes, e.esize, false},
      {"teacher->logits", t.logits, teacher_bytes, e.esize, false},
      e.targets(targets),
      vp_distill_gathered_arg("gathered_stats", gathered_stats, ranks, rows),
      e.grad_output(a.g.grad_output),
      {"gradients->grad_logits", grad, grad_bytes, e.esize, true},
      workspace_arg(workspace, workspace_bytes),
  };
  const InPlace in_place{p.row_stride, p.grad_row_stride};
  FCE_TRY(check_args(fn, args, &in_place));
  FCE_TRY(
      check_workspace(fn, vd_workspace(*o, p.opt, ranks, rows, true), workspace, workspace_bytes));
  if (empty) return empty_problem(fn, *o, args, {}, stream);  // no row: nothing to write
  set_vp_step(&p, fn, true, ranks, rows, vocab_total, vocab_start, vocab_local, targets,
              gathered_stats);
  p.first = 0;
  p.count = rows;
  p.logits = logits;
  p.teacher = t.logits;
  p.grad = grad;
  p.grad_output = a.g.grad_output;
  set_workspace(&p, workspace, workspace_bytes, stream);
  return dispatch(*o, args, p, fce::cpu_vp_distill, fce::cuda_vp_distill);
}

}  // extern "C"
