//! Configuration: built-in defaults ← `rivulet.toml` (or the file named by `RIVULET_CONFIG`) ←
//! `RIVULET_*` environment variables (nested keys with `__`, e.g. `RIVULET_SERVER__LISTEN`).
//! Invalid configuration fails at start with the key named.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use rivulet_ipc::device::DeviceSpec;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::scheduler::SchedulingPolicy;

#[derive(Debug, Error)]
pub enum ConfigError {
    /// figment's message already says everything: not also kept as the source, which would
    /// print it a second time under "Caused by".
    #[error("invalid configuration: {0}")]
    Figment(Box<figment::Error>),
    #[error("invalid configuration: `{key}` {problem}")]
    Invalid { key: &'static str, problem: String },
    /// A configuration file named on purpose (`--config`, `RIVULET_CONFIG`) that cannot be read.
    #[error("configuration file {path}: {problem}")]
    File { path: String, problem: String },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    pub model: ModelConfig,
    pub worker: WorkerConfig,
    pub scheduler: SchedulerConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// gRPC listen address (Generation, health, reflection).
    pub listen: SocketAddr,
    /// OpenAI-compatible HTTP listen address (`/v1/...`, `/health`, `/metrics`).
    pub http_listen: SocketAddr,
    /// The Admin gRPC service's listen address (with health and reflection). On loopback it is
    /// open to whoever can reach it; anywhere else it requires `api_key`.
    pub admin_listen: SocketAddr,
    /// When set, generation on both fronts requires `Authorization: Bearer <key>`
    /// (health and metrics stay open).
    pub api_key: Option<String>,
    /// The model's name in the APIs (`model` fields, `/v1/models`); default: the model file's
    /// name without extension (or the model folder's name).
    pub served_model_name: Option<String>,
    /// Log lines as JSON.
    pub json_logs: bool,
    /// After SIGTERM/SIGINT, how long running requests may take to finish before they are ended.
    pub shutdown_timeout_secs: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// GGUF model file.
    pub path: PathBuf,
    /// Caps the model's context length (prompt + output) when set.
    pub max_model_len: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// The `rivulet-worker` binary; by default the one next to `rivulet-scheduler`.
    pub binary: Option<PathBuf>,
    /// Workers spawned as children of the scheduler (replicas of the model; 0 with an attach
    /// socket: every worker attaches).
    pub replicas: u32,
    /// `auto`, `cpu` or `cuda:N`, for every spawned replica unless `devices` is set.
    pub device: String,
    /// One device per spawned replica (`["cuda:0", "cuda:1"]`); its length must be `replicas`.
    pub devices: Vec<String>,
    /// Listen on this Unix socket for workers started elsewhere (`rivulet-worker --attach PATH`,
    /// e.g. other containers of the pod with the socket on a shared volume). Their IPC handshake
    /// socket is made in the scheduler's `TMPDIR`, which must be on a volume they share too.
    pub attach_socket: Option<PathBuf>,
    /// Bytes of memory for the KV cache.
    pub kv_cache_memory: u64,
    /// Instead of `kv_cache_memory`: this fraction of the device's free memory once the weights
    /// are loaded (free GPU memory on CUDA, available RAM on the CPU).
    pub kv_cache_memory_fraction: Option<f64>,
    /// Tokens per KV block.
    pub block_size: u32,
    /// libtorch intra-op threads (default: all cores, split between spawned replicas).
    pub threads: Option<u32>,
    /// CPU: keep f16 copies of the weights for steps of one token (single-stream decode), about
    /// twice as fast there; activations are rounded to f16, which can flip near-ties. A feature
    /// of the libtorch engine: it selects that engine.
    pub half_precision_gemv: bool,
    /// CPU: run libtorch's forward pass (f32 weights, oneDNN) instead of Rivulet's kernels on the
    /// GGUF blocks; for comparison. Spawned workers only (an attached worker takes
    /// `--libtorch-cpu` on its own command line).
    pub libtorch_cpu: bool,
    /// CPU kernels: arrange the Q4_0/Q4_1/Q8_0 weights by 16-row panels, which every step then
    /// multiplies from in place of GGUF's row-major blocks (the same bytes; on AVX-512 1.3–2×
    /// faster projections up to 8 tokens, 1.1–1.35× at 12–32; on AVX2 1.25–1.5× up to 4 tokens,
    /// ~1.2× at 16–32). `false` keeps the blocks only. Spawned workers (an attached worker takes
    /// `--no-batch-weight-copy`).
    pub batch_weight_copy: bool,
    /// CUDA: run decode steps of up to 1024 sequences by replaying CUDA graphs captured per batch
    /// and context bucket (one launch instead of ~600; 3-6x faster steps where the host's kernel
    /// launches dominate). `false` runs every step eagerly, op by op. Spawned workers (an attached
    /// worker takes `--no-cuda-graphs`).
    pub cuda_graphs: bool,
    /// Seconds to wait for the worker to load its model and report ready.
    pub startup_timeout_secs: u64,
    /// Seconds one iteration may take before the worker is declared hung.
    pub step_timeout_secs: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Sequences in one iteration at most.
    pub max_num_seqs: u32,
    /// Tokens in one iteration at most (decode tokens plus prefill chunks). Every token of a
    /// step finishes with the step, so a burst of prompts gets its first tokens in budget-sized
    /// waves: on a CPU (~0.7 ms a prefill token on 2 cores of a Zen 5) 256 answers the first half
    /// of 32 short prompts after one ~180 ms step instead of all of them after one of ~340 ms,
    /// and keeps running decodes from stalling behind long prefill steps; a GPU wants thousands.
    pub max_num_batched_tokens: u32,
    /// `max_new_tokens` for requests that do not set it.
    pub default_max_new_tokens: u32,
    /// Requests waiting for admission at most; past it, new requests get RESOURCE_EXHAUSTED.
    pub max_queued_requests: u32,
    /// Stop strings applied to every request, besides its own.
    pub default_stop_strings: Vec<String>,
    /// `fair`, `latency_first` or `throughput_first`; switchable while serving (admin RPC).
    pub policy: SchedulingPolicy,
    /// Share of KV blocks new admissions may not use (headroom for running sequences).
    pub reserved_block_ratio: f64,
    /// Memory pressure (1 − available/total) past which nothing new is admitted.
    pub backpressure_threshold: f64,
    /// Reuse the KV blocks of earlier requests' identical prompt prefixes.
    pub prefix_cache: bool,
    /// Cached blocks unused this long are freed (default: only when space is needed).
    pub prefix_cache_ttl_seconds: Option<u64>,
    /// Requests wait this long for a worker while none is ready, then end with UNAVAILABLE.
    pub no_worker_timeout_secs: u64,
    /// Confidence stop for requests that set none: end at the first token less likely than this.
    pub confidence_threshold: Option<f32>,
    /// Adapt each replica's token budget per step (up to `max_num_batched_tokens`) to its
    /// measured step time (`scheduler::adaptive`).
    pub adaptive_batching: bool,
    /// Adaptive batching: the step time to keep near, in milliseconds.
    pub adaptive_target_step_ms: u64,
    /// Adaptive batching: grow the budget only after steps that used this share of it.
    pub adaptive_target_utilization: f64,
    /// Adaptive batching: steps over which the budget ramps up from `max_num_seqs`.
    pub adaptive_warmup_iterations: u32,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            server: ServerConfig {
                listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
                http_listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
                admin_listen: SocketAddr::from(([127, 0, 0, 1], 50052)),
                api_key: None,
                served_model_name: None,
                shutdown_timeout_secs: 30,
                json_logs: false,
            },
            model: ModelConfig {
                path: PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
                max_model_len: None,
            },
            worker: WorkerConfig {
                binary: None,
                replicas: 1,
                device: "auto".to_owned(),
                devices: Vec::new(),
                attach_socket: None,
                kv_cache_memory: 1 << 30,
                kv_cache_memory_fraction: None,
                block_size: 16,
                threads: None,
                half_precision_gemv: false,
                libtorch_cpu: false,
                batch_weight_copy: true,
                cuda_graphs: true,
                startup_timeout_secs: 300,
                step_timeout_secs: 120,
            },
            scheduler: SchedulerConfig {
                max_num_seqs: 64,
                max_num_batched_tokens: 256,
                default_max_new_tokens: 16,
                max_queued_requests: 1024,
                default_stop_strings: Vec::new(),
                policy: SchedulingPolicy::Fair,
                reserved_block_ratio: 0.1,
                backpressure_threshold: 0.8,
                prefix_cache: true,
                prefix_cache_ttl_seconds: None,
                no_worker_timeout_secs: 60,
                confidence_threshold: None,
                adaptive_batching: false,
                adaptive_target_step_ms: 100,
                adaptive_target_utilization: 0.8,
                adaptive_warmup_iterations: 8,
            },
        }
    }
}

