//! Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.
//!
//! A thin mapping: the request becomes a chat-completions request (system prompt, messages,
//! tools, `tool_choice`, sampling, thinking on or off), which then takes the chat path (template,
//! tokenizer, grammar for a required tool, the one generation loop, the tool-call parser and the
//! reasoning splitter); the parts of the answer become Anthropic's content blocks (`thinking`,
//! `text`, `tool_use`), whole or as Anthropic's stream events. Errors on these routes take
//! Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`).

use std::collections::VecDeque;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use nextn_engine::scheduler::{Completion, Event};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::error::ApiError;
use crate::handler::{blocking, body_error, frontend, with_server_defaults, AppState};
use crate::image_url::fetch_images;
use crate::prepare::{prepare_chat, render_chat, tokenize_with_images};
use crate::reasoning::effort_budget;
use crate::request::{fresh_seed, parse_chat, parse_json};
use crate::respond::{failure, sse_response, started, Part, Reply};
use crate::submit::{enqueue, Submitted};

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

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid_field(param, message)
}

// ---------------------------------------------------------------------------------------------
// The request

/// Fields this API reads or checks; others are ignored (logged once at debug level).
const KNOWN_FIELDS: &[&str] = &[
    "model",
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "tools",
    "tool_choice",
    "thinking",
    "metadata",
    "context_management",
    "output_config",
    "service_tier",
    "container",
    "mcp_servers",
];

/// A Messages request as a chat-completions request, and what the answer needs to know.
#[derive(Debug, PartialEq)]
pub(crate) struct Converted {
    /// The chat-completions body the chat path parses.
    pub chat: Map<String, Value>,
    /// Tools offered with `defer_loading`: parsed in the answer, not shown in the prompt.
    pub deferred: Vec<String>,
    /// The thinking text goes into the answer (`thinking.display` is not `omitted`).
    pub show_thinking: bool,
    pub stop_sequences: Vec<String>,
}

fn as_object<'a>(v: &'a Value, param: &str) -> Result<&'a Map<String, Value>, ApiError> {
    v.as_object()
        .ok_or_else(|| bad(param, format!("'{param}' must be an object")))
}

fn block_type<'a>(b: &'a Map<String, Value>, param: &str) -> Result<&'a str, ApiError> {
    b.get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(param, format!("'{param}' needs a 'type' string")))
}

fn text_of<'a>(b: &'a Map<String, Value>, param: &str) -> Result<&'a str, ApiError> {
    b.get("text").and_then(Value::as_str).ok_or_else(|| {
        bad(
            param,
            format!("'{param}' is a text block and needs a 'text' string"),
        )
    })
}

fn refuse_block(kind: &str, param: &str) -> ApiError {
    match kind {
        "image" => bad(
            param,
            "image blocks are read in user messages only (not in system prompts, tool results or assistant messages)",
        ),
        "document" => bad(
            param,
            "content blocks of type 'document' are not supported: the model reads text and images",
        ),
        other => bad(
            param,
            format!("content blocks of type '{other}' are not supported here"),
        ),
    }
}

/// Claude Code starts its system prompt with an `x-anthropic-billing-header:` line whose
/// `cch=` stamp changes with every request; it means nothing to the model, and left as it is
/// no request could resume from the prefix cache past it. The stamp's value is blanked.
fn normalize_billing_header(text: &str) -> String {
    const HEADER: &str = "x-anthropic-billing-header:";
    if !text.starts_with(HEADER) {
        return text.to_string();
    }
    let line_end = text.find('\n').unwrap_or(text.len());
    let Some(at) = text[..line_end].find("cch=") else {
        return text.to_string();
    };
    let start = at + "cch=".len();
    let end = text[start..line_end]
        .find(';')
        .map_or(line_end, |n| start + n);
    let mut out = String::with_capacity(text.len());
    out.push_str(&text[..start]);
    out.extend(std::iter::repeat_n('0', end - start));
    out.push_str(&text[end..]);
    out
}

/// `system`: a string or an array of text blocks.
fn system_text(v: &Value) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(normalize_billing_header(s)),
        Value::Array(blocks) => {
            let mut text = String::new();
            for (i, b) in blocks.iter().enumerate() {
                let param = format!("system[{i}]");
                let b = as_object(b, &param)?;
                match block_type(b, &param)? {
                    "text" => text.push_str(&normalize_billing_header(text_of(b, &param)?)),
                    other => return Err(refuse_block(other, &param)),
                }
            }
            Ok(text)
        }
        _ => Err(bad(
            "system",
            "'system' must be a string or an array of text blocks",
        )),
    }
}

