//! Applying a finished step's outputs to the replica's running sequences: the sampled token is
//! appended and handed to [`completion`], which says what text it completes and whether the
//! sequence ends; the text goes to the outbox for its client; finished sequences leave with their
//! blocks released.

use rivulet_ipc::layout::MAX_TOP_LOGPROBS;
use rivulet_ipc::StepBuffer;

use super::outbox::Outbox;
use crate::block_manager::BlockManager;
use crate::completion::{self, Outcome};
use crate::request::{FinishReason, PromptTokenLogprob, SamplingParams, SequenceEvent, StopCause, TokenLogprob, Usage};
use crate::scheduler::StepPlan;
use crate::sequence::Sequence;
use crate::tokenizer::ModelTokenizer;

/// What the outputs are read against.
pub struct OutputContext<'a> {
    pub tokenizer: &'a ModelTokenizer,
    pub eos_token_ids: &'a [u32],
    pub max_model_len: usize,
}

/// Applies the outputs of `plan` from `buffer`, the clients' events into `outbox`; returns how
/// many tokens were generated.
pub fn apply_outputs(
    running: &mut Vec<Sequence>,
    blocks: &mut BlockManager,
    plan: &StepPlan,
    buffer: &StepBuffer,
    context: &OutputContext<'_>,
    outbox: &mut Outbox,
) -> u64 {
    let sampled = buffer.array(buffer.layout().sampled_tokens);
    let sampled_logprobs = buffer.array(buffer.layout().sampled_logprobs);
    let limits = completion::Limits {
        eos_token_ids: context.eos_token_ids,
        max_model_len: context.max_model_len,
    };
    let mut ended: Vec<Ending> = Vec::new();
    let mut generated = 0;
    let mut first_row = 0;
    for (slot, scheduled) in plan.seqs.iter().enumerate() {
        let seq = &mut running[scheduled.running_index];
        if seq.scores_prompt() {
            read_prompt_logprobs(buffer, first_row, scheduled.num_tokens, seq);
        }
        first_row += scheduled.num_tokens;
        seq.num_computed += scheduled.num_tokens;
        blocks.register_full_blocks(&seq.tokens, seq.num_computed, &seq.blocks, &mut seq.block_hashes);
        if !scheduled.sample {
            continue;
        }
        let token = sampled[slot] as u32;
        seq.tokens.push(token);
        if let (Some(cursor), Some(pieces)) = (&mut seq.guide, context.tokenizer.byte_pieces()) {
            cursor.advance(pieces.get(token));
        }
        generated += 1;
        let logprobs = read_logprobs(buffer, slot, token, &seq.request.sampling);
        if seq.request.sampling.prompt_logprobs.is_some() && seq.num_generated() == 1 {
            let prompt_logprobs = std::mem::take(&mut seq.prompt_logprobs);
            outbox.push(seq.events.clone(), SequenceEvent::PromptLogprobs(prompt_logprobs));
        }
        match completion::after_token(seq, sampled_logprobs[slot], &limits, context.tokenizer) {
            Outcome::Continue(text) => outbox.push(
                seq.events.clone(),
                SequenceEvent::Tokens {
                    token_ids: vec![token],
                    text,
                    logprobs,
                },
            ),
            outcome => ended.push(Ending {
                running_index: scheduled.running_index,
                outcome,
                logprobs,
            }),
        }
    }
    if !ended.is_empty() {
        // One pass over the list: removing each one alone moved the rest of the list every time,
        // quadratic when a wave of requests ends in one step.
        ended.sort_unstable_by_key(|end| end.running_index);
        let mut ended = ended.into_iter().peekable();
        let resident = std::mem::take(running);
        running.reserve(resident.len());
        for (index, seq) in resident.into_iter().enumerate() {
            match ended.next_if(|end| end.running_index == index) {
                Some(end) => finish(seq, end, blocks, outbox),
                None => running.push(seq),
            }
        }
    }
    generated
}

