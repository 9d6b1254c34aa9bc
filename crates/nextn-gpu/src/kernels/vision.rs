//! The kernels of a ViT block that the language model has no use for: layer norm with a bias,
//! a bias added to rows (with GELU, or other rows added), 2D rotary positions over a patch
//! grid, and full (non-causal) attention. The products are [`crate::kernels::matvec`]'s.
//!
//! Offsets and strides are in f32 elements of the buffers they index.

use super::Kernel;
use crate::{GpuError, Recorder};

kernel!(LAYER_NORM, "layer_norm", "layer_norm.wgsl");
kernel!(BIAS_ACT, "bias_act", "bias_act.wgsl");
kernel!(ROPE_VISION, "rope_vision", "rope_vision.wgsl");
kernel!(ATTENTION_FULL, "attention_full", "attention_full.wgsl");

pub static KERNELS: &[&Kernel] = &[&LAYER_NORM, &BIAS_ACT, &ROPE_VISION, &ATTENTION_FULL];

/// The widest head [`attention_full`] takes (`D_MAX` in its shader).
pub const MAX_HEAD_DIM: u32 = 128;
/// Queries an [`attention_full`] workgroup takes (`QB`).
const QUERIES_PER_GROUP: u32 = 8;

fn bad(what: &str, why: String) -> GpuError {
    GpuError::BadTensor {
        tensor: what.to_string(),
        why,
    }
}

/// Fail unless `rows` rows of `width` values from `off`, `stride` apart, lie in `buf`.
fn check_rows(
    what: &str,
    buf: &wgpu::Buffer,
    off: u32,
    stride: u32,
    rows: u32,
    width: u32,
) -> Result<(), GpuError> {
    if rows == 0 {
        return Ok(());
    }
    let end = off as u64 + (rows as u64 - 1) * stride as u64 + width as u64;
    if end * 4 > buf.size() {
        return Err(bad(
            what,
            format!(
                "{rows} rows of {width} reach element {end} of a buffer of {} elements",
                buf.size() / 4
            ),
        ));
    }
    Ok(())
}

/// `y[r] = (x[r] - mean) / sqrt(var + eps) · w + b` for `rows` rows of `width` (`x` rows
/// `x_stride` apart from `x_off`, `y` likewise), mean and variance f32 trees over the row.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm(
    rec: &mut Recorder,
    x: (&wgpu::Buffer, u32, u32),
    rows: u32,
    width: u32,
    w: &wgpu::Buffer,
    b: &wgpu::Buffer,
    y: (&wgpu::Buffer, u32, u32),
    eps: f32,
) -> Result<(), GpuError> {
    check_rows("layer_norm input", x.0, x.1, x.2, rows, width)?;
    check_rows("layer_norm output", y.0, y.1, y.2, rows, width)?;
    check_rows("layer_norm weight", w, 0, 0, 1, width)?;
    check_rows("layer_norm bias", b, 0, 0, 1, width)?;
    let groups = crate::groups_1d(rec.gpu(), rows);
    // The rows read twice over (the second time from cache), weight and bias, the rows written.
    let bytes = rows as u64 * width as u64 * 8 + width as u64 * 8;
    rec.dispatch(
        &LAYER_NORM,
        &[rows, width, x.1, x.2, y.1, y.2, eps.to_bits()],
        &[x.0, w, b, y.0],
        groups,
        bytes,
    )
}

/// What [`bias_act`] does after adding the bias.
#[derive(Clone, Copy, Debug, Default)]
pub struct BiasThen<'b> {
    /// Rows added after the bias: buffer, first element, distance between rows.
    pub add: Option<(&'b wgpu::Buffer, u32, u32)>,
    /// ggml's GELU (the f16 tanh form) last.
    pub gelu: bool,
}

/// `y[r][c] = act((y[r][c] + b[c]) + add[r][c])` in place for `rows` rows of `width` (`y` rows
/// `stride` apart from `off`), the added rows and the GELU as `then` says.
#[allow(clippy::too_many_arguments)]
pub fn bias_act(
    rec: &mut Recorder,
    y: &wgpu::Buffer,
    off: u32,
    stride: u32,
    rows: u32,
    width: u32,
    b: &wgpu::Buffer,
    then: BiasThen,
) -> Result<(), GpuError> {
    check_rows("bias rows", y, off, stride, rows, width)?;
    check_rows("bias", b, 0, 0, 1, width)?;
    if let Some((e, e_off, e_stride)) = then.add {
        check_rows("added rows", e, e_off, e_stride, rows, width)?;
        if e == y {
            return Err(bad("added rows", "in the buffer they are added to".into()));
        }
    }
    let (e, e_off, e_stride) = then.add.unwrap_or((b, 0, 0));
    let flags = then.gelu as u32 | (then.add.is_some() as u32) << 1;
    let n = rows as u64 * width as u64;
    let groups = super::elementwise::elems(rec, "bias rows", n)?;
    // The rows read and written, the added rows read.
    let bytes = n * 4 * (2 + then.add.is_some() as u64) + width as u64 * 4;
    rec.dispatch(
        &BIAS_ACT,
        &[rows, width, off, stride, flags, e_off, e_stride],
        &[y, b, e],
        groups,
        bytes,
    )
}

