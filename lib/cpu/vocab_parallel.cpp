// vocab_parallel.cpp — the vocabulary-parallel calls on the CPU (fce_vp_*, docs/semantics.md rule 16):
//   phase 1  each rank's FCE_VP_STATS float32 per row over its shard of the classes (m_r, s_r,
//            t_r, h_r, u_r, W_r, the shard's argmax, V_r), from given logits (fce_vp_stats) or
//            from z = h·W_shardᵀ + b_shard made chunk by chunk (fce_vp_linear_stats); with
//            options->vp_entropy also e_r = Σ exp(a_j − m_r)(a_j − m_r) (rule 18);
//   phase 3  the gathered stats of all ranks combined per row, in gathered order, in double:
//            M, S, ls = log S, lse = M + ls, t, Ω, U, the argmax and the tiling check (and
//            μ − M = Σ_r exp(m_r − M)(e_r + (m_r − M) s_r) / S, H = ls − (μ − M)); then the
//            loss (fce_vp_loss) or the gradient of this rank's columns (fce_vp_backward,
//            fce_vp_linear_backward, which also makes ∂h's share, ∂W and ∂b of the shard),
//            with rule 18's grad_lse and grad_entropy terms.
// Everything per row is ce_row.h's arithmetic with the row maximum m and log s of rule 9 taken
// from the combination: the float32 vectorised row when a = z (logit_scale 1, no softcap), sums
// in double; the double row otherwise. Rows run on threads; the reduction over rows is
// write_reduction's, in row order: deterministic, the same bits on every rank.
//
// Class probabilities (rule 19): the targets of phase 1 and of the gradient are this rank's
// shard of q [rows, vocab_local]; with ω_j q'_j in place of label smoothing's (ε/V) ω_j, per row,
// u_r = Σ_j ω_j q'_j (m_r − a_j) and W_r = Σ_j ω_j q'_j over the shard (soft_row.cpp), and
// phase 3 makes Q = Σ_r W_r, U = Σ_r (u_r + W_r (M − m_r)), ce = Q ls + U and
// ∂ce/∂a_j = Q p_j − ω_j q'_j: no target class, every row scored.
//
// Phase 1's m_r is stored as a float32; s_r and u_r are computed relative to that stored value
// (not to the unrounded double maximum of the double path), so that the combination's algebra
// (S = Σ s_r exp(m_r − M), U = Σ u_r + W_r (M − m_r)) is exact in the stored values and the
// gradient's p_j = exp((a_j − M) − ls) sums to 1 over the shards.
#include <atomic>
#include <climits>
#include <new>
#include <vector>

#include "ce_row.h"
#include "cpu/blas.h"
#include "exact_sum.h"
#include "linear_chunks.h"

