// nccl_cases.h — the cases of test_nccl.cpp and their machinery: the communicator, device
// memory, the cross-entropy, linear and distillation cases (data, options, the calls on the
// device, graph replays), and the comparisons with the unsharded calls.
#pragma once

#include <nccl.h>

#include <thread>

#include "fusedce_nccl.h"
#include "test_util.h"

// The suites' flat argument lists of the calls (flat_calls.h does the same for libfusedce's):
// packed into fce_vp_shard, fce_outputs and fce_gradients here; shard->ranks is the communicator's.
namespace flat {

inline int64_t comm_ranks(ncclComm_t comm) {
  int n = 0;
  if (comm && ncclCommCount(comm, &n) != ncclSuccess) n = 0;
  return n;
}

// A shard on comm (fce_nccl_shard, which puts the communicator in it) with these sizes written
// over the ones fce_nccl_shard checked, so that the calls' own checks see them; NULL without a
// communicator.
inline const fce_vp_shard* comm_shard(ncclComm_t comm, int64_t vocab_total, int64_t vocab_start,
                                      int64_t vocab_local, fce_vp_shard* sh) {
  if (!comm || fce_nccl_shard(comm, 1, 0, 1, sh) != FCE_SUCCESS) return nullptr;
  sh->vocab_total = vocab_total;
  sh->vocab_start = vocab_start;
  sh->vocab_local = vocab_local;
  return sh;
}

inline fce_status nccl_ce_ws(const TestOptions* o, ncclComm_t comm, int64_t rows,
                             int64_t vocab_total, int64_t vocab_local, int with_grad,
                             size_t* workspace_bytes) {
  fce_vp_shard sh{};
  return fce_nccl_cross_entropy_workspace_size(
      o, comm_shard(comm, vocab_total, 0, vocab_local, &sh), rows, with_grad, workspace_bytes);
}

inline fce_status nccl_linear_ws(const TestOptions* o, ncclComm_t comm, int64_t rows,
                                 int64_t hidden, int64_t vocab_total, int64_t vocab_local,
                                 int with_grad, size_t* min_bytes, size_t* optimal_bytes) {
  fce_vp_shard sh{};
  return fce_nccl_linear_ce_workspace_size(o, comm_shard(comm, vocab_total, 0, vocab_local, &sh),
                                           rows, hidden, with_grad, min_bytes, optimal_bytes);
}

inline fce_status nccl_cross_entropy(const TestOptions* o, ncclComm_t comm, int64_t rows,
                                     int64_t vocab_total, int64_t vocab_start,
                                     int64_t vocab_local, const void* logits, const void* targets,
                                     float* loss, float* lse, float* z_loss, void* grad_logits,
                                     const float* grad_output, uint32_t* error_flags,
                                     void* workspace, size_t workspace_bytes, void* stream) {
  fce_vp_shard sh{};
  const fce_vp_shard* shp = comm_shard(comm, vocab_total, vocab_start, vocab_local, &sh);
  const fce_outputs out = outputs(o, loss, lse, z_loss, error_flags);
  const fce_gradients g = logit_grads(grad_logits, grad_output);
  return fce_nccl_cross_entropy(o, shp, rows, logits, targets, &out,
                                grad_logits ? &g : nullptr, workspace, workspace_bytes, stream);
}

inline fce_status nccl_linear_ce(const TestOptions* o, ncclComm_t comm, int64_t rows,
                                 int64_t hidden, int64_t vocab_total, int64_t vocab_start,
                                 int64_t vocab_local, const void* hidden_states,
                                 const void* weight, const void* bias, const void* targets,
                                 float* loss, float* lse, float* z_loss, void* grad_hidden,
                                 void* grad_weight, void* grad_bias, const float* grad_output,
                                 uint32_t* error_flags, void* workspace, size_t workspace_bytes,
                                 void* stream) {
  fce_vp_shard sh{};
  const fce_vp_shard* shp = comm_shard(comm, vocab_total, vocab_start, vocab_local, &sh);
  const fce_outputs out = outputs(o, loss, lse, z_loss, error_flags);
  const fce_gradients g = linear_grads(grad_hidden, grad_weight, grad_bias, grad_output);
  return fce_nccl_linear_ce(o, shp, rows, hidden, hidden_states, weight, bias, targets,
                            &out, &g, workspace, workspace_bytes, stream);
}

inline fce_status nccl_distill_ws(const TestOptions* o, const fce_teacher* teacher, ncclComm_t comm,
                                  int64_t rows, int64_t vocab_total, int64_t vocab_local,
                                  int with_grad, size_t* workspace_bytes) {
  fce_vp_shard sh{};
  return fce_nccl_distill_workspace_size(o, teacher,
                                         comm_shard(comm, vocab_total, 0, vocab_local, &sh), rows,
                                         with_grad, workspace_bytes);
}

inline fce_status nccl_distill(const TestOptions* o, const fce_teacher* teacher, ncclComm_t comm,
                               int64_t rows, int64_t vocab_total, int64_t vocab_start,
                               int64_t vocab_local, const void* logits, const void* targets,
                               float* loss, float* lse, void* grad_logits, const float* grad_output,
                               uint32_t* error_flags, void* workspace, size_t workspace_bytes,
                               void* stream) {
  fce_vp_shard sh{};
  const fce_vp_shard* shp = comm_shard(comm, vocab_total, vocab_start, vocab_local, &sh);
  const fce_outputs out = outputs(o, loss, lse, nullptr, error_flags);
  const fce_gradients g = logit_grads(grad_logits, grad_output);
  return fce_nccl_distill(o, teacher, shp, rows, logits, targets, &out, grad_logits ? &g : nullptr,
                          workspace, workspace_bytes, stream);
}

}  // namespace flat

using namespace fcet;

