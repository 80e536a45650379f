use thiserror::Error;

#[derive(Debug, Error)]
pub enum WorkerError {
    #[error("model file: {0}")]
    Gguf(#[from] rivulet_gguf::GgufError),
    #[error("model `{0}` is not supported: {1}")]
    UnsupportedModel(String, String),
    #[error("kernels: {0}")]
    Kernel(#[from] rivulet_kernels::KernelError),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("step buffer: {0}")]
    StepBuffer(#[from] rivulet_ipc::StepBufferError),
    #[error("invalid step: {0}")]
    InvalidStep(String),
    #[error("KV cache: {0}")]
    KvCache(String),
    /// The KV cache budget cannot hold one sequence of the context's length.
    #[error("KV cache: {0}")]
    KvBudgetTooSmall(String),
    #[error("device `{0}` is not available: {1}")]
    Device(String, String),
    #[error("IPC: {0}")]
    Ipc(String),
}

/// The text of a caught panic (libtorch's errors reach Rust as panics from tch).
pub(crate) fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "libtorch panicked".to_owned())
}
