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
//! A pass takes at most [`PANEL_GEMV_AVX2_ROWS`] activation rows and one half of the panel at a
//! time (16 registers hold 8 accumulator chains, the totals and the decoded column); the second
//! half reads the panel's bytes again from L1.
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
            for half in 0..2 {
                macro_rules! run {
                    ($kernel:ident) => {
                        match batch {
                            1 => $kernel::<1, 8>(w, half, blocks, xp, x_stride, sp, op),
                            2 => $kernel::<2, 4>(w, half, blocks, xp, x_stride, sp, op),
                            3 => $kernel::<3, 2>(w, half, blocks, xp, x_stride, sp, op),
                            _ => $kernel::<4, 2>(w, half, blocks, xp, x_stride, sp, op),
                        }
                    };
                }
                match self.kind() {
                    Kind::Q4 => run!(q4_half),
                    Kind::Q8 => run!(q8_half),
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

/// Rows `8·half..8·half + 8` of a Q8_0 panel times `M` activation rows, each row's sums in `C`
/// chains.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_half<const M: usize, const C: usize>(
    w: *const u8,
    half: usize,
    blocks: usize,
    x: *const f32,
    x_stride: usize,
    _sums: *const f32,
    out: *mut f32,
) {
    // SAFETY (whole body): `w` holds `blocks` Q8 panel blocks, `x` `M` rows of `blocks · 32`
    // values `x_stride` apart and `out` `M · PANEL` values (caller); `half < 2`.
    unsafe {
        let mut totals = [_mm256_setzero_ps(); M];
        for block in 0..blocks {
            let base = w.add(block * Q8_BLOCK);
            if half == 0 {
                prefetch_ahead(base, Q8_BLOCK);
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(base.add(16 * half).cast()));
            let values = base.add(SCALES + 8 * half);
            let mut chains = [[_mm256_setzero_ps(); C]; M];
            for first in (0..32).step_by(C) {
                for chain in 0..C {
                    let k = first + chain;
                    let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(values.add(PANEL * k).cast())));
                    for (b, row) in chains.iter_mut().enumerate() {
                        let xv = _mm256_broadcast_ss(&*x.add(b * x_stride + block * 32 + k));
                        row[chain] = _mm256_fmadd_ps(q, xv, row[chain]);
                    }
                }
            }
            for (total, row) in totals.iter_mut().zip(&chains) {
                *total = _mm256_fmadd_ps(d, joined(row), *total);
            }
        }
        for (b, total) in totals.iter().enumerate() {
            _mm256_storeu_ps(out.add(b * PANEL + 8 * half), *total);
        }
    }
}
