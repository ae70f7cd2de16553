// cuda_stub.cc — the CUDA backend's entry points in a build without CUDA (FCE_WITH_CUDA=OFF):
// the ABI layer reports FCE_ERROR_BACKEND_UNAVAILABLE before reaching them.
#include "internal.h"

namespace fce {
bool cuda_available() { return false; }
size_t cuda_ce_workspace_size(const CeOptions&, int64_t, int64_t, bool) { return 0; }
fce_status cuda_ce(const CeProblem&) {
  return fail(FCE_ERROR_BACKEND_UNAVAILABLE, "this build has no CUDA backend");
}
void cuda_linear_ce_workspace_size(const CeOptions&, int64_t, int64_t, int64_t, bool, bool,
                                   size_t* min_bytes, size_t* optimal_bytes) {
  *min_bytes = *optimal_bytes = 0;
}
fce_status cuda_linear_ce(const LinearCeProblem&) {
  return fail(FCE_ERROR_BACKEND_UNAVAILABLE, "this build has no CUDA backend");
}
fce_status cuda_scale_gradient(int, int64_t, void*, const float*, void*) {
  return fail(FCE_ERROR_BACKEND_UNAVAILABLE, "this build has no CUDA backend");
}
fce_status cuda_vp_stats(const VpStatsProblem&) {
  return fail(FCE_ERROR_BACKEND_UNAVAILABLE, "this build has no CUDA backend");
}
size_t cuda_vp_workspace_size(const CeOptions&, int64_t, int64_t, int64_t, int64_t, bool) {
  return 0;
}
fce_status cuda_vp(const VpProblem&) {
  return fail(FCE_ERROR_BACKEND_UNAVAILABLE, "this build has no CUDA backend");
}
void cuda_vp_linear_workspace_size(const CeOptions&, int64_t, int64_t, int64_t, int64_t, int64_t,
                                   bool, int, bool, size_t* min_bytes, size_t* optimal_bytes) {
  if (min_bytes) *min_bytes = 0;
  if (optimal_bytes) *optimal_bytes = 0;
}
fce_status cuda_vp_linear(const VpLinearProblem&) {
  return fail(FCE_ERROR_BACKEND_UNAVAILABLE, "this build has no CUDA backend");
}
}  // namespace fce
