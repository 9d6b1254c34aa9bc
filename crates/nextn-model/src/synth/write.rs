//! Streaming GGUF output: the header is encoded up front (every tensor's size is known from the
//! plan), then each tensor is generated, quantized and written slab by slab, so a 27B model never
//! needs more memory than a few slabs.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use nextn_gguf::{GgmlType, GgufFile, GgufWriter, MetadataValue, DEFAULT_ALIGNMENT};
use nextn_quant::formats;

use super::plan::PlannedTensor;
use super::random::{name_hash, row_seed, Rng};
use super::SynthError;

/// Output buffered per slab; each slab is split over the worker threads.
const SLAB_BYTES: u64 = 32 << 20;

/// Progress after each tensor.
#[derive(Clone, Debug)]
pub struct Progress<'a> {
    pub index: usize,
    pub total: usize,
    pub tensor: &'a PlannedTensor,
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub elapsed_s: f64,
}

/// Header bytes: magic, counts and KVs (encoded by [`GgufWriter`]), then the tensor infos with
/// their aligned offsets, padded to the alignment. Returns the header and the data-section size.
fn encode_header(
    kvs: &[(String, MetadataValue)],
    tensors: &[PlannedTensor],
) -> Result<(Vec<u8>, u64), SynthError> {
    let mut w = GgufWriter::new();
    for (k, v) in kvs {
        w.add_kv(k.clone(), v.clone());
    }
    // A writer without tensors ends right after its KVs; the tensor count is patched in below.
    let mut header = w.to_bytes()?;
    header[8..16].copy_from_slice(&(tensors.len() as u64).to_le_bytes());
    let align = DEFAULT_ALIGNMENT;
    let mut offset = 0u64;
    for t in tensors {
        header.extend_from_slice(&(t.name.len() as u64).to_le_bytes());
        header.extend_from_slice(t.name.as_bytes());
        header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            header.extend_from_slice(&d.to_le_bytes());
        }
        header.extend_from_slice(&t.ty.id().to_le_bytes());
        header.extend_from_slice(&offset.to_le_bytes());
        offset += t.n_bytes().next_multiple_of(align);
    }
    header.resize((header.len() as u64).next_multiple_of(align) as usize, 0);
    Ok((header, offset))
}

/// Generates rows `rows` of `t` into `out` (exactly those rows' bytes).
fn fill_rows(
    t: &PlannedTensor,
    seed: u64,
    tensor_key: u64,
    rows: std::ops::Range<u64>,
    out: &mut [u8],
) -> Result<(), SynthError> {
    let ne0 = t.dims[0] as usize;
    let rb = t.row_bytes() as usize;
    let mut row = vec![0f32; ne0];
    for (i, r) in rows.enumerate() {
        let mut rng = Rng::new(row_seed(seed, tensor_key, r));
        t.init.fill(&mut rng, &mut row);
        formats::quantize(t.ty, &row, &mut out[i * rb..(i + 1) * rb]).map_err(|source| {
            SynthError::Quantize {
                tensor: t.name.clone(),
                source,
            }
        })?;
    }
    Ok(())
}

/// Writes one tensor's data, slab by slab, each slab's rows split over `threads` workers.
fn write_tensor<W: Write>(
    t: &PlannedTensor,
    seed: u64,
    threads: usize,
    out: &mut W,
    path: &Path,
) -> Result<(), SynthError> {
    let rb = t.row_bytes();
    let n_rows = t.n_rows();
    let key = name_hash(&t.name);
    let rows_per_slab = (SLAB_BYTES / rb.max(1)).clamp(1, n_rows.max(1));
    let mut buf = vec![0u8; (rows_per_slab * rb) as usize];
    let mut start = 0u64;
    while start < n_rows {
        let n = rows_per_slab.min(n_rows - start);
        let slab = &mut buf[..(n * rb) as usize];
        let workers = (threads as u64).min(n).max(1);
        if workers == 1 {
            fill_rows(t, seed, key, start..start + n, slab)?;
        } else {
            let per = n.div_ceil(workers);
            std::thread::scope(|s| -> Result<(), SynthError> {
                let handles: Vec<_> = slab
                    .chunks_mut((per * rb) as usize)
                    .enumerate()
                    .map(|(w, chunk)| {
                        let first = start + w as u64 * per;
                        let count = chunk.len() as u64 / rb;
                        s.spawn(move || fill_rows(t, seed, key, first..first + count, chunk))
                    })
                    .collect();
                for h in handles {
                    h.join().map_err(|_| SynthError::Worker {
                        tensor: t.name.clone(),
                    })??;
                }
                Ok(())
            })?;
        }
        out.write_all(slab).map_err(|source| SynthError::Io {
            path: path.to_owned(),
            source,
        })?;
        start += n;
    }
    let pad = t.n_bytes().next_multiple_of(DEFAULT_ALIGNMENT) - t.n_bytes();
    out.write_all(&vec![0u8; pad as usize])
        .map_err(|source| SynthError::Io {
            path: path.to_owned(),
            source,
        })?;
    Ok(())
}

