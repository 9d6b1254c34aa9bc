//! The gated delta-net layer between its projections, in two dispatches over `n` rows of one
//! sequence: [`step`] (the causal depthwise conv + SiLU, the q/k L2 norms, the gates β and decay,
//! and the delta-rule recurrence) and [`gated_norm`] (the gated RMSNorm, its output quantized for
//! the output projection on the way).
//!
//! Layouts (f32 elements, as the CPU's `RecurrentState` keeps them): the conv window is
//! `(Kc−1) × conv_dim`, oldest row first, of raw (pre-conv) projections; conv weights are
//! `conv_dim × Kc`, tap 0 the oldest; the state is `Hv × dk × dv`, `S_m[i][j]` at
//! `(m·dk + i)·dv + j` (i = key dim, j = value dim). A conv row is `[q (Hk·dk) | k (Hk·dk) |
//! v (Hv·dv)]`; v head m reads q/k head `m mod Hk`.
//!
//! Rollback: a verify batch runs [`step`] from the committed state into the other copy and from
//! the committed window into the other copy ([`StepIo`]), keeping the rows' raw projections.
//! Keeping all `n` rows makes the other copies the committed ones; keeping `k < n` replays
//! [`step`] in place on the committed state over the first `k` kept rows, from the kept raw
//! rows, its window into the other copy (then committed). A row's result depends only on that row, the window
//! and the state before it, so either way the state is the one decoding the kept rows one by one
//! would have left, bit for bit.

use super::matvec::{quant_layout, ActBlocks, QuantLayout, QuantOut};
use super::Kernel;
use crate::{Gpu, GpuError, Recorder};

/// The conv, norms, gates and recurrence of a delta-net layer's rows.
pub static STEP: Kernel = Kernel {
    name: "delta_net_step",
    source: include_str!("../shaders/delta_net_step.wgsl"),
    entry: "delta_net_step",
};

/// The gated norm, quantized for the output projection.
pub static GATED_NORM: Kernel = Kernel {
    name: "delta_net_gated_norm_quant",
    source: concat!(
        include_str!("../shaders/quant_common.wgsl"),
        include_str!("../shaders/delta_net_gated_norm_quant.wgsl")
    ),
    entry: "delta_net_gated_norm_quant",
};

pub static KERNELS: &[&Kernel] = &[&STEP, &GATED_NORM];

/// The largest key head size the recurrence holds (8 parts of 16 key dims per value column).
pub const MAX_KEY_HEAD: u32 = 128;

/// A delta-net layer's sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaNetShape {
    /// Hk: q/k heads.
    pub k_heads: u32,
    /// Hv: v heads (a multiple of Hk in the models; any count works here).
    pub v_heads: u32,
    /// dk: q/k head size.
    pub key_head: u32,
    /// dv: v head size.
    pub value_head: u32,
    /// Kc: conv taps (1 or more).
    pub kernel: u32,
}

impl DeltaNetShape {
    pub fn key_dim(&self) -> u32 {
        self.k_heads * self.key_head
    }

    pub fn value_dim(&self) -> u32 {
        self.v_heads * self.value_head
    }

    /// Channels of a conv row: q | k | v.
    pub fn conv_dim(&self) -> u32 {
        2 * self.key_dim() + self.value_dim()
    }

    /// Elements of the conv window, `(Kc−1) × conv_dim`.
    pub fn window_len(&self) -> u32 {
        self.kernel.saturating_sub(1) * self.conv_dim()
    }

    /// Elements of the recurrent state, `Hv × dk × dv`.
    pub fn state_len(&self) -> u32 {
        self.v_heads * self.key_head * self.value_head
    }

    fn check(&self) -> Result<(), GpuError> {
        let bad = |why: String| {
            Err(GpuError::BadTensor {
                tensor: "delta-net shape".into(),
                why,
            })
        };
        if self.k_heads == 0 || self.v_heads == 0 || self.key_head == 0 || self.value_head == 0 {
            return bad(format!("a zero size in {self:?}"));
        }
        if self.kernel == 0 {
            return bad("a conv with no taps".into());
        }
        if self.key_head > MAX_KEY_HEAD {
            return bad(format!(
                "key head size {} over the recurrence kernel's {MAX_KEY_HEAD}",
                self.key_head
            ));
        }
        Ok(())
    }
}

