//! Sends the workload: each request at its arrival time, at most `max_concurrency` in flight.

use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::Semaphore;

use crate::backend::{Backend, RequestSettings};
use crate::dataset::BenchRequest;
use crate::metrics::RequestOutcome;

pub struct RunOptions {
    pub arrivals: Vec<Duration>,
    /// `None`: no limit beyond the arrival schedule.
    pub max_concurrency: Option<usize>,
    pub settings: RequestSettings,
    pub show_progress: bool,
}

/// Runs every request; returns the outcomes in request order and the run's duration (first send
/// to last completion).
pub async fn run(
    backend: &Backend,
    requests: &[BenchRequest],
    options: &RunOptions,
) -> (Vec<RequestOutcome>, Duration) {
    let progress = if options.show_progress {
        ProgressBar::new(requests.len() as u64).with_style(
            ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        )
    } else {
        ProgressBar::hidden()
    };
    let limit = Arc::new(Semaphore::new(
        options.max_concurrency.unwrap_or(Semaphore::MAX_PERMITS),
    ));
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(requests.len());
    for (request, &offset) in requests.iter().zip(&options.arrivals) {
        tokio::time::sleep_until((started + offset).into()).await;
        let permit = match limit.clone().acquire_owned().await {
            Ok(permit) => permit,
            Err(_) => break,
        };
        let (backend, request, progress) = (backend.clone(), request.clone(), progress.clone());
        let settings = options.settings;
        tasks.push(tokio::spawn(async move {
            let outcome = backend.send(&request, settings).await;
            drop(permit);
            progress.inc(1);
            outcome
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for task in tasks {
        outcomes.push(
            task.await
                .unwrap_or_else(|e| RequestOutcome::failed(format!("request task: {e}"))),
        );
    }
    let duration = started.elapsed();
    progress.finish_and_clear();
    (outcomes, duration)
}
