//! Numeric helpers for the sampler: a platform-independent exponential and NaN-safe argmax.

/// Round-to-nearest-even shifter: adding then subtracting 1.5·2^23 rounds an f32 of magnitude
/// below 2^22 to an integer using only IEEE addition (no libm, no mode-dependent intrinsics).
const ROUND_SHIFTER: f32 = 12_582_912.0;
/// ln 2 split into a high part with trailing zero bits (so k·LN2_HI is exact for |k| < 2^8) and
/// the remainder (Cody–Waite reduction).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Below this e^x is under f32's smallest normal; such weights are treated as exactly 0.
const EXP_FLOOR: f32 = -87.0;

/// e^x for x ≤ 0 in f32, computed with basic IEEE arithmetic only.
///
/// `f32::exp` calls the platform's libm, whose last-bit results differ between systems; the
/// probabilities that decide which token a seed draws must be identical everywhere, so the sampler
/// uses this instead. Relative error is about 1e−7 (a couple of ulp). Inputs below −87 (−∞
/// included) return exactly 0: the true value is < 2e−38 and irrelevant next to the weight 1 of
/// the maximum logit. Positive inputs are not used by the sampler and saturate at x = 0.
///
/// Branch-free (selects only), so loops over it compile to vector code.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    let xc = x.clamp(EXP_FLOOR, 0.0);
    let shifted = xc * std::f32::consts::LOG2_E + ROUND_SHIFTER;
    let k = shifted - ROUND_SHIFTER;
    let r = (xc - k * LN2_HI) - k * LN2_LO;
    // Taylor series of e^r on |r| ≤ 0.35: the degree-7 remainder is below 1e-8 relative.
    let mut p = 1.0 / 5_040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    // The shifter's ulp is 1, so the low bits of `shifted` hold k as an integer offset from the
    // shifter's own bits: 2^k (k ∈ [−126, 0], a normal f32) is assembled from them with integer
    // operations, avoiding a float→int conversion that would not vectorise.
    let k_bits = shifted.to_bits().wrapping_sub(ROUND_SHIFTER.to_bits());
    let scale = f32::from_bits(k_bits.wrapping_add(127) << 23);
    let v = p * scale;
    if x < EXP_FLOOR {
        0.0
    } else {
        v
    }
}

/// Unnormalised softmax weight of `logit` relative to the maximum `max` of its set:
/// `exp((logit − max) / temperature)`, in [0, 1].
///
/// A logit equal to the maximum always weighs exactly 1, which also gives sane answers when the
/// maximum is infinite: with a +∞ maximum only the +∞ logits carry weight; with a −∞ maximum every
/// member is −∞ and they share the mass equally. A NaN logit weighs 0.
#[inline(always)]
pub fn softmax_weight(logit: f32, max: f32, temperature: f32) -> f32 {
    let w = exp_nonpositive((logit - max) / temperature);
    let w = if logit == max { 1.0 } else { w };
    if logit.is_nan() {
        0.0
    } else {
        w
    }
}

