// test_linear_ce.cpp — fce_linear_ce (z = h W^T + b, cross-entropy, dh, dW, db) against the
// float64 reference (ref.h: a naive double matmul), on the backend FCE_TEST_BACKEND selects.
//
// Every option, bias or not, overwrite and accumulate, grad_weight_fp32, per-row upstream,
// loss only, partial gradients, workspaces from the minimum to past the optimum, each CUDA plan
// crossed with the gradient sets (and captured into a CUDA graph), odd shapes, strided hidden
// rows, out-of-range targets, shift by k, token scaling, argmax and accuracy, determinism, bad
// input. Outputs poisoned, guards and row gaps checked as in test_ce.cpp.
#include <functional>

#include "check_ce.h"

using namespace fcet;

namespace {

// kWsFrac: min + (optimal − min) · ws_frac, for sweeps across the CUDA plans (vocab-sliced at
// the bottom, 16-bit token chunks accumulated in grad_weight in between, one chunk at the top).
enum WsChoice { kWsMin, kWsMid, kWsOpt, kWsMore, kWsFrac };
const char* ws_name(int w) {
  switch (w) {
    case kWsMin: return "min";
    case kWsMid: return "mid";
    case kWsOpt: return "optimal";
    case kWsFrac: return "fraction";
    default: return "more";
  }
}

struct LinCase {
  std::string name;
  int64_t N = 37, D = 24, V = 301;
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
  bool confident = false;        // every other row's target is its argmax (p_y large)
  int64_t h_pad = 0;             // hidden_row_stride = D + h_pad (0: passed as 0)
  bool bias = true;
  bool gh = true, gw = true, gb = true;  // which gradients are asked for
  bool accumulate = false;
  bool gw_fp32 = false;
  bool gout = true;
  float gscale = 0.7f;
  bool lse = true, zloss = true, flags = true;
  int ws = kWsOpt;
  double ws_frac = 0;            // with kWsFrac
  double zstd = -1;              // logit spread; -1: 8 for float32, 1.5 for 16-bit dtypes
  uint64_t seed = 1;
  std::function<void(const LinCase&, std::vector<int64_t>& y)> edit;
};

std::string case_label(const LinCase& c) {
  std::ostringstream s;
  s << c.name << " [" << backend_name() << " " << dtype_name(c.dtype) << " "
    << dtype_name(c.tdtype) << " " << reduction_name(c.reduction) << " N=" << c.N << " D=" << c.D
    << " V=" << c.V << " eps=" << c.eps << " lambda=" << c.lambda << " softcap=" << c.softcap
    << " scale=" << c.scale << (c.weights ? " weights" : "") << " shift=" << c.shift
    << " k=" << c.shift_k << (c.token_scaling ? " token_scaling" : "")
    << (c.argmax ? " argmax" : "") << (c.accuracy ? " accuracy" : "") << " h_pad=" << c.h_pad << (c.bias ? " bias" : " no-bias") << " grads=" << c.gh << c.gw
    << c.gb << (c.accumulate ? " accumulate" : "") << (c.gw_fp32 ? " grad_weight_fp32" : "")
    << " workspace=" << ws_name(c.ws);
  if (c.ws == kWsFrac) s << " " << c.ws_frac;
  s << "]";
  return s.str();
}

// gtest prints a failing parameter with this (instead of its bytes).
void PrintTo(const LinCase& c, std::ostream* os) { *os << case_label(c); }

struct LinData {
  std::vector<double> h, W, b, w, g;
  std::vector<int64_t> y;
  std::vector<double> gw0, gb0;  // accumulate: what grad_weight / grad_bias hold before
};

// The bound for everything downstream of the logits. float32: docs/semantics.md's 1e-5. float16 and
// bfloat16: torch eager materialises z = h W^T + b in the dtype, which perturbs every logit
// by up to u |z| and so every p (and the loss) by up to 2u max|z| relative; on top of that
// the same 4u as tolerance() for the dtype's roundings of the results.
double lin_tolerance(int dtype, const std::vector<double>& z) {
  if (dtype == FCE_FLOAT32) return 1e-5;
  double zmax = 0;
  for (double v : z) zmax = std::max(zmax, std::fabs(v));
  return unit_roundoff(dtype) * (4.0 + 2.0 * zmax);
}

double rms(const std::vector<double>& v) {
  double s = 0;
  size_t n = 0;
  for (double x : v)
    if (std::isfinite(x)) s += x * x, ++n;
  return n ? std::sqrt(s / static_cast<double>(n)) : 0.0;
}

struct LinOut {
  std::vector<uint8_t> loss, lse, zloss, gh, gw, gb, argmax, accuracy;
};

// Relative width of an argmax near tie (check_ce.h): the logits come out of a float32 GEMM
// (a relative error of some 2^-24 D), and on CUDA a 16-bit plan may round them to the dtype.
double argmax_tie(int dtype) { return dtype == FCE_FLOAT32 ? 1e-5 : 2 * unit_roundoff(dtype); }

class LinRunner {
 public:
  explicit LinRunner(LinCase c) : c_(std::move(c)) {
    if (c_.zstd < 0) c_.zstd = c_.dtype == FCE_FLOAT32 ? 8.0 : 1.5;
    std::mt19937_64 rng(c_.seed * 1000003u + static_cast<uint64_t>(c_.N * 7 + c_.D * 131 + c_.V));
    d_.h = random_normal(rng, c_.dtype, static_cast<size_t>(c_.N * c_.D), 1.0);
    d_.W = random_normal(rng, c_.dtype, static_cast<size_t>(c_.V * c_.D),
                         c_.zstd / std::sqrt(static_cast<double>(c_.D)));
    if (c_.bias) d_.b = random_normal(rng, c_.dtype, static_cast<size_t>(c_.V), c_.dtype == FCE_FLOAT32 ? 1.0 : 0.5);
    d_.y = random_targets(rng, c_.N, c_.V, c_.ignore_frac, c_.ignore_index);
    if (c_.weights) d_.w = random_uniform(rng, static_cast<size_t>(c_.V), 0.1, 2.0);
    if (c_.gout) {
      if (c_.reduction == FCE_REDUCTION_NONE) d_.g = random_uniform(rng, static_cast<size_t>(c_.N), -1.5, 1.5);
      else d_.g = {c_.gscale};
    }
    if (c_.edit) c_.edit(c_, d_.y);
    if (c_.confident) {  // row r is scored against y[r + k]: that one becomes row r's argmax
      const int64_t k = c_.shift > 0 ? std::max<int64_t>(c_.shift_k, 1) : 0;
      for (int64_t r = 0; r + k < c_.N; r += 2) {
        if (d_.y[static_cast<size_t>(r + k)] == c_.ignore_index) continue;
        int64_t best = 0;
        double zbest = -HUGE_VAL;
        for (int64_t v = 0; v < c_.V; ++v) {
          double z = c_.bias ? d_.b[static_cast<size_t>(v)] : 0.0;
          for (int64_t j = 0; j < c_.D; ++j)
            z += d_.h[static_cast<size_t>(r * c_.D + j)] * d_.W[static_cast<size_t>(v * c_.D + j)];
          if (z > zbest) zbest = z, best = v;
        }
        d_.y[static_cast<size_t>(r + k)] = best;
      }
    }
    fceref::Options ro;
    ro.reduction = c_.reduction;
    ro.label_smoothing = c_.eps;
    ro.z_loss_scale = c_.lambda;
    ro.softcap = c_.softcap;
    ro.logit_scale = c_.scale;
    ro.class_weights = d_.w;
    ro.ignore_index = c_.ignore_index;
    ro.shift_seq_len = c_.shift;
    ro.shift = c_.shift_k;
    ro.token_scaling = c_.token_scaling;
    ref_ = fceref::linear_cross_entropy(ro, c_.N, c_.D, c_.V, d_.h, d_.W, d_.b, d_.y,
                                        d_.g.empty() ? nullptr : &d_.g, true);
    gdt_ = c_.gw_fp32 ? FCE_FLOAT32 : c_.dtype;
    if (c_.accumulate) prefill(rng);
    tol_ = lin_tolerance(c_.dtype, ref_.logits);

    hm_ = mat(c_.dtype, c_.N, c_.D, c_.D + c_.h_pad);
    hidden_ = Buf(hm_);
    poison_all(hidden_, c_.dtype);  // row gaps: NaN, never to be read
    write_mat(hidden_, hm_, d_.h);
    hidden_.push();
    weight_ = Buf(mat(c_.dtype, c_.V, c_.D));
    write_mat(weight_, mat(c_.dtype, c_.V, c_.D), d_.W);
    weight_.push();
    if (c_.bias) {
      bias_ = Buf(vec(c_.dtype, c_.V));
      write_mat(bias_, vec(c_.dtype, c_.V), d_.b);
      bias_.push();
    }
    targets_ = targets_buf(d_.y, c_.tdtype);
    if (c_.weights) cw_ = f32_buf(d_.w);
    if (c_.gout) gout_ = f32_buf(d_.g);

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
    o_.hidden_row_stride = c_.h_pad ? hm_.stride : 0;
    o_.accumulate = c_.accumulate;
    o_.grad_weight_fp32 = c_.gw_fp32;
    o_.class_weights = cw_.p<float>();
  }

