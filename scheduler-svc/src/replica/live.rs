//! The state of a replica whose worker is up: its block manager (with the prefix cache inside),
//! its resident and waiting sequences, its scheduler and its step buffer. Built when the worker
//! reports ready and dropped when the worker goes, so no cache entry can outlive the KV it names.
//!
//! A step is planned and written here, run by the driver, and its outputs applied here. While a
//! step is in flight, `running` is not touched (the plan refers to its indices); `waiting` may be.

use std::time::{Duration, Instant};

use rivulet_ipc::{ReadyInfo, StepBuffer};

use crate::block_manager::{BlockManager, BlockManagerConfig};
use crate::completion;
use crate::queue::WaitingQueue;
use crate::request::{EngineError, SequenceEvent};
use crate::scheduler::adaptive::TokenBudget;
use crate::scheduler::{Scheduler, SchedulerLimits, SchedulingPolicy, StepPlan};
use crate::sequence::Sequence;
use crate::stats::EngineStats;
use crate::step_writer::StepWriter;
use crate::tokenizer::ModelTokenizer;
use crate::worker_client::StepTiming;

use super::outbox::Outbox;
use super::outputs::{apply_outputs, OutputContext};

pub struct LiveReplica {
    pub ready: ReadyInfo,
    pub blocks: BlockManager,
    pub scheduler: Scheduler,
    pub running: Vec<Sequence>,
    pub waiting: WaitingQueue,
    /// Tokens per step: fixed, or adapted to the measured step time.
    budget: TokenBudget,
    /// With the engine between steps; with the driver while one runs.
    buffer: Option<Box<StepBuffer>>,
    writer: StepWriter,
    in_flight: Option<InFlight>,
    last_step: u64,
}

struct InFlight {
    step: u64,
    plan: StepPlan,
    started: Instant,
    planned: Duration,
}

impl LiveReplica {
    pub fn new(
        ready: ReadyInfo,
        buffer: Box<StepBuffer>,
        limits: SchedulerLimits,
        policy: SchedulingPolicy,
        block_config: BlockManagerConfig,
        budget: TokenBudget,
    ) -> Self {
        Self {
            budget,
            blocks: BlockManager::new(ready.num_blocks, ready.block_size, block_config),
            ready,
            scheduler: Scheduler::new(limits, policy),
            running: Vec::new(),
            waiting: WaitingQueue::default(),
            buffer: Some(buffer),
            writer: StepWriter::default(),
            in_flight: None,
            last_step: 0,
        }
    }

