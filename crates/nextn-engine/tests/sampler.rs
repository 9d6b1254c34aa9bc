//! Public behaviour of the token sampler: greedy decoding, each filter against a naive reference,
//! llama.cpp's penalty formula, seeded reproducibility and the statistics of the draw.

use nextn_engine::sampler::{
    argmax, top1_probability, Sampler, SamplerConfig, SamplerError, Xoshiro256StarStar,
};

fn cfg_no_filters(temperature: f32, seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed,
        ..SamplerConfig::default()
    }
}

/// Logits on a coarse grid (frequent ties) with occasional NaN and −∞.
fn random_logits(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Xoshiro256StarStar::from_seed(seed);
    (0..n)
        .map(|_| {
            let r = rng.next_u64();
            match r % 211 {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                _ => ((r >> 20) % 300) as f32 / 25.0 - 6.0,
            }
        })
        .collect()
}

/// The chain written as plainly as possible: penalise, fully sort, cut, renormalise.
fn reference_distribution(cfg: &SamplerConfig, window: &[u32], logits: &[f32]) -> Vec<(u32, f64)> {
    let mut l = logits.to_vec();
    let recent = &window[window.len().saturating_sub(cfg.repeat_last_n)..];
    for id in 0..l.len() as u32 {
        let count = recent.iter().filter(|&&t| t == id).count() as f32;
        if count > 0.0 && cfg.repeat_last_n > 0 {
            let x = l[id as usize];
            let x = if x > 0.0 {
                x / cfg.repeat_penalty
            } else {
                x * cfg.repeat_penalty
            };
            l[id as usize] = x - (count * cfg.frequency_penalty + cfg.presence_penalty);
        }
    }
    let mut c: Vec<(u32, f32)> = l
        .iter()
        .enumerate()
        .filter(|(_, x)| !x.is_nan())
        .map(|(i, &x)| (i as u32, x))
        .collect();
    c.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
    if cfg.top_k > 0 {
        c.truncate(cfg.top_k);
    }
    let softmax = |c: &[(u32, f32)], t: f64| -> Vec<f64> {
        let max = c[0].1;
        let w: Vec<f64> = c
            .iter()
            .map(|&(_, x)| {
                if x == max {
                    1.0
                } else {
                    ((x as f64 - max as f64) / t).exp()
                }
            })
            .collect();
        let s: f64 = w.iter().sum();
        w.iter().map(|x| x / s).collect()
    };
    if cfg.top_p < 1.0 {
        let p = softmax(&c, 1.0);
        let mut cum = 0.0;
        let mut keep = c.len();
        for (i, pi) in p.iter().enumerate() {
            cum += pi;
            if cum >= cfg.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        c.truncate(keep);
    }
    if cfg.min_p > 0.0 {
        let p = softmax(&c, 1.0);
        let cut = p[0] * cfg.min_p as f64;
        c = c
            .iter()
            .zip(&p)
            .filter(|(_, &pi)| pi >= cut)
            .map(|(x, _)| *x)
            .collect();
    }
    let p = softmax(&c, cfg.temperature as f64);
    let mut out: Vec<(u32, f64)> = c.iter().zip(p).map(|(x, p)| (x.0, p)).collect();
    out.sort_by_key(|x| x.0);
    out
}

fn assert_distribution_matches(cfg: &SamplerConfig, window: &[u32], logits: &[f32], what: &str) {
    let mut s = Sampler::new(cfg.clone()).unwrap();
    for &t in window {
        s.accept(t);
    }
    let mut got: Vec<(u32, f32)> = s.distribution(logits).iter().map(|t| (t.id, t.p)).collect();
    got.sort_by_key(|x| x.0);
    let want = reference_distribution(cfg, window, logits);
    let got_ids: Vec<u32> = got.iter().map(|x| x.0).collect();
    let want_ids: Vec<u32> = want.iter().map(|x| x.0).collect();
    assert_eq!(got_ids, want_ids, "{what}: surviving candidates");
    for (g, w) in got.iter().zip(&want) {
        assert!(
            (g.1 as f64 - w.1).abs() < 1e-6,
            "{what}: p({}) = {} want {}",
            g.0,
            g.1,
            w.1
        );
    }
}

#[test]
fn greedy_picks_lowest_id_on_ties_and_never_nan() {
    let mut s = Sampler::new(SamplerConfig::greedy()).unwrap();
    assert_eq!(s.sample(&[1.0, 4.0, 2.0, 4.0], 0), 1);
    assert_eq!(s.sample(&[f32::NAN, 0.5, f32::NAN, 0.5], 0), 1);
    assert_eq!(s.sample(&[-3.0, f32::NAN, -2.0], 0), 2);
    assert_eq!(s.sample(&[f32::NAN, f32::NAN], 0), 0);
    assert_eq!(s.sample(&[], 0), 0);
    assert_eq!(argmax(&[0.0, f32::NAN, 7.0, 7.0, f32::NAN]), 2);
    // Negative temperature is greedy as well, and ignores the filters entirely.
    let cfg = SamplerConfig {
        temperature: -1.0,
        top_k: 1,
        min_p: 0.9,
        ..SamplerConfig::default()
    };
    assert!(cfg.is_greedy());
    let mut s = Sampler::new(cfg).unwrap();
    let row = random_logits(248_320, 5);
    for _ in 0..3 {
        assert_eq!(s.sample(&row, 0), argmax(&row));
    }
    assert_eq!(s.distribution(&row)[0].id, argmax(&row));
}

#[test]
fn penalties_follow_llama_cpp_formula() {
    let logits = [2.0f32, -1.0, 0.5, 3.0];
    let cfg = SamplerConfig {
        repeat_penalty: 2.0,
        frequency_penalty: 0.5,
        presence_penalty: 1.0,
        ..cfg_no_filters(1.0, 9)
    };
    let mut s = Sampler::new(cfg.clone()).unwrap();
    for t in [0, 0, 1, 3] {
        s.accept(t);
    }
    // token 0 (×2): 2/2 − (2·0.5 + 1) = −1;  token 1: −1·2 − 1.5 = −3.5;  token 3: 3/2 − 1.5 = 0.
    let penalised = [-1.0f64, -3.5, 0.5, 0.0];
    let z: f64 = penalised.iter().map(|x| x.exp()).sum();
    let dist = s.distribution(&logits).to_vec();
    assert_eq!(
        dist.iter().map(|t| t.id).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    for t in &dist {
        let want = penalised[t.id as usize].exp() / z;
        assert!((t.p as f64 - want).abs() < 1e-6, "{t:?} want {want}");
    }

    let greedy = SamplerConfig {
        temperature: 0.0,
        ..cfg.clone()
    };
    let mut g = Sampler::new(greedy.clone()).unwrap();
    for t in [0, 0, 1, 3] {
        g.accept(t);
    }
    assert_eq!(g.sample(&logits, 0), 2, "0.5 is the best penalised logit");

    // A two-token window has forgotten the two 0s: token 0 keeps its 2.0 and wins.
    let mut w = Sampler::new(SamplerConfig {
        repeat_last_n: 2,
        ..greedy.clone()
    })
    .unwrap();
    for t in [0, 0, 1, 3] {
        w.accept(t);
    }
    assert_eq!(w.recent_tokens().collect::<Vec<_>>(), vec![1, 3]);
    assert_eq!(w.sample(&logits, 0), 0);

    // repeat_last_n = 0 disables every penalty.
    let mut off = Sampler::new(SamplerConfig {
        repeat_last_n: 0,
        ..greedy
    })
    .unwrap();
    for t in [3, 3, 3] {
        off.accept(t);
    }
    assert_eq!(off.sample(&logits, 0), 3);

    // A repetition penalty below 1 boosts repeated tokens: −1·0.25 = −0.25 beats −0.5.
    let mut boost = Sampler::new(SamplerConfig {
        repeat_penalty: 0.25,
        ..SamplerConfig::greedy()
    })
    .unwrap();
    boost.accept(0);
    assert_eq!(boost.sample(&[-1.0, -0.5], 0), 0);

    // reset() forgets the window.
    g.reset();
    assert_eq!(g.sample(&logits, 0), 3);
}

#[test]
fn each_filter_matches_reference() {
    let base = cfg_no_filters(1.0, 3);
    let cases: Vec<(&str, SamplerConfig)> = vec![
        ("no filters", base.clone()),
        (
            "top_k 1",
            SamplerConfig {
                top_k: 1,
                ..base.clone()
            },
        ),
        (
            "top_k 7",
            SamplerConfig {
                top_k: 7,
                ..base.clone()
            },
        ),
        (
            "top_k 40",
            SamplerConfig {
                top_k: 40,
                ..base.clone()
            },
        ),
        (
            "top_p 0",
            SamplerConfig {
                top_p: 0.0,
                ..base.clone()
            },
        ),
        (
            "top_p 0.5",
            SamplerConfig {
                top_p: 0.5,
                ..base.clone()
            },
        ),
        (
            "top_p 0.95",
            SamplerConfig {
                top_p: 0.95,
                ..base.clone()
            },
        ),
        (
            "min_p 0.05",
            SamplerConfig {
                min_p: 0.05,
                ..base.clone()
            },
        ),
        (
            "min_p 0.5",
            SamplerConfig {
                min_p: 0.5,
                ..base.clone()
            },
        ),
        (
            "min_p 1",
            SamplerConfig {
                min_p: 1.0,
                ..base.clone()
            },
        ),
        ("temperature 0.3", cfg_no_filters(0.3, 3)),
        ("temperature 2.5", cfg_no_filters(2.5, 3)),
        ("llama.cpp defaults", SamplerConfig::default()),
        (
            "everything",
            SamplerConfig {
                temperature: 0.7,
                top_k: 25,
                top_p: 0.8,
                min_p: 0.02,
                repeat_penalty: 1.3,
                frequency_penalty: 0.1,
                presence_penalty: 0.4,
                repeat_last_n: 16,
                seed: 3,
                logit_bias: Vec::new(),
            },
        ),
    ];
    for n in [60usize, 5000] {
        let window: Vec<u32> = (0..40u32).map(|i| (i * 37) % n as u32).collect();
        for row in 0..4 {
            let logits = random_logits(n, row + 100 * n as u64);
            for (what, cfg) in &cases {
                assert_distribution_matches(cfg, &[], &logits, &format!("{what}, n={n}"));
                let penalised = SamplerConfig {
                    repeat_penalty: 1.5,
                    presence_penalty: 0.3,
                    frequency_penalty: 0.2,
                    ..cfg.clone()
                };
                assert_distribution_matches(
                    &penalised,
                    &window,
                    &logits,
                    &format!("{what} + penalties, n={n}"),
                );
            }
        }
    }
}

#[test]
fn full_vocabulary_top_k_with_penalties_matches_reference() {
    let n = 248_320;
    let logits = random_logits(n, 77);
    // Penalise the current best tokens so the fast selection has to look past them.
    let mut order: Vec<u32> = (0..n as u32).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (logits[a as usize], logits[b as usize]);
        y.partial_cmp(&x)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(&b))
    });
    let window: Vec<u32> = order
        .iter()
        .filter(|&&i| !logits[i as usize].is_nan())
        .take(64)
        .copied()
        .collect();
    let cfg = SamplerConfig {
        repeat_penalty: 1.2,
        presence_penalty: 0.5,
        ..SamplerConfig::default()
    };
    assert_distribution_matches(&cfg, &window, &logits, "248k defaults + penalties");
}

