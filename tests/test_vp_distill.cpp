// test_vp_distill.cpp — the vocabulary-parallel distillation (docs/semantics.md rule 22), P = 1..4
// ranks simulated in one process, each holding its columns of the student's and the teacher's
// logits: fce_vp_distill_stats (each round the divergence needs), the all-gather made here, then
// fce_vp_distill_loss and fce_vp_distill_backward, against the unsharded fce_distill on the same
// backend and distill_ref.h's float64 reference; every rank's loss bitwise the same; adversarial
// rows; statistics that do not tile the vocabulary or are of the wrong round; the empty problem;
// and the refusals with their messages. FCE_TEST_BACKEND picks the backend.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "distill_ref.h"
#include "vp_common.h"

namespace {

using namespace fcet;
using namespace distillref;

static_assert(FCE_VP_DISTILL_STATS == FCE_VP_STATS, "vp_common.h's gather moves rows of 8 floats");
constexpr double kInf = std::numeric_limits<double>::infinity();

struct VdCase {
  std::string name;
  Cfg c;
  int dtype = FCE_FLOAT32;
  int target_dtype = FCE_INT64;
  int64_t N = 11, V = 203;
  int64_t pad = 3;  // the student's and the gradient's row stride: vocab_local + pad (the
                    // teacher's: + pad + 2)
  bool targets = true, inplace = false, uneven = true, permuted = false;
  double ignore_frac = 0.3;
  uint64_t seed = 1;
  std::vector<int> ranks = {1, 2, 3, 4};
};

std::string label(const VdCase& k) {
  std::ostringstream s;
  s << k.name << " [" << backend_name() << " " << dtype_name(k.dtype) << " div " << k.c.divergence
    << " beta " << k.c.beta << " T " << k.c.T << " s " << k.c.s << " c " << k.c.c << " "
    << reduction_name(k.c.reduction) << " N=" << k.N << " V=" << k.V
    << (k.inplace ? " inplace" : "") << (k.uneven ? " uneven" : " even")
    << (k.targets ? "" : " no targets") << (k.permuted ? " permuted" : "") << "]";
  return s.str();
}

fce_options options_of(const VdCase& k) {
  fce_options o = test_options();
  o.dtype = k.dtype;
  o.target_dtype = k.target_dtype;
  o.reduction = k.c.reduction;
  o.logit_scale = static_cast<float>(k.c.s);
  o.softcap = static_cast<float>(k.c.c);
  return o;
}

// What rank q passes: its shard, its teacher (its shard of the teacher's logits, their stride)
// and its options (the student's strides).
struct RankArgs {
  fce_vp_shard shard;
  fce_teacher teacher;
  fce_options options;
};
RankArgs rank_args(const VdCase& k, const fce_options& o, const fce_teacher& te,
                   const std::vector<Shard>& shards, const std::vector<Buf>& tb, int q) {
  const Shard& s = shards[static_cast<size_t>(q)];
  RankArgs a{{static_cast<int64_t>(shards.size()), k.V, s.start, s.local, nullptr, nullptr}, te, o};
  a.teacher.logits = tb[static_cast<size_t>(q)].ptr();
  a.teacher.row_stride = s.local + k.pad + 2;
  a.options.row_stride = s.local + k.pad;
  a.options.grad_row_stride = s.local + k.pad;
  return a;
}

struct Outs {
  std::vector<double> loss, lse, grad;
  uint32_t flags = 0;
};

// The ranks' statistics of every round, gathered (rank order, or permuted); the last round's.
Buf run_rounds(const VdCase& k, const fce_options& o, const fce_teacher& te,
               const std::vector<Shard>& shards, const std::vector<Buf>& zb,
               const std::vector<Buf>& tb) {
  const int P = static_cast<int>(shards.size());
  int32_t rounds = 0;
  EXPECT_EQ(fce_vp_distill_rounds(&te, &rounds), FCE_SUCCESS) << fce_last_error();
  const int div = te.divergence;
  EXPECT_EQ(rounds, div == FCE_DIVERGENCE_JSD && te.beta != 0.0f && te.beta != 1.0f ? 2 : 1);
  Buf previous;
  for (int32_t round = 1; round <= rounds; ++round) {
    std::vector<Buf> stats;
    for (int q = 0; q < P; ++q) {
      const RankArgs ra = rank_args(k, o, te, shards, tb, q);
      const fce_vp_shard& sh = ra.shard;
      const fce_teacher& tq = ra.teacher;
      const fce_options& oq = ra.options;
      Buf st = poisoned(mat(FCE_FLOAT32, k.N, FCE_VP_DISTILL_STATS));
      EXPECT_EQ(fce_vp_distill_stats(&oq, &tq, &sh, round, k.N, zb[static_cast<size_t>(q)].ptr(),
                                     round == 2 ? previous.p<const float>() : nullptr,
                                     st.p<float>(), test_stream()),
                FCE_SUCCESS)
          << "round " << round << " rank " << q << ": " << fce_last_error();
      EXPECT_TRUE(finish());
      st.pull();
      stats.push_back(std::move(st));
    }
    std::vector<const Buf*> order;
    for (int q : rank_order(P, k.permuted)) order.push_back(&stats[static_cast<size_t>(q)]);
    previous = gather(order, k.N);
  }
  return previous;
}

// The loss of every rank from `gathered` (bitwise the same on all of them), and the gradient of
// every rank's columns assembled into [N, V].
void finish_step(const VdCase& k, const fce_options& o, const fce_teacher& te,
                 const std::vector<Shard>& shards, std::vector<Buf>& zb, const std::vector<Buf>& tb,
                 const Buf& gathered, const Buf& yb, const Buf& gb, Outs* out_res) {
  const int P = static_cast<int>(shards.size());
  const bool none = k.c.reduction == FCE_REDUCTION_NONE;
  const Mat lm = vec(FCE_FLOAT32, none ? k.N : 1), rm = vec(FCE_FLOAT32, k.N);
  const void* targets = k.targets ? yb.ptr() : nullptr;
  Outs& res = *out_res;
  res.grad.assign(static_cast<size_t>(k.N * k.V), 0.0);
  std::vector<uint8_t> first_loss, first_lse;
  for (int q = 0; q < P; ++q) {
    SCOPED_TRACE("rank " + std::to_string(q) + " of " + std::to_string(P));
    const Shard& s = shards[static_cast<size_t>(q)];
    const RankArgs ra = rank_args(k, o, te, shards, tb, q);
    const fce_vp_shard& sh = ra.shard;
    const fce_teacher& tq = ra.teacher;
    const fce_options& oq = ra.options;
    Buf loss = poisoned(lm), lse = poisoned(rm), flags = flags_buf(0);
    size_t wsb = 0;
    ASSERT_EQ(fce_vp_distill_loss_workspace_size(&oq, &tq, P, k.N, k.V, &wsb), FCE_SUCCESS)
        << fce_last_error();
    Buf ws = workspace_buf(wsb);
    fce_outputs out = FCE_OUTPUTS_INIT;
    out.loss = loss.p<float>();
    out.lse = lse.p<float>();
    out.error_flags = flags.p<uint32_t>();
    ASSERT_EQ(fce_vp_distill_loss(&oq, &tq, &sh, k.N, targets, gathered.p<const float>(), &out,
                                  ws.ptr(), wsb, test_stream()),
              FCE_SUCCESS)
        << fce_last_error();
    ASSERT_TRUE(finish());
    loss.pull(), lse.pull(), flags.pull();
    if (q == 0) {
      res.loss = read_mat(loss, lm);
      res.lse = read_mat(lse, rm);
      res.flags = read_flags(flags);
      first_loss = loss.mirror();
      first_lse = lse.mirror();
    } else {
      EXPECT_TRUE(bitwise_equal(loss.mirror(), first_loss, "loss of this rank vs rank 0"));
      EXPECT_TRUE(bitwise_equal(lse.mirror(), first_lse, "lse of this rank vs rank 0"));
      EXPECT_EQ(read_flags(flags), res.flags);
    }
    // the gradient of the rank's columns, in place over its logits or in a buffer of its own
    const Mat gm = mat(k.dtype, k.N, s.local, s.local + k.pad);
    Buf own = k.inplace ? Buf() : poisoned(gm);
    Buf& grad = k.inplace ? zb[static_cast<size_t>(q)] : own;
    ASSERT_EQ(fce_vp_distill_backward_workspace_size(&oq, &tq, P, k.N, k.V, s.local, &wsb),
              FCE_SUCCESS)
        << fce_last_error();
    Buf ws2 = workspace_buf(wsb);
    fce_gradients g = FCE_GRADIENTS_INIT;
    g.grad_logits = grad.ptr();
    g.grad_output = gb.p<const float>();
    ASSERT_EQ(fce_vp_distill_backward(&oq, &tq, &sh, k.N, zb[static_cast<size_t>(q)].ptr(), targets,
                                      gathered.p<const float>(), &g, ws2.ptr(), wsb, test_stream()),
              FCE_SUCCESS)
        << fce_last_error();
    ASSERT_TRUE(finish());
    grad.pull();
    EXPECT_TRUE(all_written(grad, gm, "grad_logits"));
    const std::vector<double> gq = read_mat(grad, gm);
    for (int64_t r = 0; r < k.N; ++r)
      for (int64_t j = 0; j < s.local; ++j)
        res.grad[static_cast<size_t>(r * k.V + s.start + j)] =
            gq[static_cast<size_t>(r * s.local + j)];
  }
}

// The unsharded fce_distill on the same inputs.
Outs unsharded(const VdCase& k, const std::vector<double>& z, const std::vector<double>& t,
               const Buf& yb, const Buf& gb) {
  const bool none = k.c.reduction == FCE_REDUCTION_NONE;
  const Mat lm = vec(FCE_FLOAT32, none ? k.N : 1), rm = vec(FCE_FLOAT32, k.N),
            zm = mat(k.dtype, k.N, k.V);
  Buf zb = matrix_buf(k.dtype, k.N, k.V, k.V, z), tb = matrix_buf(k.dtype, k.N, k.V, k.V, t);
  Buf loss = poisoned(lm), lse = poisoned(rm), grad = poisoned(zm);
  fce_options o = options_of(k);
  fce_teacher te = teacher_of(k.c);
  te.logits = tb.ptr();
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  out.lse = lse.p<float>();
  fce_gradients g = FCE_GRADIENTS_INIT;
  g.grad_logits = grad.ptr();
  g.grad_output = gb.p<const float>();
  size_t wsb = 0;
  Outs res;
  EXPECT_EQ(fce_distill_workspace_size(&o, &te, k.N, k.V, &wsb), FCE_SUCCESS);
  Buf ws = workspace_buf(wsb);
  EXPECT_EQ(fce_distill(&o, &te, k.N, k.V, zb.ptr(), k.targets ? yb.ptr() : nullptr, &out, &g,
                        ws.ptr(), wsb, test_stream()),
            FCE_SUCCESS)
      << fce_last_error();
  EXPECT_TRUE(finish());
  loss.pull(), lse.pull(), grad.pull();
  res.loss = read_mat(loss, lm);
  res.lse = read_mat(lse, rm);
  res.grad = read_mat(grad, zm);
  return res;
}

// Runs the case for each number of ranks against fce_distill and the reference (rows given, or
// random ones).
void run_case(const VdCase& k, const std::vector<double>* zs = nullptr,
              const std::vector<double>* ts = nullptr) {
  SCOPED_TRACE(label(k));
  std::mt19937_64 rng(k.seed);
  const std::vector<double> z = zs ? *zs : random_logits(rng, k.dtype, k.N, k.V, 0.5, 4.0, 5.0);
  const std::vector<double> t = ts ? *ts : random_logits(rng, k.dtype, k.N, k.V, 0.5, 4.0, 5.0);
  const std::vector<int64_t> y = random_targets(rng, k.N, k.V, k.ignore_frac);
  const bool none = k.c.reduction == FCE_REDUCTION_NONE;
  const std::vector<double> g = random_uniform(rng, none ? size_t(k.N) : 1, 0.5, 2.0);
  const Buf yb = targets_buf(y, k.target_dtype), gb = f32_buf(g);
  const Ref ref = reference(k.c, k.N, k.V, z, t, k.targets ? &y : nullptr, g);
  const Outs whole = unsharded(k, z, t, yb, gb);
  EXPECT_TRUE(close_normwise(whole.loss, ref.loss, loss_tol(), "unsharded loss"));
  const fce_options o = options_of(k);
  const fce_teacher te = teacher_of(k.c);
  for (int P : k.ranks) {
    SCOPED_TRACE(std::to_string(P) + " ranks");
    const std::vector<Shard> shards = make_shards(k.V, P, k.uneven);
    std::vector<Buf> zb, tb;
    for (const Shard& s : shards) {
      zb.push_back(matrix_buf(k.dtype, k.N, s.local, s.local + k.pad,
                              columns(z, k.N, k.V, s.start, s.local)));
      tb.push_back(matrix_buf(k.dtype, k.N, s.local, s.local + k.pad + 2,
                              columns(t, k.N, k.V, s.start, s.local)));
    }
    const Buf gathered = run_rounds(k, o, te, shards, zb, tb);
    Outs vp;
    finish_step(k, o, te, shards, zb, tb, gathered, yb, gb, &vp);
    if (::testing::Test::HasFatalFailure()) return;
    EXPECT_EQ(vp.flags, 0u);
    EXPECT_TRUE(close_normwise(vp.loss, whole.loss, loss_tol(), "loss vs fce_distill"));
    EXPECT_TRUE(close_normwise(vp.loss, ref.loss, loss_tol(), "loss vs the reference"));
    EXPECT_TRUE(close_normwise(vp.lse, whole.lse, 1e-6, "lse vs fce_distill"));
    EXPECT_TRUE(close_normwise(vp.lse, ref.lse, 1e-6, "lse vs the reference"));
    EXPECT_TRUE(close_normwise(vp.grad, whole.grad, grad_tol(k.dtype), "grad vs fce_distill"));
    EXPECT_TRUE(close_normwise(vp.grad, ref.grad, grad_tol(k.dtype), "grad vs the reference"));
  }
}

class VpDistill : public BackendTest {};

TEST_F(VpDistill, DivergencesDtypesReductions) {
  uint64_t seed = 100;
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16, FCE_FLOAT16})
    for (int div : {FCE_DIVERGENCE_FORWARD_KL, FCE_DIVERGENCE_REVERSE_KL, FCE_DIVERGENCE_JSD})
      for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE}) {
        VdCase k;
        k.name = "matrix";
        k.dtype = dtype;
        k.c.divergence = div;
        k.c.reduction = red;
        k.c.beta = 0.3;
        k.c.T = 2.0;
        k.seed = ++seed;
        run_case(k);
      }
}

