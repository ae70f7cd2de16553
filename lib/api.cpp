// api.cpp — the C ABI: validates every argument, names the bad one, then dispatches to a
// backend. Nothing is written to any output before every check has passed, so a failing call
// leaves the caller's buffers untouched.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "internal.h"

namespace fce {
void clear_error();
}

namespace {

using fce::fail;

constexpr int64_t kMaxVocab = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxBytes = std::numeric_limits<int64_t>::max() / 2;

// One buffer the call reads or writes, for the overlap and alignment checks.
struct Range {
  const char* name;
  const void* ptr;
  uint64_t bytes;
  bool output;
};

bool overlaps(const Range& a, const Range& b) {
  if (!a.ptr || !b.ptr || a.bytes == 0 || b.bytes == 0) return false;
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(a.ptr), b0 = reinterpret_cast<uintptr_t>(b.ptr);
  return a0 < b0 + b.bytes && b0 < a0 + a.bytes;
}

// Every output must be disjoint from every other buffer, except ranges[in_place_a] and
// ranges[in_place_b] (grad_logits written over logits; -1: no exception). The exception is by
// position, not by address: another output that starts at the logits' address (loss, lse, ...
// while grad_logits == logits) is an overlap like any other.
fce_status check_overlaps(const char* fn, const Range* r, int n, int in_place_a = -1,
                          int in_place_b = -1) {
  for (int i = 0; i < n; ++i) {
    for (int j = i + 1; j < n; ++j) {
      if (!(r[i].output || r[j].output)) continue;
      if (!overlaps(r[i], r[j])) continue;
      const bool in_place = (i == in_place_a && j == in_place_b) ||
                            (i == in_place_b && j == in_place_a);
      if (in_place) continue;
      const bool with_in_place = in_place_a >= 0 && (i == in_place_a || i == in_place_b ||
                                                      j == in_place_a || j == in_place_b);
      return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: %s overlaps %s%s", fn, r[i].name, r[j].name,
                  with_in_place ? " (grad_logits is logits, in place: no other buffer may overlap "
                                  "them)"
                                : "");
    }
  }
  return FCE_SUCCESS;
}

fce_status check_alignment(const char* fn, const char* name, const void* p, size_t align) {
  if (p && reinterpret_cast<uintptr_t>(p) % align != 0)
    return fail(FCE_ERROR_MISALIGNED, "%s: %s (%p) is not aligned to %zu bytes", fn, name, p,
                align);
  return FCE_SUCCESS;
}

// Bytes spanned by `rows` rows of `cols` elements, `stride` apart; -1 if it overflows.
int64_t span_bytes(int64_t rows, int64_t cols, int64_t stride, size_t elem) {
  if (rows <= 0 || cols <= 0) return 0;
  const int64_t max_elems = kMaxBytes / static_cast<int64_t>(elem);
  if (stride > 0 && rows - 1 > (max_elems - cols) / stride) return -1;
  return ((rows - 1) * stride + cols) * static_cast<int64_t>(elem);
}

// The caller's options as this library's fce_options: the defaults, overwritten by the
// struct_size bytes the caller's struct has. A 0.1/0.2 caller (struct_size
// FCE_OPTIONS_SIZE_V0_1) thereby gets the defaults of the fields appended in 0.3; the library
// never reads past the caller's struct. struct_size must be the size of some version's struct.
fce_status read_options(const char* fn, const fce_options* o, fce_options* local) {
  static_assert(sizeof(fce_options) == FCE_OPTIONS_SIZE_V0_3, "fce_options changed size");
  if (!o) return fail(FCE_ERROR_NULL_POINTER, "%s: options is NULL", fn);
  const size_t size = o->struct_size;
  if (size < FCE_OPTIONS_SIZE_V0_1)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->struct_size (%zu) is smaller than the smallest fce_options (%d): "
                "initialise it with FCE_OPTIONS_INIT or fce_options_default()",
                fn, size, FCE_OPTIONS_SIZE_V0_1);
  if (size > sizeof(fce_options))
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->struct_size (%zu) is larger than this library's fce_options "
                "(%zu): the caller's header is newer than the library (version %u)",
                fn, size, sizeof(fce_options), (unsigned)FCE_VERSION_NUMBER);
  if (size != FCE_OPTIONS_SIZE_V0_1 && size != FCE_OPTIONS_SIZE_V0_3)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->struct_size (%zu) is the size of no version's fce_options "
                "(%d for 0.1 and 0.2, %d for 0.3)",
                fn, size, FCE_OPTIONS_SIZE_V0_1, FCE_OPTIONS_SIZE_V0_3);
  const fce_options defaults = FCE_OPTIONS_INIT;
  *local = defaults;
  std::memcpy(local, o, size);
  return FCE_SUCCESS;
}

// Checks the options (a local copy from read_options) and the sizes every call shares; fills
// `out`.
fce_status check_options(const char* fn, const fce_options* o, int64_t rows, int64_t vocab,
                         fce::CeOptions* out) {
  if (o->reserved0 != 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: options->reserved0 (%d) must be 0", fn,
                o->reserved0);
  if (o->reserved1 != 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: options->reserved1 (%d) must be 0", fn,
                o->reserved1);
  if (o->backend != FCE_BACKEND_CUDA && o->backend != FCE_BACKEND_CPU)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: options->backend (%d) is not an fce_backend", fn,
                o->backend);
  if (o->dtype != FCE_FLOAT32 && o->dtype != FCE_FLOAT16 && o->dtype != FCE_BFLOAT16)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->dtype (%d) must be FCE_FLOAT32, FCE_FLOAT16 or FCE_BFLOAT16", fn,
                o->dtype);
  if (o->target_dtype != FCE_INT32 && o->target_dtype != FCE_INT64)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->target_dtype (%d) must be FCE_INT32 or FCE_INT64", fn,
                o->target_dtype);
  if (o->reduction != FCE_REDUCTION_MEAN && o->reduction != FCE_REDUCTION_SUM &&
      o->reduction != FCE_REDUCTION_NONE)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: options->reduction (%d) is not an fce_reduction",
                fn, o->reduction);
  if (!(o->label_smoothing >= 0.0f && o->label_smoothing < 1.0f))
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->label_smoothing (%g) must be in [0, 1)", fn,
                (double)o->label_smoothing);
  if (!(o->z_loss_scale >= 0.0f) || !std::isfinite(o->z_loss_scale))
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->z_loss_scale (%g) must be finite and >= 0", fn,
                (double)o->z_loss_scale);
  if (!(o->softcap >= 0.0f) || !std::isfinite(o->softcap))
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->softcap (%g) must be finite and >= 0 (0 = off)", fn,
                (double)o->softcap);
  if (!std::isfinite(o->logit_scale) || o->logit_scale == 0.0f)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->logit_scale (%g) must be finite and non-zero", fn,
                (double)o->logit_scale);
  if (rows < 1)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: rows (%lld) must be >= 1", fn, (long long)rows);
  if (vocab < 1 || vocab > kMaxVocab)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: vocab (%lld) must be in [1, 2^31-1]", fn,
                (long long)vocab);
  if (o->shift_seq_len < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: options->shift_seq_len (%lld) must be >= 0", fn,
                (long long)o->shift_seq_len);
  if (o->shift_seq_len > 0 && rows % o->shift_seq_len != 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: rows (%lld) is not a multiple of options->shift_seq_len (%lld)", fn,
                (long long)rows, (long long)o->shift_seq_len);
  if (o->shift < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: options->shift (%lld) must be >= 0", fn,
                (long long)o->shift);
  if (o->shift != 0 && o->shift_seq_len == 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->shift (%lld) needs options->shift_seq_len > 0 (it is 0: no shift)",
                fn, (long long)o->shift);
  FCE_TRY(check_alignment(fn, "options->class_weights", o->class_weights, 4));
  if (o->backend == FCE_BACKEND_CUDA && !fce::cuda_available())
    return fail(FCE_ERROR_BACKEND_UNAVAILABLE,
                "%s: options->backend is FCE_BACKEND_CUDA but %s", fn,
#if defined(FCE_WITH_CUDA)
                "no CUDA device is visible"
#else
                "this build has no CUDA backend"
#endif
    );
  out->dtype = o->dtype;
  out->targets_int64 = o->target_dtype == FCE_INT64;
  out->reduction = o->reduction;
  out->ignore_index = o->ignore_index;
  out->label_smoothing = o->label_smoothing;
  out->z_loss_scale = o->z_loss_scale;
  out->softcap = o->softcap;
  out->logit_scale = o->logit_scale;
  out->class_weights = o->class_weights;
  out->shift_seq_len = o->shift_seq_len;
  // SEMANTICS 1: k = options->shift, 0 meaning 1, with a shift; 0 without.
  out->shift = o->shift_seq_len > 0 ? (o->shift > 0 ? o->shift : 1) : 0;
  out->token_scaling = o->token_scaling != 0;
  out->deterministic = o->deterministic != 0;
  return FCE_SUCCESS;
}

