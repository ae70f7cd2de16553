/*
 * fusedce.h — fused cross-entropy for large vocabularies: the public C ABI.
 *
 * This header is the reference for the ABI: every declaration, and beside it the rules about
 * arguments, ownership, aliasing, streams and threads. What each call computes (the math, the
 * corner cases, the accuracy) is docs/semantics.md in the source repository; docs/performance.md
 * is the performance model. The header is C99 and C++ (tests/ compiles it as pedantic C99).
 *
 * The compute calls:
 *   fce_forward    cross-entropy over given logits z [rows, vocab]: loss (+ lse), and, when a
 *                  gradient buffer is given, dloss/dz in the same pass (one read, one write).
 *   fce_backward   dloss/dz from z, the targets and the lse saved by fce_forward.
 *   fce_backward_rescale  the one-pass gradient of fce_forward (upstream 1) made the gradient
 *                  for the real upstream scalar: free when it is 1.
 *   fce_scale_gradient    a gradient times an upstream scalar read on the device.
 *   fce_linear_ce  z = hidden · weightᵀ + bias, then cross-entropy, then the gradients of hidden,
 *                  weight and bias, holding z only piece by piece within the caller's workspace.
 *   fce_vp_*       the same with the vocabulary sharded over ranks (0.4): per-shard statistics,
 *                  a collective the caller runs, then the loss and the shard's gradients;
 *                  fce_vp_linear_ce (0.5) does it in one call through the caller's all-gather.
 * Every option lives in fce_options; what a call writes, in fce_outputs and fce_gradients;
 * where a vocabulary shard lies, in fce_vp_shard.
 *
 * Conventions (the same for every call):
 *   - Every compute call and workspace query returns an fce_status. On failure
 *     fce_last_error() returns a message naming the function and the argument that was wrong,
 *     and nothing has been written to any output buffer, with one exception: FCE_ERROR_CUDA and
 *     FCE_ERROR_CUBLAS can be reported part-way through the work a call enqueues, and then the
 *     outputs are undefined.
 *   - Caller-owned memory: every buffer, the workspace and the stream come from the caller. The
 *     library never allocates device or pinned memory, never synchronises the host with the
 *     device, and enqueues work only on the stream it is given, so every compute call can be
 *     captured in a CUDA graph. (The first call on a device does host-side set-up once: kernel
 *     attribute and occupancy queries, and for the calls with GEMMs (fce_linear_ce,
 *     fce_vp_linear_*) one cuBLASLt handle; make one eager call of each function before
 *     capturing it.)
 *   - Backends: FCE_BACKEND_CUDA takes device pointers (on the calling thread's current device)
 *     and a cudaStream_t passed as void* (NULL = the legacy default stream); the call returns as
 *     soon as the work is enqueued (asynchronous). FCE_BACKEND_CPU takes host pointers, ignores
 *     the stream, and returns when the results are written (synchronous, multithreaded).
 *   - Thread safety: every function may be called from any number of threads at once. Calls
 *     that share an output buffer or a workspace must be ordered by the caller (the same stream,
 *     or events). The last-error message is per thread.
 *   - Sizes are int64_t; offsets inside are 64-bit, so tensors past 2^31 elements are fine.
 *   - Zero rows (rows = 0) are a valid, empty problem for every call that takes rows, the
 *     workspace queries included (they return 0): the arguments are checked as for any other
 *     call, nothing is computed, and what the call writes is the reduced loss 0 (mean and sum),
 *     the z-loss total 0, the accuracy 0 (mean and sum) and, unless options->accumulate is set,
 *     a zero grad_weight and grad_bias (fce_linear_ce, fce_vp_linear_backward,
 *     fce_vp_linear_ce: the gradient of a sum over no rows); buffers of rows elements have no
 *     element to write. A pointer to a buffer of no elements may be NULL (an empty tensor's
 *     often is) and is never dereferenced. CUDA: the zeros are written by one small kernel on the
 *     caller's stream, asynchronously and graph-capturable as every other call.
 *   - Pointers must be aligned to their element size; the workspace, stats and gathered_stats
 *     to 16 bytes.
 */
#ifndef FUSEDCE_H
#define FUSEDCE_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define FCE_API __declspec(dllexport)
#elif defined(__GNUC__)
#define FCE_API __attribute__((visibility("default")))
#else
#define FCE_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- version ---- */
/* From 1.0 the ABI is append-only: no function, enum value, macro or struct field is ever
 * removed, renumbered or changed in meaning; new calls and new struct fields (at the end of the
 * versioned structs, known to the library by their struct_size) are added. */
#define FCE_VERSION_MAJOR 1
#define FCE_VERSION_MINOR 0
#define FCE_VERSION_PATCH 0
#define FCE_VERSION_NUMBER (FCE_VERSION_MAJOR * 10000 + FCE_VERSION_MINOR * 100 + FCE_VERSION_PATCH)

/* The FCE_VERSION_NUMBER the library was built with: a binding compares it with its header's. */
FCE_API unsigned fce_version(void);

/* ----------------------------------------------------------------- status ---- */
/* Append-only: codes are never renumbered or removed. */
typedef enum fce_status {
  FCE_SUCCESS = 0,
  FCE_ERROR_INVALID_ARGUMENT = 1,    /* a size, option or enum out of its domain */
  FCE_ERROR_NULL_POINTER = 2,        /* a required pointer is NULL */
  FCE_ERROR_MISALIGNED = 3,          /* a pointer not aligned to its element (workspace, stats:
                                        16 B) */
  FCE_ERROR_UNSUPPORTED = 4,         /* a valid request this build or device cannot do */
  FCE_ERROR_WORKSPACE_TOO_SMALL = 5, /* workspace_bytes below what the query returned */
  FCE_ERROR_BACKEND_UNAVAILABLE = 6, /* CUDA backend not built in, or no CUDA device */
  FCE_ERROR_CUDA = 7,                /* the CUDA runtime reported an error (launch, pointer) */
  FCE_ERROR_CUBLAS = 8,              /* cuBLASLt reported an error */
  FCE_ERROR_INTERNAL = 9,            /* a bug in fusedce: please report it */
  FCE_ERROR_OUT_OF_MEMORY = 10       /* host memory ran out (the CPU backend's buffers) (0.4) */
} fce_status;

/* A static string naming the status ("FCE_ERROR_NULL_POINTER: a required pointer is NULL"). */
FCE_API const char* fce_status_string(fce_status status);

/* The message of the last fusedce call on this thread if it failed, "" if it succeeded (each
 * compute or workspace-query call clears it first). It names the function and the argument,
 * e.g. "fce_forward: options->row_stride (100) is less than vocab (128)". The pointer stays
 * valid until the next fusedce call on this thread. */
FCE_API const char* fce_last_error(void);

/* ------------------------------------------------------------------ enums ---- */
typedef enum fce_dtype {
  FCE_FLOAT32 = 0,
  FCE_FLOAT16 = 1,
  FCE_BFLOAT16 = 2,
  FCE_INT32 = 3, /* targets only */
  FCE_INT64 = 4  /* targets only */
} fce_dtype;

typedef enum fce_reduction {
  FCE_REDUCTION_MEAN = 0, /* the cross-entropy terms / sum of w[y_i] over non-ignored rows
                             (torch's), plus the z-loss terms / the number of non-ignored rows
                             (Liger's; the two divisors agree without class weights) */
  FCE_REDUCTION_SUM = 1,
  FCE_REDUCTION_NONE = 2 /* one loss per row */
} fce_reduction;

typedef enum fce_backend { FCE_BACKEND_CUDA = 0, FCE_BACKEND_CPU = 1 } fce_backend;

/* Bits of the device-side error flags word (see error_flags below). */
#define FCE_FLAG_TARGET_OUT_OF_RANGE 1u /* a target outside [0, vocab), not ignore_index */

/* ---------------------------------------------------------------- options ---- */
/* Every option of every call. Start from FCE_OPTIONS_INIT or fce_options_default(); fields are
 * only ever appended, and struct_size tells the library which ones the caller knows: it must be
 * the size of some 1.x version's struct (FCE_OPTIONS_SIZE_V1_0); the fields past it take their
 * defaults. The outputs of a call are not options: they are fce_outputs and fce_gradients. */
