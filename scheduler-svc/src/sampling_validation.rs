//! Validating a request's `sampling` message into [`SamplingParams`], with vLLM's defaults and
//! ranges. Every error names the field.

use std::hash::{BuildHasher, Hasher};

use rivulet::proto;
use rivulet_ipc::layout::MAX_TOP_LOGPROBS;

use crate::request::{InvalidRequest, SamplingParams};

fn check(field: &'static str, value: f32, ok: bool, range: &str) -> Result<f32, InvalidRequest> {
    if value.is_finite() && ok {
        Ok(value)
    } else {
        Err(InvalidRequest::new(field, format!("{value} is out of range: {range}")))
    }
}

/// A seed for a request that did not give one: fresh randomness from the OS-seeded hasher keys.
fn fresh_seed() -> u64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    hasher.write_u128(nanos);
    hasher.finish()
}

pub fn sampling_params(sampling: Option<proto::SamplingParams>) -> Result<SamplingParams, InvalidRequest> {
    let sampling = sampling.unwrap_or_default();
    let defaults = SamplingParams::default();
    let temperature = sampling.temperature.unwrap_or(defaults.temperature);
    let top_k = sampling.top_k.unwrap_or(0);
    if top_k < -1 {
        return Err(InvalidRequest::new(
            "sampling.top_k",
            format!("{top_k} is out of range: -1, 0 (all) or positive"),
        ));
    }
    let top_p = sampling.top_p.unwrap_or(defaults.top_p);
    let min_p = sampling.min_p.unwrap_or(defaults.min_p);
    let repetition = sampling.repetition_penalty.unwrap_or(defaults.repetition_penalty);
    let frequency = sampling.frequency_penalty.unwrap_or(defaults.frequency_penalty);
    let presence = sampling.presence_penalty.unwrap_or(defaults.presence_penalty);
    if sampling.top_logprobs as usize > MAX_TOP_LOGPROBS {
        return Err(InvalidRequest::new(
            "sampling.top_logprobs",
            format!("{} is more than the {MAX_TOP_LOGPROBS} allowed", sampling.top_logprobs),
        ));
    }
    Ok(SamplingParams {
        temperature: check("sampling.temperature", temperature, temperature >= 0.0, ">= 0")?,
        top_k: top_k.max(0) as u32,
        top_p: check("sampling.top_p", top_p, top_p > 0.0 && top_p <= 1.0, "(0, 1]")?,
        min_p: check("sampling.min_p", min_p, (0.0..=1.0).contains(&min_p), "[0, 1]")?,
        repetition_penalty: check("sampling.repetition_penalty", repetition, repetition > 0.0, "> 0")?,
        frequency_penalty: check(
            "sampling.frequency_penalty",
            frequency,
            (-2.0..=2.0).contains(&frequency),
            "[-2, 2]",
        )?,
        presence_penalty: check(
            "sampling.presence_penalty",
            presence,
            (-2.0..=2.0).contains(&presence),
            "[-2, 2]",
        )?,
        seed: sampling.seed.unwrap_or_else(fresh_seed),
        logprobs: sampling.logprobs,
        top_logprobs: sampling.top_logprobs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_vllms_and_bad_values_name_their_field() {
        let params = sampling_params(None).expect("defaults");
        assert_eq!((params.temperature, params.top_p, params.top_k), (1.0, 1.0, 0));
        assert_ne!(
            sampling_params(None).expect("a").seed,
            params.seed,
            "fresh seeds differ"
        );
        let bad = |sampling: proto::SamplingParams| sampling_params(Some(sampling)).expect_err("invalid").field;
        assert_eq!(
            bad(proto::SamplingParams {
                temperature: Some(-0.5),
                ..Default::default()
            }),
            "sampling.temperature"
        );
        assert_eq!(
            bad(proto::SamplingParams {
                top_p: Some(0.0),
                ..Default::default()
            }),
            "sampling.top_p"
        );
        assert_eq!(
            bad(proto::SamplingParams {
                top_p: Some(1.5),
                ..Default::default()
            }),
            "sampling.top_p"
        );
        assert_eq!(
            bad(proto::SamplingParams {
                top_k: Some(-2),
                ..Default::default()
            }),
            "sampling.top_k"
        );
        assert_eq!(
            bad(proto::SamplingParams {
                min_p: Some(2.0),
                ..Default::default()
            }),
            "sampling.min_p"
        );
        assert_eq!(
            bad(proto::SamplingParams {
                repetition_penalty: Some(0.0),
                ..Default::default()
            }),
            "sampling.repetition_penalty"
        );
        assert_eq!(
            bad(proto::SamplingParams {
                frequency_penalty: Some(3.0),
                ..Default::default()
            }),
            "sampling.frequency_penalty"
        );
        assert_eq!(
            bad(proto::SamplingParams {
                presence_penalty: Some(f32::NAN),
                ..Default::default()
            }),
            "sampling.presence_penalty"
        );
        assert_eq!(
            bad(proto::SamplingParams {
                top_logprobs: 21,
                ..Default::default()
            }),
            "sampling.top_logprobs"
        );
        let seeded = sampling_params(Some(proto::SamplingParams {
            seed: Some(7),
            ..Default::default()
        }))
        .expect("ok");
        assert_eq!(seeded.seed, 7);
    }
}
