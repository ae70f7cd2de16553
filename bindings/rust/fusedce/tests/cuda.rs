//! The CUDA entry points of the crate, executed: every `raw::*` call on device memory and a
//! stream (Backend::Cuda), against the same call on the CPU backend with the same inputs, in
//! float32 and bfloat16. Tolerances are those the CPU-vs-reference tests use per dtype
//! (cross_entropy.rs, linear_ce.rs); the one place CUDA's documented precision differs from
//! the CPU's (linear_ce in bf16 rounds the logits z to bf16 like torch eager, the CPU keeps them
//! in float32) adds the library's own bound u·(4 + 2·max|z|) (tests/test_linear_ce.cpp).
//!
//! No GPU, no failure: each test prints "skipped: no CUDA device (why)" and returns when the CUDA
//! runtime cannot be loaded, cudaGetDeviceCount reports none, or libfusedce has no CUDA backend.
//! FUSEDCE_REQUIRE_CUDA=1 (set by run_gpu_tests.sh) turns that skip into a failure.
//!
//! FUSEDCE_CUDA_TESTS_ON_CPU=1 runs the same tests with "device" buffers in host memory and
//! Backend::Cpu in place of Backend::Cuda (no CUDA runtime touched): the harness checking itself
//! (sizes, pointers, the bit-for-bit and tolerance logic) where there is no GPU; run_tests.sh
//! runs it. The CPU-vs-CPU answers then agree trivially, so it proves nothing about CUDA.
//!
//! The CUDA runtime is opened at run time with dlopen (declared below, from libc; no crate),
//! so that this file builds and links where no CUDA toolkit exists (CI): tried in order
//! $FUSEDCE_CUDART (a file), $FUSEDCE_CUDART_DIR/libcudart.so.{13,12,} (at run time, then as
//! it was at build time), the loader's search (LD_LIBRARY_PATH, ld.so.cache) for
//! libcudart.so.{13,12,}, then /usr/local/cuda/lib64. libfusedce links its own copy of the
//! runtime statically; both share the device's primary context, so the pointers and streams
//! made here are valid there.
mod common;

use std::ffi::c_void;
use std::ptr;

use common::{assert_close, backward_rtol, to_f64, Rng};
use fusedce::bits::{bf16_to_f32, f32_to_bf16};
use fusedce::{
    backward, backward_rescale, forward, linear_ce, raw, Backend, BackwardBuffers, Dtype,
    ForwardBuffers, LinearCeBuffers, Options, Reduction, Status, TargetDtype,
    FLAG_TARGET_OUT_OF_RANGE,
};

// =============================================================== the CUDA runtime, dlopen'ed ==

mod cudart {
    use std::ffi::{c_char, c_int, c_void, CStr, CString};
    use std::sync::OnceLock;

    type Err = c_int;

    extern "C" {
        fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
        fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
        fn dlerror() -> *const c_char;
    }
    const RTLD_NOW: c_int = 2;

    pub const H2D: c_int = 1; // cudaMemcpyHostToDevice
    pub const D2H: c_int = 2; // cudaMemcpyDeviceToHost
    pub const D2D: c_int = 3; // cudaMemcpyDeviceToDevice
    pub const ATTR_PAGEABLE_MEMORY_ACCESS: c_int = 88; // cudaDevAttrPageableMemoryAccess

    /// The functions of libcudart these tests use.
    pub struct Api {
        /// The file that was opened.
        pub path: String,
        get_device_count: unsafe extern "C" fn(*mut c_int) -> Err,
        get_error_string: unsafe extern "C" fn(Err) -> *const c_char,
        malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> Err,
        free: unsafe extern "C" fn(*mut c_void) -> Err,
        memcpy: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> Err,
        memset: unsafe extern "C" fn(*mut c_void, c_int, usize) -> Err,
        stream_create: unsafe extern "C" fn(*mut *mut c_void) -> Err,
        stream_synchronize: unsafe extern "C" fn(*mut c_void) -> Err,
        stream_destroy: unsafe extern "C" fn(*mut c_void) -> Err,
        device_synchronize: unsafe extern "C" fn() -> Err,
        device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> Err,
    }

    fn candidates() -> Vec<String> {
        const NAMES: [&str; 3] = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"];
        let mut out = Vec::new();
        if let Ok(file) = std::env::var("FUSEDCE_CUDART") {
            out.push(file);
        }
        let dirs = [
            std::env::var("FUSEDCE_CUDART_DIR").ok(),
            option_env!("FUSEDCE_CUDART_DIR").map(String::from),
        ];
        for dir in dirs.into_iter().flatten() {
            out.extend(NAMES.iter().map(|n| format!("{dir}/{n}")));
        }
        out.extend(NAMES.iter().map(|n| n.to_string()));
        out.extend(NAMES.iter().map(|n| format!("/usr/local/cuda/lib64/{n}")));
        out
    }

    fn open() -> Result<Api, String> {
        let mut tried = Vec::new();
        for path in candidates() {
            let c = CString::new(path.clone()).map_err(|e| e.to_string())?;
            // SAFETY: a NUL-terminated name; dlopen has no other precondition.
            let h = unsafe { dlopen(c.as_ptr(), RTLD_NOW) };
            if h.is_null() {
                // SAFETY: dlerror returns null or a NUL-terminated message.
                let why = unsafe { dlerror() };
                let why = if why.is_null() {
                    String::from("?")
                } else {
                    unsafe { CStr::from_ptr(why) }
                        .to_string_lossy()
                        .into_owned()
                };
                tried.push(why);
                continue;
            }
            // SAFETY: h is a live handle; each symbol is cast to its C prototype (CUDA 12/13
            // runtime API, unchanged across those versions).
            return unsafe {
                Ok(Api {
                    get_device_count: sym(h, "cudaGetDeviceCount")?,
                    get_error_string: sym(h, "cudaGetErrorString")?,
                    malloc: sym(h, "cudaMalloc")?,
                    free: sym(h, "cudaFree")?,
                    memcpy: sym(h, "cudaMemcpy")?,
                    memset: sym(h, "cudaMemset")?,
                    stream_create: sym(h, "cudaStreamCreate")?,
                    stream_synchronize: sym(h, "cudaStreamSynchronize")?,
                    stream_destroy: sym(h, "cudaStreamDestroy")?,
                    device_synchronize: sym(h, "cudaDeviceSynchronize")?,
                    device_get_attribute: sym(h, "cudaDeviceGetAttribute")?,
                    path,
                })
            };
        }
        Err(format!(
            "libcudart not found (set FUSEDCE_CUDART_DIR); dlopen said: {}",
            tried.join("; ")
        ))
    }

    /// # Safety
    /// `F` must be the function-pointer type of the symbol `name`.
    unsafe fn sym<F: Copy>(h: *mut c_void, name: &str) -> Result<F, String> {
        assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
        let c = CString::new(name).unwrap();
        let p = dlsym(h, c.as_ptr());
        if p.is_null() {
            return Err(format!("libcudart has no {name}"));
        }
        Ok(std::mem::transmute_copy::<*mut c_void, F>(&p))
    }

