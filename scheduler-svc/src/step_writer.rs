//! Writes a planned step into the shared-memory step buffer (the worker's inputs), array by array,
//! straight into the mapping: nothing is allocated per iteration. The only writer of the step's
//! inputs; the arrays and the sampling row are described in `rivulet_ipc::layout`.

use rivulet_ipc::layout::{MAX_BANNED_TOKENS, MAX_LOGIT_BIAS, MAX_REQUEST_LOGIT_BIAS};
use rivulet_ipc::{SeqSampling, StepBuffer};

use crate::guide::StateMask;
use crate::scheduler::{ScheduledSeq, StepPlan};
use crate::sequence::Sequence;

/// The writer of one step buffer, for the buffer's life (a fresh, zeroed segment per worker).
#[derive(Default)]
pub struct StepWriter {
    /// For each block-table row, how many leading entries may be non-zero. A row is as long as the
    /// model's context (512 entries for SmolLM2's 8192 tokens in blocks of 16), so clearing every
    /// row's tail each step wrote 4 MB at 1024 sequences; only what an earlier step wrote past a
    /// row's new length is cleared now.
    block_table_extents: Vec<usize>,
}

impl StepWriter {
    /// `eos_token_ids`: the model's, which a sequence may not be given before its `min_new_tokens`
    /// (unless it ignores EOS), as its stop token ids may not.
    pub fn write(
        &mut self,
        buffer: &mut StepBuffer,
        step: u64,
        plan: &StepPlan,
        running: &[Sequence],
        block_size: u32,
        eos_token_ids: &[u32],
    ) {
        let layout = *buffer.layout();
        let block_size = block_size as usize;
        let scheduled = || plan.seqs.iter().map(|s| (s, &running[s.running_index]));

        {
            let header = buffer.header_mut();
            header.step = step;
            header.num_tokens = plan.num_tokens as u32;
            header.num_seqs = plan.seqs.len() as u32;
        }
        let input_ids = buffer.array_mut(layout.input_ids);
        let mut t = 0;
        for (s, seq) in scheduled() {
            for &token in &seq.tokens[seq.num_computed..seq.num_computed + s.num_tokens] {
                input_ids[t] = token as i64;
                t += 1;
            }
        }
        let positions = buffer.array_mut(layout.positions);
        let mut t = 0;
        for (s, seq) in scheduled() {
            for position in seq.num_computed..seq.num_computed + s.num_tokens {
                positions[t] = position as i64;
                t += 1;
            }
        }
        let slots = buffer.array_mut(layout.slot_mapping);
        let mut t = 0;
        for (s, seq) in scheduled() {
            for position in seq.num_computed..seq.num_computed + s.num_tokens {
                slots[t] = (seq.blocks[position / block_size] as usize * block_size + position % block_size) as i64;
                t += 1;
            }
        }
        let query_start = buffer.array_mut(layout.query_start);
        let mut start = 0;
        for (i, (s, _)) in scheduled().enumerate() {
            query_start[i] = start;
            start += s.num_tokens as i64;
        }
        query_start[plan.seqs.len()] = start;
        let context_lens = buffer.array_mut(layout.context_lens);
        for (i, (s, seq)) in scheduled().enumerate() {
            context_lens[i] = (seq.num_computed + s.num_tokens) as i64;
        }
        let sample = buffer.array_mut(layout.sample);
        for (i, (s, _)) in scheduled().enumerate() {
            sample[i] = i64::from(s.sample);
        }
        let sampling = buffer.array_mut(layout.sampling);
        for (i, (_, seq)) in scheduled().enumerate() {
            sampling[i] = sampling_row(seq);
        }
        write_logit_biases(buffer, plan, running, eos_token_ids);
        write_token_masks(buffer, plan, running, eos_token_ids);
        write_penalty_histories(buffer, plan, running);
        write_prompt_targets(buffer, plan, running);
        self.write_block_tables(buffer, plan, running);
    }

