//! The vision tower's kernels against their scalar definitions: layer norm with a bias, the bias
//! with GELU or added rows, the 2D rotary positions over a patch grid, and full attention.

use half::f16;
use nextn_gpu::kernels::vision::{
    attention_full, bias_act, layer_norm, rope_vision, BiasThen, QkvRows,
};
use nextn_gpu::validation::{assert_clean, test_device};
use nextn_gpu::{Gpu, Recorder};

fn values(n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7919 + salt * 104729) % 2003) as f32 - 1001.0) / 300.0)
        .collect()
}

fn up(gpu: &Gpu, v: &[f32]) -> wgpu::Buffer {
    gpu.upload("t", bytemuck::cast_slice(v)).unwrap()
}

fn close(got: f32, want: f64, rel: f64, what: &str) {
    assert!(
        (got as f64 - want).abs() <= rel * want.abs().max(1.0),
        "{what}: {got} vs {want}"
    );
}

#[test]
fn layer_norm_of_strided_rows() {
    let Some(gpu) = test_device() else { return };
    // A width past the workgroup's 256 threads and one below it.
    for (rows, width) in [(3usize, 300usize), (5, 64)] {
        let (x_off, x_stride, y_off, y_stride) = (7, width + 5, 2, width + 1);
        let x: Vec<f32> = values(x_off + rows * x_stride, 1)
            .iter()
            .map(|v| v + 3.0)
            .collect();
        let w = values(width, 2);
        let b = values(width, 3);
        let (xb, wb, bb) = (up(&gpu, &x), up(&gpu, &w), up(&gpu, &b));
        let yb = gpu
            .buffer("y", ((y_off + rows * y_stride) * 4) as u64)
            .unwrap();
        let mut rec = Recorder::new(&gpu);
        layer_norm(
            &mut rec,
            (&xb, x_off as u32, x_stride as u32),
            rows as u32,
            width as u32,
            &wb,
            &bb,
            (&yb, y_off as u32, y_stride as u32),
            1e-6,
        )
        .unwrap();
        rec.submit(false).unwrap();
        let got = gpu.read_f32(&yb, 0, y_off + rows * y_stride).unwrap();
        for r in 0..rows {
            let row = &x[x_off + r * x_stride..][..width];
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / width as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / width as f64;
            for c in 0..width {
                let want = (row[c] as f64 - mean) / (var + 1e-6).sqrt() * w[c] as f64 + b[c] as f64;
                close(
                    got[y_off + r * y_stride + c],
                    want,
                    1e-5,
                    &format!("row {r} col {c}"),
                );
            }
        }
        // Nothing outside the rows is written.
        assert!(got[..y_off].iter().all(|&v| v == 0.0));
    }
    assert_clean(&gpu);
}

/// ggml's CPU GELU: the tanh form of the f16-rounded input, rounded to f16.
fn gelu_ref(x: f32) -> f32 {
    if x <= -10.0 {
        return 0.0;
    }
    if x >= 10.0 {
        return x;
    }
    let h = f16::from_f32(x).to_f32() as f64;
    let g = 0.5 * h * (1.0 + (0.797_884_560_802_865_4 * h * (1.0 + 0.044715 * h * h)).tanh());
    f16::from_f32(g as f32).to_f32()
}

#[test]
fn bias_then_gelu_or_added_rows() {
    let Some(gpu) = test_device() else { return };
    let (rows, width, off, stride) = (6usize, 45usize, 3usize, 50usize);
    // Values across GELU's whole range, the clamps at ±10 included.
    let y: Vec<f32> = values(off + rows * stride, 4)
        .iter()
        .map(|v| v * 3.5)
        .collect();
    let b = values(width, 5);
    let extra = values(rows * width, 6);
    let bb = up(&gpu, &b);
    let eb = up(&gpu, &extra);
    for (gelu, add) in [(true, false), (false, true), (true, true), (false, false)] {
        let yb = up(&gpu, &y);
        let mut rec = Recorder::new(&gpu);
        let then = BiasThen {
            add: add.then_some((&eb, 0u32, width as u32)),
            gelu,
        };
        bias_act(
            &mut rec,
            &yb,
            off as u32,
            stride as u32,
            rows as u32,
            width as u32,
            &bb,
            then,
        )
        .unwrap();
        rec.submit(false).unwrap();
        let got = gpu.read_f32(&yb, 0, y.len()).unwrap();
        let mut flips = 0;
        for (i, (&g, &old)) in got.iter().zip(&y).enumerate() {
            let inside = i >= off && (i - off) % stride < width && i < off + rows * stride;
            if !inside {
                assert_eq!(g.to_bits(), old.to_bits(), "element {i} outside the rows");
                continue;
            }
            let (r, c) = ((i - off) / stride, (i - off) % stride);
            let mut v = old + b[c];
            if add {
                v += extra[r * width + c];
            }
            if gelu {
                let want = gelu_ref(v);
                if g != want {
                    // The device's tanh may differ from libm's by an ulp, which can move the
                    // f16 rounding by one step: allowed now and then, never more than a step.
                    flips += 1;
                    let step = (f16::from_f32(want).to_bits() as i32
                        - f16::from_f32(g).to_bits() as i32)
                        .abs();
                    assert!(step <= 1, "gelu({v}) = {g}, want {want}");
                }
            } else {
                assert_eq!(g.to_bits(), v.to_bits(), "row {r} col {c}");
            }
        }
        assert!(
            flips <= rows * width / 50,
            "{flips} GELU values one f16 step off"
        );
    }
    assert_clean(&gpu);
}