namespace fce {
namespace {

using namespace cpu;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

float int_as_float(int64_t v) {
  const int32_t i = static_cast<int32_t>(v);
  uint32_t u;
  std::memcpy(&u, &i, sizeof u);
  return bits_float(u);
}

int32_t float_as_int(float f) {
  const uint32_t u = float_bits(f);
  int32_t i;
  std::memcpy(&i, &u, sizeof i);
  return i;
}

// What every row of a call shares: ce_row.h's setup over the WHOLE vocabulary (targets, ω, D
// and n of rule 4, the upstream), and this rank's shard [start, start + local).
struct VpSetup {
  CeSetup ce;                 // vocab = V (vocab_total)
  int64_t start = 0, local = 0;
  const float* omega_shard;   // ω + start, or nullptr without class weights
  double shard_weight = 0;    // W_r = Σ ω_j over the shard
  bool entropy;               // options->vp_entropy: e_r in kVpEntropy, h_r in kVpLocal's bit
  bool soft;                  // class probabilities: ce.targets is the shard's q [rows, local]
  bool fast;                  // a = z: the float32 row (ce_row.h's float_path)
  bool exact;                 // options->batch_invariant: the exact statistics (VpExactStat)
  int64_t width;              // float32 per row of the statistics (vp_stats_width)
};

// grad_lse, grad_entropy: phase 3 of a gradient, [rows] or nullptr (rule 18).
VpSetup make_vp_setup(const CeOptions& opt, int64_t rows, int64_t vocab_total, int64_t start,
                      int64_t local, const void* targets, const float* grad_output,
                      const float* grad_lse = nullptr, const float* grad_entropy = nullptr) {
  VpSetup s;
  s.ce = make_setup(opt, rows, vocab_total, targets, grad_output, false, grad_lse, grad_entropy);
  s.entropy = opt.vp_entropy;
  s.soft = opt.soft_targets;
  s.start = start;
  s.local = local;
  s.omega_shard = opt.class_weights ? opt.class_weights + start : nullptr;
  for (int64_t j = 0; j < local; ++j) s.shard_weight += omega_of(s.ce, start + j);
  s.exact = opt.batch_invariant;
  s.width = vp_stats_width(opt);
  // rule 18's sums and terms, and the exact statistics: the double row, element by element
  s.fast = float_path(s.ce) && !s.entropy && !s.exact;
  return s;
}

bool in_shard(const VpSetup& s, const RowTarget& t) {
  return t.kind == RowKind::kScored && t.y >= s.start && t.y < s.start + s.local;
}

// ------------------------------------------------------------------ phase 1 ----

// e: the entropy's sum e_r, stored with s.entropy only; W: W_r of the row (class
// probabilities), nullptr: the shard's Σ ω_j.
void write_stats(const VpSetup& s, float m, double sum, double target, bool hit, double u,
                 int64_t argmax_local, float* out, double e = 0.0, const double* W = nullptr) {
  out[kVpMax] = m;
  out[kVpSumExp] = float(sum);
  out[kVpTarget] = hit ? float(target) : 0.0f;
  out[kVpHit] = hit ? 1.0f : 0.0f;
  out[kVpSmooth] = float(u);
  out[kVpWeight] = float(W ? *W : s.shard_weight);
  out[kVpArgmax] = int_as_float(s.start + argmax_local);
  out[kVpLocal] = int_as_float(s.local);
  if (s.entropy) {
    out[kVpEntropy] = float(e);
    out[kVpLocal] = bits_float(uint32_t(s.local) | (hit ? kVpHitBit : 0u));
  }
}

// The stats of a shard row of float32 a (= z: the fast path).
void row_stats_shard_f32(const VpSetup& s, const float* a, const RowTarget& t, float* out) {
  const int64_t n = s.local;
  const bool hit = in_shard(s, t);
  const double a_y = hit ? double(a[t.y - s.start]) : 0.0;
  bool nan_seen = false;
  const float m = row_max_f32(a, n, &nan_seen);
  int64_t argmax = 0;
  if (nan_seen) {  // m_r NaN, and the shard's argmax its first NaN (rule 15)
    while (!std::isnan(a[argmax])) ++argmax;
    write_stats(s, float(kNaN), kNaN, a_y, hit, 0.0, argmax, out);
    return;
  }
  while (argmax + 1 < n && a[argmax] != m) ++argmax;
  // s_r = 0 when m_r = −inf; NaN when m_r = +inf (its own term exp(+inf − +inf), rule 10)
  const double sum = std::isfinite(m) ? sum_exp_f32(a, n, m) : m < 0 ? 0.0 : kNaN;
  double u = 0.0;  // u_r = Σ ω_j (m_r − a_j) when ε > 0 and m_r > −inf
  if (s.ce.eps > 0.0 && m > -std::numeric_limits<float>::infinity())
    u = smooth_sum_f32(a, n, double(m), 0.0, s.omega_shard);
  write_stats(s, m, sum, a_y, hit, u, argmax, out);
}

// The stats of row r of the shard, double a (scaled and capped: the double path).
void row_stats_shard_f64(const VpSetup& s, const double* a, int64_t r, const RowTarget& t,
                         float* out) {
  const int64_t n = s.local;
  const bool hit = in_shard(s, t);
  const double a_y = hit ? a[t.y - s.start] : 0.0;
  double m = -kInf;
  int64_t argmax = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(a[j])) {
      write_stats(s, float(kNaN), kNaN, a_y, hit, 0.0, j, out, kNaN);
      return;
    }
    if (a[j] > m) {
      m = a[j];
      argmax = j;
    }
  }
  const float mf = float(m);  // what is stored: s_r and u_r are relative to it
  const double md = mf;
  // s_r = 0 when m_r = −inf; NaN when m_r = +inf (its own term exp(+inf − +inf), rule 10)
  double sum = md < 0 ? 0.0 : kNaN;
  if (std::isfinite(md)) {
    sum = 0.0;
    for (int64_t j = 0; j < n; ++j) sum += std::exp(a[j] - md);
  }
  double u = 0.0, W = 0.0;  // W: the row's Σ ω_j q'_j (class probabilities)
  if (s.soft) {
    // u_r = Σ ω_j q'_j (m_r − a_j): 0 when m_r = −inf (rule 16's "else 0"), NaN for +inf
    const SoftSums q = soft_shard_sums(s.ce, a, md, r, s.start, n);
    W = q.mass;
    u = std::isfinite(md) ? -q.shifted : md < 0 ? 0.0 : kNaN;
  } else if (s.ce.eps > 0.0 && m > -kInf) {
    for (int64_t j = 0; j < n; ++j) u += omega_of(s.ce, s.start + j) * (md - a[j]);
  }
  // e_r = Σ exp(a_j − m_r)(a_j − m_r) (a −inf entry adds 0): 0 when m_r = −inf, NaN for +inf
  double e = md < 0 ? 0.0 : kNaN;
  if (s.entropy && std::isfinite(md)) {
    e = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      const double x = std::exp(a[j] - md);
      if (x != 0.0) e += x * (a[j] - md);
    }
  }
  write_stats(s, mf, sum, a_y, hit, u, argmax, out, e, s.soft ? &W : nullptr);
}

