//! A server that cannot serve says so at once: a truncated model file, a model of an architecture
//! the worker cannot run, a missing worker binary or one of another protocol version, a KV cache
//! budget too small for one sequence — each stops the start with a message naming the problem and
//! a non-zero exit code, instead of a server that never becomes ready.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{binary, model_path};

/// Starts the scheduler with `env`; returns its exit code and stderr, or panics if it is still
/// running after 60 s.
fn failed_start(env: &[(&str, &str)]) -> (i32, String) {
    let mut child = Command::new(binary("rivulet-scheduler"))
        .env("RIVULET_CONFIG", "/dev/null")
        .env("RIVULET_SERVER__LISTEN", "127.0.0.1:0")
        .env("RIVULET_SERVER__HTTP_LISTEN", "127.0.0.1:0")
        .env("RIVULET_SERVER__ADMIN_LISTEN", "127.0.0.1:0")
        .env("RIVULET_WORKER__BINARY", binary("rivulet-worker"))
        .env("RIVULET_WORKER__KV_CACHE_MEMORY", (64u64 << 20).to_string())
        .env("RUST_BACKTRACE", "0")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rivulet-scheduler");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let output = child.wait_with_output().expect("stderr");
            return (
                status.code().unwrap_or(-1),
                String::from_utf8_lossy(&output.stderr).into_owned(),
            );
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the server kept running instead of refusing to start");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("rivulet-bad-start-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir.join(name)
}

/// A shell script named `name` in the scratch folder, executable, running `body`.
fn executable_script(name: &str, body: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = scratch(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

/// The GGUF file with its `general.architecture` value replaced by another of the same length.
fn with_architecture(model: &Path, architecture: &[u8; 5]) -> Vec<u8> {
    let mut bytes = std::fs::read(model).expect("model");
    let key = b"general.architecture";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .expect("the architecture key");
    // key, then the value: type (u32 = 8, string), length (u64 = 5), the bytes.
    let value = at + key.len() + 4 + 8;
    assert_eq!(&bytes[value..value + 5], b"llama");
    bytes[value..value + 5].copy_from_slice(architecture);
    bytes
}

#[test]
fn a_model_or_worker_that_cannot_serve_stops_the_start_with_the_problem_named() {
    let model = model_path();
    let full = std::fs::read(&model).expect("model");

    let truncated = scratch("truncated.gguf");
    std::fs::write(&truncated, &full[..full.len() / 2]).expect("write");
    let (code, stderr) = failed_start(&[("RIVULET_MODEL__PATH", &truncated.display().to_string())]);
    assert_ne!(code, 0);
    assert!(
        stderr.contains(&truncated.display().to_string()) && stderr.contains("truncated"),
        "{stderr}"
    );

    let other = scratch("mamba.gguf");
    std::fs::write(&other, with_architecture(&model, b"mamba")).expect("write");
    let (code, stderr) = failed_start(&[("RIVULET_MODEL__PATH", &other.display().to_string())]);
    assert_ne!(code, 0);
    assert!(stderr.contains("architecture `mamba` is not supported"), "{stderr}");

    let (code, stderr) = failed_start(&[
        ("RIVULET_MODEL__PATH", &model.display().to_string()),
        ("RIVULET_WORKER__BINARY", "/nonexistent/rivulet-worker"),
    ]);
    assert_ne!(code, 0);
    assert!(
        stderr.contains("/nonexistent/rivulet-worker") && stderr.contains("worker.binary"),
        "{stderr}"
    );

    // Worker binaries of another build, standing in as scripts: one that answers the scheduler's
    // `--protocol-version` question with an older version, one from before the question existed.
    let older = executable_script("older-worker", "echo 1");
    let (code, stderr) = failed_start(&[("RIVULET_WORKER__BINARY", &older.display().to_string())]);
    assert_ne!(code, 0);
    assert!(
        stderr.contains(&older.display().to_string()) && stderr.contains("speaks protocol version 1"),
        "{stderr}"
    );
    let ancient = executable_script(
        "ancient-worker",
        "echo \"error: unexpected argument '--protocol-version' found\" >&2; exit 2",
    );
    let (code, stderr) = failed_start(&[("RIVULET_WORKER__BINARY", &ancient.display().to_string())]);
    assert_ne!(code, 0);
    assert!(
        stderr.contains("did not tell its protocol version") && stderr.contains("unexpected argument"),
        "{stderr}"
    );

    // A KV budget of fixed bytes too small for one sequence of the context: the worker can only
    // tell once it knows its bytes per block, but no restart could help, so the server stops too
    // (and its worker with it), the key named.
    let (code, stderr) = failed_start(&[
        ("RIVULET_MODEL__PATH", &model.display().to_string()),
        ("RIVULET_WORKER__KV_CACHE_MEMORY", "1000000"),
    ]);
    assert_ne!(code, 0);
    assert!(
        stderr.contains("worker.kv_cache_memory: ") && stderr.contains("fewer than"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(truncated.parent().expect("dir"));
}