TEST_F(VpDistill, TemperatureScaleSoftcap) {
  uint64_t seed = 200;
  for (double T : {0.5, 3.0})
    for (int div : {FCE_DIVERGENCE_FORWARD_KL, FCE_DIVERGENCE_REVERSE_KL, FCE_DIVERGENCE_JSD}) {
      VdCase k;
      k.name = "scale and softcap";
      k.c.divergence = div;
      k.c.T = T;
      k.c.s = 0.8;
      k.c.c = 12.0;
      k.seed = ++seed;
      run_case(k);
    }
  VdCase neg;  // a negative scale: the order of the logits reversed
  neg.name = "negative scale";
  neg.c.divergence = FCE_DIVERGENCE_JSD;
  neg.c.s = -1.5;
  neg.seed = ++seed;
  run_case(neg);
}

// JSD at β = 0 and β = 1 is the forward and the reverse KL: one round.
TEST_F(VpDistill, JsdBetaEnds) {
  for (double beta : {0.0, 1.0, 0.9}) {
    VdCase k;
    k.name = "JSD ends";
    k.c.divergence = FCE_DIVERGENCE_JSD;
    k.c.beta = beta;
    k.seed = 300;
    run_case(k);
  }
}

TEST_F(VpDistill, InPlaceTargetsEvenShardsPermuted) {
  const CaseEdits<VdCase> edits = {
      {"in place (bfloat16)",
       [](VdCase& k) {
         k.inplace = true;
         k.dtype = FCE_BFLOAT16;
       }},
      {"no targets, even shards",
       [](VdCase& k) {
         k.targets = false;
         k.uneven = false;
       }},
      {"int32 targets, permuted gather",
       [](VdCase& k) {
         k.target_dtype = FCE_INT32;
         k.permuted = true;
       }},
      {"every row ignored", [](VdCase& k) { k.ignore_frac = 1.0; }},
  };
  uint64_t seed = 400;
  for (int div : {FCE_DIVERGENCE_FORWARD_KL, FCE_DIVERGENCE_REVERSE_KL, FCE_DIVERGENCE_JSD})
    for (const auto& [name, edit] : edits) {
      VdCase k;
      k.name = name;
      k.c.divergence = div;
      k.seed = ++seed;
      edit(k);
      run_case(k);
    }
  VdCase wide;  // rows longer than a block's threads many times over
  wide.name = "long rows";
  wide.c.divergence = FCE_DIVERGENCE_JSD;
  wide.N = 3;
  wide.V = 9000;
  wide.ranks = {1, 3};
  run_case(wide);
}

