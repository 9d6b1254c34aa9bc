//! K-quant quantizers, following ggml's reference algorithms (`quantize_row_q*_K_ref`,
//! without importance weights): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and the Q8_K activation format.
//!
//! The search for sub-block scales is ggml's: `make_qx_quants` (signed codes, weighted
//! least squares over 19 candidate scales), `make_q3_quants` (signed codes, coordinate
//! descent), `make_qkx2_quants` (unsigned codes with a min, least squares over a sweep
//! of scales). Sub-block scales are then themselves quantized (6 bits for Q4_K/Q5_K,
//! 8 for Q6_K, 4 for Q2_K) and the codes recomputed against the stored scales.
//!
//! The arithmetic is plain f32 in ggml's expression order, without fused multiply-adds:
//! llama.cpp builds ggml-base (which holds these C functions, and `ggml_quantize_chunk`
//! that llama-quantize calls) without `-march`, so the compiler has no FMA to contract
//! into. The results are byte-identical to llama-quantize's (`tests/quantize_llamacpp.rs`)
//! and to ggml compiled with `-ffp-contract=off` (`tests/formats.rs`). A ggml built with
//! FMA contraction (e.g. `-march=native` added to its C flags) can differ in the last bit
//! of a scale and so in codes near a rounding boundary.
//!
//! The importance-weighted variants (llama-quantize `--imatrix`) are in
//! [`super::weighted`].

use super::check_rows;
use super::layout::{
    blocks_from_bytes_mut, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, QK_K,
};
use super::tables::{get_scale_min_k4, pack_scale_min_k4, q3k_scale};
use crate::QuantError;
use nextn_gguf::GgmlType;

/// Groups whose largest magnitude is below this are all-zero (ggml `GROUP_MAX_EPS`).
pub(crate) const GROUP_MAX_EPS: f32 = 1e-15;

/// Round to nearest, ties to even, for `|x| <= 2^22` (ggml `nearest_int`): adding
/// 1.5 * 2^23 leaves the integer in the low mantissa bits. Outside that range the
/// result is meaningless but defined; every caller clamps it.
#[inline]
pub fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Whether this module quantizes `ty`.
pub fn has_quantizer(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K)
}

/// Byte-level entry for [`super::quantize`]; `dst` has already been sized.
pub(crate) fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    use GgmlType::*;
    match ty {
        Q2_K => quantize_row_q2_k(src, blocks_from_bytes_mut(dst)?),
        Q3_K => quantize_row_q3_k(src, blocks_from_bytes_mut(dst)?),
        Q4_K => quantize_row_q4_k(src, blocks_from_bytes_mut(dst)?),
        Q5_K => quantize_row_q5_k(src, blocks_from_bytes_mut(dst)?),
        Q6_K => quantize_row_q6_k(src, blocks_from_bytes_mut(dst)?),
        Q8_K => quantize_row_q8_k(src, blocks_from_bytes_mut(dst)?),
        _ => Err(QuantError::NoSuchOp { ty, op: "quantize" }),
    }
}

/// The element of largest magnitude with its sign (first on ties), and that magnitude.
fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut max, mut amax) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    (max, amax)
}

