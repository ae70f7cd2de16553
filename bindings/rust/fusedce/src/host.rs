//! The safe calls over host slices: they run on the CPU backend (whatever `Options::backend`
//! says), check every slice length before calling the library, and allocate the workspace in a
//! `Vec` unless given a [`HostWorkspace`] to reuse.
use std::ffi::c_void;
use std::ptr;

use crate::error::{check, check_query, Error, Result};
use crate::options::{Dtype, Options, Reduction, TargetDtype};
use crate::raw::BackwardFn;
use crate::sys;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for u16 {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
}

/// Element type of host logits, hidden states, weights and their gradients: `f32` for
/// [`Dtype::Float32`], `u16` (the raw bits) for [`Dtype::Float16`] and [`Dtype::BFloat16`]
/// (convert with [`crate::bits`]). The dtype itself comes from [`Options::dtype`].
pub trait Element: sealed::Sealed + Copy + 'static {
    #[doc(hidden)]
    const NAME: &'static str;
    #[doc(hidden)]
    const IS_F32: bool;
    #[doc(hidden)]
    fn accepts(dtype: Dtype) -> bool;
}

impl Element for f32 {
    const NAME: &'static str = "f32";
    const IS_F32: bool = true;
    fn accepts(dtype: Dtype) -> bool {
        dtype == Dtype::Float32
    }
}

impl Element for u16 {
    const NAME: &'static str = "u16";
    const IS_F32: bool = false;
    fn accepts(dtype: Dtype) -> bool {
        matches!(dtype, Dtype::Float16 | Dtype::BFloat16)
    }
}

/// Element type of host targets: `i32` or `i64` (sets the target dtype of the call).
pub trait Target: sealed::Sealed + Copy + 'static {
    #[doc(hidden)]
    const DTYPE: TargetDtype;
}

impl Target for i32 {
    const DTYPE: TargetDtype = TargetDtype::Int32;
}

impl Target for i64 {
    const DTYPE: TargetDtype = TargetDtype::Int64;
}

// ------------------------------------------------------------------------------ workspace ----

#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct Block([u8; 16]);

/// Host scratch memory, 16-byte aligned, grown on demand: pass one to the host calls through
/// their buffers' `.workspace(..)` to reuse it across calls instead of allocating each time.
#[derive(Clone, Default)]
pub struct HostWorkspace {
    blocks: Vec<Block>,
}

impl std::fmt::Debug for HostWorkspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostWorkspace({} bytes)", self.bytes())
    }
}

impl HostWorkspace {
    /// An empty workspace (no allocation).
    pub fn new() -> Self {
        HostWorkspace::default()
    }

    /// A workspace of at least `bytes` bytes.
    pub fn with_bytes(bytes: usize) -> Self {
        let mut w = HostWorkspace::new();
        w.ensure(bytes);
        w
    }

    /// Its size in bytes (a multiple of 16).
    pub fn bytes(&self) -> usize {
        self.blocks.len() * 16
    }

    /// Grows it to at least `bytes` bytes (never shrinks).
    pub fn ensure(&mut self, bytes: usize) {
        let blocks = bytes.div_ceil(16);
        if blocks > self.blocks.len() {
            self.blocks.resize(blocks, Block([0; 16]));
        }
    }

    /// Pointer and size to hand to a raw call (null and 0 when empty).
    pub fn as_raw(&mut self) -> (*mut c_void, usize) {
        if self.blocks.is_empty() {
            (ptr::null_mut(), 0)
        } else {
            (self.blocks.as_mut_ptr().cast(), self.bytes())
        }
    }
}

// -------------------------------------------------------------------------- size checks ----

pub(crate) fn to_i64(what: &str, n: usize) -> Result<i64> {
    i64::try_from(n).map_err(|_| Error::invalid(format!("fusedce: {what} ({n}) exceeds i64")))
}

/// Elements spanned by `rows` rows of `cols` elements, `stride` apart (0 or anything below
/// cols counts as cols: the library rejects those strides before touching memory).
fn span(rows: usize, cols: usize, stride: i64) -> Option<usize> {
    if rows == 0 || cols == 0 {
        return Some(0);
    }
    let stride = if stride > cols as i64 {
        usize::try_from(stride).ok()?
    } else {
        cols
    };
    (rows - 1).checked_mul(stride)?.checked_add(cols)
}

fn need(func: &str, what: &str, have: usize, need: Option<usize>, how: &str) -> Result<()> {
    match need {
        None => Err(Error::invalid(format!(
            "{func}: the size of {what} ({how}) overflows usize"
        ))),
        Some(n) if have < n => Err(Error::invalid(format!(
            "{func}: {what} has {have} elements, fewer than the {n} it needs ({how})"
        ))),
        Some(_) => Ok(()),
    }
}

/// Ok when slices of T can hold elements of `dtype` (`what` names where the dtype came from).
fn slices_hold<T: Element>(func: &str, what: &str, dtype: Dtype) -> Result<()> {
    if T::accepts(dtype) {
        return Ok(());
    }
    let hint = if T::IS_F32 {
        "u16 bit slices"
    } else {
        "f32 slices"
    };
    Err(Error::invalid(format!(
        "{func}: {what} is {dtype:?} but the slices are {}; use {hint} for {dtype:?}",
        T::NAME
    )))
}

