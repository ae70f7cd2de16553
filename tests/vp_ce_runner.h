// vp_ce_runner.h — the cross-entropy case of test_vp_ce.cpp and its runner: phase 1 on each of
// P shards, the stats gathered, fce_vp_loss, each shard's fce_vp_backward, against the
// unsharded fce_forward and the float64 reference.
#pragma once

#include <functional>

#include "vp_common.h"

namespace {

// ------------------------------------------------------------------ cross-entropy cases ----
struct VpCase : CeSpec {
  int64_t row_pad = 0, grad_pad = 0;  // strides of each shard's logits / gradient
  bool inplace = false;               // fce_vp_backward over the shard's logits
  bool uneven = true;
  bool spread = true;                 // targets at every shard's edges (spread_targets)
  bool check_held = true;             // check that every shard holds some scored row's target
  int invalid = 0;                    // rows given out-of-range targets
  double std_lo = 1, std_hi = 30;
  std::vector<int> ranks = {1, 2, 3, 4};
  std::function<void(const VpCase&, std::vector<double>& z, std::vector<int64_t>& y)> edit;
};

inline std::string case_label(const VpCase& c) {
  std::ostringstream s;
  s << spec_label(c) << " row_pad=" << c.row_pad << " grad_pad=" << c.grad_pad << (c.inplace ? " inplace" : "")
    << (c.gout ? " grad_output" : " grad_output=NULL") << (c.uneven ? " uneven" : " even")
    << " invalid=" << c.invalid << "]";
  return s.str();
}

inline void PrintTo(const VpCase& c, std::ostream* os) { *os << case_label(c); }

class VpCeRunner {
 public:
  explicit VpCeRunner(VpCase c) : c_(std::move(c)) {
    CeData d = ce_data(c_, c_.std_lo, c_.std_hi);
    z_ = std::move(d.z), y_ = std::move(d.y), w_ = std::move(d.w), g_ = std::move(d.g);
    if (c_.edit) c_.edit(c_, z_, y_);
    if (c_.spread) spread_targets(c_.N, c_.V, c_.shift, c_.shift_k, y_);
    const int64_t bad[] = {c_.V, -1, c_.V + 1000, int64_t{1} << 40};
    for (int i = 0; i < c_.invalid; ++i) {
      int64_t v = bad[i % 4];
      if (v == c_.ignore_index) v = -2;
      if (c_.tdtype == FCE_INT32 && v > INT32_MAX) v = INT32_MAX;
      y_[static_cast<size_t>(c_.N - 1 - 2 * i)] = v;
    }
    ref_ = fceref::cross_entropy(reference_options(c_, w_), c_.N, c_.V, z_, y_, g_.empty() ? nullptr : &g_, true);
    targets_ = targets_buf(y_, c_.tdtype);
    if (c_.weights) weights_ = f32_buf(w_);
    if (c_.gout) gout_ = f32_buf(g_);
    o_ = spec_options(c_);
    o_.class_weights = weights_.p<float>();
  }

  const fceref::CeResult& ref() const { return ref_; }
  double tol() const { return tolerance(c_.dtype); }
  int64_t loss_len() const { return c_.reduction == FCE_REDUCTION_NONE ? c_.N : 1; }
  uint32_t invalid_flag() const {
    for (auto k : ref_.kind)
      if (k == fceref::kInvalid) return FCE_FLAG_TARGET_OUT_OF_RANGE;
    return 0u;
  }

