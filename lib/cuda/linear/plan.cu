// linear/plan.cu — the workspace arithmetic of fce_linear_ce's CUDA plans (the plans themselves
// are described at the top of linear/linear_ce.cu): which plan (kChunked, kChunked16, kVocabSliced) a
// call runs in its workspace, with how many rows per token chunk or columns per slice, and where
// each slice of the workspace lies; the workspace-size query. A function of the sizes, the options,
// which gradients are asked for and workspace_bytes only (bitwise deterministic results for a
// given workspace size). Host code only, no CUDA calls: the vocabulary-parallel plans
// (vocab_parallel/linear_plan.cu) build on it, and their host self-test (CudaVpLinearSelftest) links it alone.
#include <algorithm>
#include <cstdint>

#include "cuda/common/knobs.h"
#include "cuda/linear/plan.cuh"
#include "internal.h"

namespace fce {
namespace cuda {
namespace linear {

// The constants, the saturating size arithmetic, balanced(), and the Sizes / Layout / Mode /
// Plan types are in linear_plan.cuh (vp_linear_plan.cu plans with them too).
// (Version 0.1 also had a float32 [V, D] ∂W accumulator in the workspace, V·D·4 bytes: 2 GiB at
// 128256×4096, more than the logits it saves. Gone: no plan allocates anything of size [V, D].)

Sizes sizes_of(const CeOptions& opt, int64_t rows, int64_t hidden, int64_t vocab, bool with_grad) {
  Sizes s;
  s.rows = rows;
  s.hidden = hidden;
  s.vocab = vocab;
  s.vocab_padded = (vocab + kVocabPad - 1) / kVocabPad * kVocabPad;
  s.elem = dtype_size(opt.dtype);
  s.reduction_none = opt.reduction == FCE_REDUCTION_NONE;
  s.with_grad = with_grad;
  s.invariant = opt.batch_invariant;
  return s;
}

// The slices of every plan; z_bytes is the logits scratch. `sliced` adds the vocab-sliced
// plan's row statistics [N] (m, log s, t: CeRowStats) and float32 ∂h accumulator [N, D] (the
// latter unless dtype is float32: then grad_hidden itself accumulates).
Layout layout_bytes(const Sizes& s, size_t z_bytes, size_t lt_bytes, bool sliced,
                    int64_t fixed_rows = 0) {
  Layout l;
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    size_t off = at;
    at = sat_add(at, sat_round(bytes));
    return off;
  };
  const size_t rows = static_cast<size_t>(s.rows), vocab = static_cast<size_t>(s.vocab);
  l.denoms = take(sizeof(CeDenoms));
  l.row_loss = take(s.reduction_none ? 0 : sat_mul(rows, 4));
  l.row_zloss = take(sat_mul(rows, 4));
  l.row_correct = take(s.reduction_none ? 0 : sat_mul(rows, 4));  // for options->accuracy
  l.bias = take(sat_mul(vocab, s.elem));             // the bias in dtype (if any)
  l.db = take(s.with_grad ? sat_mul(vocab, 4) : 0);  // ∂b accumulator (if needed)
  l.stats = take(sliced ? sat_mul(rows, sizeof(CeRowStats)) : 0);
  l.dh = take(sliced && s.with_grad
                  ? sat_mul(sat_mul(rows, static_cast<size_t>(s.hidden)), 4) : 0);
  l.lt = take(lt_bytes);
  l.z = take(z_bytes);                               // Z_c, then ∂Z_c in place
  const size_t fixed =
      sat_mul(sat_mul(static_cast<size_t>(fixed_rows), static_cast<size_t>(s.hidden)), s.elem);
  l.h_fixed = take(fixed);
  l.dh_fixed = take(s.with_grad ? fixed : 0);
  l.total = sat_add(at, kAlign);
  return l;
}

size_t chunk_bytes(const Sizes& s, int64_t chunk_rows) {
  return sat_mul(sat_mul(static_cast<size_t>(chunk_rows), static_cast<size_t>(s.vocab_padded)),
                 s.elem);
}

Layout layout_of(const Sizes& s, int64_t chunk_rows, size_t lt_bytes) {
  return layout_bytes(s, chunk_bytes(s, chunk_rows), lt_bytes, false);
}

bool fits(const Layout& l, size_t workspace_bytes) {
  return l.total != kHuge && l.total <= workspace_bytes;
}

// The workspace of a chunk of `rows` rows, the ∂W accumulator aside, is within kChunkBudget.
bool in_budget(const Sizes& s, int64_t rows, size_t lt_bytes) {
  return fits(layout_of(s, rows, lt_bytes), kChunkBudget);
}

// The most rows (a multiple of 128, or all N) whose chunk stays within kChunkBudget with
// kLtWorkspaceBudget for cuBLASLt, at most `cap`; 0 when not even 128 rows do.
int64_t budget_rows(const Sizes& s, int64_t cap) {
  cap = std::min(s.rows, cap);
  if (in_budget(s, cap, kLtWorkspaceBudget)) return cap;
  int64_t lo = 0, hi = cap / kRowQuantum;  // in quanta of 128 rows; 0 = none fits
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (in_budget(s, mid * kRowQuantum, kLtWorkspaceBudget)) lo = mid; else hi = mid - 1;
  }
  return lo * kRowQuantum;
}

// The rows of the full-speed chunk (kChunked): the largest multiple of 128 that
// stays in budget with kLtWorkspaceBudget for cuBLASLt, at most min(N, 4096) (then all of it if
// that fits), at least min(N, 1024). A function of the sizes only.
int64_t full_speed_rows(const Sizes& s) {
  return std::max(std::min(s.rows, kFullSpeedRows), budget_rows(s, kMaxChunkRows));
}

// The most chunks a 16-bit grad_weight may be summed over (the rule at kMaxChunks16).
int64_t max_chunks16(int64_t rows, int64_t vocab) {
  if (rows <= 0) return 1;
  return std::max<int64_t>(1, std::min<int64_t>(kMaxChunks16, 3 * vocab / rows));
}

// The fewest rows a kChunked16 chunk may have: at most max_chunks16 chunks.
int64_t min_rows16(const Sizes& s) {
  const int64_t k = max_chunks16(s.rows, s.vocab);
  const int64_t even = (s.rows + k - 1) / k;
  return std::min(s.rows, std::max(kMinChunkRows, (even + kRowQuantum - 1) / kRowQuantum * kRowQuantum));
}

// The cuBLASLt workspace of a plan of `rows` rows: the largest size that fits workspace_bytes
// and, when the chunk is within the budget at the smallest size, keeps it within the budget.
size_t lt_bytes_for(const Sizes& s, int64_t rows, size_t workspace_bytes) {
  const bool budgeted = in_budget(s, rows, kLtWorkspaceMin);
  for (size_t lt : kLtWorkspaceSizes)
    if (fits(layout_of(s, rows, lt), workspace_bytes) && (!budgeted || in_budget(s, rows, lt)))
      return lt;
  return kLtWorkspaceMin;  // the caller checked that rows fit with it
}

// The plan of one token-chunk mode in workspace_bytes, or false when even its smallest chunk
// does not fit.
bool plan_mode(const Sizes& s, Mode mode, size_t workspace_bytes, Plan* out) {
  const int64_t min_rows = mode == Mode::kChunked16 ? min_rows16(s) : std::min(s.rows, kMinChunkRows);
  const int64_t max_rows = mode == Mode::kChunked16 ? s.rows : full_speed_rows(s);
  if (!fits(layout_of(s, min_rows, kLtWorkspaceMin), workspace_bytes)) return false;
  // The most rows that fit (rows first: each chunk costs a pass over W and, with a float32 ∂W,
  // a read-modify-write of it; cuBLASLt's share shrinks second): layout_of grows with the rows,
  // so bisect [min_rows, max_rows].
  int64_t lo = min_rows, hi = max_rows;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(layout_of(s, mid, kLtWorkspaceMin), workspace_bytes)) lo = mid; else hi = mid - 1;
  }
  int64_t rows = lo;
  // Several chunks (then rows ≥ 128): a multiple of 128, balanced.
  if (rows < s.rows) rows = balanced(s.rows, rows / kRowQuantum * kRowQuantum, kRowQuantum);
  const size_t lt = lt_bytes_for(s, rows, workspace_bytes);
  out->mode = mode;
  out->chunk_rows = rows;
  out->chunks = (s.rows + rows - 1) / rows;
  out->slice_cols = out->slices = 0;
  out->lt_bytes = lt;
  out->layout = layout_of(s, rows, lt);
  return true;
}

