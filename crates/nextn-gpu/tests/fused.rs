//! The fused forms of the layer's steps against the separate kernels they replace, bit for bit:
//! the norm that quantizes its own results, products that add into a residual or scale, a
//! gate|up pair with SwiGLU in its epilogue, and products over rows quantized beforehand.
//! (The separate kernels are tested against their scalar definitions in their own files.)

use nextn_gguf::GgmlType;
use nextn_gpu::kernels::attention::{attention, attention_quant, AttentionScratch};
use nextn_gpu::kernels::delta_net::{gated_norm, DeltaNetShape, Rows as DnRows};
use nextn_gpu::kernels::elementwise::{swiglu, Rows};
use nextn_gpu::kernels::matvec::QuantOut;
use nextn_gpu::kernels::matvec::{
    matvec, product, quant_layout, ActBlocks, Acts, Epilogue, TILE_ROWS,
};
use nextn_gpu::kernels::norm::{norm_quant, NormOut};
use nextn_gpu::kv::{DeviceKv, KvElem};
use nextn_gpu::validation::{assert_clean, rerun_at_lavapipe_widths, test_device};
use nextn_gpu::{DeviceMatrix, Gpu, Recorder};
use nextn_quant::formats;

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
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
}

fn weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let row_bytes = ty.row_bytes(cols as u64).unwrap() as usize;
    let mut out = vec![0u8; rows * row_bytes];
    for r in 0..rows {
        let src = rng.vec(cols, 0.1 + (r % 5) as f32 / 4.0);
        formats::quantize(ty, &src, &mut out[r * row_bytes..(r + 1) * row_bytes]).unwrap();
    }
    out
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn upload(gpu: &Gpu, x: &[f32]) -> wgpu::Buffer {
    gpu.upload("x", bytemuck::cast_slice(x)).unwrap()
}

/// In the children of `rerun_at_lavapipe_widths` (which compile every module afresh, without
/// the shader cache): fewer batch sizes and types, each module kind still run.
fn in_width_child() -> bool {
    std::env::var_os("NEXTN_TEST_LAVAPIPE_WIDTH").is_some()
}

/// Batch sizes that run every kind of module: 1..=9, and past a prefill tile (in the width
/// children a group of rows and a tile).
fn batches() -> Vec<u32> {
    if in_width_child() {
        return vec![3, TILE_ROWS + 3];
    }
    let mut v: Vec<u32> = (1..=9).collect();
    v.push(TILE_ROWS + 3);
    v
}

/// Types on both paths: int8 activations (Q8_0 blocks for Q4_0, Q8_K for the K types) where the
/// adapter has integer dot products, f32 activations for Q5_0 and F16.
const TYPES: [GgmlType; 5] = [
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::F16,
];

/// Products over rows a kernel quantized as it made them have the bits of products that quantize
/// the same rows (read back as f32) themselves: for every int8 type, from row `rows[i]` of the
/// kernel's f32 output `f32_rows` (`cols` wide), against its quantized rows `q` (Q8_0 or Q8_K).
#[allow(clippy::too_many_arguments)]
fn check_quantized(
    gpu: &Gpu,
    rng: &mut Rng,
    cols: usize,
    f32_rows: &[f32],
    rows: &[usize],
    q0: Option<&wgpu::Buffer>,
    qk: Option<&wgpu::Buffer>,
    what: &str,
) {
    let all = [
        (GgmlType::Q4_K, qk),
        (GgmlType::Q8_0, q0),
        (GgmlType::Q6_K, qk),
        (GgmlType::Q4_0, q0),
    ];
    let kinds = if in_width_child() { 2 } else { all.len() };
    for (ty, q) in all.into_iter().take(kinds) {
        let Some(q) = q else { continue };
        let m_rows = 37;
        let data = weights(ty, m_rows, cols, rng);
        let m = DeviceMatrix::upload(gpu, "blk.0.w", ty, m_rows, cols, &data).unwrap();
        if !m.int8() {
            continue;
        }
        let n = rows.len();
        let src: Vec<f32> = rows
            .iter()
            .flat_map(|&r| f32_rows[r * cols..(r + 1) * cols].to_vec())
            .collect();
        let fb = upload(gpu, &src);
        let (ya, yb) = (
            gpu.buffer("ya", (n * m_rows * 4) as u64).unwrap(),
            gpu.buffer("yb", (n * m_rows * 4) as u64).unwrap(),
        );
        let mut rec = Recorder::new(gpu);
        matvec(
            &mut rec,
            &m,
            &fb,
            0,
            cols as u32,
            n as u32,
            &ya,
            0,
            m_rows as u32,
        )
        .unwrap();
        let acts = Acts {
            q8_0: Some(q),
            q8k: Some(q),
            ..Acts::f32(&fb, 0, cols as u32)
        };
        product(
            &mut rec,
            &m,
            &acts,
            n as u32,
            &yb,
            0,
            m_rows as u32,
            Epilogue::default(),
        )
        .unwrap();
        rec.submit(false).unwrap();
        let a = gpu.read_f32(&ya, 0, n * m_rows).unwrap();
        let b = gpu.read_f32(&yb, 0, n * m_rows).unwrap();
        assert_eq!(bits(&a), bits(&b), "{what}: {ty} over the quantized rows");
    }
}

