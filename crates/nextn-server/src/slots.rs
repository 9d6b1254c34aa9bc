//! `GET /slots` and `POST /slots/{id}?action=save|restore|erase`, in llama-server's shapes.
//!
//! A slot file holds the state a slot kept from its last request (attention rows, recurrent
//! states, the NextN head's state and the tokens), written under `--slot-save-path` by name.

use std::path::Path;
use std::sync::mpsc::Receiver;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path as UrlPath, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use nextn_engine::scheduler::{SlotAction, SlotActionDone, SlotActionError, SubmitError};
use nextn_engine::slot_file::write_atomically;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::handler::{json_response, AppState};
use crate::submit::submit_error;

/// `GET /slots`: every slot, busy or free, and the context it holds. With `fail_on_no_slot=1`,
/// 503 when no slot is free (llama-server's readiness probe for a load balancer).
pub(crate) async fn list(State(app): State<AppState>, uri: Uri) -> Response {
    let Some(info) = app.handle.info() else {
        return ApiError::unavailable("Loading model").into_response();
    };
    let slots = app.handle.metrics().slots;
    let fail_on_no_slot = query(&uri, "fail_on_no_slot").is_some_and(|v| v == "1" || v == "true");
    if fail_on_no_slot && slots.iter().all(|s| s.is_processing) {
        return ApiError::unavailable("no slot available").into_response();
    }
    let list: Vec<Value> = slots
        .iter()
        .map(|s| {
            json!({
                "id": s.id,
                "n_ctx": s.n_ctx,
                "speculative": info.speculative,
                "is_processing": s.is_processing,
                "n_past": s.n_past,
                "n_prompt_tokens": s.n_prompt_tokens,
                "n_prompt_tokens_processed": s.n_prompt_tokens - s.n_prompt_tokens_cache,
                "n_prompt_tokens_cache": s.n_prompt_tokens_cache,
                "next_token": [{"n_decoded": s.n_decoded}],
            })
        })
        .collect();
    json_response(StatusCode::OK, Value::Array(list))
}

/// `POST /slots/{id}?action=...` with `{"filename": "..."}` for save and restore.
pub(crate) async fn action(
    State(app): State<AppState>,
    UrlPath(id): UrlPath<String>,
    uri: Uri,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    action_inner(app, &id, &uri, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn action_inner(
    app: AppState,
    id: &str,
    uri: &Uri,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let Some(dir) = app.cfg.slot_save_path.clone() else {
        return Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "not_supported_error",
            "this server does not support slot actions: start it with --slot-save-path DIR",
        ));
    };
    let slot: usize = id
        .parse()
        .map_err(|_| ApiError::bad_request(format!("invalid slot id '{id}': expected a number")))?;
    let action = query(uri, "action").unwrap_or_default();
    match action.as_str() {
        "save" | "restore" => {}
        "erase" => {
            let done = run(&app, slot, SlotAction::Erase).await?;
            let SlotActionDone::Erased { n_tokens } = done else {
                return Err(ApiError::internal("the slot answered another action"));
            };
            return Ok(json_response(
                StatusCode::OK,
                json!({"id_slot": slot, "n_erased": n_tokens}),
            ));
        }
        "" => {
            return Err(ApiError::invalid_field(
                "action",
                "the query needs action=save, action=restore or action=erase",
            ))
        }
        other => {
            return Err(ApiError::invalid_field(
                "action",
                format!("unknown slot action '{other}': expected save, restore or erase"),
            ))
        }
    }
    let body = body.map_err(crate::handler::body_error)?;
    let filename = filename(&body)?;
    let path = dir.join(&filename);
    let started = Instant::now();
    if action == "save" {
        let done = run(&app, slot, SlotAction::Save).await?;
        let SlotActionDone::Saved { bytes, n_tokens } = done else {
            return Err(ApiError::internal("the slot answered another action"));
        };
        let n_written = bytes.len();
        let target = path.clone();
        tokio::task::spawn_blocking(move || write_atomically(&target, &bytes))
            .await
            .map_err(|e| ApiError::internal(format!("the slot file writer failed: {e}")))?
            .map_err(|e| {
                ApiError::invalid_field(
                    "filename",
                    format!("cannot write the slot file {}: {e}", path.display()),
                )
            })?;
        return Ok(json_response(
            StatusCode::OK,
            json!({
                "id_slot": slot,
                "filename": filename,
                "n_saved": n_tokens,
                "n_written": n_written,
                "timings": {"save_ms": started.elapsed().as_secs_f64() * 1000.0},
            }),
        ));
    }
    let source = path.clone();
    let bytes = tokio::task::spawn_blocking(move || std::fs::read(&source))
        .await
        .map_err(|e| ApiError::internal(format!("the slot file reader failed: {e}")))?
        .map_err(|e| {
            let status = if e.kind() == std::io::ErrorKind::NotFound {
                StatusCode::NOT_FOUND
            } else {
                StatusCode::BAD_REQUEST
            };
            ApiError {
                param: Some("filename".into()),
                ..ApiError::new(
                    status,
                    "invalid_request_error",
                    format!("cannot read the slot file {}: {e}", path.display()),
                )
            }
        })?;
    let n_read = bytes.len();
    let done = run(&app, slot, SlotAction::Restore(bytes)).await?;
    let SlotActionDone::Restored { n_tokens } = done else {
        return Err(ApiError::internal("the slot answered another action"));
    };
    Ok(json_response(
        StatusCode::OK,
        json!({
            "id_slot": slot,
            "filename": filename,
            "n_restored": n_tokens,
            "n_read": n_read,
            "timings": {"restore_ms": started.elapsed().as_secs_f64() * 1000.0},
        }),
    ))
}

