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

use std::sync::atomic::AtomicUsize;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;
use tokio::sync::mpsc::{self as tokio_mpsc, UnboundedReceiver, UnboundedSender};
use tokio::sync::{oneshot, watch};

use crate::block_manager::BlockManagerConfig;
use crate::config::Config;
use crate::model_limits::ModelLimits;
use crate::queue::WaitingQueue;
use crate::queue_ticket::QueueTicket;
use crate::replica::attach_listener::AttachListener;
use crate::replica::driver::{DriverHandle, ReplicaEvent, ReplicaMessage, WorkerSource};
use crate::replica::live::LiveReplica;
use crate::replica::{Replica, ReplicaId, ReplicaOrigin, ReplicaState};
use crate::request::{EngineError, GenerationRequest, SequenceEvent};
use crate::scheduler::{SchedulerLimits, SchedulingPolicy};
use crate::sequence::{Sequence, SequenceId};
use crate::stats::{EngineStats, StatsSnapshot};
use crate::tokenizer::ModelTokenizer;
use crate::worker_client::{worker_binary, WorkerLaunch};

#[derive(Debug, Error)]
pub enum EngineStartError {
    #[error("the worker binary `{0}` does not exist (set worker.binary)")]
    WorkerBinaryMissing(String),
    #[error("worker.attach_socket `{path}`: {source}")]
    AttachSocket { path: String, source: std::io::Error },
    #[error("starting the engine thread: {0}")]
    Thread(#[from] std::io::Error),
}

enum EngineCommand {
    Submit {
        request: GenerationRequest,
        events: UnboundedSender<SequenceEvent>,
        queue_ticket: QueueTicket,
    },
    GetStats {
        reply: oneshot::Sender<StatsSnapshot>,
    },
    SetPolicy {
        policy: SchedulingPolicy,
        reply: oneshot::Sender<SchedulingPolicy>,
    },
    ResetStatsWindow,
    /// Scale-down: stop routing to replica `id`, let its sequences finish, then let it go.
    DrainReplica {
        id: ReplicaId,
        reply: oneshot::Sender<Result<(), EngineError>>,
    },
    /// Shutting down: refuse new requests; end those still running after `timeout`.
    Drain {
        timeout: Duration,
    },
}

/// Everything that wakes the engine.
enum EngineInput {
    Command(EngineCommand),
    Replica(ReplicaMessage),
    /// A worker connected to the attach socket.
    Attached(std::os::unix::net::UnixStream),
    /// The last [`EngineHandle`] was dropped: finish what is held, then stop.
    HandlesDropped,
}

/// Sends `HandlesDropped` when the last handle goes.
struct HandleGuard(Sender<EngineInput>);

impl Drop for HandleGuard {
    fn drop(&mut self) {
        let _ = self.0.send(EngineInput::HandlesDropped);
    }
}

/// A cheap, cloneable handle to the engine loop.
#[derive(Clone)]
pub struct EngineHandle {
    inputs: Sender<EngineInput>,
    /// Requests submitted and not yet admitted for the first time (the admission queue's depth).
    queued: Arc<AtomicUsize>,
    max_queued: usize,
    pub limits: Arc<ModelLimits>,
    /// True while some replica is ready to serve and the server is not shutting down.
    pub serving: watch::Receiver<bool>,
    _guard: Arc<HandleGuard>,
}

impl EngineHandle {
    fn send(&self, command: EngineCommand) -> Result<(), EngineError> {
        self.inputs
            .send(EngineInput::Command(command))
            .map_err(|_| EngineError::ShuttingDown)
    }

    async fn ask<T>(&self, command: impl FnOnce(oneshot::Sender<T>) -> EngineCommand) -> Result<T, EngineError> {
        let (reply, answer) = oneshot::channel();
        self.send(command(reply))?;
        answer.await.map_err(|_| EngineError::ShuttingDown)
    }

