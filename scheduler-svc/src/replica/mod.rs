//! Replicas (DESIGN.md §1): independent data-parallel copies of the model. A replica is one worker
//! process together with everything that is only true while that process lives — its IPC client
//! and step buffer ([`driver`]), its block manager, prefix cache and sequences ([`live`]). They
//! are born together when the worker reports ready and dropped together when it goes.
//!
//! - [`driver`]: the thread that owns the worker process; the engine never blocks on it.
//! - [`live`]: the state of a replica whose worker is up; planning and applying its steps.
//! - [`outputs`]: a step's sampled tokens applied to its sequences.
//! - [`attach_listener`]: the socket through which workers started elsewhere join.

pub mod attach_listener;
pub mod driver;
pub mod live;
pub mod outbox;
pub mod outputs;

use driver::DriverHandle;
use live::LiveReplica;

pub type ReplicaId = u32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaState {
    /// Its worker is starting or loading the model.
    Starting,
    /// Takes new requests.
    Ready,
    /// Takes no new requests; ends once its running sequences are done.
    Draining,
    /// Its worker failed; a spawned replica restarts after a back-off.
    Failed,
}

impl ReplicaState {
    pub const ALL: [ReplicaState; 4] = [
        ReplicaState::Starting,
        ReplicaState::Ready,
        ReplicaState::Draining,
        ReplicaState::Failed,
    ];

    /// Its name as a metrics label.
    pub fn label(self) -> &'static str {
        match self {
            ReplicaState::Starting => "starting",
            ReplicaState::Ready => "ready",
            ReplicaState::Draining => "draining",
            ReplicaState::Failed => "failed",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaOrigin {
    /// Spawned by the scheduler (`worker.replicas`).
    Spawned,
    /// Attached through `worker.attach_socket`.
    Attached,
}

/// One replica as the engine sees it: identity and counters that outlive worker restarts, and
/// the [`LiveReplica`] while a worker is up.
pub struct Replica {
    pub id: ReplicaId,
    pub origin: ReplicaOrigin,
    /// The device it was asked for (until ready), then the one its worker reports.
    pub device: String,
    pub state: ReplicaState,
    pub pid: Option<u32>,
    /// Worker processes started after the first.
    pub restarts: u32,
    pub steps: u64,
    /// The worker process the engine's view belongs to (see `driver::ReplicaMessage`).
    pub incarnation: u64,
    pub last_error: Option<String>,
    pub live: Option<LiveReplica>,
    pub driver: DriverHandle,
}

/// A replica's figures for `GetStats`.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaSnapshot {
    pub id: ReplicaId,
    pub origin: ReplicaOrigin,
    pub device: String,
    pub state: ReplicaState,
    pub pid: Option<u32>,
    pub kv_blocks_total: u32,
    pub kv_blocks_used: u32,
    pub num_running: u32,
    pub num_waiting: u32,
    pub steps: u64,
    pub restarts: u32,
    pub last_error: Option<String>,
}

impl Replica {
    pub fn new(id: ReplicaId, origin: ReplicaOrigin, device: String, driver: DriverHandle) -> Self {
        Self {
            id,
            origin,
            device,
            state: ReplicaState::Starting,
            pid: None,
            restarts: 0,
            steps: 0,
            incarnation: 0,
            last_error: None,
            live: None,
            driver,
        }
    }

    /// Ready and up: new requests may be routed here.
    pub fn routable(&self) -> Option<&LiveReplica> {
        self.live.as_ref().filter(|_| self.state == ReplicaState::Ready)
    }

    pub fn snapshot(&self) -> ReplicaSnapshot {
        let live = self.live.as_ref();
        ReplicaSnapshot {
            id: self.id,
            origin: self.origin,
            device: self.device.clone(),
            state: self.state,
            pid: self.pid,
            kv_blocks_total: live.map_or(0, |l| l.blocks.total()),
            kv_blocks_used: live.map_or(0, |l| l.blocks.num_used()),
            num_running: live.map_or(0, |l| l.running.len() as u32),
            num_waiting: live.map_or(0, |l| l.waiting.len() as u32),
            steps: self.steps,
            restarts: self.restarts,
            last_error: self.last_error.clone(),
        }
    }
}
