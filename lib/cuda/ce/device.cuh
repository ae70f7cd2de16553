// ce/device.cuh — what the cross-entropy row kernels (ce/kernels.cu, ce/reduce.cu) compute, on
// the device: the kernel parameters (KParams, made on the host by make_params), the transform
// a = s·z or c·tanh(s·z/c), the online (max, Σexp[, Σω·a]) partials and their warp / CTA trees,
// the argmax keys, what a row is (docs/semantics.md rules 1-4, 6), its outputs (rules 2, 3, 8), and THE
// one place a gradient element is computed (grad_vector, rule 9), which the forward, two-pass
// and backward kernels all call, so that they write the same bits (rules 12, 14).
//
// In an anonymous namespace, as when the row kernels were one file (see ce/memory.cuh): each
// kernel translation unit compiles its own internal copy. Include it only from those files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/ce/geometry.cuh"
#include "cuda/ce/memory.cuh"
#include "cuda/ce/rows.cuh"

namespace fce {
namespace cuda {
namespace {

// (Mode, kLog2e, ex2, neg_inf, qnan and prob: ce/memory.cuh, shared with the
// vocabulary-parallel kernels.)

// Everything a row kernel needs, resolved on the host (make_params) in the same way for forward
// and backward, so that both compute the same gradient bits.
struct KParams {
  const char* logits;  // row row_begin of this launch
  char* grad;          // row row_begin of this launch, or nullptr
  int64_t z_row_bytes, g_row_bytes;
  int64_t row_begin;   // global index of this launch's first row
  int64_t ignore_index;
  int64_t shift_T;     // 0 = no shift
  int64_t shift_k;     // k >= 1 when shift_T > 0
  const void* targets;
  const float* class_weights;
  const CeDenoms* denoms;
  const float* grad_output;
  const float* lse_in;
  float* row_loss;
  float* row_zloss;
  float* lse_out;
  CeRowStats* stats_out;       // forward: (m, log s, t) per row, for a later column slice
  const CeRowStats* stats_in;  // backward: from stats_out; nullptr = from lse_in
  int64_t* argmax_out;         // forward: argmax per row (−1 ignored)
  float* row_correct;          // forward: 1 when argmax == target (valid rows), else 0
  uint32_t* error_flags;
  int vocab;            // elements of a row in this launch's buffers (a column slice's width)
  int vocab_total;      // V of the problem (targets, ε/V, Ω); = vocab unless a slice
  int64_t col_begin;    // global class of the buffers' first column (backward slices; else 0)
  int rescale;          // backward: fce_backward_rescale (see ce/rows.cuh)
  int cluster;          // CTAs per row (register path; 1 to kMaxCluster)
  int64_t rows_in_launch;  // register path: the rows of this launch
  int64_t prefetch_rows;   // register path: > 0 = prefetch the slice of the row this far ahead
  int reg_smem;            // register path: vectors per thread in shared memory (RegConfig::smem)
  int pdl;                 // launched as a programmatic dependent of the denominators kernel
  int xmbar_ok;            // register path: clusters exchange through st.async + mbarrier
                           // (the cluster-barrier exchange otherwise)
  int targets_int64;
  int reduction;
  int smooth;           // label smoothing ε > 0
  int cap;              // softcap c > 0
  int token_scaling;    // loss and gradient of each valid row times the detached p_y
  int loss_has_z;       // row_loss holds ce + λ·lse² (reduction none) rather than ce alone
  float scale;          // s
  float softcap;        // c
  float s_over_c;       // s / c
  float one_minus_eps;  // 1 − ε
  float eps_over_V;     // ε / V
  float lambda;         // z-loss λ
  float two_lambda;     // 2λ
  // docs/semantics.md rule 18 (the ROWT instantiations of the stream kernel only):
  float* entropy_out;          // forward: H per row, every row, or nullptr
  const float* grad_lse;       // with a gradient: the upstream gradient of each row's lse, or nullptr
  const float* grad_entropy;   // forward with a gradient: of each row's entropy, or nullptr
  // docs/semantics.md rule 19 (the SOFT instantiations of the stream kernel only): targets are
  // class probabilities of this dtype, q_ld elements between rows, the buffers' first column at
  // q_col: [total rows, vocab_total] from column col_begin, or a vocabulary shard's own
  // [total rows, vocab_local] (fce_vp_backward, fce_vp_linear_backward)
  int q_dtype;
  int64_t q_ld, q_col;
};

template <int MODE> __device__ __forceinline__ bool use_cap(const KParams& p) {
  return MODE == kCap || (MODE == kGeneral && p.cap);
}
template <int MODE> __device__ __forceinline__ bool use_smooth(const KParams& p) {
  return MODE == kGeneral && p.smooth;
}

// ------------------------------------------------- programmatic dependent launch ----
// fce_forward / fce_backward launch the row kernels and the finalize as programmatic
// dependents (sm_90, KParams::pdl / launch_ce_finalize): a dependent grid may start before the
// grid ahead of it ends, as soon as every CTA of that grid has started (pdl_trigger). It must
// wait (pdl_wait) before it reads what that grid wrote: the row kernels before the denominators
// (load_row_info, thread 0), the finalize before the row values. Everything else they read
// (logits, targets, weights, the upstream gradient) comes from before the denominators kernel,
// which starts only when the caller's earlier work is complete. No-ops before sm_90.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// ------------------------------------------------------------------- the math ----
// docs/semantics.md steps 1-2: a = s·z, or a = c·tanh(s·z/c) with t = tanh(s·z/c) kept for the factor 1 − t².
template <int MODE>
__device__ __forceinline__ float xform(float z, const KParams& p, float& t) {
  if constexpr (MODE == kUnit) {  // s = 1: z·1 = z
    t = 0.f;
    return z;
  }
  if (use_cap<MODE>(p)) {
    t = tanhf(__fmul_rn(z, p.s_over_c));
    return __fmul_rn(p.softcap, t);
  }
  t = 0.f;
  return __fmul_rn(z, p.scale);
}

// A partial reduction of (part of) a row: running max m, Σ exp(a − m), and Σ ω_j (a_j − c)
// (label smoothing; c is the row's reference value, its first transformed logit when finite,
// so that rows whose logits share a huge offset do not cancel; in double).
struct Partial {
  float m;
  float s;
  double sw;
};
__device__ __forceinline__ Partial partial_identity() { return Partial{neg_inf(), 0.f, 0.0}; }

// A sum s taken against m, rescaled to M ≥ m: s itself when m = M (which also covers
// m = M = ±inf: no inf − inf), else s·exp(m − M) (0 when m = −inf or the factor underflows).
__device__ __forceinline__ float rescaled(float s, float m, float M) {
  return m == M ? s : __fmul_rn(s, ex2(__fmul_rn(__fsub_rn(m, M), kLog2e)));
}

// Merges (m2, s2, sw2) into x. Symmetric bit for bit (merge(x, y) == merge(y, x)), so a
// butterfly leaves the same value in every lane. SW = false: Σω·a is not carried.
template <bool SW>
__device__ __forceinline__ void combine(Partial& x, float m2, float s2, double sw2) {
  const float mn = fmaxf(x.m, m2);
  // the equal case also covers m = mn = ±inf (no inf − inf)
  const float s1 = rescaled(x.s, x.m, mn), t2 = rescaled(s2, m2, mn);
  x.m = mn;
  x.s = __fadd_rn(s1, t2);
  if (SW) x.sw = __dadd_rn(x.sw, sw2);
}

template <bool SW> __device__ __forceinline__ void warp_reduce(Partial& x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, x.m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, x.s, o);
    const double w2 = SW ? __shfl_xor_sync(0xffffffffu, x.sw, o) : 0.0;
    combine<SW>(x, m2, s2, w2);
  }
}

// A warp's (max, Σ) with the maximum first: the lanes' maximum M (a butterfly of fmaxf), then
// each lane's sum rescaled to M once and the sums added in a butterfly. Every lane ends with
// the same bits. Against warp_reduce's merge at each of five levels (two exponentials, a
// compare and a select each): 4 instructions per lane in place of about 45.
__device__ __forceinline__ Partial warp_reduce_max_first(const Partial& x) {
  float M = x.m;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  float s = rescaled(x.s, x.m, M);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
  return Partial{M, s, 0.0};
}

// CTA-wide reduce that every warp finishes itself (the same tree, so the same bits in every
// lane of every warp): no second barrier to broadcast the result. Without label smoothing
// (SW = false) both levels take the maximum first (warp_reduce_max_first).
template <bool SW> __device__ __forceinline__ Partial block_reduce_all(Partial x, Partial* s_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if constexpr (!SW) {
    x = warp_reduce_max_first(x);
    if (lane == 0) s_warp[warp] = x;
    __syncthreads();
    Partial r = partial_identity();
    if (lane < nwarps) r = s_warp[lane];
    return warp_reduce_max_first(r);
  }
  warp_reduce<SW>(x);
  if (lane == 0) s_warp[warp] = x;
  __syncthreads();
  Partial r = partial_identity();
  if (lane < nwarps) r = s_warp[lane];
  warp_reduce<SW>(r);
  return r;
}

// t = Σ exp(a − m)(a − m) of sums (s, t) against m, made against m' ≥ m:
// exp(m − m')(t + s (m − m')); 0 when m = −inf (nothing summed) or exp(m − m') is 0 (m − m'
// may even overflow to −inf, where s (m − m') would make 0·inf).
__device__ __forceinline__ float rescale_t(float m, float m2, float s, float t) {
  const float dm = __fsub_rn(m, m2);
  const float r = ex2(__fmul_rn(dm, kLog2e));
  return m == neg_inf() || r == 0.f ? 0.f : __fmul_rn(r, __fmaf_rn(s, dm, t));
}

// rule 18's t of a CTA against its maximum M, from each thread's t against its own maximum acc.m:
// rescaled to M, then summed in a fixed tree (every thread gets the same bits). s_warp, which
// block_reduce_all has just read, is reused as scratch: the caller has had a barrier follow
// that read.
__device__ __forceinline__ float block_sum_t(const Partial& acc, float M, float tacc,
                                             Partial* s_warp) {
  if (acc.m != M) tacc = rescale_t(acc.m, M, acc.s, tacc);
  float* s_sum = reinterpret_cast<float*>(s_warp);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) tacc = __fadd_rn(tacc, __shfl_xor_sync(0xffffffffu, tacc, o));
  if (lane == 0) s_sum[warp] = tacc;
  __syncthreads();
  float tot = lane < nwarps ? s_sum[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) tot = __fadd_rn(tot, __shfl_xor_sync(0xffffffffu, tot, o));
  __syncthreads();  // s_warp may be used again
  return tot;
}

