//! The Llama-family forward pass on the CPU with Rivulet's own kernels ([`rivulet_kernels`]),
//! without libtorch: projections multiply f32 activations by the weights in their GGUF blocks
//! (a Q4_1 model streams ~96 MB per step instead of 538 MB of f32), RMSNorm, rotary embedding
//! and SiLU·mul are single passes, and attention reads the paged KV cache through the block
//! tables. libtorch only samples from the logits. Why: a libtorch step spent most of a one-token
//! step outside the weight reads — ~25 small ops per layer, gathers, OpenMP between ops.
//!
//! The arithmetic is the f32 reference's: the same dequantized weights, products summed in f32
//! (in another order), so greedy tokens and logprobs match transformers as before.

use rivulet_gguf::GgufFile;
use rivulet_kernels::attention::{paged_attention, write_kv, AttentionShape, TokenKeys};
use rivulet_kernels::awake::install_awake;
use rivulet_kernels::ops::{add_rms_norm, rms_norm, rotate_queries_and_keys, silu_mul, RopeTable};
use rivulet_kernels::{Isa, WeightMatrix};
use tch::Tensor;

use crate::attention::SeqSlice;
use crate::config::ModelConfig;
use crate::error::WorkerError;
use crate::kv_cache::HostKvCache;
use crate::step_phases::{Phase, PhaseClock, StepPhases};
use crate::weights::ModelWeights;

/// One projection: its matrices filling consecutive output columns. Matrices of one format are
/// stacked into one (Q, K and V are one pass over the activations); a file that stores them in
/// different formats (e.g. a Q4_K_M file's Q6_K `attn_v`) keeps them apart.
pub struct Projection {
    parts: Vec<WeightMatrix>,
    rows: usize,
}

impl Projection {
    fn new(parts: Vec<WeightMatrix>) -> Self {
        let rows = parts.iter().map(WeightMatrix::rows).sum();
        let parts = match WeightMatrix::stack(&parts) {
            Some(stacked) => vec![stacked],
            None => parts,
        };
        Self { parts, rows }
    }

    /// `out = x · Wᵀ`, `x` `[batch, cols]`, `out` `[batch, rows]`.
    fn apply(&self, x: &[f32], batch: usize, out: &mut Vec<f32>) -> Result<(), WorkerError> {
        // Every part stores each of its columns for every row, so a buffer already of this
        // length (the same projection's, a layer earlier) is overwritten without zeroing it.
        out.resize(batch * self.rows, 0.0);
        let mut column = 0;
        for part in &self.parts {
            part.matmul_into_columns(Isa::best(), x, batch, out, self.rows, column)?;
            column += part.rows();
        }
        Ok(())
    }

    fn byte_len(&self) -> usize {
        self.parts.iter().map(WeightMatrix::byte_len).sum()
    }
}

pub struct CpuLayer {
    attn_norm: Vec<f32>,
    qkv: Projection,
    o: Projection,
    ffn_norm: Vec<f32>,
    gate_up: Projection,
    down: Projection,
}

pub struct CpuWeights {
    token_embedding: WeightMatrix,
    layers: Vec<CpuLayer>,
    output_norm: Vec<f32>,
    /// The output head; the token embedding when the model ties them (`None`).
    lm_head: Option<WeightMatrix>,
}

