//! The CPU compute of the worker's forward pass, in Rust, with no libtorch.
//!
//! - [`matrix`]: weights kept in their GGUF blocks (Q4_0, Q4_1, Q8_0, the K-quants, f16, bf16,
//!   f32) and `x · Wᵀ` for f32 activations, decoded tile by tile into L1.
//! - [`ops`]: RMSNorm, interleaved rotary embedding, SiLU·mul — row by row, no temporaries.
//! - [`logits`]: a greedy step's reading of its logits (argmax, log-normalizer, alternatives).
//! - [`sampling`]: a row's penalties and its draw under temperature, top-k, top-p and min-p.
//! - [`attention`]: attention for every token of a step straight over the paged KV cache (block
//!   tables are followed, never gathered), grouped-query heads sharing each key read.
//! - [`kv_values`]: the KV cache's values, three bytes each (an f32 rounded to 16 significant
//!   bits).
//! - `simd` (and its children in `simd/`): the crate's only `unsafe` — AMX, AVX-512 and
//!   AVX2/FMA/F16C paths chosen at run time, with a portable fallback for every one of them.
//!
//! Parallel work runs on the current rayon pool, whose threads sleep when there is none; a step
//! run through [`awake::install_awake`] keeps them awake between its parallel regions. The
//! pool's threads should call [`flush_subnormals_on_this_thread`] when they start (the worker's
//! do).

pub mod attention;
pub mod awake;
pub mod kv_values;
pub mod logits;
pub mod matrix;
pub mod ops;
pub mod sampling;
mod simd;

pub use matrix::{Isa, WeightMatrix};
pub use simd::{flush_subnormals_on_this_thread, fma_peak_gflops_on, has_avx2, prefetch_l2};

use rivulet_gguf::GgmlType;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{0:?} weights are not supported (supported: {supported})", supported = rivulet_gguf::dequant::SUPPORTED_TYPES)]
    UnsupportedFormat(GgmlType),
    #[error("a row of {cols} values is not whole {format:?} blocks")]
    RowNotWholeBlocks { format: GgmlType, cols: usize },
    #[error("a {rows}×{cols} {format:?} matrix takes {expected} bytes, got {got}")]
    DataLength {
        format: GgmlType,
        rows: usize,
        cols: usize,
        expected: usize,
        got: usize,
    },
    #[error("matrix size overflows")]
    TooLarge,
    #[error("{what}: {got} values, expected {expected}")]
    Shape {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("row {row} is outside the matrix's {rows} rows")]
    RowOutOfRange { row: usize, rows: usize },
}

/// Vector helpers shared by the kernels' modules.
pub(crate) use simd::{dot, exp_in_place, prompt_scores_take, score_keys, score_prompt_keys, weighted_rows};
