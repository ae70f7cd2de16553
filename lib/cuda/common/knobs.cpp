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
  }
  if (const char* s = std::getenv("FCE_CUDA_CE_CLUSTER")) {
    const int v = std::atoi(s);
    if (v >= 1 && v <= 16) k.cluster = v;
  }
  if (const char* s = std::getenv("FCE_CUDA_CE_PREFETCH")) {
    const float w = static_cast<float>(std::atof(s));
    if (w >= 0.f && w <= 16.f) k.prefetch_waves = w;
  }
  if (const char* s = std::getenv("FCE_CUDA_CE_XMBAR")) k.xmbar = std::atoi(s) != 0;
  if (const char* s = std::getenv("FCE_CUDA_CE_PDL")) k.pdl = std::atoi(s) != 0;
  if (const char* s = std::getenv("FCE_CUDA_CE_BULK")) k.bulk = std::atoi(s);
  if (const char* s = std::getenv("FCE_CUDA_CE_BULK_GRAD")) k.bulk_grad = std::atoi(s) != 0;
  if (const char* s = std::getenv("FCE_CUDA_CE_SMEM")) {
    const int v = std::atoi(s);
    if (v >= 0 && v <= 12) k.reg_smem = v;
  }
  if (const char* s = std::getenv("FCE_CUDA_CE_SMEM_ALWAYS")) k.smem_always = std::atoi(s) == 1;
  if (const char* s = std::getenv("FCE_CUDA_PORTABLE")) k.portable = std::atoi(s) == 1;
  return k;
}

}  // namespace

const Knobs& knobs() {
  static const Knobs k = read_knobs();
  return k;
}

}  // namespace cuda
}  // namespace fce
