//! The reasons decided by the newest token itself: max tokens → EOS / stop token ids (unless
//! `ignore_eos` for EOS; never before `min_new_tokens`) → the model's context → confidence (the
//! token's probability below the request's threshold, not before `min_new_tokens`).

use crate::request::FinishReason;
use crate::sequence::Sequence;

/// `logprob` is the newest token's log-probability under the model.
pub fn check_token_completion(
    seq: &Sequence,
    eos_token_ids: &[u32],
    max_model_len: usize,
    logprob: f32,
) -> Option<FinishReason> {
    let stopping = &seq.request.stopping;
    let generated = seq.num_generated();
    if generated >= stopping.max_new_tokens as usize {
        return Some(FinishReason::MaxTokens);
    }
    let last = *seq.tokens.last()?;
    if generated > 0 && generated >= stopping.min_new_tokens as usize {
        if !stopping.ignore_eos && eos_token_ids.contains(&last) {
            return Some(FinishReason::EosToken);
        }
        if stopping.stop_token_ids.contains(&last) {
            return Some(FinishReason::StopToken);
        }
    }
    if seq.tokens.len() >= max_model_len {
        return Some(FinishReason::Length);
    }
    let threshold = stopping.confidence_threshold?;
    (generated >= stopping.min_new_tokens as usize && logprob.exp() < threshold).then_some(FinishReason::LowConfidence)
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;

    use super::*;
    use crate::queue_ticket::QueueTicket;
    use crate::request::{GenerationRequest, Priority, SamplingParams, StoppingParams};

    fn sequence(stopping: StoppingParams, generated: &[u32]) -> Sequence {
        let (tx, _rx) = mpsc::unbounded_channel();
        let request = GenerationRequest {
            id: String::new(),
            prompt_ids: vec![5, 6],
            sampling: SamplingParams::greedy(),
            stopping,
            priority: Priority::Normal,
        };
        let mut seq = Sequence::new(1, request, tx, QueueTicket::untracked());
        seq.tokens.extend_from_slice(generated);
        seq
    }

    fn stopping(max_new_tokens: u32, ignore_eos: bool) -> StoppingParams {
        StoppingParams {
            max_new_tokens,
            ignore_eos,
            ..Default::default()
        }
    }

    #[test]
    fn reasons_in_priority_order() {
        let check = |stop: StoppingParams, generated: &[u32], max_len| {
            check_token_completion(&sequence(stop, generated), &[2], max_len, 0.0)
        };
        assert_eq!(check(stopping(4, false), &[9], 100), None);
        assert_eq!(check(stopping(4, false), &[9, 2], 100), Some(FinishReason::EosToken));
        assert_eq!(check(stopping(4, true), &[9, 2], 100), None);
        // Max tokens wins over EOS on the same token.
        assert_eq!(check(stopping(2, false), &[9, 2], 100), Some(FinishReason::MaxTokens));
        assert_eq!(check(stopping(10, false), &[9, 9], 4), Some(FinishReason::Length));
        // An EOS in the prompt is not a finish.
        assert_eq!(check(stopping(4, false), &[], 100), None);
    }

    #[test]
    fn stop_tokens_and_min_new_tokens() {
        let with_stop = StoppingParams {
            stop_token_ids: vec![7],
            ..stopping(10, true)
        };
        assert_eq!(
            check_token_completion(&sequence(with_stop.clone(), &[1, 7]), &[2], 100, 0.0),
            Some(FinishReason::StopToken)
        );
        let min_three = StoppingParams {
            min_new_tokens: 3,
            ..with_stop
        };
        assert_eq!(
            check_token_completion(&sequence(min_three.clone(), &[1, 7]), &[2], 100, 0.0),
            None
        );
        assert_eq!(
            check_token_completion(&sequence(min_three.clone(), &[1, 2]), &[2], 100, 0.0),
            None
        );
        assert_eq!(
            check_token_completion(&sequence(min_three, &[1, 1, 7]), &[2], 100, 0.0),
            Some(FinishReason::StopToken)
        );
    }

    #[test]
    fn a_token_less_likely_than_the_confidence_threshold_ends_the_output() {
        let confident = StoppingParams {
            confidence_threshold: Some(0.5),
            min_new_tokens: 2,
            ..stopping(10, false)
        };
        let check = |generated: &[u32], probability: f32| {
            check_token_completion(&sequence(confident.clone(), generated), &[2], 100, probability.ln())
        };
        assert_eq!(check(&[9, 9], 0.6), None);
        assert_eq!(check(&[9, 9], 0.4), Some(FinishReason::LowConfidence));
        assert_eq!(check(&[9], 0.1), None, "not before min_new_tokens");
        // EOS and the other reasons come first.
        assert_eq!(check(&[9, 2], 0.1), Some(FinishReason::EosToken));
        assert_eq!(
            check_token_completion(&sequence(stopping(10, false), &[9, 9]), &[2], 100, 0.01f32.ln()),
            None,
            "off unless asked for"
        );
    }
}
