// fusedce_nccl.cpp — libfusedce_nccl: the vocabulary-parallel calls of libfusedce (fce_vp_*,
// docs/semantics.md rule 16) around NCCL's all-gather of the statistics and all-reduce of dloss/dh,
// one entry point per step (include/fusedce_nccl.h).
//
// Every call: check everything (options, sizes, communicator, device, pointers, overlaps,
// workspace) on the host, then enqueue on the caller's stream, in this order,
//   phase 1 (fce_vp_stats / fce_vp_linear_stats) into this rank's slot of the gathered buffer,
//   ncclAllGather in place (sendbuff = recvbuff + rank · count, NCCL's in-place form),
//   [the gradient: fce_vp_backward], fce_vp_loss;
// fce_nccl_linear_ce with a gradient: fce_vp_linear_ce (its all-gathers through ncclAllGather,
// one per token chunk; ∂h partial in float32), ncclAllReduce (sum, float32) of ∂h in place, the
// conversion to the dtype.
// Nothing allocates, nothing synchronises the host; the communicator queries are host-only.
#include <nccl.h>

#include <cuda_runtime_api.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>

#include "convert.h"
#include "fusedce_nccl.h"

namespace {

thread_local char g_last_error[1024] = "";

fce_status fail(fce_status status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
fce_status fail(fce_status status, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(g_last_error, sizeof g_last_error, fmt, args);
  va_end(args);
  return status;
}

#define FCE_NCCL_TRY(expr)                     \
  do {                                         \
    const fce_status fce_nccl_s_ = (expr);     \
    if (fce_nccl_s_ != FCE_SUCCESS) return fce_nccl_s_; \
  } while (0)

// A libfusedce call: on failure its own message (which names the fce_* function), prefixed.
#define FCE_NCCL_CORE(fn, expr)                                              \
  do {                                                                       \
    const fce_status fce_nccl_s_ = (expr);                                   \
    if (fce_nccl_s_ != FCE_SUCCESS)                                          \
      return fail(fce_nccl_s_, "%s: %s", fn, fce_last_error());              \
  } while (0)

// A libfusedce workspace query made to size this library's call fn (its own query, or the
// call itself): on failure the query's message, which is about the options and sizes it checks
// as the compute calls do, under fn's name alone ("fce_nccl_cross_entropy: options->
// label_smoothing (2) must be in [0, 1)"), not the query's, which the caller did not call.
fce_status query_fail(const char* fn, const char* query, fce_status status) {
  const char* m = fce_last_error();
  const size_t n = std::strlen(query);
  if (std::strncmp(m, query, n) == 0 && std::strncmp(m + n, ": ", 2) == 0) m += n + 2;
  return fail(status, "%s: %s", fn, m);
}
#define FCE_NCCL_QUERY(fn, query, ...)                                          \
  do {                                                                         \
    const fce_status fce_nccl_s_ = query(__VA_ARGS__);                         \
    if (fce_nccl_s_ != FCE_SUCCESS) return query_fail(fn, #query, fce_nccl_s_); \
  } while (0)

// An NCCL call that did not return ncclSuccess: FCE_ERROR_CUDA (fusedce_nccl.h).
fce_status nccl_fail(const char* fn, const char* what, ncclResult_t r, ncclComm_t comm) {
  const char* detail = ncclGetLastError(comm);
  const bool has_detail = detail && *detail;
  return fail(FCE_ERROR_CUDA, "%s: %s returned %d (%s)%s%s%s", fn, what, static_cast<int>(r),
              ncclGetErrorString(r), has_detail ? ": \"" : "", has_detail ? detail : "",
              has_detail ? "\"" : "");
}

constexpr int64_t kMaxBytes = std::numeric_limits<int64_t>::max() / 2;
constexpr int64_t kMaxVocab = std::numeric_limits<int32_t>::max();
constexpr size_t kSliceAlign = 256;  // every workspace slice starts 256 bytes apart (16 needed)

size_t align_up(size_t n) { return (n + kSliceAlign - 1) / kSliceAlign * kSliceAlign; }

size_t elem_size(int dtype) {
  switch (dtype) {
    case FCE_FLOAT32: return 4;
    case FCE_FLOAT16: return 2;
    case FCE_BFLOAT16: return 2;
    case FCE_INT32: return 4;
    case FCE_INT64: return 8;
    default: return 0;
  }
}

// The caller's options as this library's struct (defaults past the caller's struct_size), for
// the fields this library reads itself; the libfusedce calls get the caller's pointer and do
// their own checks (struct_size included).
fce_status read_options(const char* fn, const fce_options* o, fce_options* local) {
  if (!o) return fail(FCE_ERROR_NULL_POINTER, "%s: options is NULL", fn);
  const size_t size = o->struct_size;
  if (size < FCE_OPTIONS_SIZE_V1_0 || size > sizeof(fce_options))
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->struct_size (%zu) is not the size of any version of fce_options "
                "(%d to %zu): initialise it with FCE_OPTIONS_INIT or fce_options_default()",
                fn, size, FCE_OPTIONS_SIZE_V1_0, sizeof(fce_options));
  const fce_options defaults = FCE_OPTIONS_INIT;
  *local = defaults;
  std::memcpy(static_cast<void*>(local), o, size);
  return FCE_SUCCESS;
}

// The caller's fce_outputs / fce_gradients (NULL: all absent) as this library's struct, for the
// pointers this library checks and passes on; the libfusedce calls check the rest.
template <class T>
fce_status read_versioned(const char* fn, const char* name, const T* in, size_t v1_0,
                          const T& defaults, T* local) {
  *local = defaults;
  if (!in) return FCE_SUCCESS;
  if (in->struct_size != v1_0)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: %s->struct_size (%zu) is not the size of any version (%zu in 1.0): "
                "initialise it with its _INIT macro",
                fn, name, in->struct_size, v1_0);
  std::memcpy(static_cast<void*>(local), in, in->struct_size);
  return FCE_SUCCESS;
}

fce_status check_shard_ranks(const char* fn, const fce_vp_shard* shard, int ranks) {
  if (shard->ranks != ranks)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: shard->ranks (%lld) is not the communicator's number of ranks (%d)", fn,
                (long long)shard->ranks, ranks);
  return FCE_SUCCESS;
}