// Rows relative to their maxima: huge offsets, −inf entries, a shard of −inf in both rows, a
// teacher shard of −inf (forward KL finite), a one-hot student.
TEST_F(VpDistill, AdversarialRows) {
  const int64_t V = 64, N = 6;
  std::mt19937_64 rng(9);
  std::vector<double> z = random_logits(rng, FCE_FLOAT32, N, V, 0.5, 3.0, 0.0);
  std::vector<double> t = random_logits(rng, FCE_FLOAT32, N, V, 0.5, 3.0, 0.0);
  for (int64_t j = 0; j < V; ++j) {
    z[0 * V + j] = static_cast<float>(1e30 + z[0 * V + j] * 1e24);  // huge offsets
    t[0 * V + j] = static_cast<float>(-1e30 + t[0 * V + j] * 1e24);
    if (j % 3 == 0) z[1 * V + j] = t[1 * V + j] = -kInf;  // −inf where both are 0
    if (j < 40) z[2 * V + j] = t[2 * V + j] = -kInf;      // whole shards of −inf in both
    if (j >= 30) t[3 * V + j] = -kInf;                    // teacher zeros: forward KL finite
    if (j == 7) z[4 * V + j] = 1e4;                       // a one-hot student
    z[5 * V + j] = static_cast<float>(3e4 + z[5 * V + j]);
  }
  for (int div : {FCE_DIVERGENCE_FORWARD_KL, FCE_DIVERGENCE_JSD}) {
    VdCase k;
    k.name = "adversarial";
    k.N = N;
    k.V = V;
    k.c.divergence = div;
    k.ignore_frac = 0;
    run_case(k, &z, &t);
  }
  // The reverse KL of a student with mass where the teacher has none is +inf: row 3 left out.
  std::vector<double> z2 = z, t2 = t;
  for (int64_t j = 0; j < V; ++j) t2[3 * V + j] = t[1 * V + j], z2[3 * V + j] = z[1 * V + j];
  VdCase k;
  k.name = "adversarial reverse";
  k.N = N;
  k.V = V;
  k.c.divergence = FCE_DIVERGENCE_REVERSE_KL;
  k.ignore_frac = 0;
  run_case(k, &z2, &t2);
}

