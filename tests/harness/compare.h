// harness/compare.h — comparisons with the float64 reference: the tolerance of each dtype,
// norm-wise and scalar closeness, bitwise equality, and the message of a failing call.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "buffers.h"
#include "numbers.h"

namespace fcet {

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

// The bound for everything downstream of the logits of a linear cross-entropy. float32:
// docs/semantics.md's 1e-5. float16 and bfloat16: torch eager materialises z = h W^T + b in the
// dtype, which perturbs every logit by up to u |z| and so every p (and the loss) by up to
// 2u max|z| relative; on top of that the same 4u as tolerance() for the dtype's roundings of
// the results.
inline double lin_tolerance(int dtype, const std::vector<double>& z) {
  if (dtype == FCE_FLOAT32) return 1e-5;
  double zmax = 0;
  for (double v : z) zmax = std::max(zmax, std::fabs(v));
  return unit_roundoff(dtype) * (4.0 + 2.0 * zmax);
}

// Relative width of an argmax near tie (check_ce.h) over logits: a few float32 roundings of
// a = s z, capped (tanhf, the product with s/c), on the CUDA backend.
constexpr double kArgmaxTie = 16.0 / 16777216.0;

// The same for a linear cross-entropy: the logits come out of a float32 GEMM (a relative error
// of some 2^-24 D), and on CUDA a 16-bit plan may round them to the dtype.
inline double argmax_tie(int dtype) {
  return dtype == FCE_FLOAT32 ? 1e-5 : 2 * unit_roundoff(dtype);
}

// The reference's values as float32 outputs hold them: rounded to float (a value past the
// float32 range is the infinity a float32 result must be; e.g. z-loss of a row at 1e30).
inline std::vector<double> as_f32(const std::vector<double>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = static_cast<float>(v[i]);
  return out;
}
inline double as_f32(double v) { return static_cast<float>(v); }

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
