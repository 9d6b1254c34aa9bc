//! One scheduler step: plan prompt chunks and drafts, run the head passes, one batched target
//! pass over every busy slot, then sample / accept / commit / stream per slot.

use std::time::Instant;

use nextn_model::{BatchItem, LogitRows, ModelError, NextnHead};

use super::core::Core;
use super::head_batch::{head_forward_batch, HeadItem};
use super::lock;
use super::policy::{plan_auto, DraftCandidate, DraftPolicy, StepShape};
use super::slot::{HeadSide, Slot, Stage};
use crate::generate::ms_since;
use crate::sampler::{argmax, TokenProb};
use crate::speculative::{accept_or_resample, draw};

/// With a fixed throttle, a slot's head lag is run in a pass of its own once it reaches this many
/// rows while the slot does not draft, so the lag (and the hidden states it keeps) stays bounded
/// and drafting can resume at once when load drops.
pub(super) const LAG_FLUSH: usize = 256;
/// With `auto`, a slot that has not drafted for this many steps and owes the head this many rows
/// stops tracking the head for the rest of its request: under sustained load keeping the head
/// current would cost every token a head row for drafts that never come.
pub(super) const ABANDON_IDLE_STEPS: usize = 8;
pub(super) const ABANDON_LAG: usize = 64;
/// Every this many steps `auto` runs one step without drafts, and one where one more slot (with
/// a short head lag) drafts fully.
const EXPLORE_PERIOD: u64 = 32;
/// Only a slot whose head lag is at most this explores.
const EXPLORE_MAX_LAG: usize = 16;

/// What one slot contributes to this step's target pass.
enum Work {
    Prefill {
        start: usize,
        end: usize,
    },
    /// `dists[j]`: the distribution draft `j` was drawn from (sampled drafts only).
    Decode {
        n_past: usize,
        rows: Vec<u32>,
        dists: Vec<Vec<TokenProb>>,
    },
}

