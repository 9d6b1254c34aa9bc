//! Sampling with MTP keeps the target's distribution: the first two generated tokens, over many
//! seeds, follow the exact joint distribution plain sampling has — in both draft-sampling modes —
//! while a deliberately biased rule (accept every draft) is detected by the same test.

mod common;

use std::collections::HashMap;

use common::{generate_many, Setup};
use nextn_engine::sampler::{Sampler, SamplerConfig, Xoshiro256StarStar};
use nextn_engine::speculative::{DraftSampling, SpecConfig};
use nextn_model::{KvType, LogitRows, Model, NextnHead};
use nextn_quant::kernels::ThreadPool;

type Joint = HashMap<(u32, u32), f64>;

fn config(seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature: 0.8,
        seed,
        ..Default::default()
    }
}

/// Exact P(t1, t2) under plain sampling, and the biased B(t1, t2) = p1(t1)·q(t2 | t1) that taking
/// every head draft would give.
fn exact(model: &Model, head: &NextnHead, prompt: &[u32], pool: &ThreadPool) -> (Joint, Joint) {
    let e = model.config.n_embd;
    let mut st = model.new_sequence(64, KvType::F32, KvType::F32).unwrap();
    let out = model
        .forward(prompt, &mut st, LogitRows::Last, pool)
        .unwrap();
    let mut sampler = Sampler::new(config(0)).unwrap();
    let p1 = sampler.distribution(&out.logits).to_vec();
    let h_last = out.hidden[(prompt.len() - 1) * e..].to_vec();
    let mut head_cache = head.new_cache(KvType::F32, KvType::F32, 4096).unwrap();
    let mut prev = vec![0.0f32; e];
    prev.extend_from_slice(&out.hidden[..(prompt.len() - 1) * e]);
    head.forward(prompt, &prev, 0, &mut head_cache, LogitRows::None, pool)
        .unwrap();
    let (mut p, mut b) = (Joint::new(), Joint::new());
    for t1 in &p1 {
        let mut s2 = st.clone();
        let row = model
            .forward(&[t1.id], &mut s2, LogitRows::Last, pool)
            .unwrap();
        for t2 in sampler.distribution(&row.logits).to_vec() {
            *p.entry((t1.id, t2.id)).or_default() += t1.p as f64 * t2.p as f64;
        }
        let mut hc = head_cache.clone();
        let q = head
            .forward(
                &[t1.id],
                &h_last,
                prompt.len(),
                &mut hc,
                LogitRows::Last,
                pool,
            )
            .unwrap();
        for t2 in sampler.distribution(&q.logits).to_vec() {
            *b.entry((t1.id, t2.id)).or_default() += t1.p as f64 * t2.p as f64;
        }
    }
    (p, b)
}

/// Pearson chi-square of counts against expected probabilities, pooling cells with expectation < 5.
fn chi_square(counts: &HashMap<(u32, u32), usize>, expected: &Joint, n: usize) -> (f64, usize) {
    let mut stat = 0.0;
    let mut dof: usize = 0;
    let (mut pooled_obs, mut pooled_exp) = (0.0, 0.0);
    for (k, &pk) in expected {
        let e = pk * n as f64;
        let o = *counts.get(k).unwrap_or(&0) as f64;
        if e < 5.0 {
            pooled_obs += o;
            pooled_exp += e;
        } else {
            stat += (o - e) * (o - e) / e;
            dof += 1;
        }
    }
    // Draws outside the support count into the pool too.
    let outside: usize = counts
        .iter()
        .filter(|(k, _)| !expected.contains_key(k))
        .map(|(_, &c)| c)
        .sum();
    pooled_obs += outside as f64;
    if pooled_exp > 0.0 {
        stat += (pooled_obs - pooled_exp).powi(2) / pooled_exp.max(1.0);
        dof += 1;
    }
    (stat, dof.saturating_sub(1).max(1))
}

