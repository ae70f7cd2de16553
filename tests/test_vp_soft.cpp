// test_vp_soft.cpp — class-probability targets (docs/semantics.md rules 16, 19) on the
// vocabulary-parallel calls, P = 1..4 ranks simulated in one process, each passing its shard of
// q [rows, vocab_local]: fce_vp_stats, fce_vp_loss (targets NULL: not read) and fce_vp_backward
// against the unsharded fce_forward and soft_ref.h's float64 reference (rule 18's entropy and
// row gradients against fce_forward's); adversarial rows (−inf entries with and without
// probability, a shard of −inf without probability, a NaN); the linear calls
// (fce_vp_linear_stats, fce_vp_linear_backward, and fce_vp_linear_ce with the ranks as threads)
// against fce_linear_ce; and the bad inputs with their messages.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "soft_ref.h"
#include "vp_linear_runner.h"

namespace {

using namespace fcet;
using namespace softref;

TestOptions soft_options(const Opts& ro, int dtype, int qdtype, const Buf& w) {
  TestOptions o = test_options();
  o.dtype = dtype;
  o.target_dtype = qdtype;
  o.reduction = ro.reduction;
  o.label_smoothing = static_cast<float>(ro.eps);
  o.z_loss_scale = static_cast<float>(ro.lambda);
  o.softcap = static_cast<float>(ro.softcap);
  o.logit_scale = static_cast<float>(ro.scale);
  o.class_weights = w.empty() ? nullptr : w.p<const float>();
  return o;
}

// ------------------------------------------------------------------ given logits ----------
struct SoftVpCase {
  std::string name;
  Opts o;
  bool weights = false;
  int dtype = FCE_FLOAT32, qdtype = FCE_FLOAT32;
  int64_t N = 13, V = 203;
  int64_t pad = 0;       // the logits' and the gradient's row stride: vocab_local + pad
  bool inplace = false;  // fce_vp_backward over the shard's logits
  bool uneven = true;
  bool entropy = false;  // options->vp_entropy: outputs->entropy, grad_lse and grad_entropy
  uint64_t seed = 1;
  std::vector<int> ranks = {1, 2, 3, 4};
};

std::string label(const SoftVpCase& c) {
  std::ostringstream s;
  s << c.name << " [" << backend_name() << " " << dtype_name(c.dtype) << " q "
    << dtype_name(c.qdtype) << " " << reduction_name(c.o.reduction) << " N=" << c.N << " V=" << c.V
    << " pad=" << c.pad << (c.inplace ? " inplace" : "") << (c.uneven ? " uneven" : " even")
    << (c.entropy ? " vp_entropy" : "") << "]";
  return s.str();
}

// What a call gives back (host doubles).
struct Outs {
  std::vector<double> loss, lse, zl, entropy, grad;
  std::vector<int64_t> argmax;
  uint32_t flags = 0;
};

class SoftVpRunner {
 public:
  explicit SoftVpRunner(SoftVpCase c) : c_(std::move(c)) {
    std::mt19937_64 rng(c_.seed);
    const int64_t N = c_.N, V = c_.V;
    if (c_.weights) c_.o.w = random_uniform(rng, static_cast<size_t>(V), 0.2, 2.0);
    z_ = random_logits(rng, c_.dtype, N, V, 1.0, 30.0);
    q_ = random_probs(rng, c_.qdtype, N, V);
    g_ = random_uniform(rng, c_.o.reduction == FCE_REDUCTION_NONE ? static_cast<size_t>(N) : 1, 0.5,
                        2.0);
    if (c_.entropy) {
      glse_ = random_uniform(rng, static_cast<size_t>(N), -1.0, 1.0);
      gent_ = random_uniform(rng, static_cast<size_t>(N), -1.0, 1.0);
    }
    init();
  }
  // Given inputs (adversarial rows).
  SoftVpRunner(SoftVpCase c, std::vector<double> z, std::vector<double> q, std::vector<double> g)
      : c_(std::move(c)), z_(std::move(z)), q_(std::move(q)), g_(std::move(g)) {
    init();
  }

  const Ref& ref() const { return ref_; }
  const Outs& whole() const { return whole_; }
  int64_t loss_len() const { return c_.o.reduction == FCE_REDUCTION_NONE ? c_.N : 1; }

  // The unsharded fce_forward with every output class probabilities allow.
  void unsharded() {
    SCOPED_TRACE(label(c_) + " fce_forward (unsharded)");
    const int64_t N = c_.N, V = c_.V;
    const Mat zm = mat(c_.dtype, N, V), lm = vec(FCE_FLOAT32, loss_len()), rm = vec(FCE_FLOAT32, N);
    Buf z = matrix_buf(c_.dtype, N, V, V, z_), q = matrix_buf(c_.qdtype, N, V, V, q_);
    Buf loss = poisoned(lm), lse = poisoned(rm), zl = poisoned(vec(FCE_FLOAT32, 1)),
        ent = c_.entropy ? poisoned(rm) : Buf(), grad = poisoned(zm),
        am = poisoned(vec(FCE_INT64, N)), flags = flags_buf(0);
    TestOptions o = soft_options(c_.o, c_.dtype, c_.qdtype, w_);
    size_t wsb = 0;
    ASSERT_EQ(fce_forward_workspace_size(&o, N, V, &wsb), FCE_SUCCESS) << fce_last_error();
    Buf ws = workspace_buf(wsb);
    fce_outputs out = FCE_OUTPUTS_INIT;
    out.loss = loss.p<float>();
    out.lse = lse.p<float>();
    out.z_loss = zl.p<float>();
    out.argmax = am.p<int64_t>();
    out.entropy = ent.p<float>();
    out.error_flags = flags.p<uint32_t>();
    fce_gradients gr = FCE_GRADIENTS_INIT;
    gr.grad_logits = grad.ptr();
    gr.grad_output = gout_.p<const float>();
    gr.grad_lse = glse_b_.p<const float>();
    gr.grad_entropy = gent_b_.p<const float>();
    const fce_status st =
        fce_forward(&o, N, V, z.ptr(), q.ptr(), &out, &gr, ws.ptr(), wsb, test_stream());
    ASSERT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    ASSERT_TRUE(finish());
    for (Buf* b : {&loss, &lse, &zl, &ent, &grad, &am, &flags}) b->pull();
    whole_.loss = read_mat(loss, lm);
    whole_.lse = read_mat(lse, rm);
    whole_.zl = read_mat(zl, vec(FCE_FLOAT32, 1));
    if (c_.entropy) whole_.entropy = read_mat(ent, rm);
    whole_.grad = read_mat(grad, zm);
    whole_.argmax = read_i64(am, N);
    whole_.flags = read_flags(flags);
  }

