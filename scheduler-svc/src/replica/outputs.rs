//! Applying a finished step's outputs to the replica's running sequences: the sampled token is
//! appended and handed to [`completion`], which says what text it completes and whether the
//! sequence ends; the text goes to the outbox for its client; finished sequences leave with their
//! blocks released.

use rivulet_ipc::layout::MAX_TOP_LOGPROBS;
use rivulet_ipc::StepBuffer;

use super::outbox::Outbox;
use crate::block_manager::BlockManager;
use crate::completion::{self, Outcome};
use crate::request::{FinishReason, SamplingParams, SequenceEvent, StopCause, TokenLogprob, Usage};
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
    for (slot, scheduled) in plan.seqs.iter().enumerate() {
        let seq = &mut running[scheduled.running_index];
        seq.num_computed += scheduled.num_tokens;
        blocks.register_full_blocks(&seq.tokens, seq.num_computed, &seq.blocks, &mut seq.block_hashes);
        if !scheduled.sample {
            continue;
        }
        let token = sampled[slot] as u32;
        seq.tokens.push(token);
        generated += 1;
        let logprobs = read_logprobs(buffer, slot, token, &seq.request.sampling);
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
