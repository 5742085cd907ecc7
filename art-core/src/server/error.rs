//! The server's one error type, answered as OpenAI's error JSON with a 4xx (or 5xx for our own
//! faults): `{"error": {"message", "type", "param", "code"}}`.

use axum::extract::rejection::JsonRejection;
use axum::extract::FromRequest;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::store::StoreError;
use crate::train::TrainError;
use crate::types::InvalidName;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

/// A bad name is the client's mistake, about the field it came in.
impl From<InvalidName> for ApiError {
    fn from(invalid: InvalidName) -> Self {
        ApiError::invalid_param(invalid.what, invalid.to_string())
    }
}

/// A store error as an HTTP answer: bad names are the client's, the rest the server's.
impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match &e {
            StoreError::InvalidName(invalid) => invalid.clone().into(),
            StoreError::MetricNotFound { .. } => {
                ApiError::invalid_param("best_metric", e.to_string())
            }
            _ => ApiError::internal(e.to_string()),
        }
    }
}

/// A training error as an HTTP answer: a malformed batch is the client's, the rest the server's.
impl From<TrainError> for ApiError {
    fn from(e: TrainError) -> Self {
        if e.is_client_error() {
            ApiError::bad_request(e.to_string())
        } else {
            ApiError::internal(e.to_string())
        }
    }
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// A request value outside what is allowed, naming the parameter.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.to_string()),
            ..Self::bad_request(message)
        }
    }

    pub fn model_not_found(model: &str, available: &[String]) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "The model `{model}` does not exist on this server. Available: {}. GET /v1/models lists them.",
                available.join(", ")
            ),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    pub fn context_length(message: impl Into<String>) -> Self {
        ApiError {
            code: Some("context_length_exceeded"),
            param: Some("messages".into()),
            ..Self::bad_request(message)
        }
    }

    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "Missing or wrong API key: send `Authorization: Bearer <key>` with the key `art serve` was \
                      started with (--api-key)."
                .into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn overloaded(queued: usize) -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: format!(
                "The server is overloaded ({queued} requests queued). Retry after a short wait."
            ),
            kind: "rate_limit_error",
            param: None,
            code: Some("overloaded"),
        }
    }

    /// The service cannot take the request now (no inference replica running).
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            code: Some("unavailable"),
            ..Self::bad_request(message)
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            code: Some("not_found"),
            ..Self::bad_request(message)
        }
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::CONFLICT,
            code: Some("conflict"),
            ..Self::bad_request(message)
        }
    }

    /// A fault of the server's own. The detail (which may name files and internals) goes to the
    /// server's log under a fresh id; the client gets the id only.
    pub fn internal(detail: impl Into<String>) -> Self {
        let id = format!(
            "err-{}",
            crate::engine::tool_calls::new_tool_call_id().trim_start_matches("call_")
        );
        tracing::error!(id = %id, detail = %detail.into(), "internal error");
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: format!(
                "The server could not handle this request (internal error {id}; the server's \
                 log has the details)."
            ),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.status, self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            // A full queue drains in about a second; clients that honour the header (the
            // openai SDKs, async-openai) wait that long instead of guessing.
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        response
    }
}

impl From<JsonRejection> for ApiError {
    /// Malformed JSON, a missing field or a wrong type: serde's message says which and where.
    fn from(rejection: JsonRejection) -> Self {
        let status = rejection.status();
        ApiError {
            status,
            ..ApiError::bad_request(format!("Invalid request body: {}", rejection.body_text()))
        }
    }
}

/// `axum::Json`, with rejections answered as OpenAI-style errors.
#[derive(FromRequest)]
#[from_request(via(axum::Json), rejection(ApiError))]
pub struct ApiJson<T>(pub T);

impl<T: serde::Serialize> IntoResponse for ApiJson<T> {
    fn into_response(self) -> Response {
        Json(self.0).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_details_stay_in_the_servers_log() {
        let error = ApiError::internal("cannot write /home/someone/.art/m/checkpoints: disk full");
        assert_eq!(error.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!error.message.contains("/home"), "{}", error.message);
        assert!(
            error.message.contains("internal error err-"),
            "{}",
            error.message
        );
    }
}
