//! Attention's inner loops over the query heads that share one KV head (grouped-query
//! attention): each key or value row is loaded once for the whole group. Rows are the KV
//! cache's three-byte values ([`crate::kv_values`]), widened as they are loaded
//! ([`super::kv24`]); row offsets count values. Part of [`super`]'s `unsafe`, under its
//! invariants.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::kv24::has_kv24_avx512;
#[cfg(target_arch = "x86_64")]
use super::kv24::{load16, load8, prefetch_packed_row};
use super::{fits, has_avx2};
use crate::kv_values::{kv_value, KV_READ_PAST, KV_VALUE_BYTES};

mod passes_avx512;

#[cfg(target_arch = "x86_64")]
use passes_avx512::score_keys_avx512;

/// Whether packed rows `rows` hold every row at `offsets` (`dim` values each) and the bytes the
/// SIMD loads read past each.
fn rows_fit(rows: &[u8], offsets: &[usize], dim: usize) -> bool {
    offsets.iter().all(|&o| {
        fits(
            rows.len(),
            o.checked_add(dim)
                .and_then(|end| end.checked_mul(KV_VALUE_BYTES))
                .and_then(|end| end.checked_add(KV_READ_PAST)),
        )
    })
}

/// `out[g] = scale · q_g · key` for each query head `g` of a group (`queries` is `[group][dim]`):
/// the portable path, for CPUs and shapes the SIMD loops do not take.
fn group_dots(queries: &[f32], key: &[u8], dim: usize, scale: f32, out: &mut [f32]) {
    for (g, o) in out.iter_mut().enumerate() {
        let query = &queries[g * dim..(g + 1) * dim];
        *o = scale * query.iter().enumerate().map(|(d, q)| q * kv_value(key, d)).sum::<f32>();
    }
}

