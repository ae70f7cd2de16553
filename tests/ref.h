// ref.h — an independent float64 reference of fusedce, written from
// docs/semantics.md (never from lib/): per-row loss, lse, gradient, argmax, the reductions, the
// z-loss total, the accuracy, and linear cross-entropy through a naive double matmul. Slow and
// obvious on purpose.
//
// Exact on adversarial rows too: every row is reduced in long double to its maximum m and
// log s (s = Σ_j exp(a_j − m)) kept apart (docs/semantics.md rules 8, 9), never through a rounded lse, so a
// row whose logits share a huge offset (all −1e30, all 3e38) loses nothing; log s is
// log1p(Σ over the entries but the first maximum), so that a confident row's tiny loss and its
// gradient p_y − 1 = expm1(log p_y) keep their digits.
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
  int64_t shift = 0;           // k with T > 0 (0 means 1)
  bool token_scaling = false;  // each scored row's ce and z-loss (and gradient) times p_y
};

enum RowKind { kValid, kIgnored, kInvalid };

struct CeResult {
  std::vector<RowKind> kind;       // [N]
  std::vector<int64_t> target;     // [N] the target each row is scored against
  std::vector<double> a;           // [N * V] the scaled, capped logits
  std::vector<double> m, log_s;    // [N] the row maximum and log Σ exp(a − m) (NaN: NaN row)
  std::vector<double> lse;         // [N], every row: m + log s
  std::vector<double> t;           // [N] token scale p_y of valid rows with token scaling, else 1
  std::vector<double> row_ce;      // [N] ce_r (times t): 0 ignored, NaN invalid
  std::vector<double> row_zl;      // [N] lambda lse_r^2 (times t for valid rows): 0 ignored
  std::vector<double> row_loss;    // [N] ce_r + zl_r: 0 ignored, NaN invalid
  std::vector<int64_t> argmax;     // [N] first NaN, else the lowest maximal index; -1 ignored
  std::vector<double> correct;     // [N] 1 where a valid row's argmax is its target, else 0
  double denominator = 0;          // D: sum of omega_y over valid rows + number of invalid rows
  double count = 0;                // n: the number of non-ignored rows
  double loss = 0;                 // reduced: mean / sum; for none the plain sum (unused)
  double z_loss = 0;               // sum of zl_r (non-ignored rows), / n for mean
  double accuracy = 0;             // mean / sum: sum of correct / n (0 when n == 0)
  std::vector<double> grad;        // [N * V] dense dloss/dz (upstream applied), when asked for
};

