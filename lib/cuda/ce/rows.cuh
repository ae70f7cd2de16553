// ce/rows.cuh — the cross-entropy row kernels (ce/kernels.cu, ce/reduce.cu), shared by cuda_ce
// (ce/ce.cu), the fused linear + CE path (linear/linear_ce.cu), which calls launch_ce_rows on chunks of
// rows, and the vocabulary-parallel calls (vocab_parallel/vocab_parallel.cu, vocab_parallel/linear.cu).
//
// Call order on one stream, per problem: launch_ce_denominators (all rows) → launch_ce_rows (all
// rows, in one call or in chunks, any order) → launch_ce_finalize. Everything is enqueued on the
// given stream: no allocation, no synchronisation, graph-capturable. Each returns FCE_SUCCESS or
// a status with fce::fail() whose message starts with `fn`, the public function the caller runs
// ("fce_forward", "fce_vp_backward", ...), and names the kernel after it (FCE_ERROR_CUDA on a
// launch error; common/launch_check.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "internal.h"

namespace fce {
namespace cuda {

struct CeDenoms {
  float denom;        // D (docs/semantics.md rule 4)
  float omega_total;  // Omega = sum_j w_j (vocab without class weights)
  float count;        // n, the non-ignored rows (rule 4): the z-loss's and accuracy's divisor
};  // device memory, lives in the workspace

// What a forward pass keeps of a row for a later gradient of a column slice (fce_linear_ce's
// vocabulary-sliced plan): the row maximum m, log s, and the token-scaling factor t (1 when off).
// p_j = exp((a_j − m) − ls) needs both m and ls: lse = m + ls in float32 loses ls when |m| is
// huge (docs/semantics.md rule 9). pad: μ − m for the entropy's gradient (CeRowsArgs::stats_mu,
// the vocabulary-parallel combine with vp_entropy), else 0 (or a flag of the combine's).
struct CeRowStats {
  float m, ls, t, pad;
};

// D (docs/semantics.md rule 4) and Omega = sum of class weights (or vocab), deterministic, all rows.
// launch_ce_rows reads D for reduction mean (to form k = g / D) and Omega for label smoothing
// with class weights; launch_ce_finalize reads D for mean. Call it before them, always.
// skip_if_one (fce_backward_rescale's grad_output, else nullptr): nothing is computed when it
// reads exactly 1 on the device (the row kernels then read no denominators either).
fce_status launch_ce_denominators(const char* fn, const CeOptions& opt, int64_t rows,
                                  int64_t vocab, const void* targets, CeDenoms* out,
                                  cudaStream_t s, const float* skip_if_one = nullptr);

struct CeRowsArgs {
  const char* fn;                // the public function, for messages ("fce_forward", ...)
  CeOptions opt;
  int64_t vocab;
  int64_t total_rows;
  int64_t row_begin, row_count;  // this launch covers global rows [row_begin, row_begin+row_count)
  const void* logits;            // points at row row_begin
  int logits_dtype;              // may differ from opt.dtype (linear CE keeps a float32 chunk)
  int64_t row_stride;            // elements, >= vocab
  void* grad;                    // points at row row_begin; nullptr = no gradient; may equal
                                 // logits (then same dtype and stride)
  int grad_dtype;
  int64_t grad_row_stride;       // elements, >= vocab
  const void* targets;           // the whole targets array, indexed by global row (shift!)
  const CeDenoms* denoms;        // device
  const float* grad_output;      // nullptr = 1; [1] for mean/sum, [total_rows] for none (global)
  const float* lse_in;           // backward: saved lse [total_rows] (global); nullptr = forward
  float* row_loss;               // [total_rows] per-row loss, global index (forward): for
                                 // reduction none the whole loss_r (the user's buffer), for
                                 // mean/sum only the cross-entropy part (the z part is row_zloss)
  float* row_zloss;              // [total_rows] lambda*lse^2 (0 for ignored rows) or nullptr;
                                 // required when lambda != 0 and the reduction is mean or sum
  float* lse_out;                // [total_rows] or nullptr
  CeRowStats* stats_out;         // forward: [total_rows] or nullptr
  const CeRowStats* stats_in;    // backward: [total_rows] from a forward; nullptr = from lse_in
  int64_t* argmax_out;           // forward: [total_rows] or nullptr
  float* row_correct;            // forward: [total_rows] 1/0 per row (accuracy) or nullptr
  uint32_t* error_flags;         // or nullptr
  // A column slice (backward only, lse_in given): the buffers hold classes [col_begin,
  // col_begin + vocab) of rows of vocab_total classes (targets, ε/V, Ω and the class weights are
  // those of the whole vocabulary). vocab_total = 0 means vocab (whole rows).
  int64_t vocab_total;
  int64_t col_begin;
  // Class probabilities (opt.soft_targets) of a vocabulary shard (fce_vp_backward,
  // fce_vp_linear_backward): targets is the shard's own [total_rows, q_row_stride], class
  // col_begin in its column q_col, and stats_in's t holds each row's Q = Σ_j ω_j q'_j over the
  // whole vocabulary (vp_combine's). q_row_stride 0: targets are [total_rows, vocab_total], no
  // stats_in.
  int64_t q_row_stride, q_col;
  // fce_backward_rescale (forward kernels, lse_in null, no outputs but grad): grad holds the
  // gradient for an upstream 1; the kernel reads *grad_output on the device: 1 → returns, 0 or
  // ±2^k → scales the valid rows of grad in place, else the forward's gradient computation.
  bool rescale;
  // The row kernel follows launch_ce_denominators directly on the stream (fce_forward /
  // fce_backward): launched as its programmatic dependent on sm_90 (ce/device.cuh, pdl_trigger).
  bool after_denominators;
  // docs/semantics.md rule 18, by global row (the stream kernels run them: ce/policy.h):
  float* entropy_out;          // forward: [total_rows] entropy, or nullptr
  const float* grad_lse;       // with grad: [total_rows] upstream gradient of lse, or nullptr
  const float* grad_entropy;   // forward with grad, or a backward from stats_in whose pad holds
                               // μ − m (vp_combine's with vp_entropy, or stats_mu's): [total_rows],
                               // or nullptr
  // forward with stats_out: the row's μ − m into its pad (the ROWT kernels), for a backward on
  // column slices with grad_entropy (fce_linear_ce's vocabulary-sliced plan)
  bool stats_mu;
};
// A launch over all `rows` rows of a [rows, vocab] problem whose logits and gradient are
// opt.dtype (fce_forward / fce_backward / fce_backward_rescale, fce_vp_backward); the caller
// sets what else it needs (outputs, lse_in / stats_in, a column slice, rescale, ...).
inline CeRowsArgs all_rows_args(const char* fn, const CeOptions& opt, int64_t rows, int64_t vocab,
                                const void* logits, int64_t row_stride, void* grad,
                                int64_t grad_row_stride, const void* targets,
                                const CeDenoms* denoms, const float* grad_output) {
  CeRowsArgs a{};
  a.fn = fn;
  a.opt = opt;
  a.vocab = vocab;
  a.total_rows = rows;
  a.row_begin = 0;
  a.row_count = rows;
  a.logits = logits;
  a.logits_dtype = opt.dtype;
  a.row_stride = row_stride;
  a.grad = grad;
  a.grad_dtype = opt.dtype;
  a.grad_row_stride = grad_row_stride;
  a.targets = targets;
  a.denoms = denoms;
  a.grad_output = grad_output;
  return a;
}

// The backward in place over logits z of opt.dtype (ld elements between rows) holding rows
// [row_begin, row_begin + row_count) of total_rows and the column slice [col_begin, col_begin +
// cols) of rows of vocab_total classes, from saved row statistics (fce_linear_ce's vocab-sliced
// pass, fce_vp_linear_ce's chunks); no error flags: the pass that made the statistics has flagged
// invalid targets already.
inline CeRowsArgs slice_backward_args(const char* fn, const CeOptions& opt, int64_t total_rows,
                                      int64_t row_begin, int64_t row_count, int64_t vocab_total,
                                      int64_t col_begin, int64_t cols, void* z, int64_t ld,
                                      const void* targets, const CeDenoms* denoms,
                                      const float* grad_output, const CeRowStats* stats) {
  CeRowsArgs a = all_rows_args(fn, opt, total_rows, cols, z, ld, z, ld, targets, denoms,
                               grad_output);
  a.row_begin = row_begin;
  a.row_count = row_count;
  a.vocab_total = vocab_total;
  a.col_begin = col_begin;
  a.stats_in = stats;
  a.error_flags = nullptr;
  return a;
}

// Supported (logits_dtype, grad_dtype): (f32, f32), (f16, f16), (bf16, bf16), (f32, f16),
// (f32, bf16); without a gradient any logits dtype. Backward (lse_in or stats_in) needs grad and
// writes only the gradient (and error_flags). Rows of at most 1 MB (64 KB on sm_80) take the
// register / cluster path, longer ones the two-pass path (see ce/kernels.cu).
fce_status launch_ce_rows(const CeRowsArgs& a, cudaStream_t s);

// Deterministic fixed-order sums over all rows (docs/semantics.md rules 5, 7, 15): loss[0] from row_loss
// (the cross-entropy parts) and row_zloss, z_loss[0] from row_zloss, accuracy[0] from
// row_correct. For reduction none the caller passes loss = nullptr and accuracy = nullptr (the
// rows are the outputs) and this only makes z_loss. row_zloss = nullptr means λ = 0. Nothing to
// do when loss, z_loss and accuracy are all null.
// pdl: launched as a programmatic dependent of the row kernel before it (sm_90; it waits for
// that kernel's values before reading them).
fce_status launch_ce_finalize(const char* fn, const CeOptions& opt, int64_t rows,
                              const float* row_loss, const float* row_zloss,
                              const float* row_correct, const CeDenoms* d, float* loss,
                              float* z_loss, float* accuracy, cudaStream_t s, bool pdl = false);

}  // namespace cuda
}  // namespace fce
