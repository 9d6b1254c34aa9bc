//! One slot's side of speculative decoding: the NextN head's state, how its drafts are picked,
//! the acceptance it measured, and the two operations a step runs on it: batched drafting
//! ([`draft_batch`]) and [`Speculator::settle`], which accepts a verified row set and commits the
//! target's state and the head's together, so the two never stand at different positions.

use std::time::Instant;

use nextn_model::{ForwardOutput, Model, ModelError, NextnHead, SequenceState};
use nextn_quant::kernels::ThreadPool;

use super::accept::{accept_coupled, accept_sampled, Accepted, RowGrammar};
use super::draft::{draft, DraftJob, Drafts, HeadPass, HeadState};
use super::forced::ForcedAcceptance;
use super::{AcceptanceCounts, DraftSampling, SpecConfig};
use crate::grammar::{Constraint, GrammarError};
use crate::output::ms_since;
use crate::sampler::{Distribution, Sampler, TokenMask};

/// A slot's speculative state.
pub struct Speculator {
    /// The NextN head's side; `None` decodes plainly (no head, or retired by the policy).
    head: Option<HeadState>,
    sampling: DraftSampling,
    forced: Option<ForcedAcceptance>,
    /// Windowed acceptance counts, for the `auto` policy.
    counts: AcceptanceCounts,
    /// Decode steps since the slot last drafted.
    idle_steps: usize,
}

/// The rows a decoding slot sent through the target pass: `[id_last, drafts…]` at positions
/// `n_past..`, with what drafting left for acceptance.
pub struct VerifyRows<'a> {
    pub n_past: usize,
    pub rows: &'a [u32],
    /// The distribution each draft was drawn from (sampled drafts only).
    pub dists: &'a [Distribution],
    /// The grammar's mask for each row, computed while drafting.
    pub masks: &'a [TokenMask],
    /// The target pass's output for the rows.
    pub out: &'a ForwardOutput,
}

