//! Weight matrices on the device times activation rows on the f32-activation path (every type;
//! the int8 path is tests/matvec_int8.rs), against the scalar definition: the weights
//! dequantized by `nextn_quant::formats::dequantize` (ggml's reference), dots in f64.
//!
//! Tolerance: `|y - ref| <= TOL * sum_c |w_rc * x_c|` with `TOL = 1e-5` (f32 partial sums of
//! at most a few hundred terms each, folded in a tree; the sum of magnitudes bounds what
//! rounding can lose even where the terms cancel; lavapipe's largest is about 8e-7).
//! Dequantization itself is checked exactly: a one-hot activation row must give back the
//! weight bit for bit.

use nextn_gguf::GgmlType;
use nextn_gpu::kernels::matvec::{embed_rows, matvec, matvec_experts, DEVICE_TOKEN};
use nextn_gpu::validation::{assert_clean, test_device};
use nextn_gpu::{is_device_type, DeviceExperts, DeviceMatrix, Gpu, GpuError, Recorder};
use nextn_quant::formats;

const TOL: f64 = 1e-5;

/// The test device with every matrix uploaded onto the f32-activation path.
fn f32_device() -> Option<Gpu> {
    test_device().map(|mut g| {
        g.disable_int8_dot();
        g
    })
}

/// Every type the kernels read, in the order of how much published Qwen3.5/3.6 GGUFs use them.
const TYPES: [GgmlType; 16] = [
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::Q5_K,
    GgmlType::F16,
    GgmlType::F32,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4_1,
    GgmlType::IQ4_NL,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // SplitMix64.
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Column counts to test: several blocks, not a power of two; the float types get widths that
/// end inside a vec4.
fn widths(ty: GgmlType) -> [usize; 2] {
    match ty.block_size() {
        1 => [50, 263],
        32 => [96, 544],
        _ => [256, 768],
    }
}

/// `rows x cols` weights of `ty`: random values with a scale per row and a few outliers,
/// quantized by ggml's quantizer.
fn weights(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed);
    let row_bytes = ty.row_bytes(cols as u64).unwrap() as usize;
    let mut out = vec![0u8; rows * row_bytes];
    for r in 0..rows {
        let scale = 0.05 + 2.0 * (r % 7) as f32 / 7.0;
        let src: Vec<f32> = (0..cols)
            .map(|c| {
                let v = rng.unit() * scale;
                if c % 97 == 13 {
                    v * 8.0
                } else {
                    v
                }
            })
            .collect();
        formats::quantize(ty, &src, &mut out[r * row_bytes..(r + 1) * row_bytes]).unwrap();
    }
    out
}

fn dequantized(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Vec<f32> {
    let row_bytes = ty.row_bytes(cols as u64).unwrap() as usize;
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        formats::dequantize(
            ty,
            &data[r * row_bytes..(r + 1) * row_bytes],
            &mut out[r * cols..(r + 1) * cols],
        )
        .unwrap();
    }
    out
}

fn activations(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..len)
        .map(|i| rng.unit() * (1.0 + (i % 5) as f32))
        .collect()
}

/// Run `matvec` over `x` (uploaded whole) and read back `y_len` values of y.
#[allow(clippy::too_many_arguments)]
fn product(
    gpu: &Gpu,
    m: &DeviceMatrix,
    x: &[f32],
    x_off: u32,
    x_stride: u32,
    n: u32,
    y_len: usize,
    y_off: u32,
    y_stride: u32,
) -> Vec<f32> {
    let xb = gpu.upload("x", bytemuck::cast_slice(x)).unwrap();
    let yb = gpu.buffer("y", (y_len * 4) as u64).unwrap();
    let mut rec = Recorder::new(gpu);
    matvec(&mut rec, m, &xb, x_off, x_stride, n, &yb, y_off, y_stride).unwrap();
    rec.submit(false).unwrap();
    gpu.read_f32(&yb, 0, y_len).unwrap()
}