/// The fused norm's quantized rows are those the products make of its f32 rows; parts normed on
/// their own and picked rows land where they are sent.
#[test]
fn norm_quant_quantizes_as_the_products_do() {
    let Some(gpu) = test_device() else { return };
    let mut rng = Rng(1);
    let shapes: &[(usize, usize)] = if in_width_child() {
        &[(512, 2)]
    } else {
        &[(256, 1), (512, 2), (1024, 1)]
    };
    for &(width, parts) in shapes {
        let cols = width * parts;
        let n = 5usize;
        let mut x = rng.vec(n * cols + 7, 3.0);
        // An exact tie for the quantizers and a zero block.
        x[7] = 127.0;
        for v in &mut x[7 + 256..7 + 288] {
            *v = 0.0;
        }
        let w = rng.vec(parts * width, 1.5);
        let (xb, wb) = (upload(&gpu, &x), upload(&gpu, &w));
        // All rows as f32 and both quantizations; rows 1 and 3 picked to 0 and 1.
        let l0 = quant_layout(cols, ActBlocks::Q8_0).unwrap();
        let lk = quant_layout(cols, ActBlocks::Q8K).unwrap();
        let y = gpu.buffer("y", (n * cols * 4) as u64).unwrap();
        let q0 = gpu
            .buffer("q0", (n * l0.stride as usize * 4) as u64)
            .unwrap();
        let qk = gpu
            .buffer("qk", (n * lk.stride as usize * 4) as u64)
            .unwrap();
        let pick_ids = [u32::MAX, 0, u32::MAX, 1, u32::MAX];
        let pick = gpu.upload("pick", bytemuck::cast_slice(&pick_ids)).unwrap();
        let q0p = gpu
            .buffer("q0p", (2 * l0.stride as usize * 4) as u64)
            .unwrap();
        let picked = gpu.buffer("picked", (2 * cols * 4) as u64).unwrap();
        let mut rec = Recorder::new(&gpu);
        let all = NormOut {
            y: Some((&y, 0, cols as u32)),
            q8_0: Some(&q0),
            q8k: Some(&qk),
            ..NormOut::default()
        };
        let some = NormOut {
            q8_0: Some(&q0p),
            pick: Some((&pick, 0)),
            picked: Some((&picked, 0, cols as u32)),
            ..NormOut::default()
        };
        for out in [&all, &some] {
            norm_quant(
                &mut rec,
                &xb,
                7,
                cols as u32,
                width as u32,
                n as u32,
                parts as u32,
                width as u32,
                &wb,
                0,
                width as u32,
                out,
                1e-6,
            )
            .unwrap();
        }
        rec.submit(false).unwrap();
        let normed = gpu.read_f32(&y, 0, n * cols).unwrap();
        // Each part normed on its own: a part's values do not depend on the other part.
        if parts == 2 {
            let alone = gpu.buffer("alone", (n * width * 4) as u64).unwrap();
            let mut rec = Recorder::new(&gpu);
            let out = NormOut {
                y: Some((&alone, 0, width as u32)),
                ..NormOut::default()
            };
            norm_quant(
                &mut rec,
                &xb,
                7 + width as u32,
                cols as u32,
                width as u32,
                n as u32,
                1,
                width as u32,
                &wb,
                width as u32,
                0,
                &out,
                1e-6,
            )
            .unwrap();
            rec.submit(false).unwrap();
            let alone = gpu.read_f32(&alone, 0, n * width).unwrap();
            for r in 0..n {
                assert_eq!(
                    bits(&alone[r * width..(r + 1) * width]),
                    bits(&normed[r * cols + width..(r + 1) * cols]),
                    "second part of row {r}"
                );
            }
        }
        let got = gpu.read_f32(&picked, 0, 2 * cols).unwrap();
        assert_eq!(
            bits(&got),
            bits(&[&normed[cols..2 * cols], &normed[3 * cols..4 * cols]].concat()),
            "picked rows"
        );
        let what = format!("norm of {parts} x {width}");
        let every: Vec<usize> = (0..n).collect();
        check_quantized(
            &gpu,
            &mut rng,
            cols,
            &normed,
            &every,
            Some(&q0),
            Some(&qk),
            &what,
        );
        check_quantized(
            &gpu,
            &mut rng,
            cols,
            &normed,
            &[1, 3],
            Some(&q0p),
            None,
            &what,
        );
    }
    assert_clean(&gpu);
}

