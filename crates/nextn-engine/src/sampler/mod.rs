//! Token sampler: llama.cpp's default sampler chain with a seeded, platform-independent RNG.
//!
//! Chain, in llama.cpp's default order: penalties → top-k → top-p → min-p → temperature → draw.
//!
//! * **Penalties** look at the last `repeat_last_n` tokens passed to [`Sampler::accept`]. For a
//!   token occurring `count` ≥ 1 times there: `logit > 0 ? logit / repeat_penalty : logit ·
//!   repeat_penalty`, then `logit −= count · frequency_penalty + presence_penalty`.
//! * **top-k** keeps the `top_k` largest logits (0 = off).
//! * **top-p** keeps the smallest set of best candidates whose softmax mass (temperature 1, over
//!   the candidates left by top-k) reaches `top_p` (≥ 1 = off).
//! * **min-p** keeps candidates with probability ≥ `min_p` × the best candidate's, again at
//!   temperature 1 (0 = off).
//! * **temperature** divides the surviving logits by `temperature`, and one token is drawn from
//!   their softmax.
//!
//! `temperature ≤ 0` is greedy: the argmax of the penalised logits (the filters cannot remove the
//! argmax, so they are skipped), lowest id on ties, NaN never chosen, no randomness used.
//!
//! Ties between equal logits are always broken towards the lower token id, and NaN logits are
//! never candidates.
//!
//! # Reproducibility
//! The token at output position `i` is drawn with one uniform that depends only on `(seed, i)`
//! ([`uniform_at`], counter-based): not on how many draws came before or in what order. So a
//! seeded generation gives the same tokens whether the speculative loop verified one row or five
//! per step, alone or beside other requests; for a given [`SamplerConfig`], the same `accept` /
//! `sample` calls on the same logits yield the same tokens on every platform and in every release
//! (the softmax uses a built-in exponential instead of the platform's libm).
//! [`Sampler::reset`] forgets the penalty window.

mod chain;
mod distribution;
mod math;
mod penalties;
mod rng;

use chain::{ActivePenalties, Candidates};
use penalties::{PenaltyHistory, PenaltyParams};

pub use distribution::{
    draw_pairs, draw_residual_whole_row, DistRef, Distribution, Pairs, WholeRow, WholeRowPairs,
};
pub use math::argmax;
pub use penalties::MAX_REPEAT_LAST_N;
pub use rng::{uniform_at, Draw, Xoshiro256StarStar};

