// vocab_parallel.cu — the CUDA backend of fce_vp_stats, fce_vp_loss and fce_vp_backward
// (SEMANTICS.md rule 16), and the two kernels fce_vp_linear_* share (vp_kernels.cuh).
//
// Phase 1, vp_stats_kernel: one CTA per row of the shard, ONE read of it (16-byte vectors where
// the row allows, its ≤ 2 partial vectors element by element, never a byte outside the row; the
// same vector split as ce_kernels.cu's streaming kernels). Per thread, over its vectors in
// increasing index order: an online maximum and Σ exp(a − m) (exp2 of scaled differences, as the
// row kernels), the first index of its maximum (the argmax), and with label smoothing
// u = Σ ω_j (m − a_j) kept relative to the running maximum (u += w·(m_new − m_old) when it grows,
// w = Σ ω of the finite elements so far: every term is ≥ 0, no cancellation however far the
// logits are from each other), −inf elements apart (each adds ω·∞). Then a fixed-order CTA tree.
// A row whose Σexp is NaN holds a NaN or a +inf: only then it is read a second time, to find its
// first NaN (m_r = NaN, argmax = that NaN, as torch.argmax). Thread 0 reads the target logit
// (when the row is scored and its target is in the shard) before the loop, and writes the row's
// FCE_VP_STATS floats with two 16-byte stores. With class weights, W_r = Σ ω over the shard is
// the same for every row: vp_weights_kernel sums it once (fixed order, double) and writes it
// into every row (no workspace: fce_vp_stats has none).
//
// Phase 3, vp_combine_kernel: one thread per row (grid-stride), ranks in gathered order, float32:
// M, S = Σ s_r·exp(m_r − M), log S, t, Ω, U, the tiling check (Σ V_r = V, one shard holding a
// valid row's target), the argmax across shards; writes the row statistics for the gradient
// (CeRowStats, in the workspace) and the per-row loss / z-loss / lse / argmax / correctness that
// launch_ce_finalize (ce_rows.cuh) reduces in a fixed order. Error flags: one atomicOr per warp
// (integer; no float atomics anywhere).
//
// cuda_vp (loss): launch_ce_denominators (D, n from the targets) → combine → launch_ce_finalize.
// cuda_vp (backward): launch_ce_denominators → combine (row statistics) → launch_ce_rows in
// backward mode on the shard as a column slice [vocab_start, vocab_start + vocab_local) of rows
// of vocab_total classes with stats_in: exactly the gradient of rule 9 with m = M, log s = log S
// (the one-hot term only where the target lies in the shard).
// Everything on the caller's stream, no allocation, no host synchronisation: graph-capturable;
// every reduction has a fixed order: deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>
#include <cstring>

#include "cuda/ce_rows.cuh"
#include "cuda/device_pointers.cuh"
#include "cuda/vp_kernels.cuh"
#include "internal.h"