impl CpuWeights {
    /// The weights as the file stores them (only norms are dequantized).
    pub fn from_gguf(file: &GgufFile, config: &ModelConfig) -> Result<Self, WorkerError> {
        let hidden = config.hidden_size;
        let q_dim = config.num_heads * config.head_dim;
        let kv_dim = config.kv_dim();
        let ffn = config.intermediate_size;
        let vocab = config.vocab_size;
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<WeightMatrix, WorkerError> {
            let info = file
                .tensor(name)
                .ok_or_else(|| WorkerError::UnsupportedModel(name.to_owned(), "tensor missing".to_owned()))?;
            let shape = info.torch_shape();
            if shape != [rows as i64, cols as i64] {
                return Err(WorkerError::UnsupportedModel(
                    name.to_owned(),
                    format!("shape {shape:?}, expected [{rows}, {cols}]"),
                ));
            }
            Ok(WeightMatrix::new(
                info.ggml_type,
                rows,
                cols,
                file.tensor_bytes(info).to_vec(),
            )?)
        };
        let vector = |name: &str| -> Result<Vec<f32>, WorkerError> {
            let (info, values) = file.dequantize(name)?;
            if values.len() != hidden {
                return Err(WorkerError::UnsupportedModel(
                    name.to_owned(),
                    format!("{} values, expected {hidden}", info.element_count()),
                ));
            }
            Ok(values)
        };
        let layers = (0..config.num_layers)
            .map(|i| -> Result<CpuLayer, WorkerError> {
                let name = |t: &str| format!("blk.{i}.{t}.weight");
                Ok(CpuLayer {
                    attn_norm: vector(&name("attn_norm"))?,
                    qkv: Projection::new(vec![
                        matrix(&name("attn_q"), q_dim, hidden)?,
                        matrix(&name("attn_k"), kv_dim, hidden)?,
                        matrix(&name("attn_v"), kv_dim, hidden)?,
                    ]),
                    o: Projection::new(vec![matrix(&name("attn_output"), hidden, q_dim)?]),
                    ffn_norm: vector(&name("ffn_norm"))?,
                    gate_up: Projection::new(vec![
                        matrix(&name("ffn_gate"), ffn, hidden)?,
                        matrix(&name("ffn_up"), ffn, hidden)?,
                    ]),
                    down: Projection::new(vec![matrix(&name("ffn_down"), hidden, ffn)?]),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            token_embedding: matrix("token_embd.weight", vocab, hidden)?,
            layers,
            output_norm: vector("output_norm.weight")?,
            lm_head: match file.tensor("output.weight") {
                Some(_) => Some(matrix("output.weight", vocab, hidden)?),
                None => None,
            },
        })
    }

    /// From dense tensors (a Hugging Face folder), kept as f32.
    pub fn from_tensors(weights: &ModelWeights) -> Result<Self, WorkerError> {
        let dense = |t: &Tensor| -> Result<WeightMatrix, WorkerError> {
            let t = t.f_to_kind(tch::Kind::Float)?.f_contiguous()?;
            let (rows, cols) = t.size2()?;
            let values = Vec::<f32>::try_from(t.f_view([-1])?)?;
            Ok(WeightMatrix::from_f32(rows as usize, cols as usize, &values)?)
        };
        let vector = |t: &Tensor| -> Result<Vec<f32>, WorkerError> {
            Ok(Vec::<f32>::try_from(t.f_to_kind(tch::Kind::Float)?.f_contiguous()?)?)
        };
        let layers = weights
            .layers
            .iter()
            .map(|l| -> Result<CpuLayer, WorkerError> {
                Ok(CpuLayer {
                    attn_norm: vector(&l.attn_norm)?,
                    qkv: Projection::new(vec![dense(&l.qkv_proj)?]),
                    o: Projection::new(vec![dense(&l.o_proj)?]),
                    ffn_norm: vector(&l.ffn_norm)?,
                    gate_up: Projection::new(vec![dense(&l.gate_up_proj)?]),
                    down: Projection::new(vec![dense(&l.down_proj)?]),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            token_embedding: dense(&weights.token_embedding)?,
            layers,
            output_norm: vector(&weights.output_norm)?,
            lm_head: Some(dense(&weights.lm_head)?),
        })
    }

    /// Bytes of weights one step reads (projections and head).
    pub fn projection_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.qkv.byte_len() + l.o.byte_len() + l.gate_up.byte_len() + l.down.byte_len())
            .sum();
        layers + self.lm_head.as_ref().unwrap_or(&self.token_embedding).byte_len()
    }

    /// Arranges every projection and the head by 16-row panels ([`WeightMatrix::add_panels`]:
    /// Q4_0, Q4_1 and Q8_0, on a CPU with AVX2) instead of the row-major blocks, which no step
    /// reads any more ([`WeightMatrix::keep_only_panels`]; the same bytes). Returns the bytes the
    /// weights now take.
    pub fn add_panels(&mut self) -> usize {
        let head = self.lm_head.as_mut().unwrap_or(&mut self.token_embedding);
        let projections = self
            .layers
            .iter_mut()
            .flat_map(|l| [&mut l.qkv, &mut l.o, &mut l.gate_up, &mut l.down])
            .flat_map(|p| p.parts.iter_mut())
            .chain(std::iter::once(head));
        for matrix in projections {
            matrix.add_panels();
            matrix.keep_only_panels();
        }
        self.resident_bytes()
    }

    /// Bytes the weights take in memory (blocks, panels where kept, norms aside).
    pub fn resident_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.o, &l.gate_up, &l.down])
            .flat_map(|p| &p.parts)
            .map(WeightMatrix::resident_bytes)
            .sum();
        let head = self.lm_head.as_ref().map_or(0, WeightMatrix::resident_bytes);
        layers + head + self.token_embedding.resident_bytes()
    }
}

