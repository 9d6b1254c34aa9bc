//! AVX2 dot products of one decoded weight row with one activation row.
//!
//! Each function's floating-point operation sequence depends only on the row length, so
//! a (weight row, activation row) result is the same whichever rows share the batch.

use core::arch::x86_64::*;

use super::super::act::ActRow;
use super::super::decoded_row::DecodedRow;

/// K-family minimum handling (see `dot_k`).
pub(super) const MINS_NONE: u8 = 0;
/// `mins` hold offset·scale in the block's own scale: subtract in integers.
pub(super) const MINS_OFFSET: u8 = 1;
/// `mins` scale with the block's separate `dmin`.
pub(super) const MINS_SCALED: u8 = 2;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// `hsum_ps` of eight registers at once: lane r of the result is `hsum_ps(v[r])` bit for bit.
/// The same adds of the same operands, rearranged across registers: the halves' sums
/// (`a_l + a_{l+4}`) for two registers per add, then `x_0 + x_2` and `x_1 + x_3` for two
/// registers per add, then those two summed by one horizontal add for four registers.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum_ps_x8(v: &[__m256; 8]) -> __m256 {
    // h[r], lanes 0..4: x_l = a_l + a_{l+4} of v[r]; lanes 4..8: those of v[r + 4].
    let mut h = [_mm256_setzero_ps(); 4];
    for r in 0..4 {
        let lo = _mm256_permute2f128_ps::<0x20>(v[r], v[r + 4]);
        let hi = _mm256_permute2f128_ps::<0x31>(v[r], v[r + 4]);
        h[r] = _mm256_add_ps(lo, hi);
    }
    // Lanes (x0 + x2, x1 + x3) of v[r], then of v[r + 1] | of v[r + 4], then of v[r + 5].
    let g01 = _mm256_add_ps(
        _mm256_shuffle_ps::<0b01_00_01_00>(h[0], h[1]),
        _mm256_shuffle_ps::<0b11_10_11_10>(h[0], h[1]),
    );
    let g23 = _mm256_add_ps(
        _mm256_shuffle_ps::<0b01_00_01_00>(h[2], h[3]),
        _mm256_shuffle_ps::<0b11_10_11_10>(h[2], h[3]),
    );
    // (x0 + x2) + (x1 + x3) of v[0], v[1], v[2], v[3] | v[4], v[5], v[6], v[7].
    _mm256_hadd_ps(g01, g23)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load(p: *const u8) -> __m256i {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `p` points at as many valid elements as the
    // loads below read (the callers pass whole blocks or rows).
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// Sixteen i16 sums of adjacent products w·x for the 32 lanes at `off`. Unsigned weights
/// go straight into `maddubs`; signed ones as |w|·sign(x, w) (|w| precomputed by the
/// decoder) because `maddubs` wants its first operand unsigned. No pair can saturate:
/// activations are within ±127 and weights within -128..=127 (or 0..=63 unsigned).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pair_products<const SIGNED: bool>(
    st: &DecodedRow,
    x: *const u8,
    off: usize,
) -> __m256i {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `x` points at as many valid elements as the
    // loads below read (the callers pass whole blocks or rows).
    unsafe {
        let xv = load(x.add(off));
        if SIGNED {
            let w = load(st.q.as_ptr().add(off));
            _mm256_maddubs_epi16(load(st.qabs.as_ptr().add(off)), _mm256_sign_epi8(xv, w))
        } else {
            _mm256_maddubs_epi16(load(st.q.as_ptr().add(off)), xv)
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_block<const SIGNED: bool>(
    st: &DecodedRow,
    x: *const u8,
    wd: *const f32,
    ad: *const f32,
    b: usize,
    acc: __m256,
) -> __m256 {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `b` names a chunk inside the decoded row `st`,
    // which the decoder sized for the whole row.
    unsafe {
        let pairs = pair_products::<SIGNED>(st, x, 32 * b);
        let p = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
        let s = _mm256_set1_ps(*wd.add(b) * *ad.add(b));
        _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(p), acc)
    }
}

/// Σ_b w[b]·a[b] over per-block factors (one FMA per 8 blocks): how a constant weight
/// offset (`d_w`·`dsum_a`) or an additive minimum (`m_w`·`s_a`) contributes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn block_factor_dot(w: &[f32], a: &[f32], nb: usize) -> f32 {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w`, `a` have the lengths the callers size them
    // to (debug-asserted below), so the pointer reads and writes stay inside them.
    unsafe {
        debug_assert!(w.len() >= nb && a.len() >= nb);
        let (wp, ap) = (w.as_ptr(), a.as_ptr());
        let mut acc = _mm256_setzero_ps();
        let mut b = 0;
        while b + 8 <= nb {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(wp.add(b)), _mm256_loadu_ps(ap.add(b)), acc);
            b += 8;
        }
        let mut sum = hsum_ps(acc);
        while b < nb {
            sum += *wp.add(b) * *ap.add(b);
            b += 1;
        }
        sum
    }
}