/// The delta net's gated norm and attention's merge quantize their outputs as the products do.
#[test]
fn gated_norm_and_merge_quantize_as_the_products_do() {
    let Some(gpu) = test_device() else { return };
    let mut rng = Rng(3);
    // The gated norm: 16 heads of 128 (the models'), and 6 heads of 64 quantized in Q8_0 only.
    for (hv, dv) in [(16u32, 128u32), (6, 64)] {
        let s = DeltaNetShape {
            k_heads: 2,
            v_heads: hv,
            key_head: 16,
            value_head: dv,
            kernel: 4,
        };
        let (n, vd) = (3usize, (hv * dv) as usize);
        let (o, z) = (rng.vec(n * vd, 0.5), rng.vec(n * vd, 4.0));
        let w = rng.vec(dv as usize, 1.0);
        let (ob, zb, wb) = (upload(&gpu, &o), upload(&gpu, &z), upload(&gpu, &w));
        let y = gpu.buffer("y", (n * vd * 4) as u64).unwrap();
        let lk = quant_layout(vd, ActBlocks::Q8K);
        let l0 = quant_layout(vd, ActBlocks::Q8_0).unwrap();
        let q0 = gpu
            .buffer("q0", (n * l0.stride as usize * 4) as u64)
            .unwrap();
        let qk = lk.map(|l| {
            gpu.buffer("qk", (n * l.stride as usize * 4) as u64)
                .unwrap()
        });
        let mut rec = Recorder::new(&gpu);
        gated_norm(
            &mut rec,
            &s,
            DnRows::packed(&ob, vd as u32),
            DnRows::packed(&zb, vd as u32),
            &wb,
            n as u32,
            1e-6,
            DnRows::packed(&y, vd as u32),
            &QuantOut {
                q8_0: Some(&q0),
                q8k: qk.as_ref(),
                row0: 0,
            },
        )
        .unwrap();
        rec.submit(false).unwrap();
        let yv = gpu.read_f32(&y, 0, n * vd).unwrap();
        check_quantized(
            &gpu,
            &mut rng,
            vd,
            &yv,
            &[0, 1, 2],
            Some(&q0),
            qk.as_ref(),
            &format!("gated norm {hv} x {dv}"),
        );
    }
    // The merge: 8 query heads of 256 over 2 kv heads, 3 rows after 140 cached positions.
    let (hd, n_head, n_kv, start, n) = (256usize, 8usize, 2usize, 140usize, 3usize);
    let mut kv = DeviceKv::new(&gpu, KvElem::F16, KvElem::F16, n_kv, hd, start + n).unwrap();
    let width = n_kv * hd;
    let rows_k: Vec<u8> = rng
        .vec((start + n) * width, 1.0)
        .iter()
        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
        .collect();
    let rows_v: Vec<u8> = rng
        .vec((start + n) * width, 1.0)
        .iter()
        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
        .collect();
    kv.append_rows(&gpu, &rows_k, &rows_v, start + n).unwrap();
    let q_row = 2 * n_head * hd;
    let q = upload(&gpu, &rng.vec(n * q_row, 2.0));
    let ow = n_head * hd;
    let (plain, quant) = (
        gpu.buffer("o", (n * ow * 4) as u64).unwrap(),
        gpu.buffer("o2", (n * ow * 4) as u64).unwrap(),
    );
    let lk = quant_layout(ow, ActBlocks::Q8K).unwrap();
    let l0 = quant_layout(ow, ActBlocks::Q8_0).unwrap();
    let qk = gpu
        .buffer("qk", (n * lk.stride as usize * 4) as u64)
        .unwrap();
    let q0 = gpu
        .buffer("q0", (n * l0.stride as usize * 4) as u64)
        .unwrap();
    let mut scratch = AttentionScratch::new();
    let mut rec = Recorder::new(&gpu);
    let args = |out| (out, q_row as u32, (2 * hd) as u32, hd as u32, n_head as u32);
    let (o1, qr, qh, gate, nh) = args(&plain);
    attention(
        &mut rec,
        &mut scratch,
        &q,
        0,
        qr,
        qh,
        gate,
        nh,
        &kv,
        n as u32,
        start as u32,
        o1,
        0,
        ow as u32,
    )
    .unwrap();
    // As two sequences' segments of one pass: row 0, then rows 1 and 2, each quantized at its
    // row of the pass.
    for (first, rows) in [(0usize, 1usize), (1, 2)] {
        let qo = QuantOut {
            q8_0: Some(&q0),
            q8k: Some(&qk),
            row0: first as u32,
        };
        attention_quant(
            &mut rec,
            &mut scratch,
            &q,
            (first * q_row) as u32,
            qr,
            qh,
            gate,
            nh,
            &kv,
            rows as u32,
            (start + first) as u32,
            &quant,
            (first * ow) as u32,
            ow as u32,
            &qo,
        )
        .unwrap();
    }
    rec.submit(false).unwrap();
    let a = gpu.read_f32(&plain, 0, n * ow).unwrap();
    let b = gpu.read_f32(&quant, 0, n * ow).unwrap();
    assert_eq!(
        bits(&a),
        bits(&b),
        "the merge's f32 output with and without quantizing"
    );
    let every: Vec<usize> = (0..n).collect();
    check_quantized(
        &gpu,
        &mut rng,
        ow,
        &a,
        &every,
        Some(&q0),
        Some(&qk),
        "attention merge",
    );
    assert_clean(&gpu);
}

