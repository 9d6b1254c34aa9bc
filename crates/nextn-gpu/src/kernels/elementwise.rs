//! The small kernels between the matrix products of a MoE layer: SwiGLU of the chosen experts,
//! routing, and the weighted sum of the chosen experts (added to the residual); and a plain copy,
//! whose rate is the device's memory bandwidth for the profile.

use super::Kernel;
use crate::{GpuError, Recorder};

kernel!(SWIGLU, "swiglu", "swiglu.wgsl");
kernel!(MOE_ROUTE, "route", "moe.wgsl");
kernel!(MOE_COMBINE, "moe_combine", "moe_combine.wgsl");
kernel!(COPY_WORDS, "copy_words", "copy.wgsl");

pub static KERNELS: &[&Kernel] = &[&SWIGLU, &MOE_ROUTE, &MOE_COMBINE, &COPY_WORDS];

/// Threads per workgroup of every kernel in this file.
const WG: u32 = 256;

/// Workgroups of [`WG`] threads for one thread per value of `n` values (`what` names them in the
/// error when they are more than one dispatch takes).
pub(crate) fn elems(rec: &Recorder, what: &str, n: u64) -> Result<[u32; 3], GpuError> {
    let n = u32::try_from(n).map_err(|_| GpuError::BadTensor {
        tensor: what.into(),
        why: format!("{n} values in one dispatch"),
    })?;
    Ok(crate::groups_1d(rec.gpu(), n.div_ceil(WG)))
}

/// A strided view of `rows` rows: the buffer, the first element and the distance between rows.
#[derive(Clone, Copy)]
pub struct Rows<'b> {
    pub buf: &'b wgpu::Buffer,
    pub off: u32,
    pub stride: u32,
}

impl<'b> Rows<'b> {
    pub fn new(buf: &'b wgpu::Buffer, off: u32, stride: u32) -> Self {
        Rows { buf, off, stride }
    }
}

/// `out[r][c] = SiLU(g[r][c]) · u[r][c]`, `out` contiguous rows of `width`.
pub fn swiglu(
    rec: &mut Recorder,
    g: Rows,
    u: Rows,
    out: &wgpu::Buffer,
    n: u32,
    width: u32,
) -> Result<(), GpuError> {
    let groups = elems(rec, "activations", n as u64 * width as u64)?;
    rec.dispatch(
        &SWIGLU,
        &[n, width, g.off, g.stride, u.off, u.stride],
        &[g.buf, u.buf, out],
        groups,
        // Two values read, one written.
        n as u64 * width as u64 * 12,
    )
}

/// The most experts a MoE layer may have on the device (the routing kernel's workgroup array).
pub const MAX_EXPERTS: usize = 512;

/// For each of `n` rows of router logits (`n_expert` wide, `stride` apart): softmax, the `k` most
/// probable experts (ties to the lower id) into `ids` (`n × k` u32) and their renormalised
/// weights into `weights`.
#[allow(clippy::too_many_arguments)]
pub fn moe_route(
    rec: &mut Recorder,
    logits: &wgpu::Buffer,
    stride: u32,
    ids: &wgpu::Buffer,
    weights: &wgpu::Buffer,
    n: u32,
    n_expert: u32,
    k: u32,
) -> Result<(), GpuError> {
    if n_expert as usize > MAX_EXPERTS || k > n_expert {
        return Err(GpuError::BadTensor {
            tensor: "ffn_gate_inp".into(),
            why: format!("{n_expert} experts, {k} used: the device routes at most {MAX_EXPERTS}"),
        });
    }
    let g = crate::groups_1d(rec.gpu(), n);
    rec.dispatch(
        &MOE_ROUTE,
        &[n, n_expert, k, stride],
        &[logits, ids, weights],
        g,
        // The router's logits read, k ids and weights written.
        n as u64 * (n_expert as u64 * 4 + k as u64 * 8),
    )
}

