// test_ce.cpp — fce_forward and fce_backward against the float64 reference (ref.h), on the
// backend FCE_TEST_BACKEND selects (cpu by default, cuda).
//
// Every case: realistic random logits (row std 1-30), every output poisoned before the call,
// then: every output element written, nothing outside the output elements touched (guards,
// row gaps, inputs, workspace guards), values within the dtype's bound (test_util.h,
// tolerance()), exact zeros for ignored rows, error flags, argmax and accuracy (check_ce.h),
// and fce_backward from the saved lse agreeing with the gradient fce_forward wrote: to the
// rounding of the saved lse on every backend (check_ce.h), bit for bit on the CPU backend; the
// backward leaves outputs->argmax and ->accuracy alone.
#include <atomic>
#include <functional>
#include <thread>

#include "check_ce.h"

using namespace fcet;

namespace {

struct CeCase {
  std::string name;
  int64_t N = 33, V = 517;
  int dtype = FCE_FLOAT32;
  int tdtype = FCE_INT64;
  int reduction = FCE_REDUCTION_MEAN;
  float eps = 0, lambda = 0, softcap = 0, scale = 1;
  bool weights = false;
  double ignore_frac = 0;
  int64_t ignore_index = -100;
  int64_t shift = 0;             // shift_seq_len T
  int64_t shift_k = 0;           // options.shift k (0 = 1), with T > 0
  bool token_scaling = false;
  bool argmax = false, accuracy = false;  // options.argmax / options.accuracy asked for
  int64_t row_pad = 0;           // row_stride = V + row_pad
  int64_t grad_pad = 0;          // grad_row_stride = V + grad_pad
  bool explicit_stride = false;  // pass the strides even when dense (instead of 0)
  bool grad = true;
  bool inplace = false;          // grad_logits == logits
  bool gout = true;              // grad_output given (else NULL = 1)
  float gscale = 0.7f;           // its value for mean / sum
  int gout_zero_every = 0;       // set every n-th upstream value to 0
  bool lse = true, zloss = true, flags = true;
  bool deterministic = false;
  double std_lo = 1, std_hi = 30;
  uint64_t seed = 1;
  bool backward = true;          // also check fce_backward from the saved lse
  std::function<void(const CeCase&, std::vector<double>& z, std::vector<int64_t>& y)> edit;
};

std::string case_label(const CeCase& c) {
  std::ostringstream s;
  s << c.name << " [" << backend_name() << " " << dtype_name(c.dtype) << " "
    << dtype_name(c.tdtype) << " " << reduction_name(c.reduction) << " N=" << c.N
    << " V=" << c.V << " eps=" << c.eps << " lambda=" << c.lambda << " softcap=" << c.softcap
    << " scale=" << c.scale << (c.weights ? " weights" : "") << " shift=" << c.shift
    << " k=" << c.shift_k << (c.token_scaling ? " token_scaling" : "")
    << (c.argmax ? " argmax" : "") << (c.accuracy ? " accuracy" : "") << " row_pad=" << c.row_pad << " grad_pad=" << c.grad_pad << (c.inplace ? " inplace" : "")
    << (c.gout ? " grad_output" : " grad_output=NULL") << "]";
  return s.str();
}

// gtest prints a failing parameter with this (instead of its bytes).
void PrintTo(const CeCase& c, std::ostream* os) { *os << case_label(c); }

struct CeData {
  std::vector<double> z;  // dense [N * V], rounded to the dtype
  std::vector<int64_t> y;
  std::vector<double> w;  // class weights (float32 values) or empty
  std::vector<double> g;  // upstream gradient or empty
};

CeData make_data(const CeCase& c) {
  CeData d;
  std::mt19937_64 rng(c.seed * 1000003u + static_cast<uint64_t>(c.N * 131 + c.V));
  d.z = random_logits(rng, c.dtype, c.N, c.V, c.std_lo, c.std_hi);
  d.y = random_targets(rng, c.N, c.V, c.ignore_frac, c.ignore_index);
  if (c.weights) d.w = random_uniform(rng, static_cast<size_t>(c.V), 0.1, 2.0);
  if (c.gout) {
    if (c.reduction == FCE_REDUCTION_NONE) d.g = random_uniform(rng, static_cast<size_t>(c.N), -1.5, 1.5);
    else d.g = {c.gscale};
    if (c.gout_zero_every)
      for (size_t i = 0; i < d.g.size(); i += static_cast<size_t>(c.gout_zero_every)) d.g[i] = 0;
  }
  if (c.edit) c.edit(c, d.z, d.y);
  return d;
}

fceref::Options ref_options(const CeCase& c, const CeData& d) {
  fceref::Options r;
  r.reduction = c.reduction;
  r.label_smoothing = c.eps;
  r.z_loss_scale = c.lambda;
  r.softcap = c.softcap;
  r.logit_scale = c.scale;
  r.class_weights = d.w;
  r.ignore_index = c.ignore_index;
  r.shift_seq_len = c.shift;
  r.shift = c.shift_k;
  r.token_scaling = c.token_scaling;
  return r;
}

// Raw bytes of the elements of m (for bitwise comparisons across layouts).
std::vector<uint8_t> raw_elements(const Buf& b, const Mat& m) {
  std::vector<uint8_t> out;
  for (int64_t r = 0; r < m.rows; ++r)
    out.insert(out.end(), b.h() + m.offset(r, 0), b.h() + m.offset(r, 0) + m.cols * m.esize());
  return out;
}

::testing::AssertionResult guards_intact(const Buf& b, const char* what) {
  const auto& mm = b.mirror();
  for (size_t i = 0; i < kGuard; ++i)
    if (mm[i] != kGuardByte || mm[kGuard + b.size() + i] != kGuardByte)
      return ::testing::AssertionFailure() << what << ": guard bytes around it were overwritten";
  return ::testing::AssertionSuccess();
}

// What a forward call produced (the raw element bytes, for bitwise comparisons).
struct CeOut {
  std::vector<uint8_t> loss, lse, zloss, grad, argmax, accuracy;
};

// Relative width of an argmax near tie (check_ce.h): a few float32 roundings of a = s z, capped
// (tanhf, the product with s/c), on the CUDA backend.
constexpr double kArgmaxTie = 16.0 / 16777216.0;

class CeRunner {
 public:
  explicit CeRunner(CeCase c) : c_(std::move(c)), d_(make_data(c_)) {
    lm_ = mat(c_.dtype, c_.N, c_.V, c_.V + c_.row_pad);
    gm_ = c_.inplace ? lm_ : mat(c_.dtype, c_.N, c_.V, c_.V + c_.grad_pad);
    o_ = test_options();
    o_.dtype = c_.dtype;
    o_.target_dtype = c_.tdtype;
    o_.reduction = c_.reduction;
    o_.label_smoothing = c_.eps;
    o_.z_loss_scale = c_.lambda;
    o_.softcap = c_.softcap;
    o_.logit_scale = c_.scale;
    o_.ignore_index = c_.ignore_index;
    o_.shift_seq_len = c_.shift;
    o_.shift = c_.shift_k;
    o_.token_scaling = c_.token_scaling;
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
    Buf flags(4, 0);
    std::memcpy(flags.h(), &preset, 4);
    flags.push();
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
      uint32_t f;
      std::memcpy(&f, flags.h(), 4);
      EXPECT_EQ(f, expected_flags(preset)) << "error_flags";
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
    uint32_t f;
    std::memcpy(&f, flags.h(), 4);
    EXPECT_EQ(f, expected_flags(0)) << "error_flags (fce_backward)";
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
void run_case(const CeCase& c) {
  CeRunner run(c);
  CeOut out;
  ASSERT_NO_FATAL_FAILURE(run.forward(&out));
  if (c.grad && c.lse && c.backward && !c.inplace) {
    ASSERT_NO_FATAL_FAILURE(run.backward(false, &out.grad));
  }
}

// ------------------------------------------------------------------ the option matrix -------
struct OptionSet {
  const char* name;
  std::function<void(CeCase&)> apply;
};

// Every other row's target becomes its argmax (unless ignored): rows predicted right, p_y large.
void confident_targets(const CeCase& c, std::vector<double>& z, std::vector<int64_t>& y) {
  for (int64_t r = 0; r < c.N; r += 2) {
    const double* row = &z[static_cast<size_t>(r * c.V)];
    if (y[static_cast<size_t>(r)] != c.ignore_index)
      y[static_cast<size_t>(r)] = std::max_element(row, row + c.V) - row;
  }
}

const std::vector<OptionSet>& option_sets() {
  static const std::vector<OptionSet> sets = {
      {"plain", [](CeCase&) {}},
      {"ignored_int32_gradoutput_null",
       [](CeCase& c) { c.tdtype = FCE_INT32; c.ignore_frac = 0.3; c.gout = false; }},
      {"custom_ignore_index", [](CeCase& c) { c.ignore_index = 3; c.ignore_frac = 0.25; }},
      {"weights_label_smoothing",
       [](CeCase& c) { c.weights = true; c.eps = 0.1f; c.ignore_frac = 0.1; }},
      {"label_smoothing", [](CeCase& c) { c.eps = 0.2f; }},
      {"weights", [](CeCase& c) { c.weights = true; c.tdtype = FCE_INT32; }},
      {"zloss", [](CeCase& c) { c.lambda = 1e-3f; c.ignore_frac = 0.1; }},
      {"softcap", [](CeCase& c) { c.softcap = 30.0f; }},
      {"softcap_scale", [](CeCase& c) { c.softcap = 15.0f; c.scale = 0.6f; }},
      {"logit_scale", [](CeCase& c) { c.scale = 2.5f; c.std_hi = 10; }},
      {"negative_logit_scale", [](CeCase& c) { c.scale = -0.75f; }},
      {"shift", [](CeCase& c) { c.shift = 8; c.N = 32; c.ignore_frac = 0.1; }},
      {"shift_k1_explicit", [](CeCase& c) { c.shift = 8; c.shift_k = 1; c.N = 32; }},
      {"shift_k2", [](CeCase& c) { c.shift = 8; c.shift_k = 2; c.N = 32; c.ignore_frac = 0.1; }},
      {"shift_k3", [](CeCase& c) { c.shift = 11; c.shift_k = 3; c.N = 33; c.argmax = true; }},
      // Token scaling multiplies each row by its p_y: with random targets most rows' p_y are
      // tiny and their gradients float16 subnormals (the bound is for normal numbers); every
      // other row's target is its argmax here (p_y large), and the spread is at most 5.
      {"token_scaling",
       [](CeCase& c) {
         c.token_scaling = true; c.ignore_frac = 0.1; c.std_hi = 5; c.edit = confident_targets;
       }},
      {"token_scaling_zloss_smoothing",
       [](CeCase& c) {
         c.token_scaling = true; c.lambda = 1e-3f; c.eps = 0.1f; c.ignore_frac = 0.1;
         c.std_hi = 5;  // t = p_y: keep some rows with p_y not vanishing
       }},
      {"argmax_accuracy", [](CeCase& c) { c.argmax = c.accuracy = true; c.ignore_frac = 0.2; }},
      {"accuracy_only", [](CeCase& c) { c.accuracy = true; c.ignore_frac = 0.2; }},
      {"argmax_accuracy_confident",  // many rows predicted right: accuracy well above 0
       [](CeCase& c) { c.argmax = c.accuracy = true; c.ignore_frac = 0.1; c.edit = confident_targets; }},
      {"weights_zloss",  // the z-loss's mean divides by n, the ce's by sum of weights
       [](CeCase& c) { c.weights = true; c.lambda = 1e-3f; c.ignore_frac = 0.15; }},
      {"strided", [](CeCase& c) { c.row_pad = 13; c.grad_pad = 5; }},
      {"explicit_dense_strides", [](CeCase& c) { c.explicit_stride = true; }},
      {"inplace", [](CeCase& c) { c.inplace = true; }},
      {"inplace_strided", [](CeCase& c) { c.inplace = true; c.row_pad = 3; }},
      {"loss_only", [](CeCase& c) { c.grad = false; c.zloss = false; }},
      {"no_lse_no_flags", [](CeCase& c) { c.lse = false; c.flags = false; }},
      {"everything",
       [](CeCase& c) {
         c.tdtype = FCE_INT32; c.weights = true; c.eps = 0.05f; c.lambda = 1e-4f;
         c.softcap = 20.0f; c.scale = 1.3f; c.shift = 4; c.N = 36; c.ignore_frac = 0.15;
         c.row_pad = 7; c.grad_pad = 2; c.deterministic = true;
       }},
      {"everything_03",
       [](CeCase& c) {
         c.tdtype = FCE_INT32; c.weights = true; c.eps = 0.05f; c.lambda = 1e-4f;
         c.softcap = 20.0f; c.scale = 1.3f; c.shift = 6; c.shift_k = 2; c.N = 36;
         c.ignore_frac = 0.15; c.token_scaling = true; c.argmax = c.accuracy = true;
         c.row_pad = 7; c.grad_pad = 2; c.deterministic = true; c.std_hi = 8;
       }},
      {"everything_03_inplace",
       [](CeCase& c) {
         c.weights = true; c.eps = 0.1f; c.lambda = 2e-4f; c.softcap = 30.0f; c.scale = 0.8f;
         c.shift = 11; c.shift_k = 3; c.N = 33; c.ignore_frac = 0.1; c.row_pad = 5;
         c.inplace = true; c.token_scaling = true; c.argmax = c.accuracy = true; c.std_hi = 8;
       }},
      {"everything_inplace",
       [](CeCase& c) {
         c.weights = true; c.eps = 0.1f; c.lambda = 2e-4f; c.softcap = 30.0f; c.scale = 0.8f;
         c.shift = 11; c.N = 33; c.ignore_frac = 0.1; c.row_pad = 5; c.inplace = true;
       }},
  };
  return sets;
}

std::vector<CeCase> matrix_cases() {
  std::vector<CeCase> cases;
  uint64_t seed = 1;
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16})
    for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE})
      for (const OptionSet& s : option_sets()) {
        CeCase c;
        c.dtype = dtype;
        c.reduction = red;
        c.seed = seed++;
        s.apply(c);
        c.name = std::string(dtype_name(dtype)) + "_" + reduction_name(red) + "_" + s.name;
        cases.push_back(c);
      }
  return cases;
}

