//! One replica whose worker is SIGKILLed mid-stream: the streams do not fail but continue once
//! the restarted worker has recomputed them, with the tokens of an undisturbed run (transformers'
//! for greedy; the same request's earlier run for seeded sampling), and nothing is sent twice. The restarted worker starts with an empty prefix cache: a long
//! prompt cached before the kill is computed afresh and gives the reference's tokens (before the
//! replica owned its cache, the old cache entries pointed at blocks the new worker never
//! computed, and the output was garbage).

mod common;

use std::time::Duration;

use common::{
    assert_no_blocks_held, greedy_request, reference_tokens, shm_segments, signal, stream_tokens, TestServer,
};
use rivulet::proto::{FinishReason, GenerateRequest, SamplingParams};
use tokio_stream::StreamExt;

const TOKENS: u32 = 40;

fn long_prompt() -> String {
    "You are a careful assistant. Summarise the following notes about the history of the bicycle: \
     the draisine of 1817 had no pedals, the velocipede of the 1860s put cranks on the front wheel, \
     the high-wheeler made that wheel enormous for speed, and the safety bicycle of the 1880s \
     brought chain drive and equal wheels. Summary:"
        .to_owned()
}

fn seeded_request(prompt: &str) -> GenerateRequest {
    GenerateRequest {
        sampling: Some(SamplingParams {
            temperature: Some(0.9),
            seed: Some(4242),
            ..Default::default()
        }),
        ..greedy_request(prompt, TOKENS)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_worker_is_replaced_and_its_streams_continue_with_the_reference_tokens() {
    let segments_before = shm_segments();
    let mut server = TestServer::start(&[]);
    let prompts = vec![
        long_prompt(),
        "Tell me a very long story about a lighthouse keeper.".to_owned(),
    ];
    let reference = reference_tokens(&prompts, TOKENS).await;
    let mut client = server.client().await;

    // The long prompt once: its full blocks enter the prefix cache.
    let first = client
        .generate(greedy_request(&prompts[0], TOKENS))
        .await
        .expect("generate")
        .into_inner();
    assert_eq!(first.token_ids, reference[0]);

    // A seeded sampled request, undisturbed, for comparison.
    let undisturbed_seeded = stream_tokens(&mut client, seeded_request(&prompts[1]))
        .await
        .expect("seeded");

    // A greedy and a seeded stream in flight when the worker dies.
    let mut stream = client
        .stream_generate(greedy_request(&prompts[1], TOKENS))
        .await
        .expect("stream")
        .into_inner();
    let seeded_stream = {
        let mut client = client.clone();
        let prompt = prompts[1].clone();
        tokio::spawn(async move { stream_tokens(&mut client, seeded_request(&prompt)).await })
    };
    let mut streamed = stream.next().await.expect("a first message").expect("ok").token_ids;
    let stats = server.stats().await;
    let worker = stats.replicas[0].pid;
    assert_ne!(worker, 0, "{stats:?}");
    signal(worker, "KILL");

    let rest = tokio::time::timeout(Duration::from_secs(180), async {
        let mut last = None;
        while let Some(message) = stream.next().await {
            let message = message.expect("the stream continues after the worker died");
            streamed.extend(message.token_ids);
            last = Some(message.finish_reason);
        }
        last
    })
    .await
    .expect("the stream must end, not hang");
    assert_eq!(rest, Some(FinishReason::MaxTokens as i32));
    assert_eq!(streamed, reference[1], "the tokens of an undisturbed run, none twice");
    let seeded = seeded_stream
        .await
        .expect("task")
        .expect("the seeded stream continues too");
    assert_eq!(
        seeded, undisturbed_seeded,
        "a seeded stream draws the same tokens after recovery"
    );

    let stats = server.stats().await;
    assert_eq!(stats.replicas.len(), 1, "{stats:?}");
    assert_eq!(stats.replicas[0].restarts, 1, "{stats:?}");
    assert_ne!(stats.replicas[0].pid, worker, "a new worker process");

    // The new worker computed nothing yet: the long prompt is not served from a stale cache.
    let again = client
        .generate(greedy_request(&prompts[0], TOKENS))
        .await
        .expect("generate after the restart")
        .into_inner();
    assert_eq!(again.token_ids, reference[0]);
    assert_eq!(again.usage.expect("usage").cached_prompt_tokens, 0);
    // ... and its own cache serves it from now on.
    let cached = client
        .generate(greedy_request(&prompts[0], TOKENS))
        .await
        .expect("generate from the new cache")
        .into_inner();
    assert_eq!(cached.token_ids, reference[0]);
    assert!(cached.usage.expect("usage").cached_prompt_tokens > 0);

    assert_no_blocks_held(&server).await;
    let status = server.terminate();
    assert!(status.success(), "clean exit after SIGTERM: {status:?}");
    let left: Vec<_> = shm_segments().difference(&segments_before).cloned().collect();
    assert!(left.is_empty(), "shared memory left behind: {left:?}");
}