typedef struct fce_options {
  size_t struct_size;         /* sizeof(fce_options) */
  const float* class_weights; /* w [vocab] float32 in the backend's memory, or NULL (all 1);
                                 [vocab_total] for fce_vp_*: the whole vocabulary's */
  int64_t ignore_index;       /* rows whose target equals it get loss 0 and a zero gradient: -100 */
  int64_t row_stride;         /* elements between rows of logits; 0 = vocab (dense; for
                                 fce_vp_*, vocab_local) */
  int64_t grad_row_stride;    /* elements between rows of grad_logits; 0 = vocab (dense; for
                                 fce_vp_*, vocab_local) */
  int64_t shift_seq_len;      /* T > 0: causal shift, row b*T+t is scored against target
                                 b*T+t+k (k = shift below, 1 by default), rows with t >= T-k
                                 are ignored; rows % T must be 0. 0 = no shift */
  int64_t hidden_row_stride;  /* fce_linear_ce, fce_vp_linear_*: elements between rows of
                                 hidden (any value >= hidden, at most 2^31-1 on the CPU
                                 backend, whose BLAS takes int; unused with one row); 0 =
                                 hidden size */
  int32_t backend;            /* fce_backend: FCE_BACKEND_CUDA */
  int32_t dtype;              /* fce_dtype of logits / hidden, weight, bias, and of their
                                 gradients (but see grad_weight_fp32): FCE_FLOAT32 */
  int32_t target_dtype;       /* FCE_INT32 or FCE_INT64: targets are class indices [rows]
                                 (FCE_INT64, torch's, by default). FCE_FLOAT32, FCE_FLOAT16 or
                                 FCE_BFLOAT16: targets are class probabilities q [rows,
                                 vocab], dense (row stride = vocab), of that dtype, as torch's
                                 F.cross_entropy(input, probabilities): per row
                                 loss = -sum_j w_j q'_j log p_j, q' = (1-eps) q + eps/vocab, plus
                                 the z-loss; every row is scored (ignore_index does not apply;
                                 mean divides by rows, class weights or not); docs/semantics.md
                                 rule 19. q is not checked: a negative or NaN q_j gives what the
                                 formula gives (NaN propagates, as torch's). Refused with them:
                                 token_scaling and outputs->accuracy (no target class),
                                 shift_seq_len (FCE_ERROR_UNSUPPORTED). The fce_vp_* calls
                                 take each rank's shard of q, [rows, vocab_local] (see
                                 there).
                                 error_flags never get FCE_FLAG_TARGET_OUT_OF_RANGE */
  int32_t reduction;          /* fce_reduction: FCE_REDUCTION_MEAN */
  float label_smoothing;      /* epsilon in [0, 1): 0 */
  float z_loss_scale;         /* lambda >= 0, adds lambda * lse^2 to each row's loss (for mean
                                 divided by the count of non-ignored rows, not by the class
                                 weights' sum): 0 */
  float softcap;              /* c >= 0: a = c * tanh(a / c) when c > 0: 0 (off) */
  float logit_scale;          /* s, finite and nonzero: a = s * z before anything else: 1 */
  int32_t deterministic;      /* nonzero: bitwise-identical results run to run. Every path of
                                 this version is deterministic; the flag keeps it so. */
  int32_t accumulate;         /* fce_linear_ce, fce_vp_linear_backward: nonzero adds into
                                 grad_weight and grad_bias (gradient accumulation); 0
                                 overwrites them. grad_hidden is always overwritten */
  int32_t grad_weight_fp32;   /* fce_linear_ce, fce_vp_linear_backward: nonzero = grad_weight
                                 and grad_bias are float32 whatever dtype is; 0 = they have
                                 dtype */
  int32_t vp_entropy;         /* the fce_vp_* and fce_nccl_* calls: nonzero makes each shard's
                                 statistics also carry its share of the entropy (one more sum
                                 per element in fce_vp_stats and fce_vp_linear_stats), which
                                 outputs->entropy and gradients->grad_entropy of those calls
                                 need; pass the same value to every call of a step (it sets
                                 the statistics' layout). The other calls require 0. 0 (off) */
  int64_t shift;              /* k >= 0, with shift_seq_len T > 0: row b*T+t is scored against
                                 target b*T+t+k and rows with t >= T-k are ignored (CCE's
                                 integer shift). 0 = 1 (the shift of 0.2). k >= T ignores
                                 every row. Must be 0 when T = 0 */
  int32_t token_scaling;      /* nonzero: each scored row's loss (its z-loss term included) and
                                 gradient are multiplied by p_y (exp((a_y - m) - log s), see
                                 fce_forward's precision note), treated as a
                                 constant (Liger's use_token_scaling); the mean's denominators
                                 are unchanged; an invalid row (loss NaN) keeps its z-loss term
                                 unscaled. 0 (off) */
  int32_t batch_invariant;    /* nonzero: each row's loss (reduction none), lse, entropy,
                                 argmax and gradient row (grad_logits; fce_linear_ce's
                                 grad_hidden row) are bitwise identical whatever the number of
                                 rows, the row's position among them and (fce_linear_ce) the
                                 workspace size, for the same options, backend, device, dtype
                                 and vocabulary: reductions over a row run in a fixed order
                                 chosen without the row count, GEMMs in fixed token chunks;
                                 fce_vp_stats / fce_vp_loss / fce_vp_backward: also whatever
                                 the number of shards and their widths (statistics rows of
                                 FCE_VP_STATS_INVARIANT exact sums).
                                 Not invariant: whatever sums over rows (the mean / sum loss,
                                 z_loss, accuracy, grad_weight, grad_bias) and, with reduction
                                 mean, the gradient (scaled by 1/D, D the batch's count).
                                 Holds for one library build and one setting of the
                                 FCE_CUDA_* knobs. CUDA: every logits row of fce_forward /
                                 fce_backward(_rescale) must start 16-byte aligned;
                                 fce_linear_ce then needs its fixed-chunk workspace (the
                                 query's) and, for a 16-bit grad_weight, few enough chunks.
                                 Else, and in the fce_vp_linear_* and distillation calls,
                                 FCE_ERROR_UNSUPPORTED. docs/semantics.md rule 21. 0: off */
} fce_options;

/* The defaults, one value per field in declaration order (positional: designated initialisers
 * would not compile as C++ before C++20). fce_options_default() writes the same values, but
 * keeps the caller's struct_size. */
#define FCE_OPTIONS_INIT                                                      \
  {                                                                           \
    sizeof(fce_options), /* struct_size: this header's struct */              \
    NULL,                /* class_weights: none (all 1) */                    \
    -100,                /* ignore_index: -100 (torch's) */                   \
    0,                   /* row_stride: vocab (dense) */                      \
    0,                   /* grad_row_stride: vocab (dense) */                 \
    0,                   /* shift_seq_len: no causal shift */                 \
    0,                   /* hidden_row_stride: hidden (dense) */              \
    FCE_BACKEND_CUDA,    /* backend: CUDA */                                  \
    FCE_FLOAT32,         /* dtype: float32 */                                 \
    FCE_INT64,           /* target_dtype: int64 (torch's) */                  \
    FCE_REDUCTION_MEAN,  /* reduction: mean */                                \
    0.0f,                /* label_smoothing: 0 */                             \
    0.0f,                /* z_loss_scale: 0 (no z-loss) */                    \
    0.0f,                /* softcap: 0 (off) */                               \
    1.0f,                /* logit_scale: 1 */                                 \
    0,                   /* deterministic: 0 (every path already is) */       \
    0,                   /* accumulate: 0 (overwrite) */                      \
    0,                   /* grad_weight_fp32: 0 (gradients of dtype) */       \
    0,                   /* vp_entropy: off */                                \
    0,                   /* shift: 0 (= 1 with shift_seq_len) (0.3) */        \
    0,                   /* token_scaling: off (0.3) */                       \
    0                    /* batch_invariant: off */                           \
  }

/* sizeof(fce_options) in version 1.0, the first of the stable ABI: the smallest struct_size any
 * 1.x library accepts. (The 0.x structs, which held argmax and accuracy, are refused with a
 * message saying so.) */
#define FCE_OPTIONS_SIZE_V1_0 120

/* Fills *options with the defaults above (for bindings that cannot use the macro). It writes
 * options->struct_size bytes at most, so set struct_size to the size of your fce_options first;
 * a struct_size of 0 means FCE_OPTIONS_SIZE_V1_0. A newer library therefore never writes past an
 * older caller's struct. */
FCE_API void fce_options_default(fce_options* options);

/* ---------------------------------------------------------------- outputs ---- */
/* What a call writes besides the gradients, all in the backend's memory. Start from
 * FCE_OUTPUTS_INIT (every output absent); fields are only ever appended (later: per-row
 * log-probs, distillation terms), and struct_size tells the library which ones the
 * caller knows: it must be the size of some version's struct (FCE_OUTPUTS_SIZE_V1_0), and the
 * fields past it are absent (NULL).
 *
 * Which calls read it: fce_forward, fce_linear_ce, fce_vp_loss and fce_vp_linear_ce write every
 * field (loss required, the others optional; entropy, for the vocabulary-parallel ones, with
 * options->vp_entropy); the gradient-only calls
 * fce_backward and fce_backward_rescale write error_flags only, and refuse a structure with any
 * other output set. The pointer itself may be NULL where no output is required: for those two
 * (then no error flags are written); never for the calls that write a loss (their message:
 * "<call>: outputs is NULL"). fce_vp_backward and fce_vp_linear_backward take no outputs: the
 * error flags of a vocabulary-parallel step are fce_vp_loss's, from the same gathered statistics
 * and targets. */