// The vocab-sliced plan: whatever the fixed slices leave of workspace_bytes is the logits
// scratch, holding a chunk of rows × all V in the lse pass and all N rows × a column slice in
// the gradient pass. cuBLASLt gets 16 MiB when the workspace is at least 256 MiB, else 4 MiB.
size_t sliced_min_scratch(const Sizes& s) {
  return sat_round(std::max(chunk_bytes(s, std::min(s.rows, kMinSliceRows)),
                            sat_mul(sat_mul(static_cast<size_t>(s.rows), kVocabPad), s.elem)));
}

size_t sliced_min_workspace(const Sizes& s) {
  return sat_add(layout_bytes(s, 0, kLtWorkspaceMin, true).total, sliced_min_scratch(s));
}

bool plan_sliced(const Sizes& s, size_t workspace_bytes, Plan* out) {
  const size_t lt = workspace_bytes >= sat_add(sliced_min_workspace(s), size_t(256) << 20)
                       ? kLtWorkspaceBudget : kLtWorkspaceMin;
  const Layout fixed = layout_bytes(s, 0, lt, true);
  if (fixed.total == kHuge || fixed.total > workspace_bytes) return false;
  const size_t scratch = (workspace_bytes - fixed.total) / kAlign * kAlign;
  if (scratch < sliced_min_scratch(s)) return false;
  const size_t row_bytes = static_cast<size_t>(s.vocab_padded) * s.elem;
  int64_t rows = static_cast<int64_t>(std::min<size_t>(static_cast<size_t>(s.rows), scratch / row_bytes));
  if (rows < s.rows)
    rows = rows >= kRowQuantum ? balanced(s.rows, rows / kRowQuantum * kRowQuantum, kRowQuantum)
                               : balanced(s.rows, rows / kMinSliceRows * kMinSliceRows, kMinSliceRows);
  const size_t col_bytes = static_cast<size_t>(s.rows) * s.elem;
  int64_t cols = static_cast<int64_t>(std::min<size_t>(static_cast<size_t>(s.vocab_padded),
                                                       scratch / col_bytes / kVocabPad * kVocabPad));
  cols = balanced(s.vocab, cols, kVocabPad);
  out->mode = Mode::kVocabSliced;
  out->chunk_rows = rows;
  out->chunks = (s.rows + rows - 1) / rows;
  out->slice_cols = cols;
  out->slices = (s.vocab + cols - 1) / cols;
  out->lt_bytes = lt;
  out->layout = layout_bytes(s, std::max(chunk_bytes(s, rows),
                                         sat_mul(sat_mul(static_cast<size_t>(s.rows),
                                                         static_cast<size_t>(cols)), s.elem)),
                             lt, true);
  return true;
}

