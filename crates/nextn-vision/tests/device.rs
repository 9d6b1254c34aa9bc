//! The tower on the device (lavapipe in CI, validation on) against llama.cpp's mtmd and against
//! the CPU tower: the same embeddings within the bounds that hold between the CPU and mtmd,
//! deepstack paths, cancellation between blocks, the capacity its buffers were sized for, and a
//! fingerprint of its own.

mod common;

use std::cell::Cell;
use std::sync::Arc;

use nextn_gguf::GgmlType;
use nextn_gpu::validation::{assert_clean, test_device};
use nextn_gpu::Gpu;
use nextn_quant::kernels::ThreadPool;
use nextn_vision::synth::{write_mmproj, TowerSpec};
use nextn_vision::{decode_image, ImageEmbedding, RgbImage, VisionError, VisionTower};

fn ramp_png() -> RgbImage {
    let bytes = std::fs::read(common::data("ramp-100x75.png")).unwrap();
    decode_image(&bytes, "ramp-100x75.png").unwrap()
}

/// Largest difference and relative L2 error of `got` against `want`, over `want`'s RMS.
fn errors(got: &[f32], want: &[f32]) -> (f64, f64, f64) {
    assert_eq!(got.len(), want.len());
    let rms = (want.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / want.len() as f64).sqrt();
    let mut max_diff = 0f64;
    let mut err2 = 0f64;
    for (a, b) in got.iter().zip(want) {
        let d = (*a as f64 - *b as f64).abs();
        max_diff = max_diff.max(d);
        err2 += d * d;
    }
    (rms, max_diff, (err2 / want.len() as f64).sqrt() / rms)
}

fn device() -> Option<Arc<Gpu>> {
    test_device().map(Arc::new)
}

fn encode(tower: &VisionTower, img: &RgbImage) -> ImageEmbedding {
    tower
        .encode(&tower.prepare(img), &ThreadPool::new(2))
        .unwrap()
}

/// The device tower gives mtmd's embeddings of the ramp picture within the bounds the CPU
/// tower keeps (mtmd_reference.rs says where they come from), and the CPU's within the same.
#[test]
fn the_device_tower_matches_mtmd_and_the_cpu() {
    let Some(gpu) = device() else { return };
    for (spec, reference) in [
        (
            TowerSpec::fixture(common::FIXTURE_DIM),
            "mtmd-fixture-ramp-100x75.bin",
        ),
        (
            TowerSpec {
                weight_type: GgmlType::F32,
                ..TowerSpec::fixture(common::FIXTURE_DIM)
            },
            "mtmd-fixture-f32-ramp-100x75.bin",
        ),
    ] {
        let tag = format!("device-{:?}", spec.weight_type);
        let path = common::write_fixture(&tag, &spec);
        let cpu = VisionTower::load(&path).unwrap();
        let mut dev = VisionTower::load(&path).unwrap();
        dev.offload(gpu.clone()).unwrap();
        assert!(dev.on_device() && !cpu.on_device());
        assert!(dev.device_bytes().unwrap() > 0);
        let img = ramp_png();
        let on_device = encode(&dev, &img);
        let on_cpu = encode(&cpu, &img);
        let reference = common::read_mtmd_embd(reference);
        assert_eq!(
            (on_device.nx, on_device.ny, on_device.width),
            (on_cpu.nx, on_cpu.ny, on_cpu.width)
        );
        for (what, want) in [("mtmd", &reference.embd), ("the CPU tower", &on_cpu.data)] {
            let (rms, max_diff, rel_l2) = errors(&on_device.data, want);
            eprintln!("{tag} against {what}: rms {rms:.4}, max |diff| {max_diff:.3e}, relative L2 {rel_l2:.3e}");
            assert!(
                max_diff <= 5e-3 * rms,
                "{tag} against {what}: max |diff| {max_diff} vs rms {rms}"
            );
            assert!(rel_l2 <= 1e-3, "{tag} against {what}: relative L2 {rel_l2}");
        }
        // The same picture again: the same bits (nothing left over from the encode before).
        let other =
            RgbImage::new(40, 90, (0..40 * 90 * 3).map(|i| (i % 253) as u8).collect()).unwrap();
        encode(&dev, &other);
        assert_eq!(encode(&dev, &img), on_device);
        // Where it runs is part of what its rows depend on.
        assert_ne!(dev.fingerprint(), cpu.fingerprint());
        assert_clean(&gpu);
    }
}

