//! fusedce::forward / backward on the CPU backend against the float64 reference of
//! tests/common (docs/semantics.md's formulas). Outputs are poisoned with NaN before every call.
mod common;

use common::*;
use fusedce::bits::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use fusedce::{
    backward, backward_in_place, forward, forward_in_place, BackwardBuffers, Dtype, ForwardBuffers,
    HostWorkspace, Options, Reduction,
};

const F32_RTOL: f64 = 2e-5;

struct Case {
    rows: usize,
    vocab: usize,
    std: f64,
    seed: u64,
    opts: Options<'static>,
    reference: Ref,
    grad_output: Vec<f32>,
    ignored: Vec<usize>,
}

fn run_case(c: &Case) {
    let mut rng = Rng::new(c.seed);
    let (rows, vocab) = (c.rows, c.vocab);
    let logits = rng.normals_f32(rows * vocab, c.std);
    let mut targets = rng.targets(rows, vocab);
    for &r in &c.ignored {
        targets[r] = c.reference.ignore_index;
    }
    let per = if c.reference.reduction == Red::None {
        rows
    } else {
        1
    };
    let mut loss = nan_vec(per);
    let mut lse = nan_vec(rows);
    let mut z_loss = f32::NAN;
    let mut grad = nan_vec(rows * vocab);
    let mut flags = 0u32;
    let mut bufs = ForwardBuffers::new(&mut loss)
        .lse(&mut lse)
        .z_loss(&mut z_loss)
        .grad_logits(&mut grad)
        .error_flags(&mut flags);
    if !c.grad_output.is_empty() {
        bufs = bufs.grad_output(&c.grad_output);
    }
    forward(&c.opts, rows, vocab, &logits, &targets, bufs).expect("forward");

    let g: Vec<f64> = if c.grad_output.is_empty() {
        vec![1.0; per]
    } else {
        to_f64(&c.grad_output)
    };
    let want = reference(&c.reference, rows, vocab, &to_f64(&logits), &targets, &g);
    assert_close("loss", &loss, &want.loss, F32_RTOL);
    assert_close("lse", &lse, &want.lse, F32_RTOL);
    assert_close("z_loss", &[z_loss], &[want.z_loss], F32_RTOL);
    assert_close("grad_logits", &grad, &want.grad, F32_RTOL);
    assert_eq!(flags, 0);
    for &r in &c.ignored {
        assert!(
            grad[r * vocab..(r + 1) * vocab].iter().all(|&x| x == 0.0),
            "ignored row {r}"
        );
        if c.reference.reduction == Red::None {
            assert_eq!(loss[r], 0.0);
        }
    }

    // backward from the saved lse gives the forward's gradient to the rounding of lse
    // (docs/semantics.md rule 12: p_j = exp(a_j - lse) carries a relative |lse|·2^-24).
    let mut grad2 = nan_vec(rows * vocab);
    let mut bufs = BackwardBuffers::new().grad_logits(&mut grad2);
    if !c.grad_output.is_empty() {
        bufs = bufs.grad_output(&c.grad_output);
    }
    backward(&c.opts, rows, vocab, &logits, &targets, &lse, bufs).expect("backward");
    assert_close("backward grad_logits", &grad2, &want.grad, F32_RTOL);
    assert_close(
        "backward vs forward",
        &grad2,
        &to_f64(&grad),
        backward_rtol(&lse),
    );
}

#[test]
fn mean_with_ignored_rows() {
    run_case(&Case {
        rows: 13,
        vocab: 97,
        std: 5.0,
        seed: 1,
        opts: Options::new(),
        reference: Ref::default(),
        grad_output: vec![],
        ignored: vec![2, 7, 12],
    });
}

#[test]
fn sum_with_smoothing_z_loss_and_custom_ignore_index() {
    run_case(&Case {
        rows: 17,
        vocab: 61,
        std: 10.0,
        seed: 2,
        opts: Options::new()
            .reduction(Reduction::Sum)
            .label_smoothing(0.1)
            .z_loss_scale(1e-3)
            .ignore_index(-1),
        reference: Ref {
            reduction: Red::Sum,
            eps: 0.1,
            lambda: 1e-3,
            ignore_index: -1,
            ..Ref::default()
        },
        grad_output: vec![0.7],
        ignored: vec![0, 5],
    });
}

