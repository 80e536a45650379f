//! Engine statistics, owned by the engine loop and copied out on request.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::metrics::Metrics;

use crate::replica::{Replica, ReplicaSnapshot, ReplicaState};
use crate::scheduler::SchedulingPolicy;

#[derive(Debug, Clone, PartialEq)]
pub struct StatsSnapshot {
    pub total_tokens_generated: u64,
    /// Generated tokens per second since the window started.
    pub tokens_per_second: f64,
    pub window_seconds: f64,
    pub num_waiting: u32,
    pub num_running: u32,
    pub kv_blocks_total: u32,
    pub kv_blocks_used: u32,
    pub kv_blocks_free: u32,
    pub kv_blocks_cached: u32,
    /// 1 − (free + cached) / total.
    pub memory_pressure: f64,
    pub prefix_cache_hit_rate: f64,
    pub num_preemptions: u64,
    pub iterations: u64,
    pub step_micros_total: u64,
    pub worker_forward_micros_total: u64,
    pub scheduler_micros_total: u64,
    pub policy: SchedulingPolicy,
    pub num_replicas_ready: u32,
    pub replicas: Vec<ReplicaSnapshot>,
}

pub struct EngineStats {
    /// The Prometheus side of the same events.
    pub metrics: Arc<Metrics>,
    pub total_tokens_generated: u64,
    pub num_preemptions: u64,
    pub iterations: u64,
    /// Cumulative iteration timings, in microseconds (see `record_step`).
    pub step_micros_total: u64,
    pub worker_forward_micros_total: u64,
    pub scheduler_micros_total: u64,
    window_start: Instant,
    window_tokens: u64,
}

impl EngineStats {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            metrics,
            total_tokens_generated: 0,
            num_preemptions: 0,
            iterations: 0,
            step_micros_total: 0,
            worker_forward_micros_total: 0,
            scheduler_micros_total: 0,
            window_start: Instant::now(),
            window_tokens: 0,
        }
    }

    pub fn record_tokens(&mut self, tokens: u64) {
        self.total_tokens_generated += tokens;
        self.window_tokens += tokens;
        self.metrics.generation_tokens.inc_by(tokens);
    }

    /// What planning a step did besides the step: sequences it preempted, prompts it looked up
    /// in the prefix cache (at their first admission).
    pub fn record_planning(&mut self, prefix_queried: u64, prefix_hit: u64, preempted: usize) {
        self.num_preemptions += preempted as u64;
        self.metrics.preemptions.inc_by(preempted as u64);
        self.metrics.prefix_cache_queries.inc_by(prefix_queried);
        self.metrics.prefix_cache_hits.inc_by(prefix_hit);
    }

    /// A step handed to its worker, of `tokens` tokens out of a budget of `max_tokens`.
    pub fn record_step_planned(&mut self, tokens: usize, max_tokens: usize) {
        self.iterations += 1;
        self.metrics.iteration_tokens.observe(tokens as f64);
        self.metrics
            .batch_utilization
            .observe(tokens as f64 / max_tokens.max(1) as f64);
    }

    /// One iteration's timing: `step` from planning until its outputs were applied, `forward` the
    /// worker's own execution time, `scheduler` the engine's work (step minus forward minus IPC).
    pub fn record_step(&mut self, step: Duration, forward: Duration, scheduler: Duration) {
        self.step_micros_total += step.as_micros() as u64;
        self.worker_forward_micros_total += forward.as_micros() as u64;
        self.scheduler_micros_total += scheduler.as_micros() as u64;
        self.metrics.step_forward.observe(forward.as_secs_f64());
        self.metrics.step_scheduler.observe(scheduler.as_secs_f64());
    }

    pub fn reset_window(&mut self) {
        self.window_start = Instant::now();
        self.window_tokens = 0;
    }

    /// Copies the counters out, with the queue figures the engine passes in and the KV figures
    /// pooled over the replicas whose workers are up.
    pub fn snapshot(&self, num_unrouted: usize, replicas: &[Replica], policy: SchedulingPolicy) -> StatsSnapshot {
        let window_seconds = self.window_start.elapsed().as_secs_f64();
        let tokens_per_second = if window_seconds > 0.0 {
            self.window_tokens as f64 / window_seconds
        } else {
            0.0
        };
        let live = || replicas.iter().filter_map(|r| r.live.as_ref());
        let sum = |f: &dyn Fn(&crate::replica::live::LiveReplica) -> u32| live().map(f).sum::<u32>();
        let kv_blocks_total = sum(&|l| l.blocks.total());
        let kv_blocks_free = sum(&|l| l.blocks.num_free());
        let kv_blocks_cached = sum(&|l| l.blocks.num_cached());
        let (queried, hit) = live()
            .map(|l| l.blocks.prefix_lookup_counts())
            .fold((0, 0), |(q, h), (lq, lh)| (q + lq, h + lh));
        StatsSnapshot {
            total_tokens_generated: self.total_tokens_generated,
            tokens_per_second,
            window_seconds,
            num_waiting: (num_unrouted + live().map(|l| l.waiting.len()).sum::<usize>()) as u32,
            num_running: live().map(|l| l.running.len()).sum::<usize>() as u32,
            kv_blocks_total,
            kv_blocks_used: sum(&|l| l.blocks.num_used()),
            kv_blocks_free,
            kv_blocks_cached,
            memory_pressure: if kv_blocks_total == 0 {
                0.0
            } else {
                1.0 - f64::from(kv_blocks_free + kv_blocks_cached) / f64::from(kv_blocks_total)
            },
            prefix_cache_hit_rate: if queried == 0 { 0.0 } else { hit as f64 / queried as f64 },
            num_preemptions: self.num_preemptions,
            iterations: self.iterations,
            step_micros_total: self.step_micros_total,
            worker_forward_micros_total: self.worker_forward_micros_total,
            scheduler_micros_total: self.scheduler_micros_total,
            policy,
            num_replicas_ready: replicas.iter().filter(|r| r.state == ReplicaState::Ready).count() as u32,
            replicas: replicas.iter().map(Replica::snapshot).collect(),
        }
    }
}
