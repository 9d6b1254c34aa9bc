//! Importance matrices for `nextn quantize --imatrix`, in both formats llama.cpp's llama-imatrix
//! writes, read as llama-quantize reads them (`common/imatrix-loader.cpp`, `load_imatrix` in
//! `tools/quantize/quantize.cpp`):
//!
//! - GGUF: per weight `<name>.in_sum2` (F32, ne0 × experts: sums of squared activations) and
//!   `<name>.counts` (F32, one count per expert), with `imatrix.datasets`, `imatrix.chunk_count`
//!   and `imatrix.chunk_size`. Each expert's importance is its sums over its count (1 where the
//!   count is 0).
//! - legacy `.dat`: `i32 n_entries`, then per entry `i32 len, name, i32 ncall, i32 nval,
//!   f32 values[nval]` (values already averaged, times ncall), then optionally
//!   `i32 chunk_count, i32 len, dataset`. Importance is values over ncall.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use nextn_gguf::{GgmlType, GgufError, GgufFile};

#[derive(Debug, thiserror::Error)]
pub enum ImatrixError {
    #[error("cannot read importance matrix {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("importance matrix {path}: {why}")]
    Invalid { path: PathBuf, why: String },
    #[error("importance matrix {path}: {source}")]
    Gguf {
        path: PathBuf,
        #[source]
        source: GgufError,
    },
}

/// Importance weights by tensor name: `ne0 × n_experts` values.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Importance {
    pub entries: HashMap<String, Vec<f32>>,
    pub datasets: Vec<String>,
    pub chunk_count: u64,
}

impl Importance {
    /// A GGUF importance matrix, or else a legacy one.
    pub fn load(path: &Path) -> Result<Importance, ImatrixError> {
        let bytes = std::fs::read(path).map_err(|source| ImatrixError::Io {
            path: path.to_owned(),
            source,
        })?;
        let loaded = if bytes.starts_with(b"GGUF") {
            let f = GgufFile::from_bytes(bytes).map_err(|source| ImatrixError::Gguf {
                path: path.to_owned(),
                source,
            })?;
            from_gguf(&f)
        } else {
            from_legacy(&bytes)
        };
        let m = loaded.map_err(|why| ImatrixError::Invalid {
            path: path.to_owned(),
            why,
        })?;
        // As llama-quantize: a non-finite weight would poison every block it touches.
        for (name, values) in &m.entries {
            if let Some(v) = values.iter().find(|v| !v.is_finite()) {
                return Err(ImatrixError::Invalid {
                    path: path.to_owned(),
                    why: format!("entry '{name}' holds the non-finite value {v}"),
                });
            }
        }
        Ok(m)
    }
}

