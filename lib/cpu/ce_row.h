// ce_row.h — the cross-entropy of one row, docs/semantics.md "The loss, row by row" and "The gradient"
// step by step (in double here; the float32 fast path below), with the corner cases of docs/semantics.md; shared by ce.cpp (logits given)
// and linear_ce.cpp (logits made chunk by chunk). Rows are independent, so they run on threads
// (parallel_for); the reduction over rows is sequential, in row order: deterministic.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"
#include "row_kernels.h"

namespace fce {
namespace cpu {

// ------------------------------------------------------------ once per call ----

// What every row shares: the options as docs/semantics.md names them, Ω and the denominators D and n.
struct CeSetup {
  int64_t rows, vocab;  // N, V
  double s;             // logit_scale
  double c;             // softcap, 0 = off
  double eps;           // label_smoothing
  double lambda;        // z_loss_scale
  const float* omega;   // class weights [V], nullptr = all 1
  double Omega;         // Σ_j ω_j
  int64_t ignore_index;
  int64_t T;            // shift_seq_len, 0 = no shift
  int64_t k;            // shift: row r is scored against target r + k (k >= 1 when T > 0)
  bool token_scaling;   // each scored row's loss and gradient times the detached p_y
  const void* targets;  // y [N]
  bool targets_int64;
  int reduction;
  const float* grad_output;  // g: [1] (mean, sum) or [N] (none); nullptr = 1
  double D;  // docs/semantics.md rule 4: Σ ω_y over scored rows + the number of invalid rows
  double n;  // docs/semantics.md rule 4: the number of non-ignored rows
  // docs/semantics.md rule 18: the entropy output is asked for, and the upstream gradients of
  // each row's lse and entropy ([N], nullptr = 0)
  bool entropy;
  const float* grad_lse;
  const float* grad_entropy;
  // docs/semantics.md rule 19: targets are class probabilities q [N, V] of q_dtype, every row
  // scored (D = n = N)
  bool soft;
  int q_dtype;
};

enum class RowKind { kScored, kIgnored, kInvalid };

struct RowTarget {
  RowKind kind;
  int64_t y;  // the class, when kind == kScored (−1 for a row of class probabilities)
};

inline double omega_of(const CeSetup& setup, int64_t j) {
  return setup.omega ? double(setup.omega[j]) : 1.0;
}

// docs/semantics.md rules 1-3: the target row r is scored against, or why it is not. With the shift, the
// last k rows of each sequence are ignored before their (absent) target is read.
inline RowTarget row_target(const CeSetup& setup, int64_t r) {
  if (setup.soft) return {RowKind::kScored, -1};  // rule 19: every row scored, no class
  int64_t source = r;
  if (setup.T > 0) {
    if (r % setup.T >= setup.T - setup.k) return {RowKind::kIgnored, 0};
    source = r + setup.k;
  }
  const int64_t y = setup.targets_int64
                        ? static_cast<const int64_t*>(setup.targets)[source]
                        : int64_t(static_cast<const int32_t*>(setup.targets)[source]);
  if (y == setup.ignore_index) return {RowKind::kIgnored, 0};
  if (y < 0 || y >= setup.vocab) return {RowKind::kInvalid, 0};
  return {RowKind::kScored, y};
}

// docs/semantics.md rule 4: D = Σ ω_{y_r} over scored rows + the number of invalid rows, and n = the number
// of non-ignored rows, in row order.
inline void denominators(CeSetup& setup) {
  setup.D = 0.0;
  setup.n = 0.0;
  if (setup.soft) {  // rule 19: the mean divides by the rows, class weights or not (torch's)
    setup.D = setup.n = double(setup.rows);
    return;
  }
  for (int64_t r = 0; r < setup.rows; ++r) {
    const RowTarget t = row_target(setup, r);
    if (t.kind == RowKind::kScored) setup.D += omega_of(setup, t.y);
    if (t.kind == RowKind::kInvalid) setup.D += 1.0;
    if (t.kind != RowKind::kIgnored) setup.n += 1.0;
  }
}

inline CeSetup make_setup(const CeOptions& opt, int64_t rows, int64_t vocab, const void* targets,
                          const float* grad_output, bool entropy = false,
                          const float* grad_lse = nullptr, const float* grad_entropy = nullptr) {
  CeSetup setup;
  setup.rows = rows;
  setup.vocab = vocab;
  setup.s = opt.logit_scale;
  setup.c = opt.softcap;
  setup.eps = opt.label_smoothing;
  setup.lambda = opt.z_loss_scale;
  setup.omega = opt.class_weights;
  setup.Omega = 0.0;
  for (int64_t j = 0; j < vocab; ++j) setup.Omega += omega_of(setup, j);
  setup.ignore_index = opt.ignore_index;
  setup.T = opt.shift_seq_len;
  setup.k = opt.shift_seq_len > 0 ? opt.shift : 0;
  setup.token_scaling = opt.token_scaling;
  setup.targets = targets;
  setup.targets_int64 = opt.targets_int64;
  setup.reduction = opt.reduction;
  setup.grad_output = grad_output;
  setup.entropy = entropy;
  setup.grad_lse = grad_lse;
  setup.grad_entropy = grad_entropy;
  setup.soft = opt.soft_targets;
  setup.q_dtype = opt.q_dtype;
  denominators(setup);
  return setup;
}

// docs/semantics.md rule 6: the upstream scales of row r, k = g · k1 for the cross-entropy terms and
// k_z = g · kz1 for the z-loss term (k1 = 1/D and kz1 = 1/n for mean, 1 otherwise). The gradient
// is computed for an upstream 1 and multiplied by g last, so that the gradient for g = ±2^k or 0
// is exactly the gradient for 1 times g, zeros' signs included (fce_backward_rescale's scaling
// in place, docs/semantics.md rule 14).
struct Upstream {
  double g, k1, kz1;
};

inline Upstream upstream_scales(const CeSetup& setup, int64_t r) {
  const bool per_row = setup.reduction == FCE_REDUCTION_NONE;
  const double g = setup.grad_output ? double(setup.grad_output[per_row ? r : 0]) : 1.0;
  if (setup.reduction != FCE_REDUCTION_MEAN) return {g, 1.0, 1.0};
  return {g, setup.D == 0.0 ? 0.0 : 1.0 / setup.D, setup.n == 0.0 ? 0.0 : 1.0 / setup.n};
}

// docs/semantics.md rule 18: the upstream gradients of row r's lse and entropy (0 when not
// given). A row whose two are 0 gets no such term at all (as when they are not given).
struct RowTerms {
  double lse, entropy;
  bool any() const { return lse != 0.0 || entropy != 0.0; }
};

inline RowTerms row_terms(const CeSetup& setup, int64_t r) {
  return {setup.grad_lse ? double(setup.grad_lse[r]) : 0.0,
          setup.grad_entropy ? double(setup.grad_entropy[r]) : 0.0};
}

// ------------------------------------------------------------- row by row ----

// Steps 1 and 2, in place: a_j = s · z_j, then a_j = c · tanh(a_j / c) when c > 0.
inline void scale_and_softcap(double s, double c, double* a, int64_t vocab) {
  for (int64_t j = 0; j < vocab; ++j) {
    a[j] = s * a[j];
    if (c > 0.0) a[j] = c * std::tanh(a[j] / c);
  }
}
inline void scale_and_softcap(const CeSetup& setup, double* a) {
  scale_and_softcap(setup.s, setup.c, a, setup.vocab);
}

// Step 3 in two parts (docs/semantics.md rules 8-10): the row maximum m and log s, s = Σ_j exp(a_j − m), kept
// apart, so that p_j = exp((a_j − m) − log s) keeps log s even when |m| is huge (all entries
// -1e30: lse = m + log s rounds to m). lse = m + log s. A NaN anywhere makes m, log s and lse
// NaN. Infinite maxima (docs/semantics.md rule 10): a row of −inf counts each entry exp(0) = 1
// (s = V, lse = −inf); a +inf maximum makes its own term exp(+inf − +inf) = NaN, so log s and
// lse are NaN (m stays +inf), as torch's log_softmax. argmax is docs/semantics.md rule 15's:
// the first NaN, else the lowest j with a_j == m.
// Rule 18: with t = Σ_j exp(a_j − m)(a_j − m) (a −inf entry adds 0, not 0·inf), the mean logit
// μ = Σ_j p_j a_j = m + t/s is kept as mu_m = μ − m = t/s, and the entropy H = lse − μ =
// log s − t/s. Both are NaN when m is not finite (a row of −inf has no distribution).
struct RowStats {
  double m, log_s, lse;
  int64_t argmax;
  double mu_m = 0.0, entropy = 0.0;
};

// log s of a row whose maximum m is infinite (rule 10): log V for a row of −inf, NaN for +inf.
inline double infinite_max_log_s(double m, int64_t vocab) {
  return m < 0 ? std::log(double(vocab)) : std::numeric_limits<double>::quiet_NaN();
}

inline RowStats row_stats(const double* a, int64_t vocab) {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  double m = -std::numeric_limits<double>::infinity();
  int64_t argmax = 0;
  for (int64_t j = 0; j < vocab; ++j) {
    if (std::isnan(a[j])) return {kNaN, kNaN, kNaN, j};
    if (a[j] > m) {
      m = a[j];
      argmax = j;
    }
  }
  if (std::isinf(m)) {
    const double log_s = infinite_max_log_s(m, vocab);
    return {m, log_s, m + log_s, argmax, kNaN, kNaN};
  }
  double s = 0.0, t = 0.0;
  for (int64_t j = 0; j < vocab; ++j) {
    const double e = std::exp(a[j] - m);
    s += e;
    if (e != 0.0) t += e * (a[j] - m);
  }
  const double log_s = std::log(s);
  return {m, log_s, m + log_s, argmax, t / s, log_s - t / s};
}

// fce_backward's statistics (docs/semantics.md rule 12): the row is reduced again (in double, cheap next to
// the gradient); when its lse rounds to the saved float, that is exactly what fce_forward had, so
// its (m, log s) are used and the gradient is fce_forward's bit for bit; so they are when
// |lse| >= 1024, where the saved float would lose log s. Otherwise (the lse of another call)
// p_j = exp(a_j − lse) from the saved value, as the header says: m = lse, log s = 0.
inline RowStats saved_stats(float saved, const double* a, int64_t vocab) {
  const RowStats exact = row_stats(a, vocab);
  if (float(exact.lse) == saved || std::fabs(saved) >= 1024.0f) return exact;
  return {double(saved), 0.0, double(saved), exact.argmax, (exact.m + exact.mu_m) - double(saved),
          exact.entropy};
}

// p_j = exp((a_j − m) − log s) (docs/semantics.md rule 9).
inline double probability(const RowStats& st, double a_j) {
  return std::exp((a_j - st.m) - st.log_s);
}

// Step 4 (docs/semantics.md rule 8): ce = (1 − ε) ω_y ((m − a_y) + log s) + (ε/V) Σ_j ω_j ((m − a_j) + log s).
// The smoothing sum is skipped when ε == 0 (so that a −inf entry does not make 0 · inf).
inline double cross_entropy(const CeSetup& setup, const double* a, const RowStats& st, int64_t y) {
  double ce = (1.0 - setup.eps) * omega_of(setup, y) * ((st.m - a[y]) + st.log_s);
  if (setup.eps > 0.0) {
    double smooth = 0.0;
    for (int64_t j = 0; j < setup.vocab; ++j)
      smooth += omega_of(setup, j) * ((st.m - a[j]) + st.log_s);
    ce += setup.eps / double(setup.vocab) * smooth;
  }
  return ce;
}

// Step 5's z-loss term λ · lse² (0 when λ == 0, whatever lse is).
inline double z_loss_term(const CeSetup& setup, double lse) {
  return setup.lambda == 0.0 ? 0.0 : setup.lambda * lse * lse;
}

// The z-loss term of a scored row with token scaling's factor t: t · λ lse², and 0 when λ == 0
// whatever t is (no z-loss term at all, even for a row whose p_y is NaN).
inline double scaled_z_loss_term(const CeSetup& setup, double t, double lse) {
  return setup.lambda == 0.0 ? 0.0 : t * z_loss_term(setup, lse);
}

// An element's ∂/∂z_j from d_a, its loss's ∂/∂a_j for an upstream 1 (when the row has a loss
// term), p = p_j and rule 18's terms: (g d_a + grad_lse p − grad_entropy p (a_j − μ)) · s ·
// (1 − (a_j / c)²), the lse and entropy terms 0 where p = 0 (never 0 · inf).
inline double element_gradient(const CeSetup& setup, double a_j, double p, const RowStats& st,
                               double d_a, bool loss_term, const Upstream& up,
                               const RowTerms& terms) {
  const double cap = setup.c > 0.0 ? 1.0 - (a_j / setup.c) * (a_j / setup.c) : 1.0;
  if (!terms.any()) {
    double d_z = d_a * setup.s;
    if (setup.c > 0.0) d_z *= cap;
    return up.g * d_z;
  }
  double d_row = 0.0;  // grad_lse ∂lse/∂a_j + grad_entropy ∂H/∂a_j
  if (p != 0.0) d_row = terms.lse * p - terms.entropy * p * ((a_j - st.m) - st.mu_m);
  return ((loss_term ? up.g * d_a : 0.0) + d_row) * setup.s * cap;
}

// docs/semantics.md rule 19 (soft_row.cpp): the cross-entropy of row r against its class
// probabilities, and its gradient in place (a_j in, ∂/∂z_j out), in double.
double soft_cross_entropy(const CeSetup& setup, const double* a, const RowStats& st, int64_t r);
void soft_gradient(const CeSetup& setup, double* a, const RowStats& st, int64_t r,
                   const Upstream& up, const RowTerms& terms);
// The same on a vocabulary shard (rule 16; lib/cpu/vocab_parallel.cpp): setup.targets is the
// shard's q [rows, local] of classes [start, start + local), a the shard's row.
// soft_shard_sums: W = Σ_j ω_j q'_j and Σ_j ω_j q'_j (a_j − m) over the shard (the terms with
// ω_j q'_j = 0 left out of the second); soft_shard_gradient: ∂/∂z_j of the shard's columns in
// place, with st the combined row statistics and mass = Q of the whole row.
struct SoftSums {
  double mass, shifted;
};
SoftSums soft_shard_sums(const CeSetup& setup, const double* a, double m, int64_t r, int64_t start,
                         int64_t local);
// ω_j q'_j of column j in [0, local) of the shard (vocab_parallel.cpp's exact statistics).
double soft_shard_weight(const CeSetup& setup, int64_t r, int64_t start, int64_t local, int64_t j);
void soft_shard_gradient(const CeSetup& setup, double* a, const RowStats& st, double mass,
                         int64_t r, int64_t start, int64_t local, const Upstream& up,
                         const RowTerms& terms);

// The gradient (docs/semantics.md rules 9 and 18), in place: a_j in, ∂/∂z_j out:
//   ∂ce/∂a_j = (1−ε) ω_y (p_j − [j = y]) + (ε/V)(Ω p_j − ω_j),  ∂zl/∂a_j = 2 λ lse p_j
//   ∂loss/∂a_j = t · (k ∂ce/∂a_j + k_z ∂zl/∂a_j)   (t = p_y with token scaling, else 1)
//   ∂lse/∂a_j = p_j,  ∂H/∂a_j = −p_j (a_j − μ)      (μ = Σ_k p_k a_k)
//   ∂/∂z_j = (∂loss/∂a_j + grad_lse ∂lse/∂a_j + grad_entropy ∂H/∂a_j) · s · (1 − (a_j / c)²)
// (the last factor only with softcap), the loss's upstream g applied last (to the loss term).
// y < 0: a row with no loss term (ignored), whose lse and entropy terms still flow. An element
// with p_j = 0 gets 0 from those terms (never 0 · inf).
inline void gradient(const CeSetup& setup, double* a, const RowStats& st, int64_t y,
                     const Upstream& up, double t, const RowTerms& terms) {
  const double target_weight = y < 0 ? 0.0 : (1.0 - setup.eps) * omega_of(setup, y);
  const double smoothing = y < 0 ? 0.0 : setup.eps / double(setup.vocab);
  const double z_loss = y < 0 || setup.lambda == 0.0 ? 0.0 : 2.0 * setup.lambda * st.lse;
  for (int64_t j = 0; j < setup.vocab; ++j) {
    const double p = probability(st, a[j]);
    double d_ce = target_weight * (p - (j == y ? 1.0 : 0.0));
    if (smoothing != 0.0) d_ce += smoothing * (setup.Omega * p - omega_of(setup, j));
    double d_a = up.k1 * d_ce;
    if (z_loss != 0.0) d_a += up.kz1 * z_loss * p;
    if (setup.token_scaling) d_a *= t;
    a[j] = element_gradient(setup, a[j], p, st, d_a, y >= 0, up, terms);
  }
}

// -------------------------------------------------- the float32 row (fast path) ----
//
// When a = z exactly (logit_scale 1, no softcap: float16, bfloat16 and float32 logits are all
// exact in float32) the row stays in float32 and the hot loops run vectorised (row_kernels.h):
// float32 exp per element, Σ exp(a_j − m) and the smoothing sum accumulated in double, log s
// and the loss in double, m and log s kept apart (docs/semantics.md rule 9), and the gradient computed in
// float32 from p_j = exp((a_j − m) − log s), the upstream g multiplied last in float32 (so that
// fce_backward_rescale's exact scaling is bit for bit this with that g, docs/semantics.md rule 14). With
// logit_scale or softcap the double path above is used.

// The entropy and the lse / entropy gradients (rule 18) take the double path.
inline bool float_path(const CeSetup& setup) {
  return setup.s == 1.0 && setup.c == 0.0 && !setup.entropy && !setup.grad_lse &&
         !setup.grad_entropy && !setup.soft;
}

// Step 3 on a float32 row: as row_stats.
inline RowStats row_stats_f32(const float* a, int64_t vocab) {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  bool nan_seen = false;
  const float m = row_max_f32(a, vocab, &nan_seen);
  if (nan_seen) {
    int64_t j = 0;
    while (!std::isnan(a[j])) ++j;
    return {kNaN, kNaN, kNaN, j};
  }
  int64_t argmax = 0;
  while (argmax + 1 < vocab && a[argmax] != m) ++argmax;
  const double log_s =
      std::isfinite(m) ? std::log(sum_exp_f32(a, vocab, m)) : infinite_max_log_s(m, vocab);
  return {double(m), log_s, double(m) + log_s, argmax};
}

// saved_stats on a float32 row.
inline RowStats saved_stats_f32(float saved, const float* a, int64_t vocab) {
  const RowStats exact = row_stats_f32(a, vocab);
  if (float(exact.lse) == saved || std::fabs(saved) >= 1024.0f) return exact;
  return {double(saved), 0.0, double(saved), exact.argmax};
}

// Step 4 on a float32 row, as cross_entropy.
inline double cross_entropy_f32(const CeSetup& setup, const float* a, const RowStats& st,
                                int64_t y) {
  double ce = (1.0 - setup.eps) * omega_of(setup, y) * ((st.m - double(a[y])) + st.log_s);
  if (setup.eps > 0.0)
    ce += setup.eps / double(setup.vocab) *
          smooth_sum_f32(a, setup.vocab, st.m, st.log_s, setup.omega);
  return ce;
}

// The gradient of a float32 row into out (float32, may be a): gradient's formula with s = 1,
// regrouped per element as g · (A p_j + B ω_j),
//   A = t (k1 ((1−ε) ω_y + (ε/V) Ω) + kz1 2 λ lse),  B = −t k1 ε/V,
// and the target's element, which has the − (1−ε) ω_y on top, computed again in double.
inline void gradient_f32_row(const CeSetup& setup, const float* a, const RowStats& st, int64_t y,
                             const Upstream& up, double t, float* out) {
  const double target_weight = (1.0 - setup.eps) * omega_of(setup, y);
  const double smoothing = setup.eps / double(setup.vocab);
  const double z_loss = setup.lambda == 0.0 ? 0.0 : 2.0 * setup.lambda * st.lse;
  double A = up.k1 * (target_weight + smoothing * setup.Omega);
  if (z_loss != 0.0) A += up.kz1 * z_loss;
  double B = -up.k1 * smoothing;
  if (setup.token_scaling) A *= t, B *= t;
  const float g = float(up.g);
  const double a_y = a[y];  // read before out (maybe a) is written
  gradient_f32(a, setup.vocab, float(st.m), float(st.log_s), float(A), float(B), setup.omega, g,
               out);
  const double p = std::exp((a_y - st.m) - st.log_s);
  double d_ce = target_weight * (p - 1.0);
  if (smoothing != 0.0) d_ce += smoothing * (setup.Omega * p - omega_of(setup, y));
  double d_a = up.k1 * d_ce;
  if (z_loss != 0.0) d_a += up.kz1 * z_loss * p;
  if (setup.token_scaling) d_a *= t;
  out[y] = g * float(d_a);
}

// Elements [0, n) of a row of `dtype` at src, as float32 (exact).
inline void load_row_f32(int dtype, const void* src, int64_t n, float* dst) {
  if (dtype == FCE_FLOAT32) {
    std::memcpy(dst, src, size_t(n) * sizeof(float));
    return;
  }
  convert_row_to_float(dtype, src, n, dst);
}

// ------------------------------------------------------------- many rows ----

// Per-row results of a forward, indexed by problem row, reduced by write_reduction.
struct RowResults {
  std::vector<double> ce;        // ce_r (times t with token scaling): 0 ignored, NaN invalid
  std::vector<double> z_loss;    // zl_r: 0 for ignored rows (docs/semantics.md rules 7, 8)
  std::vector<uint8_t> correct;  // 1 when argmax_r == y_r (scored rows), else 0; empty: no accuracy
  RowResults(int64_t rows, bool accuracy)
      : ce(size_t(rows)), z_loss(size_t(rows)), correct(accuracy ? size_t(rows) : 0) {}
};

// Rows [first_row, first_row + count) of the problem. Logit and gradient pointers address the
// job's own rows (row i at logits + i * logits_stride elements); lse_in, lse_out, argmax and
// results are indexed by problem row.
struct RowsJob {
  int64_t first_row, count;
  const void* logits;
  int64_t logits_stride;
  int logits_dtype;
  void* grad;  // nullptr: no gradient
  int64_t grad_stride;
  int grad_dtype;
  const float* lse_in;           // fce_backward: the saved lse; nullptr: the row's own (m, log s)
  float* lse_out;                // forward, optional
  float* entropy_out = nullptr;  // forward, optional (rule 18)
  int64_t* argmax;               // forward, optional (−1 for ignored rows)
  RowResults* results;           // forward: ce, z-loss and accuracy per row; nullptr: gradient only
};

// One row per thread (float32 on the fast path, else double), allocated before any output is
// written.
struct RowScratch {
  int threads;
  std::vector<std::vector<double>> rows;
  std::vector<std::vector<float>> frows;
  RowScratch(const CeSetup& setup, int64_t max_count) {
    const int64_t vocab = setup.vocab;
    threads = thread_count(max_count, std::max<int64_t>(1, (int64_t(1) << 16) / vocab));
    if (float_path(setup)) frows.assign(size_t(threads), std::vector<float>(size_t(vocab)));
    else rows.assign(size_t(threads), std::vector<double>(size_t(vocab)));
  }
};

// run_rows' work on one row that is read, on the float32 path. Returns false when the gradient
// row is still to be filled (ignored and invalid rows).
inline bool float_row(const CeSetup& setup, const RowsJob& job, RowTarget t, int64_t r,
                      const void* z_row, void* grad_row, float* a) {
  const int64_t V = setup.vocab;
  RowResults* res = job.results;
  load_row_f32(job.logits_dtype, z_row, V, a);
  const RowStats st = job.lse_in ? saved_stats_f32(job.lse_in[r], a, V) : row_stats_f32(a, V);
  if (job.lse_out) job.lse_out[r] = float(st.lse);
  if (job.argmax && t.kind != RowKind::kIgnored) job.argmax[r] = st.argmax;
  const double tscale = setup.token_scaling && t.kind == RowKind::kScored
                            ? std::exp((double(a[t.y]) - st.m) - st.log_s)
                            : 1.0;
  if (res && t.kind == RowKind::kInvalid) {
    res->ce[size_t(r)] = std::numeric_limits<double>::quiet_NaN();
    res->z_loss[size_t(r)] = z_loss_term(setup, st.lse);
  } else if (res && t.kind == RowKind::kScored) {
    res->ce[size_t(r)] = tscale * cross_entropy_f32(setup, a, st, t.y);
    res->z_loss[size_t(r)] = scaled_z_loss_term(setup, tscale, st.lse);
    if (!res->correct.empty()) res->correct[size_t(r)] = st.argmax == t.y ? 1 : 0;
  }
  if (!(grad_row && t.kind == RowKind::kScored)) return false;
  const Upstream up = upstream_scales(setup, r);
  if (job.grad_dtype == FCE_FLOAT32) {
    gradient_f32_row(setup, a, st, t.y, up, tscale, static_cast<float*>(grad_row));
  } else {
    gradient_f32_row(setup, a, st, t.y, up, tscale, a);
    for (int64_t j = 0; j < V; ++j) store_float(job.grad_dtype, grad_row, j, a[j]);
  }
  return true;
}

// The job's rows, each read whole into the thread's buffer before its gradient is written (in
// place works). Returns true when some target was out of range.
inline bool run_rows(const CeSetup& setup, const RowsJob& job, RowScratch& scratch) {
  const int64_t V = setup.vocab;
  const size_t logits_size = dtype_size(job.logits_dtype), grad_size = dtype_size(job.grad_dtype);
  std::atomic<bool> invalid_seen{false};
  RowResults* res = job.results;
  const bool fast = float_path(setup);
  parallel_for(job.count, scratch.threads, [&](int64_t begin, int64_t end, int thread) {
    double* a = fast ? nullptr : scratch.rows[size_t(thread)].data();
    float* af = fast ? scratch.frows[size_t(thread)].data() : nullptr;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = job.first_row + i;
      const RowTarget t = row_target(setup, r);
      const void* z_row =
          static_cast<const char*>(job.logits) + size_t(i) * job.logits_stride * logits_size;
      void* grad_row = job.grad
                           ? static_cast<char*>(job.grad) + size_t(i) * job.grad_stride * grad_size
                           : nullptr;
      if (t.kind == RowKind::kInvalid) invalid_seen.store(true, std::memory_order_relaxed);
      if (res) {  // defaults: what an ignored row gets
        res->ce[size_t(r)] = 0.0;
        res->z_loss[size_t(r)] = 0.0;
        if (!res->correct.empty()) res->correct[size_t(r)] = 0;
      }
      if (job.argmax) job.argmax[r] = -1;

      // The row is read when it is scored, when a forward output needs its statistics (lse and
      // entropy of every row; z-loss and argmax of an invalid row), or for the lse and entropy
      // terms of an ignored row's gradient (rule 18), never for a gradient alone of an ignored
      // row without them or of an invalid row.
      const RowTerms terms = row_terms(setup, r);
      const bool ignored_terms = grad_row && t.kind == RowKind::kIgnored && terms.any();
      const bool read = t.kind == RowKind::kScored || job.lse_out || job.entropy_out ||
                        ignored_terms || (t.kind == RowKind::kInvalid && (res || job.argmax));
      if (read && fast) {
        if (float_row(setup, job, t, r, z_row, grad_row, af)) continue;
      } else if (read) {
        load_row(job.logits_dtype, z_row, V, a);
        scale_and_softcap(setup, a);  // steps 1, 2
        const RowStats st = job.lse_in ? saved_stats(job.lse_in[r], a, V) : row_stats(a, V);  // 3
        if (job.lse_out) job.lse_out[r] = float(st.lse);
        if (job.entropy_out) job.entropy_out[r] = float(st.entropy);
        if (job.argmax && t.kind != RowKind::kIgnored) job.argmax[r] = st.argmax;
        // Token scaling's t = p_y, a constant of the row (docs/semantics.md rules 8, 9).
        const double tscale =
            setup.token_scaling && t.kind == RowKind::kScored ? probability(st, a[t.y]) : 1.0;
        if (res && t.kind == RowKind::kInvalid) {
          res->ce[size_t(r)] = std::numeric_limits<double>::quiet_NaN();
          res->z_loss[size_t(r)] = z_loss_term(setup, st.lse);  // never scaled
        } else if (res && t.kind == RowKind::kScored) {
          res->ce[size_t(r)] = setup.soft ? soft_cross_entropy(setup, a, st, r)  // 4, rule 19
                                          : tscale * cross_entropy(setup, a, st, t.y);
          res->z_loss[size_t(r)] = scaled_z_loss_term(setup, tscale, st.lse);  // 5
          if (!res->correct.empty()) res->correct[size_t(r)] = st.argmax == t.y ? 1 : 0;
        }
        if ((grad_row && t.kind == RowKind::kScored) || ignored_terms) {
          const int64_t y = t.kind == RowKind::kScored ? t.y : -1;
          if (setup.soft) soft_gradient(setup, a, st, r, upstream_scales(setup, r), terms);
          else gradient(setup, a, st, y, upstream_scales(setup, r), tscale, terms);
          store_row(job.grad_dtype, a, V, grad_row);
          continue;
        }
      }
      if (grad_row) fill_row(job.grad_dtype, grad_row, V, t.kind == RowKind::kIgnored ? 0.0f : NAN);
    }
  });
  return invalid_seen.load();
}

// docs/semantics.md rules 5, 7 and 15: the loss, the z-loss total and the accuracy from the rows' values,
// summed in row order.
inline void write_reduction(const CeSetup& setup, const RowResults& res, float* loss, float* z_loss,
                            float* accuracy) {
  double loss_sum = 0.0, ce_sum = 0.0, z_loss_sum = 0.0, correct = 0.0;
  for (int64_t r = 0; r < setup.rows; ++r) {
    loss_sum += res.ce[size_t(r)] + res.z_loss[size_t(r)];
    ce_sum += res.ce[size_t(r)];
    z_loss_sum += res.z_loss[size_t(r)];
    if (!res.correct.empty()) correct += res.correct[size_t(r)];
  }
  const bool mean = setup.reduction == FCE_REDUCTION_MEAN;
  // Each quotient is 0 when its divisor is (a mean over no rows is 0), unless its sum is not
  // finite (an invalid row, a NaN or infinite term): class weights that cancel can make D 0
  // with rows counted.
  auto quotient = [](double sum, double divisor) {
    return divisor != 0.0 ? sum / divisor : std::isfinite(sum) ? 0.0 : sum;
  };
  const double ce_mean = quotient(ce_sum, setup.D);
  const double z_loss_mean = quotient(z_loss_sum, setup.n);
  switch (setup.reduction) {
    case FCE_REDUCTION_NONE:
      for (int64_t r = 0; r < setup.rows; ++r)
        loss[r] = float(res.ce[size_t(r)] + res.z_loss[size_t(r)]);
      break;
    case FCE_REDUCTION_SUM: loss[0] = float(loss_sum); break;
    default: loss[0] = float(ce_mean + z_loss_mean); break;
  }
  if (z_loss) z_loss[0] = float(mean ? z_loss_mean : z_loss_sum);
  if (accuracy && setup.reduction == FCE_REDUCTION_NONE) {
    for (int64_t r = 0; r < setup.rows; ++r) accuracy[r] = float(res.correct[size_t(r)]);
  } else if (accuracy) {
    accuracy[0] = setup.n == 0.0 ? 0.0f : float(correct / setup.n);
  }
}

}  // namespace cpu
}  // namespace fce
