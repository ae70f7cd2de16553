// fusedce_nccl.cpp — libfusedce_nccl: the vocabulary-parallel calls of libfusedce (fce_vp_*,
// docs/semantics.md rule 16) around NCCL's all-gather of the statistics and all-reduce of dloss/dh,
// one entry point per step (include/fusedce_nccl.h).
//
// Every call: check everything (options, sizes, communicator, device, pointers, overlaps,
// workspace) on the host, then enqueue on the caller's stream, in this order,
//   phase 1 (fce_vp_stats / fce_vp_linear_stats) into this rank's slot of the gathered buffer,
//   ncclAllGather in place (sendbuff = recvbuff + rank · count, NCCL's in-place form),
//   [the gradient: fce_vp_backward], fce_vp_loss;
// fce_nccl_distill: per round (fce_vp_distill_rounds) fce_vp_distill_stats and the all-gather,
// then fce_vp_distill_loss and [the gradient: fce_vp_distill_backward];
// fce_nccl_linear_ce with a gradient: fce_vp_linear_ce (its all-gathers through ncclAllGather,
// one per token chunk; ∂h partial in float32), ncclAllReduce (sum, float32) of ∂h in place, the
// conversion to the dtype.
// Nothing allocates, nothing synchronises the host; the communicator queries are host-only.
#include <nccl.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>

#include "checks.h"
#include "convert.h"
#include "fusedce_nccl.h"

using namespace fce_nccl;