/// `y` against the f64 dot of each weight row with each x row, within `TOL`.
#[allow(clippy::too_many_arguments)]
fn check_against_reference(
    what: &str,
    w: &[f32],
    rows: usize,
    cols: usize,
    x: &[f32],
    x_off: usize,
    x_stride: usize,
    n: usize,
    y: &[f32],
    y_off: usize,
    y_stride: usize,
) -> f64 {
    let mut worst = 0f64;
    for i in 0..n {
        let xr = &x[x_off + i * x_stride..][..cols];
        for r in 0..rows {
            let wr = &w[r * cols..(r + 1) * cols];
            let want: f64 = wr.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum();
            let mag: f64 = wr
                .iter()
                .zip(xr)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
            let got = y[y_off + i * y_stride + r] as f64;
            let err = (got - want).abs();
            assert!(
                err <= TOL * mag + 1e-30,
                "{what}: x row {i}, weight row {r}: {got} vs {want} (error {err:e}, scale {mag:e})"
            );
            if mag > 0.0 {
                worst = worst.max(err / mag);
            }
        }
    }
    worst
}

#[test]
fn every_type_matches_the_reference() {
    let Some(gpu) = f32_device() else { return };
    let mut worst = Vec::new();
    for (t, ty) in TYPES.into_iter().enumerate() {
        assert!(is_device_type(ty), "{ty}");
        for (s, cols) in widths(ty).into_iter().enumerate() {
            // Rows not a multiple of any workgroup's row count.
            let rows = [37, 5][s];
            let data = weights(ty, rows, cols, 1 + t as u64 * 10 + s as u64);
            let m = DeviceMatrix::upload(&gpu, "blk.0.w", ty, rows, cols, &data).unwrap();
            assert_eq!((m.ty(), m.rows(), m.cols()), (ty, rows, cols));
            assert!(m.device_bytes() >= data.len() as u64);
            let w = dequantized(ty, rows, cols, &data);
            // The main types through every batch module, the others through N = 1, a
            // middle one and the 8 + 1 of prefill.
            let ns: &[u32] = if t < 2 {
                &[1, 2, 3, 4, 5, 8, 9]
            } else {
                &[1, [2, 3, 4, 5][t % 4], 9]
            };
            for &n in ns {
                // Rows of x with a gap after each, the first an odd offset in: the scalar
                // load path; even widths and offsets: the vec4 path.
                let (x_off, x_stride) = if n % 2 == 1 {
                    (3, cols + 5)
                } else {
                    (4, cols + 4)
                };
                let x = activations(x_off + n as usize * x_stride, 100 + n as u64);
                let (y_off, y_stride) = (2, rows + 3);
                let y = product(
                    &gpu,
                    &m,
                    &x,
                    x_off as u32,
                    x_stride as u32,
                    n,
                    y_off + n as usize * y_stride,
                    y_off as u32,
                    y_stride as u32,
                );
                let e = check_against_reference(
                    &format!("{ty} {rows}x{cols} n={n}"),
                    &w,
                    rows,
                    cols,
                    &x,
                    x_off,
                    x_stride,
                    n as usize,
                    &y,
                    y_off,
                    y_stride,
                );
                worst.push((ty, e));
            }
        }
    }
    let max = worst.iter().map(|(_, e)| *e).fold(0.0, f64::max);
    eprintln!("largest error relative to sum |w*x|: {max:e}");
    assert_clean(&gpu);
}

#[test]
fn dequantization_is_exact() {
    let Some(gpu) = f32_device() else { return };
    for (t, ty) in TYPES.into_iter().enumerate() {
        let rows = 19;
        let cols = match ty.block_size() {
            1 => 13,
            32 => 64,
            _ => 256,
        };
        let data = weights(ty, rows, cols, 500 + t as u64);
        let w = dequantized(ty, rows, cols, &data);
        let m = DeviceMatrix::upload(&gpu, "w", ty, rows, cols, &data).unwrap();
        // x row i is the unit vector e_i: y row i is column i of W, each value one weight
        // decoded and added to zeros. n = cols > 8 also runs the batch in groups.
        let mut x = vec![0f32; cols * cols];
        for i in 0..cols {
            x[i * cols + i] = 1.0;
        }
        let y = product(
            &gpu,
            &m,
            &x,
            0,
            cols as u32,
            cols as u32,
            cols * rows,
            0,
            rows as u32,
        );
        for i in 0..cols {
            for r in 0..rows {
                assert_eq!(y[i * rows + r], w[r * cols + i], "{ty}: weight ({r}, {i})");
            }
        }
    }
    assert_clean(&gpu);
}

