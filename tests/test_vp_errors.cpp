// test_vp_errors.cpp — bad input to every vocabulary-parallel entry point (fce_vp_*): the
// status, a message naming the function and the argument, every buffer untouched; and the
// workspace queries. Part of the test_vocab_parallel executable (test_vp_ce.cpp says what the
// others hold).
#include "vp_common.h"

namespace {

// ------------------------------------------------------------------ bad input ---------------
enum VpFn { kStats, kLoss, kBackward, kLinStats, kLinBackward, kLinCe };
const char* fn_name(VpFn f) {
  switch (f) {
    case kStats: return "fce_vp_stats";
    case kLoss: return "fce_vp_loss";
    case kBackward: return "fce_vp_backward";
    case kLinStats: return "fce_vp_linear_stats";
    case kLinBackward: return "fce_vp_linear_backward";
    default: return "fce_vp_linear_ce";
  }
}

struct VpArgs {
  TestOptions o;
  const TestOptions* opts;
  int64_t ranks, rows, hidden, vocab_total, vocab_start, vocab_local;
  const void* logits;
  const void* hidden_states;
  const void* weight;
  const void* bias;
  const void* targets;
  float* stats;
  const float* gathered;
  float* loss;
  float* lse;
  float* z_loss;
  const float* gout;
  void* grad;
  void* gh;
  int32_t gh_dtype;
  void* gw;
  void* gb;
  uint32_t* flags;
  fce_vp_all_gather_fn all_gather;  // fce_vp_linear_ce
  void* context;
  void* ws;
  size_t wsb;
};

class VpBadInput : public BackendTest {
 protected:
  static constexpr int64_t N = 8, V = 40, S0 = 16, VL = 24, D = 8;  // shard [16, 40)
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    std::mt19937_64 rng(5);
    // An arena of 2 N VL floats: the shard's logits at its start, room for overlapping grads.
    arena = Buf(static_cast<size_t>(2 * N * VL) * 4);
    poison_all(arena, FCE_FLOAT32);
    write_mat(arena, mat(FCE_FLOAT32, N, VL), random_logits(rng, FCE_FLOAT32, N, VL));
    arena.push();
    Buf logits0(mat(FCE_FLOAT32, N, S0));
    write_mat(logits0, mat(FCE_FLOAT32, N, S0), random_logits(rng, FCE_FLOAT32, N, S0));
    logits0.push();
    targets = targets_buf(random_targets(rng, N, V), FCE_INT64);
    weights = f32_buf(random_uniform(rng, V, 0.5, 1.5));
    gout = f32_buf({1.0});
    stats = poisoned(vec(FCE_FLOAT32, N * FCE_VP_STATS));
    loss = poisoned(vec(FCE_FLOAT32, N));
    lse = poisoned(vec(FCE_FLOAT32, N));
    zl = poisoned(vec(FCE_FLOAT32, 1));
    grad = poisoned(mat(FCE_FLOAT32, N, VL));
    flags = Buf(4, 0xA5);
    flags.push();
    am = poisoned(vec(FCE_INT64, N));
    acc = poisoned(vec(FCE_FLOAT32, N));
    hidden = f32_buf(random_normal(rng, FCE_FLOAT32, N * D, 1.0));
    weight = f32_buf(random_normal(rng, FCE_FLOAT32, VL * D, 0.3));
    bias = f32_buf(random_normal(rng, FCE_FLOAT32, VL, 0.3));
    gh = poisoned(mat(FCE_FLOAT32, N, D));
    gw = poisoned(mat(FCE_FLOAT32, VL, D));
    gb = poisoned(vec(FCE_FLOAT32, VL));
    a.o = test_options();
    a.o.class_weights = weights.p<float>();
    // Real gathered stats of the two shards [0, 16) and [16, 40).
    Buf st0 = poisoned(vec(FCE_FLOAT32, N * FCE_VP_STATS));
    Buf st1 = poisoned(vec(FCE_FLOAT32, N * FCE_VP_STATS));
    ASSERT_EQ(flat::vp_stats(&a.o, N, V, 0, S0, logits0.ptr(), targets.ptr(), st0.p<float>(),
                           test_stream()), FCE_SUCCESS) << fce_last_error();
    ASSERT_EQ(flat::vp_stats(&a.o, N, V, S0, VL, arena.ptr(), targets.ptr(), st1.p<float>(),
                           test_stream()), FCE_SUCCESS) << fce_last_error();
    ASSERT_TRUE(finish());
    st0.pull();
    st1.pull();
    gathered = gather({&st0, &st1}, N);
    size_t b = 0, mn = 0, op = 0;
    TestOptions loss_o = a.o;  // fce_vp_loss is called with reduction none (args())
    loss_o.reduction = FCE_REDUCTION_NONE;
    ASSERT_EQ(fce_vp_loss_workspace_size(&loss_o, 2, N, V, &b), FCE_SUCCESS) << fce_last_error();
    ws_need[kLoss] = b;
    ASSERT_EQ(fce_vp_backward_workspace_size(&a.o, 2, N, V, VL, &b), FCE_SUCCESS) << fce_last_error();
    ws_need[kBackward] = b;
    ASSERT_EQ(fce_vp_linear_stats_workspace_size(&a.o, N, D, VL, &mn, &op), FCE_SUCCESS)
        << fce_last_error();
    ws_need[kLinStats] = mn;
    ASSERT_EQ(fce_vp_linear_backward_workspace_size(&a.o, 2, N, D, V, VL, FCE_FLOAT32, &mn, &op),
              FCE_SUCCESS) << fce_last_error();
    ws_need[kLinBackward] = mn;
    ASSERT_EQ(fce_vp_linear_ce_workspace_size(&a.o, 2, N, D, V, VL, 1, FCE_FLOAT32, &mn, &op),
              FCE_SUCCESS) << fce_last_error();
    ws_need[kLinCe] = mn;
    ws_need[kStats] = 0;
    size_t most = 0;
    for (size_t w : ws_need) most = std::max(most, w);
    ws = workspace_buf(most + 64);
    a.opts = &a.o;
    a.ranks = 2;
    a.rows = N;
    a.hidden = D;
    a.vocab_total = V;
    a.vocab_start = S0;
    a.vocab_local = VL;
    a.logits = arena.ptr();
    a.hidden_states = hidden.ptr();
    a.weight = weight.ptr();
    a.bias = bias.ptr();
    a.targets = targets.ptr();
    a.stats = stats.p<float>();
    a.gathered = gathered.p<float>();
    a.loss = loss.p<float>();
    a.lse = lse.p<float>();
    a.z_loss = zl.p<float>();
    a.gout = gout.p<float>();
    a.grad = grad.ptr();
    a.gh = gh.ptr();
    a.gh_dtype = FCE_FLOAT32;
    a.gw = gw.ptr();
    a.gb = gb.ptr();
    a.flags = flags.p<uint32_t>();
    a.all_gather = fake_gather;
    a.context = this;
    a.ws = ws.ptr();
    a.wsb = 0;
  }

