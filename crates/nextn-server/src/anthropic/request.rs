//! A Messages request as the server's chat request: the system prompt, the messages (thinking,
//! text, images, tool use and tool results), the client tools, `tool_choice`, sampling and
//! thinking, each error naming the field as Anthropic's clients write it
//! (`messages[0].content[1].source.type`).

use nextn_engine::chat::ChatMessage;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::reasoning::effort_budget;
use crate::request::chat::ChatRequest;
use crate::request::fields::{Fields, Names};
use crate::request::images::{image_from_base64, image_from_url, ChatImage, MessageText};
use crate::request::params::parse_params;
use crate::tools::{self, Tool, ToolChoice};
use crate::ReasoningFormat;

/// Fields this API reads or checks; others are ignored (named in the debug log).
pub(crate) const KNOWN_FIELDS: &[&str] = &[
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

/// The generation parameters a Messages request can set, under Anthropic's names.
const PARAM_NAMES: Names = Names::Mapped(&[
    ("model", "model"),
    ("max_tokens", "max_tokens"),
    ("stop", "stop_sequences"),
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("stream", "stream"),
]);

/// What the answer needs besides the chat request.
#[derive(Debug, PartialEq)]
pub(crate) struct MessagesAnswer {
    pub model: String,
    /// The thinking text goes into the answer (`thinking.display` is not `omitted`).
    pub show_thinking: bool,
    pub stop_sequences: Vec<String>,
}

/// What the body asks for, where parsing it needs more than the body.
#[derive(Clone, Copy)]
pub(crate) struct Context<'a> {
    /// The server's defaults for fields the request leaves out.
    pub defaults: Option<&'a Map<String, Value>>,
    /// `/count_tokens`: no `max_tokens`.
    pub count_only: bool,
    /// A vision tower is loaded: a picture a tool returned reaches the model; without one it is
    /// named in the text instead.
    pub vision: bool,
}

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid_field(param, message)
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
            "image blocks are read in user messages and tool results only (not in system prompts or assistant messages)",
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
pub(crate) fn normalize_billing_header(text: &str) -> String {
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

/// An `image` block's picture (`param` is the block's path): a `base64` source, or a `url`
/// source fetched only where the server allows it.
fn image(b: &Map<String, Value>, param: &str) -> Result<ChatImage, ApiError> {
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
    match source.get("type").and_then(Value::as_str) {
        Some("base64") => {
            field("media_type")?;
            image_from_base64(field("data")?, &format!("{param}.source.data"))
        }
        Some("url") => image_from_url(field("url")?, &format!("{param}.source.url")),
        Some(other) => Err(bad(
            &format!("{param}.source.type"),
            format!(
                "image sources of type '{other}' are not supported (use \"base64\" or \"url\")"
            ),
        )),
        None => Err(bad(
            &format!("{param}.source.type"),
            "the image source needs a 'type'",
        )),
    }
}

/// A `document` block's text: a `text` source (plain text) or a `content` source (text blocks);
/// `None` for a document only a reader of PDFs or files could open.
fn document_text(b: &Map<String, Value>, param: &str) -> Result<Option<String>, ApiError> {
    let source = b
        .get("source")
        .and_then(Value::as_object)
        .ok_or_else(|| bad(param, "a document block needs a 'source' object"))?;
    let title = b.get("title").and_then(Value::as_str);
    let body = match source.get("type").and_then(Value::as_str) {
        Some("text") => source
            .get("data")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                bad(
                    &format!("{param}.source.data"),
                    "a text document needs a 'data' string",
                )
            })?
            .to_string(),
        Some("content") => match source.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(blocks)) => {
                let mut text = String::new();
                for (i, b) in blocks.iter().enumerate() {
                    let bparam = format!("{param}.source.content[{i}]");
                    let b = as_object(b, &bparam)?;
                    match block_type(b, &bparam)? {
                        "text" => text.push_str(text_of(b, &bparam)?),
                        other => return Err(refuse_block(other, &bparam)),
                    }
                }
                text
            }
            _ => {
                return Err(bad(
                    &format!("{param}.source.content"),
                    "a content document needs 'content': a string or text blocks",
                ))
            }
        },
        Some(_) => return Ok(None),
        None => {
            return Err(bad(
                &format!("{param}.source.type"),
                "the document source needs a 'type'",
            ))
        }
    };
    Ok(Some(match title {
        Some(t) => format!("{t}\n\n{body}"),
        None => body,
    }))
}

