// status.cpp — status strings and the thread-local last-error message (fail, fce_last_error).
#include <cstdarg>
#include <cstdio>

#include "internal.h"

namespace {
thread_local char g_last_error[1024] = "";  // room for the paths a missing cuBLASLt names
}

namespace fce {

fce_status fail(fce_status status, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(g_last_error, sizeof g_last_error, fmt, args);
  va_end(args);
  return status;
}

void clear_error() { g_last_error[0] = '\0'; }

}  // namespace fce

extern "C" {

FCE_API const char* fce_status_string(fce_status status) {
  switch (status) {
    case FCE_SUCCESS: return "FCE_SUCCESS: no error";
    case FCE_ERROR_INVALID_ARGUMENT:
      return "FCE_ERROR_INVALID_ARGUMENT: a size, option or enum out of its domain";
    case FCE_ERROR_NULL_POINTER: return "FCE_ERROR_NULL_POINTER: a required pointer is NULL";
    case FCE_ERROR_MISALIGNED:
      return "FCE_ERROR_MISALIGNED: a pointer is not aligned to its element size";
    case FCE_ERROR_UNSUPPORTED:
      return "FCE_ERROR_UNSUPPORTED: a valid request this build or device cannot do";
    case FCE_ERROR_WORKSPACE_TOO_SMALL:
      return "FCE_ERROR_WORKSPACE_TOO_SMALL: the workspace is smaller than the query returned";
    case FCE_ERROR_BACKEND_UNAVAILABLE:
      return "FCE_ERROR_BACKEND_UNAVAILABLE: the CUDA backend is not built in or no device";
    case FCE_ERROR_CUDA: return "FCE_ERROR_CUDA: the CUDA runtime reported an error";
    case FCE_ERROR_CUBLAS: return "FCE_ERROR_CUBLAS: cuBLASLt reported an error";
    case FCE_ERROR_INTERNAL: return "FCE_ERROR_INTERNAL: an internal error in fusedce";
    case FCE_ERROR_OUT_OF_MEMORY: return "FCE_ERROR_OUT_OF_MEMORY: host memory ran out";
  }
  return "unknown fce_status";
}

FCE_API const char* fce_last_error(void) { return g_last_error; }

}  // extern "C"
