//! OpenAI request bodies, checked field by field so a wrong field gets a 400 naming it.
//! Every field the server reads is listed in crates/nextn-server/README.md. A known field that
//! asks for something not implemented (mirostat, DRY, XTC, ...) is refused with a 400 naming it,
//! unless its value is the one that turns it off; unknown fields are ignored, as OpenAI-compatible
//! servers do, and logged once at debug level ([`unknown_fields`]).

use nextn_engine::chat::ChatMessage;
use nextn_engine::grammar::GrammarSource;
use nextn_engine::media::{IMAGE_PLACEHOLDER, MEDIA_MARKER};
use nextn_engine::sampler::SamplerConfig;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::tools::{self, Tool, ToolChoice};
use crate::ReasoningFormat;

/// Stop strings a request may give, and how long each may be.
const MAX_STOPS: usize = 16;
const MAX_STOP_LEN: usize = 1024;

/// A `logit_bias` key: a token id, or a text whose tokens all get the bias (llama-server).
#[derive(Clone, Debug, PartialEq)]
pub enum BiasKey {
    Id(u64),
    Text(String),
}

/// What both endpoints share: sampling, budget, stopping, streaming, output format.
#[derive(Clone, Debug, PartialEq)]
pub struct GenParams {
    pub model: Option<String>,
    pub n_predict: Option<usize>,
    pub sampler: SamplerConfig,
    /// `logit_bias` before its keys are resolved to token ids (that needs the tokenizer).
    pub logit_bias: Vec<(BiasKey, f32)>,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
    /// Log probabilities with this many alternatives per token (`logprobs` / `top_logprobs`,
    /// completions' `logprobs`, llama.cpp's `n_probs`).
    pub logprobs: Option<usize>,
    /// `response_format` json_object / json_schema, llama.cpp's `json_schema` or `grammar`.
    pub grammar: Option<GrammarSource>,
    /// Per-request `reasoning_format`.
    pub reasoning: Option<ReasoningFormat>,
    /// `thinking_budget_tokens` (llama-server): at most this many tokens of reasoning, `Some(None)`
    /// for no cap (-1); `None`: the server's `--reasoning-budget`.
    pub reasoning_budget: Option<Option<usize>>,
    /// `cache_prompt`: resume from and add to the prefix cache (default true).
    pub cache_prompt: bool,
    /// `return_progress` (llama-server): a stream reports how far the prompt has been
    /// processed (`prompt_progress`) before the answer.
    pub return_progress: bool,
    /// `forced_acceptance_reference`: the plain output this request's drafts are steered
    /// towards on a server started with `--force-acceptance` (measurement only).
    pub forced_reference: Option<Vec<u32>>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    pub params: GenParams,
    pub messages: Vec<ChatMessage>,
    pub template_kwargs: Map<String, Value>,
    pub tools: Vec<Tool>,
    /// The tools as the chat template gets them.
    pub tools_for_template: Value,
    pub tool_choice: ToolChoice,
    pub parallel_tool_calls: bool,
    /// The request used the older `functions` / `function_call` fields: the answer uses them too.
    pub legacy_functions: bool,
    /// The images of the messages' content parts, in order; each sits in its message's content
    /// as [`IMAGE_PLACEHOLDER`], what the Qwen3.5 / Qwen3.6 templates render for an image part.
    pub images: Vec<ChatImage>,
}

/// An image content part as the request sent it: the field it came from and where its encoded
/// bytes (PNG, JPEG, WebP, GIF) are. Every API's image part maps onto this.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatImage {
    pub source: ImageSource,
    pub field: String,
}

/// Where an image's bytes are: in the request, or behind an http(s) URL that the handler fetches
/// (`--allow-image-urls`, see [`crate::image_url`]) before the request is prepared.
#[derive(Clone, Debug, PartialEq)]
pub enum ImageSource {
    Inline(Vec<u8>),
    Remote(String),
}

impl ChatImage {
    pub fn inline(bytes: Vec<u8>, field: impl Into<String>) -> Self {
        ChatImage {
            source: ImageSource::Inline(bytes),
            field: field.into(),
        }
    }

    /// The URL still to fetch, if the image is one.
    pub fn remote_url(&self) -> Option<&str> {
        match &self.source {
            ImageSource::Remote(u) => Some(u),
            ImageSource::Inline(_) => None,
        }
    }

    /// The image's bytes; an image still behind its URL has none yet (the handlers fetch every
    /// URL before preparing, so that is the server's fault).
    pub fn bytes(&self) -> Result<&[u8], ApiError> {
        match &self.source {
            ImageSource::Inline(b) => Ok(b),
            ImageSource::Remote(_) => Err(ApiError::internal(format!(
                "{}: the image URL was not fetched before the prompt was prepared",
                self.field
            ))),
        }
    }
}

/// An image given as a URL: a `data:image/...;base64,...` URI decoded here, or an `http://` /
/// `https://` URL kept for the handler to fetch (or refuse, without `--allow-image-urls`).
pub fn image_from_url(url: &str, field: &str) -> Result<ChatImage, ApiError> {
    use base64::Engine as _;
    let Some(rest) = strip_prefix_ignore_case(url, "data:") else {
        return remote_image(url, field);
    };
    let Some((media, data)) = rest.split_once(',') else {
        return Err(ApiError::invalid_field(
            field,
            "the data URI has no ',' before its data",
        ));
    };
    if !media.ends_with(";base64") {
        return Err(ApiError::invalid_field(
            field,
            "the data URI must be base64-encoded (data:image/...;base64,...)",
        ));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| {
            ApiError::invalid_field(field, format!("the image's base64 data is invalid: {e}"))
        })?;
    Ok(ChatImage::inline(bytes, field))
}

