//! Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.
//!
//! The body is read into the server's chat request by this API's own front end ([`request`]),
//! which takes the chat path from there (template, tokenizer, grammar for a required tool, the
//! one generation loop, the tool-call parser and the reasoning splitter); the parts of the answer
//! become Anthropic's content blocks ([`answer`]: `thinking`, `text`, `tool_use`), whole or as
//! Anthropic's stream events. Errors on these routes take Anthropic's shape
//! (`{"type": "error", "error": {"type", "message"}}`) and name fields as Anthropic's clients do.

pub(crate) mod answer;
mod request;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::handler::{body_error, chat_pipeline, AppState};
use crate::prepare::{count_chat_tokens, prepare_chat};
use crate::request::fresh_seed;
use crate::request::unknown::log_unknown;
use crate::submit::{enqueue, Submitted};
use crate::App;

use answer::Answer;
use request::{parse_messages, Context, MessagesAnswer, KNOWN_FIELDS};

/// The routes whose errors take Anthropic's shape.
pub(crate) fn is_messages_path(path: &str) -> bool {
    path == "/v1/messages" || path.starts_with("/v1/messages/")
}

/// Anthropic's error type and HTTP status for an error. A saturated or not yet ready server is
/// `overloaded_error` with 529, which Anthropic's clients retry.
fn error_kind(e: &ApiError) -> (&'static str, StatusCode) {
    let overloaded = StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    match e.status.as_u16() {
        400 | 405 | 415 => ("invalid_request_error", e.status),
        401 => ("authentication_error", e.status),
        403 => ("permission_error", e.status),
        404 => ("not_found_error", e.status),
        413 => ("request_too_large", e.status),
        429 => ("rate_limit_error", e.status),
        503 | 529 => ("overloaded_error", overloaded),
        _ => ("api_error", StatusCode::INTERNAL_SERVER_ERROR),
    }
}

fn error_body(e: &ApiError) -> Value {
    let (kind, _) = error_kind(e);
    json!({
        "type": "error",
        "error": {"type": kind, "message": e.message},
        "request_id": format!("req_{:016x}", fresh_seed()),
    })
}

pub(crate) fn error_response(e: ApiError) -> Response {
    let (_, status) = error_kind(&e);
    let mut r = (
        status,
        [(header::CONTENT_TYPE, "application/json; charset=utf-8")],
        error_body(&e).to_string(),
    )
        .into_response();
    if status == StatusCode::UNAUTHORIZED {
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
    }
    r
}

/// How this server reads a Messages body: with its defaults, and a vision tower or not.
fn context(app: &App, count_only: bool) -> Context<'_> {
    Context {
        defaults: Some(&app.cfg.request_defaults),
        count_only,
        vision: app.frontend.get().is_some_and(|f| f.vision.is_some()),
    }
}

pub(crate) async fn count_tokens(
    State(app): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    count_inner(app, body).await.unwrap_or_else(error_response)
}

async fn count_inner(
    app: AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(body_error)?;
    // Images count by the rows they take in the prompt, so URLs are fetched to be counted.
    let (_, n, ()) = chat_pipeline(
        &app,
        body,
        |app, o| {
            let (req, _) = parse_messages(&o, context(app, true))?;
            Ok((req, ()))
        },
        count_chat_tokens,
    )
    .await?;
    Ok(crate::handler::json_response(
        StatusCode::OK,
        json!({"input_tokens": n}),
    ))
}

pub(crate) async fn messages(
    State(app): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    messages_inner(app, body)
        .await
        .unwrap_or_else(error_response)
}

async fn messages_inner(
    app: AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(body_error)?;
    let (fe, prepared, extra): (_, _, MessagesAnswer) = chat_pipeline(
        &app,
        body,
        |app, o| {
            log_unknown(app.cfg.debug_log, "/v1/messages", &o, &[KNOWN_FIELDS]);
            parse_messages(&o, context(app, false))
        },
        prepare_chat,
    )
    .await?;
    let prompt_tokens = prepared.prompt_len();
    let Submitted {
        rx,
        params,
        shaping,
    } = enqueue(&app, prepared)?;
    let reply = crate::respond::Reply::new(
        app.clone(),
        fe.tokenizer.clone(),
        crate::respond::Endpoint::Chat,
        false,
        shaping,
    );
    let answer = Answer {
        reply,
        tokenizer: fe.tokenizer.clone(),
        id: format!("msg_{:016x}{:08x}", fresh_seed(), fresh_seed() as u32),
        model: extra.model,
        show_thinking: extra.show_thinking,
        stop_sequences: extra.stop_sequences,
        prompt_tokens,
    };
    if params.stream {
        answer::stream(rx, answer).await
    } else {
        answer::collect(rx, answer).await
    }
}

#[cfg(test)]
mod tests;
