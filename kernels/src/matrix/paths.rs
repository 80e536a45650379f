//! Which kernel a product runs on ([`Path`]), the activations prepared once for it
//! ([`Product`]), and one task's share of the work on each path: a contiguous range of weight
//! rows (whole panels where the path reads panels), its columns of the output written by that
//! task alone.

use std::ops::Range;

use rayon::prelude::*;
use rivulet_gguf::GgmlType;

use super::decoded::SCRATCH;
use super::{panel_tile_rows, Isa, WeightMatrix, AMX_MIN_BATCH, PANEL_GEMV_AVX2_MAX_BATCH, STRIP};
use crate::simd::{self, SharedOutput};

/// A kernel for one product, chosen by [`Path::choose`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Path {
    PanelAmx,
    PackedAvx512,
    PanelGemv,
    PanelGemvAvx2,
    GemvQ4_1,
    Gemv,
    Packed,
    Portable,
}

impl Path {
    /// The path for `batch` activation rows times `matrix` on code path `isa`.
    ///
    /// With AMX and panels, batches of `AMX_MIN_BATCH` or more run on the tiles (`PanelAmx`).
    /// With AVX-512 and panels, batches of `packed_avx512_min_rows` or more decode each pair
    /// of panels once into L1 and multiply it in register tiles (`PackedAvx512`); smaller ones
    /// multiply straight from the panels, decoded in registers, eight activation rows a pass
    /// (`PanelGemv`; one row against 4-bit panels on its 8-bit digits where the CPU has
    /// AVX-512BW); with AVX2, batches of up to `PANEL_GEMV_AVX2_MAX_BATCH` (`PanelGemvAvx2`).
    /// Without panels, small batches decode each row-major block in registers and use it at
    /// once (`Gemv`; one or two rows against Q4_1 with the block minimum factored out,
    /// `GemvQ4_1`). Larger ones decode a panel of
    /// rows once into L1 and run a register-blocked kernel over every activation row
    /// (`Packed`, from the panels where they exist); `Portable` is the same idea in plain Rust.
    pub(super) fn choose(matrix: &WeightMatrix, isa: Isa, batch: usize) -> Self {
        let whole_blocks = matrix.cols.is_multiple_of(32);
        let panels = matrix.panels.is_some();
        match isa {
            Isa::Amx if panels && batch >= AMX_MIN_BATCH && matrix.cols > 0 => Path::PanelAmx,
            Isa::Avx512 | Isa::Amx if panels && batch >= simd::packed_avx512_min_rows() && matrix.cols > 0 => {
                Path::PackedAvx512
            }
            Isa::Avx512 | Isa::Amx if panels => Path::PanelGemv,
            // Where only the panels remain, a path that reads the blocks takes the panels' instead.
            _ if matrix.panels_only && simd::has_avx512() => Path::PanelGemv,
            Isa::Avx2 | Isa::Portable
                if panels && batch <= PANEL_GEMV_AVX2_MAX_BATCH && (isa == Isa::Avx2 || matrix.panels_only) =>
            {
                Path::PanelGemvAvx2
            }
            _ if matrix.panels_only => Path::Packed,
            Isa::Avx2 | Isa::Avx512 | Isa::Amx
                if batch <= simd::GEMV_Q4_1_MAX_BATCH && matrix.format == GgmlType::Q4_1 && whole_blocks =>
            {
                Path::GemvQ4_1
            }
            Isa::Avx2 | Isa::Avx512 | Isa::Amx
                if batch <= simd::GEMV_MAX_BATCH && simd::gemv_decodes(matrix.format) && whole_blocks =>
            {
                Path::Gemv
            }
            Isa::Avx2 | Isa::Avx512 | Isa::Amx => Path::Packed,
            Isa::Portable => Path::Portable,
        }
    }

    /// Weight rows a task's share is counted in.
    fn unit(self) -> usize {
        match self {
            Path::Packed | Path::PackedAvx512 | Path::PanelGemv | Path::PanelGemvAvx2 | Path::PanelAmx => simd::PANEL,
            Path::GemvQ4_1 | Path::Gemv | Path::Portable => STRIP,
        }
    }
}

/// One product's inputs, shared by its tasks: the activations, and what the path prepares from
/// them once (so that no task repeats it).
pub(super) struct Product<'a> {
    x: &'a [f32],
    batch: usize,
    output: SharedOutput<'a>,
    first_column: usize,
    q4_1_activations: simd::Q4_1Activations,
    block_sums: Vec<f32>,
    split: simd::SplitActivations,
    digits: Option<simd::ActivationDigits>,
    pair_kernel: Option<simd::DigitPairKernel>,
    pair_panels: bool,
}

