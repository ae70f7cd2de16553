// distill/kernels.cu — the distillation kernels (distill/kernels.cuh). The row kernel runs one
// block per row in at most three sweeps over both rows: (max, Σ exp) of both, then the loss (and
// the correction term K of the reverse KL and the JSD), then the gradient (the forward KL writes
// its gradient in the second sweep already; a row not counted writes its zero gradient after the
// first). Everything relative to the row maxima in float32; the block sums in a fixed order
// (bitwise deterministic).
//
// A thread (kRowThreads a block) takes chunks of 8 consecutive elements, chunk c on thread
// c mod kRowThreads, loaded as 16-byte vectors when the row's student, teacher and gradient
// start 16-byte aligned and element by element otherwise: the same arithmetic in the same order
// either way, so a row's results depend neither on the path nor on other rows. Per chunk the
// running maximum moves once and the running sum is rescaled once: one exponential per element
// and row in the first sweep. Exponentials are 2^((x − m)·log2e) with x − m ≤ 0 (MUFU.EX2,
// within 2 ulp, exact at 0 as expf is: a one-hot row keeps p = 1 and the reverse KL's gradient
// (log p − log q) − K its exact 0; results below 2^-126 flush to 0, a term of weight 0). Without
// a softcap the sweeps work on z itself (Mode). The JSD's log m_j is the log of
// β q_j + (1 − β) p_j from the probabilities at hand where that mixture is normal, rule 20's
// logaddexp of the logs where it is tiny (or NaN).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/common/launch_check.cuh"
#include "cuda/distill/kernels.cuh"

namespace fce {
namespace cuda {
namespace distill {
namespace {

constexpr int kThreads = 256;     // the count and reduce kernels
constexpr int kRowThreads = 512;  // the row kernel
constexpr int kRowWarps = kRowThreads / 32;
constexpr int kChunk = 8;  // consecutive elements of a thread per step: 16 bytes of 16-bit
constexpr size_t kAlign = 256;
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
constexpr float kTinyMix = 0x1p-100f;  // below: log m_j by logaddexp

__device__ __forceinline__ float ex2(float x) {  // 2^x (results below 2^-126 flush to 0)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float lg2(float x) {  // log2 x of a normal x
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// e^x for x ≤ 0 (−inf: 0; NaN: NaN).
__device__ __forceinline__ float exp_neg(float x) { return ex2(x * kLog2e); }

template <int DT>
struct Elem;
template <>
struct Elem<FCE_FLOAT32> {
  using T = float;
};
template <>
struct Elem<FCE_FLOAT16> {
  using T = __half;
};
template <>
struct Elem<FCE_BFLOAT16> {
  using T = __nv_bfloat16;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Two 16-bit elements of a word <-> floats (the low one first).
template <class T>
__device__ __forceinline__ void unpack2(uint32_t w, float& lo, float& hi) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
  } else {
    __half2 h;
    memcpy(&h, &w, 4);
    const float2 f = __half22float2(h);
    lo = f.x;
    hi = f.y;
  }
}
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t w;
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&w, &h, 4);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&w, &h, 4);
  }
  return w;
}

