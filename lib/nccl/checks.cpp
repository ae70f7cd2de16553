// nccl/checks.cpp — the checks and helpers every libfusedce_nccl call shares (nccl/checks.h).
#include "checks.h"

#include <cuda_runtime_api.h>

#include <cstdarg>
#include <cstdio>
#include <string>

namespace fce_nccl {

thread_local char g_last_error[1024] = "";

char* last_error_buffer() { return g_last_error; }

fce_status fail(fce_status status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
fce_status fail(fce_status status, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(g_last_error, sizeof g_last_error, fmt, args);
  va_end(args);
  return status;
}

// A libfusedce workspace query made to size this library's call fn (its own query, or the
// call itself): on failure the query's message, which is about the options and sizes it checks
// as the compute calls do, under fn's name alone ("fce_nccl_cross_entropy: options->
// label_smoothing (2) must be in [0, 1)"), not the query's, which the caller did not call; the
// query named again in the message ("... is not supported by <query>") becomes fn too.
fce_status query_fail(const char* fn, const char* query, fce_status status) {
  std::string m = fce_last_error();
  const size_t n = std::strlen(query);
  if (m.compare(0, n, query) == 0 && m.compare(n, 2, ": ") == 0) m.erase(0, n + 2);
  for (size_t at = m.find(query); at != std::string::npos; at = m.find(query, at + 1))
    m.replace(at, n, fn);
  return fail(status, "%s: %s", fn, m.c_str());
}

// An NCCL call that did not return ncclSuccess: FCE_ERROR_CUDA (fusedce_nccl.h).
fce_status nccl_fail(const char* fn, const char* what, ncclResult_t r, ncclComm_t comm) {
  const char* detail = ncclGetLastError(comm);
  const bool has_detail = detail && *detail;
  return fail(FCE_ERROR_CUDA, "%s: %s returned %d (%s)%s%s%s", fn, what, static_cast<int>(r),
              ncclGetErrorString(r), has_detail ? ": \"" : "", has_detail ? detail : "",
              has_detail ? "\"" : "");
}

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

int64_t targets_bytes(int target_dtype, int64_t rows, int64_t vocab_local) {
  const int64_t ts = static_cast<int64_t>(elem_size(target_dtype));
  const bool soft =
      target_dtype == FCE_FLOAT32 || target_dtype == FCE_FLOAT16 || target_dtype == FCE_BFLOAT16;
  if (!soft) return rows * ts;  // (rows is checked against kMaxBytes before)
  if (vocab_local > 0 && rows > kMaxBytes / vocab_local / ts) return -1;
  return rows * vocab_local * ts;
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

fce_status check_shard_ranks(const char* fn, const fce_vp_shard* shard, int ranks) {
  if (shard->ranks != ranks)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: shard->ranks (%lld) is not the communicator's number of ranks (%d)", fn,
                (long long)shard->ranks, ranks);
  return FCE_SUCCESS;
}

fce_status check_row_grads(const char* fn, const fce_gradients& g, bool with_grad,
                           const char* none) {
  if (with_grad || (!g.grad_lse && !g.grad_entropy)) return FCE_SUCCESS;
  return fail(FCE_ERROR_INVALID_ARGUMENT,
              "%s: gradients->%s is given but %s NULL: no gradient to add it to", fn,
              g.grad_lse ? "grad_lse" : "grad_entropy", none);
}

fce_status read_structs(const char* fn, const fce_vp_shard* shard, int ranks,
                        const fce_outputs* outputs, const fce_gradients* gradients,
                        fce_outputs* out, fce_gradients* g) {
  FCE_NCCL_TRY(check_shard_ranks(fn, shard, ranks));
  if (!outputs)
    return fail(FCE_ERROR_NULL_POINTER, "%s: outputs is NULL (the loss is required)", fn);
  const fce_outputs out0 = FCE_OUTPUTS_INIT;
  const fce_gradients g0 = FCE_GRADIENTS_INIT;
  const fce_status st = read_versioned(fn, "outputs", outputs, FCE_OUTPUTS_SIZE_V1_0, out0, out);
  if (st != FCE_SUCCESS) return st;
  return read_versioned(fn, "gradients", gradients, FCE_GRADIENTS_SIZE_V1_0, g0, g);
}

// The outputs and gradients a distillation does not write: fce_distill's refusals (its
// statuses, this library's function named).
fce_status refuse_distill_fields(const char* fn, const fce_outputs& out, const fce_gradients& g) {
  const struct {
    const char* name;
    const void* ptr;
    fce_status status;
  } refused[] = {{"outputs->z_loss", out.z_loss, FCE_ERROR_UNSUPPORTED},
                 {"outputs->argmax", out.argmax, FCE_ERROR_UNSUPPORTED},
                 {"outputs->accuracy", out.accuracy, FCE_ERROR_UNSUPPORTED},
                 {"outputs->entropy", out.entropy, FCE_ERROR_UNSUPPORTED},
                 {"gradients->grad_lse", g.grad_lse, FCE_ERROR_UNSUPPORTED},
                 {"gradients->grad_entropy", g.grad_entropy, FCE_ERROR_UNSUPPORTED},
                 {"gradients->grad_hidden", g.grad_hidden, FCE_ERROR_INVALID_ARGUMENT},
                 {"gradients->grad_weight", g.grad_weight, FCE_ERROR_INVALID_ARGUMENT},
                 {"gradients->grad_bias", g.grad_bias, FCE_ERROR_INVALID_ARGUMENT}};
  for (const auto& r : refused)
    if (r.ptr)
      return fail(r.status,
                  "%s: %s is given, but %s writes only outputs->loss, ->lse and ->error_flags "
                  "and gradients->grad_logits (for grad_output)",
                  fn, r.name, fn);
  if (g.grad_hidden_dtype != FCE_FLOAT32)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: gradients->grad_hidden_dtype (%d) must be FCE_FLOAT32 (the default)", fn,
                g.grad_hidden_dtype);
  if (g.reserved0 != 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: gradients->reserved0 (%d) must be 0", fn,
                g.reserved0);
  return FCE_SUCCESS;
}

// The all-gather of a shard made by fce_nccl_shard (fce_vp_all_gather_fn): ncclAllGather on
// the communicator the shard carries as its context, on the call's stream. NCCL's result is kept
// (per thread) for the message of the fce_nccl_* call that ran it.
thread_local ncclResult_t g_gather_result = ncclSuccess;
ncclResult_t last_gather_result() { return g_gather_result; }
void clear_gather_result() { g_gather_result = ncclSuccess; }
fce_status nccl_all_gather(void* context, const float* send, float* recv, int64_t count,
                           void* stream) {
  g_gather_result =
      ncclAllGather(send, recv, static_cast<size_t>(count), ncclFloat32,
                    static_cast<ncclComm_t>(context), static_cast<cudaStream_t>(stream));
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

// The in-place all-gather of the statistics (NCCL's in-place form: sendbuff = recvbuff +
// rank · count).
fce_status gather_stats(const char* fn, float* gathered, int rank, size_t count, ncclComm_t comm,
                        void* stream) {
  if (count == 0) return FCE_SUCCESS;  // (no row: nothing to gather, on every rank alike)
  const float* mine = gathered + static_cast<size_t>(rank) * count;
  const ncclResult_t r =
      ncclAllGather(mine, gathered, count, ncclFloat32, comm, static_cast<cudaStream_t>(stream));
  if (r != ncclSuccess) return nccl_fail(fn, "ncclAllGather (statistics)", r, comm);
  return FCE_SUCCESS;
}

// Options, backend and communicator: what the workspace queries check (full = the compute
// calls: also the rank, the device and a pending asynchronous error).
fce_status check_common(const char* fn, const fce_options* options, const fce_vp_shard* shard,
                        bool full, fce_options* o, CommInfo* ci, ncclComm_t* comm_out) {
  FCE_NCCL_TRY(read_options(fn, options, o));
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
    return nccl_fail(fn, "comm (ncclCommGetAsyncError: a pending asynchronous error)", async, comm);
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

fce_status begin_query(const char* fn, const fce_options* options, const fce_vp_shard* shard,
                       const void* result, const char* result_name, Call* c) {
  last_error_buffer()[0] = '\0';
  if (!result) return fail(FCE_ERROR_NULL_POINTER, "%s: %s is NULL", fn, result_name);
  FCE_NCCL_TRY(check_common(fn, options, shard, false, &c->o, &c->ci, &c->comm));
  return check_shard_ranks(fn, shard, c->ci.ranks);
}

fce_status begin_compute(const char* fn, const fce_options* options, const fce_vp_shard* shard,
                         const fce_outputs* outputs, const fce_gradients* gradients, Call* c) {
  last_error_buffer()[0] = '\0';
  FCE_NCCL_TRY(check_common(fn, options, shard, true, &c->o, &c->ci, &c->comm));
  return read_structs(fn, shard, c->ci.ranks, outputs, gradients, &c->out, &c->g);
}

// rows, the shard and the gathered statistics' size (P · rows · stats_width float32).
fce_status check_sizes(const char* fn, int64_t rows, int64_t vocab_total, int64_t vocab_start,
                       int64_t vocab_local, bool with_start, int ranks, int64_t stats_width,
                       size_t* gathered_bytes) {
  if (rows < 0)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: rows (%lld) must be >= 0", fn, (long long)rows);
  if (vocab_total < 1 || vocab_total > kMaxVocab)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: vocab_total (%lld) must be in [1, 2^31-1]", fn,
                (long long)vocab_total);
  if (vocab_local < 1 || vocab_local > vocab_total)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: vocab_local (%lld) must be in [1, vocab_total "
                "(%lld)]",
                fn, (long long)vocab_local, (long long)vocab_total);
  if (with_start && (vocab_start < 0 || vocab_start > vocab_total - vocab_local))
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: vocab_start (%lld) + vocab_local (%lld) must lie in [0, vocab_total (%lld)]",
                fn, (long long)vocab_start, (long long)vocab_local, (long long)vocab_total);
  const int64_t per_rank = stats_width * static_cast<int64_t>(sizeof(float));
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

fce_status row_stride(const char* fn, const char* name, int64_t stride, int64_t vocab_local,
                      int64_t* out) {
  *out = stride ? stride : vocab_local;
  if (*out < vocab_local)
    return fail(FCE_ERROR_INVALID_ARGUMENT, "%s: %s (%lld) is less than vocab_local (%lld)", fn,
                name, (long long)*out, (long long)vocab_local);
  return FCE_SUCCESS;
}

fce_status logits_strides(const char* fn, const fce_options& o, int64_t vocab_local,
                          const void* logits, const void* grad_logits, int64_t* rs, int64_t* grs) {
  FCE_NCCL_TRY(row_stride(fn, "options->row_stride", o.row_stride, vocab_local, rs));
  *grs = o.grad_row_stride ? o.grad_row_stride : vocab_local;
  if (!grad_logits) return FCE_SUCCESS;
  FCE_NCCL_TRY(row_stride(fn, "options->grad_row_stride", o.grad_row_stride, vocab_local, grs));
  if (grad_logits == logits && *grs != *rs)
    return fail(FCE_ERROR_INVALID_ARGUMENT,
                "%s: gradients->grad_logits is logits (in place) but options->grad_row_stride "
                "(%lld) is not options->row_stride (%lld)",
                fn, (long long)*grs, (long long)*rs);
  return FCE_SUCCESS;
}

fce_status check_ranges(const char* fn, const Range* r, int n, int in_place_a, int in_place_b) {
  for (int i = 0; i < n; ++i)
    if (r[i].ptr && reinterpret_cast<uintptr_t>(r[i].ptr) % r[i].align != 0)
      return fail(FCE_ERROR_MISALIGNED, "%s: %s (%p) is not aligned to %zu bytes", fn, r[i].name,
                  r[i].ptr, r[i].align);
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
  *accuracy = {"outputs->accuracy", out.accuracy, per_row ? static_cast<uint64_t>(rows) * 4 : 4,
               true, 4};
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

}  // namespace fce_nccl
