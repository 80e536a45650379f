//! Activations split for the AMX tiles ([`super`]): each f32 value as three bf16 whose sum is
//! the value (`x = hi + mid + lo + ε`, `|ε| ≤ 2⁻²⁴·|x|`: f32's 24 significant bits), laid out
//! tile by tile. Plain Rust, no `unsafe`: the rounding is written so that the compiler
//! vectorizes it.

use rayon::prelude::*;

use super::TILE_ROWS;
use crate::simd::panel_gemv::block_sum;

/// An activation matrix split for the tiles, tile by tile and block by block: for each tile of
/// 16 rows (zero rows pad the last) and each block of 32 columns, the `hi`, `mid` and `lo`
/// tiles (`[16][32]` bf16 bits each, [`A_BLOCK`] values together), and the block sums of the 16
/// rows (`[tile][block][16]`, what 4-bit panels meet their offsets with).
#[derive(Debug, Default)]
pub struct SplitActivations {
    pub(super) tiles_data: Vec<ActivationRow>,
    pub(super) sums: Vec<f32>,
    pub(super) blocks: usize,
    pub(super) rows: usize,
}

impl Drop for SplitActivations {
    fn drop(&mut self) {
        // An empty split (a product on another path) leaves the spare buffers as they are.
        if self.tiles_data.capacity() > 0 {
            SPARE_BUFFERS.set((std::mem::take(&mut self.tiles_data), std::mem::take(&mut self.sums)));
        }
    }
}

/// One row of an activation tile: 32 bf16 on a cache line of its own (a tile row that
/// straddled two lines would cost two line reads).
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct ActivationRow(pub(super) [u16; 32]);

thread_local! {
    /// The buffers of the last [`SplitActivations`] this thread dropped, for its next one.
    static SPARE_BUFFERS: std::cell::Cell<(Vec<ActivationRow>, Vec<f32>)> = const { std::cell::Cell::new((Vec::new(), Vec::new())) };
}

/// Values of one block's `hi`, `mid` and `lo` tiles.
pub(super) const A_BLOCK: usize = 3 * TILE_ROWS * 32;

/// The nearest bf16 to `x` (ties to even), as bits; a NaN stays a (quiet) NaN and an infinity
/// stays one. The few finite values that round up to infinity (|x| ≥ 3.39e38) are truncated
/// instead, so that the parts of a split still sum to `x`.
pub(super) fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16 & 0x8000) | 0x7FC0;
    }
    if !fits_bf16_rounding(x) {
        return (bits >> 16) as u16;
    }
    bf16_bits_of_ordinary(x)
}

/// Whether `x` is finite and rounds to a finite bf16 (every activation a model produces).
fn fits_bf16_rounding(x: f32) -> bool {
    x.to_bits() & 0x7FFF_FFFF < 0x7F7F_8000
}

/// [`bf16_bits`] for a value that [`fits_bf16_rounding`]: branch-free, so the split's loops
/// vectorize (the special cases' branches made a 128-row product 72 ms instead of 57). No wrap:
/// such a value's bits plus 0x8000 stay below 2³².
fn bf16_bits_of_ordinary(x: f32) -> u16 {
    let bits = x.to_bits();
    ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) as u16
}

/// A block's 32 values as three bf16 parts each (`hi`, `mid`, `lo`), in a form the compiler
/// vectorizes.
fn split_block(values: &[f32; 32]) -> [[u16; 32]; 3] {
    // The remainders of an ordinary value are ordinary too (each is at most half an ulp of the
    // part before), so one check covers all three roundings.
    if values.iter().all(|&v| fits_bf16_rounding(v)) {
        split_with(values, bf16_bits_of_ordinary)
    } else {
        split_with(values, bf16_bits)
    }
}

#[inline(always)]
fn split_with(values: &[f32; 32], round: impl Fn(f32) -> u16) -> [[u16; 32]; 3] {
    let widen = |bits: u16| f32::from_bits(u32::from(bits) << 16);
    let mut parts = [[0u16; 32]; 3];
    for (c, &v) in values.iter().enumerate() {
        let hi = round(v);
        let rest = v - widen(hi);
        let mid = round(rest);
        parts[0][c] = hi;
        parts[1][c] = mid;
        parts[2][c] = round(rest - widen(mid));
    }
    parts
}

impl SplitActivations {
    /// Tiles of 16 rows the split holds (zero rows pad the last).
    pub(super) fn tiles(&self) -> usize {
        self.rows.div_ceil(TILE_ROWS)
    }

