// common/gemm.cuh — a small cuBLASLt wrapper for the fused linear + CE path: row-major problems
// in, column-major cuBLASLt calls out. One cublasLtHandle_t per device, created lazily under a
// mutex the first time a device is used (host-side only; kept for the life of the process).
// Every GEMM is C[M, N] = alpha · op(A)[M, K] · op(B)[K, N] + beta · C (+ bias[N] on each row),
// A, B, C row-major, float32 accumulation (never TF32), C of f32, f16 or bf16 (one rounding).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "internal.h"

// The row-major → column-major mapping (common/gemm.cu implements exactly this):
//   A row-major matrix X[r, c] with row stride ld is, byte for byte, the column-major matrix
//   Xᵀ[c, r] with leading dimension ld. So the row-major product C = op(A)·op(B) is computed as
//   the column-major product  Cᵀ[N, M] = op(B)ᵀ[N, K] · op(A)ᵀ[K, M]:
//     cuBLASLt "A" operand = our B storage: op = trans_b ? T : N,
//                            layout rows×cols = trans_b ? K×N : N×K, ld = ldb
//     cuBLASLt "B" operand = our A storage: op = trans_a ? T : N,
//                            layout rows×cols = trans_a ? M×K : K×M, ld = lda
//     cuBLASLt C/D         = our C storage: layout N×M, ld = ldc
//     cuBLASLt (m, n, k)   = (N, M, K)
//   Our bias over the N columns of each row of C is cuBLASLt's bias over the m = N rows of Cᵀ
//   (CUBLASLT_EPILOGUE_BIAS: "length must match matrix D rows").
//
// Bias type: cuBLASLt reads the bias in the D type (CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE's
// default, -1 = "the type of D"; the only documented exceptions are IMMA and fp8 kernels), so
// the bias has c_dtype here: float32 with an f32 C, f16/bf16 with an f16/bf16 C. The epilogue
// adds it to the float32 accumulator before the one rounding to the C type (cublasLt computes
// D = alpha·A·B + beta·C + bias in the compute type, then converts), exactly what torch's
// addmm/linear with a bias does through the same epilogue.

namespace fce {
namespace cuda {

struct RowMajorGemm {
  const char* fn;     // the public function, first in error messages ("fce_linear_ce", ...)
  const char* name;   // names the GEMM in error messages ("logits", "grad_hidden", ...)
  int64_t M, N, K;    // op(A) is [M, K], op(B) is [K, N], C is [M, N]
  const void* A;      // stored [M, K] row-major, or [K, M] when trans_a
  int64_t lda;        // elements between rows of the stored A
  bool trans_a;
  const void* B;      // stored [K, N] row-major, or [N, K] when trans_b
  int64_t ldb;
  bool trans_b;
  int ab_dtype;       // FCE_FLOAT32 / FCE_FLOAT16 / FCE_BFLOAT16, for both A and B
  void* C;            // [M, N] row-major, ldc elements between rows; read when beta != 0
  int64_t ldc;
  int c_dtype;        // FCE_FLOAT32 / FCE_FLOAT16 / FCE_BFLOAT16
  float alpha, beta;
  const void* bias;   // [N] of c_dtype added to every row of C (before C's rounding), or nullptr
  void* workspace;    // cuBLASLt workspace (256-byte aligned), workspace_bytes of it
  size_t workspace_bytes;
  // options->batch_invariant: only an algorithm without a split of K (CUBLASLT_ALGO_CONFIG_
  // SPLITK_NUM 1): the first such of the heuristic's first kInvariantCandidates, else the first
  // of them that cublasLtMatmulAlgoCheck accepts set to one split; FCE_ERROR_UNSUPPORTED if none
  bool whole_k = false;
};

// The cuBLASLt (column-major) view of a RowMajorGemm: the mapping written above, in one place
// (gemm() uses it; a host test can check it against a plain row-major product).
struct ColumnMajorView {
  bool trans_first;             // op of cuBLASLt's "A" operand (our B storage)
  uint64_t first_rows, first_cols;
  int64_t first_ld;
  const void* first;
  bool trans_second;            // op of cuBLASLt's "B" operand (our A storage)
  uint64_t second_rows, second_cols;
  int64_t second_ld;
  const void* second;
  uint64_t m, n, k;             // cuBLASLt's problem: D[m, n] = op(first)[m, k] · op(second)[k, n]
  uint64_t out_rows, out_cols;  // = m, n: our C storage seen as Cᵀ
  int64_t out_ld;
};

inline ColumnMajorView column_major_view(const RowMajorGemm& g) {
  ColumnMajorView v;
  v.trans_first = g.trans_b;
  v.first_rows = static_cast<uint64_t>(g.trans_b ? g.K : g.N);
  v.first_cols = static_cast<uint64_t>(g.trans_b ? g.N : g.K);
  v.first_ld = g.ldb;
  v.first = g.B;
  v.trans_second = g.trans_a;
  v.second_rows = static_cast<uint64_t>(g.trans_a ? g.M : g.K);
  v.second_cols = static_cast<uint64_t>(g.trans_a ? g.K : g.M);
  v.second_ld = g.lda;
  v.second = g.A;
  v.m = static_cast<uint64_t>(g.N);
  v.n = static_cast<uint64_t>(g.M);
  v.k = static_cast<uint64_t>(g.K);
  v.out_rows = v.m;
  v.out_cols = v.n;
  v.out_ld = g.ldc;
  return v;
}

// Enqueues the GEMM on stream s. With a bias, *bias_applied tells whether cuBLASLt's BIAS
// epilogue added it; when no algorithm supports that epilogue for this problem the GEMM runs
// without it, *bias_applied = false, and the caller adds the bias itself. Errors come back as
// FCE_ERROR_CUBLAS / FCE_ERROR_CUDA through fce::fail, naming g.fn, then g.name.
fce_status gemm(const RowMajorGemm& g, cudaStream_t s, bool* bias_applied);

}  // namespace cuda
}  // namespace fce
