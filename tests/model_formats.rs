//! Model formats and chat: the default model saved as a Hugging Face folder (config.json,
//! safetensors, tokenizer files; made at test time from transformers' own dequantization) gives
//! the same greedy output as the GGUF file, and chat `messages` render through the model's
//! template.

mod common;

use common::{greedy_request, hf_reference, TestServer};
use rivulet::proto::{ChatMessage, GenerateRequest};
use serde_json::json;
use tonic::Code;

#[tokio::test(flavor = "multi_thread")]
async fn a_hugging_face_folder_gives_the_same_greedy_output_as_the_gguf_file() {
    let folder = std::env::temp_dir().join(format!("rivulet-hf-folder-{}", std::process::id()));
    let out_dir = folder.display().to_string();
    tokio::task::spawn_blocking(move || hf_reference(json!({"task": "save_hf_folder", "out_dir": out_dir})))
        .await
        .expect("fixture");
    let folder_path = folder.display().to_string();
    let from_folder = TestServer::start(&[("RIVULET_MODEL__PATH", folder_path.as_str())]);
    let from_gguf = TestServer::start(&[]);

    let prompts = [
        "The capital of France is",
        "def add(a, b):\n",
        "Once upon a time, in a small village,",
    ];
    let (mut folder_client, mut gguf_client) = (from_folder.client().await, from_gguf.client().await);
    for prompt in prompts {
        let a = folder_client
            .generate(greedy_request(prompt, 24))
            .await
            .expect("folder")
            .into_inner();
        let b = gguf_client
            .generate(greedy_request(prompt, 24))
            .await
            .expect("gguf")
            .into_inner();
        assert_eq!(
            a.usage.map(|u| u.prompt_tokens),
            b.usage.map(|u| u.prompt_tokens),
            "same tokenization"
        );
        assert_eq!(a.token_ids, b.token_ids, "greedy output for {prompt:?}");
        assert_eq!(a.text, b.text);
    }

    // Chat messages go through each model's own template: the same conversation, the same output.
    let chat = GenerateRequest {
        messages: vec![ChatMessage {
            role: "user".to_owned(),
            content: "What is 2+2?".to_owned(),
        }],
        ..greedy_request("", 16)
    };
    let a = folder_client
        .generate(chat.clone())
        .await
        .expect("folder chat")
        .into_inner();
    let b = gguf_client
        .generate(chat.clone())
        .await
        .expect("gguf chat")
        .into_inner();
    assert_eq!(a.token_ids, b.token_ids);
    let _ = std::fs::remove_dir_all(folder);
}

#[tokio::test(flavor = "multi_thread")]
async fn chat_messages_render_with_the_models_template() {
    let server = common::shared_server();
    let mut client = server.client().await;
    let messages = vec![ChatMessage {
        role: "user".to_owned(),
        content: "Name a color.".to_owned(),
    }];
    let chat = GenerateRequest {
        messages,
        ..greedy_request("", 12)
    };
    let rendered =
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
                    <|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n";
    let by_messages = client.generate(chat.clone()).await.expect("chat").into_inner();
    let by_prompt = client
        .generate(greedy_request(rendered, 12))
        .await
        .expect("prompt")
        .into_inner();
    assert_eq!(
        by_messages.usage.map(|u| u.prompt_tokens),
        by_prompt.usage.map(|u| u.prompt_tokens)
    );
    assert_eq!(by_messages.token_ids, by_prompt.token_ids);

    let both = GenerateRequest {
        prompt: "Hi".to_owned(),
        ..chat.clone()
    };
    let status = client.generate(both).await.expect_err("prompt and messages");
    assert_eq!(status.code(), Code::InvalidArgument);
    let bad_role = GenerateRequest {
        messages: vec![ChatMessage {
            role: "wizard".to_owned(),
            content: "Hi".to_owned(),
        }],
        ..greedy_request("", 4)
    };
    let status = client.generate(bad_role).await.expect_err("unknown role");
    assert!(status.message().starts_with("messages"), "{}", status.message());
}
