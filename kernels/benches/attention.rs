//! Decode attention alone: `batch` sequences at `context` keys over `layers` layers' paged
//! caches (SmolLM2's 9 query heads, 3 KV heads of 64, blocks of 16 unless told), each layer's
//! cache visited `repeats` times a step; ms per step (the median of 15) and GB/s of keys and
//! values read.
//!
//! `cargo bench -p rivulet-kernels --bench attention [-- threads [batch [context [layers
//! [repeats [block_size]]]]]]` (defaults 2 32 256 30 1 16). The caches hold three bytes a value,
//! as the worker's do (`kv_values`). With 30 layers a 32-sequence step's 283 MB (377 MB as
//! f32, until the forty-first round) come from memory; `-- 1 4 256 1 100` keeps one 1.2 MB layer in L2 where L2
//! holds it (the Xeon's 2 MB; not Zen 4's 1 MB: `-- 1 2 256 1 200` there), which times the
//! arithmetic. Each timed step runs as the worker runs one, inside the pool with its other
//! threads awake (`install_awake`): until the fortieth round they slept between calls, and each
//! call paid rayon's hand-off (~30% of the thread's time in a profile on 2 vCPUs).
//! Block tables are shuffled, as a serving cache hands blocks out; `ATTENTION_IN_ORDER=1` gives
//! each sequence consecutive blocks instead. A second line times the same keys and values read
//! in the same runs and order with nothing computed (each run's successor fetched into L2, as
//! attention fetches its rows): the memory's ceiling for attention over a cache the caches do
//! not hold, and attention's time as a share of it.

use std::time::Instant;

use rayon::prelude::*;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rivulet_kernels::attention::{paged_attention, AttentionShape, TokenKeys};
use rivulet_kernels::awake::install_awake;
use rivulet_kernels::kv_values::{kv_cache_bytes, pack_kv_row, KV_VALUE_BYTES};
use rivulet_kernels::prefetch_l2;

fn arg(n: usize, default: usize) -> usize {
    std::env::args().nth(n).and_then(|a| a.parse().ok()).unwrap_or(default)
}

