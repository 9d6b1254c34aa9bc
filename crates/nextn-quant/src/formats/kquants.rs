//! Dequantization of the 256-element K-quant super-blocks: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K.
//!
//! The float operations and their order follow gguf-py (and ggml's reference): the
//! sub-block scale `d * sc` is formed in f32 first, then `scale * q - d_min * m`, each step
//! rounded to f32 (no fused multiply-add).

use super::check_rows;
use super::layout::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, QK_K};
use super::tables::{get_scale_min_k4, q3k_scales};
use crate::QuantError;

pub fn dequantize_row_q2_k(blocks: &[BlockQ2K], dst: &mut [f32]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK_K, dst.len())?;
    for (b, out) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (b.d(), b.dmin());
        // Sub-block `sub` = 8*h + 2*s + half covers elements 128*h + 32*s + 16*half + (0..16).
        for (sub, out) in out.chunks_exact_mut(16).enumerate() {
            let (h, s, half) = (sub / 8, (sub / 2) % 4, sub % 2);
            let sc = b.scales[sub];
            let dl = d * ((sc & 0x0f) as f32);
            let ml = dmin * ((sc >> 4) as f32);
            let qs = &b.qs[32 * h + 16 * half..][..16];
            for (o, &q) in out.iter_mut().zip(qs) {
                *o = dl * (((q >> (2 * s)) & 3) as f32) - ml;
            }
        }
    }
    Ok(())
}

pub fn dequantize_row_q3_k(blocks: &[BlockQ3K], dst: &mut [f32]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK_K, dst.len())?;
    for (b, out) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = b.d();
        let scales = q3k_scales(&b.scales);
        for (sub, out) in out.chunks_exact_mut(16).enumerate() {
            let (h, s, half) = (sub / 8, (sub / 2) % 4, sub % 2);
            let dl = d * (scales[sub] as f32);
            let qs = &b.qs[32 * h + 16 * half..][..16];
            let hmask = &b.hmask[16 * half..][..16];
            let hbit = 4 * h + s;
            for ((o, &q), &m) in out.iter_mut().zip(qs).zip(hmask) {
                let low = ((q >> (2 * s)) & 3) as i8;
                // A clear high bit means the code is offset by -4.
                let q = low - (((m >> hbit) & 1) ^ 1) as i8 * 4;
                *o = dl * (q as f32);
            }
        }
    }
    Ok(())
}

pub fn dequantize_row_q4_k(blocks: &[BlockQ4K], dst: &mut [f32]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK_K, dst.len())?;
    for (b, out) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (b.d(), b.dmin());
        for (sub, out) in out.chunks_exact_mut(32).enumerate() {
            let (sc, m) = get_scale_min_k4(sub, &b.scales);
            let dl = d * (sc as f32);
            let ml = dmin * (m as f32);
            let (c, shift) = (sub / 2, 4 * (sub % 2));
            for (l, o) in out.iter_mut().enumerate() {
                let q = (b.qs[32 * c + l] >> shift) & 0x0f;
                *o = dl * (q as f32) - ml;
            }
        }
    }
    Ok(())
}

pub fn dequantize_row_q5_k(blocks: &[BlockQ5K], dst: &mut [f32]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK_K, dst.len())?;
    for (b, out) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (b.d(), b.dmin());
        for (sub, out) in out.chunks_exact_mut(32).enumerate() {
            let (sc, m) = get_scale_min_k4(sub, &b.scales);
            let dl = d * (sc as f32);
            let ml = dmin * (m as f32);
            let (c, shift) = (sub / 2, 4 * (sub % 2));
            for (l, o) in out.iter_mut().enumerate() {
                let q = ((b.qs[32 * c + l] >> shift) & 0x0f) | (((b.qh[l] >> sub) & 1) << 4);
                *o = dl * (q as f32) - ml;
            }
        }
    }
    Ok(())
}

pub fn dequantize_row_q6_k(blocks: &[BlockQ6K], dst: &mut [f32]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK_K, dst.len())?;
    for (b, out) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = b.d();
        for (sub, out) in out.chunks_exact_mut(16).enumerate() {
            let (h, s, half) = (sub / 8, (sub / 2) % 4, sub % 2);
            let dl = d * (b.scales[sub] as f32);
            let ql = &b.ql[64 * h + 32 * (s & 1) + 16 * half..][..16];
            let qh = &b.qh[32 * h + 16 * half..][..16];
            let (lshift, hshift) = (4 * (s >> 1), 2 * s);
            for ((o, &lo), &hi) in out.iter_mut().zip(ql).zip(qh) {
                let q = (((lo >> lshift) & 0x0f) | (((hi >> hshift) & 3) << 4)) as i8 - 32;
                *o = dl * (q as f32);
            }
        }
    }
    Ok(())
}

pub fn dequantize_row_q8_k(blocks: &[BlockQ8K], dst: &mut [f32]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK_K, dst.len())?;
    for (b, out) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = b.d();
        for (o, &q) in out.iter_mut().zip(&b.qs) {
            *o = d * (q as f32);
        }
    }
    Ok(())
}
