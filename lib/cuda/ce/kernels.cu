// ce/kernels.cu — cross-entropy over given logits, row by row (docs/semantics.md steps 1-5 and
// rules 1-12): each row's loss, lse and λ·lse², and the gradient, in ONE read of the logits and
// ONE write of the gradient; plus the denominators pre-pass and the fixed-order finalize.
//
// Why it is fast. The op is memory bound (forward + gradient moves 2·N·V·e bytes for ~20 flops
// per element), so the goal is to touch each logit exactly once. A row is 250-500 KB, more than
// one SM's shared memory, so:
//   * Register path (ce_rows_regs_kernel), rows up to 1 MB: a row is split over a cluster of
//     k ≤ 16 CTAs (k = 1 only on sm_80; over 8 a non-portable size that sm_90 allows), each CTA
//     holding its ≤ 64 KB slice IN REGISTERS
//     as 16-byte vectors (≤ 512 threads × 8 uint4 = 32 registers). A thread issues all 8 of its
//     loads before the first use (64 KB in flight per CTA). Per thread an online (max, Σexp)
//     over its vectors (exp2 of scaled differences), a warp/CTA tree that every warp finishes
//     itself (no broadcast barrier), then each CTA stores its (max, Σexp[, Σω·a]) into every
//     CTA of the cluster with st.async, which completes on that CTA's mbarrier, and every warp
//     folds the k partials in rank order, so all agree bit for bit on the lse. No cluster
//     barrier sits on that path: the release a cluster barrier needs (barrier.cluster.arrive.
//     release) compiles to a GPU-wide memory barrier in every warp, which ncu found was the
//     largest stall of the kernel (H100: dev/NOTES.md); with the argmax outputs, and in
//     the persistent variant, the exchange keeps the cluster barriers. The gradient is then
//     computed from the registers and stored with 16-byte stores. ≤ 64 registers per thread
//     (launch bounds 512 × 2) keep two CTAs per SM: one CTA's loads overlap the other's math
//     and stores. The block is cut to the row (threads = ⌈slice / 8⌉ rounded up to a warp), and
//     k is the smallest power of two whose slices fit, so a CTA is nearly full, or for 16-bit
//     rows another size whose CTAs are fuller (choose_reg_config: 151936 bf16 in 5 CTAs of 480
//     threads, 2 per SM, holds 118 KB per SM where 8 CTAs of 320 threads, 3 per SM, held 111 KB,
//     and waits on 5 CTAs in the exchange instead of 8). On sm_90 a row longer than its CTAs'
//     registers hold may also keep up to kRegSmemVptMax more vectors per thread in shared memory (SMEM:
//     copied with cp.async in flight with the register loads, read back by the same thread for
//     the fold and the gradient; up to 96 KB more per CTA, still two CTAs per SM): such rows then
//     take clusters of fewer CTAs, and an SM holds more of them than its register file's 128 KB
//     (choose_reg_config; dev/NOTES.md, "shared-memory slots"). Four compiled modes per
//     dtype pair (unit = plain with s = 1, plain, softcap, general = label smoothing) keep the
//     hot ones lean (unit: no multiply per element; for 16-bit rows held in registers only, a
//     fold in two passes, the thread's maximum first, two elements per compare); the general
//     mode needs ~75-88 registers and runs one CTA per SM rather than spill. Each CTA first asks
//     the L2 for its slice of the row a quarter of a wave ahead, an eighth with slots (one bulk
//     prefetch, kDefaultPrefetchWaves / kSlotPrefetchWaves), so DRAM keeps reading while CTAs
//     reduce, exchange and store.
//   * Two-pass path (ce_rows_stream_kernel<…, BWD = false>), any V (rows past 1 MB, sm_80 rows
//     past 64 KB, or no cluster fits): one 1024-thread CTA per row, one CTA per SM, so only
//     #SMs rows (≈ 33 MB at 250 KB) are in flight and the second read mostly hits the 50 MB L2.
//     Pass 1: online (max, Σexp) with L2-keeping loads; pass 2 rereads the row BACKWARDS (the
//     last-read part is the likeliest still in L2) and writes the gradient.
//   * Backward (ce_rows_stream_kernel<…, BWD = true>): the saved lse makes every element
//     independent: one streaming pass with per-row constants; ignored and invalid rows are
//     written without being read.
//   * Forward without a gradient on sm_90, rows of 16 KB or more (ce_rows_bulk_kernel,
//     ce/bulk_kernel.cuh): a pure read stream; one persistent CTA per SM keeps three 64 KB bulk copies
//     of its rows in flight through a shared-memory ring (a producer warp, 8 consumer warps, a
//     finisher warp for the row ends), 91-101 % of copy at N = 16384 where the register and
//     two-pass kernels gave 61-95 % (H100: dev/NOTES.md). With a gradient the same kernel
//     holds a whole row per stage (two stages) for rows of 64-104 KB that are unaligned or over
//     88 KB, where the register path needs a cluster (V = 50257 bf16: 79 → 88 %) rather than
//     one CTA with shared-memory slots (that shape from 16 waves of rows: 88 → 92.5 % at
//     N = 16384); then fce_backward_rescale runs it too. Each copy lands at its source's
//     offset modulo 128 in its stage.
// Correctness rules kept by construction:
//   * Row starts need not be 16-byte aligned (odd V, any stride): vector v of a row covers
//     elements [v·E − lead, v·E − lead + E), lead = (row address mod 16) / e. Vectors inside
//     the row use 16-byte accesses; the ≤ 2 partial vectors of a row use element accesses for
//     its own elements only, so nothing outside [row, row + V) is ever read or written. When the
//     gradient's alignment differs from the logits' (other stride, base or dtype), vector v of
//     the gradient is stored element by element.
//   * Forward and backward write the same gradient bits: both compute every element in
//     grad_vector() from the same float lse and the same row constants (make_row_grad), with
//     explicit _rn intrinsics so no FMA contraction can differ between kernels or modes.
//   * fce_forward / fce_backward launch the row kernel as a programmatic dependent of the
//     denominators kernel and the finalize as one of the row kernel (sm_90): each may start
//     early and waits (griddepcontrol.wait) before it reads the other's output (ce/device.cuh).
//   * No float atomics: per-row values go to row_loss / row_zloss; ce_finalize_kernel sums
//     them in a fixed order (one block, double accumulation): deterministic run to run.
//   * 64-bit row offsets (row · stride · e in int64); 32-bit element indices only where V is
//     known to be ≤ 2^19 (register path).
//   * The register path's index arithmetic (reg_config, reg_slice, is_full, grad_vec_ok) is
//     shared with a host self-test, ce_rows_selftest() (ce/path.cu; the ctest target
//     CudaCeRowsSelftest runs it without a GPU): every element owned exactly once, every 16-byte
//     access aligned and inside its row.
//
// The files: ce/rows.cuh (the interface), ce/geometry.cuh (block sizes, the register path's
// split, the host-side path choice implemented in ce/path.cu), ce/memory.cuh and ce/device.cuh
// (the device helpers: row reads and writes; the math, the row semantics, the gradient), this
// file (the two row kernels and launch_ce_rows), ce/reduce.cu (the denominators pre-pass and
// the finalize, one block each). Every message starts with the public function's name (a.fn).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/ce/bulk_kernel.cuh"
#include "cuda/ce/device.cuh"
#include "cuda/ce/geometry.cuh"
#include "cuda/ce/policy.h"
#include "cuda/ce/rows.cuh"
#include "cuda/common/launch_check.cuh"

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
  return key == kNoArgmax ? 0xffffffffu
                          : (static_cast<uint32_t>(key >> 32) << 31) | static_cast<uint32_t>(key & 0x7fffffffu);
}
__device__ __forceinline__ uint64_t unpack_key(uint32_t k) {
  return k == 0xffffffffu ? kNoArgmax
                          : (uint64_t(k >> 31) << 32) | static_cast<uint64_t>(k & 0x7fffffffu);
}

