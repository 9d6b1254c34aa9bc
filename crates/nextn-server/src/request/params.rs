//! What every generating request shares: sampling, the token budget, stopping, streaming,
//! log probabilities, the output format and reasoning, read from whichever API's fields carry
//! them ([`Fields`] maps the names). A known field that asks for something not implemented
//! (mirostat, DRY, XTC, ...) is refused with a 400 naming it, unless its value is the one that
//! turns it off.

use nextn_engine::grammar::GrammarSource;
use nextn_engine::sampler::SamplerConfig;
use serde_json::Value;

use super::fields::Fields;
use crate::error::ApiError;
use crate::ReasoningFormat;

/// Stop strings a request may give, and how long each may be.
const MAX_STOPS: usize = 16;
const MAX_STOP_LEN: usize = 1024;

/// Top alternatives a request may ask for per token.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A `logit_bias` key: a token id, or a text whose tokens all get the bias (llama-server).
#[derive(Clone, Debug, PartialEq)]
pub enum BiasKey {
    Id(u64),
    Text(String),
}

/// What every generating endpoint shares: sampling, budget, stopping, streaming, output format.
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
    /// `response_format` json_object / json_schema, llama.cpp's `json_schema` or `grammar`
    /// (Responses' `text.format`), and the field it came from, as the client names it.
    pub grammar: Option<GrammarSource>,
    pub grammar_field: String,
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
    /// `return_tokens`: the generated token ids go into the answer.
    pub return_tokens: bool,
    /// `forced_acceptance_reference`: the plain output this request's drafts are steered
    /// towards on a server started with `--force-acceptance` (measurement only).
    pub forced_reference: Option<Vec<u32>>,
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

pub(crate) fn parse_params(f: &Fields) -> Result<GenParams, ApiError> {
    let model = f.string("model")?.map(str::to_string);
    let mut n_predict = None;
    for name in ["n_predict", "max_tokens", "max_completion_tokens"] {
        match f.integer(name)? {
            None | Some(-1) => {}
            Some(n) if n < 0 => {
                return Err(f.bad(
                    name,
                    format!(
                        "'{}' must be at least 0 (or -1 for no limit), got {n}",
                        f.path(name)
                    ),
                ))
            }
            Some(n) => n_predict = Some(usize::try_from(n).unwrap_or(usize::MAX)),
        }
    }
    let mut s = SamplerConfig::default();
    if let Some(t) = f.ranged("temperature", 0.0, 100.0)? {
        s.temperature = t;
    }
    if let Some(p) = f.ranged("top_p", 0.0, 1.0)? {
        s.top_p = p;
    }
    if let Some(p) = f.ranged("min_p", 0.0, 1.0)? {
        s.min_p = p;
    }
    if let Some(k) = f.integer("top_k")? {
        // llama.cpp: top_k <= 0 turns it off.
        s.top_k = usize::try_from(k).unwrap_or(0);
    }
    if let Some(p) = f.ranged("presence_penalty", -2.0, 2.0)? {
        s.presence_penalty = p;
    }
    if let Some(p) = f.ranged("frequency_penalty", -2.0, 2.0)? {
        s.frequency_penalty = p;
    }
    if let Some(p) = f.ranged("repeat_penalty", 0.0, 100.0)? {
        if p <= 0.0 {
            return Err(f.bad(
                "repeat_penalty",
                format!("'{}' must be greater than 0", f.path("repeat_penalty")),
            ));
        }
        s.repeat_penalty = p;
    }
    if let Some(n) = f.integer("repeat_last_n")? {
        if !(0..=1 << 20).contains(&n) {
            return Err(f.bad(
                "repeat_last_n",
                format!(
                    "'{}' must be between 0 and 1048576",
                    f.path("repeat_last_n")
                ),
            ));
        }
        s.repeat_last_n = n as usize;
    }
    s.seed = match f.integer("seed")? {
        Some(n) if n >= 0 => n as u64,
        _ => fresh_seed(),
    };
    let stop = parse_stop(f)?;
    if let Some(n) = f.integer("n")? {
        if n != 1 {
            return Err(f.bad("n", "only n = 1 is supported"));
        }
    }
    if let Some(n) = f.integer("best_of")? {
        if n != 1 {
            return Err(f.bad("best_of", "only best_of = 1 is supported"));
        }
    }
    refuse_unsupported(f)?;
    let logprobs = parse_logprobs(f)?;
    let (grammar, grammar_field) = match parse_grammar(f)? {
        Some((g, field)) => (Some(g), field),
        None => (None, f.path("grammar")),
    };
    let logit_bias = parse_logit_bias(f)?;
    let reasoning = match f.string("reasoning_format")? {
        None => None,
        Some("none") => Some(ReasoningFormat::None),
        Some("deepseek" | "auto" | "deepseek-legacy") => Some(ReasoningFormat::Deepseek),
        Some(other) => {
            return Err(f.bad(
                "reasoning_format",
                format!(
                    "'{}' '{other}' must be \"none\", \"auto\" or \"deepseek\"",
                    f.path("reasoning_format")
                ),
            ))
        }
    };
    let reasoning_budget = match f.integer("thinking_budget_tokens")? {
        None => None,
        Some(-1) => Some(None),
        Some(n) if n >= 0 => Some(Some(usize::try_from(n).unwrap_or(usize::MAX))),
        Some(n) => {
            return Err(f.bad(
                "thinking_budget_tokens",
                format!(
                    "'{}' must be -1 (no cap) or at least 0, got {n}",
                    f.path("thinking_budget_tokens")
                ),
            ))
        }
    };
    let include_usage = match f.object("stream_options")? {
        None => false,
        Some(so) => {
            let at = f.path("stream_options");
            Fields::nested(so, &at)
                .boolean("include_usage")?
                .unwrap_or(false)
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
        ignore_eos: f.boolean("ignore_eos")?.unwrap_or(false),
        stream: f.boolean("stream")?.unwrap_or(false),
        include_usage,
        logprobs,
        grammar,
        grammar_field,
        reasoning,
        reasoning_budget,
        cache_prompt: f.boolean("cache_prompt")?.unwrap_or(true),
        return_progress: f.boolean("return_progress")?.unwrap_or(false),
        return_tokens: f.boolean("return_tokens")?.unwrap_or(false),
        forced_reference: token_ids(f, "forced_acceptance_reference")?,
    })
}

