//! Safe Rust wrappers over libfusedce: fused cross-entropy for large vocabularies.
//!
//! The calls of the C ABI (`include/fusedce.h`; the math is `docs/semantics.md`'s):
//! - [`forward`]: loss (+ lse, z-loss) over logits `[rows, vocab]`, and the gradient over the
//!   logits in the same pass when given a buffer for it;
//! - [`backward`]: the gradient from the logits, the targets and the saved lse;
//! - [`backward_rescale`]: the gradient [`forward`] wrote for an upstream 1, made the gradient
//!   for the upstream scalar once it is known (free when it is 1);
//! - [`linear_ce`]: z = h·Wᵀ + b and the cross-entropy without holding z whole, with the
//!   gradients of h, W and b;
//! - [`scale_gradient`]: a gradient written without the upstream gradient, scaled by it once it
//!   is known.
//!
//! The safe functions take host slices and run on the CPU backend: `f32` slices for float32,
//! `u16` bit slices ([`bits`] converts) for float16/bfloat16 selected by [`Options::dtype`],
//! `i32`/`i64` targets. Slice lengths are checked here; everything else is checked by the
//! library, whose message comes back in [`Error`]. For device memory and a CUDA stream, use
//! the `unsafe` functions of [`raw`].
//!
//! Since 0.3: [`Options::shift`] (the causal shift by k) and [`Options::token_scaling`], and the
//! optional outputs `argmax` (each row's predicted class) and `accuracy`, given per call to
//! [`ForwardBuffers`] / [`LinearCeBuffers`] (host slices) or [`raw::ForwardArgs`] /
//! [`raw::LinearCeArgs`] (pointers).
//!
//! ```no_run
//! # fn main() -> fusedce::Result<()> {
//! use fusedce::{forward, ForwardBuffers, Options, Reduction};
//! let (rows, vocab) = (2, 4);
//! let logits = [0.1f32, 2.0, -1.0, 0.5, 1.5, 0.0, 0.3, -0.2];
//! let targets = [1i64, 3];
//! let opts = Options::new().reduction(Reduction::Mean).label_smoothing(0.1);
//! let mut loss = [0.0f32];
//! let mut grad = vec![0.0f32; rows * vocab];
//! forward(&opts, rows, vocab, &logits, &targets,
//!         ForwardBuffers::new(&mut loss).grad_logits(&mut grad))?;
//! println!("loss {}", loss[0]);
//! # Ok(()) }
//! ```
//!
//! Linking: `fusedce-sys` finds libfusedce through `FUSEDCE_LIB_DIR`, then pkg-config.
#![warn(missing_docs)]

pub use fusedce_sys as sys;

pub mod bits;
mod error;
mod host;
mod options;
pub mod raw;

pub use error::{Error, Result, Status};
pub use host::{
    backward, backward_in_place, backward_rescale, backward_workspace_size, forward,
    forward_in_place, forward_workspace_size, linear_ce, linear_ce_workspace_size, scale_gradient,
    BackwardBuffers, Element, ForwardBuffers, HostWorkspace, LinearCeBuffers, Target,
    WorkspaceSize,
};
pub use options::{Backend, Dtype, Options, Reduction, TargetDtype};

/// `FCE_FLAG_TARGET_OUT_OF_RANGE`: a bit of the error-flags word: some target was outside
/// [0, vocab) and not ignore_index (its row's loss is NaN).
pub const FLAG_TARGET_OUT_OF_RANGE: u32 = sys::FCE_FLAG_TARGET_OUT_OF_RANGE;

/// `FCE_VERSION_NUMBER` of the header these bindings were generated from.
pub const HEADER_VERSION: u32 = sys::FCE_VERSION_NUMBER;

/// `FCE_VERSION_NUMBER` the loaded library was built with (major·10000 + minor·100 + patch).
pub fn version() -> u32 {
    // SAFETY: no arguments, no state.
    unsafe { sys::fce_version() }
}

/// Ok when the loaded library can serve these bindings, by the rule every fusedce binding follows
/// (`bindings/README.md`, "Library versions"): the library's major version must equal the
/// binding's; an older minor is accepted, and what it lacks returns [`Status::Unsupported`]
/// ("<feature>: needs libfusedce >= 0.x; the loaded library is 0.y.z") when asked for; a newer
/// minor is accepted.
pub fn check_version() -> Result<()> {
    let (lib, hdr) = (version(), HEADER_VERSION);
    if lib / 10000 == hdr / 10000 {
        Ok(())
    } else {
        Err(Error::new(
            Status::Unsupported,
            format!(
                "fusedce: the library is version {} (major {}), these bindings were written for \
                 {} (major {}): the major versions must be equal",
                format_version(lib),
                lib / 10000,
                format_version(hdr),
                hdr / 10000
            ),
        ))
    }
}

fn format_version(n: u32) -> String {
    format!("{}.{}.{}", n / 10000, n / 100 % 100, n % 100)
}

/// `Err(Status::Unsupported)` "<what>: needs libfusedce >= 0.x; the loaded library is 0.y.z"
/// when the loaded library is older than the `FCE_VERSION_NUMBER` `since`.
pub(crate) fn require(what: &str, since: u32) -> Result<()> {
    let lib = version();
    if lib >= since {
        return Ok(());
    }
    Err(Error::new(
        Status::Unsupported,
        format!(
            "{what}: needs libfusedce >= {}.{}; the loaded library is {}",
            since / 10000,
            since / 100 % 100,
            format_version(lib)
        ),
    ))
}

/// The struct to pass the loaded library: as built (a library of another major version is
/// refused when it is loaded; every 1.x library knows the 1.0 struct).
pub(crate) fn options_for_library(raw: sys::fce_options) -> Result<sys::fce_options> {
    Ok(raw)
}

/// Whether this library has the CUDA backend and sees a CUDA device.
pub fn cuda_available() -> bool {
    // SAFETY: no arguments.
    unsafe { sys::fce_cuda_available() != 0 }
}

/// What the loaded library was built with and runs on, one line (`fce_build_info()`): version,
/// backends, the CPU backend's BLAS. A library older than 0.3 has no `fce_build_info`: the line
/// then says so.
pub fn build_info() -> String {
    if let Err(e) = require("fce_build_info", 300) {
        return e.message().to_string();
    }
    // SAFETY: no arguments; the library returns a NUL-terminated string of static storage.
    unsafe { std::ffi::CStr::from_ptr(sys::fce_build_info()) }
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_rule() {
        check_version().unwrap(); // the library these tests run against: the same major
        assert!(require("anything", 100).is_ok()); // every library has 0.1's
        let e = require("a feature of 1.99", 19900).unwrap_err();
        assert_eq!(e.status(), Status::Unsupported);
        let want = format!(
            "a feature of 1.99: needs libfusedce >= 1.99; the loaded library is {}",
            format_version(version())
        );
        assert_eq!(e.message(), want);
        let raw = *Options::new().shift_seq_len(4).shift(2).as_raw();
        let passed = options_for_library(raw).unwrap(); // any 1.x library: the 1.0 struct
        assert_eq!(passed.struct_size, std::mem::size_of::<sys::fce_options>());
        assert_eq!(format_version(30102), "3.1.2");
    }
}
