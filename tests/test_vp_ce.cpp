// test_vocab_parallel.cpp — the vocabulary-parallel calls (fce_vp_*, docs/semantics.md rule 16) on
// the backend FCE_TEST_BACKEND selects, with P = 1, 2, 3, 4 ranks simulated in one process:
// phase 1 on each shard, the stats "all-gathered" by the test (in rank order and in a permuted
// order), then fce_vp_loss and each shard's fce_vp_backward / fce_vp_linear_backward. Every
// result is compared with the UNSHARDED call on the same backend (fce_forward, fce_linear_ce)
// and with the float64 reference (ref.h), with the bounds the unsharded suites use (test_util.h
// tolerance(), test_linear_ce's bound for the linear case): loss, lse, z_loss, argmax and
// accuracy (check_ce.h, near ties allowed either way), error flags, the gradient of every
// shard's columns, the sum of the ranks' partial grad_hidden, grad_weight / grad_bias rows.
// Outputs are poisoned, guards and row gaps checked, inputs checked untouched.
//
// Also: the tiling check (a shard missing, duplicated or replaced: NaN rows and
// FCE_FLAG_SHARDS_INCONSISTENT), adversarial rows (±1e30 shared offsets, a −inf shard, NaN),
// determinism, and bad input to every new entry point (status, a message naming the function
//
// The suite is the test_vocab_parallel executable: test_vp_ce.cpp (cross-entropy over sharded
// logits: the option matrix, corner cases, the tiling check, adversarial rows),
// test_vp_linear.cpp (the linear calls and the fused fce_vp_linear_ce), test_vp_errors.cpp (bad
// input and workspace queries); the cases and runners are vp_ce_runner.h and vp_linear_runner.h.
#include "entropy_ref.h"
#include "vp_ce_runner.h"