typedef struct fce_outputs {
  size_t struct_size;    /* sizeof(fce_outputs) */
  float* loss;           /* float32: [1] for mean/sum, [rows] for none (ignored rows get 0). */
  float* lse;            /* optional float32 [rows]: log-sum-exp of each row's (scaled, capped)
                            logits, written for every row, ignored ones too; what fce_backward
                            needs. */
  float* z_loss;         /* optional float32 [1]: lambda * sum lse_i^2 over non-ignored rows
                            (each valid row's times p_y with token_scaling), divided by the
                            number of non-ignored rows for mean (summed for sum and none): the
                            part of the loss that is z-loss, for logging. */
  int64_t* argmax;       /* optional int64 [rows]: each row's predicted class, the argmax of its
                            scaled, capped logits a (lowest index among equal maxima, a NaN
                            counts as the largest, as torch.argmax); -1 for ignored rows. */
  float* accuracy;       /* optional float32: for mean and sum [1], the fraction of non-ignored
                            rows whose argmax equals the target (invalid rows count, never
                            correct; 0 when every row is ignored); for none [rows], 1 or 0 per
                            row (0 for ignored and invalid rows). Unweighted. */
  uint32_t* error_flags; /* optional uint32: the call ORs FCE_FLAG_* bits into it and never
                            clears it (zero it once, read it whenever convenient). A row whose
                            target is out of range gets loss NaN and a NaN gradient row; it counts
                            1 (not its class weight) in the mean's denominator. */
  float* entropy;        /* optional float32 [rows]: the entropy of each row's softmax over its
                            scaled, capped logits a, H_i = lse_i - sum_j p_ij a_ij (>= 0; log V
                            for a constant row), written for every row, ignored ones too (as
                            lse); NaN where lse is NaN, and for a row of -inf. Computed relative
                            to the row maximum m (with s = sum exp(a - m) and
                            t = sum exp(a - m)(a - m): H = log s - t/s), so rows of huge
                            magnitude are exact; -inf entries (p = 0) add nothing. Written by
                            fce_forward, fce_linear_ce, fce_vp_loss and fce_vp_linear_ce (these
                            two with options->vp_entropy, else refused). Its gradient:
                            gradients->grad_entropy. */
} fce_outputs;

#define FCE_OUTPUTS_INIT                                          \
  {                                                               \
    sizeof(fce_outputs), /* struct_size: this header's struct */  \
    NULL,                /* loss */                               \
    NULL,                /* lse: not written */                   \
    NULL,                /* z_loss: not written */                \
    NULL,                /* argmax: not computed */               \
    NULL,                /* accuracy: not computed */             \
    NULL,                /* error_flags: not written */           \
    NULL                 /* entropy: not computed */              \
  }

/* sizeof(fce_outputs) in version 1.0 (on LP64 and LLP64 targets). */
#define FCE_OUTPUTS_SIZE_V1_0 64

/* -------------------------------------------------------------- gradients ---- */
/* The gradients a call writes and the upstream gradient it scales them by, in the backend's
 * memory. Start from FCE_GRADIENTS_INIT (nothing asked for); fields are only ever appended,
 * and struct_size must be the size of some version's struct (FCE_GRADIENTS_SIZE_V1_0); the
 * fields past it are absent.
 *
 * Which calls read which fields (a field a call does not take must be NULL, so that a gradient
 * asked for is never silently left unwritten):
 *   fce_forward, fce_backward, fce_backward_rescale, fce_vp_backward: grad_logits, grad_output;
 *   fce_linear_ce, fce_vp_linear_backward, fce_vp_linear_ce: grad_hidden, grad_weight,
 *   grad_bias, grad_output (and, for the fce_vp_linear_* calls, grad_hidden_dtype);
 *   grad_lse: fce_forward (with grad_logits), fce_backward, fce_linear_ce (with any gradient),
 *   fce_vp_backward, fce_vp_linear_backward, fce_vp_linear_ce (with any gradient);
 *   grad_entropy: fce_forward (with grad_logits), fce_linear_ce (with any gradient), and the
 *   three fce_vp_* calls above with options->vp_entropy (the shards' statistics then carry the
 *   entropy's sums; without it: FCE_ERROR_INVALID_ARGUMENT).
 *   The others refuse a non-NULL grad_lse / grad_entropy with a message naming the call and
 *   the field (fce_backward refuses grad_entropy: it needs the row's mean logit, which only a
 *   pass over the whole row makes: use fce_forward with a gradient).
 *
 * The differentiable lse and entropy (docs/semantics.md rule 18): the gradient these calls
 * write is that of loss + sum_i (grad_lse_i * lse_i + grad_entropy_i * H_i), the sum over EVERY
 * row (an ignored row has no loss term, but its lse and entropy terms flow), per element of the
 * scaled, capped logits a_ij:
 *   d/da_ij = (the loss term, for grad_output, as without them)
 *           + grad_lse_i * p_ij - grad_entropy_i * p_ij * (a_ij - mu_i),  mu_i = sum_k p_ik a_ik,
 * then times s * (1 - (a_ij / c)^2) as for the loss. token_scaling does not scale these two
 * terms. An element with p_ij = 0 (a -inf logit) gets 0 from them. fce_linear_ce's grad_hidden,
 * grad_weight and grad_bias follow through the logits. A row whose grad_lse_i and
 * grad_entropy_i are both 0 gets the loss's gradient alone (an ignored row: zeros); an invalid
 * row's gradient stays NaN. fce_backward computes p_ij from the saved lse as for the loss
 * (rule 12). CUDA: a call with outputs->entropy, grad_lse or grad_entropy runs its rows in
 * registers where the plain call's rows fit there (one read; its bulk-kernel rows too), else, and
 * with label smoothing, on the two-pass kernel (each row read twice, the second read mostly from
 * L2); either costs more than the plain loss + gradient (docs/performance.md). Given without a
 * gradient to add them to (fce_forward without grad_logits, fce_linear_ce without grad_hidden,
 * grad_weight and grad_bias), they are refused.
 *
 * The pointer itself may be NULL: no gradient (the loss only, for fce_forward, fce_linear_ce and
 * fce_vp_linear_ce); the calls that compute nothing else (fce_backward, fce_backward_rescale,
 * fce_vp_backward, fce_vp_linear_backward) refuse it ("<call>: gradients is NULL"). */
typedef struct fce_gradients {
  size_t struct_size;       /* sizeof(fce_gradients) */
  const float* grad_output; /* upstream gradient g, float32: one value for mean/sum, [rows]
                               values for none; NULL means g = 1 (each row, for none). Being a
                               pointer, it can be written by earlier work on the stream. */
  void* grad_logits;        /* dloss/dz [rows, options->grad_row_stride] of options->dtype. It
                               may be the logits themselves (in place; then grad_row_stride must
                               equal row_stride); any other overlap is an error. */
  void* grad_hidden;        /* dloss/dh [rows, hidden] dense, of dtype (fce_vp_linear_*: of
                               grad_hidden_dtype), always overwritten. */
  void* grad_weight;        /* dloss/dW [vocab, hidden] dense, of dtype or float32
                               (options->grad_weight_fp32); overwritten, or added to with
                               options->accumulate. */
  void* grad_bias;          /* dloss/db [vocab], the dtype of grad_weight; only with a bias. */
  int32_t grad_hidden_dtype; /* fce_vp_linear_*: FCE_FLOAT32 or options->dtype, the dtype of
                               the partial grad_hidden (FCE_FLOAT32 keeps the all-reduce exact to
                               float32). The other calls require FCE_FLOAT32 (the default) here:
                               their grad_hidden has options->dtype. */
  int32_t reserved0;        /* must be 0 */
  const float* grad_lse;    /* optional float32 [rows]: the upstream gradient of each row's lse
                               (outputs->lse), every row, ignored ones included; NULL = 0. Adds
                               grad_lse_i * p_ij to d/da_ij. */
  const float* grad_entropy; /* optional float32 [rows]: the upstream gradient of each row's
                               entropy (outputs->entropy), every row; NULL = 0. Adds
                               -grad_entropy_i * p_ij * (a_ij - mu_i) to d/da_ij. */
} fce_gradients;

#define FCE_GRADIENTS_INIT                                          \
  {                                                                 \
    sizeof(fce_gradients), /* struct_size: this header's struct */  \
    NULL,                  /* grad_output: g = 1 */                 \
    NULL,                  /* grad_logits */                        \
    NULL,                  /* grad_hidden */                        \
    NULL,                  /* grad_weight */                        \
    NULL,                  /* grad_bias */                          \
    FCE_FLOAT32,           /* grad_hidden_dtype */                  \
    0,                     /* reserved0: must be 0 */               \
    NULL,                  /* grad_lse: 0 */                        \
    NULL                   /* grad_entropy: 0 */                    \
  }

/* sizeof(fce_gradients) in version 1.0 (on LP64 and LLP64 targets). */
#define FCE_GRADIENTS_SIZE_V1_0 72

/* ---------------------------------------------------------- cross-entropy ---- */
/*
 * Common arguments of fce_forward / fce_backward:
 *   rows, vocab   N >= 0 rows (0: the empty problem of the conventions above) of
 *                 1 <= V <= 2^31-1 classes.
 *   logits        z [rows, row_stride] of options->dtype (read only).
 *   targets       y [rows] of options->target_dtype, or class probabilities q [rows, vocab]
 *                 (a float target_dtype: docs/semantics.md rule 19).
 *   outputs       what the call writes (fce_outputs above: loss, lse, z_loss, argmax, accuracy,
 *                 error_flags).
 *   gradients     gradients->grad_logits, dloss/dz, for the upstream gradients->grad_output
 *                 (fce_gradients above); grad_logits may be logits itself (in place).
 *   workspace     scratch of at least the size the matching *_workspace_size query returned
 *                 for the same options and sizes; NULL is fine when that size is 0. Its
 *                 contents on entry and exit are meaningless.
 *
 * A mean over zero non-ignored rows is 0 with a zero gradient (torch gives NaN).
 */

/* Workspace bytes fce_forward needs for these options and sizes. */
FCE_API fce_status fce_forward_workspace_size(const fce_options* options, int64_t rows,
                                              int64_t vocab, size_t* workspace_bytes);

/* Loss (and optionally lse, the z-loss total, argmax, accuracy and the gradient) in one pass
 * over the logits.
 *   outputs    required; outputs->loss required, every other field optional.
 *   gradients  optional (NULL: the loss only). With gradients->grad_logits, the gradient of the
 *              loss scaled by gradients->grad_output is written in the same pass: the training
 *              path.
 * Precision: each p_j is exp((a_j - m) - log s) with the row maximum m and s = sum exp(a_j - m)
 * kept apart, so rows whose logits share a huge offset (all -1e30, all 3e38) are exact. */