// grad_lse / grad_entropy (docs/semantics.md rule 18) need a gradient to add them to: refused
// without one (as fce_forward and fce_vp_linear_ce refuse them), never silently dropped.
fce_status check_row_grads(const char* fn, const fce_gradients& g, bool with_grad,
                           const char* none) {
  if (with_grad || (!g.grad_lse && !g.grad_entropy)) return FCE_SUCCESS;
  return fail(FCE_ERROR_INVALID_ARGUMENT,
              "%s: gradients->%s is given but %s NULL: no gradient to "
              "add it to",
              fn, g.grad_lse ? "grad_lse" : "grad_entropy", none);
}

fce_status read_structs(const char* fn, const fce_vp_shard* shard, int ranks,
                        const fce_outputs* outputs, const fce_gradients* gradients,
                        fce_outputs* out, fce_gradients* g) {
  FCE_NCCL_TRY(check_shard_ranks(fn, shard, ranks));
  if (!outputs) return fail(FCE_ERROR_NULL_POINTER, "%s: outputs is NULL (the loss is required)", fn);
  const fce_outputs out0 = FCE_OUTPUTS_INIT;
  const fce_gradients g0 = FCE_GRADIENTS_INIT;
  const fce_status st = read_versioned(fn, "outputs", outputs, FCE_OUTPUTS_SIZE_V1_0, out0, out);
  if (st != FCE_SUCCESS) return st;
  return read_versioned(fn, "gradients", gradients, FCE_GRADIENTS_SIZE_V1_0, g0, g);
}

// The all-gather of a shard made by fce_nccl_shard (fce_vp_all_gather_fn): ncclAllGather on
// the communicator the shard carries as its context, on the call's stream. NCCL's result is kept
// (per thread) for the message of the fce_nccl_* call that ran it.
thread_local ncclResult_t g_gather_result = ncclSuccess;
fce_status nccl_all_gather(void* context, const float* send, float* recv, int64_t count,
                           void* stream) {
  g_gather_result = ncclAllGather(send, recv, static_cast<size_t>(count), ncclFloat32,
                                  static_cast<ncclComm_t>(context),
                                  static_cast<cudaStream_t>(stream));
  if (g_gather_result == ncclSuccess) return FCE_SUCCESS;
  fail(FCE_ERROR_CUDA, "ncclAllGather returned %d (%s)", static_cast<int>(g_gather_result),
       ncclGetErrorString(g_gather_result));
  return FCE_ERROR_CUDA;
}

// The communicator of a shard made by fce_nccl_shard (its context).
fce_status shard_comm(const char* fn, const fce_vp_shard* shard, ncclComm_t* comm) {
  if (!shard) return fail(FCE_ERROR_NULL_POINTER, "%s: shard is NULL", fn);
  if (shard->all_gather != nccl_all_gather)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: shard->all_gather is not fusedce_nccl's: make the shard with fce_nccl_shard, "
                "which puts the communicator in it",
                fn);
  *comm = static_cast<ncclComm_t>(shard->context);
  return FCE_SUCCESS;
}

struct CommInfo {
  int ranks = 0, rank = 0, device = -1;
};

