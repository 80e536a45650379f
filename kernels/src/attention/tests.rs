//! Attention's tests: KV writes land where the cache layout says, attention through scattered
//! blocks matches a dense f64 softmax(q·Kᵀ)·V however the work is split (whole pairs, pairs in
//! parts, a prompt chunk's runs), and the vectorized softmax matches per-head loops.

use super::*;
use crate::kv_values::{kv_cache_bytes, kv_value, pack_kv, unpack_kv};

/// Where the key (or value) row of KV head `kv_head` for the sequence's `index`-th token
/// starts, in values, found independently of `KeyRows::offsets_into`'s block walk (the cache is
/// `[blocks][kv_heads][block_size][head_dim]`).
fn kv_row_start(shape: AttentionShape, table: &[i64], index: usize, kv_head: usize) -> usize {
    let block = table[index / shape.block_size] as usize;
    let row = (block * shape.kv_heads + kv_head) * shape.block_size + index % shape.block_size;
    row * shape.head_dim
}

/// That row's values, unpacked.
fn kv_row(shape: AttentionShape, cache: &[u8], table: &[i64], index: usize, kv_head: usize) -> Vec<f32> {
    let at = kv_row_start(shape, table, index, kv_head);
    (at..at + shape.head_dim).map(|i| kv_value(cache, i)).collect()
}

/// `values` packed into a cache of their length (with its tail).
fn packed(values: &[f32]) -> Vec<u8> {
    let mut cache = vec![0u8; kv_cache_bytes(values.len())];
    crate::kv_values::pack_kv_row(values, &mut cache[..values.len() * KV_VALUE_BYTES]);
    cache
}

/// `x` as the cache keeps it.
fn rounded(x: f32) -> f32 {
    unpack_kv(pack_kv(x))
}

#[test]
fn write_kv_puts_each_tokens_heads_in_its_slot() {
    let shape = AttentionShape {
        heads: 6,
        kv_heads: 2,
        head_dim: 8,
        block_size: 4,
    };
    let (q_width, kv_width) = (shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim);
    // Two spare values after each row's `[q | k | v]`, as a wider row would have.
    let row_width = q_width + 2 * kv_width + 2;
    let slots = [13i64, 2, 7, 8, 0];
    let qkv: Vec<f32> = (0..slots.len() * row_width).map(|i| i as f32).collect();
    let blocks = 4;
    // A byte no write leaves alone by chance everywhere: the expected caches are this with each
    // written row's packed values put where the layout says, and nothing else changed.
    let mut keys = vec![0xABu8; kv_cache_bytes(blocks * shape.block_size * kv_width)];
    let mut values = keys.clone();
    let (mut expected_keys, mut expected_values) = (keys.clone(), values.clone());
    write_kv(shape, &qkv, row_width, &slots, &mut keys, &mut values);
    // Each slot of block `slot / block_size` as the block table `[0, 1, 2, 3]` reads it.
    let table = [0i64, 1, 2, 3];
    for (t, &slot) in slots.iter().enumerate() {
        let row = &qkv[t * row_width..(t + 1) * row_width];
        for kv_head in 0..shape.kv_heads {
            let key = &row[q_width + kv_head * shape.head_dim..][..shape.head_dim];
            let value = &row[q_width + kv_width + kv_head * shape.head_dim..][..shape.head_dim];
            let rounded_row = |r: &[f32]| r.iter().map(|&x| rounded(x)).collect::<Vec<f32>>();
            assert_eq!(kv_row(shape, &keys, &table, slot as usize, kv_head), rounded_row(key));
            assert_eq!(
                kv_row(shape, &values, &table, slot as usize, kv_head),
                rounded_row(value)
            );
            let at = kv_row_start(shape, &table, slot as usize, kv_head) * KV_VALUE_BYTES;
            for (d, (k, v)) in key.iter().zip(value).enumerate() {
                expected_keys[at + 3 * d..][..3].copy_from_slice(&pack_kv(*k));
                expected_values[at + 3 * d..][..3].copy_from_slice(&pack_kv(*v));
            }
        }
    }
    assert!(
        keys == expected_keys && values == expected_values,
        "a byte outside the written rows changed"
    );
}

/// Reference: dense attention in f64 over keys gathered in order.
fn reference(q: &[f32], keys: &[Vec<f32>], values: &[Vec<f32>], dim: usize) -> Vec<f64> {
    let scale = 1.0 / (dim as f64).sqrt();
    let scores: Vec<f64> = keys
        .iter()
        .map(|k| k.iter().zip(q).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale)
        .collect();
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let total: f64 = weights.iter().sum();
    (0..dim)
        .map(|d| weights.iter().zip(values).map(|(w, v)| w * v[d] as f64).sum::<f64>() / total)
        .collect()
}

