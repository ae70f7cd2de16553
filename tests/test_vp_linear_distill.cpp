// test_vp_linear_distill.cpp — the vocabulary-parallel distillation from hidden states
// (fce_vp_linear_distill_stats, fce_vp_linear_distill_backward; docs/semantics.md rule 22), P =
// 1..3 ranks simulated in one process, each holding its rows of the student's and the teacher's
// weights: the statistics of each round, the all-gather made here, fce_vp_distill_loss, then the
// backward of every rank, against the unsharded fce_linear_distill on the same backend: the
// loss and lse equal, the ranks' partial grad_hidden summed equal to its grad_hidden, each
// rank's grad_weight equal to its rows of the whole grad_weight; every workspace from min_bytes
// to optimal_bytes (bitwise the same on the CPU, whose chunks do not depend on it); the empty
// problem; and the refusals with their messages. FCE_TEST_BACKEND picks the backend.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "distill_ref.h"
#include "vp_common.h"

namespace {

using namespace fcet;
using namespace distillref;

static_assert(FCE_VP_DISTILL_STATS == FCE_VP_STATS, "vp_common.h's gather moves rows of 8 floats");

struct VldCase {
  Cfg c;
  int dtype = FCE_FLOAT32;
  int64_t N = 37, D = 24, Dt = 40, V = 150;
  int64_t pad = 3;  // the student's hidden row stride: D + pad (the teacher's: Dt + pad + 2)
  int grad_hidden_dtype = FCE_FLOAT32;
  bool fp32_dw = false, accumulate = false, grad_hidden = true, grad_weight = true;
  bool targets = true, uneven = true;
  std::vector<int> ranks = {1, 2, 3};
  // the workspace of every call: min_bytes + (optimal_bytes - min_bytes) * ws_frac
  double ws_frac = 1.0;
  uint64_t seed = 1;
};

std::string label(const VldCase& k) {
  std::ostringstream s;
  s << "[" << backend_name() << " " << dtype_name(k.dtype) << " div " << k.c.divergence << " beta "
    << k.c.beta << " T " << k.c.T << " " << reduction_name(k.c.reduction) << " N=" << k.N
    << " D=" << k.D << " Dt=" << k.Dt << " V=" << k.V << " grad_hidden "
    << dtype_name(k.grad_hidden_dtype) << (k.fp32_dw ? " fp32 dW" : "")
    << (k.accumulate ? " accumulate" : "") << (k.uneven ? " uneven" : " even")
    << (k.targets ? "" : " no targets") << " workspace " << k.ws_frac << "]";
  return s.str();
}

fce_options options_of(const VldCase& k) {
  fce_options o = test_options();
  o.dtype = k.dtype;
  o.reduction = k.c.reduction;
  o.logit_scale = static_cast<float>(k.c.s);
  o.softcap = static_cast<float>(k.c.c);
  o.grad_weight_fp32 = k.fp32_dw;
  o.accumulate = k.accumulate;
  o.hidden_row_stride = k.D + k.pad;
  return o;
}

struct Data {
  std::vector<double> h, w, ht, wt;  // [N, D], [V, D], [N, Dt], [V, Dt]
  std::vector<int64_t> y;
  std::vector<double> g;    // grad_output: [1] or [N]
  std::vector<double> old;  // grad_weight's value before (accumulate) [V, D]
};

Data data_of(const VldCase& k) {
  std::mt19937_64 rng(k.seed);
  Data d;
  d.h = random_normal(rng, k.dtype, size_t(k.N * k.D), 1.0);
  d.w = random_normal(rng, k.dtype, size_t(k.V * k.D), 0.5);
  d.ht = random_normal(rng, k.dtype, size_t(k.N * k.Dt), 1.0);
  d.wt = random_normal(rng, k.dtype, size_t(k.V * k.Dt), 0.5);
  d.y = random_targets(rng, k.N, k.V, 0.25);
  const bool none = k.c.reduction == FCE_REDUCTION_NONE;
  d.g = random_uniform(rng, none ? size_t(k.N) : 1, 0.5, 2.0);
  d.old = random_normal(rng, k.fp32_dw ? FCE_FLOAT32 : k.dtype, size_t(k.V * k.D), 0.01);
  return d;
}

// The inputs in the backend: both hidden states (strided) and the targets, grad_output.
struct Inputs {
  Buf h, ht, y, g;
};
Inputs inputs_of(const VldCase& k, const Data& d) {
  Inputs in;
  in.h = matrix_buf(k.dtype, k.N, k.D, k.D + k.pad, d.h);
  in.ht = matrix_buf(k.dtype, k.N, k.Dt, k.Dt + k.pad + 2, d.ht);
  in.y = targets_buf(d.y, FCE_INT64);
  in.g = f32_buf(d.g);
  return in;
}

// Rows [start, start + local) of a dense [rows, cols] matrix.
std::vector<double> rows_of(const std::vector<double>& m, int64_t cols, int64_t start,
                            int64_t local) {
  return std::vector<double>(m.begin() + start * cols, m.begin() + (start + local) * cols);
}

struct Result {
  std::vector<double> loss, lse, dh, dw;
  std::vector<uint8_t> dw_bytes, dh_bytes;
};

// The unsharded fce_linear_distill (at its optimal workspace).
Result whole(const VldCase& k, const Data& d, Inputs& in) {
  const bool none = k.c.reduction == FCE_REDUCTION_NONE;
  const int gw_dtype = k.fp32_dw ? FCE_FLOAT32 : k.dtype;
  const Mat lm = vec(FCE_FLOAT32, none ? k.N : 1), rm = vec(FCE_FLOAT32, k.N);
  const Mat dhm = mat(k.dtype, k.N, k.D), dwm = mat(gw_dtype, k.V, k.D);
  Buf wb = matrix_buf(k.dtype, k.V, k.D, k.D, d.w),
      wtb = matrix_buf(k.dtype, k.V, k.Dt, k.Dt, d.wt);
  Buf loss = poisoned(lm), lse = poisoned(rm), dh = poisoned(dhm), dw = poisoned(dwm);
  if (k.accumulate) {
    write_mat(dw, dwm, d.old);
    dw.push();
  }
  fce_options o = options_of(k);
  fce_teacher te = teacher_of(k.c);
  te.hidden_states = in.ht.ptr();
  te.weight = wtb.ptr();
  te.hidden = k.Dt;
  te.hidden_row_stride = k.Dt + k.pad + 2;
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  out.lse = lse.p<float>();
  fce_gradients g = FCE_GRADIENTS_INIT;
  g.grad_hidden = k.grad_hidden ? dh.ptr() : nullptr;
  g.grad_weight = k.grad_weight ? dw.ptr() : nullptr;
  g.grad_output = in.g.p<const float>();
  size_t lo = 0, hi = 0;
  Result r;
  EXPECT_EQ(fce_linear_distill_workspace_size(&o, &te, k.N, k.D, k.V, 1, &lo, &hi), FCE_SUCCESS)
      << fce_last_error();
  Buf ws = workspace_buf(hi);
  EXPECT_EQ(fce_linear_distill(&o, &te, k.N, k.D, k.V, in.h.ptr(), wb.ptr(),
                               k.targets ? in.y.ptr() : nullptr, &out, &g, ws.ptr(), hi,
                               test_stream()),
            FCE_SUCCESS)
      << fce_last_error();
  EXPECT_TRUE(finish());
  loss.pull(), lse.pull(), dh.pull(), dw.pull();
  r.loss = read_mat(loss, lm);
  r.lse = read_mat(lse, rm);
  if (k.grad_hidden) r.dh = read_mat(dh, dhm);
  if (k.grad_weight) r.dw = read_mat(dw, dwm);
  return r;
}

// What rank q holds: its shard, its rows of both weights, its teacher.
struct Rank {
  fce_vp_shard shard;
  Buf w, wt;
  fce_teacher teacher;
};
std::vector<Rank> ranks_of(const VldCase& k, const Data& d, const Inputs& in, int P) {
  std::vector<Rank> out;
  const std::vector<Shard> shards = make_shards(k.V, P, k.uneven);
  for (const Shard& s : shards) {
    Rank r;
    r.shard = {P, k.V, s.start, s.local, nullptr, nullptr};
    r.w = matrix_buf(k.dtype, s.local, k.D, k.D, rows_of(d.w, k.D, s.start, s.local));
    r.wt = matrix_buf(k.dtype, s.local, k.Dt, k.Dt, rows_of(d.wt, k.Dt, s.start, s.local));
    r.teacher = teacher_of(k.c);
    r.teacher.hidden_states = in.ht.ptr();
    r.teacher.weight = r.wt.ptr();
    r.teacher.hidden = k.Dt;
    r.teacher.hidden_row_stride = k.Dt + k.pad + 2;
    out.push_back(std::move(r));
  }
  return out;
}

size_t pick(size_t lo, size_t hi, double frac) {
  return lo + static_cast<size_t>(static_cast<double>(hi - lo) * frac);
}

// The step over P ranks: every round's statistics gathered, the loss of rank 0 (every rank's
// the same bits: checked), the ranks' gradients assembled (∂h summed over the ranks in double).
Result sharded(const VldCase& k, const Data& d, Inputs& in, int P) {
  const fce_options o = options_of(k);
  std::vector<Rank> ranks = ranks_of(k, d, in, P);
  const fce_teacher& te = ranks[0].teacher;
  int32_t rounds = 0;
  EXPECT_EQ(fce_vp_distill_rounds(&te, &rounds), FCE_SUCCESS) << fce_last_error();
  Result res;
  Buf previous;
  for (int32_t round = 1; round <= rounds; ++round) {
    std::vector<Buf> stats;
    for (int q = 0; q < P; ++q) {
      Rank& rk = ranks[size_t(q)];
      size_t lo = 0, hi = 0;
      EXPECT_EQ(fce_vp_linear_distill_stats_workspace_size(&o, &rk.teacher, k.N, k.D,
                                                           rk.shard.vocab_local, &lo, &hi),
                FCE_SUCCESS)
          << fce_last_error();
      EXPECT_LE(lo, hi);
      const size_t bytes = pick(lo, hi, k.ws_frac);
      Buf ws = workspace_buf(bytes);
      Buf st = poisoned(mat(FCE_FLOAT32, k.N, FCE_VP_DISTILL_STATS));
      EXPECT_EQ(fce_vp_linear_distill_stats(&o, &rk.teacher, &rk.shard, round, k.N, k.D, in.h.ptr(),
                                            rk.w.ptr(), nullptr,
                                            round == 2 ? previous.p<const float>() : nullptr,
                                            st.p<float>(), ws.ptr(), bytes, test_stream()),
                FCE_SUCCESS)
          << "round " << round << " rank " << q << ": " << fce_last_error();
      EXPECT_TRUE(finish());
      st.pull();
      EXPECT_TRUE(all_written(st, mat(FCE_FLOAT32, k.N, FCE_VP_DISTILL_STATS), "stats"));
      EXPECT_TRUE(guards_intact(ws, "workspace"));
      stats.push_back(std::move(st));
    }
    std::vector<const Buf*> order;
    for (const Buf& b : stats) order.push_back(&b);
    previous = gather(order, k.N);
  }
  const Buf& gathered = previous;
  const bool none = k.c.reduction == FCE_REDUCTION_NONE;
  const Mat lm = vec(FCE_FLOAT32, none ? k.N : 1), rm = vec(FCE_FLOAT32, k.N);
  const void* targets = k.targets ? in.y.ptr() : nullptr;
  const int gw_dtype = k.fp32_dw ? FCE_FLOAT32 : k.dtype;
  res.dh.assign(size_t(k.N * k.D), 0.0);
  res.dw.assign(size_t(k.V * k.D), 0.0);
  std::vector<uint8_t> first_loss;
  for (int q = 0; q < P; ++q) {
    SCOPED_TRACE("rank " + std::to_string(q) + " of " + std::to_string(P));
    Rank& rk = ranks[size_t(q)];
    const int64_t start = rk.shard.vocab_start, local = rk.shard.vocab_local;
    // the loss: fce_vp_distill_loss on the gathered statistics, with the linear teacher
    Buf loss = poisoned(lm), lse = poisoned(rm);
    size_t wsb = 0;
    EXPECT_EQ(fce_vp_distill_loss_workspace_size(&o, &rk.teacher, P, k.N, k.V, &wsb), FCE_SUCCESS)
        << fce_last_error();
    Buf lws = workspace_buf(wsb);
    fce_outputs out = FCE_OUTPUTS_INIT;
    out.loss = loss.p<float>();
    out.lse = lse.p<float>();
    EXPECT_EQ(fce_vp_distill_loss(&o, &rk.teacher, &rk.shard, k.N, targets,
                                  gathered.p<const float>(), &out, lws.ptr(), wsb, test_stream()),
              FCE_SUCCESS)
        << fce_last_error();
    EXPECT_TRUE(finish());
    loss.pull(), lse.pull();
    if (q == 0) {
      res.loss = read_mat(loss, lm);
      res.lse = read_mat(lse, rm);
      first_loss = loss.mirror();
    } else {
      EXPECT_TRUE(bitwise_equal(loss.mirror(), first_loss, "loss of this rank vs rank 0"));
    }
    // the backward of the rank
    const Mat dhm = mat(k.grad_hidden_dtype, k.N, k.D), dwm = mat(gw_dtype, local, k.D);
    Buf dh = poisoned(dhm), dw = poisoned(dwm);
    if (k.accumulate) {
      write_mat(dw, dwm, rows_of(d.old, k.D, start, local));
      dw.push();
    }
    size_t lo = 0, hi = 0;
    EXPECT_EQ(fce_vp_linear_distill_backward_workspace_size(&o, &rk.teacher, P, k.N, k.D, k.V,
                                                            local, k.grad_hidden_dtype, &lo, &hi),
              FCE_SUCCESS)
        << fce_last_error();
    EXPECT_LE(lo, hi);
    const size_t bytes = pick(lo, hi, k.ws_frac);
    Buf ws = workspace_buf(bytes);
    fce_gradients g = FCE_GRADIENTS_INIT;
    g.grad_hidden = k.grad_hidden ? dh.ptr() : nullptr;
    g.grad_weight = k.grad_weight ? dw.ptr() : nullptr;
    g.grad_hidden_dtype = k.grad_hidden_dtype;
    g.grad_output = in.g.p<const float>();
    EXPECT_EQ(fce_vp_linear_distill_backward(
                  &o, &rk.teacher, &rk.shard, k.N, k.D, in.h.ptr(), rk.w.ptr(), nullptr, targets,
                  gathered.p<const float>(), &g, ws.ptr(), bytes, test_stream()),
              FCE_SUCCESS)
        << fce_last_error();
    EXPECT_TRUE(finish());
    dh.pull(), dw.pull();
    EXPECT_TRUE(guards_intact(ws, "workspace"));
    if (k.grad_hidden) {
      EXPECT_TRUE(all_written(dh, dhm, "grad_hidden"));
      const std::vector<double> part = read_mat(dh, dhm);
      for (size_t i = 0; i < part.size(); ++i) res.dh[i] += part[i];
      res.dh_bytes.insert(res.dh_bytes.end(), dh.mirror().begin(), dh.mirror().end());
    }
    if (k.grad_weight) {
      EXPECT_TRUE(all_written(dw, dwm, "grad_weight"));
      const std::vector<double> rows = read_mat(dw, dwm);
      std::copy(rows.begin(), rows.end(), res.dw.begin() + start * k.D);
      res.dw_bytes.insert(res.dw_bytes.end(), dw.mirror().begin(), dw.mirror().end());
    }
  }
  return res;
}

// The tolerances of a comparison with fce_linear_distill: the vocabulary-parallel distillation
// tests' (distill_ref.h) on the CPU, whose logits are float32 in both calls; on CUDA the
// linear tests' (test_distill.cpp), whose GEMMs (TF32, or logits in the 16-bit dtype) differ
// between the whole weight and a shard of it.
double loss_tolerance(const VldCase& k, const Data& d) {
  if (!on_cuda()) return loss_tol();
  if (k.dtype == FCE_FLOAT32) return 2e-3;
  double zmax = 0.0;  // max |z| and |t|, as test_distill.cpp's check_linear takes it
  for (int64_t r = 0; r < k.N; ++r)
    for (int64_t v = 0; v < k.V; ++v) {
      double z = 0.0, t = 0.0;
      for (int64_t i = 0; i < k.D; ++i) z += d.h[size_t(r * k.D + i)] * d.w[size_t(v * k.D + i)];
      for (int64_t i = 0; i < k.Dt; ++i)
        t += d.ht[size_t(r * k.Dt + i)] * d.wt[size_t(v * k.Dt + i)];
      zmax = std::max({zmax, std::fabs(z), std::fabs(t)});
    }
  return unit_roundoff(k.dtype) * (4.0 + 4.0 * zmax);
}
// A gradient stored in `dtype` by one of the two calls at least.
double grad_tolerance(int dtype) {
  if (dtype == FCE_FLOAT32) return on_cuda() ? 2e-3 : grad_tol(FCE_FLOAT32);
  return on_cuda() ? 2 * tolerance(dtype) : grad_tol(dtype);
}

void run_case(const VldCase& k) {
  SCOPED_TRACE(label(k));
  const Data d = data_of(k);
  Inputs in = inputs_of(k, d);
  const Result w = whole(k, d, in);
  if (::testing::Test::HasFailure()) return;
  const double ltol = loss_tolerance(k, d);
  // ∂h: fce_linear_distill's is of the dtype; the sum of the partial ones of grad_hidden_dtype
  const double htol = grad_tolerance(k.dtype);
  const double wtol = grad_tolerance(k.fp32_dw ? FCE_FLOAT32 : k.dtype);
  for (int P : k.ranks) {
    SCOPED_TRACE(std::to_string(P) + " ranks");
    const Result r = sharded(k, d, in, P);
    if (::testing::Test::HasFailure()) return;
    EXPECT_TRUE(close_normwise(r.loss, w.loss, ltol, "loss vs fce_linear_distill"));
    EXPECT_TRUE(close_normwise(r.lse, w.lse, ltol, "lse vs fce_linear_distill"));
    if (k.grad_hidden) {
      EXPECT_TRUE(close_normwise(r.dh, w.dh, htol, "Σ partial grad_hidden vs fce_linear_distill"));
    }
    if (k.grad_weight) {
      EXPECT_TRUE(close_normwise(r.dw, w.dw, wtol, "grad_weight rows vs fce_linear_distill"));
    }
  }
}

class VpLinearDistill : public BackendTest {};

TEST_F(VpLinearDistill, DivergencesDtypesReductions) {
  uint64_t seed = 100;
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (int div : {FCE_DIVERGENCE_FORWARD_KL, FCE_DIVERGENCE_REVERSE_KL, FCE_DIVERGENCE_JSD})
      for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE}) {
        VldCase k;
        k.dtype = dtype;
        k.c.divergence = div;
        k.c.reduction = red;
        k.c.beta = 0.5;  // the JSD: two rounds
        k.c.T = 2.0;
        k.fp32_dw = dtype != FCE_FLOAT32;
        k.seed = ++seed;
        run_case(k);
      }
}

