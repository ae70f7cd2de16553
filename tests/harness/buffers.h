// harness/buffers.h — buffers in the backend's memory with guard regions around them, their
// host mirrors, poison, and the checks that every output element was written and nothing
// outside the output elements changed.
//
// Every test is written once against Buf; Buf keeps a host mirror (guards included) and moves
// it to and from the backend's memory (host memory for the CPU backend, cudaMalloc'ed memory
// for the CUDA backend). A test fills the mirror, push()es, calls fusedce, finish()es, pull()s
// and checks the mirror: values, that every output element was written (no poison left), and
// that nothing outside the output elements changed (guards, row gaps, inputs).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <sstream>
#include <utility>
#include <vector>

#include "backend.h"
#include "numbers.h"

namespace fcet {

// ------------------------------------------------------------------ poison and guards -------
// Outputs are poisoned before each call with a NaN of an unusual payload that no arithmetic
// produces (a signalling NaN: any operation on it would set the quiet bit). An element still
// holding it after the call was not written.
constexpr uint32_t kPoison32 = 0xFFBADBADu;
constexpr uint16_t kPoison16 = 0xFFBAu;     // a NaN both as binary16 and as bfloat16
constexpr uint64_t kPoison64 = 0xBADBADBADBADBAD5ull;  // int64 outputs (argmax): no index, not -1
constexpr uint8_t kGuardByte = 0xC3;        // guard regions and row gaps of outputs
constexpr size_t kGuard = 256;              // guard bytes each side (keeps 256-byte alignment)

inline void put_poison(int dtype, void* dst) {
  if (dtype_size(dtype) == 8) std::memcpy(dst, &kPoison64, 8);
  else if (dtype_size(dtype) == 4) std::memcpy(dst, &kPoison32, 4);
  else if (dtype_size(dtype) == 2) std::memcpy(dst, &kPoison16, 2);
  else std::memset(dst, 0xFF, dtype_size(dtype));
}
inline bool is_poison(int dtype, const void* src) {
  if (dtype_size(dtype) == 8) { uint64_t u; std::memcpy(&u, src, 8); return u == kPoison64; }
  if (dtype_size(dtype) == 4) { uint32_t u; std::memcpy(&u, src, 4); return u == kPoison32; }
  if (dtype_size(dtype) == 2) { uint16_t u; std::memcpy(&u, src, 2); return u == kPoison16; }
  return false;
}

// A layout: rows x cols elements of dtype, stride elements between rows.
struct Mat {
  int dtype = FCE_FLOAT32;
  int64_t rows = 1, cols = 1, stride = 1;
  size_t esize() const { return dtype_size(dtype); }
  // Exactly the bytes the last element needs: a write into the last row's gap hits the guard.
  size_t bytes() const {
    return static_cast<size_t>((rows - 1) * stride + cols) * esize();
  }
  size_t offset(int64_t r, int64_t c) const { return static_cast<size_t>(r * stride + c) * esize(); }
};
inline Mat vec(int dtype, int64_t n) { return Mat{dtype, 1, n, n}; }
inline Mat mat(int dtype, int64_t rows, int64_t cols, int64_t stride = 0) {
  return Mat{dtype, rows, cols, stride ? stride : cols};
}

// A buffer in the backend's memory with kGuard bytes before and after, and a host mirror of the
// whole allocation (guards included). The data pointer is 256-byte aligned.
class Buf {
 public:
  Buf() = default;
  explicit Buf(size_t bytes, uint8_t fill = kGuardByte) { alloc(bytes, fill); }
  explicit Buf(const Mat& m, uint8_t fill = kGuardByte) { alloc(m.bytes(), fill); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  Buf(Buf&& o) noexcept { swap(o); }
  Buf& operator=(Buf&& o) noexcept {
    if (this != &o) {
      release();
      swap(o);
    }
    return *this;
  }
  ~Buf() { release(); }

  bool empty() const { return base_ == nullptr; }
  size_t size() const { return bytes_; }
  // The data pointer in the backend's memory (nullptr when empty).
  void* ptr() const { return base_ ? static_cast<uint8_t*>(base_) + kGuard : nullptr; }
  template <class T> T* p() const { return static_cast<T*>(ptr()); }
  // The host mirror of the data (call pull() first to see what the library wrote).
  uint8_t* h() { return mirror_.data() + kGuard; }
  const uint8_t* h() const { return mirror_.data() + kGuard; }
  template <class T> T* hp() { return reinterpret_cast<T*>(h()); }
  const std::vector<uint8_t>& mirror() const { return mirror_; }

  // Mirror -> backend memory (guards included).
  void push() {
    if (!base_) return;
#if FCE_TEST_HAVE_CUDA
    if (dev_) {  // on the test stream (non-blocking), then wait: ordered with the calls
      FCE_CUDA_CHECK(cudaMemcpyAsync(base_, mirror_.data(), mirror_.size(),
                                     cudaMemcpyHostToDevice, cuda_stream()));
      FCE_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
      return;
    }
#endif
    std::memcpy(base_, mirror_.data(), mirror_.size());
  }
  // Backend memory -> mirror (guards included).
  void pull() {
    if (!base_) return;
#if FCE_TEST_HAVE_CUDA
    if (dev_) {
      FCE_CUDA_CHECK(cudaMemcpyAsync(mirror_.data(), base_, mirror_.size(),
                                     cudaMemcpyDeviceToHost, cuda_stream()));
      FCE_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
      return;
    }
#endif
    std::memcpy(mirror_.data(), base_, mirror_.size());
  }

 private:
  void alloc(size_t bytes, uint8_t fill) {
    bytes_ = bytes;
    size_t total = bytes + 2 * kGuard;
    mirror_.assign(total, fill);
    std::memset(mirror_.data(), kGuardByte, kGuard);
    std::memset(mirror_.data() + kGuard + bytes, kGuardByte, kGuard);
    dev_ = on_cuda();
#if FCE_TEST_HAVE_CUDA
    if (dev_) {
      FCE_CUDA_CHECK(cudaMalloc(&base_, total));
      push();
      return;
    }
#endif
    base_ = std::aligned_alloc(256, (total + 255) / 256 * 256);
    if (!base_) std::abort();
    push();
  }
  void release() {
    if (!base_) return;
#if FCE_TEST_HAVE_CUDA
    if (dev_) {
      cudaFree(base_);
      base_ = nullptr;
      return;
    }
#endif
    std::free(base_);
    base_ = nullptr;
  }
  void swap(Buf& o) noexcept {
    std::swap(base_, o.base_);
    std::swap(bytes_, o.bytes_);
    std::swap(mirror_, o.mirror_);
    std::swap(dev_, o.dev_);
  }
  void* base_ = nullptr;
  size_t bytes_ = 0;
  std::vector<uint8_t> mirror_;
  bool dev_ = false;
};

// Writes dense values [rows * cols] into the elements of m (row gaps untouched).
inline void write_mat(Buf& b, const Mat& m, const std::vector<double>& dense) {
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c)
      put(m.dtype, b.h() + m.offset(r, c), dense[static_cast<size_t>(r * m.cols + c)]);
}
inline std::vector<double> read_mat(const Buf& b, const Mat& m) {
  std::vector<double> out(static_cast<size_t>(m.rows * m.cols));
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c)
      out[static_cast<size_t>(r * m.cols + c)] = get(m.dtype, b.h() + m.offset(r, c));
  return out;
}
// The int64 elements of an [n] int64 buffer (argmax).
inline std::vector<int64_t> read_i64(const Buf& b, int64_t n) {
  std::vector<int64_t> out(static_cast<size_t>(n));
  if (n > 0) std::memcpy(out.data(), b.h(), static_cast<size_t>(n) * 8);
  return out;
}
inline void poison_mat(Buf& b, const Mat& m) {
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) put_poison(m.dtype, b.h() + m.offset(r, c));
}
// Poisons every byte of the data region (the guards stay).
inline void poison_all(Buf& b, int dtype) {
  size_t es = dtype_size(dtype);
  for (size_t i = 0; i + es <= b.size(); i += es) put_poison(dtype, b.h() + i);
}

