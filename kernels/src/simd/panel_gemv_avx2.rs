//! A few activation rows times a panel ([`Panels`]) with AVX2: the weights decoded in registers
//! and used at once, eight weight rows (half a panel) to a register. Part of [`super`]'s
//! `unsafe`, under its invariants.
//!
//! Why: on a CPU without AVX-512 one decoding sequence multiplied GGUF's row-major blocks
//! ([`super::gemv_q4_1`]), where each 32-bit lane of a block is a different column of one row:
//! every block needs its scale and minimum converted and broadcast, and each row its horizontal
//! sum, ~22 vector instructions per 32 weights. In a panel one column of 8 rows is 8 consecutive
//! bytes with the rows' scales beside them as vectors, so a column of a 4-bit panel costs one
//! widening load, a mask and a shift, two conversions and one FMA per activation row for 16
//! weights (column `j` in the low nibbles, `j + 16` in the high ones), and a block's scale and
//! offset are one FMA each for 8 rows. The same exact GGUF values in f32, summed in another order:
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
use super::panels::{Kind, Panels, Q4_BLOCK, Q8_BLOCK, SCALES};
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
        let source = self.pass_source(panel, PANEL_GEMV_AVX2_ROWS, x, x_stride, sums, batch, out);
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
/// chains (even: low and high nibbles apart, and one or two rows alternate columns too, so that
/// they still hide the FMA latency).
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
        let low_nibble = _mm256_set1_epi32(0x0F);
        let mut totals = [_mm256_setzero_ps(); M];
        for block in 0..blocks {
            let base = w.add(block * Q4_BLOCK);
            if half == 0 {
                // Once per panel: the second half finds the bytes in L1.
                prefetch_ahead(base, Q4_BLOCK);
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(base.add(16 * half).cast()));
            let offset = _mm256_cvtph_ps(_mm_loadu_si128(base.add(SCALES + 16 * half).cast()));
            let nibbles = base.add(2 * SCALES + 8 * half);
            let mut chains = [[_mm256_setzero_ps(); C]; M];
            // Columns `first..first + C/2` a pass, each into chains of its own: the chain indices
            // are constants once the inner loops unroll, so the chains stay in registers.
            for first in (0..16).step_by(C / 2) {
                for pair in 0..C / 2 {
                    let j = first + pair;
                    // Row `8·half + i`'s byte in lane `i`: column j (low nibble), j + 16 (high).
                    let bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(nibbles.add(PANEL * j).cast()));
                    let low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low_nibble));
                    let high = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(bytes));
                    for (b, row) in chains.iter_mut().enumerate() {
                        let xs = x.add(b * x_stride + block * 32 + j);
                        row[2 * pair] = _mm256_fmadd_ps(low, _mm256_broadcast_ss(&*xs), row[2 * pair]);
                        row[2 * pair + 1] = _mm256_fmadd_ps(high, _mm256_broadcast_ss(&*xs.add(16)), row[2 * pair + 1]);
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
