//! Parsing one GGUF shard from a byte slice. Every length and count read from the file is checked
//! against the bytes that remain before anything is allocated for it.

use std::collections::{HashMap, HashSet};

use crate::value::{type_id, MetadataArray, MetadataValue};
use crate::{GgmlType, GgufError, TensorInfo};

pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// ggml's GGML_MAX_DIMS.
pub const MAX_DIMS: usize = 4;
/// ggml stores names in `char[GGML_MAX_NAME = 64]` including the NUL, so 63 bytes at most.
pub const MAX_TENSOR_NAME_LEN: usize = 63;
/// gguf-py can nest arrays; llama.cpp cannot. Bounded so that crafted input cannot exhaust the stack.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// Smallest possible encodings, used to reject counts the remaining bytes could not hold.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8;
/// Preallocation cap: vectors grow past it only as real entries are parsed.
const MAX_PREALLOC: usize = 1 << 16;

/// Everything in one shard's header, plus where its data section starts.
#[derive(Debug, Clone)]
pub(crate) struct ShardHeader {
    pub version: u32,
    pub alignment: u64,
    pub kvs: Vec<(String, MetadataValue)>,
    pub kv_index: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    /// Byte just after the last tensor info.
    pub infos_end: u64,
    /// First multiple of the alignment at or after `infos_end`.
    pub data_start: u64,
    pub file_size: u64,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: impl FnOnce() -> String) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.offset(),
                needed: n,
                available: self.remaining(),
            });
        }
        // n <= remaining <= usize::MAX here.
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.buf[start..self.pos])
    }

    fn array<const N: usize>(
        &mut self,
        what: impl FnOnce() -> String,
    ) -> Result<[u8; N], GgufError> {
        let bytes = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u32(&mut self, what: impl FnOnce() -> String) -> Result<u32, GgufError> {
        self.array::<4>(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: impl FnOnce() -> String) -> Result<u64, GgufError> {
        self.array::<8>(what).map(u64::from_le_bytes)
    }

    /// A GGUF string: `u64` length then UTF-8 bytes.
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let len_at = self.offset();
        let len = self.u64(|| format!("length of {}", what()))?;
        if len > self.remaining() {
            return Err(GgufError::LengthTooLarge {
                what: what(),
                len,
                offset: len_at,
                available: self.remaining(),
            });
        }
        let bytes_at = self.offset();
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::InvalidUtf8 {
                what: what(),
                offset: bytes_at,
            }),
        }
    }
}

/// Bytes one element of a value type takes at least; `None` for unknown type ids.
fn min_value_bytes(ty: u32) -> Option<u64> {
    Some(match ty {
        type_id::U8 | type_id::I8 | type_id::BOOL => 1,
        type_id::U16 | type_id::I16 => 2,
        type_id::U32 | type_id::I32 | type_id::F32 => 4,
        type_id::U64 | type_id::I64 | type_id::F64 => 8,
        type_id::STRING => 8,
        type_id::ARRAY => 4 + 8,
        _ => return None,
    })
}

fn read_value(
    c: &mut Cursor<'_>,
    key: &str,
    ty: u32,
    ty_offset: u64,
) -> Result<MetadataValue, GgufError> {
    let what = || format!("value of key {key:?}");
    Ok(match ty {
        type_id::U8 => MetadataValue::U8(c.array::<1>(what)?[0]),
        type_id::I8 => MetadataValue::I8(i8::from_le_bytes(c.array::<1>(what)?)),
        type_id::U16 => MetadataValue::U16(u16::from_le_bytes(c.array(what)?)),
        type_id::I16 => MetadataValue::I16(i16::from_le_bytes(c.array(what)?)),
        type_id::U32 => MetadataValue::U32(u32::from_le_bytes(c.array(what)?)),
        type_id::I32 => MetadataValue::I32(i32::from_le_bytes(c.array(what)?)),
        type_id::F32 => MetadataValue::F32(f32::from_le_bytes(c.array(what)?)),
        type_id::U64 => MetadataValue::U64(u64::from_le_bytes(c.array(what)?)),
        type_id::I64 => MetadataValue::I64(i64::from_le_bytes(c.array(what)?)),
        type_id::F64 => MetadataValue::F64(f64::from_le_bytes(c.array(what)?)),
        type_id::BOOL => {
            let at = c.offset();
            MetadataValue::Bool(read_bool(c.array::<1>(what)?[0], key, at)?)
        }
        type_id::STRING => MetadataValue::String(c.string(&what)?),
        type_id::ARRAY => MetadataValue::Array(read_array(c, key, 1)?),
        _ => {
            return Err(GgufError::UnknownValueType {
                key: key.to_owned(),
                type_id: ty,
                offset: ty_offset,
            })
        }
    })
}

