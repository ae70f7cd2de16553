// vocab_parallel/linear_plan.cu — the workspace plans of fce_vp_linear_stats and fce_vp_linear_backward on
// CUDA (vocab_parallel/linear_plan.cuh; vocab_parallel/linear.cu's header describes both phases), and their
// workspace-size query. Host code only, no CUDA calls: with -DFCE_VP_SELFTEST this file and
// linear/plan.cu make the host self-test vp_linear_selftest() (the ctest target
// CudaVpLinearSelftest, no GPU needed).
#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "cuda/linear/plan.cuh"
#include "cuda/vocab_parallel/linear_plan.cuh"
#include "internal.h"

namespace fce {
namespace cuda {
namespace vp_plan {

using linear::kAlign;
using linear::kChunkBudget;
using linear::kHuge;
using linear::kLtWorkspaceBudget;
using linear::kLtWorkspaceMin;
using linear::kVocabPad;
using linear::sat_round;

// ---- phase 1: fce_linear_ce's loss-only token-chunk plan for the shard
linear::Sizes stats_sizes(const CeOptions& opt, int64_t rows, int64_t hidden, int64_t vocab_local) {
  return linear::sizes_of(opt, rows, hidden, vocab_local, false);
}

// ---- phase 3: the slice pass over the shard's columns for all rows
BwdSizes bwd_sizes(const CeOptions& opt, int64_t rows, int64_t hidden, int64_t vocab_local,
                   int grad_hidden_dtype) {
  BwdSizes s;
  s.rows = rows;
  s.hidden = hidden;
  s.cols = vocab_local;
  s.cols_padded = (vocab_local + kVocabPad - 1) / kVocabPad * kVocabPad;
  s.elem = dtype_size(opt.dtype);
  s.dh32 = grad_hidden_dtype != FCE_FLOAT32;
  return s;
}

namespace {

// total includes kAlign of slack for aligning the caller's (16-byte aligned) pointer; kHuge when
// it overflows.
BwdLayout bwd_layout(const BwdSizes& s, size_t lt_bytes, size_t z_bytes) {
  BwdLayout l;
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t off = at;
    at = sat_add(at, sat_round(bytes));
    return off;
  };
  const size_t rows = static_cast<size_t>(s.rows);
  l.denoms = take(sizeof(CeDenoms));
  l.stats = take(sat_mul(rows, sizeof(CeRowStats)));
  l.bias = take(sat_mul(static_cast<size_t>(s.cols), s.elem));
  l.dh = take(s.dh32 ? sat_mul(sat_mul(rows, static_cast<size_t>(s.hidden)), 4) : 0);
  l.lt = take(lt_bytes);
  l.z = take(z_bytes);
  l.total = sat_add(at, kAlign);
  return l;
}

size_t slice_bytes(const BwdSizes& s, int64_t cols) {
  return sat_mul(sat_mul(static_cast<size_t>(s.rows), static_cast<size_t>(cols)), s.elem);
}

// The full-speed slice: as many columns as kChunkBudget of logits holds (all of the shard when
// they fit), at least kVocabPad, balanced over the shard.
int64_t full_speed_cols(const BwdSizes& s) {
  const size_t col_bytes = std::max<size_t>(1, sat_mul(static_cast<size_t>(s.rows), s.elem));
  int64_t cols = static_cast<int64_t>(std::min<size_t>(static_cast<size_t>(s.cols_padded),
                                                       kChunkBudget / col_bytes / kVocabPad * kVocabPad));
  cols = std::max<int64_t>(cols, kVocabPad);
  return linear::balanced(s.cols, cols, kVocabPad);
}

}  // namespace

size_t bwd_min_workspace(const BwdSizes& s) {
  return bwd_layout(s, kLtWorkspaceMin, slice_bytes(s, kVocabPad)).total;
}
size_t bwd_optimal_workspace(const BwdSizes& s) {
  return bwd_layout(s, kLtWorkspaceBudget, slice_bytes(s, full_speed_cols(s))).total;
}

// False when workspace_bytes is below bwd_min_workspace.
bool bwd_plan(const BwdSizes& s, size_t workspace_bytes, BwdPlan* out) {
  const size_t lo = bwd_min_workspace(s);
  if (lo == kHuge || workspace_bytes < lo) return false;
  const size_t lt = workspace_bytes >= bwd_optimal_workspace(s) ? kLtWorkspaceBudget : kLtWorkspaceMin;
  const BwdLayout fixed = bwd_layout(s, lt, 0);
  if (fixed.total == kHuge || fixed.total > workspace_bytes) return false;  // not reached
  const size_t scratch = (workspace_bytes - fixed.total) / kAlign * kAlign;
  const size_t col_bytes = std::max<size_t>(1, sat_mul(static_cast<size_t>(s.rows), s.elem));
  int64_t cols = static_cast<int64_t>(std::min<size_t>(static_cast<size_t>(s.cols_padded),
                                                       scratch / col_bytes / kVocabPad * kVocabPad));
  if (cols < kVocabPad) return false;  // not reached: the minimum holds 64 columns
  cols = linear::balanced(s.cols, cols, kVocabPad);
  out->slice_cols = cols;
  out->slices = (s.cols + cols - 1) / cols;
  out->lt_bytes = lt;
  out->layout = bwd_layout(s, lt, slice_bytes(s, cols));
  return true;
}

bool fused_plan(const CeOptions& opt, int64_t ranks, int64_t rows, int64_t hidden,
                int64_t plan_width, int64_t width, bool need_dw, bool dw_fp32,
                size_t workspace_bytes, FusedPlan* out) {
  const size_t n = static_cast<size_t>(rows);
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t off = at;
    at = sat_add(at, sat_round(bytes));
    return off;
  };
  out->own = take(sat_mul(n, FCE_VP_STATS * 4));
  out->gathered = take(sat_mul(sat_mul(n, static_cast<size_t>(ranks)), FCE_VP_STATS * 4));
  out->rowstats = take(sat_mul(n, sizeof(CeRowStats)));
  out->lin_at = at;
  const linear::Sizes ps = linear::sizes_of(opt, rows, hidden, plan_width, true);
  const linear::Mode mode =
      (need_dw && !dw_fp32) ? linear::Mode::kChunked16 : linear::Mode::kChunked;
  const size_t full = linear::optimal_workspace(ps, need_dw, dw_fp32);
  out->threshold = kHuge;
  out->total = kHuge;
  // the plan of the full-speed size, whatever the workspace beyond it: the same on every rank;
  // the threshold is what that plan takes for a shard plan_width wide (plan_mode may give it a
  // smaller cuBLASLt workspace than optimal_workspace assumed: never above full)
  linear::Plan p;
  if (full == kHuge || !linear::plan_mode(ps, mode, full, &p)) return false;
  out->threshold = sat_add(at, p.layout.total);
  if (out->threshold == kHuge || workspace_bytes < out->threshold) return false;
  const linear::Sizes ls = linear::sizes_of(opt, rows, hidden, width, true);
  p.layout = linear::layout_of(ls, p.chunk_rows, p.lt_bytes);
  out->lin = p;
  out->total = sat_add(at, p.layout.total);
  return true;
}

}  // namespace vp_plan
}  // namespace cuda

