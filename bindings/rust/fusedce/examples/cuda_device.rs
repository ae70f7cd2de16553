// Cross-entropy on the CUDA backend from Rust: device pointers and a stream (fusedce::raw).
//
// Run (from the repository root, after `make` with CUDA, on a machine with a GPU):
//   FUSEDCE_LIB_DIR=$PWD/build cargo run --offline --manifest-path bindings/rust/Cargo.toml -p fusedce --example cuda_device
//
// It uploads bf16 logits and int64 targets, runs one fused forward (loss, lse, argmax, accuracy
// and the gradient for an upstream 1) on a stream, makes that gradient the one for an upstream
// 0.5 with backward_rescale (the scalar read on the device), and checks the loss against the
// CPU backend. Without a GPU it says so and exits 0.
//
// The device memory and the stream come from the CUDA runtime, opened here with dlopen so that
// the example builds where no CUDA toolkit is installed (`cargo test` builds the examples). In
// your own code use whatever owns the memory (cudarc, tch's `data_ptr()`, a
// `#[link(name = "cudart")]` block): fusedce only needs the pointers and the stream.
use std::ffi::{c_char, c_int, c_void, CString};

use fusedce::bits::{bf16_to_f32, f32_to_bf16};
use fusedce::{raw, Backend, Dtype, Options, Reduction};

/// The core, as in the README: one step on device memory (every pointer on the current
/// device), enqueued on `stream`; nothing here waits for the GPU.
///
/// # Safety
/// The pointers are device memory of the sizes given in include/fusedce.h for these rows and
/// vocab (bf16 logits/grad [rows, vocab], int64 targets [rows], f32 loss [1], lse [rows], one
/// f32 upstream gradient, int64 argmax [rows], f32 accuracy [1]) and stay alive until the
/// stream has run the work; the workspace holds `workspace_bytes`.
#[allow(clippy::too_many_arguments)]
unsafe fn step(
    rows: usize,
    vocab: usize,
    logits: *const c_void,
    targets: *const c_void,
    loss: *mut f32,
    lse: *mut f32,
    argmax: *mut i64,
    accuracy: *mut f32,
    grad: *mut c_void,
    upstream: *const f32,
    workspace: *mut c_void,
    workspace_bytes: usize,
    stream: raw::Stream,
) -> fusedce::Result<()> {
    let opts = Options::new()
        .backend(Backend::Cuda)
        .dtype(Dtype::BFloat16)
        .reduction(Reduction::Mean)
        .label_smoothing(0.1);
    // The loss, and the gradient for an upstream gradient of 1 (grad_output null) ...
    raw::forward(
        &opts,
        rows as i64,
        vocab as i64,
        &raw::ForwardArgs {
            logits,
            targets,
            loss,
            lse,
            argmax,
            accuracy,
            grad_logits: grad,
            workspace,
            workspace_bytes,
            stream,
            ..Default::default()
        },
    )?;
    // ... made the gradient for the upstream scalar once it is known (read on the device).
    raw::backward_rescale(
        &opts,
        rows as i64,
        vocab as i64,
        &raw::BackwardArgs {
            logits,
            targets,
            lse,
            grad_output: upstream,
            grad_logits: grad,
            workspace,
            workspace_bytes,
            stream,
            ..Default::default()
        },
    )
}

/// The few functions of libcudart the example needs, opened at run time.
struct Cudart {
    device_count: unsafe extern "C" fn(*mut c_int) -> c_int,
    malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int,
    free: unsafe extern "C" fn(*mut c_void) -> c_int,
    memcpy: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> c_int,
    stream_create: unsafe extern "C" fn(*mut *mut c_void) -> c_int,
    stream_synchronize: unsafe extern "C" fn(*mut c_void) -> c_int,
    stream_destroy: unsafe extern "C" fn(*mut c_void) -> c_int,
}

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

impl Cudart {
    fn open() -> Option<Cudart> {
        let dir =
            std::env::var("FUSEDCE_CUDART_DIR").unwrap_or_else(|_| "/usr/local/cuda/lib64".into());
        let names = [
            "libcudart.so.13".to_string(),
            "libcudart.so.12".into(),
            format!("{dir}/libcudart.so.13"),
            format!("{dir}/libcudart.so"),
        ];
        let h = names.iter().find_map(|n| {
            let c = CString::new(n.as_str()).ok()?;
            // SAFETY: a NUL-terminated name; RTLD_NOW.
            let h = unsafe { dlopen(c.as_ptr(), 2) };
            (!h.is_null()).then_some(h)
        })?;
        unsafe fn sym<F: Copy>(h: *mut c_void, name: &str) -> Option<F> {
            let c = CString::new(name).ok()?;
            let p = dlsym(h, c.as_ptr());
            (!p.is_null()).then(|| std::mem::transmute_copy::<*mut c_void, F>(&p))
        }
        // SAFETY: each symbol cast to its C prototype.
        unsafe {
            Some(Cudart {
                device_count: sym(h, "cudaGetDeviceCount")?,
                malloc: sym(h, "cudaMalloc")?,
                free: sym(h, "cudaFree")?,
                memcpy: sym(h, "cudaMemcpy")?,
                stream_create: sym(h, "cudaStreamCreate")?,
                stream_synchronize: sym(h, "cudaStreamSynchronize")?,
                stream_destroy: sym(h, "cudaStreamDestroy")?,
            })
        }
    }
    fn ok(e: c_int, what: &str) {
        assert!(e == 0, "{what} failed: cudaError {e}");
    }
    fn upload<T: Copy>(&self, data: &[T]) -> *mut c_void {
        let bytes = std::mem::size_of_val(data).max(1);
        let mut p = std::ptr::null_mut();
        // SAFETY: allocation, then a copy of `data`'s bytes into it (1: host to device).
        unsafe {
            Cudart::ok((self.malloc)(&mut p, bytes), "cudaMalloc");
            Cudart::ok(
                (self.memcpy)(p, data.as_ptr().cast(), std::mem::size_of_val(data), 1),
                "cudaMemcpy",
            );
        }
        p
    }
    fn download<T: Copy + Default>(&self, p: *const c_void, n: usize) -> Vec<T> {
        let mut v = vec![T::default(); n];
        // SAFETY: p holds at least n elements (2: device to host).
        unsafe {
            Cudart::ok(
                (self.memcpy)(v.as_mut_ptr().cast(), p, std::mem::size_of_val(&v[..]), 2),
                "cudaMemcpy",
            )
        };
        v
    }
}

