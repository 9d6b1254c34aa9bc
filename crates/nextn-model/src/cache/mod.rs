//! Per-sequence caches: the attention KV cache of each full-attention layer and the recurrent
//! state (causal-conv window + delta-net state) of each gated-delta-net layer (docs/MODEL.md,
//! "Caches" and "Speculative verify rollback").

mod codec;

use half::{f16, slice::HalfFloatSliceExt};
use nextn_quant::formats::layout::{Block, BlockQ4_0, BlockQ8_0, QK32};
use nextn_quant::formats::legacy;

use crate::simd;

use crate::device::{DeviceDeltaNetCache, DeviceKvCache};
use crate::ModelError;

pub use codec::{StateCodecError, StateReader, StateWriter};

/// Element type of the attention KV cache (`-ctk` / `-ctv`). The quantized types use llama.cpp's
/// block layouts, placed as llama.cpp places them: each head's `head_dim` values of a position
/// in 32-element blocks, so a head dimension that is a multiple of 32 is required.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvType {
    F16,
    F32,
    Q8_0,
    Q4_0,
}

impl KvType {
    /// The names `-ctk`/`-ctv` take.
    pub const NAMES: &'static str = "f32, f16, q8_0, q4_0";

    pub fn parse(s: &str) -> Option<KvType> {
        match s.to_ascii_lowercase().as_str() {
            "f16" => Some(KvType::F16),
            "f32" => Some(KvType::F32),
            "q8_0" => Some(KvType::Q8_0),
            "q4_0" => Some(KvType::Q4_0),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
            KvType::Q4_0 => "q4_0",
        }
    }

    /// Values per block: 32 for the quantized types, 1 for the float ones.
    pub fn block_len(self) -> usize {
        match self {
            KvType::F16 | KvType::F32 => 1,
            KvType::Q8_0 | KvType::Q4_0 => QK32,
        }
    }

    /// Bytes that `n` values take (`n` a multiple of [`KvType::block_len`]).
    pub fn row_bytes(self, n: usize) -> usize {
        match self {
            KvType::F16 => 2 * n,
            KvType::F32 => 4 * n,
            KvType::Q8_0 => n / QK32 * BlockQ8_0::BYTES,
            KvType::Q4_0 => n / QK32 * BlockQ4_0::BYTES,
        }
    }

    /// Whether heads of `head_dim` values can be stored in this type.
    pub fn fits_head_dim(self, head_dim: usize) -> bool {
        head_dim.is_multiple_of(self.block_len())
    }
}

/// One tensor of cached vectors, `width` values per position; for the quantized types
/// `width / 32` blocks per position.
#[derive(Clone, Debug)]
pub(crate) enum KvBuf {
    F16(Vec<f16>),
    F32(Vec<f32>),
    Q8_0(Vec<BlockQ8_0>),
    Q4_0(Vec<BlockQ4_0>),
}

impl KvBuf {
    fn new(ty: KvType) -> Self {
        match ty {
            KvType::F16 => KvBuf::F16(Vec::new()),
            KvType::F32 => KvBuf::F32(Vec::new()),
            KvType::Q8_0 => KvBuf::Q8_0(Vec::new()),
            KvType::Q4_0 => KvBuf::Q4_0(Vec::new()),
        }
    }

    pub(crate) fn ty(&self) -> KvType {
        match self {
            KvBuf::F16(_) => KvType::F16,
            KvBuf::F32(_) => KvType::F32,
            KvBuf::Q8_0(_) => KvType::Q8_0,
            KvBuf::Q4_0(_) => KvType::Q4_0,
        }
    }

