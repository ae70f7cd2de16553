// ce/soft.cuh — class-probability targets on the stream kernel's SOFT instantiations
// (docs/semantics.md rule 19): q'_j = (1 − ε) q_j + ε/V, read element by element from the
// dense [rows, V] targets of KParams::q_dtype; per row Q = Σ_j ω_j q'_j and
// U = Σ_j ω_j q'_j (a_j − m) against the row maximum m (summed online beside Σexp, rescaled
// when the running maximum grows; a term with ω_j q'_j = 0 is left out, so that a −inf logit of
// probability 0 adds nothing), the loss Q·log s − U + λ lse², and the gradient element
// ((Q + 2λ lse) p_j − ω_j q'_j) · k · s (· (1 − t_j²) with softcap). Apart from device.cuh, so
// that the kernels for class indices keep their code. Included by ce/stream_kernel.cuh alone.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/ce/device.cuh"

namespace fce {
namespace cuda {
namespace {

// q'_j of global row `row`, column j of this launch's buffers.
__device__ __forceinline__ float soft_q(const KParams& p, int64_t row, int64_t j) {
  const int64_t i = row * p.q_ld + p.q_col + j;
  float q;
  if (p.q_dtype == FCE_FLOAT32) {
    q = __ldg(static_cast<const float*>(p.targets) + i);
  } else {
    const unsigned short raw = __ldg(static_cast<const unsigned short*>(p.targets) + i);
    q = p.q_dtype == FCE_FLOAT16 ? __half2float(__ushort_as_half(raw))
                                 : __bfloat162float(__ushort_as_bfloat16(raw));
  }
  return __fmaf_rn(p.one_minus_eps, q, p.eps_over_V);  // q itself when ε = 0
}

__device__ __forceinline__ float soft_w(const KParams& p, int64_t j) {
  return p.class_weights ? __ldg(p.class_weights + p.col_begin + j) : 1.f;
}

// A thread's (Q, U) of the row, U against its running maximum.
struct SoftSums {
  double Q, U;
};

// U against a new maximum m2 ≥ m: U + Q (m − m2); nothing to do while no mass is summed.
__device__ __forceinline__ void soft_rescale(SoftSums& x, float m, float m2) {
  if (m != m2 && x.Q != 0.0) x.U = __dadd_rn(x.U, x.Q * (double(m) - double(m2)));
}

// One vector's terms, after online_vector moved the running maximum from m_old to m.
template <class TZ, int MODE, class I>
__device__ __forceinline__ void soft_vector(const uint4& raw, I j0, bool full, const KParams& p,
                                            int64_t row, float m_old, float m, SoftSums& x) {
  constexpr int E = vec_elems<TZ>();
  soft_rescale(x, m_old, m);
  const float ms = m == neg_inf() ? 0.f : m;  // as online_vector: all −inf so far
  float a[E];
  unpack<TZ>(raw, a);
#pragma unroll
  for (int q = 0; q < E; ++q) {
    const I j = j0 + q;
    if (!(full || (j >= 0 && j < p.vocab))) continue;
    float t;
    const float aj = xform<MODE>(a[q], p, t);
    const float wq = __fmul_rn(soft_w(p, j), soft_q(p, row, j));
    x.Q = __dadd_rn(x.Q, double(wq));
    if (wq != 0.f) x.U = __dadd_rn(x.U, double(wq) * (double(aj) - double(ms)));
  }
}

// The CTA's (Q, U) against the row maximum M (each thread's U moved from its own maximum m),
// summed in a fixed tree: every thread gets the same bits. s_scratch: 32 × 16 bytes, free.
__device__ __forceinline__ SoftSums soft_block_sum(SoftSums x, float m, float M,
                                                   double2* s_scratch) {
  soft_rescale(x, m, M);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    x.Q = __dadd_rn(x.Q, __shfl_xor_sync(0xffffffffu, x.Q, o));
    x.U = __dadd_rn(x.U, __shfl_xor_sync(0xffffffffu, x.U, o));
  }
  __syncthreads();  // s_scratch may be in use
  if (lane == 0) s_scratch[warp] = make_double2(x.Q, x.U);
  __syncthreads();
  const double2 v = lane < nwarps ? s_scratch[lane] : make_double2(0.0, 0.0);
  SoftSums r{v.x, v.y};
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    r.Q = __dadd_rn(r.Q, __shfl_xor_sync(0xffffffffu, r.Q, o));
    r.U = __dadd_rn(r.U, __shfl_xor_sync(0xffffffffu, r.U, o));
  }
  __syncthreads();  // s_scratch may be used again
  return r;
}

// Q alone (fce_backward: p from the saved lse), a thread per element, the same tree.
__device__ __forceinline__ double soft_mass(const KParams& p, int64_t row, double2* s_scratch) {
  SoftSums x{0.0, 0.0};
  for (int64_t j = threadIdx.x; j < p.vocab; j += blockDim.x)
    x.Q = __dadd_rn(x.Q, double(__fmul_rn(soft_w(p, j), soft_q(p, row, j))));
  return soft_block_sum(x, 0.f, 0.f, s_scratch).Q;
}

// What load_row_info gives a row of class probabilities: scored, no class (y = −1), the
// upstream scales k = k_z (D = n = rows for mean).
__device__ RowInfo soft_row_info(const KParams& p, int64_t row) {
  if (p.pdl) pdl_wait();  // p.denoms is the denominators kernel's
  RowInfo r;
  r.kind = kValid;
  r.y = -1;
  r.wy = 0.f;
  r.ay = 0.f;
  r.k = 0.f;
  r.rho = 1.f;
  r.omega = 0.f;
  if (p.grad) {
    const float g =
        p.grad_output ? p.grad_output[p.reduction == FCE_REDUCTION_NONE ? row : 0] : 1.f;
    r.k = g;
    if (p.reduction == FCE_REDUCTION_MEAN) {
      const float n = p.denoms->count;
      r.k = n > 0.f ? __fdiv_rn(g, n) : 0.f;
    }
  }
  r.kz = r.k;
  return r;
}

// The forward's per-row outputs (rules 8, 19), by one thread per row: ce = Q·log s − U, NaN
// without a finite maximum (a NaN, a +inf, a row of −inf: rule 10).
__device__ void soft_row_outputs(const KParams& p, int64_t row, const RowVals& v,
                                 const SoftSums& x) {
  if (p.lse_out) p.lse_out[row] = v.lse;
  if (p.stats_out) p.stats_out[row] = CeRowStats{v.m, v.ls, 1.f, 0.f};
  const float zl = p.lambda != 0.f ? __fmul_rn(p.lambda, __fmul_rn(v.lse, v.lse)) : 0.f;
  const float ce = isfinite(v.m) ? static_cast<float>(__dsub_rn(x.Q * double(v.ls), x.U)) : qnan();
  if (p.row_zloss) p.row_zloss[row] = zl;
  if (p.row_loss) p.row_loss[row] = p.loss_has_z ? __fadd_rn(ce, zl) : ce;
}

// A row's gradient constants: A = Q + 2λ lse, ks = k·s, and rule 18's Ls, Es, mum.
struct SoftGrad {
  float m, ls, A, ks;
  RowTerms rt;
};
__device__ __forceinline__ SoftGrad soft_grad(const KParams& p, int64_t row, const RowInfo& ri,
                                              const RowVals& v, double Q, float mum) {
  SoftGrad g;
  g.m = v.m;
  g.ls = v.ls;
  const float az = p.two_lambda != 0.f ? __fmul_rn(p.two_lambda, v.lse) : 0.f;
  g.A = __fadd_rn(static_cast<float>(Q), az);
  g.ks = __fmul_rn(ri.k, p.scale);
  g.rt = RowTerms{__fmul_rn(row_grad_lse(p, row), p.scale),
                  __fmul_rn(row_grad_entropy(p, row), p.scale), mum};
  return g;
}

// The gradient of one vector of a row of class probabilities (rules 9, 18, 19).
template <class TZ, class TG, int MODE, class I>
__device__ __forceinline__ void soft_grad_vector(const uint4& raw, I j0, bool full, bool vec_ok,
                                                 const KParams& p, int64_t row, const SoftGrad& sg,
                                                 char* grow) {
  constexpr int E = vec_elems<TZ>();
  float g[E];
  unpack<TZ>(raw, g);
#pragma unroll
  for (int q = 0; q < E; ++q) {
    const I j = j0 + q;
    const bool inside = full || (j >= 0 && j < p.vocab);
    float t;
    const float a = xform<MODE>(g[q], p, t);
    const float pr = prob(a, sg.m, sg.ls);
    const float wq = inside ? __fmul_rn(soft_w(p, j), soft_q(p, row, j)) : 0.f;
    const float cf = use_cap<MODE>(p) ? __fmaf_rn(-t, t, 1.f) : 1.f;
    float gq = __fmul_rn(__fmul_rn(__fmaf_rn(pr, sg.A, -wq), sg.ks), cf);
    const float w = __fmaf_rn(-sg.rt.Es, __fsub_rn(__fsub_rn(a, sg.m), sg.rt.mum), sg.rt.Ls);
    g[q] = pr == 0.f ? gq : __fmaf_rn(__fmul_rn(pr, w), cf, gq);
  }
  store_grad<TG, E>(grow, j0, full, vec_ok, p.vocab, g);
}

}  // namespace
}  // namespace cuda
}  // namespace fce
