// test_ce_by_hand.cpp — fce_forward and fce_backward on cases worked out by hand (z-loss mean,
// cancelling weights, token scaling), argmax ties and NaN, shifts by k, concurrent calls,
// workspace queries, and the CUDA-only tests (graph capture, offsets past 2^31). Part of the
// test_ce executable (ce_runner.h).
#include <atomic>
#include <thread>

#include "ce_runner.h"

namespace {

// ------------------------------------------------------------------ by hand -----------------
// Small problems whose expected values are written out here, independently of ref.h.

struct HandOut {
  std::vector<double> loss, lse, z_loss, grad, accuracy;
  std::vector<int64_t> argmax;
};

// fce_forward on dense logits (the dtype of o), every output asked for, upstream NULL (= 1).
HandOut hand_forward(const TestOptions& opts, int64_t N, int64_t V, const std::vector<double>& z,
                     const std::vector<int64_t>& y, const std::vector<double>& weights = {}) {
  HandOut out;
  TestOptions o = opts;
  const bool per_row = o.reduction == FCE_REDUCTION_NONE;
  const Mat lm = mat(o.dtype, N, V), loss_m = vec(FCE_FLOAT32, per_row ? N : 1),
            lse_m = vec(FCE_FLOAT32, N), one = vec(FCE_FLOAT32, 1),
            acc_m = vec(FCE_FLOAT32, per_row ? N : 1), am_m = vec(FCE_INT64, N);
  Buf logits(lm);
  write_mat(logits, lm, z);
  logits.push();
  Buf targets = targets_buf(y, o.target_dtype);
  Buf w = weights.empty() ? Buf() : f32_buf(weights);
  Buf loss = poisoned(loss_m), lse = poisoned(lse_m), zl = poisoned(one), grad = poisoned(lm),
      acc = poisoned(acc_m), am = poisoned(am_m);
  o.class_weights = w.p<float>();
  o.argmax = am.p<int64_t>();
  o.accuracy = acc.p<float>();
  size_t wsb = 0;
  EXPECT_EQ(fce_forward_workspace_size(&o, N, V, &wsb), FCE_SUCCESS) << fce_last_error();
  Buf ws = workspace_buf(wsb);
  const fce_status st =
      flat::forward(&o, N, V, logits.ptr(), targets.ptr(), loss.p<float>(), lse.p<float>(),
                  zl.p<float>(), grad.ptr(), nullptr, nullptr, ws.ptr(), wsb, test_stream());
  EXPECT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
  EXPECT_TRUE(finish());
  for (Buf* b : {&loss, &lse, &zl, &grad, &acc, &am}) b->pull();
  out.loss = read_mat(loss, loss_m);
  out.lse = read_mat(lse, lse_m);
  out.z_loss = read_mat(zl, one);
  out.grad = read_mat(grad, lm);
  out.accuracy = read_mat(acc, acc_m);
  out.argmax = read_i64(am, N);
  return out;
}

// Class weights and z-loss under mean (docs/semantics.md rules 5-7): the cross-entropy is divided by
// D = sum of the weights of the targets, the z-loss by n = the number of non-ignored rows
// (Liger's normalisation). Constant rows of V = 4: lse = log 4, each ce = w log 4.
TEST_F(Ce, ZLossMeanDividesByRowCount) {
  const int64_t N = 3, V = 4;
  const double lam = 0.01, w = 2.0, L = std::log(4.0);
  TestOptions o = test_options();
  o.z_loss_scale = static_cast<float>(lam);
  o.reduction = FCE_REDUCTION_MEAN;
  const std::vector<int64_t> y = {1, 2, -100};  // n = 2, D = 2 w = 4
  HandOut h = hand_forward(o, N, V, std::vector<double>(N * V, 0.0), y, std::vector<double>(V, w));
  const double lamf = static_cast<float>(lam);
  const double mean = (2 * w * L) / (2 * w) + (2 * lamf * L * L) / 2;  // = L + λ L²
  EXPECT_TRUE(close_scalar(h.loss[0], mean, 1e-6, "mean loss"));
  EXPECT_TRUE(close_scalar(h.z_loss[0], lamf * L * L, 1e-6, "z_loss total (mean: / n)"));
  // Gradient: k = 1/D = 1/4 on w (p − [j = y]), k_z = 1/n = 1/2 on 2 λ lse p, p = 1/4.
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t j = 0; j < V; ++j) {
      const double want = 0.25 * w * (0.25 - (j == y[static_cast<size_t>(r)] ? 1.0 : 0.0)) +
                          0.5 * 2 * lamf * L * 0.25;
      EXPECT_NEAR(h.grad[static_cast<size_t>(r * V + j)], want, 1e-6) << "row " << r << " col " << j;
    }
  for (int64_t j = 0; j < V; ++j) EXPECT_EQ(h.grad[static_cast<size_t>(2 * V + j)], 0.0);
  // sum: plain sums; z_loss total likewise.
  o.reduction = FCE_REDUCTION_SUM;
  h = hand_forward(o, N, V, std::vector<double>(N * V, 0.0), y, std::vector<double>(V, w));
  EXPECT_TRUE(close_scalar(h.loss[0], 2 * (w * L + lamf * L * L), 1e-6, "sum loss"));
  EXPECT_TRUE(close_scalar(h.z_loss[0], 2 * lamf * L * L, 1e-6, "z_loss total (sum)"));
}