// The exact statistics of row r of the shard (options->batch_invariant, rule 21), double a
// (scaled and capped) taken to float32 element by element: the maximum, the argmax and the
// target logit as row_stats_shard_f64's, and the sums Σ exp(a_j), Σ exp(a_j) a_j (entropy),
// Σ w_j a_j and Σ w_j (label smoothing or class probabilities; else 0) as exact sums (exact_sum.h): the
// same bits whatever the order of the terms, and so whatever the shards. A NaN makes m_r NaN
// (the combination's results NaN); no sum is then read.
void row_stats_exact(const VpSetup& s, const double* a, int64_t r, const RowTarget& t,
                     float* out) {
  const int64_t n = s.local;
  const bool hit = in_shard(s, t);
  float m = -std::numeric_limits<float>::infinity();
  int64_t argmax = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float x = float(a[j]);
    if (std::isnan(x)) {
      m = x;
      argmax = j;
      break;
    }
    if (x > m) m = x, argmax = j;
  }
  ExactSum S = exact_zero(), P = exact_zero(), U = exact_zero(), W = exact_zero();
  const bool weighted = s.soft || s.ce.eps > 0.0;
  for (int64_t j = 0; j < n && !std::isnan(m); ++j) {
    const float x = float(a[j]);
    float mant = 0.f;
    int64_t e2 = 0;
    exact_add_exp(S, x, &mant, &e2);
    if (s.entropy && mant != 0.f) exact_add_product(P, mant, x, e2);
    if (!weighted) continue;
    const float w = float(s.soft ? soft_shard_weight(s.ce, r, s.start, n, j)
                                 : omega_of(s.ce, s.start + j));
    exact_add(W, w);
    if (w != 0.f) exact_add_product(U, w, x);  // (a −inf logit of weight 0 adds nothing)
  }
  out[kVxMax] = m;
  out[kVxArgmax] = int_as_float(s.start + argmax);
  out[kVxLocal] = bits_float(uint32_t(s.local) | (hit ? kVpHitBit : 0u));
  out[kVxTarget] = hit ? float(a[t.y - s.start]) : 0.0f;
  exact_store(S, out + kVxSumExp);
  exact_store(P, out + kVxEntropy);
  exact_store(U, out + kVxSmooth);
  exact_store(W, out + kVxWeight);
}

// Steps 1 and 2 on the shard's row: a_j = s · z_j, then c · tanh(a_j / c) when c > 0.
void scale_and_softcap_shard(const VpSetup& s, double* a) {
  for (int64_t j = 0; j < s.local; ++j) {
    a[j] = s.ce.s * a[j];
    if (s.ce.c > 0.0) a[j] = s.ce.c * std::tanh(a[j] / s.ce.c);
  }
}

// One shard row per thread (float32 on the fast path, else double), allocated before any
// output is written.
struct ShardScratch {
  int threads;
  std::vector<std::vector<float>> frows;
  std::vector<std::vector<double>> rows;
  ShardScratch(const VpSetup& s, int64_t max_count) {
    threads = thread_count(max_count, std::max<int64_t>(1, (int64_t(1) << 16) / s.local));
    if (s.fast)
      frows.assign(size_t(threads), std::vector<float>(size_t(s.local)));
    else
      rows.assign(size_t(threads), std::vector<double>(size_t(s.local)));
  }
};

// Phase 1 on rows [first_row, first_row + count) of the problem; the logits of row i of the
// job at logits + i · stride elements, the stats of problem row r at stats + r · FCE_VP_STATS.
void stats_rows(const VpSetup& s, int64_t first_row, int64_t count, const void* logits,
                int64_t stride, int dtype, float* stats, ShardScratch& scratch) {
  const size_t esize = dtype_size(dtype);
  parallel_for(count, scratch.threads, [&](int64_t begin, int64_t end, int thread) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = first_row + i;
      const RowTarget t = row_target(s.ce, r);
      const void* z = static_cast<const char*>(logits) + size_t(i) * size_t(stride) * esize;
      float* out = stats + size_t(r) * size_t(s.width);
      if (s.fast) {
        float* a = scratch.frows[size_t(thread)].data();
        load_row_f32(dtype, z, s.local, a);
        row_stats_shard_f32(s, a, t, out);
      } else {
        double* a = scratch.rows[size_t(thread)].data();
        load_row(dtype, z, s.local, a);
        scale_and_softcap_shard(s, a);
        if (s.exact)
          row_stats_exact(s, a, r, t, out);
        else
          row_stats_shard_f64(s, a, r, t, out);
      }
    }
  });
}

// ------------------------------------------------------------------ phase 3 ----

