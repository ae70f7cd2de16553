// exact_sum.h — a sum of floats whose result does not depend on the order or the grouping of its
// terms (docs/semantics.md rule 21: the vocabulary-parallel statistics under
// options->batch_invariant, the same bits whatever the number of shards). For the CPU backend
// and the CUDA kernels alike (host and device functions).
//
// Every finite float is m · 2^e with m < 2^24 an integer. The sum keeps integer bins of 32 bits at
// fixed places of the binary scale: bin k holds the bits of weight 2^(32k) .. 2^(32k+31) of its
// terms, in an int64, signed and never carried into its neighbour (each term adds less than 2^32
// to a bin: 2^31 terms fit). A sum keeps the kExactBins bins from its top down, the top being the
// highest bin any of its terms reaches; a term's bits below them are dropped. Which bits are
// kept is thus a function of the terms alone (the top is a maximum), and the kept bins are
// integer sums: two partial sums merged in any order give the same bins, and so the same value.
// Dropped: less than 2^31 terms of 2^(32·(top − kExactBins + 1)) each, that is, relative to the
// largest term, under 2^-33 for kExactBins = 3.
//
// The ±inf and NaN terms are summed apart, in a float (the sum of such values is order-free:
// NaN, or an infinity of their one sign); 0 when there is none.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FCE_EXACT_FN __host__ __device__ __forceinline__
#else
#define FCE_EXACT_FN inline
#endif

namespace fce {

constexpr int kExactBins = 3;
constexpr int64_t kExactNoTop = INT64_MIN;  // the top of a sum of no term
// Terms of exp(a) are m · 2^n with n = floor(a · log2 e): |a · log2 e| must stay below this, or
// the term is a NaN (the logits of a row beyond ±2^60 after scale and cap).
constexpr double kExactExpLimit = 4611686018427387904.0;  // 2^62

struct ExactSum {
  int64_t bin[kExactBins];  // bin[i] is bin top − (kExactBins − 1) + i
  int64_t top;              // kExactNoTop: no finite term yet
  float nonfinite;          // the sum of the ±inf / NaN terms, 0 when none
};

FCE_EXACT_FN ExactSum exact_zero() {
  ExactSum s;
  for (int i = 0; i < kExactBins; ++i) s.bin[i] = 0;
  s.top = kExactNoTop;
  s.nonfinite = 0.f;
  return s;
}

// Moves the top up to t (bins below t − kExactBins + 1 are dropped).
FCE_EXACT_FN void exact_raise(ExactSum& s, int64_t t) {
  if (s.top == kExactNoTop) {
    s.top = t;  // the bins are all 0
    return;
  }
  const int64_t d = t - s.top;
  if (d <= 0) return;
  for (int i = 0; i < kExactBins; ++i) s.bin[i] = i + d < kExactBins ? s.bin[i + d] : 0;
  s.top = t;
}

// s += (negative ? −1 : 1) · m · 2^e, m < 2^24.
FCE_EXACT_FN void exact_add_bits(ExactSum& s, bool negative, uint32_t m, int64_t e) {
  if (m == 0) return;
  const int64_t k0 = e >= 0 ? e / 32 : -((31 - e) / 32);  // floor(e / 32)
  const int p = static_cast<int>(e - k0 * 32);            // in [0, 32)
  const uint64_t w = static_cast<uint64_t>(m) << p;       // < 2^55
  const int64_t lo = static_cast<int64_t>(w & 0xffffffffu), hi = static_cast<int64_t>(w >> 32);
  exact_raise(s, hi ? k0 + 1 : k0);
  const int64_t i0 = k0 - (s.top - (kExactBins - 1));  // ≤ kExactBins − 1; < 0: dropped
  if (i0 >= 0) s.bin[i0] += negative ? -lo : lo;
  if (hi && i0 + 1 >= 0) s.bin[i0 + 1] += negative ? -hi : hi;
}

// s += x · 2^n for a float x (any: a non-finite one goes to the non-finite sum).
FCE_EXACT_FN void exact_add(ExactSum& s, float x, int64_t n = 0) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  const int eb = static_cast<int>((u >> 23) & 0xffu);
  if (eb == 0xff) {
    s.nonfinite += x;
    return;
  }
  const uint32_t frac = u & 0x7fffffu;
  const uint32_t m = eb ? (frac | 0x800000u) : frac;  // subnormals: no implicit bit
  exact_add_bits(s, (u >> 31) != 0, m, n + (eb ? eb : 1) - 150);
}

