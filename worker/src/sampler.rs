//! Choosing each sampled sequence's next token from its logits, in one batched pass.
//! Greedy where the temperature is 0, otherwise a draw from softmax(logits / temperature).

use tch::{Kind, Tensor};

pub struct Sampled {
    /// `[samples]` i64.
    pub tokens: Tensor,
    /// `[samples]` f32: log-probability of each chosen token under the model's distribution.
    pub logprobs: Tensor,
}

/// `logits`: `[samples, vocab]` f32; `temperature`: `[samples]` f32 on the same device.
pub fn sample(logits: &Tensor, temperature: &Tensor) -> Sampled {
    let greedy = logits.argmax(-1, false);
    let is_greedy = temperature.le(0.0);
    let tokens = if is_greedy.all().int64_value(&[]) != 0 {
        greedy
    } else {
        let safe_temperature = temperature.clamp_min(1e-5).unsqueeze(1);
        let probs = (logits / safe_temperature).softmax(-1, Kind::Float);
        let drawn = probs.multinomial(1, true).squeeze_dim(1);
        greedy.where_self(&is_greedy, &drawn)
    };
    let logprobs = logits
        .log_softmax(-1, Kind::Float)
        .gather(1, &tokens.unsqueeze(1), false)
        .squeeze_dim(1);
    Sampled { tokens, logprobs }
}