    /// The runtime, opened once per process.
    pub fn api() -> Result<&'static Api, String> {
        static API: OnceLock<Result<Api, String>> = OnceLock::new();
        API.get_or_init(open).as_ref().map_err(Clone::clone)
    }

    impl Api {
        fn error(&self, e: Err) -> String {
            // SAFETY: returns a static NUL-terminated string for any code.
            let s = unsafe { (self.get_error_string)(e) };
            let s = if s.is_null() {
                "?".into()
            } else {
                unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
            };
            format!("error {e} ({s})")
        }
        #[track_caller]
        pub fn check(&self, e: Err, what: &str) {
            assert!(e == 0, "{what}: {}", self.error(e));
        }
        /// cudaGetDeviceCount; Err with the runtime's message (no driver, no device, ...).
        pub fn device_count(&self) -> Result<i32, String> {
            let mut n = 0;
            // SAFETY: a valid out pointer.
            match unsafe { (self.get_device_count)(&mut n) } {
                0 => Ok(n),
                e => Err(self.error(e)),
            }
        }
        pub fn attribute(&self, attr: c_int) -> i32 {
            let mut v = 0;
            // SAFETY: a valid out pointer, device 0.
            self.check(
                unsafe { (self.device_get_attribute)(&mut v, attr, 0) },
                "cudaDeviceGetAttribute",
            );
            v
        }
        pub unsafe fn malloc(&self, bytes: usize) -> *mut c_void {
            let mut p = std::ptr::null_mut();
            self.check((self.malloc)(&mut p, bytes), "cudaMalloc");
            p
        }
        pub unsafe fn free(&self, p: *mut c_void) {
            self.check((self.free)(p), "cudaFree");
        }
        pub unsafe fn memcpy(
            &self,
            dst: *mut c_void,
            src: *const c_void,
            bytes: usize,
            kind: c_int,
        ) {
            self.check((self.memcpy)(dst, src, bytes, kind), "cudaMemcpy");
        }
        pub unsafe fn memset(&self, p: *mut c_void, value: c_int, bytes: usize) {
            self.check((self.memset)(p, value, bytes), "cudaMemset");
        }
        pub fn stream_create(&self) -> *mut c_void {
            let mut s = std::ptr::null_mut();
            // SAFETY: a valid out pointer.
            self.check(unsafe { (self.stream_create)(&mut s) }, "cudaStreamCreate");
            s
        }
        /// cudaStreamSynchronize (null: the legacy default stream), then cudaDeviceSynchronize
        /// to surface any asynchronous error.
        pub unsafe fn sync(&self, s: *mut c_void) {
            self.check((self.stream_synchronize)(s), "cudaStreamSynchronize");
            self.check((self.device_synchronize)(), "cudaDeviceSynchronize");
        }
        pub unsafe fn stream_destroy(&self, s: *mut c_void) {
            self.check((self.stream_destroy)(s), "cudaStreamDestroy");
        }
    }
}

/// FUSEDCE_CUDA_TESTS_ON_CPU: the harness on the CPU backend over host memory (see the top).
fn on_cpu() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("FUSEDCE_CUDA_TESTS_ON_CPU").is_ok_and(|v| !v.is_empty() && v != "0")
    })
}

/// The backend of the "device" calls: CUDA, or the CPU under FUSEDCE_CUDA_TESTS_ON_CPU.
fn dev() -> Backend {
    if on_cpu() {
        Backend::Cpu
    } else {
        Backend::Cuda
    }
}

/// Whether to run: a CUDA device and a libfusedce with the CUDA backend. Otherwise prints the
/// skip line (or panics under FUSEDCE_REQUIRE_CUDA).
fn gpu() -> bool {
    if on_cpu() {
        println!("FUSEDCE_CUDA_TESTS_ON_CPU: the harness on the CPU backend over host memory");
        return true;
    }
    let why = match cudart::api() {
        Err(why) => Some(format!("the CUDA runtime could not be loaded: {why}")),
        Ok(api) => match api.device_count() {
            Err(e) => Some(format!("cudaGetDeviceCount: {e}")),
            Ok(n) if n <= 0 => Some(String::from("cudaGetDeviceCount reports 0 devices")),
            Ok(_) if !fusedce::cuda_available() => Some(format!(
                "libfusedce reports no usable CUDA backend: {}",
                fusedce::build_info()
            )),
            Ok(_) => None,
        },
    };
    let Some(why) = why else {
        return true;
    };
    if std::env::var("FUSEDCE_REQUIRE_CUDA").is_ok_and(|v| !v.is_empty() && v != "0") {
        panic!("FUSEDCE_REQUIRE_CUDA is set, but: {why}");
    }
    println!("skipped: no CUDA device ({why})");
    false
}

fn api() -> &'static cudart::Api {
    cudart::api().expect("checked by gpu()")
}

/// Device memory, freed on drop. Zero bytes: a null pointer.
struct DevBuf {
    ptr: *mut c_void,
    bytes: usize,
}

impl DevBuf {
    fn new(bytes: usize) -> DevBuf {
        let ptr = if bytes == 0 {
            ptr::null_mut()
        } else if on_cpu() {
            // SAFETY: a non-zero size; freed in drop with the same layout.
            let p = unsafe { std::alloc::alloc(DevBuf::layout(bytes)) };
            assert!(!p.is_null(), "host allocation of {bytes} bytes");
            p.cast()
        } else {
            // SAFETY: plain allocation.
            unsafe { api().malloc(bytes) }
        };
        DevBuf { ptr, bytes }
    }
    /// The host layout under FUSEDCE_CUDA_TESTS_ON_CPU (256-byte aligned, as cudaMalloc's).
    fn layout(bytes: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(bytes, 256).unwrap()
    }
    /// cudaMemcpy, or a plain copy under FUSEDCE_CUDA_TESTS_ON_CPU.
    ///
    /// # Safety
    /// `bytes` readable at `src` and writable at `dst`, in the memory `kind` names.
    unsafe fn memcpy(dst: *mut c_void, src: *const c_void, bytes: usize, kind: std::ffi::c_int) {
        if on_cpu() {
            ptr::copy_nonoverlapping(src.cast::<u8>(), dst.cast::<u8>(), bytes);
        } else {
            api().memcpy(dst, src, bytes, kind);
        }
    }
    fn zero(&self) {
        if self.bytes == 0 {
            return;
        }
        // SAFETY: the buffer's own bytes.
        unsafe {
            if on_cpu() {
                ptr::write_bytes(self.ptr.cast::<u8>(), 0, self.bytes);
            } else {
                api().memset(self.ptr, 0, self.bytes);
            }
        }
    }
    fn null() -> DevBuf {
        DevBuf::new(0)
    }
    fn from<T: Copy>(data: &[T]) -> DevBuf {
        let b = DevBuf::new(std::mem::size_of_val(data));
        if b.bytes > 0 {
            // SAFETY: b holds exactly the bytes of data.
            unsafe { DevBuf::memcpy(b.ptr, data.as_ptr().cast(), b.bytes, cudart::H2D) };
        }
        b
    }
    fn copy(&self) -> DevBuf {
        let b = DevBuf::new(self.bytes);
        if b.bytes > 0 {
            // SAFETY: both hold self.bytes.
            unsafe { DevBuf::memcpy(b.ptr, self.ptr, b.bytes, cudart::D2D) };
        }
        b
    }
    fn to_vec<T: Copy + Default>(&self, n: usize) -> Vec<T> {
        let mut v = vec![T::default(); n];
        let bytes = std::mem::size_of_val(&v[..]);
        assert!(
            bytes <= self.bytes,
            "download of {bytes} bytes from {}",
            self.bytes
        );
        if bytes > 0 {
            // SAFETY: v holds `bytes`, the buffer at least that.
            unsafe { DevBuf::memcpy(v.as_mut_ptr().cast(), self.ptr, bytes, cudart::D2H) };
        }
        v
    }
    fn ptr<T>(&self) -> *mut T {
        self.ptr.cast()
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ptr.is_null() {
        } else if on_cpu() {
            // SAFETY: allocated in new() with this layout.
            unsafe { std::alloc::dealloc(self.ptr.cast(), DevBuf::layout(self.bytes)) };
        } else {
            // SAFETY: allocated by cudaMalloc; callers synchronise before dropping.
            unsafe { api().free(self.ptr) };
        }
    }
}

/// A stream created for the test (or the legacy default stream, null), destroyed on drop.
struct Stream(raw::Stream);

impl Stream {
    fn new() -> Stream {
        if on_cpu() {
            return Stream::legacy();
        }
        Stream(api().stream_create())
    }
    fn legacy() -> Stream {
        Stream(ptr::null_mut())
    }
    fn sync(&self) {
        if !on_cpu() {
            // SAFETY: a live stream or null.
            unsafe { api().sync(self.0) };
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: created by cudaStreamCreate; nothing is pending after sync().
            unsafe {
                api().sync(self.0);
                api().stream_destroy(self.0);
            }
        }
    }
}

// ================================================================================= dtypes ==

/// f32 (float32) or u16 (bfloat16 bits): the two dtypes these tests cover.
trait El: fusedce::Element + Default + PartialEq + std::fmt::Debug {
    const DTYPE: Dtype;
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    fn bits(self) -> u32;
}

impl El for f32 {
    const DTYPE: Dtype = Dtype::Float32;
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
}

impl El for u16 {
    const DTYPE: Dtype = Dtype::BFloat16;
    fn from_f32(x: f32) -> Self {
        f32_to_bf16(x)
    }
    fn to_f32(self) -> f32 {
        bf16_to_f32(self)
    }
    fn bits(self) -> u32 {
        self as u32
    }
}

