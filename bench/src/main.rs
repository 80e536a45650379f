//! `rivulet-bench`: a serving benchmark after vLLM's `benchmark_serving`, for Rivulet's gRPC API and
//! any OpenAI-compatible `/v1/completions` server, so one tool measures both sides of a comparison.
//!
//! ```text
//! rivulet-bench run --backend rivulet --url http://127.0.0.1:50051 --num-prompts 64 --max-concurrency 8 --ignore-eos
//! rivulet-bench run --backend openai --url http://127.0.0.1:8080 --num-prompts 64 --max-concurrency 8 --ignore-eos
//! rivulet-bench compare --left rivulet=a.jsonl --right llama-server=b.jsonl
//! rivulet-bench wait-ready --admin-url http://127.0.0.1:50052 --replicas 2
//! ```

mod arrivals;
mod backend;
mod compare;
mod dataset;
mod metrics;
mod report;
mod runner;
mod server_stats;

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use rivulet_text::tokenizer::ModelTokenizer;
use serde::Serialize;

use crate::arrivals::{arrival_offsets, RequestRate};
use crate::backend::{Backend, OpenAiBackend, RequestSettings, RivuletBackend};
use crate::dataset::{BenchRequest, RandomSpec, SharedPrefixSpec};
use crate::metrics::Summary;
use crate::runner::RunOptions;

#[derive(Parser)]
#[command(version, about = "Serving benchmark for Rivulet and OpenAI-compatible servers")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one workload against one server and report its figures.
    Run(Box<RunArgs>),
    /// Print two sets of runs side by side (each the mean of its rounds) with their ratio.
    Compare(compare::CompareArgs),
    /// Wait until a Rivulet server has this many worker replicas ready (its port opens before).
    WaitReady(server_stats::WaitReadyArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum BackendKind {
    /// Rivulet's gRPC `StreamGenerate`.
    Rivulet,
    /// An OpenAI-compatible `/v1/completions` server (`stream: true`).
    Openai,
}

#[derive(Clone, Copy, Debug, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum DatasetKind {
    /// Prompts of random real tokens with the given input/output lengths.
    Random,
    /// Groups of prompts that share a long prefix.
    SharedPrefix,
    /// Prompts read from `--dataset-path` (JSON Lines with `prompt`, or one prompt per line).
    File,
}

#[derive(clap::Args, Debug, Serialize)]
struct RunArgs {
    #[arg(long, value_enum, default_value = "rivulet")]
    backend: BackendKind,
    /// Server address; defaults to http://127.0.0.1:50051 (rivulet) or http://127.0.0.1:8080 (openai).
    #[arg(long)]
    url: Option<String>,
    /// Rivulet's Admin address (server.admin_listen): when given, the run also reports Rivulet's
    /// own step timings, whichever front it drives.
    #[arg(long)]
    admin_url: Option<String>,
    /// The `model` field of OpenAI requests (left out when not given: the server's own model).
    #[arg(long)]
    model_name: Option<String>,
    /// Tokenizer for building prompts and counting their tokens: a GGUF file or a Hugging Face folder.
    #[arg(long, default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    tokenizer: PathBuf,
    #[arg(long, value_enum, default_value = "random")]
    dataset: DatasetKind,
    #[arg(long)]
    dataset_path: Option<PathBuf>,
    #[arg(long, default_value_t = 100, value_parser = positive::<usize>)]
    num_prompts: usize,
    #[arg(long, default_value_t = 128, value_parser = positive::<u32>)]
    random_input_len: u32,
    /// Output tokens asked of each request (all datasets; a file line's `max_tokens` wins).
    #[arg(long, default_value_t = 128, value_parser = positive::<u32>)]
    random_output_len: u32,
    /// Lengths are drawn uniformly from [len·(1−r), len·(1+r)], r in [0, 1).
    #[arg(long, default_value_t = 0.0, value_parser = range_ratio)]
    random_range_ratio: f64,
    #[arg(long, default_value_t = 4)]
    num_prefix_groups: usize,
    #[arg(long, default_value_t = 512)]
    prefix_len: u32,
    #[arg(long, default_value_t = 32)]
    suffix_len: u32,
    /// Requests per second (`inf`: all at once, paced by --max-concurrency only).
    #[arg(long, default_value = "inf")]
    request_rate: RequestRate,
    /// Most requests in flight at once.
    #[arg(long, value_parser = positive::<usize>)]
    max_concurrency: Option<usize>,
    /// Seed of the dataset and of the Poisson arrivals.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Ask the server to ignore EOS, so every request generates exactly its output length.
    #[arg(long)]
    ignore_eos: bool,
    /// Sampling temperature of every request (0: greedy, the default here; OpenAI clients and
    /// Rivulet's own API default to 1).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling's probability mass (unset: the server's default).
    #[arg(long)]
    top_p: Option<f32>,
    /// Keep the k most likely tokens (unset: the server's default).
    #[arg(long)]
    top_k: Option<i32>,
    /// Penalties of every request (unset: the server's defaults).
    #[arg(long)]
    frequency_penalty: Option<f32>,
    #[arg(long)]
    presence_penalty: Option<f32>,
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// Append the run's figures as one JSON line to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// A name for the run in the table and the JSON.
    #[arg(long, default_value = "run")]
    label: String,
    #[arg(long)]
    no_progress: bool,
}

