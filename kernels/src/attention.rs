//! Attention for every token of a step, read straight from the paged KV cache.
//!
//! A token at position `p` of its sequence attends to the sequence's keys `0..=p` — the same rule
//! for a decode token and for each token of a prompt chunk (that is the causal mask), so the two
//! are one code path. Keys are found through the sequence's block table as they are read; nothing
//! is gathered or padded. The query heads that share a KV head (grouped-query attention) are
//! scored together, so each key and value row is read once per group. Work is split over
//! (token, KV head) pairs, which gives even one decoding sequence a task per KV head.

use rayon::prelude::*;

use crate::{exp_in_place, group_dots, weighted_rows};

#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Tokens per KV block.
    pub block_size: usize,
}

impl AttentionShape {
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// What one token attends to: its sequence's block table and the keys visible to it (its
/// position + 1). The caller checked that the table covers `visible` keys and that every block
/// id in it lies inside the cache.
#[derive(Debug, Clone, Copy)]
pub struct TokenKeys<'a> {
    pub block_table: &'a [i64],
    pub visible: usize,
}

/// `out[t]` (`heads · head_dim` values) = softmax(q·Kᵀ · scale) · V for each token `t`.
/// `queries` holds token `t`'s heads at `t · query_stride`; `keys`/`values` are the layer's cache,
/// `[slots][kv_heads · head_dim]`.
pub fn paged_attention(
    shape: AttentionShape,
    queries: &[f32],
    query_stride: usize,
    tokens: &[TokenKeys<'_>],
    keys: &[f32],
    values: &[f32],
    out: &mut [f32],
) {
    let group_width = shape.group() * shape.head_dim;
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    out[..tokens.len() * shape.heads * shape.head_dim]
        .par_chunks_mut(group_width)
        .enumerate()
        .for_each(|(unit, out_group)| {
            let (token, kv_head) = (unit / shape.kv_heads, unit % shape.kv_heads);
            let first = token * query_stride + kv_head * group_width;
            let query_group = &queries[first..first + group_width];
            SCRATCH.with_borrow_mut(|(scores, offsets)| {
                attend_group(
                    shape,
                    scale,
                    query_group,
                    tokens[token],
                    kv_head,
                    keys,
                    values,
                    scores,
                    offsets,
                    out_group,
                )
            });
        });
}

/// How far ahead of the row being scored its key and value rows are prefetched.
const PREFETCH_ROWS_AHEAD: usize = 8;

thread_local! {
    /// `[visible][group]` scores and the value rows' offsets, reused across calls.
    static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<usize>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

#[allow(clippy::too_many_arguments)]
fn attend_group(
    shape: AttentionShape,
    scale: f32,
    query_group: &[f32],
    token: TokenKeys<'_>,
    kv_head: usize,
    keys: &[f32],
    values: &[f32],
    scores: &mut Vec<f32>,
    offsets: &mut Vec<usize>,
    out_group: &mut [f32],
) {
    let (group, visible) = (shape.group(), token.visible);
    // Where each visible key (and value) row starts, block by block through the table: slots
    // of one block are consecutive, so no per-key division.
    offsets.clear();
    let head_at = kv_head * shape.head_dim;
    for (index, &block) in token.block_table.iter().enumerate() {
        let first = index * shape.block_size;
        if first >= visible {
            break;
        }
        let base = block as usize * shape.block_size;
        let slots = base..base + shape.block_size.min(visible - first);
        offsets.extend(slots.map(|slot| slot * shape.kv_width() + head_at));
    }
    // The caller checked that the table covers every visible key; were it short, the missing
    // keys would silently drop out of the softmax, so this stays a check in release builds.
    assert_eq!(offsets.len(), visible, "block table shorter than the visible keys");
    // `[visible][group]`: one key's scores for the whole group side by side.
    scores.clear();
    scores.resize(visible * group, 0.0);
    for (index, (row, &at)) in scores.chunks_exact_mut(group).zip(offsets.iter()).enumerate() {
        // Key rows are a head's slice of each slot, so the hardware prefetcher does not follow
        // them (the scores waited on memory); value rows are fetched now for the weighted sum.
        if let Some(&ahead) = offsets.get(index + PREFETCH_ROWS_AHEAD) {
            crate::simd::prefetch(&keys[ahead..ahead + shape.head_dim]);
            crate::simd::prefetch(&values[ahead..ahead + shape.head_dim]);
        }
        group_dots(query_group, &keys[at..at + shape.head_dim], scale, row);
    }
    // Softmax per head: subtract each head's maximum, exponentiate the whole block at once
    // (vectorized), then normalize.
    let mut max = [f32::NEG_INFINITY; 16];
    let mut total = [0f32; 16];
    let (max, total) = (&mut max[..group.min(16)], &mut total[..group.min(16)]);
    if group > 16 {
        // More query heads per KV head than any model uses; keep it correct anyway.
        for g in 0..group {
            let m = (0..visible)
                .map(|t| scores[t * group + g])
                .fold(f32::NEG_INFINITY, f32::max);
            (0..visible).for_each(|t| scores[t * group + g] = (scores[t * group + g] - m).exp());
            let sum: f32 = (0..visible).map(|t| scores[t * group + g]).sum();
            (0..visible).for_each(|t| scores[t * group + g] /= sum);
        }
    } else {
        for row in scores.chunks_exact(group) {
            max.iter_mut().zip(row).for_each(|(m, s)| *m = m.max(*s));
        }
        for row in scores.chunks_exact_mut(group) {
            row.iter_mut().zip(max.iter()).for_each(|(s, m)| *s -= m);
        }
        exp_in_place(scores);
        for row in scores.chunks_exact(group) {
            total.iter_mut().zip(row).for_each(|(t, s)| *t += s);
        }
        for row in scores.chunks_exact_mut(group) {
            row.iter_mut().zip(total.iter()).for_each(|(s, t)| *s /= t);
        }
    }
    weighted_rows(scores, group, values, offsets, shape.head_dim, out_group);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key (or value) row of KV head `kv_head` for the sequence's `index`-th token, found
    /// independently of `attend_group`'s block walk.
    fn kv_row<'c>(shape: AttentionShape, cache: &'c [f32], table: &[i64], index: usize, kv_head: usize) -> &'c [f32] {
        let slot = table[index / shape.block_size] as usize * shape.block_size + index % shape.block_size;
        let at = slot * shape.kv_width() + kv_head * shape.head_dim;
        &cache[at..at + shape.head_dim]
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
        // 12: the portable path; 16: whole vectors (AVX2 where the CPU has it); groups of 3 and 4.
        for (heads, head_dim) in [(6, 12), (8, 16), (6, 64)] {
            check_against_dense(heads, head_dim);
        }
    }

    fn check_against_dense(heads: usize, head_dim: usize) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let shape = AttentionShape {
            heads,
            kv_heads: 2,
            head_dim,
            block_size: 4,
        };
        let slots = 10 * shape.block_size;
        let width = shape.kv_width();
        let mut random = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
        let keys = random(slots * width);
        let values = random(slots * width);
        // Two sequences in shuffled blocks: one decodes at position 9, one is a 3-token chunk
        // at positions 4..7 (its tokens see 5, 6 and 7 keys).
        let table_a = [7i64, 2, 9];
        let table_b = [3i64, 0];
        let tokens = [
            TokenKeys {
                block_table: &table_a,
                visible: 10,
            },
            TokenKeys {
                block_table: &table_b,
                visible: 5,
            },
            TokenKeys {
                block_table: &table_b,
                visible: 6,
            },
            TokenKeys {
                block_table: &table_b,
                visible: 7,
            },
        ];
        let q_width = shape.heads * shape.head_dim;
        let stride = q_width + 5; // queries sit inside wider rows, as in a fused QKV output
        let queries = random(tokens.len() * stride);
        let mut out = vec![0f32; tokens.len() * q_width];
        paged_attention(shape, &queries, stride, &tokens, &keys, &values, &mut out);

        let gather = |cache: &[f32], table: &[i64], n: usize, kv_head: usize| -> Vec<Vec<f32>> {
            (0..n)
                .map(|i| kv_row(shape, cache, table, i, kv_head).to_vec())
                .collect()
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
                    assert!((*g as f64 - e).abs() < 1e-5, "token {t} head {head}: {g} vs {e}");
                }
            }
        }
    }
}
