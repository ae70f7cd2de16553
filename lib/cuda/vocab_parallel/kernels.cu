// vocab_parallel/kernels.cu — the kernels of the vocabulary-parallel calls (docs/semantics.md
// rule 16) and their launchers (vocab_parallel/kernels.cuh): phase 1, each row's statistics of
// this rank's shard (vp_stats_kernel); phase 3, their combination across the ranks
// (vp_combine_kernel), for fce_vp_stats / fce_vp_loss / fce_vp_backward and the linear calls.
// Why it is fast: phase 1 reads the shard ONCE, one CTA per row in 16-byte vectors, with the
// label-smoothing sums kept relative to the running maximum (no second pass, no cancellation);
// phase 3 is one thread per row over P × 32 bytes. Fixed-order trees, no float atomics:
// deterministic. ENT instantiations (options->vp_entropy, rule 18): phase 1 also sums e_r and
// phase 3 makes μ − M and the entropy. The device helpers: vocab_parallel/device.cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>
#include <cstring>

#include "cuda/ce/rows.cuh"
#include "cuda/common/launch_check.cuh"
#include "cuda/vocab_parallel/device.cuh"
#include "cuda/vocab_parallel/kernels.cuh"
#include "exact_sum.h"
#include "internal.h"

// Phase 1, vp_stats_kernel: one CTA per row of the shard, ONE read of it (16-byte vectors where
// the row allows, its ≤ 2 partial vectors element by element, never a byte outside the row; the
// same vector split as ce/kernels.cu's streaming kernels). Per thread, over its vectors in
// increasing index order: an online maximum and Σ exp(a − m) (exp2 of scaled differences, as the
// row kernels), the first index of its maximum (the argmax), and with label smoothing
// u = Σ ω_j (m − a_j) kept relative to the running maximum (u += w·(m_new − m_old) when it grows,
// w = Σ ω of the finite elements so far: every term is ≥ 0, no cancellation however far the
// logits are from each other), −inf elements apart (each adds ω·∞). Then a fixed-order CTA tree.
// A row whose Σexp is NaN holds a NaN or a +inf (exp(+inf − +inf) = NaN): only then it is read
// a second time, to find its first NaN (m_r = NaN, argmax = that NaN, as torch.argmax; a row
// with a +inf and no NaN keeps m_r = +inf, its first +inf as the argmax, and s_r = NaN).
// Thread 0 reads the target logit (when the row is scored and its target is in the shard)
// before the loop, and writes the row's FCE_VP_STATS floats with two 16-byte stores. With class weights, W_r = Σ ω over the shard is
// the same for every row: vp_weights_kernel sums it once (fixed order, double) and writes it
// into every row (no workspace: fce_vp_stats has none).
//
// Phase 3, vp_combine_kernel: one thread per row (grid-stride), ranks in gathered order, float32:
// M, S = Σ s_r·exp(m_r − M), log S, t, Ω, U, the tiling check (Σ V_r = V, one shard holding a
// valid row's target), the argmax across shards; writes the row statistics for the gradient
// (CeRowStats, in the workspace) and the per-row loss / z-loss / lse / argmax / correctness that
// launch_ce_finalize (ce/rows.cuh) reduces in a fixed order. Error flags: one atomicOr per warp
// (integer; no float atomics anywhere).
//
// Every launcher enqueues on the given stream only (no allocation, no host synchronisation:
// graph-capturable) and names the public function (`fn`) first in its messages; every reduction
// has a fixed order: deterministic.