/// `out[r] = Σ_s weights[r·k+s] · y[r·k+s]` in slot order, plus `sigmoid(gate) · shared[r]` when
/// a shared expert is given (its gate of row `r` at `gate_off + r · gate_stride`), stored or,
/// with `add`, added to what `out` holds; rows of `width`, contiguous.
#[allow(clippy::too_many_arguments)]
pub fn moe_combine(
    rec: &mut Recorder,
    y: &wgpu::Buffer,
    weights: &wgpu::Buffer,
    shared: Option<(&wgpu::Buffer, &wgpu::Buffer, u32, u32)>,
    out: &wgpu::Buffer,
    n: u32,
    k: u32,
    width: u32,
    add: bool,
) -> Result<(), GpuError> {
    let g = elems(rec, "activations", n as u64 * width as u64)?;
    let (s_out, s_gate, gate_off, gate_stride, has) = match shared {
        Some((o, gate, off, stride)) => (o, gate, off, stride, 1),
        None => (y, weights, 0, 0, 0),
    };
    // Each slot's row and weight read, the shared expert's row and gate, the output written
    // (read too when added to).
    let row = width as u64 * 4;
    let bytes = n as u64 * (k as u64 * (row + 4) + has as u64 * (row + 4) + row * (1 + add as u64));
    rec.dispatch(
        &MOE_COMBINE,
        &[n, k, width, has, gate_off, gate_stride, add as u32],
        &[y, weights, s_out, s_gate, out],
        g,
        bytes,
    )
}

/// Copy the first `words` 16-byte words of `src` to `dst`.
pub fn copy_words(
    rec: &mut Recorder,
    src: &wgpu::Buffer,
    dst: &wgpu::Buffer,
    words: u32,
) -> Result<(), GpuError> {
    let bytes = words as u64 * 16;
    if src.size() < bytes || dst.size() < bytes || src == dst {
        return Err(GpuError::BadTensor {
            tensor: "copy".into(),
            why: format!(
                "{words} words between buffers of {} and {} bytes",
                src.size(),
                dst.size()
            ),
        });
    }
    let groups = crate::groups_1d(rec.gpu(), words.div_ceil(WG));
    rec.dispatch(&COPY_WORDS, &[words], &[src, dst], groups, 2 * bytes)
}

/// The device's memory bandwidth in bytes a second, read plus written, as the best of several
/// timed copies of `bytes` (at most the device's binding limit) of data that is not zero;
/// `None` where the device cannot time a submission.
pub fn copy_bandwidth(gpu: &crate::Gpu, bytes: u64) -> Result<Option<f64>, GpuError> {
    if !gpu.has_timestamps() {
        return Ok(None);
    }
    // Whole pieces of 1 MiB: a piece of data is uploaded once and copied over the source.
    const PIECE: u64 = 1 << 20;
    let total = (bytes.min(gpu.max_binding_bytes()) / PIECE).max(1) * PIECE;
    let words = (total / 16).min(u32::MAX as u64) as u32;
    let pattern: Vec<u32> = (0..PIECE / 4)
        .map(|i| (i as u32).wrapping_mul(0x9E37_79B9) | 1)
        .collect();
    let piece = gpu.upload("copy pattern", bytemuck::cast_slice(&pattern))?;
    let src = gpu.buffer("copy source", total)?;
    let dst = gpu.buffer("copy destination", total)?;
    let mut rec = Recorder::new(gpu);
    for at in (0..total).step_by(PIECE as usize) {
        rec.copy(&piece, 0, &src, at, PIECE);
    }
    rec.submit(false)?;
    let mut best: Option<f64> = None;
    for run in 0..6 {
        let mut rec = Recorder::new(gpu);
        copy_words(&mut rec, &src, &dst, words)?;
        let secs = rec.submit(true)?;
        // The first run warms the pipeline and the memory up.
        if let (Some(t), true) = (secs, run > 0) {
            if t > 0.0 {
                let rate = 2.0 * words as f64 * 16.0 / t;
                best = Some(best.map_or(rate, |b: f64| b.max(rate)));
            }
        }
    }
    Ok(best)
}
