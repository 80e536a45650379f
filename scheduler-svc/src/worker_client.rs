//! The scheduler's side of one worker process: spawn, handshake, step, shutdown.
//!
//! Handshake (DESIGN.md §1): create an `IpcOneShotServer`, pass its name on the worker's command
//! line, receive the worker's command sender and event receiver, wait for `Ready`, then create the
//! shared-memory step buffer sized from the reported model and attach the worker to it.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use ipc_channel::ipc::{IpcOneShotServer, IpcReceiver, IpcSender};
use ipc_channel::TryRecvError;
use rivulet_ipc::{Bootstrap, ReadyInfo, StepBuffer, StepCapacity, WorkerCommand, WorkerEvent};
use thiserror::Error;

use crate::config::Config;

/// How often a wait on the worker checks that the process is still alive.
const LIVENESS_POLL: Duration = Duration::from_millis(200);

#[derive(Debug, Error)]
pub enum WorkerClientError {
    #[error("cannot start worker `{binary}`: {source}")]
    Spawn { binary: String, source: std::io::Error },
    #[error("worker IPC: {0}")]
    Ipc(String),
    #[error("worker exited ({0})")]
    Exited(String),
    #[error("worker did not answer within {0:?}")]
    Timeout(Duration),
    #[error("worker reported: {0}")]
    Failed(String),
    #[error("worker sent an unexpected message: {0}")]
    Protocol(String),
    #[error("step buffer: {0}")]
    StepBuffer(#[from] rivulet_ipc::StepBufferError),
}

pub struct WorkerClient {
    child: Child,
    commands: IpcSender<WorkerCommand>,
    events: IpcReceiver<WorkerEvent>,
    buffer: StepBuffer,
    ready: ReadyInfo,
    step_timeout: Duration,
}

/// Result of one iteration.
#[derive(Debug, Clone, Copy)]
pub struct StepTiming {
    /// Time the worker spent in the step, as it measured it.
    pub worker: Duration,
}

impl WorkerClient {
    pub fn spawn(config: &Config) -> Result<Self, WorkerClientError> {
        let binary = worker_binary(config);
        let (server, server_name) =
            IpcOneShotServer::<Bootstrap>::new().map_err(|e| WorkerClientError::Ipc(e.to_string()))?;
        let mut command = Command::new(&binary);
        command
            .arg("--ipc-server")
            .arg(&server_name)
            .arg("--model")
            .arg(&config.model.path)
            .arg("--device")
            .arg(&config.worker.device)
            .args(match config.worker.kv_cache_memory_fraction {
                Some(fraction) => ["--kv-cache-memory-fraction".to_owned(), fraction.to_string()],
                None => [
                    "--kv-cache-memory".to_owned(),
                    config.worker.kv_cache_memory.to_string(),
                ],
            })
            .arg("--block-size")
            .arg(config.worker.block_size.to_string());
        if let Some(len) = config.model.max_model_len {
            command.arg("--max-model-len").arg(len.to_string());
        }
        if config.worker.half_precision_gemv {
            command.arg("--half-precision-gemv");
        }
        if let Some(threads) = config.worker.threads {
            command.arg("--threads").arg(threads.to_string());
        }
        let mut child = command.spawn().map_err(|source| WorkerClientError::Spawn {
            binary: binary.display().to_string(),
            source,
        })?;
        let startup_timeout = Duration::from_secs(config.worker.startup_timeout_secs);

        // `accept` blocks until the worker connects; run it aside so a worker that dies first
        // is noticed instead of waited on forever.
        let (accepted_tx, accepted_rx) = std_mpsc::channel();
        std::thread::Builder::new()
            .name("worker-accept".to_owned())
            .spawn(move || {
                let _ = accepted_tx.send(server.accept().map(|(_, bootstrap)| bootstrap));
            })
            .map_err(|e| WorkerClientError::Ipc(e.to_string()))?;
        let deadline = Instant::now() + startup_timeout;
        let bootstrap = loop {
            match accepted_rx.recv_timeout(LIVENESS_POLL) {
                Ok(Ok(bootstrap)) => break bootstrap,
                Ok(Err(e)) => return Err(fail_start(&mut child, WorkerClientError::Ipc(e.to_string()))),
                Err(_) => check_alive(&mut child, deadline, startup_timeout)?,
            }
        };
        let Bootstrap { commands, events } = bootstrap;
        let ready = match recv_event(&mut child, &events, deadline, startup_timeout)? {
            WorkerEvent::Ready(ready) => ready,
            other => return Err(startup_failure(&mut child, other)),
        };

        let capacity = StepCapacity {
            max_tokens: config.scheduler.max_num_batched_tokens,
            max_seqs: config.scheduler.max_num_seqs,
            max_blocks_per_seq: ready.max_model_len.div_ceil(ready.block_size),
            // Room for every sequence of a step to send a full-context penalty history.
            max_history_tokens: config.scheduler.max_num_seqs.saturating_mul(ready.max_model_len),
        };
        let buffer = StepBuffer::create(capacity)?;
        commands
            .send(WorkerCommand::AttachStepBuffer {
                os_id: buffer.os_id().to_owned(),
                capacity,
            })
            .map_err(|e| WorkerClientError::Ipc(e.to_string()))?;
        match recv_event(&mut child, &events, deadline, startup_timeout)? {
            WorkerEvent::StepBufferAttached => {}
            other => return Err(startup_failure(&mut child, other)),
        }
        Ok(Self {
            child,
            commands,
            events,
            buffer,
            ready,
            step_timeout: Duration::from_secs(config.worker.step_timeout_secs),
        })
    }

