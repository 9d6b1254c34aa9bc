//! A `POST /v1/responses` body as the chat completion request the server already runs: the
//! conversation (a stored one continued by `previous_response_id`, then `input`) as chat
//! messages, the function tools, `tool_choice`, `text.format` as `response_format`,
//! `reasoning.effort` as the template's `enable_thinking`, `max_output_tokens` as `max_tokens`.
//! Each field a Responses client can send is either mapped, echoed in the answer, or refused with
//! a 400 naming it (crates/nextn-server/README.md has the table).

use std::collections::HashMap;

use serde_json::{json, Map, Value};

use crate::error::ApiError;

use super::base64;

/// Request fields this endpoint reads (or checks); others are logged once at debug level and
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

/// llama.cpp sampling fields a Responses request may also give; they mean what they mean on
/// the chat endpoint.
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

/// A Responses request mapped onto the chat request.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ResponsesRequest {
    /// The chat completion body `prepare_chat` reads (before the server's defaults).
    pub chat: Map<String, Value>,
    /// The whole conversation as Responses items: the stored one, then this request's input.
    pub conversation: Vec<Value>,
    pub stream: bool,
    pub store: bool,
    /// `include: ["reasoning.encrypted_content"]`.
    pub encrypted_reasoning: bool,
    /// Namespaced functions: the name the model sees (`namespace.name`) to the namespace and
    /// the function's own name.
    pub namespaced: HashMap<String, (String, String)>,
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

/// Map a request body. `previous` is the stored conversation `previous_response_id` names.
pub(crate) fn parse(
    o: &Map<String, Value>,
    previous: Option<Vec<Value>>,
) -> Result<ResponsesRequest, ApiError> {
    refuse_unsupported(o)?;
    let mut chat = Map::new();
    let mut echo = Map::new();
    for name in CHAT_FIELDS {
        if let Some(v) = o.get(*name) {
            chat.insert((*name).to_string(), v.clone());
        }
    }
    for name in ["temperature", "top_p", "parallel_tool_calls"] {
        if let Some(v) = field(o, name) {
            chat.insert(name.to_string(), v.clone());
        }
    }
    if let Some(m) = string_field(o, "model")? {
        chat.insert("model".into(), json!(m));
    }
    let max_output = max_output_tokens(o)?;
    if let Some(n) = max_output {
        chat.insert("max_tokens".into(), json!(n));
    }
    let instructions = string_field(o, "instructions")?;
    let mut conversation = previous.unwrap_or_default();
    conversation.extend(input_items(o)?);
    if conversation.is_empty() {
        return Err(bad(
            "input",
            "'input' is required: a string or an array of input items",
        ));
    }
    let tools = parse_tools(o)?;
    let encrypted_reasoning = parse_include(o)?;
    let messages = messages(instructions, &conversation)?;
    chat.insert("messages".into(), Value::Array(messages));
    if !tools.for_chat.is_empty() {
        chat.insert("tools".into(), Value::Array(tools.for_chat.clone()));
    }
    let tool_choice = parse_tool_choice(o, &tools)?;
    if let Some(c) = &tool_choice {
        chat.insert("tool_choice".into(), c.clone());
    }
    let text = parse_text(o, &mut chat)?;
    let reasoning = parse_reasoning(o, &mut chat)?;
    let metadata = parse_metadata(o)?;

    echo.insert("instructions".into(), json!(instructions));
    echo.insert("metadata".into(), metadata);
    echo.insert(
        "parallel_tool_calls".into(),
        json!(bool_field(o, "parallel_tool_calls")?.unwrap_or(true)),
    );
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
    echo.insert("tools".into(), tools.echo);
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
    Ok(ResponsesRequest {
        chat,
        conversation,
        stream: bool_field(o, "stream")?.unwrap_or(false),
        store,
        encrypted_reasoning,
        namespaced: tools.namespaced,
        echo,
    })
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
    match field(o, "stream_options") {
        None | Some(Value::Object(_)) => {}
        Some(_) => return Err(bad("stream_options", "'stream_options' must be an object")),
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

/// The function tools as the chat request takes them, and what the response repeats.
struct Tools {
    for_chat: Vec<Value>,
    namespaced: HashMap<String, (String, String)>,
    echo: Value,
}

/// A Responses function tool (`{"type": "function", "name", "description", "parameters",
/// "strict"}`) as a chat tool, under `name`.
fn chat_tool(t: &Map<String, Value>, name: &str, param: &str) -> Result<Value, ApiError> {
    let mut f = Map::new();
    f.insert("name".into(), json!(name));
    match t.get("description") {
        None | Some(Value::Null) => {}
        Some(d @ Value::String(_)) => {
            f.insert("description".into(), d.clone());
        }
        Some(_) => {
            return Err(bad(
                param,
                format!("'{param}.description' must be a string"),
            ))
        }
    }
    if let Some(p) = t.get("parameters") {
        f.insert("parameters".into(), p.clone());
    }
    Ok(json!({"type": "function", "function": f}))
}

fn tool_name<'a>(t: &'a Map<String, Value>, param: &str) -> Result<&'a str, ApiError> {
    match t.get("name") {
        Some(Value::String(n)) => Ok(n),
        _ => Err(bad(param, format!("'{param}.name' must be a string"))),
    }
}