/// The released tower's shapes (width 1152, heads of 72 values, 16-pixel patches, a 48x48
/// position table resized to the grid) at two blocks: the device's embeddings are the CPU's
/// within the same bounds, on a picture of several hundred patches.
#[test]
fn the_released_shape_on_the_device_gives_the_cpus_embeddings() {
    let Some(gpu) = device() else { return };
    let spec = TowerSpec {
        n_layer: 2,
        ..TowerSpec::qwen35(common::FIXTURE_DIM)
    };
    let path = common::write_fixture("device-released", &spec);
    let cpu = VisionTower::load(&path).unwrap();
    let mut dev = VisionTower::load(&path).unwrap();
    // At the default 4096 tokens its MLP rows take 282,066,944 bytes: over lavapipe's binding
    // limit (128 MiB), which refuses the tower and names the bound that fits.
    match dev.offload(gpu.clone()) {
        Ok(()) => assert!(gpu.max_binding_bytes() >= 282_066_944),
        Err(VisionError::DeviceBinding { fits, bytes, .. }) => {
            assert_eq!(bytes, 282_066_944);
            assert!(!dev.on_device());
            dev.set_token_bounds(None, Some(fits as u32)).unwrap();
            dev.offload(gpu.clone()).unwrap();
            dev.set_token_bounds(None, Some(fits as u32 + 1))
                .unwrap_err();
        }
        Err(e) => panic!("{e}"),
    }
    dev.set_token_bounds(None, Some(256)).unwrap();
    dev.offload(gpu.clone()).unwrap();
    let img = RgbImage::new(
        300,
        200,
        (0..300 * 200 * 3).map(|i| (i * 13 % 251) as u8).collect(),
    )
    .unwrap();
    let (d, c) = (encode(&dev, &img), encode(&cpu, &img));
    assert_eq!((d.nx, d.ny, d.width), (c.nx, c.ny, c.width));
    assert!(d.n_tokens() >= 50, "{}x{}", d.nx, d.ny);
    let (rms, max_diff, rel_l2) = errors(&d.data, &c.data);
    eprintln!("released shape: rms {rms:.4}, max |diff| {max_diff:.3e}, relative L2 {rel_l2:.3e}");
    assert!(max_diff <= 5e-3 * rms, "max |diff| {max_diff} vs rms {rms}");
    assert!(rel_l2 <= 1e-3, "relative L2 {rel_l2}");
    assert_clean(&gpu);
}

/// Deepstack paths fill their columns of the embeddings on the device as on the CPU, and a
/// picture of another shape (grid 4x3 rather than 6x5) goes through the same buffers.
#[test]
fn deepstack_paths_on_the_device() {
    let Some(gpu) = device() else { return };
    let spec = TowerSpec {
        deepstack: vec![0, 1],
        ..TowerSpec::fixture(32)
    };
    let path = common::write_fixture("device-ds", &spec);
    write_mmproj(&spec, &path).unwrap();
    let cpu = VisionTower::load(&path).unwrap();
    let mut dev = VisionTower::load(&path).unwrap();
    dev.offload(gpu.clone()).unwrap();
    for img in [
        ramp_png(),
        RgbImage::new(
            64,
            48,
            (0..64 * 48 * 3).map(|i| (i * 7 % 256) as u8).collect(),
        )
        .unwrap(),
    ] {
        let (d, c) = (encode(&dev, &img), encode(&cpu, &img));
        assert_eq!((d.nx, d.ny, d.width), (c.nx, c.ny, 96));
        // Each path on its own: a path left unwritten or written to the wrong columns fails.
        for path in 0..3 {
            let cols = |e: &ImageEmbedding| -> Vec<f32> {
                e.data
                    .chunks_exact(96)
                    .flat_map(|row| row[path * 32..(path + 1) * 32].to_vec())
                    .collect()
            };
            let (rms, max_diff, rel_l2) = errors(&cols(&d), &cols(&c));
            assert!(
                max_diff <= 5e-3 * rms && rel_l2 <= 1e-3,
                "path {path}: rms {rms}, max |diff| {max_diff}, relative L2 {rel_l2}"
            );
        }
    }
    assert_clean(&gpu);
}

