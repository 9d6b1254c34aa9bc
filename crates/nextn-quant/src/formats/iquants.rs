//! The non-linear 4-bit formats IQ4_NL and IQ4_XS: dequantization, and quantization as
//! llama-quantize does it (ggml `quantize_iq4_nl` / `quantize_iq4_xs`, with or without
//! importance weights), in plain f32 arithmetic in ggml's expression order (ggml-base is
//! built without FMA contraction, and the results match llama-quantize byte for byte).

use super::check_rows;
use super::layout::{BlockIQ4NL, BlockIQ4XS, QK32, QK_K};
use super::quantize_k::{nearest_int, GROUP_MAX_EPS};
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

/// Index of the code book entry nearest to `x` (ggml `best_index_int8`): a bisection over the
/// sorted table, the upper entry on exact ties. The comparisons are ggml's, so a NaN `x`
/// lands on the last entry as it does there.
#[inline]
fn best_index_int8(values: &[i8; 16], x: f32) -> u8 {
    if x <= values[0] as f32 {
        return 0;
    }
    if x >= values[15] as f32 {
        return 15;
    }
    let (mut ml, mut mu) = (0usize, 15usize);
    while mu - ml > 1 {
        let mav = (ml + mu) / 2;
        if x < values[mav] as f32 {
            mu = mav;
        } else {
            ml = mav;
        }
    }
    if x - (values[mu - 1] as f32) < (values[mu] as f32) - x {
        (mu - 1) as u8
    } else {
        mu as u8
    }
}

/// How many scales either side of `max/-127` the IQ4 search tries (ggml passes `ntry` 7 from
/// `quantize_iq4_nl` / `quantize_iq4_xs`, the functions `ggml_quantize_chunk` calls).
const IQ4_NTRY: i32 = 7;

/// Best scale for one 32-element block against the code book, as the per-block part of
/// ggml's `quantize_row_iq4_nl_impl`: start from `max/-127`, then try the scales
/// `(itry - 127)/max` for `itry` in `-7..=7` and keep the weighted least-squares scale of the
/// best fit. Returns 0 for an all-zero block (its codes are set later, from the final scale).
fn iq4_block_scale(x: &[f32], weight: &[f32], codes: &mut [u8]) -> f32 {
    let values = &KVALUES_IQ4NL;
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        return 0.0;
    }
    let fit = |id: f32, mut codes: Option<&mut [u8]>| -> (f32, f32) {
        let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
        for (j, (&v, &w)) in x.iter().zip(weight).enumerate() {
            let l = best_index_int8(values, id * v);
            if let Some(c) = codes.as_deref_mut() {
                c[j] = l;
            }
            let q = values[l as usize] as f32;
            sumqx += w * q * v;
            sumq2 += w * q * q;
        }
        (sumqx, sumq2)
    };
    // ggml: d = -max/values[0] (ntry > 0), id = 1/d.
    let d = -max / values[0] as f32;
    let (sumqx, sumq2) = fit(1.0 / d, Some(codes));
    let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for itry in -IQ4_NTRY..=IQ4_NTRY {
        let id = (itry + values[0] as i32) as f32 / max;
        let (sumqx, sumq2) = fit(id, None);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    d
}

/// The per-element weights of one IQ4 block: `imatrix * sqrt(sigma2 + x^2)` with importance
/// weights, `x^2` without (ggml `quantize_row_iq4_nl_impl`).
fn iq4_weights(x: &[f32], importance: Option<&[f32]>, sigma2: f32, weight: &mut [f32]) {
    match importance {
        Some(qw) => {
            for ((w, &q), &v) in weight.iter_mut().zip(qw).zip(x) {
                *w = q * (sigma2 + v * v).sqrt();
            }
        }
        None => {
            for (w, &v) in weight.iter_mut().zip(x) {
                *w = v * v;
            }
        }
    }
}

/// `2/n * sum(x^2)`, the sigma^2 of ggml's IQ4 weighting (used with importance weights only).
fn iq4_sigma2(x: &[f32]) -> f32 {
    let mut sigma2 = 0.0f32;
    for &v in x {
        sigma2 += v * v;
    }
    sigma2 * (2.0 / x.len() as f32)
}

/// Packs 32 codes as IQ4_NL / IQ4_XS store a sub-block: element `l` in the low nibble of
/// byte `l`, element `l + 16` in its high nibble.
fn pack_iq4(codes: &[u8], qs: &mut [u8]) {
    for (l, q) in qs.iter_mut().enumerate().take(16) {
        *q = codes[l] | (codes[l + 16] << 4);
    }
}

fn check_importance(importance: Option<&[f32]>, n: usize) -> Result<(), QuantError> {
    match importance {
        Some(w) if w.len() != n => Err(QuantError::SizeMismatch {
            what: "importance weights (one per element)",
            expected: n,
            got: w.len(),
        }),
        _ => Ok(()),
    }
}

/// IQ4_NL as `ggml_quantize_chunk` makes it (ggml `quantize_iq4_nl`, which runs
/// `quantize_row_iq4_nl_impl` with `ntry` 7; not `quantize_row_iq4_nl_ref`, whose `ntry` -1
/// skips the scale search). `importance`, when given, holds one weight per element of `src`.
pub fn quantize_row_iq4_nl(
    src: &[f32],
    blocks: &mut [BlockIQ4NL],
    importance: Option<&[f32]>,
) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK32, src.len())?;
    check_importance(importance, src.len())?;
    let mut weight = [0.0f32; QK32];
    let mut codes = [0u8; QK32];
    for (i, (x, b)) in src.chunks_exact(QK32).zip(blocks.iter_mut()).enumerate() {
        let qw = importance.map(|w| &w[QK32 * i..QK32 * (i + 1)]);
        let sigma2 = if qw.is_some() { iq4_sigma2(x) } else { 0.0 };
        iq4_weights(x, qw, sigma2, &mut weight);
        let d = iq4_block_scale(x, &weight, &mut codes);
        b.set_d(d);
        // A single block per "super-block": the codes are redone against the unrounded
        // scale, as ggml does when ntry > 0.
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        for (c, &v) in codes.iter_mut().zip(x) {
            *c = best_index_int8(&KVALUES_IQ4NL, id * v);
        }
        pack_iq4(&codes, &mut b.qs);
    }
    Ok(())
}