namespace fce {
namespace cuda {
namespace {

constexpr int kStatsThreads = 512;     // most threads of a phase-1 CTA (one row)
constexpr int kStatsUnroll = 4;        // vectors in flight per thread (plain / softcap)
constexpr int kCombineThreads = 256;
constexpr int kWeightThreads = 1024;
constexpr int64_t kMaxRowsPerLaunch = int64_t(1) << 30;  // grid.x
constexpr float kLog2e = 1.4426950408889634f;

enum RowKind : int { kIgnored = 0, kValid = 1, kInvalid = 2 };
// kPlain: no softcap, no label smoothing; kCap: softcap; kGeneral: both decided at run time.
enum Mode : int { kPlain = 0, kCap = 1, kGeneral = 2 };

// ------------------------------------------------------------------ dtype traits ----
template <class T> struct Ty;
template <> struct Ty<float> { static constexpr int kBytes = 4; };
template <> struct Ty<__half> { static constexpr int kBytes = 2; };
template <> struct Ty<__nv_bfloat16> { static constexpr int kBytes = 2; };
template <class TZ> constexpr int vec_elems() { return 16 / Ty<TZ>::kBytes; }

template <class T> __device__ __forceinline__ float raw_to_float(uint32_t raw);
template <> __device__ __forceinline__ float raw_to_float<float>(uint32_t raw) {
  return __uint_as_float(raw);
}
template <> __device__ __forceinline__ float raw_to_float<__nv_bfloat16>(uint32_t raw) {
  return __uint_as_float(raw << 16);
}
template <> __device__ __forceinline__ float raw_to_float<__half>(uint32_t raw) {
  __half_raw h;
  h.x = static_cast<unsigned short>(raw);
  return __half2float(__half(h));
}

template <class TZ>
__device__ __forceinline__ void unpack(const uint4& v, float (&f)[vec_elems<TZ>()]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  if constexpr (Ty<TZ>::kBytes == 4) {
#pragma unroll
    for (int q = 0; q < 4; ++q) f[q] = __uint_as_float(w[q]);
  } else {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      f[2 * q] = raw_to_float<TZ>(w[q] & 0xffffu);
      f[2 * q + 1] = raw_to_float<TZ>(w[q] >> 16);
    }
  }
}

template <class TZ> __device__ __forceinline__ uint32_t ld_elem(const char* p) {
  if constexpr (Ty<TZ>::kBytes == 4) return __ldcg(reinterpret_cast<const unsigned int*>(p));
  else return __ldcg(reinterpret_cast<const unsigned short*>(p));
}

// Vector [j0, j0 + E) of a row: one 16-byte load when it lies inside the row (`full`), else its
// in-row elements one by one (the others 0). STREAM: evict-first (the row is read once).
template <class TZ, bool STREAM>
__device__ __forceinline__ uint4 load_vector(const char* zrow, int64_t j0, bool full, int V) {
  constexpr int E = vec_elems<TZ>();
  constexpr int eb = Ty<TZ>::kBytes;
  if (full) {
    const uint4* p = reinterpret_cast<const uint4*>(zrow + j0 * eb);
    return STREAM ? __ldcs(p) : __ldcg(p);
  }
  uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int q = 0; q < E; ++q) {
    const int64_t j = j0 + q;
    if (j >= 0 && j < V) {
      const uint32_t raw = ld_elem<TZ>(zrow + j * eb);
      if constexpr (eb == 4) w[q] = raw;
      else w[q >> 1] |= raw << (16 * (q & 1));
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <int E> __device__ __forceinline__ bool is_full(int64_t j0, int V) {
  return j0 >= 0 && j0 <= int64_t(V) - E;
}

__device__ __forceinline__ float ex2(float x) {  // 2^x (results below 2^-126 flush to 0)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float qnan() { return __int_as_float(0x7fffffff); }

// Everything a phase-1 CTA needs, resolved on the host.
struct SParams {
  const char* logits;          // row row_begin
  int64_t z_row_bytes;
  int64_t row_begin;           // global index of logits' first row
  float* stats;                // [rows, FCE_VP_STATS], global rows
  const void* targets;
  const float* class_weights;  // the whole vocabulary's, or nullptr
  int64_t ignore_index;
  int64_t shift_T, shift_k;    // shift_T = 0: no shift
  int64_t vocab_start;
  int vocab;                   // vocab_local: elements of a row
  int vocab_total;
  int targets_int64;
  int smooth;                  // label smoothing ε > 0 (u_r)
  int cap;
  int write_weight;            // kVpWeight = vocab (no class weights); else already written
  float scale, softcap, s_over_c;
};

// Row classification, SEMANTICS rules 1-3 (the same as ce_kernels.cu's classify_row).
template <class P>
__device__ __forceinline__ int classify_row(const P& p, int64_t row, int64_t* y_out) {
  int64_t ti = row;
  *y_out = 0;
  if (p.shift_T > 0) {
    if (row % p.shift_T >= p.shift_T - p.shift_k) return kIgnored;
    ti = row + p.shift_k;
  }
  const int64_t y = p.targets_int64 ? static_cast<const int64_t*>(p.targets)[ti]
                                    : static_cast<int64_t>(static_cast<const int32_t*>(p.targets)[ti]);
  *y_out = y;
  if (y == p.ignore_index) return kIgnored;
  if (y < 0 || y >= p.vocab_total) return kInvalid;
  return kValid;
}

// a = s·z, or a = c·tanh(s·z/c) (SPEC steps 1-2), as ce_kernels.cu's xform.
template <int MODE> __device__ __forceinline__ float xform(float z, const SParams& p) {
  if (MODE == kCap || (MODE == kGeneral && p.cap)) return __fmul_rn(p.softcap, tanhf(__fmul_rn(z, p.s_over_c)));
  return __fmul_rn(z, p.scale);
}

// A thread's (or a tree node's) partial statistics of a row: maximum m, Σ exp(a − m), the first
// index of the maximum (−1: none above −inf yet), and for label smoothing u = Σ ω (m − a) and
// w = Σ ω over its finite elements, ninf = Σ ω·∞ over its −inf elements.
struct Acc {
  float m, s;
  double u, w;
  float ninf;
  int am;
};
__device__ __forceinline__ Acc acc_identity() { return Acc{neg_inf(), 0.f, 0.0, 0.0, 0.f, -1}; }

// u relative to m moved to relative to mn ≥ m: + w·(mn − m) (nothing while m = −inf: then no
// finite element has been seen, w = 0).
__device__ __forceinline__ double rebase(double u, double w, float m, float mn) {
  return (m != mn && m > neg_inf()) ? __dadd_rn(u, __dmul_rn(w, __dsub_rn(double(mn), double(m)))) : u;
}

// Folds y into x (x holds the lower element indices when it comes first in the tree: the
// argmax takes the smaller index among equal maxima either way).
template <bool SMOOTH> __device__ __forceinline__ void merge(Acc& x, const Acc& y) {
  const float mn = fmaxf(x.m, y.m);
  const float s1 = x.m == mn ? x.s : __fmul_rn(x.s, ex2(__fmul_rn(__fsub_rn(x.m, mn), kLog2e)));
  const float s2 = y.m == mn ? y.s : __fmul_rn(y.s, ex2(__fmul_rn(__fsub_rn(y.m, mn), kLog2e)));
  const int ax = (x.am >= 0 && x.m == mn) ? x.am : INT_MAX;
  const int ay = (y.am >= 0 && y.m == mn) ? y.am : INT_MAX;
  const int am = ax < ay ? ax : ay;
  if (SMOOTH) {
    x.u = __dadd_rn(rebase(x.u, x.w, x.m, mn), rebase(y.u, y.w, y.m, mn));
    x.w = __dadd_rn(x.w, y.w);
    x.ninf = __fadd_rn(x.ninf, y.ninf);
  }
  x.m = mn;
  x.s = __fadd_rn(s1, s2);
  x.am = am == INT_MAX ? -1 : am;
}

__device__ __forceinline__ Acc shfl_down_acc(const Acc& x, int o) {
  Acc y;
  y.m = __shfl_down_sync(0xffffffffu, x.m, o);
  y.s = __shfl_down_sync(0xffffffffu, x.s, o);
  y.u = __shfl_down_sync(0xffffffffu, x.u, o);
  y.w = __shfl_down_sync(0xffffffffu, x.w, o);
  y.ninf = __shfl_down_sync(0xffffffffu, x.ninf, o);
  y.am = __shfl_down_sync(0xffffffffu, x.am, o);
  return y;
}

// Fixed-order CTA tree; thread 0 returns the CTA's total.
template <bool SMOOTH> __device__ __forceinline__ Acc block_reduce(Acc x, Acc* s_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const Acc y = shfl_down_acc(x, o);
    if (lane < o) merge<SMOOTH>(x, y);
  }
  if (lane == 0) s_warp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < nwarps ? s_warp[lane] : acc_identity();
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const Acc y = shfl_down_acc(x, o);
      if (lane < o) merge<SMOOTH>(x, y);
    }
  }
  return x;
}

// One vector of the row into a thread's partial (elements outside the row are −inf for the
// maximum and Σexp, and skipped by the smoothing sums).
template <class TZ, int MODE>
__device__ __forceinline__ void stats_vector(const uint4& raw, int64_t j0, bool full,
                                             const SParams& p, Acc& acc) {
  constexpr int E = vec_elems<TZ>();
  constexpr bool kSmoothMode = MODE == kGeneral;
  float a[E];
  unpack<TZ>(raw, a);
#pragma unroll
  for (int q = 0; q < E; ++q) a[q] = xform<MODE>(a[q], p);
  if (!full) {
#pragma unroll
    for (int q = 0; q < E; ++q)
      if (j0 + q < 0 || j0 + q >= p.vocab) a[q] = neg_inf();
  }
  float vm = a[0];
#pragma unroll
  for (int q = 1; q < E; ++q) vm = fmaxf(vm, a[q]);  // NaN-free (fmaxf drops NaN)
  if (vm > acc.m) {  // a new running maximum: its first index (indices only grow per thread)
    int q0 = E - 1;
#pragma unroll
    for (int q = E - 1; q >= 0; --q) q0 = a[q] == vm ? q : q0;
    acc.am = static_cast<int>(j0) + q0;
  }
  const float mn = fmaxf(acc.m, vm);
  if (kSmoothMode && p.smooth) acc.u = rebase(acc.u, acc.w, acc.m, mn);
  acc.s = acc.m == mn ? acc.s : __fmul_rn(acc.s, ex2(__fmul_rn(__fsub_rn(acc.m, mn), kLog2e)));
  acc.m = mn;
  if (mn != pos_inf()) {
    const float ms = mn == neg_inf() ? 0.f : mn;  // all −inf so far: every term is exp(−inf) = 0
#pragma unroll
    for (int q = 0; q < E; ++q) acc.s = __fadd_rn(acc.s, ex2(__fmul_rn(__fsub_rn(a[q], ms), kLog2e)));
  } else {
    // a +inf maximum: each +inf counts exp(0) = 1, finite and −inf entries 0, a NaN NaN (as the
    // CPU reference and ce_row.h); rare rows only
#pragma unroll
    for (int q = 0; q < E; ++q)
      acc.s = __fadd_rn(acc.s, a[q] == mn ? 1.f : ex2(__fmul_rn(__fsub_rn(a[q], mn), kLog2e)));
  }
  if (kSmoothMode && p.smooth) {
    // Σ ω (mn − a) over the vector's finite elements (each term ≥ 0), Σ ω of them, and ω·∞ for
    // its −inf elements; +inf and NaN elements make u NaN or 0 at the end (rule 16)
    float vs = 0.f, vw = 0.f, vinf = 0.f;
#pragma unroll
    for (int q = 0; q < E; ++q) {
      const int64_t j = j0 + q;
      if (full || (j >= 0 && j < p.vocab)) {
        const float wq = p.class_weights ? __ldg(p.class_weights + p.vocab_start + j) : 1.f;
        if (fabsf(a[q]) < pos_inf()) {
          vs = __fmaf_rn(wq, __fsub_rn(mn, a[q]), vs);
          vw = __fadd_rn(vw, wq);
        } else if (a[q] == neg_inf()) {
          vinf = __fadd_rn(vinf, __fmul_rn(wq, pos_inf()));
        }
      }
    }
    acc.u = __dadd_rn(acc.u, static_cast<double>(vs));
    acc.w = __dadd_rn(acc.w, static_cast<double>(vw));
    acc.ninf = __fadd_rn(acc.ninf, vinf);
  }
}

template <class TZ, int MODE>
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
    if (classify_row(p, row, &y) == kValid && y >= p.vocab_start && y - p.vocab_start < V) {
      t_r = xform<MODE>(raw_to_float<TZ>(ld_elem<TZ>(zrow + (y - p.vocab_start) * eb)), p);
      h_r = 1.f;
    }
  }