/// `out_g = Σ_t weights[t][g] · values[offsets[t]..][..dim]` for each query head `g` of a group
/// (`weights` is `[offsets.len()][group]`, `out` is `[group][dim]`, overwritten). The AVX2 path
/// keeps a slice of every head's output in registers across all rows (up to 12 accumulators),
/// so each value row is loaded once per slice and no partial output goes through memory.
pub fn weighted_rows(weights: &[f32], group: usize, values: &[u8], offsets: &[usize], dim: usize, out: &mut [f32]) {
    assert!(fits(weights.len(), offsets.len().checked_mul(group)) && fits(out.len(), group.checked_mul(dim)));
    assert!(rows_fit(values, offsets, dim));
    #[cfg(target_arch = "x86_64")]
    if has_kv24_avx512() {
        let (w, v, o) = (weights.as_ptr(), values.as_ptr(), out.as_mut_ptr());
        // SAFETY: AVX-512F, BW and VBMI present; as for the AVX2 path below.
        let done = unsafe {
            match (group, dim % 64, dim % 32) {
                (1, 0, _) => weighted_rows_avx512::<1, 4>(w, v, offsets, dim, o),
                (2, 0, _) => weighted_rows_avx512::<2, 4>(w, v, offsets, dim, o),
                (3, 0, _) => weighted_rows_avx512::<3, 4>(w, v, offsets, dim, o),
                (4, 0, _) => weighted_rows_avx512::<4, 4>(w, v, offsets, dim, o),
                (5, 0, _) => weighted_rows_avx512::<5, 4>(w, v, offsets, dim, o),
                (6, 0, _) => weighted_rows_avx512::<6, 4>(w, v, offsets, dim, o),
                (1, _, 0) => weighted_rows_avx512::<1, 2>(w, v, offsets, dim, o),
                (2, _, 0) => weighted_rows_avx512::<2, 2>(w, v, offsets, dim, o),
                (3, _, 0) => weighted_rows_avx512::<3, 2>(w, v, offsets, dim, o),
                (4, _, 0) => weighted_rows_avx512::<4, 2>(w, v, offsets, dim, o),
                (5, _, 0) => weighted_rows_avx512::<5, 2>(w, v, offsets, dim, o),
                (6, _, 0) => weighted_rows_avx512::<6, 2>(w, v, offsets, dim, o),
                (7, _, 0) => weighted_rows_avx512::<7, 2>(w, v, offsets, dim, o),
                (8, _, 0) => weighted_rows_avx512::<8, 2>(w, v, offsets, dim, o),
                _ => false,
            }
        };
        if done {
            return;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        let (w, v, o) = (weights.as_ptr(), values.as_ptr(), out.as_mut_ptr());
        // SAFETY: AVX2 present; every row read lies in `values` and every weight in `weights`
        // (asserted), and `out` holds `group · dim` values.
        let done = weighted_rows_avx2_takes(group, dim)
            && unsafe {
                match group {
                    1 => weighted_rows_avx2::<1, 4>(w, v, offsets, dim, o),
                    2 => weighted_rows_avx2::<2, 4>(w, v, offsets, dim, o),
                    3 => weighted_rows_avx2::<3, 4>(w, v, offsets, dim, o),
                    4 => weighted_rows_avx2::<4, 2>(w, v, offsets, dim, o),
                    5 => weighted_rows_avx2::<5, 2>(w, v, offsets, dim, o),
                    6 => weighted_rows_avx2::<6, 2>(w, v, offsets, dim, o),
                    _ => false,
                }
            };
        if done {
            return;
        }
    }
    out[..group * dim].fill(0.0);
    for (t, &offset) in offsets.iter().enumerate() {
        let row = &values[offset * KV_VALUE_BYTES..];
        for d in 0..dim {
            let value = kv_value(row, d);
            for (g, w) in weights[t * group..(t + 1) * group].iter().enumerate() {
                out[g * dim + d] += w * value;
            }
        }
    }
}

/// Whether [`weighted_rows`]' AVX2 loop takes `group` heads of `dim` values (`CV` 4 for groups
/// of up to 3, 2 up to 6): exactly then `score_keys_avx2` leaves the value rows to it.
#[cfg(target_arch = "x86_64")]
fn weighted_rows_avx2_takes(group: usize, dim: usize) -> bool {
    match group {
        1..=3 => dim.is_multiple_of(32),
        4..=6 => dim.is_multiple_of(16),
        _ => false,
    }
}

/// `G` heads, `CV` vectors of each head's output per pass; returns true (the dispatch checked
/// that `dim` is a multiple of `8 · CV`).
///
/// The `G · CV` accumulators stay in registers across all rows only if every other live vector
/// fits beside them in AVX2's sixteen: for SmolLM2's groups of three (`CV` 4) the row's four
/// value vectors and a broadcast weight made seventeen, and the compiler kept an accumulator on
/// the stack, a store and a reload in its FMA chain every row. With the group's three weights
/// broadcast first and each value vector loaded as it is used, sixteen: on Zen 3, one thread
/// over 255 rows in cache, 10–16 ns a row against 20–24 (the fortieth round).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn weighted_rows_avx2<const G: usize, const CV: usize>(
    weights: *const f32,
    values: *const u8,
    offsets: &[usize],
    dim: usize,
    out: *mut f32,
) -> bool {
    // SAFETY (whole body): see `weighted_rows`.
    unsafe {
        // The value rows come from memory here (see `score_keys_avx2`): the first slice's pass
        // fetches each row ahead as the scoring loop fetches keys; later slices find them cached.
        for &ahead in offsets.iter().take(PREFETCH_L2_ROWS_AHEAD) {
            prefetch_packed_row::<_MM_HINT_T1>(values, ahead, dim);
        }
        for slice in (0..dim).step_by(8 * CV) {
            let mut acc = [[_mm256_setzero_ps(); CV]; G];
            for (t, &offset) in offsets.iter().enumerate() {
                if slice == 0 {
                    if let Some(&ahead) = offsets.get(t + PREFETCH_L2_ROWS_AHEAD) {
                        prefetch_packed_row::<_MM_HINT_T1>(values, ahead, dim);
                    }
                    if let Some(&ahead) = offsets.get(t + PREFETCH_ROWS_AHEAD) {
                        prefetch_packed_row::<_MM_HINT_T0>(values, ahead, dim);
                    }
                }
                let row = values.add((offset + slice) * KV_VALUE_BYTES);
                // Sixteen vector registers: where the group's broadcast weights fit beside the
                // accumulators, each value vector is loaded as it is used; else the row's
                // vectors are loaded first and each weight broadcast as it is used.
                if G * CV + G < 16 {
                    let w: [__m256; G] = std::array::from_fn(|g| _mm256_broadcast_ss(&*weights.add(t * G + g)));
                    for c in 0..CV {
                        let v = load8(row.add(8 * c * KV_VALUE_BYTES));
                        for (head, w) in acc.iter_mut().zip(&w) {
                            head[c] = _mm256_fmadd_ps(*w, v, head[c]);
                        }
                    }
                } else {
                    let v: [__m256; CV] = std::array::from_fn(|c| load8(row.add(8 * c * KV_VALUE_BYTES)));
                    for (g, head) in acc.iter_mut().enumerate() {
                        let w = _mm256_broadcast_ss(&*weights.add(t * G + g));
                        for (a, vc) in head.iter_mut().zip(&v) {
                            *a = _mm256_fmadd_ps(w, *vc, *a);
                        }
                    }
                }
            }
            for (g, head) in acc.iter().enumerate() {
                for (c, a) in head.iter().enumerate() {
                    _mm256_storeu_ps(out.add(g * dim + slice + 8 * c), *a);
                }
            }
        }
        true
    }
}

