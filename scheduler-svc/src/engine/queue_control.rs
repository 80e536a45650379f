//! Operator control of the admission queue (Admin `GetQueue`, `ClearQueue`). "Queued" means
//! waiting for a first admission — unrouted, or in a replica's waiting queue with its queue ticket
//! still held; a preempted sequence has already streamed tokens and is not the queue's.

use std::time::Duration;

use super::Engine;
use crate::replica::ReplicaId;
use crate::request::{EngineError, Priority, SequenceEvent};
use crate::sequence::Sequence;

#[derive(Debug, Clone, PartialEq)]
pub struct QueuedRequest {
    pub request_id: String,
    pub priority: Priority,
    pub prompt_tokens: u32,
    pub waiting: Duration,
    /// The replica whose waiting queue holds it, if one took it.
    pub replica: Option<ReplicaId>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct QueueSnapshot {
    /// Highest priority first, then oldest first.
    pub requests: Vec<QueuedRequest>,
    /// The longest sequence a ready replica would admit now (0: none would).
    pub recommended_max_sequence_length: u32,
}

fn is_queued(seq: &Sequence) -> bool {
    seq.queue_ticket.is_some()
}

fn queued(seq: &Sequence, replica: Option<ReplicaId>) -> QueuedRequest {
    QueuedRequest {
        request_id: seq.request.id.clone(),
        priority: seq.request.priority,
        prompt_tokens: seq.prompt_len() as u32,
        waiting: seq.submitted_at.elapsed(),
        replica,
    }
}

impl Engine {
    pub(super) fn queue_snapshot(&self) -> QueueSnapshot {
        let mut requests: Vec<QueuedRequest> = self
            .unrouted
            .iter()
            .filter(|seq| is_queued(seq))
            .map(|seq| queued(seq, None))
            .collect();
        for replica in &self.replicas {
            if let Some(live) = &replica.live {
                requests.extend(
                    live.waiting
                        .iter()
                        .filter(|seq| is_queued(seq))
                        .map(|seq| queued(seq, Some(replica.id))),
                );
            }
        }
        requests.sort_by(|a, b| b.priority.cmp(&a.priority).then(b.waiting.cmp(&a.waiting)));
        let recommended_max_sequence_length = self
            .replicas
            .iter()
            .filter_map(|replica| replica.routable())
            .filter(|live| live.scheduler.admits_new_sequences(live.running.len()))
            .map(|live| live.blocks.admissible_tokens(!live.running.is_empty()))
            .max()
            .unwrap_or(0)
            .min(self.limits.max_model_len);
        QueueSnapshot {
            requests,
            recommended_max_sequence_length,
        }
    }

    /// Ends every queued request with [`EngineError::ClearedFromQueue`]; returns how many.
    pub(super) fn clear_queue(&mut self) -> usize {
        let mut cleared = 0;
        let mut end = |seq: &mut Sequence| {
            if !is_queued(seq) {
                return true;
            }
            let _ = seq.events.send(SequenceEvent::Failed(EngineError::ClearedFromQueue));
            cleared += 1;
            false
        };
        self.unrouted.retain_mut(&mut end);
        for live in self.replicas.iter_mut().filter_map(|r| r.live.as_mut()) {
            // Queued sequences hold no KV blocks yet: nothing to release.
            live.waiting.retain_mut(&mut end);
        }
        tracing::info!(cleared, "queue cleared by an operator");
        cleared
    }
}
