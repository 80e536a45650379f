//! The engine loop: one thread that owns every piece of scheduling state — requests not yet
//! routed, the replicas (each with its block manager, prefix cache and sequences) and the
//! statistics — and plans and applies every step (DESIGN.md §1, §2). Handlers talk to it only
//! through [`EngineHandle`]; replica drivers report through the same input channel. No locks.
//!
//! The engine never blocks on a worker: each replica's step runs on its driver thread while the
//! engine plans the other replicas' steps, so replica B's step never waits for replica A's.
//! Planning and applying outputs are a fraction of a percent of a step, so one owner for all
//! replicas costs nothing measurable and keeps routing and moving sequences between replicas
//! simple: they are moves between queues the engine owns.
//!
//! - [`handle`]: what the engine is sent, and the handle front ends hold.
//! - [`pool`]: the replicas' lifecycle and routing requests to them.
//! - [`queue_control`]: the operator's view and control of the admission queue.

mod handle;
mod pool;
mod queue_control;

use std::sync::atomic::AtomicUsize;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;
use tokio::sync::watch;

use crate::block_manager::BlockManagerConfig;
use crate::completion;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::model_limits::ModelLimits;
use crate::queue::WaitingQueue;
use crate::replica::attach_listener::AttachListener;
use crate::replica::driver::{DriverHandle, WorkerSource};
use crate::replica::outbox::Outbox;
use crate::replica::{Replica, ReplicaId, ReplicaOrigin, ReplicaState};
use crate::request::{EngineError, SequenceEvent};
use crate::scheduler::adaptive::{AdaptiveBatching, TokenBudget};
use crate::scheduler::{SchedulerLimits, SchedulingPolicy};
use crate::sequence::{Sequence, SequenceId};
use crate::stats::EngineStats;
use crate::tokenizer::ModelTokenizer;
use crate::worker_client::worker_binary;

pub use handle::EngineHandle;
use handle::{EngineCommand, EngineInput, HandleGuard};
pub use queue_control::{QueueSnapshot, QueuedRequest};

#[derive(Debug, Error)]
pub enum EngineStartError {
    #[error("the worker binary `{0}` does not exist (set worker.binary)")]
    WorkerBinaryMissing(String),
    #[error(transparent)]
    WorkerProtocol(#[from] crate::worker_protocol::WorkerProtocolError),
    #[error("worker.attach_socket `{path}`: {source}")]
    AttachSocket { path: String, source: std::io::Error },
    #[error(
        "the temporary folder {path} (TMPDIR), where each worker's handshake socket is made, cannot be written: {error}"
    )]
    TempDir { path: String, error: std::io::Error },
    #[error("starting the engine thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// Starts the engine thread, its spawned replicas and the attach socket; returns at once (the
/// workers load in the background; `EngineHandle::serving` says when one is ready). The thread
/// ends when every [`EngineHandle`] is dropped, after finishing the requests it holds.
pub fn start(
    config: Config,
    tokenizer: Arc<ModelTokenizer>,
    limits: ModelLimits,
    metrics: Arc<Metrics>,
) -> Result<(EngineHandle, JoinHandle<()>), EngineStartError> {
    let binary = worker_binary(&config);
    if config.worker.replicas > 0 && binary.components().count() > 1 && !binary.exists() {
        return Err(EngineStartError::WorkerBinaryMissing(binary.display().to_string()));
    }
    if config.worker.replicas > 0 {
        crate::worker_protocol::check_worker_protocol(&binary)?;
    }
    check_temp_dir()?;
    let (inputs, input_rx) = mpsc::channel();
    let (serving_tx, serving) = watch::channel(false);
    let (refused_setting_tx, refused_setting) = watch::channel(None);
    let limits = Arc::new(limits);
    let attach_listener = match &config.worker.attach_socket {
        Some(path) => {
            let attached = inputs.clone();
            let listener = AttachListener::bind(path, move |stream| {
                let _ = attached.send(EngineInput::Attached(stream));
            })
            .map_err(|source| EngineStartError::AttachSocket {
                path: path.display().to_string(),
                source,
            })?;
            Some(listener)
        }
        None => None,
    };
    let max_queued = config.scheduler.max_queued_requests as usize;
    let stats = EngineStats::new(metrics);
    let mut engine = Engine::new(
        config,
        tokenizer,
        limits.clone(),
        (inputs.clone(), input_rx),
        (serving_tx, refused_setting_tx),
        stats,
    );
    engine.attach_listener = attach_listener;
    for index in 0..engine.config.worker.replicas as usize {
        engine.add_replica(ReplicaOrigin::Spawned, WorkerSource::Spawn, index)?;
    }
    let thread = std::thread::Builder::new()
        .name("engine".to_owned())
        .spawn(move || engine.run())?;
    let handle = EngineHandle {
        inputs: inputs.clone(),
        queued: Arc::new(AtomicUsize::new(0)),
        max_queued,
        limits,
        serving,
        refused_setting,
        _guard: Arc::new(HandleGuard(inputs)),
    };
    Ok((handle, thread))
}

