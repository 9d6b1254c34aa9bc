//! The gated full-attention layer between its projections: per-head RMSNorm of q and k,
//! partial NEOX rotary embedding, the KV cache store, and causal grouped-query softmax
//! attention with the sigmoid output gate.
//!
//! Every function works on `n` rows of one sequence whose first row is at position
//! `start_pos`; offsets and strides are in f32 elements of the buffers they index.

use super::Kernel;
use crate::kv::{DeviceKv, MAX_HEAD_DIM};
use crate::{GpuError, Recorder};

pub static HEAD_NORM: Kernel = Kernel {
    name: "attention_head_norm",
    source: include_str!("../shaders/attention_head_norm.wgsl"),
    entry: "attention_head_norm",
};

pub static ROPE_NEOX: Kernel = Kernel {
    name: "rope_neox",
    source: include_str!("../shaders/rope_neox.wgsl"),
    entry: "rope_neox",
};

pub static KV_STORE: Kernel = Kernel {
    name: "kv_store",
    source: include_str!("../shaders/kv_store.wgsl"),
    entry: "kv_store",
};

pub static ATTENTION_CHUNK: Kernel = Kernel {
    name: "attention_chunk",
    source: include_str!("../shaders/attention_chunk.wgsl"),
    entry: "attention_chunk",
};

pub static ATTENTION_MERGE: Kernel = Kernel {
    name: "attention_merge",
    source: include_str!("../shaders/attention_merge.wgsl"),
    entry: "attention_merge",
};

pub static KERNELS: &[&Kernel] = &[
    &HEAD_NORM,
    &ROPE_NEOX,
    &KV_STORE,
    &ATTENTION_CHUNK,
    &ATTENTION_MERGE,
];

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

/// RMSNorm of each of `heads` heads of `head_dim` values in each of `n` rows, in place:
/// head `h` of row `i` starts at `x_off + i * row_stride + h * head_stride` (q heads sit at
/// stride `2 * head_dim` in the joint query/gate projection, k heads at `head_dim`); `w` holds
/// the `head_dim` weights from `w_off`. The sum of squares is an f32 tree over the head.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_heads_inplace(
    rec: &mut Recorder,
    x: &wgpu::Buffer,
    x_off: u32,
    row_stride: u32,
    n: u32,
    heads: u32,
    head_stride: u32,
    head_dim: u32,
    w: &wgpu::Buffer,
    w_off: u32,
    eps: f32,
) -> Result<(), GpuError> {
    if n == 0 || heads == 0 || head_dim == 0 {
        return Ok(());
    }
    check_extent(
        "attention head norm input",
        x,
        extent(x_off, n, row_stride, heads, head_stride, head_dim),
    )?;
    check_extent(
        "attention head norm weight",
        w,
        w_off as u64 + head_dim as u64,
    )?;
    let groups = crate::groups_1d(rec.gpu(), n * heads);
    rec.dispatch(
        &HEAD_NORM,
        &[
            n,
            heads,
            head_dim,
            x_off,
            row_stride,
            head_stride,
            w_off,
            eps.to_bits(),
        ],
        &[x, w],
        groups,
    )
}

