//! Attention scores straight from the cache's key blocks, which hold their keys transposed: within
//! one KV head's block, value `d` of every key sits side by side (`[head_dim][block_size]`; see
//! [`crate::attention::AttentionShape`]). Part of [`super`]'s `unsafe`, under its invariants.
//!
//! Why transposed: with one key a row, a key's score is a dot product, and every one ended in a
//! horizontal sum per query head, which bound attention wherever the keys were cached (on an
//! Intel Xeon, one thread over keys in L2 read them at only 9–12 GB/s). Over a transposed block a
//! vector holds one value of 16 (8 on AVX2) consecutive keys, so each query value is broadcast
//! and multiplied into all their scores at once: the scores come out as vectors, with no
//! horizontal sum at all. The attention bench (`kernels/benches/attention.rs`, three
//! alternations): one thread over keys in L2 15.1–18.4 → 7.3–9.8 ms, two threads over a
//! 32-sequence step at context 256 (377 MB, from memory) 30.9–34.2 → 26.2–27.7 ms.
//!
//! A vector covers whole groups of 16 (or 8) slots of a block, also where a run starts or ends
//! inside one: the lanes outside the run (another part's keys, or slots not yet written, which
//! may hold anything) are computed and never stored. On AVX-512 a masked store leaves them out,
//! so its address may lie before the scores' start for lanes it masks off: masked-off lanes are
//! neither read nor written, and the address is formed with wrapping arithmetic.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::grouped_heads::weighted_rows_avx2_takes;
use super::{fits, has_avx2, has_avx512};

/// Keys `first..first + count` of one KV head's block, whose keys (and values) start at `base`
/// in the layer's caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRun {
    pub base: usize,
    pub first: usize,
    pub count: usize,
}

/// A SIMD loop of [`score_key_runs`] for one group size: queries, keys, values (to fetch), runs,
/// `dim`, `block_size`, scale, scores.
#[cfg(target_arch = "x86_64")]
type ScoreRunsKernel = unsafe fn(*const f32, *const f32, Option<*const f32>, &[KeyRun], usize, usize, f32, Scores);

/// `$kernel`'s instance for `$group` query heads, for groups of 1 to 8 (`None` beyond).
#[cfg(target_arch = "x86_64")]
macro_rules! score_runs_instance {
    ($kernel:ident, $group:expr) => {
        match $group {
            1 => Some($kernel::<1> as ScoreRunsKernel),
            2 => Some($kernel::<2> as ScoreRunsKernel),
            3 => Some($kernel::<3> as ScoreRunsKernel),
            4 => Some($kernel::<4> as ScoreRunsKernel),
            5 => Some($kernel::<5> as ScoreRunsKernel),
            6 => Some($kernel::<6> as ScoreRunsKernel),
            7 => Some($kernel::<7> as ScoreRunsKernel),
            8 => Some($kernel::<8> as ScoreRunsKernel),
            _ => None,
        }
    };
}

/// Runs ahead of the one being scored whose keys (and value rows) are fetched: a run of 16 keys
/// is scored in about the time a line takes to come from memory. Measured on an Intel Xeon
/// (`rivulet-worker-bench`, attention's share of a step, alternating runs): one sequence at
/// context 1024 2.8–3.9 ms with these fetches against 3.5–4.3 without and 3.3–4.0 for the
/// row-per-key scoring before; at 32 sequences, memory-bound, all three within the noise.
const RUNS_AHEAD: usize = 2;

