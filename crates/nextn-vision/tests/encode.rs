//! The encode of 8-bit prepared pictures: the same bits as when prepared images held normalised
//! f32 planes, the token grid known from the image's size alone, and an encode that stops when
//! it is cancelled.
//!
//! The reference digests are FNV-1a (64-bit) over the raw little-endian embeddings the encoder gave
//! for `tests/data/ramp-100x75.png` while prepared images were f32 planes (`encode_time` on the
//! fixture mmproj, any thread count gives the same bits; 7,680 values each):
//!   cargo run --release -p nextn-vision --example synth_mmproj fixture 256 fixture.gguf
//!   cargo run --release -p nextn-vision --example encode_time fixture.gguf \
//!       crates/nextn-vision/tests/data/ramp-100x75.png 2 1 embeddings.f32
//! (`fixture-f32` for the second), then the digest of `embeddings.f32`.

mod common;

use std::cell::Cell;
use std::io::Cursor;

use nextn_gguf::GgmlType;
use nextn_quant::kernels::ThreadPool;
use nextn_vision::synth::TowerSpec;
use nextn_vision::{decode_image, image_size, RgbImage, VisionError, VisionTower};

/// FNV-1a (64-bit) over the values' little-endian bytes.
fn digest(values: &[f32]) -> u64 {
    values
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
}

fn ramp() -> RgbImage {
    let bytes = std::fs::read(common::data("ramp-100x75.png")).unwrap();
    decode_image(&bytes, "ramp-100x75.png").unwrap()
}

#[test]
fn encodes_keep_the_bits_of_normalised_f32_planes() {
    let img = ramp();
    const VALUES: usize = 7_680;
    for (tag, weight_type, reference) in [
        ("bits-f16", GgmlType::F16, 0xe318_a255_39a7_0b40u64),
        ("bits-f32", GgmlType::F32, 0xab64_4759_ee9a_9fc0),
    ] {
        let spec = TowerSpec {
            weight_type,
            ..TowerSpec::fixture(common::FIXTURE_DIM)
        };
        let tower = VisionTower::load(common::write_fixture(tag, &spec)).unwrap();
        let prepared = tower.prepare(&img);
        assert_eq!(
            prepared.pixels().len(),
            96 * 80 * 3,
            "8-bit RGB, 3 bytes a pixel"
        );
        for threads in [1, 2] {
            let emb = tower.encode(&prepared, &ThreadPool::new(threads)).unwrap();
            assert_eq!(emb.data.len(), VALUES, "{tag}");
            assert_eq!(
                digest(&emb.data),
                reference,
                "{tag}, {threads} threads: not the bits of the f32-plane encode"
            );
        }
    }
}

#[test]
fn the_token_grid_from_the_size_is_the_grid_of_the_prepared_picture() {
    let mut tower = VisionTower::load(common::fixture_mmproj("grid")).unwrap();
    let sizes = [
        (100, 75),
        (1, 1),
        (70, 50),
        (1000, 700),
        (700, 1000),
        (2000, 40),
        (3, 9000),
        (513, 511),
    ];
    for bounds in [
        (Some(8), Some(4096)),
        (Some(64), Some(256)),
        (Some(1), Some(8)),
    ] {
        tower.set_token_bounds(bounds.0, bounds.1).unwrap();
        for (w, h) in sizes {
            let px = (0..w * h * 3).map(|i| (i % 251) as u8).collect();
            let img = RgbImage::new(w, h, px).unwrap();
            let prepared = tower.prepare(&img);
            let (nx, ny) = tower.token_grid(&prepared);
            assert_eq!(
                tower.token_grid_for_size(w, h),
                (nx, ny),
                "{w}x{h}, bounds {bounds:?}"
            );
        }
    }
    // From a file's header: the grid its decoded picture gets.
    let mut png = Vec::new();
    image::RgbImage::from_pixel(333, 222, image::Rgb([1, 2, 3]))
        .write_to(&mut Cursor::new(&mut png), image::ImageFormat::Png)
        .unwrap();
    let (w, h) = image_size(&png, "p.png").unwrap();
    let decoded = decode_image(&png, "p.png").unwrap();
    assert_eq!(
        tower.token_grid_for_size(w, h),
        tower.token_grid(&tower.prepare(&decoded))
    );
}

#[test]
fn a_cancelled_encode_stops_between_blocks() {
    let tower = VisionTower::load(common::fixture_mmproj("cancel")).unwrap();
    let prepared = tower.prepare(&ramp());
    let pool = ThreadPool::new(2);
    let n_layer = tower.config().n_layer;
    // Never cancelled: asked before the patch embedding and after every block, and the
    // embeddings are those of `encode`.
    let asked = Cell::new(0);
    let full = tower
        .encode_cancellable(&prepared, &pool, &|| {
            asked.set(asked.get() + 1);
            false
        })
        .unwrap();
    assert_eq!(asked.get(), 1 + n_layer);
    assert_eq!(full, tower.encode(&prepared, &pool).unwrap());
    // Cancelled after the first block: no further block runs.
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
}
