//! Choosing each sampled sequence's next token from its logits with libtorch, for the whole
//! step in one batched pass (no per-sequence loops over tensors): the CUDA engine's and the
//! libtorch CPU engine's sampler. The CPU kernels' steps sample row by row in Rust
//! ([`crate::kernel_sampling`], over [`rivulet_kernels::sampling`]) with the same semantics,
//! which this module's tests hold them to.
//!
//! Order, as in vLLM: logit biases (`allowed_token_ids`, `logit_bias`, the stop tokens banned
//! before `min_new_tokens`), then repetition / frequency / presence penalties; then greedy rows
//! (temperature 0) take the argmax, the others divide by their temperature, keep their top-k,
//! then top-p of what top-k kept (renormalized), then min-p, and draw by an exponential race:
//! the token with the largest weight over an exponential number that is a pure function of
//! (seed, draw index, token) ([`rivulet_kernels::sampling`] says why; the row's key is computed
//! on the host, each token's bits on the device), so a seeded sequence draws the same token
//! whatever else shares its batch, after a preemption and after a restart. Logprobs are those
//! of the model's own distribution (log-softmax of the raw logits).

use rivulet_ipc::SeqSampling;
use rivulet_kernels::sampling::{race_key, FMIX32_MUL1, FMIX32_MUL2, RACE_TOKEN_MIX};
use tch::kind::Element;
use tch::{Device, Kind, Tensor};

use crate::kernel_sampling::LogitBiasRow;

/// Penalty histories: which tokens each row has seen.
pub struct PenaltyHistory {
    /// `[H]` i64: the row each history token belongs to.
    pub rows: Tensor,
    /// `[H]` i64: the token ids.
    pub tokens: Tensor,
    /// `[H]` bool: true for generated tokens (frequency / presence count only those).
    pub generated: Tensor,
}

/// Logit biases: entries of a row, a token and what is added to its logit (finite, or −∞ for
/// a token the row may not choose: its stop tokens before `min_new_tokens`), `[B]` each; and
/// the rows that may choose only their listed tokens (vLLM's `allowed_token_ids`).
pub struct LogitBias {
    /// `[B]` i64.
    pub rows: Tensor,
    /// `[B]` i64.
    pub tokens: Tensor,
    /// `[B]` f32.
    pub values: Tensor,
    /// `[R]` i64: rows whose unlisted tokens are excluded; `None` if there are none.
    pub allowed_only_rows: Option<Tensor>,
    /// Rows with a structured output's token mask: `[M]` i64 rows, and `[M, 64 × words]` bool,
    /// true where a token may be chosen (the words go to the device as they are and are unpacked
    /// there: 64 times fewer bytes to copy); `None` if no row has one.
    pub masks: Option<(Tensor, Tensor)>,
}