impl From<Box<figment::Error>> for ConfigError {
    fn from(error: Box<figment::Error>) -> Self {
        Self::Figment(error)
    }
}

/// Settings given on the command line: they win over the file and the environment.
#[derive(Debug, Default, Clone)]
pub struct Overrides(Vec<(&'static str, figment::value::Value)>);

impl Overrides {
    /// Sets `key` (a dotted path such as `worker.replicas`) when `value` is given.
    pub fn set<T: Serialize>(mut self, key: &'static str, value: Option<T>) -> Result<Self, ConfigError> {
        if let Some(value) = value {
            let value = figment::value::Value::serialize(value).map_err(Box::new)?;
            self.0.push((key, value));
        }
        Ok(self)
    }
}

impl Config {
    /// Defaults ← the TOML file (when it exists) ← `RIVULET_*` environment.
    pub fn load(toml_path: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_with(toml_path, Overrides::default())
    }

    /// Defaults ← the TOML file (when it exists) ← `RIVULET_*` environment ← `overrides`.
    pub fn load_with(toml_path: Option<&Path>, overrides: Overrides) -> Result<Self, ConfigError> {
        let named = toml_path
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("RIVULET_CONFIG").map(PathBuf::from));
        // Only the implicit `./rivulet.toml` may be absent: a file the user named that cannot be
        // read is a mistake to report, not a reason to serve on the defaults.
        if let Some(named) = &named {
            let problem = match std::fs::metadata(named) {
                Ok(metadata) if metadata.is_dir() => Some("is a directory".to_owned()),
                Ok(_) => std::fs::File::open(named).err().map(|error| error.to_string()),
                Err(error) => Some(error.to_string()),
            };
            if let Some(problem) = problem {
                return Err(ConfigError::File {
                    path: named.display().to_string(),
                    problem,
                });
            }
        }
        let path = named.unwrap_or_else(|| PathBuf::from("rivulet.toml"));
        let figment = Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::file(path))
            .merge(
                Env::prefixed("RIVULET_")
                    .ignore(&["CONFIG"])
                    // `RIVULET_KERNELS_*` choose the kernels' code paths in the worker (which
                    // inherits this environment); they are not configuration keys.
                    .filter(|key| !key.as_str().to_ascii_uppercase().starts_with("KERNELS_"))
                    .split("__"),
            );
        let figment = overrides.0.into_iter().fold(figment, |figment, (key, value)| {
            figment.merge(Serialized::default(key, value))
        });
        let config: Config = figment.extract().map_err(Box::new)?;
        config.validate()?;
        Ok(config)
    }

    /// The model's name in the APIs: `server.served_model_name`, else the model file's stem.
    pub fn served_model_name(&self) -> String {
        if let Some(name) = &self.server.served_model_name {
            return name.clone();
        }
        let path = &self.model.path;
        let name = if path.is_dir() {
            path.file_name()
        } else {
            path.file_stem()
        };
        name.map_or_else(|| "model".to_owned(), |n| n.to_string_lossy().into_owned())
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key, problem: &str| {
            Err(ConfigError::Invalid {
                key,
                problem: problem.to_owned(),
            })
        };
        if self.worker.block_size == 0 || self.worker.block_size > 1024 {
            return invalid("worker.block_size", "must be between 1 and 1024");
        }
        if self
            .worker
            .kv_cache_memory_fraction
            .is_some_and(|f| !(f > 0.0 && f <= 1.0))
        {
            return invalid("worker.kv_cache_memory_fraction", "must be in (0, 1]");
        }
        if self.worker.kv_cache_memory == 0 {
            return invalid("worker.kv_cache_memory", "must be positive");
        }
        if self.scheduler.max_num_seqs == 0 {
            return invalid("scheduler.max_num_seqs", "must be positive");
        }
        if self.scheduler.max_num_batched_tokens < self.scheduler.max_num_seqs {
            return invalid(
                "scheduler.max_num_batched_tokens",
                "must be at least scheduler.max_num_seqs",
            );
        }
        if self.scheduler.default_max_new_tokens == 0 {
            return invalid("scheduler.default_max_new_tokens", "must be positive");
        }
        if !self.worker.devices.is_empty() && self.worker.devices.len() != self.worker.replicas as usize {
            return invalid(
                "worker.devices",
                &format!(
                    "lists {} devices for {} replicas (worker.replicas)",
                    self.worker.devices.len(),
                    self.worker.replicas
                ),
            );
        }
        if self.worker.replicas == 0 && self.worker.attach_socket.is_none() {
            return invalid(
                "worker.replicas",
                "is 0 and no worker.attach_socket is set: no worker could ever serve",
            );
        }
        if !self.server.admin_listen.ip().is_loopback() && self.server.api_key.as_deref().unwrap_or("").is_empty() {
            return invalid(
                "server.admin_listen",
                "is not a loopback address, so the Admin service needs server.api_key to be set",
            );
        }
        if self.server.served_model_name.as_deref() == Some("") {
            return invalid("server.served_model_name", "must not be empty");
        }
        if !(self.scheduler.adaptive_target_utilization > 0.0 && self.scheduler.adaptive_target_utilization <= 1.0) {
            return invalid("scheduler.adaptive_target_utilization", "must be in (0, 1]");
        }
        if self.scheduler.adaptive_target_step_ms == 0 {
            return invalid("scheduler.adaptive_target_step_ms", "must be positive");
        }
        if self.scheduler.no_worker_timeout_secs == 0 {
            return invalid("scheduler.no_worker_timeout_secs", "must be positive");
        }
        if self.worker.step_timeout_secs == 0 {
            return invalid("worker.step_timeout_secs", "must be positive");
        }
        if self.worker.startup_timeout_secs == 0 {
            return invalid("worker.startup_timeout_secs", "must be positive");
        }
        // The spelling only: whether the machine has the device, the worker finds out.
        if DeviceSpec::parse(&self.worker.device).is_none() {
            return invalid("worker.device", "must be auto, cpu or cuda:N");
        }
        if let Some(bad) = self
            .worker
            .devices
            .iter()
            .find(|device| DeviceSpec::parse(device).is_none())
        {
            return invalid(
                "worker.devices",
                &format!("lists {bad:?}: each must be auto, cpu or cuda:N"),
            );
        }
        if self.model.max_model_len == Some(0) {
            return invalid("model.max_model_len", "must be positive");
        }
        if self.scheduler.max_queued_requests == 0 {
            return invalid("scheduler.max_queued_requests", "must be positive");
        }
        if !(0.0..1.0).contains(&self.scheduler.reserved_block_ratio) {
            return invalid("scheduler.reserved_block_ratio", "must be in [0, 1)");
        }
        if !(self.scheduler.backpressure_threshold > 0.0 && self.scheduler.backpressure_threshold <= 1.0) {
            return invalid("scheduler.backpressure_threshold", "must be in (0, 1]");
        }
        if self
            .scheduler
            .confidence_threshold
            .is_some_and(|threshold| !(threshold > 0.0 && threshold < 1.0))
        {
            return invalid("scheduler.confidence_threshold", "must be in (0, 1)");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rivulet.example.toml` (shown by `--help`) names every setting and states the true defaults.
    #[test]
    fn the_example_file_lists_every_setting_with_its_default() {
        let example = include_str!("../../rivulet.example.toml");
        let parsed: Config = Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::string(example))
            .extract()
            .expect("the example parses");
        assert_eq!(parsed, Config::default(), "the example's values are the defaults");
        let defaults = serde_json::to_value(Config::default()).expect("serializable");
        let sections = defaults.as_object().expect("sections");
        for (section, keys) in sections {
            assert!(example.contains(&format!("[{section}]")), "[{section}] missing");
            for key in keys.as_object().expect("keys").keys() {
                let shown = example
                    .lines()
                    .any(|line| line.trim_start_matches("# ").starts_with(&format!("{key} =")));
                assert!(shown, "{section}.{key} is not in rivulet.example.toml");
            }
        }
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's closure signature, not ours
    fn environment_overrides_nested_keys_and_errors_name_the_key() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("rivulet.toml", "[scheduler]\nmax_num_seqs = 8\n")?;
            jail.set_env("RIVULET_SERVER__LISTEN", "127.0.0.1:6000");
            // The kernels' path switches pass through to the worker, not into the configuration.
            jail.set_env("RIVULET_KERNELS_NO_AMX", "1");
            let config = Config::load(None).map_err(|e| e.to_string())?;
            assert_eq!(config.scheduler.max_num_seqs, 8);
            assert_eq!(config.server.listen.port(), 6000);

            jail.set_env("RIVULET_WORKER__BLOCK_SIZE", "0");
            let err = Config::load(None).expect_err("block size 0").to_string();
            assert!(err.contains("worker.block_size"), "{err}");

            jail.set_env("RIVULET_WORKER__BLOCK_SIZE", "sixteen");
            let err = Config::load(None).expect_err("not a number").to_string();
            assert!(err.to_lowercase().contains("block_size"), "{err}");
            jail.set_env("RIVULET_WORKER__BLOCK_SIZE", "16");

            jail.set_env("RIVULET_WORKER__DEVICES", "[\"cuda:0\", \"cuda:1\"]");
            let err = Config::load(None).expect_err("two devices, one replica").to_string();
            assert!(err.contains("worker.devices"), "{err}");
            jail.set_env("RIVULET_WORKER__REPLICAS", "2");
            assert_eq!(Config::load(None).map_err(|e| e.to_string())?.worker.devices.len(), 2);

            jail.set_env("RIVULET_WORKER__DEVICES", "[]");
            jail.set_env("RIVULET_WORKER__REPLICAS", "0");
            let err = Config::load(None).expect_err("no worker at all").to_string();
            assert!(err.contains("worker.replicas"), "{err}");
            jail.set_env("RIVULET_WORKER__ATTACH_SOCKET", "/tmp/rivulet-workers.sock");
            assert_eq!(Config::load(None).map_err(|e| e.to_string())?.worker.replicas, 0);

            // Admin beyond loopback only behind the API key.
            jail.set_env("RIVULET_SERVER__ADMIN_LISTEN", "0.0.0.0:50052");
            let err = Config::load(None).expect_err("open admin").to_string();
            assert!(err.contains("server.admin_listen"), "{err}");
            jail.set_env("RIVULET_SERVER__API_KEY", "k");
            assert!(Config::load(None).is_ok());

            // Command-line flags win over the environment and the file.
            let flags = Overrides::default()
                .set("worker.replicas", Some(3u32))
                .and_then(|o| o.set("scheduler.max_num_seqs", None::<u32>))
                .and_then(|o| o.set("model.path", Some(PathBuf::from("other.gguf"))))
                .map_err(|e| e.to_string())?;
            let config = Config::load_with(None, flags).map_err(|e| e.to_string())?;
            assert_eq!(config.worker.replicas, 3);
            assert_eq!(config.scheduler.max_num_seqs, 8, "an absent flag changes nothing");
            assert_eq!(config.model.path, PathBuf::from("other.gguf"));
            Ok(())
        });
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's closure signature, not ours
    fn out_of_range_values_and_a_named_file_that_is_missing_are_refused_by_name() {
        figment::Jail::expect_with(|jail| {
            for (variable, bad, good, key) in [
                ("RIVULET_MODEL__MAX_MODEL_LEN", "0", "64", "model.max_model_len"),
                (
                    "RIVULET_SCHEDULER__MAX_QUEUED_REQUESTS",
                    "0",
                    "8",
                    "scheduler.max_queued_requests",
                ),
                (
                    "RIVULET_SCHEDULER__RESERVED_BLOCK_RATIO",
                    "1.5",
                    "0.1",
                    "scheduler.reserved_block_ratio",
                ),
                (
                    "RIVULET_SCHEDULER__BACKPRESSURE_THRESHOLD",
                    "-0.1",
                    "0.8",
                    "scheduler.backpressure_threshold",
                ),
                (
                    "RIVULET_SCHEDULER__CONFIDENCE_THRESHOLD",
                    "2.0",
                    "0.5",
                    "scheduler.confidence_threshold",
                ),
                (
                    "RIVULET_WORKER__STARTUP_TIMEOUT_SECS",
                    "0",
                    "10",
                    "worker.startup_timeout_secs",
                ),
                ("RIVULET_WORKER__DEVICE", "gpu", "CUDA:1", "worker.device"),
            ] {
                jail.set_env(variable, bad);
                let err = Config::load(None).expect_err(key).to_string();
                assert!(err.contains(key), "{variable}={bad}: {err}");
                jail.set_env(variable, good);
                Config::load(None).map_err(|e| format!("{variable}={good}: {e}"))?;
            }
            // Only the implicit ./rivulet.toml may be missing.
            let err = Config::load(Some(Path::new("missing.toml")))
                .expect_err("named, missing")
                .to_string();
            assert!(err.contains("configuration file missing.toml"), "{err}");
            let err = Config::load(Some(jail.directory()))
                .expect_err("a directory")
                .to_string();
            assert!(err.contains("is a directory"), "{err}");
            jail.set_env("RIVULET_CONFIG", "missing.toml");
            assert!(Config::load(None).is_err(), "RIVULET_CONFIG names a missing file");
            jail.create_file("missing.toml", "")?;
            Config::load(None).map_err(|e| e.to_string())?;
            Ok(())
        });
    }
}
