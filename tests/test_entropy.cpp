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

#include "ref.h"
#include "test_util.h"

namespace {

using namespace fcet;

// ------------------------------------------------------------------ the reference ----------
// Rule 18 on top of ref.h's cross_entropy (which gives a, m, log s and the loss's gradient):
// per row μ − m = t/s with t = Σ exp(a − m)(a − m), H = log s − t/s, and the extra gradient
// (gl p − ge p (a − μ)) · s · (1 − (a/c)²). Long double, −inf entries (p = 0) adding nothing.
struct RowTermsRef {
  std::vector<double> entropy;  // [N]
  std::vector<double> dz;       // [N * V] the extra gradient over z
};

RowTermsRef row_terms_ref(const fceref::Options& o, const fceref::CeResult& ce, int64_t N,
                          int64_t V, const std::vector<double>* gl,
                          const std::vector<double>* ge) {
  RowTermsRef res;
  res.entropy.assign(static_cast<size_t>(N), fceref::kNaN);
  res.dz.assign(static_cast<size_t>(N * V), 0.0);
  for (int64_t r = 0; r < N; ++r) {
    const double m = ce.m[static_cast<size_t>(r)], ls = ce.log_s[static_cast<size_t>(r)];
    const double* a = &ce.a[static_cast<size_t>(r * V)];
    const double cl = gl ? (*gl)[static_cast<size_t>(r)] : 0.0;
    const double ch = ge ? (*ge)[static_cast<size_t>(r)] : 0.0;
    double* d = &res.dz[static_cast<size_t>(r * V)];
    if (!std::isfinite(m) || std::isnan(ls)) {
      if (cl != 0.0 || ch != 0.0)
        for (int64_t j = 0; j < V; ++j) d[j] = fceref::kNaN;
      continue;
    }
    long double s = 0, t = 0;
    for (int64_t j = 0; j < V; ++j) {
      const long double e = std::exp(static_cast<long double>(a[j]) - m);
      s += e;
      if (e != 0) t += e * (static_cast<long double>(a[j]) - m);
    }
    const long double mu_m = t / s;
    res.entropy[static_cast<size_t>(r)] = static_cast<double>(static_cast<long double>(ls) - mu_m);
    if (cl == 0.0 && ch == 0.0) continue;
    for (int64_t j = 0; j < V; ++j) {
      const long double p = std::exp((static_cast<long double>(a[j]) - m) - ls);
      long double da = 0;
      if (p != 0) da = cl * p - ch * p * ((static_cast<long double>(a[j]) - m) - mu_m);
      long double dzj = da * o.logit_scale;
      if (o.softcap > 0) dzj *= 1 - (a[j] / o.softcap) * (a[j] / o.softcap);
      d[j] = static_cast<double>(dzj);
    }
  }
  return res;
}

// The whole gradient over z: the loss's (ce.grad, upstream applied) plus the row terms.
std::vector<double> total_grad(const fceref::CeResult& ce, const RowTermsRef& t) {
  std::vector<double> g = ce.grad;
  for (size_t i = 0; i < g.size(); ++i) g[i] += t.dz[i];
  return g;
}

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
TestOptions lib_options(const fceref::Options& ro, int dtype, const Buf& weights) {
  TestOptions o = test_options();
  o.dtype = dtype;
  o.reduction = ro.reduction;
  o.label_smoothing = static_cast<float>(ro.label_smoothing);
  o.z_loss_scale = static_cast<float>(ro.z_loss_scale);
  o.softcap = static_cast<float>(ro.softcap);
  o.logit_scale = static_cast<float>(ro.logit_scale);
  o.class_weights = weights.empty() ? nullptr : weights.p<const float>();
  o.ignore_index = ro.ignore_index;
  o.shift_seq_len = ro.shift_seq_len;
  o.shift = ro.shift;
  o.token_scaling = ro.token_scaling ? 1 : 0;
  return o;
}

struct Config {
  const char* name;
  fceref::Options ro;
  bool weights = false;
};

std::vector<Config> configs() {
  using Set = void (*)(fceref::Options&);
  auto make = [](const char* name, Set set, bool weights = false) {
    Config c{name, {}, weights};
    if (set) set(c.ro);
    return c;
  };
  return {
      make("plain", nullptr),
      make("smoothing+weights+zloss",
           [](fceref::Options& o) { o.label_smoothing = 0.1, o.z_loss_scale = 1e-3; }, true),
      make("softcap+scale", [](fceref::Options& o) { o.softcap = 20.0, o.logit_scale = 0.75; }),
      make("scale", [](fceref::Options& o) { o.logit_scale = 1.5; }),
      make("shift", [](fceref::Options& o) { o.shift_seq_len = 4, o.shift = 1; }),
      make("token_scaling+zloss",
           [](fceref::Options& o) { o.token_scaling = true, o.z_loss_scale = 1e-2; }),
  };
}

// What one fce_forward / fce_backward case checks.
struct Problem {
  int64_t N, V;
  std::vector<double> z;     // dense [N * V], rounded to the dtype
  std::vector<int64_t> y;
  std::vector<double> weights;
  std::vector<double> gl, ge;  // [N]
  std::vector<double> g;       // upstream of the loss: [1] or [N]
};

Problem make_problem(std::mt19937_64& rng, int dtype, const fceref::Options& ro, bool weights,
                     int64_t N, int64_t V) {
  Problem p;
  p.N = N;
  p.V = V;
  p.z = random_logits(rng, dtype, N, V, 1.0, 30.0);
  p.y = random_targets(rng, N, V, 0.25);
  if (weights) p.weights = random_uniform(rng, static_cast<size_t>(V), 0.2, 2.0);
  p.gl = random_uniform(rng, static_cast<size_t>(N), -2.0, 2.0);
  p.ge = random_uniform(rng, static_cast<size_t>(N), -2.0, 2.0);
  p.g = random_uniform(rng, ro.reduction == fceref::kNone ? static_cast<size_t>(N) : 1, 0.5, 2.0);
  return p;
}

struct Want {
  bool lse_terms = true, entropy_terms = true, loss_grad = true;
};

// fce_forward with outputs->entropy and lse, and the one-pass gradient with grad_lse and
// grad_entropy (loss_grad false: grad_output 0 for mean/sum, so only the row terms are left).
void check_forward(int dtype, const Config& c, int reduction, const Want& w, uint64_t seed,
                   int64_t N = 16, int64_t V = 203) {
  SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype) + " " + reduction_name(reduction));
  fceref::Options ro = c.ro;
  ro.reduction = reduction;
  std::mt19937_64 rng(seed);
  Problem P = make_problem(rng, dtype, ro, c.weights, N, V);
  if (!w.loss_grad) std::fill(P.g.begin(), P.g.end(), 0.0);
  ro.class_weights = P.weights;
  const fceref::CeResult ref = fceref::cross_entropy(ro, P.N, P.V, P.z, P.y, &P.g, true);
  const RowTermsRef rt = row_terms_ref(ro, ref, P.N, P.V, w.lse_terms ? &P.gl : nullptr,
                                       w.entropy_terms ? &P.ge : nullptr);

  const Mat zm = mat(dtype, P.N, P.V);
  Buf z(zm);
  write_mat(z, zm, P.z);
  z.push();
  Buf wb = P.weights.empty() ? Buf() : f32_buf(P.weights);
  Buf y = targets_buf(P.y, FCE_INT64);
  Buf gl = f32_buf(P.gl), ge = f32_buf(P.ge), g = f32_buf(P.g);
  const Mat lm = vec(FCE_FLOAT32, reduction == fceref::kNone ? P.N : 1);
  const Mat rm = vec(FCE_FLOAT32, P.N);
  Buf loss = poisoned(lm), lse = poisoned(rm), ent = poisoned(rm), grad = poisoned(zm);
  TestOptions o = lib_options(ro, dtype, wb);
  size_t ws_bytes = 0;
  ASSERT_EQ(fce_forward_workspace_size(&o, P.N, P.V, &ws_bytes), FCE_SUCCESS);
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
  const fce_status st =
      fce_forward(&o, P.N, P.V, z.ptr(), y.ptr(), &out, &gr, ws.ptr(), ws_bytes, test_stream());
  ASSERT_EQ(st, FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
  loss.pull();
  lse.pull();
  ent.pull();
  grad.pull();
  EXPECT_TRUE(all_written(ent, rm, "entropy"));
  EXPECT_TRUE(all_written(grad, zm, "grad_logits"));
  EXPECT_TRUE(close_normwise(read_mat(ent, rm), rt.entropy, 1e-5, "entropy"));
  EXPECT_TRUE(close_normwise(read_mat(lse, rm), ref.lse, 1e-5, "lse"));
  if (reduction == fceref::kNone)
    EXPECT_TRUE(close_normwise(read_mat(loss, lm), ref.row_loss, 1e-5, "loss"));
  else
    EXPECT_TRUE(close_scalar(read_mat(loss, lm)[0], ref.loss, 1e-5, "loss"));
  EXPECT_TRUE(close_normwise(read_mat(grad, zm), total_grad(ref, rt), tolerance(dtype),
                             "grad_logits"));
}

