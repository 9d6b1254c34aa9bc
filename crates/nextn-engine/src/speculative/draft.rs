//! Drafting: the NextN head's side of each sequence, and one batched head pass per draft depth
//! over every sequence that drafts this step.
//!
//! The head's cache entry at every committed position `p` must be computed from the token at `p`
//! and the target's hidden state at `p − 1` (docs/MODEL.md, "NextN (MTP) head"). Committed rows
//! whose entry is not computed yet wait in the sequence's *lag* and are run in the first head pass
//! the sequence next takes part in, together with `id_last`, whose entry is the first draft step.
//! A sequence that does not draft for a while thus costs no head work until it drafts again.

use std::time::Instant;

use nextn_model::{
    DeviceRows, ForwardOutput, HeadBatchItem, HiddenPrev, KvRows, KvType, LayerCache, LogitRows,
    ModelError, NextnHead, Readback, StateCodecError, StateReader, StateWriter,
};
use nextn_quant::kernels::ThreadPool;

use super::SpecConfig;
use crate::grammar::Constraint;
use crate::output::ms_since;
use crate::sampler::{top1_probability, Distribution, Draw, Sampler, TokenMask};

/// The NextN head's side of one sequence.
#[derive(Clone, Debug)]
pub struct HeadState {
    cache: LayerCache,
    /// Positions the cache holds (`0..pos`).
    pos: usize,
    /// Committed positions `pos..` still without a head entry: their tokens, and the target's
    /// hidden state of the position before each.
    lag_tokens: Vec<u32>,
    lag_hidden: Vec<f32>,
    /// The target's hidden state of the last committed position: it pairs with the token at the
    /// next position.
    last_hidden: Vec<f32>,
    /// Cache rows the prompt's images took beyond the rotary positions they advanced, as in the
    /// target's state: the head sees every row at the target's rotary position.
    rope_shift: usize,
    n_embd: usize,
}

impl HeadState {
    /// A fresh state for a sequence of at most `n_ctx` positions (its cache allocated now, on
    /// the device when the head runs there).
    pub fn new(
        head: &NextnHead,
        n_embd: usize,
        k_type: KvType,
        v_type: KvType,
        n_ctx: usize,
    ) -> Result<Self, ModelError> {
        Ok(HeadState {
            cache: head.new_cache(k_type, v_type, n_ctx)?,
            pos: 0,
            lag_tokens: Vec::new(),
            lag_hidden: Vec::new(),
            // Position 0 has no previous hidden state: the head sees zeros, as llama.cpp feeds it.
            last_hidden: vec![0.0; n_embd],
            rope_shift: 0,
            n_embd,
        })
    }

    /// A copy; a cache on the device is a new allocation there, which can fail for lack of room.
    pub fn try_clone(&self) -> Result<Self, ModelError> {
        Ok(HeadState {
            cache: self.cache.try_clone()?,
            pos: self.pos,
            lag_tokens: self.lag_tokens.clone(),
            lag_hidden: self.lag_hidden.clone(),
            last_hidden: self.last_hidden.clone(),
            rope_shift: self.rope_shift,
            n_embd: self.n_embd,
        })
    }

    /// Positions the head has an entry for or owes one (its cache and its lag).
    pub fn covered(&self) -> usize {
        self.pos + self.lag_tokens.len()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        let cache = if self.cache.is_attention() {
            self.cache.bytes()
        } else {
            0
        };
        cache + (self.lag_hidden.len() + self.last_hidden.len()) * 4 + self.lag_tokens.len() * 4
    }

    /// Committed positions whose head entry is still to be computed.
    pub fn lag(&self) -> usize {
        self.lag_tokens.len()
    }