  // fce_vp_linear_ce's all-gather, standing in for the other rank: recv gets the two shards'
  // real statistics (the gather-once plan of these sizes gathers all N rows at once).
  static fce_status fake_gather(void* ctx, const float*, float* recv, int64_t count,
                                void* stream) {
    VpBadInput* t = static_cast<VpBadInput*>(ctx);
    ++t->gathers;
    if (count != N * FCE_VP_STATS) return FCE_ERROR_INTERNAL;
    const size_t bytes = static_cast<size_t>(2 * count) * sizeof(float);
#if FCE_TEST_HAVE_CUDA
    if (on_cuda())
      return cudaMemcpyAsync(recv, t->gathered.ptr(), bytes, cudaMemcpyDeviceToDevice,
                             static_cast<cudaStream_t>(stream)) == cudaSuccess
                 ? FCE_SUCCESS : FCE_ERROR_CUDA;
#endif
    (void)stream;
    std::memcpy(recv, t->gathered.ptr(), bytes);
    return FCE_SUCCESS;
  }

  VpArgs args(VpFn f) {
    VpArgs x = a;
    x.wsb = ws_need[f];
    if (f == kLoss) x.o.reduction = FCE_REDUCTION_NONE, x.gout = nullptr;  // loss [N]
    return x;
  }

  fce_status call(VpFn f, const VpArgs& x) {
    switch (f) {
      case kStats:
        return flat::vp_stats(x.opts, x.rows, x.vocab_total, x.vocab_start, x.vocab_local, x.logits,
                            x.targets, x.stats, test_stream());
      case kLoss:
        return flat::vp_loss(x.opts, x.ranks, x.rows, x.vocab_total, x.targets, x.gathered, x.loss,
                           x.lse, x.z_loss, x.flags, x.ws, x.wsb, test_stream());
      case kBackward:
        return flat::vp_backward(x.opts, x.ranks, x.rows, x.vocab_total, x.vocab_start,
                               x.vocab_local, x.logits, x.targets, x.gathered, x.gout, x.grad,
                               x.ws, x.wsb, test_stream());
      case kLinStats:
        return flat::vp_linear_stats(x.opts, x.rows, x.hidden, x.vocab_total, x.vocab_start,
                                   x.vocab_local, x.hidden_states, x.weight, x.bias, x.targets,
                                   x.stats, x.ws, x.wsb, test_stream());
      case kLinBackward:
        return flat::vp_linear_backward(x.opts, x.ranks, x.rows, x.hidden, x.vocab_total,
                                      x.vocab_start, x.vocab_local, x.hidden_states, x.weight,
                                      x.bias, x.targets, x.gathered, x.gout, x.gh, x.gh_dtype,
                                      x.gw, x.gb, x.ws, x.wsb, test_stream());
      default:
        return flat::vp_linear_ce(x.opts, x.ranks, x.rows, x.hidden, x.vocab_total, x.vocab_start,
                                x.vocab_local, x.hidden_states, x.weight, x.bias, x.targets,
                                x.loss, x.lse, x.z_loss, x.gout, x.gh, x.gh_dtype, x.gw, x.gb,
                                x.flags, x.all_gather, x.context, x.ws, x.wsb, test_stream());
    }
  }

