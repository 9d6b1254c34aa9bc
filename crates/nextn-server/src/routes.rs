//! The router: every route and the handler it runs, authentication, the JSON-body check, and the
//! OpenAI chat and completion endpoints (the request side they share with the other APIs is in
//! `prepare` and `submit`).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use nextn_engine::scheduler::Phase;
use serde_json::json;

use crate::error::ApiError;
use crate::handler::{blocking, body_error, chat_pipeline, frontend, json_response, AppState};
use crate::prepare::{
    compile, prepare_chat, resolve_bias, tokenize_within_context, with_reasoning_budget, Prepared,
};
use crate::reasoning::prompt_opens_thinking;
use crate::request::images::check_image_count;
use crate::request::unknown::log_unknown;
use crate::request::{parse_chat, parse_completion, parse_json, Prompt, KNOWN_FIELDS};
use crate::respond::{self, Endpoint, Reply, Shaping};
use crate::submit::{enqueue, Submitted};
use crate::{anthropic, native, responses, slots, unserved};
use crate::{prometheus, Frontend};
use nextn_engine::media::MultimodalPrompt;

pub(crate) fn router(app: AppState) -> Router {
    let limit = app.cfg.max_body_bytes;
    Router::new()
        .route("/", get(chat_page))
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/chat/completions", post(chat))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/input_tokens", post(responses::input_tokens))
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route("/v1/completions", post(completions))
        .route("/completions", post(completions))
        .route("/completion", post(completion_native))
        .route("/tokenize", post(native::tokenize))
        .route("/detokenize", post(native::detokenize))
        .route("/apply-template", post(native::apply_template))
        .route("/props", get(native::props))
        .route("/slots", get(slots::list))
        .route("/slots/{id}", post(slots::action))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/embeddings", post(unserved::embeddings))
        .route("/embeddings", post(unserved::embeddings))
        .route("/embedding", post(unserved::embeddings))
        .route("/v1/rerank", post(unserved::rerank))
        .route("/v1/reranking", post(unserved::rerank))
        .route("/rerank", post(unserved::rerank))
        .route("/reranking", post(unserved::rerank))
        .route("/v1/audio/transcriptions", post(unserved::transcriptions))
        .route("/audio/transcriptions", post(unserved::transcriptions))
        .route_layer(middleware::from_fn(json_bodies_only))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(app.clone(), auth))
        .layer(middleware::from_fn_with_state(
            app.clone(),
            crate::cors::layer,
        ))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(app)
}

/// Compare without an early exit, so the time taken does not tell how much of a guess matched.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len().max(b.len());
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..n {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= std::hint::black_box(u64::from(x ^ y));
    }
    std::hint::black_box(diff) == 0
}

/// Which of `keys` `given` is.
fn key_index(keys: &[String], given: &str) -> Option<usize> {
    // Every key is compared, so which key matched is not visible either.
    keys.iter().enumerate().fold(None, |found, (i, k)| {
        let hit = constant_time_eq(k.as_bytes(), given.as_bytes());
        found.or(hit.then_some(i))
    })
}

/// Who sent a request: the index of the API key it gave, `None` where the server takes no keys.
/// What a request stores (Responses) is that caller's only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Caller(pub Option<usize>);

async fn auth(State(app): State<AppState>, mut req: Request, next: Next) -> Response {
    let path = req.uri().path();
    // The chat page holds no data: it asks for the key and sends it with every API call.
    if app.cfg.api_keys.is_empty() || matches!(path, "/" | "/health" | "/v1/health") {
        req.extensions_mut().insert(Caller(None));
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
        .or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok()));
    match given.and_then(|k| key_index(&app.cfg.api_keys, k)) {
        Some(i) => {
            req.extensions_mut().insert(Caller(Some(i)));
            next.run(req).await
        }
        None if anthropic::is_messages_path(path) => {
            anthropic::error_response(ApiError::unauthorized())
        }
        None => ApiError::unauthorized().into_response(),
    }
}