namespace {

const std::vector<OptionVariant<VpCase>>& option_sets() {
  static const std::vector<OptionVariant<VpCase>> sets = {
      {"plain", [](VpCase&) {}},
      {"even_shards", [](VpCase& c) { c.uneven = false; c.V = 300; }},
      {"ignored_int32_gradoutput_null",
       [](VpCase& c) { c.tdtype = FCE_INT32; c.ignore_frac = 0.3; c.gout = false; }},
      {"custom_ignore_index", [](VpCase& c) { c.ignore_index = 3; c.ignore_frac = 0.25; }},
      {"invalid_targets", [](VpCase& c) { c.invalid = 3; c.ignore_frac = 0.1; c.argmax = c.accuracy = true; }},
      {"weights_label_smoothing",
       [](VpCase& c) { c.weights = true; c.eps = 0.1f; c.ignore_frac = 0.1; }},
      {"label_smoothing", [](VpCase& c) { c.eps = 0.2f; }},
      {"weights", [](VpCase& c) { c.weights = true; c.tdtype = FCE_INT32; }},
      {"zloss", [](VpCase& c) { c.lambda = 1e-3f; c.ignore_frac = 0.1; }},
      {"weights_zloss", [](VpCase& c) { c.weights = true; c.lambda = 1e-3f; c.ignore_frac = 0.15; }},
      {"softcap", [](VpCase& c) { c.softcap = 30.0f; }},
      {"softcap_scale", [](VpCase& c) { c.softcap = 15.0f; c.scale = 0.6f; }},
      {"logit_scale", [](VpCase& c) { c.scale = 2.5f; c.std_hi = 10; }},
      {"negative_logit_scale", [](VpCase& c) { c.scale = -0.75f; }},
      {"shift", [](VpCase& c) { c.shift = 8; c.N = 32; c.ignore_frac = 0.1; }},
      {"shift_k3", [](VpCase& c) { c.shift = 11; c.shift_k = 3; c.N = 33; c.argmax = true; }},
      {"token_scaling",
       [](VpCase& c) {
         c.token_scaling = true; c.ignore_frac = 0.1; c.std_hi = 5; c.edit = confident_targets;
         c.spread = false;  // test_ce.cpp's data: rows of large p_y (16-bit subnormals otherwise)
       }},
      {"token_scaling_zloss_smoothing",
       [](VpCase& c) {
         c.token_scaling = true; c.lambda = 1e-3f; c.eps = 0.1f; c.ignore_frac = 0.1; c.std_hi = 5;
         c.spread = false;
         // (random targets here give float16 gradients so small that fce_forward itself misses
         // the bound against the reference, which is for normal numbers)
         c.edit = confident_targets;
       }},
      {"argmax_accuracy", [](VpCase& c) { c.argmax = c.accuracy = true; c.ignore_frac = 0.2; }},
      {"accuracy_only", [](VpCase& c) { c.accuracy = true; c.ignore_frac = 0.2; }},
      {"argmax_accuracy_confident",
       [](VpCase& c) { c.argmax = c.accuracy = true; c.ignore_frac = 0.1; c.edit = confident_targets; }},
      {"strided", [](VpCase& c) { c.row_pad = 13; c.grad_pad = 5; }},
      {"inplace", [](VpCase& c) { c.inplace = true; }},
      {"inplace_strided", [](VpCase& c) { c.inplace = true; c.row_pad = 3; }},
      {"everything",
       [](VpCase& c) {
         c.tdtype = FCE_INT32; c.weights = true; c.eps = 0.05f; c.lambda = 1e-4f;
         c.softcap = 20.0f; c.scale = 1.3f; c.shift = 6; c.shift_k = 2; c.N = 36;
         c.ignore_frac = 0.15; c.token_scaling = true; c.argmax = c.accuracy = true;
         c.row_pad = 7; c.grad_pad = 2; c.std_hi = 8; c.invalid = 2;
       }},
      {"everything_inplace",
       [](VpCase& c) {
         c.weights = true; c.eps = 0.1f; c.lambda = 2e-4f; c.softcap = 30.0f; c.scale = 0.8f;
         c.shift = 11; c.shift_k = 3; c.N = 33; c.ignore_frac = 0.1; c.row_pad = 5;
         c.inplace = true; c.token_scaling = true; c.argmax = c.accuracy = true; c.std_hi = 8;
         c.spread = false;
       }},
  };
  return sets;
}

class VpMatrix : public MatrixTest<VpCase> {};

TEST_P(VpMatrix, ShardedMatchesUnsharded) {
  VpCeRunner run(GetParam());
  run.run();
}

FCE_OPTION_MATRIX(VpMatrix, option_matrix(option_sets()));

// ------------------------------------------------------------------ corner cases ------------
class Vp : public BackendTest {};

// Every row ignored: loss 0 (mean: 0, not NaN), zero gradient, lse still written.
TEST_F(Vp, AllRowsIgnored) {
  for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE}) {
    VpCase c;
    c.name = "all_ignored";
    c.reduction = red;
    c.N = 9;
    c.spread = c.check_held = false;
    c.ignore_frac = 1.0;
    c.argmax = c.accuracy = true;
    c.lambda = 1e-3f;
    VpCeRunner run(c);
    run.run();
  }
}

// One row, one class per shard (V = P), and a shard of one class next to big ones.
TEST_F(Vp, TinyShards) {
  for (int64_t V : {1, 2, 3, 4}) {
    VpCase c;
    c.name = "tiny";
    c.N = 5;
    c.V = V;
    c.uneven = false;
    c.spread = c.check_held = false;
    c.eps = 0.1f;
    c.argmax = c.accuracy = true;
    c.ranks.clear();
    for (int P = 1; P <= V; ++P) c.ranks.push_back(P);
    VpCeRunner run(c);
    run.run();
  }
  VpCase c;
  c.name = "single_row";
  c.N = 1;
  c.V = 7;
  c.spread = c.check_held = false;
  c.argmax = true;
  VpCeRunner run(c);
  run.run();
}

