//! Weight matrix times activation rows: `y[i][r] = sum_c W[r][c] * x[i][c]`, for a
//! [`DeviceMatrix`] or for the experts of a [`DeviceExperts`] that a MoE router picked.
//!
//! One WGSL module per weight type and per count N (1..=8) of activation rows that a
//! workgroup multiplies by the weight blocks it has read once (decode is N = 1, speculative
//! verify of 1 + k rows N = 1 + k; prefill goes in groups of 8). Each module is the shared
//! `matvec.wgsl` with the type's unit decoder appended. A row's result is the same bits for
//! every N: the threads sharing a weight row, the units each takes and the tree that adds
//! their partial sums depend only on the matrix's type and width.

use super::Kernel;
use crate::weights::{DeviceExperts, DeviceMatrix, Packed};
use crate::{GpuError, Recorder};

/// Threads per workgroup (`WG` in matvec.wgsl).
const WG: u32 = 128;

/// Activation rows a workgroup takes at most; larger batches go in groups of this many.
pub const MAX_BATCH: u32 = 8;

/// Weight rows each thread carries, by N - 1 (`R` in the module of N): more rows share each
/// activation load when few activation rows are in flight.
const ROWS_PER_THREAD: [u32; 8] = [4, 4, 2, 2, 2, 2, 2, 2];

/// The kernels of one weight type: `matvec` for N = 1..=8, and `matvec_experts` (in the N = 1
/// module).
pub struct Family {
    pub rows: [Kernel; 8],
    pub experts: Kernel,
}

macro_rules! source {
    ($file:literal, $n:literal, $r:literal) => {
        concat!(
            "const N: u32 = ",
            $n,
            "u;\nconst R: u32 = ",
            $r,
            "u;\n",
            include_str!("../shaders/matvec.wgsl"),
            include_str!(concat!("../shaders/", $file))
        )
    };
    ($file:literal, $n:literal, $r:literal, experts) => {
        concat!(
            source!($file, $n, $r),
            include_str!("../shaders/matvec_experts.wgsl")
        )
    };
}

macro_rules! family {
    ($id:ident, $label:literal, $file:literal) => {
        pub static $id: Family = Family {
            rows: [
                Kernel {
                    name: concat!("matvec_", $label, "_n1"),
                    source: source!($file, 1, 4, experts),
                    entry: "matvec",
                },
                Kernel {
                    name: concat!("matvec_", $label, "_n2"),
                    source: source!($file, 2, 4),
                    entry: "matvec",
                },
                Kernel {
                    name: concat!("matvec_", $label, "_n3"),
                    source: source!($file, 3, 2),
                    entry: "matvec",
                },
                Kernel {
                    name: concat!("matvec_", $label, "_n4"),
                    source: source!($file, 4, 2),
                    entry: "matvec",
                },
                Kernel {
                    name: concat!("matvec_", $label, "_n5"),
                    source: source!($file, 5, 2),
                    entry: "matvec",
                },
                Kernel {
                    name: concat!("matvec_", $label, "_n6"),
                    source: source!($file, 6, 2),
                    entry: "matvec",
                },
                Kernel {
                    name: concat!("matvec_", $label, "_n7"),
                    source: source!($file, 7, 2),
                    entry: "matvec",
                },
                Kernel {
                    name: concat!("matvec_", $label, "_n8"),
                    source: source!($file, 8, 2),
                    entry: "matvec",
                },
            ],
            experts: Kernel {
                name: concat!("matvec_experts_", $label),
                source: source!($file, 1, 4, experts),
                entry: "matvec_experts",
            },
        };
    };
}

family!(Q8_0, "q8_0", "matvec_q8_0.wgsl");
family!(Q4_0, "q4_0", "matvec_q4_0.wgsl");
family!(Q4_1, "q4_1", "matvec_q4_1.wgsl");
family!(Q5_0, "q5_0", "matvec_q5_0.wgsl");
family!(Q5_1, "q5_1", "matvec_q5_1.wgsl");
family!(IQ4_NL, "iq4_nl", "matvec_iq4_nl.wgsl");
family!(MXFP4, "mxfp4", "matvec_mxfp4.wgsl");
family!(Q2_K, "q2_k", "matvec_q2_k.wgsl");
family!(Q3_K, "q3_k", "matvec_q3_k.wgsl");
family!(Q4_K, "q4_k", "matvec_q4_k.wgsl");
family!(Q5_K, "q5_k", "matvec_q5_k.wgsl");
family!(Q6_K, "q6_k", "matvec_q6_k.wgsl");
family!(IQ4_XS, "iq4_xs", "matvec_iq4_xs.wgsl");
family!(F32, "f32", "matvec_f32.wgsl");
family!(F16, "f16", "matvec_f16.wgsl");
family!(BF16, "bf16", "matvec_bf16.wgsl");