/// `scores[g · total + i] = scale · q_g · key_i` for the `i`-th key of `runs` taken in order
/// (`total` the runs' keys in all) and query head `g` of a group (`queries` is `[group][dim]`,
/// `group = scores.len() / total`). Each run's key block is `[dim][block_size]` at its `base` of
/// `keys`. The key block [`RUNS_AHEAD`] runs on is fetched into L1 as a run is scored, and that
/// run's value rows (`base + key · dim` of `values`) into L2 for the weighted sum
/// ([`super::weighted_rows`]), unless its AVX2 loop fetches them itself.
#[allow(clippy::too_many_arguments)]
pub fn score_key_runs(
    queries: &[f32],
    keys: &[f32],
    values: &[f32],
    runs: &[KeyRun],
    dim: usize,
    block_size: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let total: usize = runs.iter().map(|r| r.count).sum();
    let group = scores.len().checked_div(total).unwrap_or(0);
    assert!(fits(scores.len(), total.checked_mul(group)) && fits(queries.len(), group.checked_mul(dim)));
    let slab = dim.checked_mul(block_size);
    assert!(runs
        .iter()
        .all(|r| r.first.checked_add(r.count).is_some_and(|end| end <= block_size)
            && fits(keys.len(), slab.and_then(|s| r.base.checked_add(s)))
            && fits(values.len(), slab.and_then(|s| r.base.checked_add(s)))));
    if total == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // The AVX2 weighted sum fetches its value rows itself (`weighted_rows_avx2_takes`).
        let (kernel, fetch_values) = if has_avx512() && block_size.is_multiple_of(16) {
            (score_runs_instance!(score_runs_avx512, group), true)
        } else if has_avx2() && block_size.is_multiple_of(8) {
            let fetch_values = has_avx512() || !weighted_rows_avx2_takes(group, dim);
            (score_runs_instance!(score_runs_avx2, group), fetch_values)
        } else {
            (None, false)
        };
        if let Some(kernel) = kernel.filter(|_| dim.is_multiple_of(4) && dim > 0) {
            let sink = Scores {
                first: scores.as_mut_ptr(),
                total,
            };
            let values = fetch_values.then_some(values.as_ptr());
            // SAFETY: the CPU has the kernel's features, `block_size` its multiple and `dim` a
            // positive multiple of 4 (checked just above); every run's key block (and value rows)
            // lies in `keys` (`values`), the queries hold `group · dim` values and `scores`
            // `group · total` (asserted).
            unsafe {
                kernel(
                    queries.as_ptr(),
                    keys.as_ptr(),
                    values,
                    runs,
                    dim,
                    block_size,
                    scale,
                    sink,
                )
            };
            return;
        }
    }
    let mut at = 0;
    for run in runs {
        let block = &keys[run.base..run.base + dim * block_size];
        for key in run.first..run.first + run.count {
            for g in 0..group {
                let q = &queries[g * dim..(g + 1) * dim];
                let dot: f32 = q.iter().enumerate().map(|(d, q)| q * block[d * block_size + key]).sum();
                scores[g * total + at] = scale * dot;
            }
            at += 1;
        }
    }
}

/// Where the kernels write: head `g`'s score of the run-ordered key `i` at `first + g · total + i`.
#[derive(Clone, Copy)]
struct Scores {
    first: *mut f32,
    total: usize,
}

/// Partial sums per query head: each head's sum over `dim` is split into this many chains (by
/// `d mod PARTS`), so that the FMAs' latency overlaps; fewer for bigger groups, whose heads are
/// already independent chains (and whose accumulators must fit the registers).
#[cfg(target_arch = "x86_64")]
const fn parts_for(group: usize) -> usize {
    match group {
        0..=3 => 4,
        4..=6 => 2,
        _ => 1,
    }
}

/// Fetches run `ahead`'s key block (from the line holding its first key) into L1 and, where
/// `values` is given, its value rows into L2.
///
/// # Safety
/// The run's key block and value rows lie inside `keys`' / `values`' allocations.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_run(keys: *const f32, values: Option<*const f32>, ahead: &KeyRun, dim: usize, block_size: usize) {
    // SAFETY (whole body): see above.
    unsafe {
        let first_line = ahead.first & !15;
        for at in (ahead.base + first_line..ahead.base + dim * block_size).step_by(16) {
            _mm_prefetch::<_MM_HINT_T0>(keys.add(at).cast());
        }
        if let Some(values) = values {
            let rows = ahead.base + ahead.first * dim;
            for at in (rows..rows + ahead.count * dim).step_by(16) {
                _mm_prefetch::<_MM_HINT_T1>(values.add(at).cast());
            }
        }
    }
}