/// Every worker's handshake goes through a socket in `TMPDIR` (a read-only root filesystem
/// without a writable `/tmp`, a `TMPDIR` that does not exist): found out at start, not at each
/// worker's start.
fn check_temp_dir() -> Result<(), EngineStartError> {
    let dir = std::env::temp_dir();
    let probe = dir.join(format!(".rivulet-start-{}", std::process::id()));
    std::fs::create_dir(&probe)
        .and_then(|()| std::fs::remove_dir(&probe))
        .map_err(|error| EngineStartError::TempDir {
            path: dir.display().to_string(),
            error,
        })
}

struct Engine {
    config: Config,
    tokenizer: Arc<ModelTokenizer>,
    limits: Arc<ModelLimits>,
    scheduler_limits: SchedulerLimits,
    /// `scheduler.adaptive_*`, when adaptive batching is on.
    adaptive: Option<AdaptiveBatching>,
    block_config: BlockManagerConfig,
    policy: SchedulingPolicy,
    replicas: Vec<Replica>,
    /// Requests no replica has taken yet (none is ready, or they lost theirs).
    unrouted: WaitingQueue,
    stats: EngineStats,
    /// Finished steps' events for their clients, sent once the next steps are out.
    outbox: Outbox,
    inputs: Receiver<EngineInput>,
    /// For the drivers the engine starts.
    input_sender: Sender<EngineInput>,
    handles_open: bool,
    /// Set once a graceful shutdown began: when the remaining requests are ended.
    drain_deadline: Option<Instant>,
    drain_expired: bool,
    serving: watch::Sender<bool>,
    refused_setting: watch::Sender<Option<String>>,
    /// Drivers of replicas that left the pool, joined when the engine stops.
    retired: Vec<DriverHandle>,
    attach_listener: Option<AttachListener>,
    next_sequence_id: SequenceId,
    next_replica_id: ReplicaId,
}

impl Engine {
    fn new(
        config: Config,
        tokenizer: Arc<ModelTokenizer>,
        limits: Arc<ModelLimits>,
        (input_sender, inputs): (Sender<EngineInput>, Receiver<EngineInput>),
        (serving, refused_setting): (watch::Sender<bool>, watch::Sender<Option<String>>),
        stats: EngineStats,
    ) -> Self {
        let scheduler = &config.scheduler;
        Self {
            scheduler_limits: SchedulerLimits {
                max_num_seqs: scheduler.max_num_seqs as usize,
                max_num_batched_tokens: scheduler.max_num_batched_tokens as usize,
            },
            adaptive: scheduler.adaptive_batching.then(|| AdaptiveBatching {
                target_step: Duration::from_millis(scheduler.adaptive_target_step_ms),
                target_utilization: scheduler.adaptive_target_utilization,
                warmup_iterations: scheduler.adaptive_warmup_iterations,
            }),
            block_config: BlockManagerConfig {
                reserved_block_ratio: scheduler.reserved_block_ratio,
                backpressure_threshold: scheduler.backpressure_threshold,
                prefix_cache: scheduler.prefix_cache,
                prefix_cache_ttl: scheduler.prefix_cache_ttl_seconds.map(Duration::from_secs),
            },
            policy: scheduler.policy,
            config,
            tokenizer,
            limits,
            replicas: Vec::new(),
            unrouted: WaitingQueue::default(),
            stats,
            outbox: Outbox::default(),
            inputs,
            input_sender,
            handles_open: true,
            drain_deadline: None,
            drain_expired: false,
            serving,
            refused_setting,
            retired: Vec::new(),
            attach_listener: None,
            next_sequence_id: 1,
            next_replica_id: 0,
        }
    }

