// ce/reduce.cu — the two one-block passes around the cross-entropy row kernels (ce/kernels.cu),
// docs/semantics.md rules 4, 5, 7, 15: the denominators pre-pass (D, Ω, n over all rows, before any
// row needs k = g / D) and the finalize (the reduced loss, z-loss and accuracy from the per-row
// values). One block each, every thread summing a fixed set of rows, then a fixed tree, all in
// double: the same bits run to run, no atomics. Enqueued on the caller's stream only.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/ce/device.cuh"
#include "cuda/ce/geometry.cuh"
#include "cuda/ce/rows.cuh"
#include "cuda/common/launch_check.cuh"

namespace fce {
namespace cuda {
namespace {

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
                                                                          CeDenoms* out,
                                                                          const float* skip_if_one) {
  pdl_trigger();  // the row kernel may start now; it waits before reading *out
  if (skip_if_one && *skip_if_one == 1.f) return;
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

// Class-probability targets (docs/semantics.md rule 19): every row scored, so D = n = rows,
// with Ω = Σ_j ω_j (or V) as above; the targets are not read.
__global__ void __launch_bounds__(kReduceThreads) ce_soft_denominators_kernel(
    const KParams p, int64_t rows, CeDenoms* out, const float* skip_if_one) {
  pdl_trigger();  // the row kernel may start now; it waits before reading *out
  if (skip_if_one && *skip_if_one == 1.f) return;
  __shared__ double s[32][3];
  double v[3] = {0.0, 0.0, 0.0};
  if (p.class_weights)
    for (int64_t j = threadIdx.x; j < p.vocab; j += blockDim.x)
      v[1] += static_cast<double>(p.class_weights[j]);
  block_sum3(v, s);
  if (threadIdx.x == 0) {
    out->denom = static_cast<float>(rows);
    out->omega_total = p.class_weights ? static_cast<float>(v[1]) : static_cast<float>(p.vocab);
    out->count = static_cast<float>(rows);
  }
}

// docs/semantics.md rules 5, 7, 15, from the per-row values, fixed order as above, double accumulation:
//   loss[0]     = Σ ce_r + Σ zl_r (sum), Σ ce_r / D + Σ zl_r / n (mean; each 0 when its divisor is)
//   z_loss[0]   = Σ zl_r (sum, none), Σ zl_r / n (mean)
//   accuracy[0] = Σ correct_r / n (0 when n = 0)
// row_zloss / row_correct null count as 0.
__global__ void __launch_bounds__(kReduceThreads) ce_finalize_kernel(
    int64_t rows, int reduction, const float* row_loss, const float* row_zloss,
    const float* row_correct, const CeDenoms* d, float* loss, float* z_loss, float* accuracy) {
  pdl_wait();  // the row kernel's values (a no-op when not launched as its dependent)
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
      // 0 over a zero divisor, unless the sum is not finite (an invalid row; class weights
      // that cancel can make D 0 with rows counted); a negative D (negative weights) divides
      ce = D != 0.0 ? ce / D : isfinite(ce) ? 0.0 : ce;
      zl = n != 0.0 ? zl / n : isfinite(zl) ? 0.0 : zl;
    }
    if (loss) loss[0] = static_cast<float>(ce + zl);
    if (z_loss) z_loss[0] = static_cast<float>(zl);
    if (accuracy) accuracy[0] = n > 0.0 ? static_cast<float>(v[2] / n) : 0.f;
  }
}

}  // namespace

// ================================================================ interface ====
fce_status launch_ce_denominators(const char* fn, const CeOptions& opt, int64_t rows,
                                  int64_t vocab, const void* targets, CeDenoms* out,
                                  cudaStream_t s, const float* skip_if_one) {
  // (class probabilities are not read here: fce_vp_loss may have none)
  if (rows < 0 || vocab < 1 || vocab > INT32_MAX || (rows > 0 && !targets && !opt.soft_targets) ||
      !out)
    return fail(FCE_ERROR_INTERNAL,
                "%s: launch_ce_denominators: bad arguments (rows %lld, vocab %lld)", fn,
                static_cast<long long>(rows), static_cast<long long>(vocab));
  KParams p = make_params(opt, vocab);
  p.targets = targets;
  if (opt.soft_targets) {
    ce_soft_denominators_kernel<<<1, kReduceThreads, 0, s>>>(p, rows, out, skip_if_one);
    return launch_check(fn, "ce_soft_denominators_kernel");
  }
  ce_denominators_kernel<<<1, kReduceThreads, 0, s>>>(p, rows, out, skip_if_one);
  return launch_check(fn, "ce_denominators_kernel");
}

fce_status launch_ce_finalize(const char* fn, const CeOptions& opt, int64_t rows,
                              const float* row_loss, const float* row_zloss,
                              const float* row_correct, const CeDenoms* d, float* loss,
                              float* z_loss, float* accuracy, cudaStream_t s, bool pdl) {
  if (!loss && !z_loss && !accuracy) return FCE_SUCCESS;
  if (rows < 0 || (loss && !row_loss) || (accuracy && !row_correct) || !d ||
      (loss && opt.z_loss_scale != 0.f && !row_zloss))
    return fail(FCE_ERROR_INTERNAL, "%s: launch_ce_finalize: bad arguments", fn);
  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attrs[2];
  make_launch(1, kReduceThreads, 1, pdl && pdl_supported(), s, &cfg, attrs);
  const cudaError_t e = cudaLaunchKernelEx(&cfg, ce_finalize_kernel, rows, opt.reduction,
                                           row_loss, row_zloss, row_correct, d, loss, z_loss,
                                           accuracy);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return fail(FCE_ERROR_CUDA, "%s: the CUDA kernel launch failed (ce_finalize_kernel): %s", fn,
                cudaGetErrorString(e));
  }
  return launch_check(fn, "ce_finalize_kernel");
}

}  // namespace cuda
}  // namespace fce