// The optional forward outputs options->argmax (int64 [rows]) and options->accuracy (float32 [1]
// or [rows]): their alignment, and their ranges for the overlap check.
fce_status check_forward_outputs(const char* fn, const fce_options& o, int64_t rows,
                                 Range* argmax, Range* accuracy) {
  FCE_TRY(check_alignment(fn, "options->argmax", o.argmax, 8));
  FCE_TRY(check_alignment(fn, "options->accuracy", o.accuracy, 4));
  const bool per_row = o.reduction == FCE_REDUCTION_NONE;
  *argmax = {"options->argmax", o.argmax, static_cast<uint64_t>(rows) * 8, true};
  *accuracy = {"options->accuracy", o.accuracy, per_row ? static_cast<uint64_t>(rows) * 4 : 4,
               true};
  return FCE_SUCCESS;
}

// cols_name: what the row's columns are called in the message (default: "hidden" for the
// hidden states' stride, else "vocab").
fce_status check_stride(const char* fn, const char* name, int64_t stride, int64_t cols,
                        int64_t* resolved, const char* cols_name = nullptr) {
  if (stride == 0) stride = cols;
  if (!cols_name) cols_name = std::strstr(name, "hidden") ? "hidden" : "vocab";
  if (stride < cols)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: %s (%lld) is less than %s (%lld)", fn, name,
                (long long)stride, cols_name, (long long)cols);
  *resolved = stride;
  return FCE_SUCCESS;
}

fce_status check_workspace(const char* fn, size_t need, const void* workspace, size_t bytes) {
  if (bytes < need)
    return fail(FCE_ERROR_WORKSPACE_TOO_SMALL,
                "%s: workspace_bytes (%zu) is less than the %zu bytes the workspace query "
                "returned",
                fn, bytes, need);
  if (need > 0 && !workspace)
    return fail(FCE_ERROR_NULL_POINTER, "%s: workspace is NULL but %zu bytes are needed", fn,
                need);
  return check_alignment(fn, "workspace", workspace, 16);
}

size_t ce_workspace(const fce_options* o, const fce::CeOptions& opt, int64_t rows, int64_t vocab,
                    bool backward) {
  return o->backend == FCE_BACKEND_CPU ? fce::cpu_ce_workspace_size(opt, rows, vocab, backward)
                                       : fce::cuda_ce_workspace_size(opt, rows, vocab, backward);
}

fce_status ce_workspace_query(const char* fn, const fce_options* options, int64_t rows,
                              int64_t vocab, bool backward, size_t* bytes) {
  fce::clear_error();
  fce_options o;
  FCE_TRY(read_options(fn, options, &o));
  fce::CeOptions opt;
  FCE_TRY(check_options(fn, &o, rows, vocab, &opt));
  if (!bytes) return fail(FCE_ERROR_NULL_POINTER, "%s: workspace_bytes is NULL", fn);
  FCE_TRY(check_alignment(fn, "workspace_bytes", bytes, alignof(size_t)));
  *bytes = ce_workspace(&o, opt, rows, vocab, backward);
  return FCE_SUCCESS;
}

// Shared by fce_forward, fce_backward and fce_backward_rescale (the backward calls: lse_in set,
// loss/lse/z_loss NULL, options->argmax and ->accuracy ignored).
fce_status ce_call(const char* fn, const fce_options* options, int64_t rows, int64_t vocab,
                   const void* logits, const void* targets, float* loss, float* lse,
                   float* z_loss, void* grad, const float* grad_output, const float* lse_in,
                   uint32_t* error_flags, void* workspace, size_t workspace_bytes, void* stream,
                   bool rescale = false) {
  fce::clear_error();
  const bool backward = lse_in != nullptr || loss == nullptr;
  fce_options local;
  FCE_TRY(read_options(fn, options, &local));
  const fce_options* o = &local;
  fce::CeProblem p{};
  FCE_TRY(check_options(fn, o, rows, vocab, &p.opt));
  if (rescale && o->reduction == FCE_REDUCTION_NONE)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->reduction is FCE_REDUCTION_NONE: a per-row upstream gradient "
                "needs fce_backward", fn);
  if (!logits) return fail(FCE_ERROR_NULL_POINTER, "%s: logits is NULL", fn);
  if (!targets) return fail(FCE_ERROR_NULL_POINTER, "%s: targets is NULL", fn);
  FCE_TRY(check_stride(fn, "options->row_stride", o->row_stride, vocab, &p.row_stride));
  FCE_TRY(
      check_stride(fn, "options->grad_row_stride", o->grad_row_stride, vocab, &p.grad_row_stride));
  const size_t esize = fce::dtype_size(o->dtype), tsize = fce::dtype_size(o->target_dtype);
  const int64_t logits_bytes = span_bytes(rows, vocab, p.row_stride, esize);
  const int64_t grad_bytes = grad ? span_bytes(rows, vocab, p.grad_row_stride, esize) : 0;
  if (logits_bytes < 0 || grad_bytes < 0 || rows > kMaxBytes / 8)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: rows (%lld) x row stride overflows a 64-bit byte offset", fn,
                (long long)rows);
  const bool per_row = o->reduction == FCE_REDUCTION_NONE;
  FCE_TRY(check_alignment(fn, "logits", logits, esize));
  FCE_TRY(check_alignment(fn, "targets", targets, tsize));
  FCE_TRY(check_alignment(fn, "loss", loss, 4));
  FCE_TRY(check_alignment(fn, "lse", lse, 4));
  FCE_TRY(check_alignment(fn, "z_loss", z_loss, 4));
  FCE_TRY(check_alignment(fn, "grad_logits", grad, esize));
  FCE_TRY(check_alignment(fn, "grad_output", grad_output, 4));
  FCE_TRY(check_alignment(fn, "lse", lse_in, 4));
  FCE_TRY(check_alignment(fn, "error_flags", error_flags, 4));
  Range argmax{}, accuracy{};  // the forward's optional outputs; never written by the backward
  if (!backward) FCE_TRY(check_forward_outputs(fn, *o, rows, &argmax, &accuracy));
  if (grad && grad == logits && p.grad_row_stride != p.row_stride)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: grad_logits is logits (in place) but options->grad_row_stride (%lld) != "
                "options->row_stride (%lld)",
                fn, (long long)p.grad_row_stride, (long long)p.row_stride);
  const uint64_t rbytes = static_cast<uint64_t>(rows) * 4;
  enum { kLogits = 0, kGrad = 8 };  // positions in ranges
  const Range ranges[] = {
      {"logits", logits, static_cast<uint64_t>(logits_bytes), false},
      {"targets", targets, static_cast<uint64_t>(rows) * tsize, false},
      {"options->class_weights", o->class_weights, static_cast<uint64_t>(vocab) * 4, false},
      {"grad_output", grad_output, per_row ? rbytes : 4, false},
      {"lse", lse_in, rbytes, false},
      {"loss", loss, per_row ? rbytes : 4, true},
      {"lse", lse, rbytes, true},
      {"z_loss", z_loss, 4, true},
      {"grad_logits", grad, static_cast<uint64_t>(grad_bytes), true},
      {"error_flags", error_flags, 4, true},
      {"workspace", workspace, workspace_bytes, true},
      argmax,
      accuracy,
  };
  static_assert(sizeof ranges / sizeof ranges[0] > kGrad, "ranges");
  // grad_logits may be logits itself (same start, same stride: checked above); any other
  // overlap is an error, an output inside the logits of an in-place call included.
  const bool in_place = grad != nullptr && grad == logits;
  FCE_TRY(check_overlaps(fn, ranges, sizeof ranges / sizeof ranges[0], in_place ? kLogits : -1,
                         in_place ? kGrad : -1));
  FCE_TRY(check_workspace(fn, ce_workspace(o, p.opt, rows, vocab, backward), workspace,
                          workspace_bytes));
  p.rows = rows;
  p.vocab = vocab;
  p.logits = logits;
  p.targets = targets;
  p.loss = loss;
  p.lse = lse;
  p.z_loss = z_loss;
  p.grad = grad;
  p.grad_output = grad_output;
  p.lse_in = lse_in;
  p.error_flags = error_flags;
  p.argmax = backward ? nullptr : o->argmax;
  p.accuracy = backward ? nullptr : o->accuracy;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  p.stream = stream;
  p.rescale = rescale;
  return o->backend == FCE_BACKEND_CPU ? fce::cpu_ce(p) : fce::cuda_ce(p);
}