#[test]
fn same_seed_same_tokens_different_seed_different_tokens() {
    let rows: Vec<Vec<f32>> = (0..200).map(|r| random_logits(500, r)).collect();
    let run = |seed: u64| -> Vec<u32> {
        let mut s = Sampler::new(SamplerConfig {
            seed,
            repeat_penalty: 1.1,
            ..SamplerConfig::default()
        })
        .unwrap();
        rows.iter()
            .enumerate()
            .map(|(i, r)| s.sample_and_accept(r, i as u64))
            .collect()
    };
    let a = run(1234);
    assert_eq!(a, run(1234));
    let b = run(1235);
    assert_ne!(a, b);
    assert!(a.iter().zip(&b).filter(|(x, y)| x != y).count() > 20);

    // reset() forgets the penalty window; a clone continues identically.
    let mut s = Sampler::new(SamplerConfig {
        seed: 1234,
        repeat_penalty: 1.1,
        ..SamplerConfig::default()
    })
    .unwrap();
    for (i, r) in rows[..50].iter().enumerate() {
        s.sample_and_accept(r, i as u64);
    }
    let mut twin = s.clone();
    let tail: Vec<u32> = (50..rows.len())
        .map(|i| s.sample_and_accept(&rows[i], i as u64))
        .collect();
    let twin_tail: Vec<u32> = rows[50..]
        .iter()
        .enumerate()
        .map(|(i, r)| twin.sample_and_accept(r, 50 + i as u64))
        .collect();
    assert_eq!(tail, twin_tail);
    assert_eq!(tail, a[50..].to_vec());
    s.reset();
    let again: Vec<u32> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| s.sample_and_accept(r, i as u64))
        .collect();
    assert_eq!(again, a);
}

