//! Batches of f32 activation rows times pairs of panels on AVX-512: each pair's weights decoded
//! once per tile of columns into L1 as f32 (`q·d + offset`, the row-major decoder's
//! arithmetic), then multiplied by every activation row in register tiles of up to
//! [`PACKED_ROWS`] rows × 32 weights, one broadcast activation serving its row's two FMAs. Part
//! of [`super`]'s `unsafe`, under its invariants (its functions run only after
//! [`super::has_avx512`] returned true).
//!
//! Why: the register-decoding kernels ([`super::panel_pair_gemv`]) decode every weight again
//! for each pass of eight rows, and on Intel's cores a 512-bit mask, shift or conversion takes
//! one of the two ports the FMAs use, so a 32-row step's projections ran at ~55% of the FMA peak
//! there (a Xeon without AMX, `cargo bench -p rivulet-kernels --bench projections -- 2 32
//! Q4_1`). Decoded once into L1, a weight's decode is shared by the whole batch, and the inner
//! loop is two loads and 24 FMAs per column.
//!
//! Layout: the decoded weights are `[k][32]` (panel `A`'s 16 rows, then `B`'s; a lone last
//! panel fills only the first 16); the activations stay as they come, row-major.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::panels::{four_columns_512, nibble_columns};
use super::panels::{Kind, Panels, Q4_BLOCK, Q8_BLOCK, SCALES};
use super::{cache_aligned, fits, has_avx512, strided_len, PANEL};

/// Activation rows per register tile: 24 accumulators (two panels a row) of the 32 registers,
/// the rest for the weights.
pub const PACKED_ROWS: usize = 12;

/// Blocks of 32 columns decoded per tile: two panels' 128 columns are 16 KiB of f32, which stay
/// in L1 beside the activations' tile while every row tile passes over them.
const TILE_BLOCKS: usize = 4;

/// Activation rows from which a step takes this path (`matrix`), unless
/// `RIVULET_KERNELS_PACKED_AVX512_MIN_ROWS` sets another count (0 for never; to compare them).
///
/// 12 where decoding in registers is dear (Intel's cores, whose masks, shifts and conversions
/// take the FMAs' ports; Zen 4's half-width units), 64 on Zen 5 and later, whose four vector
/// pipes decode beside the FMAs: there the in-register pairs of panels ran 30 layers of 4-bit
/// projections at 16 / 32 / 48 rows in 8.4–8.7 / 17.1–17.4 / 25.1–25.4 ms against this path's
/// 12.2–12.5 / 18.3–18.5 / 25.1–26.3, the 8-bit ones in 9.4 / 17.9–18.2 / 26.5–26.6 against
/// 14.1–16.9 / 20.9–21.3 / 28.3–28.5, level at 64 and slower from 96 (`PROJECTIONS_BEST_ONLY=1
/// cargo bench -p rivulet-kernels --bench projections -- 2 16,24,32,48,64,96,128 Q4_1,Q8_0`,
/// two alternations, the forty-ninth round).
pub fn packed_avx512_min_rows() -> usize {
    use std::sync::OnceLock;
    static ROWS: OnceLock<usize> = OnceLock::new();
    *ROWS.get_or_init(|| {
        let rows = std::env::var("RIVULET_KERNELS_PACKED_AVX512_MIN_ROWS").ok();
        match rows.and_then(|r| r.parse().ok()) {
            Some(0) => usize::MAX,
            Some(rows) => rows,
            None if super::is_amd_zen5_or_later() => 64,
            None => 12,
        }
    })
}

/// Values per decoded column: two panels.
const PAIR: usize = 2 * PANEL;

/// The batch's row tiles: at most [`PACKED_ROWS`] rows each, split as evenly as that allows
/// (32 rows as 11, 11 and 10), each tile's first row and row count.
fn row_tiles(batch: usize) -> impl Iterator<Item = (usize, usize)> {
    let count = batch.div_ceil(PACKED_ROWS);
    (0..count).scan(0, move |first, t| {
        // The first `batch % count` tiles take one row more.
        let rows = batch / count + usize::from(t < batch % count);
        let tile = (*first, rows);
        *first += rows;
        Some(tile)
    })
}

impl Panels {
    /// `sums[b][r] = Σ_k x[b][k] · w[panel · PANEL + r][k]` for every activation row `b < batch`
    /// (row `b` of `x` at `b * x_stride`) and `r < count · PANEL` (`count` is 1 or 2 panels from
    /// `panel`; the returned part of `sums`, rows `2 · PANEL` apart), decoding into `decoded`
    /// (both resized as needed, and used from a cache line on: [`cache_aligned`]).
    #[allow(clippy::too_many_arguments)]
    pub fn product_packed_avx512<'s>(
        &self,
        panel: usize,
        count: usize,
        x: &[f32],
        x_stride: usize,
        batch: usize,
        decoded: &mut Vec<f32>,
        sums: &'s mut Vec<f32>,
    ) -> &'s [f32] {
        assert!(has_avx512() && (1..=2).contains(&count) && panel + count <= self.panel_count());
        let blocks = self.blocks_per_row();
        let cols = blocks * 32;
        assert!(batch == 0 || (cols <= x_stride && fits(x.len(), strided_len(batch, x_stride, cols))));
        let sums = cache_aligned(sums, batch.checked_mul(PAIR).expect("a batch of sums fits in memory"));
        let decoded = cache_aligned(decoded, TILE_BLOCKS * 32 * PAIR);
        for start in (0..blocks).step_by(TILE_BLOCKS) {
            let end = (start + TILE_BLOCKS).min(blocks);
            for half in 0..count {
                let source = self.blocks(panel + half, start..end);
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX-512F present; `source` holds `end - start` panel blocks of this
                // kind, and `decoded` `(end - start) · 32` columns of `PAIR` values, of which
                // this half writes 16 each.
                unsafe {
                    let out = decoded.as_mut_ptr().add(half * PANEL);
                    match self.kind() {
                        Kind::Q4 => decode_q4(source.as_ptr(), end - start, out),
                        Kind::Q8 => decode_q8(source.as_ptr(), end - start, out),
                    }
                }
                #[cfg(not(target_arch = "x86_64"))]
                let _ = source;
            }
            let len = (end - start) * 32;
            for (first, rows) in row_tiles(batch) {
                let tile = &x[first * x_stride + start * 32..];
                let out = &mut sums[first * PAIR..(first + rows) * PAIR];
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX-512F present; `decoded` holds `len` columns of `PAIR` values,
                // `tile` `rows` rows of `len` activations `x_stride` apart (asserted above) and
                // `out` `rows` rows of `PAIR` sums (sliced above).
                unsafe {
                    let (x, out) = (tile.as_ptr(), out.as_mut_ptr());
                    tile_product(count, rows, decoded.as_ptr(), len, x, x_stride, out, start > 0);
                }
                #[cfg(not(target_arch = "x86_64"))]
                let _ = (tile, out);
            }
        }
        sums
    }
}

