// vp_linear.cu — the CUDA backend of fce_vp_linear_stats and fce_vp_linear_backward: the
// vocabulary-parallel fused linear + CE (SEMANTICS.md rules 13, 16) over this rank's weight rows
// W_s = W[vocab_start : vocab_start + vocab_local, :] (and bias b_s), never holding more of
// z = h·W_sᵀ + b_s than the caller's workspace.
//
// Phase 1 (fce_vp_linear_stats), 2·N·D·V_s FLOPs: fce_linear_ce's loss-only plan for a [N, D] ×
// [V_s, D] problem (linear_plan.cuh: plan_mode(kChunked), the same workspace arithmetic, query
// and chunk sizes): per token chunk of Nc rows, Z_c = h_c·W_sᵀ + b_s in the dtype (logits_gemm:
// cuBLASLt, float32 accumulation, the bias in the epilogue, as fce_linear_ce makes its logits),
// then the phase-1 stats kernel (vocab_parallel.cu) on Z_c's rows into stats. With class weights
// W_r (the same for every row) is written once by launch_vp_weights.
//
// Phase 3 (fce_vp_linear_backward), 6·N·D·V_s FLOPs: the combine kernel turns gathered_stats into
// the row statistics (M, log S, t) in the workspace, then fce_linear_ce's vocab-sliced gradient
// pass (linear_plan.cuh: slice_pass, the very function fce_linear_ce runs) over the shard's
// columns as a column slice [vocab_start, vocab_start + V_s) of the vocab_total classes: per
// slice of Vc columns for all N rows, Z_s again, ∂Z_s in place from the statistics, ∂W_s in ONE
// GEMM over all rows (one rounding; beta = accumulate), ∂h += ∂Z_s·W_s in float32 (the caller's
// grad_hidden itself when grad_hidden_dtype is FCE_FLOAT32, else a float32 [N, D] workspace
// buffer stored once at the end), ∂b_s by fixed-order column sums straight into grad_bias
// (+ its old value with accumulate: the same single rounding as fce_linear_ce's store).
//   Workspace (from a 256-byte aligned base): CeDenoms | CeRowStats [N] | bias copy [V_s] in
//   dtype | float32 ∂h [N, D] (only for a 16-bit grad_hidden_dtype) | cuBLASLt workspace |
//   logits scratch [N, Vc] in dtype. Nothing of size [V, D]. The minimum takes Vc = 64 and 4 MiB
//   for cuBLASLt; the full-speed size takes slices of up to 1 GiB of logits (all of the shard when
//   that fits) and 16 MiB for cuBLASLt. The plan (Vc, the cuBLASLt workspace) is a function of the
//   sizes, the options, grad_hidden_dtype and workspace_bytes only: bitwise deterministic for a
//   given workspace size.
// One stream, no allocation, no host synchronisation (after the first call's cuBLASLt handle):
// graph-capturable.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "cuda/ce_rows.cuh"
#include "cuda/device_pointers.cuh"
#include "cuda/linear_kernels.cuh"
#include "cuda/linear_plan.cuh"
#include "cuda/vp_kernels.cuh"
#include "internal.h"