impl LogitBias {
    /// From each row's entries and whether it allows only them, in row order, on `device`;
    /// `None` if no row has any.
    pub fn from_rows<'a>(
        rows: impl IntoIterator<Item = (LogitBiasRow<'a>, bool)>,
        device: Device,
    ) -> Result<Option<Self>, tch::TchError> {
        let (mut entry_rows, mut tokens, mut values, mut allowed_only) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut mask_rows, mut mask_words, mut words_per_row) = (Vec::new(), Vec::new(), 0);
        for (row, (bias, only)) in rows.into_iter().enumerate() {
            entry_rows.extend(std::iter::repeat_n(row as i64, bias.tokens.len()));
            tokens.extend_from_slice(bias.tokens);
            values.extend_from_slice(bias.values);
            if only {
                allowed_only.push(row as i64);
            }
            if let Some(mask) = bias.mask {
                mask_rows.push(row as i64);
                words_per_row = mask.len();
                mask_words.extend_from_slice(mask);
            }
        }
        if tokens.is_empty() && allowed_only.is_empty() && mask_rows.is_empty() {
            return Ok(None);
        }
        let masks = if mask_rows.is_empty() {
            None
        } else {
            let rows = mask_rows.len() as i64;
            let shifts = Tensor::f_arange(64, (Kind::Int64, device))?;
            let bits = Tensor::f_from_slice(&mask_words)?
                .f_view([rows, words_per_row as i64, 1])?
                .f_to_device(device)?
                .f_bitwise_right_shift(&shifts)?
                .f_bitwise_and(1)?
                .f_ne(0)?
                .f_view([rows, 64 * words_per_row as i64])?;
            Some((Tensor::f_from_slice(&mask_rows)?.f_to_device(device)?, bits))
        };
        let on_device = |values: &[i64]| Tensor::f_from_slice(values)?.f_to_device(device);
        Ok(Some(Self {
            rows: on_device(&entry_rows)?,
            tokens: on_device(&tokens)?,
            values: Tensor::f_from_slice(&values)?.f_to_device(device)?,
            allowed_only_rows: if allowed_only.is_empty() {
                None
            } else {
                Some(on_device(&allowed_only)?)
            },
            masks,
        }))
    }

    /// `logits` (`[rows, vocab]` f32) changed by the entries: an allowed-only row's unlisted
    /// tokens at −∞, then each entry added to its logit (repeated tokens add up).
    fn apply(&self, logits: &Tensor) -> Tensor {
        let logits = match &self.allowed_only_rows {
            Some(only) => {
                let zero = Tensor::zeros([1], (logits.kind(), logits.device()));
                let mask = logits.zeros_like().index_fill(0, only, f64::NEG_INFINITY).index_put(
                    &[Some(&self.rows), Some(&self.tokens)],
                    &zero,
                    false,
                );
                logits + mask
            }
            None => logits.shallow_clone(),
        };
        let logits = logits.index_put(&[Some(&self.rows), Some(&self.tokens)], &self.values, true);
        match &self.masks {
            Some((rows, allowed)) => {
                let vocab = logits.size()[1];
                let masked = logits
                    .index_select(0, rows)
                    .masked_fill(&allowed.narrow(1, 0, vocab).logical_not(), f64::NEG_INFINITY);
                logits.index_put(&[Some(rows)], &masked, false)
            }
            None => logits,
        }
    }
}

/// Per-row sampling parameters, `[rows]` each, on the logits' device.
pub struct SamplingBatch {
    pub temperature: Tensor,
    pub top_k: Tensor,
    pub top_p: Tensor,
    pub min_p: Tensor,
    pub repetition_penalty: Tensor,
    pub frequency_penalty: Tensor,
    pub presence_penalty: Tensor,
    /// `[rows]` i64: each row's [`race_key`] (32 bits).
    pub race_key: Tensor,
    pub history: Option<PenaltyHistory>,
    pub bias: Option<LogitBias>,
    /// Which optional stages any row needs (computed on the host, so unused ones cost nothing).
    pub any_random: bool,
    pub any_top_k: bool,
    pub any_top_p: bool,
    pub any_min_p: bool,
    /// The most alternatives any row asked for.
    pub top_logprobs: i64,
}

impl SamplingBatch {
    /// The batch of `rows` (each sampled sequence's parameters, in row order) with their penalty
    /// histories, on `device`.
    pub fn from_rows(
        rows: &[SeqSampling],
        history: Option<PenaltyHistory>,
        bias: Option<LogitBias>,
        device: Device,
    ) -> Result<Self, tch::TchError> {
        let race_keys: Vec<i64> = rows
            .iter()
            .map(|row| i64::from(race_key(row.seed, row.draw_index)))
            .collect();
        Ok(Self {
            any_random: rows.iter().any(|row| row.temperature > 0.0),
            any_top_k: rows.iter().any(|row| row.top_k > 0),
            any_top_p: rows.iter().any(|row| row.top_p < 1.0),
            any_min_p: rows.iter().any(|row| row.min_p > 0.0),
            top_logprobs: rows.iter().map(|row| row.num_top_logprobs).max().unwrap_or(0),
            temperature: column(rows, |row| row.temperature, device)?,
            top_k: column(rows, |row| row.top_k, device)?,
            top_p: column(rows, |row| row.top_p, device)?,
            min_p: column(rows, |row| row.min_p, device)?,
            repetition_penalty: column(rows, |row| row.repetition_penalty, device)?,
            frequency_penalty: column(rows, |row| row.frequency_penalty, device)?,
            presence_penalty: column(rows, |row| row.presence_penalty, device)?,
            race_key: Tensor::f_from_slice(&race_keys)?.f_to_device(device)?,
            history,
            bias,
        })
    }
}

/// One parameter of every row, `[rows]` on `device`.
fn column<T: Element>(
    rows: &[SeqSampling],
    field: impl Fn(&SeqSampling) -> T,
    device: Device,
) -> Result<Tensor, tch::TchError> {
    let values: Vec<T> = rows.iter().map(field).collect();
    Tensor::f_from_slice(&values)?.f_to_device(device)
}