  // Another set of gradients (grad_bias only where there is a bias), overwritten or
  // accumulated, grad_weight_fp32 or not, on the same data and float64 reference (which has
  // every gradient): one reference for a loop over the sets. Accumulate draws new pre-filled
  // gradients.
  void set_gradients(bool gh, bool gw, bool gb, bool accumulate, bool gw_fp32) {
    c_.gh = gh;
    c_.gw = gw;
    c_.gb = gb && c_.bias;
    c_.accumulate = accumulate;
    c_.gw_fp32 = gw_fp32;
    gdt_ = gw_fp32 ? FCE_FLOAT32 : c_.dtype;
    o_.accumulate = accumulate;
    o_.grad_weight_fp32 = gw_fp32;
    d_.gw0.clear();
    d_.gb0.clear();
    if (accumulate) {
      std::mt19937_64 rng(c_.seed * 7919u + 13u);
      prefill(rng);
    }
  }

  const fceref::LinearResult& ref() const { return ref_; }
  double tol() const { return tol_; }
  TestOptions& options() { return o_; }
  bool with_grad() const { return c_.gh || c_.gw || c_.gb; }
  bool any_invalid() const {
    for (auto k : ref_.ce.kind)
      if (k == fceref::kInvalid) return true;
    return false;
  }