    /// Append one position's values (a multiple of the block length).
    fn push(&mut self, row: &[f32]) {
        match self {
            KvBuf::F16(v) => v.extend(row.iter().map(|&x| f16::from_f32(x))),
            KvBuf::F32(v) => v.extend_from_slice(row),
            KvBuf::Q8_0(v) => {
                let at = v.len();
                v.resize(at + row.len() / QK32, BlockQ8_0::default());
                // The length is a whole number of blocks (checked when the cache is made).
                let _ = legacy::quantize_row_q8_0(row, &mut v[at..]);
            }
            KvBuf::Q4_0(v) => {
                let at = v.len();
                v.resize(at + row.len() / QK32, BlockQ4_0::default());
                let _ = legacy::quantize_row_q4_0(row, &mut v[at..]);
            }
        }
    }

    /// Stored units (values, or blocks for the quantized types) that `n` values take.
    fn units(&self, n: usize) -> usize {
        n / self.ty().block_len()
    }

    /// Keep the first `len` values.
    fn truncate(&mut self, len: usize) {
        let len = self.units(len);
        match self {
            KvBuf::F16(v) => v.truncate(len),
            KvBuf::F32(v) => v.truncate(len),
            KvBuf::Q8_0(v) => v.truncate(len),
            KvBuf::Q4_0(v) => v.truncate(len),
        }
    }

    /// Values `start..end` as a buffer of the same element type.
    fn slice(&self, start: usize, end: usize) -> KvBuf {
        let (start, end) = (self.units(start), self.units(end));
        match self {
            KvBuf::F16(v) => KvBuf::F16(v[start..end].to_vec()),
            KvBuf::F32(v) => KvBuf::F32(v[start..end].to_vec()),
            KvBuf::Q8_0(v) => KvBuf::Q8_0(v[start..end].to_vec()),
            KvBuf::Q4_0(v) => KvBuf::Q4_0(v[start..end].to_vec()),
        }
    }

    /// Append `other`'s values (nothing when the element types differ; callers check first).
    fn extend(&mut self, other: &KvBuf) {
        let n = other.len();
        self.extend_strided(other, 0, n, 1, n);
    }

    /// Append `count` runs of `len` values of `src`, the p-th starting at value
    /// `first + p·stride` (whole blocks for the quantized types); nothing when the element
    /// types differ.
    fn extend_strided(
        &mut self,
        src: &KvBuf,
        first: usize,
        stride: usize,
        count: usize,
        len: usize,
    ) {
        let (first, stride, len) = (self.units(first), self.units(stride), self.units(len));
        fn runs<T: Copy>(
            dst: &mut Vec<T>,
            src: &[T],
            first: usize,
            stride: usize,
            count: usize,
            len: usize,
        ) {
            for p in 0..count {
                let at = first + p * stride;
                dst.extend_from_slice(&src[at..at + len]);
            }
        }
        match (self, src) {
            (KvBuf::F16(d), KvBuf::F16(s)) => runs(d, s, first, stride, count, len),
            (KvBuf::F32(d), KvBuf::F32(s)) => runs(d, s, first, stride, count, len),
            (KvBuf::Q8_0(d), KvBuf::Q8_0(s)) => runs(d, s, first, stride, count, len),
            (KvBuf::Q4_0(d), KvBuf::Q4_0(s)) => runs(d, s, first, stride, count, len),
            _ => {}
        }
    }

    /// Make room for `units` more stored units.
    fn reserve(&mut self, units: usize) {
        match self {
            KvBuf::F16(v) => v.reserve(units),
            KvBuf::F32(v) => v.reserve(units),
            KvBuf::Q8_0(v) => v.reserve(units),
            KvBuf::Q4_0(v) => v.reserve(units),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            KvBuf::F16(v) => v.len() * 2,
            KvBuf::F32(v) => v.len() * 4,
            KvBuf::Q8_0(v) => v.len() * BlockQ8_0::BYTES,
            KvBuf::Q4_0(v) => v.len() * BlockQ4_0::BYTES,
        }
    }

