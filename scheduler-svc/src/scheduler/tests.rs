use tokio::sync::mpsc;

use super::*;
use crate::block_manager::BlockManagerConfig;
use crate::queue_ticket::QueueTicket;
use crate::request::{GenerationRequest, Priority, SamplingParams, SequenceEvent, StoppingParams};

type Receivers = Vec<mpsc::UnboundedReceiver<SequenceEvent>>;

fn seq(id: u64, prompt_len: usize, priority: Priority, receivers: &mut Receivers) -> Sequence {
    let (tx, rx) = mpsc::unbounded_channel();
    receivers.push(rx);
    let request = GenerationRequest {
        id: String::new(),
        prompt_ids: (0..prompt_len as u32).map(|t| t + id as u32 * 1000).collect(),
        sampling: SamplingParams::greedy(),
        stopping: StoppingParams {
            max_new_tokens: 8,
            ..Default::default()
        },
        priority,
    };
    Sequence::new(id, request, tx, QueueTicket::untracked())
}

fn blocks(total: u32, block_size: u32) -> BlockManager {
    let config = BlockManagerConfig {
        reserved_block_ratio: 0.0,
        backpressure_threshold: 1.0,
        ..Default::default()
    };
    BlockManager::new(total, block_size, config)
}

fn scheduler(max_num_seqs: usize, max_num_batched_tokens: usize, policy: SchedulingPolicy) -> Scheduler {
    Scheduler::new(
        SchedulerLimits {
            max_num_seqs,
            max_num_batched_tokens,
        },
        policy,
    )
}

/// Applies a plan as the engine would, sampling token 7 where asked.
fn finish_step(running: &mut [Sequence], plan: &StepPlan) {
    for scheduled in &plan.seqs {
        let seq = &mut running[scheduled.running_index];
        seq.num_computed += scheduled.num_tokens;
        if scheduled.sample {
            seq.tokens.push(7);
        }
    }
}

/// Turns a fresh two-token sequence into a resident one that decodes next.
fn make_resident_decoding(seq: &mut Sequence, blocks: &mut BlockManager) {
    seq.blocks = blocks.allocate(1).expect("block");
    seq.num_computed = 2;
    seq.tokens.push(7);
}

fn shape(plan: &StepPlan, running: &[Sequence]) -> Vec<(u64, usize, bool)> {
    plan.seqs
        .iter()
        .map(|s| (running[s.running_index].id, s.num_tokens, s.sample))
        .collect()
}

#[test]
fn long_prompts_are_chunked_under_the_token_budget_beside_decodes() {
    let mut r = Vec::new();
    let mut scheduler = scheduler(4, 10, SchedulingPolicy::Fair);
    let mut blocks = blocks(100, 4);
    let mut waiting = WaitingQueue::default();
    waiting.push_back(seq(1, 3, Priority::Normal, &mut r));
    waiting.push_back(seq(2, 25, Priority::Normal, &mut r));
    let mut running = Vec::new();

    let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
    assert_eq!(shape(&plan, &running), vec![(1, 3, true), (2, 7, false)]);
    finish_step(&mut running, &plan);
    let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
    let mut got = shape(&plan, &running);
    got.sort_unstable();
    assert_eq!(got, vec![(1, 1, true), (2, 9, false)]);
    finish_step(&mut running, &plan);
    let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
    let mut got = shape(&plan, &running);
    got.sort_unstable();
    assert_eq!(got, vec![(1, 1, true), (2, 9, true)]);
}

#[test]
fn the_victim_is_the_lowest_priority_then_the_newest_and_no_block_leaks() {
    let mut r = Vec::new();
    let mut scheduler = scheduler(4, 64, SchedulingPolicy::Fair);
    let mut blocks = blocks(6, 4);
    let mut waiting = WaitingQueue::default();
    waiting.push_back(seq(1, 4, Priority::High, &mut r));
    waiting.push_back(seq(2, 4, Priority::Low, &mut r));
    waiting.push_back(seq(3, 4, Priority::Normal, &mut r));
    let mut running = Vec::new();
    let mut preempted = 0;
    for _ in 0..10 {
        let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
        finish_step(&mut running, &plan);
        let held: u32 = running.iter().map(|s| s.blocks.len() as u32).sum();
        assert_eq!(held + blocks.num_available(), 6, "every block is held or available");
        if plan.preempted > 0 {
            preempted = plan.preempted;
            break;
        }
    }
    assert_eq!(preempted, 1);
    assert_eq!(
        waiting.front().map(|s| (s.id, s.num_computed, s.blocks.len())),
        Some((2, 0, 0))
    );
}