// docs/semantics.md rules 1-3: which target row r is scored against, and what kind of row it is.
inline RowKind row_kind(const Options& o, int64_t N, int64_t V, const std::vector<int64_t>& y,
                        int64_t r, int64_t* target) {
  (void)N;
  int64_t t;
  if (o.shift_seq_len > 0) {
    const int64_t k = o.shift > 0 ? o.shift : 1;
    if (r % o.shift_seq_len >= o.shift_seq_len - k) {  // no target in the sequence: never read
      *target = o.ignore_index;
      return kIgnored;
    }
    t = y[static_cast<size_t>(r + k)];
  } else {
    t = y[static_cast<size_t>(r)];
  }
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
  typedef long double LD;
  const size_t n_rows = static_cast<size_t>(N);
  CeResult res;
  res.kind.resize(n_rows);
  res.target.resize(n_rows);
  res.m.resize(n_rows);
  res.log_s.resize(n_rows);
  res.lse.resize(n_rows);
  res.t.assign(n_rows, 1.0);
  res.row_ce.assign(n_rows, 0.0);
  res.row_zl.assign(n_rows, 0.0);
  res.row_loss.assign(n_rows, 0.0);
  res.argmax.assign(n_rows, -1);
  res.correct.assign(n_rows, 0.0);
  const LD eps = o.label_smoothing, lam = o.z_loss_scale, c = o.softcap, s = o.logit_scale;
  const bool weighted = !o.class_weights.empty();
  auto omega = [&](int64_t j) -> LD {
    return weighted ? static_cast<LD>(o.class_weights[static_cast<size_t>(j)]) : 1.0L;
  };
  LD Omega = 0;
  for (int64_t j = 0; j < V; ++j) Omega += omega(j);

  // Steps 1-2 of docs/semantics.md: a = s z, then a = c tanh(a / c).
  std::vector<LD> a(static_cast<size_t>(N * V));
  res.a.resize(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    LD v = s * static_cast<LD>(z[i]);
    if (c > 0) v = c * std::tanh(v / c);
    a[i] = v;
    res.a[i] = static_cast<double>(v);
  }

  // Step 3 per row: m, log s, lse, the argmax (docs/semantics.md rules 8, 10, 15).
  std::vector<LD> M(n_rows), LS(n_rows);
  for (int64_t r = 0; r < N; ++r) {
    const LD* ar = &a[static_cast<size_t>(r * V)];
    int64_t first_nan = -1, first_max = 0;
    LD m = -HUGE_VALL;
    for (int64_t j = 0; j < V; ++j) {
      if (std::isnan(ar[j])) {
        first_nan = j;
        break;
      }
      if (ar[j] > m) m = ar[j], first_max = j;
    }
    LD log_s;
    if (first_nan >= 0) {
      m = log_s = static_cast<LD>(kNaN);
    } else if (m == HUGE_VALL) {
      // A +inf maximum: its own term is exp(+inf − +inf) = NaN, so log s and lse are NaN, as
      // torch's log_softmax makes every log-probability of the row NaN (rule 10).
      log_s = static_cast<LD>(kNaN);
    } else {
      // An entry equal to m counts exp(0) = 1 (also when m is −inf: a row of −inf has s = V,
      // lse = −inf).
      LD rest = 0;
      for (int64_t j = 0; j < V; ++j)
        if (j != first_max) rest += ar[j] == m ? 1.0L : std::exp(ar[j] - m);
      log_s = std::log1p(rest);
    }
    M[static_cast<size_t>(r)] = m;
    LS[static_cast<size_t>(r)] = log_s;
    res.m[static_cast<size_t>(r)] = static_cast<double>(m);
    res.log_s[static_cast<size_t>(r)] = static_cast<double>(log_s);
    res.lse[static_cast<size_t>(r)] = static_cast<double>(m + log_s);
    int64_t t;
    const RowKind k = row_kind(o, N, V, y, r, &t);
    res.kind[static_cast<size_t>(r)] = k;
    res.target[static_cast<size_t>(r)] = t;
    if (k != kIgnored) res.argmax[static_cast<size_t>(r)] = first_nan >= 0 ? first_nan : first_max;
  }

  // Steps 4-5 per row, and the reductions (docs/semantics.md rules 4, 5, 7, 8, 15).
  LD D = 0, n = 0, sum_ce = 0, sum_zl = 0, sum_correct = 0;
  for (int64_t r = 0; r < N; ++r) {
    const size_t ri = static_cast<size_t>(r);
    const RowKind k = res.kind[ri];
    if (k == kIgnored) continue;
    const LD* ar = &a[static_cast<size_t>(r * V)];
    const LD m = M[ri], log_s = LS[ri], lse = m + log_s;
    n += 1;
    const LD zl = lam != 0 ? lam * lse * lse : 0.0L;  // (lambda = 0: none, even for lse = -inf)
    if (k == kInvalid) {
      D += 1;
      res.row_ce[ri] = kNaN;
      res.row_zl[ri] = static_cast<double>(zl);  // never scaled
      res.row_loss[ri] = kNaN;
      sum_ce += static_cast<LD>(kNaN);
      sum_zl += zl;
      continue;
    }
    const int64_t t = res.target[ri];
    // Token scaling's t = p_y, a constant (docs/semantics.md rule 8).
    const LD ts = o.token_scaling ? std::exp((ar[t] - m) - log_s) : 1.0L;
    LD ce = (1 - eps) * omega(t) * ((m - ar[t]) + log_s);
    if (eps != 0) {
      LD sm = 0;
      for (int64_t j = 0; j < V; ++j) sm += omega(j) * ((m - ar[j]) + log_s);
      ce += eps / static_cast<LD>(V) * sm;
    }
    res.t[ri] = static_cast<double>(ts);
    res.row_ce[ri] = static_cast<double>(ts * ce);
    const LD tzl = lam != 0 ? ts * zl : 0.0L;  // (lambda = 0: none, even for p_y NaN)
    res.row_zl[ri] = static_cast<double>(tzl);
    res.row_loss[ri] = static_cast<double>(ts * ce + tzl);
    D += omega(t);
    sum_ce += ts * ce;
    sum_zl += tzl;
    if (res.argmax[ri] == t) {
      res.correct[ri] = 1.0;
      sum_correct += 1;
    }
  }
  res.denominator = static_cast<double>(D);
  res.count = static_cast<double>(n);
  res.accuracy = n == 0 ? 0.0 : static_cast<double>(sum_correct / n);
  if (o.reduction == kMean) {
    // 0 over a zero divisor unless the sum is not finite (class weights that cancel: D = 0
    // with rows counted)
    auto quotient = [](long double sum, long double divisor) {
      return divisor != 0 ? sum / divisor : std::isfinite(sum) ? 0.0L : sum;
    };
    res.loss = static_cast<double>(quotient(sum_ce, D) + quotient(sum_zl, n));
    res.z_loss = n == 0 ? 0.0 : static_cast<double>(sum_zl / n);
  } else {
    res.loss = static_cast<double>(sum_ce + sum_zl);
    res.z_loss = static_cast<double>(sum_zl);
  }
  if (!want_grad) return res;

  // The gradient (docs/semantics.md rules 6 and 9).
  res.grad.assign(static_cast<size_t>(N * V), 0.0);
  for (int64_t r = 0; r < N; ++r) {
    const size_t ri = static_cast<size_t>(r);
    const RowKind kind = res.kind[ri];
    double* gr = &res.grad[static_cast<size_t>(r * V)];
    if (kind == kIgnored) continue;
    if (kind == kInvalid) {
      for (int64_t j = 0; j < V; ++j) gr[j] = kNaN;
      continue;
    }
    LD gval;
    if (o.reduction == kNone) gval = g ? (*g)[ri] : 1.0;
    else gval = g ? (*g)[0] : 1.0;
    LD k, kz;
    if (o.reduction == kMean) {
      k = D == 0 ? 0.0L : gval / D;
      kz = n == 0 ? 0.0L : gval / n;
    } else {
      k = kz = gval;
    }
    const LD* ar = &a[static_cast<size_t>(r * V)];
    const LD m = M[ri], log_s = LS[ri], lse = m + log_s, ts = res.t[ri];
    const int64_t t = res.target[ri];
    for (int64_t j = 0; j < V; ++j) {
      const LD x = (ar[j] - m) - log_s;  // log p_j
      const LD p = std::exp(x);
      const LD p_minus_target = j == t ? std::expm1(x) : p;  // p_j − [j = y], without cancelling
      const LD dce = (1 - eps) * omega(t) * p_minus_target +
                     eps / static_cast<LD>(V) * (Omega * p - omega(j));
      const LD dzl = lam != 0 ? 2 * lam * lse * p : 0.0L;
      LD dz = ts * (k * dce + kz * dzl) * s;
      if (c > 0) dz *= 1 - (ar[j] / c) * (ar[j] / c);
      gr[j] = static_cast<double>(dz);
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

// The gradients over h, W and b of a function of the logits z = h W^T + b whose gradient over
// z is dz [N * V] (the loss's, or the loss's plus other terms): res.grad_hidden, grad_weight,
// grad_bias.
inline void linear_backward(int64_t N, int64_t D, int64_t V, const std::vector<double>& h,
                            const std::vector<double>& W, const std::vector<double>& dz,
                            LinearResult& res) {
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
}

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
  if (want_grad) linear_backward(N, D, V, h, W, res.ce.grad, res);
  return res;
}

}  // namespace fceref
