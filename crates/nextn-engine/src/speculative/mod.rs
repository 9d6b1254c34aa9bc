//! MTP speculative decoding: the parts of a speculative step, used by the one generation loop
//! (`scheduler::step`) for every request, alone or batched.
//!
//! A step drafts up to `n_max` tokens with the NextN head, chained on its own output hidden
//! state ([`draft`]); the target verifies `[id_last, d1..dk]` in one pass (in the scheduler's
//! batched target pass); [`accept`] keeps the agreed prefix plus one token drawn from the
//! target; `Model::commit` rolls back the rest (docs/MODEL.md, "Speculative verify rollback").
//!
//! Drafts are greedy (the head's top-1) and accepted when the target's own draw equals them: the
//! draw at output position i uses randomness that depends only on (seed, i), so the output is
//! plain decoding's, token for token, whatever was drafted. `--spec-draft-sampling sample`
//! draws drafts from the head instead and accepts with min(1, p/q): the same distribution,
//! but the tokens depend on what was drafted.

pub mod accept;
pub mod draft;
pub mod forced;
pub mod speculator;

/// `--spec-draft-sampling`: how drafts are chosen and verified at temperature > 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftSampling {
    /// Draft the head's top-1 token; accept it when the target's own draw at that position equals
    /// it. The draws are those plain decoding makes, so a seeded request gives the same tokens
    /// whether and however deep it drafted.
    Coupled,
    /// Draw each draft from the head's distribution q (after the request's sampler chain) and
    /// accept it with probability min(1, p/q) against the target's distribution p; on rejection
    /// draw from the normalised residual max(0, p − q). Exact in distribution, and accepts more
    /// when head and target agree in distribution, but the tokens drawn depend on the drafting.
    /// Falls back to `Coupled` at temperature 0.
    Sample,
}

impl DraftSampling {
    /// `coupled` (also `greedy`, the name of the draft rule) or `sample`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "coupled" | "greedy" => Some(DraftSampling::Coupled),
            "sample" => Some(DraftSampling::Sample),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            DraftSampling::Coupled => "coupled",
            DraftSampling::Sample => "sample",
        }
    }
}

/// What speculative decoding does, with llama.cpp's names and defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct SpecConfig {
    /// `--spec-draft-n-max`: most drafts per step.
    pub n_max: usize,
    /// `--spec-draft-n-min`: a draft chain shorter than this is discarded.
    pub n_min: usize,
    /// `--spec-draft-p-min`: stop a chain when the head's top-1 probability (full softmax) is
    /// below this.
    pub p_min: f32,
    pub draft_sampling: DraftSampling,
    /// With a grammar, pick drafts among the tokens it allows (a copy of its state advances
    /// along the chain). Off: drafts ignore the grammar and verification alone enforces it.
    pub mask_drafts: bool,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            n_max: 3,
            n_min: 0,
            p_min: 0.0,
            draft_sampling: DraftSampling::Coupled,
            mask_drafts: true,
        }
    }
}

/// One verification step, for tests and debugging.
#[derive(Clone, Debug, PartialEq)]
pub struct StepTrace {
    pub n_past: usize,
    pub id_last: u32,
    pub drafts: Vec<u32>,
    pub accepted: usize,
}

/// Acceptance statistics of one request, named as llama.cpp reports them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecStats {
    /// Tokens drafted (`draft_n`).
    pub draft_n: u64,
    /// Drafted tokens the target accepted (`draft_n_accepted`).
    pub draft_n_accepted: u64,
    /// Verification steps that carried at least one draft.
    pub steps: u64,
    /// `accepted_per_pos[i]`: steps whose draft at position i was accepted.
    pub accepted_per_pos: Vec<u64>,
    /// Steps at each draft position (how often position i was drafted).
    pub drafted_per_pos: Vec<u64>,
    /// Milliseconds of the head passes the request took part in (drafting and catching the head
    /// up with committed tokens).
    pub draft_ms: f64,
    /// Milliseconds of the target passes the request decoded in, with acceptance and commit.
    pub verify_ms: f64,
    /// Every step, when the request asked for a trace.
    pub trace: Vec<StepTrace>,
}

impl SpecStats {
    /// Statistics for drafts of up to `n_max` tokens.
    pub fn new(n_max: usize) -> Self {
        SpecStats {
            accepted_per_pos: vec![0; n_max],
            drafted_per_pos: vec![0; n_max],
            ..Default::default()
        }
    }

