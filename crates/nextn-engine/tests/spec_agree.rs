//! SPEC_AGREE: MTP speculative decoding through the generation loop produces exactly the tokens
//! plain decoding produces — greedy at every n_max, and with a seeded sampler at temperature > 0
//! whatever the drafting did — and drafts what llama.cpp's server loop drafts on the golden
//! fixtures.

mod common;

use common::{bundled, generate, load, plain_reference, Setup};
use nextn_engine::sampler::{Sampler, SamplerConfig};
use nextn_engine::speculative::draft::{draft, DraftJob, HeadState};
use nextn_engine::speculative::SpecConfig;
use nextn_model::{KvType, LogitRows};
use serde_json::Value;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn greedy_speculative_equals_plain_on_bundled_model() {
    let l = bundled(2);
    let prompts = [
        "import os\nimport sys\n\n\ndef main():\n",
        "class Stack:\n    def __init__(self):\n",
        "x",
    ];
    for p in prompts {
        let prompt = l.tok.encode(p, true);
        let greedy = SamplerConfig::greedy();
        let (want, _) = plain_reference(&l, &prompt, &greedy, 40, &Setup::plain());
        for n_max in 0..=5 {
            let got = generate(&l, &Setup::drafting(n_max), &prompt, &greedy, 40);
            assert_eq!(
                got.tokens, want,
                "prompt {p:?} n_max {n_max}: speculative output differs from plain decoding"
            );
            if n_max > 0 {
                assert!(got.spec.draft_n > 0 && got.spec.draft_n_accepted <= got.spec.draft_n);
            }
        }
        let plain = generate(&l, &Setup::plain(), &prompt, &greedy, 40);
        assert_eq!(
            plain.tokens, want,
            "prompt {p:?}: plain decoding in the loop"
        );
    }
}

/// A seed pins the output: coupled acceptance draws every token as plain decoding draws it, so
/// the tokens are the same at every draft depth, with the full or a trimmed head.
#[test]
fn seeded_sampling_speculative_equals_plain() {
    let mut l = bundled(2);
    let prompt = l.tok.encode("def factorial(n):\n", true);
    let mut setup = Setup::plain();
    setup.kv = KvType::F32;
    let mut seen_accepted = 0;
    for seed in [1u64, 7, 1234] {
        let cfg = SamplerConfig {
            temperature: 0.9,
            seed,
            ..Default::default()
        };
        let (want, _) = plain_reference(&l, &prompt, &cfg, 32, &setup);
        for trimmed in [false, true] {
            if trimmed {
                let kept: Vec<u32> = (0..2048).collect();
                l.head.restrict_vocab(&kept).unwrap();
            } else {
                l.head.clear_draft_vocab();
            }
            for n_max in 1..=4 {
                let mut s = Setup::drafting(n_max);
                s.kv = KvType::F32;
                let got = generate(&l, &s, &prompt, &cfg, 32);
                assert_eq!(
                    got.tokens, want,
                    "seed {seed} n_max {n_max} trimmed {trimmed}"
                );
                seen_accepted += got.spec.draft_n_accepted;
            }
        }
    }
    assert!(
        seen_accepted > 0,
        "no draft was accepted: verify never kept a draft"
    );
}

#[test]
fn budget_and_p_min_are_respected() {
    let l = bundled(1);
    let prompt = l.tok.encode("import os\n", true);
    let greedy = SamplerConfig::greedy();
    for n in [1usize, 2, 5] {
        let got = generate(&l, &Setup::drafting(3), &prompt, &greedy, n);
        assert_eq!(got.tokens.len(), n);
    }
    let mut strict = Setup::drafting(4);
    strict.spec.as_mut().unwrap().p_min = 1.01;
    let got = generate(&l, &strict, &prompt, &greedy, 10);
    assert_eq!(got.spec.draft_n, 0, "p_min above 1 must stop every draft");
    let mut min3 = Setup::drafting(2);
    min3.spec.as_mut().unwrap().n_min = 3;
    let got = generate(&l, &min3, &prompt, &greedy, 10);
    assert_eq!(
        got.spec.draft_n, 0,
        "drafts shorter than n_min are discarded"
    );
}

