//! Attention's scoring loop over the query heads that share one KV head (grouped-query
//! attention): [`score_keys`], each key row loaded once for the whole group. Part of
//! [`super`]'s `unsafe`, under its invariants; the weighted sum of the value rows that follows
//! is [`super::grouped_heads`]'.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::grouped_heads::{group_dots, PREFETCH_L2_ROWS_AHEAD, PREFETCH_ROWS_AHEAD};
#[cfg(target_arch = "x86_64")]
use super::grouped_heads::{prefetch_key_rows, prefetch_row, weighted_rows_avx2_takes};
use super::{fits, has_avx2, has_avx512};

/// A SIMD loop of [`score_keys`] for one group size: queries, keys, values, offsets, `dim`,
/// scale, scores.
#[cfg(target_arch = "x86_64")]
type ScoreKeysKernel = unsafe fn(*const f32, *const f32, *const f32, &[usize], usize, f32, *mut f32);

/// `$kernel`'s instance for `$group` query heads, for groups of 1 to 8 (`None` beyond).
#[cfg(target_arch = "x86_64")]
macro_rules! score_keys_instance {
    ($kernel:ident, $group:expr) => {
        match $group {
            1 => Some($kernel::<1> as ScoreKeysKernel),
            2 => Some($kernel::<2> as ScoreKeysKernel),
            3 => Some($kernel::<3> as ScoreKeysKernel),
            4 => Some($kernel::<4> as ScoreKeysKernel),
            5 => Some($kernel::<5> as ScoreKeysKernel),
            6 => Some($kernel::<6> as ScoreKeysKernel),
            7 => Some($kernel::<7> as ScoreKeysKernel),
            8 => Some($kernel::<8> as ScoreKeysKernel),
            _ => None,
        }
    };
}

/// `scores[t][g] = scale · q_g · keys[offsets[t]..][..dim]` for every key row `t` and query head
/// `g` of a group (`queries` is `[group][dim]`, `scores` `[offsets.len()][group]`), each key row
/// loaded once for the whole group. The value rows at the same offsets are fetched into the
/// caches on the way, for the weighted sum that follows ([`weighted_rows`](super::weighted_rows)) — except where the
/// AVX2 weighted sum fetches its own (see `score_keys_avx2`).
///
/// Why one call for all the keys: scored one call per key ([`group_dots`], still the path for
/// shapes and CPUs the SIMD loops do not take), each key's sums were one chain of dependent FMAs,
/// and a 32-sequence decode step spent ~11% of its time there; in one loop (AVX-512, or AVX2)
/// the keys' short chains overlap. With the AVX-512 weighted sum, on a Zen 5 EPYC
/// (`rivulet-worker-bench`, runs alternating): a decode step of 32 sequences at context 256
/// 35.3 → 31.9 ms, 64 at 512 85 → 73 ms, a 512-token prefill 445 → 391.
///
/// The AVX-512 loop fetches value rows into L2 only (keys into L2, then L1). Into L1 as well,
/// on a Zen 4 EPYC (`rivulet-worker-bench` at context 256, three alternations of the two builds)
/// attention took 821 / 861 / 955 µs of a one-sequence step against 654 / 717 / 727 without,
/// and 17.1 / 19.8 / 20.9 ms of a 32-sequence step against 16.4 / 16.8 / 19.1. Scoring sixteen
/// keys at once with their sums reduced by one tree of shuffles, on the same machine, was no
/// faster than this loop's one key at a time (attention 19.4–21.1 ms against 16.9–18.5 at 32).
pub fn score_keys(
    queries: &[f32],
    keys: &[f32],
    values: &[f32],
    offsets: &[usize],
    dim: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let group = scores.len().checked_div(offsets.len()).unwrap_or(0);
    assert!(fits(scores.len(), offsets.len().checked_mul(group)) && fits(queries.len(), group.checked_mul(dim)));
    assert!(offsets
        .iter()
        .all(|&o| fits(keys.len(), o.checked_add(dim)) && fits(values.len(), o.checked_add(dim))));
    #[cfg(target_arch = "x86_64")]
    {
        let kernel = if has_avx512() && dim.is_multiple_of(16) && dim > 0 {
            score_keys_instance!(score_keys_avx512, group)
        } else if has_avx2() && dim.is_multiple_of(8) && dim > 0 {
            // Keys a pass: as many as keep twelve sums in flight (see `score_keys_avx2`).
            match group {
                1 => Some(score_keys_avx2::<1, 12> as ScoreKeysKernel),
                2 => Some(score_keys_avx2::<2, 6> as ScoreKeysKernel),
                3 => Some(score_keys_avx2::<3, 4> as ScoreKeysKernel),
                4 => Some(score_keys_avx2::<4, 3> as ScoreKeysKernel),
                5 => Some(score_keys_avx2::<5, 2> as ScoreKeysKernel),
                6 => Some(score_keys_avx2::<6, 2> as ScoreKeysKernel),
                7 => Some(score_keys_avx2::<7, 1> as ScoreKeysKernel),
                8 => Some(score_keys_avx2::<8, 1> as ScoreKeysKernel),
                _ => None,
            }
        } else {
            None
        };
        if let Some(kernel) = kernel {
            let (q, k, v) = (queries.as_ptr(), keys.as_ptr(), values.as_ptr());
            // SAFETY: the CPU has the kernel's features and `dim` its multiple (checked just
            // above); every key and value row read lies in `keys`/`values`, the queries hold
            // `group · dim` values and `scores` `offsets.len() · group` (asserted).
            unsafe { kernel(q, k, v, offsets, dim, scale, scores.as_mut_ptr()) };
            return;
        }
    }
    for &ahead in offsets.iter().take(PREFETCH_L2_ROWS_AHEAD) {
        super::prefetch_l2(&keys[ahead..ahead + dim]);
        super::prefetch_l2(&values[ahead..ahead + dim]);
    }
    for (index, (row, &at)) in scores.chunks_exact_mut(group.max(1)).zip(offsets).enumerate() {
        if let Some(&ahead) = offsets.get(index + PREFETCH_L2_ROWS_AHEAD) {
            super::prefetch_l2(&keys[ahead..ahead + dim]);
            super::prefetch_l2(&values[ahead..ahead + dim]);
        }
        if let Some(&ahead) = offsets.get(index + PREFETCH_ROWS_AHEAD) {
            super::prefetch(&keys[ahead..ahead + dim]);
            super::prefetch(&values[ahead..ahead + dim]);
        }
        group_dots(queries, &keys[at..at + dim], scale, row);
    }
}

