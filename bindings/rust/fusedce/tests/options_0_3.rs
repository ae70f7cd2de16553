//! The options and outputs of 0.3 on the CPU backend, each against a float64 reference written
//! here or in tests/common (not from the library): the causal shift by k (also checked by
//! slicing the rows and targets by hand), the predicted classes (argmax) and the accuracy (by
//! hand), token scaling (each row's loss and gradient times p_y, treated as a constant), and the
//! mean's z-loss divided by the count of non-ignored rows when class weights are given.
mod common;

use common::*;
use fusedce::{
    backward, forward, linear_ce, raw, Backend, BackwardBuffers, ForwardBuffers, LinearCeBuffers,
    Options, Reduction, Status, FLAG_TARGET_OUT_OF_RANGE,
};

const F32_RTOL: f64 = 2e-5;

fn red(r: Reduction) -> Red {
    match r {
        Reduction::Mean => Red::Mean,
        Reduction::Sum => Red::Sum,
        Reduction::None => Red::None,
    }
}

const REDUCTIONS: [Reduction; 3] = [Reduction::Mean, Reduction::Sum, Reduction::None];

/// Everything forward writes on the CPU backend, every output poisoned first.
struct Out {
    loss: Vec<f32>,
    lse: Vec<f32>,
    z_loss: f32,
    grad: Vec<f32>,
    argmax: Vec<i64>,
    accuracy: Vec<f32>,
    flags: u32,
}

fn run_forward(
    opts: &Options<'_>,
    rows: usize,
    vocab: usize,
    logits: &[f32],
    targets: &[i64],
    grad_output: Option<&[f32]>,
) -> Out {
    let per = if opts.get_reduction() == Some(Reduction::None) {
        rows
    } else {
        1
    };
    let mut o = Out {
        loss: nan_vec(per),
        lse: nan_vec(rows),
        z_loss: f32::NAN,
        grad: nan_vec(rows * vocab),
        argmax: vec![i64::MIN; rows],
        accuracy: nan_vec(per),
        flags: 0,
    };
    let mut bufs = ForwardBuffers::new(&mut o.loss)
        .lse(&mut o.lse)
        .z_loss(&mut o.z_loss)
        .grad_logits(&mut o.grad)
        .argmax(&mut o.argmax)
        .accuracy(&mut o.accuracy)
        .error_flags(&mut o.flags);
    if let Some(g) = grad_output {
        bufs = bufs.grad_output(g);
    }
    forward(opts, rows, vocab, logits, targets, bufs).expect("forward");
    o
}

/// forward's outputs against the reference, and fce_backward's gradient from the saved lse.
#[track_caller]
#[allow(clippy::too_many_arguments)]
fn check_against_reference(
    what: &str,
    opts: &Options<'_>,
    r: &Ref,
    rows: usize,
    vocab: usize,
    logits: &[f32],
    targets: &[i64],
    g: &[f32],
) -> Out {
    let out = run_forward(opts, rows, vocab, logits, targets, Some(g));
    let want = reference(r, rows, vocab, &to_f64(logits), targets, &to_f64(g));
    assert_close(&format!("{what}: loss"), &out.loss, &want.loss, F32_RTOL);
    assert_close(&format!("{what}: lse"), &out.lse, &want.lse, F32_RTOL);
    assert_close(
        &format!("{what}: z_loss"),
        &[out.z_loss],
        &[want.z_loss],
        F32_RTOL,
    );
    assert_close(&format!("{what}: grad"), &out.grad, &want.grad, F32_RTOL);
    assert_eq!(out.argmax, want.argmax, "{what}: argmax");
    assert_close(
        &format!("{what}: accuracy"),
        &out.accuracy,
        &want.accuracy,
        1e-6,
    );
    assert_eq!(out.flags, 0, "{what}: flags");
    let mut grad2 = nan_vec(rows * vocab);
    backward(
        opts,
        rows,
        vocab,
        logits,
        targets,
        &out.lse,
        BackwardBuffers::new()
            .grad_logits(&mut grad2)
            .grad_output(g),
    )
    .expect("backward");
    assert_close(&format!("{what}: backward"), &grad2, &want.grad, F32_RTOL);
    assert_close(
        &format!("{what}: backward vs forward"),
        &grad2,
        &to_f64(&out.grad),
        backward_rtol(&out.lse),
    );
    out
}

