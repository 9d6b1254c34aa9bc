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

use super::{Sampler, SamplerConfig, TokenLogprob, TokenMask};

/// A mask allowing the ids where `allow(id)` holds, over `len` tokens.
fn mask_of(len: usize, allow: impl Fn(usize) -> bool) -> TokenMask {
    let mut words = vec![0u32; len.div_ceil(32)];
    for i in (0..len).filter(|&i| allow(i)) {
        words[i / 32] |= 1 << (i % 32);
    }
    TokenMask::from_words(words, len)
}

/// Softmax of a row at temperature 1, in f64.
fn naive_softmax(row: &[f32]) -> Vec<f64> {
    let max = row
        .iter()
        .copied()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let w: Vec<f64> = row
        .iter()
        .map(|&l| {
            if l.is_nan() {
                0.0
            } else {
                (l as f64 - max).exp()
            }
        })
        .collect();
    let total: f64 = w.iter().sum();
    w.into_iter().map(|x| x / total).collect()
}

fn unfiltered(seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed,
        ..SamplerConfig::default()
    }
}

#[test]
fn token_mask_queries_and_application() {
    let m = mask_of(70, |i| i % 7 == 3 || i == 69);
    assert_eq!(m.count(), 10 + 1);
    assert_eq!(m.first(), Some(3));
    assert!(m.allows(3) && m.allows(66) && m.allows(69));
    assert!(!m.allows(4) && !m.allows(70) && !m.allows(u32::MAX));
    // A row longer than the mask: the tokens past it are not allowed.
    let mut row: Vec<f32> = (0..80).map(|i| i as f32).collect();
    m.apply(&mut row);
    for (i, l) in row.iter().enumerate() {
        assert_eq!(*l > f32::NEG_INFINITY, m.allows(i as u32), "token {i}");
    }
    assert_eq!(mask_of(40, |_| false).first(), None);
}

/// `TokenMask::all` allows exactly the row's tokens and sampling under it is sampling without a
/// mask; `TokenMask::only` allows one token, which is drawn whatever its logit.
#[test]
fn all_and_single_token_masks() {
    for len in [1, 31, 32, 33, 70] {
        let all = TokenMask::all(len);
        assert!(all.allows_all());
        assert_eq!(all.count(), len, "len {len}");
        assert!(!all.allows(len as u32));
        let one = TokenMask::only(len as u32 - 1, len);
        assert_eq!((one.count(), one.first()), (1, Some(len as u32 - 1)));
        assert!(!one.allows_all());
    }
    let logits = noisy_logits(300, 9);
    for seed in 0..20 {
        let mut free = Sampler::new(unfiltered(seed)).unwrap();
        let mut masked = Sampler::new(unfiltered(seed)).unwrap();
        let all = TokenMask::all(logits.len());
        for i in 0..5 {
            assert_eq!(
                free.sample(&logits, i),
                masked.sample_masked(&logits, Some(&all), i)
            );
        }
        let mut row = logits.clone();
        row[7] = f32::NEG_INFINITY;
        let only = TokenMask::only(7, row.len());
        assert_eq!(masked.sample_masked(&row, Some(&only), 9), 7);
    }
}

