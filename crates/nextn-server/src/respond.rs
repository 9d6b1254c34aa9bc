//! The response side: scheduler events to an OpenAI JSON body or to SSE `data:` chunks.
//!
//! Generated text goes through the request's tool-call parser (calls are taken out of the text
//! wherever they are, also inside a reasoning block), then through the reasoning splitter
//! (`<think>…</think>` to `reasoning_content`), and what is left is `content`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use nextn_engine::output::FinishReason;
use nextn_engine::sampler::TokenLogprob;
use nextn_engine::scheduler::{Completion, Event, EventSink, FailKind};
use nextn_engine::tokenizer::Tokenizer;
use serde_json::{json, Value};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use crate::error::ApiError;
use crate::reasoning::ReasoningSplitter;
use crate::tools::{ToolCall, ToolCallParser, ToolEvent};
use crate::App;

/// A request's event channel as the scheduler sees it.
pub(crate) struct ChannelSink(pub UnboundedSender<Event>);

impl EventSink for ChannelSink {
    fn send(&mut self, event: Event) -> bool {
        self.0.send(event).is_ok()
    }
    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Chat,
    Completion,
    /// llama-server's own `/completion`: `content`, `stop`, `tokens_predicted`, ... instead of
    /// OpenAI's envelope.
    Native,
}

pub(crate) fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// How a request's answer is cut into parts.
pub(crate) struct Shaping {
    pub splitter: Option<ReasoningSplitter>,
    pub tools: Option<ToolCallParser>,
    /// Answer a legacy `functions` request with `function_call`.
    pub legacy_functions: bool,
    /// Log probabilities were asked for (chat shape or completions shape by endpoint).
    pub logprobs: bool,
    /// Send the generated token ids (`return_tokens`): `tokens` in the choice (the last chunk's
    /// when streaming), or in the native `/completion` object.
    pub return_tokens: bool,
    /// Native `/completion`: the processed `prompt` and the `generation_settings` its last
    /// object carries.
    pub native: Option<Value>,
}

/// One part of the answer, in order.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Part {
    Reasoning(String),
    Content(String),
    /// Tool call `index` begins: its id and function name.
    CallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// The next piece of tool call `index`'s arguments JSON.
    CallArguments {
        index: usize,
        text: String,
    },
}

/// How one request's answer is shaped.
pub(crate) struct Reply {
    app: Arc<App>,
    tokenizer: Arc<Tokenizer>,
    endpoint: Endpoint,
    id: String,
    created: u64,
    include_usage: bool,
    shaping: Shaping,
    calls: Vec<(String, ToolCall)>,
    /// The call being streamed as it is written: its index, id and the bytes of its arguments
    /// sent.
    open_call: Option<(usize, String, usize)>,
    /// The answer goes out as a stream (a started call has been shown already when generation
    /// leaves it unfinished).
    streaming: bool,
    /// A call's markup was cut off by the end of generation.
    unfinished_call: bool,
    /// Log probabilities not yet sent with a chunk.
    pending_logprobs: Vec<TokenLogprob>,
    /// Bytes of completion text so far (for `text_offset`).
    text_offset: usize,
}

