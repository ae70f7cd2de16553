// ce/bulk_kernel.cuh — the bulk-copy row kernel of sm_90 (ce_rows_bulk_kernel): the logits
// streamed through shared memory by bulk copies (cp.async.bulk, the TMA engine) instead of loaded
// by the threads. GRAD = false: a row's loss, lse, z-loss, statistics and argmax without a
// gradient. GRAD = true: the same and the gradient, for rows a register-path CTA cannot hold
// alone. Why it is fast: without a gradient the op is a pure read stream, and one persistent
// CTA per SM keeps its ring of copies in flight all the time (a producer warp, consumer warps,
// a finisher warp), where the register path leaves no bytes in flight between one CTA's last
// load and the next one's first (45-88 % of copy on rows up to 128 KB on an H100; this kernel
// 91-101 %). ROWT instantiations (no label smoothing) add docs/semantics.md rule 18's entropy
// (t summed beside s) and lse / entropy gradient terms, as the register kernels' ROWT ones.
// Chosen by the table of ce/policy.h.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/ce/device.cuh"
#include "cuda/ce/geometry.cuh"

// How it runs:
//   * warp 0 (the producer) walks the CTA's rows (blockIdx.x, + gridDim.x, …) 32 at a time: its
//     lanes read each row's target, target logit, smoothing reference and ≤ 2 partial end
//     vectors (their stalls delay only the copies issued ahead, never the consumers), then
//     lane 0 copies the rows' whole 16-byte vectors, chunk by chunk, into a ring of stages,
//     each with a "full" mbarrier completed by the copy's transaction bytes and an "empty" one
//     the consumers arrive on; the row's facts ride in the stage's BulkStage record; a chunk
//     lands at its source address's offset modulo 128 in its stage (BulkStage::at: a copy
//     whose ends differ modulo 128 streamed 5-6 % slower; rows of 50257 bf16 start anywhere);
//   * warps 1..kBulkConsumerWarps (the consumers) fold each chunk into their online (max, Σexp
//     [, Σω·a]) partials with online_vector (ce/device.cuh, as every forward kernel);
//   * without a gradient (Ring<false>: kBulkStages chunks of kBulkChunkBytes) they release each
//     stage at once and, at a row's end, hand their per-thread partials to the last warp (the
//     finisher), which folds them in a fixed order and writes the row's outputs
//     (write_row_outputs, write_argmax_outputs: the same code as the other forward kernels)
//     while the consumers go on with the next row;
//   * with a gradient (Ring<true>: two stages of a whole row, ≤ kBulkRowBytes) they reduce the
//     row over the consumer warps themselves (a named barrier; every warp folds the same tree),
//     write the outputs, compute the gradient from shared memory with grad_vector (the one
//     gradient routine of every kernel) and store it, and only then release the stage (so the
//     gradient may overwrite the logits in global memory: in place). fce_backward_rescale runs
//     this same kernel (see ce_rows_bulk_kernel), so it recomputes the forward's very bits.
// The per-thread order of a row's vectors is increasing (the partial first vector before the
// chunks, the partial last one after), which the argmax tracking needs. A row with a NaN or
// +inf (Σexp NaN) scans its elements again for the argmax, as the other kernels do (from global
// memory without a gradient, from the stage with one). Deterministic: the chunking, the thread
// of each vector and the reduction trees depend only on V and the row's alignment.
// Graph-capturable: no allocation, no host sync.
//
// Chosen by the table of ce/policy.h on sm_90 for V ≤ 2^30 (element indices are int): without
// a gradient for rows of at least 16 KiB, with one for the rows where it measured faster; the
// knob FCE_CUDA_CE_PATH=bulk|nobulk (common/knobs.h) forces it on or off.