#[test]
fn a_cancelled_device_encode_stops_between_blocks() {
    let Some(gpu) = device() else { return };
    let mut tower = VisionTower::load(common::fixture_mmproj("device-cancel")).unwrap();
    tower.offload(gpu.clone()).unwrap();
    let prepared = tower.prepare(&ramp_png());
    let pool = ThreadPool::new(1);
    let n_layer = tower.config().n_layer;
    let asked = Cell::new(0);
    let full = tower
        .encode_cancellable(&prepared, &pool, &|| {
            asked.set(asked.get() + 1);
            false
        })
        .unwrap();
    // As on the CPU: before the patch embedding and after every block.
    assert_eq!(asked.get(), 1 + n_layer);
    for cancel_at in 1..=1 + n_layer {
        let asked = Cell::new(0);
        let e = tower
            .encode_cancellable(&prepared, &pool, &|| {
                asked.set(asked.get() + 1);
                asked.get() >= cancel_at
            })
            .unwrap_err();
        assert!(matches!(e, VisionError::EncodeCancelled), "{e}");
        assert_eq!(asked.get(), cancel_at);
    }
    // A cancelled encode leaves nothing behind for the next one.
    assert_eq!(tower.encode(&prepared, &pool).unwrap(), full);
    assert_clean(&gpu);
}

/// The buffers hold the largest image of the token bounds; new bounds make them again, and a
/// budget too small for the tower refuses it with an error naming what did not fit.
#[test]
fn buffers_follow_the_token_bounds_and_the_budget() {
    let Some(gpu) = device() else { return };
    let mut tower = VisionTower::load(common::fixture_mmproj("device-bounds")).unwrap();
    tower.set_token_bounds(Some(4), Some(8)).unwrap();
    tower.offload(gpu.clone()).unwrap();
    let small = tower.device_bytes().unwrap();
    // 8 tokens at most: the ramp (30 tokens by default) is resized to fit.
    let img = ramp_png();
    let emb = encode(&tower, &img);
    assert!(emb.n_tokens() <= 8, "{}", emb.n_tokens());
    tower.set_token_bounds(Some(4), Some(64)).unwrap();
    assert!(tower.on_device());
    assert!(tower.device_bytes().unwrap() > small);
    assert_eq!(encode(&tower, &img).n_tokens(), 30);

    let tight = Gpu::open(&nextn_gpu::OpenOptions {
        name: Some(gpu.info.name.clone()),
        validation: true,
        memory_budget: Some(64 << 10),
        pipeline_cache_dir: None,
    })
    .unwrap();
    let mut t = VisionTower::load(common::fixture_mmproj("device-budget")).unwrap();
    let e = t.offload(Arc::new(tight)).unwrap_err().to_string();
    assert!(e.contains("vision tower on the device"), "{e}");
    assert!(!t.on_device());
    // It still encodes, on the CPU.
    assert_eq!(encode(&t, &img).n_tokens(), 30);
    assert_clean(&gpu);
}

/// Every test above again at lavapipe's 4, 8 and 16 lanes.
#[test]
fn at_every_lavapipe_width() {
    nextn_gpu::validation::rerun_at_lavapipe_widths("at_every_lavapipe_width");
}
