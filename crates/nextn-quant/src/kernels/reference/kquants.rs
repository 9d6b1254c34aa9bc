//! 256-element super-block types (K-quants, IQ4_XS, Q8_K) against Q8_K activations.

use super::super::act::ActRow;
use super::super::tables::{
    iq4xs_scales, k4_scales_mins, q3k_scales, read_f16, read_f32, KVALUES_IQ4NL,
};

/// Σ_i q(i)·a(i) over one 16- or 32-element group whose weights `w` yields by index.
#[inline]
fn group_dot(qa: &[i8], w: impl Fn(usize) -> i32) -> i32 {
    qa.iter().enumerate().map(|(l, &q)| w(l) * q as i32).sum()
}

pub(super) fn dot_q2_k(w: &[u8], a: &ActRow) -> f32 {
    let mut sumf = 0f32;
    for (b, blk) in w.chunks_exact(84).enumerate() {
        let (sc, qs) = (&blk[0..16], &blk[16..80]);
        let qa = &a.qs[256 * b..256 * b + 256];
        let bsums = &a.bsums[16 * b..16 * b + 16];
        let summs: i32 = (0..16).map(|g| bsums[g] as i32 * (sc[g] >> 4) as i32).sum();
        let mut isum = 0i32;
        for g in 0..16 {
            // Group g covers elements 16g..16g+16: half h of the 32 values that take
            // bits 2j..2j+2 of bytes 32k.. of qs, with g = 8k + 2j + h.
            let (k, j, h) = (g / 8, (g % 8) / 2, g % 2);
            let q = &qs[32 * k + 16 * h..32 * k + 16 * h + 16];
            let dot = group_dot(&qa[16 * g..16 * g + 16], |l| ((q[l] >> (2 * j)) & 3) as i32);
            isum += (sc[g] & 0x0f) as i32 * dot;
        }
        let dall = a.d[b] * read_f16(blk, 80);
        let dmin = a.d[b] * read_f16(blk, 82);
        sumf += dall * isum as f32 - dmin * summs as f32;
    }
    sumf
}

pub(super) fn dot_q3_k(w: &[u8], a: &ActRow) -> f32 {
    let mut sumf = 0f32;
    for (b, blk) in w.chunks_exact(110).enumerate() {
        let (hmask, qs) = (&blk[0..32], &blk[32..96]);
        let sc = q3k_scales(&blk[96..108]);
        let qa = &a.qs[256 * b..256 * b + 256];
        let mut isum = 0i32;
        for g in 0..16 {
            // Element e = 128k + 32j + l takes bits 2j.. of qs[32k + l] and high bit
            // 4k + j of hmask[l]; a clear high bit means "subtract 4".
            let (k, j, half) = (g / 8, (g % 8) / 2, g % 2);
            let dot = group_dot(&qa[16 * g..16 * g + 16], |l| {
                let l = 16 * half + l;
                let low = ((qs[32 * k + l] >> (2 * j)) & 3) as i32;
                let high_set = hmask[l] & (1 << (4 * k + j)) != 0;
                low - if high_set { 0 } else { 4 }
            });
            isum += sc[g] as i32 * dot;
        }
        sumf += (a.d[b] * read_f16(blk, 108)) * isum as f32;
    }
    sumf
}

/// Q4_K and Q5_K share the scale/min layout; `value(s, l)` gives weight l of sub-block s.
fn dot_k4_family<const BYTES: usize>(
    w: &[u8],
    a: &ActRow,
    value: impl Fn(&[u8], usize, usize) -> i32,
) -> f32 {
    let mut sumf = 0f32;
    for (b, blk) in w.chunks_exact(BYTES).enumerate() {
        let (sc, mn) = k4_scales_mins(&blk[4..16]);
        let qa = &a.qs[256 * b..256 * b + 256];
        let bsums = &a.bsums[16 * b..16 * b + 16];
        let summs: i32 = (0..16).map(|g| bsums[g] as i32 * mn[g / 2] as i32).sum();
        let mut isum = 0i32;
        for s in 0..8 {
            isum += sc[s] as i32 * group_dot(&qa[32 * s..32 * s + 32], |l| value(blk, s, l));
        }
        let d = a.d[b] * read_f16(blk, 0);
        let dmin = a.d[b] * read_f16(blk, 2);
        sumf += d * isum as f32 - dmin * summs as f32;
    }
    sumf
}

pub(super) fn dot_q4_k(w: &[u8], a: &ActRow) -> f32 {
    // Sub-block s = 2j + h holds nibble h of qs[32j..32j+32].
    dot_k4_family::<144>(w, a, |blk, s, l| {
        ((blk[16 + 32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0f) as i32
    })
}

pub(super) fn dot_q5_k(w: &[u8], a: &ActRow) -> f32 {
    // As Q4_K, plus bit s of qh[l] as the fifth bit.
    dot_k4_family::<176>(w, a, |blk, s, l| {
        let low = ((blk[48 + 32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0f) as i32;
        let high = ((blk[16 + l] >> s) & 1) as i32;
        low | (high << 4)
    })
}

pub(super) fn dot_q6_k(w: &[u8], a: &ActRow) -> f32 {
    let mut sumf = 0f32;
    for (b, blk) in w.chunks_exact(210).enumerate() {
        let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
        let qa = &a.qs[256 * b..256 * b + 256];
        let mut isum = 0i32;
        for g in 0..16 {
            // Element e = 128n + 32c + l: nibble c/2 of ql[64n + 32(c%2) + l] and bits
            // 2c..2c+2 of qh[32n + l].
            let (n, c, half) = (g / 8, (g % 8) / 2, g % 2);
            let dot = group_dot(&qa[16 * g..16 * g + 16], |l| {
                let l = 16 * half + l;
                let low = (ql[64 * n + 32 * (c % 2) + l] >> (4 * (c / 2))) & 0x0f;
                let high = (qh[32 * n + l] >> (2 * c)) & 3;
                (low | (high << 4)) as i32 - 32
            });
            isum += sc[g] as i8 as i32 * dot;
        }
        sumf += (a.d[b] * read_f16(blk, 208)) * isum as f32;
    }
    sumf
}

pub(super) fn dot_q8_k(w: &[u8], a: &ActRow) -> f32 {
    let mut sumf = 0f32;
    for (b, blk) in w.chunks_exact(292).enumerate() {
        let qa = &a.qs[256 * b..256 * b + 256];
        let sumi = group_dot(qa, |l| blk[4 + l] as i8 as i32);
        sumf += (a.d[b] * read_f32(blk, 0)) * sumi as f32;
    }
    sumf
}

pub(super) fn dot_iq4_xs(w: &[u8], a: &ActRow) -> f32 {
    let mut sumf = 0f32;
    for (b, blk) in w.chunks_exact(136).enumerate() {
        let scales_h = u16::from_le_bytes([blk[2], blk[3]]);
        let ls = iq4xs_scales(scales_h, &blk[4..8]);
        let qs = &blk[8..136];
        let qa = &a.qs[256 * b..256 * b + 256];
        let mut isum = 0i32;
        for (ib, &scale) in ls.iter().enumerate() {
            let q = &qs[16 * ib..16 * ib + 16];
            let dot = group_dot(&qa[32 * ib..32 * ib + 32], |l| {
                let nib = if l < 16 { q[l] & 0x0f } else { q[l - 16] >> 4 };
                KVALUES_IQ4NL[nib as usize] as i32
            });
            isum += scale as i32 * dot;
        }
        sumf += (a.d[b] * read_f16(blk, 0)) * isum as f32;
    }
    sumf
}