/// [`score_keys`] for `G` query heads (the dispatch checked that `dim` is a positive multiple
/// of 16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn score_keys_avx512<const G: usize>(
    queries: *const f32,
    keys: *const f32,
    values: *const f32,
    offsets: &[usize],
    dim: usize,
    scale: f32,
    scores: *mut f32,
) {
    // SAFETY (whole body): see `score_keys`.
    unsafe {
        // The first rows are asked into L2 all at once (from memory they arrive in parallel),
        // then each row `PREFETCH_L2_ROWS_AHEAD` ahead of its use into L2 and
        // `PREFETCH_ROWS_AHEAD` ahead into L1.
        for &ahead in offsets.iter().take(PREFETCH_L2_ROWS_AHEAD) {
            prefetch_key_rows::<_MM_HINT_T1>(keys, Some(values), ahead, dim);
        }
        for (t, &at) in offsets.iter().enumerate() {
            if let Some(&ahead) = offsets.get(t + PREFETCH_L2_ROWS_AHEAD) {
                prefetch_key_rows::<_MM_HINT_T1>(keys, Some(values), ahead, dim);
            }
            // Key rows only: the value rows are summed after every key of the part is scored,
            // by when rows fetched into L1 this early have left it (measured at `score_keys`).
            if let Some(&ahead) = offsets.get(t + PREFETCH_ROWS_AHEAD) {
                prefetch_row::<_MM_HINT_T0>(keys, ahead, dim);
            }
            let row = keys.add(at);
            let mut acc = [_mm512_setzero_ps(); G];
            for c in (0..dim).step_by(16) {
                let k = _mm512_loadu_ps(row.add(c));
                for (g, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_loadu_ps(queries.add(g * dim + c)), k, *a);
                }
            }
            for (g, a) in acc.iter().enumerate() {
                *scores.add(t * G + g) = scale * _mm512_reduce_add_ps(*a);
            }
        }
    }
}

