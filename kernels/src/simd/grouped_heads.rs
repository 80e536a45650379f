//! Attention's inner loops over the query heads that share one KV head (grouped-query
//! attention): each key or value row is loaded once for the whole group. This module sums the
//! value rows ([`weighted_rows`]) and holds the fetch helpers both loops use; the scoring loop is
//! [`super::key_scores`]. Part of [`super`]'s `unsafe`, under its invariants.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::hsum;
use super::{axpy, dot, fits, has_avx2, has_avx512};

/// Query heads one KV head serves at most on the AVX2 path of [`group_dots`] / [`group_axpy`].
const MAX_GROUP: usize = 8;

/// `out[g] = scale · q_g · key` for each query head `g` of a group (`queries` is `[group][dim]`,
/// `dim = key.len()`): the key is loaded once for the whole group.
pub(super) fn group_dots(queries: &[f32], key: &[f32], scale: f32, out: &mut [f32]) {
    let dim = key.len();
    let group = out.len();
    assert!(fits(queries.len(), group.checked_mul(dim)));
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && group <= MAX_GROUP && dim.is_multiple_of(8) {
        // SAFETY: AVX2 present; `queries` holds `group · dim` values, `key` `dim`, `out` `group`.
        unsafe { group_dots_avx2(queries.as_ptr(), key.as_ptr(), dim, scale, out) };
        return;
    }
    for (g, o) in out.iter_mut().enumerate() {
        *o = scale * dot(&queries[g * dim..(g + 1) * dim], key);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn group_dots_avx2(queries: *const f32, key: *const f32, dim: usize, scale: f32, out: &mut [f32]) {
    // SAFETY (whole body): see `group_dots`; `out.len() <= MAX_GROUP`, `dim % 8 == 0`.
    unsafe {
        let group = out.len();
        let mut acc = [_mm256_setzero_ps(); MAX_GROUP];
        for c in (0..dim).step_by(8) {
            let k = _mm256_loadu_ps(key.add(c));
            for (g, a) in acc.iter_mut().enumerate().take(group) {
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(queries.add(g * dim + c)), k, *a);
            }
        }
        for (g, o) in out.iter_mut().enumerate() {
            *o = scale * hsum(acc[g]);
        }
    }
}

/// `out_g += weights[g] · value` for each query head `g` of a group (`out` is `[group][dim]`,
/// `dim = value.len()`): the value row is loaded once for the whole group.
pub fn group_axpy(weights: &[f32], value: &[f32], out: &mut [f32]) {
    let dim = value.len();
    let group = weights.len();
    assert!(fits(out.len(), group.checked_mul(dim)));
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && dim.is_multiple_of(8) {
        // SAFETY: AVX2 present; `value` holds `dim` values and `out` `group · dim`.
        unsafe { group_axpy_avx2(weights, value.as_ptr(), dim, out.as_mut_ptr()) };
        return;
    }
    for (g, w) in weights.iter().enumerate() {
        axpy(*w, value, &mut out[g * dim..(g + 1) * dim]);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn group_axpy_avx2(weights: &[f32], value: *const f32, dim: usize, out: *mut f32) {
    // SAFETY (whole body): see `group_axpy`; `dim % 8 == 0`.
    unsafe {
        for c in (0..dim).step_by(8) {
            let v = _mm256_loadu_ps(value.add(c));
            for (g, w) in weights.iter().enumerate() {
                let dst = out.add(g * dim + c);
                _mm256_storeu_ps(dst, _mm256_fmadd_ps(_mm256_set1_ps(*w), v, _mm256_loadu_ps(dst)));
            }
        }
    }
}

/// `out_g = Σ_t weights[t][g] · values[offsets[t]..][..dim]` for each query head `g` of a group
/// (`weights` is `[offsets.len()][group]`, `out` is `[group][dim]`, overwritten). The AVX2 path
/// keeps a slice of every head's output in registers across all rows (up to 12 accumulators),
/// so each value row is loaded once per slice and no partial output goes through memory.
pub fn weighted_rows(weights: &[f32], group: usize, values: &[f32], offsets: &[usize], dim: usize, out: &mut [f32]) {
    assert!(fits(weights.len(), offsets.len().checked_mul(group)) && fits(out.len(), group.checked_mul(dim)));
    assert!(offsets.iter().all(|&o| fits(values.len(), o.checked_add(dim))));
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        let (w, v, o) = (weights.as_ptr(), values.as_ptr(), out.as_mut_ptr());
        // SAFETY: AVX-512F present; as for the AVX2 path below.
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
        group_axpy(&weights[t * group..(t + 1) * group], &values[offset..offset + dim], out);
    }
}

/// Whether [`weighted_rows`]' AVX2 loop takes `group` heads of `dim` values (`CV` 4 for groups
/// of up to 3, 2 up to 6): exactly then `score_keys_avx2` leaves the value rows to it.
#[cfg(target_arch = "x86_64")]
pub(super) fn weighted_rows_avx2_takes(group: usize, dim: usize) -> bool {
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
    values: *const f32,
    offsets: &[usize],
    dim: usize,
    out: *mut f32,
) -> bool {
    // SAFETY (whole body): see `weighted_rows`.
    unsafe {
        // The value rows come from memory here (see `score_keys_avx2`): the first slice's pass
        // fetches each row ahead as the scoring loop fetches keys; later slices find them cached.
        for &ahead in offsets.iter().take(PREFETCH_L2_ROWS_AHEAD) {
            prefetch_row::<_MM_HINT_T1>(values, ahead, dim);
        }
        for slice in (0..dim).step_by(8 * CV) {
            let mut acc = [[_mm256_setzero_ps(); CV]; G];
            for (t, &offset) in offsets.iter().enumerate() {
                if slice == 0 {
                    if let Some(&ahead) = offsets.get(t + PREFETCH_L2_ROWS_AHEAD) {
                        prefetch_row::<_MM_HINT_T1>(values, ahead, dim);
                    }
                    if let Some(&ahead) = offsets.get(t + PREFETCH_ROWS_AHEAD) {
                        prefetch_row::<_MM_HINT_T0>(values, ahead, dim);
                    }
                }
                let row = values.add(offset + slice);
                // Sixteen vector registers: where the group's broadcast weights fit beside the
                // accumulators, each value vector is loaded as it is used; else the row's
                // vectors are loaded first and each weight broadcast as it is used.
                if G * CV + G < 16 {
                    let w: [__m256; G] = std::array::from_fn(|g| _mm256_broadcast_ss(&*weights.add(t * G + g)));
                    for c in 0..CV {
                        let v = _mm256_loadu_ps(row.add(8 * c));
                        for (head, w) in acc.iter_mut().zip(&w) {
                            head[c] = _mm256_fmadd_ps(*w, v, head[c]);
                        }
                    }
                } else {
                    let v: [__m256; CV] = std::array::from_fn(|c| _mm256_loadu_ps(row.add(8 * c)));
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

/// Rows ahead of the one being scored (or summed) whose rows [`score_keys`](super::score_keys) (and
/// [`weighted_rows`]) fetch into L1: a row is scored in a few nanoseconds, and a row missing from
/// the caches takes ~100 to arrive.
pub(super) const PREFETCH_ROWS_AHEAD: usize = 16;

/// Rows ahead that [`score_keys`](super::score_keys) (and the AVX2 [`weighted_rows`]) ask into L2 first, so
/// that the L1 fetch above finds them there: rows from memory need more time than 16 rows'
/// scoring, and 64 rows of keys and values fetched into L1 (32 KiB) would fill it.
pub(super) const PREFETCH_L2_ROWS_AHEAD: usize = 64;

/// Asks for the row at `at` of `rows` (`dim` values) with the prefetch hint `HINT`.
///
/// # Safety
/// The row lies inside `rows`' allocation (a prefetch never faults, but the address arithmetic
/// must stay in bounds).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn prefetch_row<const HINT: i32>(rows: *const f32, at: usize, dim: usize) {
    // SAFETY (whole body): see above.
    unsafe {
        for line in (0..dim).step_by(16) {
            _mm_prefetch::<HINT>(rows.add(at + line).cast());
        }
    }
}

/// Asks for the key row at `at`, and the value row there where `values` is given (`dim` values
/// each), with the prefetch hint `HINT`.
///
/// # Safety
/// As [`prefetch_row`], for each row asked for.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn prefetch_key_rows<const HINT: i32>(
    keys: *const f32,
    values: Option<*const f32>,
    at: usize,
    dim: usize,
) {
    // SAFETY: see above.
    unsafe {
        prefetch_row::<HINT>(keys, at, dim);
        if let Some(values) = values {
            prefetch_row::<HINT>(values, at, dim);
        }
    }
}

/// [`weighted_rows`] on AVX-512: `G` heads, `CV` vectors of each head's output per pass; returns
/// true (the dispatch checked that `dim` is a multiple of `16 · CV`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn weighted_rows_avx512<const G: usize, const CV: usize>(
    weights: *const f32,
    values: *const f32,
    offsets: &[usize],
    dim: usize,
    out: *mut f32,
) -> bool {
    // SAFETY (whole body): see `weighted_rows`.
    unsafe {
        for slice in (0..dim).step_by(16 * CV) {
            let mut acc = [[_mm512_setzero_ps(); CV]; G];
            for (t, &offset) in offsets.iter().enumerate() {
                let row = values.add(offset + slice);
                let v: [__m512; CV] = std::array::from_fn(|c| _mm512_loadu_ps(row.add(16 * c)));
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