fn grad_output(reduction: Reduction, rows: usize, rng: &mut Rng) -> Vec<f32> {
    match reduction {
        Reduction::None => (0..rows).map(|_| rng.normal(1.0) as f32).collect(),
        _ => vec![0.8],
    }
}

// ------------------------------------------------------------------------ argmax, accuracy ----

/// Seven rows of four classes whose predicted classes are known by hand: ties (the lowest index
/// wins), a NaN (the largest, as torch.argmax), −inf, an ignored row (−1, not counted) and an
/// invalid target (counted, never correct).
fn hand_rows() -> (Vec<f32>, Vec<i64>) {
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    #[rustfmt::skip]
    let logits = vec![
        1.0, 3.0, 3.0, 0.0,   // tie of 1 and 2: 1          target 1: correct
        0.0, 0.0, 0.0, 0.0,   // all equal: 0               target 2: wrong
        1.0, nan, 5.0, nan,   // the first NaN: 1           target 1: correct
        2.0, 1.0, 0.0, -1.0,  // ignored: -1
        -inf, -1.0, 7.0, 7.0, // tie of 2 and 3: 2          target 3: wrong
        0.0, 9.0, 1.0, 2.0,   // 1                          target 4 (invalid): never correct
        5.0, 1.0, 2.0, 3.0,   // 0                          target 0: correct
    ];
    (logits, vec![1, 2, 1, -100, 3, 4, 0])
}

#[test]
fn argmax_and_accuracy_by_hand() {
    let (rows, vocab) = (7, 4);
    let (logits, targets) = hand_rows();
    // the argmax of the scaled logits: a negative scale turns it around
    for (scale, want_argmax, want_none) in [
        (
            1.0f32,
            [1i64, 0, 1, -1, 2, 1, 0],
            [1.0f32, 0., 1., 0., 0., 0., 1.],
        ),
        (-0.5, [3, 0, 1, -1, 0, 0, 1], [0., 0., 1., 0., 0., 0., 0.]),
    ] {
        // 6 rows are not ignored (the invalid one counts): 3 of them right, or 1
        let want_mean = want_none.iter().sum::<f32>() / 6.0;
        for reduction in REDUCTIONS {
            let opts = Options::new().reduction(reduction).logit_scale(scale);
            let per = if reduction == Reduction::None {
                rows
            } else {
                1
            };
            let mut loss = nan_vec(per);
            let mut argmax = vec![i64::MIN; rows];
            let mut accuracy = nan_vec(per);
            let mut flags = 0u32;
            forward(
                &opts,
                rows,
                vocab,
                &logits,
                &targets,
                ForwardBuffers::new(&mut loss)
                    .argmax(&mut argmax)
                    .accuracy(&mut accuracy)
                    .error_flags(&mut flags),
            )
            .expect("forward");
            let what = format!("scale {scale}, {reduction:?}");
            assert_eq!(argmax, want_argmax, "{what}: argmax");
            if reduction == Reduction::None {
                assert_eq!(accuracy, want_none, "{what}: accuracy");
            } else {
                assert!(
                    (accuracy[0] - want_mean).abs() <= 1e-7,
                    "{what}: accuracy {} vs {want_mean}",
                    accuracy[0]
                );
            }
            assert_ne!(flags & FLAG_TARGET_OUT_OF_RANGE, 0, "{what}: flags");
            // the reference of tests/common agrees with the hand
            let r = Ref {
                reduction: red(reduction),
                scale: scale as f64,
                ..Ref::default()
            };
            let want = reference(&r, rows, vocab, &to_f64(&logits), &targets, &[1.0]);
            assert_eq!(want.argmax, want_argmax, "{what}: the reference's argmax");
            assert_close(
                &format!("{what}: the reference's accuracy"),
                &accuracy,
                &want.accuracy,
                1e-6,
            );
        }
    }
}

