//! Building GGUF files, and rewriting parsed ones byte for byte.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::reader::{align_up, alignment_from_kvs, tensor_geometry, ALIGNMENT_KEY};
use crate::split::{split_shard_path, SPLIT_COUNT_KEY, SPLIT_NO_KEY, SPLIT_TENSORS_COUNT_KEY};
use crate::value::{MetadataArray, MetadataValue};
use crate::{GgmlType, GgufError, GgufFile, MAX_ARRAY_DEPTH, MAX_TENSOR_NAME_LEN};

/// How [`GgufWriter::write_split`] distributes tensors over shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitLimit {
    /// At most this many tensors per shard.
    MaxTensors(usize),
    /// At most this many bytes of (padded) tensor data per shard; a bigger tensor gets a shard
    /// of its own.
    MaxBytes(u64),
}

struct WriterTensor<'a> {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    /// The bytes, or empty for a deferred tensor whose bytes come from the writer's caller.
    data: Cow<'a, [u8]>,
    /// Bytes of data (`data.len()` unless deferred).
    len: u64,
    deferred: bool,
}

/// Writes the bytes of the deferred tensor of the given name (exactly its size).
pub type TensorDataSource<'s> = dyn FnMut(&str, &mut dyn Write) -> std::io::Result<()> + 's;

/// The byte layout of a parsed single-file model, kept so that rewriting reproduces its
/// offsets, padding and any gaps exactly, whatever the original writer put there.
struct PreservedLayout<'a> {
    alignment: u64,
    /// Length of magic + counts + KVs + tensor infos in the original file.
    header_len: u64,
    /// Original bytes between the tensor infos and the data section.
    header_padding: &'a [u8],
    /// Data-section offset of each tensor, in tensor order.
    offsets: Vec<u64>,
    /// Every data-section range no tensor covers: (offset, original bytes).
    fillers: Vec<(u64, &'a [u8])>,
}

/// Builds a GGUF file: version, ordered key-value pairs, tensors.
///
/// The `general.alignment` key is the single source of the data alignment (32 when absent).
pub struct GgufWriter<'a> {
    version: u32,
    kvs: Vec<(String, MetadataValue)>,
    tensors: Vec<WriterTensor<'a>>,
    tensor_names: HashSet<String>,
    layout: Option<PreservedLayout<'a>>,
}

