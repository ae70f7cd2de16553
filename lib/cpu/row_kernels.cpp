// row_kernels.cpp — see row_kernels.h. Plain loops over fixed-width blocks that GCC vectorises;
// every function is compiled three times (target_clones) and the best clone for the machine is
// used. Sums run over kLanes independent double accumulators added in a fixed order, so a
// result depends on the data only (and on the clone: FMA contraction), never on threads.
#include "row_kernels.h"

#include <cmath>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(FCE_NO_CLONES)
#define FCE_CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define FCE_CLONES
#endif

namespace fce {
namespace cpu {
namespace {

constexpr int kLanes = 16;

// exp(x) in float32, Cephes expf's range reduction and polynomial: x = n ln2 + r, |r| <= ln2/2,
// exp(r) = 1 + r + r² P(r), times 2^n built in two halves (so that subnormal results round
// once). x <= −104 (−inf included) gives 0, x > 88.72 gives +inf, NaN gives NaN. Branch free.
inline __attribute__((always_inline)) float fast_expf(float x) {
  const float hi = 88.7228394f, lo = -104.0f;
  float xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const float magic = 12582912.0f;  // 1.5 · 2^23: adding it rounds to an integer
  const float t = xc * 1.44269504088896341f + magic;
  const float n = t - magic;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t ti;
  std::memcpy(&ti, &t, 4);
  const int32_t ni = ti - 0x4b400000;  // n as an integer, in [−150, 128]
  const int32_t n1 = ni >> 1, n2 = ni - n1;
  // unsigned: for a NaN or ±inf x (whose result is chosen below) the exponent is garbage, and a
  // signed shift out of range would be undefined behaviour
  const uint32_t b1 = static_cast<uint32_t>(n1 + 127) << 23, b2 = static_cast<uint32_t>(n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, 4);
  std::memcpy(&s2, &b2, 4);
  float e = (p * s1) * s2;
  e = x > hi ? std::numeric_limits<float>::infinity() : e;
  return x != x ? x : e;
}

}  // namespace

float expf_f32(float x) { return fast_expf(x); }

FCE_CLONES float row_max_f32(const float* a, int64_t n, bool* nan_seen) {
  float m[kLanes];
  int nan[kLanes];
  for (int l = 0; l < kLanes; ++l) m[l] = -std::numeric_limits<float>::infinity(), nan[l] = 0;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float v = a[j + l];
      m[l] = v > m[l] ? v : m[l];
      nan[l] |= v != v;
    }
  float best = -std::numeric_limits<float>::infinity();
  int any = 0;
  for (; j < n; ++j) {
    best = a[j] > best ? a[j] : best;
    any |= a[j] != a[j];
  }
  for (int l = 0; l < kLanes; ++l) {
    best = m[l] > best ? m[l] : best;
    any |= nan[l];
  }
  *nan_seen = any != 0;
  return best;
}

FCE_CLONES double sum_exp_f32(const float* a, int64_t n, float m) {
  double acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    float e[kLanes];
    for (int l = 0; l < kLanes; ++l) e[l] = fast_expf(a[j + l] - m);
    for (int l = 0; l < kLanes; ++l) acc[l] += double(e[l]);
  }
  double tail = 0.0;
  for (; j < n; ++j) tail += double(fast_expf(a[j] - m));
  double s = 0.0;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s + tail;
}

FCE_CLONES double smooth_sum_f32(const float* a, int64_t n, double m, double log_s,
                                 const float* w) {
  double acc[kLanes] = {};
  int64_t j = 0;
  if (w) {
    for (; j + kLanes <= n; j += kLanes)
      for (int l = 0; l < kLanes; ++l)
        acc[l] += double(w[j + l]) * ((m - double(a[j + l])) + log_s);
  } else {
    for (; j + kLanes <= n; j += kLanes)
      for (int l = 0; l < kLanes; ++l) acc[l] += (m - double(a[j + l])) + log_s;
  }
  double tail = 0.0;
  for (; j < n; ++j) tail += (w ? double(w[j]) : 1.0) * ((m - double(a[j])) + log_s);
  double s = 0.0;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s + tail;
}

FCE_CLONES void gradient_f32(const float* a, int64_t n, float m, float log_s, float A, float B,
                             const float* w, float g, float* out) {
  if (w) {
    for (int64_t j = 0; j < n; ++j) {
      const float p = fast_expf((a[j] - m) - log_s);
      out[j] = g * (A * p + B * w[j]);
    }
  } else if (B != 0.0f) {
    for (int64_t j = 0; j < n; ++j) {
      const float p = fast_expf((a[j] - m) - log_s);
      out[j] = g * (A * p + B);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const float p = fast_expf((a[j] - m) - log_s);
      out[j] = g * (A * p);
    }
  }
}

}  // namespace cpu
}  // namespace fce