// options->batch_invariant: chunks of invariant_rows rows whatever N and the workspace, the
// GEMMs given all of them (linear_ce.cu pads the last one), cuBLASLt kLtWorkspaceBudget.
int64_t invariant_rows(const Sizes& s) {
  const size_t row = std::max<size_t>(1, sat_mul(static_cast<size_t>(s.vocab_padded), s.elem));
  const int64_t fit = static_cast<int64_t>(std::min<size_t>(kChunkBudget / 2 / row, 1 << 20));
  return std::max(kRowQuantum, std::min(kFullSpeedRows, fit / kRowQuantum * kRowQuantum));
}

Layout invariant_layout(const Sizes& s) {
  const int64_t rows = invariant_rows(s);
  return layout_bytes(s, chunk_bytes(s, rows), kLtWorkspaceBudget, false, rows);
}

bool plan_invariant(const Sizes& s, bool need_dw, bool dw_fp32, size_t workspace_bytes, Plan* out) {
  const Layout l = invariant_layout(s);
  if (!fits(l, workspace_bytes)) return false;
  out->mode = need_dw && !dw_fp32 ? Mode::kChunked16 : Mode::kChunked;
  out->chunk_rows = invariant_rows(s);
  out->chunks = (s.rows + out->chunk_rows - 1) / out->chunk_rows;
  out->slice_cols = out->slices = 0;
  out->lt_bytes = kLtWorkspaceBudget;
  out->layout = l;
  return true;
}

