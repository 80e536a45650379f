//! The Llama-family decoder: embeddings, RMSNorm, grouped-query attention with rotary embeddings
//! over the paged KV cache, SwiGLU MLP, tied or separate output head.
//!
//! All tokens of a step — prompt chunks and decode tokens of many sequences — run through the
//! projections and the MLP as one flat `[tokens, hidden]` batch; only attention looks at sequences.

use tch::{Device, Kind, Tensor};

use crate::attention::AttentionPlan;
use crate::config::ModelConfig;
use crate::error::WorkerError;
use crate::half_gemv::HalfWeights;
use crate::kv_cache::KvCache;
use crate::paged_attention::PagedDecodeAttention;
use crate::rope::Rope;
use crate::weights::ModelWeights;

pub struct LlamaModel {
    pub config: ModelConfig,
    weights: ModelWeights,
    /// f16 projection weights for one-token steps, when enabled.
    half: Option<HalfWeights>,
    rope: Rope,
    /// Decode attention over the paged blocks on CUDA in bf16 ([`crate::paged_attention`]);
    /// `None` elsewhere, where it could not be loaded, or with
    /// `RIVULET_KERNELS_NO_CUDA_PAGED_ATTENTION=1` (decode then gathers its blocks, as prefill does).
    paged_decode: Option<PagedDecodeAttention>,
    pub device: Device,
    pub kind: Kind,
}

/// One step's flat inputs, on the compute device.
pub struct ForwardInputs<'a> {
    /// `[tokens]` i64.
    pub input_ids: &'a Tensor,
    /// `[tokens]` i64, each token's position in its sequence.
    pub positions: &'a Tensor,
    /// `[tokens]` i64, where each token's K and V are written.
    pub slot_mapping: &'a Tensor,
    pub attention: &'a AttentionPlan,
    /// `[samples]` i64: the rows whose logits are wanted (each sampled sequence's last token).
    pub logit_rows: &'a Tensor,
}

impl LlamaModel {
    pub fn new(config: ModelConfig, weights: ModelWeights, max_positions: usize, device: Device, kind: Kind) -> Self {
        let rope = Rope::new(config.head_dim, config.rope_theta, max_positions, device);
        let gathered = std::env::var_os("RIVULET_KERNELS_NO_CUDA_PAGED_ATTENTION").is_some_and(|v| v == "1");
        let paged_decode = (device.is_cuda() && kind == Kind::BFloat16 && !gathered)
            .then(|| PagedDecodeAttention::load(device, config.head_dim, config.num_heads, config.num_kv_heads))
            .and_then(|loaded| match loaded {
                Ok(kernel) => {
                    tracing::info!("decode attention reads the paged KV blocks in place (NVRTC kernel)");
                    Some(kernel)
                }
                Err(error) => {
                    tracing::warn!(%error, "decode attention gathers its KV blocks instead");
                    None
                }
            });
        Self {
            config,
            weights,
            half: None,
            rope,
            paged_decode,
            device,
            kind,
        }
    }

    /// Keeps f16 copies of the projections for one-token steps (see [`crate::half_gemv`]).
    pub fn enable_half_precision_gemv(&mut self) -> Result<(), WorkerError> {
        self.half = Some(HalfWeights::from_weights(&self.weights)?);
        Ok(())
    }

    /// Moves the f32 projection weights into oneDNN's tensor format, so that every projection runs
    /// through oneDNN's matmul instead of MKL's sgemm. On the 2-core CPU this measured 1.3–1.4×
    /// faster for 8–32-row steps (sgemm repacks each weight on every call; about a fifth of a
    /// decode step went to that copy) and no slower for one row or 512-row prefills. The
    /// results are the same f32 products, summed in another order. The token embedding stays
    /// dense (it is gathered from, not multiplied).
    pub fn use_onednn_projections(&mut self) -> Result<(), WorkerError> {
        let convert = |t: &Tensor| -> Result<Tensor, WorkerError> { Ok(t.f_contiguous()?.to_mkldnn()) };
        for layer in &mut self.weights.layers {
            layer.qkv_proj = convert(&layer.qkv_proj)?;
            layer.o_proj = convert(&layer.o_proj)?;
            layer.gate_up_proj = convert(&layer.gate_up_proj)?;
            layer.down_proj = convert(&layer.down_proj)?;
        }
        self.weights.lm_head = convert(&self.weights.lm_head)?;
        Ok(())
    }

