//! The integer GEMV: Q4_0, Q4_1 and Q8_0 weight rows times activation rows quantized to 16 bits
//! per block ([`crate::activations`]). Part of [`super`]'s `unsafe`, under its invariants.
//!
//! Per block of 32 weights: the quants widened to 16 bits (one `vpmovzxbw`/`vpmovsxbw` per 16),
//! two `vpmaddwd` against the activation's values (exact 32-bit sums: |q| ≤ 128 and |v| ≤ 32767
//! keep four products per lane under 2²⁴, so the conversion to f32 is exact too), then one FMA
//! by `d · s` (the weight block's scale times the activation block's). Q4_1's `m` multiplies the
//! activation block's exact f32 lane sums.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use rivulet_gguf::GgmlType;

use super::{fits, has_avx2, strided_len};
use crate::activations::{QuantizedRows, BLOCK};

/// Activation rows up to this count take the integer path; above it the f32 GEMV decodes each
/// block once for all rows, which costs fewer instructions per row (measured with
/// `cargo bench -p rivulet-kernels --bench projections`: at 4 rows Q4_1 took 1.3× the f32
/// path's time, at 1 and 2 rows 0.7–0.8×).
pub const GEMV_I16_MAX_BATCH: usize = 2;

/// Formats the integer path multiplies.
pub fn gemv_i16_decodes(format: GgmlType) -> bool {
    matches!(format, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
}

/// `out[r * batch + b] = Σ_k w_r[k] · x_b[k]` for `rows` weight rows (row `r` at `r * row_bytes`
/// in `data`, whole blocks of `format`) and the `batch = x.rows()` quantized activation rows.
pub fn gemv_i16_rows_avx2(
    format: GgmlType,
    data: &[u8],
    row_bytes: usize,
    rows: usize,
    x: &QuantizedRows,
    out: &mut [f32],
) {
    let batch = x.rows();
    assert!(has_avx2() && gemv_i16_decodes(format));
    assert!((1..=GEMV_I16_MAX_BATCH).contains(&batch));
    assert!(fits(out.len(), rows.checked_mul(batch)));
    let blocks = x.blocks();
    let row_len = blocks * format.block_layout().1 as usize;
    assert!(row_bytes >= row_len && fits(data.len(), strided_len(rows, row_bytes, row_len)));
    assert!(fits(x.values().len(), blocks.checked_mul(BLOCK * batch)));
    assert!(fits(x.scales().len(), blocks.checked_mul(batch)));
    assert!(fits(x.lane_sums().len(), blocks.checked_mul(8 * batch)));
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 present; `data` holds every row's blocks, `x` every block of every activation
    // row, `out` every result (asserted above).
    unsafe {
        let acts = Acts {
            values: x.values().as_ptr(),
            scales: x.scales().as_ptr(),
            lane_sums: x.lane_sums().as_ptr(),
            blocks,
        };
        let (w, out) = (data.as_ptr(), out.as_mut_ptr());
        match format {
            GgmlType::Q4_0 => all_rows::<Q4_0>(w, row_bytes, rows, &acts, batch, out),
            GgmlType::Q4_1 => all_rows::<Q4_1>(w, row_bytes, rows, &acts, batch, out),
            _ => all_rows::<Q8_0>(w, row_bytes, rows, &acts, batch, out),
        }
    }
}

/// Formats as const generic tags (one instantiation each: no format test in the inner loop).
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;

/// Raw views of [`QuantizedRows`].
struct Acts {
    values: *const i16,
    scales: *const f32,
    lane_sums: *const f32,
    blocks: usize,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn all_rows<const F: u8>(w: *const u8, row_bytes: usize, rows: usize, x: &Acts, batch: usize, out: *mut f32) {
    // SAFETY (whole body): as for `rows_times`, for every group of rows (caller).
    unsafe {
        let mut row = 0;
        while row < rows {
            let w = w.add(row * row_bytes);
            let out = out.add(row * batch);
            // One activation row takes two weight rows per pass: four independent accumulators.
            row += match (rows - row, batch) {
                (2.., 1) => rows_times::<F, 2, 1>(w, row_bytes, x, out),
                (_, 1) => rows_times::<F, 1, 1>(w, row_bytes, x, out),
                _ => rows_times::<F, 1, 2>(w, row_bytes, x, out),
            };
        }
    }
}

/// One weight block: the quants as two vectors of 16 × i16 (values 0–15 and 16–31), the scale
/// `d` and (Q4_1) the minimum `m`, each broadcast.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn weight_block<const F: u8>(block: *const u8) -> (__m256i, __m256i, __m256, __m256) {
    // SAFETY (whole body): the block's bytes are readable at `block` (caller).
    unsafe {
        match F {
            Q4_1 => {
                // d and m are adjacent f16: one 32-bit broadcast, converted, then split.
                let dm = _mm256_cvtph_ps(_mm_set1_epi32(block.cast::<i32>().read_unaligned()));
                let q = _mm256_cvtepu8_epi16(_mm_loadu_si128(block.add(4).cast()));
                // Each 16-bit lane holds one byte: its low nibble is value i, its high one i + 16.
                let low = _mm256_and_si256(q, _mm256_set1_epi16(0x0F));
                let high = _mm256_srli_epi16::<4>(q);
                (low, high, _mm256_moveldup_ps(dm), _mm256_movehdup_ps(dm))
            }
            Q4_0 => {
                let d = _mm256_cvtph_ps(_mm_set1_epi16(block.cast::<i16>().read_unaligned()));
                let q = _mm256_cvtepu8_epi16(_mm_loadu_si128(block.add(2).cast()));
                let eight = _mm256_set1_epi16(8);
                let low = _mm256_sub_epi16(_mm256_and_si256(q, _mm256_set1_epi16(0x0F)), eight);
                let high = _mm256_sub_epi16(_mm256_srli_epi16::<4>(q), eight);
                (low, high, d, _mm256_setzero_ps())
            }
            _ => {
                let d = _mm256_cvtph_ps(_mm_set1_epi16(block.cast::<i16>().read_unaligned()));
                let low = _mm256_cvtepi8_epi16(_mm_loadu_si128(block.add(2).cast()));
                let high = _mm256_cvtepi8_epi16(_mm_loadu_si128(block.add(18).cast()));
                (low, high, d, _mm256_setzero_ps())
            }
        }
    }
}

/// `R` weight rows × `B` activation rows; returns `R`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_times<const F: u8, const R: usize, const B: usize>(
    rows: *const u8,
    row_bytes: usize,
    x: &Acts,
    out: *mut f32,
) -> usize {
    // SAFETY (whole body): `rows` holds `R` rows of `x.blocks` blocks `row_bytes` apart, `x`
    // `B` activation rows of `x.blocks` blocks, and `out` `R · B` results (caller).
    unsafe {
        let block_bytes = match F {
            Q4_0 => 18,
            Q4_1 => 20,
            _ => 34,
        };
        // The `d·s` terms and Q4_1's `m·Σx` terms in separate accumulators: two short
        // dependency chains instead of one long one.
        let mut scaled = [[_mm256_setzero_ps(); B]; R];
        let mut minimums = [[_mm256_setzero_ps(); B]; R];
        for block in 0..x.blocks {
            for r in 0..R {
                // As in the f32 GEMV: the hardware prefetcher alone leaves one row waiting on
                // memory. A hint only (it never faults), so it may point past the data.
                _mm_prefetch::<_MM_HINT_T0>(rows.wrapping_add(r * row_bytes + block * block_bytes + 1024).cast());
                let (low, high, d, m) = weight_block::<F>(rows.add(r * row_bytes + block * block_bytes));
                for b in 0..B {
                    let at = b * x.blocks + block;
                    let values = x.values.add(at * BLOCK);
                    let products = _mm256_add_epi32(
                        _mm256_madd_epi16(low, _mm256_loadu_si256(values.cast())),
                        _mm256_madd_epi16(high, _mm256_loadu_si256(values.add(16).cast())),
                    );
                    let scale = _mm256_mul_ps(d, _mm256_broadcast_ss(&*x.scales.add(at)));
                    scaled[r][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), scale, scaled[r][b]);
                    if F == Q4_1 {
                        let sums = _mm256_loadu_ps(x.lane_sums.add(at * 8));
                        minimums[r][b] = _mm256_fmadd_ps(m, sums, minimums[r][b]);
                    }
                }
            }
        }
        for r in 0..R {
            for b in 0..B {
                *out.add(r * B + b) = super::hsum(_mm256_add_ps(scaled[r][b], minimums[r][b]));
            }
        }
        R
    }
}