impl Default for GgufWriter<'_> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'a> GgufWriter<'a> {
    /// Version 3, alignment 32, nothing in it.
    pub fn new() -> Self {
        GgufWriter {
            version: 3,
            kvs: Vec::new(),
            tensors: Vec::new(),
            tensor_names: HashSet::new(),
            layout: None,
        }
    }

    /// Everything in `f`, tensor data borrowed from its mapping. For a single-file model,
    /// writing the result reproduces the file byte for byte (as long as tensors are not added or
    /// removed and the alignment is unchanged). For a split model the tensors of all shards are
    /// gathered into one file without the `split.*` keys and laid out afresh.
    pub fn from_file(f: &'a GgufFile) -> Self {
        let single = f.shard_count() == 1;
        let mut w = GgufWriter::new();
        w.version = f.version();
        w.kvs = f
            .metadata()
            .iter()
            .filter(|(k, _)| single || !is_split_key(k))
            .cloned()
            .collect();
        for t in f.tensors() {
            w.tensor_names.insert(t.name.clone());
            w.tensors.push(WriterTensor {
                name: t.name.clone(),
                dims: t.dims.clone(),
                ty: t.ty,
                data: Cow::Borrowed(f.tensor_data(t)),
                len: t.n_bytes,
                deferred: false,
            });
        }
        if single {
            w.layout = Some(preserved_layout(f));
        }
        w
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    /// 2 or 3 (the two differ only in what readers accept); checked when writing.
    pub fn set_version(&mut self, version: u32) {
        self.version = version;
    }

    /// Sets `general.alignment` (as u32, like llama.cpp; u64 if it does not fit). Checked to be a
    /// non-zero power of two when writing.
    pub fn set_alignment(&mut self, alignment: u64) {
        let v = match u32::try_from(alignment) {
            Ok(a) => MetadataValue::U32(a),
            Err(_) => MetadataValue::U64(alignment),
        };
        self.set_kv(ALIGNMENT_KEY, v);
    }

    /// The alignment `general.alignment` asks for (32 when absent).
    pub fn alignment(&self) -> Result<u64, GgufError> {
        alignment_from_kvs(&self.kvs)
    }

    /// Appends a key-value pair. A key added twice makes writing fail with `DuplicateKey`.
    pub fn add_kv(&mut self, key: impl Into<String>, value: impl Into<MetadataValue>) {
        self.kvs.push((key.into(), value.into()));
    }

    /// Replaces the value of `key` where it stands, or appends it.
    pub fn set_kv(&mut self, key: impl Into<String>, value: impl Into<MetadataValue>) {
        let key = key.into();
        let value = value.into();
        match self.kvs.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => self.kvs.push((key, value)),
        }
    }

    /// Removes `key`, returning its value.
    pub fn remove_kv(&mut self, key: &str) -> Option<MetadataValue> {
        let i = self.kvs.iter().position(|(k, _)| k == key)?;
        Some(self.kvs.remove(i).1)
    }

    pub fn kvs(&self) -> &[(String, MetadataValue)] {
        &self.kvs
    }

    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.kvs.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Appends a tensor; `dims` in ggml `ne` order. Checks the name, dims, block geometry and that
    /// `data` is exactly the size the type and dims need.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: Vec<u64>,
        ty: GgmlType,
        data: impl Into<Cow<'a, [u8]>>,
    ) -> Result<(), GgufError> {
        let name = name.into();
        let data = data.into();
        let n_bytes = self.check_new_tensor(&name, &dims, ty)?;
        if n_bytes != data.len() as u64 {
            return Err(GgufError::TensorSizeMismatch {
                tensor: name,
                ty,
                dims,
                expected: n_bytes,
                found: data.len() as u64,
            });
        }
        self.push_tensor(WriterTensor {
            name,
            dims,
            ty,
            len: n_bytes,
            data,
            deferred: false,
        });
        Ok(())
    }

    /// Appends a tensor whose bytes are produced while the file is written (by the source given
    /// to [`GgufWriter::write_file_with`] or [`GgufWriter::write_split_with`]), so a file far
    /// bigger than memory can be written tensor by tensor. Checks as [`GgufWriter::add_tensor`];
    /// returns the tensor's size in bytes.
    pub fn add_tensor_deferred(
        &mut self,
        name: impl Into<String>,
        dims: Vec<u64>,
        ty: GgmlType,
    ) -> Result<u64, GgufError> {
        let name = name.into();
        let n_bytes = self.check_new_tensor(&name, &dims, ty)?;
        self.push_tensor(WriterTensor {
            name,
            dims,
            ty,
            data: Cow::Borrowed(&[]),
            len: n_bytes,
            deferred: true,
        });
        Ok(n_bytes)
    }

    /// Record a checked tensor; the layout is computed again when next needed.
    fn push_tensor(&mut self, tensor: WriterTensor<'a>) {
        self.layout = None;
        self.tensor_names.insert(tensor.name.clone());
        self.tensors.push(tensor);
    }

    /// The checks every new tensor passes (name length, no duplicate, dims and block geometry);
    /// returns its size in bytes.
    fn check_new_tensor(&self, name: &str, dims: &[u64], ty: GgmlType) -> Result<u64, GgufError> {
        if name.len() > MAX_TENSOR_NAME_LEN {
            return Err(GgufError::TensorNameTooLong {
                len: name.len(),
                tensor: name.to_string(),
                max: MAX_TENSOR_NAME_LEN,
                offset: 0,
            });
        }
        if self.tensor_names.contains(name) {
            return Err(GgufError::DuplicateTensor {
                tensor: name.to_string(),
                offset: 0,
            });
        }
        let (_, n_bytes) = tensor_geometry(name, dims, ty, 0)?;
        Ok(n_bytes)
    }

    /// Removes the tensor called `name`; `false` if there is none.
    pub fn remove_tensor(&mut self, name: &str) -> bool {
        let Some(i) = self.tensors.iter().position(|t| t.name == name) else {
            return false;
        };
        self.tensors.remove(i);
        self.tensor_names.remove(name);
        self.layout = None;
        true
    }

    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// Forgets the layout copied by [`from_file`](Self::from_file): the next write lays tensors
    /// out in order, each at the next aligned offset, with zero padding (as llama.cpp does).
    pub fn discard_preserved_layout(&mut self) {
        self.layout = None;
    }

    /// Writes the whole file. Everything is validated before the first byte goes out.
    ///
    /// Laid out afresh, tensors follow the tensor infos in order, each at the next multiple of
    /// the alignment, zero padded (as llama.cpp and gguf-py do); a file without tensors ends
    /// right after its key-value pairs.
    pub fn write_to<W: Write + ?Sized>(&self, w: &mut W) -> Result<(), GgufError> {
        self.write_to_with(w, &mut |name, _| {
            Err(std::io::Error::other(format!(
                "no data source for deferred tensor '{name}'"
            )))
        })
    }

    /// [`GgufWriter::write_to`], taking the bytes of deferred tensors from `source`.
    pub fn write_to_with<W: Write + ?Sized>(
        &self,
        w: &mut W,
        source: &mut TensorDataSource<'_>,
    ) -> Result<(), GgufError> {
        if !matches!(self.version, 2 | 3) {
            return Err(GgufError::UnsupportedWriteVersion {
                version: self.version,
            });
        }
        let alignment = self.alignment()?;
        let layout = self
            .layout
            .as_ref()
            .filter(|l| l.alignment == alignment && l.offsets.len() == self.tensors.len());
        let offsets = match layout {
            Some(l) => l.offsets.clone(),
            None => self.fresh_offsets(alignment)?,
        };
        let header = self.encode_header(&offsets)?;
        w.write_all(&header).map_err(GgufError::Write)?;
        let header_len = header.len() as u64;
        match layout {
            Some(l) if l.header_len == header_len => {
                w.write_all(l.header_padding).map_err(GgufError::Write)?
            }
            // No tensors, no data section to align (gguf-py writes vocab-only files this way).
            // Padding anyway would let a tiny file with a huge `general.alignment` expand into
            // gigabytes of zeros.
            _ if self.tensors.is_empty() => {}
            _ => write_zeros(w, padding(header_len, alignment)?)?,
        }
        match layout {
            Some(l) => {
                let mut pieces: Vec<(u64, &[u8])> = self
                    .tensors
                    .iter()
                    .zip(&offsets)
                    .map(|(t, &o)| (o, &t.data[..]))
                    .chain(l.fillers.iter().copied())
                    .collect();
                pieces.sort_by_key(|p| p.0);
                let mut pos = 0u64;
                for (offset, bytes) in pieces {
                    // The preserved pieces tile the data section; zeros only if that ever breaks.
                    write_zeros(w, offset.saturating_sub(pos))?;
                    w.write_all(bytes).map_err(GgufError::Write)?;
                    pos = pos.max(offset) + bytes.len() as u64;
                }
            }
            None => {
                for t in &self.tensors {
                    if t.deferred {
                        let mut counted = CountingWriter {
                            inner: &mut *w,
                            written: 0,
                        };
                        source(&t.name, &mut counted).map_err(GgufError::Write)?;
                        if counted.written != t.len {
                            return Err(GgufError::Write(std::io::Error::other(format!(
                                "deferred tensor '{}' produced {} bytes, expected {}",
                                t.name, counted.written, t.len
                            ))));
                        }
                    } else {
                        w.write_all(&t.data).map_err(GgufError::Write)?;
                    }
                    write_zeros(w, padding(t.len, alignment)?)?;
                }
            }
        }
        Ok(())
    }

    /// The whole file in memory.
    pub fn to_bytes(&self) -> Result<Vec<u8>, GgufError> {
        let mut out = Vec::new();
        self.write_to(&mut out)?;
        Ok(out)
    }

    /// Writes the file to `path` (created or truncated).
    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<(), GgufError> {
        self.write_file_with(path, &mut |name, _| {
            Err(std::io::Error::other(format!(
                "no data source for deferred tensor '{name}'"
            )))
        })
    }

    /// [`GgufWriter::write_file`], taking the bytes of deferred tensors from `source`.
    pub fn write_file_with(
        &self,
        path: impl AsRef<Path>,
        source: &mut TensorDataSource<'_>,
    ) -> Result<(), GgufError> {
        let path = path.as_ref();
        let io_err = |source| GgufError::Io {
            path: path.to_owned(),
            source,
        };
        let file = File::create(path).map_err(io_err)?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        self.write_to_with(&mut out, source).map_err(|e| match e {
            GgufError::Write(source) => io_err(source),
            other => other,
        })?;
        out.flush().map_err(io_err)?;
        Ok(())
    }

    /// Writes `<stem>-00001-of-0000N.gguf` ... like `llama-gguf-split`: every tensor in order,
    /// distributed by `limit`; the first shard carries all metadata, every shard carries
    /// `split.no` (u16, 0-based), `split.count` (u16) and `split.tensors.count` (i32).
    /// Shards after the first also carry `general.alignment` when it is set, so each is
    /// self-describing. Returns the paths written.
    pub fn write_split(
        &self,
        stem: impl AsRef<Path>,
        limit: SplitLimit,
    ) -> Result<Vec<PathBuf>, GgufError> {
        self.write_split_with(stem, limit, &mut |name, _| {
            Err(std::io::Error::other(format!(
                "no data source for deferred tensor '{name}'"
            )))
        })
    }

    /// [`GgufWriter::write_split`], taking the bytes of deferred tensors from `source`.
    pub fn write_split_with(
        &self,
        stem: impl AsRef<Path>,
        limit: SplitLimit,
        source: &mut TensorDataSource<'_>,
    ) -> Result<Vec<PathBuf>, GgufError> {
        let alignment = self.alignment()?;
        let groups = self.split_groups(limit, alignment)?;
        let count = u16::try_from(groups.len()).map_err(|_| GgufError::BadSplit {
            reason: format!("{} shards exceed split.count's u16 range", groups.len()),
        })?;
        let total = i32::try_from(self.tensors.len()).map_err(|_| GgufError::BadSplit {
            reason: format!(
                "{} tensors exceed split.tensors.count's i32 range",
                self.tensors.len()
            ),
        })?;
        let mut paths = Vec::with_capacity(groups.len());
        for (no, group) in groups.iter().enumerate() {
            let mut shard = GgufWriter::new();
            shard.version = self.version;
            shard.kvs = if no == 0 {
                self.kvs
                    .iter()
                    .filter(|(k, _)| !is_split_key(k))
                    .cloned()
                    .collect()
            } else {
                self.kvs
                    .iter()
                    .filter(|(k, _)| k == ALIGNMENT_KEY)
                    .cloned()
                    .collect()
            };
            // no < count <= u16::MAX
            shard
                .kvs
                .push((SPLIT_NO_KEY.into(), MetadataValue::U16(no as u16)));
            shard
                .kvs
                .push((SPLIT_COUNT_KEY.into(), MetadataValue::U16(count)));
            shard
                .kvs
                .push((SPLIT_TENSORS_COUNT_KEY.into(), MetadataValue::I32(total)));
            for t in &self.tensors[group.clone()] {
                shard.tensors.push(WriterTensor {
                    name: t.name.clone(),
                    dims: t.dims.clone(),
                    ty: t.ty,
                    data: Cow::Borrowed(&t.data),
                    len: t.len,
                    deferred: t.deferred,
                });
            }
            let path = split_shard_path(stem.as_ref(), no as u64 + 1, count.into());
            shard.write_file_with(&path, source)?;
            paths.push(path);
        }
        Ok(paths)
    }

    /// Consecutive index ranges of tensors, one per shard (one empty shard if no tensors).
    fn split_groups(
        &self,
        limit: SplitLimit,
        alignment: u64,
    ) -> Result<Vec<std::ops::Range<usize>>, GgufError> {
        let n = self.tensors.len();
        let mut groups = Vec::new();
        match limit {
            SplitLimit::MaxTensors(0) | SplitLimit::MaxBytes(0) => {
                return Err(GgufError::BadSplit {
                    reason: format!("limit {limit:?} must be positive"),
                })
            }
            SplitLimit::MaxTensors(per) => {
                let mut start = 0;
                while start < n {
                    let end = start.saturating_add(per).min(n);
                    groups.push(start..end);
                    start = end;
                }
            }
            SplitLimit::MaxBytes(max) => {
                let (mut start, mut bytes) = (0usize, 0u64);
                for (i, t) in self.tensors.iter().enumerate() {
                    let size = align_up(t.len, alignment).unwrap_or(u64::MAX);
                    if i > start && bytes.saturating_add(size) > max {
                        groups.push(start..i);
                        (start, bytes) = (i, 0);
                    }
                    bytes = bytes.saturating_add(size);
                }
                if start < n {
                    groups.push(start..n);
                }
            }
        }
        if groups.is_empty() {
            groups.push(0..0);
        }
        Ok(groups)
    }

    fn fresh_offsets(&self, alignment: u64) -> Result<Vec<u64>, GgufError> {
        let mut offsets = Vec::with_capacity(self.tensors.len());
        let mut next = 0u64;
        for t in &self.tensors {
            offsets.push(next);
            next = next
                .checked_add(t.len)
                .and_then(|e| align_up(e, alignment))
                .ok_or_else(|| GgufError::TooLarge {
                    reason: format!("tensor {:?}: data section size overflows u64", t.name),
                })?;
        }
        Ok(offsets)
    }

    /// Magic, counts, KVs and tensor infos. Refuses what a reader would refuse: duplicate keys,
    /// arrays nested too deep.
    fn encode_header(&self, offsets: &[u64]) -> Result<Vec<u8>, GgufError> {
        let mut b = Vec::with_capacity(4096);
        b.extend_from_slice(&crate::GGUF_MAGIC);
        b.extend_from_slice(&self.version.to_le_bytes());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        let mut seen = HashSet::with_capacity(self.kvs.len());
        for (key, value) in &self.kvs {
            let at = b.len() as u64;
            if !seen.insert(key.as_str()) {
                return Err(GgufError::DuplicateKey {
                    key: key.clone(),
                    offset: at,
                });
            }
            if let MetadataValue::Array(a) = value {
                if array_depth(a) > MAX_ARRAY_DEPTH {
                    return Err(GgufError::NestingTooDeep {
                        key: key.clone(),
                        max_depth: MAX_ARRAY_DEPTH,
                        offset: at,
                    });
                }
            }
            put_str(&mut b, key);
            b.extend_from_slice(&value.type_id().to_le_bytes());
            put_value(&mut b, value);
        }
        for (t, &offset) in self.tensors.iter().zip(offsets) {
            put_str(&mut b, &t.name);
            b.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&t.ty.id().to_le_bytes());
            b.extend_from_slice(&offset.to_le_bytes());
        }
        Ok(b)
    }
}