  Acc acc = acc_identity();
  for (int64_t base = tid; base < nvec; base += step) {
    uint4 buf[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = base + int64_t(u) * nt;
      const int64_t j0 = v * E - lead;
      buf[u] = make_uint4(0u, 0u, 0u, 0u);
      if (v < nvec) buf[u] = load_vector<TZ, true>(zrow, j0, is_full<E>(j0, V), V);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = base + int64_t(u) * nt;
      const int64_t j0 = v * E - lead;
      if (v < nvec) stats_vector<TZ, MODE>(buf[u], j0, is_full<E>(j0, V), p, acc);
    }
  }
  const Acc blk = block_reduce<SMOOTH>(acc, s_warp);
  if (tid == 0) s_final = blk;
  __syncthreads();
  const Acc fin = s_final;

  // Σexp NaN: the row holds a NaN. Its first NaN (a second read, rare rows only)
  int nan_j = INT_MAX;
  if (isnan(fin.s)) {
    for (int64_t v = tid; v < nvec; v += nt) {
      const int64_t j0 = v * E - lead;
      const bool full = is_full<E>(j0, V);
      float a[E];
      unpack<TZ>(load_vector<TZ, false>(zrow, j0, full, V), a);
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
    const float local_bits = __int_as_float(V);
    float* out = p.stats + row * FCE_VP_STATS;
    reinterpret_cast<float4*>(out)[0] = make_float4(m, s, t_r, h_r);
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
  const float* gathered;       // [ranks, rows, FCE_VP_STATS]
  int64_t ranks, rows;
  const void* targets;
  const float* class_weights;
  int64_t ignore_index, shift_T, shift_k;
  int vocab_total;
  int targets_int64;
  int reduction;
  int smooth, token_scaling, loss_has_z;
  float one_minus_eps, eps_over_V, lambda;
  CeRowStats* stats_out;
  float* row_loss;
  float* row_zloss;
  float* lse;
  int64_t* argmax;
  float* row_correct;
  uint32_t* error_flags;
};

__global__ void __launch_bounds__(kCombineThreads) vp_combine_kernel(const CParams p) {
  uint32_t flags = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; row < p.rows; row += stride) {
    int64_t y;
    const int kind = classify_row(p, row, &y);
    const float* g = p.gathered + row * FCE_VP_STATS;
    const int64_t rank_stride = p.rows * FCE_VP_STATS;

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
    float S = 0.f, T = 0.f, H = 0.f, Om = 0.f, Us = 0.f;
    int64_t sum_local = 0;
    bool best_nan = false, have_best = false;
    float best_m = neg_inf();
    int best_j = 0;
    for (int64_t r = 0; r < p.ranks; ++r) {
      const float4 lo = *reinterpret_cast<const float4*>(g + r * rank_stride);
      const float4 hi = *reinterpret_cast<const float4*>(g + r * rank_stride + 4);
      const float m_r = lo.x, s_r = lo.y, t_r = lo.z, h_r = lo.w;
      const float u_r = hi.x, w_r = hi.y;
      const int j_r = __float_as_int(hi.z), v_r = __float_as_int(hi.w);
      if (m_r > neg_inf()) S = __fadd_rn(S, m_r == M ? s_r : __fmul_rn(s_r, expf(__fsub_rn(m_r, M))));
      T = __fadd_rn(T, t_r);
      H = __fadd_rn(H, h_r);
      Om = __fadd_rn(Om, w_r);
      if (p.smooth) Us = __fadd_rn(Us, __fadd_rn(u_r, __fmul_rn(w_r, __fsub_rn(M, m_r))));
      sum_local += v_r;
      // argmax: a NaN shard first (the smallest global index among them: the first NaN), else
      // the largest m_r, the smallest global index among equal maxima
      if (isnan(m_r)) {
        if (!best_nan || j_r < best_j) best_j = j_r;
        best_nan = true;
      } else if (!best_nan && (!have_best || m_r > best_m || (m_r == best_m && j_r < best_j))) {
        best_m = m_r;
        best_j = j_r;
      }
      have_best = true;
    }
    if (any_nan) S = qnan();
    const float ls = logf(S);
    float lse = M == pos_inf() ? M : __fadd_rn(M, ls);
    // Two disjoint shards never report the same argmax (a global index inside each): equal
    // ones mean a shard's statistics were gathered twice (in place of another's of that size).
    bool duplicate = false;
    for (int64_t r = 1; r < p.ranks && !duplicate; ++r) {
      const float j_r = g[r * rank_stride + kVpArgmax];
      for (int64_t q = 0; q < r && !duplicate; ++q)
        duplicate = __float_as_int(g[q * rank_stride + kVpArgmax]) == __float_as_int(j_r);
    }
    const bool inconsistent =
        sum_local != p.vocab_total || duplicate || (kind == kValid && H != 1.f);
    const float wy = kind == kValid ? (p.class_weights ? p.class_weights[y] : 1.f) : 0.f;
    const float ts = (p.token_scaling && kind == kValid)
                         ? ex2(__fmul_rn(__fsub_rn(__fsub_rn(T, M), ls), kLog2e)) : 1.f;
    if (inconsistent) {
      lse = qnan();
      flags |= FCE_FLAG_SHARDS_INCONSISTENT;
    }
    // (pad = 1: an ignored row whose gradient must be NaN all the same, launch_vp_nan_rows)
    if (p.stats_out)
      p.stats_out[row] = inconsistent ? CeRowStats{qnan(), qnan(), qnan(), kind == kIgnored ? 1.f : 0.f}
                                      : CeRowStats{M, ls, ts, 0.f};

    // the row's loss (rule 16 into rule 8), as launch_ce_rows' write_row_outputs
    float zl = (kind != kIgnored && p.lambda != 0.f) ? __fmul_rn(p.lambda, __fmul_rn(lse, lse)) : 0.f;
    float ce = 0.f;
    if (kind == kInvalid) {
      ce = qnan();
      flags |= FCE_FLAG_TARGET_OUT_OF_RANGE;
    } else if (kind == kValid) {
      const float nll = isinf(M) ? __fsub_rn(lse, T) : __fadd_rn(__fsub_rn(M, T), ls);
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

// The rows flagged by the combine (CeRowStats.pad ≠ 0: ignored rows of an inconsistent tiling)
// get a NaN gradient row; one warp per row, the others return after reading their flag.
template <class TG>
__global__ void __launch_bounds__(256) vp_nan_rows_kernel(const CeRowStats* stats, int64_t rows,
                                                          char* g, int64_t cols, int64_t ld) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; row < rows; row += warps) {
    if (stats[row].pad == 0.f) continue;
    TG* out = reinterpret_cast<TG*>(g + row * ld * int64_t(sizeof(TG)));
    for (int64_t j = lane; j < cols; j += 32) out[j] = TG(qnan());
  }
}

// ---------------------------------------------------------------- host side ----
fce_status launch_error(const char* fn, const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return fail(FCE_ERROR_CUDA, "%s: %s: launch failed: %s", fn, kernel, cudaGetErrorString(e));
  return FCE_SUCCESS;
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
    if (mode == kPlain) vp_stats_kernel<TZ, kPlain><<<blocks, threads, 0, s>>>(q);
    else if (mode == kCap) vp_stats_kernel<TZ, kCap><<<blocks, threads, 0, s>>>(q);
    else vp_stats_kernel<TZ, kGeneral><<<blocks, threads, 0, s>>>(q);
    FCE_TRY(launch_error(a.fn, "vp_stats_kernel"));
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
  const CeOptions& opt = a.opt;
  SParams p;
  memset(&p, 0, sizeof p);
  p.stats = a.stats;
  p.targets = a.targets;
  p.class_weights = opt.class_weights;
  p.ignore_index = opt.ignore_index;
  p.shift_T = opt.shift_seq_len;
  p.shift_k = opt.shift_seq_len > 0 ? (opt.shift > 0 ? opt.shift : 1) : 0;
  p.vocab_start = a.vocab_start;
  p.vocab = static_cast<int>(a.vocab_local);
  p.vocab_total = static_cast<int>(a.vocab_total);
  p.targets_int64 = opt.targets_int64 ? 1 : 0;
  p.smooth = opt.label_smoothing > 0.f ? 1 : 0;
  p.cap = opt.softcap > 0.f ? 1 : 0;
  p.write_weight = a.weight_written ? 0 : 1;
  p.scale = opt.logit_scale;
  p.softcap = opt.softcap;
  p.s_over_c = opt.softcap > 0.f ? opt.logit_scale / opt.softcap : 0.f;
  switch (a.logits_dtype) {
    case FCE_FLOAT32: return launch_stats_typed<float>(a, p, s);
    case FCE_FLOAT16: return launch_stats_typed<__half>(a, p, s);
    case FCE_BFLOAT16: return launch_stats_typed<__nv_bfloat16>(a, p, s);
    default:
      return fail(FCE_ERROR_UNSUPPORTED, "%s: logits dtype %d", a.fn, a.logits_dtype);
  }
}

fce_status launch_vp_weights(const char* fn, const CeOptions& opt, int64_t rows,
                             int64_t vocab_start, int64_t vocab_local, float* stats,
                             cudaStream_t s) {
  if (!opt.class_weights || rows < 0 || vocab_start < 0 || vocab_local < 1 || !stats)
    return fail(FCE_ERROR_INTERNAL, "%s: launch_vp_weights: bad arguments", fn);
  if (rows == 0) return FCE_SUCCESS;
  // a few blocks share the row writes (each sums the weights itself, in the same order)
  const int64_t per_block = int64_t(kWeightThreads) * 64;
  const int64_t blocks = (rows + per_block - 1) / per_block;
  vp_weights_kernel<<<static_cast<unsigned>(blocks < 8 ? blocks : 8), kWeightThreads, 0, s>>>(
      opt.class_weights + vocab_start, vocab_local, stats, rows);
  return launch_error(fn, "vp_weights_kernel");
}

fce_status launch_vp_nan_rows(const char* fn, const CeRowStats* stats, int64_t rows, void* g,
                              int dtype, int64_t cols, int64_t ld, cudaStream_t s) {
  if (rows <= 0 || cols <= 0) return FCE_SUCCESS;
  int64_t blocks = (rows + 7) / 8;  // 8 warps of 256 threads
  if (blocks > 4096) blocks = 4096;
  char* gp = static_cast<char*>(g);
  switch (dtype) {
    case FCE_FLOAT32:
      vp_nan_rows_kernel<float><<<static_cast<unsigned>(blocks), 256, 0, s>>>(stats, rows, gp, cols, ld);
      break;
    case FCE_FLOAT16:
      vp_nan_rows_kernel<__half><<<static_cast<unsigned>(blocks), 256, 0, s>>>(stats, rows, gp, cols, ld);
      break;
    case FCE_BFLOAT16:
      vp_nan_rows_kernel<__nv_bfloat16><<<static_cast<unsigned>(blocks), 256, 0, s>>>(stats, rows, gp, cols, ld);
      break;
    default:
      return fail(FCE_ERROR_INTERNAL, "%s: launch_vp_nan_rows: dtype %d", fn, dtype);
  }
  return launch_error(fn, "vp_nan_rows_kernel");
}

fce_status launch_vp_combine(const VpCombineArgs& a, cudaStream_t s) {
  if (a.ranks < 1 || a.rows < 0 || a.vocab_total < 1 || a.vocab_total > INT32_MAX ||
      !a.targets || !a.gathered)
    return fail(FCE_ERROR_INTERNAL, "%s: launch_vp_combine: bad arguments", a.fn);
  if (a.rows == 0) return FCE_SUCCESS;
  const CeOptions& opt = a.opt;
  CParams p;
  memset(&p, 0, sizeof p);
  p.gathered = a.gathered;
  p.ranks = a.ranks;
  p.rows = a.rows;
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
  p.loss_has_z = opt.reduction == FCE_REDUCTION_NONE ? 1 : 0;
  // as ce_kernels.cu's make_params
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
  int64_t blocks = (a.rows + kCombineThreads - 1) / kCombineThreads;
  if (blocks > 65536) blocks = 65536;
  vp_combine_kernel<<<static_cast<unsigned>(blocks), kCombineThreads, 0, s>>>(p);
  return launch_error(a.fn, "vp_combine_kernel");
}

}  // namespace cuda

// ============================================================== the calls ====
namespace {

constexpr size_t kWsAlign = 256;
size_t align_up(size_t x) { return (x + kWsAlign - 1) / kWsAlign * kWsAlign; }

// Workspace of fce_vp_loss / fce_vp_backward (offsets from the caller's 16-byte aligned pointer):
//   [0, 256)                 CeDenoms (D, Ω, n of the whole problem)
//   loss:     row losses (mean/sum; none writes the caller's loss), row z-loss terms (λ ≠ 0),
//             row correctness (mean/sum, for options->accuracy), align(rows·4) each
//   backward: the combined row statistics CeRowStats [rows] (16 bytes each)
// The same for any argmax / accuracy / lse / z_loss request (the query sees only the options).
struct VpWsLayout {
  size_t denoms = 0, stats = 0, row_loss = 0, row_zloss = 0, row_correct = 0, total = 0;
  bool has_row_loss = false, has_row_zloss = false, has_row_correct = false;
};
VpWsLayout vp_ws_layout(const CeOptions& opt, int64_t rows, bool backward) {
  VpWsLayout l;
  const size_t n = static_cast<size_t>(rows < 0 ? 0 : rows);
  size_t off = align_up(sizeof(cuda::CeDenoms));
  if (backward) {
    l.stats = off;
    off += align_up(n * sizeof(cuda::CeRowStats));
  } else {
    const bool none = opt.reduction == FCE_REDUCTION_NONE;
    if (!none) {
      l.has_row_loss = true;
      l.row_loss = off;
      off += align_up(n * sizeof(float));
    }
    if (opt.z_loss_scale != 0.f) {
      l.has_row_zloss = true;
      l.row_zloss = off;
      off += align_up(n * sizeof(float));
    }
    if (!none) {
      l.has_row_correct = true;
      l.row_correct = off;
      off += align_up(n * sizeof(float));
    }
  }
  l.total = off;
  return l;
}

bool dtype_ok(int dtype) {
  return dtype == FCE_FLOAT32 || dtype == FCE_FLOAT16 || dtype == FCE_BFLOAT16;
}

}  // namespace

fce_status cuda_vp_stats(const VpStatsProblem& p) {
  const char* fn = "fce_vp_stats";
  const CeOptions& opt = p.opt;
  const cuda::NamedPointer pointers[] = {{p.logits, "logits"},
                                         {p.targets, "targets"},
                                         {p.stats, "stats"},
                                         {opt.class_weights, "options->class_weights"}};
  int device = 0;
  FCE_TRY(cuda::check_device_pointers(fn, pointers,
                                      static_cast<int>(sizeof pointers / sizeof pointers[0]),
                                      &device));
  if (!dtype_ok(opt.dtype))
    return fail(FCE_ERROR_INTERNAL, "%s: dtype %d reached the CUDA backend", fn, opt.dtype);
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  if (opt.class_weights)
    FCE_TRY(cuda::launch_vp_weights(fn, opt, p.rows, p.vocab_start, p.vocab_local, p.stats, stream));
  cuda::VpStatsArgs a{};
  a.fn = fn;
  a.opt = opt;
  a.row_begin = 0;
  a.row_count = p.rows;
  a.logits = p.logits;
  a.logits_dtype = opt.dtype;
  a.row_stride = p.row_stride;
  a.vocab_total = p.vocab_total;
  a.vocab_start = p.vocab_start;
  a.vocab_local = p.vocab_local;
  a.targets = p.targets;
  a.stats = p.stats;
  a.weight_written = opt.class_weights != nullptr;
  return cuda::launch_vp_stats(a, stream);
}

size_t cuda_vp_workspace_size(const CeOptions& opt, int64_t /*ranks*/, int64_t rows,
                              int64_t /*vocab_total*/, int64_t /*vocab_local*/, bool backward) {
  return vp_ws_layout(opt, rows, backward).total;
}

fce_status cuda_vp(const VpProblem& p) {
  const bool backward = p.grad != nullptr;
  const char* fn = backward ? "fce_vp_backward" : "fce_vp_loss";
  const CeOptions& opt = p.opt;

  // ---- everything that can fail before any work is enqueued
  const cuda::NamedPointer pointers[] = {
      {p.targets, "targets"},         {p.gathered, "gathered_stats"},
      {p.loss, "loss"},               {p.lse, "lse"},
      {p.z_loss, "z_loss"},           {p.argmax, "options->argmax"},
      {p.accuracy, "options->accuracy"}, {p.logits, "logits"},
      {p.grad_output, "grad_output"}, {p.grad, "grad_logits"},
      {p.error_flags, "error_flags"}, {opt.class_weights, "options->class_weights"},
      {p.workspace, "workspace"}};
  int device = 0;
  FCE_TRY(cuda::check_device_pointers(fn, pointers,
                                      static_cast<int>(sizeof pointers / sizeof pointers[0]),
                                      &device));
  if (!dtype_ok(opt.dtype))
    return fail(FCE_ERROR_INTERNAL, "%s: dtype %d reached the CUDA backend", fn, opt.dtype);
  const VpWsLayout ws = vp_ws_layout(opt, p.rows, backward);
  if (p.workspace_bytes < ws.total)
    return fail(FCE_ERROR_WORKSPACE_TOO_SMALL, "%s: workspace_bytes (%zu) is less than %zu", fn,
                p.workspace_bytes, ws.total);
  if (!p.workspace)
    return fail(FCE_ERROR_NULL_POINTER, "%s: workspace is NULL (%zu bytes needed)", fn, ws.total);
  if (!backward && !p.loss) return fail(FCE_ERROR_NULL_POINTER, "%s: loss is NULL", fn);
  if (backward && !p.logits) return fail(FCE_ERROR_NULL_POINTER, "%s: logits is NULL", fn);

  char* base = static_cast<char*>(p.workspace);
  auto* denoms = reinterpret_cast<cuda::CeDenoms*>(base + ws.denoms);
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);

