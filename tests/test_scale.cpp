// test_scale.cpp — fce_scale_gradient on the backend FCE_TEST_BACKEND selects (cpu by default,
// cuda): grad[i] *= *grad_output in place, the float32 product rounded once to the dtype.
//
// Every case: gradient-like values over many binades with the corner values mixed in (zeros of
// both signs, infinities, quiet and signalling NaNs, the largest finite value, subnormals),
// guard elements before and after the span (and Buf's guards around those), then: each element
// equals the float64 reference rounded once to the dtype, bitwise (NaN where it is NaN),
// nothing outside the span changed, and a scale of exactly 1 leaves the buffer bitwise as it
// was (NaN payloads included: the call must not even rewrite it). Bad input: the status, a
// message naming fce_scale_gradient and the argument, and no buffer touched.
#include "test_util.h"

using namespace fcet;

namespace {

constexpr float kNaNf = std::numeric_limits<float>::quiet_NaN();
constexpr double kInfd = std::numeric_limits<double>::infinity();

// ------------------------------------------------------------------ the reference -----------
// v rounded once (to nearest, ties to even) to a binary format of p significant bits whose
// normal exponents are [emin, emax]: subnormals keep the quantum 2^(emin - p + 1), values from
// 2^(emax + 1) on (after rounding) are infinite. Signed zeros, infinities and NaN pass through.
double round_format(double v, int p, int emin, int emax) {
  if (std::isnan(v) || std::isinf(v) || v == 0) return v;
  int e;
  std::frexp(std::fabs(v), &e);  // |v| in [2^(e-1), 2^e)
  const int q = std::max(e - 1, emin) - (p - 1);  // the exponent of the last significant bit
  const double r = std::ldexp(std::nearbyint(std::ldexp(v, -q)), q);
  if (std::fabs(r) >= std::ldexp(1.0, emax + 1)) return std::copysign(kInfd, v);
  return r;
}

// v rounded once to dtype, as a double (exactly representable in the dtype).
double round_once(int dtype, double v) {
  switch (dtype) {
    case FCE_FLOAT16: return round_format(v, 11, -14, 15);
    case FCE_BFLOAT16: return round_format(v, 8, -126, 127);
    default: return round_format(v, 24, -126, 127);
  }
}

// The bits of element i of dtype at p, and the bits of a value representable in dtype.
uint32_t bits_at(int dtype, const uint8_t* p, int64_t i) {
  if (dtype == FCE_FLOAT32) {
    uint32_t u;
    std::memcpy(&u, p + 4 * i, 4);
    return u;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return h;
}
void set_bits(int dtype, uint8_t* p, int64_t i, uint32_t bits) {
  if (dtype == FCE_FLOAT32) {
    std::memcpy(p + 4 * i, &bits, 4);
  } else {
    const uint16_t h = static_cast<uint16_t>(bits);
    std::memcpy(p + 2 * i, &h, 2);
  }
}
uint32_t bits_of(int dtype, double exact) {
  switch (dtype) {
    case FCE_FLOAT16: return f64_to_f16(exact);
    case FCE_BFLOAT16: return f32_to_bf16(static_cast<float>(exact));
    default: return f32_bits(static_cast<float>(exact));
  }
}
bool is_nan_bits(int dtype, uint32_t b) {
  switch (dtype) {
    case FCE_FLOAT16: return (b & 0x7c00u) == 0x7c00u && (b & 0x03ffu) != 0;
    case FCE_BFLOAT16: return (b & 0x7f80u) == 0x7f80u && (b & 0x007fu) != 0;
    default: return (b & 0x7f800000u) == 0x7f800000u && (b & 0x007fffffu) != 0;
  }
}
double value_of(int dtype, uint32_t b) {
  switch (dtype) {
    case FCE_FLOAT16: return f16_to_f64(static_cast<uint16_t>(b));
    case FCE_BFLOAT16: return bf16_to_f32(static_cast<uint16_t>(b));
    default: return f32_from_bits(b);
  }
}

// What the header promises for element bits x and scale g: the float32 product rounded once
// to the dtype. For scales whose significand has at most 3 bits (2.5, -0.375, 0, powers of
// two) and 16-bit inputs that product is exact in float32, and for float32 inputs rounding the
// exact product once to float32 is the float32 product: either way it is the float64 product
// rounded once. That is the reference (`exact_scale`); for other scales (0.1f) the float32
// product itself is rounded once to the dtype.
double reference(int dtype, uint32_t x, float g, bool exact_scale) {
  const double xv = value_of(dtype, x);
  if (exact_scale) return round_once(dtype, xv * static_cast<double>(g));
  return round_once(dtype, static_cast<double>(static_cast<float>(xv) * g));
}

// ------------------------------------------------------------------ data -------------------
// Gradient-like values: random signs, magnitudes log-uniform over 2^-30..2^6 (every binade
// the dtype has there, subnormal for float16), rounded to the dtype; one element in 12 a
// corner value instead.
std::vector<uint32_t> make_data(std::mt19937_64& rng, int dtype, int64_t n) {
  std::vector<uint32_t> specials;
  switch (dtype) {
    case FCE_FLOAT32:
      specials = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                  0x7f800001u /* signalling NaN */, 0x7f7fffffu /* max */, 0xff7fffffu,
                  0x00800000u /* min normal */, 0x00000001u /* min subnormal */,
                  0x80000003u, 0x007fffffu /* max subnormal */, 0x3f800000u /* 1 */};
      break;
    case FCE_FLOAT16:
      specials = {0x0000u, 0x8000u, 0x7c00u, 0xfc00u, 0x7e00u, 0x7c01u /* signalling NaN */,
                  0x7bffu /* 65504 */, 0xfbffu, 0x7800u /* 32768: overflows times 2.5 */,
                  0x0400u /* min normal */, 0x0001u /* min subnormal */, 0x8003u,
                  0x03ffu, 0x3c00u};
      break;
    default:
      specials = {0x0000u, 0x8000u, 0x7f80u, 0xff80u, 0x7fc0u, 0x7f81u /* signalling NaN */,
                  0x7f7fu /* max */, 0xff7fu, 0x0080u /* min normal */, 0x0001u, 0x8003u,
                  0x007fu, 0x3f80u};
      break;
  }
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::uniform_int_distribution<size_t> pick(0, specials.size() - 1);
  std::vector<uint32_t> v(static_cast<size_t>(n));
  for (auto& b : v) {
    if (u(rng) < 1.0 / 12) {
      b = specials[pick(rng)];
      continue;
    }
    double x = std::exp2(-30.0 + 36.0 * u(rng));
    if (u(rng) < 0.5) x = -x;
    b = bits_of(dtype, round_once(dtype, x));
  }
  return v;
}

// ------------------------------------------------------------------ one call ---------------
// grad = the data placed `lead` elements past a 256-byte boundary with `trail` guard elements
// after it; grad_output = g in the backend's memory. Scales, then checks every element of the
// span against the reference and every other byte (guard elements, Buf guards) unchanged.
void run_scale(int dtype, const std::vector<uint32_t>& data, int64_t lead, float g,
               bool exact_scale, const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t n = static_cast<int64_t>(data.size());
  const size_t es = dtype_size(dtype);
  const int64_t trail = 16;
  Buf grad(static_cast<size_t>(lead + n + trail) * es);  // guard elements: kGuardByte bytes
  for (int64_t i = 0; i < n; ++i) set_bits(dtype, grad.h(), lead + i, data[static_cast<size_t>(i)]);
  grad.push();
  Buf gout = f32_buf({static_cast<double>(g)});
  const std::vector<uint8_t> before = grad.mirror(), gout_before = gout.mirror();

  void* gp = static_cast<uint8_t*>(grad.ptr()) + lead * es;
  ASSERT_EQ(fce_scale_gradient(backend_id(), dtype, n, gp, gout.p<float>(), test_stream()),
            FCE_SUCCESS)
      << fce_last_error();
  EXPECT_STREQ(fce_last_error(), "");
  ASSERT_TRUE(finish());
  grad.pull();
  gout.pull();
  EXPECT_TRUE(unchanged(gout, gout_before, "grad_output"));

  if (g == 1.0f) {  // exactly 1: not one bit of the buffer may change
    EXPECT_TRUE(bitwise_equal(grad.mirror(), before, "grad scaled by exactly 1"));
    return;
  }
  // Outside the span: bytes [0, kGuard + lead*es) and [kGuard + (lead+n)*es, end) of the mirror.
  const std::vector<uint8_t>& now = grad.mirror();
  const size_t lo = kGuard + static_cast<size_t>(lead) * es;
  const size_t hi = lo + static_cast<size_t>(n) * es;
  for (size_t i = 0; i < now.size(); ++i) {
    if (i >= lo && i < hi) continue;
    if (now[i] != before[i]) {
      ADD_FAILURE() << "byte " << static_cast<long long>(i) - static_cast<long long>(lo)
                    << " relative to grad (outside the " << n << " elements) changed";
      break;
    }
  }
  int64_t bad = 0;
  std::ostringstream first;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t x = data[static_cast<size_t>(i)];
    const uint32_t out = bits_at(dtype, grad.h(), lead + i);
    const double ref = reference(dtype, x, g, exact_scale);
    const bool ok = std::isnan(ref) ? is_nan_bits(dtype, out) : out == bits_of(dtype, ref);
    if (ok) continue;
    if (bad < 5)
      first << "\n  [" << i << "] x = " << value_of(dtype, x) << " (bits 0x" << std::hex << x
            << "): got " << std::dec << value_of(dtype, out) << " (bits 0x" << std::hex << out
            << "), expected " << std::dec << ref << " (bits 0x" << std::hex
            << bits_of(dtype, ref) << std::dec << ")";
    ++bad;
  }
  EXPECT_EQ(bad, 0) << bad << " of " << n << " elements differ from the reference:" << first.str();
}

