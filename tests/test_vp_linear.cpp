// test_vp_linear.cpp — the vocabulary-parallel linear calls (fce_vp_linear_stats,
// fce_vp_linear_backward, the fused fce_vp_linear_ce) with P = 1-4 ranks simulated in one
// process, against the unsharded fce_linear_ce and the float64 reference: the option matrix,
// workspace sizes, fused chunks, a failing all-gather. Part of the test_vocab_parallel
// executable (test_vp_ce.cpp says what the others hold).
#include "entropy_ref.h"
#include "vp_linear_runner.h"

namespace {

const std::vector<OptionVariant<LinVpCase>>& lin_option_sets() {
  static const std::vector<OptionVariant<LinVpCase>> sets = {
      {"plain", [](LinVpCase&) {}},
      {"no_bias", [](LinVpCase& c) { c.bias = false; }},
      {"grad_hidden_f32", [](LinVpCase& c) { c.gh_f32 = true; }},
      {"weights_smoothing_zloss",
       [](LinVpCase& c) { c.weights = true; c.eps = 0.1f; c.lambda = 1e-3f; c.ignore_frac = 0.1; }},
      {"softcap_scale", [](LinVpCase& c) { c.softcap = 15.0f; c.scale = 0.8f; }},
      {"shift_token_scaling",
       [](LinVpCase& c) {
         c.shift = 8; c.shift_k = 2; c.N = 32; c.token_scaling = true; c.confident = true;
       }},
      {"ignored_invalid_argmax_accuracy",
       [](LinVpCase& c) { c.ignore_frac = 0.2; c.invalid = 2; c.argmax = c.accuracy = true; c.tdtype = FCE_INT32; }},
      {"accumulate", [](LinVpCase& c) { c.accumulate = true; }},
      {"grad_weight_fp32", [](LinVpCase& c) { c.gw_fp32 = true; c.gh_f32 = true; }},
      {"accumulate_fp32", [](LinVpCase& c) { c.accumulate = true; c.gw_fp32 = true; }},
      {"grad_output_null", [](LinVpCase& c) { c.gout = false; c.ignore_frac = 0.2; }},
      {"grad_weight_only", [](LinVpCase& c) { c.gh = false; c.gb = false; }},
      {"grad_hidden_only", [](LinVpCase& c) { c.gw = false; c.gb = false; }},
      {"grad_bias_only", [](LinVpCase& c) { c.gh = false; c.gw = false; }},
      {"strided_hidden_min_workspace", [](LinVpCase& c) { c.h_pad = 5; c.ws_min = true; }},
      {"everything",
       [](LinVpCase& c) {
         c.weights = true; c.eps = 0.05f; c.lambda = 1e-4f; c.softcap = 20.0f; c.scale = 1.2f;
         c.shift = 6; c.shift_k = 1; c.N = 36; c.ignore_frac = 0.1; c.token_scaling = true;
         c.confident = true; c.argmax = c.accuracy = true; c.accumulate = true; c.h_pad = 3;
         c.invalid = 1;
       }},
  };
  return sets;
}

class VpLinearMatrix : public MatrixTest<LinVpCase> {};

TEST_P(VpLinearMatrix, ShardedMatchesUnsharded) {
  VpLinRunner run(GetParam());
  run.run();
}

FCE_OPTION_MATRIX(VpLinearMatrix, option_matrix(lin_option_sets(), 101));

class VpLinear : public BackendTest {};

// Bigger than one CPU chunk of rows, and the workspace from min_bytes to optimal_bytes: the
// same bits on the CPU (the chunking depends on the sizes only), within rounding elsewhere.
TEST_F(VpLinear, WorkspaceSizes) {
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16}) {
    LinVpCase c;
    c.name = "workspaces";
    c.dtype = dtype;
    c.N = 1100;  // > 1024 rows: two chunks on the CPU
    c.D = 16;
    c.V = 97;
    c.ranks = {3};
    c.eps = 0.1f;
    c.accumulate = true;
    std::vector<std::vector<uint8_t>> raws;
    for (bool ws_min : {false, true}) {
      c.ws_min = ws_min;
      VpLinRunner run(c);
      ASSERT_NO_FATAL_FAILURE(run.run());
      const Shard s = make_shards(c.V, 3, true)[1];
      Buf st0 = run.stats(make_shards(c.V, 3, true)[0]);
      Buf st1 = run.stats(s);
      Buf st2 = run.stats(make_shards(c.V, 3, true)[2]);
      Buf g = gather({&st0, &st1, &st2}, c.N);
      const auto grads = run.backward(s, g, 3);
      std::vector<uint8_t> all = st1.mirror();
      all.insert(all.end(), grads.raw_gh.begin(), grads.raw_gh.end());
      all.insert(all.end(), grads.raw_gw.begin(), grads.raw_gw.end());
      all.insert(all.end(), grads.raw_gb.begin(), grads.raw_gb.end());
      raws.push_back(all);
    }
    if (!on_cuda()) {
      EXPECT_TRUE(bitwise_equal(raws[0], raws[1], "stats and gradients (optimal vs min workspace)"));
    }
  }
}

