// ce_runner.h — the case and the runner of test_ce*.cpp: fce_forward and fce_backward on one
// CeCase with every output poisoned, checked against the float64 reference (ref.h).
//
// Every case: realistic random logits (row std 1-30), every output poisoned before the call,
// then: every output element written, nothing outside the output elements touched (guards,
// row gaps, inputs, workspace guards), values within the dtype's bound (test_util.h,
// tolerance()), exact zeros for ignored rows, error flags, argmax and accuracy (check_ce.h),
// and fce_backward from the saved lse agreeing with the gradient fce_forward wrote: to the
// rounding of the saved lse on every backend (check_ce.h), bit for bit on the CPU backend; the
// backward leaves outputs->argmax and ->accuracy alone.
#pragma once

#include <functional>

#include "check_ce.h"

using namespace fcet;

namespace {

struct CeCase : CeSpec {
  CeCase() { N = 33, V = 517; }
  int64_t row_pad = 0;           // row_stride = V + row_pad
  int64_t grad_pad = 0;          // grad_row_stride = V + grad_pad
  bool explicit_stride = false;  // pass the strides even when dense (instead of 0)
  bool grad = true;
  bool inplace = false;          // grad_logits == logits
  int gout_zero_every = 0;       // set every n-th upstream value to 0
  bool lse = true, zloss = true, flags = true;
  bool deterministic = false;
  double std_lo = 1, std_hi = 30;
  bool backward = true;          // also check fce_backward from the saved lse
  std::function<void(const CeCase&, std::vector<double>& z, std::vector<int64_t>& y)> edit;
};

inline std::string case_label(const CeCase& c) {
  std::ostringstream s;
  s << spec_label(c) << " row_pad=" << c.row_pad << " grad_pad=" << c.grad_pad
    << (c.inplace ? " inplace" : "") << (c.gout ? " grad_output" : " grad_output=NULL") << "]";
  return s.str();
}

// gtest prints a failing parameter with this (instead of its bytes).
inline void PrintTo(const CeCase& c, std::ostream* os) { *os << case_label(c); }

inline CeData make_data(const CeCase& c) {
  CeData d = ce_data(c, c.std_lo, c.std_hi);
  if (c.gout_zero_every)
    for (size_t i = 0; i < d.g.size(); i += static_cast<size_t>(c.gout_zero_every)) d.g[i] = 0;
  if (c.edit) c.edit(c, d.z, d.y);
  return d;
}

inline fceref::Options ref_options(const CeCase& c, const CeData& d) { return reference_options(c, d.w); }

// What a forward call produced (the raw element bytes, for bitwise comparisons).
struct CeOut {
  std::vector<uint8_t> loss, lse, zloss, grad, argmax, accuracy;
};

class CeRunner {
 public:
  explicit CeRunner(CeCase c) : c_(std::move(c)), d_(make_data(c_)) {
    lm_ = mat(c_.dtype, c_.N, c_.V, c_.V + c_.row_pad);
    gm_ = c_.inplace ? lm_ : mat(c_.dtype, c_.N, c_.V, c_.V + c_.grad_pad);
    o_ = spec_options(c_);
    o_.deterministic = c_.deterministic;
    if (c_.row_pad || c_.explicit_stride || c_.inplace) o_.row_stride = lm_.stride;
    if (c_.grad_pad || c_.explicit_stride || c_.inplace) o_.grad_row_stride = gm_.stride;
    ref_ = fceref::cross_entropy(ref_options(c_, d_), c_.N, c_.V, d_.z, d_.y,
                                 d_.g.empty() ? nullptr : &d_.g, true);
    targets_ = targets_buf(d_.y, c_.tdtype);
    if (c_.weights) weights_ = f32_buf(d_.w);
    if (c_.gout) gout_ = f32_buf(d_.g);
    o_.class_weights = weights_.p<float>();
  }

  const CeCase& c() const { return c_; }
  const CeData& data() const { return d_; }
  const fceref::CeResult& ref() const { return ref_; }
  TestOptions& options() { return o_; }
  double tol() const { return tolerance(c_.dtype); }
  int64_t loss_len() const { return c_.reduction == FCE_REDUCTION_NONE ? c_.N : 1; }
  bool any_invalid() const {
    for (auto k : ref_.kind)
      if (k == fceref::kInvalid) return true;
    return false;
  }
  int64_t accuracy_len() const { return c_.reduction == FCE_REDUCTION_NONE ? c_.N : 1; }
  uint32_t expected_flags(uint32_t preset) const {
    return preset | (any_invalid() ? FCE_FLAG_TARGET_OUT_OF_RANGE : 0u);
  }

