//! The plan of one step: which prompt chunks run, how deep each decoding slot drafts, whose head
//! catches up without drafting and whose head is retired ([`Planner::plan`]).
//!
//! `Auto` prices every extra draft token with the measured cost curves ([`super::cost`]) and the
//! slot's measured acceptance: draft `j+1` of a slot is expected to yield `Π_{l≤j} a_l` tokens and
//! costs one more verify row in the target pass, one more row (or a whole new pass) of the head at
//! depth `j`, and, for a slot's first draft, the commit of a verify batch. Drafts are added best
//! value-per-millisecond first, as long as they raise the step's expected tokens per millisecond;
//! a step with no drafts is plain decoding, so the plan is never priced below plain. `MaxSlots`
//! is the fixed throttle: every slot drafts `n_max` while at most that many slots are busy.

use super::cost::CostModel;
pub use crate::speculative::AcceptanceCounts;

/// Acceptance assumed for a draft position nothing has been measured for yet: optimistic, so
/// positions get tried and measured.
const PRIOR_ACCEPTANCE: f64 = 0.75;
/// Pseudo-steps of the global estimate in a slot's own estimate, and of the prior in the global.
const SLOT_PRIOR_WEIGHT: f64 = 4.0;
const GLOBAL_PRIOR_WEIGHT: f64 = 2.0;
/// Sliding windows (in steps per position) of the acceptance counts.
const GLOBAL_WINDOW: f64 = 400.0;
pub(super) const SLOT_WINDOW: f64 = 64.0;
/// A slot's head lag is run in a pass of its own once it reaches this many rows while the slot
/// prefills (under any policy) or decodes without drafting (fixed throttle), so the lag (and the
/// hidden states it keeps, `n_embd` floats a row) stays bounded however long the prompt, and
/// drafting can resume at once when load drops.
pub(super) const LAG_FLUSH: usize = 256;
/// With `auto`, a slot that has not drafted for this many steps and owes the head this many rows
/// stops tracking the head for the rest of its request: under sustained load keeping the head
/// current would cost every token a head row for drafts that never come.
const ABANDON_IDLE_STEPS: usize = 8;
const ABANDON_LAG: usize = 64;
/// Every this many steps `auto` runs one step without drafts, and one where one more slot (with
/// a short head lag) drafts fully.
const EXPLORE_PERIOD: u64 = 32;
/// Only a slot whose head lag is at most this explores.
const EXPLORE_MAX_LAG: usize = 16;

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

/// What the plan needs to know of one busy slot.
pub(super) struct SlotView<'a> {
    pub index: usize,
    /// Admission order: prompts are processed first come, first served.
    pub seq_no: u64,
    pub stage: ViewStage<'a>,
}

pub(super) enum ViewStage<'a> {
    Prefill {
        /// The next prompt position to run.
        next: usize,
        /// Where this chunk must end at the latest (the next cache point or the prompt's end).
        chunk_limit: usize,
        prompt_len: usize,
        head_lag: Option<usize>,
    },
    Decode {
        /// Most drafts the slot has room for (context and token budget; 0 without a head).
        room: usize,
        head_lag: Option<usize>,
        idle_steps: usize,
        acceptance: &'a AcceptanceCounts,
    },
}

/// A prompt chunk of this step: `prompt[start..end]` of slot `slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PromptChunk {
    pub slot: usize,
    pub start: usize,
    pub end: usize,
}

/// One step's plan.
#[derive(Clone, Debug, Default)]
pub(super) struct StepPlan {
    pub prompt: Vec<PromptChunk>,
    /// Every decoding slot with its draft depth (0: a plain decode row), in slot order.
    pub decode: Vec<(usize, usize)>,
    /// Slots whose head runs (a piece of) its lag this step without drafting.
    pub catch_up: Vec<usize>,
    /// Slots whose head is dropped before drafting: they decode plainly from now on.
    pub retire: Vec<usize>,
}

/// Plans steps: owns the policy, the server-wide acceptance counts and the step counter that
/// schedules `auto`'s exploration.
pub(super) struct Planner {
    policy: DraftPolicy,
    /// Drafting settings when the engine drafts (`n_max`, `n_min`).
    limits: Option<(usize, usize)>,
    n_batch: usize,
    acceptance: AcceptanceCounts,
    step_no: u64,
}

impl Planner {
    pub fn new(policy: DraftPolicy, limits: Option<(usize, usize)>, n_batch: usize) -> Self {
        Planner {
            policy,
            limits,
            n_batch,
            acceptance: AcceptanceCounts::new(limits.map_or(0, |l| l.0)),
            step_no: 0,
        }
    }

    /// The server-wide acceptance estimate per draft position.
    pub fn acceptance_estimate(&self) -> Vec<f64> {
        let n_max = self.limits.map_or(0, |l| l.0);
        self.acceptance
            .estimate(&vec![PRIOR_ACCEPTANCE; n_max], GLOBAL_PRIOR_WEIGHT)
    }