impl Reply {
    pub fn new(
        app: Arc<App>,
        tokenizer: Arc<Tokenizer>,
        endpoint: Endpoint,
        include_usage: bool,
        shaping: Shaping,
    ) -> Self {
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completion | Endpoint::Native => "cmpl",
        };
        let id = format!("{prefix}-{:016x}", crate::request::fresh_seed());
        Reply {
            app,
            tokenizer,
            endpoint,
            id,
            created: unix_time(),
            include_usage,
            shaping,
            calls: Vec::new(),
            open_call: None,
            streaming: false,
            unfinished_call: false,
            pending_logprobs: Vec::new(),
            text_offset: 0,
        }
    }

    /// The complete calls so far, each with its id.
    pub(crate) fn calls(&self) -> &[(String, ToolCall)] {
        &self.calls
    }

    /// The answer goes out as it is generated: a call whose markup generation leaves unfinished
    /// has been shown as that call, not as text.
    pub(crate) fn set_streaming(&mut self) {
        self.streaming = true;
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion | Endpoint::Native, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.app.cfg.model_id,
            "system_fingerprint": concat!("nextn-", env!("CARGO_PKG_VERSION")),
            "choices": choices,
        })
    }

    /// Text after the reasoning splitter.
    fn split(&mut self, text: &str, parts: &mut Vec<Part>) {
        let (r, c) = match &mut self.shaping.splitter {
            Some(s) => s.push(text),
            None => (String::new(), text.to_string()),
        };
        push_text(parts, r, c);
    }

    /// A piece of generated text into parts.
    pub(crate) fn parts(&mut self, text: &str) -> Vec<Part> {
        let mut parts = Vec::new();
        let events = match &mut self.shaping.tools {
            Some(p) => p.push(text),
            None => vec![ToolEvent::Text(text.to_string())],
        };
        self.route(events, &mut parts);
        parts
    }

    fn route(&mut self, events: Vec<ToolEvent>, parts: &mut Vec<Part>) {
        let fresh_id = || format!("call_{:016x}", crate::request::fresh_seed());
        for e in events {
            match e {
                ToolEvent::Text(t) => self.split(&t, parts),
                // A stream has shown the markup as the call; a whole answer returns it as text.
                ToolEvent::Unfinished(_) if self.streaming => {}
                ToolEvent::Unfinished(t) => self.split(&t, parts),
                ToolEvent::CallStart(name) => {
                    let (index, id) = (self.calls.len(), fresh_id());
                    self.open_call = Some((index, id.clone(), 0));
                    parts.push(Part::CallStart { index, id, name });
                }
                ToolEvent::ArgumentsDelta(text) => {
                    if let Some((index, _, sent)) = &mut self.open_call {
                        *sent += text.len();
                        parts.push(Part::CallArguments {
                            index: *index,
                            text,
                        });
                    }
                }
                ToolEvent::Call(c) => {
                    let json = c.arguments_json();
                    // The call that was being streamed gets the rest of its arguments (the
                    // parser keeps what was sent a prefix of them).
                    let (index, id, sent) = match self.open_call.take() {
                        Some(open) => open,
                        None => {
                            let (index, id) = (self.calls.len(), fresh_id());
                            parts.push(Part::CallStart {
                                index,
                                id: id.clone(),
                                name: c.name.clone(),
                            });
                            (index, id, 0)
                        }
                    };
                    let rest = json.get(sent..).unwrap_or_default();
                    if !rest.is_empty() {
                        parts.push(Part::CallArguments {
                            index,
                            text: rest.to_string(),
                        });
                    }
                    self.calls.push((id, c));
                }
            }
        }
    }

    /// What is left at the end of generation.
    pub(crate) fn finish_parts(&mut self) -> Vec<Part> {
        let mut parts = Vec::new();
        if let Some(p) = &mut self.shaping.tools {
            let (events, unfinished) = p.finish();
            self.unfinished_call = unfinished;
            self.route(events, &mut parts);
        }
        let (r, c) = match &mut self.shaping.splitter {
            Some(s) => s.finish(),
            None => (String::new(), String::new()),
        };
        push_text(&mut parts, r, c);
        parts
    }

    pub(crate) fn finish_reason(&self, c: &Completion) -> &'static str {
        if self.unfinished_call {
            // Markup cut off by the budget or a stop string: it came back as text.
            return "length";
        }
        match c.finish.as_str() {
            "stop" if !self.calls.is_empty() && self.shaping.legacy_functions => "function_call",
            "stop" if !self.calls.is_empty() => "tool_calls",
            other => other,
        }
    }

    /// The chat `logprobs` object, or the completions one, for some tokens.
    fn logprobs_json(&mut self, tokens: &[TokenLogprob]) -> Value {
        let tok = &self.tokenizer;
        let text = |id: u32| tok.decode(&[id]);
        let bytes = |id: u32| tok.token_bytes(id).to_vec();
        let per_token = || {
            tokens
                .iter()
                .map(|t| {
                    json!({
                        "id": t.id,
                        "token": text(t.id),
                        "logprob": t.logprob,
                        "bytes": bytes(t.id),
                        "top_logprobs": t.top.iter().map(|&(id, lp)| json!({
                            "id": id, "token": text(id), "logprob": lp, "bytes": bytes(id),
                        })).collect::<Vec<_>>(),
                    })
                })
                .collect::<Vec<_>>()
        };
        match self.endpoint {
            Endpoint::Chat => json!({ "content": per_token() }),
            // llama-server's `completion_probabilities`.
            Endpoint::Native => json!(per_token()),
            Endpoint::Completion => {
                let mut offsets = Vec::new();
                for t in tokens {
                    offsets.push(self.text_offset);
                    self.text_offset += tok.token_bytes(t.id).len();
                }
                json!({
                    "tokens": tokens.iter().map(|t| text(t.id)).collect::<Vec<_>>(),
                    "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                    "top_logprobs": tokens.iter().map(|t| {
                        let mut m = serde_json::Map::new();
                        for &(id, lp) in &t.top {
                            m.insert(text(id), json!(lp));
                        }
                        Value::Object(m)
                    }).collect::<Vec<_>>(),
                    "text_offset": offsets,
                })
            }
        }
    }

    /// The log probabilities collected so far for the next chunk (`null` when none were asked).
    fn take_logprobs(&mut self) -> Value {
        if !self.shaping.logprobs {
            return Value::Null;
        }
        let pending = std::mem::take(&mut self.pending_logprobs);
        self.logprobs_json(&pending)
    }

    pub(crate) fn log(&self, c: &Completion) {
        if !self.app.cfg.log_requests {
            return;
        }
        let t = &c.timings;
        let mut line = format!(
            "slot {}: prompt {} tokens {:.1} ms, generated {} tokens {:.1} ms ({:.1} tok/s), finish {}",
            c.slot,
            t.prompt_n,
            t.prompt_ms,
            t.predicted_n,
            t.predicted_ms,
            t.predicted_per_second(),
            self.finish_reason(c)
        );
        if c.spec.draft_n > 0 {
            line += &format!(
                ", draft acceptance = {:.5} ({} accepted / {} drafted)",
                c.spec.acceptance_rate(),
                c.spec.draft_n_accepted,
                c.spec.draft_n
            );
        }
        if let Some((ms, n)) = c.grammar_masks {
            line += &format!(", grammar {n} masks in {ms:.1} ms");
        }
        eprintln!("{line}");
    }
}