fn parse_tools(o: &Map<String, Value>) -> Result<Tools, ApiError> {
    let mut tools = Tools {
        for_chat: Vec::new(),
        namespaced: HashMap::new(),
        echo: json!([]),
    };
    let list = match field(o, "tools") {
        None => return Ok(tools),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(bad("tools", "'tools' must be an array")),
    };
    tools.echo = Value::Array(list.clone());
    for (i, t) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        let Some(t) = t.as_object() else {
            return Err(bad(&param, "each tool must be an object"));
        };
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {
                let name = tool_name(t, &param)?;
                tools.for_chat.push(chat_tool(t, name, &param)?);
            }
            // A group of functions (`{"type": "namespace", "name", "tools": [...]}`): the model
            // sees each as `namespace.name`, and its calls carry the namespace.
            Some("namespace") => {
                let ns = tool_name(t, &param)?;
                let Some(Value::Array(inner)) = t.get("tools") else {
                    return Err(bad(&param, format!("'{param}.tools' must be an array")));
                };
                for (j, f) in inner.iter().enumerate() {
                    let fparam = format!("{param}.tools[{j}]");
                    let Some(f) = f.as_object() else {
                        return Err(bad(&fparam, "each tool must be an object"));
                    };
                    match f.get("type").and_then(Value::as_str) {
                        Some("function") => {}
                        other => {
                            return Err(bad(
                                &fparam,
                                format!(
                                    "tools of type '{}' are not supported inside a namespace (only 'function')",
                                    other.unwrap_or("(none)")
                                ),
                            ))
                        }
                    }
                    let name = tool_name(f, &fparam)?;
                    let qualified = format!("{ns}.{name}");
                    tools.for_chat.push(chat_tool(f, &qualified, &fparam)?);
                    tools
                        .namespaced
                        .insert(qualified, (ns.to_string(), name.to_string()));
                }
            }
            Some(other) => {
                return Err(bad(
                    &param,
                    format!("tools of type '{other}' are not supported: only 'function' (and 'namespace' groups of functions) run here"),
                ))
            }
            None => return Err(bad(&param, "each tool needs a 'type'")),
        }
    }
    Ok(tools)
}

/// The name the model knows a called function by: `namespace.name` for a namespaced one.
fn qualified_name(name: &str, namespace: Option<&str>) -> String {
    match namespace {
        Some(ns) if !ns.is_empty() => format!("{ns}.{name}"),
        _ => name.to_string(),
    }
}