// ------------------------------------------------------------------ the matrix --------------
struct ScaleCase {
  int dtype;
  int64_t count;
};

std::string case_name(const ScaleCase& c) {
  return std::string(dtype_name(c.dtype)) + "_n" + std::to_string(c.count);
}
void PrintTo(const ScaleCase& c, std::ostream* os) {
  *os << case_name(c) << " [" << backend_name() << "]";
}

std::vector<ScaleCase> matrix_cases() {
  std::vector<ScaleCase> cases;
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16})
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{1000003}})
      cases.push_back({dtype, n});
  return cases;
}

class ScaleMatrix : public ::testing::TestWithParam<ScaleCase> {
 protected:
  void SetUp() override { FCE_REQUIRE_BACKEND(); }
};

// Each count with the span starting on a 16-byte boundary, one element past it, and one
// element before the next (the longest unaligned head), for every scale.
TEST_P(ScaleMatrix, MatchesReferenceRoundedOnce) {
  const ScaleCase c = GetParam();
  const int64_t per16 = static_cast<int64_t>(16 / dtype_size(c.dtype));
  std::mt19937_64 rng(1000 + static_cast<uint64_t>(c.dtype) * 100 + static_cast<uint64_t>(c.count % 97));
  const std::vector<uint32_t> data = make_data(rng, c.dtype, c.count);
  struct ScaleValue {
    float g;
    bool exact;  // see reference()
  };
  const ScaleValue scales[] = {{1.0f, true}, {2.5f, true}, {-0.375f, true}, {0.0f, true},
                          {kNaNf, true}, {0.1f, false}};
  for (int64_t lead : {int64_t{0}, int64_t{1}, per16 - 1})
    for (const ScaleValue& s : scales) {
      std::ostringstream what;
      what << case_name(c) << " [" << backend_name() << "] scale " << s.g << ", grad "
           << lead << " element(s) past a 16-byte boundary";
      run_scale(c.dtype, data, lead, s.g, s.exact, what.str());
      if (HasFatalFailure()) return;
    }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ScaleMatrix, ::testing::ValuesIn(matrix_cases()),
                         [](const ::testing::TestParamInfo<ScaleCase>& i) {
                           return case_name(i.param);
                         });

