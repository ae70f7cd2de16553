// tma_align.cu — does a bulk copy's (cp.async.bulk, the TMA engine) global address modulo 128
// bytes decide how fast it streams? A probe, not part of the library.
//
// ce_rows_bulk_kernel copies each row's whole 16-byte vectors in chunks of 64 KB from the row's
// first whole vector; measured (dev/NOTES.md, run 12 of the tuning of 2026-11-24) rows whose starts
// are 16-byte but not 128-byte aligned ran 6-9 points of copy slower (forward only,
// 32768×32000 bf16 stored 33000 apart: 87.2 % against 96.4 %). This kernel does only what the
// bulk kernel's ring does (one producer lane, 3 stages of 64 KB, 8 consumer warps that read
// each stage from shared memory and release it), over rows of R bytes stored R apart, with
// the shared-memory destination either at the stage's start (as the library does) or at the
// same offset modulo 128 as the source ("congruent"), or with the row split at its first
// 128-byte boundary into two copies ("split").
//   nvcc -O3 -arch=sm_90 -std=c++17 -o tma_align tma_align.cu && ./tma_align
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

constexpr int kStages = 3, kChunk = 64 << 10, kSlack = 128, kConsumerWarps = 8;
constexpr int kThreads = 32 * (1 + kConsumerWarps);

__device__ __forceinline__ uint32_t sa(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(sa(bar)), "r"(parity) : "memory");
  } while (!done);
}

// mode 0: destination at the stage's start; 1: congruent modulo 128; 2: split at the first
// 128-byte boundary (two copies into one stage, the destination congruent too)
__global__ void __launch_bounds__(kThreads, 1)
stream_rows(const char* base, int64_t rows, int64_t row_bytes, int mode, unsigned long long* sink) {
  __shared__ uint64_t full[kStages], empty[kStages];
  __shared__ int64_t st_off[kStages], st_len[kStages];
  extern __shared__ __align__(128) char ring[];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&full[s])));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(&empty[s])), "r"(kConsumerWarps));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  if (warp == 0) {
    if (lane == 0) {
      uint32_t it = 0;
      for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const uintptr_t a = reinterpret_cast<uintptr_t>(base + r * row_bytes);
        const uintptr_t b = (a + 15) & ~uintptr_t(15), e = (a + row_bytes) & ~uintptr_t(15);
        for (uintptr_t c = b; c < e; c += kChunk) {
          const uint32_t len = static_cast<uint32_t>(e - c < kChunk ? e - c : kChunk);
          const int s = it % kStages;
          if (it >= kStages) wait(&empty[s], ((it / kStages) - 1) & 1);
          const int off = mode == 0 ? 0 : static_cast<int>(c & 127);
          st_off[s] = off;
          st_len[s] = len;
          char* dst = ring + size_t(s) * (kChunk + kSlack) + off;
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(&full[s])),
                       "r"(len) : "memory");
          uint32_t first = len;
          if (mode == 2 && (c & 127)) {
            first = static_cast<uint32_t>(128 - (c & 127));
            if (first > len) first = len;
          }
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                       ::"r"(sa(dst)), "l"(c), "r"(first), "r"(sa(&full[s])) : "memory");
          if (first < len)
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         ::"r"(sa(dst + first)), "l"(c + first), "r"(len - first), "r"(sa(&full[s])) : "memory");
          ++it;
        }
      }
      // the end: a stage of length −1
      const int s = it % kStages;
      if (it >= kStages) wait(&empty[s], ((it / kStages) - 1) & 1);
      st_len[s] = -1;
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(&full[s])) : "memory");
    }
    return;
  }
  unsigned long long acc = 0;
  const int ct = threadIdx.x - 32;
  for (uint32_t it = 0;; ++it) {
    const int s = it % kStages;
    wait(&full[s], (it / kStages) & 1);
    const int64_t len = st_len[s];
    if (len < 0) break;
    const uint4* v = reinterpret_cast<const uint4*>(ring + size_t(s) * (kChunk + kSlack) + st_off[s]);
    for (int i = ct; i < len / 16; i += 32 * kConsumerWarps) {
      const uint4 x = v[i];
      acc += x.x ^ x.y ^ x.z ^ x.w;
    }
    __syncwarp();
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(&empty[s])) : "memory");
  }
  if (acc == 0x123456789ull) *sink = acc;  // keeps the reads
}

// the same rows read with 16-byte loads by many CTAs (one row per CTA, 512 threads)
__global__ void read_rows(const char* base, int64_t row_bytes, unsigned long long* sink) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(base + int64_t(blockIdx.x) * row_bytes);
  const uint4* b = reinterpret_cast<const uint4*>((a + 15) & ~uintptr_t(15));
  const int64_t n = (int64_t((a + row_bytes) & ~uintptr_t(15)) - int64_t(reinterpret_cast<uintptr_t>(b))) / 16;
  unsigned long long acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const uint4 x = __ldcs(b + i);
    acc += x.x ^ x.y ^ x.z ^ x.w;
  }
  if (acc == 0x123456789ull) *sink = acc;
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const size_t total = size_t(1700) << 20;
  char* buf;
  unsigned long long* sink;
  if (cudaMalloc(&buf, total + 4096) != cudaSuccess || cudaMalloc(&sink, 8) != cudaSuccess) return 1;
  cudaMemset(buf, 1, total + 4096);
  const int smem = kStages * (kChunk + kSlack);
  cudaFuncSetAttribute(stream_rows, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  // (row bytes, base offset): 50257 bf16 dense (rows at 2-byte offsets), stored 50264 apart
  // (16-byte aligned, 48 mod 128), 51200 apart (128-byte aligned); 32000 bf16 dense / 33000
  // apart; 50257 float32 dense
  const int64_t shapes[] = {100514, 100528, 102400, 64000, 66000, 201028};
  const char* names[] = {"dest at stage start", "dest congruent mod 128", "split at 128 B"};
  printf("rows of R bytes stored R apart, ~1.7 GB per pass; GB/s of the rows' bytes (median of 9)\n");
  for (int64_t R : shapes) {
    const int64_t rows = int64_t(total) / R;
    auto time = [&](auto launch) {
      float t[9];
      launch();
      for (int i = 0; i < 9; ++i) {
        cudaEventRecord(e0);
        launch();
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        cudaEventElapsedTime(&t[i], e0, e1);
      }
      for (int i = 0; i < 9; ++i)
        for (int j = i + 1; j < 9; ++j)
          if (t[j] < t[i]) { float x = t[i]; t[i] = t[j]; t[j] = x; }
      return double(rows) * R / (t[4] * 1e-3) / 1e9;
    };
    printf("R = %lld (%lld rows)", (long long)R, (long long)rows);
    for (int mode = 0; mode < 3; ++mode)
      printf(" | %s %.0f", names[mode],
             time([&] { stream_rows<<<sms, kThreads, smem>>>(buf, rows, R, mode, sink); }));
    printf(" | 16-byte loads %.0f\n", time([&] { read_rows<<<rows, 512>>>(buf, R, sink); }));
  }
  cudaError_t err = cudaDeviceSynchronize();
  printf("%s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