  // Logits with poison (NaN) in the row gaps: the library must never read them.
  Buf make_logits() const {
    Buf b(lm_);
    poison_all(b, c_.dtype);
    write_mat(b, lm_, d_.z);
    b.push();
    return b;
  }

  // fce_forward with every output poisoned; checks everything. ws_fill: the workspace garbage.
  void forward(CeOut* out = nullptr, uint8_t ws_fill = 0xFF) {
    SCOPED_TRACE(case_label(c_) + " fce_forward");
    Buf logits = make_logits();
    Mat loss_m = vec(FCE_FLOAT32, loss_len()), lse_m = vec(FCE_FLOAT32, c_.N),
        zl_m = vec(FCE_FLOAT32, 1);
    Buf loss = poisoned(loss_m);
    lse_ = c_.lse ? poisoned(lse_m) : Buf();
    Buf zl = c_.zloss ? poisoned(zl_m) : Buf();
    Buf grad = (c_.grad && !c_.inplace) ? poisoned(gm_) : Buf();
    void* grad_ptr = c_.grad ? (c_.inplace ? logits.ptr() : grad.ptr()) : nullptr;
    // The optional outputs live as long as the runner: backward() passes the same options.
    const Mat am_m = vec(FCE_INT64, c_.N), acc_m = vec(FCE_FLOAT32, accuracy_len());
    argmax_ = c_.argmax ? poisoned(am_m) : Buf();
    accuracy_ = c_.accuracy ? poisoned(acc_m) : Buf();
    o_.argmax = argmax_.p<int64_t>();
    o_.accuracy = accuracy_.p<float>();
    const uint32_t preset = 0x100u;  // the call ORs bits in, never clears
    Buf flags = flags_buf(preset);
    size_t wsb = 0;
    fce_status st = fce_forward_workspace_size(&o_, c_.N, c_.V, &wsb);
    ASSERT_EQ(st, FCE_SUCCESS) << fce_last_error();
    Buf ws = workspace_buf(wsb, ws_fill);

    auto b_logits = logits.mirror(), b_targets = targets_.mirror(), b_w = weights_.mirror(),
         b_g = gout_.mirror(), b_loss = loss.mirror(), b_lse = lse_.mirror(),
         b_zl = zl.mirror(), b_grad = grad.mirror(), b_am = argmax_.mirror(),
         b_acc = accuracy_.mirror();

    st = flat::forward(&o_, c_.N, c_.V, logits.ptr(), targets_.ptr(), loss.p<float>(),
                     lse_.p<float>(), zl.p<float>(), grad_ptr, gout_.p<float>(),
                     c_.flags ? flags.p<uint32_t>() : nullptr, ws.ptr(), wsb, test_stream());
    ASSERT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    ASSERT_TRUE(finish());
    for (Buf* b : {&logits, &targets_, &weights_, &gout_, &loss, &lse_, &zl, &grad, &flags, &ws,
                   &argmax_, &accuracy_})
      b->pull();

    // Inputs untouched (in place: only the gradient's elements changed).
    if (c_.inplace) {
      EXPECT_TRUE(only_elements_changed(logits, b_logits, &lm_, "logits (in place)"));
    } else {
      EXPECT_TRUE(unchanged(logits, b_logits, "logits"));
    }
    EXPECT_TRUE(unchanged(targets_, b_targets, "targets"));
    EXPECT_TRUE(unchanged(weights_, b_w, "class_weights"));
    EXPECT_TRUE(unchanged(gout_, b_g, "grad_output"));
    if (!ws.empty()) { EXPECT_TRUE(guards_intact(ws, "workspace")); }

    // Loss.
    EXPECT_TRUE(only_elements_changed(loss, b_loss, &loss_m, "loss"));
    EXPECT_TRUE(all_written(loss, loss_m, "loss"));
    std::vector<double> lv = read_mat(loss, loss_m);
    if (c_.reduction == FCE_REDUCTION_NONE) {
      EXPECT_TRUE(close_normwise(lv, ref_.row_loss, tol(), "loss (per row)"));
      for (int64_t r = 0; r < c_.N; ++r)
        if (ref_.kind[static_cast<size_t>(r)] == fceref::kIgnored) {
          EXPECT_EQ(lv[static_cast<size_t>(r)], 0.0) << "ignored row " << r << " loss";
        }
    } else {
      EXPECT_TRUE(close_scalar(lv[0], ref_.loss, tol(), "loss (reduced)"));
    }
    // lse (every row, ignored ones too).
    if (c_.lse) {
      EXPECT_TRUE(only_elements_changed(lse_, b_lse, &lse_m, "lse"));
      EXPECT_TRUE(all_written(lse_, lse_m, "lse"));
      EXPECT_TRUE(close_normwise(read_mat(lse_, lse_m), ref_.lse, tol(), "lse"));
    }
    // z-loss total.
    if (c_.zloss) {
      EXPECT_TRUE(only_elements_changed(zl, b_zl, &zl_m, "z_loss"));
      EXPECT_TRUE(all_written(zl, zl_m, "z_loss"));
      EXPECT_TRUE(close_scalar(read_mat(zl, zl_m)[0], ref_.z_loss, tol(), "z_loss"));
    }
    // Gradient.
    if (c_.grad) {
      Buf& gb = c_.inplace ? logits : grad;
      if (!c_.inplace) {
        EXPECT_TRUE(only_elements_changed(grad, b_grad, &gm_, "grad_logits"));
        EXPECT_TRUE(all_written(grad, gm_, "grad_logits"));
      }
      check_grad(gb, gm_, "grad_logits (fce_forward)");
      if (out) out->grad = raw_elements(gb, gm_);
    }
    // Error flags: OR-ed in, never cleared.
    if (c_.flags) {
      EXPECT_EQ(read_flags(flags), expected_flags(preset)) << "error_flags";
      EXPECT_TRUE(guards_intact(flags, "error_flags"));
    }
    // Argmax and accuracy (docs/semantics.md rule 15).
    std::vector<int64_t> am;
    if (c_.argmax) {
      EXPECT_TRUE(only_elements_changed(argmax_, b_am, &am_m, "outputs->argmax"));
      EXPECT_TRUE(all_written(argmax_, am_m, "outputs->argmax"));
      am = read_i64(argmax_, c_.N);
      EXPECT_TRUE(argmax_matches(am, ref_, c_.V, kArgmaxTie, nullptr));
    }
    if (c_.accuracy) {
      EXPECT_TRUE(only_elements_changed(accuracy_, b_acc, &acc_m, "outputs->accuracy"));
      EXPECT_TRUE(all_written(accuracy_, acc_m, "outputs->accuracy"));
      EXPECT_TRUE(accuracy_matches(read_mat(accuracy_, acc_m), c_.reduction, ref_,
                                   c_.argmax ? &am : nullptr, c_.V, kArgmaxTie));
    }
    if (out) {
      if (c_.argmax) out->argmax = raw_elements(argmax_, am_m);
      if (c_.accuracy) out->accuracy = raw_elements(accuracy_, acc_m);
      out->loss = raw_elements(loss, loss_m);
      if (c_.lse) out->lse = raw_elements(lse_, lse_m);
      if (c_.zloss) out->zloss = raw_elements(zl, zl_m);
    }
  }

