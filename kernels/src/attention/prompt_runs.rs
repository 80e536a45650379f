//! Attention for runs of consecutive tokens of one prompt (a prompt chunk's), scored together:
//! every token of a run reads the same key rows (each sees one more), so one pass over them
//! scores the whole run ([`score_prompt_keys`]), sharing each row's loads and the reductions of
//! its sums. The softmax and the weighted sum of values stay per token, as for any other token.

use rayon::prelude::*;

use super::{attend_whole, normalize, softmax_numerators, AttentionShape, KeyRows, TokenKeys, SCRATCH};
use crate::{score_prompt_keys, weighted_rows};

/// Whether `next` is the token after `token` in the same prompt: the same block table, one more
/// key visible.
pub(super) fn same_prompt(token: &TokenKeys<'_>, next: &TokenKeys<'_>) -> bool {
    std::ptr::eq(token.block_table, next.block_table) && next.visible == token.visible + 1
}

/// Prompt tokens scored together at most: enough to share each key row's loads and reductions,
/// few enough that a long prompt's runs still make many tasks.
const PROMPT_TILE_TOKENS: usize = 8;

/// Attention for every token when no pair is split, runs of consecutive tokens of one prompt
/// (up to [`PROMPT_TILE_TOKENS`]) a task: their keys are the same rows (each token sees one
/// more), so the run's scores come from one pass over the last token's keys
/// ([`score_prompt_keys`]), then each token's softmax and weighted sum as for any other token.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend_by_prompt_runs(
    shape: AttentionShape,
    scale: f32,
    queries: &[f32],
    query_stride: usize,
    tokens: &[TokenKeys<'_>],
    keys: &[u8],
    values: &[u8],
    out: &mut [f32],
) {
    let (group, head_dim) = (shape.group(), shape.head_dim);
    let (group_width, token_width) = (group * head_dim, shape.heads * head_dim);
    let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
    for (index, token) in tokens.iter().enumerate() {
        match runs.last_mut() {
            Some(run) if run.len() < PROMPT_TILE_TOKENS && same_prompt(&tokens[run.end - 1], token) => run.end += 1,
            _ => runs.push(index..index + 1),
        }
    }
    let mut outputs = Vec::with_capacity(runs.len());
    let mut rest = &mut out[..tokens.len() * token_width];
    for run in &runs {
        let (head, tail) = rest.split_at_mut(run.len() * token_width);
        outputs.push(head);
        rest = tail;
    }
    runs.par_iter().zip(outputs).for_each(|(run, out_run)| {
        SCRATCH.with_borrow_mut(|scratch| {
            let last = tokens[run.end - 1];
            for kv_head in 0..shape.kv_heads {
                let rows = KeyRows {
                    shape,
                    token: last,
                    kv_head,
                    keys: 0..last.visible,
                };
                let first_query = run.start * query_stride + kv_head * group_width;
                if run.len() == 1 {
                    // A lone token (a decoding sequence's) as every other step attends it.
                    let out_group = &mut out_run[kv_head * group_width..][..group_width];
                    let query_group = &queries[first_query..first_query + group_width];
                    attend_whole(shape, scale, query_group, rows, keys, values, scratch, out_group);
                    continue;
                }
                let (scores, offsets, stats) = (&mut scratch.0, &mut scratch.1, &mut scratch.2);
                stats.resize(2 * group, 0.0);
                rows.offsets_into(offsets);
                let count = offsets.len();
                scores.clear();
                scores.resize(run.len() * count * group, 0.0);
                let scored = score_prompt_keys(
                    &queries[first_query..],
                    query_stride,
                    run.len(),
                    group,
                    keys,
                    offsets,
                    head_dim,
                    scale,
                    scores,
                );
                assert!(scored, "prompt runs are made only where their scoring runs");
                for (i, token) in tokens[run.clone()].iter().enumerate() {
                    let (max, total) = stats.split_at_mut(group);
                    max.fill(f32::NEG_INFINITY);
                    total.fill(0.0);
                    let out_group = &mut out_run[i * token_width + kv_head * group_width..][..group_width];
                    let visible = token.visible.min(count);
                    let token_scores = &mut scores[i * count * group..][..visible * group];
                    if visible == 0 {
                        out_group.fill(0.0);
                        continue;
                    }
                    softmax_numerators(token_scores, group, max, total);
                    weighted_rows(token_scores, group, values, &offsets[..visible], head_dim, out_group);
                    normalize(out_group, total, head_dim);
                }
            }
        });
    });
}