  // fce_vp_stats of shard s (its logits and its shard of q).
  Buf stats(const Shard& s) {
    SCOPED_TRACE("fce_vp_stats of shard [" + std::to_string(s.start) + ", +" +
                 std::to_string(s.local) + ")");
    const int64_t N = c_.N;
    Buf logits =
        matrix_buf(c_.dtype, N, s.local, s.local + c_.pad, columns(z_, N, c_.V, s.start, s.local));
    Buf q = matrix_buf(c_.qdtype, N, s.local, s.local, columns(q_, N, c_.V, s.start, s.local));
    const Mat sm = vec(FCE_FLOAT32, N * FCE_VP_STATS);
    Buf st = poisoned(sm);
    TestOptions o = shard_options();
    if (c_.pad) o.row_stride = s.local + c_.pad;
    const fce_vp_shard shard{1, c_.V, s.start, s.local, nullptr, nullptr};
    auto b_logits = logits.mirror(), b_q = q.mirror();
    const fce_status status =
        fce_vp_stats(&o, &shard, N, logits.ptr(), q.ptr(), st.p<float>(), test_stream());
    EXPECT_EQ(status, FCE_SUCCESS) << fce_status_string(status) << ": " << fce_last_error();
    EXPECT_TRUE(finish());
    for (Buf* b : {&logits, &q, &st}) b->pull();
    EXPECT_TRUE(unchanged(logits, b_logits, "logits (fce_vp_stats)"));
    EXPECT_TRUE(unchanged(q, b_q, "targets (fce_vp_stats)"));
    EXPECT_TRUE(all_written(st, sm, "stats"));
    return st;
  }

  // fce_vp_loss on gathered, targets NULL (class probabilities are not read).
  Outs loss(Buf& gathered, int64_t ranks) {
    const int64_t N = c_.N;
    const Mat lm = vec(FCE_FLOAT32, loss_len()), rm = vec(FCE_FLOAT32, N);
    Buf loss = poisoned(lm), lse = poisoned(rm), zl = poisoned(vec(FCE_FLOAT32, 1)),
        ent = c_.entropy ? poisoned(rm) : Buf(), am = poisoned(vec(FCE_INT64, N)),
        flags = flags_buf(0x100u);
    TestOptions o = shard_options();
    size_t wsb = 1;
    EXPECT_EQ(fce_vp_loss_workspace_size(&o, ranks, N, c_.V, &wsb), FCE_SUCCESS)
        << fce_last_error();
    Buf ws = workspace_buf(wsb);
    const fce_vp_shard shard{ranks, c_.V, 0, c_.V, nullptr, nullptr};
    fce_outputs out = FCE_OUTPUTS_INIT;
    out.loss = loss.p<float>();
    out.lse = lse.p<float>();
    out.z_loss = zl.p<float>();
    out.argmax = am.p<int64_t>();
    out.entropy = ent.p<float>();
    out.error_flags = flags.p<uint32_t>();
    auto b_g = gathered.mirror();
    const fce_status st = fce_vp_loss(&o, &shard, N, nullptr, gathered.p<const float>(), &out,
                                      ws.ptr(), wsb, test_stream());
    EXPECT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    EXPECT_TRUE(finish());
    for (Buf* b : {&gathered, &loss, &lse, &zl, &ent, &am, &flags, &ws}) b->pull();
    EXPECT_TRUE(unchanged(gathered, b_g, "gathered_stats"));
    EXPECT_TRUE(guards_intact(ws, "workspace (fce_vp_loss)"));
    EXPECT_TRUE(all_written(loss, lm, "loss"));
    EXPECT_TRUE(all_written(lse, rm, "lse"));
    Outs v;
    v.loss = read_mat(loss, lm);
    v.lse = read_mat(lse, rm);
    v.zl = read_mat(zl, vec(FCE_FLOAT32, 1));
    if (c_.entropy) {
      EXPECT_TRUE(all_written(ent, rm, "outputs->entropy"));
      v.entropy = read_mat(ent, rm);
    }
    v.argmax = read_i64(am, N);
    v.flags = read_flags(flags);
    return v;
  }

  // fce_vp_backward of shard s; its columns into grad [N, V].
  void backward(const Shard& s, Buf& gathered, int64_t ranks, std::vector<double>* grad) {
    SCOPED_TRACE("fce_vp_backward of shard [" + std::to_string(s.start) + ", +" +
                 std::to_string(s.local) + ")" + (c_.inplace ? " in place" : ""));
    const int64_t N = c_.N;
    const Mat lm = mat(c_.dtype, N, s.local, s.local + c_.pad);
    Buf logits =
        matrix_buf(c_.dtype, N, s.local, lm.stride, columns(z_, N, c_.V, s.start, s.local));
    Buf q = matrix_buf(c_.qdtype, N, s.local, s.local, columns(q_, N, c_.V, s.start, s.local));
    Buf gbuf = c_.inplace ? Buf() : poisoned(lm);
    TestOptions o = shard_options();
    if (c_.pad || c_.inplace) o.row_stride = o.grad_row_stride = lm.stride;
    size_t wsb = 1;
    EXPECT_EQ(fce_vp_backward_workspace_size(&o, ranks, N, c_.V, s.local, &wsb), FCE_SUCCESS)
        << fce_last_error();
    Buf ws = workspace_buf(wsb);
    const fce_vp_shard shard{ranks, c_.V, s.start, s.local, nullptr, nullptr};
    fce_gradients gr = FCE_GRADIENTS_INIT;
    gr.grad_logits = c_.inplace ? logits.ptr() : gbuf.ptr();
    gr.grad_output = gout_.p<const float>();
    gr.grad_lse = glse_b_.p<const float>();
    gr.grad_entropy = gent_b_.p<const float>();
    auto b_q = q.mirror(), b_logits = logits.mirror();
    const fce_status st =
        fce_vp_backward(&o, &shard, N, logits.ptr(), q.ptr(), gathered.p<const float>(), &gr,
                        ws.ptr(), wsb, test_stream());
    ASSERT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    ASSERT_TRUE(finish());
    for (Buf* b : {&logits, &q, &gbuf, &ws}) b->pull();
    EXPECT_TRUE(unchanged(q, b_q, "targets (fce_vp_backward)"));
    EXPECT_TRUE(guards_intact(ws, "workspace (fce_vp_backward)"));
    if (!c_.inplace) {
      EXPECT_TRUE(unchanged(logits, b_logits, "logits (fce_vp_backward)"));
      EXPECT_TRUE(all_written(gbuf, lm, "grad_logits"));
    }
    const std::vector<double> v = read_mat(c_.inplace ? logits : gbuf, lm);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t j = 0; j < s.local; ++j)
        (*grad)[static_cast<size_t>(r * c_.V + s.start + j)] =
            v[static_cast<size_t>(r * s.local + j)];
  }

