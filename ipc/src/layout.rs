//! The shared-memory step buffer's layout: a `#[repr(C)]` header followed by fixed-capacity
//! arrays at offsets both processes compute from the same [`StepCapacity`].
//!
//! Every array element is `i64` or `f32`, the dtypes the worker wraps as tensors without a copy
//! (index ops in libtorch take `i64`). Arrays start on 64-byte boundaries.

use serde::{Deserialize, Serialize};

pub const STEP_MAGIC: u32 = 0x5256_4C54; // "RVLT"
pub const STEP_LAYOUT_VERSION: u32 = 1;
const ARRAY_ALIGN: usize = 64;

/// Written by the scheduler before each `Step`; read by the worker.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepHeader {
    pub magic: u32,
    pub version: u32,
    /// The iteration this buffer describes; must match the `Step { step }` command.
    pub step: u64,
    /// Tokens in the flat batch (`input_ids`, `positions`, `slot_mapping` hold this many).
    pub num_tokens: u32,
    /// Sequences in the step (`query_start` holds `num_seqs + 1`, the per-sequence arrays `num_seqs`).
    pub num_seqs: u32,
}
const _: () = assert!(std::mem::size_of::<StepHeader>() == 24);
const _: () = assert!(std::mem::align_of::<StepHeader>() == 8);

/// The most a step may hold; fixed when the buffer is created.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepCapacity {
    pub max_tokens: u32,
    pub max_seqs: u32,
    pub max_blocks_per_seq: u32,
    pub _reserved: u32,
}
const _: () = assert!(std::mem::size_of::<StepCapacity>() == 16);

/// A byte range of one array inside the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArraySpan {
    pub offset: usize,
    pub len: usize,
}

/// Byte offsets of every array for one capacity.
///
/// Inputs (scheduler writes): `input_ids`, `positions`, `slot_mapping` (`[max_tokens]`),
/// `query_start` (`[max_seqs + 1]`, prefix sums of each sequence's tokens in this step),
/// `context_lens` (`[max_seqs]`, tokens in the KV cache after this step), `sample` (`[max_seqs]`,
/// 1 when the sequence's last token in this step is to be sampled), `temperature` (`[max_seqs]`),
/// `block_tables` (`[max_seqs, max_blocks_per_seq]`, row-major, unused entries 0).
/// Outputs (worker writes): `sampled_tokens`, `sampled_logprobs` (`[max_seqs]`, valid where `sample`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepLayout {
    pub capacity: StepCapacity,
    pub input_ids: ArraySpan,
    pub positions: ArraySpan,
    pub slot_mapping: ArraySpan,
    pub query_start: ArraySpan,
    pub context_lens: ArraySpan,
    pub sample: ArraySpan,
    pub temperature: ArraySpan,
    pub block_tables: ArraySpan,
    pub sampled_tokens: ArraySpan,
    pub sampled_logprobs: ArraySpan,
    pub total_bytes: usize,
}

impl StepLayout {
    pub fn new(capacity: StepCapacity) -> Self {
        let tokens = capacity.max_tokens as usize;
        let seqs = capacity.max_seqs as usize;
        let blocks = capacity.max_blocks_per_seq as usize;
        let mut cursor = std::mem::size_of::<StepHeader>();
        let mut next = |elems: usize, elem_size: usize| {
            let offset = cursor.next_multiple_of(ARRAY_ALIGN);
            cursor = offset + elems * elem_size;
            ArraySpan { offset, len: elems }
        };
        let input_ids = next(tokens, 8);
        let positions = next(tokens, 8);
        let slot_mapping = next(tokens, 8);
        let query_start = next(seqs + 1, 8);
        let context_lens = next(seqs, 8);
        let sample = next(seqs, 8);
        let temperature = next(seqs, 4);
        let block_tables = next(seqs * blocks, 8);
        let sampled_tokens = next(seqs, 8);
        let sampled_logprobs = next(seqs, 4);
        let total_bytes = cursor.next_multiple_of(ARRAY_ALIGN);
        Self {
            capacity,
            input_ids,
            positions,
            slot_mapping,
            query_start,
            context_lens,
            sample,
            temperature,
            block_tables,
            sampled_tokens,
            sampled_logprobs,
            total_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrays_are_aligned_disjoint_and_inside_the_buffer() {
        let layout = StepLayout::new(StepCapacity {
            max_tokens: 100,
            max_seqs: 7,
            max_blocks_per_seq: 13,
            _reserved: 0,
        });
        let spans = [
            (layout.input_ids, 8),
            (layout.positions, 8),
            (layout.slot_mapping, 8),
            (layout.query_start, 8),
            (layout.context_lens, 8),
            (layout.sample, 8),
            (layout.temperature, 4),
            (layout.block_tables, 8),
            (layout.sampled_tokens, 8),
            (layout.sampled_logprobs, 4),
        ];
        let mut end = std::mem::size_of::<StepHeader>();
        for (span, size) in spans {
            assert_eq!(span.offset % ARRAY_ALIGN, 0);
            assert!(span.offset >= end, "arrays overlap");
            end = span.offset + span.len * size;
        }
        assert!(end <= layout.total_bytes);
        assert_eq!(layout.block_tables.len, 7 * 13);
        assert_eq!(layout.query_start.len, 8);
    }
}
