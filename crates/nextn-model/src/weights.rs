//! Binding GGUF tensors to the weights a layer holds, with shape checks (docs/MODEL.md, "Tensor
//! names").
//!
//! Weights stay in the memory map: a [`Linear`] keeps the file alive through an `Arc` and borrows
//! its bytes only for the duration of a product.

use std::sync::Arc;

use nextn_gguf::{GgmlType, GgufFile, TensorInfo};
use nextn_quant::formats;
use nextn_quant::kernels::{repack, QMatrix, ThreadPool};

use crate::ModelError;

/// Says of a tensor, by name, whether it is used on the CPU.
type TensorFilter = dyn Fn(&str) -> bool + Send + Sync;

/// Looks tensors up by name and checks their shapes; the only way layers get their weights.
pub struct WeightLoader {
    file: Arc<GgufFile>,
    /// Whether matrices for products are copied into the kernels' repacked layout.
    repack: bool,
    /// With a device: the matrices that stay on the host are the tensors for which this says so;
    /// the others are left as mapped. `None`: every matrix is a host one.
    host_tensors: Option<Box<TensorFilter>>,
}

impl WeightLoader {
    pub fn new(file: Arc<GgufFile>) -> Self {
        let weights: u64 = file.tensors().iter().map(|t| t.n_bytes).sum();
        let repack = should_repack(weights, std::env::var("NEXTN_REPACK").ok().as_deref());
        WeightLoader {
            file,
            repack,
            host_tensors: None,
        }
    }

    /// A loader for a model split between the CPU and a device: the tensors for which `on_host`
    /// holds are prepared for the CPU kernels as [`WeightLoader::new`] prepares them, the rest are
    /// left as mapped, as [`WeightLoader::mapped_only`] does.
    pub fn split(
        file: Arc<GgufFile>,
        on_host: impl Fn(&str) -> bool + Send + Sync + 'static,
    ) -> Self {
        let mut w = WeightLoader::new(file);
        w.host_tensors = Some(Box::new(on_host));
        w
    }

    /// Whether tensor `name` goes to the CPU kernels' layout.
    fn repacks(&self, name: &str) -> bool {
        self.repack
            && self
                .host_tensors
                .as_ref()
                .is_none_or(|on_host| on_host(name))
    }

    /// A loader that leaves every matrix as mapped: for a model whose products run on a device,
    /// where a host copy in the CPU kernels' layout would only take memory.
    pub fn mapped_only(file: Arc<GgufFile>) -> Self {
        WeightLoader {
            file,
            repack: false,
            host_tensors: None,
        }
    }

    pub fn file(&self) -> &Arc<GgufFile> {
        &self.file
    }

    pub fn has(&self, name: &str) -> bool {
        self.file.tensor(name).is_some()
    }

