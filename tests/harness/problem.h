// harness/problem.h — problem generation: realistic random data (logits of a realistic spread,
// targets with ignored rows, class weights, upstream gradients, hidden states, weight and bias
// for linear cross-entropy), the options every suite's case shares (CeSpec, LinearSpec),
// their translation into the library's options and the reference's, and the option matrix: a
// list of named option sets crossed with every dtype and reduction, one gtest case each.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../ref.h"
#include "backend.h"
#include "buffers.h"
#include "numbers.h"

namespace fcet {

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

// ------------------------------------------------------------------ the problem -------------
// The options of one cross-entropy problem, as every suite's case has them (a suite's case
// derives from it and adds its own: layouts, which outputs, shards, workspaces).
struct CeSpec {
  std::string name;
  int64_t N = 37, V = 301;
  int dtype = FCE_FLOAT32;
  int tdtype = FCE_INT64;
  int reduction = FCE_REDUCTION_MEAN;
  float eps = 0, lambda = 0, softcap = 0, scale = 1;
  bool weights = false;
  double ignore_frac = 0;
  int64_t ignore_index = -100;
  int64_t shift = 0;             // shift_seq_len T
  int64_t shift_k = 0;           // options.shift k (0 = 1), with T > 0
  bool token_scaling = false;
  bool argmax = false, accuracy = false;  // options.argmax / options.accuracy asked for
  bool gout = true;              // grad_output given (else NULL = 1)
  float gscale = 0.7f;           // its value for mean / sum
  uint64_t seed = 1;
};

// A linear cross-entropy problem: z = h W^T + b over hidden size D.
struct LinearSpec : CeSpec {
  LinearSpec() { N = 37, V = 301; }
  int64_t D = 24;
  bool confident = false;        // some rows' targets are their argmax (p_y large)
  int64_t h_pad = 0;             // hidden_row_stride = D + h_pad (0: passed as 0)
  bool bias = true;
  bool gh = true, gw = true, gb = true;  // which gradients are asked for
  bool accumulate = false;
  bool gw_fp32 = false;
  double zstd = -1;              // logit spread; -1: 8 for float32, 1.5 for 16-bit dtypes
};

// The start of every case's label: name, backend, dtypes, reduction, options.
inline std::string spec_label(const CeSpec& c) {
  std::ostringstream s;
  s << c.name << " [" << backend_name() << " " << dtype_name(c.dtype) << " "
    << dtype_name(c.tdtype) << " " << reduction_name(c.reduction) << " N=" << c.N
    << " V=" << c.V << " eps=" << c.eps << " lambda=" << c.lambda << " softcap=" << c.softcap
    << " scale=" << c.scale << (c.weights ? " weights" : "") << " shift=" << c.shift
    << " k=" << c.shift_k << (c.token_scaling ? " token_scaling" : "")
    << (c.argmax ? " argmax" : "") << (c.accuracy ? " accuracy" : "");
  return s.str();
}

// The library's options for the problem on the backend under test (class weights, strides and
// the optional outputs are the caller's).
inline TestOptions spec_options(const CeSpec& c) {
  TestOptions o = test_options();
  o.dtype = c.dtype;
  o.target_dtype = c.tdtype;
  o.reduction = c.reduction;
  o.label_smoothing = c.eps;
  o.z_loss_scale = c.lambda;
  o.softcap = c.softcap;
  o.logit_scale = c.scale;
  o.ignore_index = c.ignore_index;
  o.shift_seq_len = c.shift;
  o.shift = c.shift_k;
  o.token_scaling = c.token_scaling;
  return o;
}

// The reference's options for the problem with class weights w (empty: none).
inline fceref::Options reference_options(const CeSpec& c, const std::vector<double>& w) {
  fceref::Options r;
  r.reduction = c.reduction;
  r.label_smoothing = c.eps;
  r.z_loss_scale = c.lambda;
  r.softcap = c.softcap;
  r.logit_scale = c.scale;
  r.class_weights = w;
  r.ignore_index = c.ignore_index;
  r.shift_seq_len = c.shift;
  r.shift = c.shift_k;
  r.token_scaling = c.token_scaling;
  return r;
}

// The random generator of a case: its seed and its shape.
inline std::mt19937_64 spec_rng(const CeSpec& c, uint64_t shape) {
  return std::mt19937_64(c.seed * 1000003u + shape);
}

// Class weights in [0.1, 2) (when asked for), then the upstream gradient (when given: [N]
// values in [-1.5, 1.5) for reduction none, else gscale), drawn in that order.
inline void weights_and_upstream(std::mt19937_64& rng, const CeSpec& c, std::vector<double>& w,
                                 std::vector<double>& g) {
  if (c.weights) w = random_uniform(rng, static_cast<size_t>(c.V), 0.1, 2.0);
  if (c.gout) {
    if (c.reduction == FCE_REDUCTION_NONE) g = random_uniform(rng, static_cast<size_t>(c.N), -1.5, 1.5);
    else g = {c.gscale};
  }
}

// The data of a cross-entropy problem over logits.
struct CeData {
  std::vector<double> z;  // dense [N * V], rounded to the dtype
  std::vector<int64_t> y;
  std::vector<double> w;  // class weights (float32 values) or empty
  std::vector<double> g;  // upstream gradient or empty
};

// Logits of row std log-uniform in [std_lo, std_hi], targets (ignore_frac of them ignored),
// class weights, upstream gradient.
inline CeData ce_data(const CeSpec& c, double std_lo, double std_hi) {
  CeData d;
  std::mt19937_64 rng = spec_rng(c, static_cast<uint64_t>(c.N * 131 + c.V));
  d.z = random_logits(rng, c.dtype, c.N, c.V, std_lo, std_hi);
  d.y = random_targets(rng, c.N, c.V, c.ignore_frac, c.ignore_index);
  weights_and_upstream(rng, c, d.w, d.g);
  return d;
}

// Every other row's target becomes its argmax (unless ignored): rows predicted right, p_y large.
inline void confident_targets(const CeSpec& c, std::vector<double>& z, std::vector<int64_t>& y) {
  for (int64_t r = 0; r < c.N; r += 2) {
    const double* row = &z[static_cast<size_t>(r * c.V)];
    if (y[static_cast<size_t>(r)] != c.ignore_index)
      y[static_cast<size_t>(r)] = std::max_element(row, row + c.V) - row;
  }
}

// The data of a linear cross-entropy problem.
struct LinearData {
  std::vector<double> h, W, b, w, g;  // hidden [N * D], weight [V * D], bias [V] or empty
  std::vector<int64_t> y;
  std::vector<double> gw0, gb0;  // accumulate: what grad_weight / grad_bias hold before
};

// Root mean square of the finite values.
inline double rms(const std::vector<double>& v) {
  double s = 0;
  size_t n = 0;
  for (double x : v)
    if (std::isfinite(x)) s += x * x, ++n;
  return n ? std::sqrt(s / static_cast<double>(n)) : 0.0;
}

// Hidden states N(0, 1), a weight of spread zstd / sqrt(D) (logits of std about zstd), a bias
// (when asked for), targets, class weights, upstream gradient; rng carries on (for what the
// case draws next).
inline LinearData linear_data(std::mt19937_64& rng, const LinearSpec& c) {
  LinearData d;
  d.h = random_normal(rng, c.dtype, static_cast<size_t>(c.N * c.D), 1.0);
  d.W = random_normal(rng, c.dtype, static_cast<size_t>(c.V * c.D),
                      c.zstd / std::sqrt(static_cast<double>(c.D)));
  if (c.bias)
    d.b = random_normal(rng, c.dtype, static_cast<size_t>(c.V), c.dtype == FCE_FLOAT32 ? 1.0 : 0.5);
  d.y = random_targets(rng, c.N, c.V, c.ignore_frac, c.ignore_index);
  weights_and_upstream(rng, c, d.w, d.g);
  return d;
}
inline std::mt19937_64 linear_rng(const LinearSpec& c) {
  return spec_rng(c, static_cast<uint64_t>(c.N * 7 + c.D * 131 + c.V));
}

// Every `step`-th row (from row 0) is scored against its argmax (row r against y[r + k] with a
// shift): p_y large. Ignored targets stay.
inline void confident_linear_targets(const LinearSpec& c, LinearData& d, int64_t step) {
  const int64_t k = c.shift > 0 ? std::max<int64_t>(c.shift_k, 1) : 0;
  for (int64_t r = 0; r + k < c.N; r += step) {
    if (d.y[static_cast<size_t>(r + k)] == c.ignore_index) continue;
    int64_t best = 0;
    double zbest = -HUGE_VAL;
    for (int64_t v = 0; v < c.V; ++v) {
      double z = c.bias ? d.b[static_cast<size_t>(v)] : 0.0;
      for (int64_t j = 0; j < c.D; ++j)
        z += d.h[static_cast<size_t>(r * c.D + j)] * d.W[static_cast<size_t>(v * c.D + j)];
      if (z > zbest) zbest = z, best = v;
    }
    d.y[static_cast<size_t>(r + k)] = best;
  }
}

// accumulate: grad_weight and grad_bias pre-filled (in dtype gdt) with values of the spread of
// the reference's gradients.
inline void prefill_gradients(std::mt19937_64& rng, const LinearSpec& c,
                              const fceref::LinearResult& ref, int gdt, LinearData& d) {
  const double sw = rms(ref.grad_weight), sb = rms(ref.grad_bias);
  d.gw0 = random_normal(rng, gdt, static_cast<size_t>(c.V * c.D), sw > 0 ? sw : 1.0);
  d.gb0 = random_normal(rng, gdt, static_cast<size_t>(c.V), sb > 0 ? sb : 1.0);
}

// ------------------------------------------------------------------ the option matrix -------
// A named set of options applied to a default case.
template <class Case>
struct OptionVariant {
  const char* name;
  std::function<void(Case&)> apply;
};

// Every option set crossed with every dtype and reduction, named dtype_reduction_set, seeded
// first_seed, first_seed + 1, ...
template <class Case>
std::vector<Case> option_matrix(const std::vector<OptionVariant<Case>>& sets, uint64_t first_seed = 1) {
  std::vector<Case> cases;
  uint64_t seed = first_seed;
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16})
    for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE})
      for (const OptionVariant<Case>& s : sets) {
        Case c;
        c.dtype = dtype;
        c.reduction = red;
        c.seed = seed++;
        s.apply(c);
        c.name = std::string(dtype_name(dtype)) + "_" + reduction_name(red) + "_" + s.name;
        cases.push_back(c);
      }
  return cases;
}

// The fixture of an option matrix: one gtest case per Case, skipped where the backend cannot
// run; instantiate with FCE_OPTION_MATRIX.
template <class Case>
class MatrixTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { FCE_REQUIRE_BACKEND(); }
};

#define FCE_OPTION_MATRIX(Fixture, cases)                                                     \
  INSTANTIATE_TEST_SUITE_P(Options, Fixture, ::testing::ValuesIn(cases),                      \
                           [](const ::testing::TestParamInfo<Fixture::ParamType>& i) {        \
                             return i.param.name;                                             \
                           })

const int kDtypes[] = {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16};
const int kReductions[] = {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE};

}  // namespace fcet
