// test_entropy.cpp — the differentiable lse and the per-row entropy (docs/semantics.md rule 18):
// outputs->entropy, gradients->grad_lse and ->grad_entropy through fce_forward (one pass),
// fce_backward (grad_lse) and fce_linear_ce, against a float64 reference built on ref.h, whose
// own formulas are checked by finite differences first; and every refusal.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "entropy_ref.h"
#include "ref.h"
#include "test_util.h"

namespace {

using namespace fcet;

// ------------------------------------------------------------ finite differences ----------
// The reference's formulas against central differences of f(z) = Σ_i gl_i lse_i + ge_i H_i,
// H_i computed the plain way (lse − Σ p a), on a tiny problem with logit_scale and softcap.
TEST(EntropyReference, FiniteDifferences) {
  const int64_t N = 3, V = 5;
  fceref::Options o;
  o.logit_scale = 1.7;
  o.softcap = 6.0;
  std::mt19937_64 rng(7);
  std::vector<double> z = random_normal(rng, FCE_FLOAT32, static_cast<size_t>(N * V), 2.0);
  const std::vector<double> gl = {0.7, -1.3, 0.0}, ge = {-0.4, 0.9, 2.1};
  auto f = [&](const std::vector<double>& x) {
    double total = 0;
    for (int64_t r = 0; r < N; ++r) {
      std::vector<double> a(static_cast<size_t>(V));
      double mx = -INFINITY;
      for (int64_t j = 0; j < V; ++j) {
        a[j] = o.softcap * std::tanh(o.logit_scale * x[r * V + j] / o.softcap);
        mx = std::max(mx, a[j]);
      }
      double s = 0;
      for (double v : a) s += std::exp(v - mx);
      const double lse = mx + std::log(s);
      double pa = 0;
      for (double v : a) pa += std::exp(v - lse) * v;
      total += gl[r] * lse + ge[r] * (lse - pa);
    }
    return total;
  };
  const std::vector<int64_t> y(static_cast<size_t>(N), -100);  // all ignored: no loss term
  const fceref::CeResult ce = fceref::cross_entropy(o, N, V, z, y, nullptr, true);
  const RowTermsRef t = row_terms_ref(o, ce, N, V, &gl, &ge);
  for (int64_t i = 0; i < N * V; ++i) {
    const double h = 1e-6;
    std::vector<double> zp = z, zm = z;
    zp[i] += h;
    zm[i] -= h;
    const double fd = (f(zp) - f(zm)) / (2 * h);
    EXPECT_NEAR(t.dz[i], fd, 1e-7 * (1 + std::fabs(fd))) << "element " << i;
  }
  // The entropy itself: H = lse − Σ p a.
  for (int64_t r = 0; r < N; ++r) {
    double pa = 0;
    for (int64_t j = 0; j < V; ++j) pa += std::exp(ce.a[r * V + j] - ce.lse[r]) * ce.a[r * V + j];
    EXPECT_NEAR(t.entropy[r], ce.lse[r] - pa, 1e-12);
  }
}

// ------------------------------------------------------------------ the calls -------------
// The option sets of the cases, on a CeSpec (spec_options and reference_options give the
// library's options and the reference's); a quarter of the targets ignored.
std::vector<CeSpec> configs() {
  auto make = [](const char* name, void (*set)(CeSpec&)) {
    CeSpec c;
    c.name = name;
    c.ignore_frac = 0.25;
    if (set) set(c);
    return c;
  };
  return {
      make("plain", nullptr),
      make("smoothing+weights+zloss",
           [](CeSpec& c) { c.eps = 0.1f, c.lambda = 1e-3f, c.weights = true; }),
      make("softcap+scale", [](CeSpec& c) { c.softcap = 20.0f, c.scale = 0.75f; }),
      make("scale", [](CeSpec& c) { c.scale = 1.5f; }),
      make("shift", [](CeSpec& c) { c.shift = 4, c.shift_k = 1; }),
      make("token_scaling+zloss", [](CeSpec& c) { c.token_scaling = true, c.lambda = 1e-2f; }),
  };
}

// One case's data: ce_data's (logits of row std 1 to 30, targets, class weights, the loss's
// upstream gradient) and the upstream gradients of lse and of the entropy, [N] in [-2, 2) each.
struct Problem : CeData {
  std::vector<double> gl, ge;
};

Problem make_problem(const CeSpec& c) {
  Problem p;
  static_cast<CeData&>(p) = ce_data(c, 1.0, 30.0);
  std::mt19937_64 rng = spec_rng(c, 18);
  p.gl = random_uniform(rng, static_cast<size_t>(c.N), -2.0, 2.0);
  p.ge = random_uniform(rng, static_cast<size_t>(c.N), -2.0, 2.0);
  return p;
}

// The case's name, dtype and reduction, for SCOPED_TRACE.
std::string case_name(const CeSpec& c) {
  return c.name + " " + dtype_name(c.dtype) + " " + reduction_name(c.reduction);
}

struct Want {
  bool lse_terms = true, entropy_terms = true, loss_grad = true;
  bool grad = true;  // false: the forward alone (no gradients), its entropy, lse and loss
};

// fce_forward with outputs->entropy and lse, and the one-pass gradient with grad_lse and
// grad_entropy (loss_grad false: grad_output 0 for mean/sum, so only the row terms are left).
void check_forward(CeSpec c, int dtype, int reduction, const Want& w, uint64_t seed, int64_t N = 16,
                   int64_t V = 203) {
  c.dtype = dtype;
  c.reduction = reduction;
  c.seed = seed;
  c.N = N;
  c.V = V;
  SCOPED_TRACE(case_name(c));
  Problem P = make_problem(c);
  if (!w.loss_grad) std::fill(P.g.begin(), P.g.end(), 0.0);
  const fceref::Options ro = reference_options(c, P.w);
  const fceref::CeResult ref = fceref::cross_entropy(ro, N, V, P.z, P.y, &P.g, true);
  const RowTermsRef rt = row_terms_ref(ro, ref, N, V, w.lse_terms ? &P.gl : nullptr,
                                       w.entropy_terms ? &P.ge : nullptr);

  const Mat zm = mat(dtype, N, V);
  Buf z(zm);
  write_mat(z, zm, P.z);
  z.push();
  Buf wb = P.w.empty() ? Buf() : f32_buf(P.w);
  Buf y = targets_buf(P.y, c.tdtype);
  Buf gl = f32_buf(P.gl), ge = f32_buf(P.ge), g = f32_buf(P.g);
  const Mat lm = vec(FCE_FLOAT32, reduction == FCE_REDUCTION_NONE ? N : 1);
  const Mat rm = vec(FCE_FLOAT32, N);
  Buf loss = poisoned(lm), lse = poisoned(rm), ent = poisoned(rm), grad = poisoned(zm);
  TestOptions o = spec_options(c);
  o.class_weights = wb.p<const float>();
  size_t ws_bytes = 0;
  ASSERT_EQ(fce_forward_workspace_size(&o, N, V, &ws_bytes), FCE_SUCCESS);
  Buf ws = workspace_buf(ws_bytes);
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  out.lse = lse.p<float>();
  out.entropy = ent.p<float>();
  fce_gradients gr = FCE_GRADIENTS_INIT;
  gr.grad_logits = grad.ptr();
  gr.grad_output = g.p<const float>();
  gr.grad_lse = w.lse_terms ? gl.p<const float>() : nullptr;
  gr.grad_entropy = w.entropy_terms ? ge.p<const float>() : nullptr;
  const fce_status st = fce_forward(&o, N, V, z.ptr(), y.ptr(), &out, w.grad ? &gr : nullptr,
                                    ws.ptr(), ws_bytes, test_stream());
  ASSERT_EQ(st, FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
  loss.pull();
  lse.pull();
  ent.pull();
  grad.pull();
  EXPECT_TRUE(all_written(ent, rm, "entropy"));
  if (w.grad) EXPECT_TRUE(all_written(grad, zm, "grad_logits"));
  EXPECT_TRUE(close_normwise(read_mat(ent, rm), rt.entropy, 1e-5, "entropy"));
  EXPECT_TRUE(close_normwise(read_mat(lse, rm), ref.lse, 1e-5, "lse"));
  if (reduction == FCE_REDUCTION_NONE) {
    EXPECT_TRUE(close_normwise(read_mat(loss, lm), ref.row_loss, 1e-5, "loss"));
  } else {
    EXPECT_TRUE(close_scalar(read_mat(loss, lm)[0], ref.loss, 1e-5, "loss"));
  }
  if (w.grad)
    EXPECT_TRUE(
        close_normwise(read_mat(grad, zm), total_grad(ref, rt), tolerance(dtype), "grad_logits"));
}

class Entropy : public BackendTest {};

TEST_F(Entropy, ForwardOnePass) {
  uint64_t seed = 100;
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16})
    for (const CeSpec& c : configs())
      for (int red : kReductions) check_forward(c, dtype, red, {}, ++seed);
}

