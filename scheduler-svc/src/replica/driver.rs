//! A replica's driver: the thread that owns its worker process (through [`WorkerClient`]) and does
//! everything that may block on it — spawning or accepting the worker, the handshake, each step's
//! wait, restarts with back-off — so that the engine never does.
//!
//! The engine and the driver take turns with the step buffer: `RunStep` carries it to the driver,
//! `StepDone` carries it back. Whoever holds it may touch the shared memory; no locks.

use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rivulet_ipc::{ReadyInfo, StepBuffer};

use crate::worker_client::{StepTiming, WorkerClient, WorkerClientError, WorkerLaunch};

use super::ReplicaId;

/// The first restart waits this long; each failure in a row doubles it, up to `MAX_BACKOFF`.
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How often an idle worker is checked for life, so that health tells the truth between requests.
const IDLE_LIVENESS_POLL: Duration = Duration::from_millis(250);

/// Engine → driver. The step buffer travels boxed: its mapping handle is a few hundred bytes.
pub enum DriverCommand {
    /// Run the step whose inputs are in `buffer`, on the worker of `incarnation` (a step meant
    /// for an earlier worker process is dropped, never run on its successor).
    RunStep {
        incarnation: u64,
        step: u64,
        buffer: Box<StepBuffer>,
    },
}

/// Driver → engine, about one worker process of the replica (`incarnation` counts them).
pub struct ReplicaMessage {
    pub replica: ReplicaId,
    pub incarnation: u64,
    pub event: ReplicaEvent,
}

pub enum ReplicaEvent {
    /// A worker process is being started (or accepted) and loads its model.
    Starting,
    Ready {
        pid: u32,
        ready: ReadyInfo,
        buffer: Box<StepBuffer>,
    },
    StepDone {
        step: u64,
        buffer: Box<StepBuffer>,
        timing: StepTiming,
    },
    /// The worker is gone (died, hung past the step deadline, failed a step or its start); its
    /// KV cache with it. `restarting`: a new worker process follows after a back-off.
    Failed { error: String, restarting: bool },
    /// The replica's first worker refused a setting's value (`error` names the key): a restart
    /// would fail the same way, so none follows.
    RefusedSetting { error: String },
    /// The driver ended: the replica will not come back.
    Exited,
}

/// Where the replica's workers come from.
pub enum WorkerSource {
    /// Spawned as children, and respawned after a failure.
    Spawn,
    /// One worker that connected to the attach socket; when it fails, the replica ends.
    Attached(UnixStream),
}

/// How a driver reaches the engine.
type Notify = Arc<dyn Fn(ReplicaMessage) + Send + Sync>;

