//! What a greedy step needs from a row of logits, in a few passes over it and no temporaries:
//! the argmax, the log-normalizer (`logprob(i) = logit(i) − log_normalizer`, libtorch's
//! `log_softmax` in f32) and the most likely alternatives.
//!
//! Why: sampling a step of 32 greedy rows through libtorch (`log_softmax` into a new
//! `[rows, vocab]` tensor, then `argmax`, `gather` and `topk`, on one thread) took ~9% of a
//! served 32-client step on a 2-core Xeon while the other core waited; the same reads here are
//! ~10 µs a row.

/// One row's greedy summary.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSummary {
    /// The first index holding the row's largest value (libtorch's `argmax`).
    pub argmax: usize,
    /// `max + ln Σ exp(x − max)`: subtracted from a logit it gives that token's log-probability.
    pub log_normalizer: f32,
}

/// Values a pass of [`exp_sum`] exponentiates at once (on the stack).
const EXP_CHUNK: usize = 256;

/// The argmax and log-normalizer of `row` (non-empty). A row holding NaN has no meaningful
/// distribution: its normalizer is NaN and its argmax the first non-NaN maximum.
pub fn summarize_row(row: &[f32]) -> RowSummary {
    let max = row_max(row);
    let argmax = row.iter().position(|&v| v == max).unwrap_or(0);
    let log_normalizer = if max.is_finite() {
        max + exp_sum(row, max).ln()
    } else {
        // All −∞ (or +∞ somewhere): what log_softmax gives such a row.
        max
    };
    RowSummary { argmax, log_normalizer }
}

/// The first index holding the row's largest value (NaN ignored; 0 for an all-NaN row).
pub fn argmax(row: &[f32]) -> usize {
    let max = row_max(row);
    // Whole chunks first (a comparison the compiler vectorizes), then the chunk that holds it.
    let chunk = row
        .chunks(64)
        .position(|chunk| chunk.iter().fold(false, |found, &v| found | (v == max)));
    chunk
        .and_then(|chunk| {
            let start = chunk * 64;
            row[start..].iter().position(|&v| v == max).map(|offset| start + offset)
        })
        .unwrap_or(0)
}

/// The largest value, over 16 lanes that the compiler keeps in vector registers (NaN ignored).
pub(crate) fn row_max(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = row.chunks_exact(16);
    for chunk in &mut chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = if v > *lane { v } else { *lane };
        }
    }
    let tail = chunks.remainder().iter().copied();
    lanes
        .into_iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a })
}

/// `Σ exp(x − max)`, exponentiating [`EXP_CHUNK`] values at a time on the stack.
fn exp_sum(row: &[f32], max: f32) -> f32 {
    let mut buffer = [0f32; EXP_CHUNK];
    let mut total = 0f32;
    for chunk in row.chunks(EXP_CHUNK) {
        let shifted = &mut buffer[..chunk.len()];
        for (s, &v) in shifted.iter_mut().zip(chunk) {
            *s = v - max;
        }
        crate::exp_in_place(shifted);
        let mut lanes = [0f32; 16];
        let mut values = shifted.chunks_exact(16);
        for part in &mut values {
            lanes.iter_mut().zip(part).for_each(|(l, v)| *l += v);
        }
        total += lanes.iter().sum::<f32>() + values.remainder().iter().sum::<f32>();
    }
    total
}

/// The `k` largest values of `row` with their indices into `out`, largest first, ties in index
/// order (what libtorch's sorted `topk` returns on distinct values). NaN values are skipped.
pub fn top_entries(row: &[f32], k: usize, out: &mut Vec<(usize, f32)>) {
    out.clear();
    if k == 0 {
        return;
    }
    for (index, &value) in row.iter().enumerate() {
        // NaN, or not above the smallest kept once full: not among the k largest.
        if value.is_nan() || (out.len() == k && value <= out[k - 1].1) {
            continue;
        }
        if out.len() == k {
            out.pop();
        }
        // After every kept value at least as large: equal values stay in index order.
        let at = out.partition_point(|&(_, kept)| kept >= value);
        out.insert(at, (index, value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The f64 reference: max, then `max + ln Σ exp(x − max)`.
    fn reference(row: &[f32]) -> (usize, f64) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let argmax = row.iter().position(|&v| v == max).expect("a maximum");
        let sum: f64 = row.iter().map(|&v| (f64::from(v) - f64::from(max)).exp()).sum();
        (argmax, f64::from(max) + sum.ln())
    }

    fn pseudo_random_row(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 40.0 - 20.0
            })
            .collect()
    }

    #[test]
    fn summaries_match_an_f64_log_softmax_at_odd_lengths() {
        for (len, seed) in [(1, 1), (15, 2), (17, 3), (255, 4), (257, 5), (49_152, 6), (50_001, 7)] {
            let row = pseudo_random_row(len, seed);
            let summary = summarize_row(&row);
            let (argmax, normalizer) = reference(&row);
            assert_eq!(summary.argmax, argmax, "length {len}");
            assert!(
                (f64::from(summary.log_normalizer) - normalizer).abs() < 1e-5 * normalizer.abs().max(1.0),
                "length {len}: {} vs {normalizer}",
                summary.log_normalizer
            );
        }
    }

    #[test]
    fn the_first_of_equal_maxima_wins() {
        let row = [1.0f32, 3.0, -2.0, 3.0, 3.0, 0.0];
        assert_eq!(summarize_row(&row).argmax, 1);
        let mut top = Vec::new();
        top_entries(&row, 4, &mut top);
        assert_eq!(top, vec![(1, 3.0), (3, 3.0), (4, 3.0), (0, 1.0)]);
    }

    #[test]
    fn top_entries_are_the_largest_in_order() {
        let row = pseudo_random_row(4_099, 11);
        let mut sorted: Vec<(usize, f32)> = row.iter().copied().enumerate().collect();
        sorted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut top = Vec::new();
        for k in [1, 2, 5, 20] {
            top_entries(&row, k, &mut top);
            assert_eq!(top, sorted[..k], "k = {k}");
        }
        top_entries(&row[..3], 5, &mut top);
        assert_eq!(top.len(), 3, "a row shorter than k gives all of it");
    }

    #[test]
    fn infinite_and_nan_rows_do_not_panic() {
        let masked = [f32::NEG_INFINITY, 2.0, f32::NEG_INFINITY];
        let summary = summarize_row(&masked);
        assert_eq!(summary.argmax, 1);
        assert!((summary.log_normalizer - 2.0).abs() < 1e-6);
        let nan = [f32::NAN, 1.0];
        assert_eq!(summarize_row(&nan).argmax, 1);
        let mut top = Vec::new();
        top_entries(&nan, 2, &mut top);
        assert_eq!(top, vec![(1, 1.0)]);
    }
}