void linear_workspace(const fce_options* o, const fce::CeOptions& opt, int64_t rows,
                      int64_t hidden, int64_t vocab, bool with_grad, size_t* min_bytes,
                      size_t* optimal_bytes) {
  const bool fp32 = o->grad_weight_fp32 != 0;
  if (o->backend == FCE_BACKEND_CPU)
    fce::cpu_linear_ce_workspace_size(opt, rows, hidden, vocab, with_grad, fp32, min_bytes,
                                      optimal_bytes);
  else
    fce::cuda_linear_ce_workspace_size(opt, rows, hidden, vocab, with_grad, fp32, min_bytes,
                                       optimal_bytes);
}

fce_status check_hidden(const char* fn, int64_t hidden) {
  if (hidden < 1 || hidden > kMaxVocab)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: hidden (%lld) must be in [1, 2^31-1]", fn,
                (long long)hidden);
  return FCE_SUCCESS;
}

// ---- vocabulary-parallel (fce_vp_*) ----

constexpr int64_t kStatsBytes = FCE_VP_STATS * 4;  // one row of a shard's statistics

// vocab_total in [1, 2^31-1], 1 <= vocab_local, and, with a vocab_start (has_start),
// 0 <= vocab_start and vocab_start + vocab_local <= vocab_total; else vocab_local <= vocab_total.
fce_status check_vp_vocab(const char* fn, int64_t vocab_total, int64_t vocab_start,
                          int64_t vocab_local, bool has_start) {
  if (vocab_total < 1 || vocab_total > kMaxVocab)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: vocab_total (%lld) must be in [1, 2^31-1]", fn,
                (long long)vocab_total);
  if (vocab_local < 1)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: vocab_local (%lld) must be >= 1", fn,
                (long long)vocab_local);
  if (!has_start) {
    if (vocab_local > vocab_total)
      return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: vocab_local (%lld) exceeds vocab_total (%lld)",
                  fn, (long long)vocab_local, (long long)vocab_total);
    return FCE_SUCCESS;
  }
  if (vocab_start < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: vocab_start (%lld) must be >= 0", fn,
                (long long)vocab_start);
  if (vocab_start > vocab_total - vocab_local)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: vocab_start (%lld) + vocab_local (%lld) exceeds vocab_total (%lld)", fn,
                (long long)vocab_start, (long long)vocab_local, (long long)vocab_total);
  return FCE_SUCCESS;
}

fce_status check_vocab_total(const char* fn, int64_t vocab_total) {
  return check_vp_vocab(fn, vocab_total, 0, 1, false);
}

// rows (checked >= 1 by check_options) of stats fit a 64-bit byte offset, and, when the call
// has a ranks argument (ranks not NULL), ranks >= 1 of them do (gathered_stats [ranks, rows,
// FCE_VP_STATS]).
fce_status check_vp_rows(const char* fn, int64_t rows, const int64_t* ranks_arg) {
  if (rows > kMaxBytes / kStatsBytes)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: rows (%lld) x FCE_VP_STATS overflows a 64-bit byte offset", fn,
                (long long)rows);
  if (!ranks_arg) return FCE_SUCCESS;
  const int64_t ranks = *ranks_arg;
  if (ranks < 1)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: ranks (%lld) must be >= 1", fn,
                (long long)ranks);
  if (ranks > kMaxBytes / kStatsBytes / rows)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: ranks (%lld) x rows (%lld) x FCE_VP_STATS overflows a 64-bit byte offset", fn,
                (long long)ranks, (long long)rows);
  return FCE_SUCCESS;
}

// grad_hidden_dtype of fce_vp_linear_backward: FCE_FLOAT32 or options->dtype.
fce_status check_grad_hidden_dtype(const char* fn, int32_t grad_hidden_dtype, int32_t dtype) {
  if (grad_hidden_dtype != FCE_FLOAT32 && grad_hidden_dtype != dtype)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: grad_hidden_dtype (%d) must be FCE_FLOAT32 or options->dtype (%d)", fn,
                grad_hidden_dtype, dtype);
  return FCE_SUCCESS;
}

// The backends' workspace of fce_vp_loss (backward false; vocab_local 0: not an argument) and
// fce_vp_backward.
size_t vp_workspace(const fce_options* o, const fce::CeOptions& opt, int64_t ranks, int64_t rows,
                    int64_t vocab_total, int64_t vocab_local, bool backward) {
  return o->backend == FCE_BACKEND_CPU
             ? fce::cpu_vp_workspace_size(opt, ranks, rows, vocab_total, vocab_local, backward)
             : fce::cuda_vp_workspace_size(opt, ranks, rows, vocab_total, vocab_local, backward);
}

// The backends' workspace of fce_vp_linear_stats (backward false: the query knows neither ranks
// nor vocab_total, so they are passed as 1 and vocab_local, by the query and by the call alike;
// grad_hidden_dtype FCE_FLOAT32, unused) and fce_vp_linear_backward.
void vp_linear_workspace(const fce_options* o, const fce::CeOptions& opt, int64_t ranks,
                         int64_t rows, int64_t hidden, int64_t vocab_total, int64_t vocab_local,
                         bool backward, int32_t grad_hidden_dtype, size_t* min_bytes,
                         size_t* optimal_bytes) {
  const bool fp32 = o->grad_weight_fp32 != 0;
  if (o->backend == FCE_BACKEND_CPU)
    fce::cpu_vp_linear_workspace_size(opt, ranks, rows, hidden, vocab_total, vocab_local,
                                      backward, grad_hidden_dtype, fp32, min_bytes,
                                      optimal_bytes);
  else
    fce::cuda_vp_linear_workspace_size(opt, ranks, rows, hidden, vocab_total, vocab_local,
                                       backward, grad_hidden_dtype, fp32, min_bytes,
                                       optimal_bytes);
}

