// test_soft_targets.cpp — class-probability targets (docs/semantics.md rule 19): targets q
// [rows, vocab] of FCE_FLOAT32 / FCE_FLOAT16 / FCE_BFLOAT16 through fce_forward,
// fce_backward, fce_backward_rescale and fce_linear_ce, against a float64 reference of the
// rule's formulas (checked by finite differences first), against the hard-target call for
// one-hot q, on adversarial rows, and every refusal with its message. The reference:
// soft_ref.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "soft_ref.h"

namespace {

using namespace fcet;
using namespace softref;

// The finite-difference check of the reference's gradient (logit_scale, softcap, smoothing,
// weights, z-loss, sum).
TEST(SoftReference, FiniteDifferences) {
  const int64_t N = 3, V = 6;
  Opts o;
  o.reduction = FCE_REDUCTION_SUM;
  o.eps = 0.1, o.lambda = 0.01, o.softcap = 5.0, o.scale = 1.3;
  o.w = {0.5, 1.0, 2.0, 0.7, 1.1, 0.3};
  std::mt19937_64 rng(3);
  const std::vector<double> z = random_normal(rng, FCE_FLOAT32, N * V, 2.0);
  const std::vector<double> q = random_probs(rng, FCE_FLOAT32, N, V);
  const Ref r = soft_ref(o, N, V, z, q, {1.0});
  for (int64_t i = 0; i < N * V; ++i) {
    const double h = 1e-6;
    std::vector<double> zp = z, zm = z;
    zp[i] += h, zm[i] -= h;
    const double fd =
        (soft_ref(o, N, V, zp, q, {1.0}).loss - soft_ref(o, N, V, zm, q, {1.0}).loss) / (2 * h);
    EXPECT_NEAR(r.grad[i], fd, 1e-6 * (1 + std::fabs(fd))) << "element " << i;
  }
}

// ------------------------------------------------------------------ the calls -------------
TestOptions lib_options(const Opts& ro, int dtype, int qdtype, const Buf& w) {
  TestOptions o = test_options();
  o.dtype = dtype;
  o.target_dtype = qdtype;
  o.reduction = ro.reduction;
  o.label_smoothing = static_cast<float>(ro.eps);
  o.z_loss_scale = static_cast<float>(ro.lambda);
  o.softcap = static_cast<float>(ro.softcap);
  o.logit_scale = static_cast<float>(ro.scale);
  o.class_weights = w.empty() ? nullptr : w.p<const float>();
  return o;
}

Buf dense_buf(int dtype, int64_t rows, int64_t cols, const std::vector<double>& v) {
  const Mat m = mat(dtype, rows, cols);
  Buf b(m);
  write_mat(b, m, v);
  b.push();
  return b;
}

// One problem's inputs and fce_forward's outputs.
struct Problem {
  int64_t N = 0, V = 0;
  int dtype = FCE_FLOAT32, qdtype = FCE_FLOAT32;
  Opts o;
  std::vector<double> z, q, g;
};

Problem make_problem(uint64_t seed, const Config& c, int dtype, int qdtype, int reduction,
                     int64_t N, int64_t V) {
  std::mt19937_64 rng(seed);
  Problem P;
  P.N = N, P.V = V, P.dtype = dtype, P.qdtype = qdtype;
  P.o = c.o;
  P.o.reduction = reduction;
  if (c.weights) P.o.w = random_uniform(rng, static_cast<size_t>(V), 0.2, 2.0);
  P.z = random_logits(rng, dtype, N, V, 1.0, 30.0);
  P.q = random_probs(rng, qdtype, N, V);
  P.g = random_uniform(rng, reduction == FCE_REDUCTION_NONE ? static_cast<size_t>(N) : 1, 0.5, 2.0);
  return P;
}

struct Got {
  std::vector<double> loss, lse, grad, z_loss;
  std::vector<int64_t> argmax;
  uint32_t flags = 0;
};

// fce_forward with every output soft targets allow, and the gradient for P.g (g1: for 1).
Got run_forward(const Problem& P, bool g1 = false) {
  Got got;
  const int64_t N = P.N, V = P.V;
  const Mat zm = mat(P.dtype, N, V),
            lm = vec(FCE_FLOAT32, P.o.reduction == FCE_REDUCTION_NONE ? N : 1),
            rm = vec(FCE_FLOAT32, N);
  Buf z = dense_buf(P.dtype, N, V, P.z), q = dense_buf(P.qdtype, N, V, P.q);
  Buf w = P.o.w.empty() ? Buf() : f32_buf(P.o.w), g = f32_buf(P.g);
  Buf loss = poisoned(lm), lse = poisoned(rm), grad = poisoned(zm),
      zl = poisoned(vec(FCE_FLOAT32, 1));
  Buf am(static_cast<size_t>(N) * 8), flags(4, 0);
  flags.push();
  TestOptions o = lib_options(P.o, P.dtype, P.qdtype, w);
  size_t ws_bytes = 0;
  EXPECT_EQ(fce_forward_workspace_size(&o, N, V, &ws_bytes), FCE_SUCCESS) << fce_last_error();
  Buf ws = workspace_buf(ws_bytes);
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  out.lse = lse.p<float>();
  out.z_loss = zl.p<float>();
  out.argmax = am.p<int64_t>();
  out.error_flags = flags.p<uint32_t>();
  fce_gradients gr = FCE_GRADIENTS_INIT;
  gr.grad_logits = grad.ptr();
  gr.grad_output = g1 ? nullptr : g.p<const float>();
  const fce_status st =
      fce_forward(&o, N, V, z.ptr(), q.ptr(), &out, &gr, ws.ptr(), ws_bytes, test_stream());
  EXPECT_EQ(st, FCE_SUCCESS) << fce_last_error();
  EXPECT_TRUE(finish());
  for (Buf* b : {&loss, &lse, &grad, &zl, &am, &flags}) b->pull();
  EXPECT_TRUE(all_written(grad, zm, "grad_logits"));
  EXPECT_TRUE(all_written(lse, rm, "lse"));
  got.loss = read_mat(loss, lm);
  got.lse = read_mat(lse, rm);
  got.grad = read_mat(grad, zm);
  got.z_loss = read_mat(zl, vec(FCE_FLOAT32, 1));
  got.argmax = read_i64(am, N);
  std::memcpy(&got.flags, flags.h(), 4);
  return got;
}

void check_forward(const Problem& P) {
  const Ref r = soft_ref(P.o, P.N, P.V, P.z, P.q, P.g);
  const Got got = run_forward(P);
  if (P.o.reduction == FCE_REDUCTION_NONE)
    EXPECT_TRUE(close_normwise(got.loss, r.row_loss, 1e-5, "loss"));
  else EXPECT_TRUE(close_scalar(got.loss[0], r.loss, 1e-5, "loss"));
  EXPECT_TRUE(close_normwise(got.lse, r.lse, 1e-5, "lse"));
  EXPECT_TRUE(close_scalar(got.z_loss[0], r.z_loss, 1e-5, "z_loss"));
  EXPECT_TRUE(close_normwise(got.grad, r.grad, tolerance(P.dtype), "grad_logits"));
  EXPECT_EQ(got.argmax, r.argmax);
  EXPECT_EQ(got.flags, 0u) << "error_flags never fire for class probabilities";
}

class SoftTargets : public BackendTest {};

TEST_F(SoftTargets, ForwardMatchesReference) {
  uint64_t seed = 100;
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16})
    for (int qdtype : {FCE_FLOAT32, FCE_BFLOAT16, FCE_FLOAT16})
      for (const Config& c : configs())
        for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE}) {
          SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype) + " q " + dtype_name(qdtype) +
                       " " + reduction_name(red));
          check_forward(make_problem(++seed, c, dtype, qdtype, red, 13, 203));
        }
}