    /// Values `first..first + n` as f32 into `out[..n]`. Every conversion is exact (a half
    /// float widened, or a block's code times its scale), so the result does not depend on
    /// which copy runs.
    fn read(&self, first: usize, n: usize, out: &mut [f32]) {
        let out = &mut out[..n];
        match self {
            KvBuf::F16(v) => {
                let bits: &[u16] = v[first..first + n].reinterpret_cast();
                simd::widen_f16(bits, out);
            }
            KvBuf::F32(v) => out.copy_from_slice(&v[first..first + n]),
            KvBuf::Q8_0(v) => {
                let b = first / QK32;
                dequantize_q8_0(&v[b..b + n / QK32], out);
            }
            KvBuf::Q4_0(v) => {
                let b = first / QK32;
                dequantize_q4_0(&v[b..b + n / QK32], out);
            }
        }
    }
}

crate::simd::avx2_and_baseline! {
baseline = dequantize_q8_0_baseline;
/// `out = d · q` per Q8_0 block, as `nextn_quant`'s reference dequantizer computes it.
fn dequantize_q8_0(blocks: &[BlockQ8_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK32)) {
        let d = b.d();
        for (x, &q) in o.iter_mut().zip(&b.qs) {
            *x = q as f32 * d;
        }
    }
}
}

crate::simd::avx2_and_baseline! {
baseline = dequantize_q4_0_baseline;
/// `out = d · (q − 8)` per Q4_0 block (low nibbles first), as the reference dequantizer.
fn dequantize_q4_0(blocks: &[BlockQ4_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK32)) {
        let d = b.d();
        let (lo, hi) = o.split_at_mut(QK32 / 2);
        for l in 0..QK32 / 2 {
            let q = b.qs[l];
            lo[l] = d * (((q & 0x0f) as i8 - 8) as f32);
            hi[l] = d * (((q >> 4) as i8 - 8) as f32);
        }
    }
}
}

/// Keys and values of one attention layer for positions `0..len`, stored per kv head: each
/// head's history is one contiguous `[pos][head_dim]` run, so attention (one task per kv head)
/// streams it front to back. Interleaving the heads position by position would make every task
/// read half of each cache line run and leave the other half to another core, which halves the
/// bandwidth a long context is read at.
#[derive(Clone, Debug)]
pub struct KvLayer {
    /// Keys of each kv head.
    k: Vec<KvBuf>,
    /// Values of each kv head.
    v: Vec<KvBuf>,
    /// Element types of the keys and the values.
    types: (KvType, KvType),
    head_dim: usize,
    len: usize,
}

