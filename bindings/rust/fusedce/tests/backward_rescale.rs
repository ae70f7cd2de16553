//! fusedce::backward_rescale (and raw::backward_rescale) on the CPU backend: the gradient
//! forward wrote without a grad_output, rescaled for g, is bit for bit what forward writes given
//! g (ignored rows included: they stay +0 for a negative power of two); exactly 1 changes no
//! bit; bad arguments come back as errors naming fce_backward_rescale (or
//! fusedce::backward_rescale) and the argument.
mod common;

use common::*;
use fusedce::bits::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use fusedce::{
    backward_rescale, forward, raw, BackwardBuffers, Dtype, Element, ForwardBuffers, Options,
    Reduction, Status,
};

const ROWS: usize = 13;
const VOCAB: usize = 97;
const IGNORED: [usize; 2] = [2, 7];

fn targets() -> Vec<i64> {
    let mut t = Rng::new(21).targets(ROWS, VOCAB);
    for r in IGNORED {
        t[r] = -100;
    }
    t
}

/// forward's gradient (and lse) for `grad_output` (None: an upstream 1).
fn forward_grad<T: Element>(
    opts: &Options<'_>,
    logits: &[T],
    grad_output: Option<f32>,
    poison: T,
) -> (Vec<T>, Vec<f32>) {
    let (mut loss, mut lse) = (nan_vec(1), nan_vec(ROWS));
    let mut grad = vec![poison; ROWS * VOCAB];
    let g = grad_output.map(|g| [g]);
    let mut bufs = ForwardBuffers::new(&mut loss)
        .lse(&mut lse)
        .grad_logits(&mut grad);
    if let Some(g) = &g {
        bufs = bufs.grad_output(g);
    }
    forward(opts, ROWS, VOCAB, logits, &targets(), bufs).expect("forward");
    (grad, lse)
}

/// backward_rescale of forward's upstream-1 gradient for g, and forward's gradient given g.
fn rescaled_and_direct<T: Element>(
    opts: &Options<'_>,
    logits: &[T],
    g: f32,
    poison: T,
) -> (Vec<T>, Vec<T>) {
    let (mut grad, lse) = forward_grad(opts, logits, None, poison);
    backward_rescale(
        opts,
        ROWS,
        VOCAB,
        logits,
        &targets(),
        &lse,
        BackwardBuffers::new()
            .grad_logits(&mut grad)
            .grad_output(&[g]),
    )
    .expect("backward_rescale");
    (grad, forward_grad(opts, logits, Some(g), poison).0)
}

/// Bitwise equal (NaN equals NaN), ignored rows included: +0 there, whatever g's sign.
fn assert_same(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let ok = a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        assert!(
            ok,
            "{what} [{i}]: got {a:e} ({:#x}), forward wrote {b:e}",
            a.to_bits()
        );
    }
}

fn options() -> Options<'static> {
    Options::new().label_smoothing(0.1).z_loss_scale(1e-3)
}

/// The gradient rows of the ignored rows are +0 (not -0), element by element.
fn assert_ignored_rows_plus_zero(what: &str, grad: &[f32]) {
    for r in IGNORED {
        for (j, x) in grad[r * VOCAB..(r + 1) * VOCAB].iter().enumerate() {
            assert_eq!(
                x.to_bits(),
                0,
                "{what}: ignored row {r} [{j}] is {x:e}, not +0"
            );
        }
    }
}

#[test]
fn f32_matches_forward_given_the_upstream_scalar() {
    let logits = Rng::new(20).normals_f32(ROWS * VOCAB, 5.0);
    for reduction in [Reduction::Mean, Reduction::Sum] {
        let opts = options().reduction(reduction);
        // 1: untouched; 0.75, -1.7: computed again; 2, -0.25, 0: scaled in place.
        for g in [1.0f32, 0.75, -1.7, 2.0, -0.25, 0.0] {
            let (got, want) = rescaled_and_direct(&opts, &logits, g, f32::NAN);
            assert_same(&format!("{reduction:?}, g = {g}"), &got, &want);
            assert_ignored_rows_plus_zero(&format!("{reduction:?}, g = {g}"), &got);
        }
        let r = Ref {
            reduction: if reduction == Reduction::Mean {
                Red::Mean
            } else {
                Red::Sum
            },
            eps: 0.1,
            lambda: 1e-3,
            ..Ref::default()
        };
        let want = reference(&r, ROWS, VOCAB, &to_f64(&logits), &targets(), &[0.75]);
        let (got, _) = rescaled_and_direct(&opts, &logits, 0.75, f32::NAN);
        assert_close("g = 0.75 vs the reference", &got, &want.grad, 2e-5);
    }
}

