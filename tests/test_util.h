// test_util.h — what every fusedce test shares: the backend under test (FCE_TEST_BACKEND),
// buffers that live in that backend's memory with guard regions around them, host-side
// float16/bfloat16 conversion, realistic random data, poison, and norm-wise comparisons.
//
// Every test is written once against Buf; Buf keeps a host mirror (guards included) and moves
// it to and from the backend's memory (host memory for the CPU backend, cudaMalloc'ed memory
// for the CUDA backend). A test fills the mirror, push()es, calls fusedce, finish()es, pull()s
// and checks the mirror: values, that every output element was written (no poison left), and
// that nothing outside the output elements changed (guards, row gaps, inputs).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "flat_calls.h"
#include "fusedce.h"

#if FCE_TEST_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace fcet {

// ------------------------------------------------------------------ backend choice ----------
struct TestEnv {
  bool cuda = false;      // FCE_TEST_BACKEND=cuda
  std::string skip;       // non-empty: why the selected backend cannot run here
  std::string error;      // non-empty: FCE_TEST_BACKEND is not understood
};

inline const TestEnv& test_env() {
  static const TestEnv env = [] {
    TestEnv e;
    const char* b = std::getenv("FCE_TEST_BACKEND");
    std::string s = b ? b : "";
    if (s.empty() || s == "cpu") {
      e.cuda = false;
    } else if (s == "cuda") {
      e.cuda = true;
#if FCE_TEST_HAVE_CUDA
      int n = 0;
      if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        e.skip = "no CUDA device";
      }
#else
      e.skip = "no CUDA device (the tests were built with FCE_WITH_CUDA=OFF)";
#endif
    } else {
      e.error = "FCE_TEST_BACKEND='" + s + "' (expected cpu or cuda)";
    }
    return e;
  }();
  return env;
}

inline bool on_cuda() { return test_env().cuda; }
inline int32_t backend_id() { return on_cuda() ? FCE_BACKEND_CUDA : FCE_BACKEND_CPU; }
inline const char* backend_name() { return on_cuda() ? "cuda" : "cpu"; }

#if FCE_TEST_HAVE_CUDA
#define FCE_CUDA_CHECK(expr)                                                              \
  do {                                                                                    \
    cudaError_t fce_cuda_err_ = (expr);                                                   \
    if (fce_cuda_err_ != cudaSuccess) {                                                   \
      std::fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #expr,                \
                   cudaGetErrorString(fce_cuda_err_));                                    \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)

// One stream for every call of the suite (created non-blocking so that nothing hides a missing
// dependency on the legacy default stream).
inline cudaStream_t cuda_stream() {
  static cudaStream_t s = [] {
    cudaStream_t st;
    FCE_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    return st;
  }();
  return s;
}
#endif

#if FCE_TEST_HAVE_CUDA
// A CUDA graph of what one call enqueues on the test stream (capture mode global: any
// synchronising or unstreamed CUDA call inside it invalidates the capture), instantiated;
// launched on the test stream as often as wanted, destroyed with the object.
class CapturedGraph {
 public:
  CapturedGraph() = default;
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  ~CapturedGraph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  // Captures call() (a fusedce call on the test stream): it must succeed, and nothing runs.
  ::testing::AssertionResult capture(const std::function<fce_status()>& call) {
    cudaStream_t s = cuda_stream();
    cudaError_t e = cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    if (e != cudaSuccess)
      return ::testing::AssertionFailure() << "cudaStreamBeginCapture: " << cudaGetErrorString(e);
    const fce_status st = call();
    e = cudaStreamEndCapture(s, &graph_);
    if (st != FCE_SUCCESS)
      return ::testing::AssertionFailure() << "the call during capture: " << fce_status_string(st)
                                           << " (\"" << fce_last_error() << "\")";
    if (e != cudaSuccess)
      return ::testing::AssertionFailure() << "capture invalidated: " << cudaGetErrorString(e);
#if CUDART_VERSION >= 12000
    e = cudaGraphInstantiate(&exec_, graph_, 0);
#else
    e = cudaGraphInstantiate(&exec_, graph_, nullptr, nullptr, 0);
#endif
    if (e != cudaSuccess)
      return ::testing::AssertionFailure() << "cudaGraphInstantiate: " << cudaGetErrorString(e);
    return ::testing::AssertionSuccess();
  }
  // One replay on the test stream (asynchronous: finish() waits for it).
  ::testing::AssertionResult launch() {
    const cudaError_t e = cudaGraphLaunch(exec_, cuda_stream());
    if (e != cudaSuccess)
      return ::testing::AssertionFailure() << "cudaGraphLaunch: " << cudaGetErrorString(e);
    return ::testing::AssertionSuccess();
  }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};
