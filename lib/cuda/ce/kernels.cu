// ce/kernels.cu — cross-entropy over given logits, row by row (docs/semantics.md steps 1-5):
// each row's loss, lse and λ·lse², and the gradient, in ONE read of the logits and ONE write of
// the gradient, by the kernel that launch_ce_rows takes from the table of ce/policy.h:
//   * the register path (ce/regs_kernel.cuh): a row split over a cluster of 1-16 CTAs that hold
//     it in registers (and shared-memory slots on sm_90): the gradient needs no second read;
//   * the bulk kernel (ce/bulk_kernel.cuh, sm_90): rows streamed by bulk copies through a
//     shared-memory ring, one persistent CTA per SM;
//   * the two-pass and backward kernels (ce/stream_kernel.cuh): any V; a backward from the
//     saved lse in one streaming pass.
// Why it is fast: the op is memory bound (2·N·V·e bytes for ~20 flops per element), so every
// logit is touched once and the instructions per element are budgeted (docs/performance.md).
// Around it: ce/reduce.cu (the denominators pre-pass and the finalize), ce/device.cuh and
// ce/memory.cuh (a row's math, reads and writes), ce/geometry.cuh (block sizes, the split).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/ce/bulk_kernel.cuh"
#include "cuda/ce/device.cuh"
#include "cuda/ce/geometry.cuh"
#include "cuda/ce/policy.h"
#include "cuda/ce/regs_kernel.cuh"
#include "cuda/ce/rows.cuh"
#include "cuda/ce/stream_kernel.cuh"
#include "cuda/common/launch_check.cuh"

// Rules every row kernel keeps by construction:
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
//     shared with a host self-test, ce_rows_selftest() (ce/geometry_selftest.cpp; the ctest
//     target CudaCeRowsSelftest runs it without a GPU): every element owned exactly once, every
//     16-byte access aligned and inside its row.

