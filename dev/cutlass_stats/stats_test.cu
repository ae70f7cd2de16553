// stats_test.cu — the prototype's check and timing (build.sh): per-row lse folded from the
// partials against a naive GEMM whose float32 sums are rounded to bf16 as the library rounds its
// logits (lse in float64), on three odd shapes; then the time of three benchmark shapes.
#include <cstdio>
#include <cstdlib>
#include <cstdarg>
#include <cmath>
#include <vector>
#include <cuda_bf16.h>
#include "stats_gemm.cuh"
namespace fce { namespace cuda { namespace linear { fce_status fail(fce_status s, const char* fmt, ...) { va_list ap; va_start(ap, fmt); vfprintf(stderr, fmt, ap); va_end(ap); fprintf(stderr, "\n"); return s; } } } }
using namespace fce::cuda::linear;
__global__ void ref_lse(const __nv_bfloat16* h, const __nv_bfloat16* W, int N, int V, int D, double* lse) {
  int r = blockIdx.x; if (r >= N) return;
  __shared__ double red[256];
  double m = -1e300, s = 0;  // per thread over its columns (two passes via recompute)
  // pass 1: max
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    float acc = 0; for (int d = 0; d < D; ++d) acc += __bfloat162float(h[(size_t)r*D+d]) * __bfloat162float(W[(size_t)v*D+d]);
    float z = __bfloat162float(__float2bfloat16_rn(acc)); m = fmax(m, (double)z);
  }
  red[threadIdx.x] = m; __syncthreads();
  for (int o = 128; o; o >>= 1) { if (threadIdx.x < o) red[threadIdx.x] = fmax(red[threadIdx.x], red[threadIdx.x+o]); __syncthreads(); }
  double M = red[0]; __syncthreads();
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    float acc = 0; for (int d = 0; d < D; ++d) acc += __bfloat162float(h[(size_t)r*D+d]) * __bfloat162float(W[(size_t)v*D+d]);
    float z = __bfloat162float(__float2bfloat16_rn(acc)); s += exp((double)z - M);
  }
  red[threadIdx.x] = s; __syncthreads();
  for (int o = 128; o; o >>= 1) { if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x+o]; __syncthreads(); }
  if (threadIdx.x == 0) lse[r] = M + log(red[0]);
}
__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned x = (unsigned)(i * 2654435761u) ^ seed; x ^= x >> 13; x *= 0x5bd1e995; x ^= x >> 15;
    p[i] = __float2bfloat16(((x & 0xffffff) / 16777216.0f - 0.5f) * scale);
  }
}
int run(int N, int V, int D, bool check, int reps) {
  __nv_bfloat16 *h, *W; cudaMalloc(&h, (size_t)N*D*2); cudaMalloc(&W, (size_t)V*D*2);
  fill<<<1024,256>>>(h, (size_t)N*D, 1, 4.f); fill<<<1024,256>>>(W, (size_t)V*D, 2, 4.f / sqrtf((float)D) * 3.f);
  size_t pb = stats_partials_bytes(N, V); void* part; cudaMalloc(&part, pb); cudaMemset(part, 0xff, pb);
  int dev = 0, sms = 0; cudaGetDevice(&dev); cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  Sm90StatsArgs a{"stats_test", FCE_BFLOAT16, N, V, D, h, D, W, D, part, nullptr, 0, dev, sms};
  size_t wsb = sm90_stats_gemm_workspace(a); void* ws = nullptr; if (wsb) cudaMalloc(&ws, wsb);
  a.gemm_workspace = ws; a.gemm_workspace_bytes = wsb;
  if (sm90_stats_gemm(a, 0) != FCE_SUCCESS) { printf("launch failed\n"); return 1; }
  cudaError_t e = cudaDeviceSynchronize(); if (e) { printf("error %s\n", cudaGetErrorString(e)); return 1; }
  int bad = 0; double maxerr = 0;
  if (check) {
    double* lse; cudaMalloc(&lse, N * 8); ref_lse<<<N, 256>>>(h, W, N, V, D, lse); cudaDeviceSynchronize();
    std::vector<double> ref(N); cudaMemcpy(ref.data(), lse, N*8, cudaMemcpyDeviceToHost);
    int64_t T = stats_tiles(V), Mp = stats_rows_padded(N);
    std::vector<float2> p((size_t)T * Mp); cudaMemcpy(p.data(), part, pb, cudaMemcpyDeviceToHost);
    for (int r = 0; r < N; ++r) {
      double m = -1e300, s = 0;
      for (int64_t t = 0; t < T; ++t) { float2 q = p[t * Mp + r]; if (q.y == 0) continue; double nm = fmax(m, q.x); s = s * exp(m - nm) + q.y * exp(q.x - nm); m = nm; }
      double l = m + log(s), err = fabs(l - ref[r]);
      if (!(err <= 2e-3 * fmax(1.0, fabs(ref[r])))) { if (bad++ < 5) printf("row %d: lse %.6f ref %.6f\n", r, l, ref[r]); }
      maxerr = fmax(maxerr, err);
    }
    printf("%dx%dx%d: %d bad rows, max |lse err| %.3g (tiles %lld, ws %zu)\n", N, V, D, bad, maxerr, (long long)T, wsb);
    cudaFree(lse);
  }
  if (reps) {
    cudaEvent_t s0, s1; cudaEventCreate(&s0); cudaEventCreate(&s1);
    for (int i = 0; i < 3; ++i) sm90_stats_gemm(a, 0);
    cudaEventRecord(s0); for (int i = 0; i < reps; ++i) sm90_stats_gemm(a, 0); cudaEventRecord(s1); cudaEventSynchronize(s1);
    float ms; cudaEventElapsedTime(&ms, s0, s1); ms /= reps;
    printf("%dx%dx%d: %.3f ms, %.1f TFLOP/s\n", N, V, D, ms, 2.0 * N * V * D / (ms * 1e-3) / 1e12);
  }
  cudaFree(h); cudaFree(W); cudaFree(part); if (ws) cudaFree(ws);
  return bad != 0;
}
int main() {
  int f = 0;
  f |= run(1000, 10007, 512, true, 0);
  f |= run(256, 32000, 4096, true, 0);
  f |= run(300, 1000, 64, true, 0);
  f |= run(8192, 128256, 4096, false, 10);
  f |= run(4096, 128256, 4096, false, 10);
  f |= run(8192, 256000, 2304, false, 10);
  return f;
}
