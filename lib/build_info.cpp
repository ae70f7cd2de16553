// build_info.cpp — fce_build_info(): what this library was built with and runs on, one line,
// for bug reports, `python -m fusedce` and the demo: version, backends (CUDA architectures and
// toolkit, whether a device is visible, the cuBLASLt file loaded or why none was), and the CPU
// backend's BLAS (for OpenBLAS its own
// configuration string and thread count, read at run time from the library actually loaded).
#include <cstdio>
#include <mutex>
#include <string>

#include "fusedce.h"
#include "internal.h"

#if defined(FCE_BLAS_OPENBLAS)
#include "cpu/blas.h"  // openblas_get_config, openblas_get_num_threads (OpenBLAS's cblas.h)
#endif

#ifndef FCE_BLAS_NAME
#define FCE_BLAS_NAME "unknown"
#endif
#ifndef FCE_BLAS_LIBRARIES
#define FCE_BLAS_LIBRARIES ""
#endif

FCE_API const char* fce_build_info(void) {
  static std::once_flag once;
  static std::string info;
  std::call_once(once, [] {
    char head[64];
    std::snprintf(head, sizeof head, "fusedce %d.%d.%d", FCE_VERSION_MAJOR, FCE_VERSION_MINOR,
                  FCE_VERSION_PATCH);
    info = head;
#if defined(FCE_WITH_CUDA)
    info += "; backends: cpu, cuda (sm " FCE_CUDA_ARCHS ", CUDA " FCE_CUDA_TOOLKIT "; device ";
    info += fce::cuda_device_visible() ? "visible)" : "not visible)";
    const char* why = nullptr;
    const char* cublaslt = fce::cuda_cublaslt(&why);
    info += "; cuBLASLt: ";
    info += cublaslt ? cublaslt : "not loaded: ";
    if (!cublaslt) info += why;
#else
    info += "; backends: cpu (built without CUDA)";
#endif
#if defined(FCE_BLAS_OPENBLAS)
    const char* config = openblas_get_config();
    char threads[32];
    std::snprintf(threads, sizeof threads, ", %d threads", openblas_get_num_threads());
    info += "; BLAS: OpenBLAS (";
    info += config ? config : "?";
    info += threads;
    info += ")";
#else
    info += "; BLAS: " FCE_BLAS_NAME " (" FCE_BLAS_LIBRARIES ")";
#endif
  });
  return info.c_str();
}
