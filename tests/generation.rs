//! End to end on the real model: `rivulet-scheduler` + `rivulet-worker` processes, gRPC over
//! 127.0.0.1, checked against Hugging Face `transformers` on the same GGUF file.

mod common;

use common::{greedy_request, hf_reference, shared_server};
use futures::future::join_all;
use rivulet::proto::{ChatMessage, FinishReason, GenerateRequest, StoppingCriteria};
use serde_json::json;
use tokio_stream::StreamExt;
use tonic::Code;

const REFERENCE_TOKENS: u32 = 32;

fn varied_prompts() -> Vec<String> {
    vec![
        "The capital of France is".to_owned(),
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n".to_owned(),
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n".to_owned(),
        "Count: 1, 2, 3, 4, 5,".to_owned(),
        "Les fleurs du jardin sont très belles, et le café — naturellement —".to_owned(),
        "In 1969, Apollo 11 landed on the Moon. The astronauts were".to_owned(),
        "Once upon a time".to_owned(),
        "SELECT name, COUNT(*) FROM users WHERE".to_owned(),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn greedy_continuations_match_transformers_token_for_token() {
    let prompts = varied_prompts();
    let reference = tokio::task::spawn_blocking({
        let prompts = prompts.clone();
        move || hf_reference(json!({"task": "greedy", "prompts": prompts, "max_new_tokens": REFERENCE_TOKENS}))
    })
    .await
    .expect("reference");
    let mut client = shared_server().client().await;
    for (prompt, expected) in prompts.iter().zip(reference["results"].as_array().expect("results")) {
        let expected_prompt: Vec<u32> = serde_json::from_value(expected["prompt_ids"].clone()).expect("ids");
        let expected_output: Vec<u32> = serde_json::from_value(expected["output_ids"].clone()).expect("ids");
        let response = client
            .generate(greedy_request(prompt, REFERENCE_TOKENS))
            .await
            .expect("generate")
            .into_inner();
        let usage = response.usage.expect("usage");
        assert_eq!(
            usage.prompt_tokens as usize,
            expected_prompt.len(),
            "prompt token count for {prompt:?}"
        );
        assert_eq!(response.token_ids, expected_output, "greedy tokens for {prompt:?}");
        assert_eq!(usage.completion_tokens, REFERENCE_TOKENS);
        assert_eq!(response.finish_reason(), FinishReason::MaxTokens);

        // The same prompt given as token ids gives the same continuation.
        let by_ids = GenerateRequest {
            prompt: String::new(),
            prompt_token_ids: expected_prompt,
            ..greedy_request("", REFERENCE_TOKENS)
        };
        let response = client.generate(by_ids).await.expect("generate by ids").into_inner();
        assert_eq!(
            response.token_ids, expected_output,
            "greedy tokens from prompt_token_ids for {prompt:?}"
        );
    }
}

/// vLLM's chat options against transformers' `apply_chat_template` with the same flags: the
/// conversation as messages gives the tokens the reference's rendered prompt gives as token ids,
/// and the same prompt length; an explicit conflict is refused naming the field. Besides each
/// ending of one conversation: an empty and a blank last message continued (their turn left
/// open), and the `developer` role as vLLM hands it to a template that does not name it
/// (SmolLM2's): renamed `system`, system messages merged at the front — the reference is given
/// that conversation.
#[tokio::test(flavor = "multi_thread")]
async fn chat_endings_render_as_transformers_renders_them() {
    let conversation = json!([
        {"role": "user", "content": "Name three colours."},
        {"role": "assistant", "content": "Sure! The three colours are"},
    ]);
    // (sent, what transformers is given, add_generation_prompt, continue_final_message)
    let mut cases: Vec<(serde_json::Value, serde_json::Value, Option<bool>, bool)> =
        [(None, false), (Some(false), false), (None, true)]
            .into_iter()
            .map(|(add, continuing)| (conversation.clone(), conversation.clone(), add, continuing))
            .collect();
    for blank in ["", "  "] {
        let messages = json!([{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": blank}]);
        cases.push((messages.clone(), messages, None, true));
    }
    cases.push((
        json!([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]),
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]),
        None,
        false,
    ));
    cases.push((
        json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi!"},
            {"role": "developer", "content": "Answer in French."},
        ]),
        json!([{"role": "system", "content": "Be brief.\n\nAnswer in French."}, {"role": "user", "content": "Hi!"}]),
        None,
        false,
    ));
    let mut client = shared_server().client().await;
    for (sent, reference_messages, add_generation_prompt, continue_final_message) in cases {
        let as_proto = proto_messages(&sent);
        let reference = tokio::task::spawn_blocking({
            let messages = reference_messages;
            move || {
                hf_reference(json!({
                    "task": "chat_prompt_ids",
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt.unwrap_or(!continue_final_message),
                    "continue_final_message": continue_final_message,
                }))
            }
        })
        .await
        .expect("reference");
        let reference_ids: Vec<u32> = serde_json::from_value(reference["ids"].clone()).expect("ids");
        let case = format!(
            "add_generation_prompt {add_generation_prompt:?}, continue_final_message {continue_final_message}: {:?}",
            reference["text"]
        );
        let by_messages = client
            .generate(GenerateRequest {
                prompt: String::new(),
                messages: as_proto,
                add_generation_prompt,
                continue_final_message,
                ..greedy_request("", 12)
            })
            .await
            .expect("generate from messages")
            .into_inner();
        let by_ids = client
            .generate(GenerateRequest {
                prompt: String::new(),
                prompt_token_ids: reference_ids.clone(),
                ..greedy_request("", 12)
            })
            .await
            .expect("generate from the reference's ids")
            .into_inner();
        assert_eq!(
            by_messages.usage.map(|u| u.prompt_tokens as usize),
            Some(reference_ids.len()),
            "{case}"
        );
        assert_eq!(by_messages.token_ids, by_ids.token_ids, "{case}");
    }
    let conflict = client
        .generate(GenerateRequest {
            prompt: String::new(),
            messages: proto_messages(&conversation),
            add_generation_prompt: Some(true),
            continue_final_message: true,
            ..greedy_request("", 4)
        })
        .await
        .expect_err("both flags");
    assert_eq!(conflict.code(), Code::InvalidArgument);
    assert!(conflict.message().starts_with("continue_final_message"), "{conflict:?}");
}

/// `[{"role": …, "content": …}]` as the gRPC request's messages.
fn proto_messages(messages: &serde_json::Value) -> Vec<ChatMessage> {
    messages
        .as_array()
        .expect("an array of messages")
        .iter()
        .map(|m| ChatMessage {
            role: m["role"].as_str().expect("role").to_owned(),
            content: m["content"].as_str().expect("content").to_owned(),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_requests_give_the_same_tokens_as_each_alone() {
    let server = shared_server();
    let prompts = varied_prompts();
    let mut client = server.client().await;
    let mut alone = Vec::new();
    for prompt in &prompts {
        alone.push(
            client
                .generate(greedy_request(prompt, 24))
                .await
                .expect("alone")
                .into_inner()
                .token_ids,
        );
    }
    let together = join_all(prompts.iter().map(|prompt| async move {
        let mut client = server.client().await;
        client
            .generate(greedy_request(prompt, 24))
            .await
            .expect("together")
            .into_inner()
            .token_ids
    }))
    .await;
    for ((prompt, alone), together) in prompts.iter().zip(alone).zip(together) {
        assert_eq!(alone.len(), 24);
        assert_eq!(together, alone, "batched output differs for {prompt:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn streamed_deltas_concatenate_to_the_unary_result() {
    let mut client = shared_server().client().await;
    for prompt in [
        "Write a haiku about rivers:",
        "日本の首都は",
        "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n",
    ] {
        let mut request = greedy_request(prompt, 40);
        request.stopping = Some(StoppingCriteria {
            max_new_tokens: Some(40),
            ignore_eos: false,
            ..Default::default()
        });
        let unary = client.generate(request.clone()).await.expect("unary").into_inner();

        let mut stream = client.stream_generate(request).await.expect("stream").into_inner();
        let (mut text, mut ids, mut messages) = (String::new(), Vec::new(), Vec::new());
        while let Some(message) = stream.next().await {
            let message = message.expect("stream message");
            text.push_str(&message.text);
            ids.extend_from_slice(&message.token_ids);
            messages.push(message);
        }
        let last = messages.last().expect("at least one message");
        assert_eq!(text, unary.text, "streamed text for {prompt:?}");
        assert_eq!(ids, unary.token_ids);
        assert_eq!(last.finish_reason(), unary.finish_reason());
        assert_ne!(last.finish_reason(), FinishReason::Unspecified);
        assert_eq!(last.usage, unary.usage);
        assert!(messages[..messages.len() - 1]
            .iter()
            .all(|m| m.finish_reason() == FinishReason::Unspecified && m.usage.is_none()));
        assert!(
            !unary.text.contains('\u{FFFD}'),
            "half a character reached the client: {:?}",
            unary.text
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn generation_stops_at_the_models_end_of_sequence_token() {
    let prompts: Vec<String> = ["What is the capital of France?", "What is 2+2?", "Hi!", "Name a fruit."]
        .iter()
        .map(|question| format!("<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"))
        .collect();
    let reference = tokio::task::spawn_blocking({
        let prompts = prompts.clone();
        move || hf_reference(json!({"task": "greedy", "prompts": prompts, "max_new_tokens": 48}))
    })
    .await
    .expect("reference");
    let eos: u32 = serde_json::from_value(reference["eos_token_id"].clone()).expect("eos id");
    let mut client = shared_server().client().await;
    let mut stopped_at_eos = 0;
    for (prompt, expected) in prompts.iter().zip(reference["results"].as_array().expect("results")) {
        let full: Vec<u32> = serde_json::from_value(expected["output_ids"].clone()).expect("ids");
        let mut request = greedy_request(prompt, 48);
        request.stopping = Some(StoppingCriteria {
            max_new_tokens: Some(48),
            ignore_eos: false,
            ..Default::default()
        });
        let response = client.generate(request).await.expect("generate").into_inner();
        match full.iter().position(|&t| t == eos) {
            Some(at) => {
                stopped_at_eos += 1;
                assert_eq!(response.token_ids, full[..=at], "output up to EOS for {prompt:?}");
                assert_eq!(response.finish_reason(), FinishReason::EosToken);
                assert!(
                    !response.text.contains("<|im_end|>"),
                    "the EOS token's text is not part of the output"
                );
                // Before min_new_tokens EOS is never chosen (vLLM's min_tokens): the same
                // tokens up to it, then something else, and no EOS among the first `min`.
                let min = at + 4;
                let mut request = greedy_request(prompt, 48);
                request.stopping = Some(StoppingCriteria {
                    max_new_tokens: Some(48),
                    min_new_tokens: min as u32,
                    ..Default::default()
                });
                let longer = client.generate(request).await.expect("generate").into_inner();
                assert_eq!(longer.token_ids[..at], full[..at], "{prompt:?} before EOS");
                assert!(longer.token_ids.len() >= min, "{prompt:?}: {:?}", longer.token_ids);
                assert!(
                    !longer.token_ids[..min].contains(&eos),
                    "{prompt:?}: {:?}",
                    longer.token_ids
                );
            }
            None => {
                assert_eq!(response.token_ids, full, "output for {prompt:?}");
                assert_eq!(response.finish_reason(), FinishReason::MaxTokens);
            }
        }
    }
    assert!(
        stopped_at_eos > 0,
        "no prompt reached EOS in the reference; the test proves nothing"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_is_invalid_argument_naming_the_field_and_the_server_keeps_serving() {
    let mut client = shared_server().client().await;
    let long_prompt = "word ".repeat(3000);
    let cases: Vec<(GenerateRequest, &str)> = vec![
        (GenerateRequest::default(), "prompt"),
        (greedy_request("", 8), "prompt"),
        (greedy_request(&long_prompt, 8), "prompt"),
        (greedy_request("Hello", 0), "stopping.max_new_tokens"),
        (greedy_request("Hello", 5000), "stopping.max_new_tokens"),
        (
            GenerateRequest {
                prompt_token_ids: vec![1, 999_999],
                ..greedy_request("", 8)
            },
            "prompt_token_ids",
        ),
        (
            GenerateRequest {
                prompt_token_ids: vec![1, 2],
                ..greedy_request("Hello", 8)
            },
            "prompt",
        ),
        (
            GenerateRequest {
                sampling: Some(rivulet::proto::SamplingParams {
                    temperature: Some(-1.0),
                    ..Default::default()
                }),
                ..greedy_request("Hi", 8)
            },
            "sampling.temperature",
        ),
        (
            GenerateRequest {
                stopping: Some(StoppingCriteria {
                    max_new_tokens: Some(8),
                    stop_token_ids: (0..17).collect(),
                    ..Default::default()
                }),
                ..greedy_request("Hi", 8)
            },
            "stopping.stop_token_ids",
        ),
    ];
    for (request, field) in cases {
        let status = client.generate(request.clone()).await.expect_err("must be rejected");
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().starts_with(field),
            "message {:?} should name {field}",
            status.message()
        );
        let status = client.stream_generate(request).await.expect_err("must be rejected");
        assert_eq!(status.code(), Code::InvalidArgument);
    }
    let response = client
        .generate(greedy_request("Hello", 4))
        .await
        .expect("a good request still works")
        .into_inner();
    assert_eq!(response.token_ids.len(), 4);
}

/// The services a server reflection client of protocol `$version` lists.
macro_rules! reflected_services {
    ($version:ident, $address:expr) => {{
        use tonic_reflection::pb::$version::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::$version::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::$version::server_reflection_response::MessageResponse;
        use tonic_reflection::pb::$version::ServerReflectionRequest;
        let channel = tonic::transport::Channel::from_shared(format!("http://{}", $address))
            .expect("address")
            .connect()
            .await
            .expect("connect reflection");
        let mut client = ServerReflectionClient::new(channel);
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut responses = client
            .server_reflection_info(tokio_stream::once(request))
            .await
            .expect("reflection call")
            .into_inner();
        let response = responses.next().await.expect("an answer").expect("ok");
        match response.message_response {
            Some(MessageResponse::ListServicesResponse(list)) => {
                list.service.into_iter().map(|s| s.name).collect::<Vec<String>>()
            }
            other => panic!("not a service list: {other:?}"),
        }
    }};
}

#[tokio::test(flavor = "multi_thread")]
async fn reflection_v1_and_v1alpha_both_list_the_services() {
    let server = shared_server();
    let v1 = reflected_services!(v1, server.address);
    let v1alpha = reflected_services!(v1alpha, server.address);
    let admin_v1 = reflected_services!(v1, server.admin_address);
    let admin_v1alpha = reflected_services!(v1alpha, server.admin_address);
    // Each listener lists exactly what it serves: the Admin service only on its own listener.
    for (services, expected) in [
        (&v1, "rivulet.v1.Generation"),
        (&v1alpha, "rivulet.v1.Generation"),
        (&admin_v1, "rivulet.v1.Admin"),
        (&admin_v1alpha, "rivulet.v1.Admin"),
    ] {
        let mut sorted = services.clone();
        sorted.sort();
        let mut want = vec![expected.to_owned(), "grpc.health.v1.Health".to_owned()];
        want.sort();
        assert_eq!(sorted, want);
    }
}