/// One step's inputs as the host holds them, straight from the step buffer (validated by
/// [`crate::step::validate`]): what the CPU kernels run, and what a CUDA decode graph's inputs are
/// copied from ([`crate::decode_graphs`]).
pub struct HostStepInputs<'a> {
    pub input_ids: &'a [i64],
    pub positions: &'a [i64],
    pub slot_mapping: &'a [i64],
    pub seqs: &'a [SeqSlice],
    /// `[num_seqs][max_blocks]` block ids.
    pub block_tables: &'a [i64],
    pub max_blocks: usize,
    /// Rows of the flat batch whose logits are wanted.
    pub logit_rows: &'a [i64],
}

pub struct CpuModel {
    pub config: ModelConfig,
    weights: CpuWeights,
    rope: RopeTable,
    /// The kernels' threads. A step runs inside the pool with its other threads kept awake
    /// ([`install_awake`]), so the kernels' parallel loops start on threads that are already
    /// running rather than handing each projection to a sleeping one; between steps they sleep.
    pool: rayon::ThreadPool,
}

/// A step's activations, one buffer per kind of row, reused layer after layer.
#[derive(Default)]
struct Activations {
    hidden: Vec<f32>,
    normed: Vec<f32>,
    qkv: Vec<f32>,
    attended: Vec<f32>,
    projected: Vec<f32>,
    gate_up: Vec<f32>,
    activated: Vec<f32>,
}

