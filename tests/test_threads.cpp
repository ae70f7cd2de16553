// test_threads.cpp — the header's thread-safety promise: "every function may be called from any
// number of threads at once ... The last-error message is per thread."
//
// Eight threads, started together, each call every entry point (the three workspace queries,
// fce_forward with the gradient and in place, fce_backward, fce_forward + fce_backward_rescale,
// fce_linear_ce, fce_scale_gradient, fce_options_default, the status strings, version and build
// info) on inputs of their own: other sizes, dtypes, reductions, options (label smoothing, class
// weights, z-loss, softcap, logit scale, shift, token scaling, strides, argmax/accuracy, a
// 0.1-sized TestOptions, out-of-range targets with error_flags, accumulation, float32
// grad_weight), for a few rounds. Every output must be bitwise what the same calls give one thread at a time (every
// path is deterministic), every input untouched, every call's fce_last_error() "" after its
// success; and each thread's own failing call leaves its own message, intact while the seven
// others fail and succeed in between, at an address of its own.
//
// The concurrent pass runs first, so that the first calls of the process (the one-time set-up
// the header mentions, cuBLASLt handles on CUDA) happen from eight threads at once; ctest runs
// each test in a fresh process. FCE_TEST_BACKEND=cuda: the same on the device, each thread with
// a stream of its own.
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "test_util.h"

using namespace fcet;

namespace {

constexpr int kThreads = 8;
constexpr int kRounds = 3;

// A reusable barrier (C++17 has none).
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    const long gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return gen_ != gen; });
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  const int n_;
  int count_ = 0;
  long gen_ = 0;
};

// One buffer of a job, with the bytes it starts every round from (inputs: their data; outputs:
// poison in the elements, guard bytes in row gaps and guards).
enum Kind {
  kInput,    // must stay untouched
  kOutput,   // compared bitwise with the single-threaded calls
  kScratch,  // a workspace: its contents are meaningless
};
struct Slot {
  const char* name;
  Buf buf;
  Kind kind;
  std::vector<uint8_t> initial;
};

// What one pass of a job produced: every buffer's bytes (guards included) and the query answers.
struct Result {
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<size_t> queries;
};

// The inputs, options and buffers of one thread, and its calls.
class Job {
 public:
  explicit Job(int t) : t_(t) { build(); }
  ~Job() {
#if FCE_TEST_HAVE_CUDA
    if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
#endif
  }
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  // One round of every call; outputs pulled into *out. Failures are EXPECTs (any thread).
  void run(Result* out);
  // A failing call whose message names this thread's own value; then, after the others have
  // made theirs (barrier), the message is still this thread's; then a success clears it.
  void last_error(Barrier* barrier, const char** message_address);

 private:
  void build();
  Slot& add(const char* name, Buf b, Kind kind) {
    slots_.push_back(std::unique_ptr<Slot>(new Slot{name, std::move(b), kind, {}}));
    slots_.back()->initial = slots_.back()->buf.mirror();
    return *slots_.back();
  }
  void* p(const Slot* s) const { return s ? s->buf.ptr() : nullptr; }
  float* f(const Slot* s) const { return s ? s->buf.p<float>() : nullptr; }
  void expect_ok(fce_status st, const char* call) {
    EXPECT_EQ(st, FCE_SUCCESS) << "thread " << t_ << ": " << call << ": " << fce_last_error();
    EXPECT_STREQ(fce_last_error(), "") << "thread " << t_ << ": " << call << " succeeded";
  }
  void sync() {
#if FCE_TEST_HAVE_CUDA
    if (stream_) FCE_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
#endif
  }

