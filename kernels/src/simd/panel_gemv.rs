//! Activation rows times a panel ([`Panels`]), the weights decoded in AVX-512 registers and used
//! at once, eight activation rows a pass. Part of [`super`]'s `unsafe`, under its invariants (the
//! `avx512f` functions run only after [`super::has_avx512`] returned true).
//!
//! Why: a decoding step of one sequence was bound by the instructions that turn GGUF's
//! row-major blocks into f32 (each 32-bit lane of a row's block is a different column, so every
//! product needs its own shuffle, conversion and a horizontal sum at the end), not by memory: the
//! Q4_1 GEMV streamed ~22 GB/s on a machine that reads 59. In a panel, one 16-byte load holds
//! one column of 16 rows: widened to 16 lanes it is one register of 16 outputs' weights, so a
//! column costs one widening load, a mask or shift, one conversion and one FMA per activation
//! row against a broadcast activation — and no horizontal sums.
//!
//! Each block's scale is factored out, `Σ (d·q + offset)·x = d·Σ q·x + offset·Σ x`, with the
//! block's `Σ x` computed once per activation row for every panel ([`block_sums`]): the same
//! exact GGUF values in f32, summed in another order (the kernel tests hold it to the tolerance
//! of an f64 product).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::panels::{four_columns_512, nibble_columns, Kind, Panels, Q4_BLOCK, Q8_BLOCK, SCALES};
use super::{fits, has_avx512, strided_len, PANEL};

/// Activation rows one pass over a panel multiplies (its accumulators fill the registers); a
/// larger step makes several passes, the panel staying in L1 between them.
pub const PANEL_GEMV_ROWS: usize = 8;

/// `[batch][cols / 32]`: the sum of each 32-value block of each activation row (row `b` of `x`
/// at `b * x_stride`), in the order a vectorized loop keeps.
pub fn block_sums(x: &[f32], x_stride: usize, batch: usize, cols: usize) -> Vec<f32> {
    let mut sums = Vec::with_capacity(batch * cols / 32);
    for b in 0..batch {
        sums.extend(x[b * x_stride..b * x_stride + cols].chunks_exact(32).map(block_sum));
    }
    sums
}

/// The sum of one block's 32 values, in the order a vectorized loop keeps (the AMX path's
/// split sums its blocks with it too).
pub fn block_sum(block: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    for half in block.chunks_exact(16) {
        lanes.iter_mut().zip(half).for_each(|(l, v)| *l += v);
    }
    lanes.iter().sum()
}

impl Panels {
    /// `out[b][r] = Σ_k x[b][k] · w[panel · PANEL + r][k]` for every activation row `b < batch`
    /// (row `b` of `x` at `b * x_stride`) and `r < PANEL`; `sums` is [`block_sums`] of `x` (read
    /// by the 4-bit panels only). Passes of at most [`PANEL_GEMV_ROWS`] rows ([`Self::in_passes`]).
    pub fn product_avx512(
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
            PANEL,
            x,
            x_stride,
            sums,
            batch,
            out,
            |x, sums, rows, out| self.pass_avx512(panel, x, x_stride, sums, rows, out),
        );
    }

    /// One pass of [`Self::product_avx512`]: `1..=PANEL_GEMV_ROWS` activation rows.
    fn pass_avx512(&self, panel: usize, x: &[f32], x_stride: usize, sums: &[f32], batch: usize, out: &mut [f32]) {
        assert!(has_avx512());
        let blocks = self.blocks_per_row();
        let source = self.pass_source(panel, PANEL_GEMV_ROWS, PANEL, x, x_stride, sums, batch, out);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F present; `source` holds the panel's `blocks` blocks of its kind, `x`
        // every activation value read, `sums` every block sum read and `out` every result
        // written (asserted by `pass_source`).
        unsafe {
            let (w, xp, sp, op) = (source.as_ptr(), x.as_ptr(), sums.as_ptr(), out.as_mut_ptr());
            macro_rules! run {
                ($kernel:ident) => {
                    match batch {
                        1 => $kernel::<1, 4>(w, blocks, xp, x_stride, sp, op),
                        2 => $kernel::<2, 4>(w, blocks, xp, x_stride, sp, op),
                        3 => $kernel::<3, 2>(w, blocks, xp, x_stride, sp, op),
                        4 => $kernel::<4, 2>(w, blocks, xp, x_stride, sp, op),
                        5 => $kernel::<5, 2>(w, blocks, xp, x_stride, sp, op),
                        6 => $kernel::<6, 2>(w, blocks, xp, x_stride, sp, op),
                        7 => $kernel::<7, 2>(w, blocks, xp, x_stride, sp, op),
                        _ => $kernel::<8, 2>(w, blocks, xp, x_stride, sp, op),
                    }
                };
            }
            match self.kind() {
                Kind::Q4 => run!(q4_rows),
                Kind::Q8 => run!(q8_rows),
            }
        }
    }
}

