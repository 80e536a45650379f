//! Two spawned worker replicas behind one scheduler: concurrent greedy requests equal
//! transformers' tokens and both replicas serve; a replica whose worker is SIGKILLed, or
//! SIGSTOPped (hung: caught by the step deadline), loses no request: its sequences move to the
//! other replica and are recomputed, and every stream ends with the reference's tokens; a
//! scheduler killed outright leaves neither workers nor shared memory behind. One server for all
//! of it (each model load costs seconds on two cores).

mod common;

use std::time::Duration;

use common::{
    assert_no_blocks_held, finish_streams, greedy_request, reference_tokens, shm_segments, signal, start_streams,
    stream_tokens, TestServer,
};
use futures::future::join_all;
use rivulet::proto::generation_client::GenerationClient;
use rivulet::proto::GetStatsResponse;
use tonic::transport::Channel;

/// Tokens of each concurrent request; the disturbed streams run twice as long, so that they are
/// still running when their replica's worker is killed or stopped.
const TOKENS: u32 = 48;
const DISTURBED_TOKENS: u32 = 2 * TOKENS;

fn prompts() -> Vec<String> {
    [
        "The capital of France is",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "Once upon a time, in a small village by the sea,",
        "List three uses of copper:",
        "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
        "The quick brown fox",
        "In 1969, the first humans",
        "A haiku about autumn leaves:",
        "Explain photosynthesis to a child:",
        "SELECT name FROM users WHERE",
        "The three primary colours are",
        "My favourite recipe for pancakes starts with",
        "Translate to French: Good morning, how are you?",
        "The Pythagorean theorem states that",
        "Dear hiring manager,",
        "Rust's borrow checker ensures that",
    ]
    .iter()
    .map(|p| (*p).to_owned())
    .collect()
}

/// Starts one stream per prompt, waits until each has its first message, then sends `sig` to the
/// worker of the busiest replica and returns every stream's full token list.
async fn streams_through(
    server: &TestServer,
    client: &GenerationClient<Channel>,
    prompts: &[String],
    sig: &str,
) -> Vec<Vec<u32>> {
    let requests = prompts.iter().map(|p| greedy_request(p, DISTURBED_TOKENS)).collect();
    let streams = start_streams(client, requests).await;
    let stats = server.stats().await;
    let (victim, sequences) = busiest_worker(&stats);
    assert!(
        sequences >= 2,
        "the victim holds several sequences mid-stream: {stats:?}"
    );
    signal(victim, sig);
    finish_streams(streams, "no stream fails: its sequence moves").await
}

/// The worker pid of the replica holding the most sequences, and how many it holds.
fn busiest_worker(stats: &GetStatsResponse) -> (u32, u32) {
    stats
        .replicas
        .iter()
        .map(|r| (r.pid, r.num_running + r.num_waiting))
        .max_by_key(|(_, sequences)| *sequences)
        .expect("a replica")
}

#[tokio::test(flavor = "multi_thread")]
async fn two_replicas_serve_the_reference_and_lose_nothing_when_one_dies_or_hangs() {
    let segments_before = shm_segments();
    let server = TestServer::start(&[
        ("RIVULET_WORKER__REPLICAS", "2"),
        ("RIVULET_WORKER__STEP_TIMEOUT_SECS", "10"),
    ]);
    let prompts = prompts();
    let reference = reference_tokens(&prompts, DISTURBED_TOKENS).await;
    let client = server.client().await;
    common::wait_until(Duration::from_secs(300), "both replicas ready", || async {
        server.stats().await.num_replicas_ready == 2
    })
    .await;

    // Concurrent greedy requests: the reference's tokens, spread over both replicas.
    let outputs = join_all(prompts.iter().map(|prompt| {
        let mut client = client.clone();
        async move { stream_tokens(&mut client, greedy_request(prompt, TOKENS)).await }
    }))
    .await;
    for ((prompt, output), expected) in prompts.iter().zip(outputs).zip(&reference) {
        // Greedy: the first TOKENS of the longer reference.
        assert_eq!(
            output.expect("served"),
            expected[..TOKENS as usize],
            "prompt {prompt:?}"
        );
    }
    let stats = server.stats().await;
    assert_eq!(stats.replicas.len(), 2, "{stats:?}");
    for replica in &stats.replicas {
        assert!(replica.steps > 0, "both replicas served: {replica:?}");
        assert!(replica.kv_blocks_total > 0 && replica.pid > 0, "{replica:?}");
    }
    assert_eq!(stats.num_replicas_ready, 2);

    // SIGKILL the worker of the busier replica while every stream is mid-way.
    let outputs = streams_through(&server, &client, &prompts[..8], "KILL").await;
    for (output, expected) in outputs.iter().zip(&reference) {
        assert_eq!(output, expected, "after SIGKILL");
    }

    // SIGSTOP (a hang): the step deadline declares it dead, it is killed and replaced.
    common::wait_until(Duration::from_secs(300), "both replicas ready again", || async {
        server.stats().await.num_replicas_ready == 2
    })
    .await;
    let outputs = streams_through(&server, &client, &prompts[8..], "STOP").await;
    for (output, expected) in outputs.iter().zip(&reference[8..]) {
        assert_eq!(output, expected, "after SIGSTOP");
    }
    let stats = server.stats().await;
    let restarts: u32 = stats.replicas.iter().map(|r| r.restarts).sum();
    assert_eq!(restarts, 2, "{stats:?}");

    assert_no_blocks_held(&server).await;
    // A scheduler killed outright cannot clean up (SIGTERM's clean exit is the other tests'): its
    // workers see it go, exit, and remove the step buffers it created.
    let workers: Vec<u32> = server.stats().await.replicas.iter().map(|r| r.pid).collect();
    signal(server.pid(), "KILL");
    let exited = |pid: &u32| {
        // Gone, or a zombie nobody reaped yet.
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
            stat.rsplit(')')
                .next()
                .is_some_and(|rest| rest.trim_start().starts_with('Z'))
        })
    };
    common::wait_until(Duration::from_secs(30), "the workers to exit", || async {
        workers.iter().all(exited)
    })
    .await;
    let left: Vec<_> = shm_segments().difference(&segments_before).cloned().collect();
    assert!(left.is_empty(), "shared memory left behind: {left:?}");
}
