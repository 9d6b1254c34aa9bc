//! MTP speculative decoding for one sequence (spec §5.4, §7.2).
//!
//! Each step drafts up to `n_max` tokens greedily with the NextN head (chained on its own output
//! hidden), verifies `[id_last, d1..dk]` in one target pass, keeps the agreed prefix plus one token
//! sampled from the target, and rolls back the rest. Acceptance is exact match against tokens drawn
//! with the request's own sampler, one draw per emitted token, so the output is the target's
//! distribution — at temperature 0 token-for-token identical to plain decoding, and with a seed the
//! same tokens plain decoding draws.
//!
//! The head's KV entry at every committed position is computed from the target's hidden state of
//! the position before. Draft step 0 already pairs `id_last` with the target's hidden, so its entry
//! is kept; only the accepted drafts (which were drafted from the head's own hidden) are recomputed.

use std::time::Instant;

use nextn_model::{KvType, LayerCache, LogitRows, Model, NextnHead, SequenceState};
use nextn_quant::kernels::ThreadPool;

use crate::generate::{
    ms_since, prefill_with_hidden, Emitter, EngineError, GenerateParams, Generation, Timings,
};
use crate::sampler::{argmax, Sampler, TokenProb, Xoshiro256StarStar};
use crate::tokenizer::Tokenizer;

/// Drafting options, with llama.cpp's names and defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct SpecParams {
    /// `--spec-draft-n-max`: most drafts per step.
    pub n_max: usize,
    /// `--spec-draft-n-min`: a draft shorter than this is discarded.
    pub n_min: usize,
    /// `--spec-draft-p-min`: stop drafting when the top-1 probability (full softmax) is below this.
    pub p_min: f32,
    /// How draft tokens are chosen and verified when sampling (temperature > 0).
    pub draft_sampling: DraftSampling,
    /// Keep a per-step record (position, drafts, accepted) in [`SpecStats::trace`].
    pub trace: bool,
}

impl Default for SpecParams {
    fn default() -> Self {
        SpecParams {
            n_max: 3,
            n_min: 0,
            p_min: 0.0,
            draft_sampling: DraftSampling::Greedy,
            trace: false,
        }
    }
}

/// `--spec-draft-sampling`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftSampling {
    /// Draft the head's top-1 token; accept when the target's own draw equals it (llama.cpp's rule).
    /// With a seed, the output is the very tokens plain decoding draws.
    Greedy,
    /// Draw each draft from the head's distribution q (after the request's sampler transforms) and
    /// accept it with probability min(1, p/q) against the target's distribution p; on rejection draw
    /// from the normalised residual max(0, p − q). Lossless, and accepts more when head and target
    /// agree in distribution. Falls back to `Greedy` at temperature 0.
    Sample,
}

impl DraftSampling {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "greedy" => Some(DraftSampling::Greedy),
            "sample" => Some(DraftSampling::Sample),
            _ => None,
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

/// Acceptance statistics of one generation, named as llama.cpp reports them.
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
    pub draft_ms: f64,
    pub verify_ms: f64,
    pub trace: Vec<StepTrace>,
}