// Class weights whose sum over the counted rows is 0 or negative (docs/semantics.md rules 4-6).
// D = 0 with a finite sum: the zero-divisor rule (0); D = 0 with an invalid row: NaN (the NaN
// sum stays); D < 0 (negative weights): the quotient as it is, k = g / D in the gradient.
TEST_F(Ce, MeanWithCancellingOrNegativeWeights) {
  const int64_t N = 3, V = 4;
  const double L = std::log(4.0);  // every row's nll: zero logits
  TestOptions o = test_options();
  o.reduction = FCE_REDUCTION_MEAN;
  const std::vector<double> z(N * V, 0.0);
  // targets 0 (ω = 1) and 1 (ω = -1), one ignored row: D = 0, Σ ω nll = 0
  HandOut h = hand_forward(o, N, V, z, {0, 1, -100}, {1.0, -1.0, 1.0, 1.0});
  EXPECT_EQ(h.loss[0], 0.0) << "D = 0, finite sum";
  // targets 0 (ω = 1), 1 (ω = -2) and an invalid row (counts 1): D = 0, the sum NaN
  h = hand_forward(o, N, V, z, {0, 1, V}, {1.0, -2.0, 1.0, 1.0});
  EXPECT_TRUE(std::isnan(h.loss[0])) << "D = 0 with an invalid row: " << h.loss[0];
  // every weight -1: D = -3, Σ ω nll = -3 L: the mean is L; k = 1/D, ∂z = k ω (p − e_y)
  h = hand_forward(o, N, V, z, {0, 1, 2}, std::vector<double>(V, -1.0));
  EXPECT_TRUE(close_scalar(h.loss[0], L, 1e-6, "negative D"));
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = 0; j < V; ++j) {
      const double want = (-1.0 / 3.0) * -1.0 * (0.25 - (j == r ? 1.0 : 0.0));
      EXPECT_NEAR(h.grad[static_cast<size_t>(r * V + j)], want, 1e-6) << "row " << r << " col " << j;
    }
}