    fn info(&self, name: &str) -> Result<&TensorInfo, ModelError> {
        self.file
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    fn check_shape(&self, t: &TensorInfo, expected: &[u64]) -> Result<(), ModelError> {
        // ggml pads trailing dims with 1: [n] and [n, 1] describe the same tensor.
        let trim = |d: &[u64]| {
            let mut v = d.to_vec();
            while v.len() > 1 && v.last() == Some(&1) {
                v.pop();
            }
            v
        };
        if trim(&t.dims) != trim(expected) {
            return Err(ModelError::TensorShape {
                tensor: t.name.clone(),
                expected: expected.to_vec(),
                found: t.dims.clone(),
            });
        }
        Ok(())
    }

    /// A 1-D (or any-D) tensor dequantized to f32: norms, biases, conv kernels, router weights.
    pub fn vector(&self, name: &str, expected: &[u64]) -> Result<Vec<f32>, ModelError> {
        let t = self.info(name)?;
        self.check_shape(t, expected)?;
        formats::check_supported(t.ty, &t.name)?;
        let n = t.n_elements as usize;
        let mut out = vec![0.0f32; n];
        formats::dequantize(t.ty, self.file.tensor_data(t), &mut out)?;
        Ok(out)
    }

    pub fn optional_vector(
        &self,
        name: &str,
        expected: &[u64],
    ) -> Result<Option<Vec<f32>>, ModelError> {
        if self.has(name) {
            self.vector(name, expected).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A matrix with math shape `rows × cols` (GGUF `ne = [cols, rows]`).
    pub fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear, ModelError> {
        self.matrix(name, rows, cols, true)
    }

    /// A matrix read only row by row (an embedding table): never repacked for the kernels.
    pub fn embedding(&self, name: &str, rows: usize, cols: usize) -> Result<Linear, ModelError> {
        self.matrix(name, rows, cols, false)
    }

    /// An embedding table if the file has it.
    pub fn optional_embedding(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Linear>, ModelError> {
        if self.has(name) {
            self.embedding(name, rows, cols).map(Some)
        } else {
            Ok(None)
        }
    }

    fn matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        for_products: bool,
    ) -> Result<Linear, ModelError> {
        let t = self.info(name)?;
        self.check_shape(t, &[cols as u64, rows as u64])?;
        formats::check_supported(t.ty, &t.name)?;
        // A per-tensor `.scale` multiplies the product (NVFP4-style exports).
        let scale_name = format!("{}.scale", name.trim_end_matches(".weight"));
        let scale = self.optional_vector(&scale_name, &[1])?.map(|v| v[0]);
        // The kernels' own block arrangement where they have one: decoded in fewer steps,
        // same results. The mapped pages it was copied from are handed back to the OS.
        let repacked = (for_products && self.repacks(name))
            .then(|| repack(t.ty, self.file.tensor_data(t)))
            .flatten()
            .map(Arc::new);
        if repacked.is_some() {
            self.file.release_tensor_pages(t);
        }
        Ok(Linear {
            file: self.file.clone(),
            tensor: self.index_of(name)?,
            name: t.name.clone(),
            ty: t.ty,
            rows,
            cols,
            byte_offset: 0,
            scale,
            repacked,
        })
    }

    pub fn optional_linear(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Linear>, ModelError> {
        if self.has(name) {
            self.linear(name, rows, cols).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A stack of `n` matrices `rows × cols` (GGUF `ne = [cols, rows, n]`), one per expert.
    pub fn experts(
        &self,
        name: &str,
        n: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<Linear>, ModelError> {
        let t = self.info(name)?;
        self.check_shape(t, &[cols as u64, rows as u64, n as u64])?;
        formats::check_supported(t.ty, &t.name)?;
        let scale_name = format!("{}.scale", name.trim_end_matches(".weight"));
        let scales = self.optional_vector(&scale_name, &[n as u64])?;
        let per_expert = t.n_bytes as usize / n.max(1);
        let index = self.index_of(name)?;
        // Each expert's matrix in the kernels' own block arrangement, as for the dense weights
        // (a repack only rearranges bytes within blocks, so an expert's slice repacks alone).
        let data = self.file.tensor_data(t);
        let repacked: Vec<Option<Arc<Vec<u8>>>> = (0..n)
            .map(|e| {
                self.repacks(name)
                    .then(|| repack(t.ty, &data[e * per_expert..(e + 1) * per_expert]))
                    .flatten()
                    .map(Arc::new)
            })
            .collect();
        if repacked.iter().all(Option::is_some) && n > 0 {
            self.file.release_tensor_pages(t);
        }
        Ok(repacked
            .into_iter()
            .enumerate()
            .map(|(e, repacked)| Linear {
                file: self.file.clone(),
                tensor: index,
                name: format!("{}[{e}]", t.name),
                ty: t.ty,
                rows,
                cols,
                byte_offset: e * per_expert,
                scale: scales.as_ref().map(|s| s[e]),
                repacked,
            })
            .collect())
    }

    /// Rows `[first, first+count)` of a stacked expert tensor seen as separate matrices (fused gate_up).
    pub fn split_rows(whole: &[Linear], first: usize, count: usize) -> Vec<Linear> {
        whole
            .iter()
            .map(|l| {
                let row_bytes = l.row_bytes();
                Linear {
                    file: l.file.clone(),
                    tensor: l.tensor,
                    name: format!("{}[rows {first}..{}]", l.name, first + count),
                    ty: l.ty,
                    rows: count,
                    cols: l.cols,
                    byte_offset: l.byte_offset + first * row_bytes,
                    scale: l.scale,
                    // A repacked row keeps its place (blocks are rearranged only within
                    // themselves), so the rows' part of the repacked matrix is theirs.
                    repacked: l.repacked.as_ref().map(|p| {
                        Arc::new(p[first * row_bytes..(first + count) * row_bytes].to_vec())
                    }),
                }
            })
            .collect()
    }

    fn index_of(&self, name: &str) -> Result<usize, ModelError> {
        self.file
            .tensors()
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }
}

/// Whether to repack a model with `weights` bytes of tensors: `NEXTN_REPACK=0` never, `1`
/// always; otherwise only when the weights take at most 40 % of the machine's memory. A repacked
/// copy lives in the process's own memory, so the OS can no longer keep the file cached next to
/// it: a model near the memory size would be read from disk at every start, where a mapped one
/// starts from the page cache.
fn should_repack(weights: u64, setting: Option<&str>) -> bool {
    match setting.map(str::trim) {
        Some("0") => false,
        Some("1") => true,
        _ => total_memory_bytes()
            .is_none_or(|mem| weights.saturating_mul(5) <= mem.saturating_mul(2)),
    }
}

/// Physical memory (Linux `MemTotal`), if known.
fn total_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// A weight matrix `rows × cols` in any supported ggml type, borrowed from the mapped file.
#[derive(Clone)]
pub struct Linear {
    file: Arc<GgufFile>,
    tensor: usize,
    pub name: String,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    byte_offset: usize,
    scale: Option<f32>,
    /// The whole matrix in the kernels' repacked layout, when they have one for this type.
    repacked: Option<Arc<Vec<u8>>>,
}

impl Linear {
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols as u64).unwrap_or(0) as usize
    }

    /// The per-tensor scale the product is multiplied by, when the file stores one.
    pub fn scale(&self) -> Option<f32> {
        self.scale
    }

    pub fn bytes(&self) -> &[u8] {
        let t = &self.file.tensors()[self.tensor];
        let all = self.file.tensor_data(t);
        &all[self.byte_offset..self.byte_offset + self.rows * self.row_bytes()]
    }

    /// `out[i·rows + r] = W[r] · x[i·cols ..]` for every one of `n` input rows.
    pub fn forward(
        &self,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let Some(packed) = &self.repacked else {
            return self.forward_rows(self.bytes(), self.rows, x, n, out, pool);
        };
        let m = QMatrix::new_repacked(self.ty, self.rows, self.cols, packed)?;
        self.finish(m, x, n, out, pool)
    }

    /// The product of `forward` with other rows of this matrix's type and width: `bytes` holds
    /// `rows` whole rows (for example a gathered subset of this matrix's rows); the per-tensor
    /// scale applies as in `forward`.
    pub fn forward_rows(
        &self,
        bytes: &[u8],
        rows: usize,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let m = QMatrix::new(self.ty, rows, self.cols, bytes)?;
        self.finish(m, x, n, out, pool)
    }

    /// `out = m · x` for `n` rows, times the per-tensor scale.
    fn finish(
        &self,
        m: QMatrix,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        m.mul_rows(&x[..n * self.cols], n, &mut out[..n * m.rows], pool)?;
        if let Some(s) = self.scale {
            out[..n * m.rows].iter_mut().for_each(|v| *v *= s);
        }
        Ok(())
    }

    /// Row `r` dequantized (embedding lookup).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), ModelError> {
        if r >= self.rows {
            return Err(ModelError::TokenOutOfRange {
                token: r as u64,
                n_vocab: self.rows,
            });
        }
        let rb = self.row_bytes();
        let bytes = &self.bytes()[r * rb..(r + 1) * rb];
        formats::dequantize(self.ty, bytes, &mut out[..self.cols])?;
        if let Some(s) = self.scale {
            out[..self.cols].iter_mut().for_each(|v| *v *= s);
        }
        Ok(())
    }
}

#[cfg(test)]
mod repack_policy_tests {
    use super::*;

    #[test]
    fn repack_follows_the_setting_then_the_memory_size() {
        assert!(!should_repack(1, Some("0")));
        assert!(should_repack(u64::MAX, Some("1")));
        if let Some(mem) = total_memory_bytes() {
            assert!(should_repack(mem / 3, None));
            assert!(!should_repack(mem / 2, None));
            assert!(!should_repack(mem / 2, Some("auto")));
        }
    }
}