    /// Each sequence's KV blocks, the rest of its row 0.
    fn write_block_tables(&mut self, buffer: &mut StepBuffer, plan: &StepPlan, running: &[Sequence]) {
        let layout = *buffer.layout();
        let max_blocks = layout.capacity.max_blocks_per_seq as usize;
        if self.block_table_extents.len() < plan.seqs.len() {
            self.block_table_extents.resize(plan.seqs.len(), 0);
        }
        let tables = buffer.array_mut(layout.block_tables);
        for ((row, extent), s) in tables
            .chunks_exact_mut(max_blocks)
            .zip(&mut self.block_table_extents)
            .zip(&plan.seqs)
        {
            let blocks = &running[s.running_index].blocks;
            let used = blocks.len().min(max_blocks);
            for (entry, &block) in row.iter_mut().zip(blocks) {
                *entry = i64::from(block);
            }
            if *extent > used {
                row[used..*extent].fill(0);
            }
            *extent = used;
        }
    }
}

/// A sequence's row of sampling parameters: its request's, and its progress for `draw_index`.
fn sampling_row(seq: &Sequence) -> SeqSampling {
    let params = &seq.request.sampling;
    SeqSampling {
        temperature: params.temperature,
        top_p: params.top_p,
        min_p: params.min_p,
        repetition_penalty: params.repetition_penalty,
        frequency_penalty: params.frequency_penalty,
        presence_penalty: params.presence_penalty,
        top_k: i64::from(params.top_k),
        seed: params.seed as i64,
        draw_index: seq.num_generated() as i64,
        num_top_logprobs: if params.wants_logprobs() {
            i64::from(params.top_logprobs)
        } else {
            0
        },
        allowed_only: i64::from(params.allowed_only),
    }
}

/// For sequences that sample this step, what their logits are changed by: their request's
/// `logit_bias` (every allowed token's, with `allowed_token_ids`), then, short of their
/// `min_new_tokens`, the tokens that would stop them at −∞ (vLLM's `min_tokens`: the model's EOS
/// unless the request ignores it, and its stop token ids), so that the worker never chooses one —
/// unless they are every token the request allows, which then stay allowed. The completion check
/// ignores stopping tokens there too, should a row hold more than [`MAX_BANNED_TOKENS`]
/// (validation keeps requests' lists shorter).
fn write_logit_biases(buffer: &mut StepBuffer, plan: &StepPlan, running: &[Sequence], eos_token_ids: &[u32]) {
    let layout = *buffer.layout();
    let entries = |s: &ScheduledSeq| {
        let seq = &running[s.running_index];
        let (stopping, sampling) = (&seq.request.stopping, &seq.request.sampling);
        let sample = s.sample;
        // (Validation keeps requests within their share of the row.)
        let requested = sampling
            .logit_bias
            .iter()
            .copied()
            .take(MAX_REQUEST_LOGIT_BIAS)
            .filter(move |_| sample);
        let short = sample && seq.num_generated() < stopping.min_new_tokens as usize;
        let eos = eos_token_ids.iter().filter(move |_| !stopping.ignore_eos);
        let bans = stopping.stop_token_ids.iter().chain(eos).take(MAX_BANNED_TOKENS);
        let bans_everything = short
            && (sampling.allowed_only
                && sampling
                    .logit_bias
                    .iter()
                    .all(|(token, _)| bans.clone().any(|banned| banned == token))
                || seq
                    .guide
                    .as_ref()
                    .is_some_and(|guide| bans_leave_nothing(&guide.mask(), bans.clone().copied())));
        let bans = bans
            .filter(move |_| short && !bans_everything)
            .map(|&token| (token, f32::NEG_INFINITY));
        requested.chain(bans)
    };
    let counts = buffer.array_mut(layout.logit_bias_count);
    for (count, s) in counts.iter_mut().zip(&plan.seqs) {
        *count = entries(s).count() as i64;
    }
    let tokens = buffer.array_mut(layout.logit_bias_tokens);
    for (row, s) in tokens.chunks_exact_mut(MAX_LOGIT_BIAS).zip(&plan.seqs) {
        for (slot, (token, _)) in row.iter_mut().zip(entries(s)) {
            *slot = i64::from(token);
        }
    }
    let values = buffer.array_mut(layout.logit_bias_values);
    for (row, s) in values.chunks_exact_mut(MAX_LOGIT_BIAS).zip(&plan.seqs) {
        for (slot, (_, value)) in row.iter_mut().zip(entries(s)) {
            *slot = value;
        }
    }
}

