// test_vp_invariance.cpp — options->batch_invariant on the vocabulary-parallel calls over given
// logits (docs/semantics.md rule 21): fce_vp_stats, fce_vp_loss and fce_vp_backward give a row
// the same loss (reduction none), lse, entropy, argmax and gradient row (its shards' columns put
// together) whatever the number of shards (1 to 4, even and uneven widths: shard rows start
// anywhere in a 16-byte vector), the order the statistics are gathered in, the batch size and
// the row's place in it; and those results are the unsharded fce_forward's to float32 rounding.
// Also rows of −inf entries, a NaN, logits far from 0 and beyond the exact sums' range, and
// the calls that still refuse the flag. Run on the backend FCE_TEST_BACKEND selects.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "harness/backend.h"
#include "harness/buffers.h"
#include "harness/compare.h"
#include "vp_common.h"
#include "row_values.h"

namespace {

using namespace fcet;

struct Case {
  const char* name = "";
  int dtype = FCE_FLOAT32;
  int64_t V = 1000;
  float smoothing = 0.f, z_loss = 0.f, softcap = 0.f, scale = 1.f;
  bool weights = false, entropy = false, soft = false;
  double spread = 8.0;  // the logits lie in [-spread, spread) (plus offset)
  double offset = 0.0;
  // row id -> its logits, when not value()'s (adversarial rows)
  std::function<double(int64_t, int64_t)> logit;
};

Case make_case(const char* name, int dtype, int64_t V) {
  Case c;
  c.name = name;
  c.dtype = dtype;
  c.V = V;
  return c;
}

int64_t target_of(int64_t id, int64_t V) {
  if (id % 11 == 4) return -100;  // ignored
  return int64_t(mix(uint64_t(id) + 77u) % uint64_t(V));
}
double logit_of(const Case& c, int64_t id, int64_t j) {
  return c.logit ? c.logit(id, j) : c.offset + value(1, id, j, c.spread);
}
double q_of(int64_t id, int64_t j, int64_t V) {  // class probabilities (not normalised)
  return (value(5, id, j, 1.0) + 1.5) / double(V);
}

// What one step wrote for the probe row, as bytes, and its gradient row as numbers for the
// accuracy check.
struct Probe : RowBytes {
  std::vector<double> grad_values;
};

// A batch's per-row inputs: targets, the upstream gradients of the loss, lse and entropy.
struct RowInputs {
  Buf targets, upstream, grad_lse, grad_entropy;
  RowInputs(const std::vector<int64_t>& ids, int64_t V) {
    std::vector<int64_t> y;
    std::vector<double> up, gl, ge;
    for (int64_t id : ids) {
      y.push_back(target_of(id, V));
      up.push_back(0.5 + double(id % 5) * 0.25);
      gl.push_back(0.125 * double(id % 3));
      ge.push_back(-0.25 + 0.125 * double(id % 4));
    }
    targets = targets_buf(y, FCE_INT64);
    upstream = f32_buf(up);
    grad_lse = f32_buf(gl);
    grad_entropy = f32_buf(ge);
  }
};

TestOptions options_of(const Case& c, const Buf& weights) {
  TestOptions o = test_options();
  o.dtype = c.dtype;
  o.reduction = FCE_REDUCTION_NONE;
  o.label_smoothing = c.smoothing;
  o.z_loss_scale = c.z_loss;
  o.softcap = c.softcap;
  o.logit_scale = c.scale;
  if (c.weights) o.class_weights = weights.p<const float>();
  if (c.soft) o.target_dtype = FCE_FLOAT32;
  return o;
}

class Step {
 public:
  explicit Step(const Case& c) : c_(c) {
    std::vector<double> w(static_cast<size_t>(c.V));
    for (int64_t j = 0; j < c.V; ++j) w[size_t(j)] = 0.5 + double(j % 7) / 8.0;
    weights_ = f32_buf(w);
  }

