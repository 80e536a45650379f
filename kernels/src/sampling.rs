//! One row of a step that does not simply take the argmax: the penalties applied to its logits,
//! and a draw from its temperature-scaled distribution restricted by top-k, top-p and min-p.
//!
//! Semantics, in vLLM's (v0) order and as the worker's libtorch sampler (`worker/src/sampler.rs`), which
//! the worker's tests hold this module to: repetition penalty over the prompt's and the
//! generated tokens, frequency and presence penalties over the generated ones; then the logits
//! times the temperature's reciprocal; top-k; top-p over the distribution top-k left, renormalized; min-p
//! against the most likely token; then one draw as an exponential race ([`race_key`]): each
//! token `t` left with weight `w_t` gets an exponential number `E_t` that is a pure function of
//! the sequence's seed, its draw index and `t`, and the token with the largest `w_t / E_t` wins
//! (a draw from the weights' distribution, exactly: the race is the Gumbel-max trick in
//! another form). So a seeded sequence draws the same whatever shares its batch, after a
//! preemption, and after a worker's restart.
//!
//! Why a race and not one uniform number by inverse CDF (what this module did before): a step
//! computes a row's logits in other kernels at other batch sizes, from the prefix cache or after
//! a restart, so the same sequence's logits differ between runs in their last bits (~1e-6
//! relative). Inverse CDF walks the whole vocabulary's cumulative mass, so such a difference
//! moves every later boundary, and a draw landing in the long tail of unlikely tokens (each
//! ~1e-6 of the mass) changed token in a few per cent of the draws of a 48-token stream. In the
//! race a token changes only if the two best `w_t / E_t` lie within that relative difference of
//! each other, about as often as the difference itself. And the race is cheap: one pass of a
//! 32-bit hash over the row ([`race_bits`], vectorized) rules out almost every token against the
//! most likely token's own score; only the few left take a logarithm.
//!
//! Why here and not libtorch: the batched tensor version built a `[rows, vocab]` tensor per stage
//! (and a per-token random number for the Gumbel trick it used before), on one thread; serving 32
//! clients at temperature 1 on a 2-core Xeon, a step took 95 ms against 40 ms greedy. A row here
//! is a few passes over one reused buffer of weights: exponentiate, maybe select, draw.

mod nucleus;

use crate::logits::argmax;
use nucleus::find_cut;

/// The random part of one row's sampling parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DrawParams {
    /// Greater than 0 (a row at 0 takes the argmax instead of drawing); clamped to 1e-5 below.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (≤ 0, or at least the vocabulary: all).
    pub top_k: i64,
    /// Keep the most likely tokens until the mass before the next exceeds this (≥ 1: all).
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one (≤ 0: none).
    pub min_p: f32,
    /// The sequence's seed and which of its draws this is: the uniform number's only inputs.
    pub seed: i64,
    pub draw_index: i64,
}

/// vLLM's penalties; the neutral values (1, 0, 0) change nothing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    /// Divides the positive logits, multiplies the negative ones, of every token seen in the
    /// prompt or the output.
    pub repetition: f32,
    /// Subtracted once per occurrence of a token in the output.
    pub frequency: f32,
    /// Subtracted once from every token that occurs in the output.
    pub presence: f32,
}

impl Penalties {
    pub fn is_neutral(&self) -> bool {
        self.repetition == 1.0 && self.frequency == 0.0 && self.presence == 0.0
    }
}

