// test_vocab_parallel.cpp — the vocabulary-parallel calls (fce_vp_*, docs/semantics.md rule 16) on
// the backend FCE_TEST_BACKEND selects, with P = 1, 2, 3, 4 ranks simulated in one process:
// phase 1 on each shard, the stats "all-gathered" by the test (in rank order and in a permuted
// order), then fce_vp_loss and each shard's fce_vp_backward / fce_vp_linear_backward. Every
// result is compared with the UNSHARDED call on the same backend (fce_forward, fce_linear_ce)
// and with the float64 reference (ref.h), with the bounds the unsharded suites use (test_util.h
// tolerance(), test_linear_ce's bound for the linear case): loss, lse, z_loss, argmax and
// accuracy (check_ce.h, near ties allowed either way), error flags, the gradient of every
// shard's columns, the sum of the ranks' partial grad_hidden, grad_weight / grad_bias rows.
// Outputs are poisoned, guards and row gaps checked, inputs checked untouched.
//
// Also: the tiling check (a shard missing, duplicated or replaced: NaN rows and
// FCE_FLAG_SHARDS_INCONSISTENT), adversarial rows (±1e30 shared offsets, a −inf shard, NaN),
// determinism, and bad input to every new entry point (status, a message naming the function
// and the argument, every buffer untouched).
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <numeric>
#include <thread>

#include "check_ce.h"

using namespace fcet;

namespace {

constexpr double kArgmaxTie = 16.0 / 16777216.0;  // as test_ce.cpp

// ------------------------------------------------------------------ shards ------------------
struct Shard {
  int64_t start, local;
};

// P shards of [0, V): uneven ones grow with the rank (weights 1, 2, ..., P), even ones differ
// by at most one class.
std::vector<Shard> make_shards(int64_t V, int P, bool uneven) {
  std::vector<Shard> s;
  const int64_t wsum = uneven ? int64_t(P) * (P + 1) / 2 : P;
  int64_t acc = 0, start = 0;
  for (int i = 0; i < P; ++i) {
    acc += uneven ? i + 1 : 1;
    int64_t end = i + 1 == P ? V : V * acc / wsum;
    end = std::min(std::max(end, start + 1), V - (P - 1 - i));  // every shard non-empty
    s.push_back({start, end - start});
    start = end;
  }
  return s;
}

// The gathered order of the ranks: 0..P-1, or a permutation of it (rotated and swapped).
std::vector<int> rank_order(int P, bool permuted) {
  std::vector<int> o(static_cast<size_t>(P));
  std::iota(o.begin(), o.end(), 0);
  if (permuted && P > 1) {
    std::rotate(o.begin(), o.begin() + 1, o.end());
    std::swap(o[0], o[static_cast<size_t>(P - 1)]);
  }
  return o;
}

// gathered_stats [ranks, rows, FCE_VP_STATS] from the stats buffers (pulled) in the given order.
Buf gather(const std::vector<const Buf*>& stats, int64_t rows) {
  const size_t one = static_cast<size_t>(rows) * FCE_VP_STATS * 4;
  Buf g(stats.size() * one);
  for (size_t q = 0; q < stats.size(); ++q) std::memcpy(g.h() + q * one, stats[q]->h(), one);
  g.push();
  return g;
}

// Targets at read positions set to the first and the last class of every shard of every P
// (uneven and even), so that every shard holds targets (checked by the runner).
void spread_targets(int64_t N, int64_t V, int64_t T, int64_t k, std::vector<int64_t>& y) {
  std::vector<int64_t> read;  // positions of y that some row is scored against
  for (int64_t p = 0; p < N; ++p)
    if (T == 0 || p % T >= (k > 0 ? k : 1)) read.push_back(p);
  size_t next = 0;
  for (bool uneven : {true, false})
    for (int P = 1; P <= 4; ++P)
      for (const Shard& s : make_shards(V, P, uneven))
        for (int64_t cls : {s.start, s.start + s.local - 1}) {
          y[static_cast<size_t>(read[next % read.size()])] = cls;
          next += read.size() >= 40 ? 2 : 1;  // distinct positions while there are enough
        }
}

std::vector<uint8_t> raw_elements(const Buf& b, const Mat& m) {
  std::vector<uint8_t> out;
  for (int64_t r = 0; r < m.rows; ++r)
    out.insert(out.end(), b.h() + m.offset(r, 0), b.h() + m.offset(r, 0) + m.cols * m.esize());
  return out;
}

::testing::AssertionResult guards_intact(const Buf& b, const char* what) {
  if (b.empty()) return ::testing::AssertionSuccess();
  const auto& mm = b.mirror();
  for (size_t i = 0; i < kGuard; ++i)
    if (mm[i] != kGuardByte || mm[kGuard + b.size() + i] != kGuardByte)
      return ::testing::AssertionFailure() << what << ": guard bytes around it were overwritten";
  return ::testing::AssertionSuccess();
}

// The sharded argmax against the unsharded call's: equal, except in rows whose maximum is a near
// tie (check_ce.h), where either may pick another entry within the tie; and against the
// reference (argmax_matches).
::testing::AssertionResult argmax_agrees(const std::vector<int64_t>& vp,
                                         const std::vector<int64_t>& whole,
                                         const fceref::CeResult& ref, int64_t V, double tie) {
  const std::vector<bool> amb = ambiguous_argmax_rows(ref, V, tie);
  int64_t bad = 0;
  std::ostringstream msg;
  for (size_t r = 0; r < vp.size(); ++r)
    if (vp[r] != whole[r] && !amb[r]) {
      if (bad < 5) msg << "\n  row " << r << ": sharded " << vp[r] << ", unsharded " << whole[r];
      ++bad;
    }
  if (bad)
    return ::testing::AssertionFailure() << "argmax vs the unsharded call: " << bad
                                         << " rows differ" << msg.str();
  return argmax_matches(vp, ref, V, tie, nullptr);
}

// The reference's values as float32 outputs hold them: rounded to float (a value past the
// float32 range is the infinity a float32 result must be; e.g. z-loss of a row at 1e30).
std::vector<double> as_f32(const std::vector<double>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = static_cast<float>(v[i]);
  return out;
}
double as_f32(double v) { return static_cast<float>(v); }

uint32_t read_flags(const Buf& f) {
  uint32_t v;
  std::memcpy(&v, f.h(), 4);
  return v;
}

Buf flags_buf(uint32_t preset) {
  Buf f(4, 0);
  std::memcpy(f.h(), &preset, 4);
  f.push();
  return f;
}

// What the unsharded call and the sharded one produce for the loss (kept as doubles).
struct LossOut {
  std::vector<double> loss, lse, zl, acc;
  std::vector<int64_t> am;
  uint32_t flags = 0;
};

// ------------------------------------------------------------------ cross-entropy cases ----
struct VpCase {
  std::string name;
  int64_t N = 37, V = 301;
  int dtype = FCE_FLOAT32;
  int tdtype = FCE_INT64;
  int reduction = FCE_REDUCTION_MEAN;
  float eps = 0, lambda = 0, softcap = 0, scale = 1;
  bool weights = false;
  double ignore_frac = 0;
  int64_t ignore_index = -100;
  int64_t shift = 0, shift_k = 0;  // shift_seq_len T, options.shift k
  bool token_scaling = false;
  bool argmax = false, accuracy = false;
  int64_t row_pad = 0, grad_pad = 0;  // strides of each shard's logits / gradient
  bool inplace = false;               // fce_vp_backward over the shard's logits
  bool gout = true;
  float gscale = 0.7f;
  bool uneven = true;
  bool spread = true;                 // targets at every shard's edges (spread_targets)
  bool check_held = true;             // check that every shard holds some scored row's target
  int invalid = 0;                    // rows given out-of-range targets
  double std_lo = 1, std_hi = 30;
  std::vector<int> ranks = {1, 2, 3, 4};
  uint64_t seed = 1;
  std::function<void(const VpCase&, std::vector<double>& z, std::vector<int64_t>& y)> edit;
};

std::string case_label(const VpCase& c) {
  std::ostringstream s;
  s << c.name << " [" << backend_name() << " " << dtype_name(c.dtype) << " "
    << dtype_name(c.tdtype) << " " << reduction_name(c.reduction) << " N=" << c.N
    << " V=" << c.V << " eps=" << c.eps << " lambda=" << c.lambda << " softcap=" << c.softcap
    << " scale=" << c.scale << (c.weights ? " weights" : "") << " shift=" << c.shift
    << " k=" << c.shift_k << (c.token_scaling ? " token_scaling" : "")
    << (c.argmax ? " argmax" : "") << (c.accuracy ? " accuracy" : "")
    << " row_pad=" << c.row_pad << " grad_pad=" << c.grad_pad << (c.inplace ? " inplace" : "")
    << (c.gout ? " grad_output" : " grad_output=NULL") << (c.uneven ? " uneven" : " even")
    << " invalid=" << c.invalid << "]";
  return s.str();
}

void PrintTo(const VpCase& c, std::ostream* os) { *os << case_label(c); }

// Every other row's target becomes its argmax (unless ignored): p_y large (test_ce.cpp's).
void confident_targets(const VpCase& c, std::vector<double>& z, std::vector<int64_t>& y) {
  for (int64_t r = 0; r < c.N; r += 2) {
    const double* row = &z[static_cast<size_t>(r * c.V)];
    if (y[static_cast<size_t>(r)] != c.ignore_index)
      y[static_cast<size_t>(r)] = std::max_element(row, row + c.V) - row;
  }
}

class VpCeRunner {
 public:
  explicit VpCeRunner(VpCase c) : c_(std::move(c)) {
    std::mt19937_64 rng(c_.seed * 1000003u + static_cast<uint64_t>(c_.N * 131 + c_.V));
    z_ = random_logits(rng, c_.dtype, c_.N, c_.V, c_.std_lo, c_.std_hi);
    y_ = random_targets(rng, c_.N, c_.V, c_.ignore_frac, c_.ignore_index);
    if (c_.weights) w_ = random_uniform(rng, static_cast<size_t>(c_.V), 0.1, 2.0);
    if (c_.gout) {
      if (c_.reduction == FCE_REDUCTION_NONE)
        g_ = random_uniform(rng, static_cast<size_t>(c_.N), -1.5, 1.5);
      else
        g_ = {c_.gscale};
    }
    if (c_.edit) c_.edit(c_, z_, y_);
    if (c_.spread) spread_targets(c_.N, c_.V, c_.shift, c_.shift_k, y_);
    const int64_t bad[] = {c_.V, -1, c_.V + 1000, int64_t{1} << 40};
    for (int i = 0; i < c_.invalid; ++i) {
      int64_t v = bad[i % 4];
      if (v == c_.ignore_index) v = -2;
      if (c_.tdtype == FCE_INT32 && v > INT32_MAX) v = INT32_MAX;
      y_[static_cast<size_t>(c_.N - 1 - 2 * i)] = v;
    }
    fceref::Options ro;
    ro.reduction = c_.reduction;
    ro.label_smoothing = c_.eps;
    ro.z_loss_scale = c_.lambda;
    ro.softcap = c_.softcap;
    ro.logit_scale = c_.scale;
    ro.class_weights = w_;
    ro.ignore_index = c_.ignore_index;
    ro.shift_seq_len = c_.shift;
    ro.shift = c_.shift_k;
    ro.token_scaling = c_.token_scaling;
    ref_ = fceref::cross_entropy(ro, c_.N, c_.V, z_, y_, g_.empty() ? nullptr : &g_, true);
    targets_ = targets_buf(y_, c_.tdtype);
    if (c_.weights) weights_ = f32_buf(w_);
    if (c_.gout) gout_ = f32_buf(g_);
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
  void backward(const Shard& s, Buf& gathered, int64_t ranks, std::vector<double>* grad,
                uint32_t* flags_out) {
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
    Buf flags = flags_buf(0);
    size_t wsb = 1;
    EXPECT_EQ(fce_vp_backward_workspace_size(&o, ranks, c_.N, c_.V, s.local, &wsb), FCE_SUCCESS)
        << fce_last_error();
    Buf ws = workspace_buf(wsb);
    auto b_logits = logits.mirror(), b_g = gathered.mirror(), b_y = targets_.mirror(),
         b_go = gout_.mirror(), b_grad = gbuf.mirror(), b_am = am.mirror(), b_acc = acc.mirror();
    const fce_status st = flat::vp_backward(&o, ranks, c_.N, c_.V, s.start, s.local, logits.ptr(),
                                          targets_.ptr(), gathered.p<float>(), gout_.p<float>(),
                                          gptr, flags.p<uint32_t>(), ws.ptr(), wsb, test_stream());
    ASSERT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    ASSERT_TRUE(finish());
    for (Buf* b : {&logits, &gathered, &targets_, &gout_, &gbuf, &am, &acc, &flags, &ws}) b->pull();
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
    *flags_out = read_flags(flags);
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
    Buf gathered_perm;
    for (bool permuted : {false, true}) {
      if (permuted && P == 1) continue;
      SCOPED_TRACE(permuted ? "gathered in a permuted rank order" : "gathered in rank order");
      std::vector<const Buf*> order;
      for (int q : rank_order(P, permuted)) order.push_back(&stats[static_cast<size_t>(q)]);
      Buf gathered = gather(order, c_.N);
      check_loss(loss(gathered, P));
      if (permuted || P == 1) gathered_perm = std::move(gathered);
    }
    std::vector<double> grad(static_cast<size_t>(c_.N * c_.V), -12345.0);
    for (const Shard& s : shards) {
      uint32_t f = 0;
      ASSERT_NO_FATAL_FAILURE(backward(s, gathered_perm, P, &grad, &f));
      EXPECT_EQ(f, invalid_flag()) << "error_flags (fce_vp_backward)";
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

struct OptionSet {
  const char* name;
  std::function<void(VpCase&)> apply;
};

const std::vector<OptionSet>& option_sets() {
  static const std::vector<OptionSet> sets = {
      {"plain", [](VpCase&) {}},
      {"even_shards", [](VpCase& c) { c.uneven = false; c.V = 300; }},
      {"ignored_int32_gradoutput_null",
       [](VpCase& c) { c.tdtype = FCE_INT32; c.ignore_frac = 0.3; c.gout = false; }},
      {"custom_ignore_index", [](VpCase& c) { c.ignore_index = 3; c.ignore_frac = 0.25; }},
      {"invalid_targets", [](VpCase& c) { c.invalid = 3; c.ignore_frac = 0.1; c.argmax = c.accuracy = true; }},
      {"weights_label_smoothing",
       [](VpCase& c) { c.weights = true; c.eps = 0.1f; c.ignore_frac = 0.1; }},
      {"label_smoothing", [](VpCase& c) { c.eps = 0.2f; }},
      {"weights", [](VpCase& c) { c.weights = true; c.tdtype = FCE_INT32; }},
      {"zloss", [](VpCase& c) { c.lambda = 1e-3f; c.ignore_frac = 0.1; }},
      {"weights_zloss", [](VpCase& c) { c.weights = true; c.lambda = 1e-3f; c.ignore_frac = 0.15; }},
      {"softcap", [](VpCase& c) { c.softcap = 30.0f; }},
      {"softcap_scale", [](VpCase& c) { c.softcap = 15.0f; c.scale = 0.6f; }},
      {"logit_scale", [](VpCase& c) { c.scale = 2.5f; c.std_hi = 10; }},
      {"negative_logit_scale", [](VpCase& c) { c.scale = -0.75f; }},
      {"shift", [](VpCase& c) { c.shift = 8; c.N = 32; c.ignore_frac = 0.1; }},
      {"shift_k3", [](VpCase& c) { c.shift = 11; c.shift_k = 3; c.N = 33; c.argmax = true; }},
      {"token_scaling",
       [](VpCase& c) {
         c.token_scaling = true; c.ignore_frac = 0.1; c.std_hi = 5; c.edit = confident_targets;
         c.spread = false;  // test_ce.cpp's data: rows of large p_y (16-bit subnormals otherwise)
       }},
      {"token_scaling_zloss_smoothing",
       [](VpCase& c) {
         c.token_scaling = true; c.lambda = 1e-3f; c.eps = 0.1f; c.ignore_frac = 0.1; c.std_hi = 5;
         c.spread = false;
         // (random targets here give float16 gradients so small that fce_forward itself misses
         // the bound against the reference, which is for normal numbers)
         c.edit = confident_targets;
       }},
      {"argmax_accuracy", [](VpCase& c) { c.argmax = c.accuracy = true; c.ignore_frac = 0.2; }},
      {"accuracy_only", [](VpCase& c) { c.accuracy = true; c.ignore_frac = 0.2; }},
      {"argmax_accuracy_confident",
       [](VpCase& c) { c.argmax = c.accuracy = true; c.ignore_frac = 0.1; c.edit = confident_targets; }},
      {"strided", [](VpCase& c) { c.row_pad = 13; c.grad_pad = 5; }},
      {"inplace", [](VpCase& c) { c.inplace = true; }},
      {"inplace_strided", [](VpCase& c) { c.inplace = true; c.row_pad = 3; }},
      {"everything",
       [](VpCase& c) {
         c.tdtype = FCE_INT32; c.weights = true; c.eps = 0.05f; c.lambda = 1e-4f;
         c.softcap = 20.0f; c.scale = 1.3f; c.shift = 6; c.shift_k = 2; c.N = 36;
         c.ignore_frac = 0.15; c.token_scaling = true; c.argmax = c.accuracy = true;
         c.row_pad = 7; c.grad_pad = 2; c.std_hi = 8; c.invalid = 2;
       }},
      {"everything_inplace",
       [](VpCase& c) {
         c.weights = true; c.eps = 0.1f; c.lambda = 2e-4f; c.softcap = 30.0f; c.scale = 0.8f;
         c.shift = 11; c.shift_k = 3; c.N = 33; c.ignore_frac = 0.1; c.row_pad = 5;
         c.inplace = true; c.token_scaling = true; c.argmax = c.accuracy = true; c.std_hi = 8;
         c.spread = false;
       }},
  };
  return sets;
}

std::vector<VpCase> matrix_cases() {
  std::vector<VpCase> cases;
  uint64_t seed = 1;
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16})
    for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE})
      for (const OptionSet& s : option_sets()) {
        VpCase c;
        c.dtype = dtype;
        c.reduction = red;
        c.seed = seed++;
        s.apply(c);
        c.name = std::string(dtype_name(dtype)) + "_" + reduction_name(red) + "_" + s.name;
        cases.push_back(c);
      }
  return cases;
}

class VpMatrix : public ::testing::TestWithParam<VpCase> {
 protected:
  void SetUp() override { FCE_REQUIRE_BACKEND(); }
};

TEST_P(VpMatrix, ShardedMatchesUnsharded) {
  VpCeRunner run(GetParam());
  run.run();
}

INSTANTIATE_TEST_SUITE_P(Options, VpMatrix, ::testing::ValuesIn(matrix_cases()),
                         [](const ::testing::TestParamInfo<VpCase>& i) { return i.param.name; });

// ------------------------------------------------------------------ corner cases ------------
class Vp : public BackendTest {};

// Every row ignored: loss 0 (mean: 0, not NaN), zero gradient, lse still written.
TEST_F(Vp, AllRowsIgnored) {
  for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE}) {
    VpCase c;
    c.name = "all_ignored";
    c.reduction = red;
    c.N = 9;
    c.spread = c.check_held = false;
    c.ignore_frac = 1.0;
    c.argmax = c.accuracy = true;
    c.lambda = 1e-3f;
    VpCeRunner run(c);
    run.run();
  }
}

