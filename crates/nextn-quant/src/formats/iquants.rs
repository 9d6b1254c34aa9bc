//! Dequantization of the non-linear 4-bit formats IQ4_NL and IQ4_XS.

use super::check_rows;
use super::layout::{BlockIQ4NL, BlockIQ4XS, QK32, QK_K};
use super::tables::{iq4xs_scale, KVALUES_IQ4NL};
use crate::QuantError;

pub fn dequantize_row_iq4_nl(blocks: &[BlockIQ4NL], dst: &mut [f32]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK32, dst.len())?;
    for (b, out) in blocks.iter().zip(dst.chunks_exact_mut(QK32)) {
        let d = b.d();
        for (l, &q) in b.qs.iter().enumerate() {
            out[l] = d * (KVALUES_IQ4NL[(q & 0x0f) as usize] as f32);
            out[l + 16] = d * (KVALUES_IQ4NL[(q >> 4) as usize] as f32);
        }
    }
    Ok(())
}

pub fn dequantize_row_iq4_xs(blocks: &[BlockIQ4XS], dst: &mut [f32]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK_K, dst.len())?;
    for (b, out) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let (d, scales_h) = (b.d(), b.scales_h());
        for (ib, out) in out.chunks_exact_mut(32).enumerate() {
            let dl = d * (iq4xs_scale(ib, scales_h, &b.scales_l) as f32);
            for (l, &q) in b.qs[16 * ib..16 * ib + 16].iter().enumerate() {
                out[l] = dl * (KVALUES_IQ4NL[(q & 0x0f) as usize] as f32);
                out[l + 16] = dl * (KVALUES_IQ4NL[(q >> 4) as usize] as f32);
            }
        }
    }
    Ok(())
}