// Elements [j, j + n) of a row as floats (n ≤ kChunk; the rest 0). Vec: n = kChunk, and row + j
// is 16-byte aligned.
template <class T, bool Vec>
__device__ __forceinline__ void load_chunk(const T* row, uint32_t j, int n, float (&x)[kChunk]) {
  if constexpr (Vec) {
    const uint4* v = reinterpret_cast<const uint4*>(row + j);
    if constexpr (sizeof(T) == 4) {
      const uint4 w0 = v[0], w1 = v[1];
      const uint32_t w[kChunk] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
      for (int k = 0; k < kChunk; ++k) x[k] = __uint_as_float(w[k]);
    } else {
      const uint4 w0 = v[0];
      const uint32_t w[kChunk / 2] = {w0.x, w0.y, w0.z, w0.w};
#pragma unroll
      for (int k = 0; k < kChunk / 2; ++k) unpack2<T>(w[k], x[2 * k], x[2 * k + 1]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kChunk; ++k) x[k] = k < n ? to_float(row[j + k]) : 0.0f;
  }
}

// Stores g[0, n) as elements [j, j + n) of a row (as load_chunk).
template <class T, bool Vec>
__device__ __forceinline__ void store_chunk(T* row, uint32_t j, int n, const float (&g)[kChunk]) {
  if constexpr (Vec) {
    uint4* v = reinterpret_cast<uint4*>(row + j);
    if constexpr (sizeof(T) == 4) {
      v[0] = make_uint4(__float_as_uint(g[0]), __float_as_uint(g[1]), __float_as_uint(g[2]),
                        __float_as_uint(g[3]));
      v[1] = make_uint4(__float_as_uint(g[4]), __float_as_uint(g[5]), __float_as_uint(g[6]),
                        __float_as_uint(g[7]));
    } else {
      v[0] = make_uint4(pack2<T>(g[0], g[1]), pack2<T>(g[2], g[3]), pack2<T>(g[4], g[5]),
                        pack2<T>(g[6], g[7]));
    }
  } else {
#pragma unroll
    for (int k = 0; k < kChunk; ++k)
      if (k < n) row[j + k] = from_float<T>(g[k]);
  }
}

// Calls f(j, n, vec) for this thread's chunks [j, j + n) of a row of V elements, in order; vec
// (std::true_type or std::false_type) says whether the chunk goes as 16-byte vectors. V < 2^31:
// j + the step stays below 2^32.
template <class F>
__device__ __forceinline__ void for_chunks(uint32_t V, bool vec, F&& f) {
  constexpr uint32_t step = uint32_t(kRowThreads) * kChunk;
  uint32_t j = threadIdx.x * kChunk;
  if (vec) {
    for (; j + kChunk <= V; j += step) f(j, kChunk, std::true_type());
  } else {
    for (; j + kChunk <= V; j += step) f(j, kChunk, std::false_type());
  }
  if (j < V) f(j, int(V - j), std::false_type());
}

__device__ __forceinline__ float sum_chunk(const float (&e)[kChunk]) {  // pairwise
  return ((e[0] + e[1]) + (e[2] + e[3])) + ((e[4] + e[5]) + (e[6] + e[7]));
}

// A running (m, s = Σ e^(x − m)) over part of a row. s turns NaN at a NaN element, and at +inf
// (x − m is inf − inf there): rule 10's NaN row either way; m = −inf and s = 0 while every
// element was −inf. m is never NaN (fmaxf drops NaN).
struct Run {
  float m, s;
};

// What exponents are taken relative to: m, or 0 while m is −inf (every x − 0 is then −inf or
// NaN, as it should be).
__device__ __forceinline__ float base(float m) { return m > -INFINITY ? m : 0.0f; }

// A chunk into the run: its maximum first, then one rescale of the sum.
__device__ __forceinline__ void add_chunk(Run& r, const float (&x)[kChunk], float fL) {
  float cm = x[0];
#pragma unroll
  for (int k = 1; k < kChunk; ++k) cm = fmaxf(cm, x[k]);
  const float m = fmaxf(r.m, cm), c = base(m);
  float e[kChunk];
#pragma unroll
  for (int k = 0; k < kChunk; ++k) e[k] = ex2((x[k] - c) * fL);
  r.s = fmaf(r.s, ex2((r.m - c) * fL), sum_chunk(e));
  r.m = m;
}

// Two runs of x, u = x·f: the rescales by the accurate expf (a few per thread and row).
__device__ __forceinline__ Run merge(const Run& a, const Run& b, float f) {
  const float m = fmaxf(a.m, b.m), c = base(m);
  return {m, a.s * expf((a.m - c) * f) + b.s * expf((b.m - c) * f)};
}

__device__ __forceinline__ Run shfl_down(const Run& v, int o) {
  return {__shfl_down_sync(0xffffffffu, v.m, o), __shfl_down_sync(0xffffffffu, v.s, o)};
}

// Both rows' runs merged over the row kernel's block in a fixed order (a shuffle tree in each
// warp, then one over the warps' results in warp 0), returned to every thread.
__device__ void block_merge(Run& p, Run& q, Run* shared, float f) {  // shared: [2 * kRowWarps]
  for (int o = 16; o > 0; o >>= 1) {
    p = merge(p, shfl_down(p, o), f);
    q = merge(q, shfl_down(q, o), f);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    shared[warp] = p;
    shared[kRowWarps + warp] = q;
  }
  __syncthreads();
  if (warp == 0) {
    p = lane < kRowWarps ? shared[lane] : Run{-INFINITY, 0.0f};
    q = lane < kRowWarps ? shared[kRowWarps + lane] : Run{-INFINITY, 0.0f};
    for (int o = kRowWarps / 2; o > 0; o >>= 1) {
      p = merge(p, shfl_down(p, o), f);
      q = merge(q, shfl_down(q, o), f);
    }
    if (lane == 0) {
      shared[0] = p;
      shared[kRowWarps] = q;
    }
  }
  __syncthreads();
  p = shared[0];
  q = shared[kRowWarps];
}

// Two block-wide sums of the row kernel in a fixed order, as block_merge.
__device__ void block_sum2(float& a, float& b, float* shared) {  // shared: [2 * kRowWarps]
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_down_sync(0xffffffffu, a, o);
    b += __shfl_down_sync(0xffffffffu, b, o);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    shared[warp] = a;
    shared[kRowWarps + warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    a = lane < kRowWarps ? shared[lane] : 0.0f;
    b = lane < kRowWarps ? shared[kRowWarps + lane] : 0.0f;
    for (int o = kRowWarps / 2; o > 0; o >>= 1) {
      a += __shfl_down_sync(0xffffffffu, a, o);
      b += __shfl_down_sync(0xffffffffu, b, o);
    }
    if (lane == 0) {
      shared[0] = a;
      shared[kRowWarps] = b;
    }
  }
  __syncthreads();
  a = shared[0];
  b = shared[kRowWarps];
}

// The count kernel's block sum (kThreads), in a fixed order: warp shuffles, then thread 0.
__device__ float block_sum(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) t += shared[w];
    shared[kThreads / 32] = t;
  }
  __syncthreads();
  return shared[kThreads / 32];
}

