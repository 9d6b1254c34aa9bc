//! The top-1 of logits rows on the device, so that a greedy row reads back 8 bytes instead of
//! its whole vocabulary.

use super::Kernel;
use crate::{GpuError, Recorder};

pub static ARGMAX_ROWS: Kernel = Kernel {
    name: "argmax_rows",
    source: include_str!("../shaders/argmax.wgsl"),
    entry: "argmax_rows",
};

pub static KERNELS: &[&Kernel] = &[&ARGMAX_ROWS];

/// The index [`argmax_rows`] writes for a row whose values are all NaN.
pub const NO_INDEX: u32 = u32::MAX;

/// For `rows` rows of `width` f32 values in `x`, `stride` apart from `x_off`: pair `r` of `out`
/// (words `out_off + 2r`, `out_off + 2r + 1`): the
/// index of row `r`'s largest value that is not NaN, the lowest such index among equal values
/// (−0 equals +0), [`NO_INDEX`] when every value is NaN; then that value's bits (+0 for
/// a −0; a NaN's bits with [`NO_INDEX`]), from word `out_off` of `out`.
#[allow(clippy::too_many_arguments)]
pub fn argmax_rows(
    rec: &mut Recorder,
    x: &wgpu::Buffer,
    x_off: u32,
    stride: u32,
    width: u32,
    rows: u32,
    out: &wgpu::Buffer,
    out_off: u32,
) -> Result<(), GpuError> {
    if out.size() / 4 < out_off as u64 + 2 * rows as u64 {
        return Err(GpuError::BadTensor {
            tensor: "argmax output".into(),
            why: format!("{rows} rows from word {out_off} past its buffer"),
        });
    }
    let groups = crate::groups_1d(rec.gpu(), rows);
    // Each row read, an (id, logit) pair written.
    let bytes = rows as u64 * (width as u64 * 4 + 8);
    rec.dispatch(
        &ARGMAX_ROWS,
        &[rows, width, stride, x_off, out_off],
        &[x, out],
        groups,
        bytes,
    )
}
