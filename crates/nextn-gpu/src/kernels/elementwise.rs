//! The small kernels between the matrix products: residual adds, strided copies and gathers,
//! SwiGLU, a tensor's scale, MoE routing and the weighted sum of the chosen experts.

use super::Kernel;
use crate::{GpuError, Recorder};

macro_rules! kernel {
    ($id:ident, $name:literal, $file:literal) => {
        pub static $id: Kernel = Kernel {
            name: $name,
            source: include_str!(concat!("../shaders/", $file)),
            entry: $name,
        };
    };
}

kernel!(ADD_ROWS, "add_rows", "add.wgsl");
kernel!(COPY_ROWS, "copy_rows", "copy.wgsl");
kernel!(GATHER_ROWS, "gather_rows", "gather.wgsl");
kernel!(SWIGLU, "swiglu", "swiglu.wgsl");
kernel!(SCALE, "scale", "scale.wgsl");
kernel!(MOE_ROUTE, "route", "moe.wgsl");
kernel!(MOE_COMBINE, "moe_combine", "moe_combine.wgsl");

pub static KERNELS: &[&Kernel] = &[
    &ADD_ROWS,
    &COPY_ROWS,
    &GATHER_ROWS,
    &SWIGLU,
    &SCALE,
    &MOE_ROUTE,
    &MOE_COMBINE,
];

/// Threads per workgroup of every kernel in this file.
const WG: u32 = 256;

fn elems(rec: &Recorder, n: u64) -> Result<[u32; 3], GpuError> {
    let n = u32::try_from(n).map_err(|_| GpuError::BadTensor {
        tensor: "activations".into(),
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

/// `a[r][c] += b[r][c]` for `n` rows of `width`.
pub fn add_rows(rec: &mut Recorder, a: Rows, b: Rows, n: u32, width: u32) -> Result<(), GpuError> {
    let g = elems(rec, n as u64 * width as u64)?;
    rec.dispatch(
        &ADD_ROWS,
        &[n, width, a.off, b.off, a.stride, b.stride],
        &[a.buf, b.buf],
        g,
    )
}

/// `dst[r][c] = src[r][c]` for `n` rows of `width` (distinct buffers).
pub fn copy_rows(
    rec: &mut Recorder,
    src: Rows,
    dst: Rows,
    n: u32,
    width: u32,
) -> Result<(), GpuError> {
    let g = elems(rec, n as u64 * width as u64)?;
    rec.dispatch(
        &COPY_ROWS,
        &[n, width, src.off, dst.off, src.stride, dst.stride],
        &[src.buf, dst.buf],
        g,
    )
}

/// `dst` row i = `src` row `idx[i]`, for `n` rows of `width` (rows contiguous in both).
pub fn gather_rows(
    rec: &mut Recorder,
    src: &wgpu::Buffer,
    idx: &wgpu::Buffer,
    dst: &wgpu::Buffer,
    n: u32,
    width: u32,
) -> Result<(), GpuError> {
    let g = elems(rec, n as u64 * width as u64)?;
    rec.dispatch(&GATHER_ROWS, &[n, width], &[src, idx, dst], g)
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
    let groups = elems(rec, n as u64 * width as u64)?;
    rec.dispatch(
        &SWIGLU,
        &[n, width, g.off, g.stride, u.off, u.stride],
        &[g.buf, u.buf, out],
        groups,
    )
}

/// `x[off..off+n] *= s`.
pub fn scale(
    rec: &mut Recorder,
    x: &wgpu::Buffer,
    off: u32,
    n: u32,
    s: f32,
) -> Result<(), GpuError> {
    let g = elems(rec, n as u64)?;
    rec.dispatch(&SCALE, &[n, off, s.to_bits()], &[x], g)
}

/// The most experts a MoE layer may have on the device (the routing kernel's workgroup array).
pub const MAX_EXPERTS: usize = 512;

/// For each of `n` rows of router logits (`n_expert` wide): softmax, the `k` most probable experts
/// (ties to the lower id) into `ids` (`n × k` u32) and their renormalised weights into `weights`.
pub fn moe_route(
    rec: &mut Recorder,
    logits: &wgpu::Buffer,
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
    rec.dispatch(&MOE_ROUTE, &[n, n_expert, k], &[logits, ids, weights], g)
}

/// `out[r] = Σ_s weights[r·k+s] · y[r·k+s]` in slot order, plus `sigmoid(shared_gate[r]) ·
/// shared[r]` when a shared expert is given; rows of `width`, contiguous.
#[allow(clippy::too_many_arguments)]
pub fn moe_combine(
    rec: &mut Recorder,
    y: &wgpu::Buffer,
    weights: &wgpu::Buffer,
    shared: Option<(&wgpu::Buffer, &wgpu::Buffer)>,
    out: &wgpu::Buffer,
    n: u32,
    k: u32,
    width: u32,
) -> Result<(), GpuError> {
    let g = elems(rec, n as u64 * width as u64)?;
    let (s_out, s_gate, has) = match shared {
        Some((o, gate)) => (o, gate, 1),
        None => (y, weights, 0),
    };
    rec.dispatch(
        &MOE_COMBINE,
        &[n, k, width, has],
        &[y, weights, s_out, s_gate, out],
        g,
    )
}
