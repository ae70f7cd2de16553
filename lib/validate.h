// validate.h — the argument checks of the ABI layer (lib/api*.cpp), shared by every entry point:
// the options, sizes and strides, and each call's argument table (lib/internal.h's Arg: every
// buffer of the call listed once), which drives the alignment check, the overlap check and, for
// the CUDA backend, the device-pointer check made once before dispatching. Every check names
// the public function (fn) and the argument; nothing here writes to a caller's buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>

#include "internal.h"

namespace fce {

void clear_error();  // lib/status.cpp: fce_last_error() is "" until the next fail()

namespace abi {

constexpr int64_t kMaxVocab = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxBytes = std::numeric_limits<int64_t>::max() / 2;
constexpr int64_t kStatsBytes = FCE_VP_STATS * 4;  // one row of a shard's statistics
// ... under options->batch_invariant (the widest: the bound of the size checks)
constexpr int64_t kExactStatsBytes = FCE_VP_STATS_INVARIANT * 4;

// ---- options and sizes ----

// options->target_dtype of class probabilities (docs/semantics.md rule 19) rather than indices.
inline bool is_soft_dtype(int32_t target_dtype) {
  return target_dtype == FCE_FLOAT32 || target_dtype == FCE_FLOAT16 ||
         target_dtype == FCE_BFLOAT16;
}
// Class-probability targets in a call that takes class indices only (the distillation calls):
// FCE_ERROR_UNSUPPORTED naming the call and options->target_dtype.
fce_status refuse_soft_targets(const char* fn, const fce_options& o);
// options->batch_invariant (docs/semantics.md rule 21) in a call that cannot honour it (the
// vocabulary-parallel and distillation calls): FCE_ERROR_UNSUPPORTED naming the call and field.
fce_status refuse_batch_invariant(const char* fn, const CeOptions& opt);
// outputs->accuracy with class-probability targets (no target class): refused.
fce_status refuse_soft_accuracy(const char* fn, const fce_options& o, const fce_outputs& out);

// Starts a call: clears the last error and copies the caller's options into *local (the
// defaults, overwritten by the struct_size bytes the caller's struct has: a caller of an older
// 1.x version gets the defaults of the fields appended since; nothing past its struct is read).
fce_status begin_call(const char* fn, const fce_options* options, fce_options* local);

// The caller's fce_outputs into *local (NULL: every output absent), struct_size checked. kLoss:
// a call that writes a loss (outputs required); kFlagsOnly: a gradient-only call, which writes
// error_flags alone and refuses any other output.
enum class OutputsUse { kLoss, kFlagsOnly };
fce_status read_outputs(const char* fn, const fce_outputs* outputs, OutputsUse use,
                        fce_outputs* local);

// The caller's fce_gradients into *local (NULL: none, unless required), struct_size checked,
// with the fields the call does not take absent: kLogits (grad_logits, grad_output), kLinear
// (grad_hidden, grad_weight, grad_bias, grad_output), kVpLinear (those and grad_hidden_dtype).
enum class GradientsUse { kLogits, kLinear, kVpLinear };
fce_status read_gradients(const char* fn, const fce_gradients* gradients, GradientsUse use,
                          bool required, fce_gradients* local);

// gradients->grad_lse and ->grad_entropy (docs/semantics.md rule 18) in a call that does not
// read them: FCE_ERROR_UNSUPPORTED naming the call and the field, `why` appended (", use ...").
// allow_lse: the call reads grad_lse (fce_backward), so only grad_entropy is refused.
fce_status refuse_row_grads(const char* fn, const fce_gradients& g, bool allow_lse,
                            const char* why);
// grad_lse / grad_entropy given to a call that reads them but writes no gradient to add them to
// (fce_forward without grad_logits, fce_linear_ce without any gradient).
fce_status check_row_grads_have_gradient(const char* fn, const fce_gradients& g,
                                         bool with_grad, const char* gradient_names);
// outputs->entropy or gradients->grad_entropy (either may be nullptr) given to a
// vocabulary-parallel call without options->vp_entropy, which their statistics need.
fce_status check_vp_entropy(const char* fn, const fce_options& o, const float* entropy,
                            const float* grad_entropy);
// refuse_row_grads' `why` for the vocabulary-parallel calls.
constexpr const char* kVpRowGrads = " (the vocabulary-parallel calls do not read it)";

// What a compute call reads through its structures, each read and checked once: the options
// (begin_call), the shard of an fce_vp_* call, the outputs and the gradients.
struct StructUse {
  OutputsUse outputs;
  GradientsUse gradients;
  bool gradients_required;
};
constexpr StructUse kLossCall{OutputsUse::kLoss, GradientsUse::kLogits, false};
constexpr StructUse kLogitsGradCall{OutputsUse::kFlagsOnly, GradientsUse::kLogits, true};
struct CallArgs {
  fce_options o;
  fce_outputs out;
  fce_gradients g;
  fce_vp_shard shard;  // {1, 0, 0, 0, NULL, NULL} for a call without one
};
// begin_call, then (vp: the call takes a shard) check_shard, read_outputs and read_gradients.
fce_status begin_compute(const char* fn, const fce_options* options, const fce_vp_shard* shard,
                         bool vp, const fce_outputs* outputs, const fce_gradients* gradients,
                         StructUse use, CallArgs* a);

// The options (a local copy from begin_call) and the sizes every call shares; fills *out.
fce_status check_options(const char* fn, const fce_options* o, int64_t rows, int64_t vocab,
                         CeOptions* out);

// A stride option (0 = cols) into *resolved; it must be >= cols. cols_name: what the row's
// columns are called in the message (default: "hidden" for the hidden states' stride, else
// "vocab").
fce_status check_stride(const char* fn, const char* name, int64_t stride, int64_t cols,
                        int64_t* resolved, const char* cols_name = nullptr);

// Bytes spanned by `rows` rows of `cols` elements, `stride` apart; -1 if it overflows.
int64_t span_bytes(int64_t rows, int64_t cols, int64_t stride, size_t elem);

fce_status check_hidden(const char* fn, int64_t hidden);

// ---- vocabulary-parallel sizes (fce_vp_*) ----

// vocab_total in [1, 2^31-1], 1 <= vocab_local, and, with a vocab_start (has_start),
// 0 <= vocab_start and vocab_start + vocab_local <= vocab_total; else vocab_local <= vocab_total.
fce_status check_vp_vocab(const char* fn, int64_t vocab_total, int64_t vocab_start,
                          int64_t vocab_local, bool has_start);
inline fce_status check_vocab_total(const char* fn, int64_t vocab_total) {
  return check_vp_vocab(fn, vocab_total, 0, 1, false);
}
// The fce_vp_shard pointer of a compute call (its sizes are checked by the call's own checks).
fce_status check_shard(const char* fn, const fce_vp_shard* shard);
// rows (checked >= 0 by check_options) of stats fit a 64-bit byte offset, and, when the call
// has a ranks argument (ranks not NULL), ranks >= 1 of them do (gathered_stats [ranks, rows,
// FCE_VP_STATS]).
fce_status check_vp_rows(const char* fn, int64_t rows, const int64_t* ranks);
// grad_hidden_dtype of fce_vp_linear_backward: FCE_FLOAT32 or options->dtype.
fce_status check_grad_hidden_dtype(const char* fn, int32_t grad_hidden_dtype, int32_t dtype);

// ---- pointers ----

fce_status check_alignment(const char* fn, const char* name, const void* p, size_t align);

// The pointers a call requires, in the order given: the first NULL one is FCE_ERROR_NULL_POINTER
// ("fn: name is NULL"). A buffer of no elements (empty: rows = 0 for a per-row one) may be NULL.
struct Required {
  const char* name;
  const void* ptr;
  bool empty = false;
};
fce_status check_required(const char* fn, std::initializer_list<Required> pointers);

// A call's argument table: every buffer of the call once, in the order its overlap messages name
// them ("fn: <earlier> overlaps <later>"), absent optional ones with a null ptr.
struct ArgTable {
  const Arg* arg;
  int count;
  template <size_t N>
  ArgTable(const Arg (&table)[N]) : arg(table), count(static_cast<int>(N)) {}  // NOLINT
};

// grad_logits written over logits (in place), where the header allows it (fce_forward,
// fce_backward, fce_vp_backward): the strides of the two.
struct InPlace {
  int64_t row_stride, grad_row_stride;
};

// The checks an argument table drives, in this order: every present entry aligned to its align
// (FCE_ERROR_MISALIGNED: the first one in the table that is not); with in_place, an entry
// "grad_logits" that is the entry "logits" (of some bytes: two pointers to no element are no
// buffer) needs grad_row_stride == row_stride; every output
// disjoint from every other entry (FCE_ERROR_INVALID_ARGUMENT naming the first pair in table
// order), except grad_logits and logits when they are the same buffer, in place. The exception
// is by entry, not by address: another output that starts at the logits' address (loss, lse,
// ... while grad_logits == logits) is an overlap like any other.
fce_status check_args(const char* fn, ArgTable args, const InPlace* in_place = nullptr);

// workspace_bytes >= need (what the backend's query returns for the call), the workspace not
// NULL when need > 0, and aligned to 16 bytes, in that order (after the overlaps).
fce_status check_workspace(const char* fn, size_t need, const void* workspace, size_t bytes);

// The backends' workspace of fce_vp_loss (backward false; vocab_local 0: not an argument) and
// fce_vp_backward (api_vp.cpp; fce_vp_linear_ce's gather-once plan runs fce_vp_loss's too).
size_t vp_workspace(const fce_options& o, const CeOptions& opt, int64_t ranks, int64_t rows,
                    int64_t vocab_total, int64_t vocab_local, bool backward);

// The CUDA backend's check of the table, made once per call before dispatching to it: every
// present entry must be memory the current device can dereference (the CPU backend has none).
inline fce_status check_device_pointers(const char* fn, ArgTable args) {
  return cuda_check_pointers(fn, args.arg, args.count);
}

// The problem, every argument checked, to cpu(p) or, after check_device_pointers, cuda(p).
template <class Problem>
fce_status dispatch(const fce_options& o, ArgTable args, const Problem& p,
                    fce_status (*cpu)(const Problem&), fce_status (*cuda)(const Problem&)) {
  if (o.backend == FCE_BACKEND_CPU) return cpu(p);
  FCE_TRY(check_device_pointers(p.fn, args));
  return cuda(p);
}

// The empty problem (rows = 0, docs/semantics.md "Zero rows"), every argument checked: nothing is
// computed and no backend kernel runs; what the call writes is zeros, the spans given (those
// absent or of no bytes skipped): the reduced loss, z_loss and accuracy of mean and sum, and
// grad_weight and grad_bias without accumulate. The CPU backend writes them at once; the CUDA
// backend, after check_device_pointers, with one small kernel on the caller's stream
// (asynchronous, graph-capturable; nothing at all when no span is left).
fce_status empty_problem(const char* fn, const fce_options& o, ArgTable args,
                         std::initializer_list<ZeroSpan> zeros, void* stream);
// An empty problem's zeros of grad_weight or grad_bias (bytes of them): all of it, or nothing
// with options->accumulate (adding the zero gradient leaves it as it is).
inline ZeroSpan weight_grad_zeros(const fce_options& o, void* grad, uint64_t bytes) {
  return {grad, o.accumulate ? 0 : static_cast<size_t>(bytes)};
}

// ---- the fields several problem structs (lib/internal.h) share, filled the same way ----

// hidden_states, weight, bias, targets (LinearCeProblem, VpLinearProblem).
template <class Problem>
void set_linear_inputs(Problem* p, const void* hidden_states, const void* weight,
                       const void* bias, const void* targets) {
  p->hidden_states = hidden_states;
  p->weight = weight;
  p->bias = bias;
  p->targets = targets;
}
// The loss outputs (CeProblem of fce_forward, LinearCeProblem, VpProblem of fce_vp_loss).
template <class Problem>
void set_loss_outputs(Problem* p, const fce_outputs& out) {
  p->loss = out.loss;
  p->lse = out.lse;
  p->z_loss = out.z_loss;
  p->argmax = out.argmax;
  p->accuracy = out.accuracy;
}
// The entropy output and the upstream gradients of lse and entropy (CeProblem of fce_forward
// and fce_backward, LinearCeProblem).
template <class Problem>
void set_row_terms(Problem* p, const fce_outputs& out, const fce_gradients& g) {
  p->entropy = out.entropy;
  p->grad_lse = g.grad_lse;
  p->grad_entropy = g.grad_entropy;
}
// The gradients of the linear layer, with options->grad_weight_fp32 and ->accumulate
// (LinearCeProblem, VpLinearProblem of fce_vp_linear_backward).
template <class Problem>
void set_linear_grads(Problem* p, const fce_options& o, void* grad_hidden, void* grad_weight,
                      void* grad_bias) {
  p->grad_hidden = grad_hidden;
  p->grad_weight = grad_weight;
  p->grad_bias = grad_bias;
  p->grad_weight_fp32 = o.grad_weight_fp32 != 0;
  p->accumulate = o.accumulate != 0;
}
// The step of a vocabulary-parallel phase-3 problem (VpProblem, VpDistillProblem): the call,
// loss or gradient, the ranks and rows, this rank's shard (the loss: 0, 0), the targets and the
// gathered statistics.
template <class Problem>
void set_vp_step(Problem* p, const char* fn, bool backward, int64_t ranks, int64_t rows,
                 int64_t vocab_total, int64_t vocab_start, int64_t vocab_local,
                 const void* targets, const float* gathered) {
  p->fn = fn;
  p->backward = backward;
  p->ranks = ranks;
  p->rows = rows;
  p->vocab_total = vocab_total;
  p->vocab_start = vocab_start;
  p->vocab_local = vocab_local;
  p->targets = targets;
  p->gathered = gathered;
}
// The workspace and the stream (every problem struct but VpStatsProblem).
template <class Problem>
void set_workspace(Problem* p, void* workspace, size_t workspace_bytes, void* stream) {
  p->workspace = workspace;
  p->workspace_bytes = workspace_bytes;
  p->stream = stream;
}

// ---- the entries most tables share, sized from the options and the rows of the call ----
struct Entries {
  const fce_options& o;
  int64_t rows;
  size_t esize;  // options->dtype
  size_t tsize;  // options->target_dtype
  bool soft;     // class probabilities: targets are [rows, vocab] of target_dtype
  bool per_row;  // FCE_REDUCTION_NONE: loss, grad_output and accuracy have one value per row

