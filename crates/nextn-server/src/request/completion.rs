//! Text completion requests: OpenAI's `/v1/completions` and llama-server's `/completion`, whose
//! prompt is a string, token ids, or llama-server's multimodal prompt object.

use nextn_engine::media::{IMAGE_PLACEHOLDER, MEDIA_MARKER};
use serde_json::{Map, Value};

use super::fields::{Fields, Names};
use super::images::{image_from_base64, ChatImage};
use super::params::{parse_params, GenParams};
use crate::error::ApiError;

#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    /// llama-server's multimodal prompt: `{"prompt_string": ..., "multimodal_data": [base64...]}`,
    /// each image at a `<__media__>` marker of the text.
    Multimodal {
        text: String,
        images: Vec<ChatImage>,
    },
}

impl Prompt {
    /// The prompt's images, in order.
    pub fn images(&self) -> &[ChatImage] {
        match self {
            Prompt::Multimodal { images, .. } => images,
            Prompt::Text(_) | Prompt::Tokens(_) => &[],
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct CompletionRequest {
    pub params: GenParams,
    pub prompt: Prompt,
}

/// A `{"prompt_string", "multimodal_data"}` prompt object.
fn multimodal_prompt(p: &Map<String, Value>) -> Result<Prompt, ApiError> {
    if let Some(k) = p
        .keys()
        .find(|k| *k != "prompt_string" && *k != "multimodal_data")
    {
        return Err(ApiError::invalid_field(
            &format!("prompt.{k}"),
            format!("unknown prompt field '{k}' (a prompt object has prompt_string and multimodal_data)"),
        ));
    }
    let Some(Value::String(text)) = p.get("prompt_string") else {
        return Err(ApiError::invalid_field(
            "prompt.prompt_string",
            "a prompt object needs a 'prompt_string' string",
        ));
    };
    let images = match p.get("multimodal_data") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(k, v)| {
                let field = format!("prompt.multimodal_data[{k}]");
                match v.as_str() {
                    Some(b64) => image_from_base64(b64, &field),
                    None => Err(ApiError::invalid_field(
                        &field,
                        "each item must be a base64 string",
                    )),
                }
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid_field(
                "prompt.multimodal_data",
                "'multimodal_data' must be an array of base64 strings",
            ))
        }
    };
    let markers = text.matches(MEDIA_MARKER).count();
    if markers != images.len() {
        return Err(ApiError::invalid_field(
            "prompt.multimodal_data",
            format!(
                "the prompt_string has {markers} {MEDIA_MARKER} markers but {} images were given",
                images.len()
            ),
        ));
    }
    Ok(Prompt::Multimodal {
        text: text.replace(MEDIA_MARKER, IMAGE_PLACEHOLDER),
        images,
    })
}

/// A text completion body, with the server's defaults for what it leaves out.
pub fn parse_completion(
    o: &Map<String, Value>,
    defaults: Option<&Map<String, Value>>,
) -> Result<CompletionRequest, ApiError> {
    let f = Fields::request(o, Names::Same, defaults);
    let params = parse_params(&f)?;
    let bad = || {
        f.bad(
            "prompt",
            "'prompt' must be a string, an array of token ids, or an array with one of those",
        )
    };
    let tokens = |a: &[Value]| -> Result<Vec<u32>, ApiError> {
        a.iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(bad)
            })
            .collect()
    };
    let prompt = match f.own("prompt") {
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Object(p)) => multimodal_prompt(p)?,
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => Prompt::Tokens(tokens(a)?),
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => Prompt::Text(s.clone()),
            Value::Array(t) => Prompt::Tokens(tokens(t)?),
            _ => return Err(bad()),
        },
        Some(Value::Array(_)) => {
            return Err(f.bad("prompt", "only one prompt per request is supported"))
        }
        None => return Err(f.bad("prompt", "'prompt' is required")),
        Some(_) => return Err(bad()),
    };
    if f.boolean("echo")? == Some(true) {
        return Err(f.bad("echo", "echo is not supported"));
    }
    Ok(CompletionRequest { params, prompt })
}