#[test]
fn a_preemption_mid_step_leaves_every_planned_index_pointing_at_its_sequence() {
    // Four resident sequences, each about to need a second block, and two blocks free. The ring
    // starts at the second: B and C take the free blocks, then D must preempt A, which sits
    // before all three in `running`, so every planned index moves down by one.
    let mut r = Vec::new();
    let mut scheduler = scheduler(4, 64, SchedulingPolicy::Fair);
    scheduler.round_robin = 1;
    let mut blocks = blocks(6, 2);
    let mut running: Vec<Sequence> = [
        (1, Priority::Low),
        (2, Priority::Normal),
        (3, Priority::Normal),
        (4, Priority::Normal),
    ]
    .into_iter()
    .map(|(id, priority)| {
        let mut seq = seq(id, 2, priority, &mut r);
        make_resident_decoding(&mut seq, &mut blocks);
        seq
    })
    .collect();
    let mut waiting = WaitingQueue::default();

    let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
    assert_eq!(plan.preempted, 1);
    assert_eq!(shape(&plan, &running), vec![(2, 1, true), (3, 1, true), (4, 1, true)]);
    assert_eq!(waiting.front().map(|s| (s.id, s.blocks.len())), Some((1, 0)));
    let held: u32 = running.iter().map(|s| s.blocks.len() as u32).sum();
    assert_eq!((held, blocks.num_available()), (6, 0));
}

#[test]
fn admission_follows_priority_then_arrival_and_the_sequence_limit() {
    let mut r = Vec::new();
    let mut scheduler = scheduler(2, 64, SchedulingPolicy::Fair);
    let mut blocks = blocks(100, 4);
    let mut waiting = WaitingQueue::default();
    waiting.push_back(seq(1, 2, Priority::Normal, &mut r));
    waiting.push_back(seq(2, 2, Priority::Low, &mut r));
    waiting.push_back(seq(3, 2, Priority::Critical, &mut r));
    let mut running = Vec::new();
    let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
    assert_eq!(
        shape(&plan, &running).iter().map(|s| s.0).collect::<Vec<_>>(),
        vec![3, 1]
    );
    assert_eq!(plan.first_admissions, 2);
    assert_eq!(waiting.front().map(|s| s.id), Some(2));
}

#[test]
fn fair_rotates_when_more_sequences_are_resident_than_fit_a_step() {
    let mut r = Vec::new();
    let mut scheduler = scheduler(2, 64, SchedulingPolicy::Fair);
    let mut blocks = blocks(100, 4);
    let mut waiting = WaitingQueue::default();
    let mut running: Vec<Sequence> = (1..=3).map(|id| seq(id, 2, Priority::Normal, &mut r)).collect();
    for s in &mut running {
        make_resident_decoding(s, &mut blocks);
    }
    let mut served = Vec::new();
    for _ in 0..3 {
        let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
        served.extend(shape(&plan, &running).iter().map(|s| s.0));
        finish_step(&mut running, &plan);
    }
    served.sort_unstable();
    assert_eq!(served, vec![1, 1, 2, 2, 3, 3], "each sequence got two of the six slots");
}

#[test]
fn latency_first_prefills_the_youngest_first_and_throughput_first_keeps_decoding() {
    for (policy, expected_first) in [
        (SchedulingPolicy::LatencyFirst, 4),
        (SchedulingPolicy::ThroughputFirst, 1),
    ] {
        let mut r = Vec::new();
        let mut scheduler = scheduler(1, 64, policy);
        let mut blocks = blocks(100, 4);
        let mut waiting = WaitingQueue::default();
        let mut running = vec![seq(1, 2, Priority::Normal, &mut r)];
        make_resident_decoding(&mut running[0], &mut blocks);
        for id in 2..=4 {
            waiting.push_back(seq(id, 3, Priority::Normal, &mut r));
        }
        let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
        assert_eq!(shape(&plan, &running)[0].0, expected_first, "{policy:?}");
        if policy == SchedulingPolicy::LatencyFirst {
            finish_step(&mut running, &plan);
            let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
            assert_eq!(shape(&plan, &running)[0].0, 3, "then the next youngest");
        } else {
            assert_eq!(waiting.len(), 3, "no prefill while the decode batch is full");
        }
    }
}

#[test]
fn a_second_sequence_reuses_the_first_ones_cached_prefix() {
    let mut r = Vec::new();
    let mut scheduler = scheduler(4, 64, SchedulingPolicy::Fair);
    let mut blocks = blocks(100, 4);
    let mut waiting = WaitingQueue::default();
    let first = seq(1, 10, Priority::Normal, &mut r);
    let prompt = first.tokens.clone();
    waiting.push_back(first);
    let mut running = Vec::new();
    let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
    finish_step(&mut running, &plan);
    let seq0 = &mut running[0];
    blocks.register_full_blocks(&seq0.tokens, seq0.num_computed, &seq0.blocks, &mut seq0.block_hashes);

    let mut second = seq(2, 0, Priority::Normal, &mut r);
    second.tokens = prompt.clone();
    second.request.prompt_ids = prompt;
    waiting.push_back(second);
    let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
    let second = running.iter().find(|s| s.id == 2).expect("admitted");
    assert_eq!(second.cached_prompt_tokens, 8, "two full blocks of four");
    assert_eq!(second.blocks[..2], running[0].blocks[..2]);
    assert!(
        shape(&plan, &running).contains(&(2, 2, true)),
        "only the last two prompt tokens are computed"
    );
}

