//! A `POST /v1/responses` body as the server's chat request: the conversation (a stored one
//! continued by `previous_response_id`, then `input`) as chat messages ([`items`]), the function
//! tools and `tool_choice` ([`tools`]), `text.format` as the output grammar, `reasoning.effort` as
//! the template's `enable_thinking`, `max_output_tokens` as the token budget. Each field a
//! Responses client can send is either read, echoed in the answer, or refused with a 400 naming
//! it as the client wrote it (crates/nextn-server/README.md has the table).

mod items;
mod tools;

use std::collections::HashMap;

use nextn_engine::grammar::GrammarSource;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::request::chat::ChatRequest;
use crate::request::fields::{Fields, Names};
use crate::request::params::parse_params;

use super::sealed::Sealer;

/// Request fields this endpoint reads (or checks); others are named in the debug log and
/// ignored, as on the chat endpoint.
pub(crate) const KNOWN_FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "text",
    "reasoning",
    "stream",
    "stream_options",
    "store",
    "previous_response_id",
    "metadata",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "include",
    "truncation",
    "background",
    "conversation",
    "prompt",
    "max_tool_calls",
    "top_logprobs",
    "service_tier",
];

/// llama.cpp's fields a Responses request may also give; they mean what they mean on the chat
/// endpoint.
pub(crate) const CHAT_FIELDS: &[&str] = &[
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repeat_penalty",
    "repeat_last_n",
    "stop",
    "logit_bias",
    "chat_template_kwargs",
    "cache_prompt",
    "thinking_budget_tokens",
];

/// The generation parameters a Responses request can set, under its names.
const PARAM_NAMES: Names = Names::Mapped(&[
    ("model", "model"),
    ("max_tokens", "max_output_tokens"),
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("stream", "stream"),
    ("stream_options", "stream_options"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("seed", "seed"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("repeat_penalty", "repeat_penalty"),
    ("repeat_last_n", "repeat_last_n"),
    ("stop", "stop"),
    ("logit_bias", "logit_bias"),
    ("cache_prompt", "cache_prompt"),
    ("thinking_budget_tokens", "thinking_budget_tokens"),
]);

/// Most `metadata` pairs, and the longest key and value (OpenAI's limits).
const MAX_METADATA: usize = 16;
const MAX_METADATA_KEY: usize = 64;
const MAX_METADATA_VALUE: usize = 512;

/// `include` values for items this server never produces (its only tools are functions): there
/// is nothing to add, so they are accepted.
const INCLUDE_NOTHING_TO_ADD: &[&str] = &[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
];

/// What the answer needs besides the chat request.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ResponsesRequest {
    /// The whole conversation as Responses items: the stored one, then this request's input.
    pub conversation: Vec<Value>,
    pub stream: bool,
    pub store: bool,
    /// `include: ["reasoning.encrypted_content"]`.
    pub encrypted_reasoning: bool,
    /// Namespaced functions: the name the model sees (`namespace.name`) to the namespace and
    /// the function's own name.
    pub namespaced: HashMap<String, (String, String)>,
    /// `reasoning.effort`, for a reasoning budget out of the answer's allowance.
    pub effort: Option<String>,
    /// The request's settings as the Response object repeats them.
    pub echo: Map<String, Value>,
}

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid_field(param, message)
}

/// A present, non-null field.
fn field<'a>(o: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    o.get(name).filter(|v| !v.is_null())
}

fn string_field<'a>(o: &'a Map<String, Value>, name: &str) -> Result<Option<&'a str>, ApiError> {
    match field(o, name) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(bad(name, format!("'{name}' must be a string"))),
    }
}

fn bool_field(o: &Map<String, Value>, name: &str) -> Result<Option<bool>, ApiError> {
    match field(o, name) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(bad(name, format!("'{name}' must be true or false"))),
    }
}

/// `previous_response_id`, when given.
pub(crate) fn previous_id(o: &Map<String, Value>) -> Result<Option<&str>, ApiError> {
    string_field(o, "previous_response_id")
}

/// What parsing a body needs besides the body.
pub(crate) struct Context<'a> {
    /// The conversation `previous_response_id` names, as it was stored.
    pub previous: Option<Vec<Value>>,
    /// The server's defaults for fields the request leaves out.
    pub defaults: Option<&'a Map<String, Value>>,
    /// Opens the reasoning this server sealed into `encrypted_content`.
    pub sealer: &'a Sealer,
}