/// Queue the action and wait for the inference thread's answer (it runs once the slot is free).
async fn run(app: &AppState, slot: usize, action: SlotAction) -> Result<SlotActionDone, ApiError> {
    let answer: Receiver<_> = app.handle.slot_action(slot, action).map_err(submit_error)?;
    let result = tokio::task::spawn_blocking(move || answer.recv())
        .await
        .map_err(|e| ApiError::internal(format!("waiting for the slot failed: {e}")))?
        .map_err(|_| ApiError::unavailable("the inference engine stopped"))?;
    result.map_err(|e| match e {
        SlotActionError::NoSuchSlot { .. } | SlotActionError::File(_) => {
            ApiError::bad_request(e.to_string())
        }
        SlotActionError::Save { .. } => ApiError::internal(e.to_string()),
        SlotActionError::ShuttingDown => submit_error(SubmitError::ShuttingDown),
    })
}

/// The body's `filename`: a plain file name inside the save directory.
fn filename(body: &[u8]) -> Result<String, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    let name = match v.get("filename") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => {
            return Err(ApiError::invalid_field(
                "filename",
                "filename must be a string",
            ))
        }
        None => {
            return Err(ApiError::invalid_field(
                "filename",
                "the body needs {\"filename\": \"...\"}",
            ))
        }
    };
    if !valid_filename(&name) {
        return Err(ApiError::invalid_field(
            "filename",
            format!("invalid filename '{name}': a plain file name is needed, without a directory, '..' or control characters"),
        ));
    }
    Ok(name)
}

fn valid_filename(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name != "."
        && name != ".."
        && !name.starts_with('.')
        && !name
            .chars()
            .any(|c| c == '/' || c == '\\' || c == ':' || c.is_control())
}

/// The value of `key` in the URI's query string (the values used here need no decoding).
fn query(uri: &Uri, key: &str) -> Option<String> {
    uri.query()?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == key).then(|| v.to_string())
    })
}

/// Make sure the save directory exists and takes files; a clear error otherwise.
pub fn check_save_dir(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| {
        format!(
            "--slot-save-path {}: cannot create the directory: {e}",
            dir.display()
        )
    })?;
    let probe = dir.join(format!(".nextn-write-test-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| {
        format!(
            "--slot-save-path {}: the directory is not writable: {e}",
            dir.display()
        )
    })?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}
