//! `POST /v1/completions` and `POST /v1/chat/completions`: whole responses, or server-sent events
//! ending in `data: [DONE]`. A client that disconnects drops the event stream (or the handler's
//! future), which cancels its request.
//!
//! A request for several choices (a batch of prompts, `n` > 1) is one engine request per choice
//! (a prompt's copies submitted once its first choice has prefilled it: [`submit_choices`]): a
//! whole response waits for all of them, a stream interleaves their chunks, each choice with its
//! `index`; the usage counts each prompt once and every choice's output.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
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
use super::prompt_echo::{echoed_text, push_echoed_logprobs, vllm_prompt_logprobs, PromptEcho};
use super::tool_calls::{CallsOrText, ToolCallBuilder};
use super::translate::{output_limit, to_drafts, Endpoint};
use super::{unix_seconds, HttpState, RequestId};
use crate::api::tracking::{openai_finish_reason, TrackedRequest};
use crate::api::validation::{Field, Prompt, RequestDraft};
use crate::request::{FinishReason, PromptTokenLogprob, SequenceEvent, StopCause, TokenLogprob, Usage};
use crate::token_piece::{CharOffsets, TokenPiece};
use crate::tokenizer::ModelTokenizer;

/// The body as bytes or axum's reason not (a body over its limit, say): answered in OpenAI's
/// JSON like every other error, not as axum's plain text.
pub type BodyBytes = Result<Bytes, BytesRejection>;

pub async fn completions(state: State<HttpState>, id: Extension<RequestId>, body: BodyBytes) -> Response {
    generate(Endpoint::Completions, state, id, body).await
}

pub async fn chat_completions(state: State<HttpState>, id: Extension<RequestId>, body: BodyBytes) -> Response {
    generate(Endpoint::Chat, state, id, body).await
}

/// Parses the body with the path of what was wrong in the error; anything but whitespace after
/// the JSON value is an error too (a body is one value).
pub fn parse_json<T: serde::de::DeserializeOwned>(body: BodyBytes) -> Result<T, ApiError> {
    let body = body.map_err(|rejection| ApiError::unreadable_body(&rejection))?;
    let deserializer = &mut serde_json::Deserializer::from_slice(&body);
    let parsed: T = serde_path_to_error::deserialize(&mut *deserializer)
        .map_err(|error| ApiError::malformed(error.path().to_string(), error.inner().to_string()))?;
    deserializer
        .end()
        .map_err(|error| ApiError::malformed(String::new(), error.to_string()))?;
    Ok(parsed)
}

