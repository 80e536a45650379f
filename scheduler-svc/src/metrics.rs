//! Prometheus metrics, served at `GET /metrics`. The names are vLLM's with the `rivulet:` prefix
//! (vLLM dashboards and autoscaling recipes carry over by the prefix), labelled with the served
//! model's name as vLLM's are; Rivulet's own (workers, restarts, step time split) follow them.
//!
//! Events are recorded where they happen — per request by the fronts' [`crate::api::tracking`],
//! per step by the engine — and the instantaneous figures (queue, KV usage, workers) are read from
//! the engine's stats at each scrape.

use std::collections::HashMap;

use prometheus::{
    exponential_buckets, Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};
use thiserror::Error;

use crate::replica::ReplicaState;
use crate::stats::StatsSnapshot;

#[derive(Debug, Error)]
#[error("metrics: {0}")]
pub struct MetricsError(#[from] prometheus::Error);

const PREFIX: &str = "rivulet:";

/// Latency buckets from 1 ms to ~2 min (vLLM's span).
fn latency_buckets() -> Vec<f64> {
    exponential_buckets(0.001, 2.0, 18).unwrap_or_default()
}

/// Token-count buckets from 1 to 65 536.
fn token_buckets() -> Vec<f64> {
    exponential_buckets(1.0, 2.0, 17).unwrap_or_default()
}

pub struct Metrics {
    registry: Registry,
    num_requests_running: IntGauge,
    num_requests_waiting: IntGauge,
    kv_cache_usage_perc: Gauge,
    workers: IntGaugeVec,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    pub prefix_cache_queries: IntCounter,
    pub prefix_cache_hits: IntCounter,
    pub preemptions: IntCounter,
    pub worker_restarts: IntCounter,
    request_success: IntCounterVec,
    pub time_to_first_token: Histogram,
    pub time_per_output_token: Histogram,
    pub request_time_per_output_token: Histogram,
    pub e2e_request_latency: Histogram,
    pub request_queue_time: Histogram,
    pub request_prompt_tokens: Histogram,
    pub request_generation_tokens: Histogram,
    pub iteration_tokens: Histogram,
    pub step_forward: Histogram,
    pub step_scheduler: Histogram,
    pub batch_utilization: Histogram,
    pub iteration_errors: IntCounter,
}

impl Metrics {
    pub fn new(model_name: &str) -> Result<Self, MetricsError> {
        let labels = HashMap::from([("model_name".to_owned(), model_name.to_owned())]);
        let registry = Registry::new_custom(None, Some(labels))?;
        let name = |short: &str| format!("{PREFIX}{short}");
        let gauge = |short: &str, help: &str| -> Result<IntGauge, MetricsError> {
            let metric = IntGauge::new(name(short), help)?;
            registry.register(Box::new(metric.clone()))?;
            Ok(metric)
        };
        let counter = |short: &str, help: &str| -> Result<IntCounter, MetricsError> {
            let metric = IntCounter::new(name(short), help)?;
            registry.register(Box::new(metric.clone()))?;
            Ok(metric)
        };
        let histogram = |short: &str, help: &str, buckets: Vec<f64>| -> Result<Histogram, MetricsError> {
            let metric = Histogram::with_opts(HistogramOpts::new(name(short), help).buckets(buckets))?;
            registry.register(Box::new(metric.clone()))?;
            Ok(metric)
        };
        let kv_cache_usage_perc = Gauge::new(name("kv_cache_usage_perc"), "KV cache usage: 1 = 100% of blocks in use")?;
        registry.register(Box::new(kv_cache_usage_perc.clone()))?;
        let workers = IntGaugeVec::new(Opts::new(name("workers"), "Worker replicas by state"), &["state"])?;
        registry.register(Box::new(workers.clone()))?;
        let request_success = IntCounterVec::new(
            Opts::new(name("request_success_total"), "Finished requests by finish reason"),
            &["finished_reason"],
        )?;
        registry.register(Box::new(request_success.clone()))?;
        Ok(Self {
            num_requests_running: gauge("num_requests_running", "Requests in a worker's batch")?,
            num_requests_waiting: gauge("num_requests_waiting", "Requests waiting to be scheduled")?,
            kv_cache_usage_perc,
            workers,
            prompt_tokens: counter("prompt_tokens_total", "Prompt tokens of requests that produced a token")?,
            generation_tokens: counter("generation_tokens_total", "Tokens generated")?,
            prefix_cache_queries: counter(
                "prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache",
            )?,
            prefix_cache_hits: counter("prefix_cache_hits_total", "Prompt tokens served from the prefix cache")?,
            preemptions: counter("num_preemptions_total", "Sequences preempted (to be recomputed)")?,
            worker_restarts: counter(
                "worker_restarts_total",
                "Worker processes started again after one failed",
            )?,
            request_success,
            time_to_first_token: histogram(
                "time_to_first_token_seconds",
                "From submission to the first token",
                latency_buckets(),
            )?,
            time_per_output_token: histogram(
                "time_per_output_token_seconds",
                "Time before each output token after a request's first (inter-token latency)",
                latency_buckets(),
            )?,
            request_time_per_output_token: histogram(
                "request_time_per_output_token_seconds",
                "Per request: mean time per output token after the first",
                latency_buckets(),
            )?,
            e2e_request_latency: histogram(
                "e2e_request_latency_seconds",
                "From submission to the last token",
                latency_buckets(),
            )?,
            request_queue_time: histogram(
                "request_queue_time_seconds",
                "From submission to first admission into a step",
                latency_buckets(),
            )?,
            request_prompt_tokens: histogram("request_prompt_tokens", "Prompt tokens per request", token_buckets())?,
            request_generation_tokens: histogram(
                "request_generation_tokens",
                "Generated tokens per request",
                token_buckets(),
            )?,
            iteration_tokens: histogram("iteration_tokens_total", "Tokens per engine step", token_buckets())?,
            step_forward: histogram(
                "step_forward_seconds",
                "The worker's execution of a step (forward pass and sampling)",
                latency_buckets(),
            )?,
            step_scheduler: histogram(
                "step_scheduler_seconds",
                "The engine's own work per step: planning, writing inputs, applying outputs",
                latency_buckets(),
            )?,
            batch_utilization: histogram(
                "batch_utilization",
                "Tokens per step as a share of the step's token budget (max_num_batched_tokens)",
                vec![0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0],
            )?,
            iteration_errors: counter(
                "iteration_errors_total",
                "Worker failures: a step that failed or missed its deadline, or a worker that died",
            )?,
            registry,
        })
    }

    /// Counts a finished request under OpenAI's words (`stop`, `length`, `abort`, `error`).
    pub fn record_finished(&self, reason: &str) {
        self.request_success.with_label_values(&[reason]).inc();
    }

    /// The text exposition, with the instantaneous figures taken from `stats`.
    pub fn render(&self, stats: &StatsSnapshot) -> Result<String, MetricsError> {
        self.num_requests_running.set(i64::from(stats.num_running));
        self.num_requests_waiting.set(i64::from(stats.num_waiting));
        let usage = if stats.kv_blocks_total == 0 {
            0.0
        } else {
            f64::from(stats.kv_blocks_used) / f64::from(stats.kv_blocks_total)
        };
        self.kv_cache_usage_perc.set(usage);
        for state in ReplicaState::ALL {
            let count = stats.replicas.iter().filter(|r| r.state == state).count();
            self.workers.with_label_values(&[state.label()]).set(count as i64);
        }
        let mut text = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut text)?;
        Ok(String::from_utf8_lossy(&text).into_owned())
    }
}
