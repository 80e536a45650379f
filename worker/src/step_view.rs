//! The step buffer's arrays wrapped as CPU tensors over the shared mapping — no copy.
//!
//! This module holds the worker's only `unsafe`. Invariant: a [`StepView`] borrows the
//! [`StepBuffer`] it wraps (so it cannot outlive the mapping), and it is only used between
//! receiving `Step { n }` and sending `StepDone { n }`, the worker's turn, when the scheduler does
//! not touch the buffer. Every length comes from a header checked against the buffer's capacity.

use std::marker::PhantomData;

use rivulet_ipc::layout::{ArraySpan, StepElement, MAX_TOP_LOGPROBS};
use rivulet_ipc::{StepBuffer, StepHeader};
use tch::kind::Element;
use tch::{Device, TchError, Tensor};

/// The arrays the step runs on as tensors; the sampling parameters are read as rows instead
/// (`step::sampling_batch`), since only the sampled sequences' are needed.
pub struct StepView<'a> {
    /// `[num_tokens]` i64.
    pub input_ids: Tensor,
    pub positions: Tensor,
    pub slot_mapping: Tensor,
    /// `[num_seqs, max_blocks_per_seq]` i64.
    pub block_tables: Tensor,
    /// `[num_history_tokens]` i64: every sequence's penalty history, back to back.
    pub history_tokens: Tensor,
    /// Outputs, `[num_seqs]`: i64 tokens and f32 logprobs; `[num_seqs, MAX_TOP_LOGPROBS]` alternatives.
    pub sampled_tokens: Tensor,
    pub sampled_logprobs: Tensor,
    pub top_logprob_ids: Tensor,
    pub top_logprob_values: Tensor,
    /// Outputs, `[num_tokens]`: f32 prompt logprobs and i64 ranks; `[num_tokens, MAX_TOP_LOGPROBS]`
    /// alternatives.
    pub prompt_logprobs: Tensor,
    pub prompt_logprob_ranks: Tensor,
    pub prompt_top_logprob_ids: Tensor,
    pub prompt_top_logprob_values: Tensor,
    _buffer: PhantomData<&'a StepBuffer>,
}

impl<'a> StepView<'a> {
    /// `history_len`: tokens in `history_tokens` this step (validated by the caller).
    pub fn wrap(buffer: &'a StepBuffer, header: &StepHeader, history_len: usize) -> Result<Self, TchError> {
        let layout = buffer.layout();
        let tokens = header.num_tokens as i64;
        let seqs = header.num_seqs as i64;
        let blocks = layout.capacity.max_blocks_per_seq as i64;
        let top = MAX_TOP_LOGPROBS as i64;
        let base = buffer.base_ptr();
        Ok(Self {
            input_ids: wrap(base, layout.input_ids, &[tokens])?,
            positions: wrap(base, layout.positions, &[tokens])?,
            slot_mapping: wrap(base, layout.slot_mapping, &[tokens])?,
            block_tables: wrap(base, layout.block_tables, &[seqs, blocks])?,
            history_tokens: wrap(base, layout.history_tokens, &[history_len as i64])?,
            sampled_tokens: wrap(base, layout.sampled_tokens, &[seqs])?,
            sampled_logprobs: wrap(base, layout.sampled_logprobs, &[seqs])?,
            top_logprob_ids: wrap(base, layout.top_logprob_ids, &[seqs, top])?,
            top_logprob_values: wrap(base, layout.top_logprob_values, &[seqs, top])?,
            prompt_logprobs: wrap(base, layout.prompt_logprobs, &[tokens])?,
            prompt_logprob_ranks: wrap(base, layout.prompt_logprob_ranks, &[tokens])?,
            prompt_top_logprob_ids: wrap(base, layout.prompt_top_logprob_ids, &[tokens, top])?,
            prompt_top_logprob_values: wrap(base, layout.prompt_top_logprob_values, &[tokens, top])?,
            _buffer: PhantomData,
        })
    }
}

/// The array `span` describes as a contiguous tensor of `shape`, its kind from the element type.
fn wrap<T: StepElement + Element>(base: *mut u8, span: ArraySpan<T>, shape: &[i64]) -> Result<Tensor, TchError> {
    let elements: i64 = shape.iter().product();
    if elements < 0 || elements as usize > span.len {
        return Err(TchError::Shape(format!(
            "{shape:?} exceeds the array's {} elements",
            span.len
        )));
    }
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    // SAFETY: `span` lies inside the mapping (the layout was built for this buffer's capacity and
    // `elements <= span.len` was checked above); the mapping outlives the tensor by the borrow on
    // `StepView`; `T` is a `StepElement` (valid for every bit pattern, aligned by the layout) and
    // its tensor kind is `T::KIND`; access is exclusive during the worker's turn (module docs).
    unsafe { Tensor::f_from_blob(base.add(span.offset), shape, &strides, T::KIND, Device::Cpu) }
}

#[cfg(test)]
mod tests {
    use rivulet_ipc::StepCapacity;

    use super::*;

    /// The scheduler writes through its mapping; the worker, through a second mapping of the same
    /// segment, sees the values as tensors whose memory *is* the mapping, and its writes come back.
    #[test]
    fn tensors_alias_the_shared_mapping_without_a_copy() {
        let capacity = StepCapacity {
            max_tokens: 16,
            max_seqs: 4,
            max_blocks_per_seq: 8,
            max_history_tokens: 32,
            token_mask_words: 2,
        };
        let mut scheduler_side = StepBuffer::create(capacity).expect("create");
        let layout = *scheduler_side.layout();
        scheduler_side.header_mut().step = 1;
        scheduler_side.header_mut().num_tokens = 3;
        scheduler_side.header_mut().num_seqs = 2;
        scheduler_side.array_mut(layout.input_ids)[..3].copy_from_slice(&[5, 6, 7]);

        let worker_side = StepBuffer::open(scheduler_side.os_id(), capacity).expect("open");
        let header = worker_side.header_for_step(1).expect("header");
        let mut view = StepView::wrap(&worker_side, &header, 0).expect("wrap");
        // Same memory: the tensor's data pointer is the worker mapping's array address.
        let expected_ptr = worker_side.base_ptr() as usize + layout.input_ids.offset;
        assert_eq!(view.input_ids.data_ptr() as usize, expected_ptr);
        assert_eq!(Vec::<i64>::try_from(&view.input_ids).expect("read"), vec![5, 6, 7]);

        // A later scheduler write is visible through the existing tensor: nothing was copied.
        scheduler_side.array_mut(layout.input_ids)[1] = 60;
        assert_eq!(view.input_ids.int64_value(&[1]), 60);

        // The worker's output writes land in the scheduler's mapping.
        view.sampled_tokens.copy_(&Tensor::from_slice(&[42i64, 43]));
        assert_eq!(&scheduler_side.array(layout.sampled_tokens)[..2], &[42, 43]);
    }
}