// Rows longer than one pass of a CTA's threads (CUDA: the stream kernel's chunks).
TEST_F(SoftTargets, LongRows) {
  uint64_t seed = 200;
  const std::vector<Config> cs = configs();
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (const Config& c : {cs[0], cs[1], cs[2]}) {
      SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype));
      check_forward(make_problem(++seed, c, dtype, FCE_FLOAT32, FCE_REDUCTION_MEAN, 3, 70001));
    }
}

// One-hot q is the hard-target call (no class weights with mean: the hard mean divides by
// Σ ω_y, the soft one by N).
TEST_F(SoftTargets, OneHotEqualsHardTargets) {
  uint64_t seed = 300;
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (const Config& c : configs())
      for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE}) {
        if (c.weights && red == FCE_REDUCTION_MEAN) continue;
        SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype) + " " + reduction_name(red));
        Problem P = make_problem(++seed, c, dtype, FCE_FLOAT32, red, 9, 77);
        std::mt19937_64 rng(seed);
        const std::vector<int64_t> y = random_targets(rng, P.N, P.V);
        std::fill(P.q.begin(), P.q.end(), 0.0);
        for (int64_t i = 0; i < P.N; ++i) P.q[static_cast<size_t>(i * P.V + y[i])] = 1.0;
        const Got soft = run_forward(P);
        // the hard call
        const Mat zm = mat(dtype, P.N, P.V);
        const Mat lm = vec(FCE_FLOAT32, red == FCE_REDUCTION_NONE ? P.N : 1);
        Buf z = dense_buf(dtype, P.N, P.V, P.z), yb = targets_buf(y, FCE_INT64);
        Buf w = P.o.w.empty() ? Buf() : f32_buf(P.o.w), g = f32_buf(P.g);
        Buf loss = poisoned(lm), grad = poisoned(zm);
        TestOptions o = lib_options(P.o, dtype, FCE_INT64, w);
        size_t ws_bytes = 0;
        ASSERT_EQ(fce_forward_workspace_size(&o, P.N, P.V, &ws_bytes), FCE_SUCCESS);
        Buf ws = workspace_buf(ws_bytes);
        fce_outputs out = FCE_OUTPUTS_INIT;
        out.loss = loss.p<float>();
        fce_gradients gr = FCE_GRADIENTS_INIT;
        gr.grad_logits = grad.ptr();
        gr.grad_output = g.p<const float>();
        ASSERT_EQ(fce_forward(&o, P.N, P.V, z.ptr(), yb.ptr(), &out, &gr, ws.ptr(), ws_bytes,
                              test_stream()),
                  FCE_SUCCESS)
            << fce_last_error();
        ASSERT_TRUE(finish());
        loss.pull();
        grad.pull();
        EXPECT_TRUE(close_normwise(soft.loss, read_mat(loss, lm), 2e-6, "loss"));
        EXPECT_TRUE(close_normwise(soft.grad, read_mat(grad, zm), 2 * tolerance(dtype), "grad"));
      }
}

