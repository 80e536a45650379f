//! The `rivulet.v1.Generation` gRPC service: a thin adapter that validates, converts proto ⇄
//! domain types, hands requests to the engine and maps errors to `Status` in one place.

use std::pin::Pin;
use std::sync::Arc;

use rivulet::proto;
use rivulet::proto::generation_server::Generation;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::chat_template::ChatMessage;
use crate::engine::EngineHandle;
use crate::request::{
    EngineError, FinishReason, GenerationRequest, InvalidRequest, Priority, SequenceEvent, StoppingParams,
    TokenLogprob, Usage,
};

/// Stop strings a request may carry.
const MAX_STOP_STRINGS: usize = 8;
use crate::sampling_validation::sampling_params;
use crate::tokenizer::ModelTokenizer;

pub struct GenerationService {
    engine: EngineHandle,
    tokenizer: Arc<ModelTokenizer>,
    default_max_new_tokens: u32,
    default_stop_strings: Vec<String>,
}

impl GenerationService {
    pub fn new(
        engine: EngineHandle,
        tokenizer: Arc<ModelTokenizer>,
        default_max_new_tokens: u32,
        default_stop_strings: Vec<String>,
    ) -> Self {
        Self {
            engine,
            tokenizer,
            default_max_new_tokens,
            default_stop_strings,
        }
    }

    /// Validates and tokenizes a request; every error names the offending field.
    fn to_domain(&self, request: proto::GenerateRequest) -> Result<GenerationRequest, InvalidRequest> {
        let limits = &self.engine.limits;
        let max_model_len = limits.max_model_len as usize;
        let given = [
            !request.prompt.is_empty(),
            !request.prompt_token_ids.is_empty(),
            !request.messages.is_empty(),
        ];
        let prompt_field = match given {
            [true, false, false] => "prompt",
            [false, true, false] => "prompt_token_ids",
            [false, false, true] => "messages",
            [false, false, false] => {
                return Err(InvalidRequest::new(
                    "prompt",
                    "must not be empty (set prompt, prompt_token_ids or messages)",
                ))
            }
            _ => {
                return Err(InvalidRequest::new(
                    "prompt",
                    "set only one of prompt, prompt_token_ids and messages",
                ))
            }
        };
        let prompt_ids = match prompt_field {
            "prompt_token_ids" => {
                let vocab = limits.vocab_size;
                if let Some(bad) = request.prompt_token_ids.iter().find(|&&id| id >= vocab) {
                    return Err(InvalidRequest::new(
                        "prompt_token_ids",
                        format!("token id {bad} is outside the vocabulary of {vocab}"),
                    ));
                }
                request.prompt_token_ids
            }
            field => {
                let text = if field == "messages" {
                    self.render_chat(request.messages)?
                } else {
                    request.prompt
                };
                let ids = self
                    .tokenizer
                    .encode(&text)
                    .map_err(|e| InvalidRequest::new(field, e.to_string()))?;
                if ids.is_empty() {
                    return Err(InvalidRequest::new(field, "tokenizes to no tokens"));
                }
                ids
            }
        };
        if prompt_ids.len() >= max_model_len {
            return Err(InvalidRequest::new(
                prompt_field,
                format!(
                    "{} tokens leave no room in the model's context of {max_model_len} tokens",
                    prompt_ids.len()
                ),
            ));
        }

        let sampling = sampling_params(request.sampling)?;

        let stopping = request.stopping.unwrap_or_default();
        let max_new_tokens = stopping.max_new_tokens.unwrap_or(self.default_max_new_tokens);
        if max_new_tokens == 0 {
            return Err(InvalidRequest::new("stopping.max_new_tokens", "must be at least 1"));
        }
        let total = prompt_ids.len() + max_new_tokens as usize;
        if total > max_model_len {
            return Err(InvalidRequest::new(
                "stopping.max_new_tokens",
                format!(
                    "prompt ({} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the model's context of {max_model_len}",
                    prompt_ids.len()
                ),
            ));
        }
        if let Some(capacity) = limits.kv_capacity_tokens().filter(|&capacity| total > capacity) {
            return Err(InvalidRequest::new(
                "stopping.max_new_tokens",
                format!("prompt + max_new_tokens = {total} tokens can never fit in the KV cache of {capacity} tokens"),
            ));
        }
        if stopping.stop.len() > MAX_STOP_STRINGS {
            return Err(InvalidRequest::new(
                "stopping.stop",
                format!("{} stop strings; at most {MAX_STOP_STRINGS}", stopping.stop.len()),
            ));
        }
        if stopping.stop.iter().any(String::is_empty) {
            return Err(InvalidRequest::new("stopping.stop", "stop strings must not be empty"));
        }
        let vocab = limits.vocab_size;
        if let Some(bad) = stopping.stop_token_ids.iter().find(|&&id| id >= vocab) {
            return Err(InvalidRequest::new(
                "stopping.stop_token_ids",
                format!("token id {bad} is outside the vocabulary of {vocab}"),
            ));
        }
        if stopping.min_new_tokens > max_new_tokens {
            return Err(InvalidRequest::new(
                "stopping.min_new_tokens",
                format!("{} exceeds max_new_tokens ({max_new_tokens})", stopping.min_new_tokens),
            ));
        }
        if stopping.max_response_chars == Some(0) {
            return Err(InvalidRequest::new(
                "stopping.max_response_chars",
                "must be at least 1 when set",
            ));
        }
        let priority = match proto::Priority::try_from(request.priority) {
            Ok(proto::Priority::Unspecified | proto::Priority::Normal) => Priority::Normal,
            Ok(proto::Priority::Low) => Priority::Low,
            Ok(proto::Priority::High) => Priority::High,
            Ok(proto::Priority::Critical) => Priority::Critical,
            Err(_) => {
                return Err(InvalidRequest::new(
                    "priority",
                    format!("unknown priority {}", request.priority),
                ))
            }
        };
        let mut stop_strings = stopping.stop;
        stop_strings.extend(self.default_stop_strings.iter().cloned());
        Ok(GenerationRequest {
            prompt_ids,
            sampling,
            stopping: StoppingParams {
                max_new_tokens,
                ignore_eos: stopping.ignore_eos,
                stop_strings,
                stop_token_ids: stopping.stop_token_ids,
                min_new_tokens: stopping.min_new_tokens,
                max_response_chars: stopping.max_response_chars,
                include_stop_str_in_output: stopping.include_stop_str_in_output,
            },
            priority,
        })
    }