/// The options of 0.3 go through every branch of the rescale too: token scaling, a causal shift
/// by k, class weights with the z-loss (the z-loss normalised by the count of rows).
#[test]
fn token_scaling_shift_and_class_weights_match_forward() {
    let logits = Rng::new(26).normals_f32(ROWS * VOCAB, 4.0);
    let mut rng = Rng::new(27);
    let weights: Vec<f32> = (0..VOCAB)
        .map(|_| 0.25 + 2.0 * rng.uniform() as f32)
        .collect();
    let w64 = to_f64(&weights);
    // one sequence of ROWS (13) tokens, shifted by 3: its last 3 rows are ignored too
    for (name, opts, r) in [
        (
            "token scaling",
            options().token_scaling(true),
            Ref {
                eps: 0.1,
                lambda: 1e-3,
                token_scaling: true,
                ..Ref::default()
            },
        ),
        (
            "shift 3, class weights",
            options()
                .shift_seq_len(ROWS as i64)
                .shift(3)
                .class_weights(&weights),
            Ref {
                eps: 0.1,
                lambda: 1e-3,
                shift_seq_len: ROWS,
                shift: 3,
                weights: Some(w64.clone()),
                ..Ref::default()
            },
        ),
        (
            "everything",
            options()
                .token_scaling(true)
                .shift_seq_len(ROWS as i64)
                .shift(2)
                .class_weights(&weights)
                .softcap(20.0),
            Ref {
                eps: 0.1,
                lambda: 1e-3,
                token_scaling: true,
                shift_seq_len: ROWS,
                shift: 2,
                weights: Some(w64.clone()),
                softcap: 20.0,
                ..Ref::default()
            },
        ),
    ] {
        for reduction in [Reduction::Mean, Reduction::Sum] {
            let opts = opts.reduction(reduction);
            for g in [1.0f32, 0.75, -1.7, 2.0, -0.25, 0.0] {
                let (got, want) = rescaled_and_direct(&opts, &logits, g, f32::NAN);
                assert_same(&format!("{name}, {reduction:?}, g = {g}"), &got, &want);
            }
            let r = Ref {
                reduction: if reduction == Reduction::Mean {
                    Red::Mean
                } else {
                    Red::Sum
                },
                ..r.clone()
            };
            let want = reference(&r, ROWS, VOCAB, &to_f64(&logits), &targets(), &[-1.7]);
            let (got, _) = rescaled_and_direct(&opts, &logits, -1.7, f32::NAN);
            assert_close(
                &format!("{name}, {reduction:?}, g = -1.7"),
                &got,
                &want.grad,
                2e-5,
            );
        }
    }
}

#[test]
fn exactly_one_changes_no_bit() {
    let logits = Rng::new(22).normals_f32(ROWS * VOCAB, 5.0);
    let opts = options();
    let (_, lse) = forward_grad(&opts, &logits, None, f32::NAN);
    // Not a gradient at all, with a signalling NaN a multiplication would quiet: left as is.
    let mut grad: Vec<f32> = (0..ROWS * VOCAB).map(|i| i as f32 * 0.25).collect();
    grad[5] = f32::from_bits(0x7f80_0001);
    let before: Vec<u32> = grad.iter().map(|x| x.to_bits()).collect();
    backward_rescale(
        &opts,
        ROWS,
        VOCAB,
        &logits,
        &targets(),
        &lse,
        BackwardBuffers::new()
            .grad_logits(&mut grad)
            .grad_output(&[1.0]),
    )
    .expect("backward_rescale");
    assert!(grad.iter().map(|x| x.to_bits()).eq(before), "g = 1 wrote");
}