/// URL schemes are case-insensitive (RFC 3986), so `DATA:` and `HTTPS://` count too.
fn strip_prefix_ignore_case<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &s[prefix.len()..])
}

/// An image URL that is not a data URI: an absolute `http://` or `https://` URL with a host, to be
/// fetched later; any other scheme is refused here.
fn remote_image(url: &str, field: &str) -> Result<ChatImage, ApiError> {
    let inline = "send the image inline as a data URI (data:image/png;base64,...)";
    let parsed = match reqwest::Url::parse(url) {
        Ok(u) => u,
        Err(e)
            if strip_prefix_ignore_case(url, "http://").is_some()
                || strip_prefix_ignore_case(url, "https://").is_some() =>
        {
            return Err(ApiError::invalid_field(
                field,
                format!("{field}: the image URL is not a valid URL ({e})"),
            ))
        }
        Err(_) => {
            return Err(ApiError::invalid_field(
                field,
                format!("{field}: an image URL must be a data URI or an http(s) URL: {inline}"),
            ))
        }
    };
    match parsed.scheme() {
        // Both are special schemes: a URL that parsed has a host.
        "http" | "https" => Ok(ChatImage {
            source: ImageSource::Remote(parsed.into()),
            field: field.to_string(),
        }),
        other => Err(ApiError::invalid_field(
            field,
            format!("{field}: image URLs with the scheme '{other}:' are not fetched (only http:// and https://): {inline}"),
        )),
    }
}

/// An OpenAI `image_url` part: `{"url": ..., "detail": "auto"}` or the URL as a string.
fn image_url_part(p: &Value, field: &str) -> Result<ChatImage, ApiError> {
    let url = match p.get("image_url") {
        Some(Value::String(u)) => u,
        Some(Value::Object(o)) => {
            match o.get("detail") {
                None | Some(Value::Null) => {}
                Some(Value::String(d)) if d == "auto" => {}
                Some(d) => {
                    return Err(ApiError::invalid_field(
                        &format!("{field}.image_url.detail"),
                        format!("detail {d} is not supported: images are sized within the mmproj's pixel bounds ('auto')"),
                    ))
                }
            }
            match o.get("url") {
                Some(Value::String(u)) => u,
                _ => {
                    return Err(ApiError::invalid_field(
                        &format!("{field}.image_url.url"),
                        "an image_url part needs a 'url' string",
                    ))
                }
            }
        }
        _ => {
            return Err(ApiError::invalid_field(
                field,
                "an image_url part needs an 'image_url' object with a 'url'",
            ))
        }
    };
    image_from_url(url, &format!("{field}.image_url.url"))
}

/// Top alternatives a request may ask for per token.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Fields the server reads (or checks), for telling unknown ones apart.
const KNOWN_FIELDS: &[&str] = &[
    "return_tokens",
    "return_progress",
    "cache_prompt",
    "forced_acceptance_reference",
    "model",
    "messages",
    "prompt",
    "n_predict",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "min_p",
    "top_k",
    "presence_penalty",
    "frequency_penalty",
    "repeat_penalty",
    "repeat_last_n",
    "seed",
    "stop",
    "n",
    "logprobs",
    "top_logprobs",
    "n_probs",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "response_format",
    "json_schema",
    "grammar",
    "logit_bias",
    "stream",
    "stream_options",
    "ignore_eos",
    "chat_template_kwargs",
    "reasoning_format",
    "thinking_budget_tokens",
    "echo",
    "best_of",
    "suffix",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "typical_p",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "xtc_probability",
    "xtc_threshold",
    "top_n_sigma",
    "dynatemp_range",
    "dynatemp_exponent",
    "tfs_z",
    "samplers",
    "min_keep",
    "post_sampling_probs",
    "lora",
    "penalize_nl",
];

/// The request's fields this server does not know, each named once per process (logged at
/// debug level by the caller).
pub fn unknown_fields(o: &Map<String, Value>) -> Vec<String> {
    use std::collections::HashSet;
    use std::sync::Mutex;
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    let seen = seen.get_or_insert_with(HashSet::new);
    o.keys()
        .filter(|k| !KNOWN_FIELDS.contains(&k.as_str()))
        .filter(|k| seen.insert((*k).clone()))
        .cloned()
        .collect()
}

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

/// A `{"prompt_string", "multimodal_data"}` prompt object.
fn multimodal_prompt(p: &Map<String, Value>) -> Result<Prompt, ApiError> {
    use base64::Engine as _;
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
                let Some(b64) = v.as_str() else {
                    return Err(ApiError::invalid_field(
                        &field,
                        "each item must be a base64 string",
                    ));
                };
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(b64.trim())
                    .map_err(|e| ApiError::invalid_field(&field, format!("invalid base64: {e}")))?;
                Ok(ChatImage::inline(bytes, field))
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

#[derive(Clone, Debug, PartialEq)]
pub struct CompletionRequest {
    pub params: GenParams,
    pub prompt: Prompt,
}

pub fn parse_json(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad_request(
            "the request body must be a JSON object",
        )),
        Err(e) => Err(ApiError::bad_request(format!(
            "the request body is not valid JSON: {e}"
        ))),
    }
}

/// A present, non-null field.
fn field<'a>(o: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    o.get(name).filter(|v| !v.is_null())
}

