//! One step as the worker sees it: the step buffer's per-sequence layout checked against the
//! model and the cache (so a bad step is an error, never a crash), the sampling batch built from
//! it, and the outputs written back.

use rivulet_ipc::layout::{MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS};
use rivulet_ipc::{SeqSampling, StepBuffer, StepHeader};
use tch::{Device, Kind, Tensor};

use crate::attention::SeqSlice;
use crate::error::WorkerError;
use crate::kernel_sampling::{LogitBiasRow, RowRequest};
use crate::prompt_logprobs::PromptRow;
use crate::sampler::{LogitBias, PenaltyHistory, Sampled, SamplingBatch};
use crate::step_view::StepView;

/// What validation checks against.
#[derive(Debug, Clone, Copy)]
pub struct StepLimits {
    pub vocab_size: i64,
    pub max_model_len: i64,
    pub block_size: i64,
    pub num_blocks: i64,
}

/// A step's per-sequence layout, validated.
#[derive(Debug, Default)]
pub struct HostStep {
    pub seqs: Vec<SeqSlice>,
    /// Flat-batch row of each sampled sequence's last token.
    pub logit_rows: Vec<i64>,
    /// Index (in the step) of each sampled sequence.
    pub sampled_seqs: Vec<i64>,
    /// Tokens in the step's penalty histories.
    pub history_len: usize,
    /// Tokens whose follower in the prompt is scored (prompt logprobs), in flat-batch order.
    pub prompt_rows: Vec<PromptRow>,
}

impl HostStep {
    /// The rows the output head computes: the sampled sequences' last tokens, then the prompt
    /// rows; at least one, since a step of prompt chunks that all end mid-prompt and score
    /// nothing still runs the head.
    pub fn head_rows(&self) -> Vec<i64> {
        let rows: Vec<i64> = self
            .logit_rows
            .iter()
            .copied()
            .chain(self.prompt_rows.iter().map(|row| row.flat_row))
            .collect();
        if rows.is_empty() {
            vec![0]
        } else {
            rows
        }
    }
}

fn invalid<T>(what: String) -> Result<T, WorkerError> {
    Err(WorkerError::InvalidStep(what))
}

fn check_range<'v>(what: &str, values: impl IntoIterator<Item = &'v i64>, end: i64) -> Result<(), WorkerError> {
    match values.into_iter().find(|&&v| v < 0 || v >= end) {
        Some(bad) => invalid(format!("{what} holds {bad}, outside 0..{end}")),
        None => Ok(()),
    }
}

/// Blocks that hold `tokens` tokens (`tokens` was checked non-negative by the caller).
fn blocks_for(tokens: i64, block_size: i64) -> usize {
    ((tokens + block_size - 1) / block_size).max(0) as usize
}

