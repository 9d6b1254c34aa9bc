//! MXFP4 (OCP microscaling FP4): 32 e2m1 values sharing one E8M0 exponent.

use super::layout::{BlockMxfp4, QK32};
use super::tables::{e8m0_to_f32_half, KVALUES_MXFP4};
use super::{check_rows, trunc_i32_like_x86};
use crate::QuantError;

pub fn dequantize_row_mxfp4(blocks: &[BlockMxfp4], dst: &mut [f32]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK32, dst.len())?;
    for (b, out) in blocks.iter().zip(dst.chunks_exact_mut(QK32)) {
        let d = b.d_half();
        for (l, &q) in b.qs.iter().enumerate() {
            out[l] = d * (KVALUES_MXFP4[(q & 0x0f) as usize] as f32);
            out[l + 16] = d * (KVALUES_MXFP4[(q >> 4) as usize] as f32);
        }
    }
    Ok(())
}

/// The shared exponent for a block whose largest magnitude is `amax`: the largest e2m1
/// value (6 = 12/2) times `2^(e-127)` should cover `amax`, so `e = floor(log2 amax) - 2 + 127`.
///
/// `log2` is evaluated in f64 and rounded to f32 before the floor, which is what numpy's
/// float32 `log2` gives (so a value a few ulps below a power of two can round up to it).
/// Blocks so small that `e` would be negative (amax < 2^-125) wrap modulo 256 as the
/// reference's byte cast does on x86; their codes are then all zero, so the block still
/// decodes to zeros.
fn shared_exponent(amax: f32) -> u8 {
    if amax > 0.0 {
        let log2 = (amax as f64).log2() as f32;
        trunc_i32_like_x86(log2.floor() - 2.0 + 127.0) as u8
    } else {
        0
    }
}

/// MXFP4 quantization as ggml's reference: shared exponent from the block maximum, then
/// the nearest code for each element (the first one on ties).
pub fn quantize_row_mxfp4(src: &[f32], blocks: &mut [BlockMxfp4]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK32, src.len())?;
    for (x, b) in src.chunks_exact(QK32).zip(blocks.iter_mut()) {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let e = shared_exponent(amax);
        let d = e8m0_to_f32_half(e);
        let code = |v: f32| -> u8 {
            let mut best = 0u8;
            let mut best_err = f32::INFINITY;
            for (k, &kv) in KVALUES_MXFP4.iter().enumerate() {
                let err = (d * (kv as f32) - v).abs();
                if err < best_err {
                    best_err = err;
                    best = k as u8;
                }
            }
            best
        };
        for l in 0..16 {
            b.qs[l] = code(x[l]) | (code(x[l + 16]) << 4);
        }
        b.e = [e];
    }
    Ok(())
}
