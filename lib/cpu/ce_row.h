// ce_row.h — the cross-entropy of one row, SPEC.md "The loss, row by row" and "The gradient"
// step by step, in double, with the corner cases of SEMANTICS.md; shared by ce.cpp (logits given)
// and linear_ce.cpp (logits made chunk by chunk). Rows are independent, so they run on threads
// (parallel_for); the reduction over rows is sequential, in row order: deterministic.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"

namespace fce {
namespace cpu {

// ------------------------------------------------------------ once per call ----

// What every row shares: the options as the SPEC names them, Ω and the mean's denominator D.
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
  const void* targets;  // y [N]
  bool targets_int64;
  int reduction;
  const float* grad_output;  // g: [1] (mean, sum) or [N] (none); nullptr = 1
  double D;                  // SEMANTICS 4
};

enum class RowKind { kScored, kIgnored, kInvalid };

struct RowTarget {
  RowKind kind;
  int64_t y;  // the class, when kind == kScored
};

inline double omega_of(const CeSetup& setup, int64_t j) {
  return setup.omega ? double(setup.omega[j]) : 1.0;
}

// SEMANTICS 1-3: the target row r is scored against, or why it is not.
inline RowTarget row_target(const CeSetup& setup, int64_t r) {
  int64_t source = r;
  if (setup.T > 0) {
    if (r % setup.T == setup.T - 1) return {RowKind::kIgnored, 0};
    source = r + 1;
  }
  const int64_t y = setup.targets_int64
                        ? static_cast<const int64_t*>(setup.targets)[source]
                        : int64_t(static_cast<const int32_t*>(setup.targets)[source]);
  if (y == setup.ignore_index) return {RowKind::kIgnored, 0};
  if (y < 0 || y >= setup.vocab) return {RowKind::kInvalid, 0};
  return {RowKind::kScored, y};
}

// SEMANTICS 4: D = Σ ω_{y_r} over scored rows + the number of invalid rows, in row order.
inline double denominator(const CeSetup& setup) {
  double D = 0.0;
  for (int64_t r = 0; r < setup.rows; ++r) {
    const RowTarget t = row_target(setup, r);
    if (t.kind == RowKind::kScored) D += omega_of(setup, t.y);
    if (t.kind == RowKind::kInvalid) D += 1.0;
  }
  return D;
}

inline CeSetup make_setup(const CeOptions& opt, int64_t rows, int64_t vocab, const void* targets,
                          const float* grad_output) {
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
  setup.targets = targets;
  setup.targets_int64 = opt.targets_int64;
  setup.reduction = opt.reduction;
  setup.grad_output = grad_output;
  setup.D = denominator(setup);
  return setup;
}

// SEMANTICS 6: k = g / D (mean; 0 when D == 0), g (sum), g_r (none).
inline double upstream_scale(const CeSetup& setup, int64_t r) {
  const bool per_row = setup.reduction == FCE_REDUCTION_NONE;
  const double g = setup.grad_output ? double(setup.grad_output[per_row ? r : 0]) : 1.0;
  if (setup.reduction == FCE_REDUCTION_MEAN) return setup.D == 0.0 ? 0.0 : g / setup.D;
  return g;
}

// ------------------------------------------------------------- row by row ----

// Steps 1 and 2, in place: a_j = s · z_j, then a_j = c · tanh(a_j / c) when c > 0.
inline void scale_and_softcap(const CeSetup& setup, double* a) {
  for (int64_t j = 0; j < setup.vocab; ++j) {
    a[j] = setup.s * a[j];
    if (setup.c > 0.0) a[j] = setup.c * std::tanh(a[j] / setup.c);
  }
}

// Step 3: lse = log Σ_j exp(a_j), from the row maximum (never overflows). A row of −inf gives
// −inf; a NaN anywhere gives NaN.
inline double log_sum_exp(const double* a, int64_t vocab) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  double max = -kInf;
  bool nan = false;
  for (int64_t j = 0; j < vocab; ++j) {
    if (std::isnan(a[j]))
      nan = true;
    else if (a[j] > max)
      max = a[j];
  }
  if (nan) return std::numeric_limits<double>::quiet_NaN();
  if (std::isinf(max)) return max;  // all −inf, or a +inf entry
  double sum = 0.0;
  for (int64_t j = 0; j < vocab; ++j) sum += std::exp(a[j] - max);
  return max + std::log(sum);
}