  // The probe row (at pos of the batch ids) after a whole step over `shards`, the statistics
  // gathered in rank order or a permuted one.
  Probe run(const std::vector<int64_t>& ids, int64_t pos, const std::vector<Shard>& shards,
            bool permuted) {
    const int64_t n = static_cast<int64_t>(ids.size()), V = c_.V;
    const int P = static_cast<int>(shards.size());
    TestOptions o = options_of(c_, weights_);
    o.batch_invariant = 1;
    o.vp_entropy = c_.entropy ? 1 : 0;
    RowInputs in(ids, V);

    std::vector<Buf> logits, q, stats, grads;
    std::vector<Mat> mats;
    for (const Shard& s : shards) {
      const Mat m = mat(c_.dtype, n, s.local, s.local + 1);  // rows start anywhere
      Buf b(m);
      Buf qb(mat(FCE_FLOAT32, n, s.local));
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < s.local; ++j) {
          put(c_.dtype, b.h() + m.offset(i, j), logit_of(c_, ids[size_t(i)], s.start + j));
          put(FCE_FLOAT32, qb.h() + size_t(i * s.local + j) * 4,
              q_of(ids[size_t(i)], s.start + j, V));
        }
      b.push();
      qb.push();
      logits.push_back(std::move(b));
      q.push_back(std::move(qb));
      mats.push_back(m);
      stats.push_back(poisoned(vec(FCE_FLOAT32, n * FCE_VP_STATS_INVARIANT)));
      grads.push_back(poisoned(m));
    }
    auto shard_of = [&](int r) {
      fce_vp_shard sh{P, V, shards[size_t(r)].start, shards[size_t(r)].local, nullptr, nullptr};
      return sh;
    };
    auto targets_for = [&](int r) { return c_.soft ? q[size_t(r)].ptr() : in.targets.ptr(); };
    o.row_stride = o.grad_row_stride = 0;
    for (int r = 0; r < P; ++r) {
      const fce_vp_shard sh = shard_of(r);
      o.row_stride = o.grad_row_stride = sh.vocab_local + 1;
      EXPECT_EQ(fce_vp_stats(&o, &sh, n, logits[size_t(r)].ptr(), targets_for(r),
                             stats[size_t(r)].p<float>(), test_stream()),
                FCE_SUCCESS)
          << fce_last_error();
    }
    EXPECT_TRUE(finish());
    const size_t one = size_t(n) * FCE_VP_STATS_INVARIANT * 4;
    Buf gathered(size_t(P) * one);
    const std::vector<int> order = rank_order(P, permuted);
    for (int k = 0; k < P; ++k) {
      stats[size_t(order[size_t(k)])].pull();
      std::memcpy(gathered.h() + size_t(k) * one, stats[size_t(order[size_t(k)])].h(), one);
    }
    gathered.push();

