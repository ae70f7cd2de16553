// Per-CTA %globaltimer timeline of two copies of N rows of 64 KB (dev/NOTES.md,
// "What the remaining targets ask, measured"), to compare with the register kernel's (probe.py): each CTA of 512 threads
// copies one row, either
//   rowwise: every thread loads its 8 vectors of 16 bytes, then stores them (the register
//            kernel's shape without the fold: nothing is written until the row is read), or
//   stream:  every thread loads and stores one vector at a time (a plain copy), or
//   barrier: rowwise with a CTA barrier (__syncthreads) between the loads and the stores, as a
//            row's gradient waits for the whole row (the register kernel's fold and exchange).
// Prints, like probe.py, the span and the bandwidth per 4 µs (each CTA's bytes spread over its
// life). A 256 MB fill runs before each timed launch, as triton's do_bench does.
//   nvcc -O3 -arch=sm_90 -o copy_timeline copy_timeline.cu && ./copy_timeline 4096
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#define CHECK(x)                                                                           \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

constexpr int kThreads = 512, kVpt = 8;  // 512 × 8 × 16 B = 64 KB per row

__device__ __forceinline__ unsigned long long gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

template <bool ROWWISE, bool BARRIER>
__global__ void __launch_bounds__(kThreads, 2) copy_rows(const uint4* src, uint4* dst,
                                                          unsigned long long* stamps) {
  if (threadIdx.x == 0) stamps[blockIdx.x * 2] = gtime();
  const size_t base = size_t(blockIdx.x) * kThreads * kVpt + threadIdx.x;
  if (ROWWISE) {
    uint4 v[kVpt];
#pragma unroll
    for (int i = 0; i < kVpt; ++i) v[i] = __ldcs(src + base + i * kThreads);
    if (BARRIER) {  // every thread's loads complete (the values used) before any store
      unsigned x = 0;
#pragma unroll
      for (int i = 0; i < kVpt; ++i) x ^= v[i].x ^ v[i].w;
      __syncthreads();
      if (x == 0x12345678u && threadIdx.x == 9999) stamps[0] = 0;  // keeps x live
    }
#pragma unroll
    for (int i = 0; i < kVpt; ++i) __stcs(dst + base + i * kThreads, v[i]);
  } else {
#pragma unroll 1
    for (int i = 0; i < kVpt; ++i) __stcs(dst + base + i * kThreads, __ldcs(src + base + i * kThreads));
  }
  __syncthreads();
  if (threadIdx.x == 0) stamps[blockIdx.x * 2 + 1] = gtime();
}

int main(int argc, char** argv) {
  const int rows = argc > 1 ? std::atoi(argv[1]) : 4096;
  const size_t row_bytes = size_t(kThreads) * kVpt * 16, bytes = row_bytes * rows;
  uint4 *src, *dst;
  unsigned char* fill;
  unsigned long long* stamps;
  CHECK(cudaMalloc(&src, bytes));
  CHECK(cudaMalloc(&dst, bytes));
  CHECK(cudaMalloc(&fill, size_t(256) << 20));
  CHECK(cudaMalloc(&stamps, size_t(rows) * 2 * sizeof(unsigned long long)));
  CHECK(cudaMemset(src, 1, bytes));
  std::vector<unsigned long long> h(size_t(rows) * 2);
  for (int variant = 0; variant < 3; ++variant) {
    for (int rep = 0; rep < 4; ++rep) {
      CHECK(cudaMemsetAsync(fill, rep, size_t(256) << 20));
      if (variant == 0)
        copy_rows<true, false><<<rows, kThreads>>>(src, dst, stamps);
      else if (variant == 1)
        copy_rows<false, false><<<rows, kThreads>>>(src, dst, stamps);
      else
        copy_rows<true, true><<<rows, kThreads>>>(src, dst, stamps);
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
    }
    CHECK(cudaMemcpy(h.data(), stamps, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
    unsigned long long t0 = ~0ull, t1 = 0;
    for (int r = 0; r < rows; ++r) {
      t0 = h[2 * r] < t0 ? h[2 * r] : t0;
      t1 = h[2 * r + 1] > t1 ? h[2 * r + 1] : t1;
    }
    const double span = (t1 - t0) / 1e3, ideal = 2.0 * bytes / 3.03e12 * 1e6;
    const int nb = int(span / 4) + 1;
    std::vector<double> b(nb, 0.0);
    for (int r = 0; r < rows; ++r) {
      const double a = (h[2 * r] - t0) / 1e3, e = (h[2 * r + 1] - t0) / 1e3 > a + 1e-3 ? (h[2 * r + 1] - t0) / 1e3 : a + 1e-3;
      for (int i = int(a / 4); i <= int(e / 4) && i < nb; ++i) {
        const double lo = a > i * 4 ? a : i * 4, hi = e < i * 4 + 4 ? e : i * 4 + 4;
        if (hi > lo) b[i] += 2.0 * row_bytes * (hi - lo) / (e - a);
      }
    }
    std::printf("%s %d rows of 64 KB: span %.1f us (ideal %.1f)\n   TB/s per 4 us:",
                variant == 0 ? "rowwise" : variant == 1 ? "stream " : "barrier",
                rows, span, ideal);
    for (int i = 0; i < nb; ++i) std::printf(" %.2f", b[i] / 4e-6 / 1e12);
    std::printf("\n");
  }
  return 0;
}