// Options, backend and communicator: what the workspace queries check (full = the compute
// calls: also the rank, the device and a pending asynchronous error).
fce_status check_common(const char* fn, const fce_options* options, const fce_vp_shard* shard,
                        bool full, fce_options* o, CommInfo* ci, ncclComm_t* comm_out) {
  FCE_NCCL_TRY(read_options(fn, options, o));
  if (o->target_dtype == FCE_FLOAT32 || o->target_dtype == FCE_FLOAT16 ||
      o->target_dtype == FCE_BFLOAT16)
    return fail(FCE_ERROR_UNSUPPORTED,
                "%s: options->target_dtype (%d) gives class probabilities, which fusedce_nccl "
                "does not support (its vocabulary-parallel calls take class indices)",
                fn, o->target_dtype);
  if (o->backend == FCE_BACKEND_CPU)
    return fail(FCE_ERROR_UNSUPPORTED,
                "%s: options->backend is FCE_BACKEND_CPU: fusedce_nccl runs NCCL collectives on "
                "device memory, FCE_BACKEND_CUDA only",
                fn);
  if (o->backend != FCE_BACKEND_CUDA)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->backend (%d) is not an fce_backend (fusedce_nccl: FCE_BACKEND_CUDA)",
                fn, o->backend);
  ncclComm_t comm = nullptr;
  FCE_NCCL_TRY(shard_comm(fn, shard, &comm));
  *comm_out = comm;
  if (!comm)
    return fail(FCE_ERROR_NULL_POINTER, "%s: shard->context (the communicator) is NULL", fn);
  ncclResult_t r = ncclCommCount(comm, &ci->ranks);
  if (r != ncclSuccess) return nccl_fail(fn, "ncclCommCount(comm)", r, comm);
  if (ci->ranks < 1)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: comm has %d ranks", fn, ci->ranks);
  if (!full) return FCE_SUCCESS;
  r = ncclCommUserRank(comm, &ci->rank);
  if (r != ncclSuccess) return nccl_fail(fn, "ncclCommUserRank(comm)", r, comm);
  if (ci->rank < 0 || ci->rank >= ci->ranks)
    return fail(FCE_ERROR_INTERNAL, "%s: ncclCommUserRank gave rank %d of %d", fn, ci->rank,
                ci->ranks);
  ncclResult_t async = ncclSuccess;
  r = ncclCommGetAsyncError(comm, &async);
  if (r != ncclSuccess) return nccl_fail(fn, "ncclCommGetAsyncError(comm)", r, comm);
  if (async != ncclSuccess)
    return nccl_fail(fn, "comm (ncclCommGetAsyncError: a pending asynchronous error)", async,
                     comm);
  r = ncclCommCuDevice(comm, &ci->device);
  if (r != ncclSuccess) return nccl_fail(fn, "ncclCommCuDevice(comm)", r, comm);
  int current = -1;
  const cudaError_t e = cudaGetDevice(&current);
  if (e != cudaSuccess)
    return fail(FCE_ERROR_CUDA, "%s: cudaGetDevice: %s", fn, cudaGetErrorString(e));
  if (current != ci->device)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: comm belongs to CUDA device %d but the calling thread's current device is "
                "%d (cudaSetDevice(%d) before the call)",
                fn, ci->device, current, ci->device);
  return FCE_SUCCESS;
}

// rows, the shard and the gathered statistics' size (P · rows · FCE_VP_STATS float32).
fce_status check_sizes(const char* fn, int64_t rows, int64_t vocab_total, int64_t vocab_start,
                       int64_t vocab_local, bool with_start, int ranks, size_t* gathered_bytes) {
  if (rows < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: rows (%lld) must be >= 0", fn, (long long)rows);
  if (vocab_total < 1 || vocab_total > kMaxVocab)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: vocab_total (%lld) must be in [1, 2^31-1]", fn,
                (long long)vocab_total);
  if (vocab_local < 1 || vocab_local > vocab_total)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: vocab_local (%lld) must be in [1, vocab_total "
                "(%lld)]", fn, (long long)vocab_local, (long long)vocab_total);
  if (with_start && (vocab_start < 0 || vocab_start > vocab_total - vocab_local))
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: vocab_start (%lld) + vocab_local (%lld) must lie in [0, vocab_total (%lld)]",
                fn, (long long)vocab_start, (long long)vocab_local, (long long)vocab_total);
  const int64_t per_rank = static_cast<int64_t>(FCE_VP_STATS * sizeof(float));
  if (rows > kMaxBytes / per_rank / ranks)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: rows (%lld) x %d ranks of statistics overflow the workspace", fn,
                (long long)rows, ranks);
  *gathered_bytes = static_cast<size_t>(rows * per_rank * ranks);
  return FCE_SUCCESS;
}

// Bytes spanned by rows of cols elements stride apart; -1 on overflow.
int64_t span_bytes(int64_t rows, int64_t cols, int64_t stride, size_t elem) {
  if (rows <= 0 || cols <= 0) return 0;
  const int64_t max_elems = kMaxBytes / static_cast<int64_t>(elem);
  if (stride < cols) stride = cols;
  if (rows - 1 > (max_elems - cols) / stride) return -1;
  return ((rows - 1) * stride + cols) * static_cast<int64_t>(elem);
}

// One buffer of the call, for the alignment and overlap checks.
struct Range {
  const char* name;
  const void* ptr;
  uint64_t bytes;
  bool output;
  size_t align;
};

fce_status check_ranges(const char* fn, const Range* r, int n, int in_place_a, int in_place_b) {
  for (int i = 0; i < n; ++i)
    if (r[i].ptr && reinterpret_cast<uintptr_t>(r[i].ptr) % r[i].align != 0)
      return fail(FCE_ERROR_MISALIGNED, "%s: %s (%p) is not aligned to %zu bytes", fn,
                  r[i].name, r[i].ptr, r[i].align);
  for (int i = 0; i < n; ++i) {
    for (int j = i + 1; j < n; ++j) {
      if (!(r[i].output || r[j].output)) continue;
      if (!r[i].ptr || !r[j].ptr || r[i].bytes == 0 || r[j].bytes == 0) continue;
      const uintptr_t a = reinterpret_cast<uintptr_t>(r[i].ptr);
      const uintptr_t b = reinterpret_cast<uintptr_t>(r[j].ptr);
      if (!(a < b + r[j].bytes && b < a + r[i].bytes)) continue;
      if ((i == in_place_a && j == in_place_b) || (i == in_place_b && j == in_place_a)) {
        if (a == b) continue;  // in place: the same start (and, checked before, stride)
      }
      return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: %s overlaps %s", fn, r[i].name, r[j].name);
    }
  }
  return FCE_SUCCESS;
}