#[test]
fn accuracy_of_only_ignored_rows_is_zero_and_argmax_minus_one() {
    let (rows, vocab) = (5, 9);
    let logits = Rng::new(30).normals_f32(rows * vocab, 3.0);
    let targets = vec![-100i64; rows];
    for reduction in REDUCTIONS {
        let per = if reduction == Reduction::None {
            rows
        } else {
            1
        };
        let (mut loss, mut accuracy, mut argmax) = (nan_vec(per), nan_vec(per), vec![7i64; rows]);
        forward(
            &Options::new().reduction(reduction),
            rows,
            vocab,
            &logits,
            &targets,
            ForwardBuffers::new(&mut loss)
                .argmax(&mut argmax)
                .accuracy(&mut accuracy),
        )
        .unwrap();
        assert!(
            accuracy.iter().all(|&a| a == 0.0),
            "{reduction:?}: {accuracy:?}"
        );
        assert!(argmax.iter().all(|&a| a == -1), "{reduction:?}: {argmax:?}");
    }
}

/// Random rows (distinct logits: no ties to break) with ignored rows, and a shift: argmax and
/// accuracy against the reference, with every other output, for each reduction; asking for
/// them changes nothing else, bit for bit.
#[test]
fn argmax_and_accuracy_with_every_reduction_and_a_shift() {
    let (t, batch, vocab) = (8, 5, 113);
    let rows = t * batch;
    let mut rng = Rng::new(31);
    let logits = rng.normals_f32(rows * vocab, 3.0);
    let mut targets = rng.targets(rows, vocab);
    for r in [3, 17, 30] {
        targets[r] = -100;
    }
    // make a third of the rows right, so that the accuracy is not ~0
    let a = to_f64(&logits);
    for r in (0..rows).step_by(3) {
        if r + 2 < rows && targets[r + 2] != -100 {
            targets[r + 2] = argmax_of(&a[r * vocab..(r + 1) * vocab]);
        }
    }
    for reduction in REDUCTIONS {
        for (shift_seq_len, shift) in [(0usize, 0usize), (t, 2)] {
            let opts = Options::new()
                .reduction(reduction)
                .label_smoothing(0.05)
                .shift_seq_len(shift_seq_len as i64)
                .shift(shift as i64);
            let r = Ref {
                reduction: red(reduction),
                eps: 0.05,
                shift_seq_len,
                shift,
                ..Ref::default()
            };
            let g = grad_output(reduction, rows, &mut rng);
            let what = format!("{reduction:?}, T {shift_seq_len}, k {shift}");
            let out = check_against_reference(&what, &opts, &r, rows, vocab, &logits, &targets, &g);
            if shift == 2 {
                // the targets made right above: row r against targets[r + 2]
                assert!(
                    out.accuracy.iter().any(|&x| x > 0.2),
                    "{what}: {:?}",
                    out.accuracy
                );
            }
            // the same call without argmax and accuracy writes the same bits
            let per = out.loss.len();
            let (mut loss, mut lse, mut grad) =
                (nan_vec(per), nan_vec(rows), nan_vec(rows * vocab));
            forward(
                &opts,
                rows,
                vocab,
                &logits,
                &targets,
                ForwardBuffers::new(&mut loss)
                    .lse(&mut lse)
                    .grad_logits(&mut grad)
                    .grad_output(&g),
            )
            .unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&loss), bits(&out.loss), "{what}: loss");
            assert_eq!(bits(&grad), bits(&out.grad), "{what}: grad");
            assert_eq!(bits(&lse), bits(&out.lse), "{what}: lse");
        }
    }
}

// ------------------------------------------------------------------------ token scaling ----

