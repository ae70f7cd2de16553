// linear_runner.h — the case and the runner of test_linear_ce*.cpp: one fce_linear_ce call on a
// LinCase with every output poisoned (or pre-filled, accumulate), checked against the float64
// reference (ref.h: a naive double matmul).
#pragma once

#include <functional>

#include "check_ce.h"

using namespace fcet;

namespace {

// kWsFrac: min + (optimal − min) · ws_frac, for sweeps across the CUDA plans (vocab-sliced at
// the bottom, 16-bit token chunks accumulated in grad_weight in between, one chunk at the top).
enum WsChoice { kWsMin, kWsMid, kWsOpt, kWsMore, kWsFrac };
inline const char* ws_name(int w) {
  switch (w) {
    case kWsMin: return "min";
    case kWsMid: return "mid";
    case kWsOpt: return "optimal";
    case kWsFrac: return "fraction";
    default: return "more";
  }
}

struct LinCase : LinearSpec {
  bool lse = true, zloss = true, flags = true;
  int ws = kWsOpt;
  double ws_frac = 0;            // with kWsFrac
  std::function<void(const LinCase&, std::vector<int64_t>& y)> edit;
};

inline std::string case_label(const LinCase& c) {
  std::ostringstream s;
  s << spec_label(c) << " D=" << c.D << " h_pad=" << c.h_pad << (c.bias ? " bias" : " no-bias")
    << " grads=" << c.gh << c.gw << c.gb << (c.accumulate ? " accumulate" : "")
    << (c.gw_fp32 ? " grad_weight_fp32" : "") << " workspace=" << ws_name(c.ws);
  if (c.ws == kWsFrac) s << " " << c.ws_frac;
  s << "]";
  return s.str();
}

// gtest prints a failing parameter with this (instead of its bytes).
inline void PrintTo(const LinCase& c, std::ostream* os) { *os << case_label(c); }

struct LinOut {
  std::vector<uint8_t> loss, lse, zloss, gh, gw, gb, argmax, accuracy;
};

class LinRunner {
 public:
  explicit LinRunner(LinCase c) : c_(std::move(c)) {
    if (c_.zstd < 0) c_.zstd = c_.dtype == FCE_FLOAT32 ? 8.0 : 1.5;
    std::mt19937_64 rng = linear_rng(c_);
    d_ = linear_data(rng, c_);
    if (c_.edit) c_.edit(c_, d_.y);
    // Row r is scored against y[r + k]: every other one becomes row r's argmax.
    if (c_.confident) confident_linear_targets(c_, d_, 2);
    ref_ = fceref::linear_cross_entropy(reference_options(c_, d_.w), c_.N, c_.D, c_.V, d_.h, d_.W, d_.b, d_.y,
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

    o_ = spec_options(c_);
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
  void prefill(std::mt19937_64& rng) { prefill_gradients(rng, c_, ref_, gdt_, d_); }

  LinCase c_;
  LinearData d_;
  fceref::LinearResult ref_;
  int gdt_ = FCE_FLOAT32;
  double tol_ = 0;
  Mat hm_;
  TestOptions o_;
  Buf hidden_, weight_, bias_, targets_, cw_, gout_;
};

inline void run_case(const LinCase& c) {
  LinRunner r(c);
  r.run();
}

}  // namespace

// The fixture of test_linear_ce's single tests (one type for every source of the executable).
class Linear : public fcet::BackendTest {};
