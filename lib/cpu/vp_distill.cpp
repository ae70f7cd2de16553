// vp_distill.cpp — the vocabulary-parallel distillation on the CPU (fce_vp_distill_*,
// docs/semantics.md rule 22): each shard row of the student and the teacher loaded and put
// through rule 20's transform (distill_row.h, over the shard's vocab_local columns), its sums in
// double; the gathered statistics combined by vd_combine (lib/vp_distill.h, shared with the
// CUDA backend); the gradient element by element with distill_row.h's distill_du and
// distill_chain. Rows run on threads; the loss is reduced in row order (write_distill_loss):
// deterministic, the same bits on every rank.
#include <atomic>
#include <limits>
#include <new>
#include <vector>

#include "distill_row.h"
#include "vp_distill.h"

namespace fce {
namespace {

using namespace cpu;

constexpr double kInf = std::numeric_limits<double>::infinity();

// What every row shares: rule 20's setup over the shard's columns (vocab = vocab_local), the
// mean's n from the targets of the whole problem, the shard's place and the divergence.
struct VdSetup {
  DistillSetup d;
  int64_t start, local;
  int div;  // vd_divergence
};

VdSetup make_vd_setup(const DistillOptions& opt, int64_t rows, int64_t start, int64_t local,
                      const void* targets, const float* grad_output) {
  VdSetup s;
  s.d = make_distill_setup(opt, rows, local, targets, grad_output);
  s.start = start;
  s.local = local;
  s.div = vd_divergence(opt.divergence, opt.beta);
  return s;
}

Div as_div(int div) {
  return div == kVdForward ? Div::kForward : div == kVdReverse ? Div::kReverse : Div::kJsd;
}

// Shard row i of the student and of the teacher (their dtype, strides in elements) into u and
// v, transformed: u = a / T, v = a' / T.
void load_shard_rows(const VdSetup& s, int dtype, const void* student, int64_t student_stride,
                     const void* teacher, int64_t teacher_stride, int64_t i, double* u, double* v) {
  const size_t esize = dtype_size(dtype);
  load_row(dtype, static_cast<const char*>(student) + size_t(i) * size_t(student_stride) * esize,
           s.local, u);
  load_row(dtype, static_cast<const char*>(teacher) + size_t(i) * size_t(teacher_stride) * esize,
           s.local, v);
  transform_row(s.d, u);
  transform_row(s.d, v);
}

// The maximum of a shard row (NaN if any entry is NaN) and the first index of it (of the first
// NaN), rounded to the float32 that is stored: the sums are relative to that value.
float shard_max(const double* x, int64_t n, int64_t* argmax) {
  double m = -kInf;
  *argmax = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(x[j])) {
      *argmax = j;
      return std::numeric_limits<float>::quiet_NaN();
    }
    if (x[j] > m) m = x[j], *argmax = j;
  }
  return float(m);
}

// Σ_j w_j (x_j − y_j), w_j = exp(x_j), the terms with w_j = 0 left out (never 0·inf).
double cross_sum(const double* x, const double* y, int64_t n) {
  double c = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const double w = std::exp(x[j]);
    if (w != 0.0) c += w * (x[j] - y[j]);
  }
  return c;
}

void put_bits(float* out, int slot, uint32_t bits) { out[slot] = vd_float(bits); }

// Round 1 of a row: the maxima, the sums relative to them and the cross sum of the divergence.
void round1_row(const VdSetup& s, double* u, double* v, float* out) {
  const int64_t n = s.local;
  int64_t argmax = 0, unused = 0;
  const float mu = shard_max(u, n, &argmax), mv = shard_max(v, n, &unused);
  const double bu = vd_base(mu), bv = vd_base(mv);
  double su = 0.0, sv = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    u[j] -= bu;  // x_j and y_j of rule 22 from here on
    v[j] -= bv;
    su += std::exp(u[j]);
    sv += std::exp(v[j]);
  }
  out[kVdMaxU] = mu;
  out[kVdSumU] = float(su);
  out[kVdMaxV] = mv;
  out[kVdSumV] = float(sv);
  out[kVdCross] = s.div == kVdForward   ? float(cross_sum(v, u, n))
                  : s.div == kVdReverse ? float(cross_sum(u, v, n))
                                        : 0.0f;
  out[kVdJsdP] = 0.0f;
  put_bits(out, kVdArgmax, uint32_t(s.start + argmax));
  put_bits(out, kVdLocal, uint32_t(n));
}

// Round 2 of a row (the JSD): round 1's combination c (its values rounded to the float32 that
// is stored), then A_r and B_r over the shard.
void round2_row(const VdSetup& s, const VdRow& c, const double* u, const double* v, float* out) {
  const int64_t n = s.local;
  int64_t argmax = 0;
  (void)shard_max(u, n, &argmax);
  const float Mu = float(c.Mu), lsu = float(c.lsu), Mv = float(c.Mv), lsv = float(c.lsv);
  const double b = s.d.beta;
  double A = 0.0, B = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const double lp = (u[j] - Mu) - lsu, lq = (v[j] - Mv) - lsv;
    const double lm = log_mix(b, lq, lp);
    A += kl_term(std::exp(lq), lq, lm);
    B += kl_term(std::exp(lp), lp, lm);
  }
  out[kVdMaxU] = Mu;
  out[kVdSumU] = lsu;
  out[kVdMaxV] = Mv;
  out[kVdSumV] = lsv;
  out[kVdCross] = float(A);
  out[kVdJsdP] = float(B);
  put_bits(out, kVdArgmax, uint32_t(s.start + argmax) | (c.ok ? 0u : kVdTopBit));
  put_bits(out, kVdLocal, uint32_t(n) | kVdTopBit);
}