#[test]
fn token_scaling_against_the_reference() {
    let (rows, vocab) = (24, 89);
    let mut rng = Rng::new(32);
    let logits = rng.normals_f32(rows * vocab, 2.0);
    let mut targets = rng.targets(rows, vocab);
    targets[5] = -100;
    targets[11] = -100;
    let weights: Vec<f32> = (0..vocab)
        .map(|_| 0.5 + 1.5 * rng.uniform() as f32)
        .collect();
    let w64 = to_f64(&weights);
    for reduction in REDUCTIONS {
        for (name, opts, r) in [
            ("plain", Options::new(), Ref::default()),
            (
                "smoothing, z-loss, softcap",
                Options::new()
                    .label_smoothing(0.1)
                    .z_loss_scale(1e-2)
                    .softcap(8.0),
                Ref {
                    eps: 0.1,
                    lambda: 1e-2,
                    softcap: 8.0,
                    ..Ref::default()
                },
            ),
            (
                "class weights, z-loss, shift 3",
                Options::new()
                    .class_weights(&weights)
                    .z_loss_scale(1e-2)
                    .shift_seq_len(6)
                    .shift(3),
                Ref {
                    weights: Some(w64.clone()),
                    lambda: 1e-2,
                    shift_seq_len: 6,
                    shift: 3,
                    ..Ref::default()
                },
            ),
        ] {
            let opts = opts.reduction(reduction).token_scaling(true);
            let r = Ref {
                reduction: red(reduction),
                token_scaling: true,
                ..r
            };
            let g = grad_output(reduction, rows, &mut rng);
            let what = format!("token scaling, {name}, {reduction:?}");
            check_against_reference(&what, &opts, &r, rows, vocab, &logits, &targets, &g);
        }
    }
}

/// Token scaling by hand: with reduction none, each row's loss is the unscaled loss times
/// p_y = exp(a_y − lse), p_y computed here in float64 from the logits; its gradient row is the
/// unscaled gradient row times that p_y (a constant: no term for its own derivative).
#[test]
fn token_scaling_is_the_unscaled_result_times_p_y() {
    let (rows, vocab) = (16, 57);
    let mut rng = Rng::new(33);
    let logits = rng.normals_f32(rows * vocab, 3.0);
    let mut targets = rng.targets(rows, vocab);
    targets[4] = -100;
    let base = Options::new()
        .reduction(Reduction::None)
        .label_smoothing(0.1)
        .z_loss_scale(1e-3)
        .logit_scale(0.5);
    let plain = run_forward(&base, rows, vocab, &logits, &targets, None);
    let scaled = run_forward(
        &base.token_scaling(true),
        rows,
        vocab,
        &logits,
        &targets,
        None,
    );
    let z = to_f64(&logits);
    for r in 0..rows {
        let a: Vec<f64> = z[r * vocab..(r + 1) * vocab]
            .iter()
            .map(|x| 0.5 * x)
            .collect();
        let m = a.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + a.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        let p_y = if targets[r] == -100 {
            0.0 // ignored: loss and gradient 0 either way
        } else {
            (a[targets[r] as usize] - lse).exp()
        };
        let want_loss = p_y * plain.loss[r] as f64;
        assert!(
            (scaled.loss[r] as f64 - want_loss).abs() <= 1e-5 * want_loss.abs() + 1e-7,
            "row {r}: loss {} vs p_y·{} = {want_loss}",
            scaled.loss[r],
            plain.loss[r]
        );
        let row = r * vocab..(r + 1) * vocab;
        let want: Vec<f64> = plain.grad[row.clone()]
            .iter()
            .map(|&x| p_y * x as f64)
            .collect();
        assert_close(&format!("row {r}: grad"), &scaled.grad[row], &want, 1e-5);
        // lse and the predictions do not change
        assert_eq!(
            scaled.lse[r].to_bits(),
            plain.lse[r].to_bits(),
            "row {r}: lse"
        );
        assert_eq!(scaled.argmax[r], plain.argmax[r], "row {r}: argmax");
    }
    // z_loss: the sum of the rows' z-loss terms, each times p_y
    let mut want_z = 0.0;
    for r in 0..rows {
        if targets[r] == -100 {
            continue;
        }
        let a: Vec<f64> = z[r * vocab..(r + 1) * vocab]
            .iter()
            .map(|x| 0.5 * x)
            .collect();
        let m = a.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + a.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        want_z += (a[targets[r] as usize] - lse).exp() * 1e-3 * lse * lse;
    }
    assert_close("z_loss", &[scaled.z_loss], &[want_z], 1e-5);
}

// ------------------------------------------------------------------------ shift by k ----