    /// Runs the step and returns f32 logits `[samples, vocab]` for `logit_rows`.
    pub fn forward(&self, inputs: &ForwardInputs<'_>, kv_cache: &KvCache) -> Tensor {
        let config = &self.config;
        let tokens = inputs.input_ids.size()[0];
        let q_dim = (config.num_heads * config.head_dim) as i64;
        let kv_dim = config.kv_dim() as i64;
        let (heads, kv_heads, head_dim) = (
            config.num_heads as i64,
            config.num_kv_heads as i64,
            config.head_dim as i64,
        );

        let half = self.half.as_ref().filter(|_| tokens == 1);
        let angles = self.rope.angles(inputs.positions);
        let mut hidden = self.weights.token_embedding.index_select(0, inputs.input_ids);
        for (index, (layer, cache)) in self.weights.layers.iter().zip(&kv_cache.layers).enumerate() {
            let half_layer = half.map(|h| &h.layers[index]);
            let normed = self.rms_norm(&hidden, &layer.attn_norm);
            let qkv = linear(&normed, &layer.qkv_proj, half_layer.map(|h| &h.qkv_proj));
            // Q and K side by side, rotated in one pass.
            let rotated = angles.apply(
                &qkv.narrow(1, 0, q_dim + kv_dim)
                    .view([tokens, heads + kv_heads, head_dim]),
            );
            let q = rotated.narrow(1, 0, heads);
            let k = rotated.narrow(1, heads, kv_heads);
            let v = qkv.narrow(1, q_dim + kv_dim, kv_dim).view([tokens, kv_heads, head_dim]);

            let (mut key_cache, mut value_cache) = cache.flat();
            let _ = key_cache.index_copy_(0, inputs.slot_mapping, &k);
            let _ = value_cache.index_copy_(0, inputs.slot_mapping, &v);
            let attended = inputs
                .attention
                .attend(&q, &key_cache, &value_cache, self.paged_decode.as_ref());
            add_projection(&mut hidden, &attended, &layer.o_proj, half_layer.map(|h| &h.o_proj));

            let normed = self.rms_norm(&hidden, &layer.ffn_norm);
            let gate_up = linear(&normed, &layer.gate_up_proj, half_layer.map(|h| &h.gate_up_proj)).chunk(2, 1);
            let activated = gate_up[0].silu() * &gate_up[1];
            add_projection(
                &mut hidden,
                &activated,
                &layer.down_proj,
                half_layer.map(|h| &h.down_proj),
            );
        }
        // Only the sampled rows need the (vocabulary-sized) output head.
        let last = hidden.index_select(0, inputs.logit_rows);
        let normed = self.rms_norm(&last, &self.weights.output_norm);
        linear(&normed, &self.weights.lm_head, half.map(|h| &h.lm_head)).to_kind(Kind::Float)
    }

    /// RMSNorm computed in f32 whatever the compute dtype, normalized values rounded to it before
    /// the weight (as transformers' LlamaRMSNorm): libtorch's `rms_norm` does exactly that, in one
    /// kernel on CUDA.
    fn rms_norm(&self, x: &Tensor, weight: &Tensor) -> Tensor {
        x.rms_norm([self.config.hidden_size as i64], Some(weight), self.config.rms_norm_eps)
    }
}

/// `hidden += x · weightᵀ`: one GEMM accumulating into `hidden` for plain weights (no separate add,
/// and one rounding in the compute dtype instead of two); otherwise through [`linear`].
fn add_projection(hidden: &mut Tensor, x: &Tensor, weight: &Tensor, half: Option<&Tensor>) {
    if half.is_none() && !weight.is_mkldnn() {
        let _ = hidden.addmm_(x, &weight.tr());
    } else {
        *hidden += linear(x, weight, half);
    }
}

/// A projection, `x · weightᵀ`: through the f16 copy when one is given (the result keeps `x`'s
/// kind); through oneDNN's matmul when the weight is in its format (see
/// [`LlamaModel::use_onednn_projections`]; input and output stay ordinary tensors).
fn linear(x: &Tensor, weight: &Tensor, half: Option<&Tensor>) -> Tensor {
    match half {
        Some(half) => x.to_kind(Kind::Half).linear::<Tensor>(half, None).to_kind(x.kind()),
        None if weight.is_mkldnn() => x
            .contiguous()
            .to_mkldnn()
            .mkldnn_linear::<Tensor>(weight, None)
            .to_dense(None, false),
        None => x.linear::<Tensor>(weight, None),
    }
}
