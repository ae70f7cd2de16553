// test_distill.cpp — distillation against a teacher (docs/semantics.md rule 20): fce_distill
// and fce_linear_distill against a float64 reference written from the rule (its gradient
// formulas checked by finite differences first), Liger's JSD ends, temperature, reductions,
// ignored rows, adversarial rows, the linear call against the logits call, workspace sweeps,
// and every refusal with its message. Self-contained on test_util.h; FCE_TEST_BACKEND picks
// the backend.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "distill_ref.h"

namespace {

using namespace fcet;
using namespace distillref;
constexpr double kInf = std::numeric_limits<double>::infinity();

// The divergence the plain way, for the finite differences: softmax, then the definitions.
double plain_loss(const Cfg& c, const double* z, const double* t, int64_t V) {
  std::vector<LD> u(V), v(V);
  for (int64_t j = 0; j < V; ++j) u[j] = transform(c, z[j]), v[j] = transform(c, t[j]);
  const std::vector<LD> lp = log_softmax(u), lq = log_softmax(v);
  LD loss = 0;
  for (int64_t j = 0; j < V; ++j) {
    const LD p = std::exp(lp[j]), q = std::exp(lq[j]);
    if (c.divergence == FCE_DIVERGENCE_FORWARD_KL) loss += q * std::log(q / p);
    if (c.divergence == FCE_DIVERGENCE_REVERSE_KL) loss += p * std::log(p / q);
    if (c.divergence == FCE_DIVERGENCE_JSD) {
      const LD m = c.beta * q + (1 - c.beta) * p;
      loss += c.beta * q * std::log(q / m) + (1 - c.beta) * p * std::log(p / m);
    }
  }
  return static_cast<double>(loss);
}

TEST(DistillReference, FiniteDifferences) {
  const int64_t V = 7;
  std::mt19937_64 rng(11);
  const std::vector<double> z = random_normal(rng, FCE_FLOAT32, V, 2.0);
  const std::vector<double> t = random_normal(rng, FCE_FLOAT32, V, 2.0);
  for (int div : {FCE_DIVERGENCE_FORWARD_KL, FCE_DIVERGENCE_REVERSE_KL, FCE_DIVERGENCE_JSD})
    for (double beta : {0.5, 0.2, 0.9}) {
      Cfg c;
      c.divergence = div;
      c.beta = beta;
      c.T = 1.7;
      c.s = 1.3;
      c.c = 5.0;
      const RowRef r = row_ref(c, z.data(), t.data(), V);
      EXPECT_NEAR(r.loss, plain_loss(c, z.data(), t.data(), V), 1e-12);
      for (int64_t j = 0; j < V; ++j) {
        std::vector<double> zp = z, zm = z;
        const double h = 1e-6;
        zp[j] += h;
        zm[j] -= h;
        const double fd =
            (plain_loss(c, zp.data(), t.data(), V) - plain_loss(c, zm.data(), t.data(), V)) /
            (2 * h);
        EXPECT_NEAR(r.dz[j], fd, 1e-8 * (1 + std::fabs(fd))) << "div " << div << " j " << j;
      }
    }
}

// Liger's generalised JSD: β KL(q||m) + (1−β) KL(p||m) tends to 0 at both ends (m → p, m → q),
// which is why its β = 0 and β = 1 are defined as the forward and the reverse KL instead.
TEST(DistillReference, JsdEnds) {
  const int64_t V = 9;
  std::mt19937_64 rng(12);
  const std::vector<double> z = random_normal(rng, FCE_FLOAT32, V, 2.0);
  const std::vector<double> t = random_normal(rng, FCE_FLOAT32, V, 2.0);
  Cfg jsd, fwd, rev;
  jsd.divergence = FCE_DIVERGENCE_JSD;
  rev.divergence = FCE_DIVERGENCE_REVERSE_KL;
  jsd.beta = 0;
  EXPECT_EQ(row_ref(jsd, z.data(), t.data(), V).loss, row_ref(fwd, z.data(), t.data(), V).loss);
  jsd.beta = 1;
  EXPECT_EQ(row_ref(jsd, z.data(), t.data(), V).loss, row_ref(rev, z.data(), t.data(), V).loss);
  jsd.beta = 1e-9;
  EXPECT_LT(row_ref(jsd, z.data(), t.data(), V).loss, 1e-6);
  EXPECT_GT(row_ref(fwd, z.data(), t.data(), V).loss, 1e-2);
}

// ------------------------------------------------------------------ calling the library -----
fce_options options_of(const Cfg& c, int dtype) {
  fce_options o = test_options();
  o.dtype = dtype;
  o.reduction = c.reduction;
  o.logit_scale = static_cast<float>(c.s);
  o.softcap = static_cast<float>(c.c);
  return o;
}

struct Case {
  Cfg c;
  int dtype = FCE_FLOAT32;
  int64_t N = 6, V = 300;
  bool targets = true, grad = true, in_place = false, lse = true;
  double ignore_frac = 0.3;
  double spread = 4.0;
  uint64_t seed = 1;
};

// Runs fce_distill on random rows (or the given ones) and checks the loss, lse and gradient
// against the reference, and that nothing outside the outputs was written.
void run_case(const Case& k, const std::vector<double>* zs = nullptr,
              const std::vector<double>* ts = nullptr) {
  std::mt19937_64 rng(k.seed);
  const int64_t N = k.N, V = k.V, stride = V + 3, tstride = V + 5;
  std::vector<double> z = zs ? *zs : random_logits(rng, k.dtype, N, V, 0.5, k.spread, 5.0);
  std::vector<double> t = ts ? *ts : random_logits(rng, k.dtype, N, V, 0.5, k.spread, 5.0);
  std::vector<int64_t> y = random_targets(rng, N, V, k.ignore_frac);
  const bool none = k.c.reduction == FCE_REDUCTION_NONE;
  std::vector<double> g = random_uniform(rng, none ? N : 1, 0.5, 2.0);
  const Ref ref = reference(k.c, N, V, z, t, k.targets ? &y : nullptr, g);

  const Mat zm = mat(k.dtype, N, V, stride), tm = mat(k.dtype, N, V, tstride);
  Buf zb(zm), tb(tm);
  write_mat(zb, zm, z);
  write_mat(tb, tm, t);
  zb.push();
  tb.push();
  Buf yb = targets_buf(y, FCE_INT64), gb = f32_buf(g);
  const Mat lm = vec(FCE_FLOAT32, none ? N : 1), lsm = vec(FCE_FLOAT32, N);
  Buf loss = poisoned(lm), lse = poisoned(lsm);
  const Mat gm = mat(k.dtype, N, V, k.in_place ? stride : V + 1);
  Buf grad = k.in_place || !k.grad ? Buf() : poisoned(gm);
  const std::vector<uint8_t> t_before = tb.mirror(), z_before = zb.mirror();

  fce_options o = options_of(k.c, k.dtype);
  o.row_stride = stride;
  o.grad_row_stride = gm.stride;
  fce_teacher te = teacher_of(k.c);
  te.logits = tb.ptr();
  te.row_stride = tstride;
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  out.lse = k.lse ? lse.p<float>() : nullptr;
  fce_gradients gr = FCE_GRADIENTS_INIT;
  gr.grad_output = gb.p<float>();
  gr.grad_logits = k.in_place ? zb.ptr() : grad.ptr();
  size_t ws = 0;
  ASSERT_EQ(fce_distill_workspace_size(&o, &te, N, V, &ws), FCE_SUCCESS) << fce_last_error();
  Buf wb = workspace_buf(ws);
  ASSERT_EQ(fce_distill(&o, &te, N, V, zb.ptr(), k.targets ? yb.ptr() : nullptr, &out,
                        k.grad ? &gr : nullptr, wb.ptr(), ws, test_stream()),
            FCE_SUCCESS)
      << fce_last_error();
  ASSERT_TRUE(finish());
  loss.pull();
  lse.pull();
  tb.pull();
  zb.pull();
  EXPECT_TRUE(unchanged(tb, t_before, "teacher logits"));
  EXPECT_TRUE(close_normwise(read_mat(loss, lm), ref.loss, loss_tol(), "loss"));
  if (k.lse) {
    EXPECT_TRUE(close_normwise(read_mat(lse, lsm), ref.lse, 1e-6, "lse"));
  }
  if (!k.grad) {
    EXPECT_TRUE(unchanged(zb, z_before, "logits"));
    return;
  }
  Buf& gbuf = k.in_place ? zb : grad;
  if (!k.in_place) grad.pull();
  EXPECT_TRUE(all_written(gbuf, gm, "grad_logits"));
  EXPECT_TRUE(close_normwise(read_mat(gbuf, gm), ref.grad, grad_tol(k.dtype), "grad_logits"));
}

class Distill : public BackendTest {};

TEST_F(Distill, DivergencesDtypesReductions) {
  uint64_t seed = 100;
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16, FCE_FLOAT16})
    for (int div : {FCE_DIVERGENCE_FORWARD_KL, FCE_DIVERGENCE_REVERSE_KL, FCE_DIVERGENCE_JSD})
      for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE}) {
        Case k;
        k.dtype = dtype;
        k.c.divergence = div;
        k.c.reduction = red;
        k.c.beta = 0.3;
        k.seed = ++seed;
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " div " + std::to_string(div) + " " +
                     reduction_name(red));
        run_case(k);
      }
}