fn number(o: &Map<String, Value>, name: &str) -> Result<Option<f64>, ApiError> {
    match field(o, name) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() => Ok(Some(x)),
            _ => Err(ApiError::invalid_field(
                name,
                format!("'{name}' must be a finite number"),
            )),
        },
    }
}

fn ranged(o: &Map<String, Value>, name: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
    match number(o, name)? {
        Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::invalid_field(
            name,
            format!("'{name}' must be between {lo} and {hi}, got {x}"),
        )),
        x => Ok(x.map(|x| x as f32)),
    }
}

fn integer(o: &Map<String, Value>, name: &str) -> Result<Option<i64>, ApiError> {
    match field(o, name) {
        None => Ok(None),
        Some(v) => match (v.as_i64(), v.as_u64(), v.as_f64()) {
            (Some(i), _, _) => Ok(Some(i)),
            (None, Some(_), _) => Ok(Some(i64::MAX)),
            // Clients written in JavaScript send 100.0 for 100.
            (None, None, Some(f)) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(Some(f as i64)),
            _ => Err(ApiError::invalid_field(
                name,
                format!("'{name}' must be an integer"),
            )),
        },
    }
}

fn boolean(o: &Map<String, Value>, name: &str) -> Result<Option<bool>, ApiError> {
    match field(o, name) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::invalid_field(
            name,
            format!("'{name}' must be true or false"),
        )),
    }
}

fn string<'a>(o: &'a Map<String, Value>, name: &str) -> Result<Option<&'a str>, ApiError> {
    match field(o, name) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ApiError::invalid_field(
            name,
            format!("'{name}' must be a string"),
        )),
    }
}

/// Seed of a request that gives none: different for every request, like llama-server's default.
pub(crate) fn fresh_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    // splitmix64 of (time, count): distinct seeds even within one clock tick.
    let mut z = t ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