/// A `tool_result`'s `content`: a string or text blocks (a `tool_reference` from a tool search
/// names a tool, which is shown by its definition).
fn tool_result_text(
    v: Option<&Value>,
    param: &str,
    tools: &Map<String, Value>,
) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for (i, b) in blocks.iter().enumerate() {
                let param = format!("{param}.content[{i}]");
                let b = as_object(b, &param)?;
                match block_type(b, &param)? {
                    "text" => text.push_str(text_of(b, &param)?),
                    "tool_reference" => {
                        let name = b.get("tool_name").and_then(Value::as_str).ok_or_else(|| {
                            bad(&param, "a tool_reference block needs a 'tool_name' string")
                        })?;
                        let def = tools.get(name).ok_or_else(|| {
                            bad(
                                &param,
                                format!("'{name}' is not one of the request's tools"),
                            )
                        })?;
                        if !text.is_empty() {
                            text.push('\n');
                        }
                        text.push_str(&def.to_string());
                    }
                    other => return Err(refuse_block(other, &param)),
                }
            }
            Ok(text)
        }
        Some(_) => Err(bad(
            param,
            format!("'{param}.content' must be a string or an array of blocks"),
        )),
    }
}

/// One message's content blocks as chat messages, appended to `out`. A user message's
/// `tool_result` blocks become `tool` messages, in order with its text.
fn convert_message(
    m: &Map<String, Value>,
    at: usize,
    tools: &Map<String, Value>,
    out: &mut Vec<Value>,
) -> Result<(), ApiError> {
    let param = format!("messages[{at}]");
    let role = match m.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant" | "system")) => r,
        Some(r) => {
            return Err(bad(
                &format!("{param}.role"),
                format!("unknown role '{r}': it must be \"user\" or \"assistant\""),
            ))
        }
        None => {
            return Err(bad(
                &format!("{param}.role"),
                "each message needs a 'role' string",
            ))
        }
    };
    let blocks = match m.get("content") {
        Some(Value::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(blocks)) => blocks,
        _ => {
            return Err(bad(
                &format!("{param}.content"),
                "'content' must be a string or an array of content blocks",
            ))
        }
    };
    let mut text = String::new();
    // A user message's images, each after the text before it: the message's content becomes
    // chat completions' parts.
    let mut parts: Vec<Value> = Vec::new();
    let mut thinking: Option<String> = None;
    let mut calls = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        let bparam = format!("{param}.content[{i}]");
        let b = as_object(b, &bparam)?;
        let kind = block_type(b, &bparam)?;
        match (kind, role) {
            ("text", _) => text.push_str(text_of(b, &bparam)?),
            ("image", "user") => {
                if !text.is_empty() {
                    parts.push(json!({"type": "text", "text": std::mem::take(&mut text)}));
                }
                parts.push(image_part(b, &bparam)?);
            }
            ("thinking", "assistant") => {
                let t = b
                    .get("thinking")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(&bparam, "a thinking block needs a 'thinking' string"))?;
                thinking.get_or_insert_with(String::new).push_str(t);
            }
            // Another server's encrypted reasoning: there is nothing here that could read it.
            ("redacted_thinking", "assistant") => {}
            ("tool_use", "assistant") => {
                let id = b
                    .get("id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(&bparam, "a tool_use block needs an 'id' string"))?;
                let name = b
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(&bparam, "a tool_use block needs a 'name' string"))?;
                let input = match b.get("input") {
                    Some(v @ Value::Object(_)) => v.clone(),
                    _ => return Err(bad(&bparam, "a tool_use block's 'input' must be an object")),
                };
                calls.push(json!({
                    "id": id, "type": "function",
                    "function": {"name": name, "arguments": input.to_string()},
                }));
            }
            ("tool_result", "user") => {
                if !text.is_empty() || !parts.is_empty() {
                    let content = user_content(&mut parts, std::mem::take(&mut text));
                    out.push(json!({"role": "user", "content": content}));
                }
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        bad(&bparam, "a tool_result block needs a 'tool_use_id' string")
                    })?;
                let mut content = tool_result_text(b.get("content"), &bparam, tools)?;
                match b.get("is_error") {
                    None | Some(Value::Null | Value::Bool(false)) => {}
                    // The template has no field for it: the model reads it in the result.
                    Some(Value::Bool(true)) => content = format!("Error: {content}"),
                    Some(_) => return Err(bad(&bparam, "'is_error' must be true or false")),
                }
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            ("thinking" | "redacted_thinking" | "tool_use", _) => {
                return Err(bad(
                    &bparam,
                    format!("'{kind}' blocks belong in assistant messages"),
                ))
            }
            ("tool_result", _) => {
                return Err(bad(&bparam, "'tool_result' blocks belong in user messages"))
            }
            (other, _) => return Err(refuse_block(other, &bparam)),
        }
    }
    let mut msg = json!({"role": role, "content": user_content(&mut parts, text)});
    if let Some(t) = thinking {
        msg["reasoning_content"] = json!(t);
    }
    if !calls.is_empty() {
        msg["tool_calls"] = Value::Array(calls);
    }
    let has_tool_messages = out
        .last()
        .is_some_and(|m| m["role"] == "tool" && role == "user");
    // A user message made of tool results alone has no user text to add.
    if !(has_tool_messages && msg["content"] == "" && msg.get("tool_calls").is_none()) {
        out.push(msg);
    }
    Ok(())
}

