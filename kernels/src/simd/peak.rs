//! The CPU's fp32 FMA throughput on the widest vectors the kernels use: what a compute-bound
//! step could reach at best. Part of [`super`]'s `unsafe`, under its invariants (each
//! `target_feature` function runs only after its feature was detected).
//!
//! Why not libtorch's sgemm, as `rivulet-worker-bench` measured before: on AMD CPUs MKL runs its
//! AVX2 kernel, so on a Zen 5 EPYC with full-width AVX-512 it reached ~200 GFLOP/s where the FMA
//! units do ~510, and steps read as 110–150% of that "roofline".

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::time::{Duration, Instant};

use super::{has_avx2, has_avx512};

/// Independent FMA chains: enough to cover a 4-cycle latency at two FMAs per cycle, with slack.
const CHAINS: usize = 12;

/// FMAs per chain between clock readings.
const ROUND: usize = 1 << 16;

/// [`fma_peak_gflops_on`] for the calling thread alone.
fn fma_peak_gflops(duration: Duration) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        let (lanes, round): (usize, fn() -> f32) = if has_avx512() {
            // SAFETY: AVX-512F present.
            (16, || unsafe { chains_avx512() })
        } else if has_avx2() {
            // SAFETY: AVX2 and FMA present.
            (8, || unsafe { chains_avx2() })
        } else {
            return None;
        };
        round(); // warm the units up (clocks ramp on first use of wide vectors)
        let start = Instant::now();
        let mut rounds = 0usize;
        while start.elapsed() < duration {
            std::hint::black_box(round());
            rounds += 1;
        }
        let flops = (rounds * ROUND * CHAINS * lanes * 2) as f64;
        Some(flops / start.elapsed().as_secs_f64() / 1e9)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = duration;
        None
    }
}

/// GFLOP/s of fp32 FMAs on the widest vectors the kernels use (AVX-512 or AVX2), measured on
/// `threads` threads at once over about `duration` and summed: the machine's peak with that many
/// cores busy (clocks drop as more of them run wide vectors). `None` on CPUs where the kernels
/// run the portable path.
pub fn fma_peak_gflops_on(threads: usize, duration: Duration) -> Option<f64> {
    std::thread::scope(|scope| {
        let runs: Vec<_> = (0..threads.max(1))
            .map(|_| scope.spawn(move || fma_peak_gflops(duration)))
            .collect();
        runs.into_iter().map(|run| run.join().ok().flatten()).sum()
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn chains_avx512() -> f32 {
    let (scale, add) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
    let mut chains = [_mm512_set1_ps(1.0); CHAINS];
    for _ in 0..ROUND {
        for chain in &mut chains {
            *chain = _mm512_fmadd_ps(*chain, scale, add);
        }
    }
    chains.iter().map(|c| _mm512_reduce_add_ps(*c)).sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn chains_avx2() -> f32 {
    let (scale, add) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
    let mut chains = [_mm256_set1_ps(1.0); CHAINS];
    for _ in 0..ROUND {
        for chain in &mut chains {
            *chain = _mm256_fmadd_ps(*chain, scale, add);
        }
    }
    // SAFETY: AVX2 and FMA, as this function's.
    chains.iter().map(|c| unsafe { super::hsum(*c) }).sum()
}
