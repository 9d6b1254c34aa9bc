//! RMSNorm on the device against the scalar definition (its quantized output against the
//! products' own quantization is in fused.rs).

use nextn_gpu::kernels::norm::{norm_quant, NormOut};
use nextn_gpu::validation::{assert_clean, test_device};
use nextn_gpu::Recorder;

fn reference(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ss: f64 = x.iter().map(|v| (*v as f64) * (*v as f64)).sum();
    let scale = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| v * scale * g).collect()
}

#[test]
fn rms_norm_matches_the_definition() {
    let Some(gpu) = test_device() else { return };
    for (rows, width) in [(1usize, 64usize), (3, 1000), (9, 257)] {
        let x: Vec<f32> = (0..rows * width)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        let w: Vec<f32> = (0..width).map(|i| 0.5 + (i % 7) as f32 / 5.0).collect();
        let xb = gpu.upload("x", bytemuck::cast_slice(&x)).unwrap();
        let wb = gpu.upload("w", bytemuck::cast_slice(&w)).unwrap();
        let yb = gpu.buffer("y", (rows * width * 4) as u64).unwrap();
        let mut rec = Recorder::new(&gpu);
        let out = NormOut {
            y: Some((&yb, 0, width as u32)),
            ..NormOut::default()
        };
        norm_quant(
            &mut rec,
            &xb,
            0,
            width as u32,
            width as u32,
            rows as u32,
            1,
            width as u32,
            &wb,
            0,
            0,
            &out,
            1e-6,
        )
        .unwrap();
        rec.submit(false).unwrap();
        let y = gpu.read_f32(&yb, 0, rows * width).unwrap();
        for r in 0..rows {
            let want = reference(&x[r * width..(r + 1) * width], &w, 1e-6);
            for (a, b) in y[r * width..(r + 1) * width].iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                    "row {r}: {a} vs {b}"
                );
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
