// fuzz_case.h — the fuzz target's case (fuzz_api.cpp): the fuzzer's bytes read as one call
// (the entry point, sizes, every field of fce_options, the buffers and their placement, the
// workspace), and the oracle that judges the call from include/fusedce.h: valid, invalid (with
// the status codes that may answer it), or either.
#pragma once

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

namespace {

using u128 = unsigned __int128;
using i128 = __int128;

constexpr uint64_t kCap = uint64_t(2) << 20;       // bytes a buffer may have to be backed
constexpr uint64_t kCappedBacking = 4096;          // bytes backing a larger one (invalid calls)
constexpr uint64_t kNoBuffer = uint64_t(1) << 62;  // declared this large: no such buffer exists
constexpr uint64_t kMaxWork = uint64_t(1) << 17;  // rows x vocab (x hidden) of a valid call
constexpr uint64_t kGap = 64;                      // poisoned bytes between buffers
constexpr int64_t kMaxVocab = std::numeric_limits<int32_t>::max();
constexpr uint8_t kGapByte = 0xC3;
constexpr uint32_t kPoison32 = 0xFFBADBADu;  // a signalling NaN no arithmetic produces
constexpr uint16_t kPoison16 = 0xFFBAu;      // NaN as binary16 and as bfloat16
constexpr uint64_t kPoison64 = 0xBADBADBADBADBAD5ull;

bool g_verbose = false;  // FCE_FUZZ_VERBOSE: print every call and its answer
bool g_timing = false;   // FCE_FUZZ_TIMING: print how long each call took
bool g_cuda = false;  // the library has a usable CUDA backend: CUDA-backend calls are skipped

// ------------------------------------------------------------------ input ------------------
// The fuzzer's bytes, consumed from the front; an exhausted input reads zeros, and every choice
// is arranged so that zeros mean "the plain valid call".
class Input {
 public:
  Input(const uint8_t* d, size_t n) : d_(d), n_(n) {}
  uint8_t byte() {
    if (!n_) return 0;
    --n_;
    return *d_++;
  }
  uint16_t u16() { return uint16_t(byte() | (unsigned(byte()) << 8)); }
  uint32_t u32() { return uint32_t(u16()) | (uint32_t(u16()) << 16); }
  uint64_t u64() { return uint64_t(u32()) | (uint64_t(u32()) << 32); }
  unsigned below(unsigned n) { return n <= 1 ? 0 : n <= 256 ? byte() % n : u32() % n; }

 private:
  const uint8_t* d_;
  size_t n_;
};

// Data values come from a generator seeded by the input (cheaper than input bytes).
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform(double lo, double hi) { return lo + (hi - lo) * double(next() >> 11) * 0x1p-53; }
  uint64_t below(uint64_t n) { return n ? next() % n : 0; }
};

// ------------------------------------------------------------------ number formats ---------
uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
uint16_t to_f16(float f) {  // round to nearest even; good enough for test data
  const uint32_t u = f32_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);
  if (a >= 0x38800000u) {
    const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return uint16_t(sign | ((r >> 13) - (112u << 10)));
  }
  return uint16_t(sign | uint16_t(std::nearbyint(double(bits_f32(a)) * 16777216.0)));
}
float from_f16(uint16_t h) {
  const int sign = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v = e == 0 ? std::ldexp(double(m), -24)
             : e == 31 ? (m ? std::numeric_limits<double>::quiet_NaN() : HUGE_VAL)
                       : std::ldexp(1.0 + m / 1024.0, e - 15);
  return float(sign ? -v : v);
}
bool is_float_dtype(int d) { return d == FCE_FLOAT32 || d == FCE_FLOAT16 || d == FCE_BFLOAT16; }
uint64_t esize_of(int d) {
  switch (d) {
    case FCE_FLOAT16:
    case FCE_BFLOAT16: return 2;
    case FCE_INT64: return 8;
    default: return 4;  // float32, int32, and (for layout only) invalid dtypes
  }
}
void store(int dtype, uint8_t* p, double v) {
  switch (dtype) {
    case FCE_FLOAT16: {
      uint16_t h = to_f16(float(v));
      std::memcpy(p, &h, 2);
      break;
    }
    case FCE_BFLOAT16: {
      uint16_t h = to_bf16(float(v));
      std::memcpy(p, &h, 2);
      break;
    }
    default: {
      float f = float(v);
      std::memcpy(p, &f, 4);
      break;
    }
  }
}
double load(int dtype, const uint8_t* p) {
  uint16_t h;
  switch (dtype) {
    case FCE_FLOAT16: std::memcpy(&h, p, 2); return from_f16(h);
    case FCE_BFLOAT16: std::memcpy(&h, p, 2); return bits_f32(uint32_t(h) << 16);
    default: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
  }
}
void put_poison(uint64_t es, uint8_t* p) {
  if (es == 8) std::memcpy(p, &kPoison64, 8);
  else if (es == 4) std::memcpy(p, &kPoison32, 4);
  else std::memcpy(p, &kPoison16, 2);
}
bool is_poison(uint64_t es, const uint8_t* p) {
  if (es == 8) return std::memcmp(p, &kPoison64, 8) == 0;
  if (es == 4) return std::memcmp(p, &kPoison32, 4) == 0;
  return std::memcmp(p, &kPoison16, 2) == 0;
}

