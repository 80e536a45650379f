//! The `rivulet.v1.Generation` gRPC service: a thin adapter that translates a `GenerateRequest`
//! into the domain's [`RequestDraft`], hands it to the [`Frontend`] and maps events and errors back
//! (errors in one place, [`submit_status`]). The request id travels in `x-request-id` metadata.

use std::pin::Pin;

use rivulet::proto;
use rivulet::proto::generation_server::Generation;
use tokio_stream::{Stream, StreamExt};
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status};

use super::tracking::TrackedRequest;
use super::validation::{chat_ending, Field, Prompt, RequestDraft, SamplingDraft, StoppingDraft, ValidationError};
use super::{request_id, Frontend, SubmitError, REQUEST_ID_HEADER};
use crate::chat_template::ChatMessage;
use crate::guide::{GuideRequest, GuideSpec};
use crate::request::{
    EngineError, ErrorKind, FinishReason, Priority, PromptTokenLogprob, SequenceEvent, StopCause, TokenLogprob, Usage,
};

pub struct GenerationService {
    front: Frontend,
}

impl GenerationService {
    pub fn new(front: Frontend) -> Self {
        Self { front }
    }

    fn submit(&self, request: Request<proto::GenerateRequest>) -> Result<TrackedRequest, Status> {
        let given = request.metadata().get(REQUEST_ID_HEADER).and_then(|v| v.to_str().ok());
        let id = request_id(given);
        let draft = to_draft(id.clone(), request.into_inner()).map_err(|e| submit_status(e.into()))?;
        self.front.submit(draft, "grpc").map_err(submit_status)
    }
}

/// The response with the request's id in its metadata.
fn with_request_id<T>(message: T, id: &str) -> Response<T> {
    let mut response = Response::new(message);
    if let Ok(value) = MetadataValue::try_from(id) {
        response.metadata_mut().insert(REQUEST_ID_HEADER, value);
    }
    response
}

/// Which prompt the request carries, as the domain's [`Prompt`].
fn to_draft(id: String, request: proto::GenerateRequest) -> Result<RequestDraft, ValidationError> {
    let given = [
        !request.prompt.is_empty(),
        !request.prompt_token_ids.is_empty(),
        !request.messages.is_empty(),
    ];
    // The chat options shape the template's prompt; with a prompt given as such they would change
    // nothing, so they are refused rather than ignored.
    if request.messages.is_empty() {
        if request.add_generation_prompt.is_some() {
            return Err(ValidationError::invalid(
                Field::AddGenerationPrompt,
                "applies to messages only",
            ));
        }
        if request.continue_final_message {
            return Err(ValidationError::invalid(
                Field::ContinueFinalMessage,
                "applies to messages only",
            ));
        }
    }
    let prompt = match given {
        [true, false, false] => Prompt::Text(request.prompt),
        [false, true, false] => Prompt::TokenIds(request.prompt_token_ids),
        [false, false, true] => Prompt::Messages {
            ending: chat_ending(request.add_generation_prompt, request.continue_final_message)?,
            messages: request
                .messages
                .into_iter()
                .map(|m| ChatMessage {
                    role: m.role,
                    content: m.content,
                })
                .collect(),
        },
        [false, false, false] => {
            return Err(ValidationError::invalid(
                Field::Prompt,
                "must not be empty (set prompt, prompt_token_ids or messages)",
            ))
        }
        _ => {
            return Err(ValidationError::invalid(
                Field::Prompt,
                "set only one of prompt, prompt_token_ids and messages",
            ))
        }
    };
    let priority = match proto::Priority::try_from(request.priority) {
        Ok(proto::Priority::Unspecified | proto::Priority::Normal) => Priority::Normal,
        Ok(proto::Priority::Low) => Priority::Low,
        Ok(proto::Priority::High) => Priority::High,
        Ok(proto::Priority::Critical) => Priority::Critical,
        Err(_) => {
            return Err(ValidationError::invalid(
                Field::Priority,
                format!("unknown priority {}", request.priority),
            ))
        }
    };
    let mut sampling = request.sampling.unwrap_or_default();
    let guide = structured_output(sampling.structured_output.take())?;
    let stopping = request.stopping.unwrap_or_default();
    Ok(RequestDraft {
        id,
        model: Some(request.model).filter(|m| !m.is_empty()),
        prompt,
        sampling: SamplingDraft {
            temperature: sampling.temperature.map(f64::from),
            top_k: sampling.top_k,
            top_p: sampling.top_p.map(f64::from),
            min_p: sampling.min_p.map(f64::from),
            repetition_penalty: sampling.repetition_penalty.map(f64::from),
            frequency_penalty: sampling.frequency_penalty.map(f64::from),
            presence_penalty: sampling.presence_penalty.map(f64::from),
            seed: sampling.seed,
            logprobs: sampling.logprobs,
            top_logprobs: sampling.top_logprobs,
            logit_bias: sampling.logit_bias.into_iter().collect(),
            allowed_token_ids: Some(sampling.allowed_token_ids).filter(|ids| !ids.is_empty()),
            prompt_logprobs: sampling.prompt_logprobs,
            guide,
        },
        stopping: StoppingDraft {
            max_new_tokens: stopping.max_new_tokens,
            default_to_rest_of_context: false,
            prompt_alone: false,
            confidence_threshold: stopping.confidence_threshold.map(f64::from),
            ignore_eos: stopping.ignore_eos,
            stop: stopping.stop,
            stop_token_ids: stopping.stop_token_ids,
            min_new_tokens: stopping.min_new_tokens,
            max_response_chars: stopping.max_response_chars,
            include_stop_str_in_output: stopping.include_stop_str_in_output,
        },
        priority,
    })
}