  // P ranks: the stats, gathered in a permuted order (and in rank order for the loss), the
  // loss, every shard's gradient; against the unsharded call and the reference.
  void sharded(int P) {
    SCOPED_TRACE(label(c_) + " P=" + std::to_string(P));
    const std::vector<Shard> shards = make_shards(c_.V, P, c_.uneven);
    std::vector<Buf> st;
    for (const Shard& s : shards) st.push_back(stats(s));
    ASSERT_FALSE(testing::Test::HasFatalFailure());
    Buf gathered_perm =
        gather_both_orders(st, c_.N, [&](Buf& gathered) { check_loss(loss(gathered, P)); });
    std::vector<double> grad(static_cast<size_t>(c_.N * c_.V), -12345.0);
    for (const Shard& s : shards) ASSERT_NO_FATAL_FAILURE(backward(s, gathered_perm, P, &grad));
    const double tol = tolerance(c_.dtype);
    EXPECT_TRUE(close_normwise(grad, whole_.grad, tol, "grad_logits (all shards) vs unsharded"));
    if (!c_.entropy) {  // (the reference has no rule 18 terms)
      EXPECT_TRUE(close_normwise(grad, ref_.grad, tol, "grad_logits (all shards) vs reference"));
    }
  }

  void check_loss(const Outs& v) {
    constexpr double tol = 1e-5;  // float32 results of exact inputs
    if (c_.o.reduction == FCE_REDUCTION_NONE) {
      EXPECT_TRUE(close_normwise(v.loss, whole_.loss, tol, "loss (per row) vs unsharded"));
      EXPECT_TRUE(
          close_normwise(v.loss, as_f32(ref_.row_loss), tol, "loss (per row) vs reference"));
    } else {
      EXPECT_TRUE(close_scalar(v.loss[0], whole_.loss[0], tol, "loss vs unsharded"));
      EXPECT_TRUE(close_scalar(v.loss[0], as_f32(ref_.loss), tol, "loss vs reference"));
    }
    EXPECT_TRUE(close_normwise(v.lse, whole_.lse, tol, "lse vs unsharded"));
    EXPECT_TRUE(close_normwise(v.lse, as_f32(ref_.lse), tol, "lse vs reference"));
    EXPECT_TRUE(close_scalar(v.zl[0], whole_.zl[0], tol, "z_loss vs unsharded"));
    EXPECT_TRUE(close_scalar(v.zl[0], as_f32(ref_.z_loss), tol, "z_loss vs reference"));
    if (c_.entropy) {
      EXPECT_TRUE(close_normwise(v.entropy, whole_.entropy, tol, "entropy vs unsharded"));
    }
    EXPECT_EQ(v.argmax, ref_.argmax) << "argmax vs reference";
    EXPECT_EQ(v.argmax, whole_.argmax) << "argmax vs unsharded";
    EXPECT_EQ(v.flags, 0x100u) << "error_flags: none for class probabilities";
  }

  void run() {
    ASSERT_NO_FATAL_FAILURE(unsharded());
    for (int P : c_.ranks) ASSERT_NO_FATAL_FAILURE(sharded(P));
  }

 private:
  void init() {
    if (!c_.o.w.empty()) w_ = f32_buf(c_.o.w);
    gout_ = f32_buf(g_);
    if (!glse_.empty()) glse_b_ = f32_buf(glse_);
    if (!gent_.empty()) gent_b_ = f32_buf(gent_);
    ref_ = soft_ref(c_.o, c_.N, c_.V, z_, q_, g_);
  }
  // The options of the sharded calls (the strides set by each call from its layout).
  TestOptions shard_options() const {
    TestOptions o = soft_options(c_.o, c_.dtype, c_.qdtype, w_);
    o.vp_entropy = c_.entropy ? 1 : 0;
    return o;
  }

  SoftVpCase c_;
  std::vector<double> z_, q_, g_, glse_, gent_;
  Buf w_, gout_, glse_b_, gent_b_;
  Ref ref_;
  Outs whole_;
};

// soft_ref.h's option sets, the fourth with label smoothing too
std::vector<Config> vp_configs() {
  std::vector<Config> c = softref::configs();
  c[3].name = "scale+zloss+smoothing";
  c[3].o.eps = 0.05;
  return c;
}

class VpSoft : public BackendTest {};

TEST_F(VpSoft, MatchesUnshardedAndReference) {
  uint64_t seed = 1000;
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16})
    for (const Config& cf : vp_configs())
      for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE}) {
        SoftVpCase c;
        c.name = cf.name;
        c.o = cf.o;
        c.o.reduction = red;
        c.weights = cf.weights;
        c.dtype = dtype;
        c.qdtype = dtype == FCE_FLOAT32   ? FCE_FLOAT32
                   : dtype == FCE_FLOAT16 ? FCE_BFLOAT16
                                          : FCE_FLOAT16;
        c.seed = ++seed;
        SoftVpRunner(c).run();
      }
}

// Strided logits and gradients, in place, even shards; a long row (several passes of a CUDA
// CTA over the shard).
TEST_F(VpSoft, LayoutsAndLongRows) {
  uint64_t seed = 2000;
  const std::vector<Config> cs = vp_configs();
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (int variant = 0; variant < 4; ++variant) {
      SoftVpCase c;
      c.name = cs[static_cast<size_t>(variant)].name;
      c.o = cs[static_cast<size_t>(variant)].o;
      c.weights = cs[static_cast<size_t>(variant)].weights;
      c.dtype = dtype;
      c.seed = ++seed;
      switch (variant) {
        case 0: c.pad = 5; break;
        case 1: c.inplace = true, c.pad = 3; break;
        case 2: c.uneven = false, c.o.reduction = FCE_REDUCTION_NONE; break;
        default: c.N = 3, c.V = 40001, c.ranks = {1, 3}; break;
      }
      SoftVpRunner(c).run();
    }
}