/// A message's content for chat completions: its text, or with images its parts in order.
fn user_content(parts: &mut Vec<Value>, text: String) -> Value {
    if parts.is_empty() {
        return json!(text);
    }
    if !text.is_empty() {
        parts.push(json!({"type": "text", "text": text}));
    }
    Value::Array(std::mem::take(parts))
}

/// An `image` block as chat completions' `image_url` part: a `base64` source as a data URI, a
/// `url` source as its URL (fetched only where the server allows it).
fn image_part(b: &Map<String, Value>, param: &str) -> Result<Value, ApiError> {
    let source = b
        .get("source")
        .and_then(Value::as_object)
        .ok_or_else(|| bad(param, "an image block needs a 'source' object"))?;
    let field = |name: &str| {
        source.get(name).and_then(Value::as_str).ok_or_else(|| {
            bad(
                &format!("{param}.source.{name}"),
                format!("the image source needs a '{name}' string"),
            )
        })
    };
    let url = match source.get("type").and_then(Value::as_str) {
        Some("base64") => format!("data:{};base64,{}", field("media_type")?, field("data")?),
        Some("url") => field("url")?.to_string(),
        Some(other) => {
            return Err(bad(
                &format!("{param}.source.type"),
                format!(
                    "image sources of type '{other}' are not supported (use \"base64\" or \"url\")"
                ),
            ))
        }
        None => {
            return Err(bad(
                &format!("{param}.source.type"),
                "the image source needs a 'type'",
            ))
        }
    };
    Ok(json!({"type": "image_url", "image_url": {"url": url}}))
}

/// A request's tools: as chat completions takes them, their definitions by name (for
/// `tool_reference` blocks), and the names of the deferred ones.
type ConvertedTools = (Vec<Value>, Map<String, Value>, Vec<String>);

/// `tools`: Anthropic's client tools as chat-completions tools.
fn convert_tools(v: Option<&Value>) -> Result<ConvertedTools, ApiError> {
    let (mut tools, mut defs, mut deferred) = (Vec::new(), Map::new(), Vec::new());
    let list = match v {
        None | Some(Value::Null) => return Ok((tools, defs, deferred)),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(bad("tools", "'tools' must be an array")),
    };
    for (i, t) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        let t = as_object(t, &param)?;
        match t.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(other) => {
                return Err(bad(
                    &param,
                    format!("tools of type '{other}' (Anthropic's server tools) are not supported: give client tools with 'name', 'description' and 'input_schema'"),
                ))
            }
        }
        let name = t
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(&param, format!("'{param}.name' must be a string")))?;
        let schema = match t.get("input_schema") {
            Some(s @ Value::Object(_)) => s.clone(),
            _ => {
                return Err(bad(
                    &param,
                    format!("'{param}.input_schema' must be a JSON Schema object"),
                ))
            }
        };
        if t.get("strict") == Some(&Value::Bool(true)) {
            return Err(bad(
                &param,
                "'strict' tools are not supported: inputs follow the schema only with tool_choice \"any\" or \"tool\"",
            ));
        }
        match t.get("defer_loading") {
            None | Some(Value::Null | Value::Bool(false)) => {}
            Some(Value::Bool(true)) => deferred.push(name.to_string()),
            Some(_) => {
                return Err(bad(
                    &param,
                    format!("'{param}.defer_loading' must be true or false"),
                ))
            }
        }
        let mut function = json!({"name": name, "parameters": schema});
        if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
            let d = d
                .as_str()
                .ok_or_else(|| bad(&param, format!("'{param}.description' must be a string")))?;
            function["description"] = json!(d);
        }
        defs.insert(
            name.to_string(),
            json!({"name": name, "description": function.get("description"), "input_schema": function["parameters"]}),
        );
        tools.push(json!({"type": "function", "function": function}));
    }
    Ok((tools, defs, deferred))
}

