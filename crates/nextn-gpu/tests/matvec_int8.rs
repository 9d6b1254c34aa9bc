//! The int8-activation path of the quantized products (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_XS)
//! against nextn-quant's scalar CPU kernel (`QMatrix::mul_rows_reference`): the activations
//! quantized as the CPU quantizes them (Q8_0 blocks for Q8_0 and Q4_0, Q8_K for the others), an
//! exact integer sum per block, one f32 term per block.
//!
//! Tolerance: the integer parts are the CPU's exactly, so a row of one 32-value block (Q8_0,
//! Q4_0) is the CPU's bits; a 256-value block of a narrow row is shared among threads, each
//! scaling the integer sum of its sub-blocks, and with a minimum term (Q4_K, Q5_K) the device
//! fuses the two products: within `1e-6` of the block's magnitude. Rows of several blocks add
//! the same terms in another order (a tree instead of a running sum):
//! `|y - cpu| <= 1e-6 * sum_c |w_c * x_c|`, where one quantized value off by one would already
//! move a row by about 3e-5 of that sum. Batch invariance and the prefill tile: bit for bit.

use nextn_gguf::GgmlType;
use nextn_gpu::kernels::matvec::{matvec, matvec_experts, GPU_ROW_THREADS, TILE_ROWS};
use nextn_gpu::validation::{assert_clean, rerun_at_lavapipe_widths, test_device};
use nextn_gpu::weights::has_int8_kernels;
use nextn_gpu::{DeviceExperts, DeviceMatrix, Gpu, GpuError, Recorder};
use nextn_quant::formats;
use nextn_quant::kernels::QMatrix;

const TOL: f64 = 1e-6;

/// In the children of `rerun_at_lavapipe_widths` (which compile every module afresh, without
/// the shader cache): fewer batch sizes and types, each module kind still run.
fn in_width_child() -> bool {
    std::env::var_os("NEXTN_TEST_LAVAPIPE_WIDTH").is_some()
}

const TYPES: [GgmlType; 6] = [
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::Q5_K,
    GgmlType::IQ4_XS,
    GgmlType::Q4_0,
];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn widths(ty: GgmlType) -> [usize; 2] {
    match ty.block_size() {
        32 => [96, 544],
        _ => [256, 768],
    }
}

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

/// Activations with exact ties for the quantizers: a block whose largest value is 127 (so
/// values k + 0.5 round half to even), one of all zeros, and signed extremes.
fn activations(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    let mut x: Vec<f32> = (0..len)
        .map(|i| rng.unit() * (1.0 + (i % 5) as f32))
        .collect();
    if len >= 512 {
        x[0] = 127.0;
        for (j, v) in x[1..32].iter_mut().enumerate() {
            *v = j as f32 - 15.5;
        }
        x[256..288].fill(0.0);
        x[300] = -9.0;
    }
    x
}