/// A sequence this step ended.
struct Ending {
    running_index: usize,
    outcome: Outcome,
    /// Its last token's logprobs, when its request asked for them.
    logprobs: Vec<TokenLogprob>,
}

/// `seq` leaves as `end` says: its blocks are released and its client's last event goes out.
fn finish(mut seq: Sequence, end: Ending, blocks: &mut BlockManager, outbox: &mut Outbox) {
    seq.release_kv(blocks);
    let Ending { outcome, logprobs, .. } = end;
    let (reason, text) = match outcome {
        Outcome::Finished(reason, text) => (reason, text),
        Outcome::Failed(error) => {
            outbox.push(seq.events, SequenceEvent::Failed(error));
            return;
        }
        Outcome::Continue(_) => return,
    };
    let usage = Usage {
        prompt_tokens: seq.prompt_len() as u32,
        completion_tokens: seq.num_generated() as u32,
        cached_prompt_tokens: seq.cached_prompt_tokens as u32,
    };
    let stop = match reason {
        FinishReason::StopString => seq.output.matched_stop().map(|stop| StopCause::String(stop.to_owned())),
        FinishReason::StopToken => seq.tokens.last().map(|&token| StopCause::TokenId(token)),
        _ => None,
    };
    let last_token = seq.tokens.last().copied().into_iter().collect();
    let finished = SequenceEvent::Finished {
        reason,
        stop,
        token_ids: last_token,
        text,
        usage,
        logprobs,
        queue_time: seq.queue_time.unwrap_or_default(),
    };
    outbox.push(seq.events, finished);
}

/// The scores of `seq`'s prompt tokens that follow its `num_tokens` tokens of this step (whose
/// rows start at `first_row`), each kept at its prompt position: a prompt computed again (after
/// a preemption) overwrites what it scored before rather than adding to it.
fn read_prompt_logprobs(buffer: &StepBuffer, first_row: usize, num_tokens: usize, seq: &mut Sequence) {
    let layout = buffer.layout();
    let alternatives = seq.request.sampling.prompt_logprobs.unwrap_or(0) as usize;
    let (logprobs, ranks) = (
        buffer.array(layout.prompt_logprobs),
        buffer.array(layout.prompt_logprob_ranks),
    );
    let (top_ids, top_values) = (
        buffer.array(layout.prompt_top_logprob_ids),
        buffer.array(layout.prompt_top_logprob_values),
    );
    for j in 0..num_tokens {
        let (row, position) = (first_row + j, seq.num_computed + j);
        let Some(&token_id) = seq.request.prompt_ids.get(position + 1) else {
            break;
        };
        let top = row * MAX_TOP_LOGPROBS..row * MAX_TOP_LOGPROBS + alternatives;
        seq.prompt_logprobs.truncate(position);
        debug_assert_eq!(seq.prompt_logprobs.len(), position, "prompt chunks come in order");
        seq.prompt_logprobs.push(PromptTokenLogprob {
            token_id,
            logprob: logprobs[row],
            rank: ranks[row].clamp(0, i64::from(u32::MAX)) as u32,
            top: top_ids[top.clone()]
                .iter()
                .zip(&top_values[top])
                .map(|(&id, &logprob)| (id as u32, logprob))
                .collect(),
        });
    }
}

/// The logprobs of the token sampled in `slot`, when the request asked for them.
fn read_logprobs(buffer: &StepBuffer, slot: usize, token: u32, sampling: &SamplingParams) -> Vec<TokenLogprob> {
    if !sampling.wants_logprobs() {
        return Vec::new();
    }
    let layout = buffer.layout();
    let row = slot * MAX_TOP_LOGPROBS;
    let count = sampling.top_logprobs as usize;
    let ids = &buffer.array(layout.top_logprob_ids)[row..row + count];
    let values = &buffer.array(layout.top_logprob_values)[row..row + count];
    let top = ids
        .iter()
        .zip(values)
        .map(|(&id, &logprob)| (id as u32, logprob))
        .collect();
    vec![TokenLogprob {
        token_id: token,
        logprob: buffer.array(layout.sampled_logprobs)[slot],
        top,
    }]
}
