//! Row-wise operations of a Llama block, each one pass over its row with no temporaries (what
//! libtorch did as ~6 separate kernels and intermediate tensors per norm or rotation).

use rayon::prelude::*;

/// Rows a parallel task of the row-wise passes takes at least: a row of a small model's hidden
/// state is ~1 µs of work, so fewer rows would cost more in hand-offs than they save.
const ROWS_PER_TASK: usize = 8;

/// RMSNorm of each `width`-value row of `x` into `out`: `x / sqrt(mean(x²) + eps) · weight`, in
/// f32 as Hugging Face's `LlamaRMSNorm`. Rows run in parallel.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len();
    out.par_chunks_exact_mut(width)
        .zip(x.par_chunks_exact(width))
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(dst, row)| norm_row(row, weight, eps, dst));
}

/// `hidden += residual`, then [`rms_norm`] of the sum into `out`: the residual stream's update
/// after a projection and the next norm, one pass over each row, rows in parallel. Before, the
/// two ran one after the other on the step's thread while the other cores waited.
pub fn add_rms_norm(hidden: &mut [f32], residual: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len();
    hidden
        .par_chunks_exact_mut(width)
        .zip(residual.par_chunks_exact(width))
        .zip(out.par_chunks_exact_mut(width))
        .with_min_len(ROWS_PER_TASK)
        .for_each(|((row, added), dst)| {
            for (h, r) in row.iter_mut().zip(added) {
                *h += r;
            }
            norm_row(row, weight, eps, dst);
        });
}

fn norm_row(row: &[f32], weight: &[f32], eps: f32, dst: &mut [f32]) {
    let mean_square = crate::dot(row, row) / weight.len() as f32;
    let scale = 1.0 / (mean_square + eps).sqrt();
    for ((o, v), w) in dst.iter_mut().zip(row).zip(weight) {
        *o = v * scale * w;
    }
}

/// Rotary position embedding in the interleaved layout (pairs `(2i, 2i + 1)`), llama.cpp's
/// `rope_f32` with `GGML_ROPE_TYPE_NORM`, which GGUF's permuted Q/K rows expect.
pub struct RopeTable {
    half_dim: usize,
    /// `[positions][half_dim]` cosines and sines, computed in f64 and rounded.
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(head_dim: usize, theta: f64, max_positions: usize) -> Self {
        let half_dim = head_dim / 2;
        let mut cos = Vec::with_capacity(max_positions * half_dim);
        let mut sin = Vec::with_capacity(max_positions * half_dim);
        for position in 0..max_positions {
            for i in 0..half_dim {
                let inv_freq = 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64);
                let angle = position as f64 * inv_freq;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Self { half_dim, cos, sin }
    }

    pub fn max_positions(&self) -> usize {
        self.cos.len() / self.half_dim.max(1)
    }

    /// Rotates every head (`2 · half_dim` values each) of `row` for `position`
    /// (which the caller checked is below [`Self::max_positions`]).
    pub fn rotate(&self, row: &mut [f32], position: usize) {
        let at = position * self.half_dim;
        let (cos, sin) = (&self.cos[at..at + self.half_dim], &self.sin[at..at + self.half_dim]);
        for head in row.chunks_exact_mut(2 * self.half_dim) {
            for (pair, (c, s)) in head.chunks_exact_mut(2).zip(cos.iter().zip(sin)) {
                let (even, odd) = (pair[0], pair[1]);
                pair[0] = even * c - odd * s;
                pair[1] = even * s + odd * c;
            }
        }
    }
}

/// Rotates the query and key heads of each row of a step's `[q | k | v]` projection
/// (`row_width` values a row: `q_width` of queries, then `k_width` of keys) for its position,
/// rows in parallel. Every position must be below [`RopeTable::max_positions`].
pub fn rotate_queries_and_keys(
    table: &RopeTable,
    qkv: &mut [f32],
    row_width: usize,
    q_width: usize,
    k_width: usize,
    positions: &[i64],
) {
    qkv.par_chunks_exact_mut(row_width)
        .zip(positions.par_iter())
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(row, &position)| {
            let (q, rest) = row.split_at_mut(q_width);
            table.rotate(q, position as usize);
            table.rotate(&mut rest[..k_width], position as usize);
        });
}

