// test_linear_plans.cpp — fce_linear_ce through each CUDA plan (vocab-sliced, token chunks, one
// chunk) crossed with the gradient sets and workspaces, a workspace one byte short, out-of-range
// and ignored targets, determinism, agreement with fce_forward on the materialised logits, and
// the CUDA graph captures. Part of the test_linear_ce executable (linear_runner.h).
#include "linear_runner.h"

namespace {

// ------------------------------------------------------------------ plans -------------------
// Problems that take fce_linear_ce through each of its plans, crossed with the gradient sets
// and the workspace sizes. On CUDA (lib/cuda/linear_ce.cu; min / mid / optimal):
//   300 x 100 x 1000, hidden_row_stride 103 (rows 2-byte aligned in 16 bits): 3 token chunks of
//     128 rows at the minimum for loss only and a float32 grad_weight, the vocab-sliced plan
//     there for a 16-bit grad_weight and for grad_hidden only; one chunk at mid and optimal;
//   5000 x 32 x 64: more rows than a full-speed chunk (4096): 2 balanced chunks of 2560 even at
//     the optimum for loss only and a float32 grad_weight (40 of 128 at the minimum); a 16-bit
//     grad_weight may take one chunk only (3·V / N < 1 chunks, linear_plan.cuh): the
//     vocab-sliced plan at the minimum, one chunk above;
//   64 x 256 x 3000: fewer rows than 128: one chunk (the vocab-sliced plan at the minimum for a
//     16-bit grad_weight and for grad_hidden only).
// On the CPU: chunks of 1024 rows (5 at 5000 rows), in host memory below the optimum.
struct PlanShape {
  int64_t N, D, V, h_pad;
};
const PlanShape kPlanShapes[] = {{300, 100, 1000, 3}, {5000, 32, 64, 0}, {64, 256, 3000, 0}};

// Three option sets, one per reduction: mean with a bias and a scalar grad_output; sum with
// every option of the per-row math, no bias, grad_output NULL; none with a shift and a per-row
// grad_output. A tenth of the targets ignored.
const char* const kPlanOptionNames[] = {"mean_bias", "sum_all_options", "none_shift"};

LinCase plan_case(int dtype, const PlanShape& s, int option_set, uint64_t seed) {
  LinCase c;
  c.name = std::string("plans_") + kPlanOptionNames[option_set];
  c.dtype = dtype;
  c.N = s.N;
  c.D = s.D;
  c.V = s.V;
  c.h_pad = s.h_pad;
  c.ignore_frac = 0.1;
  c.seed = seed;
  switch (option_set) {
    case 0:
      c.reduction = FCE_REDUCTION_MEAN;
      break;
    case 1:
      c.reduction = FCE_REDUCTION_SUM;
      c.bias = c.gb = c.gout = false;
      c.eps = 0.1f;
      c.lambda = 1e-3f;
      c.softcap = 20.0f;
      c.scale = 0.8f;
      c.weights = true;
      break;
    default:
      c.reduction = FCE_REDUCTION_NONE;
      c.eps = 0.05f;
      c.lambda = 1e-3f;
      c.shift = 4;
      break;
  }
  return c;
}

// The gradient sets (LinRunner::set_gradients; grad_bias where there is a bias).
struct GradSet {
  const char* name;
  bool gh, gw, gb, accumulate, gw_fp32;
};
const GradSet kGradSets[] = {
    {"loss_only", false, false, false, false, false},
    {"all", true, true, true, false, false},
    {"all_accumulate", true, true, true, true, false},
    {"all_accumulate_grad_weight_fp32", true, true, true, true, true},
    {"all_grad_weight_fp32", true, true, true, false, true},
    {"grad_hidden_only", true, false, false, false, false},
};
// grad_weight_fp32 is what a float32 dtype does anyway.
bool applies(const GradSet& g, int dtype) { return !(g.gw_fp32 && dtype == FCE_FLOAT32); }

std::string plan_trace(int dtype, const PlanShape& s, const GradSet& g, int ws) {
  std::ostringstream o;
  o << dtype_name(dtype) << " " << s.N << "x" << s.D << "x" << s.V << " " << g.name
    << " workspace=" << ws_name(ws);
  return o.str();
}

// Every output of two calls, bit for bit.
void expect_same_bits(const LinOut& a, const LinOut& b, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_TRUE(bitwise_equal(a.loss, b.loss, "loss"));
  EXPECT_TRUE(bitwise_equal(a.lse, b.lse, "lse"));
  EXPECT_TRUE(bitwise_equal(a.zloss, b.zloss, "z_loss"));
  EXPECT_TRUE(bitwise_equal(a.gh, b.gh, "grad_hidden"));
  EXPECT_TRUE(bitwise_equal(a.gw, b.gw, "grad_weight"));
  EXPECT_TRUE(bitwise_equal(a.gb, b.gb, "grad_bias"));
}

// Each plan, with each gradient set (loss only, all of them overwritten or accumulated, a
// float32 grad_weight for a 16-bit dtype, grad_hidden only) at the minimum, a middle and the
// optimal workspace: within the bound of the reference, and the same bits when run again (the
// workspace's garbage changed in between). The option sets take turns over dtypes and shapes
// (each shape and each dtype meets each set once): one float64 reference per dtype and shape.
TEST_F(Linear, PlansByGradientsAndWorkspace) {
  for (int di = 0; di < 3; ++di)
    for (int si = 0; si < 3; ++si) {
      const int dtype = kDtypes[di];
      const PlanShape& s = kPlanShapes[si];
      LinRunner r(plan_case(dtype, s, (di + si) % 3, 1234 + static_cast<uint64_t>(si)));
      r.options().deterministic = 1;
      for (const GradSet& g : kGradSets) {
        if (!applies(g, dtype)) continue;
        r.set_gradients(g.gh, g.gw, g.gb, g.accumulate, g.gw_fp32);
        for (int ws : {kWsMin, kWsMid, kWsOpt}) {
          SCOPED_TRACE(plan_trace(dtype, s, g, ws));
          LinOut a, b;
          ASSERT_NO_FATAL_FAILURE(r.run(&a, ws, 0xFF));
          ASSERT_NO_FATAL_FAILURE(r.run(&b, ws, 0x00));
          expect_same_bits(a, b, "the same workspace size twice");
        }
      }
    }
}

// One byte short of min_bytes is refused for each gradient set (its own query: on CUDA the
// minimum of a 16-bit grad_weight is the vocab-sliced plan's, that of loss only and of a float32
// grad_weight 128-row chunks'), the outputs untouched; min_bytes itself is enough.
TEST_F(Linear, WorkspaceOneByteShortIsRefused) {
  const PlanShape& s = kPlanShapes[0];
  const int64_t N = s.N, D = s.D, V = s.V;
  std::mt19937_64 rng(31);
  for (int dtype : kDtypes) {
    const Mat hm = mat(dtype, N, D), wm = mat(dtype, V, D), bm = vec(dtype, V);
    Buf h(hm), w(wm), b(bm);
    write_mat(h, hm, random_normal(rng, dtype, static_cast<size_t>(N * D), 1.0));
    write_mat(w, wm, random_normal(rng, dtype, static_cast<size_t>(V * D), 0.1));
    write_mat(b, bm, random_normal(rng, dtype, static_cast<size_t>(V), 0.5));
    h.push();
    w.push();
    b.push();
    Buf y = targets_buf(random_targets(rng, N, V, 0.1), FCE_INT64);
    for (const GradSet& g : kGradSets) {
      if (!applies(g, dtype) || g.accumulate) continue;
      SCOPED_TRACE(plan_trace(dtype, s, g, kWsMin));
      const int gdt = g.gw_fp32 ? FCE_FLOAT32 : dtype;
      const Mat one = vec(FCE_FLOAT32, 1), ghm = mat(dtype, N, D), gwm = mat(gdt, V, D),
                gbm = vec(gdt, V);
      Buf loss = poisoned(one), gh = g.gh ? poisoned(ghm) : Buf(), gw = g.gw ? poisoned(gwm) : Buf(),
          gb = g.gb ? poisoned(gbm) : Buf();
      TestOptions o = test_options();
      o.dtype = dtype;
      o.grad_weight_fp32 = g.gw_fp32;
      size_t mn = 0, op = 0;
      ASSERT_EQ(fce_linear_ce_workspace_size(&o, N, D, V, g.gh || g.gw || g.gb, &mn, &op),
                FCE_SUCCESS)
          << fce_last_error();
      ASSERT_GT(mn, 0u) << "min_bytes 0: cannot test a too-small workspace";
      Buf ws = workspace_buf(mn);
      auto call = [&](size_t bytes) {
        return flat::linear_ce(&o, N, D, V, h.ptr(), w.ptr(), b.ptr(), y.ptr(), loss.p<float>(),
                             nullptr, nullptr, gh.ptr(), gw.ptr(), gb.ptr(), nullptr, nullptr,
                             ws.ptr(), bytes, test_stream());
      };
      std::vector<Buf*> outs = {&loss, &gh, &gw, &gb, &h, &w, &b, &y};
      std::vector<std::vector<uint8_t>> before;
      for (Buf* x : outs) before.push_back(x->mirror());
      fce_status st = call(mn - 1);
      EXPECT_EQ(st, FCE_ERROR_WORKSPACE_TOO_SMALL) << fce_status_string(st) << ": " << fce_last_error();
      EXPECT_TRUE(error_mentions("workspace"));
      ASSERT_TRUE(finish());
      for (size_t i = 0; i < outs.size(); ++i) {
        outs[i]->pull();
        EXPECT_TRUE(unchanged(*outs[i], before[i], "a buffer of the refused call"));
      }
      st = call(mn);
      EXPECT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
      ASSERT_TRUE(finish());
      loss.pull();
      EXPECT_TRUE(all_written(loss, one, "loss (workspace of min_bytes)"));
    }
  }
}

// Targets outside [0, V): NaN loss row (and reduced), the flag, NaN grad_hidden row, and
// grad_weight / grad_bias NaN (every column sees the NaN row); other rows' dh intact.
TEST_F(Linear, OutOfRangeTargets) {
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (int tdtype : {FCE_INT32, FCE_INT64})
      for (int red : kReductions)
        for (bool grads : {false, true}) {
          LinCase c;
          c.name = "out_of_range";
          c.dtype = dtype;
          c.tdtype = tdtype;
          c.reduction = red;
          c.ignore_frac = 0.2;
          c.gh = c.gw = c.gb = grads;
          c.edit = [](const LinCase& cc, std::vector<int64_t>& y) {
            y[2] = cc.V;
            y[5] = -1;
            y[11] = cc.tdtype == FCE_INT64 ? (int64_t{1} << 32) + 3 : INT32_MAX;
          };
          run_case(c);
        }
}

// An out-of-range target in a problem of several chunks, at the minimum workspace (on CUDA: 3
// token chunks for loss only and a float32 grad_weight, the vocab-sliced plan for a 16-bit
// grad_weight and for grad_hidden only): whichever plan computes them, the NaN row reaches the
// reduced loss, the flag, its grad_hidden row and every element of grad_weight and grad_bias.
TEST_F(Linear, OutOfRangeTargetAtMinimumWorkspace) {
  for (int dtype : kDtypes) {
    LinCase c = plan_case(dtype, kPlanShapes[0], 0, 99);
    c.name = "out_of_range_min_workspace";
    c.h_pad = 0;
    c.ws = kWsMin;
    c.edit = [](const LinCase& cc, std::vector<int64_t>& y) {
      y[static_cast<size_t>(cc.N / 2)] = cc.V;
    };
    LinRunner r(c);
    ASSERT_TRUE(r.any_invalid());
    for (const GradSet& g : kGradSets) {
      if (!applies(g, dtype) || g.accumulate) continue;
      SCOPED_TRACE(plan_trace(dtype, kPlanShapes[0], g, kWsMin));
      r.set_gradients(g.gh, g.gw, g.gb, g.accumulate, g.gw_fp32);
      ASSERT_NO_FATAL_FAILURE(r.run());
    }
  }
}

TEST_F(Linear, AllRowsIgnored) {
  for (int dtype : kDtypes)
    for (int red : kReductions)
      for (bool acc : {false, true}) {
        LinCase c;
        c.name = "all_ignored";
        c.dtype = dtype;
        c.reduction = red;
        c.ignore_frac = 1.0;
        c.weights = true;
        c.eps = 0.1f;
        c.lambda = 1e-3f;
        c.accumulate = acc;
        run_case(c);
      }
}

TEST_F(Linear, Deterministic) {
  for (int dtype : kDtypes) {
    LinCase c;
    c.name = "deterministic";
    c.dtype = dtype;
    c.N = 300;
    c.D = 48;
    c.V = 2000;
    c.eps = 0.1f;
    c.weights = true;
    c.argmax = c.accuracy = true;
    LinRunner r(c);
    r.options().deterministic = 1;
    LinOut a, b;
    ASSERT_NO_FATAL_FAILURE(r.run(&a, kWsOpt, 0xFF));
    ASSERT_NO_FATAL_FAILURE(r.run(&b, kWsOpt, 0x11));
    EXPECT_TRUE(bitwise_equal(a.loss, b.loss, "loss"));
    EXPECT_TRUE(bitwise_equal(a.lse, b.lse, "lse"));
    EXPECT_TRUE(bitwise_equal(a.zloss, b.zloss, "z_loss"));
    EXPECT_TRUE(bitwise_equal(a.gh, b.gh, "grad_hidden"));
    EXPECT_TRUE(bitwise_equal(a.gw, b.gw, "grad_weight"));
    EXPECT_TRUE(bitwise_equal(a.gb, b.gb, "grad_bias"));
    EXPECT_TRUE(bitwise_equal(a.argmax, b.argmax, "outputs->argmax"));
    EXPECT_TRUE(bitwise_equal(a.accuracy, b.accuracy, "outputs->accuracy"));
  }
}

// The loss of fce_linear_ce equals fce_forward's on the materialised logits (float32).
TEST_F(Linear, AgreesWithForwardOnMaterialisedLogits) {
  LinCase c;
  c.name = "vs_forward";
  c.N = 50;
  c.D = 32;
  c.V = 700;
  c.reduction = FCE_REDUCTION_NONE;
  c.eps = 0.1f;
  c.softcap = 15.0f;
  LinRunner r(c);
  ASSERT_NO_FATAL_FAILURE(r.run());
  // Feed the reference logits (float32) to fce_forward: both agree with the same reference.
  TestOptions o = r.options();
  o.hidden_row_stride = 0;
  Mat zm = mat(FCE_FLOAT32, c.N, c.V);
  Buf z(zm);
  write_mat(z, zm, r.ref().logits);
  z.push();
  Buf y(static_cast<size_t>(c.N) * 8);
  for (int64_t i = 0; i < c.N; ++i) {
    int64_t t = r.ref().ce.target[static_cast<size_t>(i)];
    std::memcpy(y.h() + 8 * i, &t, 8);
  }
  y.push();
  Mat lm = vec(FCE_FLOAT32, c.N);
  Buf loss = poisoned(lm);
  size_t wsb = 0;
  ASSERT_EQ(fce_forward_workspace_size(&o, c.N, c.V, &wsb), FCE_SUCCESS) << fce_last_error();
  Buf ws = workspace_buf(wsb);
  ASSERT_EQ(flat::forward(&o, c.N, c.V, z.ptr(), y.ptr(), loss.p<float>(), nullptr, nullptr,
                        nullptr, nullptr, nullptr, ws.ptr(), wsb, test_stream()),
            FCE_SUCCESS)
      << fce_last_error();
  ASSERT_TRUE(finish());
  loss.pull();
  EXPECT_TRUE(close_normwise(read_mat(loss, lm), r.ref().ce.row_loss, 1e-5, "fce_forward loss"));
}

// ------------------------------------------------------------------ CUDA only ---------------
#if FCE_TEST_HAVE_CUDA
TEST_F(Linear, CudaGraphCapture) {
  if (!on_cuda()) {
    std::printf("SKIPPED: graph capture is a CUDA backend test (FCE_TEST_BACKEND=cuda)\n");
    GTEST_SKIP() << "CUDA backend only";
  }
  const int64_t N = 96, D = 64, V = 1000;
  std::mt19937_64 rng(5);
  auto h = random_normal(rng, FCE_BFLOAT16, N * D, 1.0), W = random_normal(rng, FCE_BFLOAT16, V * D, 0.2);
  auto y = random_targets(rng, N, V, 0.1);
  Buf hb(mat(FCE_BFLOAT16, N, D)), wb(mat(FCE_BFLOAT16, V, D));
  write_mat(hb, mat(FCE_BFLOAT16, N, D), h);
  write_mat(wb, mat(FCE_BFLOAT16, V, D), W);
  hb.push();
  wb.push();
  Buf yb = targets_buf(y, FCE_INT64);
  TestOptions o = test_options();
  o.dtype = FCE_BFLOAT16;
  o.grad_weight_fp32 = 1;
  o.label_smoothing = 0.1f;
  Mat one = vec(FCE_FLOAT32, 1), ghm = mat(FCE_BFLOAT16, N, D), gwm = mat(FCE_FLOAT32, V, D);
  Buf loss = poisoned(one), gh = poisoned(ghm), gw = poisoned(gwm);
  size_t mn = 0, op = 0;
  ASSERT_EQ(fce_linear_ce_workspace_size(&o, N, D, V, 1, &mn, &op), FCE_SUCCESS);
  Buf ws = workspace_buf(op);
  auto call = [&] {
    return flat::linear_ce(&o, N, D, V, hb.ptr(), wb.ptr(), nullptr, yb.ptr(), loss.p<float>(),
                         nullptr, nullptr, gh.ptr(), gw.ptr(), nullptr, nullptr, nullptr,
                         ws.ptr(), op, test_stream());
  };
  ASSERT_EQ(call(), FCE_SUCCESS) << fce_last_error();  // eager first (cuBLASLt handle)
  ASSERT_TRUE(finish());
  for (Buf* b : {&loss, &gh, &gw}) b->pull();
  auto e_loss = loss.mirror(), e_gh = gh.mirror(), e_gw = gw.mirror();
  poison_mat(loss, one), loss.push();
  poison_mat(gh, ghm), gh.push();
  poison_mat(gw, gwm), gw.push();
  cudaStream_t s = cuda_stream();
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  fce_status st = call();
  cudaError_t ce = cudaStreamEndCapture(s, &graph);
  ASSERT_EQ(st, FCE_SUCCESS) << fce_last_error();
  ASSERT_EQ(ce, cudaSuccess) << cudaGetErrorString(ce);
  cudaGraphExec_t exec = nullptr;
#if CUDART_VERSION >= 12000
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
#else
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, nullptr, nullptr, 0), cudaSuccess);
#endif
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  ASSERT_TRUE(finish());
  for (Buf* b : {&loss, &gh, &gw}) b->pull();
  EXPECT_TRUE(bitwise_equal(loss.mirror(), e_loss, "graph vs eager loss"));
  EXPECT_TRUE(bitwise_equal(gh.mirror(), e_gh, "graph vs eager grad_hidden"));
  EXPECT_TRUE(bitwise_equal(gw.mirror(), e_gw, "graph vs eager grad_weight"));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// Each plan captured into a CUDA graph and replayed (the call enqueues everything on the one
