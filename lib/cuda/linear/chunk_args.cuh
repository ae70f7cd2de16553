// linear/chunk_args.cuh — the arguments of a token chunk's gradient steps (chunk_grads, steps
// 3-5 of linear/linear_ce.cu), filled in one place for the two calls that run them per chunk:
// fce_linear_ce (linear/linear_ce.cu) and fce_vp_linear_ce (vocab_parallel/linear_ce.cu).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/linear/plan.cuh"
#include "internal.h"

namespace fce {
namespace cuda {
namespace linear {

// The chunk of rc rows from row r0 of problem p (LinearCeProblem or VpLinearProblem: its hidden
// states, weight of `cols` rows and gradient outputs), from ∂Z_c in the chunk slices' logits
// scratch (ldz elements apart): ∂h_c into grad_hidden's rows from r0 (of grad_hidden_dtype), ∂W
// (+)= ∂Z_cᵀ·h_c (of grad_weight_dtype) and ∂b, the first chunk overwriting unless accumulate.
template <class Problem>
ChunkGrads chunk_grads_args(const Problem& p, int dtype, int grad_hidden_dtype,
                            int grad_weight_dtype, int64_t cols, const ChunkSlices& cs, int64_t ldz,
                            size_t lt_bytes, int64_t r0, int64_t rc) {
  const size_t row0 = static_cast<size_t>(r0);
  ChunkGrads g{};
  g.fn = p.fn;
  g.dtype = dtype;
  g.rc = rc;
  g.cols = cols;
  g.hidden = p.hidden;
  g.dz = cs.z;
  g.ldz = ldz;
  g.h_c = static_cast<const char*>(p.hidden_states) +
          row0 * static_cast<size_t>(p.hidden_row_stride) * dtype_size(dtype);
  g.hs = p.hidden_row_stride;
  g.weight = p.weight;
  g.grad_hidden = p.grad_hidden
                      ? static_cast<char*>(p.grad_hidden) +
                            row0 * static_cast<size_t>(p.hidden) * dtype_size(grad_hidden_dtype)
                      : nullptr;
  g.grad_hidden_dtype = grad_hidden_dtype;
  g.grad_weight = p.grad_weight;
  g.grad_weight_dtype = grad_weight_dtype;
  g.grad_bias = p.grad_bias;
  g.db32 = cs.db32;
  g.first = r0 == 0;
  g.accumulate = p.accumulate;
  g.lt_ws = cs.lt;
  g.lt_bytes = lt_bytes;
  return g;
}

}  // namespace linear
}  // namespace cuda
}  // namespace fce