#[test]
fn none_with_softcap_logit_scale_and_per_row_grad_output() {
    let rows = 11;
    let mut rng = Rng::new(99);
    run_case(&Case {
        rows,
        vocab: 50,
        std: 30.0,
        seed: 3,
        opts: Options::new()
            .reduction(Reduction::None)
            .softcap(30.0)
            .logit_scale(0.8),
        reference: Ref {
            reduction: Red::None,
            softcap: 30.0,
            scale: 0.8,
            ..Ref::default()
        },
        grad_output: (0..rows).map(|_| rng.normal(1.0) as f32).collect(),
        ignored: vec![4],
    });
}

#[test]
fn mean_with_smoothing_and_z_loss() {
    run_case(&Case {
        rows: 8,
        vocab: 129,
        std: 3.0,
        seed: 4,
        opts: Options::new().label_smoothing(0.2).z_loss_scale(1e-2),
        reference: Ref {
            eps: 0.2,
            lambda: 1e-2,
            ..Ref::default()
        },
        grad_output: vec![1.5],
        ignored: vec![1],
    });
}

#[test]
fn class_weights_with_smoothing_and_i32_targets() {
    let (rows, vocab) = (10, 23);
    let mut rng = Rng::new(5);
    let logits = rng.normals_f32(rows * vocab, 4.0);
    let mut targets: Vec<i32> = (0..rows).map(|_| rng.below(vocab) as i32).collect();
    targets[3] = -100;
    let weights: Vec<f32> = (0..vocab)
        .map(|_| 0.5 + 1.5 * rng.uniform() as f32)
        .collect();
    let opts = Options::new().class_weights(&weights).label_smoothing(0.05);
    let (mut loss, mut grad) = (nan_vec(1), nan_vec(rows * vocab));
    forward(
        &opts,
        rows,
        vocab,
        &logits,
        &targets,
        ForwardBuffers::new(&mut loss).grad_logits(&mut grad),
    )
    .unwrap();
    let r = Ref {
        eps: 0.05,
        weights: Some(to_f64(&weights)),
        ..Ref::default()
    };
    let t64: Vec<i64> = targets.iter().map(|&t| t as i64).collect();
    let want = reference(&r, rows, vocab, &to_f64(&logits), &t64, &[1.0]);
    assert_close("loss", &loss, &want.loss, F32_RTOL);
    assert_close("grad", &grad, &want.grad, F32_RTOL);
}

#[test]
fn causal_shift() {
    let (t, batch, vocab) = (5, 3, 40);
    let rows = t * batch;
    let mut rng = Rng::new(6);
    let logits = rng.normals_f32(rows * vocab, 2.0);
    let targets = rng.targets(rows, vocab);
    let opts = Options::new().shift_seq_len(t as i64);
    let (mut loss, mut grad) = (nan_vec(1), nan_vec(rows * vocab));
    forward(
        &opts,
        rows,
        vocab,
        &logits,
        &targets,
        ForwardBuffers::new(&mut loss).grad_logits(&mut grad),
    )
    .unwrap();
    let want = reference(
        &Ref {
            shift_seq_len: t,
            ..Ref::default()
        },
        rows,
        vocab,
        &to_f64(&logits),
        &targets,
        &[1.0],
    );
    assert_close("loss", &loss, &want.loss, F32_RTOL);
    assert_close("grad", &grad, &want.grad, F32_RTOL);
    for b in 0..batch {
        let r = b * t + t - 1; // shifted out
        assert!(grad[r * vocab..(r + 1) * vocab].iter().all(|&x| x == 0.0));
    }
}