/// `tool_choice` as chat completions' `tool_choice` and `parallel_tool_calls`.
fn convert_tool_choice(v: &Value) -> Result<(Value, bool), ApiError> {
    let o = as_object(v, "tool_choice")?;
    let parallel = match o.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => !b,
        Some(_) => {
            return Err(bad(
                "tool_choice",
                "'tool_choice.disable_parallel_tool_use' must be true or false",
            ))
        }
    };
    let choice = match o.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => match o.get("name").and_then(Value::as_str) {
            Some(n) => json!({"type": "function", "function": {"name": n}}),
            None => {
                return Err(bad(
                    "tool_choice",
                    "'tool_choice' of type \"tool\" needs a 'name'",
                ))
            }
        },
        _ => {
            return Err(bad(
                "tool_choice",
                "'tool_choice.type' must be \"auto\", \"any\", \"tool\" or \"none\"",
            ))
        }
    };
    Ok((choice, parallel))
}

/// What `thinking` asks for.
struct Thinking {
    /// The template opens a reasoning block.
    on: bool,
    /// Its text is shown (`display` is not `omitted`).
    show: bool,
    /// `budget_tokens` of type `enabled`.
    budget: Option<i64>,
}

/// `thinking`, validated as Anthropic does.
fn convert_thinking(v: &Value, max_tokens: Option<i64>) -> Result<Thinking, ApiError> {
    let o = as_object(v, "thinking")?;
    let show = match o.get("display").and_then(Value::as_str) {
        None | Some("summarized") => true,
        Some("omitted") => false,
        Some(other) => {
            return Err(bad(
                "thinking",
                format!("'thinking.display' '{other}' must be \"summarized\" or \"omitted\""),
            ))
        }
    };
    match o.get("type").and_then(Value::as_str) {
        Some("disabled") => Ok(Thinking {
            on: false,
            show,
            budget: None,
        }),
        Some("adaptive") => Ok(Thinking {
            on: true,
            show,
            budget: None,
        }),
        Some("enabled") => {
            let budget = o
                .get("budget_tokens")
                .and_then(Value::as_i64)
                .ok_or_else(|| {
                    bad(
                        "thinking.budget_tokens",
                        "'thinking' of type \"enabled\" needs an integer 'budget_tokens'",
                    )
                })?;
            if budget < 1024 {
                return Err(bad(
                    "thinking.budget_tokens",
                    format!("'thinking.budget_tokens' must be at least 1024, got {budget}"),
                ));
            }
            if max_tokens.is_some_and(|m| budget >= m) {
                return Err(bad(
                    "thinking.budget_tokens",
                    "'max_tokens' must be greater than 'thinking.budget_tokens'",
                ));
            }
            Ok(Thinking {
                on: true,
                show,
                budget: Some(budget),
            })
        }
        _ => Err(bad(
            "thinking",
            "'thinking.type' must be \"enabled\", \"adaptive\" or \"disabled\"",
        )),
    }
}

