// validate.cpp — the ABI layer's argument checks (validate.h).
#include "validate.h"

#include <cmath>
#include <cstring>

namespace fce {
namespace abi {

namespace {

// struct_size must be the size of some 1.x version's struct.
fce_status read_options(const char* fn, const fce_options* o, fce_options* local) {
  static_assert(sizeof(fce_options) == FCE_OPTIONS_SIZE_V1_0, "fce_options changed size");
  if (!o) return fail(FCE_ERROR_NULL_POINTER, "%s: options is NULL", fn);
  const size_t size = o->struct_size;
  if (size < FCE_OPTIONS_SIZE_V1_0)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->struct_size (%zu) is not the size of any version of fce_options "
                "(%d in 1.0; the 0.x structs are not accepted since 1.0: argmax and accuracy "
                "moved to fce_outputs): initialise it with FCE_OPTIONS_INIT or "
                "fce_options_default()",
                fn, size, FCE_OPTIONS_SIZE_V1_0);
  if (size > sizeof(fce_options))
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->struct_size (%zu) is larger than this library's fce_options "
                "(%zu): the caller's header is newer than the library (version %u)",
                fn, size, sizeof(fce_options), (unsigned)FCE_VERSION_NUMBER);
  const fce_options defaults = FCE_OPTIONS_INIT;
  *local = defaults;
  std::memcpy(local, o, size);
  return FCE_SUCCESS;
}

// A versioned output struct of the caller (struct_size first) into *local: its defaults, then
// the caller's struct_size bytes, which must be the size of a version (v1_0 the only one yet).
template <class T>
fce_status read_versioned(const char* fn, const char* name, const T* in, size_t v1_0, T* local,
                          const T& defaults) {
  *local = defaults;
  if (!in) return FCE_SUCCESS;
  const size_t size = in->struct_size;
  if (size > sizeof(T))
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: %s->struct_size (%zu) is larger than this library's struct (%zu): the "
                "caller's header is newer than the library (version %u)",
                fn, name, size, sizeof(T), (unsigned)FCE_VERSION_NUMBER);
  if (size != v1_0)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: %s->struct_size (%zu) is not the size of any version (%zu in 1.0): "
                "initialise it with its _INIT macro",
                fn, name, size, v1_0);
  std::memcpy(local, in, size);
  return FCE_SUCCESS;
}

bool overlaps(const Arg& a, const Arg& b) {
  if (!a.ptr || !b.ptr || a.bytes == 0 || b.bytes == 0) return false;
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(a.ptr), b0 = reinterpret_cast<uintptr_t>(b.ptr);
  return a0 < b0 + b.bytes && b0 < a0 + a.bytes;
}

// The position of the entry called name, -1 if there is none.
int position(ArgTable args, const char* name) {
  for (int i = 0; i < args.count; ++i)
    if (std::strcmp(args.arg[i].name, name) == 0) return i;
  return -1;
}

// Class-probability targets (docs/semantics.md rule 19): the options that need a target class
// or are not supported with them yet.
fce_status check_soft_options(const char* fn, const fce_options& o) {
  if (!is_soft_dtype(o.target_dtype)) return FCE_SUCCESS;
  if (o.token_scaling)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->token_scaling is set but options->target_dtype (%d) gives class "
                "probabilities: there is no target class whose p_y could scale the row",
                fn, o.target_dtype);
  if (o.shift_seq_len != 0)
    return fail(FCE_ERROR_UNSUPPORTED,
                "%s: options->shift_seq_len (%lld) is not supported with class-probability "
                "targets (options->target_dtype %d): shift the probabilities' rows instead",
                fn, (long long)o.shift_seq_len, o.target_dtype);
  return FCE_SUCCESS;
}

}  // namespace

fce_status refuse_soft_targets(const char* fn, const fce_options& o) {
  if (!is_soft_dtype(o.target_dtype)) return FCE_SUCCESS;
  return fail(FCE_ERROR_UNSUPPORTED,
              "%s: options->target_dtype (%d) gives class probabilities, which %s does not "
              "take (its targets are class indices)",
              fn, o.target_dtype, fn);
}