/// A `tool_result`'s `content`: a string or blocks. Text and text documents are read; a
/// `tool_reference` from a tool search names a tool, shown by its definition; a picture reaches
/// the model where a vision tower is loaded, and is named in the text where not; a document only
/// a PDF or file reader could open is named in the text.
fn tool_result_content(
    v: Option<&Value>,
    param: &str,
    tools: &Map<String, Value>,
    cx: Context,
    images: &mut Vec<ChatImage>,
) -> Result<String, ApiError> {
    let blocks = match v {
        None | Some(Value::Null) => return Ok(String::new()),
        Some(Value::String(s)) => return Ok(s.clone()),
        Some(Value::Array(blocks)) => blocks,
        Some(_) => {
            return Err(bad(
                &format!("{param}.content"),
                format!("'{param}.content' must be a string or an array of blocks"),
            ))
        }
    };
    let mut text = MessageText::default();
    for (i, b) in blocks.iter().enumerate() {
        let bparam = format!("{param}.content[{i}]");
        let b = as_object(b, &bparam)?;
        match block_type(b, &bparam)? {
            "text" => text.push_str(text_of(b, &bparam)?),
            "tool_reference" => {
                let name = b.get("tool_name").and_then(Value::as_str).ok_or_else(|| {
                    bad(&bparam, "a tool_reference block needs a 'tool_name' string")
                })?;
                let def = tools.get(name).ok_or_else(|| {
                    bad(
                        &bparam,
                        format!("'{name}' is not one of the request's tools"),
                    )
                })?;
                if !text.text.is_empty() {
                    text.push_str("\n");
                }
                text.push_str(&def.to_string());
            }
            "image" => {
                let picture = image(b, &bparam)?;
                if cx.vision {
                    text.push_image(picture, images);
                } else {
                    text.push_str("[an image the tool returned; this server reads no images]");
                }
            }
            "document" => match document_text(b, &bparam)? {
                Some(t) => text.push_str(&t),
                None => text.push_str(
                    "[a document the tool returned; this server reads text documents only]",
                ),
            },
            other => return Err(refuse_block(other, &bparam)),
        }
    }
    Ok(text.text)
}

/// One message's content blocks as chat messages, appended to `out`. A user message's
/// `tool_result` blocks become `tool` messages, in order with its text.
fn message(
    m: &Map<String, Value>,
    at: usize,
    tools: &Map<String, Value>,
    cx: Context,
    images: &mut Vec<ChatImage>,
    out: &mut Vec<ChatMessage>,
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
            out.push(ChatMessage::new(role, s.clone()));
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
    let mut text = MessageText::default();
    let mut thinking: Option<String> = None;
    let mut calls = Vec::new();
    let mut after_tool_results = false;
    for (i, b) in blocks.iter().enumerate() {
        let bparam = format!("{param}.content[{i}]");
        let b = as_object(b, &bparam)?;
        let kind = block_type(b, &bparam)?;
        match (kind, role) {
            ("text", _) => text.push_str(text_of(b, &bparam)?),
            ("image", "user") => text.push_image(image(b, &bparam)?, images),
            ("document", "user") => match document_text(b, &bparam)? {
                Some(t) => text.push_str(&t),
                None => {
                    return Err(bad(
                        &format!("{param}.content[{i}].source.type"),
                        "documents are read from a text or content source only: the model reads text and images",
                    ))
                }
            },
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
                // Templates iterate over the arguments as a mapping.
                calls.push(json!({
                    "id": id, "type": "function",
                    "function": {"name": name, "arguments": input},
                }));
            }
            ("tool_result", "user") => {
                if !text.text.is_empty() {
                    out.push(ChatMessage::new("user", std::mem::take(&mut text.text)));
                }
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        bad(&bparam, "a tool_result block needs a 'tool_use_id' string")
                    })?;
                let mut content = tool_result_content(b.get("content"), &bparam, tools, cx, images)?;
                match b.get("is_error") {
                    None | Some(Value::Null | Value::Bool(false)) => {}
                    // The template has no field for it: the model reads it in the result.
                    Some(Value::Bool(true)) => content = format!("Error: {content}"),
                    Some(_) => return Err(bad(&bparam, "'is_error' must be true or false")),
                }
                let mut tool = ChatMessage::new("tool", content);
                tool.tool_call_id = Some(id.to_string());
                out.push(tool);
                after_tool_results = true;
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
    // A user message made of tool results alone has no user text to add.
    if after_tool_results && text.text.is_empty() && calls.is_empty() {
        return Ok(());
    }
    let mut msg = ChatMessage::new(role, text.text);
    msg.reasoning_content = thinking;
    if !calls.is_empty() {
        msg.tool_calls = Some(Value::Array(calls));
    }
    out.push(msg);
    Ok(())
}

