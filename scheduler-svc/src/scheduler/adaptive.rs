//! Adaptive batching: a replica's token budget per step (`max_num_batched_tokens`) follows its
//! measured step time. During warm-up the budget ramps up from the floor to the configured
//! maximum; afterwards a step slower than the latency target shrinks it (prefill chunks get
//! smaller, so decoding sequences keep their pace), and a fast step that filled the budget to the
//! target utilisation grows it back (more prefill per step, so waiting prompts start sooner).
//! The floor is `max_num_seqs`: every running sequence can always decode.

use std::time::Duration;

/// `scheduler.adaptive_*` settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveBatching {
    /// The step time to keep near.
    pub target_step: Duration,
    /// Grow only after steps that used at least this share of the budget (there was demand).
    pub target_utilization: f64,
    /// Steps over which the budget ramps from the floor to the maximum.
    pub warmup_iterations: u32,
}

/// Shrink on a slow step, grow on a fast full one: multiplicative, so it settles in a few steps.
const SHRINK: f64 = 0.8;
const GROW: f64 = 1.25;

#[derive(Debug, Clone)]
pub struct TokenBudget {
    adaptive: Option<AdaptiveBatching>,
    floor: usize,
    max: usize,
    current: usize,
    steps: u32,
}

impl TokenBudget {
    /// `max` tokens per step, always (adaptive batching off).
    pub fn fixed(max: usize) -> Self {
        Self {
            adaptive: None,
            floor: max,
            max,
            current: max,
            steps: 0,
        }
    }

    /// Between `floor` and `max`, starting the warm-up at the floor.
    pub fn adaptive(config: AdaptiveBatching, floor: usize, max: usize) -> Self {
        let floor = floor.clamp(1, max.max(1));
        let mut budget = Self {
            adaptive: Some(config),
            floor,
            max,
            current: floor,
            steps: 0,
        };
        budget.current = budget.warmup_level().unwrap_or(max);
        budget
    }

    /// Tokens the next step may hold.
    pub fn current(&self) -> usize {
        self.current
    }

    /// The warm-up ramp's level for the next step, while warming up.
    fn warmup_level(&self) -> Option<usize> {
        let warmup = self.adaptive?.warmup_iterations;
        (self.steps < warmup).then(|| {
            let share = f64::from(self.steps + 1) / f64::from(warmup);
            (self.floor as f64 + share * (self.max - self.floor) as f64).round() as usize
        })
    }

    /// A step of `tokens` tokens took the worker `took`.
    pub fn observe(&mut self, tokens: usize, took: Duration) {
        let Some(config) = self.adaptive else { return };
        self.steps = self.steps.saturating_add(1);
        if let Some(level) = self.warmup_level() {
            self.current = level;
            return;
        }
        let next = if took > config.target_step {
            self.current as f64 * SHRINK
        } else if tokens as f64 >= config.target_utilization * self.current as f64 {
            self.current as f64 * GROW + 1.0
        } else {
            self.current as f64
        };
        self.current = (next.round() as usize).clamp(self.floor, self.max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> AdaptiveBatching {
        AdaptiveBatching {
            target_step: Duration::from_millis(100),
            target_utilization: 0.8,
            warmup_iterations: 4,
        }
    }

    #[test]
    fn fixed_never_moves() {
        let mut budget = TokenBudget::fixed(512);
        budget.observe(512, Duration::from_secs(5));
        assert_eq!(budget.current(), 512);
    }

    #[test]
    fn warms_up_then_follows_the_step_time_between_floor_and_max() {
        let mut budget = TokenBudget::adaptive(config(), 64, 512);
        let fast = Duration::from_millis(20);
        let slow = Duration::from_millis(300);
        // The ramp: a quarter of the way per step, whatever the steps measure.
        let mut ramp = vec![budget.current()];
        for _ in 0..4 {
            budget.observe(budget.current(), slow);
            ramp.push(budget.current());
        }
        assert_eq!(ramp, [176, 288, 400, 512, 410], "ramp 64→512, then a slow step shrinks");
        // Slow steps shrink it, never below the floor.
        for _ in 0..20 {
            budget.observe(budget.current(), slow);
        }
        assert_eq!(budget.current(), 64);
        // A fast step that used little of the budget changes nothing: there was no demand.
        budget.observe(10, fast);
        assert_eq!(budget.current(), 64);
        // Fast, full steps grow it back, never above the maximum.
        budget.observe(64, fast);
        assert_eq!(budget.current(), 81);
        for _ in 0..20 {
            budget.observe(budget.current(), fast);
        }
        assert_eq!(budget.current(), 512);
    }
}
