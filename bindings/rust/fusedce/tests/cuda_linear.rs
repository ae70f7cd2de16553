//! The linear CE and scale_gradient entry points of the crate on CUDA, against the same calls
//! on the CPU backend with the same inputs, in float32 and bfloat16; the harness, its skips
//! and FUSEDCE_CUDA_TESTS_ON_CPU are those of cuda.rs (cuda_support/harness.rs).
#![allow(dead_code, unused_imports)]
mod common;

// the harness, with the imports both crates use
include!("cuda_support/harness.rs");

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
        check_loss_lse(
            what,
            (&got.loss, &got.lse, got.z_loss),
            (&want.loss, &want.lse, want.z_loss),
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