// The gathered stats of one row combined (rule 16), ranks in gathered order, in double.
struct Combined {
  bool consistent;   // the tiling check passed
  double M, ls, lse;  // m and log s of rule 9, lse = M + ls
  double t;          // a_y (scored rows)
  double Omega;      // Σ_r W_r (class probabilities: Q = Σ_j ω_j q'_j)
  double U;          // Σ_j ω_j (M − a_j) (ε > 0); class probabilities: Σ_j ω_j q'_j (M − a_j)
  int64_t argmax;    // the global argmax
  double mu_m = 0.0, H = kNaN;  // rule 18 (s.entropy): μ − M and the entropy ls − (μ − M)
};

// The argmax across shards, shard q's (m, j) after those before it: the rank with the largest
// m_r (a NaN largest), among equal maxima (NaNs among themselves) the smallest global index.
void pick_argmax(int64_t q, float m, int32_t j, float& best_m, int32_t& best_j) {
  bool better;
  if (q == 0) better = true;
  else if (std::isnan(best_m)) better = std::isnan(m) && j < best_j;
  else if (std::isnan(m)) better = true;
  else better = m > best_m || (m == best_m && j < best_j);
  if (better) best_m = m, best_j = j;
}

// Two disjoint shards never report the same argmax (a global index inside each): equal ones
// mean a shard's statistics were gathered twice (in place of another's of the same size).
template <class At>
bool duplicate_argmax(const At& at, int64_t ranks, int slot) {
  for (int64_t q = 1; q < ranks; ++q)
    for (int64_t o = 0; o < q; ++o)
      if (float_as_int(at(q)[slot]) == float_as_int(at(o)[slot])) return true;
  return false;
}

// The exact statistics of one row combined (options->batch_invariant, rule 21): the sums merged
// (integer bins: the same bits in any order), then M, ls = log S − M, t, Ω, U = M Ω − Σ w a and
// μ − M = Σ exp(a) a / S − M in double, from the merged sums alone. The argmax and the tiling
// check as combine's.
Combined combine_exact(const VpSetup& s, const float* gathered, int64_t ranks, int64_t r,
                       RowKind kind) {
  const size_t rows = size_t(s.ce.rows);
  auto at = [&](int64_t q) { return gathered + (size_t(q) * rows + size_t(r)) * kVxCount; };
  Combined c;
  bool nan_seen = false;
  double M = -kInf, t = 0.0, hits = 0.0;
  float best_m = 0.f;
  int32_t best_j = 0;
  int64_t local_sum = 0;
  ExactSum S = exact_zero(), P = exact_zero(), U = exact_zero(), W = exact_zero();
  for (int64_t q = 0; q < ranks; ++q) {
    const float* st = at(q);
    const float m = st[kVxMax];
    const int32_t j = float_as_int(st[kVxArgmax]);
    if (std::isnan(m)) nan_seen = true;
    else if (double(m) > M) M = m;
    const uint32_t local_bits = float_bits(st[kVxLocal]);
    hits += (local_bits & kVpHitBit) ? 1.0 : 0.0;
    local_sum += int64_t(local_bits & ~kVpHitBit);
    t += st[kVxTarget];
    exact_merge(S, exact_load(st + kVxSumExp));
    exact_merge(P, exact_load(st + kVxEntropy));
    exact_merge(U, exact_load(st + kVxSmooth));
    exact_merge(W, exact_load(st + kVxWeight));
    pick_argmax(q, m, j, best_m, best_j);
  }
  // S's own NaN (a term beyond exact_sum.h's range), a NaN, +inf (its term exp(+inf − +inf),
  // rule 10) or −inf maximum (S = 0) as combine's
  const bool finite = std::isfinite(M) && S.nonfinite == 0.f;
  c.M = nan_seen ? kNaN : M;
  c.ls = finite ? exact_log(S) - M : std::isnan(c.M) || M > 0 || S.nonfinite != 0.f ? kNaN : -kInf;
  c.lse = c.M + c.ls;
  c.t = t;
  c.Omega = exact_value(W);
  // (U of a row without a finite maximum is never read: its loss is NaN, rule 10)
  c.U = std::isfinite(M) ? M * c.Omega - exact_value(U) : kNaN;
  c.argmax = best_j;
  if (s.entropy) {
    c.mu_m = finite ? exact_ratio(P, S) - M : kNaN;
    c.H = c.ls - c.mu_m;
  }
  c.consistent = local_sum == s.ce.vocab && !duplicate_argmax(at, ranks, kVxArgmax) &&
                 (kind != RowKind::kScored || s.soft || hits == 1.0);
  return c;
}

