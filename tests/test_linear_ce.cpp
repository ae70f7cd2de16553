// test_linear_ce.cpp — fce_linear_ce (z = h W^T + b, cross-entropy, dh, dW, db) against the
// float64 reference (ref.h: a naive double matmul), on the backend FCE_TEST_BACKEND selects.
//
// Every option, bias or not, overwrite and accumulate, grad_weight_fp32, per-row upstream,
// loss only, partial gradients, workspaces from the minimum to past the optimum, each CUDA plan
// crossed with the gradient sets (and captured into a CUDA graph), odd shapes, strided hidden
// rows, out-of-range targets, shift by k, token scaling, argmax and accuracy, determinism, bad
// input. Outputs poisoned, guards and row gaps checked as in test_ce.cpp.
//
// test_linear_ce.cpp: the option matrix, shapes and workspaces, bad input; test_linear_plans.cpp:
// the CUDA plans crossed with the gradient sets, targets, determinism, graph capture. The case
// and its runner are linear_runner.h.
#include "linear_runner.h"

namespace {

// ------------------------------------------------------------------ the option matrix -------
const std::vector<OptionVariant<LinCase>>& option_sets() {
  static const std::vector<OptionVariant<LinCase>> sets = {
      {"plain", [](LinCase&) {}},
      {"no_bias", [](LinCase& c) { c.bias = false; c.gb = false; }},
      {"bias_without_grad_bias", [](LinCase& c) { c.gb = false; }},
      {"ignored_int32_gradoutput_null",
       [](LinCase& c) { c.tdtype = FCE_INT32; c.ignore_frac = 0.3; c.gout = false; }},
      {"weights_label_smoothing",
       [](LinCase& c) { c.weights = true; c.eps = 0.1f; c.ignore_frac = 0.1; }},
      {"zloss", [](LinCase& c) { c.lambda = 1e-3f; }},
      {"softcap_scale", [](LinCase& c) { c.softcap = 10.0f; c.scale = 0.7f; }},
      {"shift", [](LinCase& c) { c.shift = 8; c.N = 40; }},
      {"shift_k2", [](LinCase& c) { c.shift = 8; c.shift_k = 2; c.N = 40; c.ignore_frac = 0.1; }},
      {"shift_k3", [](LinCase& c) { c.shift = 7; c.shift_k = 3; c.N = 35; c.argmax = true; }},
      // Token scaling multiplies each row by its p_y: random targets make it tiny (16-bit
      // gradients of subnormals, outside the bound), so half the rows are confident ones.
      {"token_scaling",
       [](LinCase& c) { c.token_scaling = true; c.confident = true; c.ignore_frac = 0.1; }},
      {"argmax_accuracy",
       [](LinCase& c) { c.argmax = c.accuracy = true; c.confident = true; c.ignore_frac = 0.2; }},
      {"accuracy_only", [](LinCase& c) { c.accuracy = true; c.ignore_frac = 0.2; }},
      {"weights_zloss",  // the z-loss's mean divides by n, the ce's by the sum of weights
       [](LinCase& c) { c.weights = true; c.lambda = 1e-3f; c.ignore_frac = 0.15; }},
      {"hidden_row_stride", [](LinCase& c) { c.h_pad = 5; }},
      {"accumulate", [](LinCase& c) { c.accumulate = true; }},
      {"accumulate_grad_weight_fp32", [](LinCase& c) { c.accumulate = true; c.gw_fp32 = true; }},
      {"grad_weight_fp32", [](LinCase& c) { c.gw_fp32 = true; }},
      {"loss_only", [](LinCase& c) { c.gh = c.gw = c.gb = false; }},
      {"loss_only_no_outputs_but_loss",
       [](LinCase& c) { c.gh = c.gw = c.gb = false; c.lse = c.zloss = c.flags = false; }},
      {"only_grad_hidden", [](LinCase& c) { c.gw = c.gb = false; }},
      {"only_grad_weight", [](LinCase& c) { c.gh = c.gb = false; c.bias = false; }},
      {"only_grad_bias", [](LinCase& c) { c.gh = c.gw = false; }},
      {"workspace_min", [](LinCase& c) { c.ws = kWsMin; c.N = 131; }},
      {"everything",
       [](LinCase& c) {
         c.tdtype = FCE_INT32; c.weights = true; c.eps = 0.05f; c.lambda = 1e-4f;
         c.softcap = 12.0f; c.scale = 1.2f; c.shift = 7; c.N = 35; c.ignore_frac = 0.1;
         c.h_pad = 3; c.accumulate = true; c.ws = kWsMid;
       }},
      {"everything_03",
       [](LinCase& c) {
         c.tdtype = FCE_INT32; c.weights = true; c.eps = 0.05f; c.lambda = 1e-4f;
         c.softcap = 12.0f; c.scale = 1.2f; c.shift = 7; c.shift_k = 2; c.N = 35;
         c.ignore_frac = 0.1; c.h_pad = 3; c.accumulate = true; c.ws = kWsMid;
         c.token_scaling = true; c.confident = true; c.argmax = c.accuracy = true;
       }},
  };
  return sets;
}

class LinearMatrix : public MatrixTest<LinCase> {};

TEST_P(LinearMatrix, MatchesReference) { run_case(GetParam()); }

FCE_OPTION_MATRIX(LinearMatrix, option_matrix(option_sets()));

// ------------------------------------------------------------------ more cases --------------
// Odd D and V, N not a multiple of anything, at the minimum and the optimal workspace.
TEST_F(Linear, OddShapes) {
  struct Shape { int64_t N, D, V; };
  for (Shape s : {Shape{1, 1, 1}, Shape{1, 17, 7}, Shape{3, 1, 1001}, Shape{37, 33, 7},
                  Shape{131, 17, 1001}, Shape{257, 9, 63}})
    for (int dtype : kDtypes)
      for (int ws : {kWsMin, kWsOpt}) {
        LinCase c;
        c.name = "odd_shape";
        c.N = s.N;
        c.D = s.D;
        c.V = s.V;
        c.dtype = dtype;
        c.ws = ws;
        c.eps = 0.1f;
        c.reduction = FCE_REDUCTION_SUM;
        run_case(c);
      }
}

// Any workspace from the minimum up gives the same result (within the bound, bitwise for a
// given size run to run), and each matches the reference.
TEST_F(Linear, WorkspaceSizesAgree) {
  for (int dtype : kDtypes)
    for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_NONE}) {
      LinCase c;
      c.name = "workspace_sizes";
      c.dtype = dtype;
      c.reduction = red;
      c.N = 257;
      c.D = 40;
      c.V = 1001;
      c.weights = true;
      c.eps = 0.1f;
      c.lambda = 1e-4f;
      c.accumulate = true;
      LinRunner r(c);
      size_t mn = 0, op = 0, bytes = 0;
      ASSERT_NO_FATAL_FAILURE(r.workspace_bytes(kWsMin, &bytes, &mn, &op));
      ASSERT_GT(mn, 0u) << "fce_linear_ce_workspace_size: min_bytes 0 (the logits need room)";
      for (int ws : {kWsMin, kWsMid, kWsOpt, kWsMore}) {
        LinOut a, b;
        ASSERT_NO_FATAL_FAILURE(r.run(&a, ws, 0xFF));
        ASSERT_NO_FATAL_FAILURE(r.run(&b, ws, 0x00));
        EXPECT_TRUE(bitwise_equal(a.loss, b.loss, "loss, same workspace size twice"));
        EXPECT_TRUE(bitwise_equal(a.gh, b.gh, "grad_hidden, same workspace size twice"));
        EXPECT_TRUE(bitwise_equal(a.gw, b.gw, "grad_weight, same workspace size twice"));
        EXPECT_TRUE(bitwise_equal(a.gb, b.gb, "grad_bias, same workspace size twice"));
      }
    }
}