// The optional size_t outputs of a linear workspace query.
fce_status linear_query_outputs(const char* fn, size_t* min_bytes, size_t* optimal_bytes) {
  if (!min_bytes) return fail(FCE_ERROR_NULL_POINTER, "%s: min_bytes is NULL", fn);
  FCE_TRY(check_alignment(fn, "min_bytes", min_bytes, alignof(size_t)));
  return check_alignment(fn, "optimal_bytes", optimal_bytes, alignof(size_t));
}

}  // namespace

extern "C" {

FCE_API int fce_cuda_available(void) { return fce::cuda_available() ? 1 : 0; }

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
                               const void* logits, const void* targets, float* loss, float* lse,
                               float* z_loss, void* grad_logits, const float* grad_output,
                               uint32_t* error_flags, void* workspace, size_t workspace_bytes,
                               void* stream) {
  const char* fn = "fce_forward";
  if (!loss) {
    fce::clear_error();
    return fail(FCE_ERROR_NULL_POINTER, "%s: loss is NULL", fn);
  }
  return ce_call(fn, options, rows, vocab, logits, targets, loss, lse, z_loss, grad_logits,
                 grad_output, nullptr, error_flags, workspace, workspace_bytes, stream);
}

FCE_API fce_status fce_backward(const fce_options* options, int64_t rows, int64_t vocab,
                                const void* logits, const void* targets, const float* lse,
                                const float* grad_output, void* grad_logits,
                                uint32_t* error_flags, void* workspace, size_t workspace_bytes,
                                void* stream) {
  const char* fn = "fce_backward";
  fce::clear_error();
  if (!lse) return fail(FCE_ERROR_NULL_POINTER, "%s: lse is NULL", fn);
  if (!grad_logits) return fail(FCE_ERROR_NULL_POINTER, "%s: grad_logits is NULL", fn);
  return ce_call(fn, options, rows, vocab, logits, targets, nullptr, nullptr, nullptr,
                 grad_logits, grad_output, lse, error_flags, workspace, workspace_bytes, stream);
}

FCE_API fce_status fce_backward_rescale(const fce_options* options, int64_t rows, int64_t vocab,
                                        const void* logits, const void* targets,
                                        const float* lse, const float* grad_output,
                                        void* grad_logits, uint32_t* error_flags,
                                        void* workspace, size_t workspace_bytes, void* stream) {
  const char* fn = "fce_backward_rescale";
  fce::clear_error();
  if (!lse) return fail(FCE_ERROR_NULL_POINTER, "%s: lse is NULL", fn);
  if (!grad_logits) return fail(FCE_ERROR_NULL_POINTER, "%s: grad_logits is NULL", fn);
  if (!grad_output)
    return fail(FCE_ERROR_NULL_POINTER, "%s: grad_output is NULL (the upstream scalar)", fn);
  if (grad_logits == logits)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: grad_logits is logits: a gradient written over the logits cannot be "
                "recomputed; scale it with fce_scale_gradient", fn);
  return ce_call(fn, options, rows, vocab, logits, targets, nullptr, nullptr, nullptr,
                 grad_logits, grad_output, lse, error_flags, workspace, workspace_bytes, stream,
                 true);
}

FCE_API fce_status fce_linear_ce_workspace_size(const fce_options* options, int64_t rows,
                                                int64_t hidden, int64_t vocab, int with_grad,
                                                size_t* min_bytes, size_t* optimal_bytes) {
  const char* fn = "fce_linear_ce_workspace_size";
  fce::clear_error();
  fce_options o;
  FCE_TRY(read_options(fn, options, &o));
  fce::CeOptions opt;
  FCE_TRY(check_options(fn, &o, rows, vocab, &opt));
  FCE_TRY(check_hidden(fn, hidden));
  if (!min_bytes) return fail(FCE_ERROR_NULL_POINTER, "%s: min_bytes is NULL", fn);
  FCE_TRY(check_alignment(fn, "min_bytes", min_bytes, alignof(size_t)));
  FCE_TRY(check_alignment(fn, "optimal_bytes", optimal_bytes, alignof(size_t)));
  size_t lo = 0, hi = 0;
  linear_workspace(&o, opt, rows, hidden, vocab, with_grad != 0, &lo, &hi);
  *min_bytes = lo;
  if (optimal_bytes) *optimal_bytes = hi;
  return FCE_SUCCESS;
}

FCE_API fce_status fce_linear_ce(const fce_options* options, int64_t rows, int64_t hidden,
                                 int64_t vocab, const void* hidden_states, const void* weight,
                                 const void* bias, const void* targets, float* loss, float* lse,
                                 float* z_loss, void* grad_hidden, void* grad_weight,
                                 void* grad_bias, const float* grad_output, uint32_t* error_flags,
                                 void* workspace, size_t workspace_bytes, void* stream) {
  const char* fn = "fce_linear_ce";
  fce::clear_error();
  fce_options local;
  FCE_TRY(read_options(fn, options, &local));
  const fce_options* o = &local;
  fce::LinearCeProblem p{};
  FCE_TRY(check_options(fn, o, rows, vocab, &p.opt));
  FCE_TRY(check_hidden(fn, hidden));
  if (!hidden_states) return fail(FCE_ERROR_NULL_POINTER, "%s: hidden_states is NULL", fn);
  if (!weight) return fail(FCE_ERROR_NULL_POINTER, "%s: weight is NULL", fn);
  if (!targets) return fail(FCE_ERROR_NULL_POINTER, "%s: targets is NULL", fn);
  if (!loss) return fail(FCE_ERROR_NULL_POINTER, "%s: loss is NULL", fn);
  if (grad_bias && !bias)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: grad_bias is given but bias is NULL", fn);
  FCE_TRY(check_stride(fn, "options->hidden_row_stride", o->hidden_row_stride, hidden,
                       &p.hidden_row_stride));
  // One row has no "next row": its stride is never used, whatever it is (the header allows any
  // stride >= hidden), so the backends see the dense value (BLAS and cuBLASLt take int ones).
  if (rows == 1) p.hidden_row_stride = hidden;
  const size_t esize = fce::dtype_size(o->dtype), tsize = fce::dtype_size(o->target_dtype);
  const size_t gw_size = o->grad_weight_fp32 ? 4 : esize;
  const int64_t h_bytes = span_bytes(rows, hidden, p.hidden_row_stride, esize);
  const int64_t w_bytes = span_bytes(vocab, hidden, hidden, 4);  // largest: f32 grad_weight
  const int64_t gh_bytes = span_bytes(rows, hidden, hidden, esize);
  if (h_bytes < 0 || w_bytes < 0 || gh_bytes < 0 || rows > kMaxBytes / 8)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: the sizes (rows %lld, hidden %lld, vocab %lld) overflow a 64-bit byte "
                "offset",
                fn, (long long)rows, (long long)hidden, (long long)vocab);
  FCE_TRY(check_alignment(fn, "hidden_states", hidden_states, esize));
  FCE_TRY(check_alignment(fn, "weight", weight, esize));
  FCE_TRY(check_alignment(fn, "bias", bias, esize));
  FCE_TRY(check_alignment(fn, "targets", targets, tsize));
  FCE_TRY(check_alignment(fn, "loss", loss, 4));
  FCE_TRY(check_alignment(fn, "lse", lse, 4));
  FCE_TRY(check_alignment(fn, "z_loss", z_loss, 4));
  FCE_TRY(check_alignment(fn, "grad_hidden", grad_hidden, esize));
  FCE_TRY(check_alignment(fn, "grad_weight", grad_weight, gw_size));
  FCE_TRY(check_alignment(fn, "grad_bias", grad_bias, gw_size));
  FCE_TRY(check_alignment(fn, "grad_output", grad_output, 4));
  FCE_TRY(check_alignment(fn, "error_flags", error_flags, 4));
  Range argmax{}, accuracy{};
  FCE_TRY(check_forward_outputs(fn, *o, rows, &argmax, &accuracy));
  const bool per_row = o->reduction == FCE_REDUCTION_NONE;
  const uint64_t rbytes = static_cast<uint64_t>(rows) * 4;
  const uint64_t vd = static_cast<uint64_t>(vocab) * static_cast<uint64_t>(hidden);
  const Range ranges[] = {
      {"hidden_states", hidden_states, static_cast<uint64_t>(h_bytes), false},
      {"weight", weight, vd * esize, false},
      {"bias", bias, static_cast<uint64_t>(vocab) * esize, false},
      {"targets", targets, static_cast<uint64_t>(rows) * tsize, false},
      {"options->class_weights", o->class_weights, static_cast<uint64_t>(vocab) * 4, false},
      {"grad_output", grad_output, per_row ? rbytes : 4, false},
      {"loss", loss, per_row ? rbytes : 4, true},
      {"lse", lse, rbytes, true},
      {"z_loss", z_loss, 4, true},
      {"grad_hidden", grad_hidden, static_cast<uint64_t>(gh_bytes), true},
      {"grad_weight", grad_weight, vd * gw_size, true},
      {"grad_bias", grad_bias, static_cast<uint64_t>(vocab) * gw_size, true},
      {"error_flags", error_flags, 4, true},
      {"workspace", workspace, workspace_bytes, true},
      argmax,
      accuracy,
  };
  FCE_TRY(check_overlaps(fn, ranges, sizeof ranges / sizeof ranges[0]));
  const bool with_grad = grad_hidden || grad_weight || grad_bias;
  size_t min_bytes = 0, optimal_bytes = 0;
  linear_workspace(o, p.opt, rows, hidden, vocab, with_grad, &min_bytes, &optimal_bytes);
  FCE_TRY(check_workspace(fn, min_bytes, workspace, workspace_bytes));
  p.rows = rows;
  p.hidden = hidden;
  p.vocab = vocab;
  p.hidden_states = hidden_states;
  p.weight = weight;
  p.bias = bias;
  p.targets = targets;
  p.loss = loss;
  p.lse = lse;
  p.z_loss = z_loss;
  p.grad_hidden = grad_hidden;
  p.grad_weight = grad_weight;
  p.grad_bias = grad_bias;
  p.grad_weight_fp32 = o->grad_weight_fp32 != 0;
  p.accumulate = o->accumulate != 0;
  p.grad_output = grad_output;
  p.error_flags = error_flags;
  p.argmax = o->argmax;
  p.accuracy = o->accuracy;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  p.stream = stream;
  return o->backend == FCE_BACKEND_CPU ? fce::cpu_linear_ce(p) : fce::cuda_linear_ce(p);
}