fce_status refuse_batch_invariant(const char* fn, const CeOptions& opt) {
  if (!opt.batch_invariant) return FCE_SUCCESS;
  return fail(FCE_ERROR_UNSUPPORTED,
              "%s: options->batch_invariant is not supported by this call (only fce_forward, "
              "fce_backward, fce_backward_rescale, fce_linear_ce, fce_vp_stats, fce_vp_loss and "
              "fce_vp_backward honour it)",
              fn);
}

fce_status refuse_soft_accuracy(const char* fn, const fce_options& o, const fce_outputs& out) {
  if (!is_soft_dtype(o.target_dtype) || !out.accuracy) return FCE_SUCCESS;
  return fail(FCE_ERROR_INVALID_ARGUMENT,
              "%s: outputs->accuracy is given but options->target_dtype (%d) gives class "
              "probabilities: there is no target class to compare the argmax with",
              fn, o.target_dtype);
}

fce_status begin_call(const char* fn, const fce_options* options, fce_options* local) {
  clear_error();
  return read_options(fn, options, local);
}

fce_status check_options(const char* fn, const fce_options* o, int64_t rows, int64_t vocab,
                         CeOptions* out) {
  if (o->vp_entropy != 0 && std::strncmp(fn, "fce_vp_", 7) != 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->vp_entropy (%d) must be 0: only the vocabulary-parallel calls "
                "read it",
                fn, o->vp_entropy);
  if (o->backend != FCE_BACKEND_CUDA && o->backend != FCE_BACKEND_CPU)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: options->backend (%d) is not an fce_backend", fn,
                o->backend);
  if (o->dtype != FCE_FLOAT32 && o->dtype != FCE_FLOAT16 && o->dtype != FCE_BFLOAT16)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->dtype (%d) must be FCE_FLOAT32, FCE_FLOAT16 or FCE_BFLOAT16", fn,
                o->dtype);
  const bool soft = is_soft_dtype(o->target_dtype);
  if (o->target_dtype != FCE_INT32 && o->target_dtype != FCE_INT64 && !soft)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->target_dtype (%d) must be FCE_INT32 or FCE_INT64 (class indices), "
                "or FCE_FLOAT32, FCE_FLOAT16 or FCE_BFLOAT16 (class probabilities)",
                fn, o->target_dtype);
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
  if (rows < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: rows (%lld) must be >= 0", fn, (long long)rows);
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
  FCE_TRY(check_soft_options(fn, *o));
  // Here, not in the argument tables' check: the workspace queries take class weights too.
  FCE_TRY(check_alignment(fn, "options->class_weights", o->class_weights, 4));
  if (o->backend == FCE_BACKEND_CUDA) {
    if (const char* why = cuda_unavailable_reason())
      return fail(FCE_ERROR_BACKEND_UNAVAILABLE, "%s: options->backend is FCE_BACKEND_CUDA but %s",
                  fn, why);
  }
  out->dtype = o->dtype;
  out->targets_int64 = o->target_dtype == FCE_INT64;
  out->soft_targets = soft;
  out->q_dtype = soft ? o->target_dtype : FCE_FLOAT32;
  out->reduction = o->reduction;
  out->ignore_index = o->ignore_index;
  out->label_smoothing = o->label_smoothing;
  out->z_loss_scale = o->z_loss_scale;
  out->softcap = o->softcap;
  out->logit_scale = o->logit_scale;
  out->class_weights = o->class_weights;
  out->shift_seq_len = o->shift_seq_len;
  // docs/semantics.md rule 1: k = options->shift, 0 meaning 1, with a shift; 0 without.
  out->shift = o->shift_seq_len > 0 ? (o->shift > 0 ? o->shift : 1) : 0;
  out->token_scaling = o->token_scaling != 0;
  out->batch_invariant = o->batch_invariant != 0;
  out->vp_entropy = o->vp_entropy != 0;
  return FCE_SUCCESS;
}

fce_status check_stride(const char* fn, const char* name, int64_t stride, int64_t cols,
                        int64_t* resolved, const char* cols_name) {
  if (stride == 0) stride = cols;
  if (!cols_name) cols_name = std::strstr(name, "hidden") ? "hidden" : "vocab";
  if (stride < cols)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: %s (%lld) is less than %s (%lld)", fn, name,
                (long long)stride, cols_name, (long long)cols);
  *resolved = stride;
  return FCE_SUCCESS;
}

