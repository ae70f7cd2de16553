//! Checks the float64 reference of tests/common on its own (no library involved): its gradient
//! against central finite differences of its loss, and a few values known by hand.
mod common;

use common::*;

/// The scalar the gradient is of: g·L for mean/sum, Σ_r g_r·L_r for none.
fn objective(o: &Ref, rows: usize, vocab: usize, z: &[f64], y: &[i64], g: &[f64]) -> f64 {
    let out = reference(o, rows, vocab, z, y, g);
    out.loss
        .iter()
        .zip(g.iter().cycle())
        .map(|(l, g)| l * g)
        .sum()
}

fn check_gradient(o: Ref, g: Vec<f64>) {
    let (rows, vocab) = (4, 6);
    let mut rng = Rng::new(42);
    let z: Vec<f64> = (0..rows * vocab).map(|_| rng.normal(2.0)).collect();
    let y = vec![1, -100, 5, 0];
    check_gradient_at(&o, rows, vocab, &z, &y, &g);
}

fn check_gradient_at(o: &Ref, rows: usize, vocab: usize, z: &[f64], y: &[i64], g: &[f64]) {
    let (o, z, y, g) = (o.clone(), z.to_vec(), y.to_vec(), g.to_vec());
    let got = reference(&o, rows, vocab, &z, &y, &g).grad;
    let h = 1e-5;
    for i in 0..rows * vocab {
        let (mut zp, mut zm) = (z.clone(), z.clone());
        zp[i] += h;
        zm[i] -= h;
        let fd = (objective(&o, rows, vocab, &zp, &y, &g)
            - objective(&o, rows, vocab, &zm, &y, &g))
            / (2.0 * h);
        assert!(
            (fd - got[i]).abs() <= 1e-7 * (1.0 + fd.abs()),
            "{o:?} z[{i}]: analytic {} vs numeric {fd}",
            got[i]
        );
    }
}

#[test]
fn gradient_matches_finite_differences() {
    let weights = Some(vec![0.5, 1.0, 2.0, 1.5, 0.7, 1.2]);
    check_gradient(Ref::default(), vec![1.0]);
    check_gradient(
        Ref {
            reduction: Red::Sum,
            eps: 0.1,
            lambda: 1e-2,
            ..Ref::default()
        },
        vec![0.7],
    );
    check_gradient(
        Ref {
            reduction: Red::None,
            softcap: 3.0,
            scale: 1.3,
            ..Ref::default()
        },
        vec![0.5, 2.0, -1.0, 1.5],
    );
    check_gradient(
        Ref {
            eps: 0.2,
            lambda: 1e-3,
            softcap: 4.0,
            weights,
            ..Ref::default()
        },
        vec![1.0],
    );
    // the mean's z-loss over the row count n, the cross-entropy over the weights' sum D
    check_gradient(
        Ref {
            lambda: 5e-2,
            weights: Some(vec![0.2, 3.0, 2.0, 1.5, 0.7, 1.2]),
            ..Ref::default()
        },
        vec![0.9],
    );
    // a causal shift by 2 within sequences of 4 (8 rows: 2 sequences)
    let mut rng = Rng::new(43);
    let z: Vec<f64> = (0..8 * 5).map(|_| rng.normal(2.0)).collect();
    let y = vec![1, 4, 0, -100, 2, 3, 3, 1];
    for reduction in [Red::Mean, Red::Sum] {
        let o = Ref {
            reduction,
            shift_seq_len: 4,
            shift: 2,
            lambda: 1e-2,
            ..Ref::default()
        };
        check_gradient_at(&o, 8, 5, &z, &y, &[1.1]);
    }
}