FCE_API fce_status fce_forward(const fce_options* options, int64_t rows, int64_t vocab,
                               const void* logits, const void* targets,
                               const fce_outputs* outputs, const fce_gradients* gradients,
                               void* workspace, size_t workspace_bytes, void* stream);

/* Workspace bytes fce_backward needs for these options and sizes. */
FCE_API fce_status fce_backward_workspace_size(const fce_options* options, int64_t rows,
                                               int64_t vocab, size_t* workspace_bytes);

/* The gradient only, from the logits, the targets and lse [rows] saved by fce_forward with the
 * same options: one read of the logits, one write of grad_logits (required). Here p_j =
 * exp(a_j - lse) from the float32 lse, so each p_j carries the rounding of lse, a relative error
 * up to |lse| * 2^-24 (at most 2^-14): the same values as fce_forward's gradient to that
 * rounding, not bit for bit (fce_backward_rescale is). Rows with |lse| >= 1024 (huge logits,
 * where that rounding would lose log s) are reduced again from the logits, so they are exact at
 * the cost of a second read of those rows. outputs: NULL, or error_flags alone; gradients (required):
 * grad_logits (required) and grad_output. */
FCE_API fce_status fce_backward(const fce_options* options, int64_t rows, int64_t vocab,
                                const void* logits, const void* targets, const float* lse,
                                const fce_outputs* outputs, const fce_gradients* gradients,
                                void* workspace, size_t workspace_bytes, void* stream);

/* The gradient fce_forward wrote for an upstream gradient of 1 (grad_output NULL), made the
 * gradient for the upstream scalar *grad_output, rounded ONCE to the dtype, as if fce_forward had
 * been called with that grad_output: the training path when the upstream gradient is known only
 * after the forward (autograd). Reductions mean and sum only (none: use fce_backward). The
 * arguments are fce_backward's, with the same options, the lse fce_forward wrote, and
 * grad_logits holding that forward's gradient (not the logits themselves: a gradient written
 * over the logits can only be scaled, with fce_scale_gradient). Decided on the device from the
 * scalar, without a host synchronisation:
 *   exactly 1            nothing is done (one launch whose blocks return at once);
 *   0 or ± a power of 2  the rows with a valid target are scaled in place (one read and
 *                        write of them; ignored rows keep +0, invalid rows NaN): exact, and
 *                        what fce_forward writes for that scalar, except that an element
 *                        below the dtype's smallest normal number may differ from it by one
 *                        subnormal step (it is rounded twice);
 *   anything else        the gradient is computed again from the logits, by the kernel
 *                        fce_forward runs (one read of the logits, one write; lse is not read),
 *                        bit for bit what fce_forward would have written.
 * Workspace: fce_backward_workspace_size. */
FCE_API fce_status fce_backward_rescale(const fce_options* options, int64_t rows, int64_t vocab,
                                        const void* logits, const void* targets,
                                        const float* lse, const fce_outputs* outputs,
                                        const fce_gradients* gradients, void* workspace,
                                        size_t workspace_bytes, void* stream);

/* ------------------------------------------------------ fused linear + CE ---- */
/*
 *   hidden        h [rows, hidden_row_stride] of dtype; weight W [vocab, hidden] row-major
 *                 (torch.nn.Linear(hidden, vocab).weight); bias b [vocab] or NULL.
 *   loss, lse, z_loss, targets, grad_output, error_flags: as for fce_forward.
 *   grad_hidden   dloss/dh [rows, hidden] dense, of dtype, always overwritten; or NULL.
 *   grad_weight   dloss/dW [vocab, hidden] dense, of dtype or float32 (grad_weight_fp32);
 *                 overwritten, or added to with options->accumulate; or NULL.
 *   grad_bias     dloss/db [vocab], the dtype of grad_weight; or NULL (must be NULL without a
 *                 bias).
 *   With all three gradient pointers NULL the call computes the loss only (evaluation).
 *   No gradient output may overlap another buffer.
 * The logits are produced piece by piece in the workspace, never beyond workspace_bytes: they
 * exist whole only when the caller's workspace holds all N×V of them. On CUDA the plan follows
 * from the sizes, the options, the gradients asked for and workspace_bytes (dev/NOTES.md):
 *   - token chunks (6·N·D·V FLOPs): a float32 grad_weight (or none) accumulates over any number
 *     of chunks; a 16-bit grad_weight accumulates in place over at most k = min(64, max(1, 3·V/N))
 *     chunks, one rounding per chunk (bench/accuracy_dw.py --study: within 2× torch eager's
 *     error against float64 at every measured shape with k·N/V ≤ 3, in relative Frobenius norm
 *     and in max-abs over max |reference|; docs/performance.md);
 *   - otherwise, for a 16-bit grad_weight, vocabulary slices (8·N·D·V): a pass over token chunks
 *     for the loss and lse, then per slice of columns the logits of all rows, their gradient,
 *     grad_weight of the slice in one product over all rows (one rounding), and grad_hidden
 *     accumulated in a float32 [N, D] buffer in the workspace.
 * No CUDA plan keeps anything of size [V, D] in the workspace. The CPU backend takes token
 * chunks of a size fixed by N and V and accumulates in float32 (the workspace only decides
 * whether its chunk buffers live there or in host memory). Any workspace of at least min_bytes
 * (on CUDA a few MiB, plus N·D·4 for a 16-bit grad_weight) works and gives the same result for
 * a given size (bitwise) and within rounding across sizes; optimal_bytes (about 1 GiB at the
 * sizes of large-vocabulary training) runs at full speed.
 */
/* min_bytes is required; optimal_bytes may be NULL. */
FCE_API fce_status fce_linear_ce_workspace_size(const fce_options* options, int64_t rows,
                                                int64_t hidden, int64_t vocab, int with_grad,
                                                size_t* min_bytes, size_t* optimal_bytes);

FCE_API fce_status fce_linear_ce(const fce_options* options, int64_t rows, int64_t hidden,
                                 int64_t vocab, const void* hidden_states, const void* weight,
                                 const void* bias, const void* targets,
                                 const fce_outputs* outputs, const fce_gradients* gradients,
                                 void* workspace, size_t workspace_bytes, void* stream);

/* ---------------------------------------------------- vocabulary-parallel ---- */
/*
 * The output layer sharded over the vocabulary (Megatron's tensor parallelism): each of P ranks
 * holds classes [vocab_start, vocab_start + vocab_local) of vocab_total: its logits' columns, or
 * the rows W[vocab_start : vocab_start + vocab_local, :] of the weight (and of the bias). The
 * loss needs the whole row's softmax, so a step has two phases around one collective that the
 * caller runs with its own communicator (or libfusedce_nccl, fusedce_nccl.h, does it all):
 *
 *   1. fce_vp_stats / fce_vp_linear_stats: each rank writes FCE_VP_STATS float32 per row of
 *      partial statistics of its shard into stats [rows, FCE_VP_STATS] (never the logits);
 *   2. the caller ALL-GATHERS the ranks' stats buffers, in any rank order, into
 *      gathered_stats [ranks, rows, FCE_VP_STATS] (rank-major: what ncclAllGather or
 *      torch.distributed.all_gather_into_tensor makes of the [rows, FCE_VP_STATS] buffers);
 *   3. fce_vp_loss: the loss (and lse, z_loss, argmax, accuracy) from gathered_stats, identical
 *      on every rank (the same inputs in the same order: bit for bit); and for training
 *      fce_vp_backward / fce_vp_linear_backward: the gradient of this rank's shard from
 *      gathered_stats. fce_vp_linear_backward's grad_hidden is this rank's PARTIAL ∂h (its
 *      columns' share); the true ∂h is the sum over ranks: ALL-REDUCE (sum) it.
 *
 * The combination is fixed (docs/semantics.md rule 16): with each rank's row maximum m_r and
 * s_r = Σ exp(a_j − m_r) over its shard, M = max_r m_r, S = Σ_r s_r·exp(m_r − M) (ranks in
 * their gathered order), lse = M + log S, and the target logit from the one shard that holds
 * the target. Every call below has the same options as the one-GPU calls (reduction, ignore_index,
 * class_weights [vocab_total] — the WHOLE vocabulary's weights on every rank —, label
 * smoothing, z-loss, softcap, logit_scale, shift, token_scaling; outputs->argmax and ->accuracy are written by
 * fce_vp_loss; outputs->entropy and gradients->grad_lse / ->grad_entropy of rule 18 too, the
 * entropy and its gradient with options->vp_entropy on every call of the step: phase 1 then
 * also sums e_r = Σ exp(a_j − m_r)(a_j − m_r) over the shard, in the same read, and H and
 * μ = Σ p_j a_j come from the combination), and the loss, the gradients and the mean's
 * denominator are those of the unsharded call to float32 rounding. All ranks must pass the
 * same options, rows, vocab_total and targets. Class-probability targets (a float
 * options->target_dtype, rule 19): targets of fce_vp_stats, fce_vp_backward,
 * fce_vp_linear_stats, fce_vp_linear_backward and fce_vp_linear_ce is THIS RANK'S SHARD of q,
 * [rows, vocab_local] dense (columns vocab_start .. vocab_start + vocab_local - 1 of q [rows,
 * vocab_total]), and fce_vp_loss does not read targets (NULL allowed); every row is scored, the
 * mean divides by rows, and token_scaling, shift_seq_len and outputs->accuracy are refused as
 * by fce_forward. On CUDA their fce_vp_linear_ce always runs the gather-once plan.
 * If the gathered statistics do not tile [0, vocab_total) — their vocab_local do
 * not sum to vocab_total, a row's target is held by no shard or by two, or two shards report the
 * same argmax (a shard's statistics gathered twice) — the rows concerned get a NaN loss, lse
 * and gradient and an argmax of -1, and FCE_FLAG_SHARDS_INCONSISTENT is set. (What cannot be
 * seen from the statistics is not caught: statistics of another step, or shards that overlap
 * without sharing an argmax.)
 *
 * Same promises as every call: caller-owned memory, one stream, no allocation, no host
 * synchronisation, graph-capturable, deterministic. Sizes: rows >= 0 (0: the empty problem;
 * fce_vp_linear_ce then never calls shard->all_gather), ranks >= 1, 1 <= vocab_local,
 * 0 <= vocab_start, vocab_start + vocab_local <= vocab_total <= 2^31-1.
 * stats and gathered_stats are float32 in the backend's memory, aligned to 16 bytes. (0.4)
 */