TEST_F(VpLinearDistill, TemperatureScaleSoftcap) {
  uint64_t seed = 200;
  for (double T : {0.5, 3.0})
    for (int div : {FCE_DIVERGENCE_FORWARD_KL, FCE_DIVERGENCE_REVERSE_KL, FCE_DIVERGENCE_JSD}) {
      VldCase k;
      k.c.divergence = div;
      k.c.T = T;
      k.c.s = 0.8;
      k.c.c = 12.0;
      k.seed = ++seed;
      run_case(k);
    }
}

// The gradients' options: a 16-bit grad_hidden and grad_weight, accumulate, one gradient only,
// no targets, even shards.
TEST_F(VpLinearDistill, GradientOptions) {
  const std::vector<std::pair<const char*, std::function<void(VldCase&)>>> edits = {
      {"bfloat16 grad_hidden and grad_weight",
       [](VldCase& k) {
         k.dtype = FCE_BFLOAT16;
         k.grad_hidden_dtype = FCE_BFLOAT16;
       }},
      {"accumulate (float32)", [](VldCase& k) { k.accumulate = true; }},
      {"accumulate (bfloat16, float32 grad_weight)",
       [](VldCase& k) {
         k.dtype = FCE_BFLOAT16;
         k.fp32_dw = true;
         k.accumulate = true;
       }},
      {"grad_hidden only", [](VldCase& k) { k.grad_weight = false; }},
      {"grad_weight only", [](VldCase& k) { k.grad_hidden = false; }},
      {"no targets, even shards",
       [](VldCase& k) {
         k.targets = false;
         k.uneven = false;
       }},
  };
  uint64_t seed = 300;
  for (const auto& [name, edit] : edits) {
    SCOPED_TRACE(name);
    VldCase k;
    k.c.divergence = FCE_DIVERGENCE_JSD;
    k.c.beta = 0.5;
    k.c.reduction = FCE_REDUCTION_SUM;
    k.seed = ++seed;
    edit(k);
    run_case(k);
  }
}