    fn run(mut self) {
        loop {
            self.receive_inputs();
            // After the drain deadline every request was ended: a step still out (a hung worker's)
            // is not waited for; stopping the drivers cuts it off.
            if !self.handles_open && (self.is_idle() || self.drain_expired) {
                break;
            }
            self.drop_abandoned();
            self.enforce_deadlines();
            self.route_unrouted();
            self.rebalance_waiting();
            self.retire_drained();
            self.start_steps();
            self.outbox.flush();
            self.publish_health();
        }
        self.shut_down();
    }

    /// A new replica's token budget per step.
    fn token_budget(&self) -> TokenBudget {
        let limits = self.scheduler_limits;
        match self.adaptive {
            Some(adaptive) => TokenBudget::adaptive(adaptive, limits.max_num_seqs, limits.max_num_batched_tokens),
            None => TokenBudget::fixed(limits.max_num_batched_tokens),
        }
    }

    fn is_idle(&self) -> bool {
        self.unrouted.is_empty()
            && self
                .replicas
                .iter()
                .filter_map(|r| r.live.as_ref())
                .all(|live| !live.has_work() && !live.is_stepping())
    }

    /// Some replica could start a step now, so the engine must not wait for input.
    fn can_start_a_step(&self) -> bool {
        self.replicas
            .iter()
            .filter_map(|r| r.live.as_ref())
            .any(|live| live.has_work() && !live.is_stepping())
    }