fn is_f32<T: El>() -> bool {
    T::DTYPE == Dtype::Float32
}

fn f32s<T: El>(x: &[T]) -> Vec<f32> {
    x.iter().map(|&v| v.to_f32()).collect()
}

fn nan<T: El>(n: usize) -> Vec<T> {
    vec![T::from_f32(f32::NAN); n]
}

/// Tolerances (the rtol of common::assert_close) of the loss-like outputs and the gradients.
#[derive(Clone, Copy, Debug)]
struct Tol {
    loss: f64,
    grad: f64,
}

/// cross_entropy.rs: float32 2e-5 throughout; bf16 (half_case) 1e-4 for loss/lse, 1e-2 for the
/// gradient.
fn ce_tol<T: El>() -> Tol {
    if is_f32::<T>() {
        Tol {
            loss: 2e-5,
            grad: 2e-5,
        }
    } else {
        Tol {
            loss: 1e-4,
            grad: 1e-2,
        }
    }
}

#[track_caller]
fn assert_bits_eq<T: El>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.bits() == w.bits(),
            "{what}[{i}]: {:?} ({:#x}) vs {:?} ({:#x}), not bit for bit",
            g.to_f32(),
            g.bits(),
            w.to_f32(),
            w.bits()
        );
    }
}

/// argmax: equal, or (where the values differ by a rounding between the backends) two classes
/// whose values agree to `slack` relative; −1 (ignored rows) must agree exactly.
#[track_caller]
fn check_argmax(
    what: &str,
    got: &[i64],
    want: &[i64],
    value: impl Fn(usize, i64) -> f64,
    slack: f64,
) {
    assert_eq!(got.len(), want.len(), "{what}: argmax length");
    for r in 0..got.len() {
        if got[r] == want[r] {
            continue;
        }
        assert!(
            got[r] >= 0 && want[r] >= 0,
            "{what}: argmax[{r}] is {} on CUDA, {} on the CPU",
            got[r],
            want[r]
        );
        let (a, b) = (value(r, got[r]), value(r, want[r]));
        assert!(
            (a - b).abs() <= slack * b.abs().max(1.0),
            "{what}: argmax[{r}] is {} (value {a}) on CUDA, {} (value {b}) on the CPU",
            got[r],
            want[r]
        );
    }
}

/// accuracy: the same as the CPU's when the predicted classes are the same (else in [0, 1]).
#[track_caller]
fn check_accuracy(what: &str, got: &[f32], want: &[f32], same_argmax: bool) {
    if same_argmax {
        assert_close(&format!("{what}: accuracy"), got, &to_f64(want), 1e-6);
    } else {
        assert!(
            got.iter().all(|a| (0.0..=1.0).contains(a)),
            "{what}: accuracy {got:?}"
        );
    }
}

fn per_call(opts: &Options<'_>, rows: usize) -> usize {
    if opts.get_reduction() == Some(Reduction::None) {
        rows
    } else {
        1
    }
}

// =================================================================== forward / backward ==

/// Everything fce_forward writes.
#[derive(Clone, Debug)]
struct Fwd<T> {
    loss: Vec<f32>,
    lse: Vec<f32>,
    z_loss: f32,
    grad: Vec<T>,
    argmax: Vec<i64>,
    accuracy: Vec<f32>,
    flags: u32,
}

/// One cross-entropy problem: host data for the CPU calls, the same on the device for CUDA.
struct Ce<'w, T: El> {
    rows: usize,
    vocab: usize,
    logits: Vec<T>,
    targets: Vec<i64>,
    cpu: Options<'w>,
    cuda: Options<'w>,
    d_logits: DevBuf,
    d_targets: DevBuf,
    stream: Stream,
}

impl<T: El> Ce<'_, T> {
    fn per(&self) -> usize {
        per_call(&self.cpu, self.rows)
    }

    /// a_j of row r: softcap(scale·z), as the argmax sees it.
    fn a(&self, r: usize, j: i64) -> f64 {
        let z = self.logits[r * self.vocab + j as usize].to_f32();
        let a = (self.cpu.get_logit_scale() * z) as f64;
        let c = self.cpu.get_softcap() as f64;
        if c > 0.0 {
            c * (a / c).tanh()
        } else {
            a
        }
    }

    fn cpu_forward(&self, with_grad: bool, g: Option<&[f32]>) -> Fwd<T> {
        let (rows, per) = (self.rows, self.per());
        let mut o = Fwd {
            loss: vec![f32::NAN; per],
            lse: vec![f32::NAN; rows],
            z_loss: f32::NAN,
            grad: if with_grad {
                nan(rows * self.vocab)
            } else {
                vec![]
            },
            argmax: vec![-7; rows],
            accuracy: vec![f32::NAN; per],
            flags: 0,
        };
        let mut b = ForwardBuffers::new(&mut o.loss)
            .lse(&mut o.lse)
            .z_loss(&mut o.z_loss)
            .argmax(&mut o.argmax)
            .accuracy(&mut o.accuracy)
            .error_flags(&mut o.flags);
        if with_grad {
            b = b.grad_logits(&mut o.grad);
        }
        if let Some(g) = g {
            b = b.grad_output(g);
        }
        forward(&self.cpu, rows, self.vocab, &self.logits, &self.targets, b).expect("CPU forward");
        o
    }

    /// raw::forward on CUDA; `in_place`: the gradient over a device copy of the logits.
    fn cuda_forward(&self, with_grad: bool, in_place: bool, g: Option<&[f32]>) -> Fwd<T> {
        let (rows, vocab, per) = (self.rows, self.vocab, self.per());
        let loss = DevBuf::from(&vec![f32::NAN; per]);
        let lse = DevBuf::from(&vec![f32::NAN; rows]);
        let z_loss = DevBuf::from(&[f32::NAN]);
        let argmax = DevBuf::from(&vec![-7i64; rows]);
        let accuracy = DevBuf::from(&vec![f32::NAN; per]);
        let flags = DevBuf::from(&[0u32]);
        let grad = if in_place {
            self.d_logits.copy()
        } else if with_grad {
            DevBuf::from(&nan::<T>(rows * vocab))
        } else {
            DevBuf::null()
        };
        let d_g = g.map(DevBuf::from);
        let ws = DevBuf::new(fusedce::forward_workspace_size(&self.cuda, rows, vocab).unwrap());
        let logits = if in_place {
            grad.ptr
        } else {
            self.d_logits.ptr
        };
        // SAFETY: every pointer is device memory of the sizes fce_forward reads and writes,
        // live until the stream is synchronised below.
        unsafe {
            raw::forward(
                &self.cuda,
                rows as i64,
                vocab as i64,
                &raw::ForwardArgs {
                    logits,
                    targets: self.d_targets.ptr,
                    loss: loss.ptr(),
                    lse: lse.ptr(),
                    z_loss: z_loss.ptr(),
                    argmax: argmax.ptr(),
                    accuracy: accuracy.ptr(),
                    grad_logits: grad.ptr,
                    grad_output: d_g.as_ref().map_or(ptr::null(), |b| b.ptr()),
                    error_flags: flags.ptr(),
                    workspace: ws.ptr,
                    workspace_bytes: ws.bytes,
                    stream: self.stream.0,
                },
            )
        }
        .unwrap_or_else(|e| panic!("raw::forward on CUDA: {e}"));
        self.stream.sync();
        Fwd {
            loss: loss.to_vec(per),
            lse: lse.to_vec(rows),
            z_loss: z_loss.to_vec::<f32>(1)[0],
            grad: if with_grad || in_place {
                grad.to_vec(rows * vocab)
            } else {
                vec![]
            },
            argmax: argmax.to_vec(rows),
            accuracy: accuracy.to_vec(per),
            flags: flags.to_vec::<u32>(1)[0],
        }
    }

    /// fusedce::backward (or backward_rescale over `init`) on the CPU.
    fn cpu_backward(
        &self,
        rescale: bool,
        lse: &[f32],
        g: Option<&[f32]>,
        init: Option<&[T]>,
    ) -> Vec<T> {
        let n = self.rows * self.vocab;
        let mut grad = init.map_or_else(|| nan(n), <[T]>::to_vec);
        let mut b = BackwardBuffers::new().grad_logits(&mut grad);
        if let Some(g) = g {
            b = b.grad_output(g);
        }
        let (rows, vocab) = (self.rows, self.vocab);
        if rescale {
            backward_rescale(&self.cpu, rows, vocab, &self.logits, &self.targets, lse, b)
        } else {
            backward(&self.cpu, rows, vocab, &self.logits, &self.targets, lse, b)
        }
        .expect("CPU backward");
        grad
    }

    /// raw::backward (or raw::backward_rescale over `init`) on CUDA.
    fn cuda_backward(
        &self,
        rescale: bool,
        lse: &[f32],
        g: Option<&[f32]>,
        init: Option<&[T]>,
    ) -> Vec<T> {
        let (rows, vocab) = (self.rows, self.vocab);
        let grad = DevBuf::from(&init.map_or_else(|| nan(rows * vocab), <[T]>::to_vec));
        let d_lse = DevBuf::from(lse);
        let d_g = g.map(DevBuf::from);
        let ws = DevBuf::new(fusedce::backward_workspace_size(&self.cuda, rows, vocab).unwrap());
        let args = raw::BackwardArgs {
            logits: self.d_logits.ptr,
            targets: self.d_targets.ptr,
            lse: d_lse.ptr(),
            grad_output: d_g.as_ref().map_or(ptr::null(), |b| b.ptr()),
            grad_logits: grad.ptr,
            workspace: ws.ptr,
            workspace_bytes: ws.bytes,
            stream: self.stream.0,
            ..Default::default()
        };
        // SAFETY: device buffers of the sizes fce_backward uses, synchronised below.
        unsafe {
            if rescale {
                raw::backward_rescale(&self.cuda, rows as i64, vocab as i64, &args)
            } else {
                raw::backward(&self.cuda, rows as i64, vocab as i64, &args)
            }
        }
        .unwrap_or_else(|e| {
            panic!(
                "raw::backward{} on CUDA: {e}",
                if rescale { "_rescale" } else { "" }
            )
        });
        self.stream.sync();
        grad.to_vec(rows * vocab)
    }

    /// CUDA's forward outputs against the CPU's.
    #[track_caller]
    fn check(&self, what: &str, got: &Fwd<T>, want: &Fwd<T>, tol: Tol) {
        assert_close(
            &format!("{what}: loss"),
            &got.loss,
            &to_f64(&want.loss),
            tol.loss,
        );
        assert_close(
            &format!("{what}: lse"),
            &got.lse,
            &to_f64(&want.lse),
            tol.loss,
        );
        assert_close(
            &format!("{what}: z_loss"),
            &[got.z_loss],
            &[want.z_loss as f64],
            tol.loss,
        );
        assert_eq!(got.grad.len(), want.grad.len(), "{what}: grad");
        if !want.grad.is_empty() {
            assert_close(
                &format!("{what}: grad"),
                &f32s(&got.grad),
                &to_f64(&f32s(&want.grad)),
                tol.grad,
            );
        }
        assert_eq!(got.flags, want.flags, "{what}: error flags");
        // The same logits on both backends: the same classes (rule 15's lowest index among
        // equal maxima), except that softcap's tanh may round differently.
        if self.cpu.get_softcap() > 0.0 {
            check_argmax(what, &got.argmax, &want.argmax, |r, j| self.a(r, j), 1e-6);
        } else {
            assert_eq!(got.argmax, want.argmax, "{what}: argmax");
        }
        check_accuracy(
            what,
            &got.accuracy,
            &want.accuracy,
            got.argmax == want.argmax,
        );
    }
}