TEST_F(Entropy, ForwardTermsAlone) {
  uint64_t seed = 200;
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (const CeSpec& c : configs())
      for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM}) {
        check_forward(c, dtype, red, {true, false, false}, ++seed);  // grad_lse alone
        check_forward(c, dtype, red, {false, true, false}, ++seed);  // grad_entropy alone
        check_forward(c, dtype, red, {true, true, false}, ++seed);
      }
}

TEST_F(Entropy, ForwardOneTermWithLoss) {
  uint64_t seed = 300;
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16})
    for (const CeSpec& c : configs()) {
      check_forward(c, dtype, FCE_REDUCTION_MEAN, {true, false, true}, ++seed);
      check_forward(c, dtype, FCE_REDUCTION_NONE, {false, true, true}, ++seed);
    }
}

// Rows longer than one pass of a CTA's threads (CUDA: the stream kernel's chunks).
TEST_F(Entropy, LongRows) {
  uint64_t seed = 600;
  const std::vector<CeSpec> cs = configs();
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (const CeSpec& c : {cs[0], cs[1], cs[2]})
      check_forward(c, dtype, FCE_REDUCTION_MEAN, {}, ++seed, 3, 70001);
}

// Rows of the lengths the CUDA bulk kernel takes on sm_90: forward-only rows of 16 KiB and
// more, and with the gradient unaligned 16-bit rows of 64-104 KB (V = 50257: 100.5 KB).
TEST_F(Entropy, BulkRows) {
  uint64_t seed = 700;
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16})
    for (const CeSpec& c : configs()) {
      check_forward(c, dtype, FCE_REDUCTION_MEAN, {}, ++seed, 8, 50257);
      check_forward(c, dtype, FCE_REDUCTION_NONE, {true, false, true}, ++seed, 8, 50257);
      check_forward(c, dtype, FCE_REDUCTION_SUM, {false, true, false}, ++seed, 8, 50257);
      for (int64_t V : {20000, 50257})
        check_forward(c, dtype, FCE_REDUCTION_NONE, {false, false, true, false}, ++seed, 8, V);
    }
}