fn main() {
    let (threads, batch, context, layers, repeats) = (arg(1, 2), arg(2, 32), arg(3, 256), arg(4, 30), arg(5, 1));
    let block_size = arg(6, 16);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .start_handler(|_| rivulet_kernels::flush_subnormals_on_this_thread())
        .build()
        .expect("a pool");
    let shape = AttentionShape {
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
        block_size,
    };
    let blocks_per_seq = (context + 1).div_ceil(shape.block_size);
    let layer_len = batch * blocks_per_seq * shape.block_size * shape.kv_heads * shape.head_dim;
    let mut rng = StdRng::seed_from_u64(5);
    // Each layer's keys and values as the worker's cache keeps them: three bytes a value.
    let packed_layer = |rng: &mut StdRng| {
        let values: Vec<f32> = (0..layer_len).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut cache = vec![0u8; kv_cache_bytes(layer_len)];
        pack_kv_row(&values, &mut cache[..layer_len * KV_VALUE_BYTES]);
        cache
    };
    let caches: Vec<(Vec<u8>, Vec<u8>)> = (0..layers)
        .map(|_| (packed_layer(&mut rng), packed_layer(&mut rng)))
        .collect();
    let q_width = shape.heads * shape.head_dim;
    let queries: Vec<f32> = (0..batch * q_width).map(|_| rng.random_range(-1.0..1.0)).collect();
    // Blocks in a shuffled order, as a serving cache hands them out (ATTENTION_IN_ORDER=1 gives
    // each sequence consecutive blocks, which the hardware prefetchers follow across pages).
    let mut tables: Vec<i64> = (0..(batch * blocks_per_seq) as i64).collect();
    if std::env::var_os("ATTENTION_IN_ORDER").is_none() {
        for i in (1..tables.len()).rev() {
            tables.swap(i, rng.random_range(0..=i));
        }
    }
    let tokens: Vec<TokenKeys<'_>> = (0..batch)
        .map(|s| TokenKeys {
            block_table: &tables[s * blocks_per_seq..][..blocks_per_seq],
            visible: context,
        })
        .collect();
    let mut out = vec![0f32; batch * q_width];
    let bytes = (batch * context * shape.kv_heads * shape.head_dim * 2 * KV_VALUE_BYTES * layers * repeats) as f64;
    let median = median_step(&pool, &caches, layers * repeats, |k, v| {
        paged_attention(shape, &queries, q_width, &tokens, k, v, &mut out);
    });
    println!(
        "threads {threads} batch {batch} context {context} layers {layers} blocks of {block_size}: {:.2} ms/step, {:.1} GB/s ({:.1} MB)",
        median * 1e3,
        bytes / median / 1e9,
        bytes / 1e6
    );
    std::hint::black_box(&out);

    // The same bytes read in the same order with nothing computed: what this machine's memory
    // gives a read of scattered 4 KiB runs (a sequence's KV head in one block), the ceiling for
    // attention over a cache that does not fit the caches.
    let row = shape.block_size * shape.head_dim;
    // Each (sequence, KV head) pair's runs, `(offset, values)` a block (the last block's
    // visible keys only), found once: every layer's cache has the same layout.
    let unit_runs: Vec<Vec<(usize, usize)>> = (0..batch * shape.kv_heads)
        .map(|unit| {
            let (token, kv_head) = (&tokens[unit / shape.kv_heads], unit % shape.kv_heads);
            token.block_table[..context.div_ceil(shape.block_size)]
                .iter()
                .enumerate()
                .map(|(index, &block)| {
                    let keys = (context - index * shape.block_size).min(shape.block_size);
                    (
                        (block as usize * shape.kv_heads + kv_head) * row * KV_VALUE_BYTES,
                        keys * shape.head_dim * KV_VALUE_BYTES,
                    )
                })
                .collect()
        })
        .collect();
    let plain = median_step(&pool, &caches, layers * repeats, |k, v| {
        let total: u64 = unit_runs
            .par_iter()
            .map(|runs| u64::from(read_runs(k, runs)) + u64::from(read_runs(v, runs)))
            .sum();
        std::hint::black_box(total);
    });
    println!(
        "  the same bytes read in the same runs (a block's rows of one KV head), nothing computed: {:.2} ms/step, {:.1} GB/s (attention at {:.0}% of it)",
        plain * 1e3,
        bytes / plain / 1e9,
        100.0 * plain / median
    );
}

/// The median of 15 timings of one step: `visit` on `visits` layers' keys and values in turn,
/// run as the worker runs a step: inside `pool` with its other threads kept awake
/// (`install_awake`), so that no call hands off to a sleeping thread.
fn median_step(
    pool: &rayon::ThreadPool,
    caches: &[(Vec<u8>, Vec<u8>)],
    visits: usize,
    mut visit: impl FnMut(&[u8], &[u8]) + Send,
) -> f64 {
    let mut times: Vec<f64> = (0..15)
        .map(|_| {
            let started = Instant::now();
            install_awake(pool, || {
                for (k, v) in caches.iter().cycle().take(visits) {
                    visit(k, v);
                }
            });
            started.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// The sum of `runs` (each `(offset, bytes)` of `cache`), the next run fetched ahead into L2
/// as attention fetches its rows, in 64 lanes that the compiler vectorizes.
fn read_runs(cache: &[u8], runs: &[(usize, usize)]) -> u8 {
    let mut lanes = [0u8; 64];
    for (index, &(at, len)) in runs.iter().enumerate() {
        if let Some(&(next, next_len)) = runs.get(index + 1) {
            prefetch_l2(&cache[next..next + next_len]);
        }
        let run = &cache[at..at + len];
        for chunk in run.chunks_exact(64) {
            lanes.iter_mut().zip(chunk).for_each(|(l, x)| *l = l.wrapping_add(*x));
        }
        lanes
            .iter_mut()
            .zip(run.chunks_exact(64).remainder())
            .for_each(|(l, x)| *l = l.wrapping_add(*x));
    }
    lanes.iter().fold(0u8, |a, l| a.wrapping_add(*l))
}
