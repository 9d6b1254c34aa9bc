//! SPEC_AGREE: MTP speculative decoding produces exactly the tokens plain decoding produces —
//! greedy at every n_max, and with a seeded sampler at temperature > 0 — and drafts what
//! llama.cpp's server loop drafts on the golden fixtures.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use nextn_engine::generate::{generate, GenerateParams};
use nextn_engine::sampler::{Sampler, SamplerConfig};
use nextn_engine::speculative::{generate_speculative, SpecParams, SpecSequence};
use nextn_engine::tokenizer::Tokenizer;
use nextn_gguf::GgufFile;
use nextn_model::{KvType, Model, NextnHead};
use nextn_quant::kernels::ThreadPool;
use serde_json::Value;

struct Loaded {
    model: Model,
    head: NextnHead,
    tok: Tokenizer,
}

fn load(path: &Path) -> Loaded {
    let file = Arc::new(GgufFile::open(path).expect("open model"));
    let model = Model::load(file.clone()).expect("load model");
    let head = NextnHead::load(&model).expect("load head");
    let tok = Tokenizer::from_gguf(&file).expect("tokenizer");
    Loaded { model, head, tok }
}

fn bundled() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/tiny-qwen35-mtp-Q8_0.gguf")
}

fn plain(
    l: &Loaded,
    pool: &ThreadPool,
    prompt: &[u32],
    n: usize,
    cfg: &SamplerConfig,
    kv: KvType,
) -> Vec<u32> {
    let mut st = l.model.new_sequence(512, kv, kv);
    let params = GenerateParams {
        n_predict: Some(n),
        ignore_eos: true,
        ..Default::default()
    };
    let mut s = Sampler::new(cfg.clone()).unwrap();
    generate(
        &l.model,
        &l.tok,
        pool,
        &mut st,
        prompt,
        &params,
        &mut s,
        |_| true,
    )
    .unwrap()
    .tokens
}

fn speculative(
    l: &Loaded,
    pool: &ThreadPool,
    prompt: &[u32],
    n: usize,
    cfg: &SamplerConfig,
    spec: &SpecParams,
    kv: KvType,
) -> (Vec<u32>, nextn_engine::speculative::SpecStats) {
    let mut seq = SpecSequence::new(&l.model, &l.head, 512, kv, kv);
    let params = GenerateParams {
        n_predict: Some(n),
        ignore_eos: true,
        ..Default::default()
    };
    let mut s = Sampler::new(cfg.clone()).unwrap();
    let (g, stats) = generate_speculative(
        &l.model,
        &l.head,
        &l.tok,
        pool,
        &mut seq,
        prompt,
        &params,
        spec,
        &mut s,
        |_| true,
    )
    .unwrap();
    (g.tokens, stats)
}

#[test]
fn greedy_speculative_equals_plain_on_bundled_model() {
    let l = load(&bundled());
    let pool = ThreadPool::new(2);
    let prompts = [
        "import os\nimport sys\n\n\ndef main():\n",
        "class Stack:\n    def __init__(self):\n",
        "x",
    ];
    for p in prompts {
        let prompt = l.tok.encode(p, true);
        let want = plain(
            &l,
            &pool,
            &prompt,
            40,
            &SamplerConfig::greedy(),
            KvType::F16,
        );
        for n_max in 0..=5 {
            let spec = SpecParams {
                n_max,
                ..Default::default()
            };
            let (got, stats) = speculative(
                &l,
                &pool,
                &prompt,
                40,
                &SamplerConfig::greedy(),
                &spec,
                KvType::F16,
            );
            assert_eq!(
                got, want,
                "prompt {p:?} n_max {n_max}: speculative output differs from plain decoding"
            );
            if n_max > 0 {
                assert!(stats.draft_n > 0 && stats.draft_n_accepted <= stats.draft_n);
            }
        }
    }
}

#[test]
fn seeded_sampling_speculative_equals_plain() {
    let l = load(&bundled());
    let pool = ThreadPool::new(2);
    let prompt = l.tok.encode("def factorial(n):\n", true);
    for seed in [1u64, 7, 1234] {
        let cfg = SamplerConfig {
            temperature: 0.9,
            seed,
            ..Default::default()
        };
        let want = plain(&l, &pool, &prompt, 32, &cfg, KvType::F32);
        for n_max in [1, 3] {
            let spec = SpecParams {
                n_max,
                ..Default::default()
            };
            let (got, _) = speculative(&l, &pool, &prompt, 32, &cfg, &spec, KvType::F32);
            assert_eq!(got, want, "seed {seed} n_max {n_max}");
        }
    }
}

#[test]
fn budget_and_p_min_are_respected() {
    let l = load(&bundled());
    let pool = ThreadPool::new(1);
    let prompt = l.tok.encode("import os\n", true);
    for n in [1usize, 2, 5] {
        let (got, _) = speculative(
            &l,
            &pool,
            &prompt,
            n,
            &SamplerConfig::greedy(),
            &SpecParams::default(),
            KvType::F16,
        );
        assert_eq!(got.len(), n);
    }
    let strict = SpecParams {
        n_max: 4,
        p_min: 1.01,
        ..Default::default()
    };
    let (_, stats) = speculative(
        &l,
        &pool,
        &prompt,
        10,
        &SamplerConfig::greedy(),
        &strict,
        KvType::F16,
    );
    assert_eq!(stats.draft_n, 0, "p_min above 1 must stop every draft");
    let min3 = SpecParams {
        n_max: 2,
        n_min: 3,
        ..Default::default()
    };
    let (_, stats) = speculative(
        &l,
        &pool,
        &prompt,
        10,
        &SamplerConfig::greedy(),
        &min3,
        KvType::F16,
    );
    assert_eq!(stats.draft_n, 0, "drafts shorter than n_min are discarded");
}