// ------------------------------------------------------------------ the call ---------------
enum Fn {
  kForward,
  kBackward,
  kRescale,
  kLinear,
  kScale,
  kQueryForward,
  kQueryBackward,
  kQueryLinear,
  kOptionsDefault,
  kMisc,
  kNumFn
};
const char* const kFnName[kNumFn] = {"fce_forward",
                                     "fce_backward",
                                     "fce_backward_rescale",
                                     "fce_linear_ce",
                                     "fce_scale_gradient",
                                     "fce_forward_workspace_size",
                                     "fce_backward_workspace_size",
                                     "fce_linear_ce_workspace_size",
                                     "fce_options_default",
                                     "(status strings, version, last error)"};

// Every buffer any call takes, in placement order (a buffer may alias only an earlier one).
enum BufId {
  B_LOGITS,
  B_TARGETS,
  B_CW,       // options->class_weights
  B_GOUT,     // grad_output
  B_LSE_IN,   // the saved lse of the backward calls
  B_HIDDEN,
  B_WEIGHT,
  B_BIAS,
  B_LOSS,
  B_LSE,
  B_ZLOSS,
  B_GRAD,     // grad_logits (read and written by fce_backward_rescale), fce_scale_gradient's grad
  B_GH,
  B_GW,
  B_GB,
  B_FLAGS,
  B_ARGMAX,   // outputs->argmax
  B_ACC,      // outputs->accuracy
  B_WS,
  B_Q0,       // the queries' workspace_bytes / min_bytes
  B_Q1,       // optimal_bytes
  kNumBuf
};
const char* const kBufName[kNumBuf] = {
    "logits", "targets", "options->class_weights", "grad_output", "lse (saved)", "hidden_states",
    "weight", "bias", "loss", "lse", "z_loss", "grad_logits", "grad_hidden", "grad_weight",
    "grad_bias", "error_flags", "outputs->argmax", "outputs->accuracy", "workspace",
    "query output", "optimal_bytes"};

enum Role {
  kIn,       // read only
  kOut,      // written (every element, when must_write)
  kInOut,    // read and written (accumulate, rescale, scale_gradient)
  kIgnored,  // passed (in the options) but the call must neither need nor write it
};

enum Fill { kFillData, kFillTargets, kFillWeights, kFillScalar, kFillPoison, kFillFlags,
            kFillRaw };

struct Buffer {
  bool present = false;
  Role role = kIn;
  bool required = false;
  bool must_write = false;
  int dtype = FCE_FLOAT32;   // element type (FCE_INT64 for argmax; for layout and fill)
  uint64_t es = 4;           // element bytes (alignment the header asks for)
  uint64_t align = 4;
  int64_t rows = 1, cols = 0, stride = 0;  // elements (dense: rows 1)
  uint64_t declared = 0;     // bytes the call may touch, saturated at kNoBuffer
  Fill fill = kFillPoison;
  // placement
  int slot = -1;
  uint64_t offset = 0;       // in the slot
  int alias_of = -1;         // placed inside another buffer's slot
  uint8_t* ptr = nullptr;
  bool capped() const { return declared > kCap; }
  uint64_t backed() const { return declared > kCap ? kCappedBacking : declared; }
};

enum Severity { kEither, kInvalid };
struct Defect {
  Severity sev;
  fce_status code;
  bool capped_dep;  // judged from the declared extent of a buffer we could not back
  std::string what;
};

struct Case {
  Fn fn = kForward;
  fce_options opt{};      // the caller's struct as generated (every field)
  fce_options eff{};      // what the library should see (defaults past struct_size)
  bool opt_null = false;
  uint64_t opt_bytes = sizeof(fce_options);  // readable bytes of the caller's struct
  int64_t rows = 1, vocab = 1, hidden = 1, count = 0;
  int32_t with_grad = 0;
  int32_t sg_backend = FCE_BACKEND_CPU, sg_dtype = FCE_FLOAT32;
  size_t ws_bytes = 0;
  size_t ws_need = 0, ws_opt = 0;
  bool ws_need_known = false;
  void* stream = nullptr;
  Buffer b[kNumBuf];
  std::vector<Defect> defects;
  // data
  uint64_t seed = 0;
  int data_mode = 0;   // 0 tame, 1 tame with special values, 2 raw bits
  int target_mode = 0;
  double gout_value = 1.0;
  bool gout_special = false;
  bool tame_options = true;
  // options-default / misc
  int32_t status_arg = 0;
};

void add(Case& c, Severity s, fce_status code, bool capped_dep, const std::string& what) {
  c.defects.push_back({s, code, capped_dep, what});
}

uint64_t sat(u128 x) { return x > kNoBuffer ? kNoBuffer : uint64_t(x); }

// Bytes from the first element to past the last of rows x cols elements, stride apart.
uint64_t span_bytes(int64_t rows, int64_t cols, int64_t stride, uint64_t es) {
  if (rows <= 0 || cols <= 0) return 0;
  if (stride < cols) stride = cols;
  return sat((u128(uint64_t(rows - 1)) * u128(uint64_t(stride)) + u128(uint64_t(cols))) * es);
}

void declare(Case& c, BufId id, Role role, int dtype, int64_t rows, int64_t cols, int64_t stride,
             Fill fill, bool required = false, bool must_write = false) {
  Buffer& b = c.b[id];
  b.role = role;
  b.dtype = dtype;
  b.es = esize_of(dtype);
  b.align = b.es;
  b.rows = rows;
  b.cols = cols;
  b.stride = stride < cols ? cols : stride;
  b.declared = span_bytes(rows, cols, stride, b.es);
  b.fill = fill;
  b.required = required;
  b.must_write = must_write;
}
void declare_bytes(Case& c, BufId id, Role role, uint64_t bytes, uint64_t align, Fill fill) {
  Buffer& b = c.b[id];
  b.role = role;
  b.dtype = FCE_INT32;
  b.es = 1;
  b.align = align;
  b.rows = 1;
  b.cols = int64_t(bytes > kNoBuffer ? kNoBuffer : bytes);
  b.stride = b.cols;
  b.declared = bytes > kNoBuffer ? kNoBuffer : bytes;
  b.fill = fill;
}