// A workspace sweep from the minimum to the optimum: on CUDA it crosses every plan for a 16-bit
// grad_weight (the vocab-sliced plan, token chunks accumulated in grad_weight, one chunk), and
// each must match the float64 reference within the same bound; for a float32 grad_weight the
// token chunks of every size.
TEST_F(Linear, WorkspaceSweepMatchesReference) {
  for (int dtype : kDtypes)
    for (int variant = 0; variant < 2; ++variant)
      for (double frac : {0.0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0}) {
        LinCase c;
        c.name = "workspace_sweep";
        c.dtype = dtype;
        c.N = 1023;
        c.D = 24;
        c.V = 3001;
        c.ws = kWsFrac;
        c.ws_frac = frac;
        c.seed = 7 + variant;
        if (variant == 1) {  // every option that touches the gradient pass
          c.reduction = FCE_REDUCTION_NONE;
          c.weights = true;
          c.eps = 0.1f;
          c.lambda = 1e-4f;
          c.softcap = 15.0f;
          c.scale = 0.9f;
          c.shift = 11;
          c.N = 1023 - 1023 % 11;
          c.ignore_frac = 0.1;
          c.h_pad = 3;
          c.accumulate = true;
        }
        run_case(c);
      }
}

// The smallest workspace cuts the rows into many chunks; dW and db must still be summed in
// float32 across them (docs/semantics.md) and rounded once: 16-bit partial sums over ~1000 chunks
// would miss the bound by a wide margin. (On CUDA the minimum takes the vocab-sliced plan for
// a 16-bit grad_weight: one GEMM over all rows per column slice.)
TEST_F(Linear, ManyChunksAccumulateInFloat32) {
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16})
    for (bool acc : {false, true}) {
      LinCase c;
      c.name = "many_chunks";
      c.dtype = dtype;
      c.N = 1023;
      c.D = 16;
      c.V = 61;
      c.reduction = FCE_REDUCTION_SUM;
      c.accumulate = acc;
      c.ws = kWsMin;
      run_case(c);
    }
}

