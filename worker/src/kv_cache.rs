//! The paged KV cache: per layer, K and V tensors of `[num_blocks, block_size, n_kv_heads,
//! head_dim]`. A token's KV lives at slot `block * block_size + offset`; the scheduler's slot
//! mapping says where each new token goes and its block tables say where each sequence's past is.

use rivulet_kernels::kv_values::{kv_cache_bytes, KV_VALUE_BYTES};
use tch::{Device, Kind, Tensor};

use crate::config::ModelConfig;
use crate::error::WorkerError;
use crate::page_buffer::PageBuffer;

pub struct LayerKv {
    pub keys: Tensor,
    pub values: Tensor,
}

impl LayerKv {
    /// Flat `[num_slots, n_kv_heads, head_dim]` views sharing the cache's storage.
    pub fn flat(&self) -> (Tensor, Tensor) {
        let (blocks, block_size, heads, dim) = self.keys.size4().expect("KV cache is 4-D");
        let shape = [blocks * block_size, heads, dim];
        (self.keys.view(shape), self.values.view(shape))
    }
}

/// Blocks of `block_size` tokens that `memory_bytes` holds; an error when that cannot hold one
/// sequence of `max_model_len` tokens.
pub fn blocks_in_budget(
    config: &ModelConfig,
    block_size: usize,
    memory_bytes: usize,
    max_model_len: usize,
    value_bytes: usize,
) -> Result<usize, WorkerError> {
    if block_size == 0 {
        return Err(WorkerError::KvCache("block_size must be positive".to_owned()));
    }
    let per_block = bytes_per_block(config, block_size, value_bytes);
    let num_blocks = memory_bytes / per_block;
    let needed = max_model_len.div_ceil(block_size);
    if num_blocks < needed {
        return Err(WorkerError::KvBudgetTooSmall(format!(
            "kv_cache_memory of {memory_bytes} bytes gives {num_blocks} blocks of {block_size} tokens \
             ({per_block} bytes each), fewer than the {needed} one {max_model_len}-token sequence needs"
        )));
    }
    Ok(num_blocks)
}

pub struct KvCache {
    pub layers: Vec<LayerKv>,
    pub num_blocks: usize,
    pub block_size: usize,
}

/// Bytes one block takes across all layers (K and V), at `value_bytes` a key or value.
pub fn bytes_per_block(config: &ModelConfig, block_size: usize, value_bytes: usize) -> usize {
    2 * config.num_layers * block_size * config.kv_dim() * value_bytes
}

impl KvCache {
    /// Allocates as many blocks as `memory_bytes` holds; fails when that cannot hold one sequence
    /// of `max_model_len` tokens.
    pub fn allocate(
        config: &ModelConfig,
        block_size: usize,
        memory_bytes: usize,
        max_model_len: usize,
        device: Device,
        kind: Kind,
    ) -> Result<Self, WorkerError> {
        let num_blocks = blocks_in_budget(
            config,
            block_size,
            memory_bytes,
            max_model_len,
            kind.elt_size_in_bytes(),
        )?;
        let shape = [
            num_blocks as i64,
            block_size as i64,
            config.num_kv_heads as i64,
            config.head_dim as i64,
        ];
        let layers = (0..config.num_layers)
            .map(|_| -> Result<LayerKv, WorkerError> {
                Ok(LayerKv {
                    keys: Tensor::f_zeros(shape, (kind, device))?,
                    values: Tensor::f_zeros(shape, (kind, device))?,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            layers,
            num_blocks,
            block_size,
        })
    }

    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Takes the last block out of the ones offered to the scheduler (for the worker's own use,
    /// e.g. [`crate::decode_graphs`]' padding rows) and returns its id; `None` when that would
    /// leave fewer than one `max_model_len`-token sequence needs.
    pub fn reserve_block(&mut self, max_model_len: usize) -> Option<usize> {
        (self.num_blocks > max_model_len.div_ceil(self.block_size)).then(|| {
            self.num_blocks -= 1;
            self.num_blocks
        })
    }
}

/// The KV cache of the CPU kernels ([`crate::cpu_model`]): per layer, K and V as
/// `[blocks][n_kv_heads][block_size][head_dim]` values of three bytes each
/// (`rivulet_kernels::kv_values`: an f32 rounded to 16 significant bits; a quarter fewer bytes
/// for attention to read than f32) in `rivulet_kernels::attention::AttentionShape::
/// cache_offset`'s order (each head's rows of a block consecutive), the same slot numbering as
/// [`KvCache`], each in its own page-aligned mapping ([`PageBuffer`]: every 64-value row starts
/// on a cache line).
/// Zeroed pages are only touched, so resident memory grows with the slots in use.
pub struct HostKvCache {
    pub layers: Vec<HostLayerKv>,
    pub num_blocks: usize,
    pub block_size: usize,
}

pub struct HostLayerKv {
    pub keys: PageBuffer,
    pub values: PageBuffer,
}

impl HostKvCache {
    pub fn allocate(
        config: &ModelConfig,
        block_size: usize,
        memory_bytes: usize,
        max_model_len: usize,
    ) -> Result<Self, WorkerError> {
        let num_blocks = blocks_in_budget(config, block_size, memory_bytes, max_model_len, KV_VALUE_BYTES)?;
        let bytes = kv_cache_bytes(num_blocks * block_size * config.kv_dim());
        let layers = (0..config.num_layers)
            .map(|_| -> Result<HostLayerKv, WorkerError> {
                Ok(HostLayerKv {
                    keys: PageBuffer::zeroed(bytes)?,
                    values: PageBuffer::zeroed(bytes)?,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            layers,
            num_blocks,
            block_size,
        })
    }
}