  // The unsharded fce_forward (every output), the baseline of every comparison.
  void unsharded() {
    SCOPED_TRACE(case_label(c_) + " fce_forward (unsharded)");
    const Mat lm = mat(c_.dtype, c_.N, c_.V);
    Buf logits(lm);
    write_mat(logits, lm, z_);
    logits.push();
    Mat loss_m = vec(FCE_FLOAT32, loss_len());
    Buf loss = poisoned(loss_m), lse = poisoned(vec(FCE_FLOAT32, c_.N)),
        zl = poisoned(vec(FCE_FLOAT32, 1)), grad = poisoned(lm),
        am = poisoned(vec(FCE_INT64, c_.N)), acc = poisoned(loss_m), flags = flags_buf(0);
    TestOptions o = o_;
    o.argmax = am.p<int64_t>();
    o.accuracy = acc.p<float>();
    size_t wsb = 0;
    ASSERT_EQ(fce_forward_workspace_size(&o, c_.N, c_.V, &wsb), FCE_SUCCESS) << fce_last_error();
    Buf ws = workspace_buf(wsb);
    const fce_status st =
        flat::forward(&o, c_.N, c_.V, logits.ptr(), targets_.ptr(), loss.p<float>(),
                    lse.p<float>(), zl.p<float>(), grad.ptr(), gout_.p<float>(),
                    flags.p<uint32_t>(), ws.ptr(), wsb, test_stream());
    ASSERT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    ASSERT_TRUE(finish());
    for (Buf* b : {&loss, &lse, &zl, &grad, &am, &acc, &flags}) b->pull();
    whole_.loss = read_mat(loss, loss_m);
    whole_.lse = read_mat(lse, vec(FCE_FLOAT32, c_.N));
    whole_.zl = read_mat(zl, vec(FCE_FLOAT32, 1));
    whole_.am = read_i64(am, c_.N);
    whole_.acc = read_mat(acc, loss_m);
    whole_.flags = read_flags(flags);
    whole_grad_ = read_mat(grad, lm);
    ASSERT_EQ(whole_.flags, invalid_flag()) << "fce_forward's error flags";
  }

  // Phase 1 of shard s: its logits (row gaps poisoned) and fce_vp_stats; returns the stats.
  Buf shard_logits(const Shard& s, Mat* m_out) const {
    const Mat m = mat(c_.dtype, c_.N, s.local, s.local + c_.row_pad);
    Buf b(m);
    poison_all(b, c_.dtype);  // the row gaps: NaN, never to be read
    std::vector<double> cols(static_cast<size_t>(c_.N * s.local));
    for (int64_t r = 0; r < c_.N; ++r)
      for (int64_t j = 0; j < s.local; ++j)
        cols[static_cast<size_t>(r * s.local + j)] = z_[static_cast<size_t>(r * c_.V + s.start + j)];
    write_mat(b, m, cols);
    b.push();
    if (m_out) *m_out = m;
    return b;
  }

  TestOptions shard_options(const Mat& lm, const Mat& gm) const {
    TestOptions o = o_;
    if (c_.row_pad || c_.inplace) o.row_stride = lm.stride;
    if (c_.grad_pad || c_.inplace) o.grad_row_stride = gm.stride;
    return o;
  }

  Buf stats(const Shard& s, bool* ok = nullptr) {
    SCOPED_TRACE("fce_vp_stats of shard [" + std::to_string(s.start) + ", +" +
                 std::to_string(s.local) + ")");
    Mat lm;
    Buf logits = shard_logits(s, &lm);
    const Mat sm = vec(FCE_FLOAT32, c_.N * FCE_VP_STATS);
    Buf st = poisoned(sm);
    TestOptions o = shard_options(lm, lm);
    auto b_logits = logits.mirror(), b_y = targets_.mirror(), b_w = weights_.mirror(),
         b_st = st.mirror();
    const fce_status status = flat::vp_stats(&o, c_.N, c_.V, s.start, s.local, logits.ptr(),
                                           targets_.ptr(), st.p<float>(), test_stream());
    EXPECT_EQ(status, FCE_SUCCESS) << fce_status_string(status) << ": " << fce_last_error();
    if (ok) *ok = status == FCE_SUCCESS;
    EXPECT_TRUE(finish());
    for (Buf* b : {&logits, &targets_, &weights_, &st}) b->pull();
    EXPECT_TRUE(unchanged(logits, b_logits, "logits (fce_vp_stats)"));
    EXPECT_TRUE(unchanged(targets_, b_y, "targets (fce_vp_stats)"));
    EXPECT_TRUE(unchanged(weights_, b_w, "class_weights (fce_vp_stats)"));
    EXPECT_TRUE(only_elements_changed(st, b_st, &sm, "stats"));
    EXPECT_TRUE(all_written(st, sm, "stats"));
    return st;
  }

