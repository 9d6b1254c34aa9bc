//! Slot files through the generation loop: a state saved by one engine and loaded by a fresh one
//! continues exactly as a cold engine would (tokens and log probabilities, with and without
//! drafting, on the bundled model and the dense and MoE fixtures); damaged, foreign and
//! mismatched files are refused with an error that says why.

mod common;

use common::{run_jobs, scheduler, Job, Loaded, Setup};
use nextn_engine::sampler::SamplerConfig;
use nextn_engine::scheduler::{PrefixCacheConfig, Scheduler};
use nextn_engine::slot_file::SlotFileError;
use nextn_gguf::Fnv1a;
use nextn_model::KvType;

fn models() -> Vec<Loaded> {
    common::bundled_and_fixtures(2)
}

fn tokens(l: &Loaded, n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| {
            (i.wrapping_mul(2246822519).wrapping_add(seed * 104729) >> 7) % l.model.n_vocab as u32
        })
        .collect()
}

fn job(prompt: &[u32], n: usize, cache_points: Vec<usize>) -> Job {
    Job {
        cache_points,
        prompt: prompt.to_vec(),
        sampler: SamplerConfig {
            temperature: 0.8,
            seed: 5,
            ..SamplerConfig::default()
        },
        n,
        grammar: None,
        logprobs: Some(2),
    }
}

fn cached(setup: &Setup) -> Setup {
    Setup {
        prefix_cache: Some(PrefixCacheConfig {
            budget_bytes: 1 << 30,
            snapshot_every: 0,
        }),
        ..setup.clone()
    }
}

/// Run `prompt` on a fresh engine, keeping a snapshot before its last token; the slot file of it.
fn save(l: &Loaded, setup: &Setup, prompt: &[u32]) -> (Vec<u8>, Vec<u32>) {
    let setup = cached(setup);
    let mut s = scheduler(l, &setup, 1, 2);
    let point = prompt.len() - 1;
    run_jobs(&mut s, &setup, vec![job(prompt, 4, vec![point])]);
    s.save_prefix(prompt, point)
        .expect("a snapshot at the point")
}

fn load(s: &mut Scheduler<'_>, bytes: &[u8]) -> Result<Vec<u32>, SlotFileError> {
    s.load_prefix(bytes)
}

/// Rewrite the checksum after editing a file, so that only the edit is judged.
fn reseal(bytes: &mut [u8]) {
    let n = bytes.len() - 8;
    let mut h = Fnv1a::new();
    h.write(&bytes[..n]);
    bytes[n..].copy_from_slice(&h.finish().to_le_bytes());
}

#[test]
fn a_loaded_state_continues_as_a_cold_engine() {
    for l in models() {
        for (label, base) in [("plain", Setup::plain()), ("mtp", Setup::drafting(3))] {
            let prompt = tokens(&l, 50, 1);
            let (bytes, kept) = save(&l, &base, &prompt);
            assert_eq!(kept, prompt[..prompt.len() - 1], "{label}");

            let setup = cached(&base);
            let mut warm = scheduler(&l, &setup, 1, 2);
            assert_eq!(load(&mut warm, &bytes).unwrap(), kept);
            let next: Vec<u32> = [prompt.clone(), tokens(&l, 9, 2)].concat();
            let (w, wl) = run_jobs(&mut warm, &setup, vec![job(&next, 12, vec![])]).remove(0);
            let mut cold = scheduler(&l, &base, 1, 2);
            let (c, cl) = run_jobs(&mut cold, &base, vec![job(&next, 12, vec![])]).remove(0);
            assert_eq!(w.timings.cache_n, kept.len(), "{label}");
            assert_eq!(w.tokens, c.tokens, "{label}");
            assert_eq!(wl, cl, "{label}: log probabilities");
        }
    }
}

#[test]
fn damaged_foreign_and_mismatched_files_are_refused() {
    let l = common::bundled(2);
    let drafting = Setup::drafting(2);
    let prompt = tokens(&l, 20, 3);
    let (bytes, _) = save(&l, &drafting, &prompt);
    let setup = cached(&drafting);
    let mut s = scheduler(&l, &setup, 1, 2);

    // Every cut, and a flipped byte anywhere, is caught.
    for cut in [0, 4, 12, bytes.len() / 2, bytes.len() - 1] {
        assert!(load(&mut s, &bytes[..cut]).is_err(), "cut at {cut}");
    }
    let mut flipped = bytes.clone();
    flipped[bytes.len() / 3] ^= 0x40;
    assert!(matches!(
        load(&mut s, &flipped),
        Err(SlotFileError::Checksum)
    ));
    let mut other = bytes.clone();
    other[..8].copy_from_slice(b"GGUF\x03\0\0\0");
    assert!(matches!(
        load(&mut s, &other),
        Err(SlotFileError::NotASlotFile)
    ));
    let mut newer = bytes.clone();
    newer[8..12].copy_from_slice(&3u32.to_le_bytes());
    reseal(&mut newer);
    let e = load(&mut s, &newer).unwrap_err();
    assert!(matches!(e, SlotFileError::Version { found: 3, .. }), "{e}");

    // Another model's fingerprint.
    let mut foreign = bytes.clone();
    foreign[12] ^= 1;
    reseal(&mut foreign);
    let e = load(&mut s, &foreign).unwrap_err();
    assert!(matches!(e, SlotFileError::ForeignModel { .. }), "{e}");
    assert!(e.to_string().contains("another model"), "{e}");

    // Another KV element type.
    let f32_setup = Setup {
        kv: KvType::F32,
        ..cached(&drafting)
    };
    let mut f32_engine = scheduler(&l, &f32_setup, 1, 2);
    let e = load(&mut f32_engine, &bytes).unwrap_err();
    assert!(matches!(e, SlotFileError::KvTypes { .. }), "{e}");

    // Saved without the head: a drafting engine cannot use it; a plain one can use a file
    // with the head's state (and leaves that part alone).
    let (plain_bytes, _) = save(&l, &Setup::plain(), &prompt);
    let e = load(&mut s, &plain_bytes).unwrap_err();
    assert!(matches!(e, SlotFileError::NoHeadState), "{e}");
    let plain = cached(&Setup::plain());
    let mut p = scheduler(&l, &plain, 1, 2);
    assert_eq!(load(&mut p, &bytes).unwrap().len(), prompt.len() - 1);

    // The intact file still loads after all that.
    assert_eq!(load(&mut s, &bytes).unwrap().len(), prompt.len() - 1);

    // A file from a real other model.
    if let Some(golden) = nextn_testdata::shared("golden") {
        let dense = common::load(&golden.join("q35-dense-a/q35-dense-a-Q4_K_M.gguf"), 2);
        let mut d = scheduler(&dense, &setup, 1, 2);
        let e = load(&mut d, &bytes).unwrap_err();
        assert!(matches!(e, SlotFileError::ForeignModel { .. }), "{e}");
    }
}
