//! `rivulet-scheduler`: the gRPC server. Configuration: `rivulet.toml`, `RIVULET_*` variables and
//! the command-line flags for the common settings (`--help`).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use rivulet_scheduler::config::{Config, Overrides};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Rivulet LLM inference server",
    after_help = "Every setting (README, \"Configuration\") can be set in the configuration file or as \
                  RIVULET_<SECTION>__<KEY> (e.g. RIVULET_WORKER__REPLICAS=2); the flags above win over both."
)]
struct Args {
    /// Configuration file (default: $RIVULET_CONFIG or ./rivulet.toml, when present).
    #[arg(long)]
    config: Option<PathBuf>,
    /// GGUF model file or Hugging Face model folder [model.path].
    #[arg(long)]
    model: Option<PathBuf>,
    /// gRPC listen address [server.listen].
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Model workers spawned as children [worker.replicas].
    #[arg(long)]
    workers: Option<u32>,
    /// auto, cpu or cuda:N for the spawned workers [worker.device].
    #[arg(long)]
    device: Option<String>,
    /// Unix socket on which workers started elsewhere attach [worker.attach_socket].
    #[arg(long)]
    attach_socket: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let overrides = Overrides::default()
        .set("model.path", args.model)?
        .set("server.listen", args.listen)?
        .set("worker.replicas", args.workers)?
        .set("worker.device", args.device)?
        .set("worker.attach_socket", args.attach_socket)?;
    let config = Config::load_with(args.config.as_deref(), overrides)?;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if config.server.json_logs {
        subscriber.json().init();
    } else {
        subscriber.init();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(rivulet_scheduler::server::run(config))
}
