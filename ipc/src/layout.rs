//! The shared-memory step buffer's layout: a `#[repr(C)]` header followed by fixed-capacity
//! arrays at offsets both processes compute from the same [`StepCapacity`].
//!
//! Each array is described once, in the table at the `step_arrays!` call below: its name, its
//! element type and its length in terms of the capacity. The table generates [`StepLayout`] (one
//! typed [`ArraySpan`] per array), [`StepLayout::new`] and [`StepLayout::arrays`], so a new array
//! is one line there. A span carries its element type, so
//! [`StepBuffer::array`](crate::StepBuffer::array) hands back a slice of the right type.
//!
//! Elements are [`StepElement`]s: `i64` and `f32`, the dtypes the worker wraps as tensors without
//! a copy (index ops in libtorch take `i64`), and [`SeqSampling`], one `#[repr(C)]` row of
//! sampling parameters per sequence. Arrays start on 64-byte boundaries.

use std::marker::PhantomData;

use serde::{Deserialize, Serialize};

pub const STEP_MAGIC: u32 = 0x5256_4C54; // "RVLT"
/// Bumped whenever the buffer's layout changes (2: sampling parameters became [`SeqSampling`] rows;
/// 3: `banned_count` and `banned_tokens`; 4: those became the rows of logit biases, and
/// [`SeqSampling::allowed_only`]; 5: prompt logprobs, `prompt_logprob_*`; 6: token masks of
/// structured outputs, `token_mask_*`).
pub const STEP_LAYOUT_VERSION: u32 = 6;
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
const _: () = assert!(size_of::<StepHeader>() == 24);
const _: () = assert!(align_of::<StepHeader>() == 8);

/// The most a step may hold; fixed when the buffer is created.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepCapacity {
    pub max_tokens: u32,
    pub max_seqs: u32,
    pub max_blocks_per_seq: u32,
    /// Token ids of all sequences' penalty histories together (`history_tokens`).
    pub max_history_tokens: u32,
    /// `i64` words of one sequence's token mask: the model's vocabulary in bits, rounded up.
    pub token_mask_words: u32,
}
const _: () = assert!(size_of::<StepCapacity>() == 20);

/// Alternatives per token that `top_logprobs` may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Tokens a request may bias (`logit_bias`) or allow (`allowed_token_ids`): OpenAI's limit on
/// `logit_bias`.
pub const MAX_REQUEST_LOGIT_BIAS: usize = 300;

/// Tokens the scheduler may forbid a sequence's next choice besides: its stop tokens while it has
/// generated fewer than `min_new_tokens`, as vLLM's `min_tokens` forbids them (a bias of −∞).
pub const MAX_BANNED_TOKENS: usize = 32;

/// Entries in a sequence's row of `logit_bias_tokens` and `logit_bias_values`.
pub const MAX_LOGIT_BIAS: usize = MAX_REQUEST_LOGIT_BIAS + MAX_BANNED_TOKENS;

/// One sequence's sampling parameters: a row of the `sampling` array, written by the scheduler
/// from the request's parameters, read by the worker for the sequences it samples.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SeqSampling {
    /// 0 (or less) is greedy.
    pub temperature: f32,
    /// Keep the most likely tokens up to this probability mass (1: off).
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one's probability (0: off).
    pub min_p: f32,
    /// Divides positive logits, multiplies negative ones, of prompt and generated tokens (1: off).
    pub repetition_penalty: f32,
    /// Subtracted once per occurrence of a generated token (0: off).
    pub frequency_penalty: f32,
    /// Subtracted once from every generated token (0: off).
    pub presence_penalty: f32,
    /// Keep the `top_k` most likely tokens (≤ 0: off).
    pub top_k: i64,
    /// The request's seed, its `u64` bits as `i64`: the worker's generator works on wrapping
    /// 64-bit integers.
    pub seed: i64,
    /// Which draw of the sequence this is: its generated-token count, so a seeded sequence draws
    /// the same numbers whatever batch it is in.
    pub draw_index: i64,
    /// Alternatives to report (`0..=MAX_TOP_LOGPROBS`); 0 unless the request asked for logprobs.
    pub num_top_logprobs: i64,
    /// 1: only the tokens of the sequence's logit-bias row may be chosen (vLLM's
    /// `allowed_token_ids`); 0: every token may.
    pub allowed_only: i64,
}
impl SeqSampling {
    /// Greedy decoding with every other stage off (neutral penalties, no masks, no
    /// alternatives). `Default` is all zeros, whose repetition penalty of 0 is not neutral.
    pub const GREEDY: Self = Self {
        temperature: 0.0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        top_k: 0,
        seed: 0,
        draw_index: 0,
        num_top_logprobs: 0,
        allowed_only: 0,
    };
}

