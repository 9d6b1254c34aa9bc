//! Plain (non-speculative) generation for one sequence: chunked prefill, then one decode step per
//! token, streaming text as it becomes valid UTF-8 and stopping on end-of-generation tokens,
//! stop strings, the token budget or a full context.

use std::time::Instant;

use nextn_model::{ForwardOutput, LogitRows, Model, ModelError, SequenceState};
use nextn_quant::kernels::ThreadPool;

use crate::sampler::Sampler;
use crate::tokenizer::{StreamDecoder, Tokenizer};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("the prompt is empty: at least one token is needed")]
    EmptyPrompt,
    #[error("the prompt has {n_prompt} tokens, but the context holds {n_ctx} (at least one more is needed to generate)")]
    PromptTooLong { n_prompt: usize, n_ctx: usize },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// The token budget or the context ran out.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// llama-server's `timings` fields.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timings {
    pub prompt_n: usize,
    pub prompt_ms: f64,
    pub predicted_n: usize,
    pub predicted_ms: f64,
}

impl Timings {
    pub fn prompt_per_second(&self) -> f64 {
        rate(self.prompt_n, self.prompt_ms)
    }

    pub fn predicted_per_second(&self) -> f64 {
        rate(self.predicted_n, self.predicted_ms)
    }

    pub fn to_json(&self) -> serde_json::Value {
        let per_token = |ms: f64, n: usize| if n > 0 { ms / n as f64 } else { 0.0 };
        serde_json::json!({
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": per_token(self.prompt_ms, self.prompt_n),
            "prompt_per_second": self.prompt_per_second(),
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": per_token(self.predicted_ms, self.predicted_n),
            "predicted_per_second": self.predicted_per_second(),
        })
    }
}

fn rate(n: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        n as f64 * 1000.0 / ms
    } else {
        0.0
    }
}

#[derive(Clone, Debug)]
pub struct GenerateParams {
    /// Most tokens to generate; `None` runs until an end-of-generation token or a full context.
    pub n_predict: Option<usize>,
    /// Rows per prefill pass.
    pub n_batch: usize,
    /// Keep going past end-of-generation tokens.
    pub ignore_eos: bool,
    /// Generation ends when the text contains one of these; the stop string is not returned.
    pub stop: Vec<String>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            n_predict: None,
            n_batch: 512,
            ignore_eos: false,
            stop: Vec::new(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
    pub timings: Timings,
}

/// Holds back text that could still turn into a stop string, so streamed output never shows
/// part of one.
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// Add text; returns (text safe to emit, whether a stop string was hit).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in self.pending.char_indices() {
                let tail = &self.pending[i..];
                if s.starts_with(tail) {
                    keep = keep.max(tail.len());
                    break;
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// Whatever is still held back, at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// One prefill chunk that keeps every row's hidden state (the NextN head needs them); logits only
/// for the last row when `last` is set.
pub fn prefill_with_hidden(
    model: &Model,
    state: &mut SequenceState,
    chunk: &[u32],
    last: bool,
    pool: &ThreadPool,
) -> Result<ForwardOutput, EngineError> {
    let rows = if last {
        LogitRows::Last
    } else {
        LogitRows::None
    };
    Ok(model.forward(chunk, state, rows, pool)?)
}

/// Run the prompt through the model in chunks of `n_batch` rows, returning the last row's logits.
pub fn prefill(
    model: &Model,
    state: &mut SequenceState,
    prompt: &[u32],
    n_batch: usize,
    pool: &ThreadPool,
) -> Result<Vec<f32>, EngineError> {
    if prompt.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    if state.n_past + prompt.len() >= state.n_ctx {
        return Err(EngineError::PromptTooLong {
            n_prompt: state.n_past + prompt.len(),
            n_ctx: state.n_ctx,
        });
    }
    let chunks: Vec<&[u32]> = prompt.chunks(n_batch.max(1)).collect();
    let mut logits = Vec::new();
    for (i, chunk) in chunks.iter().enumerate() {
        let rows = if i + 1 == chunks.len() {
            LogitRows::Last
        } else {
            LogitRows::None
        };
        logits = model.forward(chunk, state, rows, pool)?.logits;
    }
    Ok(logits)
}

/// Turns sampled tokens into streamed text and decides when generation ends: end-of-generation
/// tokens, stop strings, the token budget, a full context or a caller that stops listening.
/// Plain and speculative generation share it, so they end in exactly the same place.
pub struct Emitter<'a, F: FnMut(&str) -> bool> {
    tokenizer: &'a Tokenizer,
    decoder: StreamDecoder<'a>,
    stops: StopMatcher,
    params: &'a GenerateParams,
    on_text: F,
    pub text: String,
    pub tokens: Vec<u32>,
    finished: Option<FinishReason>,
    hit_stop: bool,
}

impl<'a, F: FnMut(&str) -> bool> Emitter<'a, F> {
    pub fn new(tokenizer: &'a Tokenizer, params: &'a GenerateParams, on_text: F) -> Self {
        Emitter {
            tokenizer,
            decoder: StreamDecoder::new(tokenizer),
            stops: StopMatcher::new(&params.stop),
            params,
            on_text,
            text: String::new(),
            tokens: Vec::new(),
            finished: None,
            hit_stop: false,
        }
    }

