//! One step of the generation loop: plan prompt chunks and drafts, draft with the NextN head
//! ([`crate::spec::draft`]), one batched target pass over every busy slot (prefill chunks, decode
//! rows and verify rows alike), then accept ([`crate::spec::accept`]), commit and emit per slot.

use std::time::Instant;

use nextn_model::{BatchItem, ForwardOutput, LogitRows, ModelError};

use super::core::Core;
use super::policy::{plan_auto, DraftCandidate, DraftPolicy, StepShape};
use super::slot::{Slot, Stage};
use super::{lock, Event, FailKind};
use crate::output::{ms_since, FinishReason};
use crate::sampler::{TokenLogprob, TokenMask, TokenProb};
use crate::spec::accept::{accept_coupled, accept_sampled, RowGrammar};
use crate::spec::draft::{draft, DraftJob, Drafts};
use crate::spec::{DraftSampling, StepTrace};

/// A slot's head lag is run in a pass of its own once it reaches this many rows while the slot
/// prefills (under any policy) or decodes without drafting (fixed throttle), so the lag (and the
/// hidden states it keeps, `n_embd` floats a row) stays bounded however long the prompt, and
/// drafting can resume at once when load drops.
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
    /// `[id_last, drafts…]` at positions `n_past..`; `dists[j]`: the distribution draft `j` was
    /// drawn from (sampled drafts only); `masks[j]`: the grammar's mask for row `j`, computed
    /// while drafting.
    Decode {
        n_past: usize,
        rows: Vec<u32>,
        dists: Vec<Vec<TokenProb>>,
        masks: Vec<TokenMask>,
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
            let end = slot.chunk_limit(next).min(next + budget);
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
        let mut drafts = self.draft(&decoding, &depths)?;
        let mut n_drafting = 0;
        let mut n_draft_tokens = 0;
        for (d, &i) in decoding.iter().enumerate() {
            let Some(slot) = self.slots[i].as_mut() else {
                continue;
            };
            let Stage::Decode { id_last } = slot.stage else {
                continue;
            };
            let Drafts {
                tokens,
                dists,
                masks,
                ms,
                ..
            } = std::mem::take(&mut drafts[d]);
            slot.stats.draft_ms += ms;
            let mut rows = Vec::with_capacity(1 + tokens.len());
            rows.push(id_last);
            rows.extend_from_slice(&tokens);
            if !tokens.is_empty() {
                n_drafting += 1;
                n_draft_tokens += tokens.len();
            }
            work[i] = Some(Work::Decode {
                n_past: slot.state.n_past,
                rows,
                dists,
                masks,
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
                .forward_batch(&mut items, self.engine.pool)?
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
                Some(Work::Prefill { start, end }) => self.after_prefill(i, start, end, &out),
                Some(Work::Decode {
                    n_past,
                    rows,
                    dists,
                    masks,
                }) => {
                    if rows.len() > 1 {
                        n_verify += 1;
                    }
                    commit_ms +=
                        self.after_decode(i, n_past, &rows, &dists, &masks, &out, target_ms)?;
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
        match self.cfg.policy {
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
                            accept: s.counts.estimate(&global, super::core::SLOT_PRIOR_WEIGHT),
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
                            .map_or(usize::MAX, |h| h.lag())
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

    /// Run the head for this step (see [`crate::spec::draft::draft`]) over the slots that draft,
    /// the prefilling slots whose head lag has grown long and, with a fixed throttle, the decoding
    /// ones too. Returns the drafts of each decoding slot (aligned with `decoding`).
    fn draft(&mut self, decoding: &[usize], depths: &[usize]) -> Result<Vec<Drafts>, ModelError> {
        let mut drafts: Vec<Drafts> = vec![Drafts::default(); decoding.len()];
        let (Some(head), Some(spec)) = (self.engine.head, self.spec.as_ref()) else {
            return Ok(drafts);
        };
        let flush_idle = matches!(self.cfg.policy, DraftPolicy::MaxSlots(_));
        let mut depth_of_slot: Vec<Option<(usize, usize)>> = vec![None; self.slots.len()];
        for (d, &i) in decoding.iter().enumerate() {
            depth_of_slot[i] = Some((d, depths[d]));
        }
        let mut members = Vec::new();
        let mut jobs = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Some(Slot {
                head: Some(h),
                stage,
                state,
                sampler,
                draft_sampling,
                n_sampled,
                grammar,
                ..
            }) = slot.as_mut()
            else {
                continue;
            };
            let long_lag = h.lag() >= LAG_FLUSH;
            let (d, id_last, n_draft) = match (*stage, depth_of_slot[i]) {
                (Stage::Decode { id_last }, Some((d, n_draft))) => {
                    if n_draft == 0 && !(flush_idle && long_lag) {
                        continue;
                    }
                    (Some(d), id_last, n_draft)
                }
                (Stage::Prefill { .. }, _) if long_lag => (None, 0, 0),
                _ => continue,
            };
            members.push((i, d));
            jobs.push(DraftJob {
                head: h,
                id_last,
                n_past: state.n_past,
                n_draft,
                sampler,
                sample_drafts: *draft_sampling == DraftSampling::Sample,
                // The first draft sits at the output position after id_last.
                first_index: *n_sampled,
                grammar: grammar.as_mut().filter(|_| spec.mask_drafts),
            });
        }
        if jobs.is_empty() {
            return Ok(drafts);
        }
        let (made, passes) = draft(head, &mut jobs, spec, self.cfg.n_batch, self.engine.pool)?;
        for p in passes {
            self.cost.head.observe(p.rows, p.logit_rows, p.ms);
        }
        let n_vocab = self.engine.model.n_vocab;
        for ((i, d), mut m) in members.into_iter().zip(made) {
            match (d, self.slots[i].as_mut()) {
                (Some(d), slot) => {
                    if let Some(s) = slot {
                        if let Some(f) = &s.forced_acceptance {
                            f.apply(s.n_sampled, &mut m.tokens, n_vocab);
                        }
                    }
                    drafts[d] = m
                }
                // A prefilling slot's head work counts as drafting time too.
                (None, Some(slot)) => slot.stats.draft_ms += m.ms,
                (None, None) => {}
            }
        }
        Ok(drafts)
    }

    /// Count the steps each slot went without drafting; with `auto`, drop the head of a slot
    /// that keeps not drafting while its lag grows (it decodes plainly from then on).
    fn track_idle_heads(&mut self, decoding: &[usize], depths: &[usize]) {
        let auto = self.cfg.policy == DraftPolicy::Auto && self.spec.is_some();
        for (&i, &k) in decoding.iter().zip(depths) {
            let Some(slot) = self.slots[i].as_mut() else {
                continue;
            };
            let Some(h) = slot.head.as_ref() else {
                continue;
            };
            if k > 0 {
                slot.idle_steps = 0;
                continue;
            }
            slot.idle_steps += 1;
            if auto && slot.idle_steps >= ABANDON_IDLE_STEPS && h.lag() >= ABANDON_LAG {
                slot.head = None;
            }
        }
    }

    fn after_prefill(&mut self, i: usize, start: usize, end: usize, out: &ForwardOutput) {
        let Some(slot) = self.slots[i].as_mut() else {
            return;
        };
        if let Some(h) = slot.head.as_mut() {
            h.commit(start, &slot.prompt[start..end], &out.hidden);
        }
        let last = end == slot.prompt.len();
        slot.report_prompt_progress(end);
        let keep = slot.cache_prompt && slot.cache_points.contains(&end);
        lock(&self.shared.metrics).prompt_tokens_total += (end - start) as u64;
        if !last {
            slot.stage = Stage::Prefill { next: end };
        }
        if keep {
            if let Some(slot) = self.slots[i].take() {
                self.keep_prefix(&slot);
                self.slots[i] = Some(slot);
            }
        }
        if !last {
            return;
        }
        let Some(slot) = self.slots[i].as_mut() else {
            return;
        };
        let mut m = lock(&self.shared.metrics);
        slot.prompt_ms = ms_since(slot.t_start);
        m.prompt_seconds_total += slot.prompt_ms / 1000.0;
        drop(m);
        slot.t_first_token = Some(Instant::now());
        if slot.out.budget_left() == 0 {
            // max_tokens 0: the prompt only.
            self.finish(i, FinishReason::Length);
            return;
        }
        let grammar = slot.grammar.as_mut().map(|g| RowGrammar {
            constraint: g,
            masks: &[],
        });
        let accepted = accept_coupled(&mut slot.sampler, &[], out, slot.n_sampled, grammar);
        let token = match accepted {
            Ok((_, t)) => t,
            Err(e) => return self.fail(i, &e.to_string()),
        };
        slot.n_sampled += 1;
        let n_past = slot.state.n_past;
        if self.emit(i, &[token], n_past, out) {
            if let Some(slot) = self.slots[i].as_mut() {
                slot.stage = Stage::Decode { id_last: token };
            }
        }
    }

    /// Accept, commit and emit after a decode or verify row set; returns the commit time (ms).
    #[allow(clippy::too_many_arguments)]
    fn after_decode(
        &mut self,
        i: usize,
        n_past: usize,
        rows: &[u32],
        dists: &[Vec<TokenProb>],
        masks: &[TokenMask],
        out: &ForwardOutput,
        target_ms: f64,
    ) -> Result<f64, ModelError> {
        let t = Instant::now();
        let Some(slot) = self.slots[i].as_mut() else {
            return Ok(0.0);
        };
        let drafts = &rows[1..];
        let grammar = slot.grammar.as_mut().map(|g| RowGrammar {
            constraint: g,
            masks,
        });
        let result = match slot.draft_sampling {
            DraftSampling::Sample if !drafts.is_empty() => accept_sampled(
                &mut slot.sampler,
                drafts,
                dists,
                out,
                slot.n_sampled,
                grammar,
            ),
            _ => accept_coupled(&mut slot.sampler, drafts, out, slot.n_sampled, grammar),
        };
        let (accepted, next) = match result {
            Ok(x) => x,
            Err(e) => {
                // The verify rows are still pending: drop them with the request.
                self.engine.model.commit(&mut slot.state, 0)?;
                self.fail(i, &e.to_string());
                return Ok(0.0);
            }
        };
        slot.n_sampled += accepted as u64 + 1;
        let mut commit_ms = 0.0;
        if !drafts.is_empty() {
            let tc = Instant::now();
            self.engine.model.commit(&mut slot.state, accepted + 1)?;
            commit_ms = ms_since(tc);
            slot.stats.record(drafts.len(), accepted);
            slot.counts.record(drafts.len(), accepted);
            slot.counts.decay_to(super::core::SLOT_WINDOW);
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
        if slot.trace {
            slot.stats.trace.push(StepTrace {
                n_past,
                id_last: rows[0],
                drafts: drafts.to_vec(),
                accepted,
            });
        }
        let e = self.engine.model.config.n_embd;
        if let Some(h) = slot.head.as_mut() {
            // Head entries for id_last (unless its draft step made it) and the accepted drafts,
            // from the target's hidden states.
            h.commit(
                n_past,
                &rows[..accepted + 1],
                &out.hidden[..(accepted + 1) * e],
            );
        }
        if self.spec.is_some() {
            slot.stats.verify_ms += target_ms + ms_since(t);
        }
        let mut emitted: Vec<u32> = drafts[..accepted].to_vec();
        emitted.push(next);
        if self.emit(i, &emitted, n_past + 1, out) {
            if let Some(slot) = self.slots[i].as_mut() {
                slot.stage = Stage::Decode { id_last: next };
            }
        }
        Ok(commit_ms)
    }

    /// End one request with an error; the others go on.
    fn fail(&mut self, i: usize, message: &str) {
        let Some(mut slot) = self.slots[i].take() else {
            return;
        };
        slot.sink.send(Event::Failed {
            kind: FailKind::Internal,
            message: format!("generation failed: {message}"),
        });
        let busy = self.busy();
        let mut m = lock(&self.shared.metrics);
        m.requests_cancelled_total += 1;
        m.requests_processing = busy;
    }

    /// Stream tokens at positions `pos0..`, token `k` drawn from row `k` of `out`; false once the
    /// slot is finished or its client gone. A grammar that is complete ends the output.
    fn emit(&mut self, i: usize, tokens: &[u32], pos0: usize, out: &ForwardOutput) -> bool {
        let n_ctx = self.cfg.n_ctx_slot;
        let grammar_done = self.slots[i]
            .as_ref()
            .and_then(|s| s.grammar.as_ref())
            .is_some_and(|g| g.is_finished());
        for (k, &t) in tokens.iter().enumerate() {
            let Some(slot) = self.slots[i].as_mut() else {
                return false;
            };
            if let Some(n) = slot.logprobs {
                let lp = TokenLogprob::of(out.logits_row(k), t, n);
                if !slot.sink.send(Event::Logprobs(vec![lp])) {
                    return self.drop_slot(i);
                }
            }
            let before = slot.out.n_tokens();
            let (piece, finish) = slot.out.push(t, pos0 + k, n_ctx);
            let counted = (slot.out.n_tokens() - before) as u64;
            lock(&self.shared.metrics).tokens_predicted_total += counted;
            if !slot.send_text(piece) {
                return self.drop_slot(i);
            }
            let last = k + 1 == tokens.len();
            match finish {
                Some(f) => {
                    self.finish(i, f);
                    return false;
                }
                None if last && grammar_done => {
                    self.finish(i, FinishReason::Stop);
                    return false;
                }
                None => {}
            }
        }
        true
    }

    /// Free the slot of a client that went away.
    fn drop_slot(&mut self, i: usize) -> bool {
        self.slots[i] = None;
        let busy = self.busy();
        let mut m = lock(&self.shared.metrics);
        m.requests_cancelled_total += 1;
        m.requests_processing = busy;
        false
    }
}