namespace fce {
namespace cuda {
namespace {

// ENT: e_r = Σ exp(a − m_r)(a − m_r) beside s_r (each thread's against its running maximum,
// moved to the row's and summed in a fixed tree), in kVpEntropy, h_r in kVpLocal's sign bit.
template <class TZ, int MODE, bool ENT = false>
__global__ void __launch_bounds__(kStatsThreads, 2) vp_stats_kernel(const SParams p) {
  constexpr int E = vec_elems<TZ>();
  constexpr int eb = Ty<TZ>::kBytes;
  constexpr int U = MODE == kGeneral ? kStatsUnroll / 2 : kStatsUnroll;
  constexpr bool SMOOTH = MODE == kGeneral;
  __shared__ Acc s_warp[32];
  __shared__ Acc s_final;
  __shared__ int s_nan[32];

  const int64_t lrow = blockIdx.x;
  const int64_t row = p.row_begin + lrow;
  const char* zrow = p.logits + lrow * p.z_row_bytes;
  const int V = p.vocab;
  const int lead = static_cast<int>((reinterpret_cast<uintptr_t>(zrow) & 15) / eb);
  const int64_t nvec = (int64_t(lead) + V + E - 1) / E;
  const int tid = threadIdx.x, nt = blockDim.x;
  const int64_t step = int64_t(nt) * U;

  // thread 0: the row's target and, when the shard holds it, its logit (used after the loop)
  float t_r = 0.f, h_r = 0.f;
  if (tid == 0) {
    int64_t y;
    if (!p.soft && classify_row(p, row, &y) == kValid && y >= p.vocab_start &&
        y - p.vocab_start < V) {
      t_r = xform<MODE>(raw_to_float<TZ>(ld_elem<TZ>(zrow + (y - p.vocab_start) * eb)), p);
      h_r = 1.f;
    }
  }

  Acc acc = acc_identity();
  float e_acc = 0.f;  // ENT: this thread's e against acc.m
  for (int64_t base = tid; base < nvec; base += step) {
    uint4 buf[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = base + int64_t(u) * nt;
      const int64_t j0 = v * E - lead;
      buf[u] = make_uint4(0u, 0u, 0u, 0u);
      if (v < nvec) buf[u] = load_vector<TZ, kStreaming, int64_t>(zrow, j0, is_full<int64_t, E>(j0, V), V);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = base + int64_t(u) * nt;
      const int64_t j0 = v * E - lead;
      if (v >= nvec) continue;
      if constexpr (ENT)
        stats_vector<TZ, MODE, true>(buf[u], j0, is_full<int64_t, E>(j0, V), p, acc, &e_acc);
      else
        stats_vector<TZ, MODE>(buf[u], j0, is_full<int64_t, E>(j0, V), p, acc);
    }
  }
  const Acc blk = block_reduce<SMOOTH>(acc, s_warp);
  if (tid == 0) s_final = blk;
  __syncthreads();
  const Acc fin = s_final;
  float e_row = 0.f;  // ENT: the row's e against fin.m (thread 0's)
  if constexpr (ENT) {
    __shared__ float s_e[32];
    float e = acc.m != fin.m ? rebase_e(acc.m, fin.m, acc.s, e_acc) : e_acc;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) e = __fadd_rn(e, __shfl_xor_sync(0xffffffffu, e, o));
    if ((tid & 31) == 0) s_e[tid >> 5] = e;
    __syncthreads();
    if (tid == 0)
      for (int w = 0; w < (nt >> 5); ++w) e_row = __fadd_rn(e_row, s_e[w]);
  }