// fce_backward (p from the saved lse, q read again) and fce_backward_rescale (exact scaling,
// and recomputation: bit for bit fce_forward's) against fce_forward's gradient.
TEST_F(SoftTargets, BackwardAndRescale) {
  uint64_t seed = 400;
  const std::vector<Config> cs = configs();
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16})
    for (const Config& c : cs)
      for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE})
        for (double gv : {0.5, 0.3}) {
          SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype) + " " + reduction_name(red) +
                       " g " + std::to_string(gv));
          Problem P = make_problem(++seed, c, dtype, FCE_BFLOAT16, red, 11, 131);
          std::fill(P.g.begin(), P.g.end(), gv);
          const Got fwd = run_forward(P), fwd1 = run_forward(P, true);
          const int64_t N = P.N, V = P.V;
          const Mat zm = mat(dtype, N, V);
          Buf z = dense_buf(dtype, N, V, P.z), q = dense_buf(P.qdtype, N, V, P.q);
          Buf w = P.o.w.empty() ? Buf() : f32_buf(P.o.w), g = f32_buf(P.g);
          Buf lse = f32_buf(fwd.lse);
          TestOptions o = lib_options(P.o, dtype, P.qdtype, w);
          size_t ws_bytes = 0;
          ASSERT_EQ(fce_backward_workspace_size(&o, N, V, &ws_bytes), FCE_SUCCESS);
          Buf ws = workspace_buf(ws_bytes);
          fce_gradients gr = FCE_GRADIENTS_INIT;
          gr.grad_output = g.p<const float>();
          Buf grad = poisoned(zm);
          gr.grad_logits = grad.ptr();
          ASSERT_EQ(fce_backward(&o, N, V, z.ptr(), q.ptr(), lse.p<const float>(), nullptr, &gr,
                                 ws.ptr(), ws_bytes, test_stream()),
                    FCE_SUCCESS)
              << fce_last_error();
          ASSERT_TRUE(finish());
          grad.pull();
          EXPECT_TRUE(close_normwise(read_mat(grad, zm), fwd.grad, std::max(2e-5, tolerance(dtype)),
                                     "fce_backward"));
          if (red == FCE_REDUCTION_NONE) continue;
          Buf rescaled = dense_buf(dtype, N, V, fwd1.grad);
          gr.grad_logits = rescaled.ptr();
          ASSERT_EQ(fce_backward_rescale(&o, N, V, z.ptr(), q.ptr(), lse.p<const float>(), nullptr,
                                         &gr, ws.ptr(), ws_bytes, test_stream()),
                    FCE_SUCCESS)
              << fce_last_error();
          ASSERT_TRUE(finish());
          rescaled.pull();
          const std::vector<double> got = read_mat(rescaled, zm);
          if (gv == 0.3) {  // recomputed by the forward's own computation
            EXPECT_EQ(got, fwd.grad);
          } else {  // scaled in place: exact, but for one subnormal step (rounded twice)
            const double step = std::ldexp(1.0, dtype == FCE_FLOAT16    ? -24
                                                : dtype == FCE_BFLOAT16 ? -133
                                                                        : -149);
            for (size_t i = 0; i < got.size(); ++i)
              EXPECT_LE(std::fabs(got[i] - fwd.grad[i]), step) << "element " << i;
          }
        }
}

