//! ggml block formats: byte layouts, dequantization and quantization.
//!
//! Dequantization is bit-exact with gguf-py's `gguf.quants.dequantize` (numpy) for every
//! type [`can_dequantize`] accepts. Quantization produces the bytes llama.cpp's
//! `llama-quantize` writes for the same type (it calls `ggml_quantize_chunk`): bit-exact
//! with gguf-py's `gguf.quants.quantize` where gguf-py has a quantizer, and ports of ggml's
//! C quantizers elsewhere (K-quants, IQ4_NL, IQ4_XS), checked byte for byte against files
//! made by `llama-quantize` (`tests/quantize_llamacpp.rs`). ggml-base, where those C
//! quantizers live, is compiled without `-march`, hence without FMA contraction: the ports
//! use plain f32 arithmetic in ggml's expression order. Both directions work on whole rows
//! of whole blocks, given as raw little-endian bytes (the entry points below) or as slices
//! of the typed blocks of [`layout`] (the `*_row_*` functions of the submodules, for
//! kernels that already hold blocks).
//!
//! [`quantize_with_importance`] adds llama-quantize's `--imatrix` paths: per-column
//! importance weights, which ggml's quantizers of most types use to weigh their fits.
//!
//! Submodules by family: [`float`] (F32/F16/BF16 and scalar conversions), [`legacy`]
//! (Q4_0 ... Q8_0), [`kquants`] (Q2_K ... Q8_K dequantization), [`quantize_k`] (K-quant
//! quantizers), [`weighted`] (the importance-weighted quantizers of the legacy and K-quant
//! formats), [`iquants`] (IQ4_NL, IQ4_XS), [`mxfp4`]; [`tables`] holds the shared code
//! books and scale unpacking.

pub mod float;
pub mod iquants;
pub mod kquants;
pub mod layout;
pub mod legacy;
pub mod mxfp4;
pub mod quantize_k;
pub mod tables;
pub mod weighted;

pub use float::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
pub use layout::{
    blocks_as_bytes, blocks_from_bytes, blocks_from_bytes_mut, Block, BlockIQ4NL, BlockIQ4XS,
    BlockMxfp4, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1,
    BlockQ6K, BlockQ8K, BlockQ8_0, K_SCALE_SIZE, QK32, QK_K,
};
pub use tables::{e8m0_to_f32_half, get_scale_min_k4, KVALUES_IQ4NL, KVALUES_MXFP4};

use crate::QuantError;
use nextn_gguf::GgmlType;

/// Whether [`dequantize`] handles `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | Q8_K
            | IQ4_NL
            | IQ4_XS
            | MXFP4
    )
}

/// Whether [`quantize`] handles `ty`.
pub fn can_quantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | MXFP4 | IQ4_NL | IQ4_XS
    ) || quantize_k::has_quantizer(ty)
}

/// Whether ggml's quantizer for `ty` uses importance weights. [`quantize_with_importance`]
/// accepts weights for every type [`can_quantize`] handles and ignores them for the others
/// (F32, F16, BF16, Q8_0, MXFP4, Q8_K), as `ggml_quantize_chunk` does.
pub fn uses_importance(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_NL | IQ4_XS
    )
}

/// The refusal a model loader uses: `Err(UnsupportedTensorType)` for a tensor whose type
/// we cannot compute with (that is, cannot dequantize).
pub fn check_supported(ty: GgmlType, tensor: &str) -> Result<(), QuantError> {
    if can_dequantize(ty) {
        Ok(())
    } else {
        Err(QuantError::UnsupportedTensorType {
            ty,
            tensor: tensor.to_string(),
        })
    }
}

/// Decodes a row of `ty` blocks. `dst.len()` must be a whole number of blocks and `src`
/// exactly `ty.row_bytes(dst.len())` bytes.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    if !can_dequantize(ty) {
        return Err(QuantError::NoSuchOp {
            ty,
            op: "dequantize",
        });
    }
    let expected = row_bytes(ty, dst.len())?;
    if src.len() != expected {
        return Err(QuantError::SizeMismatch {
            what: "dequantize: source bytes",
            expected,
            got: src.len(),
        });
    }
    use GgmlType::*;
    match ty {
        F32 => float::dequantize_f32(src, dst),
        F16 => float::dequantize_f16(src, dst),
        BF16 => float::dequantize_bf16(src, dst),
        Q4_0 => legacy::dequantize_row_q4_0(blocks_from_bytes(src)?, dst)?,
        Q4_1 => legacy::dequantize_row_q4_1(blocks_from_bytes(src)?, dst)?,
        Q5_0 => legacy::dequantize_row_q5_0(blocks_from_bytes(src)?, dst)?,
        Q5_1 => legacy::dequantize_row_q5_1(blocks_from_bytes(src)?, dst)?,
        Q8_0 => legacy::dequantize_row_q8_0(blocks_from_bytes(src)?, dst)?,
        Q2_K => kquants::dequantize_row_q2_k(blocks_from_bytes(src)?, dst)?,
        Q3_K => kquants::dequantize_row_q3_k(blocks_from_bytes(src)?, dst)?,
        Q4_K => kquants::dequantize_row_q4_k(blocks_from_bytes(src)?, dst)?,
        Q5_K => kquants::dequantize_row_q5_k(blocks_from_bytes(src)?, dst)?,
        Q6_K => kquants::dequantize_row_q6_k(blocks_from_bytes(src)?, dst)?,
        Q8_K => kquants::dequantize_row_q8_k(blocks_from_bytes(src)?, dst)?,
        IQ4_NL => iquants::dequantize_row_iq4_nl(blocks_from_bytes(src)?, dst)?,
        IQ4_XS => iquants::dequantize_row_iq4_xs(blocks_from_bytes(src)?, dst)?,
        MXFP4 => mxfp4::dequantize_row_mxfp4(blocks_from_bytes(src)?, dst)?,
        _ => {
            return Err(QuantError::NoSuchOp {
                ty,
                op: "dequantize",
            })
        }
    }
    Ok(())
}

