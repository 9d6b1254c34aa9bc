//! The candidate list and the filters of the sampler chain (top-k, top-p, min-p) plus the final
//! temperature-scaled draw.
//!
//! Ordering convention: a candidate ranks before another when its logit is larger, or when the
//! logits are equal and its id is smaller. This total order makes every selection and sort below
//! deterministic, which the seeded draw relies on. NaN logits never become candidates.

use std::cmp::Ordering;

use super::math::{lane_sum, nan_ignoring_max, softmax_weight};
use super::penalties::{PenaltyHistory, PenaltyParams};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub logit: f32,
    pub id: u32,
}

#[inline]
fn rank_order(a: &Candidate, b: &Candidate) -> Ordering {
    // NaN never enters the list, so partial_cmp only sees comparable values; −0.0 == +0.0 falls
    // through to the id tie-break like every other tie.
    b.logit
        .partial_cmp(&a.logit)
        .unwrap_or(Ordering::Equal)
        .then(a.id.cmp(&b.id))
}

/// Reorders `items` so that its first `m` entries are its `m` best in rank order (unsorted among
/// themselves) for the smallest `m` whose softmax mass (weights relative to `max`, temperature 1)
/// reaches `need`, and returns `m` (all of `items` if the mass never gets there).
///
/// Quickselect where the pivot test is accumulated mass instead of a position: each round
/// partitions the live range around a median-of-three pivot and continues on the side that holds
/// the cut, so the expected work is linear. A deterministic depth limit falls back to sorting the
/// live range, bounding the worst case at O(n log n).
fn weighted_cut(items: &mut [Candidate], max: f32, mut need: f64) -> usize {
    let weight = |c: &Candidate| f64::from(softmax_weight(c.logit, max, 1.0));
    let (mut lo, mut hi) = (0usize, items.len());
    let mut rounds_left = 2 * (usize::BITS - items.len().leading_zeros()) + 8;
    loop {
        if hi - lo <= 64 || rounds_left == 0 {
            items[lo..hi].sort_unstable_by(rank_order);
            let mut cumulative = 0.0f64;
            for (i, item) in items[lo..hi].iter().enumerate() {
                cumulative += weight(item);
                if cumulative >= need {
                    return lo + i + 1;
                }
            }
            return hi;
        }
        rounds_left -= 1;

        // Median of first, middle and last by rank, moved to the end as the Lomuto pivot.
        let mid = lo + (hi - lo) / 2;
        let last = hi - 1;
        let (a, b, c) = (items[lo], items[mid], items[last]);
        let median = if (rank_order(&a, &b).is_lt()) == (rank_order(&b, &c).is_lt()) {
            mid
        } else if (rank_order(&b, &a).is_lt()) == (rank_order(&a, &c).is_lt()) {
            lo
        } else {
            last
        };
        items.swap(median, last);
        let pivot = items[last];

        let mut store = lo;
        let mut better_mass = 0.0f64;
        for i in lo..last {
            if rank_order(&items[i], &pivot).is_lt() {
                better_mass += weight(&items[i]);
                items.swap(i, store);
                store += 1;
            }
        }
        items.swap(store, last);

        if better_mass >= need {
            hi = store;
        } else {
            need -= better_mass + weight(&items[store]);
            if need <= 0.0 {
                return store + 1;
            }
            lo = store + 1;
        }
    }
}

#[cfg(test)]
pub fn weighted_cut_for_tests(items: &mut [Candidate], max: f32, need: f64) -> usize {
    weighted_cut(items, max, need)
}

/// Penalties that actually change something this call: non-neutral parameters and a non-empty
/// window.
#[derive(Clone, Copy)]
pub struct ActivePenalties<'a> {
    pub history: &'a PenaltyHistory,
    pub params: PenaltyParams,
}

impl ActivePenalties<'_> {
    /// The penalised logit of every windowed token that exists in this vocabulary and is not NaN.
    fn adjusted<'s>(&'s self, logits: &'s [f32]) -> impl Iterator<Item = Candidate> + 's {
        self.history.counts().filter_map(move |(id, count)| {
            let raw = *logits.get(id as usize)?;
            let logit = self.params.apply(raw, count);
            (!logit.is_nan()).then_some(Candidate { logit, id })
        })
    }
}