/// `application/json` or a structured `+json` type, with any parameters (`charset=utf-8`).
fn is_json_media_type(value: &str) -> bool {
    let essence = value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// Every POST endpoint reads a JSON body: a body labelled as something else is refused with 415
/// instead of being parsed anyway. A missing Content-Type is accepted, as llama-server accepts it
/// (its handlers parse the body whatever the header says), and an empty body has nothing to label.
async fn json_bodies_only(req: Request, next: Next) -> Response {
    if req.method() != Method::POST {
        return next.run(req).await;
    }
    let Some(value) = req.headers().get(header::CONTENT_TYPE) else {
        return next.run(req).await;
    };
    let empty = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .is_some_and(|n| n.as_bytes() == b"0");
    if empty || value.to_str().is_ok_and(is_json_media_type) {
        return next.run(req).await;
    }
    let e = ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "invalid_request_error",
        format!(
            "Content-Type '{}' is not supported: the body must be JSON sent as 'Content-Type: application/json' (with curl: -H 'Content-Type: application/json', or --json)",
            String::from_utf8_lossy(value.as_bytes())
        ),
    );
    in_the_apis_shape(req.uri().path(), e)
}

/// An error answered in the shape of the API whose route was asked for.
fn in_the_apis_shape(path: &str, e: ApiError) -> Response {
    if anthropic::is_messages_path(path) {
        anthropic::error_response(e)
    } else {
        e.into_response()
    }
}

/// The chat page: one self-contained file, embedded in the binary.
async fn chat_page() -> Response {
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        include_str!("page/chat.html"),
    )
        .into_response()
}

async fn not_found(req: Request) -> Response {
    let e = ApiError::not_found(format!(
        "no route for {} {}",
        req.method(),
        req.uri().path()
    ));
    in_the_apis_shape(req.uri().path(), e)
}

async fn method_not_allowed(req: Request) -> Response {
    let e = ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    );
    in_the_apis_shape(req.uri().path(), e)
}

async fn health(State(app): State<AppState>) -> Response {
    match app.handle.phase() {
        Phase::Ready if app.frontend.get().is_some() => {
            json_response(StatusCode::OK, json!({"status": "ok"}))
        }
        Phase::Loading | Phase::Ready => ApiError::unavailable("Loading model").into_response(),
        Phase::Failed | Phase::Stopped => ApiError::unavailable(
            app.handle
                .failure()
                .unwrap_or_else(|| "the server is shutting down".into()),
        )
        .into_response(),
    }
}