/// Map a request body onto the chat request.
pub(crate) fn parse(
    o: &Map<String, Value>,
    cx: Context,
) -> Result<(ChatRequest, ResponsesRequest), ApiError> {
    refuse_unsupported(o)?;
    let max_output = max_output_tokens(o)?;
    let mut params = parse_params(&Fields::request(o, PARAM_NAMES, cx.defaults))?;
    let instructions = string_field(o, "instructions")?;
    let previous_len = cx.previous.as_ref().map_or(0, Vec::len);
    let mut conversation = cx.previous.unwrap_or_default();
    conversation.extend(input_items(o)?);
    if conversation.is_empty() {
        return Err(bad(
            "input",
            "'input' is required: a string or an array of input items",
        ));
    }
    let string_input = matches!(field(o, "input"), Some(Value::String(_)));
    let item_path = |i: usize| -> String {
        match i.checked_sub(previous_len) {
            None => format!("previous_response_id (its item {i})"),
            Some(_) if string_input => "input".to_string(),
            Some(k) => format!("input[{k}]"),
        }
    };
    let tools = tools::parse_tools(o)?;
    let encrypted_reasoning = parse_include(o)?;
    let mut images = Vec::new();
    let messages = items::messages(
        instructions,
        &conversation,
        &item_path,
        cx.sealer,
        &mut images,
    )?;
    let tool_choice = tools::parse_tool_choice(o, &tools)?;
    let text = parse_text(o, &mut params)?;
    let (reasoning, thinking, effort) = parse_reasoning(o)?;
    let metadata = parse_metadata(o)?;
    let mut template_kwargs = match field(o, "chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(k)) => k.clone(),
        Some(_) => {
            return Err(bad(
                "chat_template_kwargs",
                "'chat_template_kwargs' must be an object",
            ))
        }
    };
    if let Some(on) = thinking {
        template_kwargs
            .entry("enable_thinking")
            .or_insert(json!(on));
    }
    let parallel = bool_field(o, "parallel_tool_calls")?.unwrap_or(true);

    let mut echo = Map::new();
    echo.insert("instructions".into(), json!(instructions));
    echo.insert("metadata".into(), metadata);
    echo.insert("parallel_tool_calls".into(), json!(parallel));
    echo.insert(
        "temperature".into(),
        field(o, "temperature").cloned().unwrap_or(Value::Null),
    );
    echo.insert(
        "top_p".into(),
        field(o, "top_p").cloned().unwrap_or(Value::Null),
    );
    echo.insert(
        "tool_choice".into(),
        field(o, "tool_choice").cloned().unwrap_or(json!("auto")),
    );
    echo.insert("tools".into(), tools.echo.clone());
    echo.insert("max_output_tokens".into(), json!(max_output));
    echo.insert(
        "previous_response_id".into(),
        json!(previous_id(o)?.map(str::to_string)),
    );
    echo.insert("reasoning".into(), reasoning);
    echo.insert("text".into(), text);
    echo.insert("truncation".into(), json!("disabled"));
    echo.insert("top_logprobs".into(), json!(0));
    echo.insert("background".into(), json!(false));
    echo.insert("service_tier".into(), json!("default"));
    for name in ["user", "safety_identifier", "prompt_cache_key"] {
        echo.insert(name.into(), json!(string_field(o, name)?));
    }
    let store = bool_field(o, "store")?.unwrap_or(true);
    echo.insert("store".into(), json!(store));

    let stream = params.stream;
    let mut req = ChatRequest::new(params, messages, images).with_tools(
        tools.tools,
        tools.for_template,
        tool_choice,
        parallel,
    )?;
    req.template_kwargs = template_kwargs;
    Ok((
        req,
        ResponsesRequest {
            conversation,
            stream,
            store,
            encrypted_reasoning,
            namespaced: tools.namespaced,
            effort,
            echo,
        },
    ))
}

