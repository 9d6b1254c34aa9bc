//! Image embeddings in the trunk at M-RoPE positions, against llama.cpp: the bundled model, the
//! prompt `Look at this picture: <__media__> and say what is in it.` with
//! `crates/nextn-vision/tests/data/ramp-100x75.png` through the fixture mmproj
//! (`nextn_vision::synth::TowerSpec::fixture(256)`). References from `tools/mtmd_image_ref.c`:
//! `data/mtmd-image-embd-fixture.bin` (mode embd: llama.cpp's own embeddings of the image, fed
//! here so that only the trunk is compared) and `data/mtmd-image-logits-fixture.bin` (mode
//! logits, 2 threads: the prompt's chunks, its final position and the last row's logits).

use std::path::Path;
use std::sync::Arc;

use nextn_gguf::GgufFile;
use nextn_model::{KvType, LogitRows, Model};
use nextn_quant::kernels::ThreadPool;

fn data(name: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(name),
    )
    .expect("test data")
}

fn i32s(b: &[u8]) -> impl Iterator<Item = i32> + '_ {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
}

struct Embd {
    nx: usize,
    ny: usize,
    width: usize,
    data: Vec<f32>,
}

fn read_embd() -> Embd {
    let b = data("mtmd-image-embd-fixture.bin");
    let h: Vec<i32> = i32s(&b[..20]).collect();
    let (nx, ny, n, width) = (h[0] as usize, h[1] as usize, h[2] as usize, h[4] as usize);
    let start = (5 + 3 * n) * 4;
    let data = b[start..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    Embd {
        nx,
        ny,
        width,
        data,
    }
}

/// The prompt's chunks (`None` for the image), llama.cpp's final position and last logits.
fn read_logits() -> (Vec<Option<Vec<u32>>>, usize, Vec<f32>) {
    let b = data("mtmd-image-logits-fixture.bin");
    let v: Vec<i32> = i32s(&b).collect();
    let mut i = 1;
    let mut chunks = Vec::new();
    for _ in 0..v[0] {
        let (is_image, n) = (v[i] == 1, v[i + 1] as usize);
        i += 2;
        if is_image {
            chunks.push(None);
        } else {
            chunks.push(Some(v[i..i + n].iter().map(|&t| t as u32).collect()));
            i += n;
        }
    }
    let (n_past, n_vocab) = (v[i] as usize, v[i + 1] as usize);
    let logits = b[(i + 2) * 4..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect::<Vec<f32>>();
    assert_eq!(logits.len(), n_vocab);
    (chunks, n_past, logits)
}

fn bundled() -> Model {
    let file = GgufFile::open(nextn_testdata::bundled_model()).expect("bundled model");
    Model::load(Arc::new(file)).expect("load")
}

#[test]
fn logits_after_an_image_prompt_match_llamacpp() {
    let model = bundled();
    let pool = ThreadPool::new(2);
    let embd = read_embd();
    assert_eq!(embd.width, model.config.n_embd);
    let (chunks, n_past_ref, reference) = read_logits();
    assert_eq!(chunks.len(), 3, "text, image, text");
    let mut state = model.new_sequence(512, KvType::F16, KvType::F16).unwrap();
    let mut last = None;
    for (i, chunk) in chunks.iter().enumerate() {
        let logits = if i + 1 == chunks.len() {
            LogitRows::Last
        } else {
            LogitRows::None
        };
        last = Some(match chunk {
            Some(tokens) => model.forward(tokens, &mut state, logits, &pool).unwrap(),
            None => model
                .forward_image(&embd.data, embd.nx, embd.ny, &mut state, logits, &pool)
                .unwrap(),
        });
    }
    // The image took nx * ny cache rows but advanced the position by max(nx, ny), as mtmd's n_past.
    assert_eq!(state.n_past - state.rope_shift(), n_past_ref);
    assert_eq!(state.rope_shift(), embd.nx * embd.ny - embd.nx.max(embd.ny));
    let ours = last.unwrap();
    let ours = ours.logits_row(0);
    // Tolerance as the Q8_0 goldens (golden_llamacpp.rs): int8 activation roundings flip now and
    // then on f32 differences; a tenth of the row's spread, and the same top token.
    let mean = reference.iter().map(|&v| v as f64).sum::<f64>() / reference.len() as f64;
    let std = (reference
        .iter()
        .map(|&v| (v as f64 - mean).powi(2))
        .sum::<f64>()
        / reference.len() as f64)
        .sqrt();
    let max_diff = ours
        .iter()
        .zip(&reference)
        .map(|(a, b)| (*a as f64 - *b as f64).abs())
        .fold(0.0, f64::max);
    eprintln!("logit std {std:.3}, max |diff| {max_diff:.3e}");
    assert!(max_diff <= 0.1 * std, "max |diff| {max_diff} vs std {std}");
    let argmax = |x: &[f32]| {
        x.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0
    };
    assert_eq!(argmax(ours), argmax(&reference));
}

#[test]
fn positions_after_an_image_differ_from_text_positions() {
    // The same rows with the image's rows as text (plain positions) must give other logits, by
    // more than the tolerance above: that comparison could not pass with positions ignored.
    let model = bundled();
    let pool = ThreadPool::new(2);
    let embd = read_embd();
    let (chunks, _, reference) = read_logits();
    let mean = reference.iter().sum::<f32>() / reference.len() as f32;
    let std =
        (reference.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / reference.len() as f32).sqrt();
    let (Some(head), Some(tail)) = (&chunks[0], &chunks[2]) else {
        panic!("text, image, text")
    };
    let mut state = model.new_sequence(512, KvType::F16, KvType::F16).unwrap();
    model
        .forward(head, &mut state, LogitRows::None, &pool)
        .unwrap();
    // Each image row as its own one-row image: positions advance by one per row, like text.
    let e = embd.width;
    for row in embd.data.chunks_exact(e) {
        model
            .forward_image(row, 1, 1, &mut state, LogitRows::None, &pool)
            .unwrap();
    }
    assert_eq!(state.rope_shift(), 0);
    let out = model
        .forward(tail, &mut state, LogitRows::Last, &pool)
        .unwrap();
    let max_diff = out
        .logits_row(0)
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!("with text positions: max |diff| {max_diff:.3e}");
    assert!(
        max_diff > 0.1 * std,
        "text positions gave the image prompt's logits (|d| {max_diff})"
    );
}

#[test]
fn truncating_before_an_image_forgets_its_positions() {
    let model = bundled();
    let pool = ThreadPool::new(1);
    let e = model.config.n_embd;
    let mut state = model.new_sequence(64, KvType::F16, KvType::F16).unwrap();
    model
        .forward(&[1, 2, 3], &mut state, LogitRows::None, &pool)
        .unwrap();
    model
        .forward_image(&vec![0.01; 6 * e], 3, 2, &mut state, LogitRows::None, &pool)
        .unwrap();
    assert_eq!((state.n_past, state.rope_shift()), (9, 3));
    state.truncate_kv(3);
    assert!(state.images.is_empty());
    let bad = model.forward_image(&[0.0; 5], 3, 2, &mut state, LogitRows::None, &pool);
    assert!(bad.unwrap_err().to_string().contains("3x2"));
}
