//! Prompts with images through the generation loop, on the bundled model and a random-weight
//! mmproj written for its width: greedy decoding with MTP drafting equals plain decoding, both
//! equal the image decoded by hand (text rows, `Model::forward_image`, text rows, one token at a
//! time), and the next turn of a conversation resumes after the picture.

mod common;

use std::path::PathBuf;
use std::sync::{mpsc, Arc};

use common::{Collect, Loaded, Setup};
use nextn_engine::media::{ImageInput, MultimodalPrompt};
use nextn_engine::sampler::SamplerConfig;
use nextn_engine::scheduler::{
    Completion, EngineRef, Event, PrefixCacheConfig, Request, Scheduler, SchedulerConfig,
};
use nextn_model::LogitRows;
use nextn_vision::synth::{write_mmproj, TowerSpec};
use nextn_vision::{RgbImage, VisionTower};

fn tower(l: &Loaded) -> Arc<VisionTower> {
    Arc::new(tower_of(l))
}

fn tower_of(l: &Loaded) -> VisionTower {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("nextn-images-{}-{k}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path: PathBuf = dir.join("mmproj.gguf");
    write_mmproj(&TowerSpec::fixture(l.model.config.n_embd), &path).expect("write mmproj");
    let t = VisionTower::load(&path).expect("load mmproj");
    std::fs::remove_dir_all(&dir).ok();
    t
}

fn picture(seed: u8) -> RgbImage {
    let (w, h) = (70u32, 50u32);
    let px = (0..w * h * 3)
        .map(|i| ((i * 7 + u32::from(seed) * 31) % 251) as u8)
        .collect();
    RgbImage::new(w, h, px).expect("image")
}

fn prompt(l: &Loaded, t: &VisionTower, text: &str, seed: u8) -> MultimodalPrompt {
    prompt_with(l, t, text, &picture(seed))
}

fn prompt_with(l: &Loaded, t: &VisionTower, text: &str, img: &RgbImage) -> MultimodalPrompt {
    let rendered = format!(
        "<|im_start|>user\n{text}<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n"
    );
    MultimodalPrompt::tokenize(&l.tok, &rendered, true, vec![ImageInput::new(t, img)])
        .expect("one placeholder, one image")
}

fn engine<'a>(l: &'a Loaded, t: &'a Arc<VisionTower>, head: bool) -> EngineRef<'a> {
    EngineRef {
        vision: Some(t),
        ..l.engine(head)
    }
}

fn scheduler<'a>(engine: EngineRef<'a>, setup: &Setup) -> Scheduler<'a> {
    Scheduler::new(
        engine,
        SchedulerConfig {
            n_slots: 1,
            n_ctx_slot: setup.n_ctx,
            k_type: setup.kv,
            v_type: setup.kv,
            n_batch: 32,
            queue_capacity: 4,
            spec: setup.spec.clone(),
            policy: setup.policy,
            calibrate: false,
            prefix_cache: setup.prefix_cache.clone(),
        },
    )
}

fn run(s: &mut Scheduler<'_>, p: &MultimodalPrompt, n: usize) -> Result<Completion, String> {
    let (tx, rx) = mpsc::channel();
    s.submit(Request {
        prompt: p.tokens.clone(),
        images: p.images.clone(),
        sampler: SamplerConfig::greedy(),
        n_predict: Some(n),
        stop: Vec::new(),
        ignore_eos: true,
        trace: false,
        grammar: None,
        logprobs: None,
        cache_prompt: true,
        cache_points: Vec::new(),
        forced_acceptance: None,
        prompt_progress: false,
        sink: Box::new(Collect(tx)),
    });
    s.run();
    match rx.try_recv() {
        Ok(Event::Done(c)) => Ok(c),
        Ok(Event::Failed { message, .. }) => Err(message),
        other => panic!("the request did not end: {other:?}"),
    }
}