/// Step-by-step drafts and acceptance equal llama-server's loop (golden `speculative_simulated`,
/// server style: n_max 3, 24 tokens) on the F32 fixtures.
#[test]
fn drafts_match_llamacpp_server_loop() {
    let Some(dir) = nextn_testdata::shared("golden") else {
        return;
    };
    for fixture in ["q35-dense-a", "q35moe-a", "q35moe-b"] {
        let golden: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(fixture).join("golden.json")).unwrap(),
        )
        .unwrap();
        let v = &golden["variants"]["F32"];
        let l = load(&dir.join(fixture).join(v["model"].as_str().unwrap()), 2);
        for seq in v["sequences"].as_array().unwrap() {
            let name = seq["name"].as_str().unwrap();
            let sim = &golden["speculative_simulated"]["F32"][name]["server"];
            if sim.is_null() {
                continue;
            }
            let prompt = ids(&seq["tokens"]);
            let mut setup = Setup::drafting(3);
            setup.kv = KvType::F32;
            setup.trace = true;
            setup.ignore_eos = false;
            let got = generate(&l, &setup, &prompt, &SamplerConfig::greedy(), 24);
            let greedy = ids(&seq["greedy"]["tokens"]);
            let n = got.tokens.len().min(greedy.len());
            assert_eq!(
                got.tokens[..n],
                greedy[..n],
                "{fixture} {name}: tokens differ from llama.cpp greedy"
            );
            let steps = sim["steps"].as_array().unwrap();
            assert!(!got.spec.trace.is_empty());
            for (i, (ours, theirs)) in got.spec.trace.iter().zip(steps).enumerate() {
                assert_eq!(
                    ours.n_past as u64,
                    theirs["n_past"].as_u64().unwrap(),
                    "{fixture} {name} step {i} n_past"
                );
                assert_eq!(
                    ours.drafts,
                    ids(&theirs["drafts"]),
                    "{fixture} {name} step {i} drafts"
                );
                assert_eq!(
                    ours.accepted as u64,
                    theirs["accepted"].as_u64().unwrap(),
                    "{fixture} {name} step {i} accepted"
                );
            }
        }
    }
}

/// SPEC_AGREE on the dense and MoE fixtures (F32 and quantized): MTP greedy output equals plain
/// greedy output at n_max 1..4, with prompts whose length is a multiple of the prefill chunk,
/// drafts cut by the requested length and by the context limit; rejection occurs at every position.
#[test]
fn greedy_speculative_equals_plain_on_fixtures() {
    let Some(dir) = nextn_testdata::shared("golden") else {
        return;
    };
    let files = [
        "q35-dense-a/q35-dense-a-F32.gguf",
        "q35-dense-a/q35-dense-a-Q4_K_M.gguf",
        "q35moe-a/q35moe-a-Q8_0.gguf",
        "q35moe-b/q35moe-b-F32.gguf",
    ];
    let mut rejected_at = vec![false; 4];
    for file in files {
        let l = load(&dir.join(file), 2);
        let golden: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(file).parent().unwrap().join("golden.json")).unwrap(),
        )
        .unwrap();
        for seq in golden["sequences"].as_array().unwrap() {
            let prompt = ids(&seq["tokens"]);
            for (n_predict, n_ctx, n_batch) in
                [(30, 512, 4), (7, 512, 512), (64, prompt.len() + 9, 8)]
            {
                let mut setup = Setup::plain();
                setup.n_ctx = n_ctx;
                setup.n_batch = n_batch;
                let greedy = SamplerConfig::greedy();
                let (want, want_finish) = plain_reference(&l, &prompt, &greedy, n_predict, &setup);
                for n_max in 1..=4 {
                    let mut s = Setup::drafting(n_max);
                    s.n_ctx = n_ctx;
                    s.n_batch = n_batch;
                    s.trace = true;
                    let got = generate(&l, &s, &prompt, &greedy, n_predict);
                    assert_eq!(
                        got.tokens, want,
                        "{file} {} n_max {n_max} n_ctx {n_ctx}",
                        seq["name"]
                    );
                    assert_eq!(got.finish, want_finish);
                    for st in &got.spec.trace {
                        if st.accepted < st.drafts.len() {
                            rejected_at[st.accepted] = true;
                        }
                    }
                }
            }
        }
    }
    assert!(
        rejected_at.iter().all(|&r| r),
        "rejections not seen at every draft position: {rejected_at:?}"
    );
}