impl Panels {
    /// Runs `pass(x, sums, rows, out)` over `batch` activation rows in passes of at most
    /// `max_rows`, sized evenly (13 = 7 + 6, not 8 + 5: a pass of few rows has too few
    /// accumulators to hide the FMA latency); each pass gets its rows of `x` (`x_stride` apart),
    /// of `sums` ([`block_sums`]) and of `out` (`out_row` values a row).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn in_passes(
        &self,
        max_rows: usize,
        out_row: usize,
        x: &[f32],
        x_stride: usize,
        sums: &[f32],
        batch: usize,
        out: &mut [f32],
        mut pass: impl FnMut(&[f32], &[f32], usize, &mut [f32]),
    ) {
        let blocks = self.blocks_per_row();
        let passes = batch.div_ceil(max_rows);
        let mut start = 0;
        for index in 0..passes {
            let rows = (batch - start).div_ceil(passes - index);
            pass(
                &x[start * x_stride..],
                sums.get(start * blocks..).unwrap_or_default(),
                rows,
                &mut out[start * out_row..(start + rows) * out_row],
            );
            start += rows;
        }
    }

    /// Panel `panel`'s blocks, once a pass of `batch` activation rows (`1..=max_rows`) is
    /// checked against them: `x` holds every value the pass reads, `sums` every block sum (4-bit
    /// panels) and `out` every result it writes (`out_row` values a row). The kernels' `unsafe`
    /// rests on these asserts.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn pass_source(
        &self,
        panel: usize,
        max_rows: usize,
        out_row: usize,
        x: &[f32],
        x_stride: usize,
        sums: &[f32],
        batch: usize,
        out: &[f32],
    ) -> &[u8] {
        assert!((1..=max_rows).contains(&batch));
        let blocks = self.blocks_per_row();
        assert!(fits(x.len(), strided_len(batch, x_stride, blocks * 32)));
        assert!(self.kind() == Kind::Q8 || fits(sums.len(), batch.checked_mul(blocks)));
        assert!(fits(out.len(), batch.checked_mul(out_row)));
        self.blocks(panel, 0..blocks)
    }
}

/// Blocks ahead that a block's bytes are fetched.
pub(super) const PREFETCH_BLOCKS: usize = 4;

/// Fetches the block `PREFETCH_BLOCKS` after the one at `base` (`block_bytes` each). A hint
/// only: it never faults, so it may point past the panel.
#[cfg(target_arch = "x86_64")]
pub(super) fn prefetch_ahead(base: *const u8, block_bytes: usize) {
    prefetch_block::<_MM_HINT_T0>(base.wrapping_add(PREFETCH_BLOCKS * block_bytes), block_bytes);
}

/// Blocks ahead that the AVX2 one-token digit kernel ([`super::panel_digits_avx2`]) fetches,
/// through [`prefetch_streamed`].
#[cfg(target_arch = "x86_64")]
const STREAMED_PREFETCH_BLOCKS: usize = 8;