// ------------------------------------------------------------------ interesting values ------
// a + b wrapping around (sizes may be extreme; no undefined behaviour in the harness itself)
int64_t wadd(int64_t a, int64_t b) { return int64_t(uint64_t(a) + uint64_t(b)); }

int64_t interesting_i64(Input& in, const Case& c) {
  const int64_t v[] = {0,
                       1,
                       -1,
                       2,
                       3,
                       c.rows,
                       wadd(c.rows, 1),
                       wadd(c.rows, -1),
                       c.vocab,
                       wadd(c.vocab, -1),
                       wadd(c.vocab, 1),
                       c.hidden,
                       wadd(c.hidden, -1),
                       -100,
                       kMaxVocab,
                       kMaxVocab + int64_t(1),
                       std::numeric_limits<int64_t>::max(),
                       std::numeric_limits<int64_t>::min(),
                       int64_t(1) << 40,
                       -(int64_t(1) << 40),
                       int64_t(1) << 59,
                       int64_t(1) << 62};
  const unsigned n = sizeof v / sizeof v[0];
  const unsigned k = in.below(n + 2);
  if (k < n) return v[k];
  return k == n ? int64_t(in.u16()) : int64_t(in.u64());
}
int32_t interesting_i32(Input& in) {
  const int32_t v[] = {0, 1, 2, 3, 4, 5, -1, 100, std::numeric_limits<int32_t>::min(),
                       std::numeric_limits<int32_t>::max()};
  const unsigned n = sizeof v / sizeof v[0];
  const unsigned k = in.below(n + 1);
  return k < n ? v[k] : int32_t(in.u32());
}
float interesting_float(Input& in) {
  const float inf = std::numeric_limits<float>::infinity();
  const float v[] = {0.0f, -0.0f, 0.1f, 0.5f, std::nextafter(1.0f, 0.0f), 1.0f, 1.5f, 2.0f, 30.0f,
                     1e-30f, 1e-45f, std::numeric_limits<float>::max(), -0.1f, -1.0f,
                     -std::numeric_limits<float>::max(), inf, -inf,
                     std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                     bits_f32(0x7f800001u) /* signalling NaN */};
  const unsigned n = sizeof v / sizeof v[0];
  const unsigned k = in.below(n + 1);
  return k < n ? v[k] : bits_f32(in.u32());
}
size_t interesting_struct_size(Input& in) {
  const size_t v[] = {0, 8, 96, 100, 103, 105, 112, 128, 135, 137, 144, 1 << 20,
                      std::numeric_limits<size_t>::max()};
  return v[in.below(sizeof v / sizeof v[0])];
}

// A size: mostly small (fast calls), sometimes larger, sometimes extreme.
int64_t gen_size(Input& in, int64_t small, int64_t large, const Case& c) {
  const uint8_t sel = in.byte();
  if (sel < 216) return 1 + int64_t(in.u16() % uint64_t(small));
  if (sel < 240) return 1 + int64_t(in.u16() % uint64_t(large));
  return interesting_i64(in, c);
}

