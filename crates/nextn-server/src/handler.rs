//! What every endpoint handler shares: the server state it is handed, the request body it reads,
//! the loaded frontend it needs, the JSON it answers with, the blocking threads that parse, render
//! and tokenize, and the one way a chat-shaped request goes from its body to what the scheduler
//! runs ([`chat_pipeline`]).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use nextn_engine::scheduler::Phase;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::image_url::fetch_images;
use crate::request::images::check_image_count;
use crate::request::{parse_json, ChatRequest};
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

/// A body at least this large is parsed into a tree several times its size, freed once the
/// typed request is built; the allocator is then asked to hand those pages back.
const RELEASE_AFTER_BODY_BYTES: usize = 1 << 20;

/// Hand the pages the allocator keeps after freeing back to the OS. glibc keeps what a large
/// parse freed in the arena of the thread that parsed it, and with one arena a blocking thread,
/// requests of large bodies (a hostile client's hundred thousand unknown fields) would otherwise
/// raise the server's resident memory with every new thread that parses one.
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of the allocator's arenas to the OS.
    unsafe {
        libc::malloc_trim(0);
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

/// A chat-shaped request from its body to `finish`'s result: the body parsed into the typed
/// request by the API's `parse` off the async threads (with what else the API's answer needs),
/// its images counted against `--max-images`, its image URLs fetched on the async threads, and
/// `finish` (preparing it for the scheduler, or counting its tokens) off them again.
pub(crate) async fn chat_pipeline<X, P>(
    app: &AppState,
    body: Bytes,
    parse: impl FnOnce(&App, Map<String, Value>) -> Result<(ChatRequest, X), ApiError> + Send + 'static,
    finish: impl FnOnce(&App, &Frontend, ChatRequest) -> Result<P, ApiError> + Send + 'static,
) -> Result<(Arc<Frontend>, P, X), ApiError>
where
    X: Send + 'static,
    P: Send + 'static,
{
    let fe = frontend(app)?;
    let app2 = app.clone();
    let (mut req, extra) = blocking(move || {
        let large = body.len() >= RELEASE_AFTER_BODY_BYTES;
        let parsed = parse_json(&body).and_then(|o| parse(&app2, o));
        drop(body);
        if large {
            release_freed_memory();
        }
        parsed
    })
    .await?;
    check_image_count(&req.images, app.cfg.max_images)?;
    fetch_images(app, &fe, &mut req.images).await?;
    let (app2, fe2) = (app.clone(), fe.clone());
    let done = blocking(move || finish(&app2, &fe2, req)).await?;
    Ok((fe, done, extra))
}
