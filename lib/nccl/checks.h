// nccl/checks.h — what every libfusedce_nccl call shares: its message (fail, per thread),
// reading the caller's versioned structs, the checks of options, communicator, sizes, buffers
// and workspace, and the all-gather that fce_nccl_shard puts in a shard (nccl/checks.cpp).
#pragma once

#include <nccl.h>

#include <cstdint>
#include <cstring>
#include <limits>

#include "fusedce_nccl.h"

namespace fce_nccl {

// The calling thread's message buffer (fce_nccl_last_error).
char* last_error_buffer();
// Sets the calling thread's message (printf format) and returns status.
fce_status fail(fce_status status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

#define FCE_NCCL_TRY(expr)                              \
  do {                                                  \
    const fce_status fce_nccl_s_ = (expr);              \
    if (fce_nccl_s_ != FCE_SUCCESS) return fce_nccl_s_; \
  } while (0)

// A libfusedce call: on failure its own message (which names the fce_* function), prefixed.
#define FCE_NCCL_CORE(fn, expr)                                                               \
  do {                                                                                        \
    const fce_status fce_nccl_s_ = (expr);                                                    \
    if (fce_nccl_s_ != FCE_SUCCESS) return fail(fce_nccl_s_, "%s: %s", fn, fce_last_error()); \
  } while (0)

// A libfusedce workspace query made to size this library's call fn (its own query, or the
// call itself): on failure the query's message under fn's name alone (FCE_NCCL_QUERY).
fce_status query_fail(const char* fn, const char* query, fce_status status);
#define FCE_NCCL_QUERY(fn, query, ...)                                          \
  do {                                                                          \
    const fce_status fce_nccl_s_ = query(__VA_ARGS__);                          \
    if (fce_nccl_s_ != FCE_SUCCESS) return query_fail(fn, #query, fce_nccl_s_); \
  } while (0)

// An NCCL call that did not return ncclSuccess: FCE_ERROR_CUDA (fusedce_nccl.h).
fce_status nccl_fail(const char* fn, const char* what, ncclResult_t r, ncclComm_t comm);

constexpr int64_t kMaxBytes = std::numeric_limits<int64_t>::max() / 2;
constexpr int64_t kMaxVocab = std::numeric_limits<int32_t>::max();
constexpr size_t kSliceAlign = 256;  // every workspace slice starts 256 bytes apart (16 needed)

inline size_t align_up(size_t n) { return (n + kSliceAlign - 1) / kSliceAlign * kSliceAlign; }

// Bytes of one element of an fce_dtype; 0 for an unknown one.
size_t elem_size(int dtype);

// Bytes of a call's targets: y [rows] of class indices, or this rank's shard of class
// probabilities q [rows, vocab_local] (a float target_dtype, docs/semantics.md rule 19); -1 on
// overflow.
int64_t targets_bytes(int target_dtype, int64_t rows, int64_t vocab_local);

// The caller's options as this library's struct (defaults past the caller's struct_size).
fce_status read_options(const char* fn, const fce_options* o, fce_options* local);

// The caller's fce_outputs / fce_gradients (NULL: all absent) as this library's struct, for the
// pointers this library checks and passes on; the libfusedce calls check the rest.
template <class T>
inline fce_status read_versioned(const char* fn, const char* name, const T* in, size_t v1_0,
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

fce_status check_shard_ranks(const char* fn, const fce_vp_shard* shard, int ranks);
// grad_lse / grad_entropy (docs/semantics.md rule 18) need a gradient to add them to: refused
// without one (as fce_forward and fce_vp_linear_ce refuse them), never silently dropped.
fce_status check_row_grads(const char* fn, const fce_gradients& g, bool with_grad,
                           const char* none);
fce_status read_structs(const char* fn, const fce_vp_shard* shard, int ranks,
                        const fce_outputs* outputs, const fce_gradients* gradients,
                        fce_outputs* out, fce_gradients* g);
// The outputs and gradients a distillation does not write (fce_distill's refusals), refused
// before anything is enqueued: the libfusedce calls would refuse them only part-way.
fce_status refuse_distill_fields(const char* fn, const fce_outputs& out, const fce_gradients& g);

// The all-gather fce_nccl_shard puts in a shard (ncclAllGather on the communicator in its
// context), and NCCL's result of its last run on this thread.
fce_status nccl_all_gather(void* context, const float* send, float* recv, int64_t count,
                           void* stream);
ncclResult_t last_gather_result();
void clear_gather_result();
// The communicator of a shard made by fce_nccl_shard.
fce_status shard_comm(const char* fn, const fce_vp_shard* shard, ncclComm_t* comm);
// ncclAllGather, in place on the stream, of every rank's count float32 of statistics in its
// slot of gathered [ranks, count] (this rank's: gathered + rank · count); nothing when count is
// 0 (no row, on every rank alike).
fce_status gather_stats(const char* fn, float* gathered, int rank, size_t count, ncclComm_t comm,
                        void* stream);

struct CommInfo {
  int ranks = 0, rank = 0, device = -1;
};

// Options, backend and communicator: what the workspace queries check (full = the compute
// calls: also the rank, the device and a pending asynchronous error).
fce_status check_common(const char* fn, const fce_options* options, const fce_vp_shard* shard,
                        bool full, fce_options* o, CommInfo* ci, ncclComm_t* comm_out);
// What a call reads first, each checked once (a compute call binds it as
// auto& [o, ci, comm, out, g]; a workspace query reads o and ci).
struct Call {
  fce_options o;
  CommInfo ci;
  ncclComm_t comm = nullptr;
  fce_outputs out;
  fce_gradients g;
};
// A workspace query's start: clears the message, refuses a NULL result (result_name), then
// check_common and the shard's ranks.
fce_status begin_query(const char* fn, const fce_options* options, const fce_vp_shard* shard,
                       const void* result, const char* result_name, Call* c);
// A compute call's start: clears the message, then check_common (full) and read_structs.
fce_status begin_compute(const char* fn, const fce_options* options, const fce_vp_shard* shard,
                         const fce_outputs* outputs, const fce_gradients* gradients, Call* c);
// rows, the shard and the gathered statistics' size (P · rows · stats_width float32:
// FCE_VP_STATS, or FCE_VP_STATS_INVARIANT under options->batch_invariant, stats_width()).
fce_status check_sizes(const char* fn, int64_t rows, int64_t vocab_total, int64_t vocab_start,
                       int64_t vocab_local, bool with_start, int ranks, int64_t stats_width,
                       size_t* gathered_bytes);
inline int64_t stats_width(const fce_options& o) {
  return o.batch_invariant ? FCE_VP_STATS_INVARIANT : FCE_VP_STATS;
}
// Bytes spanned by rows of cols elements stride apart; -1 on overflow.
int64_t span_bytes(int64_t rows, int64_t cols, int64_t stride, size_t elem);
// The row stride of a shard [rows, vocab_local] named `name` (0: vocab_local), at least
// vocab_local.
fce_status row_stride(const char* fn, const char* name, int64_t stride, int64_t vocab_local,
                      int64_t* out);
// The row strides of the logits and (with a gradient) of gradients->grad_logits, which must be
// the logits' when the gradient is written in place (grad_logits == logits).
fce_status logits_strides(const char* fn, const fce_options& o, int64_t vocab_local,
                          const void* logits, const void* grad_logits, int64_t* rs, int64_t* grs);

// One buffer of the call, for the alignment and overlap checks.
struct Range {
  const char* name;
  const void* ptr;
  uint64_t bytes;
  bool output;
  size_t align;
};

// Alignment of every range, and no output overlapping another range except the in-place pair.
fce_status check_ranges(const char* fn, const Range* r, int n, int in_place_a, int in_place_b);
// The upstream gradient and the outputs loss, lse, z_loss and error_flags: five entries from r.
void loss_ranges(const fce_options& o, const fce_outputs& out, int64_t rows,
                 const float* grad_output, Range* r);
// The optional forward outputs outputs->argmax and ->accuracy.
void forward_output_ranges(const fce_options& o, const fce_outputs& out, int64_t rows,
                           Range* argmax, Range* accuracy);
fce_status check_workspace(const char* fn, const void* workspace, size_t workspace_bytes,
                           size_t needed);

}  // namespace fce_nccl