namespace fce {
namespace cuda {
namespace {

using linear::kAlign;
using linear::kChunkBudget;
using linear::kHuge;
using linear::kLtWorkspaceBudget;
using linear::kLtWorkspaceMin;
using linear::kVocabPad;
using linear::sat_add;
using linear::sat_mul;
using linear::sat_round;

// ---- phase 1: fce_linear_ce's loss-only token-chunk plan for the shard
linear::Sizes stats_sizes(const CeOptions& opt, int64_t rows, int64_t hidden, int64_t vocab_local) {
  return linear::sizes_of(opt, rows, hidden, vocab_local, false);
}

// ---- phase 3: the slice pass over the shard's columns for all rows
struct BwdSizes {
  int64_t rows, hidden, cols, cols_padded;
  size_t elem;
  bool dh32;  // ∂h accumulates in a float32 workspace buffer (16-bit grad_hidden_dtype)
};
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

struct BwdLayout {
  size_t denoms, stats, bias, dh, lt, z, total;
};
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

size_t bwd_min_workspace(const BwdSizes& s) {
  return bwd_layout(s, kLtWorkspaceMin, slice_bytes(s, kVocabPad)).total;
}
size_t bwd_optimal_workspace(const BwdSizes& s) {
  return bwd_layout(s, kLtWorkspaceBudget, slice_bytes(s, full_speed_cols(s))).total;
}

struct BwdPlan {
  int64_t slice_cols, slices;
  size_t lt_bytes;
  BwdLayout layout;
};
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

// The slice pass's fix_dz: the ignored rows of an inconsistent tiling get a NaN ∂Z row too (so
// that their ∂h rows, ∂W and ∂b are NaN, as every other gradient of such a call).
struct NanRows {
  const char* fn;
  const CeRowStats* stats;
  int dtype;
};
fce_status nan_rows(const void* ctx, void* dz, int64_t rows, int64_t cols, int64_t ld,
                    cudaStream_t s) {
  const NanRows* c = static_cast<const NanRows*>(ctx);
  return launch_vp_nan_rows(c->fn, c->stats, rows, dz, c->dtype, cols, ld, s);
}

char* aligned_base(void* workspace) {
  return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(workspace) + kAlign - 1) / kAlign *
                                 kAlign);
}

fce_status vp_linear_stats(const VpLinearProblem& p) {
  const char* fn = "fce_vp_linear_stats";
  const CeOptions& opt = p.opt;
  const int dtype = opt.dtype;
  const int64_t N = p.rows, D = p.hidden, Vs = p.vocab_local, hs = p.hidden_row_stride;
  const size_t e = dtype_size(dtype);

  const NamedPointer pointers[] = {{p.hidden_states, "hidden_states"}, {p.weight, "weight"},
                                   {p.bias, "bias"},                   {p.targets, "targets"},
                                   {p.stats, "stats"},
                                   {opt.class_weights, "options->class_weights"},
                                   {p.workspace, "workspace"}};
  int device = 0;
  FCE_TRY(check_device_pointers(fn, pointers, static_cast<int>(sizeof pointers / sizeof pointers[0]),
                                &device));

  const linear::Sizes s = stats_sizes(opt, N, D, Vs);
  linear::Plan plan;
  if (!linear::plan_mode(s, linear::Mode::kChunked, p.workspace_bytes, &plan)) {
    const size_t lo = linear::min_workspace(s, false, true);
    const size_t full = std::max(lo, linear::optimal_workspace(s, false, true));
    return fail(FCE_ERROR_WORKSPACE_TOO_SMALL,
                "%s: workspace_bytes (%zu) is too small: the CUDA backend needs at least %zu bytes "
                "for these sizes (%zu for full speed)",
                fn, p.workspace_bytes, lo, full);
  }
  if (!p.workspace)
    return fail(FCE_ERROR_NULL_POINTER, "%s: workspace is NULL (%zu bytes needed)", fn,
                plan.layout.total);

  const linear::Layout& L = plan.layout;
  char* base = aligned_base(p.workspace);
  void* bias_ws = p.bias ? static_cast<void*>(base + L.bias) : nullptr;
  void* lt_ws = base + L.lt;
  void* z = base + L.z;  // Z_c [rc, ldz] in dtype
  const int64_t ldz = s.vocab_padded;
  const char* hidden = static_cast<const char*>(p.hidden_states);
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);

  if (opt.class_weights)
    FCE_TRY(launch_vp_weights(fn, opt, N, p.vocab_start, Vs, p.stats, stream));
  if (p.bias) FCE_VP_TRY(fn, launch_convert(p.bias, dtype, bias_ws, dtype, Vs, stream));

