// stats_gemm.cuh — a measured prototype (dev/NOTES.md "What bounds the remaining cells, and linear CE measured in turns"),
// not part of the library: the sm_90 logits GEMM that reduces each row's (max, Σexp) in its
// epilogue instead of writing the logits (stats_gemm.cu). Built by build.sh.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace fce {
namespace cuda {
namespace linear {

enum fce_status { FCE_SUCCESS = 0, FCE_ERROR_INTERNAL = 9, FCE_ERROR_CUDA = 8 };
enum { FCE_FLOAT16 = 1, FCE_BFLOAT16 = 2 };
fce_status fail(fce_status s, const char* fmt, ...);  // prints the message (stats_test.cu)

// Its tiles: 128 rows × 256 columns. The partials are float2 (m, s) at [tile][row] of a
// [⌈cols / 256⌉, round(rows, 128)] array (row fastest).
constexpr int64_t kStatsTileRows = 128;
#if defined(FCE_STATS_PINGPONG)
constexpr int64_t kStatsTileCols = 128;
#else
constexpr int64_t kStatsTileCols = 256;
#endif
inline int64_t stats_tiles(int64_t cols) { return (cols + kStatsTileCols - 1) / kStatsTileCols; }
inline int64_t stats_rows_padded(int64_t rows) {
  return (rows + kStatsTileRows - 1) / kStatsTileRows * kStatsTileRows;
}
inline size_t stats_partials_bytes(int64_t rows, int64_t cols) {
  return static_cast<size_t>(stats_tiles(cols)) * static_cast<size_t>(stats_rows_padded(rows)) * 8;
}

struct Sm90StatsArgs {
  const char* fn;        // the public function, for messages
  int dtype;             // FCE_BFLOAT16 or FCE_FLOAT16: of hidden and weight
  int64_t rows, cols, depth;  // N, V (or a slice's columns), D
  const void* hidden;    // [rows, lda]
  int64_t lda;           // ≥ depth, a multiple of 8
  const void* weight;    // [cols, ldb]
  int64_t ldb;           // ≥ depth, a multiple of 8
  void* partials;        // stats_partials_bytes(rows, cols), 16-byte aligned
  void* gemm_workspace;  // sm90_stats_gemm_workspace() bytes (may be 0)
  size_t gemm_workspace_bytes;
  int device, sm_count;
};

size_t sm90_stats_gemm_workspace(const Sm90StatsArgs& a);
fce_status sm90_stats_gemm(const Sm90StatsArgs& a, cudaStream_t stream);

}  // namespace linear
}  // namespace cuda
}  // namespace fce