// Adversarial rows: a constant row at −1e30, a bfloat16 row near its limit, a row whose −inf
// entries have q = 0 (finite), a −inf entry with q > 0 (loss +inf), a row of −inf (NaN), a row
// of huge spread, a NaN logit.
TEST_F(SoftTargets, AdversarialRows) {
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const int64_t N = 7, V = 67;
    const double big = dtype == FCE_FLOAT16 ? 65504.0 : dtype == FCE_BFLOAT16 ? 3.38e38 : 3.4e38;
    std::mt19937_64 rng(17);
    Problem P;
    P.N = N, P.V = V, P.dtype = dtype, P.qdtype = FCE_FLOAT32;
    P.z = random_logits(rng, dtype, N, V, 1.0, 10.0);
    P.q = random_probs(rng, FCE_FLOAT32, N, V);
    P.o.reduction = FCE_REDUCTION_NONE;
    P.g.assign(static_cast<size_t>(N), 1.0);
    for (int64_t j = 0; j < V; ++j) P.z[0 * V + j] = round_to(dtype, -big);
    for (int64_t j = 0; j < V; ++j) P.z[1 * V + j] = round_to(dtype, j % 2 ? big : big / 2);
    for (int64_t j = 0; j < V; j += 3) P.z[2 * V + j] = -INFINITY, P.q[2 * V + j] = 0.0;
    P.z[3 * V + 4] = -INFINITY;  // q > 0 there (random_probs: row 3 dense)
    P.q[3 * V + 4] = 0.25;
    for (int64_t j = 0; j < V; ++j) P.z[4 * V + j] = -INFINITY;
    for (int64_t j = 0; j < V; ++j) P.z[5 * V + j] = round_to(dtype, j * (big / V) - big / 2);
    P.z[6 * V + 9] = kNaN;
    const Ref r = soft_ref(P.o, N, V, P.z, P.q, P.g);
    ASSERT_TRUE(std::isfinite(r.row_loss[0]) && std::isfinite(r.row_loss[2]));
    ASSERT_EQ(r.row_loss[3], INFINITY);
    ASSERT_TRUE(std::isnan(r.row_loss[4]) && std::isnan(r.row_loss[6]));
    const Got got = run_forward(P);
    for (int64_t i = 0; i < N; ++i) {
      SCOPED_TRACE("row " + std::to_string(i));
      EXPECT_TRUE(close_scalar(got.loss[i], r.row_loss[i], 1e-5, "loss"));
      if (i == 4 || i == 6) {  // NaN rows: NaN gradient
        for (int64_t j = 0; j < V; ++j) EXPECT_TRUE(std::isnan(got.grad[i * V + j]));
        continue;
      }
      const std::vector<double> gg(got.grad.begin() + i * V, got.grad.begin() + (i + 1) * V);
      const std::vector<double> gw(r.grad.begin() + i * V, r.grad.begin() + (i + 1) * V);
      EXPECT_TRUE(close_normwise(gg, gw, tolerance(dtype), "gradient row"));
    }
  }
}

