//! How deep each slot drafts this step.
//!
//! `Auto` prices every extra draft token with the measured cost curves ([`super::cost`]) and the
//! slot's measured acceptance: draft `j+1` of a slot is expected to yield `Π_{l≤j} a_l` tokens and
//! costs one more verify row in the target pass, one more row (or a whole new pass) of the head at
//! depth `j`, and, for a slot's first draft, the commit of a verify batch. Drafts are added best
//! value-per-millisecond first, as long as they raise the step's expected tokens per millisecond;
//! a step with no drafts is plain decoding, so the plan is never priced below plain. `MaxSlots`
//! is the fixed throttle: every slot drafts `n_max` while at most that many slots are busy.

use super::cost::CostModel;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftPolicy {
    /// Decide per step and per slot from measured costs and acceptance.
    Auto,
    /// Draft `n_max` tokens in every slot while at most this many slots are busy, else none.
    MaxSlots(usize),
}

impl DraftPolicy {
    /// Every slot drafts `n_max` tokens in every step.
    pub const ALWAYS: DraftPolicy = DraftPolicy::MaxSlots(usize::MAX);
}

/// A decoding slot that could draft this step.
#[derive(Clone, Debug)]
pub struct DraftCandidate {
    /// Most drafts allowed (n_max, context room and token budget).
    pub max_k: usize,
    /// Estimated probability that draft position `j` is accepted given position `j−1` was.
    pub accept: Vec<f64>,
}

/// The work of this step that does not depend on drafting.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepShape {
    /// Prompt rows in the target pass.
    pub prefill_rows: usize,
    /// Prompt rows that need logits (last chunk of a prompt).
    pub prefill_logit_rows: usize,
}

/// Raise the step's expected rate only by clearly better drafts: measurement noise must not tip
/// a plan below plain decoding.
const MARGIN: f64 = 0.1;