pub fn parse_params(o: &Map<String, Value>) -> Result<GenParams, ApiError> {
    let model = string(o, "model")?.map(str::to_string);
    let mut n_predict = None;
    for name in ["n_predict", "max_tokens", "max_completion_tokens"] {
        match integer(o, name)? {
            None | Some(-1) => {}
            Some(n) if n < 0 => {
                return Err(ApiError::invalid_field(
                    name,
                    format!("'{name}' must be at least 0 (or -1 for no limit), got {n}"),
                ))
            }
            Some(n) => n_predict = Some(usize::try_from(n).unwrap_or(usize::MAX)),
        }
    }
    let mut s = SamplerConfig::default();
    if let Some(t) = ranged(o, "temperature", 0.0, 100.0)? {
        s.temperature = t;
    }
    if let Some(p) = ranged(o, "top_p", 0.0, 1.0)? {
        s.top_p = p;
    }
    if let Some(p) = ranged(o, "min_p", 0.0, 1.0)? {
        s.min_p = p;
    }
    if let Some(k) = integer(o, "top_k")? {
        // llama.cpp: top_k <= 0 turns it off.
        s.top_k = usize::try_from(k).unwrap_or(0);
    }
    if let Some(p) = ranged(o, "presence_penalty", -2.0, 2.0)? {
        s.presence_penalty = p;
    }
    if let Some(p) = ranged(o, "frequency_penalty", -2.0, 2.0)? {
        s.frequency_penalty = p;
    }
    if let Some(p) = ranged(o, "repeat_penalty", 0.0, 100.0)? {
        if p <= 0.0 {
            return Err(ApiError::invalid_field(
                "repeat_penalty",
                "'repeat_penalty' must be greater than 0",
            ));
        }
        s.repeat_penalty = p;
    }
    if let Some(n) = integer(o, "repeat_last_n")? {
        if !(0..=1 << 20).contains(&n) {
            return Err(ApiError::invalid_field(
                "repeat_last_n",
                "'repeat_last_n' must be between 0 and 1048576",
            ));
        }
        s.repeat_last_n = n as usize;
    }
    s.seed = match integer(o, "seed")? {
        Some(n) if n >= 0 => n as u64,
        _ => fresh_seed(),
    };
    let stop = match field(o, "stop") {
        None => Vec::new(),
        Some(Value::String(x)) => vec![x.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str().map(str::to_string).ok_or_else(|| {
                    ApiError::invalid_field(
                        "stop",
                        "'stop' must be a string or an array of strings",
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid_field(
                "stop",
                "'stop' must be a string or an array of strings",
            ))
        }
    };
    if stop.len() > MAX_STOPS || stop.iter().any(|x| x.len() > MAX_STOP_LEN) {
        return Err(ApiError::invalid_field(
            "stop",
            format!("at most {MAX_STOPS} stop strings of at most {MAX_STOP_LEN} bytes each"),
        ));
    }
    if let Some(n) = integer(o, "n")? {
        if n != 1 {
            return Err(ApiError::invalid_field("n", "only n = 1 is supported"));
        }
    }
    if let Some(n) = integer(o, "best_of")? {
        if n != 1 {
            return Err(ApiError::invalid_field(
                "best_of",
                "only best_of = 1 is supported",
            ));
        }
    }
    refuse_unsupported(o)?;
    let logprobs = parse_logprobs(o)?;
    let grammar = parse_grammar(o)?;
    let logit_bias = parse_logit_bias(o)?;
    let reasoning = match string(o, "reasoning_format")? {
        None => None,
        Some("none") => Some(ReasoningFormat::None),
        Some("deepseek" | "auto" | "deepseek-legacy") => Some(ReasoningFormat::Deepseek),
        Some(other) => {
            return Err(ApiError::invalid_field(
                "reasoning_format",
                format!("'reasoning_format' '{other}' must be \"none\", \"auto\" or \"deepseek\""),
            ))
        }
    };
    let reasoning_budget = match integer(o, "thinking_budget_tokens")? {
        None => None,
        Some(-1) => Some(None),
        Some(n) if n >= 0 => Some(Some(usize::try_from(n).unwrap_or(usize::MAX))),
        Some(n) => {
            return Err(ApiError::invalid_field(
                "thinking_budget_tokens",
                format!("'thinking_budget_tokens' must be -1 (no cap) or at least 0, got {n}"),
            ))
        }
    };
    let include_usage = match field(o, "stream_options") {
        None => false,
        Some(Value::Object(so)) => boolean(so, "include_usage")?.unwrap_or(false),
        Some(_) => {
            return Err(ApiError::invalid_field(
                "stream_options",
                "'stream_options' must be an object",
            ))
        }
    };
    s.validate()
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(GenParams {
        model,
        n_predict,
        sampler: s,
        logit_bias,
        stop,
        ignore_eos: boolean(o, "ignore_eos")?.unwrap_or(false),
        stream: boolean(o, "stream")?.unwrap_or(false),
        include_usage,
        logprobs,
        grammar,
        reasoning,
        reasoning_budget,
        cache_prompt: boolean(o, "cache_prompt")?.unwrap_or(true),
        return_progress: boolean(o, "return_progress")?.unwrap_or(false),
        forced_reference: token_ids(o, "forced_acceptance_reference")?,
    })
}

/// An array of token ids (non-negative integers below 2³²).
fn token_ids(o: &Map<String, Value>, name: &str) -> Result<Option<Vec<u32>>, ApiError> {
    let Some(v) = field(o, name) else {
        return Ok(None);
    };
    let bad = || ApiError::invalid_field(name, format!("'{name}' must be an array of token ids"));
    let a = v.as_array().ok_or_else(bad)?;
    a.iter()
        .map(|x| {
            x.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(bad)
        })
        .collect::<Result<Vec<u32>, _>>()
        .map(Some)
}

/// llama.cpp's other samplers: a value that turns one off is accepted (clients such as
/// llama.cpp's web page send them all), anything else is refused, naming the field.
fn refuse_unsupported(o: &Map<String, Value>) -> Result<(), ApiError> {
    // (field, the value that turns it off)
    const OFF: [(&str, f64); 7] = [
        ("mirostat", 0.0),
        ("typical_p", 1.0),
        ("dry_multiplier", 0.0),
        ("xtc_probability", 0.0),
        ("top_n_sigma", -1.0),
        ("dynatemp_range", 0.0),
        ("tfs_z", 1.0),
    ];
    for (name, off) in OFF {
        if let Some(v) = number(o, name)? {
            // top-n-sigma is off at any value <= 0 in llama.cpp.
            let is_off = v == off || (name == "top_n_sigma" && v <= 0.0);
            if !is_off {
                return Err(ApiError::invalid_field(
                    name,
                    format!("'{name}' is not supported (only {off}, which turns it off)"),
                ));
            }
        }
    }
    if let Some(n) = integer(o, "min_keep")? {
        if n > 1 {
            return Err(ApiError::invalid_field(
                "min_keep",
                "'min_keep' is not supported (only 0 or 1)",
            ));
        }
    }
    for name in ["samplers", "lora"] {
        if field(o, name).is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
            return Err(ApiError::invalid_field(
                name,
                format!("'{name}' is not supported"),
            ));
        }
    }
    if boolean(o, "post_sampling_probs")? == Some(true) {
        return Err(ApiError::invalid_field(
            "post_sampling_probs",
            "'post_sampling_probs' is not supported: log probabilities are the model's own",
        ));
    }
    if field(o, "suffix").is_some_and(|v| v.as_str().is_none_or(|s| !s.is_empty())) {
        return Err(ApiError::invalid_field(
            "suffix",
            "'suffix' (text insertion) is not supported",
        ));
    }
    Ok(())
}

/// Chat: `logprobs: true` with `top_logprobs` 0-20; completions: `logprobs` as the number of
/// alternatives; llama.cpp: `n_probs`.
fn parse_logprobs(o: &Map<String, Value>) -> Result<Option<usize>, ApiError> {
    let top = |name: &str, n: Option<i64>| -> Result<usize, ApiError> {
        match n {
            None => Ok(0),
            Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Ok(n as usize),
            Some(n) => Err(ApiError::invalid_field(
                name,
                format!("'{name}' must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
            )),
        }
    };
    let mut wanted = match field(o, "logprobs") {
        None | Some(Value::Bool(false)) => None,
        Some(Value::Bool(true)) => Some(top("top_logprobs", integer(o, "top_logprobs")?)?),
        Some(_) => match integer(o, "logprobs")? {
            Some(0) | None => None,
            n => Some(top("logprobs", n)?),
        },
    };
    if wanted.is_none() && field(o, "top_logprobs").is_some() {
        return Err(ApiError::invalid_field(
            "top_logprobs",
            "'top_logprobs' needs \"logprobs\": true",
        ));
    }
    match integer(o, "n_probs")? {
        None | Some(0) => {}
        n => wanted = Some(top("n_probs", n)?.max(wanted.unwrap_or(0))),
    }
    Ok(wanted)
}

/// At most one of `response_format` (json_object / json_schema), `json_schema` and `grammar`.
fn parse_grammar(o: &Map<String, Value>) -> Result<Option<GrammarSource>, ApiError> {
    let mut found: Vec<(&str, GrammarSource)> = Vec::new();
    if let Some(rf) = field(o, "response_format") {
        let bad = |m: &str| ApiError::invalid_field("response_format", m.to_string());
        let Some(rf) = rf.as_object() else {
            return Err(bad("'response_format' must be an object"));
        };
        match rf.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object") => found.push((
                "response_format",
                match rf.get("schema").filter(|s| !s.is_null()) {
                    // llama-server takes a schema here too.
                    Some(schema) => GrammarSource::JsonSchema(schema.clone()),
                    None => GrammarSource::JsonObject,
                },
            )),
            Some("json_schema") => {
                let schema = rf
                    .get("json_schema")
                    .and_then(|j| j.get("schema"))
                    .or_else(|| rf.get("schema"))
                    .filter(|s| s.is_object() || s.is_boolean());
                match schema {
                    Some(schema) => found.push(("response_format", GrammarSource::JsonSchema(schema.clone()))),
                    None => {
                        return Err(bad(
                            "'response_format' of type json_schema needs 'json_schema': {\"schema\": {...}}",
                        ))
                    }
                }
            }
            Some(other) => {
                return Err(bad(&format!(
                    "'response_format' type '{other}' must be \"text\", \"json_object\" or \"json_schema\""
                )))
            }
            None => return Err(bad("'response_format' needs a 'type'")),
        }
    }
    match field(o, "json_schema") {
        None => {}
        Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
            found.push(("json_schema", GrammarSource::JsonSchema(schema.clone())))
        }
        Some(_) => {
            return Err(ApiError::invalid_field(
                "json_schema",
                "'json_schema' must be a JSON Schema object",
            ))
        }
    }
    match field(o, "grammar") {
        None => {}
        Some(Value::String(g)) if g.trim().is_empty() => {}
        Some(Value::String(g)) => found.push(("grammar", GrammarSource::Grammar(g.clone()))),
        Some(_) => {
            return Err(ApiError::invalid_field(
                "grammar",
                "'grammar' must be a string (a GBNF or Lark grammar)",
            ))
        }
    }
    if found.len() > 1 {
        return Err(ApiError::invalid_field(
            found[1].0,
            format!(
                "give only one of response_format (JSON), json_schema and grammar: this request has '{}' and '{}'",
                found[0].0, found[1].0
            ),
        ));
    }
    Ok(found.pop().map(|(_, g)| g))
}

