// distill/linear_plan.cuh — the token chunks of fce_linear_distill (distill/linear_distill.cu),
// shared with fce_vp_linear_distill_* (vocab_parallel/linear_distill.cu, over a weight shard):
// the plan (the chunk's rows and the cuBLASLt workspace in the caller's workspace), and a
// chunk's GEMMs: the student's Z_c = h_c·Wᵀ and the teacher's Z'_c = h'_c·W'ᵀ in the dtype
// (linear/plan.cuh's logits_gemm, float32 accumulation), then the student's ∂h_c and ∂W (+)=
// (linear/plan.cuh's chunk_grads) from ∂Z_c written over Z_c.
//   Workspace (from a 256-byte aligned base): distill/kernels.cuh's Head for the reduction |
//   cuBLASLt workspace | Z_c | Z'_c ([chunk_rows, linear_ldz(vocab)] each, in dtype).
// The plan is a function of the sizes, the options and workspace_bytes only.
#pragma once

#include <cuda_runtime.h>

#include "distill.h"

namespace fce {
namespace cuda {
namespace distill {

struct LinearPlan {
  int64_t chunk_rows = 0, chunks = 0;
  size_t lt_bytes = 0, z_bytes = 0, head = 0, total = 0;
};

// The elements between rows of Z_c: vocab padded as fce_linear_ce's logits.
int64_t linear_ldz(int64_t vocab);
// The workspace of the smallest plan and of the full-speed one (opt.reduction sizes the Head).
void linear_plan_sizes(const DistillOptions& opt, int64_t rows, int64_t vocab, size_t* min_bytes,
                       size_t* optimal_bytes);
// The plan in workspace_bytes: the largest chunk (up to the full-speed one) with the largest
// cuBLASLt workspace that fits; false when even the smallest does not.
bool choose_linear_plan(const DistillOptions& opt, int64_t rows, int64_t vocab,
                        size_t workspace_bytes, LinearPlan* out);
// A 16-bit grad_weight (dw16) follows fce_linear_ce's chunk rule (linear::max_chunks16): over
// more token chunks than it allows, FCE_ERROR_UNSUPPORTED naming fn (fce_linear_ce would take its
// vocabulary-sliced plan there).
fce_status check_linear_dw16(const char* fn, const DistillOptions& opt, int64_t rows, int64_t vocab,
                             const LinearPlan& plan, bool dw16);

// What a call's chunks read and write.
struct LinearChunks {
  const char* fn;
  int dtype;  // of the hidden states, the weights and Z_c
  int64_t vocab, hidden, teacher_hidden;
  const void* hidden_states;  // [rows, hidden_row_stride]
  int64_t hidden_row_stride;
  const void* weight;                 // [vocab, hidden]
  const void* teacher_hidden_states;  // [rows, teacher_hidden_row_stride]
  int64_t teacher_hidden_row_stride;
  const void* teacher_weight;  // [vocab, teacher_hidden]
  char* lt;                    // the cuBLASLt workspace
  size_t lt_bytes;
  void* zs;           // the student's Z_c, then ∂Z_c (written over it by the caller's row kernel)
  void* zt;           // the teacher's Z'_c
  int64_t ldz;        // linear_ldz(vocab)
  void* grad_hidden;  // [rows, hidden] dense, of grad_hidden_dtype, or nullptr
  int grad_hidden_dtype;
  void* grad_weight;  // [vocab, hidden] dense, of grad_weight_dtype, or nullptr
  int grad_weight_dtype;
  bool accumulate;
};
// lt, lt_bytes, zs, zt and ldz of plan's layout from the aligned base (c->vocab set).
void set_chunk_buffers(LinearChunks* c, char* base, const LinearPlan& plan);
// The chunks of call p (a LinearDistillProblem, or a VpLinearDistillProblem over its shard of
// `vocab` classes) in plan's layout from the aligned base.
template <class Problem>
LinearChunks chunks_of(const Problem& p, int64_t vocab, int grad_hidden_dtype, char* base,
                       const LinearPlan& plan) {
  LinearChunks c{};
  c.fn = p.fn;
  c.dtype = p.opt.dtype;
  c.vocab = vocab;
  c.hidden = p.hidden;
  c.teacher_hidden = p.teacher_hidden;
  c.hidden_states = p.hidden_states;
  c.hidden_row_stride = p.hidden_row_stride;
  c.weight = p.weight;
  c.teacher_hidden_states = p.teacher_hidden_states;
  c.teacher_hidden_row_stride = p.teacher_hidden_row_stride;
  c.teacher_weight = p.teacher_weight;
  set_chunk_buffers(&c, base, plan);
  c.grad_hidden = p.grad_hidden;
  c.grad_hidden_dtype = grad_hidden_dtype;
  c.grad_weight = p.grad_weight;
  c.grad_weight_dtype = p.grad_weight_fp32 ? FCE_FLOAT32 : p.opt.dtype;
  c.accumulate = p.accumulate;
  return c;
}
// Z_c and Z'_c of rows [r0, r0 + rc).
fce_status chunk_logits(const LinearChunks& c, int64_t r0, int64_t rc, cudaStream_t s);
// ∂h of rows [r0, r0 + rc) and ∂W (+)= from ∂Z_c in zs (first: the call's first chunk).
fce_status chunk_grads(const LinearChunks& c, int64_t r0, int64_t rc, bool first, cudaStream_t s);

}  // namespace distill
}  // namespace cuda
}  // namespace fce