/// Reasoning and content text as parts, joined to the previous part of the same kind.
fn push_text(parts: &mut Vec<Part>, reasoning: String, content: String) {
    if !reasoning.is_empty() {
        match parts.last_mut() {
            Some(Part::Reasoning(r)) => r.push_str(&reasoning),
            _ => parts.push(Part::Reasoning(reasoning)),
        }
    }
    if !content.is_empty() {
        match parts.last_mut() {
            Some(Part::Content(c)) => c.push_str(&content),
            _ => parts.push(Part::Content(content)),
        }
    }
}

fn timings(c: &Completion) -> Value {
    let mut t = c.timings.to_json();
    t["draft_n"] = json!(c.spec.draft_n);
    t["draft_n_accepted"] = json!(c.spec.draft_n_accepted);
    if let Some((ms, n)) = c.grammar_masks {
        t["grammar_ms"] = json!(ms);
        t["grammar_masks"] = json!(n);
    }
    t
}

fn usage(c: &Completion) -> Value {
    json!({
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": c.timings.cache_n},
    })
}

pub(crate) fn failure(kind: FailKind, message: String) -> ApiError {
    let status = StatusCode::from_u16(kind.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let ty = match kind {
        FailKind::Invalid => "invalid_request_error",
        FailKind::Shutdown => "unavailable_error",
        FailKind::Internal => "server_error",
    };
    ApiError::new(status, ty, message)
}

/// A call as OpenAI's `tool_calls[i]`.
fn tool_call_json(id: &str, call: &ToolCall) -> Value {
    json!({
        "id": id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json()},
    })
}

/// Wait until the request has a slot (or failed), so a failure still gets its own status.
pub(crate) async fn started(rx: &mut UnboundedReceiver<Event>) -> Result<(), ApiError> {
    match rx.recv().await {
        Some(Event::Started { .. }) => Ok(()),
        Some(Event::Failed { kind, message }) => Err(failure(kind, message)),
        Some(_) => Err(ApiError::internal("the engine answered out of order")),
        None => Err(ApiError::unavailable("the server is shutting down")),
    }
}

/// The events of a request answered whole, every API's: each piece of text to `on_text`, the
/// log probabilities into `logprobs`, up to the completion (or the failure, as an error).
pub(crate) async fn collect_events(
    rx: &mut UnboundedReceiver<Event>,
    mut on_text: impl FnMut(&str),
    logprobs: &mut Vec<TokenLogprob>,
) -> Result<Completion, ApiError> {
    started(rx).await?;
    loop {
        match rx.recv().await {
            Some(Event::Text(t)) => on_text(&t),
            Some(Event::Logprobs(l)) => logprobs.extend(l),
            Some(Event::Done(c)) => return Ok(c),
            Some(Event::Failed { kind, message }) => return Err(failure(kind, message)),
            Some(Event::Started { .. } | Event::PromptProgress { .. }) => {}
            None => {
                return Err(ApiError::internal(
                    "the engine stopped before the request finished",
                ))
            }
        }
    }
}