impl CpuModel {
    pub fn new(
        config: ModelConfig,
        weights: CpuWeights,
        max_positions: usize,
        threads: usize,
    ) -> Result<Self, WorkerError> {
        let rope = RopeTable::new(config.head_dim, config.rope_theta, max_positions);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("rivulet-kernels-{i}"))
            // Subnormals cost ~100 cycles each and weigh nothing next to the sums they join.
            .start_handler(|_| rivulet_kernels::flush_subnormals_on_this_thread())
            .build()
            .map_err(|e| WorkerError::UnsupportedModel("thread pool".to_owned(), e.to_string()))?;
        Ok(Self {
            config,
            weights,
            rope,
            pool,
        })
    }

    pub fn weights(&self) -> &CpuWeights {
        &self.weights
    }

    /// Runs the step and returns f32 logits `[logit_rows, vocab]`, row-major. The pool's
    /// threads stay awake from the first layer to the last ([`install_awake`]).
    pub fn forward(&self, step: &HostStepInputs<'_>, cache: &mut HostKvCache) -> Result<Vec<f32>, WorkerError> {
        install_awake(&self.pool, || {
            self.forward_in_pool(step, cache, &mut PhaseClock::untimed())
        })
    }

    /// [`Self::forward`], adding the step's wall time per phase to `phases` (the worker bench's
    /// breakdown; see [`crate::step_phases`]).
    pub fn forward_timed(
        &self,
        step: &HostStepInputs<'_>,
        cache: &mut HostKvCache,
        phases: &mut StepPhases,
    ) -> Result<Vec<f32>, WorkerError> {
        install_awake(&self.pool, || {
            self.forward_in_pool(step, cache, &mut PhaseClock::timing(phases))
        })
    }

    /// Runs `work` on the kernels' threads (its parallel loops use them rather than rayon's
    /// global pool).
    pub fn in_pool<R: Send>(&self, work: impl FnOnce() -> R + Send) -> R {
        self.pool.install(work)
    }

    fn forward_in_pool(
        &self,
        step: &HostStepInputs<'_>,
        cache: &mut HostKvCache,
        clock: &mut PhaseClock<'_>,
    ) -> Result<Vec<f32>, WorkerError> {
        let config = &self.config;
        let (hidden_size, kv_dim) = (config.hidden_size, config.kv_dim());
        let q_dim = config.num_heads * config.head_dim;
        let qkv_width = q_dim + 2 * kv_dim;
        let tokens = step.input_ids.len();
        let eps = config.rms_norm_eps as f32;
        let shape = AttentionShape {
            heads: config.num_heads,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            block_size: cache.block_size,
        };
        let keys_of = self.token_keys(step)?;
        if step.positions.iter().any(|&p| p as usize >= self.rope.max_positions()) {
            return Err(WorkerError::InvalidStep(
                "a position is past the rotary table".to_owned(),
            ));
        }

        let mut act = Activations::default();
        act.hidden.reserve(tokens * hidden_size);
        for &id in step.input_ids {
            self.weights
                .token_embedding
                .dequantize_row(id as usize, &mut act.hidden)?;
        }
        act.normed.resize(tokens * hidden_size, 0.0);
        act.attended.resize(tokens * q_dim, 0.0);
        act.activated.resize(tokens * config.intermediate_size, 0.0);
        let layers = &self.weights.layers;
        clock.lap(Phase::Embedding);
        if let Some(first) = layers.first() {
            rms_norm(&act.hidden, &first.attn_norm, eps, &mut act.normed);
        }
        clock.lap(Phase::Norms);
        for (index, (layer, kv)) in layers.iter().zip(&mut cache.layers).enumerate() {
            // `act.normed` holds this layer's attention norm of the residual stream.
            layer.qkv.apply(&act.normed, tokens, &mut act.qkv)?;
            clock.lap(Phase::Qkv);
            rotate_queries_and_keys(&self.rope, &mut act.qkv, qkv_width, q_dim, kv_dim, step.positions);
            write_kv(
                shape,
                &act.qkv,
                qkv_width,
                step.slot_mapping,
                &mut kv.keys,
                &mut kv.values,
            );
            clock.lap(Phase::RotaryAndCacheWrite);
            paged_attention(
                shape,
                &act.qkv,
                qkv_width,
                &keys_of,
                &kv.keys,
                &kv.values,
                &mut act.attended,
            );
            clock.lap(Phase::Attention);
            layer.o.apply(&act.attended, tokens, &mut act.projected)?;
            clock.lap(Phase::Output);
            add_rms_norm(&mut act.hidden, &act.projected, &layer.ffn_norm, eps, &mut act.normed);
            clock.lap(Phase::Norms);
            layer.gate_up.apply(&act.normed, tokens, &mut act.gate_up)?;
            clock.lap(Phase::GateUp);
            silu_mul(&act.gate_up, config.intermediate_size, &mut act.activated);
            clock.lap(Phase::SiluMul);
            layer.down.apply(&act.activated, tokens, &mut act.projected)?;
            clock.lap(Phase::Down);
            // The next layer's attention norm joins this layer's residual add; after the last
            // layer only the sampled rows are summed (below).
            if let Some(next) = layers.get(index + 1) {
                add_rms_norm(&mut act.hidden, &act.projected, &next.attn_norm, eps, &mut act.normed);
            }
            clock.lap(Phase::Norms);
        }

        // Only the sampled rows need the (vocabulary-sized) output head.
        let rows = step.logit_rows.len();
        let mut last = Vec::with_capacity(rows * hidden_size);
        for &row in step.logit_rows {
            let span = row as usize * hidden_size..(row as usize + 1) * hidden_size;
            if layers.is_empty() {
                last.extend_from_slice(&act.hidden[span]);
            } else {
                last.extend(
                    act.hidden[span.clone()]
                        .iter()
                        .zip(&act.projected[span])
                        .map(|(h, p)| h + p),
                );
            }
        }
        let mut normed = vec![0.0; rows * hidden_size];
        rms_norm(&last, &self.weights.output_norm, eps, &mut normed);
        let head = self.weights.lm_head.as_ref().unwrap_or(&self.weights.token_embedding);
        let mut logits = vec![0.0; rows * config.vocab_size];
        head.matmul(&normed, rows, &mut logits)?;
        clock.lap(Phase::Head);
        Ok(logits)
    }

    /// What each token attends to: its sequence's block table and its position + 1 keys.
    fn token_keys<'a>(&self, step: &HostStepInputs<'a>) -> Result<Vec<TokenKeys<'a>>, WorkerError> {
        let mut keys = Vec::with_capacity(step.input_ids.len());
        for (i, seq) in step.seqs.iter().enumerate() {
            let table = step
                .block_tables
                .get(i * step.max_blocks..(i + 1) * step.max_blocks)
                .ok_or_else(|| WorkerError::InvalidStep(format!("no block table for sequence {i}")))?;
            let past = (seq.context_len - seq.num_tokens) as usize;
            keys.extend((1..=seq.num_tokens as usize).map(|j| TokenKeys {
                block_table: table,
                visible: past + j,
            }));
        }
        if keys.len() != step.input_ids.len() {
            return Err(WorkerError::InvalidStep(
                "sequences do not cover the step's tokens".to_owned(),
            ));
        }
        Ok(keys)
    }
}
