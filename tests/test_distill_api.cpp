// test_distill_api.cpp — the argument checks of the distillation calls (docs/semantics.md rule
// 19): every refusal of fce_distill and fce_linear_distill with its message, and the empty
// problem. The values are tested in test_distill.cpp. FCE_TEST_BACKEND picks the backend.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "test_util.h"

namespace {

using namespace fcet;

// ------------------------------------------------------------------ refusals ----------------
class DistillRefusals : public BackendTest {
 protected:
  static constexpr int64_t N = 4, V = 32;
  Buf z{mat(FCE_FLOAT32, N, V)}, t{mat(FCE_FLOAT32, N, V)}, grad{mat(FCE_FLOAT32, N, V)};
  Buf loss{vec(FCE_FLOAT32, 1)}, other{vec(FCE_FLOAT32, N)};
  Buf y{targets_buf(std::vector<int64_t>(N, 1), FCE_INT64)};
  fce_options o = test_options();
  fce_teacher te = FCE_TEACHER_INIT;
  fce_outputs out = FCE_OUTPUTS_INIT;
  fce_gradients g = FCE_GRADIENTS_INIT;
  void SetUp() override {
    BackendTest::SetUp();
    te.logits = t.ptr();
    out.loss = loss.p<float>();
    g.grad_logits = grad.ptr();
  }
  // fce_distill with the fixture's arguments (a 64 KiB workspace) fails with `status` and a
  // message mentioning `what`.
  void expect_refused(fce_status status, const char* what, const fce_teacher* tp = nullptr) {
    Buf ws(65536);
    EXPECT_EQ(fce_distill(&o, tp ? tp : &te, N, V, z.ptr(), y.ptr(), &out, &g, ws.ptr(), 65536,
                          test_stream()),
              status);
    EXPECT_TRUE(error_mentions(what));
  }
};

TEST_F(DistillRefusals, Teacher) {
  Buf ws(65536);
  EXPECT_EQ(fce_distill(&o, nullptr, N, V, z.ptr(), y.ptr(), &out, &g, ws.ptr(), 65536, nullptr),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_distill: teacher is NULL"));
  fce_teacher bad = te;
  bad.struct_size = 8;
  expect_refused(FCE_ERROR_INVALID_ARGUMENT, "fce_distill: teacher->struct_size (8)", &bad);
  bad = te;
  bad.reserved0 = 1;
  expect_refused(FCE_ERROR_INVALID_ARGUMENT, "fce_distill: teacher->reserved0", &bad);
  bad = te;
  bad.divergence = 7;
  expect_refused(FCE_ERROR_INVALID_ARGUMENT, "fce_distill: teacher->divergence (7)", &bad);
  bad = te;
  bad.beta = 1.5f;
  expect_refused(FCE_ERROR_INVALID_ARGUMENT, "fce_distill: teacher->beta (1.5)", &bad);
  for (float T : {0.0f, -1.0f, NAN, INFINITY}) {
    bad = te;
    bad.temperature = T;
    expect_refused(FCE_ERROR_INVALID_ARGUMENT, "fce_distill: teacher->temperature", &bad);
  }
  bad = te;
  bad.logits = nullptr;
  expect_refused(FCE_ERROR_NULL_POINTER, "fce_distill: teacher->logits is NULL", &bad);
  bad = te;
  bad.row_stride = V - 1;
  expect_refused(FCE_ERROR_INVALID_ARGUMENT, "fce_distill: teacher->row_stride (31)", &bad);
  bad = te;
  bad.weight = z.ptr();
  expect_refused(FCE_ERROR_INVALID_ARGUMENT, "fce_distill: teacher->weight is set", &bad);
  bad = te;
  bad.logits = grad.ptr();
  expect_refused(FCE_ERROR_INVALID_ARGUMENT, "teacher->logits overlaps gradients->grad_logits",
                 &bad);
}

TEST_F(DistillRefusals, Options) {
  Buf w = f32_buf(std::vector<double>(V, 1.0));
  const fce_options base = o;
  o.class_weights = w.p<float>();
  expect_refused(FCE_ERROR_UNSUPPORTED, "fce_distill: options->class_weights is not supported");
  o = base;
  o.label_smoothing = 0.1f;
  expect_refused(FCE_ERROR_UNSUPPORTED, "fce_distill: options->label_smoothing is not supported");
  o = base;
  o.z_loss_scale = 1e-4f;
  expect_refused(FCE_ERROR_UNSUPPORTED, "fce_distill: options->z_loss_scale is not supported");
  o = base;
  o.token_scaling = 1;
  expect_refused(FCE_ERROR_UNSUPPORTED, "fce_distill: options->token_scaling is not supported");
  o = base;
  o.shift_seq_len = 2;
  expect_refused(FCE_ERROR_UNSUPPORTED, "fce_distill: options->shift_seq_len is not supported");
  o = base;
  o.target_dtype = FCE_FLOAT32;  // class probabilities: a distillation's targets only mark rows
  expect_refused(FCE_ERROR_UNSUPPORTED, "fce_distill: options->target_dtype (0) gives class");
  o = base;
  o.vp_entropy = 1;
  expect_refused(FCE_ERROR_INVALID_ARGUMENT, "fce_distill: options->vp_entropy");
  o = base;
  size_t bytes = 0;
  o.label_smoothing = 0.1f;
  EXPECT_EQ(fce_distill_workspace_size(&o, &te, N, V, &bytes), FCE_ERROR_UNSUPPORTED);
  EXPECT_TRUE(error_mentions("fce_distill_workspace_size: options->label_smoothing"));
}

TEST_F(DistillRefusals, OutputsAndGradients) {
  Buf am(vec(FCE_INT64, N));
  const fce_outputs base = out;
  out.z_loss = other.p<float>();
  expect_refused(FCE_ERROR_UNSUPPORTED, "fce_distill: outputs->z_loss is not supported");
  out = base;
  out.argmax = am.p<int64_t>();
  expect_refused(FCE_ERROR_UNSUPPORTED, "fce_distill: outputs->argmax is not supported");
  out = base;
  out.accuracy = other.p<float>();
  expect_refused(FCE_ERROR_UNSUPPORTED, "fce_distill: outputs->accuracy is not supported");
  out = base;
  out.entropy = other.p<float>();
  expect_refused(FCE_ERROR_UNSUPPORTED, "fce_distill: outputs->entropy is not supported");
  out = base;
  out.loss = nullptr;
  expect_refused(FCE_ERROR_NULL_POINTER, "fce_distill: outputs->loss is NULL");
  out = base;
  const fce_gradients gbase = g;
  g.grad_lse = other.p<float>();
  expect_refused(FCE_ERROR_UNSUPPORTED, "fce_distill: gradients->grad_lse is not supported");
  g = gbase;
  g.grad_entropy = other.p<float>();
  expect_refused(FCE_ERROR_UNSUPPORTED, "fce_distill: gradients->grad_entropy is not supported");
  g = gbase;
  g.grad_hidden = grad.ptr();
  expect_refused(FCE_ERROR_INVALID_ARGUMENT, "fce_distill: gradients->grad_hidden is given");
}

TEST_F(DistillRefusals, Linear) {
  const int64_t D = 8;
  Buf h(mat(FCE_FLOAT32, N, D)), w(mat(FCE_FLOAT32, V, D)), dw(mat(FCE_FLOAT32, V, D));
  Buf ws(8 << 20);  // the CUDA minimum is a few MiB
  fce_teacher lt = FCE_TEACHER_INIT;
  lt.hidden_states = h.ptr();
  lt.weight = w.ptr();
  lt.hidden = D;
  fce_gradients lg = FCE_GRADIENTS_INIT;
  lg.grad_weight = dw.ptr();
  auto call = [&](const fce_teacher& tt, const fce_gradients& gg, size_t bytes) {
    return fce_linear_distill(&o, &tt, N, D, V, h.ptr(), w.ptr(), y.ptr(), &out, &gg, ws.ptr(),
                              bytes, test_stream());
  };
  size_t min_bytes = 0;
  ASSERT_EQ(fce_linear_distill_workspace_size(&o, &lt, N, D, V, 1, &min_bytes, nullptr),
            FCE_SUCCESS)
      << fce_last_error();
  ASSERT_LE(min_bytes, ws.size()) << "the test's workspace";
  ASSERT_EQ(call(lt, lg, min_bytes), FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
  fce_gradients bias = lg;
  bias.grad_bias = other.ptr();
  EXPECT_EQ(call(lt, bias, ws.size()), FCE_ERROR_UNSUPPORTED);
  EXPECT_TRUE(error_mentions("fce_linear_distill: gradients->grad_bias is not supported"));
  fce_teacher bad = lt;
  bad.logits = t.ptr();
  EXPECT_EQ(call(bad, lg, ws.size()), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_linear_distill: teacher->logits is set"));
  bad = lt;
  bad.hidden = 0;
  EXPECT_EQ(call(bad, lg, ws.size()), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_linear_distill: teacher->hidden (0)"));
  bad = lt;
  bad.hidden_row_stride = D - 1;
  EXPECT_EQ(call(bad, lg, ws.size()), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("teacher->hidden_row_stride (7) is less than teacher->hidden"));
  bad = lt;
  bad.weight = nullptr;
  EXPECT_EQ(call(bad, lg, ws.size()), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_linear_distill: teacher->weight is NULL"));
  bad = lt;
  bad.weight = dw.ptr();
  EXPECT_EQ(call(bad, lg, ws.size()), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("teacher->weight overlaps gradients->grad_weight"));
  size_t lo = 0, hi = 0;
  ASSERT_EQ(fce_linear_distill_workspace_size(&o, &lt, N, D, V, 1, &lo, &hi), FCE_SUCCESS);
  if (lo > 0) {
    EXPECT_EQ(call(lt, lg, lo - 1), FCE_ERROR_WORKSPACE_TOO_SMALL);
    EXPECT_TRUE(error_mentions("fce_linear_distill"));
  }
  fce_gradients logits = FCE_GRADIENTS_INIT;
  logits.grad_logits = grad.ptr();
  EXPECT_EQ(call(lt, logits, ws.size()), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_linear_distill: gradients->grad_logits is given"));
}

TEST_F(DistillRefusals, EmptyProblem) {
  Buf ws(16);
  put(FCE_FLOAT32, loss.h(), 7.0);
  loss.push();
  ASSERT_EQ(fce_distill(&o, &te, 0, V, nullptr, nullptr, &out, nullptr, nullptr, 0, test_stream()),
            FCE_SUCCESS)
      << fce_last_error();
  ASSERT_TRUE(finish());
  loss.pull();
  EXPECT_EQ(get(FCE_FLOAT32, loss.h()), 0.0);
}

}  // namespace
