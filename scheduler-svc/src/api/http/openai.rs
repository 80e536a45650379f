//! OpenAI's JSON shapes (with vLLM's extras) for completions and chat completions. One request
//! type serves both endpoints: each endpoint refuses the other's fields, and every parameter
//! Rivulet does not support is refused by name (unknown fields are refused by serde), never
//! silently ignored. Optional parameters take `null` as "not given", as OpenAI's API does.

use serde::{Deserialize, Serialize};

use super::lax_integer;
use super::tool_calls::ToolCall;
use crate::token_piece::{CharOffsets, TokenPiece};
use crate::tokenizer::ModelTokenizer;

// Each untagged enum names what it takes (`expecting`): serde's own message would name the Rust
// type ("data did not match any variant of untagged enum PromptInput").
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, an array of token ids, or an array holding one prompt (string or token ids)"
)]
pub enum PromptInput {
    Text(String),
    TokenIds(Vec<u32>),
    Texts(Vec<String>),
    TokenIdBatches(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or an array of strings")]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

impl StopInput {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopInput::One(stop) => vec![stop],
            StopInput::Many(stops) => stops,
        }
    }
}

/// Completions take a count of alternatives, chat a flag (with `top_logprobs`).
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "true or false (chat), or a count of alternatives (completions)"
)]
pub enum LogprobsInput {
    Flag(bool),
    Count(#[serde(deserialize_with = "lax_integer::integer")] u32),
}

/// `priority` by name (`low`, `normal`, `high`, `critical`), or as vLLM's integer, where lower is
/// served earlier and 0 is the default: so that a vLLM client's `"priority": 0` is not refused.
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "low, normal, high or critical, or an integer (vLLM's: lower is served earlier)"
)]
pub enum PriorityInput {
    Name(String),
    Level(#[serde(deserialize_with = "lax_integer::integer")] i64),
}

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or an array of content parts")]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
    /// Any other field, kept so that the refusal can name it (an untagged enum's own error
    /// could not): unknown fields are refused here as everywhere else.
    #[serde(flatten)]
    pub other: std::collections::BTreeMap<String, serde_json::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputMessage {
    pub role: String,
    /// May be null on an assistant's message that made tool calls.
    pub content: Option<MessageContent>,
    /// A participant's name: accepted, not shown to the model (the chat template has no place for it).
    pub name: Option<String>,
    /// An assistant's earlier calls (`tool_calls` of a response, sent back in the conversation).
    pub tool_calls: Option<Vec<InputToolCall>>,
    /// A `tool` message's: the call it answers. Accepted, not shown to the model.
    pub tool_call_id: Option<String>,
    // A response's message sent back as the `openai` package dumps it (`message.model_dump()`):
    // its other fields, taken and not shown to the model.
    #[allow(dead_code)]
    pub refusal: Option<String>,
    #[allow(dead_code)]
    pub annotations: Option<Vec<serde_json::Value>>,
    #[allow(dead_code)]
    pub audio: Option<serde_json::Value>,
    /// OpenAI's deprecated call: refused unless null (calls go in `tool_calls`).
    pub function_call: Option<serde_json::Value>,
}

/// A call an assistant made, sent back in a conversation: OpenAI's shape, shown to the model as
/// JSON (`index` is taken from clients that gather a stream's parts).
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct InputToolCall {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    pub id: String,
    #[serde(rename = "type")]
    pub kind: ToolKind,
    pub function: InputFunctionCall,
}

/// A tool's `type`: OpenAI's one kind (any other is refused while parsing).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolKind {
    Function,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct InputFunctionCall {
    pub name: String,
    /// JSON text, as a response gives it.
    pub arguments: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
    /// vLLM's usage on every chunk: taken at its default (false), refused otherwise.
    pub continuous_usage_stats: Option<bool>,
}

/// A `/v1/completions` or `/v1/chat/completions` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerationBody {
    pub model: Option<String>,
    /// Completions only.
    pub prompt: Option<PromptInput>,
    /// Chat only.
    pub messages: Option<Vec<InputMessage>>,
    #[serde(default, deserialize_with = "lax_integer::option")]
    pub max_tokens: Option<u32>,
    /// Chat's newer name for `max_tokens`.
    #[serde(default, deserialize_with = "lax_integer::option")]
    pub max_completion_tokens: Option<u32>,
    // Numbers as JSON's (f64), checked as sent and then narrowed (`validation::narrow`): read as
    // f32 directly, `1e-50` would become 0 and `1e39` infinite, refused where vLLM takes them.
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    /// Token ids (as strings) to what is added to their logits, -100 to 100 (OpenAI's).
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    /// vLLM's range, a signed 64-bit integer; -1 is vLLM's "no seed".
    #[serde(default, deserialize_with = "lax_integer::option")]
    pub seed: Option<i64>,
    pub stop: Option<StopInput>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub logprobs: Option<LogprobsInput>,
    /// Chat only.
    #[serde(default, deserialize_with = "lax_integer::option")]
    pub top_logprobs: Option<u32>,
    pub user: Option<String>,
    // vLLM's extras.
    #[serde(default, deserialize_with = "lax_integer::option")]
    pub top_k: Option<i32>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub ignore_eos: Option<bool>,
    #[serde(default, deserialize_with = "lax_integer::option")]
    pub min_tokens: Option<u32>,
    #[serde(default, deserialize_with = "lax_integer::option_list")]
    pub stop_token_ids: Option<Vec<u32>>,
    pub include_stop_str_in_output: Option<bool>,
    /// Only these tokens may be chosen.
    #[serde(default, deserialize_with = "lax_integer::option_list")]
    pub allowed_token_ids: Option<Vec<u32>>,
    /// Also return the generated token ids (`choices[].token_ids`).
    pub return_token_ids: Option<bool>,
    /// vLLM's: whether the tokenizer adds its special tokens (a BOS) to the prompt. Accepted for
    /// its clients; Rivulet reads every prompt as written (SmolLM2's tokenizer adds none).
    pub add_special_tokens: Option<bool>,
    /// Each prompt token's log-probability (after the first), with this many alternatives.
    #[serde(default, deserialize_with = "lax_integer::option")]
    pub prompt_logprobs: Option<u32>,
    /// Chat only (vLLM's): open the assistant's turn after the messages (default true).
    pub add_generation_prompt: Option<bool>,
    /// Chat only (vLLM's): leave the last message open for the model to continue.
    pub continue_final_message: Option<bool>,
    /// Rivulet's confidence stop: end at the first token less likely than this (0-1).
    pub confidence_threshold: Option<f64>,
    /// Rivulet's scheduling class, or vLLM's integer (lower is served earlier).
    pub priority: Option<PriorityInput>,
    /// Completions only: the prompt repeated before each choice's text (and its tokens before
    /// the choice's in `logprobs`).
    pub echo: Option<bool>,
    // OpenAI parameters Rivulet refuses unless they ask for the default.
    #[serde(default, deserialize_with = "lax_integer::option")]
    pub n: Option<u32>,
    #[serde(default, deserialize_with = "lax_integer::option")]
    pub best_of: Option<u32>,
    pub suffix: Option<String>,
    // vLLM's extras that clients send at their defaults; refused otherwise.
    /// Default true: special tokens are left out of the text.
    pub skip_special_tokens: Option<bool>,
    /// Default true.
    pub spaces_between_special_tokens: Option<bool>,
    /// Default false.
    pub use_beam_search: Option<bool>,
    /// Default 1 (beam search's).
    pub length_penalty: Option<f64>,
    /// Default none (no truncation).
    pub truncate_prompt_tokens: Option<serde_json::Value>,
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
    pub functions: Option<serde_json::Value>,
    pub function_call: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<serde_json::Value>,
    // Structured outputs (`structured_output.rs` reads them): OpenAI's, then vLLM's.
    pub response_format: Option<serde_json::Value>,
    pub structured_outputs: Option<serde_json::Value>,
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    pub guided_whitespace_pattern: Option<String>,
    /// vLLM's choice of library; Rivulet has one, whatever is named.
    #[allow(dead_code)]
    pub guided_decoding_backend: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct UsageBody {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

/// `/v1/completions` logprobs: parallel lists, one entry per token; `null` for an echoed prompt's
/// first token, which nothing precedes.
#[derive(Debug, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<serde_json::Map<String, serde_json::Value>>>,
    pub text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// Appends one token: its text, where it starts in the choice's text, and, where it is scored
    /// (`score`: its logprob and the alternatives to list), its logprob and `top_logprobs` — the
    /// token itself, then the alternatives, up to `logprobs` + 1 entries as OpenAI defines them
    /// and vLLM lists them. `special_as_written`: the text holds a special token as written
    /// (`<|im_end|>`, an echoed prompt's), not left out (an output's).
    pub fn push_token(
        &mut self,
        tokenizer: &ModelTokenizer,
        offsets: &mut CharOffsets,
        token_id: u32,
        special_as_written: bool,
        score: Option<(f32, &[(u32, f32)])>,
    ) {
        let piece = TokenPiece::of(tokenizer, token_id);
        self.text_offset.push(offsets.offset());
        if special_as_written && piece.text_bytes.is_empty() {
            offsets.push(piece.text.as_bytes());
        } else {
            offsets.push(&piece.text_bytes);
        }
        self.token_logprobs.push(score.map(|(logprob, _)| logprob));
        self.top_logprobs.push(score.map(|(logprob, alternatives)| {
            let mut top = serde_json::Map::new();
            for (id, value) in std::iter::once((token_id, logprob)).chain(alternatives.iter().copied()) {
                top.entry(TokenPiece::of(tokenizer, id).text)
                    .or_insert(serde_json::json!(value));
            }
            top
        }));
        self.tokens.push(piece.text);
    }
}

/// One entry of vLLM's `prompt_logprobs` (keyed by token id): a prompt token's and each
/// alternative's log-probability, rank and text.
#[derive(Debug, Serialize)]
pub struct PromptLogprobEntry {
    pub logprob: f32,
    pub rank: u32,
    pub decoded_token: String,
}

/// `/v1/chat/completions` logprobs: one object per token.
#[derive(Debug, Default, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Debug, Serialize)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// One choice of a response or chunk; `text` for completions, `message` / `delta` for chat.
#[derive(Debug, Serialize)]
pub struct Choice {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<AssistantMessage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<AssistantMessage>,
    pub logprobs: Option<serde_json::Value>,
    pub finish_reason: Option<&'static str>,
    /// vLLM's field: the stop string or stop token id that ended the output, "low_confidence"
    /// for Rivulet's confidence stop, else null (EOS, the length, and chunks before the last).
    pub stop_reason: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    /// Completions' (vLLM's `return_token_ids`): the prompt's ids, in a stream on the choice's
    /// first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// Completions' (vLLM's `prompt_logprobs`): `null` for the first prompt token, then an
    /// object per token from token ids to [`PromptLogprobEntry`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<serde_json::Value>,
}

impl Choice {
    /// A stream's chunk for this choice would carry nothing: no text or calls, no logprobs or
    /// ids, no finish.
    pub fn says_nothing(&self) -> bool {
        let empty_delta = self
            .delta
            .as_ref()
            .is_some_and(|delta| delta.content.is_none() && delta.tool_calls.is_none());
        empty_delta
            && self.logprobs.is_none()
            && self.finish_reason.is_none()
            && self.token_ids.is_none()
            && self.prompt_token_ids.is_none()
    }
}

/// A whole response or one streamed chunk.
#[derive(Debug, Serialize)]
pub struct ResponseBody {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<Choice>,
    /// Chat's (vLLM's `return_token_ids`): the prompt's ids, in a stream on each choice's first
    /// chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// Chat's (vLLM's `prompt_logprobs`), shaped as a completions choice's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<serde_json::Value>,
    /// Left out where the response has no usage; `null` in every chunk but the last of a stream
    /// asked for its usage (`stream_options.include_usage`), as OpenAI sends them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageBody>>,
}

#[derive(Debug, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: u32,
}

#[derive(Debug, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}
