// fuzz_api.cpp — a libFuzzer target over the argument validation of fusedce's one-GPU entry
// points (fce_forward, fce_backward, fce_backward_rescale, fce_linear_ce, fce_scale_gradient and
// their workspace queries) on the CPU backend. (The vocabulary-parallel calls' bad input is
// tests/test_vp_errors.cpp's VpBadInput.) The case and its oracle are fuzz_case.h.
//
// Each input is one call: the fuzzer's bytes pick the entry point, the sizes, every field of
// fce_options (struct_size 104/136 and garbage ones, enums, option floats, strides, shift,
// reserved fields), which pointers are NULL, misaligned, or alias another buffer (in place, into
// a row gap, partly, adjacent), the workspace size and the data. The harness then
//   - judges the call with its own oracle, written from include/fusedce.h (not from lib/api.cpp):
//     valid, invalid (with the status codes that may answer it), or "either" where the header
//     leaves the answer open (every such case is listed in judge() with its reason);
//   - places every buffer in one arena with poisoned gaps between them (AddressSanitizer reports
//     any read or write outside the caller's buffers; without ASan the gaps are canaries), the
//     options struct ending where its struct_size says (the library must not read past it);
//   - calls the library and checks: an invalid call fails with one of the expected codes and
//     changes no byte; a valid call succeeds and changes only the elements of its outputs (row
//     gaps and inputs untouched, the backward calls never write argmax/accuracy); every required
//     output element written (outputs are poisoned first); ignored rows have loss 0, a zero
//     gradient row and argmax -1; out-of-range targets give NaN rows and exactly
//     FCE_FLAG_TARGET_OUT_OF_RANGE ORed into error_flags; with tame data, finite results;
//     fce_last_error() is "" after a success and names the function after a failure.
// Any failed check prints the call and aborts, which libFuzzer records as a crash (the input is
// saved; run the binary on it to reproduce, with FCE_FUZZ_VERBOSE=1 to print every call).
//
// Built by `make fuzz` (clang, -fsanitize=fuzzer,address,undefined, the library's sources
// compiled in, CPU only) and, without libFuzzer, as fuzz_replay (fuzz_replay_main.cpp), which
// runs the corpus in tests/fuzz/corpus as a ctest regression test against the built library.

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "fusedce.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FCE_FUZZ_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(FCE_FUZZ_ASAN)
#define FCE_FUZZ_ASAN 1
#endif
#if FCE_FUZZ_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define FUZZ_POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define FUZZ_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define FUZZ_POISON(p, n) ((void)(p), (void)(n))
#define FUZZ_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#include "fuzz_case.h"

