//! Dot-product kernels: a weight matrix in any supported ggml block type times 1..8
//! activation rows, with ggml's numerics (activations quantized to the weight type's
//! vec_dot type, integer dot products per block, f32 scaling per block).
//!
//! Paths: a scalar reference (`reference`), AVX2 and AVX-512 on x86-64 (`x86`), NEON on
//! aarch64 (`neon`), chosen at run time ([`simd_level`]). Each SIMD path unpacks a weight
//! row once into int8 lanes plus scales (`stage`) and then runs one shared dot product
//! per activation row, so extra rows cost only the integer arithmetic, and a row's result
//! never depends on which rows share its batch.

mod act;
mod matrix;
mod pool;
mod reference;
mod simd;
mod stage;
mod tables;

#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use matrix::{is_supported_weight_type, QMatrix, MAX_ROWS_PER_PASS, SUPPORTED_WEIGHT_TYPES};
pub use pool::ThreadPool;
pub use simd::{detected_simd_level, simd_level, SimdLevel};