namespace fce {
namespace cuda {
namespace {

constexpr int kBulkConsumers = 32 * kBulkConsumerWarps;
static_assert(kBulkChunkBytes % 16 == 0 && kBulkRowBytes % 16 == 0,
              "bulk copies move whole 16-byte vectors");
// The ring: forward only, kBulkStages chunks of kBulkChunkBytes; with a gradient, two stages
// of a whole row each (the row stays in shared memory from its reduction to its gradient).
template <bool GRAD> struct Ring {
  static constexpr int kStages = GRAD ? kBulkGradStages : kBulkStages;
  static constexpr int kBytes = GRAD ? kBulkRowBytes : kBulkChunkBytes;
  static constexpr int kVecs = kBytes / 16;
  static constexpr int kStride = kBytes + kBulkStageSlack;  // a stage's place in the ring
};
static_assert(Ring<true>::kStages <= kBulkStages, "BulkShared holds kBulkStages stages");

// What the producer tells the consumers about a stage: the chunk, and its row's facts.
struct BulkStage {
  int64_t lrow;    // row of this launch
  int v_begin;     // the chunk's first vector (index among the row's vectors)
  int nv;          // whole vectors in the chunk
  int lead;        // elements of the row's first vector before the row
  int at;          // the chunk's offset in its stage: its source address modulo 128
  int flags;       // kStLast | kStHead | kStTail | kStDone
  float c;         // smoothing reference (general mode)
  float gl, ge;    // ROWT with a gradient: the row's grad_lse and grad_entropy (rule 18)
  RowInfo info;
  uint4 head, tail;  // the row's partial first / last vectors (in-row elements only)
};
constexpr int kStLast = 1, kStHead = 2, kStTail = 4, kStDone = 8;

// A finished row's per-thread partials (and argmax candidates), for the finisher warp.
struct RowEnd {
  Partial part[kBulkConsumers];
  int am[kBulkConsumers];
  RowInfo info;
  int64_t lrow;
  float c;
  int lead;
};

// Forward only: rows alternate between two RowEnd slots (with a gradient there are none).
template <bool GRAD> struct BulkEnds { RowEnd end[2]; };
template <> struct BulkEnds<true> {};

struct BulkShared {
  BulkStage st[kBulkStages];
  BulkStage batch[32];  // the producer warp's next rows
  Partial warp[2][kBulkConsumerWarps];   // with a gradient: the CTA reduction (alternating)
  uint64_t wmin[2][kBulkConsumerWarps];  // with a gradient: the argmax
  uint64_t full[kBulkStages];
  uint64_t empty[kBulkStages];
  uint64_t red_full[2];   // the consumer warps have stored a row's partials
  uint64_t red_empty[2];  // the finisher has read them
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Waits for the phase of `parity` of a CTA-local mbarrier to complete, the thread suspended
// (up to a 1 ms hint per try) rather than spinning: the waiting producer and finisher warps
// take no issue slots from the consumers. (The consumers wait with mbar_wait, no hint.)
__device__ __forceinline__ void bulk_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(smem_addr(bar)), "r"(parity), "r"(1000000u) : "memory");
  } while (!done);
}
__device__ __forceinline__ void consumers_sync() {  // the consumer warps only (barrier 1)
  asm volatile("bar.sync 1, %0;" ::"r"(kBulkConsumers) : "memory");
}
__device__ __forceinline__ void bulk_mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// `bytes` from global `src` into shared `dst`, completing on `bar` (both 16-byte aligned).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
#endif

// The facts of row lrow (of this launch) a stage carries, and its chunking (nch chunks of the
// whole vectors [fv0, fv0 + nfull)); the global reads of a row other than its whole vectors.
template <class TZ, int MODE>
__device__ __forceinline__ void bulk_row_facts(const KParams& p, int64_t lrow, BulkStage& b) {
  constexpr int E = vec_elems<TZ>();
  constexpr int eb = Ty<TZ>::kBytes;
  const int V = p.vocab;
  const char* zrow = p.logits + lrow * p.z_row_bytes;
  b.lrow = lrow;
  b.flags = 0;
  b.lead = static_cast<int>((reinterpret_cast<uintptr_t>(zrow) & 15) / eb);
  const int nvec = (b.lead + V + E - 1) / E;
  const int fv0 = b.lead ? 1 : 0;
  const int fv1 = (b.lead + V) / E;  // past the last whole vector
  b.v_begin = fv0;
  b.nv = fv1 > fv0 ? fv1 - fv0 : 0;  // here: the row's whole vectors (all chunks)
  if (b.lead) {
    b.flags |= kStHead;
    b.head = load_vector<TZ, kStreaming>(zrow, -b.lead, false, V);
  }
  if (fv1 < nvec && fv1 >= fv0) {  // a partial last vector that is not the first one
    b.flags |= kStTail;
    b.tail = load_vector<TZ, kStreaming>(zrow, fv1 * E - b.lead, false, V);
  }
  b.c = smoothing_reference<TZ, MODE>(p, zrow);
  b.info = load_row_info<TZ, MODE>(p, p.row_begin + lrow, zrow, true);
  b.gl = p.grad ? row_grad_lse(p, p.row_begin + lrow) : 0.f;
  b.ge = p.grad ? row_grad_entropy(p, p.row_begin + lrow) : 0.f;
}

// The producer warp: its 32 lanes read the facts of the CTA's next 32 rows at once (into
// sh.batch; their load latencies overlap instead of adding up row after row), then lane 0
// copies those rows chunk by chunk into the ring; after the last row a kDone stage.
template <class TZ, int MODE, bool GRAD>
__device__ __forceinline__ void bulk_produce(const KParams& p, BulkShared& sh, char* ring) {
  using R = Ring<GRAD>;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int eb = Ty<TZ>::kBytes;
  const int lane = threadIdx.x & 31;
  uint32_t it = 0;  // stages issued (lane 0)
  // the stage `it` once free: its record, filled by the caller, goes out with its copy
  auto next_stage = [&]() -> int {
    const int s = static_cast<int>(it % R::kStages);
    if (it >= R::kStages) bulk_wait(&sh.empty[s], ((it / R::kStages) - 1) & 1);
    return s;
  };
  for (int64_t base = blockIdx.x; base < p.rows_in_launch; base += int64_t(32) * gridDim.x) {
    const int64_t mine = base + int64_t(lane) * gridDim.x;
    if (mine < p.rows_in_launch) bulk_row_facts<TZ, MODE>(p, mine, sh.batch[lane]);
    __syncwarp();
    if (lane == 0) {
      for (int l = 0; l < 32 && base + int64_t(l) * gridDim.x < p.rows_in_launch; ++l) {
        const BulkStage& b = sh.batch[l];
        const char* zrow = p.logits + b.lrow * p.z_row_bytes;
        const int nfull = b.nv;  // (with a gradient the host ensures nfull ≤ R::kVecs)
        int nch = (nfull + R::kVecs - 1) / R::kVecs;
        if (nch < 1) nch = 1;  // a row inside one or two partial vectors: one empty chunk
        for (int ch = 0; ch < nch; ++ch) {
          const int s = next_stage();
          BulkStage& d = sh.st[s];
          d = b;
          d.v_begin = b.v_begin + ch * R::kVecs;
          d.nv = nfull - ch * R::kVecs < R::kVecs ? nfull - ch * R::kVecs : R::kVecs;
          d.flags = (ch == 0 ? (b.flags & kStHead) : 0) |
                    (ch == nch - 1 ? kStLast | (b.flags & kStTail) : 0);
          const uint32_t bytes = static_cast<uint32_t>(d.nv) * 16u;
          const char* src = zrow - b.lead * eb + int64_t(d.v_begin) * 16;
          d.at = static_cast<int>(reinterpret_cast<uintptr_t>(src) & (kBulkStageSlack - 1));
          mbar_expect(&sh.full[s], bytes);  // arrives (the stage record is released with it)
          if (bytes) bulk_copy(ring + size_t(s) * R::kStride + d.at, src, bytes, &sh.full[s]);
          ++it;
        }
      }
    }
    __syncwarp();  // lane 0 has copied the batch's records: sh.batch may be refilled
  }
  if (lane == 0) {
    const int s = next_stage();
    sh.st[s].flags = kStDone;
    mbar_expect(&sh.full[s], 0u);
  }
#else
  (void)p, (void)sh, (void)ring;
#endif
}

// Thread ct's share of a stage's nv whole vectors (vectors ct, ct + kBulkConsumers, …, the row's
// vectors v_begin + i), folded into its partial; U vectors read from shared memory at a time,
// a whole group of 16-bit kUnit vectors with the maximum first (fold_group_unit) unless the
// argmax is tracked. WT (ROWT): *tacc carries the thread's t against acc.m too (rule 18).
template <class TZ, int MODE, bool WT = false>
__device__ __forceinline__ void fold_stage(const KParams& p, const uint4* sv, int nv, int v_begin,
                                           int lead, float c, int ct, Partial& acc,
                                           bool want_argmax, int& am, float* tacc = nullptr) {
  constexpr int E = vec_elems<TZ>();
  constexpr int U = 4;
  for (int i0 = ct; i0 < nv; i0 += U * kBulkConsumers) {
    uint4 buf[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u * kBulkConsumers;
      buf[u] = i < nv ? sv[i] : make_uint4(0u, 0u, 0u, 0u);
    }
    if constexpr (MODE == kUnit && E == 8) {  // a whole group: the maximum first
      if (!want_argmax && i0 + (U - 1) * kBulkConsumers < nv) {
        fold_group_unit<TZ, U, WT>(buf, acc, tacc);
        continue;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u * kBulkConsumers;
      if (i < nv)
        online_vector<TZ, MODE, int, WT>(buf[u], (v_begin + i) * E - lead, true, p, c, acc,
                                         want_argmax, am, tacc);
    }
  }
}

// Thread ct's share of a stage: the row's partial first vector (thread 0, before the chunks),
// its share of the whole vectors (fold_stage), the partial last vector (the last thread, after
// them). WT (ROWT): with t (rule 18) in *tacc.
template <class TZ, int MODE, bool WT>
__device__ __forceinline__ void fold_row_stage(const KParams& p, const BulkStage& b,
                                               const uint4* sv, int ct, Partial& acc,
                                               bool want_argmax, int& am, float* tacc) {
  constexpr int E = vec_elems<TZ>();
  const int lead = b.lead, nv = b.nv;
  if ((b.flags & kStHead) && ct == 0)
    online_vector<TZ, MODE, int, WT>(b.head, -lead, false, p, b.c, acc, want_argmax, am, tacc);
  fold_stage<TZ, MODE, WT>(p, sv, nv, b.v_begin, lead, b.c, ct, acc, want_argmax, am, tacc);
  if ((b.flags & kStTail) && ct == kBulkConsumers - 1)
    online_vector<TZ, MODE, int, WT>(b.tail, (b.v_begin + nv) * E - lead, false, p, b.c, acc,
                                     want_argmax, am, tacc);
}
// fold_row_stage with t where a ROWT kernel's row needs it (need_t), else without.
template <class TZ, int MODE, bool ROWT>
__device__ __forceinline__ void fold_row_stage_t(const KParams& p, const BulkStage& b,
                                                 const uint4* sv, int ct, Partial& acc,
                                                 bool want_argmax, int& am, bool need_t,
                                                 float& tacc) {
  if constexpr (ROWT) {
    if (need_t) {
      fold_row_stage<TZ, MODE, true>(p, b, sv, ct, acc, want_argmax, am, &tacc);
      return;
    }
  }
  fold_row_stage<TZ, MODE, false>(p, b, sv, ct, acc, want_argmax, am, nullptr);
}
// ROWT: t is needed for the entropy, its gradient and the saved statistics' μ − m (the lse
// gradient alone needs none).
__device__ __forceinline__ bool bulk_need_t(const KParams& p) {
  return p.entropy_out != nullptr || p.grad_entropy != nullptr || p.stats_out != nullptr;
}

// The consumers (threads 32..): fold the stages, finish each row. ROWT: each thread's t (rule
// 18) rides to the finisher in its partial's sw (no label smoothing in a ROWT kernel).
template <class TZ, int MODE, bool ROWT>
__device__ __forceinline__ void bulk_consume(const KParams& p, BulkShared& sh, RowEnd* ends,
                                             const char* ring) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int ct = static_cast<int>(threadIdx.x) - 32, lane = ct & 31;
  const bool want_argmax = p.argmax_out != nullptr || p.row_correct != nullptr;
  const bool need_t = ROWT && bulk_need_t(p);
  Partial acc = partial_identity();
  float tacc = 0.f;  // ROWT: this thread's t against acc.m
  int am = -1;
  uint32_t nrow = 0;  // rows finished by this CTA
  for (uint32_t it = 0;; ++it) {
    const int s = static_cast<int>(it % Ring<false>::kStages);
    mbar_wait(&sh.full[s], (it / Ring<false>::kStages) & 1);  // (no suspend hint: measured slower)
    const BulkStage& b = sh.st[s];
    const int flags = b.flags;
    if (flags & kStDone) break;
    const int lead = b.lead;
    const float c = b.c;
    const uint4* sv = reinterpret_cast<const uint4*>(ring + size_t(s) * Ring<false>::kStride + b.at);
    fold_row_stage_t<TZ, MODE, ROWT>(p, b, sv, ct, acc, want_argmax, am, need_t, tacc);
    if (flags & kStLast) {  // the row's end: this thread's partial to the finisher
      const int slot = nrow & 1;
      const uint32_t use = nrow >> 1;
      if (use > 0) bulk_wait(&sh.red_empty[slot], (use - 1) & 1);
      RowEnd& e = ends[slot];
      e.part[ct] = acc;
      if constexpr (ROWT) e.part[ct].sw = static_cast<double>(tacc);
      if (want_argmax) e.am[ct] = am;
      if (ct == 0) {
        e.info = b.info;
        e.lrow = b.lrow;
        e.c = c;
        e.lead = lead;
      }
      acc = partial_identity();
      tacc = 0.f;
      am = -1;
      ++nrow;
    }
    __syncwarp();
    if (lane == 0) {
      bulk_mbar_arrive(&sh.empty[s]);  // the stage may be refilled
      if (flags & kStLast) bulk_mbar_arrive(&sh.red_full[(nrow - 1) & 1]);
    }
  }
#else
  (void)p, (void)sh, (void)ends, (void)ring;
#endif
}

// The consumers with a gradient: a stage holds a whole row. Its (max, Σexp) over the consumer
// warps (every warp finishes the same tree: the same bits everywhere, as block_reduce_all),
// the outputs, the gradient from shared memory (grad_vector, as every kernel), then the argmax
// from shared memory, and only then is the stage released (the gradient may be written over
// the logits in global memory: in place). ROWT: the reduction carries t (warp_reduce_t, the
// maximum first at both levels), the row's entropy is written and the gradient takes rule 18's
// terms (grad_vector_lean, as the register kernels).
template <class TZ, class TG, int MODE, bool ROWT>
__device__ __forceinline__ void bulk_consume_grad(const KParams& p, BulkShared& sh, const char* ring) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using R = Ring<true>;
  constexpr int E = vec_elems<TZ>();
  constexpr bool SW = MODE == kGeneral;
  const int ct = static_cast<int>(threadIdx.x) - 32, lane = ct & 31, cw = ct >> 5;
  const int V = p.vocab;
  const bool want_argmax = p.argmax_out != nullptr || p.row_correct != nullptr;
  const bool need_t = ROWT && bulk_need_t(p);
  int par = 0;
  for (uint32_t it = 0;; ++it) {
    const int s = static_cast<int>(it % R::kStages);
    mbar_wait(&sh.full[s], (it / R::kStages) & 1);
    const BulkStage& b = sh.st[s];
    const int flags = b.flags;
    if (flags & kStDone) break;
    const int lead = b.lead, v_begin = b.v_begin, nv = b.nv;
    const float c = b.c;
    const bool head = (flags & kStHead) && ct == 0, tail = (flags & kStTail) && ct == kBulkConsumers - 1;
    const int jt = (v_begin + nv) * E - lead;  // the partial last vector's first element
    const uint4* sv = reinterpret_cast<const uint4*>(ring + size_t(s) * R::kStride + b.at);
    Partial acc = partial_identity();
    float tacc = 0.f;  // ROWT: this thread's t against acc.m
    int am = -1;
    fold_row_stage_t<TZ, MODE, ROWT>(p, b, sv, ct, acc, want_argmax, am, need_t, tacc);
    // ---- the row's partial, every consumer warp folding the 8 warp partials in order
    Partial fin = partial_identity();
    if constexpr (ROWT) {  // (t in sw)
      const Partial x = warp_reduce_t(acc, tacc);
      if (lane == 0) sh.warp[par][cw] = x;
      consumers_sync();
      Partial r = partial_identity();
      if (lane < kBulkConsumerWarps) r = sh.warp[par][lane];
      fin = warp_reduce_t(r, static_cast<float>(r.sw));
    } else {
      Partial x = acc;
      warp_reduce<SW>(x);
      if (lane == 0) sh.warp[par][cw] = x;
      consumers_sync();
      if (lane < kBulkConsumerWarps) fin = sh.warp[par][lane];
      warp_reduce<SW>(fin);
    }
    const RowInfo ri = b.info;
    const int64_t lrow = b.lrow, row = p.row_begin + lrow;
    const RowVals vals = row_vals(p, ri, fin);
    float mum = 0.f;  // ROWT: μ − m = t/s
    if constexpr (ROWT) {
      mum = __fdiv_rn(static_cast<float>(fin.sw), fin.s);
      // H = log s − t/s (both terms ≥ 0: no cancellation); NaN without a finite maximum
      if (ct == 0 && p.entropy_out) p.entropy_out[row] = isfinite(fin.m) ? __fsub_rn(vals.ls, mum) : qnan();
    }
    if (ct == 0) write_row_outputs<MODE>(p, row, ri, fin, vals, c, mum);
    // ---- the gradient, from shared memory
    char* grow = p.grad + lrow * p.g_row_bytes;
    const bool vec_ok = grad_vec_ok<TZ, TG>(grow, lead);
    // ROWT: an ignored row's terms flow too (rule 18); rows without terms as below
    bool terms = false;
    if constexpr (ROWT)
      terms = ri.kind == kValid || (ri.kind == kIgnored && (b.gl != 0.f || b.ge != 0.f));
    if (terms) {
      RowGrad rg = make_row_grad<MODE>(p, ri, vals);
      const RowTerms rt = row_terms(p, ri, mum, b.gl, b.ge, rg);
      const LeanTerms lt = lean_terms(rg, rt);
      const int yl = ri.kind == kValid ? local_target<int, E>(p, ri.y) : -2 * E;
      const auto grad_all = [&](auto es) {
        constexpr bool ES = decltype(es)::value;
        if (head) grad_vector_lean<TZ, TG, MODE, ES>(b.head, -lead, false, vec_ok, p, rg, lt, rt, yl, grow);
        for (int i = ct; i < nv; i += kBulkConsumers)
          grad_vector_lean<TZ, TG, MODE, ES>(sv[i], (v_begin + i) * E - lead, true, vec_ok, p, rg,
                                             lt, rt, yl, grow);
        if (tail) grad_vector_lean<TZ, TG, MODE, ES>(b.tail, jt, false, vec_ok, p, rg, lt, rt, yl, grow);
      };
      if (lt.Es != 0.f) grad_all(std::true_type{});
      else grad_all(std::false_type{});
    } else if (ri.kind == kValid) {
      const RowGrad rg = make_row_grad<MODE>(p, ri, vals);
      const int yl = local_target<int, E>(p, ri.y);
      if (head) grad_vector<TZ, TG, MODE>(b.head, -lead, false, vec_ok, p, rg, yl, grow);
      for (int i = ct; i < nv; i += kBulkConsumers)
        grad_vector<TZ, TG, MODE>(sv[i], (v_begin + i) * E - lead, true, vec_ok, p, rg, yl, grow);
      if (tail) grad_vector<TZ, TG, MODE>(b.tail, jt, false, vec_ok, p, rg, yl, grow);
    } else {
      const float value = ri.kind == kInvalid ? qnan() : 0.f;
      if (head) fill_vector<TG, E>(-lead, false, vec_ok, V, value, grow);
      for (int i = ct; i < nv; i += kBulkConsumers)
        fill_vector<TG, E>((v_begin + i) * E - lead, true, vec_ok, V, value, grow);
      if (tail) fill_vector<TG, E>(jt, false, vec_ok, V, value, grow);
    }
    // ---- the argmax, from shared memory (a row with a NaN or +inf: every element again)
    if (want_argmax) {
      uint64_t best = (am >= 0 && acc.m == fin.m) ? ((uint64_t(1) << 32) | static_cast<uint32_t>(am))
                                                  : kNoArgmax;
      if (isnan(fin.s)) {
        best = kNoArgmax;
        if (head) argmax_vector<TZ, MODE>(b.head, -lead, false, p, fin.m, best);
        for (int i = ct; i < nv; i += kBulkConsumers)
          argmax_vector<TZ, MODE>(sv[i], (v_begin + i) * E - lead, true, p, fin.m, best);
        if (tail) argmax_vector<TZ, MODE>(b.tail, jt, false, p, fin.m, best);
      }
      best = warp_min_u64(best);
      if (lane == 0) sh.wmin[par][cw] = best;
      consumers_sync();
      if (cw == 0) {
        uint64_t r = lane < kBulkConsumerWarps ? sh.wmin[par][lane] : kNoArgmax;
        r = warp_min_u64(r);
        if (lane == 0) write_argmax_outputs(p, row, ri, r);
      }
    }
    __syncwarp();
    if (lane == 0) bulk_mbar_arrive(&sh.empty[s]);  // the stage may be refilled
    par ^= 1;
  }
#else
  (void)p, (void)sh, (void)ring;
#endif
}

