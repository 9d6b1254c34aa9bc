//! The conversation's items as chat messages: `instructions` and the system / developer
//! messages that open it become the one system message templates expect first; consecutive
//! reasoning, assistant text and function calls become one assistant message; function outputs
//! become tool messages; user images become the prompt's images.

use nextn_engine::chat::ChatMessage;
use serde_json::{json, Map, Value};

use super::tools::qualified_name;
use crate::error::ApiError;
use crate::request::images::{check_detail, image_from_url, ChatImage, MessageText};
use crate::responses::sealed::Sealer;

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid_field(param, message)
}

/// A message's content: a string, or `input_text` / `output_text` (and `refusal`) parts, and
/// where `images` is given `input_image` parts, which go there and stand in the text as the
/// template's placeholder.
fn content_text(
    v: Option<&Value>,
    param: &str,
    mut images: Option<&mut Vec<ChatImage>>,
) -> Result<String, ApiError> {
    let parts = match v {
        None | Some(Value::Null) => return Ok(String::new()),
        Some(Value::String(s)) => return Ok(s.clone()),
        Some(Value::Array(parts)) => parts,
        Some(_) => {
            return Err(bad(
                param,
                "'content' must be a string or an array of content parts",
            ))
        }
    };
    let mut text = MessageText::default();
    for (j, p) in parts.iter().enumerate() {
        let pparam = format!("{param}[{j}]");
        let key = match p.get("type").and_then(Value::as_str) {
            Some("input_text" | "output_text" | "text") => "text",
            Some("refusal") => "refusal",
            Some("input_image") => match images.as_deref_mut() {
                Some(images) => {
                    text.push_image(input_image(p, &pparam)?, images);
                    continue;
                }
                None => {
                    return Err(bad(
                        &pparam,
                        "input_image parts are read in user messages only",
                    ))
                }
            },
            Some(other) => {
                return Err(bad(
                    &pparam,
                    format!("content parts of type '{other}' are not supported"),
                ))
            }
            None => return Err(bad(&pparam, "each content part needs a 'type'")),
        };
        match p.get(key).and_then(Value::as_str) {
            Some(t) => text.push_str(t),
            None => {
                return Err(bad(
                    &pparam,
                    format!("a content part needs a '{key}' string"),
                ))
            }
        }
    }
    Ok(text.text)
}

/// An `input_image` part's picture: its `image_url` (a data URI, or a URL fetched only where the
/// server allows it); `detail` may be `auto`, `low` or `high`.
fn input_image(p: &Value, param: &str) -> Result<ChatImage, ApiError> {
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
    check_detail(p.get("detail"), &format!("{param}.detail"))?;
    image_from_url(url, &format!("{param}.image_url"))
}

/// The thinking a `reasoning` item carries: its `reasoning_text` content, else its
/// `encrypted_content` (sealed by this server), else its summary. Sealed reasoning this server
/// cannot open (another server's, or this one's before it restarted) is left out: the model
/// goes on without it, as with reasoning the template does not show.
fn reasoning_text(
    item: &Map<String, Value>,
    param: &str,
    sealer: &Sealer,
) -> Result<String, ApiError> {
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
        Some(Value::String(s)) => match sealer.open(s) {
            Some(text) => return Ok(text),
            None => {
                eprintln!(
                    "warning: /v1/responses: {param}.encrypted_content was not sealed by this server (or not since it started); that reasoning is left out"
                );
                return Ok(String::new());
            }
        },
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

    fn flush(&mut self, messages: &mut Vec<ChatMessage>) {
        if self.is_empty() {
            return;
        }
        let turn = std::mem::take(self);
        let mut m = ChatMessage::new("assistant", turn.content);
        m.reasoning_content = turn.reasoning;
        if !turn.calls.is_empty() {
            m.tool_calls = Some(Value::Array(turn.calls));
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
        _ => Err(bad(
            &format!("{param}.{key}"),
            format!("'{param}.{key}' must be a string"),
        )),
    }
}

/// The conversation as chat messages; `path(i)` names item `i` as the client gave it.
/// Input items that record a hosted tool's work (see `tools::HOSTED`).
const HOSTED_CALL_ITEMS: &[&str] = &[
    "web_search_call",
    "file_search_call",
    "code_interpreter_call",
    "computer_call",
    "computer_call_output",
    "image_generation_call",
    "local_shell_call",
    "local_shell_call_output",
    "mcp_call",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
];

pub(super) fn messages(
    instructions: Option<&str>,
    items: &[Value],
    path: &dyn Fn(usize) -> String,
    sealer: &Sealer,
    images: &mut Vec<ChatImage>,
) -> Result<Vec<ChatMessage>, ApiError> {
    let mut system: Vec<String> = instructions.map(str::to_string).into_iter().collect();
    let mut messages = Vec::new();
    let mut turn = AssistantTurn::default();
    let mut opening = true;
    for (i, item) in items.iter().enumerate() {
        let param = path(i);
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
                    "system" | "developer" if opening => {
                        system.push(content_text(content, &cparam, None)?)
                    }
                    "user" => {
                        opening = false;
                        turn.flush(&mut messages);
                        let text = content_text(content, &cparam, Some(images))?;
                        messages.push(ChatMessage::new("user", text));
                    }
                    "system" | "developer" => {
                        opening = false;
                        turn.flush(&mut messages);
                        messages.push(ChatMessage::new(
                            "system",
                            content_text(content, &cparam, None)?,
                        ));
                    }
                    "assistant" => {
                        opening = false;
                        if !turn.calls.is_empty() {
                            turn.flush(&mut messages);
                        }
                        turn.content
                            .push_str(&content_text(content, &cparam, None)?);
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
                let output = content_text(item.get("output"), &format!("{param}.output"), None)?;
                let mut tool = ChatMessage::new("tool", output);
                tool.tool_call_id = Some(call_id.to_string());
                messages.push(tool);
            }
            "reasoning" => {
                opening = false;
                if !turn.content.is_empty() || !turn.calls.is_empty() {
                    turn.flush(&mut messages);
                }
                let text = reasoning_text(item, &param, sealer)?;
                if !text.is_empty() {
                    turn.reasoning.get_or_insert_with(String::new).push_str(&text);
                }
            }
            // What a hosted tool did on OpenAI's side (a conversation begun there): nothing here
            // ran it or can show it to the model as it was.
            kind if HOSTED_CALL_ITEMS.contains(&kind) => {
                eprintln!(
                    "warning: /v1/responses: {param} is a '{kind}' item of a hosted tool this server cannot run; it is left out of the prompt"
                );
            }
            "item_reference" => {
                return Err(bad(
                    &param,
                    "'item_reference' items are not supported: send the item itself, or continue with 'previous_response_id'",
                ))
            }
            other => {
                return Err(bad(
                    &format!("{param}.type"),
                    format!("input items of type '{other}' are not supported (message, function_call, function_call_output and reasoning are)"),
                ))
            }
        }
    }
    turn.flush(&mut messages);
    if !system.is_empty() {
        messages.insert(0, ChatMessage::new("system", system.join("\n\n")));
    }
    Ok(messages)
}
