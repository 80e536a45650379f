//! Attaching a worker that the scheduler did not spawn (another container of the pod).
//!
//! The scheduler listens on a Unix socket (`worker.attach_socket`, on a volume both containers
//! mount). `rivulet-worker --attach PATH` connects and sends one [`AttachHello`] line of JSON; the
//! scheduler answers with one [`AttachAssignment`] line: the name of an `IpcOneShotServer` to
//! connect to and the model and cache settings to load. From there the handshake is the spawned
//! worker's (`Bootstrap`, `Ready`, `AttachStepBuffer`), so both kinds of worker are one code path.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Bumped whenever the attach lines, the IPC messages or the step buffer's layout
/// ([`STEP_LAYOUT_VERSION`](crate::layout::STEP_LAYOUT_VERSION)) change incompatibly: this is the
/// version the scheduler checks before it starts a worker (3: sampling parameters as rows; 4:
/// tokens banned before `min_new_tokens`; 5: a failure names the setting it refused; 6: logit
/// biases; 7: prompt logprobs; 8: structured outputs' token masks).
pub const PROTOCOL_VERSION: u32 = 8;

/// The worker's first line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttachHello {
    pub protocol_version: u32,
    /// The device the worker was started for (`auto`, `cpu`, `cuda:N`): its container's choice.
    pub device: String,
    pub pid: u32,
}

/// How the worker sizes its KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum KvCacheBudget {
    Bytes(u64),
    /// This fraction of the device's free memory once the weights are loaded.
    FreeFraction(f64),
}

/// What a worker loads, and how: the scheduler's answer to [`AttachHello`], and the same settings
/// a spawned worker gets on its command line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttachAssignment {
    /// The scheduler's `IpcOneShotServer` to connect to.
    pub ipc_server: String,
    pub model: PathBuf,
    pub kv_cache: KvCacheBudget,
    pub block_size: u32,
    pub max_model_len: Option<u32>,
    pub half_precision_gemv: bool,
    /// Intra-op threads; the worker's own `--threads` wins.
    pub threads: Option<u32>,
}

/// The scheduler's answer when it will not take the worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum AttachReply {
    Assigned(AttachAssignment),
    Refused { reason: String },
}
