//! `POST /v1/completions` and `POST /v1/chat/completions`: whole responses, or server-sent events
//! ending in `data: [DONE]`. A client that disconnects drops the event stream (or the handler's
//! future), which cancels its request.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures::stream::{self, StreamExt};

use super::errors::ApiError;
use super::openai::{
    AssistantMessage, ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, Choice, CompletionLogprobs, GenerationBody,
    PromptTokensDetails, ResponseBody, UsageBody,
};
use super::translate::{to_draft, Endpoint};
use super::{unix_seconds, HttpState, RequestId};
use crate::api::tracking::{openai_finish_reason, TrackedRequest};
use crate::request::{FinishReason, SequenceEvent, TokenLogprob, Usage};
use crate::tokenizer::ModelTokenizer;

pub async fn completions(state: State<HttpState>, id: Extension<RequestId>, body: Bytes) -> Response {
    generate(Endpoint::Completions, state, id, body).await
}

pub async fn chat_completions(state: State<HttpState>, id: Extension<RequestId>, body: Bytes) -> Response {
    generate(Endpoint::Chat, state, id, body).await
}

/// Parses the body with the path of what was wrong in the error.
fn parse_body(body: &[u8]) -> Result<GenerationBody, ApiError> {
    let deserializer = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(deserializer)
        .map_err(|error| ApiError::malformed(error.path().to_string(), error.inner().to_string()))
}

async fn generate(
    endpoint: Endpoint,
    State(state): State<HttpState>,
    Extension(RequestId(id)): Extension<RequestId>,
    body: Bytes,
) -> Response {
    let body = match parse_body(&body) {
        Ok(body) => body,
        Err(error) => return error.into_response(),
    };
    let streaming = body.stream.unwrap_or(false);
    let include_usage = body
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage.unwrap_or(false));
    if body.stream_options.is_some() && !streaming {
        return ApiError::bad_request("stream_options", "stream_options: only with stream: true").into_response();
    }
    let return_token_ids = body.return_token_ids.unwrap_or(false);
    let draft = match to_draft(endpoint, id.clone(), body) {
        Ok(draft) => draft,
        Err(error) => return error.into_response(),
    };
    let wants_logprobs = draft.sampling.logprobs;
    let events = match state.front.submit(draft, "http") {
        Ok(events) => events,
        Err(error) => return ApiError::submit(endpoint, error).into_response(),
    };
    let builder = ChoiceBuilder {
        endpoint,
        id: match endpoint {
            Endpoint::Completions => format!("cmpl-{id}"),
            Endpoint::Chat => format!("chatcmpl-{id}"),
        },
        created: unix_seconds(),
        model: state.front.served_model_name().to_owned(),
        tokenizer: state.front.validator.tokenizer.clone(),
        return_token_ids,
        wants_logprobs,
        text_offset: 0,
    };
    if streaming {
        stream_response(builder, events, include_usage).into_response()
    } else {
        whole_response(builder, events).await
    }
}

async fn whole_response(mut builder: ChoiceBuilder, mut events: TrackedRequest) -> Response {
    match events.whole_result().await {
        Ok(done) => {
            let choice = builder.choice(done.text, done.token_ids, &done.logprobs, Some(done.reason), false);
            let object = builder.endpoint.object(false);
            Json(builder.body(object, vec![choice], Some(usage_body(done.usage)))).into_response()
        }
        Err(error) => ApiError::engine(&error).into_response(),
    }
}

fn stream_response(
    mut builder: ChoiceBuilder,
    events: TrackedRequest,
    include_usage: bool,
) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let object = builder.endpoint.object(true);
    let opening = (builder.endpoint == Endpoint::Chat).then(|| {
        let choice = Choice {
            delta: Some(AssistantMessage {
                role: Some("assistant"),
                content: Some(String::new()),
            }),
            ..empty_choice()
        };
        json_event(&builder.body(object, vec![choice], None))
    });
    let chunks = events.flat_map(move |event| {
        let mut out = Vec::new();
        match event {
            SequenceEvent::Tokens {
                token_ids,
                text,
                logprobs,
            } => {
                if !text.is_empty() || !token_ids.is_empty() {
                    let choice = builder.choice(text, token_ids, &logprobs, None, true);
                    out.push(json_event(&builder.body(object, vec![choice], None)));
                }
            }
            SequenceEvent::Finished {
                reason,
                token_ids,
                text,
                usage,
                logprobs,
                ..
            } => {
                let choice = builder.choice(text, token_ids, &logprobs, Some(reason), true);
                out.push(json_event(&builder.body(object, vec![choice], None)));
                if include_usage {
                    out.push(json_event(&builder.body(object, Vec::new(), Some(usage_body(usage)))));
                }
            }
            SequenceEvent::Failed(error) => out.push(json_event(&ApiError::engine(&error).body())),
        }
        stream::iter(out)
    });
    let done = stream::once(async { Ok(Event::default().data("[DONE]")) });
    Sse::new(stream::iter(opening).chain(chunks).chain(done)).keep_alive(KeepAlive::default())
}