  // The workspace size for ws (queried every time: the query itself is under test).
  void workspace_bytes(int ws, size_t* bytes, size_t* min_out = nullptr, size_t* opt_out = nullptr) {
    size_t mn = 0, op = 0;
    fce_status st = fce_linear_ce_workspace_size(&o_, c_.N, c_.D, c_.V, with_grad(), &mn, &op);
    ASSERT_EQ(st, FCE_SUCCESS) << fce_last_error();
    ASSERT_GE(op, mn) << "optimal_bytes < min_bytes";
    if (min_out) *min_out = mn;
    if (opt_out) *opt_out = op;
    switch (ws) {
      case kWsMin: *bytes = mn; break;
      case kWsMid: *bytes = mn + (op - mn) / 2; break;
      case kWsOpt: *bytes = op; break;
      case kWsFrac: *bytes = mn + static_cast<size_t>(static_cast<double>(op - mn) * c_.ws_frac); break;
      default: *bytes = op + 4096 + 3; break;
    }
  }

  // One call on outputs poisoned (or pre-filled, accumulate), checked against the reference.
  // as_graph (CUDA backend): the call is captured into a CUDA graph (nothing may run during the
  // capture) and the graph launched once instead.
  void run(LinOut* out = nullptr, int ws_choice = -1, uint8_t ws_fill = 0xFF,
           bool as_graph = false) {
    if (ws_choice < 0) ws_choice = c_.ws;
    LinCase label = c_;
    label.ws = ws_choice;
    SCOPED_TRACE(case_label(label));
    const int64_t N = c_.N, D = c_.D, V = c_.V;
    Mat loss_m = vec(FCE_FLOAT32, c_.reduction == FCE_REDUCTION_NONE ? N : 1),
        lse_m = vec(FCE_FLOAT32, N), zl_m = vec(FCE_FLOAT32, 1);
    Mat gh_m = mat(c_.dtype, N, D), gw_m = mat(gdt_, V, D), gb_m = vec(gdt_, V);
    Buf loss = poisoned(loss_m);
    Buf lse = c_.lse ? poisoned(lse_m) : Buf();
    Buf zl = c_.zloss ? poisoned(zl_m) : Buf();
    Buf gh = c_.gh ? poisoned(gh_m) : Buf();
    const Mat am_m = vec(FCE_INT64, N), acc_m = vec(FCE_FLOAT32, loss_m.cols);
    Buf am = c_.argmax ? poisoned(am_m) : Buf();
    Buf acc = c_.accuracy ? poisoned(acc_m) : Buf();
    o_.argmax = am.p<int64_t>();
    o_.accuracy = acc.p<float>();
    Buf gw, gb;
    if (c_.gw) {
      gw = poisoned(gw_m);
      if (c_.accumulate) write_mat(gw, gw_m, d_.gw0), gw.push();
    }
    if (c_.gb) {
      gb = poisoned(gb_m);
      if (c_.accumulate) write_mat(gb, gb_m, d_.gb0), gb.push();
    }
    const uint32_t preset = 0x40u;
    Buf flags(4, 0);
    std::memcpy(flags.h(), &preset, 4);
    flags.push();
    size_t wsb = 0;
    ASSERT_NO_FATAL_FAILURE(workspace_bytes(ws_choice, &wsb));
    Buf ws = workspace_buf(wsb, ws_fill);

    auto b_h = hidden_.mirror(), b_W = weight_.mirror(), b_b = bias_.mirror(),
         b_y = targets_.mirror(), b_cw = cw_.mirror(), b_g = gout_.mirror(),
         b_loss = loss.mirror(), b_lse = lse.mirror(), b_zl = zl.mirror(), b_gh = gh.mirror(),
         b_gw = gw.mirror(), b_gb = gb.mirror(), b_am = am.mirror(), b_acc = acc.mirror();
    auto call = [&] {
      return flat::linear_ce(&o_, N, D, V, hidden_.ptr(), weight_.ptr(), bias_.ptr(),
                           targets_.ptr(), loss.p<float>(), lse.p<float>(), zl.p<float>(),
                           gh.ptr(), gw.ptr(), gb.ptr(), gout_.p<float>(),
                           c_.flags ? flags.p<uint32_t>() : nullptr, ws.ptr(), wsb,
                           test_stream());
    };
    fce_status st = FCE_SUCCESS;
#if FCE_TEST_HAVE_CUDA
    CapturedGraph graph;  // lives until the checks are done (it holds this call's pointers)
#endif
    if (as_graph) {
#if FCE_TEST_HAVE_CUDA
      ASSERT_TRUE(on_cuda()) << "graph capture needs the CUDA backend";
      ASSERT_TRUE(graph.capture(call));
      loss.pull();
      EXPECT_FALSE(all_written(loss, loss_m, "loss")) << "fce_linear_ce ran during capture";
      ASSERT_TRUE(graph.launch());
#else
      FAIL() << "graph capture needs the CUDA backend (built with FCE_WITH_CUDA=OFF)";
#endif
    } else {
      st = call();
    }
    ASSERT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    ASSERT_TRUE(finish());
    for (Buf* b : {&hidden_, &weight_, &bias_, &targets_, &cw_, &gout_, &loss, &lse, &zl, &gh,
                   &gw, &gb, &flags, &ws, &am, &acc})
      b->pull();

    EXPECT_TRUE(unchanged(hidden_, b_h, "hidden_states"));
    EXPECT_TRUE(unchanged(weight_, b_W, "weight"));
    EXPECT_TRUE(unchanged(bias_, b_b, "bias"));
    EXPECT_TRUE(unchanged(targets_, b_y, "targets"));
    EXPECT_TRUE(unchanged(cw_, b_cw, "class_weights"));
    EXPECT_TRUE(unchanged(gout_, b_g, "grad_output"));
    if (!ws.empty()) {
      const auto& mm = ws.mirror();
      bool ok = true;
      for (size_t i = 0; i < kGuard; ++i)
        ok = ok && mm[i] == kGuardByte && mm[kGuard + ws.size() + i] == kGuardByte;
      EXPECT_TRUE(ok) << "workspace: guard bytes around it were overwritten";
    }

    const auto& ce = ref_.ce;
    EXPECT_TRUE(only_elements_changed(loss, b_loss, &loss_m, "loss"));
    EXPECT_TRUE(all_written(loss, loss_m, "loss"));
    std::vector<double> lv = read_mat(loss, loss_m);
    if (c_.reduction == FCE_REDUCTION_NONE) {
      EXPECT_TRUE(close_normwise(lv, ce.row_loss, tol_, "loss (per row)"));
      for (int64_t r = 0; r < N; ++r)
        if (ce.kind[static_cast<size_t>(r)] == fceref::kIgnored) {
          EXPECT_EQ(lv[static_cast<size_t>(r)], 0.0) << "ignored row " << r;
        }
    } else {
      EXPECT_TRUE(close_scalar(lv[0], ce.loss, tol_, "loss (reduced)"));
    }
    if (c_.lse) {
      EXPECT_TRUE(only_elements_changed(lse, b_lse, &lse_m, "lse"));
      EXPECT_TRUE(all_written(lse, lse_m, "lse"));
      EXPECT_TRUE(close_normwise(read_mat(lse, lse_m), ce.lse, tol_, "lse"));
    }
    if (c_.zloss) {
      EXPECT_TRUE(only_elements_changed(zl, b_zl, &zl_m, "z_loss"));
      EXPECT_TRUE(all_written(zl, zl_m, "z_loss"));
      EXPECT_TRUE(close_scalar(read_mat(zl, zl_m)[0], ce.z_loss, tol_, "z_loss"));
    }
    if (c_.gh) {
      EXPECT_TRUE(only_elements_changed(gh, b_gh, &gh_m, "grad_hidden"));
      EXPECT_TRUE(all_written(gh, gh_m, "grad_hidden"));
      std::vector<double> v = read_mat(gh, gh_m);
      EXPECT_TRUE(close_normwise(v, ref_.grad_hidden, tol_, "grad_hidden"));
      for (int64_t r = 0; r < N; ++r)
        if (ce.kind[static_cast<size_t>(r)] == fceref::kIgnored)
          for (int64_t k = 0; k < D; ++k)
            if (v[static_cast<size_t>(r * D + k)] != 0.0) {
              ADD_FAILURE() << "grad_hidden: ignored row " << r << " is not zero";
              break;
            }
    }
    auto expect_acc = [&](const std::vector<double>& dref, const std::vector<double>& init) {
      std::vector<double> e = dref;
      if (c_.accumulate)
        for (size_t i = 0; i < e.size(); ++i) e[i] += init[i];
      return e;
    };
    if (c_.gw) {
      EXPECT_TRUE(only_elements_changed(gw, b_gw, &gw_m, "grad_weight"));
      if (!c_.accumulate) { EXPECT_TRUE(all_written(gw, gw_m, "grad_weight")); }
      EXPECT_TRUE(close_normwise(read_mat(gw, gw_m), expect_acc(ref_.grad_weight, d_.gw0), tol_,
                                 c_.accumulate ? "grad_weight (accumulated)" : "grad_weight"));
    }
    if (c_.gb) {
      EXPECT_TRUE(only_elements_changed(gb, b_gb, &gb_m, "grad_bias"));
      if (!c_.accumulate) { EXPECT_TRUE(all_written(gb, gb_m, "grad_bias")); }
      EXPECT_TRUE(close_normwise(read_mat(gb, gb_m), expect_acc(ref_.grad_bias, d_.gb0), tol_,
                                 c_.accumulate ? "grad_bias (accumulated)" : "grad_bias"));
    }
    if (c_.flags) {
      uint32_t f;
      std::memcpy(&f, flags.h(), 4);
      EXPECT_EQ(f, preset | (any_invalid() ? FCE_FLAG_TARGET_OUT_OF_RANGE : 0u)) << "error_flags";
    }
    // Argmax and accuracy (docs/semantics.md rule 15) of the logits h W^T + b.
    std::vector<int64_t> amv;
    if (c_.argmax) {
      EXPECT_TRUE(only_elements_changed(am, b_am, &am_m, "outputs->argmax"));
      EXPECT_TRUE(all_written(am, am_m, "outputs->argmax"));
      amv = read_i64(am, N);
      EXPECT_TRUE(argmax_matches(amv, ce, V, argmax_tie(c_.dtype), nullptr));
    }
    if (c_.accuracy) {
      EXPECT_TRUE(only_elements_changed(acc, b_acc, &acc_m, "outputs->accuracy"));
      EXPECT_TRUE(all_written(acc, acc_m, "outputs->accuracy"));
      EXPECT_TRUE(accuracy_matches(read_mat(acc, acc_m), c_.reduction, ce,
                                   c_.argmax ? &amv : nullptr, V, argmax_tie(c_.dtype)));
    }
    o_.argmax = nullptr;  // the buffers go with this call
    o_.accuracy = nullptr;
    if (out) {
      out->argmax = am.mirror();
      out->accuracy = acc.mirror();
      out->loss = loss.mirror();
      out->lse = lse.mirror();
      out->zloss = zl.mirror();
      out->gh = gh.mirror();
      out->gw = gw.mirror();
      out->gb = gb.mirror();
    }
  }

