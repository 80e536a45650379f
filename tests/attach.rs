//! Workers started by someone else (as the worker containers of a pod would be) attach through
//! the scheduler's socket: a scheduler without workers is NOT_SERVING and queues requests; an
//! attached worker makes it SERVING and serves them; a second attaches while requests stream;
//! draining the first loses nothing and its process exits; killing the last makes health
//! NOT_SERVING, and a new attach serves again. With no worker at all, a request waits
//! `scheduler.no_worker_timeout_secs` and then ends with UNAVAILABLE.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use common::{
    assert_no_blocks_held, binary, finish_streams, greedy_request, reference_tokens, shm_segments, signal,
    start_streams, stream_tokens, wait_until, TestServer,
};
use rivulet::proto::DrainWorkerRequest;
use tonic_health::pb::health_check_response::ServingStatus;

const TOKENS: u32 = 32;
/// The streams running through the drain are longer, so that they outlast the second worker's load.
const DRAINED_TOKENS: u32 = 4 * TOKENS;

fn attach_worker(socket: &Path) -> Child {
    Command::new(binary("rivulet-worker"))
        .arg("--attach")
        .arg(socket)
        .arg("--threads")
        .arg("1")
        .env("RUST_LOG", "warn")
        .spawn()
        .expect("start rivulet-worker --attach")
}

fn wait_exit(child: &mut Child, timeout: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the worker did not exit in {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn attached_workers_join_drain_and_leave_while_serving() {
    let segments_before = shm_segments();
    let socket: PathBuf = std::env::temp_dir().join(format!("rivulet-attach-test-{}.sock", std::process::id()));
    let socket_text = socket.display().to_string();
    let mut server = TestServer::start_without_waiting_for_workers(&[
        ("RIVULET_WORKER__REPLICAS", "0"),
        ("RIVULET_WORKER__ATTACH_SOCKET", &socket_text),
        ("RIVULET_SCHEDULER__NO_WORKER_TIMEOUT_SECS", "240"),
    ]);
    let prompts: Vec<String> = [
        "The capital of France is",
        "Once upon a time, in a small village by the sea,",
        "List three uses of copper:",
        "The Pythagorean theorem states that",
        "Explain photosynthesis to a child:",
    ]
    .iter()
    .map(|p| (*p).to_owned())
    .collect();
    let reference = reference_tokens(&prompts, DRAINED_TOKENS).await;

    assert_eq!(server.health().await, ServingStatus::NotServing);
    let mut client = server.client().await;
    // A request sent with no worker waits in the queue for one.
    let early = {
        let mut client = client.clone();
        let prompt = prompts[0].clone();
        tokio::spawn(async move { stream_tokens(&mut client, greedy_request(&prompt, TOKENS)).await })
    };

    let mut first = attach_worker(&socket);
    server.wait_until_serving(Duration::from_secs(300)).await;
    let early = tokio::time::timeout(Duration::from_secs(120), early)
        .await
        .expect("the queued request is served")
        .expect("task");
    assert_eq!(early.expect("served"), reference[0][..TOKENS as usize]);
    let stats = server.stats().await;
    assert_eq!(stats.replicas.len(), 1, "{stats:?}");
    assert!(
        stats.replicas[0].attached && stats.replicas[0].pid == first.id(),
        "{stats:?}"
    );
    let first_id = stats.replicas[0].id;

    // Streams on the first worker; a second attaches meanwhile; the first is drained.
    let requests = prompts[1..].iter().map(|p| greedy_request(p, DRAINED_TOKENS)).collect();
    let streams = start_streams(&client, requests).await;
    let mut second = attach_worker(&socket);
    wait_until(Duration::from_secs(300), "the second worker ready", || async {
        server.stats().await.num_replicas_ready == 2
    })
    .await;
    let stats = server.stats().await;
    let draining = stats
        .replicas
        .iter()
        .find(|r| r.id == first_id)
        .expect("the first replica");
    assert!(
        draining.num_running > 0,
        "drained while it still runs requests: {stats:?}"
    );
    server
        .admin()
        .await
        .drain_worker(DrainWorkerRequest { id: first_id })
        .await
        .expect("drain");
    let outputs = finish_streams(streams, "a drain loses nothing").await;
    for (output, expected) in outputs.iter().zip(&reference[1..]) {
        assert_eq!(output, expected, "drained streams: the reference's tokens");
    }
    let status = wait_exit(&mut first, Duration::from_secs(60));
    assert!(status.success(), "a drained worker exits cleanly: {status:?}");
    wait_until(Duration::from_secs(30), "the drained replica to leave", || async {
        server.stats().await.replicas.iter().all(|r| r.id != first_id)
    })
    .await;

    // The second serves alone; killing it leaves no worker.
    let output = stream_tokens(&mut client, greedy_request(&prompts[3], TOKENS)).await;
    assert_eq!(
        output.expect("served by the second worker"),
        reference[3][..TOKENS as usize]
    );
    signal(second.id(), "KILL");
    let _ = second.wait();
    wait_until(Duration::from_secs(30), "NOT_SERVING without workers", || async {
        server.health().await == ServingStatus::NotServing
    })
    .await;
    assert!(
        server.stats().await.replicas.is_empty(),
        "a worker that disconnects leaves the pool"
    );

    // A new attach serves again.
    let mut third = attach_worker(&socket);
    server.wait_until_serving(Duration::from_secs(300)).await;
    let output = stream_tokens(&mut client, greedy_request(&prompts[4], TOKENS)).await;
    assert_eq!(
        output.expect("served by the third worker"),
        reference[4][..TOKENS as usize]
    );

    assert_no_blocks_held(&server).await;
    let status = server.terminate();
    assert!(status.success(), "clean exit after SIGTERM: {status:?}");
    let status = wait_exit(&mut third, Duration::from_secs(30));
    assert!(
        status.success(),
        "an attached worker exits when the scheduler goes: {status:?}"
    );
    assert!(!socket.exists(), "the attach socket is removed");
    let left: Vec<_> = shm_segments().difference(&segments_before).cloned().collect();
    assert!(left.is_empty(), "shared memory left behind: {left:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn with_no_worker_requests_wait_then_end_with_unavailable() {
    let socket = std::env::temp_dir().join(format!("rivulet-no-worker-test-{}.sock", std::process::id()));
    let socket_text = socket.display().to_string();
    let server = TestServer::start_without_waiting_for_workers(&[
        ("RIVULET_WORKER__REPLICAS", "0"),
        ("RIVULET_WORKER__ATTACH_SOCKET", &socket_text),
        ("RIVULET_SCHEDULER__NO_WORKER_TIMEOUT_SECS", "2"),
    ]);
    assert_eq!(server.health().await, ServingStatus::NotServing);
    let mut client = server.client().await;
    let started = std::time::Instant::now();
    let status = stream_tokens(&mut client, greedy_request("Hello", 4))
        .await
        .expect_err("no worker ever attached");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(1900) && waited < Duration::from_secs(30),
        "it waited for a worker for the timeout, then ended: {waited:?}"
    );
    let stats = server.stats().await;
    assert_eq!((stats.num_waiting, stats.replicas.len()), (0, 0), "{stats:?}");
}
