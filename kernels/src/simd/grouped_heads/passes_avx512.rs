//! [`super::score_keys`]' AVX-512 loop: keys scored `16 / G` a pass, their sums reduced
//! together. Part of [`crate::simd`]'s `unsafe`, under its invariants (its functions run only
//! after [`super::has_kv24_avx512`] returned true).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::super::kv24::{load16, prefetch_packed_row};
#[cfg(target_arch = "x86_64")]
use super::{in_passes, prefetch_key_rows, PREFETCH_L2_ROWS_AHEAD, PREFETCH_ROWS_AHEAD};
#[cfg(target_arch = "x86_64")]
use crate::kv_values::KV_VALUE_BYTES;

/// [`super::score_keys`] on AVX-512 for `G` query heads, `K` keys a pass (the dispatch checked that
/// `dim` is a positive multiple of 16 and that `G · K <= 16`).
///
/// Why `K` keys a pass: one key at a time, each of its `G` sums was reduced on its own
/// (`_mm512_reduce_add_ps`: four shuffles and four adds a score), twice as many shuffles and
/// adds as the key's FMAs, and on Intel's cores the shuffles share a port with the FMAs and with
/// the byte permutes that widen the cache's three-byte values. A pass's `K · G` sums are reduced
/// together ([`sums_of_sixteen`]: two shuffles and an add a score), each score the same sum in
/// the same order as before.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
pub(super) unsafe fn score_keys_avx512<const G: usize, const K: usize>(
    queries: *const f32,
    keys: *const u8,
    values: *const u8,
    offsets: &[usize],
    dim: usize,
    scale: f32,
    scores: *mut f32,
) {
    // SAFETY (whole body): see `score_keys`; `G · K <= 16` (the dispatch).
    unsafe {
        // The first rows are asked into L2 all at once (from memory they arrive in parallel),
        // then each row `PREFETCH_L2_ROWS_AHEAD` ahead of its use into L2 and
        // `PREFETCH_ROWS_AHEAD` ahead into L1.
        for &ahead in offsets.iter().take(PREFETCH_L2_ROWS_AHEAD) {
            prefetch_key_rows::<_MM_HINT_T1>(keys, Some(values), ahead, dim);
        }
        in_passes::<K>(
            offsets.len(),
            |t| {
                if let Some(&ahead) = offsets.get(t + PREFETCH_L2_ROWS_AHEAD) {
                    prefetch_key_rows::<_MM_HINT_T1>(keys, Some(values), ahead, dim);
                }
                // Key rows only: the value rows are summed after every key of the part is
                // scored, by when rows fetched into L1 this early have left it (measured at
                // `score_keys`).
                if let Some(&ahead) = offsets.get(t + PREFETCH_ROWS_AHEAD) {
                    prefetch_packed_row::<_MM_HINT_T0>(keys, ahead, dim);
                }
            },
            |t, whole| {
                let (rows, out) = (&offsets[t..], scores.add(t * G));
                if whole {
                    score_pass_avx512::<G, K>(queries, keys, rows, dim, scale, out);
                } else {
                    score_pass_avx512::<G, 1>(queries, keys, rows, dim, scale, out);
                }
            },
        );
    }
}

/// The scores of the `K` keys at `offsets[..K]` for `G` heads into `scores[..K · G]` (`[key][G]`,
/// so consecutive): `K · G <= 16` independent FMA chains, reduced together.
///
/// # Safety
/// As `score_keys_avx512`, with `offsets` holding at least `K` rows and `scores` `K · G` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
#[inline]
unsafe fn score_pass_avx512<const G: usize, const K: usize>(
    queries: *const f32,
    keys: *const u8,
    offsets: &[usize],
    dim: usize,
    scale: f32,
    scores: *mut f32,
) {
    // SAFETY (whole body): see above; every slot index is below 16 (`K · G <= 16`).
    unsafe {
        // Sum `n` (key `n / G`, head `n % G`) is kept in slot `SUM_SLOT[n]`, so that it comes
        // out of `sums_of_sixteen` in lane `n`; the slots no sum uses stay zero.
        let mut acc = [_mm512_setzero_ps(); 16];
        let rows: [*const u8; K] = std::array::from_fn(|key| keys.add(offsets[key] * KV_VALUE_BYTES));
        for c in (0..dim).step_by(16) {
            for (key, row) in rows.iter().enumerate() {
                let k = load16(row.add(c * KV_VALUE_BYTES));
                for g in 0..G {
                    let slot = SUM_SLOT[key * G + g];
                    acc[slot] = _mm512_fmadd_ps(_mm512_loadu_ps(queries.add(g * dim + c)), k, acc[slot]);
                }
            }
        }
        let sums = _mm512_mul_ps(_mm512_set1_ps(scale), sums_of_sixteen(&acc));
        let used = K * G;
        if used == 16 {
            _mm512_storeu_ps(scores, sums);
        } else {
            _mm512_mask_storeu_ps(scores, ((1u32 << used) - 1) as __mmask16, sums);
        }
    }
}

