//! Broken or foreign mmproj files are refused with an error naming the key or tensor.

mod common;

use nextn_gguf::{GgufFile, GgufWriter, MetadataValue};
use nextn_vision::synth::{write_mmproj, TowerSpec};
use nextn_vision::VisionTower;

/// The fixture rewritten by `edit`, loaded; returns the error text.
fn load_edited(tag: &str, edit: impl FnOnce(&mut GgufWriter)) -> String {
    let src = common::fixture_mmproj(tag);
    let file = GgufFile::open(&src).unwrap();
    let mut w = GgufWriter::from_file(&file);
    edit(&mut w);
    let out = src.with_file_name("edited.gguf");
    w.write_file(&out).unwrap();
    match VisionTower::load(&out) {
        Ok(_) => panic!("the edited file loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_missing_tensor_is_named() {
    let e = load_edited("missing", |w| {
        w.remove_tensor("v.blk.1.attn_qkv.weight");
    });
    assert!(
        e.contains("v.blk.1.attn_qkv.weight") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn an_unsupported_projector_is_named() {
    let e = load_edited("proj", |w| w.set_kv("clip.projector_type", "gemma3"));
    assert!(e.contains("gemma3") && e.contains("qwen3vl_merger"), "{e}");
}

#[test]
fn absurd_sizes_are_refused_before_allocating() {
    let e = load_edited("layers", |w| {
        w.set_kv("clip.vision.block_count", MetadataValue::U32(1_000_000))
    });
    assert!(e.contains("clip.vision.block_count"), "{e}");
    let e = load_edited("width", |w| {
        w.set_kv("clip.vision.embedding_length", MetadataValue::U32(96))
    });
    assert!(
        e.contains("v.patch_embd.weight") || e.contains("embedding_length"),
        "{e}"
    );
    let e = load_edited("heads", |w| {
        w.set_kv("clip.vision.attention.head_count", MetadataValue::U32(5))
    });
    assert!(e.contains("head_count"), "{e}");
}

#[test]
fn a_text_model_file_is_not_an_mmproj() {
    let e = match VisionTower::load(nextn_testdata::bundled_model()) {
        Ok(_) => panic!("the text model loaded as an mmproj"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("not an mmproj") && e.contains("qwen35"), "{e}");
}

#[test]
fn the_projection_width_must_match_the_text_model() {
    let tower = VisionTower::load(common::fixture_mmproj("width-check")).unwrap();
    tower.check_text_model(common::FIXTURE_DIM).unwrap();
    let e = tower.check_text_model(2048).unwrap_err().to_string();
    assert!(e.contains("256") && e.contains("2048"), "{e}");
}

#[test]
fn deepstack_features_widen_the_embeddings() {
    let spec = TowerSpec {
        deepstack: vec![0],
        ..TowerSpec::fixture(32)
    };
    let path = common::fixture_mmproj("ds").with_file_name("deepstack.gguf");
    write_mmproj(&spec, &path).unwrap();
    let tower = VisionTower::load(&path).unwrap();
    assert_eq!(tower.n_deepstack(), 1);
    assert_eq!(tower.embedding_width(), 64);
    let img = nextn_vision::RgbImage::new(64, 48, vec![128; 64 * 48 * 3]).unwrap();
    let emb = tower
        .encode(
            &tower.prepare(&img),
            &nextn_quant::kernels::ThreadPool::new(1),
        )
        .unwrap();
    assert_eq!((emb.nx, emb.ny, emb.width), (4, 3, 64));
    // The deepstack half is its own projection, not a copy of the main one.
    assert_ne!(emb.data[..32], emb.data[32..64]);
    let e = tower.check_text_model(32).unwrap_err().to_string();
    assert!(e.contains("deepstack"), "{e}");
}

/// The fingerprint follows the file and the token bounds, and nothing else.
#[test]
fn the_fingerprint_names_the_file_and_the_token_bounds() {
    let path = common::fixture_mmproj("fingerprint");
    let a = VisionTower::load(&path).unwrap();
    let mut b = VisionTower::load(&path).unwrap();
    assert_eq!(a.fingerprint(), b.fingerprint());
    b.set_token_bounds(None, Some(64)).unwrap();
    assert_ne!(a.fingerprint(), b.fingerprint());
    let other = TowerSpec {
        seed: TowerSpec::fixture(common::FIXTURE_DIM).seed + 1,
        ..TowerSpec::fixture(common::FIXTURE_DIM)
    };
    let c = VisionTower::load(common::write_fixture("fingerprint-other", &other)).unwrap();
    assert_ne!(a.fingerprint(), c.fingerprint());
}
