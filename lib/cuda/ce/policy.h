// ce/policy.h — which kernel computes the rows of a cross-entropy launch (launch_ce_rows), and
// in what shape: a pure function of the device's properties, the knobs, the call's shape and
// what the occupancy queries say about the kernels (RowsKernels). Host code, no CUDA call: the
// library asks it through ce/path.cu; the test CudaCePolicy asks it on a model of a device.
// Why each rule: docs/performance.md, "Choosing a row kernel"; the measurements: dev/NOTES.md.
#pragma once

#include <cstdint>

#include "cuda/ce/geometry.cuh"
#include "cuda/common/knobs.h"

namespace fce {
namespace cuda {

// What the policy needs of the device (cudaDeviceProp at run time; any values in a test).
struct DeviceProps {
  int major = 0;            // compute capability: 9+ has clusters and bulk copies
  int sms = 0;              // multiprocessors
  int regs_per_sm = 65536;  // 32-bit registers of an SM
  int max_threads_per_sm = 2048;
  int max_ctas_per_sm = 32;
  int64_t smem_per_sm = 0;      // bytes of shared memory of an SM
  int64_t l2_bytes = 0;         // bytes of L2 cache
  double dram_bytes_per_s = 0;  // memory clock × bus width × 2; 0 unknown
};

// ---------------------------------------------------------------- the table ----
// The row kernel of a launch: the first row whose condition holds (docs/performance.md).
//
//   condition (row = V · element bytes)                              kernel
//   a backward (a saved lse or row statistics)                       kBackward
//   the entropy or the lse / entropy gradient terms (row_terms)
//     with label smoothing or class probabilities (not fast_terms)   kTwoPass
//   sm_90+, forward only, row ≥ bulk_min_row                         kBulk
//   sm_90+, with a gradient, bulk_grad_min_row < row,
//     row + 16 ≤ kBulkRowBytes, row unaligned or > bulk_grad_aligned_row,
//     a register shape without shared-memory slots (16-bit rows: any
//     shape where DRAM ≥ bulk_grad_slots_dram)                     kBulk (with the gradient)
//   forward only, row ≥ stream_min_row                               kTwoPass
//   the register path's shape fits a cluster resident on the device  kRegisters
//   otherwise                                                        kTwoPass
//
// The register path's shape (choose_reg_config): the fewest CTAs of at most kRegThreads that
// hold the row; a power of two of registers only, or for 16-bit rows a size whose CTAs of at
// least kRegFullThreads keep held_gain more bytes resident per SM; with shared-memory slots
// (sm_90+) fewer CTAs, kept only where the registers-only shape holds less than
// resident_enough of the register file's half per SM and the launch has smem_min_waves waves,
// and its clusters fill slot_share of the CTA slots (else up to 3 more CTAs). The L2 prefetch
// distance with a gradient: prefetch_waves of resident rows, slot_prefetch_waves with slots.
struct RowsTable {
  int64_t bulk_min_row;           // bytes
  int64_t bulk_grad_min_row;      // bytes: a register-path CTA holds less (kRegVecsPerCta)
  int64_t bulk_grad_aligned_row;  // bytes
  // bytes/s: from this DRAM rate (or an unknown one) 16-bit rows take the bulk kernel with the
  // gradient over a register shape with slots. The H200 (4.8 TB/s), where the slots' loops run
  // instruction bound: 16384×50257 bf16 1.097 ms with slots (70 % of copy), 0.912 in bulk (84 %).
  // The H100 (3.35 TB/s) measured the slots faster (89.7 → 92.5 %, before the fast slots).
  double bulk_grad_slots_dram;
  int64_t stream_min_row;  // bytes
  double resident_enough;  // of half the register file
  int64_t smem_min_waves;
  double slot_share;
  int held_gain_pct;  // percent more row bytes resident per SM
  float prefetch_waves;
  float slot_prefetch_waves;
};
// The H100 / H200 measurements (sm_90; sm_80 takes the rows that need no cluster or bulk copy).
// clang-format off
constexpr RowsTable kRowsTable = {
    /* bulk_min_row          */ 16 << 10,
    /* bulk_grad_min_row     */ int64_t{kRegVecsPerCta} * 16,  // 64 KiB
    /* bulk_grad_aligned_row */ 88 << 10,
    /* bulk_grad_slots_dram  */ 4.0e12,
    /* stream_min_row        */ 128 << 10,
    /* resident_enough       */ 115.0 / 128.0,  // 115 KiB of the 128 KiB of sm_80 / sm_90
    /* smem_min_waves        */ 16,
    /* slot_share            */ 0.88,
    /* held_gain_pct         */ 5,
    /* prefetch_waves        */ kDefaultPrefetchWaves,  // 0.25
    /* slot_prefetch_waves   */ kSlotPrefetchWaves,     // 0.125
};
// clang-format on

// ------------------------------------------------------------ the inputs ----
// The rows a launch under options->batch_invariant shows the policy (RowsShape::rows): more
// than any launch has, so the choice is the one for many rows, made from V, dtype and device.
constexpr int64_t kInvariantPolicyRows = int64_t{1} << 40;

// The call's rows, as the policy sees them.
struct RowsShape {
  bool backward;      // lse_in or stats_in given
  bool with_grad;     // a gradient is written
  int64_t rows;       // rows of the call
  int64_t vocab;      // elements of a row
  int elem_bytes;     // of the logits
  bool aligned_rows;  // every row starts 16-byte aligned
  bool rescale;       // fce_backward_rescale: the register path runs persistent
  // the entropy or the lse / entropy gradient terms (docs/semantics.md rule 18), or class
  // probabilities (rule 19): the register and bulk kernels have rule 18's terms unless label
  // smoothing (fast_terms false, or class probabilities: then the rows take kBackward or
  // kTwoPass)
  bool row_terms = false;
  bool fast_terms = false;
};

// The kernels a shape can run on (the register kernel, persistent or not, with shared-memory
// slots or not; the bulk kernel), and what the occupancy queries say of them on the device.
enum class RowsKernel { kRegs, kRegsLoop, kSlots, kSlotsLoop };
struct RowsKernels {
  virtual ~RowsKernels() = default;
  virtual int regs(RowsKernel k) const = 0;  // registers per thread; 0 unknown
  // The kernel takes kRegSmemBytesMax of dynamic shared memory (sets it up when asked).
  virtual bool slots_ready(RowsKernel k) const = 0;
  // Clusters of c.k > 1 CTAs of kRegThreads with the most shared memory (smem) can be resident.
  virtual bool cluster_fits(RowsKernel k, int cluster, bool smem) const = 0;
  // Rows (clusters of c.k CTAs of that shape) resident at once; 0 unknown.
  virtual int64_t wave_rows(RowsKernel k, const RegConfig& c) const = 0;
  // CTAs of a bulk-kernel grid (one per SM), 0 when it cannot run here (sets it up when asked).
  virtual int bulk_ctas(bool grad) const = 0;
};

// Which kernel runs the rows of one launch_ce_rows call.
enum class RowsPath {
  kBackward,   // ce_rows_stream_kernel<…, BWD = true>: lse_in / stats_in given
  kRegisters,  // ce_rows_regs_kernel in clusters of RowsChoice::rc.k CTAs of rc.threads
  kTwoPass,    // ce_rows_stream_kernel<…, BWD = false>
  kBulk,       // ce_rows_bulk_kernel (sm_90), RowsChoice::wave_rows CTAs at most
};
struct RowsChoice {
  RowsPath path;
  RegConfig rc;           // kRegisters: the cluster size and the threads per CTA
  bool persistent;        // kRegisters: the LOOP kernel over at most wave_rows clusters
  int64_t wave_rows;      // kRegisters: rows (clusters) resident at once; kBulk: the CTAs
  int64_t prefetch_rows;  // kRegisters: KParams::prefetch_rows (0 = no prefetch)
  bool xmbar;             // kRegisters: KParams::xmbar_ok (always: the kernel drops it where
                          // it must, with argmax or rescale)
};

// The policy: the table above on this device, with these knobs.
RowsChoice choose_rows(const DeviceProps& dev, const Knobs& knobs, const RowsShape& q,
                       const RowsKernels& kernels);

// The register path's cluster size for rows of `vocab` elements of elem_bytes with at most
// lead_max elements before them in their 16-byte vector: the rule of the table (at most max_k
// CTAs; smem_max > 0: with up to that many shared-memory slots per thread), or force_k where
// the slices fit it. CTAs per SM from `regs` registers per thread and the device's limits.
// False when no size up to max_k holds the row.
bool choose_reg_config(const DeviceProps& dev, int64_t vocab, int elem_bytes, int lead_max,
                       int max_k, int force_k, int regs, int smem_max, RegConfig* c);

// ------------------------------------------------------------- at run time ----
// One launch_ce_rows call: its shape and the kernels it may run (for the occupancy queries).
constexpr int kRowTermsSlots = 40;  // the query caches' cells of the ROWT register kernels
struct RowsQuery {
  RowsShape shape;
  int slot;  // (dtype pair) · 4 + mode (+ kRowTermsSlots: ROWT): the query caches' cell
  const void* regs_kernel;            // ce_rows_regs_kernel<TZ, TG, mode, false, false>
  const void* regs_loop_kernel;       // … <…, true, false>: persistent
  const void* regs_smem_kernel;       // … <…, false, true>: with shared-memory slots
  const void* regs_smem_loop_kernel;  // … <…, true, true>
  const void* bulk_kernel;            // ce_rows_bulk_kernel<TZ, TG, mode, with_grad>, or nullptr
};
// choose_rows on the current device with the process's knobs (ce/path.cu): FCE_ERROR_CUDA
// naming fn when there is no usable device.
fce_status choose_rows_path(const char* fn, const RowsQuery& q, RowsChoice* out);

}  // namespace cuda
}  // namespace fce
