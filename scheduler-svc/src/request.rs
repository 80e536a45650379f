//! Domain types of a generation request and its results, independent of proto and of libtorch.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 is greedy.
    pub temperature: f32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct StoppingParams {
    pub max_new_tokens: u32,
    pub ignore_eos: bool,
}

/// A validated request, tokenized.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    pub prompt_ids: Vec<u32>,
    pub sampling: SamplingParams,
    pub stopping: StoppingParams,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    MaxTokens,
    EosToken,
    /// The sequence reached the model's context length.
    Length,
    Cancelled,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
}

/// What the engine sends back on a request's stream.
#[derive(Debug, Clone, PartialEq)]
pub enum SequenceEvent {
    /// New tokens and the text they complete (possibly empty while a character is incomplete).
    Tokens { token_ids: Vec<u32>, text: String },
    /// The last event of a request that completed.
    Finished {
        reason: FinishReason,
        text: String,
        usage: Usage,
    },
    /// The last event of a request that could not complete.
    Failed(EngineError),
}

/// Why the engine could not serve a request.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum EngineError {
    #[error("the model worker failed: {0}")]
    WorkerUnavailable(String),
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("detokenizing: {0}")]
    Detokenize(String),
}

/// Invalid input, naming the field.
#[derive(Debug, Clone, PartialEq, Error)]
#[error("{field}: {problem}")]
pub struct InvalidRequest {
    pub field: &'static str,
    pub problem: String,
}

impl InvalidRequest {
    pub fn new(field: &'static str, problem: impl Into<String>) -> Self {
        Self {
            field,
            problem: problem.into(),
        }
    }
}
