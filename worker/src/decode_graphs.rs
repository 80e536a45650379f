//! Decode steps on CUDA through captured graphs (`worker.cuda_graphs`).
//!
//! A decode step of the libtorch engine is ~600 small kernels; launched one by one from the host
//! it costs 10+ ms whatever the batch, while the GPU is busy for 1-2 ms of it at small batches
//! (measured on an H100: README, "On a GPU"). So, as vLLM does, each
//! decode step whose shape fits is padded to a bucket (batch: [`batch_bucket`]; key blocks: the
//! next power of two from [`MIN_BLOCKS`]) and run by replaying a graph captured for that bucket:
//! one host-to-device copy of the step's inputs, one launch. A bucket's graph is captured on its
//! first step, which runs eagerly (that also warms up cuBLAS and cuDNN for the shape). Prefill
//! steps, and decode steps larger than the buckets, run eagerly.
//!
//! Padding rows read and write one KV block the scheduler never hands out (the last one,
//! reserved by [`DecodeGraphs::new`]'s caller); their logits are dropped. Every graph writes its
//! logits into one buffer with the rows of the largest bucket captured (when a larger one comes,
//! the buffer grows and the graphs are captured again as their buckets recur), so the graphs'
//! memory does not grow with the number of buckets; their intermediates share one pool.

use std::collections::HashMap;

use tch::{Device, Kind, Tensor};

use crate::attention::AttentionPlan;
use crate::cpu_model::HostStepInputs;
use crate::cuda_graph::{Graph, GraphError};
use crate::kv_cache::KvCache;
use crate::model::{ForwardInputs, LlamaModel};

/// Largest decode batch run through a graph.
pub const MAX_BATCH: i64 = 1024;
/// Batches up to this many rows are padded to the next power of two (there the step is the host's
/// launches, and padding costs the GPU little); larger ones to the next multiple of it, since
/// there the GPU's work grows with the rows and doubling them would cost up to twice the step.
pub const POWER_OF_TWO_BATCHES_UP_TO: i64 = 64;
/// Fewest key blocks a bucket gathers (256 tokens at block size 16).
pub const MIN_BLOCKS: i64 = 16;
/// Largest `batch × blocks` run through a graph. Where decode attention gathers its blocks (no
/// paged kernel), the copies take `2 · batch · blocks · block bytes` of the graphs' shared memory
/// pool per layer in flight (400 MB for SmolLM2's 6 KB bf16 blocks).
pub const MAX_BATCH_BLOCKS: i64 = 1 << 15;

/// The batch a graph runs for a step of `rows` sequences (see [`POWER_OF_TWO_BATCHES_UP_TO`]), or
/// `None` past [`MAX_BATCH`].
pub fn batch_bucket(rows: usize) -> Option<i64> {
    let rows = i64::try_from(rows).ok().filter(|&r| r > 0)?;
    let bucket = if rows <= POWER_OF_TWO_BATCHES_UP_TO {
        (rows as u64).next_power_of_two() as i64
    } else {
        (rows + POWER_OF_TWO_BATCHES_UP_TO - 1) / POWER_OF_TWO_BATCHES_UP_TO * POWER_OF_TWO_BATCHES_UP_TO
    };
    (bucket <= MAX_BATCH).then_some(bucket)
}

/// Whether `step` is decode only, each sequence one token at row `i`, sampled in order: the
/// steps a graph can run.
pub fn is_plain_decode(step: &HostStepInputs<'_>) -> bool {
    !step.seqs.is_empty()
        && step.seqs.len() == step.logit_rows.len()
        && step
            .seqs
            .iter()
            .zip(step.logit_rows)
            .enumerate()
            .all(|(i, (s, &row))| s.num_tokens == 1 && s.first_token == i as i64 && row == i as i64)
}

struct Captured {
    graph: Graph,
    /// The graph's inputs, one i64 buffer: ids, positions, slots, context lengths (`[batch]`
    /// each), then the block tables (`[batch, blocks]`).
    inputs: Tensor,
}

pub struct DecodeGraphs {
    device_index: usize,
    block_size: i64,
    scratch_block: i64,
    captured: HashMap<(i64, i64), Captured>,
    /// `[largest bucket captured, vocab]` f32: where every graph writes its logits (the first rows
    /// of it).
    logits: Option<Tensor>,
    /// Set after a capture fails: every step then runs eagerly.
    disabled: bool,
}

impl DecodeGraphs {
    /// `scratch_block`: a KV block no sequence uses, for the padding rows.
    pub fn new(device: Device, block_size: usize, scratch_block: usize) -> Option<Self> {
        let Device::Cuda(device_index) = device else {
            return None;
        };
        crate::cuda_graph::supported().then(|| Self {
            device_index,
            block_size: block_size as i64,
            scratch_block: scratch_block as i64,
            captured: HashMap::new(),
            logits: None,
            disabled: false,
        })
    }

