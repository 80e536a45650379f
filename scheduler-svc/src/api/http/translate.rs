//! OpenAI's request body → the domain's [`RequestDraft`], and domain field names back into
//! OpenAI's parameter names for errors. Refusals of what Rivulet does not support happen here.

use super::errors::ApiError;
use super::openai::{GenerationBody, LogprobsInput, MessageContent, PriorityInput, PromptInput};
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
            Field::MaxNewTokens => "max_tokens",
            Field::Stop => "stop",
            Field::StopTokenIds => "stop_token_ids",
            Field::MinNewTokens => "min_tokens",
            Field::MaxResponseChars => "max_response_chars",
            Field::ConfidenceThreshold => "confidence_threshold",
            Field::Priority => "priority",
            Field::AddGenerationPrompt => "add_generation_prompt",
            Field::ContinueFinalMessage => "continue_final_message",
        }
    }
}

fn unsupported(param: &'static str, what: &str) -> ApiError {
    ApiError::bad_request(param, format!("{param}: {what} is not supported"))
}

/// Refuses every OpenAI parameter Rivulet does not implement, unless it asks for the default.
fn refuse_unsupported(body: &GenerationBody) -> Result<(), ApiError> {
    if body.n.is_some_and(|n| n != 1) {
        return Err(unsupported("n", "more than one choice"));
    }
    if body.best_of.is_some_and(|n| n != 1) {
        return Err(unsupported("best_of", "more than one candidate"));
    }
    if body.echo == Some(true) {
        return Err(unsupported("echo", "echoing the prompt"));
    }
    if body.suffix.is_some() {
        return Err(unsupported("suffix", "a suffix (insertion)"));
    }
    if body.logit_bias.as_ref().is_some_and(|bias| !bias.is_empty()) {
        return Err(unsupported("logit_bias", "biasing logits"));
    }
    let absent_or_none = |value: &Option<serde_json::Value>| match value {
        None | Some(serde_json::Value::Null) => true,
        Some(serde_json::Value::String(s)) => s == "none",
        Some(_) => false,
    };
    // Without tools, `tool_choice: "auto"` and `parallel_tool_calls` change nothing (agent
    // frameworks send them by default); tools themselves are refused.
    let harmless_choice = |value: &Option<serde_json::Value>| {
        absent_or_none(value) || value.as_ref().and_then(|v| v.as_str()) == Some("auto")
    };
    let no_tools = |value: &Option<serde_json::Value>| {
        absent_or_none(value) || value == &Some(serde_json::Value::Array(Vec::new()))
    };
    for (param, refused) in [
        ("tools", !no_tools(&body.tools)),
        ("functions", !no_tools(&body.functions)),
        ("tool_choice", !harmless_choice(&body.tool_choice)),
        ("function_call", !harmless_choice(&body.function_call)),
    ] {
        if refused {
            return Err(unsupported(param, "tool and function calling"));
        }
    }
    if let Some(format) = &body.response_format {
        if format.get("type").and_then(|t| t.as_str()) != Some("text") {
            return Err(unsupported("response_format", "a structured response format"));
        }
    }
    Ok(())
}

/// The prompt of a completions request: one text or one list of token ids.
fn completion_prompt(prompt: Option<PromptInput>) -> Result<Prompt, ApiError> {
    let one = |count: usize| -> Result<(), ApiError> {
        if count == 1 {
            Ok(())
        } else {
            Err(unsupported("prompt", "a batch of prompts (send one per request)"))
        }
    };
    match prompt {
        None => Err(ApiError::bad_request("prompt", "prompt: is required")),
        Some(PromptInput::Text(text)) => Ok(Prompt::Text(text)),
        Some(PromptInput::TokenIds(ids)) => Ok(Prompt::TokenIds(ids)),
        Some(PromptInput::Texts(mut texts)) => {
            one(texts.len())?;
            Ok(Prompt::Text(texts.remove(0)))
        }
        Some(PromptInput::TokenIdBatches(mut batches)) => {
            one(batches.len())?;
            Ok(Prompt::TokenIds(batches.remove(0)))
        }
    }
}