FCE_API fce_status fce_scale_gradient(int32_t backend, int32_t dtype, int64_t count, void* grad,
                                      const float* grad_output, void* stream) {
  const char* fn = "fce_scale_gradient";
  fce::clear_error();
  if (backend != FCE_BACKEND_CUDA && backend != FCE_BACKEND_CPU)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: backend (%d) is not an fce_backend", fn, backend);
  if (dtype != FCE_FLOAT32 && dtype != FCE_FLOAT16 && dtype != FCE_BFLOAT16)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: dtype (%d) must be FCE_FLOAT32, FCE_FLOAT16 or FCE_BFLOAT16", fn, dtype);
  const size_t esize = fce::dtype_size(dtype);
  if (count < 0 || count > kMaxBytes / static_cast<int64_t>(esize))
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: count (%lld) must be in [0, 2^62 / %zu]", fn,
                (long long)count, esize);
  if (!grad_output) return fail(FCE_ERROR_NULL_POINTER, "%s: grad_output is NULL", fn);
  if (count > 0 && !grad) return fail(FCE_ERROR_NULL_POINTER, "%s: grad is NULL", fn);
  FCE_TRY(check_alignment(fn, "grad", grad, esize));
  FCE_TRY(check_alignment(fn, "grad_output", grad_output, 4));
  const Range ranges[] = {
      {"grad", grad, static_cast<uint64_t>(count) * esize, true},
      {"grad_output", grad_output, 4, false},
  };
  FCE_TRY(check_overlaps(fn, ranges, 2));
  if (count == 0) return FCE_SUCCESS;
  if (backend == FCE_BACKEND_CPU) return fce::cpu_scale_gradient(dtype, count, grad, grad_output);
  if (!fce::cuda_available())
    return fail(FCE_ERROR_BACKEND_UNAVAILABLE, "%s: no CUDA device or no CUDA backend", fn);
  return fce::cuda_scale_gradient(dtype, count, grad, grad_output, stream);
}

// ---------------------------------------------------------------- vocabulary-parallel ----

FCE_API fce_status fce_vp_stats(const fce_options* options, int64_t rows, int64_t vocab_total,
                                int64_t vocab_start, int64_t vocab_local, const void* logits,
                                const void* targets, float* stats, void* stream) {
  const char* fn = "fce_vp_stats";
  fce::clear_error();
  fce_options local;
  FCE_TRY(read_options(fn, options, &local));
  const fce_options* o = &local;
  fce::VpStatsProblem p{};
  FCE_TRY(check_vp_vocab(fn, vocab_total, vocab_start, vocab_local, true));
  FCE_TRY(check_options(fn, o, rows, vocab_total, &p.opt));
  FCE_TRY(check_vp_rows(fn, rows, nullptr));
  if (!logits) return fail(FCE_ERROR_NULL_POINTER, "%s: logits is NULL", fn);
  if (!targets) return fail(FCE_ERROR_NULL_POINTER, "%s: targets is NULL", fn);
  if (!stats) return fail(FCE_ERROR_NULL_POINTER, "%s: stats is NULL", fn);
  FCE_TRY(check_stride(fn, "options->row_stride", o->row_stride, vocab_local, &p.row_stride,
                       "vocab_local"));
  const size_t esize = fce::dtype_size(o->dtype), tsize = fce::dtype_size(o->target_dtype);
  const int64_t logits_bytes = span_bytes(rows, vocab_local, p.row_stride, esize);
  if (logits_bytes < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: rows (%lld) x row stride overflows a 64-bit byte offset", fn,
                (long long)rows);
  FCE_TRY(check_alignment(fn, "logits", logits, esize));
  FCE_TRY(check_alignment(fn, "targets", targets, tsize));
  FCE_TRY(check_alignment(fn, "stats", stats, 16));
  const Range ranges[] = {
      {"logits", logits, static_cast<uint64_t>(logits_bytes), false},
      {"targets", targets, static_cast<uint64_t>(rows) * tsize, false},
      {"options->class_weights", o->class_weights, static_cast<uint64_t>(vocab_total) * 4, false},
      {"stats", stats, static_cast<uint64_t>(rows) * kStatsBytes, true},
  };
  FCE_TRY(check_overlaps(fn, ranges, sizeof ranges / sizeof ranges[0]));
  p.rows = rows;
  p.vocab_total = vocab_total;
  p.vocab_start = vocab_start;
  p.vocab_local = vocab_local;
  p.logits = logits;
  p.targets = targets;
  p.stats = stats;
  p.stream = stream;
  return o->backend == FCE_BACKEND_CPU ? fce::cpu_vp_stats(p) : fce::cuda_vp_stats(p);
}