/// The engine's end of a driver.
pub struct DriverHandle {
    commands: Option<Sender<DriverCommand>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl DriverHandle {
    /// Starts the driver thread of replica `id`; `notify` delivers its messages to the engine.
    pub fn start(
        id: ReplicaId,
        source: WorkerSource,
        launch: WorkerLaunch,
        notify: impl Fn(ReplicaMessage) + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        let (commands, command_rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let driver = Driver {
            id,
            launch,
            commands: command_rx,
            stop: stop.clone(),
            notify: Arc::new(notify),
            incarnation: 0,
        };
        let thread = std::thread::Builder::new()
            .name(format!("replica-{id}"))
            .spawn(move || driver.run(source))?;
        Ok(Self {
            commands: Some(commands),
            stop,
            thread: Some(thread),
        })
    }

    /// Hands the step buffer to the driver to run `step`; false if the driver is gone.
    pub fn run_step(&self, incarnation: u64, step: u64, buffer: Box<StepBuffer>) -> bool {
        self.commands.as_ref().is_some_and(|commands| {
            commands
                .send(DriverCommand::RunStep {
                    incarnation,
                    step,
                    buffer,
                })
                .is_ok()
        })
    }

    /// Tells the driver to let its worker go (it is asked to exit) and end, without waiting.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.commands = None;
    }

    /// Stops the driver and waits until its worker has exited and its step buffer is unlinked.
    pub fn join(mut self) {
        self.stop();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

struct Driver {
    id: ReplicaId,
    launch: WorkerLaunch,
    commands: Receiver<DriverCommand>,
    stop: Arc<AtomicBool>,
    notify: Notify,
    incarnation: u64,
}

/// Tells the engine that the driver ended, however it ended (a panic included), so that the
/// engine never waits for a replica nobody drives.
struct ExitNotice {
    notify: Notify,
    replica: ReplicaId,
    incarnation: u64,
}

impl Drop for ExitNotice {
    fn drop(&mut self) {
        (self.notify)(ReplicaMessage {
            replica: self.replica,
            incarnation: self.incarnation,
            event: ReplicaEvent::Exited,
        });
    }
}

impl Driver {
    fn run(mut self, source: WorkerSource) {
        let mut notice = ExitNotice {
            notify: self.notify.clone(),
            replica: self.id,
            incarnation: 0,
        };
        self.run_incarnations(source, &mut notice);
    }

    fn run_incarnations(&mut self, source: WorkerSource, notice: &mut ExitNotice) {
        let mut attached = match source {
            WorkerSource::Spawn => None,
            WorkerSource::Attached(stream) => Some(stream),
        };
        let restarts = attached.is_none();
        let mut backoff = FIRST_BACKOFF;
        // A setting refused before any worker of the replica got ready cannot work: no restart.
        // After one did, the same refusal is the machine changing (memory taken, a device
        // lost), which a later restart may outlast.
        let mut ever_ready = false;
        loop {
            self.incarnation += 1;
            notice.incarnation = self.incarnation;
            self.send(ReplicaEvent::Starting);
            let started = match attached.take() {
                Some(stream) => WorkerClient::attach(stream, &self.launch, self.stop.clone()),
                None => WorkerClient::spawn(&self.launch, self.stop.clone()),
            };
            let failure = match started {
                Ok((client, buffer)) => {
                    ever_ready = true;
                    tracing::info!(replica = self.id, pid = client.pid(), ready = ?client.ready(), "worker ready");
                    self.send(ReplicaEvent::Ready {
                        pid: client.pid(),
                        ready: client.ready().clone(),
                        buffer: Box::new(buffer),
                    });
                    match self.serve(client) {
                        Served::Released => break,
                        Served::Failed { error, stepped } => {
                            if stepped {
                                backoff = FIRST_BACKOFF;
                            }
                            error
                        }
                    }
                }
                Err(WorkerClientError::Stopped) => break,
                Err(error @ WorkerClientError::RefusedSetting { .. }) if !ever_ready => {
                    tracing::error!(replica = self.id, %error, "worker refused a setting; not restarting it");
                    self.send(ReplicaEvent::RefusedSetting {
                        error: error.to_string(),
                    });
                    break;
                }
                Err(error) => error,
            };
            let stopping = self.stop.load(Ordering::Acquire);
            if stopping {
                // The engine let go mid-step (a drain past its deadline): not a worker's failure.
                tracing::info!(replica = self.id, error = %failure, "worker cut off while stopping");
            } else {
                tracing::error!(replica = self.id, error = %failure, restarting = restarts, "worker failed");
            }
            self.send(ReplicaEvent::Failed {
                error: failure.to_string(),
                restarting: restarts && !stopping,
            });
            if !restarts || stopping {
                break;
            }
            if !self.back_off(backoff) {
                break;
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// Waits `duration` before the next worker process; false if the engine stopped the driver
    /// meanwhile (it drops its sender). Steps still addressed to the lost worker are dropped.
    fn back_off(&self, duration: Duration) -> bool {
        let deadline = Instant::now() + duration;
        loop {
            match self
                .commands
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Err(RecvTimeoutError::Disconnected) => return false,
                Err(RecvTimeoutError::Timeout) => return true,
                Ok(DriverCommand::RunStep { .. }) => {}
            }
        }
    }

    /// Runs steps until the engine lets go (the worker is then shut down cleanly) or the worker
    /// fails (it is then killed or cut off).
    fn serve(&self, mut client: WorkerClient) -> Served {
        let mut stepped = false;
        loop {
            let (step, buffer) = match self.commands.recv_timeout(IDLE_LIVENESS_POLL) {
                Ok(DriverCommand::RunStep {
                    incarnation,
                    step,
                    buffer,
                }) if incarnation == self.incarnation => (step, buffer),
                Ok(DriverCommand::RunStep { .. }) => continue,
                Err(RecvTimeoutError::Disconnected) => return Served::Released,
                Err(RecvTimeoutError::Timeout) => match client.check_alive() {
                    Ok(()) => continue,
                    Err(error) => {
                        client.abandon();
                        return Served::Failed { error, stepped };
                    }
                },
            };
            match client.run_step(step) {
                Ok(timing) => {
                    stepped = true;
                    self.send(ReplicaEvent::StepDone { step, buffer, timing });
                }
                Err(error) => {
                    client.abandon();
                    return Served::Failed { error, stepped };
                }
            }
        }
    }

    fn send(&self, event: ReplicaEvent) {
        (self.notify)(ReplicaMessage {
            replica: self.id,
            incarnation: self.incarnation,
            event,
        });
    }
}

enum Served {
    Released,
    Failed { error: WorkerClientError, stepped: bool },
}