/// Fetches the block [`STREAMED_PREFETCH_BLOCKS`] after the one at `base` (`block_bytes` each)
/// as non-temporal (`prefetchnta`): into L1 for the kernel's loads, marked as data the caches
/// need not keep (a one-token step reads each weight once). A hint only, as [`prefetch_ahead`].
///
/// Why: on a Zen 3 EPYC (2 vCPUs, AVX2 only) the digit kernel's streamed projections took about
/// as long as their arithmetic from cache plus their reads from memory: the two hardly
/// overlapped. SmolLM2's 4-bit projections for one token (`cargo bench -p rivulet-kernels
/// --bench projections -- 2 1 Q4_1`, six alternating runs) took 4.87–5.96 ms a step (median
/// 5.15) this way against 5.58–6.18 (median 5.88) with [`prefetch_ahead`]'s `prefetcht0` four
/// blocks ahead, and 6.46–8.68 ms against 7.64–9.16 on one thread; the whole one-token step
/// (`rivulet-worker-bench` batch 1 at context 256, 100 steps a run, builds alternating)
/// 6.80–9.92 ms (median 8.3 over fourteen runs) against 7.96–11.02 (median 8.7). `prefetchnta`
/// 12 blocks ahead measured as 8, 6 worse; `prefetcht0` 16 ahead as fast in the kernel alone
/// but no faster than 4 in whole steps; a fetch of each task's first blocks before its loop (as
/// [`Panels::fetch_pairs_start`] does for the pair kernels) no better. The f32 kernels of a few
/// rows ([`super::panel_gemv_avx2`]), bound by their arithmetic, measured level (4-bit) or
/// slower (Q8_0 at two rows) with it, so they keep [`prefetch_ahead`].
#[cfg(target_arch = "x86_64")]
pub(super) fn prefetch_streamed(base: *const u8, block_bytes: usize) {
    prefetch_block::<_MM_HINT_NTA>(base.wrapping_add(STREAMED_PREFETCH_BLOCKS * block_bytes), block_bytes);
}

/// Asks for the `block_bytes` at `block` with the prefetch hint `HINT`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_block<const HINT: i32>(block: *const u8, block_bytes: usize) {
    for line in 0..block_bytes.div_ceil(64) {
        // SAFETY: a prefetch reads nothing architecturally and never faults.
        unsafe { _mm_prefetch::<HINT>(block.wrapping_add(64 * line).cast()) };
    }
}

/// Blocks ahead that the VNNI digit kernels ([`super::panel_digits_vnni`]) fetch into the L2
/// cache only (`prefetcht1`, through [`PairAhead`]): 10 KB of a 4-bit panel. They also fetch
/// [`PREFETCH_BLOCKS`] ahead into L1, so that their loads meet lines already moved up from L2:
/// on a Zen 5 EPYC (`cargo bench -p rivulet-kernels --bench projections -- 2 1 Q4_1`, four
/// alternating runs) the 4-bit projections took 1.82–2.38 ms a step with both fetches against
/// 2.30–2.63 with the L2 fetch alone, and a one-token step 3.33–3.87 ms (one run 4.71) against
/// 3.74–3.84 (five alternating runs in a slow hour).
///
/// Why: a one-token step on the VNNI kernel streams weights as fast as memory gives them, and a
/// fetch into L1 four blocks ahead keeps too few lines in flight (each L1 miss holds one of the
/// core's few fill buffers until memory answers). On a Xeon (Emerald Rapids, 2 threads, `cargo
/// bench -p rivulet-kernels --bench projections -- 2 1 Q4_1`, three alternating runs)
/// SmolLM2's 4-bit projections took 4.41–4.69 ms per step with this against 4.96–5.24 with
/// [`prefetch_ahead`]'s (5.9–6.3 with none). Intel and Zen 4 fetch `prefetcht1` into L2; older
/// AMD cores fetch it into L1, where 10 KB ahead of two panels would crowd the cache, so only
/// the AVX-512 VNNI kernels use it.
pub(super) const L2_PREFETCH_BLOCKS: usize = 32;

