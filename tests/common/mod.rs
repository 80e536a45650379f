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
    pub address: String,
}

impl TestServer {
    /// Starts the server with test-sized defaults plus `env` overrides (`RIVULET_*` variables).
    pub fn start(env: &[(&str, &str)]) -> Self {
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
            .env("RIVULET_CONFIG", "/nonexistent/rivulet.toml")
            .env("RIVULET_SERVER__LISTEN", "127.0.0.1:0")
            .env("RIVULET_MODEL__PATH", model_path())
            .env("RIVULET_MODEL__MAX_MODEL_LEN", "2048")
            .env("RIVULET_WORKER__KV_CACHE_MEMORY", (256u64 << 20).to_string())
            .env("RIVULET_WORKER__BINARY", binary("rivulet-worker"))
            .stdout(Stdio::piped());
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().expect("spawn rivulet-scheduler");
        let stdout = child.stdout.take().expect("piped stdout");
        let (address_tx, address_rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(address) = line.strip_prefix("rivulet-scheduler listening on ") {
                    let _ = address_tx.send(address.to_owned());
                }
            }
        });
        let address = match address_rx.recv_timeout(Duration::from_secs(300)) {
            Ok(address) => address,
            Err(_) => {
                let _ = child.kill();
                panic!("rivulet-scheduler did not start listening: {:?}", child.wait());
            }
        };
        Self { child, address }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub async fn client(&self) -> GenerationClient<Channel> {
        GenerationClient::connect(format!("http://{}", self.address))
            .await
            .expect("connect")
    }

    pub async fn admin(&self) -> AdminClient<Channel> {
        AdminClient::connect(format!("http://{}", self.address))
            .await
            .expect("connect admin")
    }

    pub async fn stats(&self) -> rivulet::proto::GetStatsResponse {
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