pub struct Sampled {
    /// `[rows]` i64.
    pub tokens: Tensor,
    /// `[rows]` f32: log-probability of each chosen token under the model's distribution.
    pub logprobs: Tensor,
    /// `[rows, top_logprobs]`: the most likely alternatives and their log-probabilities.
    pub top_ids: Option<Tensor>,
    pub top_values: Option<Tensor>,
}

/// `logits`: `[rows, vocab]` f32.
pub fn sample(logits: &Tensor, batch: &SamplingBatch) -> Sampled {
    let raw_logprobs = logits.log_softmax(-1, Kind::Float);
    // Biases (a banned token can be neither the argmax nor drawn), then penalties, as vLLM
    // orders them; logprobs stay the raw logits'.
    let logits = match &batch.bias {
        Some(bias) => bias.apply(logits),
        None => logits.shallow_clone(),
    };
    let logits = match &batch.history {
        Some(history) => apply_penalties(&logits, history, batch),
        None => logits,
    };
    let greedy = logits.argmax(-1, false);
    let tokens = if batch.any_random {
        let drawn = draw(&logits, batch);
        greedy.where_self(&batch.temperature.le(0.0), &drawn)
    } else {
        greedy
    };
    let logprobs = raw_logprobs.gather(1, &tokens.unsqueeze(1), false).squeeze_dim(1);
    let (top_values, top_ids) = if batch.top_logprobs > 0 {
        let (values, ids) = raw_logprobs.topk(batch.top_logprobs, -1, true, true);
        (Some(values), Some(ids))
    } else {
        (None, None)
    };
    Sampled {
        tokens,
        logprobs,
        top_ids,
        top_values,
    }
}

/// vLLM's penalties: repetition over prompt and generated tokens (divide positive logits, multiply
/// negative ones); frequency × count and presence × (count > 0) over generated tokens.
fn apply_penalties(logits: &Tensor, history: &PenaltyHistory, batch: &SamplingBatch) -> Tensor {
    let (rows, vocab) = logits.size2().expect("logits are [rows, vocab]");
    let device = logits.device();
    let mut seen = Tensor::zeros([rows, vocab], (Kind::Bool, device));
    let ones = Tensor::ones([history.tokens.size()[0]], (Kind::Bool, device));
    let _ = seen.index_put_(&[Some(&history.rows), Some(&history.tokens)], &ones, false);
    let mut counts = Tensor::zeros([rows, vocab], (Kind::Float, device));
    let generated = history.generated.to_kind(Kind::Float);
    let _ = counts.index_put_(&[Some(&history.rows), Some(&history.tokens)], &generated, true);

    let repetition = batch.repetition_penalty.unsqueeze(1);
    let penalized = (logits / &repetition).where_self(&logits.gt(0.0), &(logits * &repetition));
    let logits = penalized.where_self(&seen, logits);
    logits
        - batch.frequency_penalty.unsqueeze(1) * &counts
        - batch.presence_penalty.unsqueeze(1) * counts.gt(0.0).to_kind(Kind::Float)
}