impl<'e> Core<'e> {
    pub(super) fn step(&mut self) -> Result<(), ModelError> {
        self.step_no += 1;
        let n_slots = self.slots.len();
        let mut work: Vec<Option<Work>> = (0..n_slots).map(|_| None).collect();

        // Prompt chunks, first come first served, within the per-step row budget.
        let mut prefilling: Vec<(u64, usize)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref()
                    .filter(|s| matches!(s.stage, Stage::Prefill { .. }))
                    .map(|s| (s.seq_no, i))
            })
            .collect();
        prefilling.sort_unstable();
        let mut budget = self.cfg.n_batch;
        let mut shape = StepShape::default();
        for &(_, i) in &prefilling {
            let Some(slot) = self.slots[i].as_ref() else {
                continue;
            };
            let Stage::Prefill { next } = slot.stage else {
                continue;
            };
            if budget == 0 {
                break;
            }
            let end = slot.prompt.len().min(next + budget);
            budget -= end - next;
            shape.prefill_rows += end - next;
            if end == slot.prompt.len() {
                shape.prefill_logit_rows += 1;
            }
            work[i] = Some(Work::Prefill { start: next, end });
        }

        let decoding: Vec<usize> = (0..n_slots)
            .filter(|&i| {
                self.slots[i]
                    .as_ref()
                    .is_some_and(|s| matches!(s.stage, Stage::Decode { .. }))
            })
            .collect();
        let depths = self.plan_drafts(&decoding, shape);
        self.track_idle_heads(&decoding, &depths);
        let (drafts, mut dists) = self.draft(&decoding, &depths)?;
        let mut n_drafting = 0;
        let mut n_draft_tokens = 0;
        for (d, &i) in decoding.iter().enumerate() {
            let Some(slot) = self.slots[i].as_ref() else {
                continue;
            };
            let Stage::Decode { id_last } = slot.stage else {
                continue;
            };
            let mut rows = Vec::with_capacity(1 + drafts[d].len());
            rows.push(id_last);
            rows.extend_from_slice(&drafts[d]);
            if !drafts[d].is_empty() {
                n_drafting += 1;
                n_draft_tokens += drafts[d].len();
            }
            work[i] = Some(Work::Decode {
                n_past: slot.state.n_past,
                rows,
                dists: std::mem::take(&mut dists[d]),
            });
        }

        // One target pass over every slot's rows.
        let t_target = Instant::now();
        let mut order = Vec::new();
        let mut n_rows = 0;
        let mut n_logit_rows = 0;
        let outs = {
            let mut items = Vec::new();
            for (i, (slot, w)) in self.slots.iter_mut().zip(&work).enumerate() {
                let (Some(slot), Some(w)) = (slot.as_mut(), w.as_ref()) else {
                    continue;
                };
                let Slot { prompt, state, .. } = slot;
                let item = match w {
                    Work::Prefill { start, end } => BatchItem {
                        tokens: &prompt[*start..*end],
                        state,
                        logits: if *end == prompt.len() {
                            LogitRows::Last
                        } else {
                            LogitRows::None
                        },
                        verify: false,
                    },
                    Work::Decode { rows, .. } if rows.len() > 1 => BatchItem {
                        tokens: rows,
                        state,
                        logits: LogitRows::All,
                        verify: true,
                    },
                    Work::Decode { rows, .. } => BatchItem {
                        tokens: rows,
                        state,
                        logits: LogitRows::Last,
                        verify: false,
                    },
                };
                n_rows += item.tokens.len();
                n_logit_rows += match item.logits {
                    LogitRows::None => 0,
                    LogitRows::Last => 1,
                    LogitRows::All => item.tokens.len(),
                };
                items.push(item);
                order.push(i);
            }
            self.engine
                .model
                .forward_batch(&mut items, &self.engine.pool)?
        };
        let target_ms = ms_since(t_target);
        self.cost.target.observe(n_rows, n_logit_rows, target_ms);
        {
            let busy = self.busy();
            let mut m = lock(&self.shared.metrics);
            m.n_decode_total += 1;
            m.n_busy_slots_total += busy as u64;
            m.last_step_rows = n_rows;
            m.last_step_ms = target_ms;
            m.last_step_drafting_slots = n_drafting;
            m.last_step_draft_tokens = n_draft_tokens;
        }

        let t_post = Instant::now();
        let mut commit_ms = 0.0;
        let mut n_verify = 0;
        for (out, i) in outs.into_iter().zip(order) {
            match work[i].take() {
                Some(Work::Prefill { start, end }) => self.after_prefill(i, start, end, &out)?,
                Some(Work::Decode {
                    n_past,
                    rows,
                    dists,
                }) => {
                    if rows.len() > 1 {
                        n_verify += 1;
                    }
                    commit_ms += self.after_decode(i, n_past, &rows, &dists, &out)?;
                }
                None => {}
            }
        }
        if n_verify > 0 {
            self.cost.observe_commit(n_verify, commit_ms);
        }
        if !decoding.is_empty() {
            self.cost
                .observe_per_slot(decoding.len(), ms_since(t_post) - commit_ms);
        }
        Ok(())
    }

    /// Draft depth per decoding slot (aligned with `decoding`).
    fn plan_drafts(&self, decoding: &[usize], shape: StepShape) -> Vec<usize> {
        let Some(spec) = &self.spec else {
            return vec![0; decoding.len()];
        };
        let max_k: Vec<usize> = decoding
            .iter()
            .map(|&i| match self.slots[i].as_ref() {
                Some(s) if s.head.is_some() => {
                    // Room for [id_last, drafts] in the context and in the token budget (the bonus token counts).
                    let room = s.state.remaining().saturating_sub(1);
                    let budget = s.out.budget_left().saturating_sub(1);
                    let k = spec.n_max.min(room).min(budget);
                    if k < spec.n_min {
                        0
                    } else {
                        k
                    }
                }
                _ => 0,
            })
            .collect();
        match spec.policy {
            DraftPolicy::MaxSlots(n) => {
                if self.busy() <= n {
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
                let prior = vec![super::core::PRIOR_ACCEPTANCE; spec.n_max];
                let global = self
                    .global_acc
                    .estimate(&prior, super::core::GLOBAL_PRIOR_WEIGHT);
                let cands: Vec<DraftCandidate> = decoding
                    .iter()
                    .zip(&max_k)
                    .filter_map(|(&i, &k)| {
                        let s = self.slots[i].as_ref()?;
                        Some(DraftCandidate {
                            max_k: k,
                            accept: s
                                .stats
                                .counts
                                .estimate(&global, super::core::SLOT_PRIOR_WEIGHT),
                        })
                    })
                    .collect();
                if cands.len() != decoding.len() {
                    return vec![0; decoding.len()];
                }
                let mut depths = plan_auto(&self.cost, shape, &cands);
                if self.step_no % EXPLORE_PERIOD == EXPLORE_PERIOD / 2 {
                    // A slot that owes the head next to nothing explores, so exploring costs a
                    // few rows and never a catch-up pass.
                    let lag_of = |d: usize| {
                        self.slots[decoding[d]]
                            .as_ref()
                            .and_then(|s| s.head.as_ref())
                            .map_or(usize::MAX, |h| h.lag_tokens.len())
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

    /// Run the head for this step: a first pass over every drafting slot's lag plus `id_last`
    /// (and the lag of slots whose lag is long), then one pass per further draft depth.
    /// Returns the drafts of each decoding slot, and for sampled drafts their distributions.
    #[allow(clippy::type_complexity)]
    fn draft(
        &mut self,
        decoding: &[usize],
        depths: &[usize],
    ) -> Result<(Vec<Vec<u32>>, Vec<Vec<Vec<TokenProb>>>), ModelError> {
        let mut drafts: Vec<Vec<u32>> = vec![Vec::new(); decoding.len()];
        let mut dists: Vec<Vec<Vec<TokenProb>>> = vec![Vec::new(); decoding.len()];
        let (Some(head), Some(spec)) = (self.engine.head.as_ref(), self.spec.clone()) else {
            return Ok((drafts, dists));
        };
        let eps = self.engine.model.config.rms_eps;
        let pool = &self.engine.pool;
        let e = self.engine.model.config.n_embd;
        let mut drafting_of_slot: Vec<Option<usize>> = vec![None; self.slots.len()];
        for (d, &i) in decoding.iter().enumerate() {
            if depths[d] > 0 {
                drafting_of_slot[i] = Some(d);
            }
        }
        let mut chain: Vec<Vec<f32>> = vec![Vec::new(); decoding.len()];

        // Depth 0: lag rows + id_last for drafting slots; long lags of the others (fixed
        // throttle only). A lag longer than the prompt budget is run in budget-sized pieces
        // first, and the slot drafts once it is caught up.
        let flush_idle = matches!(spec.policy, DraftPolicy::MaxSlots(_));
        let max_rows = self.cfg.n_batch;
        let t0 = Instant::now();
        // (slot, decoding index when drafting, rows run)
        let mut members: Vec<(usize, Option<usize>, usize)> = Vec::new();
        let outs = {
            let mut items = Vec::new();
            for (i, slot) in self.slots.iter_mut().enumerate() {
                let Some(slot) = slot.as_mut() else { continue };
                let Stage::Decode { id_last } = slot.stage else {
                    continue;
                };
                let Some(h) = slot.head.as_mut() else {
                    continue;
                };
                let lag = h.lag_tokens.len();
                let mut d = drafting_of_slot[i];
                if d.is_some() && lag + 1 > max_rows {
                    d = None;
                } else if d.is_none() && !(flush_idle && lag >= LAG_FLUSH) {
                    continue;
                }
                if d.is_some() {
                    h.lag_tokens.push(id_last);
                    h.lag_hidden.extend_from_slice(&h.pending_hidden);
                }
                let rows = h.lag_tokens.len().min(max_rows);
                let HeadSide {
                    cache,
                    lag_tokens,
                    lag_hidden,
                    pos,
                    ..
                } = h;
                items.push(HeadItem {
                    tokens: &lag_tokens[..rows],
                    hidden_prev: &lag_hidden[..rows * e],
                    start_pos: *pos,
                    cache,
                    logits: if d.is_some() {
                        LogitRows::Last
                    } else {
                        LogitRows::None
                    },
                });
                members.push((i, d, rows));
            }
            if items.is_empty() {
                return Ok((drafts, dists));
            }
            head_forward_batch(head, eps, &mut items, pool)?
        };
        let rows: usize = members.iter().map(|m| m.2).sum();
        let n_logits = members.iter().filter(|m| m.1.is_some()).count();
        self.cost.head.observe(rows, n_logits, ms_since(t0));
        for (out, &(i, d, rows)) in outs.iter().zip(&members) {
            let Some(slot) = self.slots[i].as_mut() else {
                continue;
            };
            if let Some(h) = slot.head.as_mut() {
                h.consume_lag(rows, e);
            }
            if let Some(d) = d {
                if let Some((pick, q)) = pick_draft(slot, out.logits_row(0), spec.p_min) {
                    drafts[d].push(pick);
                    dists[d].extend(q);
                    let n = out.hidden.len() / e;
                    chain[d] = out.hidden[(n - 1) * e..].to_vec();
                }
            }
        }
        // Slots that were to draft but are still catching up do not draft this step.
        let caught_up: Vec<bool> = decoding
            .iter()
            .map(|&i| members.iter().any(|m| m.0 == i && m.1.is_some()))
            .collect();

        // Further depths: one row per slot still drafting, on the head's own hidden state.
        let max_depth = depths.iter().copied().max().unwrap_or(0);
        for depth in 1..max_depth {
            let t = Instant::now();
            let inputs: Vec<(usize, [u32; 1], Vec<f32>)> = (0..decoding.len())
                .filter(|&d| caught_up[d] && depths[d] > depth && drafts[d].len() == depth)
                .map(|d| (d, [drafts[d][depth - 1]], std::mem::take(&mut chain[d])))
                .collect();
            if inputs.is_empty() {
                break;
            }
            let outs = {
                let mut items = Vec::new();
                let mut by_slot: Vec<Option<usize>> = vec![None; self.slots.len()];
                for (k, (d, _, _)) in inputs.iter().enumerate() {
                    by_slot[decoding[*d]] = Some(k);
                }
                for (i, slot) in self.slots.iter_mut().enumerate() {
                    let Some(k) = by_slot[i] else { continue };
                    let Some(slot) = slot.as_mut() else { continue };
                    let n_past = slot.state.n_past;
                    let Some(h) = slot.head.as_mut() else {
                        continue;
                    };
                    let (_, token, hidden) = &inputs[k];
                    items.push((
                        k,
                        HeadItem {
                            tokens: token,
                            hidden_prev: hidden,
                            start_pos: n_past + depth,
                            cache: &mut h.cache,
                            logits: LogitRows::Last,
                        },
                    ));
                }
                let (ks, mut items): (Vec<usize>, Vec<HeadItem>) = items.into_iter().unzip();
                let outs = head_forward_batch(head, eps, &mut items, pool)?;
                ks.into_iter().zip(outs).collect::<Vec<_>>()
            };
            self.cost.head.observe(outs.len(), outs.len(), ms_since(t));
            for (k, out) in outs {
                let d = inputs[k].0;
                let Some(slot) = self.slots[decoding[d]].as_mut() else {
                    continue;
                };
                if let Some((pick, q)) = pick_draft(slot, out.logits_row(0), spec.p_min) {
                    drafts[d].push(pick);
                    dists[d].extend(q);
                    chain[d] = out.hidden;
                }
            }
        }

        // The chain's own entries go; the entry for id_last (from the target's hidden) stays.
        for (d, &i) in decoding.iter().enumerate() {
            if !caught_up[d] {
                continue;
            }
            let Some(slot) = self.slots[i].as_mut() else {
                continue;
            };
            let n_past = slot.state.n_past;
            if let Some(h) = slot.head.as_mut() {
                NextnHead::truncate(&mut h.cache, n_past + 1);
                h.pos = n_past + 1;
            }
            if drafts[d].len() < spec.n_min {
                drafts[d].clear();
                dists[d].clear();
            }
        }
        Ok((drafts, dists))
    }

    /// Count the steps each slot went without drafting; with `auto`, drop the head of a slot
    /// that keeps not drafting while its lag grows (it decodes plainly from then on).
    fn track_idle_heads(&mut self, decoding: &[usize], depths: &[usize]) {
        let auto = self
            .spec
            .as_ref()
            .is_some_and(|s| s.policy == DraftPolicy::Auto);
        for (&i, &k) in decoding.iter().zip(depths) {
            let Some(slot) = self.slots[i].as_mut() else {
                continue;
            };
            let Some(h) = slot.head.as_mut() else {
                continue;
            };
            if k > 0 {
                h.idle_steps = 0;
                continue;
            }
            h.idle_steps += 1;
            if auto && h.idle_steps >= ABANDON_IDLE_STEPS && h.lag_tokens.len() >= ABANDON_LAG {
                slot.head = None;
            }
        }
    }

    fn after_prefill(
        &mut self,
        i: usize,
        start: usize,
        end: usize,
        out: &nextn_model::ForwardOutput,
    ) -> Result<(), ModelError> {
        let e = self.engine.model.config.n_embd;
        let Some(slot) = self.slots[i].as_mut() else {
            return Ok(());
        };
        let len = end - start;
        if let Some(h) = slot.head.as_mut() {
            h.lag_tokens.extend_from_slice(&slot.prompt[start..end]);
            h.lag_hidden.extend_from_slice(&h.pending_hidden);
            h.lag_hidden.extend_from_slice(&out.hidden[..(len - 1) * e]);
            h.pending_hidden = out.hidden[(len - 1) * e..len * e].to_vec();
        }
        let last = end == slot.prompt.len();
        let mut m = lock(&self.shared.metrics);
        m.prompt_tokens_total += len as u64;
        if !last {
            slot.stage = Stage::Prefill { next: end };
            return Ok(());
        }
        slot.prompt_ms = ms_since(slot.t_start);
        m.prompt_seconds_total += slot.prompt_ms / 1000.0;
        drop(m);
        slot.t_first_token = Some(Instant::now());
        if slot.out.budget_left() == 0 {
            // max_tokens 0: the prompt only.
            self.finish(i, crate::generate::FinishReason::Length);
            return Ok(());
        }
        let token = slot.sampler.sample(out.logits_row(0));
        slot.sampler.accept(token);
        let n_past = slot.state.n_past;
        if self.emit(i, &[token], n_past) {
            if let Some(slot) = self.slots[i].as_mut() {
                slot.stage = Stage::Decode { id_last: token };
            }
        }
        Ok(())
    }

    /// Accept, commit and emit after a decode or verify row set; returns the commit time (ms).
    fn after_decode(
        &mut self,
        i: usize,
        n_past: usize,
        rows: &[u32],
        dists: &[Vec<TokenProb>],
        out: &nextn_model::ForwardOutput,
    ) -> Result<f64, ModelError> {
        let e = self.engine.model.config.n_embd;
        let Some(slot) = self.slots[i].as_mut() else {
            return Ok(0.0);
        };
        let drafts = &rows[1..];
        let (accepted, next) =
            if slot.sample_drafts && !drafts.is_empty() && dists.len() == drafts.len() {
                accept_sampled(slot, drafts, dists, out)
            } else {
                accept_exact(slot, drafts, out)
            };
        let mut commit_ms = 0.0;
        if !drafts.is_empty() {
            let t = Instant::now();
            self.engine.model.commit(&mut slot.state, accepted + 1)?;
            commit_ms = ms_since(t);
            slot.stats.draft_n += drafts.len() as u64;
            slot.stats.draft_n_accepted += accepted as u64;
            slot.stats.steps += 1;
            slot.stats.counts.record(drafts.len(), accepted);
            slot.stats.counts.decay_to(super::core::SLOT_WINDOW);
            self.global_acc.record(drafts.len(), accepted);
            self.global_acc.decay_to(super::core::GLOBAL_WINDOW);
            let mut m = lock(&self.shared.metrics);
            m.spec_drafts_total += 1;
            m.spec_draft_tokens_total += drafts.len() as u64;
            m.spec_accepted_tokens_total += accepted as u64;
            if m.spec_accepted_per_pos_total.len() < drafts.len() {
                m.spec_accepted_per_pos_total.resize(drafts.len(), 0);
            }
            for p in 0..accepted {
                m.spec_accepted_per_pos_total[p] += 1;
            }
        }
        if let Some(h) = slot.head.as_mut() {
            if h.pos + h.lag_tokens.len() == n_past {
                // No head pass ran for id_last: it joins the lag with the hidden state before it.
                h.lag_tokens.push(rows[0]);
                h.lag_hidden.extend_from_slice(&h.pending_hidden);
            }
            // Head entries for the accepted drafts, from the target's hidden states.
            h.lag_tokens.extend_from_slice(&drafts[..accepted]);
            h.lag_hidden.extend_from_slice(&out.hidden[..accepted * e]);
            h.pending_hidden = out.hidden[accepted * e..(accepted + 1) * e].to_vec();
        }
        let mut emitted: Vec<u32> = drafts[..accepted].to_vec();
        emitted.push(next);
        if self.emit(i, &emitted, n_past + 1) {
            if let Some(slot) = self.slots[i].as_mut() {
                slot.stage = Stage::Decode { id_last: next };
            }
        }
        Ok(commit_ms)
    }

    /// Stream tokens at positions `pos0..`; false once the slot is finished or its client gone.
    fn emit(&mut self, i: usize, tokens: &[u32], pos0: usize) -> bool {
        let n_ctx = self.cfg.n_ctx_slot;
        for (k, &t) in tokens.iter().enumerate() {
            let Some(slot) = self.slots[i].as_mut() else {
                return false;
            };
            let before = slot.out.n_tokens;
            let (piece, finish) = slot.out.push(t, pos0 + k, n_ctx);
            let counted = (slot.out.n_tokens - before) as u64;
            lock(&self.shared.metrics).tokens_predicted_total += counted;
            if !slot.send_text(piece) {
                self.slots[i] = None;
                let busy = self.busy();
                let mut m = lock(&self.shared.metrics);
                m.requests_cancelled_total += 1;
                m.requests_processing = busy;
                return false;
            }
            if let Some(f) = finish {
                self.finish(i, f);
                return false;
            }
        }
        true
    }
}

/// The draft after a head row: its top-1 (or, for sampled drafts, a draw from the head's
/// distribution under the request's sampler, returned too); `None` when the head is not
/// confident enough (`p_min`) and the chain stops.
fn pick_draft(slot: &mut Slot, row: &[f32], p_min: f32) -> Option<(u32, Option<Vec<TokenProb>>)> {
    let top = argmax(row);
    if p_min > 0.0 && top1_probability(row, top) < p_min {
        return None;
    }
    if !slot.sample_drafts {
        return Some((top, None));
    }
    let q = slot.sampler.distribution(row).to_vec();
    let pick = draw(&q, slot.spec_rng.next_f64())?;
    Some((pick, Some(q)))
}

/// Exact-match acceptance: draw t_j from row j with the request's sampler; keep going while it
/// equals the next draft. Returns (accepted drafts, the token after them).
fn accept_exact(slot: &mut Slot, drafts: &[u32], out: &nextn_model::ForwardOutput) -> (usize, u32) {
    let mut accepted = 0;
    let mut next = slot.sampler.sample(out.logits_row(0));
    slot.sampler.accept(next);
    while accepted < drafts.len() && next == drafts[accepted] {
        accepted += 1;
        next = slot.sampler.sample(out.logits_row(accepted));
        slot.sampler.accept(next);
    }
    (accepted, next)
}

/// Speculative sampling: draft j (drawn from q_j) is kept with probability min(1, p_j/q_j) under
/// the target's distribution p_j after the accepted prefix; the first rejection is replaced by a
/// draw from the residual; with every draft kept, the bonus token is drawn from the next row.
fn accept_sampled(
    slot: &mut Slot,
    drafts: &[u32],
    dists: &[Vec<TokenProb>],
    out: &nextn_model::ForwardOutput,
) -> (usize, u32) {
    let mut accepted = 0;
    let mut replacement = None;
    while accepted < drafts.len() {
        let p = slot.sampler.distribution(out.logits_row(accepted)).to_vec();
        match accept_or_resample(&p, &dists[accepted], drafts[accepted], &mut slot.spec_rng) {
            Ok(()) => {
                slot.sampler.accept(drafts[accepted]);
                accepted += 1;
            }
            Err(t) => {
                replacement = Some(t);
                break;
            }
        }
    }
    let next = replacement.unwrap_or_else(|| slot.sampler.sample(out.logits_row(accepted)));
    slot.sampler.accept(next);
    (accepted, next)
}

/// Probability of the top-1 token under the softmax of the whole row.
fn top1_probability(logits: &[f32], top: u32) -> f32 {
    let max = logits[top as usize];
    let sum: f64 = logits.iter().map(|&v| ((v - max) as f64).exp()).sum();
    (1.0 / sum) as f32
}