// options->vp_entropy: the entropy, and the gradients of grad_lse and grad_entropy (rule 18),
// against fce_forward's.
TEST_F(VpSoft, EntropyAndRowGradients) {
  uint64_t seed = 3000;
  const std::vector<Config> cs = vp_configs();
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (const Config& cf : {cs[0], cs[1], cs[2]})
      for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_NONE}) {
        SoftVpCase c;
        c.name = cf.name;
        c.o = cf.o;
        c.o.reduction = red;
        c.weights = cf.weights;
        c.dtype = dtype;
        c.entropy = true;
        c.seed = ++seed;
        SoftVpRunner(c).run();
      }
}

// A constant row at −1e30, a row of huge spread, −inf entries with q = 0 (finite), a −inf entry
// with q > 0 (loss +inf), a row of −inf (NaN), a NaN logit, a row whose last classes (all of
// the last shard of P = 2 and 3) are −inf with q = 0 there: that shard's m_r is −inf and its
// W_r 0, which adds nothing; and a NaN q_j (not checked: NaN loss and gradient row).
TEST_F(VpSoft, AdversarialRows) {
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16}) {
    const int64_t N = 8, V = 67;
    const double big = dtype == FCE_BFLOAT16 ? 3.38e38 : 3.4e38;
    std::mt19937_64 rng(17);
    std::vector<double> z = random_logits(rng, dtype, N, V, 1.0, 10.0);
    std::vector<double> q = random_probs(rng, FCE_FLOAT32, N, V);
    for (int64_t j = 0; j < V; ++j) z[0 * V + j] = round_to(dtype, -1e30);
    for (int64_t j = 0; j < V; ++j) z[1 * V + j] = round_to(dtype, j * (big / (2 * V)) - big / 4);
    for (int64_t j = 0; j < V; j += 3) z[2 * V + j] = -INFINITY, q[2 * V + j] = 0.0;
    z[3 * V + 4] = -INFINITY;  // q > 0 there
    q[3 * V + 4] = 0.25;
    for (int64_t j = 0; j < V; ++j) z[4 * V + j] = -INFINITY;
    z[5 * V + 9] = kNaN;
    for (int64_t j = V / 3; j < V; ++j) z[6 * V + j] = -INFINITY, q[6 * V + j] = 0.0;
    q[7 * V + 30] = kNaN;
    SoftVpCase c;
    c.name = "adversarial";
    c.dtype = dtype;
    c.N = N, c.V = V;
    c.o.reduction = FCE_REDUCTION_NONE;
    SoftVpRunner run(c, z, q, std::vector<double>(static_cast<size_t>(N), 1.0));
    const Ref& r = run.ref();
    ASSERT_TRUE(std::isfinite(r.row_loss[0]) && std::isfinite(r.row_loss[2]) &&
                std::isfinite(r.row_loss[6]));
    ASSERT_EQ(r.row_loss[3], INFINITY);
    ASSERT_TRUE(std::isnan(r.row_loss[4]) && std::isnan(r.row_loss[5]) &&
                std::isnan(r.row_loss[7]));
    ASSERT_NO_FATAL_FAILURE(run.unsharded());
    for (int P : {1, 2, 3}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " P=" + std::to_string(P));
      const std::vector<Shard> shards = make_shards(V, P, true);
      std::vector<Buf> st;
      std::vector<const Buf*> order;
      for (const Shard& s : shards) st.push_back(run.stats(s));
      for (int k : rank_order(P, true)) order.push_back(&st[static_cast<size_t>(k)]);
      Buf gathered = gather(order, N);
      const Outs v = run.loss(gathered, P);
      EXPECT_TRUE(close_normwise(v.loss, as_f32(r.row_loss), 1e-5, "loss vs reference"));
      EXPECT_TRUE(close_normwise(v.loss, run.whole().loss, 1e-5, "loss vs unsharded"));
      std::vector<double> grad(static_cast<size_t>(N * V), -12345.0);
      for (const Shard& s : shards) ASSERT_NO_FATAL_FAILURE(run.backward(s, gathered, P, &grad));
      for (int64_t i = 0; i < N; ++i) {
        SCOPED_TRACE("row " + std::to_string(i));
        const std::vector<double> got(grad.begin() + i * V, grad.begin() + (i + 1) * V);
        const std::vector<double> want(run.whole().grad.begin() + i * V,
                                       run.whole().grad.begin() + (i + 1) * V);
        if (i == 4 || i == 5 || i == 7) {  // no distribution, or a NaN q_j: NaN rows
          for (double x : got) EXPECT_TRUE(std::isnan(x));
          continue;
        }
        EXPECT_TRUE(close_normwise(got, want, tolerance(dtype), "gradient row vs unsharded"));
      }
    }
  }
}

// ------------------------------------------------------------------ linear -----------------
// fce_vp_linear_stats, the gather, fce_vp_loss and fce_vp_linear_backward on P shards of the
// weight, and fce_vp_linear_ce with the ranks as threads (SimGather), against fce_linear_ce
// (the sum over ranks of the partial ∂h; ∂W and ∂b by rows).
struct LinSoft {
  std::string name;
  Opts o;
  bool weights = false;
  int dtype = FCE_FLOAT32;
  int qdtype = FCE_FLOAT16;
  int64_t N = 37, D = 24, V = 301;
  uint64_t seed = 1;
};

struct LinGrads {
  std::vector<double> loss, lse, zl, gh, gw, gb;
};

