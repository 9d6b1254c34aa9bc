//! One busy slot: a request's sequence state, speculative state, sampler, text stream and
//! statistics.

use std::time::Instant;

use nextn_model::SequenceState;

use nextn_vision::ImageEmbedding;

use super::encoder::EncodeTicket;
use super::{Event, EventSink, Request};
use crate::grammar::Constraint;
use crate::media::PromptImage;
use crate::output::TextOut;
use crate::sampler::Sampler;
use crate::speculative::speculator::Speculator;
use crate::speculative::SpecStats;
use crate::tokenizer::Tokenizer;

/// Where one of a request's images stands with the encoder.
#[derive(Debug)]
pub enum Encoding {
    /// Not encoded for this request: its rows were resumed from a cache, or they have run.
    NotNeeded,
    /// Queued or being encoded.
    Waiting,
    /// Encoded; its rows run when the prompt reaches them.
    Ready(ImageEmbedding),
}

/// Where a slot's sequence stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// `prompt[..next]` has been run through the target.
    Prefill { next: usize },
    /// `id_last` was sampled and is not yet in the target's state; it will sit at `state.n_past`.
    Decode { id_last: u32 },
}

pub struct Slot<'t> {
    pub prompt: Vec<u32>,
    /// The prompt's images, in order.
    pub images: Vec<PromptImage>,
    /// Each image's embeddings, as the encoder delivers them.
    pub encodings: Vec<Encoding>,
    /// Cancels this request's encodes when the slot is dropped.
    pub encode_ticket: Option<EncodeTicket>,
    /// Images encoded for this request and the milliseconds it took.
    pub images_encoded: usize,
    pub image_encode_ms: f64,
    pub sink: Box<dyn EventSink>,
    pub sampler: Sampler,
    pub state: SequenceState,
    /// The head's state and what drafting measured for this request.
    pub spec: Speculator,
    pub stage: Stage,
    pub out: TextOut<'t>,
    /// Tokens sampled so far: the output index of the next draw.
    pub n_sampled: u64,
    pub stats: SpecStats,
    /// Record every step in `stats.trace`.
    pub trace: bool,
    pub grammar: Option<Constraint>,
    /// Send log probabilities with this many alternatives per token.
    pub logprobs: Option<usize>,
    /// Use and feed the prefix cache.
    pub cache_prompt: bool,
    /// Prompt positions to keep a snapshot at, ascending.
    pub cache_points: Vec<usize>,
    /// Send [`Event::PromptProgress`] while the prompt is processed.
    pub prompt_progress: bool,
    /// Prompt tokens resumed from the prefix cache.
    pub cache_n: usize,
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
        spec: Speculator,
        tokenizer: &'t Tokenizer,
        n_max: usize,
        seq_no: u64,
        cache_n: usize,
    ) -> Self {
        let Request {
            prompt,
            images,
            n_predict,
            stop,
            ignore_eos,
            trace,
            grammar,
            logprobs,
            cache_prompt,
            mut cache_points,
            prompt_progress,
            sink,
            ..
        } = request;
        cache_points.sort_unstable();
        cache_points.dedup();
        Slot {
            prompt,
            encodings: images.iter().map(|_| Encoding::NotNeeded).collect(),
            encode_ticket: None,
            images,
            images_encoded: 0,
            image_encode_ms: 0.0,
            sink,
            sampler,
            state,
            spec,
            stage: Stage::Prefill { next: cache_n },
            out: TextOut::new(tokenizer, &stop, n_predict, ignore_eos),
            n_sampled: 0,
            stats: SpecStats::new(n_max),
            trace,
            grammar,
            logprobs,
            cache_prompt,
            cache_points,
            prompt_progress,
            cache_n,
            t_start: Instant::now(),
            t_first_token: None,
            prompt_ms: 0.0,
            seq_no,
        }
    }

    /// Report that `processed` prompt tokens are in the state, when the request asked.
    pub fn report_prompt_progress(&mut self, processed: usize) {
        if self.prompt_progress {
            self.sink.send(Event::PromptProgress {
                total: self.prompt.len(),
                cache: self.cache_n,
                processed,
                time_ms: self.t_start.elapsed().as_secs_f64() * 1e3,
            });
        }
    }

    /// Where the prompt chunk starting at `next` must end at the latest: the next cache point
    /// or image. An image is a chunk of its own: one starting at `next` ends where it ends.
    pub fn chunk_limit(&self, next: usize) -> usize {
        if let Some(im) = self.image_at(next) {
            return im.end();
        }
        let next_image = self
            .images
            .iter()
            .map(|im| im.pos)
            .find(|&p| p > next)
            .unwrap_or(self.prompt.len());
        self.cache_points
            .iter()
            .copied()
            .find(|&p| p > next)
            .unwrap_or(self.prompt.len())
            .min(next_image)
            .min(self.prompt.len())
    }

    /// Whether the prompt has reached an image whose embeddings the encoder has not delivered
    /// yet: the slot then waits, out of the steps.
    pub fn waits_for_image(&self) -> bool {
        match self.stage {
            Stage::Prefill { next } => self
                .image_index_at(next)
                .is_some_and(|k| matches!(self.encodings[k], Encoding::Waiting)),
            Stage::Decode { .. } => false,
        }
    }

    /// The index of the image whose rows start at prompt position `pos`.
    pub fn image_index_at(&self, pos: usize) -> Option<usize> {
        self.images.iter().position(|im| im.pos == pos)
    }

    fn image_at(&self, pos: usize) -> Option<&PromptImage> {
        self.image_index_at(pos).map(|k| &self.images[k])
    }

    /// The committed tokens: the prompt, then the output, up to the state's position.
    pub fn committed_tokens(&self) -> Vec<u32> {
        let n = self.state.n_past;
        self.prompt
            .iter()
            .chain(self.out.tokens())
            .take(n)
            .copied()
            .collect()
    }

    /// Send text; false when the listener is gone.
    pub fn send_text(&mut self, piece: String) -> bool {
        piece.is_empty() || self.sink.send(Event::Text(piece))
    }
}