  for (int64_t c = 0; c < plan.chunks; ++c) {
    const int64_t r0 = c * plan.chunk_rows;
    const int64_t rc = std::min(plan.chunk_rows, N - r0);
    const void* h_c = hidden + static_cast<size_t>(r0) * static_cast<size_t>(hs) * e;
    // Z_c[rc, Vs] = h_c · W_sᵀ + b_s   (dtype, float32 accumulation, ld = ldz)
    FCE_VP_TRY(fn, linear::logits_gemm(dtype, rc, Vs, D, h_c, hs, p.weight, bias_ws, z, ldz, lt_ws,
                                       plan.lt_bytes, stream));
    VpStatsArgs a{};
    a.fn = fn;
    a.opt = opt;
    a.row_begin = r0;
    a.row_count = rc;
    a.logits = z;
    a.logits_dtype = dtype;
    a.row_stride = ldz;
    a.vocab_total = p.vocab_total;
    a.vocab_start = p.vocab_start;
    a.vocab_local = Vs;
    a.targets = p.targets;
    a.stats = p.stats;
    a.weight_written = opt.class_weights != nullptr;
    FCE_TRY(launch_vp_stats(a, stream));
  }
  return FCE_SUCCESS;
}

fce_status vp_linear_backward(const VpLinearProblem& p) {
  const char* fn = "fce_vp_linear_backward";
  const CeOptions& opt = p.opt;
  const int dtype = opt.dtype;
  const int64_t N = p.rows, D = p.hidden, Vs = p.vocab_local;
  const bool dw_fp32 = p.grad_weight_fp32 || dtype == FCE_FLOAT32;
  const int grad_w_dtype = dw_fp32 ? FCE_FLOAT32 : dtype;  // of grad_weight and grad_bias

  const NamedPointer pointers[] = {
      {p.hidden_states, "hidden_states"}, {p.weight, "weight"},
      {p.bias, "bias"},                   {p.targets, "targets"},
      {p.gathered, "gathered_stats"},     {p.grad_output, "grad_output"},
      {p.grad_hidden, "grad_hidden"},     {p.grad_weight, "grad_weight"},
      {p.grad_bias, "grad_bias"},         {p.error_flags, "error_flags"},
      {opt.class_weights, "options->class_weights"}, {p.workspace, "workspace"}};
  int device = 0;
  FCE_TRY(check_device_pointers(fn, pointers, static_cast<int>(sizeof pointers / sizeof pointers[0]),
                                &device));
  if (p.grad_hidden_dtype != FCE_FLOAT32 && p.grad_hidden_dtype != dtype)
    return fail(FCE_ERROR_INTERNAL, "%s: grad_hidden_dtype %d reached the CUDA backend", fn,
                p.grad_hidden_dtype);
  if (!p.grad_hidden && !p.grad_weight && !p.grad_bias)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: grad_hidden, grad_weight and grad_bias are all NULL (nothing to compute)", fn);

  const BwdSizes s = bwd_sizes(opt, N, D, Vs, p.grad_hidden_dtype);
  BwdPlan plan;
  if (!bwd_plan(s, p.workspace_bytes, &plan)) {
    const size_t lo = bwd_min_workspace(s);
    const size_t full = std::max(lo, bwd_optimal_workspace(s));
    return fail(FCE_ERROR_WORKSPACE_TOO_SMALL,
                "%s: workspace_bytes (%zu) is too small: the CUDA backend needs at least %zu bytes "
                "for these sizes (%zu for full speed)",
                fn, p.workspace_bytes, lo, full);
  }
  if (!p.workspace)
    return fail(FCE_ERROR_NULL_POINTER, "%s: workspace is NULL (%zu bytes needed)", fn,
                plan.layout.total);

  const BwdLayout& L = plan.layout;
  char* base = aligned_base(p.workspace);
  CeDenoms* denoms = reinterpret_cast<CeDenoms*>(base + L.denoms);
  CeRowStats* stats = reinterpret_cast<CeRowStats*>(base + L.stats);
  void* bias_ws = p.bias ? static_cast<void*>(base + L.bias) : nullptr;
  // ∂h: the caller's float32 grad_hidden is the accumulator; a 16-bit one gets a float32 one
  float* dh = nullptr;
  if (p.grad_hidden)
    dh = s.dh32 ? reinterpret_cast<float*>(base + L.dh) : static_cast<float*>(p.grad_hidden);
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);

  // ---- D, Ω, n of the whole problem; the bias in dtype at a 256-byte aligned address
  FCE_VP_TRY(fn, launch_ce_denominators(opt, N, p.vocab_total, p.targets, denoms, stream));
  if (p.bias) FCE_VP_TRY(fn, launch_convert(p.bias, dtype, bias_ws, dtype, Vs, stream));

  // ---- the row statistics (M, log S, t) from the gathered shards (flags: out of range, tiling)
  VpCombineArgs c{};
  c.fn = fn;
  c.opt = opt;
  c.ranks = p.ranks;
  c.rows = N;
  c.vocab_total = p.vocab_total;
  c.targets = p.targets;
  c.gathered = p.gathered;
  c.stats_out = stats;
  c.error_flags = p.error_flags;
  FCE_TRY(launch_vp_combine(c, stream));

  // ---- fce_linear_ce's vocab-sliced gradient pass over the shard's columns
  linear::SlicePass sp{};
  sp.opt = opt;
  sp.rows = N;
  sp.hidden = D;
  sp.hidden_row_stride = p.hidden_row_stride;
  sp.cols = Vs;
  sp.col_offset = p.vocab_start;
  sp.vocab_total = p.vocab_total;
  sp.hidden_states = p.hidden_states;
  sp.weight = p.weight;
  sp.bias = bias_ws;
  sp.targets = p.targets;
  sp.denoms = denoms;
  sp.grad_output = p.grad_output;
  sp.stats = stats;
  sp.z = base + L.z;
  sp.slice_cols = plan.slice_cols;
  sp.slices = plan.slices;
  sp.lt_ws = base + L.lt;
  sp.lt_bytes = plan.lt_bytes;
  sp.grad_weight = p.grad_weight;
  sp.grad_weight_dtype = grad_w_dtype;
  sp.accumulate = p.accumulate;
  sp.dh = dh;
  sp.db = p.grad_bias;  // each slice's columns complete: straight into grad_bias
  sp.db_dtype = grad_w_dtype;
  sp.db_add_old = p.accumulate;
  const NanRows fix{fn, stats, dtype};
  sp.fix_dz = nan_rows;
  sp.fix_ctx = &fix;
  FCE_VP_TRY(fn, linear::slice_pass(sp, stream));

  // ---- a 16-bit grad_hidden out of its float32 accumulator (one rounding)
  if (p.grad_hidden && s.dh32)
    FCE_VP_TRY(fn, launch_store_accumulator(dh, p.grad_hidden, p.grad_hidden_dtype, N * D, false,
                                            stream));
  return FCE_SUCCESS;
}

}  // namespace
}  // namespace cuda