/// The shifted call against the unshifted one on the rows and targets sliced by hand: sequence
/// b's rows t < T − k against targets b·T + t + k; the last k rows of each sequence ignored.
#[test]
fn shift_k_equals_slicing_by_hand() {
    let (t, batch, vocab) = (7, 3, 41);
    let rows = t * batch;
    let mut rng = Rng::new(34);
    let logits = rng.normals_f32(rows * vocab, 4.0);
    let mut targets = rng.targets(rows, vocab);
    targets[9] = -100; // an ignore_index target inside a sequence
    for k in [0usize, 1, 2, 3, 6] {
        let k_eff = k.max(1);
        // the sliced problem: kept rows, their shifted targets
        let kept: Vec<usize> = (0..rows).filter(|r| r % t < t - k_eff).collect();
        let sliced_logits: Vec<f32> = kept
            .iter()
            .flat_map(|&r| logits[r * vocab..(r + 1) * vocab].iter().copied())
            .collect();
        let sliced_targets: Vec<i64> = kept.iter().map(|&r| targets[r + k_eff]).collect();
        let n = kept.len();
        for reduction in REDUCTIONS {
            let what = format!("k {k}, {reduction:?}");
            let opts = Options::new()
                .reduction(reduction)
                .label_smoothing(0.1)
                .z_loss_scale(1e-3);
            let shifted = run_forward(
                &opts.shift_seq_len(t as i64).shift(k as i64),
                rows,
                vocab,
                &logits,
                &targets,
                None,
            );
            let sliced = run_forward(&opts, n, vocab, &sliced_logits, &sliced_targets, None);
            let unshifted = run_forward(&opts, rows, vocab, &logits, &targets, None);
            // the reference, with the shift rule of tests/common
            let r = Ref {
                reduction: red(reduction),
                eps: 0.1,
                lambda: 1e-3,
                shift_seq_len: t,
                shift: k,
                ..Ref::default()
            };
            let want = reference(&r, rows, vocab, &to_f64(&logits), &targets, &[1.0]);
            assert_close(
                &format!("{what}: loss"),
                &shifted.loss,
                &want.loss,
                F32_RTOL,
            );
            assert_close(
                &format!("{what}: grad"),
                &shifted.grad,
                &want.grad,
                F32_RTOL,
            );
            assert_eq!(shifted.argmax, want.argmax, "{what}: argmax");
            // against the slicing
            let close = |a: f32, b: f32| (a - b).abs() <= 1e-6 * b.abs().max(1.0);
            if reduction == Reduction::None {
                for (i, &r) in kept.iter().enumerate() {
                    assert!(
                        close(shifted.loss[r], sliced.loss[i]),
                        "{what}: loss row {r}"
                    );
                    assert_eq!(
                        shifted.accuracy[r], sliced.accuracy[i],
                        "{what}: acc row {r}"
                    );
                }
            } else {
                assert!(
                    close(shifted.loss[0], sliced.loss[0]),
                    "{what}: loss {} vs sliced {}",
                    shifted.loss[0],
                    sliced.loss[0]
                );
                assert!(close(shifted.z_loss, sliced.z_loss), "{what}: z_loss");
                assert!(
                    close(shifted.accuracy[0], sliced.accuracy[0]),
                    "{what}: accuracy"
                );
            }
            for r in 0..rows {
                let row = &shifted.grad[r * vocab..(r + 1) * vocab];
                match kept.iter().position(|&x| x == r) {
                    Some(i) => {
                        let want = &sliced.grad[i * vocab..(i + 1) * vocab];
                        assert!(
                            row.iter().zip(want).all(|(&a, &b)| close(a, b)),
                            "{what}: grad row {r}"
                        );
                        assert_eq!(shifted.argmax[r], sliced.argmax[i], "{what}: argmax {r}");
                    }
                    None => {
                        assert!(
                            row.iter().all(|&x| x.to_bits() == 0),
                            "{what}: row {r} not +0"
                        );
                        assert_eq!(shifted.argmax[r], -1, "{what}: argmax of shifted-out {r}");
                        if reduction == Reduction::None {
                            assert_eq!(shifted.loss[r], 0.0, "{what}: loss of shifted-out {r}");
                        }
                    }
                }
                // lse is written for every row, the shifted-out ones too
                assert_eq!(
                    shifted.lse[r].to_bits(),
                    unshifted.lse[r].to_bits(),
                    "{what}: lse row {r}"
                );
            }
        }
    }
}