/// Where [`sums_of_sixteen`] takes the vector whose sum it puts in lane `n`: its tree leaves
/// slot `4j + i`'s sum in lane `4i + j`, a permutation that is its own inverse.
#[cfg(target_arch = "x86_64")]
const SUM_SLOT: [usize; 16] = [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15];

/// Lane `SUM_SLOT[s]` of the result: the sum of `slots[s]`'s sixteen lanes, added in
/// `_mm512_reduce_add_ps`' order (its 128-bit quarters `(0 + 2) + (1 + 3)`, then within the
/// quarter `(0 + 2) + (1 + 3)`), so each sum is bit for bit what that reduction gives: fifteen
/// shuffling adds for sixteen sums, where reducing each on its own takes four.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn sums_of_sixteen(slots: &[__m512; 16]) -> __m512 {
    // Quarters 0 + 2 and 1 + 3 of two vectors x, y: [x02, x13, y02, y13].
    let quarters = |x: __m512, y: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
        )
    };
    // Those quarter sums added, for four vectors: [x, y, z, w], a quarter each.
    let whole = |p: __m512, q: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(p, q),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(p, q),
        )
    };
    // Within each quarter, elements 0 + 2 and 1 + 3 of two vectors' quarters.
    let pairs = |a: __m512, b: __m512| {
        let (a, b) = (_mm512_castps_pd(a), _mm512_castps_pd(b));
        _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
        )
    };
    // Within each quarter, the two pair sums of two vectors added.
    let last = |c: __m512, d: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(c, d),
            _mm512_shuffle_ps::<0b11_01_11_01>(c, d),
        )
    };
    let s = slots;
    let b: [__m512; 4] =
        std::array::from_fn(|n| whole(quarters(s[4 * n], s[4 * n + 1]), quarters(s[4 * n + 2], s[4 * n + 3])));
    last(pairs(b[0], b[1]), pairs(b[2], b[3]))
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::super::{has_kv24_avx512, score_keys};
    use super::*;
    use crate::kv_values::{kv_cache_bytes, pack_kv_row};

    /// The AVX-512 passes give each score bit for bit what one key at a time gave: the same FMA
    /// chain, reduced by `_mm512_reduce_add_ps`' order, for every group size and a last pass of
    /// fewer keys.
    #[test]
    fn avx512_passes_score_as_one_key_at_a_time() {
        if !has_kv24_avx512() {
            return;
        }
        let dim = 64;
        let rows = 37;
        let wave = |i: usize, m: usize| ((i * m % 97) as f32 - 48.0) * 0.013;
        let values: Vec<f32> = (0..rows * dim).map(|i| wave(i, 31)).collect();
        let mut keys = vec![0u8; kv_cache_bytes(values.len())];
        pack_kv_row(&values, &mut keys[..values.len() * KV_VALUE_BYTES]);
        // Rows out of order, as block tables leave them.
        let offsets: Vec<usize> = (0..rows).map(|r| (r * 11 % rows) * dim).collect();
        for group in 1..=8 {
            let queries: Vec<f32> = (0..group * dim).map(|i| wave(i, 17)).collect();
            let mut scores = vec![0f32; rows * group];
            score_keys(&queries, &keys, &keys, &offsets, dim, 0.125, &mut scores);
            for (t, &at) in offsets.iter().enumerate() {
                for g in 0..group {
                    // SAFETY: AVX-512 with VBMI present; each row's 64-byte loads lie in `keys`
                    // (its tail), the queries hold `group · dim` values.
                    let expected = unsafe {
                        let mut acc = _mm512_setzero_ps();
                        for c in (0..dim).step_by(16) {
                            let k = load16(keys.as_ptr().add((at + c) * KV_VALUE_BYTES));
                            acc = _mm512_fmadd_ps(_mm512_loadu_ps(queries.as_ptr().add(g * dim + c)), k, acc);
                        }
                        0.125 * _mm512_reduce_add_ps(acc)
                    };
                    assert_eq!(
                        scores[t * group + g].to_bits(),
                        expected.to_bits(),
                        "group {group} key {t} head {g}"
                    );
                }
            }
        }
    }
}
