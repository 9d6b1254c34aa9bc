//! Every way a GGUF file (or a request to write one) can be wrong, each naming the key, tensor or
//! shard at fault and the byte offset where the problem was found.

use std::path::PathBuf;

use crate::GgmlType;

/// Errors from reading or writing GGUF files.
///
/// Errors found while parsing a file that was opened by path come wrapped in
/// [`GgufError::InFile`] (naming the shard); [`GgufError::kind`] unwraps that context for matching.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Wraps an error found while parsing the file at `path` (one shard of a model).
    #[error("{}: {source}", path.display())]
    InFile {
        path: PathBuf,
        #[source]
        source: Box<GgufError>,
    },
    #[error("write failed: {0}")]
    Write(#[source] std::io::Error),

    // ---- container structure ----
    #[error(
        "truncated file: {what} at byte {offset} needs {needed} bytes but only {available} remain"
    )]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        available: u64,
    },
    #[error("bad magic {found:02x?} at byte 0: not a GGUF file (expected \"GGUF\")")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {version} at byte 4 (supported: 2, 3)")]
    UnsupportedVersion { version: u32 },
    #[error("big-endian GGUF (version {version} byte-swapped) is not supported")]
    BigEndian { version: u32 },
    #[error(
        "{what} count {count} at byte {offset} is larger than the file could hold (at most {max})"
    )]
    CountTooLarge {
        what: &'static str,
        count: u64,
        offset: u64,
        max: u64,
    },
    #[error(
        "{what}: length {len} at byte {offset} exceeds the {available} bytes left in the file"
    )]
    LengthTooLarge {
        what: String,
        len: u64,
        offset: u64,
        available: u64,
    },
    #[error("{what} at byte {offset} is not valid UTF-8")]
    InvalidUtf8 { what: String, offset: u64 },

    // ---- metadata ----
    #[error("unknown metadata value type {type_id} for key {key:?} at byte {offset}")]
    UnknownValueType {
        key: String,
        type_id: u32,
        offset: u64,
    },
    #[error("invalid bool byte {value} for key {key:?} at byte {offset} (must be 0 or 1)")]
    InvalidBool { key: String, value: u8, offset: u64 },
    #[error("arrays nested deeper than {max_depth} levels in key {key:?} at byte {offset}")]
    NestingTooDeep {
        key: String,
        max_depth: usize,
        offset: u64,
    },
    #[error("duplicate metadata key {key:?} at byte {offset}")]
    DuplicateKey { key: String, offset: u64 },
    #[error("metadata key {key:?} is {value}; it must be a non-zero power of two")]
    BadAlignment { key: String, value: u64 },
    #[error("metadata key {key:?}: expected {expected}, found {found}")]
    MetadataType {
        key: String,
        expected: &'static str,
        found: String,
    },

    // ---- tensor infos ----
    #[error("tensor {tensor:?} (info at byte {offset}): name is {len} bytes; the limit is {max} (ggml GGML_MAX_NAME)")]
    TensorNameTooLong {
        tensor: String,
        len: usize,
        max: usize,
        offset: u64,
    },
    #[error("tensor {tensor:?} (info at byte {offset}): {n_dims} dimensions; must be 1 to {max}")]
    TensorDimCount {
        tensor: String,
        n_dims: u64,
        max: usize,
        offset: u64,
    },
    #[error("tensor {tensor:?} (info at byte {offset}): dimension {index} is {value}; must be 1 to {max}")]
    TensorDim {
        tensor: String,
        index: usize,
        value: u64,
        max: u64,
        offset: u64,
    },
    #[error("tensor {tensor:?} (info at byte {offset}): element count of dims {dims:?} overflows")]
    ElementCountOverflow {
        tensor: String,
        dims: Vec<u64>,
        offset: u64,
    },
    #[error("unknown ggml type id {id} in tensor {tensor:?} at byte {offset}")]
    UnknownGgmlType {
        tensor: String,
        id: u32,
        offset: u64,
    },
    #[error("tensor {tensor:?} (info at byte {offset}): row length {ne0} is not a multiple of {ty}'s block size {block_size}")]
    PartialBlock {
        tensor: String,
        ty: GgmlType,
        ne0: u64,
        block_size: usize,
        offset: u64,
    },
    #[error("duplicate tensor name {tensor:?} (info at byte {offset})")]
    DuplicateTensor { tensor: String, offset: u64 },
    #[error("tensor {tensor:?}: data offset {data_offset} is not a multiple of the alignment {alignment}")]
    MisalignedTensor {
        tensor: String,
        data_offset: u64,
        alignment: u64,
    },
    #[error("tensor {tensor:?}: data [{start}, {start}+{n_bytes}) relative to the data section at byte {data_start} runs past the end of the file ({file_size} bytes)")]
    TensorOutOfBounds {
        tensor: String,
        start: u64,
        n_bytes: u64,
        data_start: u64,
        file_size: u64,
    },
    #[error("tensors {first:?} (data bytes {first_start}..{first_end}) and {second:?} (from {second_start}) overlap")]
    TensorOverlap {
        first: String,
        first_start: u64,
        first_end: u64,
        second: String,
        second_start: u64,
    },

    // ---- split models ----
    #[error("{} is shard {shard_no} (split.no, 0-based) of {count}; open the first shard (…-00001-of-{count:05}.gguf) instead", path.display())]
    NotFirstShard {
        path: PathBuf,
        shard_no: u64,
        count: u64,
    },
    #[error("{}: split.count is {count} but the file name does not follow <name>-00001-of-{count:05}.gguf, so the other shards cannot be located", path.display())]
    UnnamedSplit { path: PathBuf, count: u64 },
    #[error("{}: file name says {from_name} shards but split.count is {from_metadata}", path.display())]
    SplitNameMismatch {
        path: PathBuf,
        from_name: u64,
        from_metadata: u64,
    },
    #[error("missing shard {index} of {count}: {}", path.display())]
    MissingShard {
        path: PathBuf,
        index: u64,
        count: u64,
    },
    #[error("{}: split.count is {found}, but the first shard says {expected}", path.display())]
    SplitCountMismatch {
        path: PathBuf,
        expected: u64,
        found: u64,
    },
    #[error("{}: split.no is {found}, expected {expected}", path.display())]
    SplitNoMismatch {
        path: PathBuf,
        expected: u64,
        found: u64,
    },
    #[error("split.tensors.count says {expected} tensors but the {shards} shards hold {found}")]
    SplitTensorCount {
        expected: u64,
        found: u64,
        shards: usize,
    },
    #[error("tensor {tensor:?} appears in shard {first_shard} and again in shard {second_shard}")]
    DuplicateTensorAcrossShards {
        tensor: String,
        first_shard: usize,
        second_shard: usize,
    },

    // ---- writer ----
    #[error(
        "tensor {tensor:?}: {ty} with dims {dims:?} needs {expected} bytes of data, got {found}"
    )]
    TensorSizeMismatch {
        tensor: String,
        ty: GgmlType,
        dims: Vec<u64>,
        expected: u64,
        found: u64,
    },
    #[error("cannot write GGUF version {version} (supported: 2, 3)")]
    UnsupportedWriteVersion { version: u32 },
    #[error("cannot split: {reason}")]
    BadSplit { reason: String },
    #[error("cannot write: {reason}")]
    TooLarge { reason: String },
}

impl GgufError {
    /// The underlying error without the file-path context added by `GgufFile::open`.
    pub fn kind(&self) -> &GgufError {
        match self {
            GgufError::InFile { source, .. } => source.kind(),
            other => other,
        }
    }
}
