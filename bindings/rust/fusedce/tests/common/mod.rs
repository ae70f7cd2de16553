//! An independent float64 reference of docs/semantics.md, written from the
//! formulas (not from the library), plus random data and comparison helpers for the tests.
#![allow(dead_code)]

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Red {
    Mean,
    Sum,
    None,
}

#[derive(Clone, Debug)]
pub struct Ref {
    pub reduction: Red,
    pub ignore_index: i64,
    pub eps: f64,
    pub lambda: f64,
    pub softcap: f64,
    pub scale: f64,
    pub weights: Option<Vec<f64>>,
    /// T of the causal shift (options' shift_seq_len); 0: no shift.
    pub shift_seq_len: usize,
    /// k of the causal shift (options' shift); 0 means 1.
    pub shift: usize,
    /// Each scored row's loss and gradient times the detached p_y.
    pub token_scaling: bool,
}

impl Default for Ref {
    fn default() -> Self {
        Ref {
            reduction: Red::Mean,
            ignore_index: -100,
            eps: 0.0,
            lambda: 0.0,
            softcap: 0.0,
            scale: 1.0,
            weights: None,
            shift_seq_len: 0,
            shift: 0,
            token_scaling: false,
        }
    }
}

#[derive(Clone, Debug)]
pub struct RefOut {
    /// [1] for mean/sum, [rows] for none.
    pub loss: Vec<f64>,
    pub lse: Vec<f64>,
    pub z_loss: f64,
    /// dense [rows, vocab]
    pub grad: Vec<f64>,
    /// [rows]: the lowest index of the largest a (a NaN the largest), −1 for ignored rows.
    pub argmax: Vec<i64>,
    /// [1] for mean/sum, [rows] for none.
    pub accuracy: Vec<f64>,
    /// [rows]: the target each row is scored against (None: ignored).
    pub target: Vec<Option<i64>>,
}

/// The target of row r (docs/semantics.md rule 1): y[r], or with a causal shift (T, k) y[r + k]
/// unless r mod T ≥ T − k; None when the row is shifted out or its target is ignore_index.
pub fn row_target(o: &Ref, r: usize, y: &[i64]) -> Option<i64> {
    let t = if o.shift_seq_len > 0 {
        let k = o.shift.max(1);
        if r % o.shift_seq_len + k >= o.shift_seq_len {
            return None;
        }
        y[r + k]
    } else {
        y[r]
    };
    (t != o.ignore_index).then_some(t)
}

/// torch.argmax of a row: the lowest index of the maximum, the first NaN if there is one.
pub fn argmax_of(a: &[f64]) -> i64 {
    if let Some(i) = a.iter().position(|x| x.is_nan()) {
        return i as i64;
    }
    let mut best = 0;
    for j in 1..a.len() {
        if a[j] > a[best] {
            best = j;
        }
    }
    best as i64
}

/// Cross-entropy of dense z [rows, vocab] (f64) against y, with upstream g ([1] or [rows]).
/// docs/semantics.md: loss_r = t·ce_r + t·zl_r (t = p_y with token scaling, else 1); mean: Σ ce / D
/// + Σ zl / n, D the class-weight sum, n the count of non-ignored rows.
pub fn reference(o: &Ref, rows: usize, vocab: usize, z: &[f64], y: &[i64], g: &[f64]) -> RefOut {
    let w = |j: usize| o.weights.as_ref().map_or(1.0, |w| w[j]);
    let omega: f64 = (0..vocab).map(w).sum();
    let v = vocab as f64;
    let mut ce_r = vec![0.0; rows];
    let mut zl_r = vec![0.0; rows];
    let mut lse = vec![0.0; rows];
    let mut argmax = vec![-1i64; rows];
    let mut correct = vec![0.0; rows];
    let mut targets = vec![None; rows];
    // d(ce_r)/dz and d(zl_r)/dz (token scale included), before the upstream scales
    let mut dce = vec![0.0; rows * vocab];
    let mut dzl = vec![0.0; rows * vocab];
    let mut denom = 0.0; // D
    let mut count = 0.0; // n
    for r in 0..rows {
        // 1-2: scale, softcap
        let a: Vec<f64> = (0..vocab)
            .map(|j| {
                let a = o.scale * z[r * vocab + j];
                if o.softcap > 0.0 {
                    o.softcap * (a / o.softcap).tanh()
                } else {
                    a
                }
            })
            .collect();
        // 3: lse with the max taken out
        let m = a.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let l = m + a.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        lse[r] = l;
        let Some(t) = row_target(o, r, y) else {
            continue;
        };
        targets[r] = Some(t);
        argmax[r] = argmax_of(&a);
        count += 1.0;
        if t < 0 || t as usize >= vocab {
            // invalid: NaN loss and gradient, counts 1, its z-loss term unscaled, never correct
            ce_r[r] = f64::NAN;
            zl_r[r] = o.lambda * l * l;
            denom += 1.0;
            for j in 0..vocab {
                dce[r * vocab + j] = f64::NAN;
            }
            continue;
        }
        let t = t as usize;
        correct[r] = (argmax[r] == t as i64) as u8 as f64;
        let ts = if o.token_scaling {
            (a[t] - l).exp()
        } else {
            1.0
        };
        // 4-5: CE with weights and smoothing, then z-loss, each times the token scale
        let smooth: f64 = (0..vocab).map(|j| w(j) * (l - a[j])).sum();
        ce_r[r] = ts * ((1.0 - o.eps) * w(t) * (l - a[t]) + o.eps / v * smooth);
        zl_r[r] = ts * o.lambda * l * l;
        denom += w(t);
        for j in 0..vocab {
            let p = (a[j] - l).exp();
            let onehot = if j == t { 1.0 } else { 0.0 };
            let dce_da = (1.0 - o.eps) * w(t) * (p - onehot) + o.eps / v * (omega * p - w(j));
            let dzl_da = 2.0 * o.lambda * l * p;
            let cap = if o.softcap > 0.0 {
                1.0 - (a[j] / o.softcap).powi(2)
            } else {
                1.0
            };
            dce[r * vocab + j] = ts * dce_da * o.scale * cap;
            dzl[r * vocab + j] = ts * dzl_da * o.scale * cap;
        }
    }
    let gr = |r: usize| if g.len() == 1 { g[0] } else { g[r] };
    let over = |x: f64, d: f64| if d == 0.0 { 0.0 } else { x / d };
    let zsum: f64 = zl_r.iter().sum();
    let row_loss: Vec<f64> = (0..rows).map(|r| ce_r[r] + zl_r[r]).collect();
    // (loss, z_loss, accuracy, k for the CE terms, k_z for the z-loss terms)
    let (loss, z_loss, accuracy, k, kz): (Vec<f64>, f64, Vec<f64>, Vec<f64>, Vec<f64>) =
        match o.reduction {
            Red::Mean => (
                vec![over(ce_r.iter().sum(), denom) + over(zsum, count)],
                over(zsum, count),
                vec![over(correct.iter().sum(), count)],
                vec![over(gr(0), denom); rows],
                vec![over(gr(0), count); rows],
            ),
            Red::Sum => (
                vec![row_loss.iter().sum()],
                zsum,
                vec![over(correct.iter().sum(), count)],
                vec![gr(0); rows],
                vec![gr(0); rows],
            ),
            Red::None => (
                row_loss,
                zsum,
                correct,
                (0..rows).map(gr).collect(),
                (0..rows).map(gr).collect(),
            ),
        };
    let grad = (0..rows * vocab)
        .map(|i| k[i / vocab] * dce[i] + kz[i / vocab] * dzl[i])
        .collect();
    RefOut {
        loss,
        lse,
        z_loss,
        grad,
        argmax,
        accuracy,
        target: targets,
    }
}