__device__ __forceinline__ float log_add_exp(float x, float y) {
  if (isnan(x) || isnan(y)) return NAN;
  const float hi = fmaxf(x, y), lo = fminf(x, y);
  if (hi == -INFINITY) return hi;
  return hi + log1pf(expf(lo - hi));
}

// The JSD's mixture m_j = β q_j + (1 − β) p_j.
struct Mix {
  float b, b1, log_b, log_1mb;
  // log2 m_j, MUFU.LG2 of the mixture where it is at least kTinyMix (within a few ulp); else
  // (tiny, or NaN) rule 20's logaddexp(log β + log q_j, log(1 − β) + log p_j), or −inf where
  // p_j = q_j = 0 (both terms and the gradient are 0 there, whatever log m_j is). The rare
  // second case runs once per chunk that has one, off the common path.
  __device__ __forceinline__ void log2_m(const float (&p)[kChunk], const float (&q)[kChunk],
                                         const float (&lp)[kChunk], const float (&lq)[kChunk],
                                         float (&lm2)[kChunk]) const {
    bool tiny = false;
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      const float mix = fmaf(b, q[k], b1 * p[k]);
      tiny |= !(mix >= kTinyMix);
      lm2[k] = lg2(mix);
    }
    if (!tiny) return;
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      if (fmaf(b, q[k], b1 * p[k]) >= kTinyMix) continue;
      lm2[k] = p[k] == 0.0f && q[k] == 0.0f ? -INFINITY
                                            : log_add_exp(log_b + lq[k], log_1mb + lp[k]) * kLog2e;
    }
  }
};

enum Div { kForward = 0, kReverse = 1, kJsd = 2 };

// How the row kernel gets u = a / T from z. kScaled (no softcap, s / T > 0): it works on z
// itself, u − m_u = (z − m_z)·(s/T) with m_z the maximum of z (z ↦ z·s/T is monotonic), so no
// multiply per element beyond the exponent's and log p's own. kGeneral (a softcap, or s < 0):
// u made per element, u = (c/T) tanh(z·s/c) (∂u/∂z = (s/T)(1 − tanh²)) or z·s/T.
enum Mode { kScaled = 0, kGeneral = 1 };

// Blocks of the row kernel per SM its registers are held to (40 or 64 a thread): the JSD's
// chunk and the softcap's tanhf keep the most.
template <int M, int div>
constexpr int kRowBlocks = div == kJsd || M == kGeneral ? 2 : 3;