/// Checks every index and length the step will use.
pub fn validate(buffer: &StepBuffer, header: &StepHeader, limits: StepLimits) -> Result<HostStep, WorkerError> {
    let layout = buffer.layout();
    let tokens = header.num_tokens as usize;
    let seqs = header.num_seqs as usize;
    if tokens == 0 || seqs == 0 {
        return invalid(format!("empty step ({tokens} tokens, {seqs} sequences)"));
    }
    let query_start = &buffer.array(layout.query_start)[..=seqs];
    let context_lens = &buffer.array(layout.context_lens)[..seqs];
    let sample_flags = &buffer.array(layout.sample)[..seqs];
    let block_tables = buffer.array(layout.block_tables);
    let max_blocks = layout.capacity.max_blocks_per_seq as usize;
    if query_start[0] != 0 || query_start[seqs] != tokens as i64 {
        return invalid(format!("query_start must run from 0 to {tokens}"));
    }
    let mut host = HostStep {
        seqs: Vec::with_capacity(seqs),
        ..HostStep::default()
    };
    for i in 0..seqs {
        let (start, end, context) = (query_start[i], query_start[i + 1], context_lens[i]);
        if end <= start {
            return invalid(format!("sequence {i} has no tokens"));
        }
        if context < end - start
            || context > limits.max_model_len
            || blocks_for(context, limits.block_size) > max_blocks
        {
            return invalid(format!("sequence {i}: context length {context} is out of range"));
        }
        let used_blocks = &block_tables[i * max_blocks..i * max_blocks + blocks_for(context, limits.block_size)];
        check_range(&format!("block table of sequence {i}"), used_blocks, limits.num_blocks)?;
        host.seqs.push(SeqSlice {
            first_token: start,
            num_tokens: end - start,
            context_len: context,
        });
        if sample_flags[i] != 0 {
            host.logit_rows.push(end - 1);
            host.sampled_seqs.push(i as i64);
        }
    }
    check_range(
        "input_ids",
        &buffer.array(layout.input_ids)[..tokens],
        limits.vocab_size,
    )?;
    check_range(
        "positions",
        &buffer.array(layout.positions)[..tokens],
        limits.max_model_len,
    )?;
    let num_slots = limits.num_blocks * limits.block_size;
    check_range("slot_mapping", &buffer.array(layout.slot_mapping)[..tokens], num_slots)?;

    let bias_count = &buffer.array(layout.logit_bias_count)[..seqs];
    for &seq in &host.sampled_seqs {
        let seq = seq as usize;
        let count = bias_count[seq];
        if !(0..=MAX_LOGIT_BIAS as i64).contains(&count) {
            return invalid(format!("sequence {seq}: {count} logit bias entries"));
        }
        // A row allowed only its listed tokens must list one, or nothing is left to choose.
        if count == 0 && buffer.array(layout.sampling)[seq].allowed_only != 0 {
            return invalid(format!(
                "sequence {seq}: allowed only its listed tokens, and lists none"
            ));
        }
        let row = bias_row(buffer, seq);
        check_range(
            &format!("logit bias tokens of sequence {seq}"),
            row.tokens,
            limits.vocab_size,
        )?;
        // −∞ bans a token; +∞ or NaN would leave no distribution to draw from.
        if let Some(bad) = row.values.iter().find(|v| !(v.is_finite() || **v == f32::NEG_INFINITY)) {
            return invalid(format!("sequence {seq}: a logit bias of {bad}"));
        }
    }

    check_token_masks(buffer, &host.sampled_seqs, limits.vocab_size)?;

    let history_start = &buffer.array(layout.history_start)[..=seqs];
    let history_prompt = &buffer.array(layout.history_prompt_len)[..seqs];
    let capacity = layout.capacity.max_history_tokens as i64;
    if history_start[0] != 0 || history_start[seqs] > capacity {
        return invalid(format!("history_start must run from 0 to at most {capacity}"));
    }
    for i in 0..seqs {
        let len = history_start[i + 1] - history_start[i];
        if len < 0 || history_prompt[i] < 0 || history_prompt[i] > len {
            return invalid(format!("sequence {i}: bad penalty history range"));
        }
    }
    host.history_len = history_start[seqs] as usize;
    check_range(
        "history_tokens",
        &buffer.array(layout.history_tokens)[..host.history_len],
        limits.vocab_size,
    )?;
    let sampling = &buffer.array(layout.sampling)[..seqs];
    check_range(
        "num_top_logprobs",
        sampling.iter().map(|row| &row.num_top_logprobs),
        MAX_TOP_LOGPROBS as i64 + 1,
    )?;
    for &seq in &host.sampled_seqs {
        check_sampling(seq, &sampling[seq as usize])?;
    }
    host.prompt_rows = prompt_rows(buffer, query_start, limits.vocab_size)?;
    Ok(host)
}

/// The tokens of sequences that asked for prompt logprobs whose follower is given, checked.
fn prompt_rows(buffer: &StepBuffer, query_start: &[i64], vocab_size: i64) -> Result<Vec<PromptRow>, WorkerError> {
    let layout = buffer.layout();
    let seqs = query_start.len() - 1;
    let tops = &buffer.array(layout.prompt_logprob_top)[..seqs];
    let targets = buffer.array(layout.prompt_logprob_targets);
    let mut rows = Vec::new();
    for (seq, &top) in tops.iter().enumerate() {
        if top < 0 {
            continue;
        }
        if top > MAX_TOP_LOGPROBS as i64 {
            return invalid(format!("sequence {seq}: {top} prompt logprob alternatives"));
        }
        for flat_row in query_start[seq]..query_start[seq + 1] {
            match targets[flat_row as usize] {
                -1 => {}
                target if (0..vocab_size).contains(&target) => rows.push(PromptRow {
                    flat_row,
                    target: target as usize,
                    top: top as usize,
                }),
                bad => return invalid(format!("prompt_logprob_targets holds {bad}, outside 0..{vocab_size}")),
            }
        }
    }
    Ok(rows)
}