fn read_bool(byte: u8, key: &str, offset: u64) -> Result<bool, GgufError> {
    match byte {
        0 => Ok(false),
        1 => Ok(true),
        value => Err(GgufError::InvalidBool {
            key: key.to_owned(),
            value,
            offset,
        }),
    }
}

/// Fixed-size elements, converted in bulk after one bounds check.
fn read_fixed<T, const N: usize>(
    c: &mut Cursor<'_>,
    count: u64,
    key: &str,
    conv: fn([u8; N]) -> T,
) -> Result<Vec<T>, GgufError> {
    // count * N <= remaining was checked by the caller, so this cannot overflow.
    let bytes = c.take(count * N as u64, || {
        format!("array elements of key {key:?}")
    })?;
    Ok(bytes
        .chunks_exact(N)
        .map(|ch| {
            let mut a = [0u8; N];
            a.copy_from_slice(ch);
            conv(a)
        })
        .collect())
}

fn read_array(c: &mut Cursor<'_>, key: &str, depth: usize) -> Result<MetadataArray, GgufError> {
    let header_at = c.offset();
    if depth > MAX_ARRAY_DEPTH {
        return Err(GgufError::NestingTooDeep {
            key: key.to_owned(),
            max_depth: MAX_ARRAY_DEPTH,
            offset: header_at,
        });
    }
    let elem_ty = c.u32(|| format!("array element type of key {key:?}"))?;
    let Some(min_bytes) = min_value_bytes(elem_ty) else {
        return Err(GgufError::UnknownValueType {
            key: key.to_owned(),
            type_id: elem_ty,
            offset: header_at,
        });
    };
    let count_at = c.offset();
    let count = c.u64(|| format!("array length of key {key:?}"))?;
    let available = c.remaining();
    if !matches!(count.checked_mul(min_bytes), Some(n) if n <= available) {
        return Err(GgufError::LengthTooLarge {
            what: format!(
                "array of {} for key {key:?}",
                crate::value::value_type_name(elem_ty).unwrap_or("?")
            ),
            len: count,
            offset: count_at,
            available,
        });
    }
    let prealloc = (count as usize).min(MAX_PREALLOC);
    Ok(match elem_ty {
        type_id::U8 => MetadataArray::U8(read_fixed(c, count, key, |b: [u8; 1]| b[0])?),
        type_id::I8 => MetadataArray::I8(read_fixed(c, count, key, i8::from_le_bytes)?),
        type_id::U16 => MetadataArray::U16(read_fixed(c, count, key, u16::from_le_bytes)?),
        type_id::I16 => MetadataArray::I16(read_fixed(c, count, key, i16::from_le_bytes)?),
        type_id::U32 => MetadataArray::U32(read_fixed(c, count, key, u32::from_le_bytes)?),
        type_id::I32 => MetadataArray::I32(read_fixed(c, count, key, i32::from_le_bytes)?),
        type_id::F32 => MetadataArray::F32(read_fixed(c, count, key, f32::from_le_bytes)?),
        type_id::U64 => MetadataArray::U64(read_fixed(c, count, key, u64::from_le_bytes)?),
        type_id::I64 => MetadataArray::I64(read_fixed(c, count, key, i64::from_le_bytes)?),
        type_id::F64 => MetadataArray::F64(read_fixed(c, count, key, f64::from_le_bytes)?),
        type_id::BOOL => {
            let at = c.offset();
            let bytes = read_fixed(c, count, key, |b: [u8; 1]| b[0])?;
            let mut out = Vec::with_capacity(bytes.len());
            for (i, &b) in bytes.iter().enumerate() {
                out.push(read_bool(b, key, at + i as u64)?);
            }
            MetadataArray::Bool(out)
        }
        type_id::STRING => {
            let mut out = Vec::with_capacity(prealloc);
            for i in 0..count {
                out.push(c.string(&|| format!("string element {i} of key {key:?}"))?);
            }
            MetadataArray::String(out)
        }
        // min_value_bytes accepted the id, so only ARRAY is left.
        _ => {
            let mut out = Vec::with_capacity(prealloc);
            for _ in 0..count {
                out.push(read_array(c, key, depth + 1)?);
            }
            MetadataArray::Array(out)
        }
    })
}