/// Rows of an embedding table gathered on the device are the host's dequantized rows (bit for
/// bit but for the sign of a zero), for every type, from a matrix split over several buffers
/// too; ids standing for a drafted token are looked up in the drafts, and an id past the table
/// gives zeros.
#[test]
fn embedding_rows_are_the_dequantized_rows() {
    let Some(gpu) = f32_device() else { return };
    for (t, ty) in TYPES.into_iter().enumerate() {
        let rows = 19;
        let cols = match ty.block_size() {
            1 => 13,
            32 => 64,
            _ => 256,
        };
        let data = weights(ty, rows, cols, 700 + t as u64);
        let w = dequantized(ty, rows, cols, &data);
        let row_bytes = ty.row_bytes(cols as u64).unwrap();
        // Whole, and split into buffers of a few rows each.
        for limit in [u64::MAX, 5 * row_bytes + 64] {
            let m =
                DeviceMatrix::upload_with_limit(&gpu, "token_embd", ty, rows, cols, &data, limit)
                    .unwrap();
            // Draft pair 1 names row 4; DEVICE_TOKEN + 0 names no row (a draft with no token).
            let drafts: Vec<u32> = vec![u32::MAX, 0, 4, 0];
            let ids: Vec<u32> = vec![7, 0, 18, DEVICE_TOKEN + 1, 7, rows as u32, DEVICE_TOKEN];
            let (ib, db) = (
                gpu.upload("ids", bytemuck::cast_slice(&ids)).unwrap(),
                gpu.upload("drafts", bytemuck::cast_slice(&drafts)).unwrap(),
            );
            let stride = cols + 3;
            let out = gpu
                .upload(
                    "out",
                    bytemuck::cast_slice(&vec![9.0f32; 2 + ids.len() * stride]),
                )
                .unwrap();
            let mut rec = Recorder::new(&gpu);
            embed_rows(
                &mut rec,
                &m,
                &ib,
                0,
                &db,
                ids.len() as u32,
                &out,
                2,
                stride as u32,
            )
            .unwrap();
            rec.submit(false).unwrap();
            let got = gpu.read_f32(&out, 0, 2 + ids.len() * stride).unwrap();
            for (i, &id) in ids.iter().enumerate() {
                let id = if id >= DEVICE_TOKEN {
                    drafts[2 * (id - DEVICE_TOKEN) as usize]
                } else {
                    id
                };
                let want: Vec<f32> = if (id as usize) < rows {
                    w[id as usize * cols..(id as usize + 1) * cols].to_vec()
                } else {
                    vec![0.0; cols]
                };
                // Zeros as +0: the sign of a zero is the one thing the decoders may lose.
                let bits = |r: &[f32]| -> Vec<u32> {
                    r.iter()
                        .map(|&v| if v == 0.0 { 0 } else { v.to_bits() })
                        .collect()
                };
                let row = &got[2 + i * stride..][..cols];
                assert_eq!(
                    bits(row),
                    bits(&want),
                    "{ty}: row {i} (id {id}), buffers of {limit} bytes"
                );
                // The gap between rows is left alone.
                assert_eq!(got[2 + i * stride + cols], 9.0);
            }
        }
    }
    assert_clean(&gpu);
}