/// `tool_choice` in the chat request's terms (`None`: left to the default, `auto`).
fn parse_tool_choice(o: &Map<String, Value>, tools: &Tools) -> Result<Option<Value>, ApiError> {
    let Some(v) = field(o, "tool_choice") else {
        return Ok(None);
    };
    match v {
        Value::String(s) if matches!(s.as_str(), "none" | "auto" | "required") => {
            Ok(Some(v.clone()))
        }
        Value::String(s) => Err(bad(
            "tool_choice",
            format!("'tool_choice' '{s}' must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"name\": ...}}"),
        )),
        Value::Object(m) => match m.get("type").and_then(Value::as_str) {
            Some("function") => {
                let Some(name) = m.get("name").and_then(Value::as_str) else {
                    return Err(bad(
                        "tool_choice",
                        "'tool_choice' of type function needs a 'name'",
                    ));
                };
                let namespace = m.get("namespace").and_then(Value::as_str);
                let mut wanted = qualified_name(name, namespace);
                let plain = tools
                    .for_chat
                    .iter()
                    .any(|t| t["function"]["name"] == json!(wanted));
                if !plain && namespace.is_none() {
                    // A function's own name, when one namespace has it.
                    let mut matches = tools
                        .namespaced
                        .iter()
                        .filter(|(_, (_, n))| n == name)
                        .map(|(q, _)| q.clone());
                    if let (Some(q), None) = (matches.next(), matches.next()) {
                        wanted = q;
                    }
                }
                Ok(Some(
                    json!({"type": "function", "function": {"name": wanted}}),
                ))
            }
            Some(other) => Err(bad(
                "tool_choice",
                format!("'tool_choice' of type '{other}' is not supported: only \"none\", \"auto\", \"required\" or a function"),
            )),
            None => Err(bad("tool_choice", "'tool_choice' needs a 'type'")),
        },
        _ => Err(bad(
            "tool_choice",
            "'tool_choice' must be a string or an object",
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
    for v in list {
        match v.as_str() {
            Some("reasoning.encrypted_content") => encrypted = true,
            Some(s) if INCLUDE_NOTHING_TO_ADD.contains(&s) => {}
            Some("message.output_text.logprobs") => {
                return Err(bad(
                    "include",
                    "'message.output_text.logprobs' is not supported on /v1/responses (use /v1/chat/completions)",
                ))
            }
            Some(other) => {
                return Err(bad(
                    "include",
                    format!("'include' value '{other}' is not known"),
                ))
            }
            None => return Err(bad("include", "'include' must be an array of strings")),
        }
    }
    Ok(encrypted)
}

/// `text.format` as `response_format`, and `text.verbosity`; returns the `text` the response
/// repeats.
fn parse_text(o: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<Value, ApiError> {
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
    match format.get("type").and_then(Value::as_str) {
        Some("text") => {}
        Some("json_object") => {
            chat.insert("response_format".into(), json!({"type": "json_object"}));
        }
        Some("json_schema") => {
            let schema = format
                .get("schema")
                .filter(|s| s.is_object() || s.is_boolean())
                .ok_or_else(|| {
                    bad(
                        "text.format",
                        "'text.format' of type json_schema needs a 'schema' object",
                    )
                })?;
            chat.insert(
                "response_format".into(),
                json!({"type": "json_schema", "json_schema": {"schema": schema}}),
            );
        }
        Some(other) => {
            return Err(bad(
                "text.format",
                format!(
                "'text.format' type '{other}' must be \"text\", \"json_object\" or \"json_schema\""
            ),
            ))
        }
        None => return Err(bad("text.format", "'text.format' needs a 'type'")),
    }
    Ok(Value::Object(text.clone()))
}

/// `reasoning.effort`: `none` and `minimal` turn thinking off (the template's
/// `enable_thinking: false`), the other efforts turn it on; without an effort the server's
/// default holds. Returns the `reasoning` the response repeats.
fn parse_reasoning(
    o: &Map<String, Value>,
    chat: &mut Map<String, Value>,
) -> Result<Value, ApiError> {
    let r = match field(o, "reasoning") {
        None => return Ok(json!({"effort": null, "summary": null})),
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
    if let Some(on) = thinking {
        let kwargs = chat
            .entry("chat_template_kwargs")
            .or_insert_with(|| json!({}));
        // A `chat_template_kwargs` that is not an object is refused by the chat request.
        if let Value::Object(k) = kwargs {
            k.entry("enable_thinking").or_insert(json!(on));
        }
    }
    Ok(json!({
        "effort": effort,
        "summary": r.get("summary").or_else(|| r.get("generate_summary")).cloned().unwrap_or(Value::Null),
    }))
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

/// One part of a message's content.
enum Part {
    Text(String),
    /// An `input_image` as chat completions' `image_url` part.
    Image(Value),
}

/// A message's content: a string, or `input_text` / `output_text` (and `refusal`) parts, and
/// where `images` allows them `input_image` parts.
fn content_parts(v: Option<&Value>, param: &str, images: bool) -> Result<Vec<Part>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![Part::Text(s.clone())]),
        Some(Value::Array(parts)) => {
            let mut out = Vec::new();
            for (j, p) in parts.iter().enumerate() {
                let pparam = format!("{param}[{j}]");
                let key = match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => "text",
                    Some("refusal") => "refusal",
                    Some("input_image") if images => {
                        out.push(Part::Image(image_part(p, &pparam)?));
                        continue;
                    }
                    Some("input_image") => {
                        return Err(bad(
                            &pparam,
                            "input_image parts are read in user messages only",
                        ))
                    }
                    Some(other) => {
                        return Err(bad(
                            &pparam,
                            format!("content parts of type '{other}' are not supported"),
                        ))
                    }
                    None => return Err(bad(&pparam, "each content part needs a 'type'")),
                };
                match p.get(key).and_then(Value::as_str) {
                    Some(t) => out.push(Part::Text(t.to_string())),
                    None => {
                        return Err(bad(
                            &pparam,
                            format!("a content part needs a '{key}' string"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        Some(_) => Err(bad(
            param,
            "'content' must be a string or an array of content parts",
        )),
    }
}

/// The text of a message's content (no images).
fn content_text(v: Option<&Value>, param: &str) -> Result<String, ApiError> {
    Ok(content_parts(v, param, false)?
        .into_iter()
        .map(|p| match p {
            Part::Text(t) => t,
            Part::Image(_) => String::new(),
        })
        .collect())
}

/// A user message's content for chat completions: its text, or with images its parts in order.
fn user_content(v: Option<&Value>, param: &str) -> Result<Value, ApiError> {
    let parts = content_parts(v, param, true)?;
    if !parts.iter().any(|p| matches!(p, Part::Image(_))) {
        return Ok(json!(content_text(v, param)?));
    }
    Ok(Value::Array(
        parts
            .into_iter()
            .map(|p| match p {
                Part::Text(t) => json!({"type": "text", "text": t}),
                Part::Image(i) => i,
            })
            .collect(),
    ))
}

/// An `input_image` part as chat completions' `image_url` part: its `image_url` (a data URI, or
/// a URL fetched only where the server allows it) and `detail`.
fn image_part(p: &Value, param: &str) -> Result<Value, ApiError> {
    if p.get("file_id").is_some_and(|f| !f.is_null()) {
        return Err(bad(
            &format!("{param}.file_id"),
            "'file_id' images are not supported (there is no Files API here): send 'image_url' with a data URI",
        ));
    }
    let url = p.get("image_url").and_then(Value::as_str).ok_or_else(|| {
        bad(
            &format!("{param}.image_url"),
            "an input_image part needs an 'image_url' string",
        )
    })?;
    let mut image = json!({"url": url});
    match p.get("detail") {
        None | Some(Value::Null) => {}
        Some(Value::String(d)) if matches!(d.as_str(), "auto" | "low" | "high") => {
            image["detail"] = json!(d);
        }
        Some(_) => {
            return Err(bad(
                &format!("{param}.detail"),
                "'detail' must be \"auto\", \"low\" or \"high\"",
            ))
        }
    }
    Ok(json!({"type": "image_url", "image_url": image}))
}

/// The thinking a `reasoning` item carries: its `reasoning_text` content, else its
/// `encrypted_content` (written by this server), else its summary.
fn reasoning_text(item: &Map<String, Value>, param: &str) -> Result<String, ApiError> {
    let joined = |key: &str, part: &str| -> Result<Option<String>, ApiError> {
        match item.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(parts)) if parts.is_empty() => Ok(None),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some(t), Some(Value::String(s))) if t == part => text.push_str(s),
                        _ => {
                            return Err(bad(
                                &format!("{param}.{key}"),
                                format!(
                                    "'{key}' parts must be {{\"type\": \"{part}\", \"text\": ...}}"
                                ),
                            ))
                        }
                    }
                }
                Ok(Some(text))
            }
            Some(_) => Err(bad(
                &format!("{param}.{key}"),
                format!("'{key}' must be an array"),
            )),
        }
    };
    if let Some(text) = joined("content", "reasoning_text")? {
        return Ok(text);
    }
    match item.get("encrypted_content") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            return base64::decode(s)
                .and_then(|b| String::from_utf8(b).ok())
                .ok_or_else(|| {
                    bad(
                        &format!("{param}.encrypted_content"),
                        "'encrypted_content' was not written by this server",
                    )
                })
        }
        Some(_) => {
            return Err(bad(
                &format!("{param}.encrypted_content"),
                "'encrypted_content' must be a string",
            ))
        }
    }
    Ok(joined("summary", "summary_text")?.unwrap_or_default())
}

/// One assistant turn in the making: reasoning, then text, then calls.
#[derive(Default)]
struct AssistantTurn {
    reasoning: Option<String>,
    content: String,
    calls: Vec<Value>,
}

impl AssistantTurn {
    fn is_empty(&self) -> bool {
        self.reasoning.is_none() && self.content.is_empty() && self.calls.is_empty()
    }

    fn flush(&mut self, messages: &mut Vec<Value>) {
        if self.is_empty() {
            return;
        }
        let turn = std::mem::take(self);
        let mut m = json!({"role": "assistant", "content": turn.content});
        if let Some(r) = turn.reasoning {
            m["reasoning_content"] = json!(r);
        }
        if !turn.calls.is_empty() {
            m["tool_calls"] = Value::Array(turn.calls);
        }
        messages.push(m);
    }
}

fn item_string<'a>(
    item: &'a Map<String, Value>,
    key: &str,
    param: &str,
) -> Result<&'a str, ApiError> {
    match item.get(key) {
        Some(Value::String(s)) => Ok(s),
        _ => Err(bad(param, format!("'{param}.{key}' must be a string"))),
    }
}