namespace {

// ---- cross-entropy and distillation: [gathered | scratch]
struct StatsLayout {
  size_t gathered = 0;  // bytes of [P, rows, stats_width]
  size_t scratch_off = 0, scratch = 0;
  size_t total() const { return scratch_off + scratch; }
};

fce_status ce_layout(const char* fn, const fce_options* options, int ranks, int64_t rows,
                     int64_t vocab_total, int64_t vocab_local, bool with_grad,
                     size_t gathered_bytes, StatsLayout* l) {
  size_t loss_ws = 0, bw_ws = 0;
  FCE_NCCL_QUERY(fn, fce_vp_loss_workspace_size, options, ranks, rows, vocab_total, &loss_ws);
  if (with_grad)
    FCE_NCCL_QUERY(fn, fce_vp_backward_workspace_size, options, ranks, rows, vocab_total,
                   vocab_local, &bw_ws);
  l->gathered = gathered_bytes;
  l->scratch_off = align_up(gathered_bytes);
  l->scratch = loss_ws > bw_ws ? loss_ws : bw_ws;
  return FCE_SUCCESS;
}

// ---- distillation: [gathered | scratch] as the cross-entropy; the JSD's round-1 statistics
// (two rounds) are gathered into the scratch, which the loss and the backward use only after
// round 2 has read them.
fce_status distill_layout(const char* fn, const fce_options* options, const fce_teacher* teacher,
                          int ranks, int64_t rows, int64_t vocab_total, int64_t vocab_local,
                          bool with_grad, size_t gathered_bytes, int32_t* rounds, StatsLayout* l) {
  size_t loss_ws = 0, bw_ws = 0;
  FCE_NCCL_QUERY(fn, fce_vp_distill_loss_workspace_size, options, teacher, ranks, rows, vocab_total,
                 &loss_ws);
  if (with_grad)
    FCE_NCCL_QUERY(fn, fce_vp_distill_backward_workspace_size, options, teacher, ranks, rows,
                   vocab_total, vocab_local, &bw_ws);
  FCE_NCCL_QUERY(fn, fce_vp_distill_rounds, teacher, rounds);
  const size_t first = *rounds > 1 ? gathered_bytes : 0;
  l->gathered = gathered_bytes;
  l->scratch_off = align_up(gathered_bytes);
  l->scratch = loss_ws > bw_ws ? loss_ws : bw_ws;
  if (first > l->scratch) l->scratch = first;
  return FCE_SUCCESS;
}

// ---- linear CE: [gathered | float32 ∂h (16-bit dtype with grad_hidden) | scratch]
struct LinLayout {
  size_t gathered = 0;
  size_t gh_off = 0, gh = 0;
  size_t scratch_off = 0, scratch_min = 0, scratch_opt = 0;
  size_t min_total() const { return scratch_off + scratch_min; }
  size_t opt_total() const { return scratch_off + scratch_opt; }
};

fce_status lin_layout(const char* fn, const fce_options* options, const fce_options& o,
                      int ranks, int64_t rows, int64_t hidden, int64_t vocab_total,
                      int64_t vocab_local, bool with_grad, bool f32_grad_hidden_buffer,
                      size_t gathered_bytes, LinLayout* l) {
  if (hidden < 1)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: hidden (%lld) must be >= 1", fn,
                (long long)hidden);
  size_t st_min = 0, st_opt = 0, loss_ws = 0, fu_min = 0, fu_opt = 0;
  if (with_grad) {  // fce_vp_linear_ce: the statistics live in its own workspace
    FCE_NCCL_QUERY(fn, fce_vp_linear_ce_workspace_size, options, ranks, rows, hidden,
                   vocab_total, vocab_local, 1, FCE_FLOAT32, &fu_min, &fu_opt);
    gathered_bytes = 0;
  } else {
    FCE_NCCL_QUERY(fn, fce_vp_linear_stats_workspace_size, options, rows, hidden, vocab_local,
                   &st_min, &st_opt);
    FCE_NCCL_QUERY(fn, fce_vp_loss_workspace_size, options, ranks, rows, vocab_total, &loss_ws);
  }
  l->gathered = gathered_bytes;
  l->gh_off = align_up(gathered_bytes);
  l->gh = 0;
  if (f32_grad_hidden_buffer && o.dtype != FCE_FLOAT32) {
    if (rows > kMaxBytes / 4 / hidden)
      return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: rows (%lld) x hidden (%lld) overflow", fn,
                  (long long)rows, (long long)hidden);
    l->gh = static_cast<size_t>(rows * hidden * 4);
  }
  l->scratch_off = l->gh_off + align_up(l->gh);
  auto mx = [](size_t a, size_t b) { return a > b ? a : b; };
  l->scratch_min = mx(mx(st_min, loss_ws), fu_min);
  l->scratch_opt = mx(mx(mx(st_opt, st_min), loss_ws), mx(fu_opt, fu_min));
  return FCE_SUCCESS;
}

}  // namespace

