//! `worker.half_precision_gemv` (f16 weight copies for one-token steps) checked against the f32
//! weights on the real model: the same greedy tokens except where f32 itself saw a near-tie, and
//! the chosen tokens' log-probabilities within f16's rounding; and, since that flag runs the
//! libtorch engine, its prompt logprobs (prefill rows, f32) against the CPU kernels'.

mod common;

use common::{greedy_request, TestServer};
use rivulet::proto::GenerateResponse;

const PROMPTS: &[&str] = &[
    "The history of the river begins",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colors are",
];
const TOKENS: u32 = 24;

async fn generate_with_logprobs(server: &TestServer, prompt: &str) -> GenerateResponse {
    let mut request = greedy_request(prompt, TOKENS);
    if let Some(sampling) = request.sampling.as_mut() {
        sampling.logprobs = true;
        sampling.top_logprobs = 2;
    }
    server
        .client()
        .await
        .generate(request)
        .await
        .expect("generate")
        .into_inner()
}

#[tokio::test]
async fn half_precision_gemv_matches_f32_up_to_near_ties_and_its_engine_scores_prompts_alike() {
    let f32_server = common::shared_server();
    let half_server = TestServer::start(&[("RIVULET_WORKER__HALF_PRECISION_GEMV", "true")]);
    let mut identical = 0;
    for prompt in PROMPTS {
        // One request at a time, so every decode step has one token and takes the f16 path.
        let reference = generate_with_logprobs(f32_server, prompt).await;
        let half = generate_with_logprobs(&half_server, prompt).await;
        let agreed = reference
            .token_ids
            .iter()
            .zip(&half.token_ids)
            .take_while(|(a, b)| a == b)
            .count();
        for i in 0..agreed {
            let (a, b) = (reference.logprobs[i].logprob, half.logprobs[i].logprob);
            assert!(
                (a - b).abs() < 0.05,
                "{prompt:?} token {i}: logprob {a} (f32) vs {b} (f16)"
            );
        }
        if agreed == reference.token_ids.len() {
            identical += 1;
            continue;
        }
        // They parted: only where f32's two best tokens were nearly tied, and f16 took the other.
        let top = &reference.logprobs[agreed].top;
        let gap = top[0].logprob - top[1].logprob;
        assert!(
            gap < 0.1 && half.token_ids[agreed] == top[1].token_id,
            "{prompt:?} diverged at token {agreed} where f32 was not near a tie (gap {gap})"
        );
    }
    assert!(
        identical * 2 >= PROMPTS.len(),
        "only {identical} of {} prompts identical",
        PROMPTS.len()
    );
    // The same server, to start one libtorch worker for both checks.
    assert_prompt_logprobs_agree(f32_server, &half_server).await;
}

/// The libtorch engine scores a prompt (its multi-token steps stay f32) as the CPU kernels do.
async fn assert_prompt_logprobs_agree(kernels: &TestServer, libtorch: &TestServer) {
    let mut request = greedy_request(PROMPTS[4], 2);
    if let Some(sampling) = request.sampling.as_mut() {
        sampling.prompt_logprobs = Some(2);
    }
    let mut scored = Vec::new();
    for server in [kernels, libtorch] {
        let response = server.client().await.generate(request.clone()).await.expect("generate");
        scored.push(response.into_inner().prompt_logprobs);
    }
    let (ours, theirs) = (&scored[0], &scored[1]);
    assert!(
        ours.len() > 5 && ours.len() == theirs.len(),
        "{} vs {} scores",
        ours.len(),
        theirs.len()
    );
    for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
        assert_eq!(a.token_id, b.token_id, "entry {i}");
        assert!(
            (a.logprob - b.logprob).abs() < 1e-3,
            "entry {i}: {} vs {}",
            a.logprob,
            b.logprob
        );
        assert_eq!(b.top.len(), 2, "entry {i}");
        assert!(
            (a.top[0].logprob - b.top[0].logprob).abs() < 1e-3,
            "entry {i}'s likeliest"
        );
    }
}