/// z = h·Wᵀ + b in f64: h [rows, hidden], w [vocab, hidden], b [vocab].
pub fn linear(
    rows: usize,
    hidden: usize,
    vocab: usize,
    h: &[f64],
    w: &[f64],
    b: Option<&[f64]>,
) -> Vec<f64> {
    let mut z = vec![0.0; rows * vocab];
    for r in 0..rows {
        for v in 0..vocab {
            let mut acc = b.map_or(0.0, |b| b[v]);
            for d in 0..hidden {
                acc += h[r * hidden + d] * w[v * hidden + d];
            }
            z[r * vocab + v] = acc;
        }
    }
    z
}

/// (dh = dz·W [rows, hidden], dW = dzᵀ·h [vocab, hidden], db = Σ_r dz [vocab]).
pub fn linear_grads(
    rows: usize,
    hidden: usize,
    vocab: usize,
    h: &[f64],
    w: &[f64],
    dz: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut dh = vec![0.0; rows * hidden];
    let mut dw = vec![0.0; vocab * hidden];
    let mut db = vec![0.0; vocab];
    for r in 0..rows {
        for v in 0..vocab {
            let g = dz[r * vocab + v];
            db[v] += g;
            for d in 0..hidden {
                dh[r * hidden + d] += g * w[v * hidden + d];
                dw[v * hidden + d] += g * h[r * hidden + d];
            }
        }
    }
    (dh, dw, db)
}

/// splitmix64: a small deterministic generator, so the tests need no crate.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Normal(0, std), Box-Muller.
    pub fn normal(&mut self, std: f64) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn normals_f32(&mut self, n: usize, std: f64) -> Vec<f32> {
        (0..n).map(|_| self.normal(std) as f32).collect()
    }
    pub fn targets(&mut self, n: usize, vocab: usize) -> Vec<i64> {
        (0..n).map(|_| self.below(vocab) as i64).collect()
    }
}

pub fn to_f64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// Picks the logical [rows, cols] out of a strided buffer.
pub fn dense<T: Copy>(x: &[T], rows: usize, cols: usize, stride: usize) -> Vec<T> {
    (0..rows)
        .flat_map(|r| x[r * stride..r * stride + cols].iter().copied())
        .collect()
}

/// |got − want| ≤ rtol·|want| + rtol·max|want| (the second term scales the small entries of
/// a gradient by the tensor's magnitude). NaN must match NaN.
#[track_caller]
pub fn assert_close(name: &str, got: &[f32], want: &[f64], rtol: f64) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let scale = want
        .iter()
        .filter(|x| x.is_finite())
        .fold(0.0f64, |m, x| m.max(x.abs()));
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{name}[{i}]: got {g}, want NaN");
            continue;
        }
        let err = (g as f64 - w).abs();
        let tol = rtol * w.abs() + rtol * scale;
        assert!(
            err <= tol,
            "{name}[{i}]: got {g}, want {w} (error {err:.3e} > {tol:.3e})"
        );
    }
}

/// The tolerance of fce_backward's gradient against fce_forward's (docs/semantics.md rule 12): each
/// p_j = exp(a_j - lse) carries the rounding of the float32 lse, a relative |lse|·2^-24 (rows
/// with |lse| >= 1024 are reduced again, exactly), on top of float32 rounding.
pub fn backward_rtol(lse: &[f32]) -> f64 {
    let worst = lse
        .iter()
        .filter(|x| x.is_finite())
        .fold(0.0f64, |m, &x| m.max((x as f64).abs()))
        .min(1024.0);
    1e-6 + 2.0 * worst * 2f64.powi(-24)
}

pub fn nan_vec(n: usize) -> Vec<f32> {
    vec![f32::NAN; n]
}