namespace {

// ------------------------------------------------------------------ memory -----------------
struct Arena {
  std::vector<uint8_t> mem;  // [gap][slot0][gap][slot1]...[gap]
  uint8_t* base = nullptr;
  size_t used = 0;
};
Arena g_arena;

struct Slot {
  uint64_t start = 0, size = 0;
};

// ------------------------------------------------------------------ reporting --------------
std::string describe(const Case& c) {
  char line[512];
  std::string s;
  std::snprintf(line, sizeof line, "call %s rows=%lld vocab=%lld hidden=%lld count=%lld\n",
                kFnName[c.fn], (long long)c.rows, (long long)c.vocab, (long long)c.hidden,
                (long long)c.count);
  s += line;
  const fce_options& o = c.opt;
  std::snprintf(line, sizeof line,
                "options%s: struct_size=%zu backend=%d dtype=%d target_dtype=%d reduction=%d "
                "ignore_index=%lld row_stride=%lld grad_row_stride=%lld hidden_row_stride=%lld "
                "shift_seq_len=%lld shift=%lld\n  label_smoothing=%g z_loss_scale=%g softcap=%g "
                "logit_scale=%g deterministic=%d accumulate=%d grad_weight_fp32=%d "
                "token_scaling=%d vp_entropy=%d batch_invariant=%d (readable bytes %llu)\n",
                c.opt_null ? " (passed NULL)" : "", o.struct_size, o.backend, o.dtype,
                o.target_dtype, o.reduction, (long long)o.ignore_index, (long long)o.row_stride,
                (long long)o.grad_row_stride, (long long)o.hidden_row_stride,
                (long long)o.shift_seq_len, (long long)o.shift, (double)o.label_smoothing,
                (double)o.z_loss_scale, (double)o.softcap, (double)o.logit_scale,
                o.deterministic, o.accumulate, o.grad_weight_fp32, o.token_scaling, o.vp_entropy,
                o.batch_invariant, (unsigned long long)c.opt_bytes);
  s += line;
  if (c.fn == kScale) {
    std::snprintf(line, sizeof line, "scale_gradient: backend=%d dtype=%d\n", c.sg_backend,
                  c.sg_dtype);
    s += line;
  }
  std::snprintf(line, sizeof line,
                "workspace_bytes=%zu (query: %s %zu, optimal %zu) data_mode=%d targets=%d "
                "seed=%llu grad_output=%g\n",
                c.ws_bytes, c.ws_need_known ? "min" : "failed", c.ws_need, c.ws_opt, c.data_mode,
                c.target_mode, (unsigned long long)c.seed, c.gout_value);
  s += line;
  for (int id = 0; id < kNumBuf; ++id) {
    const Buffer& b = c.b[id];
    if (!b.present) continue;
    std::snprintf(line, sizeof line,
                  "  %-22s %p slot %d +%llu%s%s [%lld x %lld, stride %lld, %llu B/elem] "
                  "declared %llu B%s\n",
                  kBufName[id], (void*)b.ptr, b.slot, (unsigned long long)b.offset,
                  b.alias_of >= 0 ? " alias of " : "", b.alias_of >= 0 ? kBufName[b.alias_of] : "",
                  (long long)b.rows, (long long)b.cols, (long long)b.stride,
                  (unsigned long long)b.es, (unsigned long long)b.declared,
                  b.capped() ? " (capped)" : "");
    s += line;
  }
  for (const Defect& d : c.defects) {
    std::snprintf(line, sizeof line, "  oracle: %s: %s (%s)%s\n",
                  d.sev == kInvalid ? "INVALID" : "either", d.what.c_str(),
                  fce_status_string(d.code), d.capped_dep ? " [capped]" : "");
    s += line;
  }
  return s;
}

// The arena before the call (for the report of a failure).
const std::vector<uint8_t>* g_before = nullptr;
// The call under way, described when AddressSanitizer stops the process inside it (fuzz_replay
// built with ASan; libFuzzer installs its own death callback, and UBSan calls none: there, run
// the saved input with FCE_FUZZ_VERBOSE=1, which prints each call before making it).
const Case* g_current = nullptr;

// The first elements of each buffer, before and after the call.
std::string dump(const Case& c) {
  std::string s;
  char line[128];
  for (int id = 0; id < kNumBuf && g_before; ++id) {
    const Buffer& b = c.b[id];
    if (!b.present || b.es == 1) continue;
    const uint64_t off = uint64_t(b.ptr - g_arena.base);
    for (int when = 0; when < 2; ++when) {
      const uint8_t* p = when ? b.ptr : g_before->data() + off;
      s += std::string("  ") + (when ? "after  " : "before ") + kBufName[id] + ":";
      for (uint64_t i = 0; i < 12 && (i + 1) * b.es <= b.backed(); ++i) {
        if (b.dtype == FCE_INT64 || b.dtype == FCE_INT32) {
          int64_t v = 0;
          if (b.es == 8) std::memcpy(&v, p + 8 * i, 8);
          else { int32_t w; std::memcpy(&w, p + 4 * i, 4); v = w; }
          std::snprintf(line, sizeof line, " %lld", (long long)v);
        } else {
          std::snprintf(line, sizeof line, " %.9g", load(b.dtype, p + i * b.es));
        }
        s += line;
      }
      s += "\n";
    }
  }
  return s;
}

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.9g", v);
  return b;
}

[[noreturn]] void fail(const Case& c, const std::string& what) {
  std::fprintf(stderr, "\n==== fusedce fuzz: %s\n%s%s", what.c_str(), describe(c).c_str(),
               dump(c).c_str());
  std::fflush(stderr);
  std::abort();
}

// ------------------------------------------------------------------ data -------------------
struct RowInfo {
  enum Kind { kScored, kIgnored, kInvalidRow } kind;
};

int64_t read_target(const Case& c, const uint8_t* t, int64_t i) {
  if (c.eff.target_dtype == FCE_INT32) {
    int32_t v;
    std::memcpy(&v, t + 4 * i, 4);
    return v;
  }
  int64_t v;
  std::memcpy(&v, t + 8 * i, 8);
  return v;
}

// docs/semantics.md rules 1-3: each row scored, ignored or invalid, from the targets in memory.
std::vector<RowInfo::Kind> row_kinds(const Case& c) {
  std::vector<RowInfo::Kind> k(size_t(c.rows));
  const uint8_t* t = c.b[B_TARGETS].ptr;
  const int64_t T = c.eff.shift_seq_len, shift = c.eff.shift ? c.eff.shift : 1;
  for (int64_t r = 0; r < c.rows; ++r) {
    int64_t src = r;
    if (T > 0) {
      const int64_t pos = r % T;
      if (pos >= T - shift) {
        k[size_t(r)] = RowInfo::kIgnored;
        continue;
      }
      src = r + shift;
    }
    const int64_t y = read_target(c, t, src);
    k[size_t(r)] = y == c.eff.ignore_index ? RowInfo::kIgnored
                   : (y < 0 || y >= c.vocab) ? RowInfo::kInvalidRow
                                            : RowInfo::kScored;
  }
  return k;
}

double special_value(Rng& rng) {
  const double v[] = {std::numeric_limits<double>::quiet_NaN(), HUGE_VAL, -HUGE_VAL, 3e38, -3e38,
                      65504.0, -1e30, 1e-40, 0.0};
  return v[rng.below(sizeof v / sizeof v[0])];
}

