//! The chat request every chat-shaped API builds (OpenAI chat completions here; Anthropic
//! Messages and OpenAI Responses in their own modules): messages as the template takes them,
//! the tools, `tool_choice`, the images in order, and the generation parameters.

use nextn_engine::chat::ChatMessage;
use serde_json::{Map, Value};

use super::fields::{Fields, Names};
use super::images::{image_url_part, ChatImage, MessageText};
use super::params::{parse_params, GenParams};
use crate::error::ApiError;
use crate::tools::{self, Tool, ToolChoice};

#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    pub params: GenParams,
    pub messages: Vec<ChatMessage>,
    pub template_kwargs: Map<String, Value>,
    pub tools: Vec<Tool>,
    /// The tools as the chat template gets them.
    pub tools_for_template: Value,
    pub tool_choice: ToolChoice,
    /// The field `tool_choice` came from, as the client names it.
    pub tool_choice_field: String,
    pub parallel_tool_calls: bool,
    /// The request used the older `functions` / `function_call` fields: the answer uses them too.
    pub legacy_functions: bool,
    /// The images of the messages, in order; each sits in its message's content as the
    /// template's image placeholder.
    pub images: Vec<ChatImage>,
}

impl ChatRequest {
    /// A request of `messages` with `params` and nothing else (no tools, no template variables).
    pub(crate) fn new(
        params: GenParams,
        messages: Vec<ChatMessage>,
        images: Vec<ChatImage>,
    ) -> Self {
        ChatRequest {
            params,
            messages,
            template_kwargs: Map::new(),
            tools: Vec::new(),
            tools_for_template: Value::Array(Vec::new()),
            tool_choice: ToolChoice::Auto,
            tool_choice_field: "tool_choice".into(),
            parallel_tool_calls: true,
            legacy_functions: false,
            images,
        }
    }
}

/// Message content: a string, null, or an array of `{"type": "text", "text": ...}` and
/// `{"type": "image_url", ...}` parts; the images go to `images`.
fn content(
    v: Option<&Value>,
    param: &str,
    images: &mut Vec<ChatImage>,
) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = MessageText::default();
            for (k, p) in parts.iter().enumerate() {
                let pparam = format!("{param}[{k}]");
                match p.get("type").and_then(Value::as_str) {
                    Some("image_url") => text.push_image(image_url_part(p, &pparam)?, images),
                    Some("text") => match p.get("text").and_then(Value::as_str) {
                        Some(t) => text.push_str(t),
                        None => {
                            return Err(ApiError::invalid_field(
                                &pparam,
                                "a text part needs a 'text' string",
                            ))
                        }
                    },
                    Some(other) => {
                        return Err(ApiError::invalid_field(
                            &pparam,
                            format!("content parts of type '{other}' are not supported"),
                        ))
                    }
                    None => {
                        return Err(ApiError::invalid_field(
                            &pparam,
                            "each content part needs a 'type'",
                        ))
                    }
                }
            }
            Ok(text.text)
        }
        Some(_) => Err(ApiError::invalid_field(
            param,
            "'content' must be a string, null or an array of parts",
        )),
    }
}

fn message(m: &Value, i: usize, images: &mut Vec<ChatImage>) -> Result<ChatMessage, ApiError> {
    let at = format!("messages[{i}]");
    let Value::Object(m) = m else {
        return Err(ApiError::invalid_field(
            &at,
            "each message must be an object",
        ));
    };
    let f = Fields::nested(m, &at);
    let role = match f.get("role").and_then(Value::as_str) {
        Some(r @ ("system" | "developer" | "user" | "assistant" | "tool")) => r.to_string(),
        Some(r) => return Err(f.bad("role", format!("unknown role '{r}'"))),
        None => return Err(f.bad("role", "each message needs a 'role' string")),
    };
    let tool_calls = match f.get("tool_calls") {
        None => m
            .get("function_call")
            .filter(|v| v.is_object())
            // A legacy assistant message: its one call, in the shape templates expect.
            .map(|call| serde_json::json!([{"type": "function", "function": call}])),
        Some(v @ Value::Array(_)) => Some(v.clone()),
        Some(_) => return Err(f.bad("tool_calls", "'tool_calls' must be an array")),
    };
    Ok(ChatMessage {
        role,
        content: content(m.get("content"), &f.path("content"), images)?,
        reasoning_content: f.string("reasoning_content")?.map(str::to_string),
        tool_calls: tool_calls.map(|c| tools::arguments_for_template(&c)),
        name: f.string("name")?.map(str::to_string),
        tool_call_id: f.string("tool_call_id")?.map(str::to_string),
    })
}

/// An OpenAI chat completions body, with the server's defaults for what it leaves out.
pub fn parse_chat(
    o: &Map<String, Value>,
    defaults: Option<&Map<String, Value>>,
) -> Result<ChatRequest, ApiError> {
    let f = Fields::request(o, Names::Same, defaults);
    let params = parse_params(&f)?;
    let raw = match f.own("messages") {
        Some(Value::Array(raw)) if !raw.is_empty() => raw,
        Some(Value::Array(_)) => return Err(f.bad("messages", "'messages' must not be empty")),
        _ => return Err(f.bad("messages", "'messages' must be an array of messages")),
    };
    let mut images = Vec::new();
    let messages = raw
        .iter()
        .enumerate()
        .map(|(i, m)| message(m, i, &mut images))
        .collect::<Result<Vec<_>, _>>()?;
    let template_kwargs = f
        .object("chat_template_kwargs")?
        .cloned()
        .unwrap_or_default();
    let (tools, tools_for_template) = tools::parse_tools(o)?;
    let tool_choice = tools::parse_tool_choice(o, &tools)?;
    let tool_choice_field = if f.own("tool_choice").is_none() && f.own("function_call").is_some() {
        "function_call"
    } else {
        "tool_choice"
    };
    let mut req = ChatRequest::new(params, messages, images);
    req.template_kwargs = template_kwargs;
    req.tools = tools;
    req.tools_for_template = tools_for_template;
    req.tool_choice = tool_choice;
    req.tool_choice_field = tool_choice_field.into();
    req.parallel_tool_calls = f.boolean("parallel_tool_calls")?.unwrap_or(true);
    req.legacy_functions = f.own("functions").is_some();
    check_grammar_and_choice(&req)?;
    Ok(req)
}

impl ChatRequest {
    /// The request with its tools (`for_template` as the template shows them), the choice among
    /// them and whether several calls may come at once, checked against its output format.
    pub(crate) fn with_tools(
        mut self,
        tools: Vec<Tool>,
        for_template: Vec<Value>,
        choice: ToolChoice,
        parallel: bool,
    ) -> Result<Self, ApiError> {
        self.tools = tools;
        self.tools_for_template = Value::Array(for_template);
        self.tool_choice = choice;
        self.parallel_tool_calls = parallel;
        check_grammar_and_choice(&self)?;
        Ok(self)
    }
}

/// A required or named tool call has its own grammar: it cannot be combined with an output
/// format.
pub(crate) fn check_grammar_and_choice(req: &ChatRequest) -> Result<(), ApiError> {
    if req.params.grammar.is_some()
        && matches!(req.tool_choice, ToolChoice::Required | ToolChoice::Named(_))
    {
        return Err(ApiError::invalid_field(
            &req.tool_choice_field,
            format!(
                "a required or named tool call cannot be combined with an output format ('{}')",
                req.params.grammar_field
            ),
        ));
    }
    Ok(())
}