class LinSoftRunner {
 public:
  explicit LinSoftRunner(LinSoft c) : c_(std::move(c)) {
    std::mt19937_64 rng(c_.seed);
    const int64_t N = c_.N, D = c_.D, V = c_.V;
    if (c_.weights) c_.o.w = random_uniform(rng, static_cast<size_t>(V), 0.2, 2.0);
    h_ = random_normal(rng, c_.dtype, static_cast<size_t>(N * D), 1.0);
    W_ = random_normal(rng, c_.dtype, static_cast<size_t>(V * D), 0.5);
    b_ = random_normal(rng, c_.dtype, static_cast<size_t>(V), 0.5);
    q_ = random_probs(rng, c_.qdtype, N, V);
    g_ = random_uniform(rng, c_.o.reduction == FCE_REDUCTION_NONE ? static_cast<size_t>(N) : 1, 0.5,
                        2.0);
    if (!c_.o.w.empty()) w_ = f32_buf(c_.o.w);
    gout_ = f32_buf(g_);
    hidden_ = matrix_buf(c_.dtype, N, D, D, h_);
  }
  int64_t loss_len() const { return c_.o.reduction == FCE_REDUCTION_NONE ? c_.N : 1; }
  double tol() const { return c_.dtype == FCE_FLOAT32 ? 1e-5 : 3e-2; }
  TestOptions options() const {
    TestOptions o = soft_options(c_.o, c_.dtype, c_.qdtype, w_);
    o.grad_weight_fp32 = 1;
    return o;
  }

  // fce_linear_ce over the whole weight: the baseline.
  LinGrads unsharded() {
    const int64_t N = c_.N, D = c_.D, V = c_.V;
    Buf Wb = matrix_buf(c_.dtype, V, D, D, W_), bb = matrix_buf(c_.dtype, 1, V, V, b_);
    Buf qb = matrix_buf(c_.qdtype, N, V, V, q_);
    const Mat lm = vec(FCE_FLOAT32, loss_len()), rm = vec(FCE_FLOAT32, N), hm = mat(c_.dtype, N, D),
              wm = mat(FCE_FLOAT32, V, D), bm = vec(FCE_FLOAT32, V);
    Buf loss = poisoned(lm), lse = poisoned(rm), zl = poisoned(vec(FCE_FLOAT32, 1)),
        gh = poisoned(hm), gw = poisoned(wm), gb = poisoned(bm);
    TestOptions o = options();
    size_t lo = 0, hi = 0;
    EXPECT_EQ(fce_linear_ce_workspace_size(&o, N, D, V, 1, &lo, &hi), FCE_SUCCESS)
        << fce_last_error();
    Buf ws = workspace_buf(hi);
    fce_outputs out = FCE_OUTPUTS_INIT;
    out.loss = loss.p<float>();
    out.lse = lse.p<float>();
    out.z_loss = zl.p<float>();
    fce_gradients gr = FCE_GRADIENTS_INIT;
    gr.grad_output = gout_.p<const float>();
    gr.grad_hidden = gh.ptr();  // (of options->dtype)
    gr.grad_weight = gw.ptr();
    gr.grad_bias = gb.ptr();
    const fce_status st = fce_linear_ce(&o, N, D, V, hidden_.ptr(), Wb.ptr(), bb.ptr(), qb.ptr(),
                                        &out, &gr, ws.ptr(), hi, test_stream());
    EXPECT_EQ(st, FCE_SUCCESS) << fce_last_error();
    EXPECT_TRUE(finish());
    for (Buf* x : {&loss, &lse, &zl, &gh, &gw, &gb}) x->pull();
    return {read_mat(loss, lm), read_mat(lse, rm), read_mat(zl, vec(FCE_FLOAT32, 1)),
            read_mat(gh, hm),   read_mat(gw, wm),  read_mat(gb, bm)};
  }

  void compare(const LinGrads& got, const LinGrads& want, const char* what) {
    SCOPED_TRACE(what);
    EXPECT_TRUE(close_normwise(got.loss, want.loss, tol(), "loss"));
    EXPECT_TRUE(close_normwise(got.lse, want.lse, tol(), "lse"));
    EXPECT_TRUE(close_normwise(got.zl, want.zl, tol(), "z_loss"));
    EXPECT_TRUE(close_normwise(got.gh, want.gh, tol(), "grad_hidden (sum over ranks)"));
    EXPECT_TRUE(close_normwise(got.gw, want.gw, tol(), "grad_weight (shard rows)"));
    EXPECT_TRUE(close_normwise(got.gb, want.gb, tol(), "grad_bias (shard rows)"));
  }

