//! OpenAI's Responses API: `POST /v1/responses`, `POST /v1/responses/input_tokens`,
//! `GET` / `DELETE /v1/responses/{id}`.
//!
//! A thin mapping onto the chat completion path: the request becomes a chat request
//! ([`input`]) that goes through the same conversion, template, grammar, tool-call parser and
//! generation loop (`prepare::prepare_chat`, `submit::enqueue`), and the answer's parts become
//! output items and stream events ([`output`]). Responses are kept in a bounded in-memory store
//! ([`store`]) unless `store: false`, so `previous_response_id` can continue one.

mod base64;
mod input;
mod output;
pub(crate) mod store;

use std::collections::VecDeque;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use nextn_engine::output::FinishReason;
use nextn_engine::scheduler::{Completion, Event, FailKind};
use nextn_engine::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::error::ApiError;
use crate::handler::{
    blocking, body_error, frontend, json_response, with_server_defaults, AppState,
};
use crate::image_url::fetch_images;
use crate::prepare::{prepare_chat, Prepared};
use crate::reasoning::effort_budget;
use crate::request::{fresh_seed, parse_chat, parse_json, ChatRequest};
use crate::respond::{failure, sse_response, started, unix_time, Endpoint, Reply};
use crate::submit::{enqueue, Submitted};
use crate::App;

use input::ResponsesRequest;
use output::Output;

/// Name each field this endpoint does not know, once, when debug logging is on.
fn log_unknown(app: &App, o: &Map<String, Value>) {
    use std::collections::HashSet;
    use std::sync::Mutex;
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    if !app.cfg.debug_log {
        return;
    }
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    let seen = seen.get_or_insert_with(HashSet::new);
    let unknown: Vec<&str> = o
        .keys()
        .filter(|k| {
            !input::KNOWN_FIELDS.contains(&k.as_str()) && !input::CHAT_FIELDS.contains(&k.as_str())
        })
        .filter(|k| seen.insert((*k).clone()))
        .map(String::as_str)
        .collect();
    if !unknown.is_empty() {
        eprintln!(
            "debug: /v1/responses ignores unknown request fields: {}",
            unknown.join(", ")
        );
    }
}

/// An error from the chat path, with the field named as a Responses request names it.
fn in_responses_terms(mut e: ApiError) -> ApiError {
    let renamed = match e.param.as_deref() {
        Some(p) if p.starts_with("messages") => "input",
        Some("response_format") => "text.format",
        Some("max_tokens") => "max_output_tokens",
        Some(p) if p.starts_with("tools[") || p.starts_with("functions") => "tools",
        _ => return e,
    };
    e.param = Some(renamed.into());
    e
}

/// The body, its mapping (continuing a stored conversation), the chat body it maps to and that
/// body parsed (image URLs not yet fetched).
fn parse(
    app: &App,
    body: &[u8],
) -> Result<(ResponsesRequest, Map<String, Value>, ChatRequest), ApiError> {
    let o = parse_json(body)?;
    log_unknown(app, &o);
    let previous = match input::previous_id(&o)? {
        None => None,
        Some(id) => match app.responses.get(id) {
            Some(stored) => Some(stored.conversation),
            None => {
                return Err(ApiError::invalid_field(
                    "previous_response_id",
                    format!("Previous response with id '{id}' not found (responses are kept in memory while the server runs, unless 'store' is false)"),
                ))
            }
        },
    };
    let req = input::parse(&o, previous)?;
    let mut chat = req.chat.clone();
    with_server_defaults(app, &mut chat);
    // An effort's share of the answer's allowance (`max_output_tokens`, else the server's
    // `--n-predict`, else a slot's context), unless the request sets `thinking_budget_tokens`.
    let effort = req.echo.get("reasoning").and_then(|r| r.get("effort"));
    if let Some(effort) = effort.and_then(Value::as_str) {
        let allowance = ["max_tokens", "n_predict"]
            .iter()
            .find_map(|k| chat.get(*k).and_then(Value::as_u64))
            .or_else(|| app.handle.info().map(|i| i.n_ctx_slot as u64));
        if let Some(budget) = allowance.and_then(|a| effort_budget(effort, a)) {
            chat.entry("thinking_budget_tokens")
                .or_insert(json!(budget));
        }
    }
    let parsed = parse_chat(&chat).map_err(in_responses_terms)?;
    Ok((req, chat, parsed))
}