/// Token scaling: the scale p_y is a constant for the gradient, so no finite difference sees
/// it; instead each row's loss and gradient are the unscaled ones times p_y (reduction none).
#[test]
fn token_scaling_is_the_unscaled_row_times_p_y() {
    let (rows, vocab) = (4, 6);
    let mut rng = Rng::new(44);
    let z: Vec<f64> = (0..rows * vocab).map(|_| rng.normal(2.0)).collect();
    let y = vec![1, -100, 5, 0];
    let g = vec![0.5, 2.0, -1.0, 1.5];
    let base = Ref {
        reduction: Red::None,
        eps: 0.1,
        lambda: 1e-2,
        softcap: 3.0,
        ..Ref::default()
    };
    let plain = reference(&base, rows, vocab, &z, &y, &g);
    let scaled = reference(
        &Ref {
            token_scaling: true,
            ..base.clone()
        },
        rows,
        vocab,
        &z,
        &y,
        &g,
    );
    let mut zsum = 0.0;
    for r in 0..rows {
        let p_y = if y[r] < 0 {
            0.0
        } else {
            let a = |j: usize| 3.0 * (z[r * vocab + j] / 3.0).tanh();
            (a(y[r] as usize) - plain.lse[r]).exp()
        };
        assert!(
            (scaled.loss[r] - p_y * plain.loss[r]).abs() < 1e-14,
            "row {r}"
        );
        for j in 0..vocab {
            let i = r * vocab + j;
            assert!(
                (scaled.grad[i] - p_y * plain.grad[i]).abs() < 1e-14,
                "row {r} [{j}]"
            );
        }
        zsum += p_y * 1e-2 * plain.lse[r] * plain.lse[r];
    }
    assert!((scaled.z_loss - zsum).abs() < 1e-14);
}

#[test]
fn values_known_by_hand() {
    // Two equal logits: loss ln 2, gradient (p − onehot) = (−½, ½), lse ln 2.
    let out = reference(&Ref::default(), 1, 2, &[0.0, 0.0], &[0], &[1.0]);
    assert!((out.loss[0] - 2f64.ln()).abs() < 1e-15);
    assert!((out.grad[0] + 0.5).abs() < 1e-15 && (out.grad[1] - 0.5).abs() < 1e-15);
    // Mean over two rows where one is ignored divides by 1; all ignored gives 0.
    let out = reference(
        &Ref::default(),
        2,
        2,
        &[0.0, 0.0, 5.0, 1.0],
        &[1, -100],
        &[1.0],
    );
    assert!((out.loss[0] - 2f64.ln()).abs() < 1e-15);
    let out = reference(&Ref::default(), 1, 2, &[0.0, 0.0], &[-100], &[1.0]);
    assert_eq!(out.loss[0], 0.0);
    assert!(out.grad.iter().all(|&g| g == 0.0));
    // Full smoothing of a uniform row costs the same ln V as no smoothing.
    let out = reference(
        &Ref {
            eps: 0.5,
            ..Ref::default()
        },
        1,
        4,
        &[1.0; 4],
        &[2],
        &[1.0],
    );
    assert!((out.loss[0] - 4f64.ln()).abs() < 1e-14);
    // Token scaling of two equal logits: p_y = ½, loss ½ ln 2, gradient ½ (−½, ½).
    let out = reference(
        &Ref {
            token_scaling: true,
            ..Ref::default()
        },
        1,
        2,
        &[0.0, 0.0],
        &[0],
        &[1.0],
    );
    assert!((out.loss[0] - 0.5 * 2f64.ln()).abs() < 1e-15);
    assert!((out.grad[0] + 0.25).abs() < 1e-15 && (out.grad[1] - 0.25).abs() < 1e-15);
    // Mean with class weights: CE / Σw over the weights, z-loss / the row count. Two rows of
    // two equal logits (lse ln 2), targets 0 and 1 with weights 1 and 3: CE = (1 + 3) ln 2 / 4,
    // z-loss λ (ln 2)² · 2 / 2.
    let out = reference(
        &Ref {
            lambda: 0.1,
            weights: Some(vec![1.0, 3.0]),
            ..Ref::default()
        },
        2,
        2,
        &[0.0; 4],
        &[0, 1],
        &[1.0],
    );
    let l2 = 2f64.ln();
    assert!((out.loss[0] - (l2 + 0.1 * l2 * l2)).abs() < 1e-15);
    assert!((out.z_loss - 0.1 * l2 * l2).abs() < 1e-15);
    // Causal shift by 2 in sequences of 3: only t = 0 is scored, against y[t + 2].
    let out = reference(
        &Ref {
            reduction: Red::None,
            shift_seq_len: 3,
            shift: 2,
            ..Ref::default()
        },
        3,
        2,
        &[0.0, 0.0, 5.0, -5.0, 5.0, -5.0],
        &[-100, -100, 1],
        &[1.0],
    );
    assert!((out.loss[0] - l2).abs() < 1e-15 && out.loss[1] == 0.0 && out.loss[2] == 0.0);
    assert_eq!(out.argmax, [0, -1, -1]);
    assert_eq!(out.accuracy, [0.0, 0.0, 0.0]);
}