TEST_F(Distill, TemperatureScaleSoftcap) {
  uint64_t seed = 200;
  for (double T : {0.5, 1.0, 3.0})
    for (int div : {FCE_DIVERGENCE_FORWARD_KL, FCE_DIVERGENCE_REVERSE_KL, FCE_DIVERGENCE_JSD}) {
      Case k;
      k.c.divergence = div;
      k.c.T = T;
      k.c.s = 0.8;
      k.c.c = 12.0;
      k.seed = ++seed;
      SCOPED_TRACE("T " + std::to_string(T) + " div " + std::to_string(div));
      run_case(k);
    }
}

// JSD at β = 0 and β = 1 is the forward and the reverse KL, as Liger defines its ends.
TEST_F(Distill, JsdBetaEnds) {
  for (double beta : {0.0, 0.5, 1.0}) {
    Case k;
    k.c.divergence = FCE_DIVERGENCE_JSD;
    k.c.beta = beta;
    k.seed = 300;
    SCOPED_TRACE("beta " + std::to_string(beta));
    run_case(k);
  }
  Case fwd, jsd0;
  fwd.seed = jsd0.seed = 301;
  jsd0.c.divergence = FCE_DIVERGENCE_JSD;
  jsd0.c.beta = 0.0;
  std::mt19937_64 rng(5);
  const std::vector<double> z = random_logits(rng, FCE_FLOAT32, 6, 300);
  const std::vector<double> t = random_logits(rng, FCE_FLOAT32, 6, 300);
  std::vector<int64_t> y(6, 0);
  std::vector<double> g = {1.0};
  EXPECT_EQ(reference(fwd.c, 6, 300, z, t, &y, g).loss,
            reference(jsd0.c, 6, 300, z, t, &y, g).loss);
}

