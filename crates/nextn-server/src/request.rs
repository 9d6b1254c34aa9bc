//! OpenAI request bodies, checked field by field so a wrong field gets a 400 naming it.
//! Unknown fields are ignored (clients send `user`, `metadata`, ...).

use nextn_engine::chat::ChatMessage;
use nextn_engine::sampler::SamplerConfig;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// Stop strings a request may give, and how long each may be.
const MAX_STOPS: usize = 16;
const MAX_STOP_LEN: usize = 1024;

/// What both endpoints share: sampling, budget, stopping, streaming.
#[derive(Clone, Debug, PartialEq)]
pub struct GenParams {
    pub model: Option<String>,
    pub n_predict: Option<usize>,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    pub params: GenParams,
    pub messages: Vec<ChatMessage>,
    pub template_kwargs: Map<String, Value>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
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
    // Chat sends `logprobs: true`, legacy completions a count; either asks for what is not
    // supported, and so does llama-server's `n_probs`.
    match field(o, "logprobs") {
        None | Some(Value::Bool(false)) => {}
        Some(Value::Bool(true)) => {
            return Err(ApiError::invalid_field(
                "logprobs",
                "logprobs are not supported",
            ))
        }
        Some(_) => match integer(o, "logprobs")? {
            Some(0) => {}
            _ => {
                return Err(ApiError::invalid_field(
                    "logprobs",
                    "logprobs are not supported",
                ))
            }
        },
    }
    if field(o, "top_logprobs").is_some() {
        return Err(ApiError::invalid_field(
            "top_logprobs",
            "logprobs are not supported",
        ));
    }
    match integer(o, "n_probs")? {
        None | Some(0) => {}
        Some(n) if n < 0 => {
            return Err(ApiError::invalid_field(
                "n_probs",
                format!("'n_probs' must be at least 0, got {n}"),
            ))
        }
        Some(_) => {
            return Err(ApiError::invalid_field(
                "n_probs",
                "token probabilities (n_probs) are not supported",
            ))
        }
    }
    if field(o, "tools")
        .and_then(Value::as_array)
        .is_some_and(|a| !a.is_empty())
    {
        return Err(ApiError::invalid_field(
            "tools",
            "tool calls are not supported yet",
        ));
    }
    if let Some(rf) = field(o, "response_format") {
        let ty = rf.get("type").and_then(Value::as_str);
        if ty != Some("text") {
            return Err(ApiError::invalid_field(
                "response_format",
                "only response_format {\"type\": \"text\"} is supported",
            ));
        }
    }
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
        stop,
        ignore_eos: boolean(o, "ignore_eos")?.unwrap_or(false),
        stream: boolean(o, "stream")?.unwrap_or(false),
        include_usage,
    })
}

/// Message content: a string, null, or an array of `{"type": "text", "text": ...}` parts.
fn content(v: Option<&Value>, at: usize) -> Result<String, ApiError> {
    let param = format!("messages[{at}].content");
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
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
        messages.push(ChatMessage {
            role,
            content: content(m.get("content"), i)?,
            reasoning_content: text_of("reasoning_content")?,
            tool_calls: m.get("tool_calls").filter(|v| !v.is_null()).cloned(),
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
    Ok(ChatRequest {
        params,
        messages,
        template_kwargs,
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
                "messages[0].content",
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
                json!({"messages": [{"role": "user", "content": "x"}], "n_probs": 5}),
                "n_probs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true}),
                "logprobs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logprobs": 5}),
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
        ];
        for (body, param) in cases {
            let e = parse_chat(&obj(body.clone())).expect_err(&body.to_string());
            assert_eq!(e.status.as_u16(), 400);
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
        // Asking for none of what is unsupported is fine.
        for ok in [
            json!({"n_probs": 0}),
            json!({"n_probs": null}),
            json!({"logprobs": false}),
            json!({"logprobs": 0}),
        ] {
            assert!(parse_params(&obj(ok.clone())).is_ok(), "{ok}");
        }
        assert!(parse_json(b"{not json").is_err());
        assert!(parse_json(b"[1]").is_err());
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
