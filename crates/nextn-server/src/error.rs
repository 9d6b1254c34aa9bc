//! OpenAI-style error bodies: `{"error": {"code", "message", "type", "param"}}` with the HTTP
//! status in `code`, as llama-server and the OpenAI API answer.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<Box<str>>,
    /// Extra fields next to `message` (llama-server adds `n_prompt_tokens` / `n_ctx`).
    pub extra: Option<Box<Value>>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            extra: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// A request field with a wrong type or value.
    pub fn invalid_field(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.into()),
            ..ApiError::bad_request(message)
        }
    }

    pub fn unauthorized() -> Self {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "Invalid API Key",
        )
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, "not_found_error", message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable_error",
            message,
        )
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn body(&self) -> Value {
        let mut error = json!({
            "code": self.status.as_u16(),
            "message": self.message,
            "type": self.kind,
            "param": self.param,
        });
        if let (Some(Value::Object(extra)), Value::Object(e)) = (self.extra.as_deref(), &mut error)
        {
            for (k, v) in extra {
                e.insert(k.clone(), v.clone());
            }
        }
        json!({ "error": error })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body().to_string();
        let mut r = (
            self.status,
            [(header::CONTENT_TYPE, "application/json; charset=utf-8")],
            body,
        )
            .into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_openai_shape_with_extras() {
        let mut e = ApiError::invalid_field("temperature", "temperature must be a number");
        e.extra = Some(Box::new(json!({"n_ctx": 16})));
        let b = e.body();
        assert_eq!(b["error"]["code"], 400);
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["param"], "temperature");
        assert_eq!(b["error"]["n_ctx"], 16);
        assert_eq!(
            ApiError::unauthorized().into_response().status(),
            StatusCode::UNAUTHORIZED
        );
    }
}
