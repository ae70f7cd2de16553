// fusedce_jax_common.h — what both translation units of libfusedce_jax.so share
// (fusedce_jax.cc: the cross-entropy handlers; fusedce_jax_distill.cc: the distillation ones):
// the stream handle type, the library's status as an XLA error, the workspace result, optional
// buffers, dtype codes, dlsym binding and the library's functions (bound once, by
// fusedce_jax.cc's fce_jax_init).
#pragma once

#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "fusedce.h"
#include "xla/ffi/api/ffi.h"

#if defined(FCE_JAX_HAVE_CUDA_RUNTIME)
#include <cuda_runtime_api.h>
static_assert(std::is_same_v<cudaStream_t, struct CUstream_st*>,
              "cudaStream_t is expected to be struct CUstream_st*");
#else
struct CUstream_st;  // as CUDA's driver_types.h: an opaque handle
typedef struct CUstream_st* cudaStream_t;
#endif

#define FCE_JAX_API extern "C" __attribute__((visibility("default")))

namespace fce_jax {

namespace ffi = xla::ffi;

inline ffi::Error Invalid(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "fusedce_jax: " + what);
}

// A library status as an XLA error: "fusedce (<fn>): <last error> [<status>]", the code by the
// status's kind. last_error / status_string: the library's, as the calling unit bound them.
inline ffi::Error StatusError(fce_status st, const char* fn, const char* (*last_error)(void),
                              const char* (*status_string)(fce_status)) {
  const char* msg = last_error ? last_error() : "";
  std::string text = std::string("fusedce (") + fn + "): " + (msg && *msg ? msg : "") + " [" +
                     (status_string ? status_string(st) : "?") + "]";
  ffi::ErrorCode code = ffi::ErrorCode::kInternal;
  switch (st) {
    case FCE_ERROR_INVALID_ARGUMENT:
    case FCE_ERROR_NULL_POINTER:
    case FCE_ERROR_MISALIGNED:
    case FCE_ERROR_WORKSPACE_TOO_SMALL:
      code = ffi::ErrorCode::kInvalidArgument;
      break;
    case FCE_ERROR_UNSUPPORTED:
      code = ffi::ErrorCode::kUnimplemented;
      break;
    case FCE_ERROR_BACKEND_UNAVAILABLE:
      code = ffi::ErrorCode::kUnavailable;
      break;
    default:
      break;
  }
  if (st == FCE_ERROR_WORKSPACE_TOO_SMALL)
    text += " (the workspace is the call's last result, sized by fusedce/jax.py when the function "
            "was traced: was it traced for another backend, where libfusedce had no CUDA backend, "
            "or with a different FUSEDCE_LIBRARY?)";
  return ffi::Error(code, std::move(text));
}

// The workspace result (the last one): its pointer (NULL when empty) and byte size, all of it
// passed to the library, which checks it holds what its query asks for and is 16-byte aligned
// (fusedce/jax.py sized it at trace time).
inline ffi::Error Workspace(ffi::Result<ffi::AnyBuffer>& ws, void** ptr, size_t* bytes) {
  *ptr = nullptr;
  *bytes = 0;
  if (ws->element_type() != ffi::DataType::U8 || ws->dimensions().size() != 1)
    return Invalid("the workspace (the last result) must be a uint8 vector (fusedce/jax.py and "
                   "the shim disagree: rebuild the shim)");
  *bytes = ws->size_bytes();
  if (*bytes) *ptr = ws->untyped_data();
  return ffi::Error::Success();
}

inline bool FloatCode(ffi::DataType t, int32_t* code) {
  switch (t) {
    case ffi::DataType::F32: *code = FCE_FLOAT32; return true;
    case ffi::DataType::F16: *code = FCE_FLOAT16; return true;
    case ffi::DataType::BF16: *code = FCE_BFLOAT16; return true;
    default: return false;
  }
}

// An optional buffer: NULL when empty.
inline void* Opt(const ffi::AnyBuffer& b) {
  return b.element_count() ? b.untyped_data() : nullptr;
}
inline void* Opt(ffi::Result<ffi::AnyBuffer>& b) {
  return b->element_count() ? b->untyped_data() : nullptr;
}

// ------------------------------------------------ the library, bound by fce_jax_init ----
// The functions of the libfusedce the Python binding loaded (dlsym, fusedce_jax.cc's
// fce_jax_init); those added after 0.1 may be NULL (a handler that needs one says so,
// NeedsError). Both units' handlers call through g_api.
struct Api {
  unsigned (*version)(void);
  const char* (*last_error)(void);
  const char* (*status_string)(fce_status);
  void (*options_default)(fce_options*);
  fce_status (*forward)(const fce_options*, int64_t, int64_t, const void*, const void*,
                        const fce_outputs*, const fce_gradients*, void*, size_t, void*);
  fce_status (*backward)(const fce_options*, int64_t, int64_t, const void*, const void*,
                         const float*, const fce_outputs*, const fce_gradients*, void*, size_t,
                         void*);
  fce_status (*backward_rescale)(const fce_options*, int64_t, int64_t, const void*, const void*,
                                 const float*, const fce_outputs*, const fce_gradients*, void*,
                                 size_t, void*);
  fce_status (*linear_ce)(const fce_options*, int64_t, int64_t, int64_t, const void*,
                          const void*, const void*, const void*, const fce_outputs*,
                          const fce_gradients*, void*, size_t, void*);
  fce_status (*scale_gradient)(int32_t, int32_t, int64_t, void*, const float*, void*);
  fce_status (*distill)(const fce_options*, const fce_teacher*, int64_t, int64_t, const void*,
                        const void*, const fce_outputs*, const fce_gradients*, void*, size_t,
                        void*);
  fce_status (*linear_distill)(const fce_options*, const fce_teacher*, int64_t, int64_t,
                               int64_t, const void*, const void*, const void*,
                               const fce_outputs*, const fce_gradients*, void*, size_t, void*);
};
extern Api g_api;
extern bool g_ready;            // fce_jax_init succeeded
extern size_t g_options_size;   // the fce_options struct_size to pass the library

// The shim is not bound yet (fce_jax_init failed or was not called).
ffi::Error NotReady();
// A library status of fn as an XLA error (StatusError with the library's own strings).
ffi::Error Fail(fce_status st, const char* fn);
// A function or option the loaded library is too old for (bindings/README.md, "Library
// versions"): "<what>: needs libfusedce >= <since>; the loaded library is <version>".
ffi::Error NeedsError(const char* what, const char* since);

// out = dlsym(handle, name), else name appended to missing (", "-separated); whether found.
template <typename F>
bool Sym(void* handle, const char* name, F& out, std::string& missing) {
  void* p = dlsym(handle, name);
  if (!p) {
    missing += missing.empty() ? name : std::string(", ") + name;
    return false;
  }
  out = reinterpret_cast<F>(p);
  return true;
}

}  // namespace fce_jax