TEST_F(Distill, TargetsOptionalInPlaceNoGradient) {
  Case k;
  k.targets = false;
  run_case(k);
  Case ip;
  ip.in_place = true;
  ip.c.divergence = FCE_DIVERGENCE_JSD;
  run_case(ip);
  Case ng;
  ng.grad = false;
  ng.lse = true;
  run_case(ng);
  Case all_ignored;
  all_ignored.ignore_frac = 1.0;
  run_case(all_ignored);
  Case long_rows;
  long_rows.V = 40000;
  long_rows.N = 3;
  long_rows.c.divergence = FCE_DIVERGENCE_REVERSE_KL;
  run_case(long_rows);
}

// Rows relative to their maxima: huge offsets, −inf entries, constant rows, a row of −inf.
TEST_F(Distill, AdversarialRows) {
  const int64_t V = 64, N = 6;
  std::mt19937_64 rng(9);
  std::vector<double> z = random_logits(rng, FCE_FLOAT32, N, V, 0.5, 3.0, 0.0);
  std::vector<double> t = random_logits(rng, FCE_FLOAT32, N, V, 0.5, 3.0, 0.0);
  for (int64_t j = 0; j < V; ++j) {
    z[0 * V + j] = static_cast<float>(1e30 + z[0 * V + j] * 1e24);  // huge shared offset
    t[0 * V + j] = static_cast<float>(-1e30 + t[0 * V + j] * 1e24);
    z[1 * V + j] = -3e38;  // constant rows: p = q = 1/V, nothing to learn
    t[1 * V + j] = 2e38;
    if (j % 3 == 0) z[2 * V + j] = t[2 * V + j] = -kInf;  // −inf where both are 0
    if (j % 5 == 0) t[3 * V + j] = -kInf;                 // teacher zeros: forward KL finite
    if (j == 7) z[4 * V + j] = 1e4;                       // a one-hot student
    z[5 * V + j] = static_cast<float>(3e4 + z[5 * V + j]);
  }
  for (int div : {FCE_DIVERGENCE_FORWARD_KL, FCE_DIVERGENCE_JSD}) {
    Case k;
    k.N = N;
    k.V = V;
    k.c.divergence = div;
    k.ignore_frac = 0;
    SCOPED_TRACE("div " + std::to_string(div));
    run_case(k, &z, &t);
  }
  // The reverse KL of a student with mass where the teacher has none is +inf: those rows are
  // left out (k.targets with ignore_index) where the rule gives no finite gradient.
  std::vector<double> z2 = z, t2 = t;
  for (int64_t j = 0; j < V; ++j) t2[3 * V + j] = t[2 * V + j], z2[3 * V + j] = z[2 * V + j];
  Case k;
  k.N = N;
  k.V = V;
  k.c.divergence = FCE_DIVERGENCE_REVERSE_KL;
  k.ignore_frac = 0;
  run_case(k, &z2, &t2);
}