fn main() -> fusedce::Result<()> {
    fusedce::check_version()?;
    let cuda = Cudart::open();
    let mut n = 0;
    let devices = cuda.as_ref().map_or(0, |c| {
        // SAFETY: a valid out pointer.
        let e = unsafe { (c.device_count)(&mut n) };
        if e == 0 {
            n
        } else {
            0
        }
    });
    if devices == 0 || !fusedce::cuda_available() {
        println!(
            "no CUDA device (or libfusedce without CUDA): nothing to run ({})",
            fusedce::build_info()
        );
        return Ok(());
    }
    let cuda = cuda.unwrap();

    let (rows, vocab) = (256, 32_000);
    let logits: Vec<u16> = (0..rows * vocab)
        .map(|i| f32_to_bf16(((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 8.0))
        .collect();
    let mut targets: Vec<i64> = (0..rows).map(|r| (r * 131 % vocab) as i64).collect();
    targets[3] = -100; // ignored

    let opts = Options::new()
        .backend(Backend::Cuda)
        .dtype(Dtype::BFloat16)
        .label_smoothing(0.1);
    let ws_bytes = fusedce::forward_workspace_size(&opts, rows, vocab)?
        .max(fusedce::backward_workspace_size(&opts, rows, vocab)?);
    let d_logits = cuda.upload(&logits);
    let d_targets = cuda.upload(&targets);
    let d_loss = cuda.upload(&[0.0f32]);
    let d_lse = cuda.upload(&vec![0.0f32; rows]);
    let d_argmax = cuda.upload(&vec![0i64; rows]);
    let d_accuracy = cuda.upload(&[0.0f32]);
    let d_grad = cuda.upload(&vec![0u16; rows * vocab]);
    let d_upstream = cuda.upload(&[0.5f32]);
    let d_ws = cuda.upload(&vec![0u8; ws_bytes]);
    let mut stream = std::ptr::null_mut();
    // SAFETY: a valid out pointer.
    Cudart::ok(
        unsafe { (cuda.stream_create)(&mut stream) },
        "cudaStreamCreate",
    );

    // SAFETY: every pointer was allocated above with the sizes `step` documents.
    unsafe {
        step(
            rows,
            vocab,
            d_logits,
            d_targets,
            d_loss.cast(),
            d_lse.cast(),
            d_argmax.cast(),
            d_accuracy.cast(),
            d_grad,
            d_upstream.cast(),
            d_ws,
            ws_bytes,
            stream,
        )?;
        Cudart::ok((cuda.stream_synchronize)(stream), "cudaStreamSynchronize");
    }
    let loss = cuda.download::<f32>(d_loss, 1)[0];
    let accuracy = cuda.download::<f32>(d_accuracy, 1)[0];
    let argmax = cuda.download::<i64>(d_argmax, rows);
    let grad: Vec<f32> = cuda
        .download::<u16>(d_grad, rows * vocab)
        .into_iter()
        .map(bf16_to_f32)
        .collect();

    // The same loss on the CPU backend (host slices).
    let mut cpu_loss = [0.0f32];
    let mut cpu_grad = vec![0u16; rows * vocab];
    fusedce::forward(
        &opts,
        rows,
        vocab,
        &logits,
        &targets,
        fusedce::ForwardBuffers::new(&mut cpu_loss)
            .grad_logits(&mut cpu_grad)
            .grad_output(&[0.5]),
    )?;
    let max_diff = grad
        .iter()
        .zip(&cpu_grad)
        .map(|(&a, &b)| (a - bf16_to_f32(b)).abs())
        .fold(0.0f32, f32::max);
    println!(
        "CUDA: loss {loss:.6}, accuracy {accuracy:.4}, argmax[0..4] {:?}",
        &argmax[..4]
    );
    println!(
        "CPU:  loss {:.6}; gradient (upstream 0.5) max |CUDA − CPU| {max_diff:.3e}",
        cpu_loss[0]
    );

    // SAFETY: the stream is idle; each pointer came from cudaMalloc.
    unsafe {
        Cudart::ok((cuda.stream_destroy)(stream), "cudaStreamDestroy");
        for p in [
            d_logits, d_targets, d_loss, d_lse, d_argmax, d_accuracy, d_grad, d_upstream, d_ws,
        ] {
            Cudart::ok((cuda.free)(p), "cudaFree");
        }
    }
    assert!(
        (loss - cpu_loss[0]).abs() <= 1e-4 * cpu_loss[0].abs().max(1.0),
        "CUDA and CPU losses differ"
    );
    Ok(())
}