/// One draw per row from softmax(logits / temperature) restricted by top-k, top-p and min-p.
fn draw(logits: &Tensor, batch: &SamplingBatch) -> Tensor {
    let (rows, vocab) = logits.size2().expect("logits are [rows, vocab]");
    let device = logits.device();
    // Times the reciprocal, as the kernels' sampler scales (the same f32 products).
    let scaled = logits * batch.temperature.clamp_min(1e-5).reciprocal().unsqueeze(1);
    let (max, _) = scaled.max_dim(-1, true);
    // Unnormalized probabilities: the most likely token's weight is 1.
    let mut weights = (scaled - max).exp();
    if batch.any_top_k || batch.any_top_p {
        // Stable: equal weights stay in token order, as the kernels' sampler orders them.
        let (sorted, order) = weights.sort_stable(true, -1, true);
        let rank = Tensor::arange(vocab, (Kind::Int64, device)).unsqueeze(0);
        let mut drop_sorted = Tensor::zeros([rows, vocab], (Kind::Bool, device));
        if batch.any_top_k {
            let whole_vocabulary = Tensor::full([rows], vocab, (Kind::Int64, device));
            let k = whole_vocabulary.where_self(&batch.top_k.le(0), &batch.top_k);
            drop_sorted = drop_sorted.logical_or(&rank.ge_tensor(&k.unsqueeze(1)));
        }
        if batch.any_top_p {
            // Over what top-k kept; the most likely token is always kept.
            let kept = sorted.masked_fill(&drop_sorted, 0.0).to_kind(Kind::Double);
            let total = kept.sum_dim_intlist(-1, true, Kind::Double);
            let before = kept.cumsum(-1, Kind::Double) - &kept;
            let limit = total * batch.top_p.to_kind(Kind::Double).unsqueeze(1);
            drop_sorted = drop_sorted.logical_or(&before.gt_tensor(&limit));
        }
        let drop = Tensor::zeros([rows, vocab], (Kind::Bool, device)).scatter(1, &order, &drop_sorted);
        weights = weights.masked_fill(&drop, 0.0);
    }
    if batch.any_min_p {
        let (max_weight, _) = weights.max_dim(-1, true);
        weights = weights.masked_fill(&weights.lt_tensor(&(max_weight * batch.min_p.unsqueeze(1))), 0.0);
    }
    // The exponential race: the largest weight ÷ −ln(1 − v), v from the token's race bits
    // (`rivulet_kernels::sampling::race_exponential`); the first such token on a tie.
    let tokens = Tensor::arange(vocab, (Kind::Int64, device)).unsqueeze(0);
    let bits = fmix32(&low_product(&tokens, RACE_TOKEN_MIX).bitwise_xor_tensor(&batch.race_key.unsqueeze(1)));
    let v = (bits.to_kind(Kind::Double) + 0.5) * (1.0 / 4_294_967_296.0);
    let exponential = -(-v).log1p();
    (weights.to_kind(Kind::Double) / exponential).argmax(-1, false)
}

/// The low 32 bits of `x · factor` for `x` in `[0, 2³²)` (i64), in two halves of `factor` so that
/// no product passes 2⁴⁸.
fn low_product(x: &Tensor, factor: u32) -> Tensor {
    let low = x * i64::from(factor & 0xFFFF);
    let high = (x * i64::from(factor >> 16))
        .bitwise_and(0xFFFF)
        .bitwise_left_shift_tensor_scalar(16);
    (low + high).bitwise_and(0xFFFF_FFFF_i64)
}

