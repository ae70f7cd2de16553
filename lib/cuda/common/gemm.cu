// common/gemm.cu — the cuBLASLt wrapper of common/gemm.cuh: the row-major → column-major mapping written in
// common/gemm.cuh, one lazily created handle per device, and a small cache of heuristic picks so a
// chunked call pays the (host-side) heuristic once per distinct GEMM shape, not per chunk.
// Host code only: nothing here allocates device memory, synchronises, or touches any stream but
// the one given; cublasLtMatmul with a caller workspace is capturable in a CUDA graph.
#include <cublasLt.h>

#include <array>
#include <map>
#include <mutex>

#include "cuda/common/gemm.cuh"

namespace fce {
namespace cuda {
namespace {

std::mutex g_mutex;                           // guards the two maps below
std::map<int, cublasLtHandle_t> g_handles;    // device → handle (never destroyed)

// Everything the heuristic sees, in cuBLASLt (column-major) terms.
using AlgoKey = std::array<int64_t, 20>;
struct AlgoPick {
  bool bias_epilogue;  // the pick uses CUBLASLT_EPILOGUE_BIAS (else EPILOGUE_DEFAULT)
  cublasLtMatmulAlgo_t algo;
};
std::map<AlgoKey, AlgoPick> g_algos;
constexpr size_t kMaxCachedAlgos = 4096;
constexpr int kInvariantCandidates = 16;  // heuristic results searched for a whole-K algorithm

// The first of `found` heuristic results that computes K in one piece (SPLITK_NUM 1, no
// reduction), or -1.
int first_whole_k(const cublasLtMatmulHeuristicResult_t* results, int found) {
  for (int i = 0; i < found; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    int32_t splits = 0;
    uint32_t scheme = 1;
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                             &splits, sizeof splits,
                                             &written) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo,
                                             CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                             sizeof scheme, &written) != CUBLAS_STATUS_SUCCESS)
      continue;
    if (splits <= 1 && scheme == CUBLASLT_REDUCTION_SCHEME_NONE) return i;
  }
  return -1;
}

// When every heuristic result splits K: the first of them that cuBLASLt accepts with K in one
// piece (SPLITK_NUM 1, no reduction; cublasLtMatmulAlgoCheck, within the workspace), written
// into *out, else false. The tile and stage choice stay the heuristic's.
bool unsplit_candidate(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                       cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                       cublasLtMatrixLayout_t c, const cublasLtMatmulHeuristicResult_t* results,
                       int found, uint64_t ws_bytes, cublasLtMatmulHeuristicResult_t* out) {
  for (int i = 0; i < found; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    cublasLtMatmulAlgo_t algo = results[i].algo;
    const int32_t one = 1;
    const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
    if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one,
                                             sizeof one) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none,
                                             sizeof none) != CUBLAS_STATUS_SUCCESS)
      continue;
    cublasLtMatmulHeuristicResult_t checked = {};
    if (cublasLtMatmulAlgoCheck(handle, desc, a, b, c, c, &algo, &checked) !=
            CUBLAS_STATUS_SUCCESS ||
        checked.state != CUBLAS_STATUS_SUCCESS || checked.workspaceSize > ws_bytes)
      continue;
    checked.algo = algo;
    if (first_whole_k(&checked, 1) != 0) continue;
    *out = checked;
    return true;
  }
  return false;
}

cudaDataType_t cuda_type(int dtype) {
  switch (dtype) {
    case FCE_FLOAT16: return CUDA_R_16F;
    case FCE_BFLOAT16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

const char* dtype_name(int dtype) {
  switch (dtype) {
    case FCE_FLOAT32: return "f32";
    case FCE_FLOAT16: return "f16";
    case FCE_BFLOAT16: return "bf16";
    default: return "?";
  }
}

// The largest power of two (≤ 256) dividing both the address and the row pitch in bytes: the
// alignment every row of the matrix has, so every token chunk of it gets the same algorithm.
uint32_t alignment_of(const void* p, int64_t ld, size_t elem) {
  uint64_t bits = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)) |
                  static_cast<uint64_t>(ld) * elem | 256u;
  return static_cast<uint32_t>(bits & (~bits + 1));
}