// One row, one class per shard (V = P), and a shard of one class next to big ones.
TEST_F(Vp, TinyShards) {
  for (int64_t V : {1, 2, 3, 4}) {
    VpCase c;
    c.name = "tiny";
    c.N = 5;
    c.V = V;
    c.uneven = false;
    c.spread = c.check_held = false;
    c.eps = 0.1f;
    c.argmax = c.accuracy = true;
    c.ranks.clear();
    for (int P = 1; P <= V; ++P) c.ranks.push_back(P);
    VpCeRunner run(c);
    run.run();
  }
  VpCase c;
  c.name = "single_row";
  c.N = 1;
  c.V = 7;
  c.spread = c.check_held = false;
  c.argmax = true;
  VpCeRunner run(c);
  run.run();
}

// The same inputs in the same order give the same loss bits (every rank computes it); the
// stats of a shard are the same bits whatever the call.
TEST_F(Vp, Deterministic) {
  VpCase c;
  c.name = "deterministic";
  c.N = 64;
  c.V = 1000;
  c.eps = 0.1f;
  c.lambda = 1e-3f;
  c.weights = true;
  c.argmax = c.accuracy = true;
  VpCeRunner run(c);
  ASSERT_NO_FATAL_FAILURE(run.unsharded());
  const std::vector<Shard> shards = make_shards(c.V, 3, true);
  std::vector<Buf> stats, again;
  for (const Shard& s : shards) stats.push_back(run.stats(s));
  for (const Shard& s : shards) again.push_back(run.stats(s));
  for (size_t i = 0; i < stats.size(); ++i)
    EXPECT_TRUE(bitwise_equal(stats[i].mirror(), again[i].mirror(), "stats (two calls)"));
  Buf g = gather({&stats[2], &stats[0], &stats[1]}, c.N);
  run.loss(g, 3);
  const std::vector<uint8_t> first = run.raw_loss();
  for (int i = 0; i < 3; ++i) {
    run.loss(g, 3);
    EXPECT_TRUE(bitwise_equal(run.raw_loss(), first, "loss (same gathered stats)"));
  }
}

