//! A weight matrix kept in its GGUF blocks, and `x · Wᵀ` for f32 activations.
//!
//! Q4_0, Q4_1 and Q8_0 can be rearranged by panels of 16 rows ([`WeightMatrix::add_panels`],
//! the blocks' bytes): one 16-byte load is one column of 16 rows, and every step multiplies
//! from them, so the row-major blocks can go ([`WeightMatrix::keep_only_panels`]). With AVX-512
//! a step decodes the panels in registers, eight activation rows a pass; where the CPU also has
//! AMX, steps of [`AMX_MIN_BATCH`] rows or more multiply the panels on the tiles instead
//! (`simd::amx`: exact quants times activations split into three bf16 parts, f32 sums). With
//! AVX2, up to [`PANEL_GEMV_AVX2_MAX_BATCH`] activation rows multiply the panels decoded in
//! registers too, half a panel to a register (`simd::panel_gemv_avx2`), and one row of a 4-bit
//! matrix multiplies the panels with integer instructions, its values split into three 8-bit
//! digits that keep f32's precision (`simd::panel_digits_avx2`); from 9 rows on each task
//! decodes a panel of 16 weight rows, a tile of columns at a time, into an L1-resident `[k][16]`
//! f32 buffer — exactly GGUF's dequantization — and a register-blocked FMA kernel multiplies it
//! against every activation row, so each weight is read and decoded once per step whatever the
//! batch. A matrix without panels (another format) decodes its row-major blocks: in registers
//! for a few rows (the GEMV paths in `simd`), else row by row into the same `[k][16]` buffer. The
//! portable path decodes 4 rows of [`TILE`] values at a time and multiplies them in plain Rust.
//!
//! This file holds the type and its API; `paths` chooses a product's path and runs each task's
//! share on it, `decoded` holds the two paths that decode weights into L1 (packed, portable).

use rivulet_gguf::dequant::dequantize_append;
use rivulet_gguf::GgmlType;

use crate::simd;
use crate::KernelError;

mod decoded;
mod paths;

/// Values of each row the portable path decodes at a time: whole blocks of every format.
const TILE: usize = 512;

/// Values of each row per panel tile of the packed path: whole blocks of every format, and a
/// packed panel of 256 × 16 × 4 bytes = 16 KiB stays in L1.
const PACKED_TILE: usize = 256;

/// Weight rows a task decodes together (the register kernel's height).
const STRIP: usize = 4;

/// Activation rows from which a product runs on AMX tiles where the CPU has them: below, a
/// tile of 16 rows would be mostly padding and the AVX-512 GEMV is as fast.
pub const AMX_MIN_BATCH: usize = 16;

/// Bytes of activations one tile of the panel path's rows takes (a quarter of a typical 1 MiB
/// L2). A task sweeps every panel it owns over one tile of activation rows before the next, so
/// the rows stay in L2 between panels: sweeping all rows per panel re-read a 512-row prefill's
/// 1.2–3 MiB of activations from L3 for each of the task's panels (3–7% slower at 256–512 rows
/// on a Zen 5 EPYC; steps of up to 112 rows of 576 values, 40 of 1536, are one tile as before).
const PANEL_TILE_BYTES: usize = 256 << 10;

/// Activation rows of `cols` values per tile of the panel path: a multiple of
/// [`simd::PANEL_GEMV_ROWS`], at least one pass.
fn panel_tile_rows(cols: usize) -> usize {
    let rows = PANEL_TILE_BYTES / (4 * cols.max(1));
    (rows / simd::PANEL_GEMV_ROWS * simd::PANEL_GEMV_ROWS).max(simd::PANEL_GEMV_ROWS)
}

/// Activation rows up to which an AVX2 CPU multiplies straight from the panels, decoded in
/// registers (`simd::panel_gemv_avx2`); larger steps decode each panel once into L1 (`Packed`),
/// where the register kernel's 6 × 16 block reuses each decoded weight more.
const PANEL_GEMV_AVX2_MAX_BATCH: usize = 8;

