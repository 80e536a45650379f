//! Completion over gRPC on the real model: stop strings (across token boundaries, trimmed or
//! kept, streaming and unary agreeing), stop token ids, the character limit, and a full queue.

mod common;

use common::{greedy_request, shared_server, TestServer, SMOLLM_KV_BLOCK_BYTES};
use rivulet::proto::{FinishReason, GenerateRequest, StoppingCriteria};
use tokio_stream::StreamExt;
use tonic::Code;

const PROMPT: &str = "Write a short story about a lighthouse keeper and a storm.";

/// The streamed text deltas and token ids of a greedy run that never stops early.
async fn greedy_deltas(prompt: &str, tokens: u32) -> Vec<(Vec<u32>, String)> {
    let mut client = shared_server().client().await;
    let mut stream = client
        .stream_generate(greedy_request(prompt, tokens))
        .await
        .expect("stream")
        .into_inner();
    let mut deltas = Vec::new();
    while let Some(message) = stream.next().await {
        let message = message.expect("message");
        deltas.push((message.token_ids, message.text));
    }
    deltas
}

fn with_stopping(prompt: &str, stopping: StoppingCriteria) -> GenerateRequest {
    GenerateRequest {
        stopping: Some(stopping),
        ..greedy_request(prompt, 0)
    }
}

