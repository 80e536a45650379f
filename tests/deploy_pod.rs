//! The pod shape with real containers (DESIGN.md §6): the image `deploy/build-image.sh` builds,
//! run as Kubernetes would run the `gpu` overlay's pod — a sandbox container holding the pod's
//! network and IPC namespaces (`/dev/shm`), a scheduler container, and worker containers attaching
//! through a socket on a shared volume. From the host: greedy tokens over gRPC and HTTP equal
//! transformers'; health and `/metrics` answer; `docker kill` of a worker container loses no
//! request; a worker container started while serving takes requests; `docker stop` of the
//! scheduler drains and exits 0 within the grace period, leaving no shared-memory segment.
//!
//! Without a Docker engine the test says so and passes without running: the rest of the suite
//! does not need one.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{greedy_request, reference_tokens, root};
use futures::future::join_all;
use rivulet::proto::admin_client::AdminClient;
use rivulet::proto::generation_client::GenerationClient;
use rivulet::proto::{GetStatsRequest, GetStatsResponse};
use tokio_stream::StreamExt;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

const IMAGE: &str = "rivulet:cpu";
const KEY: &str = "pod-test-key";
const TOKENS: u32 = 24;
/// `docker stop`'s grace period, as `terminationGracePeriodSeconds` would be.
const GRACE_SECS: u64 = 60;