/// One line of `--json` output.
#[derive(Serialize)]
struct RunRecord<'a> {
    label: &'a str,
    args: &'a RunArgs,
    summary: &'a Summary,
    /// Rivulet's own step timings over the run (absent for other servers).
    server: Option<server_stats::StepCost>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Run(args) => run(*args).await,
        Command::Compare(args) => compare::print(&args),
        Command::WaitReady(args) => server_stats::wait_ready(&args).await,
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let tokenizer = ModelTokenizer::from_model_path(&args.tokenizer)
        .with_context(|| format!("loading the tokenizer from {}", args.tokenizer.display()))?;
    let requests = build_dataset(&args, &tokenizer)?;
    let url = args.url.clone().unwrap_or_else(|| match args.backend {
        BackendKind::Rivulet => "http://127.0.0.1:50051".to_owned(),
        BackendKind::Openai => "http://127.0.0.1:8080".to_owned(),
    });
    let backend = match args.backend {
        BackendKind::Rivulet => Backend::Rivulet(
            RivuletBackend::connect(&url)
                .await
                .with_context(|| format!("connecting to {url}"))?,
        ),
        BackendKind::Openai => Backend::OpenAi(OpenAiBackend::new(&url, args.model_name.as_deref())?),
    };
    let server_before = match &args.admin_url {
        Some(admin) => admin_stats(admin).await,
        None => None,
    };
    let options = RunOptions {
        arrivals: arrival_offsets(args.request_rate, requests.len(), args.seed),
        max_concurrency: args.max_concurrency,
        settings: RequestSettings {
            ignore_eos: args.ignore_eos,
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            frequency_penalty: args.frequency_penalty,
            presence_penalty: args.presence_penalty,
            repetition_penalty: args.repetition_penalty,
        },
        show_progress: !args.no_progress,
    };
    let (outcomes, duration) = runner::run(&backend, &requests, &options).await;
    let summary = Summary::from_outcomes(&outcomes, duration);
    let server = match (server_before, &args.admin_url) {
        (Some(before), Some(admin)) => admin_stats(admin).await.map(|after| after.since(&before)),
        _ => None,
    };

    print!("{}", report::table(&args.label, &summary));
    if let Some(cost) = &server {
        println!("{cost}");
    }
    if let Some(error) = outcomes.iter().find_map(|o| o.error.as_deref()) {
        println!("first error: {error}");
    }
    if let Some(path) = &args.json {
        let record = RunRecord {
            label: &args.label,
            args: &args,
            summary: &summary,
            server,
        };
        let line = serde_json::to_string(&record)?;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        std::io::Write::write_all(&mut file, format!("{line}\n").as_bytes())?;
    }
    // A run in which nothing succeeded measured nothing: scripts must see it fail.
    if summary.completed == 0 {
        anyhow::bail!("every one of the {} requests failed", summary.failed);
    }
    Ok(())
}

/// Rivulet's step figures from `--admin-url`, or a warning saying why the run goes without them.
async fn admin_stats(admin: &str) -> Option<server_stats::StepCounters> {
    match server_stats::read(admin).await {
        Ok(stats) => Some(stats),
        Err(error) => {
            eprintln!(
                "warning: --admin-url {admin}: {}; Rivulet's step timings are left out",
                error.message()
            );
            None
        }
    }
}

/// A whole number above zero (a count or a length).
fn positive<T: std::str::FromStr + PartialOrd + Default>(text: &str) -> Result<T, String> {
    match text.parse::<T>() {
        Ok(value) if value > T::default() => Ok(value),
        _ => Err(format!("`{text}` is not a whole number above 0")),
    }
}

/// `--random-range-ratio`: lengths stay positive only for r in [0, 1).
fn range_ratio(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(ratio) if (0.0..1.0).contains(&ratio) => Ok(ratio),
        _ => Err(format!("`{text}` is not in [0, 1)")),
    }
}

fn build_dataset(args: &RunArgs, tokenizer: &ModelTokenizer) -> anyhow::Result<Vec<BenchRequest>> {
    let requests = match args.dataset {
        DatasetKind::Random => dataset::random_dataset(
            tokenizer,
            &RandomSpec {
                num_prompts: args.num_prompts,
                input_len: args.random_input_len,
                output_len: args.random_output_len,
                range_ratio: args.random_range_ratio,
                seed: args.seed,
            },
        )?,
        DatasetKind::SharedPrefix => dataset::shared_prefix_dataset(
            tokenizer,
            &SharedPrefixSpec {
                num_prompts: args.num_prompts,
                num_groups: args.num_prefix_groups,
                prefix_len: args.prefix_len,
                suffix_len: args.suffix_len,
                output_len: args.random_output_len,
                seed: args.seed,
            },
        )?,
        DatasetKind::File => {
            let path = args
                .dataset_path
                .as_deref()
                .context("--dataset file needs --dataset-path")?;
            dataset::file_dataset(tokenizer, path, args.num_prompts, args.random_output_len)?
        }
    };
    Ok(requests)
}
