//! 32-element block types against Q8_0 / Q8_1 activations.

use super::super::act::ActRow;
use super::super::tables::{e8m0_to_f32_half, read_f16, read_u32, KVALUES_IQ4NL, KVALUES_MXFP4};

/// Σ over blocks of `scale(block) * Σ w·a`, where `weights` yields block `b`'s 32 integer
/// weights in element order and its f32 scale.
#[inline]
fn sum_blocks<const BYTES: usize>(
    w: &[u8],
    a: &ActRow,
    decode: impl Fn(&[u8]) -> ([i32; 32], f32),
) -> f32 {
    let mut sumf = 0f32;
    for (b, blk) in w.chunks_exact(BYTES).enumerate() {
        let (vals, wd) = decode(blk);
        let qa = &a.qs[32 * b..32 * b + 32];
        let sumi: i32 = vals.iter().zip(qa).map(|(&v, &q)| v * q as i32).sum();
        sumf += sumi as f32 * (wd * a.d[b]);
    }
    sumf
}

fn nibbles(qs: &[u8], f: impl Fn(u8) -> i32) -> [i32; 32] {
    let mut v = [0i32; 32];
    for j in 0..16 {
        v[j] = f(qs[j] & 0x0f);
        v[j + 16] = f(qs[j] >> 4);
    }
    v
}

pub(super) fn dot_q4_0(w: &[u8], a: &ActRow) -> f32 {
    sum_blocks::<18>(w, a, |blk| {
        (nibbles(&blk[2..18], |q| q as i32 - 8), read_f16(blk, 0))
    })
}

pub(super) fn dot_q8_0(w: &[u8], a: &ActRow) -> f32 {
    sum_blocks::<34>(w, a, |blk| {
        let mut v = [0i32; 32];
        for (o, &q) in v.iter_mut().zip(&blk[2..34]) {
            *o = q as i8 as i32;
        }
        (v, read_f16(blk, 0))
    })
}

fn q5_values(qh: u32, qs: &[u8], offset: i32) -> [i32; 32] {
    let mut v = [0i32; 32];
    for j in 0..16 {
        let h0 = ((qh >> j) & 1) as i32;
        let h1 = ((qh >> (j + 16)) & 1) as i32;
        v[j] = ((qs[j] & 0x0f) as i32 | (h0 << 4)) - offset;
        v[j + 16] = ((qs[j] >> 4) as i32 | (h1 << 4)) - offset;
    }
    v
}

pub(super) fn dot_q5_0(w: &[u8], a: &ActRow) -> f32 {
    sum_blocks::<22>(w, a, |blk| {
        (
            q5_values(read_u32(blk, 2), &blk[6..22], 16),
            read_f16(blk, 0),
        )
    })
}

pub(super) fn dot_iq4_nl(w: &[u8], a: &ActRow) -> f32 {
    sum_blocks::<18>(w, a, |blk| {
        (
            nibbles(&blk[2..18], |q| KVALUES_IQ4NL[q as usize] as i32),
            read_f16(blk, 0),
        )
    })
}

pub(super) fn dot_mxfp4(w: &[u8], a: &ActRow) -> f32 {
    sum_blocks::<17>(w, a, |blk| {
        (
            nibbles(&blk[1..17], |q| KVALUES_MXFP4[q as usize] as i32),
            e8m0_to_f32_half(blk[0]),
        )
    })
}

/// Types with an additive minimum: `d·Σq·a + m·s` per block, `s = d_a·Σa` from Q8_1.
fn sum_blocks_with_min<const BYTES: usize>(
    w: &[u8],
    a: &ActRow,
    decode: impl Fn(&[u8]) -> [i32; 32],
) -> f32 {
    let mut sumf = 0f32;
    for (b, blk) in w.chunks_exact(BYTES).enumerate() {
        let vals = decode(blk);
        let qa = &a.qs[32 * b..32 * b + 32];
        let sumi: i32 = vals.iter().zip(qa).map(|(&v, &q)| v * q as i32).sum();
        let (wd, wm) = (read_f16(blk, 0), read_f16(blk, 2));
        sumf += (wd * a.d[b]) * sumi as f32 + wm * a.s[b];
    }
    sumf
}

pub(super) fn dot_q4_1(w: &[u8], a: &ActRow) -> f32 {
    sum_blocks_with_min::<20>(w, a, |blk| nibbles(&blk[4..20], |q| q as i32))
}

pub(super) fn dot_q5_1(w: &[u8], a: &ActRow) -> f32 {
    sum_blocks_with_min::<24>(w, a, |blk| q5_values(read_u32(blk, 4), &blk[8..24], 0))
}