    /// Queues a validated request; its events arrive on the returned receiver. Dropping the
    /// receiver cancels the request at the next iteration. A full queue is `QueueFull`.
    pub fn submit(&self, request: GenerationRequest) -> Result<UnboundedReceiver<SequenceEvent>, EngineError> {
        let queue_ticket = QueueTicket::take(&self.queued, self.max_queued).map_err(EngineError::QueueFull)?;
        let (events, receiver) = tokio_mpsc::unbounded_channel();
        // On failure the unsent command, ticket included, is dropped: the place comes back.
        self.send(EngineCommand::Submit {
            request,
            events,
            queue_ticket,
        })?;
        Ok(receiver)
    }

    pub async fn stats(&self) -> Result<StatsSnapshot, EngineError> {
        self.ask(|reply| EngineCommand::GetStats { reply }).await
    }

    /// Starts a graceful shutdown: new requests are refused (`UNAVAILABLE`) and requests still
    /// running after `timeout` are ended with `UNAVAILABLE`.
    pub fn begin_drain(&self, timeout: Duration) {
        let _ = self.send(EngineCommand::Drain { timeout });
    }

    /// Switches the scheduling policy from the next iteration on; returns the previous one.
    pub async fn set_policy(&self, policy: SchedulingPolicy) -> Result<SchedulingPolicy, EngineError> {
        self.ask(|reply| EngineCommand::SetPolicy { policy, reply }).await
    }

    pub fn reset_stats_window(&self) -> Result<(), EngineError> {
        self.send(EngineCommand::ResetStatsWindow)
    }

    /// Stops routing to replica `id`; it exits once its running sequences are done.
    pub async fn drain_replica(&self, id: ReplicaId) -> Result<(), EngineError> {
        self.ask(|reply| EngineCommand::DrainReplica { id, reply }).await?
    }
}

/// Starts the engine thread, its spawned replicas and the attach socket; returns at once (the
/// workers load in the background; `EngineHandle::serving` says when one is ready). The thread
/// ends when every [`EngineHandle`] is dropped, after finishing the requests it holds.
pub fn start(
    config: Config,
    tokenizer: Arc<ModelTokenizer>,
    limits: ModelLimits,
) -> Result<(EngineHandle, JoinHandle<()>), EngineStartError> {
    let binary = worker_binary(&config);
    if config.worker.replicas > 0 && binary.components().count() > 1 && !binary.exists() {
        return Err(EngineStartError::WorkerBinaryMissing(binary.display().to_string()));
    }
    let (inputs, input_rx) = mpsc::channel();
    let (serving_tx, serving) = watch::channel(false);
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
    let mut engine = Engine::new(config, tokenizer, limits.clone(), inputs.clone(), input_rx, serving_tx);
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
        _guard: Arc::new(HandleGuard(inputs)),
    };
    Ok((handle, thread))
}