// fce_linear_ce: z = h·Wᵀ + b then rule 19, ∂h = ∂z·W, ∂W = ∂zᵀ·h, ∂b = Σ_r ∂z_r, at the
// minimum workspace and the full-speed one.
TEST_F(SoftTargets, LinearCe) {
  uint64_t seed = 500;
  const std::vector<Config> cs = configs();
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (const Config& c : {cs[0], cs[1], cs[2]})
      for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_NONE})
        for (bool optimal : {false, true}) {
          SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype) + " " + reduction_name(red) +
                       (optimal ? " optimal" : " min"));
          const int64_t N = 37, D = 24, V = 301;
          std::mt19937_64 rng(++seed);
          Opts ro = c.o;
          ro.reduction = red;
          if (c.weights) ro.w = random_uniform(rng, static_cast<size_t>(V), 0.2, 2.0);
          const std::vector<double> h = random_normal(rng, dtype, N * D, 1.0);
          const std::vector<double> W = random_normal(rng, dtype, V * D, 0.5);
          const std::vector<double> b = random_normal(rng, dtype, V, 0.5);
          const std::vector<double> q = random_probs(rng, FCE_FLOAT16, N, V);
          const std::vector<double> g =
              random_uniform(rng, red == FCE_REDUCTION_NONE ? static_cast<size_t>(N) : 1, 0.5, 2.0);
          std::vector<double> z(static_cast<size_t>(N * V));
          for (int64_t i = 0; i < N; ++i)
            for (int64_t j = 0; j < V; ++j) {
              long double acc = b[j];
              for (int64_t k = 0; k < D; ++k)
                acc += static_cast<long double>(h[i * D + k]) * W[j * D + k];
              z[i * V + j] = static_cast<double>(acc);
            }
          const Ref r = soft_ref(ro, N, V, z, q, g);
          std::vector<double> dh(static_cast<size_t>(N * D), 0.0),
              dW(static_cast<size_t>(V * D), 0.0), db(static_cast<size_t>(V), 0.0);
          for (int64_t i = 0; i < N; ++i)
            for (int64_t j = 0; j < V; ++j) {
              const double d = r.grad[i * V + j];
              db[j] += d;
              for (int64_t k = 0; k < D; ++k)
                dh[i * D + k] += d * W[j * D + k], dW[j * D + k] += d * h[i * D + k];
            }
          Buf hb = dense_buf(dtype, N, D, h), Wb = dense_buf(dtype, V, D, W),
              bb = dense_buf(dtype, 1, V, b);
          Buf qb = dense_buf(FCE_FLOAT16, N, V, q), wb = ro.w.empty() ? Buf() : f32_buf(ro.w),
              gb = f32_buf(g);
          const Mat lm = vec(FCE_FLOAT32, red == FCE_REDUCTION_NONE ? N : 1);
          const Mat hm = mat(dtype, N, D), wm = mat(FCE_FLOAT32, V, D), bm = vec(FCE_FLOAT32, V);
          Buf loss = poisoned(lm), gh = poisoned(hm), gW = poisoned(wm), gbias = poisoned(bm);
          TestOptions o = lib_options(ro, dtype, FCE_FLOAT16, wb);
          o.grad_weight_fp32 = 1;
          size_t lo = 0, hi = 0;
          ASSERT_EQ(fce_linear_ce_workspace_size(&o, N, D, V, 1, &lo, &hi), FCE_SUCCESS)
              << fce_last_error();
          const size_t ws_bytes = optimal ? hi : lo;
          Buf ws = workspace_buf(ws_bytes);
          fce_outputs out = FCE_OUTPUTS_INIT;
          out.loss = loss.p<float>();
          fce_gradients gr = FCE_GRADIENTS_INIT;
          gr.grad_output = gb.p<const float>();
          gr.grad_hidden = gh.ptr();
          gr.grad_weight = gW.ptr();
          gr.grad_bias = gbias.ptr();
          ASSERT_EQ(fce_linear_ce(&o, N, D, V, hb.ptr(), Wb.ptr(), bb.ptr(), qb.ptr(), &out, &gr,
                                  ws.ptr(), ws_bytes, test_stream()),
                    FCE_SUCCESS)
              << fce_last_error();
          ASSERT_TRUE(finish());
          for (Buf* x : {&loss, &gh, &gW, &gbias}) x->pull();
          const double tol = dtype == FCE_FLOAT32 ? 1e-5 : 2e-2;  // bf16 logits from a bf16 GEMM
          if (red == FCE_REDUCTION_NONE)
            EXPECT_TRUE(close_normwise(read_mat(loss, lm), r.row_loss, tol, "loss"));
          else EXPECT_TRUE(close_scalar(read_mat(loss, lm)[0], r.loss, tol, "loss"));
          EXPECT_TRUE(close_normwise(read_mat(gh, hm), dh, dtype == FCE_FLOAT32 ? 1e-5 : 3e-2,
                                     "grad_hidden"));
          EXPECT_TRUE(close_normwise(read_mat(gW, wm), dW, dtype == FCE_FLOAT32 ? 1e-5 : 3e-2,
                                     "grad_weight"));
          EXPECT_TRUE(close_normwise(read_mat(gbias, bm), db, dtype == FCE_FLOAT32 ? 1e-5 : 3e-2,
                                     "grad_bias"));
        }
}

