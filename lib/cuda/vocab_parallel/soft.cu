// vocab_parallel/soft.cu — phase 1's sums of class-probability targets (docs/semantics.md rules
// 16, 19): per row of this rank's shard, with ω_j q'_j = ω_j ((1 − ε) q_j + ε/V) of the shard's
// own q [rows, vocab_local],
//   u_r = Σ_j ω_j q'_j (m_r − a_j)   (the terms with ω_j q'_j = 0 left out: a −inf logit of
//                                     probability 0 adds nothing; 0 when m_r = −inf, NaN when
//                                     m_r is NaN or +inf)
//   W_r = Σ_j ω_j q'_j
// into kVpSmooth and kVpWeight, against the m_r that vp_stats_kernel has just written (the same
// stream: it runs after it). The combination then makes Q = Σ_r W_r and
// U = Σ_r (u_r + W_r (M − m_r)), and the loss Q log S + U, exactly the label-smoothing algebra
// with per-row weights. One CTA per row, a second read of the shard's row and one read of its
// q; q'_j and ω_j q'_j in float32 as ce/soft.cuh makes them, the sums in double, in a fixed
// order: deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

#include "cuda/ce/geometry.cuh"
#include "cuda/common/launch_check.cuh"
#include "cuda/vocab_parallel/device.cuh"
#include "cuda/vocab_parallel/kernels.cuh"
#include "internal.h"

namespace fce {
namespace cuda {
namespace {

constexpr int kSoftThreads = 256;

// (u, w) summed over the CTA in a fixed tree; thread 0 gets the total.
__device__ __forceinline__ double2 block_sum2(double u, double w, double2* s_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    u = __dadd_rn(u, __shfl_down_sync(0xffffffffu, u, o));
    w = __dadd_rn(w, __shfl_down_sync(0xffffffffu, w, o));
  }
  if (lane == 0) s_warp[warp] = make_double2(u, w);
  __syncthreads();
  double2 t = make_double2(0.0, 0.0);
  if (warp == 0) {
    t = lane < nwarps ? s_warp[lane] : make_double2(0.0, 0.0);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      t.x = __dadd_rn(t.x, __shfl_down_sync(0xffffffffu, t.x, o));
      t.y = __dadd_rn(t.y, __shfl_down_sync(0xffffffffu, t.y, o));
    }
  }
  return t;
}

template <class TZ>
__global__ void __launch_bounds__(kSoftThreads)
    vp_soft_sums_kernel(const SParams p, const QParams qp) {
  constexpr int eb = Ty<TZ>::kBytes;
  __shared__ double2 s_warp[32];
  const int64_t lrow = blockIdx.x;
  const int64_t row = p.row_begin + lrow;
  const char* zrow = p.logits + lrow * p.z_row_bytes;
  float* out = p.stats + row * FCE_VP_STATS;
  const float m = out[kVpMax];
  const int64_t qrow = row * int64_t(p.vocab);
  double u = 0.0, w = 0.0;
  for (int64_t j = threadIdx.x; j < p.vocab; j += blockDim.x) {
    const float a = xform<kGeneral>(raw_to_float<TZ>(ld_elem<TZ>(zrow + j * eb)), p);
    const float cw = p.class_weights ? __ldg(p.class_weights + p.vocab_start + j) : 1.f;
    const float wq = __fmul_rn(cw, __fmaf_rn(qp.keep, load_q(qp, qrow + j), qp.spread));
    w = __dadd_rn(w, double(wq));
    if (wq != 0.f) u = __dadd_rn(u, double(wq) * (double(m) - double(a)));
  }
  const double2 t = block_sum2(u, w, s_warp);
  if (threadIdx.x == 0) {
    out[kVpSmooth] = m == neg_inf() ? 0.f : isfinite(m) ? static_cast<float>(t.x) : qnan();
    out[kVpWeight] = static_cast<float>(t.y);
  }
}

template <class TZ>
fce_status launch_typed(const VpStatsArgs& a, const SParams& p, const QParams& qp, cudaStream_t s) {
  for (int64_t r0 = 0; r0 < a.row_count; r0 += kMaxRowsPerLaunch) {
    const int64_t n = a.row_count - r0 < kMaxRowsPerLaunch ? a.row_count - r0 : kMaxRowsPerLaunch;
    SParams q = p;
    q.row_begin = a.row_begin + r0;
    q.logits = static_cast<const char*>(a.logits) + r0 * p.z_row_bytes;
    vp_soft_sums_kernel<TZ><<<static_cast<unsigned>(n), kSoftThreads, 0, s>>>(q, qp);
    FCE_TRY(launch_check(a.fn, "vp_soft_sums_kernel"));
  }
  return FCE_SUCCESS;
}

}  // namespace

fce_status launch_vp_soft_sums(const VpStatsArgs& a, cudaStream_t s) {
  const CeOptions& opt = a.opt;
  if (!opt.soft_targets || !a.targets || !a.stats || a.row_count < 0 || a.vocab_local < 1 ||
      a.vocab_local > INT32_MAX || a.vocab_total < 1)
    return fail(FCE_ERROR_INTERNAL, "%s: launch_vp_soft_sums: bad arguments", a.fn);
  if (a.row_count == 0) return FCE_SUCCESS;
  SParams p = stats_params(a);
  const QParams qp = q_params(a);
  switch (a.logits_dtype) {
    case FCE_FLOAT32: p.z_row_bytes = a.row_stride * 4; return launch_typed<float>(a, p, qp, s);
    case FCE_FLOAT16: p.z_row_bytes = a.row_stride * 2; return launch_typed<__half>(a, p, qp, s);
    case FCE_BFLOAT16:
      p.z_row_bytes = a.row_stride * 2;
      return launch_typed<__nv_bfloat16>(a, p, qp, s);
    default: return fail(FCE_ERROR_UNSUPPORTED, "%s: logits dtype %d", a.fn, a.logits_dtype);
  }
}

}  // namespace cuda
}  // namespace fce