// ROWT with t: a warp's (max, Σ) with the maximum first (warp_reduce_max_first, the same bits)
// and its t against that maximum in sw, from each lane's t against its own maximum x.m
// (rescale_t), summed in a butterfly: every lane ends with the same bits.
__device__ __forceinline__ Partial warp_reduce_t(const Partial& x, float t) {
  Partial w = warp_reduce_max_first(x);
  if (x.m != w.m) t = rescale_t(x.m, w.m, x.s, t);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) t = __fadd_rn(t, __shfl_xor_sync(0xffffffffu, t, o));
  w.sw = static_cast<double>(t);
  return w;
}

// ROWT with t, without label smoothing: block_reduce_all<false>'s partial (the same m and s, bit
// for bit) with the CTA's t against its maximum in sw, from each thread's t against its own
// maximum x.m. Each level rescales t to the maximum it has just taken (warp_reduce_t) and sums it
// beside s, so block_reduce_all's one barrier serves both, where block_reduce_all then
// block_sum_t take four in a row's critical path.
__device__ __forceinline__ Partial block_reduce_all_t(const Partial& x, float t, Partial* s_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const Partial w = warp_reduce_t(x, t);
  if (lane == 0) s_warp[warp] = w;
  __syncthreads();
  Partial r = partial_identity();
  if (lane < nwarps) r = s_warp[lane];
  return warp_reduce_t(r, static_cast<float>(r.sw));
}

