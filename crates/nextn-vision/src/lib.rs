//! The vision tower of Qwen3.5 / Qwen3.6 as llama.cpp's converter writes it into an mmproj GGUF
//! (`clip.projector_type` `qwen3vl_merger`), computed as llama.cpp's mtmd does: decode
//! ([`decode_image`], after [`image_size`] has read the header, which is all a caller needs to
//! know how many tokens the picture will take: [`VisionTower::token_grid_for_size`]), resize
//! ([`VisionTower::prepare`], still 8-bit RGB), and encode ([`VisionTower::encode`], which
//! normalises as it reads the patches) into one embedding per 2x2 group of patches for the text
//! model.
//!
//! ```no_run
//! use nextn_quant::kernels::ThreadPool;
//! use nextn_vision::{decode_image, VisionTower};
//! # fn demo() -> Result<(), nextn_vision::VisionError> {
//! let tower = VisionTower::load("mmproj-F16.gguf")?;
//! tower.check_text_model(2048)?;
//! let img = decode_image(&std::fs::read("cat.png").unwrap(), "cat.png")?;
//! let emb = tower.encode(&tower.prepare(&img), &ThreadPool::new(4))?;
//! assert_eq!(emb.data.len(), emb.n_tokens() * emb.width);
//! # Ok(()) }
//! ```
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

mod block;
mod config;
mod device;
mod error;
mod gemm;
mod ops;
mod patch;
mod preprocess;
pub mod synth;
mod tower;
mod weights;

pub use config::{
    VisionConfig, DEFAULT_MAX_TOKENS, DEFAULT_MIN_TOKENS, MAX_TOKENS_LIMIT, PROJECTOR_QWEN3VL,
};
pub use error::VisionError;
pub use preprocess::{
    decode_image, image_size, target_size, PreparedImage, RgbImage, MAX_DECODE_BYTES,
    MAX_IMAGE_SIDE,
};
pub use tower::{ImageEmbedding, VisionTower};