/// Where a kernel that reads two consecutive panels side by side, block by block (the AVX-512
/// digit kernels, [`super::panel_digits_avx512`] and [`super::panel_digits_vnni`], and the f32
/// one of [`super::panel_pair_gemv`]), fetches
/// ahead: the block `ahead` blocks past the one it reads, in the order it will read them, counted
/// from either panel's start. Past a pair's last block that is the next pair's (the panels of a
/// task's pairs are consecutive in memory, so the next pair's first panel starts one panel past
/// the second), where a plain `base + ahead` lands in the pair's other panel and leaves the
/// next pair's second panel to be read from memory cold.
///
/// Why: on a Zen 5 EPYC (2 threads, `rivulet-worker-bench` batch 1 at context 256, three
/// alternating runs) the VNNI kernel's down projection (48 blocks a panel, where 32 ahead stays
/// inside the pair) took 735–753 µs a step with `base + 32` and 486–509 with this; the shorter
/// projections (18 blocks a panel) were already fetched across pairs by accident.
#[derive(Debug, Clone, Copy)]
pub(super) struct PairAhead {
    /// The next block to fetch, from either panel's start (a pair spans `2 · blocks`).
    at: usize,
    /// Its index inside its panel.
    within: usize,
    blocks: usize,
}

impl PairAhead {
    /// Starts `ahead` blocks past block 0 of pairs of `blocks`-block panels (`blocks > 0`).
    pub(super) fn new(ahead: usize, blocks: usize) -> Self {
        let blocks = blocks.max(1);
        let within = ahead % blocks;
        Self {
            at: ahead / blocks * 2 * blocks + within,
            within,
            blocks,
        }
    }

    /// The block to fetch for the current one (from either panel's start), then moves on a block.
    pub(super) fn advance(&mut self) -> usize {
        let at = self.at;
        self.at += 1;
        self.within += 1;
        if self.within == self.blocks {
            self.within = 0;
            self.at += self.blocks;
        }
        at
    }
}

/// Fetches block `at` ([`PairAhead::advance`]) of both panels of a pair, `block_bytes` each, with
/// the prefetch hint `HINT`. A hint only: it never faults, so it may point past the matrix.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_pair<const HINT: i32>(panels: [*const u8; 2], at: usize, block_bytes: usize) {
    for panel in panels {
        prefetch_block::<HINT>(panel.wrapping_add(at * block_bytes), block_bytes);
    }
}

impl Panels {
    /// Fetches into L2 the blocks that a pair kernel starting at panel `panel` reads before its
    /// own fetches, [`L2_PREFETCH_BLOCKS`] ahead through [`PairAhead`], reach them: the first
    /// `L2_PREFETCH_BLOCKS` of the pairs from `panel` on, in reading order. Called where a task's
    /// run of pairs starts. A hint only.
    ///
    /// Why: each projection of a one-token step is a few tasks per thread, each a run of pairs
    /// whose first 32 blocks (10 KB of 4-bit panels) no fetch of the kernel's covers. On a Zen 5
    /// EPYC (`rivulet-worker-bench` batch 1 at context 256, five alternating runs) the output
    /// projection (36 panels, six tasks) took 265–316 µs a step with this against 310–373
    /// without, the QKV projection 401–457 against 418–505.
    pub fn fetch_pairs_start(&self, panel: usize) {
        let blocks = self.blocks_per_row();
        if blocks == 0 || panel >= self.panel_count() {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            let block_bytes = self.block_bytes();
            let first = self.blocks(panel, 0..0).as_ptr();
            let panels = [first, first.wrapping_add(blocks * block_bytes)];
            let mut start = PairAhead::new(0, blocks);
            for _ in 0..L2_PREFETCH_BLOCKS {
                prefetch_pair::<_MM_HINT_T1>(panels, start.advance(), block_bytes);
            }
        }
    }
}

/// The sum of a row's `C` partial accumulators.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn joined<const C: usize>(chains: &[__m512; C]) -> __m512 {
    let mut sum = chains[0];
    for chain in &chains[1..] {
        sum = _mm512_add_ps(sum, *chain);
    }
    sum
}