// ------------------------------------------------------------------ the tiling check --------
// A shard's stats missing or duplicated: every row NaN (loss, lse, gradient), argmax -1,
// FCE_FLAG_SHARDS_INCONSISTENT — a duplicate shows in every row as two ranks reporting the same
// argmax, also when it replaces another shard of the same size (the sizes still sum to V).
TEST_F(Vp, TilingCheck) {
  for (int red : {FCE_REDUCTION_NONE, FCE_REDUCTION_MEAN}) {
    VpCase c;
    c.name = "tiling";
    c.reduction = red;
    c.V = 300;
    c.uneven = false;
    c.ignore_frac = 0.3;
    c.lambda = 1e-3f;
    c.argmax = c.accuracy = true;
    VpCeRunner run(c);
    ASSERT_NO_FATAL_FAILURE(run.unsharded());
    const std::vector<Shard> sh = make_shards(c.V, 3, false);  // 100 classes each
    // stats[3]: a wrong shard, [150, 250) (overlapping shard 2, leaving [100, 150) to none):
    // sizes that sum to V and distinct argmaxes, so only the rows whose target is held by no
    // shard or by two can be caught
    std::vector<Shard> all = sh;
    all.push_back(Shard{150, 100});
    std::vector<Buf> st;
    for (const Shard& s : all) st.push_back(run.stats(s));
    const struct {
      const char* what;
      std::vector<int> order;
    } cases[] = {
        {"shard 1 missing", {0, 2}},
        {"shard 2 missing", {0, 1}},
        {"shard 0 duplicated", {0, 1, 0, 2}},
        {"shard 2 twice instead of shard 1", {0, 2, 2}},
        {"shard 0 twice instead of shard 2, permuted", {1, 0, 0}},
        {"shard 1 computed at [150, 250)", {0, 3, 2}},
    };
    const auto& ref = run.ref();
    for (const auto& tc : cases) {
      SCOPED_TRACE(std::string(tc.what) + " (" + reduction_name(red) + ")");
      std::vector<const Buf*> order;
      int64_t local_sum = 0;
      for (int q : tc.order) {
        order.push_back(&st[static_cast<size_t>(q)]);
        local_sum += all[static_cast<size_t>(q)].local;
      }
      // The rows the check must catch: every row when the sizes do not sum to V or a shard is
      // gathered twice (its argmax appears twice), else the scored rows whose target is held
      // by no gathered shard or by two.
      bool twice = false;
      for (size_t i = 0; i < tc.order.size(); ++i)
        for (size_t k = 0; k < i; ++k) twice |= tc.order[i] == tc.order[k];
      std::vector<bool> bad(static_cast<size_t>(c.N));
      int64_t n_bad = 0;
      for (int64_t r = 0; r < c.N; ++r) {
        const size_t ri = static_cast<size_t>(r);
        int holders = 0;
        for (int q : tc.order) {
          const Shard& s = all[static_cast<size_t>(q)];
          holders += ref.target[ri] >= s.start && ref.target[ri] < s.start + s.local;
        }
        // (two overlapping shards may also hold a row's maximum both: the same argmax)
        bool same_argmax = false;
        for (size_t i = 0; i < tc.order.size(); ++i)
          for (size_t k = 0; k < i; ++k) {
            int32_t a = 0, b = 0;
            const size_t at = (ri * FCE_VP_STATS + 6) * 4;  // VpStat kVpArgmax
            std::memcpy(&a, st[static_cast<size_t>(tc.order[i])].h() + at, 4);
            std::memcpy(&b, st[static_cast<size_t>(tc.order[k])].h() + at, 4);
            same_argmax |= a == b;
          }
        bad[ri] = local_sum != c.V || twice || same_argmax ||
                  (ref.kind[ri] == fceref::kValid && holders != 1);
        n_bad += bad[ri];
      }
      ASSERT_GT(n_bad, 0);
      const int64_t ranks = static_cast<int64_t>(tc.order.size());
      Buf g = gather(order, c.N);
      const LossOut v = run.loss(g, ranks, 0x100u);
      EXPECT_EQ(v.flags, 0x100u | FCE_FLAG_SHARDS_INCONSISTENT) << "error_flags (fce_vp_loss)";
      for (int64_t r = 0; r < c.N; ++r) {
        const size_t ri = static_cast<size_t>(r);
        const bool ignored = ref.kind[ri] == fceref::kIgnored;
        if (bad[ri]) {
          EXPECT_TRUE(std::isnan(v.lse[ri])) << "row " << r << " lse " << v.lse[ri];
          EXPECT_EQ(v.am[ri], -1) << "row " << r << " argmax";
          if (red == FCE_REDUCTION_NONE) {
            EXPECT_TRUE(std::isnan(v.loss[ri])) << "row " << r << " loss " << v.loss[ri];
            EXPECT_EQ(v.acc[ri], 0.0) << "row " << r << " accuracy";
          }
        } else {
          EXPECT_TRUE(std::isfinite(v.lse[ri])) << "row " << r << " lse " << v.lse[ri];
          if (ignored) { EXPECT_EQ(v.am[ri], -1) << "ignored row " << r << " argmax"; }
          if (red == FCE_REDUCTION_NONE) {
            if (ignored) {
              EXPECT_EQ(v.loss[ri], 0.0) << "ignored row " << r;
            } else {
              EXPECT_TRUE(std::isfinite(v.loss[ri])) << "row " << r << " loss " << v.loss[ri];
            }
          }
        }
      }
      if (red != FCE_REDUCTION_NONE) {
        EXPECT_TRUE(std::isnan(v.loss[0])) << "reduced loss " << v.loss[0];
        EXPECT_TRUE(std::isnan(v.zl[0])) << "z_loss " << v.zl[0];
      }
      // The gradient of each shard: the rows caught NaN, the others finite (ignored: 0).
      std::vector<double> grad(static_cast<size_t>(c.N * c.V), 0.0);
      for (const Shard& s : sh) {
        uint32_t f = 0;
        ASSERT_NO_FATAL_FAILURE(run.backward(s, g, ranks, &grad, &f));
        EXPECT_EQ(f, FCE_FLAG_SHARDS_INCONSISTENT) << "error_flags (fce_vp_backward)";
      }
      for (int64_t r = 0; r < c.N; ++r) {
        const size_t ri = static_cast<size_t>(r);
        const bool ignored = ref.kind[ri] == fceref::kIgnored;
        for (int64_t j = 0; j < c.V; ++j) {
          const double x = grad[static_cast<size_t>(r * c.V + j)];
          const bool ok = bad[ri] ? std::isnan(x) : ignored ? x == 0.0 : std::isfinite(x);
          if (!ok) {
            ADD_FAILURE() << "gradient row " << r << " column " << j << ": " << x
                          << (bad[ri] ? " (expected NaN)" : ignored ? " (expected 0)" : " (expected finite)");
            break;
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------ adversarial rows --------
// f32 rows sharing a huge offset (all ±1e30, or 1e30 and its neighbour), a shard of −inf (the
// target outside it: finite; inside it: +inf), a row of −inf (lse −inf, loss NaN), NaN in one
// shard (the whole row NaN, argmax the first NaN whatever the gathered order), a +inf in one
// shard or in two (the whole row NaN as torch's log_softmax makes it, argmax the first +inf).
// Against the unsharded call and the reference; every P; rank order and permuted.
void adversarial_rows(const VpCase& c, std::vector<double>& z, std::vector<int64_t>& y) {
  const int64_t V = c.V;
  auto row = [&](int64_t r) { return &z[static_cast<size_t>(r * V)]; };
  const float big = 1e30f, below = std::nextafter(1e30f, 0.0f);
  const double inf = HUGE_VAL, nan = std::numeric_limits<double>::quiet_NaN();
  for (int64_t j = 0; j < V; ++j) {
    row(0)[j] = -1e30f;
    row(1)[j] = big;
    row(2)[j] = (j % 3 == 0) ? big : below;
    row(3)[j] = (j % 5 == 0) ? -static_cast<double>(below) : -1e30f;
    if (j < V / 3) row(4)[j] = -inf, row(5)[j] = -inf;
    row(6)[j] = -inf;
  }
  row(7)[V / 2] = nan;
  row(8)[V - 7] = nan;
  row(8)[V / 5] = nan;
  row(9)[V / 3 - 1] = -inf;  // one −inf entry, the target's
  row(10)[V / 2 + 3] = inf;  // one +inf, the target elsewhere
  row(11)[V - 2] = inf;      // two +inf in two shards, the target on the first
  row(11)[7] = inf;
  y[0] = 5;
  y[1] = V - 1;
  y[2] = 3;
  y[3] = V / 2;
  y[4] = V / 2;      // finite shard
  y[5] = 1;          // in the −inf block: loss +inf
  y[6] = 2;
  y[7] = 0;
  y[8] = V - 1;
  y[9] = V / 3 - 1;  // its logit is −inf: loss +inf
  y[10] = 4;         // a +inf in the row: loss, lse and gradient NaN
  y[11] = 7;
}

TEST_F(Vp, AdversarialRows) {
  for (int red : {FCE_REDUCTION_NONE, FCE_REDUCTION_MEAN})
    for (int variant = 0; variant < 3; ++variant) {
      VpCase c;
      c.name = "adversarial";
      c.reduction = red;
      c.N = 12;
      c.V = 300;  // shards of P = 3 (even): [0, 100) is the −inf block of rows 4, 5
      c.uneven = false;
      c.spread = c.check_held = false;
      c.argmax = c.accuracy = true;
      c.edit = adversarial_rows;
      if (variant == 1) c.eps = 0.1f, c.lambda = 1e-4f, c.weights = true;
      if (variant == 2) c.token_scaling = true, c.softcap = 0.0f, c.scale = 1.0f;
      VpCeRunner run(c);
      run.run();
    }
}

// ------------------------------------------------------------------ fused linear ------------
struct LinVpCase {
  std::string name;
  int64_t N = 37, D = 24, V = 301;
  int dtype = FCE_FLOAT32;
  int tdtype = FCE_INT64;
  int reduction = FCE_REDUCTION_MEAN;
  float eps = 0, lambda = 0, softcap = 0, scale = 1;
  bool weights = false;
  double ignore_frac = 0;
  int64_t shift = 0, shift_k = 0;
  bool token_scaling = false;
  bool argmax = false, accuracy = false;
  bool confident = false;
  int invalid = 0;
  int64_t h_pad = 0;
  bool bias = true;
  bool gh = true, gw = true, gb = true;
  bool gh_f32 = false;        // grad_hidden_dtype FCE_FLOAT32 (else options->dtype)
  bool accumulate = false;
  bool gw_fp32 = false;
  bool gout = true;
  float gscale = 0.7f;
  bool ws_min = false;        // the workspaces of min_bytes (else optimal_bytes)
  bool uneven = true;
  double zstd = -1;
  std::vector<int> ranks = {1, 2, 3, 4};
  uint64_t seed = 1;
};

std::string lin_label(const LinVpCase& c) {
  std::ostringstream s;
  s << c.name << " [" << backend_name() << " " << dtype_name(c.dtype) << " "
    << reduction_name(c.reduction) << " N=" << c.N << " D=" << c.D << " V=" << c.V
    << " eps=" << c.eps << " lambda=" << c.lambda << " softcap=" << c.softcap
    << " scale=" << c.scale << (c.weights ? " weights" : "") << " shift=" << c.shift
    << " k=" << c.shift_k << (c.token_scaling ? " token_scaling" : "")
    << (c.bias ? " bias" : " no-bias") << " grads=" << c.gh << c.gw << c.gb
    << (c.gh_f32 ? " grad_hidden f32" : " grad_hidden dtype")
    << (c.accumulate ? " accumulate" : "") << (c.gw_fp32 ? " grad_weight_fp32" : "")
    << (c.gout ? "" : " grad_output=NULL") << " h_pad=" << c.h_pad
    << (c.ws_min ? " workspace=min" : " workspace=optimal") << " invalid=" << c.invalid << "]";
  return s.str();
}

void PrintTo(const LinVpCase& c, std::ostream* os) { *os << lin_label(c); }

// test_linear_ce.cpp's bound: float32 1e-5; 16-bit: the dtype's roundings and the logits'
// (what torch eager's logits in the dtype would perturb).
double lin_tolerance(int dtype, const std::vector<double>& z) {
  if (dtype == FCE_FLOAT32) return 1e-5;
  double zmax = 0;
  for (double v : z) zmax = std::max(zmax, std::fabs(v));
  return unit_roundoff(dtype) * (4.0 + 2.0 * zmax);
}

double argmax_tie(int dtype) { return dtype == FCE_FLOAT32 ? 1e-5 : 2 * unit_roundoff(dtype); }

double rms(const std::vector<double>& v) {
  double s = 0;
  size_t n = 0;
  for (double x : v)
    if (std::isfinite(x)) s += x * x, ++n;
  return n ? std::sqrt(s / static_cast<double>(n)) : 0.0;
}

// The ranks of one fce_vp_linear_ce step in one process: one thread per rank, all on the one
// test stream; their all-gathers meet here. When every rank has called (count agreed), each
// copies every rank's send into its recv at that rank's slot (rank_order: a permuted order
// works), on the test stream after everything the ranks enqueued so far (CUDA) or at once (CPU),
// then waits until every rank has copied (so no send is reused before). A rank whose call
// returns leaves; a gather that cannot complete (a rank gone, or 60 s) returns an error instead
// of hanging the suite.
class SimGather {
 public:
  SimGather(int ranks, std::vector<int> slots)
      : P_(ranks), slots_(std::move(slots)), sends_(static_cast<size_t>(ranks)),
        counts_(static_cast<size_t>(ranks)), calls_(static_cast<size_t>(ranks), 0) {}

  struct Rank {
    SimGather* g;
    int rank;
  };
  static fce_status fn(void* ctx, const float* send, float* recv, int64_t count, void* stream) {
    const Rank* r = static_cast<const Rank*>(ctx);
    return r->g->gather(r->rank, send, recv, count, stream);
  }
  void leave() {
    std::lock_guard<std::mutex> lk(m_);
    ++left_;
    cv_.notify_all();
  }
  int calls(int rank) const { return calls_[static_cast<size_t>(rank)]; }
  bool mismatch() const { return mismatch_; }

 private:
  bool barrier(std::unique_lock<std::mutex>& lk) {  // false: a rank left, or the time ran out
    const uint64_t gen = gen_;
    if (++arrived_ == P_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
      return true;
    }
    const bool ok = cv_.wait_for(lk, std::chrono::seconds(60),
                                 [&] { return gen_ != gen || left_ > 0; });
    return ok && gen_ != gen;
  }
  fce_status gather(int rank, const float* send, float* recv, int64_t count, void* stream) {
    std::unique_lock<std::mutex> lk(m_);
    sends_[static_cast<size_t>(rank)] = send;
    counts_[static_cast<size_t>(rank)] = count;
    ++calls_[static_cast<size_t>(rank)];
    if (!barrier(lk)) return FCE_ERROR_INTERNAL;
    for (int q = 0; q < P_; ++q)
      if (counts_[static_cast<size_t>(q)] != count) mismatch_ = true;
    if (mismatch_) return FCE_ERROR_INTERNAL;
    lk.unlock();
    const size_t bytes = static_cast<size_t>(count) * sizeof(float);
    for (int q = 0; q < P_; ++q) {
      float* dst = recv + static_cast<int64_t>(slots_[static_cast<size_t>(q)]) * count;
#if FCE_TEST_HAVE_CUDA
      if (on_cuda()) {
        FCE_CUDA_CHECK(cudaMemcpyAsync(dst, sends_[static_cast<size_t>(q)], bytes,
                                       cudaMemcpyDeviceToDevice,
                                       static_cast<cudaStream_t>(stream)));
        continue;
      }
#endif
      (void)stream;
      std::memcpy(dst, sends_[static_cast<size_t>(q)], bytes);
    }
    lk.lock();
    return barrier(lk) ? FCE_SUCCESS : FCE_ERROR_INTERNAL;
  }

  const int P_;
  const std::vector<int> slots_;
  std::vector<const float*> sends_;
  std::vector<int64_t> counts_;
  std::vector<int> calls_;
  std::mutex m_;
  std::condition_variable cv_;
  int arrived_ = 0, left_ = 0;
  uint64_t gen_ = 0;
  bool mismatch_ = false;
};

class VpLinRunner {
 public:
  explicit VpLinRunner(LinVpCase c) : c_(std::move(c)) {
    if (c_.zstd < 0) c_.zstd = c_.dtype == FCE_FLOAT32 ? 8.0 : 1.5;
    c_.gb = c_.gb && c_.bias;
    std::mt19937_64 rng(c_.seed * 1000003u + static_cast<uint64_t>(c_.N * 7 + c_.D * 131 + c_.V));
    h_ = random_normal(rng, c_.dtype, static_cast<size_t>(c_.N * c_.D), 1.0);
    W_ = random_normal(rng, c_.dtype, static_cast<size_t>(c_.V * c_.D),
                       c_.zstd / std::sqrt(static_cast<double>(c_.D)));
    if (c_.bias)
      b_ = random_normal(rng, c_.dtype, static_cast<size_t>(c_.V), c_.dtype == FCE_FLOAT32 ? 1.0 : 0.5);
    y_ = random_targets(rng, c_.N, c_.V, c_.ignore_frac);
    if (c_.weights) w_ = random_uniform(rng, static_cast<size_t>(c_.V), 0.1, 2.0);
    if (c_.gout) {
      if (c_.reduction == FCE_REDUCTION_NONE)
        g_ = random_uniform(rng, static_cast<size_t>(c_.N), -1.5, 1.5);
      else
        g_ = {c_.gscale};
    }
    if (c_.confident) {  // row r is scored against y[r + k]: that one becomes row r's argmax
      const int64_t k = c_.shift > 0 ? std::max<int64_t>(c_.shift_k, 1) : 0;
      for (int64_t r = 0; r + k < c_.N; r += 4) {
        if (y_[static_cast<size_t>(r + k)] == -100) continue;
        int64_t best = 0;
        double zbest = -HUGE_VAL;
        for (int64_t v = 0; v < c_.V; ++v) {
          double z = c_.bias ? b_[static_cast<size_t>(v)] : 0.0;
          for (int64_t j = 0; j < c_.D; ++j)
            z += h_[static_cast<size_t>(r * c_.D + j)] * W_[static_cast<size_t>(v * c_.D + j)];
          if (z > zbest) zbest = z, best = v;
        }
        y_[static_cast<size_t>(r + k)] = best;
      }
    }
    spread_targets(c_.N, c_.V, c_.shift, c_.shift_k, y_);
    for (int i = 0; i < c_.invalid; ++i)
      y_[static_cast<size_t>(c_.N - 1 - 2 * i)] = i % 2 ? -3 : c_.V + i;
    fceref::Options ro;
    ro.reduction = c_.reduction;
    ro.label_smoothing = c_.eps;
    ro.z_loss_scale = c_.lambda;
    ro.softcap = c_.softcap;
    ro.logit_scale = c_.scale;
    ro.class_weights = w_;
    ro.shift_seq_len = c_.shift;
    ro.shift = c_.shift_k;
    ro.token_scaling = c_.token_scaling;
    ref_ = fceref::linear_cross_entropy(ro, c_.N, c_.D, c_.V, h_, W_, b_, y_,
                                        g_.empty() ? nullptr : &g_, true);
    gdt_ = c_.gw_fp32 ? FCE_FLOAT32 : c_.dtype;
    ghdt_ = c_.gh_f32 ? FCE_FLOAT32 : c_.dtype;
    if (c_.accumulate) {
      const double sw = rms(ref_.grad_weight), sb = rms(ref_.grad_bias);
      gw0_ = random_normal(rng, gdt_, static_cast<size_t>(c_.V * c_.D), sw > 0 ? sw : 1.0);
      gb0_ = random_normal(rng, gdt_, static_cast<size_t>(c_.V), sb > 0 ? sb : 1.0);
    }
    tol_ = lin_tolerance(c_.dtype, ref_.logits);
    hm_ = mat(c_.dtype, c_.N, c_.D, c_.D + c_.h_pad);
    hidden_ = Buf(hm_);
    poison_all(hidden_, c_.dtype);
    write_mat(hidden_, hm_, h_);
    hidden_.push();
    targets_ = targets_buf(y_, c_.tdtype);
    if (c_.weights) cw_ = f32_buf(w_);
    if (c_.gout) gout_ = f32_buf(g_);
    o_ = test_options();
    o_.dtype = c_.dtype;
    o_.target_dtype = c_.tdtype;
    o_.reduction = c_.reduction;
    o_.label_smoothing = c_.eps;
    o_.z_loss_scale = c_.lambda;
    o_.softcap = c_.softcap;
    o_.logit_scale = c_.scale;
    o_.shift_seq_len = c_.shift;
    o_.shift = c_.shift_k;
    o_.token_scaling = c_.token_scaling;
    o_.hidden_row_stride = c_.h_pad ? hm_.stride : 0;
    o_.accumulate = c_.accumulate;
    o_.grad_weight_fp32 = c_.gw_fp32;
    o_.class_weights = cw_.p<float>();
  }

  uint32_t invalid_flag() const {
    for (auto k : ref_.ce.kind)
      if (k == fceref::kInvalid) return FCE_FLAG_TARGET_OUT_OF_RANGE;
    return 0u;
  }

  // Rows [start, start + local) of a [V, cols] matrix (dense values) as a buffer of dtype.
  static Buf rows_buf(const std::vector<double>& m, int64_t cols, int64_t start, int64_t local,
                      int dtype) {
    const Mat bm = mat(dtype, local, cols);
    Buf b(bm);
    std::vector<double> part(m.begin() + start * cols, m.begin() + (start + local) * cols);
    write_mat(b, bm, part);
    b.push();
    return b;
  }

  // The unsharded fce_linear_ce with every output.
  void unsharded() {
    SCOPED_TRACE(lin_label(c_) + " fce_linear_ce (unsharded)");
    const int64_t N = c_.N, D = c_.D, V = c_.V;
    Buf weight = rows_buf(W_, D, 0, V, c_.dtype);
    Buf bias = c_.bias ? rows_buf(b_, 1, 0, V, c_.dtype) : Buf();
    const Mat loss_m = vec(FCE_FLOAT32, c_.reduction == FCE_REDUCTION_NONE ? N : 1);
    const Mat gh_m = mat(c_.dtype, N, D), gw_m = mat(gdt_, V, D), gb_m = vec(gdt_, V);
    Buf loss = poisoned(loss_m), lse = poisoned(vec(FCE_FLOAT32, N)),
        zl = poisoned(vec(FCE_FLOAT32, 1)), am = poisoned(vec(FCE_INT64, N)),
        acc = poisoned(loss_m), flags = flags_buf(0);
    Buf gh = poisoned(gh_m), gw = poisoned(gw_m), gb = c_.bias ? poisoned(gb_m) : Buf();
    if (c_.accumulate) {
      write_mat(gw, gw_m, gw0_), gw.push();
      if (c_.bias) write_mat(gb, gb_m, gb0_), gb.push();
    }
    TestOptions o = o_;
    o.argmax = am.p<int64_t>();
    o.accuracy = acc.p<float>();
    size_t mn = 0, op = 0;
    ASSERT_EQ(fce_linear_ce_workspace_size(&o, N, D, V, 1, &mn, &op), FCE_SUCCESS)
        << fce_last_error();
    Buf ws = workspace_buf(op);
    const fce_status st =
        flat::linear_ce(&o, N, D, V, hidden_.ptr(), weight.ptr(), bias.ptr(), targets_.ptr(),
                      loss.p<float>(), lse.p<float>(), zl.p<float>(), gh.ptr(), gw.ptr(),
                      gb.ptr(), gout_.p<float>(), flags.p<uint32_t>(), ws.ptr(), op,
                      test_stream());
    ASSERT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    ASSERT_TRUE(finish());
    for (Buf* b : {&loss, &lse, &zl, &am, &acc, &flags, &gh, &gw, &gb}) b->pull();
    whole_.loss = read_mat(loss, loss_m);
    whole_.lse = read_mat(lse, vec(FCE_FLOAT32, N));
    whole_.zl = read_mat(zl, vec(FCE_FLOAT32, 1));
    whole_.am = read_i64(am, N);
    whole_.acc = read_mat(acc, loss_m);
    whole_.flags = read_flags(flags);
    whole_gh_ = read_mat(gh, gh_m);
    whole_gw_ = read_mat(gw, gw_m);
    if (c_.bias) whole_gb_ = read_mat(gb, gb_m);
    ASSERT_EQ(whole_.flags, invalid_flag()) << "fce_linear_ce's error flags";
  }

  size_t workspace(bool backward, int64_t ranks, const Shard& s) {
    size_t mn = 0, op = 0;
    fce_status st =
        backward ? fce_vp_linear_backward_workspace_size(&o_, ranks, c_.N, c_.D, c_.V, s.local,
                                                         ghdt_, &mn, &op)
                 : fce_vp_linear_stats_workspace_size(&o_, c_.N, c_.D, s.local, &mn, &op);
    EXPECT_EQ(st, FCE_SUCCESS) << fce_last_error();
    EXPECT_GE(op, mn) << "optimal_bytes < min_bytes";
    return c_.ws_min ? mn : op;
  }

  // fce_vp_linear_stats of shard s.
  Buf stats(const Shard& s, bool* ok = nullptr) {
    SCOPED_TRACE("fce_vp_linear_stats of shard [" + std::to_string(s.start) + ", +" +
                 std::to_string(s.local) + ")");
    Buf weight = rows_buf(W_, c_.D, s.start, s.local, c_.dtype);
    Buf bias = c_.bias ? rows_buf(b_, 1, s.start, s.local, c_.dtype) : Buf();
    const Mat sm = vec(FCE_FLOAT32, c_.N * FCE_VP_STATS);
    Buf st = poisoned(sm);
    const size_t wsb = workspace(false, 1, s);
    Buf ws = workspace_buf(wsb);
    auto b_h = hidden_.mirror(), b_w = weight.mirror(), b_b = bias.mirror(),
         b_st = st.mirror();
    const fce_status status =
        flat::vp_linear_stats(&o_, c_.N, c_.D, c_.V, s.start, s.local, hidden_.ptr(), weight.ptr(),
                            bias.ptr(), targets_.ptr(), st.p<float>(), ws.ptr(), wsb,
                            test_stream());
    EXPECT_EQ(status, FCE_SUCCESS) << fce_status_string(status) << ": " << fce_last_error();
    if (ok) *ok = status == FCE_SUCCESS;
    EXPECT_TRUE(finish());
    for (Buf* b : {&hidden_, &weight, &bias, &st, &ws}) b->pull();
    EXPECT_TRUE(unchanged(hidden_, b_h, "hidden_states (fce_vp_linear_stats)"));
    EXPECT_TRUE(unchanged(weight, b_w, "weight (fce_vp_linear_stats)"));
    EXPECT_TRUE(unchanged(bias, b_b, "bias (fce_vp_linear_stats)"));
    EXPECT_TRUE(guards_intact(ws, "workspace (fce_vp_linear_stats)"));
    EXPECT_TRUE(only_elements_changed(st, b_st, &sm, "stats"));
    EXPECT_TRUE(all_written(st, sm, "stats"));
    return st;
  }

  struct Grads {
    std::vector<double> gh, gw, gb;
    std::vector<uint8_t> raw_gh, raw_gw, raw_gb;
    uint32_t flags = 0;
  };

  // fce_vp_linear_backward of shard s.
  Grads backward(const Shard& s, Buf& gathered, int64_t ranks) {
    SCOPED_TRACE("fce_vp_linear_backward of shard [" + std::to_string(s.start) + ", +" +
                 std::to_string(s.local) + ")");
    Grads out;
    Buf weight = rows_buf(W_, c_.D, s.start, s.local, c_.dtype);
    Buf bias = c_.bias ? rows_buf(b_, 1, s.start, s.local, c_.dtype) : Buf();
    const Mat gh_m = mat(ghdt_, c_.N, c_.D), gw_m = mat(gdt_, s.local, c_.D),
              gb_m = vec(gdt_, s.local);
    Buf gh = c_.gh ? poisoned(gh_m) : Buf(), gw = c_.gw ? poisoned(gw_m) : Buf(),
        gb = c_.gb ? poisoned(gb_m) : Buf();
    if (c_.accumulate) {
      if (c_.gw) {
        write_mat(gw, gw_m, std::vector<double>(gw0_.begin() + s.start * c_.D,
                                                gw0_.begin() + (s.start + s.local) * c_.D));
        gw.push();
      }
      if (c_.gb) {
        write_mat(gb, gb_m, std::vector<double>(gb0_.begin() + s.start,
                                                gb0_.begin() + s.start + s.local));
        gb.push();
      }
    }
    Buf flags = flags_buf(0);
    const size_t wsb = workspace(true, ranks, s);
    Buf ws = workspace_buf(wsb);
    auto b_h = hidden_.mirror(), b_w = weight.mirror(), b_b = bias.mirror(),
         b_g = gathered.mirror(), b_go = gout_.mirror(), b_gh = gh.mirror(), b_gw = gw.mirror(),
         b_gb = gb.mirror();
    const fce_status st = flat::vp_linear_backward(
        &o_, ranks, c_.N, c_.D, c_.V, s.start, s.local, hidden_.ptr(), weight.ptr(), bias.ptr(),
        targets_.ptr(), gathered.p<float>(), gout_.p<float>(), gh.ptr(), ghdt_, gw.ptr(),
        gb.ptr(), flags.p<uint32_t>(), ws.ptr(), wsb, test_stream());
    EXPECT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    EXPECT_TRUE(finish());
    for (Buf* b : {&hidden_, &weight, &bias, &gathered, &gout_, &gh, &gw, &gb, &flags, &ws})
      b->pull();
    EXPECT_TRUE(unchanged(hidden_, b_h, "hidden_states (fce_vp_linear_backward)"));
    EXPECT_TRUE(unchanged(weight, b_w, "weight (fce_vp_linear_backward)"));
    EXPECT_TRUE(unchanged(bias, b_b, "bias (fce_vp_linear_backward)"));
    EXPECT_TRUE(unchanged(gathered, b_g, "gathered_stats (fce_vp_linear_backward)"));
    EXPECT_TRUE(unchanged(gout_, b_go, "grad_output (fce_vp_linear_backward)"));
    EXPECT_TRUE(guards_intact(ws, "workspace (fce_vp_linear_backward)"));
    if (c_.gh) {
      EXPECT_TRUE(only_elements_changed(gh, b_gh, &gh_m, "grad_hidden"));
      EXPECT_TRUE(all_written(gh, gh_m, "grad_hidden"));
      out.gh = read_mat(gh, gh_m);
      out.raw_gh = gh.mirror();
    }
    if (c_.gw) {
      EXPECT_TRUE(only_elements_changed(gw, b_gw, &gw_m, "grad_weight"));
      EXPECT_TRUE(all_written(gw, gw_m, "grad_weight"));
      out.gw = read_mat(gw, gw_m);
      out.raw_gw = gw.mirror();
    }
    if (c_.gb) {
      EXPECT_TRUE(only_elements_changed(gb, b_gb, &gb_m, "grad_bias"));
      EXPECT_TRUE(all_written(gb, gb_m, "grad_bias"));
      out.gb = read_mat(gb, gb_m);
      out.raw_gb = gb.mirror();
    }
    out.flags = read_flags(flags);
    return out;
  }

  LossOut loss(Buf& gathered, int64_t ranks) {
    const Mat loss_m = vec(FCE_FLOAT32, c_.reduction == FCE_REDUCTION_NONE ? c_.N : 1);
    Buf loss = poisoned(loss_m), lse = poisoned(vec(FCE_FLOAT32, c_.N)),
        zl = poisoned(vec(FCE_FLOAT32, 1)), am = poisoned(vec(FCE_INT64, c_.N)),
        acc = poisoned(loss_m), flags = flags_buf(0);
    TestOptions o = o_;
    o.argmax = c_.argmax ? am.p<int64_t>() : nullptr;
    o.accuracy = c_.accuracy ? acc.p<float>() : nullptr;
    size_t wsb = 1;
    EXPECT_EQ(fce_vp_loss_workspace_size(&o, ranks, c_.N, c_.V, &wsb), FCE_SUCCESS);
    Buf ws = workspace_buf(wsb);
    const fce_status st = flat::vp_loss(&o, ranks, c_.N, c_.V, targets_.ptr(), gathered.p<float>(),
                                      loss.p<float>(), lse.p<float>(), zl.p<float>(),
                                      flags.p<uint32_t>(), ws.ptr(), wsb, test_stream());
    EXPECT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    EXPECT_TRUE(finish());
    for (Buf* b : {&loss, &lse, &zl, &am, &acc, &flags}) b->pull();
    EXPECT_TRUE(all_written(loss, loss_m, "loss"));
    EXPECT_TRUE(all_written(lse, vec(FCE_FLOAT32, c_.N), "lse"));
    EXPECT_TRUE(all_written(zl, vec(FCE_FLOAT32, 1), "z_loss"));
    LossOut v;
    v.loss = read_mat(loss, loss_m);
    v.lse = read_mat(lse, vec(FCE_FLOAT32, c_.N));
    v.zl = read_mat(zl, vec(FCE_FLOAT32, 1));
    if (c_.argmax) v.am = read_i64(am, c_.N);
    if (c_.accuracy) v.acc = read_mat(acc, loss_m);
    v.flags = read_flags(flags);
    return v;
  }

  void sharded(int P) {
    SCOPED_TRACE(lin_label(c_) + " P=" + std::to_string(P));
    const std::vector<Shard> shards = make_shards(c_.V, P, c_.uneven);
    std::vector<Buf> stats;
    bool all_ok = true;
    for (const Shard& s : shards) {
      bool ok = false;
      stats.push_back(this->stats(s, &ok));
      all_ok = all_ok && ok;
    }
    ASSERT_TRUE(all_ok) << "phase 1 failed";
    std::vector<const Buf*> order;
    for (int q : rank_order(P, true)) order.push_back(&stats[static_cast<size_t>(q)]);
    Buf gathered = gather(order, c_.N);

    const LossOut v = loss(gathered, P);
    const auto& ce = ref_.ce;
    if (c_.reduction == FCE_REDUCTION_NONE) {
      EXPECT_TRUE(close_normwise(v.loss, whole_.loss, tol_, "loss (per row) vs unsharded"));
      EXPECT_TRUE(close_normwise(v.loss, ce.row_loss, tol_, "loss (per row) vs reference"));
    } else {
      EXPECT_TRUE(close_scalar(v.loss[0], whole_.loss[0], tol_, "loss vs unsharded"));
      EXPECT_TRUE(close_scalar(v.loss[0], ce.loss, tol_, "loss vs reference"));
    }
    EXPECT_TRUE(close_normwise(v.lse, whole_.lse, tol_, "lse vs unsharded"));
    EXPECT_TRUE(close_normwise(v.lse, ce.lse, tol_, "lse vs reference"));
    EXPECT_TRUE(close_scalar(v.zl[0], whole_.zl[0], tol_, "z_loss vs unsharded"));
    EXPECT_TRUE(close_scalar(v.zl[0], ce.z_loss, tol_, "z_loss vs reference"));
    if (c_.argmax) { EXPECT_TRUE(argmax_agrees(v.am, whole_.am, ce, c_.V, argmax_tie(c_.dtype))); }
    if (c_.accuracy) {
      EXPECT_TRUE(accuracy_matches(v.acc, c_.reduction, ce, c_.argmax ? &v.am : nullptr, c_.V,
                                   argmax_tie(c_.dtype)));
    }
    EXPECT_EQ(v.flags, whole_.flags) << "error_flags (fce_vp_loss)";

    std::vector<double> gh_sum(static_cast<size_t>(c_.N * c_.D), 0.0);
    std::vector<double> gw(static_cast<size_t>(c_.V * c_.D), 0.0), gb(static_cast<size_t>(c_.V), 0.0);
    for (const Shard& s : shards) {
      const Grads g = backward(s, gathered, P);
      EXPECT_EQ(g.flags, invalid_flag()) << "error_flags (fce_vp_linear_backward)";
      for (size_t i = 0; i < g.gh.size(); ++i) gh_sum[i] += g.gh[i];  // the all-reduce
      for (size_t i = 0; i < g.gw.size(); ++i) gw[static_cast<size_t>(s.start * c_.D) + i] = g.gw[i];
      for (size_t i = 0; i < g.gb.size(); ++i) gb[static_cast<size_t>(s.start) + i] = g.gb[i];
    }
    auto accumulated = [&](const std::vector<double>& d, const std::vector<double>& init) {
      std::vector<double> e = d;
      if (c_.accumulate)
        for (size_t i = 0; i < e.size(); ++i) e[i] += init[i];
      return e;
    };
    if (c_.gh) {
      EXPECT_TRUE(close_normwise(gh_sum, whole_gh_, tol_, "grad_hidden (sum over ranks) vs unsharded"));
      EXPECT_TRUE(close_normwise(gh_sum, ref_.grad_hidden, tol_, "grad_hidden (sum over ranks) vs reference"));
      for (int64_t r = 0; r < c_.N; ++r)
        if (ce.kind[static_cast<size_t>(r)] == fceref::kIgnored)
          for (int64_t k = 0; k < c_.D; ++k)
            if (gh_sum[static_cast<size_t>(r * c_.D + k)] != 0.0) {
              ADD_FAILURE() << "grad_hidden: ignored row " << r << " is not zero";
              break;
            }
    }
    if (c_.gw) {
      EXPECT_TRUE(close_normwise(gw, whole_gw_, tol_, "grad_weight (shard rows) vs unsharded"));
      EXPECT_TRUE(close_normwise(gw, accumulated(ref_.grad_weight, gw0_), tol_,
                                 "grad_weight (shard rows) vs reference"));
    }
    if (c_.gb) {
      EXPECT_TRUE(close_normwise(gb, whole_gb_, tol_, "grad_bias (shard rows) vs unsharded"));
      EXPECT_TRUE(close_normwise(gb, accumulated(ref_.grad_bias, gb0_), tol_,
                                 "grad_bias (shard rows) vs reference"));
    }
  }

  // fce_vp_linear_ce on every rank at once (SimGather): the same checks as sharded() against
  // the unsharded call and the reference, the loss bitwise equal on every rank. ws_min: every
  // rank passes the largest min_bytes of the ranks' queries (else the largest optimal_bytes),
  // as the header asks (the same workspace_bytes on every rank). Returns the all-gathers per
  // rank.
  int fused(int P, bool ws_min) {
    SCOPED_TRACE(lin_label(c_) + " fce_vp_linear_ce P=" + std::to_string(P) +
                 (ws_min ? " workspace=min of the ranks" : " workspace=optimal of the ranks"));
    const std::vector<Shard> shards = make_shards(c_.V, P, c_.uneven);
    const int64_t N = c_.N, D = c_.D;
    const bool none = c_.reduction == FCE_REDUCTION_NONE;
    const Mat loss_m = vec(FCE_FLOAT32, none ? N : 1), gh_m = mat(ghdt_, N, D);
    size_t wsb = 0;
    for (const Shard& s : shards) {
      size_t mn = 0, op = 0;
      EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o_, P, N, D, c_.V, s.local, 1, ghdt_, &mn, &op),
                FCE_SUCCESS) << fce_last_error();
      EXPECT_GE(op, mn) << "optimal_bytes < min_bytes";
      wsb = std::max(wsb, ws_min ? mn : op);
    }
    struct RankBufs {
      Buf weight, bias, loss, lse, zl, am, acc, flags, gh, gw, gb, ws;
      fce_status st = FCE_ERROR_INTERNAL;
      std::string err;
    };
    std::vector<RankBufs> rb(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) {
      const Shard& s = shards[static_cast<size_t>(r)];
      RankBufs& b = rb[static_cast<size_t>(r)];
      b.weight = rows_buf(W_, D, s.start, s.local, c_.dtype);
      if (c_.bias) b.bias = rows_buf(b_, 1, s.start, s.local, c_.dtype);
      b.loss = poisoned(loss_m);
      b.lse = poisoned(vec(FCE_FLOAT32, N));
      b.zl = poisoned(vec(FCE_FLOAT32, 1));
      b.am = poisoned(vec(FCE_INT64, N));
      b.acc = poisoned(loss_m);
      b.flags = flags_buf(0);
      const Mat gw_m = mat(gdt_, s.local, D), gb_m = vec(gdt_, s.local);
      if (c_.gh) b.gh = poisoned(gh_m);
      if (c_.gw) b.gw = poisoned(gw_m);
      if (c_.gb) b.gb = poisoned(gb_m);
      if (c_.accumulate) {
        if (c_.gw) {
          write_mat(b.gw, gw_m, std::vector<double>(gw0_.begin() + s.start * D,
                                                    gw0_.begin() + (s.start + s.local) * D));
          b.gw.push();
        }
        if (c_.gb) {
          write_mat(b.gb, gb_m, std::vector<double>(gb0_.begin() + s.start,
                                                    gb0_.begin() + s.start + s.local));
          b.gb.push();
        }
      }
      b.ws = workspace_buf(wsb);
    }
    auto b_h = hidden_.mirror();
    EXPECT_TRUE(finish());
    SimGather g(P, rank_order(P, true));
    std::vector<SimGather::Rank> ctx;
    for (int r = 0; r < P; ++r) ctx.push_back({&g, r});
    std::vector<std::thread> threads;
    for (int r = 0; r < P; ++r)
      threads.emplace_back([&, r] {
        const Shard& s = shards[static_cast<size_t>(r)];
        RankBufs& b = rb[static_cast<size_t>(r)];
        TestOptions o = o_;
        o.argmax = c_.argmax ? b.am.p<int64_t>() : nullptr;
        o.accuracy = c_.accuracy ? b.acc.p<float>() : nullptr;
        b.st = flat::vp_linear_ce(&o, P, N, D, c_.V, s.start, s.local, hidden_.ptr(), b.weight.ptr(),
                                b.bias.ptr(), targets_.ptr(), b.loss.p<float>(), b.lse.p<float>(),
                                b.zl.p<float>(), gout_.p<float>(), b.gh.ptr(), ghdt_, b.gw.ptr(),
                                b.gb.ptr(), b.flags.p<uint32_t>(), SimGather::fn,
                                &ctx[static_cast<size_t>(r)], b.ws.ptr(), wsb, test_stream());
        if (b.st != FCE_SUCCESS) b.err = fce_last_error();
        g.leave();
      });
    for (auto& t : threads) t.join();
    EXPECT_TRUE(finish());
    EXPECT_FALSE(g.mismatch()) << "the ranks' all-gathers differ in size";
    for (int r = 0; r < P; ++r) {
      RankBufs& b = rb[static_cast<size_t>(r)];
      EXPECT_EQ(b.st, FCE_SUCCESS) << "rank " << r << ": " << fce_status_string(b.st) << ": " << b.err;
      EXPECT_EQ(g.calls(r), g.calls(0)) << "rank " << r << " made another number of all-gathers";
    }
    if (testing::Test::HasFailure()) return g.calls(0);
    hidden_.pull();
    EXPECT_TRUE(unchanged(hidden_, b_h, "hidden_states (fce_vp_linear_ce)"));

    const auto& ce = ref_.ce;
    std::vector<double> gh_sum(static_cast<size_t>(N * D), 0.0);
    std::vector<double> gw(static_cast<size_t>(c_.V * D), 0.0), gb(static_cast<size_t>(c_.V), 0.0);
    std::vector<uint8_t> loss0;
    for (int r = 0; r < P; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      const Shard& s = shards[static_cast<size_t>(r)];
      RankBufs& b = rb[static_cast<size_t>(r)];
      for (Buf* x : {&b.loss, &b.lse, &b.zl, &b.am, &b.acc, &b.flags, &b.gh, &b.gw, &b.gb, &b.ws})
        x->pull();
      EXPECT_TRUE(guards_intact(b.ws, "workspace (fce_vp_linear_ce)"));
      EXPECT_TRUE(all_written(b.loss, loss_m, "loss"));
      EXPECT_TRUE(all_written(b.lse, vec(FCE_FLOAT32, N), "lse"));
      if (r == 0) {
        loss0 = b.loss.mirror();
      } else {
        EXPECT_TRUE(bitwise_equal(b.loss.mirror(), loss0, "loss (rank r vs rank 0)"));
      }
      const std::vector<double> loss = read_mat(b.loss, loss_m), lse = read_mat(b.lse, vec(FCE_FLOAT32, N));
      const double zl = read_mat(b.zl, vec(FCE_FLOAT32, 1))[0];
      if (none) {
        EXPECT_TRUE(close_normwise(loss, whole_.loss, tol_, "loss (per row) vs unsharded"));
        EXPECT_TRUE(close_normwise(loss, ce.row_loss, tol_, "loss (per row) vs reference"));
      } else {
        EXPECT_TRUE(close_scalar(loss[0], whole_.loss[0], tol_, "loss vs unsharded"));
        EXPECT_TRUE(close_scalar(loss[0], ce.loss, tol_, "loss vs reference"));
      }
      EXPECT_TRUE(close_normwise(lse, whole_.lse, tol_, "lse vs unsharded"));
      EXPECT_TRUE(close_scalar(zl, whole_.zl[0], tol_, "z_loss vs unsharded"));
      std::vector<int64_t> am;
      if (c_.argmax) {
        am = read_i64(b.am, N);
        EXPECT_TRUE(argmax_agrees(am, whole_.am, ce, c_.V, argmax_tie(c_.dtype)));
      }
      if (c_.accuracy) {
        EXPECT_TRUE(accuracy_matches(read_mat(b.acc, loss_m), c_.reduction, ce,
                                     c_.argmax ? &am : nullptr, c_.V, argmax_tie(c_.dtype)));
      }
      EXPECT_EQ(read_flags(b.flags), whole_.flags) << "error_flags (fce_vp_linear_ce)";
      if (c_.gh) {
        EXPECT_TRUE(all_written(b.gh, gh_m, "grad_hidden"));
        const std::vector<double> v = read_mat(b.gh, gh_m);
        for (size_t i = 0; i < v.size(); ++i) gh_sum[i] += v[i];
      }
      if (c_.gw) {
        const Mat gw_m = mat(gdt_, s.local, D);
        EXPECT_TRUE(all_written(b.gw, gw_m, "grad_weight"));
        const std::vector<double> v = read_mat(b.gw, gw_m);
        std::copy(v.begin(), v.end(), gw.begin() + s.start * D);
      }
      if (c_.gb) {
        const Mat gb_m = vec(gdt_, s.local);
        EXPECT_TRUE(all_written(b.gb, gb_m, "grad_bias"));
        const std::vector<double> v = read_mat(b.gb, gb_m);
        std::copy(v.begin(), v.end(), gb.begin() + s.start);
      }
    }
    auto accumulated = [&](const std::vector<double>& d, const std::vector<double>& init) {
      std::vector<double> e = d;
      if (c_.accumulate)
        for (size_t i = 0; i < e.size(); ++i) e[i] += init[i];
      return e;
    };
    if (c_.gh) {
      EXPECT_TRUE(close_normwise(gh_sum, whole_gh_, tol_, "grad_hidden (sum over ranks) vs unsharded"));
      EXPECT_TRUE(close_normwise(gh_sum, ref_.grad_hidden, tol_, "grad_hidden (sum over ranks) vs reference"));
    }
    if (c_.gw) {
      EXPECT_TRUE(close_normwise(gw, whole_gw_, tol_, "grad_weight (shard rows) vs unsharded"));
      EXPECT_TRUE(close_normwise(gw, accumulated(ref_.grad_weight, gw0_), tol_,
                                 "grad_weight (shard rows) vs reference"));
    }
    if (c_.gb) {
      EXPECT_TRUE(close_normwise(gb, whole_gb_, tol_, "grad_bias (shard rows) vs unsharded"));
      EXPECT_TRUE(close_normwise(gb, accumulated(ref_.grad_bias, gb0_), tol_,
                                 "grad_bias (shard rows) vs reference"));
    }
    return g.calls(0);
  }

  // One rank (P = 1) through fce_vp_linear_ce with the given all-gather: its status, and the
  // message in *err.
  fce_status fused_one(fce_vp_all_gather_fn gather, void* context, std::string* err) {
    const int64_t N = c_.N, D = c_.D, V = c_.V;
    Buf weight = rows_buf(W_, D, 0, V, c_.dtype);
    Buf loss = poisoned(vec(FCE_FLOAT32, c_.reduction == FCE_REDUCTION_NONE ? N : 1));
    Buf gh = poisoned(mat(ghdt_, N, D)), flags = flags_buf(0);
    size_t mn = 0, op = 0;
    EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o_, 1, N, D, V, V, 1, ghdt_, &mn, &op), FCE_SUCCESS);
    Buf ws = workspace_buf(op);
    const fce_status st = flat::vp_linear_ce(
        &o_, 1, N, D, V, 0, V, hidden_.ptr(), weight.ptr(), nullptr, targets_.ptr(),
        loss.p<float>(), nullptr, nullptr, gout_.p<float>(), gh.ptr(), ghdt_, nullptr, nullptr,
        flags.p<uint32_t>(), gather, context, ws.ptr(), op, test_stream());
    *err = fce_last_error();
    EXPECT_TRUE(finish());
    return st;
  }

  void run() {
    ASSERT_NO_FATAL_FAILURE(unsharded());
    for (int P : c_.ranks) {
      ASSERT_NO_FATAL_FAILURE(sharded(P));
      ASSERT_NO_FATAL_FAILURE(fused(P, c_.ws_min));
      // CUDA: the other plan too (the token chunks at optimal_bytes, gather-once at min_bytes)
      if (on_cuda()) {
        ASSERT_NO_FATAL_FAILURE(fused(P, !c_.ws_min));
      }
    }
  }

  LinVpCase& c() { return c_; }
  TestOptions& options() { return o_; }

 private:
  LinVpCase c_;
  std::vector<double> h_, W_, b_, w_, g_, gw0_, gb0_;
  std::vector<int64_t> y_;
  fceref::LinearResult ref_;
  int gdt_ = FCE_FLOAT32, ghdt_ = FCE_FLOAT32;
  double tol_ = 0;
  Mat hm_;
  Buf hidden_, targets_, cw_, gout_;
  TestOptions o_;
  LossOut whole_;
  std::vector<double> whole_gh_, whole_gw_, whole_gb_;
};

struct LinOptionSet {
  const char* name;
  std::function<void(LinVpCase&)> apply;
};

const std::vector<LinOptionSet>& lin_option_sets() {
  static const std::vector<LinOptionSet> sets = {
      {"plain", [](LinVpCase&) {}},
      {"no_bias", [](LinVpCase& c) { c.bias = false; }},
      {"grad_hidden_f32", [](LinVpCase& c) { c.gh_f32 = true; }},
      {"weights_smoothing_zloss",
       [](LinVpCase& c) { c.weights = true; c.eps = 0.1f; c.lambda = 1e-3f; c.ignore_frac = 0.1; }},
      {"softcap_scale", [](LinVpCase& c) { c.softcap = 15.0f; c.scale = 0.8f; }},
      {"shift_token_scaling",
       [](LinVpCase& c) {
         c.shift = 8; c.shift_k = 2; c.N = 32; c.token_scaling = true; c.confident = true;
       }},
      {"ignored_invalid_argmax_accuracy",
       [](LinVpCase& c) { c.ignore_frac = 0.2; c.invalid = 2; c.argmax = c.accuracy = true; c.tdtype = FCE_INT32; }},
      {"accumulate", [](LinVpCase& c) { c.accumulate = true; }},
      {"grad_weight_fp32", [](LinVpCase& c) { c.gw_fp32 = true; c.gh_f32 = true; }},
      {"accumulate_fp32", [](LinVpCase& c) { c.accumulate = true; c.gw_fp32 = true; }},
      {"grad_output_null", [](LinVpCase& c) { c.gout = false; c.ignore_frac = 0.2; }},
      {"grad_weight_only", [](LinVpCase& c) { c.gh = false; c.gb = false; }},
      {"grad_hidden_only", [](LinVpCase& c) { c.gw = false; c.gb = false; }},
      {"grad_bias_only", [](LinVpCase& c) { c.gh = false; c.gw = false; }},
      {"strided_hidden_min_workspace", [](LinVpCase& c) { c.h_pad = 5; c.ws_min = true; }},
      {"everything",
       [](LinVpCase& c) {
         c.weights = true; c.eps = 0.05f; c.lambda = 1e-4f; c.softcap = 20.0f; c.scale = 1.2f;
         c.shift = 6; c.shift_k = 1; c.N = 36; c.ignore_frac = 0.1; c.token_scaling = true;
         c.confident = true; c.argmax = c.accuracy = true; c.accumulate = true; c.h_pad = 3;
         c.invalid = 1;
       }},
  };
  return sets;
}

std::vector<LinVpCase> lin_matrix_cases() {
  std::vector<LinVpCase> cases;
  uint64_t seed = 101;
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16})
    for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE})
      for (const LinOptionSet& s : lin_option_sets()) {
        LinVpCase c;
        c.dtype = dtype;
        c.reduction = red;
        c.seed = seed++;
        s.apply(c);
        c.name = std::string(dtype_name(dtype)) + "_" + reduction_name(red) + "_" + s.name;
        cases.push_back(c);
      }
  return cases;
}

