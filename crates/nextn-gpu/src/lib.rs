//! The device backend's runtime: adapters named as llama.cpp names them, buffers and read-back,
//! WGSL kernels recorded into one submission per pass, and GGUF weights repacked for the kernels.
//!
//! The model's forward pass on the device (`nextn-model`'s `device` module) is written over
//! this crate; nothing here knows what a layer is.

// Every unsafe operation sits in its own block with a SAFETY comment saying why it is sound,
// unsafe functions included.
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

pub mod context;
pub mod kernels;
pub mod kv;
pub mod pass;
pub mod validation;
pub mod weights;

pub use context::{list_devices, Counters, DeviceInfo, Gpu, OpenOptions, Reservation};
pub use pass::{groups_1d, DispatchTime, PassTime, ReadBack, ReadSlot, Recorder, Timing};
pub use weights::{is_device_type, DeviceExperts, DeviceMatrix};

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no GPU adapter found (Vulkan, Metal or DX12); on Linux without a GPU, Mesa's lavapipe (Debian: mesa-vulkan-drivers) provides one")]
    NoAdapter,
    #[error(
        "no device named '{name}' (available: {available}); `nextn --list-devices` lists them"
    )]
    UnknownDevice { name: String, available: String },
    #[error("the device could not be opened or stopped answering: {0}")]
    Device(String),
    #[error("kernel '{kernel}' was refused by the device: {why}")]
    Kernel { kernel: &'static str, why: String },
    #[error("{what} needs a buffer of {bytes} bytes, over the device's limit of {limit}")]
    BufferTooLarge {
        what: String,
        bytes: u64,
        limit: u64,
    },
    #[error("the device is out of memory: {what} needs {bytes} bytes ({why})")]
    OutOfMemory {
        what: String,
        bytes: u64,
        why: String,
    },
    #[error(
        "{what} needs {bytes} bytes of device memory, and {used} of the {budget} bytes the device \
         may use are taken (by weights and the caches of live sequences)"
    )]
    OverBudget {
        what: String,
        bytes: u64,
        used: u64,
        budget: u64,
    },
    #[error("reading back from the device failed: {0}")]
    ReadBack(String),
    #[error("tensor '{tensor}' is stored as {ty}, which the device kernels do not read")]
    UnsupportedType { tensor: String, ty: String },
    #[error("tensor '{tensor}': {why}")]
    BadTensor { tensor: String, why: String },
}
