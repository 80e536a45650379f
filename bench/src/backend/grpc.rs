//! Rivulet's gRPC streaming API.

use std::time::Instant;

use rivulet::proto::generation_client::GenerationClient;
use rivulet::proto::{GenerateRequest, SamplingParams, StoppingCriteria};
use tokio_stream::StreamExt;
use tonic::transport::Channel;

use super::RequestSettings;
use crate::dataset::BenchRequest;
use crate::metrics::RequestOutcome;

#[derive(Clone)]
pub struct RivuletBackend {
    channel: Channel,
}

impl RivuletBackend {
    /// Connects (one HTTP/2 connection, multiplexed by every request of the run).
    pub async fn connect(address: &str) -> Result<Self, tonic::transport::Error> {
        let channel = tonic::transport::Endpoint::from_shared(address.to_owned())?
            .connect()
            .await?;
        Ok(Self { channel })
    }

    pub async fn send(&self, request: &BenchRequest, settings: RequestSettings) -> RequestOutcome {
        let message = GenerateRequest {
            prompt: request.prompt.clone(),
            sampling: Some(SamplingParams {
                temperature: Some(settings.temperature),
                top_p: settings.top_p,
                top_k: settings.top_k,
                frequency_penalty: settings.frequency_penalty,
                presence_penalty: settings.presence_penalty,
                repetition_penalty: settings.repetition_penalty,
                ..Default::default()
            }),
            stopping: Some(StoppingCriteria {
                max_new_tokens: Some(request.max_tokens),
                ignore_eos: settings.ignore_eos,
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut client = GenerationClient::new(self.channel.clone());
        let sent = Instant::now();
        let mut stream = match client.stream_generate(message).await {
            Ok(response) => response.into_inner(),
            Err(status) => return RequestOutcome::failed(format!("{:?}: {}", status.code(), status.message())),
        };
        let mut arrivals = Vec::with_capacity(request.max_tokens as usize);
        let mut output_tokens = 0;
        let mut prompt_tokens = request.prompt_tokens;
        while let Some(item) = stream.next().await {
            match item {
                Ok(chunk) => {
                    if !chunk.token_ids.is_empty() {
                        arrivals.push(sent.elapsed());
                        output_tokens += chunk.token_ids.len();
                    }
                    if let Some(usage) = chunk.usage {
                        prompt_tokens = usage.prompt_tokens as usize;
                        output_tokens = usage.completion_tokens as usize;
                    }
                }
                Err(status) => return RequestOutcome::failed(format!("{:?}: {}", status.code(), status.message())),
            }
        }
        RequestOutcome::completed(prompt_tokens, output_tokens, &arrivals, sent.elapsed())
    }
}