pub(crate) async fn collect(
    mut rx: UnboundedReceiver<Event>,
    mut reply: Reply,
) -> Result<Response, ApiError> {
    let mut parts = Vec::new();
    let mut logprobs = Vec::new();
    let completion =
        collect_events(&mut rx, |t| parts.extend(reply.parts(t)), &mut logprobs).await?;
    parts.extend(reply.finish_parts());
    reply.log(&completion);
    let (mut reasoning, mut content) = (String::new(), String::new());
    for p in &parts {
        match p {
            Part::Reasoning(r) => reasoning.push_str(r),
            Part::Content(c) => content.push_str(c),
            Part::CallStart { .. } | Part::CallArguments { .. } => {}
        }
    }
    let finish = reply.finish_reason(&completion);
    let logprobs = if reply.shaping.logprobs {
        reply.logprobs_json(&logprobs)
    } else {
        Value::Null
    };
    let choice = match reply.endpoint {
        Endpoint::Chat => {
            let calls = &reply.calls;
            let mut message = json!({
                "role": "assistant",
                "content": if content.is_empty() && !calls.is_empty() { Value::Null } else { json!(content) },
            });
            if !reasoning.is_empty() {
                message["reasoning_content"] = json!(reasoning);
            }
            if !calls.is_empty() {
                if reply.shaping.legacy_functions {
                    let (_, c) = &calls[0];
                    message["function_call"] =
                        json!({"name": c.name, "arguments": c.arguments_json()});
                } else {
                    message["tool_calls"] =
                        calls.iter().map(|(id, c)| tool_call_json(id, c)).collect();
                }
            }
            json!({"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish})
        }
        Endpoint::Completion => {
            json!({"index": 0, "text": content, "logprobs": logprobs, "finish_reason": finish})
        }
        Endpoint::Native => {
            let mut body = native_final(&reply, &completion, content);
            if reply.shaping.logprobs {
                body["completion_probabilities"] = logprobs;
            }
            return Ok((
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/json; charset=utf-8")],
                body.to_string(),
            )
                .into_response());
        }
    };
    let mut choice = choice;
    if reply.shaping.return_tokens {
        choice["tokens"] = json!(completion.tokens);
    }
    let mut body = reply.envelope(false, json!([choice]));
    body["usage"] = usage(&completion);
    body["timings"] = timings(&completion);
    body["id_slot"] = json!(completion.slot);
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json; charset=utf-8")],
        body.to_string(),
    )
        .into_response())
}

/// llama-server's `stop_type`: how generation ended.
fn stop_type(c: &Completion) -> &'static str {
    match c.finish {
        FinishReason::Length => "limit",
        FinishReason::Stop => "eos",
    }
}

/// The last object of a native `/completion` (the whole answer when not streaming).
fn native_final(reply: &Reply, c: &Completion, content: String) -> Value {
    let mut v = json!({
        "index": 0,
        "content": content,
        "tokens": if reply.shaping.return_tokens { json!(c.tokens) } else { json!([]) },
        "id_slot": c.slot,
        "stop": true,
        "model": reply.app.cfg.model_id,
        "tokens_predicted": c.completion_tokens,
        "tokens_evaluated": c.prompt_tokens,
        "truncated": false,
        "stop_type": stop_type(c),
        "stopping_word": "",
        "tokens_cached": c.timings.cache_n,
        "timings": timings(c),
    });
    if let Some(Value::Object(meta)) = &reply.shaping.native {
        for (k, x) in meta {
            v[k] = x.clone();
        }
    }
    v
}

/// Work a stream runs off the async threads before its next frame (storing a finished
/// response, say), so the frame that tells the client it is done comes after it.
pub(crate) type BlockingJob = Box<dyn FnOnce() + Send>;

/// How long a stream may go without a frame before it sends one that says it is alive: proxies
/// commonly cut connections idle for 60-100 s, and a long prefill or a thinking phase whose text
/// is not shown sends nothing.
pub(crate) const IDLE_FRAME_AFTER: std::time::Duration = std::time::Duration::from_secs(15);

