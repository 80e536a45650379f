//! `rivulet-scheduler`: the gRPC server. Configuration: `rivulet.toml` and `RIVULET_*` variables.

use std::path::PathBuf;

use clap::Parser;
use rivulet_scheduler::config::Config;

#[derive(Debug, Parser)]
#[command(version, about = "Rivulet LLM inference server")]
struct Args {
    /// Configuration file (default: $RIVULET_CONFIG or ./rivulet.toml, when present).
    #[arg(long)]
    config: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = Config::load(args.config.as_deref())?;
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
