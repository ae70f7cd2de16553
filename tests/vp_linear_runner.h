// vp_linear_runner.h — the linear case of test_vp_linear.cpp and its runner: fce_vp_linear_stats,
// the gather, fce_vp_loss and fce_vp_linear_backward on P shards of the weight (and the fused
// fce_vp_linear_ce, the ranks as threads meeting in SimGather), against the unsharded
// fce_linear_ce and the float64 reference.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "vp_common.h"

namespace {

// ------------------------------------------------------------------ fused linear ------------
struct LinVpCase : LinearSpec {
  int invalid = 0;            // rows given out-of-range targets
  bool gh_f32 = false;        // grad_hidden_dtype FCE_FLOAT32 (else options->dtype)
  bool ws_min = false;        // the workspaces of min_bytes (else optimal_bytes)
  bool uneven = true;
  std::vector<int> ranks = {1, 2, 3, 4};
};

inline std::string lin_label(const LinVpCase& c) {
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

inline void PrintTo(const LinVpCase& c, std::ostream* os) { *os << lin_label(c); }

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
    std::mt19937_64 rng = linear_rng(c_);
    LinearData d = linear_data(rng, c_);
    // Row r is scored against y[r + k]: every fourth one becomes row r's argmax.
    if (c_.confident) confident_linear_targets(c_, d, 4);
    h_ = std::move(d.h), W_ = std::move(d.W), b_ = std::move(d.b), y_ = std::move(d.y);
    w_ = std::move(d.w), g_ = std::move(d.g);
    spread_targets(c_.N, c_.V, c_.shift, c_.shift_k, y_);
    for (int i = 0; i < c_.invalid; ++i)
      y_[static_cast<size_t>(c_.N - 1 - 2 * i)] = i % 2 ? -3 : c_.V + i;
    ref_ = fceref::linear_cross_entropy(reference_options(c_, w_), c_.N, c_.D, c_.V, h_, W_, b_, y_,
                                        g_.empty() ? nullptr : &g_, true);
    gdt_ = c_.gw_fp32 ? FCE_FLOAT32 : c_.dtype;
    ghdt_ = c_.gh_f32 ? FCE_FLOAT32 : c_.dtype;
    if (c_.accumulate) {
      prefill_gradients(rng, c_, ref_, gdt_, d);
      gw0_ = std::move(d.gw0), gb0_ = std::move(d.gb0);
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
    o_ = spec_options(c_);
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
    const size_t wsb = workspace(true, ranks, s);
    Buf ws = workspace_buf(wsb);
    auto b_h = hidden_.mirror(), b_w = weight.mirror(), b_b = bias.mirror(),
         b_g = gathered.mirror(), b_go = gout_.mirror(), b_gh = gh.mirror(), b_gw = gw.mirror(),
         b_gb = gb.mirror();
    const fce_status st = flat::vp_linear_backward(
        &o_, ranks, c_.N, c_.D, c_.V, s.start, s.local, hidden_.ptr(), weight.ptr(), bias.ptr(),
        targets_.ptr(), gathered.p<float>(), gout_.p<float>(), gh.ptr(), ghdt_, gw.ptr(),
        gb.ptr(), ws.ptr(), wsb, test_stream());
    EXPECT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    EXPECT_TRUE(finish());
    for (Buf* b : {&hidden_, &weight, &bias, &gathered, &gout_, &gh, &gw, &gb, &ws})
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

}  // namespace
