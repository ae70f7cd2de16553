// nvcc -std=c++17 -O2 -arch=sm_90 -Iinclude tests/gpu/smoke_linear_ce.cu -Lbuild-lin -lfusedce -Xlinker -rpath,$PWD/build-lin -o build-lin/smoke_linear_ce && build-lin/smoke_linear_ce
//
// smoke_linear_ce.cu — a standalone GPU smoke test of fce_linear_ce on the CUDA backend (run it
// from the repository root after building the library into build-lin/). Small random problems,
// checked against a float64 CPU computation of SPEC.md / SEMANTICS.md written out here:
// loss (mean / sum / none), lse, z_loss, grad_hidden, grad_weight, grad_bias; float32, float16
// and bfloat16; workspaces min, between and optimal (one chunk, several chunks, the float32 ∂W
// accumulator); overwrite and accumulate; grad_weight_fp32; loss only; grad_hidden only;
// run-to-run bitwise reproducibility; CUDA graph capture + replay; an out-of-range target.
// Prints one line per case and PASS/FAIL; exits 1 on any failure, 2 when there is no CUDA
// device. FCE_SMOKE_BACKEND=cpu runs the same cases on the CPU backend (host buffers).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fusedce.h"

#define CUDA_CHECK(x)                                                                \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

static int g_failures = 0;
// FCE_SMOKE_BACKEND=cpu runs the same cases on the CPU backend with host buffers: a check of this
// harness and its float64 reference where no GPU is.
static bool g_cpu = false;

// ---------------------------------------------------------------- dtype helpers
static size_t esize(int dtype) { return dtype == FCE_FLOAT32 ? 4 : 2; }
static const char* dname(int dtype) {
  return dtype == FCE_FLOAT32 ? "f32" : dtype == FCE_FLOAT16 ? "f16" : "bf16";
}
static double round_to(int dtype, double v) {
  if (dtype == FCE_FLOAT16) return (double)__half2float(__float2half_rn((float)v));
  if (dtype == FCE_BFLOAT16) return (double)__bfloat162float(__float2bfloat16_rn((float)v));
  return (double)(float)v;
}
static std::vector<uint8_t> encode(int dtype, const std::vector<double>& v) {
  std::vector<uint8_t> out(v.size() * esize(dtype));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == FCE_FLOAT32) {
      float f = (float)v[i];
      std::memcpy(&out[i * 4], &f, 4);
    } else if (dtype == FCE_FLOAT16) {
      __half h = __float2half_rn((float)v[i]);
      std::memcpy(&out[i * 2], &h, 2);
    } else {
      __nv_bfloat16 h = __float2bfloat16_rn((float)v[i]);
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}
static std::vector<double> decode(int dtype, const std::vector<uint8_t>& b) {
  const size_t n = b.size() / esize(dtype);
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (dtype == FCE_FLOAT32) {
      float f;
      std::memcpy(&f, &b[i * 4], 4);
      out[i] = f;
    } else if (dtype == FCE_FLOAT16) {
      __half h;
      std::memcpy(&h, &b[i * 2], 2);
      out[i] = __half2float(h);
    } else {
      __nv_bfloat16 h;
      std::memcpy(&h, &b[i * 2], 2);
      out[i] = __bfloat162float(h);
    }
  }
  return out;
}

// ---------------------------------------------------------------- device buffers
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  DevBuf() = default;
  explicit DevBuf(size_t n) : bytes(n) {
    if (n && g_cpu) p = std::malloc(n);
    else if (n) CUDA_CHECK(cudaMalloc(&p, n));
  }
  ~DevBuf() {
    if (p && g_cpu) std::free(p);
    else if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void upload(const void* src) {
    if (g_cpu) std::memcpy(p, src, bytes);
    else CUDA_CHECK(cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice));
  }
  void fill(int byte) {
    if (g_cpu) std::memset(p, byte, bytes);
    else CUDA_CHECK(cudaMemset(p, byte, bytes));
  }
  void poison() { fill(0xFF); }  // NaN in every float format
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> v(bytes);
    if (g_cpu) std::memcpy(v.data(), p, bytes);
    else CUDA_CHECK(cudaMemcpy(v.data(), p, bytes, cudaMemcpyDeviceToHost));
    return v;
  }
};