int64_t span_bytes(int64_t rows, int64_t cols, int64_t stride, size_t elem) {
  if (rows <= 0 || cols <= 0) return 0;
  const int64_t max_elems = kMaxBytes / static_cast<int64_t>(elem);
  if (stride > 0 && rows - 1 > (max_elems - cols) / stride) return -1;
  return ((rows - 1) * stride + cols) * static_cast<int64_t>(elem);
}

fce_status check_hidden(const char* fn, int64_t hidden) {
  if (hidden < 1 || hidden > kMaxVocab)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: hidden (%lld) must be in [1, 2^31-1]", fn,
                (long long)hidden);
  return FCE_SUCCESS;
}

// ---- vocabulary-parallel ----

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

fce_status check_vp_rows(const char* fn, int64_t rows, const int64_t* ranks_arg) {
  // (bounded for the widest statistics row, FCE_VP_STATS_INVARIANT's)
  if (rows > kMaxBytes / kExactStatsBytes)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: rows (%lld) x a statistics row overflows a 64-bit byte offset", fn,
                (long long)rows);
  if (!ranks_arg) return FCE_SUCCESS;
  const int64_t ranks = *ranks_arg;
  if (ranks < 1)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: ranks (%lld) must be >= 1", fn,
                (long long)ranks);
  if (rows > 0 && ranks > kMaxBytes / kExactStatsBytes / rows)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: ranks (%lld) x rows (%lld) x a statistics row overflows a 64-bit byte "
                "offset", fn,
                (long long)ranks, (long long)rows);
  return FCE_SUCCESS;
}

fce_status check_grad_hidden_dtype(const char* fn, int32_t grad_hidden_dtype, int32_t dtype) {
  if (grad_hidden_dtype != FCE_FLOAT32 && grad_hidden_dtype != dtype)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: grad_hidden_dtype (%d) must be FCE_FLOAT32 or options->dtype (%d)", fn,
                grad_hidden_dtype, dtype);
  return FCE_SUCCESS;
}

// ---- pointers and argument tables ----

fce_status check_alignment(const char* fn, const char* name, const void* p, size_t align) {
  if (p && reinterpret_cast<uintptr_t>(p) % align != 0)
    return fail(FCE_ERROR_MISALIGNED, "%s: %s (%p) is not aligned to %zu bytes", fn, name, p,
                align);
  return FCE_SUCCESS;
}

fce_status check_required(const char* fn, std::initializer_list<Required> pointers) {
  for (const Required& r : pointers)
    if (!r.ptr && !r.empty) return fail(FCE_ERROR_NULL_POINTER, "%s: %s is NULL", fn, r.name);
  return FCE_SUCCESS;
}

fce_status check_args(const char* fn, ArgTable args, const InPlace* in_place) {
  const Arg* r = args.arg;
  for (int i = 0; i < args.count; ++i)
    FCE_TRY(check_alignment(fn, r[i].name, r[i].ptr, r[i].align));
  // a, b: the positions of logits and grad_logits when the call writes one over the other
  int a = in_place ? position(args, "logits") : -1;
  int b = in_place ? position(args, "gradients->grad_logits") : -1;
  if (a < 0 || b < 0 || !r[a].ptr || r[a].ptr != r[b].ptr || r[a].bytes == 0) a = b = -1;
  if (a >= 0 && in_place->grad_row_stride != in_place->row_stride)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: grad_logits is logits (in place) but options->grad_row_stride (%lld) != "
                "options->row_stride (%lld)",
                fn, (long long)in_place->grad_row_stride, (long long)in_place->row_stride);
  for (int i = 0; i < args.count; ++i) {
    for (int j = i + 1; j < args.count; ++j) {
      if (!(r[i].output || r[j].output)) continue;
      if (!overlaps(r[i], r[j])) continue;
      if ((i == a && j == b) || (i == b && j == a)) continue;
      const bool with_in_place = a >= 0 && (i == a || i == b || j == a || j == b);
      return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: %s overlaps %s%s", fn, r[i].name, r[j].name,
                  with_in_place ? " (grad_logits is logits, in place: no other buffer may overlap "
                                  "them)"
                                : "");
    }
  }
  return FCE_SUCCESS;
}

