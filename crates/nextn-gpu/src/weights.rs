//! GGUF weight matrices on the device, repacked at upload for the matvec kernels.
//!
//! Each type's blocks are split into a dense array of quants the kernels read as vec4 of u32
//! (16 bytes at a time, adjacent threads reading adjacent vec4) and up to two side arrays of
//! per-block scales, so that the device holds exactly ggml's bytes, none added for alignment
//! (a few bytes of padding per buffer aside), and every load is an aligned u32 or vec4:
//!
//! | type   | quants (vec4 per block)            | side arrays (bytes per block)       |
//! |--------|------------------------------------|-------------------------------------|
//! | Q8_0   | qs (2)                             | f16 d (2)                           |
//! | Q4_0, IQ4_NL | qs (1)                       | f16 d (2)                           |
//! | Q4_1   | qs (1)                             | f16 d, f16 m (4)                    |
//! | Q5_0   | qs (1)                             | qh (4); f16 d (2)                   |
//! | Q5_1   | qs (1)                             | qh (4); f16 d, f16 m (4)            |
//! | MXFP4  | qs (1)                             | e (1)                               |
//! | Q2_K   | scales, qs (5)                     | f16 d, f16 dmin (4)                 |
//! | Q3_K   | hmask, qs (6)                      | scales (12); f16 d (2)              |
//! | Q4_K   | qs (8)                             | d, dmin, scales (16)                |
//! | Q5_K   | qh, qs (10)                        | d, dmin, scales (16)                |
//! | Q6_K   | ql, qh, scales (13)                | f16 d (2)                           |
//! | IQ4_XS | qs (8)                             | d, scales_h, scales_l (8)           |
//! | F32, F16, BF16 | the row, padded with zeros to 16 bytes | none                    |
//!
//! A matrix larger than the device's largest binding is split by whole rows (a stack of
//! experts by whole experts) into several buffers, each holding its rows' quants and side
//! arrays.

use nextn_gguf::GgmlType;

use crate::kernels::matvec::{self as kernels, ActBlocks, Family};
use crate::{Gpu, GpuError};

