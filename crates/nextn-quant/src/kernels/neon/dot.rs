//! NEON dot products of one decoded weight row with one activation row. Signed i8 × i8
//! products widen to i16 (`vmull_s8`), two per lane, which cannot overflow since
//! activations stay within ±127. Each function's float operation sequence depends only
//! on the row length.

use core::arch::aarch64::*;

use super::super::act::ActRow;
use super::super::decoded_row::DecodedRow;

/// Products of 16 weight/activation pairs as 8 i16 lanes: lane k holds products k and k+8.
#[inline]
unsafe fn products16(w: int8x16_t, x: int8x16_t) -> int16x8_t {
    // SAFETY: NEON is part of every aarch64 CPU.
    unsafe {
        vaddq_s16(
            vmull_s8(vget_low_s8(w), vget_low_s8(x)),
            vmull_high_s8(w, x),
        )
    }
}

#[inline]
unsafe fn load(p: *const u8) -> int8x16_t {
    // SAFETY: NEON is part of every aarch64 CPU; `p` points at as many valid elements as the loads
    // below read (the callers pass whole blocks or rows).
    unsafe { vld1q_s8(p as *const i8) }
}

/// 32-element blocks: Σ_b d_w·d_a·Σ(w·x), plus Σ_b m_w·s_a when `MIN` (Q4_1, Q5_1).
pub(super) unsafe fn dot_legacy<const MIN: bool>(
    _w: &[u8],
    st: &DecodedRow,
    a: &ActRow,
    nb: usize,
) -> f32 {
    // SAFETY: NEON is part of every aarch64 CPU; `w`, the decoded row `st` and the activation row
    // `a` all cover `nb` blocks of the row's type, so every load stays inside them.
    unsafe {
        debug_assert!(st.q.len() >= 32 * nb && a.qs.len() >= 32 * nb && a.d.len() >= nb);
        let (q, x) = (st.q.as_ptr(), a.qs.as_ptr() as *const u8);
        let mut acc = [vdupq_n_f32(0.0); 2];
        for b in 0..nb {
            let p0 = products16(load(q.add(32 * b)), load(x.add(32 * b)));
            let p1 = products16(load(q.add(32 * b + 16)), load(x.add(32 * b + 16)));
            let s = vpadalq_s16(vpaddlq_s16(p0), p1);
            let d = *st.d.get_unchecked(b) * *a.d.get_unchecked(b);
            acc[b & 1] = vfmaq_n_f32(acc[b & 1], vcvtq_f32_s32(s), d);
        }
        let mut sum = vaddvq_f32(vaddq_f32(acc[0], acc[1]));
        if MIN {
            // Σ_b m_w·s_a, four blocks per FMA.
            let (m, s) = (st.m.as_ptr(), a.s.as_ptr());
            let mut acc = vdupq_n_f32(0.0);
            let mut b = 0;
            while b + 4 <= nb {
                acc = vfmaq_f32(acc, vld1q_f32(m.add(b)), vld1q_f32(s.add(b)));
                b += 4;
            }
            let mut mins = vaddvq_f32(acc);
            while b < nb {
                mins += *m.add(b) * *s.add(b);
                b += 1;
            }
            sum += mins;
        }
        sum
    }
}