/// [`score_key_runs`] on AVX-512 for `G` query heads, 16 keys a vector (the dispatch checked
/// that `block_size` is a multiple of 16 and `dim` a positive multiple of 4).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn score_runs_avx512<const G: usize>(
    queries: *const f32,
    keys: *const f32,
    values: Option<*const f32>,
    runs: &[KeyRun],
    dim: usize,
    block_size: usize,
    scale: f32,
    out: Scores,
) {
    // SAFETY (whole body): see `score_key_runs`.
    unsafe {
        let parts = parts_for(G);
        for run in runs.iter().take(RUNS_AHEAD) {
            prefetch_run(keys, values, run, dim, block_size);
        }
        let scale = _mm512_set1_ps(scale);
        let mut at = 0;
        for (index, run) in runs.iter().enumerate() {
            if let Some(ahead) = runs.get(index + RUNS_AHEAD) {
                prefetch_run(keys, values, ahead, dim, block_size);
            }
            let end = run.first + run.count;
            // Whole vectors of 16 keys from the one holding the run's first; the lanes outside
            // the run (keys of other parts, or slots not yet written) are computed and not stored.
            let mut lane = run.first & !15;
            while lane < end {
                let block = keys.add(run.base + lane);
                let mut acc = [[_mm512_setzero_ps(); 4]; G];
                for d in (0..dim).step_by(parts) {
                    for p in 0..parts {
                        let k = _mm512_loadu_ps(block.add((d + p) * block_size));
                        for (g, head) in acc.iter_mut().enumerate() {
                            let q = _mm512_set1_ps(*queries.add(g * dim + d + p));
                            head[p] = _mm512_fmadd_ps(q, k, head[p]);
                        }
                    }
                }
                let (from, to) = (run.first.max(lane) - lane, end.min(lane + 16) - lane);
                let mask = ((1u32 << to) - (1u32 << from)) as __mmask16;
                for (g, head) in acc.iter().enumerate() {
                    let sum = match parts {
                        4 => _mm512_add_ps(_mm512_add_ps(head[0], head[1]), _mm512_add_ps(head[2], head[3])),
                        2 => _mm512_add_ps(head[0], head[1]),
                        _ => head[0],
                    };
                    // Lane `j` is the run's key `lane + j`, the `at + lane + j − first`-th of all.
                    let row = out
                        .first
                        .wrapping_add(g * out.total + at + lane)
                        .wrapping_sub(run.first);
                    _mm512_mask_storeu_ps(row, mask, _mm512_mul_ps(scale, sum));
                }
                lane += 16;
            }
            at += run.count;
        }
    }
}

/// [`score_key_runs`] on AVX2 for `G` query heads, 8 keys a vector (the dispatch checked that
/// `block_size` is a multiple of 8 and `dim` a positive multiple of 4).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn score_runs_avx2<const G: usize>(
    queries: *const f32,
    keys: *const f32,
    values: Option<*const f32>,
    runs: &[KeyRun],
    dim: usize,
    block_size: usize,
    scale: f32,
    out: Scores,
) {
    // SAFETY (whole body): see `score_key_runs`.
    unsafe {
        let parts = parts_for(G);
        for run in runs.iter().take(RUNS_AHEAD) {
            prefetch_run(keys, values, run, dim, block_size);
        }
        let scale = _mm256_set1_ps(scale);
        let mut at = 0;
        for (index, run) in runs.iter().enumerate() {
            if let Some(ahead) = runs.get(index + RUNS_AHEAD) {
                prefetch_run(keys, values, ahead, dim, block_size);
            }
            let end = run.first + run.count;
            let mut lane = run.first & !7;
            while lane < end {
                let block = keys.add(run.base + lane);
                let mut acc = [[_mm256_setzero_ps(); 4]; G];
                for d in (0..dim).step_by(parts) {
                    for p in 0..parts {
                        let k = _mm256_loadu_ps(block.add((d + p) * block_size));
                        for (g, head) in acc.iter_mut().enumerate() {
                            let q = _mm256_broadcast_ss(&*queries.add(g * dim + d + p));
                            head[p] = _mm256_fmadd_ps(q, k, head[p]);
                        }
                    }
                }
                let (from, to) = (run.first.max(lane) - lane, end.min(lane + 8) - lane);
                let mut lanes = [0f32; 8];
                for (g, head) in acc.iter().enumerate() {
                    let sum = match parts {
                        4 => _mm256_add_ps(_mm256_add_ps(head[0], head[1]), _mm256_add_ps(head[2], head[3])),
                        2 => _mm256_add_ps(head[0], head[1]),
                        _ => head[0],
                    };
                    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_mul_ps(scale, sum));
                    let row = out.first.add(g * out.total + at + lane + from - run.first);
                    std::ptr::copy_nonoverlapping(lanes.as_ptr().add(from), row, to - from);
                }
                lane += 8;
            }
            at += run.count;
        }
    }
}