// ------------------------------------------------------------------ corner cases ------------
class Scale : public BackendTest {};

// count 0 is a no-op that needs no grad; with a grad it leaves it alone.
TEST_F(Scale, CountZero) {
  Buf gout = f32_buf({2.5});
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16}) {
    EXPECT_EQ(fce_scale_gradient(backend_id(), dtype, 0, nullptr, gout.p<float>(), test_stream()),
              FCE_SUCCESS)
        << fce_last_error();
    EXPECT_STREQ(fce_last_error(), "");
    Buf grad(64);
    const std::vector<uint8_t> before = grad.mirror();
    EXPECT_EQ(fce_scale_gradient(backend_id(), dtype, 0, grad.ptr(), gout.p<float>(), test_stream()),
              FCE_SUCCESS)
        << fce_last_error();
    ASSERT_TRUE(finish());
    grad.pull();
    EXPECT_TRUE(unchanged(grad, before, "grad with count 0"));
  }
}

// More 16-byte vectors than one pass of the CUDA grid covers (the kernel grid-strides): every
// element still scaled exactly once.
TEST_F(Scale, ManyElements) {
  std::mt19937_64 rng(77);
  const std::vector<uint32_t> data = make_data(rng, FCE_FLOAT32, (int64_t{1} << 24) + 5);
  run_scale(FCE_FLOAT32, data, 1, 2.5f, true, "f32, 2^24 + 5 elements, scale 2.5");
}