impl<'a> Product<'a> {
    /// What `path` needs of `x` (`batch` rows of `matrix.cols`), computed once for every task.
    fn prepare(
        matrix: &WeightMatrix,
        path: Path,
        x: &'a [f32],
        batch: usize,
        output: SharedOutput<'a>,
        first_column: usize,
    ) -> Self {
        let q4_1_activations = match path {
            Path::GemvQ4_1 => simd::Q4_1Activations::new(x, matrix.cols, batch, matrix.cols),
            _ => simd::Q4_1Activations::default(),
        };
        // Only 4-bit panels meet their offsets with the activations' block sums.
        let block_sums = match path {
            Path::PanelGemv | Path::PanelGemvAvx2 if matrix.format != GgmlType::Q8_0 => {
                simd::block_sums(x, matrix.cols, batch, matrix.cols)
            }
            _ => Vec::new(),
        };
        let split = match path {
            Path::PanelAmx => simd::SplitActivations::new(x, matrix.cols, batch, matrix.cols),
            _ => simd::SplitActivations::default(),
        };
        // One 4-bit row on AVX2 multiplies its 8-bit digits with integer instructions instead
        // (`simd::panel_digits_avx2`), unless a value is not finite.
        let digits = match path {
            Path::PanelGemvAvx2 if batch == 1 && matrix.format != GgmlType::Q8_0 && simd::digits_enabled() => {
                simd::ActivationDigits::new(&x[..matrix.cols])
            }
            // And on AVX-512BW, two panels at once (`simd::panel_digits_avx512`, or with VNNI
            // `simd::panel_digits_vnni`).
            Path::PanelGemv
                if batch == 1 && matrix.format != GgmlType::Q8_0 && simd::digits_enabled() && simd::has_avx512bw() =>
            {
                simd::ActivationDigits::new(&x[..matrix.cols])
            }
            // Q8_0 too where `vpdpbusd` and `vpermb` exist (`simd::panel_digits_vnni`).
            Path::PanelGemv if batch == 1 && simd::digits_enabled() && simd::has_avx512_vnni_vbmi() => {
                simd::ActivationDigits::new(&x[..matrix.cols])
            }
            _ => None,
        };
        // Batches of f32 rows against 4-bit panels take two panels a pass on AVX-512 from
        // `PANEL_PAIR_MIN_ROWS` rows on (`simd::panel_pair_gemv`; larger ones `PackedAvx512`).
        // (Rows of no columns have no panel blocks to pair.)
        let pair_panels = path == Path::PanelGemv
            && digits.is_none()
            && batch >= simd::PANEL_PAIR_MIN_ROWS
            && matrix.format != GgmlType::Q8_0
            && matrix.cols > 0;
        Self {
            x,
            batch,
            output,
            first_column,
            q4_1_activations,
            block_sums,
            split,
            digits,
            pair_kernel: simd::DigitPairKernel::detect(),
            pair_panels,
        }
    }

    /// Stores `[rows][batch]` sums into the output columns of weight rows `row..row + rows`.
    fn store_columns(&self, row: usize, rows: usize, sums: &[f32]) {
        self.output.store_columns(self.first_column + row, rows, sums);
    }

    /// Stores activation rows `batch_rows` of `[batch][stride]` sums into the output columns of
    /// weight rows `row..row + rows`.
    fn store_rows(&self, batch_rows: Range<usize>, row: usize, rows: usize, sums: &[f32], stride: usize) {
        self.output
            .store_rows(batch_rows, self.first_column + row, rows, sums, stride);
    }
}