/// Where the heads of fused qkv rows sit: `rows` rows from `off`, `stride` apart, `n_head` heads
/// of `d` values in each of the q, k and v parts, the k part `k_off` and the v part `v_off`
/// elements after a row's q part.
#[derive(Clone, Copy, Debug)]
pub struct QkvRows<'b> {
    pub buf: &'b wgpu::Buffer,
    pub off: u32,
    pub stride: u32,
    pub rows: u32,
    pub n_head: u32,
    pub d: u32,
    pub k_off: u32,
    pub v_off: u32,
}

impl QkvRows<'_> {
    fn check(&self, what: &str) -> Result<(), GpuError> {
        let e = self.n_head * self.d;
        let width = self.v_off.max(self.k_off) + e;
        check_rows(what, self.buf, self.off, self.stride, self.rows, width)?;
        if self.d == 0 || !self.d.is_multiple_of(4) {
            return Err(bad(
                what,
                format!("heads of {} values (a multiple of 4 is needed)", self.d),
            ));
        }
        Ok(())
    }
}

/// The 2D rotary positions of the vision tower on the q and k parts of `qkv` in place: rows are
/// patches in merge order of a grid `nx` patches wide (even); `theta_scale` is
/// `base^(-2 / (d/2))` as the CPU computes it.
pub fn rope_vision(
    rec: &mut Recorder,
    qkv: &QkvRows,
    nx: u32,
    theta_scale: f32,
) -> Result<(), GpuError> {
    qkv.check("rope_vision rows")?;
    if nx == 0 || !nx.is_multiple_of(2) {
        return Err(bad("rope_vision grid", format!("{nx} patches wide")));
    }
    let n = qkv.rows as u64 * qkv.n_head as u64 * (qkv.d / 2) as u64;
    let groups = super::elementwise::elems(rec, "rope_vision rows", n)?;
    // The q and k parts read and written.
    let bytes = qkv.rows as u64 * (qkv.n_head * qkv.d) as u64 * 16;
    rec.dispatch(
        &ROPE_VISION,
        &[
            qkv.rows,
            qkv.n_head,
            qkv.d,
            qkv.off,
            qkv.stride,
            qkv.k_off,
            nx,
            theta_scale.to_bits(),
        ],
        &[qkv.buf],
        groups,
        bytes,
    )
}

/// `out[r][h] = Σ_j softmax_j(scale · q_r,h · k_j,h) v_j,h` over every row `j` of `qkv` (no
/// mask), heads side by side in the output rows (`out` rows `out_stride` apart from `out_off`).
pub fn attention_full(
    rec: &mut Recorder,
    qkv: &QkvRows,
    scale: f32,
    out: (&wgpu::Buffer, u32, u32),
) -> Result<(), GpuError> {
    qkv.check("attention_full rows")?;
    if qkv.d > MAX_HEAD_DIM {
        return Err(bad(
            "attention_full rows",
            format!("heads of {} values, over {MAX_HEAD_DIM}", qkv.d),
        ));
    }
    let e = qkv.n_head * qkv.d;
    check_rows("attention_full output", out.0, out.1, out.2, qkv.rows, e)?;
    if out.0 == qkv.buf {
        return Err(bad("attention_full output", "in the qkv buffer".into()));
    }
    let blocks = qkv.rows.div_ceil(QUERIES_PER_GROUP) as u64 * qkv.n_head as u64;
    let blocks = u32::try_from(blocks)
        .map_err(|_| bad("attention_full rows", format!("{blocks} workgroups")))?;
    let groups = crate::groups_1d(rec.gpu(), blocks);
    // Each head's q, k and v once, the output written.
    let bytes = qkv.rows as u64 * e as u64 * 16;
    rec.dispatch(
        &ATTENTION_FULL,
        &[
            qkv.rows,
            qkv.n_head,
            qkv.d,
            qkv.off,
            qkv.stride,
            qkv.k_off,
            qkv.v_off,
            out.1,
            out.2,
            scale.to_bits(),
        ],
        &[qkv.buf, out.0],
        groups,
        bytes,
    )
}
