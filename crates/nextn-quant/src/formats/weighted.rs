//! Quantization with importance weights: the paths ggml takes when llama-quantize is given
//! an importance matrix (`--imatrix`), i.e. `quantize_q4_0` ... `quantize_q6_K` with
//! `quant_weights != NULL`, which run `quantize_row_*_impl` instead of the reference
//! quantizers.
//!
//! Every function here quantizes ONE ggml row and takes one weight per element of it (the
//! importance matrix entry of each column). The row matters: the legacy formats scale their
//! weights by the variance of the whole row (`sigma2 = sum(x^2)/n_per_row`), so a row must
//! not be split or joined with another. The K-quants use the variance of each 256-element
//! super-block instead.
//!
//! The arithmetic is plain f32 in ggml's expression order: ggml-base, which holds these
//! functions, is built without `-march`, so there is no FMA contraction to mimic.

use super::check_rows;
use super::layout::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, QK32, QK_K,
};
use super::quantize_k::{
    finish_q3_k, make_qx_quants, nearest_int, pack_2bit, pack_q4_k, pack_q5_k, requantize_k, Qkx2,
    GROUP_MAX_EPS,
};
use super::tables::pack_scale_min_k4;
use crate::QuantError;

/// Unsigned codes in `0..=nmax` for `x ≈ scale * L - the_min` with the given weights (ggml
/// `make_qkx3_quants` with weights and `use_mad` false): the same search as `make_qkx2_quants`
/// ([`Qkx2`]) with the sweep every weighted caller uses, `rmin` -0.9, `rdelta` 0.05, 37 steps,
/// squared errors. Returns `(scale, the_min)`, `the_min >= 0` being the negated offset.
fn make_qkx3_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    codes: &mut [u8],
    aux: &mut [u8],
) -> (f32, f32) {
    Qkx2 {
        nmax,
        rmin: -0.9,
        rdelta: 0.05,
        nstep: 36,
        use_mad: false,
    }
    .run(x, weights, codes, aux)
}

