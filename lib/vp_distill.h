// vp_distill.h — the vocabulary-parallel distillation (fce_vp_distill_*, docs/semantics.md rule
// 22) between the ABI layer (lib/api_vp_distill.cpp) and the backends (lib/cpu/vp_distill.cpp,
// lib/cuda/vocab_parallel/distill.cu): the statistics' layout, the problems, every argument
// checked, and the combination of the gathered statistics of one row, written once for the
// host and the device (in double on both: P ranks per row, cheap next to the row's elements).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "distill.h"

#if defined(__CUDACC__)
#define FCE_VD_HD __host__ __device__
#else
#define FCE_VD_HD
#endif

namespace fce {

// FCE_VP_DISTILL_STATS float32 per row of a shard; u the student's a / T, v the teacher's, each
// shard's sums relative to b = its maximum (0 when that is −inf), as rule 22 writes them.
enum VdStat {
  kVdMaxU = 0,    // round 1: m_u (NaN if any u_j is NaN); round 2: the combined M_u
  kVdSumU = 1,    // round 1: s_u = Σ exp(u_j − b_u); round 2: the combined ls_u = log S_u
  kVdMaxV = 2,    // as kVdMaxU for v
  kVdSumV = 3,    // as kVdSumU for v
  kVdCross = 4,   // round 1: c_r (forward or reverse KL; 0 for the JSD); round 2: A_r
  kVdJsdP = 5,    // round 1: 0; round 2: B_r
  kVdArgmax = 6,  // int32 bits: the global index of the shard's student argmax; round 2: with
                  // kVdTopBit when round 1's statistics failed the tiling check
  kVdLocal = 7,   // int32 bits: vocab_local; round 2: with kVdTopBit
  kVdCount = 8
};
static_assert(kVdCount == FCE_VP_DISTILL_STATS, "vp distill stats layout");
constexpr uint32_t kVdTopBit = 0x80000000u;

// The divergence rule 20 computes (the JSD at β = 0 and β = 1 is the forward and the reverse
// KL) and the rounds of statistics it needs.
enum VdDiv { kVdForward = 0, kVdReverse = 1, kVdJsd = 2 };
FCE_VD_HD inline int vd_divergence(int divergence, float beta) {
  if (divergence == FCE_DIVERGENCE_FORWARD_KL) return kVdForward;
  if (divergence == FCE_DIVERGENCE_REVERSE_KL) return kVdReverse;
  return beta == 0.0f ? kVdForward : beta == 1.0f ? kVdReverse : kVdJsd;
}
FCE_VD_HD inline int vd_rounds(int div) { return div == kVdJsd ? 2 : 1; }

FCE_VD_HD inline uint32_t vd_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}
FCE_VD_HD inline float vd_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// What the sums of a shard are relative to: its maximum, or 0 when that is −inf (or NaN: the
// sums turn NaN by themselves).
FCE_VD_HD inline double vd_base(double m) { return m > -HUGE_VAL ? m : 0.0; }

// One row's gathered statistics combined (rule 22), ranks in gathered order.
struct VdRow {
  bool ok;                  // the tiling check passed
  double Mu, lsu, Mv, lsv;  // log p_j = (u_j − Mu) − lsu, log q_j = (v_j − Mv) − lsv
  double loss;              // the row's divergence (the statistics of the divergence's last round)
  double k;                 // the gradient's correction: the reverse KL's loss, the JSD's K
};

