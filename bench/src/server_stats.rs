//! Rivulet's own account of where each iteration's time went, read from `Admin/GetStats` before and
//! after a run: the scheduler's share is the step time spent outside the worker's forward pass.

use rivulet::proto::admin_client::AdminClient;
use rivulet::proto::{GetStatsRequest, GetStatsResponse};
use serde::Serialize;

#[derive(clap::Args, Debug)]
pub struct WaitReadyArgs {
    /// Rivulet's Admin address (server.admin_listen).
    #[arg(long, default_value = "http://127.0.0.1:50052")]
    admin_url: String,
    /// Ready worker replicas to wait for.
    #[arg(long, default_value_t = 1)]
    replicas: u32,
    #[arg(long, default_value_t = 300)]
    timeout_secs: u64,
}

/// Polls `Admin/GetStats` until enough replicas are ready; an error after the timeout.
pub async fn wait_ready(args: &WaitReadyArgs) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(args.timeout_secs);
    let mut last = String::from("no answer");
    while std::time::Instant::now() < deadline {
        match stats(&args.admin_url).await {
            Ok(stats) if stats.num_replicas_ready >= args.replicas => return Ok(()),
            Ok(stats) => last = format!("{} of {} replicas ready", stats.num_replicas_ready, args.replicas),
            Err(status) => last = status.to_string(),
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    anyhow::bail!("{}: not ready after {} s ({last})", args.admin_url, args.timeout_secs)
}

async fn stats(url: &str) -> Result<GetStatsResponse, tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_owned())
        .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    Ok(AdminClient::new(channel)
        .get_stats(GetStatsRequest {})
        .await?
        .into_inner())
}

/// Cumulative step counters at one moment.
#[derive(Debug, Clone, Copy)]
pub struct StepCounters {
    iterations: u64,
    step_micros: u64,
    forward_micros: u64,
    scheduler_micros: u64,
}

pub async fn read(url: &str) -> Result<StepCounters, tonic::Status> {
    let stats = stats(url).await?;
    Ok(StepCounters {
        iterations: stats.iterations,
        step_micros: stats.step_micros_total,
        forward_micros: stats.worker_forward_micros_total,
        scheduler_micros: stats.scheduler_micros_total,
    })
}

/// The run's iterations: mean step time and the shares of it outside the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepCost {
    pub iterations: u64,
    pub mean_step_ms: f64,
    pub mean_forward_ms: f64,
    /// Planning, writing the step buffer and applying outputs, per step.
    pub mean_scheduler_ms: f64,
    /// Planning, writing the step buffer and applying outputs, over step time.
    pub scheduler_share: f64,
    /// Everything outside the forward pass (scheduler, IPC round trip, worker bookkeeping), over step time.
    pub outside_forward_share: f64,
}

impl StepCounters {
    pub fn since(&self, before: &StepCounters) -> StepCost {
        let iterations = self.iterations.saturating_sub(before.iterations);
        let step = self.step_micros.saturating_sub(before.step_micros) as f64;
        let forward = self.forward_micros.saturating_sub(before.forward_micros) as f64;
        let scheduler = self.scheduler_micros.saturating_sub(before.scheduler_micros) as f64;
        let per_iteration = |micros: f64| {
            if iterations > 0 {
                micros / iterations as f64 / 1e3
            } else {
                0.0
            }
        };
        let share = |micros: f64| if step > 0.0 { micros / step } else { 0.0 };
        StepCost {
            iterations,
            mean_step_ms: per_iteration(step),
            mean_forward_ms: per_iteration(forward),
            mean_scheduler_ms: per_iteration(scheduler),
            scheduler_share: share(scheduler),
            outside_forward_share: share(step - forward),
        }
    }
}

impl std::fmt::Display for StepCost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Rivulet steps: {} iterations, mean step {:.2} ms, mean forward {:.2} ms; scheduler {:.3} ms, {:.2}% of the \
             step, everything outside the forward pass {:.2}%",
            self.iterations,
            self.mean_step_ms,
            self.mean_forward_ms,
            self.mean_scheduler_ms,
            self.scheduler_share * 100.0,
            self.outside_forward_share * 100.0
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_is_the_difference_of_two_readings() {
        let before = StepCounters {
            iterations: 10,
            step_micros: 1_000,
            forward_micros: 900,
            scheduler_micros: 50,
        };
        let after = StepCounters {
            iterations: 110,
            step_micros: 101_000,
            forward_micros: 97_900,
            scheduler_micros: 2_050,
        };
        let cost = after.since(&before);
        assert_eq!(cost.iterations, 100);
        assert!((cost.mean_step_ms - 1.0).abs() < 1e-12);
        assert!((cost.mean_forward_ms - 0.97).abs() < 1e-12);
        assert!((cost.mean_scheduler_ms - 0.02).abs() < 1e-12);
        assert!((cost.scheduler_share - 0.02).abs() < 1e-12);
        assert!((cost.outside_forward_share - 0.03).abs() < 1e-12);
    }
}