/// How one weight type is laid out on the device.
pub(crate) struct Format {
    pub(crate) family: &'static Family,
    /// Values per block as the kernel sees it: ggml's block, or 4 (F32) and 8 (F16, BF16)
    /// values for the float types, whose rows are padded with zeros to whole blocks.
    block: usize,
    /// Bytes of one such block in the source.
    src_bytes: usize,
    /// Byte ranges of a source block that make up its quants, in order (a multiple of 16 bytes).
    main: &'static [(usize, usize)],
    /// Byte ranges of a source block for the first and second side arrays.
    aux: (usize, usize),
    aux2: (usize, usize),
    /// Kernel work units per block.
    units: usize,
    /// The int8-activation kernels and the activation blocks they take, for types that have them.
    int8: Option<(&'static Family, ActBlocks)>,
}

impl Format {
    fn main_bytes(&self) -> usize {
        self.main.iter().map(|(a, b)| b - a).sum()
    }
    fn aux_bytes(&self) -> usize {
        self.aux.1 - self.aux.0
    }
    fn aux2_bytes(&self) -> usize {
        self.aux2.1 - self.aux2.0
    }
}

const NONE: (usize, usize) = (0, 0);

fn format(ty: GgmlType) -> Option<&'static Format> {
    use GgmlType as T;
    static Q8_0: Format = Format {
        family: &kernels::Q8_0,
        block: 32,
        src_bytes: 34,
        main: &[(2, 34)],
        aux: (0, 2),
        aux2: NONE,
        units: 2,
        int8: Some((&kernels::Q8_0_I8, ActBlocks::Q8_0)),
    };
    static Q4_0: Format = Format {
        family: &kernels::Q4_0,
        block: 32,
        src_bytes: 18,
        main: &[(2, 18)],
        aux: (0, 2),
        aux2: NONE,
        units: 1,
        int8: Some((&kernels::Q4_0_I8, ActBlocks::Q8_0)),
    };
    static Q4_1: Format = Format {
        family: &kernels::Q4_1,
        block: 32,
        src_bytes: 20,
        main: &[(4, 20)],
        aux: (0, 4),
        aux2: NONE,
        units: 1,
        int8: None,
    };
    static Q5_0: Format = Format {
        family: &kernels::Q5_0,
        block: 32,
        src_bytes: 22,
        main: &[(6, 22)],
        aux: (2, 6),
        aux2: (0, 2),
        units: 1,
        int8: None,
    };
    static Q5_1: Format = Format {
        family: &kernels::Q5_1,
        block: 32,
        src_bytes: 24,
        main: &[(8, 24)],
        aux: (4, 8),
        aux2: (0, 4),
        units: 1,
        int8: None,
    };
    static IQ4_NL: Format = Format {
        family: &kernels::IQ4_NL,
        block: 32,
        src_bytes: 18,
        main: &[(2, 18)],
        aux: (0, 2),
        aux2: NONE,
        units: 1,
        int8: None,
    };
    static MXFP4: Format = Format {
        family: &kernels::MXFP4,
        block: 32,
        src_bytes: 17,
        main: &[(1, 17)],
        aux: (0, 1),
        aux2: NONE,
        units: 1,
        int8: None,
    };
    static Q2_K: Format = Format {
        family: &kernels::Q2_K,
        block: 256,
        src_bytes: 84,
        main: &[(0, 80)],
        aux: (80, 84),
        aux2: NONE,
        units: 8,
        int8: None,
    };
    static Q3_K: Format = Format {
        family: &kernels::Q3_K,
        block: 256,
        src_bytes: 110,
        main: &[(0, 96)],
        aux: (96, 108),
        aux2: (108, 110),
        units: 8,
        int8: None,
    };
    static Q4_K: Format = Format {
        family: &kernels::Q4_K,
        block: 256,
        src_bytes: 144,
        main: &[(16, 144)],
        aux: (0, 16),
        aux2: NONE,
        units: 8,
        int8: Some((&kernels::Q4_K_I8, ActBlocks::Q8K)),
    };
    static Q5_K: Format = Format {
        family: &kernels::Q5_K,
        block: 256,
        src_bytes: 176,
        main: &[(16, 176)],
        aux: (0, 16),
        aux2: NONE,
        units: 8,
        int8: Some((&kernels::Q5_K_I8, ActBlocks::Q8K)),
    };
    static Q6_K: Format = Format {
        family: &kernels::Q6_K,
        block: 256,
        src_bytes: 210,
        main: &[(0, 208)],
        aux: (208, 210),
        aux2: NONE,
        units: 8,
        int8: Some((&kernels::Q6_K_I8, ActBlocks::Q8K)),
    };
    static IQ4_XS: Format = Format {
        family: &kernels::IQ4_XS,
        block: 256,
        src_bytes: 136,
        main: &[(8, 136)],
        aux: (0, 8),
        aux2: NONE,
        units: 8,
        int8: Some((&kernels::IQ4_XS_I8, ActBlocks::Q8K)),
    };
    static F32: Format = Format {
        family: &kernels::F32,
        block: 4,
        src_bytes: 16,
        main: &[(0, 16)],
        aux: NONE,
        aux2: NONE,
        units: 1,
        int8: None,
    };
    static F16: Format = Format {
        family: &kernels::F16,
        block: 8,
        src_bytes: 16,
        main: &[(0, 16)],
        aux: NONE,
        aux2: NONE,
        units: 1,
        int8: None,
    };
    static BF16: Format = Format {
        family: &kernels::BF16,
        block: 8,
        src_bytes: 16,
        main: &[(0, 16)],
        aux: NONE,
        aux2: NONE,
        units: 1,
        int8: None,
    };
    Some(match ty {
        T::Q8_0 => &Q8_0,
        T::Q4_0 => &Q4_0,
        T::Q4_1 => &Q4_1,
        T::Q5_0 => &Q5_0,
        T::Q5_1 => &Q5_1,
        T::IQ4_NL => &IQ4_NL,
        T::MXFP4 => &MXFP4,
        T::Q2_K => &Q2_K,
        T::Q3_K => &Q3_K,
        T::Q4_K => &Q4_K,
        T::Q5_K => &Q5_K,
        T::Q6_K => &Q6_K,
        T::IQ4_XS => &IQ4_XS,
        T::F32 => &F32,
        T::F16 => &F16,
        T::BF16 => &BF16,
        _ => return None,
    })
}

/// Whether products with weights of type `ty` can take int8-quantized activations (on adapters
/// with packed integer dot products).
pub fn has_int8_kernels(ty: GgmlType) -> bool {
    format(ty).is_some_and(|f| f.int8.is_some())
}

