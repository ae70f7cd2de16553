//! An independent float64 reference of shared/SPEC.md and lib/SEMANTICS.md, written from the
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
    pub shift: usize,
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
            shift: 0,
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
}

/// Cross-entropy of dense z [rows, vocab] (f64) against y, with upstream g ([1] or [rows]).
pub fn reference(o: &Ref, rows: usize, vocab: usize, z: &[f64], y: &[i64], g: &[f64]) -> RefOut {
    let w = |j: usize| o.weights.as_ref().map_or(1.0, |w| w[j]);
    let omega: f64 = (0..vocab).map(w).sum();
    let v = vocab as f64;
    let mut row_loss = vec![0.0; rows];
    let mut lse = vec![0.0; rows];
    let mut dadz = vec![0.0; rows * vocab]; // dloss_r/da * da/dz, before the upstream scale
    let mut denom = 0.0;
    let mut zsum = 0.0;
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
        let target = if o.shift > 0 {
            if r % o.shift == o.shift - 1 {
                None
            } else {
                Some(y[r + 1])
            }
        } else {
            Some(y[r])
        };
        let t = match target {
            None => continue,
            Some(t) if t == o.ignore_index => continue,
            Some(t) => t,
        };
        if t < 0 || t as usize >= vocab {
            row_loss[r] = f64::NAN;
            denom += 1.0;
            zsum += o.lambda * l * l;
            for j in 0..vocab {
                dadz[r * vocab + j] = f64::NAN;
            }
            continue;
        }
        let t = t as usize;
        // 4-5: CE with weights and smoothing, then z-loss
        let smooth: f64 = (0..vocab).map(|j| w(j) * (l - a[j])).sum();
        let ce = (1.0 - o.eps) * w(t) * (l - a[t]) + o.eps / v * smooth;
        row_loss[r] = ce + o.lambda * l * l;
        denom += w(t);
        zsum += o.lambda * l * l;
        for j in 0..vocab {
            let p = (a[j] - l).exp();
            let onehot = if j == t { 1.0 } else { 0.0 };
            let da = (1.0 - o.eps) * w(t) * (p - onehot)
                + o.eps / v * (omega * p - w(j))
                + 2.0 * o.lambda * l * p;
            let cap = if o.softcap > 0.0 {
                1.0 - (a[j] / o.softcap).powi(2)
            } else {
                1.0
            };
            dadz[r * vocab + j] = da * o.scale * cap;
        }
    }
    let gr = |r: usize| if g.len() == 1 { g[0] } else { g[r] };
    let (loss, z_loss, k): (Vec<f64>, f64, Vec<f64>) = match o.reduction {
        Red::Mean => {
            let d = |x: f64| if denom == 0.0 { 0.0 } else { x / denom };
            (
                vec![d(row_loss.iter().sum())],
                d(zsum),
                vec![d(gr(0)); rows],
            )
        }
        Red::Sum => (vec![row_loss.iter().sum()], zsum, vec![gr(0); rows]),
        Red::None => (row_loss.clone(), zsum, (0..rows).map(gr).collect()),
    };
    let grad = (0..rows * vocab).map(|i| k[i / vocab] * dadz[i]).collect();
    RefOut {
        loss,
        lse,
        z_loss,
        grad,
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

pub fn nan_vec(n: usize) -> Vec<f32> {
    vec![f32::NAN; n]
}