/// A 4-bit panel times `M` activation rows, each row's sums in `C` independent chains (so that
/// one or two rows still hide the FMA latency).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn q4_rows<const M: usize, const C: usize>(
    w: *const u8,
    blocks: usize,
    x: *const f32,
    x_stride: usize,
    sums: *const f32,
    out: *mut f32,
) {
    // SAFETY (whole body): `w` holds `blocks` Q4 panel blocks, `x` `M` rows of `blocks · 32`
    // values `x_stride` apart, `sums` `M · blocks` block sums and `out` `M · PANEL` values
    // (caller).
    unsafe {
        let mut totals = [_mm512_setzero_ps(); M];
        for block in 0..blocks {
            let base = w.add(block * Q4_BLOCK);
            prefetch_ahead(base, Q4_BLOCK);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(base.cast()));
            let offset = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(SCALES).cast()));
            let nibbles = base.add(2 * SCALES);
            let mut chains = [[_mm512_setzero_ps(); C]; M];
            for p in 0..8 {
                // Row r's two bytes in lane r: four columns, one per nibble (`nibble_columns`).
                let lanes = _mm512_cvtepu16_epi32(_mm256_loadu_si256(nibbles.add(2 * PANEL * p).cast()));
                // Each column into a chain of its own (`C` divides 4): the chain indices are
                // constants once the loops unroll, so the chains stay in registers.
                for (i, (value, column)) in four_columns_512(lanes).into_iter().zip(nibble_columns(p)).enumerate() {
                    let value = _mm512_cvtepi32_ps(value);
                    for (b, row) in chains.iter_mut().enumerate() {
                        let xs = x.add(b * x_stride + block * 32 + column);
                        row[i % C] = _mm512_fmadd_ps(value, _mm512_set1_ps(*xs), row[i % C]);
                    }
                }
            }
            for (b, (total, row)) in totals.iter_mut().zip(&chains).enumerate() {
                let block_sum = _mm512_set1_ps(*sums.add(b * blocks + block));
                *total = _mm512_fmadd_ps(offset, block_sum, _mm512_fmadd_ps(d, joined(row), *total));
            }
        }
        for (b, total) in totals.iter().enumerate() {
            _mm512_storeu_ps(out.add(b * PANEL), *total);
        }
    }
}

/// A Q8_0 panel times `M` activation rows, each row's sums in `C` independent chains.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn q8_rows<const M: usize, const C: usize>(
    w: *const u8,
    blocks: usize,
    x: *const f32,
    x_stride: usize,
    _sums: *const f32,
    out: *mut f32,
) {
    // SAFETY (whole body): `w` holds `blocks` Q8 panel blocks, `x` `M` rows of `blocks · 32`
    // values `x_stride` apart and `out` `M · PANEL` values (caller).
    unsafe {
        let mut totals = [_mm512_setzero_ps(); M];
        for block in 0..blocks {
            let base = w.add(block * Q8_BLOCK);
            prefetch_ahead(base, Q8_BLOCK);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(base.cast()));
            let values = base.add(SCALES);
            let mut chains = [[_mm512_setzero_ps(); C]; M];
            for first in (0..32).step_by(C) {
                for chain in 0..C {
                    let k = first + chain;
                    let q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(values.add(PANEL * k).cast())));
                    for (b, row) in chains.iter_mut().enumerate() {
                        let xv = _mm512_set1_ps(*x.add(b * x_stride + block * 32 + k));
                        row[chain] = _mm512_fmadd_ps(q, xv, row[chain]);
                    }
                }
            }
            for (total, row) in totals.iter_mut().zip(&chains) {
                *total = _mm512_fmadd_ps(d, joined(row), *total);
            }
        }
        for (b, total) in totals.iter().enumerate() {
            _mm512_storeu_ps(out.add(b * PANEL), *total);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PairAhead;

    /// The fetches follow the blocks in the order a pair kernel reads them: block `b` of each
    /// panel of pair `p` lies `2 · blocks · p + b` blocks from the first pair's panels' starts.
    #[test]
    fn pair_fetches_run_ahead_through_the_next_pairs() {
        for blocks in [1, 2, 5, 18, 48] {
            for ahead in [0, 1, 4, 17, 32, 100] {
                // Pair `p`'s blocks are read in steps `p · blocks + b`.
                let mut fetch = PairAhead::new(ahead, blocks);
                for step in 0..4 * blocks {
                    let target = step + ahead;
                    let expected = target / blocks * 2 * blocks + target % blocks;
                    assert_eq!(fetch.advance(), expected, "blocks {blocks}, ahead {ahead}, step {step}");
                }
            }
        }
    }
}