/// A cross-entropy case: options (dtype and backend are set by the runner), sizes, data.
struct CeCase {
    opts: Options<'static>,
    rows: usize,
    vocab: usize,
    std: f64,
    seed: u64,
    /// Positions in the targets array set to ignore_index / to an out-of-range class.
    ignore: &'static [usize],
    invalid: &'static [usize],
    class_weights: bool,
    /// Targets as int32 on the device (TargetDtype::Int32; the CPU call takes i64).
    int32_targets: bool,
    /// The legacy default stream (null) instead of a created one.
    legacy_stream: bool,
}

impl Default for CeCase {
    fn default() -> Self {
        CeCase {
            opts: Options::new(),
            rows: 16,
            vocab: 1000,
            std: 4.0,
            seed: 1,
            ignore: &[],
            invalid: &[],
            class_weights: false,
            int32_targets: false,
            legacy_stream: false,
        }
    }
}

/// Runs every CUDA cross-entropy entry point on `case` and compares with the CPU backend:
/// forward with gradient (and grad_output), again (bit for bit run to run), without gradient,
/// in place; backward from the saved lse; for mean/sum, forward with grad_output NULL then
/// backward_rescale for g in {1, 0.5, −2, 0, 0.75} (each also bit for bit CUDA's forward with
/// that g, docs/semantics.md rule 14) and scale_gradient (bit for bit the CPU's on the same input).
fn run_ce<T: El>(name: &str, case: &CeCase) {
    if !gpu() {
        return;
    }
    let what = format!("{name} ({:?})", T::DTYPE);
    let (rows, vocab) = (case.rows, case.vocab);
    let mut rng = Rng::new(case.seed);
    let logits: Vec<T> = rng
        .normals_f32(rows * vocab, case.std)
        .into_iter()
        .map(T::from_f32)
        .collect();
    let mut targets = rng.targets(rows, vocab);
    for &i in case.ignore {
        targets[i] = case.opts.get_ignore_index();
    }
    for &i in case.invalid {
        targets[i] = vocab as i64 + 5;
    }
    let weights: Vec<f32> = (0..vocab).map(|_| 0.5 + rng.uniform() as f32).collect();
    let d_weights = DevBuf::from(&weights);
    let base = case.opts.dtype(T::DTYPE);
    let (cpu, cuda) = if case.class_weights {
        // SAFETY: d_weights holds vocab floats of device memory and outlives `cuda`.
        (base.class_weights(&weights), unsafe {
            base.class_weights_ptr(d_weights.ptr())
        })
    } else {
        (base, base)
    };
    let (cuda, d_targets) = if case.int32_targets {
        let t32: Vec<i32> = targets.iter().map(|&t| t as i32).collect();
        (cuda.target_dtype(TargetDtype::Int32), DevBuf::from(&t32))
    } else {
        (
            cuda.target_dtype(TargetDtype::Int64),
            DevBuf::from(&targets),
        )
    };
    let p = Ce {
        rows,
        vocab,
        d_logits: DevBuf::from(&logits),
        d_targets,
        logits,
        targets,
        cpu,
        cuda: cuda.backend(dev()),
        stream: if case.legacy_stream {
            Stream::legacy()
        } else {
            Stream::new()
        },
    };
    let tol = ce_tol::<T>();
    let per = p.per();
    let g: Vec<f32> = if per == 1 {
        vec![0.75]
    } else {
        (0..rows).map(|_| rng.normal(1.0) as f32).collect()
    };

    // forward with the gradient and grad_output
    let want = p.cpu_forward(true, Some(&g));
    let got = p.cuda_forward(true, false, Some(&g));
    p.check(&format!("{what}: forward"), &got, &want, tol);
    if !case.invalid.is_empty() {
        assert_eq!(
            got.flags & FLAG_TARGET_OUT_OF_RANGE,
            FLAG_TARGET_OUT_OF_RANGE,
            "{what}: flag"
        );
    }
    // run to run: bit for bit
    let again = p.cuda_forward(true, false, Some(&g));
    assert_bits_eq(
        &format!("{what}: forward run to run, loss"),
        &again.loss,
        &got.loss,
    );
    assert_bits_eq(
        &format!("{what}: forward run to run, grad"),
        &again.grad,
        &got.grad,
    );
    // loss only
    let eval = p.cuda_forward(false, false, None);
    p.check(
        &format!("{what}: forward without gradient"),
        &eval,
        &p.cpu_forward(false, None),
        tol,
    );
    // in place
    let inplace = p.cuda_forward(false, true, Some(&g));
    p.check(&format!("{what}: forward in place"), &inplace, &want, tol);

    // backward from the saved lse
    let bwant = p.cpu_backward(false, &want.lse, Some(&g), None);
    let bgot = p.cuda_backward(false, &got.lse, Some(&g), None);
    let btol = tol.grad + backward_rtol(&got.lse);
    assert_close(
        &format!("{what}: backward"),
        &f32s(&bgot),
        &to_f64(&f32s(&bwant)),
        btol,
    );
    assert_close(
        &format!("{what}: backward vs forward"),
        &f32s(&bgot),
        &to_f64(&f32s(&got.grad)),
        btol,
    );

    if per != 1 {
        return; // backward_rescale and the scalar scale_gradient are for mean/sum
    }
    let want1 = p.cpu_forward(true, None);
    let got1 = p.cuda_forward(true, false, None);
    p.check(
        &format!("{what}: forward, grad_output NULL"),
        &got1,
        &want1,
        tol,
    );
    for s in [1.0f32, 0.5, -2.0, 0.0, 0.75] {
        let w = format!("{what}: backward_rescale g={s}");
        let rwant = p.cpu_backward(true, &want1.lse, Some(&[s]), Some(&want1.grad));
        let rgot = p.cuda_backward(true, &got1.lse, Some(&[s]), Some(&got1.grad));
        assert_close(&w, &f32s(&rgot), &to_f64(&f32s(&rwant)), tol.grad);
        let fwd = p.cuda_forward(true, false, Some(&[s]));
        assert_bits_eq(&format!("{w} vs CUDA forward(g)"), &rgot, &fwd.grad);
    }
    // scale_gradient of CUDA's gradient: bit for bit the CPU's on the same elements
    let s = 0.3f32;
    let mut host = got1.grad.clone();
    fusedce::scale_gradient(T::DTYPE, &mut host, s).unwrap();
    let d = DevBuf::from(&got1.grad);
    let d_s = DevBuf::from(&[s]);
    // SAFETY: rows·vocab elements of the dtype and one float, device memory, synchronised below.
    unsafe {
        raw::scale_gradient(
            dev(),
            T::DTYPE,
            host.len() as i64,
            d.ptr,
            d_s.ptr(),
            p.stream.0,
        )
    }
    .unwrap_or_else(|e| panic!("raw::scale_gradient on CUDA: {e}"));
    p.stream.sync();
    assert_bits_eq(
        &format!("{what}: scale_gradient"),
        &d.to_vec::<T>(host.len()),
        &host,
    );
}

