//! The gated full-attention layer between its projections: per-head RMSNorm of q and k,
//! partial NEOX rotary embedding and the KV cache store in one dispatch ([`prep`]), and causal
//! grouped-query softmax attention with the sigmoid output gate, its output quantized for the
//! output projection on the way ([`attention_quant`]).
//!
//! Every function works on `n` rows of one sequence whose first row is at position
//! `start_pos`; offsets and strides are in f32 elements of the buffers they index.

use super::matvec::{quant_layout, ActBlocks, QuantLayout, QuantOut};
use super::Kernel;
use crate::kv::{DeviceKv, MAX_HEAD_DIM};
use crate::{GpuError, Recorder};

/// Norms, rotation and the KV store of an attention layer's rows in one dispatch.
pub static PREP: Kernel = Kernel {
    name: "attention_prep",
    source: concat!(
        include_str!("../shaders/rope_sincos.wgsl"),
        include_str!("../shaders/kv_convert.wgsl"),
        include_str!("../shaders/attention_prep.wgsl")
    ),
    entry: "attention_prep",
};

pub static ATTENTION_CHUNK: Kernel = Kernel {
    name: "attention_chunk",
    source: include_str!("../shaders/attention_chunk.wgsl"),
    entry: "attention_chunk",
};

pub static ATTENTION_MERGE: Kernel = Kernel {
    name: "attention_merge",
    source: concat!(
        include_str!("../shaders/quant_common.wgsl"),
        include_str!("../shaders/attention_merge.wgsl")
    ),
    entry: "attention_merge",
};

pub static KERNELS: &[&Kernel] = &[&PREP, &ATTENTION_CHUNK, &ATTENTION_MERGE];

/// Cache positions per chunk of the attention's first pass (`CHUNK` in the shaders). Chunks
/// are fixed in absolute positions: a query's result is the same whatever else is computed.
pub const CHUNK: usize = 128;
/// Query heads one first-pass workgroup takes at most (`QMAX` in the shader).
const QUERIES_PER_GROUP: usize = 8;
/// f32 values of the first pass's workgroup buffer for the weighted values of its queries.
const VALUE_SLOTS: usize = 2048;
/// What [`AttentionScratch`] may grow to by default; a longer batch runs in parts.
pub const DEFAULT_SCRATCH_BYTES: u64 = 128 << 20;

fn bad(tensor: &str, why: String) -> GpuError {
    GpuError::BadTensor {
        tensor: tensor.to_string(),
        why,
    }
}

/// Fail unless elements `..end` of `buf` (f32 or u32) exist.
fn check_extent(what: &str, buf: &wgpu::Buffer, end: u64) -> Result<(), GpuError> {
    if end * 4 > buf.size() {
        return Err(bad(
            what,
            format!(
                "reaches element {end} of a buffer of {} elements",
                buf.size() / 4
            ),
        ));
    }
    Ok(())
}

/// One past the last element `n` rows of `heads` heads of `width` values touch.
fn extent(off: u32, n: u32, row_stride: u32, heads: u32, head_stride: u32, width: u32) -> u64 {
    off as u64
        + (n as u64 - 1) * row_stride as u64
        + (heads as u64 - 1) * head_stride as u64
        + width as u64
}

/// What [`prep`] does to the rows: any of the per-head norms, the rotation and the store.
pub mod steps {
    pub const NORM: u32 = 1;
    pub const ROPE: u32 = 2;
    pub const STORE: u32 = 4;
}

/// Where an attention layer's rows sit and how they are prepared: `n` rows of one sequence from
/// `x_off`, `x_stride` apart, `n_head` query heads and `n_kv` kv heads of `head_dim` values,
/// query head `h` at `h * q_head_stride` (its gate after it), key head `g` at `k_col + g *
/// head_dim`, value head `g` at `v_col + g * head_dim`; the q and k norm weights in `norms` from
/// `qn_off` and `kn_off`; rows at cache positions `start_pos..`, turned at the rotary positions
/// `rotary` gives them.
#[derive(Clone, Copy, Debug)]
pub struct PrepRows {
    pub x_off: u32,
    pub x_stride: u32,
    pub n: u32,
    pub n_head: u32,
    pub n_kv: u32,
    pub head_dim: u32,
    pub q_head_stride: u32,
    pub k_col: u32,
    pub v_col: u32,
    pub qn_off: u32,
    pub kn_off: u32,
    pub n_rot: u32,
    pub start_pos: u32,
    pub freq_base: f32,
    pub freq_scale: f32,
    pub eps: f32,
    pub rotary: RotaryPositions,
}

