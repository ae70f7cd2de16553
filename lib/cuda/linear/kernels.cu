// linear/kernels.cu — the small memory-bound kernels around the GEMMs of fce_linear_ce:
// the bias copy into the workspace, the bias-add fallback, bias-gradient column sums (fixed
// order, no atomics: bitwise deterministic), and the store of a float32 accumulator into an
// f16/bf16 gradient.
// All are grid-stride loops with 64-bit indices; none is on the critical path (≤ a few % of the
// GEMM time at D ≥ 1024).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/common/launch_check.cuh"
#include "cuda/linear/kernels.cuh"

namespace fce {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;

__device__ __forceinline__ float load_as_float(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case FCE_FLOAT16: return __half2float(static_cast<const __half*>(p)[i]);
    case FCE_BFLOAT16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void store_from_float(void* p, int dtype, int64_t i, float v) {
  switch (dtype) {
    case FCE_FLOAT16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case FCE_BFLOAT16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

unsigned grid_for(int64_t n) {
  int64_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  if (blocks < 1) blocks = 1;
  return static_cast<unsigned>(blocks);
}

// f16/bf16 → float → the same f16/bf16 is exact, so a same-dtype convert is a bit copy.
__global__ void convert_kernel(const void* src, int src_dtype, void* dst, int dst_dtype,
                               int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    store_from_float(dst, dst_dtype, i, load_as_float(src, src_dtype, i));
}

__global__ void add_bias_rows_kernel(void* z, int dtype, int64_t rows, int64_t cols, int64_t ld,
                                     const void* bias) {
  const int64_t n = rows * cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t r = i / cols, c = i - r * cols;
    const int64_t at = r * ld + c;
    store_from_float(z, dtype, at, load_as_float(z, dtype, at) + load_as_float(bias, dtype, c));
  }
}

// Block (32, kRowGroups): threadIdx.x picks the column, threadIdx.y the row group; thread
// (x, y) sums rows y, y + kRowGroups, ... in order; then row 0 adds the kRowGroups partials in
// order. The order depends only on rows: deterministic.
constexpr int kColTile = 32, kRowGroups = 8;
__global__ void column_sums_kernel(const void* dz, int dz_dtype, int64_t rows, int64_t cols,
                                   int64_t ld, void* out, int out_dtype, bool add_old) {
  __shared__ float partial[kRowGroups][kColTile + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  float sum = 0.f;
  if (c < cols) {
    for (int64_t r = threadIdx.y; r < rows; r += kRowGroups) sum += load_as_float(dz, dz_dtype, r * ld + c);
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = partial[0][threadIdx.x];
    for (int g = 1; g < kRowGroups; ++g) total += partial[g][threadIdx.x];
    if (add_old) total += load_as_float(out, out_dtype, c);
    store_from_float(out, out_dtype, c, total);
  }
}

__global__ void store_accumulator_kernel(const float* acc, void* out, int out_dtype, int64_t n,
                                         bool add_old) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    float v = acc[i];
    if (add_old) v += load_as_float(out, out_dtype, i);
    store_from_float(out, out_dtype, i, v);
  }
}

}  // namespace

fce_status launch_convert(const char* fn, const void* src, int src_dtype, void* dst,
                          int dst_dtype, int64_t n, cudaStream_t s) {
  if (n <= 0) return FCE_SUCCESS;
  convert_kernel<<<grid_for(n), kThreads, 0, s>>>(src, src_dtype, dst, dst_dtype, n);
  return launch_check(fn, "convert_kernel");
}

fce_status launch_add_bias_rows(const char* fn, void* z, int dtype, int64_t rows, int64_t cols,
                                int64_t ld, const void* bias, cudaStream_t s) {
  if (rows <= 0 || cols <= 0) return FCE_SUCCESS;
  add_bias_rows_kernel<<<grid_for(rows * cols), kThreads, 0, s>>>(z, dtype, rows, cols, ld, bias);
  return launch_check(fn, "add_bias_rows_kernel");
}

fce_status launch_column_sums(const char* fn, const void* dz, int dz_dtype, int64_t rows,
                              int64_t cols, int64_t ld, void* out, int out_dtype, bool add_old,
                              cudaStream_t s) {
  if (cols <= 0) return FCE_SUCCESS;
  const int64_t blocks = (cols + kColTile - 1) / kColTile;  // cols < 2^31: fits a grid.x
  column_sums_kernel<<<static_cast<unsigned>(blocks), dim3(kColTile, kRowGroups), 0, s>>>(
      dz, dz_dtype, rows, cols, ld, out, out_dtype, add_old);
  return launch_check(fn, "column_sums_kernel");
}

fce_status launch_store_accumulator(const char* fn, const float* acc, void* out, int out_dtype,
                                    int64_t n, bool add_old, cudaStream_t s) {
  if (n <= 0) return FCE_SUCCESS;
  store_accumulator_kernel<<<grid_for(n), kThreads, 0, s>>>(acc, out, out_dtype, n, add_old);
  return launch_check(fn, "store_accumulator_kernel");
}

}  // namespace cuda
}  // namespace fce