// Six f32 then five i64: no padding anywhere, so every byte of a row is a field's.
const _: () = assert!(size_of::<SeqSampling>() == 6 * size_of::<f32>() + 5 * size_of::<i64>());
const _: () = assert!(size_of::<SeqSampling>() == 64);
const _: () = assert!(align_of::<SeqSampling>() == 8);

mod sealed {
    pub trait Sealed {}
    impl Sealed for i64 {}
    impl Sealed for f32 {}
    impl Sealed for super::SeqSampling {}
}

/// A type the step buffer's arrays hold, read from and written to the shared bytes in place.
///
/// # Safety
/// Implementors are valid for every bit pattern (whatever the other process wrote is a value),
/// have no padding (every byte written is defined) and are aligned to at most 64 bytes (an
/// array's alignment). Sealed: only `i64`, `f32` and [`SeqSampling`] (checked above) implement it.
pub unsafe trait StepElement: Copy + sealed::Sealed + 'static {}
// SAFETY: a plain integer: any 8 bytes are an i64, no padding, align 8.
unsafe impl StepElement for i64 {}
// SAFETY: any 4 bytes are an f32 (possibly NaN), no padding, align 4.
unsafe impl StepElement for f32 {}
// SAFETY: `#[repr(C)]` of f32 and i64 fields only, whose sizes sum to the struct's (checked
// above): no padding, and any bytes are a row; align 8.
unsafe impl StepElement for SeqSampling {}

/// Where one array of `T` lies inside the buffer: only a [`StepLayout`] makes these.
pub struct ArraySpan<T> {
    /// Bytes from the start of the buffer; a multiple of 64.
    pub offset: usize,
    /// Elements (not bytes).
    pub len: usize,
    elem: PhantomData<fn() -> T>,
}

impl<T: StepElement> ArraySpan<T> {
    /// The next array of `len` elements at or after `cursor`, which moves past it.
    fn place(cursor: &mut usize, len: usize) -> Self {
        const { assert!(align_of::<T>() <= ARRAY_ALIGN) };
        let offset = cursor.next_multiple_of(ARRAY_ALIGN);
        *cursor = offset + len * size_of::<T>();
        Self {
            offset,
            len,
            elem: PhantomData,
        }
    }

    /// The array's size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * size_of::<T>()
    }
}

// By hand: derives would ask `T` for the same traits, and `SeqSampling` is not `Eq`.
impl<T> Clone for ArraySpan<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for ArraySpan<T> {}
impl<T> PartialEq for ArraySpan<T> {
    fn eq(&self, other: &Self) -> bool {
        (self.offset, self.len) == (other.offset, other.len)
    }
}
impl<T> Eq for ArraySpan<T> {}
impl<T> std::fmt::Debug for ArraySpan<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArraySpan")
            .field("type", &std::any::type_name::<T>())
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

/// One array's place, its element type erased: for checks that walk every array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArrayInfo {
    pub name: &'static str,
    pub offset: usize,
    pub bytes: usize,
    pub align: usize,
}

