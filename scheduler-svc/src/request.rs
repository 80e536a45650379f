//! Domain types of a generation request and its results, independent of proto and of libtorch.

use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

use crate::guide::Guide;

/// Sampling parameters, validated; defaults are vLLM's.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 is greedy.
    pub temperature: f32,
    /// 0 keeps every token.
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// The request's seed, or a fresh random one.
    pub seed: u64,
    pub logprobs: bool,
    pub top_logprobs: u32,
    /// What is added to each listed token's logit before the penalties (OpenAI's `logit_bias`,
    /// clamped to [-100, 100] as vLLM clamps it), one entry per token, sorted by token.
    pub logit_bias: Vec<(u32, f32)>,
    /// Only `logit_bias`'s tokens may be chosen (vLLM's `allowed_token_ids`: then `logit_bias`
    /// lists every allowed token, with its bias or 0).
    pub allowed_only: bool,
    /// vLLM's `prompt_logprobs`: each prompt token's log-probability (after the first), with this
    /// many likeliest alternatives. Such a request's prompt is computed whole, never read from
    /// the prefix cache, whose blocks hold keys and values but no logits.
    pub prompt_logprobs: Option<u32>,
    /// A structured output (vLLM's guided decoding): each token chosen from those its guide
    /// allows where the output is.
    pub guide: Option<Arc<Guide>>,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.frequency_penalty != 0.0 || self.presence_penalty != 0.0
    }

    pub fn wants_logprobs(&self) -> bool {
        self.logprobs || self.top_logprobs > 0
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: 0,
            logprobs: false,
            top_logprobs: 0,
            logit_bias: Vec::new(),
            allowed_only: false,
            prompt_logprobs: None,
            guide: None,
        }
    }
}

/// A generated token's log-probability and the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// A prompt token's log-probability given the tokens before it (vLLM's prompt logprobs), its
/// rank among the vocabulary (1: the likeliest) and the likeliest alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptTokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
    pub rank: u32,
    pub top: Vec<(u32, f32)>,
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
    /// End at the first token (after `min_new_tokens`) less likely than this.
    pub confidence_threshold: Option<f32>,
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
    /// The client's `x-request-id`, or one the server made up: on every log line about it.
    pub id: String,
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
    /// A token's probability fell below the request's confidence threshold.
    LowConfidence,
}

/// Which stop ended a request that finished on one (vLLM's `stop_reason`): the stop string that
/// matched, or the stop token id chosen. EOS and the other reasons have none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopCause {
    String(String),
    TokenId(u32),
}

impl StopCause {
    pub fn stop_string(&self) -> Option<&str> {
        match self {
            Self::String(stop) => Some(stop),
            Self::TokenId(_) => None,
        }
    }

    pub fn token_id(&self) -> Option<u32> {
        match self {
            Self::TokenId(token) => Some(*token),
            Self::String(_) => None,
        }
    }
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
    /// The prompt's logprobs, when the request asked for them: one per prompt token after the
    /// first, sent just before the first `Tokens` (or `Finished`).
    PromptLogprobs(Vec<PromptTokenLogprob>),
    /// New tokens and the text they complete (possibly empty while a character is incomplete).
    Tokens {
        token_ids: Vec<u32>,
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// The last event of a request that completed, with its last tokens and text.
    Finished {
        reason: FinishReason,
        /// The stop string or stop token id, for `StopString` and `StopToken`.
        stop: Option<StopCause>,
        token_ids: Vec<u32>,
        text: String,
        usage: Usage,
        logprobs: Vec<TokenLogprob>,
        /// From submission to its first admission into a step.
        queue_time: Duration,
    },
    /// The last event of a request that could not complete.
    Failed(EngineError),
}

/// Why the engine could not serve a request.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum EngineError {
    #[error("no model worker can serve the request: {0}")]
    WorkerUnavailable(String),
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("the queue is full ({0} requests waiting); retry later")]
    QueueFull(usize),
    #[error("detokenizing: {0}")]
    Detokenize(String),
    #[error("no worker replica {0}")]
    UnknownReplica(u32),
    #[error("an operator cleared the queue before the request started")]
    ClearedFromQueue,
}

/// How a front reports an [`EngineError`]: each maps these to its protocol's statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// No worker can serve now (gRPC `UNAVAILABLE`, HTTP 503).
    Unavailable,
    /// Too much load; retry later (`RESOURCE_EXHAUSTED`, 429).
    Overloaded,
    /// Something named does not exist (`NOT_FOUND`, 404).
    NotFound,
    /// A fault of the server (`INTERNAL`, 500).
    Internal,
    /// Ended on purpose by an operator (`ABORTED`, 503).
    Aborted,
}

impl EngineError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            EngineError::WorkerUnavailable(_) | EngineError::ShuttingDown => ErrorKind::Unavailable,
            EngineError::QueueFull(_) => ErrorKind::Overloaded,
            EngineError::UnknownReplica(_) => ErrorKind::NotFound,
            EngineError::Detokenize(_) => ErrorKind::Internal,
            EngineError::ClearedFromQueue => ErrorKind::Aborted,
        }
    }

    /// A short label for metrics and logs.
    pub fn error_type(&self) -> &'static str {
        match self {
            EngineError::WorkerUnavailable(_) => "worker_unavailable",
            EngineError::ShuttingDown => "shutting_down",
            EngineError::QueueFull(_) => "queue_full",
            EngineError::Detokenize(_) => "detokenize",
            EngineError::UnknownReplica(_) => "unknown_replica",
            EngineError::ClearedFromQueue => "queue_cleared",
        }
    }
}
