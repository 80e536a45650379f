//! Every sampled row of a CPU-kernels step chosen straight from the kernels' logits, without
//! libtorch, rows in parallel on the kernels' threads: greedy rows take the argmax, the others
//! draw ([`rivulet_kernels::sampling`]), biases and penalties first where a row has them; each row's
//! logprob and alternatives come from its raw logits ([`rivulet_kernels::logits`]).
//!
//! Why: through libtorch a step copied the logits into a tensor and read them on one thread while
//! the other core waited — a log-softmax, an argmax, a gather and a top-k for greedy rows (~9% of
//! a served 32-client step on a 2-core Xeon), and for rows that draw a `[rows, vocab]` tensor per
//! stage: serving 32 clients at temperature 1, Rivulet's default, a step took 95 ms against 40
//! greedy. The libtorch sampler ([`crate::sampler`]) stays the CUDA engine's, with the same
//! semantics; this module's tests hold the two to the same tokens.

use std::cell::RefCell;

use rayon::prelude::*;
use rivulet_ipc::SeqSampling;
use rivulet_kernels::logits::{argmax, summarize_row, top_entries};
use rivulet_kernels::sampling::{apply_penalties, draw, DrawParams, Penalties};
use tch::Tensor;

use crate::error::WorkerError;
use crate::sampler::Sampled;
use crate::step::token_allowed;

/// One sampled row's parameters and penalty history (prompt tokens first, then generated).
#[derive(Debug, Clone, Copy)]
pub struct RowRequest<'a> {
    pub params: SeqSampling,
    pub history: &'a [i64],
    /// How many of `history`'s tokens are the prompt's.
    pub prompt_len: usize,
    /// What the row's logits are changed by before its penalties (ids validated).
    pub bias: LogitBiasRow<'a>,
}

/// A row's logit-bias entries: `values[i]` (finite, or −∞ for a token the row may not choose)
/// added to the logit of `tokens[i]`, repeated tokens adding up; with
/// [`SeqSampling::allowed_only`], every token not listed is excluded; with a token mask (a
/// structured output's), every token whose bit is clear.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogitBiasRow<'a> {
    pub tokens: &'a [i64],
    pub values: &'a [f32],
    /// The row of `token_masks`, where the sequence has one.
    pub mask: Option<&'a [i64]>,
}

