//! A few activation rows times a panel ([`Panels`]) with AVX2: the weights decoded in registers
//! and used at once, eight weight rows (half a panel) to a register. Part of [`super`]'s
//! `unsafe`, under its invariants.
//!
//! Why: on a CPU without AVX-512 one decoding sequence multiplied GGUF's row-major blocks
//! ([`super::gemv_q4_1`]), where each 32-bit lane of a block is a different column of one row:
//! every block needs its scale and minimum converted and broadcast, and each row its horizontal
//! sum, ~22 vector instructions per 32 weights. In a 4-bit panel four columns of 8 rows are 16
//! consecutive bytes with the rows' scales beside them as vectors, so 32 weights cost one
//! widening load, three masks, three shifts, four conversions and four FMAs per activation row,
//! and a block's scale and offset are one FMA each for 8 rows. The same exact GGUF values in f32,
//! summed in another order:
//! `Σ (d·q + offset)·x = d·Σ q·x + offset·Σ x`, with each block's `Σ x` from [`block_sums`].
//!
//! A pass takes at most [`PANEL_GEMV_AVX2_ROWS`] activation rows. A 4-bit pass takes one half
//! of the panel at a time (16 registers hold 8 accumulator chains, the totals and the decoded
//! column), and the second half reads the panel's bytes again from L1; a Q8_0 pass takes both
//! halves at once ([`q8_panel`]).
//!
//! [`block_sums`]: super::block_sums

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::panel_gemv::prefetch_ahead;
use super::panels::{four_columns, nibble_columns, Kind, Panels, Q4_BLOCK, Q8_BLOCK, SCALES};
use super::{has_avx2, PANEL};

/// Activation rows one pass multiplies; a larger step makes several passes.
pub const PANEL_GEMV_AVX2_ROWS: usize = 4;

impl Panels {
    /// `out[b][r] = Σ_k x[b][k] · w[panel · PANEL + r][k]` for every activation row `b < batch`
    /// (row `b` of `x` at `b * x_stride`) and `r < PANEL`; `sums` is [`super::block_sums`] of
    /// `x` (read by the 4-bit panels only). Passes of at most [`PANEL_GEMV_AVX2_ROWS`] rows
    /// ([`Self::in_passes`]).
    pub fn product_avx2(&self, panel: usize, x: &[f32], x_stride: usize, sums: &[f32], batch: usize, out: &mut [f32]) {
        self.in_passes(
            PANEL_GEMV_AVX2_ROWS,
            PANEL,
            x,
            x_stride,
            sums,
            batch,
            out,
            |x, sums, rows, out| self.pass_avx2(panel, x, x_stride, sums, rows, out),
        );
    }

    /// One pass of [`Self::product_avx2`]: `1..=PANEL_GEMV_AVX2_ROWS` activation rows.
    fn pass_avx2(&self, panel: usize, x: &[f32], x_stride: usize, sums: &[f32], batch: usize, out: &mut [f32]) {
        assert!(has_avx2());
        let blocks = self.blocks_per_row();
        let source = self.pass_source(panel, PANEL_GEMV_AVX2_ROWS, PANEL, x, x_stride, sums, batch, out);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 present; `source` holds the panel's `blocks` blocks of its kind, `x` every
        // activation value read, `sums` every block sum read and `out` every result written
        // (asserted by `pass_source`).
        unsafe {
            let (w, xp, sp, op) = (source.as_ptr(), x.as_ptr(), sums.as_ptr(), out.as_mut_ptr());
            match (self.kind(), batch) {
                (Kind::Q8, 1) => q8_panel::<1, 4>(w, blocks, xp, x_stride, op),
                (Kind::Q8, 2) => q8_panel::<2, 2>(w, blocks, xp, x_stride, op),
                (Kind::Q8, 3) => q8_panel::<3, 1>(w, blocks, xp, x_stride, op),
                (Kind::Q8, _) => q8_panel::<4, 1>(w, blocks, xp, x_stride, op),
                (Kind::Q4, _) => {
                    for half in 0..2 {
                        match batch {
                            1 => q4_half::<1, 8>(w, half, blocks, xp, x_stride, sp, op),
                            2 => q4_half::<2, 4>(w, half, blocks, xp, x_stride, sp, op),
                            3 => q4_half::<3, 2>(w, half, blocks, xp, x_stride, sp, op),
                            _ => q4_half::<4, 2>(w, half, blocks, xp, x_stride, sp, op),
                        }
                    }
                }
            }
        }
    }
}

/// The sum of a row's `C` partial accumulators (a power of two), pairwise: the block's scale
/// waits on log2(C) additions rather than C - 1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn joined<const C: usize>(chains: &[__m256; C]) -> __m256 {
    let mut sums = *chains;
    let mut width = C;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            sums[i] = _mm256_add_ps(sums[i], sums[i + width]);
        }
    }
    sums[0]
}

