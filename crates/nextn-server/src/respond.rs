//! The response side: scheduler events to an OpenAI JSON body or to SSE `data:` chunks.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use nextn_engine::scheduler::{Completion, Event, EventSink, FailKind};
use serde_json::{json, Value};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use crate::error::ApiError;
use crate::reasoning::ReasoningSplitter;
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
}

pub(crate) fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// How one request's answer is shaped.
pub(crate) struct Reply {
    app: Arc<App>,
    endpoint: Endpoint,
    id: String,
    created: u64,
    include_usage: bool,
    splitter: Option<ReasoningSplitter>,
}

impl Reply {
    pub fn new(
        app: Arc<App>,
        endpoint: Endpoint,
        include_usage: bool,
        splitter: Option<ReasoningSplitter>,
    ) -> Self {
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completion => "cmpl",
        };
        let id = format!("{prefix}-{:016x}", crate::request::fresh_seed());
        Reply {
            app,
            endpoint,
            id,
            created: unix_time(),
            include_usage,
            splitter,
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
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

    /// Text split into (reasoning, content) for this request.
    fn split(&mut self, text: &str) -> (String, String) {
        match &mut self.splitter {
            Some(s) => s.push(text),
            None => (String::new(), text.to_string()),
        }
    }

    fn split_finish(&mut self) -> (String, String) {
        match &mut self.splitter {
            Some(s) => s.finish(),
            None => (String::new(), String::new()),
        }
    }

    fn log(&self, c: &Completion) {
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
            c.finish.as_str()
        );
        if c.spec.draft_n > 0 {
            line += &format!(
                ", draft acceptance = {:.5} ({} accepted / {} drafted)",
                c.spec.acceptance_rate(),
                c.spec.draft_n_accepted,
                c.spec.draft_n
            );
        }
        eprintln!("{line}");
    }
}

fn timings(c: &Completion) -> Value {
    let mut t = c.timings.to_json();
    t["cache_n"] = json!(0);
    t["draft_n"] = json!(c.spec.draft_n);
    t["draft_n_accepted"] = json!(c.spec.draft_n_accepted);
    t
}

fn usage(c: &Completion) -> Value {
    json!({
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    })
}

fn failure(kind: FailKind, message: String) -> ApiError {
    let status = StatusCode::from_u16(kind.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let ty = match kind {
        FailKind::Invalid => "invalid_request_error",
        FailKind::Shutdown => "unavailable_error",
        FailKind::Internal => "server_error",
    };
    ApiError::new(status, ty, message)
}

/// Wait until the request has a slot (or failed), so a failure still gets its own status.
async fn started(rx: &mut UnboundedReceiver<Event>) -> Result<(), ApiError> {
    match rx.recv().await {
        Some(Event::Started { .. }) => Ok(()),
        Some(Event::Failed { kind, message }) => Err(failure(kind, message)),
        Some(_) => Err(ApiError::internal("the engine answered out of order")),
        None => Err(ApiError::unavailable("the server is shutting down")),
    }
}

pub(crate) async fn collect(
    mut rx: UnboundedReceiver<Event>,
    mut reply: Reply,
) -> Result<Response, ApiError> {
    started(&mut rx).await?;
    let mut reasoning = String::new();
    let mut content = String::new();
    let completion = loop {
        match rx.recv().await {
            Some(Event::Text(t)) => {
                let (r, c) = reply.split(&t);
                reasoning += &r;
                content += &c;
            }
            Some(Event::Done(c)) => break c,
            Some(Event::Failed { kind, message }) => return Err(failure(kind, message)),
            Some(Event::Started { .. }) => {}
            None => {
                return Err(ApiError::internal(
                    "the engine stopped before the request finished",
                ))
            }
        }
    };
    let (r, c) = reply.split_finish();
    reasoning += &r;
    content += &c;
    reply.log(&completion);
    let finish = completion.finish.as_str();
    let choice = match reply.endpoint {
        Endpoint::Chat => {
            let mut message = json!({"role": "assistant", "content": content});
            if !reasoning.is_empty() {
                message["reasoning_content"] = json!(reasoning);
            }
            json!({"index": 0, "message": message, "logprobs": null, "finish_reason": finish})
        }
        Endpoint::Completion => {
            json!({"index": 0, "text": content, "logprobs": null, "finish_reason": finish})
        }
    };
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

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

struct SseState {
    rx: UnboundedReceiver<Event>,
    reply: Reply,
    frames: VecDeque<Bytes>,
    finished: bool,
}

impl SseState {
    fn delta_chunk(&self, reasoning: &str, content: &str) -> Option<Bytes> {
        if reasoning.is_empty() && content.is_empty() {
            return None;
        }
        let choice = match self.reply.endpoint {
            Endpoint::Chat => {
                let delta = if reasoning.is_empty() {
                    json!({"content": content})
                } else if content.is_empty() {
                    json!({"reasoning_content": reasoning})
                } else {
                    json!({"reasoning_content": reasoning, "content": content})
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": null})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": content, "logprobs": null, "finish_reason": null})
            }
        };
        Some(sse(&self.reply.envelope(true, json!([choice]))))
    }

    fn on_event(&mut self, event: Option<Event>) {
        match event {
            Some(Event::Text(t)) => {
                let (r, c) = self.reply.split(&t);
                if let Some(f) = self.delta_chunk(&r, &c) {
                    self.frames.push_back(f);
                }
            }
            Some(Event::Done(c)) => {
                let (r, rest) = self.reply.split_finish();
                if let Some(f) = self.delta_chunk(&r, &rest) {
                    self.frames.push_back(f);
                }
                self.reply.log(&c);
                let finish = c.finish.as_str();
                let choice = match self.reply.endpoint {
                    Endpoint::Chat => {
                        json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish})
                    }
                    Endpoint::Completion => {
                        json!({"index": 0, "text": "", "logprobs": null, "finish_reason": finish})
                    }
                };
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
                self.frames.push_back(sse(&failure(kind, message).body()));
                self.finished = true;
            }
            Some(Event::Started { .. }) => {}
            None => {
                self.frames.push_back(sse(&ApiError::internal(
                    "the engine stopped before the request finished",
                )
                .body()));
                self.finished = true;
            }
        }
    }
}

pub(crate) async fn stream(
    mut rx: UnboundedReceiver<Event>,
    reply: Reply,
) -> Result<Response, ApiError> {
    started(&mut rx).await?;
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
    let body = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(f) = st.frames.pop_front() {
                return Some((Ok::<Bytes, Infallible>(f), st));
            }
            if st.finished {
                return None;
            }
            let ev = st.rx.recv().await;
            st.on_event(ev);
        }
    });
    Ok((
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response())
}