#define FCE_VP_STATS 8 /* float32 per row of a shard's statistics (the layout is internal) */
/* The same under options->batch_invariant: rows of exact sums, so that each row's results are the
 * same bits whatever the number of shards and their widths (docs/semantics.md rule 21). Every
 * stats and gathered_stats buffer of such a step is [.., rows, FCE_VP_STATS_INVARIANT]. */
#define FCE_VP_STATS_INVARIANT 44

/* Bit of error_flags: gathered statistics that do not tile the vocabulary (see above). */
#define FCE_FLAG_SHARDS_INCONSISTENT 2u

/* fce_vp_all_gather_fn: the all-gather fce_vp_linear_ce runs its collective through (it is the
 * one call that gathers by itself). all_gather(context, send, recv, count, stream) must gather,
 * over the `ranks` ranks of the step, the `count` float32 at `send` of every rank into `recv`
 * [ranks, count], rank-major in any fixed rank order (what ncclAllGather and
 * torch.distributed.all_gather_into_tensor make), enqueued on `stream` after the work the call
 * enqueued before it (CUDA: the caller's stream; it may also complete the gather before it
 * returns), and return FCE_SUCCESS, or any other status to stop the call, which then returns it
 * (fce_last_error() names the call and the all-gather; outputs are then undefined, as after
 * FCE_ERROR_CUDA). send [count] and recv [ranks·count] lie in the caller's workspace, in the
 * backend's memory, 16-byte aligned, disjoint. It is called on the calling thread, during the
 * call, once per token chunk of fce_vp_linear_ce's plan (the CPU backend and the gather-once
 * plan: once), with count = chunk rows · FCE_VP_STATS; context is passed through. */
typedef fce_status (*fce_vp_all_gather_fn)(void* context, const float* send, float* recv,
                                           int64_t count, void* stream);

/* Where this rank lies and how it reaches the others, given to every fce_vp_* compute call by
 * pointer (required): classes [vocab_start, vocab_start + vocab_local) of vocab_total, on one of
 * `ranks` ranks. A call reads only the fields it needs: fce_vp_stats and fce_vp_linear_stats do
 * not read ranks, fce_vp_loss reads ranks and vocab_total only; all_gather and context are read
 * by fce_vp_linear_ce alone (every other call ignores them: leave them NULL), which refuses a
 * NULL shard->all_gather. Fixed for the 1.x series (no struct_size: a shard has nothing to
 * append). */
typedef struct fce_vp_shard {
  int64_t ranks;       /* P >= 1: ranks of the step (the leading size of gathered_stats) */
  int64_t vocab_total; /* classes of the whole vocabulary, in [1, 2^31-1] */
  int64_t vocab_start; /* first class of this rank's shard, >= 0 */
  int64_t vocab_local; /* classes of this rank's shard, >= 1, vocab_start + vocab_local <=
                          vocab_total */
  fce_vp_all_gather_fn all_gather; /* fce_vp_linear_ce: the collective over the ranks */
  void* context;                   /* passed to all_gather as is */
} fce_vp_shard;

/* Phase 1 over this rank's logits [rows, vocab_local] (options->row_stride apart): writes
 * stats [rows, FCE_VP_STATS] (with options->vp_entropy, the shard's entropy sums among them).
 * One read of the logits (CUDA, class probabilities: two); no workspace. targets are the
 * global class indices (the same array on every rank), or this rank's shard of class
 * probabilities q [rows, vocab_local]. */
FCE_API fce_status fce_vp_stats(const fce_options* options, const fce_vp_shard* shard,
                                int64_t rows, const void* logits, const void* targets,
                                float* stats, void* stream);

/* Workspace bytes fce_vp_loss needs. */
FCE_API fce_status fce_vp_loss_workspace_size(const fce_options* options, int64_t ranks,
                                              int64_t rows, int64_t vocab_total,
                                              size_t* workspace_bytes);

/* Phase 3, the loss: loss ([1] for mean/sum, [rows] for none; required), lse [rows], z_loss [1]
 * argmax, accuracy, entropy (optional; entropy with options->vp_entropy), all in outputs
 * (required), as fce_forward writes them for the unsharded logits. error_flags as fce_forward (targets outside [0, vocab_total)) plus
 * FCE_FLAG_SHARDS_INCONSISTENT. Reads gathered_stats, the targets and, with class weights,
 * their targets' weights: never the logits. With class probabilities targets is not read (it
 * may be NULL) and outputs->accuracy is refused. */
FCE_API fce_status fce_vp_loss(const fce_options* options, const fce_vp_shard* shard,
                               int64_t rows, const void* targets, const float* gathered_stats,
                               const fce_outputs* outputs, void* workspace,
                               size_t workspace_bytes, void* stream);

/* Workspace bytes fce_vp_backward needs. */
FCE_API fce_status fce_vp_backward_workspace_size(const fce_options* options, int64_t ranks,
                                                  int64_t rows, int64_t vocab_total,
                                                  int64_t vocab_local, size_t* workspace_bytes);

/* Phase 3, the gradient of this rank's logits: grad_logits [rows, vocab_local]
 * (options->grad_row_stride apart; may be logits itself, in place, as for fce_backward), for
 * the upstream grad_output (as fce_backward: NULL = 1) and, optional, gradients->grad_lse and
 * ->grad_entropy (rule 18, every row; grad_entropy with options->vp_entropy). One read of the logits, one write. No
 * outputs: fce_vp_loss on the same gathered_stats reports the error flags (a row with an invalid
 * target, or of inconsistent shards, gets a NaN gradient row here). */
FCE_API fce_status fce_vp_backward(const fce_options* options, const fce_vp_shard* shard,
                                   int64_t rows, const void* logits, const void* targets,
                                   const float* gathered_stats, const fce_gradients* gradients,
                                   void* workspace, size_t workspace_bytes, void* stream);

/* Workspace of fce_vp_linear_stats (phase 1 of the fused linear + CE; min_bytes required,
 * optimal_bytes may be NULL). */
FCE_API fce_status fce_vp_linear_stats_workspace_size(const fce_options* options, int64_t rows,
                                                      int64_t hidden, int64_t vocab_local,
                                                      size_t* min_bytes, size_t* optimal_bytes);

/* Phase 1 of the fused linear + CE: the statistics of z = hidden · weightᵀ + bias over this
 * rank's weight [vocab_local, hidden] and bias [vocab_local] (or NULL), the logits made piece
 * by piece in the workspace as fce_linear_ce makes them (2·N·D·vocab_local FLOPs). */
FCE_API fce_status fce_vp_linear_stats(const fce_options* options, const fce_vp_shard* shard,
                                       int64_t rows, int64_t hidden, const void* hidden_states,
                                       const void* weight, const void* bias, const void* targets,
                                       float* stats, void* workspace, size_t workspace_bytes,
                                       void* stream);

/* Workspace of fce_vp_linear_backward for these sizes, grad_hidden_dtype and options (min_bytes
 * required, optimal_bytes may be NULL). */
FCE_API fce_status fce_vp_linear_backward_workspace_size(const fce_options* options,
                                                         int64_t ranks, int64_t rows,
                                                         int64_t hidden, int64_t vocab_total,
                                                         int64_t vocab_local,
                                                         int32_t grad_hidden_dtype,
                                                         size_t* min_bytes,
                                                         size_t* optimal_bytes);

/* Phase 3 of the fused linear + CE, the gradients of this rank (6·N·D·vocab_local FLOPs: the
 * logits are made again, piece by piece):
 *   grad_hidden   this rank's partial ∂h [rows, hidden] dense, of grad_hidden_dtype
 *                 (FCE_FLOAT32, or options->dtype), always overwritten; the caller sums it
 *                 over ranks (all-reduce; float32 keeps that sum exact to float32); or NULL.
 *   grad_weight   ∂W of this rank's rows [vocab_local, hidden], grad_bias ∂b [vocab_local]: as
 *                 fce_linear_ce's (dtype or float32 by grad_weight_fp32; options->accumulate).
 * At least one gradient pointer must be given (with rows = 0 none need be: a grad_hidden of no
 * element may be NULL). No outputs, as fce_vp_backward. */
