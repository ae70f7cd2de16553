//! Bad input gives Err (never a crash), the message names the argument, and nothing is written.
use fusedce::{
    backward, forward, linear_ce, raw, Backend, BackwardBuffers, Dtype, Error, ForwardBuffers,
    LinearCeBuffers, Options, Status,
};

const ROWS: usize = 3;
const VOCAB: usize = 8;

fn inputs() -> (Vec<f32>, Vec<i64>) {
    let logits = (0..ROWS * VOCAB)
        .map(|i| ((i * 7) % 11) as f32 * 0.3 - 1.0)
        .collect();
    (logits, vec![1, 5, 7])
}

/// linear_ce over ROWS rows of hidden size 4, no bias, targets [0, 1, 2], into `bufs`.
fn small_linear_ce(opts: &Options<'_>, bufs: LinearCeBuffers<'_, f32>) -> fusedce::Result<()> {
    let (h, w) = (vec![0.5f32; ROWS * 4], vec![0.25f32; VOCAB * 4]);
    linear_ce(opts, ROWS, 4, VOCAB, &h, &w, None, &[0i64, 1, 2], bufs)
}

/// Runs forward with `opts`; returns the error and checks the loss was left alone.
fn forward_err(opts: &Options<'_>) -> Error {
    let (logits, targets) = inputs();
    let mut loss = [f32::NAN; ROWS];
    let mut grad = vec![f32::NAN; ROWS * VOCAB];
    let e = forward(
        opts,
        ROWS,
        VOCAB,
        &logits,
        &targets,
        ForwardBuffers::new(&mut loss).grad_logits(&mut grad),
    )
    .expect_err("the call should fail");
    assert!(
        loss.iter().all(|x| x.is_nan()),
        "a failed call wrote the loss"
    );
    assert!(
        grad.iter().all(|x| x.is_nan()),
        "a failed call wrote the gradient"
    );
    e
}

#[test]
fn row_stride_below_vocab_is_an_error_naming_row_stride() {
    let e = forward_err(&Options::new().row_stride(VOCAB as i64 - 1));
    assert_eq!(e.status(), Status::InvalidArgument);
    assert_eq!(e.code(), fusedce::sys::FCE_ERROR_INVALID_ARGUMENT);
    assert!(
        e.message().contains("row_stride"),
        "message: {}",
        e.message()
    );
    let shown = e.to_string();
    assert!(
        shown.contains("row_stride") && shown.contains("FCE_ERROR_INVALID_ARGUMENT"),
        "{shown}"
    );
}

#[test]
fn an_option_is_reported_under_the_call_made_not_its_workspace_query() {
    // The safe calls size their workspace with the fce_*_workspace_size query first; the
    // query's check is reported under the name of the call made.
    let opts = Options::new().label_smoothing(1.5);
    let want = "options->label_smoothing (1.5) must be in [0, 1)";
    let e = forward_err(&opts);
    assert_eq!(e.message(), format!("fce_forward: {want}"), "{e}");
    let (logits, targets) = inputs();
    let lse = [0.0f32; ROWS];
    for (rescale, name) in [(false, "fce_backward"), (true, "fce_backward_rescale")] {
        let mut grad = vec![f32::NAN; ROWS * VOCAB];
        let bufs = BackwardBuffers::new()
            .grad_logits(&mut grad)
            .grad_output(&[0.5]);
        let e = if rescale {
            fusedce::backward_rescale(&opts, ROWS, VOCAB, &logits, &targets, &lse, bufs)
        } else {
            backward(&opts, ROWS, VOCAB, &logits, &targets, &lse, bufs)
        }
        .unwrap_err();
        assert_eq!(e.message(), format!("{name}: {want}"), "{e}");
    }
    let mut loss = [f32::NAN];
    let e = small_linear_ce(&opts, LinearCeBuffers::new(&mut loss)).unwrap_err();
    assert_eq!(e.message(), format!("fce_linear_ce: {want}"), "{e}");
    // the query called on its own keeps its name
    let e = fusedce::forward_workspace_size(&opts, ROWS, VOCAB).unwrap_err();
    assert_eq!(
        e.message(),
        format!("fce_forward_workspace_size: {want}"),
        "{e}"
    );
}

