//! The scheduler's side of one worker process: start (spawned or attached), handshake, step,
//! shutdown. Used only by the replica's driver thread (`replica::driver`), never by the engine.
//!
//! Handshake (DESIGN.md §1): create an `IpcOneShotServer`; a spawned worker gets its name on the
//! command line, an attached one in the attach reply. The worker connects and hands over its
//! command sender and event receiver, loads, and reports `Ready`; the scheduler then creates the
//! shared-memory step buffer sized from the reported model and attaches the worker to it.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use ipc_channel::ipc::{IpcOneShotServer, IpcReceiver, IpcSender};
use ipc_channel::TryRecvError;

use rivulet_ipc::attach::{AttachAssignment, AttachHello, AttachReply, KvCacheBudget, PROTOCOL_VERSION};
use rivulet_ipc::{Bootstrap, ReadyInfo, StepBuffer, StepCapacity, WorkerCommand, WorkerEvent};
use thiserror::Error;

use crate::load_progress::LoadShown;

mod launch;
pub use launch::{worker_binary, WorkerLaunch};

/// An attach hello is a few dozen bytes; anything far longer is not a worker.
const MAX_HELLO_BYTES: usize = 64 * 1024;

/// How often a wait on the worker checks that it is still alive and still wanted.
const LIVENESS_POLL: Duration = Duration::from_millis(200);

#[derive(Debug, Error)]
pub enum WorkerClientError {
    #[error("cannot start worker `{binary}`: {source}")]
    Spawn { binary: String, source: std::io::Error },
    #[error("worker IPC: {0}")]
    Ipc(String),
    #[error("attaching worker: {0}")]
    Attach(String),
    #[error("worker exited ({0})")]
    Exited(String),
    #[error("worker did not answer within {0:?}")]
    Timeout(Duration),
    #[error("worker reported: {0}")]
    Failed(String),
    /// The worker cannot work with a setting's value: no restart can help.
    #[error("{key}: {message}")]
    RefusedSetting { key: String, message: String },
    #[error("worker sent an unexpected message: {0}")]
    Protocol(String),
    #[error("step buffer: {0}")]
    StepBuffer(#[from] rivulet_ipc::StepBufferError),
    #[error("the scheduler stopped waiting for the worker")]
    Stopped,
}

/// The worker's process, as far as the scheduler can act on it.
enum WorkerProcess {
    /// Spawned: the scheduler can see it exit and can kill it.
    Child(Child),
    /// Attached from elsewhere: alive as long as it holds its end of the attach connection (and of
    /// the IPC channels); it closes them when it exits, however it exits.
    Attached { pid: u32, stream: UnixStream },
}

impl WorkerProcess {
    fn pid(&self) -> u32 {
        match self {
            Self::Child(child) => child.id(),
            Self::Attached { pid, .. } => *pid,
        }
    }

    fn exit_status(&mut self) -> Option<String> {
        match self {
            Self::Child(child) => child.try_wait().ok().flatten().map(|status| status.to_string()),
            Self::Attached { stream, .. } => connection_closed(stream).then(|| "attach connection closed".to_owned()),
        }
    }

    fn kill(&mut self) {
        if let Self::Child(child) = self {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `timeout` from now, or a year from now when that overflows (a huge configured timeout).
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600))
}

/// Waits that a stopping scheduler can interrupt, with a deadline.
struct Wait<'a> {
    deadline: Instant,
    timeout: Duration,
    stop: &'a AtomicBool,
}

impl Wait<'_> {
    fn check(&self, process: &mut WorkerProcess) -> Result<(), WorkerClientError> {
        if let Some(status) = process.exit_status() {
            return Err(WorkerClientError::Exited(status));
        }
        if self.stop.load(Ordering::Acquire) {
            return Err(WorkerClientError::Stopped);
        }
        if Instant::now() >= self.deadline {
            return Err(WorkerClientError::Timeout(self.timeout));
        }
        Ok(())
    }
}

pub struct WorkerClient {
    process: WorkerProcess,
    commands: IpcSender<WorkerCommand>,
    events: IpcReceiver<WorkerEvent>,
    ready: ReadyInfo,
    step_timeout: Duration,
    stop_flag: std::sync::Arc<AtomicBool>,
}

/// Result of one iteration.
#[derive(Debug, Clone, Copy)]
pub struct StepTiming {
    /// Time the worker spent in the step, as it measured it.
    pub worker: Duration,
}