static FAMILIES: [&Family; 16] = [
    &Q8_0, &Q4_0, &Q4_1, &Q5_0, &Q5_1, &IQ4_NL, &MXFP4, &Q2_K, &Q3_K, &Q4_K, &Q5_K, &Q6_K, &IQ4_XS,
    &F32, &F16, &BF16,
];

/// Every matvec kernel, for [`super::all`].
pub fn kernels() -> Vec<&'static Kernel> {
    FAMILIES
        .iter()
        .flat_map(|f| f.rows.iter().chain(std::iter::once(&f.experts)))
        .collect()
}

/// log2 of the threads that share one weight row: as many as the row has units, up to the
/// whole workgroup. A function of the matrix's shape only, so that every batch size and the
/// experts kernel add a row's partial sums in the same tree.
fn tpr_log2(units_per_row: usize) -> u32 {
    let units = units_per_row.max(1) as u64;
    (63 - units.leading_zeros()).min(WG.trailing_zeros())
}

fn rows_per_group(n: u32, tpr_log2: u32) -> u32 {
    (WG >> tpr_log2) * ROWS_PER_THREAD[n as usize - 1]
}

fn bad(m: &Packed, why: String) -> GpuError {
    GpuError::BadTensor {
        tensor: m.name.clone(),
        why,
    }
}

/// Whether `count` rows of `width` values, `stride` apart from `off`, lie within `buf` (f32).
fn check_extent(
    m: &Packed,
    what: &str,
    buf: &wgpu::Buffer,
    off: u32,
    stride: u32,
    count: u64,
    width: u64,
) -> Result<(), GpuError> {
    let end = off as u64 + (count - 1) * stride as u64 + width;
    let have = buf.size() / 4;
    if end > have {
        return Err(bad(
            m,
            format!("{what} needs {end} values from its buffer, which holds {have}"),
        ));
    }
    if end > u32::MAX as u64 {
        return Err(bad(m, format!("{what} reaches past 2^32 values")));
    }
    Ok(())
}

struct Io<'a> {
    x: &'a wgpu::Buffer,
    x_off: u32,
    x_stride: u32,
    y: &'a wgpu::Buffer,
    y_off: u32,
    y_stride: u32,
}

/// Checks shared by both entry points: `x_rows` rows of x and `y_rows` rows of y.
fn check_io(m: &Packed, io: &Io, x_rows: u64, y_rows: u64) -> Result<(), GpuError> {
    if io.x == io.y {
        return Err(bad(m, "x and y are the same buffer".into()));
    }
    if io.x.size() < 16 {
        return Err(bad(m, "the x buffer is smaller than 16 bytes".into()));
    }
    check_extent(m, "x", io.x, io.x_off, io.x_stride, x_rows, m.cols as u64)?;
    check_extent(m, "y", io.y, io.y_off, io.y_stride, y_rows, m.rows as u64)?;
    if y_rows > 1 && (io.y_stride as u64) < m.rows as u64 {
        return Err(bad(
            m,
            format!(
                "y rows {} apart overlap rows of {} values",
                io.y_stride, m.rows
            ),
        ));
    }
    Ok(())
}

fn x_aligned(io: &Io, x_rows: u64) -> u32 {
    (io.x_off.is_multiple_of(4) && (x_rows == 1 || io.x_stride.is_multiple_of(4))) as u32
}

/// `y[y_off + i*y_stride + r] = sum_c W[r][c] * x[x_off + i*x_stride + c]` for `i < n` and every
/// row `r` of `m`, in f32 (activations and accumulation). Up to [`MAX_BATCH`] rows of x share
/// one read of the weights; larger `n` go in groups of that many. Row `i`'s result is the same
/// bits whatever `n` is and wherever the row sits. `x` and `y` are distinct buffers of f32; the
/// y rows must not overlap (`y_stride >= rows` when `n > 1`).
#[allow(clippy::too_many_arguments)]
pub fn matvec(
    rec: &mut Recorder,
    m: &DeviceMatrix,
    x: &wgpu::Buffer,
    x_off: u32,
    x_stride: u32,
    n: u32,
    y: &wgpu::Buffer,
    y_off: u32,
    y_stride: u32,
) -> Result<(), GpuError> {
    if n == 0 {
        return Ok(());
    }
    let pk = m.packed();
    let io = Io {
        x,
        x_off,
        x_stride,
        y,
        y_off,
        y_stride,
    };
    check_io(pk, &io, n as u64, n as u64)?;
    let gpu = rec.gpu();
    let max_z = gpu.max_groups_x().max(1);
    // (N, first activation row, groups along z).
    let mut plan: Vec<(u32, u32, u32)> = Vec::new();
    if n <= MAX_BATCH {
        plan.push((n, 0, 1));
    } else {
        let full = n / MAX_BATCH;
        let mut done = 0;
        while done < full {
            let z = (full - done).min(max_z);
            plan.push((MAX_BATCH, done * MAX_BATCH, z));
            done += z;
        }
        if !n.is_multiple_of(MAX_BATCH) {
            plan.push((n % MAX_BATCH, full * MAX_BATCH, 1));
        }
    }
    let units = pk.units_per_row();
    let tl = tpr_log2(units);
    let aligned = x_aligned(&io, n as u64);
    for chunk in &pk.chunks {
        for &(nb, batch0, z) in &plan {
            let blocks = (chunk.rows as u32).div_ceil(rows_per_group(nb, tl));
            let mut groups = crate::groups_1d(gpu, blocks);
            groups[2] = z;
            let params = [
                chunk.rows as u32,
                units as u32,
                tl,
                pk.bpr as u32,
                chunk.aux_off,
                chunk.aux2_off,
                pk.cols as u32,
                x_off,
                x_stride,
                aligned,
                y_off,
                y_stride,
                chunk.first_row as u32,
                batch0,
                0,
                0,
                0,
                0,
                0,
                0,
            ];
            rec.dispatch(
                &pk.format.family.rows[nb as usize - 1],
                &[],
                &params,
                &[&chunk.buffer, x, x, y],
                groups,
            )?;
        }
    }
    Ok(())
}