/// Each sampled sequence's token mask, where it has one: the flag 0 or 1, and some token of the
/// vocabulary allowed (a row wide enough for the vocabulary), or nothing would be left to choose.
fn check_token_masks(buffer: &StepBuffer, sampled_seqs: &[i64], vocab_size: i64) -> Result<(), WorkerError> {
    let used = buffer.array(buffer.layout().token_mask_used);
    for &seq in sampled_seqs {
        match used[seq as usize] {
            0 => {}
            1 => {
                let row = token_mask_row(buffer, seq as usize).unwrap_or_default();
                if (row.len() as i64) * 64 < vocab_size {
                    return invalid(format!(
                        "sequence {seq}: a token mask of {} words for a vocabulary of {vocab_size}",
                        row.len()
                    ));
                }
                if !(0..vocab_size as usize).any(|token| token_allowed(row, token)) {
                    return invalid(format!("sequence {seq}: its token mask allows no token"));
                }
            }
            bad => return invalid(format!("sequence {seq}: token_mask_used is {bad}")),
        }
    }
    Ok(())
}

/// Sequence `seq`'s row of `token_masks` if its flag says it has one.
fn token_mask_row(buffer: &StepBuffer, seq: usize) -> Option<&[i64]> {
    let layout = buffer.layout();
    if buffer.array(layout.token_mask_used)[seq] != 1 {
        return None;
    }
    let words = layout.capacity.token_mask_words as usize;
    Some(&buffer.array(layout.token_masks)[seq * words..(seq + 1) * words])
}

/// Whether `mask` (a row of `token_masks`) allows `token`.
pub fn token_allowed(mask: &[i64], token: usize) -> bool {
    mask.get(token / 64)
        .is_some_and(|word| (*word as u64) >> (token % 64) & 1 == 1)
}

/// The ranges the scheduler's validation gives a sampled row's parameters (both samplers assume
/// them: a top-p or min-p outside [0, 1], or an infinite temperature, has no meaning to draw by).
fn check_sampling(seq: i64, row: &SeqSampling) -> Result<(), WorkerError> {
    let unit = 0.0..=1.0;
    let checks = [
        ("temperature", row.temperature, row.temperature >= 0.0),
        ("top_p", row.top_p, unit.contains(&row.top_p)),
        ("min_p", row.min_p, unit.contains(&row.min_p)),
        (
            "repetition_penalty",
            row.repetition_penalty,
            row.repetition_penalty > 0.0,
        ),
        ("frequency_penalty", row.frequency_penalty, true),
        ("presence_penalty", row.presence_penalty, true),
        (
            "allowed_only",
            row.allowed_only as f32,
            matches!(row.allowed_only, 0 | 1),
        ),
    ];
    match checks
        .iter()
        .find(|(_, value, in_range)| !(value.is_finite() && *in_range))
    {
        Some((name, value, _)) => invalid(format!("sequence {seq}: {name} is {value}")),
        None => Ok(()),
    }
}

/// The sampled sequences' rows of the `sampling` array, in [`HostStep::sampled_seqs`] order.
pub fn sampled_rows(buffer: &StepBuffer, host: &HostStep) -> Vec<SeqSampling> {
    let all_rows = buffer.array(buffer.layout().sampling);
    host.sampled_seqs.iter().map(|&i| all_rows[i as usize]).collect()
}