/// Partial NEOX rotary embedding in place on the first `n_rot` values of each head: pairs
/// `(j, j + n_rot/2)` rotated by `theta_j = p * theta_scale^j * freq_scale` at the row's
/// position `p = start_pos + i`, where `theta_scale = freq_base^(-2/n_rot)` and the power is
/// taken as ggml does, by `j` repeated f32 multiplications starting from `p` (the CPU's bits).
/// Heads are laid out as in [`rms_norm_heads_inplace`].
#[allow(clippy::too_many_arguments)]
pub fn rope_neox_inplace(
    rec: &mut Recorder,
    x: &wgpu::Buffer,
    x_off: u32,
    row_stride: u32,
    n: u32,
    heads: u32,
    head_stride: u32,
    n_rot: u32,
    start_pos: u32,
    freq_base: f32,
    freq_scale: f32,
) -> Result<(), GpuError> {
    if !n_rot.is_multiple_of(2) {
        return Err(bad("rope", format!("n_rot {n_rot} is odd")));
    }
    if n == 0 || heads == 0 || n_rot == 0 {
        return Ok(());
    }
    check_extent(
        "rope input",
        x,
        extent(x_off, n, row_stride, heads, head_stride, n_rot),
    )?;
    // As the CPU computes it (ops::RopeTable), so the angles have its bits.
    let theta_scale = freq_base.powf(-2.0 / n_rot as f32);
    let half = n_rot / 2;
    let threads = n as u64 * heads as u64 * half as u64;
    let groups = crate::groups_1d(rec.gpu(), threads.div_ceil(64) as u32);
    rec.dispatch(
        &ROPE_NEOX,
        &[
            n,
            heads,
            half,
            x_off,
            row_stride,
            head_stride,
            start_pos,
            theta_scale.to_bits(),
            freq_scale.to_bits(),
        ],
        &[x],
        groups,
    )
}

/// Write the keys and values of `n` rows into `kv` at positions `start_pos..start_pos + n`,
/// converted to the cache's element types exactly as the CPU cache converts them (f16 rounded
/// to nearest even; Q8_0 as ggml's `quantize_row_q8_0`). Row `i`'s keys are the
/// `n_kv_heads * head_dim` values at `k_off + i * row_stride` (head after head), its values
/// likewise from `v_off`. `start_pos` may not be past the cache's length (no gaps); the length
/// becomes `start_pos + n`, which drops whatever was cached beyond.
#[allow(clippy::too_many_arguments)]
pub fn kv_store(
    rec: &mut Recorder,
    kv: &mut DeviceKv,
    k: &wgpu::Buffer,
    k_off: u32,
    v: &wgpu::Buffer,
    v_off: u32,
    row_stride: u32,
    n: u32,
    start_pos: u32,
) -> Result<(), GpuError> {
    let (start, end) = (start_pos as usize, start_pos as usize + n as usize);
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
    if n == 0 {
        kv.set_len(start);
        return Ok(());
    }
    let (heads, hd) = (kv.n_kv_heads() as u32, kv.head_dim() as u32);
    check_extent(
        "attention keys",
        k,
        extent(k_off, n, row_stride, 1, 0, heads * hd),
    )?;
    check_extent(
        "attention values",
        v,
        extent(v_off, n, row_stride, 1, 0, heads * hd),
    )?;
    let units = n as u64 * heads as u64 * hd.div_ceil(64) as u64;
    let groups = crate::groups_1d(rec.gpu(), units.div_ceil(64) as u32);
    let scales = kv.q8_scales_word() as u32;
    rec.dispatch(
        &KV_STORE,
        &[
            n,
            heads,
            hd,
            kv.capacity() as u32,
            start_pos,
            k_off,
            v_off,
            row_stride,
            kv.k_elem().code(),
            kv.v_elem().code(),
            scales,
            scales,
        ],
        &[k, v, kv.k_buffer(), kv.v_buffer()],
        groups,
    )?;
    kv.set_len(end);
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
    let total_units = n * n_kv;
    let units_per_part =
        ((scratch.budget.min(limit) / per_unit).min(total_units as u64) as u32).max(1);
    let part = scratch.at_least(gpu, units_per_part as u64 * per_unit)?;
    let scales = kv.q8_scales_word() as u32;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut unit0 = 0;
    while unit0 < total_units {
        let units = units_per_part.min(total_units - unit0);
        let first = crate::groups_1d(gpu, units * head_blocks * n_chunks);
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
        )?;
        let second = crate::groups_1d(gpu, units * group * (hd / 32));
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
            ],
            &[&part, q, out],
            second,
        )?;
        unit0 += units;
    }
    Ok(())
}
