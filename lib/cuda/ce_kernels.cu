// ce_kernels.cu — cross-entropy over given logits, row by row (SPEC.md steps 1-5, SEMANTICS.md
// rules 1-12): each row's loss, lse and λ·lse², and the gradient, in ONE read of the logits and
// ONE write of the gradient; plus the denominators pre-pass and the fixed-order finalize.
//
// Why it is fast. The op is memory bound (forward + gradient moves 2·N·V·e bytes for ~20 flops
// per element), so the goal is to touch each logit exactly once. A row is 250-500 KB, more than
// one SM's shared memory, so:
//   * Register path (ce_rows_regs_kernel), rows up to 512 KB: a row is split over a cluster of
//     k ∈ {1,2,4,8} CTAs (k = 1 only on sm_80), each CTA holding its ≤ 64 KB slice IN REGISTERS
//     as 16-byte vectors (≤ 512 threads × 8 uint4 = 32 registers). A thread issues all 8 of its
//     loads before the first use (64 KB in flight per CTA). Per thread an online (max, Σexp)
//     over its vectors (exp2 of scaled differences), a warp/CTA tree, then the CTAs of the
//     cluster read each other's (max, Σexp[, Σω·a]) through distributed shared memory and every
//     CTA folds them in rank order, so all agree bit for bit on the lse. The gradient is then
//     computed from the registers and stored with 16-byte stores. ≤ 64 registers per thread
//     (launch bounds 512 × 2) keep two CTAs per SM: one CTA's loads overlap the other's math
//     and stores. The block is cut to the row (threads = ⌈slice / 8⌉ rounded up to a warp), and
//     k is the smallest size whose slices fit, so a CTA is nearly full. Three compiled modes per
//     dtype pair (plain, softcap, general = label smoothing) keep the hot ones lean; the general
//     mode needs ~75-88 registers and runs one CTA per SM rather than spill.
//   * Two-pass path (ce_rows_stream_kernel<…, BWD = false>), any V (rows past 512 KB, sm_80 rows
//     past 64 KB, or no cluster fits): one 1024-thread CTA per row, one CTA per SM, so only
//     #SMs rows (≈ 33 MB at 250 KB) are in flight and the second read mostly hits the 50 MB L2.
//     Pass 1: online (max, Σexp) with L2-keeping loads; pass 2 rereads the row BACKWARDS (the
//     last-read part is the likeliest still in L2) and writes the gradient.
//   * Backward (ce_rows_stream_kernel<…, BWD = true>): the saved lse makes every element
//     independent: one streaming pass with per-row constants; ignored and invalid rows are
//     written without being read.
// Correctness rules kept by construction:
//   * Row starts need not be 16-byte aligned (odd V, any stride): vector v of a row covers
//     elements [v·E − lead, v·E − lead + E), lead = (row address mod 16) / e. Vectors inside
//     the row use 16-byte accesses; the ≤ 2 partial vectors of a row use element accesses for
//     its own elements only, so nothing outside [row, row + V) is ever read or written. When the
//     gradient's alignment differs from the logits' (other stride, base or dtype), vector v of
//     the gradient is stored element by element.
//   * Forward and backward write the same gradient bits: both compute every element in
//     grad_vector() from the same float lse and the same row constants (make_row_grad), with
//     explicit _rn intrinsics so no FMA contraction can differ between kernels or modes.
//   * No float atomics: per-row values go to row_loss / row_zloss; ce_finalize_kernel sums
//     them in a fixed order (one block, double accumulation): deterministic run to run.
//   * 64-bit row offsets (row · stride · e in int64); 32-bit element indices only where V is
//     known to be < 2^19 (register path).
//   * The register path's index arithmetic (reg_config, reg_slice, is_full, grad_vec_ok) is
//     shared with a host self-test, ce_rows_selftest() (build with -DFCE_CE_SELFTEST): every
//     element owned exactly once, every 16-byte access aligned and inside its row.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/ce_rows.cuh"