FCE_API fce_status fce_vp_linear_backward(const fce_options* options,
                                          const fce_vp_shard* shard, int64_t rows,
                                          int64_t hidden, const void* hidden_states,
                                          const void* weight, const void* bias,
                                          const void* targets, const float* gathered_stats,
                                          const fce_gradients* gradients, void* workspace,
                                          size_t workspace_bytes, void* stream);

/* The fused step (0.5): phases 1 to 3 of the linear CE in ONE call that runs the collective
 * itself, through the caller's all-gather, so that the logits are made once (6·N·D·vocab_local
 * FLOPs in all, against 8·N·D·vocab_local for fce_vp_linear_stats + fce_vp_linear_backward).
 * The call enqueues, per token chunk of its plan: the chunk's logits in the workspace, their
 * statistics, the all-gather of the chunk's statistics (shard->all_gather), the combination, the
 * gradient of the chunk's logits in place, and its share of the gradients; after the last chunk
 * the loss. A ranks-wide all-gather per chunk is thus issued from inside the call, through
 * shard->all_gather (fce_vp_all_gather_fn, above) with shard->context.
 *
 * Every rank must issue the same sequence of all-gathers: the plan (and so the chunking) is a
 * function of the options, ranks, rows, hidden, vocab_total, the gradients asked for (which
 * pointers are non-NULL), grad_hidden_dtype, the backend and workspace_bytes, never of
 * vocab_start or vocab_local: all ranks pass the same values of these, the same workspace_bytes
 * included (the query's answer is the same on every rank when no shard is wider than
 * ⌈vocab_total / ranks⌉; a wider shard needs more workspace for the same plan: pass every rank
 * the answer for the widest shard, since a rank whose workspace is too small for its own shard
 * fails with FCE_ERROR_WORKSPACE_TOO_SMALL while the others wait in their all-gather). The
 * CUDA plans:
 *   - token chunks (with a gradient, when workspace_bytes holds the full-speed chunk of a shard
 *     ⌈vocab_total / ranks⌉ wide: optimal_bytes): per chunk as above, 6·N·D·vocab_local FLOPs;
 *     grad_weight accumulates over the chunks as fce_linear_ce's token-chunk plans do (a 16-bit
 *     one in place over at most min(64, max(1, 3·W/N)) chunks, W = ⌈vocab_total / ranks⌉;
 *     a float32 one over any number);
 *   - gather-once (no gradient, or a smaller workspace, down to min_bytes): fce_vp_linear_stats
 *     for all rows, ONE all-gather, fce_vp_loss, then fce_vp_linear_backward (8·N·D·vocab_local).
 * The CPU backend always runs the gather-once plan.
 *
 * Arguments: those of fce_vp_linear_stats and fce_vp_linear_backward together (the same checks
 * and messages, naming fce_vp_linear_ce): outputs (required; loss required), lse, z_loss, argmax
 * and accuracy, error_flags as fce_vp_loss writes them (identical on every rank); grad_output,
 * grad_hidden (this rank's PARTIAL dloss/dh of grad_hidden_dtype: all-reduce it), grad_weight,
 * grad_bias as fce_vp_linear_backward; all gradient pointers NULL: the loss only. The loss and
 * the gradients are those of the unsharded fce_linear_ce to float32 rounding (and of the
 * two-phase calls: the gather-once plan runs exactly those). shard->all_gather is required
 * (NULL: FCE_ERROR_NULL_POINTER naming shard->all_gather). Deterministic for a given
 * workspace_bytes and rank order. */

/* Workspace of fce_vp_linear_ce (min_bytes required, optimal_bytes may be NULL): with_grad
 * nonzero when any gradient will be asked for (all of them assumed). min_bytes runs the
 * gather-once plan (on CUDA a few MiB plus, for a 16-bit grad_hidden_dtype, rows·hidden·4);
 * optimal_bytes on CUDA with a gradient the token-chunk plan (about 1 GiB at large-vocabulary
 * sizes; with class probabilities the gather-once plan's, the one they run). vocab_local enters only through max(vocab_local, ⌈vocab_total / ranks⌉). */
FCE_API fce_status fce_vp_linear_ce_workspace_size(const fce_options* options, int64_t ranks,
                                                   int64_t rows, int64_t hidden,
                                                   int64_t vocab_total, int64_t vocab_local,
                                                   int with_grad, int32_t grad_hidden_dtype,
                                                   size_t* min_bytes, size_t* optimal_bytes);

FCE_API fce_status fce_vp_linear_ce(const fce_options* options, const fce_vp_shard* shard,
                                    int64_t rows, int64_t hidden, const void* hidden_states,
                                    const void* weight, const void* bias, const void* targets,
                                    const fce_outputs* outputs, const fce_gradients* gradients,
                                    void* workspace, size_t workspace_bytes, void* stream);

/* ----------------------------------------------------------- distillation ---- */
/*
 * Distillation against a teacher: a divergence between the student's and the teacher's
 * softmax per row, and its gradient with respect to the student only (the teacher is a
 * constant), without the logits ever held whole (docs/semantics.md rule 20). Per row, with the
 * student's scaled, capped logits a (options->logit_scale and ->softcap as for fce_forward) and
 * the teacher's logits t put through the SAME scale and cap, and T = teacher->temperature:
 *   log p = log_softmax(a / T)   (student),   log q = log_softmax(t / T)   (teacher);
 *   FCE_DIVERGENCE_FORWARD_KL  KL(q || p) = Σ_j q_j (log q_j − log p_j);
 *   FCE_DIVERGENCE_REVERSE_KL  KL(p || q) = Σ_j p_j (log p_j − log q_j);
 *   FCE_DIVERGENCE_JSD         Liger's generalised JSD with β = teacher->beta, m = β q + (1−β) p:
 *                              β KL(q || m) + (1−β) KL(p || m) for 0 < β < 1, and, as Liger
 *                              defines its ends, KL(q || p) at β = 0 and KL(p || q) at β = 1.
 * No T² factor (Liger applies none): scale grad_output for Hinton's.
 * Rows: with targets, a row whose target equals options->ignore_index is not counted (loss 0,
 * zero gradient row); every other value counts (targets are not classes here and are not range
 * checked); targets NULL: every row counts. Reductions: mean = the sum over counted rows / their
 * number (Liger's batchmean over non-ignored tokens; 0 with a zero gradient when none counts),
 * sum, none ([rows], 0 for rows not counted). outputs (required): loss (required), lse
 * (optional: the student's log-sum-exp of a / T, every row), error_flags (optional, never set);
 * the other outputs are refused. options->class_weights, label_smoothing, z_loss_scale,
 * token_scaling and shift_seq_len, and gradients->grad_lse and grad_entropy are refused with
 * FCE_ERROR_UNSUPPORTED naming the call and the field.
 */
typedef enum fce_divergence {
  FCE_DIVERGENCE_FORWARD_KL = 0, /* KL(teacher || student) */
  FCE_DIVERGENCE_REVERSE_KL = 1, /* KL(student || teacher) */
  FCE_DIVERGENCE_JSD = 2         /* generalised JSD with beta, Liger's definition */
} fce_divergence;

/* The teacher of a distillation call, in the backend's memory, of the student's dtype
 * (options->dtype). Start from FCE_TEACHER_INIT; fields are only ever appended, and struct_size
 * must be the size of some version's struct (FCE_TEACHER_SIZE_V1_0). fce_distill reads logits
 * and row_stride (hidden_states and weight must be NULL), as do fce_vp_distill_stats and
 * fce_vp_distill_backward (their logits this rank's shard); fce_linear_distill reads
 * hidden_states, weight, hidden and hidden_row_stride (logits must be NULL, row_stride 0), as do
 * fce_vp_linear_distill_* (weight this rank's shard [vocab_local, hidden]); fce_vp_distill_loss
 * reads none of them and takes either kind. */
typedef struct fce_teacher {
  size_t struct_size;        /* sizeof(fce_teacher) */
  int32_t divergence;        /* fce_divergence: FCE_DIVERGENCE_FORWARD_KL */
  float beta;                /* β in [0, 1], read by FCE_DIVERGENCE_JSD (checked always): 0.5 */
  float temperature;         /* T, finite and > 0, divides both rows' logits: 1 */
  int32_t reserved0;         /* must be 0 */
  const void* logits;        /* fce_distill: t [rows, row_stride] */
  int64_t row_stride;        /* fce_distill: elements between rows of logits; 0 = vocab */
  const void* hidden_states; /* fce_linear_distill: [rows, hidden_row_stride] */
  const void* weight;        /* fce_linear_distill: [vocab, hidden] row-major, no bias */
  int64_t hidden;            /* fce_linear_distill: the teacher's hidden size, >= 1 */
  int64_t hidden_row_stride; /* fce_linear_distill: elements between rows of hidden_states;
                                0 = hidden */
} fce_teacher;

#define FCE_TEACHER_INIT                                              \
  {                                                                   \
    sizeof(fce_teacher),       /* struct_size: this header's struct */ \
    FCE_DIVERGENCE_FORWARD_KL, /* divergence */                       \
    0.5f,                      /* beta (JSD): 0.5 */                  \
    1.0f,                      /* temperature: 1 */                   \
    0,                         /* reserved0: must be 0 */             \
    NULL,                      /* logits */                           \
    0,                         /* row_stride: vocab (dense) */        \
    NULL,                      /* hidden_states */                    \
    NULL,                      /* weight */                           \
    0,                         /* hidden */                           \
    0                          /* hidden_row_stride: hidden (dense) */ \
  }