// The finisher warp: each row's kBulkConsumers partials in a fixed order (lane l folds
// partials 8l … 8l + 7, then the warp tree), its outputs, and the argmax. ROWT: the row's t
// (each partial's, in its sw) rescaled to the row's maximum and summed in the same order, and
// the entropy.
template <class TZ, int MODE, bool ROWT>
__device__ __forceinline__ void bulk_finish(const KParams& p, BulkShared& sh, const RowEnd* ends) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int E = vec_elems<TZ>();
  constexpr bool SW = MODE == kGeneral;
  constexpr int PER = kBulkConsumers / 32;
  const int lane = threadIdx.x & 31;
  const int V = p.vocab;
  const bool want_argmax = p.argmax_out != nullptr || p.row_correct != nullptr;
  const bool need_t = ROWT && bulk_need_t(p);
  const int64_t mine = blockIdx.x < p.rows_in_launch
                           ? (p.rows_in_launch - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  for (int64_t k = 0; k < mine; ++k) {
    const int slot = static_cast<int>(k & 1);
    bulk_wait(&sh.red_full[slot], static_cast<uint32_t>(k >> 1) & 1);
    const RowEnd& e = ends[slot];
    Partial f = partial_identity();
    Partial th[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      th[i] = e.part[lane * PER + i];
      combine<SW>(f, th[i].m, th[i].s, th[i].sw);
    }
    warp_reduce<SW>(f);
    const Partial fin = f;
    float t = 0.f;  // ROWT: the row's t against fin.m
    if (need_t) {
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const float ti = static_cast<float>(th[i].sw);
        t = __fadd_rn(t, th[i].m == fin.m ? ti : rescale_t(th[i].m, fin.m, th[i].s, ti));
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) t = __fadd_rn(t, __shfl_xor_sync(0xffffffffu, t, o));
    }
    uint64_t best = kNoArgmax;
    if (want_argmax) {
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int am = e.am[lane * PER + i];
        const uint64_t key = (am >= 0 && th[i].m == fin.m)
                                 ? ((uint64_t(1) << 32) | static_cast<uint32_t>(am)) : kNoArgmax;
        best = key < best ? key : best;
      }
    }
    const RowInfo ri = e.info;
    const int64_t lrow = e.lrow;
    const float c = e.c;
    const int lead = e.lead;
    __syncwarp();
    if (lane == 0) bulk_mbar_arrive(&sh.red_empty[slot]);  // the slot may be refilled
    const int64_t row = p.row_begin + lrow;
    const RowVals vals = row_vals(p, ri, fin);
    float mum = 0.f;  // ROWT: μ − m = t/s
    if constexpr (ROWT) {
      mum = __fdiv_rn(t, fin.s);
      // H = log s − t/s (both terms ≥ 0: no cancellation); NaN without a finite maximum
      if (lane == 0 && p.entropy_out) p.entropy_out[row] = isfinite(fin.m) ? __fsub_rn(vals.ls, mum) : qnan();
    }
    if (lane == 0) write_row_outputs<MODE>(p, row, ri, fin, vals, c, mum);
    if (want_argmax) {
      if (isnan(fin.s)) {  // a NaN or +inf in the row: scan its elements (ce/device.cuh)
        best = kNoArgmax;
        const char* zrow = p.logits + lrow * p.z_row_bytes;
        const int nvec = (lead + V + E - 1) / E;
        for (int v = lane; v < nvec; v += 32) {
          const int j0 = v * E - lead;
          const uint4 raw = load_vector<TZ, kKeepInL2>(zrow, j0, is_full<int, E>(j0, V), V);
          argmax_vector<TZ, MODE>(raw, j0, is_full<int, E>(j0, V), p, fin.m, best);
        }
      }
      best = warp_min_u64(best);
      if (lane == 0) write_argmax_outputs(p, row, ri, best);
    }
  }