  Entries(const fce_options& options, int64_t rows_);
  uint64_t row_floats() const { return static_cast<uint64_t>(rows) * 4; }
  uint64_t reduced_floats() const { return per_row ? row_floats() : 4; }

  // class indices [rows], or (soft) class probabilities [rows, vocab] dense
  Arg targets(const void* p, int64_t vocab = 1) const {
    const uint64_t per_row = soft ? static_cast<uint64_t>(vocab) : 1;
    return {"targets", p, static_cast<uint64_t>(rows) * per_row * tsize, tsize, false};
  }
  Arg class_weights(int64_t vocab) const {
    return {"options->class_weights", o.class_weights, static_cast<uint64_t>(vocab) * 4, 4, false};
  }
  Arg grad_output(const float* p) const {
    return {"gradients->grad_output", p, reduced_floats(), 4, false};
  }
  Arg loss(const float* p) const { return {"outputs->loss", p, reduced_floats(), 4, true}; }
  // lse: the input of the backward calls, or the output outputs->lse
  Arg lse(const float* p, bool output) const {
    return {output ? "outputs->lse" : "lse", p, row_floats(), 4, output};
  }
  // outputs->entropy, gradients->grad_lse and ->grad_entropy: float32 [rows]
  Arg entropy(const float* p) const { return {"outputs->entropy", p, row_floats(), 4, true}; }
  Arg grad_lse(const float* p) const { return {"gradients->grad_lse", p, row_floats(), 4, false}; }
  Arg grad_entropy(const float* p) const {
    return {"gradients->grad_entropy", p, row_floats(), 4, false};
  }
  Arg argmax(const int64_t* p) const {
    return {"outputs->argmax", p, static_cast<uint64_t>(rows) * 8, 8, true};
  }
  Arg accuracy(const float* p) const {
    return {"outputs->accuracy", p, reduced_floats(), 4, true};
  }
  // An empty problem's zeros of a reduced output (loss, accuracy): none for reduction
  // none (no row, no element), [1] for mean and sum.
  ZeroSpan reduced_zeros(void* p) const { return {p, static_cast<size_t>(reduced_floats())}; }
  // a row of a shard's statistics: FCE_VP_STATS float32, FCE_VP_STATS_INVARIANT under
  // options->batch_invariant
  uint64_t stats_row_bytes() const { return o.batch_invariant ? kExactStatsBytes : kStatsBytes; }
  Arg gathered_stats(const float* p, int64_t ranks) const {
    return {"gathered_stats", p,
            static_cast<uint64_t>(ranks) * static_cast<uint64_t>(rows) * stats_row_bytes(), 16,
            false};
  }
  Arg stats(const float* p) const {
    return {"stats", p, static_cast<uint64_t>(rows) * stats_row_bytes(), 16, true};
  }
};

// One float32 written (z_loss) or one uint32 ORed into (error_flags).
inline Arg scalar_output(const char* name, const void* p) { return {name, p, 4, 4, true}; }
inline Arg z_loss_arg(const float* p) { return scalar_output("outputs->z_loss", p); }
inline Arg error_flags_arg(const uint32_t* p) { return scalar_output("outputs->error_flags", p); }
// The workspace's 16-byte alignment is checked with its size (check_workspace, after the
// overlaps), not by check_alignment: align 1 here.
inline Arg workspace_arg(const void* p, size_t bytes) { return {"workspace", p, bytes, 1, true}; }

// ---- workspace queries ----

// A query's size_t outputs: *bytes (required) / *min_bytes (required) and *optimal_bytes.
fce_status check_size_output(const char* fn, const size_t* bytes);
fce_status check_size_outputs(const char* fn, const size_t* min_bytes,
                              const size_t* optimal_bytes);
inline void write_sizes(size_t* min_bytes, size_t* optimal_bytes, size_t lo, size_t hi) {
  *min_bytes = lo;
  if (optimal_bytes) *optimal_bytes = hi;
}

}  // namespace abi
}  // namespace fce