// grad_output may sit right after the span (it is not part of it), and is read, not scaled.
TEST_F(Scale, GradOutputRightAfterTheSpan) {
  const int64_t n = 37;
  Buf b(static_cast<size_t>(n + 1) * 4);
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = 0.25 * static_cast<double>(i - 17);
  for (int64_t i = 0; i < n; ++i) put(FCE_FLOAT32, b.h() + 4 * i, v[static_cast<size_t>(i)]);
  put(FCE_FLOAT32, b.h() + 4 * n, -2.0);
  b.push();
  ASSERT_EQ(fce_scale_gradient(backend_id(), FCE_FLOAT32, n, b.ptr(), b.p<float>() + n,
                               test_stream()),
            FCE_SUCCESS)
      << fce_last_error();
  ASSERT_TRUE(finish());
  b.pull();
  for (int64_t i = 0; i < n; ++i)
    EXPECT_EQ(get(FCE_FLOAT32, b.h() + 4 * i), -2.0 * v[static_cast<size_t>(i)]) << "element " << i;
  EXPECT_EQ(get(FCE_FLOAT32, b.h() + 4 * n), -2.0) << "grad_output was changed";
}

// ------------------------------------------------------------------ bad input ---------------
struct ScaleArgs {
  int32_t backend;
  int32_t dtype;
  int64_t count;
  void* grad;
  const float* gout;
};

