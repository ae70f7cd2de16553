// soft_ref.h — the float64 reference of class-probability targets (docs/semantics.md rule 19)
// and random probabilities, shared by test_soft_targets.cpp (the unsharded calls) and
// test_vp_soft.cpp (the vocabulary-parallel calls). On test_util.h.
#pragma once

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "test_util.h"

namespace softref {

using namespace fcet;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ------------------------------------------------------------------ the reference ----------
struct Opts {
  int reduction = FCE_REDUCTION_MEAN;
  double eps = 0.0, lambda = 0.0, softcap = 0.0, scale = 1.0;
  std::vector<double> w;  // class weights, empty = all 1
};

struct Ref {
  std::vector<double> a, lse, row_loss, grad;  // a, grad: [N * V]
  std::vector<int64_t> argmax;
  double loss = 0.0, z_loss = 0.0;
};

// Rule 19 in long double: q' = (1 − ε) q + ε/V, ce = Q log s − Σ_{ωq' ≠ 0} ωq'(a − m),
// zl = λ lse², ∂/∂a_j = k (Q p_j − ω_j q'_j + 2λ lse p_j), times s (1 − (a_j/c)²).
// g: the upstream gradient ([1], or [N] for none).
inline Ref soft_ref(const Opts& o, int64_t N, int64_t V, const std::vector<double>& z,
                    const std::vector<double>& q, const std::vector<double>& g) {
  Ref r;
  r.a.resize(static_cast<size_t>(N * V));
  r.grad.assign(static_cast<size_t>(N * V), 0.0);
  r.lse.resize(static_cast<size_t>(N));
  r.row_loss.resize(static_cast<size_t>(N));
  r.argmax.resize(static_cast<size_t>(N));
  long double total = 0, ztotal = 0;
  for (int64_t i = 0; i < N; ++i) {
    const double* zr = &z[static_cast<size_t>(i * V)];
    double* a = &r.a[static_cast<size_t>(i * V)];
    double m = -INFINITY;
    int64_t am = 0;
    bool nan = false;
    for (int64_t j = 0; j < V; ++j) {
      a[j] = o.scale * zr[j];
      if (o.softcap > 0) a[j] = o.softcap * std::tanh(a[j] / o.softcap);
      if (std::isnan(a[j]) && !nan) nan = true, am = j;
      if (!nan && a[j] > m) m = a[j], am = j;
    }
    r.argmax[static_cast<size_t>(i)] = am;
    long double s = 0, mass = 0, shifted = 0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(static_cast<long double>(a[j]) - m);
    const long double ls = std::log(s), lse = m + ls;
    auto qp = [&](int64_t j) {
      return (1 - o.eps) * q[static_cast<size_t>(i * V + j)] + o.eps / static_cast<double>(V);
    };
    auto wj = [&](int64_t j) { return o.w.empty() ? 1.0 : o.w[static_cast<size_t>(j)]; };
    for (int64_t j = 0; j < V; ++j) {
      const long double wq = wj(j) * qp(j);
      mass += wq;
      if (wq != 0) shifted += wq * (static_cast<long double>(a[j]) - m);
    }
    const bool finite = std::isfinite(m) && !nan;
    const long double ce = finite ? mass * ls - shifted : kNaN;
    const long double zl = o.lambda == 0 ? 0 : o.lambda * lse * lse;
    r.lse[static_cast<size_t>(i)] = nan ? kNaN : static_cast<double>(finite ? lse : m + ls);
    r.row_loss[static_cast<size_t>(i)] = static_cast<double>(ce + zl);
    total += ce + zl;
    ztotal += zl;
    const double gi = g.size() == 1 ? g[0] : g[static_cast<size_t>(i)];
    const long double k = o.reduction == FCE_REDUCTION_MEAN ? gi / static_cast<long double>(N) : gi;
    for (int64_t j = 0; j < V; ++j) {
      const long double p = std::exp((static_cast<long double>(a[j]) - m) - ls);
      long double da = k * (mass * p - wj(j) * qp(j) + 2 * o.lambda * lse * p);
      da *= o.scale;
      if (o.softcap > 0) da *= 1 - (a[j] / o.softcap) * (a[j] / o.softcap);
      r.grad[static_cast<size_t>(i * V + j)] = static_cast<double>(da);
    }
  }
  const bool mean = o.reduction == FCE_REDUCTION_MEAN;
  r.loss = static_cast<double>(mean && N > 0 ? total / N : total);
  r.z_loss = static_cast<double>(mean && N > 0 ? ztotal / N : ztotal);
  return r;
}

// Random probabilities, each row summing to 1 (a few rows sparse: most entries exactly 0),
// rounded to qdtype.
inline std::vector<double> random_probs(std::mt19937_64& rng, int qdtype, int64_t N, int64_t V) {
  std::vector<double> q(static_cast<size_t>(N * V));
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int64_t i = 0; i < N; ++i) {
    const bool sparse = i % 3 == 1;
    double sum = 0;
    for (int64_t j = 0; j < V; ++j) {
      double v = std::pow(u(rng), 4.0);
      if (sparse && u(rng) < 0.9) v = 0;
      q[static_cast<size_t>(i * V + j)] = v;
      sum += v;
    }
    if (sum == 0) q[static_cast<size_t>(i * V)] = sum = 1;
    for (int64_t j = 0; j < V; ++j)
      q[static_cast<size_t>(i * V + j)] = round_to(qdtype, q[static_cast<size_t>(i * V + j)] / sum);
  }
  return q;
}

// The option sets of rule 19 (Opts above) the soft-target suites run: plain, class weights,
// label smoothing, z-loss, softcap and logit_scale.
struct Config {
  const char* name;
  Opts o;
  bool weights;
};

inline std::vector<Config> configs() {
  std::vector<Config> c(5);
  c[0] = {"plain", {}, false};
  c[1] = {"smoothing+weights+zloss", {}, true};
  c[1].o.eps = 0.1, c[1].o.lambda = 1e-3;
  c[2] = {"softcap+scale", {}, false};
  c[2].o.softcap = 20.0, c[2].o.scale = 0.75;
  c[3] = {"scale+zloss", {}, false};
  c[3].o.scale = 1.5, c[3].o.lambda = 1e-2;
  c[4] = {"weights", {}, true};
  return c;
}

}  // namespace softref