async fn metrics(State(app): State<AppState>) -> Response {
    let info = app.handle.info();
    let mut text = prometheus::render(
        &app.handle.metrics(),
        info.as_ref().map_or(0, |i| i.n_slots),
        info.as_ref().map_or(0, |i| i.n_draft_max),
    );
    text += &prometheus::render_connections(&app.connections, app.cfg.limits.max_connections);
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn models(State(app): State<AppState>) -> Response {
    let info = app.handle.info();
    let meta = info.map(|i| {
        json!({
            "n_ctx_slot": i.n_ctx_slot,
            "n_slots": i.n_slots,
            "n_vocab": i.n_vocab,
            "n_ctx_train": i.n_ctx_train,
            "speculative": i.speculative,
            "n_draft_max": i.n_draft_max,
        })
    });
    json_response(
        StatusCode::OK,
        json!({
            "object": "list",
            "data": [{
                "id": app.cfg.model_id,
                "object": "model",
                "created": respond::unix_time(),
                "owned_by": "nextn",
                "meta": meta,
            }],
        }),
    )
}

async fn chat(State(app): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    chat_inner(app, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_inner(
    app: AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(body_error)?;
    let (fe, prepared, ()) = chat_pipeline(
        &app,
        body,
        |app, o| {
            log_unknown(
                app.cfg.debug_log,
                "/v1/chat/completions",
                &o,
                &[KNOWN_FIELDS],
            );
            Ok((parse_chat(&o, Some(&app.cfg.request_defaults))?, ()))
        },
        prepare_chat,
    )
    .await?;
    submit(&app, &fe, prepared, Endpoint::Chat).await
}

async fn completions(State(app): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    completions_inner(app, body, Endpoint::Completion)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// llama-server's native `/completion`.
async fn completion_native(
    State(app): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    completions_inner(app, body, Endpoint::Native)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions_inner(
    app: AppState,
    body: Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    let body = body.map_err(body_error)?;
    let fe = frontend(&app)?;
    let app2 = app.clone();
    let fe2 = fe.clone();
    let path = match endpoint {
        Endpoint::Native => "/completion",
        Endpoint::Completion | Endpoint::Chat => "/v1/completions",
    };
    let prepared = blocking(move || {
        let (app, fe) = (app2, fe2);
        let o = parse_json(&body)?;
        log_unknown(app.cfg.debug_log, path, &o, &[KNOWN_FIELDS]);
        let mut req = parse_completion(&o, Some(&app.cfg.request_defaults))?;
        check_image_count(req.prompt.images(), app.cfg.max_images)?;
        // Any model name is accepted, as llama-server does: clients hard-code names.
        resolve_bias(&fe, &mut req.params)?;
        let MultimodalPrompt { tokens, images } = match &req.prompt {
            Prompt::Text(t) => tokenize_within_context(&app, &fe, t, &[])?,
            Prompt::Tokens(t) => MultimodalPrompt {
                tokens: t.clone(),
                images: Vec::new(),
            },
            Prompt::Multimodal { text, images } => {
                tokenize_within_context(&app, &fe, text, images)?
            }
        };
        let grammar = match &req.params.grammar {
            Some(g) => Some(compile(&fe, g, &req.params.grammar_field)?),
            None => None,
        };
        // A raw prompt reasons where it opened a block or the model opens one itself.
        let in_reasoning = match &req.prompt {
            Prompt::Text(t) => prompt_opens_thinking(t),
            Prompt::Tokens(t) => prompt_opens_thinking(&fe.tokenizer.decode(t)),
            Prompt::Multimodal { text, .. } => prompt_opens_thinking(text),
        };
        let grammar = with_reasoning_budget(
            &app,
            &fe,
            grammar,
            req.params.reasoning_budget,
            in_reasoning,
            true,
        )?;
        let shaping = Shaping {
            splitter: None,
            tools: None,
            legacy_functions: false,
            logprobs: req.params.logprobs.is_some(),
            return_tokens: req.params.return_tokens,
            native: (endpoint == Endpoint::Native).then(|| {
                let p = &req.params;
                let n_ctx = app.handle.info().map_or(0, |i| i.n_ctx_slot);
                json!({
                    "prompt": fe.tokenizer.decode(&tokens),
                    "generation_settings": {
                        "n_ctx": n_ctx,
                        "model": app.cfg.model_id,
                        "n_predict": p.n_predict.map_or(-1, |n| n as i64),
                        "seed": p.sampler.seed,
                        "temperature": p.sampler.temperature,
                        "top_k": p.sampler.top_k,
                        "top_p": p.sampler.top_p,
                        "min_p": p.sampler.min_p,
                        "repeat_last_n": p.sampler.repeat_last_n,
                        "repeat_penalty": p.sampler.repeat_penalty,
                        "presence_penalty": p.sampler.presence_penalty,
                        "frequency_penalty": p.sampler.frequency_penalty,
                        "ignore_eos": p.ignore_eos,
                        "stream": p.stream,
                        "stop": p.stop,
                        "n_probs": p.logprobs.unwrap_or(0),
                    },
                })
            }),
        };
        Ok(Prepared {
            params: req.params,
            tokens,
            images,
            cache_points: Vec::new(),
            grammar,
            shaping,
        })
    })
    .await?;
    submit(&app, &fe, prepared, endpoint).await
}

async fn submit(
    app: &AppState,
    fe: &Arc<Frontend>,
    prepared: Prepared,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    let Submitted {
        rx,
        params,
        shaping,
    } = enqueue(app, prepared)?;
    let reply = Reply::new(
        app.clone(),
        fe.tokenizer.clone(),
        endpoint,
        params.include_usage,
        shaping,
    );
    if params.stream {
        respond::stream(rx, reply).await
    } else {
        respond::collect(rx, reply).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_media_types() {
        for ok in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON;charset=UTF-8",
            "application/vnd.api+json",
        ] {
            assert!(is_json_media_type(ok), "{ok}");
        }
        for refused in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "text/json+plain",
            "",
        ] {
            assert!(!is_json_media_type(refused), "{refused}");
        }
    }

    #[test]
    fn key_comparison() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
        let keys = vec!["a".to_string(), "bb".to_string()];
        assert_eq!(
            (
                key_index(&keys, "bb"),
                key_index(&keys, "a"),
                key_index(&keys, "c")
            ),
            (Some(1), Some(0), None)
        );
        assert_eq!(key_index(&[], "a"), None);
    }
}