/// Unsigned codes in `0..=nmax` for the non-negative values `x` (sub-block scales or mins)
/// with weights `quant_weights` (ggml `make_qp_quants`): the best of 9 scales near
/// `max/nmax`, then up to 5 sweeps of coordinate descent on the codes; returns the
/// least-squares scale. Codes are stored as ggml stores them, a C `int` in a `uint8_t`
/// (wrapping, should a code ever be negative), and the sweeps read them back as such.
fn make_qp_quants(nmax: i32, x: &[f32], codes: &mut [u8], quant_weights: &[f32]) -> f32 {
    let mut max = 0.0f32;
    for &v in x {
        // C `MAX(max, x[i])`: `max > x ? max : x`, so a NaN `x` replaces `max`.
        max = if max > v { max } else { v };
    }
    if max < GROUP_MAX_EPS {
        codes.fill(0);
        return 0.0;
    }
    let mut iscale = nmax as f32 / max;
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = nearest_int(iscale * v) as u8;
    }
    let scale = 1.0 / iscale;
    let mut best_mse = 0.0f32;
    for ((&v, &c), &w) in x.iter().zip(codes.iter()).zip(quant_weights) {
        let diff = v - scale * c as f32;
        best_mse += w * diff * diff;
    }
    for is in (-4..=4).filter(|&is| is != 0) {
        let iscale_is = (0.1 * is as f32 + nmax as f32) / max;
        let scale_is = 1.0 / iscale_is;
        let mut mse = 0.0f32;
        for (&v, &w) in x.iter().zip(quant_weights) {
            let l = nearest_int(iscale_is * v).min(nmax);
            let diff = v - scale_is * l as f32;
            mse += w * diff * diff;
        }
        if mse < best_mse {
            best_mse = mse;
            iscale = iscale_is;
        }
    }
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for ((c, &v), &w) in codes.iter_mut().zip(x).zip(quant_weights) {
        let l = nearest_int(iscale * v).min(nmax);
        *c = l as u8;
        // ggml accumulates with the `int` before the byte store.
        sumlx += w * v * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for ((c, &v), &w) in codes.iter_mut().zip(x).zip(quant_weights) {
            let l = *c as f32;
            let mut slx = sumlx - w * v * l;
            let mut sl2 = suml2 - w * l * l;
            if slx > 0.0 && sl2 > 0.0 {
                let new_l = nearest_int(v * sl2 / slx).min(nmax);
                if new_l != *c as i32 {
                    slx += w * v * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *c = new_l as u8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// `sum(x^2)` in element order, the statistic the weighted paths scale their weights by.
fn sum_squares(x: &[f32]) -> f32 {
    let mut s = 0.0f32;
    for &v in x {
        s += v * v;
    }
    s
}

/// `imatrix * sqrt(sigma2 + x^2)`, ggml's weighting of the importance matrix by the
/// magnitude of each value.
fn weigh(x: &[f32], qw: &[f32], sigma2: f32, weight: &mut [f32]) {
    for ((w, &q), &v) in weight.iter_mut().zip(qw).zip(x) {
        *w = q * (sigma2 + v * v).sqrt();
    }
}

fn sum(x: &[f32]) -> f32 {
    let mut s = 0.0f32;
    for &v in x {
        s += v;
    }
    s
}

/// Checks one row of `n` values against its blocks and its weights.
fn check_row(n_blocks: usize, block: usize, n: usize, weights: &[f32]) -> Result<(), QuantError> {
    check_rows(n_blocks, block, n)?;
    if weights.len() != n {
        return Err(QuantError::SizeMismatch {
            what: "importance weights (one per element of the row)",
            expected: n,
            got: weights.len(),
        });
    }
    Ok(())
}

/// `sum(x^2)/n` over the whole row, the legacy formats' variance.
fn row_sigma2(row: &[f32]) -> f32 {
    sum_squares(row) / row.len() as f32
}

/// Packs 32 codes as the legacy 4-bit formats do: element `j` low nibble, `j + 16` high.
fn pack_nibbles(codes: &[u8; QK32], qs: &mut [u8; 16]) {
    for (j, q) in qs.iter_mut().enumerate() {
        *q = codes[j] | (codes[j + 16] << 4);
    }
}

/// Packs 32 five-bit codes: low nibbles as [`pack_nibbles`], fifth bits into `qh`.
fn pack_5bit(codes: &[u8; QK32], qs: &mut [u8; 16], qh: &mut [u8; 4]) {
    let mut h = 0u32;
    for (j, q) in qs.iter_mut().enumerate() {
        let (lo, hi) = (codes[j], codes[j + 16]);
        *q = (lo & 0x0f) | ((hi & 0x0f) << 4);
        h |= (((lo & 0x10) >> 4) as u32) << j;
        h |= (((hi & 0x10) >> 4) as u32) << (j + 16);
    }
    *qh = h.to_le_bytes();
}

/// One row of Q4_0 with importance weights (ggml `quantize_row_q4_0_impl`): signed codes
/// from `make_qx_quants` (nmax 8) per block.
pub fn quantize_row_q4_0_weighted(
    row: &[f32],
    blocks: &mut [BlockQ4_0],
    weights: &[f32],
) -> Result<(), QuantError> {
    check_row(blocks.len(), QK32, row.len(), weights)?;
    let sigma2 = row_sigma2(row);
    let (mut weight, mut codes) = ([0.0f32; QK32], [0u8; QK32]);
    for ((x, qw), b) in row
        .chunks_exact(QK32)
        .zip(weights.chunks_exact(QK32))
        .zip(blocks.iter_mut())
    {
        weigh(x, qw, sigma2, &mut weight);
        let d = make_qx_quants(8, x, Some(&weight), &mut codes);
        b.set_d(d);
        pack_nibbles(&codes, &mut b.qs);
    }
    Ok(())
}

/// One row of Q4_1 with importance weights (ggml `quantize_row_q4_1_impl`).
pub fn quantize_row_q4_1_weighted(
    row: &[f32],
    blocks: &mut [BlockQ4_1],
    weights: &[f32],
) -> Result<(), QuantError> {
    check_row(blocks.len(), QK32, row.len(), weights)?;
    let sigma2 = row_sigma2(row);
    let (mut weight, mut codes, mut aux) = ([0.0f32; QK32], [0u8; QK32], [0u8; QK32]);
    for ((x, qw), b) in row
        .chunks_exact(QK32)
        .zip(weights.chunks_exact(QK32))
        .zip(blocks.iter_mut())
    {
        weigh(x, qw, sigma2, &mut weight);
        let (d, the_min) = make_qkx3_quants(15, x, &weight, &mut codes, &mut aux);
        b.set_d(d);
        b.set_m(-the_min);
        pack_nibbles(&codes, &mut b.qs);
    }
    Ok(())
}

/// One row of Q5_0 with importance weights (ggml `quantize_row_q5_0_impl`).
pub fn quantize_row_q5_0_weighted(
    row: &[f32],
    blocks: &mut [BlockQ5_0],
    weights: &[f32],
) -> Result<(), QuantError> {
    check_row(blocks.len(), QK32, row.len(), weights)?;
    let sigma2 = row_sigma2(row);
    let (mut weight, mut codes) = ([0.0f32; QK32], [0u8; QK32]);
    for ((x, qw), b) in row
        .chunks_exact(QK32)
        .zip(weights.chunks_exact(QK32))
        .zip(blocks.iter_mut())
    {
        weigh(x, qw, sigma2, &mut weight);
        let d = make_qx_quants(16, x, Some(&weight), &mut codes);
        b.set_d(d);
        pack_5bit(&codes, &mut b.qs, &mut b.qh);
    }
    Ok(())
}

/// One row of Q5_1 with importance weights (ggml `quantize_row_q5_1_impl`).
pub fn quantize_row_q5_1_weighted(
    row: &[f32],
    blocks: &mut [BlockQ5_1],
    weights: &[f32],
) -> Result<(), QuantError> {
    check_row(blocks.len(), QK32, row.len(), weights)?;
    let sigma2 = row_sigma2(row);
    let (mut weight, mut codes, mut aux) = ([0.0f32; QK32], [0u8; QK32], [0u8; QK32]);
    for ((x, qw), b) in row
        .chunks_exact(QK32)
        .zip(weights.chunks_exact(QK32))
        .zip(blocks.iter_mut())
    {
        weigh(x, qw, sigma2, &mut weight);
        let (d, the_min) = make_qkx3_quants(31, x, &weight, &mut codes, &mut aux);
        b.set_d(d);
        b.set_m(-the_min);
        pack_5bit(&codes, &mut b.qs, &mut b.qh);
    }
    Ok(())
}

/// Q2_K with importance weights (ggml `quantize_row_q2_K_impl`): per 16-element sub-block
/// a (scale, min) from `make_qkx3_quants`, both sets quantized to 4 bits by
/// `make_qp_quants` weighted by the sub-block's total weight, then codes against the
/// stored values. One weight per element of `src` (super-blocks are independent).
pub fn quantize_row_q2_k_weighted(
    src: &[f32],
    blocks: &mut [BlockQ2K],
    weights: &[f32],
) -> Result<(), QuantError> {
    check_row(blocks.len(), QK_K, src.len(), weights)?;
    for ((x, qw), b) in src
        .chunks_exact(QK_K)
        .zip(weights.chunks_exact(QK_K))
        .zip(blocks.iter_mut())
    {
        let mut codes = [0u8; QK_K];
        let (mut weight, mut aux) = ([0.0f32; 16], [0u8; 16]);
        let (mut scales, mut mins, mut sw) = ([0.0f32; 16], [0.0f32; 16], [0.0f32; 16]);
        let sigma2 = sum_squares(x) / QK_K as f32;
        for j in 0..16 {
            let xs = &x[16 * j..16 * j + 16];
            weigh(xs, &qw[16 * j..16 * j + 16], sigma2, &mut weight);
            sw[j] = sum(&weight);
            (scales[j], mins[j]) =
                make_qkx3_quants(3, xs, &weight, &mut codes[16 * j..16 * j + 16], &mut aux);
        }
        let (mut ls, mut lm) = ([0u8; 16], [0u8; 16]);
        let dm = make_qp_quants(15, &scales, &mut ls, &sw);
        let mm = make_qp_quants(15, &mins, &mut lm, &sw);
        b.set_d(dm);
        b.set_dmin(mm);
        let (dm, mm) = (b.d(), b.dmin());
        for (s, (&l, &m)) in b.scales.iter_mut().zip(ls.iter().zip(&lm)) {
            *s = l | (m << 4);
        }
        for j in 0..16 {
            let d = dm * (b.scales[j] & 0x0f) as f32;
            if d == 0.0 {
                continue;
            }
            let m = mm * (b.scales[j] >> 4) as f32;
            for i in 16 * j..16 * j + 16 {
                codes[i] = nearest_int((x[i] + m) / d).clamp(0, 3) as u8;
            }
        }
        pack_2bit(&codes, &mut b.qs);
    }
    Ok(())
}

/// Q3_K with importance weights (ggml `quantize_row_q3_K_impl`): per 16-element sub-block
/// a signed scale from `make_qx_quants` (nmax 4), the 16 scales themselves quantized to 6
/// bits by `make_qx_quants` (nmax 32) weighted by each sub-block's total weight.
pub fn quantize_row_q3_k_weighted(
    src: &[f32],
    blocks: &mut [BlockQ3K],
    weights: &[f32],
) -> Result<(), QuantError> {
    check_row(blocks.len(), QK_K, src.len(), weights)?;
    for ((x, qw), b) in src
        .chunks_exact(QK_K)
        .zip(weights.chunks_exact(QK_K))
        .zip(blocks.iter_mut())
    {
        let mut codes = [0u8; QK_K];
        let mut weight = [0.0f32; 16];
        let (mut scales, mut sw) = ([0.0f32; 16], [0.0f32; 16]);
        let sigma2 = 2.0 * sum_squares(x) / QK_K as f32;
        for j in 0..16 {
            let xs = &x[16 * j..16 * j + 16];
            weigh(xs, &qw[16 * j..16 * j + 16], sigma2, &mut weight);
            sw[j] = sum(&weight);
            scales[j] = make_qx_quants(4, xs, Some(&weight), &mut codes[16 * j..16 * j + 16]);
        }
        let mut ls = [0u8; 16];
        let d_block = make_qx_quants(32, &scales, Some(&sw), &mut ls);
        b.scales = [0; 12];
        for (j, &l) in ls.iter().enumerate() {
            if j < 8 {
                b.scales[j] = l & 0x0f;
            } else {
                b.scales[j - 8] |= (l & 0x0f) << 4;
            }
            b.scales[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
        }
        b.set_d(d_block);
        finish_q3_k(x, b, &mut codes);
    }
    Ok(())
}

/// The sub-block search of ggml's weighted Q4_K / Q5_K (`quantize_row_q4_K_impl`,
/// `quantize_row_q5_K_impl`): per 32-element sub-block a (scale, min) from
/// `make_qkx3_quants`, then both sets quantized to 6 bits by `make_qp_quants` weighted by
/// each sub-block's total weight. Returns the packed scales and the two super-block scales.
fn scales_mins_k_weighted(
    x: &[f32],
    qw: &[f32],
    nmax: i32,
    clamp_to_6_bits: bool,
    codes: &mut [u8; QK_K],
) -> ([u8; 12], f32, f32) {
    let (mut weight, mut aux) = ([0.0f32; 32], [0u8; 32]);
    let (mut scales, mut mins, mut sw) = ([0.0f32; 8], [0.0f32; 8], [0.0f32; 8]);
    let sigma2 = 2.0 * sum_squares(x) / QK_K as f32;
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        weigh(xs, &qw[32 * j..32 * j + 32], sigma2, &mut weight);
        sw[j] = sum(&weight);
        (scales[j], mins[j]) =
            make_qkx3_quants(nmax, xs, &weight, &mut codes[32 * j..32 * j + 32], &mut aux);
    }
    let (mut ls, mut lm) = ([0u8; 8], [0u8; 8]);
    let d_block = make_qp_quants(63, &scales, &mut ls, &sw);
    let m_block = make_qp_quants(63, &mins, &mut lm, &sw);
    if clamp_to_6_bits {
        // Only the Q5_K path clamps (a no-op unless a code wrapped), as in ggml.
        ls = ls.map(|l| l.min(63));
        lm = lm.map(|l| l.min(63));
    }
    (pack_scale_min_k4(&ls, &lm), d_block, m_block)
}

/// Q4_K with importance weights (ggml `quantize_row_q4_K_impl`).
pub fn quantize_row_q4_k_weighted(
    src: &[f32],
    blocks: &mut [BlockQ4K],
    weights: &[f32],
) -> Result<(), QuantError> {
    check_row(blocks.len(), QK_K, src.len(), weights)?;
    for ((x, qw), b) in src
        .chunks_exact(QK_K)
        .zip(weights.chunks_exact(QK_K))
        .zip(blocks.iter_mut())
    {
        let mut codes = [0u8; QK_K];
        let (scales, d, dmin) = scales_mins_k_weighted(x, qw, 15, false, &mut codes);
        b.scales = scales;
        b.set_d(d);
        b.set_dmin(dmin);
        requantize_k(x, &b.scales, b.d(), b.dmin(), 15, &mut codes);
        pack_q4_k(&codes, &mut b.qs);
    }
    Ok(())
}

/// Q5_K with importance weights (ggml `quantize_row_q5_K_impl`).
pub fn quantize_row_q5_k_weighted(
    src: &[f32],
    blocks: &mut [BlockQ5K],
    weights: &[f32],
) -> Result<(), QuantError> {
    check_row(blocks.len(), QK_K, src.len(), weights)?;
    for ((x, qw), b) in src
        .chunks_exact(QK_K)
        .zip(weights.chunks_exact(QK_K))
        .zip(blocks.iter_mut())
    {
        let mut codes = [0u8; QK_K];
        let (scales, d, dmin) = scales_mins_k_weighted(x, qw, 31, true, &mut codes);
        b.scales = scales;
        b.set_d(d);
        b.set_dmin(dmin);
        requantize_k(x, &b.scales, b.d(), b.dmin(), 31, &mut codes);
        pack_q5_k(&codes, b);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qp_quants_fit_exact_multiples() {
        // Values on the grid 0.5 * L come back as exactly those codes and that scale.
        let x: Vec<f32> = (0..16).map(|i| 0.5 * (i % 16) as f32).collect();
        let w = [1.0f32; 16];
        let mut codes = [0u8; 16];
        let scale = make_qp_quants(15, &x, &mut codes, &w);
        assert_eq!(scale, 0.5);
        let expected: Vec<u8> = (0..16).map(|i| (i % 16) as u8).collect();
        assert_eq!(codes.to_vec(), expected);
    }

    #[test]
    fn qp_quants_of_zeros_are_zero() {
        let mut codes = [7u8; 8];
        assert_eq!(make_qp_quants(63, &[0.0; 8], &mut codes, &[1.0; 8]), 0.0);
        assert_eq!(codes, [0; 8]);
    }

    #[test]
    fn qkx3_quants_recover_an_affine_grid() {
        // x = 0.25 * L - 1 is representable exactly: scale 0.25, min 1.
        let x: Vec<f32> = (0..32).map(|i| 0.25 * (i % 16) as f32 - 1.0).collect();
        let w = [1.0f32; 32];
        let (mut codes, mut aux) = ([0u8; 32], [0u8; 32]);
        let (scale, the_min) = make_qkx3_quants(15, &x, &w, &mut codes, &mut aux);
        assert_eq!((scale, the_min), (0.25, 1.0));
        for (i, &c) in codes.iter().enumerate() {
            assert_eq!(c as usize, i % 16);
        }
    }

    #[test]
    fn qkx3_quants_of_a_constant_block() {
        let (mut codes, mut aux) = ([9u8; 32], [0u8; 32]);
        // A positive constant: min is clamped to 0, so the range is (0, c].
        let (scale, the_min) = make_qkx3_quants(15, &[2.0; 32], &[1.0; 32], &mut codes, &mut aux);
        assert_eq!(the_min, 0.0);
        assert!((scale * 15.0 - 2.0).abs() < 1e-6, "{scale}");
        // All zeros: nothing to fit.
        let (scale, the_min) = make_qkx3_quants(15, &[0.0; 32], &[1.0; 32], &mut codes, &mut aux);
        assert_eq!((scale, the_min, codes), (0.0, 0.0, [0u8; 32]));
    }

    #[test]
    fn weights_must_cover_the_row() {
        let mut b = [BlockQ4_0::default(); 2];
        let err = quantize_row_q4_0_weighted(&[1.0; 64], &mut b, &[1.0; 32]).unwrap_err();
        assert!(matches!(
            err,
            QuantError::SizeMismatch {
                expected: 64,
                got: 32,
                ..
            }
        ));
        let mut k = [BlockQ4K::default(); 1];
        assert!(quantize_row_q4_k_weighted(&[1.0; 256], &mut k, &[1.0; 255]).is_err());
    }
}
