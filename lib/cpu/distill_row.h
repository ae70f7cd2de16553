// distill_row.h — the distillation of one row against its teacher row (docs/semantics.md rule
// 20) step by step in double, rows on threads, the reduction in row order; shared by distill.cpp
// (logits given) and linear_distill.cpp (logits made chunk by chunk). Everything is relative to
// the row maxima: log p_j = (u_j − m) − log s, never exp of a raw logit.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ce_row.h"
#include "distill.h"

namespace fce {
namespace cpu {

// What every row shares: the options as rule 20 names them and the mean's divisor n.
struct DistillSetup {
  int64_t rows, vocab;
  double s, c, T, beta;
  int divergence;
  const void* targets;  // nullptr: every row counts
  bool targets_int64;
  int64_t ignore_index;
  int reduction;
  const float* grad_output;  // nullptr = 1
  double n;                  // counted rows
};

inline bool row_counted(const DistillSetup& d, int64_t r) {
  if (!d.targets) return true;
  const int64_t y = d.targets_int64 ? static_cast<const int64_t*>(d.targets)[r]
                                    : int64_t(static_cast<const int32_t*>(d.targets)[r]);
  return y != d.ignore_index;
}

inline DistillSetup make_distill_setup(const DistillOptions& opt, int64_t rows, int64_t vocab,
                                       const void* targets, const float* grad_output) {
  DistillSetup d;
  d.rows = rows;
  d.vocab = vocab;
  d.s = opt.logit_scale;
  d.c = opt.softcap;
  d.T = opt.temperature;
  d.beta = opt.beta;
  d.divergence = opt.divergence;
  d.targets = targets;
  d.targets_int64 = opt.targets_int64;
  d.ignore_index = opt.ignore_index;
  d.reduction = opt.reduction;
  d.grad_output = grad_output;
  d.n = 0.0;
  for (int64_t r = 0; r < rows; ++r) d.n += row_counted(d, r) ? 1.0 : 0.0;
  return d;
}

// The divergence rule 20 computes: JSD at β = 0 and β = 1 is Liger's forward and reverse KL.
enum class Div { kForward, kReverse, kJsd };
inline Div effective_divergence(const DistillSetup& d) {
  if (d.divergence == FCE_DIVERGENCE_FORWARD_KL) return Div::kForward;
  if (d.divergence == FCE_DIVERGENCE_REVERSE_KL) return Div::kReverse;
  return d.beta == 0.0 ? Div::kForward : d.beta == 1.0 ? Div::kReverse : Div::kJsd;
}

// u_j = (c · tanh(s · z_j / c), or s · z_j without a cap) / T, in place.
inline void transform_row(const DistillSetup& d, double* u) {
  scale_and_softcap(d.s, d.c, u, d.vocab);
  for (int64_t j = 0; j < d.vocab; ++j) u[j] /= d.T;
}

// log(e^x + e^y) without overflow; −inf when both are −inf.
inline double log_add_exp(double x, double y) {
  const double hi = std::max(x, y), lo = std::min(x, y);
  if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::quiet_NaN();
  if (hi == -std::numeric_limits<double>::infinity()) return hi;
  return hi + std::log1p(std::exp(lo - hi));
}

// x · (log x − log y) term by term: 0 where x is 0 (0 · log 0 = 0), whatever log y is.
inline double kl_term(double x, double log_x, double log_y) {
  return x == 0.0 ? 0.0 : x * (log_x - log_y);
}

// The JSD's log m_j = log(β q_j + (1 − β) p_j) from the logs (rule 20).
inline double log_mix(double b, double lqj, double lpj) {
  return log_add_exp(std::log(b) + lqj, std::log1p(-b) + lpj);
}

// ∂loss/∂u_j from log p_j, log q_j and the row's correction k: forward p − q; reverse
// p (log p − log q − KL); JSD (1−β) p (log p − log m − K), K = KL(p || m); 0 where p_j = 0.
inline double distill_du(Div div, double b, double lpj, double lqj, double k) {
  const double pj = std::exp(lpj);
  switch (div) {
    case Div::kForward: return pj - std::exp(lqj);
    case Div::kReverse: return pj == 0.0 ? 0.0 : pj * ((lpj - lqj) - k);
    case Div::kJsd: return pj == 0.0 ? 0.0 : (1.0 - b) * pj * ((lpj - log_mix(b, lqj, lpj)) - k);
  }
  return 0.0;
}

// ∂u/∂z = s (1 − (a/c)²) / T at the transformed u_j (a = u_j · T, the capped logit).
inline double distill_chain(const DistillSetup& d, double uj) {
  double chain = d.s / d.T;
  if (d.c > 0.0) {
    const double a = uj * d.T;
    chain *= 1.0 - (a / d.c) * (a / d.c);
  }
  return chain;
}

// One row: u (the student's z, transformed in place, then its gradient ∂loss_r/∂z for an
// upstream 1 when grad is true), v (the teacher's z, transformed in place). Returns loss_r;
// *lse the student's lse of a / T.
inline double distill_row(const DistillSetup& d, double* u, double* v, bool grad, double* lse) {
  transform_row(d, u);
  transform_row(d, v);
  const RowStats sp = row_stats(u, d.vocab), sq = row_stats(v, d.vocab);
  *lse = sp.lse;
  const int64_t V = d.vocab;
  auto lp = [&](int64_t j) { return (u[j] - sp.m) - sp.log_s; };
  auto lq = [&](int64_t j) { return (v[j] - sq.m) - sq.log_s; };
  const Div div = effective_divergence(d);
  const double b = d.beta;
  double loss = 0.0, k = 0.0;  // k: Σ_j ∂loss/∂log p_j, the softmax's correction
  for (int64_t j = 0; j < V; ++j) {
    const double lpj = lp(j), lqj = lq(j);
    const double pj = std::exp(lpj), qj = std::exp(lqj);
    switch (div) {
      case Div::kForward: loss += kl_term(qj, lqj, lpj); break;
      case Div::kReverse: loss += kl_term(pj, lpj, lqj); break;
      case Div::kJsd: {
        const double lm = log_mix(b, lqj, lpj);
        loss += b * kl_term(qj, lqj, lm) + (1.0 - b) * kl_term(pj, lpj, lm);
        k += kl_term(pj, lpj, lm);
        break;
      }
    }
  }
  if (div == Div::kReverse) k = loss;
  if (!grad) return loss;
  // ∂loss/∂u_j (distill_du), then ∂u/∂z (distill_chain).
  for (int64_t j = 0; j < V; ++j)
    u[j] = distill_du(div, b, lp(j), lq(j), k) * distill_chain(d, u[j]);
  return loss;
}

// The upstream factor of row r's gradient: g / n for mean (0 when n is 0), g for sum and none.
inline double distill_upstream(const DistillSetup& d, int64_t r) {
  const bool per_row = d.reduction == FCE_REDUCTION_NONE;
  const double g = d.grad_output ? double(d.grad_output[per_row ? r : 0]) : 1.0;
  if (d.reduction != FCE_REDUCTION_MEAN) return g;
  return d.n == 0.0 ? 0.0 : g / d.n;
}

// Rows [first, first + count): student and teacher rows of their dtypes (row i at base + i *
// stride elements), the gradient (may be the student rows: in place) of grad_dtype or none.
// losses [rows] (0 for rows not counted) and lse (optional [rows]) by problem row.
struct DistillRows {
  int64_t first, count;
  const void* student;
  int64_t student_stride;
  const void* teacher;
  int64_t teacher_stride;
  int dtype;  // of student and teacher
  void* grad;
  int64_t grad_stride;
  int grad_dtype;
  std::vector<double>* losses;
  float* lse;
};

// Two double rows per thread, allocated before any output is written.
struct DistillScratch {
  int threads;
  std::vector<std::vector<double>> u, v;
  DistillScratch(int64_t vocab, int64_t max_count) {
    threads = thread_count(max_count, std::max<int64_t>(1, (int64_t(1) << 15) / vocab));
    u.assign(size_t(threads), std::vector<double>(size_t(vocab)));
    v.assign(size_t(threads), std::vector<double>(size_t(vocab)));
  }
};

inline void run_distill_rows(const DistillSetup& d, const DistillRows& job,
                             DistillScratch& scratch) {
  const size_t esize = dtype_size(job.dtype), gsize = dtype_size(job.grad_dtype);
  parallel_for(job.count, scratch.threads, [&](int64_t begin, int64_t end, int t) {
    double* u = scratch.u[size_t(t)].data();
    double* v = scratch.v[size_t(t)].data();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = job.first + i;
      load_row(job.dtype,
               static_cast<const char*>(job.student) + size_t(i) * job.student_stride * esize,
               d.vocab, u);
      load_row(job.dtype,
               static_cast<const char*>(job.teacher) + size_t(i) * job.teacher_stride * esize,
               d.vocab, v);
      const bool counted = row_counted(d, r);
      double lse = 0.0;
      const double loss = distill_row(d, u, v, counted && job.grad, &lse);
      (*job.losses)[size_t(r)] = counted ? loss : 0.0;
      if (job.lse) job.lse[r] = float(lse);
      if (!job.grad) continue;
      void* g = static_cast<char*>(job.grad) + size_t(i) * job.grad_stride * gsize;
      if (!counted) {
        fill_row(job.grad_dtype, g, d.vocab, 0.0f);
        continue;
      }
      const double k = distill_upstream(d, r);
      for (int64_t j = 0; j < d.vocab; ++j) u[j] *= k;
      store_row(job.grad_dtype, u, d.vocab, g);
    }
  });
}

// The loss output: [rows] for none, else the sum in row order, divided by n for mean (0 over
// no counted row unless the sum is not finite).
inline void write_distill_loss(const DistillSetup& d, const std::vector<double>& losses,
                               float* loss) {
  if (d.reduction == FCE_REDUCTION_NONE) {
    for (int64_t r = 0; r < d.rows; ++r) loss[r] = float(losses[size_t(r)]);
    return;
  }
  double sum = 0.0;
  for (int64_t r = 0; r < d.rows; ++r) sum += losses[size_t(r)];
  if (d.reduction == FCE_REDUCTION_MEAN)
    sum = d.n != 0.0 ? sum / d.n : std::isfinite(sum) ? 0.0 : sum;
  loss[0] = float(sum);
}

}  // namespace cpu
}  // namespace fce
