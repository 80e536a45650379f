//! Domain types of a generation request and its results, independent of proto and of libtorch.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 is greedy.
    pub temperature: f32,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct StoppingParams {
    pub max_new_tokens: u32,
    pub ignore_eos: bool,
    /// The request's stop strings and the server's defaults.
    pub stop_strings: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub min_new_tokens: u32,
    pub max_response_chars: Option<u32>,
    pub include_stop_str_in_output: bool,
}

/// Scheduling class: higher is admitted first and preempted last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Priority {
    Low,
    #[default]
    Normal,
    High,
    Critical,
}

impl Priority {
    pub const ALL_HIGHEST_FIRST: [Priority; 4] = [Priority::Critical, Priority::High, Priority::Normal, Priority::Low];
}

/// A validated request, tokenized.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    pub prompt_ids: Vec<u32>,
    pub sampling: SamplingParams,
    pub stopping: StoppingParams,
    pub priority: Priority,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    MaxTokens,
    EosToken,
    StopToken,
    StopString,
    /// The sequence reached the model's context length.
    Length,
    Cancelled,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_prompt_tokens: u32,
}

/// What the engine sends back on a request's stream.
#[derive(Debug, Clone, PartialEq)]
pub enum SequenceEvent {
    /// New tokens and the text they complete (possibly empty while a character is incomplete).
    Tokens { token_ids: Vec<u32>, text: String },
    /// The last event of a request that completed, with its last tokens and text.
    Finished {
        reason: FinishReason,
        token_ids: Vec<u32>,
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
    #[error("the queue is full ({0} requests waiting); retry later")]
    QueueFull(usize),
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