  // The two-phase calls on P shards.
  LinGrads two_phase(int P) {
    const int64_t N = c_.N, D = c_.D, V = c_.V;
    const std::vector<Shard> shards = make_shards(V, P, true);
    TestOptions o = options();
    std::vector<Buf> stats;
    for (const Shard& s : shards) {
      Buf Wb = matrix_buf(c_.dtype, s.local, D, D, rows_of(W_, D, s));
      Buf bb = matrix_buf(c_.dtype, 1, s.local, s.local, rows_of(b_, 1, s));
      Buf qb = matrix_buf(c_.qdtype, N, s.local, s.local, columns(q_, N, V, s.start, s.local));
      const Mat sm = vec(FCE_FLOAT32, N * FCE_VP_STATS);
      Buf st = poisoned(sm);
      size_t lo = 0, hi = 0;
      EXPECT_EQ(fce_vp_linear_stats_workspace_size(&o, N, D, s.local, &lo, &hi), FCE_SUCCESS)
          << fce_last_error();
      Buf ws = workspace_buf(hi);
      const fce_vp_shard shard{1, V, s.start, s.local, nullptr, nullptr};
      EXPECT_EQ(fce_vp_linear_stats(&o, &shard, N, D, hidden_.ptr(), Wb.ptr(), bb.ptr(), qb.ptr(),
                                    st.p<float>(), ws.ptr(), hi, test_stream()),
                FCE_SUCCESS)
          << fce_last_error();
      EXPECT_TRUE(finish());
      st.pull();
      EXPECT_TRUE(all_written(st, sm, "stats (fce_vp_linear_stats)"));
      stats.push_back(std::move(st));
    }
    std::vector<const Buf*> order;
    for (int k : rank_order(P, true)) order.push_back(&stats[static_cast<size_t>(k)]);
    Buf gathered = gather(order, N);
    LinGrads out;
    {  // the loss
      const Mat lm = vec(FCE_FLOAT32, loss_len()), rm = vec(FCE_FLOAT32, N);
      Buf loss = poisoned(lm), lse = poisoned(rm), zl = poisoned(vec(FCE_FLOAT32, 1));
      size_t wsb = 0;
      EXPECT_EQ(fce_vp_loss_workspace_size(&o, P, N, V, &wsb), FCE_SUCCESS) << fce_last_error();
      Buf ws = workspace_buf(wsb);
      const fce_vp_shard shard{P, V, 0, V, nullptr, nullptr};
      fce_outputs lo = FCE_OUTPUTS_INIT;
      lo.loss = loss.p<float>();
      lo.lse = lse.p<float>();
      lo.z_loss = zl.p<float>();
      EXPECT_EQ(fce_vp_loss(&o, &shard, N, nullptr, gathered.p<const float>(), &lo, ws.ptr(), wsb,
                            test_stream()),
                FCE_SUCCESS)
          << fce_last_error();
      EXPECT_TRUE(finish());
      for (Buf* x : {&loss, &lse, &zl}) x->pull();
      out.loss = read_mat(loss, lm);
      out.lse = read_mat(lse, rm);
      out.zl = read_mat(zl, vec(FCE_FLOAT32, 1));
    }
    out.gh.assign(static_cast<size_t>(N * D), 0.0);
    for (const Shard& s : shards) {
      Buf Wb = matrix_buf(c_.dtype, s.local, D, D, rows_of(W_, D, s));
      Buf bb = matrix_buf(c_.dtype, 1, s.local, s.local, rows_of(b_, 1, s));
      Buf qb = matrix_buf(c_.qdtype, N, s.local, s.local, columns(q_, N, V, s.start, s.local));
      const Mat hm = mat(FCE_FLOAT32, N, D), wm = mat(FCE_FLOAT32, s.local, D),
                bm = vec(FCE_FLOAT32, s.local);
      Buf gh = poisoned(hm), gw = poisoned(wm), gb = poisoned(bm);
      size_t lo = 0, hi = 0;
      EXPECT_EQ(
          fce_vp_linear_backward_workspace_size(&o, P, N, D, V, s.local, FCE_FLOAT32, &lo, &hi),
          FCE_SUCCESS)
          << fce_last_error();
      Buf ws = workspace_buf(hi);
      const fce_vp_shard shard{P, V, s.start, s.local, nullptr, nullptr};
      fce_gradients gr = FCE_GRADIENTS_INIT;
      gr.grad_output = gout_.p<const float>();
      gr.grad_hidden = gh.ptr();
      gr.grad_hidden_dtype = FCE_FLOAT32;
      gr.grad_weight = gw.ptr();
      gr.grad_bias = gb.ptr();
      EXPECT_EQ(fce_vp_linear_backward(&o, &shard, N, D, hidden_.ptr(), Wb.ptr(), bb.ptr(),
                                       qb.ptr(), gathered.p<const float>(), &gr, ws.ptr(), hi,
                                       test_stream()),
                FCE_SUCCESS)
          << fce_last_error();
      EXPECT_TRUE(finish());
      for (Buf* x : {&gh, &gw, &gb}) x->pull();
      accumulate_grads(s, read_mat(gh, hm), read_mat(gw, wm), read_mat(gb, bm), &out);
    }
    return out;
  }

  // fce_vp_linear_ce on every rank at once; the loss bitwise the same on every rank.
  LinGrads fused(int P, bool ws_min) {
    const int64_t N = c_.N, D = c_.D, V = c_.V;
    const std::vector<Shard> shards = make_shards(V, P, true);
    TestOptions o = options();
    size_t wsb = 0;
    for (const Shard& s : shards) {
      size_t mn = 0, op = 0;
      EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o, P, N, D, V, s.local, 1, FCE_FLOAT32, &mn, &op),
                FCE_SUCCESS)
          << fce_last_error();
      wsb = std::max(wsb, ws_min ? mn : op);
    }
    struct RankBufs {
      Buf W, b, q, loss, lse, zl, gh, gw, gb, ws;
      fce_status st = FCE_ERROR_INTERNAL;
      std::string err;
    };
    const Mat lm = vec(FCE_FLOAT32, loss_len()), rm = vec(FCE_FLOAT32, N),
              hm = mat(FCE_FLOAT32, N, D);
    std::vector<RankBufs> rb(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) {
      const Shard& s = shards[static_cast<size_t>(r)];
      RankBufs& b = rb[static_cast<size_t>(r)];
      b.W = matrix_buf(c_.dtype, s.local, D, D, rows_of(W_, D, s));
      b.b = matrix_buf(c_.dtype, 1, s.local, s.local, rows_of(b_, 1, s));
      b.q = matrix_buf(c_.qdtype, N, s.local, s.local, columns(q_, N, V, s.start, s.local));
      b.loss = poisoned(lm);
      b.lse = poisoned(rm);
      b.zl = poisoned(vec(FCE_FLOAT32, 1));
      b.gh = poisoned(hm);
      b.gw = poisoned(mat(FCE_FLOAT32, s.local, D));
      b.gb = poisoned(vec(FCE_FLOAT32, s.local));
      b.ws = workspace_buf(wsb);
    }
    EXPECT_TRUE(finish());
    SimGather g(P, rank_order(P, true));
    std::vector<SimGather::Rank> ctx;
    for (int r = 0; r < P; ++r) ctx.push_back({&g, r});
    std::vector<std::thread> threads;
    for (int r = 0; r < P; ++r)
      threads.emplace_back([&, r] {
        const Shard& s = shards[static_cast<size_t>(r)];
        RankBufs& b = rb[static_cast<size_t>(r)];
        const fce_vp_shard shard{
            P, V, s.start, s.local, SimGather::fn, &ctx[static_cast<size_t>(r)]};
        fce_outputs out = FCE_OUTPUTS_INIT;
        out.loss = b.loss.p<float>();
        out.lse = b.lse.p<float>();
        out.z_loss = b.zl.p<float>();
        fce_gradients gr = FCE_GRADIENTS_INIT;
        gr.grad_output = gout_.p<const float>();
        gr.grad_hidden = b.gh.ptr();
        gr.grad_hidden_dtype = FCE_FLOAT32;
        gr.grad_weight = b.gw.ptr();
        gr.grad_bias = b.gb.ptr();
        b.st = fce_vp_linear_ce(&o, &shard, N, D, hidden_.ptr(), b.W.ptr(), b.b.ptr(), b.q.ptr(),
                                &out, &gr, b.ws.ptr(), wsb, test_stream());
        if (b.st != FCE_SUCCESS) b.err = fce_last_error();
        g.leave();
      });
    for (auto& t : threads) t.join();
    EXPECT_TRUE(finish());
    LinGrads out;
    out.gh.assign(static_cast<size_t>(N * D), 0.0);
    std::vector<uint8_t> loss0;
    for (int r = 0; r < P; ++r) {
      const Shard& s = shards[static_cast<size_t>(r)];
      RankBufs& b = rb[static_cast<size_t>(r)];
      EXPECT_EQ(b.st, FCE_SUCCESS) << "rank " << r << ": " << b.err;
      for (Buf* x : {&b.loss, &b.lse, &b.zl, &b.gh, &b.gw, &b.gb, &b.ws}) x->pull();
      EXPECT_TRUE(guards_intact(b.ws, "workspace (fce_vp_linear_ce)"));
      const std::vector<uint8_t> raw = raw_elements(b.loss, lm);
      if (r == 0) {
        loss0 = raw;
        out.loss = read_mat(b.loss, lm);
        out.lse = read_mat(b.lse, rm);
        out.zl = read_mat(b.zl, vec(FCE_FLOAT32, 1));
      } else {
        EXPECT_TRUE(bitwise_equal(raw, loss0, "loss (rank r vs rank 0)"));
      }
      accumulate_grads(s, read_mat(b.gh, hm), read_mat(b.gw, mat(FCE_FLOAT32, s.local, D)),
                       read_mat(b.gb, vec(FCE_FLOAT32, s.local)), &out);
    }
    return out;
  }

  void run(const std::vector<int>& ranks) {
    const LinGrads whole = unsharded();
    ASSERT_FALSE(testing::Test::HasFailure());
    for (int P : ranks) {
      SCOPED_TRACE(c_.name + " " + dtype_name(c_.dtype) + " " + reduction_name(c_.o.reduction) +
                   " P=" + std::to_string(P));
      compare(two_phase(P), whole, "fce_vp_linear_stats + fce_vp_loss + fce_vp_linear_backward");
      for (bool ws_min : {true, false})
        compare(fused(P, ws_min), whole,
                ws_min ? "fce_vp_linear_ce (min_bytes)" : "fce_vp_linear_ce (optimal_bytes)");
    }
  }

 private:
  // Rows [s.start, s.start + s.local) of a [rows, cols] matrix.
  static std::vector<double> rows_of(const std::vector<double>& m, int64_t cols, const Shard& s) {
    return std::vector<double>(m.begin() + s.start * cols, m.begin() + (s.start + s.local) * cols);
  }
  void accumulate_grads(const Shard& s, const std::vector<double>& gh,
                        const std::vector<double>& gw, const std::vector<double>& gb,
                        LinGrads* out) const {
    const int64_t D = c_.D;
    for (size_t i = 0; i < gh.size(); ++i) out->gh[i] += gh[i];
    out->gw.resize(static_cast<size_t>(c_.V * D));
    out->gb.resize(static_cast<size_t>(c_.V));
    std::copy(gw.begin(), gw.end(), out->gw.begin() + s.start * D);
    std::copy(gb.begin(), gb.end(), out->gb.begin() + s.start);
  }

  LinSoft c_;
  std::vector<double> h_, W_, b_, q_, g_;
  Buf w_, gout_, hidden_;
};

