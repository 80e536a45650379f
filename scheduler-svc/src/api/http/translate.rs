//! OpenAI's request body → the domain's [`RequestDraft`], and domain field names back into
//! OpenAI's parameter names for errors. Refusals of what Rivulet does not support happen here.

use super::errors::ApiError;
use super::openai::{GenerationBody, InputMessage, LogprobsInput, MessageContent, PriorityInput, PromptInput};
use super::prompt_echo::PromptEcho;
use super::structured_output;
use super::tool_calls::{self, ToolOutput};
use crate::api::validation::{chat_ending, Field, Prompt, RequestDraft, SamplingDraft, StoppingDraft};
use crate::chat_template::ChatMessage;
use crate::request::Priority;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    /// The response's `object`: whole, or one streamed chunk.
    pub fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    /// How this endpoint names a domain field.
    pub fn param_name(self, field: Field) -> &'static str {
        match field {
            Field::Prompt | Field::PromptTokenIds => "prompt",
            Field::Messages => "messages",
            Field::Model => "model",
            Field::Temperature => "temperature",
            Field::TopK => "top_k",
            Field::TopP => "top_p",
            Field::MinP => "min_p",
            Field::RepetitionPenalty => "repetition_penalty",
            Field::FrequencyPenalty => "frequency_penalty",
            Field::PresencePenalty => "presence_penalty",
            Field::TopLogprobs if self == Endpoint::Completions => "logprobs",
            Field::TopLogprobs => "top_logprobs",
            Field::PromptLogprobs => "prompt_logprobs",
            Field::LogitBias => "logit_bias",
            Field::AllowedTokenIds => "allowed_token_ids",
            Field::MaxNewTokens => "max_tokens",
            Field::Stop => "stop",
            Field::StopTokenIds => "stop_token_ids",
            Field::MinNewTokens => "min_tokens",
            Field::MaxResponseChars => "max_response_chars",
            Field::ConfidenceThreshold => "confidence_threshold",
            Field::Priority => "priority",
            Field::AddGenerationPrompt => "add_generation_prompt",
            Field::ContinueFinalMessage => "continue_final_message",
            Field::StructuredOutput(param) => param,
        }
    }
}

fn unsupported(param: &'static str, what: &str) -> ApiError {
    ApiError::bad_request(param, format!("{param}: {what} is not supported"))
}

/// Refuses every OpenAI parameter Rivulet does not implement, unless it asks for the default.
fn refuse_unsupported(endpoint: Endpoint, body: &GenerationBody) -> Result<(), ApiError> {
    if body.n == Some(0) {
        return Err(ApiError::bad_request("n", "n: must be at least 1"));
    }
    // `best_of` above `n` ranks candidates by likelihood, which Rivulet does not; equal to `n` it
    // asks for nothing more.
    if body.best_of.is_some_and(|best_of| best_of != body.n.unwrap_or(1)) {
        return Err(unsupported("best_of", "best_of other than n (ranking candidates)"));
    }
    if body.suffix.is_some() {
        return Err(unsupported("suffix", "a suffix (insertion)"));
    }
    // vLLM's extras, taken at their defaults (clients send them so), refused otherwise.
    for (param, changed, what) in [
        (
            "skip_special_tokens",
            body.skip_special_tokens == Some(false),
            "special tokens in the text (false)",
        ),
        (
            "spaces_between_special_tokens",
            body.spaces_between_special_tokens == Some(false),
            "false",
        ),
        ("use_beam_search", body.use_beam_search == Some(true), "beam search"),
        (
            "length_penalty",
            body.length_penalty.is_some_and(|penalty| penalty != 1.0),
            "a length penalty (beam search's) other than 1",
        ),
        (
            "truncate_prompt_tokens",
            body.truncate_prompt_tokens
                .as_ref()
                .is_some_and(|value| !value.is_null()),
            "truncating the prompt",
        ),
    ] {
        if changed {
            return Err(unsupported(param, what));
        }
    }
    let absent_or_none = |value: &Option<serde_json::Value>| match value {
        None | Some(serde_json::Value::Null) => true,
        Some(serde_json::Value::String(s)) => s == "none",
        Some(_) => false,
    };
    // Without tools, `tool_choice: "auto"` and `parallel_tool_calls` change nothing (agent
    // frameworks send them by default). Chat's tools are read in `tool_calls`; completions have
    // none, and OpenAI's deprecated `functions` are refused.
    let harmless_choice = |value: &Option<serde_json::Value>| {
        absent_or_none(value) || value.as_ref().and_then(|v| v.as_str()) == Some("auto")
    };
    let no_tools = |value: &Option<serde_json::Value>| {
        absent_or_none(value) || value == &Some(serde_json::Value::Array(Vec::new()))
    };
    let completions = endpoint == Endpoint::Completions;
    for (param, refused, what) in [
        (
            "tools",
            completions && !no_tools(&body.tools),
            "tools on completions (chat takes them)",
        ),
        (
            "tool_choice",
            completions && !harmless_choice(&body.tool_choice),
            "tool_choice on completions (chat takes it)",
        ),
        (
            "functions",
            !no_tools(&body.functions),
            "functions (send them as tools)",
        ),
        (
            "function_call",
            !harmless_choice(&body.function_call),
            "function_call (send it as tool_choice)",
        ),
    ] {
        if refused {
            return Err(unsupported(param, what));
        }
    }
    Ok(())
}