class VpLinearMatrix : public ::testing::TestWithParam<LinVpCase> {
 protected:
  void SetUp() override { FCE_REQUIRE_BACKEND(); }
};

TEST_P(VpLinearMatrix, ShardedMatchesUnsharded) {
  VpLinRunner run(GetParam());
  run.run();
}

INSTANTIATE_TEST_SUITE_P(Options, VpLinearMatrix, ::testing::ValuesIn(lin_matrix_cases()),
                         [](const ::testing::TestParamInfo<LinVpCase>& i) { return i.param.name; });

class VpLinear : public BackendTest {};

// Bigger than one CPU chunk of rows, and the workspace from min_bytes to optimal_bytes: the
// same bits on the CPU (the chunking depends on the sizes only), within rounding elsewhere.
TEST_F(VpLinear, WorkspaceSizes) {
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16}) {
    LinVpCase c;
    c.name = "workspaces";
    c.dtype = dtype;
    c.N = 1100;  // > 1024 rows: two chunks on the CPU
    c.D = 16;
    c.V = 97;
    c.ranks = {3};
    c.eps = 0.1f;
    c.accumulate = true;
    std::vector<std::vector<uint8_t>> raws;
    for (bool ws_min : {false, true}) {
      c.ws_min = ws_min;
      VpLinRunner run(c);
      ASSERT_NO_FATAL_FAILURE(run.run());
      const Shard s = make_shards(c.V, 3, true)[1];
      Buf st0 = run.stats(make_shards(c.V, 3, true)[0]);
      Buf st1 = run.stats(s);
      Buf st2 = run.stats(make_shards(c.V, 3, true)[2]);
      Buf g = gather({&st0, &st1, &st2}, c.N);
      const auto grads = run.backward(s, g, 3);
      std::vector<uint8_t> all = st1.mirror();
      all.insert(all.end(), grads.raw_gh.begin(), grads.raw_gh.end());
      all.insert(all.end(), grads.raw_gw.begin(), grads.raw_gw.end());
      all.insert(all.end(), grads.raw_gb.begin(), grads.raw_gb.end());
      raws.push_back(all);
    }
    if (!on_cuda()) {
      EXPECT_TRUE(bitwise_equal(raws[0], raws[1], "stats and gradients (optimal vs min workspace)"));
    }
  }
}