fn json_event(value: &impl serde::Serialize) -> Result<Event, Infallible> {
    Ok(Event::default().data(serde_json::to_string(value).unwrap_or_default()))
}

fn empty_choice() -> Choice {
    Choice {
        index: 0,
        text: None,
        message: None,
        delta: None,
        logprobs: None,
        finish_reason: None,
        stop_reason: None,
        token_ids: None,
    }
}

fn usage_body(usage: Usage) -> UsageBody {
    UsageBody {
        prompt_tokens: usage.prompt_tokens,
        completion_tokens: usage.completion_tokens,
        total_tokens: usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details: PromptTokensDetails {
            cached_tokens: usage.cached_prompt_tokens,
        },
    }
}

/// Builds choices and bodies for one request, in its endpoint's shape.
struct ChoiceBuilder {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<ModelTokenizer>,
    return_token_ids: bool,
    wants_logprobs: bool,
    /// Characters of text sent so far (completions' `text_offset`).
    text_offset: usize,
}

impl ChoiceBuilder {
    fn body(&self, object: &'static str, choices: Vec<Choice>, usage: Option<UsageBody>) -> ResponseBody {
        ResponseBody {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }

    fn choice(
        &mut self,
        text: String,
        token_ids: Vec<u32>,
        logprobs: &[TokenLogprob],
        finish: Option<FinishReason>,
        delta: bool,
    ) -> Choice {
        let finish_reason = finish.map(openai_finish_reason);
        // OpenAI's `finish_reason` has no word for the confidence stop: it is "stop", and the
        // `stop_reason` field (vLLM's name; Rivulet fills it only for this) says which stop.
        let stop_reason = finish.and_then(|reason| (reason == FinishReason::LowConfidence).then_some("low_confidence"));
        let logprobs = self.wants_logprobs.then(|| self.logprobs(logprobs));
        self.text_offset += text.chars().count();
        let token_ids = self.return_token_ids.then_some(token_ids);
        match self.endpoint {
            Endpoint::Completions => Choice {
                text: Some(text),
                logprobs,
                finish_reason,
                stop_reason,
                token_ids,
                ..empty_choice()
            },
            Endpoint::Chat => {
                let content = AssistantMessage {
                    role: (!delta).then_some("assistant"),
                    content: (!delta || !text.is_empty()).then_some(text),
                };
                let (message, delta) = if delta {
                    (None, Some(content))
                } else {
                    (Some(content), None)
                };
                Choice {
                    message,
                    delta,
                    logprobs,
                    finish_reason,
                    stop_reason,
                    token_ids,
                    ..empty_choice()
                }
            }
        }
    }

    fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id]).unwrap_or_default()
    }

    fn logprobs(&self, logprobs: &[TokenLogprob]) -> serde_json::Value {
        let value = match self.endpoint {
            Endpoint::Completions => {
                let mut out = CompletionLogprobs::default();
                let mut offset = self.text_offset;
                for lp in logprobs {
                    let token = self.token_text(lp.token_id);
                    let mut top = serde_json::Map::new();
                    for &(id, logprob) in &lp.top {
                        top.insert(self.token_text(id), serde_json::json!(logprob));
                    }
                    out.text_offset.push(offset);
                    offset += token.chars().count();
                    out.tokens.push(token);
                    out.token_logprobs.push(lp.logprob);
                    out.top_logprobs.push(top);
                }
                serde_json::to_value(out)
            }
            Endpoint::Chat => {
                let content = logprobs
                    .iter()
                    .map(|lp| {
                        let token = self.token_text(lp.token_id);
                        ChatTokenLogprob {
                            bytes: token.as_bytes().to_vec(),
                            token,
                            logprob: lp.logprob,
                            top_logprobs: lp
                                .top
                                .iter()
                                .map(|&(id, logprob)| {
                                    let token = self.token_text(id);
                                    ChatTopLogprob {
                                        bytes: token.as_bytes().to_vec(),
                                        token,
                                        logprob,
                                    }
                                })
                                .collect(),
                        }
                    })
                    .collect();
                serde_json::to_value(ChatLogprobs { content })
            }
        };
        value.unwrap_or(serde_json::Value::Null)
    }
}
