// common/device_pointers.cu — cuda_check_pointers (internal.h): the CUDA backend's one check that the
// caller's buffers are usable on the current device. The ABI layer (lib/api.cpp) builds one
// argument table per call (fce::Arg: the names as the header spells them) and calls it once,
// before dispatching to the backend; the backend's files do not check again.
//
// Every present pointer to some bytes must be memory the current device can dereference:
// device memory of this device, managed memory, pinned host memory mapped into the device's
// address space, or any host memory where the device accesses pageable memory (HMM / ATS).
// Anything else is an FCE_ERROR_INVALID_ARGUMENT naming the function and the argument, before
// any work is enqueued.
// Host-side queries only (no synchronisation, nothing enqueued: graph capture is not disturbed).
#include <cuda_runtime.h>

#include "internal.h"

namespace fce {
namespace cuda {
namespace {

// A pointer the device can dereference: device memory of this device, managed memory, pinned
// (registered / cudaHostAlloc) host memory, or any host memory on a system where the device
// accesses pageable memory (HMM / ATS). Anything else is a plain host pointer: an error naming
// the argument, before any work is enqueued.
fce_status check_pointer(const char* fn, const void* ptr, const char* name, int device,
                         int pageable_ok) {
  if (!ptr) return FCE_SUCCESS;
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, ptr);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // old runtimes: cudaErrorInvalidValue for unregistered host memory
    if (e != cudaErrorInvalidValue)
      return fail(FCE_ERROR_CUDA, "%s: cudaPointerGetAttributes(%s) failed: %s", fn, name,
                  cudaGetErrorString(e));
    attr.type = cudaMemoryTypeUnregistered;
  }
  switch (attr.type) {
    case cudaMemoryTypeDevice:
      if (attr.device != device)
        return fail(FCE_ERROR_INVALID_ARGUMENT,
                    "%s: %s (%p) is memory of CUDA device %d, but the current device is %d", fn,
                    name, ptr, attr.device, device);
      return FCE_SUCCESS;
    case cudaMemoryTypeManaged:
      return FCE_SUCCESS;
    case cudaMemoryTypeHost:
      if (attr.devicePointer == ptr) return FCE_SUCCESS;  // pinned and mapped (UVA)
      return fail(FCE_ERROR_INVALID_ARGUMENT,
                  "%s: %s (%p) is pinned host memory not mapped into the device's address space",
                  fn, name, ptr);
    default:
      if (pageable_ok) return FCE_SUCCESS;
      return fail(FCE_ERROR_INVALID_ARGUMENT,
                  "%s: %s (%p) is host memory; the CUDA backend needs device memory", fn, name, ptr);
  }
}

}  // namespace
}  // namespace cuda

fce_status cuda_check_pointers(const char* fn, const Arg* args, int count) {
  int device = 0, pageable_ok = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&pageable_ok, cudaDevAttrPageableMemoryAccess, device);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return fail(FCE_ERROR_CUDA, "%s: no usable CUDA device: %s", fn, cudaGetErrorString(e));
  }
  // (an entry of no bytes is never dereferenced: an empty problem's per-row buffers may be any
  // pointer, as an empty tensor's often is)
  for (int i = 0; i < count; ++i)
    if (args[i].bytes > 0)
      FCE_TRY(cuda::check_pointer(fn, args[i].ptr, args[i].name, device, pageable_ok));
  return FCE_SUCCESS;
}

}  // namespace fce
