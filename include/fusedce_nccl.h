/*
 * fusedce_nccl.h — libfusedce_nccl, the optional NCCL companion of fusedce's vocabulary-parallel
 * calls (fusedce.h, "vocabulary-parallel", and docs/semantics.md rule 16).
 *
 * The output layer sharded over the vocabulary (Megatron's tensor parallelism) in one call per
 * step and rank: each entry point enqueues, on the caller's stream,
 *
 *   fce_nccl_cross_entropy   fce_vp_stats -> ncclAllGather of the statistics ->
 *                            [fce_vp_backward] -> fce_vp_loss
 *   fce_nccl_linear_ce       the loss only: fce_vp_linear_stats -> ncclAllGather of the
 *                            statistics -> fce_vp_loss;
 *                            with a gradient (0.5): fce_vp_linear_ce (the logits made once;
 *                            its all-gathers of the statistics, one per token chunk of its
 *                            plan, through ncclAllGather; partial dloss/dh in float32) ->
 *                            ncclAllReduce (sum) of dloss/dh -> one conversion to the dtype
 *   fce_nccl_distill         per round of fce_vp_distill_rounds: fce_vp_distill_stats ->
 *                            ncclAllGather of the statistics; then fce_vp_distill_loss ->
 *                            [fce_vp_distill_backward]
 *
 * (the bracketed parts only when a gradient is asked for). Every rank of the communicator makes
 * the same call with the same options, sizes and targets and its own shard, and gets the loss of
 * the whole vocabulary (identical on every rank, bit for bit), the gradient of its shard and,
 * for the linear CE, the FULL dloss/dh (the sum over ranks).
 *
 * Conventions: those of fusedce.h (caller-owned memory, one stream, no allocation, no host
 * synchronisation, graph-capturable, deterministic), with these additions:
 *   - The CUDA backend only (options->backend FCE_BACKEND_CUDA): device pointers on the calling
 *     thread's current device, which must be the communicator's device (ncclCommCuDevice).
 *   - The communicator travels in the shard: fce_nccl_shard(comm, ...) fills an fce_vp_shard
 *     whose all_gather is this library's ncclAllGather and whose context is comm, an
 *     ncclComm_t of nccl.h (typedef struct ncclComm* ncclComm_t): a BLOCKING communicator
 *     (NCCL's default), P = ncclCommCount ranks. Every fce_nccl_* call takes such a shard (and
 *     refuses one made otherwise); libfusedce's fce_vp_linear_ce takes it too, its all-gathers
 *     then running over NCCL. This header does not include nccl.h; the library is linked
 *     against NCCL. The statistics are gathered in the communicator's rank order
 *     (ncclCommUserRank); a rank's vocab_start need not follow it.
 *   - Every rank must ask for the same gradients (grad_hidden given on all ranks or on none):
 *     the collectives run on every rank or on none. Like any NCCL collective, a call that one
 *     rank makes and another does not (or makes with other sizes) hangs the stream.
 *   - Arguments are checked before anything is enqueued: options, sizes, comm, device, pointers
 *     (NULL, alignment, overlaps with each other and with the workspace), workspace size. The
 *     libfusedce calls inside check theirs again (before they enqueue anything); an error
 *     reported part-way (NCCL, CUDA, cuBLASLt) leaves the outputs undefined.
 *   - fce_nccl_linear_ce with a gradient issues one all-gather per token chunk of its plan, a
 *     function of the options, the sizes but vocab_start / vocab_local, the gradients asked for
 *     and workspace_bytes: every rank must pass the same workspace_bytes (the query returns the
 *     same sizes on every rank when no shard is wider than ceil(vocab_total / P)).
 *   - Zero rows: as in fusedce.h, an empty problem (the loss 0 for mean and sum, grad_weight
 *     and grad_bias 0 unless accumulate); no collective is issued, on any rank.
 *   - Status and message: every function returns an fce_status; on failure
 *     fce_nccl_last_error() (per thread) names this library's function and the argument, e.g.
 *     "fce_nccl_shard: comm is NULL", or holds the message of the failing libfusedce call
 *     prefixed by this library's function ("fce_nccl_linear_ce: fce_vp_linear_stats: ..."); a
 *     bad option or size that a libfusedce workspace query finds (this library sizes every
 *     call's workspace with them, and checks the options that way) is reported under this
 *     library's function alone ("fce_nccl_cross_entropy: options->label_smoothing (2) must be in
 *     [0, 1)").
 *     An error that NCCL reports (ncclAllGather / ncclAllReduce / a communicator query returning
 *     anything but ncclSuccess, ncclInProgress of a nonblocking communicator included, or an
 *     asynchronous error pending on comm) is returned as FCE_ERROR_CUDA, its ncclGetErrorString
 *     text and ncclGetLastError detail in the message. (fce_last_error() of libfusedce is not
 *     touched by this library: read fce_nccl_last_error().)
 *   - Graph capture: the first call on a device does libfusedce's one-time host set-up, so make
 *     one eager call of each entry point (with the same communicator) before capturing it. NCCL
 *     collectives are capturable (NCCL >= 2.9).
 *   - Thread safety: as fusedce.h; NCCL forbids concurrent use of one communicator from several
 *     threads, so calls with the same comm must be issued by one thread at a time.
 *
 * Workspace: the caller's, 16-byte aligned, of at least the size the matching query returns for
 * the same options, communicator and sizes. It holds the gathered statistics
 * [P, rows, FCE_VP_STATS] float32 (P·rows·32 bytes; fce_nccl_linear_ce with a gradient: inside
 * fce_vp_linear_ce's workspace; fce_nccl_distill: the last round's [P, rows,
 * FCE_VP_DISTILL_STATS], round 1's of a two-round JSD gathered into the scratch), for
 * fce_nccl_linear_ce with a 16-bit dtype and a gradient the float32 dloss/dh [rows, hidden]
 * being all-reduced, and then the scratch of the libfusedce calls (all that is left: a larger
 * workspace lets them take faster plans; fce_vp_linear_ce makes the logits once from its
 * optimal_bytes on, about 1 GiB at large-vocabulary sizes).
 *
 * Link with -lfusedce_nccl -lfusedce (pkg-config fusedce_nccl; CMake: find_package(fusedce),
 * target FusedCE::fusedce_nccl).
 */