/// Whether the device kernels read weights of type `ty`.
pub fn is_device_type(ty: GgmlType) -> bool {
    format(ty).is_some()
}

/// One device buffer of a matrix: rows `first_row .. first_row + rows`.
pub(crate) struct Chunk {
    pub(crate) buffer: wgpu::Buffer,
    pub(crate) first_row: usize,
    pub(crate) rows: usize,
    /// u32 word offsets of the side arrays in the buffer (multiples of 4).
    pub(crate) aux_off: u32,
    pub(crate) aux2_off: u32,
}

/// The repacked rows of one or more matrices of the same shape, stored one after another.
pub(crate) struct Packed {
    pub(crate) name: String,
    pub(crate) ty: GgmlType,
    pub(crate) format: &'static Format,
    /// Rows of one matrix.
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// Kernel blocks per row.
    pub(crate) bpr: usize,
    pub(crate) chunks: Vec<Chunk>,
    bytes: u64,
    /// Products quantize the activations to int8 (the type has such kernels).
    int8: bool,
    /// A gate|up pair: `rows` gate rows then as many up rows, in one chunk, multiplied together
    /// with SwiGLU ([`crate::kernels::matvec::product`]).
    pub(crate) pair: bool,
}

impl Packed {
    /// The int8 kernels and activation blocks, when this matrix's products use them.
    pub(crate) fn int8_path(&self) -> Option<(&'static Family, ActBlocks)> {
        self.format.int8.filter(|_| self.int8)
    }

    fn set_int8(&mut self, on: bool) -> Result<(), GpuError> {
        if on && self.format.int8.is_none() {
            return Err(GpuError::BadTensor {
                tensor: self.name.clone(),
                why: format!("{} has no int8-activation kernels", self.ty),
            });
        }
        self.int8 = on;
        Ok(())
    }

    /// The kernels products with these rows run: the mat-vec modules of every batch size and
    /// the prefill tile, and with `experts` the expert-indexed one; the activations' quantization
    /// on the int8 path.
    fn kernels(&self, experts: bool) -> Vec<&'static crate::kernels::Kernel> {
        let family = match self.int8_path() {
            Some((f, _)) => f,
            None => self.format.family,
        };
        let mut v: Vec<&'static crate::kernels::Kernel> = if self.pair {
            family.pair_rows.iter().chain([&family.pair_tile]).collect()
        } else {
            family.rows.iter().chain([&family.tile]).collect()
        };
        if experts {
            v.push(&family.experts);
        }
        if self.int8_path().is_some() {
            v.push(&kernels::QUANTIZE_Q8);
        }
        v
    }

    pub(crate) fn units_per_row(&self) -> usize {
        self.bpr * self.format.units
    }
}

fn pad16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

/// Source bytes repacked and written at a time (rounded to a multiple of 4 rows, so that
/// every side array's piece starts at a multiple of 4 bytes).
const PIECE_BYTES: usize = 8 << 20;
/// Bytes written between flushes of the queue's staging memory.
const FLUSH_BYTES: usize = 256 << 20;