/// Choices one request may ask for in all (prompts × `n`): each is a sequence of its own.
pub const MAX_CHOICES: usize = 64;

/// The prompts of a completions request: one text or list of token ids, or a batch of either.
fn completion_prompts(prompt: Option<PromptInput>) -> Result<Vec<Prompt>, ApiError> {
    let prompts: Vec<Prompt> = match prompt {
        None => return Err(ApiError::bad_request("prompt", "prompt: is required")),
        Some(PromptInput::Text(text)) => vec![Prompt::Text(text)],
        Some(PromptInput::TokenIds(ids)) => vec![Prompt::TokenIds(ids)],
        Some(PromptInput::Texts(texts)) => texts.into_iter().map(Prompt::Text).collect(),
        Some(PromptInput::TokenIdBatches(batches)) => batches.into_iter().map(Prompt::TokenIds).collect(),
    };
    if prompts.is_empty() {
        return Err(ApiError::bad_request("prompt", "prompt: an empty batch of prompts"));
    }
    Ok(prompts)
}

fn chat_messages(body: &mut GenerationBody) -> Result<Prompt, ApiError> {
    chat_prompt(
        body.messages.take(),
        body.add_generation_prompt,
        body.continue_final_message,
    )
}

/// Refuses the chat template's options given with a prompt that is not a conversation, saying
/// where they `belong`.
pub fn refuse_chat_options(
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    belong: &str,
) -> Result<(), ApiError> {
    for (param, given) in [
        ("add_generation_prompt", add_generation_prompt.is_some()),
        ("continue_final_message", continue_final_message.is_some()),
    ] {
        if given {
            return Err(ApiError::bad_request(param, format!("{param}: belongs to {belong}")));
        }
    }
    Ok(())
}