fn is_split_key(k: &str) -> bool {
    k == SPLIT_NO_KEY || k == SPLIT_COUNT_KEY || k == SPLIT_TENSORS_COUNT_KEY
}

fn preserved_layout(f: &GgufFile) -> PreservedLayout<'_> {
    let shard = &f.shards()[0];
    let (bytes, h) = (shard.bytes(), shard.header());
    let file_size = bytes.len() as u64;
    // All of these were bounds-checked by the parser; the min() calls only guard the zero-tensor
    // file that ends before its (empty) data section would start.
    let data_start = h.data_start.min(file_size);
    let header_padding = &bytes[h.infos_end as usize..data_start as usize];
    let data = &bytes[data_start as usize..];
    let mut ranges: Vec<(u64, u64)> = f.tensors().iter().map(|t| (t.offset, t.n_bytes)).collect();
    ranges.sort_unstable();
    let mut fillers = Vec::new();
    let mut pos = 0u64;
    for (offset, len) in ranges.into_iter().chain([(data.len() as u64, 0)]) {
        if offset > pos {
            fillers.push((pos, &data[pos as usize..offset as usize]));
        }
        pos = pos.max(offset + len);
    }
    PreservedLayout {
        alignment: h.alignment,
        header_len: h.infos_end,
        header_padding,
        offsets: f.tensors().iter().map(|t| t.offset).collect(),
        fillers,
    }
}