/// Encodes a row of f32 as `ty` blocks. `src.len()` must be a whole number of blocks and
/// `dst` exactly `ty.row_bytes(src.len())` bytes.
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    if !can_quantize(ty) {
        return Err(QuantError::NoSuchOp { ty, op: "quantize" });
    }
    let expected = row_bytes(ty, src.len())?;
    if dst.len() != expected {
        return Err(QuantError::SizeMismatch {
            what: "quantize: destination bytes",
            expected,
            got: dst.len(),
        });
    }
    use GgmlType::*;
    match ty {
        F32 => float::quantize_f32(src, dst),
        F16 => float::quantize_f16(src, dst),
        BF16 => float::quantize_bf16(src, dst),
        Q4_0 => legacy::quantize_row_q4_0(src, blocks_from_bytes_mut(dst)?)?,
        Q4_1 => legacy::quantize_row_q4_1(src, blocks_from_bytes_mut(dst)?)?,
        Q5_0 => legacy::quantize_row_q5_0(src, blocks_from_bytes_mut(dst)?)?,
        Q5_1 => legacy::quantize_row_q5_1(src, blocks_from_bytes_mut(dst)?)?,
        Q8_0 => legacy::quantize_row_q8_0(src, blocks_from_bytes_mut(dst)?)?,
        MXFP4 => mxfp4::quantize_row_mxfp4(src, blocks_from_bytes_mut(dst)?)?,
        IQ4_NL => iquants::quantize_row_iq4_nl(src, blocks_from_bytes_mut(dst)?, None)?,
        IQ4_XS => iquants::quantize_row_iq4_xs(src, blocks_from_bytes_mut(dst)?, None)?,
        _ => quantize_k::quantize(ty, src, dst)?,
    }
    Ok(())
}

/// [`quantize`] with optional importance weights, as llama-quantize with `--imatrix`:
/// `ggml_quantize_chunk(ty, src, dst, 0, nrows, n_per_row, importance)`.
///
/// `importance` holds one weight per column (the imatrix entry of the tensor, or of the
/// expert, the rows belong to), so its length is the row length `n_per_row`; `src` holds
/// whole rows of it (`src.len()` a multiple of `importance.len()`, itself a whole number of
/// blocks) and each row is quantized with the same weights. Row boundaries matter for Q4_0,
/// Q4_1, Q5_0 and Q5_1, whose weighting uses the variance of the whole row. `dst` is
/// exactly `ty.row_bytes(src.len())` bytes.
///
/// `None` is [`quantize`] (what ggml does without an imatrix, reference quantizers
/// included). Types that do not use weights (see [`uses_importance`]) ignore them after the
/// same shape checks. Weights are taken as given: llama-quantize refuses an imatrix with
/// non-finite entries before quantizing, and a caller should do the same.
pub fn quantize_with_importance(
    ty: GgmlType,
    src: &[f32],
    dst: &mut [u8],
    importance: Option<&[f32]>,
) -> Result<(), QuantError> {
    let Some(weights) = importance else {
        return quantize(ty, src, dst);
    };
    if !can_quantize(ty) {
        return Err(QuantError::NoSuchOp { ty, op: "quantize" });
    }
    let row = weights.len();
    if row == 0 || !row.is_multiple_of(ty.block_size()) || !src.len().is_multiple_of(row) {
        return Err(QuantError::ImportanceShape {
            ty,
            weights: row,
            n: src.len(),
            block: ty.block_size(),
        });
    }
    let expected = row_bytes(ty, src.len())?;
    if dst.len() != expected {
        return Err(QuantError::SizeMismatch {
            what: "quantize: destination bytes",
            expected,
            got: dst.len(),
        });
    }
    if !uses_importance(ty) {
        return quantize(ty, src, dst);
    }
    let dst_row = row_bytes(ty, row)?;
    for (x, y) in src.chunks_exact(row).zip(dst.chunks_exact_mut(dst_row)) {
        quantize_row_weighted(ty, x, y, weights)?;
    }
    Ok(())
}

