//! RMSNorm over rows, `y = x / sqrt(mean(x²) + eps) ⊙ w`, with the results quantized on the way
//! for the int8 products that read them.

use super::Kernel;
use crate::{GpuError, Recorder};

/// RMSNorm and the quantization of its results for the int8 products, in one dispatch.
pub static NORM_QUANT: Kernel = Kernel {
    name: "norm_quant",
    source: concat!(
        include_str!("../shaders/quant_common.wgsl"),
        include_str!("../shaders/norm_quant.wgsl")
    ),
    entry: "norm_quant",
};

pub static KERNELS: &[&Kernel] = &[&NORM_QUANT];

/// Where [`norm_quant`] writes: any of the normed rows as f32, quantized in Q8_0 or Q8_K blocks
/// (the layout [`crate::kernels::matvec::quant_layout`] gives for the whole row's width), and
/// with `pick` the quantized rows (and an f32 copy, `picked`) only for the rows picked.
#[derive(Clone, Copy, Default)]
pub struct NormOut<'a> {
    /// f32 rows: buffer, first element, distance between rows.
    pub y: Option<(&'a wgpu::Buffer, u32, u32)>,
    pub q8_0: Option<&'a wgpu::Buffer>,
    pub q8k: Option<&'a wgpu::Buffer>,
    /// `pick[off + r]`: the row of the quantized (and `picked`) outputs that row `r` goes to,
    /// or `u32::MAX` for none.
    pub pick: Option<(&'a wgpu::Buffer, u32)>,
    /// An f32 copy of the picked rows: buffer, first element, distance between rows.
    pub picked: Option<(&'a wgpu::Buffer, u32, u32)>,
}

/// `rows` rows of `parts * width` values of `x` (`x_stride` apart from `x_off`, part `k` of a row
/// `k * x_part` further), each part of `width` values normed on its own with its weights (`w`
/// from `w_off`, `w_stride` apart from one part to the next), written as `out` says (the parts
/// of an output row side by side). The f32 results are `x / sqrt(mean(x²) + eps) · w` with the sum of squares an f32 tree over
/// the workgroup (a part's bits depend only on the part) and the
/// quantized rows those [`crate::kernels::matvec`]'s own quantization makes of them.
#[allow(clippy::too_many_arguments)]
pub fn norm_quant(
    rec: &mut Recorder,
    x: &wgpu::Buffer,
    x_off: u32,
    x_stride: u32,
    x_part: u32,
    rows: u32,
    parts: u32,
    width: u32,
    w: &wgpu::Buffer,
    w_off: u32,
    w_stride: u32,
    out: &NormOut,
    eps: f32,
) -> Result<(), GpuError> {
    use crate::kernels::matvec::{quant_layout, ActBlocks};
    if rows == 0 || parts == 0 || width == 0 {
        return Ok(());
    }
    let bad = |why: String| GpuError::BadTensor {
        tensor: "norm_quant".into(),
        why,
    };
    let cols = (parts * width) as usize;
    let layout = |kind: ActBlocks| {
        if !(width as usize).is_multiple_of(kind.values() as usize) {
            return Err(bad(format!(
                "parts of {width} values are not whole {}-value blocks",
                kind.values()
            )));
        }
        quant_layout(cols, kind).ok_or_else(|| bad(format!("{cols} columns")))
    };
    let q0 = match out.q8_0 {
        Some(_) => Some(layout(ActBlocks::Q8_0)?),
        None => None,
    };
    let qk = match out.q8k {
        Some(_) => Some(layout(ActBlocks::Q8K)?),
        None => None,
    };
    let gpu = rec.gpu();
    let unused: Vec<wgpu::Buffer> = (0..4)
        .map(|i| gpu.scratch(["unused-0", "unused-1", "unused-2", "unused-3"][i], 16))
        .collect::<Result<_, _>>()?;
    let flags = out.y.is_some() as u32
        | (out.q8_0.is_some() as u32) << 1
        | (out.q8k.is_some() as u32) << 2
        | (out.pick.is_some() as u32) << 3
        | (out.picked.is_some() as u32) << 4;
    let (y, y_off, y_stride) = out.y.unwrap_or((&unused[0], 0, 0));
    let (yp, yp_off, yp_stride) = out.picked.unwrap_or((&unused[1], 0, 0));
    let (pick, pick_off) = out.pick.unwrap_or((&unused[2], 0));
    let q0b = out.q8_0.unwrap_or(&unused[3]);
    let qkb = out.q8k.unwrap_or(&unused[3]);
    if out.q8_0.is_some() && out.q8k.is_some() && q0b == qkb {
        return Err(bad("Q8_0 and Q8_K rows in one buffer".into()));
    }
    let q0l = q0.unwrap_or(crate::kernels::matvec::QuantLayout {
        stride: 0,
        d_off: 0,
        blocks: 0,
    });
    let qkl = qk.unwrap_or(q0l);
    let groups = crate::groups_1d(gpu, rows * parts);
    // The rows and the weights read, each output written (the rows the pick copies are not
    // counted: which they are is on the device).
    let (n, row) = (rows as u64, cols as u64 * 4);
    let written = out.y.map_or(0, |_| row)
        + q0.map_or(0, |l| l.stride as u64 * 4)
        + qk.map_or(0, |l| l.stride as u64 * 4);
    let bytes = n * (row + written) + parts as u64 * width as u64 * 4;
    rec.dispatch(
        &NORM_QUANT,
        &[
            rows,
            parts,
            width,
            x_off,
            x_stride,
            x_part,
            w_off,
            w_stride,
            y_off,
            y_stride,
            flags,
            pick_off,
            q0l.stride,
            q0l.d_off,
            qkl.stride,
            qkl.d_off,
            yp_off,
            yp_stride,
            eps.to_bits(),
        ],
        &[x, w, pick, y, q0b, qkb, yp],
        groups,
        bytes,
    )
}