// fce_vp_linear_ce over several token chunks (CUDA's token-chunk plan at optimal_bytes: rows
// [0, 2560) and [2560, 5005), a sequence of the shift rule straddling the boundary), the
// gather-once plan at min_bytes, and every rank making the same all-gathers.
TEST_F(VpLinear, FusedChunks) {
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16}) {
    LinVpCase c;
    c.name = "fused_chunks";
    c.dtype = dtype;
    c.N = 5005;  // 715 sequences of 7
    c.D = 16;
    c.V = 301;
    c.gw_fp32 = true;  // a float32 grad_weight: token chunks of at most 4096 rows
    c.gh_f32 = true;
    c.shift = 7;
    c.shift_k = 1;
    c.eps = 0.1f;
    c.lambda = 1e-4f;
    c.ignore_frac = 0.1;
    c.argmax = c.accuracy = true;
    c.accumulate = true;
    VpLinRunner run(c);
    ASSERT_NO_FATAL_FAILURE(run.unsharded());
    for (int P : {1, 3}) {
      int calls = 0;
      ASSERT_NO_FATAL_FAILURE(calls = run.fused(P, false));
      EXPECT_EQ(calls, on_cuda() ? 2 : 1) << "all-gathers at optimal_bytes, P=" << P;
      ASSERT_NO_FATAL_FAILURE(calls = run.fused(P, true));
      EXPECT_EQ(calls, 1) << "all-gathers at min_bytes, P=" << P;
    }
  }
}

namespace {
fce_status failing_gather(void* ctx, const float*, float*, int64_t, void*) {
  ++*static_cast<int*>(ctx);
  return FCE_ERROR_CUDA;
}
}  // namespace

// The all-gather's status stops the call and is returned, named; a NULL shard->all_gather is
// refused.
TEST_F(VpLinear, FusedAllGatherStatus) {
  LinVpCase c;
  c.name = "fused_status";
  c.ranks = {1};
  VpLinRunner run(c);
  std::string err;
  int calls = 0;
  EXPECT_EQ(run.fused_one(failing_gather, &calls, &err), FCE_ERROR_CUDA);
  EXPECT_EQ(calls, 1);
  EXPECT_NE(err.find("fce_vp_linear_ce: all_gather returned FCE_ERROR_CUDA"), std::string::npos)
      << err;
  EXPECT_EQ(run.fused_one(nullptr, nullptr, &err), FCE_ERROR_NULL_POINTER);
  EXPECT_NE(err.find("fce_vp_linear_ce: shard->all_gather is NULL"), std::string::npos) << err;
}

// ---------------------------------------------------------------- rule 18 on shards ----
// outputs->entropy and grad_lse / grad_entropy with options->vp_entropy through the fused
// fce_vp_linear_ce (P ranks as threads, ws_min: the gather-once plan on CUDA too) and the two
// phases (fce_vp_linear_stats, fce_vp_loss, fce_vp_linear_backward), P = 1..4 uneven shards,
// against the unsharded fce_linear_ce with the same outputs and gradients and the float64
// reference (entropy_ref.h through ref.h's linear_backward).
struct LinRowTerms {
  LinVpCase c;
  LinearData d;
  std::vector<double> gl, ge;
  fceref::LinearResult ref;  // with the row terms' gradients
  std::vector<double> ref_entropy;
  Buf h, y, w, g, glb, geb;
  TestOptions o;
  int64_t N, D, V;