  const int t_;
  std::mt19937_64 rng_;
  void* stream_ = nullptr;
  int64_t N_ = 0, V_ = 0, LN_ = 0, LD_ = 0, LV_ = 0, count_ = 0;
  int dtype_ = FCE_FLOAT32, scale_dtype_ = FCE_FLOAT32;
  TestOptions o_{}, ro_{}, lo_{};
  size_t ws_f_ = 0, ws_b_ = 0, ws_l_ = 0;
  size_t ws_fr_ = 0, ws_br_ = 0;  // the rescale pair's (ro_: mean/sum where o_ may be none)
  std::vector<std::unique_ptr<Slot>> slots_;
  // CE
  Slot *logits_ = nullptr, *logits_ip_ = nullptr, *targets_ = nullptr, *cw_ = nullptr,
       *gout_ = nullptr, *flags_ = nullptr;
  Slot *loss_ = nullptr, *lse_ = nullptr, *zl_ = nullptr, *grad_ = nullptr, *argmax_ = nullptr,
       *acc_ = nullptr, *loss_ip_ = nullptr, *grad_b_ = nullptr;
  Slot *loss_r_ = nullptr, *lse_r_ = nullptr, *grad_r_ = nullptr, *g_r_ = nullptr;
  Slot *ws_fs_ = nullptr, *ws_bs_ = nullptr, *ws_ls_ = nullptr;
  // linear
  Slot *hidden_ = nullptr, *weight_ = nullptr, *bias_ = nullptr, *ltargets_ = nullptr,
       *lloss_ = nullptr, *llse_ = nullptr, *lzl_ = nullptr, *gh_ = nullptr, *gw_ = nullptr,
       *gb_ = nullptr, *largmax_ = nullptr, *lflags_ = nullptr;
  // scale
  Slot *sgrad_ = nullptr, *sscale_ = nullptr;
};

