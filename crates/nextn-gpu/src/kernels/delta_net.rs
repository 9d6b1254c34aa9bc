//! The gated delta-net layer between its projections: the causal depthwise conv + SiLU with the
//! q/k L2 norms, the gates (β and decay), the delta-rule recurrence and the gated RMSNorm, all
//! over `n` rows of one sequence, with the conv window kept apart so that a verify batch can be
//! committed in part.
//!
//! Layouts (f32 elements, as the CPU's `RecurrentState` keeps them): the conv window is
//! `(Kc−1) × conv_dim`, oldest row first, of raw (pre-conv) projections; conv weights are
//! `conv_dim × Kc`, tap 0 the oldest; the state is `Hv × dk × dv`, `S_m[i][j]` at
//! `(m·dk + i)·dv + j` (i = key dim, j = value dim). A conv row is `[q (Hk·dk) | k (Hk·dk) |
//! v (Hv·dv)]`; v head m reads q/k head `m mod Hk`.
//!
//! Rollback: a verify batch runs [`conv_silu`], [`gates`] and [`recurrence`] from the committed
//! state into a spare one ([`StateIo::Separate`]), keeping its raw rows, conv rows, β and decay.
//! Keeping all `n` rows swaps the two state buffers and advances the window by `n`; keeping
//! `k < n` replays [`recurrence`] in place ([`StateIo::InPlace`]) on the committed state over the
//! first `k` kept rows and advances the window by `k`. Every kernel's result for a row depends
//! only on that row and the state before it, so either way the state is the one decoding the
//! kept rows one by one would have left, bit for bit.

use super::Kernel;
use crate::{GpuError, Recorder};

pub static CONV_SILU: Kernel = Kernel {
    name: "delta_net_conv_silu",
    source: include_str!("../shaders/delta_net_conv.wgsl"),
    entry: "delta_net_conv_silu",
};

pub static WINDOW_ADVANCE: Kernel = Kernel {
    name: "delta_net_window_advance",
    source: include_str!("../shaders/delta_net_window.wgsl"),
    entry: "delta_net_window_advance",
};

pub static GATES: Kernel = Kernel {
    name: "delta_net_gates",
    source: include_str!("../shaders/delta_net_gates.wgsl"),
    entry: "delta_net_gates",
};

/// The recurrence from one state buffer into another.
pub static RECURRENCE: Kernel = Kernel {
    name: "delta_net_recurrence",
    source: concat!(
        include_str!("../shaders/delta_net_state_separate.wgsl"),
        include_str!("../shaders/delta_net_recurrence.wgsl")
    ),
    entry: "delta_net_recurrence",
};

/// The same recurrence on one state buffer, updated in place: a buffer cannot be bound both
/// read-only and read-write in one dispatch.
pub static RECURRENCE_IN_PLACE: Kernel = Kernel {
    name: "delta_net_recurrence_in_place",
    source: concat!(
        include_str!("../shaders/delta_net_state_in_place.wgsl"),
        include_str!("../shaders/delta_net_recurrence.wgsl")
    ),
    entry: "delta_net_recurrence",
};

pub static GATED_NORM: Kernel = Kernel {
    name: "delta_net_gated_norm",
    source: include_str!("../shaders/delta_net_gated_norm.wgsl"),
    entry: "delta_net_gated_norm",
};

pub static KERNELS: &[&Kernel] = &[
    &CONV_SILU,
    &WINDOW_ADVANCE,
    &GATES,
    &RECURRENCE,
    &RECURRENCE_IN_PLACE,
    &GATED_NORM,
];

/// The largest key head size the recurrence holds (4 parts of 32 rows per value column).
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