fn from_gguf(f: &GgufFile) -> Result<Importance, String> {
    for key in [
        "imatrix.datasets",
        "imatrix.chunk_count",
        "imatrix.chunk_size",
    ] {
        if f.get(key).is_none() {
            return Err(format!(
                "missing metadata key '{key}' (not an importance matrix file)"
            ));
        }
    }
    let datasets = f
        .get("imatrix.datasets")
        .and_then(|v| v.as_array())
        .and_then(|a| a.as_strings())
        .map(|s| s.to_vec())
        .unwrap_or_default();
    let chunk_count = f
        .get("imatrix.chunk_count")
        .and_then(|v| v.as_u64())
        .unwrap_or(0);
    let f32_values = |name: &str| -> Result<Vec<f32>, String> {
        let t = f
            .tensor(name)
            .ok_or_else(|| format!("tensor '{name}' is missing"))?;
        if t.ty != GgmlType::F32 {
            return Err(format!("tensor '{name}' is {}, expected F32", t.ty));
        }
        Ok(f.tensor_data(t)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    };
    let mut entries = HashMap::new();
    for t in f.tensors() {
        let Some(name) = t.name.strip_suffix(".in_sum2") else {
            if t.name
                .strip_suffix(".counts")
                .is_some_and(|n| f.tensor(&format!("{n}.in_sum2")).is_none())
            {
                return Err(format!("'{}' has no matching .in_sum2 tensor", t.name));
            }
            continue;
        };
        let sums = f32_values(&t.name)?;
        let counts = f32_values(&format!("{name}.counts"))?;
        if counts.is_empty() || sums.len() % counts.len() != 0 {
            return Err(format!(
                "'{name}': {} sums do not split over {} counts",
                sums.len(),
                counts.len()
            ));
        }
        let ne0 = sums.len() / counts.len();
        let mut values = vec![1.0f32; sums.len()];
        for (j, &count) in counts.iter().enumerate() {
            // llama.cpp rounds the stored count to an integer first.
            let count = count.round();
            if count > 0.0 {
                for i in 0..ne0 {
                    values[j * ne0 + i] = sums[j * ne0 + i] / count;
                }
            }
        }
        entries.insert(name.to_string(), values);
    }
    if entries.is_empty() {
        return Err("no .in_sum2 / .counts tensors".into());
    }
    Ok(Importance {
        entries,
        datasets,
        chunk_count,
    })
}

/// A little-endian reader over a byte slice that says what it was reading when it ran out.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| format!("the file ends inside {what} (byte {})", self.at))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn i32(&mut self, what: &str) -> Result<i32, String> {
        let b = self.take(4, what)?;
        Ok(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn count(&mut self, what: &str) -> Result<usize, String> {
        let n = self.i32(what)?;
        usize::try_from(n).map_err(|_| format!("{what} is negative ({n})"))
    }
}

fn from_legacy(bytes: &[u8]) -> Result<Importance, String> {
    let mut c = Cursor { bytes, at: 0 };
    let n_entries = c.count("the entry count")?;
    if n_entries == 0 {
        return Err("no entries (neither a GGUF nor a legacy importance matrix)".into());
    }
    let mut entries = HashMap::new();
    for i in 0..n_entries {
        let len = c.count(&format!("the name length of entry {}", i + 1))?;
        let name = String::from_utf8(c.take(len, "an entry name")?.to_vec())
            .map_err(|_| format!("the name of entry {} is not UTF-8", i + 1))?;
        let ncall = c.i32(&format!("the call count of '{name}'"))?;
        let nval = c.count(&format!("the value count of '{name}'"))?;
        if nval == 0 {
            return Err(format!("entry '{name}' has no values"));
        }
        let raw = c.take(
            nval.checked_mul(4).ok_or("value count overflows")?,
            &format!("the values of '{name}'"),
        )?;
        let values = raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .map(|v| if ncall > 0 { v / ncall as f32 } else { v })
            .collect();
        entries.insert(name, values);
    }
    // Optional trailer: the chunk count and the dataset's name.
    let mut chunk_count = 0;
    let mut datasets = Vec::new();
    if let Ok(n) = c.i32("the chunk count") {
        chunk_count = n.max(0) as u64;
        if let Ok(len) = c.count("the dataset name length") {
            if let Ok(name) = c.take(len, "the dataset name") {
                datasets.push(String::from_utf8_lossy(name).into_owned());
            }
        }
    }
    Ok(Importance {
        entries,
        datasets,
        chunk_count,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn legacy(entries: &[(&str, i32, &[f32])], trailer: Option<(i32, &str)>) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&(entries.len() as i32).to_le_bytes());
        for (name, ncall, values) in entries {
            b.extend_from_slice(&(name.len() as i32).to_le_bytes());
            b.extend_from_slice(name.as_bytes());
            b.extend_from_slice(&ncall.to_le_bytes());
            b.extend_from_slice(&(values.len() as i32).to_le_bytes());
            for v in *values {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        if let Some((chunks, dataset)) = trailer {
            b.extend_from_slice(&chunks.to_le_bytes());
            b.extend_from_slice(&(dataset.len() as i32).to_le_bytes());
            b.extend_from_slice(dataset.as_bytes());
        }
        b
    }

    #[test]
    fn legacy_values_are_averaged_over_calls() {
        let m = from_legacy(&legacy(
            &[("blk.0.ffn_up.weight", 4, &[8.0, 4.0])],
            Some((10, "wiki")),
        ))
        .unwrap();
        assert_eq!(m.entries["blk.0.ffn_up.weight"], vec![2.0, 1.0]);
        assert_eq!(
            (m.chunk_count, m.datasets.clone()),
            (10, vec!["wiki".to_string()])
        );
        // Every truncation is an error naming what was being read, never a panic.
        let full = legacy(&[("a", 1, &[1.0, 2.0])], None);
        for cut in 1..full.len() {
            let e = from_legacy(&full[..cut]).unwrap_err();
            assert!(e.contains("ends inside"), "{e}");
        }
        assert!(from_legacy(&0i32.to_le_bytes())
            .unwrap_err()
            .contains("no entries"));
    }

    #[test]
    fn gguf_sums_are_divided_by_each_experts_count() {
        let mut w = nextn_gguf::GgufWriter::new();
        w.add_kv(
            "imatrix.datasets",
            nextn_gguf::MetadataValue::Array(vec!["d".to_string()].into()),
        );
        w.add_kv("imatrix.chunk_count", 3u32);
        w.add_kv("imatrix.chunk_size", 512u32);
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        w.add_tensor(
            "e.in_sum2",
            vec![2, 2],
            GgmlType::F32,
            f32s(&[4.0, 8.0, 5.0, 5.0]),
        )
        .unwrap();
        w.add_tensor("e.counts", vec![1, 2], GgmlType::F32, f32s(&[2.0, 0.0]))
            .unwrap();
        let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
        let m = from_gguf(&f).unwrap();
        assert_eq!(m.entries["e"], vec![2.0, 4.0, 1.0, 1.0]);
        assert_eq!(m.chunk_count, 3);
    }
}
