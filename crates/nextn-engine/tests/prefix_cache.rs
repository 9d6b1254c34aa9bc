//! The prefix cache through the generation loop: a request resumed from a cached prefix gets
//! exactly the tokens and log probabilities of the same request on a cold engine, with and
//! without drafting, greedy and seeded, on the bundled model and the dense and MoE fixtures;
//! resumption happens at snapshots only (a prompt that diverges inside a cached answer resumes at
//! the prompt's cache point); `cache_prompt: false` bypasses the cache; a tight budget evicts.

mod common;

use common::{run_jobs, scheduler, Job, Loaded, Setup};
use nextn_engine::sampler::SamplerConfig;
use nextn_engine::scheduler::{Completion, PrefixCacheConfig};

fn models() -> Vec<Loaded> {
    common::bundled_and_fixtures(2)
}

fn tokens(l: &Loaded, n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| {
            (i.wrapping_mul(2654435761).wrapping_add(seed * 7919) >> 9) % l.model.n_vocab as u32
        })
        .collect()
}

fn job(prompt: &[u32], sampler: &SamplerConfig, n: usize, cache_points: Vec<usize>) -> Job {
    Job {
        cache_points,
        prompt: prompt.to_vec(),
        sampler: sampler.clone(),
        n,
        grammar: None,
        logprobs: Some(3),
    }
}

fn cached(setup: &Setup, budget_bytes: usize, snapshot_every: usize) -> Setup {
    Setup {
        prefix_cache: Some(PrefixCacheConfig {
            budget_bytes,
            snapshot_every,
        }),
        ..setup.clone()
    }
}

/// The second turn of a conversation on a warm engine equals it on a cold one.
#[test]
fn a_resumed_request_equals_a_cold_one() {
    for l in models() {
        for (label, base) in [("plain", Setup::plain()), ("mtp", Setup::drafting(3))] {
            for sampler in [
                SamplerConfig::greedy(),
                SamplerConfig {
                    temperature: 0.9,
                    seed: 21,
                    ..SamplerConfig::default()
                },
            ] {
                let ctx = format!("{label}, seed {}", sampler.seed);
                let system = tokens(&l, 60, 1);
                let user = tokens(&l, 12, 2);
                let turn1: Vec<u32> = [system.clone(), user].concat();
                let warm_setup = cached(&base, 1 << 30, 32);
                let mut warm = scheduler(&l, &warm_setup, 2, 4);
                // Turn 1 keeps a snapshot before its last 4 tokens (the "assistant header").
                let point = turn1.len() - 4;
                let (first, _) = run_jobs(
                    &mut warm,
                    &warm_setup,
                    vec![job(&turn1, &sampler, 16, vec![point])],
                )
                .remove(0);
                assert_eq!(first.timings.cache_n, 0, "{ctx}");

                // Turn 2 continues the answer: resumes at the answer's committed end.
                let turn2: Vec<u32> =
                    [turn1.clone(), first.tokens.clone(), tokens(&l, 10, 3)].concat();
                // Turn 3 re-renders the answer differently: resumes at turn 1's cache point.
                let turn3: Vec<u32> = [turn1[..point].to_vec(), tokens(&l, 20, 4)].concat();
                for (turn, want_cache) in [
                    (&turn2, turn1.len() + first.tokens.len() - 1),
                    (&turn3, point),
                ] {
                    let (w, wl) = run_jobs(
                        &mut warm,
                        &warm_setup,
                        vec![job(turn, &sampler, 16, vec![])],
                    )
                    .remove(0);
                    let mut cold_s = scheduler(&l, &base, 2, 4);
                    let (c, cl) =
                        run_jobs(&mut cold_s, &base, vec![job(turn, &sampler, 16, vec![])])
                            .remove(0);
                    assert_eq!(w.timings.cache_n, want_cache, "{ctx}");
                    assert_eq!(w.timings.prompt_n, turn.len() - want_cache, "{ctx}");
                    assert_eq!(c.timings.cache_n, 0);
                    assert_eq!(w.tokens, c.tokens, "{ctx}");
                    assert_eq!(wl, cl, "{ctx}: log probabilities");
                }
                let m = warm.metrics();
                assert!(m.cache_snapshots > 0 && m.cache_bytes > 0, "{m:?}");
                assert!(m.prompt_tokens_cached_total > 0);
            }
        }
    }
}

/// `cache_prompt: false` neither reads nor feeds the cache; a budget too small for a snapshot
/// keeps nothing.
#[test]
fn bypass_and_budget() {
    let l = common::bundled(2);
    let prompt = tokens(&l, 40, 5);
    let base = Setup::drafting(2);
    let setup = cached(&base, 1 << 30, 0);
    let mut s = scheduler(&l, &setup, 1, 4);
    let greedy = SamplerConfig::greedy();
    let once =
        |s: &mut nextn_engine::scheduler::Scheduler<'_>, p: &[u32], cache: bool| -> Completion {
            let mut j = job(p, &greedy, 8, vec![]);
            j.logprobs = None;
            let mut r = common::run_jobs_with(s, &setup, vec![j], cache);
            r.remove(0).0
        };
    once(&mut s, &prompt, false);
    assert_eq!(s.metrics().cache_snapshots, 0);
    let a = once(&mut s, &prompt, true);
    assert_eq!(a.timings.cache_n, 0);
    assert_eq!(s.metrics().cache_snapshots, 1);
    // The answer's end is kept: a prompt that continues it resumes there, unless it bypasses.
    let longer: Vec<u32> = [prompt.clone(), a.tokens.clone(), tokens(&l, 30, 6)].concat();
    assert_eq!(once(&mut s, &longer, false).timings.cache_n, 0);
    assert_eq!(
        once(&mut s, &longer, true).timings.cache_n,
        prompt.len() + 7
    );

    let tiny = cached(&base, 1000, 0);
    let mut t = scheduler(&l, &tiny, 1, 4);
    run_jobs(&mut t, &tiny, vec![job(&prompt, &greedy, 8, vec![20])]);
    let m = t.metrics();
    assert_eq!((m.cache_snapshots, m.cache_bytes), (0, 0));
    assert!(m.cache_evictions_total > 0);
}