  explicit LinRowTerms(LinVpCase cc) : c(std::move(cc)) {
    if (c.zstd < 0) c.zstd = c.dtype == FCE_FLOAT32 ? 8.0 : 1.5;
    N = c.N, D = c.D, V = c.V;
    std::mt19937_64 rng = linear_rng(c);
    d = linear_data(rng, c);
    gl = random_uniform(rng, size_t(N), -2.0, 2.0);
    ge = random_uniform(rng, size_t(N), -2.0, 2.0);
    const fceref::Options ro = reference_options(c, d.w);
    ref = fceref::linear_cross_entropy(ro, N, D, V, d.h, d.W, d.b, d.y, &d.g, true);
    const RowTermsRef rt = row_terms_ref(ro, ref.ce, N, V, &gl, &ge);
    ref_entropy = rt.entropy;
    fceref::linear_backward(N, D, V, d.h, d.W, total_grad(ref.ce, rt), ref);
    const Mat hm = mat(c.dtype, N, D);
    h = Buf(hm);
    write_mat(h, hm, d.h);
    h.push();
    y = targets_buf(d.y, c.tdtype);
    if (!d.w.empty()) w = f32_buf(d.w);
    if (c.gout) g = f32_buf(d.g);
    glb = f32_buf(gl);
    geb = f32_buf(ge);
    o = spec_options(c);
    o.class_weights = w.p<const float>();
    o.grad_weight_fp32 = 1;
    o.vp_entropy = 1;
  }
  Buf rows_of(const std::vector<double>& m, int64_t cols, int64_t start, int64_t local) const {
    const Mat bm = mat(c.dtype, local, cols);
    Buf b(bm);
    write_mat(b, bm,
              std::vector<double>(m.begin() + start * cols, m.begin() + (start + local) * cols));
    b.push();
    return b;
  }
  fce_gradients grads(void* gh, void* gw, void* gb) const {
    fce_gradients gr = FCE_GRADIENTS_INIT;
    gr.grad_output = g.p<const float>();
    gr.grad_hidden = gh;
    gr.grad_weight = gw;
    gr.grad_bias = c.bias ? gb : nullptr;
    gr.grad_lse = glb.p<const float>();
    gr.grad_entropy = geb.p<const float>();
    return gr;
  }
  // What a step gives: loss, entropy, Σ_ranks grad_hidden, grad_weight and grad_bias (all rows).
  struct Result {
    std::vector<double> loss, entropy, gh, gw, gb;
  };
  Mat loss_m() const { return vec(FCE_FLOAT32, c.reduction == FCE_REDUCTION_NONE ? N : 1); }

  Result unsharded() {
    Buf W = rows_of(d.W, D, 0, V), b = c.bias ? rows_of(d.b, 1, 0, V) : Buf();
    Buf loss = poisoned(loss_m()), ent = poisoned(vec(FCE_FLOAT32, N));
    Buf gh = poisoned(mat(c.dtype, N, D)), gw = poisoned(mat(FCE_FLOAT32, V, D)),
        gb = poisoned(vec(FCE_FLOAT32, V));
    TestOptions uo = o;
    uo.vp_entropy = 0;
    size_t mn = 0, op = 0;
    EXPECT_EQ(fce_linear_ce_workspace_size(&uo, N, D, V, 1, &mn, &op), FCE_SUCCESS);
    Buf ws = workspace_buf(op);
    fce_outputs out = FCE_OUTPUTS_INIT;
    out.loss = loss.p<float>();
    out.entropy = ent.p<float>();
    const fce_gradients gr = grads(gh.ptr(), gw.ptr(), gb.ptr());
    EXPECT_EQ(fce_linear_ce(&uo, N, D, V, h.ptr(), W.ptr(), b.ptr(), y.ptr(), &out, &gr, ws.ptr(),
                            op, test_stream()),
              FCE_SUCCESS)
        << fce_last_error();
    EXPECT_TRUE(finish());
    for (Buf* x : {&loss, &ent, &gh, &gw, &gb}) x->pull();
    Result r;
    r.loss = read_mat(loss, loss_m());
    r.entropy = read_mat(ent, vec(FCE_FLOAT32, N));
    r.gh = read_mat(gh, mat(c.dtype, N, D));
    r.gw = read_mat(gw, mat(FCE_FLOAT32, V, D));
    r.gb = read_mat(gb, vec(FCE_FLOAT32, V));
    return r;
  }