#[test]
fn matches_dense_attention_through_scattered_blocks() {
    // 12: the portable path; 8, 24 and 16 up: whole vectors (AVX2 or AVX-512 where the CPU
    // has them); groups of 1 to 8 (each group size is its own instance of the SIMD loops).
    // Unsplit, and with every pair's keys split into parts of at least 2 or 3 keys (merged
    // by rescaling), as one or two decoding sequences are.
    let splits = [
        Split { tasks: 1, min_keys: 64 },
        Split { tasks: 64, min_keys: 2 },
        Split { tasks: 24, min_keys: 3 },
    ];
    for (heads, head_dim) in [
        (6, 12),
        (8, 16),
        (4, 32),
        (6, 64),
        (10, 128),
        (2, 64),
        (12, 8),
        (14, 24),
        (16, 16),
    ] {
        for split in splits {
            check_against_dense(heads, head_dim, split);
        }
    }
}

fn check_against_dense(heads: usize, head_dim: usize, split: Split) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let shape = AttentionShape {
        heads,
        kv_heads: 2,
        head_dim,
        block_size: 4,
    };
    let slots = 10 * shape.block_size;
    let width = shape.kv_heads * shape.head_dim;
    let mut random = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let keys = packed(&random(slots * width));
    let values = packed(&random(slots * width));
    // Two sequences in shuffled blocks: one decodes at position 9, one is an 11-token chunk
    // at positions 4..15 (its tokens see 5 to 15 keys: a run of `PROMPT_TILE_TOKENS` and a
    // shorter one, each scored in passes of several tokens where the CPU has AVX-512).
    let table_a = [7i64, 2, 9];
    let table_b = [3i64, 0, 5, 8];
    let tokens: Vec<TokenKeys<'_>> = std::iter::once(TokenKeys {
        block_table: &table_a,
        visible: 10,
    })
    .chain((5..=15).map(|visible| TokenKeys {
        block_table: &table_b,
        visible,
    }))
    .collect();
    let q_width = shape.heads * shape.head_dim;
    let stride = q_width + 5; // queries sit inside wider rows, as in a fused QKV output
    let queries = random(tokens.len() * stride);
    let mut out = vec![0f32; tokens.len() * q_width];
    attention_in_parts(shape, split, &queries, stride, &tokens, &keys, &values, &mut out);

    // The reference reads the values as the cache keeps them: what is checked here is the
    // attention arithmetic; what packing costs is `kv_values`' (and transformers') to check.
    let gather = |cache: &[u8], table: &[i64], n: usize, kv_head: usize| -> Vec<Vec<f32>> {
        (0..n).map(|i| kv_row(shape, cache, table, i, kv_head)).collect()
    };
    for (t, token) in tokens.iter().enumerate() {
        for head in 0..shape.heads {
            let kv_head = head / (shape.heads / shape.kv_heads);
            let q = &queries[t * stride + head * shape.head_dim..][..shape.head_dim];
            let expected = reference(
                q,
                &gather(&keys, token.block_table, token.visible, kv_head),
                &gather(&values, token.block_table, token.visible, kv_head),
                shape.head_dim,
            );
            let got = &out[t * q_width + head * shape.head_dim..][..shape.head_dim];
            for (g, e) in got.iter().zip(&expected) {
                assert!(
                    (*g as f64 - e).abs() < 1e-5,
                    "{split:?} token {t} head {head}: {g} vs {e}"
                );
            }
        }
    }
}

/// Each head's maximum, numerators and sum, for groups whose passes fit the stack (1, 3, 8)
/// and one that does not (9), over key counts that leave a partial pass or no whole one.
#[test]
fn softmax_numerators_match_per_head_loops() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for group in [1, 3, 8, 9] {
        for keys in [1, 5, 8, 17, 64, 100] {
            let scores: Vec<f32> = (0..keys * group).map(|_| rng.random_range(-30.0..30.0)).collect();
            let mut got = scores.clone();
            let (mut max, mut total) = (vec![f32::NEG_INFINITY; group], vec![0f32; group]);
            softmax_numerators(&mut got, group, &mut max, &mut total);
            for head in 0..group {
                let column = || scores.iter().skip(head).step_by(group).map(|&s| f64::from(s));
                let expected_max = column().fold(f64::NEG_INFINITY, f64::max);
                assert_eq!(f64::from(max[head]), expected_max, "group {group}, {keys} keys");
                let expected_total: f64 = column().map(|s| (s - expected_max).exp()).sum();
                let relative = (f64::from(total[head]) - expected_total).abs() / expected_total;
                assert!(relative < 1e-5, "group {group}, {keys} keys, head {head}: {relative}");
                for (key, s) in column().enumerate() {
                    let numerator = f64::from(got[key * group + head]);
                    assert!((numerator - (s - expected_max).exp()).abs() < 1e-6);
                }
            }
        }
    }
}
