//! Greedy steps sampled straight from the CPU kernels' logits, without libtorch: each row's
//! argmax, its log-probability and the most likely alternatives ([`rivulet_kernels::logits`]),
//! rows in parallel on the kernels' threads.
//!
//! Why: through libtorch a step of 32 greedy rows copied the logits into a tensor and read them
//! four times on one thread (`log_softmax` into a new tensor, `argmax`, `gather`, `topk`), ~9%
//! of a served 32-client step on a 2-core Xeon while the other core waited. A step that draws
//! at random or applies penalties still goes through [`crate::sampler`], which owns those.

use rayon::prelude::*;
use rivulet_kernels::logits::{summarize_row, top_entries};
use tch::Tensor;

use crate::error::WorkerError;
use crate::sampler::Sampled;

/// Every sampled row's greedy choice, `[rows]`, and `[rows][top]` alternatives.
#[derive(Debug, Default)]
pub struct GreedyRows {
    pub tokens: Vec<i64>,
    pub logprobs: Vec<f32>,
    pub top: usize,
    pub top_ids: Vec<i64>,
    pub top_values: Vec<f32>,
}

/// One row's choice and its alternatives `(token, logprob)`.
struct RowChoice {
    token: usize,
    logprob: f32,
    alternatives: Vec<(usize, f32)>,
}

/// The greedy choice of each `vocab`-wide row of `logits`, with `top` alternatives each (their
/// log-probabilities, largest first). Runs on the current rayon pool.
pub fn sample_greedy(logits: &[f32], vocab: usize, top: usize) -> GreedyRows {
    let choices: Vec<RowChoice> = logits
        .par_chunks_exact(vocab)
        .map(|row| {
            let summary = summarize_row(row);
            let mut alternatives = Vec::with_capacity(top);
            top_entries(row, top, &mut alternatives);
            for (_, value) in &mut alternatives {
                *value -= summary.log_normalizer;
            }
            RowChoice {
                token: summary.argmax,
                logprob: row[summary.argmax] - summary.log_normalizer,
                alternatives,
            }
        })
        .collect();
    let mut rows = GreedyRows {
        top,
        ..GreedyRows::default()
    };
    for choice in choices {
        rows.tokens.push(choice.token as i64);
        rows.logprobs.push(choice.logprob);
        for i in 0..top {
            // A vocabulary smaller than `top` leaves the rest (0, −∞).
            let (id, value) = choice.alternatives.get(i).copied().unwrap_or((0, f32::NEG_INFINITY));
            rows.top_ids.push(id as i64);
            rows.top_values.push(value);
        }
    }
    rows
}

impl GreedyRows {
    /// As the libtorch sampler returns them, for [`crate::step::write_outputs`].
    pub fn into_sampled(self) -> Result<Sampled, WorkerError> {
        let rows = self.tokens.len() as i64;
        let (top_ids, top_values) = if self.top > 0 {
            let shape = [rows, self.top as i64];
            (
                Some(Tensor::f_from_slice(&self.top_ids)?.f_view(shape)?),
                Some(Tensor::f_from_slice(&self.top_values)?.f_view(shape)?),
            )
        } else {
            (None, None)
        };
        Ok(Sampled {
            tokens: Tensor::f_from_slice(&self.tokens)?,
            logprobs: Tensor::f_from_slice(&self.logprobs)?,
            top_ids,
            top_values,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    /// The libtorch reading the fast path replaces: log_softmax, argmax, gather, topk.
    #[test]
    fn matches_libtorchs_log_softmax_argmax_and_topk() {
        let (rows, vocab, top) = (5i64, 1_031i64, 4i64);
        let logits = Tensor::randn([rows, vocab], (Kind::Float, tch::Device::Cpu)) * 6.0;
        let values = Vec::<f32>::try_from(logits.view([-1])).expect("logits");
        let greedy = sample_greedy(&values, vocab as usize, top as usize);

        let logprobs = logits.log_softmax(-1, Kind::Float);
        let tokens = Vec::<i64>::try_from(logits.argmax(-1, false)).expect("argmax");
        assert_eq!(greedy.tokens, tokens);
        let chosen = logprobs.gather(1, &Tensor::from_slice(&tokens).unsqueeze(1), false);
        let chosen = Vec::<f32>::try_from(chosen.view([-1])).expect("chosen");
        let (top_values, top_ids) = logprobs.topk(top, -1, true, true);
        let top_values = Vec::<f32>::try_from(top_values.view([-1])).expect("values");
        assert_eq!(greedy.top_ids, Vec::<i64>::try_from(top_ids.view([-1])).expect("ids"));
        for (a, b) in greedy
            .logprobs
            .iter()
            .chain(&greedy.top_values)
            .zip(chosen.iter().chain(&top_values))
        {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }
}
