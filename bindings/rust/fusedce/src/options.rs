//! `Options`: a builder over `fce_options`, every option of it (its two outputs, argmax and
//! accuracy, are given per call with the other outputs).
use std::marker::PhantomData;
use std::mem::size_of;

use crate::sys;

/// Where the buffers live and where the work runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Device pointers, a `cudaStream_t` as `*mut c_void`, asynchronous (the C default).
    Cuda,
    /// Host pointers, stream ignored, synchronous and multithreaded.
    Cpu,
}

/// Element type of logits / hidden states, weight, bias and their gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// `f32` (FCE_FLOAT32).
    Float32,
    /// IEEE half, passed as its `u16` bits (FCE_FLOAT16).
    Float16,
    /// bfloat16, passed as its `u16` bits (FCE_BFLOAT16).
    BFloat16,
}

/// Element type of the targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TargetDtype {
    /// `i32` (FCE_INT32).
    Int32,
    /// `i64` (FCE_INT64, torch's, the default).
    Int64,
}

/// How row losses become the loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reduction {
    /// The cross-entropy terms / sum of class weights of the non-ignored rows (torch's), plus
    /// the z-loss terms / the number of non-ignored rows (Liger's); the default.
    Mean,
    /// Sum of row losses.
    Sum,
    /// One loss per row.
    None,
}

impl Backend {
    pub(crate) fn raw(self) -> i32 {
        (match self {
            Backend::Cuda => sys::FCE_BACKEND_CUDA,
            Backend::Cpu => sys::FCE_BACKEND_CPU,
        }) as i32
    }
    fn from_raw(v: i32) -> Option<Backend> {
        match v as u32 {
            sys::FCE_BACKEND_CUDA => Some(Backend::Cuda),
            sys::FCE_BACKEND_CPU => Some(Backend::Cpu),
            _ => None,
        }
    }
}

impl Dtype {
    pub(crate) fn raw(self) -> i32 {
        (match self {
            Dtype::Float32 => sys::FCE_FLOAT32,
            Dtype::Float16 => sys::FCE_FLOAT16,
            Dtype::BFloat16 => sys::FCE_BFLOAT16,
        }) as i32
    }
    pub(crate) fn from_raw(v: i32) -> Option<Dtype> {
        match v as u32 {
            sys::FCE_FLOAT32 => Some(Dtype::Float32),
            sys::FCE_FLOAT16 => Some(Dtype::Float16),
            sys::FCE_BFLOAT16 => Some(Dtype::BFloat16),
            _ => None,
        }
    }
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Float32 => 4,
            Dtype::Float16 | Dtype::BFloat16 => 2,
        }
    }
}

impl TargetDtype {
    pub(crate) fn raw(self) -> i32 {
        (match self {
            TargetDtype::Int32 => sys::FCE_INT32,
            TargetDtype::Int64 => sys::FCE_INT64,
        }) as i32
    }
    fn from_raw(v: i32) -> Option<TargetDtype> {
        match v as u32 {
            sys::FCE_INT32 => Some(TargetDtype::Int32),
            sys::FCE_INT64 => Some(TargetDtype::Int64),
            _ => None,
        }
    }
}

impl Reduction {
    fn raw(self) -> i32 {
        (match self {
            Reduction::Mean => sys::FCE_REDUCTION_MEAN,
            Reduction::Sum => sys::FCE_REDUCTION_SUM,
            Reduction::None => sys::FCE_REDUCTION_NONE,
        }) as i32
    }
    pub(crate) fn from_raw(v: i32) -> Option<Reduction> {
        match v as u32 {
            sys::FCE_REDUCTION_MEAN => Some(Reduction::Mean),
            sys::FCE_REDUCTION_SUM => Some(Reduction::Sum),
            sys::FCE_REDUCTION_NONE => Some(Reduction::None),
            _ => None,
        }
    }
}