// The same inputs in the same order give the same loss bits (every rank computes it); the
// stats of a shard are the same bits whatever the call.
TEST_F(Vp, Deterministic) {
  VpCase c;
  c.name = "deterministic";
  c.N = 64;
  c.V = 1000;
  c.eps = 0.1f;
  c.lambda = 1e-3f;
  c.weights = true;
  c.argmax = c.accuracy = true;
  VpCeRunner run(c);
  ASSERT_NO_FATAL_FAILURE(run.unsharded());
  const std::vector<Shard> shards = make_shards(c.V, 3, true);
  std::vector<Buf> stats, again;
  for (const Shard& s : shards) stats.push_back(run.stats(s));
  for (const Shard& s : shards) again.push_back(run.stats(s));
  for (size_t i = 0; i < stats.size(); ++i)
    EXPECT_TRUE(bitwise_equal(stats[i].mirror(), again[i].mirror(), "stats (two calls)"));
  Buf g = gather({&stats[2], &stats[0], &stats[1]}, c.N);
  run.loss(g, 3);
  const std::vector<uint8_t> first = run.raw_loss();
  for (int i = 0; i < 3; ++i) {
    run.loss(g, 3);
    EXPECT_TRUE(bitwise_equal(run.raw_loss(), first, "loss (same gathered stats)"));
  }
}

