//! Activation rows times two consecutive 4-bit panels at once, the weights decoded in AVX-512
//! registers as in [`super::panel_gemv`]. Part of [`super`]'s `unsafe`, under its invariants (the
//! `avx512f` functions run only after [`super::has_avx512`] returned true).
//!
//! Why: in the one-panel kernel every FMA takes its activation from a broadcast load, so a pass
//! of eight rows issues a load per FMA besides the weights', and on a core that loads two 512-bit
//! vectors a cycle and multiplies two, the loads bind as soon as anything else needs the load
//! ports. Here each broadcast activation serves both panels' FMAs: half the loads per FMA, and
//! each column's decode (a widening load, a mask or shift, a conversion) stays one per panel.
//! Sixteen accumulators (eight rows × two panels) fill the registers with the decoded columns,
//! so each row's running totals live in `out` between blocks instead (one load and one store
//! per row, panel and block, against 32 FMAs).
//!
//! The arithmetic is the one-panel kernel's: each block's `Σ q·x` over its 32 columns, then
//! `offset · Σx + d · Σ q·x` added to the row's total, in f32.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::panel_gemv::PANEL_GEMV_ROWS;
#[cfg(target_arch = "x86_64")]
use super::panel_gemv::{prefetch_pair, PairAhead, PREFETCH_BLOCKS};
#[cfg(target_arch = "x86_64")]
use super::panels::{four_columns_512, nibble_columns, Q4_BLOCK, SCALES};
use super::panels::{Kind, Panels};
use super::{has_avx512, PANEL};

/// Activation rows from which a step takes this kernel: below, the step is bound by memory, and
/// one panel's single stream ([`super::panel_gemv`]) is read faster than two side by side. On a
/// Zen 5 EPYC (`rivulet-worker-bench` with `RIVULET_KERNELS_NO_DIGITS=1`, batches 1, 2 and 4 at
/// context 256, four alternating runs) one panel took 3.41–3.58 / 4.08–4.22 / 5.98–6.06 ms a
/// step and two 3.71–3.78 / 4.22–4.40 / 5.80–5.94.
pub const PANEL_PAIR_MIN_ROWS: usize = 4;

impl Panels {
    /// `out[b][r] = Σ_k x[b][k] · w[panel · PANEL + r][k]` for every activation row `b < batch`
    /// (row `b` of `x` at `b * x_stride`) and `r < 2 · PANEL`: 4-bit panels `panel` and
    /// `panel + 1`, `out`'s rows `2 · PANEL` values apart; `sums` is [`super::block_sums`] of
    /// `x`. Passes of at most [`PANEL_GEMV_ROWS`] rows ([`Self::in_passes`]).
    pub fn product_avx512_pair(
        &self,
        panel: usize,
        x: &[f32],
        x_stride: usize,
        sums: &[f32],
        batch: usize,
        out: &mut [f32],
    ) {
        self.in_passes(
            PANEL_GEMV_ROWS,
            2 * PANEL,
            x,
            x_stride,
            sums,
            batch,
            out,
            |x, sums, rows, out| self.pass_avx512_pair(panel, x, x_stride, sums, rows, out),
        );
    }

