//! Planning one iteration (FCFS): which sequences run, with how many tokens each, under the
//! limits `max_num_seqs`, `max_num_batched_tokens` and free KV blocks.
//!
//! Running sequences go first, oldest first: a decoding sequence gets one token, a prefilling one
//! the rest of its prompt up to the remaining token budget (chunked prefill). Waiting sequences
//! are then admitted in arrival order while the budget, the sequence limit and the free blocks
//! allow, highest priority class first. When a running sequence needs a block and none is free,
//! a later running sequence is preempted (lowest priority, then newest): its blocks are freed and it goes back to the front of the waiting queue, to be
//! recomputed later (its generated tokens are kept, so the client sees nothing).

use crate::block_manager::BlockManager;
use crate::queue::WaitingQueue;
use crate::sequence::Sequence;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerLimits {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
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
    /// Sequences admitted for the first time (they leave the admission queue's count).
    pub first_admissions: usize,
}

pub struct FcfsScheduler {
    pub limits: SchedulerLimits,
}

impl FcfsScheduler {
    pub fn new(limits: SchedulerLimits) -> Self {
        Self { limits }
    }

    /// Plans the next step, allocating the blocks it needs. Moves admitted sequences from
    /// `waiting` to the end of `running`, and preempted ones from `running` to `waiting`.
    pub fn plan(&self, running: &mut Vec<Sequence>, waiting: &mut WaitingQueue, blocks: &mut BlockManager) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.limits.max_num_batched_tokens;
        let mut index = 0;
        while index < running.len() {
            if budget == 0 {
                break;
            }
            let num_tokens = running[index].num_uncomputed().min(budget);
            if num_tokens == 0 {
                index += 1;
                continue;
            }
            // Make room by preempting the newest sequences not yet in this step.
            let mut fits = grow(&mut running[index], num_tokens, blocks);
            while !fits && running.len() - 1 > index {
                let victim = choose_victim(running, index + 1);
                let mut victim = running.remove(victim);
                preempt(&mut victim, blocks);
                waiting.push_front(victim);
                plan.preempted += 1;
                fits = grow(&mut running[index], num_tokens, blocks);
            }
            if !fits {
                // Not even alone does it fit now: it waits, with its blocks freed for others.
                let mut seq = running.remove(index);
                preempt(&mut seq, blocks);
                waiting.push_front(seq);
                plan.preempted += 1;
                continue;
            }
            plan.push(index, num_tokens, &running[index]);
            budget -= num_tokens;
            index += 1;
        }