  void rejected(VpFn f, const std::string& what, fce_status expected, const char* names,
                const std::function<void(VpArgs&)>& mutate) {
    SCOPED_TRACE(std::string(fn_name(f)) + " bad input: " + what);
    VpArgs x = args(f);
    mutate(x);
    if (x.opts == &a.o) x.opts = &x.o;
    std::vector<Buf*> bufs = {&arena, &targets, &weights, &gout, &stats, &gathered, &loss, &lse,
                              &zl, &grad, &flags, &am, &acc, &hidden, &weight, &bias, &gh, &gw,
                              &gb};
    std::vector<std::vector<uint8_t>> before;
    for (Buf* b : bufs) before.push_back(b->mirror());
    gathers = 0;
    const fce_status st = call(f, x);
    EXPECT_EQ(gathers, 0) << "a rejected call ran its all-gather";
    EXPECT_EQ(st, expected) << "got " << fce_status_string(st) << " (\"" << fce_last_error()
                            << "\")";
    EXPECT_TRUE(error_mentions(names));
    EXPECT_TRUE(error_mentions(std::string(fn_name(f)) + ":"));
    EXPECT_TRUE(finish());
    for (size_t i = 0; i < bufs.size(); ++i) {
      bufs[i]->pull();
      EXPECT_TRUE(unchanged(*bufs[i], before[i], "a buffer of the rejected call"));
    }
  }

  void for_all(const std::string& what, fce_status st, const char* names,
               const std::function<void(VpArgs&)>& mutate) {
    for (VpFn f : {kStats, kLoss, kBackward, kLinStats, kLinBackward, kLinCe})
      rejected(f, what, st, names, mutate);
  }

  Buf arena, targets, weights, gout, stats, gathered, loss, lse, zl, grad, flags, am, acc, hidden,
      weight, bias, gh, gw, gb, ws;
  size_t ws_need[6] = {};
  int gathers = 0;
  VpArgs a;
};

constexpr float kNaNf = std::numeric_limits<float>::quiet_NaN();

TEST_F(VpBadInput, ValidBaselineSucceeds) {
  for (VpFn f : {kStats, kLoss, kBackward, kLinStats, kLinBackward, kLinCe}) {
    SCOPED_TRACE(fn_name(f));
    VpArgs x = args(f);
    x.opts = &x.o;
    gathers = 0;
    EXPECT_EQ(call(f, x), FCE_SUCCESS) << fce_last_error();
    EXPECT_TRUE(finish());
    EXPECT_STREQ(fce_last_error(), "");
    EXPECT_EQ(gathers, f == kLinCe ? 1 : 0);
  }
  // fce_vp_linear_ce: the loss only is a valid call too
  VpArgs l = args(kLinCe);
  l.opts = &l.o;
  l.gh = l.gw = l.gb = nullptr;
  EXPECT_EQ(call(kLinCe, l), FCE_SUCCESS) << fce_last_error();
  EXPECT_TRUE(finish());
  // In place is fine for fce_vp_backward.
  VpArgs x = args(kBackward);
  x.opts = &x.o;
  x.grad = const_cast<void*>(x.logits);
  EXPECT_EQ(call(kBackward, x), FCE_SUCCESS) << fce_last_error();
  EXPECT_TRUE(finish());
}