/// A boolean field; absent or `null` is `default`.
pub(crate) fn flag(o: &Map<String, Value>, name: &str, default: bool) -> Result<bool, ApiError> {
    match o.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid_field(
            name,
            format!("'{name}' must be a boolean"),
        )),
    }
}

/// `logit_bias`: an object of token id (or text) to bias, or llama.cpp's `[[key, bias], ...]`;
/// a bias of `false` bans the token. Biases are clamped to [-100, 100] as OpenAI does.
fn parse_logit_bias(o: &Map<String, Value>) -> Result<Vec<(BiasKey, f32)>, ApiError> {
    let bad = |m: String| ApiError::invalid_field("logit_bias", m);
    let key = |k: &str| -> BiasKey {
        match k.trim().parse::<u64>() {
            Ok(id) => BiasKey::Id(id),
            Err(_) => BiasKey::Text(k.to_string()),
        }
    };
    let bias = |k: &str, v: &Value| -> Result<f32, ApiError> {
        match v {
            Value::Bool(false) => Ok(f32::NEG_INFINITY),
            Value::Number(n) => match n.as_f64() {
                Some(b) if b.is_finite() => Ok(b.clamp(-100.0, 100.0) as f32),
                _ => Err(bad(format!("the bias of '{k}' must be a finite number"))),
            },
            _ => Err(bad(format!(
                "the bias of '{k}' must be a number (or false to ban the token)"
            ))),
        }
    };
    let mut out = Vec::new();
    match field(o, "logit_bias") {
        None => {}
        Some(Value::Object(m)) => {
            for (k, v) in m {
                out.push((key(k), bias(k, v)?));
            }
        }
        Some(Value::Array(pairs)) => {
            for p in pairs {
                match p.as_array().map(Vec::as_slice) {
                    Some([Value::Number(id), v]) => {
                        let k = id.to_string();
                        let id = id
                            .as_u64()
                            .ok_or_else(|| bad(format!("'{k}' is not a token id")))?;
                        out.push((BiasKey::Id(id), bias(&k, v)?));
                    }
                    Some([Value::String(text), v]) => {
                        out.push((BiasKey::Text(text.clone()), bias(text, v)?))
                    }
                    _ => {
                        return Err(bad(
                            "'logit_bias' pairs must be [token id or text, bias]".into()
                        ))
                    }
                }
            }
        }
        Some(_) => {
            return Err(bad(
                "'logit_bias' must be an object of token id to bias".into()
            ))
        }
    }
    Ok(out)
}

