//! The OpenAI-compatible HTTP front (axum): `/v1/completions`, `/v1/chat/completions`,
//! `/v1/models`, vLLM's `/tokenize` and `/detokenize`, and the operational `/health` and
//! `/metrics`. Every response carries the request's `x-request-id`; all but the operational
//! routes require the API key when one is set.
//!
//! - [`openai`]: the JSON shapes; [`translate`]: body → domain draft;
//!   [`generate`]: the two generation endpoints; [`prompt_echo`]: `echo` and prompt logprobs;
//!   [`tokenize`]: the tokenizer's endpoints; [`errors`]: OpenAI's error shape.

pub mod errors;
pub mod generate;
mod lax_integer;
pub mod openai;
pub mod prompt_echo;
pub mod structured_output;
pub mod tokenize;
pub mod tool_calls;
pub mod translate;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use super::auth::ApiKey;
use super::{request_id, Frontend, REQUEST_ID_HEADER};
use errors::ApiError;
use openai::{ModelCard, ModelList};

#[derive(Clone)]
pub struct HttpState {
    pub front: Frontend,
    pub api_key: ApiKey,
    /// When the server started, as `/v1/models` reports it.
    pub created: u64,
}

pub fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
}

/// The request's id, put in the request's extensions by the middleware.
#[derive(Clone)]
pub struct RequestId(pub String);

pub fn router(state: HttpState) -> Router {
    let api = Router::new()
        .route("/v1/completions", post(generate::completions))
        .route("/v1/chat/completions", post(generate::chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_api_key));
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn(with_request_id))
        .with_state(state)
}

/// Takes the client's `x-request-id` (or makes one), gives it to the handler and returns it.
async fn with_request_id(mut request: Request, next: Next) -> Response {
    let given = request
        .headers()
        .get(REQUEST_ID_HEADER)
        .and_then(|value| value.to_str().ok());
    let id = request_id(given);
    request.extensions_mut().insert(RequestId(id.clone()));
    let mut response = next.run(request).await;
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    response
}

async fn require_api_key(State(state): State<HttpState>, request: Request, next: Next) -> Response {
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok());
    if state.api_key.admits(authorization) {
        next.run(request).await
    } else {
        ApiError::unauthorized().into_response()
    }
}

/// 200 while some worker replica is ready, 503 while loading, without workers or shutting down.
async fn health(State(state): State<HttpState>) -> StatusCode {
    if *state.front.engine.serving.borrow() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn metrics(State(state): State<HttpState>) -> Response {
    let stats = match state.front.engine.stats().await {
        Ok(stats) => stats,
        Err(error) => return ApiError::engine(&error).into_response(),
    };
    match state.front.metrics.render(&stats) {
        Ok(text) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
            text,
        )
            .into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

async fn models(State(state): State<HttpState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: state.front.served_model_name().to_owned(),
            object: "model",
            created: state.created,
            owned_by: "rivulet",
            max_model_len: state.front.engine.limits.max_model_len,
        }],
    })
}

async fn method_not_allowed(request: Request) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!("{} is not allowed on {}", request.method(), request.uri().path()),
        kind: "invalid_request_error",
        param: None,
        code: None,
    }
}

async fn not_found(request: Request) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("no route {} {}", request.method(), request.uri().path()),
        kind: "invalid_request_error",
        param: None,
        code: None,
    }
}