  // fce_vp_loss on gathered; outputs poisoned; checks the buffers and returns the values.
  LossOut loss(Buf& gathered, int64_t ranks, uint32_t preset = 0x100u) {
    Mat loss_m = vec(FCE_FLOAT32, loss_len()), lse_m = vec(FCE_FLOAT32, c_.N),
        zl_m = vec(FCE_FLOAT32, 1), am_m = vec(FCE_INT64, c_.N);
    Buf loss = poisoned(loss_m), lse = poisoned(lse_m), zl = poisoned(zl_m);
    Buf am = c_.argmax ? poisoned(am_m) : Buf(), acc = c_.accuracy ? poisoned(loss_m) : Buf();
    Buf flags = flags_buf(preset);
    TestOptions o = o_;
    o.argmax = am.p<int64_t>();
    o.accuracy = acc.p<float>();
    size_t wsb = 1;
    EXPECT_EQ(fce_vp_loss_workspace_size(&o, ranks, c_.N, c_.V, &wsb), FCE_SUCCESS)
        << fce_last_error();
    Buf ws = workspace_buf(wsb);
    auto b_g = gathered.mirror(), b_y = targets_.mirror(), b_loss = loss.mirror(),
         b_lse = lse.mirror(), b_zl = zl.mirror(), b_am = am.mirror(), b_acc = acc.mirror();
    const fce_status st = flat::vp_loss(&o, ranks, c_.N, c_.V, targets_.ptr(), gathered.p<float>(),
                                      loss.p<float>(), lse.p<float>(), zl.p<float>(),
                                      flags.p<uint32_t>(), ws.ptr(), wsb, test_stream());
    EXPECT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    EXPECT_TRUE(finish());
    for (Buf* b : {&gathered, &targets_, &loss, &lse, &zl, &am, &acc, &flags, &ws}) b->pull();
    EXPECT_TRUE(unchanged(gathered, b_g, "gathered_stats"));
    EXPECT_TRUE(unchanged(targets_, b_y, "targets (fce_vp_loss)"));
    EXPECT_TRUE(guards_intact(ws, "workspace (fce_vp_loss)"));
    EXPECT_TRUE(guards_intact(flags, "error_flags"));
    EXPECT_TRUE(only_elements_changed(loss, b_loss, &loss_m, "loss"));
    EXPECT_TRUE(all_written(loss, loss_m, "loss"));
    EXPECT_TRUE(only_elements_changed(lse, b_lse, &lse_m, "lse"));
    EXPECT_TRUE(all_written(lse, lse_m, "lse"));
    EXPECT_TRUE(only_elements_changed(zl, b_zl, &zl_m, "z_loss"));
    EXPECT_TRUE(all_written(zl, zl_m, "z_loss"));
    LossOut out;
    out.loss = read_mat(loss, loss_m);
    out.lse = read_mat(lse, lse_m);
    out.zl = read_mat(zl, zl_m);
    if (c_.argmax) {
      EXPECT_TRUE(only_elements_changed(am, b_am, &am_m, "outputs->argmax"));
      EXPECT_TRUE(all_written(am, am_m, "outputs->argmax"));
      out.am = read_i64(am, c_.N);
    }
    if (c_.accuracy) {
      EXPECT_TRUE(only_elements_changed(acc, b_acc, &loss_m, "outputs->accuracy"));
      EXPECT_TRUE(all_written(acc, loss_m, "outputs->accuracy"));
      out.acc = read_mat(acc, loss_m);
    }
    out.flags = read_flags(flags);
    raw_loss_ = raw_elements(loss, loss_m);
    return out;
  }

