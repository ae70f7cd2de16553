// harness/numbers.h — number formats: dtype sizes and names, host-side float16 / bfloat16
// conversion, reading and writing one element of any dtype, unit roundoffs. No gtest: the fuzz
// target uses it too.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "fusedce.h"

namespace fcet {

inline size_t dtype_size(int dtype) {
  switch (dtype) {
    case FCE_FLOAT32: return 4;
    case FCE_FLOAT16: return 2;
    case FCE_BFLOAT16: return 2;
    case FCE_INT32: return 4;
    case FCE_INT64: return 8;
    default: return 0;
  }
}

inline const char* dtype_name(int dtype) {
  switch (dtype) {
    case FCE_FLOAT32: return "f32";
    case FCE_FLOAT16: return "f16";
    case FCE_BFLOAT16: return "bf16";
    case FCE_INT32: return "i32";
    case FCE_INT64: return "i64";
    default: return "unknown";
  }
}

inline const char* reduction_name(int r) {
  switch (r) {
    case FCE_REDUCTION_MEAN: return "mean";
    case FCE_REDUCTION_SUM: return "sum";
    case FCE_REDUCTION_NONE: return "none";
    default: return "unknown";
  }
}

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float -> bfloat16, round to nearest even (NaN stays NaN).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// double -> IEEE binary16, round to nearest even, subnormals and overflow to inf included.
inline uint16_t f64_to_f16(double v) {
  if (std::isnan(v)) return 0x7e00;
  uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  double a = std::fabs(v);
  if (a >= 65520.0) return sign | 0x7c00;                  // rounds to inf
  if (a < std::ldexp(1.0, -14)) {                           // subnormal (or zero)
    double m = std::nearbyint(a * std::ldexp(1.0, 24));     // units of 2^-24; 1024 = min normal
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(m));
  }
  int ex;
  std::frexp(a, &ex);                                       // a = f * 2^ex, f in [0.5, 1)
  int e = ex - 1;                                           // a in [2^e, 2^(e+1))
  double m = std::nearbyint((std::ldexp(a, -e) - 1.0) * 1024.0);
  if (m >= 1024.0) {
    m = 0;
    ++e;
  }
  if (e > 15) return sign | 0x7c00;
  return static_cast<uint16_t>(sign | ((e + 15) << 10) | static_cast<uint16_t>(m));
}
inline double f16_to_f64(uint16_t h) {
  int sign = (h >> 15) & 1, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v;
  if (e == 0) v = std::ldexp(static_cast<double>(m), -24);
  else if (e == 31) v = m ? std::numeric_limits<double>::quiet_NaN() : HUGE_VAL;
  else v = std::ldexp(1.0 + m / 1024.0, e - 15);
  return sign ? -v : v;
}

// Writes v, rounded to dtype, at dst. Reads one element of dtype as a double.
inline void put(int dtype, void* dst, double v) {
  switch (dtype) {
    case FCE_FLOAT32: { float f = static_cast<float>(v); std::memcpy(dst, &f, 4); break; }
    case FCE_FLOAT16: { uint16_t h = f64_to_f16(v); std::memcpy(dst, &h, 2); break; }
    case FCE_BFLOAT16: { uint16_t h = f32_to_bf16(static_cast<float>(v)); std::memcpy(dst, &h, 2); break; }
    case FCE_INT32: { int32_t i = static_cast<int32_t>(v); std::memcpy(dst, &i, 4); break; }
    case FCE_INT64: { int64_t i = static_cast<int64_t>(v); std::memcpy(dst, &i, 8); break; }
    default: std::abort();
  }
}
inline double get(int dtype, const void* src) {
  switch (dtype) {
    case FCE_FLOAT32: { float f; std::memcpy(&f, src, 4); return f; }
    case FCE_FLOAT16: { uint16_t h; std::memcpy(&h, src, 2); return f16_to_f64(h); }
    case FCE_BFLOAT16: { uint16_t h; std::memcpy(&h, src, 2); return bf16_to_f32(h); }
    case FCE_INT32: { int32_t i; std::memcpy(&i, src, 4); return i; }
    case FCE_INT64: { int64_t i; std::memcpy(&i, src, 8); return static_cast<double>(i); }
    default: std::abort();
  }
}
// v rounded to dtype, as a double (what the library will see).
inline double round_to(int dtype, double v) {
  unsigned char b[8];
  put(dtype, b, v);
  return get(dtype, b);
}

// Unit roundoff of a dtype (half the distance from 1 to the next number).
inline double unit_roundoff(int dtype) {
  switch (dtype) {
    case FCE_FLOAT16: return std::ldexp(1.0, -11);
    case FCE_BFLOAT16: return std::ldexp(1.0, -8);
    default: return std::ldexp(1.0, -24);
  }
}

}  // namespace fcet
