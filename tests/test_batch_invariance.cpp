// test_batch_invariance.cpp — options->batch_invariant (docs/semantics.md rule 21): a row's
// loss (reduction none), lse, entropy, argmax and gradient row (grad_logits; fce_linear_ce's
// grad_hidden row) are the same bytes whether the row is computed alone or inside batches of
// 1, 7, 64, 1000 and 4099 rows, at the first, a middle and the last position, and (fce_linear_ce)
// with several workspace sizes. Run on the backend FCE_TEST_BACKEND selects (CUDA skips without
// a device). Also the calls that refuse the flag, and (CUDA) the refusal of unaligned rows.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "harness/backend.h"
#include "harness/buffers.h"
#include "harness/compare.h"
#include "row_values.h"

namespace {

using namespace fcet;

// ------------------------------------------------------------------ the rows of a problem ---
// Every value of row r is a function of (r, column) alone, so a batch is any list of row ids.
int64_t target_of(int64_t r, int64_t vocab) {
  if (r % 13 == 5) return -100;  // some rows ignored
  return int64_t(mix(uint64_t(r) + 77u) % uint64_t(vocab));
}
float upstream_of(int64_t r) { return 0.5f + float(r % 5) * 0.25f; }

constexpr int64_t kRowsUniverse = 5000;  // row ids drawn from [0, kRowsUniverse)
const std::vector<int64_t> kBatchSizes = {1, 7, 64, 1000, 4099};

// The row ids of a batch of n rows with `probe` at position pos: the others are a fixed walk.
std::vector<int64_t> batch_ids(int64_t n, int64_t pos, int64_t probe) {
  std::vector<int64_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[size_t(i)] = (probe + 1 + i * 7919) % kRowsUniverse;
  ids[size_t(pos)] = probe;
  for (int64_t i = 0; i < n; ++i)
    if (i != pos && ids[size_t(i)] == probe) ids[size_t(i)] = (probe + 1) % kRowsUniverse;
  return ids;
}

// The per-row buffers of a batch: targets, upstream gradients, and the outputs (poisoned).
struct RowBufs {
  Buf targets, upstream, loss, lse, entropy, argmax;
  RowBufs(const std::vector<int64_t>& ids, int64_t vocab) {
    const int64_t n = static_cast<int64_t>(ids.size());
    std::vector<int64_t> y(static_cast<size_t>(n));
    std::vector<double> g(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      y[size_t(i)] = target_of(ids[size_t(i)], vocab);
      g[size_t(i)] = upstream_of(ids[size_t(i)]);
    }
    targets = targets_buf(y, FCE_INT64);
    upstream = f32_buf(g);
    loss = poisoned(vec(FCE_FLOAT32, n));
    lse = poisoned(vec(FCE_FLOAT32, n));
    entropy = poisoned(vec(FCE_FLOAT32, n));
    argmax = poisoned(vec(FCE_INT64, n));
  }
  fce_outputs outputs(bool with_entropy) {
    fce_outputs out = FCE_OUTPUTS_INIT;
    out.loss = loss.p<float>();
    out.lse = lse.p<float>();
    out.argmax = argmax.p<int64_t>();
    if (with_entropy) out.entropy = entropy.p<float>();
    return out;
  }
  // Row pos of the outputs (after the call).
  RowBytes row(int64_t pos, bool with_entropy) {
    for (Buf* b : {&loss, &lse, &entropy, &argmax}) b->pull();
    RowBytes r;
    r.loss = bytes_at(loss, size_t(pos) * 4, 4);
    r.lse = bytes_at(lse, size_t(pos) * 4, 4);
    if (with_entropy) r.entropy = bytes_at(entropy, size_t(pos) * 4, 4);
    r.argmax = bytes_at(argmax, size_t(pos) * 8, 8);
    return r;
  }
};

// ------------------------------------------------------------------ fce_forward / backward --
struct CeCase {
  const char* name;
  int dtype;
  int64_t vocab, stride;  // stride 0 = vocab
  bool grad, entropy, backward;
  float smoothing, z_loss;
};

class CeRun {
 public:
  explicit CeRun(const CeCase& c) : c_(c) {}
  // The probe row's bytes in a batch of these rows.
  RowBytes run(const std::vector<int64_t>& ids, int64_t pos) {
    const int64_t n = static_cast<int64_t>(ids.size()), V = c_.vocab;
    const int64_t ld = c_.stride ? c_.stride : V;
    const Mat m = mat(c_.dtype, n, V, ld);
    Buf logits(m);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < V; ++j)
        put(c_.dtype, logits.h() + m.offset(i, j), value(1, ids[size_t(i)], j, 8.0));
    logits.push();
    RowBufs rb(ids, V);
    Buf grad = poisoned(m);
    TestOptions o = test_options();
    o.dtype = c_.dtype;
    o.reduction = FCE_REDUCTION_NONE;
    o.row_stride = o.grad_row_stride = ld;
    o.label_smoothing = c_.smoothing;
    o.z_loss_scale = c_.z_loss;
    o.batch_invariant = 1;
    fce_outputs out = rb.outputs(c_.entropy);
    fce_gradients gr = FCE_GRADIENTS_INIT;
    gr.grad_output = rb.upstream.p<float>();
    if (c_.grad) gr.grad_logits = grad.ptr();
    size_t ws_bytes = 0;
    EXPECT_EQ(fce_forward_workspace_size(&o, n, V, &ws_bytes), FCE_SUCCESS) << fce_last_error();
    Buf ws = workspace_buf(ws_bytes);
    EXPECT_EQ(fce_forward(&o, n, V, logits.ptr(), rb.targets.ptr(), &out, c_.grad ? &gr : nullptr,
                          ws_bytes ? ws.ptr() : nullptr, ws_bytes, test_stream()),
              FCE_SUCCESS)
        << fce_last_error();
    EXPECT_TRUE(finish());
    RowBytes r = rb.row(pos, c_.entropy);
    if (c_.backward) {  // the gradient again, from the saved lse
      fce_outputs flags = FCE_OUTPUTS_INIT;
      gr.grad_logits = grad.ptr();
      size_t bw_bytes = 0;
      EXPECT_EQ(fce_backward_workspace_size(&o, n, V, &bw_bytes), FCE_SUCCESS);
      Buf bws = workspace_buf(bw_bytes);
      EXPECT_EQ(fce_backward(&o, n, V, logits.ptr(), rb.targets.ptr(), rb.lse.p<float>(), &flags,
                             &gr, bw_bytes ? bws.ptr() : nullptr, bw_bytes, test_stream()),
                FCE_SUCCESS)
          << fce_last_error();
      EXPECT_TRUE(finish());
    }
    if (c_.grad || c_.backward) {
      grad.pull();
      r.grad = bytes_at(grad, m.offset(pos, 0), size_t(V) * m.esize());
    }
    return r;
  }

