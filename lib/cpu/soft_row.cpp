// soft_row.cpp — a row scored against class probabilities (docs/semantics.md rule 19), in
// double, as the rule writes it: q'_j = (1 − ε) q_j + ε/V, Q = Σ_j ω_j q'_j,
// U = Σ_j ω_j q'_j (a_j − m) (the terms with ω_j q'_j = 0 left out, so that a −inf logit of
// probability 0 adds nothing), ce = Q · log s − U, and
// ∂ce/∂a_j = Q p_j − ω_j q'_j. The rest of the row (z-loss, lse, entropy, rule 18's terms, the
// chain factor) is ce_row.h's, as for a row with a target class.
#include <cmath>
#include <limits>

#include "ce_row.h"

namespace fce {
namespace cpu {
namespace {

// q'_j of row r: the caller's probability, label smoothing applied.
struct SoftRow {
  const void* q;  // row r of the targets, [V] of setup.q_dtype
  double keep;    // 1 − ε
  double spread;  // ε / V
  double operator()(const CeSetup& setup, int64_t j) const {
    const double qj = double(load_float(setup.q_dtype, q, j));
    return spread == 0.0 ? qj : keep * qj + spread;
  }
};

SoftRow soft_row(const CeSetup& setup, int64_t r) {
  const char* base = static_cast<const char*>(setup.targets);
  const size_t row_bytes = size_t(setup.vocab) * dtype_size(setup.q_dtype);
  return {base + size_t(r) * row_bytes, 1.0 - setup.eps, setup.eps / double(setup.vocab)};
}

// Q = Σ_j ω_j q'_j.
double weighted_mass(const CeSetup& setup, const SoftRow& q) {
  double mass = 0.0;
  for (int64_t j = 0; j < setup.vocab; ++j) mass += omega_of(setup, j) * q(setup, j);
  return mass;
}

}  // namespace

double soft_cross_entropy(const CeSetup& setup, const double* a, const RowStats& st, int64_t r) {
  // a NaN, a +inf or a row of −inf has no distribution (rule 10): NaN
  if (!std::isfinite(st.m)) return std::numeric_limits<double>::quiet_NaN();
  const SoftRow q = soft_row(setup, r);
  double mass = 0.0, shifted = 0.0;  // Q and U
  for (int64_t j = 0; j < setup.vocab; ++j) {
    const double wq = omega_of(setup, j) * q(setup, j);
    mass += wq;
    if (wq != 0.0) shifted += wq * (a[j] - st.m);
  }
  return mass * st.log_s - shifted;
}

void soft_gradient(const CeSetup& setup, double* a, const RowStats& st, int64_t r,
                   const Upstream& up, const RowTerms& terms) {
  const SoftRow q = soft_row(setup, r);
  const double mass = weighted_mass(setup, q);
  const double z_loss = setup.lambda == 0.0 ? 0.0 : 2.0 * setup.lambda * st.lse;
  for (int64_t j = 0; j < setup.vocab; ++j) {
    const double p = probability(st, a[j]);
    const double d_ce = mass * p - omega_of(setup, j) * q(setup, j);
    double d_a = up.k1 * d_ce;
    if (z_loss != 0.0) d_a += up.kz1 * z_loss * p;
    a[j] = element_gradient(setup, a[j], p, st, d_a, true, up, terms);
  }
}

}  // namespace cpu
}  // namespace fce
