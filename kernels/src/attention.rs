//! Attention for every token of a step, read straight from the paged KV cache.
//!
//! A token at position `p` of its sequence attends to the sequence's keys `0..=p` — the same rule
//! for a decode token and for each token of a prompt chunk (that is the causal mask), so the two
//! are one code path. Keys are found through the sequence's block table as they are read; nothing
//! is gathered or padded. The query heads that share a KV head (grouped-query attention) are
//! scored together, so each key and value row is read once per group.
//!
//! Work is split over (token, KV head) pairs. When there are too few pairs to keep every thread
//! busy (one or two decoding sequences: SmolLM2's 3 KV heads on 2 threads left one thread with
//! two pairs and the other with one), each pair's keys are also split into parts scored in
//! parallel, each with its own maximum and sum, and the parts are merged by rescaling to the
//! common maximum (flash-decoding). The result is the same softmax, summed in another order.
//!
//! A prompt chunk's consecutive tokens read the same key rows (each sees one more), so where
//! the CPU has the loop for it they are scored in runs, each row once for the whole run
//! (`prompt_runs`): 2048-token prefills ~10% faster on a Zen 4 EPYC.

use rayon::prelude::*;

use crate::kv_values::{pack_kv_row, KV_VALUE_BYTES};
use crate::{exp_in_place, prompt_scores_take, score_keys, weighted_rows};

mod prompt_runs;

use prompt_runs::{attend_by_prompt_runs, same_prompt};

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

    /// Where KV head `kv_head`'s row of cache slot `slot` starts in a layer's keys (or values).
    ///
    /// The layout is `[blocks][kv_heads][block_size][head_dim]`: within a block, each KV head's
    /// rows are consecutive, so a (token, KV head) pair reads `block_size · head_dim` contiguous
    /// values per block. Why: with every slot's heads side by side (`[slots][kv_heads ·
    /// head_dim]`), a pair read a third of each 768-byte slot of SmolLM2's, and attention over
    /// a real context took a third of a 32-sequence step on Zen 3, reading at about half the
    /// memory's speed.
    pub fn cache_offset(&self, slot: usize, kv_head: usize) -> usize {
        let (block, within) = (slot / self.block_size, slot % self.block_size);
        ((block * self.kv_heads + kv_head) * self.block_size + within) * self.head_dim
    }
}

