//! The one validation of a generation request, whichever front it came through. A front translates
//! its protocol into a [`RequestDraft`] (parameters as the client gave them, unset ones `None`);
//! [`Validator::validate`] applies the defaults and the engine's limits and tokenizes, giving a
//! [`GenerationRequest`] or an error naming the [`Field`] — which each front spells in its own
//! protocol's words (`sampling.temperature` in gRPC, `temperature` in OpenAI's JSON).

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;

use rivulet_ipc::layout::{MAX_REQUEST_LOGIT_BIAS, MAX_TOP_LOGPROBS};
use thiserror::Error;

use crate::chat_template::{ChatEnding, ChatMessage};
use crate::guide::{Guide, GuideError, GuideRequest, Guides};
use crate::model_limits::ModelLimits;
use crate::request::{GenerationRequest, Priority, SamplingParams, StoppingParams};
use crate::tokenizer::ModelTokenizer;

/// Stop strings a request may carry.
pub const MAX_STOP_STRINGS: usize = 8;

/// Stop token ids a request may carry: with the model's EOS ids they must fit a step's row of
/// banned tokens (`rivulet_ipc::layout::MAX_BANNED_TOKENS`), which keeps them from being chosen
/// before `min_new_tokens`.
pub const MAX_STOP_TOKEN_IDS: usize = 16;

/// The roles a chat message may have (`developer` renamed `system` where the template does not
/// name it, as vLLM does; `tool` for a function's result sent back after its call, rendered as
/// the template renders any role). OpenAI's deprecated `function` role is refused.
const CHAT_ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// What the prompt is, as the client sent it.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    TokenIds(Vec<u32>),
    /// A conversation, rendered with the model's chat template and ending as `ending` says.
    Messages {
        messages: Vec<ChatMessage>,
        ending: ChatEnding,
    },
}

/// How a conversation ends, from vLLM's two flags: `add_generation_prompt` (default true) and
/// `continue_final_message` (default false). Continuing the last message implies no generation
/// prompt; asking for both explicitly is an error, as in vLLM.
pub fn chat_ending(
    add_generation_prompt: Option<bool>,
    continue_final_message: bool,
) -> Result<ChatEnding, ValidationError> {
    match (add_generation_prompt, continue_final_message) {
        (Some(true), true) => Err(ValidationError::invalid(
            Field::ContinueFinalMessage,
            "cannot be combined with add_generation_prompt: true",
        )),
        (_, true) => Ok(ChatEnding::ContinueLastMessage),
        (Some(false), false) => Ok(ChatEnding::MessagesOnly),
        (_, false) => Ok(ChatEnding::AssistantTurn),
    }
}

/// Sampling parameters as given; `None` takes vLLM's default.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingDraft {
    // Numbers as sent (HTTP's JSON numbers are f64; gRPC's f32 widen exactly): ranges are checked
    // on them, then they are narrowed ([`narrow`]).
    pub temperature: Option<f64>,
    /// -1 and 0 keep every token.
    pub top_k: Option<i32>,
    pub top_p: Option<f64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub seed: Option<u64>,
    pub logprobs: bool,
    pub top_logprobs: u32,
    /// Token ids and biases, in the client's order (a token given again overrides, as in a JSON
    /// object with a repeated key).
    pub logit_bias: Vec<(u32, f32)>,
    pub allowed_token_ids: Option<Vec<u32>>,
    /// Alternatives per prompt token for vLLM's prompt logprobs; `None`: no prompt logprobs.
    pub prompt_logprobs: Option<u32>,
    /// A structured output, and the parameter that asked for it (named in its errors).
    pub guide: Option<(GuideRequest, &'static str)>,
}