TEST_F(VpSoft, LinearCalls) {
  uint64_t seed = 4000;
  const std::vector<Config> cs = vp_configs();
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (const Config& cf : {cs[0], cs[1], cs[2]})
      for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_NONE}) {
        LinSoft c;
        c.name = cf.name;
        c.o = cf.o;
        c.o.reduction = red;
        c.weights = cf.weights;
        c.dtype = dtype;
        c.seed = ++seed;
        LinSoftRunner(c).run({1, 2, 3});
      }
}

// ------------------------------------------------------------------ bad inputs -------------
class VpSoftErrors : public BackendTest {
 protected:
  static constexpr int64_t N = 4, V = 16, L = 8, D = 8;
  Buf z = matrix_buf(FCE_FLOAT32, N, L, L, std::vector<double>(N* L, 0.5));
  Buf q = matrix_buf(FCE_FLOAT32, N, L, L, std::vector<double>(N* L, 1.0 / V));
  Buf stats = Buf(N * FCE_VP_STATS * 4), gathered = Buf(2 * N * FCE_VP_STATS * 4);
  Buf loss = Buf(16), acc = Buf(16), grad = Buf(N * L * 4);
  Buf h = matrix_buf(FCE_FLOAT32, N, D, D, std::vector<double>(N* D, 0.1));
  Buf W = matrix_buf(FCE_FLOAT32, L, D, D, std::vector<double>(L* D, 0.1));
  Buf gh = Buf(N * D * 4);
  Buf ws = workspace_buf(1 << 22);
  const fce_vp_shard shard{2, V, 0, L, nullptr, nullptr};
  TestOptions soft() const {
    TestOptions o = test_options();
    o.target_dtype = FCE_FLOAT32;
    return o;
  }
  void expect(fce_status st, fce_status want, const char* call, const char* field) {
    EXPECT_EQ(st, want) << fce_status_string(st) << ": " << fce_last_error();
    EXPECT_TRUE(error_mentions(call));
    EXPECT_TRUE(error_mentions(field));
  }
  fce_status stats_call(const TestOptions& o, const void* targets) {
    return fce_vp_stats(&o, &shard, N, z.ptr(), targets, stats.p<float>(), test_stream());
  }
  fce_status loss_call(const TestOptions& o, float* accuracy = nullptr) {
    fce_outputs out = FCE_OUTPUTS_INIT;
    out.loss = loss.p<float>();
    out.accuracy = accuracy;
    return fce_vp_loss(&o, &shard, N, nullptr, gathered.p<const float>(), &out, ws.ptr(), 1 << 22,
                       test_stream());
  }
  fce_status backward_call(const TestOptions& o, const void* targets) {
    fce_gradients g = FCE_GRADIENTS_INIT;
    g.grad_logits = grad.ptr();
    return fce_vp_backward(&o, &shard, N, z.ptr(), targets, gathered.p<const float>(), &g, ws.ptr(),
                           1 << 22, test_stream());
  }
  fce_status linear_stats_call(const TestOptions& o, const void* targets) {
    return fce_vp_linear_stats(&o, &shard, N, D, h.ptr(), W.ptr(), nullptr, targets,
                               stats.p<float>(), ws.ptr(), 1 << 22, test_stream());
  }
  fce_status linear_backward_call(const TestOptions& o, const void* targets) {
    fce_gradients g = FCE_GRADIENTS_INIT;
    g.grad_hidden = gh.ptr();
    g.grad_hidden_dtype = FCE_FLOAT32;
    return fce_vp_linear_backward(&o, &shard, N, D, h.ptr(), W.ptr(), nullptr, targets,
                                  gathered.p<const float>(), &g, ws.ptr(), 1 << 22, test_stream());
  }
  static fce_status no_gather(void*, const float*, float*, int64_t, void*) {
    return FCE_ERROR_INTERNAL;  // never reached: every call below is refused first
  }
  fce_status linear_ce_call(const TestOptions& o, const void* targets, float* accuracy = nullptr) {
    fce_vp_shard s = shard;
    s.all_gather = no_gather;
    fce_outputs out = FCE_OUTPUTS_INIT;
    out.loss = loss.p<float>();
    out.accuracy = accuracy;
    return fce_vp_linear_ce(&o, &s, N, D, h.ptr(), W.ptr(), nullptr, targets, &out, nullptr,
                            ws.ptr(), 1 << 22, test_stream());
  }
};

