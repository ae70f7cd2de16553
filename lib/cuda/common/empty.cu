// common/empty.cu — the CUDA backend's part of an empty problem (rows = 0, docs/semantics.md "Zero
// rows"): the ABI layer has checked every argument and the device pointers, and what the call
// writes is zero bytes over a few spans of the caller's outputs (the reduced loss, z_loss and
// accuracy: 0.0f; grad_weight and grad_bias without accumulate). One kernel on the caller's
// stream writes all of them, so the call stays asynchronous and graph-capturable as every other
// (cudaMemsetAsync is not used: the spans may be any memory a kernel can write, mapped pinned or
// pageable host memory included, which is what cuda_check_pointers accepts).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/launch_check.cuh"
#include "internal.h"

namespace fce {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 132 * 8;  // grid-stride beyond this

struct Spans {
  uint16_t* ptr[kMaxZeroSpans];  // every span 2-byte aligned, an even number of bytes
  int64_t head[kMaxZeroSpans];   // 16-bit words before the first 16-byte aligned one
  int64_t nvec[kMaxZeroSpans];   // 16-byte vectors from there
  int64_t n[kMaxZeroSpans];      // 16-bit words in all
  int count;
};

// Span by span, every thread of the grid: its 16-byte aligned middle as vectors, the words
// before and after it one by one.
__global__ void __launch_bounds__(kThreads) zero_kernel(const Spans s) {
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nt = int64_t(gridDim.x) * blockDim.x;
  for (int k = 0; k < s.count; ++k) {
    uint16_t* p = s.ptr[k];
    uint4* v = reinterpret_cast<uint4*>(p + s.head[k]);
    for (int64_t i = tid; i < s.nvec[k]; i += nt) v[i] = make_uint4(0u, 0u, 0u, 0u);
    const int64_t tail = s.head[k] + s.nvec[k] * 8;
    for (int64_t i = tid; i < s.head[k] + (s.n[k] - tail); i += nt)
      p[i < s.head[k] ? i : tail + (i - s.head[k])] = 0;
  }
}

}  // namespace
}  // namespace cuda

fce_status cuda_write_zeros(const char* fn, const ZeroSpan* spans, int count, void* stream) {
  cuda::Spans s{};
  int64_t most = 0;
  for (int k = 0; k < count && k < kMaxZeroSpans; ++k) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(spans[k].ptr);
    const int64_t n = static_cast<int64_t>(spans[k].bytes / 2);
    int64_t head = static_cast<int64_t>(((16 - (addr & 15)) & 15) / 2);
    if (head > n) head = n;
    s.ptr[k] = static_cast<uint16_t*>(spans[k].ptr);
    s.head[k] = head;
    s.nvec[k] = (n - head) / 8;
    s.n[k] = n;
    s.count = k + 1;
    most = s.nvec[k] > most ? s.nvec[k] : most;
  }
  int64_t blocks = (most + cuda::kThreads - 1) / cuda::kThreads;
  if (blocks < 1) blocks = 1;
  if (blocks > cuda::kMaxBlocks) blocks = cuda::kMaxBlocks;
  cuda::zero_kernel<<<static_cast<unsigned>(blocks), cuda::kThreads, 0,
                      static_cast<cudaStream_t>(stream)>>>(s);
  return cuda::launch_check(fn, "zero_kernel");
}

}  // namespace fce