fn upload(gpu: &Gpu, ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> DeviceMatrix {
    let m = DeviceMatrix::upload(gpu, "blk.0.w", ty, rows, cols, data).unwrap();
    assert!(
        m.int8(),
        "{ty}: the int8 path is not chosen on this adapter"
    );
    m
}

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

/// The CPU's product of the n rows of x (`x_stride` apart from `x_off`), and each output's
/// `sum_c |w_c * x_c|` over the dequantized weights.
#[allow(clippy::too_many_arguments)]
fn cpu(
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    x_off: usize,
    x_stride: usize,
    n: usize,
) -> (Vec<f32>, Vec<f64>) {
    let xs: Vec<f32> = (0..n)
        .flat_map(|i| x[x_off + i * x_stride..][..cols].iter().copied())
        .collect();
    let q = QMatrix::new(ty, rows, cols, data).unwrap();
    let mut out = vec![0f32; n * rows];
    q.mul_rows_reference(&xs, n, &mut out).unwrap();
    let row_bytes = ty.row_bytes(cols as u64).unwrap() as usize;
    let mut mag = vec![0f64; n * rows];
    let mut w = vec![0f32; cols];
    for r in 0..rows {
        formats::dequantize(ty, &data[r * row_bytes..][..row_bytes], &mut w).unwrap();
        for i in 0..n {
            mag[i * rows + r] = w
                .iter()
                .zip(&xs[i * cols..][..cols])
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
        }
    }
    (out, mag)
}

fn check(what: &str, got: &[f32], want: &[f32], mag: &[f64]) -> f64 {
    let mut worst = 0f64;
    for (k, ((g, w), m)) in got.iter().zip(want).zip(mag).enumerate() {
        let err = (*g as f64 - *w as f64).abs();
        assert!(
            err <= TOL * m + 1e-30,
            "{what}: output {k}: device {g} vs CPU {w} (error {err:e}, scale {m:e})"
        );
        if *m > 0.0 {
            worst = worst.max(err / m);
        }
    }
    worst
}

fn every_type_against_the_cpu(gpu: &Gpu, ns_main: &[u32]) {
    let mut worst = 0f64;
    for (t, ty) in TYPES.into_iter().enumerate() {
        assert!(has_int8_kernels(ty), "{ty}");
        for (s, cols) in widths(ty).into_iter().enumerate() {
            let rows = [37, 5][s];
            let data = weights(ty, rows, cols, 11 + t as u64 * 10 + s as u64);
            let m = upload(gpu, ty, rows, cols, &data);
            let ns: Vec<u32> = if in_width_child() {
                vec![1, 9, 33]
            } else if t < 2 {
                ns_main.to_vec()
            } else {
                vec![1, [2, 3, 4, 5][t % 4], 9]
            };
            for n in ns {
                let (x_off, x_stride) = if n % 2 == 1 {
                    (3, cols + 5)
                } else {
                    (4, cols + 4)
                };
                let x = activations(x_off + n as usize * x_stride, 200 + n as u64);
                let (y_off, y_stride) = (2, rows + 3);
                let y = product(
                    gpu,
                    &m,
                    &x,
                    x_off as u32,
                    x_stride as u32,
                    n,
                    y_off + n as usize * y_stride,
                    y_off as u32,
                    y_stride as u32,
                );
                let got: Vec<f32> = (0..n as usize)
                    .flat_map(|i| y[y_off + i * y_stride..][..rows].iter().copied())
                    .collect();
                let (want, mag) = cpu(ty, &data, rows, cols, &x, x_off, x_stride, n as usize);
                let e = check(&format!("{ty} {rows}x{cols} n={n}"), &got, &want, &mag);
                worst = worst.max(e);
            }
        }
    }
    eprintln!("largest error against the CPU relative to sum |w*x|: {worst:e}");
}

/// The test device with a GPU's setting of the threads a weight row spreads over (lavapipe,
/// a CPU, takes a block a thread by default): narrow rows share their blocks.
fn gpu_setting() -> Option<Gpu> {
    let mut gpu = test_device()?;
    gpu.set_row_threads(GPU_ROW_THREADS).unwrap();
    Some(gpu)
}

/// At a GPU's setting, at settings where a thread takes four and two sub-blocks of a block at
/// the wider width (a row of three blocks), and at a block a thread (lavapipe's default).
#[test]
fn every_type_matches_the_cpu() {
    let Some(mut gpu) = gpu_setting() else { return };
    if !gpu.int8_dot() {
        eprintln!("skipped: '{}' has no int8 dot products", gpu.info.name);
        return;
    }
    every_type_against_the_cpu(&gpu, &[1, 2, 3, 4, 5, 8, 9, 33]);
    let settings: &[u32] = if in_width_child() { &[1] } else { &[4, 8, 1] };
    for &threads in settings {
        gpu.set_row_threads(threads).unwrap();
        every_type_against_the_cpu(&gpu, &[1, 8, 33]);
    }
    assert_clean(&gpu);
}

/// A row of one block: the CPU's bits where one thread takes the whole block and its term is
/// one product (Q8_0, Q4_0: 32-value blocks); within a rounding of the block where the term has
/// two products or the row is so narrow that its 256-value block is shared among threads, each
/// adding the term of its sub-blocks.
#[test]
fn a_single_block_is_the_cpus_term() {
    let Some(gpu) = gpu_setting() else { return };
    if !gpu.int8_dot() {
        return;
    }
    for (t, ty) in TYPES.into_iter().enumerate() {
        let (rows, cols) = (29, ty.block_size());
        let data = weights(ty, rows, cols, 70 + t as u64);
        let m = upload(&gpu, ty, rows, cols, &data);
        let n = 5;
        let x = activations(n * cols, 71 + t as u64);
        let y = product(
            &gpu,
            &m,
            &x,
            0,
            cols as u32,
            n as u32,
            n * rows,
            0,
            rows as u32,
        );
        let (want, mag) = cpu(ty, &data, rows, cols, &x, 0, cols, n);
        let whole_term = ty.block_size() == 32;
        for k in 0..y.len() {
            if !whole_term {
                let err = (y[k] as f64 - want[k] as f64).abs();
                assert!(
                    err <= TOL * mag[k],
                    "{ty} output {k}: {} vs {}",
                    y[k],
                    want[k]
                );
            } else {
                assert_eq!(y[k].to_bits(), want[k].to_bits(), "{ty} output {k}");
            }
        }
    }
    assert_clean(&gpu);
}

/// Row i of an n-row product (mat-vec, groups, prefill tiles) against the 1-row product of the
/// same x row, bit for bit.
fn check_batch_invariance(gpu: &Gpu, ty: GgmlType, ns: &[u32]) {
    let (rows, cols) = (23, widths(ty)[1]);
    let data = weights(ty, rows, cols, 900);
    let m = upload(gpu, ty, rows, cols, &data);
    let max_n = *ns.iter().max().unwrap() as usize;
    let stride = cols + 4;
    let x = activations(max_n * stride + 4, 901);
    // All single rows in one pass, each its own dispatch.
    let xb = gpu.upload("x", bytemuck::cast_slice(&x)).unwrap();
    let yb = gpu.buffer("y", (max_n * rows * 4) as u64).unwrap();
    let mut rec = Recorder::new(gpu);
    for i in 0..max_n {
        matvec(
            &mut rec,
            &m,
            &xb,
            (i * stride) as u32,
            0,
            1,
            &yb,
            (i * rows) as u32,
            0,
        )
        .unwrap();
    }
    rec.submit(false).unwrap();
    let single = gpu.read_f32(&yb, 0, max_n * rows).unwrap();
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
                for r in 0..rows {
                    assert_eq!(
                        y[i * (rows + 1) + r].to_bits(),
                        single[(first + i) * rows + r].to_bits(),
                        "{ty}: row {r} of x row {} as row {i} of {n}",
                        first + i
                    );
                }
            }
        }
    }
}

