//! A submitted request as both fronts see it: its stream of engine events, observed on the way
//! past for the per-request metrics (time to first token, time per output token, end-to-end
//! latency, queue time, finish reasons) and for the one log line each request leaves when it ends,
//! however it ends (finished, failed, or dropped because its client went away).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::{Stream, StreamExt};

use crate::metrics::Metrics;
use crate::request::{
    EngineError, ErrorKind, FinishReason, PromptTokenLogprob, SequenceEvent, StopCause, TokenLogprob, Usage,
};

/// OpenAI's (and vLLM's metrics') word for a finish reason.
pub fn openai_finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::EosToken | FinishReason::StopToken | FinishReason::StopString | FinishReason::LowConfidence => {
            "stop"
        }
        FinishReason::MaxTokens | FinishReason::Length => "length",
        FinishReason::Cancelled => "abort",
    }
}

/// A whole result, for the fronts' unary calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Completed {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    pub reason: FinishReason,
    /// The stop string or stop token id that ended it, if one did.
    pub stop: Option<StopCause>,
    pub usage: Usage,
    /// The prompt's logprobs, when the request asked for them.
    pub prompt_logprobs: Option<Vec<PromptTokenLogprob>>,
}

pub struct TrackedRequest {
    id: String,
    front: &'static str,
    events: UnboundedReceiver<SequenceEvent>,
    metrics: Arc<Metrics>,
    /// The prompt as the model reads it (vLLM's `prompt_token_ids`, for `return_token_ids`).
    prompt_ids: Vec<u32>,
    submitted: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    generated: usize,
    /// Set once the last event went past: what the summary line reports.
    outcome: Option<&'static str>,
    /// An event taken early ([`Self::wait_for_first_event`]), handed out first.
    held: Option<SequenceEvent>,
    /// The prompt's logprobs, once they went past (or were taken early).
    prompt_logprobs: Option<Vec<PromptTokenLogprob>>,
}

