// linear/linear_ce.cu — fce_linear_ce on CUDA: z = h·Wᵀ + b, cross-entropy, and ∂h, ∂W, ∂b,
// without ever holding all of z (docs/semantics.md "fce_linear_ce"). Per token chunk of Nc rows:
//   1. Z_c = h_c·Wᵀ (+ b)      cuBLASLt, float32 accumulation, stored in the dtype (one rounding)
//   2. CE pass                 launch_ce_rows on Z_c: row losses, lse, ∂Z_c in place over Z_c
//   3. ∂h_c = ∂Z_c·W           one GEMM over K = V, straight into grad_hidden
//   4. ∂W (+)= ∂Z_cᵀ·h_c       as the plan says (below)
//   5. ∂b (+)= colsum(∂Z_c)    fixed-order column sums in float32
// then the fixed-order loss reduction (launch_ce_finalize). Why it is fast: the 6·N·D·V FLOPs of
// a training step run in cuBLASLt's GEMMs, and the CE pass between them moves ~4 bytes per
// logit (4-8 % of the GEMM time at D = 2304-4096); the caller's workspace picks the plan
// (linear/plan.cu), so one workspace size gives the same bits every run. No allocation, no
// synchronisation, one stream: graph-capturable once the device's cuBLASLt handle exists.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/ce/rows.cuh"
#include "cuda/common/gemm.cuh"
#include "cuda/linear/chunk_args.cuh"
#include "cuda/linear/kernels.cuh"
#include "cuda/linear/plan.cuh"
#include "internal.h"

// Precision of f16/bf16 (version 2; version 1 kept a float32 Z_c): the logits are exactly torch
// eager's — F.linear in bf16 returns z rounded once to bf16 from a float32 accumulation, and
// so does step 1 (bias included, the same cuBLASLt epilogue). Everything after is float32 math
// on those 16-bit logits (torch eager's cross_entropy on bf16 logits even rounds its
// log-softmax to bf16; we do not), and ∂Z_c is rounded once to the dtype, as before. Each logit
// carries a relative error ≤ u (2^-8 bf16, 2^-11 f16), so p and the loss move by ≤ 2u·max|z|
// relative: tests/test_linear_ce.cpp's bound u·(4 + 2·max|z|), docs/semantics.md's "at least as close as
// torch eager in the dtype" (f16 logits beyond ±65504 become ±inf, as torch's do). FCE_FLOAT32
// keeps float32 logits (docs/semantics.md's 1e-5).
// Bytes: a chunk row is V·e of scratch (e = 2 for f16/bf16: 250 KB at V = 128256, was V·6 with
// a float32 Z_c + a separate 16-bit ∂Z_c), and the CE pass moves 2e = 4 bytes per logit (was 6).
//
// Plans, by workspace size (choose_plan in linear/plan.cu; the query returns the smallest and the
// full-speed one).
// Token-chunk plans (6·N·D·V) take chunks of Nc rows, as many as fit the workspace (multiples
// of 128, balanced); a chunk row is V·e bytes (250 KB at V = 128256 bf16).
//   kChunked      loss only, or a float32 ∂W (grad_weight_fp32 or dtype f32: the caller's
//                 float32 grad_weight is the accumulator, beta = 1 after the first chunk), or
//                 no grad_weight. Full speed: Nc ≤ 4096 within kChunkBudget = 1 GiB.
//   kChunked16    f16/bf16 ∂W accumulated in grad_weight itself (beta = 1 after the first
//                 chunk): one rounding per chunk, so at most max_chunks16 chunks (one chunk when
//                 all rows fit: ∂W is then one GEMM over all N rows, one rounding). Full speed:
//                 chunks as large as 1 GiB holds (fewer roundings), at most max_chunks16 of them.
//                 No [V, D] float32 buffer anywhere: at 8192×4096×128256 bf16 two chunks of
//                 4096 rows in 1.0 GiB.
//   kVocabSliced  f16/bf16 ∂W in any workspace too small for kChunked16 (down to a few MiB), 8·N·D·V: a first
//                 pass over token chunks for the loss and lse (2·N·D·V), then per slice of Vc
//                 columns for all N rows: Z_s = h·W_sᵀ (+ b_s), ∂Z_s from the saved lse in place
//                 (the backward kernel on a column slice), ∂W_s = ∂Z_sᵀ·h in ONE GEMM over all N
//                 rows (one rounding), ∂h += ∂Z_s·W_s into a float32 [N, D] accumulator (128 MiB
//                 at N = 8192, D = 4096; extra to the scratch), ∂b_s by column sums. The logits
//                 scratch holds max(Nc·V, N·Vc) elements.
//   batch_invariant (docs/semantics.md rule 21): token chunks of invariant_rows rows, a
//                 function of V and dtype (never of N or the workspace); steps 1 and 3 always
//                 multiply all of them (hidden rows copied, the last chunk padded with zero
//                 rows; ∂h through a chunk buffer) with an algorithm that does not split K, so
//                 each row's logits and ∂h come from the same GEMM whatever the batch; no
//                 vocab-sliced plan (a 16-bit grad_weight over more than max_chunks16 chunks
//                 is refused).
// Determinism: the plan (mode, Nc, cuBLASLt workspace) is a function of the sizes, the options,
// which gradients are asked for, and workspace_bytes only, and every step has a fixed order
// (cuBLASLt picks one algorithm per shape and alignment; no atomics), so for a given workspace
// size the results are bitwise identical run to run. Different workspace sizes change only the
// float32 rounding order (of the ∂W/∂b chunk sums, and cuBLASLt's algorithm for another Nc).
//
// No allocation, no synchronisation, one stream: everything is carved from the caller's
// workspace (256-byte aligned) and enqueued on p.stream, so the call is graph-capturable once
// the device's cuBLASLt handle exists (created on the first call on that device).
//
// Shared with the vocabulary-parallel linear calls (vocab_parallel/linear.cu) through linear/plan.cuh: the
// plan arithmetic (namespace linear, in linear/plan.cu: host code only), logits_gemm (step 1 / a)
// and slice_pass (the vocab-sliced plan's gradient pass, steps a-e below), which this file runs
// as it always did; they take the public function's name (fn) for their messages. The ABI layer
// has checked every argument, the device pointers included (cuda_check_pointers).