    /// The logits (`[seqs, vocab]` f32) of a step that [`is_plain_decode`], through a graph, or
    /// `None` when the step does not fit one (the caller runs it eagerly). The logits are valid
    /// until the next call.
    pub fn forward(&mut self, model: &LlamaModel, cache: &KvCache, step: &HostStepInputs<'_>) -> Option<Tensor> {
        if self.disabled {
            return None;
        }
        let (batch, blocks) = self.bucket(step)?;
        let inputs = self.padded_inputs(step, batch, blocks);
        let rows = step.seqs.len() as i64;
        if let (Some(captured), Some(shared_logits)) = (self.captured.get(&(batch, blocks)), &self.logits) {
            let mut buffer = captured.inputs.shallow_clone();
            buffer.copy_(&Tensor::from_slice(&inputs));
            return match captured.graph.replay() {
                Ok(()) => Some(shared_logits.narrow(0, 0, rows)),
                Err(error) => {
                    self.disable(&error);
                    None
                }
            };
        }
        // First step of this bucket: eagerly (the result of this step), then record the same.
        let device = Device::Cuda(self.device_index);
        let buffer = Tensor::from_slice(&inputs).to_device(device);
        let block_size = self.block_size;
        let logits = decode_forward(model, cache, &buffer, batch, blocks, block_size);
        let shared_logits = match &self.logits {
            Some(shared) if shared.size()[0] >= batch => shared.shallow_clone(),
            _ => {
                // The graphs captured so far write into the old buffer: they go, to be captured
                // again as their buckets recur.
                self.captured.clear();
                let grown = Tensor::empty([batch, logits.size()[1]], (Kind::Float, device));
                self.logits = Some(grown.shallow_clone());
                grown
            }
        };
        let mut graph_logits = shared_logits.narrow(0, 0, batch);
        let pool = self.captured.values().next().map(|c| &c.graph);
        match Graph::capture(self.device_index, pool, || {
            graph_logits.copy_(&decode_forward(model, cache, &buffer, batch, blocks, block_size));
        }) {
            Ok((graph, ())) => {
                tracing::debug!(batch, blocks, "captured a CUDA graph for decode steps");
                self.captured
                    .insert((batch, blocks), Captured { graph, inputs: buffer });
            }
            Err(error) => self.disable(&error),
        }
        Some(logits.narrow(0, 0, rows))
    }

    fn disable(&mut self, error: &GraphError) {
        tracing::warn!(%error, "CUDA graphs disabled: decode steps run eagerly");
        self.disabled = true;
        self.captured.clear();
        self.logits = None;
    }

    /// The (batch, blocks) bucket of a plain decode step, if one holds it.
    fn bucket(&self, step: &HostStepInputs<'_>) -> Option<(i64, i64)> {
        let batch = batch_bucket(step.seqs.len())?;
        let needed = step
            .seqs
            .iter()
            .map(|s| (s.context_len + self.block_size - 1) / self.block_size)
            .max()?;
        let blocks = (needed.max(MIN_BLOCKS) as u64).next_power_of_two() as i64;
        (batch * blocks <= MAX_BATCH_BLOCKS).then_some((batch, blocks))
    }

    /// The graph's input buffer for `step`: its rows, then padding rows that attend to one token of
    /// the scratch block and write their K/V there; each table row is padded with the scratch block.
    fn padded_inputs(&self, step: &HostStepInputs<'_>, batch: i64, blocks: i64) -> Vec<i64> {
        let rows = step.seqs.len();
        let (batch, blocks) = (batch as usize, blocks as usize);
        let mut inputs = vec![0i64; 4 * batch + batch * blocks];
        let (ids, rest) = inputs.split_at_mut(batch);
        let (positions, rest) = rest.split_at_mut(batch);
        let (slots, rest) = rest.split_at_mut(batch);
        let (context, tables) = rest.split_at_mut(batch);
        ids[..rows].copy_from_slice(&step.input_ids[..rows]);
        positions[..rows].copy_from_slice(&step.positions[..rows]);
        slots[..rows].copy_from_slice(&step.slot_mapping[..rows]);
        slots[rows..].fill(self.scratch_block * self.block_size);
        for (c, s) in context.iter_mut().zip(step.seqs) {
            *c = s.context_len;
        }
        context[rows..].fill(1);
        // Only the blocks a sequence's context covers (the ones the step's validation checked).
        tables.fill(self.scratch_block);
        for ((row, table), seq) in tables.chunks_mut(blocks).enumerate().zip(step.seqs) {
            let used = ((seq.context_len + self.block_size - 1) / self.block_size) as usize;
            let used = used.min(blocks).min(step.max_blocks);
            let start = row * step.max_blocks;
            table[..used].copy_from_slice(&step.block_tables[start..start + used]);
        }
        inputs
    }
}

/// The decode forward pass reading everything from `inputs` (see [`Captured::inputs`]).
fn decode_forward(
    model: &LlamaModel,
    cache: &KvCache,
    inputs: &Tensor,
    batch: i64,
    blocks: i64,
    block_size: i64,
) -> Tensor {
    let part = |index: i64| inputs.narrow(0, index * batch, batch);
    let (ids, positions, slots, context) = (part(0), part(1), part(2), part(3));
    let tables = inputs.narrow(0, 4 * batch, batch * blocks).view([batch, blocks]);
    let plan = AttentionPlan::decode_on_device(&tables, &context, block_size, model.config.head_dim, model.kind);
    let rows = Tensor::arange(batch, (Kind::Int64, inputs.device()));
    let forward_inputs = ForwardInputs {
        input_ids: &ids,
        positions: &positions,
        slot_mapping: &slots,
        attention: &plan,
        logit_rows: &rows,
    };
    model.forward(&forward_inputs, cache)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_batches_take_powers_of_two_and_large_ones_multiples_of_the_threshold() {
        let buckets: Vec<Option<i64>> = [1, 2, 3, 5, 63, 64, 65, 128, 129, 1000, 1024]
            .iter()
            .map(|&rows| batch_bucket(rows))
            .collect();
        let expected = [1, 2, 4, 8, 64, 64, 128, 128, 192, 1024, 1024].map(Some);
        assert_eq!(buckets, expected);
        assert_eq!(batch_bucket(0), None);
        assert_eq!(batch_bucket(MAX_BATCH as usize + 1), None);
    }
}
