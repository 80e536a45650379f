//! Writes a planned step into the shared-memory step buffer (the worker's inputs), array by array,
//! straight into the mapping: nothing is allocated per iteration.

use rivulet_ipc::StepBuffer;

use crate::scheduler::StepPlan;
use crate::sequence::Sequence;

pub fn write_step(buffer: &mut StepBuffer, step: u64, plan: &StepPlan, running: &[Sequence], block_size: u32) {
    let layout = *buffer.layout();
    let block_size = block_size as usize;
    let max_blocks = layout.capacity.max_blocks_per_seq as usize;
    let scheduled = || plan.seqs.iter().map(|s| (s, &running[s.running_index]));

    {
        let header = buffer.header_mut();
        header.step = step;
        header.num_tokens = plan.num_tokens as u32;
        header.num_seqs = plan.seqs.len() as u32;
    }
    let input_ids = buffer.i64_array_mut(layout.input_ids);
    let mut t = 0;
    for (s, seq) in scheduled() {
        for &token in &seq.tokens[seq.num_computed..seq.num_computed + s.num_tokens] {
            input_ids[t] = token as i64;
            t += 1;
        }
    }
    let positions = buffer.i64_array_mut(layout.positions);
    let mut t = 0;
    for (s, seq) in scheduled() {
        for position in seq.num_computed..seq.num_computed + s.num_tokens {
            positions[t] = position as i64;
            t += 1;
        }
    }
    let slots = buffer.i64_array_mut(layout.slot_mapping);
    let mut t = 0;
    for (s, seq) in scheduled() {
        for position in seq.num_computed..seq.num_computed + s.num_tokens {
            slots[t] = (seq.blocks[position / block_size] as usize * block_size + position % block_size) as i64;
            t += 1;
        }
    }
    let query_start = buffer.i64_array_mut(layout.query_start);
    let mut start = 0;
    for (i, (s, _)) in scheduled().enumerate() {
        query_start[i] = start;
        start += s.num_tokens as i64;
    }
    query_start[plan.seqs.len()] = start;
    let context_lens = buffer.i64_array_mut(layout.context_lens);
    for (i, (s, seq)) in scheduled().enumerate() {
        context_lens[i] = (seq.num_computed + s.num_tokens) as i64;
    }
    let sample = buffer.i64_array_mut(layout.sample);
    for (i, (s, _)) in scheduled().enumerate() {
        sample[i] = i64::from(s.sample);
    }
    let temperature = buffer.f32_array_mut(layout.temperature);
    for (i, (_, seq)) in scheduled().enumerate() {
        temperature[i] = seq.request.sampling.temperature;
    }
    let tables = buffer.i64_array_mut(layout.block_tables);
    for (i, (_, seq)) in scheduled().enumerate() {
        let row = &mut tables[i * max_blocks..(i + 1) * max_blocks];
        for (entry, &block) in row.iter_mut().zip(&seq.blocks) {
            *entry = block as i64;
        }
        row[seq.blocks.len().min(max_blocks)..].fill(0);
    }
}