    /// Emit one sampled token; returns the finish reason once generation must end.
    /// `context_left` is how many more positions the sequence can take after this token.
    pub fn push(&mut self, token: u32, context_left: usize) -> Option<FinishReason> {
        if self.finished.is_some() {
            return self.finished;
        }
        if self.tokenizer.is_eog(token) && !self.params.ignore_eos {
            self.finished = Some(FinishReason::Stop);
            return self.finished;
        }
        self.tokens.push(token);
        let (piece, hit) = self.stops.push(&self.decoder.push(token));
        if !piece.is_empty() {
            self.text.push_str(&piece);
            if !(self.on_text)(&piece) {
                self.finished = Some(FinishReason::Stop);
                return self.finished;
            }
        }
        if hit {
            self.hit_stop = true;
            self.finished = Some(FinishReason::Stop);
        } else if self
            .params
            .n_predict
            .is_some_and(|n| self.tokens.len() >= n)
            || context_left == 0
        {
            self.finished = Some(FinishReason::Length);
        }
        self.finished
    }

    /// Tokens still allowed by the budget (`usize::MAX` when unbounded).
    pub fn budget_left(&self) -> usize {
        self.params
            .n_predict
            .map(|n| n.saturating_sub(self.tokens.len()))
            .unwrap_or(usize::MAX)
    }

    /// Flush held-back text and return (text, tokens, finish reason).
    pub fn finish(mut self) -> (String, Vec<u32>, FinishReason) {
        if !self.hit_stop {
            // Bytes of an unfinished character and text held back for a possible stop string.
            let (mut rest, hit) = self.stops.push(&self.decoder.flush());
            if !hit {
                rest.push_str(&self.stops.finish());
            }
            if !rest.is_empty() {
                self.text.push_str(&rest);
                (self.on_text)(&rest);
            }
        }
        (
            self.text,
            self.tokens,
            self.finished.unwrap_or(FinishReason::Length),
        )
    }
}

/// Generate after `prompt`, calling `on_text` with each newly complete piece of text.
/// `on_text` returns false to stop early (e.g. the client went away).
#[allow(clippy::too_many_arguments)]
pub fn generate(
    model: &Model,
    tokenizer: &Tokenizer,
    pool: &ThreadPool,
    state: &mut SequenceState,
    prompt: &[u32],
    params: &GenerateParams,
    sampler: &mut Sampler,
    on_text: impl FnMut(&str) -> bool,
) -> Result<Generation, EngineError> {
    let t0 = Instant::now();
    for &t in prompt {
        sampler.accept(t);
    }
    let mut logits = prefill(model, state, prompt, params.n_batch, pool)?;
    let mut timings = Timings {
        prompt_n: prompt.len(),
        prompt_ms: ms_since(t0),
        ..Default::default()
    };

    let t1 = Instant::now();
    let mut emitter = Emitter::new(tokenizer, params, on_text);
    loop {
        let token = sampler.sample(&logits);
        sampler.accept(token);
        if emitter.push(token, state.remaining()).is_some() {
            break;
        }
        logits = model
            .forward(&[token], state, LogitRows::Last, pool)?
            .logits;
    }
    let (text, tokens, finish) = emitter.finish();
    timings.predicted_n = tokens.len();
    timings.predicted_ms = ms_since(t1);
    Ok(Generation {
        tokens,
        text,
        finish,
        timings,
    })
}

pub(crate) fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_matcher_holds_back_prefixes() {
        let mut m = StopMatcher::new(&["</s>".to_string()]);
        assert_eq!(m.push("hello <"), ("hello ".to_string(), false));
        assert_eq!(m.push("/"), (String::new(), false));
        assert_eq!(m.push("x"), ("</x".to_string(), false));
        assert_eq!(m.push("ab</s>cd"), ("ab".to_string(), true));
    }

    #[test]
    fn stop_matcher_without_stops_passes_through() {
        let mut m = StopMatcher::new(&[]);
        assert_eq!(m.push("abc"), ("abc".to_string(), false));
        assert_eq!(m.finish(), "");
    }
}