/// The options of a host call: CPU backend, the targets' dtype, the dtype checked against T.
fn host_options<T: Element, I: Target>(
    func: &str,
    opts: &Options<'_>,
    vocab: usize,
) -> Result<sys::fce_options> {
    let mut o = *opts;
    {
        let raw = o.raw_mut();
        raw.backend = sys::FCE_BACKEND_CPU as i32;
        raw.target_dtype = I::DTYPE.raw();
    }
    if let Some(d) = Dtype::from_raw(o.as_raw().dtype) {
        slices_hold::<T>(func, "options dtype", d)?;
    } // an unknown raw dtype is left for the library to reject, naming options->dtype
    if let Some(n) = o.weights_len() {
        need(func, "class_weights", n, Some(vocab), "vocab")?;
    }
    Ok(*o.as_raw())
}

/// Elements of loss / grad_output: `[rows]` for none, `[1]` otherwise.
fn per_call(raw: &sys::fce_options, rows: usize) -> (usize, &'static str) {
    match Reduction::from_raw(raw.reduction) {
        Some(Reduction::None) => (rows, "rows, reduction none"),
        Some(_) => (1, "1 for mean/sum"),
        None => (rows.max(1), "rows"), // the library rejects it anyway
    }
}

/// The argmax `[rows]` and accuracy (`[1]`, or `[rows]` for none) pointers of a forward call
/// (null where not asked for), after checking their lengths.
fn extra_outputs(
    func: &str,
    raw: &sys::fce_options,
    rows: usize,
    argmax: Option<&mut [i64]>,
    accuracy: Option<&mut [f32]>,
) -> Result<(*mut i64, *mut f32)> {
    let (per, per_how) = per_call(raw, rows);
    let mut ptrs = (ptr::null_mut(), ptr::null_mut());
    if let Some(a) = argmax {
        need(func, "argmax", a.len(), Some(rows), "rows")?;
        ptrs.0 = a.as_mut_ptr();
    }
    if let Some(a) = accuracy {
        need(func, "accuracy", a.len(), Some(per), per_how)?;
        ptrs.1 = a.as_mut_ptr();
    }
    Ok(ptrs)
}

/// The `fce_outputs` of a loss call on host slices (`extras`: argmax and accuracy pointers).
fn loss_outputs(
    loss: &mut [f32],
    lse: Option<&mut [f32]>,
    z_loss: Option<&mut f32>,
    extras: (*mut i64, *mut f32),
    error_flags: Option<&mut u32>,
) -> sys::fce_outputs {
    crate::raw::outputs(
        loss.as_mut_ptr(),
        lse.map_or(ptr::null_mut(), |x| x.as_mut_ptr()),
        z_loss.map_or(ptr::null_mut(), |x| x as *mut f32),
        extras.0,
        extras.1,
        error_flags.map_or(ptr::null_mut(), |x| x as *mut u32),
    )
}

fn workspace_ptr(
    given: Option<&mut HostWorkspace>,
    local: &mut HostWorkspace,
    min: usize,
    grow_to: usize,
) -> (*mut c_void, usize) {
    let ws = match given {
        Some(w) => w,
        None => local,
    };
    if ws.bytes() < min {
        ws.ensure(grow_to);
    }
    ws.as_raw()
}

// ---------------------------------------------------------------------------- queries ----

/// Workspace bytes `fce_forward` needs for these options and sizes (on `opts`' backend).
pub fn forward_workspace_size(opts: &Options<'_>, rows: usize, vocab: usize) -> Result<usize> {
    let mut bytes = 0usize;
    let (r, v) = (to_i64("rows", rows)?, to_i64("vocab", vocab)?);
    let raw = crate::options_for_library(*opts.as_raw())?;
    // SAFETY: options is a valid struct, bytes a valid out pointer.
    check(unsafe { sys::fce_forward_workspace_size(&raw, r, v, &mut bytes) })?;
    Ok(bytes)
}

/// Workspace bytes `fce_backward` needs for these options and sizes (on `opts`' backend).
pub fn backward_workspace_size(opts: &Options<'_>, rows: usize, vocab: usize) -> Result<usize> {
    let mut bytes = 0usize;
    let (r, v) = (to_i64("rows", rows)?, to_i64("vocab", vocab)?);
    let raw = crate::options_for_library(*opts.as_raw())?;
    // SAFETY: as above.
    check(unsafe { sys::fce_backward_workspace_size(&raw, r, v, &mut bytes) })?;
    Ok(bytes)
}

/// The two sizes of the linear_ce workspace query.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkspaceSize {
    /// The least that works: any size from here up gives the same result.
    pub min: usize,
    /// From this size up, full speed.
    pub optimal: usize,
}