/// The body, its mapping and the prepared chat request: parsed off the async threads, its image
/// URLs fetched on them, then prepared off them again.
async fn prepare(app: &AppState, body: Bytes) -> Result<(ResponsesRequest, Prepared), ApiError> {
    let fe = frontend(app)?;
    let app2 = app.clone();
    let (req, chat, mut parsed) = blocking(move || parse(&app2, &body)).await?;
    fetch_images(app, &fe, &mut parsed.images)
        .await
        .map_err(in_responses_terms)?;
    let app2 = app.clone();
    let prepared =
        blocking(move || prepare_chat(&app2, &fe, &chat, parsed).map_err(in_responses_terms))
            .await?;
    Ok((req, prepared))
}

pub(crate) async fn create(
    State(app): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    create_inner(app, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn create_inner(
    app: AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(body_error)?;
    let fe = frontend(&app)?;
    let (req, prepared) = prepare(&app, body).await?;
    let cache_prompt = prepared.params.cache_prompt;
    let Submitted {
        rx,
        params,
        shaping,
    } = enqueue(&app, prepared).map_err(in_responses_terms)?;
    let reply = Reply::new(
        app.clone(),
        fe.tokenizer.clone(),
        Endpoint::Chat,
        params.include_usage,
        shaping,
    );
    let stem = format!("{:016x}", fresh_seed());
    let answer = Answer {
        app: app.clone(),
        tokenizer: fe.tokenizer.clone(),
        id: format!("resp_{stem}"),
        created_at: unix_time(),
        output: Output::new(&stem, req.namespaced.clone(), req.encrypted_reasoning),
        reply,
        cache_prompt,
        req,
    };
    if answer.req.stream {
        stream(rx, answer).await
    } else {
        collect(rx, answer).await
    }
}

/// One response being answered.
struct Answer {
    app: Arc<App>,
    tokenizer: Arc<Tokenizer>,
    id: String,
    created_at: u64,
    req: ResponsesRequest,
    reply: Reply,
    output: Output,
    cache_prompt: bool,
}

impl Answer {
    /// The Response object.
    fn object(&self, status: &str, extra: Value) -> Value {
        let mut r = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": null,
            "model": self.app.cfg.model_id,
            "output": self.output.items(),
            "usage": null,
        });
        for (k, v) in &self.req.echo {
            r[k] = v.clone();
        }
        if let Value::Object(extra) = extra {
            for (k, v) in extra {
                r[k] = v;
            }
        }
        r
    }

    fn text(&mut self, t: &str) {
        let parts = self.reply.parts(t);
        self.output.push(parts, self.reply.calls());
    }

    /// The end of generation: the rest of the parts, the open item closed, the final object
    /// (kept when `store`).
    fn finish(&mut self, c: &Completion) -> Value {
        let parts = self.reply.finish_parts();
        self.output.push(parts, self.reply.calls());
        self.reply.log(c);
        let incomplete =
            self.reply.finish_reason(c) == "length" || c.finish == FinishReason::Length;
        let (status, details) = if incomplete {
            ("incomplete", json!({"reason": "max_output_tokens"}))
        } else {
            ("completed", Value::Null)
        };
        self.output.close(status);
        let reasoning_tokens = if self.output.reasoning_text().is_empty() {
            0
        } else {
            self.tokenizer
                .encode(self.output.reasoning_text(), false)
                .len()
                .min(c.completion_tokens)
        };
        let cached = c.timings.cache_n;
        let usage = json!({
            "input_tokens": c.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": cached,
                "cache_write_tokens": if self.cache_prompt { c.prompt_tokens.saturating_sub(cached) } else { 0 },
            },
            "output_tokens": c.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": c.prompt_tokens + c.completion_tokens,
        });
        let mut extra = json!({"incomplete_details": details, "usage": usage});
        if !incomplete {
            extra["completed_at"] = json!(unix_time());
        }
        let object = self.object(status, extra);
        if self.req.store {
            let mut conversation = self.req.conversation.clone();
            conversation.extend(self.output.items().iter().cloned());
            self.app
                .responses
                .put(self.id.clone(), object.clone(), conversation);
        }
        object
    }

    /// The object of a response that failed after it started.
    fn failed(&mut self, kind: FailKind, message: &str) -> Value {
        self.output.close("incomplete");
        let code = match kind {
            FailKind::Invalid => "invalid_prompt",
            FailKind::Shutdown | FailKind::Internal => "server_error",
        };
        self.object(
            "failed",
            json!({"error": {"code": code, "message": message}}),
        )
    }
}