namespace {

// ------------------------------------------------------------------ device and communicator --
int device_count() {
  static const int n = [] {
    int c = 0;
    if (cudaGetDeviceCount(&c) != cudaSuccess) {
      (void)cudaGetLastError();
      c = 0;
    }
    return c;
  }();
  return n;
}

#define REQUIRE_GPU()                                                                     \
  do {                                                                                    \
    if (device_count() == 0) {                                                            \
      std::printf("SKIPPED: test_nccl needs a CUDA device; none here\n");                 \
      GTEST_SKIP() << "no CUDA device";                                                   \
    }                                                                                     \
  } while (0)

#define NCCL_CHECK(expr)                                                                  \
  do {                                                                                    \
    ncclResult_t r_ = (expr);                                                             \
    if (r_ != ncclSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #expr,                \
                   ncclGetErrorString(r_));                                               \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)

ncclComm_t g_comm = nullptr;

// The one-rank communicator of device 0 (created on first use, destroyed after the last test).
ncclComm_t comm1() {
  if (!g_comm) {
    int dev = 0;
    FCE_CUDA_CHECK(cudaSetDevice(0));
    NCCL_CHECK(ncclCommInitAll(&g_comm, 1, &dev));
  }
  return g_comm;
}

class NcclEnvironment : public ::testing::Environment {
 public:
  void TearDown() override {
    if (g_comm) ncclCommDestroy(g_comm);
    g_comm = nullptr;
  }
};
::testing::Environment* const g_env = ::testing::AddGlobalTestEnvironment(new NcclEnvironment);

// ------------------------------------------------------------------ device memory ------------
// cudaMalloc'ed bytes on the current device; copies on `stream`, then a wait.
class Dev {
 public:
  Dev() = default;
  explicit Dev(size_t bytes, cudaStream_t s) : s_(s), n_(bytes) {
    if (bytes) FCE_CUDA_CHECK(cudaMalloc(&p_, bytes));
  }
  Dev(const std::vector<uint8_t>& h, cudaStream_t s) : Dev(h.size(), s) { upload(h); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  Dev(Dev&& o) noexcept { *this = std::move(o); }
  Dev& operator=(Dev&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    std::swap(s_, o.s_);
    return *this;
  }
  ~Dev() {
    if (p_) cudaFree(p_);
  }
  void* ptr() const { return p_; }
  template <class T> T* p() const { return static_cast<T*>(p_); }
  size_t size() const { return n_; }
  void upload(const std::vector<uint8_t>& h) {
    if (!n_) return;
    FCE_CUDA_CHECK(cudaMemcpyAsync(p_, h.data(), std::min(n_, h.size()), cudaMemcpyHostToDevice, s_));
    FCE_CUDA_CHECK(cudaStreamSynchronize(s_));
  }
  void fill(uint8_t b) {
    if (!n_) return;
    FCE_CUDA_CHECK(cudaMemsetAsync(p_, b, n_, s_));
    FCE_CUDA_CHECK(cudaStreamSynchronize(s_));
  }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> h(n_);
    if (!n_) return h;
    FCE_CUDA_CHECK(cudaStreamSynchronize(s_));
    FCE_CUDA_CHECK(cudaMemcpyAsync(h.data(), p_, n_, cudaMemcpyDeviceToHost, s_));
    FCE_CUDA_CHECK(cudaStreamSynchronize(s_));
    return h;
  }

