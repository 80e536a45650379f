//! Sampling end to end on the real model: logprobs against `transformers`, seeded determinism
//! whatever shares the batch and whatever the policy, fresh randomness without a seed, top-k = 1
//! equal to greedy, logit biases and allowed tokens against `transformers`' processors, and
//! parameter validation.

mod common;

use std::collections::HashMap;

use common::{greedy_request, hf_reference, shared_server};
use futures::future::join_all;
use rivulet::proto::generation_client::GenerationClient;
use rivulet::proto::{GenerateRequest, SamplingParams, SchedulingPolicy, SetSchedulingPolicyRequest};
use serde_json::json;
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic::Code;

const PROMPT: &str = "<|im_start|>user\nGive me three ideas for a weekend.<|im_end|>\n<|im_start|>assistant\n";

fn sampled(prompt: &str, max_new_tokens: u32, sampling: SamplingParams) -> GenerateRequest {
    GenerateRequest {
        sampling: Some(sampling),
        ..greedy_request(prompt, max_new_tokens)
    }
}

/// A request with `sampling` is refused as INVALID_ARGUMENT, the message naming `field` first.
async fn assert_invalid_naming(client: &mut GenerationClient<Channel>, sampling: SamplingParams, field: &str) {
    let status = client
        .generate(sampled(PROMPT, 2, sampling))
        .await
        .expect_err("invalid");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().starts_with(field),
        "{} should name {field}",
        status.message()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn logprobs_match_transformers_log_softmax() {
    let mut client = shared_server().client().await;
    let request = sampled(
        PROMPT,
        8,
        SamplingParams {
            temperature: Some(0.0),
            logprobs: true,
            top_logprobs: 5,
            ..Default::default()
        },
    );
    let by_ids = client
        .generate(GenerateRequest {
            prompt: String::new(),
            prompt_token_ids: vec![],
            ..request.clone()
        })
        .await;
    assert_eq!(by_ids.expect_err("no prompt").code(), Code::InvalidArgument);
    let unary = client.generate(request.clone()).await.expect("generate").into_inner();
    assert_eq!(unary.logprobs.len(), unary.token_ids.len());

    let mut stream = client.stream_generate(request).await.expect("stream").into_inner();
    let mut streamed = Vec::new();
    while let Some(message) = stream.next().await {
        streamed.extend(message.expect("message").logprobs);
    }
    // The same tokens and values; the second run reuses the cached prompt, so its float sums
    // may differ in the last bits.
    assert_eq!(streamed.len(), unary.logprobs.len());
    for (a, b) in streamed.iter().zip(&unary.logprobs) {
        assert_eq!(a.token_id, b.token_id);
        assert!((a.logprob - b.logprob).abs() < 1e-4, "streamed {a:?} vs unary {b:?}");
        assert_eq!(a.top.len(), b.top.len());
    }

    let prompt_ids = tokio::task::spawn_blocking(|| hf_reference(json!({"task": "tokenize", "texts": [PROMPT]})))
        .await
        .expect("tokenize")["ids"][0]
        .clone();
    let output_ids = unary.token_ids.clone();
    let reference = tokio::task::spawn_blocking(move || {
        hf_reference(json!({"task": "logprobs", "prompt_ids": prompt_ids, "output_ids": output_ids, "top": 5}))
    })
    .await
    .expect("reference");
    for (i, (ours, theirs)) in unary
        .logprobs
        .iter()
        .zip(reference["steps"].as_array().expect("steps"))
        .enumerate()
    {
        assert_eq!(ours.token_id, unary.token_ids[i]);
        let expected = theirs["logprob"].as_f64().expect("logprob");
        assert!(
            (f64::from(ours.logprob) - expected).abs() < 1e-3,
            "token {i}: {} vs {expected}",
            ours.logprob
        );
        let top_ids: Vec<u32> = serde_json::from_value(theirs["top_ids"].clone()).expect("ids");
        let top_values: Vec<f64> = serde_json::from_value(theirs["top_values"].clone()).expect("values");
        assert_eq!(ours.top.len(), 5);
        for (rank, alternative) in ours.top.iter().enumerate() {
            assert!(
                (f64::from(alternative.logprob) - top_values[rank]).abs() < 1e-3,
                "token {i} rank {rank}: {} vs {}",
                alternative.logprob,
                top_values[rank]
            );
            // Near-ties may swap places; the id must be the reference's at this rank or a tie.
            if alternative.token_id != top_ids[rank] {
                let tie = top_ids
                    .iter()
                    .zip(&top_values)
                    .any(|(id, v)| *id == alternative.token_id && (v - top_values[rank]).abs() < 1e-3);
                assert!(
                    tie,
                    "token {i} rank {rank}: id {} vs {}",
                    alternative.token_id, top_ids[rank]
                );
            }
        }
        // Greedy: the chosen token is the most likely one.
        assert!((ours.logprob - ours.top[0].logprob).abs() < 1e-6);
    }
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: Some(0.9),
        top_p: Some(0.95),
        top_k: Some(50),
        seed: Some(seed),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_seeded_request_gives_the_same_tokens_alone_in_a_crowd_and_under_another_policy() {
    let server = shared_server();
    let mut client = server.client().await;
    let alone = client
        .generate(sampled(PROMPT, 24, seeded(1234)))
        .await
        .expect("alone")
        .into_inner()
        .token_ids;
    assert_eq!(alone.len(), 24);

    let crowd = join_all((0..8).map(|i| async move {
        let request = if i == 3 {
            sampled(PROMPT, 24, seeded(1234))
        } else {
            sampled(&format!("{i}. {PROMPT}"), 24, SamplingParams::default())
        };
        server
            .client()
            .await
            .generate(request)
            .await
            .expect("crowd")
            .into_inner()
            .token_ids
    }))
    .await;
    assert_eq!(crowd[3], alone, "the batch changed a seeded request's tokens");

    let mut admin = server.admin().await;
    let set = |policy: SchedulingPolicy| SetSchedulingPolicyRequest { policy: policy as i32 };
    admin
        .set_scheduling_policy(set(SchedulingPolicy::ThroughputFirst))
        .await
        .expect("policy");
    let other_policy = client
        .generate(sampled(PROMPT, 24, seeded(1234)))
        .await
        .expect("again")
        .into_inner()
        .token_ids;
    admin
        .set_scheduling_policy(set(SchedulingPolicy::Fair))
        .await
        .expect("policy back");
    assert_eq!(other_policy, alone, "the policy changed a seeded request's tokens");

    let other_seed = client
        .generate(sampled(PROMPT, 24, seeded(99)))
        .await
        .expect("other seed")
        .into_inner()
        .token_ids;
    assert_ne!(other_seed, alone, "another seed draws other tokens");
    let unseeded = SamplingParams {
        temperature: Some(1.0),
        ..Default::default()
    };
    let first = client
        .generate(sampled(PROMPT, 24, unseeded.clone()))
        .await
        .expect("unseeded")
        .into_inner()
        .token_ids;
    let second = client
        .generate(sampled(PROMPT, 24, unseeded))
        .await
        .expect("unseeded")
        .into_inner()
        .token_ids;
    assert_ne!(first, second, "without a seed each request draws fresh randomness");
}

#[tokio::test(flavor = "multi_thread")]
async fn top_k_one_is_greedy_and_bad_parameters_are_rejected() {
    let mut client = shared_server().client().await;
    let greedy = client
        .generate(greedy_request(PROMPT, 16))
        .await
        .expect("greedy")
        .into_inner()
        .token_ids;
    let top1 = SamplingParams {
        temperature: Some(1.3),
        top_k: Some(1),
        seed: Some(5),
        ..Default::default()
    };
    let sampled_top1 = client
        .generate(sampled(PROMPT, 16, top1))
        .await
        .expect("top-1")
        .into_inner()
        .token_ids;
    assert_eq!(sampled_top1, greedy);

    let cases = [
        (
            SamplingParams {
                top_p: Some(0.0),
                ..Default::default()
            },
            "sampling.top_p",
        ),
        (
            SamplingParams {
                min_p: Some(-0.1),
                ..Default::default()
            },
            "sampling.min_p",
        ),
        (
            SamplingParams {
                repetition_penalty: Some(0.0),
                ..Default::default()
            },
            "sampling.repetition_penalty",
        ),
        (
            SamplingParams {
                top_logprobs: 50,
                ..Default::default()
            },
            "sampling.top_logprobs",
        ),
        (
            SamplingParams {
                top_k: Some(-5),
                ..Default::default()
            },
            "sampling.top_k",
        ),
    ];
    for (sampling, field) in cases {
        assert_invalid_naming(&mut client, sampling, field).await;
    }
    let penalized = SamplingParams {
        temperature: Some(0.0),
        presence_penalty: Some(2.0),
        repetition_penalty: Some(1.5),
        ..Default::default()
    };
    let response = client
        .generate(sampled(PROMPT, 16, penalized))
        .await
        .expect("penalties")
        .into_inner();
    assert_eq!(response.token_ids.len(), 16);
    assert_ne!(
        response.token_ids, greedy,
        "strong penalties change a greedy continuation"
    );
}

/// OpenAI's `logit_bias` and vLLM's `allowed_token_ids` against transformers' own logits
/// processors on the same weights (the bias, then a repetition penalty: vLLM's order), greedy:
/// the same tokens, and logprobs that stay the model's own. The biases come from the unbiased
/// run: its first two tokens banned, its first step's fourth alternative raised.
#[tokio::test(flavor = "multi_thread")]
async fn logit_bias_and_allowed_tokens_choose_what_transformers_processors_choose() {
    const TOKENS: u32 = 12;
    let mut client = shared_server().client().await;
    let greedy_with = |sampling: SamplingParams| {
        sampled(
            PROMPT,
            TOKENS,
            SamplingParams {
                temperature: Some(0.0),
                logprobs: true,
                top_logprobs: 5,
                ..sampling
            },
        )
    };
    let plain = client
        .generate(greedy_with(SamplingParams::default()))
        .await
        .expect("unbiased")
        .into_inner();
    let raised = plain.logprobs[0].top[3].token_id;
    let bias: HashMap<u32, f32> = [
        (plain.token_ids[0], -100.0),
        (plain.token_ids[1], -100.0),
        (raised, 2.5),
    ]
    .into_iter()
    .collect();
    let allowed: Vec<u32> = plain
        .logprobs
        .iter()
        .flat_map(|lp| lp.top.iter().map(|t| t.token_id))
        .collect();
    let prompt_ids = tokio::task::spawn_blocking(|| hf_reference(json!({"task": "tokenize", "texts": [PROMPT]})))
        .await
        .expect("tokenize")["ids"][0]
        .clone();
    let cases = [
        (
            SamplingParams {
                logit_bias: bias.clone(),
                repetition_penalty: Some(1.3),
                ..Default::default()
            },
            json!({"logit_bias": bias, "repetition_penalty": 1.3}),
        ),
        (
            SamplingParams {
                allowed_token_ids: allowed.clone(),
                logit_bias: bias.clone(),
                ..Default::default()
            },
            json!({"allowed_token_ids": allowed, "logit_bias": bias}),
        ),
    ];
    for (sampling, options) in cases {
        let ours = client
            .generate(greedy_with(sampling))
            .await
            .expect("biased")
            .into_inner();
        let mut request = json!({"task": "processed_greedy", "prompt_ids": prompt_ids, "max_new_tokens": TOKENS});
        for (key, value) in options.as_object().expect("options") {
            request[key] = value.clone();
        }
        let reference = tokio::task::spawn_blocking(move || hf_reference(request))
            .await
            .expect("reference");
        let expected: Vec<u32> = serde_json::from_value(reference["output_ids"].clone()).expect("ids");
        assert_eq!(ours.token_ids, expected, "tokens under {options}");
        if let Some(allowed) = options.get("allowed_token_ids") {
            let allowed: Vec<u32> = serde_json::from_value(allowed.clone()).expect("allowed");
            assert!(
                ours.token_ids.iter().all(|t| allowed.contains(t)),
                "{:?}",
                ours.token_ids
            );
        }
        for (i, (lp, theirs)) in ours
            .logprobs
            .iter()
            .zip(reference["logprobs"].as_array().expect("logprobs"))
            .enumerate()
        {
            let theirs = theirs.as_f64().expect("logprob");
            assert!(
                (f64::from(lp.logprob) - theirs).abs() < 1e-3,
                "token {i} under {options}: {} vs {theirs}",
                lp.logprob
            );
        }
    }

    for (sampling, field) in [
        (
            SamplingParams {
                logit_bias: [(1 << 20, 1.0)].into_iter().collect(),
                ..Default::default()
            },
            "sampling.logit_bias",
        ),
        (
            SamplingParams {
                logit_bias: [(5, f32::NAN)].into_iter().collect(),
                ..Default::default()
            },
            "sampling.logit_bias",
        ),
        (
            SamplingParams {
                allowed_token_ids: vec![5, 1 << 20],
                ..Default::default()
            },
            "sampling.allowed_token_ids",
        ),
    ] {
        assert_invalid_naming(&mut client, sampling, field).await;
    }
}

/// vLLM's prompt logprobs: each prompt token's log-probability given the tokens before it, its
/// rank and alternatives, against transformers' log-softmax over the same prompt — on a prompt
/// longer than a step's token budget (so its scores come from several prefill chunks), asked
/// twice (the second time its blocks are in the prefix cache, which such a request must not
/// read: the cache holds no logits) and streamed (the first message carries them alone).
#[tokio::test(flavor = "multi_thread")]
async fn prompt_logprobs_match_transformers_over_chunks_and_skip_the_prefix_cache() {
    const ALTERNATIVES: u32 = 3;
    let mut client = shared_server().client().await;
    let prompt = "The river ran past the mill, and the miller counted the sacks of flour one by one. ".repeat(18);
    let request = sampled(
        &prompt,
        2,
        SamplingParams {
            temperature: Some(0.0),
            prompt_logprobs: Some(ALTERNATIVES),
            ..Default::default()
        },
    );
    let first = client.generate(request.clone()).await.expect("first").into_inner();
    let again = client.generate(request.clone()).await.expect("again").into_inner();
    let usage = again.usage.expect("usage");
    assert!(
        usage.prompt_tokens > 300,
        "{} prompt tokens: not chunked",
        usage.prompt_tokens
    );
    assert_eq!(usage.cached_prompt_tokens, 0, "prompt logprobs read the prefix cache");
    assert_eq!(first.prompt_logprobs.len(), usage.prompt_tokens as usize - 1);
    assert_eq!(
        first.prompt_logprobs, again.prompt_logprobs,
        "the same prompt scored twice"
    );

    let mut stream = client.stream_generate(request).await.expect("stream").into_inner();
    let opening = stream.next().await.expect("a first message").expect("message");
    assert!(opening.token_ids.is_empty() && opening.text.is_empty());
    assert_eq!(opening.prompt_logprobs, first.prompt_logprobs);
    while let Some(message) = stream.next().await {
        assert!(message.expect("message").prompt_logprobs.is_empty(), "scores sent once");
    }

    let text = prompt.clone();
    let prompt_ids: Vec<u32> = serde_json::from_value(
        tokio::task::spawn_blocking(move || hf_reference(json!({"task": "tokenize", "texts": [text]})))
            .await
            .expect("tokenize")["ids"][0]
            .clone(),
    )
    .expect("ids");
    assert_eq!(prompt_ids.len(), usage.prompt_tokens as usize);
    let (head, rest) = (vec![prompt_ids[0]], prompt_ids[1..].to_vec());
    let reference = tokio::task::spawn_blocking(move || {
        hf_reference(json!({"task": "logprobs", "prompt_ids": head, "output_ids": rest, "top": ALTERNATIVES}))
    })
    .await
    .expect("reference");
    let steps = reference["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), first.prompt_logprobs.len());
    for (i, (ours, theirs)) in first.prompt_logprobs.iter().zip(steps).enumerate() {
        assert_eq!(
            ours.token_id,
            prompt_ids[i + 1],
            "entry {i} scores prompt token {}",
            i + 1
        );
        let expected = theirs["logprob"].as_f64().expect("logprob");
        assert!(
            (f64::from(ours.logprob) - expected).abs() < 1e-3,
            "prompt token {}: {} vs {expected}",
            i + 1,
            ours.logprob
        );
        let top_values: Vec<f64> = serde_json::from_value(theirs["top_values"].clone()).expect("values");
        assert_eq!(ours.top.len(), ALTERNATIVES as usize);
        for (k, alternative) in ours.top.iter().enumerate() {
            assert!(
                (f64::from(alternative.logprob) - top_values[k]).abs() < 1e-3,
                "token {} rank {k}",
                i + 1
            );
        }
        // The rank counts the tokens at least as likely: 1 for the likeliest, and where the token
        // is among the listed alternatives, its place there.
        assert!(ours.rank >= 1);
        let likelier = top_values.iter().filter(|&&v| v > expected + 1e-3).count() as u32;
        if (likelier as usize) < top_values.len() {
            assert!(
                ours.rank > likelier && ours.rank <= likelier + 2,
                "prompt token {}: rank {} with {likelier} likelier alternatives",
                i + 1,
                ours.rank
            );
        } else {
            assert!(ours.rank > ALTERNATIVES, "prompt token {}: rank {}", i + 1, ours.rank);
        }
    }

    assert_invalid_naming(
        &mut client,
        SamplingParams {
            prompt_logprobs: Some(21),
            ..Default::default()
        },
        "sampling.prompt_logprobs",
    )
    .await;
}

/// Structured outputs (a choice, regular expressions) choose what transformers chooses when each
/// step may take only the tokens that the `regex` package's partial matching says keep the text a
/// possible match, and EOS only where the text matches whole; a JSON schema's output parses and
/// holds its schema; what cannot be compiled or combined is refused naming the field.
#[tokio::test(flavor = "multi_thread")]
async fn structured_outputs_choose_what_transformers_chooses_under_the_same_constraint() {
    use rivulet::proto::structured_output::Kind;
    use rivulet::proto::{Choices, FinishReason, StoppingCriteria, StructuredOutput};

    const TOKENS: u32 = 24;
    let mut client = shared_server().client().await;
    let chat = |question: &str| format!("<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n");
    let output = |kind: Kind| StructuredOutput {
        kind: Some(kind),
        whitespace_pattern: None,
    };
    let guided = |prompt_ids: Vec<u32>, output: StructuredOutput| GenerateRequest {
        prompt_token_ids: prompt_ids,
        sampling: Some(SamplingParams {
            temperature: Some(0.0),
            structured_output: Some(output),
            ..Default::default()
        }),
        stopping: Some(StoppingCriteria {
            max_new_tokens: Some(TOKENS),
            ..Default::default()
        }),
        ..Default::default()
    };
    // Narrow constraints: the reference tests every token under each live prefix with Python's
    // `regex`, which over `[a-z]+` would take seconds a step.
    let months = "(January|February|March|April|May|June|July|August|September|October|November|December)";
    // (question, the request's structured output, the same constraint as a `regex` pattern)
    let cases = [
        (
            "What is the capital of France?",
            Kind::Choice(Choices {
                choices: ["Paris", "London", "Berlin", "Madrid"].map(String::from).to_vec(),
            }),
            "Paris|London|Berlin|Madrid".to_owned(),
        ),
        (
            "How many legs does a spider have?",
            Kind::Regex("[0-9]{1,2} legs".into()),
            "[0-9]{1,2} legs".to_owned(),
        ),
        (
            "When did people first walk on the moon?",
            Kind::Regex(format!("{months} [0-9]{{1,2}}, [0-9]{{4}}")),
            format!("{months} [0-9]{{1,2}}, [0-9]{{4}}"),
        ),
        (
            "Name two colours of the French flag.",
            Kind::Regex("- (red|white|blue|green)\n- (red|white|blue|green)".into()),
            "- (red|white|blue|green)\n- (red|white|blue|green)".to_owned(),
        ),
    ];
    let texts: Vec<String> = cases.iter().map(|(question, _, _)| chat(question)).collect();
    let tokenized = tokio::task::spawn_blocking(move || hf_reference(json!({"task": "tokenize", "texts": texts})))
        .await
        .expect("tokenize");
    let prompt_ids: Vec<Vec<u32>> = serde_json::from_value(tokenized["ids"].clone()).expect("ids");
    let reference_cases: Vec<_> = cases
        .iter()
        .zip(&prompt_ids)
        .map(|((_, _, pattern), ids)| json!({"prompt_ids": ids, "pattern": pattern}))
        .collect();
    let reference = tokio::task::spawn_blocking(move || {
        hf_reference(json!({"task": "guided_greedy", "cases": reference_cases, "max_new_tokens": TOKENS}))
    })
    .await
    .expect("reference");
    let eos = reference["eos_token_id"].as_u64().expect("eos") as u32;
    let expected: Vec<Vec<u32>> = serde_json::from_value(reference["results"].clone()).expect("results");
    for (((question, kind, _), ids), expected) in cases.into_iter().zip(prompt_ids).zip(expected) {
        let ours = client
            .generate(guided(ids, output(kind)))
            .await
            .expect("guided")
            .into_inner();
        let mut tokens = ours.token_ids.clone();
        if expected.len() < TOKENS as usize {
            assert_eq!(
                ours.finish_reason(),
                FinishReason::EosToken,
                "{question}: {}",
                ours.text
            );
            assert_eq!(tokens.pop(), Some(eos), "{question}");
        }
        assert_eq!(tokens, expected, "{question}: {:?}", ours.text);
    }

    let schema = json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "country": {"enum": ["France", "Germany", "Italy", "Spain"]},
            "population_millions": {"type": "number"},
            "capital": {"type": "boolean"}
        },
        "required": ["city", "country", "population_millions", "capital"]
    });
    let described = client
        .generate(GenerateRequest {
            prompt: chat("Describe Paris as JSON."),
            stopping: Some(StoppingCriteria {
                max_new_tokens: Some(96),
                ..Default::default()
            }),
            ..guided(Vec::new(), output(Kind::JsonSchema(schema.to_string())))
        })
        .await
        .expect("a JSON schema's output")
        .into_inner();
    assert_eq!(described.finish_reason(), FinishReason::EosToken, "{}", described.text);
    let value: serde_json::Value = serde_json::from_str(&described.text).expect("the output is JSON");
    let keys: Vec<&str> = value
        .as_object()
        .expect("an object")
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(keys, ["city", "country", "population_millions", "capital"], "{value}");
    assert!(
        value["city"].as_str().is_some_and(|city| city.chars().count() <= 24),
        "{value}"
    );
    assert!(["France", "Germany", "Italy", "Spain"].contains(&value["country"].as_str().unwrap_or("")));
    assert!(
        value["population_millions"].is_number() && value["capital"].is_boolean(),
        "{value}"
    );

    for (sampling, field) in [
        (
            SamplingParams {
                structured_output: Some(output(Kind::Regex("(unclosed".into()))),
                ..Default::default()
            },
            "sampling.structured_output",
        ),
        (
            SamplingParams {
                structured_output: Some(output(Kind::Choice(Choices::default()))),
                ..Default::default()
            },
            "sampling.structured_output",
        ),
        (
            SamplingParams {
                structured_output: Some(output(Kind::Regex("[a-z]+".into()))),
                allowed_token_ids: vec![1, 2, 3],
                ..Default::default()
            },
            "sampling.structured_output",
        ),
        (
            SamplingParams {
                structured_output: Some(StructuredOutput::default()),
                ..Default::default()
            },
            "sampling.structured_output",
        ),
    ] {
        assert_invalid_naming(&mut client, sampling, field).await;
    }
}