fn chat_messages(body: &mut GenerationBody) -> Result<Prompt, ApiError> {
    let messages = body
        .messages
        .take()
        .ok_or_else(|| ApiError::bad_request("messages", "messages: is required"))?;
    let mut converted = Vec::with_capacity(messages.len());
    for message in messages {
        let content = match message.content {
            MessageContent::Text(text) => text,
            MessageContent::Parts(parts) => {
                let mut text = String::new();
                for part in parts {
                    match (part.kind.as_str(), part.text) {
                        ("text", Some(part_text)) => text.push_str(&part_text),
                        (kind, _) => {
                            return Err(unsupported("messages", &format!("a content part of type {kind:?}")));
                        }
                    }
                }
                text
            }
        };
        // OpenAI's newer name for the system role.
        let role = if message.role == "developer" {
            "system".to_owned()
        } else {
            message.role
        };
        converted.push(ChatMessage { role, content });
    }
    let ending = chat_ending(body.add_generation_prompt, body.continue_final_message.unwrap_or(false))
        .map_err(|e| ApiError::bad_request("continue_final_message", e.to_string()))?;
    Ok(Prompt::Messages {
        messages: converted,
        ending,
    })
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

/// A body for `endpoint` as the domain's draft.
pub fn to_draft(endpoint: Endpoint, id: String, mut body: GenerationBody) -> Result<RequestDraft, ApiError> {
    refuse_unsupported(&body)?;
    let prompt = match endpoint {
        Endpoint::Completions => {
            if body.messages.is_some() {
                return Err(ApiError::bad_request(
                    "messages",
                    "messages: belongs to /v1/chat/completions; send a prompt here",
                ));
            }
            for (param, given) in [
                ("add_generation_prompt", body.add_generation_prompt.is_some()),
                ("continue_final_message", body.continue_final_message.is_some()),
            ] {
                if given {
                    return Err(ApiError::bad_request(
                        param,
                        format!("{param}: belongs to /v1/chat/completions (it shapes the chat template's prompt)"),
                    ));
                }
            }
            completion_prompt(body.prompt.take())?
        }
        Endpoint::Chat => {
            if body.prompt.is_some() {
                return Err(ApiError::bad_request(
                    "prompt",
                    "prompt: belongs to /v1/completions; send messages here",
                ));
            }
            chat_messages(&mut body)?
        }
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
        (Endpoint::Chat, Some(LogprobsInput::Flag(flag)), top) => (flag, top.unwrap_or(0)),
        (Endpoint::Chat, None, Some(_)) => {
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
    if body.max_tokens.is_some() && body.max_completion_tokens.is_some() {
        return Err(ApiError::bad_request(
            "max_completion_tokens",
            "max_completion_tokens: set it or max_tokens, not both",
        ));
    }
    if let Some(user) = &body.user {
        tracing::debug!(request_id = %id, %user, "end user");
    }
    Ok(RequestDraft {
        id,
        model: body.model,
        prompt,
        sampling: SamplingDraft {
            temperature: body.temperature,
            top_k: body.top_k,
            top_p: body.top_p,
            min_p: body.min_p,
            repetition_penalty: body.repetition_penalty,
            frequency_penalty: body.frequency_penalty,
            presence_penalty: body.presence_penalty,
            seed: body.seed,
            logprobs,
            top_logprobs,
        },
        stopping: StoppingDraft {
            max_new_tokens: body.max_tokens.or(body.max_completion_tokens),
            // vLLM's defaults: completions take the server's default, chat the rest of the context.
            default_to_rest_of_context: endpoint == Endpoint::Chat,
            ignore_eos: body.ignore_eos.unwrap_or(false),
            stop: body.stop.map(|stop| stop.into_vec()).unwrap_or_default(),
            stop_token_ids: body.stop_token_ids.unwrap_or_default(),
            min_new_tokens: body.min_tokens.unwrap_or(0),
            max_response_chars: None,
            include_stop_str_in_output: body.include_stop_str_in_output.unwrap_or(false),
            confidence_threshold: body.confidence_threshold,
        },
        priority: priority(body.priority)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat_template::ChatEnding;

    fn body(json: serde_json::Value) -> GenerationBody {
        serde_json::from_value(json).expect("a valid body")
    }

    fn refused(endpoint: Endpoint, json: serde_json::Value) -> Option<String> {
        to_draft(endpoint, "id".to_owned(), body(json))
            .err()
            .and_then(|e| e.param)
    }

    #[test]
    fn each_endpoint_takes_its_own_shape_and_names_what_it_refuses() {
        let draft = to_draft(
            Endpoint::Completions,
            "id".to_owned(),
            body(serde_json::json!({"prompt": [[1, 2, 3]], "logprobs": 2, "max_tokens": 5, "stop": "x"})),
        )
        .expect("completions");
        assert_eq!(draft.prompt, Prompt::TokenIds(vec![1, 2, 3]));
        assert_eq!((draft.sampling.logprobs, draft.sampling.top_logprobs), (true, 2));
        assert_eq!(draft.stopping.max_new_tokens, Some(5));
        assert_eq!(draft.stopping.stop, vec!["x".to_owned()]);

        let chat = to_draft(
            Endpoint::Chat,
            "id".to_owned(),
            body(serde_json::json!({
                "messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}],
                "logprobs": true, "top_logprobs": 3, "max_completion_tokens": 7
            })),
        )
        .expect("chat");
        let Prompt::Messages { messages, .. } = chat.prompt else {
            panic!("messages")
        };
        assert_eq!(
            (messages[0].role.as_str(), messages[0].content.as_str()),
            ("system", "Be brief.")
        );
        assert_eq!((chat.sampling.top_logprobs, chat.stopping.max_new_tokens), (3, Some(7)));

        let p = |s: &str| Some(s.to_owned());
        assert_eq!(refused(Endpoint::Chat, serde_json::json!({"prompt": "x"})), p("prompt"));
        assert_eq!(
            refused(Endpoint::Completions, serde_json::json!({"prompt": "x", "n": 2})),
            p("n")
        );
        assert_eq!(
            refused(Endpoint::Completions, serde_json::json!({"prompt": ["a", "b"]})),
            p("prompt")
        );
        assert_eq!(
            refused(
                Endpoint::Completions,
                serde_json::json!({"prompt": "x", "logprobs": true})
            ),
            p("logprobs")
        );
        assert_eq!(
            refused(
                Endpoint::Chat,
                serde_json::json!({"messages": [], "tools": [{"type": "function"}]})
            ),
            p("tools")
        );
        assert_eq!(
            refused(
                Endpoint::Chat,
                serde_json::json!({"messages": [], "priority": "urgent"})
            ),
            p("priority")
        );
        assert!(serde_json::from_value::<GenerationBody>(serde_json::json!({"prompt": "x", "best_of_n": 2})).is_err());
    }

    #[test]
    fn chat_takes_vllms_options_for_how_the_conversation_ends() {
        let ending = |extra: serde_json::Value| {
            let mut json = serde_json::json!({"messages": [{"role": "user", "content": "x"}]});
            json.as_object_mut()
                .expect("object")
                .extend(extra.as_object().expect("object").clone());
            match to_draft(Endpoint::Chat, "id".to_owned(), body(json)) {
                Ok(draft) => match draft.prompt {
                    Prompt::Messages { ending, .. } => Ok(ending),
                    other => panic!("not messages: {other:?}"),
                },
                Err(error) => Err(error.param),
            }
        };
        assert_eq!(ending(serde_json::json!({})), Ok(ChatEnding::AssistantTurn));
        assert_eq!(
            ending(serde_json::json!({"add_generation_prompt": false})),
            Ok(ChatEnding::MessagesOnly)
        );
        assert_eq!(
            ending(serde_json::json!({"continue_final_message": true})),
            Ok(ChatEnding::ContinueLastMessage)
        );
        assert_eq!(
            ending(serde_json::json!({"continue_final_message": true, "add_generation_prompt": false})),
            Ok(ChatEnding::ContinueLastMessage)
        );
        assert_eq!(
            ending(serde_json::json!({"continue_final_message": true, "add_generation_prompt": true})),
            Err(Some("continue_final_message".to_owned()))
        );
        assert_eq!(
            refused(
                Endpoint::Completions,
                serde_json::json!({"prompt": "x", "continue_final_message": true})
            ),
            Some("continue_final_message".to_owned())
        );
    }

    #[test]
    fn priority_takes_a_class_or_vllms_integer() {
        let of = |priority: serde_json::Value| {
            to_draft(
                Endpoint::Completions,
                "id".to_owned(),
                body(serde_json::json!({"prompt": "x", "priority": priority})),
            )
            .map(|draft| draft.priority)
            .ok()
        };
        assert_eq!(of(serde_json::json!("high")), Some(Priority::High));
        assert_eq!(of(serde_json::json!(null)), Some(Priority::Normal));
        assert_eq!(of(serde_json::json!(0)), Some(Priority::Normal));
        assert_eq!(of(serde_json::json!(-1)), Some(Priority::High));
        assert_eq!(of(serde_json::json!(-7)), Some(Priority::Critical));
        assert_eq!(of(serde_json::json!(3)), Some(Priority::Low));
    }

    #[test]
    fn a_value_of_the_wrong_shape_is_told_what_the_field_takes() {
        let message = |json: serde_json::Value| {
            serde_json::from_value::<GenerationBody>(json)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        for (json, expected) in [
            (serde_json::json!({"stop": 5}), "a string or an array of strings"),
            (serde_json::json!({"prompt": [1, "a"]}), "an array of token ids"),
            (
                serde_json::json!({"messages": [{"role": "user", "content": null}]}),
                "a string or an array of content parts",
            ),
            (serde_json::json!({"priority": 1.5}), "or an integer"),
        ] {
            let text = message(json);
            assert!(text.contains(expected) && !text.contains("untagged"), "{text}");
        }
    }
}
