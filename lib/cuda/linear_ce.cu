// linear_ce.cu — fce_linear_ce on CUDA: z = h·Wᵀ + b, cross-entropy, and ∂h, ∂W, ∂b, without
// ever holding all of z (SPEC.md "fce_linear_ce", SEMANTICS.md rule 13).
//
// Token chunks of Nc rows (the 6·N·D·V algorithm of shared/PERF.md). For each chunk c:
//   1. Z_c = h_c·Wᵀ (+ b)       cuBLASLt, float32 accumulation, written to [Nc, V] in the
//                               workspace IN THE DTYPE (f16/bf16; float32 for FCE_FLOAT32), one
//                               rounding. The bias rides the BIAS epilogue in the D type (a copy
//                               in the workspace), added to the float32 accumulator before it
//                               is rounded.
//   2. CE pass                  launch_ce_rows (ce_rows.cuh) on Z_c, float32 math inside: row
//                               losses, lse, and ∂Z_c written IN PLACE over Z_c (same dtype,
//                               same stride: ce_rows.cuh allows grad == logits)
//   3. ∂h_c = ∂Z_c·W            one GEMM over K = V, written straight into grad_hidden
//   4. ∂W (+)= ∂Z_cᵀ·h_c        see the plans below
//   5. ∂b (+)= colsum(∂Z_c)     fixed-order column sums in float32
// then the fixed-order loss reduction (launch_ce_finalize). Loss only: steps 1, 2 (forward).
//
// Precision of f16/bf16 (version 2; version 1 kept a float32 Z_c): the logits are exactly torch
// eager's — F.linear in bf16 returns z rounded once to bf16 from a float32 accumulation, and
// so does step 1 (bias included, the same cuBLASLt epilogue). Everything after is float32 math
// on those 16-bit logits (torch eager's cross_entropy on bf16 logits even rounds its
// log-softmax to bf16; we do not), and ∂Z_c is rounded once to the dtype, as before. Each logit
// carries a relative error ≤ u (2^-8 bf16, 2^-11 f16), so p and the loss move by ≤ 2u·max|z|
// relative: tests/test_linear_ce.cpp's bound u·(4 + 2·max|z|), SPEC's "at least as close as
// torch eager in the dtype" (f16 logits beyond ±65504 become ±inf, as torch's do). FCE_FLOAT32
// keeps float32 logits (SPEC's 1e-5).
// Bytes: a chunk row is V·e of scratch (e = 2 for f16/bf16: 250 KB at V = 128256, was V·6 with
// a float32 Z_c + a separate 16-bit ∂Z_c), and the CE pass moves 2e = 4 bytes per logit (was 6).
//
// Plans, by workspace size (choose_plan; the query returns the smallest and the full-speed one).
// Token-chunk plans (6·N·D·V) take chunks of Nc rows, as many as fit the workspace (multiples
// of 128, balanced); a chunk row is V·e bytes (250 KB at V = 128256 bf16).
//   kChunked      loss only, or a float32 ∂W (grad_weight_fp32 or dtype f32: the caller's
//                 float32 grad_weight is the accumulator, beta = 1 after the first chunk), or
//                 no grad_weight. Full speed: Nc ≤ 4096 within kChunkBudget = 1 GiB.
//   kChunked16    f16/bf16 ∂W accumulated in grad_weight itself (beta = 1 after the first
//                 chunk): one rounding per chunk, so at most kMaxChunks16 chunks (one chunk when
//                 all rows fit: ∂W is then one GEMM over all N rows, one rounding). Full speed:
//                 chunks as large as 1 GiB holds (fewer roundings), at most kMaxChunks16 of them.
//                 No [V, D] float32 buffer anywhere: at 8192×4096×128256 bf16 two chunks of
//                 4096 rows in 1.0 GiB.
//   kVocabSliced  f16/bf16 ∂W in any workspace too small for kChunked16 (down to a few MiB), 8·N·D·V: a first
//                 pass over token chunks for the loss and lse (2·N·D·V), then per slice of Vc
//                 columns for all N rows: Z_s = h·W_sᵀ (+ b_s), ∂Z_s from the saved lse in place
//                 (the backward kernel on a column slice), ∂W_s = ∂Z_sᵀ·h in ONE GEMM over all N
//                 rows (one rounding), ∂h += ∂Z_s·W_s into a float32 [N, D] accumulator (128 MiB
//                 at N = 8192, D = 4096; extra to the scratch), ∂b_s by column sums. The logits
//                 scratch holds max(Nc·V, N·Vc) elements.
// Determinism: the plan (mode, Nc, cuBLASLt workspace) is a function of the sizes, the options,
// which gradients are asked for, and workspace_bytes only, and every step has a fixed order
// (cuBLASLt picks one algorithm per shape and alignment; no atomics), so for a given workspace
// size the results are bitwise identical run to run. Different workspace sizes change only the
// float32 rounding order (of the ∂W/∂b chunk sums, and cuBLASLt's algorithm for another Nc).
//
// No allocation, no synchronisation, one stream: everything is carved from the caller's
// workspace (256-byte aligned) and enqueued on p.stream, so the call is graph-capturable once
// the device's cuBLASLt handle exists (created on the first call on that device).
//
// Shared with the vocabulary-parallel linear calls (vp_linear.cu) through linear_plan.cuh: the
// plan arithmetic (namespace linear), logits_gemm (step 1 / a) and slice_pass (the vocab-sliced
// plan's gradient pass, steps a-e below), which this file runs as it always did.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cuda/ce_rows.cuh"
#include "cuda/device_pointers.cuh"
#include "cuda/gemm.cuh"
#include "cuda/linear_kernels.cuh"
#include "cuda/linear_plan.cuh"
#include "internal.h"

