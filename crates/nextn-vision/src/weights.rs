//! The tower's tensors, bound by name and checked against the configuration at load.

use std::sync::Arc;

use nextn_gguf::{GgmlType, GgufFile, TensorInfo};
use nextn_quant::formats::{dequantize, f32_to_f16};
use nextn_quant::kernels::{is_supported_weight_type, QMatrix, ThreadPool};

use crate::error::VisionError;
use crate::gemm;

/// A weight matrix of `rows` outputs over `cols` inputs, still in the file's type, with an
/// optional F32 bias.
pub(crate) struct Linear {
    name: String,
    ty: GgmlType,
    data: MatrixBytes,
    rows: usize,
    cols: usize,
    bias: Option<Vec<f32>>,
}

impl Linear {
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    pub(crate) fn cols(&self) -> usize {
        self.cols
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn ty(&self) -> GgmlType {
        self.ty
    }

    pub(crate) fn bias(&self) -> Option<&[f32]> {
        self.bias.as_deref()
    }

    /// The matrix's bytes as ggml stores them.
    pub(crate) fn bytes(&self) -> &[u8] {
        match &self.data {
            MatrixBytes::File(file, info) => file.tensor_data(info),
            MatrixBytes::Owned(v) => v,
        }
    }

    /// `out[i*rows + r] = W[r] . x[i*cols..] + b[r]` for `n` rows of `x`.
    pub(crate) fn forward(
        &self,
        x: &[f32],
        n: usize,
        pool: &ThreadPool,
    ) -> Result<Vec<f32>, VisionError> {
        let mut out = vec![0f32; n * self.rows];
        self.forward_into(x, n, &mut out, pool)?;
        Ok(out)
    }

    pub(crate) fn forward_into(
        &self,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), VisionError> {
        let bytes = self.bytes();
        if n >= gemm::MIN_GEMM_ROWS && gemm::handles(self.ty) {
            let panels = gemm::Panels::from_rows(self.ty, bytes, self.rows, self.cols, pool)
                .map_err(|source| self.kernel_error(source))?;
            match gemm::round_for(self.ty, &x[..n * self.cols], self.cols, pool) {
                Some(rounded) => gemm::gemm(&rounded, n, &panels, out, pool),
                None => gemm::gemm(x, n, &panels, out, pool),
            }
        } else {
            let m = QMatrix::new(self.ty, self.rows, self.cols, bytes)
                .map_err(|source| self.kernel_error(source))?;
            m.mul_rows(x, n, out, pool)
                .map_err(|source| self.kernel_error(source))?;
        }
        if let Some(b) = &self.bias {
            for row in out.chunks_exact_mut(self.rows) {
                for (o, bv) in row.iter_mut().zip(b) {
                    *o += *bv;
                }
            }
        }
        Ok(())
    }

    fn kernel_error(&self, source: nextn_quant::QuantError) -> VisionError {
        VisionError::Kernel {
            tensor: self.name.clone(),
            source,
        }
    }
}

/// Where a matrix's bytes are: in the mapped file, or converted at load.
enum MatrixBytes {
    File(Arc<GgufFile>, TensorInfo),
    Owned(Vec<u8>),
}

/// Binds tensors of one mmproj file by name.
pub(crate) struct Binder {
    pub(crate) file: Arc<GgufFile>,
}

impl Binder {
    pub(crate) fn has(&self, name: &str) -> bool {
        self.file.tensor(name).is_some()
    }

    fn info(&self, name: &str) -> Result<TensorInfo, VisionError> {
        self.file
            .tensor(name)
            .cloned()
            .ok_or_else(|| VisionError::MissingTensor {
                tensor: name.to_string(),
            })
    }

    fn check_shape(info: &TensorInfo, expected: &[u64]) -> Result<(), VisionError> {
        if info.dims != expected {
            return Err(VisionError::TensorShape {
                tensor: info.name.clone(),
                found: info.dims.clone(),
                expected: expected.to_vec(),
            });
        }
        Ok(())
    }