/// Seed used by [`SamplerConfig::default`]. Callers who want different draws per request must
/// choose the seed themselves (e.g. from the clock); the sampler never reads entropy.
pub const DEFAULT_SEED: u64 = 0;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplerError {
    #[error("sampler setting `{field}` = {value} is invalid: {reason}")]
    InvalidParameter {
        field: &'static str,
        value: String,
        reason: &'static str,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// ≤ 0 selects greedy decoding.
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    /// In [0, 1]; 1 disables top-p.
    pub top_p: f32,
    /// In [0, 1]; 0 disables min-p.
    pub min_p: f32,
    /// > 0; 1 disables the repetition penalty.
    pub repeat_penalty: f32,
    /// Number of most recent accepted tokens the penalties look at; 0 disables all penalties.
    pub repeat_last_n: usize,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: u64,
    /// Added to the logits of these tokens before anything else (OpenAI's `logit_bias`); −∞
    /// bans a token.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplerConfig {
    /// llama.cpp's defaults (`common_params_sampling`).
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: DEFAULT_SEED,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplerConfig {
    /// Plain argmax decoding: temperature 0, every filter and penalty neutral.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Self::default()
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    pub fn validate(&self) -> Result<(), SamplerError> {
        fn invalid(
            field: &'static str,
            value: impl std::fmt::Display,
            reason: &'static str,
        ) -> Result<(), SamplerError> {
            Err(SamplerError::InvalidParameter {
                field,
                value: value.to_string(),
                reason,
            })
        }
        if !self.temperature.is_finite() {
            return invalid("temperature", self.temperature, "must be a finite number");
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return invalid("top_p", self.top_p, "must be between 0 and 1");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return invalid("min_p", self.min_p, "must be between 0 and 1");
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            return invalid(
                "repeat_penalty",
                self.repeat_penalty,
                "must be a finite number greater than 0",
            );
        }
        if self.repeat_last_n > MAX_REPEAT_LAST_N {
            return invalid(
                "repeat_last_n",
                self.repeat_last_n,
                "must be at most 1048576",
            );
        }
        if !self.presence_penalty.is_finite() {
            return invalid(
                "presence_penalty",
                self.presence_penalty,
                "must be a finite number",
            );
        }
        if !self.frequency_penalty.is_finite() {
            return invalid(
                "frequency_penalty",
                self.frequency_penalty,
                "must be a finite number",
            );
        }
        if let Some((id, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| b.is_nan() || *b == f32::INFINITY)
        {
            return invalid(
                "logit_bias",
                format!("{b} for token {id}"),
                "must be a finite number or -inf",
            );
        }
        Ok(())
    }

    fn penalty_params(&self) -> PenaltyParams {
        PenaltyParams {
            repeat: self.repeat_penalty,
            frequency: self.frequency_penalty,
            presence: self.presence_penalty,
        }
    }
}

/// A token id with its probability under the sampler chain.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenProb {
    pub id: u32,
    pub p: f32,
}

/// The tokens a grammar allows at one position: one bit per token id of the logits row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
    len: usize,
    /// Built to allow every token: sampling under it is sampling without a mask.
    all: bool,
}

impl TokenMask {
    /// A mask over `len` tokens from 32-bit words, bit `i % 32` of word `i / 32` for token `i`.
    pub fn from_words(mut words: Vec<u32>, len: usize) -> Self {
        words.resize(len.div_ceil(32), 0);
        TokenMask {
            words,
            len,
            all: false,
        }
    }

    /// Every one of `len` tokens.
    pub fn all(len: usize) -> Self {
        let mut words = vec![u32::MAX; len.div_ceil(32)];
        if !len.is_multiple_of(32) {
            if let Some(last) = words.last_mut() {
                *last = (1u32 << (len % 32)) - 1;
            }
        }
        TokenMask {
            words,
            len,
            all: true,
        }
    }

    /// Only token `id` of `len`.
    pub fn only(id: u32, len: usize) -> Self {
        let mut words = vec![0u32; len.div_ceil(32)];
        let i = id as usize;
        if i < len {
            words[i / 32] |= 1 << (i % 32);
        }
        TokenMask::from_words(words, len)
    }

    /// Whether the mask was built to allow every token ([`TokenMask::all`]).
    pub fn allows_all(&self) -> bool {
        self.all
    }

    pub fn allows(&self, id: u32) -> bool {
        let i = id as usize;
        i < self.len && self.words[i / 32] >> (i % 32) & 1 == 1
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The lowest allowed token id.
    pub fn first(&self) -> Option<u32> {
        self.words
            .iter()
            .enumerate()
            .find(|(_, &w)| w != 0)
            .map(|(i, w)| (i * 32) as u32 + w.trailing_zeros())
            .filter(|&t| (t as usize) < self.len)
    }

    /// Set the logit of every token the mask does not allow to −∞.
    pub fn apply(&self, logits: &mut [f32]) {
        for (w, chunk) in self.words.iter().zip(logits.chunks_mut(32)) {
            if *w == u32::MAX {
                continue;
            }
            for (bit, l) in chunk.iter_mut().enumerate() {
                if w >> bit & 1 == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        if logits.len() > self.len {
            logits[self.len..].fill(f32::NEG_INFINITY);
        }
    }
}

/// Stateful sampler: configuration, penalty window and reusable scratch buffers.
#[derive(Clone, Debug)]
pub struct Sampler {
    cfg: SamplerConfig,
    history: PenaltyHistory,
    candidates: Candidates,
    penalised_logits: Vec<f32>,
    /// The row after logit bias and a grammar's mask.
    shaped_logits: Vec<f32>,
    distribution: Vec<TokenProb>,
    spare: SpareDistributions,
}

/// Distributions handed back after use, whose buffers the next ones reuse (a draft's
/// distribution over a 248k vocabulary is a megabyte).
#[derive(Default)]
struct SpareDistributions(Vec<Distribution>);

impl SpareDistributions {
    /// More than a few steps' drafts are not worth holding on to.
    const MAX: usize = 16;
}

impl Clone for SpareDistributions {
    /// A copy starts without spares: they are only buffers.
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl std::fmt::Debug for SpareDistributions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} spare distributions", self.0.len())
    }
}

/// Where the row of a whole-row distribution lives, with its maximum and softmax total.
#[derive(Clone, Copy)]
struct WholeRowPlan {
    source: RowSource,
    max: f32,
}

#[derive(Clone, Copy)]
enum RowSource {
    /// The logits as given.
    Input,
    /// `Sampler::shaped_logits`.
    Shaped,
    /// `Sampler::penalised_logits`.
    Penalised,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Result<Self, SamplerError> {
        cfg.validate()?;
        Ok(Self {
            history: PenaltyHistory::new(cfg.repeat_last_n),
            candidates: Candidates::default(),
            penalised_logits: Vec::new(),
            shaped_logits: Vec::new(),
            distribution: Vec::new(),
            spare: SpareDistributions::default(),
            cfg,
        })
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Whether every draw of this sampler without a mask is the argmax of the raw row (greedy,
    /// no penalty, no logit bias): such a row need not come back whole from the device, its
    /// top-1 is the draw ([`nextn_model::Readback::Top1`]).
    pub fn draws_argmax(&self) -> bool {
        self.cfg.is_greedy()
            && self.cfg.logit_bias.is_empty()
            && (self.cfg.penalty_params().is_neutral() || self.cfg.repeat_last_n == 0)
    }

    /// Whether [`Sampler::top_token`] without a mask is the argmax of the raw row (no logit
    /// bias): a greedy draft row's top-1 is enough.
    pub fn top_token_is_argmax(&self) -> bool {
        self.cfg.logit_bias.is_empty()
    }

    /// Records a token in the penalty window. Feed the prompt tokens too, then every emitted token;
    /// [`Sampler::sample`] does not record its own result.
    pub fn accept(&mut self, token: u32) {
        self.history.record(token);
    }

    /// The penalty window's contents, oldest first.
    pub fn recent_tokens(&self) -> impl Iterator<Item = u32> + '_ {
        self.history.recent()
    }

    /// Forgets the penalty window: the sampler behaves as if newly created.
    pub fn reset(&mut self) {
        self.history.clear();
    }

    /// Draws the token at output position `index` (0 for the first generated token) from
    /// `logits` (one row, indexed by token id) through the chain, with the uniform
    /// [`uniform_at`]`(seed, Draw::Token, index)`.
    ///
    /// `logits` is not modified. Returns 0 if there is nothing to choose from (empty slice or all
    /// NaN).
    pub fn sample(&mut self, logits: &[f32], index: u64) -> u32 {
        self.sample_masked(logits, None, index)
    }

    /// [`Sampler::sample`] over only the tokens `mask` allows (a grammar's), with the request's
    /// logit bias applied first. The draw is the one plain decoding under the same mask makes.
    pub fn sample_masked(&mut self, logits: &[f32], mask: Option<&TokenMask>, index: u64) -> u32 {
        if let Some(plan) = self.plan_whole_row(logits, mask) {
            let u = self.uniform(Draw::Token, index);
            let token = distribution::draw_weighted(&self.whole_row(logits, plan), u);
            return allowed_or_first(token, mask);
        }
        let shaped = self.shape(logits, mask);
        let row = shaped.as_deref().unwrap_or(logits);
        let token = if self.cfg.is_greedy() {
            self.greedy(row)
        } else {
            let u = self.uniform(Draw::Token, index);
            self.run_chain(row);
            self.candidates.draw(u).unwrap_or(0)
        };
        self.unshape(shaped);
        allowed_or_first(token, mask)
    }

    /// [`Sampler::sample`] followed by [`Sampler::accept`] of the result.
    pub fn sample_and_accept(&mut self, logits: &[f32], index: u64) -> u32 {
        self.sample_masked_and_accept(logits, None, index)
    }

    /// [`Sampler::sample_masked`] followed by [`Sampler::accept`] of the result.
    pub fn sample_masked_and_accept(
        &mut self,
        logits: &[f32],
        mask: Option<&TokenMask>,
        index: u64,
    ) -> u32 {
        let token = self.sample_masked(logits, mask, index);
        self.accept(token);
        token
    }

    /// The best token of a draft head's row after the logit bias and `mask` (no penalties or
    /// filters: drafts are the head's top-1); `None` when no allowed token has a finite logit
    /// and the mask leaves more than one choice.
    pub fn top_token(&mut self, logits: &[f32], mask: Option<&TokenMask>) -> Option<u32> {
        let shaped = self.shape(logits, mask);
        let row = shaped.as_deref().unwrap_or(logits);
        let top = argmax(row);
        let finite = row
            .get(top as usize)
            .is_some_and(|l| *l > f32::NEG_INFINITY);
        self.unshape(shaped);
        match mask {
            _ if finite => Some(top),
            Some(m) if m.count() == 1 => m.first(),
            _ => None,
        }
    }

    /// The row with the logit bias and `mask` applied, when either changes anything.
    fn shape(&mut self, logits: &[f32], mask: Option<&TokenMask>) -> Option<Vec<f32>> {
        let mask = mask.filter(|m| !m.allows_all());
        if self.cfg.logit_bias.is_empty() && mask.is_none() {
            return None;
        }
        let mut row = std::mem::take(&mut self.shaped_logits);
        row.clear();
        row.extend_from_slice(logits);
        for &(id, b) in &self.cfg.logit_bias {
            if let Some(l) = row.get_mut(id as usize) {
                *l += b;
            }
        }
        if let Some(m) = mask {
            m.apply(&mut row);
        }
        Some(row)
    }

    /// Keep the scratch row's allocation for the next call.
    fn unshape(&mut self, shaped: Option<Vec<f32>>) {
        if let Some(row) = shaped {
            self.shaped_logits = row;
        }
    }

    /// This sampler's uniform for `draw` at output position `index`.
    pub fn uniform(&self, draw: Draw, index: u64) -> f64 {
        uniform_at(self.cfg.seed, draw, index)
    }

    /// The distribution [`Sampler::sample`] would draw from right now, without drawing (the RNG is
    /// untouched): the surviving candidates with probabilities summing to 1, in the order the
    /// draw walks them — best first when top-k or top-p is active, token-id order otherwise.
    /// Greedy configs give the argmax with probability 1; empty or all-NaN logits give an empty
    /// slice.
    pub fn distribution(&mut self, logits: &[f32]) -> &[TokenProb] {
        self.distribution_masked(logits, None)
    }

    /// [`Sampler::distribution`] over only the tokens `mask` allows, after the logit bias: the
    /// distribution [`Sampler::sample_masked`] draws from.
    pub fn distribution_masked(
        &mut self,
        logits: &[f32],
        mask: Option<&TokenMask>,
    ) -> &[TokenProb] {
        self.distribution.clear();
        let shaped = self.shape(logits, mask);
        let row = shaped.as_deref().unwrap_or(logits);
        if self.cfg.is_greedy() {
            if row.iter().any(|l| !l.is_nan()) {
                let id = allowed_or_first(self.greedy(row), mask);
                self.distribution.push(TokenProb { id, p: 1.0 });
            }
        } else {
            self.run_chain(row);
            self.distribution.extend(
                self.candidates
                    .probabilities()
                    .filter(|&(id, _)| mask.is_none_or(|m| m.allows(id)))
                    .map(|(id, p)| TokenProb { id, p }),
            );
        }
        self.unshape(shaped);
        &self.distribution
    }

    /// [`Sampler::distribution_masked`] as a view: the same probabilities, read from the row on
    /// demand when the chain keeps every token (top-k, top-p and min-p off), so that a lookup or
    /// a draw costs no list of the whole vocabulary.
    pub fn distribution_view<'s>(
        &'s mut self,
        logits: &'s [f32],
        mask: Option<&TokenMask>,
    ) -> DistRef<'s> {
        match self.plan_whole_row(logits, mask) {
            Some(plan) => DistRef::WholeRow(self.whole_row(logits, plan)),
            None => DistRef::Listed(self.distribution_masked(logits, mask)),
        }
    }

    /// [`Sampler::distribution_masked`] into `out`, which keeps it past `logits`: by token id
    /// when the chain keeps every token, listed otherwise. `out`'s buffers are reused.
    pub fn distribution_into(
        &mut self,
        logits: &[f32],
        mask: Option<&TokenMask>,
        out: &mut Distribution,
    ) {
        match self.plan_whole_row(logits, mask) {
            Some(plan) => {
                let row = self.row_of(logits, plan.source);
                out.set_whole_row(row, plan.max, self.cfg.temperature);
            }
            None => out.set_listed(self.distribution_masked(logits, mask)),
        }
    }

    /// A distribution to fill with [`Sampler::distribution_into`], reusing one handed back with
    /// [`Sampler::recycle`] when there is one.
    pub fn spare_distribution(&mut self) -> Distribution {
        self.spare.0.pop().unwrap_or_default()
    }

    /// Hand distributions back for [`Sampler::spare_distribution`] to reuse.
    pub fn recycle(&mut self, dists: impl IntoIterator<Item = Distribution>) {
        let room = SpareDistributions::MAX.saturating_sub(self.spare.0.len());
        self.spare.0.extend(dists.into_iter().take(room));
    }

    /// The chain over a row of `len` tokens removes none: sampling with top-k, top-p and min-p
    /// off.
    fn keeps_every_token(&self, len: usize) -> bool {
        let c = &self.cfg;
        !c.is_greedy() && (c.top_k == 0 || c.top_k >= len) && c.top_p >= 1.0 && c.min_p <= 0.0
    }

    /// Shape and penalise the row for a chain that keeps every token and find its maximum; `None` (the listed chain
    /// decides) when a filter is on, or the row is empty, holds a NaN or has no token above −∞:
    /// the listed chain drops NaN candidates and weighs an all −∞ row evenly, which a by-id
    /// reading would not reproduce.
    fn plan_whole_row(&mut self, logits: &[f32], mask: Option<&TokenMask>) -> Option<WholeRowPlan> {
        if logits.is_empty() || !self.keeps_every_token(logits.len()) {
            return None;
        }
        let mut source = RowSource::Input;
        if let Some(shaped) = self.shape(logits, mask) {
            self.shaped_logits = shaped;
            source = RowSource::Shaped;
        }
        let params = self.cfg.penalty_params();
        if !params.is_neutral() && self.history.distinct() > 0 {
            let row = match source {
                RowSource::Shaped => &self.shaped_logits,
                _ => logits,
            };
            self.penalised_logits.clear();
            self.penalised_logits.extend_from_slice(row);
            penalise(&mut self.penalised_logits, &self.history, params);
            source = RowSource::Penalised;
        }
        let row = self.row_of(logits, source);
        let (max, any_nan) = row_max_and_any_nan(row);
        if max == f32::NEG_INFINITY || any_nan {
            return None;
        }
        Some(WholeRowPlan { source, max })
    }

    fn row_of<'s>(&'s self, logits: &'s [f32], source: RowSource) -> &'s [f32] {
        match source {
            RowSource::Input => logits,
            RowSource::Shaped => &self.shaped_logits,
            RowSource::Penalised => &self.penalised_logits,
        }
    }

    fn whole_row<'s>(&'s self, logits: &'s [f32], plan: WholeRowPlan) -> WholeRow<'s> {
        let row = self.row_of(logits, plan.source);
        let total = row_softmax_total(row, plan.max, self.cfg.temperature);
        WholeRow::new(row, plan.max, self.cfg.temperature, total)
    }

    /// Top-1 token and its probability after renormalising over only the `k` best raw logits
    /// (0 = whole row). This is the quantity llama.cpp's MTP drafter compares with `p_min`
    /// (softmax over its top-10 candidates).
    pub fn top1_probability_among_top_k(&mut self, logits: &[f32], k: usize) -> (u32, f32) {
        if k == 0 || k >= logits.len() {
            return top1_probability(logits);
        }
        self.candidates.fill_top_k(logits, k, None);
        let Some(best) = self.candidates.items().first().copied() else {
            return (0, 0.0);
        };
        let total: f64 = self
            .candidates
            .items()
            .iter()
            .map(|c| f64::from(math::softmax_weight(c.logit, best.logit, 1.0)))
            .sum();
        (best.id, (1.0 / total) as f32)
    }

    fn greedy(&mut self, logits: &[f32]) -> u32 {
        let params = self.cfg.penalty_params();
        if params.is_neutral() || self.history.distinct() == 0 {
            return argmax(logits);
        }
        self.penalised_logits.clear();
        self.penalised_logits.extend_from_slice(logits);
        penalise(&mut self.penalised_logits, &self.history, params);
        argmax(&self.penalised_logits)
    }

    fn run_chain(&mut self, logits: &[f32]) {
        let params = self.cfg.penalty_params();
        let penalties =
            (!params.is_neutral() && self.history.distinct() > 0).then_some(ActivePenalties {
                history: &self.history,
                params,
            });
        let k = self.cfg.top_k;
        if k > 0 && k < logits.len() {
            self.candidates.fill_top_k(logits, k, penalties);
        } else {
            self.candidates.fill_all(logits, penalties);
        }
        self.candidates.top_p(self.cfg.top_p);
        self.candidates.min_p(self.cfg.min_p);
        self.candidates.weigh(self.cfg.temperature);
    }
}

/// The log probability of a token under the softmax of a whole logits row, with the `top` most
/// likely tokens of the row (OpenAI's `logprobs` / `top_logprobs`).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    /// The `top` most likely tokens and their log probabilities, most likely first (ties: lower
    /// id first).
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprob {
    /// From the raw logits (no temperature, penalties, bias or grammar): the model's own
    /// distribution, the same whether the token was drafted or not.
    pub fn of(row: &[f32], id: u32, top: usize) -> Self {
        let max = math::nan_ignoring_max(row);
        let lse = max as f64
            + row
                .iter()
                .filter(|v| !v.is_nan())
                .map(|&v| ((v - max) as f64).exp())
                .sum::<f64>()
                .ln();
        let lp =
            |t: u32| (row.get(t as usize).map_or(f64::NEG_INFINITY, |&v| v as f64) - lse) as f32;
        let k = top.min(row.len());
        let mut order: Vec<u32> = (0..row.len() as u32).collect();
        let by_logit =
            |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
        if k > 0 && k < order.len() {
            order.select_nth_unstable_by(k - 1, by_logit);
        }
        order.truncate(k);
        order.sort_by(by_logit);
        TokenLogprob {
            id,
            logprob: lp(id),
            top: order.into_iter().map(|t| (t, lp(t))).collect(),
        }
    }
}

math::wide_fn! {
    /// [`math::max_and_any_nan`] over a vocabulary row.
    fn row_max_and_any_nan(row: &[f32]) -> (f32, bool) {
        math::max_and_any_nan(row)
    }
}

math::wide_fn! {
    /// [`math::softmax_total`] over a vocabulary row.
    fn row_softmax_total(row: &[f32], max: f32, temperature: f32) -> f64 {
        math::softmax_total(row, max, temperature)
    }
}

/// Apply the penalties to the logit of every windowed token in `row`.
fn penalise(row: &mut [f32], history: &PenaltyHistory, params: PenaltyParams) {
    for (id, count) in history.counts() {
        if let Some(l) = row.get_mut(id as usize) {
            *l = params.apply(*l, count);
        }
    }
}

/// `token` when the mask allows it, else the mask's first allowed token: a row whose allowed
/// tokens all have −∞ logits still yields a token the grammar accepts.
fn allowed_or_first(token: u32, mask: Option<&TokenMask>) -> u32 {
    match mask {
        Some(m) if !m.allows(token) => m.first().unwrap_or(token),
        _ => token,
    }
}

/// Top-1 token of the raw logits and its probability under the softmax of the whole row
/// (temperature 1, no penalties or filters). `(0, 0.0)` for empty or all-NaN logits.
pub fn top1_probability(logits: &[f32]) -> (u32, f32) {
    let top = argmax(logits);
    let Some(&max) = logits.get(top as usize).filter(|l| !l.is_nan()) else {
        return (0, 0.0);
    };
    (top, (1.0 / math::softmax_total(logits, max, 1.0)) as f32)
}

#[cfg(test)]
mod tests;