#endif

// The stream argument every compute call gets.
inline void* test_stream() {
#if FCE_TEST_HAVE_CUDA
  if (on_cuda()) return static_cast<void*>(cuda_stream());
#endif
  return nullptr;
}

// Waits for the work of the last call(s) and reports an asynchronous CUDA error, if any.
inline ::testing::AssertionResult finish() {
#if FCE_TEST_HAVE_CUDA
  if (on_cuda()) {
    cudaError_t e = cudaStreamSynchronize(cuda_stream());
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess)
      return ::testing::AssertionFailure() << "CUDA error after the call: " << cudaGetErrorString(e);
  }
#endif
  return ::testing::AssertionSuccess();
}

// Every test body starts with this: skips (visibly) when the selected backend cannot run here.
#define FCE_REQUIRE_BACKEND()                                                             \
  do {                                                                                    \
    const ::fcet::TestEnv& fce_env_ = ::fcet::test_env();                                 \
    if (!fce_env_.error.empty()) FAIL() << fce_env_.error;                                \
    if (!fce_env_.skip.empty()) {                                                         \
      std::printf("SKIPPED: %s\n", fce_env_.skip.c_str());                                \
      GTEST_SKIP() << fce_env_.skip;                                                      \
    }                                                                                     \
  } while (0)

// Fixture of every test that calls the library on the selected backend.
class BackendTest : public ::testing::Test {
 protected:
  void SetUp() override { FCE_REQUIRE_BACKEND(); }
};

// Options with the backend under test selected.
inline TestOptions test_options() {
  TestOptions o = FCE_OPTIONS_INIT;
  o.backend = backend_id();
  return o;
}

// ------------------------------------------------------------------ number formats ----------
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

// ------------------------------------------------------------------ random data -------------
// Logits with a realistic spread: row r has standard deviation log-uniform in [std_lo, std_hi]
// and a random offset (lse must not care), values rounded to dtype. Dense [rows * cols].
inline std::vector<double> random_logits(std::mt19937_64& rng, int dtype, int64_t rows,
                                         int64_t cols, double std_lo = 1.0, double std_hi = 30.0,
                                         double max_offset = 10.0) {
  std::vector<double> z(static_cast<size_t>(rows * cols));
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (int64_t r = 0; r < rows; ++r) {
    double sd = std_lo * std::pow(std_hi / std_lo, u(rng));
    double off = max_offset * (2 * u(rng) - 1);
    for (int64_t c = 0; c < cols; ++c)
      z[static_cast<size_t>(r * cols + c)] = round_to(dtype, off + sd * nd(rng));
  }
  return z;
}

// Normal values of standard deviation sd rounded to dtype.
inline std::vector<double> random_normal(std::mt19937_64& rng, int dtype, size_t n, double sd) {
  std::normal_distribution<double> nd(0.0, sd);
  std::vector<double> v(n);
  for (auto& x : v) x = round_to(dtype, nd(rng));
  return v;
}

inline std::vector<double> random_uniform(std::mt19937_64& rng, size_t n, double lo, double hi) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(n);
  for (auto& x : v) x = static_cast<float>(u(rng));  // float32 inputs: exactly representable
  return v;
}