// One row per block (kernels.cuh's RowsArgs); DT the dtype of the rows and of the gradient.
template <int DT, int M, int div>
__global__ void __launch_bounds__(kRowThreads, kRowBlocks<M, div>) rows_kernel(RowsArgs a) {
  using T = typename Elem<DT>::T;
  __shared__ Run run_shared[2 * kRowWarps];
  __shared__ float sum_shared[2 * kRowWarps];
  const DistillOptions& o = a.opt;
  const int64_t i = blockIdx.x, r = a.first + i;
  const uint32_t V = static_cast<uint32_t>(a.vocab);
  const T* zs = static_cast<const T*>(a.student) + i * a.student_ld;
  const T* zt = static_cast<const T*>(a.teacher) + i * a.teacher_ld;
  T* grad = a.grad ? static_cast<T*>(a.grad) + i * a.grad_ld : nullptr;
  const bool vec = ((reinterpret_cast<uintptr_t>(zs) | reinterpret_cast<uintptr_t>(zt) |
                     reinterpret_cast<uintptr_t>(grad)) &
                    15u) == 0;
  const bool cap = o.softcap > 0.0f;
  const float invT = 1.0f / o.temperature;
  const float su = o.logit_scale / o.temperature, sc = o.logit_scale / o.softcap,
              cT = o.softcap / o.temperature;
  // x, what the sweeps work on: z (kScaled) or u; u − m_u = (x − m_x)·f.
  const float f = M == kScaled ? su : 1.0f, fL = f * kLog2e;
  // x of a loaded chunk in place (−inf past n); t: the tanh values (0 without a softcap).
  auto transform = [&](float(&x)[kChunk], float(&t)[kChunk], int n) {
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      if constexpr (M == kGeneral) {
        if (cap) {
          t[k] = tanhf(x[k] * sc);
          x[k] = cT * t[k];
        } else {
          t[k] = 0.0f;
          x[k] *= su;
        }
      }
      if (k >= n) x[k] = -INFINITY;
    }
  };

  // Sweep 1: both rows' (max, Σ exp).
  Run p{-INFINITY, 0.0f}, q{-INFINITY, 0.0f};
  for_chunks(V, vec, [&](uint32_t j, int n, auto v) {
    constexpr bool kVec = decltype(v)::value;
    float x[kChunk], y[kChunk], t[kChunk];
    load_chunk<T, kVec>(zs, j, n, x);
    load_chunk<T, kVec>(zt, j, n, y);
    transform(x, t, n);
    transform(y, t, n);
    add_chunk(p, x, fL);
    add_chunk(q, y, fL);
  });
  block_merge(p, q, run_shared, f);
  // log s: NaN for a NaN row (rule 10), −inf for a row of −inf.
  const float ls_p = logf(p.s), ls_q = logf(q.s);
  const float mp = isnan(p.s) ? NAN : p.m, mq = isnan(q.s) ? NAN : q.m;
  const bool is_counted = counted(a.targets, o.targets_int64, o.ignore_index, r);
  if (threadIdx.x == 0 && a.lse) a.lse[r] = mp * f + ls_p;
  if (!is_counted) {  // loss 0, a zero gradient row (the rows were read: in place is fine)
    if (threadIdx.x == 0) a.row_loss[r] = 0.0f;
    if (grad)
      for_chunks(V, vec, [&](uint32_t j, int n, auto v) {
        const float g[kChunk] = {};
        store_chunk<T, decltype(v)::value>(grad, j, n, g);
      });
    return;
  }
  const Mix mix{o.beta, 1.0f - o.beta, logf(o.beta), log1pf(-o.beta)};
  float up = 0.0f;  // the upstream factor: g (/ n for mean)
  if (grad) {
    const bool per_row = o.reduction == FCE_REDUCTION_NONE;
    const float g = a.grad_output ? a.grad_output[per_row ? r : 0] : 1.0f;
    up = o.reduction == FCE_REDUCTION_MEAN ? (*a.n == 0.0f ? 0.0f : g / *a.n) : g;
  }
  // ∂u/∂z · up: gs, times 1 − tanh² with a softcap.
  const float gs = o.logit_scale * invT * up;
  auto chain = [&](const float(&t)[kChunk], int k) {
    if constexpr (M == kGeneral) return gs * (1.0f - t[k] * t[k]);
    return gs;
  };
  // Both rows' chunk at j as log p, log q (and the student's tanh values).
  auto logs = [&](uint32_t j, int n, auto v, float(&lp)[kChunk], float(&lq)[kChunk],
                  float(&t)[kChunk]) {
    constexpr bool kVec = decltype(v)::value;
    float tt[kChunk];
    load_chunk<T, kVec>(zs, j, n, lp);
    load_chunk<T, kVec>(zt, j, n, lq);
    transform(lp, t, n);
    transform(lq, tt, n);
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      lp[k] = fmaf(lp[k] - mp, f, -ls_p);
      lq[k] = fmaf(lq[k] - mq, f, -ls_q);
    }
  };
  // Sweep 2: the loss and K (forward KL: its gradient too). sa, sb: forward Σ q (log q − log p);
  // reverse Σ p (log p − log q); JSD Σ q (log q − log m) and Σ p (log p − log m) = K. A term
  // whose weight is 0 adds 0.
  float sa = 0.0f, sb = 0.0f;
  if constexpr (div == kForward) {
    auto sweep = [&](auto with_grad) {
      for_chunks(V, vec, [&](uint32_t j, int n, auto v) {
        float lp[kChunk], lq[kChunk], t[kChunk];
        [[maybe_unused]] float g[kChunk];
        logs(j, n, v, lp, lq, t);
#pragma unroll
        for (int k = 0; k < kChunk; ++k) {
          const float qj = exp_neg(lq[k]);
          sa = fmaf(qj, qj == 0.0f ? 0.0f : lq[k] - lp[k], sa);
          if constexpr (decltype(with_grad)::value) g[k] = (exp_neg(lp[k]) - qj) * chain(t, k);
        }
        if constexpr (decltype(with_grad)::value) store_chunk<T, decltype(v)::value>(grad, j, n, g);
      });
    };
    if (grad) {
      sweep(std::true_type());
    } else {
      sweep(std::false_type());
    }
  } else if constexpr (div == kReverse) {
    for_chunks(V, vec, [&](uint32_t j, int n, auto v) {
      float lp[kChunk], lq[kChunk], t[kChunk];
      logs(j, n, v, lp, lq, t);
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        const float pj = exp_neg(lp[k]);
        sa = fmaf(pj, pj == 0.0f ? 0.0f : lp[k] - lq[k], sa);
      }
    });
  } else {
    for_chunks(V, vec, [&](uint32_t j, int n, auto v) {
      float lp[kChunk], lq[kChunk], t[kChunk], pj[kChunk], qj[kChunk], lm2[kChunk];
      logs(j, n, v, lp, lq, t);
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        pj[k] = exp_neg(lp[k]);
        qj[k] = exp_neg(lq[k]);
      }
      mix.log2_m(pj, qj, lp, lq, lm2);
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        sa = fmaf(qj[k], qj[k] == 0.0f ? 0.0f : fmaf(lm2[k], -kLn2, lq[k]), sa);
        sb = fmaf(pj[k], pj[k] == 0.0f ? 0.0f : fmaf(lm2[k], -kLn2, lp[k]), sb);
      }
    });
  }
  block_sum2(sa, sb, sum_shared);
  const float loss = div == kJsd ? mix.b * sa + mix.b1 * sb : sa;
  const float k_row = div == kJsd ? sb : sa;  // K; the reverse KL's is the loss
  if (threadIdx.x == 0) a.row_loss[r] = loss;
  if (div == kForward || !grad) return;
  // Sweep 3: the gradient of the reverse KL and the JSD, which needs K; 0 where p_j = 0.
  if constexpr (div == kReverse) {
    for_chunks(V, vec, [&](uint32_t j, int n, auto v) {
      float lp[kChunk], lq[kChunk], t[kChunk], g[kChunk];
      logs(j, n, v, lp, lq, t);
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        const float pj = exp_neg(lp[k]);
        g[k] = (pj == 0.0f ? 0.0f : pj * ((lp[k] - lq[k]) - k_row)) * chain(t, k);
      }
      store_chunk<T, decltype(v)::value>(grad, j, n, g);
    });
  } else {
    const float b1gs = mix.b1 * gs;
    for_chunks(V, vec, [&](uint32_t j, int n, auto v) {
      float lp[kChunk], lq[kChunk], t[kChunk], pj[kChunk], qj[kChunk], lm2[kChunk], g[kChunk];
      logs(j, n, v, lp, lq, t);
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        pj[k] = exp_neg(lp[k]);
        qj[k] = exp_neg(lq[k]);
      }
      mix.log2_m(pj, qj, lp, lq, lm2);
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        const float du = pj[k] == 0.0f ? 0.0f : pj[k] * (fmaf(lm2[k], -kLn2, lp[k]) - k_row);
        g[k] = M == kGeneral ? du * (mix.b1 * chain(t, k)) : du * b1gs;
      }
      store_chunk<T, decltype(v)::value>(grad, j, n, g);
    });
  }
}