/// Workspace sizes `fce_linear_ce` needs (on `opts`' backend); `with_grad`: whether any
/// gradient buffer will be given.
pub fn linear_ce_workspace_size(
    opts: &Options<'_>,
    rows: usize,
    hidden: usize,
    vocab: usize,
    with_grad: bool,
) -> Result<WorkspaceSize> {
    let (mut min, mut optimal) = (0usize, 0usize);
    let (r, h, v) = (
        to_i64("rows", rows)?,
        to_i64("hidden", hidden)?,
        to_i64("vocab", vocab)?,
    );
    let raw = crate::options_for_library(*opts.as_raw())?;
    // SAFETY: options is a valid struct, both outputs valid pointers.
    check(unsafe {
        sys::fce_linear_ce_workspace_size(&raw, r, h, v, with_grad as i32, &mut min, &mut optimal)
    })?;
    Ok(WorkspaceSize { min, optimal })
}

// ---------------------------------------------------------------------------- forward ----

/// Outputs (and the optional inputs) of [`forward`]: `loss` is required — `[1]` for mean/sum,
/// `[rows]` for none — everything else is optional.
pub struct ForwardBuffers<'a, T: Element> {
    loss: &'a mut [f32],
    lse: Option<&'a mut [f32]>,
    z_loss: Option<&'a mut f32>,
    argmax: Option<&'a mut [i64]>,
    accuracy: Option<&'a mut [f32]>,
    grad_logits: Option<&'a mut [T]>,
    grad_output: Option<&'a [f32]>,
    error_flags: Option<&'a mut u32>,
    workspace: Option<&'a mut HostWorkspace>,
}

impl<'a, T: Element> ForwardBuffers<'a, T> {
    /// Buffers with the loss only.
    pub fn new(loss: &'a mut [f32]) -> Self {
        ForwardBuffers {
            loss,
            lse: None,
            z_loss: None,
            argmax: None,
            accuracy: None,
            grad_logits: None,
            grad_output: None,
            error_flags: None,
            workspace: None,
        }
    }
    /// Also write lse `[rows]` (what [`backward`] needs).
    pub fn lse(mut self, lse: &'a mut [f32]) -> Self {
        self.lse = Some(lse);
        self
    }
    /// Also write the z-loss total λ·Σ lse² over the non-ignored rows (each term times p_y
    /// with token scaling), divided by their number for mean: the part of the loss that is
    /// z-loss, for logging.
    pub fn z_loss(mut self, z_loss: &'a mut f32) -> Self {
        self.z_loss = Some(z_loss);
        self
    }
    /// Also write each row's predicted class `[rows]`: the argmax of its scaled, capped logits
    /// (the lowest index among equal maxima; a NaN counts as the largest, as torch.argmax),
    /// −1 for ignored rows. Since 0.3.
    pub fn argmax(mut self, argmax: &'a mut [i64]) -> Self {
        self.argmax = Some(argmax);
        self
    }
    /// Also write the accuracy: `[1]` for mean/sum, the fraction of non-ignored rows whose
    /// argmax is the target (rows with an invalid target count, never correct; 0 when every
    /// row is ignored); `[rows]` for none, 1 or 0 per row (0 for ignored rows). Unweighted.
    /// Since 0.3.
    pub fn accuracy(mut self, accuracy: &'a mut [f32]) -> Self {
        self.accuracy = Some(accuracy);
        self
    }
    /// Also write ∂loss/∂logits `[rows, grad_row_stride]` in the same pass (the training path).
    pub fn grad_logits(mut self, grad: &'a mut [T]) -> Self {
        self.grad_logits = Some(grad);
        self
    }
    /// Upstream gradient g: `[1]` for mean/sum, `[rows]` for none; 1 when not given.
    pub fn grad_output(mut self, grad_output: &'a [f32]) -> Self {
        self.grad_output = Some(grad_output);
        self
    }
    /// A flags word the call ORs `FCE_FLAG_*` bits into (never cleared by the call).
    pub fn error_flags(mut self, flags: &'a mut u32) -> Self {
        self.error_flags = Some(flags);
        self
    }
    /// Scratch to reuse (grown if too small) instead of a fresh allocation.
    pub fn workspace(mut self, workspace: &'a mut HostWorkspace) -> Self {
        self.workspace = Some(workspace);
        self
    }
}

/// Cross-entropy of host `logits` `[rows, row_stride]` against `targets` `[rows]` on the CPU
/// backend: the loss, and whatever else `bufs` asks for (lse, z-loss, argmax, accuracy, the
/// gradient).
///
/// ```no_run
/// # fn main() -> fusedce::Result<()> {
/// use fusedce::{forward, ForwardBuffers, Options};
/// let (rows, vocab) = (2, 3);
/// let logits = [1.0f32, 2.0, 3.0, 0.5, 0.0, -1.0];
/// let targets = [2i64, 0];
/// let (mut loss, mut grad) = ([0.0f32], vec![0.0f32; 6]);
/// forward(&Options::new(), rows, vocab, &logits, &targets,
///         ForwardBuffers::new(&mut loss).grad_logits(&mut grad))?;
/// # Ok(()) }
/// ```
pub fn forward<T: Element, I: Target>(
    opts: &Options<'_>,
    rows: usize,
    vocab: usize,
    logits: &[T],
    targets: &[I],
    bufs: ForwardBuffers<'_, T>,
) -> Result<()> {
    forward_impl(
        "fusedce::forward",
        opts,
        rows,
        vocab,
        Logits::Shared(logits),
        targets,
        bufs,
    )
}

