// common/cublaslt_loader.cpp — cuBLASLt, loaded at run time instead of linked: libfusedce has
// no DT_NEEDED on libcublasLt, so a machine without it (no CUDA toolkit, no nvidia-cublas wheel)
// still loads the library and runs the CPU backend; the CUDA backend then reports what is
// missing. common/gemm.cu keeps calling cublasLt* by name: this file defines those functions
// (hidden, like everything but fce_*) as forwarders to the ones dlsym found.
#include <cublasLt.h>
#include <dlfcn.h>
#include <link.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <sys/stat.h>

#include "internal.h"

// The search, first success wins (cublaslt_load, once per process):
//   1. FUSEDCE_CUBLASLT=<file>: that file and nothing else (an explicit choice is never
//      replaced by another library; a name that cannot load switches the CUDA backend off);
//   2. the soname (libcublasLt.so.<major>) already loaded in the process (torch, CuPy or
//      fusedce/_lib.py loaded it): dlopen(RTLD_NOLOAD);
//   3. the nvidia-cublas wheel beside the package in the same site-packages, found from this
//      library's own file (dladdr; site-packages/fusedce/lib/libfusedce.so.0 in a wheel):
//      <site>/nvidia/cu13/lib/libcublasLt.so.13 (CUDA 13, `nvidia-cublas`),
//      <site>/nvidia/cublas/lib/libcublasLt.so.12 (CUDA 12, `nvidia-cublas-cu12`) — the layouts
//      of those wheels, as torch's RUNPATH has them;
//   4. the soname through the dynamic loader's own path (LD_LIBRARY_PATH, ldconfig);
//   5. source builds only (FCE_CUBLASLT_TOOLKIT_DIR, never in a wheel): the toolkit's library
//      directory the library was built against.

