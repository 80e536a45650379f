//! Harness for the end-to-end tests: the real `rivulet-scheduler` binary (which spawns the real
//! worker) on the real model, reached over gRPC on 127.0.0.1, and the Hugging Face reference.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::Duration;

use rivulet::proto::admin_client::AdminClient;
use rivulet::proto::generation_client::GenerationClient;
use rivulet::proto::{GenerateRequest, SamplingParams, StoppingCriteria};
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn model_path() -> PathBuf {
    root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

pub fn binary(name: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"));
    target.join("release").join(name)
}

/// A running server; stopped (SIGTERM, then SIGKILL) when dropped.
pub struct TestServer {
    child: Child,
    /// gRPC (Generation, health, reflection).
    pub address: String,
    /// The OpenAI-compatible HTTP front.
    pub http_address: String,
    /// The Admin service.
    pub admin_address: String,
    /// `client()` first waits until a worker replica is ready (the port opens before).
    wait_for_worker: bool,
}

impl TestServer {
    /// Starts the server with test-sized defaults plus `env` overrides (`RIVULET_*` variables).
    pub fn start(env: &[(&str, &str)]) -> Self {
        Self::launch(env, true, None)
    }

    /// Starts a server whose workers will attach later: `client()` does not wait for one.
    pub fn start_without_waiting_for_workers(env: &[(&str, &str)]) -> Self {
        Self::launch(env, false, None)
    }

    /// Like `start_without_waiting_for_workers`, with the server's log (its workers' too) written
    /// to `log` instead of the test's output.
    pub fn start_logging_to(env: &[(&str, &str)], log: &std::path::Path) -> Self {
        Self::launch(env, false, Some(log))
    }

    fn launch(env: &[(&str, &str)], wait_for_worker: bool, log: Option<&std::path::Path>) -> Self {
        let scheduler = binary("rivulet-scheduler");
        assert!(
            scheduler.exists(),
            "{} is missing: run `cargo build --release --bins` (scripts/test.sh does)",
            scheduler.display()
        );
        let mut command = Command::new(&scheduler);
        command
            .current_dir(root())
            .env(
                "RUST_LOG",
                std::env::var("RIVULET_TEST_LOG").unwrap_or_else(|_| "warn".to_owned()),
            )
            // The tests' own variable is not the server's setting (figment would refuse it).
            .env_remove("RIVULET_TEST_LOG")
            // An empty configuration file: a rivulet.toml in the working folder is not read.
            .env("RIVULET_CONFIG", "/dev/null")
            .env("RIVULET_SERVER__LISTEN", "127.0.0.1:0")
            .env("RIVULET_SERVER__HTTP_LISTEN", "127.0.0.1:0")
            .env("RIVULET_SERVER__ADMIN_LISTEN", "127.0.0.1:0")
            .env("RIVULET_MODEL__PATH", model_path())
            .env("RIVULET_MODEL__MAX_MODEL_LEN", "2048")
            .env("RIVULET_WORKER__KV_CACHE_MEMORY", (256u64 << 20).to_string())
            .env("RIVULET_WORKER__BINARY", binary("rivulet-worker"))
            .stdout(Stdio::piped());
        if let Some(log) = log {
            command.stderr(std::fs::File::create(log).expect("create the log file"));
        }
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().expect("spawn rivulet-scheduler");
        let stdout = child.stdout.take().expect("piped stdout");
        let (address_tx, address_rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("rivulet-scheduler ") {
                    let _ = address_tx.send(rest.to_owned());
                }
            }
        });
        // Three lines, all printed before any worker is ready: gRPC, HTTP, admin.
        let mut addresses = Vec::new();
        while addresses.len() < 3 {
            match address_rx.recv_timeout(Duration::from_secs(300)) {
                Ok(line) => addresses.push(line),
                Err(_) => {
                    let _ = child.kill();
                    panic!("rivulet-scheduler did not start listening: {:?}", child.wait());
                }
            }
        }
        let find = |prefix: &str| {
            addresses
                .iter()
                .find_map(|line| line.strip_prefix(prefix))
                .unwrap_or_else(|| panic!("no `{prefix}` line in {addresses:?}"))
                .to_owned()
        };
        let address = find("listening on ");
        let http_address = find("http listening on ");
        let admin_address = find("admin listening on ");
        Self {
            child,
            address,
            http_address,
            admin_address,
            wait_for_worker,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub async fn client(&self) -> GenerationClient<Channel> {
        self.wait_for_worker_if_expected().await;
        GenerationClient::connect(format!("http://{}", self.address))
            .await
            .expect("connect")
    }

    async fn wait_for_worker_if_expected(&self) {
        if self.wait_for_worker {
            self.wait_until_serving(Duration::from_secs(300)).await;
        }
    }

    /// The standard gRPC health status of the server as a whole.
    pub async fn health(&self) -> ServingStatus {
        let channel = Channel::from_shared(format!("http://{}", self.address))
            .expect("address")
            .connect()
            .await
            .expect("connect health");
        let mut health = HealthClient::new(channel);
        let response = health
            .check(HealthCheckRequest { service: String::new() })
            .await
            .expect("health check")
            .into_inner();
        ServingStatus::try_from(response.status).expect("a known status")
    }

    /// Waits until health says SERVING (some worker replica is ready).
    pub async fn wait_until_serving(&self, timeout: Duration) {
        wait_until(timeout, "the server to be SERVING", || async {
            self.health().await == ServingStatus::Serving
        })
        .await;
    }

    pub async fn admin(&self) -> AdminClient<Channel> {
        AdminClient::connect(format!("http://{}", self.admin_address))
            .await
            .expect("connect admin")
    }

    /// The server's stats (once a worker is ready, unless started without waiting for one).
    pub async fn stats(&self) -> rivulet::proto::GetStatsResponse {
        self.wait_for_worker_if_expected().await;
        let request = rivulet::proto::GetStatsRequest {};
        self.admin().await.get_stats(request).await.expect("stats").into_inner()
    }

    /// Sends SIGTERM and waits for the process to exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        for _ in 0..300 {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        self.child.wait().expect("wait")
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.terminate();
        }
    }
}

