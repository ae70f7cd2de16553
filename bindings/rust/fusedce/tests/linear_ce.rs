//! fusedce::linear_ce on the CPU backend against the float64 reference: z = h·Wᵀ + b, then the
//! cross-entropy of tests/common, then dh = dz·W, dW = dzᵀ·h, db = Σ_r dz.
mod common;

use common::*;
use fusedce::bits::{bf16_to_f32, f32_to_bf16};
use fusedce::{
    linear_ce, linear_ce_workspace_size, Dtype, HostWorkspace, LinearCeBuffers, Options, Reduction,
};

// The logits come from an f32 GEMM (BLAS): a little looser than the logits-given path.
const RTOL: f64 = 1e-4;

struct Data {
    rows: usize,
    hidden: usize,
    vocab: usize,
    h: Vec<f32>,
    w: Vec<f32>,
    b: Vec<f32>,
    y: Vec<i64>,
}

fn data(rows: usize, hidden: usize, vocab: usize, seed: u64) -> Data {
    let mut rng = Rng::new(seed);
    let h = rng.normals_f32(rows * hidden, 1.0);
    let w = rng.normals_f32(vocab * hidden, 2.0 / (hidden as f64).sqrt() * 2.0);
    let b = rng.normals_f32(vocab, 0.5);
    let mut y = rng.targets(rows, vocab);
    y[1] = -100;
    Data {
        rows,
        hidden,
        vocab,
        h,
        w,
        b,
        y,
    }
}

fn expected(d: &Data, r: &Ref, g: &[f64], bias: bool) -> (RefOut, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (h, w, b) = (to_f64(&d.h), to_f64(&d.w), to_f64(&d.b));
    let z = linear(d.rows, d.hidden, d.vocab, &h, &w, bias.then_some(&b[..]));
    let out = reference(r, d.rows, d.vocab, &z, &d.y, g);
    let (dh, dw, db) = linear_grads(d.rows, d.hidden, d.vocab, &h, &w, &out.grad);
    (out, dh, dw, db)
}

#[test]
fn loss_and_all_gradients() {
    let d = data(9, 16, 37, 21);
    let opts = Options::new().label_smoothing(0.05).z_loss_scale(1e-4);
    let (mut loss, mut lse, mut z_loss) = (nan_vec(1), nan_vec(d.rows), f32::NAN);
    let mut gh = nan_vec(d.rows * d.hidden);
    let mut gw = nan_vec(d.vocab * d.hidden);
    let mut gb = nan_vec(d.vocab);
    let g = [0.5f32];
    linear_ce(
        &opts,
        d.rows,
        d.hidden,
        d.vocab,
        &d.h,
        &d.w,
        Some(&d.b),
        &d.y,
        LinearCeBuffers::new(&mut loss)
            .lse(&mut lse)
            .z_loss(&mut z_loss)
            .grad_hidden(&mut gh)
            .grad_weight(&mut gw)
            .grad_bias(&mut gb)
            .grad_output(&g),
    )
    .unwrap();
    let r = Ref {
        eps: 0.05,
        lambda: 1e-4,
        ..Ref::default()
    };
    let (want, dh, dw, db) = expected(&d, &r, &[0.5], true);
    assert_close("loss", &loss, &want.loss, RTOL);
    assert_close("lse", &lse, &want.lse, RTOL);
    assert_close("z_loss", &[z_loss], &[want.z_loss], RTOL);
    assert_close("grad_hidden", &gh, &dh, RTOL);
    assert_close("grad_weight", &gw, &dw, RTOL);
    assert_close("grad_bias", &gb, &db, RTOL);
}

#[test]
fn sum_without_bias_and_evaluation_only() {
    let d = data(12, 8, 29, 22);
    let opts = Options::new().reduction(Reduction::Sum).softcap(5.0);
    let r = Ref {
        reduction: Red::Sum,
        softcap: 5.0,
        ..Ref::default()
    };
    let (want, dh, dw, _) = expected(&d, &r, &[1.0], false);

    let mut loss = nan_vec(1);
    linear_ce(
        &opts,
        d.rows,
        d.hidden,
        d.vocab,
        &d.h,
        &d.w,
        None,
        &d.y,
        LinearCeBuffers::new(&mut loss),
    )
    .unwrap();
    assert_close("eval loss", &loss, &want.loss, RTOL);

    let (mut loss, mut gh, mut gw) = (
        nan_vec(1),
        nan_vec(d.rows * d.hidden),
        nan_vec(d.vocab * d.hidden),
    );
    linear_ce(
        &opts,
        d.rows,
        d.hidden,
        d.vocab,
        &d.h,
        &d.w,
        None,
        &d.y,
        LinearCeBuffers::new(&mut loss)
            .grad_hidden(&mut gh)
            .grad_weight(&mut gw),
    )
    .unwrap();
    assert_close("loss", &loss, &want.loss, RTOL);
    assert_close("grad_hidden", &gh, &dh, RTOL);
    assert_close("grad_weight", &gw, &dw, RTOL);
}

