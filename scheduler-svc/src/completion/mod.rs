//! Every way a sequence ends, decided here, in DESIGN.md §3's priority order, as one typed
//! [`Outcome`]:
//!
//! 1. cancellation — the client went away ([`is_abandoned`]; the engine asks between steps);
//! 2. the newest token ([`token`]): max tokens → EOS / stop token ids (whose text is left out
//!    unless `include_stop_str_in_output`, as vLLM leaves it out) → the model's context →
//!    confidence;
//! 3. the text ([`text`]): stop strings (matched across tokens, trimmed unless asked to keep
//!    them) → the character limit; a stop string the newest token completed outranks max tokens
//!    and the context running out on that same token (the output is trimmed at it, and vLLM
//!    reports it so too);
//! 4. a token that cannot be detokenized fails the request ([`Outcome::Failed`]).

mod text;
mod token;

pub use text::{OutputText, TextProgress};
pub use token::check_token_completion;

use crate::request::{EngineError, FinishReason};
use crate::sequence::Sequence;
use crate::tokenizer::ModelTokenizer;

/// What one new token means for its sequence.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Send this text (possibly empty while held back); generation goes on.
    Continue(String),
    /// Send this last text and finish for this reason.
    Finished(FinishReason, String),
    /// The request cannot go on.
    Failed(EngineError),
}

/// The client dropped its stream or call: nobody wants the result.
pub fn is_abandoned(seq: &Sequence) -> bool {
    seq.events.is_closed()
}

/// What the model's limits say of a sequence's tokens.
pub struct Limits<'a> {
    pub eos_token_ids: &'a [u32],
    pub max_model_len: usize,
}

/// Decides what `seq`'s newest token (already appended to `seq.tokens`, with its log-probability
/// `logprob`) means: the text it completes, and whether the sequence ends.
pub fn after_token(seq: &mut Sequence, logprob: f32, limits: &Limits<'_>, tokenizer: &ModelTokenizer) -> Outcome {
    let Some(&token) = seq.tokens.last() else {
        return Outcome::Continue(String::new());
    };
    let token_reason = check_token_completion(seq, limits.eos_token_ids, limits.max_model_len, logprob);
    // The token that stops the output (EOS, a stop token id) adds no text unless the request
    // keeps what stopped it, as in vLLM (its id is still the output's last); nor does a character
    // left incomplete before it, which vLLM's detokenizer never emits either.
    let stopping_token = matches!(token_reason, Some(FinishReason::EosToken | FinishReason::StopToken));
    let silent = stopping_token && !seq.request.stopping.include_stop_str_in_output;
    let mut delta = if silent {
        String::new()
    } else {
        match seq.detokenizer.push(tokenizer, token) {
            Ok(text) => text,
            Err(error) => return Outcome::Failed(EngineError::Detokenize(error.to_string())),
        }
    };
    if token_reason.is_some() && !silent {
        match seq.detokenizer.flush(tokenizer) {
            Ok(rest) => delta.push_str(&rest),
            Err(error) => return Outcome::Failed(EngineError::Detokenize(error.to_string())),
        }
    }
    let min_reached = seq.num_generated() >= seq.request.stopping.min_new_tokens as usize;
    match (seq.output.push(&delta, min_reached), token_reason) {
        (TextProgress::Continue(text), None) => Outcome::Continue(text),
        (TextProgress::Continue(mut text), Some(reason)) => {
            text.push_str(&seq.output.finish());
            Outcome::Finished(reason, text)
        }
        // A stop string the token's text completed names the finish over the budget running out
        // on the same token (max tokens, the context), as vLLM's does: the text is trimmed at it.
        (TextProgress::StopString(text), Some(FinishReason::MaxTokens | FinishReason::Length) | None) => {
            Outcome::Finished(FinishReason::StopString, text)
        }
        // Otherwise a token reason outranks what the same token's text did.
        (TextProgress::StopString(text) | TextProgress::CharLimit(text), Some(reason)) => {
            Outcome::Finished(reason, text)
        }
        (TextProgress::CharLimit(text), None) => Outcome::Finished(FinishReason::Length, text),
    }
}