// ---------------------------------------------------------------- the problem
struct Shape {
  int64_t rows, hidden, vocab, hidden_pad;  // hidden_row_stride = hidden + hidden_pad
};
struct OptSet {
  const char* name;
  int reduction;
  bool bias;
  double eps, lambda, softcap, scale;
  bool class_weights;
  int64_t shift;      // T, 0 = off
  int grad_output;    // 0: NULL, 1: given
  bool target_out_of_range;
};

struct Inputs {
  std::vector<double> h, w, b, cw, g;  // already rounded to the dtype (h: [rows, stride])
  std::vector<int64_t> y;
};

struct Reference {
  std::vector<double> loss, lse, dh, dw, db;  // loss: [1] or [rows]
  double z_loss = 0;
  double zmax = 0;  // max |z| over all logits (bias included): the 16-bit tolerance scales with it
};

static Reference reference(const Shape& sh, const OptSet& o, const Inputs& in) {
  const int64_t N = sh.rows, D = sh.hidden, V = sh.vocab, hs = sh.hidden + sh.hidden_pad;
  Reference r;
  std::vector<double> z(V), a(V), dz((size_t)N * V, 0.0), row_loss(N, 0.0);
  r.lse.assign(N, 0.0);
  std::vector<int> kind(N);  // 0 valid, 1 ignored, 2 invalid
  std::vector<int64_t> tgt(N);
  double Omega = 0;
  for (int64_t j = 0; j < V; ++j) Omega += o.class_weights ? in.cw[j] : 1.0;
  double denom = 0, zsum = 0;
  for (int64_t i = 0; i < N; ++i) {
    int64_t y;
    if (o.shift > 0) {
      const int64_t t = i % o.shift;
      y = t == o.shift - 1 ? -100 : in.y[i + 1];
    } else {
      y = in.y[i];
    }
    tgt[i] = y;
    kind[i] = y == -100 ? 1 : (y < 0 || y >= V) ? 2 : 0;
    if (kind[i] == 0) denom += o.class_weights ? in.cw[y] : 1.0;
    if (kind[i] == 2) denom += 1.0;
  }
  for (int64_t i = 0; i < N; ++i) {
    double mx = -INFINITY;
    for (int64_t j = 0; j < V; ++j) {
      double s = o.bias ? in.b[j] : 0.0;
      for (int64_t k = 0; k < D; ++k) s += in.h[i * hs + k] * in.w[j * D + k];
      z[j] = s;
      r.zmax = std::max(r.zmax, std::fabs(s));
      double aj = o.scale * s;
      if (o.softcap > 0) aj = o.softcap * std::tanh(aj / o.softcap);
      a[j] = aj;
      mx = std::max(mx, aj);
    }
    double se = 0;
    for (int64_t j = 0; j < V; ++j) se += std::exp(a[j] - mx);
    const double lse = mx + std::log(se);
    r.lse[i] = lse;
    if (kind[i] == 1) continue;
    if (kind[i] == 2) {
      row_loss[i] = NAN;
      zsum += o.lambda * lse * lse;
      for (int64_t j = 0; j < V; ++j) dz[i * V + j] = NAN;
      continue;
    }
    const int64_t y = tgt[i];
    const double wy = o.class_weights ? in.cw[y] : 1.0;
    double smooth = 0;
    for (int64_t j = 0; j < V; ++j) smooth += (o.class_weights ? in.cw[j] : 1.0) * (lse - a[j]);
    row_loss[i] = (1 - o.eps) * wy * (lse - a[y]) + (o.eps / V) * smooth + o.lambda * lse * lse;
    zsum += o.lambda * lse * lse;
    const double g = o.grad_output ? (o.reduction == FCE_REDUCTION_NONE ? in.g[i] : in.g[0]) : 1.0;
    const double k = o.reduction == FCE_REDUCTION_MEAN ? (denom > 0 ? g / denom : 0.0) : g;
    for (int64_t j = 0; j < V; ++j) {
      const double p = std::exp(a[j] - lse);
      const double wj = o.class_weights ? in.cw[j] : 1.0;
      double da = (1 - o.eps) * wy * (p - (j == y ? 1.0 : 0.0)) + (o.eps / V) * (Omega * p - wj) +
                  2 * o.lambda * lse * p;
      double d = k * da * o.scale;
      if (o.softcap > 0) d *= 1 - (a[j] / o.softcap) * (a[j] / o.softcap);
      dz[i * V + j] = d;
    }
  }
  if (o.reduction == FCE_REDUCTION_NONE) {
    r.loss = row_loss;
    r.z_loss = zsum;
  } else {
    double s = 0;
    for (int64_t i = 0; i < N; ++i) s += row_loss[i];
    if (o.reduction == FCE_REDUCTION_MEAN) {
      s = denom > 0 ? s / denom : 0.0;
      r.z_loss = denom > 0 ? zsum / denom : 0.0;
    } else {
      r.z_loss = zsum;
    }
    r.loss = {s};
  }
  r.dh.assign((size_t)N * D, 0.0);
  r.dw.assign((size_t)V * D, 0.0);
  r.db.assign(V, 0.0);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < V; ++j) {
      const double d = dz[i * V + j];
      if (d == 0.0) continue;
      for (int64_t k = 0; k < D; ++k) {
        r.dh[i * D + k] += d * in.w[j * D + k];
        r.dw[j * D + k] += d * in.h[i * hs + k];
      }
      r.db[j] += d;
    }
  return r;
}

