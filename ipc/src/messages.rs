//! Control messages over `ipc-channel`. Bulk data never travels here: it lives in the step buffer.

use ipc_channel::ipc::{IpcReceiver, IpcSender};
use serde::{Deserialize, Serialize};

use crate::layout::StepCapacity;

/// The first message: the worker connects to the scheduler's one-shot server (whose name it got on
/// its command line) and hands over both ends the scheduler needs.
#[derive(Debug, Serialize, Deserialize)]
pub struct Bootstrap {
    pub commands: IpcSender<WorkerCommand>,
    pub events: IpcReceiver<WorkerEvent>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum WorkerCommand {
    /// Map the shared-memory step buffer named `os_id`, sized for `capacity`.
    AttachStepBuffer { os_id: String, capacity: StepCapacity },
    /// Run iteration `step` as described by the step buffer's inputs; answer `StepDone`.
    Step { step: u64 },
    /// Exit cleanly.
    Shutdown,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum WorkerEvent {
    /// Loading the model's weights: sent every few percent, before `Ready`.
    LoadProgress(LoadProgress),
    /// Model loaded, KV cache allocated, warm-up iteration done.
    Ready(ReadyInfo),
    /// The step buffer is mapped; steps may be sent.
    StepBufferAttached,
    /// Iteration `step` finished; its outputs are in the step buffer.
    StepDone { step: u64, forward_micros: u64 },
    /// The worker could not carry out a command. `fatal` means it is exiting. `setting` names the
    /// configuration key whose value it cannot work with (`worker.kv_cache_memory`): another
    /// worker given the same settings would fail the same way, so restarting cannot help.
    Failed {
        message: String,
        fatal: bool,
        setting: Option<String>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LoadProgress {
    pub tensors_loaded: u32,
    pub tensors_total: u32,
    pub bytes_loaded: u64,
    pub bytes_total: u64,
}

impl LoadProgress {
    /// Whole percent of the bytes loaded.
    pub fn percent(&self) -> u32 {
        (self.bytes_loaded.saturating_mul(100) / self.bytes_total.max(1)).min(100) as u32
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub architecture: String,
    pub name: String,
    pub vocab_size: u32,
    pub hidden_size: u32,
    pub num_layers: u32,
    pub num_heads: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub context_length: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadyInfo {
    pub model: ModelInfo,
    /// KV cache blocks the worker allocated from its memory budget.
    pub num_blocks: u32,
    pub block_size: u32,
    pub max_model_len: u32,
    pub eos_token_ids: Vec<u32>,
    /// "cpu" or "cuda:N".
    pub device: String,
}