/// A product that adds into a residual with a power-of-two scale (exact) is the stored product,
/// scaled, added to what was there; a gate|up pair is the two products through SwiGLU.
#[test]
fn epilogues_and_pairs_are_the_separate_steps() {
    let Some(gpu) = test_device() else { return };
    let mut rng = Rng(2);
    // In the width children one type on each path.
    let types: &[GgmlType] = if in_width_child() {
        &[GgmlType::Q4_K, GgmlType::Q5_0]
    } else {
        &TYPES
    };
    for &ty in types {
        let (rows, cols) = (45usize, 512usize);
        let gate = weights(ty, rows, cols, &mut rng);
        let up = weights(ty, rows, cols, &mut rng);
        let mg = DeviceMatrix::upload(&gpu, "blk.0.ffn_gate", ty, rows, cols, &gate).unwrap();
        let mu = DeviceMatrix::upload(&gpu, "blk.0.ffn_up", ty, rows, cols, &up).unwrap();
        let pair = DeviceMatrix::upload_pair(&gpu, "blk.0.ffn_gate_up", ty, rows, cols, &gate, &up)
            .unwrap();
        assert!(pair.is_pair() && pair.rows() == rows);
        for n in batches() {
            let nu = n as usize;
            let x = rng.vec(nu * cols, 2.0);
            let xb = upload(&gpu, &x);
            let resid = rng.vec(nu * rows, 1.0);
            let g = gpu.buffer("g", (nu * rows * 4) as u64).unwrap();
            let u = gpu.buffer("u", (nu * rows * 4) as u64).unwrap();
            let act = gpu.buffer("act", (nu * rows * 4) as u64).unwrap();
            let fused = gpu.buffer("fused", (nu * rows * 4) as u64).unwrap();
            let added = upload(&gpu, &resid);
            let (rw, nn) = (rows as u32, n);
            let mut rec = Recorder::new(&gpu);
            matvec(&mut rec, &mg, &xb, 0, cols as u32, nn, &g, 0, rw).unwrap();
            matvec(&mut rec, &mu, &xb, 0, cols as u32, nn, &u, 0, rw).unwrap();
            swiglu(
                &mut rec,
                Rows::new(&g, 0, rw),
                Rows::new(&u, 0, rw),
                &act,
                nn,
                rw,
            )
            .unwrap();
            let acts = Acts::f32(&xb, 0, cols as u32);
            product(
                &mut rec,
                &pair,
                &acts,
                nn,
                &fused,
                0,
                rw,
                Epilogue::default(),
            )
            .unwrap();
            let epi = Epilogue {
                add: true,
                scale: 0.5,
            };
            product(&mut rec, &mg, &acts, nn, &added, 0, rw, epi).unwrap();
            rec.submit(false).unwrap();
            let want = gpu.read_f32(&act, 0, nu * rows).unwrap();
            let got = gpu.read_f32(&fused, 0, nu * rows).unwrap();
            assert_eq!(bits(&got), bits(&want), "{ty}: pair of {n} rows");
            let gv = gpu.read_f32(&g, 0, nu * rows).unwrap();
            let want: Vec<f32> = resid.iter().zip(&gv).map(|(r, g)| r + g * 0.5).collect();
            let got = gpu.read_f32(&added, 0, nu * rows).unwrap();
            assert_eq!(bits(&got), bits(&want), "{ty}: residual of {n} rows");
        }
    }
    assert_clean(&gpu);
}

/// Every test above again at lavapipe's 4, 8 and 16 lanes.
#[test]
fn at_every_lavapipe_width() {
    rerun_at_lavapipe_widths("at_every_lavapipe_width");
}