    pub fn is_stepping(&self) -> bool {
        self.in_flight.is_some()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn num_sequences(&self) -> usize {
        self.running.len() + self.waiting.len()
    }

    /// Tokens its KV cache holds.
    pub fn capacity_tokens(&self) -> usize {
        self.ready.num_blocks as usize * self.ready.block_size as usize
    }

    /// Whether its KV cache could hold `seq` to its end (alone, if need be).
    pub fn can_ever_hold(&self, seq: &Sequence) -> bool {
        let remaining = (seq.request.stopping.max_new_tokens as usize).saturating_sub(seq.num_generated());
        seq.tokens.len() + remaining <= self.capacity_tokens()
    }

    /// KV blocks left once its waiting sequences got theirs: the routing measure of room.
    pub fn room_after_queue(&self) -> i64 {
        let queued: i64 = self
            .waiting
            .iter()
            .map(|seq| i64::from(self.blocks.blocks_for(seq.tokens.len())))
            .sum();
        i64::from(self.blocks.num_available()) - queued
    }

    /// Plans the next step and writes it into the step buffer; returns its number and the buffer
    /// for the driver, or `None` when there is nothing to run. A sequence that cannot run at all
    /// is failed through `outbox`, behind what its client has not been sent yet.
    pub fn begin_step(&mut self, stats: &mut EngineStats, outbox: &mut Outbox) -> Option<(u64, Box<StepBuffer>)> {
        if self.is_stepping() || !self.has_work() {
            return None;
        }
        let started = Instant::now();
        self.blocks.expire_cached(started);
        self.scheduler.limits.max_num_batched_tokens = self.budget.current();
        let (queried_before, hit_before) = self.blocks.prefix_lookup_counts();
        let plan = self
            .scheduler
            .plan(&mut self.running, &mut self.waiting, &mut self.blocks);
        let (queried, hit) = self.blocks.prefix_lookup_counts();
        stats.record_planning(queried - queried_before, hit - hit_before, plan.preempted);
        if plan.seqs.is_empty() {
            // Nothing fits even alone (a cache smaller than validation assumed): never spin on it.
            if let Some(seq) = self.waiting.pop_front() {
                let capacity = self.capacity_tokens();
                let error = EngineError::WorkerUnavailable(format!(
                    "the request ({} tokens) does not fit in this worker's KV cache of {capacity} tokens",
                    seq.tokens.len()
                ));
                outbox.push(seq.events, SequenceEvent::Failed(error));
            }
            return None;
        }
        let mut buffer = self.buffer.take()?;
        self.last_step += 1;
        stats.record_step_planned(plan.num_tokens, self.scheduler.limits.max_num_batched_tokens);
        self.writer.write(
            &mut buffer,
            self.last_step,
            &plan,
            &self.running,
            self.blocks.block_size(),
            &self.ready.eos_token_ids,
        );
        self.in_flight = Some(InFlight {
            step: self.last_step,
            plan,
            started,
            planned: started.elapsed(),
        });
        Some((self.last_step, buffer))
    }

    /// Applies the outputs of a step the worker finished, the clients' events into `outbox`.
    pub fn finish_step(
        &mut self,
        step: u64,
        buffer: Box<StepBuffer>,
        timing: StepTiming,
        tokenizer: &ModelTokenizer,
        stats: &mut EngineStats,
        outbox: &mut Outbox,
    ) {
        let returned = Instant::now();
        let Some(in_flight) = self.in_flight.take_if(|f| f.step == step) else {
            return; // not this incarnation's step: its buffer is not ours
        };
        let context = OutputContext {
            tokenizer,
            eos_token_ids: &self.ready.eos_token_ids,
            max_model_len: self.ready.max_model_len as usize,
        };
        self.budget.observe(in_flight.plan.num_tokens, timing.worker);
        let generated = apply_outputs(
            &mut self.running,
            &mut self.blocks,
            &in_flight.plan,
            &buffer,
            &context,
            outbox,
        );
        stats.record_tokens(generated);
        stats.record_step(
            in_flight.started.elapsed(),
            timing.worker,
            in_flight.planned + returned.elapsed(),
        );
        self.buffer = Some(buffer);
    }

    /// Cancellation: sequences whose client went away leave, with their blocks released.
    /// Resident ones only between steps (a step in flight refers to them by index).
    pub fn drop_abandoned(&mut self) {
        let blocks = &mut self.blocks;
        if self.in_flight.is_none() {
            self.running.retain_mut(|seq| {
                let keep = !completion::is_abandoned(seq);
                if !keep {
                    seq.release_kv(blocks);
                    tracing::debug!(request_id = %seq.request.id, "cancelled");
                }
                keep
            });
        }
        self.waiting.retain_mut(|seq| {
            let keep = !completion::is_abandoned(seq);
            if !keep {
                seq.release_kv(blocks);
            }
            keep
        });
    }

    /// Takes every waiting sequence out (they hold no blocks: waiting ones never do).
    pub fn take_waiting(&mut self) -> Vec<Sequence> {
        self.waiting.drain().collect()
    }

    /// Takes the `count` waiting sequences that would be admitted last.
    pub fn take_last_waiting(&mut self, count: usize) -> Vec<Sequence> {
        let ids: Vec<_> = self.waiting.iter().map(|seq| seq.id).collect();
        let last = &ids[ids.len().saturating_sub(count)..];
        last.iter().filter_map(|&id| self.waiting.remove(id)).collect()
    }

    /// Ends every sequence with `error`. Resident ones in a step still out stay until it returns
    /// (the step writes their rows), but their clients are told now: a hung worker's step may
    /// never return, and the server's shutdown must not wait on it. Their events then go to a
    /// closed channel, so the engine drops them as abandoned once the step is back.
    pub fn fail_all(&mut self, error: &EngineError) {
        let blocks = &mut self.blocks;
        let resident = if self.in_flight.is_none() {
            std::mem::take(&mut self.running)
        } else {
            // Those told already (at an earlier pass) hold the closed channel.
            for seq in self.running.iter_mut().filter(|seq| !seq.events.is_closed()) {
                let (closed, _) = tokio::sync::mpsc::unbounded_channel();
                let client = std::mem::replace(&mut seq.events, closed);
                let _ = client.send(SequenceEvent::Failed(error.clone()));
            }
            Vec::new()
        };
        for mut seq in resident.into_iter().chain(self.waiting.drain()) {
            seq.release_kv(blocks);
            let _ = seq.events.send(SequenceEvent::Failed(error.clone()));
        }
    }

    /// The worker is gone with its KV: every sequence leaves, to be recomputed elsewhere from its
    /// prompt and generated tokens. Its stream continues where it was.
    pub fn evacuate(mut self) -> Vec<Sequence> {
        let mut sequences: Vec<Sequence> = self.running.drain(..).chain(self.waiting.drain()).collect();
        for seq in &mut sequences {
            seq.forget_kv();
        }
        sequences
    }
}