/// Greedy decoding by hand: the text before the image, the image's embeddings, the text after,
/// then one row per token.
fn by_hand(l: &Loaded, t: &VisionTower, p: &MultimodalPrompt, n: usize) -> Vec<u32> {
    let pool = &l.pool;
    let im = &p.images[0];
    let kv = Setup::plain().kv;
    let mut state = l.model.new_sequence(512, kv, kv).expect("sequence");
    l.model
        .forward(&p.tokens[..im.pos], &mut state, LogitRows::None, pool)
        .expect("text before");
    let emb = t.encode(&im.image, pool).expect("encode");
    l.model
        .forward_image(&emb.data, emb.nx, emb.ny, &mut state, LogitRows::None, pool)
        .expect("image");
    let mut logits = l
        .model
        .forward(&p.tokens[im.end()..], &mut state, LogitRows::Last, pool)
        .expect("text after")
        .logits;
    let mut out = Vec::new();
    while out.len() < n {
        let next = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .expect("logits");
        out.push(next);
        logits = l
            .model
            .forward(&[next], &mut state, LogitRows::Last, pool)
            .expect("decode")
            .logits;
    }
    out
}

#[test]
fn greedy_mtp_with_an_image_equals_plain_decoding_and_decoding_by_hand() {
    let l = common::bundled(2);
    let t = tower(&l);
    let p = prompt(&l, &t, "Look:", 1);
    let im = &p.images[0];
    assert!(im.n_tokens() > 1 && im.nx != im.ny, "{}x{}", im.nx, im.ny);
    let n = 40;
    let want = by_hand(&l, &t, &p, n);
    let plain = run(
        &mut scheduler(engine(&l, &t, false), &Setup::plain()),
        &p,
        n,
    )
    .expect("plain");
    assert_eq!(plain.tokens, want, "plain decoding in the loop");
    assert_eq!(plain.timings.images_encoded, 1);
    assert!(plain.timings.image_encode_ms > 0.0);
    assert_eq!(plain.prompt_tokens, p.tokens.len());
    let setup = Setup::drafting(3);
    let mtp = run(&mut scheduler(engine(&l, &t, true), &setup), &p, n).expect("mtp");
    assert_eq!(mtp.tokens, want, "greedy MTP");
    assert!(mtp.spec.draft_n > 0, "drafting continued after the image");
    assert!(
        mtp.spec.draft_n_accepted > 0,
        "the head's drafts after the image are accepted: {:?}",
        mtp.spec
    );
}

#[test]
fn the_next_turn_resumes_after_the_image_and_equals_a_cold_run() {
    let l = common::bundled(2);
    let t = tower(&l);
    let setup = Setup {
        prefix_cache: Some(PrefixCacheConfig {
            budget_bytes: 64 << 20,
            snapshot_every: 0,
        }),
        ..Setup::drafting(3)
    };
    let first = prompt(&l, &t, "Look:", 2);
    let mut warm = scheduler(engine(&l, &t, true), &setup);
    let answer = run(&mut warm, &first, 12).expect("first turn");
    let mut second = first.clone();
    second.tokens.extend(&answer.tokens);
    second.tokens.extend(l.tok.encode_continuation(
        "<|im_end|>\n<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n",
        true,
    ));
    let resumed = run(&mut warm, &second, 24).expect("second turn, warm");
    assert!(
        resumed.timings.cache_n > first.images[0].end(),
        "resumed after the image: {:?}",
        resumed.timings
    );
    assert_eq!(
        resumed.timings.images_encoded, 0,
        "the image was not encoded again"
    );
    let cold = run(&mut scheduler(engine(&l, &t, true), &setup), &second, 24).expect("cold");
    assert_eq!(cold.timings.cache_n, 0);
    assert_eq!(cold.timings.images_encoded, 1);
    assert_eq!(resumed.tokens, cold.tokens, "warm equals cold");

    // Another picture at the same place is not taken for the first.
    let other = prompt(&l, &t, "Look:", 3);
    let fresh = run(&mut warm, &other, 4).expect("other picture");
    assert!(
        fresh.timings.cache_n <= other.images[0].pos,
        "{:?}",
        fresh.timings
    );
    assert_eq!(fresh.timings.images_encoded, 1);
}