// ------------------------------------------------------------------ generation -------------
void gen_options(Input& in, Case& c) {
  fce_options o = FCE_OPTIONS_INIT;
  o.backend = FCE_BACKEND_CPU;
  // Valid variety first: one bit per setting (zero bits: the defaults).
  const uint32_t bits = in.u32();
  if (bits & 1u) o.reduction = int32_t(in.below(3));
  if (bits & 2u) o.dtype = int32_t(in.below(3));
  if (bits & 4u) o.target_dtype = FCE_INT32;
  if (bits & 8u) {
    const float v[] = {0.1f, 0.5f, 0.999f};
    o.label_smoothing = v[in.below(3)];
  }
  if (bits & 16u) {
    const float v[] = {1e-4f, 1e-2f, 1.0f};
    o.z_loss_scale = v[in.below(3)];
  }
  if (bits & 32u) {
    const float v[] = {0.5f, 5.0f, 30.0f};
    o.softcap = v[in.below(3)];
  }
  if (bits & 64u) {
    const float v[] = {0.5f, 2.0f, -1.0f, 1e-3f, 30.0f};
    o.logit_scale = v[in.below(5)];
  }
  if ((bits & 128u) && c.rows >= 1) {
    const int64_t m = 1 + in.below(4);
    const int64_t T = c.rows % m == 0 ? c.rows / m : c.rows;
    o.shift_seq_len = T;
    const int64_t k[] = {0, 1, 2, wadd(T, -1), T, wadd(T, 1)};
    o.shift = std::max<int64_t>(0, k[in.below(6)]);
  }
  if (bits & 256u) o.token_scaling = 1;
  if (bits & 512u) {
    const int64_t v[] = {0, 1, wadd(c.vocab, -1), -1, 7};
    o.ignore_index = v[in.below(5)];
  }
  if (bits & 1024u) o.row_stride = wadd(c.vocab, int64_t(in.below(10)));
  if (bits & 2048u) o.grad_row_stride = wadd(c.vocab, int64_t(in.below(10)));
  if (bits & 4096u) o.hidden_row_stride = wadd(c.hidden, int64_t(in.below(10)));
  if (bits & 8192u) o.accumulate = 1;
  if (bits & 16384u) o.grad_weight_fp32 = 1;
  if (bits & 32768u) o.deterministic = 1;
  if (((bits >> 16) & 7u) == 7u) o.struct_size = 104;  // a 0.x caller's: refused since 1.0
  // Then defects: a few fields set to interesting (often invalid) values.
  const uint8_t m = in.byte();
  const int n = m < 128 ? 0 : m < 200 ? 1 : m < 240 ? 2 : 3 + m % 3;
  for (int i = 0; i < n; ++i) {
    switch (in.below(21)) {
      case 0: o.struct_size = interesting_struct_size(in); break;
      case 1: o.ignore_index = interesting_i64(in, c); break;
      case 2: o.row_stride = interesting_i64(in, c); break;
      case 3: o.grad_row_stride = interesting_i64(in, c); break;
      case 4: o.shift_seq_len = interesting_i64(in, c); break;
      case 5: o.hidden_row_stride = interesting_i64(in, c); break;
      case 6: o.backend = interesting_i32(in); break;
      case 7: o.dtype = interesting_i32(in); break;
      case 8:
        // the class-probability codes (FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16: targets of
        // [rows, vocab]) are outside this case's model, whose targets are class indices: they
        // become codes the library refuses (test_soft_targets covers them)
        o.target_dtype = interesting_i32(in);
        if (o.target_dtype >= FCE_FLOAT32 && o.target_dtype <= FCE_BFLOAT16) o.target_dtype += 16;
        break;
      case 9: o.reduction = interesting_i32(in); break;
      case 10: o.label_smoothing = interesting_float(in); break;
      case 11: o.z_loss_scale = interesting_float(in); break;
      case 12: o.softcap = interesting_float(in); break;
      case 13: o.logit_scale = interesting_float(in); break;
      case 14: o.deterministic = interesting_i32(in); break;
      case 15: o.accumulate = interesting_i32(in); break;
      case 16: o.grad_weight_fp32 = interesting_i32(in); break;
      case 17: o.vp_entropy = interesting_i32(in); break;
      case 18: o.shift = interesting_i64(in, c); break;
      case 19: o.token_scaling = interesting_i32(in); break;
      default: o.batch_invariant = interesting_i32(in); break;
    }
  }
  c.opt = o;
  c.opt_null = in.below(64) == 63;
  // The caller's struct is as long as its struct_size says (readable bytes; 8-byte multiple).
  const size_t s = o.struct_size;
  uint64_t readable = s < 8 ? 8 : s > sizeof(fce_options) ? sizeof(fce_options) : s;
  c.opt_bytes = (readable + 7) & ~uint64_t(7);
  // What the library sees: the defaults, overwritten by the caller's struct_size bytes.
  const fce_options defaults = FCE_OPTIONS_INIT;
  c.eff = defaults;
  const bool known = s == FCE_OPTIONS_SIZE_V1_0;
  std::memcpy(&c.eff, &c.opt, known ? s : size_t(c.opt_bytes));
}

bool is_tame_options(const fce_options& o) {
  return std::fabs(o.logit_scale) <= 64.0f && o.z_loss_scale <= 1e4f;
}

// Whether an optional buffer is passed: from a bit of `bits`.
bool bit(uint32_t bits, int i) { return (bits >> i) & 1u; }