/// Fields that ask for something this server does not do, unless their value turns it off.
fn refuse_unsupported(o: &Map<String, Value>) -> Result<(), ApiError> {
    if bool_field(o, "background")? == Some(true) {
        return Err(bad(
            "background",
            "'background' responses are not supported: stream the response instead",
        ));
    }
    if field(o, "conversation").is_some() {
        return Err(bad(
            "conversation",
            "'conversation' objects are not supported: continue a conversation with 'previous_response_id'",
        ));
    }
    if field(o, "prompt").is_some() {
        return Err(bad(
            "prompt",
            "'prompt' (stored prompt templates) is not supported: send 'instructions' and 'input'",
        ));
    }
    if field(o, "max_tool_calls").is_some() {
        return Err(bad(
            "max_tool_calls",
            "'max_tool_calls' is not supported (set 'parallel_tool_calls': false for at most one call)",
        ));
    }
    match string_field(o, "truncation")? {
        None | Some("disabled") => {}
        Some(other) => {
            return Err(bad(
                "truncation",
                format!("'truncation' '{other}' is not supported: only \"disabled\" (a conversation longer than the context is refused)"),
            ))
        }
    }
    match field(o, "top_logprobs") {
        None => {}
        Some(v) if v.as_u64() == Some(0) => {}
        Some(_) => {
            return Err(bad(
                "top_logprobs",
                "'top_logprobs' is not supported on /v1/responses (use /v1/chat/completions)",
            ))
        }
    }
    match string_field(o, "service_tier")? {
        None | Some("auto" | "default") => {}
        Some(other) => {
            return Err(bad(
                "service_tier",
                format!("'service_tier' '{other}' is not supported: only \"auto\" or \"default\""),
            ))
        }
    }
    Ok(())
}

fn max_output_tokens(o: &Map<String, Value>) -> Result<Option<u64>, ApiError> {
    match field(o, "max_output_tokens") {
        None => Ok(None),
        Some(v) => match v.as_u64().or_else(|| {
            v.as_f64()
                .filter(|f| f.fract() == 0.0 && *f >= 1.0 && *f < 9.0e15)
                .map(|f| f as u64)
        }) {
            Some(n) if n >= 1 => Ok(Some(n)),
            _ => Err(bad(
                "max_output_tokens",
                "'max_output_tokens' must be an integer of at least 1",
            )),
        },
    }
}

/// `input`: a string (one user message) or an array of items.
fn input_items(o: &Map<String, Value>) -> Result<Vec<Value>, ApiError> {
    match field(o, "input") {
        None => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![json!({
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": s}],
        })]),
        Some(Value::Array(items)) => Ok(items.clone()),
        Some(_) => Err(bad(
            "input",
            "'input' must be a string or an array of input items",
        )),
    }
}

/// `include`: whether reasoning comes back as `encrypted_content` too.
fn parse_include(o: &Map<String, Value>) -> Result<bool, ApiError> {
    let list = match field(o, "include") {
        None => return Ok(false),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(bad("include", "'include' must be an array of strings")),
    };
    let mut encrypted = false;
    for (i, v) in list.iter().enumerate() {
        let param = format!("include[{i}]");
        match v.as_str() {
            Some("reasoning.encrypted_content") => encrypted = true,
            Some(s) if INCLUDE_NOTHING_TO_ADD.contains(&s) => {}
            Some("message.output_text.logprobs") => {
                return Err(bad(
                    &param,
                    "'message.output_text.logprobs' is not supported on /v1/responses (use /v1/chat/completions)",
                ))
            }
            Some(other) => {
                return Err(bad(
                    &param,
                    format!("'include' value '{other}' is not known"),
                ))
            }
            None => return Err(bad(&param, "'include' must be an array of strings")),
        }
    }
    Ok(encrypted)
}

