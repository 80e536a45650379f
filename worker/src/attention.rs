//! Paged attention for one step.
//!
//! [`AttentionPlan`] is built once per step from the step's per-sequence layout and shared by all
//! layers: sequences with one query token (decode, or a one-token prefill chunk) are attended
//! together as one padded batch; longer chunks (prefill) one sequence at a time, each over its own
//! blocks with a causal mask offset by its position.

use tch::{Device, Kind, Tensor};

/// The KV blocks and mask for a group of sequences. Keys are gathered a whole block at a time
/// (a few large copies rather than one per slot); positions past a sequence's context are masked.
struct KeyGather {
    /// `[batch * blocks]` block ids, row by row (rows shorter than the longest are padded by their
    /// tables); flattened once per step, then used by every layer.
    blocks: Tensor,
    batch: i64,
    blocks_per_row: i64,
    /// `[batch, 1, queries, blocks * block_size]`, true where the query may attend to the key.
    mask: Tensor,
}

impl KeyGather {
    /// The first `blocks_per_row` entries of each row of `tables` (`[batch, max_blocks]`).
    fn new(tables: &Tensor, blocks_per_row: i64, mask: Tensor) -> Self {
        Self {
            blocks: tables.narrow(1, 0, blocks_per_row).reshape([-1]),
            batch: tables.size()[0],
            blocks_per_row,
            mask,
        }
    }
}

struct DecodeGroup {
    /// Rows of the flat token batch that belong to the group, `[batch]`.
    token_rows: Tensor,
    keys: KeyGather,
}

struct PrefillChunk {
    first_token: i64,
    num_tokens: i64,
    keys: KeyGather,
}

pub struct AttentionPlan {
    decode: Option<DecodeGroup>,
    prefills: Vec<PrefillChunk>,
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
    /// `block_tables`: `[num_seqs, max_blocks]` i64 on the compute device.
    pub fn new(seqs: &[SeqSlice], block_tables: &Tensor, block_size: i64, head_dim: usize, device: Device) -> Self {
        let decode_rows: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].num_tokens == 1).collect();
        let decode = (!decode_rows.is_empty()).then(|| {
            let seq_index =
                Tensor::from_slice(&decode_rows.iter().map(|&i| i as i64).collect::<Vec<_>>()).to_device(device);
            let token_rows: Vec<i64> = decode_rows.iter().map(|&i| seqs[i].first_token).collect();
            let context: Vec<i64> = decode_rows.iter().map(|&i| seqs[i].context_len).collect();
            let max_context = context.iter().copied().max().unwrap_or(1);
            let num_blocks = blocks_for(max_context, block_size, block_tables);
            let context = Tensor::from_slice(&context).to_device(device);
            let key_pos = Tensor::arange(num_blocks * block_size, (Kind::Int64, device));
            let mask = key_pos
                .unsqueeze(0)
                .lt_tensor(&context.unsqueeze(1))
                .view([-1, 1, 1, num_blocks * block_size]);
            DecodeGroup {
                token_rows: Tensor::from_slice(&token_rows).to_device(device),
                keys: KeyGather::new(&block_tables.index_select(0, &seq_index), num_blocks, mask),
            }
        });
        let prefills = seqs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.num_tokens > 1)
            .map(|(i, s)| {
                let num_blocks = blocks_for(s.context_len, block_size, block_tables);
                let key_pos = Tensor::arange(num_blocks * block_size, (Kind::Int64, device));
                let query_pos =
                    Tensor::arange_start(s.context_len - s.num_tokens, s.context_len, (Kind::Int64, device));
                // Causal; keys past the context sit after every query, so this masks them too.
                let mask = key_pos.unsqueeze(0).le_tensor(&query_pos.unsqueeze(1)).view([
                    1,
                    1,
                    s.num_tokens,
                    num_blocks * block_size,
                ]);
                PrefillChunk {
                    first_token: s.first_token,
                    num_tokens: s.num_tokens,
                    keys: KeyGather::new(&block_tables.narrow(0, i as i64, 1), num_blocks, mask),
                }
            })
            .collect();
        Self {
            decode,
            prefills,
            scale: 1.0 / (head_dim as f64).sqrt(),
            block_size,
        }
    }

    /// `queries`: `[tokens, n_heads, head_dim]`; `key_cache`/`value_cache`: flat
    /// `[slots, n_kv_heads, head_dim]` with this step's tokens already written.
    /// Returns `[tokens, n_heads * head_dim]`.
    pub fn attend(&self, queries: &Tensor, key_cache: &Tensor, value_cache: &Tensor) -> Tensor {
        let (tokens, heads, dim) = queries.size3().expect("queries are [tokens, heads, head_dim]");
        let mut output = Tensor::zeros([tokens, heads, dim], (queries.kind(), queries.device()));
        if let Some(group) = &self.decode {
            // One query per sequence: the query heads that share a KV head become that KV head's
            // "query positions" ([b, kv_heads, heads / kv_heads, dim]), so attention reads each
            // gathered K/V once instead of a copy repeated per query head (GQA without expansion).
            let kv_heads = key_cache.size()[1];
            let q = queries
                .index_select(0, &group.token_rows)
                .view([-1, kv_heads, heads / kv_heads, dim]);
            let attended = self.attend_group(&q, key_cache, value_cache, &group.keys, false);
            let _ = output.index_copy_(0, &group.token_rows, &attended.reshape([-1, heads, dim]));
        }
        for chunk in &self.prefills {
            let q = queries
                .narrow(0, chunk.first_token, chunk.num_tokens)
                .transpose(0, 1)
                .unsqueeze(0);
            let attended = self.attend_group(&q, key_cache, value_cache, &chunk.keys, true); // [1, heads, n, dim]
            output
                .narrow(0, chunk.first_token, chunk.num_tokens)
                .copy_(&attended.squeeze_dim(0).transpose(0, 1));
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
            Some(&keys.mask),
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
