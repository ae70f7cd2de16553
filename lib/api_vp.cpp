// api_vp.cpp — the C ABI of the vocabulary-parallel cross-entropy over given logits shards:
// fce_vp_stats (phase 1), fce_vp_loss and fce_vp_backward (phase 3) and their workspace queries
// (docs/semantics.md rule 16). Every argument is checked (validate.h) and named when wrong before
// anything is written; then the problem goes to a backend.
#include "validate.h"

namespace {

using fce::fail;
using namespace fce::abi;

// fce_vp_loss_workspace_size (vocab_local 0: no such argument) and
// fce_vp_backward_workspace_size.
fce_status vp_workspace_query(const char* fn, const fce_options* options, int64_t ranks,
                              int64_t rows, int64_t vocab_total, int64_t vocab_local,
                              bool backward, size_t* bytes) {
  fce_options o;
  FCE_TRY(begin_call(fn, options, &o));
  if (backward)
    FCE_TRY(check_vp_vocab(fn, vocab_total, 0, vocab_local, false));
  else
    FCE_TRY(check_vocab_total(fn, vocab_total));
  fce::CeOptions opt;
  FCE_TRY(check_options(fn, &o, rows, vocab_total, &opt));
  FCE_TRY(check_vp_rows(fn, rows, &ranks));
  FCE_TRY(check_size_output(fn, bytes));
  *bytes = vp_workspace(o, opt, ranks, rows, vocab_total, vocab_local, backward);
  return FCE_SUCCESS;
}

// The rows of a logits shard [rows, vocab_local] (options->row_stride apart), or of its
// gradient: *bytes, or an error when they overflow a 64-bit byte offset.
fce_status shard_bytes(const char* fn, int64_t rows, int64_t vocab_local, int64_t stride,
                       size_t esize, uint64_t* bytes) {
  const int64_t b = span_bytes(rows, vocab_local, stride, esize);
  if (b < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: rows (%lld) x row stride overflows a 64-bit byte offset", fn,
                (long long)rows);
  *bytes = static_cast<uint64_t>(b);
  return FCE_SUCCESS;
}

}  // namespace