/// `stop`: a string or an array of strings, within [`MAX_STOPS`] and [`MAX_STOP_LEN`].
fn parse_stop(f: &Fields) -> Result<Vec<String>, ApiError> {
    let bad = || {
        f.bad(
            "stop",
            format!(
                "'{}' must be a string or an array of strings",
                f.path("stop")
            ),
        )
    };
    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(x)) => vec![x.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string).ok_or_else(bad))
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(bad()),
    };
    if stop.len() > MAX_STOPS || stop.iter().any(|x| x.len() > MAX_STOP_LEN) {
        return Err(f.bad(
            "stop",
            format!("at most {MAX_STOPS} stop strings of at most {MAX_STOP_LEN} bytes each"),
        ));
    }
    Ok(stop)
}

/// An array of token ids (non-negative integers below 2³²).
fn token_ids(f: &Fields, name: &str) -> Result<Option<Vec<u32>>, ApiError> {
    let Some(v) = f.get(name) else {
        return Ok(None);
    };
    let bad = || {
        f.bad(
            name,
            format!("'{}' must be an array of token ids", f.path(name)),
        )
    };
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
fn refuse_unsupported(f: &Fields) -> Result<(), ApiError> {
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
        if let Some(v) = f.number(name)? {
            // top-n-sigma is off at any value <= 0 in llama.cpp.
            let is_off = v == off || (name == "top_n_sigma" && v <= 0.0);
            if !is_off {
                return Err(f.bad(
                    name,
                    format!("'{name}' is not supported (only {off}, which turns it off)"),
                ));
            }
        }
    }
    if let Some(n) = f.integer("min_keep")? {
        if n > 1 {
            return Err(f.bad("min_keep", "'min_keep' is not supported (only 0 or 1)"));
        }
    }
    for name in ["samplers", "lora"] {
        if f.get(name)
            .is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty()))
        {
            return Err(f.bad(name, format!("'{name}' is not supported")));
        }
    }
    if f.boolean("post_sampling_probs")? == Some(true) {
        return Err(f.bad(
            "post_sampling_probs",
            "'post_sampling_probs' is not supported: log probabilities are the model's own",
        ));
    }
    if f.get("suffix")
        .is_some_and(|v| v.as_str().is_none_or(|s| !s.is_empty()))
    {
        return Err(f.bad("suffix", "'suffix' (text insertion) is not supported"));
    }
    Ok(())
}