    Buf loss = poisoned(vec(FCE_FLOAT32, n)), lse = poisoned(vec(FCE_FLOAT32, n)),
        entropy = poisoned(vec(FCE_FLOAT32, n)), argmax = poisoned(vec(FCE_INT64, n));
    fce_outputs out = FCE_OUTPUTS_INIT;
    out.loss = loss.p<float>();
    out.lse = lse.p<float>();
    out.argmax = c_.soft ? nullptr : argmax.p<int64_t>();
    if (c_.entropy) out.entropy = entropy.p<float>();
    const fce_vp_shard sh0 = shard_of(0);
    size_t ws_bytes = 0;
    EXPECT_EQ(fce_vp_loss_workspace_size(&o, P, n, V, &ws_bytes), FCE_SUCCESS) << fce_last_error();
    Buf ws = workspace_buf(ws_bytes);
    EXPECT_EQ(fce_vp_loss(&o, &sh0, n, c_.soft ? nullptr : in.targets.ptr(), gathered.p<float>(),
                          &out, ws_bytes ? ws.ptr() : nullptr, ws_bytes, test_stream()),
              FCE_SUCCESS)
        << fce_last_error();
    for (int r = 0; r < P; ++r) {
      const fce_vp_shard sh = shard_of(r);
      o.row_stride = o.grad_row_stride = sh.vocab_local + 1;
      fce_gradients g = FCE_GRADIENTS_INIT;
      g.grad_logits = grads[size_t(r)].ptr();
      g.grad_output = in.upstream.p<float>();
      if (c_.entropy) {
        g.grad_lse = in.grad_lse.p<float>();
        g.grad_entropy = in.grad_entropy.p<float>();
      }
      size_t bw = 0;
      EXPECT_EQ(fce_vp_backward_workspace_size(&o, P, n, V, sh.vocab_local, &bw), FCE_SUCCESS);
      Buf bws = workspace_buf(bw);
      EXPECT_EQ(fce_vp_backward(&o, &sh, n, logits[size_t(r)].ptr(), targets_for(r),
                                gathered.p<float>(), &g, bw ? bws.ptr() : nullptr, bw,
                                test_stream()),
                FCE_SUCCESS)
          << fce_last_error();
    }
    EXPECT_TRUE(finish());
    for (Buf* b : {&loss, &lse, &entropy, &argmax}) b->pull();
    Probe p;
    p.loss = bytes_at(loss, size_t(pos) * 4, 4);
    p.lse = bytes_at(lse, size_t(pos) * 4, 4);
    if (c_.entropy) p.entropy = bytes_at(entropy, size_t(pos) * 4, 4);
    if (!c_.soft) p.argmax = bytes_at(argmax, size_t(pos) * 8, 8);
    for (int r = 0; r < P; ++r) {
      Buf& gb = grads[size_t(r)];
      gb.pull();
      const Mat& m = mats[size_t(r)];
      const std::vector<uint8_t> row = bytes_at(gb, m.offset(pos, 0), size_t(m.cols) * m.esize());
      p.grad.insert(p.grad.end(), row.begin(), row.end());
      for (int64_t j = 0; j < m.cols; ++j)
        p.grad_values.push_back(get(c_.dtype, gb.h() + m.offset(pos, j)));
    }
    return p;
  }

  // The unsharded fce_forward (without batch_invariant) of the rows: loss, lse, entropy of the
  // probe, and its gradient row.
  struct Whole {
    double loss, lse, entropy;
    std::vector<double> grad;
  };
  Whole whole(const std::vector<int64_t>& ids, int64_t pos) {
    const int64_t n = static_cast<int64_t>(ids.size()), V = c_.V;
    TestOptions o = options_of(c_, weights_);
    const Mat m = mat(c_.dtype, n, V);
    Buf logits(m), grad = poisoned(m), q(mat(FCE_FLOAT32, n, V));
    RowInputs in(ids, V);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t id = ids[size_t(i)];
      for (int64_t j = 0; j < V; ++j) {
        put(c_.dtype, logits.h() + m.offset(i, j), logit_of(c_, id, j));
        put(FCE_FLOAT32, q.h() + size_t(i * V + j) * 4, q_of(id, j, V));
      }
    }
    logits.push();
    q.push();
    Buf loss = poisoned(vec(FCE_FLOAT32, n)), lse = poisoned(vec(FCE_FLOAT32, n)),
        entropy = poisoned(vec(FCE_FLOAT32, n));
    fce_outputs out = FCE_OUTPUTS_INIT;
    out.loss = loss.p<float>();
    out.lse = lse.p<float>();
    if (c_.entropy) out.entropy = entropy.p<float>();
    fce_gradients g = FCE_GRADIENTS_INIT;
    g.grad_logits = grad.ptr();
    g.grad_output = in.upstream.p<float>();
    if (c_.entropy) {
      g.grad_lse = in.grad_lse.p<float>();
      g.grad_entropy = in.grad_entropy.p<float>();
    }
    size_t ws_bytes = 0;
    EXPECT_EQ(fce_forward_workspace_size(&o, n, V, &ws_bytes), FCE_SUCCESS);
    Buf ws = workspace_buf(ws_bytes);
    EXPECT_EQ(fce_forward(&o, n, V, logits.ptr(), c_.soft ? q.ptr() : in.targets.ptr(), &out, &g,
                          ws_bytes ? ws.ptr() : nullptr, ws_bytes, test_stream()),
              FCE_SUCCESS)
        << fce_last_error();
    EXPECT_TRUE(finish());
    for (Buf* b : {&loss, &lse, &entropy, &grad}) b->pull();
    Whole w;
    w.loss = get(FCE_FLOAT32, loss.h() + size_t(pos) * 4);
    w.lse = get(FCE_FLOAT32, lse.h() + size_t(pos) * 4);
    w.entropy = c_.entropy ? get(FCE_FLOAT32, entropy.h() + size_t(pos) * 4) : 0.0;
    for (int64_t j = 0; j < V; ++j) w.grad.push_back(get(c_.dtype, grad.h() + m.offset(pos, j)));
    return w;
  }

 private:
  Case c_;
  Buf weights_;
};