/// A conversation as the domain's prompt: the messages' contents (text parts joined), and how
/// the chat template ends it.
pub fn chat_prompt(
    messages: Option<Vec<InputMessage>>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
) -> Result<Prompt, ApiError> {
    let messages = messages.ok_or_else(|| ApiError::bad_request("messages", "messages: is required"))?;
    let mut converted = Vec::with_capacity(messages.len());
    for (index, message) in messages.into_iter().enumerate() {
        if message.function_call.as_ref().is_some_and(|call| !call.is_null()) {
            return Err(unsupported(
                "messages",
                &format!("messages[{index}].function_call (send calls as tool_calls)"),
            ));
        }
        let calls = match message.tool_calls {
            Some(calls) if message.role != "assistant" && !calls.is_empty() => {
                return Err(ApiError::bad_request(
                    "messages",
                    format!("messages[{index}].tool_calls: only an assistant's message makes calls"),
                ));
            }
            Some(calls) if !calls.is_empty() => Some(serde_json::to_string(&calls).unwrap_or_default()),
            _ => None,
        };
        let content = match message.content {
            None if calls.is_some() => String::new(),
            None => {
                return Err(ApiError::bad_request(
                    "messages",
                    format!("messages[{index}].content: is required (null only beside an assistant's tool_calls)"),
                ))
            }
            Some(MessageContent::Text(text)) => text,
            Some(MessageContent::Parts(parts)) => {
                // The text parts joined by newlines, as vLLM joins them.
                let mut texts = Vec::with_capacity(parts.len());
                for part in parts {
                    if let Some(field) = part.other.keys().next() {
                        return Err(ApiError::bad_request(
                            "messages",
                            format!("messages: a content part's field {field:?} is not supported"),
                        ));
                    }
                    match (part.kind.as_str(), part.text) {
                        ("text", Some(part_text)) => texts.push(part_text),
                        ("text", None) => {
                            return Err(ApiError::bad_request(
                                "messages",
                                "messages: a content part of type \"text\" needs its \"text\"",
                            ));
                        }
                        (kind, _) => {
                            return Err(unsupported("messages", &format!("a content part of type {kind:?}")));
                        }
                    }
                }
                texts.join("\n")
            }
        };
        // An assistant's calls are shown to the model as the JSON they came back as, after any
        // text of its turn (a template with no place for calls would show it nothing; a
        // response's calls come with empty content, and clients send both back as they were).
        let content = match calls {
            Some(calls) if content.is_empty() => calls,
            Some(calls) => format!("{content}\n{calls}"),
            None => content,
        };
        // Roles as sent: a `developer` message is renamed where the template does not name the
        // role, as vLLM renames it (`rivulet_text`'s chat template does that for both fronts).
        converted.push(ChatMessage {
            role: message.role,
            content,
        });
    }
    let ending = chat_ending(add_generation_prompt, continue_final_message.unwrap_or(false))
        .map_err(|e| ApiError::submit(Endpoint::Chat, e.into()))?;
    Ok(Prompt::Messages {
        messages: converted,
        ending,
    })
}

/// The output's limit and the parameter that set it (named in its errors): chat takes
/// `max_completion_tokens`, OpenAI's newer name, over `max_tokens`, as vLLM does; vLLM's
/// completions know only `max_tokens`, so there `max_completion_tokens` counts only without it.
pub fn output_limit(endpoint: Endpoint, body: &GenerationBody) -> (Option<u32>, &'static str) {
    match (endpoint, body.max_tokens, body.max_completion_tokens) {
        (Endpoint::Chat, _, Some(limit)) | (Endpoint::Completions, None, Some(limit)) => {
            (Some(limit), "max_completion_tokens")
        }
        (_, limit, _) => (limit, "max_tokens"),
    }
}

/// `priority` by name, or vLLM's integer mapped onto the classes in its order (lower is served
/// earlier): 0 the default class, -1 high, anything lower critical, anything above 0 low.
fn priority(input: Option<PriorityInput>) -> Result<Priority, ApiError> {
    match input {
        None => Ok(Priority::Normal),
        Some(PriorityInput::Level(level)) => Ok(match level {
            ..=-2 => Priority::Critical,
            -1 => Priority::High,
            0 => Priority::Normal,
            1.. => Priority::Low,
        }),
        Some(PriorityInput::Name(name)) => match name.as_str() {
            "normal" => Ok(Priority::Normal),
            "low" => Ok(Priority::Low),
            "high" => Ok(Priority::High),
            "critical" => Ok(Priority::Critical),
            other => Err(ApiError::bad_request(
                "priority",
                format!("priority: {other:?} is not low, normal, high or critical (or vLLM's integer)"),
            )),
        },
    }
}