// One row (lrow, of this launch) by one CTA of its cluster: the body of ce_rows_regs_kernel.
// xmbar: the cluster's partials are exchanged through st.async and this CTA's mbarrier (one
// row per CTA, no argmax: ce_rows_regs_kernel set it up), else through cluster barriers.
// SMEM: the CTA also holds p.reg_smem slots per thread in shared memory, svec (slot kRegVpt + i
// of thread t at svec[i·blockDim + t]); only their own thread reads them. Without (the shape
// of rows a CTA's registers hold) the kernel is the registers-only one, compiled apart.
template <class TZ, class TG, int MODE, bool SMEM>
__device__ __forceinline__ void regs_row(const KParams& p, int64_t lrow, int64_t next_lrow,
                                         bool xmbar, RegShared& sh, uint4* svec) {
  constexpr int E = vec_elems<TZ>();
  constexpr int eb = Ty<TZ>::kBytes;
  constexpr bool SW = MODE == kGeneral;
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
  // ---- all loads of the slice in flight at once
  uint4 buf[kRegVpt];
#pragma unroll
  for (int i = 0; i < kRegVpt; ++i) {
    const int j0 = j00 + i * jstep;
    buf[i] = make_uint4(0u, 0u, 0u, 0u);
    if (v0 + i * nt < vend) buf[i] = load_vector<TZ, kStreaming>(zrow, j0, is_full<int, E>(j0, V), V);
  }
  // the argmax keys of the registers' elements against the row's maximum m (a row with a NaN or
  // +inf: the argmax note above)
  auto scan_registers = [&](float m, uint64_t& best) {
#pragma unroll
    for (int i = 0; i < kRegVpt; ++i) {
      const int j0 = j00 + i * jstep;
      if (v0 + i * nt < vend) argmax_vector<TZ, MODE>(buf[i], j0, is_full<int, E>(j0, V), p, m, best);
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
  // The row's target and its logit (load_row_info, thread 0): for 16-bit rows before the fold,
  // for float32 rows after it. Measured on an H100 (dev/NOTES.md, 2026-11-25):
  // after the fold, float32 forward + gradient at 4096×32000 ran 91.5 → 94.5 % of copy and
  // 8192×32000 93.9 → 96.7 %, while 16-bit rows lost up to 9 points (16384×128256 bf16 95.7 →
  // 86.6 %).
  constexpr bool kInfoAfterFold = Ty<TZ>::kBytes == 4;
  if (!kInfoAfterFold && tid == 0)
    s_info = load_row_info<TZ, MODE>(p, row, zrow, rank == 0 || p.token_scaling);
  const float c = smoothing_reference<TZ, MODE>(p, zrow);

  // ---- phase 1: (max, Σexp[, Σω·(a − c)]) of the slice
  Partial acc = partial_identity();
  int am = -1;
  // kUnit, 16-bit, registers only: two passes (max_vector, sumexp_vector: ce/device.cuh), the
  // thread's maximum (two elements per compare) and then the sum. Measured on an H100 against the
  // online fold of the same kernels (dev/NOTES.md, 2026-11-28): forward + gradient
  // 1024×32000 bf16 64.0 → 65.6 % of copy, 1024×128256 84.4 → 85.3, 4096×32000 87.3 → 87.7, the
  // other shapes within 0.5 point; with shared-memory slots (read twice) 16384×50257 bf16 fell
  // 93.3 → 89.2 and float32 rows 0.5-1.1 points, so those keep the online fold.
  if constexpr (MODE == kUnit && !SMEM && E == 8) {
    uint32_t pm = packed_neg_inf<TZ>();
    float fm = neg_inf();
#pragma unroll
    for (int i = 0; i < kRegVpt; ++i) {
      const int j0 = j00 + i * jstep;
      if (v0 + i * nt < vend) max_vector<TZ>(buf[i], j0, is_full<int, E>(j0, V), V, pm, fm);
    }
    const float m = max_total<TZ>(pm, fm);
    const float ms = m == neg_inf() ? 0.f : m;  // all −inf: every term is exp(−inf) = 0
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kRegVpt; ++i) {
      const int j0 = j00 + i * jstep;
      if (v0 + i * nt < vend) sumexp_vector<TZ>(buf[i], j0, is_full<int, E>(j0, V), V, ms, sum);
    }
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
#pragma unroll
    for (int i = 0; i < kRegVpt; ++i) {
      const int j0 = j00 + i * jstep;
      if (v0 + i * nt < vend)
        online_vector<TZ, MODE>(buf[i], j0, is_full<int, E>(j0, V), p, c, acc, want_argmax, am);
    }
    if constexpr (SMEM) {
      async_copies_wait();
#pragma unroll 1
      for (int i = 0; i < ns_used; ++i) {
        const int j0 = j00 + (kRegVpt + i) * jstep;
        online_vector<TZ, MODE>(svec[i * nt + tid], j0, is_full<int, E>(j0, V), p, c, acc,
                                want_argmax, am);
      }
    }
  }
  if (kInfoAfterFold && tid == 0)
    s_info = load_row_info<TZ, MODE>(p, row, zrow, rank == 0 || p.token_scaling);
  // every warp ends with the CTA's partial (and, after the barrier inside, s_info is there)
  const Partial blk = block_reduce_all<SW>(acc, s_warp);

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
      for (int r = 0; r < k; ++r)
        combine<SW>(f, __shfl_sync(0xffffffffu, mine.m, r), __shfl_sync(0xffffffffu, mine.s, r),
                    SW ? __shfl_sync(0xffffffffu, mine.sw, r) : 0.0);
      fin = f;
    } else {
      if (tid == 0) sh.part = blk;
      cluster_sync_release_acquire();
      if (tid < 32) {
        Partial mine = partial_identity();
        if (tid < k) mine = *cooperative_groups::this_cluster().map_shared_rank(&sh.part, tid);
        Partial f = partial_identity();
        for (int r = 0; r < k; ++r)
          combine<SW>(f, __shfl_sync(0xffffffffu, mine.m, r), __shfl_sync(0xffffffffu, mine.s, r),
                      SW ? __shfl_sync(0xffffffffu, mine.sw, r) : 0.0);
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
  const RowVals vals = row_vals(p, ri, fin);
  if (rank == 0 && tid == 0) write_row_outputs<MODE>(p, row, ri, fin, vals, c);
  // the argmax's reduction comes after the gradient: this thread's candidate waits in shared
  // memory (no register held through the gradient). With SMEM a row with a NaN or +inf (the
  // argmax note above) scans its elements for the candidate first, while the registers hold the
  // logits: then nothing reads the registers after the gradient and the shared-memory slots'
  // gradient loop runs with them free.
  if constexpr (!SMEM) {
    if (want_argmax) s_cand[tid] = (am >= 0 && acc.m == fin.m) ? static_cast<uint32_t>(am) : 0xffffffffu;
  } else if (want_argmax) {
    uint64_t best = (am >= 0 && acc.m == fin.m) ? ((uint64_t(1) << 32) | static_cast<uint32_t>(am))
                                                : kNoArgmax;
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
    if (ri.kind == kValid) {
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
        if (v0 + i * nt < vend) fill_vector<TG, E>(j0, is_full<int, E>(j0, V), vec_ok, V, value, grow);
      }
    }
  }
  // ---- the argmax, once the gradient is out: the candidates to the CTA, then the cluster
  // (registers only: a row with a NaN or +inf scans the registers, still holding the row, now)
  if (want_argmax) {
    const uint32_t cand = s_cand[tid];
    uint64_t best = SMEM ? unpack_key(cand)
                         : cand == 0xffffffffu ? kNoArgmax : ((uint64_t(1) << 32) | cand);
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
template <class TZ, class TG, int MODE, bool LOOP, bool SMEM>
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
    regs_row<TZ, TG, MODE, SMEM>(p, first, next, xmbar, sh, reg_svec);
  } else {
    if (p.rescale && *p.grad_output == 1.f) return;  // the usual case: nothing to do anywhere
    const int64_t stride = gridDim.x / k;
    for (int64_t lrow = first; lrow < p.rows_in_launch; lrow += stride) {
      regs_row<TZ, TG, MODE, SMEM>(p, lrow, p.prefetch_rows > 0 ? lrow + stride : INT64_MAX, false,
                                   sh, reg_svec);
      __syncthreads();  // the next row reuses the shared scalars
    }
  }
}

// ====================================================== streaming kernels ====
// Pass 1 of a streaming CTA: the row's (max, Σexp[, Σω·(a − c)]) with L2-keeping loads; the
// CTA's total is in s_final on return (after a barrier).
template <class TZ, int MODE>
__device__ __forceinline__ Partial stream_reduce(const KParams& p, const char* zrow, int lead,
                                                 int nvec, float c, Partial* s_warp,
                                                 Partial* s_final, bool track, Partial& mine,
                                                 int& am) {
  constexpr int E = vec_elems<TZ>();
  constexpr int U = MODE == kGeneral ? kStreamUnroll / 2 : kStreamUnroll;
  constexpr bool SW = MODE == kGeneral;
  const int V = p.vocab, tid = threadIdx.x, nt = blockDim.x, step = nt * U;
  Partial acc = partial_identity();
  for (int base = tid; base < nvec; base += step) {
    uint4 buf[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = base + u * nt;
      const int64_t j0 = int64_t(v) * E - lead;
      buf[u] = make_uint4(0u, 0u, 0u, 0u);
      if (v < nvec) buf[u] = load_vector<TZ, kKeepInL2>(zrow, j0, is_full<int64_t, E>(j0, V), V);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = base + u * nt;
      const int64_t j0 = int64_t(v) * E - lead;
      if (v < nvec) online_vector<TZ, MODE>(buf[u], j0, is_full<int64_t, E>(j0, V), p, c, acc, track, am);
    }
  }
  mine = acc;
  const Partial blk = block_reduce_all<SW>(acc, s_warp);
  if (threadIdx.x == 0) *s_final = blk;
  __syncthreads();
  return *s_final;
}

// One CTA per row. BWD = false: the two-pass forward (any V). BWD = true: the backward pass
// from the saved lse (one read and one write; ignored and invalid rows are only written) or from
// the saved row statistics of a column slice (stats_in). A row whose saved |lse| ≥ 1024 is
// reduced again first (pass 1): there the float lse no longer holds log s (docs/semantics.md rule 12).
constexpr float kRescueLse = 1024.f;
template <class TZ, class TG, int MODE, bool BWD>
__global__ void __launch_bounds__(BWD ? kBackwardThreads : kTwoPassThreads, BWD ? 2 : 1)
    ce_rows_stream_kernel(const KParams p) {
  pdl_trigger();  // the finalize may start once every CTA has (it waits for our values)
  constexpr int E = vec_elems<TZ>();
  constexpr int eb = Ty<TZ>::kBytes;
  // (the general two-pass kernel keeps 2 vectors in flight: 4 does not fit 64 registers on sm_80)
  constexpr int U = (MODE == kGeneral && !BWD) ? kStreamUnroll / 2 : kStreamUnroll;
  __shared__ Partial s_warp[32];
  __shared__ Partial s_final;
  __shared__ RowInfo s_info;
  __shared__ uint64_t s_wmin[32];

  const int64_t lrow = blockIdx.x;
  const int64_t row = p.row_begin + lrow;
  const char* zrow = p.logits + lrow * p.z_row_bytes;
  const int V = p.vocab;
  const int lead = static_cast<int>((reinterpret_cast<uintptr_t>(zrow) & 15) / eb);
  const int nvec = static_cast<int>((int64_t(lead) + V + E - 1) / E);  // ≤ 2^29
  const int tid = threadIdx.x, nt = blockDim.x;
  const int step = nt * U;

  if constexpr (!BWD) {
    if (p.rescale && rescale_prologue<TG>(p, row, p.grad + lrow * p.g_row_bytes, 0, V)) return;
  }
  const bool want_argmax = !BWD && (p.argmax_out != nullptr || p.row_correct != nullptr);
  if (tid == 0)
    s_info = load_row_info<TZ, MODE>(p, row, zrow, !BWD || (p.token_scaling && !p.stats_in));
  const float c = BWD ? 0.f : smoothing_reference<TZ, MODE>(p, zrow);
  RowVals vals;
  Partial fin = partial_identity(), mine;
  int am = -1;
  if constexpr (!BWD) {
    fin = stream_reduce<TZ, MODE>(p, zrow, lead, nvec, c, s_warp, &s_final, want_argmax, mine, am);
    vals = row_vals(p, s_info, fin);
  } else {
    __syncthreads();  // s_info
    if (p.stats_in) {
      const CeRowStats st = p.stats_in[row];
      vals = RowVals{st.m, st.ls, __fadd_rn(st.m, st.ls), st.t};
    } else {
      const float lse = p.lse_in[row];
      if (s_info.kind == kValid && isfinite(lse) && fabsf(lse) >= kRescueLse) {
        fin = stream_reduce<TZ, MODE>(p, zrow, lead, nvec, c, s_warp, &s_final, false, mine, am);
        vals = make_row_vals(p, s_info, fin.m, logf(fin.s), lse);
      } else {
        vals = make_row_vals(p, s_info, lse, 0.f, lse);  // exp((a − lse) − 0)
      }
    }
  }
  const RowInfo ri = s_info;
  if constexpr (!BWD) {
    // The forward's argmax: tracked in pass 1, or (a row with a NaN or +inf) a scan of its own.
    uint64_t best = kNoArgmax;
    if (want_argmax && !isnan(fin.s) && am >= 0 && mine.m == fin.m)
      best = (uint64_t(1) << 32) | static_cast<uint32_t>(am);
    if (want_argmax && isnan(fin.s)) {
      for (int v = tid; v < nvec; v += nt) {
        const int64_t j0 = int64_t(v) * E - lead;
        const uint4 raw = load_vector<TZ, kKeepInL2>(zrow, j0, is_full<int64_t, E>(j0, V), V);
        argmax_vector<TZ, MODE>(raw, j0, is_full<int64_t, E>(j0, V), p, fin.m, best);
      }
    }
    if (want_argmax) {
      best = block_min_u64(best, s_wmin);
      if (tid == 0) write_argmax_outputs(p, row, ri, best);
    }
    if (tid == 0) write_row_outputs<MODE>(p, row, ri, fin, vals, c);
  }
  const bool grad_pass = p.grad && ri.kind == kValid;
  char* grow = p.grad ? p.grad + lrow * p.g_row_bytes : nullptr;
  if (grad_pass) {
    const bool vec_ok = grad_vec_ok<TZ, TG>(grow, lead);
    const RowGrad rg = make_row_grad<MODE>(p, ri, vals);
    const int64_t yl = local_target<int64_t, E>(p, ri.y);
    const int nchunks = (nvec + step - 1) / step;
    for (int ch = 0; ch < nchunks; ++ch) {
      // the forward's second read runs backwards: its last-read vectors are likeliest in L2
      const int base = (BWD ? ch : nchunks - 1 - ch) * step + tid;
      uint4 buf[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = base + u * nt;
        const int64_t j0 = int64_t(v) * E - lead;
        buf[u] = make_uint4(0u, 0u, 0u, 0u);
        if (v < nvec) buf[u] = load_vector<TZ, kStreaming>(zrow, j0, is_full<int64_t, E>(j0, V), V);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = base + u * nt;
        const int64_t j0 = int64_t(v) * E - lead;
        if (v < nvec)
          grad_vector<TZ, TG, MODE>(buf[u], j0, is_full<int64_t, E>(j0, V), vec_ok, p, rg, yl, grow);
      }
    }
  } else if (grow) {
    const bool vec_ok = grad_vec_ok<TZ, TG>(grow, lead);
    const float value = ri.kind == kInvalid ? qnan() : 0.f;
    if constexpr (BWD) {
      if (ri.kind == kInvalid && tid == 0 && p.error_flags)
        atomicOr(p.error_flags, FCE_FLAG_TARGET_OUT_OF_RANGE);
    }
    for (int v = tid; v < nvec; v += nt) {
      const int64_t j0 = int64_t(v) * E - lead;
      fill_vector<TG, E>(j0, is_full<int64_t, E>(j0, V), vec_ok, V, value, grow);
    }
  }
}

// ====================================================== launching the kernels ====
// A kernel as the runtime's host-side queries take it (cudaFuncGetAttributes, the occupancy).
template <class K> const void* kernel_address(K* kernel) {
  return reinterpret_cast<const void*>(kernel);
}

// One launch of a row kernel: `grid` CTAs of `threads` (and `smem` bytes of dynamic shared
// memory), in clusters of k when k > 1, as a programmatic dependent of the kernel before it when
// q.pdl.
template <class K>
fce_status launch_rows_kernel(const char* fn, const char* what, K* kernel, int64_t grid,
                              int threads, int k, const KParams& q, cudaStream_t s, int smem = 0) {
  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attrs[2];
  make_launch(static_cast<unsigned>(grid), static_cast<unsigned>(threads), k, q.pdl != 0, s, &cfg,
              attrs);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, q);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return fail(FCE_ERROR_CUDA,
                "%s: the CUDA kernel launch failed (%s, clusters of %d × %d threads): %s", fn,
                what, k, threads, cudaGetErrorString(e));
  }
  return launch_check(fn, what);
}