// A batch of n row ids with `probe` at pos (the others a fixed walk, never the probe).
std::vector<int64_t> batch_ids(int64_t n, int64_t pos, int64_t probe) {
  std::vector<int64_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[size_t(i)] = probe + 1 + i * 7919 % 4000;
  ids[size_t(pos)] = probe;
  return ids;
}

double as_float(const std::vector<uint8_t>& b) {
  float f;
  std::memcpy(&f, b.data(), 4);
  return f;
}

void check(const Case& c, std::vector<int64_t> probes = {3, 1234}) {
  SCOPED_TRACE(std::string(c.name) + " [" + backend_name() + " " + dtype_name(c.dtype) + "]");
  Step step(c);
  const std::vector<int64_t> sizes =
      on_cuda() ? std::vector<int64_t>{1, 5, 64, 300} : std::vector<int64_t>{1, 5, 37};
  for (int64_t probe : probes) {
    const Probe alone = step.run({probe}, 0, make_shards(c.V, 1, false), false);
    // against the unsharded call of the flag's absence: float32 rounding apart
    const Step::Whole w = step.whole(batch_ids(5, 2, probe), 2);
    const double tol = tolerance(FCE_FLOAT32);
    EXPECT_TRUE(close_scalar(as_float(alone.loss), w.loss, tol, "loss vs fce_forward"));
    EXPECT_TRUE(close_scalar(as_float(alone.lse), w.lse, tol, "lse vs fce_forward"));
    if (c.entropy) {
      EXPECT_TRUE(close_scalar(as_float(alone.entropy), w.entropy, tol, "entropy vs fce_forward"));
    }
    EXPECT_TRUE(close_normwise(alone.grad_values, w.grad, tolerance(c.dtype),
                               "gradient row vs fce_forward"));
    for (int P = 1; P <= 4; ++P)
      for (bool uneven : {false, true}) {
        if (P == 1 && uneven) continue;
        const std::vector<Shard> shards = make_shards(c.V, P, uneven);
        for (int64_t n : sizes)
          for (int64_t pos : {int64_t{0}, n - 1}) {
            if (n == 1 && pos > 0) continue;
            for (bool permuted : {false, true}) {
              if (permuted && (P == 1 || n != sizes[1])) continue;
              EXPECT_TRUE(
                  same_row(alone, step.run(batch_ids(n, pos, probe), pos, shards, permuted)))
                  << "row " << probe << " at " << pos << " of " << n << ", " << P
                  << (uneven ? " uneven" : " even") << " shards"
                  << (permuted ? ", gathered permuted" : "");
            }
          }
      }
  }
}

class VpInvariance : public BackendTest {};

TEST_F(VpInvariance, PlainF32) { check(make_case("plain", FCE_FLOAT32, 1000)); }

TEST_F(VpInvariance, Bf16ScaleSoftcap) {
  Case c = make_case("scale softcap", FCE_BFLOAT16, 2053);
  c.scale = 1.5f;
  c.softcap = 20.f;
  check(c);
}

TEST_F(VpInvariance, SmoothingWeightsZLoss) {
  Case c = make_case("smoothing, class weights, z-loss", FCE_FLOAT16, 1531);
  c.smoothing = 0.1f;
  c.z_loss = 1e-3f;
  c.weights = true;
  check(c);
}