namespace fce {
namespace cuda {
namespace {

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

template <class TZ, class TG, int MODE, bool LOOP, bool ROWT = false>
fce_status launch_forward_regs(const char* fn, const KParams& q, const RegConfig& rc,
                               int64_t grid_rows, cudaStream_t s) {
  if (rc.smem > 0)
    return launch_rows_kernel(fn, "ce_rows_regs_kernel with shared-memory slots",
                              ce_rows_regs_kernel<TZ, TG, MODE, LOOP, true, ROWT>,
                              grid_rows * rc.k, rc.threads, rc.k, q, s, reg_smem_bytes(rc));
  return launch_rows_kernel(fn, "ce_rows_regs_kernel",
                            ce_rows_regs_kernel<TZ, TG, MODE, LOOP, false, ROWT>,
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

// Rule 18's terms on the register path (ROWT): the unit, plain and softcap modes; label
// smoothing keeps them on the stream kernel (ce/policy.h).
template <class TZ, class TG>
fce_status launch_regs_terms(const char* fn, int mode, const KParams& q, const RegConfig& rc,
                             int64_t grid_rows, cudaStream_t s) {
  return mode == kUnit  ? launch_forward_regs<TZ, TG, kUnit, false, true>(fn, q, rc, grid_rows, s)
       : mode == kCap   ? launch_forward_regs<TZ, TG, kCap, false, true>(fn, q, rc, grid_rows, s)
                        : launch_forward_regs<TZ, TG, kPlain, false, true>(fn, q, rc, grid_rows, s);
}
template <class TZ, class TG, bool SMEM> const void* regs_terms_kernel(int mode) {
  return mode == kUnit ? kernel_address(ce_rows_regs_kernel<TZ, TG, kUnit, false, SMEM, true>)
       : mode == kCap  ? kernel_address(ce_rows_regs_kernel<TZ, TG, kCap, false, SMEM, true>)
                       : kernel_address(ce_rows_regs_kernel<TZ, TG, kPlain, false, SMEM, true>);
}

template <class TZ, class TG, bool LOOP, bool SMEM> const void* regs_kernel(int mode) {
  return mode == kUnit  ? kernel_address(ce_rows_regs_kernel<TZ, TG, kUnit, LOOP, SMEM>)
       : mode == kPlain ? kernel_address(ce_rows_regs_kernel<TZ, TG, kPlain, LOOP, SMEM>)
       : mode == kCap   ? kernel_address(ce_rows_regs_kernel<TZ, TG, kCap, LOOP, SMEM>)
                        : kernel_address(ce_rows_regs_kernel<TZ, TG, kGeneral, LOOP, SMEM>);
}

// The bulk kernel of a mode (GRAD: with the gradient; without one TG is TZ), with rule 18's
// terms or not (rowt: the unit, plain and softcap modes only, as the register path's).
template <class TZ, class TG, bool GRAD> auto bulk_kernel(int mode, bool rowt) {
  if (rowt)
    return mode == kUnit  ? ce_rows_bulk_kernel<TZ, TG, kUnit, GRAD, true>
         : mode == kCap   ? ce_rows_bulk_kernel<TZ, TG, kCap, GRAD, true>
                          : ce_rows_bulk_kernel<TZ, TG, kPlain, GRAD, true>;
  return mode == kUnit  ? ce_rows_bulk_kernel<TZ, TG, kUnit, GRAD>
       : mode == kPlain ? ce_rows_bulk_kernel<TZ, TG, kPlain, GRAD>
       : mode == kCap   ? ce_rows_bulk_kernel<TZ, TG, kCap, GRAD>
                        : ce_rows_bulk_kernel<TZ, TG, kGeneral, GRAD>;
}

// The stream kernel of a launch: two-pass forward or backward (BWD), with rule 18's terms or
// not (ROWT), for class probabilities (soft: rule 19, with rule 18's terms), in its plain or
// general mode.
template <class TZ, class TG, bool BWD>
auto stream_kernel(int mode, bool rowt, bool soft) {
  const bool plain = mode == kPlain || mode == kUnit;
  if (soft)
    return plain ? ce_rows_stream_kernel<TZ, TG, kPlain, BWD, true, true>
                 : ce_rows_stream_kernel<TZ, TG, kGeneral, BWD, true, true>;
  return rowt ? (plain ? ce_rows_stream_kernel<TZ, TG, kPlain, BWD, true>
                       : ce_rows_stream_kernel<TZ, TG, kGeneral, BWD, true>)
              : (plain ? ce_rows_stream_kernel<TZ, TG, kPlain, BWD>
                       : ce_rows_stream_kernel<TZ, TG, kGeneral, BWD>);
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
  // batch_invariant (docs/semantics.md rule 21): the shape the policy gives a launch of many
  // rows, whatever this one has, so that a row's kernel and split never follow the row count
  rq.shape.rows = a.opt.batch_invariant ? kInvariantPolicyRows : a.row_count;
  rq.shape.vocab = a.vocab;
  rq.shape.elem_bytes = Ty<TZ>::kBytes;
  rq.shape.aligned_rows =
      (reinterpret_cast<uintptr_t>(a.logits) & 15) == 0 && (p.z_row_bytes & 15) == 0;
  rq.shape.rescale = p.rescale != 0;
  // rule 18's entropy and gradient terms: the ROWT register and bulk kernels without label
  // smoothing, else the stream kernels (ce/policy.h); never persistent (fce_backward_rescale
  // has none)
  const bool rowt = p.entropy_out || p.grad_lse || p.grad_entropy || (p.stats_out && a.stats_mu);
  const bool soft = a.opt.soft_targets;  // rule 19: the stream kernels only
  const bool fast_terms = rowt && mode != kGeneral && !soft;
  rq.shape.row_terms = rowt || soft;
  rq.shape.fast_terms = fast_terms;
  rq.slot = (fast_terms ? kRowTermsSlots : 0) + pair * 4 + mode;
  rq.regs_kernel = fast_terms ? regs_terms_kernel<TZ, TG, false>(mode)
                              : regs_kernel<TZ, TG, false, false>(mode);
  rq.regs_loop_kernel = regs_kernel<TZ, TG, true, false>(mode);
  rq.regs_smem_kernel = fast_terms ? regs_terms_kernel<TZ, TG, true>(mode)
                                   : regs_kernel<TZ, TG, false, true>(mode);
  rq.regs_smem_loop_kernel = regs_kernel<TZ, TG, true, true>(mode);
  rq.bulk_kernel = a.grad ? kernel_address(bulk_kernel<TZ, TG, true>(mode, fast_terms))
                          : kernel_address(bulk_kernel<TZ, TZ, false>(mode, fast_terms));
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
                              stream_kernel<TZ, TG, true>(mode, rowt, soft), n,
                              static_cast<int>(threads), 1, q, s);
    } else if (choice.path == RowsPath::kBulk) {
      q.rows_in_launch = n;
      const int64_t grid = n < choice.wave_rows ? n : choice.wave_rows;
      st = a.grad ? launch_rows_kernel(a.fn, "ce_rows_bulk_kernel, with the gradient",
                                       bulk_kernel<TZ, TG, true>(mode, fast_terms), grid,
                                       kBulkThreads, 1, q, s, bulk_ring_bytes(true))
                  : launch_rows_kernel(a.fn, "ce_rows_bulk_kernel",
                                       bulk_kernel<TZ, TZ, false>(mode, fast_terms), grid,
                                       kBulkThreads, 1, q, s, bulk_ring_bytes(false));
    } else if (choice.path == RowsPath::kRegisters) {
      q.cluster = rc.k;
      q.reg_smem = rc.smem;
      q.rows_in_launch = n;
      q.prefetch_rows = choice.prefetch_rows;
      q.xmbar_ok = choice.xmbar ? 1 : 0;
      if (fast_terms) {
        st = launch_regs_terms<TZ, TG>(a.fn, mode, q, rc, n, s);
      } else if (choice.persistent) {
        const int64_t grid_rows = n < choice.wave_rows ? n : choice.wave_rows;
        st = launch_regs_mode<TZ, TG, true>(a.fn, mode, q, rc, grid_rows, s);
      } else {
        st = launch_regs_mode<TZ, TG, false>(a.fn, mode, q, rc, n, s);
      }
    } else {
      const unsigned threads = static_cast<unsigned>(stream_threads(a.vocab, E, kTwoPassThreads));
      st = launch_rows_kernel(a.fn, "ce_rows_stream_kernel, two-pass forward",
                              stream_kernel<TZ, TG, false>(mode, rowt, soft), n,
                              static_cast<int>(threads), 1, q, s);
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
  // (a backward from stats_in takes both: the vocabulary-parallel statistics carry μ − m)
  if ((a.grad_lse || a.grad_entropy) &&
      (a.rescale || (backward && !a.stats_in && a.grad_entropy)))
    return fail(FCE_ERROR_INTERNAL,
                "%s: launch_ce_rows: grad_lse / grad_entropy with a rescale, or grad_entropy with "
                "a backward from the saved lse",
                fn);
  const int64_t vocab_total = a.vocab_total > 0 ? a.vocab_total : a.vocab;
  if (a.col_begin < 0 || a.col_begin + a.vocab > vocab_total || vocab_total > INT32_MAX ||
      (vocab_total != a.vocab && !a.stats_in))
    return fail(FCE_ERROR_INTERNAL, "%s: launch_ce_rows: bad column slice (%lld+%lld of %lld)",
                fn, static_cast<long long>(a.col_begin), static_cast<long long>(a.vocab),
                static_cast<long long>(vocab_total));
  if (a.row_count == 0) return FCE_SUCCESS;
  if (a.opt.soft_targets && (a.stats_out || (a.stats_in && a.q_row_stride <= 0)))
    return fail(FCE_ERROR_INTERNAL,
                "%s: launch_ce_rows: class-probability targets with saved row statistics", fn);
  KParams p = make_params(a.opt, vocab_total);  // ε/V and Ω of the whole vocabulary
  // class probabilities (rule 19): q' carries ε itself; no smoothing sum over the logits
  if (a.opt.soft_targets) p.smooth = 0;
  p.vocab = static_cast<int>(a.vocab);            // the row length of these buffers
  p.col_begin = a.col_begin;
  p.q_ld = a.q_row_stride > 0 ? a.q_row_stride : vocab_total;
  p.q_col = a.q_row_stride > 0 ? a.q_col : a.col_begin;
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
  p.entropy_out = outputs ? a.entropy_out : nullptr;
  p.grad_lse = a.grad ? a.grad_lse : nullptr;
  p.grad_entropy = a.grad ? a.grad_entropy : nullptr;
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