// ------------------------------------------------------------------ refusals --------------
class SoftRefusals : public BackendTest {
 protected:
  static constexpr int64_t N = 4, V = 16;
  Buf z = dense_buf(FCE_FLOAT32, N, V, std::vector<double>(N* V, 0.5));
  Buf q = dense_buf(FCE_FLOAT32, N, V, std::vector<double>(N* V, 1.0 / V));
  Buf loss = Buf(16), acc = Buf(16), grad = Buf(N * V * 4),
      lse = f32_buf(std::vector<double>(N, 3.0));
  Buf ws = workspace_buf(1 << 20);
  TestOptions soft() {
    TestOptions o = test_options();
    o.target_dtype = FCE_FLOAT32;
    return o;
  }
  void expect(fce_status st, fce_status want, const char* call, const char* field) {
    EXPECT_EQ(st, want) << fce_last_error();
    EXPECT_TRUE(error_mentions(call));
    EXPECT_TRUE(error_mentions(field));
  }
  fce_status forward(const TestOptions& o, float* accuracy = nullptr) {
    fce_outputs out = FCE_OUTPUTS_INIT;
    out.loss = loss.p<float>();
    out.accuracy = accuracy;
    return fce_forward(&o, N, V, z.ptr(), q.ptr(), &out, nullptr, ws.ptr(), 1 << 20, test_stream());
  }
};

