// vocab_parallel/distill.cu — the vocabulary-parallel distillation on the CUDA backend
// (fce_vp_distill_*, docs/semantics.md rule 22). One block per row for the statistics and the
// gradient, one thread per row for the loss; the combination of a row's gathered statistics is
// vd_combine (lib/vp_distill.h, the CPU backend's own, in double). The mean's n and the
// fixed-order reduction of the row losses are distill/kernels.cuh's (launch_count,
// launch_reduce, in the workspace's Head).
//
// A block walks its row's shard element by element, thread t taking elements t, t + kThreads,
// ... (coalesced), both rows put through rule 20's transform in float32: u = a / T with
// a = s·z, or c·tanh(s·z / c). Round 1: the maxima (the student's argmax, NaN first), then the
// sums relative to them (expf) and the cross sum of the divergence; round 2 (the JSD): A_r and
// B_r with round 1's combination rounded to float32, as the CPU backend writes it; the gradient:
// rule 20's per element with log p, log q from the combination. Block sums run in a fixed order
// (warp shuffles, then warp 0 over the warps): deterministic, the same bits on every rank for
// the same gathered statistics. Everything on the caller's stream, no allocation, no host
// synchronisation: graph-capturable.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/ce/memory.cuh"
#include "cuda/common/launch_check.cuh"
#include "cuda/distill/kernels.cuh"
#include "vp_distill.h"