/// Draws under a mask only ever give allowed tokens, and their distribution is the softmax of
/// the allowed logits alone.
#[test]
fn masked_draws_follow_the_renormalised_distribution() {
    let logits: Vec<f32> = noisy_logits(300, 5)
        .into_iter()
        .map(|l| if l.is_nan() { 0.0 } else { l / 3.0 })
        .collect();
    let mask = mask_of(300, |i| i % 3 != 0 && logits[i] > f32::NEG_INFINITY);
    let mut masked = logits.clone();
    mask.apply(&mut masked);
    let want = naive_softmax(&masked);
    let mut s = Sampler::new(unfiltered(17)).unwrap();
    let dist = s.distribution_masked(&logits, Some(&mask)).to_vec();
    let total: f64 = dist.iter().map(|t| t.p as f64).sum();
    assert!((total - 1.0).abs() < 1e-4, "{total}");
    for t in &dist {
        assert!(mask.allows(t.id));
        assert!((t.p as f64 - want[t.id as usize]).abs() < 1e-5, "{t:?}");
    }
    let mut counts = vec![0u32; 300];
    let n = 60_000;
    for i in 0..n {
        let t = s.sample_masked(&logits, Some(&mask), i);
        assert!(mask.allows(t), "draw {i} gave {t}");
        counts[t as usize] += 1;
    }
    for (id, &c) in counts.iter().enumerate() {
        let p = want[id];
        let sd = (n as f64 * p * (1.0 - p)).sqrt();
        assert!(
            (c as f64 - n as f64 * p).abs() <= 5.0 * sd + 2.0,
            "token {id}: {c} vs p {p}"
        );
    }
    // Greedy takes the best allowed token; an allowed set with only −∞ logits still gives one.
    let mut g = Sampler::new(SamplerConfig::greedy()).unwrap();
    let best = (0..300u32)
        .filter(|&i| mask.allows(i))
        .max_by(|&a, &b| {
            logits[a as usize]
                .total_cmp(&logits[b as usize])
                .then(b.cmp(&a))
        })
        .unwrap();
    assert_eq!(g.sample_masked(&logits, Some(&mask), 0), best);
    let mut dead = logits.clone();
    dead[7] = f32::NEG_INFINITY;
    dead[8] = f32::NEG_INFINITY;
    let only = mask_of(300, |i| i == 7 || i == 8);
    assert_eq!(g.sample_masked(&dead, Some(&only), 0), 7);
    assert_eq!(s.sample_masked(&dead, Some(&only), 1), 7);
}

/// The bias is added to the raw logits before everything else; −∞ bans a token.
#[test]
fn logit_bias_shifts_and_bans() {
    let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
    let top = super::argmax(&logits);
    let bias = vec![(top, f32::NEG_INFINITY), (11, 2.5), (12, -1.0)];
    let mut biased = logits.clone();
    biased[top as usize] = f32::NEG_INFINITY;
    biased[11] += 2.5;
    biased[12] -= 1.0;
    let cfg = SamplerConfig {
        logit_bias: bias.clone(),
        ..unfiltered(3)
    };
    let mut s = Sampler::new(cfg).unwrap();
    let want = naive_softmax(&biased);
    for t in s.distribution(&logits).to_vec() {
        assert!((t.p as f64 - want[t.id as usize]).abs() < 1e-5, "{t:?}");
    }
    for i in 0..5000 {
        assert_ne!(s.sample(&logits, i), top);
    }
    let mut g = Sampler::new(SamplerConfig {
        logit_bias: bias,
        ..SamplerConfig::greedy()
    })
    .unwrap();
    assert_eq!(g.sample(&logits, 0), super::argmax(&biased));
    assert_eq!(g.top_token(&logits, None), Some(super::argmax(&biased)));
}

/// Log probabilities against a full sort in f64.
#[test]
fn token_logprob_matches_a_full_sort() {
    for seed in 0..20 {
        let row: Vec<f32> = noisy_logits(1000, seed)
            .into_iter()
            .map(|l| if l.is_nan() { -3.0 } else { l })
            .collect();
        let p = naive_softmax(&row);
        let mut order: Vec<u32> = (0..1000).collect();
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        for top in [0, 1, 5, 20] {
            let id = (seed * 37 % 1000) as u32;
            let lp = TokenLogprob::of(&row, id, top);
            assert_eq!(lp.id, id);
            let want = p[id as usize].ln();
            assert!(
                (lp.logprob as f64 - want).abs() < 1e-4
                    || (want.is_infinite() && lp.logprob.is_infinite()),
                "{} vs {want}",
                lp.logprob
            );
            let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
            assert_eq!(ids, order[..top]);
            for &(t, l) in &lp.top {
                assert!((l as f64 - p[t as usize].ln()).abs() < 1e-4);
            }
        }
    }
}

/// The listed chain's draw, as `sample_masked` makes it when some filter is on.
fn listed_sample(s: &mut Sampler, row: &[f32], mask: Option<&TokenMask>, index: u64) -> u32 {
    let shaped = s.shape(row, mask);
    let r = shaped.as_deref().unwrap_or(row);
    let u = s.uniform(super::Draw::Token, index);
    s.run_chain(r);
    let t = s.candidates.draw(u).unwrap_or(0);
    s.unshape(shaped);
    super::allowed_or_first(t, mask)
}

