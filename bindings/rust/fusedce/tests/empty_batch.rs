//! Zero rows, the empty problem (include/fusedce.h, docs/semantics.md "Zero rows"), through the
//! safe calls with empty slices: the queries say 0 bytes, the reduced loss, z-loss and accuracy
//! are 0, nothing per row exists, grad_weight and grad_bias are 0 (left as they are with
//! accumulate).
use fusedce::{
    backward, backward_rescale, forward, linear_ce, Backend, BackwardBuffers, ForwardBuffers,
    LinearCeBuffers, Options, Reduction,
};

const VOCAB: usize = 9;
const HIDDEN: usize = 4;

#[test]
fn queries_return_zero() {
    let opts = Options::new().backend(Backend::Cpu).label_smoothing(0.1);
    assert_eq!(fusedce::forward_workspace_size(&opts, 0, VOCAB).unwrap(), 0);
    assert_eq!(
        fusedce::backward_workspace_size(&opts, 0, VOCAB).unwrap(),
        0
    );
    let s = fusedce::linear_ce_workspace_size(&opts, 0, HIDDEN, VOCAB, true).unwrap();
    assert_eq!((s.min, s.optimal), (0, 0));
}

#[test]
fn forward_and_backward_of_no_row() {
    let (logits, targets, lse) = (Vec::<f32>::new(), Vec::<i64>::new(), Vec::<f32>::new());
    for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
        let opts = Options::new()
            .reduction(reduction)
            .label_smoothing(0.1)
            .z_loss_scale(1e-3);
        let none = reduction == Reduction::None;
        let mut loss = if none { vec![] } else { vec![f32::NAN] };
        let mut accuracy = loss.clone();
        let (mut z_loss, mut flags) = (f32::NAN, 0xA5u32);
        let (mut grad, mut out_lse, mut argmax) = (Vec::<f32>::new(), Vec::new(), Vec::new());
        forward(
            &opts,
            0,
            VOCAB,
            &logits,
            &targets,
            ForwardBuffers::new(&mut loss)
                .lse(&mut out_lse)
                .z_loss(&mut z_loss)
                .argmax(&mut argmax)
                .accuracy(&mut accuracy)
                .grad_logits(&mut grad)
                .error_flags(&mut flags),
        )
        .unwrap();
        assert!(
            loss.iter().chain(&accuracy).all(|&x| x == 0.0),
            "{loss:?} {accuracy:?}"
        );
        assert_eq!(z_loss, 0.0);
        assert_eq!(flags, 0xA5, "error_flags touched");
        backward(
            &opts,
            0,
            VOCAB,
            &logits,
            &targets,
            &lse,
            BackwardBuffers::new().grad_logits(&mut grad),
        )
        .unwrap();
        if !none {
            backward_rescale(
                &opts,
                0,
                VOCAB,
                &logits,
                &targets,
                &lse,
                BackwardBuffers::new()
                    .grad_logits(&mut grad)
                    .grad_output(&[0.5]),
            )
            .unwrap();
        }
    }
}

#[test]
fn linear_ce_of_no_row() {
    let w: Vec<f32> = (0..VOCAB * HIDDEN).map(|i| i as f32 * 0.1).collect();
    let b = vec![0.5f32; VOCAB];
    let targets = Vec::<i64>::new();
    for accumulate in [false, true] {
        let opts = Options::new().accumulate(accumulate);
        let (mut loss, mut z_loss) = ([f32::NAN], f32::NAN);
        let mut gh = Vec::<f32>::new();
        let (mut gw, mut gb) = (vec![3.0f32; VOCAB * HIDDEN], vec![3.0f32; VOCAB]);
        linear_ce(
            &opts,
            0,
            HIDDEN,
            VOCAB,
            &[],
            &w,
            Some(&b),
            &targets,
            LinearCeBuffers::new(&mut loss)
                .z_loss(&mut z_loss)
                .grad_hidden(&mut gh)
                .grad_weight(&mut gw)
                .grad_bias(&mut gb),
        )
        .unwrap();
        assert_eq!((loss[0], z_loss), (0.0, 0.0));
        let want = if accumulate { 3.0 } else { 0.0 };
        assert!(
            gw.iter().chain(&gb).all(|&x| x == want),
            "accumulate {accumulate}"
        );
    }
}
