//! The engine loop: one thread that owns every piece of scheduling state — the waiting queue, the
//! running sequences, the block manager and the worker — and drives one iteration at a time
//! (DESIGN.md §2). gRPC handlers talk to it only through [`EngineHandle`]; no locks.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rivulet_ipc::layout::MAX_TOP_LOGPROBS;
use rivulet_ipc::{ReadyInfo, StepBuffer};
use thiserror::Error;
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tokio::sync::oneshot;

use crate::block_manager::{BlockManager, BlockManagerConfig};
use crate::completion::check_token_completion;
use crate::config::Config;
use crate::output_text::TextProgress;
use crate::queue::WaitingQueue;
use crate::queue_ticket::QueueTicket;
use crate::request::{
    EngineError, FinishReason, GenerationRequest, SamplingParams, SequenceEvent, TokenLogprob, Usage,
};
use crate::scheduler::{Scheduler, SchedulerLimits, SchedulingPolicy, StepPlan};
use crate::sequence::{Sequence, SequenceId};
use crate::stats::{EngineStats, StatsSnapshot};
use crate::step_writer::write_step;
use crate::tokenizer::ModelTokenizer;
use crate::worker_client::{WorkerClient, WorkerClientError};

/// How long after a failed worker restart the next one is tried.
const RESTART_BACKOFF: Duration = Duration::from_secs(5);

#[derive(Debug, Error)]
pub enum EngineStartError {
    #[error("starting the worker: {0}")]
    Worker(#[from] WorkerClientError),
    #[error("the worker's vocabulary ({worker}) differs from the tokenizer's ({tokenizer})")]
    VocabularyMismatch { worker: u32, tokenizer: u32 },
    #[error("starting the engine thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// What request validation needs to know about the served model.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    pub ready: ReadyInfo,
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
    /// Shutting down: refuse new requests; end those still running after `timeout`.
    Drain {
        timeout: Duration,
    },
}

/// A cheap, cloneable handle to the engine loop.
#[derive(Clone)]
pub struct EngineHandle {
    commands: UnboundedSender<EngineCommand>,
    /// Requests submitted and not yet admitted for the first time (the admission queue's depth).
    queued: Arc<AtomicUsize>,
    max_queued: usize,
    pub info: Arc<EngineInfo>,
}

impl EngineHandle {
    /// Queues a validated request; its events arrive on the returned receiver. Dropping the
    /// receiver cancels the request at the next iteration. A full queue is `QueueFull`.
    pub fn submit(&self, request: GenerationRequest) -> Result<UnboundedReceiver<SequenceEvent>, EngineError> {
        let queue_ticket = QueueTicket::take(&self.queued, self.max_queued).map_err(EngineError::QueueFull)?;
        let (events, receiver) = mpsc::unbounded_channel();
        // On failure the unsent command, ticket included, is dropped: the place comes back.
        self.commands
            .send(EngineCommand::Submit {
                request,
                events,
                queue_ticket,
            })
            .map_err(|_| EngineError::ShuttingDown)?;
        Ok(receiver)
    }

    pub async fn stats(&self) -> Result<StatsSnapshot, EngineError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(EngineCommand::GetStats { reply })
            .map_err(|_| EngineError::ShuttingDown)?;
        answer.await.map_err(|_| EngineError::ShuttingDown)
    }

    /// Starts a graceful shutdown: new requests are refused (`UNAVAILABLE`) and requests still
    /// running after `timeout` are ended with `UNAVAILABLE`.
    pub fn begin_drain(&self, timeout: Duration) {
        let _ = self.commands.send(EngineCommand::Drain { timeout });
    }

    /// Switches the scheduling policy from the next iteration on; returns the previous one.
    pub async fn set_policy(&self, policy: SchedulingPolicy) -> Result<SchedulingPolicy, EngineError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(EngineCommand::SetPolicy { policy, reply })
            .map_err(|_| EngineError::ShuttingDown)?;
        answer.await.map_err(|_| EngineError::ShuttingDown)
    }

    pub fn reset_stats_window(&self) -> Result<(), EngineError> {
        self.commands
            .send(EngineCommand::ResetStatsWindow)
            .map_err(|_| EngineError::ShuttingDown)
    }
}

