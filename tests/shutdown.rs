//! Graceful shutdown: on SIGTERM the server stops taking work, lets running requests finish up to
//! `shutdown_timeout_secs`, ends the rest with UNAVAILABLE, stops its worker and exits cleanly —
//! also when the worker hangs in a step.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{greedy_request, TestServer};
use rivulet::proto::generation_client::GenerationClient;
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic::Code;

fn children(pid: u32) -> Vec<u32> {
    let output = Command::new("pgrep")
        .arg("-P")
        .arg(pid.to_string())
        .output()
        .expect("pgrep");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

fn is_running(pid: u32) -> bool {
    Command::new("kill")
        .arg("-0")
        .arg(pid.to_string())
        .status()
        .expect("kill -0")
        .success()
}

/// A stream of 1500 tokens, once its first token came.
async fn long_stream(
    client: &mut GenerationClient<Channel>,
) -> tonic::Streaming<rivulet::proto::GenerateStreamResponse> {
    let mut long = client
        .stream_generate(greedy_request("Tell me a very long story.", 1500))
        .await
        .expect("long")
        .into_inner();
    long.next().await.expect("first").expect("ok");
    long
}

/// The error a stream ends with, reading past its tokens (it must not end cleanly: the requests
/// here cannot finish their 1500 tokens before the shutdown ends them).
async fn ending_status(stream: &mut tonic::Streaming<rivulet::proto::GenerateStreamResponse>) -> tonic::Status {
    loop {
        match stream.next().await {
            Some(Ok(_)) => continue,
            Some(Err(status)) => return status,
            None => panic!("a 1500-token request cannot have finished before the shutdown"),
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_drains_then_ends_what_is_left_and_exits_cleanly() {
    let mut server = TestServer::start(&[("RIVULET_SERVER__SHUTDOWN_TIMEOUT_SECS", "2")]);
    let worker = children(server.pid());
    assert_eq!(worker.len(), 1, "one worker process");
    let mut client = server.client().await;
    let mut short = client
        .stream_generate(greedy_request("Say hello.", 6))
        .await
        .expect("short")
        .into_inner();
    let mut long = long_stream(&mut client).await;

    let signalled = Instant::now();
    common::signal(server.pid(), "TERM");

    // The short request still finishes normally.
    let mut last = None;
    while let Some(message) = short.next().await {
        last = Some(message.expect("the short request completes during the drain"));
    }
    assert_ne!(last.expect("messages").finish_reason, 0);

    // The long one is ended with UNAVAILABLE once the shutdown timeout passes.
    let status = ending_status(&mut long).await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        signalled.elapsed() >= Duration::from_secs(2),
        "ended before the shutdown timeout"
    );

    let exit = server.terminate();
    assert!(exit.success(), "exit status {exit:?}");
    assert!(!is_running(worker[0]), "the worker process stopped too");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hung_worker_does_not_hold_the_shutdown_past_its_timeout() {
    // The step deadline (120 s by default) is far past the drain: the shutdown must not wait on
    // a step that a SIGSTOPped worker will never finish.
    let mut server = TestServer::start(&[("RIVULET_SERVER__SHUTDOWN_TIMEOUT_SECS", "2")]);
    let worker = children(server.pid());
    let mut long = long_stream(&mut server.client().await).await;
    common::signal(worker[0], "STOP");
    let signalled = Instant::now();
    common::signal(server.pid(), "TERM");
    let status = ending_status(&mut long).await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    let exit = server.terminate();
    assert!(exit.success(), "exit status {exit:?}");
    assert!(
        signalled.elapsed() < Duration::from_secs(20),
        "the shutdown waited {:?} for the hung worker",
        signalled.elapsed()
    );
    assert!(!is_running(worker[0]), "the hung worker was killed");
}
