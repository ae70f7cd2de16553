// vocab_parallel/device.cuh — the device helpers of the vocabulary-parallel kernels (vocab_parallel/kernels.cu): the
// dtype traits and 16-byte row reads of ce/memory.cuh, the row
// classification and the logit transform of docs/semantics.md rules 1-3 and docs/semantics.md steps 1-2 (as
// ce/device.cuh's), and phase 1's per-thread statistics of a row (Acc: maximum, Σexp, the
// argmax, the label-smoothing sums relative to the running maximum) with their fixed-order
// warp / CTA tree; ENT (options->vp_entropy): the entropy's sum e beside them, per thread.
//
// In an anonymous namespace, as when the kernels and these helpers were one file: each kernel
// translation unit compiles its own internal copy (the compiler sees exactly the program it
// always did). Include it only from the kernel files of vocab_parallel/ (kernels.cu, soft.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstring>

#include "cuda/ce/memory.cuh"
#include "internal.h"

namespace fce {
namespace cuda {
namespace {

// ---------------------------------------------------------------- configuration ----
constexpr int kStatsThreads = 512;     // most threads of a phase-1 CTA (one row)
constexpr int kStatsUnroll = 4;        // vectors in flight per thread (plain / softcap)
constexpr int kCombineThreads = 256;
constexpr int kWeightThreads = 1024;

// The dtype traits and the 16-byte row reads (Ty, vec_elems, raw_to_float, unpack, ld_elem,
// load_vector, is_full), Mode, kLog2e, ex2, the infinities, qnan and prob are ce/memory.cuh's /
// ce/geometry.cuh's, the CE kernels' own.

// Everything a phase-1 CTA needs, resolved on the host.
struct SParams {
  const char* logits;          // row row_begin
  int64_t z_row_bytes;
  int64_t row_begin;           // global index of logits' first row
  float* stats;                // [rows, FCE_VP_STATS], global rows
  const void* targets;
  const float* class_weights;  // the whole vocabulary's, or nullptr
  int64_t ignore_index;
  int64_t shift_T, shift_k;    // shift_T = 0: no shift
  int64_t vocab_start;
  int vocab;                   // vocab_local: elements of a row
  int vocab_total;
  int targets_int64;
  int smooth;                  // label smoothing ε > 0 with class indices (u_r)
  int soft;                    // class probabilities (rule 19): no target class; u_r and W_r
                               // are vp_soft_sums_kernel's (vocab_parallel/soft.cu)
  int cap;
  int write_weight;            // kVpWeight = vocab (no class weights); else already written
  float scale, softcap, s_over_c;
};

// The SParams of a phase-1 launch over a (a VpStatsArgs, vocab_parallel/kernels.cuh): all but
// the row pointers (logits, z_row_bytes, row_begin: the launcher's) and the mode flags smooth
// and write_weight (vp_stats_kernel's launcher).
template <class Args> SParams stats_params(const Args& a) {
  const CeOptions& opt = a.opt;
  SParams p;
  memset(&p, 0, sizeof p);
  p.stats = a.stats;
  p.targets = a.targets;
  p.class_weights = opt.class_weights;
  p.ignore_index = opt.ignore_index;
  p.shift_T = opt.shift_seq_len;
  p.shift_k = opt.shift_seq_len > 0 ? (opt.shift > 0 ? opt.shift : 1) : 0;
  p.vocab_start = a.vocab_start;
  p.vocab = static_cast<int>(a.vocab_local);
  p.vocab_total = static_cast<int>(a.vocab_total);
  p.targets_int64 = opt.targets_int64 ? 1 : 0;
  p.soft = opt.soft_targets ? 1 : 0;
  p.cap = opt.softcap > 0.f ? 1 : 0;
  p.scale = opt.logit_scale;
  p.softcap = opt.softcap;
  p.s_over_c = opt.softcap > 0.f ? opt.logit_scale / opt.softcap : 0.f;
  return p;
}

// Class probabilities (rule 19): the shard's q and how q'_j = (1 − ε) q_j + ε/V is made.
struct QParams {
  const char* q;  // the shard's q, row 0 (global rows), [rows, vocab_local]
  int q_dtype;
  float keep;    // 1 − ε
  float spread;  // ε / V
};
template <class Args> QParams q_params(const Args& a) {
  const CeOptions& opt = a.opt;
  QParams qp;
  qp.q = static_cast<const char*>(a.targets);
  qp.q_dtype = opt.q_dtype;
  // as ce/device.cuh's make_params
  qp.keep = static_cast<float>(1.0 - static_cast<double>(opt.label_smoothing));
  qp.spread = static_cast<float>(static_cast<double>(opt.label_smoothing) /
                                 static_cast<double>(a.vocab_total));
  return qp;
}
__device__ __forceinline__ float load_q(const QParams& qp, int64_t i) {
  if (qp.q_dtype == FCE_FLOAT32) return __ldg(reinterpret_cast<const float*>(qp.q) + i);
  const unsigned short raw = __ldg(reinterpret_cast<const unsigned short*>(qp.q) + i);
  return qp.q_dtype == FCE_FLOAT16 ? __half2float(__ushort_as_half(raw))
                                   : __bfloat162float(__ushort_as_bfloat16(raw));
}

// e = Σ exp(a − m)(a − m) of sums (s, e) against m, made against m2 ≥ m: exp(m − m2)(e +
// s (m − m2)); 0 when m = −inf (nothing summed) or exp(m − m2) is 0 (never 0·inf). (The CE
// kernels' rescale_t, ce/device.cuh, which this header cannot include.)
__device__ __forceinline__ float rebase_e(float m, float m2, float s, float e) {
  const float dm = __fsub_rn(m, m2);
  const float r = ex2(__fmul_rn(dm, kLog2e));
  return (m == neg_inf() || r == 0.f) ? 0.f : __fmul_rn(r, __fmaf_rn(s, dm, e));
}


// (classify_row, rules 1-3, and RowKind: ce/memory.cuh, shared with the CE kernels)

// a = s·z, or a = c·tanh(s·z/c) (docs/semantics.md steps 1-2), as ce/device.cuh's xform.
template <int MODE> __device__ __forceinline__ float xform(float z, const SParams& p) {
  if (MODE == kCap || (MODE == kGeneral && p.cap)) return __fmul_rn(p.softcap, tanhf(__fmul_rn(z, p.s_over_c)));
  return __fmul_rn(z, p.scale);
}

// A thread's (or a tree node's) partial statistics of a row: maximum m, Σ exp(a − m), the first
// index of the maximum (−1: none above −inf yet), and for label smoothing u = Σ ω (m − a) and
// w = Σ ω over its finite elements, ninf = Σ ω·∞ over its −inf elements.
struct Acc {
  float m, s;
  double u, w;
  float ninf;
  int am;
};
__device__ __forceinline__ Acc acc_identity() { return Acc{neg_inf(), 0.f, 0.0, 0.0, 0.f, -1}; }

// u relative to m moved to relative to mn ≥ m: + w·(mn − m) (nothing while m = −inf: then no
// finite element has been seen, w = 0).
__device__ __forceinline__ double rebase(double u, double w, float m, float mn) {
  return (m != mn && m > neg_inf()) ? __dadd_rn(u, __dmul_rn(w, __dsub_rn(double(mn), double(m)))) : u;
}

// Folds y into x (x holds the lower element indices when it comes first in the tree: the
// argmax takes the smaller index among equal maxima either way).
template <bool SMOOTH> __device__ __forceinline__ void merge(Acc& x, const Acc& y) {
  const float mn = fmaxf(x.m, y.m);
  const float s1 = x.m == mn ? x.s : __fmul_rn(x.s, ex2(__fmul_rn(__fsub_rn(x.m, mn), kLog2e)));
  const float s2 = y.m == mn ? y.s : __fmul_rn(y.s, ex2(__fmul_rn(__fsub_rn(y.m, mn), kLog2e)));
  const int ax = (x.am >= 0 && x.m == mn) ? x.am : INT_MAX;
  const int ay = (y.am >= 0 && y.m == mn) ? y.am : INT_MAX;
  const int am = ax < ay ? ax : ay;
  if (SMOOTH) {
    x.u = __dadd_rn(rebase(x.u, x.w, x.m, mn), rebase(y.u, y.w, y.m, mn));
    x.w = __dadd_rn(x.w, y.w);
    x.ninf = __fadd_rn(x.ninf, y.ninf);
  }
  x.m = mn;
  x.s = __fadd_rn(s1, s2);
  x.am = am == INT_MAX ? -1 : am;
}

__device__ __forceinline__ Acc shfl_down_acc(const Acc& x, int o) {
  Acc y;
  y.m = __shfl_down_sync(0xffffffffu, x.m, o);
  y.s = __shfl_down_sync(0xffffffffu, x.s, o);
  y.u = __shfl_down_sync(0xffffffffu, x.u, o);
  y.w = __shfl_down_sync(0xffffffffu, x.w, o);
  y.ninf = __shfl_down_sync(0xffffffffu, x.ninf, o);
  y.am = __shfl_down_sync(0xffffffffu, x.am, o);
  return y;
}

// Fixed-order CTA tree; thread 0 returns the CTA's total.
template <bool SMOOTH> __device__ __forceinline__ Acc block_reduce(Acc x, Acc* s_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const Acc y = shfl_down_acc(x, o);
    if (lane < o) merge<SMOOTH>(x, y);
  }
  if (lane == 0) s_warp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < nwarps ? s_warp[lane] : acc_identity();
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const Acc y = shfl_down_acc(x, o);
      if (lane < o) merge<SMOOTH>(x, y);
    }
  }
  return x;
}