impl WeightMatrix {
    /// `x · selfᵀ` on `path` into columns `first_column..first_column + self.rows` of `out`
    /// (`[batch][out_width]`), the rows split into tasks on the current rayon pool. The caller
    /// checked the shapes.
    pub(super) fn product_on(
        &self,
        path: Path,
        x: &[f32],
        batch: usize,
        out: &mut [f32],
        out_width: usize,
        first_column: usize,
    ) {
        let unit = path.unit();
        let units = self.rows.div_ceil(unit);
        // Several tasks per thread so that a slow core does not hold the step up.
        let per_task = units.div_ceil(rayon::current_num_threads() * 4).max(1);
        let output = SharedOutput::new(out, batch, out_width);
        let product = Product::prepare(self, path, x, batch, output, first_column);
        // Whole pairs of panels per task where an AVX-512 kernel takes two at once, and whole
        // groups of panels where the AMX path takes several at once.
        let per_task = match path {
            Path::PanelGemv if product.digits.is_some() || product.pair_panels => per_task.next_multiple_of(2),
            Path::PackedAvx512 => per_task.next_multiple_of(2),
            Path::PanelAmx => per_task.next_multiple_of(simd::AMX_PANELS),
            _ => per_task,
        };
        (0..units.div_ceil(per_task)).into_par_iter().for_each(|task| {
            let first = task * per_task * unit;
            let last = ((task + 1) * per_task * unit).min(self.rows);
            self.task(path, &product, first, last);
        });
    }

    /// One task's rows `first..last` of the product.
    fn task(&self, path: Path, product: &Product, first: usize, last: usize) {
        match path {
            Path::GemvQ4_1 => self.gemv_q4_1_task(product, first, last),
            Path::Gemv => self.gemv_task(product, first, last),
            Path::PanelGemv => self.panel_gemv_task(product, first, last),
            Path::PanelGemvAvx2 => self.panel_gemv_avx2_task(product, first, last),
            Path::PanelAmx => self.panel_amx_task(product, first, last),
            Path::PackedAvx512 => self.packed_avx512_task(product, first, last),
            Path::Packed => self.packed_task(product, first, last),
            Path::Portable => self.portable_task(product, first, last),
        }
    }

    /// One or two activation rows against row-major Q4_1 blocks, four weight rows a pass, the
    /// blocks' minimum factored out (`simd::gemv_q4_1_avx2`).
    fn gemv_q4_1_task(&self, product: &Product, first: usize, last: usize) {
        let Product {
            batch,
            ref q4_1_activations,
            ..
        } = *product;
        let mut sums = [0f32; STRIP * simd::GEMV_Q4_1_MAX_BATCH];
        for row in (first..last).step_by(STRIP) {
            let rows = STRIP.min(last - row);
            let bytes = &self.data[row * self.row_bytes..(row + rows) * self.row_bytes];
            simd::gemv_q4_1_avx2(bytes, self.row_bytes, rows, q4_1_activations, &mut sums);
            product.store_columns(row, rows, &sums[..rows * batch]);
        }
    }