class CeMatrix : public ::testing::TestWithParam<CeCase> {
 protected:
  void SetUp() override { FCE_REQUIRE_BACKEND(); }
};

TEST_P(CeMatrix, ForwardAndBackwardMatchReference) { run_case(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Options, CeMatrix, ::testing::ValuesIn(matrix_cases()),
                         [](const ::testing::TestParamInfo<CeCase>& i) { return i.param.name; });

// ------------------------------------------------------------------ corner cases ------------
class Ce : public BackendTest {};

const int kDtypes[] = {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16};
const int kReductions[] = {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE};

// Every row ignored: loss 0 (mean -> 0, not NaN), z_loss 0, zero gradient, lse still written.
TEST_F(Ce, AllRowsIgnored) {
  for (int dtype : kDtypes)
    for (int red : kReductions) {
      CeCase c;
      c.name = "all_ignored";
      c.dtype = dtype;
      c.reduction = red;
      c.weights = true;
      c.eps = 0.1f;
      c.lambda = 1e-3f;
      c.N = 9;
      c.V = 70;
      c.ignore_frac = 1.0;
      run_case(c);
      // Shift with T = 1: every row is the last of its sequence.
      c.name = "all_ignored_by_shift_T1";
      c.ignore_frac = 0;
      c.shift = 1;
      run_case(c);
      // All ignored with a custom ignore_index.
      c.name = "all_ignored_custom_index";
      c.shift = 0;
      c.ignore_index = 12345;
      c.ignore_frac = 1.0;
      run_case(c);
    }
}

TEST_F(Ce, SingleRow) {
  for (int dtype : kDtypes)
    for (int red : kReductions)
      for (int64_t V : {1, 7, 517}) {
        CeCase c;
        c.name = "N1";
        c.dtype = dtype;
        c.reduction = red;
        c.N = 1;
        c.V = V;
        c.eps = 0.1f;
        c.lambda = 1e-4f;
        run_case(c);
        c.name = "N1_shift";  // one row, T = 1: ignored
        c.shift = 1;
        run_case(c);
      }
}

TEST_F(Ce, OddVocabularies) {
  for (int dtype : kDtypes)
    for (int64_t V : {1, 2, 3, 7, 50257}) {
      CeCase c;
      c.name = "odd_vocab";
      c.dtype = dtype;
      c.reduction = FCE_REDUCTION_NONE;
      c.N = 3;
      c.V = V;
      c.weights = true;
      c.eps = 0.1f;
      c.lambda = 1e-4f;
      run_case(c);
      c.reduction = FCE_REDUCTION_MEAN;
      c.row_pad = 1;
      c.grad_pad = 3;
      c.softcap = 30.0f;
      run_case(c);
    }
}

TEST_F(Ce, BiggerShapes) {
  for (int dtype : kDtypes) {
    CeCase c;
    c.name = "bigger";
    c.dtype = dtype;
    c.N = 131;
    c.V = 4099;
    c.eps = 0.1f;
    c.lambda = 1e-4f;
    c.ignore_frac = 0.05;
    run_case(c);
  }
}

// Long rows: float32 rows of 512 KB to 1 MB (on sm_90 a cluster of 16 CTAs holds each; the
// other backends and devices take their usual paths) and 16-bit rows past 512 KB, aligned and
// not, with and without every option the register path treats apart (smoothing and weights:
// its general mode; the argmax: the barrier exchange; in place; a padded stride).
TEST_F(Ce, LongRows) {
  struct Shape {
    int dtype;
    int64_t V;
  };
  for (Shape sh : {Shape{FCE_FLOAT32, 151936}, Shape{FCE_FLOAT32, 200003},
                   Shape{FCE_FLOAT32, 262144}, Shape{FCE_FLOAT32, 262145},
                   Shape{FCE_BFLOAT16, 300001}}) {
    CeCase c;
    c.name = "long_rows";
    c.dtype = sh.dtype;
    c.N = 5;
    c.V = sh.V;
    c.ignore_frac = 0.2;
    c.std_hi = 8;
    run_case(c);
    c.name = "long_rows_options";
    c.weights = true;
    c.eps = 0.1f;
    c.lambda = 1e-4f;
    c.argmax = c.accuracy = true;
    c.row_pad = 3;
    c.reduction = FCE_REDUCTION_NONE;
    run_case(c);
    c.name = "long_rows_inplace";
    c.weights = false;
    c.eps = 0;
    c.argmax = c.accuracy = false;
    c.row_pad = 0;
    c.inplace = true;
    c.reduction = FCE_REDUCTION_SUM;
    run_case(c);
  }
}

// Rows built to be hard: +-1e4 (well separated), -inf entries, constant rows, one huge
// outlier; targets never on a -inf entry (its loss would be +inf).
void extreme_edit(const CeCase& c, std::vector<double>& z, std::vector<int64_t>& y) {
  const int64_t V = c.V;
  auto at = [&](int64_t r, int64_t j) -> double& { return z[static_cast<size_t>(r * V + j)]; };
  for (int64_t j = 0; j < V; ++j) {  // row 0: a permutation of -1e4 .. 1e4, 2e4/V apart
    int64_t k = (j * 37) % V;
    at(0, j) = round_to(c.dtype, -1e4 + 2e4 * static_cast<double>(k) / static_cast<double>(V - 1));
  }
  for (int64_t j = 0; j < V; ++j)  // row 1: every 3rd entry -inf
    if (j % 3 == 1) at(1, j) = -HUGE_VAL;
  y[1] = 3 * (y[1] / 3 % (V / 3));  // j % 3 == 0: finite
  // Constant rows stay moderate here (the huge ones, ±1e30 and ±3e38, are
  // test_adversarial.cpp's, with error measures made for them).
  for (int64_t j = 0; j < V; ++j) at(2, j) = 2.5;    // row 2: constant
  for (int64_t j = 0; j < V; ++j) at(3, j) = -60.0;  // row 3: constant, negative
  at(4, V / 2) = 1e4;                                 // row 4: one huge outlier
  y[5] = V / 2;
  at(5, V / 2) = 1e4;                                 // row 5: outlier at the target
  for (int64_t j = 0; j < V; ++j)                     // row 6: all -inf but the target
    if (j != y[6]) at(6, j) = -HUGE_VAL;
  for (int64_t j = 0; j < V; ++j)                     // row 7: -1e4 but one entry 1e4
    at(7, j) = (j == 5) ? 1e4 : -1e4;
  y[7] = 6;                                           // loss 2e4
}

TEST_F(Ce, ExtremeLogits) {
  for (int dtype : kDtypes)
    for (int red : kReductions) {
      CeCase c;
      c.name = "extreme";
      c.dtype = dtype;
      c.reduction = red;
      c.N = 12;
      c.V = 97;
      c.lambda = 1e-4f;
      c.edit = extreme_edit;
      run_case(c);
      // With a softcap every entry becomes finite (-inf -> -c), so smoothing is fine too.
      c.name = "extreme_softcap_smoothing";
      c.softcap = 30.0f;
      c.eps = 0.1f;
      c.weights = true;
      run_case(c);
      c.name = "extreme_strided";
      c.softcap = 0;
      c.eps = 0;
      c.row_pad = 4;
      c.grad_pad = 9;
      run_case(c);
    }
}

// A row of all -inf: lse = -inf and its loss NaN (docs/semantics.md rule 10); other rows intact.
TEST_F(Ce, AllNegativeInfinityRow) {
  for (int dtype : kDtypes) {
    CeCase c;
    c.name = "all_neg_inf_row";
    c.dtype = dtype;
    c.reduction = FCE_REDUCTION_NONE;
    c.N = 5;
    c.V = 40;
    c.grad = false;
    c.edit = [](const CeCase& cc, std::vector<double>& z, std::vector<int64_t>&) {
      for (int64_t j = 0; j < cc.V; ++j) z[static_cast<size_t>(2 * cc.V + j)] = -HUGE_VAL;
    };
    CeRunner run(c);
    ASSERT_TRUE(std::isinf(run.ref().lse[2]) && run.ref().lse[2] < 0);
    ASSERT_TRUE(std::isnan(run.ref().row_loss[2]));
    run.forward();
  }
}

// Targets outside [0, V): NaN row loss and gradient row, NaN reduced loss, the flag, the row
// counted 1 in the mean's denominator, every other row intact.
TEST_F(Ce, OutOfRangeTargets) {
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (int tdtype : {FCE_INT32, FCE_INT64})
      for (int red : kReductions)
        for (bool flags : {true, false}) {
          CeCase c;
          c.name = "out_of_range";
          c.dtype = dtype;
          c.tdtype = tdtype;
          c.reduction = red;
          c.flags = flags;
          c.N = 24;
          c.V = 301;
          c.weights = true;
          c.eps = 0.1f;
          c.lambda = 1e-3f;
          c.ignore_frac = 0.2;
          c.edit = [](const CeCase& cc, std::vector<double>&, std::vector<int64_t>& y) {
            y[1] = cc.V;
            y[4] = -1;
            y[7] = -101;
            y[9] = cc.V + 1000;
            if (cc.tdtype == FCE_INT64) {
              y[12] = (int64_t{1} << 32) + 1;  // a valid class if truncated to 32 bits
              y[15] = INT64_MAX;
              y[18] = INT64_MIN;
            } else {
              y[12] = INT32_MAX;
              y[15] = INT32_MIN;
            }
          };
          run_case(c);
        }
}

TEST_F(Ce, OutOfRangeTargetsWithShift) {
  CeCase c;
  c.name = "out_of_range_shift";
  c.reduction = FCE_REDUCTION_MEAN;
  c.N = 24;
  c.V = 100;
  c.shift = 6;
  c.edit = [](const CeCase& cc, std::vector<double>&, std::vector<int64_t>& y) {
    y[3] = cc.V;   // read by row 2
    y[6] = 100000; // would be read by row 5 = the last of its sequence: ignored, no flag
  };
  CeRunner run(c);
  ASSERT_EQ(run.ref().kind[2], fceref::kInvalid);
  ASSERT_EQ(run.ref().kind[5], fceref::kIgnored);
  run.forward();
  // Only y[6] out of range (never read): no NaN, no flag.
  CeCase d = c;
  d.edit = [](const CeCase&, std::vector<double>&, std::vector<int64_t>& y) { y[6] = 100000; };
  CeRunner run2(d);
  ASSERT_FALSE(run2.any_invalid());
  CeOut out;
  run2.forward(&out);
  run2.backward(false, &out.grad);
}

// grad_output = 0: a zero gradient (exactly). Also per-row for none with zeros mixed in.
TEST_F(Ce, ZeroUpstreamGradient) {
  for (int red : kReductions) {
    CeCase c;
    c.name = "zero_upstream";
    c.reduction = red;
    c.gout_zero_every = 1;
    c.eps = 0.1f;
    c.lambda = 1e-3f;
    run_case(c);
  }
  CeCase c;
  c.name = "per_row_upstream_with_zeros";
  c.reduction = FCE_REDUCTION_NONE;
  c.gout_zero_every = 3;
  run_case(c);
}

// fce_backward writing over the logits it reads.
TEST_F(Ce, BackwardInPlace) {
  for (int dtype : kDtypes)
    for (int red : kReductions) {
      CeCase c;
      c.name = "backward_inplace";
      c.dtype = dtype;
      c.reduction = red;
      c.weights = true;
      c.eps = 0.1f;
      c.lambda = 1e-4f;
      c.softcap = 30.0f;
      c.row_pad = 6;
      c.ignore_frac = 0.1;
      CeRunner run(c);
      CeOut out;
      ASSERT_NO_FATAL_FAILURE(run.forward(&out));
      ASSERT_NO_FATAL_FAILURE(run.backward(true, &out.grad));
    }
}

// Two identical calls give bitwise-identical outputs, whatever garbage the workspace holds.
TEST_F(Ce, Deterministic) {
  for (int dtype : kDtypes)
    for (int red : kReductions) {
      CeCase c;
      c.name = "deterministic";
      c.dtype = dtype;
      c.reduction = red;
      c.N = 131;
      c.V = 2053;
      c.weights = true;
      c.eps = 0.1f;
      c.lambda = 1e-4f;
      c.ignore_frac = 0.1;
      c.deterministic = true;
      c.argmax = c.accuracy = true;
      CeRunner run(c);
      CeOut a, b;
      ASSERT_NO_FATAL_FAILURE(run.forward(&a, 0xFF));
      ASSERT_NO_FATAL_FAILURE(run.forward(&b, 0x00));
      EXPECT_TRUE(bitwise_equal(a.loss, b.loss, "loss"));
      EXPECT_TRUE(bitwise_equal(a.lse, b.lse, "lse"));
      EXPECT_TRUE(bitwise_equal(a.zloss, b.zloss, "z_loss"));
      EXPECT_TRUE(bitwise_equal(a.grad, b.grad, "grad_logits"));
      EXPECT_TRUE(bitwise_equal(a.argmax, b.argmax, "outputs->argmax"));
      EXPECT_TRUE(bitwise_equal(a.accuracy, b.accuracy, "outputs->accuracy"));
      std::vector<uint8_t> g1, g2;
      ASSERT_NO_FATAL_FAILURE(run.backward(false, &a.grad, &g1, 0xFF));
      ASSERT_NO_FATAL_FAILURE(run.backward(false, &a.grad, &g2, 0x5A));
      EXPECT_TRUE(bitwise_equal(g1, g2, "grad_logits (fce_backward)"));
    }
}

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