fn check_count(
    c: &Cursor<'_>,
    what: &'static str,
    count: u64,
    offset: u64,
    min_bytes: u64,
) -> Result<(), GgufError> {
    let max = c.remaining() / min_bytes;
    if count > max {
        return Err(GgufError::CountTooLarge {
            what,
            count,
            offset,
            max,
        });
    }
    Ok(())
}

pub(crate) fn align_up(x: u64, alignment: u64) -> Option<u64> {
    x.checked_next_multiple_of(alignment)
}

/// The alignment a KV list asks for, validated.
pub(crate) fn alignment_from_kvs(kvs: &[(String, MetadataValue)]) -> Result<u64, GgufError> {
    let Some((_, v)) = kvs.iter().find(|(k, _)| k == ALIGNMENT_KEY) else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    let Some(a) = v.as_u64() else {
        return Err(GgufError::MetadataType {
            key: ALIGNMENT_KEY.to_owned(),
            expected: "a non-negative integer",
            found: v.describe(),
        });
    };
    if a == 0 || !a.is_power_of_two() {
        return Err(GgufError::BadAlignment {
            key: ALIGNMENT_KEY.to_owned(),
            value: a,
        });
    }
    Ok(a)
}

/// Element count and byte size of a tensor, validating dims and block geometry.
pub(crate) fn tensor_geometry(
    name: &str,
    dims: &[u64],
    ty: GgmlType,
    info_offset: u64,
) -> Result<(u64, u64), GgufError> {
    if dims.is_empty() || dims.len() > MAX_DIMS {
        return Err(GgufError::TensorDimCount {
            tensor: name.to_owned(),
            n_dims: dims.len() as u64,
            max: MAX_DIMS,
            offset: info_offset,
        });
    }
    // ggml keeps ne as int64_t.
    let max = i64::MAX as u64;
    for (index, &value) in dims.iter().enumerate() {
        if value == 0 || value > max {
            return Err(GgufError::TensorDim {
                tensor: name.to_owned(),
                index,
                value,
                max,
                offset: info_offset,
            });
        }
    }
    let overflow = || GgufError::ElementCountOverflow {
        tensor: name.to_owned(),
        dims: dims.to_vec(),
        offset: info_offset,
    };
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= max)
        .ok_or_else(overflow)?;
    let ne0 = dims[0];
    let Some(row) = ty.row_bytes(ne0) else {
        return Err(GgufError::PartialBlock {
            tensor: name.to_owned(),
            ty,
            ne0,
            block_size: ty.block_size(),
            offset: info_offset,
        });
    };
    let n_bytes = row.checked_mul(n_elements / ne0).ok_or_else(overflow)?;
    Ok((n_elements, n_bytes))
}

fn read_tensor_info(c: &mut Cursor<'_>, index: u64, shard: usize) -> Result<TensorInfo, GgufError> {
    let info_offset = c.offset();
    let name = c.string(&|| format!("name of tensor #{index}"))?;
    if name.len() > MAX_TENSOR_NAME_LEN {
        return Err(GgufError::TensorNameTooLong {
            len: name.len(),
            tensor: name,
            max: MAX_TENSOR_NAME_LEN,
            offset: info_offset,
        });
    }
    let n_dims_at = c.offset();
    let n_dims = c.u32(|| format!("n_dims of tensor {name:?}"))?;
    if n_dims == 0 || n_dims as usize > MAX_DIMS {
        return Err(GgufError::TensorDimCount {
            tensor: name,
            n_dims: n_dims.into(),
            max: MAX_DIMS,
            offset: n_dims_at,
        });
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for i in 0..n_dims {
        dims.push(c.u64(|| format!("dimension {i} of tensor {name:?}"))?);
    }
    let ty_at = c.offset();
    let ty_id = c.u32(|| format!("ggml type of tensor {name:?}"))?;
    let Some(ty) = GgmlType::from_id(ty_id) else {
        return Err(GgufError::UnknownGgmlType {
            tensor: name,
            id: ty_id,
            offset: ty_at,
        });
    };
    let offset = c.u64(|| format!("data offset of tensor {name:?}"))?;
    let (n_elements, n_bytes) = tensor_geometry(&name, &dims, ty, info_offset)?;
    Ok(TensorInfo {
        name,
        dims,
        ty,
        offset,
        shard,
        n_elements,
        n_bytes,
        file_offset: 0, // set once the data section start is known
    })
}

/// Refuses two tensors whose data ranges (relative to the same data section) intersect.
pub(crate) fn check_overlaps(tensors: &[TensorInfo]) -> Result<(), GgufError> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| (tensors[i].offset, tensors[i].n_bytes));
    for pair in order.windows(2) {
        let (a, b) = (&tensors[pair[0]], &tensors[pair[1]]);
        // Offsets and sizes were bounds-checked against the file, so the sum cannot overflow.
        let a_end = a.offset + a.n_bytes;
        if b.offset < a_end {
            return Err(GgufError::TensorOverlap {
                first: a.name.clone(),
                first_start: a.offset,
                first_end: a_end,
                second: b.name.clone(),
                second_start: b.offset,
            });
        }
    }
    Ok(())
}

