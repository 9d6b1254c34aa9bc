//! Per-thread scratch that holds one weight row decoded for the SIMD dot products, so
//! each weight block is unpacked once however many activation rows it meets.

use crate::GgmlType;

/// Buffers for one decoded weight row; which ones a type fills depends on its family and
/// on the instruction set (see the decoders).
pub(crate) struct Stage {
    /// One byte per weight: int8 values (or unsigned, for types whose kernel subtracts an
    /// offset through the activation sums).
    pub q: Vec<u8>,
    /// Per-block weight scale.
    pub d: Vec<f32>,
    /// Per-block minimum (Q4_1, Q5_1) or min scale (Q2_K, Q4_K, Q5_K).
    pub m: Vec<f32>,
    /// Sub-block scales as the instruction set wants them (at most one i16 per 2 weights).
    pub sc: Vec<i16>,
    /// Per-16-weight minimums / offsets, multiplied with the activation's 16-sums.
    pub mins: Vec<i16>,
    /// F16 / BF16 weights widened to f32.
    pub f: Vec<f32>,
}

impl Stage {
    pub(crate) fn new(ty: GgmlType, cols: usize) -> Stage {
        let nb = cols / ty.block_size();
        let quantized = ty.is_quantized();
        let k_family = ty.block_size() == 256;
        let widened = matches!(ty, GgmlType::F16 | GgmlType::BF16);
        Stage {
            q: if quantized { vec![0; cols] } else { Vec::new() },
            d: if quantized { vec![0.0; nb] } else { Vec::new() },
            m: if quantized { vec![0.0; nb] } else { Vec::new() },
            sc: if k_family { vec![0; cols / 2] } else { Vec::new() },
            mins: if k_family { vec![0; cols / 16] } else { Vec::new() },
            f: if widened { vec![0.0; cols] } else { Vec::new() },
        }
    }
}