/// Scratch state reused from call to call so that sampling a 248k vocabulary allocates nothing once
/// the buffers have grown.
#[derive(Clone, Debug, Default)]
pub struct Candidates {
    items: Vec<Candidate>,
    /// `items` is in rank order (set by any step that sorted it).
    sorted: bool,
    weights: Vec<f64>,
    total_weight: f64,
}

impl Candidates {
    pub fn items(&self) -> &[Candidate] {
        &self.items
    }

    #[cfg(test)]
    pub fn is_sorted(&self) -> bool {
        self.sorted
    }

    /// Every non-NaN logit as a candidate in id order, with penalties applied.
    pub fn fill_all(&mut self, logits: &[f32], penalties: Option<ActivePenalties<'_>>) {
        self.items.clear();
        self.items
            .extend(
                logits
                    .iter()
                    .enumerate()
                    .filter(|(_, l)| !l.is_nan())
                    .map(|(i, &logit)| Candidate {
                        logit,
                        id: i as u32,
                    }),
            );
        self.sorted = false;
        if let Some(pen) = penalties {
            for adj in pen.adjusted(logits) {
                // Ids are ascending, so the windowed token (known non-NaN) is found by bisection.
                if let Ok(pos) = self.items.binary_search_by_key(&adj.id, |c| c.id) {
                    self.items[pos].logit = adj.logit;
                }
            }
        }
    }

    /// The `k` best penalised logits, in rank order. `k` must be ≥ 1.
    ///
    /// For a large vocabulary this scans the raw logits once, keeping a bounded buffer that is
    /// pruned with a partial selection whenever it fills; after the first prune almost every logit
    /// is rejected by one comparison against the running k-th value. Penalised tokens are handled
    /// by keeping `k + P` raw candidates (P = distinct windowed tokens): dropping the windowed ones
    /// afterwards still leaves the true top-k of the unpenalised tokens, to which the P penalised
    /// values are then added back before the final selection.
    pub fn fill_top_k(&mut self, logits: &[f32], k: usize, penalties: Option<ActivePenalties<'_>>) {
        debug_assert!(k >= 1);
        let keep = k + penalties.map_or(0, |p| p.history.distinct());
        let cap = (keep * 2).max(keep + 64);
        if cap >= logits.len() {
            self.fill_all(logits, penalties);
            self.truncate_to_top(k);
            return;
        }

        self.items.clear();
        let mut next = 0;
        while next < logits.len() && self.items.len() < cap {
            let logit = logits[next];
            if !logit.is_nan() {
                self.items.push(Candidate {
                    logit,
                    id: next as u32,
                });
            }
            next += 1;
        }
        if self.items.len() == cap {
            let mut threshold = self.prune(keep);
            // Blocks whose (vectorised) maximum does not beat the running k-th value are skipped
            // whole; for a top-40 of a 248k row that is nearly all of them.
            const BLOCK: usize = 64;
            for (b, block) in logits[next..].chunks(BLOCK).enumerate() {
                // The block maximum is never NaN (−∞ for an all-NaN block).
                if nan_ignoring_max(block) <= threshold {
                    continue;
                }
                let base = next + b * BLOCK;
                for (offset, &logit) in block.iter().enumerate() {
                    // Equal to the threshold is rejected: that candidate's id is larger than the
                    // current k-th's, so it ranks after it. NaN compares false and is rejected.
                    if logit > threshold {
                        self.items.push(Candidate {
                            logit,
                            id: (base + offset) as u32,
                        });
                        if self.items.len() == cap {
                            threshold = self.prune(keep);
                        }
                    }
                }
            }
        }

        if let Some(pen) = penalties {
            let history = pen.history;
            self.items.retain(|c| !history.contains(c.id));
            self.items.extend(pen.adjusted(logits));
        }
        self.sorted = false;
        self.truncate_to_top(k);
    }

    /// Keeps the `keep` best items (unordered) and returns the logit of the worst kept one.
    fn prune(&mut self, keep: usize) -> f32 {
        self.items.select_nth_unstable_by(keep - 1, rank_order);
        self.items.truncate(keep);
        self.items
            .iter()
            .map(|c| c.logit)
            .fold(f32::INFINITY, f32::min)
    }

    /// Keeps the `k` best candidates and sorts them into rank order.
    pub fn truncate_to_top(&mut self, k: usize) {
        if k == 0 {
            return;
        }
        if self.items.len() > k {
            self.items.select_nth_unstable_by(k - 1, rank_order);
            self.items.truncate(k);
        }
        self.items.sort_unstable_by(rank_order);
        self.sorted = true;
    }

