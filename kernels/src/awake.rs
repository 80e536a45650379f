//! Keeping a rayon pool's threads awake for the length of one step.
//!
//! Why: a step is ~180 parallel regions (four projections, attention and SiLU·mul per layer)
//! with short one-thread stretches between them (norms, rotary embedding, KV writes). A rayon
//! thread that finds no work spins for only ~20 µs and then sleeps, so every stretch longer than
//! that put the other threads to sleep, and the next region started on one thread while a
//! futex woke the rest (tens of µs on a virtual CPU that halted): ~200 context switches per
//! step of 32 sequences on a 2-core Xeon, with a core idle ~20% of the time. Measured with
//! 8-task regions of 100 µs between 20 µs stretches: 165 µs per iteration asleep, 126 awake
//! (120 ideal).
//!
//! [`install_awake`] runs the step on the pool while every other thread of it loops on
//! [`rayon::yield_now`], running any job as soon as it is queued, and yielding the core to the
//! OS (`sched_yield`) when there is none, so that another process that is ready (the scheduler)
//! still runs. When the step returns they go back to rayon's sleep: nothing spins between steps.
//!
//! A loop also ends once it has found no job for [`IDLE_LIMIT`]. A loop is a job, and a rayon
//! thread waiting inside a join runs whatever job it finds: a thread that stole one of the
//! step's jobs before taking its loop (rayon looks for the loop first, but a steal can slip in
//! between) may run the loop inside that job, and a loop that lasted until the step ends would
//! wait for itself — a deadlock that hung a worker step, and the stress test below within
//! ~16 000 steps. Ending on idleness turns that rare case into one pause of [`IDLE_LIMIT`].
//! Making the step wait until every other thread is in its loop also fixes it, but puts their
//! wake-up (a futex, and on a virtual CPU often a halted vCPU) before every step's first
//! instruction instead of beside the step's first one-thread stretch.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a thread's loop runs without finding a job before it ends (see the module docs):
/// longer than a step's one-thread stretches (tens to hundreds of µs), short against a step.
pub const IDLE_LIMIT: Duration = Duration::from_millis(2);

/// Runs `work` inside `pool` with the pool's other threads awake and stealing its jobs until it
/// returns (or unwinds).
pub fn install_awake<R: Send>(pool: &rayon::ThreadPool, work: impl FnOnce() -> R + Send) -> R {
    pool.install(|| {
        let done = AtomicBool::new(false);
        let caller = rayon::current_thread_index();
        rayon::in_place_scope(|scope| {
            scope.spawn_broadcast(|_, context| {
                // The calling thread has the step to run (its own broadcast job returns at once).
                if Some(context.index()) == caller {
                    return;
                }
                let mut last_job = Instant::now();
                while !done.load(Ordering::Acquire) {
                    match rayon::yield_now() {
                        Some(rayon::Yield::Executed) => last_job = Instant::now(),
                        _ if last_job.elapsed() > IDLE_LIMIT => return,
                        _ => std::thread::yield_now(),
                    }
                }
            });
            // Set when `work` returns or panics: the scope waits for every broadcast job, so
            // the loops above must end either way.
            let _stop = Stop(&done);
            work()
        })
    })
}

/// Ends the loops of [`install_awake`] when dropped.
struct Stop<'a>(&'a AtomicBool);

impl Drop for Stop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn runs_parallel_work_and_returns_its_result() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("pool");
        let sum = install_awake(&pool, || {
            (0..20)
                .map(|round| (0..1000u64).into_par_iter().map(|i| i * round).sum::<u64>())
                .sum::<u64>()
        });
        assert_eq!(sum, (0..20u64).sum::<u64>() * (0..1000u64).sum::<u64>());
        // Again on the same pool: the threads left their loops.
        assert_eq!(install_awake(&pool, || 7), 7);
    }

    #[test]
    fn a_panic_in_the_step_ends_the_loops_and_reaches_the_caller() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("pool");
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            install_awake(&pool, || -> u32 { panic!("step failed") })
        }));
        assert!(outcome.is_err());
        assert_eq!(install_awake(&pool, || 3), 3, "the pool still runs steps");
    }

    #[test]
    fn a_one_thread_pool_runs_the_step_alone() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("pool");
        assert_eq!(install_awake(&pool, || (0..10).into_par_iter().sum::<i32>()), 45);
    }
}

#[cfg(test)]
mod stress {
    use super::*;
    use rayon::prelude::*;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    /// Steps back to back, each a parallel loop of one-item jobs (nested joins): before the
    /// loops ended on idleness, one of the threads ended up running its loop inside a stolen
    /// job of the step within ~16 000 steps, and no step finished again.
    #[test]
    fn back_to_back_steps_with_nested_joins_never_deadlock() {
        const STEPS: u64 = 60_000;
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("pool");
        let reached = Arc::new(AtomicU64::new(0));
        let progress = Arc::clone(&reached);
        std::thread::spawn(move || {
            for step in 0..STEPS {
                let sum = install_awake(&pool, || {
                    (0..64u32)
                        .into_par_iter()
                        .with_max_len(1)
                        .map(|i| u64::from(i) + step)
                        .sum::<u64>()
                });
                assert_eq!(sum, 64 * step + 2016);
                progress.store(step + 1, Ordering::Release);
            }
        });
        let mut last = 0;
        while last < STEPS {
            std::thread::sleep(std::time::Duration::from_secs(2));
            let now = reached.load(Ordering::Acquire);
            assert!(now > last, "no step finished in 2 s (after {now} steps)");
            last = now;
        }
    }
}