// Declares the buffers of the call (sizes, roles) from the sizes and options; c.eff decides.
void declare_call(Input& in, Case& c) {
  const fce_options& o = c.eff;
  const int dt = is_float_dtype(o.dtype) ? o.dtype : FCE_FLOAT32;
  const int tdt = o.target_dtype == FCE_INT32 ? FCE_INT32 : FCE_INT64;
  const bool none = o.reduction == FCE_REDUCTION_NONE;
  const int64_t R = c.rows, V = c.vocab, D = c.hidden;
  const int64_t reduced = none ? R : 1;
  const uint32_t bits = in.u32();
  auto declare_forward_extras = [&](bool written) {
    // options->class_weights; outputs->argmax and ->accuracy, passed to the calls that write
    // them (the gradient-only calls refuse them)
    c.b[B_CW].present = bit(bits, 10);
    declare(c, B_CW, kIn, FCE_FLOAT32, 1, V, V, kFillWeights);
    c.b[B_ARGMAX].present = written && bit(bits, 11);
    declare(c, B_ARGMAX, written ? kOut : kIgnored, FCE_INT64, 1, R, R, kFillPoison, false,
            written);
    c.b[B_ACC].present = written && bit(bits, 12);
    declare(c, B_ACC, written ? kOut : kIgnored, FCE_FLOAT32, 1, reduced, reduced, kFillPoison,
            false, written);
  };
  const int64_t rs = o.row_stride, grs = o.grad_row_stride;
  switch (c.fn) {
    case kForward:
    case kBackward:
    case kRescale: {
      const bool fwd = c.fn == kForward;
      c.b[B_LOGITS].present = true;
      declare(c, B_LOGITS, kIn, dt, R, V, rs, kFillData, true);
      c.b[B_TARGETS].present = true;
      declare(c, B_TARGETS, kIn, tdt, 1, R, R, kFillTargets, true);
      c.b[B_GOUT].present = c.fn == kRescale || bit(bits, 0);
      declare(c, B_GOUT, kIn, FCE_FLOAT32, 1, reduced, reduced, kFillScalar, c.fn == kRescale);
      if (fwd) {
        c.b[B_LOSS].present = true;
        declare(c, B_LOSS, kOut, FCE_FLOAT32, 1, reduced, reduced, kFillPoison, true, true);
        c.b[B_LSE].present = bit(bits, 1);
        declare(c, B_LSE, kOut, FCE_FLOAT32, 1, R, R, kFillPoison, false, true);
        c.b[B_ZLOSS].present = bit(bits, 2);
        declare(c, B_ZLOSS, kOut, FCE_FLOAT32, 1, 1, 1, kFillPoison, false, true);
        c.b[B_GRAD].present = bit(bits, 3);
        declare(c, B_GRAD, kOut, dt, R, V, grs, kFillPoison, false, true);
      } else {
        c.b[B_LSE_IN].present = true;
        // values (tame: the true lse, by derived_fill; raw bits only with data_mode 2, where
        // any NaN payload may reach the outputs)
        declare(c, B_LSE_IN, kIn, FCE_FLOAT32, 1, R, R, kFillData, true);
        c.b[B_GRAD].present = true;
        declare(c, B_GRAD, c.fn == kRescale ? kInOut : kOut, dt, R, V, grs,
                c.fn == kRescale ? kFillData : kFillPoison, true, c.fn == kBackward);
      }
      c.b[B_FLAGS].present = bit(bits, 4);
      declare(c, B_FLAGS, kInOut, FCE_INT32, 1, 1, 1, kFillFlags);
      declare_forward_extras(fwd);
      break;
    }
    case kLinear: {
      const bool gw32 = o.grad_weight_fp32 != 0;
      const int gdt = gw32 ? FCE_FLOAT32 : dt;
      const bool acc = o.accumulate != 0;
      c.b[B_HIDDEN].present = true;
      declare(c, B_HIDDEN, kIn, dt, R, D, o.hidden_row_stride, kFillData, true);
      c.b[B_WEIGHT].present = true;
      declare(c, B_WEIGHT, kIn, dt, V, D, D, kFillData, true);
      c.b[B_BIAS].present = bit(bits, 5);
      declare(c, B_BIAS, kIn, dt, 1, V, V, kFillData);
      c.b[B_TARGETS].present = true;
      declare(c, B_TARGETS, kIn, tdt, 1, R, R, kFillTargets, true);
      c.b[B_GOUT].present = bit(bits, 0);
      declare(c, B_GOUT, kIn, FCE_FLOAT32, 1, reduced, reduced, kFillScalar);
      c.b[B_LOSS].present = true;
      declare(c, B_LOSS, kOut, FCE_FLOAT32, 1, reduced, reduced, kFillPoison, true, true);
      c.b[B_LSE].present = bit(bits, 1);
      declare(c, B_LSE, kOut, FCE_FLOAT32, 1, R, R, kFillPoison, false, true);
      c.b[B_ZLOSS].present = bit(bits, 2);
      declare(c, B_ZLOSS, kOut, FCE_FLOAT32, 1, 1, 1, kFillPoison, false, true);
      c.b[B_GH].present = bit(bits, 6);
      declare(c, B_GH, kOut, dt, R, D, D, kFillPoison, false, true);
      c.b[B_GW].present = bit(bits, 7);
      declare(c, B_GW, acc ? kInOut : kOut, gdt, V, D, D, acc ? kFillData : kFillPoison, false,
              !acc);
      c.b[B_GB].present = bit(bits, 8) && (c.b[B_BIAS].present || in.below(8) == 7);
      declare(c, B_GB, acc ? kInOut : kOut, gdt, 1, V, V, acc ? kFillData : kFillPoison, false,
              !acc);
      c.b[B_FLAGS].present = bit(bits, 4);
      declare(c, B_FLAGS, kInOut, FCE_INT32, 1, 1, 1, kFillFlags);
      declare_forward_extras(true);
      break;
    }
    case kScale: {
      const int sdt = is_float_dtype(c.sg_dtype) ? c.sg_dtype : FCE_FLOAT32;
      c.b[B_GRAD].present = c.count != 0 || !bit(bits, 9);
      declare(c, B_GRAD, kInOut, sdt, 1, c.count, c.count, kFillData, c.count > 0);
      c.b[B_GOUT].present = true;
      declare(c, B_GOUT, kIn, FCE_FLOAT32, 1, 1, 1, kFillScalar, true);
      break;
    }
    case kQueryForward:
    case kQueryBackward:
    case kQueryLinear: {
      // The options' pointers are never read by a query: real (small) buffers all the same.
      declare_forward_extras(false);
      c.b[B_Q0].present = true;
      declare_bytes(c, B_Q0, kOut, 8, 8, kFillPoison);
      c.b[B_Q0].required = true;
      c.b[B_Q0].must_write = true;
      c.b[B_Q0].dtype = FCE_INT64;
      c.b[B_Q0].es = 8;
      c.b[B_Q0].cols = 1;
      c.b[B_Q0].stride = 1;
      if (c.fn == kQueryLinear) {
        c.b[B_Q1].present = !bit(bits, 13);
        declare_bytes(c, B_Q1, kOut, 8, 8, kFillPoison);
        c.b[B_Q1].must_write = true;
        c.b[B_Q1].dtype = FCE_INT64;
        c.b[B_Q1].es = 8;
        c.b[B_Q1].cols = 1;
        c.b[B_Q1].stride = 1;
      }
      break;
    }
    default: break;
  }
}