/// A `[rows, cols]` matrix in one of GGUF's formats, row-major, each row whole blocks.
#[derive(Debug, Clone)]
pub struct WeightMatrix {
    format: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: Vec<u8>,
    /// The same blocks rearranged by 16-row panels ([`simd::Panels`]); made by
    /// [`Self::add_panels`] (Q4_0, Q4_1, Q8_0 on an AVX2 CPU).
    panels: Option<simd::Panels>,
    /// Whether `data` was let go because the panels serve every step
    /// ([`Self::keep_only_panels`]): then every product comes from the panels and rows are read
    /// back from them.
    panels_only: bool,
}

impl WeightMatrix {
    /// Takes `data` as `rows` rows of `cols` values of `format`.
    pub fn new(format: GgmlType, rows: usize, cols: usize, data: Vec<u8>) -> Result<Self, KernelError> {
        if rivulet_gguf::dequantize(format, &[], 0).is_err() {
            return Err(KernelError::UnsupportedFormat(format));
        }
        let row_bytes = format
            .byte_len(cols as u64)
            .ok_or(KernelError::RowNotWholeBlocks { format, cols })? as usize;
        let expected = row_bytes.checked_mul(rows).ok_or(KernelError::TooLarge)?;
        if data.len() != expected {
            return Err(KernelError::DataLength {
                format,
                rows,
                cols,
                expected,
                got: data.len(),
            });
        }
        Ok(Self {
            format,
            rows,
            cols,
            row_bytes,
            data,
            panels: None,
            panels_only: false,
        })
    }

    /// An f32 matrix from row-major values.
    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Result<Self, KernelError> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::new(GgmlType::F32, rows, cols, data)
    }

    /// Stacks matrices of one format and width row-wise (e.g. Q, K and V into one projection);
    /// `None` when their formats or widths differ.
    pub fn stack(parts: &[WeightMatrix]) -> Option<Self> {
        let first = parts.first()?;
        if parts
            .iter()
            .any(|p| p.format != first.format || p.cols != first.cols || p.panels_only)
        {
            return None;
        }
        let data = parts.iter().flat_map(|p| p.data.iter().copied()).collect();
        let rows = parts.iter().map(|p| p.rows).sum();
        Self::new(first.format, rows, first.cols, data).ok()
    }

    pub fn format(&self) -> GgmlType {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes the weights occupy in one copy (what one step streams).
    pub fn byte_len(&self) -> usize {
        match &self.panels {
            Some(panels) if self.panels_only => panels.byte_len(),
            _ => self.data.len(),
        }
    }

    /// Bytes the weights occupy in memory: the blocks, and their copy rearranged for large
    /// batches if [`Self::add_panels`] made one.
    pub fn resident_bytes(&self) -> usize {
        self.data.len() + self.panels.as_ref().map_or(0, simd::Panels::byte_len)
    }

    /// Whether the matrix keeps panels.
    pub fn has_panels(&self) -> bool {
        self.panels.is_some()
    }

    /// Keeps, beside the blocks, a copy rearranged by panels of 16 rows (`simd::Panels`; the
    /// blocks' bytes for Q4_1 and Q8_0, ~1.1× for Q4_0), which every step then multiplies from
    /// ([`Self::keep_only_panels`] lets the blocks go). Only Q4_0, Q4_1 and Q8_0 on an AVX2 CPU
    /// have them; for anything else this does nothing.
    pub fn add_panels(&mut self) {
        if self.panels.is_none() && simd::has_avx2() {
            self.panels = simd::Panels::new(self.format, &self.data, self.rows, self.cols / 32, self.row_bytes);
        }
    }

    /// Lets the row-major blocks go where panels exist (they serve every step): the matrix then
    /// takes its bytes once instead of twice. Every product then comes from the panels whatever
    /// [`Isa`] is asked for, and rows are read back from them, byte for byte (so an embedding
    /// lookup gives the same values). Returns whether the blocks went.
    pub fn keep_only_panels(&mut self) -> bool {
        if self.panels.is_some() {
            self.data = Vec::new();
            self.panels_only = true;
        }
        self.panels_only
    }

    /// Row `row` as f32 (an embedding lookup), appended to `out`.
    pub fn dequantize_row(&self, row: usize, out: &mut Vec<f32>) -> Result<(), KernelError> {
        if row >= self.rows {
            return Err(KernelError::RowOutOfRange { row, rows: self.rows });
        }
        match &self.panels {
            Some(panels) if self.panels_only => {
                dequantize_append(self.format, &panels.row_blocks(self.format, row), out)
            }
            _ => dequantize_append(
                self.format,
                &self.data[row * self.row_bytes..(row + 1) * self.row_bytes],
                out,
            ),
        }
        .map_err(KernelError::UnsupportedFormat)
    }

    /// The whole matrix as f32 (for tests and references).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for row in 0..self.rows {
            // In range, and `new` checked the format is supported.
            let _ = self.dequantize_row(row, &mut out);
        }
        out
    }

    /// `out = x · selfᵀ`: `x` is `[batch, cols]`, `out` is `[batch, rows]`, both row-major.
    /// Runs on the current rayon pool, with the best code path this CPU has.
    pub fn matmul(&self, x: &[f32], batch: usize, out: &mut [f32]) -> Result<(), KernelError> {
        self.matmul_on(Isa::best(), x, batch, out)
    }

    /// [`Self::matmul`] on a chosen code path (tests and benchmarks compare them).
    pub fn matmul_on(&self, isa: Isa, x: &[f32], batch: usize, out: &mut [f32]) -> Result<(), KernelError> {
        self.matmul_into_columns(isa, x, batch, out, self.rows, 0)
    }

    /// `x · selfᵀ` into columns `first_column..first_column + rows` of `out`, a `[batch,
    /// out_width]` matrix (so projections stored apart fill one fused output).
    /// Every element of those columns is stored (never accumulated into), whatever `out` held.
    pub fn matmul_into_columns(
        &self,
        isa: Isa,
        x: &[f32],
        batch: usize,
        out: &mut [f32],
        out_width: usize,
        first_column: usize,
    ) -> Result<(), KernelError> {
        check_len("activations", x.len(), batch * self.cols)?;
        check_len("output", out.len(), batch * out_width)?;
        if first_column + self.rows > out_width {
            return Err(KernelError::Shape {
                what: "output columns",
                expected: out_width,
                got: first_column + self.rows,
            });
        }
        if batch == 0 || self.rows == 0 {
            return Ok(());
        }
        let path = paths::Path::choose(self, isa, batch);
        self.product_on(path, x, batch, out, out_width, first_column);
        Ok(())
    }
}