impl SpecStats {
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

/// Probability of the top-1 token under the softmax of the whole row.
fn top1_probability(logits: &[f32], top: u32) -> f32 {
    let max = logits[top as usize];
    let sum: f64 = logits.iter().map(|&v| ((v - max) as f64).exp()).sum();
    (1.0 / sum) as f32
}

/// The target's and the head's state for one sequence between steps.
pub struct SpecSequence {
    pub state: SequenceState,
    pub head_cache: LayerCache,
    /// Target post-norm hidden at position `n_past − 1`: the seed of the next draft.
    pub pending_hidden: Vec<f32>,
}

impl SpecSequence {
    pub fn new(
        model: &Model,
        head: &NextnHead,
        n_ctx: usize,
        k_type: KvType,
        v_type: KvType,
    ) -> Self {
        SpecSequence {
            state: model.new_sequence(n_ctx, k_type, v_type),
            head_cache: head.new_cache(k_type, v_type),
            // Position 0 has no previous hidden state: the head sees zeros, as llama.cpp feeds it.
            pending_hidden: vec![0.0; model.config.n_embd],
        }
    }
}

/// Draft up to `n_draft` tokens after `id_last` at position `n_past`. Leaves the head's cache with
/// the step-0 entry (which used the target's hidden) and nothing beyond it.
pub fn draft_chain(
    head: &NextnHead,
    seq: &mut SpecSequence,
    id_last: u32,
    n_draft: usize,
    p_min: f32,
    pool: &ThreadPool,
) -> Result<Vec<u32>, EngineError> {
    Ok(draft_chain_with(head, seq, id_last, n_draft, p_min, None, pool)?.0)
}

/// [`draft_chain`]; with `sampling = Some((sampler, rng))` each draft is drawn from the head's
/// distribution after the sampler's transforms, and those distributions are returned too.
#[allow(clippy::type_complexity)]
fn draft_chain_with(
    head: &NextnHead,
    seq: &mut SpecSequence,
    id_last: u32,
    n_draft: usize,
    p_min: f32,
    mut sampling: Option<(&mut Sampler, &mut Xoshiro256StarStar)>,
    pool: &ThreadPool,
) -> Result<(Vec<u32>, Vec<Vec<TokenProb>>), EngineError> {
    let n_past = seq.state.n_past;
    let mut drafts = Vec::with_capacity(n_draft);
    let mut dists = Vec::new();
    let mut token = id_last;
    let mut hidden = seq.pending_hidden.clone();
    for i in 0..n_draft {
        let out = head.forward(
            &[token],
            &hidden,
            n_past + i,
            &mut seq.head_cache,
            LogitRows::Last,
            pool,
        )?;
        let row = out.logits_row(0);
        let top = argmax(row);
        if p_min > 0.0 && top1_probability(row, top) < p_min {
            break;
        }
        let pick = match sampling.as_mut() {
            Some((sampler, rng)) => {
                let q = sampler.distribution(row).to_vec();
                let Some(d) = draw(&q, rng.next_f64()) else {
                    break;
                };
                dists.push(q);
                d
            }
            None => top,
        };
        drafts.push(pick);
        token = pick;
        hidden = out.hidden;
    }
    NextnHead::truncate(&mut seq.head_cache, n_past + 1);
    Ok((drafts, dists))
}

/// Draw from a distribution given as (id, p) pairs with a uniform `u` in [0, 1).
pub(crate) fn draw(dist: &[TokenProb], u: f64) -> Option<u32> {
    let total: f64 = dist.iter().map(|t| t.p as f64).sum();
    if dist.is_empty() || !(total > 0.0) {
        return None;
    }
    let target = u * total;
    let mut acc = 0.0f64;
    for t in dist {
        acc += t.p as f64;
        if target < acc {
            return Some(t.id);
        }
    }
    dist.iter().rev().find(|t| t.p > 0.0).map(|t| t.id)
}

fn prob_of(dist: &[TokenProb], id: u32) -> f64 {
    dist.iter()
        .find(|t| t.id == id)
        .map(|t| t.p as f64)
        .unwrap_or(0.0)
}

/// Speculative sampling acceptance of draft `d` drawn from `q` against the target's `p`:
/// accept with probability min(1, p(d)/q(d)); otherwise draw from max(0, p − q) normalised.
/// Returns `Ok(())` to accept, `Err(token)` with the replacement on rejection.
pub(crate) fn accept_or_resample(
    p: &[TokenProb],
    q: &[TokenProb],
    d: u32,
    rng: &mut Xoshiro256StarStar,
) -> Result<(), u32> {
    let (pd, qd) = (prob_of(p, d), prob_of(q, d));
    let u = rng.next_f64();
    if qd > 0.0 && u * qd < pd {
        return Ok(());
    }
    let residual: Vec<TokenProb> = p
        .iter()
        .map(|t| TokenProb {
            id: t.id,
            p: (t.p as f64 - prob_of(q, t.id)).max(0.0) as f32,
        })
        .filter(|t| t.p > 0.0)
        .collect();
    let u = rng.next_f64();
    // p == q on their common support leaves no residual mass: any draw from p is then exact.
    Err(draw(&residual, u).or_else(|| draw(p, u)).unwrap_or(d))
}

/// Bring the head's cache up to the target: entries for positions `from..state.n_past` from the
/// target's hidden states (`hidden[i]` belongs to position `from − 1 + i`).
fn catch_up_head(
    head: &NextnHead,
    seq: &mut SpecSequence,
    tokens: &[u32],
    hidden_prev: &[f32],
    from: usize,
    pool: &ThreadPool,
) -> Result<(), EngineError> {
    if !tokens.is_empty() {
        NextnHead::truncate(&mut seq.head_cache, from);
        head.forward(
            tokens,
            hidden_prev,
            from,
            &mut seq.head_cache,
            LogitRows::None,
            pool,
        )?;
    }
    Ok(())
}

/// Prefill the prompt on the target and the head; returns the last row's logits.
pub fn prefill_speculative(
    model: &Model,
    head: &NextnHead,
    seq: &mut SpecSequence,
    prompt: &[u32],
    n_batch: usize,
    pool: &ThreadPool,
) -> Result<Vec<f32>, EngineError> {
    let e = model.config.n_embd;
    let mut logits = Vec::new();
    let chunks: Vec<&[u32]> = prompt.chunks(n_batch.max(1)).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let from = seq.state.n_past;
        let last = i + 1 == chunks.len();
        let out = prefill_with_hidden(model, &mut seq.state, chunk, last, pool)?;
        let mut hprev = Vec::with_capacity(chunk.len() * e);
        hprev.extend_from_slice(&seq.pending_hidden);
        hprev.extend_from_slice(&out.hidden[..(chunk.len() - 1) * e]);
        catch_up_head(head, seq, chunk, &hprev, from, pool)?;
        seq.pending_hidden = out.hidden[(chunk.len() - 1) * e..].to_vec();
        logits = out.logits;
    }
    Ok(logits)
}