impl WorkerClient {
    /// Spawns a worker process and waits (interruptibly, through `stop`) until it is ready. The
    /// step buffer is returned apart: it travels between the engine and the driver.
    pub fn spawn(
        launch: &WorkerLaunch,
        stop: std::sync::Arc<AtomicBool>,
    ) -> Result<(Self, StepBuffer), WorkerClientError> {
        let (server, server_name) = one_shot_server()?;
        let settings = &launch.assignment;
        let name = server_name.clone();
        let mut command = Command::new(&launch.binary);
        command
            .arg("--ipc-server")
            .arg(&server_name)
            .arg("--model")
            .arg(&settings.model)
            .arg("--device")
            .arg(&launch.device)
            .args(match settings.kv_cache {
                KvCacheBudget::FreeFraction(fraction) => {
                    ["--kv-cache-memory-fraction".to_owned(), fraction.to_string()]
                }
                KvCacheBudget::Bytes(bytes) => ["--kv-cache-memory".to_owned(), bytes.to_string()],
            })
            .arg("--block-size")
            .arg(settings.block_size.to_string());
        if let Some(len) = settings.max_model_len {
            command.arg("--max-model-len").arg(len.to_string());
        }
        if settings.half_precision_gemv {
            command.arg("--half-precision-gemv");
        }
        if let Some(threads) = launch.threads {
            command.arg("--threads").arg(threads.to_string());
        }
        if launch.libtorch_cpu {
            command.arg("--libtorch-cpu");
        }
        if !launch.batch_weight_copy {
            command.arg("--no-batch-weight-copy");
        }
        if !launch.cuda_graphs {
            command.arg("--no-cuda-graphs");
        }
        command.env("RIVULET_SERVER__JSON_LOGS", launch.json_logs.to_string());
        let child = command.spawn().map_err(|source| WorkerClientError::Spawn {
            binary: launch.binary.display().to_string(),
            source,
        })?;
        Self::handshake(launch, (server, name), WorkerProcess::Child(child), stop)
    }

    /// Takes a worker that connected to the attach socket: reads its hello, answers with the
    /// model and cache settings, then waits (interruptibly) until it is ready.
    pub fn attach(
        stream: UnixStream,
        launch: &WorkerLaunch,
        stop: std::sync::Arc<AtomicBool>,
    ) -> Result<(Self, StepBuffer), WorkerClientError> {
        let attach_error = |e: &dyn std::fmt::Display| WorkerClientError::Attach(e.to_string());
        let wait = Wait {
            deadline: deadline_after(launch.startup_timeout),
            timeout: launch.startup_timeout,
            stop: &stop,
        };
        let hello: AttachHello = read_hello(&stream, &wait)?;
        let mut writer = &stream;
        let mut reply = |reply: &AttachReply| -> Result<(), WorkerClientError> {
            let mut text = serde_json::to_string(reply).map_err(|e| attach_error(&e))?;
            text.push('\n');
            writer.write_all(text.as_bytes()).map_err(|e| attach_error(&e))
        };
        if hello.protocol_version != PROTOCOL_VERSION {
            let reason = format!(
                "protocol version {} (this scheduler speaks {PROTOCOL_VERSION})",
                hello.protocol_version
            );
            reply(&AttachReply::Refused { reason: reason.clone() })?;
            return Err(WorkerClientError::Attach(reason));
        }
        let (server, server_name) = one_shot_server()?;
        let assignment = AttachAssignment {
            ipc_server: server_name.clone(),
            ..launch.assignment.clone()
        };
        reply(&AttachReply::Assigned(assignment))?;
        let process = WorkerProcess::Attached { pid: hello.pid, stream };
        Self::handshake(launch, (server, server_name), process, stop)
    }