static SHARED: OnceLock<TestServer> = OnceLock::new();

extern "C" fn stop_shared_server() {
    if let Some(server) = SHARED.get() {
        let _ = Command::new("kill").arg("-TERM").arg(server.pid().to_string()).status();
    }
}

/// One server shared by all tests of a test binary (statics are never dropped, so it is stopped
/// when the test process exits).
pub fn shared_server() -> &'static TestServer {
    SHARED.get_or_init(|| {
        // SAFETY: registering a plain `extern "C"` function with no captured state.
        unsafe { libc::atexit(stop_shared_server) };
        TestServer::start(&[])
    })
}

/// Bytes of KV per 16-token block for SmolLM2-135M in the CPU kernels' cache, three bytes a key
/// or value (`rivulet_kernels::kv_values`): 2 × 30 layers × 16 × 3 heads × 64 × 3.
pub const SMOLLM_KV_BLOCK_BYTES: u64 = 2 * 30 * 16 * 3 * 64 * 3;

pub fn greedy_request(prompt: &str, max_new_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.to_owned(),
        sampling: Some(SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        stopping: Some(StoppingCriteria {
            max_new_tokens: Some(max_new_tokens),
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Runs the Hugging Face reference script (`tests/python/hf_reference.py`) with `request`.
pub fn hf_reference(mut request: serde_json::Value) -> serde_json::Value {
    request["model"] = serde_json::Value::String(model_path().display().to_string());
    let python = root().join(".venv/bin/python");
    let mut child = Command::new(&python)
        .arg(root().join("tests/python/hf_reference.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_VERBOSITY", "error")
        .spawn()
        .unwrap_or_else(|e| panic!("run {} (scripts/setup.sh --test installs it): {e}", python.display()));
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(request.to_string().as_bytes()).expect("write request");
    }
    let output = child.wait_with_output().expect("reference output");
    assert!(output.status.success(), "reference script failed: {:?}", output.status);
    serde_json::from_slice(&output.stdout).expect("reference JSON")
}

/// Polls `condition` every 100 ms until it holds; panics naming `what` after `timeout`.
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + timeout;
    while !condition().await {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The shared-memory segments (step buffers) that exist now.
pub fn shm_segments() -> std::collections::BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .filter(|name| name.starts_with("shmem_"))
                .collect()
        })
        .unwrap_or_default()
}

/// The server's `/metrics` text (plain HTTP/1.0 over a socket).
pub fn metrics_text(http_address: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(http_address).expect("connect http");
    write!(stream, "GET /metrics HTTP/1.0\r\n\r\n").expect("send");
    let mut metrics = String::new();
    stream.read_to_string(&mut metrics).expect("read");
    metrics
}

/// Sends `signal` (e.g. "KILL", "STOP") to process `pid`.
pub fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{signal} {pid}");
}

/// Streams `request` to the end: every token id in order, or the error status that ended it.
pub async fn stream_tokens(
    client: &mut GenerationClient<Channel>,
    request: GenerateRequest,
) -> Result<Vec<u32>, tonic::Status> {
    use tokio_stream::StreamExt;
    let mut stream = client.stream_generate(request).await?.into_inner();
    let mut tokens = Vec::new();
    while let Some(message) = stream.next().await {
        tokens.extend(message?.token_ids);
    }
    Ok(tokens)
}

/// A stream that has delivered its first tokens, and the rest of it.
pub type StartedStream = (Vec<u32>, tonic::Streaming<rivulet::proto::GenerateStreamResponse>);

/// Starts one stream per request, concurrently, and returns once each has its first message.
pub async fn start_streams(client: &GenerationClient<Channel>, requests: Vec<GenerateRequest>) -> Vec<StartedStream> {
    use tokio_stream::StreamExt;
    futures::future::join_all(requests.into_iter().map(|request| {
        let mut client = client.clone();
        async move {
            let mut stream = client.stream_generate(request).await.expect("stream").into_inner();
            let first = stream.next().await.expect("a first message").expect("ok").token_ids;
            (first, stream)
        }
    }))
    .await
}

/// Reads started streams to their ends; every one must succeed (`why` says why it should).
pub async fn finish_streams(streams: Vec<StartedStream>, why: &'static str) -> Vec<Vec<u32>> {
    use tokio_stream::StreamExt;
    let finish = streams.into_iter().map(|(mut tokens, mut stream)| async move {
        while let Some(message) = stream.next().await {
            tokens.extend(message.expect(why).token_ids);
        }
        tokens
    });
    tokio::time::timeout(Duration::from_secs(240), futures::future::join_all(finish))
        .await
        .expect("every stream ends")
}

/// Greedy reference tokens from transformers for each prompt.
pub async fn reference_tokens(prompts: &[String], max_new_tokens: u32) -> Vec<Vec<u32>> {
    let prompts = prompts.to_vec();
    let reference = tokio::task::spawn_blocking(move || {
        hf_reference(serde_json::json!({"task": "greedy", "prompts": prompts, "max_new_tokens": max_new_tokens}))
    })
    .await
    .expect("reference");
    reference["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|result| serde_json::from_value(result["output_ids"].clone()).expect("output ids"))
        .collect()
}

/// Asserts that no replica holds a KV block any more, nothing waits and nothing runs.
pub async fn assert_no_blocks_held(server: &TestServer) {
    let mut stats = server.stats().await;
    // Cancelled or finished sequences leave at the next iteration: give it a moment.
    for _ in 0..50 {
        if stats.kv_blocks_used == 0 && stats.num_running == 0 && stats.num_waiting == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        stats = server.stats().await;
    }
    assert_eq!(
        (stats.kv_blocks_used, stats.num_running, stats.num_waiting),
        (0, 0, 0),
        "{stats:?}"
    );
    for replica in &stats.replicas {
        assert_eq!(replica.kv_blocks_used, 0, "replica {replica:?}");
    }
}