class ScaleBadInput : public BackendTest {
 protected:
  static constexpr int64_t N = 64;
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    std::mt19937_64 rng(5);
    grad = Buf(static_cast<size_t>(N) * 4);
    write_mat(grad, vec(FCE_FLOAT32, N), random_normal(rng, FCE_FLOAT32, N, 1.0));
    grad.push();
    gout = f32_buf({2.5});
    a = {backend_id(), FCE_FLOAT32, N, grad.ptr(), gout.p<float>()};
  }
  static fce_status call(const ScaleArgs& x) {
    return fce_scale_gradient(x.backend, x.dtype, x.count, x.grad, x.gout, test_stream());
  }
  void expect_rejected(const char* what, fce_status expected, const char* names,
                       const std::function<void(ScaleArgs&)>& mutate) {
    SCOPED_TRACE(std::string("fce_scale_gradient bad input: ") + what);
    ScaleArgs x = a;
    mutate(x);
    const std::vector<uint8_t> g0 = grad.mirror(), o0 = gout.mirror();
    const fce_status st = call(x);
    EXPECT_EQ(st, expected) << "got " << fce_status_string(st) << " (\"" << fce_last_error()
                            << "\")";
    EXPECT_TRUE(error_mentions("fce_scale_gradient"));
    EXPECT_TRUE(error_mentions(names));
    EXPECT_TRUE(finish());
    grad.pull();
    gout.pull();
    EXPECT_TRUE(unchanged(grad, g0, "grad of the rejected call"));
    EXPECT_TRUE(unchanged(gout, o0, "grad_output of the rejected call"));
  }
  Buf grad, gout;
  ScaleArgs a{};
};

