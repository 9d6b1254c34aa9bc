use nextn_gguf::GgmlType;

/// Errors of the formats and kernels. Messages name the type and, where known, the tensor.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum QuantError {
    /// A model asked for a type we cannot compute with.
    #[error("unsupported tensor type {ty} in tensor {tensor}")]
    UnsupportedTensorType { ty: GgmlType, tensor: String },
    /// An operation (dequantize, quantize, dot) that this type does not have.
    #[error("{op} is not available for tensor type {ty}")]
    NoSuchOp { ty: GgmlType, op: &'static str },
    /// A length that is not a whole number of blocks.
    #[error("{ty}: {n} elements is not a whole number of {block}-element blocks")]
    PartialBlock {
        ty: GgmlType,
        n: usize,
        block: usize,
    },
    /// Importance weights that do not describe whole rows of whole blocks of the source:
    /// there must be one weight per column, a whole number of blocks, and whole rows.
    #[error(
        "{ty}: {weights} importance weights (one per column) do not split {n} elements into \
         whole rows of whole {block}-element blocks"
    )]
    ImportanceShape {
        ty: GgmlType,
        weights: usize,
        n: usize,
        block: usize,
    },
    /// Buffers whose sizes do not fit together.
    #[error("{what}: expected {expected}, got {got}")]
    SizeMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// A shape whose byte or element count does not fit in memory sizes.
    #[error("{what}: {rows} x {cols} overflows the address space")]
    ShapeTooLarge {
        what: &'static str,
        rows: usize,
        cols: usize,
    },
    /// A kernel instruction set that this CPU (or this build's architecture) lacks.
    #[error("SIMD level {level} is not supported on this CPU")]
    SimdUnavailable { level: &'static str },
}