#[test]
fn shift_without_shift_seq_len_or_negative_is_an_error() {
    let (rows, vocab) = (6, 10);
    let logits = Rng::new(35).normals_f32(rows * vocab, 1.0);
    let targets = vec![1i64; rows];
    for (opts, what) in [
        (Options::new().shift(2), "shift without shift_seq_len"),
        (Options::new().shift_seq_len(3).shift(-1), "negative shift"),
    ] {
        let mut loss = [f32::NAN];
        let e = forward(
            &opts,
            rows,
            vocab,
            &logits,
            &targets,
            ForwardBuffers::new(&mut loss),
        )
        .unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument, "{what}: {e}");
        assert!(e.message().contains("shift"), "{what}: {e}");
        assert!(loss[0].is_nan(), "{what}: a rejected call wrote");
    }
}

// ------------------------------------------------------------------------ z-loss, mean ----

/// The mean with class weights: the cross-entropy terms over the class weights' sum D, the
/// z-loss terms over the count n of non-ignored rows; z_loss = λ Σ lse² / n, here from the
/// library's own lse.
#[test]
fn mean_z_loss_is_divided_by_the_count_of_rows_with_class_weights() {
    let (rows, vocab) = (20, 64);
    let mut rng = Rng::new(36);
    let logits = rng.normals_f32(rows * vocab, 5.0);
    let mut targets = rng.targets(rows, vocab);
    for r in [0, 7, 8] {
        targets[r] = -100;
    }
    let weights: Vec<f32> = (0..vocab)
        .map(|_| 0.1 + 3.0 * rng.uniform() as f32)
        .collect();
    let lambda = 1e-2f32;
    let opts = Options::new()
        .class_weights(&weights)
        .z_loss_scale(lambda)
        .label_smoothing(0.1);
    let r = Ref {
        weights: Some(to_f64(&weights)),
        lambda: lambda as f64,
        eps: 0.1,
        ..Ref::default()
    };
    let out = check_against_reference(
        "mean, class weights",
        &opts,
        &r,
        rows,
        vocab,
        &logits,
        &targets,
        &[1.3],
    );
    let scored: Vec<usize> = (0..rows).filter(|&r| targets[r] != -100).collect();
    let n = scored.len() as f64;
    let d: f64 = scored
        .iter()
        .map(|&r| weights[targets[r] as usize] as f64)
        .sum();
    assert!(
        (d - n).abs() > 1.0,
        "the weights must make D differ from n ({d} vs {n})"
    );
    let want_z = lambda as f64
        * scored
            .iter()
            .map(|&r| (out.lse[r] as f64).powi(2))
            .sum::<f64>()
        / n;
    assert_close("z_loss = λ Σ lse² / n", &[out.z_loss], &[want_z], 1e-5);
    // loss = (loss without z-loss) + z_loss: the two terms have their own divisors
    let plain = run_forward(
        &opts.z_loss_scale(0.0),
        rows,
        vocab,
        &logits,
        &targets,
        None,
    );
    assert_close(
        "loss = CE / D + z-loss / n",
        &out.loss,
        &[plain.loss[0] as f64 + want_z],
        1e-5,
    );
    // the sum reduction is unaffected by any divisor: Σ ce + λ Σ lse²
    let sum = run_forward(
        &opts.reduction(Reduction::Sum),
        rows,
        vocab,
        &logits,
        &targets,
        None,
    );
    let plain_sum = run_forward(
        &opts.reduction(Reduction::Sum).z_loss_scale(0.0),
        rows,
        vocab,
        &logits,
        &targets,
        None,
    );
    assert_close(
        "sum",
        &sum.loss,
        &[plain_sum.loss[0] as f64 + want_z * n],
        1e-5,
    );
}

// ------------------------------------------------------------------------ linear_ce ----