// fce_vp_linear_ce over several token chunks (CUDA's token-chunk plan at optimal_bytes: rows
// [0, 2560) and [2560, 5005), a sequence of the shift rule straddling the boundary), the
// gather-once plan at min_bytes, and every rank making the same all-gathers.
TEST_F(VpLinear, FusedChunks) {
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16}) {
    LinVpCase c;
    c.name = "fused_chunks";
    c.dtype = dtype;
    c.N = 5005;  // 715 sequences of 7
    c.D = 16;
    c.V = 301;
    c.gw_fp32 = true;  // a float32 grad_weight: token chunks of at most 4096 rows
    c.gh_f32 = true;
    c.shift = 7;
    c.shift_k = 1;
    c.eps = 0.1f;
    c.lambda = 1e-4f;
    c.ignore_frac = 0.1;
    c.argmax = c.accuracy = true;
    c.accumulate = true;
    VpLinRunner run(c);
    ASSERT_NO_FATAL_FAILURE(run.unsharded());
    for (int P : {1, 3}) {
      int calls = 0;
      ASSERT_NO_FATAL_FAILURE(calls = run.fused(P, false));
      EXPECT_EQ(calls, on_cuda() ? 2 : 1) << "all-gathers at optimal_bytes, P=" << P;
      ASSERT_NO_FATAL_FAILURE(calls = run.fused(P, true));
      EXPECT_EQ(calls, 1) << "all-gathers at min_bytes, P=" << P;
    }
  }
}