    /// One pass of [`Self::product_avx512_pair`]: `1..=PANEL_GEMV_ROWS` activation rows.
    fn pass_avx512_pair(&self, panel: usize, x: &[f32], x_stride: usize, sums: &[f32], batch: usize, out: &mut [f32]) {
        assert!(has_avx512() && self.kind() == Kind::Q4 && panel + 1 < self.panel_count());
        let blocks = self.blocks_per_row();
        let first = self.pass_source(panel, PANEL_GEMV_ROWS, 2 * PANEL, x, x_stride, sums, batch, out);
        let panels = [first.as_ptr(), self.blocks(panel + 1, 0..blocks).as_ptr()];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F present; `panels` hold two 4-bit panels' `blocks` blocks, `x` every
        // activation value read, `sums` every block sum read and `out` every result written
        // (`pass_source`'s asserts, with `2 · PANEL` values a row).
        unsafe {
            let (xp, sp, op) = (x.as_ptr(), sums.as_ptr(), out.as_mut_ptr());
            match batch {
                1 => q4_rows_pair::<1, 4>(panels, blocks, xp, x_stride, sp, op),
                2 => q4_rows_pair::<2, 2>(panels, blocks, xp, x_stride, sp, op),
                3 => q4_rows_pair::<3, 2>(panels, blocks, xp, x_stride, sp, op),
                4 => q4_rows_pair::<4, 1>(panels, blocks, xp, x_stride, sp, op),
                5 => q4_rows_pair::<5, 1>(panels, blocks, xp, x_stride, sp, op),
                6 => q4_rows_pair::<6, 1>(panels, blocks, xp, x_stride, sp, op),
                7 => q4_rows_pair::<7, 1>(panels, blocks, xp, x_stride, sp, op),
                _ => q4_rows_pair::<8, 1>(panels, blocks, xp, x_stride, sp, op),
            }
        }
    }
}

/// Two 4-bit panels times `M` activation rows, each row's sums per panel in `C` independent
/// chains (so that few rows still hide the FMA latency); results `M` rows of `2 · PANEL`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn q4_rows_pair<const M: usize, const C: usize>(
    panels: [*const u8; 2],
    blocks: usize,
    x: *const f32,
    x_stride: usize,
    sums: *const f32,
    out: *mut f32,
) {
    // SAFETY (whole body): each of `panels` holds `blocks` Q4 panel blocks, `x` `M` rows of
    // `blocks · 32` values `x_stride` apart, `sums` `M · blocks` block sums and `out`
    // `M · 2 · PANEL` values (caller).
    unsafe {
        for b in 0..M {
            _mm512_storeu_ps(out.add(2 * b * PANEL), _mm512_setzero_ps());
            _mm512_storeu_ps(out.add((2 * b + 1) * PANEL), _mm512_setzero_ps());
        }
        let mut ahead = PairAhead::new(PREFETCH_BLOCKS, blocks);
        for block in 0..blocks {
            prefetch_pair::<_MM_HINT_T0>(panels, ahead.advance(), Q4_BLOCK);
            let bases = [panels[0].add(block * Q4_BLOCK), panels[1].add(block * Q4_BLOCK)];
            // `[row][panel][chain]`.
            let mut chains = [[[_mm512_setzero_ps(); C]; 2]; M];
            for p in 0..8 {
                // Row r's two bytes in lane r: four columns, one per nibble (`nibble_columns`).
                let load = |base: *const u8| {
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256(base.add(2 * SCALES + 2 * PANEL * p).cast()))
                };
                let columns = [four_columns_512(load(bases[0])), four_columns_512(load(bases[1]))];
                // (Plain loops over constant bounds: they unroll, so the chain indices are
                // constants and the chains stay in registers.)
                for (i, column) in nibble_columns(p).into_iter().enumerate() {
                    let values = [_mm512_cvtepi32_ps(columns[0][i]), _mm512_cvtepi32_ps(columns[1][i])];
                    for (b, row) in chains.iter_mut().enumerate() {
                        let xs = _mm512_set1_ps(*x.add(b * x_stride + block * 32 + column));
                        for (half, value) in row.iter_mut().zip(values) {
                            half[i % C] = _mm512_fmadd_ps(value, xs, half[i % C]);
                        }
                    }
                }
            }
            for (h, base) in bases.into_iter().enumerate() {
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(base.cast()));
                let offset = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(SCALES).cast()));
                for (b, row) in chains.iter().enumerate() {
                    let block_sum = _mm512_set1_ps(*sums.add(b * blocks + block));
                    let at = out.add((2 * b + h) * PANEL);
                    let mut joined = row[h][0];
                    for chain in &row[h][1..] {
                        joined = _mm512_add_ps(joined, *chain);
                    }
                    let total = _mm512_fmadd_ps(d, joined, _mm512_loadu_ps(at));
                    _mm512_storeu_ps(at, _mm512_fmadd_ps(offset, block_sum, total));
                }
            }
        }
    }
}