/// With top-k, top-p and min-p off, the whole-row forms (a view read from the row, a
/// distribution kept by id, the sampling walk) give the listed chain's probabilities and draws
/// to the bit: with temperatures, penalties, logit bias and masks, and through the listed chain
/// itself where a NaN or an all −∞ row sends them there.
#[test]
fn whole_row_forms_match_the_listed_chain_to_the_bit() {
    use super::{DistRef, Distribution};
    let n = 5000;
    for seed in 0..6u64 {
        let mut row: Vec<f32> = noisy_logits(n, seed)
            .into_iter()
            .map(|l| if l.is_nan() { -3.0 } else { l })
            .collect();
        if seed == 5 {
            row[17] = f32::NAN;
        }
        let cfg = SamplerConfig {
            temperature: [0.7, 1.0, 1.3][seed as usize % 3],
            repeat_penalty: if seed % 2 == 0 { 1.3 } else { 1.0 },
            frequency_penalty: if seed == 2 { 0.5 } else { 0.0 },
            logit_bias: if seed >= 3 {
                vec![(11, 4.0), (12, f32::NEG_INFINITY)]
            } else {
                Vec::new()
            },
            ..unfiltered(seed)
        };
        let mut s = Sampler::new(cfg).unwrap();
        for t in [3u32, 11, 11, 400, 4999] {
            s.accept(t);
        }
        let some = mask_of(n, |i| i % 3 != 1);
        let none = mask_of(n, |_| false);
        for mask in [None, Some(&some), Some(&none)] {
            let listed = s.distribution_masked(&row, mask).to_vec();
            let mut p = vec![None; n];
            for t in listed.iter().rev() {
                p[t.id as usize] = Some(t.p);
            }
            let mut kept = Distribution::default();
            s.distribution_into(&row, mask, &mut kept);
            let whole_row = seed != 5 && !std::ptr::eq(mask.unwrap_or(&some), &none);
            assert_eq!(matches!(kept.view(), DistRef::ById(_)), whole_row);
            for id in 0..n as u32 {
                let want = p[id as usize].map_or(0.0, f64::from);
                assert_eq!(
                    kept.prob(id).to_bits(),
                    want.to_bits(),
                    "seed {seed} id {id}"
                );
            }
            for u in [0.0, 0.1, 0.5, 0.77, 0.999_99] {
                let want = DistRef::Listed(&listed).draw(u);
                assert_eq!(kept.draw(u), want, "seed {seed} u {u}");
            }
            // A draft distribution from a neighbouring row, for the residual.
            let other: Vec<f32> = row.iter().rev().copied().collect();
            let mut q = Distribution::default();
            s.distribution_into(&other, mask, &mut q);
            let view = s.distribution_view(&row, mask);
            assert_eq!(matches!(view, DistRef::WholeRow(_)), whole_row);
            let residual: Vec<super::TokenProb> = listed
                .iter()
                .map(|t| super::TokenProb {
                    id: t.id,
                    p: (f64::from(t.p) - q.prob(t.id)).max(0.0) as f32,
                })
                .filter(|t| t.p > 0.0)
                .collect();
            for u in [0.0, 0.3, 0.61, 0.999_99] {
                let want = DistRef::Listed(&residual).draw(u);
                let got = super::draw_residual_whole_row(view, q.view(), u);
                assert_eq!(got.is_some(), whole_row);
                if let Some(got) = got {
                    assert!(want.is_some());
                    assert_eq!(got, want, "seed {seed} u {u}");
                }
            }
            for id in 0..n as u32 {
                let want = p[id as usize].map_or(0.0, f64::from);
                assert_eq!(
                    view.prob(id).to_bits(),
                    want.to_bits(),
                    "seed {seed} id {id}"
                );
            }
            for index in 0..20 {
                let mut plain = s.clone();
                let want = listed_sample(&mut plain, &row, mask, index);
                assert_eq!(s.sample_masked(&row, mask, index), want, "seed {seed}");
            }
        }
    }
}
