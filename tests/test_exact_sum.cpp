// test_exact_sum.cpp — lib/exact_sum.h, the order-free sums of the vocabulary-parallel
// statistics under options->batch_invariant: the same bins for any order and grouping of the
// terms (shuffled, split into parts merged in any order), exactness against 128-bit fixed point
// where nothing is dropped, the exp terms and log of a sum of them against double, and the
// non-finite terms.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "exact_sum.h"

namespace {

using fce::ExactSum;

std::vector<uint8_t> bytes(const ExactSum& s) {
  float slots[fce::kExactSlots];
  fce::exact_store(s, slots);
  std::vector<uint8_t> b(sizeof slots);
  std::memcpy(b.data(), slots, sizeof slots);
  return b;
}

ExactSum sum_of(const std::vector<float>& x) {
  ExactSum s = fce::exact_zero();
  for (float v : x) fce::exact_add(s, v);
  return s;
}

// Terms over a wide range of magnitudes and both signs.
std::vector<float> terms(std::mt19937& rng, int n, int min_exp, int max_exp) {
  std::uniform_real_distribution<float> mant(1.f, 2.f);
  std::uniform_int_distribution<int> ex(min_exp, max_exp), sign(0, 1);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = (sign(rng) ? -1.f : 1.f) * std::ldexp(mant(rng), ex(rng));
  return x;
}

TEST(ExactSum, OrderAndGroupingDoNotMatter) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> x = terms(rng, 3000, -140, 120);  // subnormals to 2^120: bins dropped
    const std::vector<uint8_t> ref = bytes(sum_of(x));
    std::shuffle(x.begin(), x.end(), rng);
    EXPECT_EQ(bytes(sum_of(x)), ref) << "shuffled, trial " << trial;
    // split into parts at random places, the parts merged in reverse order
    std::vector<ExactSum> parts;
    size_t at = 0;
    while (at < x.size()) {
      const size_t n = std::min(x.size() - at, size_t(1 + rng() % 500));
      parts.push_back(sum_of(std::vector<float>(x.begin() + long(at), x.begin() + long(at + n))));
      at += n;
    }
    ExactSum merged = fce::exact_zero();
    for (auto it = parts.rbegin(); it != parts.rend(); ++it) fce::exact_merge(merged, *it);
    EXPECT_EQ(bytes(merged), ref) << "merged parts, trial " << trial;
  }
}

TEST(ExactSum, ExactWhereNothingIsDropped) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 20; ++trial) {
    // magnitudes 2^-30 .. 2^30: the top bin is bin 0 (bits 2^0 .. 2^31), and every bit of
    // every term (down to 2^-53) lies in the three bins from it down
    const std::vector<float> x = terms(rng, 5000, -30, 30);
    __int128 fixed = 0;  // the sum in units of 2^-64
    for (float v : x) fixed += static_cast<__int128>(std::ldexp(static_cast<double>(v), 64));
    const ExactSum s = sum_of(x);
    ASSERT_EQ(s.top, 0);
    __int128 got = 0;  // bin i holds the bits of weight 2^(32 (i - 2)): 2^(32 i) units
    for (int i = 0; i < fce::kExactBins; ++i)
      got += static_cast<__int128>(s.bin[i]) * (static_cast<__int128>(1) << (32 * i));
    EXPECT_TRUE(got == fixed) << "trial " << trial;
  }
  // products: x·y exactly (the rounded product and its remainder)
  ExactSum p = fce::exact_zero();
  fce::exact_add_product(p, 1.f + 0x1p-23f, 1.f + 0x1p-23f);
  EXPECT_EQ(fce::exact_value(p), (1.0 + 0x1p-23) * (1.0 + 0x1p-23));
}

// The definition, independently: every term's bits added to per-bin integers over the whole
// binary scale (a map of 32-bit bins), then the three bins from the highest term's down.
int64_t bin_of(int64_t place) { return place >= 0 ? place / 32 : -((31 - place) / 32); }

TEST(ExactSum, KeepsTheBinsOfTheDefinition) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> ex(-300, 300), sign(0, 1);
  std::uniform_int_distribution<uint32_t> mant(0, (1u << 24) - 1);
  for (int trial = 0; trial < 50; ++trial) {
    std::map<int64_t, __int128> bins;
    int64_t top = INT64_MIN;
    ExactSum s = fce::exact_zero();
    const int spread = 1 + trial * 6;  // terms from close together to far apart
    const int centre = ex(rng);
    for (int t = 0; t < 400; ++t) {
      const uint32_t m = mant(rng);
      const int64_t e = centre + ex(rng) % spread;
      const bool neg = sign(rng) != 0;
      fce::exact_add_bits(s, neg, m, e);
      if (m == 0) continue;
      int high = 23;
      while (!(m >> high)) --high;
      top = std::max(top, bin_of(e + high));
      for (int b = 0; b < 24; ++b)  // bit by bit into its bin
        if ((m >> b) & 1u) {
          const int64_t place = e + b, bin = bin_of(place);
          const __int128 v = static_cast<__int128>(1) << (place - 32 * bin);
          bins[bin] += neg ? -v : v;
        }
    }
    ASSERT_EQ(s.top, top) << "trial " << trial;
    for (int i = 0; i < fce::kExactBins; ++i)
      EXPECT_TRUE(static_cast<__int128>(s.bin[i]) == bins[top - (fce::kExactBins - 1) + i])
          << "trial " << trial << ", bin " << i;
  }
}

TEST(ExactSum, ExpTermsAndTheirLog) {
  std::mt19937 rng(3);
  std::normal_distribution<float> logit(0.f, 6.f);
  for (double offset : {0.0, 1e4, -3e5}) {
    ExactSum s = fce::exact_zero(), e = fce::exact_zero();
    double m = -INFINITY;
    std::vector<float> a(2000);
    for (float& v : a) {
      v = static_cast<float>(offset + logit(rng));
      m = std::max(m, static_cast<double>(v));
    }
    double ref = 0.0, ref_e = 0.0;
    for (float v : a) {
      ref += std::exp(v - m);
      ref_e += std::exp(v - m) * v;
      float mant = 0.f;
      int64_t n = 0;
      fce::exact_add_exp(s, v, &mant, &n);
      fce::exact_add_product(e, mant, v, n);
    }
    const double lse = m + std::log(ref);
    EXPECT_NEAR(fce::exact_log(s), lse, 4e-7 * (1.0 + std::fabs(lse))) << "offset " << offset;
    EXPECT_NEAR(fce::exact_ratio(e, s), ref_e / ref, 4e-7 * (1.0 + std::fabs(offset)))
        << "offset " << offset;
  }
  float mant = 1.f;
  int64_t n = 1;
  ExactSum s = fce::exact_zero();
  fce::exact_add_exp(s, -INFINITY, &mant, &n);  // adds nothing
  EXPECT_EQ(mant, 0.f);
  EXPECT_EQ(s.top, fce::kExactNoTop);
  fce::exact_add_exp(s, 1e20f, &mant, &n);  // beyond the range: a NaN term
  EXPECT_TRUE(std::isnan(s.nonfinite));
}

TEST(ExactSum, NonFiniteTerms) {
  ExactSum s = sum_of({1.f, -INFINITY, 2.f, -INFINITY});
  EXPECT_EQ(fce::exact_value(s), -INFINITY);
  fce::exact_add(s, INFINITY);
  EXPECT_TRUE(std::isnan(fce::exact_value(s)));
  EXPECT_EQ(fce::exact_value(fce::exact_zero()), 0.0);
}

}  // namespace