#[test]
fn linear_ce_with_argmax_accuracy_token_scaling_and_shift() {
    let (rows, hidden, vocab, t) = (12, 16, 37, 4);
    let mut rng = Rng::new(37);
    let h = rng.normals_f32(rows * hidden, 1.0);
    let w = rng.normals_f32(vocab * hidden, 0.5);
    let b = rng.normals_f32(vocab, 0.5);
    let mut y = rng.targets(rows, vocab);
    y[2] = -100;
    let z = linear(
        rows,
        hidden,
        vocab,
        &to_f64(&h),
        &to_f64(&w),
        Some(&to_f64(&b)),
    );
    for reduction in REDUCTIONS {
        let what = format!("linear_ce, {reduction:?}");
        let opts = Options::new()
            .reduction(reduction)
            .token_scaling(true)
            .z_loss_scale(1e-3)
            .shift_seq_len(t as i64)
            .shift(2);
        let r = Ref {
            reduction: red(reduction),
            token_scaling: true,
            lambda: 1e-3,
            shift_seq_len: t,
            shift: 2,
            ..Ref::default()
        };
        let g = grad_output(reduction, rows, &mut rng);
        let want = reference(&r, rows, vocab, &z, &y, &to_f64(&g));
        let (dh, dw, db) = linear_grads(rows, hidden, vocab, &to_f64(&h), &to_f64(&w), &want.grad);
        let per = want.loss.len();
        let (mut loss, mut z_loss, mut accuracy) = (nan_vec(per), f32::NAN, nan_vec(per));
        let mut argmax = vec![i64::MIN; rows];
        let (mut gh, mut gw, mut gb) = (
            nan_vec(rows * hidden),
            nan_vec(vocab * hidden),
            nan_vec(vocab),
        );
        linear_ce(
            &opts,
            rows,
            hidden,
            vocab,
            &h,
            &w,
            Some(&b),
            &y,
            LinearCeBuffers::new(&mut loss)
                .z_loss(&mut z_loss)
                .argmax(&mut argmax)
                .accuracy(&mut accuracy)
                .grad_hidden(&mut gh)
                .grad_weight(&mut gw)
                .grad_bias(&mut gb)
                .grad_output(&g),
        )
        .expect("linear_ce");
        // the logits come from a float32 GEMM: as tests/linear_ce.rs
        assert_close(&format!("{what}: loss"), &loss, &want.loss, 1e-4);
        assert_close(&format!("{what}: z_loss"), &[z_loss], &[want.z_loss], 1e-4);
        assert_close(&format!("{what}: grad_hidden"), &gh, &dh, 1e-4);
        assert_close(&format!("{what}: grad_weight"), &gw, &dw, 1e-4);
        assert_close(&format!("{what}: grad_bias"), &gb, &db, 1e-4);
        // the predicted class is a maximum of the float64 logits (up to the GEMM's rounding),
        // −1 exactly where the row is ignored; the accuracy follows from it
        let mut correct = vec![0.0f64; rows];
        for r in 0..rows {
            match want.target[r] {
                None => assert_eq!(argmax[r], -1, "{what}: row {r}"),
                Some(target) => {
                    let row = &z[r * vocab..(r + 1) * vocab];
                    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    assert!(
                        (0..vocab as i64).contains(&argmax[r])
                            && row[argmax[r] as usize] >= m - 1e-4 * m.abs().max(1.0),
                        "{what}: row {r}: argmax {} is not a maximum",
                        argmax[r]
                    );
                    correct[r] = (argmax[r] == target) as u8 as f64;
                }
            }
        }
        let n = want.target.iter().filter(|t| t.is_some()).count() as f64;
        let want_acc = if reduction == Reduction::None {
            correct
        } else {
            vec![correct.iter().sum::<f64>() / n]
        };
        assert_close(&format!("{what}: accuracy"), &accuracy, &want_acc, 1e-6);
    }
}

// ------------------------------------------------------------------------ raw calls ----

