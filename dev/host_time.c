// host_time.c — the host time of one fce_forward call (enqueue only, the best of 5 loops of 200),
// at 64×512 and 4096×50257 bf16, loss only and with the gradient (dev/NOTES.md,
// "What bounds the remaining cells, and linear CE measured in turns"). Build: gcc -O2 -Iinclude -I/usr/local/cuda/include -o /tmp/host_time dev/host_time.c
// -Lbuild -lfusedce -L/usr/local/cuda/lib64 -lcudart; run with build/ on LD_LIBRARY_PATH.
// Arguments N V [N V …]: those shapes instead.
#include <stdio.h>
#include <time.h>
#include <cuda_runtime.h>
#include "fusedce.h"
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
#include <stdlib.h>
int main(int argc, char** argv) {
  long shapes[8][2] = {{64, 512}, {4096, 50257}};
  int ns = 2;
  if (argc >= 3) {
    ns = 0;
    for (int a = 1; a + 1 < argc && ns < 8; a += 2, ++ns) {
      shapes[ns][0] = atol(argv[a]);
      shapes[ns][1] = atol(argv[a + 1]);
    }
  }
  for (int si = 0; si < ns; ++si) {
    long N = shapes[si][0], V = shapes[si][1];
    void *z, *g, *ws; long long* y; float *loss, *lse;
    cudaMalloc(&z, N * V * 2); cudaMalloc(&g, N * V * 2); cudaMalloc((void**)&y, N * 8); cudaMemset(y, 0, N * 8); cudaMemset(z, 0, N * V * 2);
    cudaMalloc((void**)&loss, 4); cudaMalloc((void**)&lse, N * 4);
    fce_options o = FCE_OPTIONS_INIT; o.dtype = FCE_BFLOAT16;
    size_t wsb = 0; fce_forward_workspace_size(&o, N, V, &wsb); cudaMalloc(&ws, wsb > 16 ? wsb : 16);
    cudaStream_t s; cudaStreamCreate(&s);
    for (int mode = 0; mode < 2; ++mode) {
      for (int i = 0; i < 50; ++i) fce_forward(&o, N, V, z, y, loss, lse, NULL, mode ? g : NULL, NULL, NULL, ws, wsb, (void*)s);
      cudaStreamSynchronize(s);
      double best = 1e9;
      for (int r = 0; r < 5; ++r) {
        double t0 = now();
        for (int i = 0; i < 200; ++i) fce_forward(&o, N, V, z, y, loss, lse, NULL, mode ? g : NULL, NULL, NULL, ws, wsb, (void*)s);
        double t1 = now();
        cudaStreamSynchronize(s);
        if ((t1 - t0) / 200 < best) best = (t1 - t0) / 200;
      }
      printf("%ldx%ld fce_forward %s: %.1f us host per call\n", N, V, mode ? "with gradient" : "loss only", best);
    }
    cudaFree(z); cudaFree(g); cudaFree(y); cudaFree(loss); cudaFree(lse); cudaFree(ws);
  }
  return 0;
}