/// Dispatches [`rows_times_columns`] on the tile's row and panel counts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_product(
    panels: usize,
    rows: usize,
    w: *const f32,
    len: usize,
    x: *const f32,
    x_stride: usize,
    sums: *mut f32,
    accumulate: bool,
) {
    macro_rules! dispatch {
        ($($m:literal)*) => {
            match (panels, rows) {
                $((1, $m) => rows_times_columns::<$m, 1>(w, len, x, x_stride, sums, accumulate),)*
                $((_, $m) => rows_times_columns::<$m, 2>(w, len, x, x_stride, sums, accumulate),)*
                _ => unreachable!("tiles hold 1..=PACKED_ROWS rows"),
            }
        };
    }
    // SAFETY: the caller's (see `Panels::product_packed_avx512`).
    unsafe { dispatch!(1 2 3 4 5 6 7 8 9 10 11 12) }
}

/// `sums[b][p·16..p·16 + 16] (+)= Σ_k x[b][k] · w[k][p·16..]` for `M` rows and `P` panels: `w`
/// holds `len` columns of `PAIR` values, `x` `M` rows of `len` values `x_stride` apart, `sums`
/// `M` rows of `PAIR`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rows_times_columns<const M: usize, const P: usize>(
    w: *const f32,
    len: usize,
    x: *const f32,
    x_stride: usize,
    sums: *mut f32,
    accumulate: bool,
) {
    // SAFETY (whole body): the pointers hold what the doc says (caller).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); P]; M];
        if accumulate {
            for (b, row) in acc.iter_mut().enumerate() {
                for (p, sum) in row.iter_mut().enumerate() {
                    *sum = _mm512_loadu_ps(sums.add(b * PAIR + p * PANEL));
                }
            }
        }
        for k in 0..len {
            let mut weights = [_mm512_setzero_ps(); P];
            for (p, weight) in weights.iter_mut().enumerate() {
                *weight = _mm512_loadu_ps(w.add(k * PAIR + p * PANEL));
            }
            // (Plain loops over constant bounds: they unroll, so the accumulators stay in
            // registers and each broadcast folds into its FMAs.)
            for (b, row) in acc.iter_mut().enumerate() {
                let xs = _mm512_set1_ps(*x.add(b * x_stride + k));
                for (sum, weight) in row.iter_mut().zip(weights) {
                    *sum = _mm512_fmadd_ps(weight, xs, *sum);
                }
            }
        }
        for (b, row) in acc.iter().enumerate() {
            for (p, sum) in row.iter().enumerate() {
                _mm512_storeu_ps(sums.add(b * PAIR + p * PANEL), *sum);
            }
        }
    }
}

/// A 4-bit panel's `count` blocks from `source`, decoded as `out[k · PAIR + r]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn decode_q4(source: *const u8, count: usize, out: *mut f32) {
    // SAFETY (whole body): `source` holds `count` blocks of `Q4_BLOCK`, `out` `count · 32`
    // columns of `PAIR` values (caller).
    unsafe {
        for block in 0..count {
            let base = source.add(block * Q4_BLOCK);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(base.cast()));
            let offset = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(SCALES).cast()));
            let out = out.add(block * 32 * PAIR);
            for p in 0..8 {
                // Row r's two bytes in lane r: four columns, one per nibble.
                let lanes = _mm512_cvtepu16_epi32(_mm256_loadu_si256(base.add(2 * SCALES + 2 * PANEL * p).cast()));
                for (nibble, column) in four_columns_512(lanes).into_iter().zip(nibble_columns(p)) {
                    let value = _mm512_fmadd_ps(_mm512_cvtepi32_ps(nibble), d, offset);
                    _mm512_storeu_ps(out.add(column * PAIR), value);
                }
            }
        }
    }
}

/// A Q8_0 panel's `count` blocks from `source`, decoded as `out[k · PAIR + r]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn decode_q8(source: *const u8, count: usize, out: *mut f32) {
    // SAFETY (whole body): `source` holds `count` blocks of `Q8_BLOCK`, `out` `count · 32`
    // columns of `PAIR` values (caller).
    unsafe {
        for block in 0..count {
            let base = source.add(block * Q8_BLOCK);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(base.cast()));
            let out = out.add(block * 32 * PAIR);
            for k in 0..32 {
                let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(base.add(SCALES + PANEL * k).cast()));
                _mm512_storeu_ps(out.add(k * PAIR), _mm512_mul_ps(_mm512_cvtepi32_ps(q), d));
            }
        }
    }
}