// A student −inf where the teacher has mass: the forward KL is +inf (its gradient −q finite).
TEST_F(VpDistill, InfiniteForwardKl) {
  const int64_t V = 16, N = 2;
  std::vector<double> z(N * V, 0.0), t(N * V, 0.0);
  for (int64_t j = 10; j < V; ++j) z[j] = -kInf;  // a whole shard of the student (P >= 2)
  z[V + 3] = -kInf;
  VdCase k;
  k.name = "infinite forward KL";
  k.N = N;
  k.V = V;
  k.c.reduction = FCE_REDUCTION_NONE;
  k.ignore_frac = 0;
  run_case(k, &z, &t);
}

// ------------------------------------------------------------------ inconsistent statistics --
class VpDistillTiling : public BackendTest {
 protected:
  static constexpr int64_t N = 5, V = 40;
  std::vector<Shard> shards = make_shards(V, 2, true);
  std::vector<Buf> zb, tb, stats1;
  Buf yb;  // buffers are made in SetUp, once the backend is known to run here
  fce_options o = test_options();
  fce_teacher te = FCE_TEACHER_INIT;
  void SetUp() override {
    BackendTest::SetUp();
    if (HasFatalFailure() || IsSkipped()) return;
    yb = targets_buf(std::vector<int64_t>{1, -100, 2, 3, 4}, FCE_INT64);
    te.divergence = FCE_DIVERGENCE_JSD;
    std::mt19937_64 rng(3);
    const std::vector<double> z = random_logits(rng, FCE_FLOAT32, N, V),
                              t = random_logits(rng, FCE_FLOAT32, N, V);
    for (const Shard& s : shards) {
      zb.push_back(
          matrix_buf(FCE_FLOAT32, N, s.local, s.local, columns(z, N, V, s.start, s.local)));
      tb.push_back(
          matrix_buf(FCE_FLOAT32, N, s.local, s.local, columns(t, N, V, s.start, s.local)));
      stats1.push_back(stats_of(1, zb.size() - 1, nullptr));
    }
  }
  fce_vp_shard shard(size_t q, int64_t ranks = 2) const {
    return {ranks, V, shards[q].start, shards[q].local, nullptr, nullptr};
  }
  Buf stats_of(int32_t round, size_t q, const Buf* previous) {
    fce_teacher tq = te;
    tq.logits = tb[q].ptr();
    const fce_vp_shard sh = shard(q);
    Buf st(static_cast<size_t>(N) * FCE_VP_DISTILL_STATS * 4);
    EXPECT_EQ(fce_vp_distill_stats(&o, &tq, &sh, round, N, zb[q].ptr(),
                                   previous ? previous->p<const float>() : nullptr, st.p<float>(),
                                   test_stream()),
              FCE_SUCCESS)
        << fce_last_error();
    EXPECT_TRUE(finish());
    st.pull();
    return st;
  }
  // The loss (reduction none) and flags from gathered, and rank 0's gradient.
  void loss_and_grad(const Buf& gathered, int64_t ranks, std::vector<double>* loss, uint32_t* flags,
                     std::vector<double>* grad) {
    o.reduction = FCE_REDUCTION_NONE;
    const fce_vp_shard sh = shard(0, ranks);
    Buf lb(vec(FCE_FLOAT32, N)), fb = flags_buf(0);
    fce_outputs out = FCE_OUTPUTS_INIT;
    out.loss = lb.p<float>();
    out.error_flags = fb.p<uint32_t>();
    size_t wsb = 0;
    ASSERT_EQ(fce_vp_distill_loss_workspace_size(&o, &te, ranks, N, V, &wsb), FCE_SUCCESS);
    Buf ws = workspace_buf(wsb);
    ASSERT_EQ(fce_vp_distill_loss(&o, &te, &sh, N, yb.ptr(), gathered.p<const float>(), &out,
                                  ws.ptr(), wsb, test_stream()),
              FCE_SUCCESS)
        << fce_last_error();
    ASSERT_TRUE(finish());
    lb.pull(), fb.pull();
    *loss = read_mat(lb, vec(FCE_FLOAT32, N));
    *flags = read_flags(fb);
    const Mat gm = mat(FCE_FLOAT32, N, shards[0].local);
    Buf gbuf = poisoned(gm);
    fce_teacher tq = te;
    tq.logits = tb[0].ptr();
    fce_gradients g = FCE_GRADIENTS_INIT;
    g.grad_logits = gbuf.ptr();
    ASSERT_EQ(fce_vp_distill_backward_workspace_size(&o, &tq, ranks, N, V, shards[0].local, &wsb),
              FCE_SUCCESS);
    Buf ws2 = workspace_buf(wsb);
    ASSERT_EQ(fce_vp_distill_backward(&o, &tq, &sh, N, zb[0].ptr(), yb.ptr(),
                                      gathered.p<const float>(), &g, ws2.ptr(), wsb, test_stream()),
              FCE_SUCCESS)
        << fce_last_error();
    ASSERT_TRUE(finish());
    gbuf.pull();
    *grad = read_mat(gbuf, gm);
  }
  // Every counted row NaN (loss and gradient), the ignored row 1 loss 0 and gradient 0, the flag.
  void expect_inconsistent(const Buf& gathered, int64_t ranks) {
    std::vector<double> loss, grad;
    uint32_t flags = 0;
    loss_and_grad(gathered, ranks, &loss, &flags, &grad);
    EXPECT_EQ(flags, FCE_FLAG_SHARDS_INCONSISTENT);
    const int64_t L = shards[0].local;
    for (int64_t r = 0; r < N; ++r) {
      if (r == 1) {
        EXPECT_EQ(loss[r], 0.0);
        for (int64_t j = 0; j < L; ++j) EXPECT_EQ(grad[r * L + j], 0.0);
        continue;
      }
      EXPECT_TRUE(std::isnan(loss[r])) << "row " << r;
      for (int64_t j = 0; j < L; ++j) EXPECT_TRUE(std::isnan(grad[r * L + j])) << "row " << r;
    }
  }
};