// stream: no allocation, no synchronisation): the replay matches the reference and the eager
// call bit for bit. The first two problems of kPlanShapes with a bias and grad_output, at the
// minimum and the optimal workspace (token chunks of 128 and 2560 rows, the vocab-sliced plan,
// one chunk), and the workspace sweep's problem at a tenth of the way to its optimum (a 16-bit
// grad_weight accumulated in place over several chunks), with each gradient set; lse, z_loss
// and error_flags included.
TEST_F(Linear, CudaGraphCaptureEveryPlan) {
  if (!on_cuda()) {
    std::printf("SKIPPED: graph capture is a CUDA backend test (FCE_TEST_BACKEND=cuda)\n");
    GTEST_SKIP() << "CUDA backend only";
  }
  for (int dtype : kDtypes)
    for (int si = 0; si < 2; ++si) {
      const PlanShape& s = kPlanShapes[si];
      LinRunner r(plan_case(dtype, s, 0, 4321));
      for (const GradSet& g : kGradSets) {
        if (!applies(g, dtype)) continue;
        r.set_gradients(g.gh, g.gw, g.gb, g.accumulate, g.gw_fp32);
        for (int ws : {kWsMin, kWsOpt}) {
          SCOPED_TRACE(plan_trace(dtype, s, g, ws));
          LinOut eager, replay;
          ASSERT_NO_FATAL_FAILURE(r.run(&eager, ws, 0xFF));  // first: the cuBLASLt handle exists
          ASSERT_NO_FATAL_FAILURE(r.run(&replay, ws, 0xFF, /*as_graph=*/true));
          expect_same_bits(eager, replay, "graph replay vs eager");
        }
      }
    }
  for (int dtype : kDtypes) {
    const PlanShape s = {1023, 24, 3001, 0};
    LinCase c = plan_case(dtype, s, 0, 4321);
    c.ws_frac = 0.1;
    LinRunner r(c);
    for (const GradSet& g : kGradSets) {
      if (!applies(g, dtype)) continue;
      r.set_gradients(g.gh, g.gw, g.gb, g.accumulate, g.gw_fp32);
      SCOPED_TRACE(plan_trace(dtype, s, g, kWsFrac));
      LinOut eager, replay;
      ASSERT_NO_FATAL_FAILURE(r.run(&eager, kWsFrac, 0xFF));
      ASSERT_NO_FATAL_FAILURE(r.run(&replay, kWsFrac, 0xFF, /*as_graph=*/true));
      expect_same_bits(eager, replay, "graph replay vs eager");
    }
  }
}
#endif

}  // namespace
