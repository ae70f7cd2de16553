// api_vp_linear.cpp — the C ABI of the vocabulary-parallel fused linear + cross-entropy over
// weight shards: fce_vp_linear_stats (phase 1), fce_vp_linear_backward (phase 3), the one-call
// step fce_vp_linear_ce (the all-gather through the caller's function: the gather-once plan
// here, CUDA's token-chunk plan in lib/cuda/vp_linear_ce.cu) and their workspace queries
// (docs/semantics.md rule 16). Every argument is checked (validate.h) and named when
// wrong before anything is written; then the problem goes to a backend.
#include <algorithm>
#include <cstdint>

#include "validate.h"

namespace {

using fce::fail;
using namespace fce::abi;

// The backends' workspace of fce_vp_linear_stats (backward false: the query knows neither ranks
// nor vocab_total, so they are passed as 1 and vocab_local, by the query and by the call alike;
// grad_hidden_dtype FCE_FLOAT32, unused) and fce_vp_linear_backward.
void vp_linear_workspace(const fce_options& o, const fce::CeOptions& opt, int64_t ranks,
                         int64_t rows, int64_t hidden, int64_t vocab_total, int64_t vocab_local,
                         bool backward, int32_t grad_hidden_dtype, size_t* min_bytes,
                         size_t* optimal_bytes) {
  const bool fp32 = o.grad_weight_fp32 != 0;
  if (rows == 0)  // the empty problem: nothing computed
    *min_bytes = *optimal_bytes = 0;
  else if (o.backend == FCE_BACKEND_CPU)
    fce::cpu_vp_linear_workspace_size(opt, ranks, rows, hidden, vocab_total, vocab_local,
                                      backward, grad_hidden_dtype, fp32, min_bytes,
                                      optimal_bytes);
  else
    fce::cuda_vp_linear_workspace_size(opt, ranks, rows, hidden, vocab_total, vocab_local,
                                       backward, grad_hidden_dtype, fp32, min_bytes,
                                       optimal_bytes);
}

// The sizes and options both calls check first (ranks NULL: fce_vp_linear_stats, one rank), and
// those fields of p.
fce_status check_sizes(const char* fn, const fce_options& o, const int64_t* ranks, int64_t rows,
                       int64_t hidden, int64_t vocab_total, int64_t vocab_start,
                       int64_t vocab_local, fce::VpLinearProblem* p) {
  FCE_TRY(check_vp_vocab(fn, vocab_total, vocab_start, vocab_local, true));
  FCE_TRY(check_options(fn, &o, rows, vocab_total, &p->opt));
  FCE_TRY(refuse_batch_invariant(fn, p->opt));
  FCE_TRY(check_hidden(fn, hidden));
  FCE_TRY(check_vp_rows(fn, rows, ranks));
  p->fn = fn;
  p->ranks = ranks ? *ranks : 1;
  p->rows = rows;
  p->hidden = hidden;
  p->vocab_total = vocab_total;
  p->vocab_start = vocab_start;
  p->vocab_local = vocab_local;
  return FCE_SUCCESS;
}

// options->hidden_row_stride into p (one row has no stride, as for fce_linear_ce), and the bytes
// of hidden_states: *h_bytes; the bytes of [vocab_local, hidden] and [rows, hidden] of elem bytes
// each (the largest buffers of those shapes the call has) must fit a 64-bit byte offset too.
fce_status check_hidden_spans(const char* fn, const fce_options& o, size_t elem,
                              fce::VpLinearProblem* p, uint64_t* h_bytes) {
  FCE_TRY(check_stride(fn, "options->hidden_row_stride", o.hidden_row_stride, p->hidden,
                       &p->hidden_row_stride));
  if (p->rows == 1) p->hidden_row_stride = p->hidden;
  const int64_t h = span_bytes(p->rows, p->hidden, p->hidden_row_stride, fce::dtype_size(o.dtype));
  const int64_t w = span_bytes(p->vocab_local, p->hidden, p->hidden, elem);
  const int64_t nd = span_bytes(p->rows, p->hidden, p->hidden, elem);
  if (h < 0 || w < 0 || nd < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: the sizes (rows %lld, hidden %lld, vocab_local %lld) overflow a 64-bit byte "
                "offset",
                fn, (long long)p->rows, (long long)p->hidden, (long long)p->vocab_local);
  *h_bytes = static_cast<uint64_t>(h);
  return FCE_SUCCESS;
}

}  // namespace

