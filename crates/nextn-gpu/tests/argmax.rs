//! The device's top-1 of logits rows against the host sampler's rule: the largest value that is
//! not NaN, the lowest index among equal values (−0 equals +0), none for an all-NaN row.
//! Exact: an index and a value are compared bit for bit.

use nextn_gpu::kernels::argmax::{argmax_rows, NO_INDEX};
use nextn_gpu::validation::{assert_clean, test_device};
use nextn_gpu::Recorder;

/// The rule as a plain scan: a later value wins only when strictly larger.
fn reference(row: &[f32]) -> Option<(u32, f32)> {
    let mut best: Option<(u32, f32)> = None;
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i as u32, v));
        }
    }
    best
}

/// A row of `width` values with ties at its maximum, NaNs, infinities and signed zeros placed by
/// `seed`.
fn row(width: usize, seed: usize) -> Vec<f32> {
    let mut r: Vec<f32> = (0..width)
        .map(|i| ((i * 7919 + seed * 104_729) % 1009) as f32 / 97.0 - 5.0)
        .collect();
    match seed % 6 {
        0 => {
            // The maximum at several places, the first one late.
            let m = 11.5;
            for k in [width * 2 / 3, width - 1, width / 3 + 1] {
                r[k.min(width - 1)] = m;
            }
        }
        1 => {
            for v in r.iter_mut().step_by(3) {
                *v = f32::NAN;
            }
        }
        2 => r.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
        3 => {
            r.iter_mut().for_each(|v| *v = -1.0);
            r[width / 2] = 0.0;
            r[width / 4] = -0.0;
        }
        4 => r.iter_mut().for_each(|v| *v = f32::NAN),
        _ => r[width - 1] = f32::INFINITY,
    }
    r
}

#[test]
fn argmax_rows_follow_the_host_rule() {
    let Some(gpu) = test_device() else { return };
    for (rows, width, pad) in [
        (1usize, 1usize, 0usize),
        (2, 7, 3),
        (3, 255, 1),
        (4, 256, 0),
        (5, 257, 5),
        (8, 1000, 0),
        (9, 5003, 2),
    ] {
        let stride = width + pad;
        let x_off = 3;
        let mut x = vec![0.0f32; x_off + rows * stride];
        let mut rows_in = Vec::new();
        for r in 0..rows {
            let v = row(width, r + width);
            x[x_off + r * stride..x_off + r * stride + width].copy_from_slice(&v);
            rows_in.push(v);
        }
        let xb = gpu.upload("x", bytemuck::cast_slice(&x)).unwrap();
        let out = gpu.buffer("top1", (rows * 8) as u64).unwrap();
        let mut rec = Recorder::new(&gpu);
        argmax_rows(
            &mut rec,
            &xb,
            x_off as u32,
            stride as u32,
            width as u32,
            rows as u32,
            &out,
            0,
        )
        .unwrap();
        rec.submit(false).unwrap();
        let got = gpu.read_u32(&out, 0, 2 * rows).unwrap();
        for (r, v) in rows_in.iter().enumerate() {
            let (idx, bits) = (got[2 * r], got[2 * r + 1]);
            match reference(v) {
                None => assert_eq!(idx, NO_INDEX, "{rows}x{width} row {r}: all NaN"),
                Some((want, value)) => {
                    assert_eq!(idx, want, "{rows}x{width} row {r}");
                    // A −0 comes back as +0: equal to it, as the rule has it.
                    assert_eq!(f32::from_bits(bits), value, "{rows}x{width} row {r}");
                }
            }
        }
    }
    assert_clean(&gpu);
}

/// Every test above again at lavapipe's 4, 8 and 16 lanes.
#[test]
fn at_every_lavapipe_width() {
    nextn_gpu::validation::rerun_at_lavapipe_widths("at_every_lavapipe_width");
}
