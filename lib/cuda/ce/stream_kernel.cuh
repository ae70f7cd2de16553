// ce/stream_kernel.cuh — ce_rows_stream_kernel, one CTA per row, any V. BWD = false (the
// two-pass forward, for rows no cluster holds): one 1024-thread CTA per row and per SM, so only
// #SMs rows (≈ 33 MB at 250 KB) are in flight and the second read mostly hits the L2; pass 1 an
// online (max, Σexp) with L2-keeping loads, pass 2 rereads the row backwards (the last-read part
// is the likeliest still in L2) and writes the gradient. BWD = true (fce_backward): the saved lse
// makes every element independent, one streaming pass; ignored and invalid rows are written
// without being read. Included by ce/kernels.cu alone (its anonymous namespace).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/ce/device.cuh"
#include "cuda/ce/geometry.cuh"
#include "cuda/ce/soft.cuh"

namespace fce {
namespace cuda {
namespace {

// ====================================================== streaming kernels ====
// Pass 1 of a streaming CTA: the row's (max, Σexp[, Σω·(a − c)]) with L2-keeping loads; the
// CTA's total is in s_final on return (after a barrier). ENT: *t_row is the row's
// t = Σ exp(a − m)(a − m) against the row's maximum m (docs/semantics.md rule 18), in every
// thread.
// SOFT (docs/semantics.md rule 19): *soft is the row's (Q, U) against its maximum, in every
// thread, from the class probabilities of global row `row`.
template <class TZ, int MODE, bool ENT = false, bool SOFT = false>
__device__ __forceinline__ Partial stream_reduce(const KParams& p, const char* zrow, int lead,
                                                 int nvec, float c, Partial* s_warp,
                                                 Partial* s_final, bool track, Partial& mine,
                                                 int& am, float* t_row = nullptr, int64_t row = 0,
                                                 SoftSums* soft = nullptr) {
  constexpr int E = vec_elems<TZ>();
  constexpr int U = MODE == kGeneral ? kStreamUnroll / 2 : kStreamUnroll;
  constexpr bool SW = MODE == kGeneral;
  const int V = p.vocab, tid = threadIdx.x, nt = blockDim.x, step = nt * U;
  Partial acc = partial_identity();
  float tacc = 0.f;         // ENT: this thread's t against acc.m
  SoftSums sacc{0.0, 0.0};  // SOFT: this thread's (Q, U) against acc.m
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
      if (v < nvec) {
        const float m_old = acc.m;
        online_vector<TZ, MODE, int64_t, ENT>(buf[u], j0, is_full<int64_t, E>(j0, V), p, c, acc,
                                              track, am, &tacc);
        if constexpr (SOFT)
          soft_vector<TZ, MODE>(buf[u], j0, is_full<int64_t, E>(j0, V), p, row, m_old, acc.m, sacc);
      }
    }
  }
  mine = acc;
  const Partial blk = block_reduce_all<SW>(acc, s_warp);
  if (threadIdx.x == 0) *s_final = blk;
  __syncthreads();
  if constexpr (ENT) *t_row = block_sum_t(acc, blk.m, tacc, s_warp);
  if constexpr (SOFT)
    *soft = soft_block_sum(sacc, acc.m, blk.m, reinterpret_cast<double2*>(s_warp));
  return *s_final;
}

// One CTA per row. BWD = false: the two-pass forward (any V). BWD = true: the backward pass
// from the saved lse (one read and one write; ignored and invalid rows are only written) or from
// the saved row statistics of a column slice (stats_in). A row whose saved |lse| ≥ 1024 is
// reduced again first (pass 1): there the float lse no longer holds log s (docs/semantics.md rule 12).
// ROWT (docs/semantics.md rule 18): the forward also sums t = Σ exp(a − m)(a − m) in pass 1 and
// writes the entropy H = log s − t/s (p.entropy_out); the gradient of both directions adds the
// terms of p.grad_lse and (forward) p.grad_entropy, to every row but the invalid ones (an ignored
// row whose two values are 0 keeps its zeros).
// SOFT (docs/semantics.md rule 19, with ROWT): the targets are class probabilities, read in both
// passes: pass 1 also sums (Q, U) (the backward: Q alone), every row is scored, and the gradient
// is ce/soft.cuh's.
constexpr float kRescueLse = 1024.f;
template <class TZ, class TG, int MODE, bool BWD, bool ROWT = false, bool SOFT = false>
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
    if (p.rescale && rescale_prologue<TG, SOFT>(p, row, p.grad + lrow * p.g_row_bytes, 0, V))
      return;
  }
  const bool want_argmax = !BWD && (p.argmax_out != nullptr || p.row_correct != nullptr);
  if constexpr (SOFT) {
    if (tid == 0) s_info = soft_row_info(p, row);
  } else {
    if (tid == 0)
      s_info = load_row_info<TZ, MODE>(p, row, zrow, !BWD || (p.token_scaling && !p.stats_in));
  }
  const float c = (BWD || SOFT) ? 0.f : smoothing_reference<TZ, MODE>(p, zrow);
  SoftSums soft{0.0, 0.0};  // SOFT: the row's (Q, U)
  RowVals vals;
  Partial fin = partial_identity(), mine;
  int am = -1;
  float mum = 0.f;  // ROWT: μ − m = t/s
  if constexpr (!BWD) {
    float t_row = 0.f;
    fin = stream_reduce<TZ, MODE, ROWT, SOFT>(p, zrow, lead, nvec, c, s_warp, &s_final, want_argmax,
                                              mine, am, &t_row, row, &soft);
    vals = row_vals(p, s_info, fin);
    if constexpr (ROWT) {
      mum = __fdiv_rn(t_row, fin.s);
      // H = log s − t/s (both terms ≥ 0: no cancellation); NaN without a finite maximum
      if (tid == 0 && p.entropy_out)
        p.entropy_out[row] = isfinite(fin.m) ? __fsub_rn(vals.ls, mum) : qnan();
    }
  } else {
    __syncthreads();  // s_info
    // (the vocabulary-parallel statistics of class probabilities carry the row's Q in t)
    if constexpr (SOFT)
      if (!p.stats_in) soft.Q = soft_mass(p, row, reinterpret_cast<double2*>(s_warp));
    if (p.stats_in) {
      const CeRowStats st = p.stats_in[row];
      vals = RowVals{st.m, st.ls, __fadd_rn(st.m, st.ls), st.t};
      if constexpr (SOFT) soft.Q = static_cast<double>(st.t);
      // the vocabulary-parallel statistics of options->vp_entropy carry μ − m in pad
      if constexpr (ROWT) mum = p.grad_entropy ? st.pad : 0.f;
    } else {
      const float lse = p.lse_in[row];
      const bool flows = s_info.kind == kValid || (ROWT && s_info.kind == kIgnored);
      if (flows && isfinite(lse) && fabsf(lse) >= kRescueLse) {
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
    if constexpr (SOFT) {
      if (tid == 0) soft_row_outputs(p, row, vals, soft);
    } else {
      if (tid == 0) write_row_outputs<MODE>(p, row, ri, fin, vals, c, mum);
    }
  }
  bool grad_pass = p.grad && ri.kind == kValid;
  if constexpr (ROWT)  // an ignored row's lse and entropy terms (rule 18)
    grad_pass = grad_pass || (p.grad && ri.kind == kIgnored &&
                              (row_grad_lse(p, row) != 0.f || row_grad_entropy(p, row) != 0.f));
  char* grow = p.grad ? p.grad + lrow * p.g_row_bytes : nullptr;
  if (grad_pass) {
    const bool vec_ok = grad_vec_ok<TZ, TG>(grow, lead);
    RowGrad rg = make_row_grad<MODE>(p, ri, vals);
    RowTerms rt{};
    if constexpr (ROWT && !SOFT)
      rt = row_terms(p, ri, mum, row_grad_lse(p, row), row_grad_entropy(p, row), rg);
    SoftGrad sg{};
    if constexpr (SOFT) sg = soft_grad(p, row, ri, vals, soft.Q, mum);
    const int64_t yl = ri.kind == kValid ? local_target<int64_t, E>(p, ri.y) : int64_t(-2 * E);
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
        if (v >= nvec) continue;
        if constexpr (SOFT)
          soft_grad_vector<TZ, TG, MODE>(buf[u], j0, is_full<int64_t, E>(j0, V), vec_ok, p, row, sg,
                                         grow);
        else if constexpr (ROWT)
          grad_vector_terms<TZ, TG, MODE>(buf[u], j0, is_full<int64_t, E>(j0, V), vec_ok, p, rg, rt,
                                          yl, grow);
        else
          grad_vector<TZ, TG, MODE>(buf[u], j0, is_full<int64_t, E>(j0, V), vec_ok, p, rg, yl,
                                    grow);
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

}  // namespace
}  // namespace cuda
}  // namespace fce