// The workspace the matching query asks for, with options as the caller's (pointers dropped:
// a query does not look at them). Unknown when the query fails.
void query_workspace(Case& c) {
  fce_options q = c.opt;
  q.class_weights = nullptr;
  size_t need = 0, opt = 0;
  fce_status st = FCE_ERROR_INTERNAL;
  if (c.opt_null) return;
  if (c.fn == kForward) st = fce_forward_workspace_size(&q, c.rows, c.vocab, &need);
  if (c.fn == kBackward || c.fn == kRescale)
    st = fce_backward_workspace_size(&q, c.rows, c.vocab, &need);
  if (c.fn == kLinear) {
    const int wg = c.b[B_GH].present || c.b[B_GW].present || c.b[B_GB].present;
    st = fce_linear_ce_workspace_size(&q, c.rows, c.hidden, c.vocab, wg, &need, &opt);
  }
  if (st == FCE_SUCCESS) {
    c.ws_need = need;
    c.ws_opt = std::max(opt, need);
    c.ws_need_known = true;
  }
}

void gen_workspace(Input& in, Case& c) {
  const size_t need = c.ws_need, opt = c.ws_opt;
  size_t bytes = need;
  switch (in.below(16)) {
    case 1: bytes = opt; break;
    case 2: bytes = need + 1; break;
    case 3: bytes = need + 16; break;
    case 4: bytes = need + 4096; break;
    case 5: bytes = need ? need - 1 : 0; break;
    case 6: bytes = need / 2; break;
    case 7: bytes = need + (opt - need) / 2; break;
    case 8: bytes = 0; break;
    case 9: bytes = size_t(in.u32()); break;
    case 10: bytes = std::numeric_limits<size_t>::max() - in.byte(); break;
    case 11: bytes = size_t(1) << 62; break;
    default: break;
  }
  c.ws_bytes = bytes;
  // The workspace pointer: NULL when nothing is asked (the plain call), else a buffer.
  c.b[B_WS].present = bytes > 0 ? in.below(16) != 15 : in.below(4) == 3;
  declare_bytes(c, B_WS, kOut, bytes, 16, kFillRaw);
}

// Where each present buffer lives: its own slot (maybe misaligned), or inside an earlier one
// (in place, at an offset, in a row gap, adjacent), or NULL.
void gen_placement(Input& in, Case& c) {
  int nslots = 0;
  for (int id = 0; id < kNumBuf; ++id) {
    Buffer& b = c.b[id];
    if (!b.present) continue;
    uint64_t mis = 0;
    const uint8_t sel = in.byte();
    // in place: grad_logits is logits (fce_forward, fce_backward; invalid for the rescale)
    if (id == B_GRAD && c.b[B_LOGITS].present && (c.fn == kForward || c.fn == kBackward ||
                                                  c.fn == kRescale) && sel >= 200 && sel < 224) {
      b.alias_of = B_LOGITS;
      b.offset = c.b[B_LOGITS].offset;
      b.slot = c.b[B_LOGITS].slot;
      continue;
    }
    if (sel >= 228 && sel < 236) {  // NULL
      b.present = false;
      continue;
    }
    if (sel >= 236 && sel < 242) mis = 1 + in.below(15);
    if (sel >= 242) {  // alias an earlier buffer
      std::vector<int> earlier;
      for (int j = 0; j < id; ++j)
        if (c.b[j].present && c.b[j].slot >= 0) earlier.push_back(j);
      if (!earlier.empty()) {
        const Buffer& t = c.b[earlier[in.below(unsigned(earlier.size()))]];
        const uint64_t tb = t.backed();
        uint64_t off = 0;
        switch (in.below(9)) {
          case 0: off = 0; break;
          case 1: off = t.es; break;
          case 2: off = 4; break;
          case 3: off = (tb / 2) & ~uint64_t(15); break;
          case 4: off = tb >= 4 ? tb - 4 : 0; break;
          case 5: off = tb; break;  // adjacent: no overlap
          case 6: off = tb + 1 + in.below(64); break;
          case 7:  // into the first row gap of a strided buffer
            off = t.cols > 0 && t.stride > t.cols && uint64_t(t.cols) * t.es < tb
                      ? uint64_t(t.cols) * t.es : tb;
            break;
          default: off = in.below(unsigned(std::min<uint64_t>(tb + 1, 1u << 20))); break;
        }
        b.alias_of = int(&t - c.b);
        b.slot = t.slot;
        b.offset = t.offset + off;
        continue;
      }
    }
    b.slot = nslots++;
    b.offset = mis;
  }
}

// ------------------------------------------------------------------ the oracle -------------
// Do the elements of a and b share a byte? (Rows of cols elements, stride apart.)
struct Lay {
  i128 start;
  i128 rows, cb, sb;  // rows, bytes per row, bytes between rows
};
Lay lay_of(const Buffer& b) {
  Lay l;
  l.start = i128(uintptr_t(b.ptr));
  if (b.rows > 1 && b.declared < kNoBuffer) {
    l.rows = b.rows;
    l.cb = i128(b.cols) * b.es;
    l.sb = i128(b.stride) * b.es;
  } else {  // dense, or too large to care: its whole span
    l.rows = 1;
    l.cb = i128(b.declared);
    l.sb = l.cb;
  }
  return l;
}
bool seg_hits(i128 s, i128 e, const Lay& b) {
  if (b.cb <= 0 || s >= e) return false;
  if (b.rows == 1) return b.start < e && s < b.start + b.cb;
  const i128 num = s - b.start - b.cb;  // the first row r with start + r*sb + cb > s
  const i128 r = num < 0 ? 0 : num / b.sb + 1;
  if (r >= b.rows) return false;
  return b.start + r * b.sb < e;
}
bool elements_overlap(const Buffer& a, const Buffer& b) {
  Lay la = lay_of(a), lb = lay_of(b);
  if (la.rows > lb.rows) std::swap(la, lb);
  if (la.rows > 65536) return true;  // not reached with backed buffers
  for (i128 r = 0; r < la.rows; ++r) {
    const i128 s = la.start + r * la.sb;
    if (seg_hits(s, s + la.cb, lb)) return true;
  }
  return false;
}
bool spans_overlap(const Buffer& a, const Buffer& b) {
  const i128 a0 = i128(uintptr_t(a.ptr)), b0 = i128(uintptr_t(b.ptr));
  return a.declared > 0 && b.declared > 0 && a0 < b0 + i128(b.declared) &&
         b0 < a0 + i128(a.declared);
}