 private:
  CeCase c_;
};

// The probe rows alone, then inside every batch size at three positions.
void check_ce(const CeCase& c) {
  SCOPED_TRACE(c.name);
  CeRun run(c);
  for (int64_t probe : {int64_t{3}, int64_t{1234}}) {
    const RowBytes alone = run.run({probe}, 0);
    for (int64_t n : kBatchSizes)
      for (int64_t pos : {int64_t{0}, n / 2, n - 1}) {
        if (n == 1 && pos > 0) continue;
        EXPECT_TRUE(same_row(alone, run.run(batch_ids(n, pos, probe), pos)))
            << "row " << probe << " at position " << pos << " of " << n;
      }
  }
}

class BatchInvariance : public BackendTest {};

// Vocabulary sizes that take the register / cluster path, the bulk-copy path and the two-pass
// path on sm_90 (docs/performance.md); the CPU runs the smaller ones.
TEST_F(BatchInvariance, ForwardWithGradientF32) {
  check_ce({"f32 V=1000", FCE_FLOAT32, 1000, 0, true, false, false, 0.f, 0.f});
  check_ce({"f32 V=8192 smoothing z-loss", FCE_FLOAT32, 8192, 0, true, false, false, 0.1f, 1e-3f});
  if (on_cuda()) check_ce({"f32 V=32768", FCE_FLOAT32, 32768, 0, true, false, false, 0.f, 0.f});
}
TEST_F(BatchInvariance, ForwardOnlyBf16) {
  check_ce({"bf16 V=4096 forward", FCE_BFLOAT16, 4096, 0, false, false, false, 0.f, 0.f});
  if (on_cuda()) {
    check_ce({"bf16 V=50304 forward", FCE_BFLOAT16, 50304, 0, false, false, false, 0.f, 0.f});
    check_ce({"bf16 V=128256 gradient", FCE_BFLOAT16, 128256, 0, true, false, false, 0.f, 0.f});
  }
}
TEST_F(BatchInvariance, EntropyAndSmoothing) {
  check_ce({"f32 V=2048 entropy", FCE_FLOAT32, 2048, 0, true, true, false, 0.f, 0.f});
  check_ce({"bf16 V=3000 entropy smoothing", FCE_BFLOAT16, 3000, 0, true, true, false, 0.1f, 0.f});
}
TEST_F(BatchInvariance, Backward) {
  check_ce({"f16 V=4096 backward", FCE_FLOAT16, 4096, 0, false, false, true, 0.05f, 0.f});
}
// Rows whose starts are not 16-byte aligned: the CPU honours the flag; CUDA refuses it.
TEST_F(BatchInvariance, UnalignedRows) {
  if (!on_cuda()) {
    check_ce({"f32 V=1001", FCE_FLOAT32, 1001, 0, true, false, false, 0.f, 0.f});
    check_ce({"bf16 V=1000 stride 1003", FCE_BFLOAT16, 1000, 1003, true, false, false, 0.f, 0.f});
    return;
  }
  const int64_t n = 4, V = 1001;
  Buf logits(mat(FCE_FLOAT32, n, V));
  Buf targets = targets_buf({1, 2, 3, 4}, FCE_INT64);
  Buf loss = poisoned(vec(FCE_FLOAT32, n));
  TestOptions o = test_options();
  o.reduction = FCE_REDUCTION_NONE;
  o.batch_invariant = 1;
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = loss.p<float>();
  size_t ws_bytes = 0;
  ASSERT_EQ(fce_forward_workspace_size(&o, n, V, &ws_bytes), FCE_SUCCESS);
  Buf ws = workspace_buf(ws_bytes);
  EXPECT_EQ(fce_forward(&o, n, V, logits.ptr(), targets.ptr(), &out, nullptr, ws.ptr(), ws_bytes,
                        test_stream()),
            FCE_ERROR_UNSUPPORTED);
  EXPECT_TRUE(error_mentions("batch_invariant"));
  EXPECT_TRUE(error_mentions("fce_forward"));
}

