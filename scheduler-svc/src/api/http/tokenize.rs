//! vLLM's `POST /tokenize` and `POST /detokenize`: a prompt (or a conversation, through the chat
//! template) as the token ids the model would read for it, and ids back to text. Clients use them
//! to count a prompt against the context before sending it, or to build token-id prompts; both
//! go through the same validation and tokenizer as generation, so the count is the one a
//! request is held to.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};

use super::errors::ApiError;
use super::generate::{parse_json, BodyBytes};
use super::openai::InputMessage;
use super::translate::{chat_prompt, refuse_chat_options, Endpoint};
use super::HttpState;
use crate::api::validation::Prompt;

/// A `/tokenize` body: vLLM's completion form (`prompt`) or chat form (`messages`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeBody {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<InputMessage>>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    /// vLLM's: whether the tokenizer adds its special tokens (a BOS). Accepted for its clients;
    /// Rivulet reads every prompt as written, adding none, as generation reads it (SmolLM2's
    /// tokenizer adds none either way).
    pub add_special_tokens: Option<bool>,
    /// Also each token as text (`token_strs`).
    pub return_token_strs: Option<bool>,
}

#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: u32,
    pub tokens: Vec<u32>,
    pub token_strs: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeBody {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

pub async fn tokenize(State(state): State<HttpState>, body: BodyBytes) -> Response {
    match tokenize_body(&state, body) {
        Ok(response) => Json(response).into_response(),
        Err(error) => error.into_response(),
    }
}

fn tokenize_body(state: &HttpState, body: BodyBytes) -> Result<TokenizeResponse, ApiError> {
    let body: TokenizeBody = parse_json(body)?;
    let (endpoint, prompt) = match (body.prompt, body.messages) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "messages",
                "messages: give either prompt or messages, not both",
            ))
        }
        (Some(text), None) => {
            refuse_chat_options(
                body.add_generation_prompt,
                body.continue_final_message,
                "the chat form (messages)",
            )?;
            (Endpoint::Completions, Prompt::Text(text))
        }
        (None, messages @ Some(_)) => (
            Endpoint::Chat,
            chat_prompt(messages, body.add_generation_prompt, body.continue_final_message)?,
        ),
        (None, None) => {
            return Err(ApiError::bad_request(
                "prompt",
                "prompt: is required (or messages, the chat form)",
            ))
        }
    };
    let validator = &state.front.validator;
    validator
        .check_model(body.model)
        .map_err(|error| ApiError::submit(endpoint, error.into()))?;
    // An empty text is no tokens here, as in vLLM (generation refuses it).
    let tokens = match prompt {
        Prompt::Text(text) if text.is_empty() => Vec::new(),
        prompt => {
            validator
                .prompt_ids(prompt)
                .map_err(|error| ApiError::submit(endpoint, error.into()))?
                .1
        }
    };
    // vLLM's `token_strs`: the vocabulary's strings, which a byte-level vocabulary keeps apart
    // where decoded text would read `�` for every part of a character.
    let token_strs = body.return_token_strs.unwrap_or(false).then(|| {
        tokens
            .iter()
            .map(|&id| validator.tokenizer.token_string(id).unwrap_or_default())
            .collect()
    });
    Ok(TokenizeResponse {
        count: tokens.len(),
        max_model_len: state.front.engine.limits.max_model_len,
        tokens,
        token_strs,
    })
}

pub async fn detokenize(State(state): State<HttpState>, body: BodyBytes) -> Response {
    match detokenize_body(&state, body) {
        Ok(response) => Json(response).into_response(),
        Err(error) => error.into_response(),
    }
}

fn detokenize_body(state: &HttpState, body: BodyBytes) -> Result<DetokenizeResponse, ApiError> {
    let body: DetokenizeBody = parse_json(body)?;
    let validator = &state.front.validator;
    validator
        .check_model(body.model)
        .map_err(|error| ApiError::submit(Endpoint::Completions, error.into()))?;
    let vocab = validator.tokenizer.vocab_size();
    if let Some(bad) = body.tokens.iter().find(|&&id| id >= vocab) {
        return Err(ApiError::bad_request(
            "tokens",
            format!("tokens: {bad} is not below the vocabulary size {vocab}"),
        ));
    }
    // Special tokens written out, as vLLM's detokenizer (and an echo of token ids) writes them.
    let prompt = validator
        .tokenizer
        .decode_with_special(&body.tokens)
        .map_err(|error| ApiError::bad_request("tokens", format!("tokens: {error}")))?;
    Ok(DetokenizeResponse { prompt })
}
