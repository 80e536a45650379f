//! The engine's mailbox: what front ends, drivers and the attach socket send it, and the cheap,
//! cloneable [`EngineHandle`] through which gRPC handlers reach it.

use std::sync::atomic::AtomicUsize;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::{self as tokio_mpsc, UnboundedReceiver, UnboundedSender};
use tokio::sync::{oneshot, watch};

use super::queue_control::QueueSnapshot;
use crate::model_limits::ModelLimits;
use crate::queue_ticket::QueueTicket;
use crate::replica::driver::ReplicaMessage;
use crate::replica::ReplicaId;
use crate::request::{EngineError, GenerationRequest, SequenceEvent};
use crate::scheduler::SchedulingPolicy;
use crate::stats::StatsSnapshot;

pub(super) enum EngineCommand {
    Submit {
        /// Boxed: a request is several times the size of every other command.
        request: Box<GenerationRequest>,
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
    GetQueue {
        reply: oneshot::Sender<QueueSnapshot>,
    },
    ClearQueue {
        reply: oneshot::Sender<usize>,
    },
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
pub(super) enum EngineInput {
    Command(EngineCommand),
    Replica(ReplicaMessage),
    /// A worker connected to the attach socket.
    Attached(std::os::unix::net::UnixStream),
    /// The last [`EngineHandle`] was dropped: finish what is held, then stop.
    HandlesDropped,
}

/// Sends `HandlesDropped` when the last handle goes.
pub(super) struct HandleGuard(pub(super) Sender<EngineInput>);

impl Drop for HandleGuard {
    fn drop(&mut self) {
        let _ = self.0.send(EngineInput::HandlesDropped);
    }
}

/// A cheap, cloneable handle to the engine loop.
#[derive(Clone)]
pub struct EngineHandle {
    pub(super) inputs: Sender<EngineInput>,
    /// Requests submitted and not yet admitted for the first time (the admission queue's depth).
    pub(super) queued: Arc<AtomicUsize>,
    pub(super) max_queued: usize,
    pub limits: Arc<ModelLimits>,
    /// True while some replica is ready to serve and the server is not shutting down.
    pub serving: watch::Receiver<bool>,
    /// Set when a spawned worker refused a setting's value (the key and why): the server cannot
    /// serve with its configuration and stops.
    pub refused_setting: watch::Receiver<Option<String>>,
    pub(super) _guard: Arc<HandleGuard>,
}

impl EngineHandle {
    /// `scheduler.max_queued_requests`: how many requests may wait for their first admission.
    pub fn max_queued(&self) -> usize {
        self.max_queued
    }

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
            request: Box::new(request),
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

    /// The requests waiting for their first admission, and how long a sequence could be admitted.
    pub async fn queue(&self) -> Result<QueueSnapshot, EngineError> {
        self.ask(|reply| EngineCommand::GetQueue { reply }).await
    }

    /// Ends every request waiting for its first admission; returns how many.
    pub async fn clear_queue(&self) -> Result<usize, EngineError> {
        self.ask(|reply| EngineCommand::ClearQueue { reply }).await
    }

    /// Stops routing to replica `id`; it exits once its running sequences are done.
    pub async fn drain_replica(&self, id: ReplicaId) -> Result<(), EngineError> {
        self.ask(|reply| EngineCommand::DrainReplica { id, reply }).await?
    }
}