/// Whether banning `bans` would leave a guided row nothing to choose: its guide allows no
/// token but an end, or only tokens among the bans (stop token ids may be ordinary tokens).
fn bans_leave_nothing(mask: &StateMask, bans: impl Iterator<Item = u32>) -> bool {
    if !mask.continues {
        return true;
    }
    let allowed = |token: u32| {
        mask.tokens
            .get(token as usize / 64)
            .is_some_and(|word| word >> (token % 64) & 1 == 1)
    };
    let mut banned_allowed: Vec<u32> = bans.filter(|&token| allowed(token)).collect();
    banned_allowed.sort_unstable();
    banned_allowed.dedup();
    let allowed_count: u32 = mask.tokens.iter().map(|word| word.count_ones()).sum();
    banned_allowed.len() as u32 == allowed_count
}

/// For sampled sequences with a structured output, the tokens their guide allows where their
/// output is, and the tokens that end it (the model's EOS and the request's stop token ids)
/// where the output is whole — or where nothing else is allowed, so that a row never allows
/// nothing (a guide that no token can continue ends there). A row that would still allow
/// nothing (no end token at all) goes unmasked rather than failing the step.
fn write_token_masks(buffer: &mut StepBuffer, plan: &StepPlan, running: &[Sequence], eos_token_ids: &[u32]) {
    let layout = *buffer.layout();
    let words = layout.capacity.token_mask_words as usize;
    let guided = |s: &ScheduledSeq| {
        running[s.running_index]
            .guide
            .as_ref()
            .filter(|_| s.sample && words > 0)
    };
    let masks = buffer.array_mut(layout.token_masks);
    for (row, s) in masks.chunks_exact_mut(words.max(1)).zip(&plan.seqs) {
        let Some(mask) = guided(s).map(|guide| guide.mask()) else {
            continue;
        };
        for (slot, word) in row.iter_mut().zip(mask.tokens.iter().chain(std::iter::repeat(&0))) {
            *slot = *word as i64;
        }
        if mask.complete || !mask.continues {
            let stopping = &running[s.running_index].request.stopping;
            for &token in eos_token_ids.iter().chain(&stopping.stop_token_ids) {
                if let Some(word) = row.get_mut(token as usize / 64) {
                    *word |= 1 << (token % 64);
                }
            }
        }
    }
    for (i, s) in plan.seqs.iter().enumerate() {
        let allows_some = guided(s).is_some() && {
            let row = &buffer.array(layout.token_masks)[i * words..(i + 1) * words];
            row.iter().any(|&word| word != 0)
        };
        buffer.array_mut(layout.token_mask_used)[i] = i64::from(allows_some);
    }
}

/// For sequences whose prompt is scored ([`Sequence::scores_prompt`]), how many alternatives
/// each token's score lists and, for each of their tokens, the prompt token after it (−1 past the
/// prompt's second-to-last token: the last one's follower is sampled); −1 for everyone else.
fn write_prompt_targets(buffer: &mut StepBuffer, plan: &StepPlan, running: &[Sequence]) {
    let layout = *buffer.layout();
    let scheduled = || plan.seqs.iter().map(|s| (s, &running[s.running_index]));
    let tops = buffer.array_mut(layout.prompt_logprob_top);
    for (top, (_, seq)) in tops.iter_mut().zip(scheduled()) {
        *top = match seq.request.sampling.prompt_logprobs {
            Some(alternatives) if seq.scores_prompt() => i64::from(alternatives),
            _ => -1,
        };
    }
    let targets = buffer.array_mut(layout.prompt_logprob_targets);
    let mut t = 0;
    for (s, seq) in scheduled() {
        let scored = seq.scores_prompt();
        for position in seq.num_computed..seq.num_computed + s.num_tokens {
            targets[t] = match seq.request.prompt_ids.get(position + 1) {
                Some(&next) if scored => i64::from(next),
                _ => -1,
            };
            t += 1;
        }
    }
}