/// Writes the file to `path` (through `path.part`, renamed when complete), then re-opens it and
/// checks that its tensor directory is the plan. Returns the file size.
pub fn write_gguf(
    path: &Path,
    kvs: &[(String, MetadataValue)],
    tensors: &[PlannedTensor],
    seed: u64,
    threads: usize,
    progress: &mut dyn FnMut(&Progress),
) -> Result<u64, SynthError> {
    for t in tensors {
        if t.dims.is_empty()
            || t.dims[0] % t.ty.block_size() as u64 != 0
            || !formats::can_quantize(t.ty)
        {
            return Err(SynthError::Plan {
                tensor: t.name.clone(),
                why: format!("type {} cannot hold dims {:?}", t.ty, t.dims),
            });
        }
    }
    let (header, data_len) = encode_header(kvs, tensors)?;
    let total = header.len() as u64 + data_len;
    let mut part = path.as_os_str().to_owned();
    part.push(".part");
    let part = PathBuf::from(part);
    let io = |p: &Path| {
        let p = p.to_owned();
        move |source| SynthError::Io { path: p, source }
    };
    let result = (|| {
        let file = File::create(&part).map_err(io(&part))?;
        let mut out = BufWriter::with_capacity(4 << 20, file);
        out.write_all(&header).map_err(io(&part))?;
        let t0 = Instant::now();
        let mut done = header.len() as u64;
        for (index, t) in tensors.iter().enumerate() {
            write_tensor(t, seed, threads, &mut out, &part)?;
            done += t.n_bytes().next_multiple_of(DEFAULT_ALIGNMENT);
            progress(&Progress {
                index,
                total: tensors.len(),
                tensor: t,
                bytes_done: done,
                bytes_total: total,
                elapsed_s: t0.elapsed().as_secs_f64(),
            });
        }
        out.flush().map_err(io(&part))?;
        out.into_inner()
            .map_err(|e| io(&part)(e.into_error()))?
            .sync_all()
            .map_err(io(&part))?;
        Ok::<(), SynthError>(())
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&part);
        return Err(e);
    }
    std::fs::rename(&part, path).map_err(io(path))?;
    check_written(path, tensors, total)?;
    Ok(total)
}

/// The written file parses and lists exactly the planned tensors (names, dims, types).
fn check_written(path: &Path, tensors: &[PlannedTensor], size: u64) -> Result<(), SynthError> {
    let f = GgufFile::open(path)?;
    let listed: Vec<(&str, &[u64], GgmlType)> = f
        .tensors()
        .iter()
        .map(|t| (t.name.as_str(), &t.dims[..], t.ty))
        .collect();
    let planned: Vec<(&str, &[u64], GgmlType)> = tensors
        .iter()
        .map(|t| (t.name.as_str(), &t.dims[..], t.ty))
        .collect();
    if listed != planned || f.file_size() != size {
        return Err(SynthError::Plan {
            tensor: String::new(),
            why: format!(
                "{} does not read back as written ({} bytes, expected {size})",
                path.display(),
                f.file_size()
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::random::Init;

    fn t(name: &str, dims: Vec<u64>, ty: GgmlType) -> PlannedTensor {
        PlannedTensor {
            name: name.into(),
            dims,
            ty,
            init: Init::Normal { std: 0.1 },
        }
    }

    #[test]
    fn streamed_file_equals_a_gguf_writer_file() {
        let dir = std::env::temp_dir().join(format!("nextn-synth-write-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.gguf");
        let tensors = vec![
            t("a", vec![64, 3], GgmlType::Q8_0),
            t("b", vec![5], GgmlType::F32),
            t("c", vec![256, 70], GgmlType::Q4_K),
        ];
        let kvs = vec![("general.architecture".to_string(), MetadataValue::from("x"))];
        let mut calls = 0;
        // Different thread counts must give the same bytes.
        write_gguf(&path, &kvs, &tensors, 9, 3, &mut |_| calls += 1).unwrap();
        assert_eq!(calls, 3);
        let bytes = std::fs::read(&path).unwrap();
        write_gguf(&path, &kvs, &tensors, 9, 1, &mut |_| {}).unwrap();
        assert_eq!(bytes, std::fs::read(&path).unwrap());

        let f = GgufFile::from_bytes(bytes.clone()).unwrap();
        let mut w = GgufWriter::new();
        w.add_kv("general.architecture", "x");
        for x in f.tensors() {
            w.add_tensor(
                x.name.clone(),
                x.dims.clone(),
                x.ty,
                f.tensor_data(x).to_vec(),
            )
            .unwrap();
        }
        assert_eq!(
            w.to_bytes().unwrap(),
            bytes,
            "same layout as the reference writer"
        );
        assert!(f.tensor_data_by_name("c").unwrap().iter().any(|&b| b != 0));
        write_gguf(&path, &kvs, &tensors, 10, 1, &mut |_| {}).unwrap();
        assert_ne!(bytes, std::fs::read(&path).unwrap(), "the seed matters");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn refuses_types_that_do_not_fit() {
        let path = std::env::temp_dir().join("nextn-synth-never-written.gguf");
        let err = write_gguf(
            &path,
            &[],
            &[t("x", vec![100, 2], GgmlType::Q4_K)],
            0,
            1,
            &mut |_| {},
        )
        .unwrap_err();
        assert!(err.to_string().contains("x"), "{err}");
        assert!(!path.exists());
    }
}