/// Every option of every call (`fce_options`), built by chaining:
///
/// ```no_run
/// use fusedce::{Options, Reduction};
/// let opts = Options::new()
///     .reduction(Reduction::Sum)
///     .label_smoothing(0.1)
///     .z_loss_scale(1e-4);
/// ```
///
/// The defaults are the C header's `FCE_OPTIONS_INIT`. The lifetime `'w` is that of borrowed
/// class weights ([`Options::class_weights`]); the host functions ignore the `backend` and
/// target-dtype fields (they run on the CPU backend with the targets' own type).
///
/// The two outputs that live in `fce_options` (`argmax`, `accuracy`, since 0.3) are not set
/// here: they are per-call buffers, given like the other outputs, to [`crate::ForwardBuffers`]
/// and [`crate::LinearCeBuffers`] (host slices), or [`crate::raw::ForwardArgs`] and
/// [`crate::raw::LinearCeArgs`] (pointers); each call puts them into its own copy of the struct.
#[derive(Clone, Copy, Debug)]
pub struct Options<'w> {
    raw: sys::fce_options,
    /// Length of host class weights set through the safe setter, checked against vocab.
    weights_len: Option<usize>,
    _weights: PhantomData<&'w [f32]>,
}

impl Default for Options<'_> {
    fn default() -> Self {
        Options::new()
    }
}

impl<'w> Options<'w> {
    /// The defaults of `FCE_OPTIONS_INIT`: mean reduction, ignore_index −100, dense strides,
    /// float32 logits, int64 targets, no smoothing, z-loss, softcap, shift or token scaling;
    /// logit scale 1; CUDA.
    pub fn new() -> Self {
        // Built here rather than with fce_options_default(), which writes the library's own
        // sizeof(fce_options): a newer library would write past a struct of this size.
        let raw = sys::fce_options {
            struct_size: size_of::<sys::fce_options>(),
            class_weights: std::ptr::null(),
            ignore_index: -100,
            row_stride: 0,
            grad_row_stride: 0,
            shift_seq_len: 0,
            hidden_row_stride: 0,
            backend: sys::FCE_BACKEND_CUDA as i32,
            dtype: sys::FCE_FLOAT32 as i32,
            target_dtype: sys::FCE_INT64 as i32,
            reduction: sys::FCE_REDUCTION_MEAN as i32,
            label_smoothing: 0.0,
            z_loss_scale: 0.0,
            softcap: 0.0,
            logit_scale: 1.0,
            deterministic: 0,
            accumulate: 0,
            grad_weight_fp32: 0,
            vp_entropy: 0,
            shift: 0,
            token_scaling: 0,
            batch_invariant: 0,
        };
        Options {
            raw,
            weights_len: None,
            _weights: PhantomData,
        }
    }

    /// Host class weights ω `[vocab]` for the CPU backend (checked against vocab by the host
    /// functions). For device weights use [`Options::class_weights_ptr`].
    pub fn class_weights(mut self, weights: &'w [f32]) -> Self {
        self.raw.class_weights = weights.as_ptr();
        self.weights_len = Some(weights.len());
        self
    }

    /// Class weights by pointer: float32 `[vocab]` in the memory of the backend that will run
    /// the call (device memory for CUDA); null for none.
    ///
    /// # Safety
    /// The pointer must stay valid, hold `vocab` floats and live in the right memory for every
    /// call made with these options, including the safe host functions (CPU: host memory).
    pub unsafe fn class_weights_ptr(mut self, weights: *const f32) -> Self {
        self.raw.class_weights = weights;
        self.weights_len = None;
        self
    }

    /// No class weights (all 1), the default.
    pub fn no_class_weights(mut self) -> Self {
        self.raw.class_weights = std::ptr::null();
        self.weights_len = None;
        self
    }

    /// Rows whose target equals this get loss 0 and a zero gradient (default −100).
    pub fn ignore_index(mut self, index: i64) -> Self {
        self.raw.ignore_index = index;
        self
    }

    /// Elements between rows of the logits; 0 = vocab (dense, the default).
    pub fn row_stride(mut self, stride: i64) -> Self {
        self.raw.row_stride = stride;
        self
    }

    /// Elements between rows of grad_logits; 0 = vocab (dense, the default).
    pub fn grad_row_stride(mut self, stride: i64) -> Self {
        self.raw.grad_row_stride = stride;
        self
    }

    /// Causal shift with sequence length T > 0: row b·T+t is scored against target b·T+t+k
    /// (k = [`Options::shift`], 1 by default) and rows with t ≥ T−k are ignored (rows must be a
    /// multiple of T); 0 = off (the default).
    pub fn shift_seq_len(mut self, seq_len: i64) -> Self {
        self.raw.shift_seq_len = seq_len;
        self
    }

