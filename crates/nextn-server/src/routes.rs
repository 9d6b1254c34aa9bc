//! Routes, authentication and the request side of each endpoint: parse, render, tokenize,
//! check against the context, submit.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use nextn_engine::chat::final_header;
use nextn_engine::grammar::{Constraint, GrammarSource};
use nextn_engine::media::{is_image_token, ImageInput, MultimodalPrompt, PromptImage};
use nextn_engine::scheduler::{Phase, SubmitError};
use nextn_engine::speculative::forced::ForcedAcceptance;
use nextn_vision::decode_image;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::reasoning::{prompt_opens_thinking, ReasoningSplitter};
use crate::request::{
    flag, parse_chat, parse_completion, parse_json, unknown_fields, BiasKey, ChatImage,
    ChatRequest, GenParams, Prompt,
};
use crate::respond::{self, Endpoint, Reply, Shaping};
use crate::tools::{call_grammar, Reasoning, ToolCallParser, ToolChoice};
use crate::{anthropic, native, responses, slots, unserved};
use crate::{prometheus, App, Frontend, ReasoningFormat};

pub(crate) type AppState = Arc<App>;

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
        .layer(middleware::from_fn_with_state(app.clone(), native::cors))
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

fn key_matches(keys: &[String], given: &str) -> bool {
    // Every key is compared, so which key matched is not visible either.
    keys.iter().fold(false, |ok, k| {
        constant_time_eq(k.as_bytes(), given.as_bytes()) | ok
    })
}

async fn auth(State(app): State<AppState>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    // The chat page holds no data: it asks for the key and sends it with every API call.
    if app.cfg.api_keys.is_empty() || matches!(path, "/" | "/health" | "/v1/health") {
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
    match given {
        Some(k) if key_matches(&app.cfg.api_keys, k) => next.run(req).await,
        _ if anthropic::is_messages_path(path) => {
            anthropic::error_response(ApiError::unauthorized())
        }
        _ => ApiError::unauthorized().into_response(),
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
    ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "invalid_request_error",
        format!(
            "Content-Type '{}' is not supported: the body must be JSON sent as 'Content-Type: application/json' (with curl: -H 'Content-Type: application/json', or --json)",
            String::from_utf8_lossy(value.as_bytes())
        ),
    )
    .into_response()
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
    if anthropic::is_messages_path(req.uri().path()) {
        return anthropic::error_response(e);
    }
    e.into_response()
}

async fn method_not_allowed(req: Request) -> Response {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
    .into_response()
}

pub(crate) fn json_response(status: StatusCode, v: serde_json::Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json; charset=utf-8")],
        v.to_string(),
    )
        .into_response()
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

pub(crate) fn body_error(r: BytesRejection) -> ApiError {
    if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "the request body is too large",
        )
    } else {
        ApiError::new(
            r.status(),
            "invalid_request_error",
            format!("cannot read the request body: {}", r.body_text()),
        )
    }
}

pub(crate) fn frontend(app: &App) -> Result<Arc<Frontend>, ApiError> {
    match (app.handle.phase(), app.frontend.get()) {
        (Phase::Ready, Some(f)) => Ok(f.clone()),
        (Phase::Loading, _) | (Phase::Ready, None) => Err(ApiError::unavailable("Loading model")),
        _ => Err(ApiError::unavailable("the server is shutting down")),
    }
}

pub(crate) fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::QueueFull(_) => {
            ApiError::unavailable(format!("the server is busy: {e}; retry later"))
        }
        SubmitError::Loading => ApiError::unavailable("Loading model"),
        SubmitError::ShuttingDown => ApiError::unavailable("the server is shutting down"),
        SubmitError::Stopped(_) => ApiError::internal(e.to_string()),
    }
}

/// Fill in the fields a request leaves out from the server's command line (`--temp`, `-n`, ...).
/// The token budget goes in as `n_predict`, which `max_tokens` and `max_completion_tokens` override.
pub(crate) fn with_server_defaults(app: &App, o: &mut Map<String, Value>) {
    for (k, v) in &app.cfg.request_defaults {
        o.entry(k.clone()).or_insert_with(|| v.clone());
    }
}