#[test]
fn a_row_is_the_same_bits_in_any_batch_and_tile() {
    let Some(gpu) = gpu_setting() else { return };
    if !gpu.int8_dot() {
        return;
    }
    let t = TILE_ROWS;
    if in_width_child() {
        for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::IQ4_XS] {
            check_batch_invariance(&gpu, ty, &[3, 9, t + 5]);
        }
        assert_clean(&gpu);
        return;
    }
    check_batch_invariance(
        &gpu,
        GgmlType::Q4_K,
        &[2, 3, 4, 5, 6, 7, 8, 9, 17, t, t + 1, 2 * t + 9],
    );
    for ty in TYPES {
        check_batch_invariance(&gpu, ty, &[3, 9, t + 5]);
    }
    assert_clean(&gpu);
}

/// `matvec_experts` on the int8 path against `matvec` on each expert's own matrix, bit for bit,
/// for both ways of taking x, with the stack whole and split over several buffers.
fn check_experts(gpu: &Gpu, ty: GgmlType) {
    let (n_expert, rows, cols) = (5, 21, widths(ty)[0]);
    let expert_bytes = rows * ty.row_bytes(cols as u64).unwrap() as usize;
    let data = weights(ty, n_expert * rows, cols, 4321);
    let whole = DeviceExperts::upload(gpu, "exps", ty, n_expert, rows, cols, &data).unwrap();
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
    assert!(whole.int8() && split.int8());
    let singles: Vec<DeviceMatrix> = (0..n_expert)
        .map(|e| {
            upload(
                gpu,
                ty,
                rows,
                cols,
                &data[e * expert_bytes..][..expert_bytes],
            )
        })
        .collect();
    let (n, n_used) = (3usize, 3usize);
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
            for pair in 0..n * n_used {
                let got = &y[pair * y_stride..][..rows];
                let e = ids[pair] as usize;
                if e >= n_expert {
                    assert!(got.iter().all(|v| *v == sentinel), "{ty}: pair {pair}");
                    continue;
                }
                let xr = if x_per_slot { pair } else { pair / n_used };
                let want = product(gpu, &singles[e], &x, (xr * stride) as u32, 0, 1, rows, 0, 0);
                for r in 0..rows {
                    assert_eq!(
                        got[r].to_bits(),
                        want[r].to_bits(),
                        "{ty}: pair {pair} (expert {e}) row {r}, x_per_slot {x_per_slot}"
                    );
                }
            }
        }
    }
}

#[test]
fn experts_match_their_own_matrices() {
    let Some(gpu) = gpu_setting() else { return };
    if !gpu.int8_dot() {
        return;
    }
    let types: &[GgmlType] = if in_width_child() {
        &[GgmlType::Q4_K]
    } else {
        &[GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::Q6_K]
    };
    for &ty in types {
        check_experts(&gpu, ty);
    }
    assert_clean(&gpu);
}