#[test]
fn half_precision_matches_forward() {
    let values = Rng::new(23).normals_f32(ROWS * VOCAB, 3.0);
    // bfloat16: computed again (0.75) and scaled in place (2, exact: no subnormals here);
    // float16: computed again only (its scaled subnormals may differ by one quantum).
    for (dtype, to, from, scalars) in [
        (
            Dtype::BFloat16,
            f32_to_bf16 as fn(f32) -> u16,
            bf16_to_f32 as fn(u16) -> f32,
            &[0.75f32, 2.0][..],
        ),
        (Dtype::Float16, f32_to_f16, f16_to_f32, &[0.75f32, -1.7][..]),
    ] {
        let logits: Vec<u16> = values.iter().map(|&v| to(v)).collect();
        let opts = options().dtype(dtype);
        for &g in scalars {
            let (got, want) = rescaled_and_direct(&opts, &logits, g, to(f32::NAN));
            let (got, want): (Vec<f32>, Vec<f32>) = (
                got.into_iter().map(from).collect(),
                want.into_iter().map(from).collect(),
            );
            assert_same(&format!("{dtype:?}, g = {g}"), &got, &want);
        }
    }
}

/// raw::backward_rescale on the CPU backend with the upstream scalar `g`; `grad_logits` may be
/// `logits` itself (which the library refuses).
fn raw_rescale(
    logits: *const f32,
    grad_logits: *mut f32,
    lse: &[f32],
    g: f32,
) -> fusedce::Result<()> {
    let t = targets();
    // SAFETY: the caller's pointers hold ROWS * VOCAB floats; the CPU backend is synchronous.
    unsafe {
        raw::backward_rescale(
            &options().backend(fusedce::Backend::Cpu),
            ROWS as i64,
            VOCAB as i64,
            &raw::BackwardArgs {
                logits: logits.cast(),
                targets: t.as_ptr().cast(),
                lse: lse.as_ptr(),
                grad_output: &g,
                grad_logits: grad_logits.cast(),
                ..Default::default()
            },
        )
    }
}

#[test]
fn raw_call_on_the_cpu_backend() {
    let logits = Rng::new(24).normals_f32(ROWS * VOCAB, 4.0);
    let (mut grad, lse) = forward_grad(&options(), &logits, None, f32::NAN);
    raw_rescale(logits.as_ptr(), grad.as_mut_ptr(), &lse, -1.7).expect("raw::backward_rescale");
    assert_same(
        "raw, g = -1.7",
        &grad,
        &forward_grad(&options(), &logits, Some(-1.7), f32::NAN).0,
    );
}

#[test]
fn bad_arguments_name_the_function_and_the_argument() {
    let logits = Rng::new(25).normals_f32(ROWS * VOCAB, 4.0);
    let t = targets();
    let (grad0, lse) = forward_grad(&options(), &logits, None, f32::NAN);
    let bits = |g: &[f32]| g.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let call = |opts: &Options<'_>, g: Option<&[f32]>, with_grad: bool, grad_len: usize| {
        let mut grad = grad0.clone();
        grad.truncate(grad_len);
        let mut bufs = BackwardBuffers::new();
        if with_grad {
            bufs = bufs.grad_logits(&mut grad);
        }
        if let Some(g) = g {
            bufs = bufs.grad_output(g);
        }
        let e = backward_rescale(opts, ROWS, VOCAB, &logits, &t, &lse, bufs).unwrap_err();
        if grad_len == grad0.len() {
            assert_eq!(bits(&grad), bits(&grad0), "a rejected call wrote: {e}");
        }
        e
    };
    let n = ROWS * VOCAB;
    let none = options().reduction(Reduction::None);
    let cases: [(&str, Status, &str, fusedce::Error); 4] = [
        (
            "reduction none",
            Status::InvalidArgument,
            "reduction",
            call(&none, Some(&[0.5; ROWS]), true, n),
        ),
        (
            "no grad_output",
            Status::NullPointer,
            "grad_output",
            call(&options(), None, true, n),
        ),
        (
            "no grad_logits",
            Status::NullPointer,
            "grad_logits",
            call(&options(), Some(&[0.5]), false, n),
        ),
        (
            "grad_logits too short",
            Status::InvalidArgument,
            "grad_logits",
            call(&options(), Some(&[0.5]), true, n - 1),
        ),
    ];
    for (what, status, name, e) in cases {
        assert_eq!(e.status(), status, "{what}: {e}");
        assert!(e.message().contains("backward_rescale"), "{what}: {e}");
        assert!(e.message().contains(name), "{what}: {e}");
    }
    // The gradient over the logits (allowed by fce_backward) cannot be rescaled.
    let mut z = logits.clone();
    let e = raw_rescale(z.as_ptr(), z.as_mut_ptr(), &lse, 0.5).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    assert!(
        e.message().contains("fce_backward_rescale") && e.message().contains("grad_logits"),
        "{e}"
    );
    assert_eq!(bits(&z), bits(&logits), "a rejected call wrote");
}