template <class TZ, class TG, int MODE, bool LOOP>
fce_status launch_forward_regs(const char* fn, const KParams& q, const RegConfig& rc,
                               int64_t grid_rows, cudaStream_t s) {
  if (rc.smem > 0)
    return launch_rows_kernel(fn, "ce_rows_regs_kernel with shared-memory slots",
                              ce_rows_regs_kernel<TZ, TG, MODE, LOOP, true>, grid_rows * rc.k,
                              rc.threads, rc.k, q, s, reg_smem_bytes(rc));
  return launch_rows_kernel(fn, "ce_rows_regs_kernel", ce_rows_regs_kernel<TZ, TG, MODE, LOOP, false>,
                            grid_rows * rc.k, rc.threads, rc.k, q, s);
}

template <class TZ, class TG, bool LOOP>
fce_status launch_regs_mode(const char* fn, int mode, const KParams& q, const RegConfig& rc,
                            int64_t grid_rows, cudaStream_t s) {
  return mode == kUnit  ? launch_forward_regs<TZ, TG, kUnit, LOOP>(fn, q, rc, grid_rows, s)
       : mode == kPlain ? launch_forward_regs<TZ, TG, kPlain, LOOP>(fn, q, rc, grid_rows, s)
       : mode == kCap   ? launch_forward_regs<TZ, TG, kCap, LOOP>(fn, q, rc, grid_rows, s)
                        : launch_forward_regs<TZ, TG, kGeneral, LOOP>(fn, q, rc, grid_rows, s);
}

