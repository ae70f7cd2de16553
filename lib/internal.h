// internal.h — what the ABI layer (lib/api.cpp) hands to a backend once every argument is
// validated: sizes resolved (strides never 0), pointers checked for null, alignment, overlap,
// and the workspace checked against the backend's own size query. A backend trusts these.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusedce.h"

namespace fce {

// Records the message for fce_last_error() on this thread (printf-style) and returns status.
fce_status fail(fce_status status, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

// Returns from the calling function with the status of `expr` unless it is FCE_SUCCESS.
#define FCE_TRY(expr)                    \
  do {                                   \
    const fce_status fce_try_ = (expr);  \
    if (fce_try_ != FCE_SUCCESS) return fce_try_; \
  } while (0)

// Workspace size arithmetic that saturates at SIZE_MAX instead of wrapping (SIZE_MAX then reads
// "too large for any workspace"): the sum, the product, a rounded up to a multiple of align.
inline size_t sat_add(size_t a, size_t b) { return a > SIZE_MAX - b ? SIZE_MAX : a + b; }
inline size_t sat_mul(size_t a, size_t b) {
  return (a != 0 && b > SIZE_MAX / a) ? SIZE_MAX : a * b;
}
inline size_t sat_round_up(size_t a, size_t align) {
  return a > SIZE_MAX - (align - 1) ? SIZE_MAX : (a + align - 1) / align * align;
}

inline size_t dtype_size(int dtype) {
  switch (dtype) {
    case FCE_FLOAT32: return 4;
    case FCE_FLOAT16: return 2;
    case FCE_BFLOAT16: return 2;
    case FCE_INT32: return 4;
    case FCE_INT64: return 8;
    default: return 0;
  }
}

// fce_backward_rescale: scaling by g is exact for every element (0, or ± a power of two that
// is a normal float): the cases it scales in place instead of computing the gradient again.
inline bool exact_scale(float g) {
  uint32_t bits;
  static_assert(sizeof bits == sizeof g, "float is 32 bits");
  __builtin_memcpy(&bits, &g, sizeof bits);
  const uint32_t exponent = (bits >> 23) & 0xffu, mantissa = bits & 0x7fffffu;
  return (bits & 0x7fffffffu) == 0 || (mantissa == 0 && exponent != 0 && exponent != 0xffu);
}

// One buffer of a call, as the ABI layer lists it once per call (lib/api_*.cpp's argument
// tables): its name as the header spells it, where it is, how many bytes it spans, the
// alignment it needs, and whether the call writes it. The same table drives the alignment
// check, the overlap check and the CUDA backend's device-pointer check.
struct Arg {
  const char* name;
  const void* ptr;   // nullptr: absent (optional and not given)
  uint64_t bytes;
  size_t align;
  bool output;
};

// A span of a caller's output that an empty problem (rows = 0) fills with zero bytes: a 0.0f
// reduced loss, z_loss or accuracy, or a zero grad_weight / grad_bias (validate.h empty_problem).
struct ZeroSpan {
  void* ptr;     // nullptr: absent
  size_t bytes;  // 0: nothing to write
};
constexpr int kMaxZeroSpans = 5;  // loss, z_loss, accuracy, grad_weight, grad_bias

// What a cross-entropy call computes (no longer inferred from which pointers are null).
enum class CeMode { kForward, kBackward, kRescale };

// The options every cross-entropy computation shares (docs/semantics.md, "The loss, row by row").
struct CeOptions {
  int dtype;               // FCE_FLOAT32 / FCE_FLOAT16 / FCE_BFLOAT16 of the logits
  bool targets_int64;      // target dtype (class indices)
  bool soft_targets;       // targets are class probabilities q [rows, vocab] (docs/semantics.md
                           // rule 19), of q_dtype; every row scored, no ignore_index
  int q_dtype;             // FCE_FLOAT32 / FCE_FLOAT16 / FCE_BFLOAT16 of q (soft_targets)
  int reduction;           // fce_reduction
  int64_t ignore_index;
  float label_smoothing;   // epsilon
  float z_loss_scale;      // lambda
  float softcap;           // c, 0 = off
  float logit_scale;       // s
  const float* class_weights;  // [vocab] or nullptr
  int64_t shift_seq_len;   // T, 0 = off
  int64_t shift;           // k >= 1 when T > 0 (options->shift, 0 resolved to 1); 0 when T = 0
  bool token_scaling;      // loss and gradient of each scored row times the detached p_y
  bool batch_invariant;    // each row's results independent of the batch (docs/semantics.md
                           // rule 21): paths and GEMM shapes chosen without the row count
  bool vp_entropy;         // fce_vp_*: the shard statistics carry the entropy's sum (kVpEntropy)
};

// fce_forward, fce_backward and fce_backward_rescale (mode). Backward and rescale: lse_in and
// grad given, loss/lse/z_loss/argmax/accuracy null.
struct CeProblem {
  const char* fn;           // the public function ("fce_forward", ...): every message starts with it
  CeMode mode;
  CeOptions opt;
  int64_t rows, vocab;
  int64_t row_stride;       // >= vocab
  int64_t grad_row_stride;  // >= vocab
  const void* logits;
  const void* targets;
  float* loss;              // [1] or [rows] (none); nullptr for backward
  float* lse;               // optional [rows] output (forward)
  float* z_loss;            // optional [1]
  void* grad;               // optional (forward), required (backward); may == logits
  const float* grad_output; // nullptr = 1
  const float* lse_in;      // backward: saved lse [rows]
  uint32_t* error_flags;    // optional
  int64_t* argmax;          // optional [rows] (forward only; null for backward)
  float* accuracy;          // optional [1] (mean/sum) or [rows] (none) (forward only)
  float* entropy;           // optional [rows] (forward only)
  const float* grad_lse;    // optional [rows] upstream gradient of lse (forward with grad,
                            // backward); nullptr = 0
  const float* grad_entropy;  // optional [rows] upstream gradient of the entropy (forward with
                              // grad); nullptr = 0
  void* workspace;          // >= the backend's workspace size, 16-byte aligned (or null if 0)
  size_t workspace_bytes;
  void* stream;
};

// fce_linear_ce.
struct LinearCeProblem {
  const char* fn;             // "fce_linear_ce"
  CeOptions opt;
  int64_t rows, hidden, vocab;
  int64_t hidden_row_stride;  // >= hidden
  const void* hidden_states;  // [rows, hidden_row_stride]
  const void* weight;         // [vocab, hidden]
  const void* bias;           // [vocab] or nullptr
  const void* targets;
  float* loss;                // [1] or [rows]
  float* lse;                 // optional [rows]
  float* z_loss;              // optional [1]
  void* grad_hidden;          // optional [rows, hidden] dense, dtype
  void* grad_weight;          // optional [vocab, hidden] dense, dtype or f32
  void* grad_bias;            // optional [vocab], same dtype as grad_weight
  bool grad_weight_fp32;
  bool accumulate;
  const float* grad_output;   // nullptr = 1
  uint32_t* error_flags;
  int64_t* argmax;            // optional [rows]
  float* accuracy;            // optional [1] (mean/sum) or [rows] (none)
  float* entropy;             // optional [rows]
  const float* grad_lse;      // optional [rows] (with a gradient); nullptr = 0
  const float* grad_entropy;  // optional [rows] (with a gradient); nullptr = 0
  void* workspace;
  size_t workspace_bytes;
  void* stream;
  bool with_grad() const { return grad_hidden || grad_weight || grad_bias; }
};

// ---- vocabulary-parallel (fce_vp_*; docs/semantics.md rule 16). The stats layout, FCE_VP_STATS
// float32 per row of a shard: see VpStat. class_weights (opt) are the whole vocabulary's.
enum VpStat {
  kVpMax = 0,       // m_r = max_j a_j over the shard (NaN if any a_j is NaN)
  kVpSumExp = 1,    // s_r = Σ_j exp(a_j − m_r) (0 when m_r = −inf)
  kVpTarget = 2,    // a_y when the row's target y is in the shard, else 0
  kVpHit = 3,       // 1 when the row is scored and its target is in the shard, else 0
  kVpSmooth = 4,    // u_r = Σ_j ω_j (m_r − a_j) when label_smoothing > 0 and m_r > −inf, else 0
  kVpWeight = 5,    // W_r = Σ_j ω_j over the shard (vocab_local without class weights)
  kVpArgmax = 6,    // int32 bits: the global index of the shard's argmax (docs/semantics.md rule 15)
  kVpLocal = 7,     // int32 bits: vocab_local (the tiling check)
  kVpCount = 8
};
static_assert(kVpCount == FCE_VP_STATS, "stats layout");
// With options->vp_entropy (docs/semantics.md rule 18) slot kVpHit carries the entropy's sum
// instead, and h_r moves to the sign bit of kVpLocal (vocab_local < 2^31 leaves it free):
constexpr int kVpEntropy = kVpHit;  // u_r = Σ_j exp(a_j − m_r)(a_j − m_r): 0 when m_r = −inf,
                                    // NaN when m_r is NaN or +inf
constexpr uint32_t kVpHitBit = 0x80000000u;  // in kVpLocal: the row's target is in the shard

// Under options->batch_invariant (docs/semantics.md rule 21) a shard's row is FCE_VP_STATS_INVARIANT
// float32 of exact sums (exact_sum.h), none relative to the shard's maximum, so that the
// combination is the same bits whatever the shards:
enum VpExactStat {
  kVxMax = 0,     // m_r as kVpMax
  kVxArgmax = 1,  // as kVpArgmax
  kVxTarget = 2,  // as kVpTarget (the same slot): a_y when the target is in the shard, else 0
  kVxLocal = 3,   // vocab_local, kVpHitBit when the row is scored and its target is in the shard
  kVxSumExp = 4,  // Σ_j exp(a_j)                          (each an ExactSum of kExactSlots)
  kVxEntropy = kVxSumExp + 10,  // Σ_j exp(a_j) a_j, with options->vp_entropy, else 0
  kVxSmooth = kVxEntropy + 10,  // Σ_j w_j a_j (w_j = ω_j, or ω_j q'_j for class probabilities)
  kVxWeight = kVxSmooth + 10,   // Σ_j w_j
  kVxCount = kVxWeight + 10
};
static_assert(kVxCount == FCE_VP_STATS_INVARIANT && int(kVxTarget) == int(kVpTarget),
              "exact stats layout");
// Float32 per row of a shard's statistics for these options.
inline int64_t vp_stats_width(const CeOptions& opt) {
  return opt.batch_invariant ? FCE_VP_STATS_INVARIANT : FCE_VP_STATS;
}

// fce_vp_stats (logits given) — validated as fce_forward's logits (row_stride >= vocab_local).
struct VpStatsProblem {
  const char* fn;             // "fce_vp_stats"
  CeOptions opt;
  int64_t rows, vocab_total, vocab_start, vocab_local;
  int64_t row_stride;         // >= vocab_local
  const void* logits;         // [rows, row_stride] of opt.dtype
  const void* targets;        // [rows (+ shift)] global class indices
  float* stats;               // [rows, FCE_VP_STATS], 16-byte aligned
  void* stream;
};

// fce_vp_loss (backward false) and fce_vp_backward (backward: logits, grad used;
// loss/lse/z_loss/argmax/accuracy null).
struct VpProblem {
  const char* fn;             // "fce_vp_loss" or "fce_vp_backward"
  bool backward;              // fce_vp_backward (not inferred from the pointers)
  CeOptions opt;
  int64_t ranks, rows, vocab_total;
  int64_t vocab_start, vocab_local;   // backward only
  int64_t row_stride, grad_row_stride;  // backward only, >= vocab_local
  const void* targets;
  const float* gathered;      // [ranks, rows, FCE_VP_STATS]
  // loss
  float* loss;                // [1] or [rows]
  float* lse;                 // optional [rows]
  float* z_loss;              // optional [1]
  int64_t* argmax;            // optional [rows]
  float* accuracy;            // optional [1] or [rows]
  // backward
  const void* logits;         // [rows, row_stride], this rank's shard
  const float* grad_output;   // nullptr = 1
  void* grad;                 // [rows, grad_row_stride]; may == logits
  float* entropy;             // loss: optional [rows] (needs opt.vp_entropy)
  const float* grad_lse;      // backward: optional [rows], nullptr = 0
  const float* grad_entropy;  // backward: optional [rows] (needs opt.vp_entropy), nullptr = 0
  uint32_t* error_flags;      // optional
  void* workspace;
  size_t workspace_bytes;
  void* stream;
};

// fce_vp_linear_stats (backward false: writes stats) and fce_vp_linear_backward (backward:
// reads gathered, writes the gradients).
struct VpLinearProblem {
  const char* fn;             // "fce_vp_linear_stats" or "fce_vp_linear_backward"
  bool backward;              // fce_vp_linear_backward (not inferred from the pointers)
  CeOptions opt;
  int64_t ranks, rows, hidden, vocab_total, vocab_start, vocab_local;
  int64_t hidden_row_stride;  // >= hidden
  const void* hidden_states;  // [rows, hidden_row_stride]
  const void* weight;         // [vocab_local, hidden]
  const void* bias;           // [vocab_local] or nullptr
  const void* targets;
  float* stats;               // phase 1: [rows, FCE_VP_STATS]
  const float* gathered;      // phase 3: [ranks, rows, FCE_VP_STATS]
  const float* grad_output;   // nullptr = 1
  void* grad_hidden;          // optional [rows, hidden] dense, grad_hidden_dtype
  int grad_hidden_dtype;      // FCE_FLOAT32 or opt.dtype
  void* grad_weight;          // optional [vocab_local, hidden] dense, dtype or f32
  void* grad_bias;            // optional [vocab_local], same dtype as grad_weight
  bool grad_weight_fp32;
  bool accumulate;
  uint32_t* error_flags;      // optional (phase 3)
  const float* grad_lse;      // phase 3: optional [rows], nullptr = 0
  const float* grad_entropy;  // phase 3: optional [rows] (needs opt.vp_entropy), nullptr = 0
  void* workspace;
  size_t workspace_bytes;
  void* stream;
};

// fce_vp_linear_ce: both phases in one call, the all-gather through the caller's function
// (lib/api_vp_linear_ce.cpp runs the gather-once plan from the calls above; the CUDA
// token-chunk plan is lib/cuda/vocab_parallel/linear_ce.cu).
struct VpLinearCeProblem {
  VpLinearProblem lin;        // fn "fce_vp_linear_ce"; stats and gathered unused
  float* loss;                // [1] or [rows]
  float* lse;                 // optional [rows]
  float* z_loss;              // optional [1]
  int64_t* argmax;            // optional [rows]
  float* accuracy;            // optional [1] or [rows]
  float* entropy;             // optional [rows] (needs opt.vp_entropy)
  fce_vp_all_gather_fn all_gather;
  void* context;
};

// ---- CPU backend (lib/cpu/) ----
size_t cpu_ce_workspace_size(const CeOptions& opt, int64_t rows, int64_t vocab, bool backward);
fce_status cpu_ce(const CeProblem& p);  // by p.mode
void cpu_linear_ce_workspace_size(const CeOptions& opt, int64_t rows, int64_t hidden,
                                  int64_t vocab, bool with_grad, bool grad_weight_fp32,
                                  size_t* min_bytes, size_t* optimal_bytes);
fce_status cpu_linear_ce(const LinearCeProblem& p);
// grad[i] *= *scale for i < count (fce_scale_gradient; arguments checked).
fce_status cpu_scale_gradient(int dtype, int64_t count, void* grad, const float* scale);
// vocabulary-parallel (lib/cpu/vocab_parallel.cpp)
fce_status cpu_vp_stats(const VpStatsProblem& p);
size_t cpu_vp_workspace_size(const CeOptions& opt, int64_t ranks, int64_t rows,
                             int64_t vocab_total, int64_t vocab_local, bool backward);
fce_status cpu_vp(const VpProblem& p);  // loss, or backward (p.backward)
void cpu_vp_linear_workspace_size(const CeOptions& opt, int64_t ranks, int64_t rows,
                                  int64_t hidden, int64_t vocab_total, int64_t vocab_local,
                                  bool backward, int grad_hidden_dtype, bool grad_weight_fp32,
                                  size_t* min_bytes, size_t* optimal_bytes);
fce_status cpu_vp_linear(const VpLinearProblem& p);  // stats, or backward (p.backward)

// ---- CUDA backend (lib/cuda/); stubs returning FCE_ERROR_BACKEND_UNAVAILABLE when not built --
// Whether the CUDA backend can run: built in, a device visible, cuBLASLt loaded (the first call
// looks for it: lib/cuda/common/cublaslt_loader.cpp). cuda_unavailable_reason() is nullptr when it can,
// else why not, for the messages of FCE_ERROR_BACKEND_UNAVAILABLE ("no CUDA device is visible
// (...)", "libcublasLt.so.13 (cuBLASLt) not found; ... Looked: ...", "this build has no CUDA
// backend ..."); valid until the next call on this thread.
bool cuda_available();
const char* cuda_unavailable_reason();
bool cuda_device_visible();  // built in and a device visible (cuBLASLt not looked at)
// The file of the cuBLASLt loaded (looking for it on the first call), or nullptr with *why
// saying what was tried (for fce_build_info; only in a build with the CUDA backend).
const char* cuda_cublaslt(const char** why);
// Every present buffer of some bytes in the call's argument table must be memory the current
// device can dereference (FCE_ERROR_INVALID_ARGUMENT naming fn and the argument otherwise). The ABI
// layer calls it once per CUDA call, before dispatching; the backend does not check again.
fce_status cuda_check_pointers(const char* fn, const Arg* args, int count);
size_t cuda_ce_workspace_size(const CeOptions& opt, int64_t rows, int64_t vocab, bool backward);
// fce_forward, fce_backward, fce_backward_rescale on the CUDA backend (by p.mode).
fce_status cuda_ce(const CeProblem& p);
void cuda_linear_ce_workspace_size(const CeOptions& opt, int64_t rows, int64_t hidden,
                                   int64_t vocab, bool with_grad, bool grad_weight_fp32,
                                   size_t* min_bytes, size_t* optimal_bytes);
fce_status cuda_linear_ce(const LinearCeProblem& p);
fce_status cuda_scale_gradient(int dtype, int64_t count, void* grad, const float* scale,
                               void* stream);
// Zero bytes over each span (present, bytes > 0, aligned to 2 bytes), one kernel on the stream
// (lib/cuda/common/empty.cu: the empty problem's outputs; pointers checked by the ABI layer).
fce_status cuda_write_zeros(const char* fn, const ZeroSpan* spans, int count, void* stream);
// vocabulary-parallel (lib/cuda/vocab_parallel/vocab_parallel.cu, lib/cuda/vocab_parallel/linear.cu)
fce_status cuda_vp_stats(const VpStatsProblem& p);
size_t cuda_vp_workspace_size(const CeOptions& opt, int64_t ranks, int64_t rows,
                              int64_t vocab_total, int64_t vocab_local, bool backward);
fce_status cuda_vp(const VpProblem& p);
void cuda_vp_linear_workspace_size(const CeOptions& opt, int64_t ranks, int64_t rows,
                                   int64_t hidden, int64_t vocab_total, int64_t vocab_local,
                                   bool backward, int grad_hidden_dtype, bool grad_weight_fp32,
                                   size_t* min_bytes, size_t* optimal_bytes);
fce_status cuda_vp_linear(const VpLinearProblem& p);
// fce_vp_linear_ce's token-chunk plan (lib/cuda/vocab_parallel/linear_ce.cu): whether it runs at
// workspace_bytes (rank-invariant: planned for shards plan_width = ⌈vocab_total / ranks⌉ wide;
// with_grad true), *threshold the workspace from which it does, *need what this rank's shard of
// `width` classes needs then (may exceed workspace_bytes for a shard wider than plan_width).
// workspace_bytes SIZE_MAX: the full-speed sizes, for the query.
bool cuda_vp_linear_ce_chunked(const CeOptions& opt, int64_t ranks, int64_t rows, int64_t hidden,
                               int64_t vocab_total, int64_t width, bool need_dw, bool dw_fp32,
                               size_t workspace_bytes, size_t* threshold, size_t* need);
fce_status cuda_vp_linear_ce(const VpLinearCeProblem& p);  // the token-chunk plan

}  // namespace fce