// ------------------------------------------- 16-bit rows, the maximum first ----
// A row's (or a thread's share's) maximum can be taken on the raw 16-bit values two at a time
// (max.bf16x2 / max.f16x2, sm_80+: like fmaxf, a NaN loses against a number) when a = z (kUnit),
// and its Σ exp then against that maximum with no running maximum to test and no rescale per
// vector (the register path's two-pass fold, regs_row; the bulk kernel's groups, fold_group_unit).
template <class TZ>
__device__ __forceinline__ uint32_t packed_neg_inf() {
  static_assert(Ty<TZ>::kBytes == 2, "the two-pass fold is for 16-bit rows");
  return std::is_same<TZ, __half>::value ? 0xfc00fc00u : 0xff80ff80u;
}
template <class TZ>
__device__ __forceinline__ uint32_t max2_raw(uint32_t a, uint32_t b) {
  uint32_t r;
  if constexpr (std::is_same<TZ, __half>::value)
    asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  else asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
// The maximum of a packed running maximum pm (max2_raw) and a float one fm.
template <class TZ>
__device__ __forceinline__ float max_total(uint32_t pm, float fm) {
  return fmaxf(fm, fmaxf(raw_to_float<TZ>(pm & 0xffffu), raw_to_float<TZ>(pm >> 16)));
}
// A vector [j0, j0 + E) as floats, its elements outside the row [0, V) set to −inf when it is
// not full (they add exp(−inf) = 0 to a sum).
template <class TZ, class I>
__device__ __forceinline__ void unpack_in_row(const uint4& raw, I j0, bool full, int V,
                                              float (&a)[vec_elems<TZ>()]) {
  unpack<TZ>(raw, a);
  if (!full) {
#pragma unroll
    for (int q = 0; q < vec_elems<TZ>(); ++q)
      if (j0 + q < 0 || j0 + q >= V) a[q] = neg_inf();
  }
}

// Σ exp(a − ms) of a vector's in-row elements into s2 with one FFMA per term (the second pass of
// the two-pass fold, without t): the term is 2^(a·log2e − C), C = ms·log2e rounded, which is
// exp(a − ms) to the same one rounding of its exponent as sumexp_vector's (a − ms exact, then
// ·log2e) times 2^r, r = ms·log2e − C (exact by an FMA), the same factor in every term: the
// caller multiplies the sum by 2^−r once. Only for |ms| < kFfmaSumMax = 2^20, where |r| ≤ 2^−4
// (half an ulp of C); a row whose maximum is larger (up to ±FLT_MAX: rule 9's constant huge
// rows) keeps the subtraction, exact there.
constexpr float kFfmaSumMax = 1048576.f;
template <class TZ, class I>
__device__ __forceinline__ void sumexp_vector_c(const uint4& raw, I j0, bool full, int V, float C,
                                                float& s2) {
  constexpr int E = vec_elems<TZ>();
  float a[E];
  unpack_in_row<TZ>(raw, j0, full, V, a);
#pragma unroll
  for (int q = 0; q < E; ++q) s2 = __fadd_rn(s2, ex2(__fmaf_rn(a[q], kLog2e, -C)));
}
// Σ exp(a − ms) of a vector's in-row elements into s, each term as online_vector adds it (the
// second pass of the two-pass fold). WITH_T (ROWT, docs/semantics.md rule 18): also
// t = Σ exp(a − ms)(a − ms) into t, with a − ms clamped to −FLT_MAX so that a −inf element
// (e = 0) adds 0, never 0·inf; without it t is not touched.
template <class TZ, bool WITH_T, class I>
__device__ __forceinline__ void sumexp_vector(const uint4& raw, I j0, bool full, int V, float ms,
                                              float& s, float& t) {
  constexpr int E = vec_elems<TZ>();
  float a[E];
  unpack_in_row<TZ>(raw, j0, full, V, a);
#pragma unroll
  for (int q = 0; q < E; ++q) {
    if constexpr (WITH_T) {
      const float d = fmaxf(__fsub_rn(a[q], ms), -3.40282347e38f);
      const float e = ex2(__fmul_rn(d, kLog2e));
      s = __fadd_rn(s, e);
      t = __fmaf_rn(e, d, t);
    } else {
      s = __fadd_rn(s, ex2(__fmul_rn(__fsub_rn(a[q], ms), kLog2e)));
    }
  }
}
// ROWT, the second pass with t (sumexp_vector_c's form, |ms| < kFfmaSumMax): each term
// e = 2^x, x = a·log2e − C, into s2, and e·x into t2. As x = (a − ms)·log2e + r exactly before
// its one rounding, the caller's t = Σ exp(a − ms)(a − ms) is (t2 − r·s2)·2^−r·ln 2: one FFMA
// per term beside the sum's own FFMA, exponential and add, where sumexp_vector's t takes six
// instructions a term. A −inf element (an out-of-row one too) makes e·x = 0·(−inf) = NaN
// unless CLAMP (x clamped to −FLT_MAX: it adds 0, one FMNMX per term more): the callers sum
// without it and sum again with it where t2 came out NaN (t2_again), which gives the clamped
// form's very bits at the cost of the rows with −inf (or NaN) entries only.
constexpr float kLn2 = 0.693147180559945309f;
template <class TZ, bool CLAMP, class I>
__device__ __forceinline__ void sumexp_t_vector_c(const uint4& raw, I j0, bool full, int V, float C,
                                                  float& s2, float& t2) {
  constexpr int E = vec_elems<TZ>();
  float a[E];
  unpack_in_row<TZ>(raw, j0, full, V, a);
#pragma unroll
  for (int q = 0; q < E; ++q) {
    const float x = __fmaf_rn(a[q], kLog2e, -C);
    const float e = ex2(x);
    s2 = __fadd_rn(s2, e);
    t2 = __fmaf_rn(e, CLAMP ? fmaxf(x, -3.40282347e38f) : x, t2);
  }
}
// Whether sums of sumexp_t_vector_c<…, false> must be taken again with CLAMP: t2 is NaN (a −inf
// element, or a NaN one, where the second sum is NaN too).
__device__ __forceinline__ bool t2_again(float t2) { return isnan(t2); }
// kUnit, 16-bit: U full vectors folded into acc with the maximum first: their maximum on the
// packed raw values, one rescale of acc to the new maximum, then one FFMA and an exponential per
// element (sumexp_vector_c) — against online_vector's maximum, test and rescale per vector.
// The caller keeps online_vector where the argmax is tracked. WT (ROWT, docs/semantics.md rule
// 18): *tacc also carries t = Σ exp(a − m)(a − m) against acc.m (rescale_t when it grows; the
// terms by sumexp_t_vector_c, or sumexp_vector past kFfmaSumMax), as online_vector's ENT.
template <class TZ, int U, bool WT = false>
__device__ __forceinline__ void fold_group_unit(const uint4 (&buf)[U], Partial& acc,
                                                float* tacc = nullptr) {
  uint32_t pm = packed_neg_inf<TZ>();
#pragma unroll
  for (int u = 0; u < U; ++u)
    pm = max2_raw<TZ>(pm, max2_raw<TZ>(max2_raw<TZ>(buf[u].x, buf[u].y),
                                       max2_raw<TZ>(buf[u].z, buf[u].w)));
  const float mn = fmaxf(acc.m, max_total<TZ>(pm, neg_inf()));
  if constexpr (WT) {
    if (acc.m != mn) *tacc = rescale_t(acc.m, mn, acc.s, *tacc);
  }
  acc.s = rescaled(acc.s, acc.m, mn);
  acc.m = mn;
  const float ms = mn == neg_inf() ? 0.f : mn;  // all −inf so far: every term is exp(−inf) = 0
  if (fabsf(ms) < kFfmaSumMax) {
    const float C = __fmul_rn(ms, kLog2e), r = __fmaf_rn(ms, kLog2e, -C);
    float s2 = 0.f, t2 = 0.f;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if constexpr (WT) sumexp_t_vector_c<TZ, false>(buf[u], 0, true, 0, C, s2, t2);
      else sumexp_vector_c<TZ>(buf[u], 0, true, 0, C, s2);
    }
    if (WT && t2_again(t2)) {  // (a −inf element: the clamped sums)
      s2 = t2 = 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u) sumexp_t_vector_c<TZ, true>(buf[u], 0, true, 0, C, s2, t2);
    }
    const float back = ex2(-r);
    acc.s = __fadd_rn(acc.s, __fmul_rn(s2, back));
    if constexpr (WT) *tacc = __fadd_rn(*tacc, __fmul_rn(__fmul_rn(__fmaf_rn(-r, s2, t2), back), kLn2));
  } else {  // (a huge or infinite maximum: the subtraction, exact)
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if constexpr (WT) {
        sumexp_vector<TZ, true>(buf[u], 0, true, 0, ms, acc.s, *tacc);
      } else {
        float a[vec_elems<TZ>()];
        unpack<TZ>(buf[u], a);
#pragma unroll
        for (int q = 0; q < vec_elems<TZ>(); ++q)
          acc.s = __fadd_rn(acc.s, ex2(__fmul_rn(__fsub_rn(a[q], ms), kLog2e)));
      }
    }
  }
}