// Step 4: ce = (1 − ε) ω_y (lse − a_y) + (ε / V) Σ_j ω_j (lse − a_j). The smoothing sum is
// skipped when ε == 0 (so that a −inf entry does not make 0 · inf).
inline double cross_entropy(const CeSetup& setup, const double* a, double lse, int64_t y) {
  double ce = (1.0 - setup.eps) * omega_of(setup, y) * (lse - a[y]);
  if (setup.eps > 0.0) {
    double smooth = 0.0;
    for (int64_t j = 0; j < setup.vocab; ++j) smooth += omega_of(setup, j) * (lse - a[j]);
    ce += setup.eps / double(setup.vocab) * smooth;
  }
  return ce;
}

// Step 5's z-loss term λ · lse² (0 when λ == 0, whatever lse is).
inline double z_loss_term(const CeSetup& setup, double lse) {
  return setup.lambda == 0.0 ? 0.0 : setup.lambda * lse * lse;
}

// The gradient, in place: a_j in, ∂loss/∂z_j out, with p_j = exp(a_j − lse):
//   ∂loss/∂a_j = (1−ε) ω_y (p_j − [j = y]) + (ε/V)(Ω p_j − ω_j) + 2 λ lse p_j
//   ∂loss/∂z_j = k · ∂loss/∂a_j · s · (1 − (a_j / c)²)   (the last factor only with softcap)
inline void gradient(const CeSetup& setup, double* a, double lse, int64_t y, double k) {
  const double target_weight = (1.0 - setup.eps) * omega_of(setup, y);
  const double smoothing = setup.eps / double(setup.vocab);
  const double z_loss = setup.lambda == 0.0 ? 0.0 : 2.0 * setup.lambda * lse;
  for (int64_t j = 0; j < setup.vocab; ++j) {
    const double p = std::exp(a[j] - lse);
    double d_a = target_weight * (p - (j == y ? 1.0 : 0.0));
    if (smoothing != 0.0) d_a += smoothing * (setup.Omega * p - omega_of(setup, j));
    if (z_loss != 0.0) d_a += z_loss * p;
    double d_z = k * d_a * setup.s;
    if (setup.c > 0.0) d_z *= 1.0 - (a[j] / setup.c) * (a[j] / setup.c);
    a[j] = d_z;
  }
}

// fce_backward's lse: the saved value, except that when it is exactly what fce_forward stored
// (the float32 rounding of the double lse recomputed here), the double itself is used, so that
// the gradient is bit for bit fce_forward's (SEMANTICS 12) and as accurate.
inline double saved_lse(float saved, const double* a, int64_t vocab) {
  const double exact = log_sum_exp(a, vocab);
  return float(exact) == saved ? exact : double(saved);
}

// ------------------------------------------------------------- many rows ----

// Rows [first_row, first_row + count) of the problem. Logit and gradient pointers address the
// job's own rows (row i at logits + i * logits_stride elements); lse_in, lse_out, row_loss and
// row_z_loss are indexed by problem row.
struct RowsJob {
  int64_t first_row, count;
  const void* logits;
  int64_t logits_stride;
  int logits_dtype;
  void* grad;  // nullptr: no gradient
  int64_t grad_stride;
  int grad_dtype;
  const float* lse_in;  // backward: the saved lse; nullptr: forward
  float* lse_out;       // forward, optional
  double* row_loss;     // forward: loss_r (0 ignored, NaN invalid)
  double* row_z_loss;   // forward: λ lse_r², 0 for ignored rows (SEMANTICS 7)
};

// One double row per thread, allocated before any output is written.
struct RowScratch {
  int threads;
  std::vector<std::vector<double>> rows;
  RowScratch(int64_t vocab, int64_t max_count) {
    threads = thread_count(max_count, std::max<int64_t>(1, (int64_t(1) << 16) / vocab));
    rows.assign(size_t(threads), std::vector<double>(size_t(vocab)));
  }
};