namespace fce {
namespace cuda {
namespace linear {

// The constants, the saturating size arithmetic, balanced(), and the Sizes / Layout / Mode /
// Plan types are in linear_plan.cuh (vp_linear.cu plans with them too).
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
  return s;
}

// The slices of every plan; z_bytes is the logits scratch. `sliced` adds the vocab-sliced
// plan's row statistics [N] (m, log s, t: CeRowStats) and float32 ∂h accumulator [N, D] (the
// latter unless dtype is float32: then grad_hidden itself accumulates).
Layout layout_bytes(const Sizes& s, size_t z_bytes, size_t lt_bytes, bool sliced) {
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

// The fewest rows a kChunked16 chunk may have: at most kMaxChunks16 chunks.
int64_t min_rows16(const Sizes& s) {
  const int64_t even = (s.rows + kMaxChunks16 - 1) / kMaxChunks16;
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

// need_dw: grad_weight is asked for; dw_fp32: it is float32 (grad_weight_fp32 or dtype f32).
// A float32 ∂W (or none) accumulates over token chunks at any workspace. A 16-bit ∂W, in order
// of preference: token chunks accumulated in grad_weight (≤ kMaxChunks16 roundings; one chunk
// when all rows fit), then the vocab-sliced plan (8·N·D·V, one rounding, any workspace from a
// few MiB). FCE_LINEAR_CE_PLAN=sliced in the environment (read on every call) takes the
// vocab-sliced plan whenever it fits: the tests and benchmarks use it to run that plan at any
// size; it changes which plan runs, never the promises.
bool force_sliced() {
  const char* v = std::getenv("FCE_LINEAR_CE_PLAN");
  return v && std::strcmp(v, "sliced") == 0;
}

bool choose_plan(const Sizes& s, bool need_dw, bool dw_fp32, size_t workspace_bytes, Plan* out) {
  if (!need_dw || dw_fp32)  // (the vocab-sliced plan as well when even 128 rows do not fit)
    return plan_mode(s, Mode::kChunked, workspace_bytes, out) ||
           (s.with_grad && !dw_fp32 && plan_sliced(s, workspace_bytes, out));
  if (force_sliced() && plan_sliced(s, workspace_bytes, out)) return true;
  if (plan_mode(s, Mode::kChunked16, workspace_bytes, out)) return true;
  return plan_sliced(s, workspace_bytes, out);
}

// The smallest workspace in which a call with these gradients (any subset of them, for
// with_grad: grad_weight or not) has a plan.
size_t min_workspace(const Sizes& s, bool need_dw, bool dw_fp32) {
  const int64_t few = std::min(s.rows, kMinChunkRows);
  const size_t chunked = layout_of(s, few, kLtWorkspaceMin).total;
  if (!need_dw || dw_fp32) return chunked;
  const size_t sliced = sliced_min_workspace(s);
  const size_t with_dw = std::min(layout_of(s, min_rows16(s), kLtWorkspaceMin).total, sliced);
  const size_t without_dw = std::min(chunked, sliced);  // grad_hidden / grad_bias only
  return std::max(with_dw, without_dw);
}

// The workspace of the full-speed plan: kChunked with full-speed chunks; for a 16-bit ∂W,
// kChunked16 with chunks as large as the 1 GiB budget allows, but at most kMaxChunks16 of them.
size_t optimal_workspace(const Sizes& s, bool need_dw, bool dw_fp32) {
  if (!need_dw || dw_fp32) {
    Plan p;
    return plan_mode(s, Mode::kChunked, kHuge - 1, &p) ? p.layout.total : kHuge;
  }
  const int64_t rows = std::max(min_rows16(s), budget_rows(s, s.rows));
  const int64_t r = rows < s.rows ? balanced(s.rows, rows, kRowQuantum) : rows;
  const size_t lt = in_budget(s, r, kLtWorkspaceFull) ? kLtWorkspaceFull : kLtWorkspaceBudget;
  return layout_of(s, r, lt).total;
}


fce_status logits_gemm(int dtype, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda,
                       const void* W, const void* bias, void* Z, int64_t ldz, void* lt_ws,
                       size_t lt_bytes, cudaStream_t s) {
  RowMajorGemm g{};
  g.name = "logits (hidden · weightᵀ + bias)";
  g.M = M; g.N = N; g.K = K;
  g.A = A; g.lda = lda; g.trans_a = false;
  g.B = W; g.ldb = K; g.trans_b = true;
  g.ab_dtype = dtype;
  g.C = Z; g.ldc = ldz; g.c_dtype = dtype;
  g.alpha = 1.f; g.beta = 0.f;
  g.bias = bias;
  g.workspace = lt_ws; g.workspace_bytes = lt_bytes;
  bool bias_applied = false;
  FCE_TRY(gemm(g, s, &bias_applied));
  // No algorithm fuses the bias for this shape: add it in a second pass (for f16/bf16 Z that
  // is a second rounding, the one place the 16-bit logits are not torch's bit for bit).
  if (bias && !bias_applied) FCE_TRY(launch_add_bias_rows(Z, dtype, M, N, ldz, bias, s));
  return FCE_SUCCESS;
}

fce_status slice_pass(const SlicePass& sp, cudaStream_t stream) {
  const CeOptions& opt = sp.opt;
  const int dtype = opt.dtype;
  const size_t e = dtype_size(dtype);
  const int64_t N = sp.rows, D = sp.hidden, hs = sp.hidden_row_stride, V = sp.cols;
  const char* hidden = static_cast<const char*>(sp.hidden_states);
  void* z = sp.z;
  for (int64_t sl = 0; sl < sp.slices; ++sl) {
    const int64_t v0 = sl * sp.slice_cols;
    const int64_t vc = std::min(sp.slice_cols, V - v0);
    const int64_t lds = sp.slice_cols;
    const bool first = sl == 0;
    const char* w_s = static_cast<const char*>(sp.weight) + static_cast<size_t>(v0) * D * e;
    const void* b_s = sp.bias ? static_cast<const char*>(sp.bias) + static_cast<size_t>(v0) * e
                              : nullptr;

    // a. Z_s[N, vc] = h · W_sᵀ + b_s   (computed again: cuBLASLt may pick another algorithm
    //    for this shape than for the lse pass, so a logit may differ from it by a rounding)
    FCE_TRY(logits_gemm(dtype, N, vc, D, hidden, hs, w_s, b_s, z, lds, sp.lt_ws, sp.lt_bytes,
                        stream));

    // b. ∂Z_s from the saved row statistics, in place (the backward kernel on a column slice)
    CeRowsArgs a{};
    a.opt = opt;
    a.vocab = vc;
    a.vocab_total = sp.vocab_total;
    a.col_begin = sp.col_offset + v0;
    a.total_rows = N;
    a.row_begin = 0;
    a.row_count = N;
    a.logits = z;
    a.logits_dtype = dtype;
    a.row_stride = lds;
    a.grad = z;
    a.grad_dtype = dtype;
    a.grad_row_stride = lds;
    a.targets = sp.targets;
    a.denoms = sp.denoms;
    a.grad_output = sp.grad_output;
    a.stats_in = sp.stats;
    a.error_flags = nullptr;  // the lse pass has flagged invalid targets already
    FCE_TRY(launch_ce_rows(a, stream));
    if (sp.fix_dz) FCE_TRY(sp.fix_dz(sp.fix_ctx, z, N, vc, lds, stream));

    // c. ∂W_s[vc, D] = ∂Z_sᵀ · h over all N rows: one GEMM, one rounding
    if (sp.grad_weight) {
      RowMajorGemm gw{};
      gw.name = "grad_weight (dZᵀ · hidden)";
      gw.M = vc; gw.N = D; gw.K = N;
      gw.A = z; gw.lda = lds; gw.trans_a = true;
      gw.B = hidden; gw.ldb = hs; gw.trans_b = false;
      gw.ab_dtype = dtype;
      gw.C = static_cast<char*>(sp.grad_weight) +
             static_cast<size_t>(v0) * D * dtype_size(sp.grad_weight_dtype);
      gw.ldc = D; gw.c_dtype = sp.grad_weight_dtype;
      gw.alpha = 1.f; gw.beta = sp.accumulate ? 1.f : 0.f;
      gw.workspace = sp.lt_ws; gw.workspace_bytes = sp.lt_bytes;
      FCE_TRY(gemm(gw, stream, nullptr));
    }

    // d. ∂h[N, D] (+)= ∂Z_s · W_s   (float32 accumulation across slices)
    if (sp.dh) {
      RowMajorGemm gh{};
      gh.name = "grad_hidden (dZ · weight)";
      gh.M = N; gh.N = D; gh.K = vc;
      gh.A = z; gh.lda = lds; gh.trans_a = false;
      gh.B = w_s; gh.ldb = D; gh.trans_b = false;
      gh.ab_dtype = dtype;
      gh.C = sp.dh; gh.ldc = D; gh.c_dtype = FCE_FLOAT32;
      gh.alpha = 1.f; gh.beta = first ? 0.f : 1.f;
      gh.workspace = sp.lt_ws; gh.workspace_bytes = sp.lt_bytes;
      FCE_TRY(gemm(gh, stream, nullptr));
    }

    // e. ∂b_s = Σ_rows ∂Z_s, complete in one pass
    if (sp.db)
      FCE_TRY(launch_column_sums(z, dtype, N, vc, lds,
                                 static_cast<char*>(sp.db) + static_cast<size_t>(v0) * dtype_size(sp.db_dtype),
                                 sp.db_dtype, sp.db_add_old, stream));
  }
  return FCE_SUCCESS;
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

fce_status cuda_linear_ce(const LinearCeProblem& p) {
  using namespace cuda;
  using namespace cuda::linear;
  const CeOptions& opt = p.opt;
  const int dtype = opt.dtype;
  if (dtype != FCE_FLOAT32 && dtype != FCE_FLOAT16 && dtype != FCE_BFLOAT16)
    return fail(FCE_ERROR_INTERNAL, "fce_linear_ce: dtype %d reached the CUDA backend", dtype);
  const int64_t N = p.rows, D = p.hidden, V = p.vocab, hs = p.hidden_row_stride;
  const bool with_grad = p.with_grad();
  const bool dw_fp32 = p.grad_weight_fp32 || dtype == FCE_FLOAT32;
  const int grad_w_dtype = dw_fp32 ? FCE_FLOAT32 : dtype;  // of grad_weight and grad_bias
  const size_t e = dtype_size(dtype);

  // ---- everything that can fail before any work is enqueued
  const NamedPointer pointers[] = {
      {p.hidden_states, "hidden_states"}, {p.weight, "weight"}, {p.bias, "bias"},
      {p.targets, "targets"}, {p.loss, "loss"}, {p.lse, "lse"},
      {p.z_loss, "z_loss"}, {p.grad_hidden, "grad_hidden"},
      {p.grad_weight, "grad_weight"}, {p.grad_bias, "grad_bias"},
      {p.grad_output, "grad_output"}, {p.error_flags, "error_flags"},
      {opt.class_weights, "options->class_weights"}, {p.argmax, "options->argmax"},
      {p.accuracy, "options->accuracy"}, {p.workspace, "workspace"}};
  int device = 0;
  FCE_TRY(check_device_pointers("fce_linear_ce", pointers,
                                static_cast<int>(sizeof pointers / sizeof pointers[0]), &device));

  const Sizes s = sizes_of(opt, N, D, V, with_grad);
  Plan plan;
  if (!choose_plan(s, p.grad_weight != nullptr, dw_fp32, p.workspace_bytes, &plan)) {
    size_t min_bytes = 0, optimal_bytes = 0;
    cuda_linear_ce_workspace_size(opt, N, D, V, with_grad, p.grad_weight_fp32, &min_bytes,
                                  &optimal_bytes);
    return fail(FCE_ERROR_WORKSPACE_TOO_SMALL,
                "fce_linear_ce: workspace_bytes (%zu) is too small: the CUDA backend needs at "
                "least %zu bytes for these sizes (%zu for full speed)",
                p.workspace_bytes, min_bytes, optimal_bytes);
  }
  if (!p.workspace)
    return fail(FCE_ERROR_NULL_POINTER, "fce_linear_ce: workspace is NULL (%zu bytes needed)",
                plan.layout.total);

  // ---- carve the workspace
  const Layout& L = plan.layout;
  char* base = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(p.workspace) + kAlign - 1) / kAlign * kAlign);
  CeDenoms* denoms = reinterpret_cast<CeDenoms*>(base + L.denoms);
  float* row_loss = s.reduction_none ? p.loss : reinterpret_cast<float*>(base + L.row_loss);
  // the z-loss terms: part of a mean/sum loss, or asked for (λ = 0: none)
  float* row_zloss = (opt.z_loss_scale != 0.f && (!s.reduction_none || p.z_loss))
                         ? reinterpret_cast<float*>(base + L.row_zloss) : nullptr;
  float* row_correct = !p.accuracy ? nullptr
                       : s.reduction_none ? p.accuracy : reinterpret_cast<float*>(base + L.row_correct);
  void* bias_ws = p.bias ? static_cast<void*>(base + L.bias) : nullptr;  // the bias, in dtype
  float* db32 = reinterpret_cast<float*>(base + L.db);
  void* lt_ws = base + L.lt;
  void* z = base + L.z;  // Z_c [rc, ldz] in dtype, then ∂Z_c in place (same dtype and stride)
  const int64_t ldz = s.vocab_padded;
  const bool sliced = plan.mode == Mode::kVocabSliced;
  // the vocab-sliced plan (only ever chosen for a 16-bit dtype whose grad_weight and grad_bias
  // are 16-bit too: choose_plan takes token chunks for float32 ones): the lse pass keeps each
  // row's (m, log s, t) for the gradient pass; ∂h accumulates in a float32 workspace buffer
  CeRowStats* stats = sliced ? reinterpret_cast<CeRowStats*>(base + L.stats) : nullptr;
  float* dh32 = reinterpret_cast<float*>(base + L.dh);
  const bool grad_in_chunks = with_grad && !sliced;

  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const char* hidden = static_cast<const char*>(p.hidden_states);

  // ---- the loss denominators (need all targets); the bias copied to 256-byte aligned
  // workspace (in dtype: cuBLASLt's bias has the D type), so cuBLASLt's pick does not depend
  // on the caller's bias address
  FCE_TRY(launch_ce_denominators(opt, N, V, p.targets, denoms, stream));
  if (p.bias) FCE_TRY(launch_convert(p.bias, dtype, bias_ws, dtype, V, stream));

  for (int64_t c = 0; c < plan.chunks; ++c) {
    const int64_t r0 = c * plan.chunk_rows;
    const int64_t rc = std::min(plan.chunk_rows, N - r0);
    const bool first = c == 0;
    const void* h_c = hidden + static_cast<size_t>(r0) * static_cast<size_t>(hs) * e;

    // 1. Z_c[rc, V] = h_c[rc, D] · W[V, D]ᵀ + b   (in dtype, float32 accumulation, ld = ldz)
    FCE_TRY(logits_gemm(dtype, rc, V, D, h_c, hs, p.weight, bias_ws, z, ldz, lt_ws,
                        plan.lt_bytes, stream));

    // 2. the CE pass: row losses, lse, and ∂Z_c in dtype, in place over Z_c
    CeRowsArgs a{};
    a.opt = opt;
    a.vocab = V;
    a.total_rows = N;
    a.row_begin = r0;
    a.row_count = rc;
    a.logits = z;
    a.logits_dtype = dtype;
    a.row_stride = ldz;
    a.grad = grad_in_chunks ? z : nullptr;
    a.grad_dtype = dtype;
    a.grad_row_stride = ldz;
    a.targets = p.targets;
    a.denoms = denoms;
    a.grad_output = p.grad_output;
    a.lse_in = nullptr;
    a.row_loss = row_loss;
    a.row_zloss = row_zloss;
    a.lse_out = p.lse;
    a.stats_out = stats;
    a.argmax_out = p.argmax;
    a.row_correct = row_correct;
    a.error_flags = p.error_flags;
    FCE_TRY(launch_ce_rows(a, stream));
    if (!grad_in_chunks) continue;

    // 3. ∂h_c[rc, D] = ∂Z_c[rc, V] · W[V, D]   (straight into grad_hidden, dense)
    if (p.grad_hidden) {
      RowMajorGemm gh{};
      gh.name = "grad_hidden (dZ · weight)";
      gh.M = rc; gh.N = D; gh.K = V;
      gh.A = z; gh.lda = ldz; gh.trans_a = false;
      gh.B = p.weight; gh.ldb = D; gh.trans_b = false;
      gh.ab_dtype = dtype;
      gh.C = static_cast<char*>(p.grad_hidden) + static_cast<size_t>(r0) * static_cast<size_t>(D) * e;
      gh.ldc = D; gh.c_dtype = dtype;
      gh.alpha = 1.f; gh.beta = 0.f;
      gh.workspace = lt_ws; gh.workspace_bytes = plan.lt_bytes;
      FCE_TRY(gemm(gh, stream, nullptr));
    }

    // 4. ∂W[V, D] (+)= ∂Z_c[rc, V]ᵀ · h_c[rc, D]
    if (p.grad_weight) {
      RowMajorGemm gw{};
      gw.name = "grad_weight (dZᵀ · hidden)";
      gw.M = V; gw.N = D; gw.K = rc;
      gw.A = z; gw.lda = ldz; gw.trans_a = true;
      gw.B = h_c; gw.ldb = hs; gw.trans_b = false;
      gw.ab_dtype = dtype;
      gw.ldc = D;
      gw.alpha = 1.f;
      switch (plan.mode) {
        case Mode::kChunked16:     // f16/bf16 grad_weight itself: one rounding per chunk
          gw.C = p.grad_weight; gw.c_dtype = dtype;
          gw.beta = (first && !p.accumulate) ? 0.f : 1.f;
          break;
        case Mode::kVocabSliced:   // not reached: no gradient in the token chunks
          break;
        case Mode::kChunked:       // the caller's float32 grad_weight
          gw.C = p.grad_weight; gw.c_dtype = FCE_FLOAT32;
          gw.beta = (first && !p.accumulate) ? 0.f : 1.f;
          break;
      }
      gw.workspace = lt_ws; gw.workspace_bytes = plan.lt_bytes;
      FCE_TRY(gemm(gw, stream, nullptr));
    }

    // 5. ∂b[V] (+)= Σ_rows ∂Z_c   (float32: the caller's, or the workspace accumulator)
    if (p.grad_bias) {
      if (dw_fp32)
        FCE_TRY(launch_column_sums(z, dtype, rc, V, ldz, p.grad_bias, FCE_FLOAT32,
                                   !(first && !p.accumulate), stream));
      else
        FCE_TRY(launch_column_sums(z, dtype, rc, V, ldz, db32, FCE_FLOAT32, !first, stream));
    }
  }

  // ---- the vocab-sliced gradient pass: per slice of columns [v0, v0 + vc), for all N rows
  // (slice_pass, shared with fce_vp_linear_backward)
  if (sliced && with_grad) {
    SlicePass sp{};
    sp.opt = opt;
    sp.rows = N;
    sp.hidden = D;
    sp.hidden_row_stride = hs;
    sp.cols = V;
    sp.col_offset = 0;
    sp.vocab_total = V;
    sp.hidden_states = hidden;
    sp.weight = p.weight;
    sp.bias = bias_ws;
    sp.targets = p.targets;
    sp.denoms = denoms;
    sp.grad_output = p.grad_output;
    sp.stats = stats;
    sp.z = z;
    sp.slice_cols = plan.slice_cols;
    sp.slices = plan.slices;
    sp.lt_ws = lt_ws;
    sp.lt_bytes = plan.lt_bytes;
    sp.grad_weight = p.grad_weight;
    sp.grad_weight_dtype = grad_w_dtype;
    sp.accumulate = p.accumulate;
    sp.dh = p.grad_hidden ? dh32 : nullptr;
    sp.db = p.grad_bias ? db32 : nullptr;  // complete per slice; stored below
    sp.db_dtype = FCE_FLOAT32;
    sp.db_add_old = false;
    FCE_TRY(slice_pass(sp, stream));
  }
  if (sliced && p.grad_hidden)
    FCE_TRY(launch_store_accumulator(dh32, p.grad_hidden, dtype, N * D, false, stream));

  // ---- f16/bf16 gradients out of their float32 accumulators (one rounding, + old values)
  if (p.grad_bias && !dw_fp32)
    FCE_TRY(launch_store_accumulator(db32, p.grad_bias, grad_w_dtype, V, p.accumulate, stream));

  // ---- the reduced loss, z-loss and accuracy, fixed order. For none the per-row losses and
  // accuracies already are the caller's: only the z-loss total remains.
  if (!s.reduction_none)
    FCE_TRY(launch_ce_finalize(opt, N, row_loss, row_zloss, row_correct, denoms, p.loss,
                               p.z_loss, p.accuracy, stream));
  else
    FCE_TRY(launch_ce_finalize(opt, N, row_loss, row_zloss, row_correct, denoms, nullptr,
                               p.z_loss, nullptr, stream));
  return FCE_SUCCESS;
}

}  // namespace fce