// gathered [ranks, rows, kVdCount]; round: which round's statistics they are (1: the maxima and
// sums; 2: the JSD's, carrying round 1's combination); div: vd_divergence's.
FCE_VD_HD inline VdRow vd_combine(const float* gathered, int64_t ranks, int64_t rows, int64_t r,
                                  int64_t vocab_total, int round, int div, double beta) {
  const double inf = HUGE_VAL, nan = inf - inf;
  auto at = [&](int64_t q) {
    return gathered +
           (static_cast<uint64_t>(q) * static_cast<uint64_t>(rows) + static_cast<uint64_t>(r)) *
               kVdCount;
  };
  VdRow c;
  const uint32_t round_bit = round == 2 ? kVdTopBit : 0u;
  bool ok = true;
  int64_t local_sum = 0;
  for (int64_t q = 0; q < ranks; ++q) {
    const uint32_t local = vd_bits(at(q)[kVdLocal]), argmax = vd_bits(at(q)[kVdArgmax]);
    ok = ok && (local & kVdTopBit) == round_bit && !(round == 2 && (argmax & kVdTopBit));
    local_sum += static_cast<int64_t>(local & ~kVdTopBit);
    for (int64_t o = 0; o < q; ++o)  // a shard gathered twice reports its argmax twice
      ok = ok && ((vd_bits(at(o)[kVdArgmax]) ^ argmax) & ~kVdTopBit) != 0u;
  }
  ok = ok && local_sum == vocab_total;
  if (round == 2) {  // the combination every rank carried, the same bits on all of them
    const float* first = at(0);
    for (int64_t q = 1; q < ranks; ++q)
      for (int s = kVdMaxU; s <= kVdSumV; ++s) ok = ok && vd_bits(at(q)[s]) == vd_bits(first[s]);
    c.Mu = first[kVdMaxU];
    c.lsu = first[kVdSumU];
    c.Mv = first[kVdMaxV];
    c.lsv = first[kVdSumV];
    double A = 0.0, B = 0.0;
    for (int64_t q = 0; q < ranks; ++q) {
      A += at(q)[kVdCross];
      B += at(q)[kVdJsdP];
    }
    c.loss = beta * A + (1.0 - beta) * B;
    c.k = B;
    c.ok = ok;
    return c;
  }
  // M = max_r m_r (NaN if any is NaN); S = Σ s_r exp(b_r − M) over the ranks with m_r > −inf
  double Mu = -inf, Mv = -inf;
  bool nan_u = false, nan_v = false;
  for (int64_t q = 0; q < ranks; ++q) {
    const double mu = at(q)[kVdMaxU], mv = at(q)[kVdMaxV];
    nan_u = nan_u || mu != mu;
    nan_v = nan_v || mv != mv;
    if (mu > Mu) Mu = mu;
    if (mv > Mv) Mv = mv;
  }
  if (nan_u) Mu = nan;
  if (nan_v) Mv = nan;
  double Su = 0.0, Sv = 0.0, C = 0.0;
  for (int64_t q = 0; q < ranks; ++q) {
    const float* st = at(q);
    const double mu = st[kVdMaxU], mv = st[kVdMaxV];
    const double du = vd_base(mu) - Mu, dv = vd_base(mv) - Mv;
    if (mu > -inf) Su += double(st[kVdSumU]) * exp(du);
    if (mv > -inf) Sv += double(st[kVdSumV]) * exp(dv);
    // the cross sum: KL(q‖p) over the ranks where q has mass, KL(p‖q) where p has
    if (div == kVdForward && mv > -inf)
      C += exp(dv) * (double(st[kVdCross]) + double(st[kVdSumV]) * (dv - du));
    if (div == kVdReverse && mu > -inf)
      C += exp(du) * (double(st[kVdCross]) + double(st[kVdSumU]) * (du - dv));
  }
  if (nan_u) Su = nan;
  if (nan_v) Sv = nan;
  c.Mu = Mu;
  c.lsu = log(Su);
  c.Mv = Mv;
  c.lsv = log(Sv);
  c.loss = div == kVdForward   ? C / Sv + (c.lsu - c.lsv)
           : div == kVdReverse ? C / Su + (c.lsv - c.lsu)
                               : 0.0;
  c.k = div == kVdReverse ? c.loss : 0.0;
  c.ok = ok;
  return c;
}

// fce_vp_distill_stats, every argument checked; also one token chunk of
// fce_vp_linear_distill_stats (rows [first, first + count) of the call's rows, whose logits the
// chunk made: the per-row buffers stay the call's, indexed by the call's row).
struct VpDistillStatsProblem {
  const char* fn;  // "fce_vp_distill_stats"
  DistillOptions opt;
  int round;  // 1 or 2 (2 only for the JSD with 0 < β < 1)
  int64_t ranks, rows, vocab_total, vocab_start, vocab_local;
  int64_t first, count;                    // the rows computed (the whole call: 0, rows)
  int64_t row_stride, teacher_row_stride;  // >= vocab_local
  const void* logits;                      // the student's shard [count, row_stride]
  const void* teacher;                     // the teacher's shard [count, teacher_row_stride]
  const float* previous;                   // round 2: round 1's gathered [ranks, rows, 8]
  float* stats;                            // [rows, FCE_VP_DISTILL_STATS], 16-byte aligned
  void* stream;
};

// fce_vp_distill_loss (backward false) and fce_vp_distill_backward; the backward also of one
// token chunk of fce_vp_linear_distill_backward (rows [first, first + count) as above: logits,
// teacher and grad hold the chunk's rows; targets, gathered and grad_output are the call's).
struct VpDistillProblem {
  const char* fn;  // "fce_vp_distill_loss" or "fce_vp_distill_backward"
  bool backward;
  DistillOptions opt;
  int64_t ranks, rows, vocab_total;
  int64_t vocab_start, vocab_local;                         // backward only
  int64_t first, count;                                     // backward only: the rows computed
  int64_t row_stride, teacher_row_stride, grad_row_stride;  // backward only, >= vocab_local
  const void* targets;                                      // [rows] or nullptr
  const float* gathered;     // the last round's [ranks, rows, FCE_VP_DISTILL_STATS]
  float* loss;               // loss: [1] or [rows]
  float* lse;                // loss: optional [rows]
  uint32_t* error_flags;     // loss: optional
  const void* logits;        // backward: the student's shard [count, row_stride]
  const void* teacher;       // backward: the teacher's shard [count, teacher_row_stride]
  void* grad;                // backward: [count, grad_row_stride]; may == logits
  const float* grad_output;  // backward: nullptr = 1
  void* workspace;
  size_t workspace_bytes;
  void* stream;
};