/// For sequences with penalties that sample this step, their token history (prompt, then
/// generated tokens).
fn write_penalty_histories(buffer: &mut StepBuffer, plan: &StepPlan, running: &[Sequence]) {
    let layout = *buffer.layout();
    let scheduled = || plan.seqs.iter().map(|s| (s, &running[s.running_index]));
    let needs_history = |s: &ScheduledSeq, seq: &Sequence| s.sample && seq.request.sampling.has_penalties();
    let capacity = layout.history_tokens.len;
    let mut start = 0usize;
    let mut starts = Vec::with_capacity(plan.seqs.len() + 1);
    for (s, seq) in scheduled() {
        starts.push(start as i64);
        if needs_history(s, seq) && start + seq.tokens.len() <= capacity {
            let history = &mut buffer.array_mut(layout.history_tokens)[start..start + seq.tokens.len()];
            for (slot, &token) in history.iter_mut().zip(&seq.tokens) {
                *slot = i64::from(token);
            }
            start += seq.tokens.len();
        }
    }
    starts.push(start as i64);
    buffer.array_mut(layout.history_start)[..starts.len()].copy_from_slice(&starts);
    let prompt_lens = buffer.array_mut(layout.history_prompt_len);
    for (i, (s, seq)) in scheduled().enumerate() {
        let has_range = starts[i + 1] > starts[i];
        prompt_lens[i] = if needs_history(s, seq) && has_range {
            seq.prompt_len() as i64
        } else {
            0
        };
    }
}

#[cfg(test)]
mod tests {
    use rivulet_ipc::StepCapacity;

    use super::*;
    use crate::queue_ticket::QueueTicket;
    use crate::request::{GenerationRequest, Priority, SamplingParams, StoppingParams};

    /// A resident sequence of `prompt_len` tokens, all computed, holding `blocks`.
    fn resident(id: u64, prompt_len: usize, blocks: Vec<u32>) -> Sequence {
        let (events, _) = tokio::sync::mpsc::unbounded_channel();
        let request = GenerationRequest {
            id: String::new(),
            prompt_ids: vec![5; prompt_len],
            sampling: SamplingParams::greedy(),
            stopping: StoppingParams::default(),
            priority: Priority::Normal,
        };
        let mut seq = Sequence::new(id, request, events, QueueTicket::untracked());
        seq.num_computed = prompt_len - 1;
        seq.blocks = blocks;
        seq
    }

    fn one_token_each(count: usize) -> StepPlan {
        StepPlan {
            seqs: (0..count)
                .map(|running_index| ScheduledSeq {
                    running_index,
                    num_tokens: 1,
                    sample: true,
                })
                .collect(),
            num_tokens: count,
            ..StepPlan::default()
        }
    }

    /// A fresh step buffer of room for `max_seqs` one-token sequences of `max_blocks_per_seq`.
    fn buffer(max_seqs: u32, max_blocks_per_seq: u32) -> StepBuffer {
        let capacity = StepCapacity {
            max_tokens: max_seqs,
            max_seqs,
            max_blocks_per_seq,
            max_history_tokens: 16,
            token_mask_words: 2,
        };
        StepBuffer::create(capacity).expect("create")
    }

    #[test]
    fn a_row_holds_its_sequences_blocks_then_zeros_whatever_an_earlier_step_left_in_it() {
        let mut buffer = buffer(2, 5);
        let layout = *buffer.layout();
        let mut writer = StepWriter::default();
        let long = vec![resident(1, 8, vec![3, 4, 5, 6]), resident(2, 4, vec![7, 8])];
        writer.write(&mut buffer, 1, &one_token_each(2), &long, 2, &[]);
        assert_eq!(buffer.array(layout.block_tables), &[3, 4, 5, 6, 0, 7, 8, 0, 0, 0]);
        // The first row's new sequence is shorter, the second's longer.
        let short = vec![resident(3, 2, vec![9]), resident(4, 6, vec![10, 11, 12])];
        writer.write(&mut buffer, 2, &one_token_each(2), &short, 2, &[]);
        assert_eq!(buffer.array(layout.block_tables), &[9, 0, 0, 0, 0, 10, 11, 12, 0, 0]);
        // A step of one sequence leaves the second row alone; it is cleared when next used.
        writer.write(&mut buffer, 3, &one_token_each(1), &short[1..], 2, &[]);
        assert_eq!(&buffer.array(layout.block_tables)[..5], &[10, 11, 12, 0, 0]);
        writer.write(&mut buffer, 4, &one_token_each(2), &short, 2, &[]);
        assert_eq!(buffer.array(layout.block_tables), &[9, 0, 0, 0, 0, 10, 11, 12, 0, 0]);
    }

