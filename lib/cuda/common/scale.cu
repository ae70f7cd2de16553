// common/scale.cu — fce_scale_gradient on CUDA: grad[i] *= *g, in place, with the scalar read on the
// device. Why it is cheap: the common upstream gradient is exactly 1 (loss.backward() of a
// mean or sum), and then every block reads the one float and returns, so applying it costs a
// launch, no host synchronisation and no pass over the gradient. Otherwise one streaming read
// and write in 16-byte vectors (float32 product, one rounding to the dtype), as fast as a copy.
// The ABI layer has checked the arguments, the device pointers included (cuda_check_pointers).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/launch_check.cuh"
#include "internal.h"

namespace fce {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;               // 16-byte vectors in flight per thread
constexpr int64_t kMaxBlocks = 132 * 16;  // grid-stride beyond this

template <class T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Elements [0, head) and [head + nvec·E, n) one by one; the 16-byte aligned middle as vectors.
template <class T>
__global__ void __launch_bounds__(kThreads) scale_kernel(T* __restrict__ grad, int64_t n,
                                                         int64_t head, int64_t nvec,
                                                         const float* __restrict__ scale) {
  const float g = *scale;
  if (g == 1.0f) return;  // the common case: nothing to do
  constexpr int E = 16 / sizeof(T);
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nt = int64_t(gridDim.x) * blockDim.x;
  uint4* v = reinterpret_cast<uint4*>(grad + head);
  for (int64_t base = tid; base < nvec; base += nt * kUnroll) {
    uint4 buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * nt < nvec) buf[u] = __ldcs(v + base + u * nt);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * nt >= nvec) continue;
      T* e = reinterpret_cast<T*>(&buf[u]);
#pragma unroll
      for (int q = 0; q < E; ++q) e[q] = from_f<T>(__fmul_rn(to_f<T>(e[q]), g));
      __stcs(v + base + u * nt, buf[u]);
    }
  }
  const int64_t tail = head + nvec * E;
  for (int64_t i = tid; i < head + (n - tail); i += nt) {
    const int64_t k = i < head ? i : tail + (i - head);
    grad[k] = from_f<T>(__fmul_rn(to_f<T>(grad[k]), g));
  }
}

template <class T>
fce_status launch(void* grad, int64_t n, const float* scale, cudaStream_t s) {
  constexpr int E = 16 / sizeof(T);
  const uintptr_t addr = reinterpret_cast<uintptr_t>(grad);
  int64_t head = static_cast<int64_t>(((16 - (addr & 15)) & 15) / sizeof(T));
  if (head > n) head = n;
  const int64_t nvec = (n - head) / E;
  int64_t blocks = (nvec + int64_t(kThreads) * kUnroll - 1) / (int64_t(kThreads) * kUnroll);
  if (blocks < 1) blocks = 1;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  scale_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(static_cast<T*>(grad), n,
                                                                      head, nvec, scale);
  return launch_check("fce_scale_gradient", "scale_kernel");
}

}  // namespace
}  // namespace cuda

fce_status cuda_scale_gradient(int dtype, int64_t count, void* grad, const float* scale,
                               void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case FCE_FLOAT16: return cuda::launch<__half>(grad, count, scale, s);
    case FCE_BFLOAT16: return cuda::launch<__nv_bfloat16>(grad, count, scale, s);
    default: return cuda::launch<float>(grad, count, scale, s);
  }
}

}  // namespace fce
