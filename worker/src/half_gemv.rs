//! f16 copies of the projection weights, used for steps of a single token (one sequence decoding
//! alone). Such a step is a matrix-vector product over every weight, bounded by how fast the
//! weights stream from memory; libtorch's CPU f16 GEMV reads half the bytes and measured ~2.9×
//! faster than f32 for this model's shapes, while its f16 GEMM for several rows measured slower,
//! so larger steps keep the f32 weights. Opt-in (`worker.half_precision_gemv`): activations are
//! rounded to f16 on the way in, which can flip a near-tie between two tokens.

use tch::{Kind, Tensor};

use crate::error::WorkerError;
use crate::weights::ModelWeights;

pub struct HalfLayer {
    pub qkv_proj: Tensor,
    pub o_proj: Tensor,
    pub gate_up_proj: Tensor,
    pub down_proj: Tensor,
}

pub struct HalfWeights {
    pub layers: Vec<HalfLayer>,
    pub lm_head: Tensor,
}

impl HalfWeights {
    pub fn from_weights(weights: &ModelWeights) -> Result<Self, WorkerError> {
        let half = |t: &Tensor| -> Result<Tensor, WorkerError> { Ok(t.f_to_kind(Kind::Half)?.f_contiguous()?) };
        let layers = weights
            .layers
            .iter()
            .map(|layer| {
                Ok(HalfLayer {
                    qkv_proj: half(&layer.qkv_proj)?,
                    o_proj: half(&layer.o_proj)?,
                    gate_up_proj: half(&layer.gate_up_proj)?,
                    down_proj: half(&layer.down_proj)?,
                })
            })
            .collect::<Result<_, WorkerError>>()?;
        Ok(Self {
            layers,
            lm_head: half(&weights.lm_head)?,
        })
    }
}
