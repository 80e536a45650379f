//! The paths that decode weights into an L1 buffer before multiplying: the packed path (a
//! panel of 16 rows transposed into `[k][16]` f32, then a register-blocked FMA kernel) and the
//! portable one (four rows of [`TILE`] values, plain Rust), with their per-thread buffers.

use rivulet_gguf::dequant::dequantize_append;

use super::{Isa, WeightMatrix, PACKED_TILE, STRIP, TILE};
use crate::simd;

impl WeightMatrix {
    /// Rows `first..first + rows` (at most `PANEL`) times `x` as `[batch][PANEL]` sums (in
    /// `scratch.sums`), one column tile of `PACKED_TILE` at a time. `task_end` ends the
    /// calling task's rows: the next panel is prefetched only if it is the task's own.
    pub(super) fn panel_product<'s>(
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
    pub(super) fn rows_product(&self, first: usize, rows: usize, x: &[f32], batch: usize, scratch: &mut Scratch) {
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

/// Per-thread buffers, reused across calls so that the hot loop does not allocate.
#[derive(Default)]
pub(super) struct Scratch {
    /// Decoded weights: `[STRIP][TILE]` (portable) or `[PANEL][PACKED_TILE]` (packed).
    pub(super) tile: Vec<f32>,
    /// `[STRIP][batch]` partial products.
    pub(super) sums: Vec<f32>,
    /// The portable decoder's output.
    pub(super) decoded: Vec<f32>,
    /// `[PACKED_TILE][PANEL]` transposed weights.
    pub(super) packed: Vec<f32>,
}

thread_local! {
    pub(super) static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
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