/// Fields that ask for what this server does not do, refused unless they ask for nothing.
fn refuse_unsupported(o: &Map<String, Value>) -> Result<(), ApiError> {
    if let Some(cm) = o.get("context_management").filter(|v| !v.is_null()) {
        let edits = cm.get("edits").and_then(Value::as_array);
        let Some(edits) = edits else {
            return Err(bad(
                "context_management",
                "'context_management' needs an 'edits' array",
            ));
        };
        for e in edits {
            // Keeping every thinking block clears nothing: the template decides which earlier
            // reasoning the prompt shows.
            let keeps_all = e.get("type").and_then(Value::as_str)
                == Some("clear_thinking_20251015")
                && e.get("keep").is_none_or(|k| k == "all");
            if !keeps_all {
                return Err(bad(
                    "context_management",
                    format!("context edit {e} is not supported (only clear_thinking_20251015 keeping \"all\")"),
                ));
            }
        }
    }
    if let Some(oc) = o.get("output_config").filter(|v| !v.is_null()) {
        let oc = as_object(oc, "output_config")?;
        for (k, v) in oc {
            match (k.as_str(), v) {
                (_, Value::Null) => {}
                ("effort", Value::String(e))
                    if matches!(e.as_str(), "low" | "medium" | "high" | "max") => {}
                ("effort", _) => {
                    return Err(bad(
                        "output_config.effort",
                        "'output_config.effort' must be \"low\", \"medium\", \"high\" or \"max\"",
                    ))
                }
                (other, _) => {
                    return Err(bad(
                        "output_config",
                        format!("'output_config.{other}' is not supported"),
                    ))
                }
            }
        }
    }
    match o.get("service_tier") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "auto" || s == "standard_only" => {}
        Some(_) => {
            return Err(bad(
                "service_tier",
                "'service_tier' must be \"auto\" or \"standard_only\"",
            ))
        }
    }
    for name in ["container", "mcp_servers"] {
        if o.get(name).is_some_and(|v| !v.is_null()) {
            return Err(bad(name, format!("'{name}' is not supported")));
        }
    }
    if let Some(m) = o.get("metadata").filter(|v| !v.is_null()) {
        let m = as_object(m, "metadata")?;
        if m.get("user_id")
            .is_some_and(|u| !u.is_null() && !u.is_string())
        {
            return Err(bad(
                "metadata.user_id",
                "'metadata.user_id' must be a string",
            ));
        }
    }
    Ok(())
}

/// A Messages body as a chat-completions body. `count_only`: `/count_tokens`, which has no
/// `max_tokens`.
pub(crate) fn convert(o: &Map<String, Value>, count_only: bool) -> Result<Converted, ApiError> {
    let mut chat = Map::new();
    match o.get("model") {
        Some(Value::String(m)) => {
            chat.insert("model".into(), json!(m));
        }
        _ => return Err(bad("model", "'model' must be a string")),
    }
    let max_tokens = match o.get("max_tokens") {
        Some(v) => match v.as_i64() {
            Some(n) if n >= 1 => Some(n),
            _ => {
                return Err(bad(
                    "max_tokens",
                    "'max_tokens' must be an integer of at least 1",
                ))
            }
        },
        None if count_only => None,
        None => return Err(bad("max_tokens", "'max_tokens' is required")),
    };
    if let Some(n) = max_tokens.filter(|_| !count_only) {
        chat.insert("max_tokens".into(), json!(n));
    }
    refuse_unsupported(o)?;
    let (tools, defs, deferred) = convert_tools(o.get("tools"))?;
    let mut messages = Vec::new();
    if let Some(s) = o.get("system").filter(|v| !v.is_null()) {
        messages.push(json!({"role": "system", "content": system_text(s)?}));
    }
    let raw = match o.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => return Err(bad("messages", "'messages' must not be empty")),
        _ => return Err(bad("messages", "'messages' must be an array of messages")),
    };
    for (i, m) in raw.iter().enumerate() {
        let m = as_object(m, &format!("messages[{i}]"))?;
        convert_message(m, i, &defs, &mut messages)?;
    }
    chat.insert("messages".into(), Value::Array(messages));
    if !tools.is_empty() {
        chat.insert("tools".into(), Value::Array(tools));
    }
    if let Some(tc) = o.get("tool_choice").filter(|v| !v.is_null()) {
        let (choice, parallel) = convert_tool_choice(tc)?;
        chat.insert("tool_choice".into(), choice);
        chat.insert("parallel_tool_calls".into(), json!(parallel));
    }
    let stop_sequences = match o.get("stop_sequences") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str().map(str::to_string).ok_or_else(|| {
                    bad(
                        "stop_sequences",
                        "'stop_sequences' must be an array of strings",
                    )
                })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(bad(
                "stop_sequences",
                "'stop_sequences' must be an array of strings",
            ))
        }
    };
    if !stop_sequences.is_empty() {
        chat.insert("stop".into(), json!(stop_sequences));
    }
    if let Some(t) = o.get("temperature").filter(|v| !v.is_null()) {
        match t.as_f64() {
            Some(x) if (0.0..=1.0).contains(&x) => {}
            _ => {
                return Err(bad(
                    "temperature",
                    "'temperature' must be a number between 0 and 1",
                ))
            }
        }
    }
    for k in ["temperature", "top_p", "top_k", "stream"] {
        if let Some(v) = o.get(k).filter(|v| !v.is_null()) {
            chat.insert(k.into(), v.clone());
        }
    }
    let mut show_thinking = true;
    let mut budget = None;
    if let Some(t) = o.get("thinking").filter(|v| !v.is_null()) {
        let thinking = convert_thinking(t, max_tokens)?;
        show_thinking = thinking.show;
        budget = thinking.budget;
        chat.insert(
            "chat_template_kwargs".into(),
            json!({"enable_thinking": thinking.on}),
        );
    }
    // An explicit budget wins over the effort's share of `max_tokens`.
    let effort = o
        .get("output_config")
        .and_then(|c| c.get("effort"))
        .and_then(Value::as_str);
    let budget = budget.or_else(|| {
        let allowance = u64::try_from(max_tokens?).ok()?;
        effort_budget(effort?, allowance).and_then(|b| i64::try_from(b).ok())
    });
    if let Some(b) = budget {
        chat.insert("thinking_budget_tokens".into(), json!(b));
    }
    // Thinking is always its own block here, whatever the server's --reasoning-format.
    chat.insert("reasoning_format".into(), json!("deepseek"));
    if o.get("stream") == Some(&Value::Bool(true)) {
        // The first progress event carries the prefix-cache hit for `message_start`.
        chat.insert("return_progress".into(), json!(true));
    }
    Ok(Converted {
        chat,
        deferred,
        show_thinking,
        stop_sequences,
    })
}