    /// One verify step that carried `drafted` drafts, of which the first `accepted` were kept.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.steps += 1;
        self.draft_n += drafted as u64;
        self.draft_n_accepted += accepted as u64;
        if self.drafted_per_pos.len() < drafted {
            self.drafted_per_pos.resize(drafted, 0);
            self.accepted_per_pos.resize(drafted, 0);
        }
        self.drafted_per_pos[..drafted]
            .iter_mut()
            .for_each(|c| *c += 1);
        self.accepted_per_pos[..accepted]
            .iter_mut()
            .for_each(|c| *c += 1);
    }

    pub fn acceptance_rate(&self) -> f64 {
        if self.draft_n > 0 {
            self.draft_n_accepted as f64 / self.draft_n as f64
        } else {
            0.0
        }
    }

    /// 1 + accepted / steps: tokens gained per verification step.
    pub fn mean_accepted_len(&self) -> f64 {
        if self.steps > 0 {
            1.0 + self.draft_n_accepted as f64 / self.steps as f64
        } else {
            1.0
        }
    }

    pub fn merge(&mut self, other: &SpecStats) {
        self.draft_n += other.draft_n;
        self.draft_n_accepted += other.draft_n_accepted;
        self.steps += other.steps;
        for (dst, src) in [
            (&mut self.accepted_per_pos, &other.accepted_per_pos),
            (&mut self.drafted_per_pos, &other.drafted_per_pos),
        ] {
            if dst.len() < src.len() {
                dst.resize(src.len(), 0);
            }
            dst.iter_mut().zip(src).for_each(|(a, b)| *a += b);
        }
        self.draft_ms += other.draft_ms;
        self.verify_ms += other.verify_ms;
    }

    pub fn to_json(&self, predicted_n: usize) -> serde_json::Value {
        let per_token = |x: u64| {
            if predicted_n > 0 {
                x as f64 / predicted_n as f64
            } else {
                0.0
            }
        };
        let rate_per_pos: Vec<f64> = self
            .accepted_per_pos
            .iter()
            .zip(&self.drafted_per_pos)
            .map(|(&a, &d)| if d > 0 { a as f64 / d as f64 } else { 0.0 })
            .collect();
        serde_json::json!({
            "draft_n": self.draft_n,
            "draft_n_accepted": self.draft_n_accepted,
            "steps": self.steps,
            "acceptance_rate": self.acceptance_rate(),
            "accepted_per_pos": self.accepted_per_pos,
            "drafted_per_pos": self.drafted_per_pos,
            "acceptance_per_pos": rate_per_pos,
            "mean_accepted_len": self.mean_accepted_len(),
            "drafts_per_token": per_token(self.draft_n),
            "accepted_per_token": per_token(self.draft_n_accepted),
            "draft_ms": self.draft_ms,
            "verify_ms": self.verify_ms,
        })
    }

    /// One line for stderr, in the spirit of llama.cpp's `draft acceptance` log.
    pub fn summary(&self) -> String {
        let per_pos: Vec<String> = self
            .accepted_per_pos
            .iter()
            .zip(&self.drafted_per_pos)
            .map(|(&a, &d)| {
                if d > 0 {
                    format!("{:.2}", a as f64 / d as f64)
                } else {
                    "-".into()
                }
            })
            .collect();
        format!(
            "draft acceptance = {:.5} ({} accepted / {} drafted), {} steps, mean len = {:.3}, per position [{}], draft {:.1} ms, verify {:.1} ms",
            self.acceptance_rate(),
            self.draft_n_accepted,
            self.draft_n,
            self.steps,
            self.mean_accepted_len(),
            per_pos.join(", "),
            self.draft_ms,
            self.verify_ms
        )
    }
}

/// Per-position acceptance counts: `reached[j]` steps drafted position `j` with every earlier
/// draft accepted, `accepted[j]` of them accepted it too.
#[derive(Clone, Debug, Default)]
pub struct AcceptanceCounts {
    pub reached: Vec<f64>,
    pub accepted: Vec<f64>,
}

impl AcceptanceCounts {
    pub fn new(n: usize) -> Self {
        AcceptanceCounts {
            reached: vec![0.0; n],
            accepted: vec![0.0; n],
        }
    }

    /// Record one verify step: `drafted` tokens offered, the first `accepted` of them kept.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        for j in 0..drafted.min(accepted + 1).min(self.reached.len()) {
            self.reached[j] += 1.0;
            if j < accepted {
                self.accepted[j] += 1.0;
            }
        }
    }

    /// Keep the counts a sliding window of roughly `window` steps per position.
    pub fn decay_to(&mut self, window: f64) {
        for j in 0..self.reached.len() {
            if self.reached[j] > window {
                let f = window / self.reached[j];
                self.reached[j] *= f;
                self.accepted[j] *= f;
            }
        }
    }

    /// Conditional acceptance per position, shrunk toward `prior` with `weight` pseudo-steps.
    pub fn estimate(&self, prior: &[f64], weight: f64) -> Vec<f64> {
        (0..self.reached.len())
            .map(|j| {
                let p = prior.get(j).copied().unwrap_or(0.5);
                (self.accepted[j] + weight * p) / (self.reached[j] + weight)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acceptance_counts_condition_on_earlier_positions() {
        let mut c = AcceptanceCounts::new(3);
        c.record(3, 1); // positions 0 and 1 reached; 0 accepted
        c.record(3, 3); // all reached and accepted
        c.record(1, 0); // position 0 reached, rejected
        assert_eq!(c.reached, vec![3.0, 2.0, 1.0]);
        assert_eq!(c.accepted, vec![2.0, 1.0, 1.0]);
        let est = c.estimate(&[0.5, 0.5, 0.5], 0.0);
        assert!((est[0] - 2.0 / 3.0).abs() < 1e-12);
        assert!((est[1] - 0.5).abs() < 1e-12);
        // With no measurements, the prior; with some, pulled toward it by its weight.
        assert_eq!(
            AcceptanceCounts::new(2).estimate(&[0.3, 0.6], 4.0),
            vec![0.3, 0.6]
        );
        assert!((c.estimate(&[0.0; 3], 1.0)[2] - 0.5).abs() < 1e-12);
        c.decay_to(1.5);
        assert!((c.reached[0] - 1.5).abs() < 1e-12 && (c.accepted[0] - 1.0).abs() < 1e-12);
    }
}