    pub fn ready(&self) -> &ReadyInfo {
        &self.ready
    }

    pub fn buffer_mut(&mut self) -> &mut StepBuffer {
        &mut self.buffer
    }

    pub fn buffer(&self) -> &StepBuffer {
        &self.buffer
    }

    /// Runs the step whose inputs are in the buffer; on success its outputs are there too.
    pub fn run_step(&mut self, step: u64) -> Result<StepTiming, WorkerClientError> {
        self.commands
            .send(WorkerCommand::Step { step })
            .map_err(|e| WorkerClientError::Ipc(e.to_string()))?;
        let deadline = Instant::now() + self.step_timeout;
        match recv_event(&mut self.child, &self.events, deadline, self.step_timeout)? {
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
}

impl Drop for WorkerClient {
    fn drop(&mut self) {
        let _ = self.commands.send(WorkerCommand::Shutdown);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn worker_binary(config: &Config) -> PathBuf {
    config.worker.binary.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|dir| dir.join("rivulet-worker")))
            .unwrap_or_else(|| PathBuf::from("rivulet-worker"))
    })
}

fn recv_event(
    child: &mut Child,
    events: &IpcReceiver<WorkerEvent>,
    deadline: Instant,
    timeout: Duration,
) -> Result<WorkerEvent, WorkerClientError> {
    loop {
        match events.try_recv_timeout(LIVENESS_POLL) {
            Ok(event) => return Ok(event),
            Err(TryRecvError::Empty) => check_alive(child, deadline, timeout)?,
            Err(TryRecvError::IpcError(error)) => {
                let status = child
                    .try_wait()
                    .ok()
                    .flatten()
                    .map_or_else(|| format!("{error:?}"), |s| s.to_string());
                return Err(WorkerClientError::Exited(status));
            }
        }
    }
}

fn check_alive(child: &mut Child, deadline: Instant, timeout: Duration) -> Result<(), WorkerClientError> {
    if let Ok(Some(status)) = child.try_wait() {
        return Err(WorkerClientError::Exited(status.to_string()));
    }
    if Instant::now() >= deadline {
        let _ = child.kill();
        return Err(WorkerClientError::Timeout(timeout));
    }
    Ok(())
}

/// A start-up answer other than the expected one: the worker's own failure, or a protocol error.
fn startup_failure(child: &mut Child, event: WorkerEvent) -> WorkerClientError {
    let error = match event {
        WorkerEvent::Failed { message, .. } => WorkerClientError::Failed(message),
        other => WorkerClientError::Protocol(format!("{other:?}")),
    };
    fail_start(child, error)
}

fn fail_start(child: &mut Child, error: WorkerClientError) -> WorkerClientError {
    let _ = child.kill();
    let _ = child.wait();
    error
}