// Phase 1 on one vector: online max / Σexp (and Σω·(a − c) when smoothing) of its in-row
// elements. With `track`, am follows the index of the first element equal to the thread's
// running maximum (a thread visits its vectors in increasing index order, so a later equal
// value never replaces it): the argmax at the cost of a compare per vector (see row_argmax).
// ENT (docs/semantics.md rule 18, the stream kernel's ROWT forward): *tacc also carries
// t = Σ exp(a − m)(a − m) against the thread's running maximum m, rescaled with it
// (t ← exp(m − m')(t + s (m − m')) when m grows to m'); a −inf element adds nothing.
template <class TZ, int MODE, class I, bool ENT = false>
__device__ __forceinline__ void online_vector(const uint4& raw, I j0, bool full, const KParams& p,
                                              float c, Partial& acc, bool track, int& am,
                                              float* tacc = nullptr) {
  constexpr int E = vec_elems<TZ>();
  float a[E];
  unpack<TZ>(raw, a);
#pragma unroll
  for (int q = 0; q < E; ++q) {
    float t;
    a[q] = xform<MODE>(a[q], p, t);
  }
  if (!full) {
#pragma unroll
    for (int q = 0; q < E; ++q)
      if (j0 + q < 0 || j0 + q >= p.vocab) a[q] = neg_inf();
  }
  float vm = a[0];
#pragma unroll
  for (int q = 1; q < E; ++q) vm = fmaxf(vm, a[q]);
  if (track && vm > acc.m) {  // a new running maximum (rare after the first vectors)
    int q0 = E - 1;
#pragma unroll
    for (int q = E - 1; q >= 0; --q) q0 = a[q] == vm ? q : q0;
    am = static_cast<int>(j0) + q0;
  }
  const float mn = fmaxf(acc.m, vm);
  if constexpr (ENT) {
    if (acc.m != mn) *tacc = rescale_t(acc.m, mn, acc.s, *tacc);
  }
  acc.s = acc.m == mn ? acc.s : __fmul_rn(acc.s, ex2(__fmul_rn(__fsub_rn(acc.m, mn), kLog2e)));
  acc.m = mn;
  const float ms = mn == neg_inf() ? 0.f : mn;  // all −inf so far: every term is exp(−inf) = 0
  if constexpr (ENT) {
#pragma unroll
    for (int q = 0; q < E; ++q) {
      const float d = __fsub_rn(a[q], ms);
      const float e = ex2(__fmul_rn(d, kLog2e));
      acc.s = __fadd_rn(acc.s, e);
      *tacc = e != 0.f ? __fmaf_rn(e, d, *tacc) : *tacc;
    }
  } else {
#pragma unroll
    for (int q = 0; q < E; ++q) acc.s = __fadd_rn(acc.s, ex2(__fmul_rn(__fsub_rn(a[q], ms), kLog2e)));
  }
  if (use_smooth<MODE>(p)) {
    // the vector's Σω·(a − c) in float (E terms), the row's in double
    float vs = 0.f;
#pragma unroll
    for (int q = 0; q < E; ++q) {
      const I j = j0 + q;
      const float d = __fsub_rn(a[q], c);
      if (full || (j >= 0 && j < p.vocab))
        vs = p.class_weights ? __fmaf_rn(__ldg(p.class_weights + j), d, vs) : __fadd_rn(vs, d);
    }
    acc.sw = __dadd_rn(acc.sw, static_cast<double>(vs));
  }
}

// The smoothing sum's reference c of a row: its first transformed logit when finite, else 0
// (a non-finite a_0 makes the smoothing term infinite or NaN anyway). Every thread of every CTA
// of the row computes the same value from the same element.
template <class TZ, int MODE>
__device__ __forceinline__ float smoothing_reference(const KParams& p, const char* zrow) {
  if (!use_smooth<MODE>(p)) return 0.f;
  float t;
  const float a0 = xform<MODE>(raw_to_float<TZ>(ld_elem<TZ>(zrow)), p, t);
  return isfinite(a0) ? a0 : 0.f;
}

// The argmax of a row (docs/semantics.md rule 15) as a minimum over keys: j for a NaN element, 2^32 + j
// for an element equal to the row maximum m, ~0 for the others; the row's smallest key names the
// first NaN, else the first maximum (torch.argmax's choice). A thread's key comes from phase 1's
// tracking (its first index of its own maximum, when that is the row's) — except on the rare
// rows whose Σexp is NaN (a NaN or a +inf in the row), where argmax_vector scans the elements
// again. A row of −inf only has no key: argmax 0.
constexpr uint64_t kNoArgmax = ~uint64_t(0);
template <class TZ, int MODE, class I>
__device__ __forceinline__ void argmax_vector(const uint4& raw, I j0, bool full, const KParams& p,
                                              float m, uint64_t& best) {
  constexpr int E = vec_elems<TZ>();
  float a[E];
  unpack<TZ>(raw, a);
#pragma unroll
  for (int q = 0; q < E; ++q) {
    const I j = j0 + q;
    float t;
    const float x = xform<MODE>(a[q], p, t);
    if (full || (j >= 0 && j < p.vocab)) {
      const uint64_t key = isnan(x) ? static_cast<uint64_t>(j)
                         : x == m   ? (uint64_t(1) << 32) | static_cast<uint64_t>(j)
                                    : kNoArgmax;
      best = key < best ? key : best;
    }
  }
}
__device__ __forceinline__ uint64_t warp_min_u64(uint64_t x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t y = __shfl_xor_sync(0xffffffffu, x, o);
    x = y < x ? y : x;
  }
  return x;
}
// CTA-wide minimum; every lane of warp 0 returns it.
__device__ __forceinline__ uint64_t block_min_u64(uint64_t x, uint64_t* s_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  x = warp_min_u64(x);
  __syncthreads();  // s_warp may be in use by an earlier reduction
  if (lane == 0) s_warp[warp] = x;
  __syncthreads();
  uint64_t r = kNoArgmax;
  if (warp == 0) {
    if (lane < nwarps) r = s_warp[lane];
    r = warp_min_u64(r);
  }
  return r;
}

