//! ggml quantized block formats and the kernels that multiply by them.
//!
//! `formats`: dequantize / quantize every supported block type, exactly as ggml does.
//! `kernels`: dot products and matrix × rows products (scalar reference + SIMD), and the thread pool.

// Every unsafe operation sits in its own block with a SAFETY comment saying why it is sound,
// unsafe functions included.
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

mod error;
pub mod formats;
pub mod kernels;

pub use error::QuantError;
pub use nextn_gguf::GgmlType;