void Job::build() {
  rng_.seed(0x7E57ull * 1000003ull + static_cast<uint64_t>(t_));
  const int t = t_;
  const int dtypes[] = {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16};
  const int reductions[] = {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM, FCE_REDUCTION_NONE};
  dtype_ = dtypes[t % 3];
  const int red = reductions[(t + t / 3) % 3];
  const int tdt = t % 2 ? FCE_INT32 : FCE_INT64;
  const int64_t Ns[kThreads] = {64, 96, 48, 80, 72, 128, 33, 100};
  const int64_t Vs[kThreads] = {1000, 777, 2049, 515, 1311, 300, 4099, 1000};
  N_ = Ns[t];
  V_ = Vs[t];
#if FCE_TEST_HAVE_CUDA
  if (on_cuda()) {
    cudaStream_t s;
    FCE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    stream_ = s;
  }
#endif

  // ---- cross-entropy options: a different set per thread
  TestOptions o = test_options();
  o.dtype = dtype_;
  o.target_dtype = tdt;
  o.reduction = red;
  bool weights = false, extras = false, bad_targets = false;
  double ignore_frac = 0.1;
  switch (t) {
    case 0: break;
    case 1: o.label_smoothing = 0.1f; weights = true; break;
    case 2: o.z_loss_scale = 1e-3f; o.softcap = 30.0f; extras = true; break;
    case 3:
      o.logit_scale = 0.7f; o.shift_seq_len = 16; o.shift = 2;
      o.row_stride = V_ + 5; o.grad_row_stride = V_ + 3;
      break;
    case 4: o.token_scaling = 1; o.ignore_index = 3; bad_targets = true; extras = true; break;
    case 5:
      o.label_smoothing = 0.05f; o.z_loss_scale = 1e-4f; o.softcap = 20.0f; weights = true;
      extras = true; o.row_stride = V_ + 8;
      break;
    case 6: bad_targets = true; break;
    default: o.shift_seq_len = 10; weights = true; o.token_scaling = 1; break;
  }
  const Mat lm = mat(dtype_, N_, V_, o.row_stride), gm = mat(dtype_, N_, V_, o.grad_row_stride);
  const Mat rows_f32 = vec(FCE_FLOAT32, N_);
  const Mat red_f32 = vec(FCE_FLOAT32, red == FCE_REDUCTION_NONE ? N_ : 1);
  const Mat one = vec(FCE_FLOAT32, 1);

  {
    Buf b(lm);
    write_mat(b, lm, random_logits(rng_, dtype_, N_, V_));
    b.push();
    logits_ = &add("logits", std::move(b), kInput);
    // the in-place forward's logits: the same values, overwritten by the gradient each round
    Buf c(lm);
    std::memcpy(c.h(), logits_->buf.h(), lm.bytes());
    c.push();
    logits_ip_ = &add("logits (in place)", std::move(c), kOutput);
  }
  std::vector<int64_t> y = random_targets(rng_, N_, V_, ignore_frac, o.ignore_index);
  if (bad_targets) {
    y[1] = V_;
    y[static_cast<size_t>(N_ / 2)] = -7;
  }
  targets_ = &add("targets", targets_buf(y, tdt), kInput);
  if (weights) {
    cw_ = &add("class_weights", f32_buf(random_uniform(rng_, static_cast<size_t>(V_), 0.2, 2.0)),
               kInput);
    o.class_weights = cw_->buf.p<float>();
  }
  gout_ = &add("grad_output",
               f32_buf(random_uniform(rng_, red == FCE_REDUCTION_NONE ? size_t(N_) : 1, 0.5, 2.0)),
               kInput);
  {
    Buf fl(4, 0);
    fl.push();
    flags_ = &add("error_flags", std::move(fl), kOutput);
  }
  loss_ = &add("loss", poisoned(red_f32), kOutput);
  lse_ = &add("lse", poisoned(rows_f32), kOutput);
  zl_ = &add("z_loss", poisoned(one), kOutput);
  grad_ = &add("grad_logits", poisoned(gm), kOutput);
  loss_ip_ = &add("loss (in place)", poisoned(red_f32), kOutput);
  grad_b_ = &add("grad_logits (backward)", poisoned(gm), kOutput);
  if (extras) {
    Buf am(static_cast<size_t>(N_) * 8);
    for (int64_t r = 0; r < N_; ++r) put_poison(FCE_INT64, am.h() + 8 * r);
    am.push();
    argmax_ = &add("argmax", std::move(am), kOutput);
    acc_ = &add("accuracy", poisoned(red_f32), kOutput);
    o.argmax = argmax_->buf.p<int64_t>();
    o.accuracy = acc_->buf.p<float>();
  }
  o_ = o;
  // fce_backward_rescale: mean or sum, the forward's gradient for an upstream 1, then g
  ro_ = o;
  if (ro_.reduction == FCE_REDUCTION_NONE) ro_.reduction = FCE_REDUCTION_SUM;
  ro_.argmax = nullptr;
  ro_.accuracy = nullptr;
  loss_r_ = &add("loss (rescale's forward)", poisoned(one), kOutput);
  lse_r_ = &add("lse (rescale's forward)", poisoned(rows_f32), kOutput);
  grad_r_ = &add("grad_logits (rescaled)", poisoned(gm), kOutput);
  const float gs[kThreads] = {1.0f, 0.3f, -2.0f, 0.5f, 3.7f, 0.0f, 4.0f, -0.7f};
  g_r_ = &add("rescale's grad_output", f32_buf({gs[t]}), kInput);

  // ---- fused linear + cross-entropy
  LN_ = 32 + 8 * t;
  LD_ = 24 + 8 * t;
  LV_ = 200 + 37 * t;
  TestOptions lo = test_options();
  lo.dtype = dtype_;
  lo.target_dtype = tdt;
  lo.reduction = reductions[t % 3];
  lo.accumulate = t % 2;
  lo.grad_weight_fp32 = t % 4 == 1;
  lo.hidden_row_stride = t % 3 ? LD_ + t % 3 : 0;
  if (t % 4 == 2) lo.label_smoothing = 0.1f;
  if (t % 4 == 3) lo.z_loss_scale = 1e-3f;
  if (t == 5) lo.softcap = 15.0f;
  const Mat hm = mat(dtype_, LN_, LD_, lo.hidden_row_stride), wm = mat(dtype_, LV_, LD_);
  {
    Buf h(hm), w(wm);
    write_mat(h, hm, random_normal(rng_, dtype_, static_cast<size_t>(LN_ * LD_), 1.0));
    write_mat(w, wm, random_normal(rng_, dtype_, static_cast<size_t>(LV_ * LD_), 0.05));
    h.push();
    w.push();
    hidden_ = &add("hidden_states", std::move(h), kInput);
    weight_ = &add("weight", std::move(w), kInput);
  }
  const bool with_bias = t % 3 != 2;
  if (with_bias) {
    const Mat bm = vec(dtype_, LV_);
    Buf b(bm);
    write_mat(b, bm, random_normal(rng_, dtype_, static_cast<size_t>(LV_), 0.1));
    b.push();
    bias_ = &add("bias", std::move(b), kInput);
  }
  std::vector<int64_t> ly = random_targets(rng_, LN_, LV_, 0.1, lo.ignore_index);
  if (t == 4) ly[2] = LV_ + 1;
  ltargets_ = &add("targets (linear)", targets_buf(ly, tdt), kInput);
  const Mat lred = vec(FCE_FLOAT32, lo.reduction == FCE_REDUCTION_NONE ? LN_ : 1);
  lloss_ = &add("loss (linear)", poisoned(lred), kOutput);
  llse_ = &add("lse (linear)", poisoned(vec(FCE_FLOAT32, LN_)), kOutput);
  lzl_ = &add("z_loss (linear)", poisoned(one), kOutput);
  gh_ = &add("grad_hidden", poisoned(mat(dtype_, LN_, LD_)), kOutput);
  const int gdt = lo.grad_weight_fp32 ? FCE_FLOAT32 : dtype_;
  const Mat gwm = mat(gdt, LV_, LD_), gbm = vec(gdt, LV_);
  if (lo.accumulate) {  // accumulate into existing gradients
    Buf gw(gwm), gb(gbm);
    write_mat(gw, gwm, random_normal(rng_, gdt, static_cast<size_t>(LV_ * LD_), 0.01));
    write_mat(gb, gbm, random_normal(rng_, gdt, static_cast<size_t>(LV_), 0.01));
    gw.push();
    gb.push();
    gw_ = &add("grad_weight", std::move(gw), kOutput);
    if (with_bias) gb_ = &add("grad_bias", std::move(gb), kOutput);
  } else {
    gw_ = &add("grad_weight", poisoned(gwm), kOutput);
    if (with_bias) gb_ = &add("grad_bias", poisoned(gbm), kOutput);
  }
  if (t % 2 == 0) {
    Buf am(static_cast<size_t>(LN_) * 8);
    for (int64_t r = 0; r < LN_; ++r) put_poison(FCE_INT64, am.h() + 8 * r);
    am.push();
    largmax_ = &add("argmax (linear)", std::move(am), kOutput);
    lo.argmax = largmax_->buf.p<int64_t>();
  }
  {
    Buf fl(4, 0);
    fl.push();
    lflags_ = &add("error_flags (linear)", std::move(fl), kOutput);
  }
  lo_ = lo;

  // ---- fce_scale_gradient
  scale_dtype_ = dtypes[(t + 1) % 3];
  count_ = 1000 + 311 * t;
  {
    const Mat sm = vec(scale_dtype_, count_);
    Buf g(sm);
    write_mat(g, sm, random_normal(rng_, scale_dtype_, static_cast<size_t>(count_), 1.0));
    g.push();
    sgrad_ = &add("grad (scale_gradient)", std::move(g), kOutput);
    const float ss[kThreads] = {2.0f, 0.3f, -1.5f, 1.0f, 0.5f, 3.0f, -0.25f, 7.0f};
    sscale_ = &add("scale", f32_buf({ss[t]}), kInput);
  }

  // ---- workspaces, from the queries (made here on the main thread; the runs ask again)
  EXPECT_EQ(fce_forward_workspace_size(&o_, N_, V_, &ws_f_), FCE_SUCCESS) << fce_last_error();
  EXPECT_EQ(fce_backward_workspace_size(&o_, N_, V_, &ws_b_), FCE_SUCCESS) << fce_last_error();
  size_t opt = 0;
  EXPECT_EQ(fce_linear_ce_workspace_size(&lo_, LN_, LD_, LV_, 1, &ws_l_, &opt), FCE_SUCCESS)
      << fce_last_error();
  EXPECT_EQ(fce_forward_workspace_size(&ro_, N_, V_, &ws_fr_), FCE_SUCCESS) << fce_last_error();
  EXPECT_EQ(fce_backward_workspace_size(&ro_, N_, V_, &ws_br_), FCE_SUCCESS) << fce_last_error();
  const size_t ws_f_most = std::max(ws_f_, ws_fr_), ws_b_most = std::max(ws_b_, ws_br_);
  if (ws_f_most) ws_fs_ = &add("workspace (forward)", workspace_buf(ws_f_most), kScratch);
  if (ws_b_most) ws_bs_ = &add("workspace (backward)", workspace_buf(ws_b_most), kScratch);
  if (ws_l_) ws_ls_ = &add("workspace (linear)", workspace_buf(ws_l_), kScratch);
}