/// Message content: a string, null, or an array of `{"type": "text", "text": ...}` and
/// `{"type": "image_url", ...}` parts; the images go to `images`.
fn content(v: Option<&Value>, at: usize, images: &mut Vec<ChatImage>) -> Result<String, ApiError> {
    let param = format!("messages[{at}].content");
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (k, p) in parts.iter().enumerate() {
                match p.get("type").and_then(Value::as_str) {
                    Some("image_url") => {
                        images.push(image_url_part(p, &format!("{param}[{k}]"))?);
                        text.push_str(IMAGE_PLACEHOLDER);
                    }
                    Some("text") => match p.get("text").and_then(Value::as_str) {
                        Some(t) => text.push_str(t),
                        None => {
                            return Err(ApiError::invalid_field(
                                &param,
                                "a text part needs a 'text' string",
                            ))
                        }
                    },
                    Some(other) => {
                        return Err(ApiError::invalid_field(
                            &param,
                            format!("content parts of type '{other}' are not supported"),
                        ))
                    }
                    None => {
                        return Err(ApiError::invalid_field(
                            &param,
                            "each content part needs a 'type'",
                        ))
                    }
                }
            }
            Ok(text)
        }
        Some(_) => Err(ApiError::invalid_field(
            &param,
            "'content' must be a string, null or an array of parts",
        )),
    }
}

pub fn parse_chat(o: &Map<String, Value>) -> Result<ChatRequest, ApiError> {
    let params = parse_params(o)?;
    let Some(Value::Array(raw)) = field(o, "messages") else {
        return Err(ApiError::invalid_field(
            "messages",
            "'messages' must be an array of messages",
        ));
    };
    if raw.is_empty() {
        return Err(ApiError::invalid_field(
            "messages",
            "'messages' must not be empty",
        ));
    }
    let mut messages = Vec::with_capacity(raw.len());
    let mut images = Vec::new();
    for (i, m) in raw.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(ApiError::invalid_field(
                &format!("messages[{i}]"),
                "each message must be an object",
            ));
        };
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("system" | "developer" | "user" | "assistant" | "tool")) => r.to_string(),
            Some(r) => {
                return Err(ApiError::invalid_field(
                    &format!("messages[{i}].role"),
                    format!("unknown role '{r}'"),
                ))
            }
            None => {
                return Err(ApiError::invalid_field(
                    &format!("messages[{i}].role"),
                    "each message needs a 'role' string",
                ))
            }
        };
        let text_of = |name: &str| -> Result<Option<String>, ApiError> {
            match m.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(ApiError::invalid_field(
                    &format!("messages[{i}].{name}"),
                    format!("'{name}' must be a string"),
                )),
            }
        };
        let tool_calls = match m.get("tool_calls").filter(|v| !v.is_null()) {
            None => m
                .get("function_call")
                .filter(|v| v.is_object())
                // A legacy assistant message: its one call, in the shape templates expect.
                .map(|f| serde_json::json!([{"type": "function", "function": f}])),
            Some(v @ Value::Array(_)) => Some(v.clone()),
            Some(_) => {
                return Err(ApiError::invalid_field(
                    &format!("messages[{i}].tool_calls"),
                    "'tool_calls' must be an array",
                ))
            }
        };
        messages.push(ChatMessage {
            role,
            content: content(m.get("content"), i, &mut images)?,
            reasoning_content: text_of("reasoning_content")?,
            tool_calls: tool_calls.map(|c| tools::arguments_for_template(&c)),
            name: text_of("name")?,
            tool_call_id: text_of("tool_call_id")?,
        });
    }
    let template_kwargs = match field(o, "chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(k)) => k.clone(),
        Some(_) => {
            return Err(ApiError::invalid_field(
                "chat_template_kwargs",
                "'chat_template_kwargs' must be an object",
            ))
        }
    };
    let (tools, tools_for_template) = tools::parse_tools(o)?;
    let tool_choice = tools::parse_tool_choice(o, &tools)?;
    if params.grammar.is_some()
        && matches!(tool_choice, ToolChoice::Required | ToolChoice::Named(_))
    {
        return Err(ApiError::invalid_field(
            "tool_choice",
            "a required or named tool call cannot be combined with response_format, json_schema or grammar",
        ));
    }
    let legacy_functions = field(o, "functions").is_some();
    Ok(ChatRequest {
        params,
        messages,
        template_kwargs,
        tools,
        tools_for_template,
        tool_choice,
        parallel_tool_calls: boolean(o, "parallel_tool_calls")?.unwrap_or(true),
        legacy_functions,
        images,
    })
}