/// The state of one server-sent-events answer: frames ready to send, whether it has ended, and
/// the request's event channel, whose events `on_event` turns into frames in the API's shape.
pub(crate) trait SseFrames: Send + 'static {
    fn next_frame(&mut self) -> Option<Bytes>;
    fn finished(&self) -> bool;
    fn events(&mut self) -> &mut UnboundedReceiver<Event>;
    fn on_event(&mut self, event: Option<Event>);
    /// Nothing happened for [`IDLE_FRAME_AFTER`]: queue the API's keep-alive frame.
    fn idle(&mut self);
    /// Work to finish before the next frame goes out.
    fn take_blocking(&mut self) -> Option<BlockingJob> {
        None
    }
}

/// An SSE comment: every SSE reader skips it, and the connection carries bytes.
pub(crate) fn keep_alive_comment() -> Bytes {
    Bytes::from_static(b": keep-alive\n\n")
}

/// A streamed answer: the frames of `state` as they are made, until it has ended.
pub(crate) fn sse_response(state: impl SseFrames) -> Response {
    let body = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            // A job is queued with the frames that follow it (the last ones, when a finished
            // response is kept), so it runs before any queued frame goes out.
            if let Some(job) = st.take_blocking() {
                // A job that panicked leaves the stream to go on with what it has.
                let _ = tokio::task::spawn_blocking(job).await;
                continue;
            }
            if let Some(f) = st.next_frame() {
                return Some((Ok::<Bytes, Infallible>(f), st));
            }
            if st.finished() {
                return None;
            }
            match tokio::time::timeout(IDLE_FRAME_AFTER, st.events().recv()).await {
                Ok(ev) => st.on_event(ev),
                Err(_) => st.idle(),
            }
        }
    });
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

/// The three fields every API's stream state keeps under the same names (`frames`, `finished`,
/// `rx`), its keep-alive frame (`idle_frame`), and with `blocking`, a `blocking` field of work to
/// finish before the next frame.
macro_rules! sse_frames {
    ($state:ty) => {
        $crate::respond::sse_frames!(@impl $state, {});
    };
    ($state:ty, blocking) => {
        $crate::respond::sse_frames!(@impl $state, {
            fn take_blocking(&mut self) -> Option<$crate::respond::BlockingJob> {
                self.blocking.take()
            }
        });
    };
    (@impl $state:ty, { $($extra:tt)* }) => {
        impl $crate::respond::SseFrames for $state {
            fn next_frame(&mut self) -> Option<axum::body::Bytes> {
                self.frames.pop_front()
            }
            fn finished(&self) -> bool {
                self.finished
            }
            fn events(
                &mut self,
            ) -> &mut tokio::sync::mpsc::UnboundedReceiver<nextn_engine::scheduler::Event> {
                &mut self.rx
            }
            fn on_event(&mut self, event: Option<nextn_engine::scheduler::Event>) {
                <$state>::on_event(self, event)
            }
            fn idle(&mut self) {
                let frame = <$state>::idle_frame();
                self.frames.push_back(frame);
            }
            $($extra)*
        }
    };
}
pub(crate) use sse_frames;

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

sse_frames!(SseState);

struct SseState {
    rx: UnboundedReceiver<Event>,
    reply: Reply,
    frames: VecDeque<Bytes>,
    finished: bool,
}

impl SseState {
    fn idle_frame() -> Bytes {
        keep_alive_comment()
    }

    fn chunk(&mut self, delta: Value) {
        let logprobs = self.reply.take_logprobs();
        let choice =
            json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": null});
        let v = self.reply.envelope(true, json!([choice]));
        self.frames.push_back(sse(&v));
    }

