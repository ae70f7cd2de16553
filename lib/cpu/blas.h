// blas.h — the CPU backend's BLAS: the cblas.h of the BLAS it is built with (CMakeLists.txt,
// FCE_BLAS). PyPI's scipy-openblas32 (FCE_BLAS=scipy-openblas, what the wheels link) prefixes
// every symbol with scipy_ so that it never clashes with another OpenBLAS in the process: the
// names used here map to those.
#pragma once

#include <cblas.h>

#if defined(FCE_BLAS_SCIPY_OPENBLAS)
#define cblas_sgemm scipy_cblas_sgemm
#define openblas_get_config scipy_openblas_get_config
#define openblas_get_num_threads scipy_openblas_get_num_threads
#endif
