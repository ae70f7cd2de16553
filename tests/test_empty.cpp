// test_empty.cpp — zero rows (rows = 0), the empty problem, on the backend FCE_TEST_BACKEND
// selects (include/fusedce.h conventions; docs/semantics.md "Zero rows"). Every call that takes
// rows accepts 0: the workspace queries return 0; the reduced loss, the z-loss total and the
// accuracy of mean and sum are written 0, nothing else per row (lse, argmax, the gradient of the
// logits, grad_hidden, the statistics) has an element; grad_weight and grad_bias are zeroed, or
// left as they are with accumulate; error_flags is never touched. Per-row buffers may be NULL,
// or any pointer (here: buffers of no bytes between guards, which must stay as they were).
// rows < 0 stays an error naming rows. On CUDA the calls are also captured into a CUDA graph:
// nothing runs during the capture, the zeros arrive when the graph is launched.
#include "test_util.h"

using namespace fcet;

namespace {

constexpr int64_t kV = 37, kD = 5;
constexpr uint8_t kFlagsByte = 0xA5;

class Empty : public BackendTest {};

// The outputs of a call (loss, z_loss, accuracy: [1] each, poisoned; for reduction none loss
// and accuracy have no element), and per-row buffers of no element: absent (NULL) or present
// (a 0-byte buffer between guards, which must stay as it is).
struct Outputs {
  bool none;
  Buf loss, zl, acc, flags;
  Buf lse, am, grad;  // [0]
  std::vector<std::vector<uint8_t>> empty_before;
  Outputs(bool none_, bool per_row_null) : none(none_) {
    const Mat one = vec(FCE_FLOAT32, 1);
    if (!none) loss = poisoned(one), acc = poisoned(one);
    zl = poisoned(one);
    flags = Buf(4, kFlagsByte);
    if (!per_row_null) {
      lse = Buf(size_t(0));
      am = Buf(size_t(0));
      grad = Buf(size_t(0));
      if (none) loss = Buf(size_t(0)), acc = Buf(size_t(0));
    }
    for (Buf* b : empties()) empty_before.push_back(b->mirror());
  }
  std::vector<Buf*> empties() {
    std::vector<Buf*> e = {&lse, &am, &grad};
    if (none) e.push_back(&loss), e.push_back(&acc);
    return e;
  }
  // After the call (finish()ed): with `written` (the forward calls), the reduced outputs exactly
  // +0; always the flags and every buffer of no element untouched.
  void check(const char* what, bool written) {
    SCOPED_TRACE(what);
    for (Buf* b : {&loss, &zl, &acc, &flags, &lse, &am, &grad}) b->pull();
    const Mat one = vec(FCE_FLOAT32, 1);
    if (written && !none) {
      EXPECT_EQ(read_mat(loss, one)[0], 0.0) << "loss";
      EXPECT_FALSE(std::signbit(read_mat(loss, one)[0])) << "loss";
      EXPECT_EQ(read_mat(acc, one)[0], 0.0) << "accuracy";
    }
    if (written) {
      EXPECT_EQ(read_mat(zl, one)[0], 0.0) << "z_loss";
    }
    for (int i = 0; i < 4; ++i) EXPECT_EQ(flags.h()[i], kFlagsByte) << "error_flags byte " << i;
    std::vector<Buf*> e = empties();
    for (size_t i = 0; i < e.size(); ++i)
      EXPECT_TRUE(unchanged(*e[i], empty_before[i], "a buffer of no element"));
  }
};

const int kReductions[] = {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE};

TEST_F(Empty, WorkspaceQueriesReturnZero) {
  for (int red : kReductions) {
    TestOptions o = test_options();
    o.reduction = red;
    o.label_smoothing = 0.1f;
    size_t b = 1, lo = 1, hi = 1;
    ASSERT_EQ(fce_forward_workspace_size(&o, 0, kV, &b), FCE_SUCCESS) << fce_last_error();
    EXPECT_EQ(b, 0u);
    b = 1;
    ASSERT_EQ(fce_backward_workspace_size(&o, 0, kV, &b), FCE_SUCCESS) << fce_last_error();
    EXPECT_EQ(b, 0u);
    for (int g : {0, 1}) {
      lo = hi = 1;
      ASSERT_EQ(fce_linear_ce_workspace_size(&o, 0, kD, kV, g, &lo, &hi), FCE_SUCCESS)
          << fce_last_error();
      EXPECT_EQ(lo, 0u);
      EXPECT_EQ(hi, 0u);
      lo = hi = 1;
      ASSERT_EQ(fce_vp_linear_ce_workspace_size(&o, 2, 0, kD, kV, kV / 2 + 1, g, FCE_FLOAT32, &lo,
                                                &hi),
                FCE_SUCCESS)
          << fce_last_error();
      EXPECT_EQ(lo, 0u);
      EXPECT_EQ(hi, 0u);
    }
    b = 1;
    ASSERT_EQ(fce_vp_loss_workspace_size(&o, 3, 0, kV, &b), FCE_SUCCESS) << fce_last_error();
    EXPECT_EQ(b, 0u);
    b = 1;
    ASSERT_EQ(fce_vp_backward_workspace_size(&o, 3, 0, kV, 13, &b), FCE_SUCCESS)
        << fce_last_error();
    EXPECT_EQ(b, 0u);
    lo = hi = 1;
    ASSERT_EQ(fce_vp_linear_stats_workspace_size(&o, 0, kD, 13, &lo, &hi), FCE_SUCCESS)
        << fce_last_error();
    EXPECT_EQ(lo + hi, 0u);
    lo = hi = 1;
    ASSERT_EQ(fce_vp_linear_backward_workspace_size(&o, 3, 0, kD, kV, 13, FCE_FLOAT32, &lo, &hi),
              FCE_SUCCESS)
        << fce_last_error();
    EXPECT_EQ(lo + hi, 0u);
    // negative rows stay an error, naming the query and rows
    EXPECT_EQ(fce_forward_workspace_size(&o, -1, kV, &b), FCE_ERROR_INVALID_ARGUMENT);
    EXPECT_TRUE(error_mentions("fce_forward_workspace_size"));
    EXPECT_TRUE(error_mentions("rows (-1) must be >= 0"));
  }
}

TEST_F(Empty, ForwardBackwardRescale) {
  Buf weights = f32_buf(std::vector<double>(kV, 1.5));
  Buf gout = f32_buf({0.75});
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (int red : kReductions)
      for (bool null_rows : {true, false})
        for (int64_t T : {0, 4}) {
          const bool none = red == FCE_REDUCTION_NONE;
          const std::string what = std::string(dtype_name(dtype)) + " " + reduction_name(red) +
                                   (null_rows ? " per-row NULL" : " per-row 0-byte buffers") +
                                   (T ? " shift_seq_len 4" : "") + " [" + backend_name() + "]";
          SCOPED_TRACE(what);
          TestOptions o = test_options();
          o.dtype = dtype;
          o.reduction = red;
          o.label_smoothing = 0.1f;
          o.z_loss_scale = 1e-3f;
          o.shift_seq_len = T;
          o.class_weights = weights.p<float>();
          Outputs out(none, null_rows);
          o.argmax = out.am.p<int64_t>();
          o.accuracy = out.acc.p<float>();
          void* rows_ptr = null_rows ? nullptr : out.grad.ptr();  // logits, targets: no element
          fce_status st = flat::forward(&o, 0, kV, rows_ptr, rows_ptr, out.loss.p<float>(),
                                      out.lse.p<float>(), out.zl.p<float>(), out.grad.ptr(),
                                      gout.p<float>(), out.flags.p<uint32_t>(), nullptr, 0,
                                      test_stream());
          ASSERT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
          EXPECT_STREQ(fce_last_error(), "");
          ASSERT_TRUE(finish());
          out.check("fce_forward", true);

          // the backward calls: nothing to write at all
          Outputs b(none, null_rows);
          st = flat::backward(&o, 0, kV, rows_ptr, rows_ptr, b.lse.p<float>(),
                            none ? nullptr : gout.p<float>(), b.grad.ptr(),
                            b.flags.p<uint32_t>(), nullptr, 0, test_stream());
          ASSERT_EQ(st, FCE_SUCCESS) << "fce_backward: " << fce_last_error();
          ASSERT_TRUE(finish());
          b.check("fce_backward", false);
          if (none) continue;
          st = flat::backward_rescale(&o, 0, kV, rows_ptr, rows_ptr, b.lse.p<float>(),
                                    gout.p<float>(), b.grad.ptr(), b.flags.p<uint32_t>(),
                                    nullptr, 0, test_stream());
          ASSERT_EQ(st, FCE_SUCCESS) << "fce_backward_rescale: " << fce_last_error();
          ASSERT_TRUE(finish());
          b.check("fce_backward_rescale", false);
          // two pointers to no element are no buffer: not "grad_logits is logits" (whatever the
          // strides), as equal pointers of empty arrays may be (Rust's dangling slices)
          TestOptions so = o;
          so.grad_row_stride = kV + 3;
          st = flat::backward_rescale(&so, 0, kV, b.grad.ptr(), rows_ptr, nullptr, gout.p<float>(),
                                    b.grad.ptr(), nullptr, nullptr, 0, test_stream());
          EXPECT_EQ(st, FCE_SUCCESS) << fce_last_error();
          st = flat::backward(&so, 0, kV, b.grad.ptr(), rows_ptr, nullptr, gout.p<float>(),
                            b.grad.ptr(), nullptr, nullptr, 0, test_stream());
          EXPECT_EQ(st, FCE_SUCCESS) << fce_last_error();
          ASSERT_TRUE(finish());
          b.check("fce_backward_rescale (grad_logits at the logits' address)", false);
          // still required with no row: the reduced loss, the upstream scalar of the rescale
          EXPECT_EQ(flat::forward(&o, 0, kV, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                nullptr, nullptr, nullptr, 0, test_stream()),
                    FCE_ERROR_NULL_POINTER);
          EXPECT_TRUE(error_mentions("fce_forward: outputs->loss is NULL"));
          EXPECT_EQ(flat::backward_rescale(&o, 0, kV, nullptr, nullptr, nullptr, nullptr, nullptr,
                                         nullptr, nullptr, 0, test_stream()),
                    FCE_ERROR_NULL_POINTER);
          EXPECT_TRUE(error_mentions("fce_backward_rescale: gradients->grad_output is NULL"));
        }
}

TEST_F(Empty, NegativeRowsStayAnError) {
  TestOptions o = test_options();
  Buf loss = poisoned(vec(FCE_FLOAT32, 1)), lse = poisoned(vec(FCE_FLOAT32, 1));
  const auto before = loss.mirror();
  EXPECT_EQ(flat::forward(&o, -1, kV, lse.ptr(), lse.ptr(), loss.p<float>(), nullptr, nullptr,
                        nullptr, nullptr, nullptr, nullptr, 0, test_stream()),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_forward: rows (-1) must be >= 0"));
  ASSERT_TRUE(finish());
  loss.pull();
  EXPECT_TRUE(unchanged(loss, before, "loss of the refused call"));
  EXPECT_EQ(flat::linear_ce(&o, -3, kD, kV, lse.ptr(), lse.ptr(), nullptr, lse.ptr(),
                          loss.p<float>(), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                          nullptr, nullptr, 0, test_stream()),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_linear_ce: rows (-3) must be >= 0"));
  EXPECT_EQ(flat::vp_loss(&o, 2, -1, kV, lse.ptr(), lse.p<float>(), loss.p<float>(), nullptr,
                        nullptr, nullptr, nullptr, 0, test_stream()),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_loss: rows (-1) must be >= 0"));
}

// fce_linear_ce: the loss outputs as fce_forward's; grad_weight and grad_bias zeroed, or left as
// they are with accumulate (a sum over no rows adds nothing); grad_hidden has no element.
TEST_F(Empty, LinearCe) {
  std::mt19937_64 rng(5);
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16})
    for (int red : kReductions)
      for (bool accumulate : {false, true})
        for (bool fp32 : {false, true}) {
          const bool none = red == FCE_REDUCTION_NONE;
          SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + reduction_name(red) +
                       (accumulate ? " accumulate" : "") + (fp32 ? " grad_weight_fp32" : "") +
                       " [" + backend_name() + "]");
          TestOptions o = test_options();
          o.dtype = dtype;
          o.reduction = red;
          o.accumulate = accumulate;
          o.grad_weight_fp32 = fp32;
          const int gdt = fp32 ? FCE_FLOAT32 : dtype;
          const Mat wm = mat(dtype, kV, kD), bm = vec(dtype, kV), gwm = mat(gdt, kV, kD),
                    gbm = vec(gdt, kV);
          Buf w(wm), b(bm);
          write_mat(w, wm, random_normal(rng, dtype, kV * kD, 1.0));
          write_mat(b, bm, random_normal(rng, dtype, kV, 1.0));
          w.push();
          b.push();
          Buf gw(gwm), gb(gbm);
          write_mat(gw, gwm, random_normal(rng, gdt, kV * kD, 1.0));  // what accumulate keeps
          write_mat(gb, gbm, random_normal(rng, gdt, kV, 1.0));
          gw.push();
          gb.push();
          const auto gw_before = gw.mirror(), gb_before = gb.mirror();
          Outputs out(none, true);
          o.accuracy = out.acc.p<float>();
          const fce_status st =
              flat::linear_ce(&o, 0, kD, kV, nullptr, w.ptr(), b.ptr(), nullptr,
                            out.loss.p<float>(), nullptr, out.zl.p<float>(), nullptr, gw.ptr(),
                            gb.ptr(), nullptr, out.flags.p<uint32_t>(), nullptr, 0,
                            test_stream());
          ASSERT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
          ASSERT_TRUE(finish());
          out.check("fce_linear_ce", true);
          gw.pull();
          gb.pull();
          if (accumulate) {
            EXPECT_TRUE(unchanged(gw, gw_before, "grad_weight (accumulate)"));
            EXPECT_TRUE(unchanged(gb, gb_before, "grad_bias (accumulate)"));
          } else {
            for (double v : read_mat(gw, gwm)) ASSERT_EQ(v, 0.0) << "grad_weight";
            for (double v : read_mat(gb, gbm)) ASSERT_EQ(v, 0.0) << "grad_bias";
            EXPECT_TRUE(only_elements_changed(gw, gw_before, &gwm, "grad_weight"));
          }
        }
}

// The vocabulary-parallel calls: phase 1 and the gradient of the logits write nothing, the loss
// is fce_forward's, the linear gradients as fce_linear_ce's; fce_vp_linear_ce never gathers.
fce_status no_gather(void* context, const float*, float*, int64_t, void*) {
  ++*static_cast<int*>(context);
  return FCE_ERROR_INTERNAL;
}

TEST_F(Empty, VocabParallel) {
  const int64_t P = 3, VL = 13, VS = 13;
  for (int red : kReductions) {
    const bool none = red == FCE_REDUCTION_NONE;
    SCOPED_TRACE(std::string(reduction_name(red)) + " [" + backend_name() + "]");
    TestOptions o = test_options();
    o.reduction = red;
    const Mat wm = mat(FCE_FLOAT32, VL, kD);
    Buf w(wm);
    write_mat(w, wm, std::vector<double>(VL * kD, 0.5));
    w.push();
    fce_status st = flat::vp_stats(&o, 0, kV, VS, VL, nullptr, nullptr, nullptr, test_stream());
    EXPECT_EQ(st, FCE_SUCCESS) << "fce_vp_stats: " << fce_last_error();
    st = flat::vp_linear_stats(&o, 0, kD, kV, VS, VL, nullptr, w.ptr(), nullptr, nullptr, nullptr,
                             nullptr, 0, test_stream());
    EXPECT_EQ(st, FCE_SUCCESS) << "fce_vp_linear_stats: " << fce_last_error();
    Outputs out(none, true);
    o.accuracy = out.acc.p<float>();
    st = flat::vp_loss(&o, P, 0, kV, nullptr, nullptr, out.loss.p<float>(), nullptr,
                     out.zl.p<float>(), out.flags.p<uint32_t>(), nullptr, 0, test_stream());
    ASSERT_EQ(st, FCE_SUCCESS) << "fce_vp_loss: " << fce_last_error();
    ASSERT_TRUE(finish());
    out.check("fce_vp_loss", true);
    o.accuracy = nullptr;
    Outputs b(none, true);
    st = flat::vp_backward(&o, P, 0, kV, VS, VL, nullptr, nullptr, nullptr, nullptr, nullptr,
                         nullptr, 0, test_stream());
    ASSERT_EQ(st, FCE_SUCCESS) << "fce_vp_backward: " << fce_last_error();
    Buf gw = poisoned(wm);
    st = flat::vp_linear_backward(&o, P, 0, kD, kV, VS, VL, nullptr, w.ptr(), nullptr, nullptr,
                                nullptr, nullptr, nullptr, FCE_FLOAT32, gw.ptr(), nullptr,
                                nullptr, 0, test_stream());
    ASSERT_EQ(st, FCE_SUCCESS) << "fce_vp_linear_backward: " << fce_last_error();
    ASSERT_TRUE(finish());
    gw.pull();
    for (double v : read_mat(gw, wm)) ASSERT_EQ(v, 0.0) << "grad_weight (fce_vp_linear_backward)";
    // no gradient asked for at all: with no row, not an error (grad_hidden may be NULL)
    st = flat::vp_linear_backward(&o, P, 0, kD, kV, VS, VL, nullptr, w.ptr(), nullptr, nullptr,
                                nullptr, nullptr, nullptr, FCE_FLOAT32, nullptr, nullptr,
                                nullptr, 0, test_stream());
    EXPECT_EQ(st, FCE_SUCCESS) << fce_last_error();
    b.check("fce_vp_backward, fce_vp_linear_backward", false);
    int gathers = 0;
    Outputs f(none, true);
    o.accuracy = f.acc.p<float>();
    gw = poisoned(wm);
    st = flat::vp_linear_ce(&o, P, 0, kD, kV, VS, VL, nullptr, w.ptr(), nullptr, nullptr,
                          f.loss.p<float>(), nullptr, f.zl.p<float>(), nullptr, nullptr,
                          FCE_FLOAT32, gw.ptr(), nullptr, f.flags.p<uint32_t>(), no_gather,
                          &gathers, nullptr, 0, test_stream());
    ASSERT_EQ(st, FCE_SUCCESS) << "fce_vp_linear_ce: " << fce_last_error();
    ASSERT_TRUE(finish());
    EXPECT_EQ(gathers, 0) << "fce_vp_linear_ce gathered with no row";
    f.check("fce_vp_linear_ce", true);
    gw.pull();
    for (double v : read_mat(gw, wm)) ASSERT_EQ(v, 0.0) << "grad_weight (fce_vp_linear_ce)";
  }
}

#if FCE_TEST_HAVE_CUDA
// The empty problem on CUDA is asynchronous on the caller's stream and graph-capturable: nothing
// runs during the capture, and each launch of the graph writes the zeros again.
TEST_F(Empty, CudaGraphCapture) {
  if (!on_cuda()) {
    std::printf("SKIPPED: graph capture is a CUDA backend test (FCE_TEST_BACKEND=cuda)\n");
    GTEST_SKIP() << "CUDA backend only";
  }
  TestOptions o = test_options();
  o.reduction = FCE_REDUCTION_MEAN;
  const Mat one = vec(FCE_FLOAT32, 1), wm = mat(FCE_BFLOAT16, kV, kD);
  Buf loss = poisoned(one), zl = poisoned(one), w(wm), gw = poisoned(wm);
  w.push();
  CapturedGraph graph;
  ASSERT_TRUE(graph.capture([&] {
    const fce_status st = flat::forward(&o, 0, kV, nullptr, nullptr, loss.p<float>(), nullptr,
                                      zl.p<float>(), nullptr, nullptr, nullptr, nullptr, 0,
                                      test_stream());
    if (st != FCE_SUCCESS) return st;
    TestOptions lo = o;
    lo.dtype = FCE_BFLOAT16;
    return flat::linear_ce(&lo, 0, kD, kV, nullptr, w.ptr(), nullptr, nullptr, loss.p<float>(),
                         nullptr, nullptr, nullptr, gw.ptr(), nullptr, nullptr, nullptr, nullptr,
                         0, test_stream());
  }));
  for (Buf* b : {&loss, &zl, &gw}) b->pull();
  EXPECT_FALSE(all_written(loss, one, "loss")) << "the empty problem ran during capture";
  EXPECT_FALSE(all_written(gw, wm, "grad_weight")) << "the empty problem ran during capture";
  for (int launch = 0; launch < 2; ++launch) {
    ASSERT_TRUE(graph.launch());
    ASSERT_TRUE(finish());
    for (Buf* b : {&loss, &zl, &gw}) b->pull();
    EXPECT_EQ(read_mat(loss, one)[0], 0.0);
    EXPECT_EQ(read_mat(zl, one)[0], 0.0);
    for (double v : read_mat(gw, wm)) ASSERT_EQ(v, 0.0);
    for (Buf* b : {&loss, &zl}) poison_all(*b, FCE_FLOAT32), b->push();
    poison_mat(gw, wm);
    gw.push();
  }
}
#endif

}  // namespace
