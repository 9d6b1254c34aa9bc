//! Chat templates: the Jinja template a GGUF carries in `tokenizer.chat_template`, rendered the
//! way Hugging Face and llama.cpp's `--jinja` render it.
//!
//! The environment follows Hugging Face's: `trim_blocks` and `lstrip_blocks` on, no autoescape,
//! Python string / dict methods (`.strip()`, `.split()`, `.items()`...), `raise_exception(msg)`,
//! and a `tojson` that prints like Python's `json.dumps`. The context holds `messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token` and every caller keyword argument
//! (`enable_thinking`, `tools`, ...).

mod pyjson;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

/// One conversation turn, shaped like an OpenAI chat message; absent fields stay undefined in the
/// template (templates test them with `is defined` / `is string`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..ChatMessage::default()
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("chat template does not compile: {0}")]
    Syntax(String),
    #[error("chat template failed to render: {0}")]
    Render(String),
    /// The template itself rejected the conversation through `raise_exception`.
    #[error("chat template rejected the conversation: {0}")]
    Raised(String),
    #[error("cannot continue the final message: {0}")]
    Prefill(&'static str),
    #[error(transparent)]
    Gguf(#[from] nextn_gguf::GgufError),
}

const TEMPLATE_NAME: &str = "chat";
const RAISED_PREFIX: &str = "raise_exception: ";
/// Marks where the final message's content ends when rendering a prefill.
const PREFILL_SENTINEL: &str = "\u{E000}nextn-prefill-end\u{E001}";

/// The ChatML layout of llama.cpp's built-in "chatml" template, used when a file has none.
const CHATML_SOURCE: &str = "{%- for message in messages -%}\
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}";

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_bytes", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED_PREFIX}{message}"),
    ))
}

fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let mut options = pyjson::DumpOptions::default();
    let indent: Option<Value> = kwargs.get("indent")?;
    options.indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => {
                let n = i64::try_from(v)?;
                Some(" ".repeat(n.clamp(0, 64) as usize))
            }
        },
    };
    options.ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    options.sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    if let Some(seps) = separators {
        match <[String; 2]>::try_from(seps) {
            Ok([item, key]) => options.separators = Some((item, key)),
            Err(_) => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson separators must be a pair",
                ));
            }
        }
    }
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::BadSerialization, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(pyjson::dumps(&json, &options)))
}

fn template_error(e: &Error) -> String {
    // The alternate form carries the template line and the failing expression.
    let mut text = format!("{e:#}");
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        text.push_str(&format!(": {inner}"));
        source = inner.source();
    }
    text
}

fn render_error(e: Error) -> ChatTemplateError {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = current {
        if let Some(jinja) = err.downcast_ref::<Error>() {
            if let Some(message) = jinja.detail().and_then(|d| d.strip_prefix(RAISED_PREFIX)) {
                return ChatTemplateError::Raised(message.to_owned());
            }
        }
        current = err.source();
    }
    ChatTemplateError::Render(template_error(&e))
}

impl ChatTemplate {
    /// Compiles a Jinja chat template.
    pub fn new(source: &str) -> Result<Self, ChatTemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| ChatTemplateError::Syntax(template_error(&e)))?;
        Ok(ChatTemplate {
            env,
            source: source.to_owned(),
            bos_token: String::new(),
            eos_token: String::new(),
        })
    }

    /// ChatML (`<|im_start|>role\ncontent<|im_end|>\n`), llama.cpp's built-in fallback.
    pub fn chatml() -> Self {
        match ChatTemplate::new(CHATML_SOURCE) {
            Ok(t) => t,
            // The built-in source is a constant; a failure here is a bug in this file.
            Err(e) => unreachable!("built-in ChatML template does not compile: {e}"),
        }
    }

    /// The template of a GGUF file (`tokenizer.chat_template`), if it has one.
    pub fn from_gguf(f: &nextn_gguf::GgufFile) -> Result<Option<Self>, ChatTemplateError> {
        match f.get_str("tokenizer.chat_template")? {
            Some(source) => ChatTemplate::new(source).map(Some),
            None => Ok(None),
        }
    }

    /// Sets the `bos_token` / `eos_token` strings templates may print.
    pub fn with_special_tokens(mut self, bos_token: &str, eos_token: &str) -> Self {
        self.bos_token = bos_token.to_owned();
        self.eos_token = eos_token.to_owned();
        self
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders the conversation; with `add_generation_prompt` the prompt ends where the assistant's
    /// reply starts. `kwargs` are extra template variables (`enable_thinking`, `tools`, ...).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ChatTemplateError> {
        let mut context = serde_json::Map::new();
        context.insert("bos_token".into(), self.bos_token.clone().into());
        context.insert("eos_token".into(), self.eos_token.clone().into());
        for (key, value) in kwargs {
            context.insert(key.clone(), value.clone());
        }
        let messages = serde_json::to_value(messages)
            .map_err(|e| ChatTemplateError::Render(format!("messages do not serialize: {e}")))?;
        context.insert("messages".into(), messages);
        context.insert("add_generation_prompt".into(), add_generation_prompt.into());

        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatTemplateError::Render(template_error(&e)))?;
        template
            .render(Value::from_serialize(&context))
            .map_err(render_error)
    }

    /// Renders a conversation whose last message is a partial reply to be continued: the prompt
    /// stops right after that message's content, with no end-of-turn (what llama-server does with
    /// a trailing assistant message, and `continue_final_message` in transformers).
    pub fn render_prefill(
        &self,
        messages: &[ChatMessage],
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ChatTemplateError> {
        let Some((last, earlier)) = messages.split_last() else {
            return Err(ChatTemplateError::Prefill("the conversation is empty"));
        };
        let mut marked = earlier.to_vec();
        let mut last = last.clone();
        last.content.push_str(PREFILL_SENTINEL);
        marked.push(last);
        let rendered = self.render(&marked, false, kwargs)?;
        match rendered.find(PREFILL_SENTINEL) {
            Some(end) => Ok(rendered[..end].to_owned()),
            None => Err(ChatTemplateError::Prefill(
                "the template does not print the final message's content",
            )),
        }
    }
}

/// Where the next turn of a ChatML conversation diverges from this prompt: the final
/// `<|im_start|>` (the assistant header; templates re-render earlier answers, without their
/// reasoning, from there on). The state just before it is worth keeping for that turn.
pub fn final_header(tokenizer: &crate::tokenizer::Tokenizer, tokens: &[u32]) -> Option<usize> {
    let id = tokenizer.token_id("<|im_start|>")?;
    tokens.iter().rposition(|&t| t == id).filter(|&p| p > 0)
}

#[cfg(test)]
mod tests;
