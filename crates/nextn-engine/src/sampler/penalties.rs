//! Repetition / presence / frequency penalty state: the last `window` accepted tokens and how often
//! each occurs among them.

use std::collections::{BTreeMap, VecDeque};

/// Largest accepted `repeat_last_n`. The window only grows as tokens are accepted, but a bound keeps
/// a hostile request from pinning unbounded memory over a long generation.
pub const MAX_REPEAT_LAST_N: usize = 1 << 20;

#[derive(Clone, Debug)]
pub struct PenaltyHistory {
    window: usize,
    recent: VecDeque<u32>,
    // Ordered map: the penalised set is iterated every sample and a stable order keeps every
    // intermediate buffer identical from run to run.
    counts: BTreeMap<u32, u32>,
}

impl PenaltyHistory {
    pub fn new(window: usize) -> Self {
        Self {
            window,
            recent: VecDeque::with_capacity(window.min(4096)),
            counts: BTreeMap::new(),
        }
    }

    pub fn record(&mut self, token: u32) {
        if self.window == 0 {
            return;
        }
        if self.recent.len() == self.window {
            if let Some(old) = self.recent.pop_front() {
                if let Some(c) = self.counts.get_mut(&old) {
                    *c -= 1;
                    if *c == 0 {
                        self.counts.remove(&old);
                    }
                }
            }
        }
        self.recent.push_back(token);
        *self.counts.entry(token).or_insert(0) += 1;
    }

    pub fn clear(&mut self) {
        self.recent.clear();
        self.counts.clear();
    }

    /// Distinct tokens in the window with their occurrence counts (all counts ≥ 1), by token id.
    pub fn counts(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.counts.iter().map(|(&t, &c)| (t, c))
    }

    pub fn contains(&self, token: u32) -> bool {
        self.counts.contains_key(&token)
    }

    pub fn distinct(&self) -> usize {
        self.counts.len()
    }

    pub fn recent(&self) -> impl Iterator<Item = u32> + '_ {
        self.recent.iter().copied()
    }
}

/// The penalty parameters, applied to a token that occurs `count` ≥ 1 times in the window, in
/// llama.cpp's formula: the repetition penalty shrinks positive logits and grows negative ones
/// (division vs multiplication), then frequency and presence penalties are subtracted.
#[derive(Clone, Copy, Debug)]
pub struct PenaltyParams {
    pub repeat: f32,
    pub frequency: f32,
    pub presence: f32,
}

impl PenaltyParams {
    pub fn is_neutral(&self) -> bool {
        self.repeat == 1.0 && self.frequency == 0.0 && self.presence == 0.0
    }

    #[inline]
    pub fn apply(&self, logit: f32, count: u32) -> f32 {
        let repeated = if logit <= 0.0 {
            logit * self.repeat
        } else {
            logit / self.repeat
        };
        let presence = if count > 0 { self.presence } else { 0.0 };
        repeated - (count as f32 * self.frequency + presence)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_slides_and_counts_follow() {
        let mut h = PenaltyHistory::new(3);
        for t in [5, 7, 5, 9] {
            h.record(t);
        }
        // Window is now [7, 5, 9]: the first 5 has left.
        assert_eq!(h.counts().collect::<Vec<_>>(), vec![(5, 1), (7, 1), (9, 1)]);
        h.record(9);
        assert_eq!(h.counts().collect::<Vec<_>>(), vec![(5, 1), (9, 2)]);
        assert_eq!(h.recent().collect::<Vec<_>>(), vec![5, 9, 9]);
        h.clear();
        assert_eq!(h.distinct(), 0);
    }

    #[test]
    fn zero_window_records_nothing() {
        let mut h = PenaltyHistory::new(0);
        h.record(1);
        assert_eq!(h.distinct(), 0);
    }

    #[test]
    fn formula_matches_hand_computation() {
        let p = PenaltyParams {
            repeat: 2.0,
            frequency: 0.5,
            presence: 0.25,
        };
        // 3 / 2 − (2·0.5 + 0.25) = 0.25
        assert_eq!(p.apply(3.0, 2), 0.25);
        // −3 · 2 − (1·0.5 + 0.25) = −6.75
        assert_eq!(p.apply(-3.0, 1), -6.75);
        // 0 counts as non-positive: 0 · 2 − 0.75
        assert_eq!(p.apply(0.0, 1), -0.75);
    }
}
