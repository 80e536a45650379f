//! Attention's weighted sum of value rows for the query heads that share one KV head
//! (grouped-query attention): each value row is loaded once for the whole group. Part of
//! [`super`]'s `unsafe`, under its invariants. (The scores come from [`super::key_scores`].)

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{axpy, fits, has_avx2, has_avx512};

/// `out_g = Σ_t weights[g][t] · values[offsets[t]..][..dim]` for each query head `g` of a group
/// (`weights` is `[group][offsets.len()]`, as [`super::score_key_runs`] writes scores; `out` is
/// `[group][dim]`, overwritten). The AVX2 path
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
    let count = offsets.len();
    for (g, out_head) in out[..group * dim].chunks_exact_mut(dim).enumerate() {
        out_head.fill(0.0);
        for (&w, &offset) in weights[g * count..(g + 1) * count].iter().zip(offsets) {
            axpy(w, &values[offset..offset + dim], out_head);
        }
    }
}

/// Whether [`weighted_rows`]' AVX2 loop takes `group` heads of `dim` values (`CV` 4 for groups
/// of up to 3, 2 up to 6): exactly then the AVX2 scoring ([`super::score_key_runs`]) leaves the
/// value rows to it.
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
        // The value rows come from memory here: the first slice's pass fetches each row ahead,
        // later slices find them cached. (On Zen 3, with value rows a row at a time, fetching
        // them here rather than while scoring keys took attention over a 256-token context at
        // 32 sequences from 32.7–38.4 to 28.8–31.8 ms per step.)
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
                let v: [__m256; CV] = std::array::from_fn(|c| _mm256_loadu_ps(row.add(8 * c)));
                for (g, head) in acc.iter_mut().enumerate() {
                    let w = _mm256_broadcast_ss(&*weights.add(g * offsets.len() + t));
                    for (a, vc) in head.iter_mut().zip(&v) {
                        *a = _mm256_fmadd_ps(w, *vc, *a);
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

/// Rows ahead of the one being summed whose rows the AVX2 [`weighted_rows`] fetches into L1: a
/// row is summed in a few nanoseconds, and a row missing from the caches takes ~100 to arrive.
const PREFETCH_ROWS_AHEAD: usize = 16;

/// Rows ahead that the AVX2 [`weighted_rows`] asks into L2 first, so that the L1 fetch above
/// finds them there.
const PREFETCH_L2_ROWS_AHEAD: usize = 64;

/// Asks for the row at `at` of `rows` (`dim` values) with the prefetch hint `HINT`.
///
/// # Safety
/// The row lies inside `rows`' allocation (a prefetch never faults, but the address arithmetic
/// must stay in bounds).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_row<const HINT: i32>(rows: *const f32, at: usize, dim: usize) {
    // SAFETY (whole body): see above.
    unsafe {
        for line in (0..dim).step_by(16) {
            _mm_prefetch::<HINT>(rows.add(at + line).cast());
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
                    let w = _mm512_set1_ps(*weights.add(g * offsets.len() + t));
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