  // P ranks: fused (fce_vp_linear_ce through SimGather) or the two phases.
  Result sharded(int P, bool fused, bool ws_min) {
    const std::vector<Shard> shards = make_shards(V, P, true);
    struct RankBufs {
      Buf W, b, loss, ent, gh, gw, gb, ws, stats;
      size_t wsb = 0;
      fce_status st = FCE_ERROR_INTERNAL;
      std::string err;
    };
    std::vector<RankBufs> rb(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) {
      const Shard& s = shards[size_t(r)];
      RankBufs& b = rb[size_t(r)];
      b.W = rows_of(d.W, D, s.start, s.local);
      if (c.bias) b.b = rows_of(d.b, 1, s.start, s.local);
      b.loss = poisoned(loss_m());
      b.ent = poisoned(vec(FCE_FLOAT32, N));
      b.gh = poisoned(mat(FCE_FLOAT32, N, D));
      b.gw = poisoned(mat(FCE_FLOAT32, s.local, D));
      b.gb = poisoned(vec(FCE_FLOAT32, s.local));
      b.stats = poisoned(vec(FCE_FLOAT32, N * FCE_VP_STATS));
    }
    size_t wsb = 0;
    for (const Shard& s : shards) {
      size_t mn = 0, op = 0;
      if (fused)
        EXPECT_EQ(
            fce_vp_linear_ce_workspace_size(&o, P, N, D, V, s.local, 1, FCE_FLOAT32, &mn, &op),
            FCE_SUCCESS)
            << fce_last_error();
      else
        EXPECT_EQ(
            fce_vp_linear_backward_workspace_size(&o, P, N, D, V, s.local, FCE_FLOAT32, &mn, &op),
            FCE_SUCCESS)
            << fce_last_error();
      size_t smn = 0, sop = 0, lws = 0;
      EXPECT_EQ(fce_vp_linear_stats_workspace_size(&o, N, D, s.local, &smn, &sop), FCE_SUCCESS);
      EXPECT_EQ(fce_vp_loss_workspace_size(&o, P, N, V, &lws), FCE_SUCCESS);
      if (!fused) mn = std::max({mn, smn, lws}), op = std::max({op, sop, lws});
      wsb = std::max(wsb, ws_min ? mn : op);
    }
    for (RankBufs& b : rb) b.ws = workspace_buf(wsb);
    EXPECT_TRUE(finish());
    const Mat lm = loss_m();
    if (fused) {
      SimGather sg(P, rank_order(P, true));
      std::vector<SimGather::Rank> ctx;
      for (int r = 0; r < P; ++r) ctx.push_back({&sg, r});
      std::vector<std::thread> threads;
      for (int r = 0; r < P; ++r)
        threads.emplace_back([&, r] {
          const Shard& s = shards[size_t(r)];
          RankBufs& b = rb[size_t(r)];
          const fce_vp_shard sh{P, V, s.start, s.local, SimGather::fn, &ctx[size_t(r)]};
          fce_outputs out = FCE_OUTPUTS_INIT;
          out.loss = b.loss.p<float>();
          out.entropy = b.ent.p<float>();
          fce_gradients gr = grads(b.gh.ptr(), b.gw.ptr(), b.gb.ptr());
          b.st = fce_vp_linear_ce(&o, &sh, N, D, h.ptr(), b.W.ptr(), b.b.ptr(), y.ptr(), &out, &gr,
                                  b.ws.ptr(), wsb, test_stream());
          if (b.st != FCE_SUCCESS) b.err = fce_last_error();
          sg.leave();
        });
      for (auto& t : threads) t.join();
    } else {
      for (int r = 0; r < P; ++r) {
        const Shard& s = shards[size_t(r)];
        RankBufs& b = rb[size_t(r)];
        const fce_vp_shard sh{P, V, s.start, s.local, nullptr, nullptr};
        b.st = fce_vp_linear_stats(&o, &sh, N, D, h.ptr(), b.W.ptr(), b.b.ptr(), y.ptr(),
                                   b.stats.p<float>(), b.ws.ptr(), wsb, test_stream());
        if (b.st != FCE_SUCCESS) b.err = fce_last_error();
      }
      EXPECT_TRUE(finish());
      for (RankBufs& b : rb) b.stats.pull();
      std::vector<const Buf*> order;
      for (int q : rank_order(P, true)) order.push_back(&rb[size_t(q)].stats);
      Buf gathered = gather(order, N);
      for (int r = 0; r < P && !testing::Test::HasFailure(); ++r) {
        const Shard& s = shards[size_t(r)];
        RankBufs& b = rb[size_t(r)];
        const fce_vp_shard sh{P, V, s.start, s.local, nullptr, nullptr};
        fce_outputs out = FCE_OUTPUTS_INIT;
        out.loss = b.loss.p<float>();
        out.entropy = b.ent.p<float>();
        EXPECT_EQ(fce_vp_loss(&o, &sh, N, y.ptr(), gathered.p<const float>(), &out, b.ws.ptr(), wsb,
                              test_stream()),
                  FCE_SUCCESS)
            << fce_last_error();
        fce_gradients gr = grads(b.gh.ptr(), b.gw.ptr(), b.gb.ptr());
        b.st =
            fce_vp_linear_backward(&o, &sh, N, D, h.ptr(), b.W.ptr(), b.b.ptr(), y.ptr(),
                                   gathered.p<const float>(), &gr, b.ws.ptr(), wsb, test_stream());
        if (b.st != FCE_SUCCESS) b.err = fce_last_error();
      }
    }
    EXPECT_TRUE(finish());
    Result res;
    res.gh.assign(size_t(N * D), 0.0);
    res.gw.assign(size_t(V * D), 0.0);
    res.gb.assign(size_t(V), 0.0);
    for (int r = 0; r < P; ++r) {
      const Shard& s = shards[size_t(r)];
      RankBufs& b = rb[size_t(r)];
      EXPECT_EQ(b.st, FCE_SUCCESS) << "rank " << r << ": " << b.err;
      if (b.st != FCE_SUCCESS) return res;
      for (Buf* x : {&b.loss, &b.ent, &b.gh, &b.gw, &b.gb}) x->pull();
      const std::vector<double> l = read_mat(b.loss, lm), e = read_mat(b.ent, vec(FCE_FLOAT32, N));
      if (r == 0) res.loss = l, res.entropy = e;
      EXPECT_TRUE(l == res.loss && e == res.entropy) << "rank " << r << ": another loss/entropy";
      const std::vector<double> gh = read_mat(b.gh, mat(FCE_FLOAT32, N, D));
      for (size_t i = 0; i < gh.size(); ++i) res.gh[i] += gh[i];
      const std::vector<double> gw = read_mat(b.gw, mat(FCE_FLOAT32, s.local, D));
      std::copy(gw.begin(), gw.end(), res.gw.begin() + s.start * D);
      if (c.bias) {
        const std::vector<double> gb = read_mat(b.gb, vec(FCE_FLOAT32, s.local));
        std::copy(gb.begin(), gb.end(), res.gb.begin() + s.start);
      }
    }
    return res;
  }