namespace fce {
namespace cuda {
namespace {

constexpr int kThreads = 256;  // a row's block
constexpr int kWarps = kThreads / 32;
constexpr int kLossThreads = 256;

// A shard's running maximum: m (−inf until a larger entry), the first index of it, NaN seen
// (then idx is the first NaN's).
struct Max {
  float m;
  int idx;
  int nan;
};

__device__ __forceinline__ void add_max(Max& a, float x, int j) {
  if (a.nan) return;
  if (x != x) {
    a.nan = 1;
    a.idx = j;
  } else if (x > a.m) {
    a.m = x;
    a.idx = j;
  }
}
// The better of two running maxima: a NaN first (the smaller index), then the larger m, then
// the smaller index.
__device__ __forceinline__ Max better(const Max& a, const Max& b) {
  if (a.nan != b.nan) return a.nan ? a : b;
  if (a.nan || a.m == b.m) return a.idx <= b.idx ? a : b;
  return a.m > b.m ? a : b;
}
__device__ __forceinline__ Max shfl_down(const Max& a, int o) {
  return {__shfl_down_sync(0xffffffffu, a.m, o), __shfl_down_sync(0xffffffffu, a.idx, o),
          __shfl_down_sync(0xffffffffu, a.nan, o)};
}
__device__ __forceinline__ float shfl_down(float a, int o) {
  return __shfl_down_sync(0xffffffffu, a, o);
}

// N values merged over the block by op in a fixed order (a shuffle tree in each warp, then one
// over the warps' results in warp 0; none: what lanes past the warps hold), returned to every
// thread.
template <class T, int N, class Op>
__device__ void block_reduce(T (&v)[N], T* shared, T none, Op op) {  // shared: [N * kWarps]
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = op(v[k], shfl_down(v[k], o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0)
#pragma unroll
    for (int k = 0; k < N; ++k) shared[k * kWarps + warp] = v[k];
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      v[k] = lane < kWarps ? shared[k * kWarps + lane] : none;
      for (int o = kWarps / 2; o > 0; o >>= 1) v[k] = op(v[k], shfl_down(v[k], o));
    }
    if (lane == 0)
#pragma unroll
      for (int k = 0; k < N; ++k) shared[k * kWarps] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = shared[k * kWarps];
  __syncthreads();
}
template <int N>
__device__ void block_max(Max (&v)[N], Max* shared) {
  block_reduce(v, shared, Max{neg_inf(), INT_MAX, 0},
               [](const Max& a, const Max& b) { return better(a, b); });
}
template <int N>
__device__ void block_sum(float (&v)[N], float* shared) {
  block_reduce(v, shared, 0.0f, [](float a, float b) { return a + b; });
}

// Rule 20's transform of one element: u = a / T; *chain = ∂u/∂z = (s / T)(1 − tanh²).
struct Xform {
  float s, c, s_over_c, invT;
  __device__ __forceinline__ float operator()(float z, float* chain = nullptr) const {
    float a = z * s;
    float d = s * invT;
    if (c > 0.0f) {
      const float t = tanhf(z * s_over_c);
      a = c * t;
      d *= 1.0f - t * t;
    }
    if (chain) *chain = d;
    return a * invT;
  }
};
Xform make_xform(const DistillOptions& o) {
  return {o.logit_scale, o.softcap, o.softcap > 0.0f ? o.logit_scale / o.softcap : 0.0f,
          1.0f / o.temperature};
}

__device__ __forceinline__ float base(float m) { return m > neg_inf() ? m : 0.0f; }

// x · (log x − log y): 0 where x is 0.
__device__ __forceinline__ float kl_term(float x, float lx, float ly) {
  return x == 0.0f ? 0.0f : x * (lx - ly);
}
// log m_j = log(β q_j + (1 − β) p_j) as rule 20's logaddexp of the logs.
__device__ __forceinline__ float log_mix(float log_b, float log_1mb, float lq, float lp) {
  const float x = log_b + lq, y = log_1mb + lp;
  if (x != x || y != y) return qnan();
  const float hi = fmaxf(x, y), lo = fminf(x, y);
  if (hi == neg_inf()) return hi;
  return hi + log1pf(expf(lo - hi));
}

struct StatsArgs {
  VpDistillStatsProblem p;
  Xform xf;
  int div;
};

template <class T>
__global__ void __launch_bounds__(kThreads) stats_kernel(StatsArgs a) {
  __shared__ Max max_shared[2 * kWarps];
  __shared__ float sum_shared[3 * kWarps];
  __shared__ float comb[5];  // round 2: Mu, lsu, Mv, lsv, ok
  const VpDistillStatsProblem& p = a.p;
  const int64_t i = blockIdx.x, r = p.first + i;  // the chunk's row, the call's
  const int n = static_cast<int>(p.vocab_local);
  const T* zs = static_cast<const T*>(p.logits) + i * p.row_stride;
  const T* zt = static_cast<const T*>(p.teacher) + i * p.teacher_row_stride;
  float* out = p.stats + r * kVdCount;
  const int first = threadIdx.x < n ? int(threadIdx.x) : INT_MAX;
  if (p.round == 2 && threadIdx.x == 0) {
    const VdRow c =
        vd_combine(p.previous, p.ranks, p.rows, r, p.vocab_total, 1, a.div, double(p.opt.beta));
    comb[0] = float(c.Mu);
    comb[1] = float(c.lsu);
    comb[2] = float(c.Mv);
    comb[3] = float(c.lsv);
    comb[4] = c.ok ? 1.0f : 0.0f;
  }
  if (p.round == 2) {  // one read: the argmax, A_r and B_r
    __syncthreads();
    const float Mu = comb[0], lsu = comb[1], Mv = comb[2], lsv = comb[3];
    const float b = p.opt.beta, log_b = logf(b), log_1mb = log1pf(-b);
    Max mx[1] = {{neg_inf(), first, 0}};
    float s[2] = {0.0f, 0.0f};
    for (int j = threadIdx.x; j < n; j += kThreads) {
      const float u = a.xf(to_float(zs[j])), v = a.xf(to_float(zt[j]));
      add_max(mx[0], u, j);
      const float lp = (u - Mu) - lsu, lq = (v - Mv) - lsv;
      const float lm = log_mix(log_b, log_1mb, lq, lp);
      s[0] += kl_term(expf(lq), lq, lm);
      s[1] += kl_term(expf(lp), lp, lm);
    }
    block_max(mx, max_shared);
    block_sum(s, sum_shared);
    if (threadIdx.x != 0) return;
    out[kVdMaxU] = Mu;
    out[kVdSumU] = lsu;
    out[kVdMaxV] = Mv;
    out[kVdSumV] = lsv;
    out[kVdCross] = s[0];
    out[kVdJsdP] = s[1];
    out[kVdArgmax] =
        vd_float(uint32_t(p.vocab_start + mx[0].idx) | (comb[4] != 0.0f ? 0u : kVdTopBit));
    out[kVdLocal] = vd_float(uint32_t(n) | kVdTopBit);
    return;
  }
  // Round 1: the maxima, then the sums relative to them.
  Max mx[2] = {{neg_inf(), first, 0}, {neg_inf(), first, 0}};
  for (int j = threadIdx.x; j < n; j += kThreads) {
    add_max(mx[0], a.xf(to_float(zs[j])), j);
    add_max(mx[1], a.xf(to_float(zt[j])), j);
  }
  block_max(mx, max_shared);
  const float mu = mx[0].nan ? qnan() : mx[0].m, mv = mx[1].nan ? qnan() : mx[1].m;
  const float bu = base(mu), bv = base(mv);
  float s[3] = {0.0f, 0.0f, 0.0f};  // s_u, s_v, the cross sum
  for (int j = threadIdx.x; j < n; j += kThreads) {
    const float x = a.xf(to_float(zs[j])) - bu, y = a.xf(to_float(zt[j])) - bv;
    const float ex = expf(x), ey = expf(y);
    s[0] += ex;
    s[1] += ey;
    if (a.div == kVdForward && ey != 0.0f) s[2] += ey * (y - x);
    if (a.div == kVdReverse && ex != 0.0f) s[2] += ex * (x - y);
  }
  block_sum(s, sum_shared);
  if (threadIdx.x != 0) return;
  out[kVdMaxU] = mu;
  out[kVdSumU] = s[0];
  out[kVdMaxV] = mv;
  out[kVdSumV] = s[1];
  out[kVdCross] = s[2];
  out[kVdJsdP] = 0.0f;
  out[kVdArgmax] = vd_float(uint32_t(p.vocab_start + mx[0].idx));
  out[kVdLocal] = vd_float(uint32_t(n));
}

struct RowsArgs {
  VpDistillProblem p;
  int div, rounds;
  const float* n;   // the counted rows (device)
  float* row_loss;  // loss: [rows] (the caller's loss for reduction none)
};

__global__ void __launch_bounds__(kLossThreads) loss_kernel(RowsArgs a) {
  const VpDistillProblem& p = a.p;
  const int64_t r = int64_t(blockIdx.x) * kLossThreads + threadIdx.x;
  if (r >= p.rows) return;
  const VdRow c = vd_combine(p.gathered, p.ranks, p.rows, r, p.vocab_total, a.rounds, a.div,
                             double(p.opt.beta));
  if (!c.ok && p.error_flags) atomicOr(p.error_flags, FCE_FLAG_SHARDS_INCONSISTENT);
  if (p.lse) p.lse[r] = c.ok ? float(c.Mu + c.lsu) : qnan();
  const bool is_counted = distill::counted(p.targets, p.opt.targets_int64, p.opt.ignore_index, r);
  a.row_loss[r] = !is_counted ? 0.0f : c.ok ? float(c.loss) : qnan();
}

template <class T>
__global__ void __launch_bounds__(kThreads) backward_kernel(RowsArgs a, Xform xf) {
  __shared__ float comb[6];  // Mu, lsu, Mv, lsv, k, ok
  const VpDistillProblem& p = a.p;
  const int64_t i = blockIdx.x, r = p.first + i;  // the chunk's row, the call's
  const int n = static_cast<int>(p.vocab_local);
  const T* zs = static_cast<const T*>(p.logits) + i * p.row_stride;
  const T* zt = static_cast<const T*>(p.teacher) + i * p.teacher_row_stride;
  T* g = static_cast<T*>(p.grad) + i * p.grad_row_stride;
  if (!distill::counted(p.targets, p.opt.targets_int64, p.opt.ignore_index, r)) {
    for (int j = threadIdx.x; j < n; j += kThreads) g[j] = from_float<T>(0.0f);
    return;
  }
  if (threadIdx.x == 0) {
    const VdRow c = vd_combine(p.gathered, p.ranks, p.rows, r, p.vocab_total, a.rounds, a.div,
                               double(p.opt.beta));
    comb[0] = float(c.Mu);
    comb[1] = float(c.lsu);
    comb[2] = float(c.Mv);
    comb[3] = float(c.lsv);
    comb[4] = float(c.k);
    comb[5] = c.ok ? 1.0f : 0.0f;
  }
  __syncthreads();
  if (comb[5] == 0.0f) {  // inconsistent statistics: a NaN row
    for (int j = threadIdx.x; j < n; j += kThreads) g[j] = from_float<T>(qnan());
    return;
  }
  const float Mu = comb[0], lsu = comb[1], Mv = comb[2], lsv = comb[3], k = comb[4];
  const float b = p.opt.beta, log_b = logf(b), log_1mb = log1pf(-b);
  const bool per_row = p.opt.reduction == FCE_REDUCTION_NONE;
  const float go = p.grad_output ? p.grad_output[per_row ? r : 0] : 1.0f;
  const float up = p.opt.reduction == FCE_REDUCTION_MEAN ? (*a.n == 0.0f ? 0.0f : go / *a.n) : go;
  for (int j = threadIdx.x; j < n; j += kThreads) {
    float chain;
    const float u = xf(to_float(zs[j]), &chain), v = xf(to_float(zt[j]));
    const float lp = (u - Mu) - lsu, lq = (v - Mv) - lsv;
    const float pj = expf(lp);
    float du;
    if (a.div == kVdForward) du = pj - expf(lq);
    else if (a.div == kVdReverse) du = pj == 0.0f ? 0.0f : pj * ((lp - lq) - k);
    else du = pj == 0.0f ? 0.0f : (1.0f - b) * pj * ((lp - log_mix(log_b, log_1mb, lq, lp)) - k);
    g[j] = from_float<T>(du * chain * up);
  }
}

template <template <class> class Launch, class... Args>
void by_dtype(int dtype, Args&&... args) {
  switch (dtype) {
    case FCE_FLOAT16: Launch<__half>::run(args...); break;
    case FCE_BFLOAT16: Launch<__nv_bfloat16>::run(args...); break;
    default: Launch<float>::run(args...); break;
  }
}
template <class T>
struct LaunchStats {
  static void run(const StatsArgs& a, cudaStream_t s) {
    stats_kernel<T><<<unsigned(a.p.count), kThreads, 0, s>>>(a);
  }
};
template <class T>
struct LaunchBackward {
  static void run(const RowsArgs& a, const Xform& xf, cudaStream_t s) {
    backward_kernel<T><<<unsigned(a.p.count), kThreads, 0, s>>>(a, xf);
  }
};

char* aligned_base(void* workspace) {
  return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(workspace) + uintptr_t(255)) &
                                 ~uintptr_t(255));
}

}  // namespace
}  // namespace cuda

