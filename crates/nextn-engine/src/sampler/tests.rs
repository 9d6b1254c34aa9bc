//! Checks of the chain internals (the selection fast paths) against straightforward versions.

use super::chain::{ActivePenalties, Candidate, Candidates};
use super::penalties::{PenaltyHistory, PenaltyParams};
use super::rng::Xoshiro256StarStar;

/// Logits drawn from a coarse grid so that ties are common, with some NaN and ±∞ sprinkled in.
fn noisy_logits(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Xoshiro256StarStar::from_seed(seed);
    (0..n)
        .map(|_| {
            let r = rng.next_u64();
            match r % 997 {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                _ => ((r >> 16) % 400) as f32 / 20.0 - 10.0,
            }
        })
        .collect()
}

fn naive_top_k(logits: &[f32], k: usize, pen: Option<ActivePenalties<'_>>) -> Vec<Candidate> {
    let mut all: Vec<Candidate> = logits
        .iter()
        .enumerate()
        .map(|(i, &logit)| Candidate {
            logit,
            id: i as u32,
        })
        .collect();
    if let Some(p) = pen {
        for (id, count) in p.history.counts() {
            if let Some(c) = all.get_mut(id as usize) {
                c.logit = p.params.apply(c.logit, count);
            }
        }
    }
    all.retain(|c| !c.logit.is_nan());
    all.sort_by(|a, b| b.logit.partial_cmp(&a.logit).unwrap().then(a.id.cmp(&b.id)));
    all.truncate(k);
    all
}

#[test]
fn top_k_scan_matches_full_sort() {
    for (seed, n, k) in [(1, 5000, 1), (2, 5000, 10), (3, 20_000, 40), (4, 3000, 700)] {
        let logits = noisy_logits(n, seed);
        let mut c = Candidates::default();
        c.fill_top_k(&logits, k, None);
        assert!(c.is_sorted());
        assert_eq!(
            c.items(),
            naive_top_k(&logits, k, None).as_slice(),
            "seed {seed}"
        );
    }
}

#[test]
fn top_k_scan_with_penalties_matches_full_sort() {
    let n = 8000;
    let logits = noisy_logits(n, 11);
    // Window over the current best tokens (so the raw scan must look past them) plus a few
    // negative and out-of-vocabulary ids.
    let mut order: Vec<usize> = (0..n).filter(|&i| !logits[i].is_nan()).collect();
    order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap().then(a.cmp(&b)));
    let mut history = PenaltyHistory::new(64);
    for &i in order.iter().take(30) {
        history.record(i as u32);
        history.record(i as u32);
    }
    for &i in order.iter().rev().take(3) {
        history.record(i as u32);
    }
    history.record(n as u32 + 5);
    for params in [
        PenaltyParams {
            repeat: 1.3,
            frequency: 0.2,
            presence: 0.5,
        },
        PenaltyParams {
            repeat: 0.5,
            frequency: -1.0,
            presence: -2.0,
        },
    ] {
        let pen = ActivePenalties {
            history: &history,
            params,
        };
        for k in [1, 5, 40] {
            let mut c = Candidates::default();
            c.fill_top_k(&logits, k, Some(pen));
            assert_eq!(
                c.items(),
                naive_top_k(&logits, k, Some(pen)).as_slice(),
                "k {k}"
            );
        }
    }
}

#[test]
fn top_p_adaptive_prefix_matches_sorted_cut() {
    // A nearly flat row needs far more than the first 256-candidate prefix to reach p.
    let logits: Vec<f32> = noisy_logits(10_000, 21).iter().map(|l| l * 0.05).collect();
    for p in [0.1f32, 0.5, 0.9, 0.999] {
        let mut unsorted = Candidates::default();
        unsorted.fill_all(&logits, None);
        unsorted.top_p(p);

        let mut sorted = Candidates::default();
        sorted.fill_all(&logits, None);
        sorted.truncate_to_top(usize::MAX);
        sorted.top_p(p);

        assert!(unsorted.is_sorted());
        assert_eq!(unsorted.items(), sorted.items(), "p {p}");
        assert!(
            unsorted.items().len() > 256,
            "p {p} should exceed the first prefix"
        );
    }
}

#[test]
fn weighted_cut_finds_smallest_sufficient_prefix() {
    for seed in 0..20u64 {
        let logits: Vec<f32> = noisy_logits(3000, 500 + seed)
            .iter()
            .map(|l| l * 0.1)
            .collect();
        let mut c = Candidates::default();
        c.fill_all(&logits, None);
        let max = logits
            .iter()
            .copied()
            .filter(|l| !l.is_nan())
            .fold(f32::NEG_INFINITY, f32::max);
        let mut items = c.items().to_vec();
        let weights: Vec<f64> = {
            let mut sorted = items.clone();
            sorted.sort_by(|a, b| b.logit.partial_cmp(&a.logit).unwrap().then(a.id.cmp(&b.id)));
            items = sorted.clone();
            sorted
                .iter()
                .map(|c| f64::from(super::math::softmax_weight(c.logit, max, 1.0)))
                .collect()
        };
        let total: f64 = weights.iter().sum();
        let need = total * (0.05 + 0.045 * seed as f64);
        let mut cum = 0.0;
        let want = weights
            .iter()
            .position(|w| {
                cum += w;
                cum >= need
            })
            .map_or(items.len(), |i| i + 1);
        // Shuffle deterministically, then cut.
        let mut rng = Xoshiro256StarStar::from_seed(seed);
        for i in (1..items.len()).rev() {
            items.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let mut expect: Vec<u32> = {
            let mut s = items.clone();
            s.sort_by(|a, b| b.logit.partial_cmp(&a.logit).unwrap().then(a.id.cmp(&b.id)));
            s[..want].iter().map(|c| c.id).collect()
        };
        let m = super::chain::weighted_cut_for_tests(&mut items, max, need);
        assert_eq!(m, want, "seed {seed}");
        let mut got: Vec<u32> = items[..m].iter().map(|c| c.id).collect();
        got.sort_unstable();
        expect.sort_unstable();
        assert_eq!(got, expect, "seed {seed}");
    }
}

#[test]
fn draw_walks_cumulative_weights() {
    let mut c = Candidates::default();
    c.fill_all(&[0.0, (3.0f32).ln(), f32::NEG_INFINITY], None);
    c.weigh(1.0);
    // Weights 1 : 3 : 0 → boundaries at 0.25.
    assert_eq!(c.draw(0.0), Some(0));
    assert_eq!(c.draw(0.2499), Some(0));
    assert_eq!(c.draw(0.2501), Some(1));
    assert_eq!(c.draw(0.999_999), Some(1));
    let mut empty = Candidates::default();
    empty.fill_all(&[f32::NAN], None);
    empty.weigh(1.0);
    assert_eq!(empty.draw(0.5), None);
}
