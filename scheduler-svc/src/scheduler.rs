//! Planning one iteration under the limits `max_num_seqs` (sequences in the step),
//! `max_num_batched_tokens` (tokens in the step) and the KV blocks, by the current policy.
//!
//! Sequences are *resident* (admitted: they hold KV blocks, `running`) or *waiting*. Each step the
//! policy orders the candidates; they are taken in that order while the step has room. A resident
//! sequence gets one token when decoding, or the rest of its prompt up to the remaining budget
//! (chunked prefill). A waiting sequence is admitted when the block manager accepts it, reusing
//! the longest cached prefix. When a candidate needs a block and none is available, a resident
//! sequence not in this step is preempted (lowest priority, then newest): its blocks are released
//! and it waits again, to be recomputed later (its generated tokens are kept, so its client sees
//! nothing). With nothing else to preempt, the candidate itself waits; no state can deadlock
//! because validation guarantees every request fits the cache alone.
//!
//! Policies (DESIGN.md §3):
//! - `Fair`: resident sequences, then waiting ones by priority and arrival, as one ring whose
//!   start rotates each step (round-robin when more are runnable than `max_num_seqs`).
//! - `LatencyFirst`: prefills (waiting and partly prefilled) take the budget first, youngest first
//!   within a priority; then decodes, youngest first.
//! - `ThroughputFirst`: decodes first, longest sequences first; then prefills; new sequences are
//!   admitted only while the step has room.

pub mod adaptive;

use std::collections::HashSet;

use crate::block_manager::{Admission, BlockManager, PrefixMatch};
use crate::queue::WaitingQueue;
use crate::sequence::{Sequence, SequenceId};

/// Prompt tokens one step scores at most (prompt logprobs): each is a vocabulary-wide row of
/// logits on the worker (49 152 f32s, 192 KiB, for SmolLM2), so however large the step's token
/// budget (8192 on a GPU), a step's rows take ~50 MB, not gigabytes. A scored prompt is
/// prefilled in chunks of at most this many tokens.
pub const MAX_SCORED_TOKENS_PER_STEP: usize = 256;

/// What is left of a step's tokens as it is planned: all of them, and those that may be scored.
#[derive(Debug, Clone, Copy)]
struct StepBudget {
    tokens: usize,
    scored: usize,
}

impl StepBudget {
    /// The most tokens `seq` may have in this step.
    fn for_seq(&self, seq: &Sequence) -> usize {
        if seq.scores_prompt() {
            self.tokens.min(self.scored)
        } else {
            self.tokens
        }
    }