// ------------------------------------------------------------------ the tiling check --------
// A shard's stats missing or duplicated: every row NaN (loss, lse, gradient), argmax -1,
// FCE_FLAG_SHARDS_INCONSISTENT — a duplicate shows in every row as two ranks reporting the same
// argmax, also when it replaces another shard of the same size (the sizes still sum to V).
TEST_F(Vp, TilingCheck) {
  for (int red : {FCE_REDUCTION_NONE, FCE_REDUCTION_MEAN}) {
    VpCase c;
    c.name = "tiling";
    c.reduction = red;
    c.V = 300;
    c.uneven = false;
    c.ignore_frac = 0.3;
    c.lambda = 1e-3f;
    c.argmax = c.accuracy = true;
    VpCeRunner run(c);
    ASSERT_NO_FATAL_FAILURE(run.unsharded());
    const std::vector<Shard> sh = make_shards(c.V, 3, false);  // 100 classes each
    // stats[3]: a wrong shard, [150, 250) (overlapping shard 2, leaving [100, 150) to none):
    // sizes that sum to V and distinct argmaxes, so only the rows whose target is held by no
    // shard or by two can be caught
    std::vector<Shard> all = sh;
    all.push_back(Shard{150, 100});
    std::vector<Buf> st;
    for (const Shard& s : all) st.push_back(run.stats(s));
    const struct {
      const char* what;
      std::vector<int> order;
    } cases[] = {
        {"shard 1 missing", {0, 2}},
        {"shard 2 missing", {0, 1}},
        {"shard 0 duplicated", {0, 1, 0, 2}},
        {"shard 2 twice instead of shard 1", {0, 2, 2}},
        {"shard 0 twice instead of shard 2, permuted", {1, 0, 0}},
        {"shard 1 computed at [150, 250)", {0, 3, 2}},
    };
    const auto& ref = run.ref();
    for (const auto& tc : cases) {
      SCOPED_TRACE(std::string(tc.what) + " (" + reduction_name(red) + ")");
      std::vector<const Buf*> order;
      int64_t local_sum = 0;
      for (int q : tc.order) {
        order.push_back(&st[static_cast<size_t>(q)]);
        local_sum += all[static_cast<size_t>(q)].local;
      }
      // The rows the check must catch: every row when the sizes do not sum to V or a shard is
      // gathered twice (its argmax appears twice), else the scored rows whose target is held
      // by no gathered shard or by two.
      bool twice = false;
      for (size_t i = 0; i < tc.order.size(); ++i)
        for (size_t k = 0; k < i; ++k) twice |= tc.order[i] == tc.order[k];
      std::vector<bool> bad(static_cast<size_t>(c.N));
      int64_t n_bad = 0;
      for (int64_t r = 0; r < c.N; ++r) {
        const size_t ri = static_cast<size_t>(r);
        int holders = 0;
        for (int q : tc.order) {
          const Shard& s = all[static_cast<size_t>(q)];
          holders += ref.target[ri] >= s.start && ref.target[ri] < s.start + s.local;
        }
        // (two overlapping shards may also hold a row's maximum both: the same argmax)
        bool same_argmax = false;
        for (size_t i = 0; i < tc.order.size(); ++i)
          for (size_t k = 0; k < i; ++k) {
            int32_t a = 0, b = 0;
            const size_t at = (ri * FCE_VP_STATS + 6) * 4;  // VpStat kVpArgmax
            std::memcpy(&a, st[static_cast<size_t>(tc.order[i])].h() + at, 4);
            std::memcpy(&b, st[static_cast<size_t>(tc.order[k])].h() + at, 4);
            same_argmax |= a == b;
          }
        bad[ri] = local_sum != c.V || twice || same_argmax ||
                  (ref.kind[ri] == fceref::kValid && holders != 1);
        n_bad += bad[ri];
      }
      ASSERT_GT(n_bad, 0);
      const int64_t ranks = static_cast<int64_t>(tc.order.size());
      Buf g = gather(order, c.N);
      const LossOut v = run.loss(g, ranks, 0x100u);
      EXPECT_EQ(v.flags, 0x100u | FCE_FLAG_SHARDS_INCONSISTENT) << "error_flags (fce_vp_loss)";
      for (int64_t r = 0; r < c.N; ++r) {
        const size_t ri = static_cast<size_t>(r);
        const bool ignored = ref.kind[ri] == fceref::kIgnored;
        if (bad[ri]) {
          EXPECT_TRUE(std::isnan(v.lse[ri])) << "row " << r << " lse " << v.lse[ri];
          EXPECT_EQ(v.am[ri], -1) << "row " << r << " argmax";
          if (red == FCE_REDUCTION_NONE) {
            EXPECT_TRUE(std::isnan(v.loss[ri])) << "row " << r << " loss " << v.loss[ri];
            EXPECT_EQ(v.acc[ri], 0.0) << "row " << r << " accuracy";
          }
        } else {
          EXPECT_TRUE(std::isfinite(v.lse[ri])) << "row " << r << " lse " << v.lse[ri];
          if (ignored) { EXPECT_EQ(v.am[ri], -1) << "ignored row " << r << " argmax"; }
          if (red == FCE_REDUCTION_NONE) {
            if (ignored) {
              EXPECT_EQ(v.loss[ri], 0.0) << "ignored row " << r;
            } else {
              EXPECT_TRUE(std::isfinite(v.loss[ri])) << "row " << r << " loss " << v.loss[ri];
            }
          }
        }
      }
      if (red != FCE_REDUCTION_NONE) {
        EXPECT_TRUE(std::isnan(v.loss[0])) << "reduced loss " << v.loss[0];
        EXPECT_TRUE(std::isnan(v.zl[0])) << "z_loss " << v.zl[0];
      }
      // The gradient of each shard: the rows caught NaN, the others finite (ignored: 0).
      std::vector<double> grad(static_cast<size_t>(c.N * c.V), 0.0);
      for (const Shard& s : sh) {
        ASSERT_NO_FATAL_FAILURE(run.backward(s, g, ranks, &grad));
      }
      for (int64_t r = 0; r < c.N; ++r) {
        const size_t ri = static_cast<size_t>(r);
        const bool ignored = ref.kind[ri] == fceref::kIgnored;
        for (int64_t j = 0; j < c.V; ++j) {
          const double x = grad[static_cast<size_t>(r * c.V + j)];
          const bool ok = bad[ri] ? std::isnan(x) : ignored ? x == 0.0 : std::isfinite(x);
          if (!ok) {
            ADD_FAILURE() << "gradient row " << r << " column " << j << ": " << x
                          << (bad[ri] ? " (expected NaN)" : ignored ? " (expected 0)" : " (expected finite)");
            break;
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------ adversarial rows --------
// f32 rows sharing a huge offset (all ±1e30, or 1e30 and its neighbour), a shard of −inf (the
// target outside it: finite; inside it: +inf), a row of −inf (lse −inf, loss NaN), NaN in one
// shard (the whole row NaN, argmax the first NaN whatever the gathered order), a +inf in one
// shard or in two (the whole row NaN as torch's log_softmax makes it, argmax the first +inf).
// Against the unsharded call and the reference; every P; rank order and permuted.
void adversarial_rows(const VpCase& c, std::vector<double>& z, std::vector<int64_t>& y) {
  const int64_t V = c.V;
  auto row = [&](int64_t r) { return &z[static_cast<size_t>(r * V)]; };
  const float big = 1e30f, below = std::nextafter(1e30f, 0.0f);
  const double inf = HUGE_VAL, nan = std::numeric_limits<double>::quiet_NaN();
  for (int64_t j = 0; j < V; ++j) {
    row(0)[j] = -1e30f;
    row(1)[j] = big;
    row(2)[j] = (j % 3 == 0) ? big : below;
    row(3)[j] = (j % 5 == 0) ? -static_cast<double>(below) : -1e30f;
    if (j < V / 3) row(4)[j] = -inf, row(5)[j] = -inf;
    row(6)[j] = -inf;
  }
  row(7)[V / 2] = nan;
  row(8)[V - 7] = nan;
  row(8)[V / 5] = nan;
  row(9)[V / 3 - 1] = -inf;  // one −inf entry, the target's
  row(10)[V / 2 + 3] = inf;  // one +inf, the target elsewhere
  row(11)[V - 2] = inf;      // two +inf in two shards, the target on the first
  row(11)[7] = inf;
  y[0] = 5;
  y[1] = V - 1;
  y[2] = 3;
  y[3] = V / 2;
  y[4] = V / 2;      // finite shard
  y[5] = 1;          // in the −inf block: loss +inf
  y[6] = 2;
  y[7] = 0;
  y[8] = V - 1;
  y[9] = V / 3 - 1;  // its logit is −inf: loss +inf
  y[10] = 4;         // a +inf in the row: loss, lse and gradient NaN
  y[11] = 7;
}

TEST_F(Vp, AdversarialRows) {
  for (int red : {FCE_REDUCTION_NONE, FCE_REDUCTION_MEAN})
    for (int variant = 0; variant < 3; ++variant) {
      VpCase c;
      c.name = "adversarial";
      c.reduction = red;
      c.N = 12;
      c.V = 300;  // shards of P = 3 (even): [0, 100) is the −inf block of rows 4, 5
      c.uneven = false;
      c.spread = c.check_held = false;
      c.argmax = c.accuracy = true;
      c.edit = adversarial_rows;
      if (variant == 1) c.eps = 0.1f, c.lambda = 1e-4f, c.weights = true;
      if (variant == 2) c.token_scaling = true, c.softcap = 0.0f, c.scale = 1.0f;
      VpCeRunner run(c);
      run.run();
    }
}

}  // namespace

// ---------------------------------------------------------------- rule 18 on shards ----
// outputs->entropy (fce_vp_loss) and grad_lse / grad_entropy (fce_vp_backward) with
// options->vp_entropy, P = 1..4 uneven shards and P = 3 even, against the unsharded fce_forward
// with the same outputs and gradients and against the float64 reference (entropy_ref.h).
// entropy_terms false: grad_lse alone, without options->vp_entropy (the plain statistics).
void check_vp_entropy(VpCase c, bool entropy_terms) {
  SCOPED_TRACE(case_label(c) + (entropy_terms ? " entropy" : " grad_lse alone"));
  const int64_t N = c.N, V = c.V;
  CeData d = ce_data(c, 1.0, 30.0);
  std::mt19937_64 rng = spec_rng(c, 18);
  const std::vector<double> gl_v = random_uniform(rng, size_t(N), -2.0, 2.0);
  const std::vector<double> ge_v = random_uniform(rng, size_t(N), -2.0, 2.0);
  const fceref::Options ro = reference_options(c, d.w);
  const fceref::CeResult ref = fceref::cross_entropy(ro, N, V, d.z, d.y, &d.g, true);
  const RowTermsRef rt = row_terms_ref(ro, ref, N, V, &gl_v, entropy_terms ? &ge_v : nullptr);
  const std::vector<double> ref_grad = total_grad(ref, rt);
  Buf wb = d.w.empty() ? Buf() : f32_buf(d.w), y = targets_buf(d.y, c.tdtype);
  Buf gl = f32_buf(gl_v), ge = f32_buf(ge_v), g = c.gout ? f32_buf(d.g) : Buf();
  TestOptions o = spec_options(c);
  o.class_weights = wb.p<const float>();
  o.vp_entropy = entropy_terms ? 1 : 0;
  const Mat lm = vec(FCE_FLOAT32, c.reduction == FCE_REDUCTION_NONE ? N : 1);
  const Mat rm = vec(FCE_FLOAT32, N);
  fce_gradients gr = FCE_GRADIENTS_INIT;
  gr.grad_output = g.p<const float>();
  gr.grad_lse = gl.p<const float>();
  gr.grad_entropy = entropy_terms ? ge.p<const float>() : nullptr;

  // the unsharded call
  const Mat zm = mat(c.dtype, N, V);
  Buf z(zm), grad = poisoned(zm), loss = poisoned(lm), ent = poisoned(rm);
  write_mat(z, zm, d.z);
  z.push();
  TestOptions uo = o;
  uo.vp_entropy = 0;
  size_t wsb = 0;
  ASSERT_EQ(fce_forward_workspace_size(&uo, N, V, &wsb), FCE_SUCCESS) << fce_last_error();
  Buf ws = workspace_buf(wsb);
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  out.entropy = entropy_terms ? ent.p<float>() : nullptr;
  gr.grad_logits = grad.ptr();
  ASSERT_EQ(fce_forward(&uo, N, V, z.ptr(), y.ptr(), &out, &gr, ws.ptr(), wsb, test_stream()),
            FCE_SUCCESS)
      << fce_last_error();
  ASSERT_TRUE(finish());
  for (Buf* b : {&grad, &loss, &ent}) b->pull();
  const std::vector<double> whole_grad = read_mat(grad, zm), whole_loss = read_mat(loss, lm);
  const std::vector<double> whole_ent = entropy_terms ? read_mat(ent, rm) : std::vector<double>();

  for (const auto& [P, uneven] :
       std::vector<std::pair<int, bool>>{{1, true}, {2, true}, {3, true}, {4, true}, {3, false}}) {
    SCOPED_TRACE("P=" + std::to_string(P) + (uneven ? " uneven" : " even"));
    const std::vector<Shard> shards = make_shards(V, P, uneven);
    std::vector<Buf> stats, logits;
    for (const Shard& s : shards) {
      const Mat sm = mat(c.dtype, N, s.local);
      std::vector<double> cols(size_t(N * s.local));
      for (int64_t r = 0; r < N; ++r)
        for (int64_t j = 0; j < s.local; ++j)
          cols[size_t(r * s.local + j)] = d.z[size_t(r * V + s.start + j)];
      logits.emplace_back(sm);
      write_mat(logits.back(), sm, cols);
      logits.back().push();
      stats.push_back(poisoned(vec(FCE_FLOAT32, N * FCE_VP_STATS)));
      const fce_vp_shard sh{P, V, s.start, s.local, nullptr, nullptr};
      ASSERT_EQ(fce_vp_stats(&o, &sh, N, logits.back().ptr(), y.ptr(), stats.back().p<float>(),
                             test_stream()),
                FCE_SUCCESS)
          << fce_last_error();
    }
    std::vector<const Buf*> order;
    for (int q : rank_order(P, true)) order.push_back(&stats[size_t(q)]);
    ASSERT_TRUE(finish());
    for (Buf& b : stats) b.pull();
    Buf gathered = gather(order, N);
    const fce_vp_shard all{P, V, 0, V, nullptr, nullptr};
    ASSERT_EQ(fce_vp_loss_workspace_size(&o, P, N, V, &wsb), FCE_SUCCESS) << fce_last_error();
    Buf lws = workspace_buf(wsb);
    Buf vloss = poisoned(lm), vent = poisoned(rm);
    fce_outputs vout = FCE_OUTPUTS_INIT;
    vout.loss = vloss.p<float>();
    vout.entropy = entropy_terms ? vent.p<float>() : nullptr;
    ASSERT_EQ(fce_vp_loss(&o, &all, N, y.ptr(), gathered.p<const float>(), &vout, lws.ptr(), wsb,
                          test_stream()),
              FCE_SUCCESS)
        << fce_last_error();
    std::vector<double> vgrad(size_t(N * V), -12345.0);
    for (size_t k = 0; k < shards.size(); ++k) {
      const Shard& s = shards[k];
      const fce_vp_shard sh{P, V, s.start, s.local, nullptr, nullptr};
      const Mat sm = mat(c.dtype, N, s.local);
      Buf sg = poisoned(sm);
      ASSERT_EQ(fce_vp_backward_workspace_size(&o, P, N, V, s.local, &wsb), FCE_SUCCESS);
      Buf bws = workspace_buf(wsb);
      fce_gradients sgr = gr;
      sgr.grad_logits = sg.ptr();
      ASSERT_EQ(fce_vp_backward(&o, &sh, N, logits[k].ptr(), y.ptr(), gathered.p<const float>(),
                                &sgr, bws.ptr(), wsb, test_stream()),
                FCE_SUCCESS)
          << fce_last_error();
      ASSERT_TRUE(finish());
      sg.pull();
      EXPECT_TRUE(all_written(sg, sm, "grad_logits (shard)"));
      const std::vector<double> v = read_mat(sg, sm);
      for (int64_t r = 0; r < N; ++r)
        for (int64_t j = 0; j < s.local; ++j)
          vgrad[size_t(r * V + s.start + j)] = v[size_t(r * s.local + j)];
    }
    for (Buf* b : {&vloss, &vent}) b->pull();
    const double tol = tolerance(c.dtype);
    if (entropy_terms) {
      EXPECT_TRUE(all_written(vent, rm, "entropy"));
      EXPECT_TRUE(close_normwise(read_mat(vent, rm), whole_ent, 1e-5, "entropy vs unsharded"));
      EXPECT_TRUE(close_normwise(read_mat(vent, rm), rt.entropy, 1e-5, "entropy vs reference"));
    }
    EXPECT_TRUE(close_normwise(read_mat(vloss, lm), whole_loss, tol, "loss vs unsharded"));
    EXPECT_TRUE(close_normwise(vgrad, whole_grad, tol, "grad_logits vs unsharded"));
    EXPECT_TRUE(close_normwise(vgrad, ref_grad, tol, "grad_logits vs reference"));
  }
}

TEST_F(Vp, EntropyAndRowGradients) {
  const CaseEdits<VpCase> sets = {
      {"plain", [](VpCase&) {}},
      {"ignored", [](VpCase& c) { c.ignore_frac = 0.3; }},
      {"weights_label_smoothing_zloss",
       [](VpCase& c) {
         c.weights = true;
         c.eps = 0.1f;
         c.lambda = 1e-3f;
         c.ignore_frac = 0.2;
       }},
      {"softcap_scale",
       [](VpCase& c) {
         c.softcap = 15.0f;
         c.scale = 0.6f;
       }},
      {"token_scaling", [](VpCase& c) { c.token_scaling = true; }},
      {"shift",
       [](VpCase& c) {
         c.shift = 6;
         c.shift_k = 2;
       }},
  };
  for_row_terms_cases<VpCase>(sets, 12, 203, 7, [](const VpCase& c) {
    check_vp_entropy(c, true);
    if (c.dtype == FCE_FLOAT32 && c.reduction == FCE_REDUCTION_MEAN) check_vp_entropy(c, false);
  });
}