    /// The target committed `tokens` at positions `start..`, with `hidden` its post-norm hidden
    /// states of those rows (`tokens.len() × n_embd`). Positions the head already has an entry
    /// for (`id_last`, entered by the first draft step) are skipped.
    pub fn commit(&mut self, start: usize, tokens: &[u32], hidden: &[f32]) {
        let e = self.n_embd;
        let Some(last) = tokens.len().checked_sub(1) else {
            return;
        };
        let covered = self.pos + self.lag_tokens.len();
        for (i, &t) in tokens.iter().enumerate() {
            if start + i < covered {
                continue;
            }
            self.lag_tokens.push(t);
            if i == 0 {
                self.lag_hidden.extend_from_slice(&self.last_hidden);
            } else {
                self.lag_hidden
                    .extend_from_slice(&hidden[(i - 1) * e..i * e]);
            }
        }
        self.last_hidden.clear();
        self.last_hidden
            .extend_from_slice(&hidden[last * e..(last + 1) * e]);
    }

    /// The target committed one image's rows at positions `start..` (`embd` its embeddings,
    /// `nx` tokens wide; `hidden` the target's post-norm rows). The head gets its entries at
    /// once, after the lag before it: each image row pairs its embedding, in place of a token
    /// embedding, with the target's hidden state of the row before, at the image's M-RoPE
    /// position, so the head's cache has no hole at the image and later rows see it as the
    /// target's do. Returns the milliseconds of head work.
    #[allow(clippy::too_many_arguments)]
    pub fn commit_image(
        &mut self,
        head: &NextnHead,
        start: usize,
        embd: &[f32],
        nx: usize,
        n_pos: usize,
        hidden: &[f32],
        pool: &ThreadPool,
    ) -> Result<f64, ModelError> {
        let t = Instant::now();
        let e = self.n_embd;
        let n = hidden.len() / e;
        if self.covered() != start || n == 0 {
            return Err(ModelError::ImageShape {
                found: embd.len(),
                nx,
                ny: n / nx.max(1),
                n_embd: e,
            });
        }
        if self.lag() > 0 {
            let rows = self.lag();
            head.forward_batch(
                &mut [HeadBatchItem {
                    tokens: &self.lag_tokens,
                    hidden_prev: HiddenPrev::Host(&self.lag_hidden),
                    start_pos: self.pos,
                    rope_shift: self.rope_shift,
                    cache: &mut self.cache,
                    logits: LogitRows::None,
                    readback: Readback::Logits,
                }],
                pool,
            )?;
            self.consume_lag(rows);
        }
        let mut hidden_prev = Vec::with_capacity(n * e);
        hidden_prev.extend_from_slice(&self.last_hidden);
        hidden_prev.extend_from_slice(&hidden[..(n - 1) * e]);
        head.forward_image(
            embd,
            &hidden_prev,
            nx,
            self.pos,
            self.pos - self.rope_shift,
            &mut self.cache,
            pool,
        )?;
        self.pos += n;
        self.rope_shift += n - n_pos;
        self.last_hidden.clear();
        self.last_hidden.extend_from_slice(&hidden[(n - 1) * e..]);
        Ok(ms_since(t))
    }

    /// Drop the head's entries past committed position `n_past` (an entry for a sampled token
    /// the target never committed, made by a draft step). False when the state cannot stand at
    /// `n_past`: it covers fewer positions, or entries past `n_past` sit behind a lag.
    pub fn rewind(&mut self, n_past: usize) -> bool {
        if self.covered() == n_past {
            return true;
        }
        if self.pos <= n_past || !self.lag_tokens.is_empty() {
            return false;
        }
        if !self.cache.is_attention() {
            return false;
        }
        self.cache.truncate_attention(n_past);
        self.pos = n_past;
        true
    }

    /// The state as bytes, for a slot file ([`HeadState::decode`] reads it back).
    pub fn encode(&self, w: &mut StateWriter) -> Result<(), ModelError> {
        let rows = self.cache.attention_rows(0, self.pos).transpose()?;
        w.u64(self.n_embd as u64);
        w.u64(self.pos as u64);
        if let Some(rows) = rows {
            rows.encode(w);
        }
        w.u32s(&self.lag_tokens);
        w.f32s(&self.lag_hidden);
        w.f32s(&self.last_hidden);
        Ok(())
    }

