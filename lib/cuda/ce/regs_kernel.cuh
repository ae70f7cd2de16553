// ce/regs_kernel.cuh — ce_rows_regs_kernel, the register path: a row split over a cluster of
// k ≤ 16 CTAs (k = 1 on sm_80), each CTA holding its ≤ 64 KB slice in registers (≤ 512 threads ×
// 8 uint4) and on sm_90 up to 96 KB more in shared-memory slots (cp.async, in flight with the
// register loads). A thread issues all its loads before the first use; an online (max, Σexp)
// per thread and a warp/CTA tree; each CTA stores its partial into every CTA of the cluster with
// st.async on an mbarrier (no cluster barrier, whose release is a GPU-wide memory barrier in
// every warp: the kernel's largest stall), every warp folds the k partials in rank order (all
// agree bit for bit), and the gradient is written from the registers with 16-byte stores. ≤ 64
// registers keep two CTAs per SM, one's loads under the other's math (the general mode, label
// smoothing, runs one). Each CTA first asks the L2 for a later row's slice. Four modes per dtype
// pair (unit: s = 1, plain, softcap, general) keep the hot ones lean; ROWT instantiations (all but
// general) add rule 18's entropy and lse / entropy gradient terms. A thread whose register slots
// are all full and inside its slice (the fast slots) runs its loops without a test per slot, and
// the reductions take the maximum first. Included by ce/kernels.cu
// alone (its anonymous namespace). The measurements behind each choice: dev/NOTES.md.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/ce/device.cuh"
#include "cuda/ce/geometry.cuh"

