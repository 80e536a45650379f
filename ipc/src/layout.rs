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
    /// Token ids of all sequences' penalty histories together (`history_tokens`).
    pub max_history_tokens: u32,
}
const _: () = assert!(std::mem::size_of::<StepCapacity>() == 16);

/// Alternatives per token that `top_logprobs` may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A byte range of one array inside the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArraySpan {
    pub offset: usize,
    pub len: usize,
}

/// Byte offsets of every array for one capacity.
///
/// Inputs (scheduler writes):
/// - per token (`[max_tokens]`): `input_ids`, `positions`, `slot_mapping`;
/// - per sequence: `query_start` (`[max_seqs + 1]`, prefix sums of each sequence's tokens in this
///   step), `context_lens` (tokens in the KV cache after this step), `sample` (1 when the step ends
///   at the sequence's last token, so its next one is sampled), `block_tables`
///   (`[max_seqs, max_blocks_per_seq]`, row-major, unused entries 0);
/// - sampling, per sequence: `temperature`, `top_k` (≤ 0: off), `top_p`, `min_p`,
///   `repetition_penalty`, `frequency_penalty`, `presence_penalty`, `seed`, `draw_index` (which
///   draw of the sequence this is: its generated-token count, so a seeded sequence draws the same
///   numbers whatever batch it is in), `num_top_logprobs`;
/// - penalty histories: `history_start` (`[max_seqs + 1]`, prefix sums into `history_tokens`),
///   `history_prompt_len` (the first so many of a sequence's history are prompt tokens, the rest
///   generated ones), `history_tokens` (`[max_history_tokens]`).
///
/// Outputs (worker writes), valid where `sample`: `sampled_tokens`, `sampled_logprobs` (the
/// chosen token's log-probability under the model), `top_logprob_ids` / `top_logprob_values`
/// (`[max_seqs, MAX_TOP_LOGPROBS]`, the first `num_top_logprobs` of each row).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepLayout {
    pub capacity: StepCapacity,
    pub input_ids: ArraySpan,
    pub positions: ArraySpan,
    pub slot_mapping: ArraySpan,
    pub query_start: ArraySpan,
    pub context_lens: ArraySpan,
    pub sample: ArraySpan,
    pub block_tables: ArraySpan,
    pub temperature: ArraySpan,
    pub top_k: ArraySpan,
    pub top_p: ArraySpan,
    pub min_p: ArraySpan,
    pub repetition_penalty: ArraySpan,
    pub frequency_penalty: ArraySpan,
    pub presence_penalty: ArraySpan,
    pub seed: ArraySpan,
    pub draw_index: ArraySpan,
    pub num_top_logprobs: ArraySpan,
    pub history_start: ArraySpan,
    pub history_prompt_len: ArraySpan,
    pub history_tokens: ArraySpan,
    pub sampled_tokens: ArraySpan,
    pub sampled_logprobs: ArraySpan,
    pub top_logprob_ids: ArraySpan,
    pub top_logprob_values: ArraySpan,
    pub total_bytes: usize,
}

impl StepLayout {
    pub fn new(capacity: StepCapacity) -> Self {
        let tokens = capacity.max_tokens as usize;
        let seqs = capacity.max_seqs as usize;
        let blocks = capacity.max_blocks_per_seq as usize;
        let history = capacity.max_history_tokens as usize;
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
        let block_tables = next(seqs * blocks, 8);
        let temperature = next(seqs, 4);
        let top_k = next(seqs, 8);
        let top_p = next(seqs, 4);
        let min_p = next(seqs, 4);
        let repetition_penalty = next(seqs, 4);
        let frequency_penalty = next(seqs, 4);
        let presence_penalty = next(seqs, 4);
        let seed = next(seqs, 8);
        let draw_index = next(seqs, 8);
        let num_top_logprobs = next(seqs, 8);
        let history_start = next(seqs + 1, 8);
        let history_prompt_len = next(seqs, 8);
        let history_tokens = next(history, 8);
        let sampled_tokens = next(seqs, 8);
        let sampled_logprobs = next(seqs, 4);
        let top_logprob_ids = next(seqs * MAX_TOP_LOGPROBS, 8);
        let top_logprob_values = next(seqs * MAX_TOP_LOGPROBS, 4);
        let total_bytes = cursor.next_multiple_of(ARRAY_ALIGN);
        Self {
            capacity,
            input_ids,
            positions,
            slot_mapping,
            query_start,
            context_lens,
            sample,
            block_tables,
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            frequency_penalty,
            presence_penalty,
            seed,
            draw_index,
            num_top_logprobs,
            history_start,
            history_prompt_len,
            history_tokens,
            sampled_tokens,
            sampled_logprobs,
            top_logprob_ids,
            top_logprob_values,
            total_bytes,
        }
    }

    /// Every array with its element size, in buffer order.
    pub fn arrays(&self) -> [(ArraySpan, usize); 24] {
        [
            (self.input_ids, 8),
            (self.positions, 8),
            (self.slot_mapping, 8),
            (self.query_start, 8),
            (self.context_lens, 8),
            (self.sample, 8),
            (self.block_tables, 8),
            (self.temperature, 4),
            (self.top_k, 8),
            (self.top_p, 4),
            (self.min_p, 4),
            (self.repetition_penalty, 4),
            (self.frequency_penalty, 4),
            (self.presence_penalty, 4),
            (self.seed, 8),
            (self.draw_index, 8),
            (self.num_top_logprobs, 8),
            (self.history_start, 8),
            (self.history_prompt_len, 8),
            (self.history_tokens, 8),
            (self.sampled_tokens, 8),
            (self.sampled_logprobs, 4),
            (self.top_logprob_ids, 8),
            (self.top_logprob_values, 4),
        ]
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
            max_history_tokens: 50,
        });
        let mut end = std::mem::size_of::<StepHeader>();
        for (span, size) in layout.arrays() {
            assert_eq!(span.offset % ARRAY_ALIGN, 0);
            assert!(span.offset >= end, "arrays overlap");
            end = span.offset + span.len * size;
        }
        assert!(end <= layout.total_bytes);
        assert_eq!(layout.block_tables.len, 7 * 13);
        assert_eq!(layout.query_start.len, 8);
        assert_eq!(layout.top_logprob_ids.len, 7 * MAX_TOP_LOGPROBS);
    }
}