// The upstream gradient (when a gradient is asked for) and the outputs loss, lse, z_loss and
// error_flags: five entries from r on.
void loss_ranges(const fce_options& o, const fce_outputs& out, int64_t rows,
                 const float* grad_output, Range* r) {
  const bool per_row = o.reduction == FCE_REDUCTION_NONE;
  const uint64_t rows4 = static_cast<uint64_t>(rows) * 4;
  r[0] = {"gradients->grad_output", grad_output, per_row ? rows4 : 4, false, 4};
  r[1] = {"outputs->loss", out.loss, per_row ? rows4 : 4, true, 4};
  r[2] = {"outputs->lse", out.lse, rows4, true, 4};
  r[3] = {"outputs->z_loss", out.z_loss, 4, true, 4};
  r[4] = {"outputs->error_flags", out.error_flags, 4, true, 4};
}

// The optional forward outputs outputs->argmax and ->accuracy.
void forward_output_ranges(const fce_options& o, const fce_outputs& out, int64_t rows,
                           Range* argmax, Range* accuracy) {
  const bool per_row = o.reduction == FCE_REDUCTION_NONE;
  *argmax = {"outputs->argmax", out.argmax, static_cast<uint64_t>(rows) * 8, true, 8};
  *accuracy = {"outputs->accuracy", out.accuracy,
               per_row ? static_cast<uint64_t>(rows) * 4 : 4, true, 4};
}

fce_status check_workspace(const char* fn, const void* workspace, size_t workspace_bytes,
                           size_t needed) {
  if (workspace_bytes < needed)
    return fail(FCE_ERROR_WORKSPACE_TOO_SMALL,
                "%s: workspace_bytes (%zu) is less than the %zu bytes the matching "
                "*_workspace_size query returns for these options, communicator and sizes",
                fn, workspace_bytes, needed);
  if (needed > 0 && !workspace) return fail(FCE_ERROR_NULL_POINTER, "%s: workspace is NULL", fn);
  if (reinterpret_cast<uintptr_t>(workspace) % 16 != 0)
    return fail(FCE_ERROR_MISALIGNED, "%s: workspace (%p) is not aligned to 16 bytes", fn,
                workspace);
  return FCE_SUCCESS;
}

// ---- cross-entropy: [gathered | scratch]
struct CeLayout {
  size_t gathered = 0;  // bytes of [P, rows, FCE_VP_STATS]
  size_t scratch_off = 0, scratch = 0;
  size_t total() const { return scratch_off + scratch; }
};

fce_status ce_layout(const char* fn, const fce_options* options, int ranks, int64_t rows,
                     int64_t vocab_total, int64_t vocab_local, bool with_grad,
                     size_t gathered_bytes, CeLayout* l) {
  size_t loss_ws = 0, bw_ws = 0;
  FCE_NCCL_QUERY(fn, fce_vp_loss_workspace_size, options, ranks, rows, vocab_total, &loss_ws);
  if (with_grad)
    FCE_NCCL_QUERY(fn, fce_vp_backward_workspace_size, options, ranks, rows, vocab_total,
                   vocab_local, &bw_ws);
  l->gathered = gathered_bytes;
  l->scratch_off = align_up(gathered_bytes);
  l->scratch = loss_ws > bw_ws ? loss_ws : bw_ws;
  return FCE_SUCCESS;
}

// ---- linear CE: [gathered | float32 ∂h (16-bit dtype with grad_hidden) | scratch]
struct LinLayout {
  size_t gathered = 0;
  size_t gh_off = 0, gh = 0;
  size_t scratch_off = 0, scratch_min = 0, scratch_opt = 0;
  size_t min_total() const { return scratch_off + scratch_min; }
  size_t opt_total() const { return scratch_off + scratch_opt; }
};