TEST_F(ScaleBadInput, ValidBaselineSucceeds) {
  ASSERT_EQ(call(a), FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
}

TEST_F(ScaleBadInput, Enums) {
  expect_rejected("backend 7", FCE_ERROR_INVALID_ARGUMENT, "backend", [](ScaleArgs& x) { x.backend = 7; });
  expect_rejected("backend -1", FCE_ERROR_INVALID_ARGUMENT, "backend", [](ScaleArgs& x) { x.backend = -1; });
  expect_rejected("dtype FCE_INT32", FCE_ERROR_INVALID_ARGUMENT, "dtype",
                  [](ScaleArgs& x) { x.dtype = FCE_INT32; });
  expect_rejected("dtype FCE_INT64", FCE_ERROR_INVALID_ARGUMENT, "dtype",
                  [](ScaleArgs& x) { x.dtype = FCE_INT64; });
  expect_rejected("dtype 42", FCE_ERROR_INVALID_ARGUMENT, "dtype", [](ScaleArgs& x) { x.dtype = 42; });
}

TEST_F(ScaleBadInput, Counts) {
  expect_rejected("count -1", FCE_ERROR_INVALID_ARGUMENT, "count", [](ScaleArgs& x) { x.count = -1; });
  expect_rejected("count INT64_MIN", FCE_ERROR_INVALID_ARGUMENT, "count",
                  [](ScaleArgs& x) { x.count = INT64_MIN; });
  // count * 4 bytes past 2^62 would overflow the overlap arithmetic: refused up front.
  expect_rejected("count 2^61", FCE_ERROR_INVALID_ARGUMENT, "count",
                  [](ScaleArgs& x) { x.count = int64_t{1} << 61; });
}

TEST_F(ScaleBadInput, NullPointers) {
  expect_rejected("grad_output NULL", FCE_ERROR_NULL_POINTER, "grad_output",
                  [](ScaleArgs& x) { x.gout = nullptr; });
  expect_rejected("grad_output NULL, count 0", FCE_ERROR_NULL_POINTER, "grad_output",
                  [](ScaleArgs& x) { x.gout = nullptr; x.count = 0; x.grad = nullptr; });
  expect_rejected("grad NULL with count > 0", FCE_ERROR_NULL_POINTER, "grad",
                  [](ScaleArgs& x) { x.grad = nullptr; });
}

TEST_F(ScaleBadInput, Misaligned) {
  auto off = [](const void* p, int n) { return const_cast<char*>(static_cast<const char*>(p)) + n; };
  expect_rejected("float32 grad +1 byte", FCE_ERROR_MISALIGNED, "grad",
                  [&](ScaleArgs& x) { x.grad = off(x.grad, 1); x.count = N - 1; });
  expect_rejected("float32 grad +2 bytes", FCE_ERROR_MISALIGNED, "grad",
                  [&](ScaleArgs& x) { x.grad = off(x.grad, 2); x.count = N - 1; });
  expect_rejected("float16 grad +1 byte", FCE_ERROR_MISALIGNED, "grad",
                  [&](ScaleArgs& x) { x.dtype = FCE_FLOAT16; x.grad = off(x.grad, 1); });
  expect_rejected("bfloat16 grad +1 byte", FCE_ERROR_MISALIGNED, "grad",
                  [&](ScaleArgs& x) { x.dtype = FCE_BFLOAT16; x.grad = off(x.grad, 1); });
  expect_rejected("grad_output +2 bytes", FCE_ERROR_MISALIGNED, "grad_output",
                  [&](ScaleArgs& x) { x.gout = reinterpret_cast<const float*>(off(x.gout, 2)); });
}

TEST_F(ScaleBadInput, Overlap) {
  expect_rejected("grad_output inside grad", FCE_ERROR_INVALID_ARGUMENT, "grad_output",
                  [](ScaleArgs& x) { x.gout = static_cast<float*>(x.grad) + 10; });
  expect_rejected("grad_output at grad's first element", FCE_ERROR_INVALID_ARGUMENT, "grad_output",
                  [](ScaleArgs& x) { x.gout = static_cast<float*>(x.grad); });
  expect_rejected("grad_output at grad's last element", FCE_ERROR_INVALID_ARGUMENT, "grad_output",
                  [](ScaleArgs& x) { x.gout = static_cast<float*>(x.grad) + (N - 1); });
  // 16-bit: the 4-byte scalar straddling the end of the span.
  expect_rejected("grad_output straddling the end of a bfloat16 grad", FCE_ERROR_INVALID_ARGUMENT,
                  "grad_output", [](ScaleArgs& x) {
                    x.dtype = FCE_BFLOAT16;
                    x.count = 2 * N - 1;  // ends 2 bytes into the last float
                    x.gout = static_cast<float*>(x.grad) + (N - 1);
                  });
}

// ------------------------------------------------------------------ CUDA only ---------------
#if FCE_TEST_HAVE_CUDA
// Host (malloc) memory on the CUDA backend: refused, naming the argument, without a fault;
// unless the device accesses pageable memory (HMM / ATS), where it is as good as device memory.
TEST_F(Scale, CudaHostPointers) {
  if (!on_cuda()) {
    std::printf("SKIPPED: host pointers on the CUDA backend (FCE_TEST_BACKEND=cuda)\n");
    GTEST_SKIP() << "CUDA backend only";
  }
  int device = 0, pageable = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, device), cudaSuccess);
  const int64_t n = 1000;
  float* host = static_cast<float*>(std::malloc(static_cast<size_t>(n) * 4));
  ASSERT_NE(host, nullptr);
  for (int64_t i = 0; i < n; ++i) host[i] = 0.5f * static_cast<float>(i - 300);
  float* host_g = static_cast<float*>(std::malloc(4));
  ASSERT_NE(host_g, nullptr);
  *host_g = 2.5f;
  Buf dgrad = f32_buf(std::vector<double>(static_cast<size_t>(n), 1.0));
  Buf dgout = f32_buf({2.5});

  // grad in host memory
  fce_status st = fce_scale_gradient(FCE_BACKEND_CUDA, FCE_FLOAT32, n, host, dgout.p<float>(),
                                     test_stream());
  if (pageable) {
    std::printf("NOTE: this device accesses pageable host memory: host pointers are accepted\n");
    EXPECT_EQ(st, FCE_SUCCESS) << fce_last_error();
    ASSERT_TRUE(finish());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(host[i], 1.25f * static_cast<float>(i - 300));
  } else {
    EXPECT_EQ(st, FCE_ERROR_INVALID_ARGUMENT) << fce_last_error();
    EXPECT_TRUE(error_mentions("fce_scale_gradient"));
    EXPECT_TRUE(error_mentions("grad"));
    ASSERT_TRUE(finish());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(host[i], 0.5f * static_cast<float>(i - 300));
  }
  // grad_output in host memory
  st = fce_scale_gradient(FCE_BACKEND_CUDA, FCE_FLOAT32, n, dgrad.ptr(), host_g, test_stream());
  ASSERT_TRUE(finish());
  dgrad.pull();
  const double expect = pageable ? 2.5 : 1.0;
  if (pageable) {
    EXPECT_EQ(st, FCE_SUCCESS) << fce_last_error();
  } else {
    EXPECT_EQ(st, FCE_ERROR_INVALID_ARGUMENT) << fce_last_error();
    EXPECT_TRUE(error_mentions("fce_scale_gradient"));
    EXPECT_TRUE(error_mentions("grad_output"));
  }
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(get(FCE_FLOAT32, dgrad.h() + 4 * i), expect);
  std::free(host);
  std::free(host_g);
}