bool is_output(Role r) { return r == kOut || r == kInOut; }

// The header's rules (include/fusedce.h), call by call. Where the header leaves the answer open
// the defect is kEither: success and failure are both accepted (every such case says why).
void judge(Case& c) {
  const fce_options& o = c.eff;
  const bool compute = c.fn == kForward || c.fn == kBackward || c.fn == kRescale ||
                       c.fn == kLinear;
  const bool query = c.fn == kQueryForward || c.fn == kQueryBackward || c.fn == kQueryLinear;
  const bool linear = c.fn == kLinear || c.fn == kQueryLinear;
  const bool ce = compute && !linear;
  const fce_status INV = FCE_ERROR_INVALID_ARGUMENT;
  if (compute || query) {
    if (c.opt_null) add(c, kInvalid, FCE_ERROR_NULL_POINTER, false, "options is NULL");
    const size_t s = c.opt.struct_size;
    if (s != FCE_OPTIONS_SIZE_V1_0)
      add(c, kInvalid, INV, false, "struct_size is no version's size");
    if (o.vp_entropy != 0) add(c, kInvalid, INV, false, "vp_entropy != 0 (not a vp call)");
    if (o.backend != FCE_BACKEND_CPU && o.backend != FCE_BACKEND_CUDA)
      add(c, kInvalid, INV, false, "backend is no fce_backend");
    if (o.backend == FCE_BACKEND_CUDA)
      add(c, kInvalid, FCE_ERROR_BACKEND_UNAVAILABLE, false, "CUDA backend, none here");
    if (!is_float_dtype(o.dtype)) add(c, kInvalid, INV, false, "dtype");
    if (o.target_dtype != FCE_INT32 && o.target_dtype != FCE_INT64)
      add(c, kInvalid, INV, false, "target_dtype");
    if (o.reduction < 0 || o.reduction > 2) add(c, kInvalid, INV, false, "reduction");
    if (!(o.label_smoothing >= 0.0f && o.label_smoothing < 1.0f))
      add(c, kInvalid, INV, false, "label_smoothing outside [0, 1)");
    // "lambda >= 0", "c >= 0": an infinite one is no scale either (the library says "finite")
    if (!(o.z_loss_scale >= 0.0f && std::isfinite(o.z_loss_scale)))
      add(c, kInvalid, INV, false, "z_loss_scale not finite >= 0");
    if (!(o.softcap >= 0.0f && std::isfinite(o.softcap)))
      add(c, kInvalid, INV, false, "softcap not finite >= 0");
    if (!std::isfinite(o.logit_scale) || o.logit_scale == 0.0f)
      add(c, kInvalid, INV, false, "logit_scale not finite and nonzero");
    if (c.rows < 0) add(c, kInvalid, INV, false, "rows < 0");
    if (c.vocab < 1 || c.vocab > kMaxVocab) add(c, kInvalid, INV, false, "vocab outside [1, 2^31-1]");
    if (o.shift_seq_len < 0) add(c, kInvalid, INV, false, "shift_seq_len < 0");
    if (o.shift_seq_len > 0 && c.rows >= 1 && c.rows % o.shift_seq_len != 0)
      add(c, kInvalid, INV, false, "rows not a multiple of shift_seq_len");
    if (o.shift < 0) add(c, kInvalid, INV, false, "shift < 0");
    if (o.shift != 0 && o.shift_seq_len == 0)
      add(c, kInvalid, INV, false, "shift without shift_seq_len");
    if (linear) {
      if (c.hidden < 1) add(c, kInvalid, INV, false, "hidden < 1");
      // the header gives no upper bound for hidden; the library's is 2^31-1
      if (c.hidden > kMaxVocab) add(c, kEither, INV, false, "hidden > 2^31-1");
    }
    // Strides, against the sizes they describe: invalid where the call uses them, open
    // ("either") where it does not (a query, or a stride of a buffer the call does not take).
    auto stride_rule = [&](int64_t stride, int64_t cols, bool used, const char* what) {
      if (stride == 0 || (stride >= cols)) return;
      add(c, used ? kInvalid : kEither, INV, false, std::string(what) + " below its columns");
    };
    stride_rule(o.row_stride, c.vocab, ce, "row_stride");
    stride_rule(o.grad_row_stride, c.vocab, ce && c.b[B_GRAD].present, "grad_row_stride");
    stride_rule(o.hidden_row_stride, linear ? c.hidden : 0, c.fn == kLinear, "hidden_row_stride");
  }
  if (c.fn == kRescale && o.reduction == FCE_REDUCTION_NONE)
    add(c, kInvalid, INV, false, "rescale with reduction none");
  if (c.fn == kScale) {
    if (c.sg_backend != FCE_BACKEND_CPU && c.sg_backend != FCE_BACKEND_CUDA)
      add(c, kInvalid, INV, false, "backend is no fce_backend");
    // count 0: "nothing happens" (the library answers SUCCESS even for an absent backend)
    if (c.sg_backend == FCE_BACKEND_CUDA)
      add(c, c.count == 0 ? kEither : kInvalid, FCE_ERROR_BACKEND_UNAVAILABLE, false,
          "CUDA backend, none here");
    if (!is_float_dtype(c.sg_dtype)) add(c, kInvalid, INV, false, "dtype");
    if (c.count < 0) add(c, kInvalid, INV, false, "count < 0");
  }
  if (!(compute || query || c.fn == kScale)) return;

  // Pointers: NULL, alignment, "no such buffer", overlaps.
  for (int id = 0; id < kNumBuf; ++id) {
    const Buffer& b = c.b[id];
    if (query && id != B_Q0 && id != B_Q1) {
      // the options' pointers of a query: never used; misaligned ones are the caller's mistake
      // that the query may or may not see
      if (b.present && uintptr_t(b.ptr) % b.align)
        add(c, kEither, FCE_ERROR_MISALIGNED, false, std::string(kBufName[id]) + " misaligned");
      continue;
    }
    if (!b.present) {
      // grad of fce_scale_gradient with count 0 is not needed; rest as declared, but with no
      // row ("zero rows": an empty problem) a buffer of no element may be NULL
      if (b.required && !(c.rows == 0 && b.declared == 0 && c.fn != kScale))
        add(c, kInvalid, FCE_ERROR_NULL_POINTER, false, std::string(kBufName[id]) + " is NULL");
      continue;
    }
    if (uintptr_t(b.ptr) % b.align)
      add(c, b.role == kIgnored ? kEither : kInvalid, FCE_ERROR_MISALIGNED, false,
          std::string(kBufName[id]) + " misaligned");
    if (b.declared >= kNoBuffer || uint64_t(uintptr_t(b.ptr)) + b.declared < b.declared)
      add(c, id == B_WS ? kEither : kInvalid, INV, true,
          std::string(kBufName[id]) + ": no such buffer (size)");
  }
  // Sizes no buffer can have (2^62 bytes and more, the library's bound; the header names
  // "overflowing sizes"): the call may be refused for them whichever pointers are NULL. Such a
  // call is made only when something else makes it invalid: this adds the code, not a verdict.
  if (!query) {
    bool extreme = c.rows > (int64_t(1) << 59);
    for (int id = 0; id < kNumBuf; ++id) extreme |= c.b[id].declared >= kNoBuffer;
    if (extreme) add(c, kEither, INV, true, "sizes past any buffer");
  }
  if (c.fn == kScale && !c.b[B_GRAD].present && c.count == 0)
    add(c, kEither, FCE_ERROR_NULL_POINTER, false, "grad NULL with count 0");
  if (c.fn == kLinear && c.b[B_GB].present && !c.b[B_BIAS].present)
    add(c, kInvalid, INV, false, "grad_bias without bias");
  // (rows = 0: two pointers to no element are no buffer, never in place)
  const bool in_place = c.b[B_GRAD].present && c.b[B_LOGITS].present &&
                        c.b[B_GRAD].ptr == c.b[B_LOGITS].ptr && c.b[B_LOGITS].declared > 0 &&
                        (c.fn == kForward || c.fn == kBackward || c.fn == kRescale);
  if (in_place) {
    if (c.fn == kRescale) add(c, kInvalid, INV, false, "rescale in place (grad_logits is logits)");
    const int64_t r = o.row_stride ? o.row_stride : c.vocab;
    const int64_t g = o.grad_row_stride ? o.grad_row_stride : c.vocab;
    if (r != g) add(c, kInvalid, INV, false, "in place with different strides");
  }
  for (int i = 0; i < kNumBuf; ++i) {
    for (int j = i + 1; j < kNumBuf; ++j) {
      const Buffer &a = c.b[i], &b = c.b[j];
      if (!a.present || !b.present) continue;
      if (!is_output(a.role) && !is_output(b.role) && a.role != kIgnored && b.role != kIgnored)
        continue;  // two inputs may share memory
      if (!spans_overlap(a, b)) continue;
      const bool capped_dep = a.capped() || b.capped();
      const std::string what = std::string(kBufName[i]) + " overlaps " + kBufName[j];
      if (in_place && i == B_LOGITS && j == B_GRAD) continue;  // the one allowed overlap
      if (query) {
        // a query writes a size_t and reads no buffer: an output inside the options' unused
        // pointers, or min_bytes and optimal_bytes at one address, is no conflict the header
        // names
        add(c, kEither, INV, capped_dep, what + " (query)");
        continue;
      }
      if (a.role == kIgnored || b.role == kIgnored) {
        // the backward calls take the forward's options: argmax/accuracy are not theirs
        add(c, kEither, INV, capped_dep, what + " (a buffer the call ignores)");
        continue;
      }
      if (!is_output(a.role) && !is_output(b.role)) continue;
      // Strided buffers whose spans interleave without sharing an element: the header's
      // "overlap" is open here (the library compares spans).
      const bool elem = capped_dep || elements_overlap(a, b);
      add(c, elem ? kInvalid : kEither, INV, capped_dep,
          what + (elem ? "" : " (row gaps only)"));
    }
  }
  // The workspace: at least what the query returned; NULL only when that is 0.
  if (compute) {
    if (c.ws_need_known) {
      if (c.ws_bytes < c.ws_need)
        add(c, kInvalid, FCE_ERROR_WORKSPACE_TOO_SMALL, false, "workspace_bytes < query");
      if (c.ws_need > 0 && !c.b[B_WS].present)
        add(c, kInvalid, FCE_ERROR_NULL_POINTER, false, "workspace NULL but needed");
    }
  }
}

}  // namespace
