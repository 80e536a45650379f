//! The engine's pool of replicas: adding them, following their drivers' reports, losing and
//! draining them, and routing requests to them (DESIGN.md §1).

use std::time::Instant;

use crate::replica::driver::{DriverHandle, ReplicaEvent, ReplicaMessage, WorkerSource};
use crate::replica::live::LiveReplica;
use crate::replica::{Replica, ReplicaId, ReplicaOrigin, ReplicaState};
use crate::request::{EngineError, SequenceEvent};
use crate::sequence::Sequence;
use crate::worker_client::WorkerLaunch;

use super::handle::EngineInput;
use super::Engine;

impl Engine {
    /// Adds a replica and starts its driver; `index` picks a spawned replica's device.
    pub(super) fn add_replica(
        &mut self,
        origin: ReplicaOrigin,
        source: WorkerSource,
        index: usize,
    ) -> std::io::Result<()> {
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

    pub(super) fn handle_replica(&mut self, message: ReplicaMessage) {
        let Some(index) = self.replicas.iter().position(|r| r.id == message.replica) else {
            return; // a replica that already left
        };
        let replica = &mut self.replicas[index];
        let current = message.incarnation == replica.incarnation;
        match message.event {
            ReplicaEvent::Starting => {
                if replica.incarnation > 0 {
                    replica.restarts += 1;
                    self.stats.metrics.worker_restarts.inc();
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
                let budget = self.token_budget();
                let live = LiveReplica::new(
                    ready,
                    buffer,
                    self.scheduler_limits,
                    self.policy,
                    self.block_config,
                    budget,
                );
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
                    live.finish_step(step, buffer, timing, &self.tokenizer, &mut self.stats, &mut self.outbox);
                }
            }
            ReplicaEvent::Ready { .. } | ReplicaEvent::StepDone { .. } => {}
            ReplicaEvent::Failed { error, restarting } => {
                self.stats.metrics.iteration_errors.inc();
                replica.last_error = Some(error);
                if replica.state != ReplicaState::Draining {
                    replica.state = ReplicaState::Failed;
                }
                tracing::warn!(replica = message.replica, restarting, "replica lost its worker");
                self.lose_worker(index);
            }
            ReplicaEvent::RefusedSetting { error } => {
                replica.last_error = Some(error.clone());
                replica.state = ReplicaState::Failed;
                // A spawned worker's settings are the server's own: it cannot serve with them.
                // (An attached worker's container may differ; the pool waits for another.)
                if replica.origin == ReplicaOrigin::Spawned {
                    let _ = self.refused_setting.send(Some(error));
                }
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
    pub(super) fn check_compatible(&self, ready: &rivulet_ipc::ReadyInfo) -> Result<(), String> {
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
    pub(super) fn lose_worker(&mut self, index: usize) {
        // What its last step said goes out first: the sequences' later events may be sent directly.
        self.outbox.flush();
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
    pub(super) fn publish_kv_capacity(&self) {
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
    pub(super) fn reroute(&mut self, from: ReplicaId, sequences: Vec<Sequence>) {
        if !sequences.is_empty() {
            tracing::warn!(
                replica = from,
                sequences = sequences.len(),
                "moving sequences to other replicas"
            );
        }
        let now = Instant::now();
        for mut seq in sequences.into_iter().rev() {
            tracing::debug!(request_id = %seq.request.id, replica = from, "rerouted");
            seq.unrouted_since = Some(now);
            self.unrouted.push_front(seq);
        }
    }

    pub(super) fn drain_replica(&mut self, id: ReplicaId) -> Result<(), EngineError> {
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
    pub(super) fn retire_drained(&mut self) {
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

    /// Gives every unrouted request to a replica: the one with the longest prefix-cache hit for
    /// it, then the one with the most KV room left after its own queue.
    pub(super) fn route_unrouted(&mut self) {
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
    pub(super) fn rebalance_waiting(&mut self) {
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
}