/// Pins the seeded draws: these tokens come from an independent Python transcription of the
/// per-position uniform (`uniform_at`: splitmix64 at index i from a state hashed from the seed)
/// and the inverse-CDF draw over softmax(logits) in id order. If this changes, every user's
/// seeded output changes.
#[test]
fn seeded_stream_is_pinned() {
    let mut s = Sampler::new(cfg_no_filters(1.0, 2024)).unwrap();
    let got: Vec<u32> = (0..24u32)
        .map(|r| {
            let row: Vec<f32> = (0..16u32)
                .map(|i| ((i * 7 + r * 3) % 11) as f32 * 0.25 - 1.0)
                .collect();
            s.sample(&row, r as u64)
        })
        .collect();
    assert_eq!(got, PINNED_SEED_2024.to_vec());
}

/// The draw at output position i depends on (seed, i) alone: drawing the positions in another
/// order, skipping some, or repeating one gives the same token at each position. This is what
/// lets the speculative loop verify any number of rows per step and still emit plain decoding's
/// tokens.
#[test]
fn draw_at_a_position_does_not_depend_on_other_draws() {
    let rows: Vec<Vec<f32>> = (0..64).map(|r| random_logits(300, 100 + r)).collect();
    let mut s = Sampler::new(cfg_no_filters(0.9, 77)).unwrap();
    let in_order: Vec<u32> = (0..64).map(|i| s.sample(&rows[i], i as u64)).collect();
    let mut t = Sampler::new(cfg_no_filters(0.9, 77)).unwrap();
    for i in (0..64).rev() {
        assert_eq!(t.sample(&rows[i], i as u64), in_order[i], "position {i}");
        if i % 3 == 0 {
            assert_eq!(t.sample(&rows[i], i as u64), in_order[i], "repeated {i}");
        }
    }
}

