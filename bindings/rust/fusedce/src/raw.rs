//! Raw-pointer calls for device memory (CUDA backend) or any memory the caller vouches for:
//! the C functions one for one, with a struct of pointers (null by default) instead of a long
//! argument list. Nothing is checked on the Rust side; the library checks what it can (nulls,
//! alignment, sizes, overlap, workspace size) and returns the error that names the argument.
//!
//! ```no_run
//! # use std::ffi::c_void;
//! # fn demo(d_logits: *const c_void, d_targets: *const c_void, d_loss: *mut f32,
//! #         d_grad: *mut c_void, stream: *mut c_void) -> fusedce::Result<()> {
//! use fusedce::{raw, Backend, Options};
//! let opts = Options::new().backend(Backend::Cuda);
//! let (rows, vocab) = (4096, 128_256);
//! // A non-zero size means: allocate that much device memory and pass it as `workspace`.
//! let _bytes = fusedce::forward_workspace_size(&opts, rows, vocab)?;
//! unsafe {
//!     raw::forward(&opts, rows as i64, vocab as i64, &raw::ForwardArgs {
//!         logits: d_logits, targets: d_targets, loss: d_loss, grad_logits: d_grad, stream,
//!         ..Default::default()
//!     })?;
//! }
//! # Ok(()) }
//! ```
use std::ffi::c_void;
use std::ptr;

use crate::error::{check, Result};
use crate::options::{Backend, Dtype, Options};
use crate::sys;

/// A `cudaStream_t`, as the C ABI takes it (`void*`); null is the legacy default stream.
pub type Stream = *mut c_void;

/// Pointers of `fce_forward` (see include/fusedce.h). `Default` makes every one null.
#[derive(Clone, Copy, Debug)]
pub struct ForwardArgs {
    /// z `[rows, row_stride]` of options' dtype. Required.
    pub logits: *const c_void,
    /// y `[rows]` of options' target dtype. Required.
    pub targets: *const c_void,
    /// float32 `[1]` (mean/sum) or `[rows]` (none). Required.
    pub loss: *mut f32,
    /// Optional float32 `[rows]`.
    pub lse: *mut f32,
    /// Optional float32 `[1]`.
    pub z_loss: *mut f32,
    /// Optional int64 `[rows]`: each row's predicted class (the argmax of its scaled, capped
    /// logits; lowest index among equal maxima, NaN the largest), −1 for ignored rows. Goes to
    /// `fce_options::argmax`; null leaves the options' own (null unless set with
    /// [`Options::from_raw`]). Since 0.3.
    pub argmax: *mut i64,
    /// Optional float32: `[1]` for mean/sum (the fraction of non-ignored rows whose argmax is
    /// the target, unweighted), `[rows]` for none (1 or 0 per row). Goes to
    /// `fce_options::accuracy` like `argmax`. Since 0.3.
    pub accuracy: *mut f32,
    /// Optional `[rows, grad_row_stride]` of dtype; may equal `logits` (in place).
    pub grad_logits: *mut c_void,
    /// Optional float32 `[1]` or `[rows]`; null = 1.
    pub grad_output: *const f32,
    /// Optional uint32 the call ORs flag bits into.
    pub error_flags: *mut u32,
    /// Scratch of `workspace_bytes` (16-byte aligned), at least the query's size.
    pub workspace: *mut c_void,
    /// Size of `workspace`.
    pub workspace_bytes: usize,
    /// The stream the work is enqueued on (CUDA; ignored by the CPU backend).
    pub stream: Stream,
}

impl Default for ForwardArgs {
    fn default() -> Self {
        ForwardArgs {
            logits: ptr::null(),
            targets: ptr::null(),
            loss: ptr::null_mut(),
            lse: ptr::null_mut(),
            z_loss: ptr::null_mut(),
            argmax: ptr::null_mut(),
            accuracy: ptr::null_mut(),
            grad_logits: ptr::null_mut(),
            grad_output: ptr::null(),
            error_flags: ptr::null_mut(),
            workspace: ptr::null_mut(),
            workspace_bytes: 0,
            stream: ptr::null_mut(),
        }
    }
}