async fn generate(
    endpoint: Endpoint,
    State(state): State<HttpState>,
    Extension(RequestId(id)): Extension<RequestId>,
    body: BodyBytes,
) -> Response {
    let body: GenerationBody = match parse_json(body) {
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
    if body
        .stream_options
        .as_ref()
        .is_some_and(|o| o.continuous_usage_stats == Some(true))
    {
        return ApiError::invalid(
            "stream_options",
            "continuous_usage_stats is not supported (include_usage is)",
        )
        .into_response();
    }
    let return_token_ids = body.return_token_ids.unwrap_or(false);
    let per_prompt = body.n.unwrap_or(1).max(1) as usize;
    let (_, limit_param) = output_limit(endpoint, &body);
    let echo = match PromptEcho::from_body(endpoint, &body) {
        Ok(echo) => echo,
        Err(error) => return error.into_response(),
    };
    let (drafts, tool_output) = match to_drafts(endpoint, id.clone(), body) {
        Ok(drafts) => drafts,
        Err(error) => return error.into_response(),
    };
    let wants_logprobs = drafts.first().is_some_and(|draft| draft.sampling.logprobs);
    let top_logprobs = drafts.first().map_or(0, |draft| draft.sampling.top_logprobs);
    // The prompts' texts as given, for `echo` (token-id prompts are decoded instead).
    let prompt_texts: Vec<Option<String>> = drafts
        .iter()
        .map(|draft| match &draft.prompt {
            Prompt::Text(text) if echo.echo => Some(text.clone()),
            _ => None,
        })
        .collect();
    let requests = match submit_choices(&state, endpoint, limit_param, drafts, per_prompt).await {
        Ok(requests) => requests,
        Err(error) => return error.into_response(),
    };
    let response = ResponseShape {
        endpoint,
        id: match endpoint {
            Endpoint::Completions => format!("cmpl-{id}"),
            Endpoint::Chat => format!("chatcmpl-{id}"),
        },
        created: unix_seconds(),
        model: state.front.served_model_name().to_owned(),
        // Chat's choices share one conversation: its ids go on the response, not on each choice.
        chat_prompt_token_ids: (return_token_ids && endpoint == Endpoint::Chat)
            .then(|| requests.first().map(|request| request.prompt_ids().to_vec()))
            .flatten(),
    };
    let tokenizer = &state.front.validator.tokenizer;
    let builders = requests
        .iter()
        .zip(prompt_texts)
        .enumerate()
        .map(|(index, (request, prompt_text))| ChoiceBuilder {
            index: index as u32,
            endpoint,
            tokenizer: tokenizer.clone(),
            return_token_ids,
            prompt_token_ids: (return_token_ids && endpoint == Endpoint::Completions)
                .then(|| request.prompt_ids().to_vec()),
            wants_logprobs,
            top_logprobs,
            offsets: CharOffsets::default(),
            echo,
            echoed: echo.echo.then(|| EchoedPrompt {
                text: prompt_text.unwrap_or_else(|| echoed_text(tokenizer, request.prompt_ids())),
                ids: request.prompt_ids().to_vec(),
            }),
            // A copy's are its first choice's, which has them by now (`submit_choices`).
            prompt_scores: requests[index - index % per_prompt]
                .prompt_logprobs()
                .map(<[_]>::to_vec),
            tool_calls: tool_output.clone().map(ToolCallBuilder::new),
        })
        .collect();
    let usage = UsageTotals::new(per_prompt);
    if streaming {
        stream_response(response, builders, requests, usage, include_usage).into_response()
    } else {
        whole_response(response, builders, requests, usage).await
    }
}

/// Submits every choice's draft (`per_prompt` consecutive ones per prompt). A prompt's first
/// choice goes at once; its copies (`n` > 1) once it has its first token: by then the prompt's
/// blocks are in the prefix cache, and each copy prefills only what the cache lacks (vLLM forks
/// the copies after one prefill; submitted together, each would prefill the whole prompt). An
/// error drops the requests already in, which cancels them.
async fn submit_choices(
    state: &HttpState,
    endpoint: Endpoint,
    limit_param: &'static str,
    drafts: Vec<RequestDraft>,
    per_prompt: usize,
) -> Result<Vec<TrackedRequest>, ApiError> {
    // Every choice waits in the admission queue as a request of its own: more of them than the
    // queue holds could never all be queued, however idle the server (a 429 would say "retry").
    let max_queued = state.front.engine.max_queued();
    if drafts.len() > max_queued {
        let param = if per_prompt > 1 { "n" } else { "prompt" };
        return Err(ApiError::bad_request(
            param,
            format!(
                "{param}: {} choices are more than the {max_queued} requests this server queues \
                 (scheduler.max_queued_requests)",
                drafts.len()
            ),
        ));
    }
    let submit = |draft| {
        state.front.submit(draft, "http").map_err(|error| {
            ApiError::submit_naming(
                |field| match field {
                    Field::MaxNewTokens => limit_param,
                    other => endpoint.param_name(other),
                },
                error,
            )
        })
    };
    let mut firsts = Vec::new();
    let mut copies = Vec::new();
    for (index, draft) in drafts.into_iter().enumerate() {
        if index.is_multiple_of(per_prompt) {
            firsts.push(submit(draft)?);
        } else {
            // The first choice's prompt logprobs serve its copies (`ChoiceBuilder::prompt_scores`),
            // which then read the prompt from the prefix cache.
            let mut copy = draft;
            copy.sampling.prompt_logprobs = None;
            copies.push(copy);
        }
    }
    if copies.is_empty() {
        return Ok(firsts);
    }
    for first in &mut firsts {
        first.wait_for_first_event().await;
    }
    let mut copies = copies.into_iter();
    let mut requests = Vec::with_capacity(firsts.len() * per_prompt);
    for first in firsts {
        requests.push(first);
        for draft in copies.by_ref().take(per_prompt - 1) {
            requests.push(submit(draft)?);
        }
    }
    Ok(requests)
}

/// What every body of one response shares.
struct ResponseShape {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    /// With `return_token_ids` on chat, the conversation's ids (vLLM's `prompt_token_ids`): on the
    /// whole response, or on each choice's first chunk.
    chat_prompt_token_ids: Option<Vec<u32>>,
}

impl ResponseShape {
    fn body(&self, object: &'static str, choices: Vec<Choice>, usage: Option<Option<UsageBody>>) -> ResponseBody {
        ResponseBody {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model.clone(),
            choices,
            prompt_token_ids: None,
            prompt_logprobs: None,
            usage,
        }
    }
}

/// The usage of a request's choices: each prompt counted once (from its first choice; its other
/// choices read the same prompt), every choice's output.
struct UsageTotals {
    per_prompt: usize,
    total: Usage,
}

impl UsageTotals {
    fn new(per_prompt: usize) -> Self {
        Self {
            per_prompt,
            total: Usage::default(),
        }
    }

    fn add(&mut self, index: usize, usage: Usage) {
        if index.is_multiple_of(self.per_prompt) {
            self.total.prompt_tokens += usage.prompt_tokens;
            self.total.cached_prompt_tokens += usage.cached_prompt_tokens;
        }
        self.total.completion_tokens += usage.completion_tokens;
    }
}

async fn whole_response(
    response: ResponseShape,
    mut builders: Vec<ChoiceBuilder>,
    requests: Vec<TrackedRequest>,
    mut usage: UsageTotals,
) -> Response {
    let results = futures::future::join_all(
        requests
            .into_iter()
            .map(|mut events| async move { events.whole_result().await }),
    )
    .await;
    let mut choices = Vec::with_capacity(results.len());
    let mut chat_prompt_logprobs = None;
    for (index, (result, builder)) in results.into_iter().zip(&mut builders).enumerate() {
        match result {
            Ok(done) => {
                usage.add(index, builder.usage(done.usage));
                if done.prompt_logprobs.is_some() {
                    builder.prompt_scores = done.prompt_logprobs;
                }
                if index == 0 && response.endpoint == Endpoint::Chat {
                    chat_prompt_logprobs = builder.vllm_prompt_logprobs();
                }
                choices.push(builder.choice(
                    done.text,
                    done.token_ids,
                    &done.logprobs,
                    Some((done.reason, done.stop)),
                    false,
                ));
            }
            Err(error) => return ApiError::engine(&error).into_response(),
        }
    }
    let object = response.endpoint.object(false);
    let mut body = response.body(object, choices, Some(Some(usage_body(usage.total))));
    body.prompt_token_ids = response.chat_prompt_token_ids.clone();
    body.prompt_logprobs = chat_prompt_logprobs;
    Json(body).into_response()
}

fn stream_response(
    response: ResponseShape,
    mut builders: Vec<ChoiceBuilder>,
    requests: Vec<TrackedRequest>,
    mut usage: UsageTotals,
    include_usage: bool,
) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let object = response.endpoint.object(true);
    // OpenAI's chunks carry `"usage": null` before the last one when the usage was asked for.
    let chunk_usage = move || include_usage.then_some(None);
    let openings: Vec<_> = match response.endpoint {
        Endpoint::Chat => builders
            .iter()
            .map(|builder| {
                let choice = Choice {
                    index: builder.index,
                    delta: Some(AssistantMessage {
                        role: Some("assistant"),
                        content: Some(String::new()),
                        tool_calls: None,
                    }),
                    ..empty_choice()
                };
                // As vLLM: each choice's first chunk carries the conversation's ids.
                let mut body = response.body(object, vec![choice], chunk_usage());
                body.prompt_token_ids = response.chat_prompt_token_ids.clone();
                json_event(&body)
            })
            .collect(),
        Endpoint::Completions => Vec::new(),
    };
    let mut unfinished = requests.len();
    let tagged = stream::select_all(
        requests
            .into_iter()
            .enumerate()
            .map(|(index, events)| events.map(move |event| (index, event)).boxed()),
    );
    // After a failure the stream ends (`scan` returning `None`): the other choices' requests are
    // dropped with it, which cancels them.
    let chunks = tagged
        .scan(false, move |failed, (index, event)| {
            if *failed {
                return futures::future::ready(None);
            }
            let builder = &mut builders[index];
            let mut out = Vec::new();
            match event {
                SequenceEvent::PromptLogprobs(scores) => builder.prompt_scores = Some(scores),
                SequenceEvent::Tokens {
                    token_ids,
                    text,
                    logprobs,
                } => {
                    if !text.is_empty() || !token_ids.is_empty() || builder.echoed.is_some() {
                        let choice = builder.choice(text, token_ids, &logprobs, None, true);
                        // A list of tool calls says nothing until it is whole (plain text's
                        // chunks go out as before, an empty delta included, as vLLM's do).
                        if builder.tool_calls.is_none() || !choice.says_nothing() {
                            out.push(json_event(&response.body(object, vec![choice], chunk_usage())));
                        }
                    }
                }
                SequenceEvent::Finished {
                    reason,
                    stop,
                    token_ids,
                    text,
                    usage: choice_usage,
                    logprobs,
                    ..
                } => {
                    let choice = builder.choice(text, token_ids, &logprobs, Some((reason, stop)), true);
                    out.push(json_event(&response.body(object, vec![choice], chunk_usage())));
                    usage.add(index, builder.usage(choice_usage));
                    unfinished -= 1;
                    if include_usage && unfinished == 0 {
                        out.push(json_event(&response.body(
                            object,
                            Vec::new(),
                            Some(Some(usage_body(usage.total))),
                        )));
                    }
                }
                SequenceEvent::Failed(error) => {
                    *failed = true;
                    out.push(json_event(&ApiError::engine(&error).body()));
                }
            }
            futures::future::ready(Some(stream::iter(out)))
        })
        .flatten();
    let done = stream::once(async { Ok(Event::default().data("[DONE]")) });
    Sse::new(stream::iter(openings).chain(chunks).chain(done)).keep_alive(KeepAlive::default())
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
        prompt_token_ids: None,
        prompt_logprobs: None,
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

/// Builds one choice's parts of a response, in its endpoint's shape.
struct ChoiceBuilder {
    index: u32,
    endpoint: Endpoint,
    tokenizer: Arc<ModelTokenizer>,
    return_token_ids: bool,
    /// With `return_token_ids` on completions, the prompt's ids until the choice's first chunk
    /// (or its whole response) takes them.
    prompt_token_ids: Option<Vec<u32>>,
    wants_logprobs: bool,
    /// Alternatives per token asked for (completions' `logprobs` count).
    top_logprobs: u32,
    /// Characters of the choice's text before each listed token (completions' `text_offset`).
    offsets: CharOffsets,
    echo: PromptEcho,
    /// With `echo`, the prompt until the choice's first chunk (or its whole response) takes it.
    echoed: Option<EchoedPrompt>,
    /// The prompt's logprobs, once the engine sent them.
    prompt_scores: Option<Vec<PromptTokenLogprob>>,
    /// Chat's, where `tool_choice` makes the output function calls.
    tool_calls: Option<ToolCallBuilder>,
}

/// The prompt an `echo` repeats: its text as given (token ids decoded) and its tokens.
struct EchoedPrompt {
    text: String,
    ids: Vec<u32>,
}

impl ChoiceBuilder {
    /// The choice's usage as reported: an echo of the prompt alone generated nothing the client
    /// sees.
    fn usage(&self, usage: Usage) -> Usage {
        Usage {
            completion_tokens: if self.echo.echo_only {
                0
            } else {
                usage.completion_tokens
            },
            ..usage
        }
    }

    /// vLLM's `prompt_logprobs`, when asked for and sent.
    fn vllm_prompt_logprobs(&self) -> Option<serde_json::Value> {
        let alternatives = self.echo.prompt_logprobs?;
        let scores = self.prompt_scores.as_deref()?;
        Some(vllm_prompt_logprobs(&self.tokenizer, scores, alternatives))
    }

    fn choice(
        &mut self,
        mut text: String,
        mut token_ids: Vec<u32>,
        mut logprobs: &[TokenLogprob],
        mut finish: Option<(FinishReason, Option<StopCause>)>,
        delta: bool,
    ) -> Choice {
        if self.echo.echo_only {
            // The one token generated for the echo is not the client's: max_tokens was 0.
            (text, logprobs) = (String::new(), &[]);
            token_ids.clear();
            finish = finish.map(|_| (FinishReason::MaxTokens, None));
        }
        let echoed = self.echoed.take();
        if let Some(prompt) = &echoed {
            text.insert_str(0, &prompt.text);
        }
        let mut finish_reason = finish.as_ref().map(|(reason, _)| openai_finish_reason(*reason));
        // vLLM's `stop_reason`: the stop string or stop token id that ended the output; and, as
        // OpenAI's `finish_reason` has no word for the confidence stop ("stop"), "low_confidence".
        let stop_reason = match finish {
            Some((FinishReason::LowConfidence, _)) => Some(serde_json::json!("low_confidence")),
            Some((_, Some(StopCause::String(stop)))) => Some(serde_json::json!(stop)),
            Some((_, Some(StopCause::TokenId(token)))) => Some(serde_json::json!(token)),
            _ => None,
        };
        let logprobs = self
            .wants_logprobs
            .then(|| self.logprobs(echoed.as_ref().map(|prompt| &prompt.ids[..]), logprobs));
        let token_ids = self.return_token_ids.then_some(token_ids);
        match self.endpoint {
            Endpoint::Completions => Choice {
                index: self.index,
                text: Some(text),
                logprobs,
                finish_reason,
                stop_reason,
                token_ids,
                prompt_token_ids: self.prompt_token_ids.take(),
                prompt_logprobs: self.vllm_prompt_logprobs().filter(|_| !delta),
                ..empty_choice()
            },
            Endpoint::Chat => {
                let (content, tool_calls) = match self.tool_calls.as_mut() {
                    None => ((!delta || !text.is_empty()).then_some(text), None),
                    Some(calls) => {
                        let said = if delta {
                            calls.delta(text, finish_reason.is_some())
                        } else {
                            Some(calls.whole(text))
                        };
                        match said {
                            None => (None, None),
                            Some(CallsOrText::Text(text)) => (Some(text), None),
                            Some(CallsOrText::Calls(made)) => {
                                if calls.finishes_as_calls(finish_reason == Some("stop")) {
                                    finish_reason = Some("tool_calls");
                                }
                                // vLLM's message beside its calls: empty content.
                                ((!delta).then(String::new), Some(made))
                            }
                        }
                    }
                };
                let content = AssistantMessage {
                    role: (!delta).then_some("assistant"),
                    content,
                    tool_calls,
                };
                let (message, delta) = if delta {
                    (None, Some(content))
                } else {
                    (Some(content), None)
                };
                Choice {
                    index: self.index,
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

    fn piece(&self, id: u32) -> TokenPiece {
        TokenPiece::of(&self.tokenizer, id)
    }

    /// The logprobs of `logprobs`' tokens, after an echoed prompt's (`echoed`: its ids).
    fn logprobs(&mut self, echoed: Option<&[u32]>, logprobs: &[TokenLogprob]) -> serde_json::Value {
        let value = match self.endpoint {
            Endpoint::Completions => {
                let mut out = CompletionLogprobs::default();
                if let Some(prompt_ids) = echoed {
                    let scores = self.prompt_scores.as_deref().unwrap_or_default();
                    push_echoed_logprobs(
                        &self.tokenizer,
                        prompt_ids,
                        scores,
                        self.top_logprobs,
                        &mut self.offsets,
                        &mut out,
                    );
                }
                for lp in logprobs {
                    let score = Some((lp.logprob, &lp.top[..]));
                    out.push_token(&self.tokenizer, &mut self.offsets, lp.token_id, false, score);
                }
                serde_json::to_value(out)
            }
            Endpoint::Chat => {
                let content = logprobs
                    .iter()
                    .map(|lp| {
                        let piece = self.piece(lp.token_id);
                        ChatTokenLogprob {
                            bytes: piece.bytes,
                            token: piece.text,
                            logprob: lp.logprob,
                            top_logprobs: lp
                                .top
                                .iter()
                                .map(|&(id, logprob)| {
                                    let piece = self.piece(id);
                                    ChatTopLogprob {
                                        bytes: piece.bytes,
                                        token: piece.text,
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