TEST_F(VpDistillTiling, ConsistentStepIsFinite) {
  const Buf g1 = gather({&stats1[0], &stats1[1]}, N);
  const Buf s2a = stats_of(2, 0, &g1), s2b = stats_of(2, 1, &g1);
  std::vector<double> loss, grad;
  uint32_t flags = 0;
  loss_and_grad(gather({&s2a, &s2b}, N), 2, &loss, &flags, &grad);
  EXPECT_EQ(flags, 0u);
  for (double x : loss) EXPECT_TRUE(std::isfinite(x));
  for (double x : grad) EXPECT_TRUE(std::isfinite(x));
}

TEST_F(VpDistillTiling, ShardGatheredTwice) {
  const Buf g1 = gather({&stats1[0], &stats1[1]}, N);
  const Buf s2a = stats_of(2, 0, &g1);
  expect_inconsistent(gather({&s2a, &s2a}, N), 2);
}

TEST_F(VpDistillTiling, ShardMissing) {
  const Buf g1 = gather({&stats1[0], &stats1[1]}, N);
  const Buf s2a = stats_of(2, 0, &g1);
  expect_inconsistent(gather({&s2a}, N), 1);
}

// Round 1's statistics where the JSD's loss needs round 2's.
TEST_F(VpDistillTiling, WrongRound) { expect_inconsistent(gather({&stats1[0], &stats1[1]}, N), 2); }