struct Engine {
    config: Config,
    tokenizer: Arc<ModelTokenizer>,
    limits: Arc<ModelLimits>,
    scheduler_limits: SchedulerLimits,
    block_config: BlockManagerConfig,
    policy: SchedulingPolicy,
    replicas: Vec<Replica>,
    /// Requests no replica has taken yet (none is ready, or they lost theirs).
    unrouted: WaitingQueue,
    stats: EngineStats,
    inputs: Receiver<EngineInput>,
    /// For the drivers the engine starts.
    input_sender: Sender<EngineInput>,
    handles_open: bool,
    /// Set once a graceful shutdown began: when the remaining requests are ended.
    drain_deadline: Option<Instant>,
    drain_expired: bool,
    serving: watch::Sender<bool>,
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
        input_sender: Sender<EngineInput>,
        inputs: Receiver<EngineInput>,
        serving: watch::Sender<bool>,
    ) -> Self {
        let scheduler = &config.scheduler;
        Self {
            scheduler_limits: SchedulerLimits {
                max_num_seqs: scheduler.max_num_seqs as usize,
                max_num_batched_tokens: scheduler.max_num_batched_tokens as usize,
            },
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
            stats: EngineStats::default(),
            inputs,
            input_sender,
            handles_open: true,
            drain_deadline: None,
            drain_expired: false,
            serving,
            retired: Vec::new(),
            attach_listener: None,
            next_sequence_id: 1,
            next_replica_id: 0,
        }
    }

    fn run(mut self) {
        loop {
            self.receive_inputs();
            if !self.handles_open && self.is_idle() {
                break;
            }
            self.drop_abandoned();
            self.enforce_deadlines();
            self.route_unrouted();
            self.rebalance_waiting();
            self.retire_drained();
            self.start_steps();
            self.publish_health();
        }
        self.shut_down();
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
            .map(|since| since + self.no_worker_timeout());
        // A drain deadline that already fired is not waited for again: what it could not end at
        // once (sequences in a step) is ended when that step returns.
        let drain = self.drain_deadline.filter(|deadline| *deadline > Instant::now());
        [drain, no_worker].into_iter().flatten().min()
    }

    fn no_worker_timeout(&self) -> Duration {
        Duration::from_secs(self.config.scheduler.no_worker_timeout_secs)
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
                self.unrouted
                    .push_back(Sequence::new(id, request, events, queue_ticket));
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
            EngineCommand::DrainReplica { id, reply } => {
                let _ = reply.send(self.drain_replica(id));
            }
            EngineCommand::Drain { timeout } => {
                tracing::info!(waiting = self.unrouted.len(), "draining");
                self.drain_deadline = Some(Instant::now() + timeout);
            }
        }
    }

    /// Adds a replica and starts its driver; `index` picks a spawned replica's device.
    fn add_replica(&mut self, origin: ReplicaOrigin, source: WorkerSource, index: usize) -> std::io::Result<()> {
        let id = self.next_replica_id;
        self.next_replica_id += 1;
        let launch = WorkerLaunch::from_config(&self.config, index, self.config.worker.replicas as usize);
        let device = match origin {
            ReplicaOrigin::Spawned => launch.device.clone(),
            ReplicaOrigin::Attached => "attached".to_owned(),
        };
        let inputs = self.input_sender.clone();
        let driver = DriverHandle::start(id, source, launch, move |message| {
            let _ = inputs.send(EngineInput::Replica(message));
        })?;
        tracing::info!(replica = id, ?origin, %device, "replica added");
        self.replicas.push(Replica::new(id, origin, device, driver));
        Ok(())
    }

    fn handle_replica(&mut self, message: ReplicaMessage) {
        let Some(index) = self.replicas.iter().position(|r| r.id == message.replica) else {
            return; // a replica that already left
        };
        let replica = &mut self.replicas[index];
        let current = message.incarnation == replica.incarnation;
        match message.event {
            ReplicaEvent::Starting => {
                if replica.incarnation > 0 {
                    replica.restarts += 1;
                }
                replica.incarnation = message.incarnation;
                if replica.state != ReplicaState::Draining {
                    replica.state = ReplicaState::Starting;
                }
            }
            ReplicaEvent::Ready { pid, ready, buffer } if current => {
                replica.pid = Some(pid);
                replica.device = ready.device.clone();
                if let Err(problem) = self.check_compatible(&ready) {
                    tracing::error!(replica = message.replica, %problem, "worker does not serve this model; letting it go");
                    let replica = &mut self.replicas[index];
                    replica.last_error = Some(problem);
                    replica.state = ReplicaState::Failed;
                    replica.driver.stop();
                    return;
                }
                let live = LiveReplica::new(ready, buffer, self.scheduler_limits, self.policy, self.block_config);
                let replica = &mut self.replicas[index];
                replica.live = Some(live);
                if replica.state != ReplicaState::Draining {
                    replica.state = ReplicaState::Ready;
                }
                self.publish_kv_capacity();
            }
            ReplicaEvent::StepDone { step, buffer, timing } if current => {
                replica.steps += 1;
                if let Some(live) = replica.live.as_mut() {
                    live.finish_step(step, buffer, timing, &self.tokenizer, &mut self.stats);
                }
            }
            ReplicaEvent::Ready { .. } | ReplicaEvent::StepDone { .. } => {}
            ReplicaEvent::Failed { error, restarting } => {
                replica.last_error = Some(error);
                if replica.state != ReplicaState::Draining {
                    replica.state = ReplicaState::Failed;
                }
                tracing::warn!(replica = message.replica, restarting, "replica lost its worker");
                self.lose_worker(index);
            }
            ReplicaEvent::Exited => {
                self.lose_worker(index);
                let replica = self.replicas.remove(index);
                tracing::info!(replica = replica.id, "replica left the pool");
                self.retired.push(replica.driver);
            }
        }
    }

    /// A worker that serves another model, vocabulary or block size cannot join.
    fn check_compatible(&self, ready: &rivulet_ipc::ReadyInfo) -> Result<(), String> {
        let tokenizer_vocab = self.tokenizer.vocab_size();
        if ready.model.vocab_size != tokenizer_vocab {
            return Err(format!(
                "its vocabulary ({}) differs from the tokenizer's ({tokenizer_vocab})",
                ready.model.vocab_size
            ));
        }
        if ready.block_size != self.config.worker.block_size {
            return Err(format!(
                "its KV block size {} is not worker.block_size {}",
                ready.block_size, self.config.worker.block_size
            ));
        }
        if ready.max_model_len < self.limits.max_model_len {
            return Err(format!(
                "its context of {} tokens is shorter than the served {}",
                ready.max_model_len, self.limits.max_model_len
            ));
        }
        Ok(())
    }

    /// The replica's worker is gone with its KV cache: its block manager and prefix cache go with
    /// it, and its sequences move to the unrouted queue, to be recomputed on another replica.
    fn lose_worker(&mut self, index: usize) {
        let replica = &mut self.replicas[index];
        replica.pid = None;
        if let Some(live) = replica.live.take() {
            let id = replica.id;
            self.reroute(id, live.evacuate());
            self.publish_kv_capacity();
        }
    }

    /// Validation's KV limit: the largest cache among the replicas that are up (unchanged while
    /// none is, so requests keep being checked against the last known pool).
    fn publish_kv_capacity(&self) {
        let largest = self
            .replicas
            .iter()
            .filter_map(|r| r.live.as_ref())
            .map(LiveReplica::capacity_tokens)
            .max();
        if let Some(tokens) = largest {
            self.limits.set_kv_capacity(tokens);
        }
    }

    /// Puts sequences that left replica `from` back in the unrouted queue, ahead of new arrivals.
    fn reroute(&mut self, from: ReplicaId, sequences: Vec<Sequence>) {
        if !sequences.is_empty() {
            tracing::warn!(
                replica = from,
                sequences = sequences.len(),
                "moving sequences to other replicas"
            );
        }
        let now = Instant::now();
        for mut seq in sequences.into_iter().rev() {
            seq.unrouted_since = Some(now);
            self.unrouted.push_front(seq);
        }
    }

    fn drain_replica(&mut self, id: ReplicaId) -> Result<(), EngineError> {
        let index = self
            .replicas
            .iter()
            .position(|r| r.id == id)
            .ok_or(EngineError::UnknownReplica(id))?;
        let replica = &mut self.replicas[index];
        tracing::info!(replica = id, "draining replica");
        replica.state = ReplicaState::Draining;
        if let Some(waiting) = replica.live.as_mut().map(LiveReplica::take_waiting) {
            self.reroute(id, waiting);
        }
        Ok(())
    }

    /// Draining replicas whose last sequence finished leave the pool; their workers exit.
    fn retire_drained(&mut self) {
        let mut index = 0;
        while index < self.replicas.len() {
            let replica = &self.replicas[index];
            let done = replica.state == ReplicaState::Draining
                && replica.live.as_ref().is_none_or(|l| !l.has_work() && !l.is_stepping());
            if done {
                self.lose_worker(index);
                let mut replica = self.replicas.remove(index);
                tracing::info!(replica = replica.id, "replica drained; its worker exits");
                replica.driver.stop();
                self.retired.push(replica.driver);
            } else {
                index += 1;
            }
        }
    }

    /// Cancellation: a client that went away has its sequence removed and its blocks freed.
    fn drop_abandoned(&mut self) {
        self.unrouted.retain_mut(|seq| !seq.is_abandoned());
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
        let timeout = self.no_worker_timeout();
        let expired = |seq: &Sequence| seq.unrouted_since.is_some_and(|since| now >= since + timeout);
        if self.unrouted.iter().any(expired) {
            let error = EngineError::WorkerUnavailable(format!("no worker was ready within {timeout:?}"));
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
        for seq in self.unrouted.drain() {
            let _ = seq.events.send(SequenceEvent::Failed(error.clone()));
        }
        for live in self.replicas.iter_mut().filter_map(|r| r.live.as_mut()) {
            live.fail_all(error);
        }
    }

    /// Gives every unrouted request to a replica: the one with the longest prefix-cache hit for
    /// it, then the one with the most KV room left after its own queue.
    fn route_unrouted(&mut self) {
        let mut no_replica_yet = Vec::new();
        while let Some(mut seq) = self.unrouted.pop_front() {
            let mut any_routable = false;
            let best = self
                .replicas
                .iter()
                .enumerate()
                .filter_map(|(index, replica)| replica.routable().map(|live| (index, live)))
                .inspect(|_| any_routable = true)
                .filter(|(_, live)| live.can_ever_hold(&seq))
                .max_by_key(|(_, live)| (live.blocks.cached_prefix_len(&seq.tokens), live.room_after_queue()))
                .map(|(index, _)| index);
            let Some(index) = best else {
                if any_routable {
                    // Ready replicas exist, and none has the KV cache for it.
                    let _ = seq.events.send(SequenceEvent::Failed(EngineError::WorkerUnavailable(
                        "the request does not fit in any ready worker's KV cache".to_owned(),
                    )));
                } else {
                    no_replica_yet.push(seq);
                }
                continue;
            };
            seq.unrouted_since = None;
            if let Some(live) = self.replicas[index].live.as_mut() {
                // A sequence that ran before goes ahead of new arrivals of its priority.
                if seq.queue_ticket.is_none() {
                    live.waiting.push_front(seq);
                } else {
                    live.waiting.push_back(seq);
                }
            }
        }
        for seq in no_replica_yet.into_iter().rev() {
            self.unrouted.push_front(seq);
        }
    }

    /// A ready replica with nothing to do takes half the queue of the replica with the longest
    /// one (which is busy running others), so that no replica idles while another one queues.
    fn rebalance_waiting(&mut self) {
        let Some(idle) = self
            .replicas
            .iter()
            .position(|r| r.routable().is_some_and(|live| !live.has_work() && !live.is_stepping()))
        else {
            return;
        };
        let busiest = self
            .replicas
            .iter()
            .enumerate()
            .filter(|(index, _)| *index != idle)
            .filter_map(|(index, r)| r.live.as_ref().map(|live| (index, live)))
            .filter(|(_, live)| !live.running.is_empty() && !live.waiting.is_empty())
            .max_by_key(|(_, live)| live.waiting.len())
            .map(|(index, live)| (index, live.waiting.len()));
        let Some((donor, waiting)) = busiest else { return };
        let count = waiting.div_ceil(2).min(self.scheduler_limits.max_num_seqs);
        let Some(moved) = self.replicas[donor]
            .live
            .as_mut()
            .map(|live| live.take_last_waiting(count))
        else {
            return;
        };
        let (fits, stays): (Vec<_>, Vec<_>) = moved.into_iter().partition(|seq| {
            self.replicas[idle]
                .live
                .as_ref()
                .is_some_and(|live| live.can_ever_hold(seq))
        });
        if let Some(live) = self.replicas[donor].live.as_mut() {
            stays.into_iter().for_each(|seq| live.waiting.push_back(seq));
        }
        if let Some(live) = self.replicas[idle].live.as_mut() {
            fits.into_iter().for_each(|seq| live.waiting.push_back(seq));
        }
    }

    /// Every replica that is between steps and has work starts its next step.
    fn start_steps(&mut self) {
        for index in 0..self.replicas.len() {
            let replica = &mut self.replicas[index];
            let incarnation = replica.incarnation;
            let Some(live) = replica.live.as_mut() else { continue };
            let Some((step, buffer)) = live.begin_step(&mut self.stats) else {
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