TEST_F(VpBadInput, Options) {
  for_all("options NULL", FCE_ERROR_NULL_POINTER, "options", [](VpArgs& x) { x.opts = nullptr; });
  for_all("struct_size 8", FCE_ERROR_INVALID_ARGUMENT, "struct_size",
          [](VpArgs& x) { x.o.struct_size = 8; });
  for_all("dtype 7", FCE_ERROR_INVALID_ARGUMENT, "dtype", [](VpArgs& x) { x.o.dtype = 7; });
  // class probabilities (target_dtype float32) take neither token scaling nor the shift
  for_all("token_scaling with class probabilities", FCE_ERROR_INVALID_ARGUMENT,
          "options->token_scaling", [](VpArgs& x) {
            x.o.target_dtype = FCE_FLOAT32;
            x.o.token_scaling = 1;
          });
  for_all("shift_seq_len 2 with class probabilities", FCE_ERROR_UNSUPPORTED,
          "options->shift_seq_len", [](VpArgs& x) {
            x.o.target_dtype = FCE_FLOAT32;
            x.o.shift_seq_len = 2;
          });
  for_all("reduction 3", FCE_ERROR_INVALID_ARGUMENT, "reduction", [](VpArgs& x) { x.o.reduction = 3; });
  for_all("backend 2", FCE_ERROR_INVALID_ARGUMENT, "backend", [](VpArgs& x) { x.o.backend = 2; });
  for_all("label_smoothing 1", FCE_ERROR_INVALID_ARGUMENT, "label_smoothing",
          [](VpArgs& x) { x.o.label_smoothing = 1.0f; });
  for_all("z_loss_scale NaN", FCE_ERROR_INVALID_ARGUMENT, "z_loss_scale",
          [](VpArgs& x) { x.o.z_loss_scale = kNaNf; });
  for_all("softcap -1", FCE_ERROR_INVALID_ARGUMENT, "softcap", [](VpArgs& x) { x.o.softcap = -1.0f; });
  for_all("logit_scale 0", FCE_ERROR_INVALID_ARGUMENT, "logit_scale",
          [](VpArgs& x) { x.o.logit_scale = 0.0f; });
  for_all("shift_seq_len 3 with rows 8", FCE_ERROR_INVALID_ARGUMENT, "shift_seq_len",
          [](VpArgs& x) { x.o.shift_seq_len = 3; });
  for_all("shift without shift_seq_len", FCE_ERROR_INVALID_ARGUMENT, "options->shift",
          [](VpArgs& x) { x.o.shift = 2; });
  // (the calls over logits honour it: test_vp_invariance.cpp)
  for (VpFn f : {kLinStats, kLinBackward, kLinCe})
    rejected(f, "batch_invariant", FCE_ERROR_UNSUPPORTED, "options->batch_invariant",
             [](VpArgs& x) { x.o.batch_invariant = 1; });
  for_all("class_weights +1 byte", FCE_ERROR_MISALIGNED, "class_weights",
          [](VpArgs& x) { x.o.class_weights = reinterpret_cast<const float*>(reinterpret_cast<const char*>(x.o.class_weights) + 1); });
  if (!fce_cuda_available()) {
    for_all("backend CUDA without CUDA", FCE_ERROR_BACKEND_UNAVAILABLE, "backend|CUDA",
            [](VpArgs& x) { x.o.backend = FCE_BACKEND_CUDA; });
  }
}

TEST_F(VpBadInput, Sizes) {
  for_all("rows -1", FCE_ERROR_INVALID_ARGUMENT, "rows", [](VpArgs& x) { x.rows = -1; });
  for_all("vocab_total 0", FCE_ERROR_INVALID_ARGUMENT, "vocab_total", [](VpArgs& x) { x.vocab_total = 0; });
  for_all("vocab_total 2^31", FCE_ERROR_INVALID_ARGUMENT, "vocab_total",
          [](VpArgs& x) { x.vocab_total = int64_t{1} << 31; });
  for (VpFn f : {kStats, kBackward, kLinStats, kLinBackward, kLinCe}) {
    rejected(f, "vocab_local 0", FCE_ERROR_INVALID_ARGUMENT, "vocab_local", [](VpArgs& x) { x.vocab_local = 0; });
    rejected(f, "vocab_local -5", FCE_ERROR_INVALID_ARGUMENT, "vocab_local", [](VpArgs& x) { x.vocab_local = -5; });
    rejected(f, "vocab_start -1", FCE_ERROR_INVALID_ARGUMENT, "vocab_start", [](VpArgs& x) { x.vocab_start = -1; });
    rejected(f, "vocab_start + vocab_local > vocab_total", FCE_ERROR_INVALID_ARGUMENT,
             "vocab_start", [](VpArgs& x) { x.vocab_start = V - VL + 1; });
    rejected(f, "vocab_local > vocab_total", FCE_ERROR_INVALID_ARGUMENT, "vocab_local|vocab_start",
             [](VpArgs& x) { x.vocab_start = 0; x.vocab_local = V + 1; });
    rejected(f, "vocab_start INT64_MAX", FCE_ERROR_INVALID_ARGUMENT, "vocab_start",
             [](VpArgs& x) { x.vocab_start = INT64_MAX; });
  }
  for (VpFn f : {kLoss, kBackward, kLinBackward, kLinCe}) {
    rejected(f, "ranks 0", FCE_ERROR_INVALID_ARGUMENT, "ranks", [](VpArgs& x) { x.ranks = 0; });
    rejected(f, "ranks -2", FCE_ERROR_INVALID_ARGUMENT, "ranks", [](VpArgs& x) { x.ranks = -2; });
    rejected(f, "ranks overflowing", FCE_ERROR_INVALID_ARGUMENT, "ranks",
             [](VpArgs& x) { x.ranks = int64_t{1} << 60; });
  }
  for (VpFn f : {kLinStats, kLinBackward, kLinCe}) {
    rejected(f, "hidden 0", FCE_ERROR_INVALID_ARGUMENT, "hidden", [](VpArgs& x) { x.hidden = 0; });
    rejected(f, "hidden_row_stride < hidden", FCE_ERROR_INVALID_ARGUMENT, "hidden_row_stride",
             [](VpArgs& x) { x.o.hidden_row_stride = D - 1; });
  }
  for (VpFn f : {kStats, kBackward}) {
    rejected(f, "row_stride < vocab_local", FCE_ERROR_INVALID_ARGUMENT, "row_stride",
             [](VpArgs& x) { x.o.row_stride = VL - 1; });
    rejected(f, "row_stride overflowing", FCE_ERROR_INVALID_ARGUMENT, "rows|row stride|row_stride",
             [](VpArgs& x) { x.o.row_stride = INT64_MAX; });
  }
  rejected(kBackward, "grad_row_stride < vocab_local", FCE_ERROR_INVALID_ARGUMENT,
           "grad_row_stride", [](VpArgs& x) { x.o.grad_row_stride = VL - 1; });
  for (VpFn f : {kLinBackward, kLinCe}) {
    rejected(f, "grad_hidden_dtype float16 with float32", FCE_ERROR_INVALID_ARGUMENT,
             "grad_hidden_dtype", [](VpArgs& x) { x.gh_dtype = FCE_FLOAT16; });
    rejected(f, "grad_hidden_dtype int32", FCE_ERROR_INVALID_ARGUMENT, "grad_hidden_dtype",
             [](VpArgs& x) { x.gh_dtype = FCE_INT32; });
    rejected(f, "grad_hidden_dtype 9", FCE_ERROR_INVALID_ARGUMENT, "grad_hidden_dtype",
             [](VpArgs& x) { x.gh_dtype = 9; });
  }
}

