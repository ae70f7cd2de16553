//! The CUDA entry points of the crate, executed (forward, backward, backward_rescale and the
//! backend itself here; linear_ce and scale_gradient in cuda_linear.rs, the harness in
//! cuda_support/harness.rs): every `raw::*` call on device memory and a stream (Backend::Cuda), against the same call on the CPU backend with the same inputs, in
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
#![allow(dead_code, unused_imports)]
mod common;

// the harness, with the imports both crates use
include!("cuda_support/harness.rs");

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
        check_loss_lse(
            what,
            (&got.loss, &got.lse, got.z_loss),
            (&want.loss, &want.lse, want.z_loss),
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