fn case_mean() -> CeCase {
    CeCase::default()
}

/// Label smoothing, z-loss, ignored rows, the causal shift by 1 (shift 0 = 1).
fn case_mean_smoothing_zloss_shift() -> CeCase {
    CeCase {
        opts: Options::new()
            .label_smoothing(0.1)
            .z_loss_scale(1e-4)
            .shift_seq_len(11),
        rows: 33,
        vocab: 3001,
        seed: 2,
        ignore: &[2, 9, 20],
        ..CeCase::default()
    }
}

/// Sum, class weights (device pointer on CUDA), softcap, logit scale, smoothing.
fn case_sum_weights_softcap() -> CeCase {
    CeCase {
        opts: Options::new()
            .reduction(Reduction::Sum)
            .label_smoothing(0.05)
            .softcap(20.0)
            .logit_scale(0.8),
        rows: 20,
        vocab: 777,
        std: 8.0,
        seed: 3,
        ignore: &[4],
        class_weights: true,
        ..CeCase::default()
    }
}

/// None (per-row loss, accuracy and grad_output), the shift by k = 2, token scaling, z-loss,
/// one out-of-range target (a NaN row and the flag).
fn case_none_shift2_token_scaling() -> CeCase {
    CeCase {
        opts: Options::new()
            .reduction(Reduction::None)
            .shift_seq_len(8)
            .shift(2)
            .token_scaling(true)
            .z_loss_scale(1e-3),
        rows: 24,
        vocab: 513,
        seed: 4,
        ignore: &[12],
        invalid: &[7], // row 5 (t = 5 < 8 − 2) is scored against targets[7]
        ..CeCase::default()
    }
}

/// A large vocabulary (GPT-2's), int32 targets, deterministic, the legacy default stream.
fn case_large_vocab_int32() -> CeCase {
    CeCase {
        opts: Options::new()
            .label_smoothing(0.1)
            .z_loss_scale(1e-4)
            .deterministic(true),
        rows: 8,
        vocab: 50_257,
        seed: 5,
        ignore: &[3],
        int32_targets: true,
        legacy_stream: true,
        ..CeCase::default()
    }
}

#[test]
fn ce_mean_f32() {
    run_ce::<f32>("mean", &case_mean());
}
#[test]
fn ce_mean_bf16() {
    run_ce::<u16>("mean", &case_mean());
}
#[test]
fn ce_mean_smoothing_zloss_shift_f32() {
    run_ce::<f32>(
        "mean, smoothing, z-loss, shift",
        &case_mean_smoothing_zloss_shift(),
    );
}
#[test]
fn ce_mean_smoothing_zloss_shift_bf16() {
    run_ce::<u16>(
        "mean, smoothing, z-loss, shift",
        &case_mean_smoothing_zloss_shift(),
    );
}
#[test]
fn ce_sum_weights_softcap_f32() {
    run_ce::<f32>("sum, class weights, softcap", &case_sum_weights_softcap());
}
#[test]
fn ce_sum_weights_softcap_bf16() {
    run_ce::<u16>("sum, class weights, softcap", &case_sum_weights_softcap());
}
#[test]
fn ce_none_shift2_token_scaling_f32() {
    run_ce::<f32>(
        "none, shift 2, token scaling",
        &case_none_shift2_token_scaling(),
    );
}
#[test]
fn ce_none_shift2_token_scaling_bf16() {
    run_ce::<u16>(
        "none, shift 2, token scaling",
        &case_none_shift2_token_scaling(),
    );
}
#[test]
fn ce_large_vocab_int32_targets_f32() {
    run_ce::<f32>("vocab 50257, int32 targets", &case_large_vocab_int32());
}
#[test]
fn ce_large_vocab_int32_targets_bf16() {
    run_ce::<u16>("vocab 50257, int32 targets", &case_large_vocab_int32());
}

// ============================================================================ linear_ce ==

/// Everything fce_linear_ce writes, the gradients as f32 values.
#[derive(Clone, Debug)]
struct Lin {
    loss: Vec<f32>,
    lse: Vec<f32>,
    z_loss: f32,
    argmax: Vec<i64>,
    accuracy: Vec<f32>,
    gh: Vec<f32>,
    gw: Vec<f32>,
    gb: Vec<f32>,
    flags: u32,
}

struct LinProblem<T: El> {
    rows: usize,
    hidden: usize,
    vocab: usize,
    h: Vec<T>,
    w: Vec<T>,
    b: Option<Vec<T>>,
    y: Vec<i64>,
    /// z = h·Wᵀ + b in float64 from the (rounded) inputs, for the argmax check.
    z: Vec<f64>,
    cpu: Options<'static>,
    cuda: Options<'static>,
    /// grad_weight / grad_bias in float32 whatever the dtype (grad_weight_fp32).
    fp32_grads: bool,
    d_h: DevBuf,
    d_w: DevBuf,
    d_b: DevBuf,
    d_y: DevBuf,
    stream: Stream,
}

/// What grad_weight and grad_bias hold before an accumulating call (f32 values; rounded to the
/// dtype when the gradients are of the dtype).
struct Acc {
    gw: Vec<f32>,
    gb: Vec<f32>,
}

impl<T: El> LinProblem<T> {
    fn per(&self) -> usize {
        per_call(&self.cpu, self.rows)
    }