  // Σexp NaN: the row holds a NaN or a +inf. Its first NaN, if any (a second read, rare rows only)
  int nan_j = INT_MAX;
  if (isnan(fin.s)) {
    for (int64_t v = tid; v < nvec; v += nt) {
      const int64_t j0 = v * E - lead;
      const bool full = is_full<int64_t, E>(j0, V);
      float a[E];
      unpack<TZ>(load_vector<TZ, kKeepInL2, int64_t>(zrow, j0, full, V), a);
#pragma unroll
      for (int q = 0; q < E; ++q) {
        const int64_t j = j0 + q;
        if ((full || (j >= 0 && j < V)) && isnan(xform<MODE>(a[q], p)) && j < nan_j)
          nan_j = static_cast<int>(j);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) nan_j = min(nan_j, __shfl_xor_sync(0xffffffffu, nan_j, o));
    if ((tid & 31) == 0) s_nan[tid >> 5] = nan_j;
    __syncthreads();
    if (tid == 0)
      for (int w = 0; w < (nt >> 5); ++w) nan_j = min(nan_j, s_nan[w]);
  }

  if (tid == 0) {
    const bool has_nan = nan_j != INT_MAX;
    const float m = has_nan ? qnan() : fin.m;
    const float s = has_nan ? qnan() : fin.s;
    const int am = has_nan ? nan_j : (fin.am >= 0 ? fin.am : 0);
    float u = 0.f;
    if (SMOOTH && p.smooth && m > neg_inf())
      u = m == pos_inf() ? qnan() : __fadd_rn(static_cast<float>(fin.u), fin.ninf);
    const float am_bits = __int_as_float(static_cast<int>(p.vocab_start + am));
    float local_bits = __int_as_float(V);
    float slot3 = h_r;
    if constexpr (ENT) {  // e_r: 0 when m = −inf, NaN when m is NaN or +inf
      slot3 = m == neg_inf() ? 0.f : isfinite(m) ? e_row : qnan();
      local_bits = __uint_as_float(static_cast<unsigned>(V) | (h_r != 0.f ? kVpHitBit : 0u));
    }
    float* out = p.stats + row * FCE_VP_STATS;
    reinterpret_cast<float4*>(out)[0] = make_float4(m, s, t_r, slot3);
    if (p.write_weight) {
      reinterpret_cast<float4*>(out)[1] = make_float4(u, static_cast<float>(V), am_bits, local_bits);
    } else {
      out[kVpSmooth] = u;
      out[kVpArgmax] = am_bits;
      out[kVpLocal] = local_bits;
    }
  }
}

// W = Σ_j ω_j over the shard, fixed order (thread t: j = t, t + nt, … in groups of 8 loads in
// flight, then the fixed tree), double; every block computes the same bits and writes them into
// its share of the rows.
__global__ void __launch_bounds__(kWeightThreads) vp_weights_kernel(const float* w, int64_t n,
                                                                    float* stats, int64_t rows) {
  constexpr int U = 8;
  __shared__ double s_warp[32];
  __shared__ float s_total;
  const int64_t nt = blockDim.x;
  double acc = 0.0;
  for (int64_t base = threadIdx.x; base < n; base += nt * U) {
    float v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = base + u * nt < n ? __ldg(w + base + u * nt) : 0.f;
#pragma unroll
    for (int u = 0; u < U; ++u) acc = __dadd_rn(acc, static_cast<double>(v[u]));
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const double y = __shfl_down_sync(0xffffffffu, acc, o);
    if (lane < o) acc = __dadd_rn(acc, y);
  }
  if (lane == 0) s_warp[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < nwarps ? s_warp[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const double y = __shfl_down_sync(0xffffffffu, acc, o);
      if (lane < o) acc = __dadd_rn(acc, y);
    }
    if (lane == 0) s_total = static_cast<float>(acc);
  }
  __syncthreads();
  const float total = s_total;
  for (int64_t r = int64_t(blockIdx.x) * nt + threadIdx.x; r < rows; r += int64_t(gridDim.x) * nt)
    stats[r * FCE_VP_STATS + kVpWeight] = total;
}

// ----------------------------------------------------------------- combine ----
struct CParams {
  const float* gathered;       // [ranks, rows, FCE_VP_STATS] of the rows [row_begin, row_begin + rows)
  int64_t ranks, rows, row_begin;
  const void* targets;
  const float* class_weights;
  int64_t ignore_index, shift_T, shift_k;
  int vocab_total;
  int targets_int64;
  int reduction;
  int smooth, token_scaling, loss_has_z;
  int soft;                    // class probabilities (rule 19): every row scored, no target
                               // class; U and Ω of the rows' own ω_j q'_j, stats_out's t = Ω
  float one_minus_eps, eps_over_V, lambda;
  CeRowStats* stats_out;
  float* row_loss;
  float* row_zloss;
  float* lse;
  int64_t* argmax;
  float* row_correct;
  uint32_t* error_flags;
  float* entropy;              // ENT: [rows] H, or nullptr
};

// The argmax across shards, shard by shard: a NaN shard first (the smallest global index among
// them: the first NaN), else the largest m_r, the smallest global index among equal maxima.
__device__ __forceinline__ void take_argmax(float m_r, int j_r, bool& best_nan, bool& have_best,
                                            float& best_m, int& best_j) {
  if (isnan(m_r)) {
    if (!best_nan || j_r < best_j) best_j = j_r;
    best_nan = true;
  } else if (!best_nan && (!have_best || m_r > best_m || (m_r == best_m && j_r < best_j))) {
    best_m = m_r;
    best_j = j_r;
  }
  have_best = true;
}

// ENT (options->vp_entropy, rule 18): the layout with e_r, and E = Σ_r exp(m_r − M)(e_r +
// (m_r − M) s_r), μ − M = E/S, H = log S − E/S (NaN without a finite M); the row statistics
// carry μ − M in pad, and NaN in t marks an inconsistent row (launch_vp_nan_rows by_t).
// EXACT (options->batch_invariant, rule 21): the exact statistics (VpExactStat) merged, in any
// order the same bits, then log S − M, Ω, U = M Ω − Σ w a and μ − M = Σ exp(a) a / S − M in
// double from the merged sums (exact_sum.h).
template <bool ENT = false, bool EXACT = false>
__global__ void __launch_bounds__(kCombineThreads) vp_combine_kernel(const CParams p) {
  constexpr int64_t kWidth = EXACT ? kVxCount : FCE_VP_STATS;
  constexpr int kArgmaxSlot = EXACT ? kVxArgmax : kVpArgmax;
  static_assert(int(kVxMax) == int(kVpMax), "the maximum leads both layouts");
  uint32_t flags = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t lr = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; lr < p.rows; lr += stride) {
    const int64_t row = p.row_begin + lr;  // global: the targets and every output
    int64_t y = -1;
    const int kind = p.soft ? kValid : classify_row(p, row, &y);
    const float* g = p.gathered + lr * kWidth;
    const int64_t rank_stride = p.rows * kWidth;

    // M = max_r m_r, NaN if any is NaN
    float M = neg_inf();
    bool any_nan = false;
    for (int64_t r = 0; r < p.ranks; ++r) {
      const float m_r = g[r * rank_stride + kVpMax];
      any_nan |= isnan(m_r);
      M = fmaxf(M, m_r);
    }
    if (any_nan) M = qnan();

    // the rest, ranks in gathered order, float32
    float S = 0.f, T = 0.f, H = 0.f, Om = 0.f, Us = 0.f, Es = 0.f;
    int64_t sum_local = 0;
    bool best_nan = false, have_best = false;
    float best_m = neg_inf();
    int best_j = 0;
    float ls, mum = 0.f;  // log S and (ENT) μ − M
    if constexpr (EXACT) {
      ExactSum Sx = exact_zero(), Px = exact_zero(), Ux = exact_zero(), Wx = exact_zero();
      for (int64_t r = 0; r < p.ranks; ++r) {
        const float* st = g + r * rank_stride;
        const unsigned bits = __float_as_uint(st[kVxLocal]);
        H = __fadd_rn(H, (bits & kVpHitBit) ? 1.f : 0.f);
        sum_local += static_cast<int>(bits & ~kVpHitBit);
        T = __fadd_rn(T, st[kVxTarget]);
        exact_merge(Sx, exact_load(st + kVxSumExp));
        if (ENT) exact_merge(Px, exact_load(st + kVxEntropy));
        exact_merge(Ux, exact_load(st + kVxSmooth));
        exact_merge(Wx, exact_load(st + kVxWeight));
        take_argmax(st[kVxMax], __float_as_int(st[kVxArgmax]), best_nan, have_best, best_m,
                    best_j);
      }
      // a NaN, +inf (its term exp(+inf − +inf), rule 10) or −inf maximum (S = 0), or a term
      // beyond the exact sums' range (S's non-finite part)
      const double Md = M;
      const bool finite = isfinite(M) && Sx.nonfinite == 0.f;
      ls = finite ? static_cast<float>(exact_log(Sx) - Md)
           : (any_nan || M > 0.f || Sx.nonfinite != 0.f) ? qnan() : neg_inf();
      const double Omd = exact_value(Wx);
      Om = static_cast<float>(Omd);
      Us = isfinite(M) ? static_cast<float>(Md * Omd - exact_value(Ux)) : qnan();
      if (ENT) mum = finite ? static_cast<float>(exact_ratio(Px, Sx) - Md) : qnan();
    }
    for (int64_t r = 0; r < (EXACT ? 0 : p.ranks); ++r) {
      const float4 lo = *reinterpret_cast<const float4*>(g + r * rank_stride);
      const float4 hi = *reinterpret_cast<const float4*>(g + r * rank_stride + 4);
      const float m_r = lo.x, s_r = lo.y, t_r = lo.z;
      float h_r = lo.w;
      const float u_r = hi.x, w_r = hi.y;
      const int j_r = __float_as_int(hi.z);
      int v_r = __float_as_int(hi.w);
      if constexpr (ENT) {
        const unsigned bits = __float_as_uint(hi.w);
        h_r = (bits & kVpHitBit) ? 1.f : 0.f;
        v_r = static_cast<int>(bits & ~kVpHitBit);
        if (m_r > neg_inf())
          Es = __fadd_rn(Es, m_r == M ? lo.w
                                      : __fmul_rn(expf(__fsub_rn(m_r, M)),
                                                  __fmaf_rn(s_r, __fsub_rn(m_r, M), lo.w)));
      }
      if (m_r > neg_inf()) S = __fadd_rn(S, m_r == M ? s_r : __fmul_rn(s_r, expf(__fsub_rn(m_r, M))));
      T = __fadd_rn(T, t_r);
      H = __fadd_rn(H, h_r);
      Om = __fadd_rn(Om, w_r);
      if (p.smooth) Us = __fadd_rn(Us, __fadd_rn(u_r, __fmul_rn(w_r, __fsub_rn(M, m_r))));
      // (a shard of no probability mass adds nothing, even when its m_r is −inf)
      if (p.soft && w_r != 0.f)
        Us = __fadd_rn(Us, __fadd_rn(u_r, __fmul_rn(w_r, __fsub_rn(M, m_r))));
      sum_local += v_r;
      take_argmax(m_r, j_r, best_nan, have_best, best_m, best_j);
    }
    if constexpr (!EXACT) {
      if (any_nan) S = qnan();
      ls = logf(S);  // NaN when a shard holds a +inf (its s_r is NaN)
      if (ENT) mum = isfinite(M) ? __fdiv_rn(Es, S) : qnan();
    }
    float lse = __fadd_rn(M, ls);
    // Two disjoint shards never report the same argmax (a global index inside each): equal
    // ones mean a shard's statistics were gathered twice (in place of another's of that size).
    bool duplicate = false;
    for (int64_t r = 1; r < p.ranks && !duplicate; ++r) {
      const float j_r = g[r * rank_stride + kArgmaxSlot];
      for (int64_t q = 0; q < r && !duplicate; ++q)
        duplicate = __float_as_int(g[q * rank_stride + kArgmaxSlot]) == __float_as_int(j_r);
    }
    const bool inconsistent =
        sum_local != p.vocab_total || duplicate || (kind == kValid && !p.soft && H != 1.f);
    const float wy =
        kind == kValid && !p.soft ? (p.class_weights ? p.class_weights[y] : 1.f) : 0.f;
    // t of the row statistics: p_y with token scaling, Ω with class probabilities, else 1
    const float ts = p.soft ? Om : (p.token_scaling && kind == kValid) ? prob(T, M, ls) : 1.f;
    if (inconsistent) {
      lse = qnan();
      flags |= FCE_FLAG_SHARDS_INCONSISTENT;
    }
    // (pad = 1: an ignored row whose gradient must be NaN all the same, launch_vp_nan_rows)
    if constexpr (ENT) {
      if (p.entropy) p.entropy[row] = (inconsistent || !isfinite(M)) ? qnan() : __fsub_rn(ls, mum);
      if (p.stats_out)
        p.stats_out[row] = inconsistent ? CeRowStats{qnan(), qnan(), qnan(), qnan()}
                                        : CeRowStats{M, ls, ts, mum};
    } else if (p.stats_out) {
      p.stats_out[row] = inconsistent ? CeRowStats{qnan(), qnan(), qnan(), kind == kIgnored ? 1.f : 0.f}
                                      : CeRowStats{M, ls, ts, 0.f};
    }

    // the row's loss (rule 16 into rule 8), as launch_ce_rows' write_row_outputs
    float zl = (kind != kIgnored && p.lambda != 0.f) ? __fmul_rn(p.lambda, __fmul_rn(lse, lse)) : 0.f;
    float ce = 0.f;
    if (kind == kInvalid) {
      ce = qnan();
      flags |= FCE_FLAG_TARGET_OUT_OF_RANGE;
    } else if (p.soft) {
      // rule 19: ce = Ω log S + U, NaN without a finite maximum (rule 10)
      ce = isfinite(M) ? __fadd_rn(__fmul_rn(Om, ls), Us) : qnan();
    } else if (kind == kValid) {
      // NaN when M is infinite (rule 10): −inf − (−inf) on a row of −inf, a NaN ls with a +inf
      const float nll = __fadd_rn(__fsub_rn(M, T), ls);
      ce = __fmul_rn(__fmul_rn(p.one_minus_eps, wy), nll);
      if (p.smooth) ce = __fadd_rn(ce, __fmul_rn(p.eps_over_V, __fadd_rn(Us, __fmul_rn(Om, ls))));
      if (p.token_scaling) {
        ce = __fmul_rn(ce, ts);
        zl = __fmul_rn(zl, ts);
      }
    }
    if (inconsistent) {  // every row, ignored ones too (the CPU reference's)
      ce = qnan();
      zl = p.lambda != 0.f ? qnan() : 0.f;
    }
    if (p.row_zloss) p.row_zloss[row] = zl;
    if (p.row_loss) p.row_loss[row] = (p.loss_has_z && kind == kValid) ? __fadd_rn(ce, zl) : ce;
    if (p.lse) p.lse[row] = lse;
    const int64_t am = (kind == kIgnored || inconsistent) ? -1 : static_cast<int64_t>(best_j);
    if (p.argmax) p.argmax[row] = am;
    if (p.row_correct) p.row_correct[row] = (kind == kValid && !inconsistent && am == y) ? 1.f : 0.f;
  }
  flags = __reduce_or_sync(0xffffffffu, flags);
  if ((threadIdx.x & 31) == 0 && flags && p.error_flags) atomicOr(p.error_flags, flags);
}

// The rows flagged by the combine (CeRowStats.pad ≠ 0: ignored rows of an inconsistent tiling;
// BY_T, the ENT combine's: t NaN, which only such rows and rows already NaN have) get a NaN
// gradient row; one warp per row, the others return after reading their flag.
template <class TG, bool BY_T = false>
__global__ void __launch_bounds__(256) vp_nan_rows_kernel(const CeRowStats* stats, int64_t rows,
                                                          char* g, int64_t cols, int64_t ld) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; row < rows; row += warps) {
    if constexpr (BY_T) {
      if (!isnan(stats[row].t)) continue;
    } else {
      if (stats[row].pad == 0.f) continue;
    }
    TG* out = reinterpret_cast<TG*>(g + row * ld * int64_t(sizeof(TG)));
    for (int64_t j = lane; j < cols; j += 32) out[j] = TG(qnan());
  }
}