// A round 1 that failed the check taints round 2, even when round 2's own statistics tile.
TEST_F(VpDistillTiling, BadFirstRoundCarried) {
  const Buf bad = gather({&stats1[0], &stats1[0]}, N);
  const Buf s2a = stats_of(2, 0, &bad), s2b = stats_of(2, 1, &bad);
  expect_inconsistent(gather({&s2a, &s2b}, N), 2);
}

// Round 2 statistics that carry another round-1 combination (another step's): the rows whose
// carried values differ are inconsistent, the others are not.
TEST_F(VpDistillTiling, MixedCombinations) {
  const Buf g1 = gather({&stats1[0], &stats1[1]}, N);
  const Buf s2a = stats_of(2, 0, &g1);
  Buf s2b = stats_of(2, 1, &g1);
  float* row0 = s2b.hp<float>();  // row 0's carried ls_u, one ulp off
  row0[1] = std::nextafter(row0[1], 1e30f);
  std::vector<double> loss, grad;
  uint32_t flags = 0;
  loss_and_grad(gather({&s2a, &s2b}, N), 2, &loss, &flags, &grad);
  EXPECT_EQ(flags, FCE_FLAG_SHARDS_INCONSISTENT);
  EXPECT_TRUE(std::isnan(loss[0]));
  for (int64_t r = 2; r < N; ++r) EXPECT_TRUE(std::isfinite(loss[r])) << "row " << r;
  EXPECT_TRUE(std::isnan(grad[0]));
  for (size_t i = static_cast<size_t>(2 * shards[0].local); i < grad.size(); ++i)
    EXPECT_TRUE(std::isfinite(grad[i]));
}

// ------------------------------------------------------------------ the empty problem -------
TEST_F(VpDistillTiling, EmptyProblem) {
  const fce_vp_shard sh = shard(0);
  EXPECT_EQ(fce_vp_distill_stats(&o, &te, &sh, 1, 0, nullptr, nullptr, nullptr, test_stream()),
            FCE_SUCCESS)
      << fce_last_error();
  Buf lb = poisoned(vec(FCE_FLOAT32, 1));
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = lb.p<float>();
  size_t wsb = 1;
  ASSERT_EQ(fce_vp_distill_loss_workspace_size(&o, &te, 2, 0, V, &wsb), FCE_SUCCESS);
  EXPECT_EQ(wsb, 0u);
  ASSERT_EQ(fce_vp_distill_loss(&o, &te, &sh, 0, nullptr, nullptr, &out, nullptr, 0, test_stream()),
            FCE_SUCCESS)
      << fce_last_error();
  ASSERT_TRUE(finish());
  lb.pull();
  EXPECT_EQ(read_mat(lb, vec(FCE_FLOAT32, 1)), std::vector<double>{0.0});
  fce_gradients g = FCE_GRADIENTS_INIT;
  ASSERT_EQ(fce_vp_distill_backward(&o, &te, &sh, 0, nullptr, nullptr, nullptr, &g, nullptr, 0,
                                    test_stream()),
            FCE_SUCCESS)
      << fce_last_error();
}