pub fn parse_completion(o: &Map<String, Value>) -> Result<CompletionRequest, ApiError> {
    let params = parse_params(o)?;
    let bad = || {
        ApiError::invalid_field(
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
    let prompt = match field(o, "prompt") {
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Object(p)) => multimodal_prompt(p)?,
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => Prompt::Tokens(tokens(a)?),
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => Prompt::Text(s.clone()),
            Value::Array(t) => Prompt::Tokens(tokens(t)?),
            _ => return Err(bad()),
        },
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid_field(
                "prompt",
                "only one prompt per request is supported",
            ))
        }
        None => return Err(ApiError::invalid_field("prompt", "'prompt' is required")),
        Some(_) => return Err(bad()),
    };
    if boolean(o, "echo")? == Some(true) {
        return Err(ApiError::invalid_field("echo", "echo is not supported"));
    }
    Ok(CompletionRequest { params, prompt })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn chat_fields_map_to_sampler_and_budget() {
        let r = parse_chat(&obj(json!({
            "model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "seed": 9,
            "stop": "END", "presence_penalty": 0.5, "frequency_penalty": -0.5, "stream": true,
            "stream_options": {"include_usage": true}, "chat_template_kwargs": {"enable_thinking": false}, "user": "ignored"
        })))
        .unwrap();
        assert_eq!(r.messages[1].content, "ab");
        let p = &r.params;
        assert_eq!(
            (
                p.n_predict,
                p.sampler.temperature,
                p.sampler.top_p,
                p.sampler.top_k,
                p.sampler.seed
            ),
            (Some(7), 0.0, 0.5, 3, 9)
        );
        assert_eq!(
            (
                p.sampler.min_p,
                p.sampler.presence_penalty,
                p.sampler.frequency_penalty
            ),
            (0.1, 0.5, -0.5)
        );
        assert_eq!(p.stop, vec!["END".to_string()]);
        assert!(p.stream && p.include_usage);
        assert_eq!(r.template_kwargs["enable_thinking"], false);
    }

    #[test]
    fn wrong_fields_name_themselves() {
        let cases = [
            (json!({"messages": "hi"}), "messages"),
            (json!({"messages": []}), "messages"),
            (
                json!({"messages": [{"role": "wizard", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"messages": [{"role": "user", "content": 5}]}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                "messages[0].content[0]",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
                "temperature",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "top_p": 2}),
                "top_p",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}),
                "max_tokens",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}),
                "max_tokens",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "stop": [1]}),
                "stop",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "n": 2}),
                "n",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}),
                "stream",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []}),
                "chat_template_kwargs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "n_probs": "lots"}),
                "n_probs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "n_probs": {"a": 1}}),
                "n_probs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "n_probs": -5}),
                "n_probs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "n_probs": 50}),
                "n_probs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logprobs": 21}),
                "logprobs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}),
                "logprobs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
                "top_logprobs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}),
                "top_logprobs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "mirostat": 2}),
                "mirostat",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "dry_multiplier": 0.8}),
                "dry_multiplier",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "xtc_probability": 0.5}),
                "xtc_probability",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "typical_p": 0.9}),
                "typical_p",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "samplers": ["top_k"]}),
                "samplers",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "best_of": 3}),
                "best_of",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}),
                "response_format",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}),
                "response_format",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}, "grammar": "root ::= \"a\""}),
                "grammar",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "grammar": 5}),
                "grammar",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"12": "x"}}),
                "logit_bias",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logit_bias": [[1]]}),
                "logit_bias",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "reasoning_format": "xml"}),
                "reasoning_format",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "json_schema": {}}),
                "tool_choice",
            ),
        ];
        for (body, param) in cases {
            let e = parse_chat(&obj(body.clone())).expect_err(&body.to_string());
            assert_eq!(e.status.as_u16(), 400);
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
        // Values that turn a sampler off are fine: clients send them all.
        for ok in [
            json!({"n_probs": 0}),
            json!({"n_probs": null}),
            json!({"logprobs": false}),
            json!({"logprobs": 0}),
            json!({"mirostat": 0, "mirostat_tau": 5, "mirostat_eta": 0.1, "typical_p": 1,
                   "dry_multiplier": 0, "dry_base": 1.75, "xtc_probability": 0, "xtc_threshold": 0.1,
                   "top_n_sigma": -1, "dynatemp_range": 0, "min_keep": 0, "samplers": []}),
        ] {
            assert!(parse_params(&obj(ok.clone())).is_ok(), "{ok}");
        }
        assert!(parse_json(b"{not json").is_err());
        assert!(parse_json(b"[1]").is_err());
    }

    #[test]
    fn logprobs_grammars_and_bias_in_every_spelling() {
        let p = |v: Value| parse_params(&obj(v)).unwrap();
        assert_eq!(p(json!({"logprobs": true})).logprobs, Some(0));
        assert_eq!(
            p(json!({"logprobs": true, "top_logprobs": 5})).logprobs,
            Some(5)
        );
        assert_eq!(p(json!({"logprobs": 3})).logprobs, Some(3));
        assert_eq!(p(json!({"n_probs": 4})).logprobs, Some(4));
        assert_eq!(p(json!({})).logprobs, None);
        assert_eq!(
            p(json!({"response_format": {"type": "json_object"}})).grammar,
            Some(GrammarSource::JsonObject)
        );
        assert_eq!(
            p(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}, "strict": true}}})).grammar,
            Some(GrammarSource::JsonSchema(json!({"type": "integer"})))
        );
        assert_eq!(
            p(json!({"response_format": {"type": "json_object", "schema": {"type": "string"}}}))
                .grammar,
            Some(GrammarSource::JsonSchema(json!({"type": "string"})))
        );
        assert_eq!(
            p(json!({"json_schema": {"type": "array"}})).grammar,
            Some(GrammarSource::JsonSchema(json!({"type": "array"})))
        );
        assert_eq!(
            p(json!({"grammar": "root ::= \"x\""})).grammar,
            Some(GrammarSource::Grammar("root ::= \"x\"".into()))
        );
        assert_eq!(
            p(json!({"response_format": {"type": "text"}})).grammar,
            None
        );
        assert_eq!(
            p(json!({"logit_bias": {"15": -100, "Hello": 5.5, "7": false, "9": 300}})).logit_bias,
            vec![
                (BiasKey::Id(15), -100.0),
                (BiasKey::Text("Hello".into()), 5.5),
                (BiasKey::Id(7), f32::NEG_INFINITY),
                (BiasKey::Id(9), 100.0),
            ]
        );
        assert_eq!(
            p(json!({"logit_bias": [[15, -1], ["hi", 2]]})).logit_bias,
            vec![(BiasKey::Id(15), -1.0), (BiasKey::Text("hi".into()), 2.0)]
        );
        assert_eq!(
            p(json!({"reasoning_format": "none"})).reasoning,
            Some(ReasoningFormat::None)
        );
        assert_eq!(
            p(json!({"reasoning_format": "deepseek"})).reasoning,
            Some(ReasoningFormat::Deepseek)
        );
    }

    #[test]
    fn tool_fields_and_legacy_functions() {
        let r = parse_chat(&obj(json!({
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "21"}]}
            ],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": false
        })))
        .unwrap();
        assert_eq!(r.tool_choice, ToolChoice::Named("get_weather".into()));
        assert!(!r.parallel_tool_calls && !r.legacy_functions);
        let calls = r.messages[1].tool_calls.as_ref().unwrap();
        assert_eq!(calls[0]["function"]["arguments"], json!({"city": "Paris"}));
        assert_eq!(r.messages[2].tool_call_id.as_deref(), Some("c1"));
        assert_eq!(r.messages[2].content, "21");
        let r = parse_chat(&obj(json!({
            "messages": [{"role": "assistant", "content": null, "function_call": {"name": "f", "arguments": "{}"}}],
            "functions": [{"name": "f"}],
            "function_call": "auto"
        })))
        .unwrap();
        assert!(r.legacy_functions);
        assert_eq!(r.tool_choice, ToolChoice::Auto);
        assert_eq!(
            r.messages[0].tool_calls.as_ref().unwrap()[0]["function"]["name"],
            "f"
        );
    }

    /// http(s) image URLs are kept for the handler to fetch (or refuse); other schemes and
    /// relative URLs are refused while parsing, naming the field.
    #[test]
    fn image_urls_are_kept_for_fetching_and_other_schemes_refused() {
        let field = "messages[0].content[1].image_url.url";
        let remote = |u: &str| {
            image_from_url(u, field)
                .unwrap()
                .remote_url()
                .map(String::from)
        };
        assert_eq!(
            remote("http://127.0.0.1:8000/a.png").as_deref(),
            Some("http://127.0.0.1:8000/a.png")
        );
        // Schemes and hosts are case-insensitive.
        assert_eq!(
            remote("HTTPS://Example.COM/b.jpg?x=1").as_deref(),
            Some("https://example.com/b.jpg?x=1")
        );
        let inline = image_from_url("DATA:image/png;base64,iVBORw==", field).unwrap();
        assert_eq!(inline.bytes().unwrap(), &[0x89, b'P', b'N', b'G'][..]);
        for (url, words) in [
            ("ftp://example.com/a.png", "'ftp:'"),
            ("file:///etc/passwd", "'file:'"),
            ("gopher://example.com/", "only http:// and https://"),
            ("/images/a.png", "a data URI or an http(s) URL"),
            ("cat.png", "a data URI or an http(s) URL"),
            ("http://", "not a valid URL"),
            ("https://exa mple.com/a.png", "not a valid URL"),
        ] {
            let e = image_from_url(url, field).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{url}");
            assert_eq!(e.param.as_deref(), Some(field), "{url}");
            assert!(e.message.starts_with(field), "{url}: {}", e.message);
            assert!(e.message.contains(words), "{url}: {}", e.message);
        }
        let r = parse_chat(&obj(json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Compare"},
            {"type": "image_url", "image_url": {"url": "https://example.com/b.jpg"}},
            {"type": "image_url", "image_url": "data:image/png;base64,iVBORw=="},
        ]}]})))
        .unwrap();
        assert_eq!(r.images.len(), 2);
        assert_eq!(r.images[0].remote_url(), Some("https://example.com/b.jpg"));
        assert_eq!(r.images[0].field, field);
        assert_eq!(r.images[1].field, "messages[0].content[2].image_url.url");
        // An image still behind its URL has no bytes: preparing it would be the server's bug.
        let e = r.images[0].bytes().unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::INTERNAL_SERVER_ERROR);
        assert!(r.images[1].bytes().is_ok());
    }

    #[test]
    fn unknown_fields_are_named_once() {
        let o = obj(json!({"model": "m", "zz_unknown_field_a": 1, "metadata": {}}));
        let first = unknown_fields(&o);
        assert!(
            first.contains(&"zz_unknown_field_a".to_string()),
            "{first:?}"
        );
        assert!(!first.contains(&"model".to_string()));
        assert!(unknown_fields(&o).iter().all(|f| f != "zz_unknown_field_a"));
    }

    #[test]
    fn completion_prompts_in_every_shape() {
        let p = |v: Value| parse_completion(&obj(json!({"prompt": v}))).map(|r| r.prompt);
        assert_eq!(p(json!("hi")).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!([1, 2])).unwrap(), Prompt::Tokens(vec![1, 2]));
        assert_eq!(p(json!(["hi"])).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!([[3]])).unwrap(), Prompt::Tokens(vec![3]));
        assert!(p(json!(["a", "b"])).is_err());
        assert!(p(json!([-1])).is_err());
        assert!(p(json!(3)).is_err());
        assert!(parse_completion(&obj(json!({}))).is_err());
    }

    #[test]
    fn unseeded_requests_get_distinct_seeds() {
        let a = parse_params(&Map::new()).unwrap().sampler.seed;
        let b = parse_params(&Map::new()).unwrap().sampler.seed;
        assert_ne!(a, b);
        assert_eq!(
            parse_params(&obj(json!({"max_tokens": -1})))
                .unwrap()
                .n_predict,
            None
        );
    }
}
