//! llama-server's own endpoints besides the OpenAI ones, in its request and response shapes:
//! `/tokenize`, `/detokenize`, `/apply-template`, `/props`.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::handler::{body_error, frontend, json_response, AppState};
use crate::prepare::render_chat;
use crate::request::{flag, parse_chat, parse_json};

fn answer(r: Result<Value, ApiError>) -> Response {
    match r {
        Ok(v) => json_response(StatusCode::OK, v),
        Err(e) => e.into_response(),
    }
}

fn body_json(body: Result<Bytes, BytesRejection>) -> Result<Map<String, Value>, ApiError> {
    parse_json(&body.map_err(body_error)?)
}

/// `POST /tokenize {"content", "add_special", "parse_special", "with_pieces"}` →
/// `{"tokens": [id, ...]}`, or with pieces `{"tokens": [{"id", "piece"}, ...]}` where a piece
/// that is not whole UTF-8 is given as its bytes.
pub(crate) async fn tokenize(
    State(app): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer((|| {
        let fe = frontend(&app)?;
        let o = body_json(body)?;
        let add_special = flag(&o, "add_special", false)?;
        let parse_special = flag(&o, "parse_special", true)?;
        let with_pieces = flag(&o, "with_pieces", false)?;
        let content = match o.get("content") {
            None => return Ok(json!({"tokens": []})),
            Some(Value::String(s)) => s.clone(),
            Some(_) => {
                return Err(ApiError::invalid_field(
                    "content",
                    "'content' must be a string",
                ))
            }
        };
        let tok = &fe.tokenizer;
        let mut ids = tok.encode(&content, parse_special);
        if tok.adds_bos() && !add_special && !ids.is_empty() && Some(ids[0]) == tok.bos() {
            ids.remove(0);
        }
        if !with_pieces {
            return Ok(json!({"tokens": ids}));
        }
        let tokens: Vec<Value> = ids
            .iter()
            .map(|&id| {
                let bytes = tok.token_bytes(id);
                let piece = match std::str::from_utf8(bytes) {
                    Ok(s) => json!(s),
                    Err(_) => json!(bytes),
                };
                json!({"id": id, "piece": piece})
            })
            .collect();
        Ok(json!({"tokens": tokens}))
    })())
}

/// `POST /detokenize {"tokens": [id, ...]}` → `{"content": "..."}`.
pub(crate) async fn detokenize(
    State(app): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer((|| {
        let fe = frontend(&app)?;
        let o = body_json(body)?;
        let bad = || ApiError::invalid_field("tokens", "'tokens' must be an array of token ids");
        let ids: Vec<u32> = match o.get("tokens") {
            None => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(bad)
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(bad()),
        };
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= fe.n_vocab) {
            return Err(ApiError::invalid_field(
                "tokens",
                format!(
                    "token id {id} is out of range: the vocabulary has {} tokens",
                    fe.n_vocab
                ),
            ));
        }
        Ok(json!({"content": fe.tokenizer.decode(&ids)}))
    })())
}

/// `POST /apply-template` with a chat request body → `{"prompt": "..."}`: the text the chat
/// endpoint would run (tools and `chat_template_kwargs` included).
pub(crate) async fn apply_template(
    State(app): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer((|| {
        let fe = frontend(&app)?;
        let o = body_json(body)?;
        let req = parse_chat(&o, None)?;
        // The template renders an image as its placeholder: nothing needs fetching, but a URL a
        // generating request would refuse is refused here too.
        crate::image_url::check_allowed(&app, &req.images)?;
        let prompt = render_chat(&app, &fe, &req)?;
        Ok(json!({"prompt": prompt}))
    })())
}

/// `GET /props`: the generation defaults, slots, chat template and special tokens, as
/// llama-server describes itself, plus the speculative settings under `speculative`.
pub(crate) async fn props(State(app): State<AppState>) -> Response {
    answer((|| {
        let fe = frontend(&app)?;
        let info = app
            .handle
            .info()
            .ok_or_else(|| ApiError::unavailable("Loading model"))?;
        let d = &app.cfg.request_defaults;
        let get = |k: &str, default: Value| d.get(k).cloned().unwrap_or(default);
        let tok = &fe.tokenizer;
        let piece = |id: Option<u32>| id.map(|i| tok.decode(&[i])).unwrap_or_default();
        Ok(json!({
            "default_generation_settings": {
                "n_ctx": info.n_ctx_slot,
                "params": {
                    "n_predict": get("n_predict", json!(-1)),
                    "seed": get("seed", json!(-1)),
                    "temperature": get("temperature", json!(0.8)),
                    "top_k": get("top_k", json!(40)),
                    "top_p": get("top_p", json!(0.95)),
                    "min_p": get("min_p", json!(0.05)),
                    "repeat_last_n": get("repeat_last_n", json!(64)),
                    "repeat_penalty": get("repeat_penalty", json!(1.0)),
                    "presence_penalty": get("presence_penalty", json!(0.0)),
                    "frequency_penalty": get("frequency_penalty", json!(0.0)),
                    "logit_bias": get("logit_bias", json!([])),
                    "ignore_eos": false,
                    "stream": false,
                    "n_probs": 0,
                    "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
                    "speculative.n_max": info.n_draft_max,
                },
            },
            "total_slots": info.n_slots,
            "model_alias": app.cfg.model_id,
            "model_path": app.cfg.model_path,
            "modalities": {"vision": fe.vision.is_some(), "audio": false},
            "endpoint_slots": true,
            "endpoint_props": false,
            "endpoint_metrics": true,
            "chat_template": fe.template.source(),
            "bos_token": piece(tok.bos()),
            "eos_token": piece(tok.eos()),
            "build_info": concat!("nextn ", env!("CARGO_PKG_VERSION")),
            "is_sleeping": false,
            "speculative": {
                "type": if info.speculative { "nextn" } else { "none" },
                "n_max": info.n_draft_max,
                "calibration": info.calibration,
            },
        }))
    })())
}