/// SwiGLU's `silu(gate) · up` for each row of `gate_up` (`[gate | up]`, `2 · width` values) into
/// `out` (`width` values per row). Rows run in parallel: the exponentials dominate.
pub fn silu_mul(gate_up: &[f32], width: usize, out: &mut [f32]) {
    out.par_chunks_mut(width)
        .zip(gate_up.par_chunks(2 * width))
        .for_each(|(dst, row)| {
            let (gate, up) = row.split_at(width);
            crate::simd::silu_mul(gate, up, dst);
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_its_definition() {
        let x = [1.0f32, -2.0, 3.0, 0.5, 4.0, 4.0, -4.0, 0.0];
        let weight = [0.5f32, 1.0, 2.0, -1.0];
        let mut out = [0f32; 8];
        rms_norm(&x, &weight, 1e-5, &mut out);
        for (row, dst) in x.chunks(4).zip(out.chunks(4)) {
            let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / 4.0;
            for i in 0..4 {
                let expected = row[i] as f64 / (ms + 1e-5).sqrt() * weight[i] as f64;
                assert!((dst[i] as f64 - expected).abs() < 1e-5, "{} vs {expected}", dst[i]);
            }
        }
    }

    /// Rows of a hidden state with values across signs and magnitudes.
    fn rows(count: usize, width: usize, seed: f32) -> Vec<f32> {
        (0..count * width)
            .map(|i| (i as f32 * 0.37 + seed).sin() * 3.0)
            .collect()
    }

    #[test]
    fn add_rms_norm_is_the_add_then_the_norm_on_every_row() {
        let width = 24;
        let weight: Vec<f32> = (0..width).map(|i| 0.5 + 0.1 * i as f32).collect();
        // 21 rows: several parallel tasks and a short last one.
        let mut hidden = rows(21, width, 0.0);
        let residual = rows(21, width, 1.0);
        let mut expected_hidden = hidden.clone();
        for (h, r) in expected_hidden.iter_mut().zip(&residual) {
            *h += r;
        }
        let mut expected = vec![0f32; hidden.len()];
        for (row, dst) in expected_hidden.chunks(width).zip(expected.chunks_mut(width)) {
            norm_row(row, &weight, 1e-5, dst);
        }
        let mut out = vec![f32::NAN; hidden.len()];
        add_rms_norm(&mut hidden, &residual, &weight, 1e-5, &mut out);
        assert_eq!(hidden, expected_hidden);
        assert_eq!(out, expected);
    }

    #[test]
    fn queries_and_keys_rotate_by_their_rows_position_and_values_stay() {
        let table = RopeTable::new(4, 10_000.0, 64);
        // Each row: two query heads, one key head, one value head of 4 values.
        let (q_width, k_width, row_width) = (8, 4, 16);
        let positions: Vec<i64> = (0..19).map(|i| (i * 3) % 64).collect();
        let mut qkv = rows(positions.len(), row_width, 2.0);
        let mut expected = qkv.clone();
        for (row, &position) in expected.chunks_mut(row_width).zip(&positions) {
            table.rotate(&mut row[..q_width], position as usize);
            table.rotate(&mut row[q_width..q_width + k_width], position as usize);
        }
        rotate_queries_and_keys(&table, &mut qkv, row_width, q_width, k_width, &positions);
        assert_eq!(qkv, expected);
    }

    #[test]
    fn rope_rotates_adjacent_pairs_by_position() {
        let table = RopeTable::new(4, 10_000.0, 8);
        let mut row = [1.0f32, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0];
        table.rotate(&mut row, 3);
        // Pair 0 of each head turns by 3 rad, pair 1 by 3 / 100 rad.
        let (a0, a1): (f64, f64) = (3.0, 3.0 / 100.0);
        let expected = [
            a0.cos(),
            a0.sin(),
            a1.cos(),
            a1.sin(),
            -a0.sin(),
            a0.cos(),
            -a1.sin(),
            a1.cos(),
        ];
        for (got, want) in row.iter().zip(expected) {
            assert!((*got as f64 - want).abs() < 1e-6, "{got} vs {want}");
        }
        // Position 0 is the identity.
        let mut unmoved = [0.3f32, -0.7, 1.5, 2.0];
        table.rotate(&mut unmoved, 0);
        assert_eq!(unmoved, [0.3, -0.7, 1.5, 2.0]);
    }

    #[test]
    fn silu_mul_matches_its_definition() {
        // 19 values: two whole vectors and a tail; gates across the range a model produces.
        let width = 19;
        let gate: Vec<f32> = (0..width).map(|i| -30.0 + 3.3 * i as f32).collect();
        let up: Vec<f32> = (0..width).map(|i| 0.5 - 0.1 * i as f32).collect();
        let gate_up: Vec<f32> = gate.iter().chain(&up).copied().collect();
        let mut out = vec![0f32; width];
        silu_mul(&gate_up, width, &mut out);
        for i in 0..width {
            let g = gate[i] as f64;
            let expected = g / (1.0 + (-g).exp()) * up[i] as f64;
            assert!(
                (out[i] as f64 - expected).abs() <= 1e-6 * expected.abs().max(1.0),
                "{i}: {} vs {expected}",
                out[i]
            );
        }
    }

    #[test]
    fn silu_mul_is_bit_for_bit_the_three_passes_it_replaced() {
        // Many vectors and a tail, gates across the range a model produces.
        let width = 1541;
        let gate: Vec<f32> = (0..width).map(|i| (i as f32 * 0.61).sin() * 12.0).collect();
        let up: Vec<f32> = (0..width).map(|i| (i as f32 * 0.23).cos() * 3.0).collect();
        let mut expected: Vec<f32> = gate.iter().map(|g| -g).collect();
        crate::exp_in_place(&mut expected);
        for ((e, g), u) in expected.iter_mut().zip(&gate).zip(&up) {
            *e = g / (1.0 + *e) * u;
        }
        let mut out = vec![0f32; width];
        crate::simd::silu_mul(&gate, &up, &mut out);
        for (i, (got, want)) in out.iter().zip(&expected).enumerate() {
            assert_eq!(got.to_bits(), want.to_bits(), "{i}: {got} vs {want}");
        }
    }

    #[test]
    fn exp_is_within_a_few_ulp_of_libm() {
        let mut values: Vec<f32> = (0..2000).map(|i| -87.0 + 0.0875 * i as f32).collect();
        let expected: Vec<f64> = values.iter().map(|v| (*v as f64).exp()).collect();
        crate::exp_in_place(&mut values);
        for (got, want) in values.iter().zip(expected) {
            assert!(
                ((*got as f64) - want).abs() <= 4.0 * f32::EPSILON as f64 * want,
                "{got} vs {want}"
            );
        }
    }
}
