//! Small pieces of the ggml block formats that every kernel path shares: value tables,
//! scale-byte unpacking and the half-precision conversions, each written once so the
//! scalar reference and the SIMD paths cannot drift apart.

/// The 16 non-linear 4-bit levels of IQ4_NL and IQ4_XS.
pub(crate) const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// MXFP4 (e2m1) levels, doubled so they are integers; the block scale is halved to compensate.
pub(crate) const KVALUES_MXFP4: [i8; 16] =
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

#[inline]
pub(crate) fn f16_bits_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

#[inline]
pub(crate) fn read_f16(bytes: &[u8], at: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

#[inline]
pub(crate) fn read_f32(bytes: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

#[inline]
pub(crate) fn read_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Round to the nearest f16 (ties to even) and back, as ggml stores its f16 block scales.
#[inline]
pub(crate) fn round_to_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// Round to the nearest bf16 (ties to even, NaN kept quiet) and back, as ggml converts
/// activations for BF16 weights.
#[inline]
pub(crate) fn round_to_bf16(x: f32) -> f32 {
    let u = x.to_bits();
    let b = if x.is_nan() {
        (u >> 16) | 64
    } else {
        (u.wrapping_add(0x7fff + ((u >> 16) & 1))) >> 16
    };
    f32::from_bits(b << 16)
}

#[inline]
pub(crate) fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Half of the E8M0 scale 2^(e-127), i.e. 2^(e-128), computed through the bit pattern
/// (subnormal for e < 2) exactly as ggml does, so e = 0 and e = 255 behave like ggml.
#[inline]
pub(crate) fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        ((e as u32) - 1) << 23
    };
    f32::from_bits(bits)
}

/// The eight 6-bit (scale, min) pairs of a Q4_K / Q5_K block from its 12 packed bytes.
#[inline]
pub(crate) fn k4_scales_mins(packed: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = packed[j] & 63;
        mn[j] = packed[j + 4] & 63;
    }
    for j in 4..8 {
        sc[j] = (packed[j + 4] & 0x0f) | ((packed[j - 4] >> 6) << 4);
        mn[j] = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
    }
    (sc, mn)
}

/// `k4_scales_mins` with 32-bit operations: (scales, mins) as 8 bytes each, little-endian
/// (byte j = sub-block j).
#[inline]
pub(crate) fn k4_scales_mins_packed(packed: &[u8]) -> (u64, u64) {
    let a0 = read_u32(packed, 0);
    let a1 = read_u32(packed, 4);
    let a2 = read_u32(packed, 8);
    let low6 = 0x3f3f_3f3f;
    let nib = 0x0f0f_0f0f;
    let top2 = 0x0303_0303;
    let sc_lo = a0 & low6;
    let mn_lo = a1 & low6;
    let sc_hi = (a2 & nib) | (((a0 >> 6) & top2) << 4);
    let mn_hi = ((a2 >> 4) & nib) | (((a1 >> 6) & top2) << 4);
    (
        sc_lo as u64 | (sc_hi as u64) << 32,
        mn_lo as u64 | (mn_hi as u64) << 32,
    )
}

/// `q3k_scales` with 32-bit operations: the sixteen 6-bit scales, not yet offset by -32,
/// as 16 bytes in sub-block order.
#[inline]
pub(crate) fn q3k_scales_packed(packed: &[u8]) -> [u8; 16] {
    let a0 = read_u32(packed, 0);
    let a1 = read_u32(packed, 4);
    let a2 = read_u32(packed, 8);
    let nib = 0x0f0f_0f0f;
    let two = 0x0303_0303;
    let words = [
        (a0 & nib) | ((a2 & two) << 4),
        (a1 & nib) | (((a2 >> 2) & two) << 4),
        ((a0 >> 4) & nib) | (((a2 >> 4) & two) << 4),
        ((a1 >> 4) & nib) | (((a2 >> 6) & two) << 4),
    ];
    let mut out = [0u8; 16];
    for (o, w) in out.chunks_exact_mut(4).zip(words) {
        o.copy_from_slice(&w.to_le_bytes());
    }
    out
}

/// The sixteen signed 6-bit scales of a Q3_K block (already offset by -32).
#[inline]
pub(crate) fn q3k_scales(packed: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 {
            packed[j] & 0x0f
        } else {
            packed[j - 8] >> 4
        };
        let high = (packed[8 + (j % 4)] >> (2 * (j / 4))) & 3;
        *o = ((low | (high << 4)) as i8) - 32;
    }
    out
}

/// The eight signed 6-bit sub-block scales of an IQ4_XS block (already offset by -32).
#[inline]
pub(crate) fn iq4xs_scales(scales_h: u16, scales_l: &[u8]) -> [i8; 8] {
    let mut out = [0i8; 8];
    for (ib, o) in out.iter_mut().enumerate() {
        let low = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0f;
        let high = ((scales_h >> (2 * ib)) & 3) as u8;
        *o = ((low | (high << 4)) as i8) - 32;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e8m0_half_is_power_of_two() {
        for e in 0..=254u8 {
            let want = 2f64.powi(e as i32 - 128);
            assert_eq!(e8m0_to_f32_half(e) as f64, want, "e = {e}");
        }
    }

    #[test]
    fn bf16_rounding_ties_to_even() {
        // 1 + 2^-8 lies exactly between two bf16 values; the even one is 1.0.
        assert_eq!(round_to_bf16(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(round_to_bf16(1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0);
        assert!(round_to_bf16(f32::NAN).is_nan());
        assert_eq!(round_to_bf16(-2.5), -2.5);
    }

    #[test]
    fn k4_scale_unpacking_matches_bit_layout() {
        // Scale j < 4 in the low 6 bits of byte j; j >= 4 split over byte j+4 (low nibble)
        // and the top two bits of byte j-4.
        let mut packed = [0u8; 12];
        packed[0] = 0b11_000101; // sc0 = 5, top bits of sc4 = 3
        packed[4] = 0b10_000111; // mn0 = 7, top bits of mn4 = 2
        packed[8] = 0x9a; // sc4 low nibble 0xa, mn4 low nibble 0x9
        let (sc, mn) = k4_scales_mins(&packed);
        assert_eq!(sc[0], 5);
        assert_eq!(mn[0], 7);
        assert_eq!(sc[4], 0x3a);
        assert_eq!(mn[4], 0x29);
    }

    #[test]
    fn k4_packed_unpacking_agrees_with_bytewise() {
        let mut state = 0x1234_5678u32;
        for _ in 0..1000 {
            let mut packed = [0u8; 12];
            for b in packed.iter_mut() {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                *b = (state >> 24) as u8;
            }
            let (sc, mn) = k4_scales_mins(&packed);
            let (psc, pmn) = k4_scales_mins_packed(&packed);
            assert_eq!(psc.to_le_bytes(), sc);
            assert_eq!(pmn.to_le_bytes(), mn);
        }
    }

    #[test]
    fn q3k_packed_unpacking_agrees_with_bytewise() {
        let mut state = 0x8765_4321u32;
        for _ in 0..1000 {
            let mut packed = [0u8; 12];
            for b in packed.iter_mut() {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                *b = (state >> 24) as u8;
            }
            let want = q3k_scales(&packed);
            let got = q3k_scales_packed(&packed).map(|v| v as i8 - 32);
            assert_eq!(got, want);
        }
    }

    #[test]
    fn q3k_scales_cover_full_range() {
        let packed = [0xffu8; 12];
        assert_eq!(q3k_scales(&packed), [31i8; 16]);
        let packed = [0u8; 12];
        assert_eq!(q3k_scales(&packed), [-32i8; 16]);
    }
}
