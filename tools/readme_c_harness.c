/* readme_c_harness.c: the program tools/check_readme.py pastes README.md's C snippets into.
 *
 * It declares and allocates every variable the snippets use and do not declare themselves
 * (N, V, D, logits, targets, loss, lse, grad_logits, grad_output, hidden, weight, bias,
 * grad_hidden, grad_weight, grad_bias, ws, stream), then runs the snippets in place of the
 * @SNIPPETS@ line. check_readme.py compiles it twice:
 *   -DREADME_BACKEND=FCE_BACKEND_CPU   FCE_OPTIONS_INIT gives the CPU backend: host buffers, and
 *                                      every fce_* call of the snippets must succeed;
 *   (default) FCE_BACKEND_CUDA         as written: without a CUDA device the calls return
 *                                      FCE_ERROR_BACKEND_UNAVAILABLE (that counts as running);
 *                                      with one, the buffers are device memory (cudart loaded
 *                                      with dlopen) and every call must succeed.
 * Every fce_* compute and query call goes through a wrapper of the same prototype (so the
 * snippets are type-checked against the header) that records its status and checks that the
 * workspace a query asks for fits in the harness's ws. Exit status 0 = the snippets ran.
 */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fusedce.h>

#ifndef README_BACKEND
#define README_BACKEND FCE_BACKEND_CUDA
#endif
#define HARNESS_FN static __attribute__((unused)) /* a snippet may not call it */
#define WS_CAP ((size_t)256 << 20) /* the harness's workspace: more than any query at its sizes */

/* ------------------------------------------------------------------ memory ---- */
typedef int (*cuda_malloc_fn)(void**, size_t);
typedef int (*cuda_memcpy_fn)(void*, const void*, size_t, int);
typedef int (*cuda_memset_fn)(void*, int, size_t);
typedef int (*cuda_sync_fn)(void);
static cuda_malloc_fn cuda_malloc;
static cuda_memcpy_fn cuda_memcpy;
static cuda_memset_fn cuda_memset;
static cuda_sync_fn cuda_sync;
static int on_device; /* buffers are device memory (CUDA backend with a device) */

