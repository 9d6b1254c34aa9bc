//! One step of the generation loop, as a pipeline over data:
//!
//! 1. **plan** ([`super::policy::Planner::plan`]): prompt chunks, each decoding slot's draft
//!    depth, whose head catches up without drafting and whose head is retired;
//! 2. **draft** ([`crate::speculative::speculator::draft_batch`]): the NextN head over every
//!    slot that drafts or catches up, one batched pass per depth;
//! 3. **target pass**: one [`nextn_model::Model::forward_batch`] over every busy slot's rows
//!    (prompt chunks, decode rows and verify rows alike);
//! 4. **settle** ([`crate::speculative::speculator::Speculator::settle`]): per slot, accept,
//!    draw the next token and commit the target's state and the head's together;
//! 5. **emit**: stream the kept tokens' text and find where requests end;
//! 6. **record** ([`StepReport`]): statistics, acceptance counts, cost model and metrics, once;
//!
//! and then the requests that ended are finished.

use std::time::Instant;

use nextn_model::{BatchItem, ForwardOutput, LogitRows, ModelError, Readback};

use super::core::Core;
use super::policy::{SlotView, StepPlan, ViewStage, SLOT_WINDOW};
use super::slot::{Encoding, Slot, Stage};
use super::{lock, Event, FailKind};
use crate::output::{ms_since, FinishReason, GrammarEnd};
use crate::sampler::{Distribution, TokenLogprob, TokenMask};
use crate::speculative::accept::Accepted;
use crate::speculative::draft::{Drafts, HeadPass};
use crate::speculative::speculator::{draft_batch, DraftRequest, SettleError, VerifyRows};
use crate::speculative::StepTrace;

/// What one slot contributes to this step's target pass.
enum Work {
    Prefill {
        start: usize,
        end: usize,
    },
    /// The prompt's image `index` (its rows start at `start`), run through the target on its own
    /// ([`nextn_model::Model::forward_image`]) with the embeddings the encoder thread made; `embd`
    /// holds them once the target has run, for the head to take too.
    Image {
        index: usize,
        start: usize,
        embd: Vec<f32>,
    },
    /// `[id_last, drafts…]` at positions `n_past..`; `dists[j]`: the distribution draft `j` was
    /// drawn from (sampled drafts only); `masks[j]`: the grammar's mask for row `j`, computed
    /// while drafting.
    Decode {
        n_past: usize,
        rows: Vec<u32>,
        dists: Vec<Distribution>,
        masks: Vec<TokenMask>,
    },
}

/// What of a slot's logits rows comes back from the target pass: only the top-1 when every token
/// drawn from them is the row's argmax (greedy, no penalty or logit bias, no grammar) and no log
/// probabilities are sent; the whole rows otherwise.
fn target_readback(slot: &Slot) -> Readback {
    if slot.sampler.draws_argmax() && slot.grammar.is_none() && slot.logprobs.is_none() {
        Readback::Top1
    } else {
        Readback::Logits
    }
}

/// Tokens to stream for one slot after settling: token `k` was drawn from row `k` of its target
/// output and sits at position `pos0 + k`.
struct Emission {
    slot: usize,
    /// Index of the slot's output in the target pass.
    out: usize,
    tokens: Vec<u32>,
    pos0: usize,
    /// The output ends after these tokens whatever they are (the grammar admits nothing more,
    /// or the request asked for no tokens at all).
    then_end: Option<(FinishReason, Option<GrammarEnd>)>,
}

/// A request that ends this step.
struct Ending {
    slot: usize,
    finish: FinishReason,
    grammar_end: Option<GrammarEnd>,
}