// Adversarial rows: −inf entries, a constant row, a row near the dtype's limit, a row of huge
// spread, a one-hot row; entropy and gradient never NaN where the reference is finite. V = 67,
// and rows the CUDA bulk kernel takes (with the gradient, and the forward alone).
void check_adversarial(int dtype, int64_t V, bool with_grad) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " V " + std::to_string(V) +
               (with_grad ? " with the gradient" : " forward only"));
  const int64_t N = 6;
  const double big = dtype == FCE_FLOAT16 ? 65504.0 : dtype == FCE_BFLOAT16 ? 3.38e38 : 3.4e38;
  std::mt19937_64 rng(11);
  std::vector<double> z = random_logits(rng, dtype, N, V, 1.0, 10.0);
  for (int64_t j = 0; j < V; j += 3) z[0 * V + j] = -INFINITY;           // −inf entries
  for (int64_t j = 0; j < V; ++j) z[1 * V + j] = round_to(dtype, -big);  // constant, huge
  for (int64_t j = 0; j < V; ++j) z[2 * V + j] = round_to(dtype, j % 2 ? big : big / 2);
  for (int64_t j = 0; j < V; ++j) z[3 * V + j] = 0.0;                       // constant: H = log V
  for (int64_t j = 0; j < V; ++j) z[4 * V + j] = j == 5 ? 0.0 : -INFINITY;  // one-hot: H = 0
  for (int64_t j = 0; j < V; ++j) z[5 * V + j] = round_to(dtype, j * (big / V) - big / 2);
  const std::vector<int64_t> y = {1, 2, -100, 4, 5, 6};
  CeSpec c;
  c.dtype = dtype;
  c.reduction = FCE_REDUCTION_SUM;
  const fceref::Options ro = reference_options(c, {});
  const std::vector<double> g = {1.0}, gl = random_uniform(rng, N, -1, 1),
                            ge = random_uniform(rng, N, -1, 1);
  const fceref::CeResult ref = fceref::cross_entropy(ro, N, V, z, y, &g, true);
  const RowTermsRef rt = row_terms_ref(ro, ref, N, V, &gl, &ge);
  EXPECT_NEAR(rt.entropy[3], std::log(double(V)), 1e-12);
  EXPECT_EQ(rt.entropy[4], 0.0);

  const Mat zm = mat(dtype, N, V), rm = vec(FCE_FLOAT32, N);
  Buf zb(zm);
  write_mat(zb, zm, z);
  zb.push();
  Buf yb = targets_buf(y, FCE_INT64), gb = f32_buf(g), glb = f32_buf(gl), geb = f32_buf(ge);
  Buf loss = poisoned(vec(FCE_FLOAT32, 1)), ent = poisoned(rm), grad = poisoned(zm);
  TestOptions o = spec_options(c);
  size_t ws_bytes = 0;
  ASSERT_EQ(fce_forward_workspace_size(&o, N, V, &ws_bytes), FCE_SUCCESS);
  Buf ws = workspace_buf(ws_bytes);
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  out.entropy = ent.p<float>();
  fce_gradients gr = FCE_GRADIENTS_INIT;
  gr.grad_logits = grad.ptr();
  gr.grad_output = gb.p<const float>();
  gr.grad_lse = glb.p<const float>();
  gr.grad_entropy = geb.p<const float>();
  const fce_status st = fce_forward(&o, N, V, zb.ptr(), yb.ptr(), &out, with_grad ? &gr : nullptr,
                                    ws.ptr(), ws_bytes, test_stream());
  ASSERT_EQ(st, FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
  ent.pull();
  grad.pull();
  const std::vector<double> got_h = read_mat(ent, rm), got_g = read_mat(grad, zm);
  const std::vector<double> want_g = total_grad(ref, rt);
  // row by row: each row's scale differs wildly; an absolute floor for entropies near 0
  for (int64_t r = 0; r < N; ++r) {
    SCOPED_TRACE("row " + std::to_string(r));
    EXPECT_TRUE(std::isfinite(got_h[r])) << got_h[r];
    EXPECT_NEAR(got_h[r], rt.entropy[r], 1e-5 * (1 + std::fabs(rt.entropy[r])));
    if (!with_grad) continue;
    const std::vector<double> gr_got(got_g.begin() + r * V, got_g.begin() + (r + 1) * V);
    const std::vector<double> gr_want(want_g.begin() + r * V, want_g.begin() + (r + 1) * V);
    EXPECT_TRUE(close_normwise(gr_got, gr_want, tolerance(dtype), "gradient row"));
  }
}