extern "C" {

FCE_API fce_status fce_vp_stats(const fce_options* options, const fce_vp_shard* shard,
                                int64_t rows, const void* logits, const void* targets,
                                float* stats, void* stream) {
  const char* fn = "fce_vp_stats";
  fce_options local;
  FCE_TRY(begin_call(fn, options, &local));
  FCE_TRY(check_shard(fn, shard));
  const int64_t vocab_total = shard->vocab_total, vocab_start = shard->vocab_start,
                vocab_local = shard->vocab_local;
  const fce_options* o = &local;
  fce::VpStatsProblem p{};
  FCE_TRY(check_vp_vocab(fn, vocab_total, vocab_start, vocab_local, true));
  FCE_TRY(check_options(fn, o, rows, vocab_total, &p.opt));
  FCE_TRY(check_vp_rows(fn, rows, nullptr));
  const bool empty = rows == 0;  // per-row buffers of no elements may be NULL
  FCE_TRY(check_required(
      fn, {{"logits", logits, empty}, {"targets", targets, empty}, {"stats", stats, empty}}));
  FCE_TRY(check_stride(fn, "options->row_stride", o->row_stride, vocab_local, &p.row_stride,
                       "vocab_local"));
  const Entries e(*o, rows);
  uint64_t logits_bytes = 0;
  FCE_TRY(shard_bytes(fn, rows, vocab_local, p.row_stride, e.esize, &logits_bytes));
  const fce::Arg args[] = {
      {"logits", logits, logits_bytes, e.esize, false},
      e.targets(targets, vocab_local),  // class probabilities: this rank's shard of q
      e.class_weights(vocab_total),
      e.stats(stats),
  };
  FCE_TRY(check_args(fn, args));
  if (empty) return empty_problem(fn, *o, args, {}, stream);  // no row: nothing to write
  p.fn = fn;
  p.rows = rows;
  p.vocab_total = vocab_total;
  p.vocab_start = vocab_start;
  p.vocab_local = vocab_local;
  p.logits = logits;
  p.targets = targets;
  p.stats = stats;
  p.stream = stream;
  return dispatch(*o, args, p, fce::cpu_vp_stats, fce::cuda_vp_stats);
}

FCE_API fce_status fce_vp_loss_workspace_size(const fce_options* options, int64_t ranks,
                                              int64_t rows, int64_t vocab_total,
                                              size_t* workspace_bytes) {
  return vp_workspace_query("fce_vp_loss_workspace_size", options, ranks, rows, vocab_total, 0,
                            false, workspace_bytes);
}

FCE_API fce_status fce_vp_loss(const fce_options* options, const fce_vp_shard* shard,
                               int64_t rows, const void* targets, const float* gathered_stats,
                               const fce_outputs* outputs, void* workspace,
                               size_t workspace_bytes, void* stream) {
  const char* fn = "fce_vp_loss";
  CallArgs a;
  FCE_TRY(begin_compute(fn, options, shard, true, outputs, nullptr, kLossCall, &a));
  FCE_TRY(check_vp_entropy(fn, a.o, a.out.entropy, nullptr));
  const fce_outputs& out = a.out;
  const int64_t ranks = a.shard.ranks, vocab_total = a.shard.vocab_total;
  float* loss = out.loss;
  float* z_loss = out.z_loss;
  const fce_options* o = &a.o;
  fce::VpProblem p{};
  FCE_TRY(check_vocab_total(fn, vocab_total));
  FCE_TRY(check_options(fn, o, rows, vocab_total, &p.opt));
  FCE_TRY(refuse_soft_accuracy(fn, *o, out));
  FCE_TRY(check_vp_rows(fn, rows, &ranks));
  const Entries e(*o, rows);
  const bool empty = rows == 0;  // per-row buffers of no elements may be NULL
  // class probabilities: the statistics carry all the loss needs, targets are not read
  if (e.soft) targets = nullptr;
  FCE_TRY(check_required(fn, {{"targets", targets, empty || e.soft},
                              {"gathered_stats", gathered_stats, empty},
                              {"outputs->loss", loss, e.reduced_floats() == 0}}));
  const fce::Arg args[] = {
      e.targets(targets),
      e.class_weights(vocab_total),
      e.gathered_stats(gathered_stats, ranks),
      e.loss(loss),
      e.lse(out.lse, true),
      z_loss_arg(z_loss),
      error_flags_arg(out.error_flags),
      workspace_arg(workspace, workspace_bytes),
      e.argmax(out.argmax),
      e.accuracy(out.accuracy),
      e.entropy(out.entropy),
  };
  FCE_TRY(check_args(fn, args));
  FCE_TRY(check_workspace(fn, vp_workspace(*o, p.opt, ranks, rows, vocab_total, 0, false),
                          workspace, workspace_bytes));
  if (empty)  // the reduced outputs are 0
    return empty_problem(fn, *o, args,
                         {e.reduced_zeros(loss), {z_loss, 4}, e.reduced_zeros(out.accuracy)},
                         stream);
  set_vp_step(&p, fn, false, ranks, rows, vocab_total, 0, 0, targets, gathered_stats);
  set_loss_outputs(&p, out);
  p.entropy = out.entropy;
  p.error_flags = out.error_flags;
  set_workspace(&p, workspace, workspace_bytes, stream);
  return dispatch(*o, args, p, fce::cpu_vp, fce::cuda_vp);
}

FCE_API fce_status fce_vp_backward_workspace_size(const fce_options* options, int64_t ranks,
                                                  int64_t rows, int64_t vocab_total,
                                                  int64_t vocab_local, size_t* workspace_bytes) {
  return vp_workspace_query("fce_vp_backward_workspace_size", options, ranks, rows, vocab_total,
                            vocab_local, true, workspace_bytes);
}

FCE_API fce_status fce_vp_backward(const fce_options* options, const fce_vp_shard* shard,
                                   int64_t rows, const void* logits, const void* targets,
                                   const float* gathered_stats, const fce_gradients* gradients,
                                   void* workspace,
                                   size_t workspace_bytes, void* stream) {
  const char* fn = "fce_vp_backward";
  CallArgs a;
  FCE_TRY(begin_compute(fn, options, shard, true, nullptr, gradients, kLogitsGradCall, &a));
  FCE_TRY(check_vp_entropy(fn, a.o, nullptr, a.g.grad_entropy));
  const fce_gradients& g = a.g;
  const auto [ranks, vocab_total, vocab_start, vocab_local, gather, context] = a.shard;
  void* grad_logits = g.grad_logits;
  const float* grad_output = g.grad_output;
  const fce_options* o = &a.o;
  fce::VpProblem p{};
  FCE_TRY(check_vp_vocab(fn, vocab_total, vocab_start, vocab_local, true));
  FCE_TRY(check_options(fn, o, rows, vocab_total, &p.opt));
  FCE_TRY(check_vp_rows(fn, rows, &ranks));
  const bool empty = rows == 0;  // per-row buffers of no elements may be NULL
  FCE_TRY(check_required(fn, {{"logits", logits, empty},
                              {"targets", targets, empty},
                              {"gathered_stats", gathered_stats, empty},
                              {"gradients->grad_logits", grad_logits, empty}}));
  FCE_TRY(check_stride(fn, "options->row_stride", o->row_stride, vocab_local, &p.row_stride,
                       "vocab_local"));
  FCE_TRY(check_stride(fn, "options->grad_row_stride", o->grad_row_stride, vocab_local,
                       &p.grad_row_stride, "vocab_local"));
  const Entries e(*o, rows);
  uint64_t logits_bytes = 0, grad_bytes = 0;
  FCE_TRY(shard_bytes(fn, rows, vocab_local, p.row_stride, e.esize, &logits_bytes));
  FCE_TRY(shard_bytes(fn, rows, vocab_local, p.grad_row_stride, e.esize, &grad_bytes));
  const fce::Arg args[] = {
      {"logits", logits, logits_bytes, e.esize, false},
      e.targets(targets, vocab_local),  // class probabilities: this rank's shard of q
      e.class_weights(vocab_total),
      e.gathered_stats(gathered_stats, ranks),
      e.grad_output(grad_output),
      {"gradients->grad_logits", grad_logits, grad_bytes, e.esize, true},
      workspace_arg(workspace, workspace_bytes),
      e.grad_lse(g.grad_lse),
      e.grad_entropy(g.grad_entropy),
  };
  const InPlace in_place{p.row_stride, p.grad_row_stride};
  FCE_TRY(check_args(fn, args, &in_place));
  FCE_TRY(check_workspace(fn, vp_workspace(*o, p.opt, ranks, rows, vocab_total, vocab_local, true),
                          workspace, workspace_bytes));
  if (empty) return empty_problem(fn, *o, args, {}, stream);  // no row: nothing to write
  set_vp_step(&p, fn, true, ranks, rows, vocab_total, vocab_start, vocab_local, targets,
              gathered_stats);
  p.logits = logits;
  p.grad_output = grad_output;
  p.grad = grad_logits;
  p.grad_lse = g.grad_lse;
  p.grad_entropy = g.grad_entropy;
  set_workspace(&p, workspace, workspace_bytes, stream);
  return dispatch(*o, args, p, fce::cpu_vp, fce::cuda_vp);
}

}  // extern "C"