// What thread 0 of a CTA learns about its row (docs/semantics.md rules 1-4, 6); shared via smem.
struct RowInfo {
  int64_t y;
  int kind;
  float wy;     // ω_y (valid rows)
  float ay;     // a_y (valid rows, when asked)
  float k;      // upstream scale of the cross-entropy terms (rule 6), when there is a gradient
  float kz;     // upstream scale of the z-loss term (rule 6)
  float rho;    // k_z / k as D / n for mean (1 otherwise); 0 when only the z term is left
  float omega;  // Ω (label smoothing)
};

// (classify_row, rules 1-3: ce/memory.cuh)

template <class TZ, int MODE>
__device__ RowInfo load_row_info(const KParams& p, int64_t row, const char* zrow, bool need_ay) {
  if (p.pdl) pdl_wait();  // p.denoms is the denominators kernel's (see pdl_trigger)
  RowInfo r;
  r.kind = classify_row(p, row, &r.y);
  r.wy = 0.f;
  r.ay = 0.f;
  if (r.kind == kValid) {
    r.wy = p.class_weights ? p.class_weights[r.y] : 1.f;
    if (need_ay) {  // the target logit, read directly, through the same transform as all others
      float t;
      r.ay = xform<MODE>(raw_to_float<TZ>(ld_elem<TZ>(zrow + r.y * Ty<TZ>::kBytes)), p, t);
    }
  }
  r.k = 0.f;
  r.kz = 0.f;
  r.rho = 1.f;
  if (p.grad) {
    float g = 1.f;
    if (p.grad_output) g = p.grad_output[p.reduction == FCE_REDUCTION_NONE ? row : 0];
    r.k = g;
    r.kz = g;
    if (p.reduction == FCE_REDUCTION_MEAN) {
      const float D = p.denoms->denom, n = p.denoms->count;
      r.k = D != 0.f ? __fdiv_rn(g, D) : 0.f;  // (a negative D: negative class weights)
      r.kz = n > 0.f ? __fdiv_rn(g, n) : 0.f;
      // from the denominators only, never from g, so that every g takes the same formula
      if (p.two_lambda != 0.f && D != n) r.rho = D != 0.f ? __fdiv_rn(D, n) : 0.f;
    }
  }
  r.omega = 0.f;
  if (use_smooth<MODE>(p)) r.omega = p.class_weights ? p.denoms->omega_total : static_cast<float>(p.vocab_total);
  return r;
}

// A row's statistics once reduced (docs/semantics.md rules 8-10): m, ls = log S, lse = m + ls
// (−inf for a row of −inf: S = 0; NaN for a row with a NaN or a +inf entry, whose S is NaN from
// exp(+inf − +inf), as torch's log_softmax; the CPU reference's), and the token-scaling factor
// t = p_y (1 when off or not a valid row).
struct RowVals {
  float m, ls, lse, t;
};
__device__ __forceinline__ float row_lse(const Partial& f) { return __fadd_rn(f.m, logf(f.s)); }
__device__ __forceinline__ RowVals make_row_vals(const KParams& p, const RowInfo& ri, float m,
                                                 float ls, float lse) {
  RowVals v{m, ls, lse, 1.f};
  if (p.token_scaling && ri.kind == kValid) v.t = prob(ri.ay, m, ls);
  return v;
}
__device__ __forceinline__ RowVals row_vals(const KParams& p, const RowInfo& ri, const Partial& f) {
  return make_row_vals(p, ri, f.m, logf(f.s), row_lse(f));
}

// The argmax outputs of a row (rule 15) from its key (argmax_vector), by one thread per row.
__device__ __forceinline__ void write_argmax_outputs(const KParams& p, int64_t row,
                                                     const RowInfo& ri, uint64_t best) {
  const int64_t am = ri.kind == kIgnored ? -1
                   : best == kNoArgmax   ? 0
                                         : static_cast<int64_t>(best & 0xffffffffu);
  if (p.argmax_out) p.argmax_out[row] = am;
  if (p.row_correct) p.row_correct[row] = (ri.kind == kValid && am == ri.y) ? 1.f : 0.f;
}

// Forward per-row outputs (docs/semantics.md rules 2, 3, 8), by one thread per row. c is the smoothing
// reference (online_vector); mum the row's μ − m where the kernel has it (ROWT), which the saved
// statistics carry for a later column slice's entropy gradient.
template <int MODE>
__device__ void write_row_outputs(const KParams& p, int64_t row, const RowInfo& ri,
                                  const Partial& f, const RowVals& v, float c, float mum = 0.f) {
  if (p.lse_out) p.lse_out[row] = v.lse;
  if (p.stats_out) p.stats_out[row] = CeRowStats{v.m, v.ls, v.t, mum};
  float zl = (ri.kind != kIgnored && p.lambda != 0.f) ? __fmul_rn(p.lambda, __fmul_rn(v.lse, v.lse)) : 0.f;
  float ce = 0.f;
  if (ri.kind == kInvalid) {
    ce = qnan();
    if (p.error_flags) atomicOr(p.error_flags, FCE_FLAG_TARGET_OUT_OF_RANGE);
  } else if (ri.kind == kValid) {
    // lse − a_y as (m − a_y) + ls: the rounding of lse stays out of the difference. NaN when m
    // is infinite (rule 10): −inf − (−inf) on a row of −inf, a NaN ls on a row with a +inf
    const float nll = __fadd_rn(__fsub_rn(v.m, ri.ay), v.ls);
    ce = __fmul_rn(__fmul_rn(p.one_minus_eps, ri.wy), nll);
    if (use_smooth<MODE>(p)) {
      // (ε/V) Σ_j ω_j (lse − a_j) = (ε/V)(Ω·((m − c) + ls) − Σ_j ω_j (a_j − c)), in double
      const double lse_c = (static_cast<double>(v.m) - static_cast<double>(c)) + static_cast<double>(v.ls);
      const double sm = static_cast<double>(ri.omega) * lse_c - f.sw;
      ce = __fadd_rn(ce, static_cast<float>(static_cast<double>(p.eps_over_V) * sm));
    }
    if (p.token_scaling) {
      ce = __fmul_rn(ce, v.t);
      zl = __fmul_rn(zl, v.t);
    }
  }
  if (p.row_zloss) p.row_zloss[row] = zl;
  if (p.row_loss) p.row_loss[row] = (p.loss_has_z && ri.kind == kValid) ? __fadd_rn(ce, zl) : ce;
}