// Targets in [0, vocab); a fraction of them set to ignore_index.
inline std::vector<int64_t> random_targets(std::mt19937_64& rng, int64_t rows, int64_t vocab,
                                           double ignore_frac = 0.0, int64_t ignore_index = -100) {
  std::uniform_int_distribution<int64_t> cls(0, vocab - 1);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<int64_t> y(static_cast<size_t>(rows));
  for (auto& t : y) t = (ignore_frac > 0 && u(rng) < ignore_frac) ? ignore_index : cls(rng);
  return y;
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

// ------------------------------------------------------------------ comparisons -------------
// Unit roundoff of a dtype (half the distance from 1 to the next number).
inline double unit_roundoff(int dtype) {
  switch (dtype) {
    case FCE_FLOAT16: return std::ldexp(1.0, -11);
    case FCE_BFLOAT16: return std::ldexp(1.0, -8);
    default: return std::ldexp(1.0, -24);
  }
}

// Norm-wise relative bound ||out - ref|| / ||ref|| against the float64 reference on the same
// (rounded) inputs.
//  - float32: docs/semantics.md's 1e-5.
//  - float16 / bfloat16: what an honest computation in that dtype achieves (torch eager): the
//    gradient is rounded to the dtype once, an error of up to u (the unit roundoff: 2^-11 for
//    float16, 2^-8 for bfloat16) per element, and torch rounds its log-softmax to the dtype
//    too; 4u leaves room for one or two more such roundings and nothing else (an accumulation
//    in the dtype over V terms, for instance, fails it).
inline double tolerance(int dtype) {
  return dtype == FCE_FLOAT32 ? 1e-5 : 4.0 * unit_roundoff(dtype);
}

// out vs ref element by element where ref is not finite (NaN -> NaN, inf -> the same inf), and
// norm-wise over the finite ones: ||out - ref||_2 <= tol * ||ref||_2, and exactly zero when
// the reference is all zero. Never NaN or inf where the reference is finite.
inline ::testing::AssertionResult close_normwise(const std::vector<double>& out,
                                                 const std::vector<double>& ref, double tol,
                                                 const std::string& what) {
  if (out.size() != ref.size())
    return ::testing::AssertionFailure() << what << ": size " << out.size() << " vs " << ref.size();
  double d2 = 0, r2 = 0, maxabs = 0;
  int64_t bad = 0;
  std::ostringstream msg;
  size_t worst = 0;
  double worst_err = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    double o = out[i], r = ref[i];
    if (std::isnan(r)) {
      if (!std::isnan(o)) {
        if (bad < 5) msg << "\n  [" << i << "] expected NaN, got " << o;
        ++bad;
      }
      continue;
    }
    if (std::isinf(r)) {
      if (o != r) {
        if (bad < 5) msg << "\n  [" << i << "] expected " << r << ", got " << o;
        ++bad;
      }
      continue;
    }
    if (!std::isfinite(o)) {
      if (bad < 5) msg << "\n  [" << i << "] expected " << r << " (finite), got " << o;
      ++bad;
      continue;
    }
    double e = o - r;
    d2 += e * e;
    r2 += r * r;
    maxabs = std::max(maxabs, std::fabs(o));
    if (std::fabs(e) > worst_err) {
      worst_err = std::fabs(e);
      worst = i;
    }
  }
  if (bad)
    return ::testing::AssertionFailure() << what << ": " << bad << " elements wrong" << msg.str();
  if (r2 == 0) {
    if (maxabs == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << what << ": reference is all zero, got max |out| = "
                                         << maxabs << " at [" << worst << "]";
  }
  double rel = std::sqrt(d2) / std::sqrt(r2);
  if (rel <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": norm-wise relative error " << rel << " > " << tol << " (worst ["
         << worst << "]: got " << out[worst] << ", expected " << ref[worst] << ")";
}

// A scalar: NaN -> NaN, inf -> same inf, 0 -> exactly 0, else |out - ref| <= tol |ref|.
inline ::testing::AssertionResult close_scalar(double out, double ref, double tol,
                                               const std::string& what) {
  return close_normwise({out}, {ref}, tol, what);
}

// Exact equality of two byte vectors (bitwise results).
inline ::testing::AssertionResult bitwise_equal(const std::vector<uint8_t>& a,
                                                const std::vector<uint8_t>& b, const char* what) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i])
      return ::testing::AssertionFailure()
             << what << ": not bitwise identical, first difference at byte "
             << static_cast<long long>(i) - static_cast<long long>(kGuard);
  return ::testing::AssertionSuccess();
}

// The message of the last failing call names `name` (any of the '|'-separated alternatives).
inline ::testing::AssertionResult error_mentions(const std::string& alternatives) {
  const char* m = fce_last_error();
  std::string msg = m ? m : "(null)";
  std::stringstream ss(alternatives);
  std::string name;
  while (std::getline(ss, name, '|'))
    if (msg.find(name) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "fce_last_error() = \"" << msg
                                       << "\" does not mention " << alternatives;
}

}  // namespace fcet