const PINNED_SEED_2024: [u32; 24] = [
    5, 13, 3, 8, 15, 4, 13, 0, 6, 10, 3, 4, 10, 2, 8, 5, 4, 2, 10, 15, 0, 5, 12, 15,
];

#[test]
fn draws_follow_softmax() {
    let logits = [0.3f32, -1.2, 2.0, 0.0, 1.1, -0.4];
    for temperature in [1.0f32, 0.6] {
        let z: f64 = logits
            .iter()
            .map(|&l| (l as f64 / temperature as f64).exp())
            .sum();
        let want: Vec<f64> = logits
            .iter()
            .map(|&l| (l as f64 / temperature as f64).exp() / z)
            .collect();
        let mut s = Sampler::new(cfg_no_filters(temperature, 99)).unwrap();
        let draws = 200_000usize;
        let mut counts = [0usize; 6];
        for i in 0..draws {
            counts[s.sample(&logits, i as u64) as usize] += 1;
        }
        let mut chi2 = 0.0;
        for (i, &c) in counts.iter().enumerate() {
            let expected = want[i] * draws as f64;
            chi2 += (c as f64 - expected).powi(2) / expected;
            let freq = c as f64 / draws as f64;
            // Binomial σ ≤ 0.0012 here; 0.006 is ~5σ.
            assert!(
                (freq - want[i]).abs() < 0.006,
                "T={temperature} token {i}: {freq} vs {}",
                want[i]
            );
        }
        // 5 degrees of freedom: P(χ² > 30) ≈ 1.5e-5.
        assert!(chi2 < 30.0, "T={temperature} chi2 = {chi2}");
    }
}

#[test]
fn filtered_draws_stay_inside_the_distribution() {
    let logits = random_logits(3000, 8);
    let cfg = SamplerConfig {
        seed: 5,
        ..SamplerConfig::default()
    };
    let mut s = Sampler::new(cfg).unwrap();
    let allowed: Vec<u32> = s.distribution(&logits).iter().map(|t| t.id).collect();
    assert!(!allowed.is_empty() && allowed.len() <= 40);
    for i in 0..2000 {
        let t = s.sample(&logits, i);
        assert!(allowed.contains(&t), "{t} outside the filtered set");
    }
}