// Token scaling (docs/semantics.md rules 8, 9) on V = 2: p_y = t, loss = t (−log t), gradient t (p − e_y),
// t a constant. Rows: logits (0, log 3) → p = (1/4, 3/4), target 1 (t = 3/4) and target 0
// (t = 1/4).
TEST_F(Ce, TokenScalingByHand) {
  const int64_t N = 2, V = 2;
  const double l3 = static_cast<float>(std::log(3.0));  // what the float32 logits hold
  const double p1 = 1.0 / (1.0 + std::exp(-l3)), p0 = 1.0 - p1;
  TestOptions o = test_options();
  o.token_scaling = 1;
  o.reduction = FCE_REDUCTION_NONE;
  HandOut h = hand_forward(o, N, V, {0.0, l3, 0.0, l3}, {1, 0});
  EXPECT_TRUE(close_scalar(h.loss[0], p1 * -std::log(p1), 1e-6, "row 0 loss"));
  EXPECT_TRUE(close_scalar(h.loss[1], p0 * -std::log(p0), 1e-6, "row 1 loss"));
  EXPECT_NEAR(h.grad[0], p1 * p0, 1e-7);
  EXPECT_NEAR(h.grad[1], p1 * (p1 - 1), 1e-7);
  EXPECT_NEAR(h.grad[2], p0 * (p0 - 1), 1e-7);
  EXPECT_NEAR(h.grad[3], p0 * p1, 1e-7);
  // With z-loss λ: each row's λ lse² is scaled by its t too, and so is its gradient 2 λ lse p.
  o.z_loss_scale = 0.5f;
  o.reduction = FCE_REDUCTION_SUM;
  h = hand_forward(o, N, V, {0.0, l3, 0.0, l3}, {1, 0});
  const double lse = std::log(1.0 + std::exp(l3));
  const double zl = 0.5 * lse * lse;
  EXPECT_TRUE(close_scalar(h.z_loss[0], (p1 + p0) * zl, 1e-6, "z_loss total"));
  EXPECT_TRUE(close_scalar(h.loss[0], p1 * (-std::log(p1) + zl) + p0 * (-std::log(p0) + zl), 1e-6,
                           "sum loss"));
  EXPECT_NEAR(h.grad[1], p1 * ((p1 - 1) + 2 * 0.5 * lse * p1), 1e-6);
}

// Argmax and accuracy corners (docs/semantics.md rule 15), in every dtype (each value below is exact in
// float16 and bfloat16): equal maxima → the lowest index; a NaN counts as the largest (the
// first NaN); a row of −inf → 0; an ignored row → −1; accuracy over the n non-ignored rows.
TEST_F(Ce, ArgmaxTiesAndNaN) {
  const double inf = HUGE_VAL, nan = std::numeric_limits<double>::quiet_NaN();
  const int64_t N = 5, V = 6;
  const std::vector<double> z = {
      1, 3, 3, 2, 3, 0,                  // row 0: ties at 1, 2, 4 → 1 (target 1: correct)
      -inf, -inf, -inf, -inf, -inf, -inf,  // row 1: → 0 (target 2)
      0, 1, nan, 5, nan, 1,              // row 2: the first NaN → 2 (target 3)
      9, 8, 7, 6, 5, 4,                  // row 3: ignored → −1
      5, -inf, 7, 7, 1, 7};              // row 4: → 2 (target 2: correct)
  const std::vector<int64_t> y = {1, 2, 3, -100, 2};
  for (int dtype : kDtypes)
    for (int red : kReductions) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + reduction_name(red));
      TestOptions o = test_options();
      o.dtype = dtype;
      o.reduction = red;
      HandOut h = hand_forward(o, N, V, z, y);
      EXPECT_EQ(h.argmax, (std::vector<int64_t>{1, 0, 2, -1, 2}));
      if (red == FCE_REDUCTION_NONE) {
        EXPECT_EQ(h.accuracy, (std::vector<double>{1, 0, 0, 0, 1}));
      } else {
        EXPECT_EQ(h.accuracy, (std::vector<double>{0.5}));  // 2 of the n = 4 non-ignored rows
      }
      // The NaN row: NaN loss, lse and gradient; the −inf row: lse −inf, loss NaN.
      EXPECT_TRUE(std::isnan(h.lse[2]));
      EXPECT_EQ(h.lse[1], -inf);
      for (int64_t j = 0; j < V; ++j) EXPECT_TRUE(std::isnan(h.grad[static_cast<size_t>(2 * V + j)]));
      if (red == FCE_REDUCTION_NONE) {
        EXPECT_TRUE(std::isnan(h.loss[1]));
        EXPECT_TRUE(std::isnan(h.loss[2]));
        EXPECT_EQ(h.loss[3], 0.0);
        EXPECT_TRUE(std::isfinite(h.loss[0]) && std::isfinite(h.loss[4]));
      } else {
        EXPECT_TRUE(std::isnan(h.loss[0]));
      }
    }
}