/// A body for `endpoint` as the domain's drafts: one per choice, prompt by prompt, `n` choices
/// each (OpenAI's order: choice `prompt · n + j`). With a `seed`, choice `j` of a prompt samples
/// with `seed + j`, so that its choices differ and a rerun gives the same ones. Only the first
/// draft keeps `id`; the others are `id-1`, `id-2`, … (their log lines and summaries). Beside
/// them, what a chat request's `tool_choice` makes of each choice's output (`tool_calls`).
pub fn to_drafts(
    endpoint: Endpoint,
    id: String,
    body: GenerationBody,
) -> Result<(Vec<RequestDraft>, Option<ToolOutput>), ApiError> {
    let n = body.n.unwrap_or(1) as usize;
    let FirstDraft {
        draft: first,
        prompts,
        tool_output,
    } = to_draft(endpoint, id, body)?;
    if prompts.len().saturating_mul(n) > MAX_CHOICES {
        return Err(ApiError::bad_request(
            "n",
            format!(
                "n: {} prompts × n {n} choices exceed the {MAX_CHOICES} a request may ask for",
                prompts.len()
            ),
        ));
    }
    let mut drafts = Vec::with_capacity(prompts.len() * n);
    for prompt in prompts {
        for j in 0..n {
            let mut draft = first.clone();
            if !drafts.is_empty() {
                draft.id = format!("{}-{}", first.id, drafts.len());
            }
            draft.prompt = prompt.clone();
            draft.sampling.seed = first.sampling.seed.map(|seed| seed.wrapping_add(j as u64));
            drafts.push(draft);
        }
    }
    Ok((drafts, tool_output))
}

/// OpenAI's `logit_bias`: an object from token ids (strings, as JSON keys are) to numbers.
fn logit_bias(bias: Option<serde_json::Map<String, serde_json::Value>>) -> Result<Vec<(u32, f32)>, ApiError> {
    let invalid = |message: String| ApiError::bad_request("logit_bias", format!("logit_bias: {message}"));
    bias.unwrap_or_default()
        .into_iter()
        .map(|(key, value)| {
            let token: u32 = key
                .trim()
                .parse()
                .map_err(|_| invalid(format!("key {key:?} is not a token id")))?;
            match value.as_f64() {
                Some(bias) => Ok((token, bias as f32)),
                None => Err(invalid(format!(
                    "the bias of token {token} must be a number, not {value}"
                ))),
            }
        })
        .collect()
}

/// A request read: the draft of its first prompt, every prompt, and what its tool choice makes
/// of the output.
struct FirstDraft {
    draft: RequestDraft,
    prompts: Vec<Prompt>,
    tool_output: Option<ToolOutput>,
}