/// Parses one shard. `shard` is stored in each tensor info.
pub(crate) fn parse_shard(bytes: &[u8], shard: usize) -> Result<ShardHeader, GgufError> {
    let mut c = Cursor { buf: bytes, pos: 0 };
    let magic = c.array::<4>(|| "magic".into())?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32(|| "version".into())?;
    match version {
        2 | 3 => {}
        v if matches!(v.swap_bytes(), 1..=3) => {
            return Err(GgufError::BigEndian {
                version: v.swap_bytes(),
            })
        }
        v => return Err(GgufError::UnsupportedVersion { version: v }),
    }
    let n_tensors_at = c.offset();
    let n_tensors = c.u64(|| "tensor count".into())?;
    let n_kv_at = c.offset();
    let n_kv = c.u64(|| "metadata key-value count".into())?;
    check_count(&c, "metadata key-value", n_kv, n_kv_at, MIN_KV_BYTES)?;
    check_count(&c, "tensor", n_tensors, n_tensors_at, MIN_TENSOR_INFO_BYTES)?;
    let header_min = n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES;
    if header_min > c.remaining() {
        return Err(GgufError::CountTooLarge {
            what: "tensor",
            count: n_tensors,
            offset: n_tensors_at,
            max: c.remaining().saturating_sub(n_kv * MIN_KV_BYTES) / MIN_TENSOR_INFO_BYTES,
        });
    }

    let mut kvs = Vec::with_capacity((n_kv as usize).min(MAX_PREALLOC));
    let mut kv_index = HashMap::with_capacity((n_kv as usize).min(MAX_PREALLOC));
    for i in 0..n_kv {
        let key_at = c.offset();
        let key = c.string(&|| format!("key of metadata entry #{i}"))?;
        if kv_index.contains_key(&key) {
            return Err(GgufError::DuplicateKey {
                key,
                offset: key_at,
            });
        }
        let ty_at = c.offset();
        let ty = c.u32(|| format!("value type of key {key:?}"))?;
        let value = read_value(&mut c, &key, ty, ty_at)?;
        kv_index.insert(key.clone(), kvs.len());
        kvs.push((key, value));
    }
    let alignment = alignment_from_kvs(&kvs)?;

    let mut tensors = Vec::with_capacity((n_tensors as usize).min(MAX_PREALLOC));
    let mut names = HashSet::with_capacity(tensors.capacity());
    for i in 0..n_tensors {
        let info_at = c.offset();
        let t = read_tensor_info(&mut c, i, shard)?;
        if !names.insert(t.name.clone()) {
            return Err(GgufError::DuplicateTensor {
                tensor: t.name,
                offset: info_at,
            });
        }
        tensors.push(t);
    }
    let infos_end = c.offset();
    let file_size = bytes.len() as u64;
    // infos_end <= file_size < 2^63 and alignment <= 2^63, so this cannot overflow in practice;
    // saturate rather than trust that.
    let data_start = align_up(infos_end, alignment).unwrap_or(u64::MAX);
    for t in &mut tensors {
        if t.offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor {
                tensor: t.name.clone(),
                data_offset: t.offset,
                alignment,
            });
        }
        let end = data_start
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(t.n_bytes));
        if !matches!(end, Some(e) if e <= file_size) {
            return Err(GgufError::TensorOutOfBounds {
                tensor: t.name.clone(),
                start: t.offset,
                n_bytes: t.n_bytes,
                data_start,
                file_size,
            });
        }
        t.file_offset = data_start + t.offset;
    }
    check_overlaps(&tensors)?;
    Ok(ShardHeader {
        version,
        alignment,
        kvs,
        kv_index,
        tensors,
        infos_end,
        data_start,
        file_size,
    })
}

#[cfg(test)]
#[path = "reader_tests.rs"]
mod tests;