 private:
  cudaStream_t s_ = nullptr;
  void* p_ = nullptr;
  size_t n_ = 0;
};

std::vector<uint8_t> encode(int dtype, const std::vector<double>& v) {
  std::vector<uint8_t> b(v.size() * dtype_size(dtype));
  for (size_t i = 0; i < v.size(); ++i) put(dtype, b.data() + i * dtype_size(dtype), v[i]);
  return b;
}
std::vector<double> decode(int dtype, const std::vector<uint8_t>& b) {
  std::vector<double> v(b.size() / dtype_size(dtype));
  for (size_t i = 0; i < v.size(); ++i) v[i] = get(dtype, b.data() + i * dtype_size(dtype));
  return v;
}
std::vector<uint8_t> encode_targets(int tdtype, const std::vector<int64_t>& y) {
  std::vector<double> d(y.begin(), y.end());
  return encode(tdtype, d);
}

constexpr uint8_t kPoisonByte = 0xFF;   // float32 / bfloat16 NaN
constexpr uint8_t kArgmaxPoison = 0xBA; // an int64 that is no index and not -1

cudaStream_t stream0() { return cuda_stream(); }  // test_util.h: non-blocking, device 0

// Tolerances: float32 outputs of two float32 computations of the same math (docs/semantics.md's 1e-5);
// 16-bit gradients: each rounded once to the dtype (test_util.h: 4 unit roundoffs).
constexpr double kTolF32 = 1e-5;
double grad_tol(int dtype) { return dtype == FCE_FLOAT32 ? kTolF32 : tolerance(dtype); }

::testing::AssertionResult ok(fce_status s, const char* what) {
  if (s == FCE_SUCCESS) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << fce_status_string(s) << " (\""
                                       << fce_nccl_last_error() << "\" / core: \""
                                       << fce_last_error() << "\")";
}

// ------------------------------------------------------------------ cross-entropy -----------
struct CeCase {
  std::string name;
  int dtype = FCE_FLOAT32;
  int tdtype = FCE_INT64;
  int reduction = FCE_REDUCTION_MEAN;
  float eps = 0, lambda = 0, softcap = 0, scale = 1;
  bool weights = false;
  double ignore = 0;
  bool argmax = false;  // outputs->argmax and ->accuracy
  bool grad = true;
  bool in_place = false;
  int64_t N = 64, V = 1003;
  uint64_t seed = 1;
};

std::string label(const CeCase& c) {
  std::ostringstream s;
  s << c.name << " [" << dtype_name(c.dtype) << " " << reduction_name(c.reduction) << " N=" << c.N
    << " V=" << c.V << "]";
  return s.str();
}

// The host data of a case (test_util.h's CeData: z, y, w, g).
CeData ce_data(const CeCase& c) {
  std::mt19937_64 rng(c.seed);
  CeData d;
  d.z = random_logits(rng, c.dtype, c.N, c.V, 1.0, 6.0, 5.0);
  d.y = random_targets(rng, c.N, c.V, c.ignore, -100);
  if (c.weights) d.w = random_uniform(rng, static_cast<size_t>(c.V), 0.5, 2.0);
  d.g = random_uniform(rng, c.reduction == FCE_REDUCTION_NONE ? static_cast<size_t>(c.N) : 1,
                       0.5, 1.5);
  return d;
}

TestOptions ce_options(const CeCase& c) {
  TestOptions o = FCE_OPTIONS_INIT;
  o.backend = FCE_BACKEND_CUDA;
  o.dtype = c.dtype;
  o.target_dtype = c.tdtype;
  o.reduction = c.reduction;
  o.label_smoothing = c.eps;
  o.z_loss_scale = c.lambda;
  o.softcap = c.softcap;
  o.logit_scale = c.scale;
  return o;
}

// What one call wrote, downloaded.
struct CeOut {
  std::vector<uint8_t> loss, lse, z_loss, grad, argmax, accuracy, flags;
};

// The inputs on the device, and the outputs of one call.
struct CeDev {
  Dev z, y, w, g;
  Dev loss, lse, zl, grad, argmax, acc, flags, ws;
  void poison() {
    for (Dev* d : {&loss, &lse, &zl, &grad, &acc}) d->fill(kPoisonByte);
    argmax.fill(kArgmaxPoison);
    flags.fill(0);
    ws.fill(0xFF);
  }
  CeOut download(bool in_place) const {
    return {loss.download(), lse.download(), zl.download(),
            in_place ? z.download() : grad.download(), argmax.download(), acc.download(),
            flags.download()};
  }
};

CeDev ce_alloc(const CeCase& c, const CeData& d, cudaStream_t s) {
  CeDev b;
  const size_t N = static_cast<size_t>(c.N), V = static_cast<size_t>(c.V);
  b.z = Dev(encode(c.dtype, d.z), s);
  b.y = Dev(encode_targets(c.tdtype, d.y), s);
  if (c.weights) b.w = Dev(encode(FCE_FLOAT32, d.w), s);
  b.g = Dev(encode(FCE_FLOAT32, d.g), s);
  const bool none = c.reduction == FCE_REDUCTION_NONE;
  b.loss = Dev((none ? N : 1) * 4, s);
  b.lse = Dev(N * 4, s);
  b.zl = Dev(4, s);
  if (c.grad && !c.in_place) b.grad = Dev(N * V * dtype_size(c.dtype), s);
  b.argmax = Dev(N * 8, s);
  b.acc = Dev((none ? N : 1) * 4, s);
  b.flags = Dev(4, s);
  return b;
}

// The unsharded reference: fce_forward (one pass, with the gradient when asked).
::testing::AssertionResult ce_reference(const CeCase& c, const CeData& d, CeOut* out) {
  cudaStream_t s = stream0();
  CeCase rc = c;
  rc.in_place = false;
  CeDev b = ce_alloc(rc, d, s);
  TestOptions o = ce_options(c);
  o.class_weights = c.weights ? b.w.p<float>() : nullptr;
  if (c.argmax) {
    o.argmax = b.argmax.p<int64_t>();
    o.accuracy = b.acc.p<float>();
  }
  size_t wsb = 0;
  fce_status st = fce_forward_workspace_size(&o, c.N, c.V, &wsb);
  if (st != FCE_SUCCESS) return ok(st, "fce_forward_workspace_size");
  b.ws = Dev(wsb, s);
  b.poison();
  st = flat::forward(&o, c.N, c.V, b.z.ptr(), b.y.ptr(), b.loss.p<float>(), b.lse.p<float>(),
                   b.zl.p<float>(), c.grad ? b.grad.ptr() : nullptr, b.g.p<float>(),
                   b.flags.p<uint32_t>(), b.ws.ptr(), wsb, s);
  if (st != FCE_SUCCESS) return ok(st, "fce_forward (reference)");
  auto f = finish();
  if (!f) return f;
  *out = b.download(false);
  return ::testing::AssertionSuccess();
}

// Every output's bits, in one order, for comparing a graph replay with the eager call (and
// bits(const LinOut&) beside LinOut).
std::vector<std::vector<uint8_t>> bits(const CeOut& o) {
  return {o.loss, o.lse, o.z_loss, o.grad, o.argmax, o.accuracy, o.flags};
}

// After an eager call that gave `eager`: capture the same call on stream s (thread-local
// capture mode: with several ranks, the other ranks' threads go on calling CUDA meanwhile),
// then poison the outputs and replay twice; every replay must give the eager bits (`download`
// reads them back). Empty on success, else what failed.
template <class Call, class Poison, class Download>
std::string replay_matches(cudaStream_t s, Call call, Poison poison, Download download,
                           const std::vector<std::vector<uint8_t>>& eager) {
  cudaGraph_t g = nullptr;
  cudaGraphExec_t ge = nullptr;
  if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
    return "cudaStreamBeginCapture";
  const fce_status st = call();
  const cudaError_t ce = cudaStreamEndCapture(s, &g);
  if (st != FCE_SUCCESS) return std::string("during capture: ") + fce_nccl_last_error();
  if (ce != cudaSuccess) return std::string("capture invalidated: ") + cudaGetErrorString(ce);
  if (cudaGraphInstantiate(&ge, g, 0) != cudaSuccess) return "cudaGraphInstantiate";
  std::string err;
  for (int replay = 0; replay < 2 && err.empty(); ++replay) {
    poison();
    if (cudaGraphLaunch(ge, s) != cudaSuccess || cudaStreamSynchronize(s) != cudaSuccess)
      err = "graph launch";
    else if (download() != eager)
      err = "graph replay " + std::to_string(replay) + " differs from the eager call";
  }
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return err;
}

// The eager call `call` on stream s (its status, an empty message, no CUDA error), its outputs
// (`download`) into *out; with `graph`, then the replays of its capture (replay_matches). `what`
// names the call in a failure.
template <class Out, class Call, class Poison, class Download>
::testing::AssertionResult eager_and_replays(const char* what, cudaStream_t s, bool graph,
                                             Call call, Poison poison, Download download,
                                             Out* out) {
  const fce_status st = call();
  if (st != FCE_SUCCESS) return ok(st, what);
  if (fce_nccl_last_error()[0] != '\0')
    return ::testing::AssertionFailure()
           << what << ": a successful call left the message \"" << fce_nccl_last_error() << "\"";
  cudaError_t e = cudaStreamSynchronize(s);
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess)
    return ::testing::AssertionFailure()
           << what << ": CUDA error after the call: " << cudaGetErrorString(e);
  *out = download();
  if (!graph) return ::testing::AssertionSuccess();
  const std::string err = replay_matches(
      s, call, poison, [&] { return bits(download()); }, bits(*out));
  if (!err.empty()) return ::testing::AssertionFailure() << what << ": " << err;
  return ::testing::AssertionSuccess();
}

