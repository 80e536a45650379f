//! A worker started by someone other than the scheduler (`rivulet-worker --attach PATH`): it
//! registers on the scheduler's attach socket and receives what to load (see
//! `rivulet_ipc::attach`). After that it is served exactly like a spawned worker.

use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use rivulet_ipc::attach::{AttachAssignment, AttachHello, AttachReply, KvCacheBudget, PROTOCOL_VERSION};

use crate::error::WorkerError;
use crate::memory::KvBudget;
use crate::service::WorkerOptions;

/// How long the scheduler may take to answer the registration.
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);
/// How often to look again for a scheduler that is not listening yet.
const CONNECT_RETRY: Duration = Duration::from_millis(500);

/// Connects to the attach socket, waiting up to `wait` for it to appear: the containers of a pod
/// start together, and a worker that exited because the scheduler had not bound its socket yet
/// would only be restarted later (with a back-off) by its container runtime.
fn connect(path: &Path, wait: Duration) -> std::io::Result<UnixStream> {
    let deadline = Instant::now() + wait;
    let mut said = false;
    loop {
        match UnixStream::connect(path) {
            Ok(stream) => return Ok(stream),
            Err(error)
                if matches!(error.kind(), ErrorKind::NotFound | ErrorKind::ConnectionRefused)
                    && Instant::now() < deadline =>
            {
                if !said {
                    tracing::info!(socket = %path.display(), ?wait, "waiting for the scheduler to listen");
                    said = true;
                }
                std::thread::sleep(CONNECT_RETRY);
            }
            Err(error) => return Err(error),
        }
    }
}

/// Registers on the attach socket at `path`; returns the assignment the scheduler gave and the
/// connection, which the worker keeps open for as long as it lives: the scheduler sees it close
/// when the worker exits, however it exits.
/// The socket may appear up to `wait` later.
pub fn register(path: &Path, device: &str, wait: Duration) -> Result<(AttachAssignment, UnixStream), WorkerError> {
    let attach_error = |what: &str, error: &dyn std::fmt::Display| {
        WorkerError::Ipc(format!("attach socket {}: {what}: {error}", path.display()))
    };
    let mut stream = connect(path, wait).map_err(|e| attach_error("connect", &e))?;
    stream
        .set_read_timeout(Some(REPLY_TIMEOUT))
        .map_err(|e| attach_error("set timeout", &e))?;
    let hello = AttachHello {
        protocol_version: PROTOCOL_VERSION,
        device: device.to_owned(),
        pid: std::process::id(),
    };
    let mut line = serde_json::to_string(&hello).map_err(|e| attach_error("encode", &e))?;
    line.push('\n');
    stream
        .write_all(line.as_bytes())
        .map_err(|e| attach_error("send", &e))?;
    let mut reply = String::new();
    BufReader::new(&stream)
        .read_line(&mut reply)
        .map_err(|e| attach_error("receive", &e))?;
    match serde_json::from_str::<AttachReply>(&reply).map_err(|e| attach_error("decode reply", &e))? {
        AttachReply::Assigned(assignment) => Ok((assignment, stream)),
        AttachReply::Refused { reason } => Err(WorkerError::Ipc(format!(
            "the scheduler at {} refused this worker: {reason}",
            path.display()
        ))),
    }
}

/// The worker's options from an assignment; `device` and `threads` are the worker's own.
pub fn options(assignment: &AttachAssignment, device: String, threads: Option<usize>) -> WorkerOptions {
    WorkerOptions {
        model_path: assignment.model.clone(),
        device,
        kv_cache_memory: match assignment.kv_cache {
            KvCacheBudget::Bytes(bytes) => KvBudget::Bytes(bytes as usize),
            KvCacheBudget::FreeFraction(fraction) => KvBudget::FreeFraction(fraction),
        },
        block_size: assignment.block_size as usize,
        max_model_len: assignment.max_model_len.map(|len| len as usize),
        threads: threads.or(assignment.threads.map(|t| t as usize)),
        half_precision_gemv: assignment.half_precision_gemv,
        libtorch_cpu: false,
        batch_weight_copy: true,
        cuda_graphs: true,
    }
}