/// The rotary positions of a segment's rows (the CPU's `RowPositions` and `RopeTable::new_3d`):
/// text row `i` at `(p, p, p)`, `p = start_pos + i - shift`, where `shift` counts the cache rows
/// earlier images took beyond the positions they advanced; the rows of an image `image_nx`
/// tokens wide (`image_nx > 0`) at `(p0, p0 + i / image_nx, p0 + i % image_nx)`, `p0 =
/// start_pos - shift`. Rotated pair `j` turns by the t, h or w component when `j % 3` is 0, 1 or
/// 2 and `j / 3` is under that component's entry of `sections`, and not at all otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RotaryPositions {
    pub shift: u32,
    pub image_nx: u32,
    pub sections: [u32; 3],
}

impl RotaryPositions {
    /// Text rows at their cache positions, every pair turning by them.
    pub const TEXT: RotaryPositions = RotaryPositions {
        shift: 0,
        image_nx: 0,
        sections: [u32::MAX; 3],
    };
}

/// The rows between an attention layer's projections and attention, in place, in one dispatch,
/// as `steps` says ([`steps`]): the RMSNorm of each q and k head (`head_dim` values, the sum of
/// squares an f32 tree over the head), the partial NEOX rotary embedding of both on their first
/// `n_rot` values (pairs `(j, j + n_rot/2)` rotated by `theta_j = p * theta_scale^j *
/// freq_scale` at the row's position `p`, with `theta_scale = freq_base^(-2/n_rot)` and the
/// power taken as ggml does, by `j` repeated f32 multiplications starting from `p`: the CPU's
/// bits), and the keys and values into `kv` at positions `start_pos..start_pos + n`, converted
/// to the cache's element types exactly as the CPU cache converts them (f16 rounded to nearest
/// even; Q8_0 as ggml's `quantize_row_q8_0`). The store needs the cache (`kv`), whose heads must
/// be the rows'; `start_pos` may not be past its length (no gaps) and the length becomes
/// `start_pos + n`, which drops whatever was cached beyond.
pub fn prep(
    rec: &mut Recorder,
    x: &wgpu::Buffer,
    norms: &wgpu::Buffer,
    mut kv: Option<&mut DeviceKv>,
    rows: &PrepRows,
    steps: u32,
) -> Result<(), GpuError> {
    let r = rows;
    if x == norms {
        return Err(bad(
            "attention rows",
            "the rows and the norm weights share a buffer".into(),
        ));
    }
    let (start, end) = (r.start_pos as usize, r.start_pos as usize + r.n as usize);
    let (heads, hd) = (r.n_kv, r.head_dim);
    let store = steps & steps::STORE != 0;
    if store {
        let Some(kv) = kv.as_deref() else {
            return Err(bad(
                "attention KV cache",
                "no cache to store the rows in".into(),
            ));
        };
        if (kv.n_kv_heads() as u32, kv.head_dim() as u32) != (heads, hd) {
            return Err(bad(
                "attention KV cache",
                format!(
                    "rows of {heads} kv heads of {hd} stored in a cache of {} heads of {}",
                    kv.n_kv_heads(),
                    kv.head_dim()
                ),
            ));
        }
        if start > kv.len() || end > kv.capacity() {
            return Err(bad(
                "attention KV cache",
                format!(
                    "positions {start}..{end} stored in a cache holding {} of a capacity of {}",
                    kv.len(),
                    kv.capacity()
                ),
            ));
        }
    }
    if !r.n_rot.is_multiple_of(2) || r.n_rot > hd {
        return Err(bad("rope", format!("n_rot {} of heads of {hd}", r.n_rot)));
    }
    if r.rotary.shift > r.start_pos {
        return Err(bad(
            "rope",
            format!(
                "a position shift of {} before cache position {}",
                r.rotary.shift, r.start_pos
            ),
        ));
    }
    if r.n == 0 {
        if let (true, Some(kv)) = (store, kv.as_deref_mut()) {
            kv.set_len(start);
        }
        return Ok(());
    }
    let row_end = |col: u32, heads: u32, stride: u32| {
        extent(r.x_off + col, r.n, r.x_stride, heads.max(1), stride, hd)
    };
    if r.n_head > 0 {
        check_extent(
            "attention queries",
            x,
            row_end(0, r.n_head, r.q_head_stride),
        )?;
    }
    if heads > 0 && (steps & (steps::NORM | steps::ROPE) != 0 || store) {
        check_extent("attention keys", x, row_end(r.k_col, heads, hd))?;
    }
    if store {
        check_extent("attention values", x, row_end(r.v_col, heads, hd))?;
    }
    if steps & steps::NORM != 0 {
        check_extent(
            "attention head norm weight",
            norms,
            r.qn_off.max(r.kn_off) as u64 + hd as u64,
        )?;
    }
    // As the CPU computes it (ops::RopeTable), so the angles have its bits.
    let theta_scale = r.freq_base.powf(-2.0 / r.n_rot.max(1) as f32);
    let gpu = rec.gpu();
    let unused = [gpu.scratch("unused-0", 16)?, gpu.scratch("unused-1", 16)?];
    let (scales, capacity, k_elem, v_elem, k_buf, v_buf) = match kv.as_deref() {
        Some(kv) if store => (
            kv.q8_scales_word() as u32,
            kv.capacity() as u32,
            kv.k_elem().code(),
            kv.v_elem().code(),
            kv.k_buffer().clone(),
            kv.v_buffer().clone(),
        ),
        _ => (0, 0, 0, 0, unused[0].clone(), unused[1].clone()),
    };
    let groups = crate::groups_1d(gpu, r.n * (r.n_head + heads));
    // Each q and k head read and written in place; each stored key and value read and written
    // to the cache.
    let rows = r.n as u64;
    let in_place = if steps & (steps::NORM | steps::ROPE) != 0 {
        rows * (r.n_head + heads) as u64 * hd as u64 * 8
    } else {
        0
    };
    let stored = match kv.as_deref() {
        Some(kv) if store => {
            let hd = hd as usize;
            rows * heads as u64
                * (2 * hd as u64 * 4
                    + (kv.k_elem().ggml_bytes(hd) + kv.v_elem().ggml_bytes(hd)) as u64)
        }
        _ => 0,
    };
    rec.dispatch(
        &PREP,
        &[
            r.n,
            r.n_head,
            heads,
            hd,
            r.x_off,
            r.x_stride,
            r.q_head_stride,
            r.k_col,
            r.v_col,
            r.qn_off,
            r.kn_off,
            r.n_rot / 2,
            r.start_pos,
            theta_scale.to_bits(),
            r.freq_scale.to_bits(),
            capacity,
            k_elem,
            v_elem,
            scales,
            scales,
            steps,
            r.eps.to_bits(),
            r.rotary.shift,
            r.rotary.image_nx,
            r.rotary.sections[0],
            r.rotary.sections[1],
            r.rotary.sections[2],
        ],
        &[x, norms, &k_buf, &v_buf],
        groups,
        in_place + stored,
    )?;
    if let (true, Some(kv)) = (store, kv) {
        kv.set_len(end);
    }
    Ok(())
}

