// vocab_parallel/exact.cu — phase 1 under options->batch_invariant (docs/semantics.md rule 21):
// the exact statistics of a shard's rows (VpExactStat, internal.h), whose combination
// (vp_combine_kernel's EXACT instantiation, vocab_parallel/kernels.cu) is the same bits whatever
// the number of shards and their widths. Per row, over the shard's elements a_j (rules 1-3 and
// steps 1-2 as the other kernels): the maximum and its first index (the first NaN when there is
// one), the target logit, and the exact sums (exact_sum.h) Σ exp(a_j), with options->vp_entropy
// Σ exp(a_j) a_j, and with label smoothing or class probabilities Σ w_j a_j and Σ w_j
// (w_j = ω_j, or ω_j q'_j made as vocab_parallel/soft.cu makes it). The sums are integer bins:
// each thread's and the CTA's merge of them are exact, so the element order (16-byte vectors or
// not, wherever the row starts) does not matter; each element's term is computed from the
// element alone. One CTA per row, the row read once in 16-byte vectors (and its q element by
// element); no workspace. Slower than vp_stats_kernel: its cost is in
// docs/performance.md.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>
#include <cstring>

#include "cuda/common/launch_check.cuh"
#include "cuda/vocab_parallel/device.cuh"
#include "cuda/vocab_parallel/kernels.cuh"
#include "exact_sum.h"
#include "internal.h"

namespace fce {
namespace cuda {
namespace {

constexpr int kExactThreads = 256;
constexpr int kUnroll = 2;  // vectors in flight per thread

struct XParams {
  SParams p;
  QParams qp;    // class probabilities (p.soft): the shard's q
  int entropy;   // options->vp_entropy
  int weighted;  // label smoothing or class probabilities: the w sums
};

// A thread's (or a tree node's) part of a row.
struct Part {
  float m;    // maximum (NaN-free)
  int am;     // its first index, −1: none above −inf
  int nan_j;  // first NaN, INT_MAX: none
  ExactSum S, P, U, W;
};

__device__ __forceinline__ ExactSum shfl_exact(const ExactSum& x, int o) {
  ExactSum y;
#pragma unroll
  for (int i = 0; i < kExactBins; ++i)
    y.bin[i] =
        static_cast<int64_t>(__shfl_down_sync(0xffffffffu, static_cast<long long>(x.bin[i]), o));
  y.top = static_cast<int64_t>(__shfl_down_sync(0xffffffffu, static_cast<long long>(x.top), o));
  y.nonfinite = __shfl_down_sync(0xffffffffu, x.nonfinite, o);
  return y;
}

__device__ __forceinline__ void merge_part(Part& x, const Part& y, bool sums_p, bool sums_w) {
  if (y.m > x.m || (y.m == x.m && y.am >= 0 && (x.am < 0 || y.am < x.am))) {
    x.m = y.m;
    x.am = y.am;
  }
  x.nan_j = min(x.nan_j, y.nan_j);
  exact_merge(x.S, y.S);
  if (sums_p) exact_merge(x.P, y.P);
  if (sums_w) {
    exact_merge(x.U, y.U);
    exact_merge(x.W, y.W);
  }
}

template <class TZ>
__global__ void __launch_bounds__(kExactThreads) vp_stats_exact_kernel(const XParams x) {
  constexpr int eb = Ty<TZ>::kBytes;
  __shared__ Part s_warp[kExactThreads / 32];
  const SParams& p = x.p;
  const int64_t lrow = blockIdx.x;
  const int64_t row = p.row_begin + lrow;
  const char* zrow = p.logits + lrow * p.z_row_bytes;
  const int V = p.vocab;
  const int64_t qrow = row * int64_t(V);

  Part t;
  t.m = neg_inf();
  t.am = -1;
  t.nan_j = INT_MAX;
  t.S = t.P = t.U = t.W = exact_zero();
  // the row in 16-byte vectors (its ≤ 2 partial ones element by element), kUnroll in flight per
  // thread: any split gives the same sums
  constexpr int E = vec_elems<TZ>();
  const int lead = static_cast<int>((reinterpret_cast<uintptr_t>(zrow) & 15) / eb);
  const int64_t nvec = (int64_t(lead) + V + E - 1) / E;
  const int64_t step = int64_t(blockDim.x) * kUnroll;
  for (int64_t base = threadIdx.x; base < nvec; base += step) {
    uint4 buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = base + int64_t(u) * blockDim.x;
      const int64_t j0 = v * E - lead;
      buf[u] = v < nvec
                   ? load_vector<TZ, kStreaming, int64_t>(zrow, j0, is_full<int64_t, E>(j0, V), V)
                   : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j0 = (base + int64_t(u) * blockDim.x) * E - lead;
      float z[E];
      unpack<TZ>(buf[u], z);
#pragma unroll
      for (int q = 0; q < E; ++q) {
        const int64_t jj = j0 + q;
        if (jj < 0 || jj >= V) continue;  // (also the vectors past the row: jj >= V)
        const int j = static_cast<int>(jj);
        const float a = xform<kGeneral>(z[q], p);
        if (isnan(a)) {
          t.nan_j = min(t.nan_j, j);
          continue;
        }
        if (a > t.m || (a == t.m && j < t.am)) {  // the first index of the maximum
          t.m = a;
          t.am = j;
        }
        float mant;
        int64_t n;
        exact_add_exp(t.S, a, &mant, &n);
        if (x.entropy && mant != 0.f) exact_add_product(t.P, mant, a, n);
        if (x.weighted) {
          float w = p.class_weights ? __ldg(p.class_weights + p.vocab_start + j) : 1.f;
          if (p.soft) w = __fmul_rn(w, __fmaf_rn(x.qp.keep, load_q(x.qp, qrow + j), x.qp.spread));
          exact_add(t.W, w);
          if (w != 0.f) exact_add_product(t.U, w, a);  // (a −inf logit of weight 0 adds nothing)
        }
      }
    }
  }

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const bool sums_p = x.entropy != 0, sums_w = x.weighted != 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Part y;
    y.m = __shfl_down_sync(0xffffffffu, t.m, o);
    y.am = __shfl_down_sync(0xffffffffu, t.am, o);
    y.nan_j = __shfl_down_sync(0xffffffffu, t.nan_j, o);
    y.S = shfl_exact(t.S, o);
    if (sums_p) y.P = shfl_exact(t.P, o);
    if (sums_w) {
      y.U = shfl_exact(t.U, o);
      y.W = shfl_exact(t.W, o);
    }
    if (lane < o) merge_part(t, y, sums_p, sums_w);
  }
  if (lane == 0) s_warp[warp] = t;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < nwarps; ++w) merge_part(t, s_warp[w], sums_p, sums_w);

