use super::*;

/// SmolLM2's vocabulary.
const VOCAB: u32 = 49_152;

fn field_of(sampling: SamplingDraft) -> Field {
    match sampling_params(sampling, VOCAB) {
        Err(ValidationError::Invalid { field, .. }) => field,
        other => panic!("expected an invalid field, got {other:?}"),
    }
}

#[test]
fn numbers_are_checked_as_sent_and_narrowed_toward_zero_but_never_to_it() {
    assert_eq!(narrow(0.7), 0.7_f32);
    assert_eq!(narrow(0.0), 0.0);
    assert!(narrow(0.9999999999) < 1.0);
    assert!(narrow(-1.9999999999) >= -2.0);
    assert_eq!(narrow(1e-50), f32::MIN_POSITIVE);
    assert_eq!(narrow(-1e-300), -f32::MIN_POSITIVE);
    assert_eq!(narrow(1e39), f32::MAX);
    assert_eq!(narrow(-1e300), -f32::MAX);
    assert!(narrow(f64::NAN).is_nan());
    assert_eq!(narrow(f64::INFINITY), f32::INFINITY);
    let tiny = sampling_params(
        SamplingDraft {
            top_p: Some(1e-50),
            temperature: Some(1e39),
            ..Default::default()
        },
        VOCAB,
    )
    .expect("a tiny mass and a huge temperature");
    assert_eq!((tiny.top_p, tiny.temperature), (f32::MIN_POSITIVE, f32::MAX));
    for (draft, field) in [
        (
            SamplingDraft {
                frequency_penalty: Some(2.0000000001),
                ..Default::default()
            },
            Field::FrequencyPenalty,
        ),
        (
            SamplingDraft {
                top_p: Some(1.00000001),
                ..Default::default()
            },
            Field::TopP,
        ),
    ] {
        match sampling_params(draft, VOCAB) {
            Err(ValidationError::Invalid { field: named, problem }) => {
                assert_eq!(named, field);
                assert!(
                    problem.starts_with("2.0000000001") || problem.starts_with("1.00000001"),
                    "{problem}"
                );
            }
            other => panic!("{field:?} just past its range: {other:?}"),
        }
    }
}

#[test]
fn defaults_are_vllms_and_bad_values_name_their_field() {
    let params = sampling_params(SamplingDraft::default(), VOCAB).expect("defaults");
    assert_eq!((params.temperature, params.top_p, params.top_k), (1.0, 1.0, 0));
    let again = sampling_params(SamplingDraft::default(), VOCAB).expect("defaults");
    assert_ne!(again.seed, params.seed, "fresh seeds differ");
    let cases = [
        (
            SamplingDraft {
                temperature: Some(-0.5),
                ..Default::default()
            },
            Field::Temperature,
        ),
        (
            SamplingDraft {
                temperature: Some(f64::INFINITY),
                ..Default::default()
            },
            Field::Temperature,
        ),
        (
            SamplingDraft {
                top_p: Some(0.0),
                ..Default::default()
            },
            Field::TopP,
        ),
        (
            SamplingDraft {
                top_p: Some(1.5),
                ..Default::default()
            },
            Field::TopP,
        ),
        (
            SamplingDraft {
                top_k: Some(-2),
                ..Default::default()
            },
            Field::TopK,
        ),
        (
            SamplingDraft {
                min_p: Some(2.0),
                ..Default::default()
            },
            Field::MinP,
        ),
        (
            SamplingDraft {
                repetition_penalty: Some(0.0),
                ..Default::default()
            },
            Field::RepetitionPenalty,
        ),
        (
            SamplingDraft {
                repetition_penalty: Some(f64::INFINITY),
                ..Default::default()
            },
            Field::RepetitionPenalty,
        ),
        (
            SamplingDraft {
                frequency_penalty: Some(3.0),
                ..Default::default()
            },
            Field::FrequencyPenalty,
        ),
        (
            SamplingDraft {
                presence_penalty: Some(f64::NAN),
                ..Default::default()
            },
            Field::PresencePenalty,
        ),
        (
            SamplingDraft {
                top_logprobs: 21,
                ..Default::default()
            },
            Field::TopLogprobs,
        ),
    ];
    for (draft, field) in cases {
        assert_eq!(field_of(draft), field);
    }
    let seeded = sampling_params(
        SamplingDraft {
            seed: Some(7),
            ..Default::default()
        },
        VOCAB,
    )
    .expect("ok");
    assert_eq!(seeded.seed, 7);
}

fn biased(logit_bias: Vec<(u32, f32)>, allowed_token_ids: Option<Vec<u32>>) -> SamplingDraft {
    SamplingDraft {
        logit_bias,
        allowed_token_ids,
        ..Default::default()
    }
}

#[test]
fn logit_biases_are_clamped_deduplicated_and_merged_with_the_allowed_tokens() {
    let params = sampling_params(
        biased(vec![(9, 250.0), (3, -1.5), (9, -300.0), (7, f32::INFINITY)], None),
        VOCAB,
    )
    .expect("valid");
    // Sorted by token; the later entry for 9 wins; both ends clamped to ±100.
    assert_eq!(params.logit_bias, vec![(3, -1.5), (7, 100.0), (9, -100.0)]);
    assert!(!params.allowed_only);

    let params = sampling_params(biased(vec![(5, 2.0), (8, -4.0)], Some(vec![8, 1, 8])), VOCAB).expect("valid");
    // Every allowed token once, with its bias or 0; the bias on 5, which is not allowed, goes.
    assert_eq!(params.logit_bias, vec![(1, 0.0), (8, -4.0)]);
    assert!(params.allowed_only);

    let cases = [
        (biased(vec![(VOCAB, 1.0)], None), Field::LogitBias),
        (biased(vec![(1, f32::NAN)], None), Field::LogitBias),
        (
            biased((0..=MAX_REQUEST_LOGIT_BIAS as u32).map(|t| (t, 1.0)).collect(), None),
            Field::LogitBias,
        ),
        (biased(Vec::new(), Some(Vec::new())), Field::AllowedTokenIds),
        (biased(Vec::new(), Some(vec![3, VOCAB + 7])), Field::AllowedTokenIds),
        (
            biased(Vec::new(), Some((0..=MAX_REQUEST_LOGIT_BIAS as u32).collect())),
            Field::AllowedTokenIds,
        ),
    ];
    for (draft, field) in cases {
        assert_eq!(field_of(draft), field);
    }
    // Repeats count once towards the limit.
    let repeated = biased(Vec::new(), Some([7; 2 * MAX_REQUEST_LOGIT_BIAS].to_vec()));
    assert!(sampling_params(repeated, VOCAB).is_ok());
}