/// The device buffer attention keeps its per-chunk results in between its two passes, reused
/// from call to call (one per device is enough: calls recorded one after another take turns).
pub struct AttentionScratch {
    buf: Option<wgpu::Buffer>,
    budget: u64,
}

impl Default for AttentionScratch {
    fn default() -> Self {
        Self::new()
    }
}

impl AttentionScratch {
    pub fn new() -> Self {
        Self::with_budget(DEFAULT_SCRATCH_BYTES)
    }

    /// A scratch that grows to about `bytes` (never past the device's binding limit): a batch
    /// whose chunk results need more runs in parts of (row, kv head) units, with the same
    /// results; one unit is always allowed.
    pub fn with_budget(bytes: u64) -> Self {
        AttentionScratch {
            buf: None,
            budget: bytes,
        }
    }

    /// Bytes allocated on the device.
    pub fn bytes(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.size())
    }

    fn at_least(&mut self, gpu: &crate::Gpu, bytes: u64) -> Result<wgpu::Buffer, GpuError> {
        match &self.buf {
            Some(b) if b.size() >= bytes => Ok(b.clone()),
            _ => {
                let b = gpu.buffer("attention chunk results", bytes)?;
                self.buf = Some(b.clone());
                Ok(b)
            }
        }
    }
}