fn to_draft(endpoint: Endpoint, id: String, mut body: GenerationBody) -> Result<FirstDraft, ApiError> {
    refuse_unsupported(endpoint, &body)?;
    let echo = PromptEcho::from_body(endpoint, &body)?;
    // The prompt alone: one token generated and left out of the response, as vLLM does.
    let max_new_tokens = match output_limit(endpoint, &body) {
        _ if echo.echo_only => Some(1),
        (limit, _) => limit,
    };
    let prompts = match endpoint {
        Endpoint::Completions => {
            if body.messages.is_some() {
                return Err(ApiError::bad_request(
                    "messages",
                    "messages: belongs to /v1/chat/completions; send a prompt here",
                ));
            }
            refuse_chat_options(
                body.add_generation_prompt,
                body.continue_final_message,
                "/v1/chat/completions (it shapes the chat template's prompt)",
            )?;
            completion_prompts(body.prompt.take())?
        }
        Endpoint::Chat => {
            if body.prompt.is_some() {
                return Err(ApiError::bad_request(
                    "prompt",
                    "prompt: belongs to /v1/completions; send messages here",
                ));
            }
            vec![chat_messages(&mut body)?]
        }
    };
    let guide = structured_output::from_body(&mut body)?;
    // Tools on completions were refused above.
    let (guide, tool_output) = match tool_calls::from_body(&mut body, guide.as_ref().map(|(_, param)| *param))? {
        Some((calls, output)) => (Some((calls, "tools")), Some(output)),
        None => (guide, None),
    };
    let (logprobs, top_logprobs) = match (endpoint, body.logprobs, body.top_logprobs) {
        (_, None, None) => (false, 0),
        (Endpoint::Completions, Some(LogprobsInput::Count(count)), None) => (true, count),
        (Endpoint::Completions, _, Some(_)) => {
            return Err(ApiError::bad_request(
                "top_logprobs",
                "top_logprobs: belongs to chat; completions take logprobs: <count>",
            ))
        }
        (Endpoint::Completions, Some(LogprobsInput::Flag(_)), None) => {
            return Err(ApiError::bad_request(
                "logprobs",
                "logprobs: completions take a count of alternatives (0-20)",
            ))
        }
        (Endpoint::Chat, Some(LogprobsInput::Flag(true)), top) => (true, top.unwrap_or(0)),
        (Endpoint::Chat, Some(LogprobsInput::Flag(false)), None) => (false, 0),
        // As vLLM: alternatives without logprobs is a contradiction, not a request for none.
        (Endpoint::Chat, None | Some(LogprobsInput::Flag(false)), Some(_)) => {
            return Err(ApiError::bad_request(
                "top_logprobs",
                "top_logprobs: needs logprobs: true",
            ))
        }
        (Endpoint::Chat, Some(LogprobsInput::Count(_)), _) => {
            return Err(ApiError::bad_request(
                "logprobs",
                "logprobs: chat takes true or false (and top_logprobs)",
            ))
        }
    };
    if let Some(user) = &body.user {
        tracing::debug!(request_id = %id, %user, "end user");
    }
    let draft = RequestDraft {
        id,
        model: body.model,
        prompt: prompts[0].clone(),
        sampling: SamplingDraft {
            temperature: body.temperature,
            top_k: body.top_k,
            top_p: body.top_p,
            min_p: body.min_p,
            repetition_penalty: body.repetition_penalty,
            frequency_penalty: body.frequency_penalty,
            presence_penalty: body.presence_penalty,
            // The seed's bits: a negative seed is as good a seed (vLLM takes them), but for -1.
            seed: body.seed.filter(|&seed| seed != -1).map(|seed| seed as u64),
            logprobs,
            top_logprobs,
            logit_bias: logit_bias(body.logit_bias)?,
            allowed_token_ids: body.allowed_token_ids,
            prompt_logprobs: echo.engine_prompt_logprobs(),
            guide,
        },
        stopping: StoppingDraft {
            max_new_tokens,
            // vLLM's defaults: completions take the server's default, chat the rest of the context.
            default_to_rest_of_context: endpoint == Endpoint::Chat,
            prompt_alone: echo.echo_only,
            ignore_eos: body.ignore_eos.unwrap_or(false),
            stop: body.stop.map(|stop| stop.into_vec()).unwrap_or_default(),
            stop_token_ids: body.stop_token_ids.unwrap_or_default(),
            min_new_tokens: body.min_tokens.unwrap_or(0),
            max_response_chars: None,
            include_stop_str_in_output: body.include_stop_str_in_output.unwrap_or(false),
            confidence_threshold: body.confidence_threshold,
        },
        priority: priority(body.priority)?,
    };
    Ok(FirstDraft {
        draft,
        prompts,
        tool_output,
    })
}

#[cfg(test)]
mod tests;