    /// The shift k ≥ 0 of the causal shift (with [`Options::shift_seq_len`] T > 0): row b·T+t
    /// is scored against target b·T+t+k and rows with t ≥ T−k are ignored (CCE's integer
    /// shift). 0 means 1, the default (the shift of 0.2); it must be 0 without a
    /// `shift_seq_len`. Since 0.3.
    pub fn shift(mut self, k: i64) -> Self {
        self.raw.shift = k;
        self
    }

    /// linear_ce: elements between rows of the hidden states; 0 = hidden size (the default).
    pub fn hidden_row_stride(mut self, stride: i64) -> Self {
        self.raw.hidden_row_stride = stride;
        self
    }

    /// Backend of the raw (pointer) calls and of the workspace queries; default CUDA.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.raw.backend = backend.raw();
        self
    }

    /// Element type of logits / hidden, weight, bias and gradients; default float32. The
    /// host functions take `f32` slices for Float32 and `u16` bit slices for the others.
    pub fn dtype(mut self, dtype: Dtype) -> Self {
        self.raw.dtype = dtype.raw();
        self
    }

    /// Type of the targets for the raw calls; default Int64 (the host functions use the type
    /// of the slice they are given).
    pub fn target_dtype(mut self, dtype: TargetDtype) -> Self {
        self.raw.target_dtype = dtype.raw();
        self
    }

    /// Reduction; default mean.
    pub fn reduction(mut self, reduction: Reduction) -> Self {
        self.raw.reduction = reduction.raw();
        self
    }

    /// Label smoothing ε in [0, 1); default 0.
    pub fn label_smoothing(mut self, epsilon: f32) -> Self {
        self.raw.label_smoothing = epsilon;
        self
    }

    /// z-loss scale λ ≥ 0: adds λ·lse² to each row's loss; default 0. For the mean, the z-loss
    /// terms are divided by the number of non-ignored rows (not by the class weights' sum).
    pub fn z_loss_scale(mut self, lambda: f32) -> Self {
        self.raw.z_loss_scale = lambda;
        self
    }

    /// Softcap c ≥ 0: a = c·tanh(a/c) when c > 0; default 0 (off).
    pub fn softcap(mut self, cap: f32) -> Self {
        self.raw.softcap = cap;
        self
    }

    /// Logit scale s (finite, non-zero): a = s·z before anything else; default 1.
    pub fn logit_scale(mut self, scale: f32) -> Self {
        self.raw.logit_scale = scale;
        self
    }

    /// Token scaling (Liger's `use_token_scaling`): each scored row's loss, its z-loss term
    /// included, and its gradient are multiplied by p_y = exp(a_y − lse), treated as a constant;
    /// the mean's denominators are unchanged. Default off. Since 0.3.
    pub fn token_scaling(mut self, on: bool) -> Self {
        self.raw.token_scaling = on as i32;
        self
    }

    /// Batch invariance (docs/semantics.md rule 21): each row's loss (reduction none), lse,
    /// entropy, argmax and gradient row are bitwise the same whatever the other rows of the
    /// call, the row's position and (linear CE) the workspace size. Not the reduced loss, nor
    /// grad_weight / grad_bias. The CUDA backend needs 16-byte aligned logits rows; the
    /// vocabulary-parallel and distillation calls refuse it. Default off. Since 1.0.
    pub fn batch_invariant(mut self, on: bool) -> Self {
        self.raw.batch_invariant = on as i32;
        self
    }

    /// Bitwise-identical results run to run.
    pub fn deterministic(mut self, on: bool) -> Self {
        self.raw.deterministic = on as i32;
        self
    }

    /// linear_ce: add into grad_weight and grad_bias (gradient accumulation) instead of
    /// overwriting them; grad_hidden is always overwritten.
    pub fn accumulate(mut self, on: bool) -> Self {
        self.raw.accumulate = on as i32;
        self
    }

    /// linear_ce: grad_weight and grad_bias are float32 whatever the dtype. The host
    /// [`crate::linear_ce`] sets this itself from the kind of gradient slices it is given.
    pub fn grad_weight_fp32(mut self, on: bool) -> Self {
        self.raw.grad_weight_fp32 = on as i32;
        self
    }

    // ---- getters

    /// The class-weight pointer (null when none).
    pub fn get_class_weights(&self) -> *const f32 {
        self.raw.class_weights
    }
    /// See [`Options::ignore_index`].
    pub fn get_ignore_index(&self) -> i64 {
        self.raw.ignore_index
    }
    /// See [`Options::row_stride`].
    pub fn get_row_stride(&self) -> i64 {
        self.raw.row_stride
    }
    /// See [`Options::grad_row_stride`].
    pub fn get_grad_row_stride(&self) -> i64 {
        self.raw.grad_row_stride
    }
    /// See [`Options::shift_seq_len`].
    pub fn get_shift_seq_len(&self) -> i64 {
        self.raw.shift_seq_len
    }
    /// See [`Options::shift`] (the raw value: 0 means 1).
    pub fn get_shift(&self) -> i64 {
        self.raw.shift
    }
    /// See [`Options::hidden_row_stride`].
    pub fn get_hidden_row_stride(&self) -> i64 {
        self.raw.hidden_row_stride
    }
    /// See [`Options::backend`] (None if the raw value is not a known backend).
    pub fn get_backend(&self) -> Option<Backend> {
        Backend::from_raw(self.raw.backend)
    }
    /// See [`Options::dtype`].
    pub fn get_dtype(&self) -> Option<Dtype> {
        Dtype::from_raw(self.raw.dtype)
    }
    /// See [`Options::target_dtype`].
    pub fn get_target_dtype(&self) -> Option<TargetDtype> {
        TargetDtype::from_raw(self.raw.target_dtype)
    }
    /// See [`Options::reduction`].
    pub fn get_reduction(&self) -> Option<Reduction> {
        Reduction::from_raw(self.raw.reduction)
    }
    /// See [`Options::label_smoothing`].
    pub fn get_label_smoothing(&self) -> f32 {
        self.raw.label_smoothing
    }
    /// See [`Options::z_loss_scale`].
    pub fn get_z_loss_scale(&self) -> f32 {
        self.raw.z_loss_scale
    }
    /// See [`Options::softcap`].
    pub fn get_softcap(&self) -> f32 {
        self.raw.softcap
    }
    /// See [`Options::logit_scale`].
    pub fn get_logit_scale(&self) -> f32 {
        self.raw.logit_scale
    }
    /// See [`Options::deterministic`].
    pub fn get_deterministic(&self) -> bool {
        self.raw.deterministic != 0
    }
    /// See [`Options::accumulate`].
    pub fn get_accumulate(&self) -> bool {
        self.raw.accumulate != 0
    }
    /// See [`Options::grad_weight_fp32`].
    pub fn get_grad_weight_fp32(&self) -> bool {
        self.raw.grad_weight_fp32 != 0
    }
    /// See [`Options::token_scaling`].
    pub fn get_token_scaling(&self) -> bool {
        self.raw.token_scaling != 0
    }
    /// See [`Options::batch_invariant`].
    pub fn get_batch_invariant(&self) -> bool {
        self.raw.batch_invariant != 0
    }

    // ---- the C struct

    /// The `fce_options` this builds, for calling `fusedce_sys` directly.
    pub fn as_raw(&self) -> &sys::fce_options {
        &self.raw
    }

    /// Options from a C struct (for instance one filled by `fce_options_default`).
    ///
    /// Its `argmax` and `accuracy` output pointers are kept for the raw calls (a non-null
    /// pointer in their argument struct takes precedence); the safe host functions ignore them
    /// and write the slices their buffers name instead.
    ///
    /// # Safety
    /// `class_weights`, if not null, must satisfy what [`Options::class_weights_ptr`] asks;
    /// `argmax` and `accuracy`, if not null, must point to outputs of the sizes
    /// `include/fusedce.h` gives them, in the memory of the backend of every raw call made
    /// with these options.
    pub unsafe fn from_raw(raw: sys::fce_options) -> Self {
        Options {
            raw,
            weights_len: None,
            _weights: PhantomData,
        }
    }

    pub(crate) fn weights_len(&self) -> Option<usize> {
        self.weights_len
    }

    pub(crate) fn raw_mut(&mut self) -> &mut sys::fce_options {
        &mut self.raw
    }
}
