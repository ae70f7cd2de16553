// ref.h — an independent float64 reference of fusedce, written from SPEC.md and
// lib/SEMANTICS.md (never from lib/): per-row loss, lse, gradient, the reductions, the z-loss
// total, and linear cross-entropy through a naive double matmul. Slow and obvious on purpose.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace fceref {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

enum Reduction { kMean = 0, kSum = 1, kNone = 2 };  // the values of fce_reduction

struct Options {
  int reduction = kMean;
  double label_smoothing = 0;  // epsilon
  double z_loss_scale = 0;     // lambda
  double softcap = 0;          // c (0 = off)
  double logit_scale = 1;      // s
  std::vector<double> class_weights;  // omega [V], empty = all 1
  int64_t ignore_index = -100;
  int64_t shift_seq_len = 0;   // T (0 = off)
};

enum RowKind { kValid, kIgnored, kInvalid };

struct CeResult {
  std::vector<RowKind> kind;       // [N]
  std::vector<int64_t> target;     // [N] the target each row is scored against
  std::vector<double> lse;         // [N], every row
  std::vector<double> row_loss;    // [N]: 0 ignored, NaN invalid
  double denominator = 0;          // D: sum of omega_y over valid rows + number of invalid rows
  double loss = 0;                 // reduced: mean / sum; for none the plain sum (unused)
  double z_loss = 0;               // lambda * sum lse^2 (non-ignored rows), / D for mean
  std::vector<double> grad;        // [N * V] dense dloss/dz (k applied), when asked for
};

// SEMANTICS.md rule 1-2-3: which target row r is scored against, and what kind of row it is.
inline RowKind row_kind(const Options& o, int64_t N, int64_t V, const std::vector<int64_t>& y,
                        int64_t r, int64_t* target) {
  int64_t t;
  if (o.shift_seq_len > 0) {
    if (r % o.shift_seq_len == o.shift_seq_len - 1) {
      *target = o.ignore_index;
      return kIgnored;
    }
    t = y[static_cast<size_t>(r + 1)];
  } else {
    t = y[static_cast<size_t>(r)];
  }
  (void)N;
  *target = t;
  if (t == o.ignore_index) return kIgnored;
  if (t < 0 || t >= V) return kInvalid;
  return kValid;
}