// ------------------------------------------------------------------ refusals ----------------
class VpDistillRefusals : public VpDistillTiling {
 protected:
  Buf st, gathered;
  void SetUp() override {
    VpDistillTiling::SetUp();
    if (HasFatalFailure() || IsSkipped()) return;
    st = Buf(static_cast<size_t>(N) * FCE_VP_DISTILL_STATS * 4);
    gathered = Buf(static_cast<size_t>(2 * N) * FCE_VP_DISTILL_STATS * 4);
  }
  fce_status stats(const fce_options* op, const fce_teacher* tp, const fce_vp_shard* sh,
                   int32_t round, const void* z, const float* prev, float* out) {
    return fce_vp_distill_stats(op, tp, sh, round, N, z, prev, out, test_stream());
  }
  fce_teacher teacher0() const {
    fce_teacher t = te;
    t.logits = tb[0].ptr();
    return t;
  }
};

TEST_F(VpDistillRefusals, Rounds) {
  int32_t rounds = 0;
  EXPECT_EQ(fce_vp_distill_rounds(nullptr, &rounds), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_distill_rounds: teacher is NULL"));
  EXPECT_EQ(fce_vp_distill_rounds(&te, nullptr), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_distill_rounds: rounds is NULL"));
  fce_teacher bad = te;
  bad.beta = 2.0f;
  EXPECT_EQ(fce_vp_distill_rounds(&bad, &rounds), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_distill_rounds: teacher->beta (2)"));
  EXPECT_EQ(rounds, 0);
  EXPECT_EQ(fce_vp_distill_rounds(&te, &rounds), FCE_SUCCESS);
  EXPECT_EQ(rounds, 2);
  EXPECT_STREQ(fce_last_error(), "");
}

TEST_F(VpDistillRefusals, Stats) {
  const fce_teacher t0 = teacher0();
  const fce_vp_shard sh = shard(0);
  EXPECT_EQ(stats(&o, &t0, nullptr, 1, zb[0].ptr(), nullptr, st.p<float>()),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_distill_stats: shard is NULL"));
  EXPECT_EQ(stats(&o, nullptr, &sh, 1, zb[0].ptr(), nullptr, st.p<float>()),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_distill_stats: teacher is NULL"));
  EXPECT_EQ(stats(&o, &t0, &sh, 1, nullptr, nullptr, st.p<float>()), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_distill_stats: logits is NULL"));
  EXPECT_EQ(stats(&o, &te, &sh, 1, zb[0].ptr(), nullptr, st.p<float>()), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_distill_stats: teacher->logits is NULL"));
  EXPECT_EQ(stats(&o, &t0, &sh, 1, zb[0].ptr(), nullptr, nullptr), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_distill_stats: stats is NULL"));
  // rounds
  for (int32_t round : {0, 3, -1}) {
    EXPECT_EQ(stats(&o, &t0, &sh, round, zb[0].ptr(), nullptr, st.p<float>()),
              FCE_ERROR_INVALID_ARGUMENT);
    EXPECT_TRUE(error_mentions("fce_vp_distill_stats: round (" + std::to_string(round) +
                               ") must be in [1, 2]"));
  }
  fce_teacher fwd = t0;
  fwd.divergence = FCE_DIVERGENCE_FORWARD_KL;
  EXPECT_EQ(stats(&o, &fwd, &sh, 2, zb[0].ptr(), gathered.p<const float>(), st.p<float>()),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_distill_stats: round (2) must be in [1, 1]"));
  EXPECT_EQ(stats(&o, &t0, &sh, 2, zb[0].ptr(), nullptr, st.p<float>()), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_distill_stats: previous is NULL"));
  EXPECT_EQ(stats(&o, &t0, &sh, 1, zb[0].ptr(), gathered.p<const float>(), st.p<float>()),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_distill_stats: previous is given in round 1"));
  // sizes, strides, alignment, overlap
  fce_vp_shard bad = sh;
  bad.vocab_start = V - 1;
  EXPECT_EQ(stats(&o, &t0, &bad, 1, zb[0].ptr(), nullptr, st.p<float>()),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_distill_stats: vocab_start"));
  fce_teacher ts = t0;
  ts.row_stride = 1;
  EXPECT_EQ(stats(&o, &ts, &sh, 1, zb[0].ptr(), nullptr, st.p<float>()),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_distill_stats: teacher->row_stride (1)"));
  EXPECT_EQ(
      stats(&o, &t0, &sh, 1, zb[0].ptr(), nullptr, reinterpret_cast<float*>(st.p<char>() + 4)),
      FCE_ERROR_MISALIGNED);
  EXPECT_TRUE(error_mentions("fce_vp_distill_stats: stats"));
  EXPECT_EQ(stats(&o, &t0, &sh, 1, zb[0].ptr(), nullptr, static_cast<float*>(tb[0].ptr())),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("overlaps"));
}

TEST_F(VpDistillRefusals, OptionsAndOutputs) {
  const fce_teacher t0 = teacher0();
  const fce_vp_shard sh = shard(0);
  const struct {
    const char* field;
    void (*edit)(fce_options&);
  } refused[] = {
      {"options->batch_invariant", [](fce_options& x) { x.batch_invariant = 1; }},
      {"options->vp_entropy", [](fce_options& x) { x.vp_entropy = 1; }},
      {"options->label_smoothing", [](fce_options& x) { x.label_smoothing = 0.1f; }},
      {"options->z_loss_scale", [](fce_options& x) { x.z_loss_scale = 0.1f; }},
      {"options->token_scaling", [](fce_options& x) { x.token_scaling = 1; }},
      {"options->target_dtype", [](fce_options& x) { x.target_dtype = FCE_FLOAT32; }},
  };
  for (const auto& r : refused) {
    fce_options bad = o;
    r.edit(bad);
    EXPECT_EQ(stats(&bad, &t0, &sh, 1, zb[0].ptr(), nullptr, st.p<float>()), FCE_ERROR_UNSUPPORTED)
        << r.field;
    EXPECT_TRUE(error_mentions(std::string("fce_vp_distill_stats: ") + r.field));
    size_t bytes = 0;
    EXPECT_EQ(fce_vp_distill_loss_workspace_size(&bad, &te, 2, N, V, &bytes),
              FCE_ERROR_UNSUPPORTED);
    EXPECT_TRUE(error_mentions(std::string("fce_vp_distill_loss_workspace_size: ") + r.field));
  }
  Buf lb(vec(FCE_FLOAT32, 1)), am(vec(FCE_INT64, N));
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = lb.p<float>();
  out.argmax = am.p<int64_t>();
  Buf ws(65536);
  EXPECT_EQ(fce_vp_distill_loss(&o, &te, &sh, N, yb.ptr(), gathered.p<const float>(), &out,
                                ws.ptr(), 65536, test_stream()),
            FCE_ERROR_UNSUPPORTED);
  EXPECT_TRUE(error_mentions("fce_vp_distill_loss: outputs->argmax"));
  out.argmax = nullptr;
  EXPECT_EQ(
      fce_vp_distill_loss(&o, &te, &sh, N, yb.ptr(), nullptr, &out, ws.ptr(), 65536, test_stream()),
      FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_distill_loss: gathered_stats is NULL"));
  EXPECT_EQ(fce_vp_distill_loss(&o, &te, &sh, N, yb.ptr(), gathered.p<const float>(), nullptr,
                                ws.ptr(), 65536, test_stream()),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_distill_loss: outputs is NULL"));
  // the backward
  Buf gb(mat(FCE_FLOAT32, N, shards[0].local)), rows(vec(FCE_FLOAT32, N));
  fce_gradients g = FCE_GRADIENTS_INIT;
  g.grad_logits = gb.ptr();
  g.grad_lse = rows.p<const float>();
  EXPECT_EQ(fce_vp_distill_backward(&o, &t0, &sh, N, zb[0].ptr(), yb.ptr(),
                                    gathered.p<const float>(), &g, ws.ptr(), 65536, test_stream()),
            FCE_ERROR_UNSUPPORTED);
  EXPECT_TRUE(error_mentions("fce_vp_distill_backward: gradients->grad_lse"));
  g.grad_lse = nullptr;
  EXPECT_EQ(fce_vp_distill_backward(&o, &t0, &sh, N, zb[0].ptr(), yb.ptr(),
                                    gathered.p<const float>(), nullptr, ws.ptr(), 65536,
                                    test_stream()),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_distill_backward: gradients is NULL"));
  EXPECT_EQ(fce_vp_distill_backward(&o, &te, &sh, N, zb[0].ptr(), yb.ptr(),
                                    gathered.p<const float>(), &g, ws.ptr(), 65536, test_stream()),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_distill_backward: teacher->logits is NULL"));
  fce_options strided = o;
  strided.grad_row_stride = shards[0].local + 1;  // in place needs the logits' stride
  fce_gradients in_place = FCE_GRADIENTS_INIT;
  in_place.grad_logits = zb[0].ptr();
  EXPECT_EQ(fce_vp_distill_backward(&strided, &t0, &sh, N, zb[0].ptr(), yb.ptr(),
                                    gathered.p<const float>(), &in_place, ws.ptr(), 65536,
                                    test_stream()),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_distill_backward: "));
  fce_teacher lin = t0;
  lin.hidden = 4;
  EXPECT_EQ(fce_vp_distill_backward(&o, &lin, &sh, N, zb[0].ptr(), yb.ptr(),
                                    gathered.p<const float>(), &g, ws.ptr(), 65536, test_stream()),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_distill_backward: teacher->hidden is set"));
  size_t bytes = 0;
  EXPECT_EQ(fce_vp_distill_backward_workspace_size(&o, &te, 0, N, V, 8, &bytes),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_distill_backward_workspace_size: ranks"));
  EXPECT_EQ(fce_vp_distill_backward_workspace_size(&o, &te, 2, N, V, V + 1, &bytes),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_distill_backward_workspace_size: vocab_local"));
}

}  // namespace