namespace fce {
namespace cuda {
namespace linear {

// The plan arithmetic (sizes_of, choose_plan, min_workspace, ...) is in linear/plan.cu.

fce_status logits_gemm(const char* fn, int dtype, int64_t M, int64_t N, int64_t K, const void* A,
                       int64_t lda, const void* W, const void* bias, void* Z, int64_t ldz,
                       void* lt_ws, size_t lt_bytes, cudaStream_t s, bool whole_k) {
  RowMajorGemm g{};
  g.fn = fn;
  g.name = "logits (hidden · weightᵀ + bias)";
  g.M = M; g.N = N; g.K = K;
  g.A = A; g.lda = lda; g.trans_a = false;
  g.B = W; g.ldb = K; g.trans_b = true;
  g.ab_dtype = dtype;
  g.C = Z; g.ldc = ldz; g.c_dtype = dtype;
  g.alpha = 1.f; g.beta = 0.f;
  g.bias = bias;
  g.workspace = lt_ws; g.workspace_bytes = lt_bytes;
  g.whole_k = whole_k;
  bool bias_applied = false;
  FCE_TRY(gemm(g, s, &bias_applied));
  // No algorithm fuses the bias for this shape: add it in a second pass (for f16/bf16 Z that
  // is a second rounding, the one place the 16-bit logits are not torch's bit for bit).
  if (bias && !bias_applied) FCE_TRY(launch_add_bias_rows(fn, Z, dtype, M, N, ldz, bias, s));
  return FCE_SUCCESS;
}

namespace {

// options->batch_invariant (docs/semantics.md rule 21): `rows` rows of src (src_ld elements
// apart) into dst, dense, then zero rows up to fixed_rows: the GEMMs always see fixed_rows.
fce_status copy_fixed_rows(const char* fn, void* dst, const void* src, int64_t src_ld, int64_t rows,
                           int64_t fixed_rows, int64_t cols, size_t e, cudaStream_t s) {
  const size_t row = static_cast<size_t>(cols) * e;
  cudaError_t err = cudaMemcpy2DAsync(dst, row, src, static_cast<size_t>(src_ld) * e, row,
                                      static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, s);
  if (err == cudaSuccess && rows < fixed_rows)
    err = cudaMemsetAsync(static_cast<char*>(dst) + static_cast<size_t>(rows) * row, 0,
                          static_cast<size_t>(fixed_rows - rows) * row, s);
  if (err != cudaSuccess)
    return fail(FCE_ERROR_CUDA, "%s: copying a chunk of hidden rows failed: %s", fn,
                cudaGetErrorString(err));
  return FCE_SUCCESS;
}

// Step 3 under batch_invariant: ∂h of all fixed_rows rows of ∂Z_c into dh_fixed (K = V whole,
// no split), then the chunk's rc rows of it into grad_hidden.
fce_status fixed_grad_hidden(const ChunkGrads& g, int64_t fixed_rows, void* dh_fixed,
                             cudaStream_t stream) {
  RowMajorGemm gh{};
  gh.fn = g.fn;
  gh.name = "grad_hidden (dZ · weight), fixed rows";
  gh.M = fixed_rows; gh.N = g.hidden; gh.K = g.cols;
  gh.A = g.dz; gh.lda = g.ldz; gh.trans_a = false;
  gh.B = g.weight; gh.ldb = g.hidden; gh.trans_b = false;
  gh.ab_dtype = g.dtype;
  gh.C = dh_fixed; gh.ldc = g.hidden; gh.c_dtype = g.grad_hidden_dtype;
  gh.alpha = 1.f; gh.beta = 0.f;
  gh.workspace = g.lt_ws; gh.workspace_bytes = g.lt_bytes;
  gh.whole_k = true;
  FCE_TRY(gemm(gh, stream, nullptr));
  const size_t row = static_cast<size_t>(g.hidden) * dtype_size(g.grad_hidden_dtype);
  const cudaError_t err = cudaMemcpyAsync(g.grad_hidden, dh_fixed, row * static_cast<size_t>(g.rc),
                                          cudaMemcpyDeviceToDevice, stream);
  if (err != cudaSuccess)
    return fail(FCE_ERROR_CUDA, "%s: copying a chunk of grad_hidden rows failed: %s", g.fn,
                cudaGetErrorString(err));
  return FCE_SUCCESS;
}

}  // namespace

fce_status chunk_grads(const ChunkGrads& g, cudaStream_t stream) {
  // 3. ∂h_c[rc, D] = ∂Z_c[rc, V] · W[V, D]
  if (g.grad_hidden) {
    RowMajorGemm gh{};
    gh.fn = g.fn;
    gh.name = "grad_hidden (dZ · weight)";
    gh.M = g.rc; gh.N = g.hidden; gh.K = g.cols;
    gh.A = g.dz; gh.lda = g.ldz; gh.trans_a = false;
    gh.B = g.weight; gh.ldb = g.hidden; gh.trans_b = false;
    gh.ab_dtype = g.dtype;
    gh.C = g.grad_hidden; gh.ldc = g.hidden; gh.c_dtype = g.grad_hidden_dtype;
    gh.alpha = 1.f; gh.beta = 0.f;
    gh.workspace = g.lt_ws; gh.workspace_bytes = g.lt_bytes;
    FCE_TRY(gemm(gh, stream, nullptr));
  }
  // 4. ∂W[V, D] (+)= ∂Z_c[rc, V]ᵀ · h_c[rc, D]
  if (g.grad_weight) {
    RowMajorGemm gw{};
    gw.fn = g.fn;
    gw.name = "grad_weight (dZᵀ · hidden)";
    gw.M = g.cols; gw.N = g.hidden; gw.K = g.rc;
    gw.A = g.dz; gw.lda = g.ldz; gw.trans_a = true;
    gw.B = g.h_c; gw.ldb = g.hs; gw.trans_b = false;
    gw.ab_dtype = g.dtype;
    gw.C = g.grad_weight; gw.ldc = g.hidden; gw.c_dtype = g.grad_weight_dtype;
    gw.alpha = 1.f;
    gw.beta = (g.first && !g.accumulate) ? 0.f : 1.f;
    gw.workspace = g.lt_ws; gw.workspace_bytes = g.lt_bytes;
    FCE_TRY(gemm(gw, stream, nullptr));
  }
  // 5. ∂b[V] (+)= Σ_rows ∂Z_c   (float32: the caller's, or the workspace accumulator)
  if (g.grad_bias) {
    if (g.grad_weight_dtype == FCE_FLOAT32)
      FCE_TRY(launch_column_sums(g.fn, g.dz, g.dtype, g.rc, g.cols, g.ldz, g.grad_bias,
                                 FCE_FLOAT32, !(g.first && !g.accumulate), stream));
    else
      FCE_TRY(launch_column_sums(g.fn, g.dz, g.dtype, g.rc, g.cols, g.ldz, g.db32, FCE_FLOAT32,
                                 !g.first, stream));
  }
  return FCE_SUCCESS;
}

fce_status slice_pass(const SlicePass& sp, cudaStream_t stream) {
  const CeOptions& opt = sp.opt;
  const int dtype = opt.dtype;
  const size_t e = dtype_size(dtype);
  const int64_t N = sp.rows, D = sp.hidden, hs = sp.hidden_row_stride, V = sp.cols;
  const char* hidden = static_cast<const char*>(sp.hidden_states);
  void* z = sp.z;
  for (int64_t sl = 0; sl < sp.slices; ++sl) {
    const int64_t v0 = sl * sp.slice_cols;
    const int64_t vc = std::min(sp.slice_cols, V - v0);
    const int64_t lds = sp.slice_cols;
    const bool first = sl == 0;
    const char* w_s = static_cast<const char*>(sp.weight) + static_cast<size_t>(v0) * D * e;
    const void* b_s = sp.bias ? static_cast<const char*>(sp.bias) + static_cast<size_t>(v0) * e
                              : nullptr;

    // a. Z_s[N, vc] = h · W_sᵀ + b_s   (computed again: cuBLASLt may pick another algorithm
    //    for this shape than for the lse pass, so a logit may differ from it by a rounding)
    FCE_TRY(logits_gemm(sp.fn, dtype, N, vc, D, hidden, hs, w_s, b_s, z, lds, sp.lt_ws,
                        sp.lt_bytes, stream));

    // b. ∂Z_s from the saved row statistics, in place (the backward kernel on a column slice)
    CeRowsArgs ra = slice_backward_args(sp.fn, opt, N, 0, N, sp.vocab_total, sp.col_offset + v0,
                                        vc, z, lds, sp.targets, sp.denoms, sp.grad_output,
                                        sp.stats);
    ra.q_row_stride = sp.q_row_stride;  // (a shard's class probabilities: from column v0)
    ra.q_col = v0;
    ra.grad_lse = sp.grad_lse;  // (fce_vp_linear_backward's rule 18 terms)
    ra.grad_entropy = sp.grad_entropy;
    FCE_TRY(launch_ce_rows(ra, stream));
    if (sp.fix_dz) FCE_TRY(sp.fix_dz(sp.fix_ctx, z, N, vc, lds, stream));

    // c. ∂W_s[vc, D] = ∂Z_sᵀ · h over all N rows: one GEMM, one rounding
    if (sp.grad_weight) {
      RowMajorGemm gw{};
      gw.fn = sp.fn;
      gw.name = "grad_weight (dZᵀ · hidden)";
      gw.M = vc; gw.N = D; gw.K = N;
      gw.A = z; gw.lda = lds; gw.trans_a = true;
      gw.B = hidden; gw.ldb = hs; gw.trans_b = false;
      gw.ab_dtype = dtype;
      gw.C = static_cast<char*>(sp.grad_weight) +
             static_cast<size_t>(v0) * D * dtype_size(sp.grad_weight_dtype);
      gw.ldc = D; gw.c_dtype = sp.grad_weight_dtype;
      gw.alpha = 1.f; gw.beta = sp.accumulate ? 1.f : 0.f;
      gw.workspace = sp.lt_ws; gw.workspace_bytes = sp.lt_bytes;
      FCE_TRY(gemm(gw, stream, nullptr));
    }

    // d. ∂h[N, D] (+)= ∂Z_s · W_s   (float32 accumulation across slices)
    if (sp.dh) {
      RowMajorGemm gh{};
      gh.fn = sp.fn;
      gh.name = "grad_hidden (dZ · weight)";
      gh.M = N; gh.N = D; gh.K = vc;
      gh.A = z; gh.lda = lds; gh.trans_a = false;
      gh.B = w_s; gh.ldb = D; gh.trans_b = false;
      gh.ab_dtype = dtype;
      gh.C = sp.dh; gh.ldc = D; gh.c_dtype = FCE_FLOAT32;
      gh.alpha = 1.f; gh.beta = first ? 0.f : 1.f;
      gh.workspace = sp.lt_ws; gh.workspace_bytes = sp.lt_bytes;
      FCE_TRY(gemm(gh, stream, nullptr));
    }

    // e. ∂b_s = Σ_rows ∂Z_s, complete in one pass
    if (sp.db)
      FCE_TRY(launch_column_sums(sp.fn, z, dtype, N, vc, lds,
                                 static_cast<char*>(sp.db) + static_cast<size_t>(v0) * dtype_size(sp.db_dtype),
                                 sp.db_dtype, sp.db_add_old, stream));
  }
  return FCE_SUCCESS;
}

}  // namespace linear
}  // namespace cuda

fce_status cuda_linear_ce(const LinearCeProblem& p) {
  using namespace cuda;
  using namespace cuda::linear;
  const char* fn = p.fn;
  const CeOptions& opt = p.opt;
  const int dtype = opt.dtype;
  if (dtype != FCE_FLOAT32 && dtype != FCE_FLOAT16 && dtype != FCE_BFLOAT16)
    return fail(FCE_ERROR_INTERNAL, "%s: dtype %d reached the CUDA backend", fn, dtype);
  const int64_t N = p.rows, D = p.hidden, V = p.vocab, hs = p.hidden_row_stride;
  const bool with_grad = p.with_grad();
  const bool dw_fp32 = p.grad_weight_fp32 || dtype == FCE_FLOAT32;
  const int grad_w_dtype = dw_fp32 ? FCE_FLOAT32 : dtype;  // of grad_weight and grad_bias
  const size_t e = dtype_size(dtype);

  // ---- everything that can fail before any work is enqueued
  const Sizes s = sizes_of(opt, N, D, V, with_grad);
  Plan plan;
  if (!choose_plan(s, p.grad_weight != nullptr, dw_fp32, p.workspace_bytes, &plan)) {
    size_t min_bytes = 0, optimal_bytes = 0;
    cuda_linear_ce_workspace_size(opt, N, D, V, with_grad, p.grad_weight_fp32, &min_bytes,
                                  &optimal_bytes);
    return fail(FCE_ERROR_WORKSPACE_TOO_SMALL,
                "%s: workspace_bytes (%zu) is too small: the CUDA backend needs at least %zu "
                "bytes for these sizes (%zu for full speed)",
                fn, p.workspace_bytes, min_bytes, optimal_bytes);
  }
  if (!p.workspace)
    return fail(FCE_ERROR_NULL_POINTER, "%s: workspace is NULL (%zu bytes needed)", fn,
                plan.layout.total);

  const bool invariant = opt.batch_invariant;
  if (invariant && plan.mode == Mode::kChunked16 && plan.chunks > max_chunks16(N, V))
    return fail(FCE_ERROR_UNSUPPORTED,
                "%s: options->batch_invariant with a 16-bit grad_weight: %lld chunks of %lld "
                "rows would round grad_weight more often than docs/semantics.md allows (%lld "
                "times at most for these sizes): set options->grad_weight_fp32",
                fn, (long long)plan.chunks, (long long)plan.chunk_rows,
                (long long)max_chunks16(N, V));

  // ---- carve the workspace
  const Layout& L = plan.layout;
  char* base = aligned_base(p.workspace);
  const ChunkSlices cs =
      chunk_slices(L, base, opt, p.loss, p.z_loss != nullptr, p.accuracy, p.bias != nullptr);
  const int64_t ldz = s.vocab_padded;
  const bool sliced = plan.mode == Mode::kVocabSliced;
  // (its gradient pass has no class-probability targets, docs/semantics.md rule 19)
  if (sliced && with_grad && opt.soft_targets)
    return fail(FCE_ERROR_UNSUPPORTED,
                "%s: options->target_dtype of class probabilities is not supported by the CUDA "
                "backend's vocabulary-sliced plan (a 16-bit grad_weight with less workspace than "
                "the token chunks need): give the workspace query's optimal_bytes, or set "
                "options->grad_weight_fp32",
                fn);
  // the vocab-sliced plan (only ever chosen for a 16-bit dtype whose grad_weight and grad_bias
  // are 16-bit too: choose_plan takes token chunks for float32 ones): the lse pass keeps each
  // row's (m, log s, t) for the gradient pass; ∂h accumulates in a float32 workspace buffer
  CeRowStats* stats = sliced ? reinterpret_cast<CeRowStats*>(base + L.stats) : nullptr;
  float* dh32 = reinterpret_cast<float*>(base + L.dh);
  void* h_fixed = base + L.h_fixed;  // batch_invariant: the chunk's hidden rows, its ∂h
  void* dh_fixed = base + L.dh_fixed;
  const bool grad_in_chunks = with_grad && !sliced;

  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const char* hidden = static_cast<const char*>(p.hidden_states);

  // ---- the loss denominators (need all targets); the bias copied to 256-byte aligned
  // workspace (in dtype: cuBLASLt's bias has the D type), so cuBLASLt's pick does not depend
  // on the caller's bias address
  FCE_TRY(launch_ce_denominators(fn, opt, N, V, p.targets, cs.denoms, stream));
  if (p.bias) FCE_TRY(launch_convert(fn, p.bias, dtype, cs.bias, dtype, V, stream));

  for (int64_t c = 0; c < plan.chunks; ++c) {
    const int64_t r0 = c * plan.chunk_rows;
    const int64_t rc = std::min(plan.chunk_rows, N - r0);
    const void* h_c = hidden + static_cast<size_t>(r0) * static_cast<size_t>(hs) * e;

    // batch_invariant: the GEMMs whose rows are outputs always get chunk_rows rows (a copy of
    // the chunk's hidden rows, zero rows after the last)
    const int64_t gm = invariant ? plan.chunk_rows : rc;
    const void* h_gemm = h_c;
    int64_t h_ld = hs;
    if (invariant) {
      FCE_TRY(copy_fixed_rows(fn, h_fixed, h_c, hs, rc, plan.chunk_rows, D, e, stream));
      h_gemm = h_fixed;
      h_ld = D;
    }

    // 1. Z_c[rc, V] = h_c[rc, D] · W[V, D]ᵀ + b   (in dtype, float32 accumulation, ld = ldz)
    FCE_TRY(logits_gemm(fn, dtype, gm, V, D, h_gemm, h_ld, p.weight, cs.bias, cs.z, ldz, cs.lt,
                        plan.lt_bytes, stream, invariant));

    // 2. the CE pass: row losses, lse, and ∂Z_c in dtype, in place over Z_c
    CeRowsArgs a{};
    a.fn = fn;
    a.opt = opt;
    a.vocab = V;
    a.total_rows = N;
    a.row_begin = r0;
    a.row_count = rc;
    a.logits = cs.z;
    a.logits_dtype = dtype;
    a.row_stride = ldz;
    a.grad = grad_in_chunks ? cs.z : nullptr;
    a.grad_dtype = dtype;
    a.grad_row_stride = ldz;
    a.targets = p.targets;
    a.denoms = cs.denoms;
    a.grad_output = p.grad_output;
    a.lse_in = nullptr;
    a.row_loss = cs.row_loss;
    a.row_zloss = cs.row_zloss;
    a.lse_out = p.lse;
    a.stats_out = stats;
    a.argmax_out = p.argmax;
    a.row_correct = cs.row_correct;
    a.error_flags = p.error_flags;
    a.entropy_out = p.entropy;
    a.grad_lse = grad_in_chunks ? p.grad_lse : nullptr;
    a.grad_entropy = grad_in_chunks ? p.grad_entropy : nullptr;
    // the sliced plan's lse pass keeps μ − m for its entropy gradient (rule 18)
    a.stats_mu = sliced && with_grad && p.grad_entropy;
    FCE_TRY(launch_ce_rows(a, stream));
    if (!grad_in_chunks) continue;

    // 3-5. ∂h_c straight into grad_hidden, ∂W (+)= ∂Z_cᵀ·h_c (kChunked16: the 16-bit
    // grad_weight itself, one rounding per chunk; kChunked: the caller's float32 one), ∂b
    ChunkGrads cg =
        chunk_grads_args(p, dtype, dtype, grad_w_dtype, V, cs, ldz, plan.lt_bytes, r0, rc);
    if (invariant && cg.grad_hidden) {
      FCE_TRY(fixed_grad_hidden(cg, plan.chunk_rows, dh_fixed, stream));
      cg.grad_hidden = nullptr;
    }
    FCE_TRY(chunk_grads(cg, stream));
  }

  // ---- the vocab-sliced gradient pass: per slice of columns [v0, v0 + vc), for all N rows
  // (slice_pass, shared with fce_vp_linear_backward)
  if (sliced && with_grad) {
    SlicePass sp{};
    sp.fn = fn;
    sp.opt = opt;
    sp.rows = N;
    sp.hidden = D;
    sp.hidden_row_stride = hs;
    sp.cols = V;
    sp.col_offset = 0;
    sp.vocab_total = V;
    sp.hidden_states = hidden;
    sp.weight = p.weight;
    sp.bias = cs.bias;
    sp.targets = p.targets;
    sp.denoms = cs.denoms;
    sp.grad_output = p.grad_output;
    sp.stats = stats;
    sp.z = cs.z;
    sp.slice_cols = plan.slice_cols;
    sp.slices = plan.slices;
    sp.lt_ws = cs.lt;
    sp.lt_bytes = plan.lt_bytes;
    sp.grad_weight = p.grad_weight;
    sp.grad_weight_dtype = grad_w_dtype;
    sp.accumulate = p.accumulate;
    sp.dh = p.grad_hidden ? dh32 : nullptr;
    sp.db = p.grad_bias ? cs.db32 : nullptr;  // complete per slice; stored below
    sp.db_dtype = FCE_FLOAT32;
    sp.db_add_old = false;
    sp.grad_lse = p.grad_lse;  // rule 18's terms: the lse pass saved μ − m (stats_mu)
    sp.grad_entropy = p.grad_entropy;
    FCE_TRY(slice_pass(sp, stream));
  }
  if (sliced && p.grad_hidden)
    FCE_TRY(launch_store_accumulator(fn, dh32, p.grad_hidden, dtype, N * D, false, stream));

  // ---- f16/bf16 gradients out of their float32 accumulators (one rounding, + old values)
  if (p.grad_bias && !dw_fp32)
    FCE_TRY(launch_store_accumulator(fn, cs.db32, p.grad_bias, grad_w_dtype, V, p.accumulate,
                                     stream));

  // ---- the reduced loss, z-loss and accuracy, fixed order. For none the per-row losses and
  // accuracies already are the caller's: only the z-loss total remains.
  if (!s.reduction_none)
    FCE_TRY(launch_ce_finalize(fn, opt, N, cs.row_loss, cs.row_zloss, cs.row_correct, cs.denoms,
                               p.loss, p.z_loss, p.accuracy, stream));
  else
    FCE_TRY(launch_ce_finalize(fn, opt, N, cs.row_loss, cs.row_zloss, cs.row_correct, cs.denoms,
                               nullptr, p.z_loss, nullptr, stream));
  return FCE_SUCCESS;
}

}  // namespace fce