TEST_F(Entropy, AdversarialRows) {
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16}) check_adversarial(dtype, 67, true);
}

TEST_F(Entropy, AdversarialBulkRows) {
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16}) {
    check_adversarial(dtype, 50257, true);
    check_adversarial(dtype, 20000, false);
  }
}

// fce_backward with grad_lse (every row, ignored ones included), from the lse fce_forward saved.
TEST_F(Entropy, BackwardGradLse) {
  uint64_t seed = 400;
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16})
    for (CeSpec c : configs())
      for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_NONE}) {
        c.dtype = dtype;
        c.reduction = red;
        c.seed = ++seed;
        c.N = 12;
        c.V = 131;
        SCOPED_TRACE(case_name(c));
        const int64_t N = c.N, V = c.V;
        const Problem P = make_problem(c);
        const fceref::Options ro = reference_options(c, P.w);
        const fceref::CeResult ref = fceref::cross_entropy(ro, N, V, P.z, P.y, &P.g, true);
        const RowTermsRef rt = row_terms_ref(ro, ref, N, V, &P.gl, nullptr);
        const Mat zm = mat(dtype, N, V);
        Buf z(zm);
        write_mat(z, zm, P.z);
        z.push();
        Buf wb = P.w.empty() ? Buf() : f32_buf(P.w);
        Buf y = targets_buf(P.y, c.tdtype), gl = f32_buf(P.gl), g = f32_buf(P.g);
        Buf lse = f32_buf(as_f32(ref.lse));
        Buf grad = poisoned(zm);
        TestOptions o = spec_options(c);
        o.class_weights = wb.p<const float>();
        size_t ws_bytes = 0;
        ASSERT_EQ(fce_backward_workspace_size(&o, N, V, &ws_bytes), FCE_SUCCESS);
        Buf ws = workspace_buf(ws_bytes);
        fce_gradients gr = FCE_GRADIENTS_INIT;
        gr.grad_logits = grad.ptr();
        gr.grad_output = g.p<const float>();
        gr.grad_lse = gl.p<const float>();
        const fce_status st = fce_backward(&o, N, V, z.ptr(), y.ptr(), lse.p<const float>(),
                                           nullptr, &gr, ws.ptr(), ws_bytes, test_stream());
        ASSERT_EQ(st, FCE_SUCCESS) << fce_last_error();
        ASSERT_TRUE(finish());
        grad.pull();
        EXPECT_TRUE(all_written(grad, zm, "grad_logits"));
        // p from the saved float32 lse: within its rounding (rule 12), well inside 2e-5 here
        EXPECT_TRUE(close_normwise(read_mat(grad, zm), total_grad(ref, rt),
                                   std::max(2e-5, tolerance(dtype)), "grad_logits"));
      }
}

