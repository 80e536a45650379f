//! When a sequence is done, in DESIGN.md §3's priority order. Cancellation is noticed before a
//! step is planned (the client's channel is closed), so this looks at the newest token only:
//! max tokens → EOS (unless `ignore_eos`) → the model's context length.

use crate::request::FinishReason;
use crate::sequence::Sequence;

pub fn check_completion(seq: &Sequence, eos_token_ids: &[u32], max_model_len: usize) -> Option<FinishReason> {
    let stopping = &seq.request.stopping;
    if seq.num_generated() >= stopping.max_new_tokens as usize {
        return Some(FinishReason::MaxTokens);
    }
    let last = *seq.tokens.last()?;
    if !stopping.ignore_eos && seq.num_generated() > 0 && eos_token_ids.contains(&last) {
        return Some(FinishReason::EosToken);
    }
    if seq.tokens.len() >= max_model_len {
        return Some(FinishReason::Length);
    }
    None
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;

    use super::*;
    use crate::request::{GenerationRequest, SamplingParams, StoppingParams};

    fn sequence(max_new_tokens: u32, ignore_eos: bool, generated: &[u32]) -> Sequence {
        let (tx, _rx) = mpsc::unbounded_channel();
        let request = GenerationRequest {
            prompt_ids: vec![5, 6],
            sampling: SamplingParams { temperature: 0.0 },
            stopping: StoppingParams {
                max_new_tokens,
                ignore_eos,
            },
        };
        let mut seq = Sequence::new(1, request, tx);
        seq.tokens.extend_from_slice(generated);
        seq
    }

    #[test]
    fn reasons_in_priority_order() {
        assert_eq!(check_completion(&sequence(4, false, &[9]), &[2], 100), None);
        assert_eq!(
            check_completion(&sequence(4, false, &[9, 2]), &[2], 100),
            Some(FinishReason::EosToken)
        );
        assert_eq!(check_completion(&sequence(4, true, &[9, 2]), &[2], 100), None);
        // Max tokens wins over EOS on the same token.
        assert_eq!(
            check_completion(&sequence(2, false, &[9, 2]), &[2], 100),
            Some(FinishReason::MaxTokens)
        );
        assert_eq!(
            check_completion(&sequence(10, false, &[9, 9]), &[2], 4),
            Some(FinishReason::Length)
        );
        // An EOS in the prompt is not a finish.
        assert_eq!(check_completion(&sequence(4, false, &[]), &[6], 100), None);
    }
}
