// api.cpp — the C ABI's calls that belong to no operation: the version, the options' defaults,
// whether CUDA is there, and fce_scale_gradient. The operations' entry points are in
// api_ce.cpp, api_linear.cpp, api_vp.cpp and api_vp_linear.cpp, their checks in validate.cpp,
// the status strings and the last error in status.cpp.
#include <cstring>

#include "validate.h"

using fce::fail;
using namespace fce::abi;

extern "C" {

FCE_API unsigned fce_version(void) { return FCE_VERSION_NUMBER; }

FCE_API void fce_options_default(fce_options* options) {
  if (!options) return;
  size_t size = options->struct_size ? options->struct_size : FCE_OPTIONS_SIZE_V1_0;
  if (size < sizeof(size_t)) return;
  if (size > sizeof(fce_options)) size = sizeof(fce_options);
  fce_options defaults = FCE_OPTIONS_INIT;
  defaults.struct_size = options->struct_size ? options->struct_size : FCE_OPTIONS_SIZE_V1_0;
  std::memcpy(options, &defaults, size);
}

FCE_API int fce_cuda_available(void) { return fce::cuda_available() ? 1 : 0; }

FCE_API fce_status fce_scale_gradient(int32_t backend, int32_t dtype, int64_t count, void* grad,
                                      const float* grad_output, void* stream) {
  const char* fn = "fce_scale_gradient";
  fce::clear_error();
  if (backend != FCE_BACKEND_CUDA && backend != FCE_BACKEND_CPU)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: backend (%d) is not an fce_backend", fn, backend);
  if (dtype != FCE_FLOAT32 && dtype != FCE_FLOAT16 && dtype != FCE_BFLOAT16)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: dtype (%d) must be FCE_FLOAT32, FCE_FLOAT16 or FCE_BFLOAT16", fn, dtype);
  const size_t esize = fce::dtype_size(dtype);
  if (count < 0 || count > kMaxBytes / static_cast<int64_t>(esize))
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: count (%lld) must be in [0, 2^62 / %zu]", fn,
                (long long)count, esize);
  FCE_TRY(check_required(fn, {{"grad_output", grad_output}}));
  if (count > 0) FCE_TRY(check_required(fn, {{"grad", grad}}));
  const fce::Arg args[] = {
      {"grad", grad, static_cast<uint64_t>(count) * esize, esize, true},
      {"grad_output", grad_output, 4, 4, false},
  };
  FCE_TRY(check_args(fn, args));
  if (count == 0) return FCE_SUCCESS;
  if (backend == FCE_BACKEND_CPU) return fce::cpu_scale_gradient(dtype, count, grad, grad_output);
  if (const char* why = fce::cuda_unavailable_reason())
    return fail(FCE_ERROR_BACKEND_UNAVAILABLE, "%s: backend is FCE_BACKEND_CUDA but %s", fn, why);
  FCE_TRY(check_device_pointers(fn, args));
  return fce::cuda_scale_gradient(dtype, count, grad, grad_output, stream);
}

}  // extern "C"