#[test]
fn grad_row_stride_below_vocab() {
    let e = forward_err(&Options::new().grad_row_stride(2));
    assert!(e.message().contains("grad_row_stride"), "{e}");
}

#[test]
fn options_out_of_their_domain_are_named() {
    for (opts, name) in [
        (Options::new().label_smoothing(1.0), "label_smoothing"),
        (Options::new().label_smoothing(-0.1), "label_smoothing"),
        (Options::new().softcap(-1.0), "softcap"),
        (Options::new().z_loss_scale(f32::NAN), "z_loss_scale"),
        (Options::new().logit_scale(f32::INFINITY), "logit_scale"),
        (Options::new().shift_seq_len(2), "shift_seq_len"), // 3 rows are not a multiple of 2
    ] {
        let e = forward_err(&opts);
        assert_eq!(e.status(), Status::InvalidArgument, "{name}: {e}");
        assert!(e.message().contains(name), "{name}: {e}");
    }
}

#[test]
fn short_slices_are_caught_before_the_call() {
    let (logits, targets) = inputs();
    let mut loss = [f32::NAN];
    let e = forward(
        &Options::new(),
        ROWS,
        VOCAB,
        &logits[..ROWS * VOCAB - 1],
        &targets,
        ForwardBuffers::new(&mut loss),
    )
    .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("logits"), "{e}");

    let e = forward(
        &Options::new(),
        ROWS,
        VOCAB,
        &logits,
        &targets[..2],
        ForwardBuffers::new(&mut loss),
    )
    .unwrap_err();
    assert!(e.message().contains("targets"), "{e}");

    // reduction none needs a loss per row
    let opts = Options::new().reduction(fusedce::Reduction::None);
    let e = forward(
        &opts,
        ROWS,
        VOCAB,
        &logits,
        &targets,
        ForwardBuffers::new(&mut loss),
    )
    .unwrap_err();
    assert!(e.message().contains("loss"), "{e}");

    // a strided layout needs the room for it
    let opts = Options::new().row_stride(VOCAB as i64 + 4);
    let e = forward(
        &opts,
        ROWS,
        VOCAB,
        &logits,
        &targets,
        ForwardBuffers::new(&mut loss),
    )
    .unwrap_err();
    assert!(
        e.message().contains("logits") && e.message().contains("row_stride"),
        "{e}"
    );

    let weights = [1.0f32; VOCAB - 1];
    let opts = Options::new().class_weights(&weights);
    let e = forward(
        &opts,
        ROWS,
        VOCAB,
        &logits,
        &targets,
        ForwardBuffers::new(&mut loss),
    )
    .unwrap_err();
    assert!(e.message().contains("class_weights"), "{e}");
    assert!(loss[0].is_nan());
}

#[test]
fn slice_type_must_match_the_dtype() {
    let (logits, targets) = inputs();
    let mut loss = [f32::NAN];
    let e = forward(
        &Options::new().dtype(Dtype::BFloat16),
        ROWS,
        VOCAB,
        &logits,
        &targets,
        ForwardBuffers::new(&mut loss),
    )
    .unwrap_err();
    assert!(
        e.message().contains("BFloat16") && e.message().contains("f32"),
        "{e}"
    );
    let half = vec![0u16; ROWS * VOCAB];
    let e = forward(
        &Options::new(),
        ROWS,
        VOCAB,
        &half,
        &targets,
        ForwardBuffers::new(&mut loss),
    )
    .unwrap_err();
    assert!(e.message().contains("Float32"), "{e}");
}

