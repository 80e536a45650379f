//! `rivulet-worker`: spawned by `rivulet-scheduler`, one per device. Not meant to be run by hand.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use rivulet_worker::memory::KvBudget;
use rivulet_worker::service::{serve, WorkerOptions};

#[derive(Debug, Parser)]
#[command(version, about = "Rivulet model worker (spawned by rivulet-scheduler)")]
struct Args {
    /// Name of the scheduler's IpcOneShotServer to connect to.
    #[arg(long)]
    ipc_server: String,
    /// GGUF model file.
    #[arg(long)]
    model: PathBuf,
    /// auto, cpu or cuda:N.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Bytes of memory for the KV cache.
    #[arg(long, required_unless_present = "kv_cache_memory_fraction")]
    kv_cache_memory: Option<usize>,
    /// Instead: this fraction of the device's free memory after the weights are loaded.
    #[arg(long, conflicts_with = "kv_cache_memory")]
    kv_cache_memory_fraction: Option<f64>,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Intra-op threads (default: libtorch's choice, all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Keep f16 copies of the weights for one-token steps on the CPU.
    #[arg(long)]
    half_precision_gemv: bool,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if !rivulet_worker::malloc_tuning::keep_freed_memory() {
        tracing::warn!("could not tune malloc thresholds; steps may page-fault more");
    }
    let options = WorkerOptions {
        model_path: args.model,
        device: args.device,
        kv_cache_memory: match (args.kv_cache_memory_fraction, args.kv_cache_memory) {
            (Some(fraction), _) => KvBudget::FreeFraction(fraction),
            (None, bytes) => KvBudget::Bytes(bytes.unwrap_or_default()),
        },
        block_size: args.block_size,
        max_model_len: args.max_model_len,
        threads: args.threads,
        half_precision_gemv: args.half_precision_gemv,
    };
    serve(&options, &args.ipc_server).context("worker failed")
}
