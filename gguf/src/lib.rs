//! GGUF files: the header, metadata and tensor directory ([`file`]), and dequantization of tensor
//! data to `f32` ([`dequant`]).
//!
//! Every length and offset read from a file is checked against the file's size: a truncated or
//! corrupt file is an [`GgufError`] naming what is wrong, never a panic.

pub mod dequant;
pub mod file;

pub use dequant::{dequantize, GgmlType};
pub use file::{GgufError, GgufFile, MetadataValue, TensorInfo};