/// Starts the worker (waiting for it to be ready) and the engine thread. The thread ends when
/// every [`EngineHandle`] is dropped, after finishing the requests it holds.
pub fn start(
    config: Config,
    tokenizer: Arc<ModelTokenizer>,
) -> Result<(EngineHandle, JoinHandle<()>), EngineStartError> {
    let worker = WorkerClient::spawn(&config)?;
    let ready = worker.ready().clone();
    if ready.model.vocab_size != tokenizer.vocab_size() {
        return Err(EngineStartError::VocabularyMismatch {
            worker: ready.model.vocab_size,
            tokenizer: tokenizer.vocab_size(),
        });
    }
    tracing::info!(?ready, "worker ready");
    let (commands, command_rx) = mpsc::unbounded_channel();
    let queued = Arc::new(AtomicUsize::new(0));
    let max_queued = config.scheduler.max_queued_requests as usize;
    let engine = Engine::new(config, worker, tokenizer, command_rx);
    let thread = std::thread::Builder::new()
        .name("engine".to_owned())
        .spawn(move || engine.run())?;
    let handle = EngineHandle {
        commands,
        queued,
        max_queued,
        info: Arc::new(EngineInfo { ready }),
    };
    Ok((handle, thread))
}

struct Engine {
    config: Config,
    worker: Option<WorkerClient>,
    last_restart: Instant,
    ready: ReadyInfo,
    tokenizer: Arc<ModelTokenizer>,
    scheduler: Scheduler,
    blocks: BlockManager,
    running: Vec<Sequence>,
    waiting: WaitingQueue,
    stats: EngineStats,
    commands: UnboundedReceiver<EngineCommand>,
    commands_open: bool,
    /// Set once a graceful shutdown began: when the remaining requests are ended.
    drain_deadline: Option<Instant>,
    next_id: SequenceId,
    step: u64,
}

impl Engine {
    fn new(
        config: Config,
        worker: WorkerClient,
        tokenizer: Arc<ModelTokenizer>,
        commands: UnboundedReceiver<EngineCommand>,
    ) -> Self {
        let ready = worker.ready().clone();
        let limits = SchedulerLimits {
            max_num_seqs: config.scheduler.max_num_seqs as usize,
            max_num_batched_tokens: config.scheduler.max_num_batched_tokens as usize,
        };
        let scheduler = Scheduler::new(limits, config.scheduler.policy);
        let block_config = BlockManagerConfig {
            reserved_block_ratio: config.scheduler.reserved_block_ratio,
            backpressure_threshold: config.scheduler.backpressure_threshold,
            prefix_cache: config.scheduler.prefix_cache,
            prefix_cache_ttl: config.scheduler.prefix_cache_ttl_seconds.map(Duration::from_secs),
        };
        Self {
            blocks: BlockManager::new(ready.num_blocks, ready.block_size, block_config),
            worker: Some(worker),
            last_restart: Instant::now(),
            ready,
            config,
            tokenizer,
            scheduler,
            running: Vec::new(),
            waiting: WaitingQueue::default(),
            stats: EngineStats::default(),
            commands,
            commands_open: true,
            drain_deadline: None,
            next_id: 1,
            step: 0,
        }
    }

    fn run(mut self) {
        loop {
            self.receive_commands();
            if !self.commands_open && self.is_idle() {
                break;
            }
            self.drop_abandoned();
            if self.drain_deadline.is_some_and(|deadline| Instant::now() >= deadline) && !self.is_idle() {
                tracing::warn!(
                    running = self.running.len(),
                    "shutdown timeout: ending the remaining requests"
                );
                self.fail_all(EngineError::ShuttingDown);
            }
            if self.is_idle() {
                continue;
            }
            if self.worker.is_none() && !self.restart_worker() {
                self.fail_all(EngineError::WorkerUnavailable("the worker is restarting".to_owned()));
                continue;
            }
            self.iterate();
        }
        tracing::info!("engine loop stopped");
    }

    fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Takes every queued command; when there is nothing to do, waits for one (no spinning).
    fn receive_commands(&mut self) {
        if self.is_idle() && self.commands_open {
            match self.commands.blocking_recv() {
                Some(command) => self.handle(command),
                None => self.commands_open = false,
            }
        }
        loop {
            match self.commands.try_recv() {
                Ok(command) => self.handle(command),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    self.commands_open = false;
                    break;
                }
            }
        }
    }

    fn handle(&mut self, command: EngineCommand) {
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
                let id = self.next_id;
                self.next_id += 1;
                self.waiting.push_back(Sequence::new(id, request, events, queue_ticket));
            }
            EngineCommand::GetStats { reply } => {
                let snapshot = self.stats.snapshot(
                    self.waiting.len(),
                    self.running.len(),
                    &self.blocks,
                    self.scheduler.policy,
                );
                let _ = reply.send(snapshot);
            }
            EngineCommand::SetPolicy { policy, reply } => {
                let previous = std::mem::replace(&mut self.scheduler.policy, policy);
                tracing::info!(?previous, ?policy, "scheduling policy changed");
                let _ = reply.send(previous);
            }
            EngineCommand::ResetStatsWindow => self.stats.reset_window(),
            EngineCommand::Drain { timeout } => {
                tracing::info!(running = self.running.len(), waiting = self.waiting.len(), "draining");
                self.drain_deadline = Some(Instant::now() + timeout);
            }
        }
    }

    /// Cancellation: a client that went away has its sequence removed and its blocks freed.
    fn drop_abandoned(&mut self) {
        let blocks = &mut self.blocks;
        self.running.retain_mut(|seq| {
            let keep = !seq.is_abandoned();
            if !keep {
                blocks.release(&mut seq.blocks);
                tracing::debug!(id = seq.id, "cancelled");
            }
            keep
        });
        self.waiting.retain_mut(|seq| {
            let keep = !seq.is_abandoned();
            if !keep {
                blocks.release(&mut seq.blocks);
            }
            keep
        });
    }

    fn iterate(&mut self) {
        let started = Instant::now();
        self.blocks.expire_cached(started);
        let plan = self
            .scheduler
            .plan(&mut self.running, &mut self.waiting, &mut self.blocks);
        self.stats.num_preemptions += plan.preempted as u64;
        if plan.seqs.is_empty() {
            // Nothing fits even alone: validation makes this unreachable, but never spin on it.
            if let Some(seq) = self.waiting.pop_front() {
                let _ = seq.events.send(SequenceEvent::Failed(EngineError::WorkerUnavailable(
                    "the request does not fit in the KV cache".to_owned(),
                )));
            }
            return;
        }
        self.step += 1;
        self.stats.iterations += 1;
        let Some(worker) = self.worker.as_mut() else { return };
        write_step(
            worker.buffer_mut(),
            self.step,
            &plan,
            &self.running,
            self.blocks.block_size(),
        );
        let planned = started.elapsed();
        match worker.run_step(self.step) {
            Ok(timing) => {
                let returned = Instant::now();
                self.apply_outputs(&plan);
                let applied = returned.elapsed();
                self.stats
                    .record_step(started.elapsed(), timing.worker, planned + applied);
            }
            Err(error) => self.on_worker_failure(error),
        }
    }

    fn apply_outputs(&mut self, plan: &StepPlan) {
        let Some(worker) = self.worker.as_ref() else { return };
        let buffer = worker.buffer();
        let sampled = buffer.i64_array(buffer.layout().sampled_tokens);
        let max_model_len = self.ready.max_model_len as usize;
        let mut finished: Vec<(usize, FinishReason, String, Vec<TokenLogprob>)> = Vec::new();
        let mut generated = 0;
        for (slot, scheduled) in plan.seqs.iter().enumerate() {
            let seq = &mut self.running[scheduled.running_index];
            seq.num_computed += scheduled.num_tokens;
            self.blocks
                .register_full_blocks(&seq.tokens, seq.num_computed, &seq.blocks, &mut seq.block_hashes);
            if !scheduled.sample {
                continue;
            }
            let token = sampled[slot] as u32;
            seq.tokens.push(token);
            generated += 1;
            let logprobs = read_logprobs(buffer, slot, token, &seq.request.sampling);
            let token_reason = check_token_completion(seq, &self.ready.eos_token_ids, max_model_len);
            let mut delta = match seq.detokenizer.push(&self.tokenizer, token) {
                Ok(text) => text,
                Err(error) => {
                    let _ = seq
                        .events
                        .send(SequenceEvent::Failed(EngineError::Detokenize(error.to_string())));
                    finished.push((
                        scheduled.running_index,
                        FinishReason::Cancelled,
                        String::new(),
                        Vec::new(),
                    ));
                    continue;
                }
            };
            if token_reason.is_some() {
                delta.push_str(&seq.detokenizer.flush(&self.tokenizer).unwrap_or_default());
            }
            let min_reached = seq.num_generated() >= seq.request.stopping.min_new_tokens as usize;
            let outcome = match (seq.output.push(&delta, min_reached), token_reason) {
                (TextProgress::Continue(text), None) => {
                    let _ = seq.events.send(SequenceEvent::Tokens {
                        token_ids: vec![token],
                        text,
                        logprobs,
                    });
                    continue;
                }
                (TextProgress::Continue(mut text), Some(reason)) => {
                    text.push_str(&seq.output.finish());
                    (reason, text)
                }
                (TextProgress::StopString(text) | TextProgress::CharLimit(text), Some(reason)) => (reason, text),
                (TextProgress::StopString(text), None) => (FinishReason::StopString, text),
                (TextProgress::CharLimit(text), None) => (FinishReason::Length, text),
            };
            finished.push((scheduled.running_index, outcome.0, outcome.1, logprobs));
        }
        self.stats.record_tokens(generated);
        // Remove from the back so earlier indices stay valid.
        finished.sort_unstable_by_key(|(index, ..)| std::cmp::Reverse(*index));
        for (index, reason, text, logprobs) in finished {
            let mut seq = self.running.remove(index);
            self.blocks.release(&mut seq.blocks);
            if reason == FinishReason::Cancelled {
                continue;
            }
            let usage = Usage {
                prompt_tokens: seq.prompt_len() as u32,
                completion_tokens: seq.num_generated() as u32,
                cached_prompt_tokens: seq.cached_prompt_tokens as u32,
            };
            let last_token = seq.tokens.last().copied().into_iter().collect();
            let _ = seq.events.send(SequenceEvent::Finished {
                reason,
                token_ids: last_token,
                text,
                usage,
                logprobs,
            });
        }
    }

    /// The worker died, hung or refused the step: the running requests fail with UNAVAILABLE,
    /// every block is freed, and a new worker is started. Waiting requests wait for it.
    fn on_worker_failure(&mut self, error: WorkerClientError) {
        tracing::error!(%error, "worker failed; restarting it");
        let message = error.to_string();
        for mut seq in self.running.drain(..) {
            self.blocks.release(&mut seq.blocks);
            let _ = seq
                .events
                .send(SequenceEvent::Failed(EngineError::WorkerUnavailable(message.clone())));
        }
        for seq in self.waiting.iter_mut() {
            self.blocks.release(&mut seq.blocks);
            seq.num_computed = 0;
        }
        self.worker = None;
        self.restart_worker();
    }

    fn restart_worker(&mut self) -> bool {
        if self.worker.is_some() {
            return true;
        }
        if self.last_restart.elapsed() < RESTART_BACKOFF && self.step > 0 {
            std::thread::sleep(RESTART_BACKOFF.saturating_sub(self.last_restart.elapsed()));
        }
        self.last_restart = Instant::now();
        match WorkerClient::spawn(&self.config) {
            Ok(worker)
                if worker.ready().num_blocks == self.ready.num_blocks
                    && worker.ready().block_size == self.ready.block_size =>
            {
                tracing::info!("worker restarted");
                self.worker = Some(worker);
                true
            }
            Ok(_) => {
                tracing::error!("restarted worker reports a different KV cache; not using it");
                false
            }
            Err(error) => {
                tracing::error!(%error, "worker restart failed");
                false
            }
        }
    }

    fn fail_all(&mut self, error: EngineError) {
        for mut seq in self.running.drain(..).chain(self.waiting.drain()) {
            self.blocks.release(&mut seq.blocks);
            let _ = seq.events.send(SequenceEvent::Failed(error.clone()));
        }
    }
}

/// The logprobs of the token sampled in `slot`, when the request asked for them.
fn read_logprobs(buffer: &StepBuffer, slot: usize, token: u32, sampling: &SamplingParams) -> Vec<TokenLogprob> {
    if !sampling.wants_logprobs() {
        return Vec::new();
    }
    let layout = buffer.layout();
    let row = slot * MAX_TOP_LOGPROBS;
    let count = sampling.top_logprobs as usize;
    let ids = &buffer.i64_array(layout.top_logprob_ids)[row..row + count];
    let values = &buffer.f32_array(layout.top_logprob_values)[row..row + count];
    let top = ids
        .iter()
        .zip(values)
        .map(|(&id, &logprob)| (id as u32, logprob))
        .collect();
    vec![TokenLogprob {
        token_id: token,
        logprob: buffer.f32_array(layout.sampled_logprobs)[slot],
        top,
    }]
}
