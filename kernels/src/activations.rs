//! Activation rows as 16-bit integers per block of 32 values, for the integer GEMV
//! ([`crate::simd::gemv_i16_rows_avx2`]).
//!
//! Why: at one or two sequences a step is bound by the instructions that turn each quantized
//! weight into an f32 (unpack, widen, convert, scale — ~30 per block of 32) rather than by memory.
//! With the activations as integers, a block of Q4/Q8 weights multiplies them with two
//! `vpmaddwd` (16-bit products summed in exact 32-bit integers) and is scaled once: about half
//! the instructions.
//!
//! What it costs in precision: each block of 32 activations shares one scale `s = max|x| / 32767`
//! and each value becomes `round(x / s)`, off by at most `s / 2` — 2⁻¹⁶ of the block's largest
//! value (f16 keeps 2⁻¹¹ of each value, f32 2⁻²⁴). The integer products and their sums are exact,
//! so a dot product is off by at most `Σ |w| · s / 2` over its blocks plus f32 rounding; the kernel
//! tests assert that bound. llama.cpp quantizes activations to 8 bits for the same reason, with
//! 256× the error. Q4_1's `m · Σx` term uses the exact f32 sums ([`QuantizedRows::lane_sums`]).

/// Values per block: one scale each (the GGUF block size of the formats the path serves).
pub const BLOCK: usize = 32;

/// The largest magnitude a quantized value takes (symmetric, so `-32768` never appears).
const LEVELS: f32 = 32767.0;

/// `rows` activation rows of `blocks · 32` values each, quantized block by block.
#[derive(Debug, Default)]
pub struct QuantizedRows {
    blocks: usize,
    rows: usize,
    /// `[rows][blocks][32]`: `round(x / scale)`.
    values: Vec<i16>,
    /// `[rows][blocks]`: the block's scale, `max|x| / 32767` (0 for an all-zero block).
    scales: Vec<f32>,
    /// `[rows][blocks][8]`: lane `l` holds `x[l] + x[8 + l] + x[16 + l] + x[24 + l]` of the block,
    /// in f32 from the unquantized values, so that the 8 lanes sum to the block's `Σx`.
    lane_sums: Vec<f32>,
}

impl QuantizedRows {
    /// Quantizes `rows` rows of `x` (`[rows][cols]`, `cols` a multiple of 32).
    pub fn new(x: &[f32], rows: usize, cols: usize) -> Self {
        assert!(cols.is_multiple_of(BLOCK) && x.len() == rows * cols);
        let blocks = cols / BLOCK;
        let mut quantized = Self {
            blocks,
            rows,
            values: vec![0; rows * cols],
            scales: vec![0.0; rows * blocks],
            lane_sums: vec![0.0; rows * blocks * 8],
        };
        let chunks = x
            .chunks_exact(BLOCK)
            .zip(quantized.values.chunks_exact_mut(BLOCK))
            .zip(quantized.scales.iter_mut())
            .zip(quantized.lane_sums.chunks_exact_mut(8));
        for (((block, values), scale), lane_sums) in chunks {
            let max = block.iter().fold(0f32, |max, v| max.max(v.abs()));
            *scale = max / LEVELS;
            let inverse = if max > 0.0 { LEVELS / max } else { 0.0 };
            for (value, &x) in values.iter_mut().zip(block) {
                // `as` saturates (and maps NaN to 0); the clamp keeps a value rounded up past
                // the largest level inside the symmetric range.
                *value = (x * inverse).round().clamp(-LEVELS, LEVELS) as i16;
            }
            for (lane, sum) in lane_sums.iter_mut().enumerate() {
                *sum = block[lane] + block[8 + lane] + block[16 + lane] + block[24 + lane];
            }
        }
        quantized
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    pub fn values(&self) -> &[i16] {
        &self.values
    }

    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    pub fn lane_sums(&self) -> &[f32] {
        &self.lane_sums
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_within_half_a_step_and_sums_are_exact_f32() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 37 % 64) as f32 - 31.5) * 0.013).collect();
        let quantized = QuantizedRows::new(&x, 1, 64);
        assert_eq!(quantized.blocks(), 2);
        for (block, chunk) in x.chunks(32).enumerate() {
            let scale = quantized.scales()[block];
            let max = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(scale, max / 32767.0);
            for (i, &v) in chunk.iter().enumerate() {
                let q = quantized.values()[block * 32 + i];
                assert_ne!(q, i16::MIN, "the range is symmetric: -32768 is never produced");
                assert!((q as f32 * scale - v).abs() <= scale * 0.5001, "{v} → {q}");
            }
            let lanes: f32 = quantized.lane_sums()[block * 8..block * 8 + 8].iter().sum();
            let exact: f32 = chunk.iter().sum();
            assert!((lanes - exact).abs() <= 1e-5);
        }
    }

    #[test]
    fn zero_blocks_have_zero_scale() {
        let quantized = QuantizedRows::new(&[0.0; 32], 1, 32);
        assert_eq!(quantized.scales(), &[0.0]);
        assert!(quantized.values().iter().all(|&v| v == 0));
    }
}