extern "C" {

FCE_API fce_status fce_vp_linear_stats_workspace_size(const fce_options* options, int64_t rows,
                                                      int64_t hidden, int64_t vocab_local,
                                                      size_t* min_bytes, size_t* optimal_bytes) {
  const char* fn = "fce_vp_linear_stats_workspace_size";
  fce_options o;
  FCE_TRY(begin_call(fn, options, &o));
  if (vocab_local < 1 || vocab_local > kMaxVocab)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: vocab_local (%lld) must be in [1, 2^31-1]", fn,
                (long long)vocab_local);
  fce::CeOptions opt;
  FCE_TRY(check_options(fn, &o, rows, vocab_local, &opt));
  FCE_TRY(refuse_batch_invariant(fn, opt));
  FCE_TRY(check_hidden(fn, hidden));
  FCE_TRY(check_vp_rows(fn, rows, nullptr));
  FCE_TRY(check_size_outputs(fn, min_bytes, optimal_bytes));
  size_t lo = 0, hi = 0;
  vp_linear_workspace(o, opt, 1, rows, hidden, vocab_local, vocab_local, false, FCE_FLOAT32, &lo,
                      &hi);
  write_sizes(min_bytes, optimal_bytes, lo, hi);
  return FCE_SUCCESS;
}

FCE_API fce_status fce_vp_linear_stats(const fce_options* options, const fce_vp_shard* shard,
                                       int64_t rows, int64_t hidden, const void* hidden_states,
                                       const void* weight, const void* bias, const void* targets,
                                       float* stats, void* workspace, size_t workspace_bytes,
                                       void* stream) {
  const char* fn = "fce_vp_linear_stats";
  fce_options local;
  FCE_TRY(begin_call(fn, options, &local));
  FCE_TRY(check_shard(fn, shard));
  const int64_t vocab_total = shard->vocab_total, vocab_start = shard->vocab_start,
                vocab_local = shard->vocab_local;
  const fce_options* o = &local;
  fce::VpLinearProblem p{};
  FCE_TRY(check_sizes(fn, *o, nullptr, rows, hidden, vocab_total, vocab_start, vocab_local, &p));
  const bool empty = rows == 0;  // per-row buffers of no elements may be NULL
  FCE_TRY(check_required(fn, {{"hidden_states", hidden_states, empty},
                              {"weight", weight},
                              {"targets", targets, empty},
                              {"stats", stats, empty}}));
  const Entries e(*o, rows);
  uint64_t h_bytes = 0;
  FCE_TRY(check_hidden_spans(fn, *o, e.esize, &p, &h_bytes));
  const uint64_t vd = static_cast<uint64_t>(vocab_local) * static_cast<uint64_t>(hidden);
  const fce::Arg args[] = {
      {"hidden_states", hidden_states, h_bytes, e.esize, false},
      {"weight", weight, vd * e.esize, e.esize, false},
      {"bias", bias, static_cast<uint64_t>(vocab_local) * e.esize, e.esize, false},
      e.targets(targets, vocab_local),  // class probabilities: this rank's shard of q
      e.class_weights(vocab_total),
      e.stats(stats),
      workspace_arg(workspace, workspace_bytes),
  };
  FCE_TRY(check_args(fn, args));
  size_t min_bytes = 0, optimal_bytes = 0;
  vp_linear_workspace(*o, p.opt, 1, rows, hidden, vocab_local, vocab_local, false, FCE_FLOAT32,
                      &min_bytes, &optimal_bytes);
  FCE_TRY(check_workspace(fn, min_bytes, workspace, workspace_bytes));
  if (empty) return empty_problem(fn, *o, args, {}, stream);  // no row: nothing to write
  p.backward = false;
  set_linear_inputs(&p, hidden_states, weight, bias, targets);
  p.stats = stats;
  p.grad_hidden_dtype = FCE_FLOAT32;
  set_workspace(&p, workspace, workspace_bytes, stream);
  return dispatch(*o, args, p, fce::cpu_vp_linear, fce::cuda_vp_linear);
}