#[test]
fn strided_and_in_place() {
    let (rows, vocab) = (6, 33);
    let (stride, gstride) = (vocab + 3, vocab + 5);
    let mut rng = Rng::new(7);
    let mut logits = rng.normals_f32(rows * stride, 6.0);
    let targets = rng.targets(rows, vocab);
    let opts = Options::new()
        .reduction(Reduction::Sum)
        .label_smoothing(0.1)
        .row_stride(stride as i64)
        .grad_row_stride(gstride as i64);
    let (mut loss, mut grad) = (nan_vec(1), nan_vec(rows * gstride));
    forward(
        &opts,
        rows,
        vocab,
        &logits,
        &targets,
        ForwardBuffers::new(&mut loss).grad_logits(&mut grad),
    )
    .unwrap();
    let z = to_f64(&dense(&logits, rows, vocab, stride));
    let r = Ref {
        reduction: Red::Sum,
        eps: 0.1,
        ..Ref::default()
    };
    let want = reference(&r, rows, vocab, &z, &targets, &[1.0]);
    assert_close("loss", &loss, &want.loss, F32_RTOL);
    assert_close(
        "grad",
        &dense(&grad, rows, vocab, gstride),
        &want.grad,
        F32_RTOL,
    );

    // In place: the gradient overwrites the logits (grad_row_stride = row_stride).
    let opts = opts.grad_row_stride(stride as i64);
    let mut lse = nan_vec(rows);
    let mut loss2 = nan_vec(1);
    forward_in_place(
        &opts,
        rows,
        vocab,
        &mut logits,
        &targets,
        ForwardBuffers::new(&mut loss2).lse(&mut lse),
    )
    .unwrap();
    assert_close("in-place loss", &loss2, &want.loss, F32_RTOL);
    assert_close(
        "in-place grad",
        &dense(&logits, rows, vocab, stride),
        &want.grad,
        F32_RTOL,
    );

    // backward in place, from fresh logits and the saved lse.
    let mut logits = dense(
        &z.iter().map(|&x| x as f32).collect::<Vec<_>>(),
        rows,
        vocab,
        vocab,
    );
    let opts = Options::new()
        .reduction(Reduction::Sum)
        .label_smoothing(0.1);
    let mut ws = HostWorkspace::new();
    backward_in_place(
        &opts,
        rows,
        vocab,
        &mut logits,
        &targets,
        &lse,
        BackwardBuffers::new().workspace(&mut ws),
    )
    .unwrap();
    assert_close("backward in place", &logits, &want.grad, F32_RTOL);
}

#[test]
fn mean_over_only_ignored_rows_is_zero() {
    let (rows, vocab) = (4, 10);
    let logits = Rng::new(8).normals_f32(rows * vocab, 3.0);
    let targets = vec![-100i64; rows];
    let (mut loss, mut grad) = (nan_vec(1), nan_vec(rows * vocab));
    forward(
        &Options::new(),
        rows,
        vocab,
        &logits,
        &targets,
        ForwardBuffers::new(&mut loss).grad_logits(&mut grad),
    )
    .unwrap();
    assert_eq!(loss[0], 0.0);
    assert!(grad.iter().all(|&x| x == 0.0));
}

#[test]
fn target_out_of_range_gives_nan_and_a_flag() {
    let (rows, vocab) = (5, 12);
    let logits = Rng::new(9).normals_f32(rows * vocab, 2.0);
    let targets = vec![1i64, 12, 3, -100, 0]; // 12 is out of range
    let (mut loss, mut lse, mut flags) = (nan_vec(rows), nan_vec(rows), 0u32);
    let opts = Options::new().reduction(Reduction::None);
    forward(
        &opts,
        rows,
        vocab,
        &logits,
        &targets,
        ForwardBuffers::new(&mut loss)
            .lse(&mut lse)
            .error_flags(&mut flags),
    )
    .unwrap();
    assert!(loss[1].is_nan());
    assert!(loss[0].is_finite() && loss[2].is_finite() && loss[4].is_finite());
    assert_eq!(loss[3], 0.0);
    assert_eq!(
        flags & fusedce::FLAG_TARGET_OUT_OF_RANGE,
        fusedce::FLAG_TARGET_OUT_OF_RANGE
    );
}

/// Half precision: u16 bit slices; the reference runs on the same (rounded) inputs.
fn half_case(dtype: Dtype, to: fn(f32) -> u16, from: fn(u16) -> f32) {
    let (rows, vocab) = (9, 70);
    let mut rng = Rng::new(10);
    let logits: Vec<u16> = rng
        .normals_f32(rows * vocab, 8.0)
        .into_iter()
        .map(to)
        .collect();
    let mut targets = rng.targets(rows, vocab);
    targets[2] = -100;
    let opts = Options::new()
        .dtype(dtype)
        .label_smoothing(0.1)
        .z_loss_scale(1e-4);
    let (mut loss, mut lse) = (nan_vec(1), nan_vec(rows));
    let mut grad = vec![to(f32::NAN); rows * vocab];
    forward(
        &opts,
        rows,
        vocab,
        &logits,
        &targets,
        ForwardBuffers::new(&mut loss)
            .lse(&mut lse)
            .grad_logits(&mut grad),
    )
    .unwrap();
    let z: Vec<f64> = logits.iter().map(|&h| from(h) as f64).collect();
    let r = Ref {
        eps: 0.1,
        lambda: 1e-4,
        ..Ref::default()
    };
    let want = reference(&r, rows, vocab, &z, &targets, &[1.0]);
    assert_close("loss", &loss, &want.loss, 1e-4);
    assert_close("lse", &lse, &want.lse, 1e-4);
    let grad: Vec<f32> = grad.into_iter().map(from).collect();
    assert!(grad.iter().all(|x| x.is_finite()));
    assert_close("grad", &grad, &want.grad, 1e-2);

    let mut grad2 = vec![to(f32::NAN); rows * vocab];
    backward(
        &opts,
        rows,
        vocab,
        &logits,
        &targets,
        &lse,
        BackwardBuffers::new().grad_logits(&mut grad2),
    )
    .unwrap();
    let grad2: Vec<f32> = grad2.into_iter().map(from).collect();
    assert_close("backward grad", &grad2, &want.grad, 1e-2);
}