fce_status stats(const VpDistillStatsProblem& p) {
  const VdSetup s = make_vd_setup(p.opt, p.rows, p.vocab_start, p.vocab_local, nullptr, nullptr);
  DistillScratch scratch(p.vocab_local, p.count);
  parallel_for(p.count, scratch.threads, [&](int64_t begin, int64_t end, int t) {
    double* u = scratch.u[size_t(t)].data();
    double* v = scratch.v[size_t(t)].data();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = p.first + i;  // the call's row
      load_shard_rows(s, p.opt.dtype, p.logits, p.row_stride, p.teacher, p.teacher_row_stride, i, u,
                      v);
      float* out = p.stats + size_t(r) * kVdCount;
      if (p.round == 1) {
        round1_row(s, u, v, out);
      } else {
        const VdRow c =
            vd_combine(p.previous, p.ranks, p.rows, r, p.vocab_total, 1, s.div, s.d.beta);
        round2_row(s, c, u, v, out);
      }
    }
  });
  return FCE_SUCCESS;
}

// fce_vp_distill_loss: every row combined, the row losses, then the reduction in row order.
fce_status loss(const VpDistillProblem& p) {
  const VdSetup s = make_vd_setup(p.opt, p.rows, 0, 1, p.targets, nullptr);
  const int rounds = vd_rounds(s.div);
  std::vector<double> losses(size_t(p.rows), 0.0);
  std::atomic<bool> inconsistent{false};
  parallel_for(p.rows, thread_count(p.rows, std::max<int64_t>(1, 4096 / p.ranks)),
               [&](int64_t begin, int64_t end, int) {
                 for (int64_t r = begin; r < end; ++r) {
                   const VdRow c = vd_combine(p.gathered, p.ranks, p.rows, r, p.vocab_total, rounds,
                                              s.div, s.d.beta);
                   if (!c.ok) inconsistent.store(true, std::memory_order_relaxed);
                   if (p.lse)
                     p.lse[r] =
                         c.ok ? float(c.Mu + c.lsu) : std::numeric_limits<float>::quiet_NaN();
                   if (row_counted(s.d, r))
                     losses[size_t(r)] = c.ok ? c.loss : std::numeric_limits<double>::quiet_NaN();
                 }
               });
  write_distill_loss(s.d, losses, p.loss);
  if (p.error_flags && inconsistent.load()) *p.error_flags |= FCE_FLAG_SHARDS_INCONSISTENT;
  return FCE_SUCCESS;
}

// fce_vp_distill_backward: per row the combination, then the gradient of the shard's columns
// (rows not counted: 0; rows of inconsistent statistics: NaN). Each row is read whole before
// its gradient is written (in place is fine). The mean's n counts the call's rows, all of them
// (make_vd_setup over p.rows), whichever rows p.first and p.count pick.
fce_status backward(const VpDistillProblem& p) {
  const VdSetup s =
      make_vd_setup(p.opt, p.rows, p.vocab_start, p.vocab_local, p.targets, p.grad_output);
  const int rounds = vd_rounds(s.div);
  const Div div = as_div(s.div);
  const size_t gsize = dtype_size(p.opt.dtype);
  DistillScratch scratch(p.vocab_local, p.count);
  parallel_for(p.count, scratch.threads, [&](int64_t begin, int64_t end, int t) {
    double* u = scratch.u[size_t(t)].data();
    double* v = scratch.v[size_t(t)].data();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = p.first + i;  // the call's row
      void* g = static_cast<char*>(p.grad) + size_t(i) * size_t(p.grad_row_stride) * gsize;
      if (!row_counted(s.d, r)) {
        fill_row(p.opt.dtype, g, s.local, 0.0f);
        continue;
      }
      const VdRow c =
          vd_combine(p.gathered, p.ranks, p.rows, r, p.vocab_total, rounds, s.div, s.d.beta);
      if (!c.ok) {
        fill_row(p.opt.dtype, g, s.local, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      load_shard_rows(s, p.opt.dtype, p.logits, p.row_stride, p.teacher, p.teacher_row_stride, i, u,
                      v);
      const double up = distill_upstream(s.d, r);
      for (int64_t j = 0; j < s.local; ++j) {
        const double lp = (u[j] - c.Mu) - c.lsu, lq = (v[j] - c.Mv) - c.lsv;
        u[j] = distill_du(div, s.d.beta, lp, lq, c.k) * distill_chain(s.d, u[j]) * up;
      }
      store_row(p.opt.dtype, u, s.local, g);
    }
  });
  return FCE_SUCCESS;
}

}  // namespace

fce_status cpu_vp_distill_stats(const VpDistillStatsProblem& p) {
  try {
    return stats(p);
  } catch (const std::bad_alloc&) {
    return fail(FCE_ERROR_OUT_OF_MEMORY,
                "%s (CPU): out of host memory for %lld rows of %lld classes", p.fn,
                (long long)p.rows, (long long)p.vocab_local);
  }
}

// Scratch lives in host memory (two double rows per thread, one double per row).
size_t cpu_vp_distill_workspace_size(const DistillOptions&, int64_t, int64_t, bool) { return 0; }

fce_status cpu_vp_distill(const VpDistillProblem& p) {
  try {
    return p.backward ? backward(p) : loss(p);
  } catch (const std::bad_alloc&) {
    return fail(FCE_ERROR_OUT_OF_MEMORY,
                "%s (CPU): out of host memory (ranks %lld, rows %lld, vocab_total %lld)", p.fn,
                (long long)p.ranks, (long long)p.rows, (long long)p.vocab_total);
  }
}

}  // namespace fce
