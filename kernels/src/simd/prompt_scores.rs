//! Key scoring for several consecutive tokens of one prompt at once: each key row is loaded once
//! for all of them, and their sums are reduced together. Part of [`super`]'s `unsafe`, under its
//! invariants.
//!
//! Why: in a prompt chunk, every token of a sequence scores the same keys (the earlier ones of
//! the prompt), which sit in L1/L2, so scoring there is arithmetic, and [`super::score_keys`]'s
//! one horizontal sum per (key, query head) dominated it (~7% of a 256-token prefill on a Zen 4
//! EPYC, more than the weighted sum of values over the same rows). Tokens `t..t + Q` with `G`
//! query heads each keep `Q · G` vectors of partial sums per key and fold them into one or two
//! vectors of sums with a tree of horizontal adds.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::grouped_heads::sums_of_eight;
use super::kv24::has_kv24_avx512;
#[cfg(target_arch = "x86_64")]
use super::kv24::{load16, prefetch_packed_row};
use super::{fits, strided_len};
use crate::kv_values::{KV_READ_PAST, KV_VALUE_BYTES};

/// Tokens per pass for `group` query heads per KV head: up to 16 (token, head) sums per key.
fn tokens_per_pass(group: usize) -> Option<usize> {
    match group {
        1 => Some(8),
        2..=4 => Some(4),
        _ => None,
    }
}

/// Whether [`score_prompt_keys`] takes `group` query heads of `dim` values on this CPU (else
/// the caller scores one token at a time).
pub fn prompt_scores_take(group: usize, dim: usize) -> bool {
    has_kv24_avx512() && dim.is_multiple_of(16) && dim > 0 && tokens_per_pass(group).is_some()
}

/// `scores[q][t][g] = scale · query(q)_g · key row t` (the `dim` packed values from value
/// `offsets[t]` of `keys`, [`crate::kv_values`]) for `tokens` tokens `q`
/// (token `q`'s `group` query heads at `queries[q · query_stride..]`, `[group][dim]`), every key
/// row `t` and head `g`: `scores` is `[tokens][offsets.len()][group]`. Every token is scored
/// against every row; a caller whose tokens see fewer keys reads only their first rows' scores.
/// Returns false, writing nothing, where [`prompt_scores_take`] does not hold.
#[allow(clippy::too_many_arguments)]
pub fn score_prompt_keys(
    queries: &[f32],
    query_stride: usize,
    tokens: usize,
    group: usize,
    keys: &[u8],
    offsets: &[usize],
    dim: usize,
    scale: f32,
    scores: &mut [f32],
) -> bool {
    if !prompt_scores_take(group, dim) || tokens == 0 {
        return false;
    }
    assert!(query_stride >= group * dim && fits(queries.len(), strided_len(tokens, query_stride, group * dim)));
    assert!(fits(
        scores.len(),
        tokens.checked_mul(offsets.len()).and_then(|n| n.checked_mul(group))
    ));
    assert!(offsets.iter().all(|&o| fits(
        keys.len(),
        o.checked_add(dim)
            .and_then(|end| end.checked_mul(KV_VALUE_BYTES))
            .and_then(|end| end.checked_add(KV_READ_PAST))
    )));
    #[cfg(target_arch = "x86_64")]
    {
        let per_pass = tokens_per_pass(group).unwrap_or(1);
        for first in (0..tokens).step_by(per_pass) {
            let count = per_pass.min(tokens - first);
            let (q, k) = (queries[first * query_stride..].as_ptr(), keys.as_ptr());
            let out = scores[first * offsets.len() * group..].as_mut_ptr();
            // SAFETY: AVX-512F, BW and VBMI present and `dim` a positive multiple of 16
            // (`prompt_scores_take`);
            // tokens `first..first + count` hold `group · dim` queries each, `query_stride`
            // apart, every key row read lies in `keys`, and `out` holds `count` tokens' scores
            // (asserted above).
            unsafe {
                match group {
                    1 => scores_avx512::<1, 8>(q, query_stride, count, k, offsets, dim, scale, out),
                    2 => scores_avx512::<2, 4>(q, query_stride, count, k, offsets, dim, scale, out),
                    3 => scores_avx512::<3, 4>(q, query_stride, count, k, offsets, dim, scale, out),
                    _ => scores_avx512::<4, 4>(q, query_stride, count, k, offsets, dim, scale, out),
                }
            }
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Rows ahead of the one being scored whose key row is fetched into L1.
const PREFETCH_ROWS_AHEAD: usize = 8;

/// [`score_prompt_keys`] for `count <= Q` tokens of `G` heads (`Q · G <= 16`). Tokens past
/// `count` are computed from the first token's queries and not stored, so that the loops keep
/// their constant bounds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn scores_avx512<const G: usize, const Q: usize>(
    queries: *const f32,
    query_stride: usize,
    count: usize,
    keys: *const u8,
    offsets: &[usize],
    dim: usize,
    scale: f32,
    scores: *mut f32,
) {
    // SAFETY (whole body): see `score_prompt_keys`.
    unsafe {
        let token_queries: [*const f32; Q] =
            std::array::from_fn(|q| queries.add(if q < count { q * query_stride } else { 0 }));
        let rows = offsets.len();
        let scale = _mm256_set1_ps(scale);
        for (t, &at) in offsets.iter().enumerate() {
            if let Some(&ahead) = offsets.get(t + PREFETCH_ROWS_AHEAD) {
                prefetch_packed_row::<_MM_HINT_T0>(keys, ahead, dim);
            }
            let row = keys.add(at * KV_VALUE_BYTES);
            // Sum `q · G + g` in vector `q · G + g`: 16 at most.
            let mut acc = [_mm512_setzero_ps(); 16];
            for c in (0..dim).step_by(16) {
                let k = load16(row.add(c * KV_VALUE_BYTES));
                for (q, token) in token_queries.iter().enumerate() {
                    for g in 0..G {
                        let a = &mut acc[q * G + g];
                        *a = _mm512_fmadd_ps(_mm512_loadu_ps(token.add(g * dim + c)), k, *a);
                    }
                }
            }
            // Each vector folded to 8 lanes, then eight sums to a vector by horizontal adds.
            let used = Q * G;
            let mut sums = [0f32; 16];
            for part in 0..used.div_ceil(8) {
                let eight: [__m256; 8] = std::array::from_fn(|i| fold_to_eight(acc[part * 8 + i]));
                let vector = _mm256_mul_ps(scale, sums_of_eight(&eight, (used - part * 8).min(8)));
                _mm256_storeu_ps(sums.as_mut_ptr().add(part * 8), vector);
            }
            for q in 0..count {
                std::ptr::copy_nonoverlapping(sums.as_ptr().add(q * G), scores.add((q * rows + t) * G), G);
            }
        }
    }
}

/// `v`'s two 256-bit halves added: eight lanes with the same sum as `v`'s sixteen.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn fold_to_eight(v: __m512) -> __m256 {
    let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    _mm256_add_ps(_mm512_castps512_ps256(v), high)
}