async fn unary_and_streamed(request: GenerateRequest) -> (rivulet::proto::GenerateResponse, String, FinishReason) {
    let mut client = shared_server().client().await;
    let unary = client.generate(request.clone()).await.expect("unary").into_inner();
    let mut stream = client.stream_generate(request).await.expect("stream").into_inner();
    let (mut text, mut reason, mut stop) = (String::new(), FinishReason::Unspecified, (None, None));
    while let Some(message) = stream.next().await {
        let message = message.expect("message");
        text.push_str(&message.text);
        reason = message.finish_reason();
        stop = (message.stop_string, message.stop_token_id);
    }
    // Which stop ended it (vLLM's stop_reason) comes on the stream's last message as on the unary.
    assert_eq!(stop, (unary.stop_string.clone(), unary.stop_token_id));
    (unary, text, reason)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stop_string_spanning_tokens_ends_the_output_and_is_trimmed() {
    let deltas = greedy_deltas(PROMPT, 48).await;
    let full: String = deltas.iter().map(|(_, text)| text.as_str()).collect();
    // A stop string made of the end of one token's text and the start of the next one's.
    let (left, right) = deltas
        .windows(2)
        .skip(3)
        .map(|pair| (pair[0].1.clone(), pair[1].1.clone()))
        .find(|(a, b)| a.chars().count() >= 2 && b.chars().count() >= 2)
        .expect("two adjacent multi-character tokens");
    let stop: String = left
        .chars()
        .rev()
        .take(2)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .chain(right.chars().take(2))
        .collect();
    let cut = full.find(&stop).expect("the stop string occurs in the output");
    let stopping = StoppingCriteria {
        max_new_tokens: Some(48),
        ignore_eos: true,
        stop: vec![stop.clone()],
        ..Default::default()
    };

    let (unary, streamed, reason) = unary_and_streamed(with_stopping(PROMPT, stopping.clone())).await;
    assert_eq!(unary.finish_reason(), FinishReason::StopString);
    assert_eq!(reason, FinishReason::StopString);
    assert_eq!(unary.text, full[..cut], "output trimmed before {stop:?}");
    assert_eq!(streamed, unary.text, "streaming and unary agree");
    assert_eq!(
        (unary.stop_string.as_deref(), unary.stop_token_id),
        (Some(stop.as_str()), None)
    );
    assert!(unary.token_ids.len() < 48);

    // The token that completes the stop string is the last one allowed: the stop still names the
    // finish (as vLLM's), since the text is trimmed at it.
    let at_limit = StoppingCriteria {
        max_new_tokens: Some(unary.token_ids.len() as u32),
        ..stopping.clone()
    };
    let (limited, streamed, reason) = unary_and_streamed(with_stopping(PROMPT, at_limit)).await;
    assert_eq!(
        (limited.finish_reason(), reason),
        (FinishReason::StopString, FinishReason::StopString)
    );
    assert_eq!((limited.text.as_str(), streamed.as_str()), (&full[..cut], &full[..cut]));
    assert_eq!(limited.stop_string.as_deref(), Some(stop.as_str()));

    let keep = StoppingCriteria {
        include_stop_str_in_output: true,
        ..stopping
    };
    let (unary, streamed, _) = unary_and_streamed(with_stopping(PROMPT, keep)).await;
    assert_eq!(unary.text, full[..cut + stop.len()]);
    assert_eq!(streamed, unary.text);
}

#[tokio::test(flavor = "multi_thread")]
async fn stop_token_ids_min_new_tokens_and_the_character_limit() {
    let deltas = greedy_deltas(PROMPT, 24).await;
    let tokens: Vec<u32> = deltas.iter().flat_map(|(ids, _)| ids.clone()).collect();
    let full: String = deltas.iter().map(|(_, text)| text.as_str()).collect();

    // Stop at the 6th generated token's id (its first occurrence).
    let stop_token = tokens[5];
    let first = tokens.iter().position(|&t| t == stop_token).expect("present");
    let stopping = StoppingCriteria {
        max_new_tokens: Some(24),
        ignore_eos: true,
        stop_token_ids: vec![stop_token],
        ..Default::default()
    };
    let (unary, streamed, reason) = unary_and_streamed(with_stopping(PROMPT, stopping.clone())).await;
    assert_eq!(unary.finish_reason(), FinishReason::StopToken);
    assert_eq!(reason, FinishReason::StopToken);
    assert_eq!(unary.token_ids, tokens[..=first]);
    assert_eq!(
        (unary.stop_string.as_deref(), unary.stop_token_id),
        (None, Some(stop_token))
    );
    // As in vLLM, the stopping token's text is left out (its id stays) unless the request keeps
    // what stopped it: the text is that of the tokens before it, or through it.
    let text_of = |count: usize| async move {
        let through = StoppingCriteria {
            max_new_tokens: Some(count as u32),
            ignore_eos: true,
            ..Default::default()
        };
        match count {
            0 => String::new(),
            _ => unary_and_streamed(with_stopping(PROMPT, through)).await.0.text,
        }
    };
    assert_eq!(unary.text, text_of(first).await);
    assert_eq!(streamed, unary.text);
    let kept = StoppingCriteria {
        include_stop_str_in_output: true,
        ..stopping.clone()
    };
    let (unary, streamed, _) = unary_and_streamed(with_stopping(PROMPT, kept)).await;
    assert_eq!(unary.text, text_of(first + 1).await);
    assert_eq!(streamed, unary.text);

    // Never chosen before min_new_tokens (vLLM's min_tokens): the same tokens up to it, then
    // another, and the stop token only from `min` on, where it ends the output.
    let min = first + 2;
    let at_least = StoppingCriteria {
        min_new_tokens: min as u32,
        ..stopping
    };
    let (unary, _, reason) = unary_and_streamed(with_stopping(PROMPT, at_least)).await;
    let ids = &unary.token_ids;
    assert_eq!(ids[..first], tokens[..first]);
    assert!(!ids[..min].contains(&stop_token), "{ids:?}");
    match ids.iter().position(|&t| t == stop_token) {
        Some(at) => assert_eq!((at + 1, reason), (ids.len(), FinishReason::StopToken)),
        None => assert_eq!((ids.len(), reason), (24, FinishReason::MaxTokens)),
    }

    // The character limit cuts the text on a character boundary, reason LENGTH.
    let limit = full.chars().count() / 2;
    let chars = StoppingCriteria {
        max_new_tokens: Some(24),
        ignore_eos: true,
        max_response_chars: Some(limit as u32),
        ..Default::default()
    };
    let (unary, streamed, reason) = unary_and_streamed(with_stopping(PROMPT, chars)).await;
    assert_eq!(unary.finish_reason(), FinishReason::Length);
    assert_eq!(reason, FinishReason::Length);
    assert_eq!(unary.text, full.chars().take(limit).collect::<String>());
    assert_eq!(streamed, unary.text);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_queue_is_resource_exhausted_and_the_server_recovers() {
    // 24 KV blocks of which 90% are kept from new admissions while anything runs, and room for
    // one waiting request.
    let kv_bytes = (24 * SMOLLM_KV_BLOCK_BYTES).to_string();
    let server = TestServer::start(&[
        ("RIVULET_MODEL__MAX_MODEL_LEN", "256"),
        ("RIVULET_WORKER__KV_CACHE_MEMORY", kv_bytes.as_str()),
        ("RIVULET_SCHEDULER__RESERVED_BLOCK_RATIO", "0.9"),
        ("RIVULET_SCHEDULER__MAX_QUEUED_REQUESTS", "1"),
    ]);
    let mut client = server.client().await;
    // One long request runs and grows past the three blocks left outside the reserve ...
    let mut running = client
        .stream_generate(greedy_request(PROMPT, 200))
        .await
        .expect("running")
        .into_inner();
    for _ in 0..40 {
        running.next().await.expect("message").expect("ok");
    }
    // ... so the next one cannot be admitted and waits (the only queue slot) ...
    let mut waiting_client = server.client().await;
    let waiting = tokio::spawn(async move { waiting_client.generate(greedy_request("Hello", 4)).await });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(server.stats().await.num_waiting, 1);
    // ... and the one after it is turned away.
    let status = client
        .generate(greedy_request("Hello", 4))
        .await
        .expect_err("queue full");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("queue is full"), "{}", status.message());

    drop(running); // cancelling frees its blocks; the waiting request then runs.
    let response = waiting
        .await
        .expect("join")
        .expect("the queued request is served")
        .into_inner();
    assert_eq!(response.token_ids.len(), 4);
    let response = client
        .generate(greedy_request("Hello", 4))
        .await
        .expect("served again")
        .into_inner();
    assert_eq!(response.token_ids.len(), 4);
}

#[tokio::test(flavor = "multi_thread")]
async fn confidence_stop_ends_at_the_first_unlikely_token() {
    let with_logprobs = |confidence_threshold| {
        let mut request = with_stopping(
            PROMPT,
            StoppingCriteria {
                max_new_tokens: Some(48),
                ignore_eos: true,
                confidence_threshold,
                ..Default::default()
            },
        );
        request.sampling = Some(rivulet::proto::SamplingParams {
            temperature: Some(0.0),
            logprobs: true,
            ..Default::default()
        });
        request
    };
    // The whole greedy run and each token's probability under the model.
    let (full, _, _) = unary_and_streamed(with_logprobs(None)).await;
    let probabilities: Vec<f32> = full.logprobs.iter().map(|l| l.logprob.exp()).collect();
    // A threshold the run crosses: 0.9, or just above its least likely token.
    let least = probabilities.iter().copied().fold(1.0f32, f32::min);
    let threshold = if least < 0.85 { 0.9 } else { least + 1e-3 };
    let stop_at = probabilities
        .iter()
        .position(|&p| p < threshold)
        .expect("a token below the threshold");

    let (stopped, _, streamed_reason) = unary_and_streamed(with_logprobs(Some(threshold))).await;
    assert_eq!(stopped.finish_reason(), FinishReason::LowConfidence);
    assert_eq!(streamed_reason, FinishReason::LowConfidence);
    assert_eq!(
        stopped.token_ids,
        full.token_ids[..=stop_at],
        "the greedy tokens up to and including the first with probability < {threshold}: {probabilities:?}"
    );

    let mut client = shared_server().client().await;
    let error = client
        .generate(with_logprobs(Some(1.5)))
        .await
        .expect_err("out of range");
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(
        error.message().starts_with("stopping.confidence_threshold"),
        "{}",
        error.message()
    );
}