  // the target logit, when the row is scored and its target is in the shard
  float t_r = 0.f;
  bool hit = false;
  int64_t y;
  if (!p.soft && classify_row(p, row, &y) == kValid && y >= p.vocab_start &&
      y - p.vocab_start < V) {
    t_r = xform<kGeneral>(raw_to_float<TZ>(ld_elem<TZ>(zrow + (y - p.vocab_start) * eb)), p);
    hit = true;
  }
  const bool has_nan = t.nan_j != INT_MAX;
  const int am = has_nan ? t.nan_j : (t.am >= 0 ? t.am : 0);
  float* out = p.stats + row * kVxCount;
  out[kVxMax] = has_nan ? qnan() : t.m;
  out[kVxArgmax] = __int_as_float(static_cast<int>(p.vocab_start + am));
  out[kVxLocal] = __uint_as_float(static_cast<unsigned>(V) | (hit ? kVpHitBit : 0u));
  out[kVxTarget] = t_r;
  exact_store(t.S, out + kVxSumExp);
  exact_store(t.P, out + kVxEntropy);
  exact_store(t.U, out + kVxSmooth);
  exact_store(t.W, out + kVxWeight);
}

template <class TZ>
fce_status launch_typed(const VpStatsArgs& a, XParams x, cudaStream_t s) {
  x.p.z_row_bytes = a.row_stride * Ty<TZ>::kBytes;
  for (int64_t r0 = 0; r0 < a.row_count; r0 += kMaxRowsPerLaunch) {
    const int64_t n = a.row_count - r0 < kMaxRowsPerLaunch ? a.row_count - r0 : kMaxRowsPerLaunch;
    XParams q = x;
    q.p.row_begin = a.row_begin + r0;
    q.p.logits = static_cast<const char*>(a.logits) + r0 * x.p.z_row_bytes;
    vp_stats_exact_kernel<TZ><<<static_cast<unsigned>(n), kExactThreads, 0, s>>>(q);
    FCE_TRY(launch_check(a.fn, "vp_stats_exact_kernel"));
  }
  return FCE_SUCCESS;
}

}  // namespace

fce_status launch_vp_stats_exact(const VpStatsArgs& a, cudaStream_t s) {
  const CeOptions& opt = a.opt;
  XParams x;
  memset(&x, 0, sizeof x);
  x.p = stats_params(a);
  x.entropy = opt.vp_entropy ? 1 : 0;
  x.weighted = opt.soft_targets || opt.label_smoothing > 0.f ? 1 : 0;
  if (opt.soft_targets) x.qp = q_params(a);
  switch (a.logits_dtype) {
    case FCE_FLOAT32: return launch_typed<float>(a, x, s);
    case FCE_FLOAT16: return launch_typed<__half>(a, x, s);
    case FCE_BFLOAT16: return launch_typed<__nv_bfloat16>(a, x, s);
    default: return fail(FCE_ERROR_UNSUPPORTED, "%s: logits dtype %d", a.fn, a.logits_dtype);
  }
}

}  // namespace cuda
}  // namespace fce