// fce_linear_ce: entropy and ∂h, ∂W, ∂b of loss + Σ gl lse + Σ ge H, at the minimum workspace
// and the full-speed one.
TEST_F(Entropy, LinearCe) {
  uint64_t seed = 500;
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_NONE})
      for (int fp32w : {0, 1})
        for (int big_ws : {0, 1}) {
          SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + reduction_name(red) + " fp32w " +
                       std::to_string(fp32w) + " ws " + std::to_string(big_ws));
          LinearSpec c;
          c.name = "linear";
          c.dtype = dtype;
          c.reduction = red;
          c.seed = ++seed;
          c.N = 24;
          c.D = 32;
          c.V = 157;
          c.zstd = 0.5 * std::sqrt(32.0);  // weight entries of std 0.5
          c.eps = 0.05f;
          c.softcap = 30.0f;
          c.ignore_frac = 0.2;
          c.gw_fp32 = fp32w;
          const int64_t N = c.N, D = c.D, V = c.V;
          std::mt19937_64 rng = linear_rng(c);
          const LinearData d = linear_data(rng, c);
          const std::vector<double> gl = random_uniform(rng, N, -1, 1),
                                    ge = random_uniform(rng, N, -1, 1);
          const fceref::Options ro = reference_options(c, d.w);
          fceref::LinearResult ref =
              fceref::linear_cross_entropy(ro, N, D, V, d.h, d.W, d.b, d.y, &d.g, true);
          const RowTermsRef rt = row_terms_ref(ro, ref.ce, N, V, &gl, &ge);
          fceref::linear_backward(N, D, V, d.h, d.W, total_grad(ref.ce, rt), ref);
          const Mat hm = mat(dtype, N, D), wm = mat(dtype, V, D), bm = vec(dtype, V);
          const int gw_dtype = fp32w ? FCE_FLOAT32 : dtype;
          const Mat gwm = mat(gw_dtype, V, D), gbm = vec(gw_dtype, V), rm = vec(FCE_FLOAT32, N);
          Buf hb(hm), wb(wm), bb(bm);
          write_mat(hb, hm, d.h);
          write_mat(wb, wm, d.W);
          write_mat(bb, bm, d.b);
          hb.push();
          wb.push();
          bb.push();
          Buf yb = targets_buf(d.y, c.tdtype), glb = f32_buf(gl), geb = f32_buf(ge);
          Buf gb = f32_buf(d.g);
          Buf loss = poisoned(vec(FCE_FLOAT32, red == FCE_REDUCTION_NONE ? N : 1));
          Buf ent = poisoned(rm);
          Buf gh = poisoned(hm), gw = poisoned(gwm), gbias = poisoned(gbm);
          TestOptions o = spec_options(c);
          o.grad_weight_fp32 = c.gw_fp32;
          size_t lo = 0, hi = 0;
          ASSERT_EQ(fce_linear_ce_workspace_size(&o, N, D, V, 1, &lo, &hi), FCE_SUCCESS);
          const size_t ws_bytes = big_ws ? hi : lo;
          Buf ws = workspace_buf(ws_bytes);
          fce_outputs out = FCE_OUTPUTS_INIT;
          out.loss = loss.p<float>();
          out.entropy = ent.p<float>();
          fce_gradients gr = FCE_GRADIENTS_INIT;
          gr.grad_output = gb.p<const float>();
          gr.grad_hidden = gh.ptr();
          gr.grad_weight = gw.ptr();
          gr.grad_bias = gbias.ptr();
          gr.grad_lse = glb.p<const float>();
          gr.grad_entropy = geb.p<const float>();
          const fce_status st = fce_linear_ce(&o, N, D, V, hb.ptr(), wb.ptr(), bb.ptr(), yb.ptr(),
                                              &out, &gr, ws.ptr(), ws_bytes, test_stream());
          // (CUDA, a 16-bit grad_weight in the minimum workspace: the vocabulary-sliced plan)
          ASSERT_EQ(st, FCE_SUCCESS) << fce_last_error();
          ASSERT_TRUE(finish());
          ent.pull();
          gh.pull();
          gw.pull();
          gbias.pull();
          // the logits themselves come from a float32 product: the linear suite's bounds
          const double tol = dtype == FCE_FLOAT32 ? 1e-4 : 4 * tolerance(dtype);
          // the entropy, like the loss: a 16-bit plan may hold the logits in the dtype (as torch
          // eager does), which moves each by up to u |z| and the entropy by up to 2u max|z|
          // relative (lin_tolerance)
          const double ent_tol = dtype == FCE_FLOAT32 ? 1e-4 : lin_tolerance(dtype, ref.logits);
          EXPECT_TRUE(close_normwise(read_mat(ent, rm), rt.entropy, ent_tol, "entropy"));
          EXPECT_TRUE(close_normwise(read_mat(gh, hm), ref.grad_hidden, tol, "grad_hidden"));
          EXPECT_TRUE(close_normwise(read_mat(gw, gwm), ref.grad_weight, tol, "grad_weight"));
          EXPECT_TRUE(close_normwise(read_mat(gbias, gbm), ref.grad_bias, tol, "grad_bias"));
        }
}

