//! `QMatrix`: a weight matrix in a ggml block type, multiplied by a few activation rows.

use std::ops::Range;

use super::act::{ActKind, ActRows};
use super::decoded_row::DecodedRow;
use super::pool::ThreadPool;
use super::reference;
use super::simd::{simd_level, SimdLevel};
use crate::{GgmlType, QuantError};

/// Weight types the kernels multiply by.
pub const SUPPORTED_WEIGHT_TYPES: [GgmlType; 17] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
];

/// Whether `QMatrix` accepts weights of type `ty`.
pub fn is_supported_weight_type(ty: GgmlType) -> bool {
    SUPPORTED_WEIGHT_TYPES.contains(&ty)
}

/// Activation rows are converted and multiplied in groups of at most this many; each
/// group streams the weights once.
pub const MAX_ROWS_PER_PASS: usize = 8;

/// Output rows handed to one task are a multiple of this.
const ROWS_PER_TASK_QUANTUM: usize = 16;

/// Below this many weight bytes per pass a product runs on the calling thread alone: waking
/// the pool would cost more than it saves.
const SINGLE_THREAD_BYTES: usize = 64 * 1024;

/// A `rows × cols` matrix in ggml type `ty`; row `r` is `data[r*row_bytes..(r+1)*row_bytes]`
/// (ggml's layout, where a tensor of shape `[cols, rows]` has `cols` contiguous elements).
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    /// How the bytes inside each block are arranged.
    pub layout: Layout,
}

/// The arrangement of the bytes inside a matrix's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// ggml's own block layout (what a GGUF file holds).
    Ggml,
    /// Blocks rearranged by [`repack`] for the fused x86 kernels: the same bytes per block and
    /// the same results, minus the per-block shuffles those kernels would otherwise do.
    Repacked,
}