/// Where the recurrence reads its state and where it leaves the state after the last row.
#[derive(Clone, Copy, Debug)]
pub enum StateIo<'a> {
    /// Read and update one buffer.
    InPlace(&'a wgpu::Buffer),
    /// Read `input` (left as it was) and write `output`; the same buffer twice is
    /// [`StateIo::InPlace`].
    Separate {
        input: &'a wgpu::Buffer,
        output: &'a wgpu::Buffer,
    },
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

/// Invocation groups of `wg` for `count` invocations.
fn groups_for(rec: &Recorder, count: u32, wg: u32) -> [u32; 3] {
    crate::groups_1d(rec.gpu(), count.div_ceil(wg))
}

/// `out[t] = SiLU(Σ_j x_{t+j} ⊙ W[:, j])` over the combined rows `x = [window, raw rows 0..n]`
/// (so row t sees the `Kc−1` rows before it), then every q and k head of `out[t]` (the first
/// `2·Hk` heads of `dk`) scaled to `x / max(‖x‖, eps)`. `out` is `n × conv_dim`, packed; the
/// window is read, not changed ([`conv_window_advance`] moves it). `conv_w` is `conv_dim × Kc`.
#[allow(clippy::too_many_arguments)]
pub fn conv_silu(
    rec: &mut Recorder,
    shape: &DeltaNetShape,
    raw: Rows,
    n: u32,
    window: &wgpu::Buffer,
    conv_w: &wgpu::Buffer,
    eps: f32,
    out: &wgpu::Buffer,
) -> Result<(), GpuError> {
    shape.check()?;
    if n == 0 {
        return Ok(());
    }
    let conv_dim = shape.conv_dim();
    need_rows(&raw, n, conv_dim, "delta-net raw projections")?;
    need(window, shape.window_len() as u64, "delta-net conv window")?;
    need(
        conv_w,
        conv_dim as u64 * shape.kernel as u64,
        "ssm_conv1d.weight",
    )?;
    need(out, n as u64 * conv_dim as u64, "delta-net conv output")?;
    let heads = 2 * shape.k_heads + shape.v_heads;
    let groups = crate::groups_1d(rec.gpu(), n * heads);
    rec.dispatch(
        &CONV_SILU,
        &[
            n,
            conv_dim,
            shape.kernel,
            raw.offset,
            raw.stride,
            shape.k_heads,
            shape.v_heads,
            shape.key_head,
            shape.value_head,
            eps.to_bits(),
        ],
        &[raw.buffer, window, conv_w, out],
        groups,
    )
}

/// `window` := the last `Kc−1` rows of `[window, raw rows 0..keep]`, in place: the window after
/// `keep` more rows of the sequence. `keep == 0` leaves it.
pub fn conv_window_advance(
    rec: &mut Recorder,
    shape: &DeltaNetShape,
    window: &wgpu::Buffer,
    raw: Rows,
    keep: u32,
) -> Result<(), GpuError> {
    shape.check()?;
    if keep == 0 || shape.kernel == 1 {
        return Ok(());
    }
    let conv_dim = shape.conv_dim();
    need_rows(&raw, keep, conv_dim, "delta-net raw projections")?;
    need(window, shape.window_len() as u64, "delta-net conv window")?;
    let groups = groups_for(rec, conv_dim, 64);
    rec.dispatch(
        &WINDOW_ADVANCE,
        &[conv_dim, shape.kernel, keep, raw.offset, raw.stride],
        &[window, raw.buffer],
        groups,
    )
}

/// Per row t and v head m (`n × Hv` each, packed): `beta = sigmoid(b)`,
/// `decay = exp(softplus(alpha + dt_bias[m]) · a[m])` (softplus is `x` above 20).
/// `b` and `alpha` are rows of at least `Hv` values.
#[allow(clippy::too_many_arguments)]
pub fn gates(
    rec: &mut Recorder,
    shape: &DeltaNetShape,
    b: Rows,
    alpha: Rows,
    dt_bias: &wgpu::Buffer,
    a: &wgpu::Buffer,
    n: u32,
    beta_out: &wgpu::Buffer,
    decay_out: &wgpu::Buffer,
) -> Result<(), GpuError> {
    shape.check()?;
    if n == 0 {
        return Ok(());
    }
    let hv = shape.v_heads;
    need_rows(&b, n, hv, "delta-net beta projection")?;
    need_rows(&alpha, n, hv, "delta-net alpha projection")?;
    need(dt_bias, hv as u64, "ssm_dt.bias")?;
    need(a, hv as u64, "ssm_a")?;
    need(beta_out, n as u64 * hv as u64, "delta-net beta")?;
    need(decay_out, n as u64 * hv as u64, "delta-net decay")?;
    let groups = groups_for(rec, n * hv, 64);
    rec.dispatch(
        &GATES,
        &[n, hv, b.offset, b.stride, alpha.offset, alpha.stride],
        &[b.buffer, alpha.buffer, dt_bias, a, beta_out, decay_out],
        groups,
    )
}

/// The delta rule over `n` rows, in order, for every v head m with `g = m mod Hk`:
/// `S ← decay·S; u = Sᵀk_g; δ = β(v_m − u); S += k_g δᵀ; o_m = Sᵀq_g / √dk`. `conv` holds the
/// rows' `[q | k | v]` after the conv, SiLU and L2 norms (`n × conv_dim`, packed), `beta` and
/// `decay` are `n × Hv`, `out` gets `o`, `n × Hv·dv`. The state after the last row is left in
/// the output state (with `n == 0` and [`StateIo::Separate`], a copy of the input). In place or
/// not, the arithmetic is the same, and so are the bits.
#[allow(clippy::too_many_arguments)]
pub fn recurrence(
    rec: &mut Recorder,
    shape: &DeltaNetShape,
    state: StateIo,
    conv: &wgpu::Buffer,
    beta: &wgpu::Buffer,
    decay: &wgpu::Buffer,
    n: u32,
    out: &wgpu::Buffer,
) -> Result<(), GpuError> {
    shape.check()?;
    let state_len = shape.state_len() as u64;
    let state = match state {
        StateIo::Separate { input, output } if input == output => StateIo::InPlace(input),
        other => other,
    };
    let (kernel, states): (&Kernel, Vec<&wgpu::Buffer>) = match state {
        StateIo::InPlace(s) => {
            if n == 0 {
                return Ok(());
            }
            need(s, state_len, "delta-net state")?;
            (&RECURRENCE_IN_PLACE, vec![s])
        }
        StateIo::Separate { input, output } => {
            need(input, state_len, "delta-net state (input)")?;
            need(output, state_len, "delta-net state (output)")?;
            (&RECURRENCE, vec![input, output])
        }
    };
    let rows = n as u64;
    need(conv, rows * shape.conv_dim() as u64, "delta-net conv rows")?;
    need(beta, rows * shape.v_heads as u64, "delta-net beta")?;
    need(decay, rows * shape.v_heads as u64, "delta-net decay")?;
    // Nothing is written to `out` for no rows, but it is bound all the same.
    need(
        out,
        rows * shape.value_dim() as u64,
        "delta-net recurrence output",
    )?;
    let tiles = shape.value_head.div_ceil(32);
    let groups = crate::groups_1d(rec.gpu(), shape.v_heads * tiles);
    let scale = 1.0 / (shape.key_head as f32).sqrt();
    let mut buffers = states;
    buffers.extend([conv, beta, decay, out]);
    rec.dispatch(
        kernel,
        &[
            n,
            shape.k_heads,
            shape.v_heads,
            shape.key_head,
            shape.value_head,
            shape.conv_dim(),
            scale.to_bits(),
        ],
        &buffers,
        groups,
    )
}

/// `y_m = RMSNorm(o_m; norm_w) ⊙ SiLU(z_m)` per row and v head: `o` and `y` are `n × Hv·dv`,
/// packed; `z` rows hold at least `Hv·dv` values; `norm_w` is `dv` long, shared by the heads.
#[allow(clippy::too_many_arguments)]
pub fn gated_norm(
    rec: &mut Recorder,
    shape: &DeltaNetShape,
    o: &wgpu::Buffer,
    z: Rows,
    norm_w: &wgpu::Buffer,
    n: u32,
    eps: f32,
    y: &wgpu::Buffer,
) -> Result<(), GpuError> {
    shape.check()?;
    if n == 0 {
        return Ok(());
    }
    let value_dim = shape.value_dim();
    let len = n as u64 * value_dim as u64;
    need(o, len, "delta-net recurrence output")?;
    need_rows(&z, n, value_dim, "delta-net gate projection")?;
    need(norm_w, shape.value_head as u64, "ssm_norm.weight")?;
    need(y, len, "delta-net gated norm output")?;
    let groups = crate::groups_1d(rec.gpu(), n * shape.v_heads);
    rec.dispatch(
        &GATED_NORM,
        &[
            n,
            shape.v_heads,
            shape.value_head,
            z.offset,
            z.stride,
            eps.to_bits(),
        ],
        &[o, z.buffer, norm_w, y],
        groups,
    )
}
