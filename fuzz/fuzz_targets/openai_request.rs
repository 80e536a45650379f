//! The HTTP front's translation of an OpenAI request body (both endpoints) into the domain draft,
//! and the gRPC-independent sampling validation of the result. Refusals are fine; panics are not.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rivulet_scheduler::api::http::openai::GenerationBody;
use rivulet_scheduler::api::http::translate::{to_drafts, Endpoint};
use rivulet_scheduler::api::validation::sampling_params;

fuzz_target!(|data: &[u8]| {
    for endpoint in [Endpoint::Completions, Endpoint::Chat] {
        let Ok(body) = serde_json::from_slice::<GenerationBody>(data) else {
            return;
        };
        if let Ok(drafts) = to_drafts(endpoint, "fuzz".to_owned(), body) {
            for draft in drafts {
                // SmolLM2's vocabulary, so that token ids reach both sides of the check.
                let _ = sampling_params(draft.sampling, 49_152);
            }
        }
    }
});