/// Causal softmax attention of `n` rows over `kv`, gated: for row `i` (position
/// `start_pos + i`) and query head `h`, with kv head `g = h / (n_head / n_kv_heads)`,
///
/// `out[i][h] = softmax_p(q_ih · k_gp / sqrt(head_dim)) · v_gp  ⊙  sigmoid(gate_ih)`
///
/// over cache positions `p = 0..=start_pos + i`. The query of head `h` of row `i` is the
/// `head_dim` values at `q_off + i * q_row_stride + h * q_head_stride`, its gate those at
/// `gate_off` further; the output row `i` is the heads' results in order, `n_head * head_dim`
/// values at `out_off + i * out_row_stride`. `out` must be another buffer than `q`. The cache
/// must hold positions `0..start_pos + n` (store them first, see [`kv_store`]).
///
/// Each row's result has the same bits whatever `n` is and whatever the other rows are: the
/// cache is cut into chunks of [`CHUNK`] absolute positions, each chunk's softmax pieces are
/// computed alone, then folded in chunk order.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    rec: &mut Recorder,
    scratch: &mut AttentionScratch,
    q: &wgpu::Buffer,
    q_off: u32,
    q_row_stride: u32,
    q_head_stride: u32,
    gate_off: u32,
    n_head: u32,
    kv: &DeviceKv,
    n: u32,
    start_pos: u32,
    out: &wgpu::Buffer,
    out_off: u32,
    out_row_stride: u32,
) -> Result<(), GpuError> {
    attention_quant(
        rec,
        scratch,
        q,
        q_off,
        q_row_stride,
        q_head_stride,
        gate_off,
        n_head,
        kv,
        n,
        start_pos,
        out,
        out_off,
        out_row_stride,
        &QuantOut::default(),
    )
}