TEST_F(VpBadInput, NullPointers) {
  rejected(kStats, "logits NULL", FCE_ERROR_NULL_POINTER, "logits", [](VpArgs& x) { x.logits = nullptr; });
  rejected(kStats, "stats NULL", FCE_ERROR_NULL_POINTER, "stats", [](VpArgs& x) { x.stats = nullptr; });
  rejected(kLoss, "gathered_stats NULL", FCE_ERROR_NULL_POINTER, "gathered_stats",
           [](VpArgs& x) { x.gathered = nullptr; });
  rejected(kLoss, "loss NULL", FCE_ERROR_NULL_POINTER, "loss", [](VpArgs& x) { x.loss = nullptr; });
  rejected(kBackward, "logits NULL", FCE_ERROR_NULL_POINTER, "logits", [](VpArgs& x) { x.logits = nullptr; });
  rejected(kBackward, "gathered_stats NULL", FCE_ERROR_NULL_POINTER, "gathered_stats",
           [](VpArgs& x) { x.gathered = nullptr; });
  rejected(kBackward, "grad_logits NULL", FCE_ERROR_NULL_POINTER, "grad_logits",
           [](VpArgs& x) { x.grad = nullptr; });
  for (VpFn f : {kLinStats, kLinBackward, kLinCe}) {
    rejected(f, "hidden_states NULL", FCE_ERROR_NULL_POINTER, "hidden_states",
             [](VpArgs& x) { x.hidden_states = nullptr; });
    rejected(f, "weight NULL", FCE_ERROR_NULL_POINTER, "weight", [](VpArgs& x) { x.weight = nullptr; });
  }
  rejected(kLinCe, "loss NULL", FCE_ERROR_NULL_POINTER, "loss", [](VpArgs& x) { x.loss = nullptr; });
  rejected(kLinCe, "all_gather NULL", FCE_ERROR_NULL_POINTER, "shard->all_gather",
           [](VpArgs& x) { x.all_gather = nullptr; });
  rejected(kLinCe, "grad_bias without bias", FCE_ERROR_INVALID_ARGUMENT, "grad_bias",
           [](VpArgs& x) { x.bias = nullptr; });
  rejected(kLinStats, "stats NULL", FCE_ERROR_NULL_POINTER, "stats", [](VpArgs& x) { x.stats = nullptr; });
  rejected(kLinBackward, "gathered_stats NULL", FCE_ERROR_NULL_POINTER, "gathered_stats",
           [](VpArgs& x) { x.gathered = nullptr; });
  rejected(kLinBackward, "every gradient NULL", FCE_ERROR_NULL_POINTER, "grad_hidden",
           [](VpArgs& x) { x.gh = x.gw = x.gb = nullptr; });
  rejected(kLinBackward, "grad_bias without bias", FCE_ERROR_INVALID_ARGUMENT, "grad_bias",
           [](VpArgs& x) { x.bias = nullptr; });
  for_all("targets NULL", FCE_ERROR_NULL_POINTER, "targets", [](VpArgs& x) { x.targets = nullptr; });
}