void fill_buffer(Case& c, Buffer& b, Rng& rng) {
  uint8_t* p = b.ptr;
  const uint64_t n = b.backed();
  switch (b.fill) {
    case kFillPoison:
      for (uint64_t i = 0; i + b.es <= n; i += b.es) put_poison(b.es, p + i);
      break;
    case kFillFlags: {
      uint32_t f = uint32_t(rng.next());
      if (rng.below(2)) f &= ~uint32_t(FCE_FLAG_TARGET_OUT_OF_RANGE);
      if (n >= 4) std::memcpy(p, &f, 4);
      break;
    }
    case kFillRaw:
      for (uint64_t i = 0; i < n; ++i) p[i] = uint8_t(rng.next());
      break;
    case kFillTargets: {
      const uint64_t es = b.es;
      for (uint64_t i = 0; i + es <= n; i += es) {
        int64_t y = int64_t(rng.below(uint64_t(std::max<int64_t>(1, std::min(c.vocab, kMaxVocab)))));
        const uint64_t u = rng.below(16);
        if (c.target_mode >= 1 && u < 3) y = c.eff.ignore_index;
        if (c.target_mode == 2 && u == 3) {
          const int64_t bad[] = {-1, c.vocab, wadd(c.vocab, 1), std::numeric_limits<int32_t>::min(),
                                 std::numeric_limits<int64_t>::max(), -100};
          y = bad[rng.below(6)];
        }
        if (es == 4) {
          const int32_t v = int32_t(y);
          std::memcpy(p + i, &v, 4);
        } else {
          std::memcpy(p + i, &y, 8);
        }
      }
      break;
    }
    default: {  // values of b.dtype
      if (c.data_mode == 2) {
        for (uint64_t i = 0; i < n; ++i) p[i] = uint8_t(rng.next());
        break;
      }
      double lo = -8, hi = 8;
      if (&b == &c.b[B_HIDDEN] || &b == &c.b[B_WEIGHT] || &b == &c.b[B_BIAS] ||
          &b == &c.b[B_GW] || &b == &c.b[B_GB] || &b == &c.b[B_GRAD]) {
        lo = -1;
        hi = 1;
      }
      if (b.fill == kFillWeights) lo = 0.1, hi = 2;
      if (b.fill == kFillScalar) lo = -4, hi = 4;
      for (uint64_t i = 0; i + b.es <= n; i += b.es) {
        double v = rng.uniform(lo, hi);
        if (c.data_mode == 1 && rng.below(8) == 0) v = special_value(rng);
        store(b.dtype, p + i, v);
      }
      if (b.fill == kFillScalar && n >= 4) {
        store(FCE_FLOAT32, p, c.gout_value);  // the scalar (or the first per-row value)
      }
      break;
    }
  }
}

// The saved lse of the backward calls, as fce_forward computes it (docs/semantics.md rule 8), when the data
// is tame; and the gradient fce_backward_rescale starts from: 0 in ignored rows, NaN in invalid
// ones (what fce_forward wrote), other values elsewhere.
void derived_fill(Case& c) {
  const fce_options& o = c.eff;
  if (c.b[B_LSE_IN].present && c.data_mode == 0 && c.b[B_LOGITS].present) {
    const Buffer& z = c.b[B_LOGITS];
    for (int64_t r = 0; r < c.rows; ++r) {
      double m = -HUGE_VAL, s = 0;
      std::vector<double> a(size_t(c.vocab));
      for (int64_t j = 0; j < c.vocab; ++j) {
        double x = o.logit_scale * float(load(o.dtype, z.ptr + (uint64_t(r) * z.stride + j) * z.es));
        x = float(x);
        if (o.softcap > 0) x = float(o.softcap * std::tanh(x / o.softcap));
        a[size_t(j)] = x;
        m = std::max(m, x);
      }
      for (double x : a) s += std::exp(x - m);
      store(FCE_FLOAT32, c.b[B_LSE_IN].ptr + 4 * uint64_t(r), m + std::log(s));
    }
  }
  if (c.fn == kRescale && c.b[B_GRAD].present && c.b[B_TARGETS].present) {
    const Buffer& g = c.b[B_GRAD];
    const auto kinds = row_kinds(c);
    for (int64_t r = 0; r < c.rows; ++r) {
      if (kinds[size_t(r)] == RowInfo::kScored) continue;
      const double v = kinds[size_t(r)] == RowInfo::kIgnored
                           ? 0.0 : std::numeric_limits<double>::quiet_NaN();
      for (int64_t j = 0; j < c.vocab; ++j)
        store(g.dtype, g.ptr + (uint64_t(r) * g.stride + j) * g.es, v);
    }
  }
}

