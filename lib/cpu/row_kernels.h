// row_kernels.h — the float32 hot loops of a cross-entropy row (row_kernels.cpp), vectorised by
// the compiler and cloned per instruction set (AVX-512, AVX2+FMA, baseline x86-64) with the
// clone picked at load time: a row's maximum, Σ exp(a_j − m) in double, the smoothing sum in
// double, and the gradient row. exp is a float32 polynomial (fast_expf, within 2 ulp).
#pragma once

#include <cstdint>

namespace fce {
namespace cpu {

// The largest entry of a[0, n), NaNs skipped (−inf when there is none); *nan_seen when some
// entry is NaN.
float row_max_f32(const float* a, int64_t n, bool* nan_seen);

// Σ_j exp(a_j − m) accumulated in double (in a fixed order: deterministic), m finite.
double sum_exp_f32(const float* a, int64_t n, float m);

// Σ_j ω_j ((m − a_j) + log_s) in double (ω_j = 1 when w is nullptr).
double smooth_sum_f32(const float* a, int64_t n, double m, double log_s, const float* w);

// out_j = g · (A · p_j + B · ω_j), p_j = fast_expf((a_j − m) − log_s), in float32 (ω_j = 1 when
// w is nullptr). out may be a.
void gradient_f32(const float* a, int64_t n, float m, float log_s, float A, float B,
                  const float* w, float g, float* out);

// fast_expf for one value (the same arithmetic as the loops).
float expf_f32(float x);

}  // namespace cpu
}  // namespace fce