    /// A few activation rows against row-major blocks decoded in registers, four weight rows a
    /// pass (`simd::gemv_rows_avx2`).
    fn gemv_task(&self, product: &Product, first: usize, last: usize) {
        let Product { x, batch, .. } = *product;
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
            product.store_columns(row, rows, &sums[..rows * batch]);
        }
    }

    /// Activation rows against the panels decoded in registers (AVX-512): one row on its 8-bit
    /// digits, else eight rows a pass, two 4-bit panels at once where the task holds both.
    fn panel_gemv_task(&self, product: &Product, first: usize, last: usize) {
        let Product {
            x,
            batch,
            ref block_sums,
            ref digits,
            pair_kernel,
            pair_panels,
            ..
        } = *product;
        SCRATCH.with_borrow_mut(|scratch| {
            // `PanelGemv` is chosen only where panels exist.
            if let (Some(panels), Some(_)) = (&self.panels, digits) {
                // The pair kernels fetch far ahead of the blocks they read, so a task's
                // first blocks are fetched here (`Panels::fetch_pairs_start`).
                panels.fetch_pairs_start(first / simd::PANEL);
            }
            if let (Some(panels), Some(digits), GgmlType::Q8_0) = (&self.panels, digits, self.format) {
                // One row's digits against Q8_0 panels, two panels a pass.
                scratch.sums.resize(2 * simd::PANEL, 0.0);
                for panel in (first..last).step_by(2 * simd::PANEL) {
                    let rows = (2 * simd::PANEL).min(last - panel);
                    panels.product_digits_q8_vnni(panel / simd::PANEL, digits, &mut scratch.sums);
                    product.store_rows(0..1, panel, rows, &scratch.sums, 2 * simd::PANEL);
                }
            } else if let (Some(panels), Some(digits)) = (&self.panels, digits) {
                // One row's digits against 4-bit panels, two panels a pass (the last of
                // an odd count on the AVX2 digit kernel).
                scratch.sums.resize(2 * simd::PANEL, 0.0);
                let mut panel = first;
                while panel < last {
                    let rows = (2 * simd::PANEL).min(last - panel);
                    if let (true, Some(kernel)) = (rows > simd::PANEL, pair_kernel) {
                        panels.product_digits_pair(kernel, panel / simd::PANEL, digits, block_sums, &mut scratch.sums);
                    } else {
                        panels.product_digits_avx2(panel / simd::PANEL, digits, block_sums, &mut scratch.sums);
                    }
                    product.store_rows(0..1, panel, rows, &scratch.sums, 2 * simd::PANEL);
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
                        product.store_rows(first_row..first_row + tile_rows, panel, rows, &scratch.sums, stride);
                        panel += rows;
                    }
                }
            }
        });
    }

    /// A few activation rows against the panels decoded in registers (AVX2), one row of a 4-bit
    /// matrix on its 8-bit digits.
    fn panel_gemv_avx2_task(&self, product: &Product, first: usize, last: usize) {
        let Product {
            x,
            batch,
            ref block_sums,
            ref digits,
            ..
        } = *product;
        SCRATCH.with_borrow_mut(|scratch| {
            // `PanelGemvAvx2` is chosen only where panels exist.
            if let Some(panels) = &self.panels {
                scratch.sums.resize(batch * simd::PANEL, 0.0);
                for panel in (first..last).step_by(simd::PANEL) {
                    let rows = simd::PANEL.min(last - panel);
                    match digits {
                        Some(digits) => {
                            panels.product_digits_avx2(panel / simd::PANEL, digits, block_sums, &mut scratch.sums)
                        }
                        None => {
                            panels.product_avx2(panel / simd::PANEL, x, self.cols, block_sums, batch, &mut scratch.sums)
                        }
                    }
                    product.store_rows(0..batch, panel, rows, &scratch.sums, simd::PANEL);
                }
            }
        });
    }

    /// Tiles of 16 activation rows against the panels on the AMX tiles, [`simd::AMX_PANELS`]
    /// panels a call.
    fn panel_amx_task(&self, product: &Product, first: usize, last: usize) {
        let Product { ref split, .. } = *product;
        // `PanelAmx` is chosen only where panels exist and the CPU has AMX.
        if let Some(panels) = &self.panels {
            let group = simd::AMX_PANELS * simd::PANEL;
            simd::Tiles::with(|| {
                for panel in (first..last).step_by(group) {
                    let rows = group.min(last - panel);
                    let panels_now = panel / simd::PANEL..(panel + rows).div_ceil(simd::PANEL);
                    panels.product_amx(panels_now, split, &product.output, product.first_column + panel, rows);
                }
            });
        }
    }

    /// Each pair of panels decoded once into L1 and multiplied in register tiles (AVX-512).
    fn packed_avx512_task(&self, product: &Product, first: usize, last: usize) {
        let Product { x, batch, .. } = *product;
        SCRATCH.with_borrow_mut(|scratch| {
            // `PackedAvx512` is chosen only where panels exist.
            if let Some(panels) = &self.panels {
                for panel in (first..last).step_by(2 * simd::PANEL) {
                    let rows = (2 * simd::PANEL).min(last - panel);
                    let (index, count) = (panel / simd::PANEL, rows.div_ceil(simd::PANEL));
                    let (decoded, sums) = (&mut scratch.packed, &mut scratch.sums);
                    let sums = panels.product_packed_avx512(index, count, x, self.cols, batch, decoded, sums);
                    product.store_rows(0..batch, panel, rows, sums, 2 * simd::PANEL);
                }
            }
        });
    }

    /// Each panel of 16 weight rows decoded once into L1 and multiplied by a register-blocked
    /// kernel (AVX2; from the row-major blocks where there are no panels).
    fn packed_task(&self, product: &Product, first: usize, last: usize) {
        let Product { x, batch, .. } = *product;
        SCRATCH.with_borrow_mut(|scratch| {
            for panel in (first..last).step_by(simd::PANEL) {
                let rows = simd::PANEL.min(last - panel);
                let sums = self.panel_product(panel, rows, last, x, batch, scratch);
                product.store_rows(0..batch, panel, rows, sums, simd::PANEL);
            }
        });
    }

    /// Plain Rust: four weight rows decoded at a time and multiplied against every activation
    /// row.
    fn portable_task(&self, product: &Product, first: usize, last: usize) {
        let Product { x, batch, .. } = *product;
        SCRATCH.with_borrow_mut(|scratch| {
            self.rows_product(first, last - first, x, batch, scratch);
            product.store_columns(first, last - first, &scratch.sums[..(last - first) * batch]);
        });
    }
}