    /// The prompt of a chat request: its messages through the model's chat template.
    fn render_chat(&self, messages: Vec<proto::ChatMessage>) -> Result<String, InvalidRequest> {
        let template = self
            .tokenizer
            .chat_template()
            .ok_or_else(|| InvalidRequest::new("messages", "the served model has no chat template; send a prompt"))?;
        if let Some(bad) = messages
            .iter()
            .find(|m| !["system", "user", "assistant"].contains(&m.role.as_str()))
        {
            return Err(InvalidRequest::new("messages", format!("unknown role {:?}", bad.role)));
        }
        let messages: Vec<ChatMessage> = messages
            .into_iter()
            .map(|m| ChatMessage {
                role: m.role,
                content: m.content,
            })
            .collect();
        template
            .render(&messages)
            .map_err(|e| InvalidRequest::new("messages", e.to_string()))
    }

    fn submit(
        &self,
        request: proto::GenerateRequest,
    ) -> Result<tokio::sync::mpsc::UnboundedReceiver<SequenceEvent>, Status> {
        let request = self.to_domain(request).map_err(invalid_argument)?;
        self.engine.submit(request).map_err(engine_status)
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<proto::GenerateStreamResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Generation for GenerationService {
    async fn generate(
        &self,
        request: Request<proto::GenerateRequest>,
    ) -> Result<Response<proto::GenerateResponse>, Status> {
        let mut events = self.submit(request.into_inner())?;
        let mut response = proto::GenerateResponse::default();
        while let Some(event) = events.recv().await {
            // The same messages the stream carries, so unary and streaming results agree.
            let message = stream_message(event)?;
            response.token_ids.extend(message.token_ids);
            response.text.push_str(&message.text);
            response.logprobs.extend(message.logprobs);
            if message.usage.is_some() {
                response.finish_reason = message.finish_reason;
                response.usage = message.usage;
                return Ok(Response::new(response));
            }
        }
        Err(Status::unavailable("the engine stopped before the request finished"))
    }

    type StreamGenerateStream = EventStream;

    async fn stream_generate(&self, request: Request<proto::GenerateRequest>) -> Result<Response<EventStream>, Status> {
        let events = self.submit(request.into_inner())?;
        // Dropping this stream (the client went away) drops the receiver, which cancels the
        // request at the engine's next iteration.
        let stream = UnboundedReceiverStream::new(events).map(stream_message);
        Ok(Response::new(Box::pin(stream)))
    }
}

/// One engine event as a stream message; only the last one carries the finish reason and usage.
fn stream_message(event: SequenceEvent) -> Result<proto::GenerateStreamResponse, Status> {
    match event {
        SequenceEvent::Tokens {
            token_ids,
            text,
            logprobs,
        } => Ok(proto::GenerateStreamResponse {
            text,
            token_ids,
            logprobs: logprobs.into_iter().map(proto_logprob).collect(),
            ..Default::default()
        }),
        SequenceEvent::Finished {
            reason,
            token_ids,
            text,
            usage,
            logprobs,
        } => Ok(proto::GenerateStreamResponse {
            text,
            token_ids,
            finish_reason: proto_reason(reason) as i32,
            usage: Some(proto_usage(usage)),
            logprobs: logprobs.into_iter().map(proto_logprob).collect(),
        }),
        SequenceEvent::Failed(error) => Err(engine_status(error)),
    }
}

fn invalid_argument(error: InvalidRequest) -> Status {
    Status::invalid_argument(error.to_string())
}

pub fn engine_status(error: EngineError) -> Status {
    match error {
        EngineError::WorkerUnavailable(_) | EngineError::ShuttingDown => Status::unavailable(error.to_string()),
        EngineError::QueueFull(_) => Status::resource_exhausted(error.to_string()),
        EngineError::Detokenize(_) => Status::internal(error.to_string()),
        EngineError::UnknownReplica(_) => Status::not_found(error.to_string()),
    }
}

fn proto_reason(reason: FinishReason) -> proto::FinishReason {
    match reason {
        FinishReason::MaxTokens => proto::FinishReason::MaxTokens,
        FinishReason::EosToken => proto::FinishReason::EosToken,
        FinishReason::StopToken => proto::FinishReason::StopToken,
        FinishReason::StopString => proto::FinishReason::StopString,
        FinishReason::Length => proto::FinishReason::Length,
        FinishReason::Cancelled => proto::FinishReason::Cancelled,
    }
}

fn proto_logprob(logprob: TokenLogprob) -> proto::TokenLogprob {
    proto::TokenLogprob {
        token_id: logprob.token_id,
        logprob: logprob.logprob,
        top: logprob
            .top
            .into_iter()
            .map(|(token_id, logprob)| proto::TopLogprob { token_id, logprob })
            .collect(),
    }
}

fn proto_usage(usage: Usage) -> proto::Usage {
    proto::Usage {
        prompt_tokens: usage.prompt_tokens,
        completion_tokens: usage.completion_tokens,
        cached_prompt_tokens: usage.cached_prompt_tokens,
    }
}
