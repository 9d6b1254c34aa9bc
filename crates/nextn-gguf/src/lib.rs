//! The GGUF container: what is in a file, never what the tensors mean.

mod types;

pub use types::GgmlType;
