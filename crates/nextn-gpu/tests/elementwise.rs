//! The small kernels against their scalar definitions.

use nextn_gpu::kernels::elementwise::{
    copy_bandwidth, copy_words, moe_combine, moe_route, swiglu, Rows,
};
use nextn_gpu::validation::{assert_clean, test_device};
use nextn_gpu::{Gpu, Recorder, Timing};

fn values(n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7919 + salt * 104729) % 2003) as f32 - 1001.0) / 300.0)
        .collect()
}

fn up(gpu: &Gpu, v: &[f32]) -> wgpu::Buffer {
    gpu.upload("t", bytemuck::cast_slice(v)).unwrap()
}

#[test]
fn swiglu_of_strided_rows() {
    let Some(gpu) = test_device() else { return };
    let (n, w, stride) = (5usize, 37usize, 50usize);
    let a = values(n * stride, 1);
    let b = values(n * w, 2);
    let (ab, bb) = (up(&gpu, &a), up(&gpu, &b));
    let sb = gpu.buffer("s", (n * w * 4) as u64).unwrap();
    let mut rec = Recorder::new(&gpu);
    swiglu(
        &mut rec,
        Rows::new(&ab, 3, stride as u32),
        Rows::new(&bb, 0, w as u32),
        &sb,
        n as u32,
        w as u32,
    )
    .unwrap();
    rec.submit(false).unwrap();
    let got_s = gpu.read_f32(&sb, 0, n * w).unwrap();
    for r in 0..n {
        for c in 0..w {
            let x = a[3 + r * stride + c];
            let s = x / (1.0 + (-x).exp()) * b[r * w + c];
            let i = r * w + c;
            assert!(
                (got_s[i] - s).abs() <= 1e-5 * s.abs().max(1.0),
                "swiglu {i}"
            );
        }
    }
    assert_clean(&gpu);
}

#[test]
fn moe_routing_and_combination() {
    let Some(gpu) = test_device() else { return };
    let (n, ne, k, w) = (4usize, 64usize, 8usize, 24usize);
    // Router logits rows with the shared expert's gate after them, as one stacked product leaves
    // them.
    let stride = ne + 1;
    let mut logits = values(n * stride, 3);
    // A tie: the lower expert id goes first.
    logits[5] = 9.0;
    logits[9] = 9.0;
    let lb = up(&gpu, &logits);
    let ids = gpu.buffer("ids", (n * k * 4) as u64).unwrap();
    let wts = gpu.buffer("w", (n * k * 4) as u64).unwrap();
    let y = values(n * k * w, 4);
    let shared = values(n * w, 5);
    let gate: Vec<f32> = (0..n).map(|r| logits[r * stride + ne]).collect();
    let resid = values(n * w, 7);
    let (yb, sb) = (up(&gpu, &y), up(&gpu, &shared));
    let out = up(&gpu, &resid);
    let mut rec = Recorder::new(&gpu);
    moe_route(
        &mut rec,
        &lb,
        stride as u32,
        &ids,
        &wts,
        n as u32,
        ne as u32,
        k as u32,
    )
    .unwrap();
    moe_combine(
        &mut rec,
        &yb,
        &wts,
        Some((&sb, &lb, ne as u32, stride as u32)),
        &out,
        n as u32,
        k as u32,
        w as u32,
        true,
    )
    .unwrap();
    rec.submit(false).unwrap();
    let got_ids = gpu.read_u32(&ids, 0, n * k).unwrap();
    let got_w = gpu.read_f32(&wts, 0, n * k).unwrap();
    let got_out = gpu.read_f32(&out, 0, n * w).unwrap();
    for r in 0..n {
        let row = &logits[r * stride..r * stride + ne];
        let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f64> = row.iter().map(|v| ((v - mx) as f64).exp()).collect();
        let s: f64 = e.iter().sum();
        let p: Vec<f64> = e.iter().map(|v| v / s).collect();
        let mut order: Vec<usize> = (0..ne).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let chosen: f64 = order[..k].iter().map(|&i| p[i]).sum();
        for slot in 0..k {
            assert_eq!(
                got_ids[r * k + slot] as usize,
                order[slot],
                "row {r} slot {slot}"
            );
            let want = p[order[slot]] / chosen;
            assert!((got_w[r * k + slot] as f64 - want).abs() < 1e-5, "weight");
        }
        if r == 0 {
            assert_eq!(&got_ids[..2], &[5, 9]);
        }
        for c in 0..w {
            let mut want = 0.0f64;
            for slot in 0..k {
                want += got_w[r * k + slot] as f64 * y[(r * k + slot) * w + c] as f64;
            }
            want += 1.0 / (1.0 + (-gate[r] as f64).exp()) * shared[r * w + c] as f64;
            // Added to the residual.
            want += resid[r * w + c] as f64;
            assert!(
                (got_out[r * w + c] as f64 - want).abs() < 1e-4,
                "combine {r} {c}"
            );
        }
    }
    assert_clean(&gpu);
}

/// Every test above again at lavapipe's 4, 8 and 16 lanes.
/// The copy moves every word, a per-dispatch profile names it with the bytes it moves (read and
/// written), and the bandwidth measured with it is a positive rate where the device can time.
#[test]
fn copy_words_and_the_bytes_a_profile_counts() {
    let Some(gpu) = test_device() else { return };
    let words = 1000u32;
    let data = values(words as usize * 4, 3);
    let src = up(&gpu, &data);
    let dst = gpu.buffer("d", words as u64 * 16 + 64).unwrap();
    let mut rec = Recorder::new(&gpu);
    copy_words(&mut rec, &src, &dst, words).unwrap();
    let time = rec.submit_timed(Timing::Dispatches).unwrap();
    assert_eq!(gpu.read_f32(&dst, 0, data.len()).unwrap(), data);
    if gpu.has_dispatch_timestamps() {
        let t = time.expect("a timed pass");
        assert_eq!(t.dispatches.len(), 1);
        assert_eq!(t.dispatches[0].kernel, "copy_words");
        assert_eq!(t.dispatches[0].bytes, 2 * 16 * words as u64);
    }
    let mut rec = Recorder::new(&gpu);
    assert!(copy_words(&mut rec, &src, &dst, words + 1).is_err());
    if gpu.has_timestamps() {
        let rate = copy_bandwidth(&gpu, 4 << 20).unwrap().expect("a rate");
        assert!(rate > 1e6, "{rate} bytes/s");
    }
    assert_clean(&gpu);
}

#[test]
fn at_every_lavapipe_width() {
    nextn_gpu::validation::rerun_at_lavapipe_widths("at_every_lavapipe_width");
}
