//! fusedce::scale_gradient (and raw::scale_gradient) on the CPU backend: every element equals
//! the float64 product rounded once to the dtype, a scale of exactly 1 changes no bit, and bad
//! arguments come back as errors naming fce_scale_gradient and the argument, nothing written.
mod common;

use common::Rng;
use fusedce::bits::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use fusedce::{raw, scale_gradient, Backend, Dtype, Status};
use std::ffi::c_void;
use std::ptr;

/// Gradient-like values over many binades, with the corner values among them: zeros of both
/// signs, infinities, a quiet and a signalling NaN, the largest finite value, subnormals.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let specials = [
        0.0f32,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x7f80_0001), // signalling NaN
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::from_bits(1), // smallest subnormal
        1.0,
    ];
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|i| {
            if i % 11 == 3 {
                specials[rng.below(specials.len())]
            } else {
                let x = (2f64).powf(-30.0 + 36.0 * rng.uniform()) as f32;
                if rng.uniform() < 0.5 {
                    -x
                } else {
                    x
                }
            }
        })
        .collect()
}

/// The float64 product rounded once to float32. (For the 16-bit checks below it is exact in
/// float32 already: an 8- or 11-bit significand times 2.5's 3 bits, so converting it to the
/// 16-bit type is the one rounding.)
fn product(x: f32, g: f32) -> f32 {
    (x as f64 * g as f64) as f32
}

fn same(got: f32, want: f32) -> bool {
    (got.is_nan() && want.is_nan()) || got.to_bits() == want.to_bits()
}

#[test]
fn f32_scaled_by_2_5_matches_the_rounded_product() {
    // Long enough for the CPU backend to split it over threads.
    let x = values(200_003, 1);
    let mut grad = x.clone();
    scale_gradient(Dtype::Float32, &mut grad, 2.5).expect("scale_gradient");
    for (i, (&g, &x)) in grad.iter().zip(&x).enumerate() {
        assert!(same(g, product(x, 2.5)), "[{i}] {x} * 2.5: got {g}");
    }
}

#[test]
fn bf16_and_f16_scaled_by_2_5_match_the_rounded_product() {
    let x = values(10_007, 2);
    for (dtype, to, from) in [
        (
            Dtype::BFloat16,
            f32_to_bf16 as fn(f32) -> u16,
            bf16_to_f32 as fn(u16) -> f32,
        ),
        (Dtype::Float16, f32_to_f16, f16_to_f32),
    ] {
        let bits: Vec<u16> = x.iter().map(|&v| to(v)).collect();
        let mut grad = bits.clone();
        scale_gradient(dtype, &mut grad, 2.5).expect("scale_gradient");
        for (i, (&g, &b)) in grad.iter().zip(&bits).enumerate() {
            let want = to(product(from(b), 2.5));
            let ok = if from(want).is_nan() {
                from(g).is_nan()
            } else {
                g == want
            };
            assert!(
                ok,
                "{dtype:?} [{i}] {} * 2.5: got {:#06x}, expected {want:#06x}",
                from(b),
                g
            );
        }
    }
}

#[test]
fn a_scale_of_exactly_one_changes_no_bit() {
    let x = values(1_001, 3);
    let mut grad = x.clone();
    scale_gradient(Dtype::Float32, &mut grad, 1.0).expect("f32");
    assert!(
        grad.iter().zip(&x).all(|(a, b)| a.to_bits() == b.to_bits()),
        "f32 changed"
    );
    let mut bits: Vec<u16> = x.iter().map(|&v| f32_to_bf16(v)).collect();
    bits.push(0x7f81); // a signalling bfloat16 NaN: a multiplication would quiet it
    let before = bits.clone();
    scale_gradient(Dtype::BFloat16, &mut bits, 1.0).expect("bf16");
    assert_eq!(bits, before, "bf16 changed");
}

#[test]
fn an_empty_slice_is_fine() {
    let mut grad: Vec<f32> = Vec::new();
    scale_gradient(Dtype::Float32, &mut grad, 3.0).expect("empty");
    // count 0 with a null grad, through the raw call
    let g = 3.0f32;
    unsafe {
        raw::scale_gradient(
            Backend::Cpu,
            Dtype::Float32,
            0,
            ptr::null_mut(),
            &g,
            ptr::null_mut(),
        )
    }
    .expect("count 0, grad null");
}

#[test]
fn slice_type_must_match_the_dtype() {
    let mut grad = vec![1.0f32; 4];
    let e = scale_gradient(Dtype::BFloat16, &mut grad, 2.0).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().starts_with("fusedce::scale_gradient"), "{e}");
    assert!(e.message().contains("u16"), "{e}");
    assert_eq!(grad, [1.0; 4], "a rejected call wrote");
}

#[test]
fn bad_arguments_name_fce_scale_gradient_and_the_argument() {
    let mut buf = [1.5f32; 9];
    let g = 2.0f32;
    let p: *mut c_void = buf.as_mut_ptr().cast();
    let cases: [(&str, Status, &str, i64, *mut c_void, *const f32); 5] = [
        (
            "grad null",
            Status::NullPointer,
            "grad",
            8,
            ptr::null_mut(),
            &g,
        ),
        (
            "grad_output null",
            Status::NullPointer,
            "grad_output",
            8,
            p,
            ptr::null(),
        ),
        ("count -1", Status::InvalidArgument, "count", -1, p, &g),
        // one byte past a float: not aligned to 4
        (
            "grad misaligned",
            Status::Misaligned,
            "grad",
            8,
            unsafe { p.cast::<u8>().add(1) }.cast(),
            &g,
        ),
        // the scalar inside the span
        (
            "grad_output inside grad",
            Status::InvalidArgument,
            "grad_output",
            8,
            p,
            unsafe { buf.as_ptr().add(2) },
        ),
    ];
    for (what, status, name, count, grad, grad_output) in cases {
        let e = unsafe {
            raw::scale_gradient(
                Backend::Cpu,
                Dtype::Float32,
                count,
                grad,
                grad_output,
                ptr::null_mut(),
            )
        }
        .expect_err(what);
        assert_eq!(e.status(), status, "{what}: {e}");
        assert!(e.message().contains("fce_scale_gradient"), "{what}: {e}");
        assert!(e.message().contains(name), "{what}: {e}");
        assert_eq!(buf, [1.5; 9], "{what}: a rejected call wrote");
    }
}

#[test]
fn cuda_backend_without_cuda_is_backend_unavailable() {
    if fusedce::cuda_available() {
        return; // host pointers on a real device are another matter (the C tests cover it)
    }
    let mut buf = [1.0f32; 4];
    let g = 2.0f32;
    let e = unsafe {
        raw::scale_gradient(
            Backend::Cuda,
            Dtype::Float32,
            4,
            buf.as_mut_ptr().cast(),
            &g,
            ptr::null_mut(),
        )
    }
    .unwrap_err();
    assert_eq!(e.status(), Status::BackendUnavailable, "{e}");
    assert!(e.message().contains("fce_scale_gradient"), "{e}");
    assert_eq!(buf, [1.0; 4]);
}
