//! From sampled tokens to what a caller sees: streamed text that never shows part of a stop string
//! or of a UTF-8 character, where generation ends and why, and llama-server's `timings`.

use std::time::Instant;

use crate::tokenizer::{StreamDecoder, Tokenizer};

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

/// How a request's grammar ended its output (a [`FinishReason::Stop`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrammarEnd {
    /// The output completes the grammar.
    Complete,
    /// The grammar admits no token after the output so far (it cannot be completed from there):
    /// the request's grammar ran into a dead end, and the output stops before it.
    DeadEnd,
}

impl GrammarEnd {
    pub fn describe(self) -> &'static str {
        match self {
            GrammarEnd::Complete => "the output completes the grammar",
            GrammarEnd::DeadEnd => "the grammar admits no further token",
        }
    }
}

/// llama-server's `timings` fields.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timings {
    /// Prompt tokens run through the model (the rest came from the prefix cache).
    pub prompt_n: usize,
    /// Prompt tokens resumed from the prefix cache.
    pub cache_n: usize,
    pub prompt_ms: f64,
    pub predicted_n: usize,
    pub predicted_ms: f64,
    /// Images the vision tower encoded for the prompt, and the milliseconds it took (images
    /// resumed from a cache are not encoded again).
    pub images_encoded: usize,
    pub image_encode_ms: f64,
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
        let mut t = serde_json::json!({
            "prompt_n": self.prompt_n,
            "cache_n": self.cache_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": per_token(self.prompt_ms, self.prompt_n),
            "prompt_per_second": self.prompt_per_second(),
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": per_token(self.predicted_ms, self.predicted_n),
            "predicted_per_second": self.predicted_per_second(),
        });
        if self.images_encoded > 0 {
            t["images_encoded"] = self.images_encoded.into();
            t["image_encode_ms"] = self.image_encode_ms.into();
        }
        t
    }
}

fn rate(n: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        n as f64 * 1000.0 / ms
    } else {
        0.0
    }
}

pub(crate) fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
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

/// Turns one request's sampled tokens into text and decides where its generation ends:
/// end-of-generation tokens, stop strings, the token budget or a full context.
pub struct TextOut<'t> {
    tokenizer: &'t Tokenizer,
    decoder: StreamDecoder<'t>,
    stops: StopMatcher,
    n_predict: Option<usize>,
    ignore_eos: bool,
    /// Every token that counts as output (an end-of-generation token that ends it does not).
    tokens: Vec<u32>,
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
            tokens: Vec::new(),
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
        self.tokens.push(token);
        let (piece, hit) = self.stops.push(&self.decoder.push(token));
        if hit {
            self.hit_stop = true;
            self.finished = Some(FinishReason::Stop);
        } else if self.n_predict.is_some_and(|n| self.tokens.len() >= n)
            || n_ctx.saturating_sub(pos) == 0
        {
            self.finished = Some(FinishReason::Length);
        }
        (piece, self.finished)
    }

    /// Tokens of the output so far.
    /// The output's tokens so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Tokens the budget still allows (`usize::MAX` when unbounded).
    pub fn budget_left(&self) -> usize {
        self.n_predict
            .map(|n| n.saturating_sub(self.tokens.len()))
            .unwrap_or(usize::MAX)
    }

    /// Text still held back (an unfinished character, a possible stop-string prefix), and the
    /// output's tokens.
    pub fn finish(&mut self) -> (String, Vec<u32>) {
        let tokens = std::mem::take(&mut self.tokens);
        if self.hit_stop {
            return (String::new(), tokens);
        }
        let (mut rest, hit) = self.stops.push(&self.decoder.flush());
        if !hit {
            rest.push_str(&self.stops.finish());
        }
        (rest, tokens)
    }
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