impl KvLayer {
    pub fn new(k_type: KvType, v_type: KvType, n_heads: usize, head_dim: usize) -> Self {
        KvLayer {
            k: (0..n_heads).map(|_| KvBuf::new(k_type)).collect(),
            v: (0..n_heads).map(|_| KvBuf::new(v_type)).collect(),
            types: (k_type, v_type),
            head_dim,
            len: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Values per position: `n_head_kv · head_dim`.
    pub fn width(&self) -> usize {
        self.k.len() * self.head_dim
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(KvBuf::bytes).sum()
    }

    /// Append one position: `k` and `v` hold every kv head's `head_dim` values, head after head.
    pub fn push(&mut self, k: &[f32], v: &[f32]) {
        let hd = self.head_dim;
        for (h, (kb, vb)) in self.k.iter_mut().zip(&mut self.v).enumerate() {
            kb.push(&k[h * hd..(h + 1) * hd]);
            vb.push(&v[h * hd..(h + 1) * hd]);
        }
        self.len += 1;
    }

    /// Drop every position `>= pos`.
    pub fn truncate(&mut self, pos: usize) {
        if pos < self.len {
            let keep = pos * self.head_dim;
            self.k
                .iter_mut()
                .chain(&mut self.v)
                .for_each(|b| b.truncate(keep));
            self.len = pos;
        }
    }

    /// The keys and values of positions `start..end`, exactly as stored, position by position
    /// (a prefix cache keeps them to hand to a later sequence with the same tokens).
    pub fn rows(&self, start: usize, end: usize) -> KvRows {
        let end = end.min(self.len);
        let start = start.min(end);
        let hd = self.head_dim;
        let interleave = |heads: &[KvBuf], ty: KvType| {
            let mut rows = KvBuf::new(ty);
            rows.reserve((end - start) * self.width() / ty.block_len());
            for p in start..end {
                for head in heads {
                    rows.extend_strided(head, p * hd, hd, 1, hd);
                }
            }
            rows
        };
        KvRows {
            k: interleave(&self.k, self.types.0),
            v: interleave(&self.v, self.types.1),
            width: self.width(),
            len: end - start,
        }
    }

    /// Append rows taken with [`KvLayer::rows`] from a cache of the same shape and types.
    pub fn append_rows(&mut self, rows: &KvRows) -> Result<(), ModelError> {
        let width = self.width();
        if rows.width != width {
            return Err(ModelError::SnapshotMismatch {
                what: "attention row width",
                expected: width,
                found: rows.width,
            });
        }
        if self.types != rows.types() {
            return Err(ModelError::SnapshotKvType);
        }
        let hd = self.head_dim;
        for (h, (kb, vb)) in self.k.iter_mut().zip(&mut self.v).enumerate() {
            kb.extend_strided(&rows.k, h * hd, width, rows.len, hd);
            vb.extend_strided(&rows.v, h * hd, width, rows.len, hd);
        }
        self.len += rows.len;
        Ok(())
    }

    /// The keys (or values) of kv head `head` at positions `positions`, as f32 into `out`
    /// (`[pos][head_dim]`), whatever the stored type.
    pub fn read_head(
        &self,
        values: bool,
        head: usize,
        positions: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        let buf = if values { &self.v[head] } else { &self.k[head] };
        let hd = self.head_dim;
        buf.read(positions.start * hd, positions.len() * hd, out);
    }
}

/// Keys and values of a run of positions of one attention layer, in the cache's element types.
#[derive(Clone, Debug, PartialEq)]
pub struct KvRows {
    pub(crate) k: KvBuf,
    pub(crate) v: KvBuf,
    pub(crate) width: usize,
    pub(crate) len: usize,
}

impl PartialEq for KvBuf {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (KvBuf::F16(a), KvBuf::F16(b)) => a
                .iter()
                .map(|x| x.to_bits())
                .eq(b.iter().map(|x| x.to_bits())),
            (KvBuf::F32(a), KvBuf::F32(b)) => a
                .iter()
                .map(|x| x.to_bits())
                .eq(b.iter().map(|x| x.to_bits())),
            (KvBuf::Q8_0(a), KvBuf::Q8_0(b)) => a == b,
            (KvBuf::Q4_0(a), KvBuf::Q4_0(b)) => a == b,
            _ => false,
        }
    }
}

impl KvRows {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bytes(&self) -> usize {
        self.k.bytes() + self.v.bytes()
    }

    /// Positions `start..end` as rows of their own.
    pub fn range(&self, start: usize, end: usize) -> KvRows {
        let end = end.min(self.len);
        let start = start.min(end);
        let w = self.width;
        KvRows {
            k: self.k.slice(start * w, end * w),
            v: self.v.slice(start * w, end * w),
            width: w,
            len: end - start,
        }
    }

    /// Append the positions of `other`, which must have the same width and element types.
    pub fn append(&mut self, other: &KvRows) -> Result<(), ModelError> {
        if other.width != self.width {
            return Err(ModelError::SnapshotMismatch {
                what: "attention row width",
                expected: self.width,
                found: other.width,
            });
        }
        if self.types() != other.types() {
            return Err(ModelError::SnapshotKvType);
        }
        self.k.extend(&other.k);
        self.v.extend(&other.v);
        self.len += other.len;
        Ok(())
    }

    /// Split into positions `..at` (kept in `self`) and `at..` (returned).
    pub fn split_off(&mut self, at: usize) -> KvRows {
        let at = at.min(self.len);
        let w = self.width;
        let tail = KvRows {
            k: self.k.slice(at * w, self.len * w),
            v: self.v.slice(at * w, self.len * w),
            width: w,
            len: self.len - at,
        };
        self.k.truncate(at * w);
        self.v.truncate(at * w);
        self.len = at;
        tail
    }
}