void Job::run(Result* out) {
  // every buffer back to its initial bytes
  for (auto& s : slots_) {
    std::memcpy(s->buf.h() - kGuard, s->initial.data(), s->initial.size());
    s->buf.push();
  }
  out->queries.clear();
  size_t a = 0, b = 0, c = 0, d = 0;
  expect_ok(fce_forward_workspace_size(&o_, N_, V_, &a), "fce_forward_workspace_size");
  expect_ok(fce_backward_workspace_size(&o_, N_, V_, &b), "fce_backward_workspace_size");
  expect_ok(fce_linear_ce_workspace_size(&lo_, LN_, LD_, LV_, 1, &c, &d),
            "fce_linear_ce_workspace_size");
  out->queries = {a, b, c, d};
  EXPECT_EQ(a, ws_f_);
  EXPECT_EQ(b, ws_b_);
  EXPECT_EQ(c, ws_l_);

  uint32_t* flags = flags_->buf.p<uint32_t>();
  // the one-pass training forward: loss, lse, z_loss, gradient (+ argmax, accuracy)
  expect_ok(flat::forward(&o_, N_, V_, p(logits_), p(targets_), f(loss_), f(lse_), f(zl_), p(grad_),
                        f(gout_), flags, p(ws_fs_), ws_f_, stream_),
            "fce_forward");
  // in place: the gradient over the logits (argmax/accuracy off: they are the first call's)
  TestOptions ip = o_;
  ip.argmax = nullptr;
  ip.accuracy = nullptr;
  ip.grad_row_stride = ip.row_stride;
  expect_ok(flat::forward(&ip, N_, V_, p(logits_ip_), p(targets_), f(loss_ip_), nullptr, nullptr,
                        p(logits_ip_), f(gout_), flags, p(ws_fs_), ws_f_, stream_),
            "fce_forward (in place)");
  // the backward from the saved lse (the options of the forward, argmax and accuracy included:
  // it must not write them)
  expect_ok(flat::backward(&o_, N_, V_, p(logits_), p(targets_), f(lse_), f(gout_), p(grad_b_),
                         flags, p(ws_bs_), ws_b_, stream_),
            "fce_backward");
  // the gradient for an upstream 1, then made the gradient for g
  expect_ok(flat::forward(&ro_, N_, V_, p(logits_), p(targets_), f(loss_r_), f(lse_r_), nullptr,
                        p(grad_r_), nullptr, flags, p(ws_fs_), ws_fr_, stream_),
            "fce_forward (upstream 1)");
  expect_ok(flat::backward_rescale(&ro_, N_, V_, p(logits_), p(targets_), f(lse_r_), f(g_r_),
                                 p(grad_r_), flags, p(ws_bs_), ws_br_, stream_),
            "fce_backward_rescale");
  expect_ok(flat::linear_ce(&lo_, LN_, LD_, LV_, p(hidden_), p(weight_), p(bias_), p(ltargets_),
                          f(lloss_), f(llse_), f(lzl_), p(gh_), p(gw_), p(gb_), nullptr,
                          lflags_->buf.p<uint32_t>(), p(ws_ls_), ws_l_, stream_),
            "fce_linear_ce");
  expect_ok(fce_scale_gradient(backend_id(), scale_dtype_, count_, p(sgrad_), f(sscale_),
                               stream_),
            "fce_scale_gradient");
  // the calls that touch no buffer of the backend
  TestOptions def{};
  def.struct_size = t_ % 2 ? 0 : sizeof(fce_options);  // 0: FCE_OPTIONS_SIZE_V1_0
  fce_options_default(&def);
  EXPECT_EQ(def.ignore_index, -100);
  EXPECT_EQ(def.struct_size, size_t(FCE_OPTIONS_SIZE_V1_0));
  EXPECT_EQ(std::string(fce_status_string(FCE_ERROR_NULL_POINTER)).rfind("FCE_ERROR_NULL_POINTER", 0),
            0u);
  EXPECT_EQ(fce_version(), static_cast<unsigned>(FCE_VERSION_NUMBER));
  EXPECT_EQ(std::string(fce_build_info()).rfind("fusedce ", 0), 0u);

  sync();
  EXPECT_TRUE(finish());
  out->bytes.clear();
  for (auto& s : slots_) {
    s->buf.pull();
    if (s->kind == kInput) {
      EXPECT_TRUE(unchanged(s->buf, s->initial, s->name)) << "thread " << t_;
    }
    if (s->kind == kOutput) out->bytes.push_back(s->buf.mirror());
  }
}