    /// A state written by [`HeadState::encode`], checked against `head`'s shape and the KV types.
    /// `rope_shift` is the target's for the same rows (the images among them set it).
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        r: &mut StateReader<'_>,
        head: &NextnHead,
        n_embd: usize,
        k_type: KvType,
        v_type: KvType,
        n_ctx: usize,
        rope_shift: usize,
    ) -> Result<HeadState, HeadStateError> {
        let mut state = HeadState::new(head, n_embd, k_type, v_type, n_ctx)?;
        state.rope_shift = rope_shift;
        let found_embd = r.count("head hidden width")?;
        if found_embd != n_embd {
            return Err(HeadStateError::Mismatch {
                what: "hidden width",
                expected: n_embd,
                found: found_embd,
            });
        }
        state.pos = r.count("head position")?;
        if !state.cache.is_attention() {
            return Err(HeadStateError::Mismatch {
                what: "attention layers",
                expected: 0,
                found: 1,
            });
        }
        let rows = KvRows::decode(r)?;
        if rows.len() != state.pos {
            return Err(HeadStateError::Mismatch {
                what: "attention rows",
                expected: state.pos,
                found: rows.len(),
            });
        }
        state.cache.append_attention_rows(&rows)?;
        state.lag_tokens = r.u32s("head lag tokens")?;
        state.lag_hidden = r.f32s("head lag hidden states")?;
        state.last_hidden = r.f32s("head last hidden state")?;
        if state.lag_hidden.len() != state.lag_tokens.len() * n_embd {
            return Err(HeadStateError::Mismatch {
                what: "lag hidden values",
                expected: state.lag_tokens.len() * n_embd,
                found: state.lag_hidden.len(),
            });
        }
        if state.last_hidden.len() != n_embd {
            return Err(HeadStateError::Mismatch {
                what: "last hidden values",
                expected: n_embd,
                found: state.last_hidden.len(),
            });
        }
        Ok(state)
    }

    /// The first `rows` lag rows now have head entries.
    fn consume_lag(&mut self, rows: usize) {
        let rows = rows.min(self.lag_tokens.len());
        self.pos += rows;
        self.lag_tokens.drain(..rows);
        self.lag_hidden.drain(..rows * self.n_embd);
    }
}

/// Why a saved head state cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum HeadStateError {
    #[error(transparent)]
    Codec(#[from] StateCodecError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(
        "the saved NextN head state does not fit this head: {what} {found}, expected {expected}"
    )]
    Mismatch {
        what: &'static str,
        expected: usize,
        found: usize,
    },
}

/// One sequence's part of this step's drafting.
pub struct DraftJob<'a> {
    pub head: &'a mut HeadState,
    /// The last sampled token, not yet in the target's state; it will sit at `n_past`.
    pub id_last: u32,
    pub n_past: usize,
    /// Most drafts to make; 0 only runs (a piece of) the lag.
    pub n_draft: usize,
    /// The request's sampler: its logit bias applies to the head's rows as to the target's, and
    /// with `sample_drafts` the drafts are drawn from the head's distribution under it.
    pub sampler: &'a mut Sampler,
    pub sample_drafts: bool,
    /// Output index of the first draft (the position after `id_last`).
    pub first_index: u64,
    /// The request's grammar, at its state after `id_last`: drafts are picked among the tokens
    /// it allows, advancing a copy of its state along the chain (rolled back afterwards).
    pub grammar: Option<&'a mut Constraint>,
}

/// What drafting produced for one job.
#[derive(Clone, Debug, Default)]
pub struct Drafts {
    pub tokens: Vec<u32>,
    /// The distribution each draft was drawn from (sampled drafts only).
    pub dists: Vec<Distribution>,
    /// With a grammar: its mask before each draft (after `id_last` and the drafts before it),
    /// which verification reuses for the same rows.
    pub masks: Vec<TokenMask>,
    /// Milliseconds of the head passes this job took part in.
    pub ms: f64,
    /// The chain reached the end of the grammar or of generation: no further depth.
    ended: bool,
}

/// One head pass: its rows, the rows it computed logits for, and its time.
#[derive(Clone, Copy, Debug)]
pub struct HeadPass {
    pub rows: usize,
    pub logit_rows: usize,
    pub ms: f64,
}