  // fce_backward from the lse the last forward() saved, with the forward's options (argmax and
  // accuracy included: never written); compares with the reference and with the gradient
  // forward wrote (fwd_grad): to the rounding of the saved lse (docs/semantics.md rule 12), bit for
  // bit on the CPU backend (its backward reduces each row again in double and, where that rounds
  // to the saved lse, uses it).
  void backward(bool inplace, const std::vector<uint8_t>* fwd_grad, std::vector<uint8_t>* out = nullptr,
                uint8_t ws_fill = 0xFF) {
    SCOPED_TRACE(case_label(c_) + (inplace ? " fce_backward (in place)" : " fce_backward"));
    ASSERT_FALSE(lse_.empty()) << "backward() needs forward() with lse first";
    TestOptions o = o_;
    Mat gm = inplace ? lm_ : gm_;
    if (inplace) o.grad_row_stride = lm_.stride, o.row_stride = lm_.stride;
    Buf logits = make_logits();
    Buf grad = inplace ? Buf() : poisoned(gm);
    void* grad_ptr = inplace ? logits.ptr() : grad.ptr();
    Buf flags(4, 0);
    size_t wsb = 0;
    fce_status st = fce_backward_workspace_size(&o, c_.N, c_.V, &wsb);
    ASSERT_EQ(st, FCE_SUCCESS) << fce_last_error();
    Buf ws = workspace_buf(wsb, ws_fill);
    auto b_logits = logits.mirror(), b_lse = lse_.mirror(), b_targets = targets_.mirror(),
         b_grad = grad.mirror(), b_g = gout_.mirror(), b_am = argmax_.mirror(),
         b_acc = accuracy_.mirror();
    st = flat::backward(&o, c_.N, c_.V, logits.ptr(), targets_.ptr(), lse_.p<float>(),
                      gout_.p<float>(), grad_ptr, flags.p<uint32_t>(), ws.ptr(), wsb,
                      test_stream());
    ASSERT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    ASSERT_TRUE(finish());
    for (Buf* b : {&logits, &lse_, &targets_, &grad, &flags, &ws, &gout_, &argmax_, &accuracy_})
      b->pull();
    EXPECT_TRUE(unchanged(lse_, b_lse, "lse (input of fce_backward)"));
    EXPECT_TRUE(unchanged(argmax_, b_am, "outputs->argmax (not an output of fce_backward)"));
    EXPECT_TRUE(unchanged(accuracy_, b_acc, "outputs->accuracy (not an output of fce_backward)"));
    EXPECT_TRUE(unchanged(targets_, b_targets, "targets"));
    EXPECT_TRUE(unchanged(gout_, b_g, "grad_output"));
    if (!ws.empty()) { EXPECT_TRUE(guards_intact(ws, "workspace")); }
    Buf& gb = inplace ? logits : grad;
    if (inplace) {
      EXPECT_TRUE(only_elements_changed(logits, b_logits, &lm_, "logits (in place)"));
    } else {
      EXPECT_TRUE(unchanged(logits, b_logits, "logits"));
      EXPECT_TRUE(only_elements_changed(grad, b_grad, &gm, "grad_logits"));
      EXPECT_TRUE(all_written(grad, gm, "grad_logits"));
    }
    check_grad(gb, gm, inplace ? "grad_logits (fce_backward, in place)" : "grad_logits (fce_backward)");
    EXPECT_EQ(read_flags(flags), expected_flags(0)) << "error_flags (fce_backward)";
    std::vector<uint8_t> mine = raw_elements(gb, gm);
    if (fwd_grad) {
      if (!on_cuda()) {
        EXPECT_TRUE(bitwise_equal(mine, *fwd_grad, "fce_backward vs fce_forward gradient"));
      }
      // Every backend: element by element within the rounding of the saved lse.
      std::vector<double> a, b;
      for (size_t i = 0; i < mine.size(); i += gm.esize()) {
        a.push_back(get(gm.dtype, mine.data() + i));
        b.push_back(get(gm.dtype, fwd_grad->data() + i));
      }
      EXPECT_TRUE(backward_matches_forward(a, b, ref_, ref_options(c_, d_), c_.V,
                                           d_.g.empty() ? nullptr : &d_.g, c_.dtype));
    }
    if (out) *out = std::move(mine);
  }

