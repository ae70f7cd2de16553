// common/knobs.cpp — knobs(): the environment variables of common/knobs.h, read once. A value
// out of its range leaves the default.
#include "cuda/common/knobs.h"

#include <cstdlib>
#include <cstring>

namespace fce {
namespace cuda {

namespace {

Knobs read_knobs() {
  Knobs k;
  if (const char* s = std::getenv("FCE_CUDA_CE_PATH")) {
    if (!std::strcmp(s, "regs")) k.path = 1;
    else if (!std::strcmp(s, "twopass")) k.path = 2;
    else if (!std::strcmp(s, "bulk")) k.bulk = 2;
    else if (!std::strcmp(s, "nobulk")) k.bulk = 0;
  }
  if (const char* s = std::getenv("FCE_CUDA_CE_SMEM")) {
    if (!std::strcmp(s, "always")) {
      k.smem_always = true;
      k.bulk_grad = false;
    } else if (*s >= '0' && *s <= '9') {
      const int v = std::atoi(s);
      if (v >= 0 && v <= 12) k.reg_smem = v;
    }
  }
  if (const char* s = std::getenv("FCE_CUDA_CE_CLUSTER")) {
    const int v = std::atoi(s);
    if (v >= 1 && v <= 16) k.cluster = v;
  }
  if (const char* s = std::getenv("FCE_CUDA_PORTABLE")) k.portable = std::atoi(s) == 1;
  if (const char* s = std::getenv("FCE_LINEAR_CE_PLAN"))
    k.linear_sliced = !std::strcmp(s, "sliced");
  return k;
}

}  // namespace

const Knobs& knobs() {
  static const Knobs k = read_knobs();
  return k;
}

}  // namespace cuda
}  // namespace fce