// Every workspace from min_bytes to optimal_bytes: the same result (within rounding on CUDA,
// whose token chunks follow it: several chunk counts; bitwise on the CPU, whose chunks do not),
// and over more than one CPU chunk (1024 rows).
TEST_F(VpLinearDistill, WorkspaceSizes) {
  for (int64_t N : {int64_t(70), int64_t(2100)}) {
    std::vector<Result> per_size;
    for (double frac : {0.0, 0.2, 0.5, 1.0}) {
      VldCase k;
      k.N = N;
      k.V = 97;
      k.dtype = FCE_BFLOAT16;
      k.fp32_dw = true;
      k.c.divergence = FCE_DIVERGENCE_JSD;
      k.c.beta = 0.5;
      k.c.T = 1.5;
      k.ranks = {3};
      k.ws_frac = frac;
      k.seed = 400;
      run_case(k);
      if (::testing::Test::HasFailure()) return;
      if (on_cuda()) continue;
      const Data d = data_of(k);
      Inputs in = inputs_of(k, d);
      per_size.push_back(sharded(k, d, in, 3));
      EXPECT_TRUE(bitwise_equal(per_size.back().dw_bytes, per_size[0].dw_bytes, "grad_weight"));
      EXPECT_TRUE(bitwise_equal(per_size.back().dh_bytes, per_size[0].dh_bytes, "grad_hidden"));
    }
  }
}