#else
  (void)p, (void)sh, (void)ends;
#endif
}

// grid: at most one CTA per SM (Ring<GRAD>::kStages · Ring<GRAD>::kStride of dynamic shared
// memory), each walking rows blockIdx.x, + gridDim.x, … of the launch (p.rows_in_launch).
// GRAD: the gradient too (rows of at most kBulkRowBytes of whole vectors), and
// fce_backward_rescale (p.rescale: nothing for an upstream 1, an exact in-place scaling for 0
// or ± a power of two, else the forward's gradient again: the same kernel, the same bits).
// ROWT: rule 18's entropy and lse / entropy gradient terms (no label smoothing: the unit, plain
// and softcap modes), as the register kernels' ROWT instantiations; fce_backward_rescale never
// runs them.
template <class TZ, class TG, int MODE, bool GRAD, bool ROWT = false>
__global__ void __launch_bounds__(kBulkThreads, 1) ce_rows_bulk_kernel(const KParams p) {
  static_assert(!(ROWT && MODE == kGeneral), "ROWT carries t in the partial's sw: no label smoothing");
  pdl_trigger();  // the finalize may start once every CTA has (it waits for our values)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (GRAD && !ROWT) {
    if (p.rescale) {
      if (*p.grad_output == 1.f) return;  // the usual case: nothing to do anywhere
      bool done = true;
      for (int64_t lrow = blockIdx.x; lrow < p.rows_in_launch && done; lrow += gridDim.x)
        done = rescale_prologue<TG>(p, p.row_begin + lrow, p.grad + lrow * p.g_row_bytes, 0, p.vocab);
      if (done) return;  // (g is one value: the first row decides for all)
    }
  }
  __shared__ BulkShared sh;
  __shared__ BulkEnds<GRAD> ends;
  extern __shared__ __align__(128) char ring[];
  if (threadIdx.x == 0) {
    for (int s = 0; s < Ring<GRAD>::kStages; ++s) {
      mbar_init_count(&sh.full[s], 1);
      mbar_init_count(&sh.empty[s], kBulkConsumerWarps);
    }
    for (int r = 0; r < 2; ++r) {
      mbar_init_count(&sh.red_full[r], kBulkConsumerWarps);
      mbar_init_count(&sh.red_empty[r], 1);
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    bulk_produce<TZ, MODE, GRAD>(p, sh, ring);
  } else if (threadIdx.x < 32 + kBulkConsumers) {
    if constexpr (GRAD) bulk_consume_grad<TZ, TG, MODE, ROWT>(p, sh, ring);
    else bulk_consume<TZ, MODE, ROWT>(p, sh, ends.end, ring);
  } else if constexpr (!GRAD) {
    bulk_finish<TZ, MODE, ROWT>(p, sh, ends.end);
  }
#else
  (void)p;
#endif
}

}  // namespace
}  // namespace cuda
}  // namespace fce
