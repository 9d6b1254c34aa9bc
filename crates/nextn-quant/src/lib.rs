//! ggml quantized block formats and the kernels that multiply by them.
//!
//! `formats`: dequantize / quantize every supported block type, exactly as ggml does.
//! `kernels`: dot products and matrix × rows products (scalar reference + SIMD), and the thread pool.

mod error;
pub mod formats;
pub mod kernels;

pub use error::QuantError;
pub use nextn_gguf::GgmlType;
