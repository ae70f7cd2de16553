// vp_linear_plan.cuh — the workspace plans of the vocabulary-parallel linear calls on CUDA
// (vp_linear_plan.cu, host code only; vp_linear.cu runs them). Phase 1 (fce_vp_linear_stats) is
// fce_linear_ce's loss-only token-chunk plan for the shard (linear_plan.cuh); phase 3
// (fce_vp_linear_backward) is the slice pass over the shard's columns for all rows, whose
// workspace is laid out here: CeDenoms | CeRowStats [N] | bias copy [V_s] in dtype | float32 ∂h
// [N, D] (16-bit grad_hidden_dtype only) | cuBLASLt workspace | logits scratch [N, Vc] in dtype.
// A function of the sizes, the options, grad_hidden_dtype and workspace_bytes only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/linear_plan.cuh"
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

}  // namespace vp_plan

#if defined(FCE_VP_SELFTEST)
// Host-only check of the phase-3 plan arithmetic (vp_linear_plan.cu); returns the number of
// failures, each printed. Built only with -DFCE_VP_SELFTEST (tests/CMakeLists.txt); no GPU.
int vp_linear_selftest();
#endif

}  // namespace cuda
}  // namespace fce