  // The sharded loss against the unsharded call and the reference.
  void check_loss(const LossOut& v) {
    const double tol = this->tol();
    if (c_.reduction == FCE_REDUCTION_NONE) {
      EXPECT_TRUE(close_normwise(v.loss, whole_.loss, tol, "loss (per row) vs unsharded"));
      EXPECT_TRUE(close_normwise(v.loss, as_f32(ref_.row_loss), tol, "loss (per row) vs reference"));
      for (int64_t r = 0; r < c_.N; ++r)
        if (ref_.kind[static_cast<size_t>(r)] == fceref::kIgnored) {
          EXPECT_EQ(v.loss[static_cast<size_t>(r)], 0.0) << "ignored row " << r << " loss";
        }
    } else {
      EXPECT_TRUE(close_scalar(v.loss[0], whole_.loss[0], tol, "loss vs unsharded"));
      EXPECT_TRUE(close_scalar(v.loss[0], as_f32(ref_.loss), tol, "loss vs reference"));
    }
    EXPECT_TRUE(close_normwise(v.lse, whole_.lse, tol, "lse vs unsharded"));
    EXPECT_TRUE(close_normwise(v.lse, as_f32(ref_.lse), tol, "lse vs reference"));
    EXPECT_TRUE(close_scalar(v.zl[0], whole_.zl[0], tol, "z_loss vs unsharded"));
    EXPECT_TRUE(close_scalar(v.zl[0], as_f32(ref_.z_loss), tol, "z_loss vs reference"));
    if (c_.argmax) {
      EXPECT_TRUE(argmax_agrees(v.am, whole_.am, ref_, c_.V, kArgmaxTie));
    }
    if (c_.accuracy) {
      EXPECT_TRUE(accuracy_matches(v.acc, c_.reduction, ref_, c_.argmax ? &v.am : nullptr, c_.V,
                                   kArgmaxTie));
      if (c_.argmax && v.am == whole_.am) {
        EXPECT_TRUE(close_normwise(v.acc, whole_.acc, std::ldexp(1.0, -23), "accuracy vs unsharded"));
      }
    }
    EXPECT_EQ(v.flags, 0x100u | whole_.flags) << "error_flags (fce_vp_loss)";
  }

  // fce_vp_backward of shard s from gathered; writes its columns into grad (dense [N, V]).
  void backward(const Shard& s, Buf& gathered, int64_t ranks, std::vector<double>* grad) {
    SCOPED_TRACE("fce_vp_backward of shard [" + std::to_string(s.start) + ", +" +
                 std::to_string(s.local) + ")" + (c_.inplace ? " in place" : ""));
    Mat lm;
    Buf logits = shard_logits(s, &lm);
    const Mat gm = c_.inplace ? lm : mat(c_.dtype, c_.N, s.local, s.local + c_.grad_pad);
    Buf gbuf = c_.inplace ? Buf() : poisoned(gm);
    void* gptr = c_.inplace ? logits.ptr() : gbuf.ptr();
    TestOptions o = shard_options(lm, gm);
    // The forward outputs are not outputs of the backward: never written.
    Buf am = poisoned(vec(FCE_INT64, c_.N)), acc = poisoned(vec(FCE_FLOAT32, loss_len()));
    o.argmax = am.p<int64_t>();
    o.accuracy = acc.p<float>();
    size_t wsb = 1;
    EXPECT_EQ(fce_vp_backward_workspace_size(&o, ranks, c_.N, c_.V, s.local, &wsb), FCE_SUCCESS)
        << fce_last_error();
    Buf ws = workspace_buf(wsb);
    auto b_logits = logits.mirror(), b_g = gathered.mirror(), b_y = targets_.mirror(),
         b_go = gout_.mirror(), b_grad = gbuf.mirror(), b_am = am.mirror(), b_acc = acc.mirror();
    const fce_status st = flat::vp_backward(&o, ranks, c_.N, c_.V, s.start, s.local, logits.ptr(),
                                          targets_.ptr(), gathered.p<float>(), gout_.p<float>(),
                                          gptr, ws.ptr(), wsb, test_stream());
    ASSERT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    ASSERT_TRUE(finish());
    for (Buf* b : {&logits, &gathered, &targets_, &gout_, &gbuf, &am, &acc, &ws}) b->pull();
    EXPECT_TRUE(unchanged(gathered, b_g, "gathered_stats (fce_vp_backward)"));
    EXPECT_TRUE(unchanged(targets_, b_y, "targets (fce_vp_backward)"));
    EXPECT_TRUE(unchanged(gout_, b_go, "grad_output"));
    EXPECT_TRUE(unchanged(am, b_am, "outputs->argmax (not an output of fce_vp_backward)"));
    EXPECT_TRUE(unchanged(acc, b_acc, "outputs->accuracy (not an output of fce_vp_backward)"));
    EXPECT_TRUE(guards_intact(ws, "workspace (fce_vp_backward)"));
    Buf& gb = c_.inplace ? logits : gbuf;
    if (c_.inplace) {
      EXPECT_TRUE(only_elements_changed(logits, b_logits, &lm, "logits (in place)"));
    } else {
      EXPECT_TRUE(unchanged(logits, b_logits, "logits (fce_vp_backward)"));
      EXPECT_TRUE(only_elements_changed(gbuf, b_grad, &gm, "grad_logits"));
      EXPECT_TRUE(all_written(gbuf, gm, "grad_logits"));
    }
    const std::vector<double> v = read_mat(gb, gm);
    for (int64_t r = 0; r < c_.N; ++r)
      for (int64_t j = 0; j < s.local; ++j)
        (*grad)[static_cast<size_t>(r * c_.V + s.start + j)] = v[static_cast<size_t>(r * s.local + j)];
  }

