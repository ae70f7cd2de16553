//! float32 ⇄ bfloat16 / float16 bit patterns (`u16`), for the half-precision host calls.
//! Conversions to the narrow types round to nearest, ties to even, as torch does; NaN stays NaN.

/// The bfloat16 nearest to `x`, as bits.
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x0040; // keep it a (quiet) NaN
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// The float32 value of bfloat16 bits (exact).
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// The float16 nearest to `x`, as bits (overflow gives ±inf).
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let abs = b & 0x7fff_ffff;
    if abs >= 0x7f80_0000 {
        // inf, or NaN with its top payload bits and the quiet bit
        let nan = if abs > 0x7f80_0000 {
            0x0200 | ((abs >> 13) & 0x3ff) as u16
        } else {
            0
        };
        return sign | 0x7c00 | nan;
    }
    let exp = (abs >> 23) as i32 - 127;
    if exp > 15 {
        return sign | 0x7c00;
    }
    if exp >= -14 {
        // normal: 10 mantissa bits kept, 13 rounded away; a carry may reach inf, correctly
        let mant = abs & 0x7f_ffff;
        let mut h = (((exp + 15) as u32) << 10) | (mant >> 13);
        let rest = mant & 0x1fff;
        if rest > 0x1000 || (rest == 0x1000 && (h & 1) == 1) {
            h += 1;
        }
        return sign | h as u16;
    }
    if exp < -25 {
        return sign; // below half the smallest subnormal: ±0
    }
    // subnormal: value = m · 2^-24, m = (1.mant) · 2^(exp+24) = mant24 >> (-exp - 1)
    let mant = (abs & 0x7f_ffff) | 0x80_0000;
    let shift = (-exp - 1) as u32; // 14..=24
    let mut m = mant >> shift;
    let rest = mant & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    if rest > half || (rest == half && (m & 1) == 1) {
        m += 1;
    }
    sign | m as u16
}

/// The float32 value of float16 bits (exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let mant = (h & 0x3ff) as u32;
    let bits = match exp {
        0 => {
            // zero or subnormal: mant · 2^-24, exact in f32
            let v = mant as f32 * f32::from_bits(0x3380_0000); // 2^-24
            return f32::from_bits(sign | v.to_bits());
        }
        31 => sign | 0x7f80_0000 | (mant << 13),
        _ => sign | ((exp + 112) << 23) | (mant << 13),
    };
    f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_known_values() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(-2.0), 0xc000);
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even (1) wins; just above rounds up.
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
    }

    #[test]
    fn f16_known_values() {
        assert_eq!(f32_to_f16(1.0), 0x3c00);
        assert_eq!(f32_to_f16(-2.0), 0xc000);
        assert_eq!(f32_to_f16(65504.0), 0x7bff);
        assert_eq!(f32_to_f16(65520.0), 0x7c00); // rounds to inf
        assert_eq!(f32_to_f16(65519.0), 0x7bff);
        assert_eq!(f32_to_f16(2f32.powi(-24)), 0x0001);
        assert_eq!(f32_to_f16(2f32.powi(-25)), 0x0000); // tie to even: 0
        assert_eq!(f32_to_f16(1.5 * 2f32.powi(-25)), 0x0001);
        assert_eq!(f32_to_f16(2f32.powi(-14)), 0x0400);
        assert_eq!(f32_to_f16(1.0 + 1.0 / 2048.0), 0x3c00); // tie, even
        assert_eq!(f32_to_f16(1.0 + 3.0 / 2048.0), 0x3c02); // tie, even is up
        assert!(f16_to_f32(f32_to_f16(f32::NAN)).is_nan());
        assert_eq!(f32_to_f16(f32::NEG_INFINITY), 0xfc00);
    }

    #[test]
    fn f16_round_trips_every_finite_value() {
        for h in 0..=u16::MAX {
            let x = f16_to_f32(h);
            if x.is_nan() {
                continue;
            }
            assert_eq!(f32_to_f16(x), h, "bits {h:#06x} value {x}");
        }
    }

    #[test]
    fn bf16_round_trips_every_finite_value() {
        for h in 0..=u16::MAX {
            let x = bf16_to_f32(h);
            if x.is_nan() {
                continue;
            }
            assert_eq!(f32_to_bf16(x), h);
        }
    }
}