// Threads of a phase-1 CTA: enough for U vectors each on the longest row (a row start may sit
// anywhere in its 16-byte vector), whole warps, at most kStatsThreads.
unsigned stats_threads(int64_t vocab, int E, int U) {
  const int64_t nvec_max = (E - 1 + vocab + E - 1) / E;
  const int64_t t = (nvec_max + U - 1) / U;
  return static_cast<unsigned>(t < kStatsThreads ? (t + 31) / 32 * 32 : kStatsThreads);
}

template <class TZ>
fce_status launch_stats_typed(const VpStatsArgs& a, SParams p, cudaStream_t s) {
  constexpr int E = vec_elems<TZ>();
  const int mode = p.smooth ? kGeneral : p.cap ? kCap : kPlain;
  const unsigned threads =
      stats_threads(a.vocab_local, E, mode == kGeneral ? kStatsUnroll / 2 : kStatsUnroll);
  p.z_row_bytes = a.row_stride * Ty<TZ>::kBytes;
  for (int64_t r0 = 0; r0 < a.row_count; r0 += kMaxRowsPerLaunch) {
    const int64_t n = a.row_count - r0 < kMaxRowsPerLaunch ? a.row_count - r0 : kMaxRowsPerLaunch;
    SParams q = p;
    q.row_begin = a.row_begin + r0;
    q.logits = static_cast<const char*>(a.logits) + r0 * p.z_row_bytes;
    const unsigned blocks = static_cast<unsigned>(n);
    if (a.opt.vp_entropy) {  // (the general mode's e sum rides on its halved unroll)
      if (mode == kPlain) vp_stats_kernel<TZ, kPlain, true><<<blocks, threads, 0, s>>>(q);
      else if (mode == kCap) vp_stats_kernel<TZ, kCap, true><<<blocks, threads, 0, s>>>(q);
      else vp_stats_kernel<TZ, kGeneral, true><<<blocks, threads, 0, s>>>(q);
    } else if (mode == kPlain) {
      vp_stats_kernel<TZ, kPlain><<<blocks, threads, 0, s>>>(q);
    } else if (mode == kCap) {
      vp_stats_kernel<TZ, kCap><<<blocks, threads, 0, s>>>(q);
    } else {
      vp_stats_kernel<TZ, kGeneral><<<blocks, threads, 0, s>>>(q);
    }
    FCE_TRY(launch_check(a.fn, "vp_stats_kernel"));
  }
  return FCE_SUCCESS;
}

}  // namespace