    fn cpu_run(&self, grads: bool, g: Option<&[f32]>, acc: Option<&Acc>) -> Lin {
        let (rows, hidden, vocab, per) = (self.rows, self.hidden, self.vocab, self.per());
        let (mut loss, mut lse, mut z_loss) = (vec![f32::NAN; per], vec![f32::NAN; rows], f32::NAN);
        let (mut argmax, mut accuracy, mut flags) = (vec![-7i64; rows], vec![f32::NAN; per], 0u32);
        let nb = if self.b.is_some() { vocab } else { 0 };
        let mut gh: Vec<T> = nan(rows * hidden);
        let mut gw_t: Vec<T> = acc.map_or_else(
            || nan(vocab * hidden),
            |a| a.gw.iter().map(|&x| T::from_f32(x)).collect(),
        );
        let mut gb_t: Vec<T> = acc.map_or_else(
            || nan(nb),
            |a| a.gb.iter().map(|&x| T::from_f32(x)).collect(),
        );
        let mut gw_f: Vec<f32> =
            acc.map_or_else(|| vec![f32::NAN; vocab * hidden], |a| a.gw.clone());
        let mut gb_f: Vec<f32> = acc.map_or_else(|| vec![f32::NAN; nb], |a| a.gb.clone());
        let mut bufs = LinearCeBuffers::new(&mut loss)
            .lse(&mut lse)
            .z_loss(&mut z_loss)
            .argmax(&mut argmax)
            .accuracy(&mut accuracy)
            .error_flags(&mut flags);
        if grads {
            bufs = bufs.grad_hidden(&mut gh);
            if self.fp32_grads {
                bufs = bufs.grad_weight_f32(&mut gw_f);
                if nb > 0 {
                    bufs = bufs.grad_bias_f32(&mut gb_f);
                }
            } else {
                bufs = bufs.grad_weight(&mut gw_t);
                if nb > 0 {
                    bufs = bufs.grad_bias(&mut gb_t);
                }
            }
        }
        if let Some(g) = g {
            bufs = bufs.grad_output(g);
        }
        linear_ce(
            &self.cpu,
            rows,
            hidden,
            vocab,
            &self.h,
            &self.w,
            self.b.as_deref(),
            &self.y,
            bufs,
        )
        .expect("CPU linear_ce");
        let (gw, gb) = if self.fp32_grads {
            (gw_f, gb_f)
        } else {
            (f32s(&gw_t), f32s(&gb_t))
        };
        Lin {
            loss,
            lse,
            z_loss,
            argmax,
            accuracy,
            gh: if grads { f32s(&gh) } else { vec![] },
            gw: if grads { gw } else { vec![] },
            gb: if grads { gb } else { vec![] },
            flags,
        }
    }

    /// raw::linear_ce on CUDA with the minimum (`min_ws`) or the optimal workspace.
    fn cuda_run(&self, grads: bool, g: Option<&[f32]>, acc: Option<&Acc>, min_ws: bool) -> Lin {
        let (rows, hidden, vocab, per) = (self.rows, self.hidden, self.vocab, self.per());
        let nb = if self.b.is_some() { vocab } else { 0 };
        let loss = DevBuf::from(&vec![f32::NAN; per]);
        let lse = DevBuf::from(&vec![f32::NAN; rows]);
        let z_loss = DevBuf::from(&[f32::NAN]);
        let argmax = DevBuf::from(&vec![-7i64; rows]);
        let accuracy = DevBuf::from(&vec![f32::NAN; per]);
        let flags = DevBuf::from(&[0u32]);
        let gh = DevBuf::from(&nan::<T>(rows * hidden));
        let init = |n: usize, a: Option<&Vec<f32>>| -> DevBuf {
            let v: Vec<f32> = a.cloned().unwrap_or_else(|| vec![f32::NAN; n]);
            if self.fp32_grads {
                DevBuf::from(&v)
            } else {
                DevBuf::from(&v.iter().map(|&x| T::from_f32(x)).collect::<Vec<T>>())
            }
        };
        let gw = init(vocab * hidden, acc.map(|a| &a.gw));
        let gb = init(nb, acc.map(|a| &a.gb));
        let d_g = g.map(DevBuf::from);
        let opts = self
            .cuda
            .grad_weight_fp32(self.fp32_grads && !is_f32::<T>());
        let sizes = fusedce::linear_ce_workspace_size(&opts, rows, hidden, vocab, grads).unwrap();
        assert!(sizes.min <= sizes.optimal, "{sizes:?}");
        let ws = DevBuf::new(if min_ws { sizes.min } else { sizes.optimal });
        let null = ptr::null_mut();
        // SAFETY: device buffers of the sizes fce_linear_ce uses, synchronised below.
        unsafe {
            raw::linear_ce(
                &opts,
                rows as i64,
                hidden as i64,
                vocab as i64,
                &raw::LinearCeArgs {
                    hidden_states: self.d_h.ptr,
                    weight: self.d_w.ptr,
                    bias: self.d_b.ptr,
                    targets: self.d_y.ptr,
                    loss: loss.ptr(),
                    lse: lse.ptr(),
                    z_loss: z_loss.ptr(),
                    argmax: argmax.ptr(),
                    accuracy: accuracy.ptr(),
                    grad_hidden: if grads { gh.ptr } else { null },
                    grad_weight: if grads { gw.ptr } else { null },
                    grad_bias: if grads { gb.ptr } else { null },
                    grad_output: d_g.as_ref().map_or(ptr::null(), |b| b.ptr()),
                    error_flags: flags.ptr(),
                    workspace: ws.ptr,
                    workspace_bytes: ws.bytes,
                    stream: self.stream.0,
                },
            )
        }
        .unwrap_or_else(|e| panic!("raw::linear_ce on CUDA: {e}"));
        self.stream.sync();
        let grad = |b: &DevBuf, n: usize| -> Vec<f32> {
            if !grads {
                vec![]
            } else if self.fp32_grads {
                b.to_vec(n)
            } else {
                f32s(&b.to_vec::<T>(n))
            }
        };
        Lin {
            loss: loss.to_vec(per),
            lse: lse.to_vec(rows),
            z_loss: z_loss.to_vec::<f32>(1)[0],
            argmax: argmax.to_vec(rows),
            accuracy: accuracy.to_vec(per),
            gh: if grads {
                f32s(&gh.to_vec::<T>(rows * hidden))
            } else {
                vec![]
            },
            gw: grad(&gw, vocab * hidden),
            gb: grad(&gb, nb),
            flags: flags.to_vec::<u32>(1)[0],
        }
    }

    /// linear_ce.rs's tolerances: float32 1e-4 throughout; bf16 1e-3 for the loss and 2e-2 for
    /// the gradients, plus on CUDA the rounding of z to bf16: u·(4 + 2·max|z|), u = 2⁻⁸.
    fn tol(&self) -> Tol {
        if is_f32::<T>() {
            return Tol {
                loss: 1e-4,
                grad: 1e-4,
            };
        }
        let zmax = self.z.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let lin = 2f64.powi(-8) * (4.0 + 2.0 * zmax);
        Tol {
            loss: 1e-3 + lin,
            grad: 2e-2 + lin,
        }
    }

    /// What CUDA computes in f16/bf16 (lib/cuda/linear_ce.cu): z rounded once to the dtype
    /// (here from float64), the cross-entropy of those logits and ∂z rounded to the dtype (here
    /// the CPU backend's forward on them), then ∂h = ∂z·W, ∂W = ∂zᵀ·h, ∂b = Σ_r ∂z (float64).
    fn emulate(&self, grads: bool, g: Option<&[f32]>, acc: Option<&Acc>) -> Lin {
        let (rows, hidden, vocab, per) = (self.rows, self.hidden, self.vocab, self.per());
        let zt: Vec<T> = self.z.iter().map(|&x| T::from_f32(x as f32)).collect();
        let mut o = Lin {
            loss: vec![f32::NAN; per],
            lse: vec![f32::NAN; rows],
            z_loss: f32::NAN,
            argmax: vec![-7; rows],
            accuracy: vec![f32::NAN; per],
            gh: vec![],
            gw: vec![],
            gb: vec![],
            flags: 0,
        };
        let mut dz: Vec<T> = nan(rows * vocab);
        let mut b = ForwardBuffers::new(&mut o.loss)
            .lse(&mut o.lse)
            .z_loss(&mut o.z_loss)
            .argmax(&mut o.argmax)
            .accuracy(&mut o.accuracy)
            .error_flags(&mut o.flags)
            .grad_logits(&mut dz);
        if let Some(g) = g {
            b = b.grad_output(g);
        }
        let opts = self.cpu.accumulate(false);
        forward(&opts, rows, vocab, &zt, &self.y, b).expect("CPU forward on the rounded logits");
        if !grads {
            return o;
        }
        let dz: Vec<f64> = dz.iter().map(|&x| x.to_f32() as f64).collect();
        let f = |x: &T| x.to_f32() as f64;
        let mut gh = vec![0.0f64; rows * hidden];
        let mut gw = vec![0.0f64; vocab * hidden];
        let mut gb = vec![0.0f64; vocab];
        for r in 0..rows {
            for v in 0..vocab {
                let d = dz[r * vocab + v];
                if d == 0.0 {
                    continue;
                }
                gb[v] += d;
                for k in 0..hidden {
                    gh[r * hidden + k] += d * f(&self.w[v * hidden + k]);
                    gw[v * hidden + k] += d * f(&self.h[r * hidden + k]);
                }
            }
        }
        if let Some(a) = acc {
            gw.iter_mut().zip(&a.gw).for_each(|(x, &y)| *x += y as f64);
            gb.iter_mut().zip(&a.gb).for_each(|(x, &y)| *x += y as f64);
        }
        let nb = if self.b.is_some() { vocab } else { 0 };
        o.gh = gh.into_iter().map(|x| x as f32).collect();
        o.gw = gw.into_iter().map(|x| x as f32).collect();
        o.gb = gb[..nb].iter().map(|&x| x as f32).collect();
        o
    }