// ------------------------------------------------------------------ refusals ----------------
class EntropyRefusals : public BackendTest {
 protected:
  static constexpr int64_t N = 4, V = 8, D = 4;
  Buf z{mat(FCE_FLOAT32, N, V)}, grad{mat(FCE_FLOAT32, N, V)},
      y{targets_buf({1, 2, 3, 4}, FCE_INT64)};
  Buf rows{vec(FCE_FLOAT32, N)}, rows2{vec(FCE_FLOAT32, N)}, loss{vec(FCE_FLOAT32, N)};
  Buf stats{static_cast<size_t>(N * FCE_VP_STATS * 4)};
  Buf h{mat(FCE_FLOAT32, N, D)}, W{mat(FCE_FLOAT32, V, D)}, gh{mat(FCE_FLOAT32, N, D)};
  Buf ws{size_t(1) << 20};
  TestOptions o = test_options();

  fce_gradients with_lse() {
    fce_gradients g = FCE_GRADIENTS_INIT;
    g.grad_logits = grad.ptr();
    g.grad_lse = rows.p<const float>();
    return g;
  }
  fce_gradients with_entropy() {
    fce_gradients g = FCE_GRADIENTS_INIT;
    g.grad_logits = grad.ptr();
    g.grad_entropy = rows.p<const float>();
    return g;
  }
  void expect_refused(fce_status st, fce_status want, const std::string& words) {
    EXPECT_EQ(st, want) << fce_last_error();
    std::stringstream ss(words);
    std::string w;
    while (std::getline(ss, w, '|')) EXPECT_TRUE(error_mentions(w));
  }
};