Combined combine(const VpSetup& s, const float* gathered, int64_t ranks, int64_t r,
                 RowKind kind) {
  if (s.exact) return combine_exact(s, gathered, ranks, r, kind);
  const size_t rows = size_t(s.ce.rows);
  auto at = [&](int64_t q) { return gathered + (size_t(q) * rows + size_t(r)) * kVpCount; };
  Combined c;
  // M = max_r m_r (NaN if any is NaN); the argmax (pick_argmax)
  bool nan_seen = false;
  double M = -kInf;
  float best_m = 0.f;
  int32_t best_j = 0;
  for (int64_t q = 0; q < ranks; ++q) {
    const float* st = at(q);
    const float m = st[kVpMax];
    if (std::isnan(m)) nan_seen = true;
    else if (double(m) > M) M = m;
    pick_argmax(q, m, float_as_int(st[kVpArgmax]), best_m, best_j);
  }
  if (nan_seen) M = kNaN;
  // S = Σ_r s_r exp(m_r − M) over ranks with m_r > −inf (0 when M = −inf; an m_r equal to M
  // counts s_r: NaN for M = +inf, rule 10), t = Σ t_r, Ω = Σ W_r, U = Σ (u_r + W_r (M − m_r)),
  // Σ h_r, Σ V_r.
  // With s.entropy: E = Σ_r exp(m_r − M)(e_r + (m_r − M) s_r) = Σ_j exp(a_j − M)(a_j − M).
  double S = 0.0, t = 0.0, hits = 0.0, Omega = 0.0, U = 0.0, E = 0.0;
  int64_t local_sum = 0;
  const bool smoothing = s.ce.eps > 0.0 && !s.soft;
  for (int64_t q = 0; q < ranks; ++q) {
    const float* st = at(q);
    const double m = st[kVpMax];
    if (m > -kInf) S += m == M ? double(st[kVpSumExp]) : double(st[kVpSumExp]) * std::exp(m - M);
    t += st[kVpTarget];
    Omega += st[kVpWeight];
    if (smoothing) U += double(st[kVpSmooth]) + double(st[kVpWeight]) * (M - m);
    // class probabilities: a shard of no probability mass adds nothing (even with m_r = −inf)
    if (s.soft && st[kVpWeight] != 0.0f)
      U += double(st[kVpSmooth]) + double(st[kVpWeight]) * (M - m);
    if (!s.entropy) {
      hits += st[kVpHit];
      local_sum += float_as_int(st[kVpLocal]);
      continue;
    }
    const uint32_t local_bits = float_bits(st[kVpLocal]);
    hits += (local_bits & kVpHitBit) ? 1.0 : 0.0;
    local_sum += int64_t(local_bits & ~kVpHitBit);
    if (m > -kInf)
      E += m == M ? double(st[kVpEntropy])
                  : std::exp(m - M) * (double(st[kVpEntropy]) + (m - M) * double(st[kVpSumExp]));
  }
  if (nan_seen) S = kNaN;
  c.M = M;
  c.ls = std::log(S);
  c.lse = M + c.ls;
  c.t = t;
  c.Omega = Omega;
  c.U = U;
  c.argmax = best_j;
  if (s.entropy) {  // NaN without a finite maximum, as row_stats
    c.mu_m = std::isfinite(M) ? E / S : kNaN;
    c.H = c.ls - c.mu_m;
  }
  c.consistent = local_sum == s.ce.vocab && !duplicate_argmax(at, ranks, kVpArgmax) &&
                 (kind != RowKind::kScored || s.soft || hits == 1.0);
  return c;
}

// Token scaling's p_y = exp((t − M) − ls) (rule 16), 1 without token scaling.
double token_scale(const VpSetup& s, const Combined& c) {
  return s.ce.token_scaling ? std::exp((c.t - c.M) - c.ls) : 1.0;
}

// fce_vp_loss on the CPU: every row combined, the per-row values, then write_reduction.
fce_status vp_loss(const VpProblem& p) {
  const VpSetup s = make_vp_setup(p.opt, p.rows, p.vocab_total, 0, 0, p.targets, nullptr);
  RowResults res(p.rows, p.accuracy != nullptr);
  std::atomic<bool> invalid_seen{false}, inconsistent_seen{false};
  const double eps = s.ce.eps, V = double(s.ce.vocab);
  parallel_for(p.rows, thread_count(p.rows, std::max<int64_t>(1, 4096 / p.ranks)),
               [&](int64_t begin, int64_t end, int) {
    for (int64_t r = begin; r < end; ++r) {
      const size_t ri = size_t(r);
      const RowTarget t = row_target(s.ce, r);
      const Combined c = combine(s, p.gathered, p.ranks, r, t.kind);
      res.ce[ri] = 0.0;
      res.z_loss[ri] = 0.0;
      if (!res.correct.empty()) res.correct[ri] = 0;
      if (t.kind == RowKind::kInvalid) invalid_seen.store(true, std::memory_order_relaxed);
      if (!c.consistent) {  // the tiling check: loss, lse NaN, argmax −1
        inconsistent_seen.store(true, std::memory_order_relaxed);
        res.ce[ri] = kNaN;
        res.z_loss[ri] = s.ce.lambda == 0.0 ? 0.0 : kNaN;
        if (p.lse) p.lse[r] = float(kNaN);
        if (p.entropy) p.entropy[r] = float(kNaN);
        if (p.argmax) p.argmax[r] = -1;
        continue;
      }
      if (p.lse) p.lse[r] = float(c.lse);
      if (p.entropy) p.entropy[r] = float(c.H);
      if (p.argmax) p.argmax[r] = t.kind == RowKind::kIgnored ? -1 : c.argmax;
      if (t.kind == RowKind::kInvalid) {
        res.ce[ri] = kNaN;
        res.z_loss[ri] = z_loss_term(s.ce, c.lse);  // never scaled
      } else if (s.soft) {
        // rule 19: ce = Q ls + U, NaN without a finite maximum (rule 10)
        res.ce[ri] = std::isfinite(c.M) ? c.Omega * c.ls + c.U : kNaN;
        res.z_loss[ri] = z_loss_term(s.ce, c.lse);
      } else if (t.kind == RowKind::kScored) {
        // ce = (1−ε) ω_y ((M − t) + ls) + (ε/V)(U + Ω ls), zl = λ lse², both times p_y
        double ce = (1.0 - eps) * omega_of(s.ce, t.y) * ((c.M - c.t) + c.ls);
        if (eps > 0.0) ce += eps / V * (c.U + c.Omega * c.ls);
        const double ts = token_scale(s, c);
        res.ce[ri] = ts * ce;
        res.z_loss[ri] = scaled_z_loss_term(s.ce, ts, c.lse);
        if (!res.correct.empty()) res.correct[ri] = c.argmax == t.y ? 1 : 0;
      }
    }
  });
  write_reduction(s.ce, res, p.loss, p.z_loss, p.accuracy);
  if (p.error_flags) {
    if (invalid_seen.load()) *p.error_flags |= FCE_FLAG_TARGET_OUT_OF_RANGE;
    if (inconsistent_seen.load()) *p.error_flags |= FCE_FLAG_SHARDS_INCONSISTENT;
  }
  return FCE_SUCCESS;
}