FCE_API fce_status fce_vp_loss_workspace_size(const fce_options* options, int64_t ranks,
                                              int64_t rows, int64_t vocab_total,
                                              size_t* workspace_bytes) {
  const char* fn = "fce_vp_loss_workspace_size";
  fce::clear_error();
  fce_options o;
  FCE_TRY(read_options(fn, options, &o));
  FCE_TRY(check_vocab_total(fn, vocab_total));
  fce::CeOptions opt;
  FCE_TRY(check_options(fn, &o, rows, vocab_total, &opt));
  FCE_TRY(check_vp_rows(fn, rows, &ranks));
  if (!workspace_bytes) return fail(FCE_ERROR_NULL_POINTER, "%s: workspace_bytes is NULL", fn);
  FCE_TRY(check_alignment(fn, "workspace_bytes", workspace_bytes, alignof(size_t)));
  *workspace_bytes = vp_workspace(&o, opt, ranks, rows, vocab_total, 0, false);
  return FCE_SUCCESS;
}

FCE_API fce_status fce_vp_loss(const fce_options* options, int64_t ranks, int64_t rows,
                               int64_t vocab_total, const void* targets,
                               const float* gathered_stats, float* loss, float* lse,
                               float* z_loss, uint32_t* error_flags, void* workspace,
                               size_t workspace_bytes, void* stream) {
  const char* fn = "fce_vp_loss";
  fce::clear_error();
  fce_options local;
  FCE_TRY(read_options(fn, options, &local));
  const fce_options* o = &local;
  fce::VpProblem p{};
  FCE_TRY(check_vocab_total(fn, vocab_total));
  FCE_TRY(check_options(fn, o, rows, vocab_total, &p.opt));
  FCE_TRY(check_vp_rows(fn, rows, &ranks));
  if (!targets) return fail(FCE_ERROR_NULL_POINTER, "%s: targets is NULL", fn);
  if (!gathered_stats) return fail(FCE_ERROR_NULL_POINTER, "%s: gathered_stats is NULL", fn);
  if (!loss) return fail(FCE_ERROR_NULL_POINTER, "%s: loss is NULL", fn);
  const size_t tsize = fce::dtype_size(o->target_dtype);
  FCE_TRY(check_alignment(fn, "targets", targets, tsize));
  FCE_TRY(check_alignment(fn, "gathered_stats", gathered_stats, 16));
  FCE_TRY(check_alignment(fn, "loss", loss, 4));
  FCE_TRY(check_alignment(fn, "lse", lse, 4));
  FCE_TRY(check_alignment(fn, "z_loss", z_loss, 4));
  FCE_TRY(check_alignment(fn, "error_flags", error_flags, 4));
  Range argmax{}, accuracy{};
  FCE_TRY(check_forward_outputs(fn, *o, rows, &argmax, &accuracy));
  const bool per_row = o->reduction == FCE_REDUCTION_NONE;
  const uint64_t rbytes = static_cast<uint64_t>(rows) * 4;
  const Range ranges[] = {
      {"targets", targets, static_cast<uint64_t>(rows) * tsize, false},
      {"options->class_weights", o->class_weights, static_cast<uint64_t>(vocab_total) * 4, false},
      {"gathered_stats", gathered_stats,
       static_cast<uint64_t>(ranks) * static_cast<uint64_t>(rows) * kStatsBytes, false},
      {"loss", loss, per_row ? rbytes : 4, true},
      {"lse", lse, rbytes, true},
      {"z_loss", z_loss, 4, true},
      {"error_flags", error_flags, 4, true},
      {"workspace", workspace, workspace_bytes, true},
      argmax,
      accuracy,
  };
  FCE_TRY(check_overlaps(fn, ranges, sizeof ranges / sizeof ranges[0]));
  FCE_TRY(check_workspace(fn, vp_workspace(o, p.opt, ranks, rows, vocab_total, 0, false),
                          workspace, workspace_bytes));
  p.ranks = ranks;
  p.rows = rows;
  p.vocab_total = vocab_total;
  p.targets = targets;
  p.gathered = gathered_stats;
  p.loss = loss;
  p.lse = lse;
  p.z_loss = z_loss;
  p.argmax = o->argmax;
  p.accuracy = o->accuracy;
  p.error_flags = error_flags;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  p.stream = stream;
  return o->backend == FCE_BACKEND_CPU ? fce::cpu_vp(p) : fce::cuda_vp(p);
}

FCE_API fce_status fce_vp_backward_workspace_size(const fce_options* options, int64_t ranks,
                                                  int64_t rows, int64_t vocab_total,
                                                  int64_t vocab_local, size_t* workspace_bytes) {
  const char* fn = "fce_vp_backward_workspace_size";
  fce::clear_error();
  fce_options o;
  FCE_TRY(read_options(fn, options, &o));
  FCE_TRY(check_vp_vocab(fn, vocab_total, 0, vocab_local, false));
  fce::CeOptions opt;
  FCE_TRY(check_options(fn, &o, rows, vocab_total, &opt));
  FCE_TRY(check_vp_rows(fn, rows, &ranks));
  if (!workspace_bytes) return fail(FCE_ERROR_NULL_POINTER, "%s: workspace_bytes is NULL", fn);
  FCE_TRY(check_alignment(fn, "workspace_bytes", workspace_bytes, alignof(size_t)));
  *workspace_bytes = vp_workspace(&o, opt, ranks, rows, vocab_total, vocab_local, true);
  return FCE_SUCCESS;
}

FCE_API fce_status fce_vp_backward(const fce_options* options, int64_t ranks, int64_t rows,
                                   int64_t vocab_total, int64_t vocab_start, int64_t vocab_local,
                                   const void* logits, const void* targets,
                                   const float* gathered_stats, const float* grad_output,
                                   void* grad_logits, uint32_t* error_flags, void* workspace,
                                   size_t workspace_bytes, void* stream) {
  const char* fn = "fce_vp_backward";
  fce::clear_error();
  fce_options local;
  FCE_TRY(read_options(fn, options, &local));
  const fce_options* o = &local;
  fce::VpProblem p{};
  FCE_TRY(check_vp_vocab(fn, vocab_total, vocab_start, vocab_local, true));
  FCE_TRY(check_options(fn, o, rows, vocab_total, &p.opt));
  FCE_TRY(check_vp_rows(fn, rows, &ranks));
  if (!logits) return fail(FCE_ERROR_NULL_POINTER, "%s: logits is NULL", fn);
  if (!targets) return fail(FCE_ERROR_NULL_POINTER, "%s: targets is NULL", fn);
  if (!gathered_stats) return fail(FCE_ERROR_NULL_POINTER, "%s: gathered_stats is NULL", fn);
  if (!grad_logits) return fail(FCE_ERROR_NULL_POINTER, "%s: grad_logits is NULL", fn);
  FCE_TRY(check_stride(fn, "options->row_stride", o->row_stride, vocab_local, &p.row_stride,
                       "vocab_local"));
  FCE_TRY(check_stride(fn, "options->grad_row_stride", o->grad_row_stride, vocab_local,
                       &p.grad_row_stride, "vocab_local"));
  const size_t esize = fce::dtype_size(o->dtype), tsize = fce::dtype_size(o->target_dtype);
  const int64_t logits_bytes = span_bytes(rows, vocab_local, p.row_stride, esize);
  const int64_t grad_bytes = span_bytes(rows, vocab_local, p.grad_row_stride, esize);
  if (logits_bytes < 0 || grad_bytes < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: rows (%lld) x row stride overflows a 64-bit byte offset", fn,
                (long long)rows);
  FCE_TRY(check_alignment(fn, "logits", logits, esize));
  FCE_TRY(check_alignment(fn, "targets", targets, tsize));
  FCE_TRY(check_alignment(fn, "gathered_stats", gathered_stats, 16));
  FCE_TRY(check_alignment(fn, "grad_output", grad_output, 4));
  FCE_TRY(check_alignment(fn, "grad_logits", grad_logits, esize));
  FCE_TRY(check_alignment(fn, "error_flags", error_flags, 4));
  if (grad_logits == logits && p.grad_row_stride != p.row_stride)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: grad_logits is logits (in place) but options->grad_row_stride (%lld) != "
                "options->row_stride (%lld)",
                fn, (long long)p.grad_row_stride, (long long)p.row_stride);
  const bool per_row = o->reduction == FCE_REDUCTION_NONE;
  enum { kLogits = 0, kGrad = 5 };  // positions in ranges
  const Range ranges[] = {
      {"logits", logits, static_cast<uint64_t>(logits_bytes), false},
      {"targets", targets, static_cast<uint64_t>(rows) * tsize, false},
      {"options->class_weights", o->class_weights, static_cast<uint64_t>(vocab_total) * 4, false},
      {"gathered_stats", gathered_stats,
       static_cast<uint64_t>(ranks) * static_cast<uint64_t>(rows) * kStatsBytes, false},
      {"grad_output", grad_output, per_row ? static_cast<uint64_t>(rows) * 4 : 4, false},
      {"grad_logits", grad_logits, static_cast<uint64_t>(grad_bytes), true},
      {"error_flags", error_flags, 4, true},
      {"workspace", workspace, workspace_bytes, true},
  };
  const bool in_place = grad_logits == logits;
  FCE_TRY(check_overlaps(fn, ranges, sizeof ranges / sizeof ranges[0], in_place ? kLogits : -1,
                         in_place ? kGrad : -1));
  FCE_TRY(check_workspace(fn, vp_workspace(o, p.opt, ranks, rows, vocab_total, vocab_local, true),
                          workspace, workspace_bytes));
  p.ranks = ranks;
  p.rows = rows;
  p.vocab_total = vocab_total;
  p.vocab_start = vocab_start;
  p.vocab_local = vocab_local;
  p.targets = targets;
  p.gathered = gathered_stats;
  p.logits = logits;
  p.grad_output = grad_output;
  p.grad = grad_logits;
  p.error_flags = error_flags;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  p.stream = stream;
  return o->backend == FCE_BACKEND_CPU ? fce::cpu_vp(p) : fce::cuda_vp(p);
}