/// [`forward`] writing the gradient over the logits (in place; `grad_row_stride` must equal
/// `row_stride`). `bufs` must not carry a separate `grad_logits`.
pub fn forward_in_place<T: Element, I: Target>(
    opts: &Options<'_>,
    rows: usize,
    vocab: usize,
    logits: &mut [T],
    targets: &[I],
    bufs: ForwardBuffers<'_, T>,
) -> Result<()> {
    forward_impl(
        "fusedce::forward_in_place",
        opts,
        rows,
        vocab,
        Logits::InPlace(logits),
        targets,
        bufs,
    )
}

enum Logits<'a, T> {
    Shared(&'a [T]),
    InPlace(&'a mut [T]),
}

/// The logits and gradient pointers of a forward or backward call, after checking the slices
/// are long enough: a separate gradient (optional for forward, required for backward) or the
/// gradient over the logits themselves.
fn logits_and_grad<T>(
    func: &str,
    logits: Logits<'_, T>,
    grad_logits: Option<&mut [T]>,
    logits_span: Option<usize>,
    grad_span: Option<usize>,
    grad_required: bool,
) -> Result<(*const c_void, *mut c_void)> {
    match logits {
        Logits::Shared(z) => {
            need(
                func,
                "logits",
                z.len(),
                logits_span,
                "(rows-1)*row_stride+vocab",
            )?;
            let g = match grad_logits {
                Some(g) => {
                    need(func, "grad_logits", g.len(), grad_span, "(rows-1)*grad_row_stride+vocab")?;
                    g.as_mut_ptr().cast()
                }
                None if grad_required => {
                    return Err(Error::new(
                        crate::Status::NullPointer,
                        format!("{func}: grad_logits is required (backward_in_place writes over the logits)"),
                    ))
                }
                None => ptr::null_mut(),
            };
            Ok((z.as_ptr().cast(), g))
        }
        Logits::InPlace(z) => {
            if grad_logits.is_some() {
                return Err(Error::invalid(format!(
                    "{func}: grad_logits is given, but the gradient goes over the logits"
                )));
            }
            need(
                func,
                "logits",
                z.len(),
                logits_span,
                "(rows-1)*row_stride+vocab",
            )?;
            need(
                func,
                "logits",
                z.len(),
                grad_span,
                "(rows-1)*grad_row_stride+vocab",
            )?;
            let p = z.as_mut_ptr().cast::<c_void>();
            Ok((p.cast_const(), p))
        }
    }
}

fn forward_impl<T: Element, I: Target>(
    func: &str,
    opts: &Options<'_>,
    rows: usize,
    vocab: usize,
    logits: Logits<'_, T>,
    targets: &[I],
    bufs: ForwardBuffers<'_, T>,
) -> Result<()> {
    let raw = host_options::<T, I>(func, opts, vocab)?;
    let (r, v) = (to_i64("rows", rows)?, to_i64("vocab", vocab)?);
    let (per, per_how) = per_call(&raw, rows);
    let logits_span = span(rows, vocab, raw.row_stride);
    let grad_span = span(rows, vocab, raw.grad_row_stride);
    need(func, "targets", targets.len(), Some(rows), "rows")?;
    need(func, "loss", bufs.loss.len(), Some(per), per_how)?;
    if let Some(lse) = &bufs.lse {
        need(func, "lse", lse.len(), Some(rows), "rows")?;
    }
    if let Some(g) = &bufs.grad_output {
        need(func, "grad_output", g.len(), Some(per), per_how)?;
    }
    let (argmax_ptr, accuracy_ptr) = extra_outputs(func, &raw, rows, bufs.argmax, bufs.accuracy)?;
    let raw = crate::options_for_library(raw)?;
    let ForwardBuffers {
        loss,
        lse,
        z_loss,
        argmax: _,
        accuracy: _,
        grad_logits,
        grad_output,
        error_flags,
        workspace,
    } = bufs;
    let (logits_ptr, grad_ptr) =
        logits_and_grad(func, logits, grad_logits, logits_span, grad_span, false)?;
    let mut ws_bytes = 0usize;
    // SAFETY: valid options struct and out pointer.
    check_query(
        unsafe { sys::fce_forward_workspace_size(&raw, r, v, &mut ws_bytes) },
        "fce_forward_workspace_size",
        "fce_forward",
    )?;
    let mut local = HostWorkspace::new();
    let (ws, ws_len) = workspace_ptr(workspace, &mut local, ws_bytes, ws_bytes);
    // SAFETY: every pointer is null or a live host buffer at least as long as the library
    // reads or writes (checked above); the mutable ones are exclusive borrows.
    let out = loss_outputs(loss, lse, z_loss, (argmax_ptr, accuracy_ptr), error_flags);
    let g = crate::raw::logit_gradients(grad_output.map_or(ptr::null(), |x| x.as_ptr()), grad_ptr);
    check(unsafe {
        sys::fce_forward(
            &raw,
            r,
            v,
            logits_ptr,
            targets.as_ptr().cast(),
            &out,
            &g,
            ws,
            ws_len,
            ptr::null_mut(),
        )
    })
}

// --------------------------------------------------------------------------- backward ----

/// Buffers of [`backward`]: `grad_logits` (required by [`backward`], refused by
/// [`backward_in_place`]) and the optional inputs.
pub struct BackwardBuffers<'a, T: Element> {
    grad_logits: Option<&'a mut [T]>,
    grad_output: Option<&'a [f32]>,
    error_flags: Option<&'a mut u32>,
    workspace: Option<&'a mut HostWorkspace>,
}