// ---------------------------------------------------------------- comparisons
// ‖x − ref‖₂ / ‖ref‖₂ (absolute when ref is ~0); infinity when x is NaN/inf where ref is finite.
static double rel_err(const std::vector<double>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(ref[i])) {
      if (!std::isnan(x[i])) return INFINITY;
      continue;
    }
    if (!std::isfinite(x[i])) return INFINITY;
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 1e-30 ? std::sqrt(num / den) : std::sqrt(num);
}

static void report(bool ok, const std::string& what) {
  std::printf("%s  %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++g_failures;
}

// ---------------------------------------------------------------- one call
enum class Grads { kNone, kAll, kHiddenOnly };
enum class Ws { kMin, kMid, kOptimal };

struct RunResult {
  fce_status status;
  std::vector<uint8_t> loss, lse, z_loss, dh, dw, db, flags;
};

struct Case {
  int dtype;
  Shape sh;
  OptSet o;
  Grads grads;
  bool accumulate, gw_fp32;
  Ws ws;
  bool graph = false;  // the second run is captured into a CUDA graph and replayed
};

static fce_options options_of(const Case& c, const DevBuf& cw) {
  fce_options opt = FCE_OPTIONS_INIT;
  opt.backend = g_cpu ? FCE_BACKEND_CPU : FCE_BACKEND_CUDA;
  opt.dtype = c.dtype;
  opt.target_dtype = FCE_INT64;
  opt.reduction = c.o.reduction;
  opt.label_smoothing = (float)c.o.eps;
  opt.z_loss_scale = (float)c.o.lambda;
  opt.softcap = (float)c.o.softcap;
  opt.logit_scale = (float)c.o.scale;
  opt.class_weights = c.o.class_weights ? (const float*)cw.p : nullptr;
  opt.shift_seq_len = c.o.shift;
  opt.hidden_row_stride = c.sh.hidden + c.sh.hidden_pad;
  opt.accumulate = c.accumulate;
  opt.grad_weight_fp32 = c.gw_fp32;
  opt.deterministic = 1;
  return opt;
}

static void run_case(const Case& c, const Inputs& in, const Reference& ref, cudaStream_t stream) {
  const int64_t N = c.sh.rows, D = c.sh.hidden, V = c.sh.vocab, hs = D + c.sh.hidden_pad;
  const bool none = c.o.reduction == FCE_REDUCTION_NONE;
  const bool grads = c.grads != Grads::kNone, all = c.grads == Grads::kAll;
  const int gdt = c.gw_fp32 ? FCE_FLOAT32 : c.dtype;
  char label[256];
  std::snprintf(label, sizeof label, "%-4s N=%lld D=%lld(+%lld) V=%lld %-12s %s%s%s ws=%s",
                dname(c.dtype), (long long)N, (long long)D, (long long)c.sh.hidden_pad,
                (long long)V, c.o.name,
                c.grads == Grads::kNone ? "loss-only" : c.grads == Grads::kAll ? "all-grads" : "grad_hidden-only",
                c.accumulate ? " accumulate" : "", c.gw_fp32 ? " gw_fp32" : "",
                c.ws == Ws::kMin ? "min" : c.ws == Ws::kMid ? "mid" : "optimal");

  // inputs on the device
  DevBuf h((size_t)N * hs * esize(c.dtype)), w((size_t)V * D * esize(c.dtype)),
      b(c.o.bias ? (size_t)V * esize(c.dtype) : 0), y((size_t)N * 8), cw((size_t)V * 4),
      g(none ? (size_t)N * 4 : 4);
  h.upload(encode(c.dtype, in.h).data());
  w.upload(encode(c.dtype, in.w).data());
  if (c.o.bias) b.upload(encode(c.dtype, in.b).data());
  y.upload(in.y.data());
  cw.upload(encode(FCE_FLOAT32, in.cw).data());
  g.upload(encode(FCE_FLOAT32, in.g).data());

  fce_options opt = options_of(c, cw);
  size_t min_b = 0, opt_b = 0;
  fce_status st = fce_linear_ce_workspace_size(&opt, N, D, V, grads ? 1 : 0, &min_b, &opt_b);
  if (st != FCE_SUCCESS || min_b > opt_b) {
    report(false, std::string(label) + ": workspace query: " + fce_last_error());
    return;
  }
  const size_t ws_bytes = c.ws == Ws::kMin ? min_b : c.ws == Ws::kOptimal ? opt_b : min_b + (opt_b - min_b) / 2;
  DevBuf ws(ws_bytes);

  // outputs: poisoned, or old values for accumulate
  DevBuf loss(none ? (size_t)N * 4 : 4), lse((size_t)N * 4), zl(4), flags(4);
  DevBuf dh(grads ? (size_t)N * D * esize(c.dtype) : 0);
  DevBuf dw(all ? (size_t)V * D * esize(gdt) : 0), db(all && c.o.bias ? (size_t)V * esize(gdt) : 0);
  std::vector<double> old_w, old_b;
  auto prepare = [&]() {
    loss.poison();
    lse.poison();
    zl.poison();
    flags.fill(0);
    if (dh.p) dh.poison();
    if (c.accumulate) {
      if (dw.p) dw.upload(encode(gdt, old_w).data());
      if (db.p) db.upload(encode(gdt, old_b).data());
    } else {
      if (dw.p) dw.poison();
      if (db.p) db.poison();
    }
  };
  if (c.accumulate) {  // old gradients of the size of the new ones, rounded to their dtype
    std::mt19937 rng(7);
    std::normal_distribution<double> nd(0.0, 1.0);
    double rw = 0, rb = 0;
    for (double v : ref.dw) rw += v * v;
    for (double v : ref.db) rb += v * v;
    rw = std::sqrt(rw / ref.dw.size());
    rb = std::sqrt(rb / ref.db.size());
    old_w.resize(ref.dw.size());
    old_b.resize(ref.db.size());
    for (auto& v : old_w) v = round_to(gdt, rw * nd(rng));
    for (auto& v : old_b) v = round_to(gdt, rb * nd(rng));
  }
  // graph: capture the call into a CUDA graph (global capture mode: any capture-unsafe API in
  // the library fails the capture) and replay it.
  auto call = [&](bool graph) {
    prepare();
    RunResult r;
    cudaGraph_t cg = nullptr;
    if (graph) CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    r.status = fce_linear_ce(&opt, N, D, V, h.p, w.p, c.o.bias ? b.p : nullptr, y.p,
                             (float*)loss.p, (float*)lse.p, (float*)zl.p, dh.p, dw.p, db.p,
                             c.o.grad_output ? (const float*)g.p : nullptr, (uint32_t*)flags.p,
                             ws.p, ws.bytes, stream);
    if (graph) {
      const cudaError_t e = cudaStreamEndCapture(stream, &cg);
      if (r.status == FCE_SUCCESS && e != cudaSuccess) {
        std::printf("    capture failed: %s\n", cudaGetErrorString(e));
        r.status = FCE_ERROR_CUDA;
      }
      if (r.status == FCE_SUCCESS) {
        cudaGraphExec_t exec;
        CUDA_CHECK(cudaGraphInstantiate(&exec, cg, 0));
        CUDA_CHECK(cudaGraphLaunch(exec, stream));
        CUDA_CHECK(cudaStreamSynchronize(stream));
        CUDA_CHECK(cudaGraphExecDestroy(exec));
      }
      if (cg) CUDA_CHECK(cudaGraphDestroy(cg));
      (void)cudaGetLastError();
    }
    if (r.status != FCE_SUCCESS) return r;
    if (!g_cpu) CUDA_CHECK(cudaStreamSynchronize(stream));
    r.loss = loss.download();
    r.lse = lse.download();
    r.z_loss = zl.download();
    r.flags = flags.download();
    if (dh.p) r.dh = dh.download();
    if (dw.p) r.dw = dw.download();
    if (db.p) r.db = db.download();
    return r;
  };

  RunResult r = call(false);
  if (r.status != FCE_SUCCESS) {
    report(false, std::string(label) + ": " + fce_status_string(r.status) + ": " + fce_last_error());
    return;
  }
  // f16/bf16: the CUDA backend materialises each logits chunk in the dtype, as torch eager does
  // (F.linear in bf16 returns bf16 logits), while this reference keeps exact logits: every
  // logit is off by up to u·|z| (u = 2^-11 f16, 2^-8 bf16), so p and the loss by up to
  // 2u·max|z| relative, plus 4u for the roundings of the results: tests/test_linear_ce.cpp's
  // bound u·(4 + 2·max|z|), for everything downstream of the logits.
  const double u = c.dtype == FCE_FLOAT16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
  const double tol_logits16 = u * (4.0 + 2.0 * ref.zmax);
  const double tol_loss = c.dtype == FCE_FLOAT32 ? 1e-5 : tol_logits16;
  // The gradients come from a ∂z rounded to dtype (as torch's do): ~2^-9 (bf16) / 2^-12 (f16)
  // per element, ~1e-3 / 2e-4 norm-wise; f16 also flushes ∂z below 6e-8 (mean over 5000 rows);
  // and from the 16-bit logits (the bound above).
  const double tol_grad = c.dtype == FCE_FLOAT32 ? 1e-5
                          : std::max(c.dtype == FCE_FLOAT16 ? 6e-3 : 1.5e-2, tol_logits16);
  const double tol_gw = tol_grad;
  char msg[512];
  bool ok = true;
  std::string detail;
  auto check = [&](const char* what, double err, double tol) {
    std::snprintf(msg, sizeof msg, " %s=%.2e", what, err);
    detail += msg;
    if (!(err <= tol)) {
      ok = false;
      detail += "(!)";
    }
  };
  check("loss", rel_err(decode(FCE_FLOAT32, r.loss), ref.loss), tol_loss);
  check("lse", rel_err(decode(FCE_FLOAT32, r.lse), ref.lse), tol_loss);
  check("z_loss", rel_err(decode(FCE_FLOAT32, r.z_loss), {ref.z_loss}), c.o.lambda > 0 ? tol_loss : 0.0);
  uint32_t fl;
  std::memcpy(&fl, r.flags.data(), 4);
  if (fl != (c.o.target_out_of_range ? (uint32_t)FCE_FLAG_TARGET_OUT_OF_RANGE : 0u)) {
    ok = false;
    detail += " error_flags wrong";
  }
  if (grads) check("dh", rel_err(decode(c.dtype, r.dh), ref.dh), tol_grad);
  if (all) {
    std::vector<double> ew = ref.dw, eb = ref.db;
    if (c.accumulate) {
      for (size_t i = 0; i < ew.size(); ++i) ew[i] += old_w[i];
      for (size_t i = 0; i < eb.size(); ++i) eb[i] += old_b[i];
    }
    check("dW", rel_err(decode(gdt, r.dw), ew), tol_gw);
    if (c.o.bias) check("db", rel_err(decode(gdt, r.db), eb), tol_gw);
  }
  // bitwise reproducibility with the same workspace size (the second run as a CUDA graph, in
  // the cases that ask for it)
  RunResult r2 = call(c.graph && !g_cpu);
  if (r2.status != FCE_SUCCESS) {
    ok = false;
    detail += std::string(" second run") + (c.graph ? " (graph)" : "") + ": " +
              fce_status_string(r2.status) + ": " + fce_last_error();
  } else if (r2.loss != r.loss || r2.lse != r.lse || r2.z_loss != r.z_loss || r2.dh != r.dh ||
             r2.dw != r.dw || r2.db != r.db) {
    ok = false;
    detail += c.graph ? " GRAPH-REPLAY-DIFFERS" : " NOT-BITWISE-REPRODUCIBLE";
  } else if (c.graph && !g_cpu) {
    detail += " graph=bitwise";
  }
  std::snprintf(msg, sizeof msg, " [ws %zu of min %zu / opt %zu]", ws_bytes, min_b, opt_b);
  report(ok, std::string(label) + ":" + detail + msg);
}

static Inputs make_inputs(const Shape& sh, const OptSet& o, int dtype, uint64_t seed) {
  const int64_t N = sh.rows, D = sh.hidden, V = sh.vocab, hs = D + sh.hidden_pad;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  Inputs in;
  in.h.resize((size_t)N * hs);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t k = 0; k < hs; ++k) in.h[i * hs + k] = k < D ? round_to(dtype, nd(rng)) : 1e30;
  // logits of standard deviation ~6, plus a bias of ~1
  const double sw = 6.0 / std::sqrt((double)D);
  in.w.resize((size_t)V * D);
  for (auto& v : in.w) v = round_to(dtype, sw * nd(rng));
  in.b.resize(V);
  for (auto& v : in.b) v = round_to(dtype, nd(rng));
  in.cw.resize(V);
  for (auto& v : in.cw) v = (double)(float)(0.5 + ud(rng));
  in.y.resize(N);
  for (int64_t i = 0; i < N; ++i) in.y[i] = ud(rng) < 0.1 ? -100 : (int64_t)(rng() % V);
  if (o.target_out_of_range) in.y[N / 2] = V;  // N/2 is not a shifted-out row in the cases below
  const int64_t ng = o.reduction == FCE_REDUCTION_NONE ? N : 1;
  in.g.resize(ng);
  for (auto& v : in.g) v = (double)(float)(0.25 + ud(rng));
  return in;
}

