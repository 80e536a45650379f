//! Rivulet's scheduler service: the gRPC and OpenAI-compatible HTTP fronts and the engine loop that owns tokenization,
//! queueing, scheduling, paged KV accounting and completion. See `../shared/DESIGN.md`.
//!
//! - [`server`]: assembling the listeners (gRPC, OpenAI-compatible HTTP, admin) and shutdown.
//! - [`api`]: the fronts (gRPC, HTTP) and what they share: validation, request ids, the API key.
//! - [`metrics`]: Prometheus metrics under vLLM's names.
//! - [`engine`]: the single loop that owns all scheduling state, routes requests to replicas and
//!   plans and applies their steps.
//! - [`replica`]: one worker process and the state that lives and dies with it; its driver thread.
//! - [`scheduler`]: planning each iteration (continuous batching, chunked prefill, preemption).
//! - [`block_manager`]: paged KV block accounting.
//! - [`completion`]: every way a sequence ends, decided in one place as one typed outcome.
//! - `rivulet_text` ([`detokenizer`], [`tokenizer`], [`chat_template`], [`token_piece`]): text in
//!   and out.
//! - [`worker_client`], [`step_writer`]: a worker process and its shared-memory step buffer;
//!   [`worker_protocol`]: refusing a worker binary of another protocol version.

pub mod api;
// The text side lives in its own crate (the benchmark uses it without the server).
pub use rivulet_text::{chat_template, detokenizer, token_piece, tokenizer};
pub mod block_manager;
pub mod completion;
pub mod config;
pub mod engine;
pub mod guide;
pub mod load_progress;
pub mod metrics;
pub mod model_limits;
pub mod prefix_cache;
pub mod queue;
pub mod queue_ticket;
pub mod replica;
pub mod request;
pub mod scheduler;
pub mod sequence;
pub mod server;
pub mod stats;
pub mod step_writer;
pub mod worker_client;
pub mod worker_protocol;