void cuda_vp_linear_workspace_size(const CeOptions& opt, int64_t /*ranks*/, int64_t rows,
                                   int64_t hidden, int64_t /*vocab_total*/, int64_t vocab_local,
                                   bool backward, int grad_hidden_dtype, bool /*grad_weight_fp32*/,
                                   size_t* min_bytes, size_t* optimal_bytes) {
  using namespace cuda;
  using namespace cuda::vp_plan;
  size_t lo, full;
  if (!backward) {
    const linear::Sizes s = stats_sizes(opt, rows, hidden, vocab_local);
    lo = linear::min_workspace(s, false, true);
    full = linear::optimal_workspace(s, false, true);
  } else {
    const BwdSizes s = bwd_sizes(opt, rows, hidden, vocab_local, grad_hidden_dtype);
    lo = bwd_min_workspace(s);
    full = bwd_optimal_workspace(s);
  }
  if (min_bytes) *min_bytes = lo;
  if (optimal_bytes) *optimal_bytes = std::max(lo, full);
}

#if defined(FCE_VP_SELFTEST)
namespace cuda {
// Host self-check of the phase-3 plan arithmetic (build with -DFCE_VP_SELFTEST; no GPU): for many
// sizes, the query's minimum has a plan and one byte less has none; at the minimum, the
// full-speed size and sizes between, every slice of the workspace (from the worst-case aligned
// base) ends inside workspace_bytes, the slices cover the shard in multiples of 64 columns, and
// the full-speed size gets the full-speed slices. Phase 1: linear_ce's loss-only plan exists at
// its own minimum. fce_vp_linear_ce's token-chunk plan: at the plan width its need is its
// threshold, the plan at the threshold is the full-speed one, one byte less has none. Returns
// the number of failures (each printed).
int vp_linear_selftest() {
  using namespace vp_plan;
  int failures = 0;
  auto bad = [&](const char* what, int64_t N, int64_t D, int64_t Vs, int dt, int gh, size_t ws) {
    if (failures++ < 20)
      std::fprintf(stderr, "vp_linear_selftest: %s (N %lld, D %lld, Vs %lld, dtype %d, gh %d, ws %zu)\n",
                   what, (long long)N, (long long)D, (long long)Vs, dt, gh, ws);
  };
  const int64_t Ns[] = {1, 7, 128, 1000, 8192, 32896, 65536, 66048};
  const int64_t Ds[] = {1, 16, 4096};
  const int64_t Vss[] = {1, 63, 64, 65, 97, 1000, 16032, 32000, 32064, 64128, 128256};
  for (int dt : {int(FCE_FLOAT32), int(FCE_FLOAT16), int(FCE_BFLOAT16)})
    for (int gh : {int(FCE_FLOAT32), dt})
      for (int64_t N : Ns)
        for (int64_t D : Ds)
          for (int64_t Vs : Vss) {
            CeOptions opt{};
            opt.dtype = dt;
            opt.reduction = FCE_REDUCTION_MEAN;
            size_t mn = 0, op = 0;
            cuda_vp_linear_workspace_size(opt, 2, N, D, Vs * 2, Vs, true, gh, false, &mn, &op);
            const BwdSizes s = bwd_sizes(opt, N, D, Vs, gh);
            BwdPlan plan;
            if (mn > op) bad("min above optimal", N, D, Vs, dt, gh, mn);
            if (bwd_plan(s, mn - 1, &plan)) bad("a plan below the minimum", N, D, Vs, dt, gh, mn - 1);
            const size_t sizes[] = {mn, mn + 4096, (mn + op) / 2, op - 1, op, op + (size_t(3) << 30)};
            for (size_t ws : sizes) {
              if (ws < mn) continue;
              if (!bwd_plan(s, ws, &plan)) {
                bad("no plan at or above the minimum", N, D, Vs, dt, gh, ws);
                continue;
              }
              const BwdLayout& L = plan.layout;
              const size_t slack = kAlign - 16;  // the worst 16-byte aligned caller pointer
              const size_t z_end = L.z + slice_bytes(s, plan.slice_cols);
              if (L.total > ws || slack + z_end > ws || L.lt + plan.lt_bytes > L.z)
                bad("a slice past workspace_bytes", N, D, Vs, dt, gh, ws);
              if (plan.slice_cols < kVocabPad || plan.slice_cols % kVocabPad ||
                  plan.slices * plan.slice_cols < Vs || (plan.slices - 1) * plan.slice_cols >= Vs)
                bad("slices do not cover the shard", N, D, Vs, dt, gh, ws);
              if (ws >= op && (plan.slice_cols < full_speed_cols(s) || plan.lt_bytes != kLtWorkspaceBudget))
                bad("full-speed workspace without full-speed slices", N, D, Vs, dt, gh, ws);
            }
            // fce_vp_linear_ce's token-chunk plan: for a shard of the plan width, what it needs
            // is its threshold (so optimal_bytes runs it on every rank), one byte less runs the
            // gather-once plan, and the chunks cover the rows
            for (bool need_dw : {true, false}) {
              const bool fp32 = dt == FCE_FLOAT32;
              FusedPlan fp, at, below;
              if (!fused_plan(opt, 2, N, D, Vs, Vs, need_dw, fp32, kHuge, &fp)) continue;
              if (fp.total != fp.threshold || !fused_plan(opt, 2, N, D, Vs, Vs, need_dw, fp32,
                                                          fp.threshold, &at) ||
                  at.total != fp.threshold || at.lin.chunk_rows != fp.lin.chunk_rows ||
                  fused_plan(opt, 2, N, D, Vs, Vs, need_dw, fp32, fp.threshold - 1, &below))
                bad("fused plan: threshold, need and plan disagree", N, D, Vs, dt, gh, fp.threshold);
              if (fp.lin.chunks * fp.lin.chunk_rows < N ||
                  (fp.lin.chunks - 1) * fp.lin.chunk_rows >= N)
                bad("fused plan: chunks do not cover the rows", N, D, Vs, dt, gh, fp.total);
            }
            size_t smn = 0, sop = 0;
            cuda_vp_linear_workspace_size(opt, 2, N, D, Vs * 2, Vs, false, gh, false, &smn, &sop);
            linear::Plan lp;
            const linear::Sizes ls = stats_sizes(opt, N, D, Vs);
            if (smn > sop || !linear::plan_mode(ls, linear::Mode::kChunked, smn, &lp) ||
                lp.layout.total > smn || !linear::plan_mode(ls, linear::Mode::kChunked, sop, &lp))
              bad("phase 1: no plan at the query's sizes", N, D, Vs, dt, gh, smn);
          }
  return failures;
}
}  // namespace cuda
#endif

}  // namespace fce