type Interceptor = fn(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status>;
type Generation = GenerationClient<InterceptedService<Channel, Interceptor>>;
type Admin = AdminClient<InterceptedService<Channel, Interceptor>>;

fn bearer(mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
    let value = format!("Bearer {KEY}")
        .parse()
        .map_err(|_| tonic::Status::internal("key"))?;
    request.metadata_mut().insert("authorization", value);
    Ok(request)
}

/// Runs `docker args…`; its stdout, or a panic with its stderr.
fn docker(args: &[&str]) -> String {
    let output = Command::new("docker").args(args).output().expect("run docker");
    assert!(
        output.status.success(),
        "docker {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// The last lines a container wrote (stdout and stderr), for failure messages.
fn logs(container: &str) -> String {
    let output = Command::new("docker")
        .args(["logs", "--tail", "20", container])
        .output()
        .expect("docker logs");
    format!(
        "--- {container}:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn docker_engine_available() -> bool {
    Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .output()
        .is_ok_and(|output| output.status.success())
}

/// The containers and volume of one pod; removed when dropped, whatever happened.
struct Pod {
    name: String,
    containers: Vec<String>,
}

impl Pod {
    fn new() -> Self {
        let name = format!("rivulet-pod-test-{}", std::process::id());
        docker(&["volume", "create", &format!("{name}-sockets")]);
        Self {
            name,
            containers: Vec::new(),
        }
    }

    /// The sandbox (Kubernetes' pause container): owns the network namespace, publishes the
    /// ports on loopback, and holds the IPC namespace with a 1 GiB `/dev/shm`.
    fn start_sandbox(&mut self) {
        let name = format!("{}-sandbox", self.name);
        // Listed before it runs: a container created but not started is removed too.
        self.containers.push(name.clone());
        docker(&[
            "run",
            "-d",
            "--name",
            &name,
            "--ipc",
            "shareable",
            "--shm-size",
            "1g",
            "-p",
            "127.0.0.1::50051",
            "-p",
            "127.0.0.1::8000",
            "-p",
            "127.0.0.1::50052",
            "--entrypoint",
            "sleep",
            IMAGE,
            "infinity",
        ]);
    }

    /// Flags every container of the pod shares: namespaces, the socket volume, the model.
    fn shared_flags(&self) -> Vec<String> {
        let sandbox = format!("container:{}-sandbox", self.name);
        let models = root().join("models");
        vec![
            "--network".into(),
            sandbox.clone(),
            "--ipc".into(),
            sandbox,
            "-v".into(),
            format!("{}-sockets:/sockets", self.name),
            "-v".into(),
            format!("{}:/models:ro", models.display()),
        ]
    }

    fn run(&mut self, name: &str, extra: &[&str]) -> String {
        let container = format!("{}-{name}", self.name);
        let mut args: Vec<String> = vec!["run".into(), "-d".into(), "--name".into(), container.clone()];
        args.extend(self.shared_flags());
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        self.containers.push(container.clone());
        docker(&args.iter().map(String::as_str).collect::<Vec<_>>());
        container
    }

    /// The scheduler: no spawned workers, the attach socket on the shared volume (its TMPDIR
    /// too, for the IPC handshake), Admin reachable from the host behind the API key.
    fn start_scheduler(&mut self) -> String {
        self.run(
            "scheduler",
            &[
                "-e",
                "TMPDIR=/sockets",
                "-e",
                "RIVULET_WORKER__REPLICAS=0",
                "-e",
                "RIVULET_WORKER__ATTACH_SOCKET=/sockets/workers.sock",
                "-e",
                "RIVULET_WORKER__KV_CACHE_MEMORY=268435456",
                "-e",
                "RIVULET_MODEL__MAX_MODEL_LEN=2048",
                "-e",
                "RIVULET_SERVER__ADMIN_LISTEN=0.0.0.0:50052",
                "-e",
                &format!("RIVULET_SERVER__API_KEY={KEY}"),
                "-e",
                &format!("RIVULET_SERVER__SHUTDOWN_TIMEOUT_SECS={}", GRACE_SECS / 2),
                IMAGE,
            ],
        )
    }

    fn start_worker(&mut self, name: &str) -> String {
        self.run(
            name,
            &[
                "--entrypoint",
                "rivulet-worker",
                IMAGE,
                "--attach",
                "/sockets/workers.sock",
                "--device",
                "cpu",
                "--threads",
                "1",
            ],
        )
    }

    /// The host address a port of the pod is published on.
    fn published(&self, port: u16) -> String {
        let mapping = docker(&["port", &format!("{}-sandbox", self.name), &port.to_string()]);
        mapping.lines().next().expect("a published port").to_owned()
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        for container in self.containers.iter().rev() {
            let _ = Command::new("docker").args(["rm", "-f", container]).output();
        }
        let _ = Command::new("docker")
            .args(["volume", "rm", "-f", &format!("{}-sockets", self.name)])
            .output();
    }
}

/// `curl` against the HTTP front: (status, body).
fn http(address: &str, path: &str, body: Option<&serde_json::Value>) -> (u16, String) {
    let url = format!("http://{address}{path}");
    let mut command = Command::new("curl");
    command.args([
        "-s",
        "-m",
        "120",
        "-w",
        "\n%{http_code}",
        "-H",
        &format!("Authorization: Bearer {KEY}"),
    ]);
    if let Some(body) = body {
        command.args(["-H", "Content-Type: application/json", "-d", &body.to_string()]);
    }
    let output = command.arg(&url).output().expect("curl");
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// Streams every prompt concurrently; each must succeed with its reference tokens.
async fn all_streams_match(client: &Generation, prompts: &[String], reference: &[Vec<u32>], why: &str) {
    let started = start_streams(client, prompts).await;
    finish_streams(started, reference, why).await;
}

type Started = (Vec<u32>, tonic::Streaming<rivulet::proto::GenerateStreamResponse>);

/// Starts one stream per prompt; returns once every one has delivered its first tokens.
async fn start_streams(client: &Generation, prompts: &[String]) -> Vec<Started> {
    join_all(prompts.iter().map(|prompt| {
        let mut client = client.clone();
        async move {
            let request = greedy_request(prompt, TOKENS);
            let mut stream = client.stream_generate(request).await.expect("stream").into_inner();
            let first = stream.next().await.expect("a first message").expect("ok");
            (first.token_ids, stream)
        }
    }))
    .await
}

/// Reads started streams to their ends: each must succeed with its reference tokens.
async fn finish_streams(started: Vec<Started>, reference: &[Vec<u32>], why: &str) {
    let outputs = join_all(started.into_iter().map(|(mut tokens, mut stream)| async move {
        while let Some(message) = stream.next().await {
            tokens.extend(message?.token_ids);
        }
        Ok::<_, tonic::Status>(tokens)
    }));
    let outputs = tokio::time::timeout(Duration::from_secs(240), outputs)
        .await
        .expect("streams end");
    for (index, (output, want)) in outputs.into_iter().zip(reference).enumerate() {
        assert_eq!(
            &output.unwrap_or_else(|e| panic!("{why}: stream {index}: {e:?}")),
            want,
            "{why}: stream {index}"
        );
    }
}

async fn stats(admin: &mut Admin) -> GetStatsResponse {
    admin.get_stats(GetStatsRequest {}).await.expect("stats").into_inner()
}

async fn wait_for_ready_workers(admin: &mut Admin, count: u32) {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let stats = stats(admin).await;
        if stats.num_replicas_ready == count {
            return;
        }
        assert!(Instant::now() < deadline, "{count} ready workers: {stats:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_pod_shape_serves_survives_a_worker_and_drains_in_containers() {
    if !docker_engine_available() {
        eprintln!("deploy_pod: no Docker engine here: the pod-shape test did not run");
        return;
    }
    let test_started = Instant::now();
    let build = Command::new(root().join("deploy/build-image.sh"))
        .status()
        .expect("run deploy/build-image.sh");
    assert!(build.success(), "deploy/build-image.sh: {build:?}");
    let built = test_started.elapsed();

    let prompts: Vec<String> = [
        "The capital of France is",
        "Once upon a time, in a small village by the sea,",
        "List three uses of copper:",
        "def fibonacci(n):\n",
        "A haiku about autumn leaves:",
        "The Pythagorean theorem states that",
    ]
    .iter()
    .map(|p| (*p).to_owned())
    .collect();
    let reference = reference_tokens(&prompts, TOKENS).await;

    let mut pod = Pod::new();
    pod.start_sandbox();
    let cold = Instant::now();
    let scheduler = pod.start_scheduler();
    let first_worker = pod.start_worker("worker-0");
    let http_address = pod.published(8000);
    let deadline = Instant::now() + Duration::from_secs(300);
    while http(&http_address, "/health", None).0 != 200 {
        assert!(
            Instant::now() < deadline,
            "the pod never became ready:\n{}\n{}",
            logs(&scheduler),
            logs(&first_worker)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let cold_start = cold.elapsed();
    // The second worker once the first is in: replica ids then follow the containers.
    pod.start_worker("worker-1");

    let channel = |port: u16| {
        let address = format!("http://{}", pod.published(port));
        async move {
            Channel::from_shared(address)
                .expect("uri")
                .connect()
                .await
                .expect("connect")
        }
    };
    let interceptor: Interceptor = bearer;
    let client = GenerationClient::with_interceptor(channel(50051).await, interceptor);
    let mut admin = AdminClient::with_interceptor(channel(50052).await, interceptor);
    wait_for_ready_workers(&mut admin, 2).await;

    // Greedy over gRPC and over HTTP: the reference's tokens.
    all_streams_match(&client, &prompts, &reference, "gRPC").await;
    let body = serde_json::json!({
        "prompt": prompts[0], "max_tokens": TOKENS, "temperature": 0, "ignore_eos": true,
        "return_token_ids": true,
    });
    let (status, response) = http(&http_address, "/v1/completions", Some(&body));
    assert_eq!(status, 200, "{response}");
    let response: serde_json::Value = serde_json::from_str(&response).expect("JSON");
    let tokens: Vec<u32> = serde_json::from_value(response["choices"][0]["token_ids"].clone()).expect("token_ids");
    assert_eq!(tokens, reference[0], "HTTP");
    let (status, metrics) = http(&http_address, "/metrics", None);
    assert_eq!(status, 200);
    assert!(metrics.contains("rivulet:num_requests_waiting"), "{metrics}");
    // JSON logs by default, the worker containers' too (stdout has only the listening lines).
    for container in [&scheduler, &first_worker] {
        let logs = Command::new("docker")
            .args(["logs", container])
            .output()
            .expect("logs")
            .stderr;
        let logs = String::from_utf8_lossy(&logs);
        let mut json_lines = 0;
        for line in logs.lines().filter(|l| !l.trim().is_empty()) {
            if serde_json::from_str::<serde_json::Value>(line).is_ok() {
                json_lines += 1;
            } else {
                // A library's own warning may be plain text; Rivulet's lines name their target.
                assert!(
                    !line.contains("rivulet"),
                    "{container}: a Rivulet log line not JSON: {line:?}"
                );
            }
        }
        assert!(json_lines > 0, "{container} logged no JSON line:\n{logs}");
    }

    // `docker kill` of a worker container while its streams run: none is lost. worker-0
    // attached first, so its replica has the lower id.
    let first_replica = stats(&mut admin)
        .await
        .replicas
        .iter()
        .map(|r| r.id)
        .min()
        .expect("replicas");
    let started = start_streams(&client, &prompts).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stats = stats(&mut admin).await;
        if stats
            .replicas
            .iter()
            .any(|r| r.id == first_replica && r.num_running > 0)
        {
            break;
        }
        assert!(Instant::now() < deadline, "worker-0 never ran a stream: {stats:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    docker(&["kill", &first_worker]);
    finish_streams(started, &reference, "through a worker's kill").await;

    // A third worker container, started while serving, takes requests.
    let before: Vec<u32> = stats(&mut admin).await.replicas.iter().map(|r| r.id).collect();
    pod.start_worker("worker-2");
    let deadline = Instant::now() + Duration::from_secs(300);
    let newcomer = loop {
        let stats = stats(&mut admin).await;
        let new = stats.replicas.iter().find(|r| !before.contains(&r.id)).map(|r| r.id);
        if let (Some(id), 2) = (new, stats.num_replicas_ready) {
            break id;
        }
        assert!(
            Instant::now() < deadline,
            "the third worker never became ready: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut doubled = prompts.clone();
    doubled.extend(prompts.iter().cloned());
    let mut doubled_reference = reference.clone();
    doubled_reference.extend(reference.iter().cloned());
    all_streams_match(&client, &doubled, &doubled_reference, "with the third worker").await;
    let stats_now = stats(&mut admin).await;
    let steps = stats_now
        .replicas
        .iter()
        .find(|r| r.id == newcomer)
        .map_or(0, |r| r.steps);
    assert!(steps > 0, "the new worker took requests: {stats_now:?}");

    // `docker stop` of the scheduler: the streams it is running finish, it exits 0 in time.
    let started = start_streams(&client, &prompts).await;
    let stopping = Instant::now();
    let stop = tokio::task::spawn_blocking({
        let scheduler = scheduler.clone();
        move || docker(&["stop", "-t", &GRACE_SECS.to_string(), &scheduler])
    });
    finish_streams(started, &reference, "through the drain").await;
    stop.await.expect("docker stop");
    let stopped_in = stopping.elapsed();
    assert!(
        stopped_in < Duration::from_secs(GRACE_SECS),
        "stopped by the grace period's SIGKILL"
    );
    let exit = docker(&["inspect", "--format", "{{.State.ExitCode}}", &scheduler]);
    assert_eq!(exit, "0", "{}", logs(&scheduler));
    let segments = docker(&["exec", &format!("{}-sandbox", pod.name), "ls", "-A", "/dev/shm"]);
    assert!(segments.is_empty(), "shared memory left in the pod: {segments}");

    let size: u64 = docker(&["image", "inspect", "--format", "{{.Size}}", IMAGE])
        .parse()
        .expect("size");
    eprintln!(
        "deploy_pod: image {IMAGE} {} MB (build step {built:?}); cold start to SERVING {cold_start:?}; \
         scheduler stop {stopped_in:?}; whole test {:?}",
        size / 1_000_000,
        test_started.elapsed()
    );
}
