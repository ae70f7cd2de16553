// row_values.h — what the batch-invariance suites share (test_batch_invariance.cpp,
// test_vp_invariance.cpp): inputs whose every value of row r is a function of (r, column) alone,
// so that a batch is any list of row ids and a row's inputs are the same in every batch; and a
// row's outputs as bytes, compared bit for bit.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "harness/buffers.h"

namespace fcet {

inline uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

// In [-scale, scale), a multiple of scale / 2^15 (exact in every dtype tested).
inline double value(uint64_t seed, int64_t r, int64_t c, double scale) {
  const uint64_t h = mix(seed * 0x9e3779b97f4a7c15ull ^ mix(uint64_t(r) * 1000003u + uint64_t(c)));
  return (double((h >> 20) & 0xffff) / 32768.0 - 1.0) * scale;
}

// What a call wrote for one row, as bytes.
struct RowBytes {
  std::vector<uint8_t> loss, lse, entropy, argmax, grad;
};
inline std::vector<uint8_t> bytes_at(const Buf& b, size_t offset, size_t n) {
  return std::vector<uint8_t>(b.h() + offset, b.h() + offset + n);
}
inline ::testing::AssertionResult same_bytes(const std::vector<uint8_t>& a,
                                             const std::vector<uint8_t>& b, const char* what) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i])
      return ::testing::AssertionFailure() << what << ": first difference at byte " << i;
  return ::testing::AssertionSuccess();
}
inline ::testing::AssertionResult same_row(const RowBytes& a, const RowBytes& b) {
  const std::pair<const char*, std::pair<const std::vector<uint8_t>*, const std::vector<uint8_t>*>>
      parts[] = {{"loss", {&a.loss, &b.loss}},
                 {"lse", {&a.lse, &b.lse}},
                 {"entropy", {&a.entropy, &b.entropy}},
                 {"argmax", {&a.argmax, &b.argmax}},
                 {"gradient row", {&a.grad, &b.grad}}};
  for (const auto& p : parts) {
    const ::testing::AssertionResult r = same_bytes(*p.second.first, *p.second.second, p.first);
    if (!r) return r;
  }
  return ::testing::AssertionSuccess();
}

}  // namespace fcet