/// IQ4_XS as `ggml_quantize_chunk` makes it (ggml `quantize_iq4_xs` →
/// `quantize_row_iq4_nl_impl` with super-blocks of 256 and `ntry` 7): a scale per 32-element
/// sub-block from the same search as IQ4_NL, quantized to 6 bits against
/// `d = -max_scale/32`, then codes against `d * l` (the unrounded f32 `d`, as ggml).
/// `importance`, when given, holds one weight per element of `src`.
pub fn quantize_row_iq4_xs(
    src: &[f32],
    blocks: &mut [BlockIQ4XS],
    importance: Option<&[f32]>,
) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK_K, src.len())?;
    check_importance(importance, src.len())?;
    let mut weight = [0.0f32; 32];
    let mut codes = [0u8; QK_K];
    for (i, (x, b)) in src.chunks_exact(QK_K).zip(blocks.iter_mut()).enumerate() {
        let qw = importance.map(|w| &w[QK_K * i..QK_K * (i + 1)]);
        let sigma2 = if qw.is_some() { iq4_sigma2(x) } else { 0.0 };
        let mut scales = [0.0f32; QK_K / 32];
        let (mut max_scale, mut amax_scale) = (0.0f32, 0.0f32);
        for (ib, scale) in scales.iter_mut().enumerate() {
            let xb = &x[32 * ib..32 * ib + 32];
            iq4_weights(
                xb,
                qw.map(|w| &w[32 * ib..32 * ib + 32]),
                sigma2,
                &mut weight,
            );
            *scale = iq4_block_scale(xb, &weight, &mut codes[32 * ib..32 * ib + 32]);
            if scale.abs() > amax_scale {
                amax_scale = scale.abs();
                max_scale = *scale;
            }
        }
        let d = -max_scale / 32.0;
        b.set_d(d);
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let (mut scales_h, mut scales_l) = (0u16, [0u8; 4]);
        for (ib, &scale) in scales.iter().enumerate() {
            let l = nearest_int(id * scale).clamp(-32, 31);
            let dl = d * l as f32;
            let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
            for (c, &v) in codes[32 * ib..32 * ib + 32]
                .iter_mut()
                .zip(&x[32 * ib..32 * ib + 32])
            {
                *c = best_index_int8(&KVALUES_IQ4NL, idl * v);
            }
            let l = (l + 32) as u16;
            scales_l[ib / 2] |= ((l & 0x0f) as u8) << (4 * (ib % 2));
            scales_h |= (l >> 4) << (2 * (ib % 8));
        }
        b.scales_h = scales_h.to_le_bytes();
        b.scales_l = scales_l;
        for (ib, qs) in b.qs.chunks_exact_mut(16).enumerate() {
            pack_iq4(&codes[32 * ib..32 * ib + 32], qs);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_index_picks_the_nearest_entry() {
        let v = &KVALUES_IQ4NL;
        assert_eq!(best_index_int8(v, -1000.0), 0);
        assert_eq!(best_index_int8(v, 1000.0), 15);
        for (i, &k) in v.iter().enumerate() {
            assert_eq!(best_index_int8(v, k as f32) as usize, i, "{k}");
        }
        // Between -10 and 1: nearer to 1 above the midpoint -4.5, upper entry on the tie.
        assert_eq!(best_index_int8(v, 0.0), 8);
        assert_eq!(best_index_int8(v, -4.5), 8);
        assert_eq!(best_index_int8(v, -4.6), 7);
        // ggml's comparisons send NaN to the last entry.
        assert_eq!(best_index_int8(v, f32::NAN), 15);
    }

    #[test]
    fn iq4_nl_reproduces_a_code_book_block() {
        // A block made of code book values times 0.5 comes back exactly.
        let x: Vec<f32> = (0..32)
            .map(|i| 0.5 * KVALUES_IQ4NL[(i * 7) % 16] as f32)
            .collect();
        let mut b = [BlockIQ4NL::default()];
        quantize_row_iq4_nl(&x, &mut b, None).unwrap();
        let mut y = [0.0f32; 32];
        dequantize_row_iq4_nl(&b, &mut y).unwrap();
        assert_eq!(x, y);
    }

    #[test]
    fn iq4_xs_zero_block_stores_a_negative_zero_scale() {
        // ggml computes d = -max_scale/32 = -0.0 and stores it as is.
        let mut b = [BlockIQ4XS::default()];
        quantize_row_iq4_xs(&[0.0; 256], &mut b, None).unwrap();
        assert_eq!(u16::from_le_bytes(b[0].d), 0x8000);
        let mut y = [1.0f32; 256];
        dequantize_row_iq4_xs(&b, &mut y).unwrap();
        assert!(y.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn importance_weights_are_one_per_element() {
        let mut b = [BlockIQ4NL::default(); 2];
        let err = quantize_row_iq4_nl(&[1.0; 64], &mut b, Some(&[1.0; 32])).unwrap_err();
        assert!(matches!(
            err,
            QuantError::SizeMismatch {
                expected: 64,
                got: 32,
                ..
            }
        ));
    }
}