/// Stopping criteria as given; `None` takes the server's default.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StoppingDraft {
    pub max_new_tokens: Option<u32>,
    /// Without `max_new_tokens`: generate up to the end of the model's context (OpenAI's chat)
    /// rather than the server's `default_max_new_tokens`.
    pub default_to_rest_of_context: bool,
    /// Only the prompt is wanted (OpenAI's `echo` with `max_tokens: 0`): its one token is made
    /// and left out by the front, never computed into the cache, so the model's context need
    /// hold the prompt alone.
    pub prompt_alone: bool,
    pub ignore_eos: bool,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub min_new_tokens: u32,
    pub max_response_chars: Option<u32>,
    pub include_stop_str_in_output: bool,
    pub confidence_threshold: Option<f64>,
}

/// A request as a front received it, before validation.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestDraft {
    pub id: String,
    /// The model the client asked for, if it named one.
    pub model: Option<String>,
    pub prompt: Prompt,
    pub sampling: SamplingDraft,
    pub stopping: StoppingDraft,
    pub priority: Priority,
}

/// A request parameter, named in errors. Each front spells it its own way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    Prompt,
    PromptTokenIds,
    Messages,
    Model,
    Temperature,
    TopK,
    TopP,
    MinP,
    RepetitionPenalty,
    FrequencyPenalty,
    PresencePenalty,
    TopLogprobs,
    PromptLogprobs,
    LogitBias,
    AllowedTokenIds,
    MaxNewTokens,
    Stop,
    StopTokenIds,
    MinNewTokens,
    MaxResponseChars,
    ConfidenceThreshold,
    Priority,
    AddGenerationPrompt,
    ContinueFinalMessage,
    /// A structured output, under the name of the parameter the client gave it by (HTTP has
    /// several: `response_format`, vLLM's `guided_json`, `structured_outputs`, …).
    StructuredOutput(&'static str),
}

impl Field {
    /// The field's path in the gRPC `GenerateRequest`.
    pub fn grpc_name(self) -> &'static str {
        match self {
            Field::Prompt => "prompt",
            Field::PromptTokenIds => "prompt_token_ids",
            Field::Messages => "messages",
            Field::Model => "model",
            Field::Temperature => "sampling.temperature",
            Field::TopK => "sampling.top_k",
            Field::TopP => "sampling.top_p",
            Field::MinP => "sampling.min_p",
            Field::RepetitionPenalty => "sampling.repetition_penalty",
            Field::FrequencyPenalty => "sampling.frequency_penalty",
            Field::PresencePenalty => "sampling.presence_penalty",
            Field::TopLogprobs => "sampling.top_logprobs",
            Field::PromptLogprobs => "sampling.prompt_logprobs",
            Field::LogitBias => "sampling.logit_bias",
            Field::AllowedTokenIds => "sampling.allowed_token_ids",
            Field::MaxNewTokens => "stopping.max_new_tokens",
            Field::Stop => "stopping.stop",
            Field::StopTokenIds => "stopping.stop_token_ids",
            Field::MinNewTokens => "stopping.min_new_tokens",
            Field::MaxResponseChars => "stopping.max_response_chars",
            Field::ConfidenceThreshold => "stopping.confidence_threshold",
            Field::Priority => "priority",
            Field::AddGenerationPrompt => "add_generation_prompt",
            Field::ContinueFinalMessage => "continue_final_message",
            Field::StructuredOutput(_) => "sampling.structured_output",
        }
    }
}

/// Why a request cannot be served as given.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ValidationError {
    /// A parameter is invalid; the message says why (the front names the field).
    #[error("{problem}")]
    Invalid { field: Field, problem: String },
    #[error("the model `{requested}` does not exist; this server serves `{served}`")]
    UnknownModel { requested: String, served: String },
}

impl ValidationError {
    pub fn invalid(field: Field, problem: impl Into<String>) -> Self {
        Self::Invalid {
            field,
            problem: problem.into(),
        }
    }
}

/// Everything a request is checked against: the model's limits, its tokenizer and the server's
/// defaults.
pub struct Validator {
    pub tokenizer: Arc<ModelTokenizer>,
    pub limits: Arc<ModelLimits>,
    pub served_model_name: String,
    pub default_max_new_tokens: u32,
    pub default_stop_strings: Vec<String>,
    /// `scheduler.confidence_threshold`, for requests that set none.
    pub default_confidence_threshold: Option<f32>,
    /// Structured outputs' compiler, where the tokenizer allows them (byte-level BPE).
    pub guides: Option<Arc<Guides>>,
}