    fn part_chunks(&mut self, parts: Vec<Part>) {
        for p in parts {
            match (self.reply.endpoint, p) {
                (Endpoint::Completion, Part::Content(text) | Part::Reasoning(text)) => {
                    let logprobs = self.reply.take_logprobs();
                    let choice = json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": null});
                    let v = self.reply.envelope(true, json!([choice]));
                    self.frames.push_back(sse(&v));
                }
                (
                    Endpoint::Completion | Endpoint::Native,
                    Part::CallStart { .. } | Part::CallArguments { .. },
                ) => {}
                (Endpoint::Native, Part::Content(text) | Part::Reasoning(text)) => {
                    let mut v = json!({"index": 0, "content": text, "tokens": [], "stop": false});
                    if self.reply.shaping.logprobs {
                        v["completion_probabilities"] = self.reply.take_logprobs();
                    }
                    self.frames.push_back(sse(&v));
                }
                (Endpoint::Chat, Part::Content(c)) => self.chunk(json!({"content": c})),
                (Endpoint::Chat, Part::Reasoning(r)) => self.chunk(json!({"reasoning_content": r})),
                // A legacy `function_call` answer carries the first call alone.
                (Endpoint::Chat, Part::CallStart { index, id, name }) => {
                    if !self.reply.shaping.legacy_functions {
                        self.chunk(json!({"tool_calls": [{
                            "index": index, "id": id, "type": "function",
                            "function": {"name": name, "arguments": ""},
                        }]}));
                    } else if index == 0 {
                        self.chunk(json!({"function_call": {"name": name, "arguments": ""}}));
                    }
                }
                (Endpoint::Chat, Part::CallArguments { index, text }) => {
                    if !self.reply.shaping.legacy_functions {
                        self.chunk(json!({"tool_calls": [{
                            "index": index,
                            "function": {"arguments": text},
                        }]}));
                    } else if index == 0 {
                        self.chunk(json!({"function_call": {"arguments": text}}));
                    }
                }
            }
        }
    }

    fn on_event(&mut self, event: Option<Event>) {
        match event {
            Some(Event::Text(t)) => {
                let parts = self.reply.parts(&t);
                self.part_chunks(parts);
            }
            Some(Event::Logprobs(l)) => self.reply.pending_logprobs.extend(l),
            Some(Event::Done(c)) => {
                let parts = self.reply.finish_parts();
                self.part_chunks(parts);
                self.reply.log(&c);
                if self.reply.endpoint == Endpoint::Native {
                    let mut last = native_final(&self.reply, &c, String::new());
                    if self.reply.shaping.logprobs {
                        last["completion_probabilities"] = self.reply.take_logprobs();
                    }
                    self.frames.push_back(sse(&last));
                    self.finished = true;
                    return;
                }
                let finish = self.reply.finish_reason(&c);
                let logprobs = self.reply.take_logprobs();
                let choice = match self.reply.endpoint {
                    Endpoint::Chat => {
                        json!({"index": 0, "delta": {}, "logprobs": logprobs, "finish_reason": finish})
                    }
                    Endpoint::Completion | Endpoint::Native => {
                        json!({"index": 0, "text": "", "logprobs": logprobs, "finish_reason": finish})
                    }
                };
                let mut choice = choice;
                if self.reply.shaping.return_tokens {
                    choice["tokens"] = json!(c.tokens);
                }
                let mut last = self.reply.envelope(true, json!([choice]));
                last["timings"] = timings(&c);
                last["id_slot"] = json!(c.slot);
                self.frames.push_back(sse(&last));
                if self.reply.include_usage {
                    let mut u = self.reply.envelope(true, json!([]));
                    u["usage"] = usage(&c);
                    u["timings"] = timings(&c);
                    self.frames.push_back(sse(&u));
                }
                self.frames
                    .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                self.finished = true;
            }
            Some(Event::Failed { kind, message }) => {
                self.end_with_error(failure(kind, message));
            }
            Some(Event::PromptProgress {
                total,
                cache,
                processed,
                time_ms,
            }) => {
                // llama-server's shape: an empty delta (or text) carrying `prompt_progress`.
                let progress = json!({
                    "total": total, "cache": cache, "processed": processed, "time_ms": time_ms,
                });
                let mut v = match self.reply.endpoint {
                    Endpoint::Chat => self.reply.envelope(
                        true,
                        json!([{"index": 0, "delta": {"role": "assistant", "content": null}, "logprobs": null, "finish_reason": null}]),
                    ),
                    Endpoint::Completion => self.reply.envelope(
                        true,
                        json!([{"index": 0, "text": "", "logprobs": null, "finish_reason": null}]),
                    ),
                    Endpoint::Native => {
                        json!({"index": 0, "content": "", "tokens": [], "stop": false})
                    }
                };
                v["prompt_progress"] = progress;
                self.frames.push_back(sse(&v));
            }
            Some(Event::Started { .. }) => {}
            None => {
                self.end_with_error(ApiError::internal(
                    "the engine stopped before the request finished",
                ));
            }
        }
    }