impl<'a, T: Element> Default for BackwardBuffers<'a, T> {
    fn default() -> Self {
        BackwardBuffers::new()
    }
}

impl<'a, T: Element> BackwardBuffers<'a, T> {
    /// No buffers yet.
    pub fn new() -> Self {
        BackwardBuffers {
            grad_logits: None,
            grad_output: None,
            error_flags: None,
            workspace: None,
        }
    }
    /// Where ∂loss/∂logits `[rows, grad_row_stride]` goes.
    pub fn grad_logits(mut self, grad: &'a mut [T]) -> Self {
        self.grad_logits = Some(grad);
        self
    }
    /// Upstream gradient g: `[1]` for mean/sum, `[rows]` for none; 1 when not given.
    pub fn grad_output(mut self, grad_output: &'a [f32]) -> Self {
        self.grad_output = Some(grad_output);
        self
    }
    /// A flags word the call ORs `FCE_FLAG_*` bits into.
    pub fn error_flags(mut self, flags: &'a mut u32) -> Self {
        self.error_flags = Some(flags);
        self
    }
    /// Scratch to reuse (grown if too small).
    pub fn workspace(mut self, workspace: &'a mut HostWorkspace) -> Self {
        self.workspace = Some(workspace);
        self
    }
}

/// The gradient only, from the logits, the targets and the lse `[rows]` that [`forward`] wrote
/// with the same options (`fce_backward`): p_j = exp(a_j − lse) from the float32 lse, so the
/// values are [`forward`]'s gradient to the rounding of lse (a relative |lse|·2⁻²⁴ in each
/// p_j), not bit for bit; [`backward_rescale`] is bit for bit.
pub fn backward<T: Element, I: Target>(
    opts: &Options<'_>,
    rows: usize,
    vocab: usize,
    logits: &[T],
    targets: &[I],
    lse: &[f32],
    bufs: BackwardBuffers<'_, T>,
) -> Result<()> {
    backward_impl(
        false,
        "fusedce::backward",
        opts,
        rows,
        vocab,
        Logits::Shared(logits),
        targets,
        lse,
        bufs,
    )
}

/// [`backward`] writing the gradient over the logits.
pub fn backward_in_place<T: Element, I: Target>(
    opts: &Options<'_>,
    rows: usize,
    vocab: usize,
    logits: &mut [T],
    targets: &[I],
    lse: &[f32],
    bufs: BackwardBuffers<'_, T>,
) -> Result<()> {
    let func = "fusedce::backward_in_place";
    backward_impl(
        false,
        func,
        opts,
        rows,
        vocab,
        Logits::InPlace(logits),
        targets,
        lse,
        bufs,
    )
}

/// The gradient [`forward`] wrote without a `grad_output` (an upstream 1) into `grad_logits`,
/// made the gradient for the upstream scalar given as `grad_output` (`[1]`; reductions mean
/// and sum), bit for bit what [`forward`] writes given that scalar (`fce_backward_rescale`):
/// the training path when the upstream gradient is known only after the forward. `bufs` must
/// carry both `grad_logits` (holding that gradient) and `grad_output`; `logits`, `targets`,
/// `lse` and the options are the forward's. A scalar of exactly 1 writes nothing, 0 or ±2^k
/// scales the gradient in place (ignored rows stay +0), anything else computes it again from
/// the logits, by the computation [`forward`] runs.
///
/// ```no_run
/// # fn main() -> fusedce::Result<()> {
/// use fusedce::{backward_rescale, forward, BackwardBuffers, ForwardBuffers, Options};
/// let (rows, vocab) = (2, 3);
/// let logits = [1.0f32, 2.0, 3.0, 0.5, 0.0, -1.0];
/// let targets = [2i64, 0];
/// let (mut loss, mut lse, mut grad) = ([0.0f32], [0.0f32; 2], vec![0.0f32; 6]);
/// let opts = Options::new();
/// forward(&opts, rows, vocab, &logits, &targets,
///         ForwardBuffers::new(&mut loss).lse(&mut lse).grad_logits(&mut grad))?;
/// // ... later, the upstream gradient of the loss is known:
/// backward_rescale(&opts, rows, vocab, &logits, &targets, &lse,
///                  BackwardBuffers::new().grad_logits(&mut grad).grad_output(&[0.5]))?;
/// # Ok(()) }
/// ```
pub fn backward_rescale<T: Element, I: Target>(
    opts: &Options<'_>,
    rows: usize,
    vocab: usize,
    logits: &[T],
    targets: &[I],
    lse: &[f32],
    bufs: BackwardBuffers<'_, T>,
) -> Result<()> {
    backward_impl(
        true,
        "fusedce::backward_rescale",
        opts,
        rows,
        vocab,
        Logits::Shared(logits),
        targets,
        lse,
        bufs,
    )
}

