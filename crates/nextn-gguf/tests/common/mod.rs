//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use nextn_gguf::{GgmlType, GgufWriter, MetadataArray, MetadataValue};

/// Committed fixtures written by gguf-py (see tests/data/make_fixtures.py).
pub fn data_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data"))
}

/// Every `*.gguf` below `dir`, sorted.
pub fn gguf_files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "gguf") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Bytes for a tensor of `ty` and `dims`, filled with a pattern derived from `seed`.
pub fn tensor_bytes(ty: GgmlType, dims: &[u64], seed: u8) -> Vec<u8> {
    let n: u64 = dims.iter().product();
    let len = ty.row_bytes(dims[0]).unwrap() * (n / dims[0]);
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A file with every metadata value type (nested and empty arrays too) and tensors of several
/// ggml types, including exotic ones the container must accept.
pub fn rich_writer() -> GgufWriter<'static> {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "testarch");
    w.add_kv("v.u8", MetadataValue::U8(7));
    w.add_kv("v.i8", MetadataValue::I8(-7));
    w.add_kv("v.u16", MetadataValue::U16(65535));
    w.add_kv("v.i16", MetadataValue::I16(-32768));
    w.add_kv("v.u32", MetadataValue::U32(123456));
    w.add_kv("v.i32", MetadataValue::I32(-123456));
    w.add_kv("v.f32", MetadataValue::F32(3.25));
    w.add_kv("v.bool", MetadataValue::Bool(true));
    w.add_kv("v.str", "text ✓");
    w.add_kv("v.u64", MetadataValue::U64(u64::MAX));
    w.add_kv("v.i64", MetadataValue::I64(i64::MIN));
    w.add_kv("v.f64", MetadataValue::F64(-0.125));
    w.add_kv("a.u8", MetadataArray::U8(vec![1, 2, 3]));
    w.add_kv("a.i8", MetadataArray::I8(vec![-1, 2]));
    w.add_kv("a.u16", MetadataArray::U16(vec![9, 10]));
    w.add_kv("a.i16", MetadataArray::I16(vec![-9]));
    w.add_kv("a.u32", MetadataArray::U32(vec![11, 12, 13]));
    w.add_kv("a.i32", MetadataArray::I32(vec![11, -12, 0, 0]));
    w.add_kv("a.f32", MetadataArray::F32(vec![0.5, f32::NAN, -0.0]));
    w.add_kv("a.bool", MetadataArray::Bool(vec![true, false]));
    w.add_kv(
        "a.str",
        MetadataArray::String(vec!["<s>".into(), String::new(), "ĠĠ".into()]),
    );
    w.add_kv("a.u64", MetadataArray::U64(vec![1 << 40]));
    w.add_kv("a.i64", MetadataArray::I64(vec![-(1 << 40)]));
    w.add_kv("a.f64", MetadataArray::F64(vec![1e300]));
    w.add_kv("a.empty", MetadataArray::F32(vec![]));
    w.add_kv(
        "a.nested",
        MetadataArray::Array(vec![
            MetadataArray::I32(vec![1, 2]),
            MetadataArray::String(vec!["x".into()]),
            MetadataArray::Array(vec![MetadataArray::U8(vec![])]),
        ]),
    );
    let tensors: &[(&str, &[u64], GgmlType)] = &[
        ("w.f32", &[8, 3], GgmlType::F32),
        ("w.f16", &[5], GgmlType::F16),
        ("w.q8_0", &[64, 2], GgmlType::Q8_0),
        ("w.q4_k", &[256, 1, 2], GgmlType::Q4_K),
        ("w.iq2_xxs", &[256], GgmlType::IQ2_XXS),
        ("w.bf16", &[3, 1, 1, 2], GgmlType::BF16),
    ];
    for (i, (name, dims, ty)) in tensors.iter().enumerate() {
        w.add_tensor(*name, dims.to_vec(), *ty, tensor_bytes(*ty, dims, i as u8))
            .unwrap();
    }
    w
}

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("nextn-gguf-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
