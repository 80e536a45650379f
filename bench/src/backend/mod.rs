//! The servers a run can drive. Each turns one [`BenchRequest`] into one [`RequestOutcome`],
//! timing every token-bearing message from the moment the request is sent.

mod grpc;
mod openai;

pub use grpc::RivuletBackend;
pub use openai::OpenAiBackend;

use crate::dataset::BenchRequest;
use crate::metrics::RequestOutcome;

/// What every request of a run asks for besides its prompt and length.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestSettings {
    /// Generate exactly the output length, past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// 0 is greedy.
    pub temperature: f32,
    /// Unset: the server's default (all tokens).
    pub top_p: Option<f32>,
    /// Unset: the server's default (all tokens).
    pub top_k: Option<i32>,
    /// Penalties; unset: the server's defaults (none).
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

/// A server under test.
#[derive(Clone)]
pub enum Backend {
    /// Rivulet's `rivulet.v1.Generation/StreamGenerate`.
    Rivulet(RivuletBackend),
    /// Any server with OpenAI's `/v1/completions` and `stream: true` (llama-server, vLLM, TGI).
    OpenAi(OpenAiBackend),
}

impl Backend {
    pub async fn send(&self, request: &BenchRequest, settings: RequestSettings) -> RequestOutcome {
        match self {
            Self::Rivulet(backend) => backend.send(request, settings).await,
            Self::OpenAi(backend) => backend.send(request, settings).await,
        }
    }
}