// ------------------------------------------------------------------ bad input ---------------
// A valid call, mutated one argument at a time: the status, the message naming the argument,
// and every output untouched.
struct LinArgs {
  TestOptions o;
  const TestOptions* opts;
  int64_t rows, hidden, vocab;
  const void *h, *W, *b, *y;
  float *loss, *lse, *zl;
  void *gh, *gw, *gb;
  const float* gout;
  uint32_t* flags;
  void* ws;
  size_t wsb;
};

class LinearBadInput : public BackendTest {
 protected:
  static constexpr int64_t N = 8, D = 12, V = 40;
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    std::mt19937_64 rng(9);
    hidden = Buf(mat(FCE_FLOAT32, N, D));
    write_mat(hidden, mat(FCE_FLOAT32, N, D), random_normal(rng, FCE_FLOAT32, N * D, 1.0));
    hidden.push();
    weight = Buf(mat(FCE_FLOAT32, V, D));
    write_mat(weight, mat(FCE_FLOAT32, V, D), random_normal(rng, FCE_FLOAT32, V * D, 1.0));
    weight.push();
    bias = f32_buf(random_normal(rng, FCE_FLOAT32, V, 1.0));
    targets = targets_buf(random_targets(rng, N, V), FCE_INT64);
    // One arena holds grad_weight and, at a partial overlap, a second grad_hidden.
    arena = Buf(static_cast<size_t>(V * D + N * D) * 4);
    poison_all(arena, FCE_FLOAT32);
    arena.push();
    gh = poisoned(mat(FCE_FLOAT32, N, D));
    gb = poisoned(vec(FCE_FLOAT32, V));
    loss = poisoned(vec(FCE_FLOAT32, 1));
    lse = poisoned(vec(FCE_FLOAT32, N));
    zl = poisoned(vec(FCE_FLOAT32, 1));
    flags = Buf(4, 0xA5);
    flags.push();
    am = poisoned(vec(FCE_INT64, N));
    acc = poisoned(vec(FCE_FLOAT32, N));
    a.o = test_options();
    size_t mn = 0, op = 0;
    ASSERT_EQ(fce_linear_ce_workspace_size(&a.o, N, D, V, 1, &mn, &op), FCE_SUCCESS)
        << fce_last_error();
    ws = workspace_buf(op + 64);  // room for the misaligned-workspace case
    min_bytes = mn;
    a.opts = &a.o;
    a.rows = N, a.hidden = D, a.vocab = V;
    a.h = hidden.ptr(), a.W = weight.ptr(), a.b = bias.ptr(), a.y = targets.ptr();
    a.loss = loss.p<float>(), a.lse = lse.p<float>(), a.zl = zl.p<float>();
    a.gh = gh.ptr(), a.gw = arena.ptr(), a.gb = gb.ptr();
    a.gout = nullptr;
    a.flags = flags.p<uint32_t>();
    a.ws = ws.ptr();
    a.wsb = op;
  }
  fce_status call(const LinArgs& x) {
    return flat::linear_ce(x.opts, x.rows, x.hidden, x.vocab, x.h, x.W, x.b, x.y, x.loss, x.lse,
                         x.zl, x.gh, x.gw, x.gb, x.gout, x.flags, x.ws, x.wsb, test_stream());
  }
  // Runs the mutated call and checks status, message and untouched outputs.
  void expect_rejected(const char* what, fce_status expected, const char* names,
                       const std::function<void(LinArgs&)>& mutate) {
    SCOPED_TRACE(std::string("fce_linear_ce bad input: ") + what);
    LinArgs x = a;
    mutate(x);
    if (x.opts == &a.o) x.opts = &x.o;
    std::vector<const Buf*> outs = {&loss, &lse, &zl, &gh, &arena, &gb, &flags, &hidden, &weight, &bias,
                                    &am, &acc};
    std::vector<std::vector<uint8_t>> before;
    for (const Buf* b : outs) before.push_back(b->mirror());
    fce_status st = call(x);
    EXPECT_EQ(st, expected) << "got " << fce_status_string(st) << " (" << fce_last_error() << ")";
    EXPECT_TRUE(error_mentions(names));
    EXPECT_TRUE(error_mentions("fce_linear_ce"));
    EXPECT_TRUE(finish());
    for (size_t i = 0; i < outs.size(); ++i) {
      Buf* b = const_cast<Buf*>(outs[i]);
      b->pull();
      EXPECT_TRUE(unchanged(*b, before[i], "a buffer of the rejected call"));
    }
  }
  Buf hidden, weight, bias, targets, arena, gh, gb, loss, lse, zl, flags, ws, am, acc;
  size_t min_bytes = 0;
  LinArgs a;
};