/// Row i of an n-row product against the 1-row product of the same x row, bit for bit.
fn check_batch_invariance(gpu: &Gpu, ty: GgmlType, ns: &[u32]) {
    let (rows, cols) = (23, widths(ty)[1]);
    let data = weights(ty, rows, cols, 900);
    let m = DeviceMatrix::upload(gpu, "w", ty, rows, cols, &data).unwrap();
    let max_n = *ns.iter().max().unwrap() as usize;
    let stride = cols + 4;
    let x = activations(max_n * stride + 4, 901);
    let single: Vec<Vec<f32>> = (0..max_n)
        .map(|i| product(gpu, &m, &x, (i * stride) as u32, 0, 1, rows, 0, 0))
        .collect();
    for &n in ns {
        for first in [0, max_n - n as usize] {
            let y = product(
                gpu,
                &m,
                &x,
                (first * stride) as u32,
                stride as u32,
                n,
                n as usize * (rows + 1),
                0,
                rows as u32 + 1,
            );
            for i in 0..n as usize {
                let got = &y[i * (rows + 1)..][..rows];
                let want = &single[first + i];
                for r in 0..rows {
                    assert_eq!(
                        got[r].to_bits(),
                        want[r].to_bits(),
                        "{ty}: row {r} of x row {} as row {i} of {n}",
                        first + i
                    );
                }
            }
        }
    }
}

#[test]
fn a_row_is_the_same_bits_in_any_batch() {
    let Some(gpu) = f32_device() else { return };
    // Groups of 8 and prefill tiles too.
    let t = nextn_gpu::kernels::matvec::TILE_ROWS;
    check_batch_invariance(
        &gpu,
        GgmlType::Q4_K,
        &[2, 3, 4, 5, 6, 7, 8, 9, 17, t, t + 1, 2 * t + 9],
    );
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q6_K,
        GgmlType::IQ4_XS,
        GgmlType::F16,
    ] {
        check_batch_invariance(&gpu, ty, &[3, 9, 37]);
    }
    assert_clean(&gpu);
}

#[test]
fn a_matrix_over_the_binding_limit_is_split_by_rows() {
    let Some(gpu) = f32_device() else { return };
    for ty in [GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::F32] {
        let (rows, cols) = (41, widths(ty)[0]);
        let data = weights(ty, rows, cols, 1234);
        let whole = DeviceMatrix::upload(&gpu, "w", ty, rows, cols, &data).unwrap();
        assert_eq!(whole.buffer_count(), 1);
        // A limit of a few rows per buffer: several buffers, the last one short.
        let row = ty.row_bytes(cols as u64).unwrap();
        let split = DeviceMatrix::upload_with_limit(&gpu, "w", ty, rows, cols, &data, 6 * row + 64)
            .unwrap();
        assert!(split.buffer_count() >= 7, "{ty}: {}", split.buffer_count());
        let x = activations(3 * cols, 77);
        let a = product(
            &gpu,
            &whole,
            &x,
            0,
            cols as u32,
            3,
            3 * rows,
            0,
            rows as u32,
        );
        let b = product(
            &gpu,
            &split,
            &x,
            0,
            cols as u32,
            3,
            3 * rows,
            0,
            rows as u32,
        );
        assert_eq!(
            a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{ty}"
        );
        let w = dequantized(ty, rows, cols, &data);
        check_against_reference(
            &format!("{ty} split"),
            &w,
            rows,
            cols,
            &x,
            0,
            cols,
            3,
            &b,
            0,
            rows,
        );
    }
    assert_clean(&gpu);
}