// The gradient of a float32 shard row (the fast path) into out (may be a): ce_row.h's
// gradient_f32_row with m = M, log s = ls, Ω of the combination, the shard's ω, and the
// one-hot term only when y is in the shard.
void gradient_shard_f32(const VpSetup& s, const float* a, const Combined& c, const RowTarget& t,
                        const Upstream& up, double ts, float* out) {
  const double target_weight = (1.0 - s.ce.eps) * omega_of(s.ce, t.y);
  const double smoothing = s.ce.eps / double(s.ce.vocab);
  const double z_loss = s.ce.lambda == 0.0 ? 0.0 : 2.0 * s.ce.lambda * c.lse;
  double A = up.k1 * (target_weight + smoothing * c.Omega);
  if (z_loss != 0.0) A += up.kz1 * z_loss;
  double B = -up.k1 * smoothing;
  if (s.ce.token_scaling) A *= ts, B *= ts;
  const float g = float(up.g);
  const bool hit = in_shard(s, t);
  const double a_y = hit ? double(a[t.y - s.start]) : 0.0;  // read before out (maybe a)
  gradient_f32(a, s.local, float(c.M), float(c.ls), float(A), float(B), s.omega_shard, g, out);
  if (!hit) return;
  const double p = std::exp((a_y - c.M) - c.ls);
  double d_ce = target_weight * (p - 1.0);
  if (smoothing != 0.0) d_ce += smoothing * (c.Omega * p - omega_of(s.ce, t.y));
  double d_a = up.k1 * d_ce;
  if (z_loss != 0.0) d_a += up.kz1 * z_loss * p;
  if (s.ce.token_scaling) d_a *= ts;
  out[t.y - s.start] = g * float(d_a);
}

// The gradient of a double shard row (the double path), in place: ce_row.h's gradient with
// m = M, log s = ls, μ − m = μ − M over the shard's columns; y < 0: a row without a loss term
// (ignored) whose rule 18 terms flow.
void gradient_shard_f64(const VpSetup& s, double* a, const Combined& c, int64_t r, int64_t y,
                        const Upstream& up, double ts, const RowTerms& terms) {
  if (s.soft) {  // rule 19 over the shard's columns, Q = Ω of the combination
    RowStats st{};
    st.m = c.M;
    st.log_s = c.ls;
    st.lse = c.lse;
    st.mu_m = c.mu_m;
    soft_shard_gradient(s.ce, a, st, c.Omega, r, s.start, s.local, up, terms);
    return;
  }
  const double target_weight = y < 0 ? 0.0 : (1.0 - s.ce.eps) * omega_of(s.ce, y);
  const double smoothing = y < 0 ? 0.0 : s.ce.eps / double(s.ce.vocab);
  const double z_loss = y < 0 || s.ce.lambda == 0.0 ? 0.0 : 2.0 * s.ce.lambda * c.lse;
  RowStats st{};  // what element_gradient reads of the row
  st.m = c.M;
  st.mu_m = c.mu_m;
  for (int64_t j = 0; j < s.local; ++j) {
    const int64_t global = s.start + j;
    const double p = std::exp((a[j] - c.M) - c.ls);
    double d_ce = target_weight * (p - (global == y ? 1.0 : 0.0));
    if (smoothing != 0.0) d_ce += smoothing * (c.Omega * p - omega_of(s.ce, global));
    double d_a = up.k1 * d_ce;
    if (z_loss != 0.0) d_a += up.kz1 * z_loss * p;
    if (s.ce.token_scaling) d_a *= ts;
    a[j] = element_gradient(s.ce, a[j], p, st, d_a, y >= 0, up, terms);
  }
}