    /// A tensor of `expected` shape read whole as f32.
    pub(crate) fn f32s(&self, name: &str, expected: &[u64]) -> Result<Vec<f32>, VisionError> {
        let info = self.info(name)?;
        Self::check_shape(&info, expected)?;
        let mut out = vec![0f32; info.n_elements as usize];
        dequantize(info.ty, self.file.tensor_data(&info), &mut out).map_err(|source| {
            VisionError::Kernel {
                tensor: name.to_string(),
                source,
            }
        })?;
        Ok(out)
    }

    /// A one-dimensional F32 tensor of `n` elements (norms, biases), as the converter writes them.
    pub(crate) fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, VisionError> {
        let info = self.info(name)?;
        if info.ty != GgmlType::F32 {
            return Err(VisionError::TensorType {
                tensor: info.name.clone(),
                ty: info.ty,
            });
        }
        self.f32s(name, &[n as u64])
    }

    /// `name.weight` of shape `dims` (ggml order, the first `inner` dimensions flattened into one
    /// row of `cols` inputs) and `name.bias` of `rows` when `bias`.
    pub(crate) fn linear_named(
        &self,
        weight: &str,
        dims: &[u64],
        bias: Option<&str>,
    ) -> Result<Linear, VisionError> {
        let info = self.info(weight)?;
        Self::check_shape(&info, dims)?;
        if !is_supported_weight_type(info.ty) {
            return Err(VisionError::TensorType {
                tensor: info.name.clone(),
                ty: info.ty,
            });
        }
        let rows = *dims.last().unwrap_or(&1) as usize;
        let cols = (info.n_elements as usize) / rows.max(1);
        let bias = bias.map(|b| self.vector(b, rows)).transpose()?;
        // Checks the block geometry once here, so a forward pass cannot fail on it later.
        QMatrix::new(info.ty, rows, cols, self.file.tensor_data(&info)).map_err(|source| {
            VisionError::Kernel {
                tensor: info.name.clone(),
                source,
            }
        })?;
        Ok(Linear {
            name: info.name.clone(),
            ty: info.ty,
            data: MatrixBytes::File(Arc::clone(&self.file), info),
            rows,
            cols,
            bias,
        })
    }

    /// The patch-embedding kernel `name` as ggml_conv_2d multiplies it: im2col rounds the
    /// patches to F16 (to F32 for a BF16 kernel) and the kernel is taken in that type too, so
    /// an F32 or F16 kernel becomes an F16 matrix and a BF16 one an F32 matrix.
    pub(crate) fn conv_kernel(&self, name: &str, dims: &[u64]) -> Result<Linear, VisionError> {
        let info = self.info(name)?;
        let target = match info.ty {
            GgmlType::F32 | GgmlType::F16 => GgmlType::F16,
            GgmlType::BF16 => GgmlType::F32,
            ty => {
                return Err(VisionError::TensorType {
                    tensor: info.name.clone(),
                    ty,
                })
            }
        };
        let values = self.f32s(name, dims)?;
        let bytes: Vec<u8> = if target == GgmlType::F16 {
            values
                .iter()
                .flat_map(|&v| f32_to_f16(v).to_le_bytes())
                .collect()
        } else {
            values.iter().flat_map(|v| v.to_le_bytes()).collect()
        };
        let rows = *dims.last().unwrap_or(&1) as usize;
        Ok(Linear {
            name: info.name.clone(),
            ty: target,
            data: MatrixBytes::Owned(bytes),
            rows,
            cols: values.len() / rows.max(1),
            bias: None,
        })
    }

    /// `prefix.weight` of `[cols, rows]` with `prefix.bias` of `[rows]`.
    pub(crate) fn linear(
        &self,
        prefix: &str,
        cols: usize,
        rows: usize,
    ) -> Result<Linear, VisionError> {
        self.linear_named(
            &format!("{prefix}.weight"),
            &[cols as u64, rows as u64],
            Some(&format!("{prefix}.bias")),
        )
    }

    /// A layer norm `prefix.weight` / `prefix.bias` over `n` values.
    pub(crate) fn norm(&self, prefix: &str, n: usize) -> Result<Norm, VisionError> {
        Ok(Norm {
            weight: self.vector(&format!("{prefix}.weight"), n)?,
            bias: self.vector(&format!("{prefix}.bias"), n)?,
        })
    }
}

/// Layer norm weight and bias.
pub(crate) struct Norm {
    pub(crate) weight: Vec<f32>,
    pub(crate) bias: Vec<f32>,
}