/// Generates [`StepLayout`] from the table of arrays. The first line names the capacity's five
/// counts (`max_tokens`, `max_seqs`, `max_blocks_per_seq`, `max_history_tokens`,
/// `token_mask_words`, as `usize`) for
/// the length expressions; then one `name: Element [length]` line per array, in buffer order.
macro_rules! step_arrays {
    (
        |$tokens:ident, $seqs:ident, $blocks_per_seq:ident, $history:ident, $mask_words:ident|
        $( $(#[$meta:meta])* $name:ident : $elem:ty [ $len:expr ] ),* $(,)?
    ) => {
        /// Where every array of the buffer lies for one capacity. Inputs are written by the
        /// scheduler before `Step`; outputs by the worker before `StepDone`, valid for the
        /// sequences whose `sample` is 1.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct StepLayout {
            pub capacity: StepCapacity,
            $( $(#[$meta])* pub $name: ArraySpan<$elem>, )*
            pub total_bytes: usize,
        }

        impl StepLayout {
            /// How many arrays the buffer holds.
            pub const ARRAY_COUNT: usize = [$(stringify!($name)),*].len();

            pub fn new(capacity: StepCapacity) -> Self {
                let $tokens = capacity.max_tokens as usize;
                let $seqs = capacity.max_seqs as usize;
                let $blocks_per_seq = capacity.max_blocks_per_seq as usize;
                let $history = capacity.max_history_tokens as usize;
                let $mask_words = capacity.token_mask_words as usize;
                let mut cursor = size_of::<StepHeader>();
                $( let $name = ArraySpan::<$elem>::place(&mut cursor, $len); )*
                Self {
                    capacity,
                    $( $name, )*
                    total_bytes: cursor.next_multiple_of(ARRAY_ALIGN),
                }
            }

            /// Every array, in buffer order.
            pub fn arrays(&self) -> [ArrayInfo; Self::ARRAY_COUNT] {
                [$(
                    ArrayInfo {
                        name: stringify!($name),
                        offset: self.$name.offset,
                        bytes: self.$name.byte_len(),
                        align: align_of::<$elem>(),
                    }
                ),*]
            }
        }
    };
}

step_arrays! {
    |tokens, seqs, blocks_per_seq, history, mask_words|

    // Inputs, per token of the flat batch.
    /// Token ids: each sequence's tokens of this step, back to back.
    input_ids: i64 [tokens],
    /// Each token's position in its sequence.
    positions: i64 [tokens],
    /// The KV-cache slot (block × block size + offset) that takes each token's K and V.
    slot_mapping: i64 [tokens],

    // Inputs, per sequence.
    /// Prefix sums of each sequence's tokens in this step (`num_seqs + 1` of them).
    query_start: i64 [seqs + 1],
    /// Tokens in the sequence's KV cache after this step.
    context_lens: i64 [seqs],
    /// 1 when the step ends at the sequence's last token, so its next one is sampled.
    sample: i64 [seqs],
    /// `[max_seqs, max_blocks_per_seq]`, row-major: each sequence's KV blocks, unused entries 0.
    block_tables: i64 [seqs * blocks_per_seq],
    /// Each sequence's sampling parameters.
    sampling: SeqSampling [seqs],

    // Inputs: what a sampled sequence's logits are changed by this step before penalties and the
    // argmax or draw (vLLM's order): its request's `logit_bias` (or `allowed_token_ids`, each
    // with its bias or 0), then its EOS and stop token ids at −∞ before `min_new_tokens`.
    // Entries add up where a token repeats; logprobs stay the model's.
    /// How many of the sequence's row of entries are used (`0..=MAX_LOGIT_BIAS`).
    logit_bias_count: i64 [seqs],
    /// `[max_seqs, MAX_LOGIT_BIAS]`, row-major: the token ids.
    logit_bias_tokens: i64 [seqs * MAX_LOGIT_BIAS],
    /// Laid out as `logit_bias_tokens`: what each adds to its token's logit (finite, or −∞).
    logit_bias_values: f32 [seqs * MAX_LOGIT_BIAS],

    // Inputs: structured outputs' token masks (vLLM's guided decoding), for the sampled
    // sequences that have one: only the tokens whose bit is set may be chosen (after the logit
    // biases above, which may still ban some of them); logprobs stay the model's.
    /// 1 when the sequence's row of `token_masks` applies, else 0.
    token_mask_used: i64 [seqs],
    /// `[max_seqs, token_mask_words]`, row-major: bit `t % 64` of word `t / 64` set when token
    /// `t` may be chosen (the words' bits as `i64`).
    token_masks: i64 [seqs * mask_words],

    // Inputs: penalty histories (prompt, then generated tokens) of the sequences that need one.
    /// Prefix sums into `history_tokens` (`num_seqs + 1` of them).
    history_start: i64 [seqs + 1],
    /// The first so many of a sequence's history are prompt tokens, the rest generated ones.
    history_prompt_len: i64 [seqs],
    /// Every history's token ids, back to back.
    history_tokens: i64 [history],

    // Inputs: prompt logprobs (vLLM's `prompt_logprobs`), for the sequences that asked for them.
    /// Per sequence: alternatives to report for each of its rows below (`0..=MAX_TOP_LOGPROBS`),
    /// or −1 when it has none.
    prompt_logprob_top: i64 [seqs],
    /// Per token: the prompt token that follows it, whose log-probability given the context up to
    /// and including this token is wanted; −1 for none (every token of a sequence without prompt
    /// logprobs, and a prompt's last token, whose follower is sampled).
    prompt_logprob_targets: i64 [tokens],

    // Outputs, per token with a target above: its log-probability, its rank (1 + how many tokens
    // are likelier), and the likeliest alternatives, laid out as the per-sequence ones below.
    prompt_logprobs: f32 [tokens],
    prompt_logprob_ranks: i64 [tokens],
    prompt_top_logprob_ids: i64 [tokens * MAX_TOP_LOGPROBS],
    prompt_top_logprob_values: f32 [tokens * MAX_TOP_LOGPROBS],

    // Outputs, per sequence.
    /// The sampled token.
    sampled_tokens: i64 [seqs],
    /// The chosen token's log-probability under the model.
    sampled_logprobs: f32 [seqs],
    /// `[max_seqs, MAX_TOP_LOGPROBS]`: the most likely alternatives, the first
    /// `num_top_logprobs` of each row.
    top_logprob_ids: i64 [seqs * MAX_TOP_LOGPROBS],
    /// Their log-probabilities, laid out as `top_logprob_ids`.
    top_logprob_values: f32 [seqs * MAX_TOP_LOGPROBS],
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
            token_mask_words: 3,
        });
        let mut end = size_of::<StepHeader>();
        for array in layout.arrays() {
            assert_eq!(array.offset % ARRAY_ALIGN, 0, "{}", array.name);
            assert_eq!(array.offset % array.align, 0, "{}", array.name);
            assert!(array.offset >= end, "{} overlaps the array before it", array.name);
            end = array.offset + array.bytes;
        }
        assert!(end <= layout.total_bytes);
        assert_eq!(layout.block_tables.len, 7 * 13);
        assert_eq!(layout.query_start.len, 8);
        assert_eq!(layout.sampling.len, 7);
        assert_eq!(layout.sampling.byte_len(), 7 * 64);
        assert_eq!(layout.top_logprob_ids.len, 7 * MAX_TOP_LOGPROBS);
        assert_eq!(layout.logit_bias_tokens.len, 7 * MAX_LOGIT_BIAS);
        assert_eq!(layout.logit_bias_values.len, 7 * MAX_LOGIT_BIAS);
        assert_eq!(layout.arrays().len(), StepLayout::ARRAY_COUNT);
        assert_eq!(layout.arrays()[0].name, "input_ids");
    }
}