// CUDA: a 16-bit grad_weight without grad_weight_fp32 at the smallest workspace is refused where
// fce_linear_distill refuses it, naming the call; the CPU takes it.
TEST_F(VpLinearDistill, HalfWeightGradAtMinimumWorkspace) {
  VldCase k;
  k.N = 300;
  k.V = 500;
  k.dtype = FCE_BFLOAT16;
  k.ranks = {1};
  k.ws_frac = 0.0;
  const Data d = data_of(k);
  Inputs in = inputs_of(k, d);
  std::vector<Rank> ranks = ranks_of(k, d, in, 1);
  const fce_options o = options_of(k);
  const Rank& rk = ranks[0];
  size_t lo = 0, hi = 0;
  ASSERT_EQ(fce_vp_linear_distill_backward_workspace_size(&o, &rk.teacher, 1, k.N, k.D, k.V, k.V,
                                                          FCE_FLOAT32, &lo, &hi),
            FCE_SUCCESS);
  Buf gathered(static_cast<size_t>(k.N) * FCE_VP_DISTILL_STATS * 4);
  Buf dw(mat(k.dtype, k.V, k.D)), ws = workspace_buf(lo);
  fce_gradients g = FCE_GRADIENTS_INIT;
  g.grad_weight = dw.ptr();
  const fce_status st = fce_vp_linear_distill_backward(
      &o, &rk.teacher, &rk.shard, k.N, k.D, in.h.ptr(), rk.w.ptr(), nullptr, nullptr,
      gathered.p<const float>(), &g, ws.ptr(), lo, test_stream());
  if (on_cuda()) {
    EXPECT_EQ(st, FCE_ERROR_UNSUPPORTED);
    EXPECT_TRUE(error_mentions("fce_vp_linear_distill_backward: a 16-bit grad_weight"));
  } else {
    EXPECT_EQ(st, FCE_SUCCESS) << fce_last_error();
  }
  EXPECT_TRUE(finish());
}

