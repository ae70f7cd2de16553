// distill/kernels.cu — the distillation kernels (distill/kernels.cuh). The row kernel runs one
// block per row: an online (max, Σ exp) pass over both rows, a pass for the loss (and the
// correction term K of the reverse KL and the JSD), then the gradient pass (the forward KL
// writes its gradient in the second pass already). Everything relative to the row maxima in
// float32; the block sums in a fixed order (bitwise deterministic).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "cuda/common/launch_check.cuh"
#include "cuda/distill/kernels.cuh"

namespace fce {
namespace cuda {
namespace distill {
namespace {

constexpr int kThreads = 256;
constexpr size_t kAlign = 256;

__device__ __forceinline__ int esize(int dtype) { return dtype == FCE_FLOAT32 ? 4 : 2; }

__device__ __forceinline__ float load(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case FCE_FLOAT16: return __half2float(static_cast<const __half*>(p)[i]);
    case FCE_BFLOAT16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void store(void* p, int dtype, int64_t i, float v) {
  switch (dtype) {
    case FCE_FLOAT16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case FCE_BFLOAT16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

__device__ __forceinline__ bool counted(const void* targets, bool int64, int64_t ignore,
                                        int64_t r) {
  if (!targets) return true;
  const int64_t y = int64 ? static_cast<const int64_t*>(targets)[r]
                          : int64_t(static_cast<const int32_t*>(targets)[r]);
  return y != ignore;
}

// The capped logit a = c tanh(s z / c) (or s z).
__device__ __forceinline__ float capped(const DistillOptions& o, float z) {
  const float a = o.logit_scale * z;
  return o.softcap > 0.0f ? o.softcap * tanhf(a / o.softcap) : a;
}

// A running (max, Σ exp(x − max)) of a row; nan when a NaN was seen.
struct MaxSum {
  float m, s;
  bool nan;
  __device__ void add(float x) {
    if (isnan(x)) nan = true;
    if (!(x > -INFINITY)) return;  // −inf (and NaN): adds 0
    if (x > m) {
      s = s * expf(m - x) + 1.0f;  // m = −inf: s is 0, 0 · 0
      m = x;
    } else {
      s += expf(x - m);
    }
  }
  __device__ void merge(const MaxSum& o) {
    nan = nan || o.nan;
    if (o.m == -INFINITY) return;
    if (m == -INFINITY) {
      m = o.m;
      s = o.s;
      return;
    }
    const float hi = fmaxf(m, o.m);
    s = s * expf(m - hi) + o.s * expf(o.m - hi);
    m = hi;
  }
  // log s; NaN for a row with a NaN or a +inf maximum (rule 10), −inf for a row of −inf.
  __device__ float log_s() const {
    if (nan || m == INFINITY) return NAN;
    return logf(s);
  }
};

// Block-wide sums and (max, Σ) merges in a fixed order: warp shuffles, then warp 0.
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

__device__ MaxSum block_merge(MaxSum v, MaxSum* shared) {
  __syncthreads();
  shared[threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    MaxSum t = shared[0];
    for (int i = 1; i < kThreads; ++i) t.merge(shared[i]);
    shared[0] = t;
  }
  __syncthreads();
  return shared[0];
}

__device__ __forceinline__ float log_add_exp(float x, float y) {
  if (isnan(x) || isnan(y)) return NAN;
  const float hi = fmaxf(x, y), lo = fminf(x, y);
  if (hi == -INFINITY) return hi;
  return hi + log1pf(expf(lo - hi));
}

__device__ __forceinline__ float kl_term(float x, float lx, float ly) {
  return x == 0.0f ? 0.0f : x * (lx - ly);
}

enum Div { kForward = 0, kReverse = 1, kJsd = 2 };

__global__ void __launch_bounds__(kThreads) rows_kernel(RowsArgs a) {
  __shared__ MaxSum ms_shared[kThreads];
  __shared__ float sum_shared[kThreads / 32 + 1];
  const DistillOptions& o = a.opt;
  const int64_t i = blockIdx.x, r = a.first + i, V = a.vocab;
  const int dt = o.dtype;
  const void* zs = static_cast<const char*>(a.student) + i * a.student_ld * int64_t(esize(dt));
  const void* zt = static_cast<const char*>(a.teacher) + i * a.teacher_ld * int64_t(esize(dt));
  const float invT = 1.0f / o.temperature;
  // Pass 1: both rows' (max, Σ exp).
  MaxSum p{-INFINITY, 0.0f, false}, q{-INFINITY, 0.0f, false};
  for (int64_t j = threadIdx.x; j < V; j += kThreads) {
    p.add(capped(o, load(zs, dt, j)) / o.temperature);
    q.add(capped(o, load(zt, dt, j)) / o.temperature);
  }
  p = block_merge(p, ms_shared);
  q = block_merge(q, ms_shared);
  const float ls_p = p.log_s(), ls_q = q.log_s();
  const float mp = p.nan ? NAN : p.m, mq = q.nan ? NAN : q.m;
  const bool is_counted = counted(a.targets, o.targets_int64, o.ignore_index, r);
  const int div = o.divergence == FCE_DIVERGENCE_JSD ? (o.beta == 0.0f   ? kForward
                                                        : o.beta == 1.0f ? kReverse
                                                                         : kJsd)
                                                     : o.divergence;
  const float b = o.beta, log_b = logf(b), log_1mb = log1pf(-b);
  float up = 0.0f;  // the upstream factor: g (/ n for mean)
  if (a.grad && is_counted) {
    const bool per_row = o.reduction == FCE_REDUCTION_NONE;
    const float g = a.grad_output ? a.grad_output[per_row ? r : 0] : 1.0f;
    up = o.reduction == FCE_REDUCTION_MEAN ? (*a.n == 0.0f ? 0.0f : g / *a.n) : g;
  }
  const float chain0 = o.logit_scale * invT;
  auto chain = [&](float z) {
    if (!(o.softcap > 0.0f)) return chain0;
    const float c = capped(o, z) / o.softcap;
    return chain0 * (1.0f - c * c);
  };
  // Pass 2: the loss and K (forward KL: its gradient too).
  float loss = 0.0f, k = 0.0f;
  for (int64_t j = threadIdx.x; j < V; j += kThreads) {
    const float z = load(zs, dt, j);
    const float lp = (capped(o, z) / o.temperature - mp) - ls_p;
    const float lq = (capped(o, load(zt, dt, j)) / o.temperature - mq) - ls_q;
    const float pj = expf(lp), qj = expf(lq);
    if (div == kForward) {
      loss += kl_term(qj, lq, lp);
      if (a.grad)
        store(a.grad, dt, i * a.grad_ld + j, is_counted ? (pj - qj) * chain(z) * up : 0.0f);
    } else if (div == kReverse) {
      loss += kl_term(pj, lp, lq);
    } else {
      const float lm = log_add_exp(log_b + lq, log_1mb + lp);
      const float tp = kl_term(pj, lp, lm);
      loss += b * kl_term(qj, lq, lm) + (1.0f - b) * tp;
      k += tp;
    }
  }
  loss = block_sum(loss, sum_shared);
  if (div == kJsd) k = block_sum(k, sum_shared);
  if (div == kReverse) k = loss;
  if (threadIdx.x == 0) {
    a.row_loss[r] = is_counted ? loss : 0.0f;
    if (a.lse) a.lse[r] = mp + ls_p;
  }
  if (!a.grad || div == kForward) return;
  // Pass 3: the gradient of the reverse KL and the JSD, which needs K.
  void* grad = static_cast<char*>(a.grad) + i * a.grad_ld * int64_t(esize(dt));
  for (int64_t j = threadIdx.x; j < V; j += kThreads) {
    const float z = load(zs, dt, j);
    float du = 0.0f;
    if (is_counted) {
      const float lp = (capped(o, z) / o.temperature - mp) - ls_p;
      const float lq = (capped(o, load(zt, dt, j)) / o.temperature - mq) - ls_q;
      const float pj = expf(lp);
      if (pj != 0.0f) {
        if (div == kReverse) {
          du = pj * ((lp - lq) - k);
        } else {
          const float lm = log_add_exp(log_b + lq, log_1mb + lp);
          du = (1.0f - b) * pj * ((lp - lm) - k);
        }
      }
      du *= chain(z) * up;
    }
    store(grad, dt, j, du);
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

fce_status launch_rows(const RowsArgs& a, cudaStream_t s) {
  if (a.count == 0) return FCE_SUCCESS;
  rows_kernel<<<static_cast<unsigned>(a.count), kThreads, 0, s>>>(a);
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