fce_status lin_layout(const char* fn, const fce_options* options, const fce_options& o,
                      int ranks, int64_t rows, int64_t hidden, int64_t vocab_total,
                      int64_t vocab_local, bool with_grad, bool f32_grad_hidden_buffer,
                      size_t gathered_bytes, LinLayout* l) {
  if (hidden < 1)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: hidden (%lld) must be >= 1", fn,
                (long long)hidden);
  size_t st_min = 0, st_opt = 0, loss_ws = 0, fu_min = 0, fu_opt = 0;
  if (with_grad) {  // fce_vp_linear_ce: the statistics live in its own workspace
    FCE_NCCL_QUERY(fn, fce_vp_linear_ce_workspace_size, options, ranks, rows, hidden,
                   vocab_total, vocab_local, 1, FCE_FLOAT32, &fu_min, &fu_opt);
    gathered_bytes = 0;
  } else {
    FCE_NCCL_QUERY(fn, fce_vp_linear_stats_workspace_size, options, rows, hidden, vocab_local,
                   &st_min, &st_opt);
    FCE_NCCL_QUERY(fn, fce_vp_loss_workspace_size, options, ranks, rows, vocab_total, &loss_ws);
  }
  l->gathered = gathered_bytes;
  l->gh_off = align_up(gathered_bytes);
  l->gh = 0;
  if (f32_grad_hidden_buffer && o.dtype != FCE_FLOAT32) {
    if (rows > kMaxBytes / 4 / hidden)
      return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: rows (%lld) x hidden (%lld) overflow", fn,
                  (long long)rows, (long long)hidden);
    l->gh = static_cast<size_t>(rows * hidden * 4);
  }
  l->scratch_off = l->gh_off + align_up(l->gh);
  auto mx = [](size_t a, size_t b) { return a > b ? a : b; };
  l->scratch_min = mx(mx(st_min, loss_ws), fu_min);
  l->scratch_opt = mx(mx(mx(st_opt, st_min), loss_ws), mx(fu_opt, fu_min));
  return FCE_SUCCESS;
}

}  // namespace