__global__ void count_kernel(const void* targets, bool int64, int64_t ignore, int64_t rows,
                             float* n) {
  __shared__ float shared[kThreads / 32 + 1];
  float c = 0.0f;
  for (int64_t r = threadIdx.x; r < rows; r += kThreads)
    c += counted(targets, int64, ignore, r) ? 1.0f : 0.0f;
  c = block_sum(c, shared);  // exact: counts below 2^24 per thread sum exactly in float
  if (threadIdx.x == 0) *n = c;
}

__global__ void reduce_kernel(int reduction, int64_t rows, const float* row_loss, const float* n,
                              float* loss) {
  __shared__ double shared[kThreads];
  double s = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += kThreads) s += row_loss[r];
  shared[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x != 0) return;
  double t = 0.0;
  for (int w = 0; w < kThreads; ++w) t += shared[w];
  if (reduction == FCE_REDUCTION_MEAN) t = *n != 0.0f ? t / *n : isfinite(t) ? 0.0 : t;
  *loss = float(t);
}

}  // namespace

size_t head_bytes(int64_t rows, int reduction) {
  const size_t loss = reduction == FCE_REDUCTION_NONE ? 0 : sat_mul(size_t(rows), 4);
  return sat_add(kAlign, sat_round_up(loss, kAlign));
}