    /// The argmax slack: z differs by the float32 GEMM order (f32), or by CUDA's rounding of z
    /// to bf16 (two values within one rounding each of the other: 2·2⁻⁸ relative, doubled).
    fn slack(&self) -> f64 {
        if is_f32::<T>() {
            1e-4
        } else {
            2f64.powi(-6)
        }
    }

    /// For bf16, CUDA against the emulation of its documented precision: the CE tolerances of
    /// linear_ce.rs (2e-3 for the loss, for a logit rounded differently by the GEMM's float32
    /// order; 2e-2 for the gradients). Under FUSEDCE_CUDA_TESTS_ON_CPU (the CPU keeps z in
    /// float32) the bound of [`LinProblem::tol`] instead.
    fn tol_emulated(&self) -> Tol {
        if on_cpu() {
            self.tol()
        } else {
            Tol {
                loss: 2e-3,
                grad: 2e-2,
            }
        }
    }

    /// CUDA's outputs against the CPU's linear_ce and, for bf16, against [`LinProblem::emulate`].
    #[track_caller]
    fn check_all(&self, what: &str, got: &Lin, grads: bool, g: Option<&[f32]>, acc: Option<&Acc>) {
        let want = self.cpu_run(grads, g, acc);
        self.check(what, got, &want, self.tol());
        if !is_f32::<T>() {
            let em = self.emulate(grads, g, acc);
            self.check(
                &format!("{what}, vs the CPU on z rounded to bf16"),
                got,
                &em,
                self.tol_emulated(),
            );
        }
    }

    #[track_caller]
    fn check(&self, what: &str, got: &Lin, want: &Lin, tol: Tol) {
        assert_close(
            &format!("{what}: loss"),
            &got.loss,
            &to_f64(&want.loss),
            tol.loss,
        );
        assert_close(
            &format!("{what}: lse"),
            &got.lse,
            &to_f64(&want.lse),
            tol.loss,
        );
        assert_close(
            &format!("{what}: z_loss"),
            &[got.z_loss],
            &[want.z_loss as f64],
            tol.loss,
        );
        assert_close(
            &format!("{what}: grad_hidden"),
            &got.gh,
            &to_f64(&want.gh),
            tol.grad,
        );
        assert_close(
            &format!("{what}: grad_weight"),
            &got.gw,
            &to_f64(&want.gw),
            tol.grad,
        );
        assert_close(
            &format!("{what}: grad_bias"),
            &got.gb,
            &to_f64(&want.gb),
            tol.grad,
        );
        assert_eq!(got.flags, want.flags, "{what}: error flags");
        let z = |r: usize, j: i64| {
            let a = self.cpu.get_logit_scale() as f64 * self.z[r * self.vocab + j as usize];
            let c = self.cpu.get_softcap() as f64;
            if c > 0.0 {
                c * (a / c).tanh()
            } else {
                a
            }
        };
        check_argmax(what, &got.argmax, &want.argmax, z, self.slack());
        check_accuracy(
            what,
            &got.accuracy,
            &want.accuracy,
            got.argmax == want.argmax,
        );
    }
}

struct LinCase {
    opts: Options<'static>,
    rows: usize,
    hidden: usize,
    vocab: usize,
    seed: u64,
    bias: bool,
    ignore: &'static [usize],
    /// bf16 only: grad_weight / grad_bias in float32 (grad_weight_fp32).
    fp32_grads: bool,
    /// Also an accumulating call (grad_weight / grad_bias added to).
    accumulate: bool,
}

/// linear_ce on CUDA against the CPU: with every gradient, with the minimum and the optimal
/// workspace (different plans on CUDA), loss only, and accumulating into grad_weight/grad_bias.
fn run_linear<T: El>(name: &str, case: &LinCase) {
    if !gpu() {
        return;
    }
    let what = format!(
        "{name} ({:?}{})",
        T::DTYPE,
        if case.fp32_grads {
            ", f32 weight gradients"
        } else {
            ""
        }
    );
    let (rows, hidden, vocab) = (case.rows, case.hidden, case.vocab);
    let mut rng = Rng::new(case.seed);
    let h: Vec<T> = rng
        .normals_f32(rows * hidden, 1.0)
        .into_iter()
        .map(T::from_f32)
        .collect();
    let w: Vec<T> = rng
        .normals_f32(vocab * hidden, 1.5 / (hidden as f64).sqrt())
        .into_iter()
        .map(T::from_f32)
        .collect();
    let b: Option<Vec<T>> = case.bias.then(|| {
        rng.normals_f32(vocab, 0.5)
            .into_iter()
            .map(T::from_f32)
            .collect()
    });
    let mut y = rng.targets(rows, vocab);
    for &i in case.ignore {
        y[i] = case.opts.get_ignore_index();
    }
    let mut z = vec![0.0f64; rows * vocab];
    for r in 0..rows {
        for v in 0..vocab {
            let dot: f64 = (0..hidden)
                .map(|k| h[r * hidden + k].to_f32() as f64 * w[v * hidden + k].to_f32() as f64)
                .sum();
            z[r * vocab + v] = dot + b.as_ref().map_or(0.0, |b| b[v].to_f32() as f64);
        }
    }
    let opts = case.opts.dtype(T::DTYPE);
    let p = LinProblem {
        rows,
        hidden,
        vocab,
        d_h: DevBuf::from(&h),
        d_w: DevBuf::from(&w),
        d_b: b.as_ref().map_or_else(DevBuf::null, |b| DevBuf::from(b)),
        d_y: DevBuf::from(&y),
        h,
        w,
        b,
        y,
        z,
        cpu: opts,
        cuda: opts.backend(dev()).target_dtype(TargetDtype::Int64),
        fp32_grads: case.fp32_grads && !is_f32::<T>(),
        stream: Stream::new(),
    };
    let g: Vec<f32> = if p.per() == 1 {
        vec![0.7]
    } else {
        (0..rows).map(|_| rng.normal(1.0) as f32).collect()
    };

    for min_ws in [false, true] {
        let ws = if min_ws { "minimum" } else { "optimal" };
        let got = p.cuda_run(true, Some(&g), None, min_ws);
        p.check_all(
            &format!("{what}: linear_ce, {ws} workspace"),
            &got,
            true,
            Some(&g),
            None,
        );
        let again = p.cuda_run(true, Some(&g), None, min_ws);
        assert_bits_eq(
            &format!("{what}: {ws} workspace, run to run, loss"),
            &again.loss,
            &got.loss,
        );
        assert_bits_eq(
            &format!("{what}: {ws} workspace, run to run, grad_weight"),
            &again.gw,
            &got.gw,
        );
    }
    let eval = p.cuda_run(false, None, None, false);
    p.check_all(
        &format!("{what}: linear_ce loss only"),
        &eval,
        false,
        None,
        None,
    );
    if case.accumulate {
        let nb = if p.b.is_some() { vocab } else { 0 };
        let fp32 = p.fp32_grads;
        let round = |v: Vec<f32>| -> Vec<f32> {
            if fp32 {
                v
            } else {
                v.into_iter().map(|x| T::from_f32(x).to_f32()).collect()
            }
        };
        let acc = Acc {
            gw: round(rng.normals_f32(vocab * hidden, 0.01)),
            gb: round(rng.normals_f32(nb, 0.01)),
        };
        let mut pa = p;
        pa.cpu = pa.cpu.accumulate(true);
        pa.cuda = pa.cuda.accumulate(true);
        let got = pa.cuda_run(true, Some(&g), Some(&acc), false);
        pa.check_all(
            &format!("{what}: linear_ce accumulate"),
            &got,
            true,
            Some(&g),
            Some(&acc),
        );
    }
}