namespace fce {
namespace cuda {
namespace {

// ---------------------------------------------------------------- configuration ----
constexpr int kRegThreads = 512;      // most threads of a register-path CTA
constexpr int kRegVpt = 8;            // 16-byte vectors per thread (32 registers of the row)
constexpr int kRegVecsPerCta = kRegThreads * kRegVpt;  // 4096 vectors = 64 KB
constexpr int kMaxCluster = 8;        // portable cluster size limit
constexpr int64_t kRegMaxVocab = int64_t(kRegVecsPerCta) * kMaxCluster * 8;  // loose bound
constexpr int kTwoPassThreads = 1024;
constexpr int kBackwardThreads = 512;
constexpr int kStreamUnroll = 4;      // vectors in flight per thread in the streaming kernels
constexpr int kReduceThreads = 1024;  // denominators / finalize (one block)
constexpr int64_t kMaxRowsPerLaunch = int64_t(1) << 27;  // × 8 CTAs stays below 2^31 blocks
static_assert(kRegVecsPerCta * 16 == 64 * 1024, "a register-path CTA holds 64 KB of its row");
static_assert(kRegMaxVocab < (int64_t(1) << 30), "register path indexes elements with int32");
static_assert(kRegThreads % 32 == 0 && kTwoPassThreads % 32 == 0 && kBackwardThreads % 32 == 0,
              "block sizes are whole warps");
static_assert(kRegThreads <= 1024 && kTwoPassThreads <= 1024 && kReduceThreads <= 1024,
              "at most 32 warps: one warp folds the per-warp partials");
static_assert(kMaxRowsPerLaunch * kMaxCluster <= int64_t(INT32_MAX), "grid.x limit");
static_assert(kMaxCluster <= 32, "one warp reads the cluster's partials");

constexpr float kLog2e = 1.4426950408889634f;

enum RowKind : int { kIgnored = 0, kValid = 1, kInvalid = 2 };

// The feature set a kernel is compiled for. kPlain: no softcap and no label smoothing (class
// weights, z-loss and scale are per-row scalars, always allowed). kCap: softcap. kGeneral:
// softcap and label smoothing decided at run time (smoothing needs Σω·a and ω_j per element).
enum Mode : int { kPlain = 0, kCap = 1, kGeneral = 2 };

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
  int rescale;          // backward: fce_backward_rescale (see ce_rows.cuh)
  int cluster_log2;     // log2 of the CTAs per row (register path; k = 1, 2, 4, 8)
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
};

template <int MODE> __device__ __forceinline__ bool use_cap(const KParams& p) {
  return MODE == kCap || (MODE == kGeneral && p.cap);
}
template <int MODE> __device__ __forceinline__ bool use_smooth(const KParams& p) {
  return MODE == kGeneral && p.smooth;
}

// ------------------------------------------------------------------ dtype traits ----
template <class T> struct Ty;
template <> struct Ty<float> { static constexpr int kBytes = 4; };
template <> struct Ty<__half> { static constexpr int kBytes = 2; };
template <> struct Ty<__nv_bfloat16> { static constexpr int kBytes = 2; };
// Elements of TZ per 16-byte vector.
template <class TZ> constexpr int vec_elems() { return 16 / Ty<TZ>::kBytes; }

// Raw element bits (low bits of a word) -> float.
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

// One element <-> float (round to nearest even), for element-wise loops.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Two floats -> a packed pair of 16-bit values (round to nearest even), lo in the low half.
template <class T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t r;
  memcpy(&r, &v, 4);
  return r;
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  uint32_t r;
  memcpy(&r, &v, 4);
  return r;
}

// A 16-byte vector of TZ -> E floats.
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

// ------------------------------------------------------------- memory accesses ----
// Vector v of a row has elements [j0, j0 + E); "full" = all of them inside [0, V). I is the
// index type (int in the register path, int64_t in the streaming kernels).
template <class I, int E> __host__ __device__ __forceinline__ bool is_full(I j0, int V) {
  return j0 >= 0 && j0 <= I(V) - E;
}

enum CacheOp : int { kStreaming = 0, kKeepInL2 = 1 };

template <int OP> __device__ __forceinline__ uint4 ld_vec(const uint4* p) {
  if constexpr (OP == kStreaming) return __ldcs(p);  // evict-first: read once
  else return __ldcg(p);                              // L2 only: pass 2 rereads it
}
template <class TZ> __device__ __forceinline__ uint32_t ld_elem(const char* p) {
  if constexpr (Ty<TZ>::kBytes == 4) return __ldcg(reinterpret_cast<const unsigned int*>(p));
  else return __ldcg(reinterpret_cast<const unsigned short*>(p));
}

// Loads vector [j0, j0 + E) of a row: one 16-byte load when full, else its in-row elements one
// by one (the others 0): never a byte outside the row.
template <class TZ, int OP, class I>
__device__ __forceinline__ uint4 load_vector(const char* zrow, I j0, bool full, int V) {
  constexpr int E = vec_elems<TZ>();
  constexpr int eb = Ty<TZ>::kBytes;
  if (full) return ld_vec<OP>(reinterpret_cast<const uint4*>(zrow + j0 * eb));
  uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int q = 0; q < E; ++q) {
    const I j = j0 + q;
    if (j >= 0 && j < V) {
      const uint32_t raw = ld_elem<TZ>(zrow + j * eb);
      if constexpr (eb == 4) w[q] = raw;
      else w[q >> 1] |= raw << (16 * (q & 1));
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Stores the E gradient values of vector [j0, j0 + E): one vector store when the vector is full
// and the gradient row is aligned like the logits row (vec_ok), else its in-row elements one by
// one with the same rounding.
template <class TG, int E, class I>
__device__ __forceinline__ void store_grad(char* grow, I j0, bool full, bool vec_ok, int V,
                                           const float (&g)[E]) {
  constexpr int gb = Ty<TG>::kBytes;
  if (full && vec_ok) {
    char* dst = grow + j0 * gb;
    if constexpr (gb == 4) {
      static_assert(E == 4, "a float32 gradient comes from float32 logits");
      __stcs(reinterpret_cast<uint4*>(dst), make_uint4(__float_as_uint(g[0]), __float_as_uint(g[1]),
                                                       __float_as_uint(g[2]), __float_as_uint(g[3])));
    } else if constexpr (E == 8) {
      __stcs(reinterpret_cast<uint4*>(dst), make_uint4(pack2<TG>(g[0], g[1]), pack2<TG>(g[2], g[3]),
                                                       pack2<TG>(g[4], g[5]), pack2<TG>(g[6], g[7])));
    } else {
      static_assert(E == 4, "16-bit gradient of float32 logits: 8-byte vectors");
      __stcs(reinterpret_cast<uint2*>(dst), make_uint2(pack2<TG>(g[0], g[1]), pack2<TG>(g[2], g[3])));
    }
    return;
  }
#pragma unroll
  for (int q = 0; q < E; ++q) {
    const I j = j0 + q;
    if (j >= 0 && j < V) {
      char* dst = grow + j * gb;
      if constexpr (gb == 4) {
        __stcs(reinterpret_cast<float*>(dst), g[q]);
      } else {
        __stcs(reinterpret_cast<unsigned short*>(dst),
               static_cast<unsigned short>(pack2<TG>(g[q], 0.f) & 0xffffu));
      }
    }
  }
}

// The gradient row may take vector stores iff (gradient row address − lead·e_g) is a multiple
// of E·e_g: then gradient vector v starts exactly where logits vector v does, in elements.
__host__ __device__ __forceinline__ bool grad_vec_ok(uintptr_t grow, int lead, int E, int gb) {
  const uintptr_t vb = uintptr_t(E) * uintptr_t(gb);
  return ((grow - uintptr_t(lead) * uintptr_t(gb)) % vb) == 0;
}
template <class TZ, class TG>
__device__ __forceinline__ bool grad_vec_ok(const char* grow, int lead) {
  return grad_vec_ok(reinterpret_cast<uintptr_t>(grow), lead, vec_elems<TZ>(), Ty<TG>::kBytes);
}

// ------------------------------------------------------------------- the math ----
__device__ __forceinline__ float ex2(float x) {  // 2^x (results below 2^-126 flush to 0)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float qnan() { return __int_as_float(0x7fffffff); }

// SPEC steps 1-2: a = s·z, or a = c·tanh(s·z/c) with t = tanh(s·z/c) kept for the factor 1 − t².
template <int MODE>
__device__ __forceinline__ float xform(float z, const KParams& p, float& t) {
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

// Merges (m2, s2, sw2) into x. Symmetric bit for bit (merge(x, y) == merge(y, x)), so a
// butterfly leaves the same value in every lane. SW = false: Σω·a is not carried.
template <bool SW>
__device__ __forceinline__ void combine(Partial& x, float m2, float s2, double sw2) {
  const float mn = fmaxf(x.m, m2);
  // the equal case also covers m = mn = ±inf (no inf − inf)
  const float s1 = x.m == mn ? x.s : __fmul_rn(x.s, ex2(__fmul_rn(__fsub_rn(x.m, mn), kLog2e)));
  const float t2 = m2 == mn ? s2 : __fmul_rn(s2, ex2(__fmul_rn(__fsub_rn(m2, mn), kLog2e)));
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

// CTA-wide reduce; every lane of warp 0 returns the CTA's partial (other warps: don't care).
template <bool SW> __device__ __forceinline__ Partial block_reduce(Partial x, Partial* s_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  warp_reduce<SW>(x);
  if (lane == 0) s_warp[warp] = x;
  __syncthreads();
  Partial r = partial_identity();
  if (warp == 0) {
    if (lane < nwarps) r = s_warp[lane];
    warp_reduce<SW>(r);
  }
  return r;
}

// Phase 1 on one vector: online max / Σexp (and Σω·(a − c) when smoothing) of its in-row
// elements. With `track`, am follows the index of the first element equal to the thread's
// running maximum (a thread visits its vectors in increasing index order, so a later equal
// value never replaces it): the argmax at the cost of a compare per vector (see row_argmax).
template <class TZ, int MODE, class I>
__device__ __forceinline__ void online_vector(const uint4& raw, I j0, bool full, const KParams& p,
                                              float c, Partial& acc, bool track, int& am) {
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
  acc.s = acc.m == mn ? acc.s : __fmul_rn(acc.s, ex2(__fmul_rn(__fsub_rn(acc.m, mn), kLog2e)));
  acc.m = mn;
  const float ms = mn == neg_inf() ? 0.f : mn;  // all −inf so far: every term is exp(−inf) = 0
#pragma unroll
  for (int q = 0; q < E; ++q) acc.s = __fadd_rn(acc.s, ex2(__fmul_rn(__fsub_rn(a[q], ms), kLog2e)));
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

// The argmax of a row (SEMANTICS rule 15) as a minimum over keys: j for a NaN element, 2^32 + j
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

// What thread 0 of a CTA learns about its row (SEMANTICS rules 1-4, 6); shared via smem.
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

__device__ __forceinline__ int classify_row(const KParams& p, int64_t row, int64_t* y_out) {
  int64_t ti = row;
  *y_out = 0;
  if (p.shift_T > 0) {
    if (row % p.shift_T >= p.shift_T - p.shift_k) return kIgnored;  // never read past the sequence
    ti = row + p.shift_k;
  }
  const int64_t y = p.targets_int64 ? static_cast<const int64_t*>(p.targets)[ti]
                                    : static_cast<int64_t>(static_cast<const int32_t*>(p.targets)[ti]);
  *y_out = y;
  if (y == p.ignore_index) return kIgnored;
  if (y < 0 || y >= p.vocab_total) return kInvalid;
  return kValid;
}

template <class TZ, int MODE>
__device__ RowInfo load_row_info(const KParams& p, int64_t row, const char* zrow, bool need_ay) {
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
      r.k = D > 0.f ? __fdiv_rn(g, D) : 0.f;
      r.kz = n > 0.f ? __fdiv_rn(g, n) : 0.f;
      // from the denominators only, never from g, so that every g takes the same formula
      if (p.two_lambda != 0.f && D != n) r.rho = D > 0.f ? __fdiv_rn(D, n) : 0.f;
    }
  }
  r.omega = 0.f;
  if (use_smooth<MODE>(p)) r.omega = p.class_weights ? p.denoms->omega_total : static_cast<float>(p.vocab_total);
  return r;
}

// A row's statistics once reduced (SEMANTICS rules 8-10): m, ls = log S, lse = m + ls (−inf for
// a row of −inf, +inf for a row with a +inf entry, NaN with a NaN, as the CPU reference), and
// the token-scaling factor t = p_y (1 when off or not a valid row).
struct RowVals {
  float m, ls, lse, t;
};
__device__ __forceinline__ float row_lse(const Partial& f) {
  return f.m == -neg_inf() ? f.m : __fadd_rn(f.m, logf(f.s));
}
// p_j = exp((a_j − m) − ls): m and ls apart (rule 9), never through the rounded lse.
__device__ __forceinline__ float prob(float a, float m, float ls) {
  return ex2(__fmul_rn(__fsub_rn(__fsub_rn(a, m), ls), kLog2e));
}
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

// Forward per-row outputs (SEMANTICS rules 2, 3, 8), by one thread per row. c is the smoothing
// reference (online_vector).
template <int MODE>
__device__ void write_row_outputs(const KParams& p, int64_t row, const RowInfo& ri,
                                  const Partial& f, const RowVals& v, float c) {
  if (p.lse_out) p.lse_out[row] = v.lse;
  if (p.stats_out) p.stats_out[row] = CeRowStats{v.m, v.ls, v.t, 0.f};
  float zl = (ri.kind != kIgnored && p.lambda != 0.f) ? __fmul_rn(p.lambda, __fmul_rn(v.lse, v.lse)) : 0.f;
  float ce = 0.f;
  if (ri.kind == kInvalid) {
    ce = qnan();
    if (p.error_flags) atomicOr(p.error_flags, FCE_FLAG_TARGET_OUT_OF_RANGE);
  } else if (ri.kind == kValid) {
    // lse − a_y as (m − a_y) + ls: the rounding of lse stays out of the difference
    const float nll = isinf(v.m) ? __fsub_rn(v.lse, ri.ay) : __fadd_rn(__fsub_rn(v.m, ri.ay), v.ls);
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

// Per-row constants of the gradient (SEMANTICS rule 9), with p_j = exp((a_j − m) − ls):
//   ∂z_j = ks · (A·p_j − B·ω_j − [j = y]·Y) (· (1 − t_j²) with softcap), where
//   Y = (1−ε)ω_y,  As = (ε/V)Ω,  Az = 2λ·lse·ρ,  A = Y + As + Az,  B = ε/V,  ks = k·t·s,
// ρ = k_z / k (D / n for mean, 1 otherwise) puts the z-loss term's own upstream scale inside.
// The upstream scale multiplies last, so that a gradient written for g = 1 and scaled by a power
// of two equals the one written for that g bit for bit, signed zeros included (rule 14). When
// D = 0 < n (mean, every target weighted 0: k = 0, k_z ≠ 0) only the z-loss term is left:
// A = Az = 2λ·lse, ks = k_z·t·s.
// The target element is computed as Y*(p_y - 1) + (p_y*As - B*w_y) + p_y*Az: when p_y is near
// 1 (a confident model) p_y*A - Y would cancel and lose the small difference; p_y - 1 is exact
// there (Sterbenz), and As - B*w_y cancels exactly where it should (V = 1, or w_y = Omega).
struct RowGrad {
  float m, ls, A, As, Az, B, Y, ks;
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
  return g;
}

// The gradient of one vector of a valid row: THE one place a gradient element is computed
// (forward, two-pass and backward all call it, in every mode); rule 12 rests on it.
template <class TZ, class TG, int MODE, class I>
__device__ __forceinline__ void grad_vector(const uint4& raw, I j0, bool full, bool vec_ok,
                                            const KParams& p, const RowGrad& rg, int64_t y,
                                            char* grow) {
  constexpr int E = vec_elems<TZ>();
  float g[E];
  unpack<TZ>(raw, g);
  // the target within this vector: inside the buffer's columns only (a column slice's partial
  // end vectors cover classes of the neighbouring slices, and a row's first partial vector
  // starts before the row)
  const int64_t yl = y - p.col_begin;
  const int64_t dyl = yl - static_cast<int64_t>(j0);
  const int dy = (yl >= 0 && yl < p.vocab && dyl >= 0 && dyl < E) ? static_cast<int>(dyl) : -1;
  const bool weighted = use_smooth<MODE>(p) && p.class_weights != nullptr;
  // 16-bit logits: the target element (at most one per row) is computed after the loop and
  // stored over the vector's value, instead of a per-element `q == dy` test (a compare and a
  // predicated chain on every element). Measured (bench/NOTES.md, version 3): up to 4 % faster
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
    float da = __fmaf_rn(pr, rg.A, -b);
    if (!kTargetAfter && q == dy)
      da = __fmaf_rn(rg.Y, __fsub_rn(pr, 1.f), __fmaf_rn(pr, rg.Az, __fmaf_rn(pr, rg.As, -b)));
    float gq = __fmul_rn(da, rg.ks);
    if (use_cap<MODE>(p)) gq = __fmul_rn(gq, __fmaf_rn(-t, t, 1.f));
    g[q] = gq;
  }
  store_grad<TG, E>(grow, j0, full, vec_ok, p.vocab, g);
  if (kTargetAfter && dy >= 0) {  // same thread, same address, later in program order: it stays
    float t;
    const float a = xform<MODE>(zy, p, t);
    const float pr = prob(a, rg.m, rg.ls);
    const float b = weighted ? __fmul_rn(rg.B, __ldg(p.class_weights + y)) : rg.B;
    const float da =
        __fmaf_rn(rg.Y, __fsub_rn(pr, 1.f), __fmaf_rn(pr, rg.Az, __fmaf_rn(pr, rg.As, -b)));
    float gy = __fmul_rn(da, rg.ks);
    if (use_cap<MODE>(p)) gy = __fmul_rn(gy, __fmaf_rn(-t, t, 1.f));
    char* dst = grow + (y - p.col_begin) * Ty<TG>::kBytes;
    if constexpr (Ty<TG>::kBytes == 4) {
      __stcs(reinterpret_cast<float*>(dst), gy);
    } else {
      __stcs(reinterpret_cast<unsigned short*>(dst),
             static_cast<unsigned short>(pack2<TG>(gy, 0.f) & 0xffffu));
    }
  }
}

// Ignored rows: 0; invalid rows: NaN (SEMANTICS rules 2, 3).
template <class TG, int E, class I>
__device__ __forceinline__ void fill_vector(I j0, bool full, bool vec_ok, int V, float value,
                                            char* grow) {
  float g[E];
#pragma unroll
  for (int q = 0; q < E; ++q) g[q] = value;
  store_grad<TG, E>(grow, j0, full, vec_ok, V, g);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Release/acquire: the CTA's partial (shared memory) becomes visible to the cluster.
__device__ __forceinline__ void cluster_sync_release_acquire() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// "Done reading the others' shared memory" (the values read are already consumed): no fence.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}
#endif

// fce_backward_rescale's prologue of the forward kernels (SEMANTICS rule 14), read on the device:
// returns true when the CTA is done: *grad_output is 1 (nothing to do), or 0 / ± a power of two
// (the valid row's part [col0, col1) of the gradient already there is scaled in place: exact;
// ignored rows stay +0, invalid rows NaN). False: compute the gradient as the forward does.
template <class TG>
__device__ __forceinline__ bool rescale_prologue(const KParams& p, int64_t row, char* grow,
                                                 int64_t col0, int64_t col1) {
  const float g = *p.grad_output;
  if (g == 1.f) return true;
  const uint32_t bits = __float_as_uint(g), ex = (bits >> 23) & 0xffu;
  if (!((bits & 0x7fffffffu) == 0 || ((bits & 0x7fffffu) == 0 && ex != 0 && ex != 0xffu)))
    return false;
  int64_t y;
  if (classify_row(p, row, &y) == kValid) {
    TG* gr = reinterpret_cast<TG*>(grow);
    for (int64_t j = col0 + threadIdx.x; j < col1; j += blockDim.x)
      gr[j] = from_float<TG>(__fmul_rn(to_float(gr[j]), g));
  }
  return true;
}

// ============================================================ register path ====
// The register path's split of one row. Row elements are addressed through 16-byte vectors of
// E = 16/e elements: vector v holds elements [v·E − lead, v·E − lead + E), lead = (row address
// mod 16)/e, so vector 0 may start before the row and the last may end after it (only their
// in-row elements are touched). CTA `rank` of k = 2^lg holds vectors [rank·per, vend); thread
// tid of nt holds vectors v0 + i·nt (slots i < kRegVpt) that are < vend. Used by the kernel and
// by the host self-test (ce_rows_selftest), so both check the same arithmetic.
struct RegSlice {
  int lead;   // elements of the row's first vector that precede the row
  int nvec;   // vectors covering the row
  int per;    // vectors per CTA (the last CTAs may have fewer, or none)
  int v0;     // this thread's first vector
  int vend;   // past this CTA's last vector
  int j00;    // element index of vector v0's first element (< 0: the row's partial first vector)
  int jstep;  // element distance between slots, nt·E
};
__host__ __device__ __forceinline__ RegSlice reg_slice(uintptr_t row_addr, int elem_bytes, int V,
                                                       int lg, int rank, int tid, int nt) {
  const int E = 16 / elem_bytes;
  RegSlice g;
  g.lead = static_cast<int>((row_addr & 15) / static_cast<uintptr_t>(elem_bytes));
  g.nvec = (g.lead + V + E - 1) / E;
  g.per = (g.nvec + (1 << lg) - 1) >> lg;
  g.v0 = rank * g.per + tid;
  g.vend = (rank + 1) * g.per < g.nvec ? (rank + 1) * g.per : g.nvec;
  g.j00 = g.v0 * E - g.lead;
  g.jstep = nt * E;
  return g;
}

// grid.x = rows × k, clusters of (k,1,1) when k > 1. CTA `rank` of a row holds its vectors
// [rank·per, min((rank+1)·per, nvec)); thread t the vectors rank·per + t + i·blockDim,
// i < kRegVpt. The host guarantees blockDim·kRegVpt ≥ per for every row (reg_config) and
// V ≤ kRegMaxVocab (int indices).
// Two CTAs per SM (≤ 64 registers) for the plain and softcap modes; the general mode (label
// smoothing: ω_j loads and a double sum per vector) needs more registers than 64 − 32 and runs
// one CTA per SM instead of spilling.
template <class TZ, class TG, int MODE>
__global__ void __launch_bounds__(kRegThreads, MODE == kGeneral ? 1 : 2)
    ce_rows_regs_kernel(const KParams p) {
  constexpr int E = vec_elems<TZ>();
  constexpr int eb = Ty<TZ>::kBytes;
  constexpr bool SW = MODE == kGeneral;
  __shared__ Partial s_warp[32];
  __shared__ Partial s_final;  // the row's
  __shared__ RowInfo s_info;
  __shared__ uint64_t s_wmin[32];
  __shared__ uint32_t s_cand[kRegThreads];  // each thread's argmax candidate
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ Partial s_part;   // this CTA's, read by the cluster
  __shared__ uint64_t s_best_part;
#endif

  const int lg = p.cluster_log2;
  const int k = 1 << lg;
  const int64_t lrow = blockIdx.x >> lg;
  const int rank = static_cast<int>(blockIdx.x & static_cast<unsigned>(k - 1));
  const int64_t row = p.row_begin + lrow;
  const char* zrow = p.logits + lrow * p.z_row_bytes;
  const int V = p.vocab;
  const int tid = threadIdx.x, nt = blockDim.x;
  const RegSlice g = reg_slice(reinterpret_cast<uintptr_t>(zrow), eb, V, lg, rank, tid, nt);
  const int lead = g.lead, v0 = g.v0, vend = g.vend, j00 = g.j00, jstep = g.jstep;
  if (p.rescale) {  // fce_backward_rescale: every CTA of the cluster decides the same way
    const int64_t per = (int64_t(V) + k - 1) / k, c0 = rank * per, c1 = c0 + per < V ? c0 + per : V;
    if (rescale_prologue<TG>(p, row, p.grad + lrow * p.g_row_bytes, c0, c1)) return;
  }
  const bool want_argmax = p.argmax_out != nullptr || p.row_correct != nullptr;

  // ---- all loads of the slice in flight at once
  uint4 buf[kRegVpt];
#pragma unroll
  for (int i = 0; i < kRegVpt; ++i) {
    const int j0 = j00 + i * jstep;
    buf[i] = make_uint4(0u, 0u, 0u, 0u);
    if (v0 + i * nt < vend) buf[i] = load_vector<TZ, kStreaming>(zrow, j0, is_full<int, E>(j0, V), V);
  }
  if (tid == 0) s_info = load_row_info<TZ, MODE>(p, row, zrow, rank == 0 || p.token_scaling);
  const float c = smoothing_reference<TZ, MODE>(p, zrow);

  // ---- phase 1: (max, Σexp[, Σω·(a − c)]) of the slice
  Partial acc = partial_identity();
  int am = -1;
#pragma unroll
  for (int i = 0; i < kRegVpt; ++i) {
    const int j0 = j00 + i * jstep;
    if (v0 + i * nt < vend)
      online_vector<TZ, MODE>(buf[i], j0, is_full<int, E>(j0, V), p, c, acc, want_argmax, am);
  }
  const Partial blk = block_reduce<SW>(acc, s_warp);

  // ---- the row's partial: this CTA's, or the cluster's folded in rank order
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (k > 1) {
    if (tid == 0) s_part = blk;
    cluster_sync_release_acquire();
    if (tid < 32) {
      Partial mine = partial_identity();
      if (tid < k) mine = *cooperative_groups::this_cluster().map_shared_rank(&s_part, tid);
      Partial f = partial_identity();
      for (int r = 0; r < k; ++r)
        combine<SW>(f, __shfl_sync(0xffffffffu, mine.m, r), __shfl_sync(0xffffffffu, mine.s, r),
                    SW ? __shfl_sync(0xffffffffu, mine.sw, r) : 0.0);
      if (tid == 0) s_final = f;
    }
    // waited for before exit: nobody reads s_part of an exited CTA (with the argmax, the
    // exchange below does that)
    if (!want_argmax) cluster_arrive_relaxed();
  } else
#endif
  {
    // k > 1 never reaches code built without clusters (the host checks the kernel's PTX
    // version); were it to, the row would be NaN rather than silently wrong.
    if (tid == 0) s_final = k == 1 ? blk : Partial{qnan(), qnan(), 0.0};
  }
  __syncthreads();
  const Partial fin = s_final;
  const RowInfo ri = s_info;
  const RowVals vals = row_vals(p, ri, fin);
  if (rank == 0 && tid == 0) write_row_outputs<MODE>(p, row, ri, fin, vals, c);
  // the argmax comes after the gradient: this thread's candidate waits in shared memory (no
  // register held through the gradient), the row's statistics are read again from s_final
  if (want_argmax) s_cand[tid] = (am >= 0 && acc.m == fin.m) ? static_cast<uint32_t>(am) : 0xffffffffu;

  // ---- phase 2: the gradient, from the registers
  if (p.grad) {
    char* grow = p.grad + lrow * p.g_row_bytes;
    const bool vec_ok = grad_vec_ok<TZ, TG>(grow, lead);
    if (ri.kind == kValid) {
      const RowGrad rg = make_row_grad<MODE>(p, ri, vals);
#pragma unroll
      for (int i = 0; i < kRegVpt; ++i) {
        const int j0 = j00 + i * jstep;
        if (v0 + i * nt < vend)
          grad_vector<TZ, TG, MODE>(buf[i], j0, is_full<int, E>(j0, V), vec_ok, p, rg, ri.y, grow);
      }
    } else {
      const float value = ri.kind == kInvalid ? qnan() : 0.f;
#pragma unroll 1
      for (int i = 0; i < kRegVpt; ++i) {
        const int j0 = j00 + i * jstep;
        if (v0 + i * nt < vend) fill_vector<TG, E>(j0, is_full<int, E>(j0, V), vec_ok, V, value, grow);
      }
    }
  }
  // ---- the argmax, from the registers (still holding the row), once the gradient is out
  if (want_argmax) {
    const uint32_t cand = s_cand[tid];
    uint64_t best = cand == 0xffffffffu ? kNoArgmax : ((uint64_t(1) << 32) | cand);
    const float row_max = s_final.m;
    if (isnan(s_final.s)) {  // a NaN or +inf in the row: scan the elements (the argmax note above)
      best = kNoArgmax;
#pragma unroll
      for (int i = 0; i < kRegVpt; ++i) {
        const int j0 = j00 + i * jstep;
        if (v0 + i * nt < vend) argmax_vector<TZ, MODE>(buf[i], j0, is_full<int, E>(j0, V), p, row_max, best);
      }
    }
    best = block_min_u64(best, s_wmin);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (k > 1) {
      if (tid == 0) s_best_part = best;
      cluster_sync_release_acquire();
      if (tid < 32) {
        uint64_t mine = kNoArgmax;
        if (tid < k) mine = *cooperative_groups::this_cluster().map_shared_rank(&s_best_part, tid);
        best = warp_min_u64(mine);
      }
      cluster_arrive_relaxed();  // waited for before exit
    }
#endif
    if (rank == 0 && tid == 0) write_argmax_outputs(p, row, ri, best);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (k > 1) cluster_wait();
#endif
}

// ====================================================== streaming kernels ====
// Pass 1 of a streaming CTA: the row's (max, Σexp[, Σω·(a − c)]) with L2-keeping loads; the
// CTA's total is in s_final on return (after a barrier).
template <class TZ, int MODE>
__device__ __forceinline__ Partial stream_reduce(const KParams& p, const char* zrow, int lead,
                                                 int nvec, float c, Partial* s_warp,
                                                 Partial* s_final, bool track, Partial& mine,
                                                 int& am) {
  constexpr int E = vec_elems<TZ>();
  constexpr int U = MODE == kGeneral ? kStreamUnroll / 2 : kStreamUnroll;
  constexpr bool SW = MODE == kGeneral;
  const int V = p.vocab, tid = threadIdx.x, nt = blockDim.x, step = nt * U;
  Partial acc = partial_identity();
  for (int base = tid; base < nvec; base += step) {
    uint4 buf[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = base + u * nt;
      const int64_t j0 = int64_t(v) * E - lead;
      buf[u] = make_uint4(0u, 0u, 0u, 0u);
      if (v < nvec) buf[u] = load_vector<TZ, kKeepInL2>(zrow, j0, is_full<int64_t, E>(j0, V), V);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = base + u * nt;
      const int64_t j0 = int64_t(v) * E - lead;
      if (v < nvec) online_vector<TZ, MODE>(buf[u], j0, is_full<int64_t, E>(j0, V), p, c, acc, track, am);
    }
  }
  mine = acc;
  const Partial blk = block_reduce<SW>(acc, s_warp);
  if (threadIdx.x == 0) *s_final = blk;
  __syncthreads();
  return *s_final;
}

// One CTA per row. BWD = false: the two-pass forward (any V). BWD = true: the backward pass
// from the saved lse (one read and one write; ignored and invalid rows are only written) or from
// the saved row statistics of a column slice (stats_in). A row whose saved |lse| ≥ 1024 is
// reduced again first (pass 1): there the float lse no longer holds log s (SEMANTICS rule 12).
constexpr float kRescueLse = 1024.f;
template <class TZ, class TG, int MODE, bool BWD>
__global__ void __launch_bounds__(BWD ? kBackwardThreads : kTwoPassThreads, BWD ? 2 : 1)
    ce_rows_stream_kernel(const KParams p) {
  constexpr int E = vec_elems<TZ>();
  constexpr int eb = Ty<TZ>::kBytes;
  // (the general two-pass kernel keeps 2 vectors in flight: 4 does not fit 64 registers on sm_80)
  constexpr int U = (MODE == kGeneral && !BWD) ? kStreamUnroll / 2 : kStreamUnroll;
  __shared__ Partial s_warp[32];
  __shared__ Partial s_final;
  __shared__ RowInfo s_info;
  __shared__ uint64_t s_wmin[32];

  const int64_t lrow = blockIdx.x;
  const int64_t row = p.row_begin + lrow;
  const char* zrow = p.logits + lrow * p.z_row_bytes;
  const int V = p.vocab;
  const int lead = static_cast<int>((reinterpret_cast<uintptr_t>(zrow) & 15) / eb);
  const int nvec = static_cast<int>((int64_t(lead) + V + E - 1) / E);  // ≤ 2^29
  const int tid = threadIdx.x, nt = blockDim.x;
  const int step = nt * U;

  if constexpr (!BWD) {
    if (p.rescale && rescale_prologue<TG>(p, row, p.grad + lrow * p.g_row_bytes, 0, V)) return;
  }
  const bool want_argmax = !BWD && (p.argmax_out != nullptr || p.row_correct != nullptr);
  if (tid == 0)
    s_info = load_row_info<TZ, MODE>(p, row, zrow, !BWD || (p.token_scaling && !p.stats_in));
  const float c = BWD ? 0.f : smoothing_reference<TZ, MODE>(p, zrow);
  RowVals vals;
  Partial fin = partial_identity(), mine;
  int am = -1;
  if constexpr (!BWD) {
    fin = stream_reduce<TZ, MODE>(p, zrow, lead, nvec, c, s_warp, &s_final, want_argmax, mine, am);
    vals = row_vals(p, s_info, fin);
  } else {
    __syncthreads();  // s_info
    if (p.stats_in) {
      const CeRowStats st = p.stats_in[row];
      vals = RowVals{st.m, st.ls, __fadd_rn(st.m, st.ls), st.t};
    } else {
      const float lse = p.lse_in[row];
      if (s_info.kind == kValid && isfinite(lse) && fabsf(lse) >= kRescueLse) {
        fin = stream_reduce<TZ, MODE>(p, zrow, lead, nvec, c, s_warp, &s_final, false, mine, am);
        vals = make_row_vals(p, s_info, fin.m, logf(fin.s), lse);
      } else {
        vals = make_row_vals(p, s_info, lse, 0.f, lse);  // exp((a − lse) − 0)
      }
    }
  }
  const RowInfo ri = s_info;
  if constexpr (!BWD) {
    // The forward's argmax: tracked in pass 1, or (a row with a NaN or +inf) a scan of its own.
    uint64_t best = kNoArgmax;
    if (want_argmax && !isnan(fin.s) && am >= 0 && mine.m == fin.m)
      best = (uint64_t(1) << 32) | static_cast<uint32_t>(am);
    if (want_argmax && isnan(fin.s)) {
      for (int v = tid; v < nvec; v += nt) {
        const int64_t j0 = int64_t(v) * E - lead;
        const uint4 raw = load_vector<TZ, kKeepInL2>(zrow, j0, is_full<int64_t, E>(j0, V), V);
        argmax_vector<TZ, MODE>(raw, j0, is_full<int64_t, E>(j0, V), p, fin.m, best);
      }
    }
    if (want_argmax) {
      best = block_min_u64(best, s_wmin);
      if (tid == 0) write_argmax_outputs(p, row, ri, best);
    }
    if (tid == 0) write_row_outputs<MODE>(p, row, ri, fin, vals, c);
  }
  const bool grad_pass = p.grad && ri.kind == kValid;
  char* grow = p.grad ? p.grad + lrow * p.g_row_bytes : nullptr;
  if (grad_pass) {
    const bool vec_ok = grad_vec_ok<TZ, TG>(grow, lead);
    const RowGrad rg = make_row_grad<MODE>(p, ri, vals);
    const int nchunks = (nvec + step - 1) / step;
    for (int ch = 0; ch < nchunks; ++ch) {
      // the forward's second read runs backwards: its last-read vectors are likeliest in L2
      const int base = (BWD ? ch : nchunks - 1 - ch) * step + tid;
      uint4 buf[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = base + u * nt;
        const int64_t j0 = int64_t(v) * E - lead;
        buf[u] = make_uint4(0u, 0u, 0u, 0u);
        if (v < nvec) buf[u] = load_vector<TZ, kStreaming>(zrow, j0, is_full<int64_t, E>(j0, V), V);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = base + u * nt;
        const int64_t j0 = int64_t(v) * E - lead;
        if (v < nvec)
          grad_vector<TZ, TG, MODE>(buf[u], j0, is_full<int64_t, E>(j0, V), vec_ok, p, rg, ri.y, grow);
      }
    }
  } else if (grow) {
    const bool vec_ok = grad_vec_ok<TZ, TG>(grow, lead);
    const float value = ri.kind == kInvalid ? qnan() : 0.f;
    if constexpr (BWD) {
      if (ri.kind == kInvalid && tid == 0 && p.error_flags)
        atomicOr(p.error_flags, FCE_FLAG_TARGET_OUT_OF_RANGE);
    }
    for (int v = tid; v < nvec; v += nt) {
      const int64_t j0 = int64_t(v) * E - lead;
      fill_vector<TG, E>(j0, is_full<int64_t, E>(j0, V), vec_ok, V, value, grow);
    }
  }
}

// =========================================================== one-block sums ====
// Fixed-order block reduce of three doubles; thread 0 ends with the totals.
__device__ __forceinline__ void block_sum3(double (&v)[3], double (*s)[3]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int i = 0; i < 3; ++i)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v[i] = __dadd_rn(v[i], __shfl_xor_sync(0xffffffffu, v[i], o));
  if (lane == 0)
#pragma unroll
    for (int i = 0; i < 3; ++i) s[warp][i] = v[i];
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      v[i] = lane < nwarps ? s[lane][i] : 0.0;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v[i] = __dadd_rn(v[i], __shfl_xor_sync(0xffffffffu, v[i], o));
    }
  }
}

// D = Σ ω_{y_r} over valid rows + #invalid rows, n = #non-ignored rows (rule 4); Ω = Σ_j ω_j
// (or V). One block, U independent loads per thread in flight, a fixed summation order (thread
// t: rows t, t + nt, …; then the fixed tree): deterministic.
__global__ void __launch_bounds__(kReduceThreads) ce_denominators_kernel(const KParams p,
                                                                          int64_t rows,
                                                                          CeDenoms* out) {
  constexpr int U = 8;
  __shared__ double s[32][3];
  const int64_t nt = blockDim.x;
  double v[3] = {0.0, 0.0, 0.0};  // D, Ω, n
  for (int64_t base = threadIdx.x; base < rows; base += nt * U) {
    int64_t y[U];
    int kind[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t r = base + u * nt;
      kind[u] = kIgnored;
      y[u] = 0;
      if (r < rows) kind[u] = classify_row(p, r, &y[u]);
    }
    float w[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      w[u] = kind[u] == kValid ? (p.class_weights ? p.class_weights[y[u]] : 1.f)
                               : kind[u] == kInvalid ? 1.f : 0.f;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      v[0] += static_cast<double>(w[u]);
      v[2] += kind[u] == kIgnored ? 0.0 : 1.0;
    }
  }
  if (p.class_weights) {
    for (int64_t base = threadIdx.x; base < p.vocab; base += nt * U) {
      float w[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t j = base + u * nt;
        w[u] = j < p.vocab ? p.class_weights[j] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) v[1] += static_cast<double>(w[u]);
    }
  }
  block_sum3(v, s);
  if (threadIdx.x == 0) {
    out->denom = static_cast<float>(v[0]);
    out->omega_total = p.class_weights ? static_cast<float>(v[1]) : static_cast<float>(p.vocab);
    out->count = static_cast<float>(v[2]);
  }
}

// SEMANTICS rules 5, 7, 15, from the per-row values, fixed order as above, double accumulation:
//   loss[0]     = Σ ce_r + Σ zl_r (sum), Σ ce_r / D + Σ zl_r / n (mean; each 0 when its divisor is)
//   z_loss[0]   = Σ zl_r (sum, none), Σ zl_r / n (mean)
//   accuracy[0] = Σ correct_r / n (0 when n = 0)
// row_zloss / row_correct null count as 0.
__global__ void __launch_bounds__(kReduceThreads) ce_finalize_kernel(
    int64_t rows, int reduction, const float* row_loss, const float* row_zloss,
    const float* row_correct, const CeDenoms* d, float* loss, float* z_loss, float* accuracy) {
  constexpr int U = 8;
  __shared__ double s[32][3];
  const int64_t nt = blockDim.x;
  double v[3] = {0.0, 0.0, 0.0};
  for (int64_t base = threadIdx.x; base < rows; base += nt * U) {
    float la[U], lb[U], lc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t r = base + u * nt;
      la[u] = (loss && r < rows) ? row_loss[r] : 0.f;
      lb[u] = (row_zloss && r < rows) ? row_zloss[r] : 0.f;
      lc[u] = (row_correct && r < rows) ? row_correct[r] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      v[0] += static_cast<double>(la[u]);
      v[1] += static_cast<double>(lb[u]);
      v[2] += static_cast<double>(lc[u]);
    }
  }
  block_sum3(v, s);
  if (threadIdx.x == 0) {
    const double D = d->denom, n = d->count;
    double ce = v[0], zl = v[1];
    if (reduction == FCE_REDUCTION_MEAN) {
      ce = D > 0.0 ? ce / D : 0.0;
      zl = n > 0.0 ? zl / n : 0.0;
    }
    if (loss) loss[0] = static_cast<float>(ce + zl);
    if (z_loss) z_loss[0] = static_cast<float>(zl);
    if (accuracy) accuracy[0] = n > 0.0 ? static_cast<float>(v[2] / n) : 0.f;
  }
}

// ============================================================== host side ====
KParams make_params(const CeOptions& opt, int64_t vocab) {
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
  p.cluster_log2 = 0;
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
  return p;
}

fce_status launch_error(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return fail(FCE_ERROR_CUDA, "%s: launch failed: %s", kernel, cudaGetErrorString(e));
  return FCE_SUCCESS;
}

// Tuning and measurement overrides, read once: FCE_CUDA_CE_PATH = auto | regs | twopass
// (forward only), FCE_CUDA_CE_CLUSTER = the smallest cluster size to use (1, 2, 4, 8).
struct Overrides {
  int path = 0;  // 0 auto, 1 regs (same as auto when the row fits), 2 twopass
  int min_cluster = 1;
};
const Overrides& overrides() {
  static const Overrides o = [] {
    Overrides r;
    if (const char* s = getenv("FCE_CUDA_CE_PATH")) {
      if (!strcmp(s, "regs")) r.path = 1;
      else if (!strcmp(s, "twopass")) r.path = 2;
    }
    if (const char* s = getenv("FCE_CUDA_CE_CLUSTER")) {
      const int k = atoi(s);
      if (k == 1 || k == 2 || k == 4 || k == 8) r.min_cluster = k;
    }
    return r;
  }();
  return o;
}

// The register path's shape for rows of `vocab` elements of elem_bytes whose starts have at most
// lead_max elements before them in their 16-byte vector: the smallest cluster size k ≥ min_k,
// ≤ max_k whose slices fit a CTA, and the threads per CTA. False when none fits. The checks at
// the end are the kernel's coverage invariant: every vector of every row has a (rank, thread,
// slot), i.e. threads·kRegVpt ≥ ⌈nvec/k⌉ for the largest nvec of any row.
struct RegConfig {
  int k;
  int threads;
};
bool reg_config(int64_t vocab, int elem_bytes, int lead_max, int max_k, int min_k, RegConfig* c) {
  if (vocab < 1 || vocab > kRegMaxVocab) return false;
  const int64_t E = 16 / elem_bytes;
  const int64_t nvec_max = (lead_max + vocab + E - 1) / E;
  for (int k = 1; k <= max_k; k *= 2) {
    if (k < min_k) continue;
    const int64_t per = (nvec_max + k - 1) / k;
    if (per > kRegVecsPerCta) continue;
    int64_t threads = (per + kRegVpt - 1) / kRegVpt;
    threads = (threads + 31) / 32 * 32;
    if (threads > kRegThreads || threads * kRegVpt < per || threads * kRegVpt * k < nvec_max)
      return false;  // cannot happen: the invariant the kernel relies on
    c->k = k;
    c->threads = static_cast<int>(threads);
    return true;
  }
  return false;
}

struct DeviceInfo {
  int device = 0;
  int major = 0;
};
fce_status device_info(DeviceInfo* d) {
  cudaError_t e = cudaGetDevice(&d->device);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&d->major, cudaDevAttrComputeCapabilityMajor, d->device);
  if (e != cudaSuccess)
    return fail(FCE_ERROR_CUDA, "launch_ce_rows: no usable CUDA device: %s", cudaGetErrorString(e));
  return FCE_SUCCESS;
}

// Whether clusters of k CTAs of 512 threads (the largest block) of `kernel` can be resident;
// asked once per (device, kernel, k) and remembered. Also false when the kernel's code was not
// compiled for sm_90+ (e.g. compute_80 PTX JIT-compiled on a Hopper): that code has no cluster
// exchange, and k > 1 would give each CTA its slice's lse only.
constexpr int kMaxDevices = 64;
constexpr int kKernelSlots = 16;  // 5 dtype pairs × 3 modes
std::atomic<signed char> g_cluster_fits[kMaxDevices][kKernelSlots][4];  // 0 unknown, 1 yes, −1 no

template <class K>
bool cluster_fits(const DeviceInfo& dev, K kernel, int slot, int k) {
  if (k == 1) return true;
  if (dev.major < 9) return false;
  const int ki = k == 2 ? 1 : k == 4 ? 2 : 3;
  std::atomic<signed char>* cell = nullptr;
  if (dev.device >= 0 && dev.device < kMaxDevices && slot >= 0 && slot < kKernelSlots) {
    cell = &g_cluster_fits[dev.device][slot][ki];
    const signed char v = cell->load(std::memory_order_relaxed);
    if (v != 0) return v > 0;
  }
  cudaFuncAttributes fa{};
  if (cudaFuncGetAttributes(&fa, kernel) != cudaSuccess || fa.ptxVersion < 90) {
    (void)cudaGetLastError();
    if (cell) cell->store(-1, std::memory_order_relaxed);
    return false;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(k) * 16u);
  cfg.blockDim = dim3(kRegThreads);
  cfg.dynamicSmemBytes = 0;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(k);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg);
  if (e != cudaSuccess) (void)cudaGetLastError();  // a failed query only means "don't use it"
  const bool ok = e == cudaSuccess && clusters > 0;
  if (cell) cell->store(ok ? 1 : -1, std::memory_order_relaxed);
  return ok;
}

template <class TZ, class TG, int MODE>
fce_status launch_forward_regs(const KParams& q, const RegConfig& rc, int64_t n, cudaStream_t s) {
  auto kernel = ce_rows_regs_kernel<TZ, TG, MODE>;
  if (rc.k == 1) {
    kernel<<<static_cast<unsigned>(n), static_cast<unsigned>(rc.threads), 0, s>>>(q);
    return launch_error("ce_rows_regs_kernel");
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(n * rc.k));
  cfg.blockDim = dim3(static_cast<unsigned>(rc.threads));
  cfg.dynamicSmemBytes = 0;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(rc.k);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, q);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return fail(FCE_ERROR_CUDA, "ce_rows_regs_kernel (clusters of %d × %d threads): launch failed: %s",
                rc.k, rc.threads, cudaGetErrorString(e));
  }
  return launch_error("ce_rows_regs_kernel");
}