/// Draft depth per candidate.
pub fn plan_auto(cost: &CostModel, shape: StepShape, cands: &[DraftCandidate]) -> Vec<usize> {
    let s = cands.len();
    let mut k = vec![0usize; s];
    if s == 0 {
        return k;
    }
    let max_depth = cands.iter().map(|c| c.max_k).max().unwrap_or(0);
    if max_depth == 0 {
        return k;
    }
    let mut rows = shape.prefill_rows + s;
    let mut head_rows = vec![0usize; max_depth];
    let mut tokens = s as f64;
    let mut ms = cost.target.pass_ms(s, s) + cost.per_slot_ms * s as f64;
    // Expected tokens of draft k[i]+1 given the slot's current depth.
    let gain = |c: &DraftCandidate, depth: usize| -> f64 {
        c.accept.iter().take(depth + 1).product::<f64>()
    };
    loop {
        let rate = if ms > 0.0 { tokens / ms } else { f64::INFINITY };
        // (value per ms, gain, cost, members)
        let mut best: Option<(f64, f64, f64, Vec<usize>)> = None;
        let consider = |members: Vec<usize>,
                        g: f64,
                        dt: f64,
                        best: &mut Option<(f64, f64, f64, Vec<usize>)>| {
            if members.is_empty() || g <= 0.0 {
                return;
            }
            let v = if dt > 0.0 { g / dt } else { f64::INFINITY };
            if best.as_ref().is_none_or(|b| v > b.0) {
                *best = Some((v, g, dt, members));
            }
        };
        let price = |n: usize, depth: usize, head_extra: usize| -> f64 {
            let mut dt = cost.target.marginal_ms(rows, n) + cost.target.logit_row_ms() * n as f64;
            dt += cost.head.marginal_ms(head_rows[depth], head_extra)
                + cost.head.logit_row_ms() * n as f64;
            if depth == 0 {
                dt += cost.commit_ms * n as f64;
            }
            dt
        };
        for (i, c) in cands.iter().enumerate() {
            let d = k[i];
            if d >= c.max_k {
                continue;
            }
            let extra = 1;
            consider(vec![i], gain(c, d), price(1, d, extra), &mut best);
        }
        // Whole depth levels at once: a new head pass may pay only when several slots share it.
        for depth in 0..max_depth {
            let members: Vec<usize> = (0..s)
                .filter(|&i| k[i] == depth && cands[i].max_k > depth)
                .collect();
            if members.len() < 2 {
                continue;
            }
            let g: f64 = members.iter().map(|&i| gain(&cands[i], depth)).sum();
            let extra: usize = members.len();
            let dt = price(members.len(), depth, extra);
            consider(members, g, dt, &mut best);
        }
        let Some((value, g, dt, members)) = best else {
            break;
        };
        if value <= rate * (1.0 + MARGIN) {
            break;
        }
        for &i in &members {
            let d = k[i];
            head_rows[d] += 1;
            k[i] += 1;
            rows += 1;
        }
        tokens += g;
        ms += dt;
    }
    k
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
    use super::super::cost::RowCost;
    use super::*;

    /// A pass costs `base` plus `per_row` per row; logits cost `logit` per row.
    fn linear(base: f64, per_row: f64, logit: f64) -> RowCost {
        let pts: Vec<(usize, f64)> = [1usize, 2, 4, 8, 16, 32, 64, 128, 256]
            .iter()
            .map(|&r| (r, base + per_row * r as f64))
            .collect();
        RowCost::from_points(&pts, logit)
    }

    fn model(base: f64, per_row: f64, head_base: f64, head_row: f64) -> CostModel {
        CostModel {
            target: linear(base, per_row, 0.0),
            head: linear(head_base, head_row, 0.0),
            per_slot_ms: 0.0,
            commit_ms: 0.0,
        }
    }

    fn cand(max_k: usize, a: f64) -> DraftCandidate {
        DraftCandidate {
            max_k,
            accept: vec![a; max_k],
        }
    }

    /// The expected rate of a plan under the same linear costs, for checking optimality.
    fn rate(base: f64, per_row: f64, hb: f64, hr: f64, a: f64, s: usize, k: usize) -> f64 {
        let tokens: f64 = s as f64 * (1.0 + (1..=k).map(|j| a.powi(j as i32)).sum::<f64>());
        let ms = base + per_row * (s * (1 + k)) as f64 + k as f64 * (hb + hr * s as f64);
        tokens / ms
    }

    #[test]
    fn fixed_step_cost_makes_one_slot_draft_deep() {
        // A weight-bound machine: a pass costs 10 ms whatever its rows, a head pass 1 ms.
        let m = model(10.0, 0.01, 1.0, 0.01);
        let k = plan_auto(&m, StepShape::default(), &[cand(4, 0.8)]);
        assert_eq!(k, vec![4]);
    }

    #[test]
    fn compute_bound_many_slots_do_not_draft() {
        // Rows cost in proportion: a rejected draft row is pure loss.
        let m = model(0.1, 1.0, 0.05, 0.5);
        let cands: Vec<_> = (0..16).map(|_| cand(3, 0.7)).collect();
        assert_eq!(plan_auto(&m, StepShape::default(), &cands), vec![0; 16]);
    }

    #[test]
    fn low_acceptance_slot_does_not_draft_beside_a_good_one() {
        let m = model(10.0, 0.3, 1.0, 0.1);
        let k = plan_auto(&m, StepShape::default(), &[cand(3, 0.9), cand(3, 0.02)]);
        assert!(k[0] >= 2, "{k:?}");
        assert_eq!(k[1], 0, "{k:?}");
    }

    #[test]
    fn plan_is_at_least_as_good_as_every_uniform_depth() {
        for &(base, per_row, hb, hr, a, s) in &[
            (10.0, 0.2, 1.0, 0.05, 0.8, 1usize),
            (10.0, 0.2, 1.0, 0.05, 0.5, 4),
            (5.0, 0.5, 1.0, 0.2, 0.9, 8),
            (2.0, 0.5, 0.5, 0.2, 0.7, 16),
            (20.0, 0.1, 3.0, 0.05, 0.6, 2),
        ] {
            let m = model(base, per_row, hb, hr);
            let cands: Vec<_> = (0..s).map(|_| cand(4, a)).collect();
            let k = plan_auto(&m, StepShape::default(), &cands);
            assert!(
                k.iter().all(|&x| x == k[0]),
                "identical slots get identical depths: {k:?}"
            );
            let chosen = rate(base, per_row, hb, hr, a, s, k[0]);
            let best = (0..=4)
                .map(|d| rate(base, per_row, hb, hr, a, s, d))
                .fold(0.0, f64::max);
            assert!(
                chosen >= best * 0.97,
                "case {base},{per_row},{hb},{hr},{a},{s}: depth {} rate {chosen} < best {best}",
                k[0]
            );
        }
    }

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