// The gradient of rows [first_row, first_row + count) of the shard: row i of the job's logits
// at logits + i · logits_stride, of its gradient at grad + i · grad_stride (may be the logits:
// each row is read whole before it is written). Ignored rows get 0, invalid and inconsistent
// rows NaN. Returns the error flags to set.
uint32_t gradient_rows(const VpSetup& s, const float* gathered, int64_t ranks, int64_t first_row,
                       int64_t count, const void* logits, int64_t logits_stride, int logits_dtype,
                       void* grad, int64_t grad_stride, int grad_dtype, ShardScratch& scratch) {
  const size_t lsize = dtype_size(logits_dtype), gsize = dtype_size(grad_dtype);
  std::atomic<uint32_t> flags{0};
  parallel_for(count, scratch.threads, [&](int64_t begin, int64_t end, int thread) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = first_row + i;
      const RowTarget t = row_target(s.ce, r);
      const Combined c = combine(s, gathered, ranks, r, t.kind);
      void* g_row = static_cast<char*>(grad) + size_t(i) * size_t(grad_stride) * gsize;
      if (t.kind == RowKind::kInvalid) flags.fetch_or(FCE_FLAG_TARGET_OUT_OF_RANGE);
      if (!c.consistent) flags.fetch_or(FCE_FLAG_SHARDS_INCONSISTENT);
      const RowTerms terms = row_terms(s.ce, r);  // rule 18: an ignored row's terms flow
      const bool ignored_terms = t.kind == RowKind::kIgnored && terms.any();
      if (!c.consistent || (t.kind != RowKind::kScored && !ignored_terms)) {
        fill_row(grad_dtype, g_row, s.local,
                 c.consistent && t.kind == RowKind::kIgnored ? 0.0f : NAN);
        continue;
      }
      const void* z = static_cast<const char*>(logits) + size_t(i) * size_t(logits_stride) * lsize;
      const Upstream up = upstream_scales(s.ce, r);
      const double ts = token_scale(s, c);
      if (s.fast) {
        float* a = scratch.frows[size_t(thread)].data();
        load_row_f32(logits_dtype, z, s.local, a);
        if (grad_dtype == FCE_FLOAT32) {
          gradient_shard_f32(s, a, c, t, up, ts, static_cast<float*>(g_row));
        } else {
          gradient_shard_f32(s, a, c, t, up, ts, a);
          for (int64_t j = 0; j < s.local; ++j) store_float(grad_dtype, g_row, j, a[j]);
        }
      } else {
        double* a = scratch.rows[size_t(thread)].data();
        load_row(logits_dtype, z, s.local, a);
        scale_and_softcap_shard(s, a);
        gradient_shard_f64(s, a, c, r, t.kind == RowKind::kScored ? t.y : -1, up, ts, terms);
        store_row(grad_dtype, a, s.local, g_row);
      }
    }
  });
  return flags.load();
}

// ------------------------------------------------------------------ linear ----
// As lib/cpu/linear_ce.cpp: float32 cblas_sgemm over chunks of a fixed number of rows (fixed by
// rows and vocab_local, never by the workspace), the chunk's buffers in the workspace when it
// holds optimal_bytes, else in host memory.