#[test]
fn backward_needs_a_gradient_buffer() {
    let (logits, targets) = inputs();
    let lse = [0.0f32; ROWS];
    let e = backward(
        &Options::new(),
        ROWS,
        VOCAB,
        &logits,
        &targets,
        &lse,
        BackwardBuffers::<f32>::new(),
    )
    .unwrap_err();
    assert_eq!(e.status(), Status::NullPointer);
    assert!(e.message().contains("grad_logits"), "{e}");
}

#[test]
fn linear_ce_grad_bias_without_bias() {
    let (mut loss, mut gb) = ([f32::NAN], vec![f32::NAN; VOCAB]);
    let e = small_linear_ce(
        &Options::new(),
        LinearCeBuffers::new(&mut loss).grad_bias(&mut gb),
    )
    .unwrap_err();
    assert!(e.message().contains("bias"), "{e}");
    assert!(loss[0].is_nan() && gb.iter().all(|x| x.is_nan()));
}

#[test]
fn raw_calls_report_null_pointers_and_small_workspaces() {
    let (logits, targets) = inputs();
    let opts = Options::new().backend(Backend::Cpu);
    let e = unsafe {
        raw::forward(
            &opts,
            ROWS as i64,
            VOCAB as i64,
            &raw::ForwardArgs {
                logits: logits.as_ptr().cast(),
                targets: targets.as_ptr().cast(),
                ..Default::default()
            },
        )
    }
    .unwrap_err();
    assert_eq!(e.status(), Status::NullPointer);
    assert!(e.message().contains("loss"), "{e}");

    let mut loss = [f32::NAN];
    let e = unsafe {
        raw::forward(
            &opts,
            -1,
            VOCAB as i64,
            &raw::ForwardArgs {
                logits: logits.as_ptr().cast(),
                targets: targets.as_ptr().cast(),
                loss: loss.as_mut_ptr(),
                ..Default::default()
            },
        )
    }
    .unwrap_err();
    assert!(e.message().contains("rows"), "{e}");

    // A workspace one byte short, if this backend wants one for linear_ce.
    let hidden = 4usize;
    let size = fusedce::linear_ce_workspace_size(&opts, ROWS, hidden, VOCAB, false).unwrap();
    if size.min > 0 {
        let (h, w) = (vec![0.5f32; ROWS * hidden], vec![0.25f32; VOCAB * hidden]);
        let mut ws = fusedce::HostWorkspace::with_bytes(size.min);
        let (p, _) = ws.as_raw();
        let e = unsafe {
            raw::linear_ce(
                &opts,
                ROWS as i64,
                hidden as i64,
                VOCAB as i64,
                &raw::LinearCeArgs {
                    hidden_states: h.as_ptr().cast(),
                    weight: w.as_ptr().cast(),
                    targets: targets.as_ptr().cast(),
                    loss: loss.as_mut_ptr(),
                    workspace: p,
                    workspace_bytes: size.min - 1,
                    ..Default::default()
                },
            )
        }
        .unwrap_err();
        assert_eq!(e.status(), Status::WorkspaceTooSmall, "{e}");
        assert!(e.message().contains("workspace"), "{e}");
    }
}

#[test]
fn cuda_backend_without_cuda_is_backend_unavailable() {
    if fusedce::cuda_available() {
        return; // nothing to check on a machine with a GPU
    }
    let e = fusedce::forward_workspace_size(&Options::new().backend(Backend::Cuda), ROWS, VOCAB)
        .unwrap_err();
    assert_eq!(e.status(), Status::BackendUnavailable, "{e}");
}