extern "C" {

FCE_API unsigned fce_nccl_version(void) { return FCE_VERSION_NUMBER; }

FCE_API const char* fce_nccl_last_error(void) { return g_last_error; }

FCE_API const char* fce_nccl_build_info(void) {
  static const std::string info = [] {
    char line[160];
    int v = 0;
    char runtime[48] = "unknown";
    if (ncclGetVersion(&v) == ncclSuccess) {
      // NCCL_VERSION(X, Y, Z): X*10000 + Y*100 + Z since 2.9 (X*1000 + Y*100 + Z before)
      if (v >= 20900)
        std::snprintf(runtime, sizeof runtime, "%d.%d.%d", v / 10000, v / 100 % 100, v % 100);
      else
        std::snprintf(runtime, sizeof runtime, "%d.%d.%d", v / 1000, v / 100 % 10, v % 100);
    }
    std::snprintf(line, sizeof line, "fusedce_nccl %d.%d.%d; NCCL %s (built with %d.%d.%d); ",
                  FCE_VERSION_MAJOR, FCE_VERSION_MINOR, FCE_VERSION_PATCH, runtime, NCCL_MAJOR,
                  NCCL_MINOR, NCCL_PATCH);
    return std::string(line) + fce_build_info();
  }();
  return info.c_str();
}

FCE_API fce_status fce_nccl_shard(ncclComm_t comm, int64_t vocab_total, int64_t vocab_start,
                                  int64_t vocab_local, fce_vp_shard* shard) {
  const char* fn = "fce_nccl_shard";
  g_last_error[0] = '\0';
  if (!shard) return fail(FCE_ERROR_NULL_POINTER, "%s: shard is NULL", fn);
  if (!comm) return fail(FCE_ERROR_NULL_POINTER, "%s: comm is NULL", fn);
  int ranks = 0;
  const ncclResult_t r = ncclCommCount(comm, &ranks);
  if (r != ncclSuccess) return nccl_fail(fn, "ncclCommCount(comm)", r, comm);
  if (ranks < 1) return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: comm has %d ranks", fn, ranks);
  size_t gathered = 0;
  FCE_NCCL_TRY(check_sizes(fn, 0, vocab_total, vocab_start, vocab_local, true, ranks, &gathered));
  shard->ranks = ranks;
  shard->vocab_total = vocab_total;
  shard->vocab_start = vocab_start;
  shard->vocab_local = vocab_local;
  shard->all_gather = nccl_all_gather;
  shard->context = comm;
  return FCE_SUCCESS;
}

FCE_API fce_status fce_nccl_cross_entropy_workspace_size(const fce_options* options,
                                                         const fce_vp_shard* shard, int64_t rows,
                                                         int with_grad, size_t* workspace_bytes) {
  const char* fn = "fce_nccl_cross_entropy_workspace_size";
  g_last_error[0] = '\0';
  if (!workspace_bytes) return fail(FCE_ERROR_NULL_POINTER, "%s: workspace_bytes is NULL", fn);
  fce_options o;
  CommInfo ci;
  ncclComm_t comm = nullptr;
  FCE_NCCL_TRY(check_common(fn, options, shard, false, &o, &ci, &comm));
  FCE_NCCL_TRY(check_shard_ranks(fn, shard, ci.ranks));
  const int64_t vocab_total = shard->vocab_total, vocab_local = shard->vocab_local;
  size_t gathered = 0;
  FCE_NCCL_TRY(check_sizes(fn, rows, vocab_total, 0, vocab_local, false, ci.ranks, &gathered));
  CeLayout l;
  FCE_NCCL_TRY(ce_layout(fn, options, ci.ranks, rows, vocab_total, vocab_local, with_grad != 0,
                         gathered, &l));
  *workspace_bytes = l.total();
  return FCE_SUCCESS;
}

FCE_API fce_status fce_nccl_cross_entropy(const fce_options* options, const fce_vp_shard* shard,
                                          int64_t rows, const void* logits, const void* targets,
                                          const fce_outputs* outputs,
                                          const fce_gradients* gradients, void* workspace,
                                          size_t workspace_bytes, void* stream) {
  const char* fn = "fce_nccl_cross_entropy";
  g_last_error[0] = '\0';
  fce_options o;
  CommInfo ci;
  ncclComm_t comm = nullptr;
  FCE_NCCL_TRY(check_common(fn, options, shard, true, &o, &ci, &comm));
  fce_outputs out;
  fce_gradients gr;
  FCE_NCCL_TRY(read_structs(fn, shard, ci.ranks, outputs, gradients, &out, &gr));
  const int64_t vocab_total = shard->vocab_total, vocab_start = shard->vocab_start,
                vocab_local = shard->vocab_local;
  float* loss = out.loss;
  void* grad_logits = gr.grad_logits;
  const float* grad_output = gr.grad_output;
  size_t gathered_bytes = 0;
  FCE_NCCL_TRY(check_sizes(fn, rows, vocab_total, vocab_start, vocab_local, true, ci.ranks,
                           &gathered_bytes));
  const bool with_grad = grad_logits != nullptr;
  FCE_NCCL_TRY(check_row_grads(fn, gr, with_grad, "gradients->grad_logits is"));
  CeLayout l;
  FCE_NCCL_TRY(ce_layout(fn, options, ci.ranks, rows, vocab_total, vocab_local, with_grad,
                         gathered_bytes, &l));
  // The options are valid now (the libfusedce queries checked them): sizes of the buffers.
  // With no row (the empty problem) a per-row buffer of no element may be NULL.
  const bool per_row = o.reduction == FCE_REDUCTION_NONE, empty = rows == 0;
  if (!logits && !empty) return fail(FCE_ERROR_NULL_POINTER, "%s: logits is NULL", fn);
  if (!targets && !empty) return fail(FCE_ERROR_NULL_POINTER, "%s: targets is NULL", fn);
  if (!loss && !(empty && per_row))
    return fail(FCE_ERROR_NULL_POINTER, "%s: outputs->loss is NULL", fn);
  const size_t es = elem_size(o.dtype), ts = elem_size(o.target_dtype);
  const int64_t rs = o.row_stride ? o.row_stride : vocab_local;
  const int64_t grs = o.grad_row_stride ? o.grad_row_stride : vocab_local;
  if (rs < vocab_local)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->row_stride (%lld) is less than vocab_local (%lld)", fn,
                (long long)rs, (long long)vocab_local);
  if (with_grad && grs < vocab_local)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->grad_row_stride (%lld) is less than vocab_local (%lld)", fn,
                (long long)grs, (long long)vocab_local);
  if (with_grad && grad_logits == logits && grs != rs)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: gradients->grad_logits is logits (in place) but options->grad_row_stride (%lld) is not "
                "options->row_stride (%lld)",
                fn, (long long)grs, (long long)rs);
  const int64_t logits_bytes = span_bytes(rows, vocab_local, rs, es);
  const int64_t grad_bytes = with_grad ? span_bytes(rows, vocab_local, grs, es) : 0;
  if (logits_bytes < 0 || grad_bytes < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: rows x row stride overflow", fn);
  Range r[12] = {
      {"logits", logits, static_cast<uint64_t>(logits_bytes), false, es},
      {"gradients->grad_logits", grad_logits, static_cast<uint64_t>(grad_bytes), true, es},
      {"targets", targets, static_cast<uint64_t>(rows) * ts, false, ts},
      {"options->class_weights", o.class_weights, static_cast<uint64_t>(vocab_total) * 4, false,
       4},
      {},  // grad_output, then outputs->loss, ->lse, ->z_loss, ->error_flags: loss_ranges
      {},
      {},
      {},
      {},
      {"workspace", workspace, workspace_bytes, true, 16},
      {},
      {},
  };
  loss_ranges(o, out, rows, with_grad ? grad_output : nullptr, &r[4]);
  forward_output_ranges(o, out, rows, &r[10], &r[11]);
  FCE_NCCL_TRY(check_workspace(fn, workspace, workspace_bytes, l.total()));
  FCE_NCCL_TRY(check_ranges(fn, r, 12, 0, 1));

  // ---- enqueue
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  float* gathered = reinterpret_cast<float*>(workspace);
  const size_t count = static_cast<size_t>(rows) * FCE_VP_STATS;
  float* stats = gathered + static_cast<size_t>(ci.rank) * count;
  void* scratch = static_cast<char*>(workspace) + l.scratch_off;
  const size_t scratch_bytes = workspace_bytes - l.scratch_off;
  FCE_NCCL_CORE(fn, fce_vp_stats(options, shard, rows, logits, targets, stats, stream));
  if (count > 0) {  // (no row: nothing to gather, on every rank alike)
    const ncclResult_t nr = ncclAllGather(stats, gathered, count, ncclFloat32, comm, s);
    if (nr != ncclSuccess) return nccl_fail(fn, "ncclAllGather (statistics)", nr, comm);
  }
  if (with_grad)  // (its error flags are fce_vp_loss's, below)
    FCE_NCCL_CORE(fn, fce_vp_backward(options, shard, rows, logits, targets, gathered, &gr,
                                      scratch, scratch_bytes, stream));
  FCE_NCCL_CORE(fn, fce_vp_loss(options, shard, rows, targets, gathered, &out, scratch,
                                scratch_bytes, stream));
  return FCE_SUCCESS;
}

