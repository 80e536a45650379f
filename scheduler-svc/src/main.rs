//! `rivulet-scheduler`: the gRPC and OpenAI-compatible HTTP server. Configuration: `rivulet.toml`, `RIVULET_*` variables and
//! the command-line flags for the common settings (`--help`).

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use rivulet_scheduler::config::{Config, Overrides};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Rivulet LLM inference server",
    after_help = "Every setting can be set in the configuration file or as RIVULET_<SECTION>__<KEY> \
                  (e.g. RIVULET_WORKER__REPLICAS=2); the flags above win over both. --help lists them all.",
    after_long_help = concat!(
        "Every setting can be set in the configuration file or as RIVULET_<SECTION>__<KEY>; the flags \
         above win over both. All settings, with their defaults (rivulet.example.toml):\n\n",
        include_str!("../../rivulet.example.toml")
    )
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
    /// OpenAI-compatible HTTP listen address [server.http_listen].
    #[arg(long)]
    http_listen: Option<SocketAddr>,
    /// Admin gRPC listen address; beyond loopback it needs --api-key [server.admin_listen].
    #[arg(long)]
    admin_listen: Option<SocketAddr>,
    /// The model's name in the APIs (default: the model file's name) [server.served_model_name].
    #[arg(long)]
    served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on both fronts [server.api_key]; prefer the
    /// RIVULET_SERVER__API_KEY variable, which other users cannot read from the process list.
    #[arg(long)]
    api_key: Option<String>,
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
        .set("server.http_listen", args.http_listen)?
        .set("server.admin_listen", args.admin_listen)?
        .set("server.served_model_name", args.served_model_name)?
        .set("server.api_key", args.api_key)?
        .set("worker.replicas", args.workers)?
        .set("worker.device", args.device)?
        .set("worker.attach_socket", args.attach_socket)?;
    let config = Config::load_with(args.config.as_deref(), overrides)?;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only on a terminal: logs sent to a file or a collector stay plain text.
        .with_ansi(std::io::stderr().is_terminal());
    if config.server.json_logs {
        subscriber.json().init();
    } else {
        subscriber.init();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(rivulet_scheduler::server::run(config))
}