    /// Splits `batch` rows of `cols` values (whole blocks; row `b` of `x` at `b * x_stride`).
    pub fn new(x: &[f32], x_stride: usize, batch: usize, cols: usize) -> Self {
        let blocks = cols / 32;
        let tiles = batch.div_ceil(TILE_ROWS);
        // Last product's buffers, refilled: a fresh allocation of this size is fresh pages from
        // the kernel, zeroed one fault at a time (9% of a 32-row step went there).
        let (mut tiles_data, mut sums) = SPARE_BUFFERS.take();
        tiles_data.clear();
        tiles_data.resize(tiles * blocks * A_BLOCK / 32, ActivationRow([0; 32]));
        sums.clear();
        sums.resize(tiles * blocks * TILE_ROWS, 0.0);
        // One task per (tile, block): its three tiles' rows and its 16 block sums, on the
        // pool's threads (serial, this took a fifth of a 128-row product).
        tiles_data
            .par_chunks_mut(3 * TILE_ROWS)
            .zip(sums.par_chunks_mut(TILE_ROWS))
            .enumerate()
            .for_each(|(at, (rows, sums))| {
                let (tile, block) = (at / blocks, at % blocks);
                for (m, sum) in sums.iter_mut().enumerate().take(batch.saturating_sub(tile * TILE_ROWS)) {
                    // Whole blocks of a row of `x` (`matmul` checked its length).
                    let Some(values) = x[(tile * TILE_ROWS + m) * x_stride + block * 32..].first_chunk::<32>() else {
                        continue;
                    };
                    let parts = split_block(values);
                    for (part, bits) in parts.into_iter().enumerate() {
                        rows[part * TILE_ROWS + m] = ActivationRow(bits);
                    }
                    *sum = block_sum(values);
                }
            });
        Self {
            tiles_data,
            sums,
            blocks,
            rows: batch,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NaN and infinities keep their kind; the largest finite values split into finite parts
    /// that sum back to them.
    #[test]
    fn rounding_keeps_special_values() {
        let widen = |bits: u16| f32::from_bits(u32::from(bits) << 16);
        for nan in [
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0xFFFF_FFFF),
            f32::from_bits(0x7FFF_8000),
        ] {
            assert!(widen(bf16_bits(nan)).is_nan(), "{:#x}", nan.to_bits());
        }
        assert_eq!(widen(bf16_bits(f32::INFINITY)), f32::INFINITY);
        assert_eq!(widen(bf16_bits(f32::NEG_INFINITY)), f32::NEG_INFINITY);
        for big in [f32::MAX, -f32::MAX, 3.4e38] {
            let parts = split_block(&[big; 32]);
            let sum: f64 = parts.iter().map(|p| f64::from(widen(p[0]))).sum();
            assert!(parts.iter().all(|p| widen(p[0]).is_finite()), "{big}");
            assert!(
                (sum - f64::from(big)).abs() <= f64::from(big.abs()) * 2f64.powi(-24),
                "{big}"
            );
        }
    }

    /// `hi + mid + lo` is within 2⁻²⁴ of each activation (relative), zero rows pad the last
    /// tile, and the block sums sit where the kernel reads them.
    #[test]
    fn split_activations_keep_f32_bits() {
        let (batch, cols) = (19, 64);
        let x: Vec<f32> = (0..batch * cols)
            .map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.1)
            .collect();
        let split = SplitActivations::new(&x, cols, batch, cols);
        assert_eq!((split.tiles(), split.blocks), (2, 2));
        let widen = |bits: u16| f64::from(f32::from_bits(u32::from(bits) << 16));
        for tile in 0..2 {
            for block in 0..2 {
                let at = (tile * 2 + block) * A_BLOCK;
                for m in 0..TILE_ROWS {
                    let b = tile * TILE_ROWS + m;
                    for c in 0..32 {
                        let parts = [0, 1, 2].map(|part| split.tiles_data[(at + part * TILE_ROWS * 32) / 32 + m].0[c]);
                        if b >= batch {
                            assert_eq!(parts, [0; 3]);
                            continue;
                        }
                        let v = f64::from(x[b * cols + block * 32 + c]);
                        let error = (parts.iter().map(|&p| widen(p)).sum::<f64>() - v).abs();
                        assert!(error <= v.abs() * 2f64.powi(-24), "{v}: {parts:x?}");
                    }
                    let sum = split.sums[(tile * 2 + block) * TILE_ROWS + m];
                    let expected: f32 = if b < batch {
                        x[b * cols + block * 32..][..32].iter().sum()
                    } else {
                        0.0
                    };
                    assert!((sum - expected).abs() <= 1e-4, "{sum} {expected}");
                }
            }
        }
    }
}