fn shared() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/golden");
    if p.is_dir() {
        Some(p)
    } else {
        eprintln!("skipped: ../shared not found");
        None
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Step-by-step drafts and acceptance equal llama-server's loop (golden `speculative_simulated`,
/// server style: n_max 3, 24 tokens) on the F32 fixtures.
#[test]
fn drafts_match_llamacpp_server_loop() {
    let Some(dir) = shared() else { return };
    let pool = ThreadPool::new(2);
    for fixture in ["q35-dense-a", "q35moe-a", "q35moe-b"] {
        let golden: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(fixture).join("golden.json")).unwrap(),
        )
        .unwrap();
        let v = &golden["variants"]["F32"];
        let l = load(&dir.join(fixture).join(v["model"].as_str().unwrap()));
        for seq in v["sequences"].as_array().unwrap() {
            let name = seq["name"].as_str().unwrap();
            let sim = &golden["speculative_simulated"]["F32"][name]["server"];
            if sim.is_null() {
                continue;
            }
            let prompt = ids(&seq["tokens"]);
            let spec = SpecParams {
                n_max: 3,
                trace: true,
                ..Default::default()
            };
            let mut s = SpecSequence::new(&l.model, &l.head, 512, KvType::F32, KvType::F32);
            let params = GenerateParams {
                n_predict: Some(24),
                ignore_eos: false,
                ..Default::default()
            };
            let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
            let (g, stats) = generate_speculative(
                &l.model,
                &l.head,
                &l.tok,
                &pool,
                &mut s,
                &prompt,
                &params,
                &spec,
                &mut sampler,
                |_| true,
            )
            .unwrap();
            let greedy = ids(&seq["greedy"]["tokens"]);
            let n = g.tokens.len().min(greedy.len());
            assert_eq!(
                g.tokens[..n],
                greedy[..n],
                "{fixture} {name}: tokens differ from llama.cpp greedy"
            );
            for (i, (ours, theirs)) in stats
                .trace
                .iter()
                .zip(sim["steps"].as_array().unwrap())
                .enumerate()
            {
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
    let Some(dir) = shared() else { return };
    let pool = ThreadPool::new(2);
    let files = [
        "q35-dense-a/q35-dense-a-F32.gguf",
        "q35-dense-a/q35-dense-a-Q4_K_M.gguf",
        "q35moe-a/q35moe-a-Q8_0.gguf",
        "q35moe-b/q35moe-b-F32.gguf",
    ];
    let mut rejected_at = vec![false; 4];
    for file in files {
        let l = load(&dir.join(file));
        let golden: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(file).parent().unwrap().join("golden.json")).unwrap(),
        )
        .unwrap();
        for seq in golden["sequences"].as_array().unwrap() {
            let prompt = ids(&seq["tokens"]);
            for (n_predict, n_ctx, n_batch) in
                [(30, 512, 4), (7, 512, 512), (64, prompt.len() + 9, 8)]
            {
                let params = GenerateParams {
                    n_predict: Some(n_predict),
                    n_batch,
                    ignore_eos: true,
                    ..Default::default()
                };
                let mut st = l.model.new_sequence(n_ctx, KvType::F16, KvType::F16);
                let mut s = Sampler::new(SamplerConfig::greedy()).unwrap();
                let want = generate(
                    &l.model,
                    &l.tok,
                    &pool,
                    &mut st,
                    &prompt,
                    &params,
                    &mut s,
                    |_| true,
                )
                .unwrap();
                for n_max in 1..=4 {
                    let spec = SpecParams {
                        n_max,
                        trace: true,
                        ..Default::default()
                    };
                    let mut sq =
                        SpecSequence::new(&l.model, &l.head, n_ctx, KvType::F16, KvType::F16);
                    let mut s = Sampler::new(SamplerConfig::greedy()).unwrap();
                    let (got, stats) = generate_speculative(
                        &l.model,
                        &l.head,
                        &l.tok,
                        &pool,
                        &mut sq,
                        &prompt,
                        &params,
                        &spec,
                        &mut s,
                        |_| true,
                    )
                    .unwrap();
                    assert_eq!(
                        got.tokens, want.tokens,
                        "{file} {} n_max {n_max} n_ctx {n_ctx}",
                        seq["name"]
                    );
                    assert_eq!(got.finish, want.finish);
                    for st in &stats.trace {
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
/// (golden `mtp_chains`) are reproduced exactly.
#[test]
fn draft_chains_match_llamacpp_at_every_position() {
    use nextn_engine::speculative::{draft_chain, prefill_speculative};
    let Some(dir) = shared() else { return };
    let pool = ThreadPool::new(2);
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
        let l = load(&dir.join(fixture).join(v["model"].as_str().unwrap()));
        let mut checked = 0;
        for seq in v["sequences"].as_array().unwrap() {
            let mut ext = ids(&seq["tokens"]);
            ext.extend(ids(&seq["greedy"]["tokens"]));
            for chain in seq["mtp_chains"]["chains"].as_array().unwrap() {
                let p = chain["pos"].as_u64().unwrap() as usize;
                if p == 0 || p >= ext.len() {
                    continue;
                }
                let mut s = SpecSequence::new(&l.model, &l.head, 512, KvType::F32, KvType::F32);
                prefill_speculative(&l.model, &l.head, &mut s, &ext[..p], 512, &pool).unwrap();
                let drafts = draft_chain(&l.head, &mut s, ext[p], 3, 0.0, &pool).unwrap();
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