/// Writes each step token's key and value heads into its cache slot: row `t` of `qkv`
/// (`row_width` values) holds `[q | k | v]` with `shape.heads` query heads and `shape.kv_heads`
/// key and value heads, and its heads go to slot `slots[t]` of a layer's `keys` and `values`
/// (laid out as [`AttentionShape::cache_offset`] says, each value packed into three bytes:
/// [`crate::kv_values`]), so that the cache layout is known in this module alone. The caller
/// checked every slot lies in the cache.
pub fn write_kv(
    shape: AttentionShape,
    qkv: &[f32],
    row_width: usize,
    slots: &[i64],
    keys: &mut [u8],
    values: &mut [u8],
) {
    let dim = shape.head_dim;
    let (q_width, kv_width) = (shape.heads * dim, shape.kv_heads * dim);
    assert!(row_width >= q_width + 2 * kv_width && qkv.len() == slots.len() * row_width);
    let sources = qkv.chunks_exact(row_width).flat_map(|row| {
        let (k, v) = row[q_width..q_width + 2 * kv_width].split_at(kv_width);
        k.chunks_exact(dim).zip(v.chunks_exact(dim))
    });
    let destinations = slots
        .iter()
        .flat_map(|&slot| (0..shape.kv_heads).map(move |kv_head| shape.cache_offset(slot as usize, kv_head)));
    let row_bytes = dim * KV_VALUE_BYTES;
    for ((k, v), at) in sources.zip(destinations) {
        let at = at * KV_VALUE_BYTES;
        pack_kv_row(k, &mut keys[at..at + row_bytes]);
        pack_kv_row(v, &mut values[at..at + row_bytes]);
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

/// When a (token, KV head) pair's keys are split into parts.
#[derive(Debug, Clone, Copy)]
struct Split {
    /// Parallel tasks wanted in all; pairs are split only while there are fewer.
    tasks: usize,
    /// The fewest keys a part holds (below it, merging costs more than the parallelism gains).
    min_keys: usize,
}

/// Tasks per thread wanted, so that a slow core does not hold the step up.
const TASKS_PER_THREAD: usize = 4;

/// The fewest keys worth a part of their own.
const MIN_PART_KEYS: usize = 64;

/// `out[t]` (`heads · head_dim` values) = softmax(q·Kᵀ · scale) · V for each token `t`.
/// `queries` holds token `t`'s heads at `t · query_stride`; `keys`/`values` are the layer's cache,
/// laid out as [`AttentionShape::cache_offset`] says.
pub fn paged_attention(
    shape: AttentionShape,
    queries: &[f32],
    query_stride: usize,
    tokens: &[TokenKeys<'_>],
    keys: &[u8],
    values: &[u8],
    out: &mut [f32],
) {
    let split = Split {
        tasks: rayon::current_num_threads() * TASKS_PER_THREAD,
        min_keys: MIN_PART_KEYS,
    };
    attention_in_parts(shape, split, queries, query_stride, tokens, keys, values, out);
}

/// One task: keys `keys` (indices into the token's visible keys) of one (token, KV head) pair.
#[derive(Debug, Clone)]
struct Part {
    unit: usize,
    keys: std::ops::Range<usize>,
}

/// [`paged_attention`] with the given split. A part's result before normalization is, per query
/// head of the group, the largest score, the sum of `exp(score − max)` and the `exp`-weighted sum
/// of value rows.
#[allow(clippy::too_many_arguments)]
fn attention_in_parts(
    shape: AttentionShape,
    split: Split,
    queries: &[f32],
    query_stride: usize,
    tokens: &[TokenKeys<'_>],
    keys: &[u8],
    values: &[u8],
    out: &mut [f32],
) {
    let (group, head_dim) = (shape.group(), shape.head_dim);
    let group_width = group * head_dim;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let units = tokens.len() * shape.kv_heads;
    let parts_wanted = split.tasks.div_ceil(units.max(1)).max(1);
    let parts: Vec<Part> = (0..units)
        .flat_map(|unit| {
            let visible = tokens[unit / shape.kv_heads].visible;
            let count = parts_wanted.min(visible / split.min_keys.max(1)).max(1);
            let per_part = visible.div_ceil(count).max(1);
            (0..visible.max(1)).step_by(per_part).map(move |first| Part {
                unit,
                keys: first..(first + per_part).min(visible),
            })
        })
        .collect();
    if parts.len() == units
        && prompt_scores_take(group, head_dim)
        && tokens.windows(2).any(|w| same_prompt(&w[0], &w[1]))
    {
        // No pair was split, and some tokens are consecutive tokens of one prompt: those are
        // scored together (`prompt_runs`).
        attend_by_prompt_runs(shape, scale, queries, query_stride, tokens, keys, values, out);
        return;
    }
    if parts.len() == units {
        // No pair was split: each writes its normalized result straight into `out`.
        out[..units * group_width]
            .par_chunks_mut(group_width)
            .zip(parts.par_iter())
            .for_each(|(out_group, part)| {
                let rows = key_rows(shape, tokens, part);
                let query_group = query_group_of(queries, query_stride, group_width, shape, part.unit);
                SCRATCH.with_borrow_mut(|scratch| {
                    attend_whole(shape, scale, query_group, rows, keys, values, scratch, out_group)
                });
            });
        return;
    }
    // `[parts][group]` maxima and sums, `[parts][group_width]` weighted value sums.
    let mut maxima = vec![f32::NEG_INFINITY; parts.len() * group];
    let mut totals = vec![0f32; parts.len() * group];
    let mut sums = vec![0f32; parts.len() * group_width];
    parts
        .par_iter()
        .zip(maxima.par_chunks_mut(group))
        .zip(totals.par_chunks_mut(group))
        .zip(sums.par_chunks_mut(group_width))
        .for_each(|(((part, max), total), sum)| {
            let rows = key_rows(shape, tokens, part);
            let query_group = query_group_of(queries, query_stride, group_width, shape, part.unit);
            SCRATCH.with_borrow_mut(|scratch| {
                attend_part(
                    shape,
                    scale,
                    query_group,
                    rows,
                    keys,
                    values,
                    &mut scratch.0,
                    &mut scratch.1,
                    max,
                    total,
                    sum,
                )
            });
        });
    // Merge each pair's parts: rescale to the largest maximum, add, divide by the total. Here on
    // the calling thread: pairs are split only when there are fewer than the tasks wanted, and
    // their merge (a few hundred multiply-adds each) costs less than waking another thread.
    let parts_of_unit =
        |unit: usize| parts.partition_point(|p| p.unit < unit)..parts.partition_point(|p| p.unit <= unit);
    out[..units * group_width]
        .chunks_mut(group_width)
        .enumerate()
        .for_each(|(unit, out_group)| {
            let range = parts_of_unit(unit);
            for (g, out_head) in out_group.chunks_exact_mut(head_dim).enumerate() {
                let max = range
                    .clone()
                    .map(|p| maxima[p * group + g])
                    .fold(f32::NEG_INFINITY, f32::max);
                out_head.fill(0.0);
                let mut total = 0f32;
                for p in range.clone() {
                    // A part with no keys has an infinite negative maximum and contributes nothing.
                    let weight = if maxima[p * group + g] == f32::NEG_INFINITY {
                        0.0
                    } else {
                        (maxima[p * group + g] - max).exp()
                    };
                    total += weight * totals[p * group + g];
                    let part_sum = &sums[p * group_width + g * head_dim..][..head_dim];
                    out_head.iter_mut().zip(part_sum).for_each(|(o, s)| *o += weight * s);
                }
                let inverse = if total > 0.0 { total.recip() } else { 0.0 };
                out_head.iter_mut().for_each(|o| *o *= inverse);
            }
        });
}

/// An unsplit (token, KV head) pair: [`attend_part`] over all its keys, normalized into
/// `out_group`.
#[allow(clippy::too_many_arguments)]
fn attend_whole(
    shape: AttentionShape,
    scale: f32,
    query_group: &[f32],
    rows: KeyRows<'_>,
    keys: &[u8],
    values: &[u8],
    scratch: &mut Scratch,
    out_group: &mut [f32],
) {
    let group = shape.group();
    let (scores, offsets, stats) = (&mut scratch.0, &mut scratch.1, &mut scratch.2);
    stats.resize(2 * group, 0.0);
    let (max, total) = stats.split_at_mut(group);
    attend_part(
        shape,
        scale,
        query_group,
        rows,
        keys,
        values,
        scores,
        offsets,
        max,
        total,
        out_group,
    );
    normalize(out_group, total, shape.head_dim);
}

/// Divides each head's weighted sum by its softmax total.
fn normalize(out_group: &mut [f32], total: &[f32], head_dim: usize) {
    for (out_head, &total) in out_group.chunks_exact_mut(head_dim).zip(total.iter()) {
        let inverse = if total > 0.0 { total.recip() } else { 0.0 };
        out_head.iter_mut().for_each(|o| *o *= inverse);
    }
}

/// The key rows `part` reads.
fn key_rows<'a>(shape: AttentionShape, tokens: &[TokenKeys<'a>], part: &Part) -> KeyRows<'a> {
    KeyRows {
        shape,
        token: tokens[part.unit / shape.kv_heads],
        kv_head: part.unit % shape.kv_heads,
        keys: part.keys.clone(),
    }
}

/// The query heads of pair `unit` (token `unit / kv_heads`, KV head `unit % kv_heads`).
fn query_group_of(
    queries: &[f32],
    query_stride: usize,
    group_width: usize,
    shape: AttentionShape,
    unit: usize,
) -> &[f32] {
    let first = unit / shape.kv_heads * query_stride + unit % shape.kv_heads * group_width;
    &queries[first..first + group_width]
}

/// `[keys][group]` scores, the key/value rows' offsets and `[2][group]` maxima and sums.
type Scratch = (Vec<f32>, Vec<usize>, Vec<f32>);

thread_local! {
    /// Each thread's [`Scratch`], reused across calls.
    static SCRATCH: std::cell::RefCell<Scratch> = const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Which key rows a part reads: keys `keys` of what `token` sees, for KV head `kv_head`.
struct KeyRows<'a> {
    shape: AttentionShape,
    token: TokenKeys<'a>,
    kv_head: usize,
    keys: std::ops::Range<usize>,
}

impl KeyRows<'_> {
    /// Where each key (and value) row starts, block by block through the table: slots of one
    /// block are consecutive, so no per-key division.
    fn offsets_into(&self, offsets: &mut Vec<usize>) {
        let shape = self.shape;
        offsets.clear();
        // The caller checked that the table covers every visible key; were it short, the missing
        // keys would silently drop out of the softmax, so this stays a check in release builds.
        assert!(
            self.keys.end <= self.token.visible
                && self.token.visible.div_ceil(shape.block_size) <= self.token.block_table.len(),
            "block table shorter than the visible keys"
        );
        let mut key = self.keys.start;
        while key < self.keys.end {
            let (index, within) = (key / shape.block_size, key % shape.block_size);
            let count = (shape.block_size - within).min(self.keys.end - key);
            let first = shape.cache_offset(
                self.token.block_table[index] as usize * shape.block_size + within,
                self.kv_head,
            );
            offsets.extend((0..count).map(|row| first + row * shape.head_dim));
            key += count;
        }
    }
}