TEST_F(VpInvariance, EntropyAndRowTerms) {
  Case c = make_case("entropy, grad_lse, grad_entropy", FCE_FLOAT32, 777);
  c.entropy = true;
  c.smoothing = 0.05f;
  check(c);
  Case b = make_case("entropy bf16", FCE_BFLOAT16, 1999);
  b.entropy = true;
  check(b, {17});
}

TEST_F(VpInvariance, ClassProbabilities) {
  Case c = make_case("class probabilities", FCE_FLOAT32, 901);
  c.soft = true;
  c.smoothing = 0.1f;
  c.weights = true;
  c.entropy = true;
  check(c);
}

TEST_F(VpInvariance, LogitsFarFromZero) {
  Case c = make_case("logits near 3e4", FCE_FLOAT32, 640);
  c.offset = 30000.0;
  c.spread = 40.0;
  check(c, {9});
  Case d = make_case("logits near -5e6", FCE_FLOAT32, 640);
  d.offset = -5e6;
  d.spread = 64.0;
  check(d, {9});
}

// −inf entries (a shard may hold nothing else), a NaN, and logits beyond ±2^60: rows whose
// results are what the unsharded call gives (−inf entries) or NaN, the same bytes every time.
TEST_F(VpInvariance, AdversarialRows) {
  Case c = make_case("-inf entries", FCE_FLOAT32, 300);
  c.logit = [](int64_t id, int64_t j) {
    return j >= 250 || (j % 3 == 1) ? -INFINITY : value(1, id, j, 8.0);
  };
  c.smoothing = 0.f;
  check(c, {3});
  Case e = c;
  e.name = "-inf entries, entropy";
  e.entropy = true;
  check(e, {3});
  Case nan_row = make_case("a NaN", FCE_FLOAT32, 300);
  nan_row.logit = [](int64_t id, int64_t j) {
    return id == 5 && j == 123 ? NAN : value(1, id, j, 4.0);
  };
  {
    Step step(nan_row);
    const Probe alone = step.run({5}, 0, make_shards(300, 1, false), false);
    EXPECT_TRUE(std::isnan(as_float(alone.loss)));
    EXPECT_TRUE(std::isnan(as_float(alone.lse)));
    for (int P = 2; P <= 4; ++P)
      EXPECT_TRUE(
          same_row(alone, step.run(batch_ids(5, 3, 5), 3, make_shards(300, P, true), true)));
  }
  Case huge = make_case("logits at 1e20", FCE_FLOAT32, 300);
  huge.logit = [](int64_t id, int64_t j) { return 1e20 + 1e15 * value(1, id, j, 1.0); };
  {
    Step step(huge);
    const Probe alone = step.run({8}, 0, make_shards(300, 1, false), false);
    EXPECT_TRUE(std::isnan(as_float(alone.lse))) << "beyond the exact sums' range: NaN";
    for (int P = 2; P <= 4; ++P)
      EXPECT_TRUE(
          same_row(alone, step.run(batch_ids(5, 1, 8), 1, make_shards(300, P, false), false)));
  }
}

// The linear vocabulary-parallel calls do not honour the flag.
TEST_F(VpInvariance, LinearCallsRefuse) {
  TestOptions o = test_options();
  o.batch_invariant = 1;
  size_t lo = 0, hi = 0;
  EXPECT_EQ(fce_vp_linear_stats_workspace_size(&o, 4, 8, 16, &lo, &hi), FCE_ERROR_UNSUPPORTED);
  EXPECT_TRUE(error_mentions("batch_invariant"));
  EXPECT_TRUE(error_mentions("fce_vp_linear_stats_workspace_size"));
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o, 2, 4, 8, 32, 16, 1, FCE_FLOAT32, &lo, &hi),
            FCE_ERROR_UNSUPPORTED);
  EXPECT_TRUE(error_mentions("batch_invariant"));
}

}  // namespace
