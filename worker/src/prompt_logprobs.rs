//! vLLM's prompt logprobs: for each prompt token of a request that asked for them, its
//! log-probability given the tokens before it, its rank, and the likeliest alternatives, read off
//! the logits of the token before it. The step's forward pass computes those rows after the
//! sampled ones (`step::HostStep::prompt_rows`); one implementation on f32 rows serves both
//! engines, since prompt logprobs are an occasional request's, not the serving path's.

use rayon::prelude::*;
use rivulet_ipc::layout::MAX_TOP_LOGPROBS;
use rivulet_kernels::logits::{summarize_row, top_entries};
use tch::{Kind, Tensor};

use crate::error::WorkerError;
use crate::step_view::StepView;

/// One token whose follower in the prompt is scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptRow {
    /// The token's row in the step's flat batch.
    pub flat_row: i64,
    /// The prompt token that follows it (below the vocabulary size, checked by validation).
    pub target: usize,
    /// Alternatives to report (`0..=MAX_TOP_LOGPROBS`).
    pub top: usize,
}

/// What one row says of its target.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprob {
    pub logprob: f32,
    /// vLLM's rank: how many tokens are at least as likely as the target (the target included),
    /// so the likeliest token has rank 1.
    pub rank: i64,
    /// The `top` likeliest tokens and their log-probabilities, likeliest first.
    pub top: Vec<(usize, f32)>,
}

/// Scores each `vocab`-wide row of `logits` against its [`PromptRow`], rows in parallel on the
/// current rayon pool.
pub fn score_rows(logits: &[f32], vocab: usize, rows: &[PromptRow]) -> Vec<PromptLogprob> {
    logits
        .par_chunks_exact(vocab)
        .zip(rows.par_iter())
        .map(|(row, request)| score(row, request))
        .collect()
}

fn score(row: &[f32], request: &PromptRow) -> PromptLogprob {
    let summary = summarize_row(row);
    let target = row[request.target];
    let mut top = Vec::with_capacity(request.top);
    top_entries(row, request.top, &mut top);
    for (_, value) in &mut top {
        *value -= summary.log_normalizer;
    }
    PromptLogprob {
        logprob: target - summary.log_normalizer,
        rank: row.iter().filter(|&&logit| logit >= target).count() as i64,
        top,
    }
}

/// Writes each row's score into the step buffer's per-token prompt-logprob outputs (the
/// alternatives a row did not ask for as (0, −∞)).
pub fn write_outputs(view: &mut StepView<'_>, rows: &[PromptRow], scored: &[PromptLogprob]) -> Result<(), WorkerError> {
    if rows.is_empty() {
        return Ok(());
    }
    let index = Tensor::f_from_slice(&rows.iter().map(|row| row.flat_row).collect::<Vec<_>>())?;
    let logprobs: Vec<f32> = scored.iter().map(|score| score.logprob).collect();
    let ranks: Vec<i64> = scored.iter().map(|score| score.rank).collect();
    let (mut ids, mut values) = (Vec::new(), Vec::new());
    for score in scored {
        for i in 0..MAX_TOP_LOGPROBS {
            let (id, value) = score.top.get(i).copied().unwrap_or((0, f32::NEG_INFINITY));
            ids.push(id as i64);
            values.push(value);
        }
    }
    let table = |values: Tensor| values.f_view([rows.len() as i64, MAX_TOP_LOGPROBS as i64]);
    let _ = view
        .prompt_logprobs
        .f_index_copy_(0, &index, &Tensor::f_from_slice(&logprobs)?)?;
    let _ = view
        .prompt_logprob_ranks
        .f_index_copy_(0, &index, &Tensor::f_from_slice(&ranks)?)?;
    let _ = view
        .prompt_top_logprob_ids
        .f_index_copy_(0, &index, &table(Tensor::f_from_slice(&ids)?)?)?;
    let _ = view.prompt_top_logprob_values.f_index_copy_(
        0,
        &index,
        &table(Tensor::f_from_slice(&values)?.f_to_kind(Kind::Float)?)?,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against libtorch's log-softmax, sort and count on the same rows, with ties.
    #[test]
    fn scores_match_libtorchs_log_softmax_and_ranks() {
        let vocab = 97;
        let rows: Vec<f32> = (0..3 * vocab).map(|i| ((i * 37) % 23) as f32 * 0.25 - 2.0).collect();
        let requests = [
            PromptRow {
                flat_row: 4,
                target: 5,
                top: 0,
            },
            PromptRow {
                flat_row: 0,
                target: 96,
                top: 3,
            },
            PromptRow {
                flat_row: 2,
                target: 0,
                top: MAX_TOP_LOGPROBS,
            },
        ];
        let scored = score_rows(&rows, vocab, &requests);
        let logits = Tensor::from_slice(&rows).view([3, vocab as i64]);
        let reference = logits.log_softmax(-1, Kind::Double);
        for (r, (request, score)) in requests.iter().zip(&scored).enumerate() {
            let expected = reference.double_value(&[r as i64, request.target as i64]);
            assert!((f64::from(score.logprob) - expected).abs() < 1e-5, "row {r}");
            let row = logits.get(r as i64);
            let target = row.double_value(&[request.target as i64]);
            let rank = row.ge(target).sum(Kind::Int64).int64_value(&[]);
            assert_eq!(score.rank, rank, "row {r}");
            assert_eq!(score.top.len(), request.top);
            let (values, _) = reference.get(r as i64).topk(request.top as i64, -1, true, true);
            for (k, &(id, value)) in score.top.iter().enumerate() {
                assert!((f64::from(value) - values.double_value(&[k as i64])).abs() < 1e-5);
                assert!((reference.double_value(&[r as i64, id as i64]) - f64::from(value)).abs() < 1e-5);
            }
        }
    }
}