  // ---- 1. D, Ω, n from the targets (the whole vocabulary's class weights)
  FCE_VP_TRY(fn, cuda::launch_ce_denominators(opt, p.rows, p.vocab_total, p.targets, denoms, stream));

  cuda::VpCombineArgs c{};
  c.fn = fn;
  c.opt = opt;
  c.ranks = p.ranks;
  c.rows = p.rows;
  c.vocab_total = p.vocab_total;
  c.targets = p.targets;
  c.gathered = p.gathered;
  c.error_flags = p.error_flags;

  if (!backward) {
    // ---- 2. the combination: per-row losses, lse, argmax, correctness
    const bool none = opt.reduction == FCE_REDUCTION_NONE;
    float* row_loss = none ? p.loss : reinterpret_cast<float*>(base + ws.row_loss);
    float* row_zloss = (ws.has_row_zloss && (!none || p.z_loss))
                           ? reinterpret_cast<float*>(base + ws.row_zloss) : nullptr;
    float* row_correct = !p.accuracy ? nullptr
                         : none ? p.accuracy : reinterpret_cast<float*>(base + ws.row_correct);
    c.row_loss = row_loss;
    c.row_zloss = row_zloss;
    c.lse = p.lse;
    c.argmax = p.argmax;
    c.row_correct = row_correct;
    FCE_TRY(cuda::launch_vp_combine(c, stream));
    // ---- 3. the fixed-order reduction (for none the rows are the outputs: only z_loss left)
    FCE_VP_TRY(fn, cuda::launch_ce_finalize(opt, p.rows, row_loss, row_zloss, row_correct, denoms,
                                            none ? nullptr : p.loss, p.z_loss,
                                            none ? nullptr : p.accuracy, stream));
    return FCE_SUCCESS;
  }

