//! Plain float types (F32, F16, BF16) and the scalar conversions the block formats use.
//!
//! The f16 conversions reproduce numpy's (`npy_halfbits_to_floatbits` /
//! `npy_floatbits_to_halfbits`) bit for bit, NaN payloads included: the reference vectors
//! come from numpy, and hardware F16C would quiet signalling NaNs where numpy does not.
//! On every non-NaN value they agree with IEEE round-to-nearest-even (and so with F16C).

/// f16 bits to f32 (exact; NaN payload kept, signalling NaNs stay signalling).
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    // Move exponent and mantissa into f32 position and rebias. Infinities/NaNs need the
    // exponent forced to all-ones; subnormals come out as 2^-14 * (1 + m/1024) and an exact
    // subtraction of 2^-14 leaves m * 2^-24 (no subnormal operands, so no slow path).
    const SHIFTED_EXP: u32 = 0x7c00 << 13;
    let mut bits = ((h & 0x7fff) as u32) << 13;
    let exp = bits & SHIFTED_EXP;
    bits += (127 - 15) << 23;
    let magnitude = if exp == SHIFTED_EXP {
        f32::from_bits(bits + ((128 - 16) << 23))
    } else if exp == 0 {
        f32::from_bits(bits + (1 << 23)) - f32::from_bits(113 << 23)
    } else {
        f32::from_bits(bits)
    };
    f32::from_bits(magnitude.to_bits() | ((h & 0x8000) as u32) << 16)
}

/// f32 to f16 bits, rounding to nearest even; overflow gives infinity, NaN stays NaN.
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    let f = x.to_bits();
    let sign = ((f >> 16) & 0x8000) as u16;
    let exp = f & 0x7f80_0000;
    if exp >= 0x4780_0000 {
        // Infinity, NaN, or too large for f16.
        if exp == 0x7f80_0000 {
            let man = f & 0x007f_ffff;
            if man != 0 {
                // Keep the top mantissa bits; a payload that vanishes must still be a NaN.
                let h = 0x7c00 | (man >> 13) as u16;
                return sign | if h == 0x7c00 { 0x7c01 } else { h };
            }
        }
        return sign | 0x7c00;
    }
    if exp <= 0x3800_0000 {
        // Below the f16 normal range: subnormal result or zero.
        if exp < 0x3300_0000 {
            return sign;
        }
        let e = exp >> 23;
        let man = 0x0080_0000 + (f & 0x007f_ffff);
        // Bits that fall off the end decide the rounding; sticky bits beyond them only
        // matter for exact ties.
        let shift = 126 - e; // 14..=24 more than the normal shift of 13
        let sticky = man & ((1u32 << (shift - 1)) - 1) != 0;
        let mut m = man >> (shift - 1);
        let round = m & 1;
        m >>= 1;
        if round == 1 && (sticky || (m & 1) == 1) {
            m += 1;
        }
        return sign | m as u16;
    }
    let e = ((exp - 0x3800_0000) >> 13) as u16;
    let man = f & 0x007f_ffff;
    let mut h = e + (man >> 13) as u16;
    let rest = man & 0x1fff;
    if rest > 0x1000 || (rest == 0x1000 && (h & 1) == 1) {
        // A carry out of the mantissa correctly bumps the exponent (up to infinity).
        h += 1;
    }
    sign | h
}

/// bf16 bits to f32 (exact).
#[inline]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// f32 to bf16 bits as ggml does: NaNs become quiet (payload truncated), others round to
/// nearest even (overflow to infinity).
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let n = x.to_bits();
    if n & 0x7fff_ffff > 0x7f80_0000 {
        return ((n >> 16) | 0x0040) as u16;
    }
    ((n as u64 + 0x7fff + ((n >> 16) & 1) as u64) >> 16) as u16
}

/// F32 rows: bytes are little-endian f32.
pub(crate) fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
}

pub(crate) fn quantize_f32(src: &[f32], dst: &mut [u8]) {
    for (d, s) in dst.chunks_exact_mut(4).zip(src) {
        d.copy_from_slice(&s.to_le_bytes());
    }
}

pub(crate) fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f16_to_f32(u16::from_le_bytes([s[0], s[1]]));
    }
}

pub(crate) fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    for (d, s) in dst.chunks_exact_mut(2).zip(src) {
        d.copy_from_slice(&f32_to_f16(*s).to_le_bytes());
    }
}

pub(crate) fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = bf16_to_f32(u16::from_le_bytes([s[0], s[1]]));
    }
}

pub(crate) fn quantize_bf16(src: &[f32], dst: &mut [u8]) {
    for (d, s) in dst.chunks_exact_mut(2).zip(src) {
        d.copy_from_slice(&f32_to_bf16(*s).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_round_trips_every_non_nan_value() {
        for h in 0..=u16::MAX {
            let f = f16_to_f32(h);
            if f.is_nan() {
                assert_eq!(f32_to_f16(f), h, "NaN {h:#06x} payload kept");
                continue;
            }
            assert_eq!(f32_to_f16(f), h, "{h:#06x} -> {f}");
            // Agrees with the half crate (IEEE) on every non-NaN value.
            assert_eq!(
                f.to_bits(),
                half::f16::from_bits(h).to_f32().to_bits(),
                "{h:#06x}"
            );
        }
    }

    #[test]
    fn f32_to_f16_rounds_like_ieee() {
        // Sweep f32 bit patterns with a stride that visits every exponent and many mantissas.
        let mut bits: u32 = 0;
        while bits < 0x7f80_0000 {
            for sign in [0u32, 0x8000_0000] {
                let x = f32::from_bits(bits | sign);
                assert_eq!(
                    f32_to_f16(x),
                    half::f16::from_f32(x).to_bits(),
                    "{:#010x}",
                    bits | sign
                );
            }
            bits += 0x0000_0fff;
        }
        // Exact ties around the subnormal and normal boundaries.
        for x in [
            2.0f32.powi(-25),
            3.0 * 2.0f32.powi(-25),
            65520.0,
            65519.99,
            2.0f32.powi(-14) * (1.0 + 2.0f32.powi(-11)),
        ] {
            assert_eq!(f32_to_f16(x), half::f16::from_f32(x).to_bits(), "{x:e}");
        }
    }

    #[test]
    fn nan_conversions_follow_numpy() {
        assert_eq!(f16_to_f32(0x7c01).to_bits(), 0x7f80_2000);
        assert_eq!(f16_to_f32(0xfc01).to_bits(), 0xff80_2000);
        assert_eq!(f32_to_f16(f32::from_bits(0x7f80_0001)), 0x7c01);
        assert_eq!(f32_to_f16(f32::from_bits(0xff80_0001)), 0xfc01);
        assert_eq!(f32_to_f16(f32::from_bits(0x7fc0_0000)), 0x7e00);
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0);
        assert_eq!(f32_to_bf16(f32::from_bits(0xffff_ffff)), 0xffff);
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80); // tie, even stays
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82); // tie, odd rounds up
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80);
        assert_eq!(bf16_to_f32(0xc000), -2.0);
    }
}