class Entropy : public BackendTest {};

TEST_F(Entropy, ForwardOnePass) {
  uint64_t seed = 100;
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16})
    for (const Config& c : configs())
      for (int red : {fceref::kMean, fceref::kSum, fceref::kNone}) check_forward(dtype, c, red, {}, ++seed);
}

TEST_F(Entropy, ForwardTermsAlone) {
  uint64_t seed = 200;
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (const Config& c : configs())
      for (int red : {fceref::kMean, fceref::kSum}) {
        check_forward(dtype, c, red, {true, false, false}, ++seed);  // grad_lse alone
        check_forward(dtype, c, red, {false, true, false}, ++seed);  // grad_entropy alone
        check_forward(dtype, c, red, {true, true, false}, ++seed);
      }
}

TEST_F(Entropy, ForwardOneTermWithLoss) {
  uint64_t seed = 300;
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16})
    for (const Config& c : configs()) {
      check_forward(dtype, c, fceref::kMean, {true, false, true}, ++seed);
      check_forward(dtype, c, fceref::kNone, {false, true, true}, ++seed);
    }
}

// Rows longer than one pass of a CTA's threads (CUDA: the stream kernel's chunks).
TEST_F(Entropy, LongRows) {
  uint64_t seed = 600;
  const std::vector<Config> cs = configs();
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (const Config& c : {cs[0], cs[1], cs[2]})
      check_forward(dtype, c, fceref::kMean, {}, ++seed, 3, 70001);
}