/// Chi-square critical value at significance ~1e-4 (Wilson–Hilferty).
fn critical(dof: usize) -> f64 {
    let k = dof as f64;
    let z = 3.72;
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

#[test]
fn mtp_sampling_preserves_the_target_distribution() {
    let l = common::bundled(1);
    let (model, head, pool) = (&l.model, &l.head, &l.pool);
    let prompt = l.tok.encode("def parse(self, text):\n", true);
    let (p, biased) = exact(model, head, &prompt, pool);
    let n = 1000;

    // The test has power: draws from the biased rule's distribution fail it.
    let mut rng = Xoshiro256StarStar::from_seed(99);
    let cells: Vec<(&(u32, u32), &f64)> = biased.iter().collect();
    let mut biased_counts = HashMap::new();
    for _ in 0..n {
        let u = rng.next_f64();
        let mut acc = 0.0;
        let mut pick = *cells[cells.len() - 1].0;
        for (k, &pk) in &cells {
            acc += pk;
            if u < acc {
                pick = **k;
                break;
            }
        }
        *biased_counts.entry(pick).or_insert(0usize) += 1;
    }
    let (stat, dof) = chi_square(&biased_counts, &p, n);
    assert!(
        stat > critical(dof),
        "the test cannot tell the biased rule apart (chi2 {stat:.1}, dof {dof})"
    );
    eprintln!(
        "biased rule: chi2 {stat:.1} on {dof} dof (critical {:.1}) — rejected as it must be",
        critical(dof)
    );

    for mode in [DraftSampling::Coupled, DraftSampling::Sample] {
        // Three tokens, so that the second one is drafted and goes through verification.
        let setup = Setup {
            spec: Some(SpecConfig {
                n_max: 2,
                draft_sampling: mode,
                ..SpecConfig::default()
            }),
            n_ctx: 64,
            kv: KvType::F32,
            ..Setup::plain()
        };
        let requests: Vec<(Vec<u32>, SamplerConfig, usize)> = (0..n as u64)
            .map(|seed| (prompt.clone(), config(seed * 7919 + 13), 3))
            .collect();
        let done = generate_many(&l, &setup, 4, &requests);
        let mut counts = HashMap::new();
        let mut accepted = 0;
        for c in &done {
            accepted += c.spec.draft_n_accepted;
            *counts.entry((c.tokens[0], c.tokens[1])).or_insert(0usize) += 1;
        }
        let (stat, dof) = chi_square(&counts, &p, n);
        eprintln!(
            "{mode:?}: chi2 {stat:.1} on {dof} dof (critical {:.1}), {accepted} drafts accepted",
            critical(dof)
        );
        assert!(stat < critical(dof), "{mode:?}: MTP sampling departs from the target distribution (chi2 {stat:.1}, dof {dof})");
        assert!(
            accepted > 0,
            "{mode:?}: no draft was ever accepted, so the verify path was not exercised"
        );
    }
}

/// Sampled drafts over the whole 248,320-token vocabulary (top_k 0, top_p 1, min_p 0: every
/// distribution drafting and acceptance compare holds every token) cost a step at most twice a
/// step at the default sampler settings (top_k 40). Both run in the same process, interleaved,
/// and the medians of the per-request step times are compared, so a burst of other work on a
/// busy machine hits both alike and one slow request does not decide.
#[test]
fn sampled_drafts_over_the_whole_vocabulary_stay_within_twice_a_default_step() {
    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    let l = common::load(
        &golden.join("q35-dense-qwenvocab/q35-dense-qwenvocab-F32-embQ8_0.gguf"),
        2,
    );
    assert_eq!(l.model.n_vocab, 248_320);
    let setup = Setup {
        spec: Some(SpecConfig {
            n_max: 3,
            draft_sampling: DraftSampling::Sample,
            ..SpecConfig::default()
        }),
        trace: true,
        ..Setup::plain()
    };
    let prompt = l.tok.encode("def fibonacci(n):\n", true);
    let whole_vocabulary = |seed| SamplerConfig {
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        ..config(seed)
    };
    let defaults = |seed| SamplerConfig {
        seed,
        ..SamplerConfig::default()
    };
    // Milliseconds per speculative step of one request.
    let step_ms = |sampler: SamplerConfig| {
        let c = common::generate(&l, &setup, &prompt, &sampler, 24);
        assert!(c.spec.steps > 0, "the request drafted: {:?}", c.spec);
        let rejected = c.spec.draft_n - c.spec.draft_n_accepted;
        (c.timings.predicted_ms / c.spec.trace.len() as f64, rejected)
    };
    let (mut wide, mut default, mut rejections) = (Vec::new(), Vec::new(), 0);
    for seed in 0..7 {
        let (ms, rejected) = step_ms(whole_vocabulary(seed));
        wide.push(ms);
        rejections += rejected;
        default.push(step_ms(defaults(seed)).0);
    }
    // The residual over the whole vocabulary is what used to cost minutes: it must be exercised.
    assert!(rejections > 0, "no draft was rejected");
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (wide, default) = (median(wide), median(default));
    eprintln!(
        "median step: {wide:.2} ms over the whole vocabulary, {default:.2} ms at the defaults ({:.2}x)",
        wide / default
    );
    assert!(
        wide <= 2.0 * default,
        "a step over the whole vocabulary took {wide:.2} ms, at the defaults {default:.2} ms"
    );
}