/// Defines `fn $name` that runs `$body` compiled for AVX-512 (else AVX2) where the CPU has
/// it, for the passes over a whole vocabulary row; what the body calls must be
/// `#[inline(always)]` to be compiled that way too. The results are the same bits as without:
/// Rust neither fuses nor reorders floating-point operations, so wider vectors only compute the
/// same lanes at once.
macro_rules! wide_fn {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn body($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx512dq,avx512bw")]
                fn avx512($($arg: $ty),*) -> $ret {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) -> $ret {
                    body($($arg),*)
                }
                if $crate::sampler::math::has_avx512() {
                    // SAFETY: the CPU has every feature `avx512` is compiled for.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2, which `avx2` is compiled for.
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use wide_fn;

#[cfg(target_arch = "x86_64")]
#[inline]
pub fn has_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512bw")
}

const SUM_LANES: usize = 8;

#[inline(always)]
fn combine_lanes(acc: [f64; SUM_LANES]) -> f64 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// Sum of `values` in a fixed order of eight interleaved partial sums: the order is part of the
/// reproducibility contract (it is the same everywhere), and independent accumulators let the
/// loop vectorise where a single running sum could not.
pub fn lane_sum(values: &[f64]) -> f64 {
    let mut acc = [0.0f64; SUM_LANES];
    let chunks = values.chunks_exact(SUM_LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for j in 0..SUM_LANES {
            acc[j] += chunk[j];
        }
    }
    for (j, &v) in tail.iter().enumerate() {
        acc[j] += v;
    }
    combine_lanes(acc)
}

/// Σ softmax_weight(l, max, temperature) over the non-NaN `logits`, summed like [`lane_sum`].
#[inline(always)]
pub fn softmax_total(logits: &[f32], max: f32, temperature: f32) -> f64 {
    let weight = |l: f32| f64::from(softmax_weight(l, max, temperature));
    let mut acc = [0.0f64; SUM_LANES];
    let chunks = logits.chunks_exact(SUM_LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for j in 0..SUM_LANES {
            acc[j] += weight(chunk[j]);
        }
    }
    for (j, &l) in tail.iter().enumerate() {
        acc[j] += weight(l);
    }
    combine_lanes(acc)
}

/// [`softmax_total`] that also writes each weight to `weights` (as wide as `logits`; as f32, which is what the weight
/// is before the sum widens it, so the total is the same to the bit).
pub fn softmax_weights_total(
    logits: &[f32],
    max: f32,
    temperature: f32,
    weights: &mut [f32],
) -> f64 {
    for (w, &l) in weights.iter_mut().zip(logits) {
        *w = softmax_weight(l, max, temperature);
    }
    let mut acc = [0.0f64; SUM_LANES];
    let chunks = weights.chunks_exact(SUM_LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for j in 0..SUM_LANES {
            acc[j] += f64::from(chunk[j]);
        }
    }
    for (j, &w) in tail.iter().enumerate() {
        acc[j] += f64::from(w);
    }
    combine_lanes(acc)
}

/// [`nan_ignoring_max`] of `values`, and whether any of them is NaN, in one pass.
#[inline(always)]
pub fn max_and_any_nan(values: &[f32]) -> (f32, bool) {
    const BLOCK: usize = 1024;
    let mut max = f32::NEG_INFINITY;
    let mut any_nan = false;
    for block in values.chunks(BLOCK) {
        let m = nan_ignoring_max(block);
        if m > max {
            max = m;
        }
        // NaN is the only value unequal to itself; the fold has no early exit, so it vectorises.
        any_nan |= block.iter().fold(false, |seen, v| seen | v.is_nan());
    }
    (max, any_nan)
}

/// Largest non-NaN value of `values`, −∞ if there is none. Independent lane maxima let the loop
/// vectorise, and the lanes are folded as a tree rather than a serial chain.
#[inline(always)]
pub fn nan_ignoring_max(values: &[f32]) -> f32 {
    const LANES: usize = 16;
    // NaN compares false and leaves the running value unchanged.
    #[inline(always)]
    fn keep_larger(acc: f32, v: f32) -> f32 {
        if v > acc {
            v
        } else {
            acc
        }
    }
    let mut lane_max = [f32::NEG_INFINITY; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for j in 0..LANES {
            lane_max[j] = keep_larger(lane_max[j], chunk[j]);
        }
    }
    for (j, &v) in tail.iter().enumerate() {
        lane_max[j] = keep_larger(lane_max[j], v);
    }
    let mut width = LANES / 2;
    while width > 0 {
        for j in 0..width {
            lane_max[j] = keep_larger(lane_max[j], lane_max[j + width]);
        }
        width /= 2;
    }
    lane_max[0]
}

/// Index of the largest logit: the LOWEST index among equal maxima, NaN never wins (−0.0 and +0.0
/// compare equal). Returns 0 when `logits` is empty or entirely NaN.
///
/// One pass over memory: each L1-sized block's maximum is found with vector code, and only a
/// block whose maximum beats everything before it is rescanned (from L1) for its first
/// occurrence — a handful of blocks for real logit rows. Strict comparison between blocks keeps
/// the earliest block on ties.
pub fn argmax(logits: &[f32]) -> u32 {
    const BLOCK: usize = 1024;
    let mut best = f32::NEG_INFINITY;
    let mut best_idx = None;
    for (b, block) in logits.chunks(BLOCK).enumerate() {
        let m = nan_ignoring_max(block);
        if m > best {
            let pos = block.iter().position(|&v| v == m).unwrap_or(0);
            best = m;
            best_idx = Some(b * BLOCK + pos);
        }
    }
    // No value above −∞: the first non-NaN entry (a −∞) if any.
    let idx = best_idx.or_else(|| logits.iter().position(|l| !l.is_nan()));
    idx.unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_libm_closely() {
        let mut x = -90.0f32;
        while x <= 0.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_nonpositive(x));
            if x < EXP_FLOOR {
                assert_eq!(got, 0.0);
            } else {
                let rel = ((got - want) / want).abs();
                assert!(rel < 3e-7, "x={x} got={got} want={want} rel={rel}");
            }
            x += 0.001_37;
        }
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-0.0), 1.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn lane_sums_agree_with_plain_sums() {
        let v: Vec<f64> = (0..37).map(|i| i as f64 * 0.5).collect();
        assert_eq!(lane_sum(&v), v.iter().sum::<f64>());
        assert_eq!(lane_sum(&[]), 0.0);
        let logits = [
            0.0f32,
            f32::NAN,
            -1.0,
            0.0,
            -2.0,
            f32::NEG_INFINITY,
            0.5,
            1.0,
            -0.5,
            0.25,
        ];
        let want: f64 = logits
            .iter()
            .filter(|l| !l.is_nan())
            .map(|&l| (l as f64 - 1.0).exp())
            .sum();
        assert!((softmax_total(&logits, 1.0, 1.0) - want).abs() < 1e-6);
    }

    #[test]
    fn weights_total_and_max_agree_with_their_plain_forms() {
        let logits: Vec<f32> = (0..1037)
            .map(|i| ((i * 37) % 101) as f32 / 7.0 - 9.0)
            .collect();
        let max = nan_ignoring_max(&logits);
        let mut weights = vec![0.0; logits.len()];
        let total = softmax_weights_total(&logits, max, 0.8, &mut weights);
        assert_eq!(total.to_bits(), softmax_total(&logits, max, 0.8).to_bits());
        for (w, &l) in weights.iter().zip(&logits) {
            assert_eq!(w.to_bits(), softmax_weight(l, max, 0.8).to_bits());
        }
        assert_eq!(max_and_any_nan(&logits), (max, false));
        let mut with_nan = logits.clone();
        with_nan[1030] = f32::NAN;
        assert_eq!(max_and_any_nan(&with_nan), (max, true));
        assert_eq!(max_and_any_nan(&[]), (f32::NEG_INFINITY, false));
    }

    #[test]
    fn softmax_weight_handles_infinities() {
        assert_eq!(softmax_weight(f32::INFINITY, f32::INFINITY, 1.0), 1.0);
        assert_eq!(softmax_weight(3.0, f32::INFINITY, 1.0), 0.0);
        assert_eq!(
            softmax_weight(f32::NEG_INFINITY, f32::NEG_INFINITY, 1.0),
            1.0
        );
        assert_eq!(softmax_weight(f32::NEG_INFINITY, 2.0, 1.0), 0.0);
        assert_eq!(softmax_weight(f32::NAN, 2.0, 1.0), 0.0);
        let w = softmax_weight(1.0, 2.0, 0.5);
        assert!((f64::from(w) - (-2.0f64).exp()).abs() < 1e-7);
    }

    #[test]
    fn argmax_lowest_index_on_ties_and_skips_nan() {
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0, f32::NAN, 5.0, 5.0]), 3);
        assert_eq!(argmax(&[f32::NAN, -1.0]), 1);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[2.0, f32::INFINITY, f32::NAN, f32::INFINITY]), 1);
    }

    #[test]
    fn argmax_agrees_with_scalar_scan_across_lanes() {
        fn scalar(logits: &[f32]) -> u32 {
            let mut best: Option<(usize, f32)> = None;
            for (i, &l) in logits.iter().enumerate() {
                if l.is_nan() {
                    continue;
                }
                if !matches!(best, Some((_, b)) if l <= b) {
                    best = Some((i, l));
                }
            }
            best.map_or(0, |(i, _)| i as u32)
        }
        let mut state = 0x1234_5678u64;
        for n in [1usize, 15, 16, 17, 33, 100, 1000, 1023, 1024, 1025, 5000] {
            for _ in 0..50 {
                let row: Vec<f32> = (0..n)
                    .map(|_| {
                        state = state
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        match (state >> 33) % 10 {
                            0 => f32::NAN,
                            1 => f32::NEG_INFINITY,
                            2 => -0.0,
                            r => (r % 4) as f32,
                        }
                    })
                    .collect();
                assert_eq!(argmax(&row), scalar(&row), "{row:?}");
            }
        }
        let mut all_neg_inf = vec![f32::NAN; 40];
        all_neg_inf[23] = f32::NEG_INFINITY;
        all_neg_inf[31] = f32::NEG_INFINITY;
        assert_eq!(argmax(&all_neg_inf), 23);
    }
}