/// The path is the matrix's: the f32 path stays selectable and gives other bits; a type
/// without int8 kernels refuses it; an adapter turned off uploads onto the f32 path.
#[test]
fn the_path_is_chosen_per_matrix() {
    let Some(gpu) = test_device() else { return };
    if !gpu.int8_dot() {
        return;
    }
    let (ty, rows, cols) = (GgmlType::Q4_K, 9, 512);
    let data = weights(ty, rows, cols, 5);
    let mut m = upload(&gpu, ty, rows, cols, &data);
    let x = activations(cols, 6);
    let int8 = product(&gpu, &m, &x, 0, 0, 1, rows, 0, 0);
    m.set_int8(false).unwrap();
    assert!(!m.int8());
    let f32_path = product(&gpu, &m, &x, 0, 0, 1, rows, 0, 0);
    assert_ne!(int8, f32_path);
    let q5_1 = DeviceMatrix::upload(
        &gpu,
        "q5_1",
        GgmlType::Q5_1,
        rows,
        64,
        &weights(GgmlType::Q5_1, rows, 64, 7),
    );
    let mut q5_1 = q5_1.unwrap();
    assert!(!q5_1.int8());
    assert!(matches!(
        q5_1.set_int8(true),
        Err(GpuError::BadTensor { tensor, .. }) if tensor == "q5_1"
    ));
    drop(gpu);
    let mut gpu = test_device().unwrap();
    gpu.disable_int8_dot();
    assert!(gpu.info.to_string().ends_with("int8 dot: no"));
    assert!(!upload_unchecked(&gpu, ty, rows, cols, &data).int8());
    assert_clean(&gpu);
}

fn upload_unchecked(
    gpu: &Gpu,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: &[u8],
) -> DeviceMatrix {
    DeviceMatrix::upload(gpu, "w", ty, rows, cols, data).unwrap()
}

/// lavapipe reports the integer dot product (Vulkan 1.3), so CI runs the int8 path.
#[test]
fn lavapipe_has_int8_dot_products() {
    let Some(gpu) = test_device() else { return };
    if gpu.info.description.contains("llvmpipe") {
        assert!(gpu.int8_dot(), "{}", gpu.info);
        assert!(gpu.info.to_string().ends_with("int8 dot: yes"));
    }
}

/// The checks above at lavapipe's SIMD widths of 4, 8 and 16 lanes.
#[test]
fn lavapipe_vector_widths() {
    rerun_at_lavapipe_widths("lavapipe_vector_widths");
}

/// A product whose reductions end within subgroups gives the bits of the same product reduced
/// through workgroup memory alone, on both paths, whether a row's threads span several
/// subgroups or share one, for a single row, a group of rows and a prefill tile.
#[test]
fn subgroup_reductions_are_the_trees_bits() {
    let Some(mut with) = gpu_setting() else {
        return;
    };
    let Some(mut without) = gpu_setting() else {
        return;
    };
    if with.info.description.contains("llvmpipe") {
        // lavapipe has subgroup shuffles and lays its subgroups out as the products assume.
        assert!(with.subgroup_lanes() >= 4, "{}", with.subgroup_lanes());
    }
    if with.subgroup_lanes() < 2 {
        eprintln!("skipped: '{}' reduces without subgroups", with.info.name);
        return;
    }
    without.disable_subgroups();
    assert_eq!(without.subgroup_lanes(), 1);
    let t = TILE_ROWS;
    for int8 in [true, false] {
        if !int8 {
            with.disable_int8_dot();
            without.disable_int8_dot();
        }
        for (ty, cols) in [
            (GgmlType::Q4_K, 256),
            (GgmlType::Q4_K, 768),
            (GgmlType::Q4_K, 4096),
            (GgmlType::Q6_K, 768),
            (GgmlType::Q8_0, 544),
        ] {
            let rows = 37;
            let data = weights(ty, rows, cols, 500 + cols as u64);
            for threads in [GPU_ROW_THREADS, 1] {
                with.set_row_threads(threads).unwrap();
                without.set_row_threads(threads).unwrap();
                let a = DeviceMatrix::upload(&with, "blk.0.w", ty, rows, cols, &data).unwrap();
                let b = DeviceMatrix::upload(&without, "blk.0.w", ty, rows, cols, &data).unwrap();
                assert_eq!(a.int8(), int8 && with.int8_dot());
                for n in [1, 5, t + 3] {
                    let x = activations(n as usize * cols, 600 + n as u64);
                    let len = n as usize * rows;
                    let ya = product(&with, &a, &x, 0, cols as u32, n, len, 0, rows as u32);
                    let yb = product(&without, &b, &x, 0, cols as u32, n, len, 0, rows as u32);
                    let bits = |y: &[f32]| y.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&ya),
                        bits(&yb),
                        "{ty} {rows}x{cols}, int8 {int8}, {threads} threads a row, n {n}"
                    );
                }
            }
        }
    }
    assert_clean(&with);
    assert_clean(&without);
}