// ------------------------------------------------------------------ the call ---------------
fce_status invoke(Case& c, const fce_options* o) {
  auto P = [&](BufId id) -> void* { return c.b[id].present ? c.b[id].ptr : nullptr; };
  auto F = [&](BufId id) { return static_cast<float*>(P(id)); };
  // The outputs (argmax and accuracy only for the calls that write them: declare_call) and the
  // gradients, each in its structure.
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = F(B_LOSS);
  out.lse = F(B_LSE);
  out.z_loss = F(B_ZLOSS);
  out.argmax = static_cast<int64_t*>(P(B_ARGMAX));
  out.accuracy = F(B_ACC);
  out.error_flags = static_cast<uint32_t*>(P(B_FLAGS));
  fce_outputs flags = FCE_OUTPUTS_INIT;
  flags.error_flags = out.error_flags;
  fce_gradients g = FCE_GRADIENTS_INIT;
  g.grad_output = F(B_GOUT);
  g.grad_logits = P(B_GRAD);
  fce_gradients lg = FCE_GRADIENTS_INIT;
  lg.grad_output = F(B_GOUT);
  lg.grad_hidden = P(B_GH);
  lg.grad_weight = P(B_GW);
  lg.grad_bias = P(B_GB);
  switch (c.fn) {
    case kForward:
      return fce_forward(o, c.rows, c.vocab, P(B_LOGITS), P(B_TARGETS), &out, &g, P(B_WS),
                         c.ws_bytes, c.stream);
    case kBackward:
      return fce_backward(o, c.rows, c.vocab, P(B_LOGITS), P(B_TARGETS), F(B_LSE_IN), &flags, &g,
                          P(B_WS), c.ws_bytes, c.stream);
    case kRescale:
      return fce_backward_rescale(o, c.rows, c.vocab, P(B_LOGITS), P(B_TARGETS), F(B_LSE_IN),
                                  &flags, &g, P(B_WS), c.ws_bytes, c.stream);
    case kLinear:
      return fce_linear_ce(o, c.rows, c.hidden, c.vocab, P(B_HIDDEN), P(B_WEIGHT), P(B_BIAS),
                           P(B_TARGETS), &out, &lg, P(B_WS), c.ws_bytes, c.stream);
    case kScale:
      return fce_scale_gradient(c.sg_backend, c.sg_dtype, c.count, P(B_GRAD), F(B_GOUT), c.stream);
    case kQueryForward:
      return fce_forward_workspace_size(o, c.rows, c.vocab, static_cast<size_t*>(P(B_Q0)));
    case kQueryBackward:
      return fce_backward_workspace_size(o, c.rows, c.vocab, static_cast<size_t*>(P(B_Q0)));
    case kQueryLinear:
      return fce_linear_ce_workspace_size(o, c.rows, c.hidden, c.vocab, c.with_grad,
                                          static_cast<size_t*>(P(B_Q0)),
                                          static_cast<size_t*>(P(B_Q1)));
    default: return FCE_ERROR_INTERNAL;
  }
}

// ------------------------------------------------------------------ checks -----------------
// After a successful, valid call whose buffers are all disjoint: the outputs' contents.
void check_outputs(Case& c) {
  const fce_options& o = c.eff;
  const bool ce_fwd = c.fn == kForward, lin = c.fn == kLinear;
  const bool forward_like = ce_fwd || lin;
  auto buf = [&](BufId id) -> const Buffer* { return c.b[id].present ? &c.b[id] : nullptr; };
  // every element of a must-write output written (not poison any more)
  for (int id = 0; id < kNumBuf; ++id) {
    const Buffer& b = c.b[id];
    if (!b.present || !b.must_write || b.role != kOut) continue;
    if (id == B_GRAD && buf(B_LOGITS) && b.ptr == c.b[B_LOGITS].ptr) continue;  // in place
    // The float16 poison is a quiet NaN: from raw input bits, a NaN of its payload can come out
    // of the arithmetic as it is (payloads propagate), and look unwritten.
    if (c.data_mode == 2 && b.dtype == FCE_FLOAT16) continue;
    for (int64_t r = 0; r < b.rows; ++r)
      for (int64_t j = 0; j < b.cols; ++j)
        if (is_poison(b.es, b.ptr + (uint64_t(r) * b.stride + j) * b.es))
          fail(c, std::string(kBufName[id]) + ": element (" + std::to_string(r) + ", " +
                      std::to_string(j) + ") never written");
  }
  if (c.fn == kQueryLinear && buf(B_Q1)) {
    size_t lo, hi;
    std::memcpy(&lo, c.b[B_Q0].ptr, 8);
    std::memcpy(&hi, c.b[B_Q1].ptr, 8);
    if (hi < lo) fail(c, "optimal_bytes < min_bytes");
  }
  if (!(forward_like || c.fn == kBackward || c.fn == kRescale)) return;
  const auto kinds = row_kinds(c);
  bool any_invalid = false, any_counted = false;
  for (auto k : kinds) {
    any_invalid |= k == RowInfo::kInvalidRow;
    any_counted |= k != RowInfo::kIgnored;
  }
  const bool none = o.reduction == FCE_REDUCTION_NONE;
  if (forward_like) {
    const Buffer& loss = c.b[B_LOSS];
    for (int64_t r = 0; none && r < c.rows; ++r) {
      const double l = load(FCE_FLOAT32, loss.ptr + 4 * uint64_t(r));
      if (kinds[size_t(r)] == RowInfo::kIgnored && l != 0.0)
        fail(c, "loss of ignored row " + std::to_string(r) + " is " + num(l));
      if (kinds[size_t(r)] == RowInfo::kInvalidRow && !std::isnan(l))
        fail(c, "loss of invalid row " + std::to_string(r) + " is not NaN");
    }
    if (!none && any_invalid && !std::isnan(load(FCE_FLOAT32, loss.ptr)))
      fail(c, "reduced loss with an invalid row is not NaN");
    if (const Buffer* am = buf(B_ARGMAX)) {
      for (int64_t r = 0; r < c.rows; ++r) {
        int64_t a;
        std::memcpy(&a, am->ptr + 8 * uint64_t(r), 8);
        const bool ignored = kinds[size_t(r)] == RowInfo::kIgnored;
        if (ignored ? a != -1 : (a < 0 || a >= c.vocab))
          fail(c, "argmax of row " + std::to_string(r) + " is " + std::to_string(a));
      }
    }
    if (const Buffer* acc = buf(B_ACC)) {
      for (int64_t r = 0; r < (none ? c.rows : 1); ++r) {
        const double a = load(FCE_FLOAT32, acc->ptr + 4 * uint64_t(r));
        const bool zero_row = none && kinds[size_t(r)] != RowInfo::kScored;
        const bool ok = zero_row ? a == 0.0
                        : none   ? (a == 0.0 || a == 1.0)
                                 : (a >= 0.0 && a <= 1.0 && (any_counted || a == 0.0));
        if (!ok) fail(c, "accuracy[" + std::to_string(r) + "] is " + num(a));
      }
    }
  }
  // gradient rows of ignored rows all 0, of invalid rows all NaN
  const Buffer* g = (c.fn == kForward || c.fn == kBackward || c.fn == kRescale) ? buf(B_GRAD)
                                                                                : nullptr;
  if (g) {
    for (int64_t r = 0; r < c.rows; ++r) {
      const auto k = kinds[size_t(r)];
      if (k == RowInfo::kScored) continue;
      for (int64_t j = 0; j < c.vocab; ++j) {
        const double v = load(g->dtype, g->ptr + (uint64_t(r) * g->stride + j) * g->es);
        if (k == RowInfo::kIgnored ? v != 0.0 : !std::isnan(v))
          fail(c, "gradient of " + std::string(k == RowInfo::kIgnored ? "ignored" : "invalid") +
                      " row " + std::to_string(r) + " has " + num(v) + " at column " +
                      std::to_string(j));
      }
    }
  }
  // tame data (finite, moderate), tame options, no invalid rows: finite results
  const bool tame = c.data_mode == 0 && c.tame_options && !c.gout_special && !any_invalid;
  if (!tame) return;
  auto all_finite = [&](BufId id, bool rows_only_scored) {
    const Buffer* b = buf(id);
    if (!b || b->role == kIgnored) return;
    if (b->es == 2 && b->dtype == FCE_FLOAT16) return;  // a float16 gradient may overflow
    for (int64_t r = 0; r < b->rows; ++r) {
      if (rows_only_scored && kinds[size_t(r)] != RowInfo::kScored) continue;
      for (int64_t j = 0; j < b->cols; ++j) {
        const double v = load(b->dtype, b->ptr + (uint64_t(r) * b->stride + j) * b->es);
        if (!std::isfinite(v))
          fail(c, std::string(kBufName[id]) + " (" + std::to_string(r) + ", " +
                      std::to_string(j) + ") is " + num(v) + " on tame data");
      }
    }
  };
  if (forward_like) {
    all_finite(B_LOSS, false);
    all_finite(B_LSE, false);
    all_finite(B_ZLOSS, false);
  }
  if (c.fn == kForward || c.fn == kBackward) all_finite(B_GRAD, false);
  if (lin) {
    all_finite(B_GH, false);
    all_finite(B_GW, false);
    all_finite(B_GB, false);
  }
}

