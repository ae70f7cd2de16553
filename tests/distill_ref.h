// distill_ref.h — the float64 (long double) reference of the distillation (docs/semantics.md
// rule 20), written from the rule: one row's divergence, lse and gradient, and a whole problem's
// loss (by reduction), lse and gradient. test_distill.cpp checks its gradient against finite
// differences; the distillation suites (test_distill.cpp, test_vp_distill.cpp) test against it.
#pragma once

#include <cmath>
#include <vector>

#include "test_util.h"

namespace distillref {

using LD = long double;

struct Cfg {
  int divergence = FCE_DIVERGENCE_FORWARD_KL;
  double beta = 0.5, T = 1.0, s = 1.0, c = 0.0;
  int reduction = FCE_REDUCTION_MEAN;
};

// u = (c tanh(s z / c) or s z) / T.
inline LD transform(const Cfg& c, LD z) {
  LD a = c.s * z;
  if (c.c > 0) a = c.c * std::tanh(a / c.c);
  return a / c.T;
}

// log_softmax relative to the row maximum, in long double.
inline std::vector<LD> log_softmax(const std::vector<LD>& u) {
  LD m = -INFINITY;
  for (LD x : u) {
    if (std::isnan(x)) return std::vector<LD>(u.size(), NAN);
    m = std::max(m, x);
  }
  LD s = 0;
  for (LD x : u) s += std::exp(x - m);
  std::vector<LD> out(u.size());
  for (size_t j = 0; j < u.size(); ++j) out[j] = (u[j] - m) - std::log(s);
  return out;
}

inline LD kl_term(LD x, LD lx, LD ly) { return x == 0 ? 0 : x * (lx - ly); }
inline LD log_add_exp(LD x, LD y) {
  const LD hi = std::max(x, y), lo = std::min(x, y);
  if (std::isnan(x) || std::isnan(y)) return NAN;
  if (hi == -INFINITY) return hi;
  return hi + std::log1p(std::exp(lo - hi));
}

// One row: the loss, the student's lse of a / T, and ∂loss/∂z for an upstream 1.
struct RowRef {
  double loss, lse;
  std::vector<double> dz;
};

inline RowRef row_ref(const Cfg& c, const double* z, const double* t, int64_t V) {
  std::vector<LD> u(V), v(V);
  for (int64_t j = 0; j < V; ++j) u[j] = transform(c, z[j]), v[j] = transform(c, t[j]);
  const std::vector<LD> lp = log_softmax(u), lq = log_softmax(v);
  int div = c.divergence;
  if (div == FCE_DIVERGENCE_JSD && c.beta == 0) div = FCE_DIVERGENCE_FORWARD_KL;
  if (div == FCE_DIVERGENCE_JSD && c.beta == 1) div = FCE_DIVERGENCE_REVERSE_KL;
  const LD b = c.beta;
  LD loss = 0, k = 0;
  std::vector<LD> lm(V);
  for (int64_t j = 0; j < V; ++j) {
    const LD p = std::exp(lp[j]), q = std::exp(lq[j]);
    if (div == FCE_DIVERGENCE_FORWARD_KL) loss += kl_term(q, lq[j], lp[j]);
    if (div == FCE_DIVERGENCE_REVERSE_KL) loss += kl_term(p, lp[j], lq[j]);
    if (div == FCE_DIVERGENCE_JSD) {
      lm[j] = log_add_exp(std::log(b) + lq[j], std::log1p(-b) + lp[j]);
      loss += b * kl_term(q, lq[j], lm[j]) + (1 - b) * kl_term(p, lp[j], lm[j]);
      k += kl_term(p, lp[j], lm[j]);
    }
  }
  if (div == FCE_DIVERGENCE_REVERSE_KL) k = loss;
  RowRef r;
  r.loss = static_cast<double>(loss);
  LD m = -INFINITY;
  for (LD x : u) m = std::max(m, x);
  LD se = 0;
  for (LD x : u) se += std::exp(x - m);
  r.lse = static_cast<double>(m == -INFINITY ? m : m + std::log(se));
  r.dz.resize(V);
  for (int64_t j = 0; j < V; ++j) {
    const LD p = std::exp(lp[j]);
    LD du = 0;
    if (div == FCE_DIVERGENCE_FORWARD_KL) du = p - std::exp(lq[j]);
    if (div == FCE_DIVERGENCE_REVERSE_KL && p != 0) du = p * ((lp[j] - lq[j]) - k);
    if (div == FCE_DIVERGENCE_JSD && p != 0) du = (1 - b) * p * ((lp[j] - lm[j]) - k);
    LD chain = c.s / c.T;
    if (c.c > 0) {
      const LD a = u[j] * c.T;
      chain *= 1 - (a / c.c) * (a / c.c);
    }
    r.dz[j] = static_cast<double>(du * chain);
  }
  return r;
}

// The whole problem: loss ([1] or [N]), lse [N], gradient [N*V] for upstream g.
struct Ref {
  std::vector<double> loss, lse, grad;
};

inline Ref reference(const Cfg& c, int64_t N, int64_t V, const std::vector<double>& z,
                     const std::vector<double>& t, const std::vector<int64_t>* y,
                     const std::vector<double>& g) {
  Ref out;
  out.lse.resize(N);
  out.grad.assign(N * V, 0.0);
  std::vector<double> rows(N, 0.0);
  double n = 0;
  for (int64_t r = 0; r < N; ++r) n += (!y || (*y)[r] != -100) ? 1 : 0;
  for (int64_t r = 0; r < N; ++r) {
    const RowRef rr = row_ref(c, &z[r * V], &t[r * V], V);
    out.lse[r] = rr.lse;
    if (y && (*y)[r] == -100) continue;
    rows[r] = rr.loss;
    const double up = c.reduction == FCE_REDUCTION_NONE  ? g[r]
                      : c.reduction == FCE_REDUCTION_SUM ? g[0]
                      : n == 0                           ? 0.0
                                                         : g[0] / n;
    for (int64_t j = 0; j < V; ++j) out.grad[r * V + j] = rr.dz[j] * up;
  }
  if (c.reduction == FCE_REDUCTION_NONE) {
    out.loss = rows;
  } else {
    double sum = 0;
    for (double x : rows) sum += x;
    out.loss = {c.reduction == FCE_REDUCTION_MEAN ? (n == 0 ? 0.0 : sum / n) : sum};
  }
  return out;
}

// ------------------------------------------------------------------ calling the library -----
// The teacher of a case (divergence, beta, temperature; no tensors yet).
inline fce_teacher teacher_of(const Cfg& c) {
  fce_teacher t = FCE_TEACHER_INIT;
  t.divergence = c.divergence;
  t.beta = static_cast<float>(c.beta);
  t.temperature = static_cast<float>(c.T);
  return t;
}

// The distillation calls' tolerances against the reference (norm-wise): the loss, and the
// gradient of a dtype.
inline double loss_tol() { return fcet::on_cuda() ? 1e-4 : 1e-5; }
inline double grad_tol(int dtype) {
  return dtype == FCE_FLOAT32 ? (fcet::on_cuda() ? 4e-5 : 1e-5) : fcet::tolerance(dtype);
}

}  // namespace distillref
