//! OpenAI's Responses API: `POST /v1/responses`, `POST /v1/responses/input_tokens`,
//! `GET` / `DELETE /v1/responses/{id}`.
//!
//! A thin mapping onto the chat completion path: the request becomes a chat request
//! ([`input`]) that goes through the same conversion, template, grammar, tool-call parser and
//! generation loop (`prepare::prepare_chat`, `submit::enqueue`), and the answer's parts become
//! output items and stream events ([`output`]). Responses are kept in a bounded in-memory store
//! ([`store`]) unless `store: false`, so `previous_response_id` can continue one.

mod input;
mod output;
pub(crate) mod sealed;
pub(crate) mod store;

use std::collections::VecDeque;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use nextn_engine::output::FinishReason;
use nextn_engine::scheduler::{Completion, Event, FailKind};
use nextn_engine::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::error::ApiError;
use crate::handler::{blocking, body_error, chat_pipeline, json_response, AppState};
use crate::prepare::{count_chat_tokens, prepare_chat, Prepared};
use crate::reasoning::effort_budget;
use crate::request::unknown::log_unknown;
use crate::request::ChatRequest;
use crate::respond::{failure, sse_response, started, unix_time, BlockingJob, Endpoint, Reply};
use crate::routes::Caller;
use crate::submit::{enqueue, Submitted};
use crate::App;

use input::ResponsesRequest;
use output::Output;

/// Why a stored response cannot be found, for the 404s of every route that names one.
const NOT_KEPT: &str = "responses are kept in memory while the server runs, for the API key that made them, unless 'store' is false or the response was too large to keep";

/// The body read as a Responses request (continuing the caller's stored conversation) into the
/// chat request, and what the answer needs besides.
fn parse(
    app: &App,
    caller: Caller,
    o: &Map<String, Value>,
) -> Result<(ChatRequest, ResponsesRequest), ApiError> {
    log_unknown(
        app.cfg.debug_log,
        "/v1/responses",
        o,
        &[input::KNOWN_FIELDS, input::CHAT_FIELDS],
    );
    let previous = match input::previous_id(o)? {
        None => None,
        Some(id) => match app.responses.get(caller.0, id) {
            Some(stored) => Some(stored.conversation),
            None => {
                return Err(ApiError::invalid_field(
                    "previous_response_id",
                    format!("Previous response with id '{id}' not found ({NOT_KEPT})"),
                ))
            }
        },
    };
    let (mut chat, req) = input::parse(
        o,
        input::Context {
            previous,
            defaults: Some(&app.cfg.request_defaults),
            sealer: &app.sealer,
        },
    )?;
    // An effort's share of the answer's allowance (`max_output_tokens`, else the server's
    // `--n-predict`, else a slot's context), unless the request sets `thinking_budget_tokens`.
    if let (Some(effort), None) = (&req.effort, chat.params.reasoning_budget) {
        let allowance = chat
            .params
            .n_predict
            .map(|n| n as u64)
            .or_else(|| app.handle.info().map(|i| i.n_ctx_slot as u64));
        if let Some(budget) = allowance.and_then(|a| effort_budget(effort, a)) {
            chat.params.reasoning_budget = Some(Some(budget as usize));
        }
    }
    Ok((chat, req))
}

/// The body parsed, its image URLs fetched, and `finish` run on the chat request.
async fn pipeline<P: Send + 'static>(
    app: &AppState,
    caller: Caller,
    body: Bytes,
    finish: impl FnOnce(&App, &crate::Frontend, ChatRequest) -> Result<P, ApiError> + Send + 'static,
) -> Result<(Arc<crate::Frontend>, P, ResponsesRequest), ApiError> {
    chat_pipeline(app, body, move |app, o| parse(app, caller, &o), finish).await
}