/// One row of a type that uses importance weights; `y` is already sized.
fn quantize_row_weighted(
    ty: GgmlType,
    x: &[f32],
    y: &mut [u8],
    w: &[f32],
) -> Result<(), QuantError> {
    use GgmlType::*;
    match ty {
        Q4_0 => weighted::quantize_row_q4_0_weighted(x, blocks_from_bytes_mut(y)?, w),
        Q4_1 => weighted::quantize_row_q4_1_weighted(x, blocks_from_bytes_mut(y)?, w),
        Q5_0 => weighted::quantize_row_q5_0_weighted(x, blocks_from_bytes_mut(y)?, w),
        Q5_1 => weighted::quantize_row_q5_1_weighted(x, blocks_from_bytes_mut(y)?, w),
        Q2_K => weighted::quantize_row_q2_k_weighted(x, blocks_from_bytes_mut(y)?, w),
        Q3_K => weighted::quantize_row_q3_k_weighted(x, blocks_from_bytes_mut(y)?, w),
        Q4_K => weighted::quantize_row_q4_k_weighted(x, blocks_from_bytes_mut(y)?, w),
        Q5_K => weighted::quantize_row_q5_k_weighted(x, blocks_from_bytes_mut(y)?, w),
        Q6_K => quantize_k::quantize_q6_k_weighted(x, blocks_from_bytes_mut(y)?, Some(w)),
        IQ4_NL => iquants::quantize_row_iq4_nl(x, blocks_from_bytes_mut(y)?, Some(w)),
        IQ4_XS => iquants::quantize_row_iq4_xs(x, blocks_from_bytes_mut(y)?, Some(w)),
        _ => Err(QuantError::NoSuchOp {
            ty,
            op: "quantize with importance weights",
        }),
    }
}

/// Bytes of `n` elements of `ty`, or `PartialBlock` when `n` is not a whole number of blocks.
fn row_bytes(ty: GgmlType, n: usize) -> Result<usize, QuantError> {
    let block = ty.block_size();
    if !n.is_multiple_of(block) {
        return Err(QuantError::PartialBlock { ty, n, block });
    }
    // n / block * type_size cannot overflow: it is at most n * 4 for every format we handle
    // (a slice of n f32 already exists), but stay checked all the same.
    (n / block)
        .checked_mul(ty.type_size())
        .ok_or(QuantError::SizeMismatch {
            what: "row bytes (overflow)",
            expected: usize::MAX,
            got: n,
        })
}

/// Checks that `n_blocks` blocks of `block_elems` elements fit `n_elems` exactly.
pub(crate) fn check_rows(
    n_blocks: usize,
    block_elems: usize,
    n_elems: usize,
) -> Result<(), QuantError> {
    let expected = n_blocks * block_elems;
    if expected != n_elems {
        return Err(QuantError::SizeMismatch {
            what: "elements for the given blocks",
            expected,
            got: n_elems,
        });
    }
    Ok(())
}

/// Float to integer as x86 `cvttss2si` (and so C casts and numpy's `astype` on x86) does:
/// truncation toward zero, and `i32::MIN` for NaN and out-of-range values. The reference
/// quantizers then keep the low byte; matching this keeps degenerate blocks (e.g. an
/// f32-subnormal maximum, whose inverse scale overflows to infinity) bit-identical.
#[inline]
pub(crate) fn trunc_i32_like_x86(v: f32) -> i32 {
    // Rust's `as` saturates instead; the two agree inside this range.
    if v > -2_147_483_904.0 && v < 2_147_483_648.0 {
        v as i32
    } else {
        i32::MIN
    }
}

/// `roundf` (half away from zero) followed by the x86 conversion, using only a truncating
/// conversion and an exact subtraction (no libm call, so it vectorizes on baseline x86-64).
#[inline]
pub(crate) fn round_i32_like_x86(v: f32) -> i32 {
    let t = trunc_i32_like_x86(v);
    if t == i32::MIN {
        return t;
    }
    // `v - t` is exact: t has the same sign and exponent range as v.
    let frac = v - t as f32;
    t + (frac >= 0.5) as i32 - (frac <= -0.5) as i32
}

/// `1/d`, or 0 for a zero scale (an all-zero block then quantizes to the zero code).
#[inline]
pub(crate) fn inverse_or_zero(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_roundf_then_x86_conversion() {
        let reference = |v: f32| trunc_i32_like_x86(v.round());
        let mut cases = vec![
            0.5f32,
            -0.5,
            1.5,
            -1.5,
            2.5,
            0.49999997,
            -0.49999997,
            126.5,
            -127.5,
            8388607.5,
        ];
        cases.extend([
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            2147483520.0,
            -2147483648.0,
            3e9,
            -3e9,
            -0.0,
        ]);
        let mut bits = 0u32;
        while bits < 0xffff_0000 {
            cases.push(f32::from_bits(bits));
            bits += 0x0000_7fff;
        }
        for v in cases {
            assert_eq!(
                round_i32_like_x86(v),
                reference(v),
                "{v:e} ({:#010x})",
                v.to_bits()
            );
        }
    }
}
