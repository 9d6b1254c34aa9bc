use nextn_gguf::{GgmlType, GgufError};
use nextn_quant::QuantError;

/// What can go wrong loading an mmproj file, reading an image or encoding it. Each variant names
/// the key, tensor or limit involved.
#[derive(Debug, thiserror::Error)]
pub enum VisionError {
    #[error("cannot read mmproj file {path}: {source}")]
    Open { path: String, source: GgufError },
    #[error("{path} is not an mmproj file (general.architecture is '{found}', expected 'clip')")]
    NotMmproj { path: String, found: String },
    #[error("mmproj metadata {key}: {problem}")]
    Metadata { key: &'static str, problem: String },
    #[error(
        "unsupported mmproj projector type '{found}' (clip.projector_type); \
         supported: qwen3vl_merger (Qwen3.5 / Qwen3.6)"
    )]
    UnsupportedProjector { found: String },
    #[error("mmproj tensor {tensor} is missing")]
    MissingTensor { tensor: String },
    #[error("mmproj tensor {tensor} has shape {found:?}, expected {expected:?}")]
    TensorShape {
        tensor: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("mmproj tensor {tensor} has type {ty}, which the vision tower cannot compute with")]
    TensorType { tensor: String, ty: GgmlType },
    #[error("mmproj tensor {tensor}: {source}")]
    Kernel { tensor: String, source: QuantError },
    #[error(
        "the mmproj's projection width {mmproj} (clip.vision.projection_dim, mm.2.weight) \
         does not match the model's embedding width {model}: the mmproj belongs to another model"
    )]
    ProjectionWidth { mmproj: usize, model: usize },
    #[error(
        "the mmproj has {layers} deepstack layers (v.deepstack.*), which this model's trunk \
         has no inputs for"
    )]
    Deepstack { layers: usize },
    #[error("cannot decode image {what}: {reason}")]
    Decode { what: String, reason: String },
    #[error(
        "image {what} is {width}x{height} pixels; at most {max_side} pixels per side are accepted"
    )]
    ImageTooLarge {
        what: String,
        width: u32,
        height: u32,
        max_side: u32,
    },
    #[error("image {what} has no pixels ({width}x{height})")]
    ImageEmpty {
        what: String,
        width: u32,
        height: u32,
    },
    #[error(
        "image {what} is {width}x{height} pixels of {color}: decoding it takes {needed} bytes \
         (its pixels and their 8-bit RGB copy), over the limit of {limit}"
    )]
    DecodeMemory {
        what: String,
        width: u32,
        height: u32,
        /// The decoder's pixel format (`Rgba8`, `Rgb16`, ...).
        color: String,
        needed: u64,
        limit: u64,
    },
    #[error("the vision tower on the device: {what}: {source}")]
    Device {
        what: String,
        source: nextn_gpu::GpuError,
    },
    #[error(
        "the vision tower's activations for images of up to {tokens} tokens need a buffer of \
         {bytes} bytes on the device, over its binding limit of {limit}: --image-max-tokens \
         {fits} or less fits"
    )]
    DeviceBinding {
        tokens: u32,
        bytes: u64,
        limit: u64,
        fits: u64,
    },
    #[error(
        "an image of {patches} patches is more than the device's buffers hold ({capacity}, \
         sized for --image-max-tokens at load)"
    )]
    DeviceCapacity { patches: usize, capacity: usize },
    /// The caller stopped the encode (its request went away) before it was done.
    #[error("the image encode was cancelled")]
    EncodeCancelled,
}

pub(crate) fn metadata(key: &'static str, problem: impl Into<String>) -> VisionError {
    VisionError::Metadata {
        key,
        problem: problem.into(),
    }
}