async fn collect(
    mut rx: UnboundedReceiver<Event>,
    mut answer: Answer,
) -> Result<Response, ApiError> {
    started(&mut rx).await?;
    loop {
        match rx.recv().await {
            Some(Event::Text(t)) => answer.text(&t),
            Some(Event::Done(c)) => {
                let object = answer.finish(&c);
                return Ok(json_response(StatusCode::OK, object));
            }
            Some(Event::Failed { kind, message }) => return Err(failure(kind, message)),
            Some(Event::Started { .. } | Event::PromptProgress { .. } | Event::Logprobs(_)) => {}
            None => {
                return Err(ApiError::internal(
                    "the engine stopped before the request finished",
                ))
            }
        }
    }
}

crate::respond::sse_frames!(SseState);

struct SseState {
    rx: UnboundedReceiver<Event>,
    answer: Answer,
    frames: VecDeque<Bytes>,
    sequence: u64,
    finished: bool,
}

impl SseState {
    fn send(&mut self, mut event: Value) {
        event["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        let kind = event["type"].as_str().unwrap_or("message").to_string();
        self.frames
            .push_back(Bytes::from(format!("event: {kind}\ndata: {event}\n\n")));
    }

    fn send_item_events(&mut self) {
        for e in self.answer.output.take_events() {
            self.send(e);
        }
    }

    fn on_event(&mut self, event: Option<Event>) {
        match event {
            Some(Event::Text(t)) => {
                self.answer.text(&t);
                self.send_item_events();
            }
            Some(Event::Done(c)) => {
                let object = self.answer.finish(&c);
                self.send_item_events();
                let kind = if object["status"] == "incomplete" {
                    "response.incomplete"
                } else {
                    "response.completed"
                };
                self.send(json!({"type": kind, "response": object}));
                self.finished = true;
            }
            Some(Event::Failed { kind, message }) => self.fail(kind, &message),
            Some(Event::Started { .. } | Event::PromptProgress { .. } | Event::Logprobs(_)) => {}
            None => self.fail(
                FailKind::Internal,
                "the engine stopped before the request finished",
            ),
        }
    }

    fn fail(&mut self, kind: FailKind, message: &str) {
        let object = self.answer.failed(kind, message);
        self.send_item_events();
        self.send(json!({"type": "response.failed", "response": object}));
        self.finished = true;
    }
}

async fn stream(
    mut rx: UnboundedReceiver<Event>,
    mut answer: Answer,
) -> Result<Response, ApiError> {
    started(&mut rx).await?;
    answer.reply.set_streaming();
    let mut state = SseState {
        rx,
        answer,
        frames: VecDeque::new(),
        sequence: 0,
        finished: false,
    };
    let begun = state.answer.object("in_progress", json!({}));
    state.send(json!({"type": "response.created", "response": begun}));
    state.send(json!({"type": "response.in_progress", "response": begun}));
    Ok(sse_response(state))
}

/// `POST /v1/responses/input_tokens`: the prompt a request would run, counted.
pub(crate) async fn input_tokens(
    State(app): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = async {
        let body = body.map_err(body_error)?;
        let (_, prepared) = prepare(&app, body).await?;
        Ok::<_, ApiError>(json_response(
            StatusCode::OK,
            json!({"object": "response.input_tokens", "input_tokens": prepared.tokens.len()}),
        ))
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

fn unknown_response(id: &str) -> ApiError {
    let mut e = ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("Response with id '{id}' not found (responses are kept in memory while the server runs, unless 'store' is false)"),
    );
    e.param = Some("response_id".into());
    e
}

/// `GET /v1/responses/{id}`.
pub(crate) async fn retrieve(
    State(app): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> Response {
    match app.responses.get(&id) {
        Some(stored) => json_response(StatusCode::OK, stored.response),
        None => unknown_response(&id).into_response(),
    }
}

/// `DELETE /v1/responses/{id}`.
pub(crate) async fn delete(State(app): State<AppState>, UrlPath(id): UrlPath<String>) -> Response {
    if app.responses.remove(&id) {
        json_response(
            StatusCode::OK,
            json!({"id": id, "object": "response", "deleted": true}),
        )
    } else {
        unknown_response(&id).into_response()
    }
}
