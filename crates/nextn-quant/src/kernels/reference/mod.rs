//! Scalar reference dot products, one weight row against one converted activation row,
//! following ggml's generic (non-SIMD) `vec_dot` routines: an exact integer sum per block
//! or sub-block, scaled in f32 per block.
//!
//! These are the yardstick for the SIMD paths and also serve as the portable fallback
//! (`SimdLevel::Scalar`).

mod float;
mod kquants;
mod legacy;

use super::act::ActRow;
use crate::GgmlType;

/// Dot product of one weight row (`wrow`, whole blocks of `ty`) with one activation row
/// already converted to `ty`'s vec_dot type. `ty` must be one the kernels support.
pub(crate) fn dot_row(ty: GgmlType, wrow: &[u8], a: &ActRow) -> f32 {
    use GgmlType as T;
    match ty {
        T::F32 => float::dot_f32(wrow, a),
        T::F16 => float::dot_f16(wrow, a),
        T::BF16 => float::dot_bf16(wrow, a),
        T::Q4_0 => legacy::dot_q4_0(wrow, a),
        T::Q4_1 => legacy::dot_q4_1(wrow, a),
        T::Q5_0 => legacy::dot_q5_0(wrow, a),
        T::Q5_1 => legacy::dot_q5_1(wrow, a),
        T::Q8_0 => legacy::dot_q8_0(wrow, a),
        T::IQ4_NL => legacy::dot_iq4_nl(wrow, a),
        T::MXFP4 => legacy::dot_mxfp4(wrow, a),
        T::Q2_K => kquants::dot_q2_k(wrow, a),
        T::Q3_K => kquants::dot_q3_k(wrow, a),
        T::Q4_K => kquants::dot_q4_k(wrow, a),
        T::Q5_K => kquants::dot_q5_k(wrow, a),
        T::Q6_K => kquants::dot_q6_k(wrow, a),
        T::Q8_K => kquants::dot_q8_k(wrow, a),
        T::IQ4_XS => kquants::dot_iq4_xs(wrow, a),
        other => unreachable!("kernels asked for unsupported type {other}"),
    }
}