#[allow(clippy::too_many_arguments)]
fn backward_impl<T: Element, I: Target>(
    rescale: bool,
    func: &str,
    opts: &Options<'_>,
    rows: usize,
    vocab: usize,
    logits: Logits<'_, T>,
    targets: &[I],
    lse: &[f32],
    bufs: BackwardBuffers<'_, T>,
) -> Result<()> {
    if rescale {
        crate::require("fce_backward_rescale", 200)?;
    }
    let raw = crate::options_for_library(host_options::<T, I>(func, opts, vocab)?)?;
    let (r, v) = (to_i64("rows", rows)?, to_i64("vocab", vocab)?);
    let (per, per_how) = per_call(&raw, rows);
    let logits_span = span(rows, vocab, raw.row_stride);
    let grad_span = span(rows, vocab, raw.grad_row_stride);
    need(func, "targets", targets.len(), Some(rows), "rows")?;
    need(func, "lse", lse.len(), Some(rows), "rows")?;
    if let Some(g) = &bufs.grad_output {
        need(func, "grad_output", g.len(), Some(per), per_how)?;
    }
    let BackwardBuffers {
        grad_logits,
        grad_output,
        error_flags,
        workspace,
    } = bufs;
    // fce_backward_rescale: a missing grad_logits goes to the library as NULL, which names it.
    let (logits_ptr, grad_ptr) =
        logits_and_grad(func, logits, grad_logits, logits_span, grad_span, !rescale)?;
    let mut ws_bytes = 0usize;
    // SAFETY: valid options struct and out pointer.
    check_query(
        unsafe { sys::fce_backward_workspace_size(&raw, r, v, &mut ws_bytes) },
        "fce_backward_workspace_size",
        if rescale {
            "fce_backward_rescale"
        } else {
            "fce_backward"
        },
    )?;
    let mut local = HostWorkspace::new();
    let (ws, ws_len) = workspace_ptr(workspace, &mut local, ws_bytes, ws_bytes);
    let call: BackwardFn = if rescale {
        sys::fce_backward_rescale
    } else {
        sys::fce_backward
    };
    let out = crate::raw::flag_outputs(error_flags.map_or(ptr::null_mut(), |x| x as *mut u32));
    let g = crate::raw::logit_gradients(grad_output.map_or(ptr::null(), |x| x.as_ptr()), grad_ptr);
    // SAFETY: as in forward_impl.
    check(unsafe {
        call(
            &raw,
            r,
            v,
            logits_ptr,
            targets.as_ptr().cast(),
            lse.as_ptr(),
            &out,
            &g,
            ws,
            ws_len,
            ptr::null_mut(),
        )
    })
}

// ----------------------------------------------------------------------- scale_gradient ----

/// `grad[i] *= grad_output` for every element, in place, on the CPU backend
/// (`fce_scale_gradient`): the upstream gradient applied to a gradient written without one.
/// `grad` holds elements of `dtype` (`f32` slices for [`Dtype::Float32`], `u16` bits for
/// float16 / bfloat16); each product is computed in float32 and rounded once to the dtype, and a
/// `grad_output` of exactly 1 leaves the slice untouched.
///
/// ```no_run
/// # fn main() -> fusedce::Result<()> {
/// use fusedce::{scale_gradient, Dtype};
/// let mut grad = vec![0.5f32, -1.0, 2.0];
/// scale_gradient(Dtype::Float32, &mut grad, 0.25)?;
/// assert_eq!(grad, [0.125, -0.25, 0.5]);
/// # Ok(()) }
/// ```
pub fn scale_gradient<T: Element>(dtype: Dtype, grad: &mut [T], grad_output: f32) -> Result<()> {
    let func = "fusedce::scale_gradient";
    crate::require("fce_scale_gradient", 200)?;
    slices_hold::<T>(func, "dtype", dtype)?;
    let count = to_i64("grad length", grad.len())?;
    // SAFETY: grad is an exclusive borrow of `count` host elements of dtype, grad_output a live
    // f32; the CPU backend is synchronous, so neither is used after the call returns.
    check(unsafe {
        sys::fce_scale_gradient(
            sys::FCE_BACKEND_CPU as i32,
            dtype.raw(),
            count,
            grad.as_mut_ptr().cast(),
            &grad_output,
            ptr::null_mut(),
        )
    })
}

// -------------------------------------------------------------------------- linear_ce ----