// fce_vp_linear_distill_stats (backward false) and fce_vp_linear_distill_backward: the
// student's shard of logits z = h·W_sᵀ and the teacher's t = h'·W'_sᵀ made in token chunks in
// the workspace, each chunk then the problems above.
struct VpLinearDistillProblem {
  const char* fn;  // "fce_vp_linear_distill_stats" or "fce_vp_linear_distill_backward"
  bool backward;
  DistillOptions opt;
  int round;  // stats: 1 or 2
  int64_t ranks, rows, hidden, teacher_hidden, vocab_total, vocab_start, vocab_local;
  int64_t hidden_row_stride, teacher_hidden_row_stride;  // >= hidden / teacher_hidden
  const void* hidden_states;                             // [rows, hidden_row_stride]
  const void* weight;                                    // [vocab_local, hidden]
  const void* teacher_hidden_states;                     // [rows, teacher_hidden_row_stride]
  const void* teacher_weight;                            // [vocab_local, teacher_hidden]
  const float* previous;                                 // stats, round 2: [ranks, rows, 8]
  float* stats;                                          // stats: [rows, 8]
  const void* targets;                                   // backward: [rows] or nullptr
  const float* gathered;                                 // backward: [ranks, rows, 8]
  const float* grad_output;                              // backward: nullptr = 1
  void* grad_hidden;      // backward, optional: the partial ∂h [rows, hidden] dense
  int grad_hidden_dtype;  // FCE_FLOAT32 or opt.dtype
  void* grad_weight;      // backward, optional: [vocab_local, hidden], dtype or f32
  bool grad_weight_fp32;
  bool accumulate;
  void* workspace;
  size_t workspace_bytes;
  void* stream;
};

// The problems of one token chunk of p, rows [r0, r0 + count): the chunk's logits z and t
// (`ld` elements apart, of opt.dtype) made by the chunk; the call's per-row buffers. The backward
// writes ∂z over z; its workspace is the backend's of fce_vp_distill_backward.
template <class Chunk>
void vd_chunk_sizes(Chunk* q, const VpLinearDistillProblem& p, const DistillOptions& opt,
                    int64_t r0, int64_t count, const void* t, int64_t ld) {
  q->fn = p.fn;
  q->opt = opt;
  q->ranks = p.ranks;
  q->rows = p.rows;
  q->vocab_total = p.vocab_total;
  q->vocab_start = p.vocab_start;
  q->vocab_local = p.vocab_local;
  q->first = r0;
  q->count = count;
  q->row_stride = q->teacher_row_stride = ld;
  q->teacher = t;
  q->stream = p.stream;
}
inline VpDistillStatsProblem vd_stats_chunk(const VpLinearDistillProblem& p,
                                            const DistillOptions& opt, int64_t r0, int64_t count,
                                            const void* z, const void* t, int64_t ld) {
  VpDistillStatsProblem q{};
  vd_chunk_sizes(&q, p, opt, r0, count, t, ld);
  q.round = p.round;
  q.logits = z;
  q.previous = p.previous;
  q.stats = p.stats;
  return q;
}
inline VpDistillProblem vd_backward_chunk(const VpLinearDistillProblem& p,
                                          const DistillOptions& opt, int64_t r0, int64_t count,
                                          void* z, const void* t, int64_t ld, void* workspace,
                                          size_t workspace_bytes) {
  VpDistillProblem q{};
  vd_chunk_sizes(&q, p, opt, r0, count, t, ld);
  q.backward = true;
  q.grad_row_stride = ld;
  q.targets = p.targets;
  q.gathered = p.gathered;
  q.logits = z;
  q.grad = z;  // ∂z over z, in place
  q.grad_output = p.grad_output;
  q.workspace = workspace;
  q.workspace_bytes = workspace_bytes;
  return q;
}

// ---- CPU backend (lib/cpu/vp_distill.cpp, lib/cpu/vp_linear_distill.cpp) ----
fce_status cpu_vp_distill_stats(const VpDistillStatsProblem& p);
size_t cpu_vp_distill_workspace_size(const DistillOptions& opt, int64_t ranks, int64_t rows,
                                     bool backward);
fce_status cpu_vp_distill(const VpDistillProblem& p);
fce_status cpu_vp_linear_distill(const VpLinearDistillProblem& p);

// ---- CUDA backend (lib/cuda/vocab_parallel/distill.cu, linear_distill.cu); stubs in a build
// without it ----
fce_status cuda_vp_distill_stats(const VpDistillStatsProblem& p);
size_t cuda_vp_distill_workspace_size(const DistillOptions& opt, int64_t ranks, int64_t rows,
                                      bool backward);
fce_status cuda_vp_distill(const VpDistillProblem& p);
void cuda_vp_linear_distill_workspace_size(const DistillOptions& opt, int64_t rows, int64_t hidden,
                                           int64_t teacher_hidden, int64_t vocab_local,
                                           bool backward, size_t* min_bytes, size_t* optimal_bytes);
fce_status cuda_vp_linear_distill(const VpLinearDistillProblem& p);

}  // namespace fce