    fn handshake(
        launch: &WorkerLaunch,
        (server, server_name): (IpcOneShotServer<Bootstrap>, String),
        mut process: WorkerProcess,
        stop: std::sync::Arc<AtomicBool>,
    ) -> Result<(Self, StepBuffer), WorkerClientError> {
        let wait = Wait {
            deadline: deadline_after(launch.startup_timeout),
            timeout: launch.startup_timeout,
            stop: &stop,
        };
        // `accept` blocks until the worker connects; run it aside so a worker that dies first,
        // or a scheduler that stops waiting, is noticed instead of waited on forever.
        let (accepted_tx, accepted_rx) = std_mpsc::channel();
        std::thread::Builder::new()
            .name("worker-accept".to_owned())
            .spawn(move || {
                let _ = accepted_tx.send(server.accept().map(|(_, bootstrap)| bootstrap));
            })
            .map_err(|e| WorkerClientError::Ipc(e.to_string()))?;
        let bootstrap = loop {
            match accepted_rx.recv_timeout(LIVENESS_POLL) {
                Ok(Ok(bootstrap)) => break bootstrap,
                Ok(Err(e)) => return Err(fail_start(&mut process, WorkerClientError::Ipc(e.to_string()))),
                Err(_) => {
                    if let Err(error) = wait.check(&mut process) {
                        // Connect once without a message, so the accepting thread returns.
                        let _ = IpcSender::<Bootstrap>::connect(server_name);
                        return Err(fail_start(&mut process, error));
                    }
                }
            }
        };
        let Bootstrap { commands, events } = bootstrap;
        let mut shown = LoadShown::new(launch.json_logs);
        let ready = match loop {
            match recv_event(&mut process, &events, &wait) {
                Ok(WorkerEvent::LoadProgress(progress)) => shown.show(process.pid(), progress),
                other => break other,
            }
        } {
            Ok(WorkerEvent::Ready(ready)) if ready.block_size > 0 && ready.max_model_len > 0 => ready,
            Ok(WorkerEvent::Ready(ready)) => {
                let error = WorkerClientError::Protocol(format!("a worker without a KV cache: {ready:?}"));
                return Err(fail_start(&mut process, error));
            }
            Ok(other) => return Err(startup_failure(&mut process, other)),
            Err(error) => return Err(fail_start(&mut process, error)),
        };
        let capacity = StepCapacity {
            max_tokens: launch.max_num_batched_tokens,
            max_seqs: launch.max_num_seqs,
            max_blocks_per_seq: ready.max_model_len.div_ceil(ready.block_size),
            // Room for every sequence of a step to send a full-context penalty history.
            max_history_tokens: launch.max_num_seqs.saturating_mul(ready.max_model_len),
            token_mask_words: ready.model.vocab_size.div_ceil(64),
        };
        let buffer = match StepBuffer::create(capacity) {
            Ok(buffer) => buffer,
            Err(error) => return Err(fail_start(&mut process, error.into())),
        };
        let attach = commands.send(WorkerCommand::AttachStepBuffer {
            os_id: buffer.os_id().to_owned(),
            capacity,
        });
        if let Err(error) = attach {
            return Err(fail_start(&mut process, WorkerClientError::Ipc(error.to_string())));
        }
        match recv_event(&mut process, &events, &wait) {
            Ok(WorkerEvent::StepBufferAttached) => {}
            Ok(other) => return Err(startup_failure(&mut process, other)),
            Err(error) => return Err(fail_start(&mut process, error)),
        }
        let client = Self {
            process,
            commands,
            events,
            ready,
            step_timeout: launch.step_timeout,
            stop_flag: stop,
        };
        Ok((client, buffer))
    }