    fn take(&mut self, seq: &Sequence, num_tokens: usize) {
        self.tokens -= num_tokens;
        if seq.scores_prompt() {
            self.scored -= num_tokens;
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerLimits {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SchedulingPolicy {
    #[default]
    Fair,
    LatencyFirst,
    ThroughputFirst,
}

/// One sequence's part of a step: `num_tokens` tokens starting at its `num_computed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledSeq {
    /// Index into the running list.
    pub running_index: usize,
    pub num_tokens: usize,
    /// The step ends at the sequence's last token, so the worker samples its next one.
    pub sample: bool,
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub seqs: Vec<ScheduledSeq>,
    pub num_tokens: usize,
    pub preempted: usize,
    /// Sequences admitted for the first time (their queue tickets were given back).
    pub first_admissions: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Candidate {
    /// A resident sequence, with its index in `running` when the order was drawn.
    Resident(SequenceId, usize),
    Waiting(SequenceId),
}

/// Where sequence `id` is in `running`, given `hint`, its index when the step's order was drawn.
/// While a step is planned, admissions append and preemptions remove, so a sequence can only have
/// moved towards the front, by as many places as were preempted before it: the search starts at
/// the hint and goes back. Scanning the whole list for every candidate made a step's planning
/// quadratic in its sequences (~1 ms of a 1024-sequence step, a tenth of the GPU's time for it).
fn locate(running: &[Sequence], id: SequenceId, hint: usize) -> Option<usize> {
    let end = (hint + 1).min(running.len());
    running[..end].iter().rposition(|seq| seq.id == id)
}

pub struct Scheduler {
    pub limits: SchedulerLimits,
    pub policy: SchedulingPolicy,
    round_robin: usize,
}

impl Scheduler {
    pub fn new(limits: SchedulerLimits, policy: SchedulingPolicy) -> Self {
        Self {
            limits,
            policy,
            round_robin: 0,
        }
    }

    /// Whether the policy would admit a new sequence beside `running` resident ones (given the
    /// blocks): THROUGHPUT_FIRST admits only while a step has room for one more sequence.
    pub fn admits_new_sequences(&self, running: usize) -> bool {
        self.policy != SchedulingPolicy::ThroughputFirst || running < self.limits.max_num_seqs
    }

    /// Plans the next step, allocating the blocks it needs. Admitted sequences move from
    /// `waiting` to the end of `running`, preempted ones from `running` to `waiting`.
    pub fn plan(
        &mut self,
        running: &mut Vec<Sequence>,
        waiting: &mut WaitingQueue,
        blocks: &mut BlockManager,
    ) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = StepBudget {
            tokens: self.limits.max_num_batched_tokens,
            scored: MAX_SCORED_TOKENS_PER_STEP,
        };
        // (id, tokens, index in `running` when it joined the step)
        let mut in_step: Vec<(SequenceId, usize, usize)> = Vec::new();
        let mut admission_blocked = false;
        for candidate in self.order(running, waiting) {
            if budget.tokens == 0 || in_step.len() >= self.limits.max_num_seqs {
                break;
            }
            match candidate {
                Candidate::Resident(id, hint) => {
                    let Some(index) = locate(running, id, hint) else {
                        continue;
                    };
                    let num_tokens = running[index].num_uncomputed().min(budget.for_seq(&running[index]));
                    if num_tokens == 0 {
                        continue;
                    }
                    let Some(index) = make_room(running, index, num_tokens, &in_step, waiting, blocks, &mut plan)
                    else {
                        continue;
                    };
                    in_step.push((id, num_tokens, index));
                    budget.take(&running[index], num_tokens);
                }
                Candidate::Waiting(id) => {
                    // No admissions in a step that had to preempt: that would only thrash.
                    if admission_blocked || plan.preempted > 0 {
                        continue;
                    }
                    match admit(id, running, waiting, blocks, budget) {
                        Some((num_tokens, first_time)) => {
                            plan.first_admissions += usize::from(first_time);
                            in_step.push((id, num_tokens, running.len() - 1));
                            budget.take(&running[running.len() - 1], num_tokens);
                        }
                        // Within a priority order, the next waiting sequence does not jump ahead.
                        None => admission_blocked = true,
                    }
                }
            }
        }
        for (id, num_tokens, hint) in in_step {
            if let Some(index) = locate(running, id, hint) {
                plan.push(index, num_tokens, &running[index]);
            }
        }
        if self.policy == SchedulingPolicy::Fair {
            let ring = running.len() + waiting.len();
            self.round_robin = if ring == 0 {
                0
            } else {
                (self.round_robin + plan.seqs.len()) % ring
            };
        }
        plan
    }

    /// The candidates of this step, in the policy's order.
    fn order(&self, running: &[Sequence], waiting: &WaitingQueue) -> Vec<Candidate> {
        let queued = waiting.iter().map(|s| Candidate::Waiting(s.id));
        match self.policy {
            SchedulingPolicy::Fair => {
                // One ring of resident then waiting sequences; each step starts where the last
                // one stopped, so waiting requests get their turn even when the resident ones
                // alone could fill every step.
                let ring: Vec<Candidate> = running
                    .iter()
                    .enumerate()
                    .map(|(index, s)| Candidate::Resident(s.id, index))
                    .chain(queued)
                    .collect();
                let start = if ring.is_empty() {
                    0
                } else {
                    self.round_robin % ring.len()
                };
                // The rotation decides where the waiting take their turn, never their order among
                // themselves: admission stays first come, first served (a later, smaller request
                // does not pass one waiting for blocks).
                let mut in_queue_order = waiting.iter().map(|s| Candidate::Waiting(s.id));
                ring[start..]
                    .iter()
                    .chain(&ring[..start])
                    .map(|&candidate| match candidate {
                        Candidate::Waiting(_) => in_queue_order.next().unwrap_or(candidate),
                        resident => resident,
                    })
                    .collect()
            }
            SchedulingPolicy::LatencyFirst => {
                // (is decode, priority descending, youngest first)
                let mut all: Vec<(bool, std::cmp::Reverse<_>, std::cmp::Reverse<SequenceId>, Candidate)> = running
                    .iter()
                    .enumerate()
                    .map(|(index, s)| {
                        (
                            s.num_uncomputed() == 1,
                            std::cmp::Reverse(s.request.priority),
                            std::cmp::Reverse(s.id),
                            Candidate::Resident(s.id, index),
                        )
                    })
                    .chain(waiting.iter().map(|s| {
                        (
                            false,
                            std::cmp::Reverse(s.request.priority),
                            std::cmp::Reverse(s.id),
                            Candidate::Waiting(s.id),
                        )
                    }))
                    .collect();
                all.sort_by_key(|(decode, priority, age, _)| (*decode, *priority, *age));
                all.into_iter().map(|(_, _, _, candidate)| candidate).collect()
            }
            SchedulingPolicy::ThroughputFirst => {
                let mut resident: Vec<(usize, &Sequence)> = running.iter().enumerate().collect();
                // Decodes before prefills; longest first; then oldest first.
                resident.sort_by_key(|(_, s)| (s.num_uncomputed() != 1, std::cmp::Reverse(s.tokens.len()), s.id));
                resident
                    .into_iter()
                    .map(|(index, s)| Candidate::Resident(s.id, index))
                    .chain(queued)
                    .collect()
            }
        }
    }
}

/// Admits waiting sequence `id` if the block manager accepts it: reuses its cached prefix,
/// allocates blocks for its first chunk and moves it to `running`. Returns its tokens in this step
/// and whether this is its first admission.
fn admit(
    id: SequenceId,
    running: &mut Vec<Sequence>,
    waiting: &mut WaitingQueue,
    blocks: &mut BlockManager,
    budget: StepBudget,
) -> Option<(usize, bool)> {
    let mut seq = waiting.remove(id)?;
    if budget.for_seq(&seq) == 0 {
        waiting.push_front(seq);
        return None;
    }
    // A prompt whose tokens are scored is computed whole: cached blocks hold no logits.
    let prefix = if seq.scores_prompt() {
        PrefixMatch::default()
    } else {
        blocks.match_prefix(&seq.tokens)
    };
    seq.blocks = prefix.blocks;
    seq.block_hashes = prefix.hashes;
    seq.num_computed = prefix.tokens;
    if seq.queue_ticket.is_some() {
        seq.cached_prompt_tokens = prefix.tokens.min(seq.prompt_len());
    }
    // Room for the rest of its history and a first block of output.
    let expected = seq.tokens.len() + (blocks.block_size() as usize).min(seq.request.stopping.max_new_tokens as usize);
    let new_blocks = blocks.blocks_for(expected).saturating_sub(seq.blocks.len() as u32);
    let num_tokens = seq.num_uncomputed().min(budget.for_seq(&seq));
    let accepted = matches!(
        blocks.admission(new_blocks, !running.is_empty()),
        Admission::Accepted { .. }
    );
    if !accepted || !grow(&mut seq, num_tokens, blocks) {
        seq.release_kv(blocks);
        waiting.push_front(seq);
        return None;
    }
    // Dropping the ticket gives its queue place back.
    let first_time = seq.queue_ticket.take().is_some();
    if first_time {
        seq.queue_time = Some(seq.submitted_at.elapsed());
        blocks.record_prefix_lookup(seq.prompt_len(), seq.cached_prompt_tokens);
    }
    running.push(seq);
    Some((num_tokens, first_time))
}

/// Gives `running[index]` the blocks for `num_tokens` more tokens, preempting resident sequences
/// that are not in this step if needed. Returns its index then (a preemption before it moves it),
/// or `None` when it does not fit even so: then it was preempted itself.
fn make_room(
    running: &mut Vec<Sequence>,
    mut index: usize,
    num_tokens: usize,
    in_step: &[(SequenceId, usize, usize)],
    waiting: &mut WaitingQueue,
    blocks: &mut BlockManager,
    plan: &mut StepPlan,
) -> Option<usize> {
    if grow(&mut running[index], num_tokens, blocks) {
        return Some(index);
    }
    // Only under memory pressure: the victims are those not in this step.
    let scheduled: HashSet<SequenceId> = in_step.iter().map(|&(id, ..)| id).collect();
    loop {
        let id = running[index].id;
        let victim = running
            .iter()
            .enumerate()
            .filter(|(_, s)| s.id != id && !scheduled.contains(&s.id))
            .min_by_key(|(_, s)| (s.request.priority, std::cmp::Reverse(s.id)))
            .map(|(i, _)| i)
            .unwrap_or(index);
        let mut seq = running.remove(victim);
        seq.release_kv(blocks);
        tracing::debug!(request_id = %seq.request.id, "preempted (to be recomputed)");
        waiting.push_front(seq);
        plan.preempted += 1;
        match victim.cmp(&index) {
            std::cmp::Ordering::Equal => return None,
            std::cmp::Ordering::Less => index -= 1,
            std::cmp::Ordering::Greater => {}
        }
        if grow(&mut running[index], num_tokens, blocks) {
            return Some(index);
        }
    }
}

impl StepPlan {
    fn push(&mut self, running_index: usize, num_tokens: usize, seq: &Sequence) {
        let sample = seq.num_computed + num_tokens == seq.tokens.len();
        self.seqs.push(ScheduledSeq {
            running_index,
            num_tokens,
            sample,
        });
        self.num_tokens += num_tokens;
    }
}

/// Gives `seq` the blocks to hold `num_tokens` more tokens; false (and nothing taken) if too few.
fn grow(seq: &mut Sequence, num_tokens: usize, blocks: &mut BlockManager) -> bool {
    let needed = blocks
        .blocks_for(seq.num_computed + num_tokens)
        .saturating_sub(seq.blocks.len() as u32);
    if needed == 0 {
        return true;
    }
    match blocks.allocate(needed) {
        Some(mut new_blocks) => {
            seq.blocks.append(&mut new_blocks);
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests;
