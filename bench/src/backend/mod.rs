//! The servers a run can drive. Each turns one [`BenchRequest`] into one [`RequestOutcome`],
//! timing every token-bearing message from the moment the request is sent.

mod grpc;
mod openai;

pub use grpc::RivuletBackend;
pub use openai::OpenAiBackend;

use crate::dataset::BenchRequest;
use crate::metrics::RequestOutcome;

/// A server under test.
#[derive(Clone)]
pub enum Backend {
    /// Rivulet's `rivulet.v1.Generation/StreamGenerate`.
    Rivulet(RivuletBackend),
    /// Any server with OpenAI's `/v1/completions` and `stream: true` (llama-server, vLLM, TGI).
    OpenAi(OpenAiBackend),
}

impl Backend {
    pub async fn send(&self, request: &BenchRequest, ignore_eos: bool) -> RequestOutcome {
        match self {
            Self::Rivulet(backend) => backend.send(request, ignore_eos).await,
            Self::OpenAi(backend) => backend.send(request, ignore_eos).await,
        }
    }
}
