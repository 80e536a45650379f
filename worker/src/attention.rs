//! Paged attention for one step.
//!
//! [`AttentionPlan`] is built once per step from the step's per-sequence layout and shared by all
//! layers: sequences with one query token (decode, or a one-token prefill chunk) are attended
//! together as one padded batch; longer chunks (prefill) one sequence at a time, each over its own
//! blocks with a causal mask offset by its position.

use tch::{Device, Kind, Tensor};

/// The key slots and mask for a group of sequences.
struct KeyGather {
    /// `[batch, keys]` slot indices into the flat KV cache (padding points at slot 0).
    slots: Tensor,
    /// `[batch, 1, queries, keys]`, true where the query may attend to the key.
    mask: Tensor,
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
            let tables = block_tables.index_select(0, &seq_index);
            let context = Tensor::from_slice(&context).to_device(device);
            let key_pos = Tensor::arange(max_context, (Kind::Int64, device));
            let slots = slot_indices(&tables, &key_pos, block_size);
            let mask = key_pos
                .unsqueeze(0)
                .lt_tensor(&context.unsqueeze(1))
                .view([-1, 1, 1, max_context]);
            DecodeGroup {
                token_rows: Tensor::from_slice(&token_rows).to_device(device),
                keys: KeyGather { slots, mask },
            }
        });
        let prefills = seqs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.num_tokens > 1)
            .map(|(i, s)| {
                let table = block_tables.get(i as i64).unsqueeze(0);
                let key_pos = Tensor::arange(s.context_len, (Kind::Int64, device));
                let slots = slot_indices(&table, &key_pos, block_size);
                let query_pos =
                    Tensor::arange_start(s.context_len - s.num_tokens, s.context_len, (Kind::Int64, device));
                let mask =
                    key_pos
                        .unsqueeze(0)
                        .le_tensor(&query_pos.unsqueeze(1))
                        .view([1, 1, s.num_tokens, s.context_len]);
                PrefillChunk {
                    first_token: s.first_token,
                    num_tokens: s.num_tokens,
                    keys: KeyGather { slots, mask },
                }
            })
            .collect();
        Self {
            decode,
            prefills,
            scale: 1.0 / (head_dim as f64).sqrt(),
        }
    }

    /// `queries`: `[tokens, n_heads, head_dim]`; `key_cache`/`value_cache`: flat
    /// `[slots, n_kv_heads, head_dim]` with this step's tokens already written.
    /// Returns `[tokens, n_heads * head_dim]`.
    pub fn attend(&self, queries: &Tensor, key_cache: &Tensor, value_cache: &Tensor) -> Tensor {
        let (tokens, heads, dim) = queries.size3().expect("queries are [tokens, heads, head_dim]");
        let mut output = Tensor::zeros([tokens, heads, dim], (queries.kind(), queries.device()));
        if let Some(group) = &self.decode {
            let q = queries.index_select(0, &group.token_rows).unsqueeze(2); // [b, heads, 1, dim]
            let attended = self.attend_group(&q, key_cache, value_cache, &group.keys); // [b, heads, 1, dim]
            let _ = output.index_copy_(0, &group.token_rows, &attended.squeeze_dim(2));
        }
        for chunk in &self.prefills {
            let q = queries
                .narrow(0, chunk.first_token, chunk.num_tokens)
                .transpose(0, 1)
                .unsqueeze(0);
            let attended = self.attend_group(&q, key_cache, value_cache, &chunk.keys); // [1, heads, n, dim]
            output
                .narrow(0, chunk.first_token, chunk.num_tokens)
                .copy_(&attended.squeeze_dim(0).transpose(0, 1));
        }
        output.view([tokens, heads * dim])
    }

    fn attend_group(&self, q: &Tensor, key_cache: &Tensor, value_cache: &Tensor, keys: &KeyGather) -> Tensor {
        let (batch, num_keys) = keys.slots.size2().expect("slots are [batch, keys]");
        let flat = keys.slots.view([-1]);
        let gather = |cache: &Tensor| {
            let (_, kv_heads, dim) = cache.size3().expect("flat cache is [slots, heads, dim]");
            cache
                .index_select(0, &flat)
                .view([batch, num_keys, kv_heads, dim])
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
            true,
        )
    }
}

/// Slot of each key position for each row of `tables`: `table[pos / bs] * bs + pos % bs`.
fn slot_indices(tables: &Tensor, key_pos: &Tensor, block_size: i64) -> Tensor {
    let blocks = tables.index_select(1, &key_pos.floor_divide_scalar(block_size));
    blocks * block_size + key_pos.remainder(block_size).unsqueeze(0)
}