/// Chat: `logprobs: true` with `top_logprobs` 0-20; completions: `logprobs` as the number of
/// alternatives; llama.cpp: `n_probs`.
fn parse_logprobs(f: &Fields) -> Result<Option<usize>, ApiError> {
    let top = |name: &str, n: Option<i64>| -> Result<usize, ApiError> {
        match n {
            None => Ok(0),
            Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Ok(n as usize),
            Some(n) => Err(f.bad(
                name,
                format!(
                    "'{}' must be between 0 and {MAX_TOP_LOGPROBS}, got {n}",
                    f.path(name)
                ),
            )),
        }
    };
    let mut wanted = match f.get("logprobs") {
        None | Some(Value::Bool(false)) => None,
        Some(Value::Bool(true)) => Some(top("top_logprobs", f.integer("top_logprobs")?)?),
        Some(_) => match f.integer("logprobs")? {
            Some(0) | None => None,
            n => Some(top("logprobs", n)?),
        },
    };
    if wanted.is_none() && f.get("top_logprobs").is_some() {
        return Err(f.bad(
            "top_logprobs",
            format!("'{}' needs \"logprobs\": true", f.path("top_logprobs")),
        ));
    }
    match f.integer("n_probs")? {
        None | Some(0) => {}
        n => wanted = Some(top("n_probs", n)?.max(wanted.unwrap_or(0))),
    }
    Ok(wanted)
}

/// At most one of `response_format` (json_object / json_schema), `json_schema` and `grammar`,
/// with the field it came from.
fn parse_grammar(f: &Fields) -> Result<Option<(GrammarSource, String)>, ApiError> {
    let mut found: Vec<(String, GrammarSource)> = Vec::new();
    if let Some(rf) = f.get("response_format") {
        let at = f.path("response_format");
        let bad = |m: &str| f.bad("response_format", m.to_string());
        let Some(rf) = rf.as_object() else {
            return Err(bad(&format!("'{at}' must be an object")));
        };
        match rf.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object") => found.push((
                at.clone(),
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
                    Some(schema) => {
                        found.push((at.clone(), GrammarSource::JsonSchema(schema.clone())))
                    }
                    None => {
                        return Err(bad(&format!(
                        "'{at}' of type json_schema needs 'json_schema': {{\"schema\": {{...}}}}"
                    )))
                    }
                }
            }
            Some(other) => {
                return Err(bad(&format!(
                    "'{at}' type '{other}' must be \"text\", \"json_object\" or \"json_schema\""
                )))
            }
            None => return Err(bad(&format!("'{at}' needs a 'type'"))),
        }
    }
    match f.get("json_schema") {
        None => {}
        Some(schema @ (Value::Object(_) | Value::Bool(_))) => found.push((
            f.path("json_schema"),
            GrammarSource::JsonSchema(schema.clone()),
        )),
        Some(_) => return Err(f.bad("json_schema", "'json_schema' must be a JSON Schema object")),
    }
    match f.get("grammar") {
        None => {}
        Some(Value::String(g)) if g.trim().is_empty() => {}
        Some(Value::String(g)) => {
            found.push((f.path("grammar"), GrammarSource::Grammar(g.clone())))
        }
        Some(_) => {
            return Err(f.bad(
                "grammar",
                "'grammar' must be a string (a GBNF or Lark grammar)",
            ))
        }
    }
    if found.len() > 1 {
        return Err(ApiError::invalid_field(
            &found[1].0,
            format!(
                "give only one of response_format (JSON), json_schema and grammar: this request has '{}' and '{}'",
                found[0].0, found[1].0
            ),
        ));
    }
    Ok(found.pop().map(|(field, g)| (g, field)))
}

/// `logit_bias`: an object of token id (or text) to bias, or llama.cpp's `[[key, bias], ...]`;
/// a bias of `false` bans the token. Biases are clamped to [-100, 100] as OpenAI does.
fn parse_logit_bias(f: &Fields) -> Result<Vec<(BiasKey, f32)>, ApiError> {
    let bad = |m: String| f.bad("logit_bias", m);
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
    match f.get("logit_bias") {
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