    /// Takes every pending input; when there is nothing to do, waits for one (no spinning), at
    /// most until the next deadline.
    fn receive_inputs(&mut self) {
        let must_wait = !self.can_start_a_step() && (self.handles_open || !self.is_idle());
        if must_wait {
            let received = match self.next_deadline() {
                Some(deadline) => self
                    .inputs
                    .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                    .map_err(|e| e == RecvTimeoutError::Disconnected),
                None => self.inputs.recv().map_err(|_| true),
            };
            match received {
                Ok(input) => self.handle(input),
                Err(true) => self.handles_open = false,
                Err(false) => {}
            }
        }
        while let Ok(input) = self.inputs.try_recv() {
            self.handle(input);
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let no_worker = self
            .unrouted
            .iter()
            .filter_map(|seq| seq.unrouted_since)
            .min()
            .map(|since| since + self.no_worker_wait());
        // A drain deadline that already fired is not waited for again: what it could not end at
        // once (sequences in a step) is ended when that step returns.
        let drain = self.drain_deadline.filter(|deadline| *deadline > Instant::now());
        [drain, no_worker].into_iter().flatten().min()
    }

    fn no_worker_timeout(&self) -> Duration {
        Duration::from_secs(self.config.scheduler.no_worker_timeout_secs)
    }

    /// Every replica is gone (the last ones drained) and no worker can attach: nothing can serve
    /// until the server restarts, so waiting out `no_worker_timeout_secs` would only delay the
    /// error. (Spawned replicas stay in the pool while their worker restarts.)
    fn no_worker_can_come(&self) -> bool {
        self.replicas.is_empty() && self.attach_listener.is_none()
    }

    /// How long an unrouted request waits for a worker: none when none can come.
    fn no_worker_wait(&self) -> Duration {
        if self.no_worker_can_come() {
            Duration::ZERO
        } else {
            self.no_worker_timeout()
        }
    }

    fn handle(&mut self, input: EngineInput) {
        match input {
            EngineInput::Command(command) => self.handle_command(command),
            EngineInput::Replica(message) => self.handle_replica(message),
            EngineInput::Attached(stream) => {
                if self.drain_deadline.is_some() {
                    return; // shutting down: the worker sees the connection close
                }
                if let Err(error) = self.add_replica(ReplicaOrigin::Attached, WorkerSource::Attached(stream), 0) {
                    tracing::error!(%error, "cannot start a driver for an attached worker");
                }
            }
            EngineInput::HandlesDropped => self.handles_open = false,
        }
    }

    fn handle_command(&mut self, command: EngineCommand) {
        match command {
            EngineCommand::Submit {
                request,
                events,
                queue_ticket,
            } => {
                if self.drain_deadline.is_some() {
                    let _ = events.send(SequenceEvent::Failed(EngineError::ShuttingDown));
                    return;
                }
                let id = self.next_sequence_id;
                self.next_sequence_id += 1;
                tracing::debug!(request_id = %request.id, sequence = id, prompt_tokens = request.prompt_ids.len(), "queued");
                self.unrouted
                    .push_back(Sequence::new(id, *request, events, queue_ticket));
            }
            EngineCommand::GetStats { reply } => {
                let _ = reply.send(self.stats.snapshot(self.unrouted.len(), &self.replicas, self.policy));
            }
            EngineCommand::SetPolicy { policy, reply } => {
                let previous = std::mem::replace(&mut self.policy, policy);
                for live in self.replicas.iter_mut().filter_map(|r| r.live.as_mut()) {
                    live.scheduler.policy = policy;
                }
                tracing::info!(?previous, ?policy, "scheduling policy changed");
                let _ = reply.send(previous);
            }
            EngineCommand::ResetStatsWindow => self.stats.reset_window(),
            EngineCommand::GetQueue { reply } => {
                let _ = reply.send(self.queue_snapshot());
            }
            EngineCommand::ClearQueue { reply } => {
                let _ = reply.send(self.clear_queue());
            }
            EngineCommand::DrainReplica { id, reply } => {
                let _ = reply.send(self.drain_replica(id));
            }
            EngineCommand::Drain { timeout } => {
                tracing::info!(waiting = self.unrouted.len(), "draining");
                self.drain_deadline = Some(Instant::now() + timeout);
            }
        }
    }

    /// Cancellation: a client that went away has its sequence removed and its blocks freed.
    fn drop_abandoned(&mut self) {
        self.unrouted.retain_mut(|seq| !completion::is_abandoned(seq));
        for live in self.replicas.iter_mut().filter_map(|r| r.live.as_mut()) {
            live.drop_abandoned();
        }
    }

    fn enforce_deadlines(&mut self) {
        let now = Instant::now();
        if self.drain_deadline.is_some_and(|deadline| now >= deadline) && !self.is_idle() {
            if !self.drain_expired {
                tracing::warn!("shutdown timeout: ending the remaining requests");
                self.drain_expired = true;
            }
            self.fail_everything(&EngineError::ShuttingDown);
        }
        let timeout = self.no_worker_wait();
        let expired = |seq: &Sequence| seq.unrouted_since.is_some_and(|since| now >= since + timeout);
        if self.unrouted.iter().any(expired) {
            let reason = if self.no_worker_can_come() {
                "no worker replica is left (each was drained) and none can attach (worker.attach_socket is unset)"
                    .to_owned()
            } else {
                format!("no worker was ready within {timeout:?}")
            };
            let error = EngineError::WorkerUnavailable(reason);
            self.unrouted.retain_mut(|seq| {
                if expired(seq) {
                    let _ = seq.events.send(SequenceEvent::Failed(error.clone()));
                    return false;
                }
                true
            });
        }
    }

    fn fail_everything(&mut self, error: &EngineError) {
        self.outbox.flush(); // the held events come before the failure
        for seq in self.unrouted.drain() {
            let _ = seq.events.send(SequenceEvent::Failed(error.clone()));
        }
        for live in self.replicas.iter_mut().filter_map(|r| r.live.as_mut()) {
            live.fail_all(error);
        }
    }

    /// Every replica that is between steps and has work starts its next step.
    fn start_steps(&mut self) {
        for index in 0..self.replicas.len() {
            let replica = &mut self.replicas[index];
            let incarnation = replica.incarnation;
            let Some(live) = replica.live.as_mut() else { continue };
            let Some((step, buffer)) = live.begin_step(&mut self.stats, &mut self.outbox) else {
                continue;
            };
            if !replica.driver.run_step(incarnation, step, buffer) {
                // The driver is gone (it would have said why): so is the worker, for all we know.
                replica.last_error = Some("the replica's driver stopped".to_owned());
                replica.state = ReplicaState::Failed;
                self.lose_worker(index);
            }
        }
    }

    fn publish_health(&self) {
        let serving = self.drain_deadline.is_none() && self.replicas.iter().any(|r| r.routable().is_some());
        self.serving.send_if_modified(|current| {
            let changed = *current != serving;
            *current = serving;
            changed
        });
    }

    /// Lets every worker go (each exits, its step buffer unlinked) and waits for the drivers.
    fn shut_down(mut self) {
        self.outbox.flush();
        self.attach_listener = None;
        let _ = self.serving.send(false);
        let replicas = std::mem::take(&mut self.replicas);
        self.retired.extend(replicas.into_iter().map(|replica| replica.driver));
        // Every worker is told to exit before any is waited for.
        for driver in &mut self.retired {
            driver.stop();
        }
        for driver in self.retired.drain(..) {
            driver.join();
        }
        tracing::info!("engine loop stopped");
    }
}