#[test]
fn images_without_a_tower_or_beyond_the_context_are_refused() {
    let l = common::bundled(2);
    let t = tower(&l);
    let p = prompt(&l, &t, "Look:", 4);
    let err = run(&mut scheduler(l.engine(false), &Setup::plain()), &p, 4).unwrap_err();
    assert!(err.contains("--mmproj"), "{err}");
    let small = Setup {
        n_ctx: p.tokens.len() - 2,
        ..Setup::plain()
    };
    let err = run(&mut scheduler(engine(&l, &t, false), &small), &p, 4).unwrap_err();
    assert!(err.contains("image") && err.contains("context"), "{err}");
    let mut moved = p.clone();
    moved.images[0].pos += 1;
    let err = run(
        &mut scheduler(engine(&l, &t, false), &Setup::plain()),
        &moved,
        4,
    )
    .unwrap_err();
    assert!(err.contains("placeholder"), "{err}");
}

/// llama.cpp's mtmd on the same files: the bundled model, the fixture mmproj
/// (`TowerSpec::fixture(256)`, F16) and crates/nextn-vision/tests/data/ramp-100x75.png, the
/// prompt of tests/data/mtmd-logits-prompt.txt. The reference tests/data/mtmd-logits-ramp-100x75.bin
/// was written by tools/mtmd_image_ref.c (its header says how it is built):
///   cargo run --release -p nextn-vision --example synth_mmproj fixture 256 fixture.gguf
///   mtmd_image_ref logits models/tiny-qwen35-mtp-Q8_0.gguf fixture.gguf \
///       crates/nextn-vision/tests/data/ramp-100x75.png 2 \
///       crates/nextn-engine/tests/data/mtmd-logits-prompt.txt mtmd-logits-ramp-100x75.bin
/// The chunks (text tokens, the image's token count) and the position after the prompt must
/// agree exactly, the last row's logits within 1% of the largest |logit| (measured: 0.033 of
/// 8.3) with the same argmax.
#[test]
fn logits_after_an_image_prompt_match_mtmd() {
    let l = common::bundled(2);
    let t = tower(&l);
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let raw = std::fs::read(data.join("mtmd-logits-ramp-100x75.bin")).expect("reference");
    let mut words = raw.chunks_exact(4).map(|b| [b[0], b[1], b[2], b[3]]);
    let mut int = || i32::from_le_bytes(words.next().expect("reference ends early")) as usize;
    let n_chunks = int();
    let mut chunks = Vec::new();
    for _ in 0..n_chunks {
        let (kind, n) = (int(), int());
        let tokens: Vec<u32> = if kind == 0 {
            (0..n).map(|_| int() as u32).collect()
        } else {
            Vec::new()
        };
        chunks.push((kind, n, tokens));
    }
    let (n_past, n_vocab) = (int(), int());
    let want: Vec<f32> = words.map(f32::from_le_bytes).collect();
    assert_eq!((n_vocab, want.len()), (l.model.n_vocab, l.model.n_vocab));

    let text = std::fs::read_to_string(data.join("mtmd-logits-prompt.txt"))
        .expect("prompt")
        .replace(
            nextn_engine::media::MEDIA_MARKER,
            nextn_engine::media::IMAGE_PLACEHOLDER,
        );
    let png = nextn_testdata::repo_root().join("crates/nextn-vision/tests/data/ramp-100x75.png");
    let img =
        nextn_vision::decode_image(&std::fs::read(png).expect("png"), "ramp").expect("decode");
    let p = MultimodalPrompt::tokenize(&l.tok, &text, true, vec![ImageInput::new(&t, &img)])
        .expect("tokenize");
    let im = &p.images[0];
    let ours = vec![
        (0, im.pos, p.tokens[..im.pos].to_vec()),
        (1, im.n_tokens(), Vec::new()),
        (0, p.tokens.len() - im.end(), p.tokens[im.end()..].to_vec()),
    ];
    assert_eq!(chunks, ours, "chunks: (type, n_tokens, text tokens)");

    let pool = &l.pool;
    let kv = Setup::plain().kv;
    let mut state = l.model.new_sequence(512, kv, kv).expect("sequence");
    l.model
        .forward(&p.tokens[..im.pos], &mut state, LogitRows::None, pool)
        .expect("text before");
    let emb = t.encode(&im.image, pool).expect("encode");
    l.model
        .forward_image(&emb.data, emb.nx, emb.ny, &mut state, LogitRows::None, pool)
        .expect("image");
    let got = l
        .model
        .forward(&p.tokens[im.end()..], &mut state, LogitRows::Last, pool)
        .expect("text after")
        .logits;
    assert_eq!(
        state.n_past - state.rope_shift(),
        n_past,
        "position after the prompt"
    );
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_diff = got
        .iter()
        .zip(&want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i)
    };
    eprintln!(
        "logits after the image prompt: max |diff| {max_diff:.5} (largest |logit| {scale:.3})"
    );
    assert!(
        max_diff <= 0.02 * scale.max(1.0),
        "max |diff| {max_diff} of {scale}"
    );
    assert_eq!(argmax(&got), argmax(&want));
}