TEST_F(EntropyRefusals, Backward) {
  fce_gradients g = with_entropy();
  expect_refused(fce_backward(&o, N, V, z.ptr(), y.ptr(), rows2.p<const float>(), nullptr, &g,
                              ws.ptr(), ws.size(), test_stream()),
                 FCE_ERROR_UNSUPPORTED, "fce_backward: gradients->grad_entropy|fce_forward");
}

TEST_F(EntropyRefusals, BackwardRescale) {
  const float one = 1.0f;
  Buf g1 = f32_buf({one});
  for (int which = 0; which < 2; ++which) {
    fce_gradients g = which ? with_entropy() : with_lse();
    g.grad_output = g1.p<const float>();
    expect_refused(fce_backward_rescale(&o, N, V, z.ptr(), y.ptr(), rows2.p<const float>(), nullptr,
                                        &g, ws.ptr(), ws.size(), test_stream()),
                   FCE_ERROR_UNSUPPORTED,
                   which ? "fce_backward_rescale: gradients->grad_entropy"
                         : "fce_backward_rescale: gradients->grad_lse");
  }
}

TEST_F(EntropyRefusals, ForwardWithoutGradient) {
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  fce_gradients g = with_lse();
  g.grad_logits = nullptr;
  expect_refused(
      fce_forward(&o, N, V, z.ptr(), y.ptr(), &out, &g, ws.ptr(), ws.size(), test_stream()),
      FCE_ERROR_INVALID_ARGUMENT, "fce_forward: gradients->grad_lse|grad_logits is NULL");
  g = with_entropy();
  g.grad_logits = nullptr;
  expect_refused(
      fce_forward(&o, N, V, z.ptr(), y.ptr(), &out, &g, ws.ptr(), ws.size(), test_stream()),
      FCE_ERROR_INVALID_ARGUMENT, "fce_forward: gradients->grad_entropy");
}

TEST_F(EntropyRefusals, LinearWithoutGradient) {
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  fce_gradients g = FCE_GRADIENTS_INIT;
  g.grad_entropy = rows.p<const float>();
  expect_refused(fce_linear_ce(&o, N, D, V, h.ptr(), W.ptr(), nullptr, y.ptr(), &out, &g, ws.ptr(),
                               ws.size(), test_stream()),
                 FCE_ERROR_INVALID_ARGUMENT, "fce_linear_ce: gradients->grad_entropy|are all NULL");
}

TEST_F(EntropyRefusals, GradientOnlyCallsRefuseEntropyOutput) {
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.entropy = rows2.p<float>();
  fce_gradients g = FCE_GRADIENTS_INIT;
  g.grad_logits = grad.ptr();
  expect_refused(fce_backward(&o, N, V, z.ptr(), y.ptr(), rows.p<const float>(), &out, &g, ws.ptr(),
                              ws.size(), test_stream()),
                 FCE_ERROR_INVALID_ARGUMENT, "fce_backward: outputs->entropy");
}