FCE_API fce_status fce_nccl_linear_ce_workspace_size(const fce_options* options,
                                                     const fce_vp_shard* shard, int64_t rows,
                                                     int64_t hidden, int with_grad,
                                                     size_t* min_bytes, size_t* optimal_bytes) {
  const char* fn = "fce_nccl_linear_ce_workspace_size";
  g_last_error[0] = '\0';
  if (!min_bytes) return fail(FCE_ERROR_NULL_POINTER, "%s: min_bytes is NULL", fn);
  fce_options o;
  CommInfo ci;
  ncclComm_t comm = nullptr;
  FCE_NCCL_TRY(check_common(fn, options, shard, false, &o, &ci, &comm));
  FCE_NCCL_TRY(check_shard_ranks(fn, shard, ci.ranks));
  const int64_t vocab_total = shard->vocab_total, vocab_local = shard->vocab_local;
  size_t gathered = 0;
  FCE_NCCL_TRY(check_sizes(fn, rows, vocab_total, 0, vocab_local, false, ci.ranks, &gathered));
  LinLayout l;
  FCE_NCCL_TRY(lin_layout(fn, options, o, ci.ranks, rows, hidden, vocab_total, vocab_local,
                          with_grad != 0, with_grad != 0, gathered, &l));
  *min_bytes = l.min_total();
  if (optimal_bytes) *optimal_bytes = l.opt_total();
  return FCE_SUCCESS;
}