/// Each sampled sequence's parameters and penalty history (its prompt's tokens, then its
/// output's), in [`HostStep::sampled_seqs`] order, for [`crate::kernel_sampling`]; history
/// ranges as [`validate`] checked them.
pub fn row_requests<'b>(buffer: &'b StepBuffer, host: &HostStep) -> Vec<RowRequest<'b>> {
    let layout = buffer.layout();
    let (start, prompt_len) = (
        buffer.array(layout.history_start),
        buffer.array(layout.history_prompt_len),
    );
    let (tokens, sampling) = (buffer.array(layout.history_tokens), buffer.array(layout.sampling));
    host.sampled_seqs
        .iter()
        .map(|&seq| {
            let seq = seq as usize;
            RowRequest {
                params: sampling[seq],
                history: &tokens[start[seq] as usize..start[seq + 1] as usize],
                prompt_len: prompt_len[seq] as usize,
                bias: bias_row(buffer, seq),
            }
        })
        .collect()
}

/// Sequence `seq`'s logit-bias entries (the count as [`validate`] checked it).
fn bias_row(buffer: &StepBuffer, seq: usize) -> LogitBiasRow<'_> {
    let layout = buffer.layout();
    let count = buffer.array(layout.logit_bias_count)[seq] as usize;
    let entries = seq * MAX_LOGIT_BIAS..seq * MAX_LOGIT_BIAS + count;
    LogitBiasRow {
        tokens: &buffer.array(layout.logit_bias_tokens)[entries.clone()],
        values: &buffer.array(layout.logit_bias_values)[entries],
        mask: token_mask_row(buffer, seq),
    }
}

/// The sampled sequences' parameters (from their rows of the `sampling` array) and penalty
/// histories, on `device`.
pub fn sampling_batch(
    buffer: &StepBuffer,
    view: &StepView<'_>,
    host: &HostStep,
    device: Device,
) -> Result<SamplingBatch, WorkerError> {
    let layout = buffer.layout();
    let rows = sampled_rows(buffer, host);

    let history_start = buffer.array(layout.history_start);
    let history_prompt = buffer.array(layout.history_prompt_len);
    let (mut history_rows, mut generated, mut pieces) = (Vec::new(), Vec::new(), Vec::new());
    for (row, &seq) in host.sampled_seqs.iter().enumerate() {
        let (start, end) = (history_start[seq as usize], history_start[seq as usize + 1]);
        if end > start {
            let prompt_end = start + history_prompt[seq as usize];
            history_rows.extend(std::iter::repeat_n(row as i64, (end - start) as usize));
            generated.extend((start..end).map(|position| position >= prompt_end));
            pieces.push(view.history_tokens.f_narrow(0, start, end - start)?);
        }
    }
    let history = if pieces.is_empty() {
        None
    } else {
        Some(PenaltyHistory {
            rows: Tensor::f_from_slice(&history_rows)?.f_to_device(device)?,
            tokens: Tensor::f_cat(&pieces, 0)?.f_to_device(device)?,
            generated: Tensor::f_from_slice(&generated)?.f_to_device(device)?,
        })
    };
    let bias = LogitBias::from_rows(
        host.sampled_seqs
            .iter()
            .zip(&rows)
            .map(|(&seq, params)| (bias_row(buffer, seq as usize), params.allowed_only != 0)),
        device,
    )?;
    Ok(SamplingBatch::from_rows(&rows, history, bias, device)?)
}

/// Writes the sampled tokens, their logprobs and the alternatives into the step buffer.
pub fn write_outputs(view: &mut StepView<'_>, host: &HostStep, sampled: &Sampled) -> Result<(), WorkerError> {
    let index = Tensor::f_from_slice(&host.sampled_seqs)?;
    let cpu = |t: &Tensor| -> Result<Tensor, WorkerError> { Ok(t.f_to_device(Device::Cpu)?) };
    let _ = view.sampled_tokens.f_index_copy_(0, &index, &cpu(&sampled.tokens)?)?;
    let _ = view
        .sampled_logprobs
        .f_index_copy_(0, &index, &cpu(&sampled.logprobs)?.f_to_kind(Kind::Float)?)?;
    if let (Some(ids), Some(values)) = (&sampled.top_ids, &sampled.top_values) {
        let width = ids.size()[1];
        let _ = view
            .top_logprob_ids
            .f_narrow(1, 0, width)?
            .f_index_copy_(0, &index, &cpu(ids)?)?;
        let _ = view
            .top_logprob_values
            .f_narrow(1, 0, width)?
            .f_index_copy_(0, &index, &cpu(values)?)?;
    }
    Ok(())
}
