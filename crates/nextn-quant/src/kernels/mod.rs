//! Dot-product kernels: a weight matrix in any supported ggml block type times 1..8
//! activation rows, with ggml's numerics (activations quantized to the weight type's
//! vec_dot type, integer dot products per block, f32 scaling per block).
//!
//! ```no_run
//! use nextn_quant::kernels::{QMatrix, ThreadPool};
//! use nextn_quant::GgmlType;
//! # fn demo(weights: &[u8], x: &[f32]) -> Result<(), nextn_quant::QuantError> {
//! let pool = ThreadPool::new(4);
//! let w = QMatrix::new(GgmlType::Q4_K, 4096, 4096, weights)?; // 4096 rows of 4096
//! let mut out = vec![0f32; 3 * 4096];
//! w.mul_rows(x, 3, &mut out, &pool)?; // x: 3 rows of 4096; out[i*4096 + r]
//! # Ok(()) }
//! ```
//!
//! Paths: a scalar reference (`reference`, also the `Scalar` level), AVX2 and AVX-512 on
//! x86-64 (`x86`), NEON on aarch64 (`neon`), chosen at run time ([`simd_level`]).
//!
//! How a product runs: the activation rows are converted once per call (`act`); output
//! rows are split among the pool's threads in multiples of 16; for each weight row a
//! type-specific decoder unpacks it once into int8 lanes plus sub-block scales (a `DecodedRow`: the "staged" kernels),
//! and one shared integer dot product per activation row reads that. Extra activation
//! rows therefore cost only their integer arithmetic, never another pass over memory or
//! another decode, and since every (weight row, activation row) pair goes through the
//! same function with the same operation order, a row's result does not depend on the
//! other rows in its batch, on the thread count, or on the row split. On x86-64, Q4_K,
//! Q5_K, Q6_K and Q8_0 skip the decoded row: a fused kernel decodes each weight block in
//! registers and multiplies it with every activation row of the pass (`x86/fused.rs`; on
//! CPUs with VNNI, `x86/fused_vnni.rs` for Q4_K, Q6_K and Q8_0, same results bit for bit).
//!
//! Numerics: integer parts are exact and identical on every path; the f32 accumulation
//! order differs between paths (and from ggml's), so results agree with the reference
//! and with llama.cpp to float rounding, not bit for bit. On x86, types whose weights
//! carry a constant offset (Q4_0 -8, Q5_0 -16, Q3_K -4, Q6_K -32) are multiplied unsigned
//! and the offset is subtracted through the activation block sums, which keeps the
//! cheap unsigned×signed `vpmaddubsw` (exactly in integers for the K types, in f32 for
//! the 32-element types).

mod act;
mod decoded_row;
mod exp;
mod matrix;
mod pool;
mod reference;
mod simd;
mod tables;

#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use exp::exp_nonpositive;
pub use matrix::{
    is_supported_weight_type, repack, repacked_bytes, Layout, QMatrix, MAX_ROWS_PER_PASS,
    SUPPORTED_WEIGHT_TYPES,
};
pub use pool::ThreadPool;
pub use simd::{detected_simd_level, simd_level, SimdLevel};

/// The instruction set the matrix kernels run with, for reports: the SIMD level
/// ([`simd_level`]), with "+vnni" where Q4_K, Q6_K and Q8_0 use the VNNI kernels.
pub fn kernel_isa() -> String {
    #[cfg(target_arch = "x86_64")]
    if matches!(simd_level(), SimdLevel::Avx2 | SimdLevel::Avx512) {
        return x86::kernel_isa(simd_level());
    }
    simd_level().name().to_string()
}