/// Run the head for this step over every job: a first pass over each job's lag plus, for a job
/// that drafts, `id_last` (its first draft step); then one pass per further draft depth with one
/// row per job still drafting, fed its own previous output. A job whose lag with `id_last` is
/// longer than `max_rows` only runs `max_rows` of its lag and drafts in a later step. Afterwards
/// each drafting job's cache keeps its entry for `id_last` and drops the chain's own entries.
pub fn draft(
    head: &NextnHead,
    jobs: &mut [DraftJob],
    spec: &SpecConfig,
    max_rows: usize,
    pool: &ThreadPool,
) -> Result<(Vec<Drafts>, Vec<HeadPass>), ModelError> {
    let mut drafts: Vec<Drafts> = vec![Drafts::default(); jobs.len()];
    let mut passes = Vec::new();
    let max_rows = max_rows.max(1);

    // Depth 0: lag rows, plus id_last for a job that drafts and whose rows fit.
    let mut drafting = vec![false; jobs.len()];
    let mut rows_run = vec![0usize; jobs.len()];
    let readback: Vec<Readback> = jobs.iter().map(|j| draft_readback(j, spec.p_min)).collect();
    for (k, job) in jobs.iter_mut().enumerate() {
        let h = &mut *job.head;
        drafting[k] = job.n_draft > 0 && h.lag() < max_rows;
        if drafting[k] {
            h.lag_tokens.push(job.id_last);
            h.lag_hidden.extend_from_slice(&h.last_hidden);
        }
        rows_run[k] = h.lag().min(max_rows);
    }
    let t = Instant::now();
    let outs = {
        let mut items: Vec<HeadBatchItem> = jobs
            .iter_mut()
            .zip(&rows_run)
            .zip(&drafting)
            .zip(&readback)
            .map(|(((job, &rows), &d), &readback)| {
                let h = &mut *job.head;
                HeadBatchItem {
                    tokens: &h.lag_tokens[..rows],
                    hidden_prev: HiddenPrev::Host(&h.lag_hidden[..rows * h.n_embd]),
                    start_pos: h.pos,
                    rope_shift: h.rope_shift,
                    cache: &mut h.cache,
                    logits: if d { LogitRows::Last } else { LogitRows::None },
                    readback,
                }
            })
            .collect();
        head.forward_batch(&mut items, pool)?
    };
    let rows: usize = rows_run.iter().sum();
    if rows > 0 {
        let ms = ms_since(t);
        passes.push(HeadPass {
            rows,
            logit_rows: drafting.iter().filter(|&&d| d).count(),
            ms,
        });
        for (d, &r) in drafts.iter_mut().zip(&rows_run) {
            if r > 0 {
                d.ms += ms;
            }
        }
    }
    // The chain's hidden state of each drafting job.
    let mut chain: Vec<Chain> = vec![Chain::default(); jobs.len()];
    for (k, (job, out)) in jobs.iter_mut().zip(&outs).enumerate() {
        job.head.consume_lag(rows_run[k]);
        if drafting[k] {
            extend_chain(job, out, 0, spec.p_min, &mut drafts[k], &mut chain[k]);
        }
    }

    // Further depths: one row per job still drafting, on the head's own hidden state.
    let max_depth = jobs.iter().map(|j| j.n_draft).max().unwrap_or(0);
    for depth in 1..max_depth {
        let members: Vec<usize> = (0..jobs.len())
            .filter(|&k| {
                drafting[k]
                    && jobs[k].n_draft > depth
                    && drafts[k].tokens.len() == depth
                    && !drafts[k].ended
            })
            .collect();
        if members.is_empty() {
            break;
        }
        let t = Instant::now();
        let outs = {
            let tokens: Vec<[u32; 1]> = members
                .iter()
                .map(|&k| [drafts[k].tokens[depth - 1]])
                .collect();
            let mut items = Vec::with_capacity(members.len());
            let mut next = members.iter().zip(&tokens).peekable();
            for (k, job) in jobs.iter_mut().enumerate() {
                let Some((_, token)) = next.next_if(|(&m, _)| m == k) else {
                    continue;
                };
                items.push(HeadBatchItem {
                    tokens: token,
                    hidden_prev: chain[k].as_prev(),
                    start_pos: job.n_past + depth,
                    rope_shift: job.head.rope_shift,
                    cache: &mut job.head.cache,
                    logits: LogitRows::Last,
                    readback: readback[k],
                });
            }
            head.forward_batch(&mut items, pool)?
        };
        let ms = ms_since(t);
        passes.push(HeadPass {
            rows: members.len(),
            logit_rows: members.len(),
            ms,
        });
        for (&k, out) in members.iter().zip(&outs) {
            drafts[k].ms += ms;
            extend_chain(
                &mut jobs[k],
                out,
                depth,
                spec.p_min,
                &mut drafts[k],
                &mut chain[k],
            );
        }
    }

    // The chain's own entries go; the entry for id_last (from the target's hidden) stays. The
    // grammar returns to its state after id_last.
    for (k, job) in jobs.iter_mut().enumerate() {
        if !drafting[k] {
            continue;
        }
        NextnHead::truncate(&mut job.head.cache, job.n_past + 1);
        job.head.pos = job.n_past + 1;
        if let Some(g) = job.grammar.as_mut() {
            let consumed = drafts[k].tokens.len();
            if g.rollback(consumed).is_err() {
                // A grammar that cannot go back cannot check these drafts: verify without them.
                drafts[k].tokens.clear();
            }
        }
        if drafts[k].tokens.len() < spec.n_min {
            drafts[k].tokens.clear();
            job.sampler.recycle(drafts[k].dists.drain(..));
            drafts[k].masks.clear();
        }
    }
    Ok((drafts, passes))
}