/// 32-element blocks: Σ_b d_w·d_a·Σ(w·x), plus Σ_b m_w·s_a when `MIN` (Q4_1, Q5_1).
/// Weights stored as `w + OFFSET` (Q4_0: 8, Q5_0: 16) are corrected by
/// `OFFSET·Σ_b d_w·d_a·Σx`, which keeps the unsigned `maddubs` without the sign trick.
/// Even and odd blocks feed separate accumulators to hide the FMA latency.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_legacy<const SIGNED: bool, const MIN: bool, const OFFSET: i32>(
    _w: &[u8],
    st: &DecodedRow,
    a: &ActRow,
    nb: usize,
) -> f32 {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w`, the decoded row `st` and the activation
    // row `a` all cover `nb` blocks of the row's type, so every load stays inside them.
    unsafe {
        debug_assert!(st.q.len() >= 32 * nb && a.qs.len() >= 32 * nb && a.d.len() >= nb);
        let (x, wd, ad) = (a.qs.as_ptr() as *const u8, st.d.as_ptr(), a.d.as_ptr());
        let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut b = 0;
        while b + 2 <= nb {
            acc0 = legacy_block::<SIGNED>(st, x, wd, ad, b, acc0);
            acc1 = legacy_block::<SIGNED>(st, x, wd, ad, b + 1, acc1);
            b += 2;
        }
        if b < nb {
            acc0 = legacy_block::<SIGNED>(st, x, wd, ad, b, acc0);
        }
        let mut sum = hsum_ps(_mm256_add_ps(acc0, acc1));
        if OFFSET != 0 {
            sum -= OFFSET as f32 * block_factor_dot(&st.d, a.dsum, nb);
        }
        if MIN {
            sum += block_factor_dot(&st.m, a.s, nb);
        }
        sum
    }
}

/// 256-element blocks: per block Σ_chunks madd(pairs, scales) in i32, then
/// `MINS_NONE`: d_w·d_a·Σ; `MINS_OFFSET`: d_w·d_a·(Σ − bsums·mins);
/// `MINS_SCALED`: d_w·d_a·Σ − dmin_w·d_a·(bsums·mins).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_k<const SIGNED: bool, const MINS: u8>(
    _w: &[u8],
    st: &DecodedRow,
    a: &ActRow,
    nb: usize,
) -> f32 {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w`, the decoded row `st` and the activation
    // row `a` all cover `nb` blocks of the row's type, so every load stays inside them.
    unsafe {
        debug_assert!(st.q.len() >= 256 * nb && st.sc.len() >= 128 * nb && a.qs.len() >= 256 * nb);
        debug_assert!(MINS == MINS_NONE || (st.mins.len() >= 16 * nb && a.bsums.len() >= 16 * nb));
        let (x, sc) = (a.qs.as_ptr() as *const u8, st.sc.as_ptr() as *const u8);
        let (wd, wm, ad) = (st.d.as_ptr(), st.m.as_ptr(), a.d.as_ptr());
        let (mins, bsums) = (st.mins.as_ptr() as *const u8, a.bsums.as_ptr() as *const u8);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let mut sumi = _mm256_setzero_si256();
            for c in 0..8 {
                let off = 256 * b + 32 * c;
                let p = pair_products::<SIGNED>(st, x, off);
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, load(sc.add(off))));
            }
            let dd = *wd.add(b) * *ad.add(b);
            if MINS == MINS_NONE {
                acc = _mm256_fmadd_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(sumi), acc);
            } else {
                let m = _mm256_madd_epi16(load(bsums.add(32 * b)), load(mins.add(32 * b)));
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

/// f32 dot of `n` elements with four accumulators; the tail is summed in order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f32_ptrs(w: *const f32, x: *const f32, n: usize) -> f32 {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w`, `x` point at as many valid elements as the
    // loads below read (the callers pass whole blocks or rows).
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut j = 0;
        while j + 32 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(
                    _mm256_loadu_ps(w.add(j + 8 * k)),
                    _mm256_loadu_ps(x.add(j + 8 * k)),
                    *a,
                );
            }
            j += 32;
        }
        while j + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(w.add(j)), _mm256_loadu_ps(x.add(j)), acc[0]);
            j += 8;
        }
        let mut sum = hsum_ps(_mm256_add_ps(
            _mm256_add_ps(acc[0], acc[1]),
            _mm256_add_ps(acc[2], acc[3]),
        ));
        while j < n {
            sum += w.add(j).read_unaligned() * *x.add(j);
            j += 1;
        }
        sum
    }
}

/// F32 weights, read straight from the row bytes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_f32_row(w: &[u8], _st: &DecodedRow, a: &ActRow, n: usize) -> f32 {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w`, the decoded row `st` and the activation
    // row `a` all cover `n` elements of the row's type, so every load stays inside them.
    unsafe {
        debug_assert!(w.len() >= 4 * n && a.f.len() >= n);
        dot_f32_ptrs(w.as_ptr() as *const f32, a.f.as_ptr(), n)
    }
}

/// F16 / BF16 weights widened into a `DecodedRow`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_f32_staged(_w: &[u8], st: &DecodedRow, a: &ActRow, n: usize) -> f32 {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w`, the decoded row `st` and the activation
    // row `a` all cover `n` elements of the row's type, so every load stays inside them.
    unsafe {
        debug_assert!(st.f.len() >= n && a.f.len() >= n);
        dot_f32_ptrs(st.f.as_ptr(), a.f.as_ptr(), n)
    }
}