// Adversarial rows: −inf entries, a constant row, a row near the dtype's limit, a row of huge
// spread, a one-hot row; entropy and gradient never NaN where the reference is finite.
TEST_F(Entropy, AdversarialRows) {
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const int64_t N = 6, V = 67;
    const double big = dtype == FCE_FLOAT16 ? 65504.0 : dtype == FCE_BFLOAT16 ? 3.38e38 : 3.4e38;
    std::mt19937_64 rng(11);
    std::vector<double> z = random_logits(rng, dtype, N, V, 1.0, 10.0);
    for (int64_t j = 0; j < V; j += 3) z[0 * V + j] = -INFINITY;       // −inf entries
    for (int64_t j = 0; j < V; ++j) z[1 * V + j] = round_to(dtype, -big);  // constant, huge
    for (int64_t j = 0; j < V; ++j) z[2 * V + j] = round_to(dtype, j % 2 ? big : big / 2);
    for (int64_t j = 0; j < V; ++j) z[3 * V + j] = 0.0;                   // constant: H = log V
    for (int64_t j = 0; j < V; ++j) z[4 * V + j] = j == 5 ? 0.0 : -INFINITY;  // one-hot: H = 0
    for (int64_t j = 0; j < V; ++j) z[5 * V + j] = round_to(dtype, j * (big / V) - big / 2);
    const std::vector<int64_t> y = {1, 2, -100, 4, 5, 6};
    fceref::Options ro;
    ro.reduction = fceref::kSum;
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
    Buf none;
    TestOptions o = lib_options(ro, dtype, none);
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
    const fce_status st =
        fce_forward(&o, N, V, zb.ptr(), yb.ptr(), &out, &gr, ws.ptr(), ws_bytes, test_stream());
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
      const std::vector<double> gr_got(got_g.begin() + r * V, got_g.begin() + (r + 1) * V);
      const std::vector<double> gr_want(want_g.begin() + r * V, want_g.begin() + (r + 1) * V);
      EXPECT_TRUE(close_normwise(gr_got, gr_want, tolerance(dtype), "gradient row"));
    }
  }
}