/// `n` rows of `width` values in `buffer`, row r at `offset + r·stride` (f32 elements).
#[derive(Clone, Copy, Debug)]
pub struct Rows<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub offset: u32,
    pub stride: u32,
}

impl<'a> Rows<'a> {
    /// Rows packed one after another from the start of `buffer`.
    pub fn packed(buffer: &'a wgpu::Buffer, width: u32) -> Self {
        Rows {
            buffer,
            offset: 0,
            stride: width,
        }
    }
}

/// Fail unless `buf` holds `elems` f32 values.
fn need(buf: &wgpu::Buffer, elems: u64, what: &str) -> Result<(), GpuError> {
    if buf.size() < elems * 4 {
        return Err(GpuError::BadTensor {
            tensor: what.to_string(),
            why: format!(
                "needs {elems} f32 values, the buffer holds {}",
                buf.size() / 4
            ),
        });
    }
    Ok(())
}

fn need_rows(rows: &Rows, n: u32, width: u32, what: &str) -> Result<(), GpuError> {
    if n == 0 {
        return Ok(());
    }
    let end = rows.offset as u64 + (n as u64 - 1) * rows.stride as u64 + width as u64;
    need(rows.buffer, end, what)
}

/// A layer's small weights, all in one buffer: the conv weights (`conv_dim × Kc`) from `conv`,
/// `dt_bias` (`Hv`) from `dt_bias`, `a` (`Hv`) from `a` (element offsets).
#[derive(Clone, Copy, Debug)]
pub struct StepWeights<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub conv: u32,
    pub dt_bias: u32,
    pub a: u32,
}

/// Where [`step`] reads and writes a sequence's state and conv window: both copies of each in one
/// buffer (element offsets), so that a sequence binds the same buffers whichever copy is the
/// committed one.
pub struct StepIo<'a> {
    pub states: &'a wgpu::Buffer,
    /// The state before the first row.
    pub state: u32,
    /// Where the state after the last row goes: `state` (in place), or the other copy (a verify
    /// pass, which leaves the committed state as it was).
    pub state_out: u32,
    pub windows: &'a wgpu::Buffer,
    /// The conv window before the first row (read only).
    pub window: u32,
    /// Where the window after the last row goes (the other copy), or nowhere.
    pub window_out: Option<u32>,
    /// Where the rows' raw projections go for a replay: `[q|k|v (conv_dim) | β (Hv) | α (Hv)]`
    /// a row (`None`: nowhere).
    pub keep: Option<&'a wgpu::Buffer>,
}

/// Raw projection rows: `[q|k|v]` from the rows' start, β of head m at `beta_col + m` and α at
/// `alpha_col + m` of the same row.
#[derive(Clone, Copy, Debug)]
pub struct RawRows<'a> {
    pub rows: Rows<'a>,
    pub beta_col: u32,
    pub alpha_col: u32,
}