// The same corners on long rows, whose later vectors a register-path CTA on sm_90 may hold in
// shared memory rather than registers (ce_kernels.cu, SMEM): the argmax scan of a row with a NaN
// or +inf reads both, and the first NaN / the first maximum must win wherever they sit.
TEST_F(Ce, ArgmaxNaNOnLongRows) {
  const double inf = HUGE_VAL, nan = std::numeric_limits<double>::quiet_NaN();
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (int64_t V : {int64_t{151936}, int64_t{300001}}) {
      if (dtype == FCE_FLOAT32 && V == 300001) continue;  // 1.2 MB rows: the two-pass kernel
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " V=" + std::to_string(V));
      const int64_t N = 4;
      std::vector<double> z(static_cast<size_t>(N * V));
      for (int64_t r = 0; r < N; ++r)
        for (int64_t j = 0; j < V; ++j) z[static_cast<size_t>(r * V + j)] = double((j * 7 + r) % 13) - 6;
      auto at = [&](int64_t r, int64_t j) -> double& { return z[static_cast<size_t>(r * V + j)]; };
      const int64_t late = V - 11, later = V - 3, mid = V * 3 / 5;
      at(0, late) = nan;  // row 0: a NaN near the row's end only → late
      at(1, later) = nan;  // row 1: two NaNs → the first, mid
      at(1, mid) = nan;
      at(2, late) = inf;  // row 2: +inf twice → the first, mid
      at(2, mid) = inf;
      at(3, later) = 100;  // row 3: one largest value near the end (no scan) → later
      const std::vector<int64_t> y = {0, 1, mid, later};
      TestOptions o = test_options();
      o.dtype = dtype;
      o.reduction = FCE_REDUCTION_NONE;
      HandOut h = hand_forward(o, N, V, z, y);
      EXPECT_EQ(h.argmax, (std::vector<int64_t>{late, mid, mid, later}));
      EXPECT_EQ(h.accuracy, (std::vector<double>{0, 0, 1, 1}));
      EXPECT_TRUE(std::isnan(h.lse[0]) && std::isnan(h.lse[1]));
    }
}

// Shift by k (docs/semantics.md rule 1): row b T + t is scored against target b T + t + k, rows t >= T − k
// are ignored, and targets of the first k positions of each sequence are never read (garbage
// there sets no flag). k >= T ignores every row.
TEST_F(Ce, ShiftByKReadsOnlyItsTargets) {
  for (int64_t k : {int64_t{1}, int64_t{2}, int64_t{3}})
    for (int red : kReductions) {
      CeCase c;
      c.name = "shift_k_unread_targets";
      c.reduction = red;
      c.N = 24;
      c.V = 50;
      c.shift = 6;
      c.shift_k = k;
      c.argmax = c.accuracy = true;
      c.edit = [](const CeCase& cc, std::vector<double>&, std::vector<int64_t>& y) {
        for (int64_t r = 0; r < cc.N; ++r)
          if (r % cc.shift < cc.shift_k) y[static_cast<size_t>(r)] = 1000000 + r;  // never read
      };
      CeRunner run(c);
      ASSERT_FALSE(run.any_invalid());
      for (int64_t r = 0; r < c.N; ++r)
        ASSERT_EQ(run.ref().kind[static_cast<size_t>(r)] == fceref::kIgnored,
                  r % c.shift >= c.shift - k) << "row " << r;
      CeOut out;
      ASSERT_NO_FATAL_FAILURE(run.forward(&out));
      ASSERT_NO_FATAL_FAILURE(run.backward(false, &out.grad));
      // One that is read (position k of sequence 1, read by its row 0) makes that row invalid.
      c.edit = [](const CeCase& cc, std::vector<double>&, std::vector<int64_t>& y) {
        y[static_cast<size_t>(cc.shift + cc.shift_k)] = cc.V;
      };
      CeRunner run2(c);
      ASSERT_EQ(run2.ref().kind[static_cast<size_t>(c.shift)], fceref::kInvalid);
      ASSERT_NO_FATAL_FAILURE(run2.forward());
    }
  for (int64_t k : {int64_t{6}, int64_t{7}, int64_t{1} << 40}) {
    CeCase c;
    c.name = "shift_k_at_least_T";
    c.N = 12;
    c.V = 30;
    c.shift = 6;
    c.shift_k = k;
    c.lambda = 1e-3f;
    c.argmax = c.accuracy = true;
    run_case(c);
  }
}