template <class TZ, class TG, bool LOOP, bool SMEM> const void* regs_kernel(int mode) {
  return mode == kUnit  ? kernel_address(ce_rows_regs_kernel<TZ, TG, kUnit, LOOP, SMEM>)
       : mode == kPlain ? kernel_address(ce_rows_regs_kernel<TZ, TG, kPlain, LOOP, SMEM>)
       : mode == kCap   ? kernel_address(ce_rows_regs_kernel<TZ, TG, kCap, LOOP, SMEM>)
                        : kernel_address(ce_rows_regs_kernel<TZ, TG, kGeneral, LOOP, SMEM>);
}

// The bulk kernel of a mode (GRAD: with the gradient; without one TG is TZ).
template <class TZ, class TG, bool GRAD> auto bulk_kernel(int mode) {
  return mode == kUnit  ? ce_rows_bulk_kernel<TZ, TG, kUnit, GRAD>
       : mode == kPlain ? ce_rows_bulk_kernel<TZ, TG, kPlain, GRAD>
       : mode == kCap   ? ce_rows_bulk_kernel<TZ, TG, kCap, GRAD>
                        : ce_rows_bulk_kernel<TZ, TG, kGeneral, GRAD>;
}

template <class TZ, class TG>
fce_status launch_rows_typed(const CeRowsArgs& a, KParams p, int pair, cudaStream_t s) {
  constexpr int E = vec_elems<TZ>();
  p.z_row_bytes = a.row_stride * Ty<TZ>::kBytes;
  p.g_row_bytes = a.grad ? a.grad_row_stride * Ty<TG>::kBytes : 0;
  // kUnit (s = 1, the default): the register path and the bulk kernel without a multiply per
  // element (regs_row: 16-bit rows in registers fold in two passes)
  const int mode = p.smooth ? kGeneral : p.cap ? kCap : p.scale == 1.f ? kUnit : kPlain;

  // The kernel and its shape (ce/policy.h).
  RowsQuery rq;
  rq.shape.backward = a.lse_in || a.stats_in;
  rq.shape.with_grad = a.grad != nullptr;
  rq.shape.rows = a.row_count;
  rq.shape.vocab = a.vocab;
  rq.shape.elem_bytes = Ty<TZ>::kBytes;
  rq.shape.aligned_rows =
      (reinterpret_cast<uintptr_t>(a.logits) & 15) == 0 && (p.z_row_bytes & 15) == 0;
  rq.shape.rescale = p.rescale != 0;
  rq.slot = pair * 4 + mode;
  rq.regs_kernel = regs_kernel<TZ, TG, false, false>(mode);
  rq.regs_loop_kernel = regs_kernel<TZ, TG, true, false>(mode);
  rq.regs_smem_kernel = regs_kernel<TZ, TG, false, true>(mode);
  rq.regs_smem_loop_kernel = regs_kernel<TZ, TG, true, true>(mode);
  rq.bulk_kernel = a.grad ? kernel_address(bulk_kernel<TZ, TG, true>(mode))
                          : kernel_address(bulk_kernel<TZ, TZ, false>(mode));
  RowsChoice choice;
  FCE_TRY(choose_rows_path(a.fn, rq, &choice));
  const RegConfig& rc = choice.rc;

  // the first launch is a programmatic dependent of the denominators kernel (later ones, of
  // more than kMaxRowsPerLaunch rows, are ordinary launches)
  p.pdl = a.after_denominators && pdl_supported() ? 1 : 0;
  for (int64_t r0 = 0; r0 < a.row_count; r0 += kMaxRowsPerLaunch) {
    const int64_t n = a.row_count - r0 < kMaxRowsPerLaunch ? a.row_count - r0 : kMaxRowsPerLaunch;
    KParams q = p;
    q.pdl = r0 == 0 ? p.pdl : 0;
    q.row_begin = a.row_begin + r0;
    q.logits = static_cast<const char*>(a.logits) + r0 * p.z_row_bytes;
    q.grad = a.grad ? static_cast<char*>(a.grad) + r0 * p.g_row_bytes : nullptr;
    fce_status st = FCE_SUCCESS;
    if (choice.path == RowsPath::kBackward) {
      const unsigned threads = static_cast<unsigned>(stream_threads(a.vocab, E, kBackwardThreads));
      st = launch_rows_kernel(a.fn, "ce_rows_stream_kernel, backward",
                              mode == kPlain || mode == kUnit
                                  ? ce_rows_stream_kernel<TZ, TG, kPlain, true>
                                  : ce_rows_stream_kernel<TZ, TG, kGeneral, true>,
                              n, static_cast<int>(threads), 1, q, s);
    } else if (choice.path == RowsPath::kBulk) {
      q.rows_in_launch = n;
      const int64_t grid = n < choice.wave_rows ? n : choice.wave_rows;
      st = a.grad ? launch_rows_kernel(a.fn, "ce_rows_bulk_kernel, with the gradient",
                                       bulk_kernel<TZ, TG, true>(mode), grid, kBulkThreads, 1, q,
                                       s, bulk_ring_bytes(true))
                  : launch_rows_kernel(a.fn, "ce_rows_bulk_kernel",
                                       bulk_kernel<TZ, TZ, false>(mode), grid, kBulkThreads, 1, q,
                                       s, bulk_ring_bytes(false));
    } else if (choice.path == RowsPath::kRegisters) {
      q.cluster = rc.k;
      q.reg_smem = rc.smem;
      q.rows_in_launch = n;
      q.prefetch_rows = choice.prefetch_rows;
      q.xmbar_ok = choice.xmbar ? 1 : 0;
      if (choice.persistent) {
        const int64_t grid_rows = n < choice.wave_rows ? n : choice.wave_rows;
        st = launch_regs_mode<TZ, TG, true>(a.fn, mode, q, rc, grid_rows, s);
      } else {
        st = launch_regs_mode<TZ, TG, false>(a.fn, mode, q, rc, n, s);
      }
    } else {
      const unsigned threads = static_cast<unsigned>(stream_threads(a.vocab, E, kTwoPassThreads));
      st = launch_rows_kernel(a.fn, "ce_rows_stream_kernel, two-pass forward",
                              mode == kPlain || mode == kUnit
                                  ? ce_rows_stream_kernel<TZ, TG, kPlain, false>
                                  : ce_rows_stream_kernel<TZ, TG, kGeneral, false>,
                              n, static_cast<int>(threads), 1, q, s);
    }
    if (st != FCE_SUCCESS) return st;
  }
  return FCE_SUCCESS;
}

}  // namespace

