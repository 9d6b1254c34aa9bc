//! Our speculative building blocks (a target pass, the drafting step, one verify pass, coupled
//! acceptance, commit, the head's commit) driven the way llama.cpp's `llama-speculative-simple`
//! drives its loop reproduce
//! its per-step drafts, accepted counts and bonus tokens on the F32 golden fixtures
//! (`speculative_simple`, the real program's debug log, and `speculative_simulated.simple`).
//!
//! That loop differs from the server's (covered in spec_agree.rs): the target evaluates the
//! prompt minus its last token, the first draft starts from the last prompt token at
//! n_past = N − 1, a step drafts `min(n_max, n_predict − emitted − 1)` tokens — or n_max when
//! that is not positive, since common_speculative_draft only truncates to a positive cap — and
//! the loop runs until more than n_predict tokens came out.

use std::sync::Arc;

use nextn_engine::sampler::{Sampler, SamplerConfig};
use nextn_engine::speculative::accept::accept_coupled;
use nextn_engine::speculative::draft::{draft, DraftJob, HeadState};
use nextn_engine::speculative::SpecConfig;
use nextn_gguf::GgufFile;
use nextn_model::{KvType, LogitRows, Model, NextnHead};
use nextn_quant::kernels::ThreadPool;
use serde_json::Value;

const N_MAX: usize = 3;
const N_PREDICT: usize = 24;

#[derive(Debug, PartialEq)]
struct Step {
    n_past: usize,
    drafts: Vec<u32>,
    accepted: usize,
    bonus: u32,
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// llama-speculative-simple's loop at temperature 0, `max_steps` steps at most.
fn simple_loop(
    model: &Model,
    head: &NextnHead,
    pool: &ThreadPool,
    prompt: &[u32],
    eog: &[u32],
    max_steps: usize,
) -> (Vec<Step>, Vec<u32>) {
    let e = model.config.n_embd;
    let spec = SpecConfig {
        n_max: N_MAX,
        ..SpecConfig::default()
    };
    let mut state = model.new_sequence(512, KvType::F32, KvType::F32).unwrap();
    let mut head_state = HeadState::new(head, e, KvType::F32, KvType::F32, 4096).unwrap();
    let mut sampler = Sampler::new(SamplerConfig::greedy()).expect("greedy sampler");
    let (last, rest) = prompt.split_last().expect("non-empty prompt");
    let out = model
        .forward(rest, &mut state, LogitRows::None, pool)
        .expect("prefill");
    head_state.commit(0, rest, &out.hidden);
    let mut id_last = *last;
    let (mut steps, mut emitted) = (Vec::new(), Vec::new());
    // It stops only once more than n_predict tokens came out.
    while emitted.len() <= N_PREDICT && steps.len() < max_steps {
        let n_past = state.n_past;
        let cap = N_PREDICT as isize - emitted.len() as isize - 1;
        let n_draft = if cap <= 0 {
            N_MAX
        } else {
            N_MAX.min(cap as usize)
        };
        let mut jobs = [DraftJob {
            head: &mut head_state,
            id_last,
            n_past,
            n_draft,
            sampler: &mut sampler,
            sample_drafts: false,
            first_index: emitted.len() as u64,
            grammar: None,
        }];
        let (made, _) = draft(head, &mut jobs, &spec, 512, pool).expect("draft");
        let drafts = made[0].tokens.clone();
        let mut rows = vec![id_last];
        rows.extend_from_slice(&drafts);
        let out = model
            .forward_verify(&rows, &mut state, pool)
            .expect("verify");
        let kept = accept_coupled(&mut sampler, &drafts, &out, emitted.len() as u64, None)
            .expect("accept");
        let accepted = kept.drafts;
        let next = kept.next.expect("without a grammar a token always follows");
        model.commit(&mut state, accepted + 1).expect("commit");
        // The head's entries for the accepted drafts, from the target's hidden states.
        head_state.commit(
            n_past,
            &rows[..accepted + 1],
            &out.hidden[..(accepted + 1) * e],
        );
        steps.push(Step {
            n_past,
            drafts: drafts.clone(),
            accepted,
            bonus: next,
        });
        // Tokens come out one by one; an end-of-generation token ends the run.
        for &t in drafts[..accepted].iter().chain([&next]) {
            emitted.push(t);
            if eog.contains(&t) {
                return (steps, emitted);
            }
        }
        id_last = next;
    }
    (steps, emitted)
}

fn golden_steps(v: &Value, with_n_past: bool) -> Vec<Step> {
    v.as_array()
        .expect("steps")
        .iter()
        .map(|s| Step {
            n_past: if with_n_past {
                s["n_past"].as_u64().expect("n_past") as usize
            } else {
                usize::MAX
            },
            drafts: ids(&s["drafts"]),
            accepted: s["accepted"].as_u64().expect("accepted") as usize,
            bonus: s["last_target_token"].as_u64().expect("last_target_token") as u32,
        })
        .collect()
}

#[test]
fn drafts_match_llamacpp_speculative_simple() {
    let Some(dir) = nextn_testdata::shared("golden") else {
        return;
    };
    let pool = ThreadPool::new(2);
    let mut compared = 0;
    for (fixture, variant) in [
        ("q35-dense-a", "F32"),
        ("q35moe-a", "F32"),
        ("q35moe-b", "F32"),
        ("q35-dense-qwenvocab", "F32-embQ8_0"),
    ] {
        let golden: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(fixture).join("golden.json")).expect("golden.json"),
        )
        .expect("golden json");
        let v = &golden["variants"][variant];
        let path = dir.join(fixture).join(v["model"].as_str().expect("model"));
        let file = Arc::new(GgufFile::open(&path).expect("open model"));
        let model = Model::load(file).expect("load model");
        let head = NextnHead::load(&model).expect("load head");
        let eog = ids(&v["eog_ids"]);
        for seq in v["sequences"].as_array().expect("sequences") {
            let name = seq["name"].as_str().expect("name");
            let prompt = ids(&seq["tokens"]);

            // The replay of llama.cpp's loop from its own per-position draft chains.
            let sim = &golden["speculative_simulated"][variant][name]["simple"];
            if !sim.is_null() {
                let want = golden_steps(&sim["steps"], true);
                let (got, _) = simple_loop(&model, &head, &pool, &prompt, &eog, want.len());
                assert_eq!(
                    got, want,
                    "{fixture} {variant} {name}: simulated simple loop"
                );
                compared += want.len();
            }

            // The real program's log, which ran on to its last step.
            let real = &golden["speculative_simple"][variant][name];
            if !real.is_null() {
                let want = golden_steps(&real["steps"], false);
                let (got, emitted) = simple_loop(&model, &head, &pool, &prompt, &eog, usize::MAX);
                let got: Vec<Step> = got
                    .into_iter()
                    .map(|s| Step {
                        n_past: usize::MAX,
                        ..s
                    })
                    .collect();
                assert_eq!(
                    got, want,
                    "{fixture} {variant} {name}: llama-speculative-simple steps"
                );
                assert_eq!(
                    emitted,
                    ids(&real["emitted_tokens"]),
                    "{fixture} {variant} {name}: emitted tokens"
                );
                compared += want.len();
            }
        }
    }
    assert!(compared > 100, "only {compared} steps compared");
}
