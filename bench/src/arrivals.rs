//! When each request is sent: all at once (`inf`) or as a seeded Poisson process.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The request rate of a run, in requests per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RequestRate {
    /// Every request is sent at time 0 (`--request-rate inf`); `--max-concurrency` paces them.
    Infinite,
    /// Poisson arrivals: exponential gaps with this mean rate.
    Poisson(f64),
}

impl std::str::FromStr for RequestRate {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.eq_ignore_ascii_case("inf") {
            return Ok(Self::Infinite);
        }
        match text.parse::<f64>() {
            Ok(rate) if rate.is_finite() && rate > 0.0 => Ok(Self::Poisson(rate)),
            _ => Err(format!("request rate must be `inf` or a positive number, not `{text}`")),
        }
    }
}

impl std::fmt::Display for RequestRate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Infinite => write!(f, "inf"),
            Self::Poisson(rate) => write!(f, "{rate}"),
        }
    }
}

impl serde::Serialize for RequestRate {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// Send offsets from the start of the run for `count` requests; the same seed gives the same times.
pub fn arrival_offsets(rate: RequestRate, count: usize, seed: u64) -> Vec<Duration> {
    match rate {
        RequestRate::Infinite => vec![Duration::ZERO; count],
        RequestRate::Poisson(rate) => {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut now = 0.0f64;
            (0..count)
                .map(|_| {
                    // Inverse-CDF sampling of Exp(rate); 1 − u is in (0, 1], so the log is finite.
                    let uniform: f64 = rng.random();
                    now += -(1.0 - uniform).ln() / rate;
                    Duration::from_secs_f64(now)
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn infinite_rate_sends_everything_at_once() {
        assert_eq!(arrival_offsets(RequestRate::Infinite, 3, 0), vec![Duration::ZERO; 3]);
    }

    #[test]
    fn poisson_gaps_have_the_requested_mean_and_spread() {
        let rate = 4.0;
        let count = 20_000;
        let offsets = arrival_offsets(RequestRate::Poisson(rate), count, 7);
        let mut previous = Duration::ZERO;
        let gaps: Vec<f64> = offsets
            .iter()
            .map(|&offset| {
                assert!(offset >= previous, "arrival times must not go backwards");
                let gap = (offset - previous).as_secs_f64();
                previous = offset;
                gap
            })
            .collect();
        let mean = gaps.iter().sum::<f64>() / count as f64;
        let variance = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / count as f64;
        // Exp(4): mean 0.25 s, standard deviation 0.25 s; the sample mean's error is 0.25/√20000.
        assert!(
            (mean - 0.25).abs() < 5.0 * 0.25 / (count as f64).sqrt(),
            "mean gap {mean}"
        );
        assert!((variance.sqrt() - 0.25).abs() < 0.01, "gap std {}", variance.sqrt());
        // Memorylessness: P(gap > mean) = e^-1.
        let above = gaps.iter().filter(|&&g| g > 0.25).count() as f64 / count as f64;
        assert!((above - (-1.0f64).exp()).abs() < 0.02, "share above the mean {above}");
    }

    #[test]
    fn the_seed_fixes_the_schedule() {
        let a = arrival_offsets(RequestRate::Poisson(2.0), 50, 1);
        assert_eq!(a, arrival_offsets(RequestRate::Poisson(2.0), 50, 1));
        assert_ne!(a, arrival_offsets(RequestRate::Poisson(2.0), 50, 2));
    }

    #[test]
    fn rate_parses_inf_and_rejects_nonsense() {
        assert_eq!("inf".parse::<RequestRate>(), Ok(RequestRate::Infinite));
        assert_eq!("2.5".parse::<RequestRate>(), Ok(RequestRate::Poisson(2.5)));
        assert!("0".parse::<RequestRate>().is_err());
        assert!("fast".parse::<RequestRate>().is_err());
    }
}
