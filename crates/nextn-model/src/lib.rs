//! The Qwen3.5 / Qwen3.6 model (`qwen35`, `qwen35moe`): configuration from GGUF metadata, weights
//! bound from the mapped file, one file per layer kind, and the per-sequence caches.

// Every unsafe operation sits in its own block with a SAFETY comment saying why it is sound,
// unsafe functions included.
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

pub mod attention;
pub mod batch;
pub mod cache;
pub mod config;
pub mod delta_net;
pub mod device;
pub mod draft_vocab;
pub mod ffn;
pub mod graft;
mod image_rows;
pub mod inventory;
pub mod model;
pub mod nextn;
pub mod ops;
pub mod pass_bytes;
pub mod placement;
pub mod quantize;
mod simd;
pub mod synth;
pub mod validate;
pub mod weights;

pub use batch::{
    is_device_token, BatchItem, DeviceRows, ForwardOutput, HeadBatchItem, HiddenPrev, LogitRows,
    Readback, RowTop1, DEVICE_TOKEN, DEVICE_TOKENS,
};
pub use cache::{
    ImageSpan, KvRows, KvType, LayerCache, RecurrentSnapshot, RecurrentState, SequenceState,
    StateCodecError, StateReader, StateWriter,
};
pub use config::{Arch, LayerKind, Qwen35Config};
pub use model::Model;
pub use nextn::NextnHead;
pub use placement::{Blocks, Placement};

use nextn_gguf::GgufError;
use nextn_quant::QuantError;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Quant(#[from] QuantError),
    #[error("architecture '{0}' is not supported (expected qwen35 or qwen35moe)")]
    UnsupportedArchitecture(String),
    #[error("required metadata key '{0}' is missing")]
    MissingKey(String),
    #[error("metadata key '{key}': {why}")]
    BadValue { key: String, why: String },
    #[error("this {0} file has no NextN (MTP) head: nextn_predict_layers is 0 or absent")]
    NoNextnHead(String),
    #[error("tensor '{0}' is missing")]
    MissingTensor(String),
    #[error("tensor '{tensor}' is stored as {found}; expected {expected}")]
    TensorType {
        tensor: String,
        found: String,
        expected: &'static str,
    },
    #[error(transparent)]
    Invalid(#[from] validate::InvalidModel),
    #[error("this is an MTP-only file (a NextN head without the trunk): load it beside its model with -md")]
    SidecarOnly,
    #[error("tensor '{tensor}' has shape {found:?}, expected {expected:?} (ggml ne order)")]
    TensorShape {
        tensor: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
    #[error("token id {token} is out of range (vocabulary has {n_vocab} tokens)")]
    TokenOutOfRange { token: u64, n_vocab: usize },
    #[error("context is full: {n_past} positions used + {n_new} new > context length {n_ctx}")]
    ContextFull {
        n_past: usize,
        n_new: usize,
        n_ctx: usize,
    },
    #[error("cannot keep {keep} rows of a verify batch of {pending} pending rows")]
    KeepBeyondPending { keep: usize, pending: usize },
    #[error("the previous verify batch ({pending} rows) was not committed")]
    UncommittedVerify { pending: usize },
    #[error("the sequence state has {found} layer caches, but this model has {expected} layers: it was made for another model")]
    ForeignState { found: usize, expected: usize },
    #[error("{layer} layer was given a {found} cache")]
    WrongCacheKind {
        layer: &'static str,
        found: &'static str,
    },
    #[error(
        "the {layer} cache holds {cached} positions, but the batch starts at position {start}"
    )]
    CachePosition {
        layer: &'static str,
        cached: usize,
        start: usize,
    },
    #[error(
        "image embeddings of {found} floats do not fill {nx}x{ny} tokens of the model's width {n_embd}"
    )]
    ImageShape {
        found: usize,
        nx: usize,
        ny: usize,
        n_embd: usize,
    },
    #[error("a cached state does not fit this sequence: {what} {found}, expected {expected}")]
    SnapshotMismatch {
        what: &'static str,
        expected: usize,
        found: usize,
    },
    #[error(
        "cached attention rows have another element type than this sequence's KV cache (-ctk/-ctv)"
    )]
    SnapshotKvType,
    #[error("an expert routing for {rows} rows of {per_row} experts names {found} experts, or an expert outside the layer's {n_expert}")]
    Routing {
        rows: usize,
        per_row: usize,
        found: usize,
        n_expert: usize,
    },
    #[error("GPU: {0}")]
    Device(String),
    /// The device cannot hold a cache or a weight: over its memory, its budget or its largest
    /// buffer; the message names what and how many bytes.
    #[error("GPU: {0}")]
    DeviceMemory(nextn_gpu::GpuError),
    #[error("the NextN head got {found} hidden values for {rows} rows of width {width}")]
    HiddenLength {
        found: usize,
        rows: usize,
        width: usize,
    },
}