fce_status get_handle(const char* fn, int device, cublasLtHandle_t* out) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_handles.find(device);
  if (it != g_handles.end()) {
    *out = it->second;
    return FCE_SUCCESS;
  }
  cublasLtHandle_t h = nullptr;
  cublasStatus_t st = cublasLtCreate(&h);
  if (st != CUBLAS_STATUS_SUCCESS)
    return fail(FCE_ERROR_CUBLAS, "%s: cublasLtCreate on device %d failed: %s", fn, device,
                cublasLtGetStatusString(st));
  g_handles.emplace(device, h);
  *out = h;
  return FCE_SUCCESS;
}

// Destroys whatever descriptors were created, on every path out of gemm().
struct LtObjects {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtObjects() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

}  // namespace

fce_status gemm(const RowMajorGemm& g, cudaStream_t s, bool* bias_applied) {
  if (bias_applied) *bias_applied = false;
  if (g.M <= 0 || g.N <= 0 || g.K <= 0)
    return fail(FCE_ERROR_INTERNAL, "%s: GEMM %s: empty problem %lld x %lld x %lld", g.fn,
                g.name, (long long)g.M, (long long)g.N, (long long)g.K);

  int device = 0;
  cudaError_t ce = cudaGetDevice(&device);
  if (ce != cudaSuccess)
    return fail(FCE_ERROR_CUDA, "%s: cudaGetDevice failed: %s", g.fn, cudaGetErrorString(ce));
  cublasLtHandle_t handle = nullptr;
  fce_status fs = get_handle(g.fn, device, &handle);
  if (fs != FCE_SUCCESS) return fs;

  // ---- the mapping of common/gemm.cuh: column-major Cᵀ[N, M] = op(B)ᵀ[N, K] · op(A)ᵀ[K, M]
  const ColumnMajorView v = column_major_view(g);
  const cublasOperation_t op_first = v.trans_first ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = v.trans_second ? CUBLAS_OP_T : CUBLAS_OP_N;
  const void* first_ptr = v.first;
  const void* second_ptr = v.second;
  const int64_t first_ld = v.first_ld, second_ld = v.second_ld, out_ld = v.out_ld;

  const cudaDataType_t ab_type = cuda_type(g.ab_dtype), c_type = cuda_type(g.c_dtype);
  const size_t ab_size = dtype_size(g.ab_dtype), c_size = dtype_size(g.c_dtype);
  const uint32_t align_first = alignment_of(first_ptr, first_ld, ab_size);
  const uint32_t align_second = alignment_of(second_ptr, second_ld, ab_size);
  const uint32_t align_c = alignment_of(g.C, out_ld, c_size);
  const uint32_t align_bias = g.bias ? alignment_of(g.bias, 0, c_size) : 0;
  const uint64_t ws_bytes = g.workspace ? static_cast<uint64_t>(g.workspace_bytes) : 0;

  LtObjects lt;
  cublasStatus_t st;
  const char* what = "";
#define FCE_LT(call)                 \
  do {                               \
    what = #call;                    \
    st = (call);                     \
    if (st != CUBLAS_STATUS_SUCCESS) \
      goto lt_error;                 \
  } while (0)
  {
    const int32_t ta = op_first, tb = op_second;
    const uint32_t epi_default = CUBLASLT_EPILOGUE_DEFAULT, epi_bias = CUBLASLT_EPILOGUE_BIAS;
    FCE_LT(cublasLtMatmulDescCreate(&lt.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    FCE_LT(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    FCE_LT(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (g.bias) {
      // Bias elements have the D type (c_dtype: float32, f16 or bf16), the documented default
      // of CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE (-1): nothing to set. The bias type is part of
      // the algorithm cache key through c_type.
      FCE_LT(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi_bias,
                                            sizeof epi_bias));
      FCE_LT(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias,
                                            sizeof g.bias));
    }
    FCE_LT(cublasLtMatrixLayoutCreate(&lt.a, ab_type, v.first_rows, v.first_cols, first_ld));
    FCE_LT(cublasLtMatrixLayoutCreate(&lt.b, ab_type, v.second_rows, v.second_cols, second_ld));
    FCE_LT(cublasLtMatrixLayoutCreate(&lt.c, c_type, v.out_rows, v.out_cols, out_ld));

    const AlgoKey key = {device, (int64_t)v.m, (int64_t)v.n, (int64_t)v.k, ta, tb, ab_type,
                         c_type, first_ld, second_ld, out_ld, align_first, align_second,
                         align_c, g.bias != nullptr, align_bias, (int64_t)ws_bytes, g.whole_k,
                         0, 0};
    AlgoPick pick;
    bool cached = false;
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      auto it = g_algos.find(key);
      if (it != g_algos.end()) {
        pick = it->second;
        cached = true;
      }
    }
    if (!cached) {
      FCE_LT(cublasLtMatmulPreferenceCreate(&lt.pref));
      FCE_LT(cublasLtMatmulPreferenceSetAttribute(
          lt.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
      FCE_LT(cublasLtMatmulPreferenceSetAttribute(
          lt.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_first, sizeof align_first));
      FCE_LT(cublasLtMatmulPreferenceSetAttribute(
          lt.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_second, sizeof align_second));
      FCE_LT(cublasLtMatmulPreferenceSetAttribute(
          lt.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof align_c));
      FCE_LT(cublasLtMatmulPreferenceSetAttribute(
          lt.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof align_c));

      cublasLtMatmulHeuristicResult_t results[kInvariantCandidates] = {};
      cublasLtMatmulHeuristicResult_t& result = results[0];
      const int wanted = g.whole_k ? kInvariantCandidates : 1;
      int found = 0;
      pick.bias_epilogue = g.bias != nullptr;
      what = "cublasLtMatmulAlgoGetHeuristic";
      st = cublasLtMatmulAlgoGetHeuristic(handle, lt.desc, lt.a, lt.b, lt.c, lt.c, lt.pref, wanted,
                                          results, &found);
      if (g.bias && (st == CUBLAS_STATUS_NOT_SUPPORTED ||
                     (st == CUBLAS_STATUS_SUCCESS && found == 0))) {
        // No kernel fuses the bias here: plain GEMM, the caller adds the bias.
        pick.bias_epilogue = false;
        FCE_LT(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                              &epi_default, sizeof epi_default));
        what = "cublasLtMatmulAlgoGetHeuristic (without the bias epilogue)";
        st = cublasLtMatmulAlgoGetHeuristic(handle, lt.desc, lt.a, lt.b, lt.c, lt.c, lt.pref,
                                            wanted, results, &found);
      }
      if (st == CUBLAS_STATUS_SUCCESS && g.whole_k) {
        const int i = first_whole_k(results, found);
        if (i < 0 && !unsplit_candidate(handle, lt.desc, lt.a, lt.b, lt.c, results, found,
                                        ws_bytes, &result))
          return fail(FCE_ERROR_UNSUPPORTED,
                      "%s: options->batch_invariant: GEMM %s (row-major [%lld x %lld], K %lld): "
                      "none of cuBLASLt's first %d algorithms computes K without a split, even "
                      "when asked to",
                      g.fn, g.name, (long long)g.M, (long long)g.N, (long long)g.K, found);
        if (i > 0) result = results[i];
      }
      if (st == CUBLAS_STATUS_SUCCESS && (found == 0 || result.state != CUBLAS_STATUS_SUCCESS))
        st = CUBLAS_STATUS_NOT_SUPPORTED;
      if (st != CUBLAS_STATUS_SUCCESS) goto lt_error;
      pick.algo = result.algo;
      std::lock_guard<std::mutex> lock(g_mutex);
      if (g_algos.size() >= kMaxCachedAlgos) g_algos.clear();
      g_algos.emplace(key, pick);
    } else if (g.bias && !pick.bias_epilogue) {
      FCE_LT(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi_default,
                                            sizeof epi_default));
    }

    // beta == 0: cuBLASLt does not read C. C and D are the same matrix (same layout).
    FCE_LT(cublasLtMatmul(handle, lt.desc, &g.alpha, first_ptr, lt.a, second_ptr, lt.b, &g.beta,
                          g.C, lt.c, g.C, lt.c, &pick.algo, g.workspace, ws_bytes, s));
    if (bias_applied) *bias_applied = pick.bias_epilogue;
    return FCE_SUCCESS;
  }
#undef FCE_LT
lt_error:
  return fail(FCE_ERROR_CUBLAS,
              "%s: GEMM %s (row-major [%lld x %lld] = [%lld x %lld]%s · %s, %s -> %s): "
              "%s failed: %s (%s)",
              g.fn, g.name, (long long)g.M, (long long)g.N, (long long)g.M, (long long)g.K,
              g.trans_a ? "(Aᵀ)" : "", g.trans_b ? "Bᵀ" : "B", dtype_name(g.ab_dtype),
              dtype_name(g.c_dtype), what, cublasLtGetStatusName(st),
              cublasLtGetStatusString(st));
}

}  // namespace cuda
}  // namespace fce