// A student −inf where the teacher has mass: the forward KL is +inf, the gradient −q finite;
// a row of −inf has no distribution: NaN.
TEST_F(Distill, NonFiniteLosses) {
  const int64_t V = 16, N = 2;
  std::vector<double> z(N * V, 0.0), t(N * V, 0.0);
  z[3] = -kInf;
  for (int64_t j = 0; j < V; ++j) z[V + j] = -kInf;
  Case k;
  k.N = N;
  k.V = V;
  k.c.reduction = FCE_REDUCTION_NONE;
  k.ignore_frac = 0;
  const Ref ref = reference(k.c, N, V, z, t, nullptr, {1.0, 1.0});
  EXPECT_EQ(ref.loss[0], kInf);
  EXPECT_TRUE(std::isnan(ref.loss[1]));
  run_case(k, &z, &t);
}

// ------------------------------------------------------------------ fce_linear_distill ------
struct LinearCase {
  Cfg c;
  int dtype = FCE_FLOAT32;
  int64_t N = 37, D = 24, Dt = 40, V = 150;
  bool fp32_dw = false, accumulate = false, grad_hidden = true, grad_weight = true;
  uint64_t seed = 1;
};

struct LinearData {
  std::vector<double> h, w, ht, wt, z, t;  // z, t: the logits in double [N, V]
  std::vector<int64_t> y;
};

LinearData linear_data(const LinearCase& k) {
  std::mt19937_64 rng(k.seed);
  LinearData d;
  d.h = random_normal(rng, k.dtype, k.N * k.D, 1.0);
  d.w = random_normal(rng, k.dtype, k.V * k.D, 0.5);
  d.ht = random_normal(rng, k.dtype, k.N * k.Dt, 1.0);
  d.wt = random_normal(rng, k.dtype, k.V * k.Dt, 0.5);
  d.y = random_targets(rng, k.N, k.V, 0.25);
  auto matmul = [&](const std::vector<double>& a, const std::vector<double>& b, int64_t D) {
    std::vector<double> out(k.N * k.V);
    for (int64_t r = 0; r < k.N; ++r)
      for (int64_t v = 0; v < k.V; ++v) {
        LD s = 0;
        for (int64_t i = 0; i < D; ++i) s += static_cast<LD>(a[r * D + i]) * b[v * D + i];
        out[r * k.V + v] = static_cast<double>(s);
      }
    return out;
  };
  d.z = matmul(d.h, d.w, k.D);
  d.t = matmul(d.ht, d.wt, k.Dt);
  return d;
}