/// What a settled decode step kept.
#[derive(Clone, Copy, Debug)]
pub struct Settled {
    pub accepted: Accepted,
    /// Milliseconds of rolling the target's state back to the kept rows (0 without drafts).
    pub commit_ms: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum SettleError {
    #[error(transparent)]
    Grammar(#[from] GrammarError),
    #[error(transparent)]
    Model(#[from] ModelError),
}

impl Speculator {
    /// `head`: the head's state at the sequence's position, `None` to decode plainly.
    pub fn new(
        head: Option<HeadState>,
        sampling: DraftSampling,
        forced: Option<ForcedAcceptance>,
        n_max: usize,
    ) -> Self {
        Speculator {
            head,
            sampling,
            forced,
            counts: AcceptanceCounts::new(n_max),
            idle_steps: 0,
        }
    }

    pub fn has_head(&self) -> bool {
        self.head.is_some()
    }

    /// Committed positions the head still owes an entry for (`None` without a head).
    pub fn head_lag(&self) -> Option<usize> {
        self.head.as_ref().map(HeadState::lag)
    }

    /// Decode steps since the slot last drafted.
    pub fn idle_steps(&self) -> usize {
        self.idle_steps
    }

    pub fn acceptance(&self) -> &AcceptanceCounts {
        &self.counts
    }

    /// This step drafts `depth` tokens (0: none).
    pub fn planned(&mut self, depth: usize) {
        if self.head.is_none() {
            return;
        }
        self.idle_steps = if depth > 0 { 0 } else { self.idle_steps + 1 };
    }

    /// Stop tracking the head: the slot decodes plainly for the rest of its request.
    pub fn retire_head(&mut self) {
        self.head = None;
    }

    /// One verify step offered `drafted` drafts and kept `accepted`; counts keep about `window`
    /// steps per position.
    pub fn record(&mut self, drafted: usize, accepted: usize, window: f64) {
        self.counts.record(drafted, accepted);
        self.counts.decay_to(window);
    }

    /// A copy of the head's state standing exactly at `n_past` (for the prefix cache), if it can.
    pub fn head_at(&self, n_past: usize) -> Option<HeadState> {
        self.head
            .clone()
            .and_then(|mut h| h.rewind(n_past).then_some(h))
    }

    /// The head's state standing exactly at `n_past`, if it can (a slot keeping its state).
    pub fn into_head_at(self, n_past: usize) -> Option<HeadState> {
        self.head.and_then(|mut h| h.rewind(n_past).then_some(h))
    }

    /// A prompt chunk `tokens` at positions `start..` went through the target (`out` holds its
    /// hidden rows). The head records the rows as lag; after the last chunk the first output
    /// token is drawn from the chunk's logits row.
    pub fn settle_prompt(
        &mut self,
        start: usize,
        tokens: &[u32],
        out: &ForwardOutput,
        last: Option<(&mut Sampler, Option<&mut Constraint>)>,
    ) -> Result<Option<Accepted>, GrammarError> {
        if let Some(h) = self.head.as_mut() {
            h.commit(start, tokens, &out.hidden);
        }
        let Some((sampler, grammar)) = last else {
            return Ok(None);
        };
        let grammar = grammar.map(|g| RowGrammar {
            constraint: g,
            masks: &[],
        });
        accept_coupled(sampler, &[], out, 0, grammar).map(Some)
    }

    /// An image chunk went through the target (`out` holds its hidden rows, `embd` its
    /// embeddings): the head takes its rows at once ([`HeadState::commit_image`]); after the
    /// last chunk the first output token is drawn as in [`Speculator::settle_prompt`]. Returns
    /// the head's milliseconds too.
    #[allow(clippy::too_many_arguments)]
    pub fn settle_image(
        &mut self,
        head: Option<&NextnHead>,
        start: usize,
        image: &crate::media::PromptImage,
        embd: &[f32],
        out: &ForwardOutput,
        last: Option<(&mut Sampler, Option<&mut Constraint>)>,
        pool: &ThreadPool,
    ) -> Result<(Option<Accepted>, f64), SettleError> {
        let mut ms = 0.0;
        if let (Some(h), Some(head)) = (self.head.as_mut(), head) {
            ms = h.commit_image(
                head,
                start,
                embd,
                image.nx,
                image.n_pos(),
                &out.hidden,
                pool,
            )?;
        }
        let accepted = self.settle_prompt(start, &[], out, last)?;
        Ok((accepted, ms))
    }

    /// Accept what the target's output says about the verified rows, draw the token after the kept
    /// drafts, and commit the target's state and the head's to the kept rows. `first_index` is
    /// the output position row 0 predicts. On a grammar error the pending rows are dropped.
    pub fn settle(
        &mut self,
        model: &Model,
        state: &mut SequenceState,
        sampler: &mut Sampler,
        grammar: Option<&mut Constraint>,
        first_index: u64,
        verify: VerifyRows<'_>,
    ) -> Result<Settled, SettleError> {
        let VerifyRows {
            n_past,
            rows,
            dists,
            masks,
            out,
        } = verify;
        let drafts = &rows[1..];
        let grammar = grammar.map(|g| RowGrammar {
            constraint: g,
            masks,
        });
        let result = match self.sampling {
            DraftSampling::Sample if !drafts.is_empty() => {
                accept_sampled(sampler, drafts, dists, out, first_index, grammar)
            }
            _ => accept_coupled(sampler, drafts, out, first_index, grammar),
        };
        let accepted = match result {
            Ok(a) => a,
            Err(e) => {
                model.commit(state, 0)?;
                return Err(e.into());
            }
        };
        let kept = accepted.drafts + 1;
        let mut commit_ms = 0.0;
        if !drafts.is_empty() {
            let t = Instant::now();
            model.commit(state, kept)?;
            commit_ms = ms_since(t);
        }
        if let Some(h) = self.head.as_mut() {
            // Head entries for id_last (unless its draft step made it) and the kept drafts, from
            // the target's hidden states.
            let e = model.config.n_embd;
            h.commit(n_past, &rows[..kept], &out.hidden[..kept * e]);
        }
        Ok(Settled {
            accepted,
            commit_ms,
        })
    }
}

/// One slot's part of this step's drafting.
pub struct DraftRequest<'a> {
    pub speculator: &'a mut Speculator,
    /// The last sampled token, not yet in the target's state; it will sit at `n_past`.
    pub id_last: u32,
    pub n_past: usize,
    /// Drafts to make; 0 only runs (a piece of) the head's lag.
    pub n_draft: usize,
    pub sampler: &'a mut Sampler,
    /// Output position of the first draft.
    pub first_index: u64,
    /// The request's grammar, when drafts are picked among the tokens it allows.
    pub grammar: Option<&'a mut Constraint>,
}

/// Run the head for every request in one batched pass per draft depth
/// ([`super::draft::draft`]); a request measured at a forced acceptance has its chain rewritten
/// ([`ForcedAcceptance::apply`]). Requests without a head get no drafts.
pub fn draft_batch(
    head: &NextnHead,
    requests: Vec<DraftRequest<'_>>,
    spec: &SpecConfig,
    max_rows: usize,
    n_vocab: usize,
    pool: &ThreadPool,
) -> Result<(Vec<Drafts>, Vec<HeadPass>), ModelError> {
    let mut forced = Vec::with_capacity(requests.len());
    let mut jobs = Vec::with_capacity(requests.len());
    let mut has_job = Vec::with_capacity(requests.len());
    for r in requests {
        let Speculator {
            head: Some(h),
            sampling,
            forced: f,
            ..
        } = r.speculator
        else {
            has_job.push(false);
            continue;
        };
        has_job.push(true);
        let f: &Option<ForcedAcceptance> = f;
        forced.push((f.as_ref(), r.first_index));
        jobs.push(DraftJob {
            head: h,
            id_last: r.id_last,
            n_past: r.n_past,
            n_draft: r.n_draft,
            sampler: r.sampler,
            sample_drafts: *sampling == DraftSampling::Sample,
            first_index: r.first_index,
            grammar: r.grammar,
        });
    }
    let (made, passes) = if jobs.is_empty() {
        (Vec::new(), Vec::new())
    } else {
        draft(head, &mut jobs, spec, max_rows, pool)?
    };
    let mut made = made.into_iter().zip(forced);
    let drafts = has_job
        .into_iter()
        .map(|has| {
            let Some((mut d, (f, first_index))) = has.then(|| made.next()).flatten() else {
                return Drafts::default();
            };
            if let Some(f) = f {
                f.apply(first_index, &mut d.tokens, n_vocab);
            }
            d
        })
        .collect();
    Ok((drafts, passes))
}