/// What of a job's head rows comes back: only the top-1 when the draft is the row's argmax (a
/// greedy draft with no grammar, no logit bias and no confidence threshold, which needs the row's
/// softmax).
fn draft_readback(job: &DraftJob, p_min: f32) -> Readback {
    if !job.sample_drafts
        && job.grammar.is_none()
        && p_min <= 0.0
        && job.sampler.top_token_is_argmax()
    {
        Readback::Top1
    } else {
        Readback::Logits
    }
}

/// Pick the draft after a head row (its top-1, or for sampled drafts a draw from the head's
/// distribution, among the tokens the grammar allows) and keep the row's hidden state for the
/// next depth; nothing when the head is not confident enough (`p_min`) or the grammar leaves
/// no usable token, which ends the chain.
fn extend_chain(
    job: &mut DraftJob,
    out: &ForwardOutput,
    depth: usize,
    p_min: f32,
    drafts: &mut Drafts,
    chain: &mut Chain,
) {
    if let Some(top) = out.top1(0) {
        // A row read back as its top-1 (see `draft_readback`): `top_token` without a mask,
        // which drafts nothing when no logit is above −∞.
        if let Some(pick) = top.id.filter(|_| top.logit > f32::NEG_INFINITY) {
            push_draft(job, out, pick, None, drafts, chain);
        }
        return;
    }
    let row = out.logits_row(0);
    let mask = match job.grammar.as_mut().map(|g| g.mask()) {
        None => None,
        Some(Ok(m)) => Some(m),
        Some(Err(_)) => return,
    };
    // A token the constraints force (a reasoning budget's closing sequence) is drafted whatever
    // the head thinks of it: the target takes it too.
    let forced = mask.as_ref().is_some_and(|m| m.count() == 1);
    if p_min > 0.0 && !forced && top1_probability(row).1 < p_min {
        return;
    }
    let pick = if job.sample_drafts {
        let mut q = job.sampler.spare_distribution();
        job.sampler.distribution_into(row, mask.as_ref(), &mut q);
        let u = job
            .sampler
            .uniform(Draw::Draft, job.first_index + depth as u64);
        let Some(d) = q.draw(u) else {
            job.sampler.recycle([q]);
            return;
        };
        drafts.dists.push(q);
        d
    } else {
        match job.sampler.top_token(row, mask.as_ref()) {
            Some(t) => t,
            None => return,
        }
    };
    push_draft(job, out, pick, mask, drafts, chain);
}

