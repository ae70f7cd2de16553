// ce/geometry.cuh — the shapes of the cross-entropy row kernels (ce/kernels.cu): their block
// sizes, how the register path splits a row over the CTAs of a cluster, and the launch helpers
// (the choice of a kernel is ce/policy.h). The index arithmetic below is compiled for both sides
// on purpose: the kernels run it, and the host self-test ce_rows_selftest
// (ce/geometry_selftest.cpp; the ctest target CudaCeRowsSelftest, no GPU needed) checks the very
// same functions: every element of a row owned exactly once, every 16-byte access aligned and
// inside its row.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "internal.h"

namespace fce {
namespace cuda {

// ---------------------------------------------------------------- configuration ----
constexpr int kRegThreads = 512;      // most threads of a register-path CTA
constexpr int kRegVpt = 8;            // 16-byte vectors per thread (32 registers of the row)
constexpr int kRegVecsPerCta = kRegThreads * kRegVpt;  // 4096 vectors = 64 KB
// On sm_90 a register-path CTA of kRegThreads may also hold up to kRegSmemVptMax more vectors
// per thread in shared memory (loaded with cp.async, read back for the fold and the gradient):
// 96 KB more per CTA, two CTAs per SM still fit (dev/NOTES.md, "shared-memory slots"). Rows
// then fit clusters of fewer CTAs and an SM keeps more of them resident than its register
// file's 128 KB.
constexpr int kRegSmemVptMax = 12;
constexpr int kRegSmemBytesMax = kRegSmemVptMax * kRegThreads * 16;
constexpr int64_t kRegVecsPerCtaMax = int64_t(kRegThreads) * (kRegVpt + kRegSmemVptMax);
// Clusters of any size up to 16 CTAs: 8 is the portable limit, up to 16 a "non-portable" size
// sm_90 allows for a kernel that opts in (allow_cluster, ce/path.cu): float32 rows of 512 KB to
// 1 MB stay in registers instead of taking the two-pass kernel (dev/NOTES.md,
// "clusters of 16"). The size need not be a power of two (choose_reg_config).
constexpr int kMaxCluster = 16;
constexpr int64_t kRegMaxVocab = kRegVecsPerCtaMax * kMaxCluster * 8;  // loose bound
constexpr int kTwoPassThreads = 1024;
constexpr int kBackwardThreads = 512;
constexpr int kStreamUnroll = 4;      // vectors in flight per thread in the streaming kernels
constexpr int kReduceThreads = 1024;  // denominators / finalize (one block)
constexpr int kRegFileRegs = 65536;    // registers of an SM (sm_80, sm_90)
constexpr int kMaxThreadsPerSm = 2048;  // resident threads of an SM (sm_80, sm_90)
constexpr int kMaxCtasPerSm = 32;       // resident CTAs of an SM (sm_80, sm_90)
// A register-path CTA counts as nearly full from kRegFullThreads threads (choose_reg_config).
constexpr int kRegFullThreads = 448;
constexpr int64_t kMaxRowsPerLaunch = int64_t(1) << 26;  // × 16 CTAs stays below 2^31 blocks
// The register path's L2 prefetch distance, in waves of resident rows (ce/policy.h's table;
// 0 = none): each CTA asks the L2 for its slice of the row that far ahead. With
// shared-memory slots a wave holds up to twice the bytes, and an eighth measured faster than a
// quarter on every slot shape and slower on the registers-only ones (H100: 4096×151936 bf16
// 89.6 → 92.5 % of copy, float32 8192×128256 95.0 → 96.5; 4096×128256 bf16 93.6 → 92.8;
// dev/NOTES.md, "prefetch distance with slots"): 4-5 MB of rows ahead on an H100 either way.
constexpr float kDefaultPrefetchWaves = 0.25f;
constexpr float kSlotPrefetchWaves = 0.125f;
// The forward-only bulk-copy kernel of sm_90 (ce/bulk_kernel.cuh): one CTA per SM of a producer warp,
// kBulkConsumerWarps consumer warps and a finisher warp, a ring of kBulkStages chunks of
// kBulkChunkBytes in shared memory (64 KB × 3 measured best on an H100 among 16×12, 32×6, 40×5,
// 48×4 and 64×3: fewer, larger copies; dev/NOTES.md); rows shorter than kBulkMinRowBytes keep
// the register path. 8 consumer warps measured as fast as 12 or 16, two gradient stages of a
// whole row as fast as 3 or 4 smaller ones (dev/NOTES.md, H100, 2026-11-24).
constexpr int kBulkConsumerWarps = 8;
constexpr int kBulkChunkBytes = 64 << 10;
constexpr int kBulkStages = 3;
constexpr int64_t kBulkMinRowBytes = 16 << 10;
// With a gradient: two stages of a whole row each, rows of at most kBulkRowBytes of whole
// 16-byte vectors (V = 50257 bf16 is 100.5 KB).
constexpr int kBulkRowBytes = 104 << 10;
constexpr int kBulkGradStages = 2;
// Each stage has 128 bytes more than its copy: the copy lands at the source's offset modulo
// 128 (a bulk copy whose source and destination differ modulo 128 streamed 5-6 % slower on an
// H100: dev/tma_align.cu, dev/NOTES.md "bulk copies' alignment").
constexpr int kBulkStageSlack = 128;
constexpr int bulk_ring_bytes(bool grad) {
  return grad ? kBulkGradStages * (kBulkRowBytes + kBulkStageSlack)
              : kBulkStages * (kBulkChunkBytes + kBulkStageSlack);
}
constexpr int kBulkThreads = 32 * (2 + kBulkConsumerWarps);  // producer, consumers, finisher
static_assert(kRegVecsPerCta * 16 == 64 * 1024, "a register-path CTA holds 64 KB of its row");
static_assert(kRegMaxVocab < (int64_t(1) << 30), "register path indexes elements with int32");
static_assert(kRegThreads % 32 == 0 && kTwoPassThreads % 32 == 0 && kBackwardThreads % 32 == 0,
              "block sizes are whole warps");
static_assert(kRegThreads <= 1024 && kTwoPassThreads <= 1024 && kReduceThreads <= 1024,
              "at most 32 warps: one warp folds the per-warp partials");
static_assert(kMaxRowsPerLaunch * kMaxCluster <= int64_t(INT32_MAX), "grid.x limit");
static_assert(kMaxCluster <= 32, "one warp reads the cluster's partials");

// ------------------------------------------------------------ vectors of a row ----
// Vector v of a row has elements [j0, j0 + E); "full" = all of them inside [0, V). I is the
// index type (int in the register path, int64_t in the streaming kernels).
template <class I, int E> __host__ __device__ __forceinline__ bool is_full(I j0, int V) {
  return j0 >= 0 && j0 <= I(V) - E;
}

// The gradient row may take vector stores iff (gradient row address − lead·e_g) is a multiple
// of E·e_g: then gradient vector v starts exactly where logits vector v does, in elements.
__host__ __device__ __forceinline__ bool grad_vec_ok(uintptr_t grow, int lead, int E, int gb) {
  const uintptr_t vb = uintptr_t(E) * uintptr_t(gb);
  return ((grow - uintptr_t(lead) * uintptr_t(gb)) % vb) == 0;
}

// ---------------------------------------------------- the register path's split ----
// The register path's split of one row. Row elements are addressed through 16-byte vectors of
// E = 16/e elements: vector v holds elements [v·E − lead, v·E − lead + E), lead = (row address
// mod 16)/e, so vector 0 may start before the row and the last may end after it (only their
// in-row elements are touched). CTA `rank` of k holds vectors [rank·per, vend); thread
// tid of nt holds vectors v0 + i·nt (slots i < kRegVpt) that are < vend. Used by the kernel and
// by the host self-test (ce_rows_selftest), so both check the same arithmetic.
struct RegSlice {
  int lead;   // elements of the row's first vector that precede the row
  int nvec;   // vectors covering the row
  int per;    // vectors per CTA (the last CTAs may have fewer, or none)
  int v0;     // this thread's first vector
  int vend;   // past this CTA's last vector
  int j00;    // element index of vector v0's first element (< 0: the row's partial first vector)
  int jstep;  // element distance between slots, nt·E
};
__host__ __device__ __forceinline__ RegSlice reg_slice(uintptr_t row_addr, int elem_bytes, int V,
                                                       int k, int rank, int tid, int nt) {
  const int E = 16 / elem_bytes;
  RegSlice g;
  g.lead = static_cast<int>((row_addr & 15) / static_cast<uintptr_t>(elem_bytes));
  g.nvec = (g.lead + V + E - 1) / E;
  g.per = (g.nvec + k - 1) / k;
  g.v0 = rank * g.per + tid;
  g.vend = (rank + 1) * g.per < g.nvec ? (rank + 1) * g.per : g.nvec;
  g.j00 = g.v0 * E - g.lead;
  g.jstep = nt * E;
  return g;
}

// ================================================ host side (ce/policy.cpp) ====
// The register path's shape for rows of `vocab` elements of elem_bytes whose starts have at most
// lead_max elements before them in their 16-byte vector, split over a cluster of exactly k CTAs:
// the threads per CTA (a CTA's slice ⌈nvec/k⌉ in kRegVpt vectors per thread, whole warps) and,
// when the slice is longer than a CTA's registers hold (kRegVecsPerCta) and smem_max > 0, the
// vectors per thread in shared memory (≤ smem_max; the CTA then has kRegThreads threads).
// False when a slice does not fit a CTA. The checks at the end are the kernel's coverage
// invariant: every vector of every row has a (rank, thread, slot), i.e. threads·(kRegVpt +
// smem) ≥ ⌈nvec/k⌉ for the largest nvec of any row.
struct RegConfig {
  int k;
  int threads;
  int64_t per;  // vectors of the longest row each CTA holds, ⌈nvec/k⌉ (set by reg_config)
  int smem;     // slots kRegVpt … kRegVpt + smem − 1 of each thread in shared memory
};
// Dynamic shared memory of a register-path CTA of that shape (its slots).
inline int reg_smem_bytes(const RegConfig& c) { return c.smem * c.threads * 16; }
bool reg_config(int64_t vocab, int elem_bytes, int lead_max, int k, int smem_max, RegConfig* c);

// Threads of a streaming CTA: enough for kStreamUnroll vectors each on the longest row, ≤ cap.
int64_t stream_threads(int64_t vocab, int E, int cap);

// The launch of `grid` CTAs of `threads` threads in clusters of k CTAs along x, on stream s:
// *cfg points at *attr (its one attribute, the cluster shape), which must outlive the launch
// or query that uses cfg. The register-path launch and the occupancy query both use it.
inline void make_cluster_launch(unsigned grid, unsigned threads, int k, cudaStream_t s,
                                cudaLaunchConfig_t* cfg, cudaLaunchAttribute* attr) {
  *cfg = cudaLaunchConfig_t{};
  cfg->gridDim = dim3(grid);
  cfg->blockDim = dim3(threads);
  cfg->dynamicSmemBytes = 0;
  cfg->stream = s;
  *attr = cudaLaunchAttribute{};
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = static_cast<unsigned>(k);
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg->attrs = attr;
  cfg->numAttrs = 1;
}

// The launch of `grid` CTAs of `threads` on stream s, in clusters of k CTAs along x when k > 1,
// as a programmatic dependent of the grid before it when pdl (see ce/device.cuh, pdl_trigger):
// *cfg points at attrs (room for 2), which must outlive the launch.
inline void make_launch(unsigned grid, unsigned threads, int k, bool pdl, cudaStream_t s,
                        cudaLaunchConfig_t* cfg, cudaLaunchAttribute* attrs) {
  if (k > 1) {
    make_cluster_launch(grid, threads, k, s, cfg, attrs);
  } else {
    *cfg = cudaLaunchConfig_t{};
    cfg->gridDim = dim3(grid);
    cfg->blockDim = dim3(threads);
    cfg->stream = s;
    cfg->attrs = attrs;
    cfg->numAttrs = 0;
  }
  if (pdl) {
    cudaLaunchAttribute& a = attrs[cfg->numAttrs];
    a = cudaLaunchAttribute{};
    a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a.val.programmaticStreamSerializationAllowed = 1;
    cfg->numAttrs += 1;
  }
}

// Whether the current device takes programmatic dependent launches (sm_90+), asked once per
// device (ce/path.cu).
bool pdl_supported();

}  // namespace cuda
}  // namespace fce