/// A request's client tools, their definitions by name (for `tool_reference` blocks), and the
/// tools as the template shows them (deferred ones left out).
struct ClientTools {
    tools: Vec<Tool>,
    defs: Map<String, Value>,
    for_template: Vec<Value>,
}

/// `tools`: Anthropic's client tools. Server tools (`web_search_...`, `code_execution_...`,
/// ...) run on Anthropic's side: there is nothing here to run them, so they are left out of the
/// prompt, with a warning in the log, and the request goes on with its client tools.
fn client_tools(v: Option<&Value>) -> Result<ClientTools, ApiError> {
    let mut out = ClientTools {
        tools: Vec::new(),
        defs: Map::new(),
        for_template: Vec::new(),
    };
    let list = match v {
        None | Some(Value::Null) => return Ok(out),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(bad("tools", "'tools' must be an array")),
    };
    for (i, t) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        let t = as_object(t, &param)?;
        match t.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(other) => {
                eprintln!(
                    "warning: /v1/messages: {param} is a server tool of type '{other}', which runs on Anthropic's side; it is left out of the prompt"
                );
                continue;
            }
        }
        if !matches!(t.get("input_schema"), Some(Value::Object(_))) {
            return Err(bad(
                &format!("{param}.input_schema"),
                format!("'{param}.input_schema' must be a JSON Schema object"),
            ));
        }
        let tool = tools::named_tool(t.get("name"), t.get("input_schema"), &param, "input_schema")?;
        if t.get("strict") == Some(&Value::Bool(true)) {
            return Err(bad(
                &format!("{param}.strict"),
                "'strict' tools are not supported: inputs follow the schema only with tool_choice \"any\" or \"tool\"",
            ));
        }
        let deferred = match t.get("defer_loading") {
            None | Some(Value::Null | Value::Bool(false)) => false,
            Some(Value::Bool(true)) => true,
            Some(_) => {
                return Err(bad(
                    &format!("{param}.defer_loading"),
                    format!("'{param}.defer_loading' must be true or false"),
                ))
            }
        };
        let description = match t.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(d)) => Some(d.clone()),
            Some(_) => {
                return Err(bad(
                    &format!("{param}.description"),
                    format!("'{param}.description' must be a string"),
                ))
            }
        };
        let mut function = json!({"name": tool.name, "parameters": tool.parameters});
        if let Some(d) = &description {
            function["description"] = json!(d);
        }
        out.defs.insert(
            tool.name.clone(),
            json!({"name": tool.name, "description": description, "input_schema": tool.parameters}),
        );
        // A deferred tool is found by a tool search: its calls are parsed, the prompt does not
        // show it until a tool_reference does.
        if !deferred {
            out.for_template
                .push(json!({"type": "function", "function": function}));
        }
        out.tools.push(tool);
    }
    tools::check_unique(&out.tools, "tools")?;
    Ok(out)
}

/// `tool_choice` and whether several calls may come at once.
fn tool_choice(v: &Value, tools: &[Tool]) -> Result<(ToolChoice, bool), ApiError> {
    let o = as_object(v, "tool_choice")?;
    let parallel = match o.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => !b,
        Some(_) => {
            return Err(bad(
                "tool_choice.disable_parallel_tool_use",
                "'tool_choice.disable_parallel_tool_use' must be true or false",
            ))
        }
    };
    let choice = match o.get("type").and_then(Value::as_str) {
        Some("auto") => ToolChoice::Auto,
        Some("any") => ToolChoice::Required,
        Some("none") => ToolChoice::None,
        Some("tool") => match o.get("name").and_then(Value::as_str) {
            Some(n) => ToolChoice::Named(n.to_string()),
            None => {
                return Err(bad(
                    "tool_choice.name",
                    "'tool_choice' of type \"tool\" needs a 'name'",
                ))
            }
        },
        _ => {
            return Err(bad(
                "tool_choice.type",
                "'tool_choice.type' must be \"auto\", \"any\", \"tool\" or \"none\"",
            ))
        }
    };
    tools::check_choice(&choice, tools, "tool_choice")?;
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