impl Validator {
    /// Applies defaults and limits and tokenizes the prompt.
    pub fn validate(&self, mut draft: RequestDraft) -> Result<GenerationRequest, ValidationError> {
        self.check_model(draft.model)?;
        let (prompt_field, prompt_ids) = self.prompt_ids(draft.prompt)?;
        let max_model_len = self.limits.max_model_len as usize;
        // A prompt wanted alone may fill the context: nothing after it is computed.
        let room_needed = usize::from(!draft.stopping.prompt_alone);
        if prompt_ids.len() + room_needed > max_model_len {
            return Err(ValidationError::invalid(
                prompt_field,
                format!(
                    "{} tokens leave no room in the model's context of {max_model_len} tokens",
                    prompt_ids.len()
                ),
            ));
        }
        let guide = draft.sampling.guide.take();
        let mut sampling = sampling_params(draft.sampling, self.limits.vocab_size)?;
        if let Some((request, param)) = guide {
            sampling.guide = Some(self.compile_guide(&request, param, &sampling)?);
        }
        let stopping = self.stopping_params(draft.stopping, prompt_ids.len())?;
        Ok(GenerationRequest {
            id: draft.id,
            prompt_ids,
            sampling,
            stopping,
            priority: draft.priority,
        })
    }

    /// A structured output compiled against the vocabulary (or an earlier request's).
    fn compile_guide(
        &self,
        request: &GuideRequest,
        param: &'static str,
        sampling: &SamplingParams,
    ) -> Result<Arc<Guide>, ValidationError> {
        let field = Field::StructuredOutput(param);
        if sampling.allowed_only {
            // Both limits at once could leave no token to choose.
            return Err(ValidationError::invalid(
                field,
                "cannot be combined with allowed_token_ids",
            ));
        }
        let guides = self
            .guides
            .as_ref()
            .ok_or_else(|| ValidationError::invalid(field, GuideError::Unsupported.to_string()))?;
        guides
            .compile_off_runtime(request)
            .map_err(|error| ValidationError::invalid(field, error.to_string()))
    }

    /// The model a request names, if any, must be the one served.
    pub fn check_model(&self, model: Option<String>) -> Result<(), ValidationError> {
        match model.filter(|m| !m.is_empty() && *m != self.served_model_name) {
            Some(requested) => Err(ValidationError::UnknownModel {
                requested,
                served: self.served_model_name.clone(),
            }),
            None => Ok(()),
        }
    }

    /// The token ids the model reads for `prompt` (a text, token ids checked against the
    /// vocabulary, or a conversation through the chat template), as a request would be served.
    pub fn prompt_ids(&self, prompt: Prompt) -> Result<(Field, Vec<u32>), ValidationError> {
        let (field, text) = match prompt {
            Prompt::TokenIds(ids) => {
                if ids.is_empty() {
                    return Err(ValidationError::invalid(Field::PromptTokenIds, "must not be empty"));
                }
                in_vocabulary(Field::PromptTokenIds, ids.iter().copied(), self.limits.vocab_size)?;
                return Ok((Field::PromptTokenIds, ids));
            }
            Prompt::Text(text) => (Field::Prompt, text),
            Prompt::Messages { messages, ending } => (Field::Messages, self.render_chat(&messages, ending)?),
        };
        if text.is_empty() {
            return Err(ValidationError::invalid(field, "must not be empty"));
        }
        let ids = self
            .tokenizer
            .encode(&text)
            .map_err(|e| ValidationError::invalid(field, e.to_string()))?;
        if ids.is_empty() {
            return Err(ValidationError::invalid(field, "tokenizes to no tokens"));
        }
        Ok((field, ids))
    }