int main() {
  const char* backend = std::getenv("FCE_SMOKE_BACKEND");
  g_cpu = backend && std::strcmp(backend, "cpu") == 0;
  cudaStream_t stream = nullptr;
  if (g_cpu) {
    std::printf("fusedce %u; fce_linear_ce smoke test on the CPU backend\n", fce_version());
  } else {
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
      std::printf("no CUDA device: smoke_linear_ce not run (FCE_SMOKE_BACKEND=cpu runs it on the CPU)\n");
      return 2;
    }
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("fusedce %u on %s; fce_linear_ce CUDA smoke test\n", fce_version(), prop.name);
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }

  const Shape shapes[] = {
      {300, 100, 1000, 3},  // 3 chunks of 128 rows at min (loss only, f32 ∂W; a 16-bit ∂W
                            // runs one direct chunk there); a 2-byte-aligned hidden row stride
      {5000, 32, 64, 0},    // more rows than one chunk holds: 2 balanced chunks at optimal
                            // (loss only, f32 ∂W); a 16-bit ∂W takes one direct chunk at optimal
                            // and the f32 accumulator over balanced chunks at min / mid
      {64, 256, 3000, 0},   // fewer rows than 128: always one chunk
  };
  const OptSet optsets[] = {
      {"mean+bias", FCE_REDUCTION_MEAN, true, 0.0, 0.0, 0.0, 1.0, false, 0, 1, false},
      {"sum+all-opts", FCE_REDUCTION_SUM, false, 0.1, 1e-3, 20.0, 0.8, true, 0, 0, false},
      {"none+shift", FCE_REDUCTION_NONE, true, 0.05, 1e-3, 0.0, 1.0, false, 4, 1, false},
  };
  const int dtypes[] = {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16};
  struct GradMode {
    Grads grads;
    bool accumulate, gw_fp32;
  };
  const GradMode modes[] = {
      {Grads::kNone, false, false},  {Grads::kAll, false, false}, {Grads::kAll, true, false},
      {Grads::kAll, true, true},     {Grads::kAll, false, true},  {Grads::kHiddenOnly, false, false},
  };
  const Ws sizes[] = {Ws::kMin, Ws::kMid, Ws::kOptimal};

  for (int dtype : dtypes)
    for (const Shape& sh : shapes)
      for (const OptSet& o : optsets) {
        const Inputs in = make_inputs(sh, o, dtype, 1234 + sh.rows + sh.vocab);
        const Reference ref = reference(sh, o, in);
        for (const GradMode& m : modes) {
          if (dtype == FCE_FLOAT32 && m.gw_fp32) continue;  // the same as without the flag
          for (Ws ws : sizes) run_case({dtype, sh, o, m.grads, m.accumulate, m.gw_fp32, ws}, in, ref, stream);
        }
      }

  // CUDA graph capture + replay, bitwise equal to the eager call: one chunk direct (bf16, ws
  // optimal; and ws min of the first shape, where one 16-bit chunk of all 300 rows is smaller
  // than the f32 ∂W accumulator), several chunks with the f32 ∂W accumulator (bf16, ws min of
  // the second shape), f32 with accumulate (several chunks at ws min)
  for (const Shape& sh : {shapes[0], shapes[1]}) {
    const OptSet& o = optsets[0];
    for (int dtype : {FCE_BFLOAT16, FCE_FLOAT32}) {
      const Inputs in = make_inputs(sh, o, dtype, 4321);
      const Reference ref = reference(sh, o, in);
      for (Ws ws : {Ws::kMin, Ws::kOptimal}) {
        Case c{dtype, sh, o, Grads::kAll, dtype == FCE_FLOAT32, false, ws};
        c.graph = true;
        run_case(c, in, ref, stream);
      }
    }
  }

  // an out-of-range target: NaN loss, error flag, NaN gradients (checked against the reference)
  {
    const Shape sh = {300, 100, 1000, 0};
    const OptSet o = {"mean+invalid", FCE_REDUCTION_MEAN, true, 0.0, 0.0, 0.0, 1.0, false, 0, 0, true};
    for (int dtype : dtypes) {
      const Inputs in = make_inputs(sh, o, dtype, 99);
      const Reference ref = reference(sh, o, in);
      run_case({dtype, sh, o, Grads::kAll, false, false, Ws::kMin}, in, ref, stream);
    }
  }

  // a workspace one byte short of the minimum is refused
  {
    fce_options opt = FCE_OPTIONS_INIT;
    opt.dtype = FCE_BFLOAT16;
    opt.backend = g_cpu ? FCE_BACKEND_CPU : FCE_BACKEND_CUDA;
    size_t min_b = 0, opt_b = 0;
    fce_linear_ce_workspace_size(&opt, 300, 100, 1000, 1, &min_b, &opt_b);
    DevBuf h(300 * 100 * 2), w(1000 * 100 * 2), y(300 * 8), loss(4), dh(300 * 100 * 2),
        dw(1000 * 100 * 2), ws(min_b);
    y.fill(0);
    fce_status st = fce_linear_ce(&opt, 300, 100, 1000, h.p, w.p, nullptr, y.p, (float*)loss.p,
                                  nullptr, nullptr, dh.p, dw.p, nullptr, nullptr, nullptr, ws.p,
                                  min_b - 1, stream);
    report(st == FCE_ERROR_WORKSPACE_TOO_SMALL,
           std::string("workspace min-1 refused: ") + fce_status_string(st) + ": " + fce_last_error());
  }

  if (stream) CUDA_CHECK(cudaStreamDestroy(stream));
  std::printf("%s (%d failure%s)\n", g_failures ? "FAIL" : "PASS", g_failures, g_failures == 1 ? "" : "s");
  return g_failures ? 1 : 0;
}
