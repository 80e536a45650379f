//! Q4_1 rows times one or two f32 activation rows, with the minimum factored out of each block:
//! `Σ (d·q + m)·x = d·Σ q·x + m·Σ x`. Part of [`super`]'s `unsafe`, under its invariants.
//!
//! Why: one decoding sequence is bound by the instructions that turn each block into f32, not by
//! memory (Q4_1 streamed at ~10 GB/s where Q8_0, with fewer per weight, reached ~24). Factored,
//! a block costs four multiplies by `x` and one FMA by `d` instead of eight FMAs, and `m` meets
//! the block's activation sum `Σ x` (computed once per activation row for all weight rows) in
//! one FMA. The nibbles are masked in place rather than widened byte by byte ([`nibble_source`];
//! the activations are reordered to meet them), which took a single-threaded step's projections
//! from 15.4 to 8.3 ms (`PROJECTIONS_DISTINCT=1` in the projections bench, weights in cache). The
//! arithmetic stays f32 on the exact GGUF values: only the order of the sums changes (the kernel
//! tests hold it to the same tolerance against an f64 product).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{fits, has_avx2, strided_len};

/// Activation rows this path takes at most; more share each decoded block better in the
/// general GEMV.
pub const GEMV_Q4_1_MAX_BATCH: usize = 2;

/// Bytes of a Q4_1 block: f16 `d`, f16 `m`, 16 bytes of nibbles.
const BLOCK_BYTES: usize = 20;

/// Where value `lane` of vector `vector` of a block's decoded nibbles comes from: its element
/// (0..32) in GGUF's order, and the power of two it arrives scaled by.
///
/// The kernel broadcasts the block's 16 bytes of nibbles to both halves of a register, so each
/// 32-bit lane holds bytes `4i..4i + 4`, and masks one nibble per lane, leaving it in place: the
/// lane then converts to `q · 2^(8j)` exactly (a 4-bit integer times a power of two). No byte
/// has to be moved across lanes (the shuffles that widened bytes to 32 bits were the costliest
/// part of a block); the activations are reordered and scaled by `2^(-8j)` once per step instead,
/// which is exact (a power of two), so each product `q · x` is the same f32 as before.
const fn nibble_source(vector: usize, lane: usize) -> (usize, i32) {
    // Nibble position p (0..8) of the 32-bit lane: byte p / 2, low nibble when p is even.
    // Vectors 0 and 1 mask the even positions of the bytes as loaded; vectors 2 and 3 the odd
    // ones, from a copy shifted right by 4 bits. Lanes 0..4 and 4..8 take different positions.
    const POSITIONS: [[usize; 2]; 4] = [[0, 2], [4, 6], [1, 3], [5, 7]];
    let p = POSITIONS[vector][lane / 4];
    let byte = 4 * (lane % 4) + p / 2;
    (byte + 16 * (p % 2), 8 * (p / 2) as i32)
}

/// A step's activations as [`gemv_q4_1_avx2`] reads them: each 32-value block reordered and
/// scaled to meet the nibbles where the kernel leaves them ([`nibble_source`]), and each
/// block's `Σ x` (for the minimum).
#[derive(Debug, Default)]
pub struct Q4_1Activations {
    /// `[batch][cols]`, block by block in the kernel's order.
    values: Vec<f32>,
    /// `[batch][cols / 32]` pairs `(0, Σ x)`: the kernel multiplies a pair by the block's
    /// `(d, m)` as converted, so `m · Σ x` is one FMA on the vector it already has.
    sums: Vec<f32>,
    cols: usize,
    batch: usize,
}

impl Q4_1Activations {
    /// From `batch` rows of `cols` values (row `b` at `b * x_stride`); `cols` whole blocks.
    pub fn new(x: &[f32], x_stride: usize, batch: usize, cols: usize) -> Self {
        assert!(cols.is_multiple_of(32));
        let mut values = Vec::with_capacity(batch * cols);
        let mut sums = Vec::with_capacity(batch * cols / 16);
        for b in 0..batch {
            for block in x[b * x_stride..b * x_stride + cols].chunks_exact(32) {
                for vector in 0..4 {
                    values.extend((0..8).map(|lane| {
                        let (element, shift) = nibble_source(vector, lane);
                        // 2^-shift, exactly.
                        block[element] * f32::from_bits(((127 - shift) as u32) << 23)
                    }));
                }
                // Eight lane sums added at the end: the order a vectorized loop keeps.
                let mut lanes = [0f32; 8];
                for chunk in block.chunks_exact(8) {
                    lanes.iter_mut().zip(chunk).for_each(|(l, v)| *l += v);
                }
                sums.extend([0.0, lanes.iter().sum::<f32>()]);
            }
        }
        Self {
            values,
            sums,
            cols,
            batch,
        }
    }
}