namespace {
fce_status failing_gather(void* ctx, const float*, float*, int64_t, void*) {
  ++*static_cast<int*>(ctx);
  return FCE_ERROR_CUDA;
}
}  // namespace

// The all-gather's status stops the call and is returned, named; a NULL shard->all_gather is
// refused.
TEST_F(VpLinear, FusedAllGatherStatus) {
  LinVpCase c;
  c.name = "fused_status";
  c.ranks = {1};
  VpLinRunner run(c);
  std::string err;
  int calls = 0;
  EXPECT_EQ(run.fused_one(failing_gather, &calls, &err), FCE_ERROR_CUDA);
  EXPECT_EQ(calls, 1);
  EXPECT_NE(err.find("fce_vp_linear_ce: all_gather returned FCE_ERROR_CUDA"), std::string::npos)
      << err;
  EXPECT_EQ(run.fused_one(nullptr, nullptr, &err), FCE_ERROR_NULL_POINTER);
  EXPECT_NE(err.find("fce_vp_linear_ce: shard->all_gather is NULL"), std::string::npos) << err;
}

// ------------------------------------------------------------------ bad input ---------------
enum VpFn { kStats, kLoss, kBackward, kLinStats, kLinBackward, kLinCe };
const char* fn_name(VpFn f) {
  switch (f) {
    case kStats: return "fce_vp_stats";
    case kLoss: return "fce_vp_loss";
    case kBackward: return "fce_vp_backward";
    case kLinStats: return "fce_vp_linear_stats";
    case kLinBackward: return "fce_vp_linear_backward";
    default: return "fce_vp_linear_ce";
  }
}

struct VpArgs {
  TestOptions o;
  const TestOptions* opts;
  int64_t ranks, rows, hidden, vocab_total, vocab_start, vocab_local;
  const void* logits;
  const void* hidden_states;
  const void* weight;
  const void* bias;
  const void* targets;
  float* stats;
  const float* gathered;
  float* loss;
  float* lse;
  float* z_loss;
  const float* gout;
  void* grad;
  void* gh;
  int32_t gh_dtype;
  void* gw;
  void* gb;
  uint32_t* flags;
  fce_vp_all_gather_fn all_gather;  // fce_vp_linear_ce
  void* context;
  void* ws;
  size_t wsb;
};

class VpBadInput : public BackendTest {
 protected:
  static constexpr int64_t N = 8, V = 40, S0 = 16, VL = 24, D = 8;  // shard [16, 40)
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    std::mt19937_64 rng(5);
    // An arena of 2 N VL floats: the shard's logits at its start, room for overlapping grads.
    arena = Buf(static_cast<size_t>(2 * N * VL) * 4);
    poison_all(arena, FCE_FLOAT32);
    write_mat(arena, mat(FCE_FLOAT32, N, VL), random_logits(rng, FCE_FLOAT32, N, VL));
    arena.push();
    Buf logits0(mat(FCE_FLOAT32, N, S0));
    write_mat(logits0, mat(FCE_FLOAT32, N, S0), random_logits(rng, FCE_FLOAT32, N, S0));
    logits0.push();
    targets = targets_buf(random_targets(rng, N, V), FCE_INT64);
    weights = f32_buf(random_uniform(rng, V, 0.5, 1.5));
    gout = f32_buf({1.0});
    stats = poisoned(vec(FCE_FLOAT32, N * FCE_VP_STATS));
    loss = poisoned(vec(FCE_FLOAT32, N));
    lse = poisoned(vec(FCE_FLOAT32, N));
    zl = poisoned(vec(FCE_FLOAT32, 1));
    grad = poisoned(mat(FCE_FLOAT32, N, VL));
    flags = Buf(4, 0xA5);
    flags.push();
    am = poisoned(vec(FCE_INT64, N));
    acc = poisoned(vec(FCE_FLOAT32, N));
    hidden = f32_buf(random_normal(rng, FCE_FLOAT32, N * D, 1.0));
    weight = f32_buf(random_normal(rng, FCE_FLOAT32, VL * D, 0.3));
    bias = f32_buf(random_normal(rng, FCE_FLOAT32, VL, 0.3));
    gh = poisoned(mat(FCE_FLOAT32, N, D));
    gw = poisoned(mat(FCE_FLOAT32, VL, D));
    gb = poisoned(vec(FCE_FLOAT32, VL));
    a.o = test_options();
    a.o.class_weights = weights.p<float>();
    // Real gathered stats of the two shards [0, 16) and [16, 40).
    Buf st0 = poisoned(vec(FCE_FLOAT32, N * FCE_VP_STATS));
    Buf st1 = poisoned(vec(FCE_FLOAT32, N * FCE_VP_STATS));
    ASSERT_EQ(flat::vp_stats(&a.o, N, V, 0, S0, logits0.ptr(), targets.ptr(), st0.p<float>(),
                           test_stream()), FCE_SUCCESS) << fce_last_error();
    ASSERT_EQ(flat::vp_stats(&a.o, N, V, S0, VL, arena.ptr(), targets.ptr(), st1.p<float>(),
                           test_stream()), FCE_SUCCESS) << fce_last_error();
    ASSERT_TRUE(finish());
    st0.pull();
    st1.pull();
    gathered = gather({&st0, &st1}, N);
    size_t b = 0, mn = 0, op = 0;
    TestOptions loss_o = a.o;  // fce_vp_loss is called with reduction none (args())
    loss_o.reduction = FCE_REDUCTION_NONE;
    ASSERT_EQ(fce_vp_loss_workspace_size(&loss_o, 2, N, V, &b), FCE_SUCCESS) << fce_last_error();
    ws_need[kLoss] = b;
    ASSERT_EQ(fce_vp_backward_workspace_size(&a.o, 2, N, V, VL, &b), FCE_SUCCESS) << fce_last_error();
    ws_need[kBackward] = b;
    ASSERT_EQ(fce_vp_linear_stats_workspace_size(&a.o, N, D, VL, &mn, &op), FCE_SUCCESS)
        << fce_last_error();
    ws_need[kLinStats] = mn;
    ASSERT_EQ(fce_vp_linear_backward_workspace_size(&a.o, 2, N, D, V, VL, FCE_FLOAT32, &mn, &op),
              FCE_SUCCESS) << fce_last_error();
    ws_need[kLinBackward] = mn;
    ASSERT_EQ(fce_vp_linear_ce_workspace_size(&a.o, 2, N, D, V, VL, 1, FCE_FLOAT32, &mn, &op),
              FCE_SUCCESS) << fce_last_error();
    ws_need[kLinCe] = mn;
    ws_need[kStats] = 0;
    size_t most = 0;
    for (size_t w : ws_need) most = std::max(most, w);
    ws = workspace_buf(most + 64);
    a.opts = &a.o;
    a.ranks = 2;
    a.rows = N;
    a.hidden = D;
    a.vocab_total = V;
    a.vocab_start = S0;
    a.vocab_local = VL;
    a.logits = arena.ptr();
    a.hidden_states = hidden.ptr();
    a.weight = weight.ptr();
    a.bias = bias.ptr();
    a.targets = targets.ptr();
    a.stats = stats.p<float>();
    a.gathered = gathered.p<float>();
    a.loss = loss.p<float>();
    a.lse = lse.p<float>();
    a.z_loss = zl.p<float>();
    a.gout = gout.p<float>();
    a.grad = grad.ptr();
    a.gh = gh.ptr();
    a.gh_dtype = FCE_FLOAT32;
    a.gw = gw.ptr();
    a.gb = gb.ptr();
    a.flags = flags.p<uint32_t>();
    a.all_gather = fake_gather;
    a.context = this;
    a.ws = ws.ptr();
    a.wsb = 0;
  }

  // fce_vp_linear_ce's all-gather, standing in for the other rank: recv gets the two shards'
  // real statistics (the gather-once plan of these sizes gathers all N rows at once).
  static fce_status fake_gather(void* ctx, const float*, float* recv, int64_t count,
                                void* stream) {
    VpBadInput* t = static_cast<VpBadInput*>(ctx);
    ++t->gathers;
    if (count != N * FCE_VP_STATS) return FCE_ERROR_INTERNAL;
    const size_t bytes = static_cast<size_t>(2 * count) * sizeof(float);
#if FCE_TEST_HAVE_CUDA
    if (on_cuda())
      return cudaMemcpyAsync(recv, t->gathered.ptr(), bytes, cudaMemcpyDeviceToDevice,
                             static_cast<cudaStream_t>(stream)) == cudaSuccess
                 ? FCE_SUCCESS : FCE_ERROR_CUDA;
#endif
    (void)stream;
    std::memcpy(recv, t->gathered.ptr(), bytes);
    return FCE_SUCCESS;
  }

  VpArgs args(VpFn f) {
    VpArgs x = a;
    x.wsb = ws_need[f];
    if (f == kLoss) x.o.reduction = FCE_REDUCTION_NONE, x.gout = nullptr;  // loss [N]
    return x;
  }

  fce_status call(VpFn f, const VpArgs& x) {
    switch (f) {
      case kStats:
        return flat::vp_stats(x.opts, x.rows, x.vocab_total, x.vocab_start, x.vocab_local, x.logits,
                            x.targets, x.stats, test_stream());
      case kLoss:
        return flat::vp_loss(x.opts, x.ranks, x.rows, x.vocab_total, x.targets, x.gathered, x.loss,
                           x.lse, x.z_loss, x.flags, x.ws, x.wsb, test_stream());
      case kBackward:
        return flat::vp_backward(x.opts, x.ranks, x.rows, x.vocab_total, x.vocab_start,
                               x.vocab_local, x.logits, x.targets, x.gathered, x.gout, x.grad,
                               x.flags, x.ws, x.wsb, test_stream());
      case kLinStats:
        return flat::vp_linear_stats(x.opts, x.rows, x.hidden, x.vocab_total, x.vocab_start,
                                   x.vocab_local, x.hidden_states, x.weight, x.bias, x.targets,
                                   x.stats, x.ws, x.wsb, test_stream());
      case kLinBackward:
        return flat::vp_linear_backward(x.opts, x.ranks, x.rows, x.hidden, x.vocab_total,
                                      x.vocab_start, x.vocab_local, x.hidden_states, x.weight,
                                      x.bias, x.targets, x.gathered, x.gout, x.gh, x.gh_dtype,
                                      x.gw, x.gb, x.flags, x.ws, x.wsb, test_stream());
      default:
        return flat::vp_linear_ce(x.opts, x.ranks, x.rows, x.hidden, x.vocab_total, x.vocab_start,
                                x.vocab_local, x.hidden_states, x.weight, x.bias, x.targets,
                                x.loss, x.lse, x.z_loss, x.gout, x.gh, x.gh_dtype, x.gw, x.gb,
                                x.flags, x.all_gather, x.context, x.ws, x.wsb, test_stream());
    }
  }

  void rejected(VpFn f, const std::string& what, fce_status expected, const char* names,
                const std::function<void(VpArgs&)>& mutate) {
    SCOPED_TRACE(std::string(fn_name(f)) + " bad input: " + what);
    VpArgs x = args(f);
    mutate(x);
    if (x.opts == &a.o) x.opts = &x.o;
    std::vector<Buf*> bufs = {&arena, &targets, &weights, &gout, &stats, &gathered, &loss, &lse,
                              &zl, &grad, &flags, &am, &acc, &hidden, &weight, &bias, &gh, &gw,
                              &gb};
    std::vector<std::vector<uint8_t>> before;
    for (Buf* b : bufs) before.push_back(b->mirror());
    gathers = 0;
    const fce_status st = call(f, x);
    EXPECT_EQ(gathers, 0) << "a rejected call ran its all-gather";
    EXPECT_EQ(st, expected) << "got " << fce_status_string(st) << " (\"" << fce_last_error()
                            << "\")";
    EXPECT_TRUE(error_mentions(names));
    EXPECT_TRUE(error_mentions(std::string(fn_name(f)) + ":"));
    EXPECT_TRUE(finish());
    for (size_t i = 0; i < bufs.size(); ++i) {
      bufs[i]->pull();
      EXPECT_TRUE(unchanged(*bufs[i], before[i], "a buffer of the rejected call"));
    }
  }

  void for_all(const std::string& what, fce_status st, const char* names,
               const std::function<void(VpArgs&)>& mutate) {
    for (VpFn f : {kStats, kLoss, kBackward, kLinStats, kLinBackward, kLinCe})
      rejected(f, what, st, names, mutate);
  }

  Buf arena, targets, weights, gout, stats, gathered, loss, lse, zl, grad, flags, am, acc, hidden,
      weight, bias, gh, gw, gb, ws;
  size_t ws_need[6] = {};
  int gathers = 0;
  VpArgs a;
};