// fce_nccl_cross_entropy on the one-rank communicator; `graph`: after the eager call, capture
// the call in a CUDA graph, poison the outputs, replay twice and require the eager bits.
::testing::AssertionResult ce_nccl(const CeCase& c, const CeData& d, CeOut* out, bool graph) {
  if (graph && c.in_place) return ::testing::AssertionFailure() << "graph: not with in place";
  cudaStream_t s = stream0();
  ncclComm_t comm = comm1();
  CeDev b = ce_alloc(c, d, s);
  TestOptions o = ce_options(c);
  o.class_weights = c.weights ? b.w.p<float>() : nullptr;
  if (c.argmax) {
    o.argmax = b.argmax.p<int64_t>();
    o.accuracy = b.acc.p<float>();
  }
  size_t wsb = 0;
  fce_status st = flat::nccl_ce_ws(&o, comm, c.N, c.V, c.V, c.grad, &wsb);
  if (st != FCE_SUCCESS) return ok(st, "fce_nccl_cross_entropy_workspace_size");
  b.ws = Dev(wsb, s);
  b.poison();
  void* grad = c.grad ? (c.in_place ? b.z.ptr() : b.grad.ptr()) : nullptr;
  auto call = [&] {
    return flat::nccl_cross_entropy(&o, comm, c.N, c.V, 0, c.V, b.z.ptr(), b.y.ptr(),
                                  b.loss.p<float>(), b.lse.p<float>(), b.zl.p<float>(), grad,
                                  b.g.p<float>(), b.flags.p<uint32_t>(), b.ws.ptr(), wsb, s);
  };
  return eager_and_replays(
      "fce_nccl_cross_entropy", s, graph, call, [&] { b.poison(); },
      [&] { return b.download(c.in_place); }, out);
}

void expect_ce_equal(const CeCase& c, const CeOut& got, const CeOut& ref) {
  const std::string l = label(c);
  EXPECT_TRUE(close_normwise(decode(FCE_FLOAT32, got.loss), decode(FCE_FLOAT32, ref.loss),
                             kTolF32, l + " loss"));
  EXPECT_TRUE(close_normwise(decode(FCE_FLOAT32, got.lse), decode(FCE_FLOAT32, ref.lse), kTolF32,
                             l + " lse"));
  EXPECT_TRUE(close_normwise(decode(FCE_FLOAT32, got.z_loss), decode(FCE_FLOAT32, ref.z_loss),
                             kTolF32, l + " z_loss"));
  if (c.grad) {
    EXPECT_TRUE(close_normwise(decode(c.dtype, got.grad), decode(c.dtype, ref.grad),
                               grad_tol(c.dtype), l + " grad_logits"));
  }
  if (c.argmax) {
    EXPECT_EQ(got.argmax, ref.argmax) << l << " argmax";
    EXPECT_TRUE(close_normwise(decode(FCE_FLOAT32, got.accuracy),
                               decode(FCE_FLOAT32, ref.accuracy), 1e-6, l + " accuracy"));
  }
  EXPECT_EQ(got.flags, ref.flags) << l << " error_flags";
}

std::vector<CeCase> ce_cases() {
  std::vector<CeCase> v;
  for (int dt : {FCE_FLOAT32, FCE_BFLOAT16}) {
    CeCase c;
    c.dtype = dt;
    c.name = "plain";
    c.seed = 11 + dt;
    v.push_back(c);
    c.name = "smoothing+zloss+ignored+argmax";
    c.eps = 0.1f;
    c.lambda = 1e-3f;
    c.ignore = 0.2;
    c.argmax = true;
    c.seed = 21 + dt;
    v.push_back(c);
    c = CeCase();
    c.dtype = dt;
    c.name = "none+per-row upstream+ignored+smoothing+zloss";
    c.reduction = FCE_REDUCTION_NONE;
    c.ignore = 0.25;
    c.eps = 0.05f;
    c.lambda = 1e-4f;
    c.argmax = true;
    c.seed = 31 + dt;
    v.push_back(c);
    c = CeCase();
    c.dtype = dt;
    c.name = "sum+class weights+softcap+scale+int32 targets";
    c.reduction = FCE_REDUCTION_SUM;
    c.weights = true;
    c.softcap = 15.0f;
    c.scale = 0.75f;
    c.tdtype = FCE_INT32;
    c.eps = 0.1f;
    c.ignore = 0.1;
    c.seed = 41 + dt;
    v.push_back(c);
    c = CeCase();
    c.dtype = dt;
    c.name = "in place";
    c.in_place = true;
    c.lambda = 1e-4f;
    c.seed = 51 + dt;
    v.push_back(c);
    c = CeCase();
    c.dtype = dt;
    c.name = "loss only";
    c.grad = false;
    c.ignore = 0.3;
    c.argmax = true;
    c.seed = 61 + dt;
    v.push_back(c);
  }
  return v;
}