#[allow(clippy::too_many_arguments)]
fn pack(
    gpu: &Gpu,
    name: &str,
    ty: GgmlType,
    count: usize,
    rows: usize,
    cols: usize,
    data: &[u8],
    limit: u64,
    group_rows: usize,
) -> Result<Packed, GpuError> {
    let bad = |why: String| GpuError::BadTensor {
        tensor: name.to_string(),
        why,
    };
    let format = format(ty).ok_or_else(|| GpuError::UnsupportedType {
        tensor: name.to_string(),
        ty: ty.name().to_string(),
    })?;
    if rows == 0 || cols == 0 || count == 0 {
        return Err(bad(format!("empty shape {count} x {rows} x {cols}")));
    }
    if cols > u32::MAX as usize / 2 {
        return Err(bad(format!("{cols} columns")));
    }
    let row_bytes = ty.row_bytes(cols as u64).ok_or_else(|| {
        bad(format!(
            "{cols} columns is not a whole number of {}-value {ty} blocks",
            ty.block_size()
        ))
    })? as usize;
    let total_rows = count
        .checked_mul(rows)
        .filter(|r| *r <= u32::MAX as usize)
        .ok_or_else(|| bad(format!("{count} x {rows} rows")))?;
    let want = total_rows
        .checked_mul(row_bytes)
        .ok_or_else(|| bad(format!("{total_rows} rows of {row_bytes} bytes")))?;
    if data.len() != want {
        return Err(bad(format!(
            "{} bytes for {total_rows} rows of {cols} {ty} values ({want} expected)",
            data.len()
        )));
    }
    let bpr = cols.div_ceil(format.block);
    let (main_row, aux_row, aux2_row) = (
        bpr * format.main_bytes(),
        bpr * format.aux_bytes(),
        bpr * format.aux2_bytes(),
    );
    // Rows per buffer: whole groups of `group_rows` (a row, or one matrix of a stack) within
    // the binding limit, the three arrays each padded to 16 bytes.
    let per_row = (main_row + aux_row + aux2_row) as u64;
    let fit = limit.saturating_sub(48) / per_row;
    let chunk_rows = ((fit as usize).min(total_rows) / group_rows) * group_rows;
    if chunk_rows == 0 {
        return Err(GpuError::BufferTooLarge {
            what: format!(
                "{name} ({} of {} bytes)",
                if group_rows > 1 { "an expert" } else { "a row" },
                per_row * group_rows as u64
            ),
            bytes: per_row * group_rows as u64,
            limit,
        });
    }
    let piece_rows = (PIECE_BYTES / row_bytes.max(1)).max(4) / 4 * 4;
    let mut chunks = Vec::new();
    let mut bytes = 0u64;
    let mut unflushed = 0usize;
    let mut first = 0;
    while first < total_rows {
        let n = chunk_rows.min(total_rows - first);
        let aux_at = pad16(n * main_row);
        let aux2_at = aux_at + pad16(n * aux_row);
        let size = aux2_at + pad16(n * aux2_row);
        let buffer = gpu.buffer(name, size as u64)?;
        let mut done = 0;
        while done < n {
            let k = piece_rows.min(n - done);
            let src = &data[(first + done) * row_bytes..(first + done + k) * row_bytes];
            let mut main = vec![0u8; k * main_row];
            let mut aux = vec![0u8; k * aux_row];
            let mut aux2 = vec![0u8; k * aux2_row];
            for r in 0..k {
                repack_row(
                    format,
                    cols,
                    &src[r * row_bytes..(r + 1) * row_bytes],
                    &mut main[r * main_row..(r + 1) * main_row],
                    &mut aux[r * aux_row..(r + 1) * aux_row],
                    &mut aux2[r * aux2_row..(r + 1) * aux2_row],
                );
            }
            gpu.write(&buffer, (done * main_row) as u64, &main)?;
            gpu.write(&buffer, (aux_at + done * aux_row) as u64, &aux)?;
            gpu.write(&buffer, (aux2_at + done * aux2_row) as u64, &aux2)?;
            unflushed += main.len() + aux.len() + aux2.len();
            if unflushed >= FLUSH_BYTES {
                // Hand the staged copies to the device now, so that the staging memory of a
                // large model is not held until the first pass.
                gpu.queue.submit([]);
                gpu.wait()?;
                unflushed = 0;
            }
            done += k;
        }
        bytes += size as u64;
        chunks.push(Chunk {
            buffer,
            first_row: first,
            rows: n,
            aux_off: (aux_at / 4) as u32,
            aux2_off: (aux2_at / 4) as u32,
        });
        first += n;
    }
    Ok(Packed {
        name: name.to_string(),
        ty,
        format,
        rows,
        cols,
        bpr,
        chunks,
        bytes,
        int8: gpu.int8_dot() && format.int8.is_some(),
        pair: false,
    })
}

/// One row of `cols` values from ggml's bytes into the quants and side arrays.
fn repack_row(
    f: &Format,
    cols: usize,
    src: &[u8],
    main: &mut [u8],
    aux: &mut [u8],
    aux2: &mut [u8],
) {
    let padded;
    let src = if !src.len().is_multiple_of(f.src_bytes) {
        // A float row that ends inside the kernel's block: pad it with zeros.
        let mut v = src.to_vec();
        v.resize(cols.div_ceil(f.block) * f.src_bytes, 0);
        padded = v;
        &padded[..]
    } else {
        src
    };
    let (mb, ab, a2b) = (f.main_bytes(), f.aux_bytes(), f.aux2_bytes());
    for (b, block) in src.chunks_exact(f.src_bytes).enumerate() {
        let mut at = b * mb;
        for &(s, e) in f.main {
            main[at..at + e - s].copy_from_slice(&block[s..e]);
            at += e - s;
        }
        aux[b * ab..(b + 1) * ab].copy_from_slice(&block[f.aux.0..f.aux.1]);
        aux2[b * a2b..(b + 1) * a2b].copy_from_slice(&block[f.aux2.0..f.aux2.1]);
    }
}