/// A code path of the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AMX tiles (bf16 products of the exact quants and split activations, `simd::amx`) for
    /// steps of [`AMX_MIN_BATCH`] rows or more where a matrix keeps panels; [`Isa::Avx512`]
    /// otherwise.
    Amx,
    /// AVX-512F on top of [`Isa::Avx2`]: products straight from the panels, decoded in
    /// registers (`simd::panel_gemv`), where a matrix keeps them; the AVX2 paths otherwise.
    Avx512,
    /// AVX2 + FMA + F16C, chosen at run time where the CPU has them.
    Avx2,
    /// Plain Rust that the compiler vectorizes for the baseline target.
    Portable,
}

impl Isa {
    /// The fastest path this CPU runs.
    pub fn best() -> Self {
        if simd::has_amx() {
            Self::Amx
        } else if simd::has_avx512() {
            Self::Avx512
        } else if simd::has_avx2() {
            Self::Avx2
        } else {
            Self::Portable
        }
    }

    /// Every path this CPU runs, fastest first (tests and benchmarks compare them).
    pub fn available() -> Vec<Self> {
        [
            (simd::has_amx(), Self::Amx),
            (simd::has_avx512(), Self::Avx512),
            (simd::has_avx2(), Self::Avx2),
            (true, Self::Portable),
        ]
        .into_iter()
        .filter_map(|(present, isa)| present.then_some(isa))
        .collect()
    }
}

fn check_len(what: &'static str, got: usize, expected: usize) -> Result<(), KernelError> {
    if got == expected {
        Ok(())
    } else {
        Err(KernelError::Shape { what, expected, got })
    }
}