/// Rewrite a slot file's checksum after editing it, so that only the edit is judged.
fn reseal(bytes: &mut [u8]) {
    let n = bytes.len() - 8;
    let mut h = nextn_gguf::Fnv1a::new();
    h.write(&bytes[..n]);
    bytes[n..].copy_from_slice(&h.finish().to_le_bytes());
}

/// A state with an image goes to a slot file and back: another engine with the same tower
/// resumes the next turn after the picture without encoding it, with the cold run's tokens and
/// the drafts of a resume from the same state in memory (the head keeps the image's rotary
/// shift); an engine with another tower or none, and
/// files whose image section lies, are refused.
#[test]
fn a_slot_file_with_an_image_continues_as_a_cold_run() {
    use nextn_engine::slot_file::SlotFileError;
    let l = common::bundled(2);
    let t = tower(&l);
    let setup = Setup {
        prefix_cache: Some(PrefixCacheConfig {
            budget_bytes: 64 << 20,
            snapshot_every: 0,
        }),
        ..Setup::drafting(3)
    };
    // A grid of several rows and columns: the image shifts the rotary positions after it.
    let (w, h) = (200u32, 150u32);
    let px = (0..w * h * 3).map(|i| ((i * 13) % 241) as u8).collect();
    let first = prompt_with(&l, &t, "Look:", &RgbImage::new(w, h, px).expect("image"));
    let im = &first.images[0];
    assert!(im.n_tokens() > im.n_pos() + 4, "{}x{}", im.nx, im.ny);
    let mut a = scheduler(engine(&l, &t, true), &setup);
    let answer = run(&mut a, &first, 12).expect("first turn");
    let mut second = first.clone();
    second.tokens.extend(&answer.tokens);
    second.tokens.extend(l.tok.encode_continuation(
        "<|im_end|>\n<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n",
        true,
    ));
    let (bytes, kept) = a
        .save_prefix(&second.tokens, second.tokens.len() - 1)
        .expect("a snapshot after the first turn");
    assert!(kept.len() > first.images[0].end(), "{}", kept.len());

    let mut b = scheduler(engine(&l, &t, true), &setup);
    assert_eq!(b.load_prefix(&bytes).expect("same tower"), kept);
    let warm = run(&mut b, &second, 24).expect("second turn, from the file");
    assert_eq!(warm.timings.cache_n, kept.len());
    assert_eq!(
        warm.timings.images_encoded, 0,
        "the image was not encoded again"
    );
    let cold = run(&mut scheduler(engine(&l, &t, true), &setup), &second, 24).expect("cold");
    assert_eq!(cold.timings.images_encoded, 1);
    assert_eq!(warm.tokens, cold.tokens, "warm equals cold");
    // The first engine resumes from the same state in memory: the same drafts.
    let same = run(&mut a, &second, 24).expect("second turn, in memory");
    assert_eq!(same.timings.cache_n, kept.len());
    assert_eq!(same.tokens, warm.tokens);
    assert_eq!(
        (
            warm.spec.drafted_per_pos.clone(),
            warm.spec.accepted_per_pos.clone()
        ),
        (
            same.spec.drafted_per_pos.clone(),
            same.spec.accepted_per_pos.clone()
        ),
        "the head resumed from the file where it stands in memory"
    );

    // Another tower (other token bounds), or none, did not encode these rows.
    let mut bounded = tower_of(&l);
    bounded.set_token_bounds(None, Some(8)).expect("bounds");
    let bounded = Arc::new(bounded);
    let e = scheduler(engine(&l, &bounded, true), &setup)
        .load_prefix(&bytes)
        .unwrap_err();
    assert!(
        matches!(e, SlotFileError::ForeignVision { n: 1, .. }),
        "{e}"
    );
    let e = scheduler(l.engine(true), &setup)
        .load_prefix(&bytes)
        .unwrap_err();
    assert!(matches!(e, SlotFileError::NoVision { n: 1 }), "{e}");
    assert!(e.to_string().contains("--mmproj"), "{e}");

    // The image section: count 1, the tower's fingerprint, then start, rows, positions.
    let mut at = [1u64.to_le_bytes(), t.fingerprint().to_le_bytes()].concat();
    let section = bytes
        .windows(at.len())
        .position(|w| w == at.as_slice())
        .expect("the image section")
        + at.len();
    at.clear();
    let field = |k: usize| section + 8 * k..section + 8 * k + 8;
    assert_eq!(bytes[field(0)], (im.pos as u64).to_le_bytes());
    assert_eq!(bytes[field(1)], (im.n_tokens() as u64).to_le_bytes());
    assert_eq!(bytes[field(2)], (im.n_pos() as u64).to_le_bytes());
    let edits: [(usize, u64, &str); 4] = [
        (0, im.pos as u64 + 1, "holds text tokens"),
        (1, im.n_tokens() as u64 - 1, "no image there"),
        (1, 1 << 40, "not inside the tokens"),
        (2, 0, "rotary position"),
    ];
    for (k, value, says) in edits {
        let mut edited = bytes.clone();
        edited[field(k)].copy_from_slice(&value.to_le_bytes());
        reseal(&mut edited);
        let e = scheduler(engine(&l, &t, true), &setup)
            .load_prefix(&edited)
            .unwrap_err();
        assert!(
            matches!(e, SlotFileError::BadImage { .. }) && e.to_string().contains(says),
            "field {k} = {value}: {e}"
        );
    }
}

