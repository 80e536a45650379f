//! Where a CPU step's wall time goes, phase by phase ([`crate::cpu_model::CpuModel::forward_timed`]).
//!
//! Why: a one-token step is ~150 short parallel regions, and a profiler's samples say which
//! functions ran, not how long each part of the step held the step up (a thread waiting for the
//! other is not in any kernel). The worker bench prints these shares (`RIVULET_BENCH_PHASES=1`);
//! the worker itself never times its phases (an untimed step reads no clock).

use std::time::Instant;

/// A part of the forward pass, in the order a layer runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Checking the step's inputs and looking up the tokens' embeddings.
    Embedding,
    /// The fused Q, K and V projection.
    Qkv,
    /// Rotary embedding of queries and keys, and the new keys and values into the cache.
    RotaryAndCacheWrite,
    /// Attention over the paged cache.
    Attention,
    /// The attention output projection.
    Output,
    /// RMSNorms (with the residual adds they fuse).
    Norms,
    /// The fused gate and up projection.
    GateUp,
    /// SiLU(gate) · up.
    SiluMul,
    /// The down projection.
    Down,
    /// The output head over the sampled rows (and its norm).
    Head,
}

impl Phase {
    pub const ALL: [Phase; 10] = [
        Phase::Embedding,
        Phase::Qkv,
        Phase::RotaryAndCacheWrite,
        Phase::Attention,
        Phase::Output,
        Phase::Norms,
        Phase::GateUp,
        Phase::SiluMul,
        Phase::Down,
        Phase::Head,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Embedding => "embedding",
            Phase::Qkv => "qkv",
            Phase::RotaryAndCacheWrite => "rope+kv write",
            Phase::Attention => "attention",
            Phase::Output => "o proj",
            Phase::Norms => "norms",
            Phase::GateUp => "gate+up",
            Phase::SiluMul => "silu·mul",
            Phase::Down => "down",
            Phase::Head => "head",
        }
    }
}

/// Seconds spent in each [`Phase`], summed over the steps timed.
#[derive(Debug, Clone, Default)]
pub struct StepPhases {
    seconds: [f64; Phase::ALL.len()],
    steps: usize,
}

impl StepPhases {
    /// Mean seconds per step of `phase`.
    pub fn mean_seconds(&self, phase: Phase) -> f64 {
        self.seconds[phase as usize] / self.steps.max(1) as f64
    }

    /// Mean seconds per step, every phase together.
    pub fn mean_step_seconds(&self) -> f64 {
        self.seconds.iter().sum::<f64>() / self.steps.max(1) as f64
    }
}

/// Charges the time since its last lap to a phase, or does nothing (an untimed step).
pub struct PhaseClock<'a> {
    timed: Option<(&'a mut StepPhases, Instant)>,
}

impl<'a> PhaseClock<'a> {
    pub fn untimed() -> Self {
        Self { timed: None }
    }

    /// Starts timing one more step into `phases`.
    pub fn timing(phases: &'a mut StepPhases) -> Self {
        phases.steps += 1;
        Self {
            timed: Some((phases, Instant::now())),
        }
    }

    /// The time since the previous lap (or the start) was spent in `phase`.
    pub fn lap(&mut self, phase: Phase) {
        if let Some((phases, last)) = &mut self.timed {
            let now = Instant::now();
            phases.seconds[phase as usize] += (now - *last).as_secs_f64();
            *last = now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_add_up_per_phase_and_untimed_steps_record_nothing() {
        let mut phases = StepPhases::default();
        for _ in 0..2 {
            let mut clock = PhaseClock::timing(&mut phases);
            std::thread::sleep(std::time::Duration::from_millis(2));
            clock.lap(Phase::Attention);
            clock.lap(Phase::Head);
        }
        PhaseClock::untimed().lap(Phase::Qkv);
        assert!(phases.mean_seconds(Phase::Attention) >= 0.002);
        assert!(phases.mean_seconds(Phase::Head) < phases.mean_seconds(Phase::Attention));
        assert_eq!(phases.mean_seconds(Phase::Qkv), 0.0);
        let total: f64 = Phase::ALL.iter().map(|&p| phases.mean_seconds(p)).sum();
        assert!((total - phases.mean_step_seconds()).abs() < 1e-12);
    }
}