/// The delta net over `n` rows, in order, for every v head m with `g = m mod Hk`: the causal conv
/// of the combined rows `[window, raw rows 0..n]` (row t sees the `Kc−1` rows before it; taps
/// summed oldest first) and its SiLU, q and k of head g scaled to `x / max(‖x‖, eps)`, `β =
/// sigmoid(b_m)`, `decay = exp(softplus(α_m + dt_bias_m) · a_m)` (softplus is `x` above 20), then
/// `S ← decay·S; u = Sᵀk; δ = β(v_m − u); S += k δᵀ; o_m = Sᵀq / √dk`; `o_m` of row t goes to
/// `out.offset + t·out.stride + m·dv`. The state and window after the last row go where `io`
/// says; in place or not the arithmetic is the same, and so are the bits.
#[allow(clippy::too_many_arguments)]
pub fn step(
    rec: &mut Recorder,
    shape: &DeltaNetShape,
    raw: &RawRows,
    weights: &StepWeights,
    io: &StepIo,
    n: u32,
    eps: f32,
    out: Rows,
) -> Result<(), GpuError> {
    shape.check()?;
    if n == 0 {
        return Ok(());
    }
    let conv_dim = shape.conv_dim();
    let hv = shape.v_heads;
    need_rows(&raw.rows, n, conv_dim, "delta-net raw projections")?;
    for (col, what) in [(raw.beta_col, "beta"), (raw.alpha_col, "alpha")] {
        let rows = Rows {
            offset: raw.rows.offset + col,
            ..raw.rows
        };
        need_rows(&rows, n, hv, &format!("delta-net {what} projection"))?;
    }
    let (sl, wl) = (shape.state_len(), shape.window_len());
    let apart = |a: u32, b: u32, len: u32| a == b || a + len <= b || b + len <= a;
    need(
        io.states,
        io.state.max(io.state_out) as u64 + sl as u64,
        "delta-net states",
    )?;
    if !apart(io.state, io.state_out, sl) {
        return Err(GpuError::BadTensor {
            tensor: "delta-net state".into(),
            why: "the state after the rows overlaps the state before them".into(),
        });
    }
    let window_out = io.window_out.unwrap_or(io.window);
    need(
        io.windows,
        io.window.max(window_out) as u64 + wl as u64,
        "delta-net conv windows",
    )?;
    if io.window_out == Some(io.window) || !apart(io.window, window_out, wl) {
        return Err(GpuError::BadTensor {
            tensor: "delta-net conv window".into(),
            why: "the window after the rows needs room apart from the window".into(),
        });
    }
    let w = weights;
    need(
        w.buffer,
        (w.conv + conv_dim * shape.kernel)
            .max(w.dt_bias + hv)
            .max(w.a + hv) as u64,
        "delta-net weights",
    )?;
    need_rows(
        &out,
        n,
        hv * shape.value_head,
        "delta-net recurrence output",
    )?;
    let keep_stride = conv_dim + 2 * hv;
    if let Some(k) = io.keep {
        need(k, n as u64 * keep_stride as u64, "delta-net kept rows")?;
    }
    let gpu = rec.gpu();
    let unused = gpu.scratch(UNUSED, 16)?;
    let flags = (io.keep.is_some() as u32) << 1 | (io.window_out.is_some() as u32) << 2;
    let tiles = shape.value_head.div_ceil(STEP_COLS);
    let groups = crate::groups_1d(gpu, hv * tiles);
    let scale = 1.0 / (shape.key_head as f32).sqrt();
    // The recurrent state and the conv window read and written once, the conv weights, the
    // rows in, their outputs (and the kept rows) out.
    let (rows, w4) = (n as u64, 4u64);
    let state = sl as u64 * w4 * 2;
    let window = wl as u64 * w4 * 2 + conv_dim as u64 * shape.kernel as u64 * w4;
    let rows_in = rows * (conv_dim as u64 + 2 * hv as u64) * w4;
    let rows_out = rows * hv as u64 * shape.value_head as u64 * w4
        + io.keep.map_or(0, |_| rows * keep_stride as u64 * w4);
    rec.dispatch(
        &STEP,
        &[
            n,
            shape.k_heads,
            hv,
            shape.key_head,
            shape.value_head,
            shape.kernel,
            conv_dim,
            raw.rows.offset,
            raw.rows.stride,
            raw.beta_col,
            raw.alpha_col,
            w.conv,
            w.dt_bias,
            w.a,
            out.offset,
            out.stride,
            keep_stride,
            flags,
            io.state,
            io.state_out,
            io.window,
            window_out,
            eps.to_bits(),
            scale.to_bits(),
        ],
        &step_buffers(raw.rows.buffer, w, io, out.buffer, &unused),
        groups,
        state + window + rows_in + rows_out,
    )
}

/// The scratch buffer bound where a [`step`] keeps no rows.
const UNUSED: &str = "unused-2";