/// The merge-order patch `k` of a grid `nx` wide: (y, x).
fn patch_yx(k: usize, nx: usize) -> (usize, usize) {
    let block = k / 4;
    let bx = nx / 2;
    (2 * (block / bx) + (k % 4) / 2, 2 * (block % bx) + k % 2)
}

#[test]
fn rope_turns_q_and_k_by_the_patch_row_and_column() {
    let Some(gpu) = test_device() else { return };
    let (nx, ny, n_head, d) = (6usize, 4usize, 3usize, 16usize);
    let rows = nx * ny;
    let e = n_head * d;
    let (off, stride) = (5usize, 3 * e + 2);
    let qkv = values(off + rows * stride, 7);
    let buf = up(&gpu, &qkv);
    let scale = 10000f32.powf(-2.0 / (d / 2) as f32);
    let mut rec = Recorder::new(&gpu);
    let rows_of = QkvRows {
        buf: &buf,
        off: off as u32,
        stride: stride as u32,
        rows: rows as u32,
        n_head: n_head as u32,
        d: d as u32,
        k_off: e as u32,
        v_off: 2 * e as u32,
    };
    rope_vision(&mut rec, &rows_of, nx as u32, scale).unwrap();
    rec.submit(false).unwrap();
    let got = gpu.read_f32(&buf, 0, qkv.len()).unwrap();
    let (half, quarter) = (d / 2, d / 4);
    for k in 0..rows {
        let (y, x) = patch_yx(k, nx);
        let row = off + k * stride;
        for part in 0..3 {
            for h in 0..n_head {
                for i in 0..half {
                    let a = row + part * e + h * d + i;
                    if part == 2 {
                        // The v part is left alone.
                        assert_eq!(got[a].to_bits(), qkv[a].to_bits());
                        assert_eq!(got[a + half].to_bits(), qkv[a + half].to_bits());
                        continue;
                    }
                    let (pos, pw) = if i < quarter {
                        (y, i)
                    } else {
                        (x, i - quarter)
                    };
                    let theta = pos as f64 * (scale as f64).powi(pw as i32);
                    let (x0, x1) = (qkv[a] as f64, qkv[a + half] as f64);
                    let w0 = x0 * theta.cos() - x1 * theta.sin();
                    let w1 = x0 * theta.sin() + x1 * theta.cos();
                    let what = format!("patch {k} part {part} head {h} pair {i}");
                    assert!(
                        (got[a] as f64 - w0).abs() < 2e-5 * (1.0 + pos as f64),
                        "{what}"
                    );
                    assert!(
                        (got[a + half] as f64 - w1).abs() < 2e-5 * (1.0 + pos as f64),
                        "{what}"
                    );
                }
            }
        }
    }
    // A grid of odd width cannot be in merge order.
    let mut rec = Recorder::new(&gpu);
    assert!(rope_vision(&mut rec, &rows_of, 5, scale).is_err());
    assert_clean(&gpu);
}

