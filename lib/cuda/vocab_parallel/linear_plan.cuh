// vocab_parallel/linear_plan.cuh — the workspace plans of the vocabulary-parallel linear calls on CUDA
// (vocab_parallel/linear_plan.cu, host code only; vocab_parallel/linear.cu runs them). Phase 1 (fce_vp_linear_stats) is
// fce_linear_ce's loss-only token-chunk plan for the shard (linear/plan.cuh); phase 3
// (fce_vp_linear_backward) is the slice pass over the shard's columns for all rows, whose
// workspace is laid out here: CeDenoms | CeRowStats [N] | bias copy [V_s] in dtype | float32 ∂h
// [N, D] (16-bit grad_hidden_dtype only) | cuBLASLt workspace | logits scratch [N, Vc] in dtype.
// A function of the sizes, the options, grad_hidden_dtype and workspace_bytes only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/linear/plan.cuh"
#include "internal.h"

namespace fce {
namespace cuda {
namespace vp_plan {

// ---- phase 1: fce_linear_ce's loss-only token-chunk plan for the shard
linear::Sizes stats_sizes(const CeOptions& opt, int64_t rows, int64_t hidden, int64_t vocab_local);

// ---- phase 3: the slice pass over the shard's columns for all rows
struct BwdSizes {
  int64_t rows, hidden, cols, cols_padded;
  size_t elem;
  bool dh32;  // ∂h accumulates in a float32 workspace buffer (16-bit grad_hidden_dtype)
};
BwdSizes bwd_sizes(const CeOptions& opt, int64_t rows, int64_t hidden, int64_t vocab_local,
                   int grad_hidden_dtype);

// Byte offsets of the workspace slices, from a 256-byte aligned base.
struct BwdLayout {
  size_t denoms, stats, bias, dh, lt, z, total;
};

// The smallest workspace with a plan (slices of 64 columns, 4 MiB for cuBLASLt), and the
// full-speed one (slices of up to 1 GiB of logits, 16 MiB for cuBLASLt).
size_t bwd_min_workspace(const BwdSizes& s);
size_t bwd_optimal_workspace(const BwdSizes& s);

struct BwdPlan {
  int64_t slice_cols, slices;
  size_t lt_bytes;
  BwdLayout layout;
};
// The plan in workspace_bytes; false when workspace_bytes is below bwd_min_workspace.
bool bwd_plan(const BwdSizes& s, size_t workspace_bytes, BwdPlan* out);

// ---- fce_vp_linear_ce's token-chunk plan (vocab_parallel/linear_ce.cu): fce_linear_ce's token-chunk plan
// (kChunked, or kChunked16 for a 16-bit grad_weight) planned for a shard plan_width =
// ⌈vocab_total / ranks⌉ wide, so that every rank takes the same chunks (each chunk is an
// all-gather), laid out for this rank's shard after three slices of its own, from a 256-byte
// aligned base: this rank's statistics [N, FCE_VP_STATS] (the all-gathers' send buffers), the
// gathered statistics chunk after chunk ([ranks, rc, FCE_VP_STATS] per chunk of rc rows), the
// combined row statistics CeRowStats [N]; then linear::Layout (its offsets from `lin`).
struct FusedPlan {
  linear::Plan lin;     // chunk_rows, chunks, lt_bytes, mode; layout: this rank's
  size_t own, gathered, rowstats, lin_at;
  size_t total;         // bytes this rank needs (kAlign of slack included)
  size_t threshold;     // the plan runs when workspace_bytes >= threshold (rank-invariant)
};
// The plan at workspace_bytes (kHuge: the full-speed one, for the query). False when
// workspace_bytes is below the threshold (the gather-once plan runs); out->threshold is set
// either way. out->total may exceed workspace_bytes for a shard wider than plan_width.
bool fused_plan(const CeOptions& opt, int64_t ranks, int64_t rows, int64_t hidden,
                int64_t plan_width, int64_t width, bool need_dw, bool dw_fp32,
                size_t workspace_bytes, FusedPlan* out);

}  // namespace vp_plan

#if defined(FCE_VP_SELFTEST)
// Host-only check of the phase-3 plan arithmetic (vocab_parallel/linear_plan.cu); returns the number of
// failures, each printed. Built only with -DFCE_VP_SELFTEST (tests/CMakeLists.txt); no GPU.
int vp_linear_selftest();
#endif

}  // namespace cuda
}  // namespace fce