/// `text.format` as the output grammar, and `text.verbosity`; returns the `text` the response
/// repeats.
fn parse_text(
    o: &Map<String, Value>,
    params: &mut crate::request::GenParams,
) -> Result<Value, ApiError> {
    let text = match field(o, "text") {
        None => return Ok(json!({"format": {"type": "text"}})),
        Some(Value::Object(t)) => t,
        Some(_) => return Err(bad("text", "'text' must be an object")),
    };
    match text.get("verbosity") {
        None | Some(Value::Null) => {}
        Some(v) if v == "medium" => {}
        Some(v) => {
            return Err(bad(
                "text.verbosity",
                format!(
                "'text.verbosity' {v} is not supported: only \"medium\" (the model's own length)"
            ),
            ))
        }
    }
    let format = match text.get("format") {
        None | Some(Value::Null) => return Ok(Value::Object(text.clone())),
        Some(Value::Object(f)) => f,
        Some(_) => return Err(bad("text.format", "'text.format' must be an object")),
    };
    let grammar = match format.get("type").and_then(Value::as_str) {
        Some("text") => None,
        Some("json_object") => Some(GrammarSource::JsonObject),
        Some("json_schema") => {
            let schema = format
                .get("schema")
                .filter(|s| s.is_object() || s.is_boolean())
                .ok_or_else(|| {
                    bad(
                        "text.format.schema",
                        "'text.format' of type json_schema needs a 'schema' object",
                    )
                })?;
            Some(GrammarSource::JsonSchema(schema.clone()))
        }
        Some(other) => {
            return Err(bad(
                "text.format.type",
                format!(
                "'text.format' type '{other}' must be \"text\", \"json_object\" or \"json_schema\""
            ),
            ))
        }
        None => return Err(bad("text.format.type", "'text.format' needs a 'type'")),
    };
    if let Some(g) = grammar {
        params.grammar = Some(g);
        params.grammar_field = "text.format".into();
    }
    Ok(Value::Object(text.clone()))
}

/// `reasoning.effort`: `none` and `minimal` turn thinking off (the template's
/// `enable_thinking: false`), the other efforts turn it on; without an effort the server's
/// default holds. Returns the `reasoning` the response repeats, thinking on or off, and the
/// effort.
fn parse_reasoning(
    o: &Map<String, Value>,
) -> Result<(Value, Option<bool>, Option<String>), ApiError> {
    let r = match field(o, "reasoning") {
        None => return Ok((json!({"effort": null, "summary": null}), None, None)),
        Some(Value::Object(r)) => r,
        Some(_) => return Err(bad("reasoning", "'reasoning' must be an object")),
    };
    let effort = match r.get("effort") {
        None | Some(Value::Null) => None,
        Some(Value::String(e)) => Some(e.as_str()),
        Some(_) => {
            return Err(bad(
                "reasoning.effort",
                "'reasoning.effort' must be a string",
            ))
        }
    };
    let thinking = match effort {
        None => None,
        Some("none" | "minimal") => Some(false),
        Some("low" | "medium" | "high" | "xhigh" | "max") => Some(true),
        Some(other) => {
            return Err(bad(
                "reasoning.effort",
                format!("'reasoning.effort' '{other}' must be one of none, minimal, low, medium, high, xhigh, max"),
            ))
        }
    };
    for key in ["summary", "generate_summary"] {
        match r.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if matches!(s.as_str(), "auto" | "concise" | "detailed") => {}
            Some(v) => {
                return Err(bad(
                    &format!("reasoning.{key}"),
                    format!("'reasoning.{key}' {v} must be \"auto\", \"concise\" or \"detailed\""),
                ))
            }
        }
    }
    Ok((
        json!({
            "effort": effort,
            "summary": r.get("summary").or_else(|| r.get("generate_summary")).cloned().unwrap_or(Value::Null),
        }),
        thinking,
        effort.map(str::to_string),
    ))
}

fn parse_metadata(o: &Map<String, Value>) -> Result<Value, ApiError> {
    let m = match field(o, "metadata") {
        None => return Ok(Value::Null),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(bad("metadata", "'metadata' must be an object of strings")),
    };
    if m.len() > MAX_METADATA {
        return Err(bad(
            "metadata",
            format!("'metadata' holds at most {MAX_METADATA} pairs"),
        ));
    }
    for (k, v) in m {
        let ok = k.chars().count() <= MAX_METADATA_KEY
            && v.as_str()
                .is_some_and(|s| s.chars().count() <= MAX_METADATA_VALUE);
        if !ok {
            return Err(bad(
                "metadata",
                format!("'metadata' maps keys of at most {MAX_METADATA_KEY} characters to strings of at most {MAX_METADATA_VALUE} ('{k}' does not)"),
            ));
        }
    }
    Ok(Value::Object(m.clone()))
}

#[cfg(test)]
mod tests;
