//! Paged attention for one step.
//!
//! [`AttentionPlan`] is built once per step from the step's per-sequence layout and shared by all
//! layers: sequences with one query token (decode, or a one-token prefill chunk) are attended
//! together as one padded batch, and longer chunks (prefill) together as a second one, each chunk's
//! queries padded to the longest chunk's, with a causal mask offset by its position. Each group is
//! one attention call per layer whatever its number of sequences: on a GPU, where a step's time is
//! mostly the host launching kernels, that is what a step of many sequences costs.

use tch::{Device, Kind, Tensor};

use crate::paged_attention::{PagedDecodeAttention, PagedKeys};

/// The KV blocks and mask for a group of sequences. Keys are gathered a whole block at a time
/// (a few large copies rather than one per slot); positions past a sequence's context are masked.
struct KeyGather {
    /// `[batch * blocks]` block ids, row by row (rows shorter than the longest are padded by their
    /// tables); flattened once per step, then used by every layer.
    blocks: Tensor,
    batch: i64,
    blocks_per_row: i64,
    /// `[batch, 1, queries, blocks * block_size]` in the compute dtype: 0 where the query may
    /// attend to the key, -inf where not. Additive once per step rather than boolean, which the
    /// attention call would convert again in every layer.
    bias: Tensor,
}

impl KeyGather {
    /// The first `blocks_per_row` entries of each row of `tables` (`[batch, max_blocks]`);
    /// `allowed` is the boolean mask.
    fn new(tables: &Tensor, blocks_per_row: i64, allowed: &Tensor, kind: Kind) -> Self {
        let bias = Tensor::zeros(allowed.size(), (kind, allowed.device()))
            .masked_fill(&allowed.logical_not(), f64::NEG_INFINITY);
        Self {
            blocks: tables.narrow(1, 0, blocks_per_row).reshape([-1]),
            batch: tables.size()[0],
            blocks_per_row,
            bias,
        }
    }
}

struct DecodeGroup {
    /// Rows of the flat token batch that belong to the group, `[batch]`.
    token_rows: Tensor,
    /// The group is the whole batch, row `i` sequence `i`: its output is the step's, no scatter.
    is_whole_batch: bool,
    /// For [`PagedDecodeAttention`]: the group's block-table rows (`[batch, width]`) and context
    /// lengths (`[batch]`), i64 on the device.
    tables: Tensor,
    context: Tensor,
    /// The group's sequences and its longest context (a bound, for graphs), known on the host.
    sequences: i64,
    max_keys: i64,
    keys: KeyGather,
}

/// Every prefill chunk of the step: `chunks` sequences, each with its queries padded to `max_queries`.
struct PrefillGroup {
    /// `[chunks * max_queries]`: the flat token row of each padded query (padding repeats the
    /// chunk's last token, whose output is dropped).
    padded_rows: Tensor,
    /// `[real queries]`: where each real query sits in the padded layout, and its flat token row.
    kept: Tensor,
    token_rows: Tensor,
    max_queries: i64,
    keys: KeyGather,
}

pub struct AttentionPlan {
    decode: Option<DecodeGroup>,
    prefill: Option<PrefillGroup>,
    scale: f64,
    block_size: i64,
}

/// What the plan needs per sequence: where its tokens sit in the flat batch and its context.
#[derive(Debug, Clone, Copy)]
pub struct SeqSlice {
    pub first_token: i64,
    pub num_tokens: i64,
    /// Tokens in the KV cache once this step's are written (past + this step's).
    pub context_len: i64,
}