fn log_unknown(app: &AppState, o: &Map<String, Value>) {
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
        .filter(|k| !KNOWN_FIELDS.contains(&k.as_str()) && seen.insert((*k).clone()))
        .map(String::as_str)
        .collect();
    if !unknown.is_empty() {
        eprintln!(
            "debug: ignoring unknown Messages request fields: {}",
            unknown.join(", ")
        );
    }
}

/// The request as the chat path takes it: parsed, deferred tools out of the template's list.
fn chat_request(
    app: &AppState,
    c: &mut Converted,
) -> Result<crate::request::ChatRequest, ApiError> {
    with_server_defaults(app, &mut c.chat);
    let mut req = parse_chat(&c.chat)?;
    if let Value::Array(list) = &mut req.tools_for_template {
        list.retain(|t| {
            let name = t["function"]["name"].as_str().unwrap_or_default();
            !c.deferred.iter().any(|d| d == name)
        });
    }
    Ok(req)
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
    let fe = frontend(&app)?;
    let app2 = app.clone();
    let mut req = blocking(move || {
        let o = parse_json(&body)?;
        let mut c = convert(&o, true)?;
        chat_request(&app2, &mut c)
    })
    .await?;
    // Images count by the rows they take in the prompt, so URLs are fetched to be counted.
    fetch_images(&app, &fe, &mut req.images).await?;
    let n = blocking(move || {
        let text = render_chat(&app, &fe, &req)?;
        Ok(tokenize_with_images(&fe, &text, &req.images)?.tokens.len())
    })
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
    let fe = frontend(&app)?;
    let app2 = app.clone();
    let (c, mut req) = blocking(move || {
        let o = parse_json(&body)?;
        log_unknown(&app2, &o);
        let mut c = convert(&o, false)?;
        let req = chat_request(&app2, &mut c)?;
        Ok((c, req))
    })
    .await?;
    fetch_images(&app, &fe, &mut req.images).await?;
    let (app2, fe2) = (app.clone(), fe.clone());
    let (prepared, c, prompt_tokens) = blocking(move || {
        let prepared = prepare_chat(&app2, &fe2, &c.chat, req)?;
        let n = prepared.prompt_len();
        Ok((prepared, c, n))
    })
    .await?;
    let Submitted {
        rx,
        params,
        shaping,
    } = enqueue(&app, prepared)?;
    let model = c.chat["model"].as_str().unwrap_or_default().to_string();
    let reply = Reply::new(
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
        model,
        show_thinking: c.show_thinking,
        stop_sequences: c.stop_sequences,
        prompt_tokens,
    };
    if params.stream {
        stream(rx, answer).await
    } else {
        collect(rx, answer).await
    }
}

// ---------------------------------------------------------------------------------------------
// The answer

struct Answer {
    reply: Reply,
    tokenizer: std::sync::Arc<nextn_engine::tokenizer::Tokenizer>,
    id: String,
    model: String,
    show_thinking: bool,
    stop_sequences: Vec<String>,
    prompt_tokens: usize,
}

/// Anthropic's tool-use ids: the chat path's call id with Anthropic's prefix.
fn tool_use_id(call_id: &str) -> String {
    format!("toolu_{}", call_id.strip_prefix("call_").unwrap_or(call_id))
}