/* sizeof(fce_teacher) in its first version (on LP64 and LLP64 targets). */
#define FCE_TEACHER_SIZE_V1_0 72

/* Workspace bytes fce_distill needs for these options, teacher and sizes. */
FCE_API fce_status fce_distill_workspace_size(const fce_options* options,
                                              const fce_teacher* teacher, int64_t rows,
                                              int64_t vocab, size_t* workspace_bytes);

/* The divergence over given logits: student a [rows, options->row_stride] (logits) and teacher
 * t (teacher->logits [rows, teacher->row_stride]), targets [rows] of options->target_dtype or
 * NULL. gradients (optional): grad_logits [rows, options->grad_row_stride] (may be logits
 * itself, in place, as for fce_forward) for the upstream grad_output; the other fields NULL.
 * CUDA: three launches (the count of the rows that count, the row kernel, one block per row,
 * reading each row two or three times, mostly from L2, and the reduction of the row losses). */
FCE_API fce_status fce_distill(const fce_options* options, const fce_teacher* teacher,
                               int64_t rows, int64_t vocab, const void* logits,
                               const void* targets, const fce_outputs* outputs,
                               const fce_gradients* gradients, void* workspace,
                               size_t workspace_bytes, void* stream);

/* Workspace of fce_linear_distill (min_bytes required, optimal_bytes may be NULL); with_grad
 * nonzero when any gradient will be asked for. */
FCE_API fce_status fce_linear_distill_workspace_size(const fce_options* options,
                                                     const fce_teacher* teacher, int64_t rows,
                                                     int64_t hidden, int64_t vocab,
                                                     int with_grad, size_t* min_bytes,
                                                     size_t* optimal_bytes);

/* The divergence of z = hidden · weightᵀ (student, hidden_states [rows, hidden] with
 * options->hidden_row_stride, weight [vocab, hidden], no bias) against the teacher's
 * teacher->hidden_states · teacher->weightᵀ, both made piece by piece in the workspace (token
 * chunks: per chunk the student's and the teacher's logits, the student's gradient in place,
 * then its share of ∂h and ∂W, as fce_linear_ce's token-chunk plan). gradients (optional):
 * grad_hidden, grad_weight (the student's; dtype or float32 by options->grad_weight_fp32,
 * options->accumulate) and grad_output, as fce_linear_ce; grad_bias must be NULL. The loss and
 * the gradients are fce_distill's on the logits the GEMMs make, to float32 rounding. CUDA: a
 * 16-bit grad_weight without grad_weight_fp32 needs the workspace of the token-chunk plan
 * (optimal_bytes): a smaller one is refused with FCE_ERROR_UNSUPPORTED (fce_linear_ce would
 * take its vocabulary-sliced plan there), as is a 16-bit grad_weight over more token chunks
 * than the chunk rule allows; grad_weight_fp32 lifts both. */
FCE_API fce_status fce_linear_distill(const fce_options* options, const fce_teacher* teacher,
                                      int64_t rows, int64_t hidden, int64_t vocab,
                                      const void* hidden_states, const void* weight,
                                      const void* targets, const fce_outputs* outputs,
                                      const fce_gradients* gradients, void* workspace,
                                      size_t workspace_bytes, void* stream);

/* -------------------------------------- vocabulary-parallel distillation ---- */
/*
 * fce_distill with the vocabulary sharded over ranks (docs/semantics.md rule 22): each of P
 * ranks holds classes [vocab_start, vocab_start + vocab_local) of vocab_total of BOTH the
 * student's logits and the teacher's (teacher->logits is this rank's shard [rows, vocab_local],
 * teacher->row_stride apart as for fce_distill). A step is a number of statistics ROUNDS, each
 * a call and a collective the caller runs, then the loss and the gradient of this rank's
 * student columns:
 *
 *   for round = 1 .. R (fce_vp_distill_rounds):
 *     fce_vp_distill_stats(round): each rank writes FCE_VP_DISTILL_STATS float32 per row of
 *       partial statistics of its shards into stats [rows, FCE_VP_DISTILL_STATS]; round 2 also
 *       reads round 1's gathered statistics;
 *     the caller ALL-GATHERS the ranks' stats into gathered [ranks, rows, FCE_VP_DISTILL_STATS]
 *       (rank-major, in one rank order that every rank sees, as for fce_vp_stats);
 *   fce_vp_distill_loss and fce_vp_distill_backward: from the LAST round's gathered statistics.
 *
 * R = 1 for FCE_DIVERGENCE_FORWARD_KL and FCE_DIVERGENCE_REVERSE_KL (and for the JSD with β = 0
 * or β = 1, which are those): a shard's maxima and Σexp of both rows and one cross sum give the
 * whole row's divergence. R = 2 for the JSD with 0 < β < 1: its log m_j = log(β q_j + (1−β)
 * p_j) needs both rows' global log-sum-exp first (round 1), then each shard sums its share of
 * KL(q || m) and KL(p || m) (round 2, whose statistics also carry round 1's combination).
 *
 * The loss, the lse and the gradient are those of the unsharded fce_distill over the whole rows
 * to float32 rounding, identical on every rank (the same gathered statistics give the same bits)
 * and deterministic. Options, rows and refusals are fce_distill's (class_weights,
 * label_smoothing, z_loss_scale, token_scaling, shift_seq_len, batch_invariant, vp_entropy and
 * class-probability targets, outputs other than loss, lse and error_flags, and gradients other
 * than grad_logits and grad_output are refused with FCE_ERROR_UNSUPPORTED naming the call and
 * the field); targets [rows] (the same on every rank, or NULL: every row counts) are read by the
 * loss and the backward only: a row whose target is options->ignore_index gets loss 0 and a zero
 * gradient row. All ranks pass the same options, teacher (divergence, beta, temperature), rows,
 * vocab_total and targets. If the gathered statistics do not tile [0, vocab_total) (their
 * vocab_local do not sum to vocab_total, or one shard's statistics were gathered twice), or are
 * not the last round's (round 1's where the divergence needs 2, or statistics of different
 * round-1 combinations), the rows concerned get a NaN lse and, when counted, a NaN loss and
 * gradient row (a row not counted keeps loss 0 and its zero gradient), and fce_vp_distill_loss
 * sets FCE_FLAG_SHARDS_INCONSISTENT in outputs->error_flags.
 *
 * Sizes as for the fce_vp_* calls: rows >= 0 (0: the empty problem), ranks >= 1,
 * 1 <= vocab_local, 0 <= vocab_start, vocab_start + vocab_local <= vocab_total <= 2^31-1.
 * stats and gathered are float32 in the backend's memory, aligned to 16 bytes. Same promises as
 * every call: caller-owned memory, one stream, no allocation, no host synchronisation,
 * graph-capturable.
 */
#define FCE_VP_DISTILL_STATS 8 /* float32 per row of a shard's statistics (layout internal) */

/* *rounds = the statistics rounds of this teacher's divergence: 1, or 2 for the JSD with
 * 0 < beta < 1. Reads teacher->divergence and ->beta (the teacher is checked as by fce_distill;
 * its logits are not read). */
FCE_API fce_status fce_vp_distill_rounds(const fce_teacher* teacher, int32_t* rounds);

/* Round `round` (1 .. fce_vp_distill_rounds) of the statistics of this rank's shards: the
 * student's logits [rows, vocab_local] (options->row_stride apart) and teacher->logits [rows,
 * vocab_local] (teacher->row_stride apart), both of options->dtype, into stats [rows,
 * FCE_VP_DISTILL_STATS]. previous: NULL in round 1; in round 2 the gathered statistics of round
 * 1, [shard->ranks, rows, FCE_VP_DISTILL_STATS] (required). Reads the shard's ranks (round 2),
 * vocab_total, vocab_start and vocab_local. It takes no targets: every row's statistics are
 * written, a row not counted too. No workspace. CUDA: one launch, one block per row, reading
 * both rows twice (round 1) or once (round 2). */
FCE_API fce_status fce_vp_distill_stats(const fce_options* options, const fce_teacher* teacher,
                                        const fce_vp_shard* shard, int32_t round, int64_t rows,
                                        const void* logits, const float* previous, float* stats,
                                        void* stream);

/* Workspace bytes fce_vp_distill_loss needs. */
FCE_API fce_status fce_vp_distill_loss_workspace_size(const fce_options* options,
                                                      const fce_teacher* teacher, int64_t ranks,
                                                      int64_t rows, int64_t vocab_total,
                                                      size_t* workspace_bytes);

/* The loss from the last round's gathered statistics [shard->ranks, rows,
 * FCE_VP_DISTILL_STATS]: outputs (required): loss ([1] for mean / sum, [rows] for none;
 * required), lse (optional [rows]: the student's log-sum-exp of a / T, every row), error_flags
 * (optional: FCE_FLAG_SHARDS_INCONSISTENT), as fce_distill writes them for the whole rows.
 * targets [rows] or NULL as above. Reads shard->ranks and ->vocab_total, never the logits
 * (teacher->logits is not read and may be NULL; the teacher of fce_vp_linear_distill_*, with
 * its hidden states and weight, is accepted too). */
FCE_API fce_status fce_vp_distill_loss(const fce_options* options, const fce_teacher* teacher,
                                       const fce_vp_shard* shard, int64_t rows,
                                       const void* targets, const float* gathered,
                                       const fce_outputs* outputs, void* workspace,
                                       size_t workspace_bytes, void* stream);