/// One GGUF weight matrix of `rows x cols` on the device, repacked for the matvec kernels.
pub struct DeviceMatrix {
    packed: Packed,
    _reservation: crate::Reservation,
}

impl DeviceMatrix {
    /// Upload `data`, `rows` rows of `cols` values of type `ty` as ggml stores them
    /// (`ty.row_bytes(cols)` bytes a row), split by whole rows into buffers within the device's
    /// binding limit.
    pub fn upload(
        gpu: &Gpu,
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<DeviceMatrix, GpuError> {
        Self::upload_with_limit(gpu, name, ty, rows, cols, data, gpu.max_binding_bytes())
    }

    /// [`upload`](Self::upload) with buffers of at most `max_buffer_bytes` (and at most the
    /// device's binding limit): the split of a matrix over several buffers, at small sizes.
    #[allow(clippy::too_many_arguments)]
    pub fn upload_with_limit(
        gpu: &Gpu,
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
        max_buffer_bytes: u64,
    ) -> Result<DeviceMatrix, GpuError> {
        let limit = max_buffer_bytes.min(gpu.max_binding_bytes());
        // The repacked blocks are ggml's bytes and a few of padding per buffer.
        let reservation = gpu.reserve(&format!("weight '{name}'"), data.len() as u64)?;
        Ok(DeviceMatrix {
            packed: pack(gpu, name, ty, 1, rows, cols, data, limit, 1)?,
            _reservation: reservation,
        })
    }

    /// Matrices of one type and width stacked row after row into one (`parts`: each one's rows
    /// and bytes as ggml stores them): one product computes all of them, each output row the
    /// bits of the same row's product in its own matrix.
    pub fn upload_stacked(
        gpu: &Gpu,
        name: &str,
        ty: GgmlType,
        cols: usize,
        parts: &[(usize, &[u8])],
    ) -> Result<DeviceMatrix, GpuError> {
        let rows = parts.iter().map(|p| p.0).sum();
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.1.len()).sum());
        for (_, bytes) in parts {
            data.extend_from_slice(bytes);
        }
        Self::upload(gpu, name, ty, rows, cols, &data)
    }

    /// A gate and an up matrix of `rows x cols` each, multiplied together: a product gives
    /// `SiLU(gate · x) * (up · x)`, `rows` values a row. Both must fit one buffer
    /// ([`GpuError::BufferTooLarge`] otherwise: then multiply them apart).
    pub fn upload_pair(
        gpu: &Gpu,
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        gate: &[u8],
        up: &[u8],
    ) -> Result<DeviceMatrix, GpuError> {
        let limit = gpu.max_binding_bytes();
        let reservation =
            gpu.reserve(&format!("weight '{name}'"), (gate.len() + up.len()) as u64)?;
        let mut data = Vec::with_capacity(gate.len() + up.len());
        data.extend_from_slice(gate);
        data.extend_from_slice(up);
        let mut packed = pack(gpu, name, ty, 1, 2 * rows, cols, &data, limit, 2 * rows)?;
        packed.rows = rows;
        packed.pair = true;
        Ok(DeviceMatrix {
            packed,
            _reservation: reservation,
        })
    }

    /// The blocks its products quantize activations into (the int8 path), or `None` (f32
    /// activations).
    pub fn act_blocks(&self) -> Option<ActBlocks> {
        self.packed.int8_path().map(|(_, a)| a)
    }

    /// Whether this is a gate|up pair ([`DeviceMatrix::upload_pair`]).
    pub fn is_pair(&self) -> bool {
        self.packed.pair
    }

    pub fn name(&self) -> &str {
        &self.packed.name
    }
    pub fn ty(&self) -> GgmlType {
        self.packed.ty
    }
    /// Output values a row: the matrix's rows (one matrix's, for a pair).
    pub fn rows(&self) -> usize {
        self.packed.rows
    }
    pub fn cols(&self) -> usize {
        self.packed.cols
    }
    /// Bytes the matrix takes on the device.
    pub fn device_bytes(&self) -> u64 {
        self.packed.bytes
    }
    /// How many buffers the matrix is split into.
    pub fn buffer_count(&self) -> usize {
        self.packed.chunks.len()
    }
    /// Whether products quantize the activation rows to int8 and multiply them with packed
    /// integer dot products: chosen at upload (the adapter has them and the type has such
    /// kernels), the f32 path otherwise.
    pub fn int8(&self) -> bool {
        self.packed.int8
    }
    /// Choose the path of every later product (`false`: f32 activations). Fails for a type
    /// without int8 kernels. A matrix keeps one path for all its products, or rows computed
    /// before and after would differ.
    pub fn set_int8(&mut self, on: bool) -> Result<(), GpuError> {
        self.packed.set_int8(on)
    }
    pub(crate) fn packed(&self) -> &Packed {
        &self.packed
    }
    /// The kernels this matrix's products run, to build at load ([`Gpu::prepare`]).
    pub fn kernels(&self) -> Vec<&'static crate::kernels::Kernel> {
        self.packed.kernels(false)
    }

    /// The kernel that gathers its rows as an embedding table
    /// ([`crate::kernels::matvec::embed_rows`]).
    pub fn embed_kernel(&self) -> Option<&'static crate::kernels::Kernel> {
        self.packed.format.family.embed.as_ref()
    }
}

