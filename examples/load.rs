//! A small load client: N concurrent greedy `StreamGenerate` calls with `ignore_eos`, reporting
//! output tokens per second and mean time to first token. (The full serving benchmark is
//! `rivulet-bench`'s job; this is a quick check.)
//!
//! `cargo run --release --example load -- http://127.0.0.1:50051 16 64`

use std::time::{Duration, Instant};

use futures::future::join_all;
use rivulet::proto::generation_client::GenerationClient;
use rivulet::proto::{GenerateRequest, SamplingParams, StoppingCriteria};
use tokio_stream::StreamExt;

const PROMPTS: &[&str] = &[
    "The history of the river begins",
    "def quicksort(items):",
    "<|im_start|>user\nTell me about the ocean.<|im_end|>\n<|im_start|>assistant\n",
    "In the year 2050, cities will",
];

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let address = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| "http://127.0.0.1:50051".to_owned());
    let concurrency: usize = args.get(2).map_or(Ok(1), |s| s.parse())?;
    let max_new_tokens: u32 = args.get(3).map_or(Ok(64), |s| s.parse())?;
    let channel = tonic::transport::Endpoint::from_shared(address)?.connect().await?;

    let started = Instant::now();
    let results = join_all((0..concurrency).map(|i| {
        let mut client = GenerationClient::new(channel.clone());
        async move {
            let request = GenerateRequest {
                prompt: PROMPTS[i % PROMPTS.len()].to_owned(),
                sampling: Some(SamplingParams {
                    temperature: Some(0.0),
                    ..Default::default()
                }),
                stopping: Some(StoppingCriteria {
                    max_new_tokens: Some(max_new_tokens),
                    ignore_eos: true,
                    ..Default::default()
                }),
                ..Default::default()
            };
            let sent = Instant::now();
            let mut stream = client.stream_generate(request).await?.into_inner();
            let (mut first_token, mut tokens) = (None::<Duration>, 0usize);
            while let Some(message) = stream.next().await {
                let message = message?;
                if !message.token_ids.is_empty() && first_token.is_none() {
                    first_token = Some(sent.elapsed());
                }
                tokens += message.token_ids.len();
            }
            Ok::<_, anyhow::Error>((tokens, first_token.unwrap_or_default()))
        }
    }))
    .await;
    let elapsed = started.elapsed();
    let mut total_tokens = 0;
    let mut ttft = Duration::ZERO;
    for result in &results {
        let (tokens, first) = result.as_ref().map_err(|e| anyhow::anyhow!("{e}"))?;
        total_tokens += tokens;
        ttft += *first;
    }
    println!(
        "concurrency {concurrency}: {total_tokens} tokens in {:.2}s = {:.1} output tokens/s, mean TTFT {:.0} ms",
        elapsed.as_secs_f64(),
        total_tokens as f64 / elapsed.as_secs_f64(),
        ttft.as_secs_f64() * 1000.0 / concurrency as f64
    );
    Ok(())
}