TEST_F(VpBadInput, Misaligned) {
  auto off = [](const void* p, int n) { return const_cast<char*>(static_cast<const char*>(p)) + n; };
  for (VpFn f : {kStats, kLinStats})
    rejected(f, "stats +4 bytes (float aligned, not 16)", FCE_ERROR_MISALIGNED, "stats",
             [&](VpArgs& x) { x.stats = reinterpret_cast<float*>(off(x.stats, 4)); });
  for (VpFn f : {kLoss, kBackward, kLinBackward})
    rejected(f, "gathered_stats +8 bytes", FCE_ERROR_MISALIGNED, "gathered_stats",
             [&](VpArgs& x) { x.gathered = reinterpret_cast<const float*>(off(x.gathered, 8)); });
  // (the gradient calls take no outputs: the step's error flags are fce_vp_loss's)
  for (VpFn f : {kLoss, kLinCe})
    rejected(f, "error_flags +1 byte", FCE_ERROR_MISALIGNED, "error_flags",
             [&](VpArgs& x) { x.flags = reinterpret_cast<uint32_t*>(off(x.flags, 1)); });
  rejected(kLinCe, "loss +2 bytes", FCE_ERROR_MISALIGNED, "loss",
           [&](VpArgs& x) { x.loss = reinterpret_cast<float*>(off(x.loss, 2)); });
  rejected(kLinCe, "grad_output +1 byte", FCE_ERROR_MISALIGNED, "grad_output",
           [&](VpArgs& x) { x.gout = reinterpret_cast<const float*>(off(x.gout, 1)); });
  for_all("int64 targets +4 bytes", FCE_ERROR_MISALIGNED, "targets",
          [&](VpArgs& x) { x.targets = off(x.targets, 4); });
  for (VpFn f : {kStats, kBackward})
    rejected(f, "logits +2 bytes", FCE_ERROR_MISALIGNED, "logits",
             [&](VpArgs& x) { x.logits = off(x.logits, 2); });
  rejected(kBackward, "grad_logits +1 byte", FCE_ERROR_MISALIGNED, "grad_logits",
           [&](VpArgs& x) { x.grad = off(x.grad, 1); });
  rejected(kBackward, "grad_output +1 byte", FCE_ERROR_MISALIGNED, "grad_output",
           [&](VpArgs& x) { x.gout = reinterpret_cast<const float*>(off(x.gout, 1)); });
  rejected(kLoss, "loss +2 bytes", FCE_ERROR_MISALIGNED, "loss",
           [&](VpArgs& x) { x.loss = reinterpret_cast<float*>(off(x.loss, 2)); });
  rejected(kLoss, "lse +1 byte", FCE_ERROR_MISALIGNED, "lse",
           [&](VpArgs& x) { x.lse = reinterpret_cast<float*>(off(x.lse, 1)); });
  rejected(kLoss, "outputs->argmax +4 bytes", FCE_ERROR_MISALIGNED, "outputs->argmax",
           [&](VpArgs& x) { x.o.argmax = reinterpret_cast<int64_t*>(off(am.ptr(), 4)); });
  rejected(kLoss, "outputs->accuracy +2 bytes", FCE_ERROR_MISALIGNED, "outputs->accuracy",
           [&](VpArgs& x) { x.o.accuracy = reinterpret_cast<float*>(off(acc.ptr(), 2)); });
  for (VpFn f : {kLinStats, kLinBackward, kLinCe}) {
    rejected(f, "hidden_states +1 byte", FCE_ERROR_MISALIGNED, "hidden_states",
             [&](VpArgs& x) { x.hidden_states = off(x.hidden_states, 1); });
    rejected(f, "weight +2 bytes", FCE_ERROR_MISALIGNED, "weight",
             [&](VpArgs& x) { x.weight = off(x.weight, 2); });
    rejected(f, "bias +1 byte", FCE_ERROR_MISALIGNED, "bias", [&](VpArgs& x) { x.bias = off(x.bias, 1); });
  }
  for (VpFn f : {kLinBackward, kLinCe}) {
    rejected(f, "grad_hidden +2 bytes", FCE_ERROR_MISALIGNED, "grad_hidden",
             [&](VpArgs& x) { x.gh = off(x.gh, 2); });
    rejected(f, "grad_weight +1 byte", FCE_ERROR_MISALIGNED, "grad_weight",
             [&](VpArgs& x) { x.gw = off(x.gw, 1); });
    rejected(f, "grad_bias +2 bytes", FCE_ERROR_MISALIGNED, "grad_bias",
             [&](VpArgs& x) { x.gb = off(x.gb, 2); });
  }
}