/// The recurrent state of one gated-delta-net layer after some position.
#[derive(Clone, Debug, PartialEq)]
pub struct RecurrentState {
    /// The last `Kc − 1` raw (pre-conv) inputs, oldest first: `(Kc−1) × conv_dim`.
    pub conv: Vec<f32>,
    /// Per v head m, `S_m[i][j]` (i = key dim, j = value dim) row-major: `Hv × dk × dv`.
    pub ssm: Vec<f32>,
}

impl RecurrentState {
    pub fn zeros(conv_len: usize, ssm_len: usize) -> Self {
        RecurrentState {
            conv: vec![0.0; conv_len],
            ssm: vec![0.0; ssm_len],
        }
    }
}

/// Per-row inputs of the delta-rule recurrence from a verify batch, kept until commit so that a
/// partial acceptance replays only the kept rows.
#[derive(Clone, Debug)]
pub struct RowInputs {
    pub n: usize,
    /// Raw (pre-conv) projections `n × conv_dim`: they become the conv window.
    pub raw: Vec<f32>,
    /// Conv + SiLU outputs with q and k L2-normalised, `n × conv_dim`.
    pub conv: Vec<f32>,
    /// Per row and v head.
    pub beta: Vec<f32>,
    pub decay: Vec<f32>,
}

impl RowInputs {
    pub fn new(n: usize, conv_dim: usize, v_heads: usize) -> Self {
        RowInputs {
            n,
            raw: vec![0.0; n * conv_dim],
            conv: vec![0.0; n * conv_dim],
            beta: vec![0.0; n * v_heads],
            decay: vec![0.0; n * v_heads],
        }
    }
}

/// A delta-net layer's cache: the committed state, a spare state buffer that a verify batch writes
/// its final state into, and the verify rows awaiting commit.
#[derive(Clone, Debug)]
pub struct DeltaNetCache {
    pub state: RecurrentState,
    pub spare: Vec<f32>,
    pub pending: Option<RowInputs>,
}

/// What one trunk layer caches for a sequence: in host memory, or on the device when the model
/// runs there (`Model::offload`).
#[derive(Clone, Debug)]
pub enum LayerCache {
    Attention(KvLayer),
    DeltaNet(DeltaNetCache),
    DeviceAttention(DeviceKvCache),
    DeviceDeltaNet(DeviceDeltaNetCache),
}

impl LayerCache {
    /// A copy; on the device a new allocation, which can fail for lack of room there.
    pub fn try_clone(&self) -> Result<LayerCache, ModelError> {
        Ok(match self {
            LayerCache::DeviceAttention(c) => LayerCache::DeviceAttention(c.try_clone()?),
            LayerCache::DeviceDeltaNet(c) => LayerCache::DeviceDeltaNet(c.try_clone()?),
            host => host.clone(),
        })
    }