/// Rows `8·half..8·half + 8` of a 4-bit panel times `M` activation rows, each row's sums in `C`
/// chains (a power of two up to 8: the four columns of a pair apart, and one or two rows
/// alternate pairs too, so that they still hide the FMA latency).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_half<const M: usize, const C: usize>(
    w: *const u8,
    half: usize,
    blocks: usize,
    x: *const f32,
    x_stride: usize,
    sums: *const f32,
    out: *mut f32,
) {
    // SAFETY (whole body): `w` holds `blocks` Q4 panel blocks, `x` `M` rows of `blocks · 32`
    // values `x_stride` apart, `sums` `M · blocks` block sums and `out` `M · PANEL` values
    // (caller); `half < 2`, so every offset below stays inside its block.
    unsafe {
        let mut totals = [_mm256_setzero_ps(); M];
        for block in 0..blocks {
            let base = w.add(block * Q4_BLOCK);
            if half == 0 {
                // Once per panel: the second half finds the bytes in L1.
                prefetch_ahead(base, Q4_BLOCK);
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(base.add(16 * half).cast()));
            let offset = _mm256_cvtph_ps(_mm_loadu_si128(base.add(SCALES + 16 * half).cast()));
            // Rows 0..8 are the first 16 bytes of each column pair's 32, rows 8..16 the last.
            let nibbles = base.add(2 * SCALES + 16 * half);
            let mut chains = [[_mm256_setzero_ps(); C]; M];
            for p in 0..8 {
                // Row `8·half + i`'s two bytes in lane `i`: four columns, one per nibble.
                let lanes = _mm256_cvtepu16_epi32(_mm_loadu_si128(nibbles.add(2 * PANEL * p).cast()));
                // Each column into a chain of its own (`C` divides 8): the chain indices are
                // constants once the loops unroll, so the chains stay in registers.
                for (i, (value, column)) in four_columns(lanes).into_iter().zip(nibble_columns(p)).enumerate() {
                    let value = _mm256_cvtepi32_ps(value);
                    let chain = (4 * p + i) % C;
                    for (b, row) in chains.iter_mut().enumerate() {
                        let xs = x.add(b * x_stride + block * 32 + column);
                        row[chain] = _mm256_fmadd_ps(value, _mm256_broadcast_ss(&*xs), row[chain]);
                    }
                }
            }
            for (b, (total, row)) in totals.iter_mut().zip(&chains).enumerate() {
                let block_sum = _mm256_broadcast_ss(&*sums.add(b * blocks + block));
                *total = _mm256_fmadd_ps(offset, block_sum, _mm256_fmadd_ps(d, joined(row), *total));
            }
        }
        for (b, total) in totals.iter().enumerate() {
            _mm256_storeu_ps(out.add(b * PANEL + 8 * half), *total);
        }
    }
}

/// Rows `0..16` of a Q8_0 panel times `M` activation rows, each half's sums in `C` chains per
/// row (`2·M·C` accumulators: 8, as many as hide the FMA latency on two FMA pipes, or 6 for
/// three rows).
///
/// Why both halves in one pass: each activation value is then broadcast once for the panel's 16
/// rows, and each column's 16 bytes are read once, in order. This is the LM head's one-token
/// kernel on AVX2 (49 152 rows of Q8_0 in SmolLM2, ~30 MB a step). On a Zen 3 EPYC (2 vCPUs),
/// against the earlier half-panel passes: Q8_0 projections (`PROJECTIONS_BEST_ONLY=1 cargo bench
/// -p rivulet-kernels --bench projections -- 2 1,2,3,4,8 Q8_0`, three alternating runs) 7.5–10.0
/// / 7.9–8.8 / 9.1–10.1 / 10.8–11.6 / 20.7–22.1 ms a step at 1 / 2 / 3 / 4 / 8 rows against
/// 9.2–10.2 / 10.0–11.1 / 11.7–12.7 / 13.1–14.4 / 23.6–23.8; the worker bench's one-token head
/// 1909–2491 µs against 2278–3262 over seven alternations, faster in each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_panel<const M: usize, const C: usize>(
    w: *const u8,
    blocks: usize,
    x: *const f32,
    x_stride: usize,
    out: *mut f32,
) {
    // SAFETY (whole body): `w` holds `blocks` Q8 panel blocks, `x` `M` rows of `blocks · 32`
    // values `x_stride` apart and `out` `M · PANEL` values (caller).
    unsafe {
        let mut totals = [[_mm256_setzero_ps(); 2]; M];
        for block in 0..blocks {
            let base = w.add(block * Q8_BLOCK);
            prefetch_ahead(base, Q8_BLOCK);
            let d = [
                _mm256_cvtph_ps(_mm_loadu_si128(base.cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(base.add(16).cast())),
            ];
            let values = base.add(SCALES);
            let mut chains = [[[_mm256_setzero_ps(); C]; 2]; M];
            for first in (0..32).step_by(C) {
                for chain in 0..C {
                    let k = first + chain;
                    let q = [0, 1].map(|half| {
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                            values.add(PANEL * k + 8 * half).cast(),
                        )))
                    });
                    for (b, row) in chains.iter_mut().enumerate() {
                        let xv = _mm256_broadcast_ss(&*x.add(b * x_stride + block * 32 + k));
                        for (half, q) in q.iter().enumerate() {
                            row[half][chain] = _mm256_fmadd_ps(*q, xv, row[half][chain]);
                        }
                    }
                }
            }
            for (total, row) in totals.iter_mut().zip(&chains) {
                for half in 0..2 {
                    total[half] = _mm256_fmadd_ps(d[half], joined(&row[half]), total[half]);
                }
            }
        }
        for (b, total) in totals.iter().enumerate() {
            _mm256_storeu_ps(out.add(b * PANEL), total[0]);
            _mm256_storeu_ps(out.add(b * PANEL + 8), total[1]);
        }
    }
}