/// Pointers of `fce_backward`. `Default` makes every one null.
#[derive(Clone, Copy, Debug)]
pub struct BackwardArgs {
    /// z `[rows, row_stride]`. Required.
    pub logits: *const c_void,
    /// y `[rows]`. Required.
    pub targets: *const c_void,
    /// float32 `[rows]` saved by forward with the same options. Required.
    pub lse: *const f32,
    /// Optional float32 `[1]` or `[rows]`; null = 1.
    pub grad_output: *const f32,
    /// `[rows, grad_row_stride]` of dtype; may equal `logits`. Required.
    pub grad_logits: *mut c_void,
    /// Optional uint32 flag word.
    pub error_flags: *mut u32,
    /// Scratch (16-byte aligned).
    pub workspace: *mut c_void,
    /// Size of `workspace`.
    pub workspace_bytes: usize,
    /// The stream.
    pub stream: Stream,
}

impl Default for BackwardArgs {
    fn default() -> Self {
        BackwardArgs {
            logits: ptr::null(),
            targets: ptr::null(),
            lse: ptr::null(),
            grad_output: ptr::null(),
            grad_logits: ptr::null_mut(),
            error_flags: ptr::null_mut(),
            workspace: ptr::null_mut(),
            workspace_bytes: 0,
            stream: ptr::null_mut(),
        }
    }
}

/// Pointers of `fce_linear_ce`. `Default` makes every one null.
#[derive(Clone, Copy, Debug)]
pub struct LinearCeArgs {
    /// h `[rows, hidden_row_stride]` of dtype. Required.
    pub hidden_states: *const c_void,
    /// W `[vocab, hidden]` row-major of dtype. Required.
    pub weight: *const c_void,
    /// Optional b `[vocab]` of dtype.
    pub bias: *const c_void,
    /// y `[rows]`. Required.
    pub targets: *const c_void,
    /// float32 `[1]` or `[rows]`. Required.
    pub loss: *mut f32,
    /// Optional float32 `[rows]`.
    pub lse: *mut f32,
    /// Optional float32 `[1]`.
    pub z_loss: *mut f32,
    /// Optional int64 `[rows]`: the predicted classes, as [`ForwardArgs::argmax`]. Since 0.3.
    pub argmax: *mut i64,
    /// Optional float32 `[1]` (mean/sum) or `[rows]` (none): the accuracy, as
    /// [`ForwardArgs::accuracy`]. Since 0.3.
    pub accuracy: *mut f32,
    /// Optional `[rows, hidden]` dense of dtype.
    pub grad_hidden: *mut c_void,
    /// Optional `[vocab, hidden]` of dtype, or float32 with grad_weight_fp32.
    pub grad_weight: *mut c_void,
    /// Optional `[vocab]`, the type of grad_weight; needs a bias.
    pub grad_bias: *mut c_void,
    /// Optional float32 `[1]` or `[rows]`; null = 1.
    pub grad_output: *const f32,
    /// Optional uint32 flag word.
    pub error_flags: *mut u32,
    /// Scratch (16-byte aligned), at least the query's min_bytes.
    pub workspace: *mut c_void,
    /// Size of `workspace`.
    pub workspace_bytes: usize,
    /// The stream.
    pub stream: Stream,
}

impl Default for LinearCeArgs {
    fn default() -> Self {
        LinearCeArgs {
            hidden_states: ptr::null(),
            weight: ptr::null(),
            bias: ptr::null(),
            targets: ptr::null(),
            loss: ptr::null_mut(),
            lse: ptr::null_mut(),
            z_loss: ptr::null_mut(),
            argmax: ptr::null_mut(),
            accuracy: ptr::null_mut(),
            grad_hidden: ptr::null_mut(),
            grad_weight: ptr::null_mut(),
            grad_bias: ptr::null_mut(),
            grad_output: ptr::null(),
            error_flags: ptr::null_mut(),
            workspace: ptr::null_mut(),
            workspace_bytes: 0,
            stream: ptr::null_mut(),
        }
    }
}