/// `out[r * batch + b] = Σ_k w_r[k] · x[b][k]` for `rows` Q4_1 rows (row `r` at
/// `r * row_bytes` in `data`, whole blocks) and the activation rows of `x`
/// (`batch ≤ GEMV_Q4_1_MAX_BATCH`).
pub fn gemv_q4_1_avx2(data: &[u8], row_bytes: usize, rows: usize, x: &Q4_1Activations, out: &mut [f32]) {
    let Q4_1Activations {
        values,
        sums,
        cols,
        batch,
    } = x;
    let (cols, batch) = (*cols, *batch);
    assert!(has_avx2());
    assert!(cols.is_multiple_of(32) && (1..=GEMV_Q4_1_MAX_BATCH).contains(&batch));
    assert!(fits(out.len(), rows.checked_mul(batch)));
    let blocks = cols / 32;
    let row_len = blocks * BLOCK_BYTES;
    assert!(row_bytes >= row_len && fits(data.len(), strided_len(rows, row_bytes, row_len)));
    assert!(fits(values.len(), batch.checked_mul(cols)));
    assert!(fits(sums.len(), blocks.checked_mul(2 * batch)));
    let x_stride = cols;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 present; `data` holds every row's blocks, `x` every activation row read,
    // `sums` every block sum, `out` every result written (asserted above).
    unsafe {
        let (w, x, sums, out) = (data.as_ptr(), values.as_ptr(), sums.as_ptr(), out.as_mut_ptr());
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
    // rows of `blocks · 32` values, `sums` `B · blocks` pairs and `out` `R · B` results (caller).
    unsafe {
        let mut scaled = [[_mm256_setzero_ps(); B]; R];
        // Lane 1 gathers `Σ m · Σ x`; the others stay 0 (the pairs' lane 0 is 0 and d·0 = 0,
        // lanes 2 and 3 convert zero bits).
        let mut minimums = [[_mm_setzero_ps(); B]; R];
        // Lanes 0..4 keep one nibble position of their 32-bit lane, lanes 4..8 another
        // (`nibble_source`).
        let near = _mm256_setr_epi32(0xF, 0xF, 0xF, 0xF, 0xF00, 0xF00, 0xF00, 0xF00);
        let far = _mm256_setr_epi32(
            0xF_0000, 0xF_0000, 0xF_0000, 0xF_0000, 0xF00_0000, 0xF00_0000, 0xF00_0000, 0xF00_0000,
        );
        for block in 0..blocks {
            for r in 0..R {
                let base = rows.add(r * row_bytes + block * BLOCK_BYTES);
                // As in the general GEMV: the hardware prefetcher alone leaves one row waiting
                // on memory. A hint only (it never faults), so it may point past the data.
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(1024).cast());
                // d and m are adjacent f16: one 32-bit load, one conversion.
                let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(base.cast::<i32>().read_unaligned()));
                let d = _mm256_broadcastss_ps(dm);
                let bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(base.add(4).cast()));
                let shifted = _mm256_srli_epi32(bytes, 4);
                let w = [
                    _mm256_cvtepi32_ps(_mm256_and_si256(bytes, near)),
                    _mm256_cvtepi32_ps(_mm256_and_si256(bytes, far)),
                    _mm256_cvtepi32_ps(_mm256_and_si256(shifted, near)),
                    _mm256_cvtepi32_ps(_mm256_and_si256(shifted, far)),
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
                    let pair = _mm_castpd_ps(_mm_load_sd(sums.add(2 * (b * blocks + block)).cast()));
                    minimums[r][b] = _mm_fmadd_ps(dm, pair, minimums[r][b]);
                }
            }
        }
        for r in 0..R {
            for b in 0..B {
                *out.add(r * B + b) = super::hsum(scaled[r][b]) + _mm_cvtss_f32(_mm_movehdup_ps(minimums[r][b]));
            }
        }
        R
    }
}

#[cfg(test)]
mod tests {
    use super::nibble_source;

    /// The kernel's masks keep positions {0, 2}, {4, 6} (the bytes as loaded) and {1, 3}, {5, 7}
    /// (shifted right by 4) per lane half: every element of a block must come out exactly once,
    /// scaled by the power of two its position leaves it at.
    #[test]
    fn nibble_order_takes_every_element_once_at_its_scale() {
        let mut seen = [false; 32];
        for vector in 0..4 {
            for lane in 0..8 {
                let (element, shift) = nibble_source(vector, lane);
                assert!(!seen[element], "element {element} comes out twice");
                seen[element] = true;
                // Byte `element % 16` sits at byte `element % 4` of its 32-bit lane, and the mask
                // leaves its nibble at the low end of that byte.
                assert_eq!(shift, 8 * (element % 16 % 4) as i32);
                assert_eq!(lane % 4, element % 16 / 4, "a lane reads its own 4 bytes");
            }
        }
        assert!(seen.iter().all(|&s| s));
    }
}
