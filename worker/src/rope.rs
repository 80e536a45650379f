//! Rotary position embedding in the interleaved layout (adjacent dimension pairs), as llama.cpp's
//! `rope_f32` with `GGML_ROPE_TYPE_NORM` — the layout GGUF's permuted Q/K rows expect.

use tch::{Device, Kind, Tensor};

pub struct Rope {
    /// `[max_positions, head_dim / 2]`, f32.
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    pub fn new(head_dim: usize, theta: f64, max_positions: usize, device: Device) -> Self {
        let half = (head_dim / 2) as i64;
        let exponents = Tensor::arange(half, (Kind::Double, device)) * (2.0 / head_dim as f64);
        let inv_freq = Tensor::from(theta).to_device(device).pow(&exponents).reciprocal();
        let positions = Tensor::arange(max_positions as i64, (Kind::Double, device));
        let angles = positions.outer(&inv_freq);
        Self {
            cos: angles.cos().to_kind(Kind::Float),
            sin: angles.sin().to_kind(Kind::Float),
        }
    }

    /// The step's cos and sin rows, gathered once for every layer (`positions`: `[tokens]` i64).
    pub fn angles(&self, positions: &Tensor) -> RopeAngles {
        RopeAngles {
            cos: self.cos.index_select(0, positions).unsqueeze(1),
            sin: self.sin.index_select(0, positions).unsqueeze(1),
        }
    }
}

/// One step's rotation, `[tokens, 1, head_dim / 2]` f32 each.
pub struct RopeAngles {
    cos: Tensor,
    sin: Tensor,
}

impl RopeAngles {
    /// Rotates `x` (`[tokens, heads, head_dim]`, any float kind; computed in f32):
    /// (even, odd) ↦ (even·cos − odd·sin, even·sin + odd·cos) as x·cos + (−odd, even)·sin.
    pub fn apply(&self, x: &Tensor) -> Tensor {
        let (tokens, heads, head_dim) = x.size3().expect("rope input is [tokens, heads, head_dim]");
        let pairs = x.to_kind(Kind::Float).view([tokens, heads, head_dim / 2, 2]);
        let partner = Tensor::stack(&[-pairs.select(3, 1), pairs.select(3, 0)], 3);
        let (cos, sin) = (self.cos.unsqueeze(3), self.sin.unsqueeze(3));
        (&pairs * cos)
            .addcmul(&partner, &sin)
            .view([tokens, heads, head_dim])
            .to_kind(x.kind())
    }
}