/// Mean, a bias, smoothing, z-loss, ignored rows, accumulation.
fn lin_mean() -> LinCase {
    LinCase {
        opts: Options::new().label_smoothing(0.1).z_loss_scale(1e-4),
        rows: 40,
        hidden: 64,
        vocab: 1000,
        seed: 21,
        bias: true,
        ignore: &[3, 17, 30],
        fp32_grads: false,
        accumulate: true,
    }
}

/// Sum, a bias, the shift by 2, token scaling, z-loss, accumulation.
fn lin_sum_shift_token_scaling() -> LinCase {
    LinCase {
        opts: Options::new()
            .reduction(Reduction::Sum)
            .shift_seq_len(10)
            .shift(2)
            .token_scaling(true)
            .z_loss_scale(1e-4),
        rows: 50,
        hidden: 96,
        vocab: 1537,
        seed: 22,
        bias: true,
        ignore: &[8, 33],
        fp32_grads: false,
        accumulate: true,
    }
}

/// None with per-row grad_output, no bias, smoothing; bf16 with float32 weight gradients.
fn lin_none_fp32_grads() -> LinCase {
    LinCase {
        opts: Options::new()
            .reduction(Reduction::None)
            .label_smoothing(0.05),
        rows: 24,
        hidden: 128,
        vocab: 700,
        seed: 23,
        bias: false,
        ignore: &[5],
        fp32_grads: true,
        accumulate: true,
    }
}

#[test]
fn linear_ce_mean_f32() {
    run_linear::<f32>("mean, bias", &lin_mean());
}
#[test]
fn linear_ce_mean_bf16() {
    run_linear::<u16>("mean, bias", &lin_mean());
}
#[test]
fn linear_ce_sum_shift_token_scaling_f32() {
    run_linear::<f32>(
        "sum, shift 2, token scaling",
        &lin_sum_shift_token_scaling(),
    );
}
#[test]
fn linear_ce_sum_shift_token_scaling_bf16() {
    run_linear::<u16>(
        "sum, shift 2, token scaling",
        &lin_sum_shift_token_scaling(),
    );
}
#[test]
fn linear_ce_none_f32() {
    run_linear::<f32>("none, no bias", &lin_none_fp32_grads());
}
#[test]
fn linear_ce_none_bf16_fp32_grads() {
    run_linear::<u16>("none, no bias", &lin_none_fp32_grads());
}

// ======================================================================= scale_gradient ==

fn run_scale<T: El>() {
    if !gpu() {
        return;
    }
    let n = 10_007;
    let mut rng = Rng::new(31);
    let data: Vec<T> = rng
        .normals_f32(n, 3.0)
        .into_iter()
        .map(T::from_f32)
        .collect();
    let stream = Stream::new();
    for s in [0.3f32, 1.0, 0.0, -4.0, 1e-3, 7.5] {
        let mut host = data.clone();
        fusedce::scale_gradient(T::DTYPE, &mut host, s).unwrap();
        let d = DevBuf::from(&data);
        let d_s = DevBuf::from(&[s]);
        // SAFETY: n elements of the dtype and one float, device memory, synchronised below.
        unsafe { raw::scale_gradient(dev(), T::DTYPE, n as i64, d.ptr, d_s.ptr(), stream.0) }
            .unwrap_or_else(|e| panic!("raw::scale_gradient on CUDA: {e}"));
        stream.sync();
        assert_bits_eq(
            &format!("scale_gradient {:?} by {s}", T::DTYPE),
            &d.to_vec::<T>(n),
            &host,
        );
    }
    // count 0: nothing to do, null grad allowed
    let d_s = DevBuf::from(&[2.0f32]);
    unsafe { raw::scale_gradient(dev(), T::DTYPE, 0, ptr::null_mut(), d_s.ptr(), stream.0) }
        .expect("scale_gradient of 0 elements");
    stream.sync();
}

#[test]
fn scale_gradient_f32() {
    run_scale::<f32>();
}
#[test]
fn scale_gradient_bf16() {
    run_scale::<u16>();
}

// ===================================================================== the backend itself ==

#[test]
fn cuda_backend_is_available() {
    if on_cpu() || !gpu() {
        return;
    }
    let api = api();
    println!(
        "CUDA runtime {} sees {} device(s); libfusedce: {}",
        api.path,
        api.device_count().unwrap(),
        fusedce::build_info()
    );
    fusedce::check_version().unwrap();
    assert!(fusedce::cuda_available());
    let opts = Options::new().backend(Backend::Cuda);
    assert!(fusedce::forward_workspace_size(&opts, 64, 1000).is_ok());
}

/// The CUDA backend checks where the pointers live: host memory is refused with an error
/// naming the argument, unless the device reads pageable memory (HMM / ATS), where the call
/// must then give the CPU's answer.
#[test]
fn cuda_backend_with_host_pointers() {
    if on_cpu() || !gpu() {
        return;
    }
    let (rows, vocab) = (4, 100);
    let mut rng = Rng::new(41);
    let logits = rng.normals_f32(rows * vocab, 2.0);
    let targets = rng.targets(rows, vocab);
    let opts = Options::new().backend(Backend::Cuda);
    let ws = DevBuf::new(fusedce::forward_workspace_size(&opts, rows, vocab).unwrap());
    let mut loss = [f32::NAN];
    // SAFETY: live host buffers of the right sizes (read by the device only where it can).
    let r = unsafe {
        raw::forward(
            &opts,
            rows as i64,
            vocab as i64,
            &raw::ForwardArgs {
                logits: logits.as_ptr().cast(),
                targets: targets.as_ptr().cast(),
                loss: loss.as_mut_ptr(),
                workspace: ws.ptr,
                workspace_bytes: ws.bytes,
                ..Default::default()
            },
        )
    };
    Stream::legacy().sync();
    if api().attribute(cudart::ATTR_PAGEABLE_MEMORY_ACCESS) != 0 {
        r.unwrap_or_else(|e| panic!("pageable memory access, yet: {e}"));
        let mut want = [f32::NAN];
        forward(
            &opts,
            rows,
            vocab,
            &logits,
            &targets,
            ForwardBuffers::new(&mut want),
        )
        .unwrap();
        assert_close("loss from host memory", &loss, &to_f64(&want), 2e-5);
    } else {
        let e = r.expect_err("host pointers on the CUDA backend");
        assert_eq!(e.status(), Status::InvalidArgument, "{e}");
        assert!(e.message().contains("host memory"), "{e}");
    }
}

#[test]
fn cuda_workspace_too_small() {
    if on_cpu() || !gpu() {
        return;
    }
    let (rows, vocab) = (64, 1000);
    let opts = Options::new().backend(Backend::Cuda);
    let need = fusedce::forward_workspace_size(&opts, rows, vocab).unwrap();
    assert!(
        need >= 32,
        "the CUDA forward needs a workspace ({need} bytes)"
    );
    let logits = DevBuf::new(rows * vocab * 4);
    let targets = DevBuf::new(rows * 8);
    logits.zero();
    targets.zero();
    let loss = DevBuf::new(4);
    let ws = DevBuf::new(need);
    // SAFETY: device buffers; the call must refuse before enqueuing anything.
    let e = unsafe {
        raw::forward(
            &opts,
            rows as i64,
            vocab as i64,
            &raw::ForwardArgs {
                logits: logits.ptr,
                targets: targets.ptr,
                loss: loss.ptr(),
                workspace: ws.ptr,
                workspace_bytes: need - 16,
                ..Default::default()
            },
        )
    }
    .expect_err("a workspace 16 bytes short");
    assert_eq!(e.status(), Status::WorkspaceTooSmall, "{e}");
    // and the full size works (all-zero logits: the loss is log V)
    unsafe {
        raw::forward(
            &opts,
            rows as i64,
            vocab as i64,
            &raw::ForwardArgs {
                logits: logits.ptr,
                targets: targets.ptr,
                loss: loss.ptr(),
                workspace: ws.ptr,
                workspace_bytes: need,
                ..Default::default()
            },
        )
    }
    .unwrap();
    Stream::legacy().sync();
    let got = loss.to_vec::<f32>(1)[0];
    assert!(
        (got as f64 - (vocab as f64).ln()).abs() < 1e-5,
        "loss {got}"
    );
}
