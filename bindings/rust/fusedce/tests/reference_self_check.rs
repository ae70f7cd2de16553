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
}
