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

use rayon::prelude::*;
use rivulet_gguf::dequant::dequantize_append;
use rivulet_gguf::GgmlType;

use crate::simd::{self, SharedOutput};
use crate::KernelError;

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
        // With AMX and panels, batches of `AMX_MIN_BATCH` or more run on the tiles (`PanelAmx`).
        // With AVX-512 and panels, batches of `packed_avx512_min_rows` or more decode each pair
        // of panels once into L1 and multiply it in register tiles (`PackedAvx512`); smaller ones
        // multiply straight from the panels, decoded in registers, eight activation rows a pass
        // (`PanelGemv`; one row against 4-bit panels on its 8-bit digits where the CPU has
        // AVX-512BW); with AVX2, batches of up to `PANEL_GEMV_AVX2_MAX_BATCH` (`PanelGemvAvx2`).
        // Without panels, small batches decode each row-major block in registers and use it at
        // once (`Gemv`; one or two rows against Q4_1 with the block minimum factored out,
        // `GemvQ4_1`). Larger ones decode a panel of
        // rows once into L1 and run a register-blocked kernel over every activation row
        // (`Packed`, from the panels where they exist); `Portable` is the same idea in plain Rust.
        let whole_blocks = self.cols.is_multiple_of(32);
        let panels = self.panels.is_some();
        let path = match isa {
            Isa::Amx if panels && batch >= AMX_MIN_BATCH && self.cols > 0 => Path::PanelAmx,
            Isa::Avx512 | Isa::Amx if panels && batch >= simd::packed_avx512_min_rows() && self.cols > 0 => {
                Path::PackedAvx512
            }
            Isa::Avx512 | Isa::Amx if panels => Path::PanelGemv,
            // Where only the panels remain, a path that reads the blocks takes the panels' instead.
            _ if self.panels_only && simd::has_avx512() => Path::PanelGemv,
            Isa::Avx2 | Isa::Portable
                if panels && batch <= PANEL_GEMV_AVX2_MAX_BATCH && (isa == Isa::Avx2 || self.panels_only) =>
            {
                Path::PanelGemvAvx2
            }
            _ if self.panels_only => Path::Packed,
            Isa::Avx2 | Isa::Avx512 | Isa::Amx
                if batch <= simd::GEMV_Q4_1_MAX_BATCH && self.format == GgmlType::Q4_1 && whole_blocks =>
            {
                Path::GemvQ4_1
            }
            Isa::Avx2 | Isa::Avx512 | Isa::Amx
                if batch <= simd::GEMV_MAX_BATCH && simd::gemv_decodes(self.format) && whole_blocks =>
            {
                Path::Gemv
            }
            Isa::Avx2 | Isa::Avx512 | Isa::Amx => Path::Packed,
            Isa::Portable => Path::Portable,
        };
        let unit = if matches!(
            path,
            Path::Packed | Path::PackedAvx512 | Path::PanelGemv | Path::PanelGemvAvx2 | Path::PanelAmx
        ) {
            simd::PANEL
        } else {
            STRIP
        };
        let units = self.rows.div_ceil(unit);
        // Several tasks per thread so that a slow core does not hold the step up.
        let per_task = units.div_ceil(rayon::current_num_threads() * 4).max(1);
        let output = SharedOutput::new(out, batch, out_width);
        let q4_1_activations = match path {
            Path::GemvQ4_1 => simd::Q4_1Activations::new(x, self.cols, batch, self.cols),
            _ => simd::Q4_1Activations::default(),
        };
        // Only 4-bit panels meet their offsets with the activations' block sums.
        let block_sums = match path {
            Path::PanelGemv | Path::PanelGemvAvx2 if self.format != GgmlType::Q8_0 => {
                simd::block_sums(x, self.cols, batch, self.cols)
            }
            _ => Vec::new(),
        };
        let split = match path {
            Path::PanelAmx => simd::SplitActivations::new(x, self.cols, batch, self.cols),
            _ => simd::SplitActivations::default(),
        };
        // One 4-bit row on AVX2 multiplies its 8-bit digits with integer instructions instead
        // (`simd::panel_digits_avx2`), unless a value is not finite.
        let digits = match path {
            Path::PanelGemvAvx2 if batch == 1 && self.format != GgmlType::Q8_0 && simd::digits_enabled() => {
                simd::ActivationDigits::new(&x[..self.cols])
            }
            // And on AVX-512BW, two panels at once (`simd::panel_digits_avx512`, or with VNNI
            // `simd::panel_digits_vnni`).
            Path::PanelGemv
                if batch == 1 && self.format != GgmlType::Q8_0 && simd::digits_enabled() && simd::has_avx512bw() =>
            {
                simd::ActivationDigits::new(&x[..self.cols])
            }
            // Q8_0 too where `vpdpbusd` and `vpermb` exist (`simd::panel_digits_vnni`).
            Path::PanelGemv if batch == 1 && simd::digits_enabled() && simd::has_avx512_vnni_vbmi() => {
                simd::ActivationDigits::new(&x[..self.cols])
            }
            _ => None,
        };
        let pair_kernel = simd::DigitPairKernel::detect();
        // Batches of f32 rows against 4-bit panels take two panels a pass on AVX-512 from
        // `PANEL_PAIR_MIN_ROWS` rows on (`simd::panel_pair_gemv`; larger ones `PackedAvx512`).
        // (Rows of no columns have no panel blocks to pair.)
        let pair_panels = path == Path::PanelGemv
            && digits.is_none()
            && batch >= simd::PANEL_PAIR_MIN_ROWS
            && self.format != GgmlType::Q8_0
            && self.cols > 0;
        // Whole pairs of panels per task where an AVX-512 kernel takes two at once, and whole
        // groups of panels where the AMX path takes several at once.
        let per_task = match (path, &digits) {
            (Path::PanelGemv, digits) if digits.is_some() || pair_panels => per_task.next_multiple_of(2),
            (Path::PackedAvx512, _) => per_task.next_multiple_of(2),
            (Path::PanelAmx, _) => per_task.next_multiple_of(simd::AMX_PANELS),
            _ => per_task,
        };
        (0..units.div_ceil(per_task)).into_par_iter().for_each(|task| {
            let first = task * per_task * unit;
            let last = ((task + 1) * per_task * unit).min(self.rows);
            match path {
                Path::GemvQ4_1 => {
                    let mut sums = [0f32; STRIP * simd::GEMV_Q4_1_MAX_BATCH];
                    for row in (first..last).step_by(STRIP) {
                        let rows = STRIP.min(last - row);
                        let bytes = &self.data[row * self.row_bytes..(row + rows) * self.row_bytes];
                        simd::gemv_q4_1_avx2(bytes, self.row_bytes, rows, &q4_1_activations, &mut sums);
                        output.store_columns(first_column + row, rows, &sums[..rows * batch]);
                    }
                }
                Path::Gemv => {
                    let mut sums = [0f32; STRIP * simd::GEMV_MAX_BATCH];
                    for row in (first..last).step_by(STRIP) {
                        let rows = STRIP.min(last - row);
                        let bytes = &self.data[row * self.row_bytes..(row + rows) * self.row_bytes];
                        simd::gemv_rows_avx2(
                            self.format,
                            bytes,
                            self.row_bytes,
                            rows,
                            self.cols,
                            x,
                            self.cols,
                            batch,
                            &mut sums,
                        );
                        output.store_columns(first_column + row, rows, &sums[..rows * batch]);
                    }
                }
                Path::PanelGemv => SCRATCH.with_borrow_mut(|scratch| {
                    // `PanelGemv` is chosen only where panels exist.
                    if let (Some(panels), Some(_)) = (&self.panels, &digits) {
                        // The pair kernels fetch far ahead of the blocks they read, so a task's
                        // first blocks are fetched here (`Panels::fetch_pairs_start`).
                        panels.fetch_pairs_start(first / simd::PANEL);
                    }
                    if let (Some(panels), Some(digits), GgmlType::Q8_0) = (&self.panels, &digits, self.format) {
                        // One row's digits against Q8_0 panels, two panels a pass.
                        scratch.sums.resize(2 * simd::PANEL, 0.0);
                        for panel in (first..last).step_by(2 * simd::PANEL) {
                            let rows = (2 * simd::PANEL).min(last - panel);
                            panels.product_digits_q8_vnni(panel / simd::PANEL, digits, &mut scratch.sums);
                            output.store_rows(0..1, first_column + panel, rows, &scratch.sums, 2 * simd::PANEL);
                        }
                    } else if let (Some(panels), Some(digits)) = (&self.panels, &digits) {
                        // One row's digits against 4-bit panels, two panels a pass (the last of
                        // an odd count on the AVX2 digit kernel).
                        scratch.sums.resize(2 * simd::PANEL, 0.0);
                        let mut panel = first;
                        while panel < last {
                            let rows = (2 * simd::PANEL).min(last - panel);
                            if let (true, Some(kernel)) = (rows > simd::PANEL, pair_kernel) {
                                panels.product_digits_pair(
                                    kernel,
                                    panel / simd::PANEL,
                                    digits,
                                    &block_sums,
                                    &mut scratch.sums,
                                );
                            } else {
                                panels.product_digits_avx2(panel / simd::PANEL, digits, &block_sums, &mut scratch.sums);
                            }
                            output.store_rows(0..1, first_column + panel, rows, &scratch.sums, 2 * simd::PANEL);
                            panel += rows;
                        }
                    } else if let Some(panels) = &self.panels {
                        let tile = panel_tile_rows(self.cols);
                        scratch.sums.resize(tile.min(batch) * 2 * simd::PANEL, 0.0);
                        for first_row in (0..batch).step_by(tile) {
                            let tile_rows = tile.min(batch - first_row);
                            let (x, sums) = (
                                &x[first_row * self.cols..],
                                block_sums.get(first_row * self.cols / 32..).unwrap_or_default(),
                            );
                            let mut panel = first;
                            while panel < last {
                                // Two 4-bit panels a pass where both hold rows of this task
                                // (`simd::panel_pair_gemv`), else one.
                                let rows = (2 * simd::PANEL).min(last - panel);
                                let (rows, stride) = if pair_panels && rows > simd::PANEL {
                                    panels.product_avx512_pair(
                                        panel / simd::PANEL,
                                        x,
                                        self.cols,
                                        sums,
                                        tile_rows,
                                        &mut scratch.sums,
                                    );
                                    (rows, 2 * simd::PANEL)
                                } else {
                                    let index = panel / simd::PANEL;
                                    panels.product_avx512(index, x, self.cols, sums, tile_rows, &mut scratch.sums);
                                    (rows.min(simd::PANEL), simd::PANEL)
                                };
                                output.store_rows(
                                    first_row..first_row + tile_rows,
                                    first_column + panel,
                                    rows,
                                    &scratch.sums,
                                    stride,
                                );
                                panel += rows;
                            }
                        }
                    }
                }),
                Path::PanelGemvAvx2 => SCRATCH.with_borrow_mut(|scratch| {
                    // `PanelGemvAvx2` is chosen only where panels exist.
                    if let Some(panels) = &self.panels {
                        scratch.sums.resize(batch * simd::PANEL, 0.0);
                        for panel in (first..last).step_by(simd::PANEL) {
                            let rows = simd::PANEL.min(last - panel);
                            match &digits {
                                Some(digits) => panels.product_digits_avx2(
                                    panel / simd::PANEL,
                                    digits,
                                    &block_sums,
                                    &mut scratch.sums,
                                ),
                                None => panels.product_avx2(
                                    panel / simd::PANEL,
                                    x,
                                    self.cols,
                                    &block_sums,
                                    batch,
                                    &mut scratch.sums,
                                ),
                            }
                            output.store_rows(0..batch, first_column + panel, rows, &scratch.sums, simd::PANEL);
                        }
                    }
                }),
                Path::PanelAmx => {
                    // `PanelAmx` is chosen only where panels exist and the CPU has AMX.
                    if let Some(panels) = &self.panels {
                        let group = simd::AMX_PANELS * simd::PANEL;
                        simd::Tiles::with(|| {
                            for panel in (first..last).step_by(group) {
                                let rows = group.min(last - panel);
                                let panels_now = panel / simd::PANEL..(panel + rows).div_ceil(simd::PANEL);
                                panels.product_amx(panels_now, &split, &output, first_column + panel, rows);
                            }
                        });
                    }
                }
                Path::PackedAvx512 => SCRATCH.with_borrow_mut(|scratch| {
                    // `PackedAvx512` is chosen only where panels exist.
                    if let Some(panels) = &self.panels {
                        for panel in (first..last).step_by(2 * simd::PANEL) {
                            let rows = (2 * simd::PANEL).min(last - panel);
                            let (index, count) = (panel / simd::PANEL, rows.div_ceil(simd::PANEL));
                            let (decoded, sums) = (&mut scratch.packed, &mut scratch.sums);
                            let sums = panels.product_packed_avx512(index, count, x, self.cols, batch, decoded, sums);
                            output.store_rows(0..batch, first_column + panel, rows, sums, 2 * simd::PANEL);
                        }
                    }
                }),
                Path::Packed => SCRATCH.with_borrow_mut(|scratch| {
                    for panel in (first..last).step_by(simd::PANEL) {
                        let rows = simd::PANEL.min(last - panel);
                        let sums = self.panel_product(panel, rows, last, x, batch, scratch);
                        output.store_rows(0..batch, first_column + panel, rows, sums, simd::PANEL);
                    }
                }),
                Path::Portable => SCRATCH.with_borrow_mut(|scratch| {
                    self.rows_product(first, last - first, x, batch, scratch);
                    output.store_columns(
                        first_column + first,
                        last - first,
                        &scratch.sums[..(last - first) * batch],
                    );
                }),
            }
        });
        Ok(())
    }

    /// Rows `first..first + rows` (at most `PANEL`) times `x` as `[batch][PANEL]` sums (in
    /// `scratch.sums`), one column tile of `PACKED_TILE` at a time. `task_end` ends the
    /// calling task's rows: the next panel is prefetched only if it is the task's own.
    fn panel_product<'s>(
        &self,
        first: usize,
        rows: usize,
        task_end: usize,
        x: &[f32],
        batch: usize,
        scratch: &'s mut Scratch,
    ) -> &'s [f32] {
        let Scratch {
            tile,
            sums,
            decoded,
            packed,
        } = scratch;
        // Both from a cache line on (`simd::cache_aligned`): 256-bit loads and stores that
        // never straddle two.
        let sums = simd::cache_aligned(sums, batch * simd::PANEL);
        sums.fill(0.0);
        let packed = simd::cache_aligned(packed, PACKED_TILE * simd::PANEL);
        if let Some(panels) = &self.panels {
            self.product_from_panels(panels, first, task_end, x, batch, sums, packed);
            return sums;
        }
        tile.resize(simd::PANEL * PACKED_TILE, 0.0);
        let mut start = 0;
        let next_panel = first + simd::PANEL..(first + 2 * simd::PANEL).min(task_end);
        while start < self.cols {
            let len = PACKED_TILE.min(self.cols - start);
            // The next panel's bytes for this tile, on their way while this one computes: 16 rows
            // read a few blocks at a time are more streams than the hardware prefetcher follows.
            let bytes = self.row_bytes * start / self.cols..self.row_bytes * (start + len) / self.cols;
            for row in next_panel.clone() {
                simd::prefetch(&self.data[row * self.row_bytes..][bytes.clone()]);
            }
            for r in 0..simd::PANEL {
                let dst = &mut tile[r * PACKED_TILE..r * PACKED_TILE + len];
                if r < rows {
                    self.decode_segment(Isa::Avx2, first + r, start, dst, decoded);
                } else {
                    dst.fill(0.0);
                }
            }
            simd::pack_panel_avx2(tile, PACKED_TILE, len, packed);
            simd::gemm_panel_avx2(packed, len, &x[start..], self.cols, batch, sums);
            start += len;
        }
        sums
    }

    /// [`Self::panel_product`] from the panels: each tile of [`PACKED_TILE`] columns decodes
    /// straight into `packed`. A panel's blocks are one stream, tile after tile; the next tile
    /// (or the task's next panel's first) is fetched while this one computes.
    #[allow(clippy::too_many_arguments)]
    fn product_from_panels(
        &self,
        panels: &simd::Panels,
        first: usize,
        task_end: usize,
        x: &[f32],
        batch: usize,
        sums: &mut [f32],
        packed: &mut [f32],
    ) {
        // Tasks start on whole panels (`first` is a multiple of PANEL).
        let panel = first / simd::PANEL;
        let blocks = self.cols / 32;
        let tile_blocks = PACKED_TILE / 32;
        for block in (0..blocks).step_by(tile_blocks) {
            let end = (block + tile_blocks).min(blocks);
            let next = if end < blocks {
                Some((panel, end..(end + tile_blocks).min(blocks)))
            } else {
                (first + simd::PANEL < task_end).then_some((panel + 1, 0..tile_blocks.min(blocks)))
            };
            if let Some((next_panel, next_blocks)) = next {
                simd::prefetch(panels.blocks(next_panel, next_blocks));
            }
            panels.decode_avx2(panel, block..end, packed);
            let len = (end - block) * 32;
            simd::gemm_panel_avx2(packed, len, &x[block * 32..], self.cols, batch, sums);
        }
    }

    /// Decodes values `start..start + dst.len()` of row `row` into `dst` (whole blocks).
    fn decode_segment(&self, isa: Isa, row: usize, start: usize, dst: &mut [f32], decoded: &mut Vec<f32>) {
        let len = dst.len();
        let byte_range = self.row_bytes * start / self.cols..self.row_bytes * (start + len) / self.cols;
        let bytes = &self.data[row * self.row_bytes..(row + 1) * self.row_bytes][byte_range];
        if isa != Isa::Portable && simd::avx2_decodes(self.format) && len.is_multiple_of(8) {
            simd::decode_avx2(self.format, bytes, dst);
        } else {
            decoded.clear();
            // `new` checked the format is supported.
            let _ = dequantize_append(self.format, bytes, decoded);
            dst.copy_from_slice(&decoded[..len]);
        }
    }

    /// The portable path: fills `scratch.sums` (`[rows][batch]`) with rows `first..first + rows`
    /// times `x`, decoding [`TILE`] values of 4 rows at a time and multiplying them against
    /// every activation row.
    fn rows_product(&self, first: usize, rows: usize, x: &[f32], batch: usize, scratch: &mut Scratch) {
        let Scratch {
            tile, sums, decoded, ..
        } = scratch;
        sums.clear();
        sums.resize(rows.div_ceil(STRIP) * STRIP * batch, 0.0);
        tile.resize(STRIP * TILE, 0.0);
        let mut start = 0;
        while start < self.cols {
            let len = TILE.min(self.cols - start);
            for strip in (0..rows).step_by(STRIP) {
                for r in 0..STRIP {
                    let dst = &mut tile[r * TILE..r * TILE + len];
                    if strip + r < rows {
                        self.decode_segment(Isa::Portable, first + strip + r, start, dst, decoded);
                    } else {
                        dst.fill(0.0);
                    }
                }
                let strip_sums = &mut sums[strip * batch..(strip + STRIP) * batch];
                dot_4xn_portable(tile, TILE, &x[start..], self.cols, batch, len, strip_sums);
            }
            start += len;
        }
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

/// Per-thread buffers, reused across calls so that the hot loop does not allocate.
#[derive(Default)]
struct Scratch {
    /// Decoded weights: `[STRIP][TILE]` (portable) or `[PANEL][PACKED_TILE]` (packed).
    tile: Vec<f32>,
    /// `[STRIP][batch]` partial products.
    sums: Vec<f32>,
    /// The portable decoder's output.
    decoded: Vec<f32>,
    /// `[PACKED_TILE][PANEL]` transposed weights.
    packed: Vec<f32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    PanelAmx,
    PackedAvx512,
    PanelGemv,
    PanelGemvAvx2,
    GemvQ4_1,
    Gemv,
    Packed,
    Portable,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// `out[r][b] += Σ_k w[r][k] · x[b][k]` for 4 weight rows and every activation row, as 8-wide partial sums that the compiler vectorizes
/// with whatever the baseline target has.
fn dot_4xn_portable(w: &[f32], w_stride: usize, x: &[f32], x_stride: usize, batch: usize, len: usize, out: &mut [f32]) {
    for b in 0..batch {
        let xs = &x[b * x_stride..b * x_stride + len];
        for r in 0..STRIP {
            let ws = &w[r * w_stride..r * w_stride + len];
            let mut lanes = [0f32; 8];
            let mut chunks_w = ws.chunks_exact(8);
            let mut chunks_x = xs.chunks_exact(8);
            for (cw, cx) in (&mut chunks_w).zip(&mut chunks_x) {
                for i in 0..8 {
                    lanes[i] += cw[i] * cx[i];
                }
            }
            let tail: f32 = chunks_w
                .remainder()
                .iter()
                .zip(chunks_x.remainder())
                .map(|(a, b)| a * b)
                .sum();
            out[r * batch + b] += lanes.iter().sum::<f32>() + tail;
        }
    }
}

fn check_len(what: &'static str, got: usize, expected: usize) -> Result<(), KernelError> {
    if got == expected {
        Ok(())
    } else {
        Err(KernelError::Shape { what, expected, got })
    }
}