/// Signed codes `L[i] + nmax` in `0..2*nmax` for `x`, choosing among 19 scales near
/// `max/-nmax` the one that maximises the weighted fit; returns the scale (ggml
/// `make_qx_quants` with `rmse_type` 1). The weights are `x^2` unless `weights` gives
/// them (the importance-weighted paths), one per element of `x`.
pub(crate) fn make_qx_quants(
    nmax: i32,
    x: &[f32],
    weights: Option<&[f32]>,
    codes: &mut [u8],
) -> f32 {
    let (max, amax) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        codes.fill(0);
        return 0.0;
    }
    let weight = |i: usize| match weights {
        Some(w) => w[i],
        None => x[i] * x[i],
    };
    let fit = |iscale: f32| -> (f32, f32) {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for (i, &v) in x.iter().enumerate() {
            let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = weight(i);
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let assign = |iscale: f32, codes: &mut [u8]| {
        for (c, &v) in codes.iter_mut().zip(x) {
            *c = (nearest_int(iscale * v).clamp(-nmax, nmax - 1) + nmax) as u8;
        }
    };
    let iscale = -(nmax as f32) / max;
    assign(iscale, codes);
    let (sumlx, suml2) = fit(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&is| is != 0) {
        let iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = fit(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            assign(iscale, codes);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Signed codes `L[i] + nmax` refined one element at a time (up to 5 sweeps) while the
/// weighted fit improves; returns the least-squares scale.
fn make_q3_quants(nmax: i32, x: &[f32], codes: &mut [u8]) -> f32 {
    let (max, amax) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        codes.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut levels = [0i32; 16];
    let levels = &mut levels[..x.len()];
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for (l, &v) in levels.iter_mut().zip(x) {
        *l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        let w = v * v;
        sumlx += w * v * *l as f32;
        suml2 += w * *l as f32 * *l as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (l, &v) in levels.iter_mut().zip(x) {
            let w = v * v;
            let mut slx = sumlx - w * v * *l as f32;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * *l as f32 * *l as f32;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != *l {
                    slx += w * v * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *l = new_l;
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
    for (c, &l) in codes.iter_mut().zip(levels.iter()) {
        *c = (l + nmax) as u8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// Unsigned codes in `0..=nmax` for `x ≈ scale * L - min_out`, trying the scales
/// `(nmax + rmin + rdelta*is) / (max - min)` for `is` in `0..=nstep` and keeping the
/// least-squares (scale, min) of lowest weighted error. Returns (scale, min_out >= 0).
pub(super) struct Qkx2 {
    pub(super) nmax: i32,
    pub(super) rmin: f32,
    pub(super) rdelta: f32,
    pub(super) nstep: i32,
    pub(super) use_mad: bool,
}

impl Qkx2 {
    pub(super) fn run(
        &self,
        x: &[f32],
        weights: &[f32],
        codes: &mut [u8],
        aux: &mut [u8],
    ) -> (f32, f32) {
        let nmax = self.nmax;
        let (mut min, mut max) = (x[0], x[0]);
        let mut sum_w = weights[0];
        let mut sum_x = sum_w * x[0];
        for (&v, &w) in x.iter().zip(weights).skip(1) {
            if v < min {
                min = v;
            }
            if v > max {
                max = v;
            }
            sum_w += w;
            sum_x += w * v;
        }
        if min > 0.0 {
            min = 0.0;
        }
        if max == min {
            codes.fill(0);
            return (0.0, -min);
        }
        let error_of = |scale: f32, min: f32, codes: &[u8]| -> f32 {
            let mut err = 0.0f32;
            for ((&v, &w), &l) in x.iter().zip(weights).zip(codes) {
                let diff = scale * l as f32 + min - v;
                err += w * if self.use_mad {
                    diff.abs()
                } else {
                    diff * diff
                };
            }
            err
        };
        let mut iscale = nmax as f32 / (max - min);
        let mut scale = 1.0 / iscale;
        for (c, &v) in codes.iter_mut().zip(x) {
            *c = nearest_int(iscale * (v - min)).clamp(0, nmax) as u8;
        }
        let mut best_error = error_of(scale, min, codes);
        for is in 0..=self.nstep {
            iscale = (self.rmin + self.rdelta * is as f32 + nmax as f32) / (max - min);
            let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
            for ((a, &v), &w) in aux.iter_mut().zip(x).zip(weights) {
                let l = nearest_int(iscale * (v - min)).clamp(0, nmax);
                *a = l as u8;
                let l = l as f32;
                sum_l += w * l;
                sum_l2 += w * l * l;
                sum_xl += w * l * v;
            }
            let det = sum_w * sum_l2 - sum_l * sum_l;
            if det > 0.0 {
                let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
                let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
                if this_min > 0.0 {
                    this_min = 0.0;
                    this_scale = sum_xl / sum_l2;
                }
                let cur_error = error_of(this_scale, this_min, aux);
                if cur_error < best_error {
                    codes.copy_from_slice(aux);
                    best_error = cur_error;
                    scale = this_scale;
                    min = this_min;
                }
            }
        }
        (scale, -min)
    }
}

/// Packs 2-bit codes as Q2_K/Q3_K store them: byte `32*h + l`, bits `2*s`, holds code
/// `128*h + 32*s + l`.
pub(crate) fn pack_2bit(codes: &[u8; QK_K], qs: &mut [u8; 64]) {
    for h in 0..2 {
        for l in 0..32 {
            let c = |s: usize| codes[128 * h + 32 * s + l] & 3;
            qs[32 * h + l] = c(0) | (c(1) << 2) | (c(2) << 4) | (c(3) << 6);
        }
    }
}

pub fn quantize_row_q2_k(src: &[f32], blocks: &mut [BlockQ2K]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK_K, src.len())?;
    let search = Qkx2 {
        nmax: 3,
        rmin: -0.5,
        rdelta: 0.1,
        nstep: 15,
        use_mad: true,
    };
    for (x, b) in src.chunks_exact(QK_K).zip(blocks.iter_mut()) {
        let mut codes = [0u8; QK_K];
        let mut aux = [0u8; 16];
        let mut scales = [0.0f32; 16];
        let mut mins = [0.0f32; 16];
        let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
        for j in 0..16 {
            let xs = &x[16 * j..16 * j + 16];
            let weights: [f32; 16] = std::array::from_fn(|l| xs[l].abs());
            (scales[j], mins[j]) =
                search.run(xs, &weights, &mut codes[16 * j..16 * j + 16], &mut aux);
            max_scale = max_scale.max(scales[j]);
            max_min = max_min.max(mins[j]);
        }
        // Codes are truncated to a byte as ggml stores them (`uint8_t = int`).
        if max_scale > 0.0 {
            let iscale = 15.0 / max_scale;
            for (packed, &scale) in b.scales.iter_mut().zip(&scales) {
                *packed = nearest_int(iscale * scale) as u8;
            }
            b.set_d(max_scale / 15.0);
        } else {
            b.scales = [0; 16];
            b.set_d(0.0);
        }
        if max_min > 0.0 {
            let iscale = 15.0 / max_min;
            for (packed, &min) in b.scales.iter_mut().zip(&mins) {
                *packed |= (nearest_int(iscale * min) << 4) as u8;
            }
            b.set_dmin(max_min / 15.0);
        } else {
            b.set_dmin(0.0);
        }
        let (d_all, dmin_all) = (b.d(), b.dmin());
        for j in 0..16 {
            let d = d_all * (b.scales[j] & 0x0f) as f32;
            if d == 0.0 {
                continue;
            }
            let dm = dmin_all * (b.scales[j] >> 4) as f32;
            for i in 16 * j..16 * j + 16 {
                codes[i] = nearest_int((x[i] + dm) / d).clamp(0, 3) as u8;
            }
        }
        pack_2bit(&codes, &mut b.qs);
    }
    Ok(())
}

pub fn quantize_row_q3_k(src: &[f32], blocks: &mut [BlockQ3K]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK_K, src.len())?;
    for (x, b) in src.chunks_exact(QK_K).zip(blocks.iter_mut()) {
        let mut codes = [0u8; QK_K];
        let mut scales = [0.0f32; 16];
        let (mut max_scale, mut amax) = (0.0f32, 0.0f32);
        for j in 0..16 {
            scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut codes[16 * j..16 * j + 16]);
            if scales[j].abs() > amax {
                amax = scales[j].abs();
                max_scale = scales[j];
            }
        }
        b.scales = [0; 12];
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for (j, &scale) in scales.iter().enumerate() {
                // ggml keeps the code in an i8 before clamping.
                let l = (nearest_int(iscale * scale) as i8).clamp(-32, 31) as i32 + 32;
                if j < 8 {
                    b.scales[j] = (l & 0x0f) as u8;
                } else {
                    b.scales[j - 8] |= ((l & 0x0f) << 4) as u8;
                }
                b.scales[8 + j % 4] |= ((l >> 4) << (2 * (j / 4))) as u8;
            }
            b.set_d(1.0 / iscale);
        } else {
            b.set_d(0.0);
        }
        finish_q3_k(x, b, &mut codes);
    }
    Ok(())
}

/// The common tail of ggml's Q3_K quantizers, once `b.scales` and `b.d` are stored: codes
/// against the stored scales (sub-blocks of scale 0 keep the codes of the search), the high
/// bit into `hmask`, the low two bits packed.
pub(crate) fn finish_q3_k(x: &[f32], b: &mut BlockQ3K, codes: &mut [u8; QK_K]) {
    let d_all = b.d();
    for j in 0..16 {
        let d = d_all * q3k_scale(j, &b.scales) as f32;
        if d == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            codes[i] = (nearest_int(x[i] / d).clamp(-4, 3) + 4) as u8;
        }
    }
    b.hmask = [0; 32];
    for (j, c) in codes.iter_mut().enumerate() {
        if *c > 3 {
            b.hmask[j % 32] |= 1 << (j / 32);
            *c -= 4;
        }
    }
    pack_2bit(codes, &mut b.qs);
}

/// Shared by Q4_K (`nmax` 15) and Q5_K (`nmax` 31): per 32-element sub-block scale and
/// min search, 6-bit quantization of both, then codes against the stored values.
fn quantize_scales_mins_k(
    x: &[f32],
    search: &Qkx2,
    codes: &mut [u8; QK_K],
) -> ([u8; 12], f32, f32) {
    let mut aux = [0u8; 32];
    let mut scales = [0.0f32; 8];
    let mut mins = [0.0f32; 8];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let sum_x2 = xs.iter().fold(0.0f32, |s, &v| s + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        let weights: [f32; 32] = std::array::from_fn(|l| av_x + xs[l].abs());
        (scales[j], mins[j]) = search.run(xs, &weights, &mut codes[32 * j..32 * j + 32], &mut aux);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    // Truncation to a byte before the clamp, as ggml does.
    let ls: [u8; 8] = std::array::from_fn(|j| (nearest_int(inv_scale * scales[j]) as u8).min(63));
    let lm: [u8; 8] = std::array::from_fn(|j| (nearest_int(inv_min * mins[j]) as u8).min(63));
    (
        pack_scale_min_k4(&ls, &lm),
        max_scale / 63.0,
        max_min / 63.0,
    )
}

/// Codes in `0..=nmax` against the stored (f16) super-block scales; sub-blocks whose
/// stored scale is zero keep the codes of the search.
pub(crate) fn requantize_k(
    x: &[f32],
    scales: &[u8; 12],
    d_all: f32,
    dmin_all: f32,
    nmax: i32,
    codes: &mut [u8; QK_K],
) {
    for j in 0..8 {
        let (sc, m) = get_scale_min_k4(j, scales);
        let d = d_all * sc as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * m as f32;
        for i in 32 * j..32 * j + 32 {
            codes[i] = nearest_int((x[i] + dm) / d).clamp(0, nmax) as u8;
        }
    }
}

pub fn quantize_row_q4_k(src: &[f32], blocks: &mut [BlockQ4K]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK_K, src.len())?;
    let search = Qkx2 {
        nmax: 15,
        rmin: -1.0,
        rdelta: 0.1,
        nstep: 20,
        use_mad: false,
    };
    for (x, b) in src.chunks_exact(QK_K).zip(blocks.iter_mut()) {
        let mut codes = [0u8; QK_K];
        let (scales, d, dmin) = quantize_scales_mins_k(x, &search, &mut codes);
        b.scales = scales;
        b.set_d(d);
        b.set_dmin(dmin);
        requantize_k(x, &b.scales, b.d(), b.dmin(), 15, &mut codes);
        pack_q4_k(&codes, &mut b.qs);
    }
    Ok(())
}

/// Q4_K code packing: 64-element chunk `c`, element `l` low nibble, `l + 32` high nibble.
pub(crate) fn pack_q4_k(codes: &[u8; QK_K], qs: &mut [u8; 128]) {
    for c in 0..4 {
        for l in 0..32 {
            qs[32 * c + l] = codes[64 * c + l] | (codes[64 * c + 32 + l] << 4);
        }
    }
}

pub fn quantize_row_q5_k(src: &[f32], blocks: &mut [BlockQ5K]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK_K, src.len())?;
    let search = Qkx2 {
        nmax: 31,
        rmin: -0.5,
        rdelta: 0.1,
        nstep: 15,
        use_mad: false,
    };
    for (x, b) in src.chunks_exact(QK_K).zip(blocks.iter_mut()) {
        let mut codes = [0u8; QK_K];
        let (scales, d, dmin) = quantize_scales_mins_k(x, &search, &mut codes);
        b.scales = scales;
        b.set_d(d);
        b.set_dmin(dmin);
        requantize_k(x, &b.scales, b.d(), b.dmin(), 31, &mut codes);
        pack_q5_k(&codes, b);
    }
    Ok(())
}

/// Q5_K code packing: the fifth bit of element `j` at bit `j/32` of `qh[j%32]`, the low
/// four bits as Q4_K packs its codes.
pub(crate) fn pack_q5_k(codes: &[u8; QK_K], b: &mut BlockQ5K) {
    b.qh = [0; 32];
    for (j, &c) in codes.iter().enumerate() {
        b.qh[j % 32] |= (c >> 4) << (j / 32);
    }
    for c in 0..4 {
        for l in 0..32 {
            b.qs[32 * c + l] = (codes[64 * c + l] & 0x0f) | ((codes[64 * c + 32 + l] & 0x0f) << 4);
        }
    }
}

pub fn quantize_row_q6_k(src: &[f32], blocks: &mut [BlockQ6K]) -> Result<(), QuantError> {
    quantize_q6_k_weighted(src, blocks, None)
}

/// Q6_K with optional importance weights, one per element of `src`: ggml's
/// `quantize_row_q6_K_impl`, which differs from the reference only in fitting each
/// sub-block's scale with the given weights instead of `x^2`.
pub(crate) fn quantize_q6_k_weighted(
    src: &[f32],
    blocks: &mut [BlockQ6K],
    importance: Option<&[f32]>,
) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK_K, src.len())?;
    if let Some(w) = importance {
        check_rows(blocks.len(), QK_K, w.len())?;
    }
    for (i, (x, b)) in src.chunks_exact(QK_K).zip(blocks.iter_mut()).enumerate() {
        let mut codes = [0u8; QK_K];
        let mut scales = [0.0f32; 16];
        let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
        for j in 0..16 {
            let qw = importance.map(|w| &w[QK_K * i + 16 * j..QK_K * i + 16 * j + 16]);
            scales[j] = make_qx_quants(
                32,
                &x[16 * j..16 * j + 16],
                qw,
                &mut codes[16 * j..16 * j + 16],
            );
            if scales[j].abs() > max_abs_scale {
                max_abs_scale = scales[j].abs();
                max_scale = scales[j];
            }
        }
        if max_abs_scale < GROUP_MAX_EPS {
            *b = BlockQ6K::default();
            continue;
        }
        let iscale = -128.0 / max_scale;
        b.set_d(1.0 / iscale);
        for (packed, &scale) in b.scales.iter_mut().zip(&scales) {
            // Byte truncation after the upper clamp, as ggml stores it.
            *packed = nearest_int(iscale * scale).min(127) as i8;
        }
        let d_all = b.d();
        for j in 0..16 {
            let d = d_all * b.scales[j] as f32;
            if d == 0.0 {
                continue;
            }
            for i in 16 * j..16 * j + 16 {
                codes[i] = (nearest_int(x[i] / d).clamp(-32, 31) + 32) as u8;
            }
        }
        for h in 0..2 {
            for l in 0..32 {
                let c = |s: usize| codes[128 * h + 32 * s + l];
                b.ql[64 * h + l] = (c(0) & 0x0f) | ((c(2) & 0x0f) << 4);
                b.ql[64 * h + 32 + l] = (c(1) & 0x0f) | ((c(3) & 0x0f) << 4);
                b.qh[32 * h + l] =
                    (c(0) >> 4) | ((c(1) >> 4) << 2) | ((c(2) >> 4) << 4) | ((c(3) >> 4) << 6);
            }
        }
    }
    Ok(())
}

/// Q8_K, the activation format of the K-quant dot products: `d = max/-127` with the
/// signed element of largest magnitude, codes by `nearest_int`, `bsums` the sums of
/// each 16 codes.
pub fn quantize_row_q8_k(src: &[f32], blocks: &mut [BlockQ8K]) -> Result<(), QuantError> {
    check_rows(blocks.len(), QK_K, src.len())?;
    for (x, b) in src.chunks_exact(QK_K).zip(blocks.iter_mut()) {
        let (max, amax) = signed_absmax(x);
        if amax == 0.0 {
            *b = BlockQ8K::default();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for j in 0..16 {
            let sum: i32 = b.qs[16 * j..16 * j + 16].iter().map(|&q| q as i32).sum();
            b.set_bsum(j, sum as i16);
        }
        b.set_d(1.0 / iscale);
    }
    Ok(())
}