// Per-row constants of the gradient (docs/semantics.md rule 9), with p_j = exp((a_j − m) − ls):
//   ∂z_j = ks · (A·p_j − B·ω_j − [j = y]·Y) (· (1 − t_j²) with softcap), where
//   Y = (1−ε)ω_y,  As = (ε/V)Ω,  Az = 2λ·lse·ρ,  A = Y + As + Az,  B = ε/V,  ks = k·t·s,
// ρ = k_z / k (D / n for mean, 1 otherwise) puts the z-loss term's own upstream scale inside.
// The upstream scale multiplies last (without label smoothing the non-target elements are
// p_j·(A·ks): A·ks then scales exactly with ks), so that a gradient written for g = 1 and scaled
// by a power of two equals the one written for that g bit for bit, signed zeros included
// (rule 14). When
// D = 0 < n (mean, every target weighted 0: k = 0, k_z ≠ 0) only the z-loss term is left:
// A = Az = 2λ·lse, ks = k_z·t·s.
// The target element is computed as Y*(p_y - 1) + (p_y*As - B*w_y) + p_y*Az: when p_y is near
// 1 (a confident model) p_y*A - Y would cancel and lose the small difference; p_y - 1 is exact
// there (Sterbenz), and As - B*w_y cancels exactly where it should (V = 1, or w_y = Omega).
struct RowGrad {
  float m, ls, A, As, Az, B, Y, ks;
  float Aks;  // A·ks: without label smoothing (B = 0) an element is p_j·(A·ks)
};
// docs/semantics.md rule 18's per-row constants (the ROWT kernels): Ls = grad_lse·s,
// Es = grad_entropy·s and mum = μ − m (t/s of the row). Apart from RowGrad, so that the kernels
// without them keep their code.
struct RowTerms {
  float Ls, Es, mum;
};
template <int MODE>
__device__ __forceinline__ RowGrad make_row_grad(const KParams& p, const RowInfo& ri, const RowVals& v) {
  RowGrad g;
  g.m = v.m;
  g.ls = v.ls;
  if (ri.rho != 0.f) {
    const float kc = __fmul_rn(ri.k, v.t);
    g.Y = __fmul_rn(p.one_minus_eps, ri.wy);
    g.As = use_smooth<MODE>(p) ? __fmul_rn(p.eps_over_V, ri.omega) : 0.f;
    g.Az = p.two_lambda != 0.f ? __fmul_rn(__fmul_rn(p.two_lambda, v.lse), ri.rho) : 0.f;
    g.B = use_smooth<MODE>(p) ? p.eps_over_V : 0.f;
    g.ks = __fmul_rn(kc, p.scale);
  } else {
    g.Y = 0.f;
    g.As = 0.f;
    g.Az = __fmul_rn(p.two_lambda, v.lse);
    g.B = 0.f;
    g.ks = __fmul_rn(__fmul_rn(ri.kz, v.t), p.scale);
  }
  g.A = __fadd_rn(__fadd_rn(g.Y, g.As), g.Az);
  g.Aks = __fmul_rn(g.A, g.ks);
  return g;
}

// The upstream gradients of row's lse and entropy (rule 18; 0 when not given), read by every
// thread (one broadcast load each).
__device__ __forceinline__ float row_grad_lse(const KParams& p, int64_t row) {
  return p.grad_lse ? p.grad_lse[row] : 0.f;
}
__device__ __forceinline__ float row_grad_entropy(const KParams& p, int64_t row) {
  return p.grad_entropy ? p.grad_entropy[row] : 0.f;
}

// Rule 18's per-row constants of a row (mum = t/s; gl, ge: its row_grad_lse and
// row_grad_entropy); a row without a loss term (ignored: its terms still flow) gets every loss
// coefficient of g set to 0.
__device__ __forceinline__ RowTerms row_terms(const KParams& p, const RowInfo& ri, float mum,
                                              float gl, float ge, RowGrad& g) {
  if (ri.kind != kValid) g.A = g.As = g.Az = g.B = g.Y = g.ks = g.Aks = 0.f;
  return RowTerms{__fmul_rn(gl, p.scale), __fmul_rn(ge, p.scale), mum};
}

// The target's column within a row's buffer, once per row: y − col_begin when inside
// [0, vocab), else −2·E, which no vector's [j0, j0 + E) can contain (j0 ≥ −(E − 1)).
template <class I, int E>
__device__ __forceinline__ I local_target(const KParams& p, int64_t y) {
  const int64_t yl = y - p.col_begin;
  return (yl >= 0 && yl < p.vocab) ? static_cast<I>(yl) : static_cast<I>(-2 * E);
}

// THE one place a gradient element of a valid row is computed (docs/semantics.md rule 9): the
// forward, two-pass and backward kernels, in every mode and on every path, call these two, so
// that they write the same bits (rules 12, 14). pr = p_j, b = B·ω_j, t = tanh of softcap.
template <int MODE>
__device__ __forceinline__ float grad_elem(const KParams& p, const RowGrad& rg, float pr, float b,
                                           float t) {
  float gq = MODE == kGeneral ? __fmul_rn(__fmaf_rn(pr, rg.A, -b), rg.ks)
                              : __fmul_rn(pr, rg.Aks);  // B = 0 without label smoothing
  if (use_cap<MODE>(p)) gq = __fmul_rn(gq, __fmaf_rn(-t, t, 1.f));
  return gq;
}
template <int MODE>
__device__ __forceinline__ float grad_target(const KParams& p, const RowGrad& rg, float pr, float b,
                                             float t) {
  const float da =
      __fmaf_rn(rg.Y, __fsub_rn(pr, 1.f), __fmaf_rn(pr, rg.Az, __fmaf_rn(pr, rg.As, -b)));
  float gy = __fmul_rn(da, rg.ks);
  if (use_cap<MODE>(p)) gy = __fmul_rn(gy, __fmaf_rn(-t, t, 1.f));
  return gy;
}

// The target element's gradient, from its logit z, stored at column yl (the row's
// local_target, inside the row): after the vector that holds it was stored with the
// non-target form, by the same thread (same address, later in program order: it stays).
template <class TG, int MODE>
__device__ __forceinline__ void store_target(const KParams& p, const RowGrad& rg, float z,
                                             int64_t yl, char* grow) {
  float t;
  const float a = xform<MODE>(z, p, t);
  const float pr = prob(a, rg.m, rg.ls);
  const bool weighted = use_smooth<MODE>(p) && p.class_weights != nullptr;
  const float b = weighted ? __fmul_rn(rg.B, __ldg(p.class_weights + p.col_begin + yl)) : rg.B;
  const float gy = grad_target<MODE>(p, rg, pr, b, t);
  char* dst = grow + yl * Ty<TG>::kBytes;
  if constexpr (Ty<TG>::kBytes == 4) {
    __stcs(reinterpret_cast<float*>(dst), gy);
  } else {
    __stcs(reinterpret_cast<unsigned short*>(dst),
           static_cast<unsigned short>(pack2<TG>(gy, 0.f) & 0xffffu));
  }
}

