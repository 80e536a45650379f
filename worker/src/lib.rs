//! Rivulet's model worker. It owns the model weights and the paged KV cache and executes exactly
//! the iteration the scheduler describes in the shared-memory step buffer; it knows nothing about
//! queues or policies.
//!
//! - [`config`]: model hyper-parameters read from GGUF metadata.
//! - [`weights`]: GGUF tensors dequantized into libtorch tensors.
//! - [`cpu_model`]: the forward pass on the CPU with Rivulet's kernels (weights in GGUF blocks).
//! - [`model`]: the forward pass with libtorch (CUDA; the CPU when asked).
//! - [`decode_graphs`], [`cuda_graph`]: CUDA decode steps replayed from captured graphs (the
//!   latter's FFI to `cuda/graph_shim.cpp` is the worker's other `unsafe`).
//! - [`kv_cache`]: the paged KV cache tensors and their sizing from a memory budget.
//! - [`attention`]: per-step attention metadata and paged attention.
//! - [`step_view`]: the only `unsafe`: step-buffer arrays wrapped as tensors without a copy.
//! - [`sampler`]: choosing each sequence's next token with libtorch; [`kernel_sampling`]: the
//!   same for the CPU kernels' steps, without libtorch.
//! - [`service`]: the IPC loop that ties them together.

pub mod attach;
pub mod attention;
pub mod config;
pub mod cpu_model;
pub mod cuda_graph;
#[cfg(rivulet_cuda_graphs)]
mod cuda_shim;
pub mod decode_graphs;
pub mod device;
pub mod error;
pub mod half_gemv;
pub mod hf_folder;
pub mod kernel_sampling;
pub mod kv_cache;
pub mod malloc_tuning;
pub mod memory;
pub mod model;
pub mod page_buffer;
pub mod paged_attention;
pub mod prompt_logprobs;
pub mod rope;
pub mod sampler;
pub mod service;
pub mod step;
pub mod step_phases;
pub mod step_view;
pub mod weights;

pub use error::WorkerError;