/// `thinking`, validated as Anthropic does. A `display` the server does not produce (Claude
/// Code's `updates`) shows the thinking as `summarized` does.
fn thinking(v: &Value, max_tokens: Option<i64>) -> Result<Thinking, ApiError> {
    let o = as_object(v, "thinking")?;
    let show = match o.get("display") {
        None | Some(Value::Null) => true,
        Some(Value::String(d)) => d != "omitted",
        Some(_) => {
            return Err(bad(
                "thinking.display",
                "'thinking.display' must be a string",
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
            "thinking.type",
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
                        &format!("output_config.{other}"),
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

/// A Messages body as the server's chat request, and what the answer needs.
pub(crate) fn parse_messages(
    o: &Map<String, Value>,
    cx: Context,
) -> Result<(ChatRequest, MessagesAnswer), ApiError> {
    let model = match o.get("model") {
        Some(Value::String(m)) => m.clone(),
        _ => return Err(bad("model", "'model' must be a string")),
    };
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
        None if cx.count_only => None,
        None => return Err(bad("max_tokens", "'max_tokens' is required")),
    };
    refuse_unsupported(o)?;
    match o.get("stop_sequences") {
        None | Some(Value::Null | Value::Array(_)) => {}
        Some(_) => {
            return Err(bad(
                "stop_sequences",
                "'stop_sequences' must be an array of strings",
            ))
        }
    }
    if let Some(t) = o.get("temperature").filter(|v| !v.is_null()) {
        if !t.as_f64().is_some_and(|x| (0.0..=1.0).contains(&x)) {
            return Err(bad(
                "temperature",
                "'temperature' must be a number between 0 and 1",
            ));
        }
    }
    let mut params = parse_params(&Fields::request(o, PARAM_NAMES, cx.defaults))?;
    if cx.count_only {
        params.n_predict = None;
    }
    let tools = client_tools(o.get("tools"))?;
    let mut images = Vec::new();
    let mut messages = Vec::new();
    if let Some(s) = o.get("system").filter(|v| !v.is_null()) {
        messages.push(ChatMessage::new("system", system_text(s)?));
    }
    let raw = match o.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => return Err(bad("messages", "'messages' must not be empty")),
        _ => return Err(bad("messages", "'messages' must be an array of messages")),
    };
    for (i, m) in raw.iter().enumerate() {
        let m = as_object(m, &format!("messages[{i}]"))?;
        message(m, i, &tools.defs, cx, &mut images, &mut messages)?;
    }
    let (choice, parallel) = match o.get("tool_choice").filter(|v| !v.is_null()) {
        Some(tc) => tool_choice(tc, &tools.tools)?,
        None => (ToolChoice::Auto, true),
    };
    let mut show_thinking = true;
    let mut budget = None;
    let mut template_kwargs = Map::new();
    if let Some(t) = o.get("thinking").filter(|v| !v.is_null()) {
        let t = thinking(t, max_tokens)?;
        show_thinking = t.show;
        budget = t.budget;
        template_kwargs.insert("enable_thinking".into(), json!(t.on));
    }
    // An explicit budget wins over the effort's share of `max_tokens`.
    let effort = o
        .get("output_config")
        .and_then(|c| c.get("effort"))
        .and_then(Value::as_str);
    let budget = budget.and_then(|b| usize::try_from(b).ok()).or_else(|| {
        let allowance = u64::try_from(max_tokens?).ok()?;
        effort_budget(effort?, allowance).and_then(|b| usize::try_from(b).ok())
    });
    if let Some(b) = budget {
        params.reasoning_budget = Some(Some(b));
    }
    // Thinking is always its own block here, whatever the server's --reasoning-format.
    params.reasoning = Some(ReasoningFormat::Deepseek);
    // The first progress event carries the prefix-cache hit for `message_start`.
    params.return_progress = params.stream;
    let stop_sequences = params.stop.clone();
    let mut req = ChatRequest::new(params, messages, images).with_tools(
        tools.tools,
        tools.for_template,
        choice,
        parallel,
    )?;
    req.template_kwargs = template_kwargs;
    Ok((
        req,
        MessagesAnswer {
            model,
            show_thinking,
            stop_sequences,
        },
    ))
}