// Cross-entropy over dense logits z [N * V] (the values the library sees, already rounded to
// the input dtype). g: upstream gradient, nullptr = 1, else [1] (mean/sum) or [N] (none).
inline CeResult cross_entropy(const Options& o, int64_t N, int64_t V, const std::vector<double>& z,
                              const std::vector<int64_t>& y, const std::vector<double>* g,
                              bool want_grad) {
  CeResult res;
  res.kind.resize(static_cast<size_t>(N));
  res.target.resize(static_cast<size_t>(N));
  res.lse.resize(static_cast<size_t>(N));
  res.row_loss.assign(static_cast<size_t>(N), 0.0);
  const double eps = o.label_smoothing, lam = o.z_loss_scale, c = o.softcap, s = o.logit_scale;
  const bool weighted = !o.class_weights.empty();
  auto omega = [&](int64_t j) { return weighted ? o.class_weights[static_cast<size_t>(j)] : 1.0; };
  double Omega = 0;
  for (int64_t j = 0; j < V; ++j) Omega += omega(j);

  // Steps 1-2 of SPEC.md: a = s z, then a = c tanh(a / c).
  std::vector<double> a(static_cast<size_t>(N * V));
  for (size_t i = 0; i < a.size(); ++i) {
    double v = s * z[i];
    if (c > 0) v = c * std::tanh(v / c);
    a[i] = v;
  }

  double denom = 0, sum_loss = 0, sum_lse2 = 0;
  for (int64_t r = 0; r < N; ++r) {
    const double* ar = &a[static_cast<size_t>(r * V)];
    // Step 3: lse with a known max (all -inf -> -inf).
    double m = -HUGE_VAL;
    for (int64_t j = 0; j < V; ++j) m = std::max(m, ar[j]);
    double lse;
    if (m == -HUGE_VAL) {
      lse = -HUGE_VAL;
    } else {
      double se = 0;
      for (int64_t j = 0; j < V; ++j) se += std::exp(ar[j] - m);
      lse = m + std::log(se);
    }
    res.lse[static_cast<size_t>(r)] = lse;
    int64_t t;
    RowKind k = row_kind(o, N, V, y, r, &t);
    res.kind[static_cast<size_t>(r)] = k;
    res.target[static_cast<size_t>(r)] = t;
    if (k == kIgnored) continue;
    if (lam != 0) sum_lse2 += lse * lse;  // (lambda = 0: no z-loss at all, even for lse = -inf)
    if (k == kInvalid) {
      res.row_loss[static_cast<size_t>(r)] = kNaN;
      denom += 1;
      sum_loss += kNaN;
      continue;
    }
    // Step 4: torch's cross_entropy with weight, ignore_index and label_smoothing.
    double ce = (1 - eps) * omega(t) * (lse - ar[t]);
    if (eps != 0) {
      double sm = 0;
      for (int64_t j = 0; j < V; ++j) sm += omega(j) * (lse - ar[j]);
      ce += eps / static_cast<double>(V) * sm;
    }
    // Step 5: z-loss.
    double loss = lam != 0 ? ce + lam * lse * lse : ce;
    res.row_loss[static_cast<size_t>(r)] = loss;
    denom += omega(t);
    sum_loss += loss;
  }
  res.denominator = denom;
  if (o.reduction == kMean) {
    res.loss = denom == 0 ? 0.0 : sum_loss / denom;
    res.z_loss = denom == 0 ? 0.0 : lam * sum_lse2 / denom;
  } else {
    res.loss = sum_loss;
    res.z_loss = lam * sum_lse2;
  }
  if (!want_grad) return res;

  // The gradient (SEMANTICS.md rules 6 and 9).
  res.grad.assign(static_cast<size_t>(N * V), 0.0);
  for (int64_t r = 0; r < N; ++r) {
    RowKind kind = res.kind[static_cast<size_t>(r)];
    double* gr = &res.grad[static_cast<size_t>(r * V)];
    if (kind == kIgnored) continue;
    if (kind == kInvalid) {
      for (int64_t j = 0; j < V; ++j) gr[j] = kNaN;
      continue;
    }
    double gval;
    if (o.reduction == kNone) gval = g ? (*g)[static_cast<size_t>(r)] : 1.0;
    else gval = g ? (*g)[0] : 1.0;
    double k;
    if (o.reduction == kMean) k = denom == 0 ? 0.0 : gval / denom;
    else k = gval;
    const double* ar = &a[static_cast<size_t>(r * V)];
    const double lse = res.lse[static_cast<size_t>(r)];
    const int64_t t = res.target[static_cast<size_t>(r)];
    for (int64_t j = 0; j < V; ++j) {
      double p = std::exp(ar[j] - lse);
      double da = (1 - eps) * omega(t) * (p - (j == t ? 1.0 : 0.0)) +
                  eps / static_cast<double>(V) * (Omega * p - omega(j)) +
                  (lam != 0 ? 2 * lam * lse * p : 0.0);
      double dz = k * da * s;
      if (c > 0) dz *= 1 - (ar[j] / c) * (ar[j] / c);
      gr[j] = dz;
    }
  }
  return res;
}

struct LinearResult {
  std::vector<double> logits;  // [N * V] z = h W^T + b
  CeResult ce;                 // on those logits (ce.grad = dz)
  std::vector<double> grad_hidden;  // [N * D]  dz W
  std::vector<double> grad_weight;  // [V * D]  dz^T h
  std::vector<double> grad_bias;    // [V]      sum over rows of dz
};

// fce_linear_ce: h [N * D] dense, W [V * D], b [V] or empty; the naive double matmul.
inline LinearResult linear_cross_entropy(const Options& o, int64_t N, int64_t D, int64_t V,
                                         const std::vector<double>& h,
                                         const std::vector<double>& W,
                                         const std::vector<double>& b,
                                         const std::vector<int64_t>& y,
                                         const std::vector<double>* g, bool want_grad) {
  LinearResult res;
  res.logits.assign(static_cast<size_t>(N * V), 0.0);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t v = 0; v < V; ++v) {
      double acc = b.empty() ? 0.0 : b[static_cast<size_t>(v)];
      for (int64_t d = 0; d < D; ++d)
        acc += h[static_cast<size_t>(r * D + d)] * W[static_cast<size_t>(v * D + d)];
      res.logits[static_cast<size_t>(r * V + v)] = acc;
    }
  res.ce = cross_entropy(o, N, V, res.logits, y, g, want_grad);
  if (!want_grad) return res;
  const std::vector<double>& dz = res.ce.grad;
  res.grad_hidden.assign(static_cast<size_t>(N * D), 0.0);
  res.grad_weight.assign(static_cast<size_t>(V * D), 0.0);
  res.grad_bias.assign(static_cast<size_t>(V), 0.0);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t v = 0; v < V; ++v) {
      double gz = dz[static_cast<size_t>(r * V + v)];
      res.grad_bias[static_cast<size_t>(v)] += gz;
      for (int64_t d = 0; d < D; ++d) {
        res.grad_hidden[static_cast<size_t>(r * D + d)] += gz * W[static_cast<size_t>(v * D + d)];
        res.grad_weight[static_cast<size_t>(v * D + d)] += gz * h[static_cast<size_t>(r * D + d)];
      }
    }
  return res;
}

}  // namespace fceref