namespace fce {
namespace cuda {
namespace {

// ============================================================ register path ====
// (The split of a row over the CTAs of a cluster, RegSlice / reg_slice: ce/geometry.cuh.)
//
// grid.x = rows × k, clusters of (k,1,1) when k > 1. CTA `rank` of a row holds its vectors
// [rank·per, min((rank+1)·per, nvec)); thread t the vectors rank·per + t + i·blockDim,
// i < kRegVpt. The host guarantees blockDim·kRegVpt ≥ per for every row (reg_config) and
// V ≤ kRegMaxVocab (int indices).
// Two CTAs per SM (≤ 64 registers) for the plain and softcap modes; the general mode (label
// smoothing: ω_j loads and a double sum per vector) needs more registers than 64 − 32 and runs
// one CTA per SM instead of spilling.
// The shared memory of a register-path CTA (one row at a time).
struct RegShared {
  Partial warp[32];
  Partial fin;  // the row's (the barrier exchange)
  RowInfo info;
  uint64_t wmin[32];
  uint32_t cand[kRegThreads];  // each thread's argmax candidate (with slots: its key, pack_key)
  Partial part;                // this CTA's, read by the cluster (the barrier exchange)
  uint64_t best_part;
  alignas(16) Partial slots[kMaxCluster];  // the cluster's partials (the mbarrier exchange)
  uint64_t mbar;
  // The fast slots (regs_row): the thread whose registers hold the target's vector (−1: none)
  // and the target's logit z_y, for it to store the target's gradient after its vectors.
  int own;
  float zy;
  float gl, ge;  // ROWT: the row's grad_lse and grad_entropy (row_grad_lse, row_grad_entropy)
};

// Asks the L2 to fetch this CTA's slice of row lrow (of this launch) now: the full 16-byte
// vectors of [rank·per, vend) of that row, one bulk prefetch (sm_90; a no-op elsewhere).
// Nothing is read into the SM and nothing outside the row is touched; a later CTA's loads of
// that slice then find it in L2 instead of waiting for DRAM.
template <class TZ>
__device__ __forceinline__ void prefetch_slice(const KParams& p, int64_t lrow, int k, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int eb = Ty<TZ>::kBytes;
  const char* zrow = p.logits + lrow * p.z_row_bytes;
  const RegSlice g = reg_slice(reinterpret_cast<uintptr_t>(zrow), eb, p.vocab, k, rank, 0, 1);
  const int first_full = g.lead ? 1 : 0;
  const int last_full = (g.nvec * vec_elems<TZ>() - g.lead > p.vocab) ? g.nvec - 1 : g.nvec;
  const int v0 = g.v0 > first_full ? g.v0 : first_full;
  const int v1 = g.vend < last_full ? g.vend : last_full;
  if (v1 <= v0) return;
  const char* base = zrow - g.lead * eb + int64_t(v0) * 16;
  const uint32_t bytes = static_cast<uint32_t>(v1 - v0) * 16u;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base), "r"(bytes) : "memory");
#else
  (void)p, (void)lrow, (void)k, (void)rank;
#endif
}

// An argmax key (argmax_vector: j for a NaN, 2^32 | j for a maximum, kNoArgmax; j < 2^30 on the
// register path) in 32 bits and back, order kept: j, 2^31 | j, 0xffffffff.
__device__ __forceinline__ uint32_t pack_key(uint64_t key) {
  return key == kNoArgmax
             ? 0xffffffffu
             : (static_cast<uint32_t>(key >> 32) << 31) | static_cast<uint32_t>(key & 0x7fffffffu);
}
__device__ __forceinline__ uint64_t unpack_key(uint32_t k) {
  return k == 0xffffffffu ? kNoArgmax
                          : (uint64_t(k >> 31) << 32) | static_cast<uint64_t>(k & 0x7fffffffu);
}

// ROWT: the row's t against its maximum M from the cluster's k partials (lane r holds rank r's,
// its t in sw), rescaled and summed in rank order: the same bits in every warp.
__device__ __forceinline__ double fold_t(const Partial& mine, float M, int k) {
  float t = 0.f;
  for (int r = 0; r < k; ++r) {
    const float mr = __shfl_sync(0xffffffffu, mine.m, r), sr = __shfl_sync(0xffffffffu, mine.s, r);
    const float tr = static_cast<float>(__shfl_sync(0xffffffffu, mine.sw, r));
    t = __fadd_rn(t, mr == M ? tr : rescale_t(mr, M, sr, tr));
  }
  return static_cast<double>(t);
}

// The register path's fold of 16-bit rows in kUnit (regs_row, ce/kernels.cu; registers only)
// takes two passes over the registers instead of online_vector's one: the thread's maximum m of its elements first, then
// Σ exp(a − m) against it, with no running maximum to test and no rescale per vector. A full
// 16-bit vector goes into a packed running maximum (max.bf16x2 / max.f16x2, sm_80+: like fmaxf,
// a NaN loses against a number; a = z in kUnit, so the maximum of the raw values is the
// maximum of the a's); a partial vector into a float one (only its in-row elements). 16-bit
// rows only: float32 rows keep the online fold.
template <class TZ, class I>
__device__ __forceinline__ void max_vector(const uint4& raw, I j0, bool full, int V, uint32_t& pm,
                                           float& fm) {
  constexpr int E = vec_elems<TZ>();
  static_assert(E == 8, "the two-pass fold is for 16-bit rows");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (full) {
    pm = max2_raw<TZ>(pm, max2_raw<TZ>(max2_raw<TZ>(raw.x, raw.y), max2_raw<TZ>(raw.z, raw.w)));
    return;
  }
#endif
  float a[E];
  unpack<TZ>(raw, a);
#pragma unroll
  for (int q = 0; q < E; ++q)
    if (full || (j0 + q >= 0 && j0 + q < V)) fm = fmaxf(fm, a[q]);
}
// The argmax candidate of the two passes: the first in-row element equal to the thread's
// maximum m (> −inf), as online_vector's tracking leaves it; am < 0 until found.
template <class TZ, class I>
__device__ __forceinline__ void first_max_vector(const uint4& raw, I j0, bool full, int V, float m,
                                                 int& am) {
  constexpr int E = vec_elems<TZ>();
  float a[E];
  unpack<TZ>(raw, a);
  int q0 = -1;
#pragma unroll
  for (int q = E - 1; q >= 0; --q)
    if (a[q] == m && (full || (j0 + q >= 0 && j0 + q < V))) q0 = q;
  if (q0 >= 0) am = static_cast<int>(j0) + q0;
}

// The gradient of one full vector of a valid row without label smoothing, stored at dst (a
// 16-byte vector store: the fast slots of regs_row), its target element aside (regs_row stores
// that after its vectors, from RowInfo::zy): grad_vector's other elements, the same bits, without
// its tests. nlsl = −ls·log2e, prob's second term, once per row.
template <class TZ, class TG, int MODE>
__device__ __forceinline__ void grad_vector_full(const uint4& raw, const KParams& p,
                                                 const RowGrad& rg, float nlsl, char* dst) {
  constexpr int E = vec_elems<TZ>();
  float g[E];
  unpack<TZ>(raw, g);
#pragma unroll
  for (int q = 0; q < E; ++q) {
    float t;
    const float a = xform<MODE>(g[q], p, t);
    const float pr = ex2(__fmaf_rn(__fsub_rn(a, rg.m), kLog2e, nlsl));  // prob(a, rg.m, rg.ls)
    g[q] = grad_elem<MODE>(p, rg, pr, 0.f, t);
  }
  store_grad<TG, E>(dst, 0, true, true, p.vocab, g);
}

// The cluster's (max, Σ) from its k CTA partials (lane r holds rank r's) with the maximum
// first: M over the ranks, each lane's sum rescaled to M once, the sums added in rank order.
// Every warp gets the same bits. (With label smoothing regs_row merges them with combine.)
__device__ __forceinline__ Partial fold_ranks(const Partial& mine, int k) {
  float M = neg_inf();
  for (int r = 0; r < k; ++r) M = fmaxf(M, __shfl_sync(0xffffffffu, mine.m, r));
  const float term = rescaled(mine.s, mine.m, M);
  float s = 0.f;
  for (int r = 0; r < k; ++r) s = __fadd_rn(s, __shfl_sync(0xffffffffu, term, r));
  return Partial{M, s, 0.0};
}

// One row (lrow, of this launch) by one CTA of its cluster: the body of ce_rows_regs_kernel.
// xmbar: the cluster's partials are exchanged through st.async and this CTA's mbarrier (one
// row per CTA, no argmax: ce_rows_regs_kernel set it up), else through cluster barriers.
// SMEM: the CTA also holds p.reg_smem slots per thread in shared memory, svec (slot kRegVpt + i
// of thread t at svec[i·blockDim + t]); only their own thread reads them. Without (the shape
// of rows a CTA's registers hold) the kernel is the registers-only one, compiled apart.
template <class TZ, class TG, int MODE, bool SMEM, bool ROWT>
__device__ __forceinline__ void regs_row(const KParams& p, int64_t lrow, int64_t next_lrow,
                                         bool xmbar, RegShared& sh, uint4* svec) {
  constexpr int E = vec_elems<TZ>();
  constexpr int eb = Ty<TZ>::kBytes;
  constexpr bool SW = MODE == kGeneral;
  static_assert(!(ROWT && SW), "ROWT carries t in the partial's sw: no label smoothing");
  Partial* s_warp = sh.warp;
  uint64_t* s_wmin = sh.wmin;
  uint32_t* s_cand = sh.cand;
  RowInfo& s_info = sh.info;

  const int k = p.cluster;
  const int rank = static_cast<int>(blockIdx.x % static_cast<unsigned>(k));
  const int64_t row = p.row_begin + lrow;
  const char* zrow = p.logits + lrow * p.z_row_bytes;
  const int V = p.vocab;
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31;
  const RegSlice g = reg_slice(reinterpret_cast<uintptr_t>(zrow), eb, V, k, rank, tid, nt);
  const int lead = g.lead, v0 = g.v0, vend = g.vend, j00 = g.j00, jstep = g.jstep;
  if (p.rescale) {  // fce_backward_rescale: every CTA of the cluster decides the same way
    const int64_t per = (int64_t(V) + k - 1) / k, c0 = rank * per, c1 = c0 + per < V ? c0 + per : V;
    if (rescale_prologue<TG>(p, row, p.grad + lrow * p.g_row_bytes, c0, c1)) return;
  }
  if (tid == 0 && next_lrow < p.rows_in_launch) prefetch_slice<TZ>(p, next_lrow, k, rank);
  const bool want_argmax = p.argmax_out != nullptr || p.row_correct != nullptr;
  // The fast slots (16-bit rows without label smoothing): when this thread's register slots are
  // all inside the slice and full, but perhaps the last, which is then past the slice, and its
  // gradient row takes vector stores, its loops over them below run without a test per slot
  // (the slice's end, a partial vector's element loads, a scalar store, the target's column): on
  // the H200 those tests were about a fifth of the kernel's instructions at 16384×128256 bf16
  // (docs/performance.md). Every other thread (at most a warp or two of a CTA: the row's ends,
  // the slice's end) takes the general loops, and shared-memory slots keep theirs.
  constexpr bool kFast = E == 8 && !SW;
  bool fast = false, has_last = false;
  if constexpr (kFast) {
    has_last = v0 + (kRegVpt - 1) * nt < vend;
    const int jl = j00 + (has_last ? kRegVpt - 1 : kRegVpt - 2) * jstep;  // the last held slot
    fast = j00 >= 0 && v0 + (kRegVpt - 2) * nt < vend && jl <= V - E &&
           (!p.grad || grad_vec_ok<TZ, TG>(p.grad + lrow * p.g_row_bytes, lead));
  }
  // ---- all loads of the slice in flight at once
  uint4 buf[kRegVpt];
  if (fast) {
    const char* b = zrow + int64_t(j00) * eb;
    const int64_t sb = int64_t(jstep) * eb;
#pragma unroll
    for (int i = 0; i < kRegVpt - 1; ++i)
      buf[i] = ld_vec<kStreaming>(reinterpret_cast<const uint4*>(b + i * sb));
    buf[kRegVpt - 1] = make_uint4(0u, 0u, 0u, 0u);
    if (has_last)
      buf[kRegVpt - 1] = ld_vec<kStreaming>(reinterpret_cast<const uint4*>(b + (kRegVpt - 1) * sb));
  } else {
#pragma unroll
    for (int i = 0; i < kRegVpt; ++i) {
      const int j0 = j00 + i * jstep;
      buf[i] = make_uint4(0u, 0u, 0u, 0u);
      if (v0 + i * nt < vend)
        buf[i] = load_vector<TZ, kStreaming>(zrow, j0, is_full<int, E>(j0, V), V);
    }
  }
  // the argmax keys of the registers' elements against the row's maximum m (a row with a NaN or
  // +inf: the argmax note above)
  auto scan_registers = [&](float m, uint64_t& best) {
#pragma unroll
    for (int i = 0; i < kRegVpt; ++i) {
      const int j0 = j00 + i * jstep;
      if (v0 + i * nt < vend)
        argmax_vector<TZ, MODE>(buf[i], j0, is_full<int, E>(j0, V), p, m, best);
    }
  };
  // the slots past the registers, copied into shared memory, in flight with them (a slot is
  // past the CTA's slice from the first one that is: they increase)
  int ns_used = 0;
  if constexpr (SMEM) {
    const int ns = p.reg_smem;
    const uint64_t pol = evict_first_policy();
#pragma unroll 1
    for (; ns_used < ns && v0 + (kRegVpt + ns_used) * nt < vend; ++ns_used) {
      const int j0 = j00 + (kRegVpt + ns_used) * jstep;
      copy_vector_async<TZ>(svec + ns_used * nt + tid, zrow, j0, is_full<int, E>(j0, V), V, pol);
    }
  }
  // ROWT: the row's upstream lse and entropy gradients (read with s_info after the fold), loaded
  // now, so that their latency hides under the fold instead of stalling the gradient; by the
  // second warp's first thread, as thread 0 has load_row_info's chain of loads to make
  if constexpr (ROWT) {
    if (tid == (nt > 32 ? 32 : 0)) {
      sh.gl = row_grad_lse(p, row);
      sh.ge = row_grad_entropy(p, row);
    }
  }
  // The row's target and its logit (load_row_info, thread 0): for 16-bit rows before the fold,
  // for float32 rows after it. Measured on an H100 (dev/NOTES.md, 2026-11-25):
  // after the fold, float32 forward + gradient at 4096×32000 ran 91.5 → 94.5 % of copy and
  // 8192×32000 93.9 → 96.7 %, while 16-bit rows lost up to 9 points (16384×128256 bf16 95.7 →
  // 86.6 %).
  constexpr bool kInfoAfterFold = Ty<TZ>::kBytes == 4;

  if (!kInfoAfterFold && tid == 0) {
    s_info = load_row_info<TZ, MODE>(p, row, zrow, rank == 0 || p.token_scaling);
    if constexpr (kFast) {  // the thread whose registers hold the target's vector, and z_y
      const int yl = s_info.kind == kValid ? local_target<int, E>(p, s_info.y) : -1;
      const int dv = (yl + lead) / E - v0;  // (tid 0: v0 is the CTA's first vector)
      sh.own = -1;
      if (p.grad && yl >= 0 && dv >= 0 && dv < kRegVpt * nt && v0 + dv < vend) {
        sh.own = dv % nt;
        sh.zy = raw_to_float<TZ>(ld_elem<TZ>(zrow + int64_t(yl) * eb));
      }
    }
  }
  const float c = smoothing_reference<TZ, MODE>(p, zrow);

  // ---- phase 1: (max, Σexp[, Σω·(a − c)]) of the slice
  Partial acc = partial_identity();
  int am = -1;
  float tacc = 0.f;  // ROWT: this thread's t = Σ exp(a − m)(a − m) against acc.m
  // ROWT: t is needed for the entropy, its gradient and the saved statistics' μ − m (the lse
  // gradient alone needs none)
  const bool need_t =
      ROWT && (p.entropy_out != nullptr || p.grad_entropy != nullptr || p.stats_out != nullptr);
  // kUnit, 16-bit, registers only: two passes (max_vector, sumexp_vector above), the
  // thread's maximum (two elements per compare) and then the sum. Measured on an H100 against the
  // online fold of the same kernels (dev/NOTES.md, 2026-11-28): forward + gradient
  // 1024×32000 bf16 64.0 → 65.6 % of copy, 1024×128256 84.4 → 85.3, 4096×32000 87.3 → 87.7, the
  // other shapes within 0.5 point; with shared-memory slots (read twice) 16384×50257 bf16 fell
  // 93.3 → 89.2 and float32 rows 0.5-1.1 points, so those keep the online fold.
  if constexpr (MODE == kUnit && !SMEM && E == 8) {
    uint32_t pm = packed_neg_inf<TZ>();
    float fm = neg_inf();
    if (fast) {
#pragma unroll
      for (int i = 0; i < kRegVpt - 1; ++i) max_vector<TZ>(buf[i], 0, true, V, pm, fm);
      if (has_last) max_vector<TZ>(buf[kRegVpt - 1], 0, true, V, pm, fm);
    } else {
#pragma unroll
      for (int i = 0; i < kRegVpt; ++i) {
        const int j0 = j00 + i * jstep;
        if (v0 + i * nt < vend) max_vector<TZ>(buf[i], j0, is_full<int, E>(j0, V), V, pm, fm);
      }
    }
    const float m = max_total<TZ>(pm, fm);
    const float ms = m == neg_inf() ? 0.f : m;  // all −inf: every term is exp(−inf) = 0
    float sum = 0.f;
    const auto sum_pass = [&](auto with_t) {
      constexpr bool WT = decltype(with_t)::value;
      if (fabsf(ms) < kFfmaSumMax) {  // one FFMA per term (sumexp_vector_c)
        const float C = __fmul_rn(ms, kLog2e), r = __fmaf_rn(ms, kLog2e, -C);
        float s2 = 0.f, t2 = 0.f;
        const auto pass = [&](auto clamp) {
          const auto add = [&](const uint4& raw, int j0, bool full) {
            if constexpr (WT)
              sumexp_t_vector_c<TZ, decltype(clamp)::value>(raw, j0, full, V, C, s2, t2);
            else sumexp_vector_c<TZ>(raw, j0, full, V, C, s2);
          };
          if (fast) {
#pragma unroll
            for (int i = 0; i < kRegVpt - 1; ++i) add(buf[i], 0, true);
            if (has_last) add(buf[kRegVpt - 1], 0, true);
          } else {
#pragma unroll
            for (int i = 0; i < kRegVpt; ++i) {
              const int j0 = j00 + i * jstep;
              if (v0 + i * nt < vend) add(buf[i], j0, is_full<int, E>(j0, V));
            }
          }
        };
        pass(std::false_type{});
        if (WT && t2_again(t2)) {  // (a −inf element, or out-of-row ones: the clamped sums)
          s2 = t2 = 0.f;
          pass(std::true_type{});
        }
        const float back = ex2(-r);
        sum = __fmul_rn(s2, back);
        if constexpr (WT) tacc = __fmul_rn(__fmul_rn(__fmaf_rn(-r, s2, t2), back), kLn2);
        return;
      }
      if (fast) {
#pragma unroll
        for (int i = 0; i < kRegVpt - 1; ++i)
          sumexp_vector<TZ, WT>(buf[i], 0, true, V, ms, sum, tacc);
        if (has_last) sumexp_vector<TZ, WT>(buf[kRegVpt - 1], 0, true, V, ms, sum, tacc);
        return;
      }
#pragma unroll
      for (int i = 0; i < kRegVpt; ++i) {
        const int j0 = j00 + i * jstep;
        if (v0 + i * nt < vend)
          sumexp_vector<TZ, WT>(buf[i], j0, is_full<int, E>(j0, V), V, ms, sum, tacc);
      }
    };
    if (ROWT && need_t) sum_pass(std::true_type{});
    else sum_pass(std::false_type{});
    if (want_argmax && m != neg_inf()) {  // the first element equal to m
#pragma unroll
      for (int i = 0; i < kRegVpt; ++i) {
        const int j0 = j00 + i * jstep;
        if (am < 0 && v0 + i * nt < vend)
          first_max_vector<TZ>(buf[i], j0, is_full<int, E>(j0, V), V, m, am);
      }
    }
    acc = Partial{m, sum, 0.0};
  } else {
    const auto fold = [&](const uint4& raw, int j0, bool full) {
      if constexpr (ROWT) {
        if (need_t)
          online_vector<TZ, MODE, int, true>(raw, j0, full, p, c, acc, want_argmax, am, &tacc);
        else online_vector<TZ, MODE>(raw, j0, full, p, c, acc, want_argmax, am);
      } else {
        online_vector<TZ, MODE>(raw, j0, full, p, c, acc, want_argmax, am);
      }
    };
    if (fast) {
#pragma unroll
      for (int i = 0; i < kRegVpt - 1; ++i) fold(buf[i], j00 + i * jstep, true);
      if (has_last) fold(buf[kRegVpt - 1], j00 + (kRegVpt - 1) * jstep, true);
    } else {
#pragma unroll
      for (int i = 0; i < kRegVpt; ++i) {
        const int j0 = j00 + i * jstep;
        if (v0 + i * nt < vend) fold(buf[i], j0, is_full<int, E>(j0, V));
      }
    }
    if constexpr (SMEM) {
      async_copies_wait();
#pragma unroll 1
      for (int i = 0; i < ns_used; ++i) {
        const int j0 = j00 + (kRegVpt + i) * jstep;
        if constexpr (ROWT) {
          if (need_t)
            online_vector<TZ, MODE, int, true>(svec[i * nt + tid], j0, is_full<int, E>(j0, V), p, c,
                                               acc, want_argmax, am, &tacc);
          else
            online_vector<TZ, MODE>(svec[i * nt + tid], j0, is_full<int, E>(j0, V), p, c, acc,
                                    want_argmax, am);
        } else {
          online_vector<TZ, MODE>(svec[i * nt + tid], j0, is_full<int, E>(j0, V), p, c, acc,
                                  want_argmax, am);
        }
      }
    }
  }
  if (kInfoAfterFold && tid == 0)
    s_info = load_row_info<TZ, MODE>(p, row, zrow, rank == 0 || p.token_scaling);
  // every warp ends with the CTA's partial (and, after the barrier inside, s_info is there)
  // ROWT with t: the CTA's t against its maximum, carried in the partial's sw (unused without
  // smoothing, which ROWT kernels never have) through the cluster's exchange
  Partial blk;
  if constexpr (ROWT)
    blk = need_t ? block_reduce_all_t(acc, tacc, s_warp) : block_reduce_all<SW>(acc, s_warp);
  else blk = block_reduce_all<SW>(acc, s_warp);

  // ---- the row's partial: this CTA's, or the cluster's folded in rank order
  Partial fin = blk;
  bool bar_pending = false;  // a cluster barrier arrival to wait for before exit
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (k > 1) {
    if (xmbar) {
      cluster_wait();  // every CTA's mbarrier is initialised (ce_rows_regs_kernel)
      if (tid == 0) mbar_expect(&sh.mbar, static_cast<uint32_t>(k * sizeof(Partial)));
      if (tid < k) st_async_partial(blk, &sh.slots[rank], &sh.mbar, tid);
      mbar_wait(&sh.mbar, 0);
      // every warp folds the k partials in rank order (lane r holds rank r's): the same bits
      Partial mine = partial_identity();
      if (lane < k) mine = sh.slots[lane];
      Partial f = partial_identity();
      if constexpr (SW) {
        for (int r = 0; r < k; ++r)
          combine<SW>(f, __shfl_sync(0xffffffffu, mine.m, r), __shfl_sync(0xffffffffu, mine.s, r),
                      __shfl_sync(0xffffffffu, mine.sw, r));
      } else {
        f = fold_ranks(mine, k);
      }
      if constexpr (ROWT)
        if (need_t) f.sw = fold_t(mine, f.m, k);
      fin = f;
    } else {
      if (tid == 0) sh.part = blk;
      cluster_sync_release_acquire();
      if (tid < 32) {
        Partial mine = partial_identity();
        if (tid < k) mine = *cooperative_groups::this_cluster().map_shared_rank(&sh.part, tid);
        Partial f = partial_identity();
        if constexpr (SW) {
          for (int r = 0; r < k; ++r)
            combine<SW>(f, __shfl_sync(0xffffffffu, mine.m, r), __shfl_sync(0xffffffffu, mine.s, r),
                        __shfl_sync(0xffffffffu, mine.sw, r));
        } else {
          f = fold_ranks(mine, k);
        }
        if constexpr (ROWT)
          if (need_t) f.sw = fold_t(mine, f.m, k);
        if (tid == 0) sh.fin = f;
      }
      // waited for before exit (or the next row): nobody reads the part of an exited CTA (with
      // the argmax, the exchange below does that)
      if (!want_argmax) {
        cluster_arrive_relaxed();
        bar_pending = true;
      }
      __syncthreads();
      fin = sh.fin;
    }
  }
#endif
  // k > 1 never reaches code built without clusters (the host checks the kernel's PTX version);
  // were it to, the row would be NaN rather than silently wrong.
#if !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900)
  if (k > 1) fin = Partial{qnan(), qnan(), 0.0};
#endif
  const RowInfo ri = s_info;
  const float row_gl = ROWT ? sh.gl : 0.f, row_ge = ROWT ? sh.ge : 0.f;
  const RowVals vals = row_vals(p, ri, fin);
  float mum = 0.f;  // ROWT: μ − m = t/s
  if constexpr (ROWT) {
    mum = __fdiv_rn(static_cast<float>(fin.sw), fin.s);
    // H = log s − t/s (both terms ≥ 0: no cancellation); NaN without a finite maximum
    if (rank == 0 && tid == 0 && p.entropy_out)
      p.entropy_out[row] = isfinite(fin.m) ? __fsub_rn(vals.ls, mum) : qnan();
  }
  if (rank == 0 && tid == 0) write_row_outputs<MODE>(p, row, ri, fin, vals, c, mum);
  // the argmax's reduction comes after the gradient: this thread's candidate waits in shared
  // memory (no register held through the gradient). With SMEM a row with a NaN or +inf (the
  // argmax note above) scans its elements for the candidate first, while the registers hold the
  // logits: then nothing reads the registers after the gradient and the shared-memory slots'
  // gradient loop runs with them free.
  if constexpr (!SMEM) {
    if (want_argmax)
      s_cand[tid] = (am >= 0 && acc.m == fin.m) ? static_cast<uint32_t>(am) : 0xffffffffu;
  } else if (want_argmax) {
    uint64_t best =
        (am >= 0 && acc.m == fin.m) ? ((uint64_t(1) << 32) | static_cast<uint32_t>(am)) : kNoArgmax;
    if (isnan(fin.s)) {
      best = kNoArgmax;
      scan_registers(fin.m, best);
#pragma unroll 1
      for (int i = 0; i < ns_used; ++i) {
        const int j0 = j00 + (kRegVpt + i) * jstep;
        argmax_vector<TZ, MODE>(svec[i * nt + tid], j0, is_full<int, E>(j0, V), p, fin.m, best);
      }
    }
    s_cand[tid] = pack_key(best);
  }

  // ---- phase 2: the gradient, from the registers
  if (p.grad) {
    char* grow = p.grad + lrow * p.g_row_bytes;
    const bool vec_ok = grad_vec_ok<TZ, TG>(grow, lead);
    // ROWT: the row's gradient with rule 18's terms (an ignored row's terms flow too; a row
    // whose grad_entropy is 0 takes the cheaper form); the rows without terms (invalid, or
    // ignored with none) as below. (Not a function or lambda: the kernels without ROWT keep
    // their code only when this block is inside if constexpr.)
    bool done = false;
    if constexpr (ROWT) {
      if (ri.kind == kValid || (ri.kind == kIgnored && (row_gl != 0.f || row_ge != 0.f))) {
        RowGrad rg = make_row_grad<MODE>(p, ri, vals);
        const RowTerms rt = row_terms(p, ri, mum, row_gl, row_ge, rg);
        const LeanTerms lt = lean_terms(rg, rt);
        const int yl = ri.kind == kValid ? local_target<int, E>(p, ri.y) : -2 * E;
        auto grad_all = [&](auto es) {
          constexpr bool ES = decltype(es)::value;
          if (fast) {  // as the plain fast slots below: the target's owner stores it after
            const float nlsl = -__fmul_rn(rg.ls, kLog2e);
            char* const gb = grow + int64_t(j00) * Ty<TG>::kBytes;
            const int64_t sb = int64_t(jstep) * Ty<TG>::kBytes;
#pragma unroll
            for (int i = 0; i < kRegVpt - 1; ++i)
              grad_vector_lean_full<TZ, TG, MODE, ES>(buf[i], p, rg, lt, nlsl, gb + i * sb);
            if (has_last)
              grad_vector_lean_full<TZ, TG, MODE, ES>(buf[kRegVpt - 1], p, rg, lt, nlsl,
                                                      gb + (kRegVpt - 1) * sb);
            if (tid == sh.own) store_target_lean<TZ, TG, MODE>(p, rg, rt, sh.zy, yl, grow);
          } else {
#pragma unroll
            for (int i = 0; i < kRegVpt; ++i) {
              const int j0 = j00 + i * jstep;
              if (v0 + i * nt < vend)
                grad_vector_lean<TZ, TG, MODE, ES>(buf[i], j0, is_full<int, E>(j0, V), vec_ok, p,
                                                   rg, lt, rt, yl, grow);
            }
          }
          if constexpr (SMEM) {
#pragma unroll 1
            for (int i = 0; i < ns_used; ++i) {
              const int j0 = j00 + (kRegVpt + i) * jstep;
              grad_vector_lean<TZ, TG, MODE, ES>(svec[i * nt + tid], j0, is_full<int, E>(j0, V),
                                                 vec_ok, p, rg, lt, rt, yl, grow);
            }
          }
        };
        if (lt.Es != 0.f) grad_all(std::true_type{});
        else grad_all(std::false_type{});
        done = true;
      }
    }
    if (done) {
    } else if (ri.kind == kValid && fast) {
      const RowGrad rg = make_row_grad<MODE>(p, ri, vals);
      const float nlsl = -__fmul_rn(rg.ls, kLog2e);
      char* const gb = grow + int64_t(j00) * Ty<TG>::kBytes;
      const int64_t sb = int64_t(jstep) * Ty<TG>::kBytes;
#pragma unroll
      for (int i = 0; i < kRegVpt - 1; ++i)
        grad_vector_full<TZ, TG, MODE>(buf[i], p, rg, nlsl, gb + i * sb);
      if (has_last)
        grad_vector_full<TZ, TG, MODE>(buf[kRegVpt - 1], p, rg, nlsl, gb + (kRegVpt - 1) * sb);
      const int yl = local_target<int, E>(p, ri.y);
      if (tid == sh.own)  // after its vector, by the same thread: this value stays
        store_target<TG, MODE>(p, rg, sh.zy, int64_t(yl), grow);
      if constexpr (SMEM) {  // the slots in shared memory, as below
#pragma unroll 1
        for (int i = 0; i < ns_used; ++i) {
          const int j0 = j00 + (kRegVpt + i) * jstep;
          grad_vector<TZ, TG, MODE>(svec[i * nt + tid], j0, is_full<int, E>(j0, V), vec_ok, p, rg,
                                    yl, grow);
        }
      }
    } else if (ri.kind == kValid) {
      const RowGrad rg = make_row_grad<MODE>(p, ri, vals);
      const int yl = local_target<int, E>(p, ri.y);
#pragma unroll
      for (int i = 0; i < kRegVpt; ++i) {
        const int j0 = j00 + i * jstep;
        if (v0 + i * nt < vend)
          grad_vector<TZ, TG, MODE>(buf[i], j0, is_full<int, E>(j0, V), vec_ok, p, rg, yl, grow);
      }
      if constexpr (SMEM) {
#pragma unroll 1
        for (int i = 0; i < ns_used; ++i) {
          const int j0 = j00 + (kRegVpt + i) * jstep;
          grad_vector<TZ, TG, MODE>(svec[i * nt + tid], j0, is_full<int, E>(j0, V), vec_ok, p, rg,
                                    yl, grow);
        }
      }
    } else {
      const float value = ri.kind == kInvalid ? qnan() : 0.f;
#pragma unroll 1
      for (int i = 0; i < (SMEM ? kRegVpt + ns_used : kRegVpt); ++i) {
        const int j0 = j00 + i * jstep;
        if (v0 + i * nt < vend)
          fill_vector<TG, E>(j0, is_full<int, E>(j0, V), vec_ok, V, value, grow);
      }
    }
  }
  // ---- the argmax, once the gradient is out: the candidates to the CTA, then the cluster
  // (registers only: a row with a NaN or +inf scans the registers, still holding the row, now)
  if (want_argmax) {
    const uint32_t cand = s_cand[tid];
    uint64_t best = SMEM                  ? unpack_key(cand)
                    : cand == 0xffffffffu ? kNoArgmax
                                          : ((uint64_t(1) << 32) | cand);
    if (!SMEM && isnan(fin.s)) {
      best = kNoArgmax;
      scan_registers(fin.m, best);
    }
    best = block_min_u64(best, s_wmin);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (k > 1) {
      if (tid == 0) sh.best_part = best;
      cluster_sync_release_acquire();
      if (tid < 32) {
        uint64_t mine = kNoArgmax;
        if (tid < k) mine = *cooperative_groups::this_cluster().map_shared_rank(&sh.best_part, tid);
        best = warp_min_u64(mine);
      }
      cluster_arrive_relaxed();  // waited for before exit
      bar_pending = true;
    }
#endif
    if (rank == 0 && tid == 0) write_argmax_outputs(p, row, ri, best);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (bar_pending) cluster_wait();
#endif
}

// grid.x = (rows of the grid) × k. LOOP = false: one row per cluster, the grid covers the
// launch's rows; without the argmax outputs the cluster's partials go through st.async and an
// mbarrier (initialised here, then a relaxed cluster arrival that regs_row waits for before the
// first remote store). LOOP = true (persistent: fce_backward_rescale, whose CTAs usually have
// nothing to do): at most a wave of clusters, cluster
// c takes rows c, c + G, c + 2G, … (G = the grid's rows), exchanging through cluster barriers;
// every CTA of a cluster walks the same rows, so the barriers pair up. p.prefetch_rows > 0:
// each CTA first asks the L2 for its slice of the row that distance ahead (the next row of its
// own loop when LOOP).
template <class TZ, class TG, int MODE, bool LOOP, bool SMEM, bool ROWT = false>
__global__ void __launch_bounds__(kRegThreads, MODE == kGeneral ? 1 : 2)
    ce_rows_regs_kernel(const KParams p) {
  pdl_trigger();  // the finalize may start once every CTA has (it waits for our values)
  __shared__ RegShared sh;
  extern __shared__ __align__(16) uint4 reg_svec[];  // p.reg_smem × blockDim vectors
  const unsigned k = static_cast<unsigned>(p.cluster);
  const int64_t first = blockIdx.x / k;
  if constexpr (!LOOP) {
    const int64_t next = p.prefetch_rows > 0 ? first + p.prefetch_rows : INT64_MAX;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const bool want_argmax = p.argmax_out != nullptr || p.row_correct != nullptr;
    const bool xmbar = p.xmbar_ok && k > 1 && !want_argmax && !p.rescale;
    if (xmbar) {
      if (threadIdx.x == 0) mbar_init(&sh.mbar);
      cluster_arrive_relaxed();
    }
#else
    const bool xmbar = false;
#endif
    regs_row<TZ, TG, MODE, SMEM, ROWT>(p, first, next, xmbar, sh, reg_svec);
  } else {
    if (p.rescale && *p.grad_output == 1.f) return;  // the usual case: nothing to do anywhere
    const int64_t stride = gridDim.x / k;
    for (int64_t lrow = first; lrow < p.rows_in_launch; lrow += stride) {
      regs_row<TZ, TG, MODE, SMEM, ROWT>(p, lrow, p.prefetch_rows > 0 ? lrow + stride : INT64_MAX,
                                         false, sh, reg_svec);
      __syncthreads();  // the next row reuses the shared scalars
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace fce
