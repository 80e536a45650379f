//! What one request measured, and the run's summary over all of them (vLLM's serving metrics).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The timings and counts of one request, as the client saw them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestOutcome {
    /// `None` when the request succeeded; the error otherwise.
    pub error: Option<String>,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    /// Time from sending the request to the first generated token.
    pub ttft: Duration,
    /// Time from sending the request to its last byte.
    pub e2e: Duration,
    /// Gaps between successive token-bearing messages after the first.
    pub inter_token_latencies: Vec<Duration>,
}

impl RequestOutcome {
    pub fn failed(error: impl Into<String>) -> Self {
        Self {
            error: Some(error.into()),
            ..Self::default()
        }
    }

    /// A completed request, from the times (since sending) its token-bearing messages arrived.
    pub fn completed(prompt_tokens: usize, output_tokens: usize, token_arrivals: &[Duration], e2e: Duration) -> Self {
        let (ttft, inter_token_latencies) = token_timings(token_arrivals);
        Self {
            error: None,
            prompt_tokens,
            output_tokens,
            ttft,
            e2e,
            inter_token_latencies,
        }
    }

    /// Time per output token after the first: (E2E − TTFT) / (tokens − 1); `None` below 2 tokens.
    pub fn tpot(&self) -> Option<Duration> {
        if self.output_tokens < 2 {
            return None;
        }
        let decode = self.e2e.saturating_sub(self.ttft);
        Some(decode / (self.output_tokens as u32 - 1))
    }
}

/// Arrival times of token-bearing messages → TTFT and inter-token gaps, relative to `sent_at`.
fn token_timings(arrivals_since_send: &[Duration]) -> (Duration, Vec<Duration>) {
    let ttft = arrivals_since_send.first().copied().unwrap_or_default();
    let gaps = arrivals_since_send
        .windows(2)
        .map(|pair| pair[1].saturating_sub(pair[0]))
        .collect();
    (ttft, gaps)
}

/// Mean and percentiles of one latency metric, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Distribution {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Distribution {
    pub fn of_millis(samples: impl IntoIterator<Item = Duration>) -> Self {
        let mut values: Vec<f64> = samples.into_iter().map(|d| d.as_secs_f64() * 1e3).collect();
        values.sort_by(f64::total_cmp);
        if values.is_empty() {
            return Self::default();
        }
        Self {
            mean: values.iter().sum::<f64>() / values.len() as f64,
            p50: percentile(&values, 50.0),
            p90: percentile(&values, 90.0),
            p99: percentile(&values, 99.0),
        }
    }
}

/// The `q`-th percentile of sorted values, interpolating linearly between closest ranks (numpy's
/// default, which vLLM's benchmark uses).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        1 => sorted[0],
        n => {
            let rank = (q / 100.0).clamp(0.0, 1.0) * (n - 1) as f64;
            let lower = rank.floor() as usize;
            let upper = rank.ceil() as usize;
            let weight = rank - lower as f64;
            sorted[lower] + (sorted[upper] - sorted[lower]) * weight
        }
    }
}

/// The run's figures, as printed in the table and written by `--json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft_ms: Distribution,
    pub tpot_ms: Distribution,
    pub itl_ms: Distribution,
    pub e2e_ms: Distribution,
}

impl Summary {
    /// Summarises the outcomes of a run that took `duration` from first send to last completion.
    pub fn from_outcomes(outcomes: &[RequestOutcome], duration: Duration) -> Self {
        let succeeded: Vec<&RequestOutcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
        let seconds = duration.as_secs_f64();
        let per_second = |count: usize| if seconds > 0.0 { count as f64 / seconds } else { 0.0 };
        let total_input_tokens = succeeded.iter().map(|o| o.prompt_tokens).sum();
        let total_output_tokens = succeeded.iter().map(|o| o.output_tokens).sum();
        Self {
            completed: succeeded.len(),
            failed: outcomes.len() - succeeded.len(),
            duration_s: seconds,
            total_input_tokens,
            total_output_tokens,
            request_throughput: per_second(succeeded.len()),
            output_throughput: per_second(total_output_tokens),
            total_token_throughput: per_second(total_input_tokens + total_output_tokens),
            ttft_ms: Distribution::of_millis(succeeded.iter().map(|o| o.ttft)),
            tpot_ms: Distribution::of_millis(succeeded.iter().filter_map(|o| o.tpot())),
            itl_ms: Distribution::of_millis(succeeded.iter().flat_map(|o| o.inter_token_latencies.iter().copied())),
            e2e_ms: Distribution::of_millis(succeeded.iter().map(|o| o.e2e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(value: u64) -> Duration {
        Duration::from_millis(value)
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let values = [1.0, 2.0, 3.0, 4.0];
        // numpy.percentile([1, 2, 3, 4], q) for q = 0, 50, 90, 99, 100.
        assert_eq!(percentile(&values, 0.0), 1.0);
        assert!((percentile(&values, 50.0) - 2.5).abs() < 1e-12);
        assert!((percentile(&values, 90.0) - 3.7).abs() < 1e-12);
        assert!((percentile(&values, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&values, 100.0), 4.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn distribution_sorts_before_taking_percentiles() {
        let distribution = Distribution::of_millis([ms(30), ms(10), ms(20)]);
        assert!((distribution.mean - 20.0).abs() < 1e-9);
        assert!((distribution.p50 - 20.0).abs() < 1e-9);
        assert!((distribution.p90 - 28.0).abs() < 1e-9);
    }

    #[test]
    fn tpot_excludes_the_first_token() {
        let outcome = RequestOutcome {
            output_tokens: 11,
            ttft: ms(100),
            e2e: ms(600),
            ..RequestOutcome::default()
        };
        assert_eq!(outcome.tpot(), Some(ms(50)));
        let single = RequestOutcome {
            output_tokens: 1,
            ..outcome.clone()
        };
        assert_eq!(single.tpot(), None);
    }

    #[test]
    fn token_timings_split_first_token_from_gaps() {
        let (ttft, gaps) = token_timings(&[ms(120), ms(150), ms(190), ms(190)]);
        assert_eq!(ttft, ms(120));
        assert_eq!(gaps, vec![ms(30), ms(40), ms(0)]);
        let (ttft, gaps) = token_timings(&[]);
        assert_eq!(ttft, Duration::ZERO);
        assert!(gaps.is_empty());
    }

    #[test]
    fn summary_counts_failures_apart_and_divides_by_duration() {
        let ok = RequestOutcome {
            prompt_tokens: 100,
            output_tokens: 5,
            ttft: ms(200),
            e2e: ms(600),
            inter_token_latencies: vec![ms(100); 4],
            error: None,
        };
        let outcomes = vec![ok.clone(), ok, RequestOutcome::failed("boom")];
        let summary = Summary::from_outcomes(&outcomes, Duration::from_secs(2));
        assert_eq!((summary.completed, summary.failed), (2, 1));
        assert_eq!(summary.total_output_tokens, 10);
        assert!((summary.request_throughput - 1.0).abs() < 1e-12);
        assert!((summary.output_throughput - 5.0).abs() < 1e-12);
        assert!((summary.total_token_throughput - 105.0).abs() < 1e-12);
        assert!((summary.tpot_ms.mean - 100.0).abs() < 1e-9);
        assert!((summary.itl_ms.p99 - 100.0).abs() < 1e-9);
        assert!((summary.e2e_ms.p50 - 600.0).abs() < 1e-9);
    }
}