fce_status vp_linear(const VpLinearProblem& p) {
  const bool backward = p.backward;
  if (p.vocab_local > INT_MAX || p.hidden > INT_MAX || p.hidden_row_stride > INT_MAX)
    return fail(FCE_ERROR_UNSUPPORTED,
                "%s (CPU): BLAS takes int sizes: vocab_local %lld, hidden %lld, "
                "hidden_row_stride %lld must be at most %d",
                p.fn, (long long)p.vocab_local, (long long)p.hidden,
                (long long)p.hidden_row_stride, INT_MAX);
  const int dtype = p.opt.dtype;
  const int grad_weight_dtype = p.grad_weight_fp32 ? FCE_FLOAT32 : dtype;
  const int64_t R = chunk_rows(p.rows, p.vocab_local);
  try {
    // Everything is allocated before any output is written.
    const VpSetup s = make_vp_setup(p.opt, p.rows, p.vocab_total, p.vocab_start, p.vocab_local,
                                    p.targets, p.grad_output, p.grad_lse, p.grad_entropy);
    ShardScratch scratch(s, R);
    const FloatMatrix W = as_float(dtype, p.weight, p.vocab_local, p.hidden);
    const FloatMatrix b = p.bias ? as_float(dtype, p.bias, 1, p.vocab_local) : FloatMatrix();
    ChunkBuffers chunk(
        chunk_layout(dtype, R, p.hidden, p.vocab_local,
                     backward && p.grad_hidden_dtype != FCE_FLOAT32),
        p.workspace, p.workspace_bytes);
    WeightGrads weight_grads(grad_weight_dtype, p.grad_weight, p.grad_bias, p.accumulate,
                             p.vocab_local, p.hidden);

    uint32_t flags = 0;
    for (int64_t r0 = 0; r0 < p.rows; r0 += R) {
      const int64_t count = std::min(R, p.rows - r0);
      int64_t ldh = 0;
      const float* h = hidden_chunk(dtype, p.hidden_states, p.hidden_row_stride, p.hidden, r0, count,
                                    chunk.hidden, &ldh);
      logits_chunk(h, ldh, W, b.data(), count, p.hidden, p.vocab_local, chunk.logits);
      if (!backward) {
        stats_rows(s, r0, count, chunk.logits, p.vocab_local, FCE_FLOAT32, p.stats, scratch);
        continue;
      }
      // ∂z over z, in place
      flags |= gradient_rows(s, p.gathered, p.ranks, r0, count, chunk.logits, p.vocab_local,
                             FCE_FLOAT32, chunk.logits, p.vocab_local, FCE_FLOAT32, scratch);
      const float* dz = chunk.logits;
      if (p.grad_hidden)
        grad_hidden_chunk(p.grad_hidden_dtype, p.grad_hidden, dz, W, r0, count, p.hidden,
                          p.vocab_local, chunk.grad_hidden);
      weight_grads.add(dz, h, ldh, count);
    }
    if (!backward) return FCE_SUCCESS;

    weight_grads.store();
    if (p.error_flags) *p.error_flags |= flags;
    return FCE_SUCCESS;
  } catch (const std::bad_alloc&) {
    return fail(FCE_ERROR_OUT_OF_MEMORY,
                "%s (CPU): out of host memory (rows %lld, hidden %lld, vocab_local %lld)", p.fn,
                (long long)p.rows, (long long)p.hidden, (long long)p.vocab_local);
  }
}

}  // namespace

fce_status cpu_vp_stats(const VpStatsProblem& p) {
  try {
    const VpSetup s = make_vp_setup(p.opt, p.rows, p.vocab_total, p.vocab_start, p.vocab_local,
                                    p.targets, nullptr);
    ShardScratch scratch(s, p.rows);
    stats_rows(s, 0, p.rows, p.logits, p.row_stride, p.opt.dtype, p.stats, scratch);
    return FCE_SUCCESS;
  } catch (const std::bad_alloc&) {
    return fail(FCE_ERROR_OUT_OF_MEMORY,
                "%s (CPU): out of host memory for %lld rows of %lld classes", p.fn,
                (long long)p.rows, (long long)p.vocab_local);
  }
}

// Scratch lives in host memory (a row per thread, a few doubles per row).
size_t cpu_vp_workspace_size(const CeOptions&, int64_t, int64_t, int64_t, int64_t, bool) {
  return 0;
}

fce_status cpu_vp(const VpProblem& p) {
  try {
    if (!p.backward) return vp_loss(p);
    const VpSetup s = make_vp_setup(p.opt, p.rows, p.vocab_total, p.vocab_start, p.vocab_local,
                                    p.targets, p.grad_output, p.grad_lse, p.grad_entropy);
    ShardScratch scratch(s, p.rows);
    const uint32_t flags =
        gradient_rows(s, p.gathered, p.ranks, 0, p.rows, p.logits, p.row_stride, p.opt.dtype,
                      p.grad, p.grad_row_stride, p.opt.dtype, scratch);
    if (p.error_flags) *p.error_flags |= flags;
    return FCE_SUCCESS;
  } catch (const std::bad_alloc&) {
    return fail(FCE_ERROR_OUT_OF_MEMORY,
                "%s (CPU): out of host memory (ranks %lld, rows %lld, vocab_total %lld)", p.fn,
                (long long)p.ranks, (long long)p.rows, (long long)p.vocab_total);
  }
}

void cpu_vp_linear_workspace_size(const CeOptions& opt, int64_t /*ranks*/, int64_t rows,
                                  int64_t hidden, int64_t /*vocab_total*/, int64_t vocab_local,
                                  bool backward, int grad_hidden_dtype, bool /*grad_weight_fp32*/,
                                  size_t* min_bytes, size_t* optimal_bytes) {
  const ChunkLayout one_row =
      chunk_layout(opt.dtype, 1, hidden, vocab_local,
                   backward && grad_hidden_dtype != FCE_FLOAT32);
  const ChunkLayout chunk = chunk_layout(opt.dtype, chunk_rows(rows, vocab_local), hidden,
                                         vocab_local, backward && grad_hidden_dtype != FCE_FLOAT32);
  if (min_bytes) *min_bytes = one_row.total();
  if (optimal_bytes) *optimal_bytes = chunk.total();
}

fce_status cpu_vp_linear(const VpLinearProblem& p) { return vp_linear(p); }

}  // namespace fce