impl AttentionPlan {
    /// `block_tables`: `[num_seqs, max_blocks]` i64 on the compute device; `kind`: the compute dtype.
    pub fn new(
        seqs: &[SeqSlice],
        block_tables: &Tensor,
        block_size: i64,
        head_dim: usize,
        device: Device,
        kind: Kind,
    ) -> Self {
        let on_device = |values: &[i64]| Tensor::from_slice(values).to_device(device);
        // The block-table rows of the sequences at `indices`.
        let tables_of = |indices: &[usize]| {
            let indices: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
            block_tables.index_select(0, &on_device(&indices))
        };
        let decode_seqs: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].num_tokens == 1).collect();
        let decode = (!decode_seqs.is_empty()).then(|| {
            let token_rows: Vec<i64> = decode_seqs.iter().map(|&i| seqs[i].first_token).collect();
            let context: Vec<i64> = decode_seqs.iter().map(|&i| seqs[i].context_len).collect();
            let max_context = context.iter().copied().max().unwrap_or(1);
            let num_blocks = blocks_for(max_context, block_size, block_tables);
            let key_pos = Tensor::arange(num_blocks * block_size, (Kind::Int64, device));
            let allowed = key_pos.unsqueeze(0).lt_tensor(&on_device(&context).unsqueeze(1)).view([
                -1,
                1,
                1,
                num_blocks * block_size,
            ]);
            let is_whole_batch = decode_seqs.len() == seqs.len() && token_rows.iter().zip(0..).all(|(&r, i)| r == i);
            let tables = tables_of(&decode_seqs);
            DecodeGroup {
                token_rows: on_device(&token_rows),
                is_whole_batch,
                keys: KeyGather::new(&tables, num_blocks, &allowed, kind),
                tables,
                context: on_device(&context),
                sequences: decode_seqs.len() as i64,
                max_keys: max_context,
            }
        });
        let chunks: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].num_tokens > 1).collect();
        let prefill = (!chunks.is_empty()).then(|| {
            let max_queries = chunks.iter().map(|&i| seqs[i].num_tokens).max().unwrap_or(1);
            let max_context = chunks.iter().map(|&i| seqs[i].context_len).max().unwrap_or(1);
            let num_blocks = blocks_for(max_context, block_size, block_tables);
            let (mut padded_rows, mut kept, mut token_rows, mut query_pos) = (vec![], vec![], vec![], vec![]);
            for (c, &i) in chunks.iter().enumerate() {
                let s = seqs[i];
                for j in 0..max_queries {
                    let real = j < s.num_tokens;
                    padded_rows.push(s.first_token + j.min(s.num_tokens - 1));
                    // Causal; keys past the context sit after every real query, so this masks them
                    // too. A padding query sees the first key only (never an empty row).
                    query_pos.push(if real { s.context_len - s.num_tokens + j } else { 0 });
                    if real {
                        kept.push(c as i64 * max_queries + j);
                        token_rows.push(s.first_token + j);
                    }
                }
            }
            let key_pos = Tensor::arange(num_blocks * block_size, (Kind::Int64, device));
            let allowed = key_pos
                .view([1, 1, -1])
                .le_tensor(&on_device(&query_pos).view([-1, max_queries, 1]))
                .unsqueeze(1);
            PrefillGroup {
                padded_rows: on_device(&padded_rows),
                kept: on_device(&kept),
                token_rows: on_device(&token_rows),
                max_queries,
                keys: KeyGather::new(&tables_of(&chunks), num_blocks, &allowed, kind),
            }
        });
        Self {
            decode,
            prefill,
            scale: 1.0 / (head_dim as f64).sqrt(),
            block_size,
        }
    }

    /// A decode step of `[batch]` sequences, one token each in sequence order, described by device
    /// tensors alone (`block_tables`: `[batch, blocks]`, `context`: `[batch]`, i64): the plan's
    /// mask is computed by device ops from them, so a CUDA graph that records this plan's
    /// construction recomputes it from whatever those tensors hold at replay.
    pub fn decode_on_device(
        block_tables: &Tensor,
        context: &Tensor,
        block_size: i64,
        head_dim: usize,
        kind: Kind,
    ) -> Self {
        let (batch, blocks) = block_tables.size2().expect("block tables are [batch, blocks]");
        let device = block_tables.device();
        let allowed = Tensor::arange(blocks * block_size, (Kind::Int64, device))
            .unsqueeze(0)
            .lt_tensor(&context.unsqueeze(1))
            .view([batch, 1, 1, blocks * block_size]);
        Self {
            decode: Some(DecodeGroup {
                token_rows: Tensor::arange(batch, (Kind::Int64, device)),
                is_whole_batch: true,
                keys: KeyGather::new(block_tables, blocks, &allowed, kind),
                tables: block_tables.shallow_clone(),
                context: context.shallow_clone(),
                sequences: batch,
                max_keys: blocks * block_size,
            }),
            prefill: None,
            scale: 1.0 / (head_dim as f64).sqrt(),
            block_size,
        }
    }

    /// `queries`: `[tokens, n_heads, head_dim]`; `key_cache`/`value_cache`: flat
    /// `[slots, n_kv_heads, head_dim]` with this step's tokens already written; `paged`: the decode
    /// kernel over the blocks, where the device has one (else decode gathers, as prefill does).
    /// Returns `[tokens, n_heads * head_dim]`.
    pub fn attend(
        &self,
        queries: &Tensor,
        key_cache: &Tensor,
        value_cache: &Tensor,
        paged: Option<&PagedDecodeAttention>,
    ) -> Tensor {
        let (tokens, heads, dim) = queries.size3().expect("queries are [tokens, heads, head_dim]");
        let kv_heads = key_cache.size()[1];
        let decode_attended = self.decode.as_ref().map(|group| {
            let q = if group.is_whole_batch {
                queries.shallow_clone()
            } else {
                queries.index_select(0, &group.token_rows)
            };
            let suited = paged.filter(|kernel| kernel.suits(group.sequences, group.max_keys));
            let through_kernel = suited.and_then(|kernel| {
                let cache = PagedKeys {
                    key_cache,
                    value_cache,
                    tables: &group.tables,
                    context: &group.context,
                    block_size: self.block_size,
                };
                kernel
                    .attend(&q, &cache, self.scale)
                    // A launch that fails leaves the device in doubt, as a failing libtorch op
                    // does (tch panics then too); the worker's step loop reports it.
                    .unwrap_or_else(|error| panic!("{error}"))
            });
            let attended = through_kernel.unwrap_or_else(|| {
                // One query per sequence: the query heads that share a KV head become that KV
                // head's "query positions" ([b, kv_heads, heads / kv_heads, dim]), so attention
                // reads each gathered K/V once instead of a copy repeated per query head (GQA
                // without expansion).
                let q = q.reshape([-1, kv_heads, heads / kv_heads, dim]);
                self.attend_group(&q, key_cache, value_cache, &group.keys, false)
                    .reshape([-1, heads, dim])
            });
            (group, attended)
        });
        if let Some((group, attended)) = &decode_attended {
            if group.is_whole_batch {
                return attended.view([tokens, heads * dim]);
            }
        }
        let mut output = Tensor::zeros([tokens, heads, dim], (queries.kind(), queries.device()));
        if let Some((group, attended)) = &decode_attended {
            let _ = output.index_copy_(0, &group.token_rows, attended);
        }
        if let Some(group) = &self.prefill {
            let q = queries
                .index_select(0, &group.padded_rows)
                .view([-1, group.max_queries, heads, dim])
                .transpose(1, 2);
            let attended = self
                .attend_group(&q, key_cache, value_cache, &group.keys, true) // [chunks, heads, max_q, dim]
                .transpose(1, 2)
                .reshape([-1, heads, dim])
                .index_select(0, &group.kept);
            let _ = output.index_copy_(0, &group.token_rows, &attended);
        }
        output.view([tokens, heads * dim])
    }

    fn attend_group(
        &self,
        q: &Tensor,
        key_cache: &Tensor,
        value_cache: &Tensor,
        keys: &KeyGather,
        expand_kv_heads: bool,
    ) -> Tensor {
        let (batch, num_blocks) = (keys.batch, keys.blocks_per_row);
        let block_size = self.block_size;
        let gather = |cache: &Tensor| {
            let (_, kv_heads, dim) = cache.size3().expect("flat cache is [slots, heads, dim]");
            cache
                .view([-1, block_size * kv_heads * dim])
                .index_select(0, &keys.blocks)
                .view([batch, num_blocks * block_size, kv_heads, dim])
                .transpose(1, 2)
        };
        Tensor::scaled_dot_product_attention(
            q,
            &gather(key_cache),
            &gather(value_cache),
            Some(&keys.bias),
            0.0,
            false,
            self.scale,
            expand_kv_heads,
        )
    }
}