TEST_F(SoftRefusals, TokenScalingShiftAccuracy) {
  TestOptions o = soft();
  o.token_scaling = 1;
  expect(forward(o), FCE_ERROR_INVALID_ARGUMENT, "fce_forward", "options->token_scaling");
  size_t bytes = 0;
  expect(fce_forward_workspace_size(&o, N, V, &bytes), FCE_ERROR_INVALID_ARGUMENT,
         "fce_forward_workspace_size", "options->token_scaling");
  o = soft();
  o.shift_seq_len = 2;
  expect(forward(o), FCE_ERROR_UNSUPPORTED, "fce_forward", "options->shift_seq_len");
  expect(forward(soft(), acc.p<float>()), FCE_ERROR_INVALID_ARGUMENT, "fce_forward",
         "outputs->accuracy");
  // fce_linear_ce
  o = soft();
  Buf h = dense_buf(FCE_FLOAT32, N, 8, std::vector<double>(N * 8, 0.1));
  Buf W = dense_buf(FCE_FLOAT32, V, 8, std::vector<double>(V * 8, 0.1));
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  out.accuracy = acc.p<float>();
  expect(fce_linear_ce(&o, N, 8, V, h.ptr(), W.ptr(), nullptr, q.ptr(), &out, nullptr, ws.ptr(),
                       1 << 20, test_stream()),
         FCE_ERROR_INVALID_ARGUMENT, "fce_linear_ce", "outputs->accuracy");
  o.shift_seq_len = 2;
  out.accuracy = nullptr;
  expect(fce_linear_ce(&o, N, 8, V, h.ptr(), W.ptr(), nullptr, q.ptr(), &out, nullptr, ws.ptr(),
                       1 << 20, test_stream()),
         FCE_ERROR_UNSUPPORTED, "fce_linear_ce", "options->shift_seq_len");
  // the other float enums stay refused
  o = soft();
  o.target_dtype = 7;
  expect(forward(o), FCE_ERROR_INVALID_ARGUMENT, "fce_forward", "options->target_dtype");
}

// The vocabulary-parallel calls take class probabilities (test_vp_soft.cpp): their workspace
// queries answer for them.
TEST_F(SoftRefusals, VocabularyParallelQueries) {
  const TestOptions o = soft();
  size_t bytes = 0, lo = 0;
  EXPECT_EQ(fce_vp_loss_workspace_size(&o, 2, N, V, &bytes), FCE_SUCCESS) << fce_last_error();
  EXPECT_EQ(fce_vp_backward_workspace_size(&o, 2, N, V, V / 2, &bytes), FCE_SUCCESS)
      << fce_last_error();
  EXPECT_EQ(fce_vp_linear_stats_workspace_size(&o, N, 8, V / 2, &lo, nullptr), FCE_SUCCESS)
      << fce_last_error();
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o, 2, N, 8, V, V / 2, 1, FCE_FLOAT32, &lo, nullptr),
            FCE_SUCCESS)
      << fce_last_error();
  EXPECT_EQ(fce_vp_linear_backward_workspace_size(&o, 2, N, 8, V, V / 2, FCE_FLOAT32, &lo, nullptr),
            FCE_SUCCESS)
      << fce_last_error();
}

// Every row is scored: ignore_index does not apply (a row of q equal to it is still a row).
TEST_F(SoftTargets, IgnoreIndexDoesNotApply) {
  Problem P = make_problem(900, configs()[0], FCE_FLOAT32, FCE_FLOAT32, FCE_REDUCTION_MEAN, 5, 33);
  const Got a = run_forward(P);
  const Ref r = soft_ref(P.o, P.N, P.V, P.z, P.q, P.g);
  EXPECT_TRUE(close_scalar(a.loss[0], r.loss, 1e-5, "loss"));
  for (int64_t i = 0; i < P.N; ++i) EXPECT_GE(a.argmax[i], 0);
}

}  // namespace