struct LinearOut {
  std::vector<double> loss, lse, dh, dw;
  std::vector<uint8_t> dw_bytes;
};

// One fce_linear_distill call with `ws_bytes` of workspace (SIZE_MAX: optimal); old_dw is
// grad_weight's value before (accumulate).
fce_status run_linear(const LinearCase& k, const LinearData& d, size_t ws_bytes, LinearOut* r,
                      const std::vector<double>* old_dw = nullptr) {
  const int gw_dtype = k.fp32_dw ? FCE_FLOAT32 : k.dtype;
  const Mat hm = mat(k.dtype, k.N, k.D), wm = mat(k.dtype, k.V, k.D);
  const Mat htm = mat(k.dtype, k.N, k.Dt, k.Dt + 2), wtm = mat(k.dtype, k.V, k.Dt);
  Buf hb(hm), wb(wm), htb(htm), wtb(wtm);
  write_mat(hb, hm, d.h);
  write_mat(wb, wm, d.w);
  write_mat(htb, htm, d.ht);
  write_mat(wtb, wtm, d.wt);
  hb.push(), wb.push(), htb.push(), wtb.push();
  Buf yb = targets_buf(d.y, FCE_INT64);
  const bool none = k.c.reduction == FCE_REDUCTION_NONE;
  const Mat lm = vec(FCE_FLOAT32, none ? k.N : 1), lsm = vec(FCE_FLOAT32, k.N);
  const Mat dhm = mat(k.dtype, k.N, k.D), dwm = mat(gw_dtype, k.V, k.D);
  Buf loss = poisoned(lm), lse = poisoned(lsm), dh = poisoned(dhm), dw = poisoned(dwm);
  if (old_dw) {
    write_mat(dw, dwm, *old_dw);
    dw.push();
  }
  fce_options o = options_of(k.c, k.dtype);
  o.grad_weight_fp32 = k.fp32_dw;
  o.accumulate = k.accumulate;
  fce_teacher te = teacher_of(k.c);
  te.hidden_states = htb.ptr();
  te.weight = wtb.ptr();
  te.hidden = k.Dt;
  te.hidden_row_stride = k.Dt + 2;
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  out.lse = lse.p<float>();
  fce_gradients g = FCE_GRADIENTS_INIT;
  g.grad_hidden = k.grad_hidden ? dh.ptr() : nullptr;
  g.grad_weight = k.grad_weight ? dw.ptr() : nullptr;
  size_t lo = 0, hi = 0;
  EXPECT_EQ(fce_linear_distill_workspace_size(&o, &te, k.N, k.D, k.V, 1, &lo, &hi), FCE_SUCCESS);
  const size_t bytes = ws_bytes == SIZE_MAX ? hi : ws_bytes;
  Buf ws = workspace_buf(bytes);
  const fce_status st = fce_linear_distill(&o, &te, k.N, k.D, k.V, hb.ptr(), wb.ptr(), yb.ptr(),
                                           &out, &g, ws.ptr(), bytes, test_stream());
  if (st != FCE_SUCCESS) return st;
  EXPECT_TRUE(finish());
  loss.pull(), lse.pull(), dh.pull(), dw.pull();
  r->loss = read_mat(loss, lm);
  r->lse = read_mat(lse, lsm);
  if (k.grad_hidden) r->dh = read_mat(dh, dhm);
  if (k.grad_weight) r->dw = read_mat(dw, dwm);
  r->dw_bytes = dw.mirror();
  return st;
}

