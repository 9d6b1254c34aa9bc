//! AVX2 versions of the activation conversions in `act`, bit-identical to the scalar
//! code there (same IEEE operations per element, same rounding rules), only faster.

use core::arch::x86_64::*;

use super::super::act::BlockSums;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn abs_ps(v: __m256) -> __m256 {
    _mm256_andnot_ps(_mm256_set1_ps(-0.0), v)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hmax_ps(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_movehdup_ps(m));
    _mm_cvtss_f32(m)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

/// Four vectors of 8 i32 to 32 saturated i8, in element order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_i8(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> __m256i {
    let ab = _mm256_packs_epi32(a, b);
    let cd = _mm256_packs_epi32(c, d);
    let abcd = _mm256_packs_epi16(ab, cd);
    // The packs interleave 128-bit lanes: dwords come out as a0 b0 c0 d0 a1 b1 c1 d1.
    _mm256_permutevar8x32_epi32(abcd, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// As `act::quantize_q8_0_row`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_0_row(
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    mut sums: BlockSums,
) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `x`, `qs`, `d` have the lengths the callers
    // size them to (debug-asserted below), so the pointer reads and writes stay inside them.
    unsafe {
        debug_assert!(x.len() == qs.len() && x.len() == 32 * d.len());
        for b in 0..d.len() {
            let p = x.as_ptr().add(32 * b);
            let v: [__m256; 4] = core::array::from_fn(|k| _mm256_loadu_ps(p.add(8 * k)));
            let m = _mm256_max_ps(
                _mm256_max_ps(abs_ps(v[0]), abs_ps(v[1])),
                _mm256_max_ps(abs_ps(v[2]), abs_ps(v[3])),
            );
            let amax = hmax_ps(m);
            let scale = amax / 127.0;
            let inv = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let inv_v = _mm256_set1_ps(inv);
            let q: [__m256i; 4] = core::array::from_fn(|k| {
                _mm256_cvtps_epi32(_mm256_round_ps(
                    _mm256_mul_ps(v[k], inv_v),
                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
                ))
            });
            let packed = pack_i8(q[0], q[1], q[2], q[3]);
            _mm256_storeu_si256(qs.as_mut_ptr().add(32 * b) as *mut __m256i, packed);
            // Sum the saturated i8 values, as the scalar code does.
            let widened = _mm256_madd_epi16(
                _mm256_maddubs_epi16(_mm256_set1_epi8(1), packed),
                _mm256_set1_epi16(1),
            );
            let sum = hsum_epi32(widened);
            d[b] = super::super::tables::round_to_f16(scale);
            match &mut sums {
                BlockSums::Q8_1(s) => s[b] = super::super::tables::round_to_f16(sum as f32 * scale),
                BlockSums::Exact(s) => s[b] = sum as f32 * d[b],
            }
        }
    }
}

/// As `act::quantize_q8k_row`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8k_row(x: &[f32], qs: &mut [i8], d: &mut [f32], bsums: &mut [i16]) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `x`, `qs`, `d`, `bsums` have the lengths the
    // callers size them to (debug-asserted below), so the pointer reads and writes stay inside
    // them.
    unsafe {
        debug_assert!(
            x.len() == qs.len() && x.len() == 256 * d.len() && bsums.len() == 16 * d.len()
        );
        for b in 0..d.len() {
            let xb = &x[256 * b..256 * b + 256];
            let p = xb.as_ptr();
            let mut m = _mm256_setzero_ps();
            for k in 0..32 {
                m = _mm256_max_ps(m, abs_ps(_mm256_loadu_ps(p.add(8 * k))));
            }
            let amax = hmax_ps(m);
            let sums = &mut bsums[16 * b..16 * b + 16];
            if amax == 0.0 {
                d[b] = 0.0;
                qs[256 * b..256 * b + 256].fill(0);
                sums.fill(0);
                continue;
            }
            // The scalar scan keeps the first value of largest magnitude.
            let max = xb.iter().copied().find(|v| v.abs() == amax).unwrap_or(amax);
            let iscale = -127.0 / max;
            let iv = _mm256_set1_ps(iscale);
            let cap = _mm256_set1_epi32(127);
            let ones8 = _mm256_set1_epi8(1);
            let ones16 = _mm256_set1_epi16(1);
            for c in 0..8 {
                let q: [__m256i; 4] = core::array::from_fn(|k| {
                    let r = _mm256_round_ps(
                        _mm256_mul_ps(iv, _mm256_loadu_ps(p.add(32 * c + 8 * k))),
                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
                    );
                    _mm256_min_epi32(_mm256_cvtps_epi32(r), cap)
                });
                let packed = pack_i8(q[0], q[1], q[2], q[3]);
                _mm256_storeu_si256(
                    qs.as_mut_ptr().add(256 * b + 32 * c) as *mut __m256i,
                    packed,
                );
                // i32 lanes 0..4 hold the sum of values 0..16, lanes 4..8 of values 16..32.
                let quads = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, packed), ones16);
                let lo = _mm256_castsi256_si128(quads);
                let hi = _mm256_extracti128_si256(quads, 1);
                for (g, half) in [lo, hi].into_iter().enumerate() {
                    let s = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0b01_00_11_10));
                    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
                    sums[2 * c + g] = _mm_cvtsi128_si32(s) as i16;
                }
            }
            d[b] = 1.0 / iscale;
        }
    }
}

/// Round every value to f16 (`bf16` false) or bf16 and back, as `tables::round_to_f16` /
/// `round_to_bf16`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn round_row(x: &[f32], out: &mut [f32], bf16: bool) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `x`, `out` have the lengths the callers size
    // them to (debug-asserted below), so the pointer reads and writes stay inside them.
    unsafe {
        debug_assert_eq!(x.len(), out.len());
        let n = x.len();
        let (src, dst) = (x.as_ptr(), out.as_mut_ptr());
        let mut j = 0;
        while j + 8 <= n {
            let v = _mm256_loadu_ps(src.add(j));
            let r = if bf16 {
                let u = _mm256_castps_si256(v);
                let lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
                let rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
                let high = _mm256_set1_epi32(0xffff_0000u32 as i32);
                let quiet_nan =
                    _mm256_or_si256(_mm256_and_si256(u, high), _mm256_set1_epi32(0x0040_0000));
                let nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                let bits = _mm256_blendv_epi8(_mm256_and_si256(rounded, high), quiet_nan, nan);
                _mm256_castsi256_ps(bits)
            } else {
                _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT))
            };
            _mm256_storeu_ps(dst.add(j), r);
            j += 8;
        }
        let round = if bf16 {
            super::super::tables::round_to_bf16
        } else {
            super::super::tables::round_to_f16
        };
        while j < n {
            *dst.add(j) = round(*src.add(j));
            j += 1;
        }
    }
}