fce_status launch_vp_stats(const VpStatsArgs& a, cudaStream_t s) {
  if (a.row_count < 0 || a.row_begin < 0 || a.vocab_local < 1 || a.vocab_local > INT32_MAX ||
      a.vocab_start < 0 || a.vocab_start + a.vocab_local > a.vocab_total ||
      a.vocab_total > INT32_MAX || a.row_stride < a.vocab_local || !a.logits || !a.targets ||
      !a.stats)
    return fail(FCE_ERROR_INTERNAL,
                "%s: launch_vp_stats: bad arguments (rows %lld+%lld, classes %lld+%lld of %lld, "
                "stride %lld)",
                a.fn, static_cast<long long>(a.row_begin), static_cast<long long>(a.row_count),
                static_cast<long long>(a.vocab_start), static_cast<long long>(a.vocab_local),
                static_cast<long long>(a.vocab_total), static_cast<long long>(a.row_stride));
  if (a.row_count == 0) return FCE_SUCCESS;
  if (a.opt.batch_invariant) return launch_vp_stats_exact(a, s);
  const CeOptions& opt = a.opt;
  SParams p = stats_params(a);
  p.smooth = opt.label_smoothing > 0.f && !opt.soft_targets ? 1 : 0;
  p.write_weight = a.weight_written ? 0 : 1;
  switch (a.logits_dtype) {
    case FCE_FLOAT32: FCE_TRY(launch_stats_typed<float>(a, p, s)); break;
    case FCE_FLOAT16: FCE_TRY(launch_stats_typed<__half>(a, p, s)); break;
    case FCE_BFLOAT16: FCE_TRY(launch_stats_typed<__nv_bfloat16>(a, p, s)); break;
    default:
      return fail(FCE_ERROR_UNSUPPORTED, "%s: logits dtype %d", a.fn, a.logits_dtype);
  }
  // class probabilities: u_r and W_r of the row's own ω_j q'_j, against the m_r just written
  return opt.soft_targets ? launch_vp_soft_sums(a, s) : FCE_SUCCESS;
}

