// common.h — what every CPU kernel needs: float16/bfloat16 <-> float conversion (round to
// nearest even, as the hardware does), whole-row loads into double and stores from double, and
// a static parallel-for over rows on std::thread. Static chunks and per-row results that do not
// depend on the thread that computed them keep every result deterministic.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "internal.h"

namespace fce {
namespace cpu {

// ---------------------------------------------------------------- conversions ----

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even; overflow carries into inf
  return uint16_t(u >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = std::ldexp(float(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t float_to_f16(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // quiet NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);     // >= 65520 rounds to inf
  if (a >= 0x38800000u) {                                    // normal in f16 (>= 2^-14)
    const uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u);  // nearest even on 13 dropped bits
    return uint16_t(sign | ((rounded >> 13) - (112u << 10)));
  }
  if (a <= 0x33000000u) return sign;  // <= 2^-25: rounds to (signed) zero
  // Subnormal in f16: units of 2^-24, rounded to nearest even.
  const uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;
  const int shift = 126 - int(a >> 23);  // 14..24
  const uint32_t rest = mantissa & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  uint32_t units = mantissa >> shift;
  if (rest > half || (rest == half && (units & 1u))) ++units;
  return uint16_t(sign | units);
}

// double -> float rounding to odd: the float neighbour towards zero, with its last bit set when
// inexact. Rounding that to f16 or bf16 (11 or 8 significant bits, well under float's 24 - 2)
// gives the correctly rounded double -> f16/bf16 result, with no double-rounding error.
inline float double_to_float_odd(double d) {
  float f = float(d);
  if (std::isnan(d) || std::isinf(d) || double(f) == d) return f;
  if (std::fabs(double(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
  return bits_float(float_bits(f) | 1u);
}

inline float load_float(int dtype, const void* base, int64_t i) {
  switch (dtype) {
    case FCE_FLOAT16: return f16_to_float(static_cast<const uint16_t*>(base)[i]);
    case FCE_BFLOAT16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

inline void store_float(int dtype, void* base, int64_t i, float x) {
  switch (dtype) {
    case FCE_FLOAT16: static_cast<uint16_t*>(base)[i] = float_to_f16(x); break;
    case FCE_BFLOAT16: static_cast<uint16_t*>(base)[i] = float_to_bf16(x); break;
    default: static_cast<float*>(base)[i] = x; break;
  }
}

// Elements [0, n) of a row of `dtype` at src, widened to double.
inline void load_row(int dtype, const void* src, int64_t n, double* dst) {
  switch (dtype) {
    case FCE_FLOAT16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t j = 0; j < n; ++j) dst[j] = f16_to_float(s[j]);
      break;
    }
    case FCE_BFLOAT16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t j = 0; j < n; ++j) dst[j] = bf16_to_float(s[j]);
      break;
    }
    default: {
      const float* s = static_cast<const float*>(src);
      for (int64_t j = 0; j < n; ++j) dst[j] = s[j];
      break;
    }
  }
}

// Elements [0, n) of src, rounded once (nearest even) to `dtype` at dst.
inline void store_row(int dtype, const double* src, int64_t n, void* dst) {
  switch (dtype) {
    case FCE_FLOAT16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t j = 0; j < n; ++j) d[j] = float_to_f16(double_to_float_odd(src[j]));
      break;
    }
    case FCE_BFLOAT16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t j = 0; j < n; ++j) d[j] = float_to_bf16(double_to_float_odd(src[j]));
      break;
    }
    default: {
      float* d = static_cast<float*>(dst);
      for (int64_t j = 0; j < n; ++j) d[j] = float(src[j]);
      break;
    }
  }
}

// x rounded once (nearest even) to `dtype`, at element i of base.
inline void store_double(int dtype, void* base, int64_t i, double x) {
  switch (dtype) {
    case FCE_FLOAT16: static_cast<uint16_t*>(base)[i] = float_to_f16(double_to_float_odd(x)); break;
    case FCE_BFLOAT16:
      static_cast<uint16_t*>(base)[i] = float_to_bf16(double_to_float_odd(x));
      break;
    default: static_cast<float*>(base)[i] = float(x); break;
  }
}

// n copies of value (0 or NaN) as `dtype` at dst.
inline void fill_row(int dtype, void* dst, int64_t n, float value) {
  for (int64_t j = 0; j < n; ++j) store_float(dtype, dst, j, value);
}

// Elements [0, n) of a row of src_dtype at src, as float32 at dst.
inline void convert_row_to_float(int src_dtype, const void* src, int64_t n, float* dst) {
  for (int64_t j = 0; j < n; ++j) dst[j] = load_float(src_dtype, src, j);
}

// ---------------------------------------------------------------- parallel for ----

// How many threads parallel_for uses for `work` items when each thread should get at least
// `min_items_per_thread`: min(hardware_concurrency, work / min_items_per_thread), at least 1.
inline int thread_count(int64_t work, int64_t min_items_per_thread = 1) {
  const int64_t hardware = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t by_work = work / std::max<int64_t>(1, min_items_per_thread);
  return int(std::max<int64_t>(1, std::min(hardware, by_work)));
}

// Calls body(begin, end, thread) on `threads` static, contiguous chunks of [0, work): chunk t is
// [t * ceil(work / threads), ...). The calling thread runs the last chunk. body must not throw.
// If a thread cannot be started, its chunk runs on the calling thread: same chunks, same results.
template <class Body>
void parallel_for(int64_t work, int threads, Body&& body) {
  if (work <= 0) return;
  threads = int(std::max<int64_t>(1, std::min<int64_t>(threads, work)));
  const int64_t chunk = (work + threads - 1) / threads;
  std::vector<std::thread> pool;
  std::vector<int> not_started;
  pool.reserve(size_t(threads));
  not_started.reserve(size_t(threads));
  for (int t = 0; t + 1 < threads; ++t) {
    const int64_t begin = int64_t(t) * chunk, end = std::min(work, begin + chunk);
    if (begin >= end) continue;
    try {
      pool.emplace_back([&body, begin, end, t] { body(begin, end, t); });
    } catch (...) {
      not_started.push_back(t);
    }
  }
  const int last = threads - 1;
  const int64_t last_begin = int64_t(last) * chunk;
  if (last_begin < work) body(last_begin, work, last);
  for (int t : not_started) body(int64_t(t) * chunk, std::min(work, int64_t(t + 1) * chunk), t);
  for (std::thread& thread : pool) thread.join();
}

}  // namespace cpu
}  // namespace fce
