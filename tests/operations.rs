//! The operational surface, as a user and an operator meet it, on one server with an API key:
//! health while the model loads and while a killed worker is replaced (gRPC and `/health`), the
//! key on both fronts, request ids, JSON logs from the scheduler and its workers, and the OpenAI-compatible front and `/metrics` driven by the
//! real `openai` package and Prometheus' own text parser (`tests/python/openai_client.py`); and,
//! once its only replica is drained, requests refused at once.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use common::{greedy_request, root, signal, wait_until, TestServer};
use rivulet::proto::{ChatMessage, DrainWorkerRequest, GenerateRequest};
use tonic::metadata::MetadataValue;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

const KEY: &str = "test-key-1";
const TOKENS: u32 = 12;

/// The status code of `GET path` on the HTTP front (plain HTTP/1.0 over a socket).
fn http_status(address: &str, path: &str) -> u16 {
    let mut stream = TcpStream::connect(address).expect("connect http");
    write!(stream, "GET {path} HTTP/1.0\r\nHost: rivulet\r\n\r\n").expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"))
}

fn with_key<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    let value = MetadataValue::try_from(format!("Bearer {KEY}")).expect("metadata");
    request.metadata_mut().insert("authorization", value);
    request
}

fn chat_request() -> GenerateRequest {
    GenerateRequest {
        prompt: String::new(),
        messages: vec![ChatMessage {
            role: "user".to_owned(),
            content: "Name three colours.".to_owned(),
        }],
        ..greedy_request("", TOKENS)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn health_key_request_ids_and_the_openai_front() {
    let log = std::env::temp_dir().join(format!("rivulet-operations-{}.log", std::process::id()));
    let server = TestServer::start_logging_to(
        &[
            ("RIVULET_SERVER__API_KEY", KEY),
            ("RIVULET_SERVER__JSON_LOGS", "true"),
            ("RUST_LOG", "info"),
        ],
        &log,
    );
    // The ports are open at once; the worker is still loading the model.
    assert_eq!(server.health().await, ServingStatus::NotServing);
    assert_eq!(http_status(&server.http_address, "/health"), 503);
    server.wait_until_serving(Duration::from_secs(300)).await;
    assert_eq!(http_status(&server.http_address, "/health"), 200);

    // gRPC: the key is required, the request id comes back.
    let mut client = server.client().await;
    let refused = client.generate(greedy_request("Hello", 2)).await.expect_err("no key");
    assert_eq!(refused.code(), Code::Unauthenticated);
    let mut request = with_key(greedy_request("The capital of France is", TOKENS));
    request
        .metadata_mut()
        .insert("x-request-id", MetadataValue::from_static("my-request-7"));
    let response = client.generate(request).await.expect("generate with the key");
    assert_eq!(
        response.metadata().get("x-request-id").and_then(|v| v.to_str().ok()),
        Some("my-request-7")
    );
    let grpc_tokens = response.into_inner().token_ids;
    let grpc_chat_tokens = client
        .generate(with_key(chat_request()))
        .await
        .expect("chat")
        .into_inner()
        .token_ids;
    let unknown_model = client
        .generate(with_key(GenerateRequest {
            model: "another-model".to_owned(),
            ..greedy_request("Hello", 2)
        }))
        .await
        .expect_err("unknown model");
    assert_eq!(unknown_model.code(), Code::NotFound);
    // Metrics and health are open without the key.
    assert_eq!(http_status(&server.http_address, "/metrics"), 200);
    assert_eq!(http_status(&server.http_address, "/v1/models"), 401);

    // Python's grpcio-reflection client (reflection v1alpha) lists what each listener serves.
    for (address, expected) in [
        (&server.address, "rivulet.v1.Generation"),
        (&server.admin_address, "rivulet.v1.Admin"),
    ] {
        let output = Command::new(root().join(".venv/bin/python"))
            .arg(root().join("tests/python/reflection_client.py"))
            .arg(address)
            .output()
            .expect("run tests/python/reflection_client.py (scripts/setup.sh --test installs grpcio-reflection)");
        let listed = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && listed.lines().any(|s| s == expected),
            "{expected} not listed at {address}: {listed}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    // The OpenAI front, through the real client.
    let expected = serde_json::json!({
        "prompt": "The capital of France is",
        "max_tokens": TOKENS,
        "grpc_token_ids": grpc_tokens,
        "chat": [{"role": "user", "content": "Name three colours."}],
        "grpc_chat_token_ids": grpc_chat_tokens,
    });
    let output = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("tests/python/openai_client.py"))
        .arg(format!("http://{}", server.http_address))
        .arg(KEY)
        .arg(expected.to_string())
        .output()
        .expect("run tests/python/openai_client.py (scripts/setup.sh --test installs openai)");
    assert!(
        output.status.success(),
        "openai_client.py failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );

    // A killed worker: NOT_SERVING / 503 until its replacement is ready, then SERVING / 200.
    let stats = server.stats().await;
    let worker = stats.replicas[0].pid;
    signal(worker, "KILL");
    wait_until(Duration::from_secs(30), "health to say NOT_SERVING", || async {
        server.health().await == ServingStatus::NotServing
    })
    .await;
    assert_eq!(http_status(&server.http_address, "/health"), 503);
    server.wait_until_serving(Duration::from_secs(300)).await;
    assert_eq!(http_status(&server.http_address, "/health"), 200);
    let stats = server.stats().await;
    assert_ne!(stats.replicas[0].pid, worker);
    assert_eq!(stats.replicas[0].restarts, 1);
    let metrics = common::metrics_text(&server.http_address);
    assert!(
        metrics
            .lines()
            .any(|line| line.starts_with("rivulet:worker_restarts_total") && line.ends_with(" 1")),
        "{metrics}"
    );
    assert!(
        metrics
            .lines()
            .any(|line| line.starts_with("rivulet:iteration_errors_total") && line.ends_with(" 1")),
        "{metrics}"
    );

    // One log format for the pod: the scheduler's lines and its workers' are all JSON; each
    // request left one summary line with its id.
    let text = std::fs::read_to_string(&log).expect("the server's log");
    let lines: Vec<serde_json::Value> = text
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| serde_json::from_str(line).unwrap_or_else(|_| panic!("not a JSON log line: {line}")))
        .collect();
    let target = |line: &serde_json::Value| line["target"].as_str().unwrap_or("").to_owned();
    assert!(
        lines.iter().any(|l| target(l).starts_with("rivulet_worker")),
        "no worker lines"
    );
    let summary = lines
        .iter()
        .find(|l| l["fields"]["request_id"] == "my-request-7" && l["fields"]["message"] == "request finished")
        .unwrap_or_else(|| panic!("no summary line for my-request-7 in {text}"));
    assert_eq!(summary["fields"]["generated_tokens"], TOKENS);
    assert_eq!(summary["fields"]["finish_reason"], "length");
    let _ = std::fs::remove_file(&log);

    // The only replica drained (spawned, and no attach socket): nothing can serve any more, so a
    // request ends at once with UNAVAILABLE rather than after `no_worker_timeout_secs` (60 s).
    let replica = server.stats().await.replicas[0].id;
    server
        .admin()
        .await
        .drain_worker(DrainWorkerRequest { id: replica })
        .await
        .expect("drain the only replica");
    wait_until(Duration::from_secs(30), "the drained replica to leave", || async {
        server.stats().await.replicas.is_empty()
    })
    .await;
    assert_eq!(server.health().await, ServingStatus::NotServing);
    let started = std::time::Instant::now();
    let refused = client
        .generate(with_key(greedy_request("Hello", 2)))
        .await
        .expect_err("no replica left");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10) && refused.message().contains("drained"),
        "ended at once, saying why: {refused:?} after {:?}",
        started.elapsed()
    );
}
