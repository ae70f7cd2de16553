// entropy_ref.h — the float64 reference of docs/semantics.md rule 18 (the entropy and the lse /
// entropy gradient terms) on top of ref.h's cross_entropy, shared by test_entropy.cpp (which
// checks it by finite differences) and the vocabulary-parallel suite.
#pragma once

#include <cmath>
#include <vector>

#include "ref.h"

namespace {

// Rule 18 on top of ref.h's cross_entropy (which gives a, m, log s and the loss's gradient):
// per row μ − m = t/s with t = Σ exp(a − m)(a − m), H = log s − t/s, and the extra gradient
// (gl p − ge p (a − μ)) · s · (1 − (a/c)²). Long double, −inf entries (p = 0) adding nothing.
struct RowTermsRef {
  std::vector<double> entropy;  // [N]
  std::vector<double> dz;       // [N * V] the extra gradient over z
};

inline RowTermsRef row_terms_ref(const fceref::Options& o, const fceref::CeResult& ce, int64_t N,
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
inline std::vector<double> total_grad(const fceref::CeResult& ce, const RowTermsRef& t) {
  std::vector<double> g = ce.grad;
  for (size_t i = 0; i < g.size(); ++i) g[i] += t.dz[i];
  return g;
}

}  // namespace