#ifndef FUSEDCE_NCCL_H
#define FUSEDCE_NCCL_H

#include "fusedce.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ncclComm; /* nccl.h: typedef struct ncclComm* ncclComm_t */

/* The FCE_VERSION_NUMBER (fusedce.h) this library was built with: equal to fce_version() of the
 * libfusedce it is used with. */
FCE_API unsigned fce_nccl_version(void);

/* One line naming this library, the NCCL it was built with and the one it runs with, and
 * libfusedce's fce_build_info(), e.g. "fusedce_nccl 0.5.0; NCCL 2.28.9 (built with 2.28.9);
 * fusedce 0.5.0; backends: ...". Static storage. */
FCE_API const char* fce_nccl_build_info(void);

/* The message of the last fce_nccl_* call on this thread if it failed, "" if it succeeded. Valid
 * until the next fce_nccl_* call on this thread. */
FCE_API const char* fce_nccl_last_error(void);

/* ------------------------------------------------------------------ shard ---- */
/* This rank's shard, classes [vocab_start, vocab_start + vocab_local) of vocab_total, on the
 * ranks of comm: writes *shard = {ncclCommCount(comm), vocab_total, vocab_start, vocab_local,
 * this library's all-gather (ncclAllGather of float32 on comm, on the call's stream), comm}.
 * Host-only: no collective, no synchronisation. The sizes are checked as the calls check them
 * (1 <= vocab_local, 0 <= vocab_start, vocab_start + vocab_local <= vocab_total <= 2^31-1). */
FCE_API fce_status fce_nccl_shard(struct ncclComm* comm, int64_t vocab_total,
                                  int64_t vocab_start, int64_t vocab_local, fce_vp_shard* shard);

/* ---------------------------------------------------------- cross-entropy ---- */
/* Workspace bytes fce_nccl_cross_entropy needs for this shard (made by fce_nccl_shard): with_grad
 * nonzero when grad_logits will be given. */
FCE_API fce_status fce_nccl_cross_entropy_workspace_size(const fce_options* options,
                                                         const fce_vp_shard* shard, int64_t rows,
                                                         int with_grad, size_t* workspace_bytes);

/* Cross-entropy over logits sharded by the vocabulary: this rank holds the columns
 * [shard->vocab_start, shard->vocab_start + shard->vocab_local) of shard->vocab_total; shard
 * made by fce_nccl_shard (it carries the communicator).
 *   logits       this rank's z [rows, vocab_local] of options->dtype, options->row_stride apart
 *   targets      y [rows] (global class indices; the same on every rank), or with a float
 *                options->target_dtype this rank's shard of class probabilities q [rows,
 *                vocab_local], dense (fusedce.h's fce_vp_* calls, docs/semantics.md rule 19)
 *   outputs      (required) loss, lse, z_loss, argmax, accuracy, entropy: as fce_forward
 *                writes them for the unsharded logits (loss required; entropy with
 *                options->vp_entropy); identical on every rank
 *   gradients    optional (NULL: the loss only). gradients->grad_logits:
 *                dloss/dz of this rank's columns [rows, vocab_local],
 *                options->grad_row_stride apart, for the upstream grad_output (as fce_forward:
 *                NULL = 1) and grad_lse / grad_entropy (rule 18; grad_entropy with
 *                options->vp_entropy, both refused without grad_logits); may be logits itself
 *                (in place: then grad_row_stride must equal row_stride). NULL: the loss only
 *                (no backward call).
 *   outputs->error_flags  optional, as fce_vp_loss / fce_vp_backward (FCE_FLAG_TARGET_OUT_OF_RANGE,
 *                FCE_FLAG_SHARDS_INCONSISTENT when the ranks' shards do not tile the vocabulary)
 * Reads the logits twice when grad_logits is given (phase 1 and the gradient). */