void check_error_flags(const Case& c, const std::vector<uint8_t>& snapshot) {
  const Buffer& f = c.b[B_FLAGS];
  if (!f.present) return;
  uint32_t before, after;
  std::memcpy(&before, snapshot.data() + (f.ptr - g_arena.base), 4);
  std::memcpy(&after, f.ptr, 4);
  const auto kinds = row_kinds(c);
  bool any_invalid = false;
  for (auto k : kinds) any_invalid |= k == RowInfo::kInvalidRow;
  const uint32_t want = before | (any_invalid ? FCE_FLAG_TARGET_OUT_OF_RANGE : 0u);
  // fce_backward_rescale returns at once for an upstream 1, or scales exact cases in place
  const bool may_skip = c.fn == kRescale;
  if (after != want && !(may_skip && after == before))
    fail(c, "error_flags " + std::to_string(before) + " -> " + std::to_string(after) +
                ", expected " + std::to_string(want));
}

// ------------------------------------------------------------------ one input --------------
void run_options_default(Input& in) {
  // fce_options_default writes options->struct_size bytes at most (0: FCE_OPTIONS_SIZE_V1_0),
  // the defaults of FCE_OPTIONS_INIT; nothing when options is NULL.
  const size_t sizes[] = {0, FCE_OPTIONS_SIZE_V1_0, 104, 136, 8, 16, 100, 112, 200, 4, 1};
  const size_t s = sizes[in.below(sizeof sizes / sizeof sizes[0])];
  if (in.below(16) == 15) {
    fce_options_default(nullptr);
    return;
  }
  const size_t n = s == 0 ? FCE_OPTIONS_SIZE_V1_0 : s;
  const size_t room = std::max<size_t>(8, (std::min<size_t>(n, 256) + 7) & ~size_t(7));
  std::vector<uint8_t> mem(room + 64, 0xA5);
  uint8_t* p = mem.data();  // 8-aligned (vector of new'ed memory: 16)
  std::memcpy(p, &s, sizeof s);
  FUZZ_POISON(p + room, 64);
  fce_options_default(reinterpret_cast<fce_options*>(p));
  FUZZ_UNPOISON(p + room, 64);
  fce_options want = FCE_OPTIONS_INIT;
  want.struct_size = s == 0 ? FCE_OPTIONS_SIZE_V1_0 : s;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(&want);
  const size_t limit = std::min(n, sizeof(fce_options));
  Case dummy;
  dummy.fn = kOptionsDefault;
  dummy.opt.struct_size = s;
  for (size_t i = 0; i < room + 64; ++i) {
    const uint8_t before = i < sizeof s ? reinterpret_cast<const uint8_t*>(&s)[i] : 0xA5;
    if (i >= limit) {
      if (p[i] != before) fail(dummy, "fce_options_default wrote byte " + std::to_string(i));
      continue;
    }
    const bool full = s == 0 || s == FCE_OPTIONS_SIZE_V1_0;
    if (full ? p[i] != w[i] : (p[i] != before && p[i] != w[i]))
      fail(dummy, "fce_options_default: byte " + std::to_string(i) + " is not the default");
  }
}

