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
        for (j, o) in out.iter_mut().enumerate() {
            let (h, s, l) = (j / 128, (j / 32) % 4, j % 32);
            let q = (b.qs[32 * h + l] >> (2 * s)) & 3;
            let sc = b.scales[j / 16];
            let dl = d * ((sc & 0x0f) as f32);
            let ml = dmin * ((sc >> 4) as f32);
            *o = dl * (q as f32) - ml;
        }
    }
    Ok(())
}

pub fn dequantize_row_q3_k(blocks: &[BlockQ3K], dst: &mut [f32]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK_K, dst.len())?;
    for (b, out) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = b.d();
        let scales = q3k_scales(&b.scales);
        for (j, o) in out.iter_mut().enumerate() {
            let (h, s, l) = (j / 128, (j / 32) % 4, j % 32);
            let low = ((b.qs[32 * h + l] >> (2 * s)) & 3) as i8;
            let high_set = (b.hmask[j % 32] >> (j / 32)) & 1 == 1;
            let q = if high_set { low } else { low - 4 };
            let dl = d * (scales[j / 16] as f32);
            *o = dl * (q as f32);
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
        for (j, o) in out.iter_mut().enumerate() {
            let (h, s, l) = (j / 128, (j / 32) % 4, j % 32);
            let low = (b.ql[64 * h + 32 * (s & 1) + l] >> (4 * (s >> 1))) & 0x0f;
            let high = (b.qh[32 * h + l] >> (2 * s)) & 3;
            let q = (low | (high << 4)) as i8 - 32;
            let dl = d * (b.scales[j / 16] as f32);
            *o = dl * (q as f32);
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