constexpr float kNaNf = std::numeric_limits<float>::quiet_NaN();

TEST_F(VpBadInput, ValidBaselineSucceeds) {
  for (VpFn f : {kStats, kLoss, kBackward, kLinStats, kLinBackward, kLinCe}) {
    SCOPED_TRACE(fn_name(f));
    VpArgs x = args(f);
    x.opts = &x.o;
    gathers = 0;
    EXPECT_EQ(call(f, x), FCE_SUCCESS) << fce_last_error();
    EXPECT_TRUE(finish());
    EXPECT_STREQ(fce_last_error(), "");
    EXPECT_EQ(gathers, f == kLinCe ? 1 : 0);
  }
  // fce_vp_linear_ce: the loss only is a valid call too
  VpArgs l = args(kLinCe);
  l.opts = &l.o;
  l.gh = l.gw = l.gb = nullptr;
  EXPECT_EQ(call(kLinCe, l), FCE_SUCCESS) << fce_last_error();
  EXPECT_TRUE(finish());
  // In place is fine for fce_vp_backward.
  VpArgs x = args(kBackward);
  x.opts = &x.o;
  x.grad = const_cast<void*>(x.logits);
  EXPECT_EQ(call(kBackward, x), FCE_SUCCESS) << fce_last_error();
  EXPECT_TRUE(finish());
}

TEST_F(VpBadInput, Options) {
  for_all("options NULL", FCE_ERROR_NULL_POINTER, "options", [](VpArgs& x) { x.opts = nullptr; });
  for_all("struct_size 8", FCE_ERROR_INVALID_ARGUMENT, "struct_size",
          [](VpArgs& x) { x.o.struct_size = 8; });
  for_all("dtype 7", FCE_ERROR_INVALID_ARGUMENT, "dtype", [](VpArgs& x) { x.o.dtype = 7; });
  for_all("target_dtype float32 (class probabilities)", FCE_ERROR_UNSUPPORTED, "target_dtype",
          [](VpArgs& x) { x.o.target_dtype = FCE_FLOAT32; });
  for_all("reduction 3", FCE_ERROR_INVALID_ARGUMENT, "reduction", [](VpArgs& x) { x.o.reduction = 3; });
  for_all("backend 2", FCE_ERROR_INVALID_ARGUMENT, "backend", [](VpArgs& x) { x.o.backend = 2; });
  for_all("label_smoothing 1", FCE_ERROR_INVALID_ARGUMENT, "label_smoothing",
          [](VpArgs& x) { x.o.label_smoothing = 1.0f; });
  for_all("z_loss_scale NaN", FCE_ERROR_INVALID_ARGUMENT, "z_loss_scale",
          [](VpArgs& x) { x.o.z_loss_scale = kNaNf; });
  for_all("softcap -1", FCE_ERROR_INVALID_ARGUMENT, "softcap", [](VpArgs& x) { x.o.softcap = -1.0f; });
  for_all("logit_scale 0", FCE_ERROR_INVALID_ARGUMENT, "logit_scale",
          [](VpArgs& x) { x.o.logit_scale = 0.0f; });
  for_all("shift_seq_len 3 with rows 8", FCE_ERROR_INVALID_ARGUMENT, "shift_seq_len",
          [](VpArgs& x) { x.o.shift_seq_len = 3; });
  for_all("shift without shift_seq_len", FCE_ERROR_INVALID_ARGUMENT, "options->shift",
          [](VpArgs& x) { x.o.shift = 2; });
  for_all("reserved0", FCE_ERROR_INVALID_ARGUMENT, "reserved0", [](VpArgs& x) { x.o.reserved0 = 1; });
  for_all("reserved1", FCE_ERROR_INVALID_ARGUMENT, "reserved1", [](VpArgs& x) { x.o.reserved1 = 1; });
  for_all("class_weights +1 byte", FCE_ERROR_MISALIGNED, "class_weights",
          [](VpArgs& x) { x.o.class_weights = reinterpret_cast<const float*>(reinterpret_cast<const char*>(x.o.class_weights) + 1); });
  if (!fce_cuda_available()) {
    for_all("backend CUDA without CUDA", FCE_ERROR_BACKEND_UNAVAILABLE, "backend|CUDA",
            [](VpArgs& x) { x.o.backend = FCE_BACKEND_CUDA; });
  }
}

TEST_F(VpBadInput, Sizes) {
  for_all("rows -1", FCE_ERROR_INVALID_ARGUMENT, "rows", [](VpArgs& x) { x.rows = -1; });
  for_all("vocab_total 0", FCE_ERROR_INVALID_ARGUMENT, "vocab_total", [](VpArgs& x) { x.vocab_total = 0; });
  for_all("vocab_total 2^31", FCE_ERROR_INVALID_ARGUMENT, "vocab_total",
          [](VpArgs& x) { x.vocab_total = int64_t{1} << 31; });
  for (VpFn f : {kStats, kBackward, kLinStats, kLinBackward, kLinCe}) {
    rejected(f, "vocab_local 0", FCE_ERROR_INVALID_ARGUMENT, "vocab_local", [](VpArgs& x) { x.vocab_local = 0; });
    rejected(f, "vocab_local -5", FCE_ERROR_INVALID_ARGUMENT, "vocab_local", [](VpArgs& x) { x.vocab_local = -5; });
    rejected(f, "vocab_start -1", FCE_ERROR_INVALID_ARGUMENT, "vocab_start", [](VpArgs& x) { x.vocab_start = -1; });
    rejected(f, "vocab_start + vocab_local > vocab_total", FCE_ERROR_INVALID_ARGUMENT,
             "vocab_start", [](VpArgs& x) { x.vocab_start = V - VL + 1; });
    rejected(f, "vocab_local > vocab_total", FCE_ERROR_INVALID_ARGUMENT, "vocab_local|vocab_start",
             [](VpArgs& x) { x.vocab_start = 0; x.vocab_local = V + 1; });
    rejected(f, "vocab_start INT64_MAX", FCE_ERROR_INVALID_ARGUMENT, "vocab_start",
             [](VpArgs& x) { x.vocab_start = INT64_MAX; });
  }
  for (VpFn f : {kLoss, kBackward, kLinBackward, kLinCe}) {
    rejected(f, "ranks 0", FCE_ERROR_INVALID_ARGUMENT, "ranks", [](VpArgs& x) { x.ranks = 0; });
    rejected(f, "ranks -2", FCE_ERROR_INVALID_ARGUMENT, "ranks", [](VpArgs& x) { x.ranks = -2; });
    rejected(f, "ranks overflowing", FCE_ERROR_INVALID_ARGUMENT, "ranks",
             [](VpArgs& x) { x.ranks = int64_t{1} << 60; });
  }
  for (VpFn f : {kLinStats, kLinBackward, kLinCe}) {
    rejected(f, "hidden 0", FCE_ERROR_INVALID_ARGUMENT, "hidden", [](VpArgs& x) { x.hidden = 0; });
    rejected(f, "hidden_row_stride < hidden", FCE_ERROR_INVALID_ARGUMENT, "hidden_row_stride",
             [](VpArgs& x) { x.o.hidden_row_stride = D - 1; });
  }
  for (VpFn f : {kStats, kBackward}) {
    rejected(f, "row_stride < vocab_local", FCE_ERROR_INVALID_ARGUMENT, "row_stride",
             [](VpArgs& x) { x.o.row_stride = VL - 1; });
    rejected(f, "row_stride overflowing", FCE_ERROR_INVALID_ARGUMENT, "rows|row stride|row_stride",
             [](VpArgs& x) { x.o.row_stride = INT64_MAX; });
  }
  rejected(kBackward, "grad_row_stride < vocab_local", FCE_ERROR_INVALID_ARGUMENT,
           "grad_row_stride", [](VpArgs& x) { x.o.grad_row_stride = VL - 1; });
  for (VpFn f : {kLinBackward, kLinCe}) {
    rejected(f, "grad_hidden_dtype float16 with float32", FCE_ERROR_INVALID_ARGUMENT,
             "grad_hidden_dtype", [](VpArgs& x) { x.gh_dtype = FCE_FLOAT16; });
    rejected(f, "grad_hidden_dtype int32", FCE_ERROR_INVALID_ARGUMENT, "grad_hidden_dtype",
             [](VpArgs& x) { x.gh_dtype = FCE_INT32; });
    rejected(f, "grad_hidden_dtype 9", FCE_ERROR_INVALID_ARGUMENT, "grad_hidden_dtype",
             [](VpArgs& x) { x.gh_dtype = 9; });
  }
}

TEST_F(VpBadInput, NullPointers) {
  rejected(kStats, "logits NULL", FCE_ERROR_NULL_POINTER, "logits", [](VpArgs& x) { x.logits = nullptr; });
  rejected(kStats, "stats NULL", FCE_ERROR_NULL_POINTER, "stats", [](VpArgs& x) { x.stats = nullptr; });
  rejected(kLoss, "gathered_stats NULL", FCE_ERROR_NULL_POINTER, "gathered_stats",
           [](VpArgs& x) { x.gathered = nullptr; });
  rejected(kLoss, "loss NULL", FCE_ERROR_NULL_POINTER, "loss", [](VpArgs& x) { x.loss = nullptr; });
  rejected(kBackward, "logits NULL", FCE_ERROR_NULL_POINTER, "logits", [](VpArgs& x) { x.logits = nullptr; });
  rejected(kBackward, "gathered_stats NULL", FCE_ERROR_NULL_POINTER, "gathered_stats",
           [](VpArgs& x) { x.gathered = nullptr; });
  rejected(kBackward, "grad_logits NULL", FCE_ERROR_NULL_POINTER, "grad_logits",
           [](VpArgs& x) { x.grad = nullptr; });
  for (VpFn f : {kLinStats, kLinBackward, kLinCe}) {
    rejected(f, "hidden_states NULL", FCE_ERROR_NULL_POINTER, "hidden_states",
             [](VpArgs& x) { x.hidden_states = nullptr; });
    rejected(f, "weight NULL", FCE_ERROR_NULL_POINTER, "weight", [](VpArgs& x) { x.weight = nullptr; });
  }
  rejected(kLinCe, "loss NULL", FCE_ERROR_NULL_POINTER, "loss", [](VpArgs& x) { x.loss = nullptr; });
  rejected(kLinCe, "all_gather NULL", FCE_ERROR_NULL_POINTER, "shard->all_gather",
           [](VpArgs& x) { x.all_gather = nullptr; });
  rejected(kLinCe, "grad_bias without bias", FCE_ERROR_INVALID_ARGUMENT, "grad_bias",
           [](VpArgs& x) { x.bias = nullptr; });
  rejected(kLinStats, "stats NULL", FCE_ERROR_NULL_POINTER, "stats", [](VpArgs& x) { x.stats = nullptr; });
  rejected(kLinBackward, "gathered_stats NULL", FCE_ERROR_NULL_POINTER, "gathered_stats",
           [](VpArgs& x) { x.gathered = nullptr; });
  rejected(kLinBackward, "every gradient NULL", FCE_ERROR_NULL_POINTER, "grad_hidden",
           [](VpArgs& x) { x.gh = x.gw = x.gb = nullptr; });
  rejected(kLinBackward, "grad_bias without bias", FCE_ERROR_INVALID_ARGUMENT, "grad_bias",
           [](VpArgs& x) { x.bias = nullptr; });
  for_all("targets NULL", FCE_ERROR_NULL_POINTER, "targets", [](VpArgs& x) { x.targets = nullptr; });
}