void Job::last_error(Barrier* barrier, const char** message_address) {
  // a failing call with a value of this thread's own
  fce_status st = FCE_SUCCESS;
  std::string want;
  float g = 1.0f;
  switch (t_ % 4) {
    case 0:
      want = "fce_forward";
      st = flat::forward(&o_, -(1000 + t_), V_, p(logits_), p(targets_), f(loss_), nullptr, nullptr,
                       nullptr, nullptr, nullptr, nullptr, 0, stream_);
      want += "|" + std::to_string(-(1000 + t_));
      break;
    case 1:
      want = "fce_backward";
      st = flat::backward(&o_, N_, -(2000 + t_), p(logits_), p(targets_), f(lse_), nullptr,
                        p(grad_b_), nullptr, nullptr, 0, stream_);
      want += "|" + std::to_string(-(2000 + t_));
      break;
    case 2:
      want = "fce_linear_ce";
      st = flat::linear_ce(&lo_, LN_, -(3000 + t_), LV_, p(hidden_), p(weight_), nullptr,
                         p(ltargets_), f(lloss_), nullptr, nullptr, nullptr, nullptr, nullptr,
                         nullptr, nullptr, nullptr, 0, stream_);
      want += "|" + std::to_string(-(3000 + t_));
      break;
    default:
      want = "fce_scale_gradient";
      st = fce_scale_gradient(backend_id(), FCE_FLOAT32, -(4000 + t_), nullptr, &g, stream_);
      want += "|" + std::to_string(-(4000 + t_));
      break;
  }
  EXPECT_EQ(st, FCE_ERROR_INVALID_ARGUMENT) << "thread " << t_;
  const std::string fn = want.substr(0, want.find('|'));
  const std::string value = want.substr(want.find('|') + 1);
  auto check = [&](const char* when) {
    const std::string msg = fce_last_error();
    EXPECT_EQ(msg.rfind(fn + ":", 0), 0u) << "thread " << t_ << " " << when << ": \"" << msg << "\"";
    EXPECT_NE(msg.find("(" + value + ")"), std::string::npos)
        << "thread " << t_ << " " << when << ": \"" << msg << "\" does not name its " << value;
  };
  check("right after its failing call");
  *message_address = fce_last_error();
  barrier->wait();  // every thread has failed with its own value by now
  check("after the other threads' failing calls");
  barrier->wait();
  size_t bytes = 0;
  EXPECT_EQ(fce_forward_workspace_size(&o_, N_, V_, &bytes), FCE_SUCCESS) << fce_last_error();
  EXPECT_STREQ(fce_last_error(), "") << "thread " << t_ << ": a success clears the message";
  barrier->wait();
  EXPECT_STREQ(fce_last_error(), "") << "thread " << t_ << ": after the others' successes";
}