FCE_API fce_status fce_vp_linear_stats_workspace_size(const fce_options* options, int64_t rows,
                                                      int64_t hidden, int64_t vocab_local,
                                                      size_t* min_bytes, size_t* optimal_bytes) {
  const char* fn = "fce_vp_linear_stats_workspace_size";
  fce::clear_error();
  fce_options o;
  FCE_TRY(read_options(fn, options, &o));
  if (vocab_local < 1 || vocab_local > kMaxVocab)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: vocab_local (%lld) must be in [1, 2^31-1]", fn,
                (long long)vocab_local);
  fce::CeOptions opt;
  FCE_TRY(check_options(fn, &o, rows, vocab_local, &opt));
  FCE_TRY(check_hidden(fn, hidden));
  FCE_TRY(check_vp_rows(fn, rows, nullptr));
  FCE_TRY(linear_query_outputs(fn, min_bytes, optimal_bytes));
  size_t lo = 0, hi = 0;
  vp_linear_workspace(&o, opt, 1, rows, hidden, vocab_local, vocab_local, false, FCE_FLOAT32, &lo,
                      &hi);
  *min_bytes = lo;
  if (optimal_bytes) *optimal_bytes = hi;
  return FCE_SUCCESS;
}

FCE_API fce_status fce_vp_linear_stats(const fce_options* options, int64_t rows, int64_t hidden,
                                       int64_t vocab_total, int64_t vocab_start,
                                       int64_t vocab_local, const void* hidden_states,
                                       const void* weight, const void* bias, const void* targets,
                                       float* stats, void* workspace, size_t workspace_bytes,
                                       void* stream) {
  const char* fn = "fce_vp_linear_stats";
  fce::clear_error();
  fce_options local;
  FCE_TRY(read_options(fn, options, &local));
  const fce_options* o = &local;
  fce::VpLinearProblem p{};
  FCE_TRY(check_vp_vocab(fn, vocab_total, vocab_start, vocab_local, true));
  FCE_TRY(check_options(fn, o, rows, vocab_total, &p.opt));
  FCE_TRY(check_hidden(fn, hidden));
  FCE_TRY(check_vp_rows(fn, rows, nullptr));
  if (!hidden_states) return fail(FCE_ERROR_NULL_POINTER, "%s: hidden_states is NULL", fn);
  if (!weight) return fail(FCE_ERROR_NULL_POINTER, "%s: weight is NULL", fn);
  if (!targets) return fail(FCE_ERROR_NULL_POINTER, "%s: targets is NULL", fn);
  if (!stats) return fail(FCE_ERROR_NULL_POINTER, "%s: stats is NULL", fn);
  FCE_TRY(check_stride(fn, "options->hidden_row_stride", o->hidden_row_stride, hidden,
                       &p.hidden_row_stride));
  if (rows == 1) p.hidden_row_stride = hidden;  // as fce_linear_ce: one row has no stride
  const size_t esize = fce::dtype_size(o->dtype), tsize = fce::dtype_size(o->target_dtype);
  const int64_t h_bytes = span_bytes(rows, hidden, p.hidden_row_stride, esize);
  const int64_t w_bytes = span_bytes(vocab_local, hidden, hidden, esize);
  if (h_bytes < 0 || w_bytes < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: the sizes (rows %lld, hidden %lld, vocab_local %lld) overflow a 64-bit byte "
                "offset",
                fn, (long long)rows, (long long)hidden, (long long)vocab_local);
  FCE_TRY(check_alignment(fn, "hidden_states", hidden_states, esize));
  FCE_TRY(check_alignment(fn, "weight", weight, esize));
  FCE_TRY(check_alignment(fn, "bias", bias, esize));
  FCE_TRY(check_alignment(fn, "targets", targets, tsize));
  FCE_TRY(check_alignment(fn, "stats", stats, 16));
  const Range ranges[] = {
      {"hidden_states", hidden_states, static_cast<uint64_t>(h_bytes), false},
      {"weight", weight, static_cast<uint64_t>(w_bytes), false},
      {"bias", bias, static_cast<uint64_t>(vocab_local) * esize, false},
      {"targets", targets, static_cast<uint64_t>(rows) * tsize, false},
      {"options->class_weights", o->class_weights, static_cast<uint64_t>(vocab_total) * 4, false},
      {"stats", stats, static_cast<uint64_t>(rows) * kStatsBytes, true},
      {"workspace", workspace, workspace_bytes, true},
  };
  FCE_TRY(check_overlaps(fn, ranges, sizeof ranges / sizeof ranges[0]));
  size_t min_bytes = 0, optimal_bytes = 0;
  vp_linear_workspace(o, p.opt, 1, rows, hidden, vocab_local, vocab_local, false, FCE_FLOAT32,
                      &min_bytes, &optimal_bytes);
  FCE_TRY(check_workspace(fn, min_bytes, workspace, workspace_bytes));
  p.ranks = 1;
  p.rows = rows;
  p.hidden = hidden;
  p.vocab_total = vocab_total;
  p.vocab_start = vocab_start;
  p.vocab_local = vocab_local;
  p.hidden_states = hidden_states;
  p.weight = weight;
  p.bias = bias;
  p.targets = targets;
  p.stats = stats;
  p.grad_hidden_dtype = FCE_FLOAT32;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  p.stream = stream;
  return o->backend == FCE_BACKEND_CPU ? fce::cpu_vp_linear(p) : fce::cuda_vp_linear(p);
}