// ------------------------------------------------------------------ linear + CE -------------
struct LinCase {
  std::string name;
  int dtype = FCE_FLOAT32;
  int reduction = FCE_REDUCTION_MEAN;
  float eps = 0, lambda = 0;
  double ignore = 0;
  bool bias = true;
  bool gh = true, gw = true, gb = true;
  bool gw_fp32 = false, accumulate = false;
  bool argmax = false;
  bool min_ws = false;  // the minimum workspace (a slower plan) for fce_nccl_linear_ce
  int64_t N = 48, D = 64, V = 517;
  uint64_t seed = 1;
};

std::string label(const LinCase& c) {
  std::ostringstream s;
  s << c.name << " [" << dtype_name(c.dtype) << " " << reduction_name(c.reduction) << " N=" << c.N
    << " D=" << c.D << " V=" << c.V << " grads=" << c.gh << c.gw << c.gb
    << (c.min_ws ? " min workspace" : "") << "]";
  return s.str();
}

struct LinData {
  std::vector<double> h, W, b, g, gw0, gb0;
  std::vector<int64_t> y;
};

LinData lin_data(const LinCase& c) {
  std::mt19937_64 rng(c.seed);
  LinData d;
  const size_t N = static_cast<size_t>(c.N), D = static_cast<size_t>(c.D),
               V = static_cast<size_t>(c.V);
  d.h = random_normal(rng, c.dtype, N * D, 1.0);
  d.W = random_normal(rng, c.dtype, V * D, 0.3);
  d.b = random_normal(rng, c.dtype, V, 0.5);
  d.y = random_targets(rng, c.N, c.V, c.ignore, -100);
  d.g = random_uniform(rng, c.reduction == FCE_REDUCTION_NONE ? N : 1, 0.5, 1.5);
  const int gwd = c.gw_fp32 ? FCE_FLOAT32 : c.dtype;
  d.gw0 = random_normal(rng, gwd, V * D, 0.01);
  d.gb0 = random_normal(rng, gwd, V, 0.01);
  return d;
}

TestOptions lin_options(const LinCase& c) {
  TestOptions o = FCE_OPTIONS_INIT;
  o.backend = FCE_BACKEND_CUDA;
  o.dtype = c.dtype;
  o.reduction = c.reduction;
  o.label_smoothing = c.eps;
  o.z_loss_scale = c.lambda;
  o.grad_weight_fp32 = c.gw_fp32;
  o.accumulate = c.accumulate;
  return o;
}

struct LinOut {
  std::vector<uint8_t> loss, lse, z_loss, gh, gw, gb, argmax, accuracy, flags;
};
std::vector<std::vector<uint8_t>> bits(const LinOut& o) {
  return {o.loss, o.lse, o.z_loss, o.gh, o.gw, o.gb, o.argmax, o.accuracy, o.flags};
}

struct LinDev {
  Dev h, W, b, y, g;
  Dev loss, lse, zl, gh, gw, gb, argmax, acc, flags, ws;
  std::vector<uint8_t> gw0, gb0;
  void poison() {
    for (Dev* d : {&loss, &lse, &zl, &gh, &acc}) d->fill(kPoisonByte);
    argmax.fill(kArgmaxPoison);
    flags.fill(0);
    ws.fill(0xFF);
    // grad_weight / grad_bias: what accumulate adds to (poison when overwritten)
    if (!gw0.empty()) gw.upload(gw0); else gw.fill(kPoisonByte);
    if (!gb0.empty()) gb.upload(gb0); else gb.fill(kPoisonByte);
  }
  LinOut download() const {
    return {loss.download(), lse.download(), zl.download(),     gh.download(),  gw.download(),
            gb.download(),   argmax.download(), acc.download(), flags.download()};
  }
};

LinDev lin_alloc(const LinCase& c, const LinData& d, cudaStream_t s) {
  LinDev b;
  const size_t N = static_cast<size_t>(c.N), D = static_cast<size_t>(c.D),
               V = static_cast<size_t>(c.V);
  const int gwd = c.gw_fp32 ? FCE_FLOAT32 : c.dtype;
  b.h = Dev(encode(c.dtype, d.h), s);
  b.W = Dev(encode(c.dtype, d.W), s);
  if (c.bias) b.b = Dev(encode(c.dtype, d.b), s);
  b.y = Dev(encode_targets(FCE_INT64, d.y), s);
  b.g = Dev(encode(FCE_FLOAT32, d.g), s);
  const bool none = c.reduction == FCE_REDUCTION_NONE;
  b.loss = Dev((none ? N : 1) * 4, s);
  b.lse = Dev(N * 4, s);
  b.zl = Dev(4, s);
  if (c.gh) b.gh = Dev(N * D * dtype_size(c.dtype), s);
  if (c.gw) b.gw = Dev(V * D * dtype_size(gwd), s);
  if (c.gb && c.bias) b.gb = Dev(V * dtype_size(gwd), s);
  if (c.accumulate) {
    b.gw0 = encode(gwd, d.gw0);
    b.gb0 = encode(gwd, d.gb0);
  }
  b.argmax = Dev(N * 8, s);
  b.acc = Dev((none ? N : 1) * 4, s);
  b.flags = Dev(4, s);
  return b;
}