fce_status launch_vp_weights(const char* fn, const CeOptions& opt, int64_t rows,
                             int64_t vocab_start, int64_t vocab_local, float* stats,
                             cudaStream_t s) {
  if (!opt.class_weights || rows < 0 || vocab_start < 0 || vocab_local < 1 || !stats)
    return fail(FCE_ERROR_INTERNAL, "%s: launch_vp_weights: bad arguments", fn);
  // class probabilities: W_r = Σ_j ω_j q'_j differs by row (launch_vp_stats writes it)
  if (rows == 0 || opt.soft_targets) return FCE_SUCCESS;
  // a few blocks share the row writes (each sums the weights itself, in the same order)
  const int64_t per_block = int64_t(kWeightThreads) * 64;
  const int64_t blocks = (rows + per_block - 1) / per_block;
  vp_weights_kernel<<<static_cast<unsigned>(blocks < 8 ? blocks : 8), kWeightThreads, 0, s>>>(
      opt.class_weights + vocab_start, vocab_local, stats, rows);
  return launch_check(fn, "vp_weights_kernel");
}

fce_status launch_vp_nan_rows(const char* fn, const CeRowStats* stats, int64_t rows, void* g,
                              int dtype, int64_t cols, int64_t ld, cudaStream_t s, bool by_t) {
  if (rows <= 0 || cols <= 0) return FCE_SUCCESS;
  int64_t blocks = (rows + 7) / 8;  // 8 warps of 256 threads
  if (blocks > 4096) blocks = 4096;
  char* gp = static_cast<char*>(g);
  const unsigned nb = static_cast<unsigned>(blocks);
  switch (dtype) {
    case FCE_FLOAT32:
      if (by_t) vp_nan_rows_kernel<float, true><<<nb, 256, 0, s>>>(stats, rows, gp, cols, ld);
      else vp_nan_rows_kernel<float><<<nb, 256, 0, s>>>(stats, rows, gp, cols, ld);
      break;
    case FCE_FLOAT16:
      if (by_t) vp_nan_rows_kernel<__half, true><<<nb, 256, 0, s>>>(stats, rows, gp, cols, ld);
      else vp_nan_rows_kernel<__half><<<nb, 256, 0, s>>>(stats, rows, gp, cols, ld);
      break;
    case FCE_BFLOAT16:
      if (by_t) vp_nan_rows_kernel<__nv_bfloat16, true><<<nb, 256, 0, s>>>(stats, rows, gp, cols, ld);
      else vp_nan_rows_kernel<__nv_bfloat16><<<nb, 256, 0, s>>>(stats, rows, gp, cols, ld);
      break;
    default:
      return fail(FCE_ERROR_INTERNAL, "%s: launch_vp_nan_rows: dtype %d", fn, dtype);
  }
  return launch_check(fn, "vp_nan_rows_kernel");
}