TEST_F(VpLinearDistill, EmptyProblem) {
  VldCase k;
  k.N = 0;
  const Data d = data_of(k);
  const Inputs in;  // no row: the hidden states are NULL
  std::vector<Rank> ranks = ranks_of(k, d, in, 2);
  const fce_options o = options_of(k);
  for (Rank& rk : ranks) {
    size_t lo = 1, hi = 1;
    ASSERT_EQ(fce_vp_linear_distill_stats_workspace_size(&o, &rk.teacher, 0, k.D,
                                                         rk.shard.vocab_local, &lo, &hi),
              FCE_SUCCESS);
    EXPECT_EQ(lo, 0u);
    EXPECT_EQ(hi, 0u);
    ASSERT_EQ(fce_vp_linear_distill_stats(&o, &rk.teacher, &rk.shard, 1, 0, k.D, nullptr,
                                          rk.w.ptr(), nullptr, nullptr, nullptr, nullptr, 0,
                                          test_stream()),
              FCE_SUCCESS)
        << fce_last_error();
    // ∂W is the zero sum over no rows
    const Mat dwm = mat(FCE_FLOAT32, rk.shard.vocab_local, k.D);
    Buf dw = poisoned(dwm);
    fce_gradients g = FCE_GRADIENTS_INIT;
    g.grad_weight = dw.ptr();
    fce_options o32 = o;
    o32.grad_weight_fp32 = 1;
    ASSERT_EQ(fce_vp_linear_distill_backward(&o32, &rk.teacher, &rk.shard, 0, k.D, nullptr,
                                             rk.w.ptr(), nullptr, nullptr, nullptr, &g, nullptr, 0,
                                             test_stream()),
              FCE_SUCCESS)
        << fce_last_error();
    ASSERT_TRUE(finish());
    dw.pull();
    for (double x : read_mat(dw, dwm)) ASSERT_EQ(x, 0.0);
  }
}

