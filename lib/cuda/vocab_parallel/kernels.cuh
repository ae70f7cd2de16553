// vocab_parallel/kernels.cuh — the kernels of the vocabulary-parallel calls (vocab_parallel/kernels.cu), shared by
// fce_vp_stats / fce_vp_loss / fce_vp_backward (vocab_parallel/vocab_parallel.cu) and fce_vp_linear_stats /
// fce_vp_linear_backward (vocab_parallel/linear.cu). docs/semantics.md rule 16; the stats layout is VpStat
// (internal.h). Every launcher enqueues on the given stream only (no allocation, no
// synchronisation) and returns FCE_ERROR_CUDA through fce::fail, naming `fn`, on a launch error.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/ce/rows.cuh"
#include "internal.h"

namespace fce {
namespace cuda {

// Phase 1: the statistics of rows [row_begin, row_begin + row_count) of a logits shard (classes
// [vocab_start, vocab_start + vocab_local) of vocab_total), one CTA per row, one read of it.
// Writes stats[row · FCE_VP_STATS + k] for every k but kVpWeight when weight_written (the
// class-weighted W_r, written by launch_vp_weights), for the global row index.
struct VpStatsArgs {
  const char* fn;          // the public function, for messages
  CeOptions opt;
  int64_t row_begin, row_count;
  const void* logits;      // points at row row_begin; of logits_dtype
  int logits_dtype;
  int64_t row_stride;      // elements, >= vocab_local
  int64_t vocab_total, vocab_start, vocab_local;
  const void* targets;     // the whole targets array (global rows, shift rule inside)
  float* stats;            // [rows, FCE_VP_STATS] (global rows), 16-byte aligned
  bool weight_written;     // kVpWeight already written (class weights): leave it
};
// With class-probability targets (opt.soft_targets; targets is this shard's q [rows,
// vocab_local] of opt.q_dtype, global rows) it runs launch_vp_soft_sums after the stats kernel.
fce_status launch_vp_stats(const VpStatsArgs& a, cudaStream_t s);
// Class probabilities (vocab_parallel/soft.cu): kVpSmooth u_r = Σ_j ω_j q'_j (m_r − a_j) and
// kVpWeight W_r = Σ_j ω_j q'_j of the rows, against the stored m_r (launch_vp_stats' own).
fce_status launch_vp_soft_sums(const VpStatsArgs& a, cudaStream_t s);
// Under options->batch_invariant (vocab_parallel/exact.cu): the exact statistics
// [rows, FCE_VP_STATS_INVARIANT] (VpExactStat) of the rows, class weights and probabilities
// included (launch_vp_stats runs it in place of everything above).
fce_status launch_vp_stats_exact(const VpStatsArgs& a, cudaStream_t s);

// The arguments of phase 1 over a token chunk of a linear call's logits z (opt.dtype, ld
// elements apart; fce_vp_linear_stats, fce_vp_linear_ce), kVpWeight written beforehand by
// launch_vp_weights when there are class weights.
inline VpStatsArgs vp_chunk_stats_args(const char* fn, const CeOptions& opt, int64_t row_begin,
                                       int64_t row_count, const void* z, int64_t ld,
                                       int64_t vocab_total, int64_t vocab_start,
                                       int64_t vocab_local, const void* targets, float* stats) {
  VpStatsArgs a{};
  a.fn = fn;
  a.opt = opt;
  a.row_begin = row_begin;
  a.row_count = row_count;
  a.logits = z;
  a.logits_dtype = opt.dtype;
  a.row_stride = ld;
  a.vocab_total = vocab_total;
  a.vocab_start = vocab_start;
  a.vocab_local = vocab_local;
  a.targets = targets;
  a.stats = stats;
  a.weight_written = opt.class_weights != nullptr;
  return a;
}

// W_r = Σ_j ω_j over the shard's classes (opt.class_weights non-null), in a fixed order (double),
// written to stats[row · FCE_VP_STATS + kVpWeight] for rows [0, rows): the same bits in every
// row. Call it (with class weights) before or after launch_vp_stats with weight_written = true.
fce_status launch_vp_weights(const char* fn, const CeOptions& opt, int64_t rows,
                             int64_t vocab_start, int64_t vocab_local, float* stats,
                             cudaStream_t s);

// Phase 3: per row of [row_begin, row_begin + rows), the gathered statistics [ranks, rows,
// FCE_VP_STATS] of those rows combined in gathered order in float32 (rule 16), then (every output
// indexed by the global row, row_begin + the row's place in gathered):
//   stats_out    CeRowStats {M, log S, t} (t = p_y with token scaling, else 1), the gradient's
//                row statistics (launch_ce_rows' stats_in); {NaN, NaN, NaN} for a row whose
//                shards are inconsistent, with pad = 1 when that row is ignored (its gradient
//                must be NaN too: launch_vp_nan_rows), else pad = 0
//   row_loss     as launch_ce_rows' (reduction none: ce + zl; mean/sum: the ce part)
//   row_zloss    λ·lse² (times p_y with token scaling), 0 for ignored rows
//   (an inconsistent row, ignored or not: loss NaN, z-loss NaN when λ ≠ 0, lse NaN, argmax −1)
//   lse, argmax, row_correct as fce_forward's
//   error_flags  FCE_FLAG_TARGET_OUT_OF_RANGE, FCE_FLAG_SHARDS_INCONSISTENT
//   entropy      (opt.vp_entropy) H per row, NaN as lse
// With opt.vp_entropy (the statistics carry e_r) stats_out's pad holds μ − M (what the row
// kernel's grad_entropy terms need) and an inconsistent row is {NaN, NaN, NaN, NaN} (t NaN:
// launch_vp_nan_rows with by_t). Every output pointer may be null.
struct VpCombineArgs {
  const char* fn;
  CeOptions opt;
  int64_t ranks, rows, vocab_total;
  int64_t row_begin;           // 0 for all rows; fce_vp_linear_ce: its token chunk's first row
  const void* targets;         // the whole targets array (global rows, shift rule inside)
  const float* gathered;
  CeRowStats* stats_out;
  float* row_loss;
  float* row_zloss;
  float* lse;
  int64_t* argmax;
  float* row_correct;
  uint32_t* error_flags;
  float* entropy;
};
fce_status launch_vp_combine(const VpCombineArgs& a, cudaStream_t s);

// The gradient rows [rows, cols] (ld elements apart, dtype f32 / f16 / bf16) of the rows the
// combine flagged (stats[row].pad ≠ 0: ignored rows of an inconsistent tiling, whose gradient is
// NaN like every other row's, docs/semantics.md rule 16) set to NaN; the other rows untouched. Run it
// after the row kernel wrote the gradient (it writes 0 for ignored rows). by_t: the statistics of
// an opt.vp_entropy combine (the flag is t NaN).
fce_status launch_vp_nan_rows(const char* fn, const CeRowStats* stats, int64_t rows, void* g,
                              int dtype, int64_t cols, int64_t ld, cudaStream_t s,
                              bool by_t = false);

}  // namespace cuda
}  // namespace fce