// fce_backward with grad_lse (every row, ignored ones included), from the lse fce_forward saved.
TEST_F(Entropy, BackwardGradLse) {
  uint64_t seed = 400;
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16})
    for (const Config& c : configs())
      for (int red : {fceref::kMean, fceref::kNone}) {
        SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype) + " " + reduction_name(red));
        fceref::Options ro = c.ro;
        ro.reduction = red;
        std::mt19937_64 rng(++seed);
        Problem P = make_problem(rng, dtype, ro, c.weights, 12, 131);
        ro.class_weights = P.weights;
        const fceref::CeResult ref = fceref::cross_entropy(ro, P.N, P.V, P.z, P.y, &P.g, true);
        const RowTermsRef rt = row_terms_ref(ro, ref, P.N, P.V, &P.gl, nullptr);
        const Mat zm = mat(dtype, P.N, P.V);
        Buf z(zm);
        write_mat(z, zm, P.z);
        z.push();
        Buf wb = P.weights.empty() ? Buf() : f32_buf(P.weights);
        Buf y = targets_buf(P.y, FCE_INT64), gl = f32_buf(P.gl), g = f32_buf(P.g);
        std::vector<double> lse_f32(ref.lse.size());
        for (size_t i = 0; i < lse_f32.size(); ++i) lse_f32[i] = static_cast<float>(ref.lse[i]);
        Buf lse = f32_buf(lse_f32);
        Buf grad = poisoned(zm);
        TestOptions o = lib_options(ro, dtype, wb);
        size_t ws_bytes = 0;
        ASSERT_EQ(fce_backward_workspace_size(&o, P.N, P.V, &ws_bytes), FCE_SUCCESS);
        Buf ws = workspace_buf(ws_bytes);
        fce_gradients gr = FCE_GRADIENTS_INIT;
        gr.grad_logits = grad.ptr();
        gr.grad_output = g.p<const float>();
        gr.grad_lse = gl.p<const float>();
        const fce_status st = fce_backward(&o, P.N, P.V, z.ptr(), y.ptr(), lse.p<const float>(),
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
    for (int red : {fceref::kMean, fceref::kNone})
      for (int fp32w : {0, 1})
        for (int big_ws : {0, 1}) {
          SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + reduction_name(red) + " fp32w " +
                       std::to_string(fp32w) + " ws " + std::to_string(big_ws));
          const int64_t N = 24, D = 32, V = 157;
          std::mt19937_64 rng(++seed);
          fceref::Options ro;
          ro.reduction = red;
          ro.label_smoothing = 0.05;
          ro.softcap = 30.0;
          const std::vector<double> h = random_normal(rng, dtype, N * D, 1.0);
          const std::vector<double> W = random_normal(rng, dtype, V * D, 0.5);
          const std::vector<double> b = random_normal(rng, dtype, V, 0.5);
          const std::vector<int64_t> yv = random_targets(rng, N, V, 0.2);
          const std::vector<double> gl = random_uniform(rng, N, -1, 1), ge = random_uniform(rng, N, -1, 1);
          const std::vector<double> g = random_uniform(rng, red == fceref::kNone ? N : 1, 0.5, 2);
          fceref::LinearResult ref = fceref::linear_cross_entropy(ro, N, D, V, h, W, b, yv, &g, true);
          const RowTermsRef rt = row_terms_ref(ro, ref.ce, N, V, &gl, &ge);
          const std::vector<double> dz = total_grad(ref.ce, rt);
          std::vector<double> dh(N * D, 0.0), dW(V * D, 0.0), db(V, 0.0);
          for (int64_t r = 0; r < N; ++r)
            for (int64_t v = 0; v < V; ++v) {
              const double d = dz[r * V + v];
              db[v] += d;
              for (int64_t k = 0; k < D; ++k) {
                dh[r * D + k] += d * W[v * D + k];
                dW[v * D + k] += d * h[r * D + k];
              }
            }
          const Mat hm = mat(dtype, N, D), wm = mat(dtype, V, D), bm = vec(dtype, V);
          const int gw_dtype = fp32w ? FCE_FLOAT32 : dtype;
          const Mat gwm = mat(gw_dtype, V, D), gbm = vec(gw_dtype, V), rm = vec(FCE_FLOAT32, N);
          Buf hb(hm), wb(wm), bb(bm);
          write_mat(hb, hm, h);
          write_mat(wb, wm, W);
          write_mat(bb, bm, b);
          hb.push();
          wb.push();
          bb.push();
          Buf yb = targets_buf(yv, FCE_INT64), glb = f32_buf(gl), geb = f32_buf(ge), gb = f32_buf(g);
          Buf loss = poisoned(vec(FCE_FLOAT32, red == fceref::kNone ? N : 1)), ent = poisoned(rm);
          Buf gh = poisoned(hm), gw = poisoned(gwm), gbias = poisoned(gbm);
          Buf none;
          TestOptions o = lib_options(ro, dtype, none);
          o.grad_weight_fp32 = fp32w;
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
          if (on_cuda() && st == FCE_ERROR_UNSUPPORTED) {
            // the CUDA vocabulary-sliced plan (16-bit grad_weight, minimum workspace)
            EXPECT_TRUE(error_mentions("vocabulary-sliced plan"));
            EXPECT_TRUE(!fp32w && !big_ws && dtype != FCE_FLOAT32);
            continue;
          }
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
          // relative (the linear suite's lin_tolerance)
          double zmax = 0;
          for (double v : ref.logits) zmax = std::max(zmax, std::fabs(v));
          const double ent_tol =
              dtype == FCE_FLOAT32 ? 1e-4 : unit_roundoff(dtype) * (4.0 + 2.0 * zmax);
          EXPECT_TRUE(close_normwise(read_mat(ent, rm), rt.entropy, ent_tol, "entropy"));
          EXPECT_TRUE(close_normwise(read_mat(gh, hm), dh, tol, "grad_hidden"));
          EXPECT_TRUE(close_normwise(read_mat(gw, gwm), dW, tol, "grad_weight"));
          EXPECT_TRUE(close_normwise(read_mat(gbias, gbm), db, tol, "grad_bias"));
        }
}