// s += x · y · 2^n exactly: the product's rounded float and its remainder (an FMA's), two terms.
FCE_EXACT_FN void exact_add_product(ExactSum& s, float x, float y, int64_t n = 0) {
#if defined(__CUDA_ARCH__)
  const float hi = __fmul_rn(x, y);  // never contracted into the FMA below
#else
  const float hi = x * y;
#endif
  if (!(hi - hi == 0.f)) {  // ±inf or NaN
    s.nonfinite += hi;
    return;
  }
  exact_add(s, hi, n);
  exact_add(s, fmaf(x, y, -hi), n);
}

// s += exp(a) for a float a (−inf adds nothing); *mant and *n receive the term as mant · 2^n
// (mant in [1, 2), 0 for −inf), for the terms that scale by it (exp(a) · a).
FCE_EXACT_FN void exact_add_exp(ExactSum& s, float a, float* mant, int64_t* n) {
  *mant = 0.f;
  *n = 0;
  if (a == -INFINITY) return;
  const double t = static_cast<double>(a) * 1.4426950408889634;  // log2 e
  // NaN, ±inf, or beyond the range
  if (!(t < kExactExpLimit && t > -kExactExpLimit)) {
    s.nonfinite += NAN;
    return;
  }
  const double k = floor(t);
  *n = static_cast<int64_t>(k);
  *mant = exp2f(static_cast<float>(t - k));  // t − k in [0, 1), exact in double
  exact_add(s, *mant, *n);
}

// Merges y into x.
FCE_EXACT_FN void exact_merge(ExactSum& x, const ExactSum& y) {
  x.nonfinite += y.nonfinite;
  if (y.top == kExactNoTop) return;
  const int64_t t = x.top == kExactNoTop || y.top > x.top ? y.top : x.top;
  exact_raise(x, t);
  const int64_t d = t - y.top;  // y's bins sit d lower
  for (int i = 0; i < kExactBins; ++i)
    if (i - d >= 0) x.bin[i - d] += y.bin[i];
}

// The sum as d · 2^(*scale) in double (d 0 for no term; rounded, the same bits for the same
// bins). The non-finite part is the caller's to look at.
FCE_EXACT_FN double exact_mantissa(const ExactSum& s, int64_t* scale) {
  if (s.top == kExactNoTop) {
    *scale = 0;
    return 0.0;
  }
  *scale = 32 * (s.top - (kExactBins - 1));
  double d = 0.0;
  for (int i = kExactBins - 1; i >= 0; --i) d = d * 4294967296.0 + static_cast<double>(s.bin[i]);
  return d;
}

// The sum in double (its non-finite part added): for sums of ordinary magnitude.
FCE_EXACT_FN double exact_value(const ExactSum& s) {
  int64_t scale = 0;
  const double d = exact_mantissa(s, &scale);
  const int e = static_cast<int>(scale < -4000 ? -4000 : scale > 4000 ? 4000 : scale);
  return (d == 0.0 ? 0.0 : ldexp(d, e)) + static_cast<double>(s.nonfinite);
}

// The natural log of a positive sum (−inf for no term).
FCE_EXACT_FN double exact_log(const ExactSum& s) {
  int64_t scale = 0;
  const double d = exact_mantissa(s, &scale);
  return log(d) + static_cast<double>(scale) * 0.6931471805599453;
}

// x / y of two sums, y > 0.
FCE_EXACT_FN double exact_ratio(const ExactSum& x, const ExactSum& y) {
  int64_t sx = 0, sy = 0;
  const double dx = exact_mantissa(x, &sx), dy = exact_mantissa(y, &sy);
  if (dx == 0.0) return 0.0;
  const int64_t d = sx - sy;
  return ldexp(dx / dy, static_cast<int>(d < -4000 ? -4000 : d > 4000 ? 4000 : d));
}

// A sum in 10 float32 slots of a statistics row (8-byte aligned): the bins, the top, the
// non-finite sum, one slot unused.
constexpr int kExactSlots = 10;
FCE_EXACT_FN void exact_store(const ExactSum& s, float* out) {
  memcpy(out, s.bin, sizeof s.bin);
  memcpy(out + 2 * kExactBins, &s.top, sizeof s.top);
  out[2 * kExactBins + 2] = s.nonfinite;
  out[2 * kExactBins + 3] = 0.f;
}
FCE_EXACT_FN ExactSum exact_load(const float* in) {
  ExactSum s;
  memcpy(s.bin, in, sizeof s.bin);
  memcpy(&s.top, in + 2 * kExactBins, sizeof s.top);
  s.nonfinite = in[2 * kExactBins + 2];
  return s;
}

}  // namespace fce
