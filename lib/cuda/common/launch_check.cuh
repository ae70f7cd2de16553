// common/launch_check.cuh — the CUDA backend's one message for a kernel launch that failed:
//   "<public function>: the CUDA kernel launch failed (<kernel>): <CUDA's error string>"
// e.g. "fce_forward: the CUDA kernel launch failed (ce_rows_regs_kernel): too many resources
// requested for launch". The public function (fce_forward, fce_vp_backward, ...) comes first, as
// in every message of the library; the kernel is detail after it.
#pragma once

#include <cuda_runtime.h>

#include "internal.h"

namespace fce {
namespace cuda {

// The status of the kernel launch just enqueued by this thread: FCE_SUCCESS, or FCE_ERROR_CUDA
// through fce::fail naming fn and the kernel (the launch error is cleared: cudaGetLastError).
inline fce_status launch_check(const char* fn, const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return FCE_SUCCESS;
  return fail(FCE_ERROR_CUDA, "%s: the CUDA kernel launch failed (%s): %s", fn, kernel,
              cudaGetErrorString(e));
}

}  // namespace cuda
}  // namespace fce