// ------------------------------------------------------------------ refusals ----------------
class VpLinearDistillRefusals : public BackendTest {
 protected:
  static constexpr int64_t N = 5, D = 8, Dt = 6, V = 20, L = 12;  // rank 0 of 2: [0, 12)
  fce_options o{};
  fce_teacher te{};
  fce_vp_shard sh{2, V, 0, L, nullptr, nullptr};
  Buf h, ht, w, wt, y, st, gathered, ws, dh, dw, rows;
  size_t ws_bytes = 0;
  void SetUp() override {
    BackendTest::SetUp();
    if (HasFatalFailure() || IsSkipped()) return;
    o = test_options();
    h = Buf(mat(FCE_FLOAT32, N, D));
    ht = Buf(mat(FCE_FLOAT32, N, Dt));
    w = Buf(mat(FCE_FLOAT32, L, D));
    wt = Buf(mat(FCE_FLOAT32, L, Dt));
    y = Buf(vec(FCE_INT64, N));
    st = Buf(static_cast<size_t>(N) * FCE_VP_DISTILL_STATS * 4);
    gathered = Buf(static_cast<size_t>(2 * N) * FCE_VP_DISTILL_STATS * 4);
    dh = Buf(mat(FCE_FLOAT32, N, D));
    dw = Buf(mat(FCE_FLOAT32, L, D));
    rows = Buf(vec(FCE_FLOAT32, N));
    te = FCE_TEACHER_INIT;
    te.divergence = FCE_DIVERGENCE_JSD;  // two rounds
    te.hidden_states = ht.ptr();
    te.weight = wt.ptr();
    te.hidden = Dt;
    size_t lo = 0, hi = 0;
    ASSERT_EQ(fce_vp_linear_distill_backward_workspace_size(&o, &te, 2, N, D, V, L, FCE_FLOAT32,
                                                            &lo, &hi),
              FCE_SUCCESS)
        << fce_last_error();
    ws_bytes = hi;
    ws = workspace_buf(ws_bytes);
  }
  fce_status stats(const fce_options* op, const fce_teacher* tp, const fce_vp_shard* s,
                   int32_t round, const void* hs, const void* wp, const void* bias,
                   const float* prev, float* out, size_t bytes) {
    return fce_vp_linear_distill_stats(op, tp, s, round, N, D, hs, wp, bias, prev, out, ws.ptr(),
                                       bytes, test_stream());
  }
  fce_status stats1(const fce_options* op, const fce_teacher* tp) {
    return stats(op, tp, &sh, 1, h.ptr(), w.ptr(), nullptr, nullptr, st.p<float>(), ws_bytes);
  }
  fce_status backward(const fce_options* op, const fce_teacher* tp, const void* bias,
                      const float* gath, const fce_gradients* g, size_t bytes) {
    return fce_vp_linear_distill_backward(op, tp, &sh, N, D, h.ptr(), w.ptr(), bias, y.ptr(), gath,
                                          g, ws.ptr(), bytes, test_stream());
  }
};

