//! The GGUF container: what is in a file, never what the tensors mean.
//!
//! [`GgufFile`] memory-maps one model (all shards of a split model), parses and validates the
//! metadata and tensor directory, and hands out tensor data as slices of the mapping.
//! [`GgufWriter`] builds files, and reproduces a parsed file byte for byte.

// Every unsafe operation sits in its own block with a SAFETY comment saying why it is sound,
// unsafe functions included.
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

mod error;
mod reader;
mod split;
mod types;
mod value;
mod writer;

use std::collections::HashMap;
use std::fs::File;
use std::ops::Deref;
use std::path::{Path, PathBuf};

pub use error::GgufError;
pub use reader::{
    ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS, MAX_TENSOR_NAME_LEN,
};
pub use split::{split_shard_path, SPLIT_COUNT_KEY, SPLIT_NO_KEY, SPLIT_TENSORS_COUNT_KEY};
pub use types::GgmlType;
pub use value::{type_id as value_type_id, value_type_name, MetadataArray, MetadataValue};
pub use writer::{GgufWriter, SplitLimit, TensorDataSource};

use reader::ShardHeader;

/// One entry of the tensor directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml `ne` order: `dims[0]` is the contiguous (fastest-varying) dimension.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Relative to the data section of the tensor's shard, as stored in the file.
    pub offset: u64,
    /// Index of the shard holding the data (0 for single-file models).
    pub shard: usize,
    pub n_elements: u64,
    pub n_bytes: u64,
    /// Absolute byte offset of the data within its shard file.
    pub file_offset: u64,
}

impl TensorInfo {
    /// Number of rows: the product of every dimension after the first.
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }

    /// Bytes of one row (`dims[0]` elements).
    pub fn row_bytes(&self) -> u64 {
        // Validated when the info was parsed or added, so the division is exact.
        self.n_bytes / self.n_rows().max(1)
    }
}

/// The bytes of one shard: a read-only mapping of the file, a copy in anonymous memory
/// (`--no-mmap`), or an owned buffer.
enum ShardBytes {
    Mapped(memmap2::Mmap),
    /// Read from the file into memory of the process's own; its pages are never given back.
    Copied(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Deref for ShardBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            ShardBytes::Mapped(m) | ShardBytes::Copied(m) => m,
            ShardBytes::Owned(v) => v,
        }
    }
}

pub(crate) struct Shard {
    bytes: ShardBytes,
    header: ShardHeader,
}

impl Shard {
    fn parse(bytes: ShardBytes, index: usize) -> Result<Shard, GgufError> {
        let header = reader::parse_shard(&bytes, index)?;
        Ok(Shard { bytes, header })
    }

    /// Maps and parses `path`; errors carry the path.
    fn open(path: &Path, index: usize) -> Result<Shard, GgufError> {
        let io_err = |source| GgufError::Io {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(io_err)?;
        let len = file.metadata().map_err(io_err)?.len();
        let bytes = if len == 0 {
            // Mapping an empty file fails on some platforms; the parser reports the truncation.
            ShardBytes::Owned(Vec::new())
        } else {
            // SAFETY: the mapping is read-only. As with every mmap-based loader, another process
            // truncating or rewriting the file while it is mapped is outside what we can defend
            // against; model files are treated as immutable while open.
            ShardBytes::Mapped(unsafe { memmap2::Mmap::map(&file) }.map_err(io_err)?)
        };
        Shard::parse(bytes, index).map_err(|e| GgufError::InFile {
            path: path.to_owned(),
            source: Box::new(e),
        })
    }
}

/// One GGUF model, possibly split over several shard files, memory-mapped.
pub struct GgufFile {
    shards: Vec<Shard>,
    paths: Vec<PathBuf>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("paths", &self.paths)
            .field("version", &self.version())
            .field("n_kv", &self.metadata().len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens a model file. Given the first shard of a split model (`<name>-00001-of-0000N.gguf`,
    /// or `split.count` > 1 in its metadata) it opens and validates every shard; given another
    /// shard it fails with [`GgufError::NotFirstShard`].
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let first = Shard::open(path, 0)?;
        let (shards, paths) = split::open_all_shards(path, first)?;
        Self::assemble(shards, paths)
    }

    /// Copy every mapped shard into memory of the process's own and drop the file mappings
    /// (llama.cpp's `--no-mmap`): the model no longer depends on the file or the page cache.
    pub fn read_into_memory(&mut self) -> std::io::Result<()> {
        for shard in &mut self.shards {
            if let ShardBytes::Mapped(map) = &shard.bytes {
                let mut copy = memmap2::MmapMut::map_anon(map.len())?;
                copy.copy_from_slice(map);
                shard.bytes = ShardBytes::Copied(copy.make_read_only()?);
            }
        }
        Ok(())
    }

    /// Lock every shard's pages in RAM (llama.cpp's `--mlock`), reading them now. Fails when
    /// the process may not lock that much (`ulimit -l`).
    pub fn lock_in_memory(&self) -> std::io::Result<()> {
        for shard in &self.shards {
            match &shard.bytes {
                ShardBytes::Mapped(m) | ShardBytes::Copied(m) => m.lock()?,
                ShardBytes::Owned(_) => {}
            }
        }
        Ok(())
    }

    /// Whether the model is read through file mappings (false after
    /// [`read_into_memory`](Self::read_into_memory)).
    pub fn is_mapped(&self) -> bool {
        self.shards
            .iter()
            .any(|s| matches!(s.bytes, ShardBytes::Mapped(_)))
    }

    /// Parses a single shard held in memory (tests, fuzzing). Split metadata is kept but no
    /// other shards are looked for; [`shard_paths`](Self::shard_paths) is empty.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        let shard = Shard::parse(ShardBytes::Owned(bytes), 0)?;
        Self::assemble(vec![shard], Vec::new())
    }