// ------------------------------------------------------------------ fce_linear_ce -----------
struct LinCase {
  const char* name;
  int dtype;
  int64_t hidden, vocab;
  bool bias, grad_weight, grad_weight_fp32, entropy;
};

class LinRun {
 public:
  explicit LinRun(const LinCase& c) : c_(c) {
    const int64_t V = c.vocab, D = c.hidden;
    weight_ = Buf(mat(c.dtype, V, D));
    for (int64_t j = 0; j < V; ++j)
      for (int64_t k = 0; k < D; ++k)
        put(c.dtype, weight_.h() + size_t(j * D + k) * dtype_size(c.dtype), value(2, j, k, 0.25));
    weight_.push();
    bias_ = Buf(vec(c.dtype, V));
    for (int64_t j = 0; j < V; ++j)
      put(c.dtype, bias_.h() + size_t(j) * dtype_size(c.dtype), value(3, j, 0, 1.0));
    bias_.push();
  }
  // The probe row's bytes; ws_scale: the workspace is that many times the query's minimum
  // (0: optimal_bytes, < 0: optimal_bytes plus 1 MiB).
  RowBytes run(const std::vector<int64_t>& ids, int64_t pos, double ws_scale) {
    const int64_t n = static_cast<int64_t>(ids.size()), V = c_.vocab, D = c_.hidden;
    const int dt = c_.dtype;
    const Mat hm = mat(dt, n, D);
    Buf hidden(hm);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < D; ++k)
        put(dt, hidden.h() + hm.offset(i, k), value(4, ids[size_t(i)], k, 2.0));
    hidden.push();
    RowBufs rb(ids, V);
    Buf grad_hidden = poisoned(hm);
    const int dw_dtype = c_.grad_weight_fp32 ? FCE_FLOAT32 : dt;
    Buf grad_weight = poisoned(mat(dw_dtype, V, D));
    Buf grad_bias = poisoned(vec(dw_dtype, V));
    TestOptions o = test_options();
    o.dtype = dt;
    o.reduction = FCE_REDUCTION_NONE;
    o.grad_weight_fp32 = c_.grad_weight_fp32 ? 1 : 0;
    o.batch_invariant = 1;
    fce_outputs out = rb.outputs(c_.entropy);
    fce_gradients gr = FCE_GRADIENTS_INIT;
    gr.grad_output = rb.upstream.p<float>();
    gr.grad_hidden = grad_hidden.ptr();
    if (c_.grad_weight) gr.grad_weight = grad_weight.ptr();
    if (c_.grad_weight && c_.bias) gr.grad_bias = grad_bias.ptr();
    size_t lo = 0, opt = 0;
    EXPECT_EQ(fce_linear_ce_workspace_size(&o, n, D, V, true, &lo, &opt), FCE_SUCCESS)
        << fce_last_error();
    const size_t ws_bytes = ws_scale > 0    ? size_t(double(lo) * ws_scale)
                            : ws_scale == 0 ? opt
                                            : opt + (size_t(1) << 20);
    Buf ws = workspace_buf(ws_bytes);
    EXPECT_EQ(fce_linear_ce(&o, n, D, V, hidden.ptr(), weight_.ptr(),
                            c_.bias ? bias_.ptr() : nullptr, rb.targets.ptr(), &out, &gr,
                            ws_bytes ? ws.ptr() : nullptr, ws_bytes, test_stream()),
              FCE_SUCCESS)
        << fce_last_error() << " (rows " << n << ", workspace " << ws_bytes << ")";
    EXPECT_TRUE(finish());
    grad_hidden.pull();
    RowBytes r = rb.row(pos, c_.entropy);
    r.grad = bytes_at(grad_hidden, hm.offset(pos, 0), size_t(D) * hm.esize());
    return r;
  }

 private:
  LinCase c_;
  Buf weight_, bias_;
};

