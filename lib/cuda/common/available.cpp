// common/available.cpp — whether the CUDA backend can run in this process: a visible device, and
// cuBLASLt, which is loaded at run time (common/cublaslt_loader.cpp) rather than linked. The ABI layer
// asks before every CUDA call and puts the reason in FCE_ERROR_BACKEND_UNAVAILABLE's message.
#include <cuda_runtime.h>

#include <string>

#include "internal.h"

namespace fce {
namespace {

// Why no device can be used (nullptr when one can); the count's error, e.g. a driver older than
// this build's CUDA runtime needs, is named.
const char* no_device() {
  thread_local std::string why;
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    why = std::string("no CUDA device is visible (cudaGetDeviceCount: ") + cudaGetErrorString(e) +
          ")";
    return why.c_str();
  }
  return n > 0 ? nullptr : "no CUDA device is visible";
}

}  // namespace

bool cuda_device_visible() { return no_device() == nullptr; }

const char* cuda_unavailable_reason() {
  if (const char* why = no_device()) return why;
  const char* missing = nullptr;
  if (!cuda_cublaslt(&missing)) return missing;
  return nullptr;
}

bool cuda_available() { return cuda_unavailable_reason() == nullptr; }

}  // namespace fce