// Threads of a streaming CTA: enough for kStreamUnroll vectors each on the longest row, ≤ cap.
int64_t stream_threads(int64_t vocab, int E, int cap) {
  const int64_t nvec_max = (E - 1 + vocab + E - 1) / E;
  const int64_t t = (nvec_max + kStreamUnroll - 1) / kStreamUnroll;
  return t < cap ? (t + 31) / 32 * 32 : cap;
}

template <class TZ, class TG>
fce_status launch_rows_typed(const CeRowsArgs& a, KParams p, int pair, cudaStream_t s) {
  DeviceInfo dev;
  if (fce_status st = device_info(&dev)) return st;
  constexpr int E = vec_elems<TZ>();
  p.z_row_bytes = a.row_stride * Ty<TZ>::kBytes;
  p.g_row_bytes = a.grad ? a.grad_row_stride * Ty<TG>::kBytes : 0;
  const int mode = p.smooth ? kGeneral : p.cap ? kCap : kPlain;

  // The path: backward / register (cluster) / two-pass.
  bool use_regs = false;
  RegConfig rc{1, kRegThreads};
  // Forward without a gradient reads each row once whatever the path; on rows of 128 KB or
  // more the streaming kernel (many loads in flight, no register-resident slice to drain)
  // measured faster on an H100 (bench/NOTES.md: 16384×128256 bf16 1.50 ms against 1.76 ms),
  // on shorter rows the register path (32768×32000 bf16 0.76 ms against 1.02 ms).
  const bool backward = a.lse_in || a.stats_in;
  const bool long_forward_only = !a.grad && a.vocab * Ty<TZ>::kBytes >= (int64_t{128} << 10);
  const bool prefer_stream = overrides().path == 2 || (long_forward_only && overrides().path != 1);
  if (!backward && !prefer_stream) {
    const bool aligned_rows =
        (reinterpret_cast<uintptr_t>(a.logits) & 15) == 0 && (p.z_row_bytes & 15) == 0;
    const int lead_max = aligned_rows ? 0 : E - 1;
    const int max_k = dev.major >= 9 ? kMaxCluster : 1;
    int min_k = overrides().min_cluster;
    while (min_k > 1 && !reg_config(a.vocab, Ty<TZ>::kBytes, lead_max, max_k, min_k, &rc)) min_k /= 2;
    if (reg_config(a.vocab, Ty<TZ>::kBytes, lead_max, max_k, min_k, &rc)) {
      const int slot = pair * 3 + mode;
      use_regs = mode == kPlain ? cluster_fits(dev, ce_rows_regs_kernel<TZ, TG, kPlain>, slot, rc.k)
               : mode == kCap   ? cluster_fits(dev, ce_rows_regs_kernel<TZ, TG, kCap>, slot, rc.k)
                                : cluster_fits(dev, ce_rows_regs_kernel<TZ, TG, kGeneral>, slot, rc.k);
    }
  }

  for (int64_t r0 = 0; r0 < a.row_count; r0 += kMaxRowsPerLaunch) {
    const int64_t n = a.row_count - r0 < kMaxRowsPerLaunch ? a.row_count - r0 : kMaxRowsPerLaunch;
    KParams q = p;
    q.row_begin = a.row_begin + r0;
    q.logits = static_cast<const char*>(a.logits) + r0 * p.z_row_bytes;
    q.grad = a.grad ? static_cast<char*>(a.grad) + r0 * p.g_row_bytes : nullptr;
    fce_status st = FCE_SUCCESS;
    if (backward) {
      const unsigned threads = static_cast<unsigned>(stream_threads(a.vocab, E, kBackwardThreads));
      if (mode == kPlain)
        ce_rows_stream_kernel<TZ, TG, kPlain, true><<<static_cast<unsigned>(n), threads, 0, s>>>(q);
      else
        ce_rows_stream_kernel<TZ, TG, kGeneral, true><<<static_cast<unsigned>(n), threads, 0, s>>>(q);
      st = launch_error("ce_backward_kernel");
    } else if (use_regs) {
      q.cluster_log2 = rc.k == 1 ? 0 : rc.k == 2 ? 1 : rc.k == 4 ? 2 : 3;
      st = mode == kPlain ? launch_forward_regs<TZ, TG, kPlain>(q, rc, n, s)
         : mode == kCap   ? launch_forward_regs<TZ, TG, kCap>(q, rc, n, s)
                          : launch_forward_regs<TZ, TG, kGeneral>(q, rc, n, s);
    } else {
      const unsigned threads = static_cast<unsigned>(stream_threads(a.vocab, E, kTwoPassThreads));
      if (mode == kPlain)
        ce_rows_stream_kernel<TZ, TG, kPlain, false><<<static_cast<unsigned>(n), threads, 0, s>>>(q);
      else
        ce_rows_stream_kernel<TZ, TG, kGeneral, false><<<static_cast<unsigned>(n), threads, 0, s>>>(q);
      st = launch_error("ce_rows_twopass_kernel");
    }
    if (st != FCE_SUCCESS) return st;
  }
  return FCE_SUCCESS;
}

}  // namespace