/// Speculative generation after `prompt`; same contract as [`crate::generate::generate`].
#[allow(clippy::too_many_arguments)]
pub fn generate_speculative(
    model: &Model,
    head: &NextnHead,
    tokenizer: &Tokenizer,
    pool: &ThreadPool,
    seq: &mut SpecSequence,
    prompt: &[u32],
    params: &GenerateParams,
    spec: &SpecParams,
    sampler: &mut Sampler,
    on_text: impl FnMut(&str) -> bool,
) -> Result<(Generation, SpecStats), EngineError> {
    if prompt.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    if seq.state.n_past + prompt.len() >= seq.state.n_ctx {
        return Err(EngineError::PromptTooLong {
            n_prompt: seq.state.n_past + prompt.len(),
            n_ctx: seq.state.n_ctx,
        });
    }
    let e = model.config.n_embd;
    let t0 = Instant::now();
    for &t in prompt {
        sampler.accept(t);
    }
    let logits = prefill_speculative(model, head, seq, prompt, params.n_batch, pool)?;
    let mut timings = Timings {
        prompt_n: prompt.len(),
        prompt_ms: ms_since(t0),
        ..Default::default()
    };

    let t1 = Instant::now();
    let mut stats = SpecStats {
        accepted_per_pos: vec![0; spec.n_max],
        drafted_per_pos: vec![0; spec.n_max],
        ..Default::default()
    };
    let mut emitter = Emitter::new(tokenizer, params, on_text);
    let sample_drafts =
        spec.draft_sampling == DraftSampling::Sample && !sampler.config().is_greedy();
    // Draft draws and acceptance coins use their own stream, derived from the request's seed.
    let mut spec_rng = Xoshiro256StarStar::from_seed(sampler.config().seed ^ 0x9E37_79B9_7F4A_7C15);
    // The first token comes from the prompt's last row, as in llama-server.
    let mut id_last = sampler.sample(&logits);
    sampler.accept(id_last);
    let mut done = emitter.push(id_last, seq.state.remaining()).is_some();
    while !done {
        let n_past = seq.state.n_past;
        // Room for [id_last, drafts] in the context and in the token budget (the bonus token counts).
        let room = seq.state.remaining().saturating_sub(1);
        let budget = emitter.budget_left().saturating_sub(1);
        let n_draft = spec.n_max.min(room).min(budget);

        let td = Instant::now();
        let (mut drafts, draft_dists) = if n_draft > 0 {
            let sampling = if sample_drafts {
                Some((&mut *sampler, &mut spec_rng))
            } else {
                None
            };
            draft_chain_with(head, seq, id_last, n_draft, spec.p_min, sampling, pool)?
        } else {
            (Vec::new(), Vec::new())
        };
        if drafts.len() < spec.n_min {
            drafts.clear();
        }
        if n_draft == 0 {
            // No draft step ran, so the head still needs its entry for id_last.
            catch_up_head(
                head,
                seq,
                &[id_last],
                &seq.pending_hidden.clone(),
                n_past,
                pool,
            )?;
        }
        stats.draft_ms += ms_since(td);

        let tv = Instant::now();
        let mut rows = Vec::with_capacity(1 + drafts.len());
        rows.push(id_last);
        rows.extend_from_slice(&drafts);
        let out = model.forward_verify(&rows, &mut seq.state, pool)?;
        let mut accepted = 0;
        let next = if sample_drafts && !drafts.is_empty() {
            // Speculative sampling: p_i from row i under the sampler state after the accepted prefix.
            let mut replacement = None;
            while accepted < drafts.len() {
                let p = sampler.distribution(out.logits_row(accepted)).to_vec();
                match accept_or_resample(
                    &p,
                    &draft_dists[accepted],
                    drafts[accepted],
                    &mut spec_rng,
                ) {
                    Ok(()) => {
                        sampler.accept(drafts[accepted]);
                        accepted += 1;
                    }
                    Err(t) => {
                        replacement = Some(t);
                        break;
                    }
                }
            }
            let t = match replacement {
                Some(t) => t,
                None => sampler.sample(out.logits_row(accepted)),
            };
            sampler.accept(t);
            t
        } else {
            // Exact-match acceptance: draw t_i from row i; keep going while it equals the next draft.
            let mut next = sampler.sample(out.logits_row(0));
            sampler.accept(next);
            while accepted < drafts.len() && next == drafts[accepted] {
                accepted += 1;
                next = sampler.sample(out.logits_row(accepted));
                sampler.accept(next);
            }
            next
        };
        model.commit(&mut seq.state, accepted + 1)?;
        stats.verify_ms += ms_since(tv);

        if !drafts.is_empty() {
            stats.steps += 1;
            stats.draft_n += drafts.len() as u64;
            stats.draft_n_accepted += accepted as u64;
            for i in 0..drafts.len() {
                stats.drafted_per_pos[i] += 1;
            }
            for i in 0..accepted {
                stats.accepted_per_pos[i] += 1;
            }
        }

        if spec.trace {
            stats.trace.push(StepTrace {
                n_past,
                id_last,
                drafts: drafts.clone(),
                accepted,
            });
        }

        // Head entries for the accepted drafts, now from the target's hidden states.
        let td = Instant::now();
        catch_up_head(
            head,
            seq,
            &drafts[..accepted],
            &out.hidden[..accepted * e],
            n_past + 1,
            pool,
        )?;
        seq.pending_hidden = out.hidden[accepted * e..(accepted + 1) * e].to_vec();
        stats.draft_ms += ms_since(td);

        // Emit the accepted drafts and the bonus token, stopping where plain decoding would.
        let emitted: Vec<u32> = drafts[..accepted]
            .iter()
            .copied()
            .chain(std::iter::once(next))
            .collect();
        for (i, &t) in emitted.iter().enumerate() {
            // Positions plain decoding would have left when it sampled this token.
            let left = seq.state.n_ctx.saturating_sub(n_past + 1 + i);
            if emitter.push(t, left).is_some() {
                done = true;
                break;
            }
        }
        id_last = next;
    }
    let (text, tokens, finish) = emitter.finish();
    timings.predicted_n = tokens.len();
    timings.predicted_ms = ms_since(t1);
    Ok((
        Generation {
            tokens,
            text,
            finish,
            timings,
        },
        stats,
    ))
}