FCE_API fce_status fce_vp_linear_backward_workspace_size(const fce_options* options,
                                                         int64_t ranks, int64_t rows,
                                                         int64_t hidden, int64_t vocab_total,
                                                         int64_t vocab_local,
                                                         int32_t grad_hidden_dtype,
                                                         size_t* min_bytes,
                                                         size_t* optimal_bytes) {
  const char* fn = "fce_vp_linear_backward_workspace_size";
  fce::clear_error();
  fce_options o;
  FCE_TRY(read_options(fn, options, &o));
  FCE_TRY(check_vp_vocab(fn, vocab_total, 0, vocab_local, false));
  fce::CeOptions opt;
  FCE_TRY(check_options(fn, &o, rows, vocab_total, &opt));
  FCE_TRY(check_hidden(fn, hidden));
  FCE_TRY(check_vp_rows(fn, rows, &ranks));
  FCE_TRY(check_grad_hidden_dtype(fn, grad_hidden_dtype, o.dtype));
  FCE_TRY(linear_query_outputs(fn, min_bytes, optimal_bytes));
  size_t lo = 0, hi = 0;
  vp_linear_workspace(&o, opt, ranks, rows, hidden, vocab_total, vocab_local, true,
                      grad_hidden_dtype, &lo, &hi);
  *min_bytes = lo;
  if (optimal_bytes) *optimal_bytes = hi;
  return FCE_SUCCESS;
}

FCE_API fce_status fce_vp_linear_backward(const fce_options* options, int64_t ranks, int64_t rows,
                                          int64_t hidden, int64_t vocab_total,
                                          int64_t vocab_start, int64_t vocab_local,
                                          const void* hidden_states, const void* weight,
                                          const void* bias, const void* targets,
                                          const float* gathered_stats, const float* grad_output,
                                          void* grad_hidden, int32_t grad_hidden_dtype,
                                          void* grad_weight, void* grad_bias,
                                          uint32_t* error_flags, void* workspace,
                                          size_t workspace_bytes, void* stream) {
  const char* fn = "fce_vp_linear_backward";
  fce::clear_error();
  fce_options local;
  FCE_TRY(read_options(fn, options, &local));
  const fce_options* o = &local;
  fce::VpLinearProblem p{};
  FCE_TRY(check_vp_vocab(fn, vocab_total, vocab_start, vocab_local, true));
  FCE_TRY(check_options(fn, o, rows, vocab_total, &p.opt));
  FCE_TRY(check_hidden(fn, hidden));
  FCE_TRY(check_vp_rows(fn, rows, &ranks));
  FCE_TRY(check_grad_hidden_dtype(fn, grad_hidden_dtype, o->dtype));
  if (!hidden_states) return fail(FCE_ERROR_NULL_POINTER, "%s: hidden_states is NULL", fn);
  if (!weight) return fail(FCE_ERROR_NULL_POINTER, "%s: weight is NULL", fn);
  if (!targets) return fail(FCE_ERROR_NULL_POINTER, "%s: targets is NULL", fn);
  if (!gathered_stats) return fail(FCE_ERROR_NULL_POINTER, "%s: gathered_stats is NULL", fn);
  if (!grad_hidden && !grad_weight && !grad_bias)
    return fail(FCE_ERROR_NULL_POINTER,
                "%s: grad_hidden, grad_weight and grad_bias are all NULL: at least one gradient "
                "is needed",
                fn);
  if (grad_bias && !bias)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: grad_bias is given but bias is NULL", fn);
  FCE_TRY(check_stride(fn, "options->hidden_row_stride", o->hidden_row_stride, hidden,
                       &p.hidden_row_stride));
  if (rows == 1) p.hidden_row_stride = hidden;  // as fce_linear_ce: one row has no stride
  const size_t esize = fce::dtype_size(o->dtype), tsize = fce::dtype_size(o->target_dtype);
  const size_t gw_size = o->grad_weight_fp32 ? 4 : esize;
  const size_t gh_size = fce::dtype_size(grad_hidden_dtype);
  const int64_t h_bytes = span_bytes(rows, hidden, p.hidden_row_stride, esize);
  const int64_t w_bytes = span_bytes(vocab_local, hidden, hidden, 4);  // largest: f32 grad_weight
  const int64_t gh_bytes = span_bytes(rows, hidden, hidden, 4);        // largest: f32 grad_hidden
  if (h_bytes < 0 || w_bytes < 0 || gh_bytes < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: the sizes (rows %lld, hidden %lld, vocab_local %lld) overflow a 64-bit byte "
                "offset",
                fn, (long long)rows, (long long)hidden, (long long)vocab_local);
  FCE_TRY(check_alignment(fn, "hidden_states", hidden_states, esize));
  FCE_TRY(check_alignment(fn, "weight", weight, esize));
  FCE_TRY(check_alignment(fn, "bias", bias, esize));
  FCE_TRY(check_alignment(fn, "targets", targets, tsize));
  FCE_TRY(check_alignment(fn, "gathered_stats", gathered_stats, 16));
  FCE_TRY(check_alignment(fn, "grad_output", grad_output, 4));
  FCE_TRY(check_alignment(fn, "grad_hidden", grad_hidden, gh_size));
  FCE_TRY(check_alignment(fn, "grad_weight", grad_weight, gw_size));
  FCE_TRY(check_alignment(fn, "grad_bias", grad_bias, gw_size));
  FCE_TRY(check_alignment(fn, "error_flags", error_flags, 4));
  const bool per_row = o->reduction == FCE_REDUCTION_NONE;
  const uint64_t vd = static_cast<uint64_t>(vocab_local) * static_cast<uint64_t>(hidden);
  const uint64_t nd = static_cast<uint64_t>(rows) * static_cast<uint64_t>(hidden);
  const Range ranges[] = {
      {"hidden_states", hidden_states, static_cast<uint64_t>(h_bytes), false},
      {"weight", weight, vd * esize, false},
      {"bias", bias, static_cast<uint64_t>(vocab_local) * esize, false},
      {"targets", targets, static_cast<uint64_t>(rows) * tsize, false},
      {"options->class_weights", o->class_weights, static_cast<uint64_t>(vocab_total) * 4, false},
      {"gathered_stats", gathered_stats,
       static_cast<uint64_t>(ranks) * static_cast<uint64_t>(rows) * kStatsBytes, false},
      {"grad_output", grad_output, per_row ? static_cast<uint64_t>(rows) * 4 : 4, false},
      {"grad_hidden", grad_hidden, nd * gh_size, true},
      {"grad_weight", grad_weight, vd * gw_size, true},
      {"grad_bias", grad_bias, static_cast<uint64_t>(vocab_local) * gw_size, true},
      {"error_flags", error_flags, 4, true},
      {"workspace", workspace, workspace_bytes, true},
  };
  FCE_TRY(check_overlaps(fn, ranges, sizeof ranges / sizeof ranges[0]));
  size_t min_bytes = 0, optimal_bytes = 0;
  vp_linear_workspace(o, p.opt, ranks, rows, hidden, vocab_total, vocab_local, true,
                      grad_hidden_dtype, &min_bytes, &optimal_bytes);
  FCE_TRY(check_workspace(fn, min_bytes, workspace, workspace_bytes));
  p.ranks = ranks;
  p.rows = rows;
  p.hidden = hidden;
  p.vocab_total = vocab_total;
  p.vocab_start = vocab_start;
  p.vocab_local = vocab_local;
  p.hidden_states = hidden_states;
  p.weight = weight;
  p.bias = bias;
  p.targets = targets;
  p.gathered = gathered_stats;
  p.grad_output = grad_output;
  p.grad_hidden = grad_hidden;
  p.grad_hidden_dtype = grad_hidden_dtype;
  p.grad_weight = grad_weight;
  p.grad_bias = grad_bias;
  p.grad_weight_fp32 = o->grad_weight_fp32 != 0;
  p.accumulate = o->accumulate != 0;
  p.error_flags = error_flags;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  p.stream = stream;
  return o->backend == FCE_BACKEND_CPU ? fce::cpu_vp_linear(p) : fce::cuda_vp_linear(p);
}

}  // extern "C"