/// Applies `penalties` to `row` for a history whose first `prompt_len` tokens are the prompt's
/// and the rest generated. Token ids outside the row are ignored (the worker validates them).
pub fn apply_penalties(row: &mut [f32], history: &[i64], prompt_len: usize, penalties: &Penalties) {
    // Each distinct token once, with how often the output holds it.
    let mut seen: Vec<(usize, u32)> = history
        .iter()
        .enumerate()
        .filter_map(|(position, &token)| {
            let token = usize::try_from(token).ok().filter(|&t| t < row.len())?;
            Some((token, u32::from(position >= prompt_len)))
        })
        .collect();
    seen.sort_unstable_by_key(|&(token, _)| token);
    let mut i = 0;
    while i < seen.len() {
        let token = seen[i].0;
        let mut generated = 0u32;
        while i < seen.len() && seen[i].0 == token {
            generated += seen[i].1;
            i += 1;
        }
        let mut logit = row[token];
        logit = if logit > 0.0 {
            logit / penalties.repetition
        } else {
            logit * penalties.repetition
        };
        // The order of libtorch's `logits − f·count − p·(count > 0)`.
        logit -= penalties.frequency * generated as f32;
        logit -= penalties.presence * if generated > 0 { 1.0 } else { 0.0 };
        row[token] = logit;
    }
}

/// The race's key for one draw: splitmix64 of a counter mixing the sequence's seed and draw
/// index, its halves XORed into 32 bits. With [`race_bits`] it is the only randomness a draw uses.
pub fn race_key(seed: i64, draw_index: i64) -> u32 {
    let mixed = splitmix64(
        (seed as u64)
            .wrapping_mul(MIX1)
            .wrapping_add((draw_index as u64).wrapping_mul(GOLDEN)),
    );
    mixed as u32 ^ (mixed >> 32) as u32
}

/// Token `token`'s 32 random bits in the race keyed `key`: murmur3's 32-bit finalizer of the
/// token spread by a multiplication and the key XORed in. For one key, distinct tokens
/// get distinct bits (each step is a bijection of the 32-bit word). A few integer operations, so
/// that a row's worth vectorizes (`simd::race_survivors`: two rounds of the finalizer cost a
/// sampled row of SmolLM2's vocabulary ~20 µs more, on a 2-vCPU Xeon); the worker's libtorch
/// sampler computes the same bits as tensors (`worker/src/sampler.rs`).
#[inline(always)]
pub fn race_bits(key: u32, token: u32) -> u32 {
    fmix32(key ^ token.wrapping_mul(RACE_TOKEN_MIX))
}

/// Odd, so that multiplying by it is a bijection of the 32-bit tokens (2³² / φ).
pub const RACE_TOKEN_MIX: u32 = 0x9E37_79B9;
/// murmur3's `fmix32` multipliers.
pub const FMIX32_MUL1: u32 = 0x85EB_CA6B;
pub const FMIX32_MUL2: u32 = 0xC2B2_AE35;

#[inline(always)]
fn fmix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(FMIX32_MUL1);
    x ^= x >> 13;
    x = x.wrapping_mul(FMIX32_MUL2);
    x ^ (x >> 16)
}

