//! The chaos soak's calls: the mixed load's kinds of call, what each must give back, and the
//! check of each outcome against it.

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::Rng;
use rivulet::proto::generation_client::GenerationClient;
use rivulet::proto::{FinishReason, GenerateRequest, SamplingParams};
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic::Code;

use super::common::greedy_request;
use super::{CALL_DEADLINE, REFERENCE_TOKENS, SEEDED_TOKENS};

/// What each prompt must give, from transformers (greedy) or an undisturbed run before the chaos.
pub(super) struct Expected {
    pub(super) prompts: Vec<String>,
    pub(super) greedy: Vec<Vec<u32>>,
    pub(super) seeded: Vec<Vec<u32>>,
    /// A stop string inside the greedy output's text, and that text up to it.
    pub(super) stop: Vec<(String, String)>,
}

pub(super) fn seeded_request(prompt: &str, index: usize) -> GenerateRequest {
    GenerateRequest {
        sampling: Some(SamplingParams {
            temperature: Some(0.9),
            seed: Some(1000 + index as u64),
            ..Default::default()
        }),
        ..greedy_request(prompt, SEEDED_TOKENS)
    }
}

fn stop_request(prompt: &str, stop: &str) -> GenerateRequest {
    let mut request = greedy_request(prompt, REFERENCE_TOKENS);
    if let Some(stopping) = request.stopping.as_mut() {
        stopping.stop = vec![stop.to_owned()];
    }
    request
}

/// Three characters from the middle of `text` (not all blank) and the text before their first
/// occurrence.
pub(super) fn stop_string_within(text: &str) -> (String, String) {
    let chars: Vec<char> = text.chars().collect();
    let start = (chars.len() / 2..chars.len().saturating_sub(3))
        .find(|&i| chars[i..i + 3].iter().any(|c| !c.is_whitespace()))
        .unwrap_or_else(|| panic!("no stop string in {text:?}"));
    let stop: String = chars[start..start + 3].iter().collect();
    let cut = text.find(&stop).expect("the stop string is in the text");
    (stop, text[..cut].to_owned())
}

/// One call of the mixed load.
#[derive(Clone, Copy, Debug)]
pub(super) enum Call {
    GreedyUnary {
        prompt: usize,
        tokens: u32,
    },
    GreedyStream {
        prompt: usize,
        tokens: u32,
    },
    Seeded {
        prompt: usize,
        stream: bool,
    },
    StopString {
        prompt: usize,
    },
    /// A stream the client drops after this many messages.
    CancelledStream {
        prompt: usize,
        after_messages: usize,
    },
    /// A unary call the client gives up on after this long.
    CancelledUnary {
        prompt: usize,
        after: Duration,
    },
}

impl Call {
    pub(super) fn random(rng: &mut StdRng, prompts: usize) -> Self {
        let prompt = rng.random_range(0..prompts);
        let tokens = rng.random_range(4..=REFERENCE_TOKENS);
        match rng.random_range(0..6) {
            0 => Call::GreedyUnary { prompt, tokens },
            1 => Call::GreedyStream { prompt, tokens },
            2 => Call::Seeded {
                prompt,
                stream: rng.random(),
            },
            3 => Call::StopString { prompt },
            4 => Call::CancelledStream {
                prompt,
                after_messages: rng.random_range(1..=4),
            },
            _ => Call::CancelledUnary {
                prompt,
                after: Duration::from_millis(rng.random_range(20..1500)),
            },
        }
    }
}

#[derive(Debug, PartialEq)]
pub(super) enum Outcome {
    Served,
    Cancelled,
    Refused(Duration),
}

/// Tokens and the last finish reason of a stream read to its end.
pub(super) async fn read_stream(
    client: &mut GenerationClient<Channel>,
    request: GenerateRequest,
) -> Result<(Vec<u32>, FinishReason), tonic::Status> {
    let mut stream = client.stream_generate(request).await?.into_inner();
    let (mut tokens, mut reason) = (Vec::new(), FinishReason::Unspecified);
    while let Some(message) = stream.next().await {
        let message = message?;
        reason = message.finish_reason();
        tokens.extend(message.token_ids);
    }
    Ok((tokens, reason))
}

fn check(what: &str, ok: bool, detail: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(format!("{what}: {}", detail()))
    }
}