// One vector of the row into a thread's partial (elements outside the row are −inf for the
// maximum and Σexp, and skipped by the smoothing sums). ENT: *e, the thread's entropy sum
// against acc.m, follows it (a −inf element adds nothing).
template <class TZ, int MODE, bool ENT = false>
__device__ __forceinline__ void stats_vector(const uint4& raw, int64_t j0, bool full,
                                             const SParams& p, Acc& acc, float* e = nullptr) {
  constexpr int E = vec_elems<TZ>();
  constexpr bool kSmoothMode = MODE == kGeneral;
  float a[E];
  unpack<TZ>(raw, a);
#pragma unroll
  for (int q = 0; q < E; ++q) a[q] = xform<MODE>(a[q], p);
  if (!full) {
#pragma unroll
    for (int q = 0; q < E; ++q)
      if (j0 + q < 0 || j0 + q >= p.vocab) a[q] = neg_inf();
  }
  float vm = a[0];
#pragma unroll
  for (int q = 1; q < E; ++q) vm = fmaxf(vm, a[q]);  // NaN-free (fmaxf drops NaN)
  if (vm > acc.m) {  // a new running maximum: its first index (indices only grow per thread)
    int q0 = E - 1;
#pragma unroll
    for (int q = E - 1; q >= 0; --q) q0 = a[q] == vm ? q : q0;
    acc.am = static_cast<int>(j0) + q0;
  }
  const float mn = fmaxf(acc.m, vm);
  if (kSmoothMode && p.smooth) acc.u = rebase(acc.u, acc.w, acc.m, mn);
  if constexpr (ENT) {
    if (acc.m != mn) *e = rebase_e(acc.m, mn, acc.s, *e);
  }
  acc.s = acc.m == mn ? acc.s : __fmul_rn(acc.s, ex2(__fmul_rn(__fsub_rn(acc.m, mn), kLog2e)));
  acc.m = mn;
  // all −inf so far: every term is exp(−inf) = 0. A +inf maximum makes its own term
  // exp(+inf − +inf) = NaN, and so s_r (rule 16, as the CE row kernels and torch's log_softmax)
  const float ms = mn == neg_inf() ? 0.f : mn;
  if constexpr (ENT) {
#pragma unroll
    for (int q = 0; q < E; ++q) {
      const float d = __fsub_rn(a[q], ms);
      const float x = ex2(__fmul_rn(d, kLog2e));
      acc.s = __fadd_rn(acc.s, x);
      *e = x != 0.f ? __fmaf_rn(x, d, *e) : *e;
    }
  } else {
#pragma unroll
    for (int q = 0; q < E; ++q) acc.s = __fadd_rn(acc.s, ex2(__fmul_rn(__fsub_rn(a[q], ms), kLog2e)));
  }
  if (kSmoothMode && p.smooth) {
    // Σ ω (mn − a) over the vector's finite elements (each term ≥ 0), Σ ω of them, and ω·∞ for
    // its −inf elements; +inf and NaN elements make u NaN or 0 at the end (rule 16)
    float vs = 0.f, vw = 0.f, vinf = 0.f;
#pragma unroll
    for (int q = 0; q < E; ++q) {
      const int64_t j = j0 + q;
      if (full || (j >= 0 && j < p.vocab)) {
        const float wq = p.class_weights ? __ldg(p.class_weights + p.vocab_start + j) : 1.f;
        if (fabsf(a[q]) < pos_inf()) {
          vs = __fmaf_rn(wq, __fsub_rn(mn, a[q]), vs);
          vw = __fadd_rn(vw, wq);
        } else if (a[q] == neg_inf()) {
          vinf = __fadd_rn(vinf, __fmul_rn(wq, pos_inf()));
        }
      }
    }
    acc.u = __dadd_rn(acc.u, static_cast<double>(vs));
    acc.w = __dadd_rn(acc.w, static_cast<double>(vw));
    acc.ninf = __fadd_rn(acc.ninf, vinf);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace fce