// Several threads calling at once, each with its own buffers, give what one thread gives.
TEST_F(Ce, ConcurrentCallsFromThreads) {
  const int kThreads = 4;
  std::vector<CeOut> serial(kThreads), parallel(kThreads);
  std::vector<std::unique_ptr<CeRunner>> runs;
  for (int t = 0; t < kThreads; ++t) {
    CeCase c;
    c.name = "threads";
    c.seed = 100 + t;
    c.N = 64;
    c.V = 1000;
    c.eps = 0.1f;
    c.dtype = kDtypes[t % 3];
    runs.emplace_back(new CeRunner(c));
    ASSERT_NO_FATAL_FAILURE(runs.back()->forward(&serial[t]));
  }
  std::vector<std::thread> th;
  for (int t = 0; t < kThreads; ++t)
    th.emplace_back([&, t] { runs[t]->forward(&parallel[t]); });
  for (auto& x : th) x.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_TRUE(bitwise_equal(serial[t].loss, parallel[t].loss, "loss"));
    EXPECT_TRUE(bitwise_equal(serial[t].grad, parallel[t].grad, "grad_logits"));
  }
}

// The workspace query answers for every option set, and repeated queries agree.
TEST_F(Ce, WorkspaceQueryIsStable) {
  TestOptions o = test_options();
  size_t a = 1, b = 2;
  ASSERT_EQ(fce_forward_workspace_size(&o, 1000, 50257, &a), FCE_SUCCESS) << fce_last_error();
  ASSERT_EQ(fce_forward_workspace_size(&o, 1000, 50257, &b), FCE_SUCCESS) << fce_last_error();
  EXPECT_EQ(a, b);
  ASSERT_EQ(fce_backward_workspace_size(&o, 1000, 50257, &a), FCE_SUCCESS) << fce_last_error();
  ASSERT_EQ(fce_backward_workspace_size(&o, 1000, 50257, &b), FCE_SUCCESS) << fce_last_error();
  EXPECT_EQ(a, b);
}