/// An `fce_outputs` of these pointers (null: not written).
pub(crate) fn outputs(
    loss: *mut f32,
    lse: *mut f32,
    z_loss: *mut f32,
    argmax: *mut i64,
    accuracy: *mut f32,
    error_flags: *mut u32,
) -> sys::fce_outputs {
    sys::fce_outputs {
        struct_size: std::mem::size_of::<sys::fce_outputs>(),
        loss,
        lse,
        z_loss,
        argmax,
        accuracy,
        error_flags,
        entropy: ptr::null_mut(),
    }
}

/// An `fce_outputs` that writes the error flags alone (the gradient-only calls).
pub(crate) fn flag_outputs(error_flags: *mut u32) -> sys::fce_outputs {
    let null = ptr::null_mut();
    outputs(null, null, null, ptr::null_mut(), null, error_flags)
}

/// An `fce_gradients` asking for nothing (grad_hidden_dtype FCE_FLOAT32, upstream 1).
fn no_gradients() -> sys::fce_gradients {
    sys::fce_gradients {
        struct_size: std::mem::size_of::<sys::fce_gradients>(),
        grad_output: ptr::null(),
        grad_logits: ptr::null_mut(),
        grad_hidden: ptr::null_mut(),
        grad_weight: ptr::null_mut(),
        grad_bias: ptr::null_mut(),
        grad_hidden_dtype: sys::FCE_FLOAT32 as i32,
        reserved0: 0,
        grad_lse: ptr::null(),
        grad_entropy: ptr::null(),
    }
}

/// The gradient over the logits (null: none) for the upstream `grad_output` (null: 1).
pub(crate) fn logit_gradients(
    grad_output: *const f32,
    grad_logits: *mut c_void,
) -> sys::fce_gradients {
    sys::fce_gradients {
        grad_output,
        grad_logits,
        ..no_gradients()
    }
}

/// The linear layer's gradients (each null: not asked for) for the upstream `grad_output`.
pub(crate) fn linear_gradients(
    grad_output: *const f32,
    grad_hidden: *mut c_void,
    grad_weight: *mut c_void,
    grad_bias: *mut c_void,
) -> sys::fce_gradients {
    sys::fce_gradients {
        grad_output,
        grad_hidden,
        grad_weight,
        grad_bias,
        ..no_gradients()
    }
}

/// `fce_forward` on `opts`' backend.
///
/// # Safety
/// Every non-null pointer must point to memory of the backend (device memory on the calling
/// thread's current device for CUDA, host memory for CPU) of at least the size the header gives
/// it, live until the work completes (CUDA: asynchronous, ordered on `stream`), and the outputs
/// must not be accessed concurrently. `stream` must be a valid CUDA stream or null.
pub unsafe fn forward(opts: &Options<'_>, rows: i64, vocab: i64, a: &ForwardArgs) -> Result<()> {
    let raw = crate::options_for_library(*opts.as_raw())?;
    let out = outputs(a.loss, a.lse, a.z_loss, a.argmax, a.accuracy, a.error_flags);
    let g = logit_gradients(a.grad_output, a.grad_logits);
    check(sys::fce_forward(
        &raw,
        rows,
        vocab,
        a.logits,
        a.targets,
        &out,
        &g,
        a.workspace,
        a.workspace_bytes,
        a.stream,
    ))
}

/// `fce_backward` and `fce_backward_rescale`: the same arguments.
pub(crate) type BackwardFn = unsafe extern "C" fn(
    *const sys::fce_options,
    i64,
    i64,
    *const c_void,
    *const c_void,
    *const f32,
    *const sys::fce_outputs,
    *const sys::fce_gradients,
    *mut c_void,
    usize,
    *mut c_void,
) -> sys::fce_status;