#[test]
fn error_is_a_std_error() {
    fn boxed() -> Result<(), Box<dyn std::error::Error>> {
        forward_err(&Options::new().row_stride(1));
        let (logits, targets) = inputs();
        let mut loss = [0.0f32];
        forward(
            &Options::new().softcap(-2.0),
            ROWS,
            VOCAB,
            &logits,
            &targets,
            ForwardBuffers::new(&mut loss),
        )?;
        Ok(())
    }
    let e = boxed().unwrap_err();
    assert!(e.to_string().contains("softcap"), "{e}");
    let status = Status::InvalidArgument;
    assert!(
        status
            .description()
            .starts_with("FCE_ERROR_INVALID_ARGUMENT"),
        "{}",
        status.description()
    );
}

#[test]
fn version_and_default_options_match_the_library() {
    fusedce::check_version().unwrap();
    assert_eq!(fusedce::version(), fusedce::HEADER_VERSION);
    let mut c = std::mem::MaybeUninit::<fusedce::sys::fce_options>::zeroed();
    unsafe {
        (*c.as_mut_ptr()).struct_size = std::mem::size_of::<fusedce::sys::fce_options>();
        fusedce::sys::fce_options_default(c.as_mut_ptr());
    }
    let c = unsafe { c.assume_init() };
    let r = *Options::new().as_raw();
    assert_eq!(format!("{c:?}"), format!("{r:?}"));
}

#[test]
fn build_info_names_the_version_and_the_blas() {
    let info = fusedce::build_info();
    let v = fusedce::version();
    let want = format!("fusedce {}.{}.{}", v / 10000, v / 100 % 100, v % 100);
    assert!(info.starts_with(&want), "{info}");
    assert!(info.contains("BLAS: "), "{info}");
}

#[test]
fn options_builder_sets_every_field() {
    let weights = [1.0f32; 4];
    let o = Options::new()
        .class_weights(&weights)
        .ignore_index(-1)
        .row_stride(10)
        .grad_row_stride(11)
        .shift_seq_len(3)
        .hidden_row_stride(12)
        .backend(Backend::Cpu)
        .dtype(Dtype::Float16)
        .target_dtype(fusedce::TargetDtype::Int32)
        .reduction(fusedce::Reduction::Sum)
        .label_smoothing(0.1)
        .z_loss_scale(0.2)
        .softcap(0.3)
        .logit_scale(0.4)
        .deterministic(true)
        .accumulate(true)
        .grad_weight_fp32(true)
        .shift(2)
        .token_scaling(true);
    let r = o.as_raw();
    assert_eq!(r.class_weights, weights.as_ptr());
    assert_eq!(
        (
            r.ignore_index,
            r.row_stride,
            r.grad_row_stride,
            r.shift_seq_len,
            r.hidden_row_stride
        ),
        (-1, 10, 11, 3, 12)
    );
    assert_eq!(r.backend, fusedce::sys::FCE_BACKEND_CPU as i32);
    assert_eq!(r.dtype, fusedce::sys::FCE_FLOAT16 as i32);
    assert_eq!(r.target_dtype, fusedce::sys::FCE_INT32 as i32);
    assert_eq!(r.reduction, fusedce::sys::FCE_REDUCTION_SUM as i32);
    assert_eq!(
        (r.label_smoothing, r.z_loss_scale, r.softcap, r.logit_scale),
        (0.1, 0.2, 0.3, 0.4)
    );
    assert_eq!(
        (
            r.deterministic,
            r.accumulate,
            r.grad_weight_fp32,
            r.vp_entropy
        ),
        (1, 1, 1, 0)
    );
    assert_eq!(
        r.struct_size,
        std::mem::size_of::<fusedce::sys::fce_options>()
    );
    assert_eq!(o.get_reduction(), Some(fusedce::Reduction::Sum));
    assert_eq!(o.get_dtype(), Some(Dtype::Float16));
    assert_eq!(o.get_backend(), Some(Backend::Cpu));
    assert!(o.get_accumulate() && o.get_deterministic() && o.get_grad_weight_fp32());
    assert_eq!((r.shift, r.token_scaling, r.batch_invariant), (2, 1, 0));
    assert_eq!((o.get_shift(), o.get_token_scaling()), (2, true));
}