TEST_F(VpBadInput, Misaligned) {
  auto off = [](const void* p, int n) { return const_cast<char*>(static_cast<const char*>(p)) + n; };
  for (VpFn f : {kStats, kLinStats})
    rejected(f, "stats +4 bytes (float aligned, not 16)", FCE_ERROR_MISALIGNED, "stats",
             [&](VpArgs& x) { x.stats = reinterpret_cast<float*>(off(x.stats, 4)); });
  for (VpFn f : {kLoss, kBackward, kLinBackward}) {
    rejected(f, "gathered_stats +8 bytes", FCE_ERROR_MISALIGNED, "gathered_stats",
             [&](VpArgs& x) { x.gathered = reinterpret_cast<const float*>(off(x.gathered, 8)); });
    rejected(f, "error_flags +1 byte", FCE_ERROR_MISALIGNED, "error_flags",
             [&](VpArgs& x) { x.flags = reinterpret_cast<uint32_t*>(off(x.flags, 1)); });
  }
  rejected(kLinCe, "error_flags +1 byte", FCE_ERROR_MISALIGNED, "error_flags",
           [&](VpArgs& x) { x.flags = reinterpret_cast<uint32_t*>(off(x.flags, 1)); });
  rejected(kLinCe, "loss +2 bytes", FCE_ERROR_MISALIGNED, "loss",
           [&](VpArgs& x) { x.loss = reinterpret_cast<float*>(off(x.loss, 2)); });
  rejected(kLinCe, "grad_output +1 byte", FCE_ERROR_MISALIGNED, "grad_output",
           [&](VpArgs& x) { x.gout = reinterpret_cast<const float*>(off(x.gout, 1)); });
  for_all("int64 targets +4 bytes", FCE_ERROR_MISALIGNED, "targets",
          [&](VpArgs& x) { x.targets = off(x.targets, 4); });
  for (VpFn f : {kStats, kBackward})
    rejected(f, "logits +2 bytes", FCE_ERROR_MISALIGNED, "logits",
             [&](VpArgs& x) { x.logits = off(x.logits, 2); });
  rejected(kBackward, "grad_logits +1 byte", FCE_ERROR_MISALIGNED, "grad_logits",
           [&](VpArgs& x) { x.grad = off(x.grad, 1); });
  rejected(kBackward, "grad_output +1 byte", FCE_ERROR_MISALIGNED, "grad_output",
           [&](VpArgs& x) { x.gout = reinterpret_cast<const float*>(off(x.gout, 1)); });
  rejected(kLoss, "loss +2 bytes", FCE_ERROR_MISALIGNED, "loss",
           [&](VpArgs& x) { x.loss = reinterpret_cast<float*>(off(x.loss, 2)); });
  rejected(kLoss, "lse +1 byte", FCE_ERROR_MISALIGNED, "lse",
           [&](VpArgs& x) { x.lse = reinterpret_cast<float*>(off(x.lse, 1)); });
  rejected(kLoss, "outputs->argmax +4 bytes", FCE_ERROR_MISALIGNED, "outputs->argmax",
           [&](VpArgs& x) { x.o.argmax = reinterpret_cast<int64_t*>(off(am.ptr(), 4)); });
  rejected(kLoss, "outputs->accuracy +2 bytes", FCE_ERROR_MISALIGNED, "outputs->accuracy",
           [&](VpArgs& x) { x.o.accuracy = reinterpret_cast<float*>(off(acc.ptr(), 2)); });
  for (VpFn f : {kLinStats, kLinBackward, kLinCe}) {
    rejected(f, "hidden_states +1 byte", FCE_ERROR_MISALIGNED, "hidden_states",
             [&](VpArgs& x) { x.hidden_states = off(x.hidden_states, 1); });
    rejected(f, "weight +2 bytes", FCE_ERROR_MISALIGNED, "weight",
             [&](VpArgs& x) { x.weight = off(x.weight, 2); });
    rejected(f, "bias +1 byte", FCE_ERROR_MISALIGNED, "bias", [&](VpArgs& x) { x.bias = off(x.bias, 1); });
  }
  for (VpFn f : {kLinBackward, kLinCe}) {
    rejected(f, "grad_hidden +2 bytes", FCE_ERROR_MISALIGNED, "grad_hidden",
             [&](VpArgs& x) { x.gh = off(x.gh, 2); });
    rejected(f, "grad_weight +1 byte", FCE_ERROR_MISALIGNED, "grad_weight",
             [&](VpArgs& x) { x.gw = off(x.gw, 1); });
    rejected(f, "grad_bias +2 bytes", FCE_ERROR_MISALIGNED, "grad_bias",
             [&](VpArgs& x) { x.gb = off(x.gb, 2); });
  }
}

TEST_F(VpBadInput, Overlap) {
  rejected(kStats, "stats inside the logits", FCE_ERROR_INVALID_ARGUMENT, "stats",
           [](VpArgs& x) { x.stats = static_cast<float*>(const_cast<void*>(x.logits)) + 4; });
  rejected(kStats, "stats over the targets", FCE_ERROR_INVALID_ARGUMENT, "stats",
           [](VpArgs& x) { x.stats = static_cast<float*>(const_cast<void*>(x.targets)); });
  rejected(kLoss, "loss inside gathered_stats", FCE_ERROR_INVALID_ARGUMENT, "loss",
           [](VpArgs& x) { x.loss = const_cast<float*>(x.gathered) + 8; });
  rejected(kLoss, "lse over loss", FCE_ERROR_INVALID_ARGUMENT, "lse|loss",
           [](VpArgs& x) { x.lse = x.loss + 2; });
  rejected(kLoss, "outputs->argmax over the targets", FCE_ERROR_INVALID_ARGUMENT,
           "outputs->argmax", [](VpArgs& x) { x.o.argmax = static_cast<int64_t*>(const_cast<void*>(x.targets)); });
  rejected(kLoss, "outputs->accuracy inside lse", FCE_ERROR_INVALID_ARGUMENT, "outputs->accuracy",
           [](VpArgs& x) { x.o.accuracy = x.lse + 3; });
  rejected(kLoss, "error_flags inside class_weights", FCE_ERROR_INVALID_ARGUMENT, "error_flags",
           [](VpArgs& x) { x.flags = reinterpret_cast<uint32_t*>(const_cast<float*>(x.o.class_weights) + 5); });
  rejected(kBackward, "grad_logits partially over the logits", FCE_ERROR_INVALID_ARGUMENT,
           "grad_logits", [](VpArgs& x) { x.grad = static_cast<float*>(const_cast<void*>(x.logits)) + 3; });
  rejected(kBackward, "in place with grad_row_stride != row_stride", FCE_ERROR_INVALID_ARGUMENT,
           "grad_row_stride", [](VpArgs& x) {
             x.grad = const_cast<void*>(x.logits);
             x.o.row_stride = VL;
             x.o.grad_row_stride = VL + 1;
           });
  rejected(kBackward, "error_flags in the logits, in place", FCE_ERROR_INVALID_ARGUMENT,
           "error_flags", [](VpArgs& x) {
             x.grad = const_cast<void*>(x.logits);
             x.flags = static_cast<uint32_t*>(const_cast<void*>(x.logits)) + 2;
           });
  rejected(kBackward, "grad_logits over gathered_stats", FCE_ERROR_INVALID_ARGUMENT,
           "grad_logits|gathered_stats", [](VpArgs& x) { x.grad = const_cast<float*>(x.gathered); });
  rejected(kLinStats, "stats over the weight", FCE_ERROR_INVALID_ARGUMENT, "stats",
           [](VpArgs& x) { x.stats = static_cast<float*>(const_cast<void*>(x.weight)); });
  for (VpFn f : {kLinBackward, kLinCe}) {
    rejected(f, "grad_hidden over grad_weight", FCE_ERROR_INVALID_ARGUMENT,
             "grad_hidden|grad_weight", [](VpArgs& x) { x.gh = static_cast<float*>(x.gw) + 1; });
    rejected(f, "grad_bias inside hidden_states", FCE_ERROR_INVALID_ARGUMENT, "grad_bias",
             [](VpArgs& x) { x.gb = static_cast<float*>(const_cast<void*>(x.hidden_states)) + 4; });
  }
  rejected(kLinCe, "lse over loss", FCE_ERROR_INVALID_ARGUMENT, "lse|loss",
           [](VpArgs& x) { x.lse = x.loss; });
  rejected(kLinCe, "loss inside the weight", FCE_ERROR_INVALID_ARGUMENT, "loss|weight",
           [](VpArgs& x) { x.loss = static_cast<float*>(const_cast<void*>(x.weight)) + 2; });
  rejected(kLinBackward, "grad_weight over gathered_stats", FCE_ERROR_INVALID_ARGUMENT,
           "grad_weight|gathered_stats", [](VpArgs& x) { x.gw = const_cast<float*>(x.gathered); });
}

TEST_F(VpBadInput, Workspace) {
  bool any = false;
  for (VpFn f : {kLoss, kBackward, kLinStats, kLinBackward, kLinCe}) {
    if (ws_need[f] == 0) continue;
    any = true;
    rejected(f, "workspace_bytes one short", FCE_ERROR_WORKSPACE_TOO_SMALL, "workspace",
             [this, f](VpArgs& x) { x.wsb = ws_need[f] - 1; });
    rejected(f, "workspace NULL", FCE_ERROR_NULL_POINTER, "workspace",
             [](VpArgs& x) { x.ws = nullptr; });
    rejected(f, "workspace +8 bytes", FCE_ERROR_MISALIGNED, "workspace",
             [](VpArgs& x) { x.ws = static_cast<char*>(x.ws) + 8; });
  }
  if (!any) {
    std::printf("SKIPPED: no workspace is needed on this backend\n");
    GTEST_SKIP() << "no workspace to make too small";
  }
}

// The workspace queries: their own bad input, and consistent answers.
TEST_F(VpBadInput, WorkspaceQueries) {
  TestOptions o = a.o;
  size_t b = 7, mn = 7, op = 7;
  EXPECT_EQ(fce_vp_loss_workspace_size(nullptr, 2, N, V, &b), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_loss_workspace_size: options"));
  EXPECT_EQ(fce_vp_loss_workspace_size(&o, 2, N, V, nullptr), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_loss_workspace_size: workspace_bytes"));
  EXPECT_EQ(fce_vp_loss_workspace_size(&o, 0, N, V, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_loss_workspace_size: ranks"));
  EXPECT_EQ(fce_vp_loss_workspace_size(&o, 2, -1, V, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_loss_workspace_size: rows"));
  EXPECT_EQ(fce_vp_loss_workspace_size(&o, 2, N, 0, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_loss_workspace_size: vocab_total"));
  EXPECT_EQ(fce_vp_backward_workspace_size(&o, 2, N, V, V + 1, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_backward_workspace_size: vocab_local"));
  EXPECT_EQ(fce_vp_backward_workspace_size(&o, 2, N, V, 0, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_backward_workspace_size: vocab_local"));
  EXPECT_EQ(fce_vp_backward_workspace_size(&o, -1, N, V, VL, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_backward_workspace_size: ranks"));
  EXPECT_EQ(fce_vp_backward_workspace_size(&o, 2, N, V, VL, nullptr), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_backward_workspace_size: workspace_bytes"));
  EXPECT_EQ(fce_vp_linear_stats_workspace_size(&o, N, D, 0, &mn, &op), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_stats_workspace_size: vocab_local"));
  EXPECT_EQ(fce_vp_linear_stats_workspace_size(&o, N, 0, VL, &mn, &op), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_stats_workspace_size: hidden"));
  EXPECT_EQ(fce_vp_linear_stats_workspace_size(&o, N, D, VL, nullptr, &op), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_linear_stats_workspace_size: min_bytes"));
  EXPECT_EQ(fce_vp_linear_backward_workspace_size(&o, 2, N, D, V, VL, FCE_BFLOAT16, &mn, &op),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_backward_workspace_size: grad_hidden_dtype"));
  EXPECT_EQ(fce_vp_linear_backward_workspace_size(&o, 0, N, D, V, VL, FCE_FLOAT32, &mn, &op),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_backward_workspace_size: ranks"));
  EXPECT_EQ(fce_vp_linear_backward_workspace_size(&o, 2, N, D, V, V + 1, FCE_FLOAT32, &mn, &op),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_backward_workspace_size: vocab_local"));
  EXPECT_EQ(fce_vp_linear_backward_workspace_size(&o, 2, N, D, V, VL, FCE_FLOAT32, nullptr, &op),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_linear_backward_workspace_size: min_bytes"));
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(nullptr, 2, N, D, V, VL, 1, FCE_FLOAT32, &mn, &op),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_linear_ce_workspace_size: options"));
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o, 0, N, D, V, VL, 1, FCE_FLOAT32, &mn, &op),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_ce_workspace_size: ranks"));
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o, 2, N, 0, V, VL, 1, FCE_FLOAT32, &mn, &op),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_ce_workspace_size: hidden"));
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o, 2, N, D, V, V + 1, 1, FCE_FLOAT32, &mn, &op),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_ce_workspace_size: vocab_local"));
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o, 2, N, D, V, VL, 1, FCE_BFLOAT16, &mn, &op),
            FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_vp_linear_ce_workspace_size: grad_hidden_dtype"));
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o, 2, N, D, V, VL, 1, FCE_FLOAT32, nullptr, &op),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_linear_ce_workspace_size: min_bytes"));
  // rank-invariant for shards up to ceil(V / ranks): the narrow and the wide rank agree
  size_t n0 = 0, o0 = 0, n1 = 0, o1 = 0;
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o, 2, N, D, V, V / 2 - 3, 1, FCE_FLOAT32, &n0, &o0),
            FCE_SUCCESS);
  EXPECT_EQ(fce_vp_linear_ce_workspace_size(&o, 2, N, D, V, V / 2, 1, FCE_FLOAT32, &n1, &o1),
            FCE_SUCCESS);
  EXPECT_EQ(n0, n1);
  EXPECT_EQ(o0, o1);
  EXPECT_GE(o1, n1);
  TestOptions bad = o;
  bad.dtype = 42;
  EXPECT_EQ(fce_vp_loss_workspace_size(&bad, 2, N, V, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("dtype"));
  // Consistent answers: optimal >= min, a 16-bit grad_hidden_dtype (options->dtype) is fine,
  // optimal_bytes may be NULL, and a successful query clears the last error.
  EXPECT_EQ(fce_vp_linear_backward_workspace_size(&o, 2, N, D, V, VL, FCE_FLOAT32, &mn, &op),
            FCE_SUCCESS) << fce_last_error();
  EXPECT_GE(op, mn);
  EXPECT_STREQ(fce_last_error(), "");
  size_t mn2 = 0;
  EXPECT_EQ(fce_vp_linear_backward_workspace_size(&o, 2, N, D, V, VL, FCE_FLOAT32, &mn2, nullptr),
            FCE_SUCCESS);
  EXPECT_EQ(mn2, mn);
  TestOptions h = o;
  h.dtype = FCE_BFLOAT16;
  for (int32_t ghd : {FCE_FLOAT32, FCE_BFLOAT16}) {
    EXPECT_EQ(fce_vp_linear_backward_workspace_size(&h, 2, N, D, V, VL, ghd, &mn, &op), FCE_SUCCESS)
        << fce_last_error();
    EXPECT_GE(op, mn);
  }
  EXPECT_EQ(fce_vp_linear_stats_workspace_size(&h, N, D, VL, &mn, &op), FCE_SUCCESS);
  EXPECT_GE(op, mn);
}

}  // namespace
