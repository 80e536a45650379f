//! Every HTTP error in OpenAI's JSON shape, rendered by one `IntoResponse`:
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::translate::Endpoint;
use crate::api::validation::{Field, ValidationError};
use crate::api::SubmitError;
use crate::request::{EngineError, ErrorKind};

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 naming `param`, its message `param: problem`.
    pub fn invalid(param: &'static str, problem: impl std::fmt::Display) -> Self {
        Self::bad_request(param, format!("{param}: {problem}"))
    }

    pub fn bad_request(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_owned()),
            code: None,
        }
    }

    /// A body that is not JSON or not of the expected shape; `path` is where serde stopped.
    pub fn malformed(path: String, problem: String) -> Self {
        let top_level = path
            .split(['.', '['])
            .next()
            // `?` is serde_path_to_error's word for "no field yet" (a body cut short, say).
            .filter(|p| !p.is_empty() && *p != "?")
            .map(str::to_owned);
        let message = match &top_level {
            None => format!("the request body is not valid: {problem}"),
            Some(_) => format!("{path}: {problem}"),
        };
        Self {
            status: StatusCode::BAD_REQUEST,
            message,
            kind: "invalid_request_error",
            param: top_level,
            code: None,
        }
    }

    /// A body axum could not read (over its size limit: 413; cut off or unreadable: 400).
    pub fn unreadable_body(rejection: &axum::extract::rejection::BytesRejection) -> Self {
        Self {
            status: rejection.status(),
            message: format!("the request body could not be read: {}", rejection.body_text()),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: "a valid API key is required: `Authorization: Bearer <key>`".to_owned(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn engine(error: &EngineError) -> Self {
        let (status, kind) = match error.kind() {
            ErrorKind::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable_error"),
            ErrorKind::Overloaded => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
            ErrorKind::NotFound => (StatusCode::NOT_FOUND, "not_found_error"),
            ErrorKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal_error"),
            ErrorKind::Aborted => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable_error"),
        };
        Self {
            status,
            message: error.to_string(),
            kind,
            param: None,
            code: Some(error.error_type()),
        }
    }

    pub fn submit(endpoint: Endpoint, error: SubmitError) -> Self {
        Self::submit_naming(|field| endpoint.param_name(field), error)
    }

    /// [`Self::submit`] with the request's own name for each field (a chat body may set the
    /// output's limit as `max_completion_tokens`, and its errors name what the client sent).
    pub fn submit_naming(param_name: impl Fn(Field) -> &'static str, error: SubmitError) -> Self {
        match error {
            SubmitError::Invalid(ValidationError::Invalid { field, problem }) => {
                let param = param_name(field);
                Self::bad_request(param, format!("{param}: {problem}"))
            }
            SubmitError::Invalid(error @ ValidationError::UnknownModel { .. }) => Self {
                status: StatusCode::NOT_FOUND,
                message: error.to_string(),
                kind: "invalid_request_error",
                param: Some("model".to_owned()),
                code: Some("model_not_found"),
            },
            SubmitError::Engine(error) => Self::engine(&error),
        }
    }

    /// The `error` object, also sent as an event when a stream fails midway.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}
