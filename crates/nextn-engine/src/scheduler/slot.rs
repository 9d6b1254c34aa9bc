//! One busy slot: a request's sequence state, head cache, sampler, text stream and statistics.

use std::time::Instant;

use nextn_model::{LayerCache, SequenceState};

use super::policy::AcceptanceCounts;
use super::{Event, EventSink, Request};
use crate::generate::{FinishReason, StopMatcher};
use crate::sampler::{Sampler, Xoshiro256StarStar};
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// Where a slot's sequence stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// `prompt[..next]` has been run through the target.
    Prefill { next: usize },
    /// `id_last` was sampled and is not yet in the target's state; it will sit at `state.n_past`.
    Decode { id_last: u32 },
}

/// The NextN head's side of a slot.
pub struct HeadSide {
    pub cache: LayerCache,
    /// Positions the head cache holds (`0..pos`).
    pub pos: usize,
    /// Committed positions `pos..` still without a head entry: their tokens and the target's
    /// hidden state of the position before each. Run lazily, when the slot next drafts.
    pub lag_tokens: Vec<u32>,
    pub lag_hidden: Vec<f32>,
    /// Target hidden state at `n_past − 1`, which pairs with `id_last` at `n_past`.
    pub pending_hidden: Vec<f32>,
    /// Decode steps since this slot last drafted.
    pub idle_steps: usize,
}

impl HeadSide {
    /// The first `rows` lag rows now have head entries.
    pub fn consume_lag(&mut self, rows: usize, n_embd: usize) {
        let rows = rows.min(self.lag_tokens.len());
        self.pos += rows;
        self.lag_tokens.drain(..rows);
        self.lag_hidden.drain(..rows * n_embd);
    }
}

/// Turns sampled tokens into text and decides where generation ends, exactly as
/// [`crate::generate::Emitter`] does for one sequence.
pub struct TextOut<'t> {
    tokenizer: &'t Tokenizer,
    decoder: StreamDecoder<'t>,
    stops: StopMatcher,
    n_predict: Option<usize>,
    ignore_eos: bool,
    pub n_tokens: usize,
    finished: Option<FinishReason>,
    hit_stop: bool,
}

impl<'t> TextOut<'t> {
    pub fn new(
        tokenizer: &'t Tokenizer,
        stop: &[String],
        n_predict: Option<usize>,
        ignore_eos: bool,
    ) -> Self {
        TextOut {
            tokenizer,
            decoder: StreamDecoder::new(tokenizer),
            stops: StopMatcher::new(stop),
            n_predict,
            ignore_eos,
            n_tokens: 0,
            finished: None,
            hit_stop: false,
        }
    }

    /// One sampled token at context position `pos` (of `n_ctx`): the text it completes and
    /// whether generation ends with it.
    pub fn push(&mut self, token: u32, pos: usize, n_ctx: usize) -> (String, Option<FinishReason>) {
        if self.finished.is_some() {
            return (String::new(), self.finished);
        }
        if self.tokenizer.is_eog(token) && !self.ignore_eos {
            self.finished = Some(FinishReason::Stop);
            return (String::new(), self.finished);
        }
        self.n_tokens += 1;
        let (piece, hit) = self.stops.push(&self.decoder.push(token));
        if hit {
            self.hit_stop = true;
            self.finished = Some(FinishReason::Stop);
        } else if self.n_predict.is_some_and(|n| self.n_tokens >= n)
            || n_ctx.saturating_sub(pos) == 0
        {
            self.finished = Some(FinishReason::Length);
        }
        (piece, self.finished)
    }

    /// Tokens the budget still allows (`usize::MAX` when unbounded).
    pub fn budget_left(&self) -> usize {
        self.n_predict
            .map(|n| n.saturating_sub(self.n_tokens))
            .unwrap_or(usize::MAX)
    }

    /// Text still held back (an unfinished character, a possible stop-string prefix).
    pub fn flush(&mut self) -> String {
        if self.hit_stop {
            return String::new();
        }
        let (mut rest, hit) = self.stops.push(&self.decoder.flush());
        if !hit {
            rest.push_str(&self.stops.finish());
        }
        rest
    }
}

/// Per-request draft statistics.
#[derive(Clone, Debug, Default)]
pub struct DraftStats {
    pub draft_n: u64,
    pub draft_n_accepted: u64,
    pub steps: u64,
    pub counts: AcceptanceCounts,
}

pub struct Slot<'t> {
    pub prompt: Vec<u32>,
    pub sink: Box<dyn EventSink>,
    pub sampler: Sampler,
    /// Draws of sampled drafts and acceptance coins, a stream of their own derived from the seed
    /// exactly as [`crate::speculative::generate_speculative`] derives it.
    pub spec_rng: Xoshiro256StarStar,
    /// Drafts are drawn from the head's distribution and accepted with min(1, p/q).
    pub sample_drafts: bool,
    pub state: SequenceState,
    pub head: Option<HeadSide>,
    pub stage: Stage,
    pub out: TextOut<'t>,
    pub stats: DraftStats,
    pub t_start: Instant,
    pub t_first_token: Option<Instant>,
    pub prompt_ms: f64,
    /// Admission order, for first-come prompt processing.
    pub seq_no: u64,
}

impl<'t> Slot<'t> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        request: Request,
        sampler: Sampler,
        state: SequenceState,
        head: Option<HeadSide>,
        tokenizer: &'t Tokenizer,
        n_max: usize,
        seq_no: u64,
    ) -> Self {
        let Request {
            prompt,
            n_predict,
            stop,
            ignore_eos,
            sink,
            ..
        } = request;
        let seed = sampler.config().seed;
        Slot {
            prompt,
            sink,
            spec_rng: Xoshiro256StarStar::from_seed(seed ^ 0x9E37_79B9_7F4A_7C15),
            sample_drafts: false,
            sampler,
            state,
            head,
            stage: Stage::Prefill { next: 0 },
            out: TextOut::new(tokenizer, &stop, n_predict, ignore_eos),
            stats: DraftStats {
                counts: AcceptanceCounts::new(n_max),
                ..Default::default()
            },
            t_start: Instant::now(),
            t_first_token: None,
            prompt_ms: 0.0,
            seq_no,
        }
    }

    /// Send text; false when the listener is gone.
    pub fn send_text(&mut self, piece: String) -> bool {
        piece.is_empty() || self.sink.send(Event::Text(piece))
    }
}
