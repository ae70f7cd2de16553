// The harness of the CUDA test crates (cuda.rs, cuda_linear.rs), included by both with
// include!: the CUDA runtime opened with dlopen, device buffers and streams, the dtypes and
// the comparisons. Each crate uses part of it.

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

/// The per-call values both calls return, CUDA's against the CPU's: the loss, the lse and the
/// z-loss total, within `tol` (relative).
#[track_caller]
fn check_loss_lse(
    what: &str,
    (loss, lse, z_loss): (&[f32], &[f32], f32),
    (want_loss, want_lse, want_z_loss): (&[f32], &[f32], f32),
    tol: f64,
) {
    assert_close(&format!("{what}: loss"), loss, &to_f64(want_loss), tol);
    assert_close(&format!("{what}: lse"), lse, &to_f64(want_lse), tol);
    assert_close(
        &format!("{what}: z_loss"),
        &[z_loss],
        &[want_z_loss as f64],
        tol,
    );
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