static int load_cudart(void) {
  const char* names[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12", NULL};
  void* h = NULL;
  for (int i = 0; names[i] && !h; ++i) h = dlopen(names[i], RTLD_NOW);
  if (!h) return 0;
  cuda_malloc = (cuda_malloc_fn)dlsym(h, "cudaMalloc");
  cuda_memcpy = (cuda_memcpy_fn)dlsym(h, "cudaMemcpy");
  cuda_memset = (cuda_memset_fn)dlsym(h, "cudaMemset");
  cuda_sync = (cuda_sync_fn)dlsym(h, "cudaDeviceSynchronize");
  return cuda_malloc && cuda_memcpy && cuda_memset && cuda_sync;
}

/* A zeroed buffer of `bytes` (host or device), filled from `init` when it is not NULL. */
static void* buffer(size_t bytes, const void* init) {
  void* p = NULL;
  if (on_device) {
    if (cuda_malloc(&p, bytes) != 0 || cuda_memset(p, 0, bytes) != 0 ||
        (init && cuda_memcpy(p, init, bytes, 1 /* host to device */) != 0)) {
      fprintf(stderr, "harness: cudaMalloc/cudaMemcpy of %zu bytes failed\n", bytes);
      exit(2);
    }
    return p;
  }
  p = calloc(1, bytes);
  if (!p) exit(2);
  if (init) memcpy(p, init, bytes);
  return p;
}

/* ----------------------------------------------------- status bookkeeping ---- */
static int calls, failures, unavailable;

static fce_status note(fce_status s, const char* function) {
  ++calls;
  if (s == FCE_SUCCESS) return s;
  if (s == FCE_ERROR_BACKEND_UNAVAILABLE && README_BACKEND == FCE_BACKEND_CUDA && !on_device) {
    ++unavailable;
    return s;
  }
  ++failures;
  fprintf(stderr, "harness: %s returned %s: %s\n", function, fce_status_string(s),
          fce_last_error());
  return s;
}

static void check_ws(fce_status s, size_t bytes, const char* function) {
  if (s == FCE_SUCCESS && bytes > WS_CAP) {
    ++failures;
    fprintf(stderr, "harness: %s asks for %zu bytes, more than the harness's ws (%zu)\n",
            function, bytes, WS_CAP);
  }
}

/* The snippets start from FCE_OPTIONS_INIT: the header's, with the backend under test. */
static const fce_options header_options_init = FCE_OPTIONS_INIT;
HARNESS_FN fce_options harness_options(void) {
  fce_options o = header_options_init;
  o.backend = README_BACKEND;
  return o;
}
#undef FCE_OPTIONS_INIT
#define FCE_OPTIONS_INIT harness_options()

/* ---------------------------------- wrappers with the header's prototypes ---- */
HARNESS_FN fce_status w_forward_workspace_size(const fce_options* o, int64_t rows, int64_t vocab,
                                           size_t* bytes) {
  fce_status s = note(fce_forward_workspace_size(o, rows, vocab, bytes),
                      "fce_forward_workspace_size");
  check_ws(s, *bytes, "fce_forward_workspace_size");
  return s;
}
HARNESS_FN fce_status w_backward_workspace_size(const fce_options* o, int64_t rows, int64_t vocab,
                                            size_t* bytes) {
  fce_status s = note(fce_backward_workspace_size(o, rows, vocab, bytes),
                      "fce_backward_workspace_size");
  check_ws(s, *bytes, "fce_backward_workspace_size");
  return s;
}
HARNESS_FN fce_status w_linear_ce_workspace_size(const fce_options* o, int64_t rows, int64_t hidden,
                                             int64_t vocab, int with_grad, size_t* min_bytes,
                                             size_t* optimal_bytes) {
  fce_status s = note(fce_linear_ce_workspace_size(o, rows, hidden, vocab, with_grad, min_bytes,
                                                   optimal_bytes),
                      "fce_linear_ce_workspace_size");
  check_ws(s, *min_bytes, "fce_linear_ce_workspace_size");
  if (optimal_bytes) check_ws(s, *optimal_bytes, "fce_linear_ce_workspace_size");
  return s;
}
HARNESS_FN fce_status w_forward(const fce_options* o, int64_t rows, int64_t vocab, const void* logits,
                            const void* targets, const fce_outputs* outputs,
                            const fce_gradients* gradients, void* ws, size_t ws_bytes,
                            void* stream) {
  return note(fce_forward(o, rows, vocab, logits, targets, outputs, gradients, ws, ws_bytes, stream),
              "fce_forward");
}
HARNESS_FN fce_status w_backward(const fce_options* o, int64_t rows, int64_t vocab,
                             const void* logits, const void* targets, const float* lse,
                             const fce_outputs* outputs, const fce_gradients* gradients,
                             void* ws, size_t ws_bytes, void* stream) {
  return note(fce_backward(o, rows, vocab, logits, targets, lse, outputs, gradients, ws, ws_bytes,
                           stream),
              "fce_backward");
}
HARNESS_FN fce_status w_backward_rescale(const fce_options* o, int64_t rows, int64_t vocab,
                                     const void* logits, const void* targets, const float* lse,
                                     const fce_outputs* outputs, const fce_gradients* gradients,
                                     void* ws, size_t ws_bytes, void* stream) {
  return note(fce_backward_rescale(o, rows, vocab, logits, targets, lse, outputs, gradients, ws,
                                   ws_bytes, stream),
              "fce_backward_rescale");
}
HARNESS_FN fce_status w_linear_ce(const fce_options* o, int64_t rows, int64_t hidden, int64_t vocab,
                              const void* hidden_states, const void* weight, const void* bias,
                              const void* targets, const fce_outputs* outputs,
                              const fce_gradients* gradients, void* ws, size_t ws_bytes,
                              void* stream) {
  return note(fce_linear_ce(o, rows, hidden, vocab, hidden_states, weight, bias, targets, outputs,
                            gradients, ws, ws_bytes, stream),
              "fce_linear_ce");
}
#define fce_forward_workspace_size w_forward_workspace_size
#define fce_backward_workspace_size w_backward_workspace_size
#define fce_linear_ce_workspace_size w_linear_ce_workspace_size
#define fce_forward w_forward
#define fce_backward w_backward
#define fce_backward_rescale w_backward_rescale
#define fce_linear_ce w_linear_ce

/* ------------------------------------------------------------------- main ---- */
int main(void) {
  if (README_BACKEND == FCE_BACKEND_CUDA && fce_cuda_available()) {
    if (!load_cudart()) {
      printf("SKIPPED: a CUDA device is visible but libcudart could not be loaded\n");
      return 0;
    }
    on_device = 1;
  }
  /* Small sizes; every buffer is large enough for any dtype (4 bytes per element). Logits,
   * hidden states, weight and bias are zeros (valid in every dtype: each loss is log V). */
  const int64_t N = 8, V = 1000, D = 64;
  int64_t target_values[8];
  float ones[8];
  for (int i = 0; i < 8; ++i) target_values[i] = (i * 37) % V, ones[i] = 1.0f;
  void* logits = buffer((size_t)(N * V) * 4, NULL);
  void* grad_logits = buffer((size_t)(N * V) * 4, NULL);
  void* targets = buffer(sizeof target_values, target_values);
  float* loss = buffer((size_t)N * 4, NULL);
  float* lse = buffer((size_t)N * 4, NULL);
  float* grad_output = buffer(sizeof ones, ones);
  void* hidden = buffer((size_t)(N * D) * 4, NULL);
  void* weight = buffer((size_t)(V * D) * 4, NULL);
  void* bias = buffer((size_t)V * 4, NULL);
  void* grad_hidden = buffer((size_t)(N * D) * 4, NULL);
  void* grad_weight = buffer((size_t)(V * D) * 4, NULL);
  void* grad_bias = buffer((size_t)V * 4, NULL);
  void* ws = buffer(WS_CAP, NULL);
  void* stream = NULL; /* the legacy default stream */
  (void)N, (void)V, (void)D, (void)logits, (void)grad_logits, (void)targets, (void)loss;
  (void)lse, (void)grad_output, (void)hidden, (void)weight, (void)bias, (void)grad_hidden;
  (void)grad_weight, (void)grad_bias, (void)ws, (void)stream;

  {
/* @SNIPPETS@ */
  }

  float loss0 = 0.0f;
  if (on_device) {
    if (cuda_sync() != 0) {
      fprintf(stderr, "harness: cudaDeviceSynchronize reported an error\n");
      return 1;
    }
    cuda_memcpy(&loss0, loss, sizeof loss0, 2 /* device to host */);
  } else {
    loss0 = loss[0];
  }
  if (failures) return 1;
  if (calls == 0) {
    fprintf(stderr, "harness: the snippets made no fce_* call\n");
    return 1;
  }
  if (unavailable)
    printf("%d fce_* calls, %d returned FCE_ERROR_BACKEND_UNAVAILABLE (no CUDA device)\n", calls,
           unavailable);
  else if (!isfinite(loss0))
    return fprintf(stderr, "harness: loss[0] = %g is not finite\n", loss0), 1;
  else
    printf("%d fce_* calls succeeded on the %s backend, loss[0] = %.6g (log V = %.6g)\n", calls,
           README_BACKEND == FCE_BACKEND_CPU ? "CPU" : "CUDA", loss0, log((double)V));
  return 0;
}