TEST_F(VpBadInput, Overlap) {
  rejected(kStats, "stats inside the logits", FCE_ERROR_INVALID_ARGUMENT, "stats",
           [](VpArgs& x) { x.stats = static_cast<float*>(const_cast<void*>(x.logits)) + 4; });
  rejected(kStats, "stats over the targets", FCE_ERROR_INVALID_ARGUMENT, "stats",
           [](VpArgs& x) { x.stats = static_cast<float*>(const_cast<void*>(x.targets)); });
  rejected(kLoss, "loss inside gathered_stats", FCE_ERROR_INVALID_ARGUMENT, "loss",
           [](VpArgs& x) { x.loss = const_cast<float*>(x.gathered) + 8; });
  rejected(kLoss, "lse over loss", FCE_ERROR_INVALID_ARGUMENT, "lse|loss",
           [](VpArgs& x) { x.lse = x.loss + 2; });
  rejected(kLoss, "outputs->argmax over the targets", FCE_ERROR_INVALID_ARGUMENT,
           "outputs->argmax", [](VpArgs& x) { x.o.argmax = static_cast<int64_t*>(const_cast<void*>(x.targets)); });
  rejected(kLoss, "outputs->accuracy inside lse", FCE_ERROR_INVALID_ARGUMENT, "outputs->accuracy",
           [](VpArgs& x) { x.o.accuracy = x.lse + 3; });
  rejected(kLoss, "error_flags inside class_weights", FCE_ERROR_INVALID_ARGUMENT, "error_flags",
           [](VpArgs& x) { x.flags = reinterpret_cast<uint32_t*>(const_cast<float*>(x.o.class_weights) + 5); });
  rejected(kBackward, "grad_logits partially over the logits", FCE_ERROR_INVALID_ARGUMENT,
           "grad_logits", [](VpArgs& x) { x.grad = static_cast<float*>(const_cast<void*>(x.logits)) + 3; });
  rejected(kBackward, "in place with grad_row_stride != row_stride", FCE_ERROR_INVALID_ARGUMENT,
           "grad_row_stride", [](VpArgs& x) {
             x.grad = const_cast<void*>(x.logits);
             x.o.row_stride = VL;
             x.o.grad_row_stride = VL + 1;
           });
  rejected(kBackward, "grad_logits over gathered_stats", FCE_ERROR_INVALID_ARGUMENT,
           "grad_logits|gathered_stats", [](VpArgs& x) { x.grad = const_cast<float*>(x.gathered); });
  rejected(kLinStats, "stats over the weight", FCE_ERROR_INVALID_ARGUMENT, "stats",
           [](VpArgs& x) { x.stats = static_cast<float*>(const_cast<void*>(x.weight)); });
  for (VpFn f : {kLinBackward, kLinCe}) {
    rejected(f, "grad_hidden over grad_weight", FCE_ERROR_INVALID_ARGUMENT,
             "grad_hidden|grad_weight", [](VpArgs& x) { x.gh = static_cast<float*>(x.gw) + 1; });
    rejected(f, "grad_bias inside hidden_states", FCE_ERROR_INVALID_ARGUMENT, "grad_bias",
             [](VpArgs& x) { x.gb = static_cast<float*>(const_cast<void*>(x.hidden_states)) + 4; });
  }
  rejected(kLinCe, "lse over loss", FCE_ERROR_INVALID_ARGUMENT, "lse|loss",
           [](VpArgs& x) { x.lse = x.loss; });
  rejected(kLinCe, "loss inside the weight", FCE_ERROR_INVALID_ARGUMENT, "loss|weight",
           [](VpArgs& x) { x.loss = static_cast<float*>(const_cast<void*>(x.weight)) + 2; });
  rejected(kLinBackward, "grad_weight over gathered_stats", FCE_ERROR_INVALID_ARGUMENT,
           "grad_weight|gathered_stats", [](VpArgs& x) { x.gw = const_cast<float*>(x.gathered); });
}

TEST_F(VpBadInput, Workspace) {
  bool any = false;
  for (VpFn f : {kLoss, kBackward, kLinStats, kLinBackward, kLinCe}) {
    if (ws_need[f] == 0) continue;
    any = true;
    rejected(f, "workspace_bytes one short", FCE_ERROR_WORKSPACE_TOO_SMALL, "workspace",
             [this, f](VpArgs& x) { x.wsb = ws_need[f] - 1; });
    rejected(f, "workspace NULL", FCE_ERROR_NULL_POINTER, "workspace",
             [](VpArgs& x) { x.ws = nullptr; });
    rejected(f, "workspace +8 bytes", FCE_ERROR_MISALIGNED, "workspace",
             [](VpArgs& x) { x.ws = static_cast<char*>(x.ws) + 8; });
  }
  if (!any) {
    std::printf("SKIPPED: no workspace is needed on this backend\n");
    GTEST_SKIP() << "no workspace to make too small";
  }
}