// The gradient of one vector of a valid row. yl: the row's local_target.
template <class TZ, class TG, int MODE, class I>
__device__ __forceinline__ void grad_vector(const uint4& raw, I j0, bool full, bool vec_ok,
                                            const KParams& p, const RowGrad& rg, I yl,
                                            char* grow) {
  constexpr int E = vec_elems<TZ>();
  float g[E];
  unpack<TZ>(raw, g);
  // the target within this vector: inside the buffer's columns only (local_target: a column
  // slice's partial end vectors cover classes of the neighbouring slices, and a row's first
  // partial vector starts before the row)
  const I dyl = yl - j0;
  const int dy = (dyl >= 0 && dyl < E) ? static_cast<int>(dyl) : -1;
  const bool weighted = use_smooth<MODE>(p) && p.class_weights != nullptr;
  // 16-bit logits: the target element (at most one per row) is computed after the loop and
  // stored over the vector's value, instead of a per-element `q == dy` test (a compare and a
  // predicated chain on every element). Measured (dev/NOTES.md, version 3): up to 4 % faster
  // on 16-bit rows, but 8 % slower on float32 rows, which keep the test in the loop.
  constexpr bool kTargetAfter = E == 8;
  float zy = 0.f;
  if (kTargetAfter && dy >= 0) {
#pragma unroll
    for (int q = 0; q < E; ++q) zy = q == dy ? g[q] : zy;
  }
#pragma unroll
  for (int q = 0; q < E; ++q) {
    float t;
    const float a = xform<MODE>(g[q], p, t);
    const float pr = prob(a, rg.m, rg.ls);
    float b = rg.B;
    if (weighted) {
      const I j = j0 + q;
      b = 0.f;
      if (full || (j >= 0 && j < p.vocab)) b = __fmul_rn(rg.B, __ldg(p.class_weights + p.col_begin + j));
    }
    g[q] = (!kTargetAfter && q == dy) ? grad_target<MODE>(p, rg, pr, b, t)
                                      : grad_elem<MODE>(p, rg, pr, b, t);
  }
  store_grad<TG, E>(grow, j0, full, vec_ok, p.vocab, g);
  if (kTargetAfter && dy >= 0) store_target<TG, MODE>(p, rg, zy, int64_t(yl), grow);
}

// The gradient of one vector of a row with rule 18's terms (the ROWT stream kernels): the
// element grad_elem / grad_target give (the loss's part, softcap factor included) plus
// p·(Ls − Es·((a − m) − mum)) times the same softcap factor; an element with p = 0 (a −inf
// logit) gets nothing from the terms (no 0·inf). yl: the row's local_target (−2·E for a row
// without a loss term). Apart from grad_vector, whose kernels keep their code.
template <class TZ, class TG, int MODE, class I>
__device__ __forceinline__ void grad_vector_terms(const uint4& raw, I j0, bool full, bool vec_ok,
                                                  const KParams& p, const RowGrad& rg,
                                                  const RowTerms& rt, I yl, char* grow) {
  float g[vec_elems<TZ>()];
  unpack<TZ>(raw, g);
#pragma unroll
  for (int q = 0; q < vec_elems<TZ>(); ++q) {
    float t;
    const float a = xform<MODE>(g[q], p, t);
    const float pr = prob(a, rg.m, rg.ls);
    const I j = j0 + q;  // (the target: j == yl, which only a column of the buffer can be)
    const bool inside = full || (j >= 0 && j < p.vocab);
    const float b = !(use_smooth<MODE>(p) && p.class_weights) ? rg.B
                    : inside ? __fmul_rn(rg.B, __ldg(p.class_weights + p.col_begin + j))
                             : 0.f;
    const float gl = j == yl ? grad_target<MODE>(p, rg, pr, b, t) : grad_elem<MODE>(p, rg, pr, b, t);
    const float w = __fmaf_rn(-rt.Es, __fsub_rn(__fsub_rn(a, rg.m), rt.mum), rt.Ls);
    const float cf = use_cap<MODE>(p) ? __fmaf_rn(-t, t, 1.f) : 1.f;
    g[q] = pr == 0.f ? gl : __fmaf_rn(__fmul_rn(pr, w), cf, gl);
  }
  store_grad<TG, vec_elems<TZ>()>(grow, j0, full, vec_ok, p.vocab, g);
}

// ROWT: the gradient of one vector of a row without label smoothing (the only rows ROWT kernels
// have), with rule 18's terms folded into one per-row constant: an element off the target is
//   p·(A·ks + Ls − Es·((a − m) − μ')) = p·(C1 − Es·d),  d = a − m,  C1 = A·ks + Ls + Es·μ'
// (μ' = μ − m), times the softcap factor. ES = false (no entropy gradient in the row): p·C1, the
// plain gradient's cost; ES: a max and an FMA per element more (d is clamped to −128 in the
// entropy term: p is then exactly 0, so a −inf logit gets 0, never 0·inf). The target element
// (yl, inside the buffer) is stored after the vector, as store_target does.
struct LeanTerms {
  float C1, Es;
};
__device__ __forceinline__ LeanTerms lean_terms(const RowGrad& rg, const RowTerms& rt) {
  return LeanTerms{__fmaf_rn(rt.Es, rt.mum, __fadd_rn(rg.Aks, rt.Ls)), rt.Es};
}
// ROWT: the off-target form above for the E logits g of one vector, in place (nlsl = −ls·log2e).
template <int MODE, bool ES, int E>
__device__ __forceinline__ void lean_elems(const KParams& p, const RowGrad& rg, const LeanTerms& lt,
                                           float nlsl, float (&g)[E]) {
#pragma unroll
  for (int q = 0; q < E; ++q) {
    float t;
    const float a = xform<MODE>(g[q], p, t);
    const float d = __fsub_rn(a, rg.m);
    const float pr = ex2(__fmaf_rn(d, kLog2e, nlsl));  // prob(a, m, ls)
    float gq =
        ES ? __fmul_rn(pr, __fmaf_rn(-lt.Es, fmaxf(d, -128.f), lt.C1)) : __fmul_rn(pr, lt.C1);
    if (use_cap<MODE>(p)) gq = __fmul_rn(gq, __fmaf_rn(-t, t, 1.f));
    g[q] = gq;
  }
}