fn padding(len: u64, alignment: u64) -> Result<u64, GgufError> {
    align_up(len, alignment)
        .map(|a| a - len)
        .ok_or_else(|| GgufError::TooLarge {
            reason: format!("padding {len} bytes to {alignment} overflows u64"),
        })
}

fn write_zeros<W: Write + ?Sized>(w: &mut W, mut n: u64) -> Result<(), GgufError> {
    const ZEROS: [u8; 4096] = [0; 4096];
    while n > 0 {
        let k = n.min(ZEROS.len() as u64) as usize;
        w.write_all(&ZEROS[..k]).map_err(GgufError::Write)?;
        n -= k as u64;
    }
    Ok(())
}

fn array_depth(a: &MetadataArray) -> usize {
    match a {
        MetadataArray::Array(v) => 1 + v.iter().map(array_depth).max().unwrap_or(0),
        _ => 1,
    }
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

fn put_value(b: &mut Vec<u8>, v: &MetadataValue) {
    match v {
        MetadataValue::U8(x) => b.push(*x),
        MetadataValue::I8(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::U16(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::U32(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::F32(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::Bool(x) => b.push(u8::from(*x)),
        MetadataValue::String(s) => put_str(b, s),
        MetadataValue::Array(a) => put_array(b, a),
        MetadataValue::U64(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::F64(x) => b.extend_from_slice(&x.to_le_bytes()),
    }
}

fn put_array(b: &mut Vec<u8>, a: &MetadataArray) {
    b.extend_from_slice(&a.element_type_id().to_le_bytes());
    b.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! each_le {
        ($v:expr) => {
            for x in $v {
                b.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        MetadataArray::U8(v) => b.extend_from_slice(v),
        MetadataArray::I8(v) => each_le!(v),
        MetadataArray::U16(v) => each_le!(v),
        MetadataArray::I16(v) => each_le!(v),
        MetadataArray::U32(v) => each_le!(v),
        MetadataArray::I32(v) => each_le!(v),
        MetadataArray::F32(v) => each_le!(v),
        MetadataArray::Bool(v) => b.extend(v.iter().map(|&x| u8::from(x))),
        MetadataArray::String(v) => v.iter().for_each(|s| put_str(b, s)),
        MetadataArray::Array(v) => v.iter().for_each(|inner| put_array(b, inner)),
        MetadataArray::U64(v) => each_le!(v),
        MetadataArray::I64(v) => each_le!(v),
        MetadataArray::F64(v) => each_le!(v),
    }
}

#[cfg(test)]
#[path = "writer_tests.rs"]
mod tests;

/// Counts what passes through, to check that a deferred tensor got exactly its bytes.
struct CountingWriter<'w, W: Write + ?Sized> {
    inner: &'w mut W,
    written: u64,
}

impl<W: Write + ?Sized> Write for CountingWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}