/// The experts a router picked, each times its activation row. For token `i < n` and slot
/// `s < n_used`, expert `e = ids[ids_off + i*n_used + s]` (u32) multiplies the row
/// `x[x_off + j*x_stride ..]` with `j = i*n_used + s` when `x_per_slot` (each slot its own
/// input, as the down projection), `j = i` otherwise (the token's input, as gate and up), into
/// `y[y_off + (i*n_used + s)*y_stride + r]` for every row `r` of the expert. Each output row is
/// the same bits as [`matvec`] on expert `e`'s matrix alone. Rows of an id not below the
/// number of experts are left as they were.
#[allow(clippy::too_many_arguments)]
pub fn matvec_experts(
    rec: &mut Recorder,
    m: &DeviceExperts,
    ids: &wgpu::Buffer,
    ids_off: u32,
    n_used: u32,
    x: &wgpu::Buffer,
    x_off: u32,
    x_stride: u32,
    x_per_slot: bool,
    n: u32,
    y: &wgpu::Buffer,
    y_off: u32,
    y_stride: u32,
) -> Result<(), GpuError> {
    let pairs = n as u64 * n_used as u64;
    if pairs == 0 {
        return Ok(());
    }
    let pk = m.packed();
    let io = Io {
        x,
        x_off,
        x_stride,
        y,
        y_off,
        y_stride,
    };
    let x_rows = if x_per_slot { pairs } else { n as u64 };
    check_io(pk, &io, x_rows, pairs)?;
    if ids_off as u64 + pairs > ids.size() / 4 {
        return Err(bad(
            pk,
            format!(
                "ids needs {} values from its buffer, which holds {}",
                ids_off as u64 + pairs,
                ids.size() / 4
            ),
        ));
    }
    if ids == x || ids == y {
        return Err(bad(pk, "ids shares a buffer with x or y".into()));
    }
    let gpu = rec.gpu();
    let max_z = gpu.max_groups_x().max(1) as u64;
    let units = pk.units_per_row();
    let tl = tpr_log2(units);
    let aligned = x_aligned(&io, x_rows);
    let blocks = (pk.rows as u32).div_ceil(rows_per_group(1, tl));
    for chunk in &pk.chunks {
        let mut pair0 = 0u64;
        while pair0 < pairs {
            let z = (pairs - pair0).min(max_z);
            let mut groups = crate::groups_1d(gpu, blocks);
            groups[2] = z as u32;
            let params = [
                pk.rows as u32,
                units as u32,
                tl,
                pk.bpr as u32,
                chunk.aux_off,
                chunk.aux2_off,
                pk.cols as u32,
                x_off,
                x_stride,
                aligned,
                y_off,
                y_stride,
                0,
                0,
                n_used,
                ids_off,
                (chunk.first_row / pk.rows) as u32,
                (chunk.rows / pk.rows) as u32,
                x_per_slot as u32,
                pair0 as u32,
            ];
            rec.dispatch(
                &pk.format.family.experts,
                &[],
                &params,
                &[&chunk.buffer, x, x, y, ids],
                groups,
            )?;
            pair0 += z;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_constants_match_the_host() {
        for f in FAMILIES {
            for (i, k) in f.rows.iter().enumerate() {
                let head = format!(
                    "const N: u32 = {}u;\nconst R: u32 = {}u;\n",
                    i + 1,
                    ROWS_PER_THREAD[i]
                );
                assert!(k.source.starts_with(&head), "{}", k.name);
                assert!(k.source.contains(&format!("const WG: u32 = {WG}u;")));
            }
            assert_eq!(f.experts.source, f.rows[0].source);
        }
    }

    #[test]
    fn threads_per_row() {
        assert_eq!(tpr_log2(1), 0);
        assert_eq!(tpr_log2(16), 4);
        assert_eq!(tpr_log2(17), 4);
        assert_eq!(tpr_log2(127), 6);
        assert_eq!(tpr_log2(128), 7);
        assert_eq!(tpr_log2(100_000), 7);
    }
}