/// `sampling.structured_output` as the domain's request; set without a kind is an error.
fn structured_output(
    output: Option<proto::StructuredOutput>,
) -> Result<Option<(GuideRequest, &'static str)>, ValidationError> {
    use proto::structured_output::Kind;
    let Some(output) = output else {
        return Ok(None);
    };
    let field = Field::StructuredOutput("sampling.structured_output");
    let spec = match output.kind {
        Some(Kind::JsonSchema(text)) => GuideSpec::JsonSchema(
            serde_json::from_str(&text)
                .map_err(|e| ValidationError::invalid(field, format!("json_schema is not JSON: {e}")))?,
        ),
        Some(Kind::JsonObject(true)) => GuideSpec::JsonObject,
        Some(Kind::Regex(regex)) => GuideSpec::Regex(regex),
        Some(Kind::Choice(choices)) => GuideSpec::Choice(choices.choices),
        Some(Kind::JsonObject(false)) | None => {
            return Err(ValidationError::invalid(
                field,
                "set one of json_schema, json_object, regex and choice",
            ))
        }
    };
    let request = GuideRequest {
        spec,
        whitespace: output.whitespace_pattern,
    };
    Ok(Some((request, "sampling.structured_output")))
}

type EventStream = Pin<Box<dyn Stream<Item = Result<proto::GenerateStreamResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Generation for GenerationService {
    async fn generate(
        &self,
        request: Request<proto::GenerateRequest>,
    ) -> Result<Response<proto::GenerateResponse>, Status> {
        let mut events = self.submit(request)?;
        let completed = events.whole_result().await.map_err(engine_status)?;
        let response = proto::GenerateResponse {
            text: completed.text,
            token_ids: completed.token_ids,
            finish_reason: proto_reason(completed.reason) as i32,
            usage: Some(proto_usage(completed.usage)),
            logprobs: completed.logprobs.into_iter().map(proto_logprob).collect(),
            stop_string: completed
                .stop
                .as_ref()
                .and_then(StopCause::stop_string)
                .map(str::to_owned),
            stop_token_id: completed.stop.as_ref().and_then(StopCause::token_id),
            prompt_logprobs: completed
                .prompt_logprobs
                .unwrap_or_default()
                .into_iter()
                .map(proto_prompt_logprob)
                .collect(),
        };
        Ok(with_request_id(response, events.id()))
    }

    type StreamGenerateStream = EventStream;

    async fn stream_generate(&self, request: Request<proto::GenerateRequest>) -> Result<Response<EventStream>, Status> {
        let events = self.submit(request)?;
        let id = events.id().to_owned();
        // Dropping this stream (the client went away) drops the receiver, which cancels the
        // request at the engine's next iteration.
        let stream = events.map(stream_message);
        Ok(with_request_id(Box::pin(stream), &id))
    }
}

/// One engine event as a stream message; only the last one carries the finish reason and usage.
fn stream_message(event: SequenceEvent) -> Result<proto::GenerateStreamResponse, Status> {
    match event {
        SequenceEvent::PromptLogprobs(scores) => Ok(proto::GenerateStreamResponse {
            prompt_logprobs: scores.into_iter().map(proto_prompt_logprob).collect(),
            ..Default::default()
        }),
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
            stop,
            token_ids,
            text,
            usage,
            logprobs,
            ..
        } => Ok(proto::GenerateStreamResponse {
            text,
            token_ids,
            finish_reason: proto_reason(reason) as i32,
            usage: Some(proto_usage(usage)),
            logprobs: logprobs.into_iter().map(proto_logprob).collect(),
            stop_string: stop.as_ref().and_then(StopCause::stop_string).map(str::to_owned),
            stop_token_id: stop.as_ref().and_then(StopCause::token_id),
            ..Default::default()
        }),
        SequenceEvent::Failed(error) => Err(engine_status(error)),
    }
}

/// Every refusal of a request as a gRPC status; invalid input names the field.
pub fn submit_status(error: SubmitError) -> Status {
    match error {
        SubmitError::Invalid(ValidationError::Invalid { field, problem }) => {
            Status::invalid_argument(format!("{}: {problem}", field.grpc_name()))
        }
        SubmitError::Invalid(error @ ValidationError::UnknownModel { .. }) => Status::not_found(error.to_string()),
        SubmitError::Engine(error) => engine_status(error),
    }
}

pub fn engine_status(error: EngineError) -> Status {
    let message = error.to_string();
    match error.kind() {
        ErrorKind::Unavailable => Status::unavailable(message),
        ErrorKind::Overloaded => Status::resource_exhausted(message),
        ErrorKind::NotFound => Status::not_found(message),
        ErrorKind::Internal => Status::internal(message),
        ErrorKind::Aborted => Status::aborted(message),
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
        FinishReason::LowConfidence => proto::FinishReason::LowConfidence,
    }
}

fn proto_logprob(logprob: TokenLogprob) -> proto::TokenLogprob {
    proto::TokenLogprob {
        token_id: logprob.token_id,
        logprob: logprob.logprob,
        top: proto_top(logprob.top),
    }
}

fn proto_top(top: Vec<(u32, f32)>) -> Vec<proto::TopLogprob> {
    top.into_iter()
        .map(|(token_id, logprob)| proto::TopLogprob { token_id, logprob })
        .collect()
}

fn proto_prompt_logprob(score: PromptTokenLogprob) -> proto::PromptTokenLogprob {
    proto::PromptTokenLogprob {
        token_id: score.token_id,
        logprob: score.logprob,
        rank: score.rank,
        top: proto_top(score.top),
    }
}

fn proto_usage(usage: Usage) -> proto::Usage {
    proto::Usage {
        prompt_tokens: usage.prompt_tokens,
        completion_tokens: usage.completion_tokens,
        cached_prompt_tokens: usage.cached_prompt_tokens,
    }
}