void check_linear(const LinearCase& k, const LinearOut& r, const std::vector<double>* old_dw) {
  const LinearData d = linear_data(k);
  const Ref ref = reference(k.c, k.N, k.V, d.z, d.t, &d.y, std::vector<double>(k.N, 1.0));
  std::vector<double> dh(k.N * k.D, 0.0), dw(k.V * k.D, 0.0);
  for (int64_t r = 0; r < k.N; ++r)
    for (int64_t v = 0; v < k.V; ++v) {
      const double gz = ref.grad[r * k.V + v];
      for (int64_t i = 0; i < k.D; ++i) {
        dh[r * k.D + i] += gz * d.w[v * k.D + i];
        dw[v * k.D + i] += gz * d.h[r * k.D + i];
      }
    }
  if (old_dw)
    for (size_t i = 0; i < dw.size(); ++i) dw[i] += (*old_dw)[i];
  const double gtol = k.dtype == FCE_FLOAT32 ? (on_cuda() ? 2e-3 : 1e-5) : 2 * tolerance(k.dtype);
  // The loss and lse: float32 as fce_linear_ce's tests (TF32 GEMMs on CUDA); 16-bit: the bound of
  // lin_tolerance (harness/compare.h) for logits made in the dtype, here both the student's
  // and the teacher's, each perturbed by up to u |z|.
  double zmax = 0.0;
  for (const std::vector<double>* v : {&d.z, &d.t})
    for (double x : *v) zmax = std::max(zmax, std::fabs(x));
  const double ltol = k.dtype == FCE_FLOAT32 ? (on_cuda() ? 2e-3 : 1e-5)
                                             : unit_roundoff(k.dtype) * (4.0 + 4.0 * zmax);
  EXPECT_TRUE(close_normwise(r.loss, ref.loss, ltol, "loss"));
  EXPECT_TRUE(close_normwise(r.lse, ref.lse, ltol, "lse"));
  if (k.grad_hidden) {
    EXPECT_TRUE(close_normwise(r.dh, dh, gtol, "grad_hidden"));
  }
  if (k.grad_weight) {
    EXPECT_TRUE(close_normwise(r.dw, dw, gtol, "grad_weight"));
  }
}

class LinearDistill : public BackendTest {};

TEST_F(LinearDistill, AgainstReference) {
  uint64_t seed = 500;
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (int div : {FCE_DIVERGENCE_FORWARD_KL, FCE_DIVERGENCE_REVERSE_KL, FCE_DIVERGENCE_JSD})
      for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_NONE}) {
        LinearCase k;
        k.dtype = dtype;
        k.c.divergence = div;
        k.c.reduction = red;
        k.c.T = 2.0;
        k.fp32_dw = dtype != FCE_FLOAT32;
        k.seed = ++seed;
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " div " + std::to_string(div));
        LinearOut r;
        ASSERT_EQ(run_linear(k, linear_data(k), SIZE_MAX, &r), FCE_SUCCESS) << fce_last_error();
        check_linear(k, r, nullptr);
      }
}

// The linear call equals the logits call on the logits its GEMMs make (float32, to rounding).
TEST_F(LinearDistill, MatchesLogitsCall) {
  LinearCase k;
  k.c.divergence = FCE_DIVERGENCE_JSD;
  k.c.reduction = FCE_REDUCTION_NONE;
  k.grad_weight = false;
  const LinearData d = linear_data(k);
  LinearOut r;
  ASSERT_EQ(run_linear(k, d, SIZE_MAX, &r), FCE_SUCCESS) << fce_last_error();
  const Mat zm = mat(FCE_FLOAT32, k.N, k.V);
  Buf zb(zm), tb(zm), gb(zm);
  write_mat(zb, zm, d.z);
  write_mat(tb, zm, d.t);
  zb.push(), tb.push();
  Buf yb = targets_buf(d.y, FCE_INT64);
  Buf loss(vec(FCE_FLOAT32, k.N)), lse(vec(FCE_FLOAT32, k.N));
  fce_options o = options_of(k.c, FCE_FLOAT32);
  fce_teacher te = teacher_of(k.c);
  te.logits = tb.ptr();
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  out.lse = lse.p<float>();
  fce_gradients g = FCE_GRADIENTS_INIT;
  g.grad_logits = gb.ptr();
  size_t ws = 0;
  ASSERT_EQ(fce_distill_workspace_size(&o, &te, k.N, k.V, &ws), FCE_SUCCESS);
  Buf wb = workspace_buf(ws);
  ASSERT_EQ(
      fce_distill(&o, &te, k.N, k.V, zb.ptr(), yb.ptr(), &out, &g, wb.ptr(), ws, test_stream()),
      FCE_SUCCESS)
      << fce_last_error();
  ASSERT_TRUE(finish());
  loss.pull(), lse.pull(), gb.pull();
  const double tol = on_cuda() ? 2e-3 : 1e-5;
  EXPECT_TRUE(close_normwise(r.loss, read_mat(loss, vec(FCE_FLOAT32, k.N)), tol, "loss"));
  EXPECT_TRUE(close_normwise(r.lse, read_mat(lse, vec(FCE_FLOAT32, k.N)), tol, "lse"));
  const std::vector<double> dz = read_mat(gb, zm);
  std::vector<double> dh(k.N * k.D, 0.0);
  for (int64_t row = 0; row < k.N; ++row)
    for (int64_t v = 0; v < k.V; ++v)
      for (int64_t i = 0; i < k.D; ++i) dh[row * k.D + i] += dz[row * k.V + v] * d.w[v * k.D + i];
  EXPECT_TRUE(close_normwise(r.dh, dh, tol, "grad_hidden"));
}