fce_status cuda_vp_distill_stats(const VpDistillStatsProblem& p) {
  using namespace cuda;
  const StatsArgs a{p, make_xform(p.opt), vd_divergence(p.opt.divergence, p.opt.beta)};
  by_dtype<LaunchStats>(p.opt.dtype, a, static_cast<cudaStream_t>(p.stream));
  return launch_check(p.fn, "vp distill stats_kernel");
}

// The workspace: distill/kernels.cuh's Head (n, and the row losses of mean and sum; the
// backward needs n only), plus the slack of aligning it to 256 bytes.
size_t cuda_vp_distill_workspace_size(const DistillOptions& opt, int64_t, int64_t rows,
                                      bool backward) {
  return sat_add(
      cuda::distill::head_bytes(rows, backward ? int(FCE_REDUCTION_NONE) : opt.reduction), 256);
}

fce_status cuda_vp_distill(const VpDistillProblem& p) {
  using namespace cuda;
  cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  const int reduction = p.backward ? int(FCE_REDUCTION_NONE) : p.opt.reduction;
  const distill::Head h = distill::head_at(aligned_base(p.workspace), p.rows, reduction);
  FCE_TRY(distill::launch_count(p.fn, p.opt, p.rows, p.targets, h.n, s));
  RowsArgs a{p, vd_divergence(p.opt.divergence, p.opt.beta), 0, h.n, nullptr};
  a.rounds = vd_rounds(a.div);
  if (p.backward) {
    by_dtype<LaunchBackward>(p.opt.dtype, a, make_xform(p.opt), s);
    return launch_check(p.fn, "vp distill backward_kernel");
  }
  const bool none = p.opt.reduction == FCE_REDUCTION_NONE;
  a.row_loss = none ? p.loss : h.row_loss;
  const unsigned blocks = unsigned((p.rows + kLossThreads - 1) / kLossThreads);
  loss_kernel<<<blocks, kLossThreads, 0, s>>>(a);
  FCE_TRY(launch_check(p.fn, "vp distill loss_kernel"));
  if (none) return FCE_SUCCESS;
  return distill::launch_reduce(p.fn, p.opt.reduction, p.rows, h.row_loss, h.n, p.loss, s);
}

}  // namespace fce