    fn assemble(mut shards: Vec<Shard>, paths: Vec<PathBuf>) -> Result<GgufFile, GgufError> {
        let total: usize = shards.iter().map(|s| s.header.tensors.len()).sum();
        let mut tensors = Vec::with_capacity(total);
        let mut tensor_index = HashMap::with_capacity(total);
        for shard in &mut shards {
            for t in std::mem::take(&mut shard.header.tensors) {
                if let Some(&prev) = tensor_index.get(&t.name) {
                    let prev: &TensorInfo = &tensors[prev];
                    return Err(GgufError::DuplicateTensorAcrossShards {
                        tensor: t.name,
                        first_shard: prev.shard,
                        second_shard: t.shard,
                    });
                }
                tensor_index.insert(t.name.clone(), tensors.len());
                tensors.push(t);
            }
        }
        Ok(GgufFile {
            shards,
            paths,
            tensors,
            tensor_index,
        })
    }

    /// GGUF version of the (first) file: 2 or 3.
    pub fn version(&self) -> u32 {
        self.shards[0].header.version
    }

    /// Data alignment of the first shard (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.shards[0].header.alignment
    }

    /// The first shard's key-value pairs in file order (the other shards of a split model carry
    /// only their `split.*` keys).
    pub fn metadata(&self) -> &[(String, MetadataValue)] {
        &self.shards[0].header.kvs
    }

    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        let h = &self.shards[0].header;
        h.kv_index.get(key).map(|&i| &h.kvs[i].1)
    }

    fn typed<'s, T>(
        &'s self,
        key: &str,
        expected: &'static str,
        conv: impl FnOnce(&'s MetadataValue) -> Option<T>,
    ) -> Result<Option<T>, GgufError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        match conv(v) {
            Some(x) => Ok(Some(x)),
            None => Err(GgufError::MetadataType {
                key: key.to_owned(),
                expected,
                found: v.describe(),
            }),
        }
    }

    /// An integer of any type whose value fits in `u32`.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>, GgufError> {
        self.typed(key, "an integer fitting in u32", MetadataValue::as_u32)
    }

    /// An integer of any type whose value fits in `i32`.
    pub fn get_i32(&self, key: &str) -> Result<Option<i32>, GgufError> {
        self.typed(key, "an integer fitting in i32", MetadataValue::as_i32)
    }

    /// An integer of any type whose value fits in `u64`.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.typed(key, "an integer fitting in u64", MetadataValue::as_u64)
    }

    /// An integer of any type whose value fits in `i64`.
    pub fn get_i64(&self, key: &str) -> Result<Option<i64>, GgufError> {
        self.typed(key, "an integer fitting in i64", MetadataValue::as_i64)
    }

    /// An `f32`, or an `f64` narrowed.
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>, GgufError> {
        self.typed(key, "f32 or f64", MetadataValue::as_f32)
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.typed(key, "bool", MetadataValue::as_bool)
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.typed(key, "string", MetadataValue::as_str)
    }

    pub fn get_array(&self, key: &str) -> Result<Option<&MetadataArray>, GgufError> {
        self.typed(key, "array", MetadataValue::as_array)
    }

    /// Every tensor of every shard, shard by shard in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor's data: exactly `t.n_bytes` bytes, borrowed from the mapping.
    ///
    /// # Panics
    /// If `t` does not describe a tensor of this file (e.g. it came from another `GgufFile`);
    /// use [`try_tensor_data`](Self::try_tensor_data) for unchecked provenance.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        match self.try_tensor_data(t) {
            Some(d) => d,
            None => panic!(
                "tensor {:?} (shard {}, bytes {}+{}) is not part of this GgufFile",
                t.name, t.shard, t.file_offset, t.n_bytes
            ),
        }
    }

    /// Like [`tensor_data`](Self::tensor_data), but `None` when `t` does not fit this file.
    pub fn try_tensor_data(&self, t: &TensorInfo) -> Option<&[u8]> {
        let bytes: &[u8] = &self.shards.get(t.shard)?.bytes;
        let start = usize::try_from(t.file_offset).ok()?;
        let len = usize::try_from(t.n_bytes).ok()?;
        bytes.get(start..start.checked_add(len)?)
    }

    /// Tell the OS that this process no longer needs the mapped pages wholly inside tensor
    /// `t`'s bytes (for example after copying them into another layout), so they leave its
    /// resident set. The data stays readable: a later access maps the pages again from the
    /// file. Best effort: nothing happens for owned buffers, or when the OS declines.
    pub fn release_tensor_pages(&self, t: &TensorInfo) {
        let Some(shard) = self.shards.get(t.shard) else {
            return;
        };
        let ShardBytes::Mapped(map) = &shard.bytes else {
            return;
        };
        let (Ok(start), Ok(len)) = (usize::try_from(t.file_offset), usize::try_from(t.n_bytes))
        else {
            return;
        };
        const PAGE: usize = 4096;
        let first = start.div_ceil(PAGE) * PAGE;
        let end = (start.saturating_add(len) / PAGE * PAGE).min(map.len());
        if end > first {
            // SAFETY: a read-only shared file mapping; MADV_DONTNEED only drops this process's
            // page-table entries, and later reads fault the same file bytes back in.
            let _ = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, first, end - first)
            };
        }
    }

    /// Data of the tensor called `name`.
    pub fn tensor_data_by_name(&self, name: &str) -> Option<&[u8]> {
        self.tensor(name).map(|t| self.tensor_data(t))
    }

    /// The shard files, first shard first; empty for [`from_bytes`](Self::from_bytes).
    pub fn shard_paths(&self) -> &[PathBuf] {
        &self.paths
    }

    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Key-value pairs of shard `shard`, if it exists.
    pub fn shard_metadata(&self, shard: usize) -> Option<&[(String, MetadataValue)]> {
        self.shards.get(shard).map(|s| &s.header.kvs[..])
    }

    /// Absolute byte offset where shard `shard`'s data section begins.
    pub fn data_start(&self, shard: usize) -> Option<u64> {
        self.shards.get(shard).map(|s| s.header.data_start)
    }

    /// Total size in bytes of all shards.
    pub fn file_size(&self) -> u64 {
        self.shards.iter().map(|s| s.header.file_size).sum()
    }

    /// A 64-bit identity of the model: FNV-1a over the tensor directory (names, types, shapes,
    /// offsets) and the first and last 64 bytes of every tensor's data. Two files with the same
    /// weights agree; another model, quantization or fine-tune disagrees. Reads a few bytes per
    /// tensor, so it is cheap even for a mapped model of many gigabytes.
    pub fn fingerprint(&self) -> u64 {
        const SAMPLE: usize = 64;
        let mut h = Fnv1a::new();
        for t in &self.tensors {
            h.write(t.name.as_bytes());
            h.write(&t.ty.id().to_le_bytes());
            for d in &t.dims {
                h.write(&d.to_le_bytes());
            }
            h.write(&t.offset.to_le_bytes());
            if let Some(data) = self.try_tensor_data(t) {
                let head = &data[..data.len().min(SAMPLE)];
                let tail = &data[data.len().saturating_sub(SAMPLE)..];
                h.write(head);
                h.write(tail);
            }
        }
        h.finish()
    }

    pub(crate) fn shards(&self) -> &[Shard] {
        &self.shards
    }
}

