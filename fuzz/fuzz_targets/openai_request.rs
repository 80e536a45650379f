//! The HTTP front's translation of an OpenAI request body (both endpoints) into the domain draft,
//! the gRPC-independent sampling validation of the result and a structured output's pattern. Refusals are fine; panics are not.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rivulet_scheduler::api::http::openai::GenerationBody;
use rivulet_scheduler::api::http::translate::{to_drafts, Endpoint};
use rivulet_scheduler::api::validation::sampling_params;
use rivulet_scheduler::guide::pattern;

fuzz_target!(|data: &[u8]| {
    for endpoint in [Endpoint::Completions, Endpoint::Chat] {
        let Ok(body) = serde_json::from_slice::<GenerationBody>(data) else {
            return;
        };
        if let Ok((drafts, _)) = to_drafts(endpoint, "fuzz".to_owned(), body) {
            for draft in drafts {
                // A structured output's translation into one regular expression (outlines-core's
                // for JSON schemas, the refusal of recursive ones, the formats spelled out); the
                // DFA is not built here (seconds a case).
                if let Some((request, _)) = &draft.sampling.guide {
                    let _ = pattern(request);
                }
                // SmolLM2's vocabulary, so that token ids reach both sides of the check.
                let _ = sampling_params(draft.sampling, 49_152);
            }
        }
    }
});