/// Blocks covering `context` tokens, never more than the tables hold.
fn blocks_for(context: i64, block_size: i64, block_tables: &Tensor) -> i64 {
    let held = block_tables.size().last().copied().unwrap_or(0);
    ((context + block_size - 1) / block_size).clamp(1, held.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attention for one query row, computed directly in f64 over the slots its table names.
    #[allow(clippy::too_many_arguments)]
    fn reference_row(
        q: &Tensor,
        keys: &Tensor,
        values: &Tensor,
        table: &[i64],
        position: i64,
        block_size: i64,
        heads: i64,
        kv_heads: i64,
    ) -> Tensor {
        let slots: Vec<i64> = (0..=position)
            .map(|p| table[(p / block_size) as usize] * block_size + p % block_size)
            .collect();
        let slots = Tensor::from_slice(&slots);
        let (k, v) = (keys.index_select(0, &slots), values.index_select(0, &slots)); // [n, kv_heads, dim]
        let dim = q.size()[1];
        let rows: Vec<Tensor> = (0..heads)
            .map(|h| {
                let kv = h / (heads / kv_heads);
                let scores = k.select(1, kv).matmul(&q.get(h)) / (dim as f64).sqrt(); // [n]
                scores
                    .softmax(0, Kind::Double)
                    .unsqueeze(0)
                    .matmul(&v.select(1, kv))
                    .squeeze_dim(0)
            })
            .collect();
        Tensor::stack(&rows, 0)
    }

    #[test]
    fn mixed_step_matches_direct_attention_per_query() {
        let _guard = tch::no_grad_guard();
        tch::manual_seed(7);
        let (heads, kv_heads, dim, block_size) = (6, 2, 8, 4);
        let num_blocks = 24;
        let keys = Tensor::randn([num_blocks * block_size, kv_heads, dim], (Kind::Double, Device::Cpu));
        let values = Tensor::randn([num_blocks * block_size, kv_heads, dim], (Kind::Double, Device::Cpu));
        // Decode (context 9), a 5-token chunk after 6 cached, decode (context 2), a 3-token first
        // chunk: both groups, interleaved, with chunks of unequal length and offset.
        let seqs = [
            SeqSlice {
                first_token: 0,
                num_tokens: 1,
                context_len: 9,
            },
            SeqSlice {
                first_token: 1,
                num_tokens: 5,
                context_len: 11,
            },
            SeqSlice {
                first_token: 6,
                num_tokens: 1,
                context_len: 2,
            },
            SeqSlice {
                first_token: 7,
                num_tokens: 3,
                context_len: 3,
            },
        ];
        let tables: [[i64; 3]; 4] = [[5, 2, 9], [0, 17, 3], [11, 12, 13], [20, 21, 22]];
        let flat_tables: Vec<i64> = tables.iter().flatten().copied().collect();
        let block_tables = Tensor::from_slice(&flat_tables).view([4, 3]);
        let queries = Tensor::randn([10, heads, dim], (Kind::Double, Device::Cpu));
        let plan = AttentionPlan::new(
            &seqs,
            &block_tables,
            block_size,
            dim as usize,
            Device::Cpu,
            Kind::Double,
        );
        let output = plan.attend(&queries, &keys, &values, None).view([10, heads, dim]);
        for (s, seq) in seqs.iter().enumerate() {
            for j in 0..seq.num_tokens {
                let row = seq.first_token + j;
                let position = seq.context_len - seq.num_tokens + j;
                let expected = reference_row(
                    &queries.get(row),
                    &keys,
                    &values,
                    &tables[s],
                    position,
                    block_size,
                    heads,
                    kv_heads,
                );
                let error = (output.get(row) - expected).abs().max().double_value(&[]);
                assert!(error < 1e-9, "sequence {s} query {j}: error {error}");
            }
        }
    }

    #[test]
    fn decode_only_step_is_the_whole_batch() {
        let seqs = [
            SeqSlice {
                first_token: 0,
                num_tokens: 1,
                context_len: 3,
            },
            SeqSlice {
                first_token: 1,
                num_tokens: 1,
                context_len: 5,
            },
        ];
        let tables = Tensor::from_slice(&[0i64, 1, 2, 3]).view([2, 2]);
        let plan = AttentionPlan::new(&seqs, &tables, 4, 8, Device::Cpu, Kind::Float);
        assert!(plan.decode.as_ref().is_some_and(|group| group.is_whole_batch));
        assert!(plan.prefill.is_none());
    }
}
