// ce/memory.cuh — how the cross-entropy row kernels (ce/kernels.cu) read and write a row (and the
// few math helpers every CE and vocabulary-parallel kernel shares: Mode, ex2, prob): dtype
// traits, element conversions, and 16-byte vector loads and stores that never touch a byte
// outside [row, row + V) (the ≤ 2 partial vectors of a row go element by element). The vector
// split itself (is_full, grad_vec_ok on addresses) is in ce/geometry.cuh, shared with the host.
//
// Everything here is in an anonymous namespace, as it was when the row kernels were one file:
// each kernel translation unit gets its own internal copy, so the compiler sees (and inlines)
// exactly the program it always did. Include it only from the row kernels' .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "cuda/ce/geometry.cuh"

namespace fce {
namespace cuda {
namespace {

// ------------------------------------------------------------- the shared math ----
// The feature set a kernel is compiled for (the CE and the vocabulary-parallel kernels alike).
// kPlain: no softcap and no label smoothing (class weights, z-loss and scale are per-row
// scalars, always allowed). kCap: softcap. kGeneral: softcap and label smoothing decided at
// run time (smoothing needs Σω·a and ω_j per element). kUnit: kPlain with s = 1 (the default
// logit scale), a = z with no multiply per element (z·1 is z: the same bits as kPlain's); the
// CE row kernels only (the register path and the bulk kernel; elsewhere it runs as kPlain).
enum Mode : int { kPlain = 0, kCap = 1, kGeneral = 2, kUnit = 3 };

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float ex2(float x) {  // 2^x (results below 2^-126 flush to 0)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float qnan() { return __int_as_float(0x7fffffff); }

// p_j = exp((a_j − m) − ls): m and ls apart (docs/semantics.md rule 9), never through the
// rounded lse. As 2^((a − m)·log2e − ls·log2e) with one fused multiply-add: (a − m) is exact or
// rounded once, ls·log2e (|ls| ≤ log V) is rounded once per row, so the exponent's error stays
// within a few 1e-7 of its size, as with ((a − m) − ls)·log2e, for one instruction less per
// element (the row's ls·log2e is hoisted out of the loops). Every kernel that needs p (the CE
// gradient, token scaling, the vocabulary-parallel combine) calls this one.
__device__ __forceinline__ float prob(float a, float m, float ls) {
  return ex2(__fmaf_rn(__fsub_rn(a, m), kLog2e, -__fmul_rn(ls, kLog2e)));
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
// (is_full, whether a vector lies inside its row, is in ce/geometry.cuh.)

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

// Copies vector [j0, j0 + E) of a row into shared memory at dst (16-byte aligned): a full vector
// asynchronously (cp.async, L2 only, evict-first like ld_vec<kStreaming>), completed for this
// thread by async_copies_wait(); a partial one through load_vector, at once. Only the copying
// thread reads dst (the register path's shared-memory slots), so no barrier is needed.
template <class TZ, class I>
__device__ __forceinline__ void copy_vector_async(uint4* dst, const char* zrow, I j0, bool full,
                                                  int V, uint64_t policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (full) {
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(d),
                 "l"(zrow + j0 * Ty<TZ>::kBytes), "l"(policy) : "memory");
    return;
  }
#else
  (void)policy;
#endif
  *dst = load_vector<TZ, kStreaming>(zrow, j0, full, V);
}
// The L2 policy copy_vector_async takes: evict first (the row is read once).
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
#endif
  return pol;
}
// This thread's copy_vector_async copies are complete and visible to it.
__device__ __forceinline__ void async_copies_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
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

// Whether this gradient row takes vector stores (grad_vec_ok on addresses: ce/geometry.cuh).
template <class TZ, class TG>
__device__ __forceinline__ bool grad_vec_ok(const char* grow, int lead) {
  return fce::cuda::grad_vec_ok(reinterpret_cast<uintptr_t>(grow), lead, vec_elems<TZ>(),
                                Ty<TG>::kBytes);
}

// ---------------------------------------------------------- the row's target ----
enum RowKind : int { kIgnored = 0, kValid = 1, kInvalid = 2 };

// docs/semantics.md rules 1-3: the class row `row` is scored against (*y_out), or why it is not.
// P: any kernel parameter block with shift_T, shift_k, targets, targets_int64, ignore_index and
// vocab_total (the CE kernels' KParams, the vocabulary-parallel kernels' SParams and CParams).
template <class P>
__device__ __forceinline__ int classify_row(const P& p, int64_t row, int64_t* y_out) {
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

}  // namespace
}  // namespace cuda
}  // namespace fce