// The vocabulary-parallel calls take the entropy and its gradient only with options->vp_entropy
// (their statistics carry the entropy's sums then); grad_lse needs no more than the plain ones.
TEST_F(EntropyRefusals, VocabParallel) {
  fce_vp_shard s{1, V, 0, V, nullptr, nullptr};
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  out.entropy = rows2.p<float>();
  expect_refused(fce_vp_loss(&o, &s, N, y.ptr(), stats.p<const float>(), &out, ws.ptr(), ws.size(),
                             test_stream()),
                 FCE_ERROR_INVALID_ARGUMENT,
                 "fce_vp_loss: outputs->entropy is given but options->vp_entropy is 0");
  fce_gradients g = FCE_GRADIENTS_INIT;
  g.grad_logits = grad.ptr();
  g.grad_entropy = rows.p<const float>();
  expect_refused(fce_vp_backward(&o, &s, N, z.ptr(), y.ptr(), stats.p<const float>(), &g, ws.ptr(),
                                 ws.size(), test_stream()),
                 FCE_ERROR_INVALID_ARGUMENT, "fce_vp_backward: gradients->grad_entropy|vp_entropy");
  fce_gradients lg = FCE_GRADIENTS_INIT;
  lg.grad_hidden = gh.ptr();
  lg.grad_entropy = rows.p<const float>();
  expect_refused(
      fce_vp_linear_backward(&o, &s, N, D, h.ptr(), W.ptr(), nullptr, y.ptr(),
                             stats.p<const float>(), &lg, ws.ptr(), ws.size(), test_stream()),
      FCE_ERROR_INVALID_ARGUMENT, "fce_vp_linear_backward: gradients->grad_entropy|vp_entropy");
  auto gather = [](void*, const float* send, float* recv, int64_t count, void*) {
    std::memcpy(recv, send, static_cast<size_t>(count) * 4);
    return FCE_SUCCESS;
  };
  s.all_gather = gather;
  expect_refused(fce_vp_linear_ce(&o, &s, N, D, h.ptr(), W.ptr(), nullptr, y.ptr(), &out, nullptr,
                                  ws.ptr(), ws.size(), test_stream()),
                 FCE_ERROR_INVALID_ARGUMENT, "fce_vp_linear_ce: outputs->entropy|vp_entropy");
  // with the option: grad_entropy still needs a gradient to add it to
  fce_options ov = o;
  ov.vp_entropy = 1;
  out.entropy = nullptr;
  fce_gradients none = FCE_GRADIENTS_INIT;
  none.grad_entropy = rows.p<const float>();
  expect_refused(fce_vp_linear_ce(&ov, &s, N, D, h.ptr(), W.ptr(), nullptr, y.ptr(), &out, &none,
                                  ws.ptr(), ws.size(), test_stream()),
                 FCE_ERROR_INVALID_ARGUMENT, "fce_vp_linear_ce: gradients->grad_entropy|all NULL");
  // and the other calls refuse the option
  fce_outputs fo = FCE_OUTPUTS_INIT;
  fo.loss = loss.p<float>();
  expect_refused(
      fce_forward(&ov, N, V, z.ptr(), y.ptr(), &fo, nullptr, ws.ptr(), ws.size(), test_stream()),
      FCE_ERROR_INVALID_ARGUMENT, "fce_forward: options->vp_entropy");
}

TEST_F(EntropyRefusals, AlignmentAndOverlap) {
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  out.entropy = reinterpret_cast<float*>(rows2.p<char>() + 2);
  fce_gradients g = FCE_GRADIENTS_INIT;
  expect_refused(
      fce_forward(&o, N, V, z.ptr(), y.ptr(), &out, &g, ws.ptr(), ws.size(), test_stream()),
      FCE_ERROR_MISALIGNED, "fce_forward: outputs->entropy");
  out.entropy = rows2.p<float>();
  g = with_lse();
  g.grad_lse = reinterpret_cast<const float*>(rows.p<char>() + 2);
  expect_refused(
      fce_forward(&o, N, V, z.ptr(), y.ptr(), &out, &g, ws.ptr(), ws.size(), test_stream()),
      FCE_ERROR_MISALIGNED, "fce_forward: gradients->grad_lse");
  g = with_entropy();
  g.grad_entropy = rows2.p<const float>();  // the entropy output itself
  expect_refused(
      fce_forward(&o, N, V, z.ptr(), y.ptr(), &out, &g, ws.ptr(), ws.size(), test_stream()),
      FCE_ERROR_INVALID_ARGUMENT, "outputs->entropy|gradients->grad_entropy|overlaps");
  out.entropy = nullptr;
  g = with_lse();
  g.grad_lse = reinterpret_cast<const float*>(grad.ptr());  // inside the gradient
  expect_refused(
      fce_forward(&o, N, V, z.ptr(), y.ptr(), &out, &g, ws.ptr(), ws.size(), test_stream()),
      FCE_ERROR_INVALID_ARGUMENT, "gradients->grad_lse|overlaps");
}

}  // namespace