// Forward or backward over the job's rows; returns true when some target was out of range.
// Each row is read whole into the thread's buffer before its gradient is written: in place works.
inline bool run_rows(const CeSetup& setup, const RowsJob& job, RowScratch& scratch) {
  const int64_t V = setup.vocab;
  const size_t logits_size = dtype_size(job.logits_dtype), grad_size = dtype_size(job.grad_dtype);
  std::atomic<bool> invalid_seen{false};
  parallel_for(job.count, scratch.threads, [&](int64_t begin, int64_t end, int thread) {
    double* a = scratch.rows[size_t(thread)].data();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = job.first_row + i;
      const RowTarget t = row_target(setup, r);
      const void* z_row =
          static_cast<const char*>(job.logits) + size_t(i) * job.logits_stride * logits_size;
      void* grad_row = job.grad
                           ? static_cast<char*>(job.grad) + size_t(i) * job.grad_stride * grad_size
                           : nullptr;
      if (t.kind == RowKind::kInvalid) invalid_seen.store(true, std::memory_order_relaxed);

      const bool forward = job.lse_in == nullptr;
      const bool need_lse = t.kind != RowKind::kIgnored || (forward && job.lse_out);
      const bool backward_invalid = !forward && t.kind == RowKind::kInvalid;
      if (!need_lse || backward_invalid) {  // no need to read the row
        if (forward) {
          job.row_loss[r] = 0.0;
          job.row_z_loss[r] = 0.0;
        }
        if (grad_row)
          fill_row(job.grad_dtype, grad_row, V, t.kind == RowKind::kIgnored ? 0.0f : NAN);
        continue;
      }

      load_row(job.logits_dtype, z_row, V, a);
      scale_and_softcap(setup, a);  // steps 1, 2
      const double lse = forward ? log_sum_exp(a, V) : saved_lse(job.lse_in[r], a, V);  // 3
      if (forward) {
        if (job.lse_out) job.lse_out[r] = float(lse);
        switch (t.kind) {
          case RowKind::kIgnored:
            job.row_loss[r] = 0.0;
            job.row_z_loss[r] = 0.0;
            break;
          case RowKind::kInvalid:
            job.row_loss[r] = std::numeric_limits<double>::quiet_NaN();
            job.row_z_loss[r] = z_loss_term(setup, lse);
            break;
          case RowKind::kScored:
            job.row_z_loss[r] = z_loss_term(setup, lse);
            job.row_loss[r] = cross_entropy(setup, a, lse, t.y) + job.row_z_loss[r];  // 4, 5
            break;
        }
      }
      if (!grad_row) continue;
      if (t.kind != RowKind::kScored) {
        fill_row(job.grad_dtype, grad_row, V, t.kind == RowKind::kIgnored ? 0.0f : NAN);
        continue;
      }
      gradient(setup, a, lse, t.y, upstream_scale(setup, r));
      store_row(job.grad_dtype, a, V, grad_row);
    }
  });
  return invalid_seen.load();
}

// SEMANTICS 5 and 7: the loss (and the z-loss total) from the rows' values, summed in row order.
inline void write_reduction(const CeSetup& setup, const double* row_loss, const double* row_z_loss,
                            float* loss, float* z_loss) {
  double loss_sum = 0.0, z_loss_sum = 0.0;
  for (int64_t r = 0; r < setup.rows; ++r) {
    loss_sum += row_loss[r];
    z_loss_sum += row_z_loss[r];
  }
  switch (setup.reduction) {
    case FCE_REDUCTION_NONE:
      for (int64_t r = 0; r < setup.rows; ++r) loss[r] = float(row_loss[r]);
      break;
    case FCE_REDUCTION_SUM: loss[0] = float(loss_sum); break;
    default: loss[0] = setup.D == 0.0 ? 0.0f : float(loss_sum / setup.D); break;
  }
  if (z_loss) {
    const bool mean = setup.reduction == FCE_REDUCTION_MEAN;
    z_loss[0] = !mean ? float(z_loss_sum) : setup.D == 0.0 ? 0.0f : float(z_loss_sum / setup.D);
  }
}

}  // namespace cpu
}  // namespace fce