    /// What kind of cache this is, for errors.
    pub fn kind_name(&self) -> &'static str {
        match self {
            LayerCache::Attention(_) => "attention",
            LayerCache::DeltaNet(_) => "delta-net",
            LayerCache::DeviceAttention(_) => "device attention",
            LayerCache::DeviceDeltaNet(_) => "device delta-net",
        }
    }

    pub fn is_attention(&self) -> bool {
        matches!(
            self,
            LayerCache::Attention(_) | LayerCache::DeviceAttention(_)
        )
    }

    /// Positions an attention cache holds (0 for a recurrent layer).
    pub fn attention_len(&self) -> usize {
        match self {
            LayerCache::Attention(kv) => kv.len(),
            LayerCache::DeviceAttention(kv) => kv.len(),
            _ => 0,
        }
    }

    /// Drop an attention cache's positions `>= pos` (a recurrent layer is left alone).
    pub fn truncate_attention(&mut self, pos: usize) {
        match self {
            LayerCache::Attention(kv) => kv.truncate(pos),
            LayerCache::DeviceAttention(kv) => kv.truncate(pos),
            _ => {}
        }
    }

    /// An attention cache's rows `start..end` (`None` for a recurrent layer).
    pub fn attention_rows(&self, start: usize, end: usize) -> Option<Result<KvRows, ModelError>> {
        match self {
            LayerCache::Attention(kv) => Some(Ok(kv.rows(start, end))),
            LayerCache::DeviceAttention(kv) => Some(kv.rows(start, end)),
            _ => None,
        }
    }

    /// Append rows to an attention cache.
    pub fn append_attention_rows(&mut self, rows: &KvRows) -> Result<(), ModelError> {
        match self {
            LayerCache::Attention(kv) => kv.append_rows(rows),
            LayerCache::DeviceAttention(kv) => kv.append_rows(rows),
            other => Err(ModelError::WrongCacheKind {
                layer: "attention",
                found: other.kind_name(),
            }),
        }
    }

    /// Bytes the cache holds now (host or device memory).
    pub fn bytes(&self) -> usize {
        match self {
            LayerCache::Attention(kv) => kv.bytes(),
            LayerCache::DeltaNet(c) => (c.state.conv.len() + c.state.ssm.len() + c.spare.len()) * 4,
            LayerCache::DeviceAttention(kv) => kv.bytes(),
            LayerCache::DeviceDeltaNet(c) => c.bytes(),
        }
    }
}

/// The recurrent state of every delta-net layer of a sequence after `n_past` committed
/// positions: with the attention rows of those positions, all that is needed to resume it.
#[derive(Clone, Debug, PartialEq)]
pub struct RecurrentSnapshot {
    n_past: usize,
    states: Vec<RecurrentState>,
}

impl RecurrentSnapshot {
    /// Committed positions the state follows.
    pub fn n_past(&self) -> usize {
        self.n_past
    }

    pub fn bytes(&self) -> usize {
        self.states
            .iter()
            .map(|s| (s.conv.len() + s.ssm.len()) * 4)
            .sum()
    }
}

/// Everything the target model remembers about one sequence.
#[derive(Clone, Debug)]
pub struct SequenceState {
    pub layers: Vec<LayerCache>,
    /// Number of committed positions.
    pub n_past: usize,
    /// Context length this sequence may grow to.
    pub n_ctx: usize,
    /// Rows of a verify batch at the end of `n_past` that are not committed yet.
    pub pending_rows: usize,
    /// The images among the committed rows, in order.
    pub images: Vec<ImageSpan>,
}

/// Cache rows `start..start + n_tokens` hold an image's embeddings, which advanced the rotary
/// position by only `n_pos` (M-RoPE: `max(nx, ny)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageSpan {
    pub start: usize,
    pub n_tokens: usize,
    pub n_pos: usize,
}

impl SequenceState {
    /// A copy; caches on the device are new allocations there, which can fail for lack of room
    /// (an error naming what did not fit, where `clone` would panic).
    pub fn try_clone(&self) -> Result<SequenceState, ModelError> {
        Ok(SequenceState {
            layers: self
                .layers
                .iter()
                .map(LayerCache::try_clone)
                .collect::<Result<_, _>>()?,
            n_past: self.n_past,
            n_ctx: self.n_ctx,
            pending_rows: self.pending_rows,
            images: self.images.clone(),
        })
    }

    /// Cache rows the images so far took beyond the rotary positions they advanced: the rotary
    /// position of the next row is `n_past - rope_shift()`.
    pub fn rope_shift(&self) -> usize {
        self.images.iter().map(|im| im.n_tokens - im.n_pos).sum()
    }

    /// Positions still free in the context.
    pub fn remaining(&self) -> usize {
        self.n_ctx.saturating_sub(self.n_past)
    }