/// Everything a step measured and decided, folded into the statistics, the acceptance counts,
/// the cost model and the metrics by [`Core::record`].
#[derive(Default)]
pub(super) struct StepReport {
    busy: usize,
    /// The target pass: rows, rows with logits, milliseconds.
    target: (usize, usize, f64),
    head_passes: Vec<HeadPass>,
    drafting_slots: usize,
    draft_tokens: usize,
    prompt_rows: u64,
    /// Seconds from admission to the first token of the prompts finished this step.
    prompt_seconds: f64,
    tokens_predicted: u64,
    /// Head time per slot that took part in drafting.
    draft_ms: Vec<(usize, f64)>,
    verified: Vec<VerifyReport>,
    /// Decoding slots settled, and the milliseconds of settle and emit over all of them.
    n_decoding: usize,
    post_ms: f64,
}

/// One decoding slot's settled row set.
struct VerifyReport {
    slot: usize,
    n_past: usize,
    /// `[id_last, drafts…]`.
    rows: Vec<u32>,
    accepted: usize,
    commit_ms: f64,
    settle_ms: f64,
}

impl<'e> Core<'e> {
    pub(super) fn step(&mut self) -> Result<(), ModelError> {
        let mut report = StepReport {
            busy: self.busy(),
            ..StepReport::default()
        };
        let plan = self.plan();
        let mut work = self.draft(&plan, &mut report)?;
        let mut outs = self.target_pass(&work, &mut report)?;
        outs.extend(self.image_pass(&mut work, &mut report));
        let t_post = Instant::now();
        let emissions = self.settle(&mut work, &outs, &mut report)?;
        let endings = self.emit_all(emissions, &outs, &mut report);
        report.post_ms = ms_since(t_post);
        self.record(report);
        for e in endings {
            self.finish(e.slot, e.finish, e.grammar_end);
        }
        Ok(())
    }

