//! The scheduler end to end on the real model: chunked prefill beside running streams, the prefix
//! cache, preemption under a tiny KV cache, cancellations freeing every block, and switching the
//! policy while serving.

mod common;

use std::time::{Duration, Instant};

use common::{greedy_request, TestServer, SMOLLM_KV_BLOCK_BYTES};
use futures::stream::{self, StreamExt};
use rivulet::proto::{GenerateRequest, SchedulingPolicy, SetSchedulingPolicyRequest};

fn long_text(words: usize, seed: usize) -> String {
    let vocabulary = [
        "river", "stone", "light", "market", "winter", "engine", "garden", "signal", "paper", "orbit",
    ];
    (0..words)
        .map(|i| vocabulary[(i * 7 + seed * 3 + i / 10) % vocabulary.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_long_prompt_is_prefilled_in_chunks_while_another_stream_keeps_receiving_tokens() {
    let server = TestServer::start(&[("RIVULET_SCHEDULER__MAX_NUM_BATCHED_TOKENS", "64")]);
    let mut client = server.client().await;
    let mut short = client
        .stream_generate(greedy_request("Count slowly:", 300))
        .await
        .expect("stream")
        .into_inner();
    short.next().await.expect("first").expect("ok");
    let short_times = tokio::spawn(async move {
        let mut times = Vec::new();
        while let Some(message) = short.next().await {
            message.expect("ok");
            times.push(Instant::now());
        }
        times
    });

    let long_prompt = long_text(700, 1);
    let sent = Instant::now();
    let mut long_client = server.client().await;
    let mut long = long_client
        .stream_generate(greedy_request(&long_prompt, 4))
        .await
        .expect("long")
        .into_inner();
    long.next().await.expect("first of long").expect("ok");
    let long_first_token = Instant::now();
    let long_usage = loop {
        let message = long.next().await.expect("message").expect("ok");
        if let Some(usage) = message.usage {
            break usage;
        }
    };
    assert!(
        long_usage.prompt_tokens > 640,
        "the prompt needs over ten 64-token chunks"
    );
    let times = short_times.await.expect("join");
    let during = times.iter().filter(|t| **t > sent && **t < long_first_token).count();
    assert!(
        during >= 5,
        "only {during} tokens of the running stream arrived while the long prompt was prefilled"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_shared_prefix_is_reused_and_gives_the_same_output() {
    let prefix = format!("{}\n\nQuestion: ", long_text(200, 2));
    let first = greedy_request(&format!("{prefix}What is the first word?"), 16);
    let second = greedy_request(&format!("{prefix}Which word repeats?"), 16);

    let cached = TestServer::start(&[]);
    let mut client = cached.client().await;
    let cold = client.generate(first).await.expect("first").into_inner();
    assert_eq!(cold.usage.expect("usage").cached_prompt_tokens, 0);
    let warm = client.generate(second.clone()).await.expect("second").into_inner();
    let warm_usage = warm.usage.expect("usage");
    assert!(
        warm_usage.cached_prompt_tokens >= 160,
        "cached {} of {}",
        warm_usage.cached_prompt_tokens,
        warm_usage.prompt_tokens
    );
    assert_eq!(warm_usage.cached_prompt_tokens % 16, 0, "whole blocks");
    assert!(cached.stats().await.prefix_cache_hit_rate > 0.0);

    let uncached = TestServer::start(&[("RIVULET_SCHEDULER__PREFIX_CACHE", "false")]);
    let reference = uncached
        .client()
        .await
        .generate(second)
        .await
        .expect("uncached")
        .into_inner();
    assert_eq!(reference.usage.expect("usage").cached_prompt_tokens, 0);
    assert_eq!(
        warm.token_ids, reference.token_ids,
        "the cache changes nothing in the output"
    );
}

fn tiny_cache_server() -> TestServer {
    // 24 blocks of 16 tokens, the least that holds one 256-token sequence plus a little.
    let bytes = (24 * SMOLLM_KV_BLOCK_BYTES).to_string();
    TestServer::start(&[
        ("RIVULET_MODEL__MAX_MODEL_LEN", "256"),
        ("RIVULET_WORKER__KV_CACHE_MEMORY", bytes.as_str()),
    ])
}

#[tokio::test(flavor = "multi_thread")]
async fn under_a_tiny_kv_cache_preempted_requests_still_get_exactly_their_own_tokens() {
    let server = tiny_cache_server();
    let stats = server.stats().await;
    assert_eq!(stats.kv_blocks_total, 24);
    let prompts: Vec<String> = (0..16).map(|i| format!("Story {i}: {}", long_text(12, i))).collect();

    let together: Vec<Vec<u32>> = futures::future::join_all(prompts.iter().map(|prompt| {
        let server = &server;
        async move {
            server
                .client()
                .await
                .generate(greedy_request(prompt, 48))
                .await
                .expect("together")
                .into_inner()
                .token_ids
        }
    }))
    .await;
    let stats = server.stats().await;
    assert!(stats.num_preemptions > 0, "16 × ~4 blocks in 24 blocks must preempt");

    let mut client = server.client().await;
    for (prompt, together) in prompts.iter().zip(together) {
        let alone = client
            .generate(greedy_request(prompt, 48))
            .await
            .expect("alone")
            .into_inner()
            .token_ids;
        assert_eq!(together.len(), 48);
        assert_eq!(together, alone, "preemption changed the output of {prompt:?}");
    }

    // A prompt 6 tokens short of the 256-token context, without max_new_tokens: the server's
    // default (16) is cut to the room left, as vLLM caps its default, not refused.
    let near_full = GenerateRequest {
        prompt_token_ids: vec![1000; 250],
        stopping: Some(rivulet::proto::StoppingCriteria {
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let output = client
        .generate(near_full)
        .await
        .expect("capped, not refused")
        .into_inner();
    assert_eq!(output.token_ids.len(), 6);
}

/// A tiny deterministic generator for the cancellation pattern.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, bound: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % bound
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn after_many_cancelled_and_expired_requests_every_kv_block_is_free_or_cached() {
    let server = tiny_cache_server();
    let mut rng = Lcg(42);
    let plans: Vec<(u64, u64, String)> = (0..200)
        .map(|i| (rng.next(4), rng.next(6) + 1, format!("Note {i}: {}", long_text(8, i))))
        .collect();
    let outcomes: Vec<&str> = stream::iter(plans)
        .map(|(mode, amount, prompt)| {
            let server = &server;
            async move {
                let mut client = server.client().await;
                match mode {
                    // Dropped after a few streamed messages.
                    0 => {
                        let mut stream = client
                            .stream_generate(greedy_request(&prompt, 40))
                            .await
                            .expect("stream")
                            .into_inner();
                        for _ in 0..amount {
                            let _ = stream.next().await;
                        }
                        "dropped"
                    }
                    // A deadline that usually passes mid-generation.
                    1 => {
                        let mut request = tonic::Request::new(greedy_request(&prompt, 40));
                        request.set_timeout(Duration::from_millis(amount * 60));
                        match client.generate(request).await {
                            Ok(_) => "completed",
                            Err(status) => {
                                // The client's own timer (Cancelled) or the server's deadline (DeadlineExceeded).
                                let expired = [tonic::Code::Cancelled, tonic::Code::DeadlineExceeded];
                                assert!(expired.contains(&status.code()), "{status:?}");
                                "expired"
                            }
                        }
                    }
                    _ => {
                        let response = client
                            .generate(greedy_request(&prompt, amount as u32))
                            .await
                            .expect("ok");
                        assert_eq!(response.into_inner().token_ids.len(), amount as usize);
                        "completed"
                    }
                }
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    assert!(outcomes.contains(&"dropped") && outcomes.contains(&"expired") && outcomes.contains(&"completed"));

    // Cancellations are noticed at the next iteration; wait until the engine is idle.
    let deadline = Instant::now() + Duration::from_secs(30);
    let stats = loop {
        let stats = server.stats().await;
        if (stats.num_running == 0 && stats.num_waiting == 0) || Instant::now() > deadline {
            break stats;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!((stats.num_running, stats.num_waiting), (0, 0));
    assert_eq!(stats.kv_blocks_used, 0, "{stats:?}");
    assert_eq!(stats.kv_blocks_free + stats.kv_blocks_cached, stats.kv_blocks_total);
    // And the server still serves.
    let response = server
        .client()
        .await
        .generate(greedy_request("Hello", 4))
        .await
        .expect("after")
        .into_inner();
    assert_eq!(response.token_ids.len(), 4);
}

/// Sends a long prompt (one long prefill step) and, while it runs, three short requests in the
/// order B, C, D; returns their ids in the order their first tokens arrived.
async fn first_token_order(server: &TestServer, seed: usize) -> Vec<char> {
    let mut client = server.client().await;
    let long = greedy_request(&long_text(900, seed), 4);
    let blocker = tokio::spawn(async move { client.generate(long).await.expect("long").into_inner() });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (order_tx, mut order_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for name in ['B', 'C', 'D'] {
        let mut client = server.client().await;
        let order_tx = order_tx.clone();
        let request: GenerateRequest = greedy_request(&format!("Request {name} {seed}: say hi"), 3);
        tasks.push(tokio::spawn(async move {
            let mut stream = client.stream_generate(request).await.expect("stream").into_inner();
            let _ = stream.next().await;
            let _ = order_tx.send(name);
            while stream.next().await.is_some() {}
        }));
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    drop(order_tx);
    for task in tasks {
        task.await.expect("join");
    }
    blocker.await.expect("join");
    let mut order = Vec::new();
    while let Some(name) = order_rx.recv().await {
        order.push(name);
    }
    order
}

#[tokio::test(flavor = "multi_thread")]
async fn switching_the_policy_while_serving_changes_who_gets_the_first_token_first() {
    let server = TestServer::start(&[
        ("RIVULET_SCHEDULER__MAX_NUM_SEQS", "1"),
        ("RIVULET_SCHEDULER__MAX_NUM_BATCHED_TOKENS", "2048"),
        ("RIVULET_SCHEDULER__PREFIX_CACHE", "false"),
    ]);
    assert_eq!(server.stats().await.scheduling_policy(), SchedulingPolicy::Fair);
    assert_eq!(
        first_token_order(&server, 1).await,
        vec!['B', 'C', 'D'],
        "FAIR serves in arrival order"
    );

    let mut admin = server.admin().await;
    let previous = admin
        .set_scheduling_policy(SetSchedulingPolicyRequest {
            policy: SchedulingPolicy::LatencyFirst as i32,
        })
        .await
        .expect("set policy")
        .into_inner();
    assert_eq!(previous.previous(), SchedulingPolicy::Fair);
    assert_eq!(server.stats().await.scheduling_policy(), SchedulingPolicy::LatencyFirst);
    assert_eq!(
        first_token_order(&server, 2).await,
        vec!['D', 'C', 'B'],
        "LATENCY_FIRST serves the youngest first"
    );

    let invalid = admin
        .set_scheduling_policy(SetSchedulingPolicyRequest { policy: 0 })
        .await
        .expect_err("unspecified");
    assert_eq!(invalid.code(), tonic::Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_queue_can_be_listed_and_cleared_while_a_request_runs() {
    // One request runs (one sequence at a time); three wait behind it, of different priorities.
    // THROUGHPUT_FIRST admits new sequences only while a step has room, so the three stay queued
    // while the first decodes; under FAIR's round-robin they would be admitted within a few
    // steps, and whether the listing caught all three depended on how fast steps were.
    let server = TestServer::start(&[
        ("RIVULET_SCHEDULER__MAX_NUM_SEQS", "1"),
        ("RIVULET_SCHEDULER__POLICY", "throughput_first"),
    ]);
    let client = server.client().await;
    const RUNNING_TOKENS: usize = 300;
    let running = {
        let mut client = client.clone();
        tokio::spawn(async move {
            client
                .generate(greedy_request("Once upon a time", RUNNING_TOKENS as u32))
                .await
        })
    };
    common::wait_until(Duration::from_secs(30), "the first request to run", || async {
        server.stats().await.num_running == 1
    })
    .await;
    let waiting: Vec<_> = [
        ("low-1", rivulet::proto::Priority::Low),
        ("high-1", rivulet::proto::Priority::High),
        ("normal-1", rivulet::proto::Priority::Normal),
    ]
    .into_iter()
    .map(|(id, priority)| {
        let mut client = client.clone();
        let mut request = tonic::Request::new(GenerateRequest {
            priority: priority as i32,
            ..greedy_request("Hello", 4)
        });
        request
            .metadata_mut()
            .insert("x-request-id", id.parse().expect("metadata value"));
        tokio::spawn(async move { client.generate(request).await })
    })
    .collect();
    let mut admin = server.admin().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let queue = loop {
        let queue = admin
            .get_queue(rivulet::proto::GetQueueRequest {})
            .await
            .expect("get queue")
            .into_inner();
        if queue.requests.len() == 3 {
            break queue;
        }
        assert!(Instant::now() < deadline, "three requests never queued: {queue:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let ids: Vec<&str> = queue.requests.iter().map(|r| r.request_id.as_str()).collect();
    assert_eq!(ids, ["high-1", "normal-1", "low-1"], "highest priority first");
    assert!(queue
        .requests
        .iter()
        .all(|r| r.prompt_tokens > 0 && r.waiting_seconds >= 0.0));
    // The one sequence a step may hold is running, and THROUGHPUT_FIRST admits only into room.
    assert_eq!(queue.recommended_max_sequence_length, 0, "nothing can be admitted now");

    let cleared = admin
        .clear_queue(rivulet::proto::ClearQueueRequest {})
        .await
        .expect("clear queue")
        .into_inner();
    assert_eq!(cleared.cleared, 3);
    for call in waiting {
        let status = call.await.expect("task").expect_err("cleared");
        assert_eq!(status.code(), tonic::Code::Aborted, "{status:?}");
    }
    // An operator's clearing is counted as vLLM counts cancelled requests, not as errors.
    let metrics = common::metrics_text(&server.http_address);
    let finished = |reason: &str| {
        metrics
            .lines()
            .find(|line| line.starts_with("rivulet:request_success_total") && line.contains(reason))
            .and_then(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert_eq!((finished("\"abort\""), finished("\"error\"")), (3.0, 0.0), "{metrics}");
    let done = running.await.expect("task").expect("the running request is untouched");
    assert_eq!(done.into_inner().token_ids.len(), RUNNING_TOKENS);
    common::assert_no_blocks_held(&server).await;
    let idle = admin
        .get_queue(rivulet::proto::GetQueueRequest {})
        .await
        .expect("get queue")
        .into_inner();
    assert!(idle.recommended_max_sequence_length > 0 && idle.recommended_max_sequence_length <= 2048);
}