    fn render_chat(&self, messages: &[ChatMessage], ending: ChatEnding) -> Result<String, ValidationError> {
        if messages.is_empty() {
            return Err(ValidationError::invalid(Field::Messages, "must not be empty"));
        }
        let template = self.tokenizer.chat_template().ok_or_else(|| {
            ValidationError::invalid(Field::Messages, "the served model has no chat template; send a prompt")
        })?;
        if let Some(bad) = messages.iter().find(|m| !CHAT_ROLES.contains(&m.role.as_str())) {
            return Err(ValidationError::invalid(
                Field::Messages,
                format!(
                    "unknown role {:?} (system, developer, user, assistant or tool)",
                    bad.role
                ),
            ));
        }
        template
            .render(messages, ending)
            .map_err(|e| ValidationError::invalid(Field::Messages, e.to_string()))
    }

    fn stopping_params(&self, stopping: StoppingDraft, prompt_len: usize) -> Result<StoppingParams, ValidationError> {
        let max_model_len = self.limits.max_model_len as usize;
        // What the context (and the largest KV cache) leaves after the prompt.
        let room = max_model_len.saturating_sub(prompt_len);
        let room = match self.limits.kv_capacity_tokens() {
            Some(capacity) => room.min(capacity.saturating_sub(prompt_len)),
            None => room,
        };
        // A limit the client did not set never refuses its request: as vLLM caps its default,
        // the server's default (or, for chat, the rest of the context) is cut to the room left.
        let max_new_tokens = match stopping.max_new_tokens {
            Some(max) => max,
            None if stopping.default_to_rest_of_context => room.clamp(1, u32::MAX as usize) as u32,
            None => room.min(self.default_max_new_tokens as usize).max(1) as u32,
        };
        if max_new_tokens == 0 {
            return Err(ValidationError::invalid(Field::MaxNewTokens, "must be at least 1"));
        }
        let total = prompt_len + max_new_tokens as usize;
        let in_context = if stopping.prompt_alone { prompt_len } else { total };
        if in_context > max_model_len {
            return Err(ValidationError::invalid(
                Field::MaxNewTokens,
                format!(
                    "prompt ({prompt_len} tokens) + max new tokens ({max_new_tokens}) = {total} exceeds the model's context of {max_model_len}"
                ),
            ));
        }
        if let Some(capacity) = self.limits.kv_capacity_tokens().filter(|&capacity| total > capacity) {
            return Err(ValidationError::invalid(
                Field::MaxNewTokens,
                format!("prompt + max new tokens = {total} tokens can never fit in the KV cache of {capacity} tokens"),
            ));
        }
        if stopping.stop.len() > MAX_STOP_STRINGS {
            return Err(ValidationError::invalid(
                Field::Stop,
                format!("{} stop strings; at most {MAX_STOP_STRINGS}", stopping.stop.len()),
            ));
        }
        if stopping.stop.iter().any(String::is_empty) {
            return Err(ValidationError::invalid(Field::Stop, "stop strings must not be empty"));
        }
        if stopping.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(ValidationError::invalid(
                Field::StopTokenIds,
                format!(
                    "{} stop token ids; at most {MAX_STOP_TOKEN_IDS}",
                    stopping.stop_token_ids.len()
                ),
            ));
        }
        in_vocabulary(
            Field::StopTokenIds,
            stopping.stop_token_ids.iter().copied(),
            self.limits.vocab_size,
        )?;
        if stopping.min_new_tokens > max_new_tokens {
            return Err(ValidationError::invalid(
                Field::MinNewTokens,
                format!(
                    "{} exceeds the maximum of new tokens ({max_new_tokens})",
                    stopping.min_new_tokens
                ),
            ));
        }
        if stopping.max_response_chars == Some(0) {
            return Err(ValidationError::invalid(
                Field::MaxResponseChars,
                "must be at least 1 when set",
            ));
        }
        let confidence_threshold = stopping
            .confidence_threshold
            .or(self.default_confidence_threshold.map(f64::from))
            .map(|threshold| {
                check(
                    Field::ConfidenceThreshold,
                    threshold,
                    threshold > 0.0 && threshold < 1.0,
                    "(0, 1)",
                )
            })
            .transpose()?;
        let mut stop_strings = stopping.stop;
        stop_strings.extend(self.default_stop_strings.iter().cloned());
        Ok(StoppingParams {
            max_new_tokens,
            ignore_eos: stopping.ignore_eos,
            stop_strings,
            stop_token_ids: stopping.stop_token_ids,
            min_new_tokens: stopping.min_new_tokens,
            max_response_chars: stopping.max_response_chars,
            include_stop_str_in_output: stopping.include_stop_str_in_output,
            confidence_threshold,
        })
    }
}

