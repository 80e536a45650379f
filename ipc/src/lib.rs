//! The contract between `rivulet-scheduler` and `rivulet-worker`, defined once for both.
//!
//! - [`messages`]: the small control messages that travel over `ipc-channel` (one `Step` command
//!   and one `StepDone` event per iteration).
//! - [`attach`]: the two JSON lines a worker started elsewhere exchanges with the scheduler
//!   over the attach socket before the usual handshake.
//! - [`layout`]: the `#[repr(C)]` shared-memory step buffer that carries the bulk tensors of an
//!   iteration (token ids, positions, slot mapping, block tables, sampling parameters, sampled
//!   tokens, logprobs), each array described once with its element type.
//! - [`step_buffer`]: a mapped step buffer, created by the scheduler and opened by the worker.
//! - [`device`]: how a device is spelled, in the configuration and on a worker's command line.

pub mod attach;
pub mod device;
pub mod layout;
pub mod messages;
pub mod step_buffer;

pub use layout::{ArraySpan, SeqSampling, StepCapacity, StepElement, StepHeader, StepLayout};

/// The model architectures a worker can run (GGUF `general.architecture`, Hugging Face
/// `model_type`), so the scheduler can refuse another model at start instead of restarting
/// workers that can never load it.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama"];
pub use messages::{Bootstrap, LoadProgress, ModelInfo, ReadyInfo, WorkerCommand, WorkerEvent};
pub use step_buffer::{StepBuffer, StepBufferError};