FCE_API fce_status fce_nccl_linear_ce(const fce_options* options, const fce_vp_shard* shard,
                                      int64_t rows, int64_t hidden, const void* hidden_states,
                                      const void* weight, const void* bias, const void* targets,
                                      const fce_outputs* outputs, const fce_gradients* gradients,
                                      void* workspace, size_t workspace_bytes, void* stream) {
  const char* fn = "fce_nccl_linear_ce";
  g_last_error[0] = '\0';
  fce_options o;
  CommInfo ci;
  ncclComm_t comm = nullptr;
  FCE_NCCL_TRY(check_common(fn, options, shard, true, &o, &ci, &comm));
  fce_outputs out;
  fce_gradients gr;
  FCE_NCCL_TRY(read_structs(fn, shard, ci.ranks, outputs, gradients, &out, &gr));
  if (gr.grad_logits)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: gradients->grad_logits is given, but %s writes only grad_hidden, "
                "grad_weight and grad_bias", fn, fn);
  if (gr.grad_hidden_dtype != FCE_FLOAT32)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: gradients->grad_hidden_dtype (%d) must be FCE_FLOAT32 (the default): "
                "grad_hidden is the full gradient, of options->dtype", fn, gr.grad_hidden_dtype);
  const int64_t vocab_total = shard->vocab_total, vocab_start = shard->vocab_start,
                vocab_local = shard->vocab_local;
  float* loss = out.loss;
  void* grad_hidden = gr.grad_hidden;
  void* grad_weight = gr.grad_weight;
  void* grad_bias = gr.grad_bias;
  const float* grad_output = gr.grad_output;
  size_t gathered_bytes = 0;
  FCE_NCCL_TRY(check_sizes(fn, rows, vocab_total, vocab_start, vocab_local, true, ci.ranks,
                           &gathered_bytes));
  const bool with_grad = grad_hidden || grad_weight || grad_bias;
  FCE_NCCL_TRY(check_row_grads(fn, gr, with_grad,
                               "gradients->grad_hidden, grad_weight and grad_bias are all"));
  LinLayout l;
  FCE_NCCL_TRY(lin_layout(fn, options, o, ci.ranks, rows, hidden, vocab_total, vocab_local,
                          with_grad, grad_hidden != nullptr, gathered_bytes, &l));
  // With no row (the empty problem) a per-row buffer of no element may be NULL.
  const bool per_row = o.reduction == FCE_REDUCTION_NONE, empty = rows == 0;
  if (!hidden_states && !empty)
    return fail(FCE_ERROR_NULL_POINTER, "%s: hidden_states is NULL", fn);
  if (!weight) return fail(FCE_ERROR_NULL_POINTER, "%s: weight is NULL", fn);
  if (!targets && !empty) return fail(FCE_ERROR_NULL_POINTER, "%s: targets is NULL", fn);
  if (!loss && !(empty && per_row))
    return fail(FCE_ERROR_NULL_POINTER, "%s: outputs->loss is NULL", fn);
  if (grad_bias && !bias)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: gradients->grad_bias is given but bias is NULL",
                fn);
  const size_t es = elem_size(o.dtype), ts = elem_size(o.target_dtype);
  const size_t gws = o.grad_weight_fp32 ? 4 : es;
  const int64_t hrs = o.hidden_row_stride ? o.hidden_row_stride : hidden;
  if (hrs < hidden)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: options->hidden_row_stride (%lld) is less than hidden (%lld)", fn,
                (long long)hrs, (long long)hidden);
  const int64_t h_bytes = span_bytes(rows, hidden, rows > 1 ? hrs : hidden, es);
  const int64_t w_bytes = span_bytes(vocab_local, hidden, hidden, es);
  const int64_t gh_bytes = span_bytes(rows, hidden, hidden, es);
  const int64_t gw_bytes = span_bytes(vocab_local, hidden, hidden, gws);
  if (h_bytes < 0 || w_bytes < 0 || gh_bytes < 0 || gw_bytes < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: rows, hidden or vocab_local too large", fn);
  Range r[17] = {
      {"hidden_states", hidden_states, static_cast<uint64_t>(h_bytes), false, es},
      {"weight", weight, static_cast<uint64_t>(w_bytes), false, es},
      {"bias", bias, static_cast<uint64_t>(vocab_local) * es, false, es},
      {"targets", targets, static_cast<uint64_t>(rows) * ts, false, ts},
      {"options->class_weights", o.class_weights, static_cast<uint64_t>(vocab_total) * 4, false,
       4},
      {},  // grad_output, then outputs->loss, ->lse, ->z_loss, ->error_flags: loss_ranges
      {},
      {},
      {},
      {},
      {"gradients->grad_hidden", grad_hidden, static_cast<uint64_t>(gh_bytes), true, es},
      {"gradients->grad_weight", grad_weight, static_cast<uint64_t>(gw_bytes), true, gws},
      {"gradients->grad_bias", grad_bias, static_cast<uint64_t>(vocab_local) * gws, true, gws},
      {"workspace", workspace, workspace_bytes, true, 16},
      {},
      {},
      {},
  };
  loss_ranges(o, out, rows, with_grad ? grad_output : nullptr, &r[5]);
  forward_output_ranges(o, out, rows, &r[14], &r[15]);
  FCE_NCCL_TRY(check_workspace(fn, workspace, workspace_bytes, l.min_total()));
  FCE_NCCL_TRY(check_ranges(fn, r, 16, -1, -1));

  // ---- enqueue
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  char* ws = static_cast<char*>(workspace);
  void* scratch = ws + l.scratch_off;
  const size_t scratch_bytes = workspace_bytes - l.scratch_off;
  if (!with_grad) {  // the loss only: phase 1, the all-gather, the loss
    float* gathered = reinterpret_cast<float*>(ws);
    const size_t count = static_cast<size_t>(rows) * FCE_VP_STATS;
    float* stats = gathered + static_cast<size_t>(ci.rank) * count;
    FCE_NCCL_CORE(fn, fce_vp_linear_stats(options, shard, rows, hidden, hidden_states, weight,
                                          bias, targets, stats, scratch, scratch_bytes, stream));
    if (count > 0) {  // (no row: nothing to gather, on every rank alike)
      const ncclResult_t nr = ncclAllGather(stats, gathered, count, ncclFloat32, comm, s);
      if (nr != ncclSuccess) return nccl_fail(fn, "ncclAllGather (statistics)", nr, comm);
    }
    FCE_NCCL_CORE(fn, fce_vp_loss(options, shard, rows, targets, gathered, &out, scratch,
                                  scratch_bytes, stream));
    return FCE_SUCCESS;
  }
  // This rank's share of ∂h in float32: in grad_hidden itself for a float32 dtype, else in the
  // workspace slice, all-reduced there and rounded once into grad_hidden.
  float* gh32 = nullptr;
  if (grad_hidden)
    gh32 = o.dtype == FCE_FLOAT32 ? static_cast<float*>(grad_hidden)
                                  : reinterpret_cast<float*>(ws + l.gh_off);
  fce_gradients partial = gr;  // this rank's share of dloss/dh, in float32
  partial.grad_hidden = gh32;
  partial.grad_hidden_dtype = FCE_FLOAT32;
  g_gather_result = ncclSuccess;  // the shard's all-gather is nccl_all_gather on comm
  const fce_status st = fce_vp_linear_ce(options, shard, rows, hidden, hidden_states, weight,
                                         bias, targets, &out, &partial, scratch, scratch_bytes,
                                         stream);
  if (g_gather_result != ncclSuccess)
    return nccl_fail(fn, "ncclAllGather (statistics)", g_gather_result, comm);
  FCE_NCCL_CORE(fn, st);
  if (grad_hidden && rows > 0) {  // (no row: no dloss/dh to reduce, on every rank alike)
    const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(hidden);
    const ncclResult_t nr = ncclAllReduce(gh32, gh32, n, ncclFloat32, ncclSum, comm, s);
    if (nr != ncclSuccess) return nccl_fail(fn, "ncclAllReduce (grad_hidden)", nr, comm);
    if (o.dtype != FCE_FLOAT32) {
      const cudaError_t e = fce_nccl::convert_f32(gh32, grad_hidden, o.dtype,
                                                  static_cast<int64_t>(n), s);
      if (e != cudaSuccess)
        return fail(FCE_ERROR_CUDA, "%s: the conversion of grad_hidden to the dtype: %s", fn,
                    cudaGetErrorString(e));
    }
  }
  return FCE_SUCCESS;
}

}  // extern "C"