impl LogitBiasRow<'_> {
    /// Whether it changes the row at all.
    pub fn changes_row(&self, allowed_only: bool) -> bool {
        !self.tokens.is_empty() || allowed_only || self.mask.is_some()
    }

    /// `row` changed by these entries, into `adjusted`.
    pub fn apply(&self, row: &[f32], allowed_only: bool, adjusted: &mut Vec<f32>) {
        adjusted.clear();
        if allowed_only {
            adjusted.resize(row.len(), f32::NEG_INFINITY);
            for &token in self.tokens {
                if let Some(t) = usize::try_from(token).ok().filter(|&t| t < row.len()) {
                    adjusted[t] = row[t];
                }
            }
        } else {
            adjusted.extend_from_slice(row);
        }
        for (&token, &value) in self.tokens.iter().zip(self.values) {
            if let Some(logit) = usize::try_from(token).ok().and_then(|t| adjusted.get_mut(t)) {
                *logit += value;
            }
        }
        if let Some(mask) = self.mask {
            for (token, logit) in adjusted.iter_mut().enumerate() {
                if !token_allowed(mask, token) {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// Every sampled row's token, `[rows]`, and `[rows][top]` alternatives.
#[derive(Debug, Default)]
pub struct SampledRows {
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

thread_local! {
    /// Per thread: a row's penalized logits and its draw's weights, reused across rows and steps.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// The choice of each `vocab`-wide row of `logits` under its request, with `top` alternatives
/// each (log-probabilities, largest first; rows that asked for fewer get the rest as (0, −∞)).
/// Runs on the current rayon pool.
pub fn sample_rows(logits: &[f32], vocab: usize, requests: &[RowRequest<'_>], top: usize) -> SampledRows {
    let choices: Vec<RowChoice> = logits
        .par_chunks_exact(vocab)
        .zip(requests.par_iter())
        .map(|(row, request)| choose(row, request))
        .collect();
    let mut rows = SampledRows {
        top,
        ..SampledRows::default()
    };
    for choice in choices {
        rows.tokens.push(choice.token as i64);
        rows.logprobs.push(choice.logprob);
        for i in 0..top {
            let (id, value) = choice.alternatives.get(i).copied().unwrap_or((0, f32::NEG_INFINITY));
            rows.top_ids.push(id as i64);
            rows.top_values.push(value);
        }
    }
    rows
}

fn choose(row: &[f32], request: &RowRequest<'_>) -> RowChoice {
    let params = &request.params;
    let summary = summarize_row(row);
    let mut alternatives = Vec::new();
    let wanted = usize::try_from(params.num_top_logprobs).unwrap_or(0);
    top_entries(row, wanted, &mut alternatives);
    for (_, value) in &mut alternatives {
        *value -= summary.log_normalizer;
    }
    let penalties = Penalties {
        repetition: params.repetition_penalty,
        frequency: params.frequency_penalty,
        presence: params.presence_penalty,
    };
    let penalized = !request.history.is_empty() && !penalties.is_neutral();
    let allowed_only = params.allowed_only != 0;
    let biased = request.bias.changes_row(allowed_only);
    let token = if !penalized && !biased && params.temperature <= 0.0 {
        summary.argmax
    } else {
        SCRATCH.with_borrow_mut(|(adjusted, weights)| {
            let logits = if penalized || biased {
                // vLLM's order: the biases (and bans), then the penalties.
                request.bias.apply(row, allowed_only, adjusted);
                if penalized {
                    apply_penalties(adjusted, request.history, request.prompt_len, &penalties);
                }
                &adjusted[..]
            } else {
                row
            };
            if params.temperature <= 0.0 {
                argmax(logits)
            } else {
                let draw_params = DrawParams {
                    temperature: params.temperature,
                    top_k: params.top_k,
                    top_p: params.top_p,
                    min_p: params.min_p,
                    seed: params.seed,
                    draw_index: params.draw_index,
                };
                draw(logits, &draw_params, weights)
            }
        })
    };
    RowChoice {
        token,
        logprob: row[token] - summary.log_normalizer,
        alternatives,
    }
}

impl SampledRows {
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
    use crate::sampler::{sample, LogitBias, PenaltyHistory, SamplingBatch};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use tch::{Device, Kind};

    /// The libtorch sampler on the same rows, on `device`, as the CUDA engine runs it; its
    /// results come back to the host.
    fn libtorch(logits: &[f32], vocab: usize, requests: &[RowRequest<'_>], device: Device) -> Sampled {
        let rows: Vec<SeqSampling> = requests.iter().map(|r| r.params).collect();
        let (mut history_rows, mut tokens, mut generated) = (Vec::new(), Vec::new(), Vec::new());
        for (row, request) in requests.iter().enumerate() {
            for (position, &token) in request.history.iter().enumerate() {
                history_rows.push(row as i64);
                tokens.push(token);
                generated.push(position >= request.prompt_len);
            }
        }
        let history = (!tokens.is_empty()).then(|| PenaltyHistory {
            rows: Tensor::from_slice(&history_rows).to_device(device),
            tokens: Tensor::from_slice(&tokens).to_device(device),
            generated: Tensor::from_slice(&generated).to_device(device),
        });
        let bias =
            LogitBias::from_rows(requests.iter().map(|r| (r.bias, r.params.allowed_only != 0)), device).expect("bias");
        let batch = SamplingBatch::from_rows(&rows, history, bias, device).expect("batch");
        let logits = Tensor::from_slice(logits)
            .view([requests.len() as i64, vocab as i64])
            .to_device(device);
        let sampled = sample(&logits, &batch);
        let to_host = |tensor: Tensor| tensor.to_device(Device::Cpu);
        Sampled {
            tokens: to_host(sampled.tokens),
            logprobs: to_host(sampled.logprobs),
            top_ids: sampled.top_ids.map(to_host),
            top_values: sampled.top_values.map(to_host),
        }
    }

    fn values<T: tch::kind::Element>(tensor: &Tensor) -> Vec<T>
    where
        Vec<T>: TryFrom<Tensor, Error = tch::TchError>,
    {
        Vec::<T>::try_from(tensor.reshape([-1])).expect("values")
    }

    /// Logits shaped like a language model's: a few likely tokens over a long, spread tail.
    fn model_like_logits(rng: &mut StdRng, rows: usize, vocab: usize) -> Vec<f32> {
        (0..rows * vocab)
            .map(|_| {
                let base: f32 = rng.random_range(-8.0..2.0);
                if rng.random_bool(0.002) {
                    base + 10.0
                } else {
                    base
                }
            })
            .collect()
    }

    #[test]
    fn every_kind_of_row_chooses_what_libtorchs_sampler_chooses() {
        every_kind_of_row_matches_libtorch_on(Device::Cpu);
    }

    /// The CUDA engine samples with libtorch on the GPU (whose reductions and scans sum in
    /// another order): the same rows choose the same tokens there. Skipped, saying so, without a
    /// GPU; `bench/cuda.sh` runs it on one.
    #[test]
    fn every_kind_of_row_chooses_what_libtorchs_sampler_chooses_on_cuda() {
        if !tch::Cuda::is_available() {
            eprintln!("skipped: no CUDA device");
            return;
        }
        every_kind_of_row_matches_libtorch_on(Device::Cuda(0));
    }

    fn every_kind_of_row_matches_libtorch_on(device: Device) {
        let (vocab, rows) = (5_003usize, 48usize);
        let mut rng = StdRng::seed_from_u64(5);
        for round in 0..4 {
            let logits = model_like_logits(&mut rng, rows, vocab);
            let params: Vec<SeqSampling> = (0..rows)
                .map(|i| SeqSampling {
                    temperature: [0.0, 1.0, 0.7, 1.5][i % 4],
                    top_k: [0, 0, 5, 50, 2_000][i % 5],
                    top_p: [1.0, 0.9, 0.5, 1.0, 0.95, 1.0][i % 6],
                    min_p: [0.0, 0.0, 0.05][i % 3],
                    repetition_penalty: [1.0, 1.3][(i / 2) % 2],
                    frequency_penalty: [0.0, 0.4, -0.2][(i / 3) % 3],
                    presence_penalty: [0.0, 0.6][(i / 5) % 2],
                    seed: rng.random(),
                    draw_index: i as i64 + round,
                    num_top_logprobs: (i % 4) as i64,
                    allowed_only: i64::from(i % 6 == 5),
                })
                .collect();
            let histories: Vec<Vec<i64>> = (0..rows)
                .map(|i| (0..i * 3).map(|_| rng.random_range(0..vocab as i64)).collect())
                .collect();
            // Rows by `i % 6`: 1 and 4 may not choose their two likeliest tokens (as before
            // `min_tokens`); 2 have a request's biases (one token listed twice, which adds up);
            // 5 may choose only 40 tokens, one of them biased, another banned.
            let biases: Vec<(Vec<i64>, Vec<f32>)> = (0..rows)
                .map(|i| {
                    let row = &logits[i * vocab..(i + 1) * vocab];
                    let mut order: Vec<usize> = (0..vocab).collect();
                    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
                    let likeliest = |n: usize| order.iter().take(n).map(|&t| t as i64);
                    let random = |rng: &mut StdRng| rng.random_range(0..vocab as i64);
                    match i % 6 {
                        1 | 4 => (likeliest(2).collect(), vec![f32::NEG_INFINITY; 2]),
                        2 => {
                            let (a, b) = (random(&mut rng), random(&mut rng));
                            let tokens = likeliest(1).chain([a, b, b]).collect();
                            (tokens, vec![-2.5, 9.0, 1.5, 2.0])
                        }
                        5 => {
                            let tokens: Vec<i64> = (0..40).map(|_| random(&mut rng)).collect();
                            let mut values = vec![0.0; 40];
                            (values[0], values[1]) = (4.0, f32::NEG_INFINITY);
                            (tokens, values)
                        }
                        _ => (Vec::new(), Vec::new()),
                    }
                })
                .collect();
            // Rows 3 of every 7 (but the allowed-only ones) hold a structured output's mask: about
            // an eighth of the tokens.
            let masks: Vec<Option<Vec<i64>>> = (0..rows)
                .map(|i| {
                    (i % 7 == 3 && i % 6 != 5).then(|| {
                        (0..vocab.div_ceil(64))
                            .map(|_| (rng.random::<u64>() & rng.random::<u64>() & rng.random::<u64>()) as i64)
                            .collect()
                    })
                })
                .collect();
            let requests: Vec<RowRequest<'_>> = params
                .iter()
                .zip(&histories)
                .zip(&biases)
                .zip(&masks)
                .map(|(((&params, history), (tokens, values)), mask)| RowRequest {
                    params,
                    history,
                    prompt_len: history.len() / 2,
                    bias: LogitBiasRow {
                        tokens,
                        values,
                        mask: mask.as_deref(),
                    },
                })
                .collect();
            let ours = sample_rows(&logits, vocab, &requests, 3);
            for (request, &token) in requests.iter().zip(&ours.tokens) {
                let entries = || request.bias.tokens.iter().zip(request.bias.values);
                let banned = entries().any(|(&t, &v)| t == token && v == f32::NEG_INFINITY);
                assert!(!banned, "a banned token {token} was chosen");
                if let Some(mask) = request.bias.mask {
                    assert!(token_allowed(mask, token as usize), "a masked token {token} was chosen");
                }
                if request.params.allowed_only != 0 {
                    assert!(
                        request.bias.tokens.contains(&token),
                        "an unlisted token {token} was chosen"
                    );
                }
            }
            let theirs = libtorch(&logits, vocab, &requests, device);
            assert_eq!(ours.tokens, values::<i64>(&theirs.tokens), "round {round}");
            for (a, b) in ours.logprobs.iter().zip(values::<f32>(&theirs.logprobs)) {
                assert!((a - b).abs() < 1e-4, "logprob {a} vs {b}");
            }
            let their_ids = values::<i64>(theirs.top_ids.as_ref().expect("ids"));
            for (row, request) in requests.iter().enumerate() {
                let wanted = request.params.num_top_logprobs as usize;
                assert_eq!(
                    ours.top_ids[row * 3..row * 3 + wanted],
                    their_ids[row * 3..row * 3 + wanted]
                );
            }
        }
    }

    /// The greedy fast path against libtorch's log_softmax, argmax, gather and topk.
    #[test]
    fn greedy_rows_match_libtorchs_log_softmax_argmax_and_topk() {
        let (rows, vocab, top) = (5i64, 1_031i64, 4i64);
        let logits = Tensor::randn([rows, vocab], (Kind::Float, Device::Cpu)) * 6.0;
        let flat = values::<f32>(&logits);
        let params = SeqSampling {
            num_top_logprobs: top,
            ..SeqSampling::GREEDY
        };
        let requests = vec![
            RowRequest {
                params,
                history: &[],
                prompt_len: 0,
                bias: LogitBiasRow::default(),
            };
            rows as usize
        ];
        let greedy = sample_rows(&flat, vocab as usize, &requests, top as usize);

        let logprobs = logits.log_softmax(-1, Kind::Float);
        let tokens = values::<i64>(&logits.argmax(-1, false));
        assert_eq!(greedy.tokens, tokens);
        let chosen = values::<f32>(&logprobs.gather(1, &Tensor::from_slice(&tokens).unsqueeze(1), false));
        let (top_values, top_ids) = logprobs.topk(top, -1, true, true);
        assert_eq!(greedy.top_ids, values::<i64>(&top_ids));
        for (a, b) in greedy
            .logprobs
            .iter()
            .chain(&greedy.top_values)
            .zip(chosen.iter().chain(&values::<f32>(&top_values)))
        {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }
}