// Every workspace from min_bytes up gives the same result (bitwise on the CPU, whose chunks do
// not depend on it; within rounding on CUDA, whose token chunks do).
TEST_F(LinearDistill, WorkspaceSweep) {
  for (bool fp32_dw : {true, false}) {
    LinearCase k;
    k.N = 300;
    k.V = 500;
    k.dtype = FCE_BFLOAT16;
    k.fp32_dw = fp32_dw;
    k.c.divergence = FCE_DIVERGENCE_REVERSE_KL;
    const LinearData d = linear_data(k);
    fce_options o = options_of(k.c, k.dtype);
    o.grad_weight_fp32 = fp32_dw;
    fce_teacher te = teacher_of(k.c);
    te.hidden = k.Dt;
    size_t lo = 0, hi = 0;
    ASSERT_EQ(fce_linear_distill_workspace_size(&o, &te, k.N, k.D, k.V, 1, &lo, &hi), FCE_SUCCESS);
    ASSERT_LE(lo, hi);
    LinearOut best;
    ASSERT_EQ(run_linear(k, d, hi, &best), FCE_SUCCESS) << fce_last_error();
    check_linear(k, best, nullptr);
    for (size_t bytes : {lo, lo + (hi - lo) / 3, (lo + hi) / 2, hi - 16, hi + 4096}) {
      SCOPED_TRACE("fp32_dw " + std::to_string(fp32_dw) + " workspace " + std::to_string(bytes));
      LinearOut r;
      const fce_status st = run_linear(k, d, bytes, &r);
      if (on_cuda() && !fp32_dw && st == FCE_ERROR_UNSUPPORTED) {  // the sliced plan's sizes
        EXPECT_TRUE(error_mentions("grad_weight_fp32"));
        continue;
      }
      ASSERT_EQ(st, FCE_SUCCESS) << fce_last_error();
      check_linear(k, r, nullptr);
      if (!on_cuda()) {
        EXPECT_TRUE(bitwise_equal(r.dw_bytes, best.dw_bytes, "grad_weight"));
      }
    }
  }
}

TEST_F(LinearDistill, AccumulateAndHalfWeightGrad) {
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16, FCE_FLOAT16}) {
    LinearCase k;
    k.dtype = dtype;
    k.accumulate = true;
    k.c.divergence = FCE_DIVERGENCE_JSD;
    k.c.reduction = FCE_REDUCTION_SUM;
    std::mt19937_64 rng(77);
    const std::vector<double> old = random_normal(rng, dtype, k.V * k.D, 0.01);
    LinearOut r;
    SCOPED_TRACE(dtype_name(dtype));
    ASSERT_EQ(run_linear(k, linear_data(k), SIZE_MAX, &r, &old), FCE_SUCCESS) << fce_last_error();
    check_linear(k, r, &old);
  }
}

TEST_F(LinearDistill, EmptyProblem) {
  LinearCase k;
  k.N = 0;
  LinearOut r;
  ASSERT_EQ(run_linear(k, linear_data(k), SIZE_MAX, &r), FCE_SUCCESS) << fce_last_error();
  EXPECT_EQ(r.loss, std::vector<double>{0.0});
  for (double x : r.dw) ASSERT_EQ(x, 0.0);
}

}  // namespace