/// `value`, checked as sent, as the f32 the engine takes ([`narrow`]).
fn check(field: Field, value: f64, ok: bool, range: &str) -> Result<f32, ValidationError> {
    if value.is_finite() && ok {
        Ok(narrow(value))
    } else {
        Err(ValidationError::invalid(
            field,
            // The shortest form that reads back as the value (`-1e-300`, not 300 zeros).
            format!("{value:?} is out of range: {range}"),
        ))
    }
}

/// A number checked against its range as the f32 the engine takes, rounded toward zero, so that
/// it stays inside every range validation checks (each bound is 0 or a small integer: `0.9999999999`
/// stays below 1, `2.0000000001` was refused before), but never to zero from a non-zero value (a
/// tiny `top_p` is a tiny mass, not the refused 0) and never to infinity from a finite one (f32's
/// largest instead).
pub fn narrow(value: f64) -> f32 {
    let nearest = value as f32;
    if value.is_nan() || value.is_infinite() || value == 0.0 {
        return nearest;
    }
    if nearest.is_infinite() {
        return f32::MAX.copysign(nearest);
    }
    let toward_zero = if f64::from(nearest).abs() > value.abs() {
        if nearest > 0.0 {
            nearest.next_down()
        } else {
            nearest.next_up()
        }
    } else {
        nearest
    };
    if toward_zero.abs() < f32::MIN_POSITIVE {
        f32::MIN_POSITIVE.copysign(value as f32)
    } else {
        toward_zero
    }
}

/// A seed for a request that did not give one: fresh randomness from the OS-seeded hasher keys.
fn fresh_seed() -> u64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    hasher.write_u128(nanos);
    hasher.finish()
}

/// Every token id of `tokens` below `vocab`, or an error naming the first that is not.
fn in_vocabulary(field: Field, mut tokens: impl Iterator<Item = u32>, vocab: u32) -> Result<(), ValidationError> {
    match tokens.find(|&id| id >= vocab) {
        Some(bad) => Err(ValidationError::invalid(
            field,
            format!("token id {bad} is outside the vocabulary of {vocab}"),
        )),
        None => Ok(()),
    }
}

/// `logit_bias` and `allowed_token_ids` as one list: the biases clamped to [-100, 100] as vLLM
/// clamps them, and with an allowed list, its tokens each with its bias or 0 (a bias on a token
/// it does not allow changes nothing, as in vLLM), sorted by token.
fn logit_bias(
    bias: Vec<(u32, f32)>,
    allowed: Option<Vec<u32>>,
    vocab: u32,
) -> Result<(Vec<(u32, f32)>, bool), ValidationError> {
    in_vocabulary(Field::LogitBias, bias.iter().map(|&(token, _)| token), vocab)?;
    if let Some(&(token, value)) = bias.iter().find(|(_, value)| value.is_nan()) {
        return Err(ValidationError::invalid(
            Field::LogitBias,
            format!("the bias of token {token} is {value}"),
        ));
    }
    let bias: BTreeMap<u32, f32> = bias
        .into_iter()
        .map(|(token, value)| (token, value.clamp(-100.0, 100.0)))
        .collect();
    let too_many = |field, count: usize| {
        ValidationError::invalid(
            field,
            format!("{count} tokens are more than the {MAX_REQUEST_LOGIT_BIAS} allowed"),
        )
    };
    if bias.len() > MAX_REQUEST_LOGIT_BIAS {
        return Err(too_many(Field::LogitBias, bias.len()));
    }
    let Some(allowed) = allowed else {
        return Ok((bias.into_iter().collect(), false));
    };
    if allowed.is_empty() {
        return Err(ValidationError::invalid(Field::AllowedTokenIds, "must not be empty"));
    }
    in_vocabulary(Field::AllowedTokenIds, allowed.iter().copied(), vocab)?;
    let allowed: BTreeMap<u32, f32> = allowed
        .into_iter()
        .map(|token| (token, bias.get(&token).copied().unwrap_or(0.0)))
        .collect();
    if allowed.len() > MAX_REQUEST_LOGIT_BIAS {
        return Err(too_many(Field::AllowedTokenIds, allowed.len()));
    }
    Ok((allowed.into_iter().collect(), true))
}