    pub fn ready(&self) -> &ReadyInfo {
        &self.ready
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Runs the step whose inputs are in the step buffer; on success its outputs are there too.
    /// A worker that takes longer than the step deadline is hung (e.g. SIGSTOPped): an error.
    pub fn run_step(&mut self, step: u64) -> Result<StepTiming, WorkerClientError> {
        self.commands
            .send(WorkerCommand::Step { step })
            .map_err(|e| WorkerClientError::Ipc(e.to_string()))?;
        let wait = Wait {
            deadline: deadline_after(self.step_timeout),
            timeout: self.step_timeout,
            stop: &self.stop_flag,
        };
        match recv_event(&mut self.process, &self.events, &wait)? {
            WorkerEvent::StepDone {
                step: done,
                forward_micros,
            } if done == step => Ok(StepTiming {
                worker: Duration::from_micros(forward_micros),
            }),
            WorkerEvent::Failed { message, .. } => Err(WorkerClientError::Failed(message)),
            other => Err(WorkerClientError::Protocol(format!(
                "{other:?} in answer to step {step}"
            ))),
        }
    }

    /// Between steps: is the worker still there? A spawned one must not have exited; an attached
    /// one must still hold its end of the channel (a killed process closes it).
    pub fn check_alive(&mut self) -> Result<(), WorkerClientError> {
        if let Some(status) = self.process.exit_status() {
            return Err(WorkerClientError::Exited(status));
        }
        match self.events.try_recv() {
            Err(TryRecvError::Empty) => Ok(()),
            Err(TryRecvError::IpcError(error)) => Err(WorkerClientError::Exited(format!("{error:?}"))),
            Ok(event) => Err(WorkerClientError::Protocol(format!("{event:?} between steps"))),
        }
    }

    /// A worker that failed a step or missed its deadline is not trusted again: a spawned one is
    /// killed at once (a hung process would otherwise hold its memory), an attached one is cut off.
    pub fn abandon(mut self) {
        self.process.kill();
    }
}

impl Drop for WorkerClient {
    fn drop(&mut self) {
        let _ = self.commands.send(WorkerCommand::Shutdown);
        let WorkerProcess::Child(child) = &mut self.process else {
            return;
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// The handshake's one-shot server, whose socket ipc-channel makes in a fresh folder under
/// `TMPDIR`. Where that folder cannot be made, ipc-channel 0.23 panics on the error (an assertion
/// on its kind) instead of returning it: caught here, so that the driver reports a failed start.
fn one_shot_server() -> Result<(IpcOneShotServer<Bootstrap>, String), WorkerClientError> {
    match std::panic::catch_unwind(IpcOneShotServer::<Bootstrap>::new) {
        Ok(made) => made.map_err(|e| WorkerClientError::Ipc(e.to_string())),
        Err(_) => Err(WorkerClientError::Ipc(format!(
            "cannot make the handshake socket's folder in {}",
            std::env::temp_dir().display()
        ))),
    }
}

/// Whether the peer closed `stream` (a read would return end of file), without blocking. The
/// worker sends nothing on it after its hello, so any byte read is a protocol error: closed too.
fn connection_closed(stream: &UnixStream) -> bool {
    use std::io::Read;
    if stream.set_nonblocking(true).is_err() {
        return true;
    }
    let mut byte = [0u8; 1];
    let closed = match (&*stream).read(&mut byte) {
        Ok(_) => true,
        Err(error) => error.kind() != std::io::ErrorKind::WouldBlock,
    };
    let _ = stream.set_nonblocking(false);
    closed
}

/// Reads the worker's hello line, checking between short waits that the scheduler still wants it.
fn read_hello(stream: &UnixStream, wait: &Wait<'_>) -> Result<AttachHello, WorkerClientError> {
    let attach_error = |e: &dyn std::fmt::Display| WorkerClientError::Attach(e.to_string());
    stream
        .set_read_timeout(Some(LIVENESS_POLL))
        .map_err(|e| attach_error(&e))?;
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => return Err(WorkerClientError::Attach("closed before saying hello".to_owned())),
            Ok(_) if line.ends_with(b"\n") => break,
            Ok(_) if line.len() > MAX_HELLO_BYTES => {
                return Err(WorkerClientError::Attach(format!(
                    "a hello longer than {MAX_HELLO_BYTES} bytes"
                )))
            }
            Ok(_) => {}
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if wait.stop.load(Ordering::Acquire) {
                    return Err(WorkerClientError::Stopped);
                }
                if Instant::now() >= wait.deadline {
                    return Err(WorkerClientError::Timeout(wait.timeout));
                }
            }
            Err(error) => return Err(attach_error(&error)),
        }
    }
    serde_json::from_slice(&line).map_err(|e| attach_error(&e))
}

fn recv_event(
    process: &mut WorkerProcess,
    events: &IpcReceiver<WorkerEvent>,
    wait: &Wait<'_>,
) -> Result<WorkerEvent, WorkerClientError> {
    loop {
        match events.try_recv_timeout(LIVENESS_POLL) {
            Ok(event) => return Ok(event),
            Err(TryRecvError::Empty) => wait.check(process)?,
            Err(TryRecvError::IpcError(error)) => {
                let status = process.exit_status().unwrap_or_else(|| format!("{error:?}"));
                return Err(WorkerClientError::Exited(status));
            }
        }
    }
}

/// A start-up answer other than the expected one: the worker's own failure, or a protocol error.
fn startup_failure(process: &mut WorkerProcess, event: WorkerEvent) -> WorkerClientError {
    let error = match event {
        WorkerEvent::Failed {
            message,
            setting: Some(key),
            ..
        } => WorkerClientError::RefusedSetting { key, message },
        WorkerEvent::Failed { message, .. } => WorkerClientError::Failed(message),
        other => WorkerClientError::Protocol(format!("{other:?}")),
    };
    fail_start(process, error)
}

fn fail_start(process: &mut WorkerProcess, error: WorkerClientError) -> WorkerClientError {
    process.kill();
    error
}