/// A thinking block's `signature`: Anthropic's is an opaque check that the block came from the
/// model unchanged; here it is a digest of the block's text (64-bit FNV-1a, hex), which clients
/// only send back.
#[derive(Clone, Copy)]
struct Signature(u64);

impl Signature {
    fn new() -> Self {
        Signature(0xcbf2_9ce4_8422_2325)
    }
    fn add(&mut self, text: &str) {
        for b in text.bytes() {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn text(self) -> String {
        format!("nextn-fnv1a64:{:016x}", self.0)
    }
}

fn usage(c: &Completion) -> Value {
    let cached = c.timings.cache_n.min(c.prompt_tokens);
    json!({
        "input_tokens": c.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": c.completion_tokens,
    })
}

impl Answer {
    /// `stop_reason` and `stop_sequence`. A stop sequence is told from an end-of-generation
    /// token by finding it in the output's text (the stop matcher ends at its first occurrence).
    fn stop(&self, c: &Completion) -> (&'static str, Value) {
        match self.reply.finish_reason(c) {
            "tool_calls" => ("tool_use", Value::Null),
            "length" => ("max_tokens", Value::Null),
            _ => {
                let text = self.tokenizer.decode(&c.tokens);
                let hit = self
                    .stop_sequences
                    .iter()
                    .filter(|s| !s.is_empty())
                    .filter_map(|s| text.find(s.as_str()).map(|at| (at, s)))
                    .min_by_key(|(at, _)| *at);
                match hit {
                    Some((_, s)) => ("stop_sequence", json!(s)),
                    None => ("end_turn", Value::Null),
                }
            }
        }
    }

    fn message(&self, content: Vec<Value>, stop: (&str, Value), usage: Value) -> Value {
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop.0,
            "stop_sequence": stop.1,
            "usage": usage,
        })
    }
}

async fn collect(mut rx: UnboundedReceiver<Event>, mut a: Answer) -> Result<Response, ApiError> {
    started(&mut rx).await?;
    let mut parts = Vec::new();
    let completion = loop {
        match rx.recv().await {
            Some(Event::Text(t)) => parts.extend(a.reply.parts(&t)),
            Some(Event::Done(c)) => break c,
            Some(Event::Failed { kind, message }) => return Err(failure(kind, message)),
            Some(_) => {}
            None => {
                return Err(ApiError::internal(
                    "the engine stopped before the request finished",
                ))
            }
        }
    };
    parts.extend(a.reply.finish_parts());
    a.reply.log(&completion);
    let mut content: Vec<Value> = Vec::new();
    let mut signature = Signature::new();
    for p in parts {
        match p {
            Part::Reasoning(r) => {
                signature.add(&r);
                let shown = if a.show_thinking { r } else { String::new() };
                match content.last_mut() {
                    Some(b) if b["type"] == "thinking" => {
                        let t = b["thinking"].as_str().unwrap_or_default().to_string() + &shown;
                        b["thinking"] = json!(t);
                    }
                    _ => content
                        .push(json!({"type": "thinking", "thinking": shown, "signature": ""})),
                }
            }
            Part::Content(c) => match content.last_mut() {
                Some(b) if b["type"] == "text" => {
                    let t = b["text"].as_str().unwrap_or_default().to_string() + &c;
                    b["text"] = json!(t);
                }
                _ => content.push(json!({"type": "text", "text": c})),
            },
            Part::CallStart { .. } | Part::CallArguments { .. } => {}
        }
    }
    for b in &mut content {
        if b["type"] == "thinking" {
            b["signature"] = json!(signature.text());
        }
    }
    for (id, call) in a.reply.calls() {
        content.push(json!({
            "type": "tool_use",
            "id": tool_use_id(id),
            "name": call.name,
            "input": Value::Object(call.arguments.clone()),
        }));
    }
    let stop = a.stop(&completion);
    let body = a.message(content, stop, usage(&completion));
    Ok(crate::handler::json_response(StatusCode::OK, body))
}

fn event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// The content block a stream has open.
enum Open {
    Thinking(Signature),
    Text,
    /// A tool_use block, for the call with this index.
    Tool(usize),
}

crate::respond::sse_frames!(StreamState);

struct StreamState {
    rx: UnboundedReceiver<Event>,
    answer: Answer,
    frames: VecDeque<Bytes>,
    started: bool,
    /// Index of the next content block.
    next_block: usize,
    open: Option<Open>,
    finished: bool,
}