/// 256-element blocks: Σ_g scale_g·Σ(w·x) per block scaled by d_w·d_a, minus
/// dmin_w·d_a·Σ_g bsum_g·min_g when `SCALED_MINS` (Q2_K, Q4_K, Q5_K).
pub(super) unsafe fn dot_k<const SCALED_MINS: bool>(
    _w: &[u8],
    st: &DecodedRow,
    a: &ActRow,
    nb: usize,
) -> f32 {
    // SAFETY: NEON is part of every aarch64 CPU; `w`, the decoded row `st` and the activation row
    // `a` all cover `nb` blocks of the row's type, so every load stays inside them.
    unsafe {
        debug_assert!(st.q.len() >= 256 * nb && st.sc.len() >= 16 * nb && a.qs.len() >= 256 * nb);
        debug_assert!(!SCALED_MINS || (st.mins.len() >= 16 * nb && a.bsums.len() >= 16 * nb));
        let (q, x) = (st.q.as_ptr(), a.qs.as_ptr() as *const u8);
        let mut acc = vdupq_n_f32(0.0);
        for b in 0..nb {
            let mut sumi = vdupq_n_s32(0);
            for g in 0..16 {
                let off = 256 * b + 16 * g;
                let p = vpaddlq_s16(products16(load(q.add(off)), load(x.add(off))));
                sumi = vmlaq_n_s32(sumi, p, *st.sc.get_unchecked(16 * b + g) as i32);
            }
            acc = vfmaq_n_f32(
                acc,
                vcvtq_f32_s32(sumi),
                *st.d.get_unchecked(b) * *a.d.get_unchecked(b),
            );
            if SCALED_MINS {
                let bs = a.bsums.as_ptr().add(16 * b);
                let mn = st.mins.as_ptr().add(16 * b);
                let (b0, b1) = (vld1q_s16(bs), vld1q_s16(bs.add(8)));
                let (m0, m1) = (vld1q_s16(mn), vld1q_s16(mn.add(8)));
                let mut ms = vmull_s16(vget_low_s16(b0), vget_low_s16(m0));
                ms = vmlal_high_s16(ms, b0, m0);
                ms = vmlal_s16(ms, vget_low_s16(b1), vget_low_s16(m1));
                ms = vmlal_high_s16(ms, b1, m1);
                let dm = -(*st.m.get_unchecked(b) * *a.d.get_unchecked(b));
                acc = vfmaq_n_f32(acc, vcvtq_f32_s32(ms), dm);
            }
        }
        vaddvq_f32(acc)
    }
}

#[inline]
unsafe fn dot_f32_ptrs(w: *const u8, x: *const f32, n: usize) -> f32 {
    // SAFETY: NEON is part of every aarch64 CPU; `w`, `x` point at as many valid elements as the
    // loads below read (the callers pass whole blocks or rows).
    unsafe {
        // Weights through byte loads: an F32 row has no alignment guarantee.
        let wl = |j: usize| vreinterpretq_f32_u8(vld1q_u8(w.add(4 * j)));
        let mut acc = [vdupq_n_f32(0.0); 4];
        let mut j = 0;
        while j + 16 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                *a = vfmaq_f32(*a, wl(j + 4 * k), vld1q_f32(x.add(j + 4 * k)));
            }
            j += 16;
        }
        while j + 4 <= n {
            acc[0] = vfmaq_f32(acc[0], wl(j), vld1q_f32(x.add(j)));
            j += 4;
        }
        let mut sum = vaddvq_f32(vaddq_f32(
            vaddq_f32(acc[0], acc[1]),
            vaddq_f32(acc[2], acc[3]),
        ));
        while j < n {
            let wv = f32::from_le_bytes([
                *w.add(4 * j),
                *w.add(4 * j + 1),
                *w.add(4 * j + 2),
                *w.add(4 * j + 3),
            ]);
            sum += wv * *x.add(j);
            j += 1;
        }
        sum
    }
}

pub(super) unsafe fn dot_f32_row(w: &[u8], _st: &DecodedRow, a: &ActRow, n: usize) -> f32 {
    // SAFETY: NEON is part of every aarch64 CPU; `w`, the decoded row `st` and the activation row
    // `a` all cover `n` elements of the row's type, so every load stays inside them.
    unsafe {
        debug_assert!(w.len() >= 4 * n && a.f.len() >= n);
        dot_f32_ptrs(w.as_ptr(), a.f.as_ptr(), n)
    }
}

pub(super) unsafe fn dot_f32_staged(_w: &[u8], st: &DecodedRow, a: &ActRow, n: usize) -> f32 {
    // SAFETY: NEON is part of every aarch64 CPU; `w`, the decoded row `st` and the activation row
    // `a` all cover `n` elements of the row's type, so every load stays inside them.
    unsafe {
        debug_assert!(st.f.len() >= n && a.f.len() >= n);
        dot_f32_ptrs(st.f.as_ptr() as *const u8, a.f.as_ptr(), n)
    }
}