/// Keep `pick` as the next draft: the grammar (if any) takes it, and the row's hidden state
/// seeds the next depth.
fn push_draft(
    job: &mut DraftJob,
    out: &ForwardOutput,
    pick: u32,
    mask: Option<TokenMask>,
    drafts: &mut Drafts,
    chain: &mut Chain,
) {
    if let Some(g) = job.grammar.as_mut() {
        if g.consume(pick).is_err() {
            let unused = drafts.dists.split_off(drafts.tokens.len());
            job.sampler.recycle(unused);
            return;
        }
        // Nothing can follow the end of the grammar or of generation.
        drafts.ended = g.is_finished() || g.is_eog(pick);
    }
    if let Some(m) = mask {
        drafts.masks.push(m);
    }
    drafts.tokens.push(pick);
    // The hidden state of the row just drafted from (the last row of the pass), on the host or
    // where a device pass left it.
    let e = job.head.n_embd;
    *chain = match out.device_hidden {
        Some(rows) if out.hidden.is_empty() => Chain::Device(rows.last()),
        _ => Chain::Host(out.hidden[out.hidden.len().saturating_sub(e)..].to_vec()),
    };
}

/// The hidden state a draft chain feeds its next depth: the head's last row, read back or left
/// on the device by its pass.
#[derive(Clone, Debug, Default)]
enum Chain {
    #[default]
    None,
    Host(Vec<f32>),
    Device(DeviceRows),
}