 private:
  // Pre-filled gradients (accumulate) of the same size as this call's.
  void prefill(std::mt19937_64& rng) {
    double sw = rms(ref_.grad_weight), sb = rms(ref_.grad_bias);
    d_.gw0 = random_normal(rng, gdt_, static_cast<size_t>(c_.V * c_.D), sw > 0 ? sw : 1.0);
    d_.gb0 = random_normal(rng, gdt_, static_cast<size_t>(c_.V), sb > 0 ? sb : 1.0);
  }

  LinCase c_;
  LinData d_;
  fceref::LinearResult ref_;
  int gdt_ = FCE_FLOAT32;
  double tol_ = 0;
  Mat hm_;
  TestOptions o_;
  Buf hidden_, weight_, bias_, targets_, cw_, gout_;
};

void run_case(const LinCase& c) {
  LinRunner r(c);
  r.run();
}

// ------------------------------------------------------------------ the option matrix -------
struct OptionSet {
  const char* name;
  std::function<void(LinCase&)> apply;
};

const std::vector<OptionSet>& option_sets() {
  static const std::vector<OptionSet> sets = {
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

std::vector<LinCase> matrix_cases() {
  std::vector<LinCase> cases;
  uint64_t seed = 1;
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16})
    for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE})
      for (const OptionSet& s : option_sets()) {
        LinCase c;
        c.dtype = dtype;
        c.reduction = red;
        c.seed = seed++;
        s.apply(c);
        c.name = std::string(dtype_name(dtype)) + "_" + reduction_name(red) + "_" + s.name;
        cases.push_back(c);
      }
  return cases;
}

class LinearMatrix : public ::testing::TestWithParam<LinCase> {
 protected:
  void SetUp() override { FCE_REQUIRE_BACKEND(); }
};

TEST_P(LinearMatrix, MatchesReference) { run_case(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Options, LinearMatrix, ::testing::ValuesIn(matrix_cases()),
                         [](const ::testing::TestParamInfo<LinCase>& i) { return i.param.name; });

// ------------------------------------------------------------------ more cases --------------
class Linear : public BackendTest {};

const int kDtypes[] = {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16};
const int kReductions[] = {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE};

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
  expect_rejected("reserved0", FCE_ERROR_INVALID_ARGUMENT, "reserved0", [](LinArgs& x) { x.o.reserved0 = 1; });
  expect_rejected("reserved1", FCE_ERROR_INVALID_ARGUMENT, "options->reserved1",
                  [](LinArgs& x) { x.o.reserved1 = 1; });
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