/// `matvec_experts` against `matvec` on each expert's own matrix, bit for bit, for both ways
/// of taking x, with the stack whole and split over several buffers.
fn check_experts(gpu: &Gpu, ty: GgmlType) {
    let (n_expert, rows, cols) = (5, 21, widths(ty)[0]);
    let expert_bytes = rows * ty.row_bytes(cols as u64).unwrap() as usize;
    let data = weights(ty, n_expert * rows, cols, 4321);
    let whole = DeviceExperts::upload(gpu, "exps", ty, n_expert, rows, cols, &data).unwrap();
    assert_eq!(
        (whole.n_expert(), whole.rows(), whole.cols()),
        (n_expert, rows, cols)
    );
    let split = DeviceExperts::upload_with_limit(
        gpu,
        "exps",
        ty,
        n_expert,
        rows,
        cols,
        &data,
        2 * expert_bytes as u64 + 64,
    )
    .unwrap();
    assert!(split.buffer_count() >= 3, "{}", split.buffer_count());
    let singles: Vec<DeviceMatrix> = (0..n_expert)
        .map(|e| {
            let d = &data[e * expert_bytes..(e + 1) * expert_bytes];
            DeviceMatrix::upload(gpu, "expert", ty, rows, cols, d).unwrap()
        })
        .collect();
    let (n, n_used) = (3usize, 3usize);
    // The last token picks an id past the stack: its rows keep what y held.
    let ids: Vec<u32> = vec![4, 0, 2, 1, 1, 3, 2, n_expert as u32, 0];
    let idb = gpu.upload("ids", bytemuck::cast_slice(&ids)).unwrap();
    let stride = cols + 4;
    let x = activations(n * n_used * stride, 55);
    let xb = gpu.upload("x", bytemuck::cast_slice(&x)).unwrap();
    let y_stride = rows + 2;
    let sentinel = -7.25f32;
    for x_per_slot in [false, true] {
        for m in [&whole, &split] {
            let y_len = n * n_used * y_stride;
            let yb = gpu
                .upload("y", bytemuck::cast_slice(&vec![sentinel; y_len]))
                .unwrap();
            let mut rec = Recorder::new(gpu);
            matvec_experts(
                &mut rec,
                m,
                &idb,
                0,
                n_used as u32,
                &xb,
                0,
                stride as u32,
                x_per_slot,
                n as u32,
                &yb,
                0,
                y_stride as u32,
            )
            .unwrap();
            rec.submit(false).unwrap();
            let y = gpu.read_f32(&yb, 0, y_len).unwrap();
            for i in 0..n {
                for s in 0..n_used {
                    let pair = i * n_used + s;
                    let got = &y[pair * y_stride..][..rows];
                    let e = ids[pair] as usize;
                    if e >= n_expert {
                        assert!(got.iter().all(|v| *v == sentinel), "{ty}: pair {pair}");
                        continue;
                    }
                    let xr = if x_per_slot { pair } else { i };
                    let want =
                        product(gpu, &singles[e], &x, (xr * stride) as u32, 0, 1, rows, 0, 0);
                    for r in 0..rows {
                        assert_eq!(
                            got[r].to_bits(),
                            want[r].to_bits(),
                            "{ty}: pair {pair} (expert {e}) row {r}, x_per_slot {x_per_slot}"
                        );
                    }
                    let w = dequantized(ty, rows, cols, &data[e * expert_bytes..][..expert_bytes]);
                    check_against_reference(
                        &format!("{ty} expert {e}"),
                        &w,
                        rows,
                        cols,
                        &x,
                        xr * stride,
                        0,
                        1,
                        got,
                        0,
                        0,
                    );
                }
            }
            assert!(y[(n * n_used) * y_stride - 1] == sentinel);
        }
    }
}

#[test]
fn experts_match_their_own_matrices() {
    let Some(gpu) = f32_device() else { return };
    for ty in [GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::MXFP4] {
        check_experts(&gpu, ty);
    }
    assert_clean(&gpu);
}

