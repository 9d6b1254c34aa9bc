//! Lookup tables and small scale decoders shared by the formats and the kernels.

/// IQ4_NL / IQ4_XS non-linear 4-bit code book (ggml `kvalues_iq4nl`).
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// MXFP4 e2m1 values, doubled so that they are integers (ggml `kvalues_mxfp4`); pair them
/// with the halved scale of [`e8m0_to_f32_half`].
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half of the value of an E8M0 exponent byte, `2^(e - 128)`, as ggml computes it
/// (`ggml_e8m0_to_fp32_half`): e = 0 and 1 give the f32 subnormals 2^-128 and 2^-127,
/// e = 255 (the OCP NaN code) is treated as a plain exponent, 2^127.
#[inline]
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        ((e as u32) - 1) << 23
    };
    f32::from_bits(bits)
}

/// The 6-bit scale and 6-bit min of sub-block `j` (0..8) of a Q4_K / Q5_K block
/// (ggml `get_scale_min_k4`).
///
/// Packing of the 12 bytes (upper case: scales, lower case: mins, 6 bits each):
/// bytes 0..4 hold scales 0..4 in their low 6 bits and the top 2 bits of scales 4..8;
/// bytes 4..8 likewise for the mins; bytes 8..12 hold the low 4 bits of scale `4+i`
/// (low nibble) and min `4+i` (high nibble).
#[inline]
pub fn get_scale_min_k4(j: usize, scales: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        let sc = (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4);
        let m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
        (sc, m)
    }
}

/// Inverse of [`get_scale_min_k4`]: packs 8 scales and 8 mins (each < 64).
pub fn pack_scale_min_k4(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut out = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            out[j] = sc[j];
            out[j + 4] = m[j];
        } else {
            out[j + 4] = (sc[j] & 0x0f) | ((m[j] & 0x0f) << 4);
            out[j - 4] |= (sc[j] >> 4) << 6;
            out[j] |= (m[j] >> 4) << 6;
        }
    }
    out
}

/// The signed scale (-32..32) of sub-block `i` (0..16) of a Q3_K block.
///
/// Bytes 0..8 hold the low 4 bits (scale `i` in the low nibble of byte `i`, scale `i + 8`
/// in its high nibble); bytes 8..12 hold the high 2 bits, scale `i` at bit `2*(i/4)` of
/// byte `8 + i%4`.
#[inline]
pub fn q3k_scale(i: usize, scales: &[u8; 12]) -> i8 {
    let low = (scales[i % 8] >> (4 * (i / 8))) & 0x0f;
    let high = (scales[8 + i % 4] >> (2 * (i / 4))) & 0x03;
    ((low | (high << 4)) as i8) - 32
}

/// All 16 Q3_K sub-block scales.
#[inline]
pub fn q3k_scales(scales: &[u8; 12]) -> [i8; 16] {
    std::array::from_fn(|i| q3k_scale(i, scales))
}

/// The signed scale (-32..32) of sub-block `ib` (0..8) of an IQ4_XS block.
#[inline]
pub fn iq4xs_scale(ib: usize, scales_h: u16, scales_l: &[u8; 4]) -> i8 {
    let low = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0f;
    let high = ((scales_h >> (2 * ib)) & 0x03) as u8;
    ((low | (high << 4)) as i8) - 32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_min_k4_round_trips() {
        let sc: [u8; 8] = [0, 63, 17, 42, 63, 1, 32, 5];
        let m: [u8; 8] = [63, 0, 33, 9, 48, 62, 3, 31];
        let packed = pack_scale_min_k4(&sc, &m);
        for j in 0..8 {
            assert_eq!(get_scale_min_k4(j, &packed), (sc[j], m[j]), "sub-block {j}");
        }
    }

    #[test]
    fn e8m0_half_values() {
        assert_eq!(e8m0_to_f32_half(127), 0.5);
        assert_eq!(e8m0_to_f32_half(128), 1.0);
        assert_eq!(e8m0_to_f32_half(1), 2.0f32.powi(-127));
        assert_eq!(e8m0_to_f32_half(0), 2.0f32.powi(-128));
        assert_eq!(e8m0_to_f32_half(255), 2.0f32.powi(127));
    }

    #[test]
    fn q3k_scales_unpack() {
        // Scale 9 = low nibble from byte 1's high nibble, high bits from byte 9 bits 4..6.
        let mut s = [0u8; 12];
        s[1] = 0xa0;
        s[9] = 0b0010_0000;
        assert_eq!(q3k_scale(9, &s), (0x0a | (2 << 4)) - 32);
        assert_eq!(q3k_scale(0, &s), -32);
    }
}