/// The conversation as chat messages. `instructions` and the system / developer messages that
/// open the conversation become the one system message templates expect first; consecutive
/// reasoning, assistant text and function calls become one assistant message.
fn messages(instructions: Option<&str>, items: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut system: Vec<String> = instructions.map(str::to_string).into_iter().collect();
    let mut messages = Vec::new();
    let mut turn = AssistantTurn::default();
    let mut opening = true;
    for (i, item) in items.iter().enumerate() {
        let param = format!("input[{i}]");
        let Some(item) = item.as_object() else {
            return Err(bad(&param, "each input item must be an object"));
        };
        let kind = match item.get("type").and_then(Value::as_str) {
            Some(k) => k,
            None if item.contains_key("role") => "message",
            None => return Err(bad(&param, "each input item needs a 'type'")),
        };
        match kind {
            "message" => {
                let role = item_string(item, "role", &param)?;
                let content = item.get("content");
                let cparam = format!("{param}.content");
                match role {
                    "system" | "developer" if opening => system.push(content_text(content, &cparam)?),
                    "user" => {
                        opening = false;
                        turn.flush(&mut messages);
                        messages.push(json!({"role": "user", "content": user_content(content, &cparam)?}));
                    }
                    "system" | "developer" => {
                        opening = false;
                        turn.flush(&mut messages);
                        messages.push(json!({"role": "system", "content": content_text(content, &cparam)?}));
                    }
                    "assistant" => {
                        opening = false;
                        if !turn.calls.is_empty() {
                            turn.flush(&mut messages);
                        }
                        turn.content.push_str(&content_text(content, &cparam)?);
                    }
                    other => {
                        return Err(bad(
                            &format!("{param}.role"),
                            format!("unknown role '{other}' (user, assistant, system or developer)"),
                        ))
                    }
                }
            }
            "function_call" => {
                opening = false;
                let call_id = item_string(item, "call_id", &param)?;
                let name = item_string(item, "name", &param)?;
                let arguments = item_string(item, "arguments", &param)?;
                let namespace = item.get("namespace").and_then(Value::as_str);
                let name = qualified_name(name, namespace);
                // Templates iterate over the arguments as a mapping.
                let args = match serde_json::from_str::<Value>(arguments) {
                    Ok(v @ Value::Object(_)) => v,
                    _ => json!(arguments),
                };
                turn.calls.push(json!({
                    "id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args},
                }));
            }
            "function_call_output" => {
                opening = false;
                turn.flush(&mut messages);
                let call_id = item_string(item, "call_id", &param)?;
                let output = content_text(item.get("output"), &format!("{param}.output"))?;
                messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            "reasoning" => {
                opening = false;
                if !turn.content.is_empty() || !turn.calls.is_empty() {
                    turn.flush(&mut messages);
                }
                let text = reasoning_text(item, &param)?;
                turn.reasoning.get_or_insert_with(String::new).push_str(&text);
            }
            "item_reference" => {
                return Err(bad(
                    &param,
                    "'item_reference' items are not supported: send the item itself, or continue with 'previous_response_id'",
                ))
            }
            other => {
                return Err(bad(
                    &param,
                    format!("input items of type '{other}' are not supported (message, function_call, function_call_output and reasoning are)"),
                ))
            }
        }
    }
    turn.flush(&mut messages);
    if !system.is_empty() {
        messages.insert(0, json!({"role": "system", "content": system.join("\n\n")}));
    }
    Ok(messages)
}

#[cfg(test)]
mod tests;