/// A tower slow enough that its encode takes a good part of a second: 8 blocks of width 256 on
/// 16-pixel patches, for pictures scaled to at least 192 tokens.
fn slow_tower() -> Arc<VisionTower> {
    let dir = std::env::temp_dir().join(format!("nextn-images-slow-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("mmproj.gguf");
    let spec = TowerSpec {
        n_embd: 256,
        n_ff: 1024,
        n_layer: 8,
        n_head: 4,
        patch_size: 16,
        ..TowerSpec::fixture(256)
    };
    write_mmproj(&spec, &path).expect("write mmproj");
    let mut t = VisionTower::load(&path).expect("load mmproj");
    std::fs::remove_dir_all(&dir).ok();
    t.set_token_bounds(Some(192), Some(256)).expect("bounds");
    Arc::new(t)
}

/// Reports its listener gone once `after` has passed since the request started.
struct LeavesAfter {
    after: std::time::Duration,
    started: Option<std::time::Instant>,
    tx: mpsc::Sender<Event>,
}

impl nextn_engine::scheduler::EventSink for LeavesAfter {
    fn send(&mut self, event: Event) -> bool {
        if matches!(event, Event::Started { .. }) {
            self.started = Some(std::time::Instant::now());
        }
        self.tx.send(event).is_ok()
    }

    fn is_closed(&self) -> bool {
        self.started.is_some_and(|t| t.elapsed() >= self.after)
    }
}

/// A request whose client goes away while its picture is being encoded stops the encode: the
/// encoder counts it cancelled, not encoded, well before a whole encode's time; the next
/// request's picture is encoded as usual.
#[test]
fn a_cancelled_request_stops_its_encode() {
    let l = common::bundled(2);
    let t = slow_tower();
    let p = prompt(&l, &t, "Look:", 5);
    assert!(p.images[0].n_tokens() >= 192);
    // What one encode takes here, with the encoder's threads (one slot: the pool's two).
    let t0 = std::time::Instant::now();
    t.encode(&p.images[0].image, &l.pool).expect("encode");
    let full = t0.elapsed();
    let setup = Setup {
        n_ctx: 1024,
        ..Setup::plain()
    };
    let mut s = scheduler(engine(&l, &t, false), &setup);
    let (tx, rx) = mpsc::channel();
    s.submit(Request {
        prompt: p.tokens.clone(),
        images: p.images.clone(),
        sampler: SamplerConfig::greedy(),
        n_predict: Some(4),
        stop: Vec::new(),
        ignore_eos: true,
        trace: false,
        grammar: None,
        logprobs: None,
        cache_prompt: false,
        cache_points: Vec::new(),
        forced_acceptance: None,
        prompt_progress: false,
        sink: Box::new(LeavesAfter {
            after: full / 8,
            started: None,
            tx,
        }),
    });
    // Returns once the request is gone: the loop waited for the encoder meanwhile.
    s.run();
    let gone = std::time::Instant::now();
    assert!(
        rx.try_iter()
            .all(|e| !matches!(e, Event::Done(_) | Event::Text(_))),
        "the request ended before its picture was encoded"
    );
    while s.metrics().image_encodes_cancelled_total == 0 {
        assert!(
            gone.elapsed() < full,
            "the encode did not stop within a whole encode's time ({full:?})"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let stopped_after = gone.elapsed();
    let m = s.metrics();
    assert_eq!(
        (m.images_encoded_total, m.image_encodes_cancelled_total),
        (0, 1)
    );
    eprintln!("a whole encode: {full:?}; stopped {stopped_after:?} after the request went away");
    assert!(
        stopped_after < full / 2,
        "stopped {stopped_after:?} after the request went away, a whole encode takes {full:?}"
    );
    // The encoder goes on with the next request.
    let done = run(&mut s, &p, 2).expect("the next request");
    assert_eq!(done.timings.images_encoded, 1);
    assert_eq!(s.metrics().images_encoded_total, 1);
}

/// A prompt's length from its text and its pictures' sizes (what a server checks against the
/// context before decoding) is the length of the prompt made with the decoded pictures.
#[test]
fn the_prompt_length_from_image_sizes_is_the_prompt_length() {
    use nextn_engine::media::PromptText;
    let l = common::bundled(2);
    let t = tower(&l);
    let text = "<|im_start|>user\nOne <|vision_start|><|image_pad|><|vision_end|> and two \
                <|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n";
    let pictures = [picture(1), {
        let (w, h) = (333u32, 41u32);
        RgbImage::new(w, h, (0..w * h * 3).map(|i| (i % 7) as u8).collect()).expect("image")
    }];
    let pieces = PromptText::tokenize(&l.tok, text, true, 2).expect("two placeholders");
    let from_sizes = pieces.n_text_tokens()
        + pictures
            .iter()
            .map(|img| {
                let (nx, ny) = t.token_grid_for_size(img.width(), img.height());
                nx * ny
            })
            .sum::<usize>();
    let inputs: Vec<ImageInput> = pictures
        .iter()
        .map(|img| ImageInput::new(&t, img))
        .collect();
    let whole = MultimodalPrompt::tokenize(&l.tok, text, true, inputs.clone()).expect("tokenize");
    assert_eq!(from_sizes, whole.tokens.len());
    let laid = pieces.with_images(inputs).expect("two images");
    assert_eq!(laid.tokens, whole.tokens);
    assert!(PromptText::tokenize(&l.tok, text, true, 1).is_err());
}