/// Scores `rows` for the query group, and writes the part's per-head maximum, sum of
/// `exp(score − max)` and `exp`-weighted sum of value rows.
#[allow(clippy::too_many_arguments)]
fn attend_part(
    shape: AttentionShape,
    scale: f32,
    query_group: &[f32],
    rows: KeyRows<'_>,
    keys: &[u8],
    values: &[u8],
    scores: &mut Vec<f32>,
    offsets: &mut Vec<usize>,
    max: &mut [f32],
    total: &mut [f32],
    sum: &mut [f32],
) {
    let group = shape.group();
    max.fill(f32::NEG_INFINITY);
    total.fill(0.0);
    rows.offsets_into(offsets);
    let count = offsets.len();
    if count == 0 {
        sum.fill(0.0);
        return; // max stays −∞: the merge gives the part no weight
    }
    // `[count][group]`: one key's scores for the whole group side by side.
    scores.clear();
    scores.resize(count * group, 0.0);
    score_keys(query_group, keys, values, offsets, shape.head_dim, scale, scores);
    softmax_numerators(scores, group, max, total);
    weighted_rows(scores, group, values, offsets, shape.head_dim, sum);
}

/// Keys taken per pass by [`softmax_numerators`]: `group · KEYS_PER_PASS` scores fill whole
/// vectors whatever the group, and each position of a pass always holds the same head.
const KEYS_PER_PASS: usize = 8;