    /// The plan of this step, applied to the slots' speculators (idle counts, retired heads).
    fn plan(&mut self) -> StepPlan {
        let views: Vec<SlotView> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(index, s)| {
                // A slot waiting for its image's embeddings takes no part in the step.
                let s = s.as_ref().filter(|s| !s.waits_for_image())?;
                let stage = match s.stage {
                    Stage::Prefill { next } => ViewStage::Prefill {
                        next,
                        chunk_limit: s.chunk_limit(next),
                        prompt_len: s.prompt.len(),
                        head_lag: s.spec.head_lag(),
                    },
                    Stage::Decode { .. } => ViewStage::Decode {
                        // Room for [id_last, drafts] in the context and in the token budget (the
                        // bonus token counts).
                        room: s
                            .state
                            .remaining()
                            .saturating_sub(1)
                            .min(s.out.budget_left().saturating_sub(1)),
                        head_lag: s.spec.head_lag(),
                        idle_steps: s.spec.idle_steps(),
                        acceptance: s.spec.acceptance(),
                    },
                };
                Some(SlotView {
                    index,
                    seq_no: s.seq_no,
                    stage,
                })
            })
            .collect();
        let plan = self.planner.plan(&self.cost, &views);
        for &(i, depth) in &plan.decode {
            if let Some(slot) = self.slots[i].as_mut() {
                slot.spec.planned(depth);
            }
        }
        for &i in &plan.retire {
            if let Some(slot) = self.slots[i].as_mut() {
                slot.spec.retire_head();
            }
        }
        plan
    }

    /// Run the head for the slots that draft or catch up, and lay out every slot's rows of the
    /// target pass.
    fn draft(
        &mut self,
        plan: &StepPlan,
        report: &mut StepReport,
    ) -> Result<Vec<Option<Work>>, ModelError> {
        let mut work: Vec<Option<Work>> = (0..self.slots.len()).map(|_| None).collect();
        for c in &plan.prompt {
            let image = self.slots[c.slot]
                .as_ref()
                .and_then(|s| s.image_index_at(c.start));
            work[c.slot] = Some(match image {
                Some(index) => Work::Image {
                    index,
                    start: c.start,
                    embd: Vec::new(),
                },
                None => Work::Prefill {
                    start: c.start,
                    end: c.end,
                },
            });
        }
        let mut depth_of = vec![0usize; self.slots.len()];
        for &(i, depth) in &plan.decode {
            depth_of[i] = depth;
        }
        let mut made_by_slot: Vec<Option<Drafts>> = vec![None; self.slots.len()];
        if let (Some(head), Some(spec)) = (self.engine.head, self.spec.as_ref()) {
            let mut members = Vec::new();
            let mut requests = Vec::new();
            for (i, slot) in self.slots.iter_mut().enumerate() {
                let Some(slot) = slot.as_mut() else {
                    continue;
                };
                let (id_last, n_draft) = match slot.stage {
                    Stage::Decode { id_last } if depth_of[i] > 0 => (id_last, depth_of[i]),
                    Stage::Decode { id_last } if plan.catch_up.contains(&i) => (id_last, 0),
                    Stage::Prefill { .. } if plan.catch_up.contains(&i) => (0, 0),
                    _ => continue,
                };
                if !slot.spec.has_head() {
                    continue;
                }
                let Slot {
                    spec: speculator,
                    state,
                    sampler,
                    n_sampled,
                    grammar,
                    ..
                } = slot;
                members.push(i);
                requests.push(DraftRequest {
                    speculator,
                    id_last,
                    n_past: state.n_past,
                    n_draft,
                    sampler,
                    // The first draft sits at the output position after id_last.
                    first_index: *n_sampled,
                    grammar: grammar.as_mut().filter(|_| spec.mask_drafts),
                });
            }
            let n_vocab = self.engine.model.n_vocab;
            let (made, passes) = draft_batch(
                head,
                requests,
                spec,
                self.cfg.n_batch,
                n_vocab,
                self.engine.pool,
            )?;
            report.head_passes = passes;
            for (i, d) in members.into_iter().zip(made) {
                made_by_slot[i] = Some(d);
            }
        }
        for &(i, _) in &plan.decode {
            let Some(slot) = self.slots[i].as_ref() else {
                continue;
            };
            let Stage::Decode { id_last } = slot.stage else {
                continue;
            };
            let made = made_by_slot[i].take();
            let Drafts {
                tokens,
                dists,
                masks,
                ms,
                ..
            } = made.unwrap_or_default();
            report.draft_ms.push((i, ms));
            if !tokens.is_empty() {
                report.drafting_slots += 1;
                report.draft_tokens += tokens.len();
            }
            let mut rows = Vec::with_capacity(1 + tokens.len());
            rows.push(id_last);
            rows.extend_from_slice(&tokens);
            work[i] = Some(Work::Decode {
                n_past: slot.state.n_past,
                rows,
                dists,
                masks,
            });
        }
        // A prefilling slot's head work counts as drafting time too.
        report.draft_ms.extend(
            made_by_slot
                .into_iter()
                .enumerate()
                .filter_map(|(i, d)| Some((i, d?.ms))),
        );
        Ok(work)
    }

    /// One target pass over every slot's rows; the outputs in slot order.
    fn target_pass(
        &mut self,
        work: &[Option<Work>],
        report: &mut StepReport,
    ) -> Result<Vec<(usize, ForwardOutput)>, ModelError> {
        let t = Instant::now();
        let mut order = Vec::new();
        let mut n_rows = 0;
        let mut n_logit_rows = 0;
        let mut items = Vec::new();
        for (i, (slot, w)) in self.slots.iter_mut().zip(work).enumerate() {
            let (Some(slot), Some(w)) = (slot.as_mut(), w.as_ref()) else {
                continue;
            };
            let readback = target_readback(slot);
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
                    readback,
                    verify: false,
                },
                Work::Decode { rows, .. } if rows.len() > 1 => BatchItem {
                    tokens: rows,
                    state,
                    logits: LogitRows::All,
                    readback,
                    verify: true,
                },
                Work::Decode { rows, .. } => BatchItem {
                    tokens: rows,
                    state,
                    logits: LogitRows::Last,
                    readback,
                    verify: false,
                },
                Work::Image { .. } => continue,
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
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let outs = self
            .engine
            .model
            .forward_batch(&mut items, self.engine.pool)?;
        report.target = (n_rows, n_logit_rows, ms_since(t));
        Ok(order.into_iter().zip(outs).collect())
    }

    /// Run each image of this step (encoded by the encoder thread) through the target, one image
    /// at a time. A request whose image fails ends with the error; the others go on.
    fn image_pass(
        &mut self,
        work: &mut [Option<Work>],
        report: &mut StepReport,
    ) -> Vec<(usize, ForwardOutput)> {
        let mut outs = Vec::new();
        for (i, w) in work.iter_mut().enumerate() {
            let Some(Work::Image { index, embd, .. }) = w.as_mut() else {
                continue;
            };
            match self.run_image(i, *index, report) {
                Ok((e, out)) => {
                    *embd = e;
                    outs.push((i, out));
                }
                Err(message) => {
                    *w = None;
                    self.fail(i, &message);
                }
            }
        }
        outs
    }

    /// Slot `i`'s image `index`: its embeddings (from the encoder) and the target's output over
    /// its rows.
    fn run_image(
        &mut self,
        i: usize,
        index: usize,
        report: &mut StepReport,
    ) -> Result<(Vec<f32>, ForwardOutput), String> {
        let (model, pool) = (self.engine.model, self.engine.pool);
        let slot = self.slots[i].as_mut().ok_or("the slot is gone")?;
        let image = slot.images[index].clone();
        let emb = match std::mem::replace(&mut slot.encodings[index], Encoding::NotNeeded) {
            Encoding::Ready(emb) => emb,
            Encoding::Waiting | Encoding::NotNeeded => {
                return Err(format!(
                    "image {index} reached the target without its embeddings"
                ))
            }
        };
        if (emb.nx, emb.ny) != (image.nx, image.ny) {
            return Err(format!(
                "image {index} encoded to {}x{} tokens, but the prompt gave it {}x{}",
                emb.nx, emb.ny, image.nx, image.ny
            ));
        }
        let logits = if image.end() == slot.prompt.len() {
            LogitRows::Last
        } else {
            LogitRows::None
        };
        let out = model
            .forward_image(&emb.data, emb.nx, emb.ny, &mut slot.state, logits, pool)
            .map_err(|e| format!("image {index}: {e}"))?;
        report.prompt_rows += image.n_tokens() as u64;
        Ok((emb.data, out))
    }

    /// Settle every slot's rows: prompt chunks go into the head's lag (and the cache points into
    /// the prefix cache), a finished prompt and every decode row set yield the tokens to emit.
    fn settle(
        &mut self,
        work: &mut [Option<Work>],
        outs: &[(usize, ForwardOutput)],
        report: &mut StepReport,
    ) -> Result<Vec<Emission>, ModelError> {
        let mut emissions = Vec::new();
        for (k, (i, out)) in outs.iter().enumerate() {
            let i = *i;
            let emission = match work[i].take() {
                Some(Work::Prefill { start, end }) => {
                    report.prompt_rows += (end - start) as u64;
                    self.settle_prompt(i, start, end, out, report, None)
                }
                Some(Work::Image { index, start, embd }) => {
                    let end = self.slots[i]
                        .as_ref()
                        .map_or(start, |s| s.images[index].end());
                    self.settle_prompt(i, start, end, out, report, Some((index, embd)))
                }
                Some(Work::Decode {
                    n_past,
                    rows,
                    dists,
                    masks,
                }) => {
                    report.n_decoding += 1;
                    self.settle_decode(i, n_past, rows, dists, &masks, out, report)?
                }
                None => None,
            };
            emissions.extend(emission.map(|e| Emission { out: k, ..e }));
        }
        Ok(emissions)
    }

    /// A prompt chunk `start..end` went through the target; `image`: it was the prompt's image
    /// of that index, with its embeddings.
    fn settle_prompt(
        &mut self,
        i: usize,
        start: usize,
        end: usize,
        out: &ForwardOutput,
        report: &mut StepReport,
        image: Option<(usize, Vec<f32>)>,
    ) -> Option<Emission> {
        let (head, pool) = (self.engine.head, self.engine.pool);
        let slot = self.slots[i].as_mut()?;
        let last = end == slot.prompt.len();
        let Slot {
            spec,
            prompt,
            images,
            sampler,
            grammar,
            ..
        } = slot;
        let first = last.then_some((sampler, grammar.as_mut()));
        let settled = match image {
            None => spec
                .settle_prompt(start, &prompt[start..end], out, first)
                .map_err(|e| e.to_string()),
            Some((index, embd)) => spec
                .settle_image(head, start, &images[index], &embd, out, first, pool)
                .map(|(accepted, ms)| {
                    report.draft_ms.push((i, ms));
                    accepted
                })
                .map_err(|e| e.to_string()),
        };
        if let (false, Err(e)) = (last, &settled) {
            let e = e.clone();
            self.fail(i, &e);
            return None;
        }
        let slot = self.slots[i].as_mut()?;
        slot.report_prompt_progress(end);
        if !last {
            slot.stage = Stage::Prefill { next: end };
        }
        if slot.cache_prompt && slot.cache_points.contains(&end) {
            if let Some(slot) = self.slots[i].take() {
                self.keep_prefix(&slot);
                self.slots[i] = Some(slot);
            }
        }
        if !last {
            return None;
        }
        let slot = self.slots[i].as_mut()?;
        slot.prompt_ms = ms_since(slot.t_start);
        report.prompt_seconds += slot.prompt_ms / 1000.0;
        slot.t_first_token = Some(Instant::now());
        if slot.out.budget_left() == 0 {
            // max_tokens 0: the prompt only.
            return Some(Emission {
                slot: i,
                out: 0,
                tokens: Vec::new(),
                pos0: slot.state.n_past,
                then_end: Some((FinishReason::Length, None)),
            });
        }
        let accepted = match settled {
            Ok(a) => a?,
            Err(e) => {
                self.fail(i, &e);
                return None;
            }
        };
        slot.n_sampled += 1;
        Some(Emission {
            slot: i,
            out: 0,
            tokens: accepted.next.into_iter().collect(),
            pos0: slot.state.n_past,
            then_end: dead_end(accepted),
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn settle_decode(
        &mut self,
        i: usize,
        n_past: usize,
        rows: Vec<u32>,
        dists: Vec<Distribution>,
        masks: &[TokenMask],
        out: &ForwardOutput,
        report: &mut StepReport,
    ) -> Result<Option<Emission>, ModelError> {
        let t = Instant::now();
        let Some(slot) = self.slots[i].as_mut() else {
            return Ok(None);
        };
        let rows = resolve_drafts(rows, out);
        let verify = VerifyRows {
            n_past,
            rows: &rows,
            dists: &dists,
            masks,
            out,
        };
        let settled = slot.spec.settle(
            self.engine.model,
            &mut slot.state,
            &mut slot.sampler,
            slot.grammar.as_mut(),
            slot.n_sampled,
            verify,
        );
        slot.sampler.recycle(dists);
        let settled = match settled {
            Ok(s) => s,
            Err(SettleError::Model(e)) => return Err(e),
            Err(SettleError::Grammar(e)) => {
                self.fail(i, &e.to_string());
                return Ok(None);
            }
        };
        let Accepted { drafts, next } = settled.accepted;
        slot.n_sampled += drafts as u64 + u64::from(next.is_some());
        let mut tokens = rows[1..=drafts].to_vec();
        tokens.extend(next);
        report.verified.push(VerifyReport {
            slot: i,
            n_past,
            rows,
            accepted: drafts,
            commit_ms: settled.commit_ms,
            settle_ms: ms_since(t),
        });
        Ok(Some(Emission {
            slot: i,
            out: 0,
            tokens,
            pos0: n_past + 1,
            then_end: dead_end(settled.accepted),
        }))
    }

    /// Stream every slot's tokens; the requests that end.
    fn emit_all(
        &mut self,
        emissions: Vec<Emission>,
        outs: &[(usize, ForwardOutput)],
        report: &mut StepReport,
    ) -> Vec<Ending> {
        let mut endings = Vec::new();
        for e in emissions {
            let out = &outs[e.out].1;
            match self.emit(e.slot, &e.tokens, e.pos0, out, report) {
                Emitted::Ends(finish, grammar_end) => endings.push(Ending {
                    slot: e.slot,
                    finish,
                    grammar_end,
                }),
                Emitted::Gone => {}
                Emitted::Continue(_) if e.then_end.is_some() => {
                    if let Some((finish, grammar_end)) = e.then_end {
                        endings.push(Ending {
                            slot: e.slot,
                            finish,
                            grammar_end,
                        });
                    }
                }
                Emitted::Continue(Some(next)) => {
                    if let Some(slot) = self.slots[e.slot].as_mut() {
                        slot.stage = Stage::Decode { id_last: next };
                    }
                }
                Emitted::Continue(None) => {}
            }
        }
        endings
    }

    /// Stream tokens at positions `pos0..`, token `k` drawn from row `k` of `out`. A grammar
    /// that is complete ends the output.
    fn emit(
        &mut self,
        i: usize,
        tokens: &[u32],
        pos0: usize,
        out: &ForwardOutput,
        report: &mut StepReport,
    ) -> Emitted {
        let n_ctx = self.cfg.n_ctx_slot;
        let grammar_done = self.slots[i]
            .as_ref()
            .and_then(|s| s.grammar.as_ref())
            .is_some_and(|g| g.is_finished());
        for (k, &t) in tokens.iter().enumerate() {
            let Some(slot) = self.slots[i].as_mut() else {
                return Emitted::Gone;
            };
            if let Some(n) = slot.logprobs {
                let lp = TokenLogprob::of(out.logits_row(k), t, n);
                if !slot.sink.send(Event::Logprobs(vec![lp])) {
                    return self.drop_slot(i);
                }
            }
            let before = slot.out.n_tokens();
            let (piece, finish) = slot.out.push(t, pos0 + k, n_ctx);
            report.tokens_predicted += (slot.out.n_tokens() - before) as u64;
            if !slot.send_text(piece) {
                return self.drop_slot(i);
            }
            let last = k + 1 == tokens.len();
            match finish {
                Some(f) => return Emitted::Ends(f, None),
                None if last && grammar_done => {
                    return Emitted::Ends(FinishReason::Stop, Some(GrammarEnd::Complete))
                }
                None => {}
            }
        }
        Emitted::Continue(tokens.last().copied())
    }

    /// Fold one step's report into the request statistics, the acceptance counts, the cost model
    /// and the metrics.
    fn record(&mut self, report: StepReport) {
        let StepReport {
            busy,
            target: (n_rows, n_logit_rows, target_ms),
            head_passes,
            drafting_slots,
            draft_tokens,
            prompt_rows,
            prompt_seconds,
            tokens_predicted,
            draft_ms,
            verified,
            n_decoding,
            post_ms,
        } = report;
        self.cost.target.observe(n_rows, n_logit_rows, target_ms);
        for p in &head_passes {
            self.cost.head.observe(p.rows, p.logit_rows, p.ms);
        }
        for (i, ms) in draft_ms {
            if let Some(slot) = self.slots[i].as_mut() {
                slot.stats.draft_ms += ms;
            }
        }
        let speculative = self.spec.is_some();
        let mut accepted_per_pos: Vec<u64> = Vec::new();
        let (mut n_verify, mut commit_ms) = (0, 0.0);
        let (mut spec_steps, mut spec_drafted, mut spec_accepted) = (0u64, 0u64, 0u64);
        for v in verified {
            let drafted = v.rows.len() - 1;
            if drafted > 0 {
                n_verify += 1;
                commit_ms += v.commit_ms;
                self.planner.record(drafted, v.accepted);
                spec_steps += 1;
                spec_drafted += drafted as u64;
                spec_accepted += v.accepted as u64;
                if accepted_per_pos.len() < drafted {
                    accepted_per_pos.resize(drafted, 0);
                }
                accepted_per_pos[..v.accepted]
                    .iter_mut()
                    .for_each(|c| *c += 1);
            }
            let Some(slot) = self.slots[v.slot].as_mut() else {
                continue;
            };
            if drafted > 0 {
                slot.stats.record(drafted, v.accepted);
                slot.spec.record(drafted, v.accepted, SLOT_WINDOW);
            }
            if speculative {
                slot.stats.verify_ms += target_ms + v.settle_ms;
            }
            if slot.trace {
                slot.stats.trace.push(StepTrace {
                    n_past: v.n_past,
                    id_last: v.rows[0],
                    drafts: v.rows[1..].to_vec(),
                    accepted: v.accepted,
                });
            }
        }
        if n_verify > 0 {
            self.cost.observe_commit(n_verify, commit_ms);
        }
        if n_decoding > 0 {
            self.cost.observe_per_slot(n_decoding, post_ms - commit_ms);
        }
        let mut m = lock(&self.shared.metrics);
        m.n_decode_total += 1;
        m.n_busy_slots_total += busy as u64;
        m.last_step_rows = n_rows;
        m.last_step_ms = target_ms;
        m.last_step_drafting_slots = drafting_slots;
        m.last_step_draft_tokens = draft_tokens;
        m.prompt_tokens_total += prompt_rows;
        m.prompt_seconds_total += prompt_seconds;
        m.tokens_predicted_total += tokens_predicted;
        m.spec_drafts_total += spec_steps;
        m.spec_draft_tokens_total += spec_drafted;
        m.spec_accepted_tokens_total += spec_accepted;
        if m.spec_accepted_per_pos_total.len() < accepted_per_pos.len() {
            m.spec_accepted_per_pos_total
                .resize(accepted_per_pos.len(), 0);
        }
        for (total, n) in m
            .spec_accepted_per_pos_total
            .iter_mut()
            .zip(accepted_per_pos)
        {
            *total += n;
        }
    }

    /// End one request with an error; the others go on. A grammar that runs into a dead end is
    /// not an error: the request stops there ([`GrammarEnd::DeadEnd`]).
    pub(super) fn fail(&mut self, i: usize, message: &str) {
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

    /// Free the slot of a client that went away.
    fn drop_slot(&mut self, i: usize) -> Emitted {
        self.slots[i] = None;
        let busy = self.busy();
        let mut m = lock(&self.shared.metrics);
        m.requests_cancelled_total += 1;
        m.requests_processing = busy;
        Emitted::Gone
    }
}

/// The verified rows `[id_last, drafts…]` with the drafts the device drafted and kept there
/// replaced by what the target pass read back ([`ForwardOutput::tokens`]), the chain cut before a
/// draft that came to no token (its row and those after it stay unused and uncommitted).
fn resolve_drafts(mut rows: Vec<u32>, out: &ForwardOutput) -> Vec<u32> {
    if out.tokens.is_empty() {
        return rows;
    }
    for i in 0..rows.len() {
        match out.tokens.get(i).copied().flatten() {
            Some(t) => rows[i] = t,
            None => {
                rows.truncate(i.max(1));
                break;
            }
        }
    }
    rows
}

/// The end of a request whose grammar admits no token after what was accepted.
fn dead_end(accepted: Accepted) -> Option<(FinishReason, Option<GrammarEnd>)> {
    accepted
        .next
        .is_none()
        .then_some((FinishReason::Stop, Some(GrammarEnd::DeadEnd)))
}

/// What streaming a slot's tokens came to.
enum Emitted {
    /// The request goes on; the last token streamed (the next `id_last`).
    Continue(Option<u32>),
    /// The request ends after the tokens streamed.
    Ends(FinishReason, Option<GrammarEnd>),
    /// The client went away; the slot is free.
    Gone,
}
