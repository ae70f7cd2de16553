// device_pointers.cuh — the CUDA backend's one check that the caller's pointers are usable on
// the current device, shared by fce_forward / fce_backward (ce.cu) and fce_linear_ce.
#pragma once

#include "internal.h"

namespace fce {
namespace cuda {

struct NamedPointer {
  const void* ptr;
  const char* name;
};

// Every non-null pointer must be memory the current device can dereference: device memory of
// this device, managed memory, pinned host memory mapped into the device's address space, or
// any host memory where the device accesses pageable memory (HMM / ATS). Anything else is an
// FCE_ERROR_INVALID_ARGUMENT naming the argument, before any work is enqueued. Host-side
// queries only (no synchronisation). Writes the current device to *device.
fce_status check_device_pointers(const char* fn, const NamedPointer* pointers, int count,
                                 int* device);

}  // namespace cuda
}  // namespace fce