#[test]
fn bad_tensors_are_refused() {
    let Some(gpu) = f32_device() else { return };
    let err = DeviceMatrix::upload(&gpu, "a", GgmlType::IQ2_XXS, 4, 256, &[0u8; 4 * 66]);
    assert!(
        matches!(&err, Err(GpuError::UnsupportedType { tensor, ty }) if tensor == "a" && ty == "IQ2_XXS"),
        "{:?}",
        err.err()
    );
    assert!(!is_device_type(GgmlType::Q8_1));
    let err = DeviceMatrix::upload(&gpu, "b", GgmlType::Q8_0, 4, 64, &[0u8; 4 * 68 - 1]);
    assert!(matches!(err, Err(GpuError::BadTensor { .. })));
    let err = DeviceMatrix::upload(&gpu, "c", GgmlType::Q4_K, 2, 100, &[0u8; 2 * 144]);
    assert!(matches!(err, Err(GpuError::BadTensor { .. })));
    let err = DeviceExperts::upload(&gpu, "d", GgmlType::Q8_0, 3, 4, 32, &[0u8; 11 * 34]);
    assert!(matches!(err, Err(GpuError::BadTensor { .. })));
    // x shorter than the product reads.
    let data = weights(GgmlType::Q8_0, 4, 64, 1);
    let m = DeviceMatrix::upload(&gpu, "e", GgmlType::Q8_0, 4, 64, &data).unwrap();
    let xb = gpu.buffer("x", 64 * 4).unwrap();
    let yb = gpu.buffer("y", 64 * 4).unwrap();
    let mut rec = Recorder::new(&gpu);
    assert!(matches!(
        matvec(&mut rec, &m, &xb, 0, 64, 2, &yb, 0, 4),
        Err(GpuError::BadTensor { .. })
    ));
    // Overlapping rows of y.
    let xb2 = gpu.buffer("x", 128 * 4).unwrap();
    assert!(matches!(
        matvec(&mut rec, &m, &xb2, 0, 64, 2, &yb, 0, 2),
        Err(GpuError::BadTensor { .. })
    ));
    assert!(rec.is_empty());
    assert_clean(&gpu);
}

/// Marker under which `vector_width_child` runs its check, with the width it must see.
const WIDTH_ENV: &str = "NEXTN_MATVEC_WIDTH_CHILD";

/// The real check behind `lavapipe_vector_widths`: run in a child process whose lavapipe
/// instance was created with another SIMD width. Does nothing in an ordinary run.
#[test]
fn vector_width_child() {
    let Ok(bits) = std::env::var(WIDTH_ENV) else {
        return;
    };
    let gpu = f32_device().expect("the child needs the device its parent saw");
    let want = format!("{bits} bits");
    assert!(
        gpu.info.description.contains(&want),
        "adapter '{}' does not report {want}",
        gpu.info.description
    );
    // A plain type, and one whose code book sits in workgroup memory.
    for ty in [GgmlType::Q4_K, GgmlType::IQ4_XS] {
        check_batch_invariance(&gpu, ty, &[3, 9]);
        let (rows, cols) = (37, widths(ty)[1]);
        let data = weights(ty, rows, cols, 31);
        let m = DeviceMatrix::upload(&gpu, "w", ty, rows, cols, &data).unwrap();
        let x = activations(9 * cols, 32);
        let y = product(&gpu, &m, &x, 0, cols as u32, 9, 9 * rows, 0, rows as u32);
        let w = dequantized(ty, rows, cols, &data);
        check_against_reference(
            &format!("{ty} at {want}"),
            &w,
            rows,
            cols,
            &x,
            0,
            cols,
            9,
            &y,
            0,
            rows,
        );
    }
    check_experts(&gpu, GgmlType::Q4_K);
    assert_clean(&gpu);
}

/// The kernels at lavapipe's SIMD widths of 4, 8 and 16 lanes (LP_NATIVE_VECTOR_WIDTH, read
/// when the Vulkan instance is created, so each width runs in its own process).
#[test]
fn lavapipe_vector_widths() {
    let Some(gpu) = f32_device() else { return };
    if !gpu.info.description.contains("llvmpipe") {
        eprintln!(
            "skipped: the adapter is '{}', not lavapipe",
            gpu.info.description
        );
        return;
    }
    drop(gpu);
    let exe = std::env::current_exe().unwrap();
    for bits in ["128", "256", "512"] {
        let out = std::process::Command::new(&exe)
            .args(["--exact", "vector_width_child", "--nocapture"])
            .env("LP_NATIVE_VECTOR_WIDTH", bits)
            .env("MESA_SHADER_CACHE_DISABLE", "true")
            .env(WIDTH_ENV, bits)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "at {bits} bits:\n{text}");
        // The child really ran its one test, not zero.
        assert!(text.contains("1 passed"), "at {bits} bits:\n{text}");
    }
}