FCE_API fce_status fce_vp_linear_backward_workspace_size(const fce_options* options,
                                                         int64_t ranks, int64_t rows,
                                                         int64_t hidden, int64_t vocab_total,
                                                         int64_t vocab_local,
                                                         int32_t grad_hidden_dtype,
                                                         size_t* min_bytes,
                                                         size_t* optimal_bytes) {
  const char* fn = "fce_vp_linear_backward_workspace_size";
  fce_options o;
  FCE_TRY(begin_call(fn, options, &o));
  FCE_TRY(check_vp_vocab(fn, vocab_total, 0, vocab_local, false));
  fce::CeOptions opt;
  FCE_TRY(check_options(fn, &o, rows, vocab_total, &opt));
  FCE_TRY(refuse_batch_invariant(fn, opt));
  FCE_TRY(check_hidden(fn, hidden));
  FCE_TRY(check_vp_rows(fn, rows, &ranks));
  FCE_TRY(check_grad_hidden_dtype(fn, grad_hidden_dtype, o.dtype));
  FCE_TRY(check_size_outputs(fn, min_bytes, optimal_bytes));
  size_t lo = 0, hi = 0;
  vp_linear_workspace(o, opt, ranks, rows, hidden, vocab_total, vocab_local, true,
                      grad_hidden_dtype, &lo, &hi);
  write_sizes(min_bytes, optimal_bytes, lo, hi);
  return FCE_SUCCESS;
}

