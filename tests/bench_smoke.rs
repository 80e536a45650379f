//! `rivulet-bench` end to end: a short run against the real server (random and shared-prefix
//! workloads), and its OpenAI SSE client against a scripted `/v1/completions` stream. These check
//! that the harness measures what it says (counts, orderings), not how fast anything is.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

/// Runs `rivulet-bench run ARGS --json FILE` and returns the JSON record it wrote.
fn bench_run(args: &[&str], scratch: &Path) -> Value {
    let json = scratch.join(format!("{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&json);
    let output = Command::new(common::binary("rivulet-bench"))
        .current_dir(common::root())
        .arg("run")
        .args(args)
        .args(["--no-progress", "--json"])
        .arg(&json)
        .output()
        .expect("rivulet-bench runs (scripts/test.sh builds it)");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "rivulet-bench failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("Output token throughput"), "no table printed: {stdout}");
    let text = std::fs::read_to_string(&json).expect("--json file written");
    serde_json::from_str(text.lines().last().expect("one record")).expect("valid JSON")
}

fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("rivulet-bench-smoke-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

#[test]
fn random_workload_against_rivulet_counts_every_token() {
    let server = common::shared_server();
    let url = format!("http://{}", server.address);
    let admin_url = format!("http://{}", server.admin_address);
    let record = bench_run(
        &[
            "--url",
            &url,
            "--admin-url",
            &admin_url,
            "--num-prompts",
            "6",
            "--max-concurrency",
            "3",
            "--random-input-len",
            "32",
            "--random-output-len",
            "8",
            "--random-range-ratio",
            "0",
            "--request-rate",
            "50",
            "--seed",
            "3",
            "--ignore-eos",
        ],
        &scratch_dir("random"),
    );
    let summary = &record["summary"];
    assert_eq!(summary["completed"], 6, "{summary}");
    assert_eq!(summary["failed"], 0);
    // ignore_eos: exactly the asked output length; the prompts are 32 tokens give or take a merge.
    assert_eq!(summary["total_output_tokens"], 48);
    let input = summary["total_input_tokens"].as_u64().unwrap_or(0);
    assert!((6 * 30..=6 * 34).contains(&input), "input tokens {input}");
    let ttft = summary["ttft_ms"]["p50"].as_f64().unwrap_or(0.0);
    let e2e = summary["e2e_ms"]["p50"].as_f64().unwrap_or(0.0);
    let tpot = summary["tpot_ms"]["mean"].as_f64().unwrap_or(0.0);
    assert!(ttft > 0.0 && e2e > ttft && tpot > 0.0, "{summary}");
    assert!(summary["itl_ms"]["p99"].as_f64().unwrap_or(0.0) >= summary["itl_ms"]["p50"].as_f64().unwrap_or(1.0));
    // The server's own step accounting came back with the run.
    let server_cost = &record["server"];
    assert!(server_cost["iterations"].as_u64().unwrap_or(0) >= 8, "{server_cost}");
    let share = server_cost["scheduler_share"].as_f64().unwrap_or(-1.0);
    assert!((0.0..1.0).contains(&share), "{server_cost}");
    let forward = server_cost["mean_forward_ms"].as_f64().unwrap_or(0.0);
    assert!(forward > 0.0 && forward <= server_cost["mean_step_ms"].as_f64().unwrap_or(0.0));
}

#[test]
fn shared_prefix_workload_runs_against_rivulet() {
    let server = common::shared_server();
    let url = format!("http://{}", server.address);
    let record = bench_run(
        &[
            "--url",
            &url,
            "--dataset",
            "shared-prefix",
            "--num-prompts",
            "4",
            "--num-prefix-groups",
            "2",
            "--prefix-len",
            "64",
            "--suffix-len",
            "8",
            "--random-output-len",
            "4",
            "--max-concurrency",
            "2",
            "--ignore-eos",
        ],
        &scratch_dir("prefix"),
    );
    assert_eq!(record["summary"]["completed"], 4);
    assert_eq!(record["summary"]["total_output_tokens"], 16);
}

/// A scripted OpenAI-style server: answers every POST with `chunks` SSE events 20 ms apart, then a
/// usage event and `[DONE]`. Returns its base URL.
fn scripted_openai_server(chunks: usize) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address");
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().expect("clone"));
                let mut content_length = 0;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    if let Some(value) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        content_length = value.trim().parse().unwrap_or(0);
                    }
                }
                let mut body = vec![0; content_length];
                let _ = reader.read_exact(&mut body);
                let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                assert_eq!(request["stream"], true);
                assert_eq!(request["ignore_eos"], true);
                let _ = stream
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n");
                for _ in 0..chunks {
                    std::thread::sleep(Duration::from_millis(20));
                    let _ = stream.write_all(b"data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n");
                    let _ = stream.flush();
                }
                let usage = format!(
                    "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":11,\"completion_tokens\":{chunks}}}}}\n\n"
                );
                let _ = stream.write_all(usage.as_bytes());
                let _ = stream.write_all(b"data: [DONE]\n\n");
            });
        }
    });
    format!("http://{address}")
}

#[test]
fn openai_backend_times_server_sent_events() {
    let url = scripted_openai_server(5);
    let record = bench_run(
        &[
            "--backend",
            "openai",
            "--url",
            &url,
            "--num-prompts",
            "3",
            "--max-concurrency",
            "3",
            "--random-input-len",
            "16",
            "--random-output-len",
            "5",
            "--ignore-eos",
        ],
        &scratch_dir("openai"),
    );
    let summary = &record["summary"];
    assert_eq!(summary["completed"], 3, "{summary}");
    assert_eq!(summary["total_output_tokens"], 15);
    assert_eq!(
        summary["total_input_tokens"], 33,
        "usage's prompt_tokens is what counts"
    );
    // Each event is sent at least 20 ms after the previous one.
    assert!(summary["ttft_ms"]["p50"].as_f64().unwrap_or(0.0) >= 19.0, "{summary}");
    assert!(summary["itl_ms"]["p50"].as_f64().unwrap_or(0.0) >= 19.0, "{summary}");
    assert!(summary["tpot_ms"]["mean"].as_f64().unwrap_or(0.0) >= 19.0, "{summary}");
    assert!(record["server"].is_null(), "no Rivulet stats for another server");
}

#[test]
fn bad_arguments_and_a_run_in_which_every_request_failed_exit_non_zero() {
    let run = |args: &[&str]| {
        Command::new(common::binary("rivulet-bench"))
            .current_dir(common::root())
            .arg("run")
            .args(args)
            .arg("--no-progress")
            .output()
            .expect("rivulet-bench runs (scripts/test.sh builds it)")
    };
    for (args, named) in [
        (&["--max-concurrency", "0"][..], "--max-concurrency"),
        (&["--num-prompts", "0"], "--num-prompts"),
        (&["--random-output-len", "0"], "--random-output-len"),
        (&["--random-range-ratio", "1.5"], "--random-range-ratio"),
    ] {
        let output = run(args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success() && stderr.contains(named), "{args:?}: {stderr}");
    }
    // A port nobody listens on: every request fails, and the exit code says so.
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let output = run(&["--backend", "openai", "--url", &url, "--num-prompts", "2"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && stderr.contains("every one of the 2 requests failed"),
        "{stderr}"
    );
}
