// convert.cu — float32 -> float16 / bfloat16, round to nearest even (NaN stays NaN, overflow
// gives inf): the all-reduced dloss/dh of fce_nccl_linear_ce written in the caller's dtype.
// Memory-bound: 4 elements per thread and step when the destination is 8-byte aligned (the
// float32 source is a 256-byte aligned workspace slice), a grid-stride loop, 64-bit indices.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "convert.h"
#include "fusedce.h"

namespace fce_nccl {
namespace {

template <class T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <class T> struct alignas(8) Four { T a, b, c, d; };

// 4 elements per step: one 16-byte load, one 8-byte store.
template <class T>
__global__ void convert_vec4(const float4* __restrict__ src, T* __restrict__ dst, int64_t nvec,
                             const float* __restrict__ tail_src, T* __restrict__ tail_dst,
                             int tail) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < tail) tail_dst[i] = from_f32<T>(tail_src[i]);
  for (; i < nvec; i += stride) {
    const float4 v = src[i];
    Four<T> out;
    out.a = from_f32<T>(v.x);
    out.b = from_f32<T>(v.y);
    out.c = from_f32<T>(v.z);
    out.d = from_f32<T>(v.w);
    reinterpret_cast<Four<T>*>(dst)[i] = out;
  }
}

template <class T>
__global__ void convert_scalar(const float* __restrict__ src, T* __restrict__ dst, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    dst[i] = from_f32<T>(src[i]);
}

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond: enough to fill any current GPU

int blocks_for(int64_t work) {
  int64_t b = (work + kThreads - 1) / kThreads;
  if (b < 1) b = 1;
  return static_cast<int>(b < kMaxBlocks ? b : kMaxBlocks);
}

template <class T>
void launch(const float* src, void* dst_v, int64_t n, cudaStream_t stream) {
  T* dst = static_cast<T*>(dst_v);
  const bool vec = reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(dst) % 8 == 0;
  if (vec) {
    const int64_t nvec = n / 4;
    const int tail = static_cast<int>(n - nvec * 4);
    convert_vec4<T><<<blocks_for(nvec > tail ? nvec : tail), kThreads, 0, stream>>>(
        reinterpret_cast<const float4*>(src), dst, nvec, src + nvec * 4, dst + nvec * 4, tail);
  } else {
    convert_scalar<T><<<blocks_for(n), kThreads, 0, stream>>>(src, dst, n);
  }
}

}  // namespace

cudaError_t convert_f32(const float* src, void* dst, int dtype, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  (void)cudaGetLastError();  // a stale error of this runtime is not this launch's
  if (dtype == FCE_FLOAT16)
    launch<__half>(src, dst, n, stream);
  else if (dtype == FCE_BFLOAT16)
    launch<__nv_bfloat16>(src, dst, n, stream);
  else
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}

}  // namespace fce_nccl