FCE_API fce_status fce_vp_linear_backward(const fce_options* options,
                                          const fce_vp_shard* shard, int64_t rows,
                                          int64_t hidden, const void* hidden_states,
                                          const void* weight, const void* bias,
                                          const void* targets, const float* gathered_stats,
                                          const fce_gradients* gradients, void* workspace,
                                          size_t workspace_bytes, void* stream) {
  const char* fn = "fce_vp_linear_backward";
  CallArgs a;
  FCE_TRY(begin_compute(fn, options, shard, true, nullptr, gradients,
                        {OutputsUse::kFlagsOnly, GradientsUse::kVpLinear, true}, &a));
  FCE_TRY(check_vp_entropy(fn, a.o, nullptr, a.g.grad_entropy));
  const auto [ranks, vocab_total, vocab_start, vocab_local, gather, context] = a.shard;
  const auto [g_size, grad_output, g_logits, grad_hidden, grad_weight, grad_bias,
              grad_hidden_dtype, g_reserved, g_lse, g_entropy] = a.g;
  const fce_options* o = &a.o;
  fce::VpLinearProblem p{};
  FCE_TRY(check_sizes(fn, *o, &ranks, rows, hidden, vocab_total, vocab_start, vocab_local, &p));
  FCE_TRY(check_grad_hidden_dtype(fn, grad_hidden_dtype, o->dtype));
  const bool empty = rows == 0;  // per-row buffers of no elements may be NULL
  FCE_TRY(check_required(fn, {{"hidden_states", hidden_states, empty},
                              {"weight", weight},
                              {"targets", targets, empty},
                              {"gathered_stats", gathered_stats, empty}}));
  // (with no row, a grad_hidden of no element may be NULL: all three NULL is then no error)
  if (!empty && !grad_hidden && !grad_weight && !grad_bias)
    return fail(FCE_ERROR_NULL_POINTER,
                "%s: gradients->grad_hidden, ->grad_weight and ->grad_bias are all NULL: at least "
                "one gradient is needed",
                fn);
  if (grad_bias && !bias)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: gradients->grad_bias is given but bias is NULL",
                fn);
  uint64_t h_bytes = 0;
  FCE_TRY(check_hidden_spans(fn, *o, 4, &p, &h_bytes));  // largest: float32 gradients
  const Entries e(*o, rows);
  const size_t gw_size = o->grad_weight_fp32 ? 4 : e.esize;
  const size_t gh_size = fce::dtype_size(grad_hidden_dtype);
  const uint64_t vd = static_cast<uint64_t>(vocab_local) * static_cast<uint64_t>(hidden);
  const uint64_t nd = static_cast<uint64_t>(rows) * static_cast<uint64_t>(hidden);
  const uint64_t v = static_cast<uint64_t>(vocab_local);
  const fce::Arg args[] = {
      {"hidden_states", hidden_states, h_bytes, e.esize, false},
      {"weight", weight, vd * e.esize, e.esize, false},
      {"bias", bias, v * e.esize, e.esize, false},
      e.targets(targets, vocab_local),  // class probabilities: this rank's shard of q
      e.class_weights(vocab_total),
      e.gathered_stats(gathered_stats, ranks),
      e.grad_output(grad_output),
      {"gradients->grad_hidden", grad_hidden, nd * gh_size, gh_size, true},
      {"gradients->grad_weight", grad_weight, vd * gw_size, gw_size, true},
      {"gradients->grad_bias", grad_bias, v * gw_size, gw_size, true},
      workspace_arg(workspace, workspace_bytes),
      e.grad_lse(g_lse),
      e.grad_entropy(g_entropy),
  };
  FCE_TRY(check_args(fn, args));
  size_t min_bytes = 0, optimal_bytes = 0;
  vp_linear_workspace(*o, p.opt, ranks, rows, hidden, vocab_total, vocab_local, true,
                      grad_hidden_dtype, &min_bytes, &optimal_bytes);
  FCE_TRY(check_workspace(fn, min_bytes, workspace, workspace_bytes));
  if (empty)  // ∂W and ∂b are 0 (sums over no rows): written, or with accumulate left as they are
    return empty_problem(fn, *o, args,
                         {weight_grad_zeros(*o, grad_weight, vd * gw_size),
                          weight_grad_zeros(*o, grad_bias, v * gw_size)},
                         stream);
  p.backward = true;
  set_linear_inputs(&p, hidden_states, weight, bias, targets);
  p.gathered = gathered_stats;
  p.grad_output = grad_output;
  set_linear_grads(&p, *o, grad_hidden, grad_weight, grad_bias);
  p.grad_hidden_dtype = grad_hidden_dtype;
  p.grad_lse = g_lse;
  p.grad_entropy = g_entropy;
  set_workspace(&p, workspace, workspace_bytes, stream);
  return dispatch(*o, args, p, fce::cpu_vp_linear, fce::cuda_vp_linear);
}

}  // extern "C"