    /// The error event ends the stream; OpenAI streams still close with `[DONE]`, which their
    /// clients read as the end (the error, from a shutdown for instance, comes just before it).
    /// llama-server's native `/completion` stream has no end marker, so it ends with the error.
    fn end_with_error(&mut self, e: ApiError) {
        self.frames.push_back(sse(&e.body()));
        if self.reply.endpoint != Endpoint::Native {
            self.frames
                .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        }
        self.finished = true;
    }
}

pub(crate) async fn stream(
    mut rx: UnboundedReceiver<Event>,
    mut reply: Reply,
) -> Result<Response, ApiError> {
    started(&mut rx).await?;
    reply.streaming = true;
    let mut state = SseState {
        rx,
        reply,
        frames: VecDeque::new(),
        finished: false,
    };
    if state.reply.endpoint == Endpoint::Chat {
        let first = json!([{"index": 0, "delta": {"role": "assistant", "content": null}, "logprobs": null, "finish_reason": null}]);
        let v = state.reply.envelope(true, first);
        state.frames.push_back(sse(&v));
    }
    Ok(sse_response(state))
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use tokio::time::Instant;

    /// A stream whose events are text frames; its keep-alive frame is `idle`.
    struct Quiet {
        rx: UnboundedReceiver<Event>,
        frames: VecDeque<Bytes>,
        finished: bool,
        jobs: Vec<BlockingJob>,
    }

    impl SseFrames for Quiet {
        fn next_frame(&mut self) -> Option<Bytes> {
            self.frames.pop_front()
        }
        fn finished(&self) -> bool {
            self.finished
        }
        fn events(&mut self) -> &mut UnboundedReceiver<Event> {
            &mut self.rx
        }
        fn on_event(&mut self, event: Option<Event>) {
            match event {
                Some(Event::Text(t)) => self.frames.push_back(Bytes::from(t)),
                _ => {
                    self.frames.push_back(Bytes::from_static(b"done"));
                    self.finished = true;
                }
            }
        }
        fn idle(&mut self) {
            self.frames.push_back(Bytes::from_static(b"idle"));
        }
        fn take_blocking(&mut self) -> Option<BlockingJob> {
            self.jobs.pop()
        }
    }

    /// A stream with nothing to say sends its API's keep-alive frame every [`IDLE_FRAME_AFTER`]
    /// (a `ping` for Anthropic's clients, a comment for OpenAI's), and its events as they come.
    #[tokio::test(start_paused = true)]
    async fn a_quiet_stream_sends_a_keep_alive_frame_each_idle_period() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let state = Quiet {
            rx,
            frames: VecDeque::new(),
            finished: false,
            jobs: Vec::new(),
        };
        let mut body = sse_response(state).into_body().into_data_stream();
        let t0 = Instant::now();
        for n in 1..=3u32 {
            assert_eq!(body.next().await.unwrap().unwrap(), "idle");
            assert_eq!(t0.elapsed(), IDLE_FRAME_AFTER * n);
        }
        tx.send(Event::Text("token".into())).unwrap();
        assert_eq!(body.next().await.unwrap().unwrap(), "token");
        assert_eq!(t0.elapsed(), IDLE_FRAME_AFTER * 3);
        drop(tx);
        assert_eq!(body.next().await.unwrap().unwrap(), "done");
        assert!(body.next().await.is_none());
        // The keep-alive frames of the APIs: an SSE comment, Anthropic's ping event.
        assert_eq!(keep_alive_comment(), ": keep-alive\n\n");
        let ping = crate::anthropic::answer::ping_frame();
        assert_eq!(ping, "event: ping\ndata: {\"type\":\"ping\"}\n\n");
    }

    /// Work queued with the last frames runs before any of them goes out.
    #[tokio::test]
    async fn a_blocking_job_runs_before_the_frames_queued_with_it() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = ran.clone();
        let state = Quiet {
            rx,
            frames: VecDeque::from([Bytes::from_static(b"completed")]),
            finished: true,
            jobs: vec![Box::new(move || {
                std::thread::sleep(std::time::Duration::from_millis(50));
                flag.store(true, std::sync::atomic::Ordering::SeqCst);
            })],
        };
        drop(tx);
        let mut body = sse_response(state).into_body().into_data_stream();
        assert_eq!(body.next().await.unwrap().unwrap(), "completed");
        assert!(ran.load(std::sync::atomic::Ordering::SeqCst));
    }
}