    /// The row of entries of each sequence, as the worker reads it.
    fn bias_rows(buffer: &StepBuffer, seqs: usize) -> Vec<Vec<(i64, f32)>> {
        let layout = *buffer.layout();
        let (counts, tokens, values) = (
            buffer.array(layout.logit_bias_count),
            buffer.array(layout.logit_bias_tokens),
            buffer.array(layout.logit_bias_values),
        );
        (0..seqs)
            .map(|seq| {
                let row = seq * MAX_LOGIT_BIAS..seq * MAX_LOGIT_BIAS + counts[seq] as usize;
                tokens[row.clone()]
                    .iter()
                    .copied()
                    .zip(values[row].iter().copied())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn a_row_holds_the_requests_biases_then_bans_its_stopping_tokens_short_of_min_new_tokens() {
        let mut buffer = buffer(4, 2);
        let eos = [2];
        let minus = f32::NEG_INFINITY;
        let with = |logit_bias: Vec<(u32, f32)>, allowed_only: bool, min_new_tokens: u32| {
            let mut seq = resident(1, 3, vec![1]);
            seq.request.sampling.logit_bias = logit_bias;
            seq.request.sampling.allowed_only = allowed_only;
            seq.request.stopping.stop_token_ids = vec![7];
            seq.request.stopping.min_new_tokens = min_new_tokens;
            seq
        };
        let running = vec![
            // Biases, then its stop token and EOS banned while short of 2 tokens.
            with(vec![(4, 1.5), (9, -3.0)], false, 2),
            // Past its minimum: biases only.
            with(vec![(4, 1.5)], false, 0),
            // Allowed only 7 and 4 (7 a stop token): banning 7 and EOS still leaves 4.
            with(vec![(4, 0.0), (7, 0.0)], true, 2),
            // Allowed only its stop token and EOS: banning both would leave nothing, so neither
            // is banned (the completion check still ignores them until the minimum).
            with(vec![(2, 0.0), (7, 0.0)], true, 2),
        ];
        let mut writer = StepWriter::default();
        writer.write(&mut buffer, 1, &one_token_each(4), &running, 16, &eos);
        assert_eq!(
            bias_rows(&buffer, 4),
            vec![
                vec![(4, 1.5), (9, -3.0), (7, minus), (2, minus)],
                vec![(4, 1.5)],
                vec![(4, 0.0), (7, 0.0), (7, minus), (2, minus)],
                vec![(2, 0.0), (7, 0.0)],
            ]
        );
        let layout = *buffer.layout();
        let allowed_only: Vec<i64> = buffer.array(layout.sampling)[..4]
            .iter()
            .map(|row| row.allowed_only)
            .collect();
        assert_eq!(allowed_only, [0, 0, 1, 1]);
        // A sequence that does not sample this step (a prompt chunk) gets no entries.
        let mut plan = one_token_each(1);
        plan.seqs[0].sample = false;
        writer.write(&mut buffer, 2, &plan, &running, 16, &eos);
        assert_eq!(bias_rows(&buffer, 1), vec![Vec::new()]);
    }

    #[test]
    fn a_guided_row_allows_what_its_guide_allows_and_its_ends_once_whole() {
        use std::sync::Arc;

        use crate::guide::{GuideCursor, GuideRequest, GuideSpec, GuideVocabulary, Guides};

        // Token i is the byte i for printable ASCII; the rest (EOS 2 among them) are special.
        let bytes: Vec<[u8; 1]> = (0..128u8).map(|b| [b]).collect();
        let piece = |id: u32| -> &[u8] {
            if (32..127).contains(&id) {
                &bytes[id as usize]
            } else {
                &[]
            }
        };
        let vocabulary = GuideVocabulary::new(128, piece, 128);
        let request = GuideRequest {
            spec: GuideSpec::Regex("ab".into()),
            whitespace: None,
        };
        let guide = Guides::new(vocabulary).compile(&request).expect("compiles");
        let mut guided = resident(1, 3, vec![1]);
        guided.guide = Some(GuideCursor::new(Arc::clone(&guide)));
        guided.request.stopping.stop_token_ids = vec![7];
        guided.request.stopping.min_new_tokens = 5;
        let running = vec![guided, resident(2, 3, vec![2])];
        let mut buffer = buffer(2, 2);
        let layout = *buffer.layout();
        let mut writer = StepWriter::default();
        let bits = |words: &[i64]| -> Vec<usize> {
            (0..128)
                .filter(|&t| (words[t / 64] as u64) >> (t % 64) & 1 == 1)
                .collect()
        };
        writer.write(&mut buffer, 1, &one_token_each(2), &running, 16, &[2]);
        assert_eq!(&buffer.array(layout.token_mask_used)[..2], &[1, 0]);
        assert_eq!(bits(&buffer.array(layout.token_masks)[..2]), [usize::from(b'a')]);
        // Short of min_new_tokens while more may follow: its stopping tokens are banned too.
        assert_eq!(
            bias_rows(&buffer, 1),
            vec![vec![(7, f32::NEG_INFINITY), (2, f32::NEG_INFINITY)]]
        );

        let mut running = running;
        running[0].guide.as_mut().expect("guided").advance(b"ab");
        writer.write(&mut buffer, 2, &one_token_each(2), &running, 16, &[2]);
        // Whole, with nothing more allowed: only its ends, and no ban that would forbid them.
        assert_eq!(bits(&buffer.array(layout.token_masks)[..2]), [2, 7]);
        assert_eq!(bias_rows(&buffer, 1), vec![Vec::new()]);

        // At the start, with `a` a stop token: banning it would leave nothing, so nothing is.
        running[0].guide = Some(GuideCursor::new(guide));
        running[0].request.stopping.stop_token_ids = vec![u32::from(b'a')];
        writer.write(&mut buffer, 3, &one_token_each(2), &running, 16, &[2]);
        assert_eq!(bias_rows(&buffer, 1), vec![Vec::new()]);
    }

    #[test]
    fn a_scored_prompts_tokens_name_their_followers_until_its_first_token() {
        let mut buffer = buffer(5, 2);
        let layout = *buffer.layout();
        let mut scored = resident(1, 5, vec![1]);
        scored.request.prompt_ids = vec![10, 11, 12, 13, 14];
        scored.tokens = scored.request.prompt_ids.clone();
        scored.request.sampling.prompt_logprobs = Some(2);
        scored.num_computed = 1;
        let plain = resident(2, 3, vec![2]);
        // The scored prompt's last 4 tokens (a chunk through its end), the other's last token.
        let plan = StepPlan {
            seqs: vec![
                ScheduledSeq {
                    running_index: 0,
                    num_tokens: 4,
                    sample: true,
                },
                ScheduledSeq {
                    running_index: 1,
                    num_tokens: 1,
                    sample: true,
                },
            ],
            num_tokens: 5,
            ..StepPlan::default()
        };
        let mut running = vec![scored, plain];
        let mut writer = StepWriter::default();
        writer.write(&mut buffer, 1, &plan, &running, 16, &[]);
        assert_eq!(&buffer.array(layout.prompt_logprob_top)[..2], &[2, -1]);
        // Tokens 11, 12, 13 are followed by 12, 13, 14; 14's follower is sampled.
        assert_eq!(&buffer.array(layout.prompt_logprob_targets)[..5], &[12, 13, 14, -1, -1]);
        // Once it has its first token, its prompt is no longer scored (even when recomputed).
        running[0].tokens.push(99);
        running[0].num_computed = 0;
        writer.write(&mut buffer, 2, &plan, &running, 16, &[]);
        assert_eq!(&buffer.array(layout.prompt_logprob_top)[..2], &[-1, -1]);
        assert_eq!(&buffer.array(layout.prompt_logprob_targets)[..5], &[-1; 5]);
    }
}