/// `data` (whole blocks of `ty`) rearranged into [`Layout::Repacked`], when the kernels this
/// process uses have a repacked form for `ty` (Q4_K and Q6_K at the AVX2 and AVX-512 levels on
/// x86-64) and the environment variable `NEXTN_REPACK` is not `0`; `None` otherwise. The
/// product of the repacked matrix equals that of `data` bit for bit.
pub fn repack(ty: GgmlType, data: &[u8]) -> Option<Vec<u8>> {
    if std::env::var("NEXTN_REPACK").is_ok_and(|v| v.trim() == "0")
        || !has_repacked_kernel(simd_level(), ty)
        || !data.len().is_multiple_of(ty.type_size())
    {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    let out = super::x86::repack(ty, data);
    #[cfg(not(target_arch = "x86_64"))]
    let out: Option<Vec<u8>> = None;
    if out.is_some() {
        REPACKED_BYTES.fetch_add(data.len() as u64, std::sync::atomic::Ordering::Relaxed);
    }
    out
}

static REPACKED_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Bytes of weights [`repack`] has copied into the repacked layout in this process (memory
/// the process holds in addition to, and instead of touching, the mapped file).
pub fn repacked_bytes() -> u64 {
    REPACKED_BYTES.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether `level` has kernels for `ty` in [`Layout::Repacked`].
fn has_repacked_kernel(level: SimdLevel, ty: GgmlType) -> bool {
    cfg!(target_arch = "x86_64")
        && matches!(level, SimdLevel::Avx2 | SimdLevel::Avx512)
        && level.is_supported()
        && matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K)
}

/// Writes results into the caller's `out`: `out[i*rows + r]` for activation row `i` of
/// the current pass. Tasks own disjoint `(i, r)` pairs: ranges of `r`, or whole passes.
pub(crate) struct OutSink {
    ptr: *mut f32,
    rows: usize,
    n_act: usize,
}

// SAFETY: tasks write disjoint elements (distinct weight rows) of a buffer that outlives the
// pool job.
unsafe impl Sync for OutSink {}
// SAFETY: as for `Sync`: the pointer is only written through, at disjoint elements, while the
// buffer it points into is alive.
unsafe impl Send for OutSink {}

impl OutSink {
    /// A sink over `out`, which holds `n_act` rows of `rows` results.
    #[cfg(test)]
    pub(crate) fn new(out: &mut [f32], rows: usize, n_act: usize) -> OutSink {
        assert!(out.len() >= rows * n_act);
        OutSink {
            ptr: out.as_mut_ptr(),
            rows,
            n_act,
        }
    }

    /// The sink of activation rows `first..first + n` of this one, numbered from 0.
    /// # Safety
    /// `first + n <= n_act`.
    unsafe fn rows_from(&self, first: usize, n: usize) -> OutSink {
        debug_assert!(first + n <= self.n_act);
        OutSink {
            // SAFETY: the caller guarantees `first + n <= n_act`, so the offset lies inside
            // the output slice `ptr` was taken from.
            ptr: unsafe { self.ptr.add(first * self.rows) },
            rows: self.rows,
            n_act: n,
        }
    }

    /// Where `(i, r)`'s result goes: eight results of rows `r..r + 8` may be stored from it.
    /// # Safety
    /// `i < n_act`, `r + 8 <= rows`, and no other thread writes `(i, r..r + 8)`.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    pub(crate) unsafe fn eight_at(&self, i: usize, r: usize) -> *mut f32 {
        debug_assert!(i < self.n_act && r + 8 <= self.rows);
        // SAFETY: the caller guarantees `i < n_act` and `r + 8 <= rows`, so the offset lies
        // inside the output slice `ptr` was taken from.
        unsafe { self.ptr.add(i * self.rows + r) }
    }

    /// # Safety
    /// `i < n_act`, `r < rows`, and no other thread writes the same `(i, r)`.
    #[inline]
    pub(crate) unsafe fn write(&self, i: usize, r: usize, v: f32) {
        // SAFETY: the caller guarantees `i < n_act` and `r < rows`, so the offset lies inside
        // the output slice `ptr` was taken from, and that no other thread writes this `(i, r)`.
        unsafe {
            debug_assert!(i < self.n_act && r < self.rows);
            *self.ptr.add(i * self.rows + r) = v;
        }
    }
}

/// Multiply weight rows `rows` by every activation row of `act`, writing into `out`.
/// # Safety
/// The matrix is validated, the instruction set of the kernel is available, `act` matches
/// the matrix's vec_dot type and `cols`, and `decoded` was made for this matrix's type and cols.
pub(crate) type RowsFn = unsafe fn(&QMatrix, Range<usize>, &ActRows, &mut DecodedRow, &OutSink);

/// The portable kernel: the scalar reference for every (weight row, activation row) pair.
fn rows_scalar(
    m: &QMatrix,
    rows: Range<usize>,
    act: &ActRows,
    _decoded: &mut DecodedRow,
    out: &OutSink,
) {
    for r in rows {
        let w = m.row(r);
        for i in 0..act.n_rows {
            let v = reference::dot_row(m.ty, w, &act.row(i));
            // SAFETY: i < act.n_rows == out.n_act, r < m.rows; this task owns row r.
            unsafe { out.write(i, r, v) };
        }
    }
}

fn rows_fn_for(level: SimdLevel, ty: GgmlType, layout: Layout) -> RowsFn {
    match level {
        SimdLevel::Scalar => rows_scalar,
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 | SimdLevel::Avx512 => super::x86::rows_fn(level, ty, layout),
        #[cfg(target_arch = "aarch64")]
        SimdLevel::Neon => super::neon::rows_fn(ty),
        #[allow(unreachable_patterns)]
        _ => rows_scalar,
    }
}

impl<'a> QMatrix<'a> {
    /// Check that `ty` is supported, `cols` is a whole number of blocks and `data` holds
    /// exactly `rows` rows.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, QuantError> {
        let m = QMatrix {
            ty,
            rows,
            cols,
            data,
            layout: Layout::Ggml,
        };
        m.validate()?;
        Ok(m)
    }

    /// As [`new`](Self::new), for `data` produced by [`repack`].
    pub fn new_repacked(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, QuantError> {
        let m = QMatrix {
            layout: Layout::Repacked,
            ..QMatrix::new(ty, rows, cols, data)?
        };
        m.check_layout(simd_level())?;
        Ok(m)
    }

    /// A repacked matrix can only be multiplied by the kernels it was repacked for.
    fn check_layout(&self, level: SimdLevel) -> Result<(), QuantError> {
        if self.layout == Layout::Repacked && !has_repacked_kernel(level, self.ty) {
            return Err(QuantError::NoSuchOp {
                ty: self.ty,
                op: "a repacked matrix product at this SIMD level",
            });
        }
        Ok(())
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.ty.block_size() * self.ty.type_size()
    }

    /// The raw bytes of row `r` (panics if `r >= rows` or the matrix was built inconsistently
    /// without `new`).
    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    fn validate(&self) -> Result<(), QuantError> {
        let ty = self.ty;
        if !is_supported_weight_type(ty) {
            return Err(QuantError::NoSuchOp {
                ty,
                op: "matrix multiplication",
            });
        }
        let block = ty.block_size();
        if !self.cols.is_multiple_of(block) {
            return Err(QuantError::PartialBlock {
                ty,
                n: self.cols,
                block,
            });
        }
        let total = self
            .rows
            .checked_mul(self.row_bytes())
            .ok_or(QuantError::ShapeTooLarge {
                what: "weight matrix bytes",
                rows: self.rows,
                cols: self.cols,
            })?;
        if self.data.len() != total {
            return Err(QuantError::SizeMismatch {
                what: "weight matrix bytes",
                expected: total,
                got: self.data.len(),
            });
        }
        Ok(())
    }

    fn check_io(&self, x: &[f32], n_rows: usize, out: &[f32]) -> Result<(), QuantError> {
        self.validate()?;
        let too_large = |what| QuantError::ShapeTooLarge {
            what,
            rows: n_rows,
            cols: self.cols,
        };
        let want_x = n_rows
            .checked_mul(self.cols)
            .ok_or(too_large("activation elements"))?;
        if x.len() != want_x {
            return Err(QuantError::SizeMismatch {
                what: "activation elements (n_rows x cols)",
                expected: want_x,
                got: x.len(),
            });
        }
        let want_out = n_rows
            .checked_mul(self.rows)
            .ok_or(too_large("output elements"))?;
        if out.len() != want_out {
            return Err(QuantError::SizeMismatch {
                what: "output elements (n_rows x rows)",
                expected: want_out,
                got: out.len(),
            });
        }
        Ok(())
    }

    /// `out[i*rows + r] = dot(W[r], x[i*cols..(i+1)*cols])` for every activation row
    /// `i < n_rows`, with ggml's semantics (activations converted to the weight type's
    /// vec_dot type first). Rows are processed in passes of at most 8, each reading the
    /// weights once; output rows are split among the pool's threads.
    ///
    /// A row's result depends only on that row and the weights: not on `n_rows`, on the
    /// other rows, on the thread count or on how rows were split. It does depend on the
    /// SIMD level (see [`simd_level`]).
    pub fn mul_rows(
        &self,
        x: &[f32],
        n_rows: usize,
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), QuantError> {
        self.mul_rows_with(simd_level(), x, n_rows, out, pool)
    }

    /// `mul_rows` with an explicit instruction set (for tests and benchmarks); fails with
    /// `SimdUnavailable` if this CPU lacks it.
    pub fn mul_rows_with(
        &self,
        level: SimdLevel,
        x: &[f32],
        n_rows: usize,
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), QuantError> {
        self.check_io(x, n_rows, out)?;
        if !level.is_supported() {
            return Err(QuantError::SimdUnavailable {
                level: level.name(),
            });
        }
        self.check_layout(level)?;
        let kind = act_kind(self.ty);
        let rows_fn = rows_fn_for(level, self.ty, self.layout);
        let n_passes = n_rows.div_ceil(MAX_ROWS_PER_PASS);
        if n_passes > 1 && pool.n_threads() > 1 && self.runs_alone() {
            // A matrix too small to split by output rows (a 128-wide model's projections
            // are 17 KB) over many activation rows, as in a prefill: the passes are split
            // among the threads instead, each pass whole on one thread. A row's result is
            // the same whichever thread runs its pass.
            let whole = OutSink {
                ptr: out.as_mut_ptr(),
                rows: self.rows,
                n_act: n_rows,
            };
            pool.run(n_passes, |p, _| {
                let first = p * MAX_ROWS_PER_PASS;
                let n = MAX_ROWS_PER_PASS.min(n_rows - first);
                let rows_x = &x[first * self.cols..(first + n) * self.cols];
                let act = ActRows::quantize(kind, rows_x, n, self.cols, level != SimdLevel::Scalar);
                // SAFETY: rows `first..first + n` lie inside `out` (checked by `check_io`).
                let sink = unsafe { whole.rows_from(first, n) };
                // SAFETY: validated matrix, supported level, `act` built for this type and
                // cols; this task alone writes its pass's activation rows.
                DecodedRow::with_cached(self.ty, self.cols, |decoded| unsafe {
                    rows_fn(self, 0..self.rows, &act, decoded, &sink)
                });
            });
            return Ok(());
        }
        for first in (0..n_rows).step_by(MAX_ROWS_PER_PASS) {
            let n = MAX_ROWS_PER_PASS.min(n_rows - first);
            let rows_x = &x[first * self.cols..(first + n) * self.cols];
            let act = ActRows::quantize(kind, rows_x, n, self.cols, level != SimdLevel::Scalar);
            let sink = OutSink {
                ptr: out[first * self.rows..].as_mut_ptr(),
                rows: self.rows,
                n_act: n,
            };
            self.run_pass(rows_fn, &act, &sink, pool);
        }
        Ok(())
    }

    /// Whether one pass over this matrix runs on the calling thread alone: it has too few
    /// rows or bytes for splitting its rows among threads to pay.
    fn runs_alone(&self) -> bool {
        self.rows <= ROWS_PER_TASK_QUANTUM || self.data.len() < SINGLE_THREAD_BYTES
    }

    fn run_pass(&self, rows_fn: RowsFn, act: &ActRows, sink: &OutSink, pool: &ThreadPool) {
        if pool.n_threads() == 1 || self.runs_alone() {
            // SAFETY: validated matrix, supported level, `act` built for this type and
            // cols, and this call owns all rows.
            DecodedRow::with_cached(self.ty, self.cols, |decoded| unsafe {
                rows_fn(self, 0..self.rows, act, decoded, sink)
            });
            return;
        }
        // A few tasks per thread balance uneven progress; each is a multiple of 16 rows.
        let per_task = self
            .rows
            .div_ceil(pool.n_threads() * 4)
            .next_multiple_of(ROWS_PER_TASK_QUANTUM);
        let n_tasks = self.rows.div_ceil(per_task);
        pool.run(n_tasks, |t, _| {
            let rows = t * per_task..((t + 1) * per_task).min(self.rows);
            // SAFETY: as above; tasks get disjoint row ranges.
            DecodedRow::with_cached(self.ty, self.cols, |decoded| unsafe {
                rows_fn(self, rows, act, decoded, sink)
            });
        });
    }

    /// The scalar reference: same semantics as `mul_rows`, one thread, no SIMD, and the
    /// same result as `mul_rows_with(SimdLevel::Scalar, ..)` bit for bit.
    pub fn mul_rows_reference(
        &self,
        x: &[f32],
        n_rows: usize,
        out: &mut [f32],
    ) -> Result<(), QuantError> {
        self.check_io(x, n_rows, out)?;
        self.check_layout(SimdLevel::Scalar)?;
        if n_rows == 0 {
            return Ok(());
        }
        let act = ActRows::quantize(act_kind(self.ty), x, n_rows, self.cols, false);
        for i in 0..n_rows {
            let a = act.row(i);
            for (r, o) in out[i * self.rows..(i + 1) * self.rows]
                .iter_mut()
                .enumerate()
            {
                *o = reference::dot_row(self.ty, self.row(r), &a);
            }
        }
        Ok(())
    }
}

fn act_kind(ty: GgmlType) -> ActKind {
    // validate() admitted only supported types, all of which have a vec_dot type.
    ActKind::for_weight(ty).unwrap_or(ActKind::F32)
}