// ================================================================ interface ====
fce_status launch_ce_denominators(const CeOptions& opt, int64_t rows, int64_t vocab,
                                  const void* targets, CeDenoms* out, cudaStream_t s) {
  if (rows < 0 || vocab < 1 || vocab > INT32_MAX || (rows > 0 && !targets) || !out)
    return fail(FCE_ERROR_INTERNAL, "launch_ce_denominators: bad arguments (rows %lld, vocab %lld)",
                static_cast<long long>(rows), static_cast<long long>(vocab));
  KParams p = make_params(opt, vocab);
  p.targets = targets;
  ce_denominators_kernel<<<1, kReduceThreads, 0, s>>>(p, rows, out);
  return launch_error("ce_denominators_kernel");
}

fce_status launch_ce_rows(const CeRowsArgs& a, cudaStream_t s) {
  if (a.row_count < 0 || a.row_begin < 0 || a.row_begin + a.row_count > a.total_rows ||
      a.vocab < 1 || a.vocab > INT32_MAX || !a.logits || !a.targets || !a.denoms ||
      a.row_stride < a.vocab || (a.grad && a.grad_row_stride < a.vocab))
    return fail(FCE_ERROR_INTERNAL,
                "launch_ce_rows: bad arguments (rows %lld+%lld of %lld, vocab %lld, strides %lld/%lld)",
                static_cast<long long>(a.row_begin), static_cast<long long>(a.row_count),
                static_cast<long long>(a.total_rows), static_cast<long long>(a.vocab),
                static_cast<long long>(a.row_stride), static_cast<long long>(a.grad_row_stride));
  const bool backward = a.lse_in || a.stats_in;
  if (backward && !a.grad)
    return fail(FCE_ERROR_INTERNAL, "launch_ce_rows: backward (lse_in) without a gradient buffer");
  if (a.rescale && (backward || !a.grad || !a.grad_output))
    return fail(FCE_ERROR_INTERNAL, "launch_ce_rows: rescale needs a forward with grad and grad_output");
  const int64_t vocab_total = a.vocab_total > 0 ? a.vocab_total : a.vocab;
  if (a.col_begin < 0 || a.col_begin + a.vocab > vocab_total || vocab_total > INT32_MAX ||
      (vocab_total != a.vocab && !a.stats_in))
    return fail(FCE_ERROR_INTERNAL, "launch_ce_rows: bad column slice (%lld+%lld of %lld)",
                static_cast<long long>(a.col_begin), static_cast<long long>(a.vocab),
                static_cast<long long>(vocab_total));
  if (a.row_count == 0) return FCE_SUCCESS;
  KParams p = make_params(a.opt, vocab_total);  // ε/V and Ω of the whole vocabulary
  p.vocab = static_cast<int>(a.vocab);            // the row length of these buffers
  p.col_begin = a.col_begin;
  p.targets = a.targets;
  p.denoms = a.denoms;
  p.grad_output = a.grad_output;
  p.lse_in = a.stats_in ? nullptr : a.lse_in;
  p.stats_in = a.stats_in;
  // a backward or a rescale writes the gradient (and error flags) only
  const bool outputs = !backward && !a.rescale;
  p.row_loss = outputs ? a.row_loss : nullptr;
  p.row_zloss = outputs ? a.row_zloss : nullptr;
  p.lse_out = outputs ? a.lse_out : nullptr;
  p.stats_out = outputs ? a.stats_out : nullptr;
  p.argmax_out = outputs ? a.argmax_out : nullptr;
  p.row_correct = outputs ? a.row_correct : nullptr;
  p.loss_has_z = a.opt.reduction == FCE_REDUCTION_NONE ? 1 : 0;
  p.error_flags = a.error_flags;
  p.rescale = a.rescale ? 1 : 0;
  // Without a gradient its dtype is irrelevant: use the logits' own pair.
  const int zd = a.logits_dtype, gd = a.grad ? a.grad_dtype : a.logits_dtype;
  if (zd == FCE_FLOAT32 && gd == FCE_FLOAT32) return launch_rows_typed<float, float>(a, p, 0, s);
  if (zd == FCE_FLOAT16 && gd == FCE_FLOAT16) return launch_rows_typed<__half, __half>(a, p, 1, s);
  if (zd == FCE_BFLOAT16 && gd == FCE_BFLOAT16)
    return launch_rows_typed<__nv_bfloat16, __nv_bfloat16>(a, p, 2, s);
  if (zd == FCE_FLOAT32 && gd == FCE_FLOAT16) return launch_rows_typed<float, __half>(a, p, 3, s);
  if (zd == FCE_FLOAT32 && gd == FCE_BFLOAT16)
    return launch_rows_typed<float, __nv_bfloat16>(a, p, 4, s);
  return fail(FCE_ERROR_UNSUPPORTED, "launch_ce_rows: logits dtype %d with gradient dtype %d", zd, gd);
}