/// Sampling parameters with vLLM's defaults and ranges, for a model of `vocab` tokens.
pub fn sampling_params(sampling: SamplingDraft, vocab: u32) -> Result<SamplingParams, ValidationError> {
    let defaults = SamplingParams::default();
    let or_default = |value: Option<f64>, default: f32| value.unwrap_or(f64::from(default));
    let temperature = or_default(sampling.temperature, defaults.temperature);
    let top_k = sampling.top_k.unwrap_or(0);
    if top_k < -1 {
        return Err(ValidationError::invalid(
            Field::TopK,
            format!("{top_k} is out of range: -1, 0 (all) or positive"),
        ));
    }
    let top_p = or_default(sampling.top_p, defaults.top_p);
    let min_p = or_default(sampling.min_p, defaults.min_p);
    let repetition = or_default(sampling.repetition_penalty, defaults.repetition_penalty);
    let frequency = or_default(sampling.frequency_penalty, defaults.frequency_penalty);
    let presence = or_default(sampling.presence_penalty, defaults.presence_penalty);
    for (field, alternatives) in [
        (Field::TopLogprobs, Some(sampling.top_logprobs)),
        (Field::PromptLogprobs, sampling.prompt_logprobs),
    ] {
        if let Some(alternatives) = alternatives.filter(|&a| a as usize > MAX_TOP_LOGPROBS) {
            return Err(ValidationError::invalid(
                field,
                format!("{alternatives} is more than the {MAX_TOP_LOGPROBS} allowed"),
            ));
        }
    }
    let penalty = |field, value: f64| check(field, value, (-2.0..=2.0).contains(&value), "[-2, 2]");
    let (logit_bias, allowed_only) = logit_bias(sampling.logit_bias, sampling.allowed_token_ids, vocab)?;
    Ok(SamplingParams {
        temperature: check(
            Field::Temperature,
            temperature,
            temperature >= 0.0 && temperature.is_finite(),
            ">= 0 and finite",
        )?,
        top_k: top_k.max(0) as u32,
        top_p: check(Field::TopP, top_p, top_p > 0.0 && top_p <= 1.0, "(0, 1]")?,
        min_p: check(Field::MinP, min_p, (0.0..=1.0).contains(&min_p), "[0, 1]")?,
        repetition_penalty: check(
            Field::RepetitionPenalty,
            repetition,
            repetition > 0.0 && repetition.is_finite(),
            "> 0 and finite",
        )?,
        frequency_penalty: penalty(Field::FrequencyPenalty, frequency)?,
        presence_penalty: penalty(Field::PresencePenalty, presence)?,
        seed: sampling.seed.unwrap_or_else(fresh_seed),
        logprobs: sampling.logprobs,
        top_logprobs: sampling.top_logprobs,
        logit_bias,
        allowed_only,
        prompt_logprobs: sampling.prompt_logprobs,
        guide: None,
    })
}

#[cfg(test)]
mod tests;