// ROWT: the target element's gradient (yl, inside the buffer; z its logit): the loss's own form
// plus rule 18's terms, as grad_vector_terms.
template <class TZ, class TG, int MODE>
__device__ __forceinline__ void store_target_lean(const KParams& p, const RowGrad& rg,
                                                  const RowTerms& rt, float z, int yl, char* grow) {
  float t;
  const float a = xform<MODE>(z, p, t);
  const float pr = prob(a, rg.m, rg.ls);
  const float gl = grad_target<MODE>(p, rg, pr, 0.f, t);
  const float w = __fmaf_rn(-rt.Es, __fsub_rn(__fsub_rn(a, rg.m), rt.mum), rt.Ls);
  const float cf = use_cap<MODE>(p) ? __fmaf_rn(-t, t, 1.f) : 1.f;
  const float gy = pr == 0.f ? gl : __fmaf_rn(__fmul_rn(pr, w), cf, gl);
  char* dst = grow + int64_t(yl) * Ty<TG>::kBytes;
  if constexpr (Ty<TG>::kBytes == 4) {
    __stcs(reinterpret_cast<float*>(dst), gy);
  } else {
    __stcs(reinterpret_cast<unsigned short*>(dst),
           static_cast<unsigned short>(pack2<TG>(gy, 0.f) & 0xffffu));
  }
}

template <class TZ, class TG, int MODE, bool ES>
__device__ __forceinline__ void
grad_vector_lean(const uint4& raw, int j0, bool full, bool vec_ok, const KParams& p,
                 const RowGrad& rg, const LeanTerms& lt, const RowTerms& rt, int yl, char* grow) {
  constexpr int E = vec_elems<TZ>();
  float g[E];
  unpack<TZ>(raw, g);
  const int dyl = yl - j0;
  const int dy = (dyl >= 0 && dyl < E) ? dyl : -1;
  float zy = 0.f;
  if (dy >= 0) {
#pragma unroll
    for (int q = 0; q < E; ++q) zy = q == dy ? g[q] : zy;
  }
  lean_elems<MODE, ES>(p, rg, lt, -__fmul_rn(rg.ls, kLog2e), g);
  store_grad<TG, E>(grow, j0, full, vec_ok, p.vocab, g);
  if (dy >= 0) store_target_lean<TZ, TG, MODE>(p, rg, rt, zy, yl, grow);
}

// ROWT, the fast slots (regs_row): grad_vector_lean's form off the target for every element of
// one full vector, stored at dst with one 16-byte store and no test per element or per vector;
// the target's owner stores its element after (store_target_lean), as grad_vector_full and
// store_target do for the plain gradient. nlsl = −ls·log2e, once per row.
template <class TZ, class TG, int MODE, bool ES>
__device__ __forceinline__ void grad_vector_lean_full(const uint4& raw, const KParams& p,
                                                      const RowGrad& rg, const LeanTerms& lt,
                                                      float nlsl, char* dst) {
  constexpr int E = vec_elems<TZ>();
  float g[E];
  unpack<TZ>(raw, g);
  lean_elems<MODE, ES>(p, rg, lt, nlsl, g);
  store_grad<TG, E>(dst, 0, true, true, p.vocab, g);
}

// Ignored rows: 0; invalid rows: NaN (docs/semantics.md rules 2, 3).
template <class TG, int E, class I>
__device__ __forceinline__ void fill_vector(I j0, bool full, bool vec_ok, int V, float value,
                                            char* grow) {
  float g[E];
#pragma unroll
  for (int q = 0; q < E; ++q) g[q] = value;
  store_grad<TG, E>(grow, j0, full, vec_ok, V, g);
}

#include "cuda/ce/cluster.cuh"  // (sm_90: the cluster exchange of the register path)

// fce_backward_rescale's prologue of the forward kernels (docs/semantics.md rule 14), read on the device:
// returns true when the CTA is done: *grad_output is 1 (nothing to do), or 0 / ± a power of two
// (the valid row's part [col0, col1) of the gradient already there is scaled in place: exact;
// ignored rows stay +0, invalid rows NaN). False: compute the gradient as the forward does.
template <class TG, bool SOFT = false>
__device__ __forceinline__ bool rescale_prologue(const KParams& p, int64_t row, char* grow,
                                                 int64_t col0, int64_t col1) {
  const float g = *p.grad_output;
  if (g == 1.f) return true;
  const uint32_t bits = __float_as_uint(g), ex = (bits >> 23) & 0xffu;
  if (!((bits & 0x7fffffffu) == 0 || ((bits & 0x7fffffu) == 0 && ex != 0 && ex != 0xffu)))
    return false;
  int64_t y;
  if (SOFT || classify_row(p, row, &y) == kValid) {  // (rule 19: every row scored)
    TG* gr = reinterpret_cast<TG*>(grow);
    for (int64_t j = col0 + threadIdx.x; j < col1; j += blockDim.x)
      gr[j] = from_float<TG>(__fmul_rn(to_float(gr[j]), g));
  }
  return true;
}

// ------------------------------------------------------------------ host side ----
// The kernel parameters of a problem (vocab: V of the whole vocabulary; ε/V and Ω are its).
inline KParams make_params(const CeOptions& opt, int64_t vocab) {
  KParams p;
  memset(&p, 0, sizeof p);
  p.ignore_index = opt.ignore_index;
  p.shift_T = opt.shift_seq_len;
  p.shift_k = opt.shift_seq_len > 0 ? (opt.shift > 0 ? opt.shift : 1) : 0;
  p.token_scaling = opt.token_scaling ? 1 : 0;
  p.class_weights = opt.class_weights;
  p.vocab = static_cast<int>(vocab);
  p.vocab_total = static_cast<int>(vocab);
  p.col_begin = 0;
  p.cluster = 1;
  p.targets_int64 = opt.targets_int64 ? 1 : 0;
  p.reduction = opt.reduction;
  p.smooth = opt.label_smoothing > 0.f ? 1 : 0;
  p.cap = opt.softcap > 0.f ? 1 : 0;
  p.scale = opt.logit_scale;
  p.softcap = opt.softcap;
  p.s_over_c = opt.softcap > 0.f ? opt.logit_scale / opt.softcap : 0.f;
  p.one_minus_eps = static_cast<float>(1.0 - static_cast<double>(opt.label_smoothing));
  p.eps_over_V = static_cast<float>(static_cast<double>(opt.label_smoothing) / static_cast<double>(vocab));
  p.lambda = opt.z_loss_scale;
  p.two_lambda = 2.f * opt.z_loss_scale;
  p.q_dtype = opt.q_dtype;
  p.q_ld = vocab;
  p.q_col = 0;
  return p;
}

}  // namespace
}  // namespace cuda
}  // namespace fce
