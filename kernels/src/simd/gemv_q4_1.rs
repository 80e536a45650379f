//! Q4_1 rows times one or two f32 activation rows, with the minimum factored out of each block:
//! `Σ (d·q + m)·x = d·Σ q·x + m·Σ x`. Part of [`super`]'s `unsafe`, under its invariants.
//!
//! Why: one decoding sequence is bound by the instructions that turn each block into f32, not by
//! memory (Q4_1 streamed at ~10 GB/s where Q8_0, with fewer per weight, reached ~24). Factored,
//! a block costs four multiplies by `x` and one FMA by `d` instead of eight FMAs, and `m` meets
//! the block's activation sum `Σ x` (computed once per activation row for all weight rows) in
//! one scalar FMA. The arithmetic stays f32 on the exact GGUF values: only the order of the sums
//! changes (the kernel tests hold it to the same tolerance against an f64 product).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{fits, has_avx2, strided_len};

/// Activation rows this path takes at most; more share each decoded block better in the
/// general GEMV.
pub const GEMV_Q4_1_MAX_BATCH: usize = 2;

/// Bytes of a Q4_1 block: f16 `d`, f16 `m`, 16 bytes of nibbles.
const BLOCK_BYTES: usize = 20;

/// `Σ x` of every 32-value block of `batch` activation rows (`[batch][cols / 32]`), the input
/// [`gemv_q4_1_avx2`] takes beside the rows.
pub fn block_sums(x: &[f32], x_stride: usize, batch: usize, cols: usize, out: &mut Vec<f32>) {
    out.clear();
    for b in 0..batch {
        out.extend(x[b * x_stride..b * x_stride + cols].chunks_exact(32).map(|block| {
            // Eight lane sums added at the end: the order a vectorized loop keeps.
            let mut lanes = [0f32; 8];
            for chunk in block.chunks_exact(8) {
                lanes.iter_mut().zip(chunk).for_each(|(l, v)| *l += v);
            }
            lanes.iter().sum::<f32>()
        }));
    }
}

/// `out[r * batch + b] = Σ_k w_r[k] · x[b][k]` for `rows` Q4_1 rows (row `r` at
/// `r * row_bytes` in `data`, `cols` values in whole blocks) and `batch ≤ GEMV_Q4_1_MAX_BATCH`
/// activation rows (row `b` at `b * x_stride`), with `sums` from [`block_sums`].
#[allow(clippy::too_many_arguments)]
pub fn gemv_q4_1_avx2(
    data: &[u8],
    row_bytes: usize,
    rows: usize,
    cols: usize,
    x: &[f32],
    x_stride: usize,
    sums: &[f32],
    batch: usize,
    out: &mut [f32],
) {
    assert!(has_avx2());
    assert!(cols.is_multiple_of(32) && (1..=GEMV_Q4_1_MAX_BATCH).contains(&batch));
    assert!(fits(out.len(), rows.checked_mul(batch)));
    let blocks = cols / 32;
    let row_len = blocks * BLOCK_BYTES;
    assert!(row_bytes >= row_len && fits(data.len(), strided_len(rows, row_bytes, row_len)));
    assert!(cols <= x_stride && fits(x.len(), strided_len(batch, x_stride, cols)));
    assert!(fits(sums.len(), blocks.checked_mul(batch)));
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 present; `data` holds every row's blocks, `x` every activation row read,
    // `sums` every block sum, `out` every result written (asserted above).
    unsafe {
        let (w, x, sums, out) = (data.as_ptr(), x.as_ptr(), sums.as_ptr(), out.as_mut_ptr());
        let mut row = 0;
        while row < rows {
            let (w, out) = (w.add(row * row_bytes), out.add(row * batch));
            // Two weight rows per pass: independent chains to hide the FMA latency.
            row += match (rows - row, batch) {
                (2.., 1) => rows_times::<2, 1>(w, row_bytes, blocks, x, x_stride, sums, out),
                (2.., _) => rows_times::<2, 2>(w, row_bytes, blocks, x, x_stride, sums, out),
                (_, 1) => rows_times::<1, 1>(w, row_bytes, blocks, x, x_stride, sums, out),
                _ => rows_times::<1, 2>(w, row_bytes, blocks, x, x_stride, sums, out),
            };
        }
    }
}

/// `R` weight rows × `B` activation rows; returns `R`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_times<const R: usize, const B: usize>(
    rows: *const u8,
    row_bytes: usize,
    blocks: usize,
    x: *const f32,
    x_stride: usize,
    sums: *const f32,
    out: *mut f32,
) -> usize {
    // SAFETY (whole body): `rows` holds `R` rows of `blocks` blocks `row_bytes` apart, `x` `B`
    // rows of `blocks · 32` values, `sums` `B · blocks` sums and `out` `R · B` results (caller).
    unsafe {
        let mut scaled = [[_mm256_setzero_ps(); B]; R];
        let mut minimums = [[0f32; B]; R];
        let low_mask = _mm_set1_epi8(0x0F);
        for block in 0..blocks {
            for r in 0..R {
                let base = rows.add(r * row_bytes + block * BLOCK_BYTES);
                // As in the general GEMV: the hardware prefetcher alone leaves one row waiting
                // on memory. A hint only (it never faults), so it may point past the data.
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(1024).cast());
                // d and m are adjacent f16: one 32-bit load, one conversion.
                let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(base.cast::<i32>().read_unaligned()));
                let d = _mm256_broadcastss_ps(dm);
                let m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
                let q = _mm_loadu_si128(base.add(4).cast());
                let low = _mm_and_si128(q, low_mask);
                let high = _mm_and_si128(_mm_srli_epi16(q, 4), low_mask);
                let widen = |bytes: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
                let w = [
                    widen(low),
                    widen(_mm_srli_si128(low, 8)),
                    widen(high),
                    widen(_mm_srli_si128(high, 8)),
                ];
                for b in 0..B {
                    let xs = x.add(b * x_stride + block * 32);
                    // Two short chains, joined before the scale.
                    let even = _mm256_fmadd_ps(
                        w[2],
                        _mm256_loadu_ps(xs.add(16)),
                        _mm256_mul_ps(w[0], _mm256_loadu_ps(xs)),
                    );
                    let odd = _mm256_fmadd_ps(
                        w[3],
                        _mm256_loadu_ps(xs.add(24)),
                        _mm256_mul_ps(w[1], _mm256_loadu_ps(xs.add(8))),
                    );
                    scaled[r][b] = _mm256_fmadd_ps(d, _mm256_add_ps(even, odd), scaled[r][b]);
                    minimums[r][b] = m.mul_add(*sums.add(b * blocks + block), minimums[r][b]);
                }
            }
        }
        for r in 0..R {
            for b in 0..B {
                *out.add(r * B + b) = super::hsum(scaled[r][b]) + minimums[r][b];
            }
        }
        R
    }
}
