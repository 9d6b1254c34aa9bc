//! The tower against llama.cpp's mtmd on the same files: the fixture mmproj
//! (`TowerSpec::fixture(256)`, F16 and F32 matrices, regenerated here bit for bit) and
//! `tests/data/ramp-100x75.png` (`cargo run -p nextn-vision --example test_image 100 75 F`); the
//! references `tests/data/mtmd-fixture{,-f32}-ramp-100x75.bin` were written by
//! `tools/mtmd_image_ref.c` (its header says how it is built) with the bundled model as the
//! text model:
//!   cargo run --release -p nextn-vision --example synth_mmproj fixture 256 fixture.gguf
//!   mtmd_image_ref embd models/tiny-qwen35-mtp-Q8_0.gguf fixture.gguf \
//!       crates/nextn-vision/tests/data/ramp-100x75.png 2 1 mtmd-fixture-ramp-100x75.bin
//! (`fixture-f32` for the second).

mod common;

use nextn_gguf::GgmlType;
use nextn_quant::kernels::ThreadPool;
use nextn_vision::synth::TowerSpec;
use nextn_vision::{decode_image, VisionTower};

/// Compares the tower of `spec` on the ramp picture with the mtmd reference file `reference`.
fn check_against_mtmd(spec: &TowerSpec, reference: &str) {
    let reference = common::read_mtmd_embd(reference);
    let tower = VisionTower::load(common::write_fixture(reference_tag(spec), spec)).unwrap();
    tower.check_text_model(common::FIXTURE_DIM).unwrap();
    let bytes = std::fs::read(common::data("ramp-100x75.png")).unwrap();
    let img = decode_image(&bytes, "ramp-100x75.png").unwrap();
    let prepared = tower.prepare(&img);
    // 100x75 on a 16-pixel grid: 96x80, the picture scaled to 96x72 and padded top and bottom.
    assert_eq!((prepared.width(), prepared.height()), (96, 80));
    let emb = tower.encode(&prepared, &ThreadPool::new(2)).unwrap();

    assert_eq!((emb.nx, emb.ny), (reference.nx, reference.ny));
    assert_eq!(emb.n_tokens(), reference.n_tokens);
    assert_eq!(emb.width, reference.width);
    assert_eq!(
        reference.n_pos,
        emb.nx.max(emb.ny),
        "an image advances positions by max(nx, ny)"
    );
    for (t, p) in reference.positions.iter().enumerate() {
        assert_eq!(
            *p,
            [0, (t / emb.nx) as i32, (t % emb.nx) as i32],
            "token {t}"
        );
    }

    // Tolerance. Every product rounds its input to F16 (as ggml does for F16 weights and the
    // patch convolution) and GELU reads an F16 table, so an f32 difference of one ulp in a sum
    // (our summation order is not ggml's) now and then flips an F16 rounding and spreads through
    // the attention: up to 0.5% of the output's RMS in single elements, 0.1% (L2) overall. The
    // intermediate tensors before the first such flip agree within 1e-6. A wrong layer (rotary
    // order, merge order, position resize, norm placement) differs by tens of percent.
    let rms = (reference
        .embd
        .iter()
        .map(|v| (*v as f64).powi(2))
        .sum::<f64>()
        / reference.embd.len() as f64)
        .sqrt();
    let mut max_diff = 0f64;
    let mut err2 = 0f64;
    for (a, b) in emb.data.iter().zip(&reference.embd) {
        let d = (*a as f64 - *b as f64).abs();
        max_diff = max_diff.max(d);
        err2 += d * d;
    }
    let rel_l2 = (err2 / reference.embd.len() as f64).sqrt() / rms;
    eprintln!("rms {rms:.4}, max |diff| {max_diff:.3e}, relative L2 {rel_l2:.3e}");
    assert!(max_diff <= 5e-3 * rms, "max |diff| {max_diff} vs rms {rms}");
    assert!(rel_l2 <= 1e-3, "relative L2 {rel_l2}");
}

fn reference_tag(spec: &TowerSpec) -> &'static str {
    if spec.weight_type == GgmlType::F32 {
        "f32"
    } else {
        "f16"
    }
}

#[test]
fn f16_tower_matches_mtmd() {
    check_against_mtmd(
        &TowerSpec::fixture(common::FIXTURE_DIM),
        "mtmd-fixture-ramp-100x75.bin",
    );
}

#[test]
fn f32_tower_matches_mtmd() {
    let spec = TowerSpec {
        weight_type: GgmlType::F32,
        ..TowerSpec::fixture(common::FIXTURE_DIM)
    };
    check_against_mtmd(&spec, "mtmd-fixture-f32-ramp-100x75.bin");
}