        // Admit waiting sequences in arrival order. Only after preemption-free planning of the
        // running ones, and only if their whole history fits now, so admission cannot cause a
        // preemption in the same step.
        if plan.preempted == 0 {
            while budget > 0 && running.len() < self.limits.max_num_seqs {
                let Some(next) = waiting.front() else { break };
                let history_blocks = blocks.blocks_for(next.tokens.len() + 1);
                if history_blocks > blocks.num_free() {
                    break;
                }
                let Some(mut seq) = waiting.pop_front() else { break };
                let num_tokens = seq.num_uncomputed().min(budget);
                if !grow(&mut seq, num_tokens, blocks) {
                    waiting.push_front(seq);
                    break;
                }
                if !seq.admitted_once {
                    seq.admitted_once = true;
                    plan.first_admissions += 1;
                }
                running.push(seq);
                let index = running.len() - 1;
                plan.push(index, num_tokens, &running[index]);
                budget -= num_tokens;
            }
        }
        plan
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

/// Among `running[from..]`, the lowest priority, then the newest.
fn choose_victim(running: &[Sequence], from: usize) -> usize {
    (from..running.len())
        .min_by_key(|&i| (running[i].request.priority, std::cmp::Reverse(running[i].id)))
        .unwrap_or(running.len() - 1)
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

/// Frees a sequence's KV; it will be recomputed from its tokens.
pub fn preempt(seq: &mut Sequence, blocks: &mut BlockManager) {
    blocks.release(&mut seq.blocks);
    seq.num_computed = 0;
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;

    use super::*;
    use crate::request::{GenerationRequest, Priority, SamplingParams, SequenceEvent, StoppingParams};

    fn seq(id: u64, prompt_len: usize) -> (Sequence, mpsc::UnboundedReceiver<SequenceEvent>) {
        seq_with_priority(id, prompt_len, Priority::Normal)
    }

    fn seq_with_priority(
        id: u64,
        prompt_len: usize,
        priority: Priority,
    ) -> (Sequence, mpsc::UnboundedReceiver<SequenceEvent>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let request = GenerationRequest {
            prompt_ids: vec![1; prompt_len],
            sampling: SamplingParams { temperature: 0.0 },
            stopping: StoppingParams {
                max_new_tokens: 8,
                ..Default::default()
            },
            priority,
        };
        (Sequence::new(id, request, tx), rx)
    }

    fn finish_step(running: &mut [Sequence], plan: &StepPlan) {
        for scheduled in &plan.seqs {
            let seq = &mut running[scheduled.running_index];
            seq.num_computed += scheduled.num_tokens;
            if scheduled.sample {
                seq.tokens.push(7);
            }
        }
    }

    #[test]
    fn long_prompts_are_chunked_under_the_token_budget_beside_decodes() {
        let scheduler = FcfsScheduler::new(SchedulerLimits {
            max_num_seqs: 4,
            max_num_batched_tokens: 10,
        });
        let mut blocks = BlockManager::new(100, 4);
        let (short, _a) = seq(1, 3);
        let (long, _b) = seq(2, 25);
        let mut running = Vec::new();
        let mut waiting = WaitingQueue::default();
        waiting.push_back(short);
        waiting.push_back(long);

        let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
        assert_eq!(
            plan.seqs.iter().map(|s| (s.num_tokens, s.sample)).collect::<Vec<_>>(),
            vec![(3, true), (7, false)]
        );
        finish_step(&mut running, &plan);

        let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
        assert_eq!(
            plan.seqs.iter().map(|s| (s.num_tokens, s.sample)).collect::<Vec<_>>(),
            vec![(1, true), (9, false)]
        );
        finish_step(&mut running, &plan);

        let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
        assert_eq!(
            plan.seqs.iter().map(|s| (s.num_tokens, s.sample)).collect::<Vec<_>>(),
            vec![(1, true), (9, true)]
        );
        assert_eq!(running[1].blocks.len(), 7, "25 tokens in 4-token blocks");
    }

    #[test]
    fn a_sequence_that_needs_a_block_preempts_the_newest_and_blocks_return() {
        let scheduler = FcfsScheduler::new(SchedulerLimits {
            max_num_seqs: 4,
            max_num_batched_tokens: 64,
        });
        let mut blocks = BlockManager::new(4, 4);
        let (a, _a) = seq(1, 4);
        let (b, _b) = seq(2, 4);
        let mut running = Vec::new();
        let mut waiting = WaitingQueue::default();
        waiting.push_back(a);
        waiting.push_back(b);
        let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
        assert_eq!(plan.seqs.len(), 2);
        finish_step(&mut running, &plan);
        // Both now need a second block; 2 are free.
        let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
        assert_eq!(plan.preempted, 0);
        finish_step(&mut running, &plan);
        // Fill the second blocks (4 tokens each) until a third is needed: only 0 free.
        for _ in 0..3 {
            let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
            finish_step(&mut running, &plan);
        }
        let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
        assert_eq!(plan.preempted, 1);
        assert_eq!(running.len(), 1);
        assert_eq!(
            waiting.front().map(|s| (s.id, s.num_computed, s.blocks.len())),
            Some((2, 0, 0))
        );
        let in_use: usize = running.iter().map(|s| s.blocks.len()).sum();
        assert_eq!(in_use + blocks.num_free() as usize, 4, "no block leaked");
    }

    #[test]
    fn admission_respects_the_sequence_limit_in_arrival_order() {
        let scheduler = FcfsScheduler::new(SchedulerLimits {
            max_num_seqs: 2,
            max_num_batched_tokens: 64,
        });
        let mut blocks = BlockManager::new(100, 4);
        let mut waiting = WaitingQueue::default();
        (1..=3).for_each(|id| waiting.push_back(seq(id, 2).0));
        let mut running = Vec::new();
        let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
        assert_eq!(plan.seqs.len(), 2);
        assert_eq!(running.iter().map(|s| s.id).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(waiting.front().map(|s| s.id), Some(3));
    }

    #[test]
    fn the_victim_is_the_lowest_priority_then_the_newest() {
        let scheduler = FcfsScheduler::new(SchedulerLimits {
            max_num_seqs: 4,
            max_num_batched_tokens: 64,
        });
        let mut blocks = BlockManager::new(6, 4);
        let mut waiting = WaitingQueue::default();
        let mut receivers = Vec::new();
        for (id, priority) in [(1, Priority::High), (2, Priority::Low), (3, Priority::Normal)] {
            let (seq, rx) = seq_with_priority(id, 4, priority);
            waiting.push_back(seq);
            receivers.push(rx);
        }
        let mut running = Vec::new();
        for _ in 0..10 {
            let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
            finish_step(&mut running, &plan);
            if plan.preempted > 0 {
                break;
            }
        }
        assert_eq!(
            waiting.front().map(|s| s.id),
            Some(2),
            "the LOW sequence was preempted first"
        );
        assert!(running.iter().any(|s| s.id == 1));
    }
}