#[test]
fn raw_calls_write_argmax_and_accuracy() {
    let (rows, vocab) = (7, 4);
    let (logits, targets) = hand_rows();
    let opts = Options::new()
        .backend(Backend::Cpu)
        .reduction(Reduction::None);
    let (mut loss, mut argmax, mut accuracy) = (nan_vec(rows), vec![i64::MIN; rows], nan_vec(rows));
    // SAFETY: host buffers of the sizes the header gives; the CPU backend is synchronous.
    unsafe {
        raw::forward(
            &opts,
            rows as i64,
            vocab as i64,
            &raw::ForwardArgs {
                logits: logits.as_ptr().cast(),
                targets: targets.as_ptr().cast(),
                loss: loss.as_mut_ptr(),
                argmax: argmax.as_mut_ptr(),
                accuracy: accuracy.as_mut_ptr(),
                ..Default::default()
            },
        )
        .unwrap();
    }
    assert_eq!(argmax, [1, 0, 1, -1, 2, 1, 0]);
    assert_eq!(accuracy, [1.0, 0., 1., 0., 0., 0., 1.]);

    // linear_ce through raw pointers: hidden = identity rows, weight = the logits transposed,
    // made finite (0·NaN and 0·inf in the product would spread to every row) with the same
    // argmax: NaN -> 9, -inf -> -50
    let logits: Vec<f32> = logits
        .iter()
        .map(|&x| {
            if x.is_nan() {
                9.0
            } else if x.is_infinite() {
                -50.0
            } else {
                x
            }
        })
        .collect();
    let hidden = rows;
    let mut hs = vec![0.0f32; rows * hidden];
    for r in 0..rows {
        hs[r * hidden + r] = 1.0;
    }
    let mut w = vec![0.0f32; vocab * hidden];
    for r in 0..rows {
        for v in 0..vocab {
            w[v * hidden + r] = logits[r * vocab + v];
        }
    }
    let opts = Options::new().backend(Backend::Cpu);
    let size = fusedce::linear_ce_workspace_size(&opts, rows, hidden, vocab, false).unwrap();
    let mut ws = fusedce::HostWorkspace::with_bytes(size.min);
    let (workspace, workspace_bytes) = ws.as_raw();
    let (mut loss, mut argmax2, mut acc) = ([f32::NAN], vec![i64::MIN; rows], [f32::NAN]);
    // SAFETY: as above.
    unsafe {
        raw::linear_ce(
            &opts,
            rows as i64,
            hidden as i64,
            vocab as i64,
            &raw::LinearCeArgs {
                hidden_states: hs.as_ptr().cast(),
                weight: w.as_ptr().cast(),
                targets: targets.as_ptr().cast(),
                loss: loss.as_mut_ptr(),
                argmax: argmax2.as_mut_ptr(),
                accuracy: acc.as_mut_ptr(),
                workspace,
                workspace_bytes,
                ..Default::default()
            },
        )
        .unwrap();
    }
    // z = h·Wᵀ reproduces the finite logits exactly (one product of 1 per entry)
    assert_eq!(argmax2, argmax);
    assert!((acc[0] - 0.5).abs() <= 1e-7, "accuracy {}", acc[0]);
}

#[test]
fn short_argmax_and_accuracy_slices_are_caught_before_the_call() {
    let (rows, vocab) = (7, 4);
    let (logits, targets) = hand_rows();
    let mut loss = nan_vec(rows);
    let mut argmax = vec![i64::MIN; rows - 1];
    let e = forward(
        &Options::new(),
        rows,
        vocab,
        &logits,
        &targets,
        ForwardBuffers::new(&mut loss[..1]).argmax(&mut argmax),
    )
    .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(
        e.message().starts_with("fusedce::forward") && e.message().contains("argmax"),
        "{e}"
    );
    // none wants one accuracy per row
    let mut acc = nan_vec(1);
    let e = forward(
        &Options::new().reduction(Reduction::None),
        rows,
        vocab,
        &logits,
        &targets,
        ForwardBuffers::new(&mut loss).accuracy(&mut acc),
    )
    .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("accuracy"), "{e}");
    assert!(loss.iter().all(|x| x.is_nan()), "a rejected call wrote");
    let e = linear_ce(
        &Options::new(),
        rows,
        rows,
        vocab,
        &vec![0.0f32; rows * rows],
        &vec![0.0f32; vocab * rows],
        None,
        &targets,
        LinearCeBuffers::new(&mut loss[..1]).argmax(&mut argmax),
    )
    .unwrap_err();
    assert!(
        e.message().starts_with("fusedce::linear_ce") && e.message().contains("argmax"),
        "{e}"
    );
}
