//! RMSNorm over rows: `y = x / sqrt(mean(x²) + eps) ⊙ w`.

use super::Kernel;
use crate::{GpuError, Recorder};

pub static RMS_NORM: Kernel = Kernel {
    name: "rms_norm",
    source: include_str!("../shaders/rms_norm.wgsl"),
    entry: "rms_norm",
};

pub static KERNELS: &[&Kernel] = &[&RMS_NORM];

/// `y[r] = RMSNorm(x[r]; w)` for `rows` rows of `width` values, the rows `stride` apart in both
/// buffers (`x_off` / `y_off` elements in); `w` is `width` long, read from `w_off`. `x` and `y`
/// may be the same buffer only if `x_off == y_off`... they are distinct bindings, so pass
/// distinct buffers.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    rec: &mut Recorder,
    x: &wgpu::Buffer,
    x_off: u32,
    w: &wgpu::Buffer,
    w_off: u32,
    y: &wgpu::Buffer,
    y_off: u32,
    rows: u32,
    width: u32,
    stride: u32,
    eps: f32,
) -> Result<(), GpuError> {
    let groups = crate::groups_1d(rec.gpu(), rows);
    rec.dispatch(
        &RMS_NORM,
        &[rows, width, stride, x_off, y_off, w_off, eps.to_bits()],
        &[x, w, y],
        groups,
    )
}