TEST_F(LinearBadInput, ValidBaselineSucceeds) {
  LinArgs x = a;
  x.opts = &x.o;
  ASSERT_EQ(call(x), FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
}

// One row: its hidden_row_stride is never used, so any stride >= hidden works, even one past
// INT_MAX (which BLAS and cuBLASLt could not take): the same loss and gradients as dense.
TEST_F(LinearBadInput, OneRowTakesAnyHiddenStride) {
  LinArgs x = a;
  x.opts = &x.o;
  x.rows = 1;
  x.o.reduction = FCE_REDUCTION_SUM;
  x.gw = nullptr, x.gb = nullptr;  // grad_hidden only: compared below
  ASSERT_EQ(call(x), FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
  loss.pull();
  gh.pull();
  const std::vector<uint8_t> dense_loss = loss.mirror(), dense_gh = gh.mirror();
  x.o.hidden_row_stride = int64_t{INT32_MAX} + 5;
  ASSERT_EQ(call(x), FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
  loss.pull();
  gh.pull();
  EXPECT_TRUE(unchanged(loss, dense_loss, "loss with a huge stride of one row"));
  EXPECT_TRUE(unchanged(gh, dense_gh, "grad_hidden with a huge stride of one row"));
}

TEST_F(LinearBadInput, NullPointers) {
  expect_rejected("options NULL", FCE_ERROR_NULL_POINTER, "options", [](LinArgs& x) { x.opts = nullptr; });
  expect_rejected("hidden_states NULL", FCE_ERROR_NULL_POINTER, "hidden_states", [](LinArgs& x) { x.h = nullptr; });
  expect_rejected("weight NULL", FCE_ERROR_NULL_POINTER, "weight", [](LinArgs& x) { x.W = nullptr; });
  expect_rejected("targets NULL", FCE_ERROR_NULL_POINTER, "targets", [](LinArgs& x) { x.y = nullptr; });
  expect_rejected("loss NULL", FCE_ERROR_NULL_POINTER, "loss", [](LinArgs& x) { x.loss = nullptr; });
  if (a.wsb > 0)
    expect_rejected("workspace NULL with bytes", FCE_ERROR_NULL_POINTER, "workspace",
                    [](LinArgs& x) { x.ws = nullptr; });
}

TEST_F(LinearBadInput, Sizes) {
  expect_rejected("rows -1", FCE_ERROR_INVALID_ARGUMENT, "rows", [](LinArgs& x) { x.rows = -1; });
  expect_rejected("hidden 0", FCE_ERROR_INVALID_ARGUMENT, "hidden", [](LinArgs& x) { x.hidden = 0; });
  expect_rejected("hidden -4", FCE_ERROR_INVALID_ARGUMENT, "hidden", [](LinArgs& x) { x.hidden = -4; });
  expect_rejected("vocab 0", FCE_ERROR_INVALID_ARGUMENT, "vocab", [](LinArgs& x) { x.vocab = 0; });
  expect_rejected("vocab -2", FCE_ERROR_INVALID_ARGUMENT, "vocab", [](LinArgs& x) { x.vocab = -2; });
  expect_rejected("hidden_row_stride < hidden", FCE_ERROR_INVALID_ARGUMENT, "hidden_row_stride",
                  [](LinArgs& x) { x.o.hidden_row_stride = D - 1; });
  expect_rejected("hidden_row_stride negative", FCE_ERROR_INVALID_ARGUMENT, "hidden_row_stride",
                  [](LinArgs& x) { x.o.hidden_row_stride = -3; });
  expect_rejected("rows * hidden overflowing", FCE_ERROR_INVALID_ARGUMENT, "rows|hidden|vocab",
                  [](LinArgs& x) { x.rows = int64_t{1} << 40; x.hidden = int64_t{1} << 40; });
}

TEST_F(LinearBadInput, Options) {
  expect_rejected("dtype unknown", FCE_ERROR_INVALID_ARGUMENT, "dtype", [](LinArgs& x) { x.o.dtype = 9; });
  expect_rejected("dtype int32", FCE_ERROR_INVALID_ARGUMENT, "dtype", [](LinArgs& x) { x.o.dtype = FCE_INT32; });
  expect_rejected("target_dtype 5", FCE_ERROR_INVALID_ARGUMENT, "target_dtype",
                  [](LinArgs& x) { x.o.target_dtype = 5; });
  expect_rejected("reduction 3", FCE_ERROR_INVALID_ARGUMENT, "reduction", [](LinArgs& x) { x.o.reduction = 3; });
  expect_rejected("backend 7", FCE_ERROR_INVALID_ARGUMENT, "backend", [](LinArgs& x) { x.o.backend = 7; });
  expect_rejected("label_smoothing 1", FCE_ERROR_INVALID_ARGUMENT, "label_smoothing",
                  [](LinArgs& x) { x.o.label_smoothing = 1.0f; });
  expect_rejected("softcap -1", FCE_ERROR_INVALID_ARGUMENT, "softcap", [](LinArgs& x) { x.o.softcap = -1.0f; });
  expect_rejected("z_loss_scale -1", FCE_ERROR_INVALID_ARGUMENT, "z_loss_scale",
                  [](LinArgs& x) { x.o.z_loss_scale = -1.0f; });
  expect_rejected("logit_scale NaN", FCE_ERROR_INVALID_ARGUMENT, "logit_scale",
                  [](LinArgs& x) { x.o.logit_scale = std::numeric_limits<float>::quiet_NaN(); });
  expect_rejected("shift_seq_len 3 with rows 8", FCE_ERROR_INVALID_ARGUMENT, "shift_seq_len",
                  [](LinArgs& x) { x.o.shift_seq_len = 3; });
  expect_rejected("struct_size too small", FCE_ERROR_INVALID_ARGUMENT, "struct_size",
                  [](LinArgs& x) { x.o.struct_size = 8; });
  expect_rejected("vp_entropy", FCE_ERROR_INVALID_ARGUMENT, "options->vp_entropy", [](LinArgs& x) { x.o.vp_entropy = 1; });
  expect_rejected("struct_size of 0.x", FCE_ERROR_INVALID_ARGUMENT, "struct_size",
                  [](LinArgs& x) { x.o.struct_size = 104; });  // a 0.x struct
  expect_rejected("shift -2", FCE_ERROR_INVALID_ARGUMENT, "options->shift",
                  [](LinArgs& x) { x.o.shift_seq_len = 4; x.o.shift = -2; });
  expect_rejected("shift without shift_seq_len", FCE_ERROR_INVALID_ARGUMENT, "options->shift",
                  [](LinArgs& x) { x.o.shift = 3; });
}

TEST_F(LinearBadInput, ArgmaxAndAccuracy) {
  expect_rejected("outputs->argmax misaligned", FCE_ERROR_MISALIGNED, "outputs->argmax",
                  [this](LinArgs& x) { x.o.argmax = (int64_t*)(am.p<char>() + 4); });
  expect_rejected("outputs->accuracy misaligned", FCE_ERROR_MISALIGNED, "outputs->accuracy",
                  [this](LinArgs& x) { x.o.accuracy = (float*)(acc.p<char>() + 1); });
  expect_rejected("outputs->argmax over grad_hidden", FCE_ERROR_INVALID_ARGUMENT,
                  "outputs->argmax", [](LinArgs& x) { x.o.argmax = static_cast<int64_t*>(x.gh) + 2; });
  expect_rejected("outputs->argmax over weight", FCE_ERROR_INVALID_ARGUMENT, "outputs->argmax",
                  [](LinArgs& x) { x.o.argmax = static_cast<int64_t*>(const_cast<void*>(x.W)); });
  expect_rejected("outputs->accuracy over loss", FCE_ERROR_INVALID_ARGUMENT,
                  "outputs->accuracy", [](LinArgs& x) { x.o.accuracy = x.loss; });
  expect_rejected("outputs->accuracy [rows] (none) over z_loss", FCE_ERROR_INVALID_ARGUMENT,
                  "outputs->accuracy", [](LinArgs& x) {
                    x.o.reduction = FCE_REDUCTION_NONE;
                    x.loss = x.lse;  // [rows] for none
                    x.lse = nullptr;
                    x.o.accuracy = x.zl - 3;
                  });
  expect_rejected("outputs->accuracy inside outputs->argmax", FCE_ERROR_INVALID_ARGUMENT,
                  "outputs->accuracy", [this](LinArgs& x) {
                    x.o.argmax = am.p<int64_t>();
                    x.o.accuracy = reinterpret_cast<float*>(am.p<int64_t>() + 1);
                  });
  // Both given, each its own buffer: fine.
  LinArgs x = a;
  x.opts = &x.o;
  x.o.argmax = am.p<int64_t>();
  x.o.accuracy = acc.p<float>();
  ASSERT_EQ(call(x), FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
}

TEST_F(LinearBadInput, BuffersAndWorkspace) {
  expect_rejected("grad_bias without bias", FCE_ERROR_INVALID_ARGUMENT, "grad_bias",
                  [](LinArgs& x) { x.b = nullptr; });
  size_t mn = min_bytes;
  if (mn > 0) {
    expect_rejected("workspace below min_bytes", FCE_ERROR_WORKSPACE_TOO_SMALL, "workspace",
                    [mn](LinArgs& x) { x.wsb = mn - 1; });
  } else {
    ADD_FAILURE() << "min_bytes is 0: cannot test a too-small workspace";
  }
  expect_rejected("hidden_states misaligned", FCE_ERROR_MISALIGNED, "hidden_states",
                  [](LinArgs& x) { x.h = static_cast<const char*>(x.h) + 1; });
  expect_rejected("weight misaligned", FCE_ERROR_MISALIGNED, "weight",
                  [](LinArgs& x) { x.W = static_cast<const char*>(x.W) + 2; });
  expect_rejected("bias misaligned", FCE_ERROR_MISALIGNED, "bias",
                  [](LinArgs& x) { x.b = static_cast<const char*>(x.b) + 1; });
  expect_rejected("grad_weight misaligned", FCE_ERROR_MISALIGNED, "grad_weight",
                  [](LinArgs& x) { x.gw = static_cast<char*>(x.gw) + 1; });
  if (a.wsb > 0)
    expect_rejected("workspace misaligned", FCE_ERROR_MISALIGNED, "workspace",
                  [](LinArgs& x) { x.ws = static_cast<char*>(x.ws) + 8; });
  expect_rejected("grad_hidden overlapping grad_weight", FCE_ERROR_INVALID_ARGUMENT,
                  "grad_hidden|grad_weight",
                  [](LinArgs& x) { x.gh = static_cast<float*>(x.gw) + V * D - 4; });
  expect_rejected("grad_hidden over hidden_states", FCE_ERROR_INVALID_ARGUMENT,
                  "grad_hidden|hidden_states",
                  [](LinArgs& x) { x.gh = const_cast<void*>(x.h); });
}

}  // namespace