namespace fce {
namespace cuda {
namespace {

#define FCE_STR2(x) #x
#define FCE_STR(x) FCE_STR2(x)
constexpr const char* kSoname = "libcublasLt.so." FCE_STR(CUBLAS_VER_MAJOR);
#if CUBLAS_VER_MAJOR >= 13
constexpr const char* kWheelDir = "nvidia/cu" FCE_STR(CUBLAS_VER_MAJOR) "/lib";
constexpr const char* kWheel = "nvidia-cublas";
#else
constexpr const char* kWheelDir = "nvidia/cublas/lib";
constexpr const char* kWheel = "nvidia-cublas-cu" FCE_STR(CUBLAS_VER_MAJOR);
#endif

// The functions common/gemm.cu calls, as the header declares them.
struct Table {
  decltype(&cublasLtCreate) create;
  decltype(&cublasLtGetStatusName) status_name;
  decltype(&cublasLtGetStatusString) status_string;
  decltype(&cublasLtMatmulDescCreate) desc_create;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set;
  decltype(&cublasLtMatrixLayoutCreate) layout_create;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic;
  decltype(&cublasLtMatmul) matmul;
  decltype(&cublasLtMatmulAlgoConfigGetAttribute) algo_config_get;
  decltype(&cublasLtMatmulAlgoConfigSetAttribute) algo_config_set;
  decltype(&cublasLtMatmulAlgoCheck) algo_check;
};

struct State {
  Table fn = {};
  bool loaded = false;
  std::string path;    // the file loaded
  std::string reason;  // why none was, with where it looked
};
State g_state;
std::once_flag g_once;

template <typename F>
bool bind(void* handle, const char* name, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(dlsym(handle, name));
  if (!*out) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *out != nullptr;
}

// Binds every function from handle; on success records the file it came from.
bool take(void* handle, std::string* why) {
  Table t;
  std::string missing;
  bool ok = bind(handle, "cublasLtCreate", &t.create, &missing);
  ok &= bind(handle, "cublasLtGetStatusName", &t.status_name, &missing);
  ok &= bind(handle, "cublasLtGetStatusString", &t.status_string, &missing);
  ok &= bind(handle, "cublasLtMatmulDescCreate", &t.desc_create, &missing);
  ok &= bind(handle, "cublasLtMatmulDescDestroy", &t.desc_destroy, &missing);
  ok &= bind(handle, "cublasLtMatmulDescSetAttribute", &t.desc_set, &missing);
  ok &= bind(handle, "cublasLtMatrixLayoutCreate", &t.layout_create, &missing);
  ok &= bind(handle, "cublasLtMatrixLayoutDestroy", &t.layout_destroy, &missing);
  ok &= bind(handle, "cublasLtMatmulPreferenceCreate", &t.pref_create, &missing);
  ok &= bind(handle, "cublasLtMatmulPreferenceDestroy", &t.pref_destroy, &missing);
  ok &= bind(handle, "cublasLtMatmulPreferenceSetAttribute", &t.pref_set, &missing);
  ok &= bind(handle, "cublasLtMatmulAlgoGetHeuristic", &t.heuristic, &missing);
  ok &= bind(handle, "cublasLtMatmul", &t.matmul, &missing);
  ok &= bind(handle, "cublasLtMatmulAlgoConfigGetAttribute", &t.algo_config_get, &missing);
  // optional: only batch_invariant's fallback to an unsplit algorithm calls them (absent, the
  // call answers CUBLAS_STATUS_NOT_INITIALIZED and that GEMM is refused with a message)
  std::string optional;
  bind(handle, "cublasLtMatmulAlgoConfigSetAttribute", &t.algo_config_set, &optional);
  bind(handle, "cublasLtMatmulAlgoCheck", &t.algo_check, &optional);
  if (!ok) {
    *why = "lacks " + missing;
    dlclose(handle);
    return false;
  }
  link_map* map = nullptr;
  g_state.path = dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && *map->l_name
                     ? map->l_name
                     : kSoname;
  g_state.fn = t;
  g_state.loaded = true;  // the handle stays open for the life of the process
  return true;
}

void note(std::string* tried, const std::string& what) {
  *tried += (tried->empty() ? "" : "; ") + what;
}

// One attempt: dlopen(what, flags); appends "<what>: <why not>" to the tried list on failure.
bool attempt(const std::string& what, int flags, const char* label, std::string* tried) {
  dlerror();
  void* handle = dlopen(what.c_str(), flags);
  std::string why;
  if (handle && take(handle, &why)) return true;
  if (!handle) {
    const char* e = dlerror();
    why = (flags & RTLD_NOLOAD) ? "not loaded" : (e ? e : "cannot be opened");
  }
  note(tried, std::string(label) + what + ": " + why);
  return false;
}

bool is_file(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string parent(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

// The folder two levels above this library's file (site-packages for a wheel's
// site-packages/fusedce/lib/libfusedce.so.0), from dladdr of a function in it; "" if unknown.
std::string site_dir() {
  Dl_info info = {};
  if (!dladdr(reinterpret_cast<void*>(&site_dir), &info) || !info.dli_fname) return "";
  char* real = realpath(info.dli_fname, nullptr);
  const std::string file = real ? real : info.dli_fname;
  std::free(real);
  return parent(parent(parent(file)));
}

void search() {
  std::string tried;
  const int flags = RTLD_NOW | RTLD_LOCAL;
  if (const char* env = std::getenv("FUSEDCE_CUBLASLT")) {
    if (!attempt(env, flags, "FUSEDCE_CUBLASLT=", &tried))
      g_state.reason = std::string(kSoname) + " (cuBLASLt) could not be loaded: " + tried;
    return;
  }
  if (attempt(kSoname, flags | RTLD_NOLOAD, "already in the process: ", &tried)) return;
  const std::string site = site_dir();
  if (!site.empty()) {
    const std::string wheel = site + "/" + kWheelDir + "/" + kSoname;
    if (is_file(wheel)) {
      if (attempt(wheel, flags, "beside the package: ", &tried)) return;
    } else {
      note(&tried, "beside the package: " + wheel + ": no such file");
    }
  }
  if (attempt(kSoname, flags, "the dynamic loader's path: ", &tried)) return;
#if defined(FCE_CUBLASLT_TOOLKIT_DIR)
  const std::string toolkit = std::string(FCE_CUBLASLT_TOOLKIT_DIR) + "/" + kSoname;
  if (is_file(toolkit)) {
    if (attempt(toolkit, flags, "the CUDA toolkit built with: ", &tried)) return;
  } else {
    note(&tried, "the CUDA toolkit built with: " + toolkit + ": no such file");
  }
#endif
  g_state.reason = std::string(kSoname) + " (cuBLASLt) not found; install the " + kWheel +
                   " wheel (pip) or a CUDA toolkit, or set FUSEDCE_CUBLASLT to the file. "
                   "Looked: " + tried;
}

}  // namespace

bool cublaslt_load() {
  std::call_once(g_once, search);
  return g_state.loaded;
}

}  // namespace cuda

const char* cuda_cublaslt(const char** why) {
  const bool ok = cuda::cublaslt_load();
  if (why) *why = ok ? nullptr : cuda::g_state.reason.c_str();
  return ok ? cuda::g_state.path.c_str() : nullptr;
}

}  // namespace fce

// ---- the forwarders: what common/gemm.cu links against. Reached only through the CUDA backend, which
// the ABI layer enables once cublaslt_load() succeeded (cuda_available()); a call that comes
// anyway gets CUBLAS_STATUS_NOT_INITIALIZED, never a null pointer's call.
namespace {
template <typename F, typename... A>
cublasStatus_t forward(F fce::cuda::Table::*fn, A... args) {
  fce::cuda::cublaslt_load();
  const F f = fce::cuda::g_state.fn.*fn;
  return f ? f(args...) : CUBLAS_STATUS_NOT_INITIALIZED;
}
template <typename F>
const char* name_of(F fce::cuda::Table::*fn, cublasStatus_t status, const char* fallback) {
  fce::cuda::cublaslt_load();
  const F f = fce::cuda::g_state.fn.*fn;
  return f ? f(status) : fallback;
}
using fce::cuda::Table;
}  // namespace

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) { return forward(&Table::create, handle); }
const char* cublasLtGetStatusName(cublasStatus_t status) {
  return name_of(&Table::status_name, status, "CUBLAS_STATUS_NOT_INITIALIZED");
}
const char* cublasLtGetStatusString(cublasStatus_t status) {
  return name_of(&Table::status_string, status, "cuBLASLt is not loaded");
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
  return forward(&Table::desc_create, desc, compute, scale);
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  return forward(&Table::desc_destroy, desc);
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc,
                                              cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t size) {
  return forward(&Table::desc_set, desc, attr, buf, size);
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
  return forward(&Table::layout_create, layout, type, rows, cols, ld);
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  return forward(&Table::layout_destroy, layout);
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  return forward(&Table::pref_create, pref);
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  return forward(&Table::pref_destroy, pref);
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void* buf, size_t size) {
  return forward(&Table::pref_set, pref, attr, buf, size);
}
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle,
                                              cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[],
                                              int* returned) {
  return forward(&Table::heuristic, handle, desc, a, b, c, d, pref, requested, results, returned);
}
cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                              const void* alpha, const void* a, cublasLtMatrixLayout_t a_layout,
                              const void* b, cublasLtMatrixLayout_t b_layout, const void* beta,
                              const void* c, cublasLtMatrixLayout_t c_layout, void* d,
                              cublasLtMatrixLayout_t d_layout, const cublasLtMatmulAlgo_t* algo,
                              void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  return forward(&Table::matmul, handle, desc, alpha, a, a_layout, b, b_layout, beta, c, c_layout,
                 d, d_layout, algo, workspace, workspace_bytes, stream);
}

cublasStatus_t cublasLtMatmulAlgoConfigGetAttribute(const cublasLtMatmulAlgo_t* algo,
                                                    cublasLtMatmulAlgoConfigAttributes_t attr,
                                                    void* buf, size_t size, size_t* written) {
  return forward(&Table::algo_config_get, algo, attr, buf, size, written);
}

cublasStatus_t cublasLtMatmulAlgoConfigSetAttribute(cublasLtMatmulAlgo_t* algo,
                                                    cublasLtMatmulAlgoConfigAttributes_t attr,
                                                    const void* buf, size_t size) {
  return forward(&Table::algo_config_set, algo, attr, buf, size);
}

cublasStatus_t cublasLtMatmulAlgoCheck(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                       cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                       cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                       const cublasLtMatmulAlgo_t* algo,
                                       cublasLtMatmulHeuristicResult_t* result) {
  return forward(&Table::algo_check, handle, desc, a, b, c, d, algo, result);
}

}  // extern "C"
