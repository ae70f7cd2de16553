// convert.h — the one kernel of libfusedce_nccl: the all-reduced float32 dloss/dh rounded once
// to the caller's 16-bit dtype (fusedce_nccl.cpp, fce_nccl_linear_ce).
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace fce_nccl {

// dst[i] = round-to-nearest-even(src[i]) for i < n, dtype FCE_FLOAT16 or FCE_BFLOAT16; enqueued
// on stream (asynchronous, graph-capturable). Returns the launch's error (cudaSuccess when
// n == 0: nothing is launched).
cudaError_t convert_f32(const float* src, void* dst, int dtype, int64_t n, cudaStream_t stream);

}  // namespace fce_nccl