impl TrackedRequest {
    pub fn new(
        id: String,
        front: &'static str,
        prompt_ids: Vec<u32>,
        events: UnboundedReceiver<SequenceEvent>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            id,
            front,
            events,
            metrics,
            prompt_ids,
            submitted: Instant::now(),
            first_token: None,
            last_token: None,
            generated: 0,
            outcome: None,
            held: None,
            prompt_logprobs: None,
        }
    }

    /// The prompt's token ids.
    pub fn prompt_ids(&self) -> &[u32] {
        &self.prompt_ids
    }

    /// Waits until the request's first event (its first token, or its end) has arrived, and keeps
    /// it for the stream: by then its prompt has been prefilled.
    pub async fn wait_for_first_event(&mut self) {
        if self.held.is_none() && self.outcome.is_none() && self.generated == 0 {
            self.held = self.next().await;
        }
    }

    /// The prompt's logprobs, when the request asked for them and they arrived (by
    /// [`Self::wait_for_first_event`]'s return, if at all).
    pub fn prompt_logprobs(&self) -> Option<&[PromptTokenLogprob]> {
        self.prompt_logprobs.as_deref()
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Waits for the whole result: the events' text, tokens and logprobs joined, with the last
    /// event's finish reason and usage — what the stream carries, so unary and streaming agree.
    pub async fn whole_result(&mut self) -> Result<Completed, EngineError> {
        let (mut text, mut token_ids, mut logprobs) = (String::new(), Vec::new(), Vec::new());
        while let Some(event) = self.next().await {
            match event {
                // Kept as it went past (`observe`).
                SequenceEvent::PromptLogprobs(_) => {}
                SequenceEvent::Tokens {
                    token_ids: ids,
                    text: delta,
                    logprobs: lp,
                } => {
                    text.push_str(&delta);
                    token_ids.extend(ids);
                    logprobs.extend(lp);
                }
                SequenceEvent::Finished {
                    reason,
                    stop,
                    token_ids: ids,
                    text: delta,
                    usage,
                    logprobs: lp,
                    ..
                } => {
                    text.push_str(&delta);
                    token_ids.extend(ids);
                    logprobs.extend(lp);
                    return Ok(Completed {
                        text,
                        token_ids,
                        logprobs,
                        reason,
                        stop,
                        usage,
                        prompt_logprobs: self.prompt_logprobs.take(),
                    });
                }
                SequenceEvent::Failed(error) => return Err(error),
            }
        }
        Err(EngineError::ShuttingDown)
    }

    fn observe(&mut self, event: &SequenceEvent) {
        let new_tokens = match event {
            SequenceEvent::Tokens { token_ids, .. } | SequenceEvent::Finished { token_ids, .. } => token_ids.len(),
            SequenceEvent::PromptLogprobs(_) | SequenceEvent::Failed(_) => 0,
        };
        if new_tokens > 0 {
            let now = Instant::now();
            match self.last_token {
                None => {
                    self.first_token = Some(now);
                    self.metrics
                        .time_to_first_token
                        .observe(self.submitted.elapsed().as_secs_f64());
                    self.metrics.prompt_tokens.inc_by(self.prompt_ids.len() as u64);
                }
                Some(last) => {
                    // vLLM's per-token figure: the gap before each output token after the first.
                    let gap = (now - last).as_secs_f64() / new_tokens as f64;
                    for _ in 0..new_tokens {
                        self.metrics.time_per_output_token.observe(gap);
                    }
                }
            }
            self.last_token = Some(now);
        }
        self.generated += new_tokens;
        match event {
            SequenceEvent::Tokens { .. } => {}
            SequenceEvent::PromptLogprobs(scores) => self.prompt_logprobs = Some(scores.clone()),
            SequenceEvent::Finished { reason, queue_time, .. } => {
                let metrics = &self.metrics;
                let total = self.submitted.elapsed();
                metrics.e2e_request_latency.observe(total.as_secs_f64());
                metrics.request_queue_time.observe(queue_time.as_secs_f64());
                metrics.request_prompt_tokens.observe(self.prompt_ids.len() as f64);
                metrics.request_generation_tokens.observe(self.generated as f64);
                if let (Some(first), true) = (self.first_token, self.generated > 1) {
                    let per_token = first.elapsed() / (self.generated as u32 - 1);
                    metrics.request_time_per_output_token.observe(per_token.as_secs_f64());
                }
                self.finish(openai_finish_reason(*reason));
            }
            // An operator's ending (ClearQueue) is an abort, as vLLM counts a cancelled request,
            // so that dashboards do not read it as the server failing.
            SequenceEvent::Failed(error) if error.kind() == ErrorKind::Aborted => {
                tracing::info!(request_id = %self.id, %error, "request aborted");
                self.finish("abort");
            }
            SequenceEvent::Failed(error) => {
                tracing::warn!(request_id = %self.id, %error, "request failed");
                self.finish("error");
            }
        }
    }

    fn finish(&mut self, outcome: &'static str) {
        self.metrics.record_finished(outcome);
        self.outcome = Some(outcome);
        let ttft = self.first_token.map(|first| first - self.submitted);
        tracing::info!(
            request_id = %self.id,
            front = self.front,
            prompt_tokens = self.prompt_ids.len(),
            generated_tokens = self.generated,
            time_to_first_token_ms = ttft.map(|t| t.as_secs_f64() * 1e3),
            total_ms = self.submitted.elapsed().as_secs_f64() * 1e3,
            finish_reason = outcome,
            "request finished"
        );
    }
}

impl Stream for TrackedRequest {
    type Item = SequenceEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<SequenceEvent>> {
        let this = &mut *self;
        if let Some(event) = this.held.take() {
            return Poll::Ready(Some(event)); // observed when it was taken
        }
        let polled = match this.events.poll_recv(cx) {
            // The engine let go without a last event (it stopped): a failure, said once.
            Poll::Ready(None) if this.outcome.is_none() => {
                Poll::Ready(Some(SequenceEvent::Failed(EngineError::ShuttingDown)))
            }
            polled => polled,
        };
        if let Poll::Ready(Some(event)) = &polled {
            this.observe(event);
        }
        polled
    }
}

impl Drop for TrackedRequest {
    /// A request dropped before its last event: its client went away (the engine cancels it).
    fn drop(&mut self) {
        if self.outcome.is_none() {
            self.finish("abort");
        }
    }
}