// ================================================================ interface ====
fce_status launch_ce_rows(const CeRowsArgs& a, cudaStream_t s) {
  const char* fn = a.fn;
  if (a.row_count < 0 || a.row_begin < 0 || a.row_begin + a.row_count > a.total_rows ||
      a.vocab < 1 || a.vocab > INT32_MAX || !a.logits || !a.targets || !a.denoms ||
      a.row_stride < a.vocab || (a.grad && a.grad_row_stride < a.vocab))
    return fail(FCE_ERROR_INTERNAL,
                "%s: launch_ce_rows: bad arguments (rows %lld+%lld of %lld, vocab %lld, strides "
                "%lld/%lld)",
                fn, static_cast<long long>(a.row_begin), static_cast<long long>(a.row_count),
                static_cast<long long>(a.total_rows), static_cast<long long>(a.vocab),
                static_cast<long long>(a.row_stride), static_cast<long long>(a.grad_row_stride));
  const bool backward = a.lse_in || a.stats_in;
  if (backward && !a.grad)
    return fail(FCE_ERROR_INTERNAL,
                "%s: launch_ce_rows: backward (lse_in) without a gradient buffer", fn);
  if (a.rescale && (backward || !a.grad || !a.grad_output))
    return fail(FCE_ERROR_INTERNAL,
                "%s: launch_ce_rows: rescale needs a forward with grad and grad_output", fn);
  const int64_t vocab_total = a.vocab_total > 0 ? a.vocab_total : a.vocab;
  if (a.col_begin < 0 || a.col_begin + a.vocab > vocab_total || vocab_total > INT32_MAX ||
      (vocab_total != a.vocab && !a.stats_in))
    return fail(FCE_ERROR_INTERNAL, "%s: launch_ce_rows: bad column slice (%lld+%lld of %lld)",
                fn, static_cast<long long>(a.col_begin), static_cast<long long>(a.vocab),
                static_cast<long long>(vocab_total));
  if (a.row_count == 0) return FCE_SUCCESS;
  KParams p = make_params(a.opt, vocab_total);  // ε/V and Ω of the whole vocabulary
  p.vocab = static_cast<int>(a.vocab);            // the row length of these buffers
  p.col_begin = a.col_begin;
  p.targets = a.targets;
  p.denoms = a.denoms;
  p.grad_output = a.grad_output;
  p.lse_in = a.stats_in ? nullptr : a.lse_in;
  p.stats_in = a.stats_in;
  // a backward or a rescale writes the gradient (and error flags) only
  const bool outputs = !backward && !a.rescale;
  p.row_loss = outputs ? a.row_loss : nullptr;
  p.row_zloss = outputs ? a.row_zloss : nullptr;
  p.lse_out = outputs ? a.lse_out : nullptr;
  p.stats_out = outputs ? a.stats_out : nullptr;
  p.argmax_out = outputs ? a.argmax_out : nullptr;
  p.row_correct = outputs ? a.row_correct : nullptr;
  p.loss_has_z = a.opt.reduction == FCE_REDUCTION_NONE ? 1 : 0;
  p.error_flags = a.error_flags;
  p.rescale = a.rescale ? 1 : 0;
  // Without a gradient its dtype is irrelevant: use the logits' own pair.
  const int zd = a.logits_dtype, gd = a.grad ? a.grad_dtype : a.logits_dtype;
  if (zd == FCE_FLOAT32 && gd == FCE_FLOAT32) return launch_rows_typed<float, float>(a, p, 0, s);
  if (zd == FCE_FLOAT16 && gd == FCE_FLOAT16) return launch_rows_typed<__half, __half>(a, p, 1, s);
  if (zd == FCE_BFLOAT16 && gd == FCE_BFLOAT16)
    return launch_rows_typed<__nv_bfloat16, __nv_bfloat16>(a, p, 2, s);
  if (zd == FCE_FLOAT32 && gd == FCE_FLOAT16) return launch_rows_typed<float, __half>(a, p, 3, s);
  if (zd == FCE_FLOAT32 && gd == FCE_BFLOAT16)
    return launch_rows_typed<float, __nv_bfloat16>(a, p, 4, s);
  return fail(FCE_ERROR_UNSUPPORTED, "%s: launch_ce_rows: logits dtype %d with gradient dtype %d",
              fn, zd, gd);
}

}  // namespace cuda
}  // namespace fce
