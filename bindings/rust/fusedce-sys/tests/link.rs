//! Links against libfusedce and calls the functions that need no buffers: proves build.rs found
//! the library and that the committed bindings agree with it.
use fusedce_sys::*;
use std::ffi::CStr;

#[test]
fn library_version_matches_the_bindings() {
    let v = unsafe { fce_version() };
    assert_eq!(
        v, FCE_VERSION_NUMBER,
        "libfusedce {v} vs bindings {FCE_VERSION_NUMBER}"
    );
    assert_eq!(
        FCE_VERSION_NUMBER,
        FCE_VERSION_MAJOR * 10000 + FCE_VERSION_MINOR * 100 + FCE_VERSION_PATCH
    );
}

#[test]
fn options_default_matches_the_header_initialiser() {
    // struct_size first (0 would mean a 0.1 caller's struct: the 0.3 fields left as they are)
    let mut o = std::mem::MaybeUninit::<fce_options>::zeroed();
    unsafe {
        (*o.as_mut_ptr()).struct_size = std::mem::size_of::<fce_options>();
        fce_options_default(o.as_mut_ptr());
    }
    let o = unsafe { o.assume_init() };
    assert_eq!(o.struct_size, std::mem::size_of::<fce_options>());
    assert!(o.class_weights.is_null());
    assert_eq!(o.ignore_index, -100);
    assert_eq!(
        (
            o.row_stride,
            o.grad_row_stride,
            o.shift_seq_len,
            o.hidden_row_stride
        ),
        (0, 0, 0, 0)
    );
    assert_eq!(o.backend, FCE_BACKEND_CUDA as i32);
    assert_eq!(o.dtype, FCE_FLOAT32 as i32);
    assert_eq!(o.target_dtype, FCE_INT64 as i32);
    assert_eq!(o.reduction, FCE_REDUCTION_MEAN as i32);
    assert_eq!(
        (o.label_smoothing, o.z_loss_scale, o.softcap, o.logit_scale),
        (0.0, 0.0, 0.0, 1.0)
    );
    assert_eq!(
        (
            o.deterministic,
            o.accumulate,
            o.grad_weight_fp32,
            o.vp_entropy
        ),
        (0, 0, 0, 0)
    );
    assert_eq!(o.shift, 0);
    assert_eq!((o.token_scaling, o.batch_invariant), (0, 0));
}

#[test]
fn struct_sizes_of_version_1_0() {
    assert_eq!(
        std::mem::size_of::<fce_options>(),
        FCE_OPTIONS_SIZE_V1_0 as usize
    );
    assert_eq!(
        std::mem::size_of::<fce_outputs>(),
        FCE_OUTPUTS_SIZE_V1_0 as usize
    );
    assert_eq!(
        std::mem::size_of::<fce_gradients>(),
        FCE_GRADIENTS_SIZE_V1_0 as usize
    );
    // A caller that knows only struct_size and class_weights: nothing past them is written.
    let size = std::mem::size_of::<fce_options>();
    let known = 16usize;
    let mut words = vec![0xa5a5_a5a5_a5a5_a5a5u64; size / 8]; // 8-aligned, as fce_options
    words[0] = known as u64; // struct_size
    unsafe { fce_options_default(words.as_mut_ptr().cast()) };
    let after: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    assert!(
        after[known..].iter().all(|&b| b == 0xa5),
        "fce_options_default wrote past struct_size {known}"
    );
}

#[test]
fn status_strings_and_last_error() {
    for s in FCE_SUCCESS..=FCE_ERROR_INTERNAL {
        let p = unsafe { fce_status_string(s) };
        assert!(!p.is_null());
        let text = unsafe { CStr::from_ptr(p) }.to_str().unwrap();
        assert!(text.starts_with("FCE_"), "status {s}: {text:?}");
    }
    // A failing query leaves a message that names the bad argument.
    let mut bytes = 0usize;
    let s = unsafe { fce_forward_workspace_size(std::ptr::null(), 4, 8, &mut bytes) };
    assert_eq!(s, FCE_ERROR_NULL_POINTER);
    let msg = unsafe { CStr::from_ptr(fce_last_error()) }
        .to_string_lossy()
        .into_owned();
    assert!(msg.contains("options"), "{msg:?}");
}

#[test]
fn cuda_available_is_a_boolean() {
    let a = unsafe { fce_cuda_available() };
    assert!(a == 0 || a == 1);
}

/// With the `bundled` feature the library this process runs is the one build.rs built in
/// OUT_DIR, not an installed one (and not the FUSEDCE_LIB_DIR of another build).
#[cfg(all(feature = "bundled", target_os = "linux"))]
#[test]
fn bundled_library_is_the_one_loaded() {
    let _ = unsafe { fce_version() }; // the library is mapped by now
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
    let loaded: Vec<&str> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|p| p.contains("libfusedce.so"))
        .collect();
    let out_dir = env!("OUT_DIR");
    assert!(
        !loaded.is_empty() && loaded.iter().all(|p| p.starts_with(out_dir)),
        "libfusedce mapped from {loaded:?}, not from {out_dir}"
    );
}
