//! The 32-element "legacy" formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
//!
//! Quantizers follow ggml's reference (`quantize_row_*_ref`), which gguf-py reproduces bit
//! for bit: f32 arithmetic throughout, the scale stored as f16 *after* the codes were
//! computed from the unrounded f32 scale, codes by truncation of `x/d + offset + 0.5`
//! (Q4/Q5) or by round-half-away-from-zero (Q8_0). These are also what llama-quantize
//! writes without an importance matrix; its importance-weighted paths are in
//! [`super::weighted`].

use super::layout::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, QK32};
use super::{check_rows, inverse_or_zero, round_i32_like_x86, trunc_i32_like_x86};
use crate::QuantError;

const HALF: usize = QK32 / 2;

pub fn dequantize_row_q4_0(blocks: &[BlockQ4_0], dst: &mut [f32]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK32, dst.len())?;
    for (b, out) in blocks.iter().zip(dst.chunks_exact_mut(QK32)) {
        let d = b.d();
        for (l, &q) in b.qs.iter().enumerate() {
            out[l] = d * (((q & 0x0f) as i8 - 8) as f32);
            out[l + HALF] = d * (((q >> 4) as i8 - 8) as f32);
        }
    }
    Ok(())
}

pub fn dequantize_row_q4_1(blocks: &[BlockQ4_1], dst: &mut [f32]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK32, dst.len())?;
    for (b, out) in blocks.iter().zip(dst.chunks_exact_mut(QK32)) {
        let (d, m) = (b.d(), b.m());
        for (l, &q) in b.qs.iter().enumerate() {
            out[l] = d * ((q & 0x0f) as f32) + m;
            out[l + HALF] = d * ((q >> 4) as f32) + m;
        }
    }
    Ok(())
}

pub fn dequantize_row_q5_0(blocks: &[BlockQ5_0], dst: &mut [f32]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK32, dst.len())?;
    for (b, out) in blocks.iter().zip(dst.chunks_exact_mut(QK32)) {
        let (d, qh) = (b.d(), b.qh());
        for (l, &q) in b.qs.iter().enumerate() {
            let lo = (q & 0x0f) | (((qh >> l) & 1) << 4) as u8;
            let hi = (q >> 4) | (((qh >> (l + HALF)) & 1) << 4) as u8;
            out[l] = d * ((lo as i8 - 16) as f32);
            out[l + HALF] = d * ((hi as i8 - 16) as f32);
        }
    }
    Ok(())
}

pub fn dequantize_row_q5_1(blocks: &[BlockQ5_1], dst: &mut [f32]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK32, dst.len())?;
    for (b, out) in blocks.iter().zip(dst.chunks_exact_mut(QK32)) {
        let (d, m, qh) = (b.d(), b.m(), b.qh());
        for (l, &q) in b.qs.iter().enumerate() {
            let lo = (q & 0x0f) | (((qh >> l) & 1) << 4) as u8;
            let hi = (q >> 4) | (((qh >> (l + HALF)) & 1) << 4) as u8;
            out[l] = d * (lo as f32) + m;
            out[l + HALF] = d * (hi as f32) + m;
        }
    }
    Ok(())
}

pub fn dequantize_row_q8_0(blocks: &[BlockQ8_0], dst: &mut [f32]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK32, dst.len())?;
    for (b, out) in blocks.iter().zip(dst.chunks_exact_mut(QK32)) {
        let d = b.d();
        for (o, &q) in out.iter_mut().zip(&b.qs) {
            *o = q as f32 * d;
        }
    }
    Ok(())
}

/// The element of largest magnitude, keeping its sign; the first one on ties.
fn signed_absmax(x: &[f32]) -> f32 {
    let mut best = 0.0f32;
    let mut best_abs = -1.0f32;
    for &v in x {
        if v.abs() > best_abs {
            best_abs = v.abs();
            best = v;
        }
    }
    best
}

fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        })
}

/// Truncating code clamped to `0..=max`, as the reference's `astype(uint8).clip(0, max)`
/// (byte truncation first, so a non-finite value gives code 0).
#[inline]
fn trunc_code(v: f32, max: u8) -> u8 {
    (trunc_i32_like_x86(v) as u8).min(max)
}

pub fn quantize_row_q4_0(src: &[f32], blocks: &mut [BlockQ4_0]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK32, src.len())?;
    for (x, b) in src.chunks_exact(QK32).zip(blocks.iter_mut()) {
        let d = signed_absmax(x) / -8.0;
        let id = inverse_or_zero(d);
        for l in 0..HALF {
            let lo = trunc_code(x[l] * id + 8.5, 15);
            let hi = trunc_code(x[l + HALF] * id + 8.5, 15);
            b.qs[l] = lo | (hi << 4);
        }
        b.set_d(d);
    }
    Ok(())
}

pub fn quantize_row_q4_1(src: &[f32], blocks: &mut [BlockQ4_1]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK32, src.len())?;
    for (x, b) in src.chunks_exact(QK32).zip(blocks.iter_mut()) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = inverse_or_zero(d);
        for l in 0..HALF {
            let lo = trunc_code((x[l] - min) * id + 0.5, 15);
            let hi = trunc_code((x[l + HALF] - min) * id + 0.5, 15);
            b.qs[l] = lo | (hi << 4);
        }
        b.set_d(d);
        b.set_m(min);
    }
    Ok(())
}

pub fn quantize_row_q5_0(src: &[f32], blocks: &mut [BlockQ5_0]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK32, src.len())?;
    for (x, b) in src.chunks_exact(QK32).zip(blocks.iter_mut()) {
        let d = signed_absmax(x) / -16.0;
        let id = inverse_or_zero(d);
        let mut qh = 0u32;
        for l in 0..HALF {
            let lo = trunc_code(x[l] * id + 16.5, 31);
            let hi = trunc_code(x[l + HALF] * id + 16.5, 31);
            b.qs[l] = (lo & 0x0f) | (hi << 4);
            qh |= ((lo >> 4) as u32) << l | ((hi >> 4) as u32) << (l + HALF);
        }
        b.qh = qh.to_le_bytes();
        b.set_d(d);
    }
    Ok(())
}

pub fn quantize_row_q5_1(src: &[f32], blocks: &mut [BlockQ5_1]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK32, src.len())?;
    for (x, b) in src.chunks_exact(QK32).zip(blocks.iter_mut()) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = inverse_or_zero(d);
        let mut qh = 0u32;
        for l in 0..HALF {
            let lo = trunc_code((x[l] - min) * id + 0.5, 31);
            let hi = trunc_code((x[l + HALF] - min) * id + 0.5, 31);
            b.qs[l] = (lo & 0x0f) | (hi << 4);
            qh |= ((lo >> 4) as u32) << l | ((hi >> 4) as u32) << (l + HALF);
        }
        b.qh = qh.to_le_bytes();
        b.set_d(d);
        b.set_m(min);
    }
    Ok(())
}

/// Q8_0, also the activation format for Q4_0/Q5_0/Q8_0/IQ4_NL/MXFP4 dot products.
pub fn quantize_row_q8_0(src: &[f32], blocks: &mut [BlockQ8_0]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK32, src.len())?;
    for (x, b) in src.chunks_exact(QK32).zip(blocks.iter_mut()) {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = inverse_or_zero(d);
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = round_i32_like_x86(v * id) as i8;
        }
        b.set_d(d);
    }
    Ok(())
}