// An output buffer for m: guard bytes in the row gaps, poison in every element.
inline Buf poisoned(const Mat& m) {
  Buf b(m);
  poison_mat(b, m);
  b.push();
  return b;
}

// After pull(): no element of m still holds the poison.
inline ::testing::AssertionResult all_written(const Buf& b, const Mat& m, const char* what) {
  int64_t n = 0;
  std::ostringstream first;
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c)
      if (is_poison(m.dtype, b.h() + m.offset(r, c))) {
        if (n < 5) first << " (" << r << "," << c << ")";
        ++n;
      }
  if (n == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << n << " of " << m.rows * m.cols
         << " elements were never written (still poison), first at" << first.str();
}

// After pull(): every byte outside the elements of m (guards, row gaps) equals `before`.
inline ::testing::AssertionResult only_elements_changed(const Buf& b,
                                                        const std::vector<uint8_t>& before,
                                                        const Mat* m, const char* what) {
  const std::vector<uint8_t>& now = b.mirror();
  if (now.size() != before.size()) return ::testing::AssertionFailure() << what << ": size mismatch";
  // The byte ranges [lo, hi) of the mirror that must not change.
  std::vector<std::pair<size_t, size_t>> keep;
  if (m) {
    size_t pos = 0;
    for (int64_t r = 0; r < m->rows; ++r) {
      size_t o = kGuard + m->offset(r, 0);
      keep.emplace_back(pos, o);
      pos = o + static_cast<size_t>(m->cols) * m->esize();
    }
    keep.emplace_back(pos, now.size());
  } else {
    keep.emplace_back(0, now.size());
  }
  int64_t n = 0;
  std::ostringstream first;
  for (const auto& k : keep) {
    if (k.first >= k.second ||
        std::memcmp(now.data() + k.first, before.data() + k.first, k.second - k.first) == 0)
      continue;
    for (size_t i = k.first; i < k.second; ++i)
      if (now[i] != before[i]) {
        if (n < 5) {
          long long rel = static_cast<long long>(i) - static_cast<long long>(kGuard);
          first << " byte " << rel
                << (rel < 0 ? " (front guard)"
                    : rel >= static_cast<long long>(b.size()) ? " (back guard)"
                                                             : (m ? " (row gap)" : ""));
        }
        ++n;
      }
  }
  if (n == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << n
                                       << " bytes outside the output elements changed:"
                                       << first.str();
}
// After pull(): not one byte changed (inputs; outputs of a failing call).
inline ::testing::AssertionResult unchanged(const Buf& b, const std::vector<uint8_t>& before,
                                            const char* what) {
  return only_elements_changed(b, before, nullptr, what);
}

// A targets buffer of target_dtype (int32 or int64).
inline Buf targets_buf(const std::vector<int64_t>& y, int target_dtype) {
  Buf b(y.size() * dtype_size(target_dtype));
  for (size_t i = 0; i < y.size(); ++i) {
    if (target_dtype == FCE_INT32) {
      int32_t v = static_cast<int32_t>(y[i]);
      std::memcpy(b.h() + 4 * i, &v, 4);
    } else {
      std::memcpy(b.h() + 8 * i, &y[i], 8);
    }
  }
  b.push();
  return b;
}

// A float32 buffer holding v.
inline Buf f32_buf(const std::vector<double>& v) {
  Buf b(v.size() * 4);
  for (size_t i = 0; i < v.size(); ++i) put(FCE_FLOAT32, b.h() + 4 * i, v[i]);
  b.push();
  return b;
}

// A workspace of exactly `bytes` (NULL when 0), its contents garbage (NaN bytes) as the
// header allows; guards around it are checked like any output's.
inline Buf workspace_buf(size_t bytes, uint8_t fill = 0xFF) {
  if (bytes == 0) return Buf();
  Buf b(bytes, fill);
  return b;
}

// Raw bytes of the elements of m (for bitwise comparisons across layouts).
inline std::vector<uint8_t> raw_elements(const Buf& b, const Mat& m) {
  std::vector<uint8_t> out;
  for (int64_t r = 0; r < m.rows; ++r)
    out.insert(out.end(), b.h() + m.offset(r, 0), b.h() + m.offset(r, 0) + m.cols * m.esize());
  return out;
}

// After pull(): the guard bytes around b's data are intact (an empty b has none).
inline ::testing::AssertionResult guards_intact(const Buf& b, const char* what) {
  if (b.empty()) return ::testing::AssertionSuccess();
  const auto& mm = b.mirror();
  for (size_t i = 0; i < kGuard; ++i)
    if (mm[i] != kGuardByte || mm[kGuard + b.size() + i] != kGuardByte)
      return ::testing::AssertionFailure() << what << ": guard bytes around it were overwritten";
  return ::testing::AssertionSuccess();
}

// An error_flags word holding `preset` (the calls OR bits in, never clear), and its value.
inline Buf flags_buf(uint32_t preset) {
  Buf f(4, 0);
  std::memcpy(f.h(), &preset, 4);
  f.push();
  return f;
}
inline uint32_t read_flags(const Buf& f) {
  uint32_t v;
  std::memcpy(&v, f.h(), 4);
  return v;
}

}  // namespace fcet