#[test]
fn degenerate_rows() {
    let mut s = Sampler::new(cfg_no_filters(1.0, 1)).unwrap();
    assert_eq!(s.sample(&[], 0), 0);
    assert_eq!(s.sample(&[f32::NAN; 4], 1), 0);
    assert!(s.distribution(&[f32::NAN; 4]).is_empty());
    // Only the +∞ logits can be drawn.
    for i in 0..100 {
        let t = s.sample(&[0.0, f32::INFINITY, 5.0, f32::INFINITY], i);
        assert!(t == 1 || t == 3);
    }
    // All −∞: no information, so every token is equally likely (and NaN still excluded).
    let d = s
        .distribution(&[f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY])
        .to_vec();
    assert_eq!(d.len(), 2);
    assert!(d.iter().all(|t| (t.p - 0.5).abs() < 1e-7 && t.id != 1));
}

#[test]
fn top_probability() {
    let mut s = Sampler::new(SamplerConfig::default()).unwrap();
    let three = 3.0f32.ln();
    let (id, p) = top1_probability(&[0.0, three, f32::NAN]);
    assert_eq!(id, 1);
    assert!((p - 0.75).abs() < 1e-6);
    assert_eq!(top1_probability(&[]), (0, 0.0));
    assert_eq!(top1_probability(&[f32::NAN]), (0, 0.0));
    let (id, p) = top1_probability(&[2.0, 2.0]);
    assert_eq!((id, p), (0, 0.5));

    // Restricted to the best k logits, as llama.cpp's drafter renormalises over its top 10.
    let mut row = vec![-1.0f32; 1000];
    row[10] = three;
    row[500] = 0.0;
    let (id, p) = s.top1_probability_among_top_k(&row, 2);
    assert_eq!(id, 10);
    assert!((p - 0.75).abs() < 1e-6);
    let (_, p_full) = top1_probability(&row);
    let want = 3.0 / (3.0 + 1.0 + 998.0 * (-1.0f64).exp());
    assert!((p_full as f64 - want).abs() < 1e-6);
    assert_eq!(s.top1_probability_among_top_k(&row, 0).1, p_full);
}

#[test]
fn validate_names_the_field() {
    let bad: Vec<(&str, SamplerConfig)> = vec![
        (
            "temperature",
            SamplerConfig {
                temperature: f32::NAN,
                ..Default::default()
            },
        ),
        (
            "temperature",
            SamplerConfig {
                temperature: f32::INFINITY,
                ..Default::default()
            },
        ),
        (
            "top_p",
            SamplerConfig {
                top_p: 1.5,
                ..Default::default()
            },
        ),
        (
            "top_p",
            SamplerConfig {
                top_p: -0.1,
                ..Default::default()
            },
        ),
        (
            "top_p",
            SamplerConfig {
                top_p: f32::NAN,
                ..Default::default()
            },
        ),
        (
            "min_p",
            SamplerConfig {
                min_p: -0.5,
                ..Default::default()
            },
        ),
        (
            "min_p",
            SamplerConfig {
                min_p: f32::NAN,
                ..Default::default()
            },
        ),
        (
            "repeat_penalty",
            SamplerConfig {
                repeat_penalty: 0.0,
                ..Default::default()
            },
        ),
        (
            "repeat_penalty",
            SamplerConfig {
                repeat_penalty: -1.0,
                ..Default::default()
            },
        ),
        (
            "repeat_penalty",
            SamplerConfig {
                repeat_penalty: f32::NAN,
                ..Default::default()
            },
        ),
        (
            "repeat_last_n",
            SamplerConfig {
                repeat_last_n: usize::MAX,
                ..Default::default()
            },
        ),
        (
            "presence_penalty",
            SamplerConfig {
                presence_penalty: f32::NAN,
                ..Default::default()
            },
        ),
        (
            "frequency_penalty",
            SamplerConfig {
                frequency_penalty: f32::INFINITY,
                ..Default::default()
            },
        ),
    ];
    for (field, cfg) in bad {
        let err = Sampler::new(cfg).expect_err(field);
        let SamplerError::InvalidParameter { field: f, .. } = &err;
        assert_eq!(*f, field);
        assert!(err.to_string().contains(field), "{err}");
    }
    SamplerConfig::default().validate().unwrap();
    SamplerConfig::greedy().validate().unwrap();
    assert!(SamplerConfig::greedy().is_greedy());
    assert!(!SamplerConfig::default().is_greedy());
}