/// The 3-token draft chains llama.cpp drafts at every position of the F32 fixtures' greedy paths
/// (golden `mtp_chains`) are reproduced exactly by the drafting step.
#[test]
fn draft_chains_match_llamacpp_at_every_position() {
    let Some(dir) = nextn_testdata::shared("golden") else {
        return;
    };
    for fixture in ["q35-dense-a", "q35moe-a", "q35moe-b", "q35-dense-qwenvocab"] {
        let golden: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(fixture).join("golden.json")).unwrap(),
        )
        .unwrap();
        let variant = if fixture == "q35-dense-qwenvocab" {
            "F32-embQ8_0"
        } else {
            "F32"
        };
        let v = &golden["variants"][variant];
        let l = load(&dir.join(fixture).join(v["model"].as_str().unwrap()), 2);
        let e = l.model.config.n_embd;
        let spec = SpecConfig {
            n_max: 3,
            ..SpecConfig::default()
        };
        let mut checked = 0;
        for seq in v["sequences"].as_array().unwrap() {
            let mut ext = ids(&seq["tokens"]);
            ext.extend(ids(&seq["greedy"]["tokens"]));
            for chain in seq["mtp_chains"]["chains"].as_array().unwrap() {
                let p = chain["pos"].as_u64().unwrap() as usize;
                if p == 0 || p >= ext.len() {
                    continue;
                }
                // The target over ext[..p]; the head learns those positions; then one draft step.
                let mut state = l.model.new_sequence(512, KvType::F32, KvType::F32).unwrap();
                let out = l
                    .model
                    .forward(&ext[..p], &mut state, LogitRows::None, &l.pool)
                    .unwrap();
                let mut head = HeadState::new(&l.head, e, KvType::F32, KvType::F32, 4096).unwrap();
                let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
                head.commit(0, &ext[..p], &out.hidden);
                let mut jobs = [DraftJob {
                    head: &mut head,
                    id_last: ext[p],
                    n_past: p,
                    n_draft: 3,
                    sampler: &mut sampler,
                    sample_drafts: false,
                    first_index: 0,
                    grammar: None,
                }];
                let (made, _) = draft(&l.head, &mut jobs, &spec, p + 1, &l.pool).unwrap();
                let drafts = &made[0].tokens;
                let want = ids(&chain["drafts"]);
                // Compare up to a near-tie (top-1 − top-2 < 1e-3), where F32 rounding may flip the pick.
                let margins: Vec<f64> = chain["top1_logit_top2_id_logit"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|m| m[0].as_f64().unwrap() - m[2].as_f64().unwrap())
                    .collect();
                for i in 0..want.len() {
                    if margins.get(i).copied().unwrap_or(0.0) < 1e-3 {
                        break;
                    }
                    assert_eq!(
                        drafts[i], want[i],
                        "{fixture} {} chain at {p}, draft {i}",
                        seq["name"]
                    );
                    checked += 1;
                }
            }
        }
        eprintln!("{fixture}: {checked} chained drafts equal llama.cpp's");
        assert!(checked > 100);
    }
}
