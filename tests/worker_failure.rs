//! A worker that dies mid-request: the client gets `UNAVAILABLE` (not a hang), the server starts a
//! new worker and keeps serving, and shuts down cleanly afterwards.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{greedy_request, TestServer};
use tokio_stream::StreamExt;
use tonic::Code;

fn worker_pid(scheduler_pid: u32) -> Option<u32> {
    let output = Command::new("pgrep")
        .arg("-P")
        .arg(scheduler_pid.to_string())
        .output()
        .ok()?;
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_worker_fails_its_requests_with_unavailable_and_is_replaced() {
    let mut server = TestServer::start(&[]);
    let mut client = server.client().await;
    let mut stream = client
        .stream_generate(greedy_request("Tell me a very long story.", 1000))
        .await
        .expect("stream")
        .into_inner();
    let first = stream.next().await.expect("a first message").expect("ok");
    assert!(!first.token_ids.is_empty());

    let worker = worker_pid(server.pid()).expect("the scheduler's worker process");
    let killed = Command::new("kill")
        .arg("-KILL")
        .arg(worker.to_string())
        .status()
        .expect("kill");
    assert!(killed.success());

    let outcome = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(message) = stream.next().await {
            if let Err(status) = message {
                return Some(status);
            }
        }
        None
    })
    .await
    .expect("the stream must end, not hang");
    let status = outcome.expect("the stream ends with an error");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");

    // The server restarts its worker and serves the next request.
    let response = tokio::time::timeout(Duration::from_secs(120), client.generate(greedy_request("Hello", 4)))
        .await
        .expect("served in time")
        .expect("served after the restart")
        .into_inner();
    assert_eq!(response.token_ids.len(), 4);
    let new_worker = worker_pid(server.pid()).expect("a new worker");
    assert_ne!(new_worker, worker);

    let status = server.terminate();
    assert!(status.success(), "clean exit after SIGTERM: {status:?}");
}
