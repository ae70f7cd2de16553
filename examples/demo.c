/* demo.c — `make demo`: cross-entropy loss + gradient on realistic sizes, then the fused
 * linear + cross-entropy, on the GPU when there is one and on the CPU otherwise. Prints what it
 * computed, how long it took, and the memory the unfused way would have needed.
 *   build/examples/demo            GPU if available, else CPU
 *   build/examples/demo --cpu      force the CPU backend
 *   build/examples/demo --small    small sizes (what `make test` runs)
 */
#include <fusedce.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(FCE_DEMO_CUDA)
#include <cuda_runtime.h>
#endif

#define CHECK(call)                                                                   \
  do {                                                                                \
    fce_status s_ = (call);                                                           \
    if (s_ != FCE_SUCCESS) {                                                          \
      fprintf(stderr, "%s failed: %s\n  %s\n", #call, fce_status_string(s_),         \
              fce_last_error());                                                      \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

static int g_gpu = 0;

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static float uniform(void) { /* xorshift64*, in [0, 1) */
  g_rng ^= g_rng >> 12; g_rng ^= g_rng << 25; g_rng ^= g_rng >> 27;
  return (float)((g_rng * 2685821657736338717ull) >> 40) / (float)(1 << 24);
}
static float normal(void) {
  float u = uniform() + 1e-7f, v = uniform();
  return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}
static uint16_t to_bf16(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* Buffers live on the device for the GPU run and on the host for the CPU run. */
static void* alloc(size_t bytes) {
#if defined(FCE_DEMO_CUDA)
  if (g_gpu) {
    void* p = NULL;
    if (cudaMalloc(&p, bytes) != cudaSuccess) { fprintf(stderr, "cudaMalloc(%zu) failed\n", bytes); exit(1); }
    return p;
  }
#endif
  void* p = malloc(bytes ? bytes : 1);
  if (!p) { fprintf(stderr, "malloc(%zu) failed\n", bytes); exit(1); }
  return p;
}
static void release(void* p) {
#if defined(FCE_DEMO_CUDA)
  if (g_gpu) { cudaFree(p); return; }
#endif
  free(p);
}
static void upload(void* dst, const void* src, size_t bytes) {
#if defined(FCE_DEMO_CUDA)
  if (g_gpu) { cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice); return; }
#endif
  memcpy(dst, src, bytes);
}
static void download(void* dst, const void* src, size_t bytes) {
#if defined(FCE_DEMO_CUDA)
  if (g_gpu) { cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost); return; }
#endif
  memcpy(dst, src, bytes);
}
static void sync(void) {
#if defined(FCE_DEMO_CUDA)
  if (g_gpu) cudaDeviceSynchronize();
#endif
}

/* Fills a [rows, cols] matrix of `esize`-byte elements with N(0, sd) values: `pattern` random
 * rows generated on the host, repeated (generating gigabytes on the host would take longer
 * than the demo itself). */
static void fill(void* dst, int64_t rows, int64_t cols, int esize, float sd) {
  const int64_t pattern = rows < 64 ? rows : 64;
  unsigned char* host = malloc((size_t)(pattern * cols * esize));
  for (int64_t i = 0; i < pattern * cols; ++i) {
    float v = sd * normal();
    if (esize == 2) { uint16_t b = to_bf16(v); memcpy(host + i * 2, &b, 2); }
    else memcpy(host + i * 4, &v, 4);
  }
  for (int64_t r = 0; r < rows; r += pattern) {
    int64_t n = rows - r < pattern ? rows - r : pattern;
    upload((unsigned char*)dst + r * cols * esize, host, (size_t)(n * cols * esize));
  }
  free(host);
}

static void demo_cross_entropy(int64_t N, int64_t V, int dtype) {
  const int esize = dtype == FCE_FLOAT32 ? 4 : 2;
  fce_options opt = FCE_OPTIONS_INIT;
  opt.backend = g_gpu ? FCE_BACKEND_CUDA : FCE_BACKEND_CPU;
  opt.dtype = dtype;
  opt.target_dtype = FCE_INT64;

  void* logits = alloc((size_t)(N * V * esize));
  fill(logits, N, V, esize, 4.0f);
  int64_t* y_host = malloc((size_t)N * 8);
  for (int64_t i = 0; i < N; ++i) y_host[i] = (i % 17 == 0) ? -100 : (int64_t)(uniform() * V) % V;
  void* targets = alloc((size_t)N * 8);
  upload(targets, y_host, (size_t)N * 8);
  float* loss = alloc(4);
  float* lse = alloc((size_t)N * 4);
  size_t ws_bytes = 0;
  CHECK(fce_forward_workspace_size(&opt, N, V, &ws_bytes));
  void* ws = ws_bytes ? alloc(ws_bytes) : NULL;

  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss;
  out.lse = lse;
  fce_gradients grads = FCE_GRADIENTS_INIT;
  grads.grad_logits = logits; /* the gradient written in place over the logits */

  /* Warm up (the loss only), then time loss + gradient in one pass. */
  CHECK(fce_forward(&opt, N, V, logits, targets, &out, NULL, ws, ws_bytes, NULL));
  sync();
  double t0 = now_ms();
  CHECK(fce_forward(&opt, N, V, logits, targets, &out, &grads, ws, ws_bytes, NULL));
  sync();
  double ms = now_ms() - t0;
  float loss_host = 0;
  download(&loss_host, loss, 4);

  const double gib = 1024.0 * 1024.0 * 1024.0;
  const double logits_gib = (double)N * V * esize / gib;
  printf("cross-entropy  N=%lld V=%lld %s (%s)\n", (long long)N, (long long)V,
         dtype == FCE_FLOAT32 ? "float32" : "bfloat16", g_gpu ? "CUDA" : "CPU");
  printf("  loss (mean over non-ignored rows) = %.5f   for scale: log(V) + sd^2/2 = %.2f\n",
         loss_host, log((double)V) + 8.0);
  printf("  loss + gradient in place, one pass: %.2f ms  (%.0f GB/s over %.2f GiB read + written)\n",
         ms, 2.0 * logits_gib * gib / (ms * 1e6), 2.0 * logits_gib);
  printf("  extra memory: %.2f MiB workspace; the unfused way (torch eager on .float()) holds\n"
         "  float32 logits, softmax and gradient: about %.1f GiB more\n",
         ws_bytes / 1048576.0, (double)N * V * 4 * 3 / gib);
  release(logits); release(targets); release(loss); release(lse);
  if (ws) release(ws);
  free(y_host);
}

static void demo_linear_ce(int64_t N, int64_t D, int64_t V, int dtype) {
  const int esize = dtype == FCE_FLOAT32 ? 4 : 2;
  fce_options opt = FCE_OPTIONS_INIT;
  opt.backend = g_gpu ? FCE_BACKEND_CUDA : FCE_BACKEND_CPU;
  opt.dtype = dtype;
  opt.grad_weight_fp32 = 1; /* float32 dW, as an optimizer's master weights want */

  void* h = alloc((size_t)(N * D * esize));
  void* W = alloc((size_t)(V * D * esize));
  fill(h, N, D, esize, 1.0f);
  fill(W, V, D, esize, 1.0f / sqrtf((float)D) * 3.0f);
  int64_t* y_host = malloc((size_t)N * 8);
  for (int64_t i = 0; i < N; ++i) y_host[i] = (int64_t)(uniform() * V) % V;
  void* targets = alloc((size_t)N * 8);
  upload(targets, y_host, (size_t)N * 8);
  float* loss = alloc(4);
  void* dh = alloc((size_t)(N * D * esize));
  float* dW = alloc((size_t)(V * D * 4));
  size_t ws_min = 0, ws_opt = 0;
  CHECK(fce_linear_ce_workspace_size(&opt, N, D, V, 1, &ws_min, &ws_opt));
  void* ws = ws_opt ? alloc(ws_opt) : NULL;

  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss;
  fce_gradients grads = FCE_GRADIENTS_INIT;
  grads.grad_hidden = dh;
  grads.grad_weight = dW;
  CHECK(fce_linear_ce(&opt, N, D, V, h, W, NULL, targets, &out, &grads, ws, ws_opt, NULL));
  sync();
  double t0 = now_ms();
  CHECK(fce_linear_ce(&opt, N, D, V, h, W, NULL, targets, &out, &grads, ws, ws_opt, NULL));
  sync();
  double ms = now_ms() - t0;
  float loss_host = 0;
  download(&loss_host, loss, 4);
  const double flops = 6.0 * N * D * V;
  printf("linear + cross-entropy  N=%lld D=%lld V=%lld %s (%s)\n", (long long)N, (long long)D,
         (long long)V, dtype == FCE_FLOAT32 ? "float32" : "bfloat16", g_gpu ? "CUDA" : "CPU");
  printf("  loss = %.5f; loss + dL/dh + dL/dW: %.2f ms (%.1f TFLOP/s of 6*N*D*V)\n", loss_host, ms,
         flops / (ms * 1e9));
  printf("  workspace: %.1f MiB (minimum %.1f MiB); the unfused way holds the %.2f GiB of\n"
         "  logits and as much again for their gradient\n",
         ws_opt / 1048576.0, ws_min / 1048576.0, (double)N * V * esize / (1024.0 * 1024.0 * 1024.0));
  release(h); release(W); release(targets); release(loss); release(dh); release(dW);
  if (ws) release(ws);
  free(y_host);
}

int main(int argc, char** argv) {
  int force_cpu = 0, small = 0;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--cpu")) force_cpu = 1;
    else if (!strcmp(argv[i], "--small")) small = 1;
    else { fprintf(stderr, "usage: %s [--cpu] [--small]\n", argv[0]); return 2; }
  }
  printf("fusedce %u.%u.%u\n", fce_version() / 10000, fce_version() / 100 % 100, fce_version() % 100);
  if (fce_version() != FCE_VERSION_NUMBER) { fprintf(stderr, "header/library version mismatch\n"); return 1; }
  g_gpu = !force_cpu && fce_cuda_available();
  printf("%s\n", fce_build_info());
  printf("backend: %s\n\n", g_gpu ? "CUDA" : "CPU (no CUDA device, or --cpu)");
  if (g_gpu) {
    demo_cross_entropy(small ? 256 : 16384, small ? 32000 : 128256, FCE_BFLOAT16);
    demo_linear_ce(small ? 256 : 8192, small ? 256 : 4096, small ? 32000 : 128256, FCE_BFLOAT16);
  } else {
    demo_cross_entropy(small ? 64 : 1024, small ? 5003 : 128256, FCE_FLOAT32);
    demo_linear_ce(small ? 32 : 256, small ? 64 : 1024, small ? 5003 : 32000, FCE_FLOAT32);
  }
  return 0;
}
