// test_vp_linear.cpp — the vocabulary-parallel linear calls (fce_vp_linear_stats,
// fce_vp_linear_backward, the fused fce_vp_linear_ce) with P = 1-4 ranks simulated in one
// process, against the unsharded fce_linear_ce and the float64 reference: the option matrix,
// workspace sizes, fused chunks, a failing all-gather. Part of the test_vocab_parallel
// executable (test_vp_ce.cpp says what the others hold).
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

}  // namespace