/// The exponential number (rate 1) of a token's race bits: `−ln(1 − v)` for `v = (bits + ½) / 2³²`
/// in (0, 1), so never 0 or infinite. At least `v`, which is what lets a pass rule tokens out.
pub fn race_exponential(bits: u32) -> f64 {
    let v = (f64::from(bits) + 0.5) * (1.0 / 4_294_967_296.0);
    -(-v).ln_1p()
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
const MIX1: u64 = 0xBF58_476D_1CE4_E5B9;
const MIX2: u64 = 0x94D0_49BB_1331_11EB;

/// The splitmix64 finalizer of `x + GOLDEN`.
fn splitmix64(x: u64) -> u64 {
    let z = x.wrapping_add(GOLDEN);
    let z = (z ^ (z >> 30)).wrapping_mul(MIX1);
    let z = (z ^ (z >> 27)).wrapping_mul(MIX2);
    z ^ (z >> 31)
}

/// Weights below this are what the exponential's clamp leaves of −∞ or of a logit ~87 below the
/// maximum: not drawable (their mass is below the uniform number's resolution anyway).
const NEGLIGIBLE_WEIGHT: f32 = f32::MIN_POSITIVE * 1.01;

/// Tokens one pass of the race rules out at once (their flags fit a small stack buffer).
const RACE_CHUNK: usize = 256;

/// Draws a token from `row` (non-empty) under `params`; `weights` is scratch, resized to the row.
/// A row with no finite maximum (all −∞, NaN, or +∞ somewhere) has no distribution to draw from:
/// it gives its first maximum, as the argmax would.
pub fn draw(row: &[f32], params: &DrawParams, weights: &mut Vec<f32>) -> usize {
    // Times the reciprocal, as the libtorch sampler scales (the same products): multiplying by
    // a positive number is monotone, so the scaled row's maximum is the maximum's product.
    let inverse_temperature = 1.0 / params.temperature.max(1e-5);
    let heaviest = argmax(row);
    let max = row[heaviest] * inverse_temperature;
    if !max.is_finite() {
        return heaviest;
    }
    weights.clear();
    weights.extend(row.iter().map(|&logit| logit * inverse_temperature - max));
    crate::exp_in_place(weights);
    // Weights are now in [0, 1], the most likely token's e⁰ = 1. The loops below are selects
    // the compiler vectorizes; NaN fails every comparison and becomes 0.
    for w in weights.iter_mut() {
        *w = if *w >= NEGLIGIBLE_WEIGHT { *w } else { 0.0 };
    }
    let top_k = usize::try_from(params.top_k).ok().filter(|&k| k > 0 && k < row.len());
    if top_k.is_some() || params.top_p < 1.0 {
        if let Some(cut) = find_cut(weights, top_k, params.top_p) {
            // Kept: heavier than the cut, or as heavy and not after it.
            let (through_cut, after_cut) = weights.split_at_mut(cut.token as usize + 1);
            for w in through_cut {
                *w = if *w >= cut.weight { *w } else { 0.0 };
            }
            for w in after_cut {
                *w = if *w > cut.weight { *w } else { 0.0 };
            }
        }
    }
    if params.min_p > 0.0 {
        // Relative to the most likely token, whose weight is 1 (and which every mask keeps).
        let floor = params.min_p;
        for w in weights.iter_mut() {
            *w = if *w >= floor { *w } else { 0.0 };
        }
    }
    race(weights, heaviest, race_key(params.seed, params.draw_index))
}

/// The exponential race over `weights`: the token with the largest `w_t / E_t`, the lowest such
/// token on a tie. `heaviest` has the largest weight (positive).
///
/// The most likely token's score `b` comes first. Since `E_t ≥ v_t` (see [`race_exponential`]),
/// a token with `w_t ≤ v_t · b` cannot beat it, and a vectorized pass over each chunk of the
/// row rules those out with `v_t` cut to 24 bits (smaller still) and `b` lowered by a margin
/// that covers the pass's f32 rounding. Only the tokens left are scored exactly, in f64.
fn race(weights: &[f32], heaviest: usize, key: u32) -> usize {
    let score = |token: usize| f64::from(weights[token]) / race_exponential(race_bits(key, token as u32));
    let mut winner = (heaviest, score(heaviest));
    let bound = (winner.1 as f32) * (1.0 - 1e-4);
    let mut left = [0u8; RACE_CHUNK];
    for (chunk, values) in weights.chunks(RACE_CHUNK).enumerate() {
        let first = chunk * RACE_CHUNK;
        let flags = &mut left[..values.len()];
        if crate::simd::race_survivors(key, first as u32, values, bound, flags) == 0 {
            continue;
        }
        for (offset, _) in flags.iter().enumerate().filter(|&(_, &flag)| flag != 0) {
            let token = first + offset;
            let token_score = score(token);
            if token_score > winner.1 || (token_score == winner.1 && token < winner.0) {
                winner = (token, token_score);
            }
        }
    }
    winner.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> DrawParams {
        DrawParams {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            draw_index: 0,
        }
    }

    const LOGITS: [f32; 6] = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0];

    /// f64 softmax of `LOGITS / temperature`.
    fn softmax(temperature: f64) -> Vec<f64> {
        let e: Vec<f64> = LOGITS.iter().map(|&x| (f64::from(x) / temperature).exp()).collect();
        let z: f64 = e.iter().sum();
        e.iter().map(|v| v / z).collect()
    }

    fn frequencies(p: &DrawParams, draws: i64) -> Vec<f64> {
        let mut counts = [0usize; 6];
        let mut weights = Vec::new();
        for seed in 0..draws {
            counts[draw(&LOGITS, &DrawParams { seed, ..*p }, &mut weights)] += 1;
        }
        counts.iter().map(|&c| c as f64 / draws as f64).collect()
    }

    fn assert_close_to(frequencies: &[f64], expected: &[f64], draws: i64) {
        for (token, (f, p)) in frequencies.iter().zip(expected).enumerate() {
            // Five standard deviations of a binomial frequency.
            let tolerance = 5.0 * (p * (1.0 - p) / draws as f64).sqrt() + 1e-3;
            assert!((f - p).abs() < tolerance, "token {token}: {f:.4} vs {p:.4}");
        }
    }

    #[test]
    fn draws_follow_the_tempered_softmax() {
        let draws = 40_000;
        for temperature in [1.0f32, 0.5, 2.0] {
            let expected = softmax(f64::from(temperature));
            assert_close_to(&frequencies(&params(temperature), draws), &expected, draws);
        }
    }

    #[test]
    fn masks_restrict_the_support_and_renormalize() {
        let draws = 20_000;
        // softmax ≈ [0.52, 0.19, 0.12, 0.07, 0.03, 0.003].
        let top_k = DrawParams {
            top_k: 2,
            ..params(1.0)
        };
        let p = softmax(1.0);
        let renormalized = [p[0] / (p[0] + p[1]), p[1] / (p[0] + p[1]), 0.0, 0.0, 0.0, 0.0];
        assert_close_to(&frequencies(&top_k, draws), &renormalized, draws);
        // Mass before token 2 is 0.71 > 0.6: tokens 0 and 1 stay.
        let top_p = DrawParams {
            top_p: 0.6,
            ..params(1.0)
        };
        assert_close_to(&frequencies(&top_p, draws), &renormalized, draws);
        // top-p over what top-k kept: of [0.73, 0.27] the mass before token 1 is 0.73 > 0.7.
        let both = DrawParams {
            top_k: 2,
            top_p: 0.7,
            ..params(1.0)
        };
        assert_eq!(frequencies(&both, 200)[0], 1.0);
        // Kept: p ≥ 0.2 × 0.52 = 0.104, i.e. tokens 0, 1, 2.
        let min_p = DrawParams {
            min_p: 0.2,
            ..params(1.0)
        };
        let z = p[0] + p[1] + p[2];
        assert_close_to(
            &frequencies(&min_p, draws),
            &[p[0] / z, p[1] / z, p[2] / z, 0.0, 0.0, 0.0],
            draws,
        );
        let one = DrawParams {
            top_k: 1,
            ..params(1.5)
        };
        assert_eq!(frequencies(&one, 200)[0], 1.0);
    }

    #[test]
    fn a_draw_depends_on_the_seed_and_draw_index_only() {
        let mut weights = Vec::new();
        let p = DrawParams {
            seed: 77,
            draw_index: 3,
            ..params(1.0)
        };
        let first = draw(&LOGITS, &p, &mut weights);
        assert_eq!(draw(&LOGITS, &p, &mut weights), first);
        let tokens: Vec<usize> = (0..200)
            .map(|draw_index| draw(&LOGITS, &DrawParams { draw_index, ..p }, &mut weights))
            .collect();
        assert!(tokens.iter().any(|&t| t != tokens[0]), "draw indices change the draw");
        assert_ne!(race_key(78, 3), race_key(77, 3));
        assert_ne!(race_key(77, 4), race_key(77, 3));
    }

    #[test]
    fn a_large_vocabulary_draws_from_every_chunk_and_only_drawable_tokens() {
        // 2 000 equal tokens (several draw chunks), every other one masked to −∞.
        let row: Vec<f32> = (0..2_000)
            .map(|i| if i % 2 == 0 { 0.0 } else { f32::NEG_INFINITY })
            .collect();
        let mut weights = Vec::new();
        let mut counts = vec![0usize; 8];
        for seed in 0..4_000 {
            let token = draw(&row, &DrawParams { seed, ..params(1.0) }, &mut weights);
            assert_eq!(token % 2, 0, "token {token} has weight 0");
            counts[token / 250] += 1;
        }
        assert!(counts.iter().all(|&c| (400..600).contains(&c)), "{counts:?}");
        // Top-p and top-k on a flat tail: the threshold has to fall to reach the mass.
        let tail: Vec<f32> = (0..50_000)
            .map(|i| if i == 7 { 5.0 } else { -(i as f32) * 1e-4 })
            .collect();
        let spread = DrawParams {
            top_p: 0.9,
            ..params(1.0)
        };
        let tokens: Vec<usize> = (0..50)
            .map(|seed| draw(&tail, &DrawParams { seed, ..spread }, &mut weights))
            .collect();
        assert!(tokens.iter().any(|&t| t != 7), "most of the mass is in the tail");
        let k = DrawParams {
            top_k: 3,
            ..params(1.0)
        };
        for seed in 0..50 {
            assert!([0, 1, 7].contains(&draw(&tail, &DrawParams { seed, ..k }, &mut weights)));
        }
    }

    /// What the race is for: logits that differ in their last bits (other kernels, another
    /// batch, the prefix cache, a restart) draw the same token. Drawn by inverse CDF in token-id
    /// order (what this module did before), rows of this shape changed token in 32 of 2 000
    /// draws (a NumPy simulation of the same distributions; the race there: none).
    #[test]
    fn last_bit_differences_in_the_logits_do_not_change_the_draw() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        // A language model's shape: a few likely tokens over a long, spread tail.
        let row: Vec<f32> = (0..49_152)
            .map(|_| rng.random_range(-12.0f32..0.0) + if rng.random_bool(0.001) { 6.0 } else { 0.0 })
            .collect();
        let nudged: Vec<f32> = row.iter().map(|&l| l + rng.random_range(-3e-5f32..3e-5)).collect();
        let mut weights = Vec::new();
        let draws = 2_000;
        let (mut changed, mut tail) = (0, 0);
        for seed in 0..draws {
            let p = DrawParams { seed, ..params(1.0) };
            let token = draw(&row, &p, &mut weights);
            changed += usize::from(draw(&nudged, &p, &mut weights) != token);
            tail += usize::from(row[token] < 0.0);
        }
        assert!(tail > draws as usize / 10, "the tail is drawn ({tail} of {draws})");
        assert!(changed <= 2, "{changed} of {draws} draws changed");
    }

    #[test]
    fn rows_without_a_finite_maximum_give_their_first_maximum() {
        let mut weights = Vec::new();
        assert_eq!(draw(&[f32::NEG_INFINITY; 3], &params(1.0), &mut weights), 0);
        assert_eq!(draw(&[0.0, f32::INFINITY, 1.0], &params(1.0), &mut weights), 1);
    }

    #[test]
    fn penalties_follow_vllm() {
        let mut row = LOGITS.to_vec();
        // Token 0 in the prompt, token 3 twice in the output, token 4 once.
        let penalties = Penalties {
            repetition: 2.0,
            frequency: 0.5,
            presence: 0.25,
        };
        apply_penalties(&mut row, &[0, 3, 4, 3], 1, &penalties);
        assert_eq!(row, [1.0, 1.0, 0.5, 0.0 * 2.0 - 1.0 - 0.25, -2.0 - 0.5 - 0.25, -3.0]);
        let mut unchanged = LOGITS.to_vec();
        apply_penalties(&mut unchanged, &[9, -1], 0, &penalties);
        assert_eq!(unchanged, LOGITS, "out-of-range ids are ignored");
    }
}