void run_misc(Input& in) {
  Case dummy;
  dummy.fn = kMisc;
  // Any value of the enum's range [0, 15] (C++: a value outside it is undefined behaviour in
  // the caller already; from C, status.cpp's switch on the enum would load it: reported).
  const int32_t code = int32_t(in.below(16));
  const char* s = fce_status_string(static_cast<fce_status>(code));
  if (!s || !*s) fail(dummy, "fce_status_string(" + std::to_string(code) + ") is empty");
  if (code >= 0 && code <= 10) {
    const char* names[] = {"FCE_SUCCESS", "FCE_ERROR_INVALID_ARGUMENT", "FCE_ERROR_NULL_POINTER",
                           "FCE_ERROR_MISALIGNED", "FCE_ERROR_UNSUPPORTED",
                           "FCE_ERROR_WORKSPACE_TOO_SMALL", "FCE_ERROR_BACKEND_UNAVAILABLE",
                           "FCE_ERROR_CUDA", "FCE_ERROR_CUBLAS", "FCE_ERROR_INTERNAL",
                           "FCE_ERROR_OUT_OF_MEMORY"};
    if (std::strncmp(s, names[code], std::strlen(names[code])) != 0)
      fail(dummy, std::string("fce_status_string: ") + s);
  }
  if (fce_version() != FCE_VERSION_NUMBER) fail(dummy, "fce_version");
  const int cuda = fce_cuda_available();
  if (cuda != 0 && cuda != 1) fail(dummy, "fce_cuda_available");
  if (!fce_last_error()) fail(dummy, "fce_last_error is NULL");
  const char* info = fce_build_info();
  if (!info || !*info || std::strchr(info, '\n') || fce_build_info() != info)
    fail(dummy, "fce_build_info: not one stable line");
}