// ------------------------------------------------------------------ refusals ----------------
class EntropyRefusals : public BackendTest {
 protected:
  static constexpr int64_t N = 4, V = 8, D = 4;
  Buf z{mat(FCE_FLOAT32, N, V)}, grad{mat(FCE_FLOAT32, N, V)}, y{targets_buf({1, 2, 3, 4}, FCE_INT64)};
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
    expect_refused(fce_backward_rescale(&o, N, V, z.ptr(), y.ptr(), rows2.p<const float>(),
                                        nullptr, &g, ws.ptr(), ws.size(), test_stream()),
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
  expect_refused(fce_forward(&o, N, V, z.ptr(), y.ptr(), &out, &g, ws.ptr(), ws.size(),
                             test_stream()),
                 FCE_ERROR_INVALID_ARGUMENT, "fce_forward: gradients->grad_lse|grad_logits is NULL");
  g = with_entropy();
  g.grad_logits = nullptr;
  expect_refused(fce_forward(&o, N, V, z.ptr(), y.ptr(), &out, &g, ws.ptr(), ws.size(),
                             test_stream()),
                 FCE_ERROR_INVALID_ARGUMENT, "fce_forward: gradients->grad_entropy");
}

TEST_F(EntropyRefusals, LinearWithoutGradient) {
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  fce_gradients g = FCE_GRADIENTS_INIT;
  g.grad_entropy = rows.p<const float>();
  expect_refused(fce_linear_ce(&o, N, D, V, h.ptr(), W.ptr(), nullptr, y.ptr(), &out, &g,
                               ws.ptr(), ws.size(), test_stream()),
                 FCE_ERROR_INVALID_ARGUMENT,
                 "fce_linear_ce: gradients->grad_entropy|are all NULL");
}

TEST_F(EntropyRefusals, GradientOnlyCallsRefuseEntropyOutput) {
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.entropy = rows2.p<float>();
  fce_gradients g = FCE_GRADIENTS_INIT;
  g.grad_logits = grad.ptr();
  expect_refused(fce_backward(&o, N, V, z.ptr(), y.ptr(), rows.p<const float>(), &out, &g,
                              ws.ptr(), ws.size(), test_stream()),
                 FCE_ERROR_INVALID_ARGUMENT, "fce_backward: outputs->entropy");
}

TEST_F(EntropyRefusals, VocabParallel) {
  fce_vp_shard s{1, V, 0, V, nullptr, nullptr};
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  out.entropy = rows2.p<float>();
  expect_refused(fce_vp_loss(&o, &s, N, y.ptr(), stats.p<const float>(), &out, ws.ptr(),
                             ws.size(), test_stream()),
                 FCE_ERROR_UNSUPPORTED,
                 "fce_vp_loss: outputs->entropy is not supported by the vocabulary-parallel calls");
  fce_gradients g = with_lse();
  expect_refused(fce_vp_backward(&o, &s, N, z.ptr(), y.ptr(), stats.p<const float>(), nullptr, &g,
                                 ws.ptr(), ws.size(), test_stream()),
                 FCE_ERROR_UNSUPPORTED, "fce_vp_backward: gradients->grad_lse");
  fce_gradients lg = FCE_GRADIENTS_INIT;
  lg.grad_hidden = gh.ptr();
  lg.grad_entropy = rows.p<const float>();
  expect_refused(fce_vp_linear_backward(&o, &s, N, D, h.ptr(), W.ptr(), nullptr, y.ptr(),
                                        stats.p<const float>(), nullptr, &lg, ws.ptr(), ws.size(),
                                        test_stream()),
                 FCE_ERROR_UNSUPPORTED, "fce_vp_linear_backward: gradients->grad_entropy");
  auto gather = [](void*, const float* send, float* recv, int64_t count, void*) {
    std::memcpy(recv, send, static_cast<size_t>(count) * 4);
    return FCE_SUCCESS;
  };
  s.all_gather = gather;
  expect_refused(fce_vp_linear_ce(&o, &s, N, D, h.ptr(), W.ptr(), nullptr, y.ptr(), &out, nullptr,
                                  ws.ptr(), ws.size(), test_stream()),
                 FCE_ERROR_UNSUPPORTED,
                 "fce_vp_linear_ce: outputs->entropy is not supported by the vocabulary-parallel");
  out.entropy = nullptr;
  expect_refused(fce_vp_linear_ce(&o, &s, N, D, h.ptr(), W.ptr(), nullptr, y.ptr(), &out, &lg,
                                  ws.ptr(), ws.size(), test_stream()),
                 FCE_ERROR_UNSUPPORTED, "fce_vp_linear_ce: gradients->grad_entropy");
}

TEST_F(EntropyRefusals, AlignmentAndOverlap) {
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  out.entropy = reinterpret_cast<float*>(rows2.p<char>() + 2);
  fce_gradients g = FCE_GRADIENTS_INIT;
  expect_refused(fce_forward(&o, N, V, z.ptr(), y.ptr(), &out, &g, ws.ptr(), ws.size(),
                             test_stream()),
                 FCE_ERROR_MISALIGNED, "fce_forward: outputs->entropy");
  out.entropy = rows2.p<float>();
  g = with_lse();
  g.grad_lse = reinterpret_cast<const float*>(rows.p<char>() + 2);
  expect_refused(fce_forward(&o, N, V, z.ptr(), y.ptr(), &out, &g, ws.ptr(), ws.size(),
                             test_stream()),
                 FCE_ERROR_MISALIGNED, "fce_forward: gradients->grad_lse");
  g = with_entropy();
  g.grad_entropy = rows2.p<const float>();  // the entropy output itself
  expect_refused(fce_forward(&o, N, V, z.ptr(), y.ptr(), &out, &g, ws.ptr(), ws.size(),
                             test_stream()),
                 FCE_ERROR_INVALID_ARGUMENT, "outputs->entropy|gradients->grad_entropy|overlaps");
  out.entropy = nullptr;
  g = with_lse();
  g.grad_lse = reinterpret_cast<const float*>(grad.ptr());  // inside the gradient
  expect_refused(fce_forward(&o, N, V, z.ptr(), y.ptr(), &out, &g, ws.ptr(), ws.size(),
                             test_stream()),
                 FCE_ERROR_INVALID_ARGUMENT, "gradients->grad_lse|overlaps");
}

}  // namespace
