// test_api.cpp — the ABI itself: version, status strings, the options initialiser and
// fce_options_default, a 0.1/0.2 caller's smaller TestOptions, the per-thread last error,
// workspace queries, backend availability, and bad input to fce_forward / fce_backward: for each
// invalid argument the status, a message naming the function and the argument, and every output
// left untouched (overlaps included: an output inside the logits of an in-place call).
#include <functional>
#include <set>
#include <thread>

#include "test_util.h"

using namespace fcet;

namespace {

// ------------------------------------------------------------------ version, status ---------
TEST(Api, Version) {
  EXPECT_EQ(FCE_VERSION_NUMBER,
            FCE_VERSION_MAJOR * 10000 + FCE_VERSION_MINOR * 100 + FCE_VERSION_PATCH);
  EXPECT_EQ(fce_version(), static_cast<unsigned>(FCE_VERSION_NUMBER))
      << "library built from another header version";
}

// fce_build_info: one line naming the version, the backends, the cuBLASLt a CUDA build loaded
// (its file, or why none: it is loaded at run time, never linked) and the CPU backend's BLAS;
// the same pointer on every call.
TEST(Api, BuildInfo) {
  const char* info = fce_build_info();
  ASSERT_NE(info, nullptr);
  char want[64];
  std::snprintf(want, sizeof want, "fusedce %d.%d.%d; backends: cpu", FCE_VERSION_MAJOR,
                FCE_VERSION_MINOR, FCE_VERSION_PATCH);
  EXPECT_EQ(std::string(info).rfind(want, 0), 0u) << info;
  EXPECT_NE(std::string(info).find("; BLAS: "), std::string::npos) << info;
  const bool cuda_built = std::string(info).find("backends: cpu, cuda (") != std::string::npos;
  const size_t lt = std::string(info).find("; cuBLASLt: ");
  EXPECT_EQ(lt != std::string::npos, cuda_built) << info;
  if (cuda_built && lt != std::string::npos) {
    const std::string what = std::string(info).substr(lt + 12);
    EXPECT_TRUE(what.rfind("/", 0) == 0 || what.rfind("not loaded: libcublasLt.so.", 0) == 0)
        << info;
    if (fce_cuda_available()) EXPECT_EQ(what.rfind("/", 0), 0u) << info;
  }
  EXPECT_EQ(std::string(info).find('\n'), std::string::npos) << info;
  EXPECT_EQ(fce_build_info(), info);
}

TEST(Api, StatusStrings) {
  const std::pair<fce_status, const char*> codes[] = {
      {FCE_SUCCESS, "FCE_SUCCESS"},
      {FCE_ERROR_INVALID_ARGUMENT, "FCE_ERROR_INVALID_ARGUMENT"},
      {FCE_ERROR_NULL_POINTER, "FCE_ERROR_NULL_POINTER"},
      {FCE_ERROR_MISALIGNED, "FCE_ERROR_MISALIGNED"},
      {FCE_ERROR_UNSUPPORTED, "FCE_ERROR_UNSUPPORTED"},
      {FCE_ERROR_WORKSPACE_TOO_SMALL, "FCE_ERROR_WORKSPACE_TOO_SMALL"},
      {FCE_ERROR_BACKEND_UNAVAILABLE, "FCE_ERROR_BACKEND_UNAVAILABLE"},
      {FCE_ERROR_CUDA, "FCE_ERROR_CUDA"},
      {FCE_ERROR_CUBLAS, "FCE_ERROR_CUBLAS"},
      {FCE_ERROR_INTERNAL, "FCE_ERROR_INTERNAL"},
      {FCE_ERROR_OUT_OF_MEMORY, "FCE_ERROR_OUT_OF_MEMORY"},
  };
  // Append-only numbering.
  for (int i = 0; i < 11; ++i) EXPECT_EQ(static_cast<int>(codes[i].first), i);
  std::set<std::string> seen;
  for (const auto& c : codes) {
    const char* s = fce_status_string(c.first);
    ASSERT_NE(s, nullptr) << c.second;
    std::string str(s);
    // "FCE_ERROR_NULL_POINTER: a required pointer is NULL": the name first.
    EXPECT_EQ(str.rfind(c.second, 0), 0u) << "\"" << str << "\" does not start with " << c.second;
    if (c.first != FCE_SUCCESS) {
      EXPECT_GT(str.size(), std::strlen(c.second)) << "no description for " << c.second;
    }
    EXPECT_TRUE(seen.insert(str).second) << "duplicate string " << str;
    EXPECT_EQ(fce_status_string(c.first), s) << "not a static string";
  }
  for (int bad : {-1, 11, 1000, 0x7fffffff}) {
    const char* s = fce_status_string(static_cast<fce_status>(bad));
    ASSERT_NE(s, nullptr) << "unknown code " << bad;
    EXPECT_GT(std::strlen(s), 0u) << "unknown code " << bad;
  }
}

// The defaults of the fields a struct of struct_size bytes has (all of them by default).
void expect_defaults(const fce_options& o, size_t struct_size = sizeof(fce_options)) {
  EXPECT_EQ(o.struct_size, struct_size);
  EXPECT_EQ(o.class_weights, nullptr);
  EXPECT_EQ(o.ignore_index, -100);
  EXPECT_EQ(o.row_stride, 0);
  EXPECT_EQ(o.grad_row_stride, 0);
  EXPECT_EQ(o.shift_seq_len, 0);
  EXPECT_EQ(o.hidden_row_stride, 0);
  EXPECT_EQ(o.backend, FCE_BACKEND_CUDA);
  EXPECT_EQ(o.dtype, FCE_FLOAT32);
  EXPECT_EQ(o.target_dtype, FCE_INT64);
  EXPECT_EQ(o.reduction, FCE_REDUCTION_MEAN);
  EXPECT_EQ(o.label_smoothing, 0.0f);
  EXPECT_EQ(o.z_loss_scale, 0.0f);
  EXPECT_EQ(o.softcap, 0.0f);
  EXPECT_EQ(o.logit_scale, 1.0f);
  EXPECT_EQ(o.deterministic, 0);
  EXPECT_EQ(o.accumulate, 0);
  EXPECT_EQ(o.grad_weight_fp32, 0);
  EXPECT_EQ(o.vp_entropy, 0);
  EXPECT_EQ(o.shift, 0);
  EXPECT_EQ(o.token_scaling, 0);
  EXPECT_EQ(o.batch_invariant, 0);
}

TEST(Api, OptionsLayout) {
  // The sizes are the header's, and the outputs leave the options (they are fce_outputs').
  EXPECT_EQ(sizeof(fce_options), (size_t)FCE_OPTIONS_SIZE_V1_0);
  EXPECT_EQ(offsetof(fce_options, batch_invariant) + sizeof(int32_t),
            (size_t)FCE_OPTIONS_SIZE_V1_0);
  EXPECT_EQ(sizeof(fce_outputs), (size_t)FCE_OUTPUTS_SIZE_V1_0);
  EXPECT_EQ(offsetof(fce_outputs, entropy) + sizeof(void*), (size_t)FCE_OUTPUTS_SIZE_V1_0);
  EXPECT_EQ(sizeof(fce_gradients), (size_t)FCE_GRADIENTS_SIZE_V1_0);
  EXPECT_EQ(offsetof(fce_gradients, grad_entropy) + sizeof(void*),
            (size_t)FCE_GRADIENTS_SIZE_V1_0);
}

TEST(Api, OptionsInitialiser) {
  fce_options o = FCE_OPTIONS_INIT;
  expect_defaults(o);
}

TEST(Api, OptionsDefault) {
  fce_options o;
  std::memset(&o, 0, sizeof o);
  o.struct_size = sizeof o;
  fce_options_default(&o);
  expect_defaults(o);
}

// FCE_OPTIONS_INIT and fce_options_default() give the same struct, byte for byte (it has no
// padding: every field is 8-byte aligned or paired).
TEST(Api, OptionsInitEqualsDefault) {
  fce_options a = FCE_OPTIONS_INIT, b;
  std::memset(&b, 0x5A, sizeof b);
  b.struct_size = sizeof b;
  fce_options_default(&b);
  EXPECT_EQ(std::memcmp(&a, &b, sizeof a), 0);
}

// The header: "Fills *options with the defaults above" -- struct_size included, whatever the
// struct held before (a binding hands it uninitialised memory).
TEST(Api, OptionsDefaultOverwritesGarbage) {
  // The caller sets struct_size; every other byte is overwritten with the defaults.
  fce_options o;
  std::memset(&o, 0xAB, sizeof o);
  o.struct_size = sizeof o;
  fce_options_default(&o);
  expect_defaults(o);
}

TEST(Api, OptionsDefaultWritesNoMoreThanStructSize) {
  // A caller built against an older, smaller fce_options: nothing past its struct is written.
  unsigned char raw[sizeof(fce_options) + 64];
  std::memset(raw, 0xAB, sizeof raw);
  fce_options* o = reinterpret_cast<fce_options*>(raw);
  o->struct_size = offsetof(fce_options, ignore_index);  // knows struct_size + class_weights
  fce_options_default(o);
  EXPECT_EQ(o->struct_size, offsetof(fce_options, ignore_index));
  EXPECT_EQ(o->class_weights, nullptr);
  for (size_t i = offsetof(fce_options, ignore_index); i < sizeof raw; ++i)
    ASSERT_EQ(raw[i], 0xAB) << "byte " << i << " written past struct_size";
  // A zeroed struct (struct_size 0) is this version's: every field written, struct_size too.
  fce_options z;
  std::memset(&z, 0, sizeof z);
  fce_options_default(&z);
  expect_defaults(z, FCE_OPTIONS_SIZE_V1_0);
}

// ------------------------------------------------------------------ last error --------------
TEST(Api, LastErrorIsPerThread) {
  // A thread that never failed sees "".
  std::string fresh = "unset";
  std::thread([&] {
    const char* m = fce_last_error();
    fresh = m ? m : "(null)";
  }).join();
  EXPECT_EQ(fresh, "");

  // A failure on one thread is not seen by another.
  std::string mine, other = "unset";
  size_t ws = 0;
  fce_status st = fce_forward_workspace_size(nullptr, 4, 4, &ws);
  EXPECT_EQ(st, FCE_ERROR_NULL_POINTER);
  mine = fce_last_error();
  EXPECT_NE(mine.find("options"), std::string::npos) << mine;
  EXPECT_NE(mine.find("fce_forward_workspace_size"), std::string::npos) << mine;
  std::thread([&] { other = fce_last_error(); }).join();
  EXPECT_EQ(other, "");
  // And a failure elsewhere does not change this thread's message.
  std::thread([&] {
    TestOptions o = FCE_OPTIONS_INIT;
    o.reduction = 77;
    size_t b = 0;
    fce_forward_workspace_size(&o, 4, 4, &b);
  }).join();
  EXPECT_EQ(std::string(fce_last_error()), mine);
}

// ------------------------------------------------------------------ workspace queries -------
TEST(Api, WorkspaceQueries) {
  TestOptions o = FCE_OPTIONS_INIT;
  o.backend = FCE_BACKEND_CPU;
  size_t b = 0, mn = 0, op = 0;
  EXPECT_EQ(fce_forward_workspace_size(&o, 16, 100, &b), FCE_SUCCESS) << fce_last_error();
  EXPECT_EQ(fce_backward_workspace_size(&o, 16, 100, &b), FCE_SUCCESS) << fce_last_error();
  EXPECT_EQ(fce_linear_ce_workspace_size(&o, 16, 8, 100, 1, &mn, &op), FCE_SUCCESS)
      << fce_last_error();
  EXPECT_GE(op, mn);
  EXPECT_EQ(fce_linear_ce_workspace_size(&o, 16, 8, 100, 0, &mn, &op), FCE_SUCCESS)
      << fce_last_error();
  EXPECT_GE(op, mn);

  EXPECT_EQ(fce_forward_workspace_size(nullptr, 16, 100, &b), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("options"));
  EXPECT_EQ(fce_forward_workspace_size(&o, 16, 100, nullptr), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("workspace_bytes"));
  EXPECT_EQ(fce_backward_workspace_size(&o, 16, 100, nullptr), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("workspace_bytes"));
  EXPECT_EQ(fce_linear_ce_workspace_size(&o, 16, 8, 100, 1, nullptr, &op), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("min_bytes"));
  EXPECT_EQ(fce_forward_workspace_size(&o, -1, 100, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("rows"));
  EXPECT_EQ(fce_forward_workspace_size(&o, 16, -1, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("vocab"));
  EXPECT_EQ(fce_linear_ce_workspace_size(&o, 16, 0, 100, 1, &mn, &op), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("hidden"));
  TestOptions bad = o;
  bad.dtype = 42;
  EXPECT_EQ(fce_forward_workspace_size(&bad, 16, 100, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("dtype"));
  bad = o;
  bad.struct_size = 4;
  EXPECT_EQ(fce_backward_workspace_size(&bad, 16, 100, &b), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("struct_size"));
}

// ------------------------------------------------------------------ backends ----------------
TEST(Api, CudaAvailability) {
  int avail = fce_cuda_available();
  EXPECT_TRUE(avail == 0 || avail == 1);
  if (on_cuda() && test_env().skip.empty()) {
    EXPECT_EQ(avail, 1) << "FCE_TEST_BACKEND=cuda with a device, but fce_cuda_available() == 0";
  }
  if (avail) return;
  // No CUDA backend here: a CUDA call is refused, host buffers untouched.
  TestOptions o = FCE_OPTIONS_INIT;  // backend CUDA
  std::vector<float> z(4 * 8, 1.0f), loss(1, -7.0f);
  std::vector<int64_t> y = {0, 1, 2, 3};
  size_t b = 0;
  EXPECT_EQ(fce_forward_workspace_size(&o, 4, 8, &b), FCE_ERROR_BACKEND_UNAVAILABLE);
  EXPECT_EQ(flat::forward(&o, 4, 8, z.data(), y.data(), loss.data(), nullptr, nullptr, nullptr,
                        nullptr, nullptr, nullptr, 0, nullptr),
            FCE_ERROR_BACKEND_UNAVAILABLE);
  EXPECT_TRUE(error_mentions("backend|CUDA|cuda"));
  EXPECT_EQ(loss[0], -7.0f);
}

#if FCE_TEST_HAVE_CUDA
// The CUDA backend given host (pageable) memory refuses it rather than faulting.
TEST(Api, CudaBackendRejectsHostPointers) {
  FCE_REQUIRE_BACKEND();
  if (!on_cuda()) {
    std::printf("SKIPPED: CUDA backend test (FCE_TEST_BACKEND=cuda)\n");
    GTEST_SKIP() << "CUDA backend only";
  }
  TestOptions o = test_options();
  std::vector<float> z(4 * 8, 1.0f);
  std::vector<int64_t> y = {0, 1, 2, 3};
  Buf loss = poisoned(vec(FCE_FLOAT32, 1));
  Buf yb = targets_buf(y, FCE_INT64);
  auto before = loss.mirror();
  size_t b = 0;
  ASSERT_EQ(fce_forward_workspace_size(&o, 4, 8, &b), FCE_SUCCESS);
  Buf ws = workspace_buf(b);
  fce_status st = flat::forward(&o, 4, 8, z.data(), yb.ptr(), loss.p<float>(), nullptr, nullptr,
                              nullptr, nullptr, nullptr, ws.ptr(), b, test_stream());
  EXPECT_NE(st, FCE_SUCCESS);
  EXPECT_TRUE(error_mentions("logits"));
  EXPECT_TRUE(finish());
  loss.pull();
  EXPECT_TRUE(unchanged(loss, before, "loss"));
}
#endif

// ------------------------------------------------------------------ bad input ---------------
struct FwdArgs {
  TestOptions o;
  const TestOptions* opts;
  int64_t rows, vocab;
  const void* logits;
  const void* targets;
  float* loss;
  float* lse;
  float* z_loss;
  void* grad;
  const float* gout;
  uint32_t* flags;
  void* ws;
  size_t wsb;
};

class BadInput : public BackendTest {
 protected:
  static constexpr int64_t N = 8, V = 16;
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    std::mt19937_64 rng(3);
    // An arena of 2 N V floats: logits at its start, room for (partially) overlapping grads.
    arena = Buf(static_cast<size_t>(2 * N * V) * 4);
    poison_all(arena, FCE_FLOAT32);
    write_mat(arena, mat(FCE_FLOAT32, N, V), random_logits(rng, FCE_FLOAT32, N, V));
    arena.push();
    targets = targets_buf(random_targets(rng, N, V), FCE_INT64);
    weights = f32_buf(random_uniform(rng, V, 0.5, 1.5));
    gout = f32_buf({1.0});
    loss = poisoned(vec(FCE_FLOAT32, 1));
    lse = poisoned(vec(FCE_FLOAT32, N));
    lse_in = f32_buf(std::vector<double>(N, 5.0));
    zl = poisoned(vec(FCE_FLOAT32, 1));
    grad = poisoned(mat(FCE_FLOAT32, N, V));
    flags = Buf(4, 0xA5);
    flags.push();
    am = poisoned(vec(FCE_INT64, N));
    acc = poisoned(vec(FCE_FLOAT32, N));
    a.o = test_options();
    a.o.class_weights = weights.p<float>();
    size_t wf = 0, wb = 0;
    ASSERT_EQ(fce_forward_workspace_size(&a.o, N, V, &wf), FCE_SUCCESS) << fce_last_error();
    ASSERT_EQ(fce_backward_workspace_size(&a.o, N, V, &wb), FCE_SUCCESS) << fce_last_error();
    fwd_ws = wf;
    bwd_ws = wb;
    ws = workspace_buf(std::max(wf, wb) + 64);  // room for the misaligned-workspace case
    a.opts = &a.o;
    a.rows = N;
    a.vocab = V;
    a.logits = arena.ptr();
    a.targets = targets.ptr();
    a.loss = loss.p<float>();
    a.lse = lse.p<float>();
    a.z_loss = zl.p<float>();
    a.grad = grad.ptr();
    a.gout = gout.p<float>();
    a.flags = flags.p<uint32_t>();
    a.ws = ws.ptr();
    a.wsb = wf;
  }
  fce_status forward(const FwdArgs& x) {
    return flat::forward(x.opts, x.rows, x.vocab, x.logits, x.targets, x.loss, x.lse, x.z_loss,
                       x.grad, x.gout, x.flags, x.ws, x.wsb, test_stream());
  }
  // fce_backward reads lse (lse_in here) and writes grad.
  fce_status backward(const FwdArgs& x) {
    return flat::backward(x.opts, x.rows, x.vocab, x.logits, x.targets, x.lse, x.gout, x.grad,
                        x.flags, x.ws, x.wsb, test_stream());
  }
  FwdArgs backward_args() {
    FwdArgs b = a;
    b.lse = lse_in.p<float>();
    b.wsb = bwd_ws;
    return b;
  }
  void expect_rejected(bool is_forward, const char* what, fce_status expected, const char* names,
                       const std::function<void(FwdArgs&)>& mutate) {
    const char* fn = is_forward ? "fce_forward" : "fce_backward";
    SCOPED_TRACE(std::string(fn) + " bad input: " + what);
    FwdArgs x = is_forward ? a : backward_args();
    mutate(x);
    if (x.opts == &a.o) x.opts = &x.o;
    std::vector<Buf*> bufs = {&arena, &targets, &weights, &gout, &loss, &lse, &lse_in, &zl, &grad, &flags,
                              &am, &acc};
    std::vector<std::vector<uint8_t>> before;
    for (Buf* b : bufs) before.push_back(b->mirror());
    fce_status st = is_forward ? forward(x) : backward(x);
    EXPECT_EQ(st, expected) << "got " << fce_status_string(st) << " (\"" << fce_last_error() << "\")";
    EXPECT_TRUE(error_mentions(names));
    EXPECT_TRUE(error_mentions(fn));
    EXPECT_TRUE(finish());
    for (size_t i = 0; i < bufs.size(); ++i) {
      bufs[i]->pull();
      EXPECT_TRUE(unchanged(*bufs[i], before[i], "a buffer of the rejected call"));
    }
  }
  void fwd(const char* what, fce_status st, const char* names, const std::function<void(FwdArgs&)>& m) {
    expect_rejected(true, what, st, names, m);
  }
  void bwd(const char* what, fce_status st, const char* names, const std::function<void(FwdArgs&)>& m) {
    expect_rejected(false, what, st, names, m);
  }
  Buf arena, targets, weights, gout, loss, lse, lse_in, zl, grad, flags, ws, am, acc;
  size_t fwd_ws = 0, bwd_ws = 0;
  FwdArgs a;
};

constexpr float kNaNf = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TEST_F(BadInput, ValidBaselineSucceeds) {
  FwdArgs x = a;
  x.opts = &x.o;
  ASSERT_EQ(forward(x), FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
  FwdArgs y = backward_args();
  y.opts = &y.o;
  ASSERT_EQ(backward(y), FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
}

TEST_F(BadInput, NullPointers) {
  fwd("options NULL", FCE_ERROR_NULL_POINTER, "options", [](FwdArgs& x) { x.opts = nullptr; });
  fwd("logits NULL", FCE_ERROR_NULL_POINTER, "logits", [](FwdArgs& x) { x.logits = nullptr; });
  fwd("targets NULL", FCE_ERROR_NULL_POINTER, "targets", [](FwdArgs& x) { x.targets = nullptr; });
  fwd("loss NULL", FCE_ERROR_NULL_POINTER, "loss", [](FwdArgs& x) { x.loss = nullptr; });
  if (fwd_ws > 0)
    fwd("workspace NULL with bytes", FCE_ERROR_NULL_POINTER, "workspace", [](FwdArgs& x) { x.ws = nullptr; });
  bwd("options NULL", FCE_ERROR_NULL_POINTER, "options", [](FwdArgs& x) { x.opts = nullptr; });
  bwd("logits NULL", FCE_ERROR_NULL_POINTER, "logits", [](FwdArgs& x) { x.logits = nullptr; });
  bwd("targets NULL", FCE_ERROR_NULL_POINTER, "targets", [](FwdArgs& x) { x.targets = nullptr; });
  bwd("lse NULL", FCE_ERROR_NULL_POINTER, "lse", [](FwdArgs& x) { x.lse = nullptr; });
  bwd("grad_logits NULL", FCE_ERROR_NULL_POINTER, "grad_logits", [](FwdArgs& x) { x.grad = nullptr; });
}

TEST_F(BadInput, Sizes) {
  for (bool f : {true, false}) {
    expect_rejected(f, "rows -1", FCE_ERROR_INVALID_ARGUMENT, "rows", [](FwdArgs& x) { x.rows = -1; });
    expect_rejected(f, "vocab 0", FCE_ERROR_INVALID_ARGUMENT, "vocab", [](FwdArgs& x) { x.vocab = 0; });
    expect_rejected(f, "vocab -16", FCE_ERROR_INVALID_ARGUMENT, "vocab", [](FwdArgs& x) { x.vocab = -16; });
    expect_rejected(f, "vocab 2^31", FCE_ERROR_INVALID_ARGUMENT, "vocab",
                    [](FwdArgs& x) { x.vocab = int64_t{1} << 31; x.rows = 1; });
    expect_rejected(f, "row_stride < vocab", FCE_ERROR_INVALID_ARGUMENT, "row_stride",
                    [](FwdArgs& x) { x.o.row_stride = V - 1; });
    expect_rejected(f, "row_stride negative", FCE_ERROR_INVALID_ARGUMENT, "row_stride",
                    [](FwdArgs& x) { x.o.row_stride = -1; });
    expect_rejected(f, "grad_row_stride < vocab", FCE_ERROR_INVALID_ARGUMENT, "grad_row_stride",
                    [](FwdArgs& x) { x.o.grad_row_stride = V - 1; });
  }
}

// Sizes whose byte counts overflow 64 bits: refused before any memory is touched.
TEST_F(BadInput, OverflowingSizes) {
  for (bool f : {true, false}) {
    expect_rejected(f, "rows * vocab overflowing", FCE_ERROR_INVALID_ARGUMENT, "rows|vocab|row_stride",
                    [](FwdArgs& x) { x.rows = int64_t{1} << 62; x.o.row_stride = int64_t{1} << 30; x.vocab = 16; });
    expect_rejected(f, "row_stride overflowing", FCE_ERROR_INVALID_ARGUMENT, "rows|vocab|row_stride",
                    [](FwdArgs& x) { x.o.row_stride = INT64_MAX; });
  }
}

TEST_F(BadInput, Enums) {
  for (bool f : {true, false}) {
    expect_rejected(f, "dtype 7", FCE_ERROR_INVALID_ARGUMENT, "dtype", [](FwdArgs& x) { x.o.dtype = 7; });
    expect_rejected(f, "dtype -1", FCE_ERROR_INVALID_ARGUMENT, "dtype", [](FwdArgs& x) { x.o.dtype = -1; });
    expect_rejected(f, "dtype int32", FCE_ERROR_INVALID_ARGUMENT, "dtype", [](FwdArgs& x) { x.o.dtype = FCE_INT32; });
    expect_rejected(f, "dtype int64", FCE_ERROR_INVALID_ARGUMENT, "dtype", [](FwdArgs& x) { x.o.dtype = FCE_INT64; });
    expect_rejected(f, "target_dtype -1", FCE_ERROR_INVALID_ARGUMENT, "target_dtype",
                    [](FwdArgs& x) { x.o.target_dtype = -1; });
    expect_rejected(f, "target_dtype 5", FCE_ERROR_INVALID_ARGUMENT, "target_dtype",
                    [](FwdArgs& x) { x.o.target_dtype = 5; });
    expect_rejected(f, "reduction 3", FCE_ERROR_INVALID_ARGUMENT, "reduction", [](FwdArgs& x) { x.o.reduction = 3; });
    expect_rejected(f, "reduction -1", FCE_ERROR_INVALID_ARGUMENT, "reduction", [](FwdArgs& x) { x.o.reduction = -1; });
    expect_rejected(f, "backend 2", FCE_ERROR_INVALID_ARGUMENT, "backend", [](FwdArgs& x) { x.o.backend = 2; });
    expect_rejected(f, "backend -1", FCE_ERROR_INVALID_ARGUMENT, "backend", [](FwdArgs& x) { x.o.backend = -1; });
  }
}

TEST_F(BadInput, ScalarOptions) {
  for (bool f : {true, false}) {
    for (float e : {-0.01f, 1.0f, 1.5f, kNaNf})
      expect_rejected(f, ("label_smoothing " + std::to_string(e)).c_str(), FCE_ERROR_INVALID_ARGUMENT,
                      "label_smoothing", [e](FwdArgs& x) { x.o.label_smoothing = e; });
    for (float c : {-1.0f, -1e-30f, kNaNf})
      expect_rejected(f, ("softcap " + std::to_string(c)).c_str(), FCE_ERROR_INVALID_ARGUMENT, "softcap",
                      [c](FwdArgs& x) { x.o.softcap = c; });
    for (float l : {-1e-3f, kNaNf})
      expect_rejected(f, ("z_loss_scale " + std::to_string(l)).c_str(), FCE_ERROR_INVALID_ARGUMENT,
                      "z_loss_scale", [l](FwdArgs& x) { x.o.z_loss_scale = l; });
    for (float s : {kInf, -kInf, kNaNf})
      expect_rejected(f, ("logit_scale " + std::to_string(s)).c_str(), FCE_ERROR_INVALID_ARGUMENT,
                      "logit_scale", [s](FwdArgs& x) { x.o.logit_scale = s; });
    for (int64_t t : {int64_t{3}, int64_t{5}, int64_t{16}, int64_t{-1}})
      expect_rejected(f, ("shift_seq_len " + std::to_string(t) + " with rows 8").c_str(),
                      FCE_ERROR_INVALID_ARGUMENT, "shift_seq_len",
                      [t](FwdArgs& x) { x.o.shift_seq_len = t; });
    // Sizes of no version: too small, the 0.x structs' (104, 136: refused since 1.0), larger
    // than this library's.
    for (size_t sz : {size_t{0}, size_t{8}, size_t{104}, size_t{136}, sizeof(fce_options) - 4,
                      sizeof(fce_options) + 8})
      expect_rejected(f, ("struct_size " + std::to_string(sz)).c_str(), FCE_ERROR_INVALID_ARGUMENT,
                      "struct_size", [sz](FwdArgs& x) { x.o.struct_size = sz; });
    expect_rejected(f, "vp_entropy != 0", FCE_ERROR_INVALID_ARGUMENT, "options->vp_entropy",
                    [](FwdArgs& x) { x.o.vp_entropy = 1; });
    // shift: k >= 0, and only with a sequence length.
    expect_rejected(f, "shift -1", FCE_ERROR_INVALID_ARGUMENT, "options->shift",
                    [](FwdArgs& x) { x.o.shift_seq_len = 4; x.o.shift = -1; });
    expect_rejected(f, "shift INT64_MIN", FCE_ERROR_INVALID_ARGUMENT, "options->shift",
                    [](FwdArgs& x) { x.o.shift_seq_len = 4; x.o.shift = INT64_MIN; });
    expect_rejected(f, "shift 2 without shift_seq_len", FCE_ERROR_INVALID_ARGUMENT,
                    "options->shift", [](FwdArgs& x) { x.o.shift = 2; });
    expect_rejected(f, "shift 1 without shift_seq_len", FCE_ERROR_INVALID_ARGUMENT,
                    "options->shift", [](FwdArgs& x) { x.o.shift = 1; });
  }
}

TEST_F(BadInput, Misaligned) {
  auto off = [](const void* p, int n) { return static_cast<const char*>(p) + n; };
  fwd("logits +1 byte", FCE_ERROR_MISALIGNED, "logits", [&](FwdArgs& x) { x.logits = off(x.logits, 1); });
  fwd("logits +2 bytes (float32)", FCE_ERROR_MISALIGNED, "logits", [&](FwdArgs& x) { x.logits = off(x.logits, 2); });
  fwd("bfloat16 logits +1 byte", FCE_ERROR_MISALIGNED, "logits",
      [&](FwdArgs& x) { x.o.dtype = FCE_BFLOAT16; x.logits = off(x.logits, 1); x.grad = nullptr; });
  fwd("float16 logits +1 byte", FCE_ERROR_MISALIGNED, "logits",
      [&](FwdArgs& x) { x.o.dtype = FCE_FLOAT16; x.logits = off(x.logits, 1); x.grad = nullptr; });
  fwd("int64 targets +4 bytes", FCE_ERROR_MISALIGNED, "targets", [&](FwdArgs& x) { x.targets = off(x.targets, 4); });
  fwd("int32 targets +2 bytes", FCE_ERROR_MISALIGNED, "targets",
      [&](FwdArgs& x) { x.o.target_dtype = FCE_INT32; x.targets = off(x.targets, 2); });
  fwd("loss +1 byte", FCE_ERROR_MISALIGNED, "loss", [&](FwdArgs& x) { x.loss = (float*)off(x.loss, 1); });
  fwd("lse +2 bytes", FCE_ERROR_MISALIGNED, "lse", [&](FwdArgs& x) { x.lse = (float*)off(x.lse, 2); });
  fwd("z_loss +1 byte", FCE_ERROR_MISALIGNED, "z_loss", [&](FwdArgs& x) { x.z_loss = (float*)off(x.z_loss, 1); });
  fwd("grad_logits +2 bytes", FCE_ERROR_MISALIGNED, "grad_logits", [&](FwdArgs& x) { x.grad = (void*)off(x.grad, 2); });
  fwd("class_weights +1 byte", FCE_ERROR_MISALIGNED, "class_weights",
      [&](FwdArgs& x) { x.o.class_weights = (const float*)off(x.o.class_weights, 1); });
  fwd("grad_output +1 byte", FCE_ERROR_MISALIGNED, "grad_output", [&](FwdArgs& x) { x.gout = (const float*)off(x.gout, 1); });
  fwd("error_flags +1 byte", FCE_ERROR_MISALIGNED, "error_flags", [&](FwdArgs& x) { x.flags = (uint32_t*)off(x.flags, 1); });
  fwd("outputs->argmax +4 bytes", FCE_ERROR_MISALIGNED, "outputs->argmax",
      [&](FwdArgs& x) { x.o.argmax = (int64_t*)off(am.ptr(), 4); });
  fwd("outputs->argmax +1 byte", FCE_ERROR_MISALIGNED, "outputs->argmax",
      [&](FwdArgs& x) { x.o.argmax = (int64_t*)off(am.ptr(), 1); });
  fwd("outputs->accuracy +2 bytes", FCE_ERROR_MISALIGNED, "outputs->accuracy",
      [&](FwdArgs& x) { x.o.accuracy = (float*)off(acc.ptr(), 2); });
  if (fwd_ws > 0)
    fwd("workspace +8 bytes", FCE_ERROR_MISALIGNED, "workspace", [&](FwdArgs& x) { x.ws = (void*)off(x.ws, 8); });
  bwd("lse +1 byte", FCE_ERROR_MISALIGNED, "lse", [&](FwdArgs& x) { x.lse = (float*)off(x.lse, 1); });
  bwd("logits +1 byte", FCE_ERROR_MISALIGNED, "logits", [&](FwdArgs& x) { x.logits = off(x.logits, 1); });
  bwd("grad_logits +1 byte", FCE_ERROR_MISALIGNED, "grad_logits", [&](FwdArgs& x) { x.grad = (void*)off(x.grad, 1); });
  if (bwd_ws > 0)
    bwd("workspace +8 bytes", FCE_ERROR_MISALIGNED, "workspace", [&](FwdArgs& x) { x.ws = (void*)off(x.ws, 8); });
}

TEST_F(BadInput, Workspace) {
  if (fwd_ws == 0 && bwd_ws == 0) {
    std::printf("SKIPPED: the forward and backward workspaces are 0 bytes on this backend\n");
    GTEST_SKIP() << "no workspace to make too small";
  }
  if (fwd_ws > 0) {
    fwd("workspace_bytes one short", FCE_ERROR_WORKSPACE_TOO_SMALL, "workspace",
        [this](FwdArgs& x) { x.wsb = fwd_ws - 1; });
    fwd("workspace_bytes 0", FCE_ERROR_WORKSPACE_TOO_SMALL, "workspace", [](FwdArgs& x) { x.wsb = 0; });
  }
  if (bwd_ws > 0)
    bwd("workspace_bytes one short", FCE_ERROR_WORKSPACE_TOO_SMALL, "workspace",
        [this](FwdArgs& x) { x.wsb = bwd_ws - 1; });
}

TEST_F(BadInput, Overlap) {
  // grad_logits starting 3 elements into the logits: a partial overlap.
  for (bool f : {true, false}) {
    expect_rejected(f, "grad_logits partially over logits", FCE_ERROR_INVALID_ARGUMENT, "grad_logits",
                    [](FwdArgs& x) { x.grad = static_cast<float*>(const_cast<void*>(x.logits)) + 3; });
    expect_rejected(f, "grad_logits partially over logits (one row in)", FCE_ERROR_INVALID_ARGUMENT,
                    "grad_logits",
                    [](FwdArgs& x) { x.grad = static_cast<float*>(const_cast<void*>(x.logits)) + V; });
    // In place, but with another row stride.
    expect_rejected(f, "in place with grad_row_stride != row_stride", FCE_ERROR_INVALID_ARGUMENT,
                    "grad_row_stride|grad_logits", [](FwdArgs& x) {
                      x.grad = const_cast<void*>(x.logits);
                      x.o.row_stride = V;
                      x.o.grad_row_stride = V + 1;
                    });
  }
}

// The optional forward outputs overlapping another buffer (or each other).
TEST_F(BadInput, OverlapOfArgmaxAndAccuracy) {
  fwd("outputs->argmax over loss", FCE_ERROR_INVALID_ARGUMENT, "outputs->argmax",
      [](FwdArgs& x) { x.o.argmax = reinterpret_cast<int64_t*>(x.loss); });
  fwd("outputs->argmax over the logits", FCE_ERROR_INVALID_ARGUMENT, "outputs->argmax",
      [](FwdArgs& x) { x.o.argmax = static_cast<int64_t*>(const_cast<void*>(x.logits)) + 5; });
  fwd("outputs->argmax over targets", FCE_ERROR_INVALID_ARGUMENT, "outputs->argmax",
      [](FwdArgs& x) { x.o.argmax = static_cast<int64_t*>(const_cast<void*>(x.targets)); });
  fwd("outputs->accuracy inside lse", FCE_ERROR_INVALID_ARGUMENT, "outputs->accuracy",
      [](FwdArgs& x) { x.o.accuracy = x.lse + 2; });
  fwd("outputs->accuracy inside grad_logits", FCE_ERROR_INVALID_ARGUMENT, "outputs->accuracy",
      [](FwdArgs& x) { x.o.accuracy = static_cast<float*>(x.grad) + 7; });
  fwd("outputs->accuracy inside outputs->argmax", FCE_ERROR_INVALID_ARGUMENT,
      "outputs->accuracy", [this](FwdArgs& x) {
        x.o.argmax = am.p<int64_t>();
        x.o.accuracy = reinterpret_cast<float*>(am.p<int64_t>() + 3);
      });
  // Per row (none): accuracy is [rows]: one that starts inside it overlaps the next buffer.
  fwd("outputs->accuracy [rows] over z_loss", FCE_ERROR_INVALID_ARGUMENT, "outputs->accuracy",
      [](FwdArgs& x) {
        x.o.reduction = FCE_REDUCTION_NONE;
        x.gout = nullptr;
        x.loss = x.lse;  // [rows] for none
        x.lse = nullptr;
        x.o.accuracy = x.z_loss - (N - 1);
      });
}

// Since 0.3, grad_logits == logits (in place) is the one overlap allowed. Any other output at
// (or inside) the logits used to be let through when it started at the very same address as the
// logits, and was then written over by the gradient (or corrupted it): every one is an error
// now, for every entry point that takes logits.
TEST_F(BadInput, InPlaceRejectsOtherOutputsInsideTheLogits) {
  for (int red : {FCE_REDUCTION_NONE, FCE_REDUCTION_MEAN}) {
    auto in_place = [red](FwdArgs& x, bool forward) {
      x.o.reduction = red;
      if (red == FCE_REDUCTION_NONE) {
        x.gout = nullptr;
        if (forward) x.loss = x.lse, x.lse = nullptr;  // loss [rows]
      }
      x.grad = const_cast<void*>(x.logits);
    };
    float* const z = static_cast<float*>(arena.ptr());
    const struct {
      const char* name;
      std::function<void(FwdArgs&)> put;
    } outputs[] = {
        {"loss", [z](FwdArgs& x) { x.loss = z; }},
        {"lse", [z](FwdArgs& x) { x.lse = z; }},
        {"z_loss", [z](FwdArgs& x) { x.z_loss = z; }},
        {"error_flags", [z](FwdArgs& x) { x.flags = reinterpret_cast<uint32_t*>(z); }},
        {"outputs->argmax", [z](FwdArgs& x) { x.o.argmax = reinterpret_cast<int64_t*>(z); }},
        {"outputs->accuracy", [z](FwdArgs& x) { x.o.accuracy = z; }},
        {"loss", [z](FwdArgs& x) { x.loss = z + V + 1; }},  // inside, not at the start
    };
    for (const auto& out : outputs) {
      const std::string what = std::string(out.name) + " in the logits, grad_logits == logits (" +
                               reduction_name(red) + ")";
      fwd(what.c_str(), FCE_ERROR_INVALID_ARGUMENT, out.name, [&](FwdArgs& x) {
        in_place(x, true);
        out.put(x);
      });
      EXPECT_TRUE(error_mentions("overlaps"));
    }
    // fce_backward: its error flags, or the saved lse it reads, at the logits it writes over.
    bwd(("error_flags at the logits, in place (" + std::string(reduction_name(red)) + ")").c_str(),
        FCE_ERROR_INVALID_ARGUMENT, "error_flags", [&](FwdArgs& x) {
          in_place(x, false);
          x.flags = reinterpret_cast<uint32_t*>(z);
        });
    bwd(("lse at the logits, in place (" + std::string(reduction_name(red)) + ")").c_str(),
        FCE_ERROR_INVALID_ARGUMENT, "lse", [&](FwdArgs& x) {
          in_place(x, false);
          x.lse = z;
        });
  }
  // The plain in-place call is still fine (every other output elsewhere).
  FwdArgs x = a;
  x.opts = &x.o;
  x.grad = const_cast<void*>(x.logits);
  ASSERT_EQ(forward(x), FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
}

// (test_ce.cpp checks the numbers); here only that the call succeeds.
TEST_F(BadInput, OutOfRangeTargetIsNotAnArgumentError) {
  std::vector<int64_t> y(N, 1);
  y[3] = V + 5;
  Buf t = targets_buf(y, FCE_INT64);
  FwdArgs x = a;
  x.opts = &x.o;
  x.targets = t.ptr();
  Buf f(4, 0);
  x.flags = f.p<uint32_t>();
  ASSERT_EQ(forward(x), FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
  f.pull();
  uint32_t v;
  std::memcpy(&v, f.h(), 4);
  EXPECT_EQ(v, FCE_FLAG_TARGET_OUT_OF_RANGE);
}

// ------------------------------------------------------- outputs, gradients, shard ----------
// The structures themselves, on the CPU backend: their NULL pointers, their struct_size, and the
// fields a call does not take (refused, never silently ignored). The suites' flat calls
// (flat_calls.h) always pass well-formed structures; these go to the C calls directly.
class Structs : public ::testing::Test {
 protected:
  static constexpr int64_t N = 4, V = 8, D = 3;
  std::vector<float> z = std::vector<float>(N * V, 0.25f), lse = std::vector<float>(N, 0.0f);
  std::vector<float> h = std::vector<float>(N * D, 0.5f), w = std::vector<float>(V * D, 0.125f);
  std::vector<float> grad = std::vector<float>(N * V, 0.0f), gh = std::vector<float>(N * D, 0.0f);
  std::vector<float> stats = std::vector<float>(N * FCE_VP_STATS, 0.0f);
  std::vector<int64_t> y = {1, 2, 3, 4}, am = std::vector<int64_t>(N, -7);
  float loss = -1.0f;
  fce_options o = FCE_OPTIONS_INIT;
  fce_outputs out = FCE_OUTPUTS_INIT;
  fce_gradients g = FCE_GRADIENTS_INIT;
  void SetUp() override {
    o.backend = FCE_BACKEND_CPU;
    out.loss = &loss;
  }
  fce_status forward(const fce_outputs* po, const fce_gradients* pg) {
    return fce_forward(&o, N, V, z.data(), y.data(), po, pg, nullptr, 0, nullptr);
  }
  fce_status backward(const fce_outputs* po, const fce_gradients* pg) {
    return fce_backward(&o, N, V, z.data(), y.data(), lse.data(), po, pg, nullptr, 0, nullptr);
  }
  fce_status linear(const fce_outputs* po, const fce_gradients* pg) {
    size_t mn = 0;
    EXPECT_EQ(fce_linear_ce_workspace_size(&o, N, D, V, 1, &mn, nullptr), FCE_SUCCESS);
    ws.assign(mn, 0);
    return fce_linear_ce(&o, N, D, V, h.data(), w.data(), nullptr, y.data(), po, pg, ws.data(),
                         ws.size(), nullptr);
  }
  std::vector<unsigned char> ws;
};

TEST_F(Structs, OutputsAndGradientsArePassedByStructure) {
  // The loss only (gradients NULL), with argmax from outputs; then the gradient in the same pass.
  out.argmax = am.data();
  ASSERT_EQ(forward(&out, nullptr), FCE_SUCCESS) << fce_last_error();
  EXPECT_NEAR(loss, std::log(double(V)), 1e-6);  // constant logits: log V
  for (int64_t r = 0; r < N; ++r) EXPECT_EQ(am[r], 0) << "row " << r;  // ties: lowest index
  g.grad_logits = grad.data();
  ASSERT_EQ(forward(&out, &g), FCE_SUCCESS) << fce_last_error();
  EXPECT_NEAR(grad[1], (1.0 / V - 1.0) / N, 1e-7);  // row 0, its target
  EXPECT_NEAR(grad[0], 1.0 / V / N, 1e-7);
}

TEST_F(Structs, NullStructures) {
  EXPECT_EQ(forward(nullptr, nullptr), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_forward: outputs is NULL"));
  EXPECT_EQ(linear(nullptr, nullptr), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_linear_ce: outputs is NULL"));
  // The gradient-only calls: outputs may be NULL (no error flags), gradients may not.
  g.grad_logits = grad.data();
  EXPECT_EQ(backward(nullptr, &g), FCE_SUCCESS) << fce_last_error();
  EXPECT_EQ(backward(nullptr, nullptr), FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_backward: gradients is NULL"));
  const fce_vp_shard sh{1, V, 0, V, nullptr, nullptr};
  EXPECT_EQ(fce_vp_stats(&o, nullptr, N, z.data(), y.data(), stats.data(), nullptr),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_stats: shard is NULL"));
  EXPECT_EQ(fce_vp_stats(&o, &sh, N, z.data(), y.data(), stats.data(), nullptr), FCE_SUCCESS)
      << fce_last_error();
  EXPECT_EQ(fce_vp_loss(&o, &sh, N, y.data(), stats.data(), nullptr, nullptr, 0, nullptr),
            FCE_ERROR_NULL_POINTER);
  EXPECT_TRUE(error_mentions("fce_vp_loss: outputs is NULL"));
  EXPECT_EQ(loss, -1.0f);  // nothing written by the refused calls
}

TEST_F(Structs, StructSizes) {
  out.struct_size = 8;
  EXPECT_EQ(forward(&out, nullptr), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(
      error_mentions("fce_forward: outputs->struct_size (8) is not the size of any version"));
  out.struct_size = sizeof out + 8;
  EXPECT_EQ(forward(&out, nullptr), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_forward: outputs->struct_size"));
  out.struct_size = sizeof out;
  g.struct_size = 0;
  EXPECT_EQ(forward(&out, &g), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(
      error_mentions("fce_forward: gradients->struct_size (0) is not the size of any version"));
  g.struct_size = sizeof g;
  o.struct_size = 136;  // a 0.3 caller's fce_options, argmax and accuracy inside: refused
  EXPECT_EQ(forward(&out, &g), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_forward: options->struct_size (136)"));
  o.struct_size = 104;
  EXPECT_EQ(forward(&out, &g), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_forward: options->struct_size (104) is not the size of any "
                             "version of fce_options"));
  EXPECT_EQ(loss, -1.0f);
}

TEST_F(Structs, FieldsACallDoesNotTakeAreRefused) {
  g.grad_logits = grad.data();
  out.argmax = am.data();  // the gradient-only calls write error_flags alone
  EXPECT_EQ(backward(&out, &g), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_backward: outputs->loss is given"));
  fce_outputs only_argmax = FCE_OUTPUTS_INIT;
  only_argmax.argmax = am.data();
  EXPECT_EQ(backward(&only_argmax, &g), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_backward: outputs->argmax is given"));
  for (int64_t r = 0; r < N; ++r) EXPECT_EQ(am[r], -7);
  out.argmax = nullptr;
  g.grad_hidden = gh.data();  // a linear-layer gradient to a call over logits
  EXPECT_EQ(forward(&out, &g), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_forward: gradients->grad_hidden is given"));
  g.grad_hidden = nullptr;  // grad_logits to fce_linear_ce
  EXPECT_EQ(linear(&out, &g), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_linear_ce: gradients->grad_logits is given"));
  g.grad_logits = nullptr;
  g.grad_hidden = gh.data();
  g.grad_hidden_dtype = FCE_FLOAT16;  // read by the fce_vp_linear_* calls only
  EXPECT_EQ(linear(&out, &g), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_linear_ce: gradients->grad_hidden_dtype (1)"));
  g.grad_hidden_dtype = FCE_FLOAT32;
  g.reserved0 = 3;
  EXPECT_EQ(linear(&out, &g), FCE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_mentions("fce_linear_ce: gradients->reserved0"));
  g.reserved0 = 0;
  EXPECT_EQ(loss, -1.0f);
  ASSERT_EQ(linear(&out, &g), FCE_SUCCESS) << fce_last_error();
  EXPECT_NEAR(loss, std::log(double(V)), 1e-6);  // every weight row equal: constant logits
}

}  // namespace