/// [`score_keys`] on AVX2 for `G` query heads, `K` keys a pass (the dispatch checked that `dim`
/// is a positive multiple of 8 and that `G · K <= 12`).
///
/// Only the key rows are fetched ahead here where [`weighted_rows`](super::weighted_rows)' AVX2 loop will sum the
/// values (`weighted_rows_avx2_takes`): it fetches the value rows as it sums them. Fetched here
/// too, the scoring loop carried both rows' traffic and the weighted sum none, so memory idled
/// through the sum: on Zen 3, attention over a real 256-token context at
/// 32 sequences took 28.8–31.8 ms per step with the fetches split against 32.7–38.4 with both
/// here (four alternations), and one sequence 1.41–1.67 against 1.52–1.99 ms (five).
///
/// Why `K` keys a pass: each key's `G` sums are chains of dependent FMAs (`dim / 8` long), and
/// Zen 3 needs eight in flight to keep its two FMA pipes busy. Called once per key
/// ([`group_dots`]), a 32-sequence decode step at context 256 on a Zen 3 EPYC spent ~12% of its
/// time scoring keys; one key a pass (three chains for SmolLM2), then two (six), 125.8 → 102.8
/// → 93.4 ms per step at context 512. Twelve chains (four keys a pass for SmolLM2's groups of
/// three), on the same kind of machine, one thread over 255 keys in cache: 10–18 ns a key
/// against 13–26 with two keys a pass (the fortieth round). The `K · G` sums of a pass are
/// reduced together, eight at a time, by trees of horizontal adds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn score_keys_avx2<const G: usize, const K: usize>(
    queries: *const f32,
    keys: *const f32,
    values: *const f32,
    offsets: &[usize],
    dim: usize,
    scale: f32,
    scores: *mut f32,
) {
    // SAFETY (whole body): see `score_keys`; `G · K <= 12` (the dispatch).
    unsafe {
        // The value rows too, unless the weighted sum's AVX2 loop fetches them itself.
        let value_rows = (!weighted_rows_avx2_takes(G, dim)).then_some(values);
        for &ahead in offsets.iter().take(PREFETCH_L2_ROWS_AHEAD) {
            prefetch_key_rows::<_MM_HINT_T1>(keys, value_rows, ahead, dim);
        }
        let mut t = 0;
        while t < offsets.len() {
            // `K` keys a pass while `K` are left, then one at a time.
            let whole = t + K <= offsets.len();
            let keys_now = if whole { K } else { 1 };
            for ahead in t..t + keys_now {
                if let Some(&ahead) = offsets.get(ahead + PREFETCH_L2_ROWS_AHEAD) {
                    prefetch_key_rows::<_MM_HINT_T1>(keys, value_rows, ahead, dim);
                }
                if let Some(&ahead) = offsets.get(ahead + PREFETCH_ROWS_AHEAD) {
                    prefetch_key_rows::<_MM_HINT_T0>(keys, value_rows, ahead, dim);
                }
            }
            if whole {
                score_pass::<G, K>(queries, keys, &offsets[t..], dim, scale, scores.add(t * G));
            } else {
                score_pass::<G, 1>(queries, keys, &offsets[t..], dim, scale, scores.add(t * G));
            }
            t += keys_now;
        }
    }
}

/// The scores of the `K` keys at `offsets[..K]` for `G` heads into `scores[..K · G]` (`[key][G]`,
/// so consecutive): `K · G <= 12` independent FMA chains, their sums reduced eight at a time.
///
/// # Safety
/// As `score_keys_avx2`, with `offsets` holding at least `K` rows and `scores` `K · G` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn score_pass<const G: usize, const K: usize>(
    queries: *const f32,
    keys: *const f32,
    offsets: &[usize],
    dim: usize,
    scale: f32,
    scores: *mut f32,
) {
    // SAFETY (whole body): see above; `acc` holds 16 vectors, so each reduction's eight lie in it.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 16];
        let rows: [*const f32; K] = std::array::from_fn(|key| keys.add(offsets[key]));
        for c in (0..dim).step_by(8) {
            for key in 0..K {
                let k = _mm256_loadu_ps(rows[key].add(c));
                for g in 0..G {
                    acc[key * G + g] = _mm256_fmadd_ps(_mm256_loadu_ps(queries.add(g * dim + c)), k, acc[key * G + g]);
                }
            }
        }
        let n = K * G;
        let scale = _mm256_set1_ps(scale);
        let mut done = 0;
        while done < n {
            let chunk: &[__m256; 8] = &*(acc.as_ptr().add(done) as *const [__m256; 8]);
            let used = (n - done).min(8);
            let sums = _mm256_mul_ps(scale, sums_of_eight(chunk, used));
            if used == 8 {
                _mm256_storeu_ps(scores.add(done), sums);
            } else {
                let mut lanes = [0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), sums);
                std::ptr::copy_nonoverlapping(lanes.as_ptr(), scores.add(done), used);
            }
            done += used;
        }
    }
}

/// Lane `g` of the result: the sum of `vectors[g]`'s eight lanes, for `g < used` (the other
/// lanes hold anything). Horizontal adds pair the vectors up, so eight sums cost seven shuffling
/// adds rather than eight separate reductions; up to four take three.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn sums_of_eight(vectors: &[__m256; 8], used: usize) -> __m256 {
    let v = vectors;
    // Each 128-bit lane of a `hadd` holds pair sums of its two inputs' same lanes.
    let low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    if used <= 4 {
        // Lane g (g < 4) of each half: vector g's sum over that half's four values.
        let half = _mm_add_ps(_mm256_castps256_ps128(low), _mm256_extractf128_ps::<1>(low));
        return _mm256_castps128_ps256(half);
    }
    let high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    let first_halves = _mm256_permute2f128_ps::<0x20>(low, high);
    let second_halves = _mm256_permute2f128_ps::<0x31>(low, high);
    _mm256_add_ps(first_halves, second_halves)
}