/// [`attention`], and each output row also quantized into `quant`'s buffers (row `quant.row0 +
/// i` for row `i`) for the output projection's int8 product, in the same dispatch.
#[allow(clippy::too_many_arguments)]
pub fn attention_quant(
    rec: &mut Recorder,
    scratch: &mut AttentionScratch,
    q: &wgpu::Buffer,
    q_off: u32,
    q_row_stride: u32,
    q_head_stride: u32,
    gate_off: u32,
    n_head: u32,
    kv: &DeviceKv,
    n: u32,
    start_pos: u32,
    out: &wgpu::Buffer,
    out_off: u32,
    out_row_stride: u32,
    quant: &QuantOut,
) -> Result<(), GpuError> {
    let (n_kv, hd) = (kv.n_kv_heads() as u32, kv.head_dim() as u32);
    if n_head == 0 || !n_head.is_multiple_of(n_kv) {
        return Err(bad(
            "attention",
            format!("{n_head} query heads over {n_kv} kv heads"),
        ));
    }
    let seen_end = start_pos as usize + n as usize;
    if seen_end > kv.len() {
        return Err(bad(
            "attention KV cache",
            format!(
                "rows up to position {} attended over a cache of {} positions",
                seen_end as i64 - 1,
                kv.len()
            ),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    debug_assert!(hd as usize <= MAX_HEAD_DIM && hd % 32 == 0);
    check_extent(
        "attention queries",
        q,
        extent(q_off, n, q_row_stride, n_head, q_head_stride, hd),
    )?;
    check_extent(
        "attention gates",
        q,
        extent(q_off + gate_off, n, q_row_stride, n_head, q_head_stride, hd),
    )?;
    check_extent(
        "attention output",
        out,
        extent(out_off, n, out_row_stride, 1, 0, n_head * hd),
    )?;
    let gpu = rec.gpu();
    let group = n_head / n_kv;
    let qw = (QUERIES_PER_GROUP as u32)
        .min(VALUE_SLOTS as u32 / hd)
        .min(group);
    let head_blocks = group.div_ceil(qw);
    let n_chunks = seen_end.div_ceil(CHUNK) as u32;
    // Each (row, kv head) unit keeps its query heads' chunk results: max, sum, head_dim sums.
    let per_unit = group as u64 * n_chunks as u64 * (hd as u64 + 2) * 4;
    let limit = gpu.max_binding_bytes();
    if per_unit > limit {
        return Err(GpuError::BufferTooLarge {
            what: format!("attention's chunk results at a context of {seen_end} positions"),
            bytes: per_unit,
            limit,
        });
    }
    // Parts of whole rows, so that the merge of a row sees all its heads.
    let total_units = n * n_kv;
    let rows_per_part =
        ((scratch.budget.min(limit) / (per_unit * n_kv as u64)).min(n as u64) as u32).max(1);
    let units_per_part = rows_per_part * n_kv;
    let part = scratch.at_least(gpu, units_per_part as u64 * per_unit)?;
    let scales = kv.q8_scales_word() as u32;
    let scale = 1.0 / (hd as f32).sqrt();
    let width = (n_head * hd) as usize;
    let layout = |b: Option<&wgpu::Buffer>, kind: ActBlocks| -> Result<QuantLayout, GpuError> {
        match b {
            None => Ok(QuantLayout {
                stride: 0,
                d_off: 0,
                blocks: 0,
            }),
            Some(_) => quant_layout(width, kind).ok_or_else(|| {
                bad(
                    "attention output",
                    format!("{width} values a row are not whole {kind:?} blocks"),
                )
            }),
        }
    };
    let (l0, lk) = (
        layout(quant.q8_0, ActBlocks::Q8_0)?,
        layout(quant.q8k, ActBlocks::Q8K)?,
    );
    let flags = (quant.q8_0.is_some() as u32) << 1 | (quant.q8k.is_some() as u32) << 2;
    // A merge workgroup takes 8 blocks of 32 values (a chunk of 256) when it quantizes them.
    let cb = if flags != 0 { 8 } else { 1 };
    let unused = gpu.scratch("unused-3", 16)?;
    let (q0b, qkb) = (quant.q8_0.unwrap_or(&unused), quant.q8k.unwrap_or(&unused));
    // What a part must move: the keys and values of its kv heads over the positions seen (all
    // of them once the part holds a row per kv head), its queries, the chunk results written
    // and read back, its gates read and its output rows written.
    let kv_row = (kv.k_elem().ggml_bytes(hd as usize) + kv.v_elem().ggml_bytes(hd as usize)) as u64;
    let head_bytes = hd as u64 * 4;
    let mut unit0 = 0;
    while unit0 < total_units {
        let units = units_per_part.min(total_units - unit0);
        let first = crate::groups_1d(gpu, units * head_blocks * n_chunks);
        let results = units as u64 * per_unit;
        let cache = units.min(n_kv) as u64 * seen_end as u64 * kv_row;
        let queries = units as u64 * group as u64 * head_bytes;
        rec.dispatch(
            &ATTENTION_CHUNK,
            &[
                unit0,
                units,
                start_pos,
                n_kv,
                group,
                qw,
                head_blocks,
                n_chunks,
                hd,
                kv.capacity() as u32,
                q_off,
                q_row_stride,
                q_head_stride,
                kv.k_elem().code(),
                kv.v_elem().code(),
                scales,
                scales,
                scale.to_bits(),
            ],
            &[q, kv.k_buffer(), kv.v_buffer(), &part],
            first,
            cache + queries + results,
        )?;
        let rows = units / n_kv;
        let second = crate::groups_1d(gpu, rows * (n_head * hd).div_ceil(32 * cb));
        rec.dispatch(
            &ATTENTION_MERGE,
            &[
                unit0,
                units,
                start_pos,
                n_kv,
                group,
                n_chunks,
                hd,
                q_off,
                q_row_stride,
                q_head_stride,
                gate_off,
                out_off,
                out_row_stride,
                cb,
                flags,
                quant.row0,
                l0.stride,
                l0.d_off,
                lk.stride,
                lk.d_off,
            ],
            &[&part, q, out, q0b, qkb],
            second,
            results + 2 * queries,
        )?;
        unit0 += units;
    }
    Ok(())
}