    pub fn check_room(&self, n: usize) -> Result<(), ModelError> {
        if self.n_past + n > self.n_ctx {
            return Err(ModelError::ContextFull {
                n_past: self.n_past,
                n_new: n,
                n_ctx: self.n_ctx,
            });
        }
        Ok(())
    }

    /// Drop positions `>= pos` from every attention layer. Recurrent states cannot be truncated
    /// on their own: [`crate::Model::commit`] pairs this with the delta-net commit of the kept rows.
    pub fn truncate_kv(&mut self, pos: usize) {
        self.images.retain(|im| im.start < pos);
        for l in &mut self.layers {
            l.truncate_attention(pos);
        }
    }

    /// The attention rows of positions `start..end` of every attention layer, in layer order
    /// (read back from the device when the caches are there).
    pub fn attention_rows(&self, start: usize, end: usize) -> Result<Vec<KvRows>, ModelError> {
        self.layers
            .iter()
            .filter_map(|l| l.attention_rows(start, end))
            .collect()
    }

    /// The recurrent state of every delta-net layer after the last committed position. Only
    /// committed state can be kept: a pending verify batch is an error.
    pub fn recurrent_snapshot(&self) -> Result<RecurrentSnapshot, ModelError> {
        if self.pending_rows > 0 {
            return Err(ModelError::UncommittedVerify {
                pending: self.pending_rows,
            });
        }
        Ok(RecurrentSnapshot {
            n_past: self.n_past,
            states: self
                .layers
                .iter()
                .filter_map(|l| match l {
                    LayerCache::DeltaNet(c) => Some(Ok(c.state.clone())),
                    LayerCache::DeviceDeltaNet(c) => Some(c.snapshot()),
                    _ => None,
                })
                .collect::<Result<_, _>>()?,
        })
    }

