// harness/backend.h — the backend under test (FCE_TEST_BACKEND=cpu|cuda), its stream, the wait
// after a call, the skip when the backend cannot run here, and the options selecting it.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

#include "../flat_calls.h"
#include "fusedce.h"

#if FCE_TEST_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace fcet {

// ------------------------------------------------------------------ backend choice ----------
struct TestEnv {
  bool cuda = false;      // FCE_TEST_BACKEND=cuda
  std::string skip;       // non-empty: why the selected backend cannot run here
  std::string error;      // non-empty: FCE_TEST_BACKEND is not understood
};

inline const TestEnv& test_env() {
  static const TestEnv env = [] {
    TestEnv e;
    const char* b = std::getenv("FCE_TEST_BACKEND");
    std::string s = b ? b : "";
    if (s.empty() || s == "cpu") {
      e.cuda = false;
    } else if (s == "cuda") {
      e.cuda = true;
#if FCE_TEST_HAVE_CUDA
      int n = 0;
      if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        e.skip = "no CUDA device";
      }
#else
      e.skip = "no CUDA device (the tests were built with FCE_WITH_CUDA=OFF)";
#endif
    } else {
      e.error = "FCE_TEST_BACKEND='" + s + "' (expected cpu or cuda)";
    }
    return e;
  }();
  return env;
}

inline bool on_cuda() { return test_env().cuda; }
inline int32_t backend_id() { return on_cuda() ? FCE_BACKEND_CUDA : FCE_BACKEND_CPU; }
inline const char* backend_name() { return on_cuda() ? "cuda" : "cpu"; }

#if FCE_TEST_HAVE_CUDA
#define FCE_CUDA_CHECK(expr)                                                              \
  do {                                                                                    \
    cudaError_t fce_cuda_err_ = (expr);                                                   \
    if (fce_cuda_err_ != cudaSuccess) {                                                   \
      std::fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #expr,                \
                   cudaGetErrorString(fce_cuda_err_));                                    \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)

// One stream for every call of the suite (created non-blocking so that nothing hides a missing
// dependency on the legacy default stream).
inline cudaStream_t cuda_stream() {
  static cudaStream_t s = [] {
    cudaStream_t st;
    FCE_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    return st;
  }();
  return s;
}
#endif

#if FCE_TEST_HAVE_CUDA
// A CUDA graph of what one call enqueues on the test stream (capture mode global: any
// synchronising or unstreamed CUDA call inside it invalidates the capture), instantiated;
// launched on the test stream as often as wanted, destroyed with the object.
class CapturedGraph {
 public:
  CapturedGraph() = default;
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  ~CapturedGraph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  // Captures call() (a fusedce call on the test stream): it must succeed, and nothing runs.
  ::testing::AssertionResult capture(const std::function<fce_status()>& call) {
    cudaStream_t s = cuda_stream();
    cudaError_t e = cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    if (e != cudaSuccess)
      return ::testing::AssertionFailure() << "cudaStreamBeginCapture: " << cudaGetErrorString(e);
    const fce_status st = call();
    e = cudaStreamEndCapture(s, &graph_);
    if (st != FCE_SUCCESS)
      return ::testing::AssertionFailure() << "the call during capture: " << fce_status_string(st)
                                           << " (\"" << fce_last_error() << "\")";
    if (e != cudaSuccess)
      return ::testing::AssertionFailure() << "capture invalidated: " << cudaGetErrorString(e);
#if CUDART_VERSION >= 12000
    e = cudaGraphInstantiate(&exec_, graph_, 0);
#else
    e = cudaGraphInstantiate(&exec_, graph_, nullptr, nullptr, 0);
#endif
    if (e != cudaSuccess)
      return ::testing::AssertionFailure() << "cudaGraphInstantiate: " << cudaGetErrorString(e);
    return ::testing::AssertionSuccess();
  }
  // One replay on the test stream (asynchronous: finish() waits for it).
  ::testing::AssertionResult launch() {
    const cudaError_t e = cudaGraphLaunch(exec_, cuda_stream());
    if (e != cudaSuccess)
      return ::testing::AssertionFailure() << "cudaGraphLaunch: " << cudaGetErrorString(e);
    return ::testing::AssertionSuccess();
  }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};
#endif

// The stream argument every compute call gets.
inline void* test_stream() {
#if FCE_TEST_HAVE_CUDA
  if (on_cuda()) return static_cast<void*>(cuda_stream());
#endif
  return nullptr;
}

// Waits for the work of the last call(s) and reports an asynchronous CUDA error, if any.
inline ::testing::AssertionResult finish() {
#if FCE_TEST_HAVE_CUDA
  if (on_cuda()) {
    cudaError_t e = cudaStreamSynchronize(cuda_stream());
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess)
      return ::testing::AssertionFailure() << "CUDA error after the call: " << cudaGetErrorString(e);
  }
#endif
  return ::testing::AssertionSuccess();
}

// Every test body starts with this: skips (visibly) when the selected backend cannot run here.
#define FCE_REQUIRE_BACKEND()                                                             \
  do {                                                                                    \
    const ::fcet::TestEnv& fce_env_ = ::fcet::test_env();                                 \
    if (!fce_env_.error.empty()) FAIL() << fce_env_.error;                                \
    if (!fce_env_.skip.empty()) {                                                         \
      std::printf("SKIPPED: %s\n", fce_env_.skip.c_str());                                \
      GTEST_SKIP() << fce_env_.skip;                                                      \
    }                                                                                     \
  } while (0)

// Fixture of every test that calls the library on the selected backend.
class BackendTest : public ::testing::Test {
 protected:
  void SetUp() override { FCE_REQUIRE_BACKEND(); }
};

// Options with the backend under test selected.
inline TestOptions test_options() {
  TestOptions o = FCE_OPTIONS_INIT;
  o.backend = backend_id();
  return o;
}

}  // namespace fcet