/// murmur3's 32-bit finalizer over i64 tensors holding 32-bit words (`race_bits`' own).
fn fmix32(x: &Tensor) -> Tensor {
    let x = x.bitwise_xor_tensor(&x.bitwise_right_shift_tensor_scalar(16));
    let x = low_product(&x, FMIX32_MUL1);
    let x = x.bitwise_xor_tensor(&x.bitwise_right_shift_tensor_scalar(13));
    let x = low_product(&x, FMIX32_MUL2);
    x.bitwise_xor_tensor(&x.bitwise_right_shift_tensor_scalar(16))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(temperature: f32, seed: i64) -> SeqSampling {
        SeqSampling {
            temperature,
            seed,
            ..SeqSampling::GREEDY
        }
    }

    /// `rows` rows like `template`, seeds `seed_base..`.
    fn batch(rows: i64, template: SeqSampling, seed_base: i64) -> SamplingBatch {
        let rows: Vec<SeqSampling> = (0..rows)
            .map(|i| SeqSampling {
                seed: seed_base + i,
                ..template
            })
            .collect();
        SamplingBatch::from_rows(&rows, None, None, Device::Cpu).expect("batch")
    }

    fn logits(rows: i64) -> Tensor {
        Tensor::from_slice(&[2.0f32, 1.0, 0.5, 0.0, -1.0, -3.0])
            .unsqueeze(0)
            .repeat([rows, 1])
    }

    fn frequencies(tokens: &Tensor, vocab: i64) -> Vec<f64> {
        let counts = tokens.bincount::<Tensor>(None, vocab);
        let n = tokens.size()[0] as f64;
        Vec::<f64>::try_from(counts.to_kind(Kind::Double) / n).expect("frequencies")
    }

    #[test]
    fn seeded_draws_follow_the_softmax() {
        let rows = 20_000;
        let sampled = sample(&logits(rows), &batch(rows, row(1.0, 0), 0));
        let expected = Vec::<f64>::try_from(logits(1).softmax(-1, Kind::Double).squeeze()).expect("probs");
        for (token, (freq, p)) in frequencies(&sampled.tokens, 6).iter().zip(&expected).enumerate() {
            // Five standard deviations of a binomial frequency.
            let tolerance = 5.0 * (p * (1.0 - p) / rows as f64).sqrt() + 1e-3;
            assert!(
                (freq - p).abs() < tolerance,
                "token {token}: frequency {freq:.4}, softmax {p:.4}"
            );
        }
    }

    #[test]
    fn the_same_seed_and_draw_give_the_same_token_in_any_batch() {
        let alone = sample(&logits(1), &batch(1, row(1.0, 0), 77)).tokens.int64_value(&[0]);
        let in_batch = sample(&logits(64), &batch(64, row(1.0, 0), 40))
            .tokens
            .int64_value(&[37]);
        assert_eq!(alone, in_batch, "row 37 has seed 77");
        let draws: Vec<i64> = (0..200)
            .map(|s| sample(&logits(1), &batch(1, row(1.0, 0), s)).tokens.int64_value(&[0]))
            .collect();
        assert!(
            draws.iter().any(|&t| t != draws[0]),
            "different seeds draw different tokens"
        );
    }

    #[test]
    fn top_k_one_and_zero_temperature_are_greedy_and_masks_restrict_the_support() {
        let rows = 2_000;
        let top1 = SeqSampling {
            top_k: 1,
            ..row(1.5, 0)
        };
        assert_eq!(
            frequencies(&sample(&logits(rows), &batch(rows, top1, 0)).tokens, 6)[0],
            1.0
        );
        assert_eq!(
            frequencies(&sample(&logits(rows), &batch(rows, row(0.0, 0), 0)).tokens, 6)[0],
            1.0
        );

        // softmax ≈ [0.52, 0.19, 0.12, 0.07, 0.03, 0.003]: mass before token 2 is 0.71 > 0.6.
        let top_p = SeqSampling {
            top_p: 0.6,
            ..row(1.0, 0)
        };
        let freq = frequencies(&sample(&logits(rows), &batch(rows, top_p, 0)).tokens, 6);
        assert!(
            freq[0] > 0.0 && freq[1] > 0.0 && freq[2..].iter().all(|f| *f == 0.0),
            "{freq:?}"
        );
        // Top-p over what top-k kept: of [0.73, 0.27] the mass before token 1 is 0.73 > 0.7.
        let both = SeqSampling {
            top_k: 2,
            top_p: 0.7,
            ..row(1.0, 0)
        };
        assert_eq!(
            frequencies(&sample(&logits(rows), &batch(rows, both, 0)).tokens, 6)[0],
            1.0
        );

        // Kept: p ≥ 0.2 × 0.52 = 0.104, i.e. tokens 0, 1, 2.
        let min_p = SeqSampling {
            min_p: 0.2,
            ..row(1.0, 0)
        };
        let freq = frequencies(&sample(&logits(rows), &batch(rows, min_p, 0)).tokens, 6);
        assert!(
            freq[..3].iter().all(|f| *f > 0.0) && freq[3..].iter().all(|f| *f == 0.0),
            "{freq:?}"
        );
    }

    #[test]
    fn penalties_push_seen_tokens_down() {
        let history = |tokens: &[i64], generated: &[bool]| PenaltyHistory {
            rows: Tensor::zeros([tokens.len() as i64], (Kind::Int64, Device::Cpu)),
            tokens: Tensor::from_slice(tokens),
            generated: Tensor::from_slice(generated),
        };
        let repetition = SeqSampling {
            repetition_penalty: 4.0,
            ..row(0.0, 0)
        };
        let batch = SamplingBatch::from_rows(&[repetition], Some(history(&[0], &[false])), None, Device::Cpu);
        // 2.0 / 4 = 0.5 < 1.0: token 1 wins.
        assert_eq!(sample(&logits(1), &batch.expect("batch")).tokens.int64_value(&[0]), 1);
        let frequency = SeqSampling {
            frequency_penalty: 0.6,
            ..row(0.0, 0)
        };
        let batch = SamplingBatch::from_rows(&[frequency], Some(history(&[0, 0], &[true, true])), None, Device::Cpu);
        // 2.0 − 2 × 0.6 = 0.8 < 1.0.
        assert_eq!(sample(&logits(1), &batch.expect("batch")).tokens.int64_value(&[0]), 1);
    }
}