  void run() {
    SCOPED_TRACE(lin_label(c));
    const Result whole = unsharded();
    if (testing::Test::HasFailure()) return;
    const double tol = lin_tolerance(c.dtype, ref.logits);
    EXPECT_TRUE(
        close_normwise(whole.entropy, ref_entropy, tol, "entropy (unsharded) vs reference"));
    for (int P : {1, 2, 3, 4})
      for (const auto& [fused, ws_min] :
           std::vector<std::pair<bool, bool>>{{true, false}, {true, true}, {false, false}}) {
        SCOPED_TRACE("P=" + std::to_string(P) + (fused ? " fce_vp_linear_ce" : " two phases") +
                     (ws_min ? " min_bytes" : ""));
        const Result v = sharded(P, fused, ws_min);
        if (testing::Test::HasFailure()) return;
        EXPECT_TRUE(close_normwise(v.loss, whole.loss, tol, "loss vs unsharded"));
        EXPECT_TRUE(close_normwise(v.entropy, whole.entropy, tol, "entropy vs unsharded"));
        EXPECT_TRUE(close_normwise(v.entropy, ref_entropy, tol, "entropy vs reference"));
        EXPECT_TRUE(close_normwise(v.gh, whole.gh, tol, "Σ grad_hidden vs unsharded"));
        EXPECT_TRUE(close_normwise(v.gh, ref.grad_hidden, tol, "Σ grad_hidden vs reference"));
        EXPECT_TRUE(close_normwise(v.gw, whole.gw, tol, "grad_weight vs unsharded"));
        EXPECT_TRUE(close_normwise(v.gw, ref.grad_weight, tol, "grad_weight vs reference"));
        if (c.bias) {
          EXPECT_TRUE(close_normwise(v.gb, whole.gb, tol, "grad_bias vs unsharded"));
          EXPECT_TRUE(close_normwise(v.gb, ref.grad_bias, tol, "grad_bias vs reference"));
        }
      }
  }
};

TEST_F(VpLinear, EntropyAndRowGradients) {
  const CaseEdits<LinVpCase> sets = {
      {"plain", [](LinVpCase&) {}},
      {"weights_smoothing_zloss_ignored",
       [](LinVpCase& c) {
         c.weights = true;
         c.eps = 0.1f;
         c.lambda = 1e-3f;
         c.ignore_frac = 0.2;
       }},
      {"softcap_scale_no_bias",
       [](LinVpCase& c) {
         c.softcap = 15.0f;
         c.scale = 0.8f;
         c.bias = false;
       }},
  };
  for_row_terms_cases<LinVpCase>(sets, 20, 157, 11,
                                 [](const LinVpCase& c) { LinRowTerms(c).run(); });
}

}  // namespace