    fn max_logit(&self) -> f32 {
        if self.sorted {
            self.items.first().map_or(f32::NEG_INFINITY, |c| c.logit)
        } else {
            self.items
                .iter()
                .map(|c| c.logit)
                .fold(f32::NEG_INFINITY, f32::max)
        }
    }

    /// Nucleus filter: keeps the smallest rank-ordered prefix whose softmax mass (temperature 1,
    /// over the current candidates) reaches `p`; at least one candidate survives, and the
    /// survivors end up in rank order.
    ///
    /// An unsorted list is never fully sorted: the best 256 are selected and sorted first (enough
    /// for peaked distributions); if their mass falls short, a mass-weighted quickselect finds
    /// the rest of the nucleus and only that is sorted.
    pub fn top_p(&mut self, p: f32) {
        if p >= 1.0 || self.items.is_empty() {
            return;
        }
        let max = self.max_logit();
        self.fill_weights(max, 1.0);
        let target = f64::from(p) * self.total_weight;

        let len = self.items.len();
        let head = if self.sorted { len } else { len.min(256) };
        if !self.sorted {
            if head < len {
                self.items.select_nth_unstable_by(head - 1, rank_order);
            }
            self.items[..head].sort_unstable_by(rank_order);
        }
        self.sorted = true;
        let mut cumulative = 0.0f64;
        for i in 0..head {
            cumulative += f64::from(softmax_weight(self.items[i].logit, max, 1.0));
            if cumulative >= target {
                self.items.truncate(i + 1);
                return;
            }
        }
        if head == len {
            // Rounding kept the sum just below p·total: everything stays.
            return;
        }
        let tail = &mut self.items[head..];
        let more = weighted_cut(tail, max, target - cumulative);
        tail[..more].sort_unstable_by(rank_order);
        self.items.truncate(head + more);
    }

    /// Keeps candidates whose probability is at least `p` times the top candidate's, i.e.
    /// `exp(logit − max) ≥ p`; order is preserved and the top candidate always survives.
    pub fn min_p(&mut self, p: f32) {
        if p <= 0.0 || self.items.is_empty() {
            return;
        }
        let max = self.max_logit();
        let p = f64::from(p);
        // Decide in the log domain where that is unambiguous, and with the built-in exponential
        // only near the cut: libm's ln may differ in the last bit between platforms, the margin
        // is far larger than that, and the exact test is platform-independent.
        let ln_p = p.ln();
        const MARGIN: f64 = 1e-9;
        self.items.retain(|c| {
            let d = f64::from(c.logit) - f64::from(max);
            if c.logit == max || d > ln_p + MARGIN {
                true
            } else if d < ln_p - MARGIN {
                false
            } else {
                f64::from(softmax_weight(c.logit, max, 1.0)) >= p
            }
        });
    }

    fn fill_weights(&mut self, max: f32, temperature: f32) {
        self.weights.clear();
        self.weights.extend(
            self.items
                .iter()
                .map(|c| f64::from(softmax_weight(c.logit, max, temperature))),
        );
        self.total_weight = lane_sum(&self.weights);
    }

    /// Computes the temperature-scaled softmax weights of the surviving candidates.
    pub fn weigh(&mut self, temperature: f32) {
        let max = self.max_logit();
        self.fill_weights(max, temperature);
    }

    /// Inverse-CDF draw over the weights from [`Self::weigh`], walking candidates in list order;
    /// `u` is uniform in [0, 1). `None` only when there are no candidates.
    pub fn draw(&self, u: f64) -> Option<u32> {
        let target = u * self.total_weight;
        let mut cumulative = 0.0f64;
        let mut last_positive = None;
        for (c, &w) in self.items.iter().zip(&self.weights) {
            if w > 0.0 {
                cumulative += w;
                last_positive = Some(c.id);
                if target < cumulative {
                    return Some(c.id);
                }
            }
        }
        // Only reachable through rounding at u → 1.
        last_positive.or_else(|| self.items.first().map(|c| c.id))
    }

    /// Normalised probabilities of the candidates from [`Self::weigh`], in list order.
    pub fn probabilities(&self) -> impl Iterator<Item = (u32, f32)> + '_ {
        let total = self.total_weight;
        self.items
            .iter()
            .zip(&self.weights)
            .map(move |(c, &w)| (c.id, (w / total) as f32))
    }
}
