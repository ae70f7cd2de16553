// Cross-entropy loss and its gradient on the CPU backend of libfusedce, from Rust.
//
// Run (from the repository root, after `make`, with the library in build/):
//   FUSEDCE_LIB_DIR=$PWD/build cargo run --offline --manifest-path bindings/rust/Cargo.toml -p fusedce --example cross_entropy
//
// It scores 4 tokens over a vocabulary of 6 classes (one target ignored), prints the mean loss,
// each row's lse, predicted class and the accuracy, and the gradient over the logits, then the
// same loss computed by fused linear + cross-entropy from hidden states and a weight matrix.
use fusedce::{forward, linear_ce, ForwardBuffers, LinearCeBuffers, Options, Reduction};

fn main() -> Result<(), fusedce::Error> {
    fusedce::check_version()?;
    let v = fusedce::version();
    println!(
        "libfusedce {}.{}.{} (CUDA backend available: {})",
        v / 10000,
        v / 100 % 100,
        v % 100,
        fusedce::cuda_available()
    );

    let (rows, vocab) = (4, 6);
    #[rustfmt::skip]
    let logits: Vec<f32> = vec![
        2.0, 1.0, 0.1, -1.0, 0.5, 0.0,
        0.3, 0.2, 3.0, 0.0, -0.5, 1.0,
        -2.0, 0.0, 0.0, 1.5, 2.5, 0.1,
        1.0, 1.0, 1.0, 1.0, 1.0, 1.0,
    ];
    let targets: Vec<i64> = vec![0, 2, 3, -100]; // the last row is ignored

    let opts = Options::new()
        .reduction(Reduction::Mean)
        .label_smoothing(0.1);
    let mut loss = [0.0f32];
    let mut lse = vec![0.0f32; rows];
    let mut grad = vec![0.0f32; rows * vocab];
    let mut predicted = vec![0i64; rows];
    let mut accuracy = [0.0f32];
    forward(
        &opts,
        rows,
        vocab,
        &logits,
        &targets,
        ForwardBuffers::new(&mut loss)
            .lse(&mut lse)
            .argmax(&mut predicted)
            .accuracy(&mut accuracy)
            .grad_logits(&mut grad),
    )?;

    println!("mean cross-entropy (label smoothing 0.1): {:.6}", loss[0]);
    println!("lse per row: {lse:.4?}");
    println!(
        "predicted classes: {predicted:?} (-1: ignored), accuracy {:.3}",
        accuracy[0]
    );
    println!("gradient d loss / d logits:");
    for (r, row) in grad.chunks(vocab).enumerate() {
        println!("  row {r} (target {:>4}): {row:+.5?}", targets[r]);
    }

    // The same logits as hidden · weightᵀ: hidden = identity rows, weight = logitsᵀ.
    let hidden = vocab;
    let mut h = vec![0.0f32; rows * hidden];
    for r in 0..rows {
        h[r * hidden + r] = 1.0; // row r of h picks column r of weightᵀ
    }
    let mut w = vec![0.0f32; vocab * hidden];
    for r in 0..rows {
        for v in 0..vocab {
            w[v * hidden + r] = logits[r * vocab + v];
        }
    }
    let mut loss2 = [0.0f32];
    let mut grad_w = vec![0.0f32; vocab * hidden];
    linear_ce(
        &opts,
        rows,
        hidden,
        vocab,
        &h,
        &w,
        None,
        &targets,
        LinearCeBuffers::new(&mut loss2).grad_weight(&mut grad_w),
    )?;
    println!("fused linear + cross-entropy, same logits: {:.6}", loss2[0]);
    Ok(())
}