bool lin_with_grad(const LinCase& c) { return c.gh || c.gw || (c.gb && c.bias); }

::testing::AssertionResult lin_reference(const LinCase& c, const LinData& d, LinOut* out) {
  cudaStream_t s = stream0();
  LinDev b = lin_alloc(c, d, s);
  TestOptions o = lin_options(c);
  if (c.argmax) {
    o.argmax = b.argmax.p<int64_t>();
    o.accuracy = b.acc.p<float>();
  }
  size_t mn = 0, opt = 0;
  fce_status st = fce_linear_ce_workspace_size(&o, c.N, c.D, c.V, lin_with_grad(c), &mn, &opt);
  if (st != FCE_SUCCESS) return ok(st, "fce_linear_ce_workspace_size");
  b.ws = Dev(opt, s);
  b.poison();
  st = flat::linear_ce(&o, c.N, c.D, c.V, b.h.ptr(), b.W.ptr(), b.b.ptr(), b.y.ptr(),
                     b.loss.p<float>(), b.lse.p<float>(), b.zl.p<float>(), b.gh.ptr(), b.gw.ptr(),
                     b.gb.ptr(), b.g.p<float>(), b.flags.p<uint32_t>(), b.ws.ptr(), opt, s);
  if (st != FCE_SUCCESS) return ok(st, "fce_linear_ce (reference)");
  auto f = finish();
  if (!f) return f;
  *out = b.download();
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult lin_nccl(const LinCase& c, const LinData& d, LinOut* out, bool graph) {
  cudaStream_t s = stream0();
  ncclComm_t comm = comm1();
  LinDev b = lin_alloc(c, d, s);
  TestOptions o = lin_options(c);
  if (c.argmax) {
    o.argmax = b.argmax.p<int64_t>();
    o.accuracy = b.acc.p<float>();
  }
  size_t mn = 0, opt = 0;
  fce_status st = flat::nccl_linear_ws(&o, comm, c.N, c.D, c.V, c.V,
                                                     lin_with_grad(c), &mn, &opt);
  if (st != FCE_SUCCESS) return ok(st, "fce_nccl_linear_ce_workspace_size");
  if (mn > opt)
    return ::testing::AssertionFailure() << "min_bytes " << mn << " > optimal_bytes " << opt;
  const size_t wsb = c.min_ws ? mn : opt;
  b.ws = Dev(wsb, s);
  b.poison();
  auto call = [&] {
    return flat::nccl_linear_ce(&o, comm, c.N, c.D, c.V, 0, c.V, b.h.ptr(), b.W.ptr(), b.b.ptr(),
                              b.y.ptr(), b.loss.p<float>(), b.lse.p<float>(), b.zl.p<float>(),
                              b.gh.ptr(), b.gw.ptr(), b.gb.ptr(), b.g.p<float>(),
                              b.flags.p<uint32_t>(), b.ws.ptr(), wsb, s);
  };
  return eager_and_replays(
      "fce_nccl_linear_ce", s, graph, call, [&] { b.poison(); }, [&] { return b.download(); }, out);
}

// test_linear_ce.cpp's bound: float32 1e-5; 16-bit: u·(4 + 2·max|z|). The two calls make the
// 16-bit logits with GEMMs of different shapes (token chunks against vocabulary slices), so
// cuBLASLt may pick different algorithms and round a logit differently: every output, the
// float32 ones (loss, lse, a float32 grad_weight) too, moves by the logits' rounding.
double lin_tolerance(const LinCase& c, const LinData& d) {
  if (c.dtype == FCE_FLOAT32) return kTolF32;
  double zmax = 0;
  const size_t D = static_cast<size_t>(c.D);
  for (size_t r = 0; r < static_cast<size_t>(c.N); ++r)
    for (size_t v = 0; v < static_cast<size_t>(c.V); ++v) {
      double z = c.bias ? d.b[v] : 0.0;
      for (size_t k = 0; k < D; ++k) z += d.h[r * D + k] * d.W[v * D + k];
      zmax = std::max(zmax, std::fabs(z));
    }
  return unit_roundoff(c.dtype) * (4.0 + 2.0 * zmax);
}

void expect_lin_equal(const LinCase& c, const LinData& d, const LinOut& got, const LinOut& ref) {
  const std::string l = label(c);
  const int gwd = c.gw_fp32 ? FCE_FLOAT32 : c.dtype;
  const double tol = lin_tolerance(c, d);
  EXPECT_TRUE(close_normwise(decode(FCE_FLOAT32, got.loss), decode(FCE_FLOAT32, ref.loss),
                             tol, l + " loss"));
  EXPECT_TRUE(close_normwise(decode(FCE_FLOAT32, got.lse), decode(FCE_FLOAT32, ref.lse), tol,
                             l + " lse"));
  EXPECT_TRUE(close_normwise(decode(FCE_FLOAT32, got.z_loss), decode(FCE_FLOAT32, ref.z_loss),
                             tol, l + " z_loss"));
  if (c.gh) {
    EXPECT_TRUE(close_normwise(decode(c.dtype, got.gh), decode(c.dtype, ref.gh), tol,
                               l + " grad_hidden"));
  }
  if (c.gw) {
    EXPECT_TRUE(close_normwise(decode(gwd, got.gw), decode(gwd, ref.gw), tol,
                               l + " grad_weight"));
  }
  if (c.gb && c.bias) {
    EXPECT_TRUE(close_normwise(decode(gwd, got.gb), decode(gwd, ref.gb), tol,
                               l + " grad_bias"));
  }
  if (c.argmax) {
    EXPECT_EQ(got.argmax, ref.argmax) << l << " argmax";
    EXPECT_TRUE(close_normwise(decode(FCE_FLOAT32, got.accuracy),
                               decode(FCE_FLOAT32, ref.accuracy), 1e-6, l + " accuracy"));
  }
  EXPECT_EQ(got.flags, ref.flags) << l << " error_flags";
}

std::vector<LinCase> lin_cases() {
  std::vector<LinCase> v;
  for (int dt : {FCE_FLOAT32, FCE_BFLOAT16}) {
    LinCase c;
    c.dtype = dt;
    c.name = "plain";
    c.seed = 101 + dt;
    v.push_back(c);
    c.name = "smoothing+zloss+ignored+argmax";
    c.eps = 0.1f;
    c.lambda = 1e-3f;
    c.ignore = 0.2;
    c.argmax = true;
    c.seed = 111 + dt;
    v.push_back(c);
    c.name = "smoothing+zloss+ignored, minimum workspace";
    c.argmax = false;
    c.min_ws = true;
    c.seed = 121 + dt;
    v.push_back(c);
    c = LinCase();
    c.dtype = dt;
    c.name = "none+per-row upstream, no bias, grad_hidden only";
    c.reduction = FCE_REDUCTION_NONE;
    c.bias = false;
    c.gw = c.gb = false;
    c.ignore = 0.25;
    c.lambda = 1e-4f;
    c.seed = 131 + dt;
    v.push_back(c);
    c = LinCase();
    c.dtype = dt;
    c.name = "sum, accumulate, grad_weight_fp32, no grad_hidden";
    c.reduction = FCE_REDUCTION_SUM;
    c.gh = false;
    c.accumulate = true;
    c.gw_fp32 = dt != FCE_FLOAT32;
    c.seed = 141 + dt;
    v.push_back(c);
    c = LinCase();
    c.dtype = dt;
    c.name = "loss only";
    c.gh = c.gw = c.gb = false;
    c.argmax = true;
    c.seed = 151 + dt;
    v.push_back(c);
  }
  return v;
}

// ------------------------------------------------------------------ distillation ------------
// A distillation case: a cross-entropy case's name, dtypes, reduction, scale, softcap, ignored
// rows, gradient, in place, sizes and seed (its label smoothing, z-loss, class weights and argmax
// left off; its options are ce_options'), and the teacher's divergence, beta and temperature.
struct DistCase : CeCase {
  int divergence = FCE_DIVERGENCE_FORWARD_KL;
  float beta = 0.5f, T = 1.0f;
  bool targets = true;  // else NULL: every row counts
};

std::string label(const DistCase& c) {
  static const char* const div[] = {"forward KL", "reverse KL", "JSD"};
  std::ostringstream s;
  s << label(static_cast<const CeCase&>(c)) << " " << div[c.divergence] << " beta=" << c.beta
    << " T=" << c.T;
  return s.str();
}

// The student's logits, targets and upstream gradient as a cross-entropy case's, and the
// teacher's logits t [N, V].
struct DistData : CeData {
  std::vector<double> t;
};

DistData dist_data(const DistCase& c) {
  DistData d;
  static_cast<CeData&>(d) = ce_data(c);
  std::mt19937_64 rng(c.seed + 1000);
  d.t = random_logits(rng, c.dtype, c.N, c.V, 1.0, 6.0, 5.0);
  return d;
}

fce_teacher dist_teacher(const DistCase& c, const void* logits) {
  fce_teacher t = FCE_TEACHER_INIT;
  t.divergence = c.divergence;
  t.beta = c.beta;
  t.temperature = c.T;
  t.logits = logits;
  return t;
}

// A distillation case's buffers: a cross-entropy case's (ce_alloc: z, y, g, the outputs, the
// gradient; what the distillation does not write stays poisoned) and the teacher's logits t,
// [N, c.V] (a rank passes its shard's data and width). What a call wrote: CeOut.
struct DistDev : CeDev {
  Dev t;
  const void* targets(const DistCase& c) const { return c.targets ? y.ptr() : nullptr; }
  void* grad_ptr(const DistCase& c) const {
    return c.grad ? (c.in_place ? z.ptr() : grad.ptr()) : nullptr;
  }
};

DistDev dist_alloc(const DistCase& c, const DistData& d, cudaStream_t s) {
  DistDev b;
  static_cast<CeDev&>(b) = ce_alloc(c, d, s);
  b.t = Dev(encode(c.dtype, d.t), s);
  return b;
}

// The unsharded reference: fce_distill on device 0.
::testing::AssertionResult dist_reference(const DistCase& c, const DistData& d, CeOut* out) {
  cudaStream_t s = stream0();
  DistCase rc = c;
  rc.in_place = false;
  DistDev b = dist_alloc(rc, d, s);
  const TestOptions o = ce_options(c);
  const fce_teacher te = dist_teacher(c, b.t.ptr());
  size_t wsb = 0;
  fce_status st = fce_distill_workspace_size(&o, &te, c.N, c.V, &wsb);
  if (st != FCE_SUCCESS) return ok(st, "fce_distill_workspace_size");
  b.ws = Dev(wsb, s);
  b.poison();
  const fce_outputs out_s =
      flat::outputs(&o, b.loss.p<float>(), b.lse.p<float>(), nullptr, b.flags.p<uint32_t>());
  const fce_gradients g = flat::logit_grads(b.grad_ptr(rc), b.g.p<float>());
  st = fce_distill(&o, &te, c.N, c.V, b.z.ptr(), b.targets(c), &out_s, c.grad ? &g : nullptr,
                   b.ws.ptr(), wsb, s);
  if (st != FCE_SUCCESS) return ok(st, "fce_distill (reference)");
  auto f = finish();
  if (!f) return f;
  *out = b.download(false);
  return ::testing::AssertionSuccess();
}

// fce_nccl_distill over the columns [start, start + c.V) of vocab_total on comm (the one-rank
// communicator: all of them), the buffers b of the rank's shard; `graph` as ce_nccl.
::testing::AssertionResult dist_nccl_on(ncclComm_t comm, cudaStream_t s, const DistCase& c,
                                        DistDev& b, int64_t vocab_total, int64_t start, CeOut* out,
                                        bool graph) {
  if (graph && c.in_place) return ::testing::AssertionFailure() << "graph: not with in place";
  const TestOptions o = ce_options(c);
  const fce_teacher te = dist_teacher(c, b.t.ptr());
  size_t wsb = 0;
  fce_status st = flat::nccl_distill_ws(&o, &te, comm, c.N, vocab_total, c.V, c.grad, &wsb);
  if (st != FCE_SUCCESS) return ok(st, "fce_nccl_distill_workspace_size");
  b.ws = Dev(wsb, s);
  b.poison();
  auto call = [&] {
    return flat::nccl_distill(&o, &te, comm, c.N, vocab_total, start, c.V, b.z.ptr(), b.targets(c),
                              b.loss.p<float>(), b.lse.p<float>(), b.grad_ptr(c), b.g.p<float>(),
                              b.flags.p<uint32_t>(), b.ws.ptr(), wsb, s);
  };
  return eager_and_replays(
      "fce_nccl_distill", s, graph, call, [&] { b.poison(); },
      [&] { return b.download(c.in_place); }, out);
}

::testing::AssertionResult dist_nccl(const DistCase& c, const DistData& d, CeOut* out, bool graph) {
  cudaStream_t s = stream0();
  DistDev b = dist_alloc(c, d, s);
  return dist_nccl_on(comm1(), s, c, b, c.V, 0, out, graph);
}

// The distillation's bounds against fce_distill on CUDA, those test_vp_distill.cpp puts on the
// fce_vp_distill_* steps (distill_ref.h): a divergence is a difference of nearly equal sums, so
// the loss 1e-4 and a float32 gradient 4e-5; the lse as every float32 output here; a 16-bit
// gradient rounded once to the dtype.
constexpr double kDistLossTol = 1e-4, kDistGradTolF32 = 4e-5;

void expect_dist_equal(const DistCase& c, const CeOut& got, const CeOut& ref) {
  const std::string l = label(c);
  EXPECT_TRUE(close_normwise(decode(FCE_FLOAT32, got.loss), decode(FCE_FLOAT32, ref.loss),
                             kDistLossTol, l + " loss"));
  EXPECT_TRUE(close_normwise(decode(FCE_FLOAT32, got.lse), decode(FCE_FLOAT32, ref.lse), kTolF32,
                             l + " lse"));
  if (c.grad) {
    const double tol = c.dtype == FCE_FLOAT32 ? kDistGradTolF32 : grad_tol(c.dtype);
    EXPECT_TRUE(close_normwise(decode(c.dtype, got.grad), decode(c.dtype, ref.grad), tol,
                               l + " grad_logits"));
  }
  EXPECT_EQ(got.flags, ref.flags) << l << " error_flags";
}

// A case of a divergence (the JSD's beta 0.5) at temperature T; the other fields as declared.
DistCase dist_case(const char* name, int divergence, float T, int reduction = FCE_REDUCTION_MEAN,
                   double ignore = 0.0) {
  DistCase c;
  c.name = name, c.divergence = divergence, c.T = T, c.reduction = reduction, c.ignore = ignore;
  return c;
}

// fce_nccl_distill on the one-rank communicator against fce_distill; `graph`: its replays too.
void expect_dist_matches(const DistCase& c, bool graph) {
  SCOPED_TRACE(label(c));
  const DistData d = dist_data(c);
  CeOut ref, got;
  ASSERT_TRUE(dist_reference(c, d, &ref));
  ASSERT_TRUE(dist_nccl(c, d, &got, graph));
  expect_dist_equal(c, got, ref);
}

// Forward KL, reverse KL and the JSD (beta = 0.5: two rounds; beta = 0: one) with temperatures
// other than 1, each reduction, ignored rows, no targets, int32 targets, in place, the loss only.
std::vector<DistCase> dist_cases() {
  std::vector<DistCase> v;
  uint64_t seed = 500;
  for (int dt : {FCE_FLOAT32, FCE_BFLOAT16}) {
    const int mean = FCE_REDUCTION_MEAN, jsd = FCE_DIVERGENCE_JSD;
    std::vector<DistCase> k = {
        dist_case("forward KL, ignored rows", FCE_DIVERGENCE_FORWARD_KL, 2.0f, mean, 0.2),
        dist_case("reverse KL, sum, scale+softcap, int32 targets", FCE_DIVERGENCE_REVERSE_KL, 0.5f,
                  FCE_REDUCTION_SUM, 0.1),
        dist_case("JSD, none+per-row upstream, ignored rows", jsd, 2.0f, FCE_REDUCTION_NONE, 0.25),
        dist_case("JSD, in place, no targets", jsd, 1.5f),
        dist_case("JSD beta=0 (one round)", jsd, 3.0f, mean, 0.1),
        dist_case("JSD, loss only", jsd, 2.0f, mean, 0.3)};
    k[1].scale = 0.8f;
    k[1].softcap = 12.0f;
    k[1].tdtype = FCE_INT32;
    k[3].in_place = true;
    k[3].targets = false;
    k[4].beta = 0.0f;
    k[5].grad = false;
    for (DistCase& c : k) {
      c.dtype = dt;
      c.seed = ++seed;
      v.push_back(c);
    }
  }
  return v;
}

// The columns [start, start + local) of a dense [rows, cols] matrix (a rank's shard).
std::vector<double> columns(const std::vector<double>& m, int64_t rows, int64_t cols, int64_t start,
                            int64_t local) {
  std::vector<double> out(static_cast<size_t>(rows * local));
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(m.begin() + r * cols + start, local, out.begin() + r * local);
  return out;
}

}  // namespace
