// soft_row.cpp — a row scored against class probabilities (docs/semantics.md rule 19), in
// double, as the rule writes it: q'_j = (1 − ε) q_j + ε/V, Q = Σ_j ω_j q'_j,
// U = Σ_j ω_j q'_j (a_j − m) (the terms with ω_j q'_j = 0 left out, so that a −inf logit of
// probability 0 adds nothing), ce = Q · log s − U, and
// ∂ce/∂a_j = Q p_j − ω_j q'_j. The rest of the row (z-loss, lse, entropy, rule 18's terms, the
// chain factor) is ce_row.h's, as for a row with a target class.
// The same on a vocabulary shard (rule 16): the shard's sums (W_r, u_r) for phase 1, and its
// columns' gradient from the combined (M, log S) and Q = Σ_r W_r.
#include <cmath>
#include <limits>

#include "ce_row.h"

namespace fce {
namespace cpu {
namespace {

// ω_j q'_j of a row's columns [start, start + n) of the vocabulary: the caller's probability,
// label smoothing applied, times the class weight.
struct SoftRow {
  const void* q;  // the row's q_start .. q_{start+n−1}, of setup.q_dtype
  int64_t start;  // the global class of q[0]
  int64_t n;      // columns
  double keep;    // 1 − ε
  double spread;  // ε / V
  double operator()(const CeSetup& setup, int64_t j) const {  // j in [0, n)
    const double qj = double(load_float(setup.q_dtype, q, j));
    return omega_of(setup, start + j) * (spread == 0.0 ? qj : keep * qj + spread);
  }
};

// Row r of the targets [rows, n], of columns [start, start + n): the whole row (start 0, n = V)
// or a shard's.
SoftRow soft_row(const CeSetup& setup, int64_t r, int64_t start, int64_t n) {
  const char* base = static_cast<const char*>(setup.targets);
  const size_t row_bytes = size_t(n) * dtype_size(setup.q_dtype);
  return {base + size_t(r) * row_bytes, start, n, 1.0 - setup.eps, setup.eps / double(setup.vocab)};
}

// Σ_j ω_j q'_j over the row's columns.
double weighted_mass(const CeSetup& setup, const SoftRow& q) {
  double mass = 0.0;
  for (int64_t j = 0; j < q.n; ++j) mass += q(setup, j);
  return mass;
}

// (Σ_j ω_j q'_j, Σ_j ω_j q'_j (a_j − m)), the terms with ω_j q'_j = 0 left out of the second.
SoftSums sums(const CeSetup& setup, const SoftRow& q, const double* a, double m) {
  SoftSums s{0.0, 0.0};
  for (int64_t j = 0; j < q.n; ++j) {
    const double wq = q(setup, j);
    s.mass += wq;
    if (wq != 0.0) s.shifted += wq * (a[j] - m);
  }
  return s;
}

// ∂/∂z_j of the row's columns in place, Q the whole row's mass.
void gradient_columns(const CeSetup& setup, const SoftRow& q, double* a, const RowStats& st,
                      double mass, const Upstream& up, const RowTerms& terms) {
  const double z_loss = setup.lambda == 0.0 ? 0.0 : 2.0 * setup.lambda * st.lse;
  for (int64_t j = 0; j < q.n; ++j) {
    const double p = probability(st, a[j]);
    const double d_ce = mass * p - q(setup, j);
    double d_a = up.k1 * d_ce;
    if (z_loss != 0.0) d_a += up.kz1 * z_loss * p;
    a[j] = element_gradient(setup, a[j], p, st, d_a, true, up, terms);
  }
}

}  // namespace

double soft_cross_entropy(const CeSetup& setup, const double* a, const RowStats& st, int64_t r) {
  // a NaN, a +inf or a row of −inf has no distribution (rule 10): NaN
  if (!std::isfinite(st.m)) return std::numeric_limits<double>::quiet_NaN();
  const SoftSums s = sums(setup, soft_row(setup, r, 0, setup.vocab), a, st.m);
  return s.mass * st.log_s - s.shifted;
}

void soft_gradient(const CeSetup& setup, double* a, const RowStats& st, int64_t r,
                   const Upstream& up, const RowTerms& terms) {
  const SoftRow q = soft_row(setup, r, 0, setup.vocab);
  gradient_columns(setup, q, a, st, weighted_mass(setup, q), up, terms);
}

SoftSums soft_shard_sums(const CeSetup& setup, const double* a, double m, int64_t r, int64_t start,
                         int64_t local) {
  return sums(setup, soft_row(setup, r, start, local), a, m);
}

double soft_shard_weight(const CeSetup& setup, int64_t r, int64_t start, int64_t local, int64_t j) {
  return soft_row(setup, r, start, local)(setup, j);
}

void soft_shard_gradient(const CeSetup& setup, double* a, const RowStats& st, double mass,
                         int64_t r, int64_t start, int64_t local, const Upstream& up,
                         const RowTerms& terms) {
  gradient_columns(setup, soft_row(setup, r, start, local), a, st, mass, up, terms);
}

}  // namespace cpu
}  // namespace fce