size_t vp_workspace(const fce_options& o, const CeOptions& opt, int64_t ranks, int64_t rows,
                    int64_t vocab_total, int64_t vocab_local, bool backward) {
  if (rows == 0) return 0;  // the empty problem: nothing computed
  return o.backend == FCE_BACKEND_CPU
             ? cpu_vp_workspace_size(opt, ranks, rows, vocab_total, vocab_local, backward)
             : cuda_vp_workspace_size(opt, ranks, rows, vocab_total, vocab_local, backward);
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

fce_status empty_problem(const char* fn, const fce_options& o, ArgTable args,
                         std::initializer_list<ZeroSpan> zeros, void* stream) {
  ZeroSpan spans[kMaxZeroSpans];
  int count = 0;
  for (const ZeroSpan& z : zeros) {
    if (!z.ptr || z.bytes == 0) continue;
    if (count == kMaxZeroSpans)
      return fail(FCE_ERROR_INTERNAL, "%s: more than %d outputs to zero", fn, kMaxZeroSpans);
    spans[count++] = z;
  }
  if (o.backend == FCE_BACKEND_CPU) {
    for (int i = 0; i < count; ++i) std::memset(spans[i].ptr, 0, spans[i].bytes);
    return FCE_SUCCESS;
  }
  FCE_TRY(check_device_pointers(fn, args));
  return count ? cuda_write_zeros(fn, spans, count, stream) : FCE_SUCCESS;
}

Entries::Entries(const fce_options& options, int64_t rows_)
    : o(options),
      rows(rows_),
      esize(dtype_size(options.dtype)),
      tsize(dtype_size(options.target_dtype)),
      soft(is_soft_dtype(options.target_dtype)),
      per_row(options.reduction == FCE_REDUCTION_NONE) {}

// ---- workspace queries ----

fce_status check_size_output(const char* fn, const size_t* bytes) {
  if (!bytes) return fail(FCE_ERROR_NULL_POINTER, "%s: workspace_bytes is NULL", fn);
  return check_alignment(fn, "workspace_bytes", bytes, alignof(size_t));
}

fce_status check_size_outputs(const char* fn, const size_t* min_bytes,
                              const size_t* optimal_bytes) {
  if (!min_bytes) return fail(FCE_ERROR_NULL_POINTER, "%s: min_bytes is NULL", fn);
  FCE_TRY(check_alignment(fn, "min_bytes", min_bytes, alignof(size_t)));
  return check_alignment(fn, "optimal_bytes", optimal_bytes, alignof(size_t));
}

fce_status read_outputs(const char* fn, const fce_outputs* outputs, OutputsUse use,
                        fce_outputs* local) {
  static_assert(sizeof(fce_outputs) == FCE_OUTPUTS_SIZE_V1_0, "fce_outputs changed size");
  const fce_outputs defaults = FCE_OUTPUTS_INIT;
  if (!outputs && use == OutputsUse::kLoss)
    return fail(FCE_ERROR_NULL_POINTER, "%s: outputs is NULL (the loss is required)", fn);
  FCE_TRY(read_versioned(fn, "outputs", outputs, FCE_OUTPUTS_SIZE_V1_0, local, defaults));
  if (use == OutputsUse::kFlagsOnly) {
    const struct {
      const char* name;
      const void* ptr;
    } unused[] = {{"loss", local->loss},
                  {"lse", local->lse},
                  {"z_loss", local->z_loss},
                  {"argmax", local->argmax},
                  {"accuracy", local->accuracy},
                  {"entropy", local->entropy}};
    for (const auto& u : unused)
      if (u.ptr)
        return fail(FCE_ERROR_INVALID_ARGUMENT,
                    "%s: outputs->%s is given, but %s writes only outputs->error_flags", fn,
                    u.name, fn);
  }
  return FCE_SUCCESS;
}

fce_status read_gradients(const char* fn, const fce_gradients* gradients, GradientsUse use,
                          bool required, fce_gradients* local) {
  static_assert(sizeof(fce_gradients) == FCE_GRADIENTS_SIZE_V1_0, "fce_gradients changed size");
  const fce_gradients defaults = FCE_GRADIENTS_INIT;
  if (!gradients && required)
    return fail(FCE_ERROR_NULL_POINTER, "%s: gradients is NULL (%s computes gradients only)",
                fn, fn);
  FCE_TRY(read_versioned(fn, "gradients", gradients, FCE_GRADIENTS_SIZE_V1_0, local, defaults));
  if (local->reserved0 != 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: gradients->reserved0 (%d) must be 0", fn,
                local->reserved0);
  const bool logits = use == GradientsUse::kLogits;
  const char* taken = logits ? "grad_logits and grad_output"
                             : "grad_hidden, grad_weight, grad_bias and grad_output";
  const struct {
    const char* name;
    const void* ptr;
  } unused[] = {{"grad_logits", logits ? nullptr : local->grad_logits},
                {"grad_hidden", logits ? local->grad_hidden : nullptr},
                {"grad_weight", logits ? local->grad_weight : nullptr},
                {"grad_bias", logits ? local->grad_bias : nullptr}};
  for (const auto& u : unused)
    if (u.ptr)
      return fail(FCE_ERROR_INVALID_ARGUMENT,
                  "%s: gradients->%s is given, but %s writes only %s", fn, u.name, fn, taken);
  if (use != GradientsUse::kVpLinear && local->grad_hidden_dtype != FCE_FLOAT32)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: gradients->grad_hidden_dtype (%d) must be FCE_FLOAT32 (the default): only "
                "the fce_vp_linear_* calls read it",
                fn, local->grad_hidden_dtype);
  return FCE_SUCCESS;
}