fn uses_tools(req: &ChatRequest) -> bool {
    !req.tools.is_empty() && req.tool_choice != ToolChoice::None
}

/// The text a chat request runs: its messages through the template, with its template
/// variables, the server's defaults for those it leaves out, and its tools; a final assistant
/// message is continued.
pub(crate) fn render_chat(app: &App, fe: &Frontend, req: &ChatRequest) -> Result<String, ApiError> {
    let mut kwargs = req.template_kwargs.clone();
    for (k, v) in &app.cfg.template_kwargs {
        kwargs.entry(k.clone()).or_insert_with(|| v.clone());
    }
    if uses_tools(req) && !kwargs.contains_key("tools") {
        kwargs.insert("tools".into(), req.tools_for_template.clone());
    }
    let continue_last = req.messages.last().is_some_and(|m| m.role == "assistant");
    let rendered = if continue_last {
        fe.template.render_prefill(&req.messages, &kwargs)
    } else {
        fe.template.render(&req.messages, true, &kwargs)
    };
    rendered.map_err(|e| ApiError::bad_request(e.to_string()))
}

/// `text` as prompt tokens with each of `images` at its placeholder: decoded, sized for the
/// vision tower and laid out as its rows. Without images, plain tokens.
pub(crate) fn tokenize_with_images(
    fe: &Frontend,
    text: &str,
    images: &[ChatImage],
) -> Result<MultimodalPrompt, ApiError> {
    let Some(first) = images.first() else {
        return Ok(MultimodalPrompt {
            tokens: fe.tokenizer.encode(text, true),
            images: Vec::new(),
        });
    };
    let Some(vision) = fe.vision.as_deref() else {
        return Err(ApiError::invalid_field(
            &first.field,
            "the request has an image, but this server has no vision tower: start it with --mmproj FILE",
        ));
    };
    let inputs = images
        .iter()
        .map(|im| {
            decode_image(&im.bytes, &im.field)
                .map(|rgb| ImageInput::new(vision, &rgb))
                .map_err(|e| ApiError::invalid_field(&im.field, e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    MultimodalPrompt::tokenize(&fe.tokenizer, text, true, inputs).map_err(|e| {
        ApiError::bad_request(format!(
            "{e}: the text of the messages must not contain the placeholder itself"
        ))
    })
}

/// The text/JSON parts of a request that run off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("request preparation failed: {e}")))?
}

async fn chat(State(app): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    chat_inner(app, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Everything a request needs before it is submitted, prepared off the async threads.
pub(crate) struct Prepared {
    pub params: GenParams,
    pub tokens: Vec<u32>,
    /// The prompt's images at their rows of `tokens`.
    pub images: Vec<PromptImage>,
    /// Prompt positions worth a prefix-cache snapshot.
    pub cache_points: Vec<usize>,
    pub grammar: Option<Constraint>,
    pub shaping: Shaping,
}

impl Prepared {
    /// Tokens of the prompt.
    pub(crate) fn prompt_len(&self) -> usize {
        self.tokens.len()
    }
}

/// Name each field this server does not know, once, when debug logging is on.
pub(crate) fn log_unknown(app: &App, o: &Map<String, Value>) {
    let unknown = unknown_fields(o);
    if app.cfg.debug_log && !unknown.is_empty() {
        eprintln!(
            "debug: ignoring unknown request fields: {}",
            unknown.join(", ")
        );
    }
}

/// Compile a grammar for a request; a grammar that does not compile is the request's fault.
fn compile(fe: &Frontend, source: &GrammarSource, param: &str) -> Result<Constraint, ApiError> {
    let compiler = fe.grammars().map_err(ApiError::internal)?;
    compiler
        .compile(source)
        .map_err(|e| ApiError::invalid_field(param, format!("'{param}': {e}")))
}

/// `logit_bias` keys as token ids: ids checked against the vocabulary, texts tokenized (every
/// token of the text gets the bias, as in llama-server).
fn resolve_bias(fe: &Frontend, params: &mut GenParams) -> Result<(), ApiError> {
    let mut bias = Vec::new();
    for (key, b) in &params.logit_bias {
        match key {
            BiasKey::Id(id) if *id < fe.n_vocab as u64 => bias.push((*id as u32, *b)),
            BiasKey::Id(id) => {
                return Err(ApiError::invalid_field(
                    "logit_bias",
                    format!(
                        "token id {id} is out of range: the vocabulary has {} tokens",
                        fe.n_vocab
                    ),
                ))
            }
            BiasKey::Text(t) => {
                bias.extend(fe.tokenizer.encode(t, false).into_iter().map(|id| (id, *b)))
            }
        }
    }
    params.sampler.logit_bias = bias;
    Ok(())
}

async fn chat_inner(
    app: AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(body_error)?;
    let fe = frontend(&app)?;
    let app2 = app.clone();
    let fe2 = fe.clone();
    let prepared = blocking(move || {
        let (app, fe) = (app2, fe2);
        let mut o = parse_json(&body)?;
        log_unknown(&app, &o);
        with_server_defaults(&app, &mut o);
        let req = parse_chat(&o)?;
        prepare_chat(&app, &fe, &o, req)
    })
    .await?;
    submit(&app, &fe, prepared, Endpoint::Chat).await
}

/// A chat request (a body with the server's defaults filled in) as what the scheduler runs: the
/// messages through the template, the grammar for `tool_choice` or the output format, and how
/// the answer is cut into reasoning, content and tool calls.
pub(crate) fn prepare_chat(
    app: &App,
    fe: &Frontend,
    o: &Map<String, Value>,
    mut req: ChatRequest,
) -> Result<Prepared, ApiError> {
    // Any model name is accepted, as llama-server does: clients hard-code names.
    resolve_bias(fe, &mut req.params)?;
    let use_tools = uses_tools(&req);
    let text = render_chat(app, fe, &req)?;
    let MultimodalPrompt { tokens, images } = tokenize_with_images(fe, &text, &req.images)?;
    let cache_points: Vec<usize> = final_header(&fe.tokenizer, &tokens).into_iter().collect();
    let in_reasoning = prompt_opens_thinking(&text);
    let reasoning = req.params.reasoning.unwrap_or(app.cfg.reasoning);
    let grammar = match (&req.tool_choice, &req.params.grammar) {
        (ToolChoice::Required | ToolChoice::Named(_), _) if use_tools => {
            let only = match &req.tool_choice {
                ToolChoice::Named(n) => Some(n.as_str()),
                _ => None,
            };
            let reasoning = if in_reasoning {
                Reasoning::Open
            } else if fe.template.source().contains("<think>") {
                Reasoning::Optional
            } else {
                Reasoning::None
            };
            let lark = call_grammar(
                &req.tools,
                only,
                fe.tool_format,
                // A named tool is called once; `required` may call several.
                only.is_none() && req.parallel_tool_calls && !req.legacy_functions,
                reasoning,
            );
            Some(compile(fe, &GrammarSource::Grammar(lark), "tool_choice")?)
        }
        (_, Some(g)) => Some(compile(fe, g, grammar_param(o))?),
        _ => None,
    };
    let shaping = Shaping {
        splitter: match reasoning {
            ReasoningFormat::Deepseek => Some(ReasoningSplitter::new(in_reasoning)),
            ReasoningFormat::None => None,
        },
        tools: use_tools.then(|| {
            ToolCallParser::new(
                req.tools.clone(),
                (!req.parallel_tool_calls || req.legacy_functions).then_some(1),
            )
        }),
        legacy_functions: req.legacy_functions,
        logprobs: req.params.logprobs.is_some(),
        return_tokens: flag(o, "return_tokens", false)?,
        native: None,
    };
    Ok(Prepared {
        params: req.params,
        tokens,
        images,
        cache_points,
        grammar,
        shaping,
    })
}

/// Which field gave the request's grammar (for error messages).
fn grammar_param(o: &Map<String, Value>) -> &'static str {
    ["response_format", "json_schema", "grammar"]
        .into_iter()
        .find(|k| o.get(*k).is_some_and(|v| !v.is_null()))
        .unwrap_or("grammar")
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
    let prepared = blocking(move || {
        let (app, fe) = (app2, fe2);
        let mut o = parse_json(&body)?;
        log_unknown(&app, &o);
        with_server_defaults(&app, &mut o);
        let mut req = parse_completion(&o)?;
        // Any model name is accepted, as llama-server does: clients hard-code names.
        resolve_bias(&fe, &mut req.params)?;
        let MultimodalPrompt { tokens, images } = match &req.prompt {
            Prompt::Text(t) => tokenize_with_images(&fe, t, &[])?,
            Prompt::Tokens(t) => MultimodalPrompt {
                tokens: t.clone(),
                images: Vec::new(),
            },
            Prompt::Multimodal { text, images } => tokenize_with_images(&fe, text, images)?,
        };
        let grammar = match &req.params.grammar {
            Some(g) => Some(compile(&fe, g, grammar_param(&o))?),
            None => None,
        };
        let shaping = Shaping {
            splitter: None,
            tools: None,
            legacy_functions: false,
            logprobs: req.params.logprobs.is_some(),
            return_tokens: flag(&o, "return_tokens", false)?,
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

/// A request handed to the scheduler: its event channel, and how its answer is to be shaped.
pub(crate) struct Submitted {
    pub rx: tokio::sync::mpsc::UnboundedReceiver<nextn_engine::scheduler::Event>,
    pub params: GenParams,
    pub shaping: Shaping,
}

/// Check a prepared request against the loaded model and hand it to the scheduler.
pub(crate) fn enqueue(app: &AppState, prepared: Prepared) -> Result<Submitted, ApiError> {
    let Prepared {
        params,
        tokens,
        images,
        cache_points: prepared_cache_points,
        grammar,
        shaping,
    } = prepared;
    let info = app
        .handle
        .info()
        .ok_or_else(|| ApiError::unavailable("Loading model"))?;
    if tokens.is_empty() {
        return Err(ApiError::invalid_field("prompt", "the prompt is empty"));
    }
    if let Some(&bad) = tokens
        .iter()
        .find(|&&t| t as usize >= info.n_vocab && !is_image_token(t))
    {
        return Err(ApiError::invalid_field(
            "prompt",
            format!(
                "token id {bad} is out of range: the vocabulary has {} tokens",
                info.n_vocab
            ),
        ));
    }
    if tokens.len() >= info.n_ctx_slot {
        let mut e = ApiError::new(
            StatusCode::BAD_REQUEST,
            "exceed_context_size_error",
            format!(
                "the request exceeds the available context size: the prompt has {} tokens{} and a slot holds {} (at least one more is needed to generate)",
                tokens.len(),
                match images.len() {
                    0 => String::new(),
                    k => format!(
                        " ({} of them for {k} image(s))",
                        images.iter().map(|im| im.n_tokens()).sum::<usize>()
                    ),
                },
                info.n_ctx_slot
            ),
        );
        e.extra = Some(Box::new(
            json!({"n_prompt_tokens": tokens.len(), "n_ctx": info.n_ctx_slot}),
        ));
        return Err(e);
    }
    let forced_acceptance = match (&params.forced_reference, &app.cfg.forced_acceptance) {
        (None, _) => None,
        (Some(_), None) => {
            return Err(ApiError::invalid_field(
                "forced_acceptance_reference",
                "'forced_acceptance_reference' needs a server started with --force-acceptance",
            ))
        }
        (Some(reference), Some(rates)) => Some(
            ForcedAcceptance::new(rates, params.sampler.seed, reference.clone())
                .map_err(|e| ApiError::bad_request(e.to_string()))?,
        ),
    };
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let request = nextn_engine::scheduler::Request {
        prompt: tokens,
        sampler: params.sampler.clone(),
        n_predict: params.n_predict,
        stop: params.stop.clone(),
        ignore_eos: params.ignore_eos,
        trace: false,
        grammar,
        logprobs: params.logprobs,
        cache_prompt: params.cache_prompt,
        cache_points: prepared_cache_points,
        forced_acceptance,
        // As llama-server: progress is part of a stream only.
        images,
        prompt_progress: params.return_progress && params.stream,
        sink: Box::new(respond::ChannelSink(tx)),
    };
    app.handle.submit(request).map_err(submit_error)?;
    Ok(Submitted {
        rx,
        params,
        shaping,
    })
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
        assert!(key_matches(&keys, "bb") && key_matches(&keys, "a") && !key_matches(&keys, "c"));
        assert!(!key_matches(&[], "a"));
    }
}