impl StreamState {
    fn push(&mut self, name: &str, data: Value) {
        self.frames.push_back(event(name, &data));
    }

    /// `message_start` and a `ping`, once: the usage so far (the prompt, its prefix-cache hit).
    fn start(&mut self, cached: usize) {
        if self.started {
            return;
        }
        self.started = true;
        let cached = cached.min(self.answer.prompt_tokens);
        let mut m = self.answer.message(
            Vec::new(),
            ("", Value::Null),
            json!({
                "input_tokens": self.answer.prompt_tokens - cached,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached,
                "output_tokens": 0,
            }),
        );
        m["stop_reason"] = Value::Null;
        self.push(
            "message_start",
            json!({"type": "message_start", "message": m}),
        );
        self.push("ping", json!({"type": "ping"}));
    }

    fn close_block(&mut self) {
        let Some(open) = self.open.take() else {
            return;
        };
        let index = self.next_block - 1;
        if let Open::Thinking(sig) = open {
            self.push(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index,
                       "delta": {"type": "signature_delta", "signature": sig.text()}}),
            );
        }
        self.push(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        );
    }

    fn open_block(&mut self, open: Open, block: Value) {
        self.close_block();
        let index = self.next_block;
        self.next_block += 1;
        self.open = Some(open);
        self.push(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        );
    }

    fn delta(&mut self, delta: Value) {
        let index = self.next_block - 1;
        self.push(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index, "delta": delta}),
        );
    }

    fn parts(&mut self, parts: Vec<Part>) {
        for p in parts {
            match p {
                Part::Reasoning(r) => {
                    if !matches!(self.open, Some(Open::Thinking(_))) {
                        self.open_block(
                            Open::Thinking(Signature::new()),
                            json!({"type": "thinking", "thinking": "", "signature": ""}),
                        );
                    }
                    if let Some(Open::Thinking(sig)) = &mut self.open {
                        sig.add(&r);
                    }
                    if self.answer.show_thinking {
                        self.delta(json!({"type": "thinking_delta", "thinking": r}));
                    }
                }
                Part::Content(c) => {
                    if !matches!(self.open, Some(Open::Text)) {
                        self.open_block(Open::Text, json!({"type": "text", "text": ""}));
                    }
                    self.delta(json!({"type": "text_delta", "text": c}));
                }
                Part::CallStart { index, id, name } => self.open_block(
                    Open::Tool(index),
                    json!({"type": "tool_use", "id": tool_use_id(&id), "name": name, "input": {}}),
                ),
                Part::CallArguments { index, text } => {
                    if matches!(self.open, Some(Open::Tool(i)) if i == index) {
                        self.delta(json!({"type": "input_json_delta", "partial_json": text}));
                    }
                }
            }
        }
    }

    fn on_event(&mut self, ev: Option<Event>) {
        match ev {
            Some(Event::PromptProgress { cache, .. }) => self.start(cache),
            Some(Event::Text(t)) => {
                self.start(0);
                let parts = self.answer.reply.parts(&t);
                self.parts(parts);
            }
            Some(Event::Done(c)) => {
                self.start(c.timings.cache_n);
                let parts = self.answer.reply.finish_parts();
                self.parts(parts);
                self.close_block();
                self.answer.reply.log(&c);
                let (reason, seq) = self.answer.stop(&c);
                self.push(
                    "message_delta",
                    json!({"type": "message_delta",
                           "delta": {"stop_reason": reason, "stop_sequence": seq},
                           "usage": usage(&c)}),
                );
                self.push("message_stop", json!({"type": "message_stop"}));
                self.finished = true;
            }
            Some(Event::Failed { kind, message }) => self.fail(&failure(kind, message)),
            Some(Event::Started { .. } | Event::Logprobs(_)) => {}
            None => self.fail(&ApiError::internal(
                "the engine stopped before the request finished",
            )),
        }
    }

    fn fail(&mut self, e: &ApiError) {
        let mut body = error_body(e);
        if let Value::Object(m) = &mut body {
            m.remove("request_id");
        }
        self.push("error", body);
        self.finished = true;
    }
}

async fn stream(
    mut rx: UnboundedReceiver<Event>,
    mut answer: Answer,
) -> Result<Response, ApiError> {
    started(&mut rx).await?;
    answer.reply.set_streaming();
    let state = StreamState {
        rx,
        answer,
        frames: VecDeque::new(),
        started: false,
        next_block: 0,
        open: None,
        finished: false,
    };
    Ok(sse_response(state))
}

#[cfg(test)]
mod tests;