/// The widest pass kept on the stack: groups of up to 8 query heads per KV head.
const MAX_PASS: usize = 8 * KEYS_PER_PASS;

/// Turns `scores` (`[keys][group]`) into each head's softmax numerators: finds each head's
/// maximum (into `max`, which starts at −∞), subtracts it, exponentiates, and sums (into `total`,
/// which starts at 0).
///
/// Why passes of `group · 8` scores: a loop over rows of `group` (3 for SmolLM2) does not
/// vectorize, and at 32 decoding sequences those three loops took ~5% of a step. Over whole
/// passes every position keeps one head's running maximum or sum, elementwise, which the compiler
/// vectorizes; the lanes are folded per head at the end (a sum in another order).
fn softmax_numerators(scores: &mut [f32], group: usize, max: &mut [f32], total: &mut [f32]) {
    let width = group * KEYS_PER_PASS;
    let whole = if width <= MAX_PASS {
        scores.len() / width * width
    } else {
        0
    };
    let (passes, rest) = scores.split_at_mut(whole);
    let mut lanes = [f32::NEG_INFINITY; MAX_PASS];
    for pass in passes.chunks_exact(width) {
        lanes.iter_mut().zip(pass).for_each(|(l, s)| *l = l.max(*s));
    }
    for row in lanes[..width.min(whole)]
        .chunks_exact(group)
        .chain(rest.chunks_exact(group))
    {
        max.iter_mut().zip(row).for_each(|(m, s)| *m = m.max(*s));
    }

    let mut pattern = [0f32; MAX_PASS];
    for (i, p) in pattern.iter_mut().take(width.min(whole)).enumerate() {
        *p = max[i % group];
    }
    for pass in passes.chunks_exact_mut(width) {
        pass.iter_mut().zip(&pattern).for_each(|(s, m)| *s -= m);
    }
    for row in rest.chunks_exact_mut(group) {
        row.iter_mut().zip(max.iter()).for_each(|(s, m)| *s -= m);
    }
    exp_in_place(scores);

    let (passes, rest) = scores.split_at(whole);
    let mut lanes = [0f32; MAX_PASS];
    for pass in passes.chunks_exact(width) {
        lanes.iter_mut().zip(pass).for_each(|(l, s)| *l += s);
    }
    for row in lanes[..width.min(whole)]
        .chunks_exact(group)
        .chain(rest.chunks_exact(group))
    {
        total.iter_mut().zip(row).for_each(|(t, s)| *t += s);
    }
}

#[cfg(test)]
mod tests;