void check_linear(const LinCase& c) {
  SCOPED_TRACE(c.name);
  LinRun run(c);
  const int64_t probe = 321;
  const RowBytes alone = run.run({probe}, 0, 1.0);
  for (int64_t n : kBatchSizes)
    for (int64_t pos : {int64_t{0}, n / 2, n - 1}) {
      if (n == 1 && pos > 0) continue;
      EXPECT_TRUE(same_row(alone, run.run(batch_ids(n, pos, probe), pos, 1.0)))
          << "row " << probe << " at position " << pos << " of " << n;
    }
  // the workspace: the minimum, between, the optimum, more
  for (double scale : {1.5, 0.0, -1.0})
    EXPECT_TRUE(same_row(alone, run.run(batch_ids(4099, 2049, probe), 2049, scale)))
        << "workspace " << scale;
}

TEST_F(BatchInvariance, LinearF32) {
  check_linear({"f32 D=64 V=1536", FCE_FLOAT32, 64, 1536, true, true, false, true});
  if (on_cuda())
    check_linear({"f32 D=512 V=32000", FCE_FLOAT32, 512, 32000, false, true, false, false});
}
TEST_F(BatchInvariance, LinearBf16) {
  check_linear(
      {"bf16 D=96 V=1000, f32 grad_weight", FCE_BFLOAT16, 96, 1000, true, true, true, false});
  check_linear(
      {"bf16 D=64 V=2048, no grad_weight", FCE_BFLOAT16, 64, 2048, false, false, false, true});
  if (on_cuda()) {
    check_linear({"bf16 D=1024 V=50304, bf16 grad_weight", FCE_BFLOAT16, 1024, 50304, true, true,
                  false, false});
    check_linear({"f16 D=256 V=16384", FCE_FLOAT16, 256, 16384, false, true, true, true});
  }
}

// ------------------------------------------------------------------ refusals ----------------
TEST_F(BatchInvariance, DistillRefuses) {
  TestOptions o = test_options();
  o.batch_invariant = 1;
  fce_teacher t = FCE_TEACHER_INIT;
  size_t bytes = 0;
  EXPECT_EQ(fce_distill_workspace_size(&o, &t, 4, 16, &bytes), FCE_ERROR_UNSUPPORTED);
  EXPECT_TRUE(error_mentions("batch_invariant"));
  EXPECT_TRUE(error_mentions("fce_distill"));
}

}  // namespace
