//! Choosing each sampled sequence's next token from its logits, for the whole step in one
//! batched pass (no per-sequence loops over tensors).
//!
//! Order, as in vLLM: repetition / frequency / presence penalties on the logits; then greedy rows
//! (temperature 0) take the argmax, the others divide by their temperature, mask by top-k, top-p
//! and min-p, and draw with the Gumbel-max trick. The Gumbel noise comes from a counter-based
//! generator keyed by (seed, draw index, token id), so a seeded sequence draws the same numbers
//! whatever else shares its batch, and after a preemption too. Logprobs are those of the model's
//! own distribution (log-softmax of the raw logits).

use tch::{Device, Kind, Tensor};

/// Penalty histories: which tokens each row has seen.
pub struct PenaltyHistory {
    /// `[H]` i64: the row each history token belongs to.
    pub rows: Tensor,
    /// `[H]` i64: the token ids.
    pub tokens: Tensor,
    /// `[H]` bool: true for generated tokens (frequency / presence count only those).
    pub generated: Tensor,
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
    pub seed: Tensor,
    pub draw_index: Tensor,
    pub history: Option<PenaltyHistory>,
    /// Which optional stages any row needs (computed on the host, so unused ones cost nothing).
    pub any_random: bool,
    pub any_top_k: bool,
    pub any_top_p: bool,
    pub any_min_p: bool,
    /// The most alternatives any row asked for.
    pub top_logprobs: i64,
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
    let logits = match &batch.history {
        Some(history) => apply_penalties(logits, history, batch),
        None => logits.shallow_clone(),
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
    let mut scaled = logits / batch.temperature.clamp_min(1e-5).unsqueeze(1);
    if batch.any_top_k || batch.any_top_p {
        let (sorted, order) = scaled.sort(-1, true);
        let rank = Tensor::arange(vocab, (Kind::Int64, device)).unsqueeze(0);
        let mut drop_sorted = Tensor::zeros([rows, vocab], (Kind::Bool, device));
        if batch.any_top_k {
            let whole_vocabulary = Tensor::full([rows], vocab, (Kind::Int64, device));
            let k = whole_vocabulary.where_self(&batch.top_k.le(0), &batch.top_k);
            drop_sorted = drop_sorted.logical_or(&rank.ge_tensor(&k.unsqueeze(1)));
        }
        if batch.any_top_p {
            let probs = sorted.softmax(-1, Kind::Float);
            // Mass before each token; the most likely token is always kept.
            let before = probs.cumsum(-1, Kind::Float) - &probs;
            drop_sorted = drop_sorted.logical_or(&before.gt_tensor(&batch.top_p.unsqueeze(1)));
        }
        let drop = Tensor::zeros([rows, vocab], (Kind::Bool, device)).scatter(1, &order, &drop_sorted);
        scaled = scaled.masked_fill(&drop, f64::NEG_INFINITY);
    }
    if batch.any_min_p {
        let probs = scaled.softmax(-1, Kind::Float);
        let (max_prob, _) = probs.max_dim(-1, true);
        scaled = scaled.masked_fill(
            &probs.lt_tensor(&(max_prob * batch.min_p.unsqueeze(1))),
            f64::NEG_INFINITY,
        );
    }
    let uniform = seeded_uniform(&batch.seed, &batch.draw_index, vocab, device);
    let gumbel = -(-uniform.log()).log();
    (scaled.to_kind(Kind::Double) + gumbel).argmax(-1, false)
}

/// Uniform numbers in (0, 1), `[rows, vocab]` f64, a pure function of (seed, draw index, token):
/// splitmix64 over a per-element counter, computed with wrapping i64 tensor arithmetic.
pub fn seeded_uniform(seed: &Tensor, draw_index: &Tensor, vocab: i64, device: Device) -> Tensor {
    const GOLDEN: i64 = 0x9E37_79B9_7F4A_7C15_u64 as i64;
    const MIX1: i64 = 0xBF58_476D_1CE4_E5B9_u64 as i64;
    const MIX2: i64 = 0x94D0_49BB_1331_11EB_u64 as i64;
    let token = Tensor::arange(vocab, (Kind::Int64, device)).unsqueeze(0);
    let counter = splitmix64(&(seed.unsqueeze(1) * MIX1 + draw_index.unsqueeze(1) * GOLDEN));
    let z = splitmix64(&(counter + token * MIX2));
    let mantissa = logical_shift_right(&z, 11);
    (mantissa.to_kind(Kind::Double) + 0.5) * (1.0 / (1u64 << 53) as f64)
}

fn splitmix64(x: &Tensor) -> Tensor {
    const GOLDEN: i64 = 0x9E37_79B9_7F4A_7C15_u64 as i64;
    const MIX1: i64 = 0xBF58_476D_1CE4_E5B9_u64 as i64;
    const MIX2: i64 = 0x94D0_49BB_1331_11EB_u64 as i64;
    let z = x + GOLDEN;
    let z = z.bitwise_xor_tensor(&logical_shift_right(&z, 30)) * MIX1;
    let z = z.bitwise_xor_tensor(&logical_shift_right(&z, 27)) * MIX2;
    z.bitwise_xor_tensor(&logical_shift_right(&z, 31))
}

/// `>>>` on i64 (torch's `>>` is arithmetic): shift, then clear the copied sign bits.
fn logical_shift_right(x: &Tensor, bits: i64) -> Tensor {
    x.bitwise_right_shift_tensor_scalar(bits)
        .bitwise_and((1i64 << (64 - bits)) - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(rows: i64, temperature: f32, seed_base: i64) -> SamplingBatch {
        let full = |v: f64, kind| Tensor::full([rows], v, (kind, Device::Cpu));
        SamplingBatch {
            temperature: full(f64::from(temperature), Kind::Float),
            top_k: full(0.0, Kind::Int64),
            top_p: full(1.0, Kind::Float),
            min_p: full(0.0, Kind::Float),
            repetition_penalty: full(1.0, Kind::Float),
            frequency_penalty: full(0.0, Kind::Float),
            presence_penalty: full(0.0, Kind::Float),
            seed: Tensor::arange_start(seed_base, seed_base + rows, (Kind::Int64, Device::Cpu)),
            draw_index: full(0.0, Kind::Int64),
            history: None,
            any_random: temperature > 0.0,
            any_top_k: false,
            any_top_p: false,
            any_min_p: false,
            top_logprobs: 0,
        }
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
        let sampled = sample(&logits(rows), &batch(rows, 1.0, 0));
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
        let alone = sample(&logits(1), &batch(1, 1.0, 77)).tokens.int64_value(&[0]);
        let mut crowded = batch(64, 1.0, 40);
        crowded.seed = Tensor::arange_start(40, 104, (Kind::Int64, Device::Cpu));
        let in_batch = sample(&logits(64), &crowded).tokens.int64_value(&[37]);
        assert_eq!(alone, in_batch, "row 37 has seed 77");
        let draws: Vec<i64> = (0..200)
            .map(|s| sample(&logits(1), &batch(1, 1.0, s)).tokens.int64_value(&[0]))
            .collect();
        assert!(
            draws.iter().any(|&t| t != draws[0]),
            "different seeds draw different tokens"
        );
    }

    #[test]
    fn top_k_one_and_zero_temperature_are_greedy_and_masks_restrict_the_support() {
        let rows = 2_000;
        let mut top1 = batch(rows, 1.5, 0);
        top1.top_k = Tensor::full([rows], 1, (Kind::Int64, Device::Cpu));
        top1.any_top_k = true;
        assert_eq!(frequencies(&sample(&logits(rows), &top1).tokens, 6)[0], 1.0);
        assert_eq!(
            frequencies(&sample(&logits(rows), &batch(rows, 0.0, 0)).tokens, 6)[0],
            1.0
        );

        let mut top_p = batch(rows, 1.0, 0);
        top_p.top_p = Tensor::full([rows], 0.6, (Kind::Float, Device::Cpu));
        top_p.any_top_p = true;
        let freq = frequencies(&sample(&logits(rows), &top_p).tokens, 6);
        // softmax ≈ [0.52, 0.19, 0.12, 0.07, 0.03, 0.003]: mass before token 2 is 0.71 > 0.6.
        assert!(
            freq[0] > 0.0 && freq[1] > 0.0 && freq[2..].iter().all(|f| *f == 0.0),
            "{freq:?}"
        );

        let mut min_p = batch(rows, 1.0, 0);
        min_p.min_p = Tensor::full([rows], 0.2, (Kind::Float, Device::Cpu));
        min_p.any_min_p = true;
        let freq = frequencies(&sample(&logits(rows), &min_p).tokens, 6);
        // Kept: p ≥ 0.2 × 0.52 = 0.104, i.e. tokens 0, 1, 2.
        assert!(
            freq[..3].iter().all(|f| *f > 0.0) && freq[3..].iter().all(|f| *f == 0.0),
            "{freq:?}"
        );
    }

    #[test]
    fn penalties_push_seen_tokens_down() {
        let mut penalized = batch(1, 0.0, 0);
        penalized.repetition_penalty = Tensor::from_slice(&[4.0f32]);
        penalized.history = Some(PenaltyHistory {
            rows: Tensor::from_slice(&[0i64]),
            tokens: Tensor::from_slice(&[0i64]),
            generated: Tensor::from_slice(&[false]),
        });
        // 2.0 / 4 = 0.5 < 1.0: token 1 wins.
        assert_eq!(sample(&logits(1), &penalized).tokens.int64_value(&[0]), 1);
        let mut frequency = batch(1, 0.0, 0);
        frequency.frequency_penalty = Tensor::from_slice(&[0.6f32]);
        frequency.history = Some(PenaltyHistory {
            rows: Tensor::from_slice(&[0i64, 0]),
            tokens: Tensor::from_slice(&[0i64, 0]),
            generated: Tensor::from_slice(&[true, true]),
        });
        // 2.0 − 2 × 0.6 = 0.8 < 1.0.
        assert_eq!(sample(&logits(1), &frequency).tokens.int64_value(&[0]), 1);
    }
}