void cuda_vp_linear_workspace_size(const CeOptions& opt, int64_t /*ranks*/, int64_t rows,
                                   int64_t hidden, int64_t /*vocab_total*/, int64_t vocab_local,
                                   bool backward, int grad_hidden_dtype, bool /*grad_weight_fp32*/,
                                   size_t* min_bytes, size_t* optimal_bytes) {
  using namespace cuda;
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
// its own minimum. Returns the number of failures (each printed).
int vp_linear_selftest() {
  int failures = 0;
  auto bad = [&](const char* what, int64_t N, int64_t D, int64_t Vs, int dt, int gh, size_t ws) {
    if (failures++ < 20)
      std::fprintf(stderr, "vp_linear_selftest: %s (N %lld, D %lld, Vs %lld, dtype %d, gh %d, ws %zu)\n",
                   what, (long long)N, (long long)D, (long long)Vs, dt, gh, ws);
  };
  const int64_t Ns[] = {1, 7, 128, 1000, 8192, 65536};
  const int64_t Ds[] = {1, 16, 4096};
  const int64_t Vss[] = {1, 63, 64, 65, 97, 1000, 16032, 32064, 128256};
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

fce_status cuda_vp_linear(const VpLinearProblem& p) {
  const int dtype = p.opt.dtype;
  const char* fn = p.gathered ? "fce_vp_linear_backward" : "fce_vp_linear_stats";
  if (dtype != FCE_FLOAT32 && dtype != FCE_FLOAT16 && dtype != FCE_BFLOAT16)
    return fail(FCE_ERROR_INTERNAL, "%s: dtype %d reached the CUDA backend", fn, dtype);
  return p.gathered ? cuda::vp_linear_backward(p) : cuda::vp_linear_stats(p);
}

}  // namespace fce