/// Makes `call` and checks what came back; `Err` describes a broken promise.
pub(super) async fn make(
    client: &mut GenerationClient<Channel>,
    call: Call,
    expected: &Expected,
) -> Result<Outcome, String> {
    let started = Instant::now();
    let result = tokio::time::timeout(CALL_DEADLINE, make_unchecked(client, call, expected)).await;
    match result {
        Err(_) => Err(format!("{call:?} hung for {CALL_DEADLINE:?}")),
        Ok(Ok(checked)) => checked.map_err(|broken| format!("{call:?}: {broken}")),
        Ok(Err(status)) if status.code() == Code::ResourceExhausted => Ok(Outcome::Refused(started.elapsed())),
        Ok(Err(status)) => Err(format!("{call:?} failed: {status:?}")),
    }
}

/// The call itself: a transport `Status` (refusal or failure) or the checked outcome.
async fn make_unchecked(
    client: &mut GenerationClient<Channel>,
    call: Call,
    expected: &Expected,
) -> Result<Result<Outcome, String>, tonic::Status> {
    let prompt_of = |p: usize| expected.prompts[p].as_str();
    let served = match call {
        Call::GreedyUnary { prompt, tokens } => {
            let response = client
                .generate(greedy_request(prompt_of(prompt), tokens))
                .await?
                .into_inner();
            let want = &expected.greedy[prompt][..tokens as usize];
            let reason = response.finish_reason();
            check("greedy unary", response.token_ids == want, || {
                format!("{:?} != {want:?}", response.token_ids)
            })
            .and(check("greedy unary", reason == FinishReason::MaxTokens, || {
                format!("{reason:?}")
            }))
        }
        Call::GreedyStream { prompt, tokens } => {
            let (got, reason) = read_stream(client, greedy_request(prompt_of(prompt), tokens)).await?;
            let want = &expected.greedy[prompt][..tokens as usize];
            check("greedy stream", got == want, || format!("{got:?} != {want:?}")).and(check(
                "greedy stream",
                reason == FinishReason::MaxTokens,
                || format!("{reason:?}"),
            ))
        }
        Call::Seeded { prompt, stream } => {
            let request = seeded_request(prompt_of(prompt), prompt);
            let got = if stream {
                read_stream(client, request).await?.0
            } else {
                client.generate(request).await?.into_inner().token_ids
            };
            let want = &expected.seeded[prompt];
            check("seeded", &got == want, || format!("{got:?} != {want:?}"))
        }
        Call::StopString { prompt } => {
            let (stop, want) = &expected.stop[prompt];
            let response = client
                .generate(stop_request(prompt_of(prompt), stop))
                .await?
                .into_inner();
            let reason = response.finish_reason();
            check("stop string", &response.text == want, || {
                format!("{:?} != {want:?}", response.text)
            })
            .and(check("stop string", reason == FinishReason::StopString, || {
                format!("{reason:?}")
            }))
        }
        Call::CancelledStream { prompt, after_messages } => {
            let request = greedy_request(prompt_of(prompt), REFERENCE_TOKENS);
            let mut stream = client.stream_generate(request).await?.into_inner();
            let mut tokens = Vec::new();
            for _ in 0..after_messages {
                match stream.next().await {
                    Some(message) => tokens.extend(message?.token_ids),
                    None => break,
                }
            }
            // Dropping the stream here cancels the request mid-way.
            let want = &expected.greedy[prompt][..tokens.len()];
            let so_far = check("cancelled stream's tokens", tokens == want, || {
                format!("{tokens:?} != {want:?}")
            });
            return Ok(so_far.map(|()| Outcome::Cancelled));
        }
        Call::CancelledUnary { prompt, after } => {
            let request = greedy_request(prompt_of(prompt), REFERENCE_TOKENS);
            let Ok(response) = tokio::time::timeout(after, client.generate(request)).await else {
                // Dropping the call cancels the request.
                return Ok(Ok(Outcome::Cancelled));
            };
            let got = response?.into_inner().token_ids;
            let want = &expected.greedy[prompt];
            check("unary done before its cancel", &got == want, || {
                format!("{got:?} != {want:?}")
            })
        }
    };
    Ok(served.map(|()| Outcome::Served))
}