fce_status launch_ce_finalize(const CeOptions& opt, int64_t rows, const float* row_loss,
                              const float* row_zloss, const float* row_correct,
                              const CeDenoms* d, float* loss, float* z_loss, float* accuracy,
                              cudaStream_t s) {
  if (!loss && !z_loss && !accuracy) return FCE_SUCCESS;
  if (rows < 0 || (loss && !row_loss) || (accuracy && !row_correct) || !d ||
      (loss && opt.z_loss_scale != 0.f && !row_zloss))
    return fail(FCE_ERROR_INTERNAL, "launch_ce_finalize: bad arguments");
  ce_finalize_kernel<<<1, kReduceThreads, 0, s>>>(rows, opt.reduction, row_loss, row_zloss,
                                                   row_correct, d, loss, z_loss, accuracy);
  return launch_error("ce_finalize_kernel");
}

#if defined(FCE_CE_SELFTEST)
// Host self-test of the register path's geometry, on the very functions the kernel uses
// (reg_config, reg_slice, is_full, grad_vec_ok): for many V, element sizes, row alignments and
// cluster sizes, every element of a row is owned by exactly one (rank, thread, slot); every full
// vector is 16-byte aligned and inside the row; partial vectors are the row's first or last; the
// gradient's vector stores are aligned whenever grad_vec_ok allows them, and allowed in place.
// Returns the number of failures (each printed). No GPU needed.
int ce_rows_selftest() {
  int failures = 0;
  auto fail_at = [&](const char* what, int64_t V, int eb, int lead, int k, int nt) {
    if (failures++ < 20)
      fprintf(stderr, "ce_rows_selftest: %s (V %lld, e %d, lead %d, k %d, threads %d)\n", what,
              static_cast<long long>(V), eb, lead, k, nt);
  };
  const int64_t vocabs[] = {1,     2,     3,     5,     7,     8,      9,      15,     16,
                            17,    31,    33,    100,   255,   1000,   4095,   4096,   4097,
                            8191,  16383, 16384, 16385, 32000, 32767,  32768,  32769,  50257,
                            65535, 65536, 65537, 100000, 128256, 131071, 131072, 131073,
                            151936, 200003, 256000, 262136, 262143, 262144, 262145, 300000};
  std::vector<unsigned char> seen;
  for (int eb : {2, 4}) {
    const int E = 16 / eb;
    for (int64_t V : vocabs) {
      for (int aligned = 0; aligned < 2; ++aligned) {
        for (int max_k : {1, kMaxCluster}) {
          for (int min_k : {1, 2, 4, 8}) {
            RegConfig rc{};
            if (!reg_config(V, eb, aligned ? 0 : E - 1, max_k, min_k, &rc)) {
              // must only fail when even max_k CTAs of 64 KB cannot hold the row
              const int64_t nvec_max = ((aligned ? 0 : E - 1) + V + E - 1) / E;
              if (min_k <= max_k && nvec_max <= int64_t(kRegVecsPerCta) * max_k)
                fail_at("reg_config refused a row that fits", V, eb, 0, max_k, 0);
              continue;
            }
            if (rc.k < min_k || rc.k > max_k || (rc.k & (rc.k - 1)) || rc.threads % 32 ||
                rc.threads < 32 || rc.threads > kRegThreads)
              fail_at("reg_config returned a bad shape", V, eb, 0, rc.k, rc.threads);
            const int lg = rc.k == 1 ? 0 : rc.k == 2 ? 1 : rc.k == 4 ? 2 : 3;
            for (int lead = 0; lead < (aligned ? 1 : E); ++lead) {
              const uintptr_t row_addr = uintptr_t(0x10000) + uintptr_t(lead) * eb;
              seen.assign(size_t(V), 0);
              for (int rank = 0; rank < rc.k; ++rank) {
                for (int tid = 0; tid < rc.threads; ++tid) {
                  const RegSlice g = reg_slice(row_addr, eb, int(V), lg, rank, tid, rc.threads);
                  if (g.lead != lead) fail_at("lead", V, eb, lead, rc.k, rc.threads);
                  for (int i = 0; i < kRegVpt; ++i) {
                    const int v = g.v0 + i * rc.threads;
                    if (v >= g.vend) continue;
                    const int j0 = g.j00 + i * g.jstep;
                    if (j0 != v * E - lead) fail_at("slot element index", V, eb, lead, rc.k, rc.threads);
                    const bool f = E == 8 ? is_full<int, 8>(j0, int(V)) : is_full<int, 4>(j0, int(V));
                    if (f && ((row_addr + uintptr_t(int64_t(j0) * eb)) % 16 != 0 || j0 < 0 || j0 + E > V))
                      fail_at("full vector misplaced", V, eb, lead, rc.k, rc.threads);
                    if (!f && v != 0 && v != g.nvec - 1)
                      fail_at("partial vector inside the row", V, eb, lead, rc.k, rc.threads);
                    for (int q = 0; q < E; ++q) {
                      const int64_t j = int64_t(j0) + q;
                      if (j >= 0 && j < V) seen[size_t(j)]++;
                    }
                  }
                }
              }
              for (int64_t j = 0; j < V; ++j)
                if (seen[size_t(j)] != 1) {
                  fail_at(seen[size_t(j)] ? "element owned twice" : "element not owned", V, eb,
                          lead, rc.k, rc.threads);
                  break;
                }
            }
          }
        }
      }
    }
  }
  // Gradient stores: (logits E, gradient element bytes) pairs of the supported dtype pairs.
  const int pairs[][2] = {{4, 4}, {8, 2}, {4, 2}};
  for (const auto& pr : pairs) {
    const int E = pr[0], gb = pr[1], zb = 16 / E;
    for (int lead = 0; lead < E; ++lead) {
      const uintptr_t zrow = uintptr_t(0x20000) + uintptr_t(lead) * zb;
      if (zb == gb && !grad_vec_ok(zrow, lead, E, gb))
        fail_at("in-place gradient refused vector stores", 0, gb, lead, 0, 0);
      for (uintptr_t off = 0; off < 32; off += uintptr_t(gb)) {
        const uintptr_t grow = uintptr_t(0x40000) + off;
        if (!grad_vec_ok(grow, lead, E, gb)) continue;
        for (int v = 1; v < 6; ++v) {
          const int64_t j0 = int64_t(v) * E - lead;
          if ((grow + uintptr_t(j0 * gb)) % uintptr_t(E * gb) != 0)
            fail_at("misaligned gradient vector store", 0, gb, lead, 0, int(off));
        }
      }
    }
  }
  return failures;
}
#endif
}  // namespace cuda
}  // namespace fce