impl Chain {
    fn as_prev(&self) -> HiddenPrev<'_> {
        match self {
            Chain::None => HiddenPrev::Host(&[]),
            Chain::Host(v) => HiddenPrev::Host(v),
            Chain::Device(rows) => HiddenPrev::Device(*rows),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use nextn_gguf::GgufFile;
    use nextn_model::Model;

    use super::*;

    #[test]
    fn each_committed_position_gets_one_head_entry() {
        let file = GgufFile::open(nextn_testdata::bundled_model()).unwrap();
        let model = Model::load(Arc::new(file)).unwrap();
        let head = NextnHead::load(&model).unwrap();
        let pool = ThreadPool::new(1);
        let e = model.config.n_embd;
        let hidden = |n: usize| vec![0.25f32; n * e];
        let mut h = HeadState::new(&head, e, KvType::F32, KvType::F32, 64).unwrap();
        h.commit(0, &[10, 11, 12], &hidden(3));
        assert_eq!(h.lag(), 3);
        let spec = SpecConfig::default();
        let mut sampler = Sampler::new(crate::sampler::SamplerConfig::greedy()).unwrap();
        let mut jobs = [DraftJob {
            head: &mut h,
            id_last: 13,
            n_past: 3,
            n_draft: 2,
            sampler: &mut sampler,
            sample_drafts: false,
            first_index: 1,
            grammar: None,
        }];
        let (made, passes) = draft(&head, &mut jobs, &spec, 64, &pool).unwrap();
        assert_eq!(made[0].tokens.len(), 2);
        // One pass over the lag and id_last, one for the second draft.
        assert_eq!(passes.iter().map(|p| p.rows).collect::<Vec<_>>(), [4, 1]);
        assert_eq!((h.lag(), h.pos), (0, 4));
        // id_last (position 3) already has its entry from the first draft step; the accepted
        // draft at position 4 waits for the next head pass.
        h.commit(3, &[13, made[0].tokens[0]], &hidden(2));
        assert_eq!((h.lag(), h.pos), (1, 4));
        // A step that drafted nothing: id_last joins the lag.
        h.commit(5, &[20], &hidden(1));
        assert_eq!(h.lag(), 2);
        // A lag longer than the pass budget is caught up in pieces, without drafting.
        let mut jobs = [DraftJob {
            head: &mut h,
            id_last: 21,
            n_past: 6,
            n_draft: 3,
            sampler: &mut sampler,
            sample_drafts: false,
            first_index: 4,
            grammar: None,
        }];
        let (made, _) = draft(&head, &mut jobs, &spec, 2, &pool).unwrap();
        assert!(made[0].tokens.is_empty());
        assert_eq!((h.lag(), h.pos), (0, 6));
    }

    /// A slot file keeps a state's images: their spans come back, the head's rotary shift is the
    /// target's again, and only the tower that encoded them may resume it. Version 1 files (text
    /// only, no image section) still read.
    #[test]
    fn slot_files_bring_back_images_and_the_heads_rotary_shift() {
        use crate::slot_file::{ModelIdentity, SavedState, SlotFileError, Target};
        use nextn_model::{ImageSpan, LogitRows};
        let file = GgufFile::open(nextn_testdata::bundled_model()).unwrap();
        let model = Model::load(Arc::new(file)).unwrap();
        let head = NextnHead::load(&model).unwrap();
        let pool = ThreadPool::new(1);
        let (e, kv, n) = (model.config.n_embd, KvType::F32, 12);
        let text: Vec<u32> = (1..=n as u32).collect();
        let mut state = model.new_sequence(64, kv, kv).unwrap();
        model
            .forward(&text, &mut state, LogitRows::None, &pool)
            .unwrap();
        let span = ImageSpan {
            start: 3,
            n_tokens: 6,
            n_pos: 3,
        };
        state.images = vec![span];
        let mut tokens = text.clone();
        tokens.splice(3..9, crate::media::placeholder_ids(42, 6));
        let mut h = HeadState::new(&head, e, kv, kv, 64).unwrap();
        h.commit(0, &tokens, &vec![0.5; n * e]);
        h.rope_shift = 3;
        let saved = SavedState::of(tokens.clone(), &state, Some(h)).unwrap();
        let identity = ModelIdentity::of(&model);
        let target = |vision| Target {
            model: &model,
            head: Some(&head),
            identity: &identity,
            vision,
            k_type: kv,
            v_type: kv,
            n_ctx: 64,
        };
        let bytes = saved.encode(&identity, kv, kv, Some(7)).unwrap();
        let back = SavedState::decode(&bytes, &target(Some(7))).unwrap();
        assert_eq!(back.tokens, tokens);
        assert_eq!(back.images, [span]);
        assert_eq!(back.head.as_ref().map(|h| h.rope_shift), Some(3));
        assert_eq!(back.resume(&target(Some(7))).unwrap().images, [span]);
        assert!(matches!(
            SavedState::decode(&bytes, &target(Some(8))),
            Err(SlotFileError::ForeignVision {
                n: 1,
                file: 7,
                this: 8
            })
        ));
        assert!(matches!(
            SavedState::decode(&bytes, &target(None)),
            Err(SlotFileError::NoVision { n: 1 })
        ));
        // Placeholder rows the file lists no image for are refused.
        let mut unlisted = saved.clone();
        unlisted.images.clear();
        let bytes = unlisted.encode(&identity, kv, kv, Some(7)).unwrap();
        let e = SavedState::decode(&bytes, &target(Some(7))).unwrap_err();
        assert!(matches!(e, SlotFileError::BadImage { .. }), "{e}");

        // A text-only state as version 1 wrote it: no image count after the tokens.
        let mut text_only = saved.clone();
        text_only.tokens = text.clone();
        text_only.images.clear();
        let v2 = text_only.encode(&identity, kv, kv, None).unwrap();
        let after_tokens = 8 + 4 + 8 + 8 + identity.name.len() + 3 + 8 + 4 * n;
        assert_eq!(v2[after_tokens..after_tokens + 8], [0; 8]);
        let mut v1 = [&v2[..after_tokens], &v2[after_tokens + 8..]].concat();
        v1[8..12].copy_from_slice(&1u32.to_le_bytes());
        let body = v1.len() - 8;
        let mut sum = nextn_gguf::Fnv1a::new();
        sum.write(&v1[..body]);
        v1[body..].copy_from_slice(&sum.finish().to_le_bytes());
        let back = SavedState::decode(&v1, &target(None)).unwrap();
        assert_eq!(back.tokens, text);
        assert!(back.images.is_empty());
    }
}