// Captured into a CUDA graph with the scale in device memory: nothing runs during capture,
// and each replay reads the scalar as it is then (1: untouched, anything else: scaled).
TEST_F(Scale, CudaGraphCapture) {
  if (!on_cuda()) {
    std::printf("SKIPPED: graph capture is a CUDA backend test (FCE_TEST_BACKEND=cuda)\n");
    GTEST_SKIP() << "CUDA backend only";
  }
  const int dtype = FCE_BFLOAT16;
  const int64_t n = 100003;
  std::mt19937_64 rng(9);
  std::vector<uint32_t> data = make_data(rng, dtype, n);
  Buf grad(static_cast<size_t>(n + 8) * 2);
  for (int64_t i = 0; i < n; ++i) set_bits(dtype, grad.h(), 1 + i, data[static_cast<size_t>(i)]);
  grad.push();
  void* gp = static_cast<uint8_t*>(grad.ptr()) + 2;
  Buf gout = f32_buf({1.0});
  auto call = [&] {
    return fce_scale_gradient(FCE_BACKEND_CUDA, dtype, n, gp, gout.p<float>(), test_stream());
  };
  // One eager call first (the header: first call per device does host-side set-up); g = 1.
  ASSERT_EQ(call(), FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
  std::vector<uint8_t> expect = grad.mirror();
  grad.pull();
  ASSERT_TRUE(bitwise_equal(grad.mirror(), expect, "eager call with g = 1"));

  put(FCE_FLOAT32, gout.h(), 2.5);  // set before capture: capture must not run it
  gout.push();
  CapturedGraph graph;
  ASSERT_TRUE(graph.capture(call));
  grad.pull();
  EXPECT_TRUE(bitwise_equal(grad.mirror(), expect, "after capture")) << "the call ran during capture";

  // Replays: 2.5, then 1 (nothing), then -0.375, each applied to the current values.
  std::vector<uint32_t> cur = data;
  for (float g : {2.5f, 1.0f, -0.375f}) {
    SCOPED_TRACE("graph replay with grad_output = " + std::to_string(g));
    put(FCE_FLOAT32, gout.h(), g);
    gout.push();
    const std::vector<uint8_t> before = grad.mirror();
    ASSERT_TRUE(graph.launch());
    ASSERT_TRUE(finish());
    grad.pull();
    if (g == 1.0f) {
      EXPECT_TRUE(bitwise_equal(grad.mirror(), before, "replay with g = 1"));
      continue;
    }
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double ref = reference(dtype, cur[static_cast<size_t>(i)], g, true);
      const uint32_t out = bits_at(dtype, grad.h(), 1 + i);
      if (std::isnan(ref) ? !is_nan_bits(dtype, out) : out != bits_of(dtype, ref)) ++bad;
      cur[static_cast<size_t>(i)] = out;
    }
    EXPECT_EQ(bad, 0) << bad << " of " << n << " elements differ from the reference";
    for (size_t i = 0; i < kGuard + 2; ++i) ASSERT_EQ(grad.mirror()[i], before[i]) << "front guard";
    for (size_t i = kGuard + 2 + static_cast<size_t>(n) * 2; i < before.size(); ++i)
      ASSERT_EQ(grad.mirror()[i], before[i]) << "back guard";
  }
}
#endif  // FCE_TEST_HAVE_CUDA

}  // namespace
