// check_ce.h — checks of the cross-entropy outputs that need the float64 reference (ref.h) and
// more than a norm-wise bound: argmax and accuracy (docs/semantics.md rule 15), with the near ties a float32
// computation of the logits may break either way, and fce_backward's gradient against
// fce_forward's up to the rounding of the saved lse (docs/semantics.md rule 12).
#pragma once

#include "ref.h"
#include "test_util.h"

namespace fcet {

// The rows whose argmax a float32 computation may legitimately give differently from the
// reference: some other entry is within delta_r = rel * (|a_max| + 1) of the row's maximum
// (a = s z, capped, differs from the reference's by a few float32 roundings on CUDA; in
// fce_linear_ce the logits themselves by the GEMM's rounding). NaN rows are never ambiguous.
inline std::vector<bool> ambiguous_argmax_rows(const fceref::CeResult& ref, int64_t V,
                                               double rel) {
  const int64_t N = static_cast<int64_t>(ref.kind.size());
  std::vector<bool> amb(static_cast<size_t>(N), false);
  for (int64_t r = 0; r < N; ++r) {
    const int64_t best = ref.argmax[static_cast<size_t>(r)];
    if (best < 0) continue;
    const double* a = &ref.a[static_cast<size_t>(r * V)];
    if (std::isnan(a[best])) continue;
    const double delta = rel * (std::fabs(a[best]) + 1.0);
    for (int64_t j = 0; j < V && !amb[static_cast<size_t>(r)]; ++j)
      if (j != best && a[j] >= a[best] - delta) amb[static_cast<size_t>(r)] = true;
  }
  return amb;
}

// outputs->argmax against the reference: −1 exactly for ignored rows, the first NaN for a NaN
// row, otherwise the reference's index, or in an ambiguous row (above) any entry within delta
// of the maximum.
inline ::testing::AssertionResult argmax_matches(const std::vector<int64_t>& got,
                                                 const fceref::CeResult& ref, int64_t V,
                                                 double rel, int64_t* ties_broken_otherwise) {
  const std::vector<bool> amb = ambiguous_argmax_rows(ref, V, rel);
  int64_t bad = 0, other = 0;
  std::ostringstream msg;
  for (size_t r = 0; r < got.size(); ++r) {
    const int64_t want = ref.argmax[r], have = got[r];
    if (have == want) continue;
    if (amb[r] && have >= 0 && have < V) {
      const double* a = &ref.a[r * static_cast<size_t>(V)];
      // Exactly equal maxima are equal in float32 too: the lowest index, nothing else.
      if (a[have] != a[want] && a[have] >= a[want] - rel * (std::fabs(a[want]) + 1.0)) {
        ++other;
        continue;
      }
    }
    if (bad < 5) msg << "\n  row " << r << ": argmax " << have << ", expected " << want;
    ++bad;
  }
  if (ties_broken_otherwise) *ties_broken_otherwise = other;
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "argmax: " << bad << " rows wrong" << msg.str();
}

// outputs->accuracy: for none [N] 1/0 per row, for mean/sum [1] the fraction of the n
// non-ignored rows whose argmax is their target (docs/semantics.md rule 15). With the call's own argmax
// (argmax non-null) the accuracy must be exactly what that argmax implies (within one float32
// rounding of the quotient); without it, it may differ from the reference only on ambiguous
// rows.
inline ::testing::AssertionResult accuracy_matches(const std::vector<double>& got, int reduction,
                                                   const fceref::CeResult& ref,
                                                   const std::vector<int64_t>* argmax, int64_t V,
                                                   double rel) {
  const std::vector<bool> amb = ambiguous_argmax_rows(ref, V, rel);
  const size_t N = ref.kind.size();
  std::vector<double> want(N, 0.0);
  double n_amb = 0;
  for (size_t r = 0; r < N; ++r) {
    if (ref.kind[r] != fceref::kValid) continue;
    want[r] = argmax ? ((*argmax)[r] == ref.target[r] ? 1.0 : 0.0) : ref.correct[r];
    if (!argmax && amb[r]) n_amb += 1;
  }
  std::ostringstream msg;
  if (reduction == fceref::kNone) {
    int64_t bad = 0;
    for (size_t r = 0; r < N; ++r) {
      if (got[r] == want[r]) continue;
      if (!argmax && amb[r] && (got[r] == 0.0 || got[r] == 1.0)) continue;
      if (bad < 5) msg << "\n  row " << r << ": " << got[r] << ", expected " << want[r];
      ++bad;
    }
    if (bad == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "accuracy (per row): " << bad << " rows wrong"
                                         << msg.str();
  }
  double correct = 0;
  for (double w : want) correct += w;
  const double n = ref.count;
  const double expected = n == 0 ? 0.0 : correct / n;
  const double slack = (n == 0 ? 0.0 : n_amb / n) + std::ldexp(std::fabs(expected), -23);
  if (got.size() == 1 && std::fabs(got[0] - expected) <= slack)
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "accuracy: " << (got.empty() ? std::numeric_limits<double>::quiet_NaN() : got[0])
                                       << ", expected " << expected << " (slack " << slack
                                       << ", " << n << " non-ignored rows)";
}

// The sum of the magnitudes of the terms of gradient element (r, j) (docs/semantics.md rule 9), the scale
// against which its rounding error is measured:
//   |t s (1 − (a_j/c)²)| (|k| ((1−ε) ω_y (p_j + [j = y]) + (ε/V)(Ω p_j + ω_j)) + |k_z| 2 λ |lse| p_j)
// k and k_z the upstream scales of the row (docs/semantics.md rule 6). 0 for rows that are not scored.
inline double gradient_term_magnitude(const fceref::CeResult& ref, const fceref::Options& o,
                                      int64_t V, double k, double kz, size_t r, int64_t j) {
  if (ref.kind[r] != fceref::kValid) return 0.0;
  const bool weighted = !o.class_weights.empty();
  auto omega = [&](int64_t i) { return weighted ? o.class_weights[static_cast<size_t>(i)] : 1.0; };
  double Omega = 0;
  if (o.label_smoothing != 0)
    for (int64_t i = 0; i < V; ++i) Omega += omega(i);
  const double a = ref.a[r * static_cast<size_t>(V) + static_cast<size_t>(j)];
  const double p = std::exp((a - ref.m[r]) - ref.log_s[r]);
  const double cap = o.softcap > 0 ? std::fabs(1.0 - (a / o.softcap) * (a / o.softcap)) : 1.0;
  const int64_t y = ref.target[r];
  const double eps = o.label_smoothing;
  const double ce = (1 - eps) * omega(y) * (p + (j == y ? 1.0 : 0.0)) +
                    (eps != 0 ? eps / static_cast<double>(V) * (Omega * p + omega(j)) : 0.0);
  const double zl = o.z_loss_scale != 0 ? 2 * o.z_loss_scale * std::fabs(ref.lse[r]) * p : 0.0;
  return std::fabs(ref.t[r] * o.logit_scale) * cap * (std::fabs(k) * ce + std::fabs(kz) * zl);
}

inline double subnormal_step(int dtype) {
  switch (dtype) {
    case FCE_FLOAT16: return std::ldexp(1.0, -24);
    case FCE_BFLOAT16: return std::ldexp(1.0, -133);
    default: return std::ldexp(1.0, -149);
  }
}

// fce_backward's gradient (from the float32 lse fce_forward saved) against fce_forward's own,
// element by element (docs/semantics.md rule 12: "equal to the rounding of lse"). Both are the reference's
// formula evaluated with p_j = exp(x_j) for slightly different exponents x_j: the backward's
// carries the rounding of the saved lse, |lse| 2^-24 (none for rows with |lse| >= 1024, reduced
// again), and each kernel's own float32 roundings of the exponent, a few units of
// 2^-24 (|a_j − m| + log V + 1). So, with P_j the part of the element proportional to p_j and
// A_j the sum of the magnitudes of its terms (all from the reference),
//   |bwd_j − fwd_j| <= 1.01 (P_j expm1(Δx_j) + [token scaling] |g_j| expm1(Δx_y))
//                      + 16·2^-24 A_j + u (|bwd_j| + |fwd_j|) + q,
//   Δx_j = 2^-24 (4 |lse| [|lse| < 1024] + 8 (|a_j − m| + log V + 1)),
// with u the output dtype's unit roundoff (each gradient rounded once to it) and q its smallest
// subnormal step. NaN where the reference is NaN, zeros of ignored rows exactly zero.
inline ::testing::AssertionResult backward_matches_forward(
    const std::vector<double>& bwd, const std::vector<double>& fwd, const fceref::CeResult& ref,
    const fceref::Options& o, int64_t V, const std::vector<double>* g, int dtype,
    double* worst_ratio = nullptr) {
  const size_t N = ref.kind.size();
  const double u24 = std::ldexp(1.0, -24), u = unit_roundoff(dtype), q = subnormal_step(dtype);
  const double eps = o.label_smoothing, lam = o.z_loss_scale, c = o.softcap;
  const bool weighted = !o.class_weights.empty();
  auto omega = [&](int64_t j) { return weighted ? o.class_weights[static_cast<size_t>(j)] : 1.0; };
  double Omega = 0;
  for (int64_t j = 0; j < V; ++j) Omega += omega(j);
  const double D = ref.denominator, n = ref.count;
  int64_t bad = 0;
  double worst = 0;
  std::ostringstream msg;
  for (size_t r = 0; r < N; ++r) {
    const double* b = &bwd[r * static_cast<size_t>(V)];
    const double* f = &fwd[r * static_cast<size_t>(V)];
    const double* gr = &ref.grad[r * static_cast<size_t>(V)];
    const double* a = &ref.a[r * static_cast<size_t>(V)];
    const fceref::RowKind kind = ref.kind[r];
    const double gval = g ? (o.reduction == fceref::kNone ? (*g)[r] : (*g)[0]) : 1.0;
    const double k = o.reduction == fceref::kMean ? (D == 0 ? 0.0 : gval / D) : gval;
    const double kz = o.reduction == fceref::kMean ? (n == 0 ? 0.0 : gval / n) : gval;
    const double m = ref.m[r], log_s = ref.log_s[r], lse = ref.lse[r], t = ref.t[r];
    const int64_t y = ref.target[r];
    const double lse_term = std::fabs(lse) < 1024.0 ? 4.0 * std::fabs(lse) : 0.0;
    const double log_v = std::log(static_cast<double>(V));
    for (int64_t j = 0; j < V; ++j) {
      const double bj = b[j], fj = f[j];
      bool ok;
      double bound = 0;
      if (kind == fceref::kIgnored) {
        ok = bj == 0.0 && fj == 0.0;
      } else if (!std::isfinite(gr[j])) {
        ok = std::isnan(gr[j]) ? (std::isnan(bj) && std::isnan(fj)) : (bj == gr[j] && fj == gr[j]);
      } else if (!std::isfinite(bj) || !std::isfinite(fj)) {
        ok = false;
      } else {
        const double p = std::exp((a[j] - m) - log_s);
        const double cap = c > 0 ? std::fabs(1.0 - (a[j] / c) * (a[j] / c)) : 1.0;
        const double S = std::fabs(t * o.logit_scale) * cap;
        const double wy = kind == fceref::kValid ? (1 - eps) * omega(y) : 0.0;
        const double P = S * p * (std::fabs(k) * (wy + eps / V * Omega) +
                                  std::fabs(kz) * 2 * lam * std::fabs(lse));
        const double A = S * (std::fabs(k) * (wy * (p + (j == y ? 1.0 : 0.0)) +
                                              eps / V * (Omega * p + omega(j))) +
                              std::fabs(kz) * 2 * lam * std::fabs(lse) * p);
        auto dx = [&](double aj) {
          return u24 * (lse_term + 8.0 * (std::fabs(aj - m) + log_v + 1));
        };
        // (0 where p_j or g_j is 0: an entry of −inf has an infinite Δx but no part in p.)
        const double pe = P > 0 ? P * std::expm1(dx(a[j])) : 0.0;
        double ts = 0;
        if (o.token_scaling && kind == fceref::kValid && gr[j] != 0)
          ts = std::fabs(gr[j]) * std::expm1(dx(a[y]));
        bound = 1.01 * (pe + ts) + 16 * u24 * A + u * (std::fabs(bj) + std::fabs(fj)) + q;
        const double err = std::fabs(bj - fj);
        ok = err <= bound;
        if (bound > 0) worst = std::max(worst, err / bound);
      }
      if (!ok) {
        if (bad < 5)
          msg << "\n  (" << r << "," << j << "): fce_backward " << bj << ", fce_forward " << fj
              << ", bound " << bound << " (reference " << gr[j] << ", lse " << lse << ")";
        ++bad;
      }
    }
  }
  if (worst_ratio) *worst_ratio = worst;
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "fce_backward vs fce_forward gradient: " << bad
                                       << " elements beyond the lse rounding" << msg.str();
}

}  // namespace fcet