// ------------------------------------------------------------- fce_vp_linear_ce ----
// The gather-once plan (the CPU backend's; CUDA's without a gradient or below the token-chunk
// plan's threshold): fce_vp_linear_stats for all rows into `own`, ONE all-gather into
// `gathered`, fce_vp_loss, then fce_vp_linear_backward: the two-phase calls themselves (their
// backends, arguments checked once here), in one workspace:
//   own [rows, FCE_VP_STATS] | gathered [ranks, rows, FCE_VP_STATS] | the calls' workspace
// (each call's in turn, the largest of the three), 256-byte slices from the caller's 16-byte
// aligned pointer.
namespace {

struct OnceLayout {
  size_t own = 0, gathered = 0, sub = 0;
  size_t min_total = 0, optimal_total = 0;
};

OnceLayout once_layout(const fce_options& o, const fce::CeOptions& opt, int64_t ranks,
                       int64_t rows, int64_t hidden, int64_t vocab_total, int64_t width,
                       bool with_grad, int32_t grad_hidden_dtype) {
  OnceLayout l;
  const size_t row_bytes = static_cast<size_t>(rows) * kStatsBytes;
  l.gathered = fce::sat_round_up(row_bytes, 256);
  const size_t all_bytes = fce::sat_mul(static_cast<size_t>(ranks), row_bytes);
  l.sub = fce::sat_add(l.gathered, fce::sat_round_up(all_bytes, 256));
  size_t lo = 0, hi = 0, slo = 0, shi = 0;
  vp_linear_workspace(o, opt, 1, rows, hidden, width, width, false, FCE_FLOAT32, &slo, &shi);
  const size_t loss = vp_workspace(o, opt, ranks, rows, vocab_total, 0, false);
  lo = std::max(slo, loss);
  hi = std::max(shi, loss);
  if (with_grad) {
    size_t blo = 0, bhi = 0;
    vp_linear_workspace(o, opt, ranks, rows, hidden, vocab_total, width, true,
                        grad_hidden_dtype, &blo, &bhi);
    lo = std::max(lo, blo);
    hi = std::max(hi, bhi);
  }
  l.min_total = fce::sat_add(l.sub, lo);
  l.optimal_total = fce::sat_add(l.sub, std::max(lo, hi));
  return l;
}

fce_status gather_once(const fce_options& o, const fce::VpLinearCeProblem& P,
                       const OnceLayout& l, bool with_grad) {
  const fce::VpLinearProblem& p = P.lin;
  const bool cpu = o.backend == FCE_BACKEND_CPU;
  auto vp_linear = cpu ? fce::cpu_vp_linear : fce::cuda_vp_linear;
  char* ws = static_cast<char*>(p.workspace);
  float* own = reinterpret_cast<float*>(ws + l.own);
  float* gathered = reinterpret_cast<float*>(ws + l.gathered);
  void* sub = ws + l.sub;
  const size_t sub_bytes = p.workspace_bytes - l.sub;

  fce::VpLinearProblem s = p;  // phase 1 over all rows
  s.backward = false;
  s.ranks = 1;
  s.stats = own;
  s.workspace = sub;
  s.workspace_bytes = sub_bytes;
  FCE_TRY(vp_linear(s));

  const fce_status st = P.all_gather(P.context, own, gathered, p.rows * FCE_VP_STATS, p.stream);
  if (st != FCE_SUCCESS)
    return fail(st, "%s: all_gather returned %s (all %lld rows)", p.fn, fce_status_string(st),
                static_cast<long long>(p.rows));

  fce::VpProblem v{};  // the loss from the gathered statistics
  v.fn = p.fn;
  v.backward = false;
  v.opt = p.opt;
  v.ranks = p.ranks;
  v.rows = p.rows;
  v.vocab_total = p.vocab_total;
  v.targets = p.targets;
  v.gathered = gathered;
  v.loss = P.loss;
  v.lse = P.lse;
  v.z_loss = P.z_loss;
  v.argmax = P.argmax;
  v.accuracy = P.accuracy;
  v.entropy = P.entropy;
  v.error_flags = p.error_flags;
  set_workspace(&v, sub, sub_bytes, p.stream);
  FCE_TRY(cpu ? fce::cpu_vp(v) : fce::cuda_vp(v));
  if (!with_grad) return FCE_SUCCESS;

  fce::VpLinearProblem b = p;  // phase 3: this rank's gradients
  b.backward = true;
  b.gathered = gathered;
  b.workspace = sub;
  b.workspace_bytes = sub_bytes;
  return vp_linear(b);
}

// ⌈vocab_total / ranks⌉: the shard width the plans are made for (the same on every rank).
int64_t plan_width(int64_t vocab_total, int64_t ranks) { return (vocab_total + ranks - 1) / ranks; }

}  // namespace