// need_dw: grad_weight is asked for; dw_fp32: it is float32 (grad_weight_fp32 or dtype f32).
// A float32 ∂W (or none) accumulates over token chunks at any workspace. A 16-bit ∂W, in order
// of preference: token chunks accumulated in grad_weight (≤ max_chunks16 roundings; one chunk
// when all rows fit), then the vocab-sliced plan (8·N·D·V, one rounding, any workspace from a
// few MiB). FCE_LINEAR_CE_PLAN=sliced (common/knobs.h) takes the vocab-sliced plan whenever it
// fits: the tests use it to run that plan at any size; it changes which plan runs, never the
// promises.
bool choose_plan(const Sizes& s, bool need_dw, bool dw_fp32, size_t workspace_bytes, Plan* out) {
  if (s.invariant) return plan_invariant(s, need_dw, dw_fp32, workspace_bytes, out);
  if (!need_dw || dw_fp32)  // (the vocab-sliced plan as well when even 128 rows do not fit)
    return plan_mode(s, Mode::kChunked, workspace_bytes, out) ||
           (s.with_grad && !dw_fp32 && plan_sliced(s, workspace_bytes, out));
  if (knobs().linear_sliced && plan_sliced(s, workspace_bytes, out)) return true;
  if (plan_mode(s, Mode::kChunked16, workspace_bytes, out)) return true;
  return plan_sliced(s, workspace_bytes, out);
}

// The smallest workspace in which a call with these gradients (any subset of them, for
// with_grad: grad_weight or not) has a plan.
size_t min_workspace(const Sizes& s, bool need_dw, bool dw_fp32) {
  if (s.invariant) return invariant_layout(s).total;
  const int64_t few = std::min(s.rows, kMinChunkRows);
  const size_t chunked = layout_of(s, few, kLtWorkspaceMin).total;
  if (!need_dw || dw_fp32) return chunked;
  const size_t sliced = sliced_min_workspace(s);
  const size_t with_dw = std::min(layout_of(s, min_rows16(s), kLtWorkspaceMin).total, sliced);
  const size_t without_dw = std::min(chunked, sliced);  // grad_hidden / grad_bias only
  return std::max(with_dw, without_dw);
}

// The workspace of the full-speed plan: kChunked with full-speed chunks; for a 16-bit ∂W,
// kChunked16 with chunks as large as the 1 GiB budget allows, but at most max_chunks16 of them.
size_t optimal_workspace(const Sizes& s, bool need_dw, bool dw_fp32) {
  if (s.invariant) return invariant_layout(s).total;
  if (!need_dw || dw_fp32) {
    Plan p;
    return plan_mode(s, Mode::kChunked, kHuge - 1, &p) ? p.layout.total : kHuge;
  }
  const int64_t rows = std::max(min_rows16(s), budget_rows(s, s.rows));
  const int64_t r = rows < s.rows ? balanced(s.rows, rows, kRowQuantum) : rows;
  const size_t lt = in_budget(s, r, kLtWorkspaceFull) ? kLtWorkspaceFull : kLtWorkspaceBudget;
  return layout_of(s, r, lt).total;
}

}  // namespace linear
}  // namespace cuda

void cuda_linear_ce_workspace_size(const CeOptions& opt, int64_t rows, int64_t hidden,
                                   int64_t vocab, bool with_grad, bool grad_weight_fp32,
                                   size_t* min_bytes, size_t* optimal_bytes) {
  using namespace cuda;
  using namespace cuda::linear;
  // The worst case of the gradients a call with these options may ask for: all of them.
  // optimal_bytes: the full-speed plan (optimal_workspace), never below min_bytes.
  const Sizes s = sizes_of(opt, rows, hidden, vocab, with_grad);
  const bool dw_fp32 = grad_weight_fp32 || opt.dtype == FCE_FLOAT32;
  const size_t lo = min_workspace(s, with_grad, dw_fp32);
  if (min_bytes) *min_bytes = lo;
  if (optimal_bytes) *optimal_bytes = std::max(lo, optimal_workspace(s, with_grad, dw_fp32));
}

}  // namespace fce
