// linear/plan.cuh — what fce_linear_ce's CUDA path (linear/linear_ce.cu) shares with the
// vocabulary-parallel linear calls (vocab_parallel/linear.cu, vocab_parallel/linear_plan.cu): the workspace arithmetic of
// its plans (defined in linear/plan.cu, host code only), the logits GEMM of a piece of z, and the
// vocab-sliced plan's gradient pass over column slices (both defined in linear/linear_ce.cu, whose
// header comment describes the plans). fce_linear_ce calls exactly these functions, so sharing
// them changes none of its GEMMs, kernels or their order. Every function that can fail takes
// `fn`, the public function its messages start with ("fce_linear_ce", "fce_vp_linear_stats").
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda/ce/rows.cuh"
#include "internal.h"

namespace fce {
namespace cuda {
namespace linear {

constexpr size_t kAlign = 256;  // every workspace slice starts 256-byte aligned
// The full-speed token chunk stays within this (see the plans in linear_ce.cu).
constexpr size_t kChunkBudget = size_t(1) << 30;
// cuBLASLt workspace sizes, largest first: 32 MiB is NVIDIA's recommendation for Hopper; the
// budgeted chunk leaves at least kLtWorkspaceBudget; 4 MiB is the floor when memory is tight.
// (Tuning knob, to be measured: whether these GEMMs run slower with 16 MiB than with 32 MiB;
// 4096 bf16 rows at V = 128256 leave about 20 MiB of the 1 GiB for everything else.)
constexpr size_t kLtWorkspaceSizes[] = {32u << 20, 16u << 20, 8u << 20, 4u << 20};
constexpr size_t kLtWorkspaceFull = 32u << 20;
constexpr size_t kLtWorkspaceBudget = 16u << 20;
constexpr size_t kLtWorkspaceMin = 4u << 20;
constexpr int64_t kMaxChunkRows = 4096;      // more rows per chunk gives no more speed: ∂W's GEMM
                                             // is compute bound from Nc ≈ 1024 (docs/performance.md)
constexpr int64_t kFullSpeedRows = 1024;     // the full-speed chunk has at least this (or N)
constexpr int64_t kMinChunkRows = 128;       // below this, W is re-read too often per FLOP
constexpr int64_t kRowQuantum = 128;         // chunk rows are a multiple of this (or all rows)
constexpr int64_t kVocabPad = 64;            // Z_c rows padded to 64 elements (≥ 128 B)

// A 16-bit grad_weight accumulated in place over k token chunks (kChunked16) is rounded once per
// chunk. docs/semantics.md allows it while the error stays within 2× torch eager's against float64
// (relative Frobenius and max-abs over max |reference|). bench/accuracy_dw.py --study measured it
// on the H200 for N up to 65536 and V from 32000 to 256000 (docs/performance.md): the error grows
// with k the faster the more targets each class has (N / V); every point with k · N / V ≤ 3
// passed, the lowest failing one was 3.45. Hence k ≤ 3 · V / N, at least 1 and at most
// kMaxChunks16 (the largest k measured); more chunks take the vocab-sliced plan (one rounding).
constexpr int64_t kMaxChunks16 = 64;
int64_t max_chunks16(int64_t rows, int64_t vocab);
// The vocab-sliced plan's smallest pieces: 16 rows of logits in the lse pass, 64 columns of
// logits for all rows in the gradient pass (a few MiB of workspace at the peers' sizes).
constexpr int64_t kMinSliceRows = 16;

// ---- size arithmetic that saturates at SIZE_MAX instead of wrapping (sat_add, sat_mul:
// internal.h)
constexpr size_t kHuge = SIZE_MAX;
inline size_t sat_round(size_t a) { return sat_round_up(a, kAlign); }

// The fewest pieces of at most `most` each covering n, then each piece ceil(n / pieces) rounded
// up to `quantum` (never above `most`): balanced, so the last piece is not a sliver.
inline int64_t balanced(int64_t n, int64_t most, int64_t quantum) {
  const int64_t pieces = (n + most - 1) / most;
  const int64_t even = (n + pieces - 1) / pieces;
  return std::min(most, (even + quantum - 1) / quantum * quantum);
}

// What the workspace has to hold, from the sizes and options alone.
struct Sizes {
  int64_t rows, hidden, vocab, vocab_padded;
  size_t elem;          // bytes of one element of dtype: of Z_c / ∂Z_c and of the bias copy
  bool reduction_none;  // the per-row losses go straight into the caller's loss
  bool with_grad;       // ∂Z_c is produced (in place over Z_c)
  bool invariant;       // options->batch_invariant: the fixed-chunk plan (plan_invariant)
};
Sizes sizes_of(const CeOptions& opt, int64_t rows, int64_t hidden, int64_t vocab, bool with_grad);

// Byte offsets of the workspace slices, from a 256-byte aligned base. total includes kAlign of
// slack for aligning the caller's (16-byte aligned) pointer; kHuge when it overflows.
struct Layout {
  size_t denoms, row_loss, row_zloss, row_correct, bias, db, stats, dh, lt, z, total;
  // options->batch_invariant: a chunk's hidden rows [Nc, D] and its ∂h [Nc, D], both in dtype
  // (the GEMMs always see Nc rows, the last chunk padded with zero rows); 0 bytes otherwise
  size_t h_fixed, dh_fixed;
};

// The workspace's 256-byte aligned base (the caller's pointer is 16-byte aligned; every
// Layout's total includes kAlign of slack for this).
inline char* aligned_base(void* workspace) {
  return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(workspace) + kAlign - 1) / kAlign *
                                 kAlign);
}

// The slices a token-chunk pass reads and writes, at `base` (aligned_base) laid out by L, as
// fce_linear_ce and fce_vp_linear_ce both take them: the row losses go straight to the caller's
// loss for reduction none; the z-loss terms exist when λ ≠ 0 and they are part of the loss or
// asked for (z_loss_out); the accuracy rows when it is asked for (straight to it for none); the
// bias copy (in dtype) when there is a bias.
struct ChunkSlices {
  CeDenoms* denoms;
  float* row_loss;
  float* row_zloss;
  float* row_correct;
  void* bias;
  float* db32;
  void* lt;
  void* z;  // Z_c [rc, ldz] in dtype, then ∂Z_c in place (same dtype and stride)
};
inline ChunkSlices chunk_slices(const Layout& L, char* base, const CeOptions& opt, float* loss,
                                bool z_loss_out, float* accuracy, bool has_bias) {
  const bool none = opt.reduction == FCE_REDUCTION_NONE;
  ChunkSlices c;
  c.denoms = reinterpret_cast<CeDenoms*>(base + L.denoms);
  c.row_loss = none ? loss : reinterpret_cast<float*>(base + L.row_loss);
  c.row_zloss = (opt.z_loss_scale != 0.f && (!none || z_loss_out))
                    ? reinterpret_cast<float*>(base + L.row_zloss) : nullptr;
  c.row_correct = !accuracy ? nullptr
                  : none    ? accuracy
                            : reinterpret_cast<float*>(base + L.row_correct);
  c.bias = has_bias ? static_cast<void*>(base + L.bias) : nullptr;
  c.db32 = reinterpret_cast<float*>(base + L.db);
  c.lt = base + L.lt;
  c.z = base + L.z;
  return c;
}

enum class Mode { kChunked, kChunked16, kVocabSliced };

struct Plan {
  Mode mode;
  int64_t chunk_rows, chunks;  // token chunks (the vocab-sliced plan's lse pass too)
  int64_t slice_cols, slices;  // the vocab-sliced plan's gradient pass: columns per slice
  size_t lt_bytes;
  Layout layout;
};

// The slices of a token-chunk plan with chunks of chunk_rows rows and lt_bytes for cuBLASLt.
Layout layout_of(const Sizes& s, int64_t chunk_rows, size_t lt_bytes);
// The plan of one token-chunk mode in workspace_bytes, or false when even its smallest chunk
// does not fit.
bool plan_mode(const Sizes& s, Mode mode, size_t workspace_bytes, Plan* out);
// options->batch_invariant (docs/semantics.md rule 21): the rows of every token chunk, a function
// of V and dtype only (never of N or the workspace).
int64_t invariant_rows(const Sizes& s);
// fce_linear_ce's plan in workspace_bytes (need_dw: grad_weight is asked for; dw_fp32: it is
// float32), or false when none fits: see linear_plan.cu.
bool choose_plan(const Sizes& s, bool need_dw, bool dw_fp32, size_t workspace_bytes, Plan* out);
// The smallest workspace in which a call with these gradients has a plan, and the workspace of
// the full-speed plan (need_dw: grad_weight is asked for; dw_fp32: it is float32).
size_t min_workspace(const Sizes& s, bool need_dw, bool dw_fp32);
size_t optimal_workspace(const Sizes& s, bool need_dw, bool dw_fp32);

// Z[M, N] = A[M, K] · W[N, K]ᵀ (+ bias[N]) in dtype with float32 accumulation (ldz elements
// between rows of Z, lda between rows of A, W dense): cuBLASLt with the BIAS epilogue, or the
// bias added by a second kernel when no algorithm fuses it (gemm.cuh).
fce_status logits_gemm(const char* fn, int dtype, int64_t M, int64_t N, int64_t K, const void* A,
                       int64_t lda, const void* W, const void* bias, void* Z, int64_t ldz,
                       void* lt_ws, size_t lt_bytes, cudaStream_t s, bool whole_k = false);

// Steps 3-5 of a token chunk of rc rows (linear_ce.cu; fce_linear_ce and fce_vp_linear_ce run
// exactly this), from ∂Z_c [rc, cols] in dtype (ldz elements apart, in place over the chunk's
// logits), the chunk's hidden rows h_c and the weight [cols, hidden]:
//   3. ∂h_c = ∂Z_c · W              into grad_hidden (the chunk's rows, dense, grad_hidden_dtype)
//   4. ∂W (+)= ∂Z_cᵀ · h_c          into grad_weight (grad_weight_dtype: 16-bit in place, one
//                                   rounding per chunk; or float32); beta 0 on the first chunk
//                                   unless accumulate
//   5. ∂b (+)= Σ_rows ∂Z_c          float32: into a float32 grad_bias, else into db32 (stored
//                                   by the caller after the last chunk)
// Each output may be null (not asked for).
struct ChunkGrads {
  const char* fn;
  int dtype;                   // of ∂Z_c, h_c and the weight
  int64_t rc, cols, hidden;
  const void* dz;
  int64_t ldz;
  const void* h_c;
  int64_t hs;                  // elements between rows of h_c
  const void* weight;          // [cols, hidden] dense
  void* grad_hidden;           // the chunk's first row, or nullptr
  int grad_hidden_dtype;
  void* grad_weight;           // [cols, hidden], or nullptr
  int grad_weight_dtype;       // FCE_FLOAT32, or dtype (then grad_bias is dtype too, via db32)
  void* grad_bias;             // [cols], or nullptr
  float* db32;                 // [cols] float32 accumulator (a 16-bit grad_bias)
  bool first, accumulate;
  void* lt_ws;
  size_t lt_bytes;
};
fce_status chunk_grads(const ChunkGrads& g, cudaStream_t s);

// The vocab-sliced plan's gradient pass (linear_ce.cu): per slice of slice_cols columns
// [v0, v0 + vc) of the weight's `cols` rows, for all `rows` rows of hidden:
//   a. Z_s = h · W_sᵀ + b_s                     (logits_gemm, into z, ld = slice_cols)
//   b. ∂Z_s in place from stats (CeRowStats m, log s, t per row): launch_ce_rows backward on the
//      column slice [col_offset + v0, col_offset + v0 + vc) of rows of vocab_total classes
//      (then fix_dz on it, when given)
//   c. ∂W_s = ∂Z_sᵀ · h                          (one GEMM over all rows; beta = accumulate)
//   d. dh (+)= ∂Z_s · W_s                        (float32, beta = 0 on the first slice)
//   e. db[v0, v0 + vc) = colsum(∂Z_s) (+ old)    (fixed order)
// No error flags (the pass that made stats flagged invalid targets already).
struct SlicePass {
  const char* fn;              // the public function, for messages
  CeOptions opt;               // opt.dtype: of hidden, weight, bias and the logits scratch
  int64_t rows, hidden, hidden_row_stride;
  int64_t cols;                // rows of weight (classes) covered
  int64_t col_offset;          // global class of weight row 0 (0 for fce_linear_ce)
  int64_t vocab_total;         // classes of the whole vocabulary (targets, ε/V, class weights)
  const void* hidden_states;   // [rows, hidden_row_stride]
  const void* weight;          // [cols, hidden] dense
  const void* bias;            // [cols] of dtype (256-byte aligned copy) or nullptr
  const void* targets;         // global class indices (shift rule applied inside), or
                               // (fce_vp_linear_backward, q_row_stride > 0) the shard's class
                               // probabilities [rows, q_row_stride], weight row 0 in column 0
  int64_t q_row_stride;        // 0: targets are class indices
  const CeDenoms* denoms;      // device, of the whole problem
  const float* grad_output;    // nullptr = 1
  const CeRowStats* stats;     // [rows]
  void* z;                     // scratch of rows × slice_cols elements of dtype
  int64_t slice_cols, slices;
  void* lt_ws;                 // cuBLASLt workspace, lt_bytes
  size_t lt_bytes;
  void* grad_weight;           // [cols, hidden] dense, or nullptr
  int grad_weight_dtype;
  bool accumulate;             // ∂W += (else =)
  float* dh;                   // float32 [rows, hidden] accumulator, or nullptr (no ∂h)
  void* db;                    // [cols] of db_dtype, or nullptr (no ∂b)
  int db_dtype;
  bool db_add_old;
  // Optional (nullptr for fce_linear_ce): called on each slice's ∂Z_s [rows, cols] (ld elements
  // apart, dtype) after b., before its products (fce_vp_linear_backward: NaN rows of its tiling
  // check).
  fce_status (*fix_dz)(const void* ctx, void* dz, int64_t rows, int64_t cols, int64_t ld,
                       cudaStream_t s);
  const void* fix_ctx;
  // Rule 18's upstream gradients [rows] or nullptr: grad_entropy needs stats' pad to hold μ − m
  // (fce_vp_linear_backward's combine, fce_linear_ce's lse pass with stats_mu).
  const float* grad_lse;
  const float* grad_entropy;
};
fce_status slice_pass(const SlicePass& sp, cudaStream_t s);

}  // namespace linear
}  // namespace cuda
}  // namespace fce
