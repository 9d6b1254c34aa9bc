//! What every endpoint handler shares: the server state it is handed, the request body it reads,
//! the loaded frontend it needs, the JSON it answers with, the server's request defaults, and the
//! blocking threads that parse, render and tokenize.

use std::sync::Arc;

use axum::extract::rejection::BytesRejection;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use nextn_engine::scheduler::Phase;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::{App, Frontend};

pub(crate) type AppState = Arc<App>;

pub(crate) fn json_response(status: StatusCode, v: serde_json::Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json; charset=utf-8")],
        v.to_string(),
    )
        .into_response()
}

pub(crate) fn body_error(r: BytesRejection) -> ApiError {
    if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "the request body is too large",
        )
    } else {
        ApiError::new(
            r.status(),
            "invalid_request_error",
            format!("cannot read the request body: {}", r.body_text()),
        )
    }
}

pub(crate) fn frontend(app: &App) -> Result<Arc<Frontend>, ApiError> {
    match (app.handle.phase(), app.frontend.get()) {
        (Phase::Ready, Some(f)) => Ok(f.clone()),
        (Phase::Loading, _) | (Phase::Ready, None) => Err(ApiError::unavailable("Loading model")),
        _ => Err(ApiError::unavailable("the server is shutting down")),
    }
}

/// Fill in the fields a request leaves out from the server's command line (`--temp`, `-n`, ...).
/// The token budget goes in as `n_predict`, which `max_tokens` and `max_completion_tokens` override.
pub(crate) fn with_server_defaults(app: &App, o: &mut Map<String, Value>) {
    for (k, v) in &app.cfg.request_defaults {
        o.entry(k.clone()).or_insert_with(|| v.clone());
    }
}

/// The text/JSON parts of a request that run off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("request preparation failed: {e}")))?
}