/// A SIMD loop of [`score_keys`] for one group size: queries, keys, values, offsets, `dim`,
/// scale, scores.
#[cfg(target_arch = "x86_64")]
type ScoreKeysKernel = unsafe fn(*const f32, *const u8, *const u8, &[usize], usize, f32, *mut f32);

/// Rows ahead of the one being scored (or summed) whose rows [`score_keys`] (and
/// [`weighted_rows`]) fetch into L1: a row is scored in a few nanoseconds, and a row missing from
/// the caches takes ~100 to arrive.
const PREFETCH_ROWS_AHEAD: usize = 16;

/// Rows ahead that [`score_keys`] (and the AVX2 [`weighted_rows`]) ask into L2 first, so
/// that the L1 fetch above finds them there: rows from memory need more time than 16 rows'
/// scoring, and 64 rows of keys and values fetched into L1 (32 KiB) would fill it.
const PREFETCH_L2_ROWS_AHEAD: usize = 64;

/// `scores[t][g] = scale · q_g · keys[offsets[t]..][..dim]` for every key row `t` and query head
/// `g` of a group (`queries` is `[group][dim]`, `scores` `[offsets.len()][group]`), each key row
/// loaded once for the whole group. The value rows at the same offsets are fetched into the
/// caches on the way, for the weighted sum that follows ([`weighted_rows`]) — except where the
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
    keys: &[u8],
    values: &[u8],
    offsets: &[usize],
    dim: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let group = scores.len().checked_div(offsets.len()).unwrap_or(0);
    assert!(fits(scores.len(), offsets.len().checked_mul(group)) && fits(queries.len(), group.checked_mul(dim)));
    assert!(rows_fit(keys, offsets, dim) && rows_fit(values, offsets, dim));
    #[cfg(target_arch = "x86_64")]
    {
        let kernel = if has_kv24_avx512() && dim.is_multiple_of(16) && dim > 0 {
            // Keys a pass: as many as fill sixteen sums (see `score_keys_avx512`).
            match group {
                1 => Some(score_keys_avx512::<1, 16> as ScoreKeysKernel),
                2 => Some(score_keys_avx512::<2, 8> as ScoreKeysKernel),
                3 => Some(score_keys_avx512::<3, 5> as ScoreKeysKernel),
                4 => Some(score_keys_avx512::<4, 4> as ScoreKeysKernel),
                5 => Some(score_keys_avx512::<5, 3> as ScoreKeysKernel),
                6 => Some(score_keys_avx512::<6, 2> as ScoreKeysKernel),
                7 => Some(score_keys_avx512::<7, 2> as ScoreKeysKernel),
                8 => Some(score_keys_avx512::<8, 2> as ScoreKeysKernel),
                _ => None,
            }
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
    for (row, &at) in scores.chunks_exact_mut(group.max(1)).zip(offsets) {
        group_dots(queries, &keys[at * KV_VALUE_BYTES..], dim, scale, row);
    }
}

/// Walks `count` keys `K` a pass while `K` are left, then one at a time: `fetch(t)` for each key
/// `t` of a pass, then `pass(first, whole)` (`whole` for a pass of `K`). The scoring loops' shared
/// walk; inlined into each, with their target features.
#[inline(always)]
fn in_passes<const K: usize>(count: usize, mut fetch: impl FnMut(usize), mut pass: impl FnMut(usize, bool)) {
    let mut t = 0;
    while t < count {
        let whole = t + K <= count;
        let keys_now = if whole { K } else { 1 };
        (t..t + keys_now).for_each(&mut fetch);
        pass(t, whole);
        t += keys_now;
    }
}

/// [`score_keys`] on AVX2 for `G` query heads, `K` keys a pass (the dispatch checked that `dim`
/// is a positive multiple of 8 and that `G · K <= 12`).
///
/// Only the key rows are fetched ahead here where [`weighted_rows`]' AVX2 loop will sum the
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
    keys: *const u8,
    values: *const u8,
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
        in_passes::<K>(
            offsets.len(),
            |t| {
                if let Some(&ahead) = offsets.get(t + PREFETCH_L2_ROWS_AHEAD) {
                    prefetch_key_rows::<_MM_HINT_T1>(keys, value_rows, ahead, dim);
                }
                if let Some(&ahead) = offsets.get(t + PREFETCH_ROWS_AHEAD) {
                    prefetch_key_rows::<_MM_HINT_T0>(keys, value_rows, ahead, dim);
                }
            },
            |t, whole| {
                let (rows, out) = (&offsets[t..], scores.add(t * G));
                if whole {
                    score_pass::<G, K>(queries, keys, rows, dim, scale, out);
                } else {
                    score_pass::<G, 1>(queries, keys, rows, dim, scale, out);
                }
            },
        );
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
    keys: *const u8,
    offsets: &[usize],
    dim: usize,
    scale: f32,
    scores: *mut f32,
) {
    // SAFETY (whole body): see above; `acc` holds 16 vectors, so each reduction's eight lie in it.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 16];
        let rows: [*const u8; K] = std::array::from_fn(|key| keys.add(offsets[key] * KV_VALUE_BYTES));
        for c in (0..dim).step_by(8) {
            for key in 0..K {
                let k = load8(rows[key].add(c * KV_VALUE_BYTES));
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

/// Asks for the key row at `at`, and the value row there where `values` is given (`dim` values
/// each), with the prefetch hint `HINT`.
///
/// # Safety
/// As [`prefetch_packed_row`], for each row asked for.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_key_rows<const HINT: i32>(keys: *const u8, values: Option<*const u8>, at: usize, dim: usize) {
    // SAFETY: see above.
    unsafe {
        prefetch_packed_row::<HINT>(keys, at, dim);
        if let Some(values) = values {
            prefetch_packed_row::<HINT>(values, at, dim);
        }
    }
}

/// [`weighted_rows`] on AVX-512: `G` heads, `CV` vectors of each head's output per pass; returns
/// true (the dispatch checked that `dim` is a multiple of `16 · CV`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn weighted_rows_avx512<const G: usize, const CV: usize>(
    weights: *const f32,
    values: *const u8,
    offsets: &[usize],
    dim: usize,
    out: *mut f32,
) -> bool {
    // SAFETY (whole body): see `weighted_rows`.
    unsafe {
        for slice in (0..dim).step_by(16 * CV) {
            let mut acc = [[_mm512_setzero_ps(); CV]; G];
            for (t, &offset) in offsets.iter().enumerate() {
                let row = values.add((offset + slice) * KV_VALUE_BYTES);
                let v: [__m512; CV] = std::array::from_fn(|c| load16(row.add(16 * c * KV_VALUE_BYTES)));
                for (g, head) in acc.iter_mut().enumerate() {
                    let w = _mm512_set1_ps(*weights.add(t * G + g));
                    for (a, vc) in head.iter_mut().zip(&v) {
                        *a = _mm512_fmadd_ps(w, *vc, *a);
                    }
                }
            }
            for (g, head) in acc.iter().enumerate() {
                for (c, a) in head.iter().enumerate() {
                    _mm512_storeu_ps(out.add(g * dim + slice + 16 * c), *a);
                }
            }
        }
        true
    }
}