fce_status launch_vp_combine(const VpCombineArgs& a, cudaStream_t s) {
  if (a.ranks < 1 || a.rows < 0 || a.row_begin < 0 || a.vocab_total < 1 ||
      a.vocab_total > INT32_MAX || (!a.targets && !a.opt.soft_targets) || !a.gathered)
    return fail(FCE_ERROR_INTERNAL, "%s: launch_vp_combine: bad arguments", a.fn);
  if (a.rows == 0) return FCE_SUCCESS;
  const CeOptions& opt = a.opt;
  CParams p;
  memset(&p, 0, sizeof p);
  p.gathered = a.gathered;
  p.ranks = a.ranks;
  p.rows = a.rows;
  p.row_begin = a.row_begin;
  p.targets = a.targets;
  p.class_weights = opt.class_weights;
  p.ignore_index = opt.ignore_index;
  p.shift_T = opt.shift_seq_len;
  p.shift_k = opt.shift_seq_len > 0 ? (opt.shift > 0 ? opt.shift : 1) : 0;
  p.vocab_total = static_cast<int>(a.vocab_total);
  p.targets_int64 = opt.targets_int64 ? 1 : 0;
  p.reduction = opt.reduction;
  p.smooth = opt.label_smoothing > 0.f ? 1 : 0;
  p.token_scaling = opt.token_scaling ? 1 : 0;
  p.soft = opt.soft_targets ? 1 : 0;
  if (p.soft) p.smooth = 0;  // ε is in q'
  p.loss_has_z = opt.reduction == FCE_REDUCTION_NONE ? 1 : 0;
  // as ce/device.cuh's make_params
  p.one_minus_eps = static_cast<float>(1.0 - static_cast<double>(opt.label_smoothing));
  p.eps_over_V = static_cast<float>(static_cast<double>(opt.label_smoothing) /
                                    static_cast<double>(a.vocab_total));
  p.lambda = opt.z_loss_scale;
  p.stats_out = a.stats_out;
  p.row_loss = a.row_loss;
  p.row_zloss = a.row_zloss;
  p.lse = a.lse;
  p.argmax = a.argmax;
  p.row_correct = a.row_correct;
  p.error_flags = a.error_flags;
  p.entropy = a.entropy;
  int64_t blocks = (a.rows + kCombineThreads - 1) / kCombineThreads;
  if (blocks > 65536) blocks = 65536;
  const unsigned nb = static_cast<unsigned>(blocks);
  if (opt.batch_invariant && opt.vp_entropy)
    vp_combine_kernel<true, true><<<nb, kCombineThreads, 0, s>>>(p);
  else if (opt.batch_invariant)
    vp_combine_kernel<false, true><<<nb, kCombineThreads, 0, s>>>(p);
  else if (opt.vp_entropy)
    vp_combine_kernel<true><<<nb, kCombineThreads, 0, s>>>(p);
  else
    vp_combine_kernel<<<nb, kCombineThreads, 0, s>>>(p);
  return launch_check(a.fn, "vp_combine_kernel");
}

}  // namespace cuda
}  // namespace fce
