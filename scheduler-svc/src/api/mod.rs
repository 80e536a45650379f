//! The fronts clients talk to — gRPC ([`grpc`], [`admin`]) and OpenAI-compatible HTTP ([`http`]).
//! Each only translates its protocol into a [`validation::RequestDraft`] and the engine's events
//! back; what they share — validation, submission, request ids, per-request metrics and the
//! summary log line, the API key — lives here once.

pub mod admin;
pub mod auth;
pub mod grpc;
pub mod http;
pub mod tracking;
pub mod validation;

use std::sync::Arc;

use thiserror::Error;

use crate::engine::EngineHandle;
use crate::metrics::Metrics;
use crate::request::EngineError;
use tracking::TrackedRequest;
use validation::{RequestDraft, ValidationError, Validator};

/// The header (HTTP) and metadata key (gRPC) that carries a request's id, both ways.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// The client's request id when it is a sensible one (1–128 visible ASCII characters), else a
/// fresh one.
pub fn request_id(given: Option<&str>) -> String {
    match given {
        Some(id) if (1..=128).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic()) => id.to_owned(),
        _ => uuid::Uuid::new_v4().simple().to_string(),
    }
}

/// Why a request was not accepted.
#[derive(Debug, Error)]
pub enum SubmitError {
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// What both fronts hold: the engine, the one validation, the metrics.
#[derive(Clone)]
pub struct Frontend {
    pub engine: EngineHandle,
    pub validator: Arc<Validator>,
    pub metrics: Arc<Metrics>,
}

impl Frontend {
    pub fn served_model_name(&self) -> &str {
        &self.validator.served_model_name
    }

    /// Validates `draft` and queues it; its events arrive on the returned stream. Dropping the
    /// stream cancels the request.
    pub fn submit(&self, draft: RequestDraft, front: &'static str) -> Result<TrackedRequest, SubmitError> {
        let id = draft.id.clone();
        let request = self.validator.validate(draft).map_err(|error| {
            tracing::info!(request_id = %id, %error, "request refused");
            error
        })?;
        let prompt_ids = request.prompt_ids.clone();
        let events = self.engine.submit(request).map_err(|error| {
            tracing::info!(request_id = %id, %error, "request refused");
            error
        })?;
        Ok(TrackedRequest::new(id, front, prompt_ids, events, self.metrics.clone()))
    }
}