#[test]
fn bfloat16_logits() {
    half_case(Dtype::BFloat16, f32_to_bf16, bf16_to_f32);
}

#[test]
fn float16_logits() {
    half_case(Dtype::Float16, f32_to_f16, f16_to_f32);
}

#[test]
fn raw_pointer_calls_on_the_cpu_backend() {
    use fusedce::{raw, Backend};
    let (rows, vocab) = (7, 31);
    let mut rng = Rng::new(11);
    let logits = rng.normals_f32(rows * vocab, 4.0);
    let targets = rng.targets(rows, vocab);
    let opts = Options::new().backend(Backend::Cpu).label_smoothing(0.1);
    let bytes = fusedce::forward_workspace_size(&opts, rows, vocab).unwrap();
    let mut ws = HostWorkspace::with_bytes(bytes);
    let (workspace, workspace_bytes) = ws.as_raw();
    let (mut loss, mut lse, mut grad) = (nan_vec(1), nan_vec(rows), nan_vec(rows * vocab));
    unsafe {
        raw::forward(
            &opts,
            rows as i64,
            vocab as i64,
            &raw::ForwardArgs {
                logits: logits.as_ptr().cast(),
                targets: targets.as_ptr().cast(),
                loss: loss.as_mut_ptr(),
                lse: lse.as_mut_ptr(),
                grad_logits: grad.as_mut_ptr().cast(),
                workspace,
                workspace_bytes,
                ..Default::default()
            },
        )
        .unwrap();
    }
    let want = reference(
        &Ref {
            eps: 0.1,
            ..Ref::default()
        },
        rows,
        vocab,
        &to_f64(&logits),
        &targets,
        &[1.0],
    );
    assert_close("loss", &loss, &want.loss, F32_RTOL);
    assert_close("grad", &grad, &want.grad, F32_RTOL);

    let mut grad2 = nan_vec(rows * vocab);
    let g = [1.0f32];
    let bytes = fusedce::backward_workspace_size(&opts, rows, vocab).unwrap();
    let mut ws = HostWorkspace::with_bytes(bytes);
    let (workspace, workspace_bytes) = ws.as_raw();
    unsafe {
        raw::backward(
            &opts,
            rows as i64,
            vocab as i64,
            &raw::BackwardArgs {
                logits: logits.as_ptr().cast(),
                targets: targets.as_ptr().cast(),
                lse: lse.as_ptr(),
                grad_output: g.as_ptr(),
                grad_logits: grad2.as_mut_ptr().cast(),
                workspace,
                workspace_bytes,
                ..Default::default()
            },
        )
        .unwrap();
    }
    assert_close("raw backward", &grad2, &want.grad, F32_RTOL);
}

#[test]
fn deterministic_run_to_run() {
    let (rows, vocab) = (64, 257);
    let mut rng = Rng::new(12);
    let logits = rng.normals_f32(rows * vocab, 10.0);
    let targets = rng.targets(rows, vocab);
    let opts = Options::new().deterministic(true).label_smoothing(0.1);
    let run = || {
        let (mut loss, mut grad) = (nan_vec(1), nan_vec(rows * vocab));
        forward(
            &opts,
            rows,
            vocab,
            &logits,
            &targets,
            ForwardBuffers::new(&mut loss).grad_logits(&mut grad),
        )
        .unwrap();
        (
            loss[0].to_bits(),
            grad.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        )
    };
    assert_eq!(run(), run());
}