    /// Resume a fresh sequence at `snapshot.n_past`: `segments` are the attention rows of
    /// positions `0..n_past` in order (each as [`SequenceState::attention_rows`] gives them) and
    /// `snapshot` the recurrent state after them. The result is the state the sequence had when
    /// the snapshot was taken, bit for bit.
    pub fn restore<'r>(
        &mut self,
        segments: impl IntoIterator<Item = &'r [KvRows]>,
        snapshot: &RecurrentSnapshot,
    ) -> Result<(), ModelError> {
        if self.n_past != 0 || self.pending_rows != 0 {
            return Err(ModelError::SnapshotMismatch {
                what: "positions already in the sequence",
                expected: 0,
                found: self.n_past,
            });
        }
        if snapshot.n_past > self.n_ctx {
            return Err(ModelError::ContextFull {
                n_past: 0,
                n_new: snapshot.n_past,
                n_ctx: self.n_ctx,
            });
        }
        let n_attention = self.layers.iter().filter(|l| l.is_attention()).count();
        let n_delta = self.layers.len() - n_attention;
        if snapshot.states.len() != n_delta {
            return Err(ModelError::SnapshotMismatch {
                what: "delta-net layers",
                expected: n_delta,
                found: snapshot.states.len(),
            });
        }
        for rows in segments {
            if rows.len() != n_attention {
                return Err(ModelError::SnapshotMismatch {
                    what: "attention layers",
                    expected: n_attention,
                    found: rows.len(),
                });
            }
            let kvs = self.layers.iter_mut().filter(|l| l.is_attention());
            for (kv, r) in kvs.zip(rows) {
                kv.append_attention_rows(r)?;
            }
        }
        let mut states = snapshot.states.iter();
        for l in &mut self.layers {
            match l {
                l if l.is_attention() && l.attention_len() != snapshot.n_past => {
                    return Err(ModelError::SnapshotMismatch {
                        what: "attention positions",
                        expected: snapshot.n_past,
                        found: l.attention_len(),
                    });
                }
                LayerCache::Attention(_) | LayerCache::DeviceAttention(_) => {}
                LayerCache::DeviceDeltaNet(c) => {
                    let s = states.next().ok_or(ModelError::SnapshotMismatch {
                        what: "delta-net layers",
                        expected: n_delta,
                        found: snapshot.states.len(),
                    })?;
                    c.set_state(s)?;
                }
                LayerCache::DeltaNet(c) => {
                    let s = states.next().ok_or(ModelError::SnapshotMismatch {
                        what: "delta-net layers",
                        expected: n_delta,
                        found: snapshot.states.len(),
                    })?;
                    if s.conv.len() != c.state.conv.len() || s.ssm.len() != c.state.ssm.len() {
                        return Err(ModelError::SnapshotMismatch {
                            what: "recurrent state values",
                            expected: c.state.conv.len() + c.state.ssm.len(),
                            found: s.conv.len() + s.ssm.len(),
                        });
                    }
                    c.state.conv.copy_from_slice(&s.conv);
                    c.state.ssm.copy_from_slice(&s.ssm);
                }
            }
        }
        self.n_past = snapshot.n_past;
        Ok(())
    }

    /// Bytes held by the caches now.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(LayerCache::bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_truncate_and_read() {
        let mut kv = KvLayer::new(KvType::F32, KvType::F16, 2, 2);
        for p in 0..5 {
            let row: Vec<f32> = (0..4).map(|i| (p * 10 + i) as f32).collect();
            kv.push(&row, &row);
        }
        kv.truncate(3);
        assert_eq!(kv.len(), 3);
        let mut out = vec![0.0; 6];
        kv.read_head(false, 1, 0..3, &mut out);
        assert_eq!(out, vec![2.0, 3.0, 12.0, 13.0, 22.0, 23.0]);
        kv.read_head(true, 0, 0..3, &mut out);
        assert_eq!(out, vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0]);
        kv.read_head(true, 1, 1..3, &mut out[..4]);
        assert_eq!(out[..4], [12.0, 13.0, 22.0, 23.0]);
    }

    /// Each head's history is stored on its own, yet the rows handed to a prefix cache or a slot
    /// file are position by position (all heads of a position together), and appending them to
    /// another cache restores every head exactly.
    #[test]
    fn rows_are_position_major_and_round_trip_per_head() {
        let (heads, hd) = (3usize, 32usize);
        let width = heads * hd;
        let row = |p: usize, salt: usize| -> Vec<f32> {
            (0..width)
                .map(|i| ((p * 37 + i * 11 + salt) % 101) as f32 / 9.0 - 5.0)
                .collect()
        };
        for ty in [KvType::F32, KvType::F16, KvType::Q8_0, KvType::Q4_0] {
            let mut kv = KvLayer::new(ty, ty, heads, hd);
            for p in 0..10 {
                kv.push(&row(p, 0), &row(p, 5));
            }
            let rows = kv.rows(2, 7);
            let (mut k, mut v) = (KvBuf::new(ty), KvBuf::new(ty));
            for p in 2..7 {
                k.push(&row(p, 0));
                v.push(&row(p, 5));
            }
            let expected = KvRows {
                k,
                v,
                width,
                len: 5,
            };
            assert_eq!(rows, expected, "{ty:?}: position-major rows");

            let mut other = KvLayer::new(ty, ty, heads, hd);
            other.append_rows(&kv.rows(0, 10)).unwrap();
            other.truncate(6);
            other.append_rows(&kv.rows(6, 10)).unwrap();
            assert_eq!(other.len(), 10);
            for head in 0..heads {
                for values in [false, true] {
                    let (mut a, mut b) = (vec![0.0; 10 * hd], vec![0.0; 10 * hd]);
                    kv.read_head(values, head, 0..10, &mut a);
                    other.read_head(values, head, 0..10, &mut b);
                    assert_eq!(a, b, "{ty:?}, head {head}, values {values}");
                }
            }
            let narrow = KvLayer::new(ty, ty, 1, hd).rows(0, 0);
            assert!(other.append_rows(&narrow).is_err(), "width is checked");
        }
    }
}