FCE_API fce_status fce_nccl_cross_entropy(const fce_options* options, const fce_vp_shard* shard,
                                          int64_t rows, const void* logits, const void* targets,
                                          const fce_outputs* outputs,
                                          const fce_gradients* gradients, void* workspace,
                                          size_t workspace_bytes, void* stream);

/* ----------------------------------------------------------- distillation ---- */
/* Workspace bytes fce_nccl_distill needs for this teacher (its divergence and beta: the rounds)
 * and shard (made by fce_nccl_shard): with_grad nonzero when grad_logits will be given. */
FCE_API fce_status fce_nccl_distill_workspace_size(const fce_options* options,
                                                   const fce_teacher* teacher,
                                                   const fce_vp_shard* shard, int64_t rows,
                                                   int with_grad, size_t* workspace_bytes);

/* fce_distill over logits sharded by the vocabulary (fusedce.h, "vocabulary-parallel
 * distillation", docs/semantics.md rule 22): this rank holds the columns [shard->vocab_start,
 * shard->vocab_start + shard->vocab_local) of shard->vocab_total of both the student's and the
 * teacher's logits; shard made by fce_nccl_shard (it carries the communicator).
 *   teacher      divergence, beta, temperature (the same on every rank) and logits: this
 *                rank's teacher shard t [rows, vocab_local] of options->dtype,
 *                teacher->row_stride apart (0 = vocab_local)
 *   logits       this rank's student shard [rows, vocab_local], options->row_stride apart
 *   targets      [rows] int32 / int64 (the same on every rank): a row whose target is
 *                options->ignore_index is not counted; or NULL: every row counts
 *   outputs      (required) loss (required), lse (optional: the student's log-sum-exp of
 *                a / T), error_flags (optional: FCE_FLAG_SHARDS_INCONSISTENT when the ranks'
 *                shards do not tile the vocabulary): as fce_distill writes them for the
 *                unsharded rows, identical on every rank; the other outputs are refused
 *   gradients    optional (NULL: the loss only). gradients->grad_logits: dloss/dz of this
 *                rank's student columns [rows, vocab_local], options->grad_row_stride apart,
 *                for the upstream grad_output (NULL = 1; [rows] for reduction none); may be
 *                logits itself (in place: then grad_row_stride must equal row_stride). The
 *                other gradients are refused.
 * Options and refusals are fce_distill's. One all-gather of P·rows·32 bytes per round (two for
 * the JSD with 0 < beta < 1); reads both shards twice in round 1, once in round 2 and once more
 * for the gradient. */
FCE_API fce_status fce_nccl_distill(const fce_options* options, const fce_teacher* teacher,
                                    const fce_vp_shard* shard, int64_t rows, const void* logits,
                                    const void* targets, const fce_outputs* outputs,
                                    const fce_gradients* gradients, void* workspace,
                                    size_t workspace_bytes, void* stream);

/* ------------------------------------------------------ fused linear + CE ---- */
/* Workspace of fce_nccl_linear_ce: min_bytes (required) works, optimal_bytes (may be NULL) runs
 * at full speed; with_grad nonzero when any gradient will be asked for (grad_hidden assumed). */
FCE_API fce_status fce_nccl_linear_ce_workspace_size(const fce_options* options,
                                                     const fce_vp_shard* shard, int64_t rows,
                                                     int64_t hidden, int with_grad,
                                                     size_t* min_bytes, size_t* optimal_bytes);

/* z = hidden · weightᵀ + bias with the weight sharded by rows (the vocabulary), then
 * cross-entropy over the whole vocabulary, then the gradients:
 *   hidden_states  h [rows, hidden] of dtype, options->hidden_row_stride apart (the same on
 *                  every rank)
 *   weight, bias   this rank's W[vocab_start : vocab_start + vocab_local, :] [vocab_local,
 *                  hidden] and b [vocab_local] (or NULL)
 *   targets, outputs: as fce_nccl_cross_entropy; shard as there (the weight's rows)
 *   gradients      optional (NULL: the loss only); grad_output, grad_lse and grad_entropy
 *                  as fce_nccl_cross_entropy (refused without grad_hidden, grad_weight or
 *                  grad_bias); grad_hidden_dtype must be FCE_FLOAT32 (the default);
 *                  grad_logits NULL
 *   grad_hidden    the FULL dloss/dh [rows, hidden] dense, of dtype (the sum over ranks of
 *                  every rank's share, all-reduced in float32 and rounded once to dtype),
 *                  always overwritten, identical on every rank; or NULL (on every rank)
 *   grad_weight, grad_bias  this rank's rows of dloss/dW [vocab_local, hidden] and dloss/db
 *                  [vocab_local]: as fce_linear_ce (dtype or float32 by
 *                  options->grad_weight_fp32; options->accumulate adds); or NULL
 * With the three gradient pointers NULL: the loss only. */
FCE_API fce_status fce_nccl_linear_ce(const fce_options* options, const fce_vp_shard* shard,
                                      int64_t rows, int64_t hidden, const void* hidden_states,
                                      const void* weight, const void* bias, const void* targets,
                                      const fce_outputs* outputs, const fce_gradients* gradients,
                                      void* workspace, size_t workspace_bytes, void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FUSEDCE_NCCL_H */