TEST_F(VpLinearDistillRefusals, Stats) {
  const std::string fn = "fce_vp_linear_distill_stats: ";
  float* out = st.p<float>();
  EXPECT_EQ(stats(&o, &te, nullptr, 1, h.ptr(), w.ptr(), nullptr, nullptr, out, ws_bytes),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions(fn + "shard is NULL"));
  EXPECT_EQ(stats1(&o, nullptr), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions(fn + "teacher is NULL"));
  EXPECT_EQ(stats(&o, &te, &sh, 1, nullptr, w.ptr(), nullptr, nullptr, out, ws_bytes),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions(fn + "hidden_states is NULL"));
  EXPECT_EQ(stats(&o, &te, &sh, 1, h.ptr(), nullptr, nullptr, nullptr, out, ws_bytes),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions(fn + "weight is NULL"));
  fce_teacher t = te;
  t.hidden_states = nullptr;
  EXPECT_EQ(stats1(&o, &t), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions(fn + "teacher->hidden_states is NULL"));
  t = te;
  t.weight = nullptr;
  EXPECT_EQ(stats1(&o, &t), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions(fn + "teacher->weight is NULL"));
  EXPECT_EQ(stats(&o, &te, &sh, 1, h.ptr(), w.ptr(), nullptr, nullptr, nullptr, ws_bytes),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions(fn + "stats is NULL"));
  // rounds and previous
  for (int32_t round : {0, 3}) {
    EXPECT_EQ(stats(&o, &te, &sh, round, h.ptr(), w.ptr(), nullptr, nullptr, out, ws_bytes),
              FCE_ERROR_INVALID_ARGUMENT);
    EXPECT_TRUE(error_mentions(fn + "round (" + std::to_string(round) + ") must be in [1, 2]"));
  }
  EXPECT_EQ(stats(&o, &te, &sh, 2, h.ptr(), w.ptr(), nullptr, nullptr, out, ws_bytes),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions(fn + "previous is NULL"));
  EXPECT_EQ(
      stats(&o, &te, &sh, 1, h.ptr(), w.ptr(), nullptr, gathered.p<const float>(), out, ws_bytes),
      FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions(fn + "previous is given in round 1"));
  // the bias, the teacher's fields, the sizes and strides
  EXPECT_EQ(stats(&o, &te, &sh, 1, h.ptr(), w.ptr(), rows.ptr(), nullptr, out, ws_bytes),
            FCE_ERROR_UNSUPPORTED);
  EXPECT_TRUE(error_mentions(fn + "bias is not supported"));
  t = te;
  t.logits = h.ptr();
  EXPECT_EQ(stats1(&o, &t), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions(fn + "teacher->logits is set"));
  t = te;
  t.hidden = 0;
  EXPECT_EQ(stats1(&o, &t), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions(fn + "teacher->hidden (0)"));
  t = te;
  t.hidden_row_stride = Dt - 1;
  EXPECT_EQ(stats1(&o, &t), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions(fn + "teacher->hidden_row_stride"));
  fce_options bad = o;
  bad.hidden_row_stride = D - 1;
  EXPECT_EQ(stats1(&bad, &te), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions(fn + "options->hidden_row_stride"));
  EXPECT_EQ(fce_vp_linear_distill_stats(&o, &te, &sh, 1, N, 0, h.ptr(), w.ptr(), nullptr, nullptr,
                                        out, ws.ptr(), ws_bytes, test_stream()),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions(fn + "hidden"));
  fce_vp_shard wide = sh;
  wide.vocab_local = V + 1;
  EXPECT_EQ(stats(&o, &te, &wide, 1, h.ptr(), w.ptr(), nullptr, nullptr, out, ws_bytes),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions(fn + "vocab_local|" + fn + "vocab_start"));
  // alignment, overlap, the workspace
  EXPECT_EQ(stats(&o, &te, &sh, 1, h.ptr(), w.ptr(), nullptr, nullptr,
                  reinterpret_cast<float*>(st.p<char>() + 4), ws_bytes),
            FCE_ERROR_MISALIGNED);
  EXPECT_TRUE(error_mentions(fn + "stats"));
  EXPECT_EQ(stats(&o, &te, &sh, 1, h.ptr(), w.ptr(), nullptr, nullptr, h.p<float>(), ws_bytes),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("overlaps"));
  size_t lo = 0, hi = 0;
  ASSERT_EQ(fce_vp_linear_distill_stats_workspace_size(&o, &te, N, D, L, &lo, &hi), FCE_SUCCESS);
  ASSERT_GT(lo, 0u);
  EXPECT_EQ(stats(&o, &te, &sh, 1, h.ptr(), w.ptr(), nullptr, nullptr, out, lo - 1),
            FCE_ERROR_WORKSPACE_TOO_SMALL);
  EXPECT_TRUE(error_mentions(fn + "workspace"));
}

