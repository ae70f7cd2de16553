// scale.cpp — fce_scale_gradient on the CPU: grad[i] *= *scale in float32, rounded once to the
// dtype (the same arithmetic as the CUDA kernel), nothing done when the scale is exactly 1.
#include "common.h"

namespace fce {

fce_status cpu_scale_gradient(int dtype, int64_t count, void* grad, const float* scale) {
  using namespace cpu;
  const float g = *scale;
  if (g == 1.0f) return FCE_SUCCESS;
  parallel_for(count, thread_count(count, int64_t(1) << 16), [&](int64_t begin, int64_t end, int) {
    for (int64_t i = begin; i < end; ++i) store_float(dtype, grad, i, load_float(dtype, grad, i) * g);
  });
  return FCE_SUCCESS;
}

}  // namespace fce