#[test]
fn full_attention_sees_every_key() {
    let Some(gpu) = test_device() else { return };
    // Row counts that fill the last query block and key chunk and that leave them partial;
    // heads of 16 and of 72 values (the real tower's).
    for (n, n_head, d) in [(37usize, 3usize, 16usize), (16, 2, 72), (9, 1, 128)] {
        let e = n_head * d;
        let (off, stride) = (4usize, 3 * e + 3);
        let qkv: Vec<f32> = values(off + n * stride, n + d)
            .iter()
            .map(|v| v * 0.6)
            .collect();
        let buf = up(&gpu, &qkv);
        let (out_off, out_stride) = (2usize, e + 5);
        let out = gpu
            .buffer("o", ((out_off + n * out_stride) * 4) as u64)
            .unwrap();
        let scale = 1.0 / (d as f32).sqrt();
        let rows = QkvRows {
            buf: &buf,
            off: off as u32,
            stride: stride as u32,
            rows: n as u32,
            n_head: n_head as u32,
            d: d as u32,
            k_off: e as u32,
            v_off: 2 * e as u32,
        };
        let mut rec = Recorder::new(&gpu);
        attention_full(
            &mut rec,
            &rows,
            scale,
            (&out, out_off as u32, out_stride as u32),
        )
        .unwrap();
        rec.submit(false).unwrap();
        let got = gpu.read_f32(&out, 0, out_off + n * out_stride).unwrap();
        let at = |r: usize, part: usize, h: usize, c: usize| {
            qkv[off + r * stride + part * e + h * d + c] as f64
        };
        for h in 0..n_head {
            for q in 0..n {
                let s: Vec<f64> = (0..n)
                    .map(|j| {
                        (0..d).map(|c| at(q, 0, h, c) * at(j, 1, h, c)).sum::<f64>() * scale as f64
                    })
                    .collect();
                let top = s.iter().cloned().fold(f64::MIN, f64::max);
                let p: Vec<f64> = s.iter().map(|v| (v - top).exp()).collect();
                let total: f64 = p.iter().sum();
                for c in 0..d {
                    let want = (0..n).map(|j| p[j] * at(j, 2, h, c)).sum::<f64>() / total;
                    close(
                        got[out_off + q * out_stride + h * d + c],
                        want,
                        2e-5,
                        &format!("n {n} head {h} query {q} channel {c}"),
                    );
                }
            }
        }
        assert!(got[..out_off].iter().all(|&v| v == 0.0));
    }
    assert_clean(&gpu);
}

/// A query's output has the same bits whatever rows share its pass: the first rows of a longer
/// pass against a pass of those rows alone would differ in their keys, so the test takes the
/// same keys in a shifted layout instead (queries in another workgroup slot).
#[test]
fn a_query_does_not_depend_on_its_workgroup_neighbours() {
    let Some(gpu) = test_device() else { return };
    let (n, n_head, d) = (21usize, 2usize, 16usize);
    let e = n_head * d;
    let stride = 3 * e;
    let qkv = values(n * stride, 11);
    // The same rows with every query row rotated by 3: row r's keys and values unchanged.
    let mut rotated = qkv.clone();
    for r in 0..n {
        let src = (r + 3) % n;
        rotated[r * stride..r * stride + e].copy_from_slice(&qkv[src * stride..src * stride + e]);
    }
    let mut outs = Vec::new();
    for data in [&qkv, &rotated] {
        let buf = up(&gpu, data);
        let out = gpu.buffer("o", (n * e * 4) as u64).unwrap();
        let rows = QkvRows {
            buf: &buf,
            off: 0,
            stride: stride as u32,
            rows: n as u32,
            n_head: n_head as u32,
            d: d as u32,
            k_off: e as u32,
            v_off: 2 * e as u32,
        };
        let mut rec = Recorder::new(&gpu);
        attention_full(&mut rec, &rows, 0.25, (&out, 0, e as u32)).unwrap();
        rec.submit(false).unwrap();
        outs.push(gpu.read_f32(&out, 0, n * e).unwrap());
    }
    for r in 0..n {
        let src = (r + 3) % n;
        for c in 0..e {
            assert_eq!(
                outs[1][r * e + c].to_bits(),
                outs[0][src * e + c].to_bits(),
                "query {src} in slot {r}, value {c}"
            );
        }
    }
    assert_clean(&gpu);
}

#[test]
fn bad_shapes_are_refused() {
    let Some(gpu) = test_device() else { return };
    let buf = gpu.buffer("q", 64 * 4).unwrap();
    let out = gpu.buffer("o", 64 * 4).unwrap();
    let mut rows = QkvRows {
        buf: &buf,
        off: 0,
        stride: 48,
        rows: 4,
        n_head: 1,
        d: 16,
        k_off: 16,
        v_off: 32,
    };
    let mut rec = Recorder::new(&gpu);
    // Four rows of 48 do not fit in 64 values.
    let e = attention_full(&mut rec, &rows, 1.0, (&out, 0, 16)).unwrap_err();
    assert!(e.to_string().contains("attention_full rows"), "{e}");
    rows.rows = 1;
    rows.d = 160;
    rows.k_off = 0;
    rows.v_off = 0;
    rows.stride = 0;
    let big = gpu.buffer("b", 1024 * 4).unwrap();
    rows.buf = &big;
    let e = attention_full(&mut rec, &rows, 1.0, (&out, 0, 0)).unwrap_err();
    assert!(e.to_string().contains("over 128"), "{e}");
    assert!(rec.is_empty());
    assert_clean(&gpu);
}

/// Every test above again at lavapipe's 4, 8 and 16 lanes.
#[test]
fn at_every_lavapipe_width() {
    nextn_gpu::validation::rerun_at_lavapipe_widths("at_every_lavapipe_width");
}