// ------------------------------------------------------------------ CUDA only ---------------
#if FCE_TEST_HAVE_CUDA
// fce_forward (with the gradient) captured into a CUDA graph, replayed: the same bits as the
// eager call; grad_output read through its pointer at replay time.
TEST_F(Ce, CudaGraphCapture) {
  if (!on_cuda()) {
    std::printf("SKIPPED: graph capture is a CUDA backend test (FCE_TEST_BACKEND=cuda)\n");
    GTEST_SKIP() << "CUDA backend only";
  }
  CeCase c;
  c.name = "graph";
  c.N = 64;
  c.V = 1000;
  c.weights = true;
  c.eps = 0.1f;
  c.lambda = 1e-3f;
  c.softcap = 30.0f;
  c.ignore_frac = 0.1;
  CeData d = make_data(c);
  auto ref = fceref::cross_entropy(ref_options(c, d), c.N, c.V, d.z, d.y, &d.g, true);
  TestOptions o = test_options();
  o.reduction = c.reduction;
  o.label_smoothing = c.eps;
  o.z_loss_scale = c.lambda;
  o.softcap = c.softcap;
  Mat lm = mat(FCE_FLOAT32, c.N, c.V);
  Buf logits(lm);
  write_mat(logits, lm, d.z);
  logits.push();
  Buf targets = targets_buf(d.y, FCE_INT64), weights = f32_buf(d.w), gout = f32_buf(d.g);
  o.class_weights = weights.p<float>();
  Mat one = vec(FCE_FLOAT32, 1), lse_m = vec(FCE_FLOAT32, c.N);
  Buf loss = poisoned(one), zl = poisoned(one), lse = poisoned(lse_m), grad = poisoned(lm);
  Buf flags(4, 0);
  size_t wsb = 0;
  ASSERT_EQ(fce_forward_workspace_size(&o, c.N, c.V, &wsb), FCE_SUCCESS);
  Buf ws = workspace_buf(wsb);
  auto call = [&] {
    return flat::forward(&o, c.N, c.V, logits.ptr(), targets.ptr(), loss.p<float>(),
                       lse.p<float>(), zl.p<float>(), grad.ptr(), gout.p<float>(),
                       flags.p<uint32_t>(), ws.ptr(), wsb, test_stream());
  };
  ASSERT_EQ(call(), FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
  for (Buf* b : {&loss, &zl, &lse, &grad}) b->pull();
  EXPECT_TRUE(close_scalar(read_mat(loss, one)[0], ref.loss, 1e-5, "eager loss"));
  EXPECT_TRUE(close_normwise(read_mat(grad, lm), ref.grad, 1e-5, "eager grad"));
  auto e_loss = loss.mirror(), e_zl = zl.mirror(), e_lse = lse.mirror(), e_grad = grad.mirror();

  // Poison again, then capture (nothing runs during capture).
  for (Buf* b : {&loss, &zl, &lse}) poison_all(*b, FCE_FLOAT32), b->push();
  poison_mat(grad, lm);
  grad.push();
  CapturedGraph graph;
  ASSERT_TRUE(graph.capture(call));
  for (Buf* b : {&loss, &zl, &lse, &grad}) b->pull();  // nothing ran during capture
  EXPECT_FALSE(all_written(loss, one, "loss")) << "fce_forward ran during capture";
  ASSERT_TRUE(graph.launch());
  ASSERT_TRUE(finish());
  for (Buf* b : {&loss, &zl, &lse, &grad}) b->pull();
  EXPECT_TRUE(bitwise_equal(loss.mirror(), e_loss, "graph vs eager loss"));
  EXPECT_TRUE(bitwise_equal(zl.mirror(), e_zl, "graph vs eager z_loss"));
  EXPECT_TRUE(bitwise_equal(lse.mirror(), e_lse, "graph vs eager lse"));
  EXPECT_TRUE(bitwise_equal(grad.mirror(), e_grad, "graph vs eager grad"));

  // Replay with another upstream value written into grad_output: the gradient follows it.
  std::vector<double> g2 = {2.0};
  put(FCE_FLOAT32, gout.h(), 2.0);
  gout.push();
  ASSERT_TRUE(graph.launch());
  ASSERT_TRUE(finish());
  grad.pull();
  auto ref2 = fceref::cross_entropy(ref_options(c, d), c.N, c.V, d.z, d.y, &g2, true);
  EXPECT_TRUE(close_normwise(read_mat(grad, lm), ref2.grad, 1e-5, "graph replay, grad_output=2"));
}

// rows * V > 2^31: 16385 x 131072 bfloat16 (4.3 GB), in-place gradient; the last rows checked.
// Gated by FCE_TEST_LARGE=1 (about 5 GB of device memory).
TEST_F(Ce, CudaLargeOffsets) {
  if (!on_cuda()) {
    std::printf("SKIPPED: large-offset test runs on the CUDA backend only\n");
    GTEST_SKIP() << "CUDA backend only";
  }
  const char* large = std::getenv("FCE_TEST_LARGE");
  if (!large || std::string(large) != "1") {
    std::printf("SKIPPED: set FCE_TEST_LARGE=1 to run (needs ~5 GB of device memory)\n");
    GTEST_SKIP() << "FCE_TEST_LARGE != 1";
  }
  const int64_t N = 16385, V = 131072, P = 64;  // rows repeat a pool of P, the last 3 unique
  ASSERT_GT(N * V, int64_t{1} << 31);
  const int dt = FCE_BFLOAT16;
  std::mt19937_64 rng(2024);
  std::vector<double> pool = random_logits(rng, dt, P, V, 1.0, 8.0, 5.0);
  std::vector<double> tail = random_logits(rng, dt, 3, V, 2.0, 10.0, 5.0);
  std::vector<int64_t> y = random_targets(rng, N, V, 0.05);
  y[N - 1] = V - 1;  // the very last element of the tensor is a target
  y[N - 2] = 0;
  y[N - 3] = V / 2;
  auto row_values = [&](int64_t r) -> const double* {
    return r >= N - 3 ? &tail[static_cast<size_t>((r - (N - 3)) * V)]
                      : &pool[static_cast<size_t>((r % P) * V)];
  };
  // Device buffers: logits (+ a guard after), targets, loss, lse.
  const size_t lbytes = static_cast<size_t>(N * V) * 2;
  uint8_t* dlog = nullptr;
  ASSERT_EQ(cudaMalloc(&dlog, lbytes + kGuard), cudaSuccess) << "needs ~4.3 GB";
  std::vector<uint16_t> chunk(static_cast<size_t>(P * V));
  for (int64_t i = 0; i < P * V; ++i) chunk[static_cast<size_t>(i)] = f32_to_bf16(static_cast<float>(pool[static_cast<size_t>(i)]));
  for (int64_t r0 = 0; r0 < N; r0 += P) {
    int64_t n = std::min(P, N - r0);
    ASSERT_EQ(cudaMemcpy(dlog + static_cast<size_t>(r0 * V) * 2, chunk.data(),
                         static_cast<size_t>(n * V) * 2, cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<uint16_t> tail16(static_cast<size_t>(3 * V));
  for (size_t i = 0; i < tail16.size(); ++i) tail16[i] = f32_to_bf16(static_cast<float>(tail[i]));
  ASSERT_EQ(cudaMemcpy(dlog + static_cast<size_t>((N - 3) * V) * 2, tail16.data(),
                       tail16.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  std::vector<uint8_t> guard(kGuard, kGuardByte);
  ASSERT_EQ(cudaMemcpy(dlog + lbytes, guard.data(), kGuard, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Buf targets = targets_buf(y, FCE_INT64);
  Mat nm = vec(FCE_FLOAT32, N), one = vec(FCE_FLOAT32, 1);
  Buf loss_sum = poisoned(one), loss_rows = poisoned(nm), lse = poisoned(nm);
  Buf flags(4, 0);

  // Reference per row: rows of the pool share lse; loss_r = lse - z[y_r].
  fceref::Options ro;
  ro.reduction = fceref::kNone;
  std::vector<int64_t> ypool(static_cast<size_t>(P), 0);
  auto pool_ref = fceref::cross_entropy(ro, P, V, pool, ypool, nullptr, false);
  std::vector<double> ref_lse(static_cast<size_t>(N)), ref_loss(static_cast<size_t>(N));
  std::vector<int64_t> ytail(y.end() - 3, y.end());
  auto tail_ref = fceref::cross_entropy(ro, 3, V, tail, ytail, nullptr, true);
  double ref_sum = 0;
  for (int64_t r = 0; r < N; ++r) {
    double l = r >= N - 3 ? tail_ref.lse[static_cast<size_t>(r - (N - 3))] : pool_ref.lse[static_cast<size_t>(r % P)];
    ref_lse[static_cast<size_t>(r)] = l;
    int64_t t = y[static_cast<size_t>(r)];
    double lr = t == -100 ? 0.0 : l - row_values(r)[t];
    ref_loss[static_cast<size_t>(r)] = lr;
    ref_sum += lr;
  }
  const double tol = tolerance(dt);

  // 1) sum with lse, no gradient.
  TestOptions o = test_options();
  o.dtype = dt;
  o.reduction = FCE_REDUCTION_SUM;
  size_t wsb = 0;
  ASSERT_EQ(fce_forward_workspace_size(&o, N, V, &wsb), FCE_SUCCESS) << fce_last_error();
  Buf ws = workspace_buf(wsb);
  fce_status st = flat::forward(&o, N, V, dlog, targets.ptr(), loss_sum.p<float>(), lse.p<float>(),
                              nullptr, nullptr, nullptr, flags.p<uint32_t>(), ws.ptr(), wsb,
                              test_stream());
  ASSERT_EQ(st, FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
  loss_sum.pull();
  lse.pull();
  EXPECT_TRUE(all_written(lse, nm, "lse"));
  std::vector<double> lse_all = read_mat(lse, nm);
  std::vector<double> lse_last(lse_all.end() - 3, lse_all.end());
  EXPECT_TRUE(close_normwise(lse_all, ref_lse, tol, "lse (all rows)"));
  EXPECT_TRUE(close_normwise(lse_last, tail_ref.lse, tol, "lse (last 3 rows)"));
  EXPECT_TRUE(close_scalar(read_mat(loss_sum, one)[0], ref_sum, tol, "sum loss"));

  // 2) none, in-place gradient.
  o.reduction = FCE_REDUCTION_NONE;
  o.row_stride = V;
  o.grad_row_stride = V;
  ASSERT_EQ(fce_forward_workspace_size(&o, N, V, &wsb), FCE_SUCCESS) << fce_last_error();
  Buf ws2 = workspace_buf(wsb);
  st = flat::forward(&o, N, V, dlog, targets.ptr(), loss_rows.p<float>(), nullptr, nullptr, dlog,
                   nullptr, flags.p<uint32_t>(), ws2.ptr(), wsb, test_stream());
  ASSERT_EQ(st, FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
  loss_rows.pull();
  flags.pull();
  EXPECT_TRUE(all_written(loss_rows, nm, "loss"));
  std::vector<double> loss_all = read_mat(loss_rows, nm);
  EXPECT_TRUE(close_normwise(loss_all, ref_loss, tol, "loss (all rows)"));
  std::vector<double> loss_last(loss_all.end() - 3, loss_all.end());
  EXPECT_TRUE(close_normwise(loss_last, tail_ref.row_loss, tol, "loss (last 3 rows)"));
  std::vector<uint16_t> back(static_cast<size_t>(3 * V));
  ASSERT_EQ(cudaMemcpy(back.data(), dlog + static_cast<size_t>((N - 3) * V) * 2, back.size() * 2,
                       cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<double> gl(back.size());
  for (size_t i = 0; i < back.size(); ++i) gl[i] = bf16_to_f32(back[i]);
  for (int r = 0; r < 3; ++r) {
    std::vector<double> a(gl.begin() + r * V, gl.begin() + (r + 1) * V);
    std::vector<double> b(tail_ref.grad.begin() + r * V, tail_ref.grad.begin() + (r + 1) * V);
    EXPECT_TRUE(close_normwise(a, b, tol, "grad row " + std::to_string(N - 3 + r)));
  }
  ASSERT_EQ(cudaMemcpy(guard.data(), dlog + lbytes, kGuard, cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < kGuard; ++i)
    if (guard[i] != kGuardByte) {
      ADD_FAILURE() << "byte " << i << " after the logits was overwritten";
      break;
    }
  uint32_t f;
  std::memcpy(&f, flags.h(), 4);
  EXPECT_EQ(f, 0u);
  cudaFree(dlog);
}
#endif  // FCE_TEST_HAVE_CUDA

}  // namespace
