// cuda_stub.cpp — the CUDA backend's entry points in a build without CUDA (FCE_WITH_CUDA=OFF):
// the ABI layer reports FCE_ERROR_BACKEND_UNAVAILABLE before reaching them. Not globbed with
// the other lib/*.cpp: CMakeLists.txt adds it when CUDA is off (lib/cuda/ otherwise).
#include "distill.h"
#include "internal.h"
#include "vp_distill.h"

namespace fce {
namespace {
fce_status unavailable(const char* fn) {
  return fail(FCE_ERROR_BACKEND_UNAVAILABLE, "%s: %s", fn, cuda_unavailable_reason());
}
}  // namespace

bool cuda_available() { return false; }
bool cuda_device_visible() { return false; }
const char* cuda_unavailable_reason() {
  return "this build has no CUDA backend (it was built without nvcc: build from source with the "
         "CUDA toolkit, or from Python install a wheel with it, pip install fusedce-cu13 or "
         "fusedce-cu12)";
}
const char* cuda_cublaslt(const char** why) {
  if (why) *why = "this build has no CUDA backend";
  return nullptr;
}
fce_status cuda_check_pointers(const char* fn, const Arg*, int) { return unavailable(fn); }
size_t cuda_ce_workspace_size(const CeOptions&, int64_t, int64_t, bool) { return 0; }
fce_status cuda_ce(const CeProblem& p) { return unavailable(p.fn); }
void cuda_linear_ce_workspace_size(const CeOptions&, int64_t, int64_t, int64_t, bool, bool,
                                   size_t* min_bytes, size_t* optimal_bytes) {
  *min_bytes = *optimal_bytes = 0;
}
fce_status cuda_linear_ce(const LinearCeProblem& p) { return unavailable(p.fn); }
fce_status cuda_scale_gradient(int, int64_t, void*, const float*, void*) {
  return unavailable("fce_scale_gradient");
}
fce_status cuda_write_zeros(const char* fn, const ZeroSpan*, int, void*) {
  return unavailable(fn);
}
fce_status cuda_vp_stats(const VpStatsProblem& p) { return unavailable(p.fn); }
size_t cuda_vp_workspace_size(const CeOptions&, int64_t, int64_t, int64_t, int64_t, bool) {
  return 0;
}
fce_status cuda_vp(const VpProblem& p) { return unavailable(p.fn); }
void cuda_vp_linear_workspace_size(const CeOptions&, int64_t, int64_t, int64_t, int64_t, int64_t,
                                   bool, int, bool, size_t* min_bytes, size_t* optimal_bytes) {
  if (min_bytes) *min_bytes = 0;
  if (optimal_bytes) *optimal_bytes = 0;
}
fce_status cuda_vp_linear(const VpLinearProblem& p) { return unavailable(p.fn); }
bool cuda_vp_linear_ce_chunked(const CeOptions&, int64_t, int64_t, int64_t, int64_t, int64_t,
                               bool, bool, size_t, size_t* threshold, size_t* need) {
  *threshold = *need = SIZE_MAX;
  return false;
}
fce_status cuda_vp_linear_ce(const VpLinearCeProblem& p) { return unavailable(p.lin.fn); }
size_t cuda_distill_workspace_size(const DistillOptions&, int64_t, int64_t) { return 0; }
fce_status cuda_distill(const DistillProblem& p) { return unavailable(p.fn); }
void cuda_linear_distill_workspace_size(const DistillOptions&, int64_t, int64_t, int64_t, int64_t,
                                        bool, bool, size_t* min_bytes, size_t* optimal_bytes) {
  *min_bytes = *optimal_bytes = 0;
}
fce_status cuda_linear_distill(const LinearDistillProblem& p) { return unavailable(p.fn); }
fce_status cuda_vp_distill_stats(const VpDistillStatsProblem& p) { return unavailable(p.fn); }
size_t cuda_vp_distill_workspace_size(const DistillOptions&, int64_t, int64_t, bool) { return 0; }
fce_status cuda_vp_distill(const VpDistillProblem& p) { return unavailable(p.fn); }
void cuda_vp_linear_distill_workspace_size(const DistillOptions&, int64_t, int64_t, int64_t,
                                           int64_t, bool, size_t* min_bytes,
                                           size_t* optimal_bytes) {
  *min_bytes = *optimal_bytes = 0;
}
fce_status cuda_vp_linear_distill(const VpLinearDistillProblem& p) { return unavailable(p.fn); }
}  // namespace fce