#[test]
fn fair_gives_waiting_requests_a_turn_in_arrival_order_when_the_step_is_full() {
    let mut r = Vec::new();
    let mut scheduler = scheduler(1, 64, SchedulingPolicy::Fair);
    let mut blocks = blocks(100, 4);
    let mut waiting = WaitingQueue::default();
    let mut running = vec![seq(1, 2, Priority::Normal, &mut r)];
    make_resident_decoding(&mut running[0], &mut blocks);
    for id in 2..=4 {
        waiting.push_back(seq(id, 3, Priority::Normal, &mut r));
    }
    let mut first_steps = Vec::new();
    for _ in 0..4 {
        let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
        first_steps.push(shape(&plan, &running)[0].0);
        finish_step(&mut running, &plan);
    }
    assert_eq!(first_steps, vec![1, 2, 3, 4]);
}

#[test]
fn fair_never_admits_a_later_request_ahead_of_one_waiting_for_blocks() {
    let mut r = Vec::new();
    // One sequence a step, so the ring's start rotates past the waiting ones.
    let mut scheduler = scheduler(1, 64, SchedulingPolicy::Fair);
    let mut blocks = blocks(16, 4);
    let mut running = vec![seq(1, 2, Priority::Normal, &mut r)];
    make_resident_decoding(&mut running[0], &mut blocks);
    let mut hog = blocks.allocate(9).expect("blocks");
    // 6 blocks free: the earlier request needs 8, the later one 2.
    let mut waiting = WaitingQueue::default();
    waiting.push_back(seq(2, 28, Priority::Normal, &mut r));
    waiting.push_back(seq(3, 2, Priority::Normal, &mut r));
    for _ in 0..6 {
        let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
        assert_eq!(shape(&plan, &running).iter().map(|s| s.0).collect::<Vec<_>>(), vec![1]);
        finish_step(&mut running, &plan);
    }
    assert_eq!(
        waiting.iter().map(|s| s.id).collect::<Vec<_>>(),
        vec![2, 3],
        "first come, first served"
    );
    blocks.release(&mut hog);
    let admitted = (0..3).find_map(|_| {
        let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
        let ids: Vec<u64> = shape(&plan, &running).iter().map(|s| s.0).collect();
        finish_step(&mut running, &plan);
        ids.into_iter().find(|&id| id != 1)
    });
    assert_eq!(admitted, Some(2), "the earlier request goes first once blocks are free");
}

#[test]
fn a_scored_prompt_takes_at_most_the_scored_share_of_a_step() {
    let mut r = Vec::new();
    let big = MAX_SCORED_TOKENS_PER_STEP * 3;
    let mut scheduler = scheduler(4, big, SchedulingPolicy::Fair);
    let mut blocks = blocks(400, 16);
    let mut waiting = WaitingQueue::default();
    let mut scored = seq(1, MAX_SCORED_TOKENS_PER_STEP + 40, Priority::Normal, &mut r);
    scored.request.sampling.prompt_logprobs = Some(1);
    let mut twin = seq(2, MAX_SCORED_TOKENS_PER_STEP + 40, Priority::Normal, &mut r);
    twin.request.sampling.prompt_logprobs = Some(1);
    waiting.push_back(scored);
    waiting.push_back(twin);
    waiting.push_back(seq(3, 300, Priority::Normal, &mut r));
    let mut running = Vec::new();

    // Each step scores at most its share (the first, one prompt's first chunk); the plain prompt
    // is not held to it; all three have their first token within the steps the share allows.
    let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
    assert_eq!(shape(&plan, &running), vec![(1, MAX_SCORED_TOKENS_PER_STEP, false)]);
    finish_step(&mut running, &plan);
    let mut steps = 1;
    while running.len() < 3 || running.iter().any(|s| s.num_generated() == 0) {
        let plan = scheduler.plan(&mut running, &mut waiting, &mut blocks);
        let scored: usize = plan
            .seqs
            .iter()
            .filter(|s| running[s.running_index].scores_prompt())
            .map(|s| s.num_tokens)
            .sum();
        assert!(
            scored <= MAX_SCORED_TOKENS_PER_STEP,
            "step {steps} scores {scored} tokens"
        );
        let plain_prefill = plan.seqs.iter().find(|s| {
            let seq = &running[s.running_index];
            seq.id == 3 && seq.num_computed == 0
        });
        if let Some(plain) = plain_prefill {
            assert_eq!(plain.num_tokens, 300, "the plain prompt in one chunk");
        }
        finish_step(&mut running, &plan);
        steps += 1;
        assert!(steps <= 4, "{steps} steps");
    }
}