/// What a [`step`] binds, in the shader's order.
fn step_buffers<'a>(
    raw: &'a wgpu::Buffer,
    weights: &StepWeights<'a>,
    io: &StepIo<'a>,
    out: &'a wgpu::Buffer,
    unused: &'a wgpu::Buffer,
) -> [&'a wgpu::Buffer; 6] {
    [
        raw,
        weights.buffer,
        io.states,
        io.windows,
        io.keep.unwrap_or(unused),
        out,
    ]
}

/// Make the bind group of a [`step`] reading raw rows from `raw` and writing to `out`, ahead of
/// it: a verify pass makes the one its commit's replay will use, so a sequence's first partial
/// acceptance creates nothing.
pub fn prepare_step(
    gpu: &Gpu,
    raw: &wgpu::Buffer,
    weights: &StepWeights,
    io: &StepIo,
    out: &wgpu::Buffer,
) -> Result<(), GpuError> {
    let unused = gpu.scratch(UNUSED, 16)?;
    gpu.bind_ahead(&STEP, &step_buffers(raw, weights, io, out, &unused))
}

/// Value columns a [`step`] workgroup takes (`COLS` in the shader).
const STEP_COLS: u32 = 16;

/// `y_m = RMSNorm(o_m; norm_w) ⊙ SiLU(z_m)` per row and v head (`Hv·dv` values a row), written to
/// `y` as f32 and, into `quant`'s buffers, quantized for the output projection; `norm_w` is `dv`
/// long, shared by the heads.
#[allow(clippy::too_many_arguments)]
pub fn gated_norm(
    rec: &mut Recorder,
    shape: &DeltaNetShape,
    o: Rows,
    z: Rows,
    norm_w: &wgpu::Buffer,
    n: u32,
    eps: f32,
    y: Rows,
    quant: &QuantOut,
) -> Result<(), GpuError> {
    shape.check()?;
    if n == 0 {
        return Ok(());
    }
    let value_dim = shape.value_dim();
    need_rows(&o, n, value_dim, "delta-net recurrence output")?;
    need_rows(&z, n, value_dim, "delta-net gate projection")?;
    need(norm_w, shape.value_head as u64, "ssm_norm.weight")?;
    need_rows(&y, n, value_dim, "delta-net gated norm output")?;
    let width = value_dim as usize;
    let layout = |b: Option<&wgpu::Buffer>, kind: ActBlocks| -> Result<QuantLayout, GpuError> {
        match b {
            None => Ok(QuantLayout {
                stride: 0,
                d_off: 0,
                blocks: 0,
            }),
            Some(buf) => {
                let l = quant_layout(width, kind).ok_or_else(|| GpuError::BadTensor {
                    tensor: "delta-net gated norm output".into(),
                    why: format!("{width} values a row are not whole {kind:?} blocks"),
                })?;
                need(
                    buf,
                    (quant.row0 + n) as u64 * l.stride as u64,
                    "quantized rows",
                )?;
                Ok(l)
            }
        }
    };
    let (l0, lk) = (
        layout(quant.q8_0, ActBlocks::Q8_0)?,
        layout(quant.q8k, ActBlocks::Q8K)?,
    );
    let flags = (quant.q8_0.is_some() as u32) << 1 | (quant.q8k.is_some() as u32) << 2;
    let gpu = rec.gpu();
    let unused = gpu.scratch("unused-3", 16)?;
    let groups = crate::groups_1d(gpu, n);
    rec.dispatch(
        &GATED_NORM,
        &[
            n,
            shape.v_heads,
            shape.value_head,
            o.offset,
            o.stride,
            z.offset,
            z.stride,
            y.offset,
            y.stride,
            flags,
            quant.row0,
            l0.stride,
            l0.d_off,
            lk.stride,
            lk.d_off,
            eps.to_bits(),
        ],
        &[
            o.buffer,
            z.buffer,
            norm_w,
            y.buffer,
            quant.q8_0.unwrap_or(&unused),
            quant.q8k.unwrap_or(&unused),
        ],
        groups,
        // The recurrence's output and the gate read, the normed rows (and their quantized
        // copies) written.
        n as u64 * (3 * value_dim as u64 * 4 + (l0.stride as u64 + lk.stride as u64) * 4)
            + shape.value_head as u64 * 4,
    )
}