TEST_F(VpLinearDistillRefusals, OptionsAndQueries) {
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
    EXPECT_EQ(stats1(&bad, &te), FCE_ERROR_UNSUPPORTED) << r.field;
    EXPECT_TRUE(error_mentions(std::string("fce_vp_linear_distill_stats: ") + r.field));
    size_t lo = 0, hi = 0;
    EXPECT_EQ(fce_vp_linear_distill_stats_workspace_size(&bad, &te, N, D, L, &lo, &hi),
              FCE_ERROR_UNSUPPORTED);
    EXPECT_TRUE(
        error_mentions(std::string("fce_vp_linear_distill_stats_workspace_size: ") + r.field));
    EXPECT_EQ(fce_vp_linear_distill_backward_workspace_size(&bad, &te, 2, N, D, V, L, FCE_FLOAT32,
                                                            &lo, &hi),
              FCE_ERROR_UNSUPPORTED);
    EXPECT_TRUE(
        error_mentions(std::string("fce_vp_linear_distill_backward_workspace_size: ") + r.field));
  }
  size_t lo = 0, hi = 0;
  const std::string q = "fce_vp_linear_distill_backward_workspace_size: ";
  EXPECT_EQ(
      fce_vp_linear_distill_backward_workspace_size(&o, &te, 0, N, D, V, L, FCE_FLOAT32, &lo, &hi),
      FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions(q + "ranks"));
  EXPECT_EQ(fce_vp_linear_distill_backward_workspace_size(&o, &te, 2, N, D, V, V + 1, FCE_FLOAT32,
                                                          &lo, &hi),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions(q + "vocab_local"));
  EXPECT_EQ(
      fce_vp_linear_distill_backward_workspace_size(&o, &te, 2, N, D, V, L, FCE_FLOAT16, &lo, &hi),
      FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions(q + "grad_hidden_dtype"));
  EXPECT_EQ(fce_vp_linear_distill_backward_workspace_size(&o, &te, 2, N, D, V, L, FCE_FLOAT32,
                                                          nullptr, &hi),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions(q + "min_bytes"));
  fce_teacher t = te;
  t.hidden = 0;
  EXPECT_EQ(fce_vp_linear_distill_stats_workspace_size(&o, &t, N, D, L, &lo, &hi),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_distill_stats_workspace_size: teacher->hidden"));
  EXPECT_EQ(fce_vp_linear_distill_stats_workspace_size(&o, &te, N, D, 0, &lo, &hi),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_distill_stats_workspace_size: vocab_local"));
  t = te;
  t.temperature = 0.0f;
  EXPECT_EQ(fce_vp_linear_distill_stats_workspace_size(&o, &t, N, D, L, &lo, &hi),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_distill_stats_workspace_size: teacher->temperature"));
}

TEST_F(VpLinearDistillRefusals, Backward) {
  const std::string fn = "fce_vp_linear_distill_backward: ";
  const float* gath = gathered.p<const float>();
  fce_gradients g = FCE_GRADIENTS_INIT;
  g.grad_hidden = dh.ptr();
  g.grad_weight = dw.ptr();
  EXPECT_EQ(backward(&o, &te, nullptr, gath, nullptr, ws_bytes), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions(fn + "gradients is NULL"));
  fce_gradients none = FCE_GRADIENTS_INIT;
  EXPECT_EQ(backward(&o, &te, nullptr, gath, &none, ws_bytes), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions(fn + "gradients->grad_hidden and ->grad_weight are both NULL"));
  EXPECT_EQ(backward(&o, &te, nullptr, nullptr, &g, ws_bytes), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions(fn + "gathered_stats is NULL"));
  EXPECT_EQ(backward(&o, &te, rows.ptr(), gath, &g, ws_bytes), FCE_ERROR_UNSUPPORTED);
  EXPECT_TRUE(error_mentions(fn + "bias is not supported"));
  const struct {
    const char* field;
    void (*edit)(fce_gradients&, void*);
    fce_status status;
  } bad_grads[] = {
      {"gradients->grad_bias", [](fce_gradients& x, void* p) { x.grad_bias = p; },
       FCE_ERROR_UNSUPPORTED},
      {"gradients->grad_lse",
       [](fce_gradients& x, void* p) { x.grad_lse = static_cast<const float*>(p); },
       FCE_ERROR_UNSUPPORTED},
      {"gradients->grad_entropy",
       [](fce_gradients& x, void* p) { x.grad_entropy = static_cast<const float*>(p); },
       FCE_ERROR_UNSUPPORTED},
      {"gradients->grad_logits", [](fce_gradients& x, void* p) { x.grad_logits = p; },
       FCE_ERROR_INVALID_ARGUMENT},
      {"grad_hidden_dtype (2)",  // the name fce_vp_linear_backward's message gives it too
       [](fce_gradients& x, void*) { x.grad_hidden_dtype = FCE_BFLOAT16; },
       FCE_ERROR_INVALID_ARGUMENT},
  };
  for (const auto& b : bad_grads) {
    fce_gradients x = g;
    b.edit(x, rows.ptr());
    EXPECT_EQ(backward(&o, &te, nullptr, gath, &x, ws_bytes), b.status) << b.field;
    EXPECT_TRUE(error_mentions(fn + b.field));
  }
  fce_gradients small = g;
  small.grad_output = rows.p<const float>();  // mean: one value (rows is larger: fine)
  EXPECT_EQ(backward(&o, &te, nullptr, gath, &small, ws_bytes), FCE_SUCCESS) << fce_last_error();
  EXPECT_TRUE(finish());
  fce_teacher t = te;
  t.row_stride = 4;
  EXPECT_EQ(backward(&o, &t, nullptr, gath, &g, ws_bytes), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions(fn + "teacher->row_stride is set"));
  fce_gradients over = g;
  over.grad_hidden = h.ptr();  // grad_hidden over the hidden states
  EXPECT_EQ(backward(&o, &te, nullptr, gath, &over, ws_bytes), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("overlaps"));
  EXPECT_EQ(backward(&o, &te, nullptr, gath, &g, 0), FCE_ERROR_WORKSPACE_TOO_SMALL);
  EXPECT_TRUE(error_mentions(fn + "workspace"));
}

}  // namespace