int run_one(const uint8_t* data, size_t size) {
  g_before = nullptr;
  Input in(data, size);
  Case c;
  // entry point: the compute calls most often
  const uint8_t f = in.byte();
  const Fn table[16] = {kForward, kForward, kForward, kBackward, kBackward, kRescale, kRescale,
                        kLinear, kLinear, kLinear, kScale, kQueryForward, kQueryBackward,
                        kQueryLinear, kOptionsDefault, kMisc};
  c.fn = table[f % 16];
  if (c.fn == kOptionsDefault) {
    run_options_default(in);
    return 0;
  }
  if (c.fn == kMisc) {
    run_misc(in);
    return 0;
  }
  // sizes
  c.rows = gen_size(in, 24, 300, c);
  c.vocab = gen_size(in, 160, 2500, c);
  c.hidden = gen_size(in, 24, 80, c);
  if (c.fn == kScale) {
    const uint8_t sel = in.byte();
    c.count = sel < 200 ? int64_t(in.u16() % 2048) : sel < 240 ? int64_t(in.u32() % (1u << 20))
                                                               : interesting_i64(in, c);
    c.sg_backend = FCE_BACKEND_CPU;
    c.sg_dtype = int32_t(in.below(3));
    if (in.below(16) == 15) c.sg_backend = interesting_i32(in);
    if (in.below(16) == 15) c.sg_dtype = interesting_i32(in);
  } else {
    gen_options(in, c);
  }
  c.with_grad = int32_t(in.below(4) == 3 ? interesting_i32(in) : in.below(2));
  // data
  c.seed = in.u64();
  const uint8_t dm = in.byte();
  c.data_mode = dm < 192 ? 0 : dm < 224 ? 1 : 2;
  c.target_mode = int(in.below(3));
  {
    const double g[] = {1.0, 0.5, -2.0, 0.0, -0.0, 0.3, 3.7, 1.0 / 1024, 0x1p-126, 0x1p-149,
                        0x1p127, std::numeric_limits<double>::quiet_NaN(), HUGE_VAL, -1.0};
    const unsigned k = in.below(sizeof g / sizeof g[0]);
    c.gout_value = g[k];
    c.gout_special = !(std::fabs(c.gout_value) <= 4.0) || (c.gout_value != 0 &&
                                                           std::fabs(c.gout_value) < 1e-30);
  }
  const uint8_t st = in.byte();
  c.stream = st < 128 ? nullptr : reinterpret_cast<void*>(uintptr_t(0xdead0000u) + st);  // ignored
  if (c.fn != kScale) c.tame_options = is_tame_options(c.eff);
  if (c.fn != kScale && c.eff.backend == FCE_BACKEND_CUDA && g_cuda) return 0;
  if (c.fn == kScale && c.sg_backend == FCE_BACKEND_CUDA && g_cuda) return 0;

  declare_call(in, c);
  if (c.fn == kForward || c.fn == kBackward || c.fn == kRescale || c.fn == kLinear) {
    query_workspace(c);
    gen_workspace(in, c);
  }
  gen_placement(in, c);
  // the placement may have made a gradient NULL: the need is the query's for the call as made
  if (c.fn == kLinear) {
    c.ws_need_known = false;
    query_workspace(c);
  }

  // Slots: sizes from their members' extents (backed bytes), laid out with gaps.
  int nslots = 0;
  for (int id = 0; id < kNumBuf; ++id)
    if (c.b[id].present) nslots = std::max(nslots, c.b[id].slot + 1);
  std::vector<Slot> slots(size_t(nslots) + 1);  // the last one: the options struct
  for (int id = 0; id < kNumBuf; ++id) {
    const Buffer& b = c.b[id];
    if (!b.present) continue;
    Slot& s = slots[size_t(b.slot)];
    s.size = std::max<uint64_t>(s.size, b.offset + b.backed());
  }
  slots.back().size = c.opt_bytes;
  uint64_t pos = kGap;
  for (Slot& s : slots) {
    s.start = pos;
    pos += (s.size + 63) / 64 * 64 + kGap;
  }
  if (pos > (uint64_t(64) << 20)) return 0;  // never with the caps above; a safety net
  Arena& A = g_arena;
  if (A.mem.size() < pos + 256) A.mem.assign(pos + 256, 0);
  A.base = reinterpret_cast<uint8_t*>((uintptr_t(A.mem.data()) + 255) & ~uintptr_t(255));
  A.used = pos;
  std::memset(A.base, kGapByte, pos);
  for (int id = 0; id < kNumBuf; ++id) {
    Buffer& b = c.b[id];
    if (b.present) b.ptr = A.base + slots[size_t(b.slot)].start + b.offset;
  }
  uint8_t* opt_ptr = A.base + slots.back().start;

  // The options struct: its pointers into the arena, written up to its readable bytes.
  auto ptr_or_null = [&](BufId id) { return c.b[id].present ? c.b[id].ptr : nullptr; };
  if (c.fn != kScale) {
    c.opt.class_weights = reinterpret_cast<const float*>(ptr_or_null(B_CW));
    c.eff.class_weights = c.opt.class_weights;
    std::memcpy(opt_ptr, &c.opt, size_t(std::min<uint64_t>(c.opt_bytes, sizeof(fce_options))));
  }

  judge(c);
  // Verdict: invalid when a defect independent of any capped buffer says so; a call with a
  // buffer we could not back is made only then.
  bool invalid = false, either = false, capped = false;
  for (const Defect& d : c.defects) {
    if (d.sev == kInvalid && !d.capped_dep) invalid = true;
    if (d.sev == kEither) either = true;
  }
  const bool query = c.fn == kQueryForward || c.fn == kQueryBackward || c.fn == kQueryLinear;
  for (int id = 0; id < kNumBuf; ++id)  // a query reads no buffer: their sizes do not matter
    capped |= c.b[id].present && c.b[id].capped() && !query;
  if (capped && !invalid) return 0;
  const bool compute = c.fn == kForward || c.fn == kBackward || c.fn == kRescale ||
                       c.fn == kLinear;
  if (compute && !c.ws_need_known && c.defects.empty())
    fail(c, "the workspace query failed on the options and sizes of a valid call");
  // A valid call computes: keep it small enough for thousands of calls a second under the
  // sanitizers (chunk boundaries, 256 rows in the CPU linear CE, stay reachable).
  if (!invalid) {
    const u128 work = u128(uint64_t(std::max<int64_t>(c.rows, 1))) *
                      uint64_t(std::max<int64_t>(c.vocab, 1)) *
                      uint64_t(c.fn == kLinear ? std::max<int64_t>(c.hidden, 1) : 1);
    if (work > kMaxWork || (c.fn == kScale && c.count > (int64_t(1) << 20))) return 0;
  }
  if (!invalid) {
    for (const Defect& d : c.defects) invalid |= d.sev == kInvalid;
  }

  // Data, then a snapshot; the gaps poisoned for the call.
  Rng rng{c.seed};
  for (int id = 0; id < kNumBuf; ++id) {
    const bool in_place = id == B_GRAD && c.b[B_LOGITS].present && c.b[id].present &&
                          c.b[id].ptr == c.b[B_LOGITS].ptr;  // the logits are its contents
    if (c.b[id].present && !in_place) fill_buffer(c, c.b[id], rng);
  }
  if (!invalid) derived_fill(c);
  std::vector<uint8_t> snapshot(A.base, A.base + pos);
  g_before = &snapshot;
  for (size_t i = 0; i < slots.size(); ++i) {
    const uint64_t end = slots[i].start + slots[i].size;
    const uint64_t next = i + 1 < slots.size() ? slots[i + 1].start : pos;
    FUZZ_POISON(A.base + end, next - end);
  }
  FUZZ_POISON(A.base, kGap);
  if (g_verbose) std::fprintf(stderr, "---- %s", describe(c).c_str());

  g_current = &c;
  const auto t0 = std::chrono::steady_clock::now();
  const fce_status status = invoke(c, c.opt_null ? nullptr : reinterpret_cast<fce_options*>(opt_ptr));
  if (g_timing)
    std::fprintf(stderr, "time %s %lld x %lld x %lld: %.3f ms\n", kFnName[c.fn],
                 (long long)c.rows, (long long)c.vocab, (long long)c.hidden,
                 std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                     .count());
  g_current = nullptr;
  const std::string msg = fce_last_error() ? fce_last_error() : "(NULL)";
  FUZZ_UNPOISON(A.base, pos);
  if (g_verbose) std::fprintf(stderr, "  -> %s \"%s\"\n", fce_status_string(status), msg.c_str());

  if (status < FCE_SUCCESS || status > FCE_ERROR_OUT_OF_MEMORY)
    fail(c, "status " + std::to_string(int(status)) + " is no fce_status");
  if (status == FCE_ERROR_INTERNAL) fail(c, "FCE_ERROR_INTERNAL: " + msg);
  if (status == FCE_SUCCESS) {
    if (invalid) fail(c, "SUCCESS on an invalid call");
    if (!msg.empty()) fail(c, "fce_last_error() after a success: \"" + msg + "\"");
  } else {
    if (!invalid && !either)
      fail(c, std::string("error on a valid call: ") + fce_status_string(status) + " \"" + msg +
                  "\"");
    bool expected = false;
    for (const Defect& d : c.defects) expected |= d.code == status;
    if (!expected)
      fail(c, std::string("unexpected status ") + fce_status_string(status) + " \"" + msg + "\"");
    const std::string prefix = std::string(kFnName[c.fn]) + ":";
    if (msg.compare(0, prefix.size(), prefix) != 0)
      fail(c, "fce_last_error() does not start with \"" + prefix + "\": \"" + msg + "\"");
  }

  // What changed: nothing after a failure; after a success only output elements (and the
  // workspace, and error_flags). `expect` is the snapshot with those elements taken from now.
  std::vector<uint8_t> expect = snapshot;
  if (status == FCE_SUCCESS) {
    for (int id = 0; id < kNumBuf; ++id) {
      const Buffer& b = c.b[id];
      if (!b.present || !is_output(b.role)) continue;
      const uint64_t base = uint64_t(b.ptr - A.base);
      auto allow = [&](uint64_t s, uint64_t e) {
        e = std::min<uint64_t>(e, pos);
        if (s < e) std::memcpy(expect.data() + s, A.base + s, e - s);
      };
      if (b.rows <= 1 || b.es == 1) {
        allow(base, base + b.backed());
        continue;
      }
      for (int64_t r = 0; r < b.rows; ++r) {
        const uint64_t s = base + uint64_t(r) * uint64_t(b.stride) * b.es;
        if (s >= pos) break;
        allow(s, s + uint64_t(b.cols) * b.es);
      }
    }
  }
  if (std::memcmp(expect.data(), A.base, pos) != 0) {
    uint64_t i = 0;
    while (expect[i] == A.base[i]) ++i;
    std::string where = "a gap between buffers";
    for (int id = 0; id < kNumBuf; ++id) {
      const Buffer& b = c.b[id];
      if (b.present && A.base + i >= b.ptr && A.base + i < b.ptr + b.backed()) {
        where = std::string(kBufName[id]) + " + " + std::to_string(A.base + i - b.ptr);
        break;
      }
    }
    if (A.base + i >= opt_ptr && A.base + i < opt_ptr + c.opt_bytes) where = "the options struct";
    fail(c, std::string(status == FCE_SUCCESS ? "a write outside the outputs"
                                              : "a write by a failing call") +
                " at arena byte " + std::to_string(i) + " (" + where + ")");
  }
  if (status != FCE_SUCCESS || invalid || either) return 0;

  // A valid call that succeeded, buffers disjoint or sharing inputs only: its outputs.
  bool disjoint = true;
  for (int i = 0; i < kNumBuf; ++i)
    for (int j = i + 1; j < kNumBuf; ++j)
      if (c.b[i].present && c.b[j].present && spans_overlap(c.b[i], c.b[j]) &&
          !(i == B_LOGITS && j == B_GRAD))
        disjoint = false;
  if (c.fn == kForward || c.fn == kBackward || c.fn == kRescale || c.fn == kLinear)
    check_error_flags(c, snapshot);
  if (disjoint) check_outputs(c);
  return 0;
}

}  // namespace

namespace {
void describe_current() {
  if (g_current)
    std::fprintf(stderr, "\n==== fusedce fuzz: the call that was running\n%s%s",
                 describe(*g_current).c_str(), dump(*g_current).c_str());
}
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
#if FCE_FUZZ_ASAN
  __sanitizer_set_death_callback(describe_current);
#endif
  g_verbose = std::getenv("FCE_FUZZ_VERBOSE") != nullptr;
  g_timing = std::getenv("FCE_FUZZ_TIMING") != nullptr;
  g_cuda = fce_cuda_available() != 0;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return run_one(data, size);
}
