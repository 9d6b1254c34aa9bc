//! Endpoints llama-server has that a generation model cannot serve: they answer 501 with a JSON
//! error saying why, instead of a bare 404 that reads as a wrong URL.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

fn not_served(what: &str) -> Response {
    ApiError::new(
        StatusCode::NOT_IMPLEMENTED,
        "not_supported_error",
        format!(
            "{what} are not served: nextn serves text generation with Qwen3.5 / Qwen3.6 models, which have no head for them (use a server with a model made for that)"
        ),
    )
    .into_response()
}

pub(crate) async fn embeddings() -> Response {
    not_served("embeddings")
}

pub(crate) async fn rerank() -> Response {
    not_served("reranking scores")
}

pub(crate) async fn transcriptions() -> Response {
    not_served("audio transcriptions")
}
