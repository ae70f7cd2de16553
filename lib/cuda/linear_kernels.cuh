// linear_kernels.cuh — the small kernels of the fused linear + CE path (linear_kernels.cu):
// dtype conversions, the bias-add fallback, and deterministic bias-gradient column sums.
// Every launcher checks its launch and returns FCE_ERROR_CUDA through fce::fail on failure.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "internal.h"

namespace fce {
namespace cuda {

// dst[i] = float(src[i]) for i < n; src of dtype f32 / f16 / bf16.
fce_status launch_to_f32(const void* src, int src_dtype, float* dst, int64_t n, cudaStream_t s);

// z[r * ld + c] += bias[c] for r < rows, c < cols (the fallback when cuBLASLt cannot fuse it).
fce_status launch_add_bias_rows(float* z, int64_t rows, int64_t cols, int64_t ld,
                                const float* bias, cudaStream_t s);

// out[c] = cast(Σ_{r < rows} dz[r * ld + c]  (+ float(out[c]) when add_old)) for c < cols.
// Deterministic: every column is summed in one fixed order (8 interleaved partial sums over
// the rows, then added in order), no atomics. dz of dtype f32 / f16 / bf16; out f32 / f16 / bf16.
fce_status launch_column_sums(const void* dz, int dz_dtype, int64_t rows, int64_t cols,
                              int64_t ld, void* out, int out_dtype, bool add_old, cudaStream_t s);

// out[i] = cast(acc[i] (+ float(out[i]) when add_old)) for i < n: a float32 accumulator stored
// into the caller's gradient (one rounding).
fce_status launch_store_accumulator(const float* acc, void* out, int out_dtype, int64_t n,
                                    bool add_old, cudaStream_t s);

}  // namespace cuda
}  // namespace fce
