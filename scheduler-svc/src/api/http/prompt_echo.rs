//! What an HTTP response repeats of its prompt: OpenAI's `echo` (completions: the prompt's text
//! before each choice's, and its tokens before the choice's in `logprobs`, the first with `null`s
//! as nothing precedes it) and vLLM's `prompt_logprobs` (each prompt token's log-probability,
//! rank and alternatives, keyed by token id). Both read the engine's prompt logprobs
//! ([`PromptTokenLogprob`]), which a request asks for once, with as many alternatives as the
//! larger of the two wants.
//!
//! As in vLLM: `echo` with `max_tokens: 0` returns the prompt alone (the engine generates one
//! token, which the response leaves out: `finish_reason` "length", no completion tokens), and
//! `prompt_logprobs` is refused in a stream.

use std::sync::Arc;

use super::errors::ApiError;
use super::openai::{CompletionLogprobs, GenerationBody, LogprobsInput, PromptLogprobEntry};
use super::translate::{output_limit, Endpoint};
use crate::request::PromptTokenLogprob;
use crate::token_piece::{CharOffsets, TokenPiece};
use crate::tokenizer::ModelTokenizer;

/// A request's `echo` and `prompt_logprobs`, checked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptEcho {
    /// Completions' `echo`.
    pub echo: bool,
    /// `echo` with `max_tokens: 0`: the prompt and nothing generated.
    pub echo_only: bool,
    /// vLLM's `prompt_logprobs`: alternatives per prompt token.
    pub prompt_logprobs: Option<u32>,
    /// Completions' `logprobs` count, when given: the alternatives an echoed token lists.
    pub logprobs: Option<u32>,
}

impl PromptEcho {
    pub fn from_body(endpoint: Endpoint, body: &GenerationBody) -> Result<Self, ApiError> {
        let echo = body.echo.unwrap_or(false);
        if echo && endpoint == Endpoint::Chat {
            return Err(ApiError::bad_request(
                "echo",
                "echo: is not supported on chat completions",
            ));
        }
        if body.prompt_logprobs.is_some() && body.stream.unwrap_or(false) {
            return Err(ApiError::bad_request(
                "prompt_logprobs",
                "prompt_logprobs: not available with stream: true",
            ));
        }
        let logprobs = match body.logprobs {
            Some(LogprobsInput::Count(count)) if endpoint == Endpoint::Completions => Some(count),
            _ => None,
        };
        Ok(Self {
            echo,
            echo_only: echo && output_limit(endpoint, body).0 == Some(0),
            prompt_logprobs: body.prompt_logprobs,
            logprobs,
        })
    }

    /// Alternatives per prompt token the engine is asked for: what `prompt_logprobs` and an
    /// echo's `logprobs` want, the larger.
    pub fn engine_prompt_logprobs(&self) -> Option<u32> {
        let echoed = self.logprobs.filter(|_| self.echo);
        match (self.prompt_logprobs, echoed) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }
}

/// vLLM's `prompt_logprobs` list: `null` for the first token, then per token an object from token
/// id to its entry, the token's own and its `alternatives` likeliest (ranks 1, 2, …).
pub fn vllm_prompt_logprobs(
    tokenizer: &Arc<ModelTokenizer>,
    scores: &[PromptTokenLogprob],
    alternatives: u32,
) -> serde_json::Value {
    let entry = |id: u32, logprob: f32, rank: u32| {
        let entry = PromptLogprobEntry {
            logprob,
            rank,
            decoded_token: TokenPiece::of(tokenizer, id).text,
        };
        serde_json::to_value(entry).unwrap_or(serde_json::Value::Null)
    };
    let mut list = vec![serde_json::Value::Null];
    for score in scores {
        let mut map = serde_json::Map::new();
        map.insert(
            score.token_id.to_string(),
            entry(score.token_id, score.logprob, score.rank),
        );
        for (rank, &(id, logprob)) in (1..).zip(score.top.iter().take(alternatives as usize)) {
            map.entry(id.to_string()).or_insert_with(|| entry(id, logprob, rank));
        }
        list.push(serde_json::Value::Object(map));
    }
    serde_json::Value::Array(list)
}

/// The text an echo repeats of a prompt given as token ids: every token as written, special ones
/// too, as its `logprobs` list them (a text prompt is repeated as given).
pub fn echoed_text(tokenizer: &ModelTokenizer, prompt_ids: &[u32]) -> String {
    tokenizer.decode_with_special(prompt_ids).unwrap_or_default()
}

/// An echoed prompt's entries at the front of completions' `logprobs`: each token's text, offset
/// and log-probability with its `alternatives` likeliest (the first token's `null`).
pub fn push_echoed_logprobs(
    tokenizer: &Arc<ModelTokenizer>,
    prompt_ids: &[u32],
    scores: &[PromptTokenLogprob],
    alternatives: u32,
    offsets: &mut CharOffsets,
    out: &mut CompletionLogprobs,
) {
    for (i, &id) in prompt_ids.iter().enumerate() {
        // Entry i scores prompt token i + 1; the first token has none.
        let score = i.checked_sub(1).and_then(|before| scores.get(before));
        let listed = score.map(|score| (score.logprob, &score.top[..score.top.len().min(alternatives as usize)]));
        out.push_token(tokenizer, offsets, id, true, listed);
    }
}