impl Shard {
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub(crate) fn header(&self) -> &ShardHeader {
        &self.header
    }
}

/// 64-bit FNV-1a: stable across builds and platforms, unlike std's hasher.
pub struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a::new()
    }
}

impl Fnv1a {
    pub fn new() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }

    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    pub fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_can_be_shared_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<GgufFile>();
        assert_send_sync::<GgufError>();
    }

    #[test]
    fn tensor_data_rejects_foreign_infos() {
        let mut w = GgufWriter::new();
        w.add_tensor("a", vec![4], GgmlType::F32, vec![7; 16])
            .unwrap();
        let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
        let mut t = f.tensors()[0].clone();
        assert_eq!(f.try_tensor_data(&t), Some(&[7u8; 16][..]));
        assert_eq!(t.n_rows(), 1);
        assert_eq!(t.row_bytes(), 16);
        t.shard = 1;
        assert_eq!(f.try_tensor_data(&t), None);
        t.shard = 0;
        t.n_bytes = u64::MAX;
        assert_eq!(f.try_tensor_data(&t), None);
    }

    #[test]
    fn fingerprint_follows_the_weights() {
        let file = |byte: u8, name: &str| {
            let mut w = GgufWriter::new();
            w.add_tensor(name, vec![64], GgmlType::F32, vec![byte; 256])
                .unwrap();
            GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()
        };
        let a = file(1, "a").fingerprint();
        assert_eq!(a, file(1, "a").fingerprint());
        assert_ne!(a, file(2, "a").fingerprint());
        assert_ne!(a, file(1, "b").fingerprint());
    }
}
