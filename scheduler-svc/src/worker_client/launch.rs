//! What a replica's worker is started with: the binary, the device, its share of the cores and
//! the model and KV cache settings it is told to load, all read from the scheduler's [`Config`].

use std::path::PathBuf;
use std::time::Duration;

use rivulet_ipc::attach::{AttachAssignment, KvCacheBudget};

use crate::config::Config;

/// Everything a worker is told to load and how the scheduler talks to it: one per replica.
#[derive(Debug, Clone)]
pub struct WorkerLaunch {
    pub binary: PathBuf,
    pub device: String,
    pub threads: Option<u32>,
    pub assignment: AttachAssignment,
    pub startup_timeout: Duration,
    pub step_timeout: Duration,
    pub max_num_batched_tokens: u32,
    pub max_num_seqs: u32,
    /// The worker logs as the scheduler does (`server.json_logs`).
    pub json_logs: bool,
    /// `worker.libtorch_cpu`: spawned CPU workers run libtorch's forward pass, not the kernels.
    pub libtorch_cpu: bool,
    /// `worker.batch_weight_copy`.
    pub batch_weight_copy: bool,
    /// `worker.cuda_graphs`.
    pub cuda_graphs: bool,
}

impl WorkerLaunch {
    /// The settings for spawned replica `index` of `count` (its device, its share of the cores).
    pub fn from_config(config: &Config, index: usize, count: usize) -> Self {
        let worker = &config.worker;
        let device = worker
            .devices
            .get(index)
            .cloned()
            .unwrap_or_else(|| worker.device.clone());
        let threads = worker.threads.or_else(|| {
            // Several CPU replicas on one machine split its cores instead of fighting over them.
            (count > 1).then(|| {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                (cores / count).max(1) as u32
            })
        });
        Self {
            binary: worker_binary(config),
            device,
            threads,
            assignment: AttachAssignment {
                ipc_server: String::new(),
                model: config.model.path.clone(),
                kv_cache: match worker.kv_cache_memory_fraction {
                    Some(fraction) => KvCacheBudget::FreeFraction(fraction),
                    None => KvCacheBudget::Bytes(worker.kv_cache_memory),
                },
                block_size: worker.block_size,
                max_model_len: config.model.max_model_len,
                half_precision_gemv: worker.half_precision_gemv,
                threads: worker.threads,
            },
            startup_timeout: Duration::from_secs(worker.startup_timeout_secs),
            step_timeout: Duration::from_secs(worker.step_timeout_secs),
            max_num_batched_tokens: config.scheduler.max_num_batched_tokens,
            max_num_seqs: config.scheduler.max_num_seqs,
            json_logs: config.server.json_logs,
            libtorch_cpu: worker.libtorch_cpu,
            batch_weight_copy: worker.batch_weight_copy,
            cuda_graphs: worker.cuda_graphs,
        }
    }
}

/// The `rivulet-worker` binary: configured, else the one next to this executable.
pub fn worker_binary(config: &Config) -> PathBuf {
    config.worker.binary.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|dir| dir.join("rivulet-worker")))
            .unwrap_or_else(|| PathBuf::from("rivulet-worker"))
    })
}