    /// A verify step offered `drafted` drafts and kept `accepted`.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        self.acceptance.record(drafted, accepted);
        self.acceptance.decay_to(GLOBAL_WINDOW);
    }

    /// The plan of the next step over the busy slots.
    pub fn plan(&mut self, cost: &CostModel, slots: &[SlotView<'_>]) -> StepPlan {
        self.step_no += 1;
        let mut plan = StepPlan::default();
        let shape = self.plan_prompt(slots, &mut plan);
        let decoding: Vec<&SlotView> = slots
            .iter()
            .filter(|s| matches!(s.stage, ViewStage::Decode { .. }))
            .collect();
        let depths = self.plan_drafts(cost, &decoding, shape, slots.len());
        let auto = self.policy == DraftPolicy::Auto && self.limits.is_some();
        let flush_idle = matches!(self.policy, DraftPolicy::MaxSlots(_));
        for (s, &k) in decoding.iter().zip(&depths) {
            let ViewStage::Decode {
                head_lag: Some(lag),
                idle_steps,
                ..
            } = s.stage
            else {
                plan.decode.push((s.index, k));
                continue;
            };
            let idle = if k > 0 { 0 } else { idle_steps + 1 };
            if auto && idle >= ABANDON_IDLE_STEPS && lag >= ABANDON_LAG {
                plan.retire.push(s.index);
            } else if k == 0 && flush_idle && lag >= LAG_FLUSH {
                plan.catch_up.push(s.index);
            }
            plan.decode.push((s.index, k));
        }
        for s in slots {
            if let ViewStage::Prefill {
                head_lag: Some(lag),
                ..
            } = s.stage
            {
                if lag >= LAG_FLUSH {
                    plan.catch_up.push(s.index);
                }
            }
        }
        plan
    }

    /// Prompt chunks, first come first served, within the per-step row budget.
    fn plan_prompt(&self, slots: &[SlotView<'_>], plan: &mut StepPlan) -> StepShape {
        let mut prefilling: Vec<&SlotView> = slots
            .iter()
            .filter(|s| matches!(s.stage, ViewStage::Prefill { .. }))
            .collect();
        prefilling.sort_unstable_by_key(|s| (s.seq_no, s.index));
        let mut budget = self.n_batch;
        let mut shape = StepShape::default();
        for s in prefilling {
            let ViewStage::Prefill {
                next,
                chunk_limit,
                prompt_len,
                ..
            } = s.stage
            else {
                continue;
            };
            if budget == 0 {
                break;
            }
            let end = chunk_limit.min(next + budget);
            budget -= end - next;
            shape.prefill_rows += end - next;
            if end == prompt_len {
                shape.prefill_logit_rows += 1;
            }
            plan.prompt.push(PromptChunk {
                slot: s.index,
                start: next,
                end,
            });
        }
        shape
    }

    /// Draft depth per decoding slot (aligned with `decoding`).
    fn plan_drafts(
        &self,
        cost: &CostModel,
        decoding: &[&SlotView<'_>],
        shape: StepShape,
        busy: usize,
    ) -> Vec<usize> {
        let Some((n_max, n_min)) = self.limits else {
            return vec![0; decoding.len()];
        };
        let max_k: Vec<usize> = decoding
            .iter()
            .map(|s| match s.stage {
                ViewStage::Decode {
                    room,
                    head_lag: Some(_),
                    ..
                } => {
                    let k = n_max.min(room);
                    if k < n_min {
                        0
                    } else {
                        k
                    }
                }
                _ => 0,
            })
            .collect();
        match self.policy {
            DraftPolicy::MaxSlots(n) => {
                if busy <= n {
                    max_k
                } else {
                    vec![0; decoding.len()]
                }
            }
            // The cost curves are only learned at the row counts steps actually use: now and then
            // a step without drafts, and a step where one more slot drafts fully, keep both sides
            // of the plan measured, so a wrong curve cannot hold the plan at one end for good.
            DraftPolicy::Auto if self.step_no.is_multiple_of(EXPLORE_PERIOD) => {
                vec![0; decoding.len()]
            }
            DraftPolicy::Auto => {
                let global = self.acceptance_estimate();
                let cands: Vec<DraftCandidate> = decoding
                    .iter()
                    .zip(&max_k)
                    .map(|(s, &k)| DraftCandidate {
                        max_k: k,
                        accept: match s.stage {
                            ViewStage::Decode { acceptance, .. } => {
                                acceptance.estimate(&global, SLOT_PRIOR_WEIGHT)
                            }
                            ViewStage::Prefill { .. } => Vec::new(),
                        },
                    })
                    .collect();
                let mut depths = plan_auto(cost, shape, &cands);
                if self.step_no % EXPLORE_PERIOD == EXPLORE_PERIOD / 2 {
                    // A slot that owes the head next to nothing explores, so exploring costs a
                    // few rows and never a catch-up pass.
                    let lag_of = |d: usize| match decoding[d].stage {
                        ViewStage::Decode {
                            head_lag: Some(lag),
                            ..
                        } => lag,
                        _ => usize::MAX,
                    };
                    let pick = (0..decoding.len())
                        .filter(|&d| depths[d] < max_k[d] && lag_of(d) <= EXPLORE_MAX_LAG)
                        .min_by_key(|&d| {
                            (lag_of(d), (d as u64 + self.step_no) % decoding.len() as u64)
                        });
                    if let Some(d) = pick {
                        depths[d] = max_k[d];
                    }
                }
                depths
            }
        }
    }
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
}
