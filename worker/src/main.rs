//! `rivulet-worker`: runs the model for `rivulet-scheduler`. Either spawned by the scheduler
//! (`--ipc-server`, with the model settings on the command line) or started elsewhere, e.g. in
//! another container of the pod, attaching through the scheduler's socket (`--attach PATH`).
//!
//! `unsafe` here installs the SIGTERM handler (see [`exit_on_sigterm`]).

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use rivulet_worker::memory::KvBudget;
use rivulet_worker::service::{serve, WorkerOptions};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Rivulet model worker (spawned by rivulet-scheduler, or attached with --attach)"
)]
struct Args {
    /// Attach to the scheduler listening on this Unix socket (its `worker.attach_socket`); the
    /// scheduler sends the model and cache settings.
    #[arg(
        long,
        conflicts_with = "ipc_server",
        required_unless_present_any = ["ipc_server", "protocol_version"]
    )]
    attach: Option<PathBuf>,
    /// With --attach: how long to wait for the scheduler's socket to appear (seconds).
    #[arg(long, default_value_t = 120)]
    attach_wait_secs: u64,
    /// Name of the scheduler's IpcOneShotServer to connect to (set by a spawning scheduler).
    #[arg(long, requires = "model")]
    ipc_server: Option<String>,
    /// GGUF model file or Hugging Face folder (with --ipc-server).
    #[arg(long)]
    model: Option<PathBuf>,
    /// auto, cpu or cuda:N.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Bytes of memory for the KV cache.
    #[arg(long)]
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
    /// Keep f16 copies of the weights for one-token steps on the CPU (a libtorch feature: it
    /// selects the libtorch engine).
    #[arg(long)]
    half_precision_gemv: bool,
    /// On the CPU, run libtorch's forward pass instead of Rivulet's kernels (for comparison).
    #[arg(long)]
    libtorch_cpu: bool,
    /// CPU kernels: keep the Q4_0/Q4_1/Q8_0 weights as GGUF's row-major blocks, not arranged by
    /// the panels every step otherwise multiplies from. The scheduler passes it when
    /// `worker.batch_weight_copy` is false.
    #[arg(long)]
    no_batch_weight_copy: bool,
    /// CUDA: run every step eagerly, op by op, instead of replaying captured graphs for decode
    /// steps. The scheduler passes it when `worker.cuda_graphs` is false.
    #[arg(long)]
    no_cuda_graphs: bool,
    /// Log lines as JSON; the scheduler's own setting (and variable), so a pod's log is one format.
    #[arg(long, env = "RIVULET_SERVER__JSON_LOGS")]
    json_logs: bool,
    /// Print the scheduler ⇄ worker protocol version this build speaks, and exit (the scheduler
    /// asks before spawning, so a worker binary of another version is refused at start).
    #[arg(long)]
    protocol_version: bool,
}

/// SIGTERM ends the worker at once, as it ends any process without a handler, and its scheduler
/// moves what it ran to another replica. Said explicitly because a container's PID 1 ignores a
/// signal it has no handler for: a worker container's `docker stop` waited out the grace period
/// and was killed (exit 137).
fn exit_on_sigterm() {
    extern "C" fn exit_now(_signal: libc::c_int) {
        // SAFETY: `_exit` is async-signal-safe; nothing else runs in the handler.
        unsafe { libc::_exit(0) }
    }
    // SAFETY: installs a handler that calls only an async-signal-safe function.
    unsafe { libc::signal(libc::SIGTERM, exit_now as *const () as libc::sighandler_t) };
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.protocol_version {
        println!("{}", rivulet_ipc::attach::PROTOCOL_VERSION);
        return Ok(());
    }
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        // Colours only on a terminal: logs sent to a file or a collector stay plain text.
        .with_ansi(std::io::stderr().is_terminal());
    if args.json_logs {
        subscriber.json().init();
    } else {
        subscriber.init();
    }
    exit_on_sigterm();
    if !rivulet_worker::malloc_tuning::keep_freed_memory() {
        tracing::warn!("could not tune malloc thresholds; steps may page-fault more");
    }
    // An attached worker holds its registration connection until it exits.
    let mut _attach_connection = None;
    let (options, server_name) = match (&args.attach, args.ipc_server) {
        (Some(socket), _) => {
            let (assignment, connection) = rivulet_worker::attach::register(
                socket,
                &args.device,
                std::time::Duration::from_secs(args.attach_wait_secs),
            )?;
            _attach_connection = Some(connection);
            tracing::info!(socket = %socket.display(), model = %assignment.model.display(), "attached to the scheduler");
            let mut options = rivulet_worker::attach::options(&assignment, args.device, args.threads);
            options.libtorch_cpu = args.libtorch_cpu;
            options.batch_weight_copy = !args.no_batch_weight_copy;
            options.cuda_graphs = !args.no_cuda_graphs;
            (options, assignment.ipc_server)
        }
        (None, Some(server_name)) => {
            let options = WorkerOptions {
                model_path: args.model.context("--model is required with --ipc-server")?,
                device: args.device,
                kv_cache_memory: match (args.kv_cache_memory_fraction, args.kv_cache_memory) {
                    (Some(fraction), _) => KvBudget::FreeFraction(fraction),
                    (None, Some(bytes)) => KvBudget::Bytes(bytes),
                    (None, None) => anyhow::bail!("--kv-cache-memory or --kv-cache-memory-fraction is required"),
                },
                block_size: args.block_size,
                max_model_len: args.max_model_len,
                threads: args.threads,
                half_precision_gemv: args.half_precision_gemv,
                libtorch_cpu: args.libtorch_cpu,
                batch_weight_copy: !args.no_batch_weight_copy,
                cuda_graphs: !args.no_cuda_graphs,
            };
            (options, server_name)
        }
        (None, None) => anyhow::bail!("--attach PATH or --ipc-server NAME is required"),
    };
    serve(&options, &server_name).context("worker failed")
}