// NULL targets: refused by the calls that read the shard of q, accepted by fce_vp_loss.
TEST_F(VpSoftErrors, NullTargets) {
  const TestOptions o = soft();
  expect(stats_call(o, nullptr), FCE_ERROR_NULL_POINTER, "fce_vp_stats", "targets");
  expect(backward_call(o, nullptr), FCE_ERROR_NULL_POINTER, "fce_vp_backward", "targets");
  expect(linear_stats_call(o, nullptr), FCE_ERROR_NULL_POINTER, "fce_vp_linear_stats", "targets");
  expect(linear_backward_call(o, nullptr), FCE_ERROR_NULL_POINTER, "fce_vp_linear_backward",
         "targets");
  expect(linear_ce_call(o, nullptr), FCE_ERROR_NULL_POINTER, "fce_vp_linear_ce", "targets");
  // fce_vp_loss does not read them (the statistics of a real step: phase 1 first)
  ASSERT_EQ(stats_call(o, q.ptr()), FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
  stats.pull();
  std::memcpy(gathered.h(), stats.h(), N * FCE_VP_STATS * 4);
  std::memcpy(gathered.h() + N * FCE_VP_STATS * 4, stats.h(), N * FCE_VP_STATS * 4);
  gathered.push();
  EXPECT_EQ(loss_call(o), FCE_SUCCESS) << fce_last_error();
  EXPECT_TRUE(finish());
}

// The targets of a shard are [rows, vocab_local] of target_dtype: a misaligned pointer, and an
// output that overlaps their last row, are named.
TEST_F(VpSoftErrors, TargetsShape) {
  const TestOptions o = soft();
  const void* odd = static_cast<const char*>(q.ptr()) + 2;
  expect(stats_call(o, odd), FCE_ERROR_MISALIGNED, "fce_vp_stats", "targets");
  expect(backward_call(o, odd), FCE_ERROR_MISALIGNED, "fce_vp_backward", "targets");
  expect(linear_stats_call(o, odd), FCE_ERROR_MISALIGNED, "fce_vp_linear_stats", "targets");
  // stats placed over the targets' last row (beyond rows elements: only a [rows, vocab_local]
  // span reaches it)
  Buf big(N * L * 4 + N * FCE_VP_STATS * 4);
  float* inside = reinterpret_cast<float*>(static_cast<char*>(big.ptr()) + (N - 1) * L * 4);
  const float* q0 = big.p<const float>();
  EXPECT_EQ(fce_vp_stats(&o, &shard, N, z.ptr(), q0, inside, test_stream()),
            FCE_ERROR_INVALID_ARGUMENT)
      << fce_last_error();
  EXPECT_TRUE(error_mentions("fce_vp_stats"));
  EXPECT_TRUE(error_mentions("targets"));
  EXPECT_TRUE(error_mentions("stats"));
}

// What the unsharded calls refuse with class probabilities, the vocabulary-parallel ones refuse
// too: token_scaling, shift_seq_len, outputs->accuracy.
TEST_F(VpSoftErrors, RefusedOptions) {
  TestOptions o = soft();
  o.token_scaling = 1;
  expect(stats_call(o, q.ptr()), FCE_ERROR_INVALID_ARGUMENT, "fce_vp_stats",
         "options->token_scaling");
  expect(loss_call(o), FCE_ERROR_INVALID_ARGUMENT, "fce_vp_loss", "options->token_scaling");
  expect(backward_call(o, q.ptr()), FCE_ERROR_INVALID_ARGUMENT, "fce_vp_backward",
         "options->token_scaling");
  expect(linear_ce_call(o, q.ptr()), FCE_ERROR_INVALID_ARGUMENT, "fce_vp_linear_ce",
         "options->token_scaling");
  size_t bytes = 0, lo = 0;
  expect(fce_vp_loss_workspace_size(&o, 2, N, V, &bytes), FCE_ERROR_INVALID_ARGUMENT,
         "fce_vp_loss_workspace_size", "options->token_scaling");
  o = soft();
  o.shift_seq_len = 2;
  expect(stats_call(o, q.ptr()), FCE_ERROR_UNSUPPORTED, "fce_vp_stats", "options->shift_seq_len");
  expect(loss_call(o), FCE_ERROR_UNSUPPORTED, "fce_vp_loss", "options->shift_seq_len");
  expect(linear_backward_call(o, q.ptr()), FCE_ERROR_UNSUPPORTED, "fce_vp_linear_backward",
         "options->shift_seq_len");
  expect(fce_vp_linear_backward_workspace_size(&o, 2, N, D, V, L, FCE_FLOAT32, &lo, nullptr),
         FCE_ERROR_UNSUPPORTED, "fce_vp_linear_backward_workspace_size", "options->shift_seq_len");
  o = soft();
  expect(loss_call(o, acc.p<float>()), FCE_ERROR_INVALID_ARGUMENT, "fce_vp_loss",
         "outputs->accuracy");
  expect(linear_ce_call(o, q.ptr(), acc.p<float>()), FCE_ERROR_INVALID_ARGUMENT, "fce_vp_linear_ce",
         "outputs->accuracy");
}

}  // namespace