/* Workspace bytes fce_vp_distill_backward needs. */
FCE_API fce_status fce_vp_distill_backward_workspace_size(const fce_options* options,
                                                          const fce_teacher* teacher,
                                                          int64_t ranks, int64_t rows,
                                                          int64_t vocab_total,
                                                          int64_t vocab_local,
                                                          size_t* workspace_bytes);

/* The gradient of this rank's student columns from the last round's gathered statistics:
 * gradients (required): grad_logits [rows, vocab_local] (options->grad_row_stride apart; may be
 * logits itself, in place) for the upstream grad_output (NULL = 1; [rows] for reduction none),
 * the other fields NULL. Reads logits and teacher->logits (this rank's shards) once. No outputs:
 * fce_vp_distill_loss on the same gathered statistics reports the error flags (a row of
 * inconsistent shards gets a NaN gradient row here). */
FCE_API fce_status fce_vp_distill_backward(const fce_options* options, const fce_teacher* teacher,
                                           const fce_vp_shard* shard, int64_t rows,
                                           const void* logits, const void* targets,
                                           const float* gathered,
                                           const fce_gradients* gradients, void* workspace,
                                           size_t workspace_bytes, void* stream);

/* The same step from HIDDEN STATES, so that neither the student's logits nor the teacher's
 * exist whole: this rank's logits z = hidden_states · weightᵀ (weight: its shard [vocab_local,
 * hidden] of the student's weight rows [vocab_start, vocab_start + vocab_local), no bias) and
 * t = teacher->hidden_states · teacher->weightᵀ (teacher->weight: its shard [vocab_local,
 * teacher->hidden] of the teacher's), made piece by piece in the workspace as fce_linear_distill
 * makes them (token chunks):
 *
 *   for round = 1 .. R (fce_vp_distill_rounds):
 *     fce_vp_linear_distill_stats(round), then the caller's all-gather, as above;
 *   fce_vp_distill_loss: the loss from the last round's gathered statistics (no linear call:
 *     it reads the statistics only, and takes the same teacher);
 *   fce_vp_linear_distill_backward: the student's gradients of this rank.
 *
 * The statistics are those fce_vp_distill_stats writes for the logits the GEMMs make, and the
 * loss and the gradients fce_linear_distill's over the whole vocabulary, to float32 rounding.
 * The teacher is read as by fce_linear_distill (hidden_states [rows, teacher->hidden_row_stride]
 * of options->dtype, weight, hidden; logits must be NULL and row_stride 0); options, rounds,
 * targets and refusals as for fce_vp_distill_* (options->hidden_row_stride is the student's
 * hidden stride); `bias` must be NULL (FCE_ERROR_UNSUPPORTED: the distillation's linear layers
 * have none). The workspace holds a token chunk of both logits: min_bytes for the smallest,
 * optimal_bytes for full speed; any size between works, and gives the same bits (CPU) or the
 * plan's chunk for that size (CUDA, as fce_linear_distill). */

/* Workspace of fce_vp_linear_distill_stats (min_bytes required, optimal_bytes may be NULL):
 * reads teacher->hidden. */
FCE_API fce_status fce_vp_linear_distill_stats_workspace_size(const fce_options* options,
                                                              const fce_teacher* teacher,
                                                              int64_t rows, int64_t hidden,
                                                              int64_t vocab_local,
                                                              size_t* min_bytes,
                                                              size_t* optimal_bytes);

/* Round `round` of the statistics of this rank's shards from hidden states: hidden_states
 * [rows, hidden] (options->hidden_row_stride apart), weight [vocab_local, hidden], bias NULL,
 * previous and stats as for fce_vp_distill_stats (2·N·vocab_local·(hidden + teacher->hidden)
 * FLOPs: both logits). No targets: every row's statistics are written. */
FCE_API fce_status fce_vp_linear_distill_stats(const fce_options* options,
                                               const fce_teacher* teacher,
                                               const fce_vp_shard* shard, int32_t round,
                                               int64_t rows, int64_t hidden,
                                               const void* hidden_states, const void* weight,
                                               const void* bias, const float* previous,
                                               float* stats, void* workspace,
                                               size_t workspace_bytes, void* stream);

/* Workspace of fce_vp_linear_distill_backward for these sizes, grad_hidden_dtype and options
 * (min_bytes required, optimal_bytes may be NULL); reads teacher->hidden. */
FCE_API fce_status fce_vp_linear_distill_backward_workspace_size(const fce_options* options,
                                                                 const fce_teacher* teacher,
                                                                 int64_t ranks, int64_t rows,
                                                                 int64_t hidden,
                                                                 int64_t vocab_total,
                                                                 int64_t vocab_local,
                                                                 int32_t grad_hidden_dtype,
                                                                 size_t* min_bytes,
                                                                 size_t* optimal_bytes);

/* The student's gradients of this rank from the last round's gathered statistics
 * [shard->ranks, rows, FCE_VP_DISTILL_STATS] (both logits are made again, piece by piece:
 * 2·N·vocab_local·(3·hidden + teacher->hidden) FLOPs with both gradients):
 *   grad_hidden   this rank's partial ∂h = ∂z_shard · weight [rows, hidden] dense, of
 *                 gradients->grad_hidden_dtype (FCE_FLOAT32, or options->dtype), always
 *                 overwritten; the caller sums it over ranks (all-reduce), as for
 *                 fce_vp_linear_backward; or NULL.
 *   grad_weight   ∂W of this rank's rows [vocab_local, hidden] = ∂z_shardᵀ · hidden_states, as
 *                 fce_linear_distill's (dtype or float32 by options->grad_weight_fp32;
 *                 options->accumulate), or NULL.
 * At least one of them must be given (with rows = 0 neither need be); grad_output (NULL = 1;
 * [rows] for reduction none) as fce_vp_distill_backward; grad_logits, grad_bias, grad_lse and
 * grad_entropy are refused. targets [rows] or NULL as for fce_vp_distill_backward. No outputs:
 * fce_vp_distill_loss on the same gathered statistics reports the error flags (a row of
 * inconsistent shards gets NaN gradients here). CUDA: a 16-bit grad_weight without
 * grad_weight_fp32 as fce_linear_distill's (refused with FCE_ERROR_UNSUPPORTED where that needs
 * fce_linear_ce's vocabulary-sliced plan). */
FCE_API fce_status fce_vp_linear_distill_backward(const fce_options* options,
                                                  const fce_teacher* teacher,
                                                  const fce_vp_shard* shard, int64_t rows,
                                                  int64_t hidden, const void* hidden_states,
                                                  const void* weight, const void* bias,
                                                  const void* targets, const float* gathered_stats,
                                                  const fce_gradients* gradients, void* workspace,
                                                  size_t workspace_bytes, void* stream);

/* --------------------------------------------------------- upstream scale ---- */
/*
 * grad[i] = grad[i] * (*grad_output) for i < count, in place: applies an upstream gradient
 * that was not known when a forward wrote the gradient with grad_output NULL (= 1), e.g. the
 * gradient fce_forward wrote in its one pass, or fce_linear_ce's grad_hidden / grad_weight /
 * grad_bias, once autograd hands over the scalar.
 *   backend       FCE_BACKEND_CUDA or FCE_BACKEND_CPU (memory and stream as for every call)
 *   dtype         FCE_FLOAT32, FCE_FLOAT16 or FCE_BFLOAT16: the elements of grad
 *   count         number of elements, >= 0 (0: nothing happens)
 *   grad          [count] elements, aligned to the element size (dense: scale each row of a
 *                 strided buffer with its own call, or the whole span)
 *   grad_output   ONE float32 in the backend's memory (required)
 * CUDA: the scalar is read on the device, never by the host. When it is exactly 1 (a plain
 * loss.backward()) every block returns at once without touching grad: the call costs one
 * launch. Otherwise one read and one write of grad: float32 product, rounded once to dtype (so
 * a 16-bit gradient written for g = 1 and scaled here is rounded twice when g is not a power
 * of two). Asynchronous, graph-capturable, no allocation, no workspace. Calls that scale the
 * same buffer must be ordered by the caller.
 */
FCE_API fce_status fce_scale_gradient(int32_t backend, int32_t dtype, int64_t count, void* grad,
                                      const float* grad_output, void* stream);

/* ---------------------------------------------------------------- backends ---- */
/* 1 when this build has the CUDA backend, a CUDA device is visible and cuBLASLt is loaded,
 * else 0. cuBLASLt is not linked: the first call that needs the CUDA backend looks for
 * libcublasLt.so.<CUDA major> (FUSEDCE_CUBLASLT=<file> when set; else one already loaded in the
 * process; the nvidia-cublas wheel beside the library; the dynamic loader's path; for a source
 * build, the toolkit it was built with). Without it the CPU backend works and every CUDA call
 * returns FCE_ERROR_BACKEND_UNAVAILABLE naming the library and where it looked. */
FCE_API int fce_cuda_available(void);

/* One line naming what this library was built with and runs on, e.g. "fusedce 0.5.0; backends:
 * cpu, cuda (sm 80-real 90-real 100-real 120, CUDA 13.0.88; device visible); cuBLASLt:
 * /usr/local/cuda/lib64/libcublasLt.so.13; BLAS: OpenBLAS (OpenBLAS 0.3.21 DYNAMIC_ARCH
 * NO_AFFINITY Haswell MAX_THREADS=64, 2 threads)" (a build with the CUDA backend looks for
 * cuBLASLt here, and names the file or why none loaded). Static storage: valid for the
 * library's lifetime. (0.3) */
FCE_API const char* fce_build_info(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FUSEDCE_H */