::testing::AssertionResult same(const Result& a, const Result& b, int t, int round) {
  if (a.queries != b.queries)
    return ::testing::AssertionFailure() << "thread " << t << " round " << round
                                         << ": workspace queries differ";
  if (a.bytes.size() != b.bytes.size())
    return ::testing::AssertionFailure() << "thread " << t << ": buffer count differs";
  for (size_t i = 0; i < a.bytes.size(); ++i) {
    if (a.bytes[i] == b.bytes[i]) continue;
    size_t k = 0;
    while (a.bytes[i][k] == b.bytes[i][k]) ++k;
    return ::testing::AssertionFailure()
           << "thread " << t << " round " << round << ": buffer #" << i
           << " differs from the single-threaded call at byte "
           << static_cast<long long>(k) - static_cast<long long>(kGuard);
  }
  return ::testing::AssertionSuccess();
}

class Threads : public BackendTest {};

// Every entry point from 8 threads at once (the process's first calls), kRounds rounds, against
// the same calls one thread at a time afterwards.
TEST_F(Threads, EveryEntryPointFromEightThreadsMatchesOneThread) {
  std::vector<std::unique_ptr<Job>> jobs;
  for (int t = 0; t < kThreads; ++t) jobs.emplace_back(new Job(t));
  ASSERT_FALSE(HasFailure()) << "set-up failed";
  std::vector<std::vector<Result>> concurrent(kThreads, std::vector<Result>(kRounds));
  std::vector<const char*> addresses(kThreads, nullptr);
  Barrier barrier(kThreads);
  {
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t)
      threads.emplace_back([&, t] {
        barrier.wait();  // start together
        for (int r = 0; r < kRounds; ++r) {
          jobs[size_t(t)]->run(&concurrent[size_t(t)][size_t(r)]);
          barrier.wait();
        }
        jobs[size_t(t)]->last_error(&barrier, &addresses[size_t(t)]);
      });
    for (auto& th : threads) th.join();
  }
  // one thread at a time, on this thread
  for (int t = 0; t < kThreads; ++t) {
    Result serial;
    jobs[size_t(t)]->run(&serial);
    for (int r = 0; r < kRounds; ++r)
      EXPECT_TRUE(same(serial, concurrent[size_t(t)][size_t(r)], t, r));
  }
  // a message buffer per thread
  for (int i = 0; i < kThreads; ++i)
    for (int j = i + 1; j < kThreads; ++j)
      EXPECT_NE(addresses[size_t(i)], addresses[size_t(j)])
          << "threads " << i << " and " << j << " share fce_last_error()'s buffer";
}

// The per-thread message alone, many times over: failing and succeeding calls interleaved
// across 8 threads, each checking after every call that the message is its own.
TEST_F(Threads, LastErrorIsPerThread) {
  Barrier barrier(kThreads);
  std::vector<std::thread> threads;
  std::vector<int> mismatches(kThreads, 0);
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      TestOptions o = test_options();
      size_t bytes = 0;
      barrier.wait();
      for (int i = 0; i < 2000; ++i) {
        const int64_t rows = (i + t) % 2 ? 1 + t : -(100000 * (t + 1) + i);
        const fce_status st = fce_forward_workspace_size(&o, rows, 1000, &bytes);
        const std::string msg = fce_last_error();
        if (rows > 0) {
          if (st != FCE_SUCCESS || !msg.empty()) ++mismatches[size_t(t)];
        } else if (st != FCE_ERROR_INVALID_ARGUMENT ||
                   msg.find("(" + std::to_string(rows) + ")") == std::string::npos) {
          ++mismatches[size_t(t)];
        }
      }
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t)
    EXPECT_EQ(mismatches[size_t(t)], 0) << "thread " << t << ": calls whose status or message "
                                        << "was not this thread's own";
}

}  // namespace