/// A MoE expert stack on the device: `n_expert` matrices of `rows x cols`, stored one after
/// another as GGUF's 3-D `ffn_*_exps` tensors are.
pub struct DeviceExperts {
    packed: Packed,
    n_expert: usize,
    _reservation: crate::Reservation,
}

impl DeviceExperts {
    /// Upload `data`, `n_expert * rows` rows of `cols` values of type `ty` as ggml stores them,
    /// split by whole experts into buffers within the device's binding limit.
    pub fn upload(
        gpu: &Gpu,
        name: &str,
        ty: GgmlType,
        n_expert: usize,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<DeviceExperts, GpuError> {
        Self::upload_with_limit(
            gpu,
            name,
            ty,
            n_expert,
            rows,
            cols,
            data,
            gpu.max_binding_bytes(),
        )
    }

    /// [`upload`](Self::upload) with buffers of at most `max_buffer_bytes` (and at most the
    /// device's binding limit).
    #[allow(clippy::too_many_arguments)]
    pub fn upload_with_limit(
        gpu: &Gpu,
        name: &str,
        ty: GgmlType,
        n_expert: usize,
        rows: usize,
        cols: usize,
        data: &[u8],
        max_buffer_bytes: u64,
    ) -> Result<DeviceExperts, GpuError> {
        let limit = max_buffer_bytes.min(gpu.max_binding_bytes());
        let reservation = gpu.reserve(&format!("weight '{name}'"), data.len() as u64)?;
        let packed = pack(gpu, name, ty, n_expert, rows, cols, data, limit, rows)?;
        Ok(DeviceExperts {
            packed,
            n_expert,
            _reservation: reservation,
        })
    }

    pub fn name(&self) -> &str {
        &self.packed.name
    }
    pub fn ty(&self) -> GgmlType {
        self.packed.ty
    }
    pub fn n_expert(&self) -> usize {
        self.n_expert
    }
    /// Rows of one expert's matrix.
    pub fn rows(&self) -> usize {
        self.packed.rows
    }
    pub fn cols(&self) -> usize {
        self.packed.cols
    }
    pub fn device_bytes(&self) -> u64 {
        self.packed.bytes
    }
    pub fn buffer_count(&self) -> usize {
        self.packed.chunks.len()
    }
    /// Whether products quantize the activation rows to int8 and multiply them with packed
    /// integer dot products: chosen at upload (the adapter has them and the type has such
    /// kernels), the f32 path otherwise.
    pub fn int8(&self) -> bool {
        self.packed.int8
    }
    /// Choose the path of every later product (`false`: f32 activations). Fails for a type
    /// without int8 kernels. A matrix keeps one path for all its products, or rows computed
    /// before and after would differ.
    pub fn set_int8(&mut self, on: bool) -> Result<(), GpuError> {
        self.packed.set_int8(on)
    }
    pub(crate) fn packed(&self) -> &Packed {
        &self.packed
    }
    /// The kernels this stack's products run, to build at load ([`Gpu::prepare`]).
    pub fn kernels(&self) -> Vec<&'static crate::kernels::Kernel> {
        self.packed.kernels(true)
    }
}