enum Grad<'a, T> {
    Dtype(&'a mut [T]),
    F32(&'a mut [f32]),
}

impl<T> Grad<'_, T> {
    fn len(&self) -> usize {
        match self {
            Grad::Dtype(g) => g.len(),
            Grad::F32(g) => g.len(),
        }
    }
    fn is_f32(&self) -> bool {
        matches!(self, Grad::F32(_))
    }
    fn ptr(&mut self) -> *mut c_void {
        match self {
            Grad::Dtype(g) => g.as_mut_ptr().cast(),
            Grad::F32(g) => g.as_mut_ptr().cast(),
        }
    }
}

/// Outputs (and optional inputs) of [`linear_ce`]: `loss` is required; with no gradient
/// buffer the call computes the loss only (evaluation).
pub struct LinearCeBuffers<'a, T: Element> {
    loss: &'a mut [f32],
    lse: Option<&'a mut [f32]>,
    z_loss: Option<&'a mut f32>,
    argmax: Option<&'a mut [i64]>,
    accuracy: Option<&'a mut [f32]>,
    grad_hidden: Option<&'a mut [T]>,
    grad_weight: Option<Grad<'a, T>>,
    grad_bias: Option<Grad<'a, T>>,
    grad_output: Option<&'a [f32]>,
    error_flags: Option<&'a mut u32>,
    workspace: Option<&'a mut HostWorkspace>,
}

impl<'a, T: Element> LinearCeBuffers<'a, T> {
    /// Buffers with the loss only (`[1]` for mean/sum, `[rows]` for none).
    pub fn new(loss: &'a mut [f32]) -> Self {
        LinearCeBuffers {
            loss,
            lse: None,
            z_loss: None,
            argmax: None,
            accuracy: None,
            grad_hidden: None,
            grad_weight: None,
            grad_bias: None,
            grad_output: None,
            error_flags: None,
            workspace: None,
        }
    }
    /// Also write lse `[rows]`.
    pub fn lse(mut self, lse: &'a mut [f32]) -> Self {
        self.lse = Some(lse);
        self
    }
    /// Also write the z-loss total (as [`ForwardBuffers::z_loss`]).
    pub fn z_loss(mut self, z_loss: &'a mut f32) -> Self {
        self.z_loss = Some(z_loss);
        self
    }
    /// Also write each row's predicted class `[rows]` (as [`ForwardBuffers::argmax`], over
    /// z = hidden·weightᵀ + bias after scale and softcap). Since 0.3.
    pub fn argmax(mut self, argmax: &'a mut [i64]) -> Self {
        self.argmax = Some(argmax);
        self
    }
    /// Also write the accuracy, `[1]` for mean/sum or `[rows]` for none (as
    /// [`ForwardBuffers::accuracy`]). Since 0.3.
    pub fn accuracy(mut self, accuracy: &'a mut [f32]) -> Self {
        self.accuracy = Some(accuracy);
        self
    }
    /// ∂loss/∂hidden `[rows, hidden]` (dense), always overwritten.
    pub fn grad_hidden(mut self, grad: &'a mut [T]) -> Self {
        self.grad_hidden = Some(grad);
        self
    }
    /// ∂loss/∂weight `[vocab, hidden]` in the dtype; overwritten, or added to with
    /// `Options::accumulate`.
    pub fn grad_weight(mut self, grad: &'a mut [T]) -> Self {
        self.grad_weight = Some(Grad::Dtype(grad));
        self
    }
    /// ∂loss/∂weight `[vocab, hidden]` in float32 whatever the dtype (grad_weight_fp32).
    pub fn grad_weight_f32(mut self, grad: &'a mut [f32]) -> Self {
        self.grad_weight = Some(Grad::F32(grad));
        self
    }
    /// ∂loss/∂bias `[vocab]` in the dtype (needs a bias; same kind as grad_weight).
    pub fn grad_bias(mut self, grad: &'a mut [T]) -> Self {
        self.grad_bias = Some(Grad::Dtype(grad));
        self
    }
    /// ∂loss/∂bias `[vocab]` in float32 (grad_weight_fp32).
    pub fn grad_bias_f32(mut self, grad: &'a mut [f32]) -> Self {
        self.grad_bias = Some(Grad::F32(grad));
        self
    }
    /// Upstream gradient g: `[1]` for mean/sum, `[rows]` for none; 1 when not given.
    pub fn grad_output(mut self, grad_output: &'a [f32]) -> Self {
        self.grad_output = Some(grad_output);
        self
    }
    /// A flags word the call ORs `FCE_FLAG_*` bits into.
    pub fn error_flags(mut self, flags: &'a mut u32) -> Self {
        self.error_flags = Some(flags);
        self
    }
    /// Scratch to reuse: used as is when at least the minimum, else grown to the optimal size.
    pub fn workspace(mut self, workspace: &'a mut HostWorkspace) -> Self {
        self.workspace = Some(workspace);
        self
    }
}