extern "C" {

FCE_API fce_status fce_vp_linear_ce_workspace_size(const fce_options* options, int64_t ranks,
                                                   int64_t rows, int64_t hidden,
                                                   int64_t vocab_total, int64_t vocab_local,
                                                   int with_grad, int32_t grad_hidden_dtype,
                                                   size_t* min_bytes, size_t* optimal_bytes) {
  const char* fn = "fce_vp_linear_ce_workspace_size";
  fce_options o;
  FCE_TRY(begin_call(fn, options, &o));
  FCE_TRY(check_vp_vocab(fn, vocab_total, 0, vocab_local, false));
  fce::CeOptions opt;
  FCE_TRY(check_options(fn, &o, rows, vocab_total, &opt));
  FCE_TRY(refuse_batch_invariant(fn, opt));
  FCE_TRY(check_hidden(fn, hidden));
  FCE_TRY(check_vp_rows(fn, rows, &ranks));
  FCE_TRY(check_grad_hidden_dtype(fn, grad_hidden_dtype, o.dtype));
  FCE_TRY(check_size_outputs(fn, min_bytes, optimal_bytes));
  if (rows == 0) {  // the empty problem: nothing computed, nothing gathered
    write_sizes(min_bytes, optimal_bytes, 0, 0);
    return FCE_SUCCESS;
  }
  const int64_t width = std::max(vocab_local, plan_width(vocab_total, ranks));
  const OnceLayout l =
      once_layout(o, opt, ranks, rows, hidden, vocab_total, width, with_grad != 0,
                  grad_hidden_dtype);
  size_t lo = l.min_total, hi = l.optimal_total;
  if (with_grad && o.backend != FCE_BACKEND_CPU && !opt.soft_targets) {
    // full speed: the token-chunk plan, which class indices alone take (with or without
    // grad_weight: the larger of the two)
    const bool fp32 = o.grad_weight_fp32 != 0 || o.dtype == FCE_FLOAT32;
    size_t chunked = 0;
    for (bool need_dw : {true, false}) {
      size_t threshold = 0, need = 0;
      if (!fce::cuda_vp_linear_ce_chunked(opt, ranks, rows, hidden, vocab_total, width, need_dw,
                                          fp32, SIZE_MAX, &threshold, &need))
        continue;
      chunked = std::max(chunked, need);
      if (lo >= threshold) lo = std::max(lo, need);  // a minimum that runs the token chunks
    }
    if (chunked) hi = chunked;
  }
  write_sizes(min_bytes, optimal_bytes, lo, std::max(lo, hi));
  return FCE_SUCCESS;
}

FCE_API fce_status fce_vp_linear_ce(const fce_options* options, const fce_vp_shard* shard,
                                    int64_t rows, int64_t hidden, const void* hidden_states,
                                    const void* weight, const void* bias, const void* targets,
                                    const fce_outputs* outputs, const fce_gradients* gradients,
                                    void* workspace, size_t workspace_bytes, void* stream) {
  const char* fn = "fce_vp_linear_ce";
  CallArgs a;
  FCE_TRY(begin_compute(fn, options, shard, true, outputs, gradients,
                        {OutputsUse::kLoss, GradientsUse::kVpLinear, false}, &a));
  FCE_TRY(check_vp_entropy(fn, a.o, a.out.entropy, a.g.grad_entropy));
  const fce_outputs& out = a.out;
  const auto [ranks, vocab_total, vocab_start, vocab_local, all_gather, context] = a.shard;
  float* loss = out.loss;
  float* z_loss = out.z_loss;
  const auto [g_size, grad_output, g_logits, grad_hidden, grad_weight, grad_bias,
              grad_hidden_dtype, g_reserved, g_lse, g_entropy] = a.g;
  uint32_t* error_flags = out.error_flags;
  const fce_options* o = &a.o;
  fce::VpLinearCeProblem P{};
  fce::VpLinearProblem& p = P.lin;
  FCE_TRY(check_sizes(fn, *o, &ranks, rows, hidden, vocab_total, vocab_start, vocab_local, &p));
  FCE_TRY(check_grad_hidden_dtype(fn, grad_hidden_dtype, o->dtype));
  FCE_TRY(refuse_soft_accuracy(fn, *o, out));
  FCE_TRY(check_row_grads_have_gradient(fn, a.g, grad_hidden || grad_weight || grad_bias,
                                        "gradients->grad_hidden, grad_weight and grad_bias"));
  const Entries e(*o, rows);
  const bool empty = rows == 0;  // per-row buffers of no elements may be NULL
  FCE_TRY(check_required(fn, {{"hidden_states", hidden_states, empty},
                              {"weight", weight},
                              {"targets", targets, empty},
                              {"outputs->loss", loss, e.reduced_floats() == 0}}));
  if (!all_gather)
    return fail(FCE_ERROR_NULL_POINTER, "%s: shard->all_gather is NULL (the call runs the "
                "collective through it)", fn);
  if (grad_bias && !bias)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: gradients->grad_bias is given but bias is NULL",
                fn);
  uint64_t h_bytes = 0;
  FCE_TRY(check_hidden_spans(fn, *o, 4, &p, &h_bytes));  // largest: float32 gradients
  const size_t gw_size = o->grad_weight_fp32 ? 4 : e.esize;
  const size_t gh_size = fce::dtype_size(grad_hidden_dtype);
  const uint64_t vd = static_cast<uint64_t>(vocab_local) * static_cast<uint64_t>(hidden);
  const uint64_t nd = static_cast<uint64_t>(rows) * static_cast<uint64_t>(hidden);
  const uint64_t v = static_cast<uint64_t>(vocab_local);
  const fce::Arg args[] = {
      {"hidden_states", hidden_states, h_bytes, e.esize, false},
      {"weight", weight, vd * e.esize, e.esize, false},
      {"bias", bias, v * e.esize, e.esize, false},
      e.targets(targets, vocab_local),  // class probabilities: this rank's shard of q
      e.class_weights(vocab_total),
      e.grad_output(grad_output),
      e.loss(loss),
      e.lse(out.lse, true),
      z_loss_arg(z_loss),
      {"gradients->grad_hidden", grad_hidden, nd * gh_size, gh_size, true},
      {"gradients->grad_weight", grad_weight, vd * gw_size, gw_size, true},
      {"gradients->grad_bias", grad_bias, v * gw_size, gw_size, true},
      error_flags_arg(error_flags),
      workspace_arg(workspace, workspace_bytes),
      e.argmax(out.argmax),
      e.accuracy(out.accuracy),
      e.entropy(out.entropy),
      e.grad_lse(g_lse),
      e.grad_entropy(g_entropy),
  };
  FCE_TRY(check_args(fn, args));
  if (empty) {  // no statistics to gather (all_gather is not called), the outputs 0
    FCE_TRY(check_workspace(fn, 0, workspace, workspace_bytes));
    return empty_problem(fn, *o, args,
                         {e.reduced_zeros(loss), {z_loss, 4}, e.reduced_zeros(out.accuracy),
                          weight_grad_zeros(*o, grad_weight, vd * gw_size),
                          weight_grad_zeros(*o, grad_bias, v * gw_size)},
                         stream);
  }
  const bool with_grad = grad_hidden || grad_weight || grad_bias;
  const bool fp32 = o->grad_weight_fp32 != 0 || o->dtype == FCE_FLOAT32;
  // the plan: a function of what every rank passes alike (never of vocab_start / vocab_local)
  size_t threshold = 0, need = 0;
  const bool chunked =
      with_grad && o->backend != FCE_BACKEND_CPU && !p.opt.soft_targets &&
      fce::cuda_vp_linear_ce_chunked(p.opt, ranks, rows, hidden, vocab_total, vocab_local,
                                     grad_weight != nullptr, fp32, workspace_bytes, &threshold,
                                     &need);
  // (the gather-once plan's layout only when that plan runs)
  const OnceLayout l = chunked ? OnceLayout{}
                               : once_layout(*o, p.opt, ranks, rows, hidden, vocab_total,
                                             vocab_local, with_grad, grad_hidden_dtype);
  FCE_TRY(check_workspace(fn, chunked ? need : l.min_total, workspace, workspace_bytes));
  set_linear_inputs(&p, hidden_states, weight, bias, targets);
  p.grad_output = grad_output;
  set_linear_grads(&p, *o, grad_hidden, grad_weight, grad_bias);
  p.grad_hidden_dtype = grad_hidden_dtype;
  p.error_flags = error_flags;
  p.grad_lse = g_lse;
  p.grad_entropy = g_entropy;
  set_workspace(&p, workspace, workspace_bytes, stream);
  set_loss_outputs(&P, out);
  P.entropy = out.entropy;
  P.all_gather = all_gather;
  P.context = context;
  if (o->backend != FCE_BACKEND_CPU) FCE_TRY(check_device_pointers(fn, args));
  return chunked ? fce::cuda_vp_linear_ce(P) : gather_once(*o, P, l, with_grad);
}

}  // extern "C"