pub(crate) async fn create(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    create_inner(app, caller, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn create_inner(
    app: AppState,
    caller: Caller,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(body_error)?;
    let (fe, prepared, req): (_, Prepared, _) = pipeline(&app, caller, body, prepare_chat).await?;
    let cache_prompt = prepared.params.cache_prompt;
    let Submitted {
        rx,
        params,
        shaping,
    } = enqueue(&app, prepared)?;
    let reply = Reply::new(
        app.clone(),
        fe.tokenizer.clone(),
        Endpoint::Chat,
        params.include_usage,
        shaping,
    );
    let stem = app.sealer.random_hex();
    let sealer = req.encrypted_reasoning.then(|| app.sealer.clone());
    let answer = Answer {
        app: app.clone(),
        owner: caller.0,
        tokenizer: fe.tokenizer.clone(),
        id: format!("resp_{stem}"),
        created_at: unix_time(),
        output: Output::new(&stem, req.namespaced.clone(), sealer),
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
    /// The API key the response is kept for.
    owner: store::Owner,
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

    /// Tokens of the answer that were reasoning: those up to and including the one that ends
    /// the thinking block, all of them when it never ended.
    fn reasoning_tokens(&self, c: &Completion) -> usize {
        if self.output.reasoning_text().is_empty() {
            return 0;
        }
        match self.tokenizer.token_id("</think>") {
            Some(end) => c
                .tokens
                .iter()
                .position(|&t| t == end)
                .map_or(c.completion_tokens, |i| i + 1),
            None => self
                .tokenizer
                .encode(self.output.reasoning_text(), false)
                .len(),
        }
        .min(c.completion_tokens)
    }

    /// The end of generation: the rest of the parts, the open item closed, the final object,
    /// and with `store`, the job that keeps it (run off the async threads: it measures the
    /// conversation it keeps).
    fn finish(&mut self, c: &Completion) -> (Value, Option<BlockingJob>) {
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
        let reasoning_tokens = self.reasoning_tokens(c);
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
        let keep = self.req.store.then(|| {
            let mut conversation = std::mem::take(&mut self.req.conversation);
            conversation.extend(self.output.items().iter().cloned());
            let (app, owner, id, response) = (
                self.app.clone(),
                self.owner,
                self.id.clone(),
                object.clone(),
            );
            Box::new(move || {
                if !app.responses.put(owner, id.clone(), response, conversation) {
                    eprintln!(
                        "warning: response {id} is not kept: its conversation is over {} MiB",
                        store::MAX_ENTRY_BYTES >> 20
                    );
                }
            }) as BlockingJob
        });
        (object, keep)
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
                let (object, keep) = answer.finish(&c);
                if let Some(keep) = keep {
                    blocking(move || {
                        keep();
                        Ok(())
                    })
                    .await?;
                }
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

crate::respond::sse_frames!(SseState, blocking);

struct SseState {
    rx: UnboundedReceiver<Event>,
    answer: Answer,
    frames: VecDeque<Bytes>,
    sequence: u64,
    finished: bool,
    /// Keeping the finished response, done before its last event goes out.
    blocking: Option<BlockingJob>,
}

impl SseState {
    fn idle_frame() -> Bytes {
        crate::respond::keep_alive_comment()
    }

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
                let (object, keep) = self.answer.finish(&c);
                self.blocking = keep;
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
        blocking: None,
    };
    let begun = state.answer.object("in_progress", json!({}));
    state.send(json!({"type": "response.created", "response": begun}));
    state.send(json!({"type": "response.in_progress", "response": begun}));
    Ok(sse_response(state))
}

/// `POST /v1/responses/input_tokens`: the prompt a request would run, counted.
pub(crate) async fn input_tokens(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = async {
        let body = body.map_err(body_error)?;
        let (_, n, _) = pipeline(&app, caller, body, count_chat_tokens).await?;
        Ok::<_, ApiError>(json_response(
            StatusCode::OK,
            json!({"object": "response.input_tokens", "input_tokens": n}),
        ))
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

fn unknown_response(id: &str) -> ApiError {
    let mut e = ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("Response with id '{id}' not found ({NOT_KEPT})"),
    );
    e.param = Some("response_id".into());
    e
}

/// `GET /v1/responses/{id}`: a response the caller's API key made.
pub(crate) async fn retrieve(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    UrlPath(id): UrlPath<String>,
) -> Response {
    match app.responses.get(caller.0, &id) {
        Some(stored) => json_response(StatusCode::OK, stored.response),
        None => unknown_response(&id).into_response(),
    }
}

/// `DELETE /v1/responses/{id}`: a response the caller's API key made.
pub(crate) async fn delete(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    UrlPath(id): UrlPath<String>,
) -> Response {
    if app.responses.remove(caller.0, &id) {
        json_response(
            StatusCode::OK,
            json!({"id": id, "object": "response", "deleted": true}),
        )
    } else {
        unknown_response(&id).into_response()
    }
}