/// Fused linear + cross-entropy on the CPU backend: z = hidden·weightᵀ + bias is never held
/// whole; the loss (+ lse, z-loss, argmax, accuracy) and, when given buffers, the gradients of
/// hidden, weight and bias. `hidden_states` `[rows, hidden_row_stride]`, `weight`
/// `[vocab, hidden]` row-major, `bias` `[vocab]`.
#[allow(clippy::too_many_arguments)]
pub fn linear_ce<T: Element, I: Target>(
    opts: &Options<'_>,
    rows: usize,
    hidden: usize,
    vocab: usize,
    hidden_states: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    targets: &[I],
    bufs: LinearCeBuffers<'_, T>,
) -> Result<()> {
    let func = "fusedce::linear_ce";
    let mut raw = host_options::<T, I>(func, opts, vocab)?;
    let (r, h, v) = (
        to_i64("rows", rows)?,
        to_i64("hidden", hidden)?,
        to_i64("vocab", vocab)?,
    );
    let (per, per_how) = per_call(&raw, rows);
    let vd = vocab.checked_mul(hidden);
    need(
        func,
        "hidden_states",
        hidden_states.len(),
        span(rows, hidden, raw.hidden_row_stride),
        "(rows-1)*hidden_row_stride+hidden",
    )?;
    need(func, "weight", weight.len(), vd, "vocab*hidden")?;
    if let Some(b) = bias {
        need(func, "bias", b.len(), Some(vocab), "vocab")?;
    }
    need(func, "targets", targets.len(), Some(rows), "rows")?;
    need(func, "loss", bufs.loss.len(), Some(per), per_how)?;
    if let Some(x) = &bufs.lse {
        need(func, "lse", x.len(), Some(rows), "rows")?;
    }
    if let Some(g) = &bufs.grad_output {
        need(func, "grad_output", g.len(), Some(per), per_how)?;
    }
    if let Some(g) = &bufs.grad_hidden {
        need(
            func,
            "grad_hidden",
            g.len(),
            rows.checked_mul(hidden),
            "rows*hidden",
        )?;
    }
    if let Some(g) = &bufs.grad_weight {
        need(func, "grad_weight", g.len(), vd, "vocab*hidden")?;
    }
    if let Some(g) = &bufs.grad_bias {
        need(func, "grad_bias", g.len(), Some(vocab), "vocab")?;
    }
    let LinearCeBuffers {
        loss,
        lse,
        z_loss,
        argmax,
        accuracy,
        grad_hidden,
        grad_weight,
        grad_bias,
        grad_output,
        error_flags,
        workspace,
    } = bufs;
    let (argmax_ptr, accuracy_ptr) = extra_outputs(func, &raw, rows, argmax, accuracy)?;
    // grad_weight_fp32 follows the kind of slices given (for f32 both kinds are the same).
    let kinds = [
        grad_weight.as_ref().map(Grad::is_f32),
        grad_bias.as_ref().map(Grad::is_f32),
    ];
    match kinds {
        [Some(a), Some(b)] if a != b && !T::IS_F32 => {
            return Err(Error::invalid(format!(
            "{func}: grad_weight and grad_bias must both be f32 (grad_weight_f32/grad_bias_f32) \
                 or both of the dtype"
        )))
        }
        [Some(f), _] | [None, Some(f)] => raw.grad_weight_fp32 = (f && !T::IS_F32) as i32,
        [None, None] => {}
    }
    let raw = crate::options_for_library(raw)?;
    let with_grad = grad_hidden.is_some() || grad_weight.is_some() || grad_bias.is_some();
    let (mut min, mut optimal) = (0usize, 0usize);
    // SAFETY: valid options struct and out pointers.
    check_query(
        unsafe {
            sys::fce_linear_ce_workspace_size(
                &raw,
                r,
                h,
                v,
                with_grad as i32,
                &mut min,
                &mut optimal,
            )
        },
        "fce_linear_ce_workspace_size",
        "fce_linear_ce",
    )?;
    let mut local = HostWorkspace::new();
    let (ws, ws_len) = workspace_ptr(workspace, &mut local, min, optimal.max(min));
    // SAFETY: every pointer is null or a live host buffer at least as long as the library
    // reads or writes (checked above); the mutable ones are exclusive borrows.
    let out = loss_outputs(loss, lse, z_loss, (argmax_ptr, accuracy_ptr), error_flags);
    let g = crate::raw::linear_gradients(
        grad_output.map_or(ptr::null(), |x| x.as_ptr()),
        grad_hidden.map_or(ptr::null_mut(), |g| g.as_mut_ptr().cast()),
        grad_weight.map_or(ptr::null_mut(), |mut g| g.ptr()),
        grad_bias.map_or(ptr::null_mut(), |mut g| g.ptr()),
    );
    check(unsafe {
        sys::fce_linear_ce(
            &raw,
            r,
            h,
            v,
            hidden_states.as_ptr().cast(),
            weight.as_ptr().cast(),
            bias.map_or(ptr::null(), |b| b.as_ptr().cast()),
            targets.as_ptr().cast(),
            &out,
            &g,
            ws,
            ws_len,
            ptr::null_mut(),
        )
    })
}