 private:
  void check_grad(const Buf& gb, const Mat& gm, const char* what) {
    std::vector<double> gv = read_mat(gb, gm);
    EXPECT_TRUE(close_normwise(gv, ref_.grad, tol(), what));
    for (int64_t r = 0; r < c_.N; ++r)
      if (ref_.kind[static_cast<size_t>(r)] == fceref::kIgnored)
        for (int64_t j = 0; j < c_.V; ++j)
          if (gv[static_cast<size_t>(r * c_.V + j)] != 0.0) {
            ADD_FAILURE() << what << ": ignored row " << r << " has gradient "
                          << gv[static_cast<size_t>(r * c_.V + j)] << " at " << j;
            break;
          }
  }

  CeCase c_;
  CeData d_;
  Mat lm_, gm_;
  TestOptions o_;
  fceref::CeResult ref_;
  Buf targets_, weights_, gout_, lse_, argmax_, accuracy_;
};

// forward (+ backward from the saved lse when the case has a gradient and lse).
inline void run_case(const CeCase& c) {
  CeRunner run(c);
  CeOut out;
  ASSERT_NO_FATAL_FAILURE(run.forward(&out));
  if (c.grad && c.lse && c.backward && !c.inplace) {
    ASSERT_NO_FATAL_FAILURE(run.backward(false, &out.grad));
  }
}

}  // namespace

// The fixture of test_ce's single tests (one type for every source of the executable).
class Ce : public fcet::BackendTest {};