fce_status refuse_row_grads(const char* fn, const fce_gradients& g, bool allow_lse,
                            const char* why) {
  const struct {
    const char* name;
    const void* ptr;
  } fields[] = {{"grad_lse", allow_lse ? nullptr : g.grad_lse}, {"grad_entropy", g.grad_entropy}};
  for (const auto& f : fields)
    if (f.ptr)
      return fail(FCE_ERROR_UNSUPPORTED, "%s: gradients->%s is not supported by %s%s", fn, f.name,
                  fn, why);
  return FCE_SUCCESS;
}

fce_status check_row_grads_have_gradient(const char* fn, const fce_gradients& g,
                                         bool with_grad, const char* gradient_names) {
  if (with_grad) return FCE_SUCCESS;
  const char* name = g.grad_lse ? "grad_lse" : g.grad_entropy ? "grad_entropy" : nullptr;
  if (!name) return FCE_SUCCESS;
  return fail(FCE_ERROR_INVALID_ARGUMENT,
              "%s: gradients->%s is given but %s %s NULL: no gradient to add it to", fn, name,
              gradient_names, std::strchr(gradient_names, ',') ? "are all" : "is");
}

fce_status check_vp_entropy(const char* fn, const fce_options& o, const float* entropy,
                            const float* grad_entropy) {
  if (o.vp_entropy != 0) return FCE_SUCCESS;
  const char* name = entropy        ? "outputs->entropy"
                     : grad_entropy ? "gradients->grad_entropy"
                                    : nullptr;
  if (!name) return FCE_SUCCESS;
  return fail(FCE_ERROR_INVALID_ARGUMENT,
              "%s: %s is given but options->vp_entropy is 0: the shard statistics carry the "
              "entropy's sums only with options->vp_entropy set (on every call of the step)",
              fn, name);
}

fce_status check_shard(const char* fn, const fce_vp_shard* shard) {
  return check_required(fn, {{"shard", shard}});
}

fce_status begin_compute(const char* fn, const fce_options* options, const fce_vp_shard* shard,
                         bool vp, const fce_outputs* outputs, const fce_gradients* gradients,
                         StructUse use, CallArgs* a) {
  FCE_TRY(begin_call(fn, options, &a->o));
  a->shard = fce_vp_shard{1, 0, 0, 0, nullptr, nullptr};
  if (vp) {
    FCE_TRY(check_shard(fn, shard));
    a->shard = *shard;
  }
  FCE_TRY(read_outputs(fn, outputs, use.outputs, &a->out));
  return read_gradients(fn, gradients, use.gradients, use.gradients_required, &a->g);
}

}  // namespace abi
}  // namespace fce