  // P simulated ranks: phase 1 per shard; fce_vp_loss on the stats gathered in rank order and
  // in a permuted order; each shard's fce_vp_backward (from the permuted order); everything
  // compared with the unsharded call.
  void sharded(int P) {
    SCOPED_TRACE(case_label(c_) + " P=" + std::to_string(P));
    const std::vector<Shard> shards = make_shards(c_.V, P, c_.uneven);
    if (c_.check_held) {  // every shard holds the target of some scored row
      for (const Shard& s : shards) {
        bool held = false;
        for (size_t r = 0; r < ref_.kind.size(); ++r)
          held = held || (ref_.kind[r] == fceref::kValid && ref_.target[r] >= s.start &&
                          ref_.target[r] < s.start + s.local);
        EXPECT_TRUE(held) << "no scored row targets shard [" << s.start << ", +" << s.local << ")";
      }
    }
    std::vector<Buf> stats;
    bool all_ok = true;
    for (const Shard& s : shards) {
      bool ok = false;
      stats.push_back(this->stats(s, &ok));
      all_ok = all_ok && ok;
    }
    ASSERT_TRUE(all_ok) << "phase 1 failed";
    Buf gathered_perm =
        gather_both_orders(stats, c_.N, [&](Buf& gathered) { check_loss(loss(gathered, P)); });
    std::vector<double> grad(static_cast<size_t>(c_.N * c_.V), -12345.0);
    for (const Shard& s : shards) {
      ASSERT_NO_FATAL_FAILURE(backward(s, gathered_perm, P, &grad));
    }
    EXPECT_TRUE(close_normwise(grad, whole_grad_, tol(), "grad_logits (all shards) vs unsharded"));
    EXPECT_TRUE(close_normwise(grad, ref_.grad, tol(), "grad_logits (all shards) vs reference"));
    for (int64_t r = 0; r < c_.N; ++r)
      if (ref_.kind[static_cast<size_t>(r)] == fceref::kIgnored)
        for (int64_t j = 0; j < c_.V; ++j)
          if (grad[static_cast<size_t>(r * c_.V + j)] != 0.0) {
            ADD_FAILURE() << "grad_logits: ignored row " << r << " has "
                          << grad[static_cast<size_t>(r * c_.V + j)] << " at " << j;
            break;
          }
  }

  void run() {
    ASSERT_NO_FATAL_FAILURE(unsharded());
    for (int P : c_.ranks) ASSERT_NO_FATAL_FAILURE(sharded(P));
  }

  const VpCase& c() const { return c_; }
  TestOptions& options() { return o_; }
  const LossOut& whole() const { return whole_; }
  const std::vector<double>& whole_grad() const { return whole_grad_; }
  const std::vector<uint8_t>& raw_loss() const { return raw_loss_; }

 private:
  VpCase c_;
  std::vector<double> z_, w_, g_;
  std::vector<int64_t> y_;
  fceref::CeResult ref_;
  Buf targets_, weights_, gout_;
  TestOptions o_;
  LossOut whole_;
  std::vector<double> whole_grad_;
  std::vector<uint8_t> raw_loss_;
};

}  // namespace