  // ---- 2. the combination: the row statistics of the gradient
  auto* stats = reinterpret_cast<cuda::CeRowStats*>(base + ws.stats);
  c.stats_out = stats;
  FCE_TRY(cuda::launch_vp_combine(c, stream));

  // ---- 3. the shard's gradient: the backward row kernel on a column slice of the vocabulary
  cuda::CeRowsArgs a{};
  a.opt = opt;
  a.vocab = p.vocab_local;
  a.vocab_total = p.vocab_total;
  a.col_begin = p.vocab_start;
  a.total_rows = p.rows;
  a.row_begin = 0;
  a.row_count = p.rows;
  a.logits = p.logits;
  a.logits_dtype = opt.dtype;
  a.row_stride = p.row_stride;
  a.grad = p.grad;
  a.grad_dtype = opt.dtype;
  a.grad_row_stride = p.grad_row_stride;
  a.targets = p.targets;
  a.denoms = denoms;
  a.grad_output = p.grad_output;
  a.stats_in = stats;
  a.error_flags = p.error_flags;
  FCE_VP_TRY(fn, cuda::launch_ce_rows(a, stream));
  // ---- 4. ignored rows of an inconsistent tiling: NaN as well (the row kernel wrote 0)
  return cuda::launch_vp_nan_rows(fn, stats, p.rows, p.grad, opt.dtype, p.vocab_local,
                                  p.grad_row_stride, stream);
}

}  // namespace fce
