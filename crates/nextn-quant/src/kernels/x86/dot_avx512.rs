//! AVX-512 (F, BW, VL) dot products: the AVX2 scheme on 64-byte vectors, two 32-weight
//! blocks or chunks per instruction. Same staging and integer sums as AVX2; the f32
//! accumulation differs (16 lanes), so results match AVX2 to rounding, not bit for bit.

use core::arch::x86_64::*;

use super::super::act::ActRow;
use super::super::decoded_row::DecodedRow;
use super::dot_avx2::{block_factor_dot, hsum_ps, MINS_NONE, MINS_OFFSET};

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn hsum512(v: __m512) -> f32 {
    // SAFETY: the CPU has AVX-512 (F, BW, VL) with AVX2, FMA and F16C (this runs only under kernels
    // compiled for them, which the dispatcher chose after checking the CPU).
    unsafe {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
        hsum_ps(_mm256_add_ps(lo, hi))
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn load512(p: *const u8) -> __m512i {
    // SAFETY: the CPU has AVX-512 (F, BW, VL) with AVX2, FMA and F16C (this runs only under kernels
    // compiled for them, which the dispatcher chose after checking the CPU); `p` points at as many
    // valid elements as the loads below read (the callers pass whole blocks or rows).
    unsafe { _mm512_loadu_si512(p as *const __m512i) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn load256(p: *const u8) -> __m256i {
    // SAFETY: the CPU has AVX-512 (F, BW, VL) with AVX2, FMA and F16C (this runs only under kernels
    // compiled for them, which the dispatcher chose after checking the CPU); `p` points at as many
    // valid elements as the loads below read (the callers pass whole blocks or rows).
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// 64 bytes at `p`, or only the first 32 (the rest zero, nothing read past them) when
/// `half`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn load_bytes(p: *const u8, half: bool) -> __m512i {
    // SAFETY: the CPU has AVX-512 (F, BW, VL) with AVX2, FMA and F16C (this runs only under kernels
    // compiled for them, which the dispatcher chose after checking the CPU); `p` points at as many
    // valid elements as the loads below read (the callers pass whole blocks or rows).
    unsafe {
        if half {
            _mm512_maskz_loadu_epi8(0xffff_ffff, p as *const i8)
        } else {
            load512(p)
        }
    }
}

/// 32 i16 sums of adjacent products for the 64 lanes at `off`. AVX-512 has no `vpsignb`,
/// so for signed weights the activation is negated through a mask and multiplied by the
/// decoder's |w| (a zero weight gives |w| = 0 either way).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn pair_products<const SIGNED: bool>(
    st: &DecodedRow,
    x: *const u8,
    off: usize,
    half: bool,
) -> __m512i {
    // SAFETY: the CPU has AVX-512 (F, BW, VL) with AVX2, FMA and F16C (this runs only under kernels
    // compiled for them, which the dispatcher chose after checking the CPU); `x` points at as many
    // valid elements as the loads below read (the callers pass whole blocks or rows).
    unsafe {
        let xv = load_bytes(x.add(off), half);
        if SIGNED {
            let negative = _mm512_movepi8_mask(load_bytes(st.q.as_ptr().add(off), half));
            let sx = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);
            _mm512_maddubs_epi16(load_bytes(st.qabs.as_ptr().add(off), half), sx)
        } else {
            _mm512_maddubs_epi16(load_bytes(st.q.as_ptr().add(off), half), xv)
        }
    }
}

/// Blocks `b` and `b + 1` (or only `b` when `single`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn legacy_pair<const SIGNED: bool>(
    st: &DecodedRow,
    a: &ActRow,
    b: usize,
    single: bool,
    acc: __m512,
) -> __m512 {
    // SAFETY: the CPU has AVX-512 (F, BW, VL) with AVX2, FMA and F16C (this runs only under kernels
    // compiled for them, which the dispatcher chose after checking the CPU); `b` names a chunk
    // inside the decoded row `st`, which the decoder sized for the whole row.
    unsafe {
        let (wd, ad) = (st.d.as_ptr(), a.d.as_ptr());
        let s0 = *wd.add(b) * *ad.add(b);
        let s1 = if single {
            0.0
        } else {
            *wd.add(b + 1) * *ad.add(b + 1)
        };
        let pairs = pair_products::<SIGNED>(st, a.qs.as_ptr() as *const u8, 32 * b, single);
        let p = _mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
        let s = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(s0), _mm512_set1_ps(s1));
        _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(p), acc)
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn dot_legacy<const SIGNED: bool, const MIN: bool, const OFFSET: i32>(
    _w: &[u8],
    st: &DecodedRow,
    a: &ActRow,
    nb: usize,
) -> f32 {
    // SAFETY: the CPU has AVX-512 (F, BW, VL) with AVX2, FMA and F16C (this runs only under kernels
    // compiled for them, which the dispatcher chose after checking the CPU); `w`, the decoded row
    // `st` and the activation row `a` all cover `nb` blocks of the row's type, so every load stays
    // inside them.
    unsafe {
        debug_assert!(st.q.len() >= 32 * nb && a.qs.len() >= 32 * nb && a.d.len() >= nb);
        let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut b = 0;
        while b + 4 <= nb {
            acc0 = legacy_pair::<SIGNED>(st, a, b, false, acc0);
            acc1 = legacy_pair::<SIGNED>(st, a, b + 2, false, acc1);
            b += 4;
        }
        if b + 2 <= nb {
            acc0 = legacy_pair::<SIGNED>(st, a, b, false, acc0);
            b += 2;
        }
        if b < nb {
            acc1 = legacy_pair::<SIGNED>(st, a, b, true, acc1);
        }
        let mut sum = hsum512(_mm512_add_ps(acc0, acc1));
        if OFFSET != 0 {
            sum -= OFFSET as f32 * block_factor_dot(&st.d, a.dsum, nb);
        }
        if MIN {
            sum += block_factor_dot(&st.m, a.s, nb);
        }
        sum
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn dot_k<const SIGNED: bool, const MINS: u8>(
    _w: &[u8],
    st: &DecodedRow,
    a: &ActRow,
    nb: usize,
) -> f32 {
    // SAFETY: the CPU has AVX-512 (F, BW, VL) with AVX2, FMA and F16C (this runs only under kernels
    // compiled for them, which the dispatcher chose after checking the CPU); `w`, the decoded row
    // `st` and the activation row `a` all cover `nb` blocks of the row's type, so every load stays
    // inside them.
    unsafe {
        debug_assert!(st.q.len() >= 256 * nb && st.sc.len() >= 128 * nb && a.qs.len() >= 256 * nb);
        debug_assert!(MINS == MINS_NONE || (st.mins.len() >= 16 * nb && a.bsums.len() >= 16 * nb));
        let (x, sc) = (a.qs.as_ptr() as *const u8, st.sc.as_ptr() as *const u8);
        let (wd, wm, ad) = (st.d.as_ptr(), st.m.as_ptr(), a.d.as_ptr());
        let (mins, bsums) = (st.mins.as_ptr() as *const u8, a.bsums.as_ptr() as *const u8);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let mut wide = _mm512_setzero_si512();
            for c in 0..4 {
                let off = 256 * b + 64 * c;
                let p = pair_products::<SIGNED>(st, x, off, false);
                wide = _mm512_add_epi32(wide, _mm512_madd_epi16(p, load512(sc.add(off))));
            }
            let sumi = _mm256_add_epi32(
                _mm512_castsi512_si256(wide),
                _mm512_extracti64x4_epi64(wide, 1),
            );
            let dd = *wd.add(b) * *ad.add(b);
            if MINS == MINS_NONE {
                acc = _mm256_fmadd_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(sumi), acc);
            } else {
                let m = _mm256_madd_epi16(load256(bsums.add(32 * b)), load256(mins.add(32 * b)));
                if MINS == MINS_OFFSET {
                    let total = _mm256_sub_epi32(sumi, m);
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(total), acc);
                } else {
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(sumi), acc);
                    let dm = -(*wm.add(b) * *ad.add(b));
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(dm), _mm256_cvtepi32_ps(m), acc);
                }
            }
        }
        hsum_ps(acc)
    }
}