extern "C" {

FCE_API unsigned fce_nccl_version(void) { return FCE_VERSION_NUMBER; }

FCE_API const char* fce_nccl_last_error(void) { return last_error_buffer(); }

FCE_API const char* fce_nccl_build_info(void) {
  static const std::string info = [] {
    char line[160];
    int v = 0;
    char runtime[48] = "unknown";
    if (ncclGetVersion(&v) == ncclSuccess) {
      // NCCL_VERSION(X, Y, Z): X*10000 + Y*100 + Z since 2.9 (X*1000 + Y*100 + Z before)
      if (v >= 20900)
        std::snprintf(runtime, sizeof runtime, "%d.%d.%d", v / 10000, v / 100 % 100, v % 100);
      else
        std::snprintf(runtime, sizeof runtime, "%d.%d.%d", v / 1000, v / 100 % 10, v % 100);
    }
    std::snprintf(line, sizeof line, "fusedce_nccl %d.%d.%d; NCCL %s (built with %d.%d.%d); ",
                  FCE_VERSION_MAJOR, FCE_VERSION_MINOR, FCE_VERSION_PATCH, runtime, NCCL_MAJOR,
                  NCCL_MINOR, NCCL_PATCH);
    return std::string(line) + fce_build_info();
  }();
  return info.c_str();
}

FCE_API fce_status fce_nccl_shard(ncclComm_t comm, int64_t vocab_total, int64_t vocab_start,
                                  int64_t vocab_local, fce_vp_shard* shard) {
  const char* fn = "fce_nccl_shard";
  last_error_buffer()[0] = '\0';
  if (!shard) return fail(FCE_ERROR_NULL_POINTER, "%s: shard is NULL", fn);
  if (!comm) return fail(FCE_ERROR_NULL_POINTER, "%s: comm is NULL", fn);
  int ranks = 0;
  const ncclResult_t r = ncclCommCount(comm, &ranks);
  if (r != ncclSuccess) return nccl_fail(fn, "ncclCommCount(comm)", r, comm);
  if (ranks < 1) return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: comm has %d ranks", fn, ranks);
  size_t gathered = 0;
  FCE_NCCL_TRY(check_sizes(fn, 0, vocab_total, vocab_start, vocab_local, true, ranks, FCE_VP_STATS,
                           &gathered));
  shard->ranks = ranks;
  shard->vocab_total = vocab_total;
  shard->vocab_start = vocab_start;
  shard->vocab_local = vocab_local;
  shard->all_gather = nccl_all_gather;
  shard->context = comm;
  return FCE_SUCCESS;
}

FCE_API fce_status fce_nccl_cross_entropy_workspace_size(const fce_options* options,
                                                         const fce_vp_shard* shard, int64_t rows,
                                                         int with_grad, size_t* workspace_bytes) {
  const char* fn = "fce_nccl_cross_entropy_workspace_size";
  Call call;
  FCE_NCCL_TRY(begin_query(fn, options, shard, workspace_bytes, "workspace_bytes", &call));
  const int64_t vocab_total = shard->vocab_total, vocab_local = shard->vocab_local;
  size_t gathered = 0;
  FCE_NCCL_TRY(check_sizes(fn, rows, vocab_total, 0, vocab_local, false, call.ci.ranks,
                           stats_width(call.o), &gathered));
  StatsLayout l;
  FCE_NCCL_TRY(ce_layout(fn, options, call.ci.ranks, rows, vocab_total, vocab_local, with_grad != 0,
                         gathered, &l));
  *workspace_bytes = l.total();
  return FCE_SUCCESS;
}

FCE_API fce_status fce_nccl_cross_entropy(const fce_options* options, const fce_vp_shard* shard,
                                          int64_t rows, const void* logits, const void* targets,
                                          const fce_outputs* outputs,
                                          const fce_gradients* gradients, void* workspace,
                                          size_t workspace_bytes, void* stream) {
  const char* fn = "fce_nccl_cross_entropy";
  Call call;
  FCE_NCCL_TRY(begin_compute(fn, options, shard, outputs, gradients, &call));
  auto& [o, ci, comm, out, gr] = call;
  const int64_t vocab_total = shard->vocab_total, vocab_start = shard->vocab_start,
                vocab_local = shard->vocab_local;
  float* loss = out.loss;
  void* grad_logits = gr.grad_logits;
  const float* grad_output = gr.grad_output;
  size_t gathered_bytes = 0;
  FCE_NCCL_TRY(check_sizes(fn, rows, vocab_total, vocab_start, vocab_local, true, ci.ranks,
                           stats_width(o), &gathered_bytes));
  const bool with_grad = grad_logits != nullptr;
  FCE_NCCL_TRY(check_row_grads(fn, gr, with_grad, "gradients->grad_logits is"));
  StatsLayout l;
  FCE_NCCL_TRY(ce_layout(fn, options, ci.ranks, rows, vocab_total, vocab_local, with_grad,
                         gathered_bytes, &l));
  // The options are valid now (the libfusedce queries checked them): sizes of the buffers.
  // With no row (the empty problem) a per-row buffer of no element may be NULL.
  const bool per_row = o.reduction == FCE_REDUCTION_NONE, empty = rows == 0;
  if (!logits && !empty) return fail(FCE_ERROR_NULL_POINTER, "%s: logits is NULL", fn);
  if (!targets && !empty) return fail(FCE_ERROR_NULL_POINTER, "%s: targets is NULL", fn);
  if (!loss && !(empty && per_row))
    return fail(FCE_ERROR_NULL_POINTER, "%s: outputs->loss is NULL", fn);
  const size_t es = elem_size(o.dtype), ts = elem_size(o.target_dtype);
  int64_t rs = 0, grs = 0;
  FCE_NCCL_TRY(logits_strides(fn, o, vocab_local, logits, grad_logits, &rs, &grs));
  const int64_t logits_bytes = span_bytes(rows, vocab_local, rs, es);
  const int64_t grad_bytes = with_grad ? span_bytes(rows, vocab_local, grs, es) : 0;
  const int64_t y_bytes = targets_bytes(o.target_dtype, rows, vocab_local);
  if (logits_bytes < 0 || grad_bytes < 0 || y_bytes < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: rows x row stride overflow", fn);
  Range r[12] = {
      {"logits", logits, static_cast<uint64_t>(logits_bytes), false, es},
      {"gradients->grad_logits", grad_logits, static_cast<uint64_t>(grad_bytes), true, es},
      {"targets", targets, static_cast<uint64_t>(y_bytes), false, ts},
      {"options->class_weights", o.class_weights, static_cast<uint64_t>(vocab_total) * 4, false,
       4},
      {},  // grad_output, then outputs->loss, ->lse, ->z_loss, ->error_flags: loss_ranges
      {},
      {},
      {},
      {},
      {"workspace", workspace, workspace_bytes, true, 16},
      {},
      {},
  };
  loss_ranges(o, out, rows, with_grad ? grad_output : nullptr, &r[4]);
  forward_output_ranges(o, out, rows, &r[10], &r[11]);
  FCE_NCCL_TRY(check_workspace(fn, workspace, workspace_bytes, l.total()));
  FCE_NCCL_TRY(check_ranges(fn, r, 12, 0, 1));

  // ---- enqueue
  float* gathered = reinterpret_cast<float*>(workspace);
  const size_t count = static_cast<size_t>(rows) * static_cast<size_t>(stats_width(o));
  float* stats = gathered + static_cast<size_t>(ci.rank) * count;
  void* scratch = static_cast<char*>(workspace) + l.scratch_off;
  const size_t scratch_bytes = workspace_bytes - l.scratch_off;
  FCE_NCCL_CORE(fn, fce_vp_stats(options, shard, rows, logits, targets, stats, stream));
  FCE_NCCL_TRY(gather_stats(fn, gathered, ci.rank, count, comm, stream));
  if (with_grad)  // (its error flags are fce_vp_loss's, below)
    FCE_NCCL_CORE(fn, fce_vp_backward(options, shard, rows, logits, targets, gathered, &gr,
                                      scratch, scratch_bytes, stream));
  FCE_NCCL_CORE(fn, fce_vp_loss(options, shard, rows, targets, gathered, &out, scratch,
                                scratch_bytes, stream));
  return FCE_SUCCESS;
}

FCE_API fce_status fce_nccl_distill_workspace_size(const fce_options* options,
                                                   const fce_teacher* teacher,
                                                   const fce_vp_shard* shard, int64_t rows,
                                                   int with_grad, size_t* workspace_bytes) {
  const char* fn = "fce_nccl_distill_workspace_size";
  Call call;
  FCE_NCCL_TRY(begin_query(fn, options, shard, workspace_bytes, "workspace_bytes", &call));
  if (!teacher) return fail(FCE_ERROR_NULL_POINTER, "%s: teacher is NULL", fn);
  const int64_t vocab_total = shard->vocab_total, vocab_local = shard->vocab_local;
  size_t gathered = 0;
  FCE_NCCL_TRY(check_sizes(fn, rows, vocab_total, 0, vocab_local, false, call.ci.ranks,
                           FCE_VP_DISTILL_STATS, &gathered));
  int32_t rounds = 0;
  StatsLayout l;
  FCE_NCCL_TRY(distill_layout(fn, options, teacher, call.ci.ranks, rows, vocab_total, vocab_local,
                              with_grad != 0, gathered, &rounds, &l));
  *workspace_bytes = l.total();
  return FCE_SUCCESS;
}

FCE_API fce_status fce_nccl_distill(const fce_options* options, const fce_teacher* teacher,
                                    const fce_vp_shard* shard, int64_t rows, const void* logits,
                                    const void* targets, const fce_outputs* outputs,
                                    const fce_gradients* gradients, void* workspace,
                                    size_t workspace_bytes, void* stream) {
  const char* fn = "fce_nccl_distill";
  Call call;
  FCE_NCCL_TRY(begin_compute(fn, options, shard, outputs, gradients, &call));
  auto& [o, ci, comm, out, gr] = call;
  if (!teacher) return fail(FCE_ERROR_NULL_POINTER, "%s: teacher is NULL", fn);
  const int64_t vocab_total = shard->vocab_total, vocab_start = shard->vocab_start,
                vocab_local = shard->vocab_local;
  float* loss = out.loss;
  void* grad_logits = gr.grad_logits;
  size_t gathered_bytes = 0;
  FCE_NCCL_TRY(check_sizes(fn, rows, vocab_total, vocab_start, vocab_local, true, ci.ranks,
                           FCE_VP_DISTILL_STATS, &gathered_bytes));
  FCE_NCCL_TRY(refuse_distill_fields(fn, out, gr));
  const bool with_grad = grad_logits != nullptr;
  int32_t rounds = 0;
  StatsLayout l;
  FCE_NCCL_TRY(distill_layout(fn, options, teacher, ci.ranks, rows, vocab_total, vocab_local,
                              with_grad, gathered_bytes, &rounds, &l));
  // The options and the teacher are valid now (the libfusedce queries checked them): the
  // teacher's logits and strides, the sizes of the buffers. With no row (the empty problem) a
  // per-row buffer of no element may be NULL.
  const fce_teacher t0 = FCE_TEACHER_INIT;
  fce_teacher t;
  FCE_NCCL_TRY(read_versioned(fn, "teacher", teacher, FCE_TEACHER_SIZE_V1_0, t0, &t));
  const bool per_row = o.reduction == FCE_REDUCTION_NONE, empty = rows == 0;
  if (!logits && !empty) return fail(FCE_ERROR_NULL_POINTER, "%s: logits is NULL", fn);
  if (!t.logits && !empty) return fail(FCE_ERROR_NULL_POINTER, "%s: teacher->logits is NULL", fn);
  if (!loss && !(empty && per_row))
    return fail(FCE_ERROR_NULL_POINTER, "%s: outputs->loss is NULL", fn);
  const size_t es = elem_size(o.dtype), ts = elem_size(o.target_dtype);
  int64_t rs = 0, grs = 0, trs = 0;
  FCE_NCCL_TRY(logits_strides(fn, o, vocab_local, logits, grad_logits, &rs, &grs));
  FCE_NCCL_TRY(row_stride(fn, "teacher->row_stride", t.row_stride, vocab_local, &trs));
  const int64_t logits_bytes = span_bytes(rows, vocab_local, rs, es);
  const int64_t teacher_bytes = span_bytes(rows, vocab_local, trs, es);
  const int64_t grad_bytes = with_grad ? span_bytes(rows, vocab_local, grs, es) : 0;
  const int64_t y_bytes = targets_bytes(o.target_dtype, rows, vocab_local);
  if (logits_bytes < 0 || teacher_bytes < 0 || grad_bytes < 0 || y_bytes < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: rows x row stride overflow", fn);
  Range r[10] = {
      {"logits", logits, static_cast<uint64_t>(logits_bytes), false, es},
      {"gradients->grad_logits", grad_logits, static_cast<uint64_t>(grad_bytes), true, es},
      {"teacher->logits", t.logits, static_cast<uint64_t>(teacher_bytes), false, es},
      {"targets", targets, static_cast<uint64_t>(y_bytes), false, ts},
      {},  // grad_output, then outputs->loss, ->lse, ->z_loss (refused), ->error_flags
      {},
      {},
      {},
      {},
      {"workspace", workspace, workspace_bytes, true, 16},
  };
  loss_ranges(o, out, rows, with_grad ? gr.grad_output : nullptr, &r[4]);
  FCE_NCCL_TRY(check_workspace(fn, workspace, workspace_bytes, l.total()));
  FCE_NCCL_TRY(check_ranges(fn, r, 10, 0, 1));

  // ---- enqueue: the rounds (the JSD's first gathered into the scratch), the loss, the gradient
  char* ws = static_cast<char*>(workspace);
  void* scratch = ws + l.scratch_off;
  const size_t scratch_bytes = workspace_bytes - l.scratch_off;
  const size_t count = static_cast<size_t>(rows) * FCE_VP_DISTILL_STATS;
  float* gathered = reinterpret_cast<float*>(ws);
  const float* previous = nullptr;
  for (int32_t round = 1; round <= rounds; ++round) {
    float* into = round == rounds ? gathered : static_cast<float*>(scratch);
    float* stats = into + static_cast<size_t>(ci.rank) * count;
    FCE_NCCL_CORE(fn, fce_vp_distill_stats(options, teacher, shard, round, rows, logits, previous,
                                           stats, stream));
    FCE_NCCL_TRY(gather_stats(fn, into, ci.rank, count, comm, stream));
    previous = into;
  }
  FCE_NCCL_CORE(fn, fce_vp_distill_loss(options, teacher, shard, rows, targets, gathered, &out,
                                        scratch, scratch_bytes, stream));
  if (with_grad)
    FCE_NCCL_CORE(fn, fce_vp_distill_backward(options, teacher, shard, rows, logits, targets,
                                              gathered, &gr, scratch, scratch_bytes, stream));
  return FCE_SUCCESS;
}

FCE_API fce_status fce_nccl_linear_ce_workspace_size(const fce_options* options,
                                                     const fce_vp_shard* shard, int64_t rows,
                                                     int64_t hidden, int with_grad,
                                                     size_t* min_bytes, size_t* optimal_bytes) {
  const char* fn = "fce_nccl_linear_ce_workspace_size";
  Call call;
  FCE_NCCL_TRY(begin_query(fn, options, shard, min_bytes, "min_bytes", &call));
  const int64_t vocab_total = shard->vocab_total, vocab_local = shard->vocab_local;
  size_t gathered = 0;
  FCE_NCCL_TRY(check_sizes(fn, rows, vocab_total, 0, vocab_local, false, call.ci.ranks,
                           FCE_VP_STATS, &gathered));
  LinLayout l;
  FCE_NCCL_TRY(lin_layout(fn, options, call.o, call.ci.ranks, rows, hidden, vocab_total,
                          vocab_local, with_grad != 0, with_grad != 0, gathered, &l));
  *min_bytes = l.min_total();
  if (optimal_bytes) *optimal_bytes = l.opt_total();
  return FCE_SUCCESS;
}

FCE_API fce_status fce_nccl_linear_ce(const fce_options* options, const fce_vp_shard* shard,
                                      int64_t rows, int64_t hidden, const void* hidden_states,
                                      const void* weight, const void* bias, const void* targets,
                                      const fce_outputs* outputs, const fce_gradients* gradients,
                                      void* workspace, size_t workspace_bytes, void* stream) {
  const char* fn = "fce_nccl_linear_ce";
  Call call;
  FCE_NCCL_TRY(begin_compute(fn, options, shard, outputs, gradients, &call));
  auto& [o, ci, comm, out, gr] = call;
  if (gr.grad_logits)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: gradients->grad_logits is given, but %s writes only grad_hidden, "
                "grad_weight and grad_bias", fn, fn);
  if (gr.grad_hidden_dtype != FCE_FLOAT32)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: gradients->grad_hidden_dtype (%d) must be FCE_FLOAT32 (the default): "
                "grad_hidden is the full gradient, of options->dtype", fn, gr.grad_hidden_dtype);
  const int64_t vocab_total = shard->vocab_total, vocab_start = shard->vocab_start,
                vocab_local = shard->vocab_local;
  float* loss = out.loss;
  void* grad_hidden = gr.grad_hidden;
  void* grad_weight = gr.grad_weight;
  void* grad_bias = gr.grad_bias;
  const float* grad_output = gr.grad_output;
  size_t gathered_bytes = 0;
  FCE_NCCL_TRY(check_sizes(fn, rows, vocab_total, vocab_start, vocab_local, true, ci.ranks,
                           FCE_VP_STATS, &gathered_bytes));
  const bool with_grad = grad_hidden || grad_weight || grad_bias;
  FCE_NCCL_TRY(check_row_grads(fn, gr, with_grad,
                               "gradients->grad_hidden, grad_weight and grad_bias are all"));
  LinLayout l;
  FCE_NCCL_TRY(lin_layout(fn, options, o, ci.ranks, rows, hidden, vocab_total, vocab_local,
                          with_grad, grad_hidden != nullptr, gathered_bytes, &l));
  // With no row (the empty problem) a per-row buffer of no element may be NULL.
  const bool per_row = o.reduction == FCE_REDUCTION_NONE, empty = rows == 0;
  if (!hidden_states && !empty)
    return fail(FCE_ERROR_NULL_POINTER, "%s: hidden_states is NULL", fn);
  if (!weight) return fail(FCE_ERROR_NULL_POINTER, "%s: weight is NULL", fn);
  if (!targets && !empty) return fail(FCE_ERROR_NULL_POINTER, "%s: targets is NULL", fn);
  if (!loss && !(empty && per_row))
    return fail(FCE_ERROR_NULL_POINTER, "%s: outputs->loss is NULL", fn);
  if (grad_bias && !bias)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: gradients->grad_bias is given but bias is NULL",
                fn);
  const size_t es = elem_size(o.dtype), ts = elem_size(o.target_dtype);
  const size_t gws = o.grad_weight_fp32 ? 4 : es;
  const int64_t hrs = o.hidden_row_stride ? o.hidden_row_stride : hidden;
  if (hrs < hidden)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->hidden_row_stride (%lld) is less than hidden (%lld)", fn,
                (long long)hrs, (long long)hidden);
  const int64_t h_bytes = span_bytes(rows, hidden, rows > 1 ? hrs : hidden, es);
  const int64_t w_bytes = span_bytes(vocab_local, hidden, hidden, es);
  const int64_t gh_bytes = span_bytes(rows, hidden, hidden, es);
  const int64_t gw_bytes = span_bytes(vocab_local, hidden, hidden, gws);
  const int64_t y_bytes = targets_bytes(o.target_dtype, rows, vocab_local);
  if (h_bytes < 0 || w_bytes < 0 || gh_bytes < 0 || gw_bytes < 0 || y_bytes < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: rows, hidden or vocab_local too large", fn);
  Range r[17] = {
      {"hidden_states", hidden_states, static_cast<uint64_t>(h_bytes), false, es},
      {"weight", weight, static_cast<uint64_t>(w_bytes), false, es},
      {"bias", bias, static_cast<uint64_t>(vocab_local) * es, false, es},
      {"targets", targets, static_cast<uint64_t>(y_bytes), false, ts},
      {"options->class_weights", o.class_weights, static_cast<uint64_t>(vocab_total) * 4, false,
       4},
      {},  // grad_output, then outputs->loss, ->lse, ->z_loss, ->error_flags: loss_ranges
      {},
      {},
      {},
      {},
      {"gradients->grad_hidden", grad_hidden, static_cast<uint64_t>(gh_bytes), true, es},
      {"gradients->grad_weight", grad_weight, static_cast<uint64_t>(gw_bytes), true, gws},
      {"gradients->grad_bias", grad_bias, static_cast<uint64_t>(vocab_local) * gws, true, gws},
      {"workspace", workspace, workspace_bytes, true, 16},
      {},
      {},
      {},
  };
  loss_ranges(o, out, rows, with_grad ? grad_output : nullptr, &r[5]);
  forward_output_ranges(o, out, rows, &r[14], &r[15]);
  FCE_NCCL_TRY(check_workspace(fn, workspace, workspace_bytes, l.min_total()));
  FCE_NCCL_TRY(check_ranges(fn, r, 16, -1, -1));

  // ---- enqueue
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  char* ws = static_cast<char*>(workspace);
  void* scratch = ws + l.scratch_off;
  const size_t scratch_bytes = workspace_bytes - l.scratch_off;
  if (!with_grad) {  // the loss only: phase 1, the all-gather, the loss
    float* gathered = reinterpret_cast<float*>(ws);
    const size_t count = static_cast<size_t>(rows) * FCE_VP_STATS;
    float* stats = gathered + static_cast<size_t>(ci.rank) * count;
    FCE_NCCL_CORE(fn, fce_vp_linear_stats(options, shard, rows, hidden, hidden_states, weight,
                                          bias, targets, stats, scratch, scratch_bytes, stream));
    FCE_NCCL_TRY(gather_stats(fn, gathered, ci.rank, count, comm, stream));
    FCE_NCCL_CORE(fn, fce_vp_loss(options, shard, rows, targets, gathered, &out, scratch,
                                  scratch_bytes, stream));
    return FCE_SUCCESS;
  }
  // This rank's share of ∂h in float32: in grad_hidden itself for a float32 dtype, else in the
  // workspace slice, all-reduced there and rounded once into grad_hidden.
  float* gh32 = nullptr;
  if (grad_hidden)
    gh32 = o.dtype == FCE_FLOAT32 ? static_cast<float*>(grad_hidden)
                                  : reinterpret_cast<float*>(ws + l.gh_off);
  fce_gradients partial = gr;  // this rank's share of dloss/dh, in float32
  partial.grad_hidden = gh32;
  partial.grad_hidden_dtype = FCE_FLOAT32;
  clear_gather_result();  // the shard's all-gather is nccl_all_gather on comm
  const fce_status st = fce_vp_linear_ce(options, shard, rows, hidden, hidden_states, weight,
                                         bias, targets, &out, &partial, scratch, scratch_bytes,
                                         stream);
  if (last_gather_result() != ncclSuccess)
    return nccl_fail(fn, "ncclAllGather (statistics)", last_gather_result(), comm);
  FCE_NCCL_CORE(fn, st);
  if (grad_hidden && rows > 0) {  // (no row: no dloss/dh to reduce, on every rank alike)
    const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(hidden);
    const ncclResult_t nr = ncclAllReduce(gh32, gh32, n, ncclFloat32, ncclSum, comm, s);
    if (nr != ncclSuccess) return nccl_fail(fn, "ncclAllReduce (grad_hidden)", nr, comm);
    if (o.dtype != FCE_FLOAT32) {
      const cudaError_t e = fce_nccl::convert_f32(gh32, grad_hidden, o.dtype,
                                                  static_cast<int64_t>(n), s);
      if (e != cudaSuccess)
        return fail(FCE_ERROR_CUDA, "%s: the conversion of grad_hidden to the dtype: %s", fn,
                    cudaGetErrorString(e));
    }
  }
  return FCE_SUCCESS;
}

}  // extern "C"