Head head_at(char* base, int64_t rows, int reduction) {
  Head h;
  h.n = reinterpret_cast<float*>(base);
  h.row_loss = reduction == FCE_REDUCTION_NONE ? nullptr : reinterpret_cast<float*>(base + kAlign);
  (void)rows;
  return h;
}

fce_status launch_count(const char* fn, const DistillOptions& opt, int64_t rows,
                        const void* targets, float* n, cudaStream_t s) {
  count_kernel<<<1, kThreads, 0, s>>>(targets, opt.targets_int64, opt.ignore_index, rows, n);
  return launch_check(fn, "distill count_kernel");
}

template <int DT, int M>
void launch_div(const RowsArgs& a, int div, cudaStream_t s) {
  const unsigned blocks = static_cast<unsigned>(a.count);
  switch (div) {
    case kForward: rows_kernel<DT, M, kForward><<<blocks, kRowThreads, 0, s>>>(a); break;
    case kReverse: rows_kernel<DT, M, kReverse><<<blocks, kRowThreads, 0, s>>>(a); break;
    default: rows_kernel<DT, M, kJsd><<<blocks, kRowThreads, 0, s>>>(a); break;
  }
}

template <int DT>
void launch_mode(const RowsArgs& a, int div, cudaStream_t s) {
  const DistillOptions& o = a.opt;
  if (o.softcap > 0.0f || !(o.logit_scale / o.temperature > 0.0f)) {
    launch_div<DT, kGeneral>(a, div, s);
  } else {
    launch_div<DT, kScaled>(a, div, s);
  }
}

fce_status launch_rows(const RowsArgs& a, cudaStream_t s) {
  if (a.count == 0) return FCE_SUCCESS;
  const DistillOptions& o = a.opt;
  // JSD at β = 0 and β = 1 is the forward and the reverse KL (rule 20).
  const int div = o.divergence == FCE_DIVERGENCE_JSD ? (o.beta == 0.0f   ? kForward
                                                        : o.beta == 1.0f ? kReverse
                                                                         : kJsd)
                                                     : o.divergence;
  switch (o.dtype) {
    case FCE_FLOAT16: launch_mode<FCE_FLOAT16>(a, div, s); break;
    case FCE_BFLOAT16: launch_mode<FCE_BFLOAT16>(a, div, s); break;
    default: launch_mode<FCE_FLOAT32>(a, div, s); break;
  }
  return launch_check(a.fn, "distill rows_kernel");
}

fce_status launch_reduce(const char* fn, int reduction, int64_t rows, const float* row_loss,
                         const float* n, float* loss, cudaStream_t s) {
  reduce_kernel<<<1, kThreads, 0, s>>>(reduction, rows, row_loss, n, loss);
  return launch_check(fn, "distill reduce_kernel");
}

}  // namespace distill
}  // namespace cuda
}  // namespace fce