// The workspace queries: their own bad input, and consistent answers.
TEST_F(VpBadInput, WorkspaceQueries) {
  TestOptions o = a.o;
  size_t b = 7, mn = 7, op = 7;
  EXPECT_EQ(fce_vp_loss_workspace_size(nullptr, 2, N, V, &b), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_loss_workspace_size: options"));
  EXPECT_EQ(fce_vp_loss_workspace_size(&o, 2, N, V, nullptr), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_loss_workspace_size: workspace_bytes"));
  EXPECT_EQ(fce_vp_loss_workspace_size(&o, 0, N, V, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_loss_workspace_size: ranks"));
  EXPECT_EQ(fce_vp_loss_workspace_size(&o, 2, -1, V, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_loss_workspace_size: rows"));
  EXPECT_EQ(fce_vp_loss_workspace_size(&o, 2, N, 0, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_loss_workspace_size: vocab_total"));
  EXPECT_EQ(fce_vp_backward_workspace_size(&o, 2, N, V, V + 1, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_backward_workspace_size: vocab_local"));
  EXPECT_EQ(fce_vp_backward_workspace_size(&o, 2, N, V, 0, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_backward_workspace_size: vocab_local"));
  EXPECT_EQ(fce_vp_backward_workspace_size(&o, -1, N, V, VL, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_backward_workspace_size: ranks"));
  EXPECT_EQ(fce_vp_backward_workspace_size(&o, 2, N, V, VL, nullptr), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_backward_workspace_size: workspace_bytes"));
  EXPECT_EQ(fce_vp_linear_stats_workspace_size(&o, N, D, 0, &mn, &op), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_stats_workspace_size: vocab_local"));
  EXPECT_EQ(fce_vp_linear_stats_workspace_size(&o, N, 0, VL, &mn, &op), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_stats_workspace_size: hidden"));
  EXPECT_EQ(fce_vp_linear_stats_workspace_size(&o, N, D, VL, nullptr, &op), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_linear_stats_workspace_size: min_bytes"));
  EXPECT_EQ(fce_vp_linear_backward_workspace_size(&o, 2, N, D, V, VL, FCE_BFLOAT16, &mn, &op),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_backward_workspace_size: grad_hidden_dtype"));
  EXPECT_EQ(fce_vp_linear_backward_workspace_size(&o, 0, N, D, V, VL, FCE_FLOAT32, &mn, &op),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_backward_workspace_size: ranks"));
  EXPECT_EQ(fce_vp_linear_backward_workspace_size(&o, 2, N, D, V, V + 1, FCE_FLOAT32, &mn, &op),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_backward_workspace_size: vocab_local"));
  EXPECT_EQ(fce_vp_linear_backward_workspace_size(&o, 2, N, D, V, VL, FCE_FLOAT32, nullptr, &op),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_linear_backward_workspace_size: min_bytes"));
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(nullptr, 2, N, D, V, VL, 1, FCE_FLOAT32, &mn, &op),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_linear_ce_workspace_size: options"));
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o, 0, N, D, V, VL, 1, FCE_FLOAT32, &mn, &op),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_ce_workspace_size: ranks"));
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o, 2, N, 0, V, VL, 1, FCE_FLOAT32, &mn, &op),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_ce_workspace_size: hidden"));
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o, 2, N, D, V, V + 1, 1, FCE_FLOAT32, &mn, &op),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_ce_workspace_size: vocab_local"));
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o, 2, N, D, V, VL, 1, FCE_BFLOAT16, &mn, &op),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_ce_workspace_size: grad_hidden_dtype"));
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o, 2, N, D, V, VL, 1, FCE_FLOAT32, nullptr, &op),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_linear_ce_workspace_size: min_bytes"));
  // rank-invariant for shards up to ceil(V / ranks): the narrow and the wide rank agree
  size_t n0 = 0, o0 = 0, n1 = 0, o1 = 0;
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o, 2, N, D, V, V / 2 - 3, 1, FCE_FLOAT32, &n0, &o0),
            FCE_SUCCESS);
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o, 2, N, D, V, V / 2, 1, FCE_FLOAT32, &n1, &o1),
            FCE_SUCCESS);
  EXPECT_EQ(n0, n1);
  EXPECT_EQ(o0, o1);
  EXPECT_GE(o1, n1);
  TestOptions bad = o;
  bad.dtype = 42;
  EXPECT_EQ(fce_vp_loss_workspace_size(&bad, 2, N, V, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("dtype"));
  // Consistent answers: optimal >= min, a 16-bit grad_hidden_dtype (options->dtype) is fine,
  // optimal_bytes may be NULL, and a successful query clears the last error.
  EXPECT_EQ(fce_vp_linear_backward_workspace_size(&o, 2, N, D, V, VL, FCE_FLOAT32, &mn, &op),
            FCE_SUCCESS) << fce_last_error();
  EXPECT_GE(op, mn);
  EXPECT_STREQ(fce_last_error(), "");
  size_t mn2 = 0;
  EXPECT_EQ(fce_vp_linear_backward_workspace_size(&o, 2, N, D, V, VL, FCE_FLOAT32, &mn2, nullptr),
            FCE_SUCCESS);
  EXPECT_EQ(mn2, mn);
  TestOptions h = o;
  h.dtype = FCE_BFLOAT16;
  for (int32_t ghd : {FCE_FLOAT32, FCE_BFLOAT16}) {
    EXPECT_EQ(fce_vp_linear_backward_workspace_size(&h, 2, N, D, V, VL, ghd, &mn, &op), FCE_SUCCESS)
        << fce_last_error();
    EXPECT_GE(op, mn);
  }
  EXPECT_EQ(fce_vp_linear_stats_workspace_size(&h, N, D, VL, &mn, &op), FCE_SUCCESS);
  EXPECT_GE(op, mn);
}

}  // namespace
