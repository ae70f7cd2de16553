// linear/kernels.cuh — the small kernels of the fused linear + CE path (linear/kernels.cu):
// a dtype conversion / copy, the bias-add fallback, and deterministic bias-gradient column sums.
// Every launcher checks its launch and returns FCE_ERROR_CUDA through fce::fail on failure, the
// message starting with `fn`, the public function (common/launch_check.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "internal.h"

namespace fce {
namespace cuda {

// dst[i] = cast(src[i]) for i < n; src and dst of dtype f32 / f16 / bf16 (the same dtype: a
// copy, bit for bit).
fce_status launch_convert(const char* fn, const void* src, int src_dtype, void* dst,
                          int dst_dtype, int64_t n, cudaStream_t s);

// z[r * ld + c] = cast(float(z[r * ld + c]) + float(bias[c])) for r < rows, c < cols; z and bias
// of dtype f32 / f16 / bf16 (the fallback when cuBLASLt cannot fuse the bias: for f16/bf16 z
// that is a second rounding, where the epilogue rounds once).
fce_status launch_add_bias_rows(const char* fn, void* z, int dtype, int64_t rows, int64_t cols,
                                int64_t ld, const void* bias, cudaStream_t s);

// out[c] = cast(Σ_{r < rows} dz[r * ld + c]  (+ float(out[c]) when add_old)) for c < cols.
// Deterministic: every column is summed in one fixed order (8 interleaved partial sums over
// the rows, then added in order), no atomics. dz of dtype f32 / f16 / bf16; out f32 / f16 / bf16.
fce_status launch_column_sums(const char* fn, const void* dz, int dz_dtype, int64_t rows,
                              int64_t cols, int64_t ld, void* out, int out_dtype, bool add_old,
                              cudaStream_t s);

// out[i] = cast(acc[i] (+ float(out[i]) when add_old)) for i < n: a float32 accumulator stored
// into the caller's gradient (one rounding).
fce_status launch_store_accumulator(const char* fn, const float* acc, void* out, int out_dtype,
                                    int64_t n, bool add_old, cudaStream_t s);

}  // namespace cuda
}  // namespace fce