#[test]
fn per_row_loss_and_strided_hidden() {
    let d = data(6, 10, 19, 23);
    let stride = d.hidden + 4;
    let mut hs = vec![f32::NAN; d.rows * stride];
    for r in 0..d.rows {
        hs[r * stride..r * stride + d.hidden]
            .copy_from_slice(&d.h[r * d.hidden..(r + 1) * d.hidden]);
    }
    let opts = Options::new()
        .reduction(Reduction::None)
        .hidden_row_stride(stride as i64);
    let mut loss = nan_vec(d.rows);
    let mut gh = nan_vec(d.rows * d.hidden);
    linear_ce(
        &opts,
        d.rows,
        d.hidden,
        d.vocab,
        &hs,
        &d.w,
        Some(&d.b),
        &d.y,
        LinearCeBuffers::new(&mut loss).grad_hidden(&mut gh),
    )
    .unwrap();
    let r = Ref {
        reduction: Red::None,
        ..Ref::default()
    };
    let (want, dh, _, _) = expected(&d, &r, &[1.0], true);
    assert_close("loss", &loss, &want.loss, RTOL);
    assert_close("grad_hidden", &gh, &dh, RTOL);
}

#[test]
fn accumulate_adds_into_weight_and_bias_gradients() {
    let d = data(7, 12, 21, 24);
    let mut rng = Rng::new(25);
    let gw0 = rng.normals_f32(d.vocab * d.hidden, 1.0);
    let gb0 = rng.normals_f32(d.vocab, 1.0);
    let (mut gw, mut gb) = (gw0.clone(), gb0.clone());
    let mut gh = nan_vec(d.rows * d.hidden); // always overwritten
    let mut loss = nan_vec(1);
    let opts = Options::new().accumulate(true);
    linear_ce(
        &opts,
        d.rows,
        d.hidden,
        d.vocab,
        &d.h,
        &d.w,
        Some(&d.b),
        &d.y,
        LinearCeBuffers::new(&mut loss)
            .grad_hidden(&mut gh)
            .grad_weight(&mut gw)
            .grad_bias(&mut gb),
    )
    .unwrap();
    let (want, dh, dw, db) = expected(&d, &Ref::default(), &[1.0], true);
    let plus = |a: &[f32], b: &[f64]| {
        a.iter()
            .zip(b)
            .map(|(&x, &y)| x as f64 + y)
            .collect::<Vec<_>>()
    };
    assert_close("loss", &loss, &want.loss, RTOL);
    assert_close("grad_hidden", &gh, &dh, RTOL);
    assert_close("grad_weight (accumulated)", &gw, &plus(&gw0, &dw), RTOL);
    assert_close("grad_bias (accumulated)", &gb, &plus(&gb0, &db), RTOL);
}

#[test]
fn minimum_workspace_gives_the_same_result() {
    let d = data(40, 16, 300, 26);
    let opts = Options::new().label_smoothing(0.1);
    let size = linear_ce_workspace_size(
        &opts.backend(fusedce::Backend::Cpu),
        d.rows,
        d.hidden,
        d.vocab,
        true,
    )
    .unwrap();
    assert!(size.min <= size.optimal, "{size:?}");
    let mut ws = HostWorkspace::with_bytes(size.min);
    let (mut loss, mut gw) = (nan_vec(1), nan_vec(d.vocab * d.hidden));
    linear_ce(
        &opts,
        d.rows,
        d.hidden,
        d.vocab,
        &d.h,
        &d.w,
        Some(&d.b),
        &d.y,
        LinearCeBuffers::new(&mut loss)
            .grad_weight(&mut gw)
            .workspace(&mut ws),
    )
    .unwrap();
    let (want, _, dw, _) = expected(
        &d,
        &Ref {
            eps: 0.1,
            ..Ref::default()
        },
        &[1.0],
        true,
    );
    assert_close("loss", &loss, &want.loss, RTOL);
    assert_close("grad_weight", &gw, &dw, RTOL);
}

#[test]
fn bfloat16_with_float32_weight_gradient() {
    let d = data(8, 16, 33, 27);
    let hb: Vec<u16> = d.h.iter().map(|&x| f32_to_bf16(x)).collect();
    let wb: Vec<u16> = d.w.iter().map(|&x| f32_to_bf16(x)).collect();
    let bb: Vec<u16> = d.b.iter().map(|&x| f32_to_bf16(x)).collect();
    let opts = Options::new().dtype(Dtype::BFloat16);
    let mut loss = nan_vec(1);
    let mut gh = vec![f32_to_bf16(f32::NAN); d.rows * d.hidden];
    let mut gw = nan_vec(d.vocab * d.hidden);
    let mut gb = nan_vec(d.vocab);
    linear_ce(
        &opts,
        d.rows,
        d.hidden,
        d.vocab,
        &hb,
        &wb,
        Some(&bb),
        &d.y,
        LinearCeBuffers::new(&mut loss)
            .grad_hidden(&mut gh)
            .grad_weight_f32(&mut gw)
            .grad_bias_f32(&mut gb),
    )
    .unwrap();
    // Reference on the rounded inputs.
    let rounded = Data {
        h: hb.iter().map(|&x| bf16_to_f32(x)).collect(),
        w: wb.iter().map(|&x| bf16_to_f32(x)).collect(),
        b: bb.iter().map(|&x| bf16_to_f32(x)).collect(),
        y: d.y.clone(),
        ..d
    };
    let (want, dh, dw, db) = expected(&rounded, &Ref::default(), &[1.0], true);
    let gh: Vec<f32> = gh.into_iter().map(bf16_to_f32).collect();
    assert_close("loss", &loss, &want.loss, 1e-3);
    assert_close("grad_hidden (bf16)", &gh, &dh, 2e-2);
    assert_close("grad_weight (f32)", &gw, &dw, 1e-2);
    assert_close("grad_bias (f32)", &gb, &db, 1e-2);
}