/// `fce_backward` on `opts`' backend.
///
/// # Safety
/// As for [`forward`].
pub unsafe fn backward(opts: &Options<'_>, rows: i64, vocab: i64, a: &BackwardArgs) -> Result<()> {
    backward_call(sys::fce_backward, opts, rows, vocab, a)
}

/// `fce_backward_rescale` on `opts`' backend: `a.grad_logits` holds the gradient [`forward`]
/// wrote with `grad_output` null (an upstream 1) and becomes the gradient for the upstream
/// scalar `*a.grad_output` (required; reductions mean and sum), bit for bit what [`forward`]
/// writes given that scalar. Decided on the device, without a host synchronisation: exactly 1
/// writes nothing, 0 or ±2^k scales `a.grad_logits` in place (ignored rows stay +0), anything
/// else computes the gradient again from `a.logits` by the kernel [`forward`] runs (which
/// `a.grad_logits` must not overwrite: not in place). Only `error_flags` of the outputs is
/// written by the backward calls. The workspace is [`crate::backward_workspace_size`]'s.
///
/// # Safety
/// As for [`forward`].
pub unsafe fn backward_rescale(
    opts: &Options<'_>,
    rows: i64,
    vocab: i64,
    a: &BackwardArgs,
) -> Result<()> {
    crate::require("fce_backward_rescale", 200)?;
    backward_call(sys::fce_backward_rescale, opts, rows, vocab, a)
}

/// `call` (`fce_backward` or `fce_backward_rescale`) with `a`'s pointers.
///
/// # Safety
/// As for [`forward`].
unsafe fn backward_call(
    call: BackwardFn,
    opts: &Options<'_>,
    rows: i64,
    vocab: i64,
    a: &BackwardArgs,
) -> Result<()> {
    let raw = crate::options_for_library(*opts.as_raw())?;
    let out = flag_outputs(a.error_flags);
    let g = logit_gradients(a.grad_output, a.grad_logits);
    check(call(
        &raw,
        rows,
        vocab,
        a.logits,
        a.targets,
        a.lse,
        &out,
        &g,
        a.workspace,
        a.workspace_bytes,
        a.stream,
    ))
}

/// `fce_linear_ce` on `opts`' backend.
///
/// # Safety
/// As for [`forward`].
pub unsafe fn linear_ce(
    opts: &Options<'_>,
    rows: i64,
    hidden: i64,
    vocab: i64,
    a: &LinearCeArgs,
) -> Result<()> {
    let raw = crate::options_for_library(*opts.as_raw())?;
    let out = outputs(a.loss, a.lse, a.z_loss, a.argmax, a.accuracy, a.error_flags);
    let g = linear_gradients(a.grad_output, a.grad_hidden, a.grad_weight, a.grad_bias);
    check(sys::fce_linear_ce(
        &raw,
        rows,
        hidden,
        vocab,
        a.hidden_states,
        a.weight,
        a.bias,
        a.targets,
        &out,
        &g,
        a.workspace,
        a.workspace_bytes,
        a.stream,
    ))
}

/// `fce_scale_gradient`: `grad[i] *= *grad_output` for `i < count`, in place, on `backend`
/// (the float32 product rounded once to `dtype`; nothing is written when the scalar is exactly
/// 1). Applies an upstream gradient that was not known when a call wrote `grad` with
/// `grad_output` null. `count` 0 does nothing and `grad` may then be null.
///
/// # Safety
/// `grad` must point to `count` elements of `dtype` and `grad_output` to one `f32`, both in
/// the backend's memory as for [`forward`], live until the work completes (CUDA: asynchronous,
/// ordered on `stream`); nothing else may access `grad` meanwhile. `stream` must be a valid
/// CUDA stream or null.
pub unsafe fn scale_gradient(
    backend: Backend,
    dtype: Dtype,
    count: i64,
    grad: *mut c_void,
    grad_output: *const f32,
    stream: Stream,
) -> Result<()> {
    crate::require("fce_scale_gradient", 200)?;
    check(sys::fce_scale_gradient(
        backend.raw(),
        dtype.raw(),
        count,
        grad,
        grad_output,
        stream,
    ))
}
