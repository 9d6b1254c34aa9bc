//! AVX2 unpacking of 256-element super-blocks into a `DecodedRow`. Per block: 256 weight bytes,
//! one 16-lane i16 scale vector per 32 weights (lanes 0..8 scale weights 0..16 of the
//! chunk, lanes 8..16 weights 16..32, matching `maddubs` pair order), 16 i16 "mins" per
//! block for the activation 16-sums, and the f32 `d` / `dmin`.
//!
//! Types with a negative offset (Q3_K: -4, Q6_K: -32) are stored unsigned and their
//! offset goes into `mins` as offset·scale, which the dot product subtracts exactly in
//! integers; that keeps the cheap unsigned×signed `maddubs` without the sign trick.

use core::arch::x86_64::*;

use super::super::decoded_row::DecodedRow;
use super::super::tables::{
    iq4xs_scales, k4_scales_mins_packed, q3k_scales_packed, read_f32, KVALUES_IQ4NL,
};
use super::decode_legacy::{f16_at, nibbles32, store_signed, table16};

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_q(st: &mut DecodedRow, chunk: usize, v: __m256i) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `chunk` names a chunk inside the decoded row
    // `st`, which the decoder sized for the whole row (debug-asserted below).
    unsafe {
        debug_assert!(st.q.len() >= 32 * (chunk + 1));
        _mm256_storeu_si256(st.q.as_mut_ptr().add(32 * chunk) as *mut __m256i, v);
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_scales(st: &mut DecodedRow, chunk: usize, v: __m256i) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `chunk` names a chunk inside the decoded row
    // `st`, which the decoder sized for the whole row (debug-asserted below).
    unsafe {
        debug_assert!(st.sc.len() >= 16 * (chunk + 1));
        _mm256_storeu_si256(st.sc.as_mut_ptr().add(16 * chunk) as *mut __m256i, v);
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_mins(st: &mut DecodedRow, b: usize, v: __m256i) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `b` names a chunk inside the decoded row `st`,
    // which the decoder sized for the whole row (debug-asserted below).
    unsafe {
        debug_assert!(st.mins.len() >= 16 * (b + 1));
        _mm256_storeu_si256(st.mins.as_mut_ptr().add(16 * b) as *mut __m256i, v);
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load(p: *const u8) -> __m256i {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `p` points at as many valid elements as the
    // loads below read (the callers pass whole blocks or rows).
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// Scale vectors for 8 sub-blocks of 32 from their 8 scales (i16 lanes of `s8`): chunk
/// `c` gets lane `c` in all 16 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_scales_per32(st: &mut DecodedRow, b: usize, s8: __m128i) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `b` names a chunk inside the decoded row `st`,
    // which the decoder sized for the whole row.
    unsafe {
        let both = _mm256_broadcastsi128_si256(s8);
        for c in 0..8 {
            let pick = _mm256_set1_epi16((2 * c as i16) | ((2 * c as i16 + 1) << 8));
            store_scales(st, 8 * b + c, _mm256_shuffle_epi8(both, pick));
        }
    }
}

/// Scale vectors for 16 sub-blocks of 16 (i16 lanes of `s16`): chunk `c` gets lane 2c in
/// its low half and lane 2c+1 in its high half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_scales_per16(st: &mut DecodedRow, b: usize, s16: __m256i) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `b` names a chunk inside the decoded row `st`,
    // which the decoder sized for the whole row.
    unsafe {
        // After broadcasting dword c (lanes 2c, 2c+1), take its first i16 in the low 128 bits
        // and its second in the high 128 bits.
        #[rustfmt::skip]
    let split = _mm256_setr_epi8(
        0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
        2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
    );
        for c in 0..8 {
            let pair = _mm256_permutevar8x32_epi32(s16, _mm256_set1_epi32(c as i32));
            store_scales(st, 8 * b + c, _mm256_shuffle_epi8(pair, split));
        }
    }
}

#[inline]
fn check(w: &[u8], st: &DecodedRow, nb: usize, bytes: usize) {
    debug_assert!(w.len() >= nb * bytes && st.d.len() >= nb && st.m.len() >= nb);
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_q2_k(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w` holds `nb` whole blocks and `st` was made
    // for this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 84);
        let m2 = _mm256_set1_epi8(3);
        let m4 = _mm_set1_epi8(0x0f);
        for b in 0..nb {
            let p = w.as_ptr().add(84 * b);
            *st.d.get_unchecked_mut(b) = f16_at(p.add(80));
            *st.m.get_unchecked_mut(b) = f16_at(p.add(82));
            let packed = _mm_loadu_si128(p as *const __m128i);
            store_scales_per16(st, b, _mm256_cvtepu8_epi16(_mm_and_si128(packed, m4)));
            store_mins(
                st,
                b,
                _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), m4)),
            );
            for k in 0..2 {
                let mut shifted = load(p.add(16 + 32 * k));
                for j in 0..4 {
                    store_q(st, 8 * b + 4 * k + j, _mm256_and_si256(shifted, m2));
                    shifted = _mm256_srli_epi16(shifted, 2);
                }
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_q3_k(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w` holds `nb` whole blocks and `st` was made
    // for this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 110);
        let m2 = _mm256_set1_epi8(3);
        let bit2 = _mm256_set1_epi8(4);
        for b in 0..nb {
            let blk = &w[110 * b..110 * b + 110];
            let p = blk.as_ptr();
            *st.d.get_unchecked_mut(b) = f16_at(p.add(108));
            let sc = q3k_scales_packed(&blk[96..108]);
            let unbiased = _mm256_cvtepu8_epi16(_mm_loadu_si128(sc.as_ptr() as *const __m128i));
            let s16 = _mm256_sub_epi16(unbiased, _mm256_set1_epi16(32));
            store_scales_per16(st, b, s16);
            store_mins(st, b, _mm256_slli_epi16(s16, 2));
            let hmask = load(p);
            for k in 0..2 {
                let mut shifted = load(p.add(32 + 32 * k));
                for j in 0..4 {
                    // Stored value low | h<<2 in 0..8 equals the true value + 4.
                    let hbit = _mm256_set1_epi8(1i8 << (4 * k + j));
                    let h = _mm256_cmpeq_epi8(_mm256_and_si256(hmask, hbit), hbit);
                    let v =
                        _mm256_or_si256(_mm256_and_si256(shifted, m2), _mm256_and_si256(h, bit2));
                    store_q(st, 8 * b + 4 * k + j, v);
                    shifted = _mm256_srli_epi16(shifted, 2);
                }
            }
        }
    }
}

/// Q4_K and Q5_K: `d`, `dmin`, scales and mins; the quants are written by the caller.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_header(blk: &[u8], st: &mut DecodedRow, b: usize) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `b` names a chunk inside the decoded row `st`,
    // which the decoder sized for the whole row.
    unsafe {
        let p = blk.as_ptr();
        *st.d.get_unchecked_mut(b) = f16_at(p);
        *st.m.get_unchecked_mut(b) = f16_at(p.add(2));
        let (sc, mn) = k4_scales_mins_packed(&blk[4..16]);
        store_scales_per32(st, b, _mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
        // Each 32-weight min covers two 16-sums.
        let m = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn as i64));
        store_mins(
            st,
            b,
            _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m)),
        );
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_q4_k(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w` holds `nb` whole blocks and `st` was made
    // for this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 144);
        let m4 = _mm256_set1_epi8(0x0f);
        for b in 0..nb {
            let blk = &w[144 * b..144 * b + 144];
            k4_header(blk, st, b);
            for j in 0..4 {
                let q = load(blk.as_ptr().add(16 + 32 * j));
                store_q(st, 8 * b + 2 * j, _mm256_and_si256(q, m4));
                store_q(
                    st,
                    8 * b + 2 * j + 1,
                    _mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                );
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_q5_k(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w` holds `nb` whole blocks and `st` was made
    // for this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 176);
        let m4 = _mm256_set1_epi8(0x0f);
        let bit4 = _mm256_set1_epi8(0x10);
        for b in 0..nb {
            let blk = &w[176 * b..176 * b + 176];
            k4_header(blk, st, b);
            let qh = load(blk.as_ptr().add(16));
            for j in 0..4 {
                let q = load(blk.as_ptr().add(48 + 32 * j));
                let halves = [
                    _mm256_and_si256(q, m4),
                    _mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                ];
                for (h, low) in halves.into_iter().enumerate() {
                    let s = 2 * j + h;
                    let bit = _mm256_set1_epi8(1i8 << s);
                    let high =
                        _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), bit4);
                    store_q(st, 8 * b + s, _mm256_or_si256(low, high));
                }
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_q6_k(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w` holds `nb` whole blocks and `st` was made
    // for this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 210);
        let m4 = _mm256_set1_epi8(0x0f);
        let m2h = _mm256_set1_epi8(0x30);
        for b in 0..nb {
            let p = w.as_ptr().add(210 * b);
            *st.d.get_unchecked_mut(b) = f16_at(p.add(208));
            let s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(192) as *const __m128i));
            store_scales_per16(st, b, s16);
            store_mins(st, b, _mm256_slli_epi16(s16, 5));
            for n in 0..2 {
                let a = load(p.add(64 * n));
                let bq = load(p.add(64 * n + 32));
                let h = load(p.add(128 + 32 * n));
                // Two high bits 2c..2c+2 of h moved to bits 4..6 (16-bit shifts; the mask
                // drops what crosses byte borders).
                let h0 = _mm256_and_si256(_mm256_slli_epi16(h, 4), m2h);
                let h1 = _mm256_and_si256(_mm256_slli_epi16(h, 2), m2h);
                let h2 = _mm256_and_si256(h, m2h);
                let h3 = _mm256_and_si256(_mm256_srli_epi16(h, 2), m2h);
                store_q(
                    st,
                    8 * b + 4 * n,
                    _mm256_or_si256(_mm256_and_si256(a, m4), h0),
                );
                store_q(
                    st,
                    8 * b + 4 * n + 1,
                    _mm256_or_si256(_mm256_and_si256(bq, m4), h1),
                );
                store_q(
                    st,
                    8 * b + 4 * n + 2,
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), h2),
                );
                store_q(
                    st,
                    8 * b + 4 * n + 3,
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bq, 4), m4), h3),
                );
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_q8_k(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w` holds `nb` whole blocks and `st` was made
    // for this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 292);
        let ones = _mm256_set1_epi16(1);
        for b in 0..nb {
            let blk = &w[292 * b..292 * b + 292];
            *st.d.get_unchecked_mut(b) = read_f32(blk, 0);
            for c in 0..8 {
                store_signed(st, 8 * b + c, load(blk.as_ptr().add(4 + 32 * c)));
                store_scales(st, 8 * b + c, ones);
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_iq4_xs(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w` holds `nb` whole blocks and `st` was made
    // for this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 136);
        let table = table16(&KVALUES_IQ4NL);
        for b in 0..nb {
            let blk = &w[136 * b..136 * b + 136];
            let p = blk.as_ptr();
            *st.d.get_unchecked_mut(b) = f16_at(p);
            let ls = iq4xs_scales(u16::from_le_bytes([blk[2], blk[3]]), &blk[4..8]);
            let s8 = _mm_cvtepi8_epi16(_mm_loadl_epi64(ls.as_ptr() as *const __m128i));
            store_scales_per32(st, b, s8);
            for ib in 0..8 {
                let v = _mm256_shuffle_epi8(table, nibbles32(p.add(8 + 16 * ib)));
                store_signed(st, 8 * b + ib, v);
            }
        }
    }
}
