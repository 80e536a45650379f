//! One activation row times two 4-bit panels at once with AVX-512BW integer multiplies: the
//! digits scheme of [`super::panel_digits_avx2`] (the row as three signed 8-bit digits per value,
//! `vpmaddubsw` against the 4-bit weights, every integer sum exact), with each 512-bit vector
//! holding the same 32 nibble bytes of two panels side by side. Part of [`super`]'s `unsafe`,
//! under its invariants (its functions need AVX-512BW as well: [`has_avx512bw`]).
//!
//! Why: on CPUs whose 512-bit units are full width (the Intel Xeons; Zen 5), the f32 kernel of a
//! one-token step ([`super::panel_gemv`]) is bound by turning 4-bit weights into floats, not by
//! memory: its 4-bit projections streamed at 16–21 GB/s where the 8-bit LM head streams at
//! ~30. The AVX2 digit kernel runs 15 vector instructions per 32 bytes of nibbles; here the same
//! 15 (and one insert) cover 64 bytes. Every 128-bit lane computes exactly what the AVX2 kernel's
//! lane computes, and the final scaling is the same arithmetic in the same order, so the results
//! are the AVX2 digit kernel's bit for bit (a test holds them to it).
//!
//! Lanes: the low 256 bits carry panel `A`'s bytes and the high 256 bits panel `B`'s, so every
//! digit broadcast serves both. After a block's sums are joined into 32-bit integers, vector
//! `[0]` holds rows 0..4 and 8..12 of `A`, then the same rows of `B` (128 bits each), and `[1]`
//! rows 4..8 and 12..16; one two-source permutation per panel puts a panel's 16 rows in order.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::panel_digits_avx2::{ActivationDigits, DIGITS, PAIRS};
use super::panel_digits_vnni::has_avx512_vnni;
#[cfg(target_arch = "x86_64")]
use super::panel_digits_vnni::q4_digits_pair_vnni;
#[cfg(target_arch = "x86_64")]
use super::panel_gemv::{prefetch_pair, PairAhead, PREFETCH_BLOCKS};
use super::panels::{Kind, Panels, Q4_BLOCK, SCALES};
use super::{has_avx512, PANEL};

/// Whether the AVX-512BW digit kernel runs here: AVX-512 in use ([`has_avx512`]) and its
/// byte and word instructions present (detected once).
pub fn has_avx512bw() -> bool {
    use std::sync::OnceLock;
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            has_avx512() && is_x86_feature_detected!("avx512bw")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Which kernel multiplies a pair of 4-bit panels by a row's digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DigitPairKernel {
    /// `vpmaddubsw` and 16-bit sums (this module; AVX-512BW).
    Bw,
    /// `vpdpbusd` and 32-bit sums ([`super::panel_digits_vnni`]; AVX-512 VNNI).
    Vnni,
}

impl DigitPairKernel {
    /// The faster one this CPU runs, `None` without AVX-512BW.
    pub fn detect() -> Option<Self> {
        if has_avx512_vnni() {
            Some(Self::Vnni)
        } else {
            has_avx512bw().then_some(Self::Bw)
        }
    }
}

impl Panels {
    /// `out[r] = Σ_k x[k] · w[panel · PANEL + r][k]` for `r < 2 · PANEL`: panels `panel` and
    /// `panel + 1` (rows `0..PANEL` of `out`, then `PANEL..2 · PANEL`), with `x` given as its
    /// digits and `sums` its [`super::block_sums`], on `kernel`; 4-bit panels only.
    pub fn product_digits_pair(
        &self,
        kernel: DigitPairKernel,
        panel: usize,
        x: &ActivationDigits,
        sums: &[f32],
        out: &mut [f32],
    ) {
        let blocks = self.blocks_per_row();
        // The kernel's features, and the digit layout it reads.
        let (present, digits) = match kernel {
            DigitPairKernel::Bw => (has_avx512bw(), x.pairs.len()),
            DigitPairKernel::Vnni => (has_avx512_vnni(), x.quads.len()),
        };
        assert!(present && self.kind() == Kind::Q4);
        assert_eq!(x.blocks(), blocks);
        assert!(digits == blocks * DIGITS && sums.len() >= blocks);
        assert!(out.len() >= 2 * PANEL);
        let panels = [
            self.blocks(panel, 0..blocks).as_ptr(),
            self.blocks(panel + 1, 0..blocks).as_ptr(),
        ];
        let (scales, sums, out) = (x.scales.as_ptr().cast(), sums.as_ptr(), out.as_mut_ptr());
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the kernel's features are present (checked above: `has_avx512bw`, and for
        // VNNI `has_avx512_vnni`); `panels` hold the two panels' `blocks` Q4 blocks, `x`
        // `blocks` blocks of digits (in the layout the kernel reads) and scales, `sums` `blocks`
        // sums and `out` `2 · PANEL` values (asserted).
        unsafe {
            match kernel {
                DigitPairKernel::Bw => q4_digits_pair(panels, blocks, x.pairs.as_ptr().cast(), scales, sums, out),
                DigitPairKernel::Vnni => {
                    q4_digits_pair_vnni(panels, blocks, x.quads.as_ptr().cast(), scales, sums, out)
                }
            }
        }
    }
}

/// The 16 rows of each of two 4-bit panels times one row's digits (see the module docs).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn q4_digits_pair(
    panels: [*const u8; 2],
    blocks: usize,
    digits: *const u8,
    scales: *const f32,
    sums: *const f32,
    out: *mut f32,
) {
    // SAFETY (whole body): each of `panels` holds `blocks` Q4 panel blocks, `digits`
    // `blocks · DIGITS` 64-byte lines of digit pairs, `scales` `2 · blocks` and `sums` `blocks`
    // values, `out` `2 · PANEL` (caller).
    unsafe {
        let low_nibbles = _mm512_set1_epi8(0x0F);
        // `vpmaddwd` weights, as in the AVX2 kernel: (ΣqD1, ΣqD0) pairs into 256·ΣqD0 + ΣqD1,
        // and (a, b) into a + b.
        let join = _mm512_set1_epi32(256 << 16 | 1);
        let add = _mm512_set1_epi16(1);
        // Rows 0..16 of a panel from the two joined vectors (see the module's lanes): its
        // 128-bit lanes `[0].0, [1].0, [0].1, [1].1` for `A`, `.2` and `.3` for `B`.
        let order = [
            _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
            _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31),
        ];
        let mut totals = [_mm512_setzero_ps(); 2];
        let mut near = PairAhead::new(PREFETCH_BLOCKS, blocks);
        for block in 0..blocks {
            let bases = panels.map(|panel| panel.add(block * Q4_BLOCK));
            prefetch_pair::<_MM_HINT_T0>(panels, near.advance(), Q4_BLOCK);
            let nibbles = bases.map(|base| base.add(2 * SCALES));
            let lines = digits.add(block * DIGITS * 64);
            // Per digit, 16-bit sums of each panel's 16 rows over the low nibbles' columns and
            // over the high ones', as in the AVX2 kernel.
            let mut sums16 = [[_mm512_setzero_si512(); 2]; DIGITS];
            for pair in 0..PAIRS {
                let low = _mm256_loadu_si256(nibbles[0].add(32 * pair).cast());
                let high = _mm256_loadu_si256(nibbles[1].add(32 * pair).cast());
                let bytes = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high);
                let nibble_words = [
                    _mm512_and_si512(bytes, low_nibbles),
                    _mm512_and_si512(_mm512_srli_epi16::<4>(bytes), low_nibbles),
                ];
                for (digit, sums) in sums16.iter_mut().enumerate() {
                    let line = lines.add(64 * digit).cast::<i32>();
                    for (half, (sum, words)) in sums.iter_mut().zip(nibble_words).enumerate() {
                        let x = _mm512_set1_epi32(*line.add(pair + PAIRS * half));
                        *sum = _mm512_add_epi16(*sum, _mm512_maddubs_epi16(words, x));
                    }
                }
            }
            let [first, second, third] = sums16;
            let mut leading = [_mm512_setzero_si512(); 2];
            for (a, b) in first.into_iter().zip(second) {
                leading[0] = _mm512_add_epi32(leading[0], _mm512_madd_epi16(_mm512_unpacklo_epi16(b, a), join));
                leading[1] = _mm512_add_epi32(leading[1], _mm512_madd_epi16(_mm512_unpackhi_epi16(b, a), join));
            }
            let last = [
                _mm512_madd_epi16(_mm512_unpacklo_epi16(third[0], third[1]), add),
                _mm512_madd_epi16(_mm512_unpackhi_epi16(third[0], third[1]), add),
            ];
            let s1 = _mm512_set1_ps(*scales.add(2 * block));
            let s2 = _mm512_set1_ps(*scales.add(2 * block + 1));
            let block_sum = _mm512_set1_ps(*sums.add(block));
            let dots: [__m512; 2] = std::array::from_fn(|i| {
                _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(last[i]),
                    s2,
                    _mm512_mul_ps(_mm512_cvtepi32_ps(leading[i]), s1),
                )
            });
            for ((total, base), order) in totals.iter_mut().zip(bases).zip(order) {
                let dot = _mm512_permutex2var_ps(dots[0], order, dots[1]);
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(base.cast()));
                let offset = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(SCALES).cast()));
                *total = _mm512_fmadd_ps(d, dot, _mm512_fmadd_ps(offset, block_sum, *total));
            }
        }
        _mm512_storeu_ps(out, totals[0]);
        _mm512_storeu_ps(out.add(PANEL), totals[1]);
    }
}

#[cfg(test)]
mod tests {
    use super::super::panel_digits_avx2::fixtures;
    use super::*;

    /// Each panel pair's products, on each pair kernel this CPU has (BW, VNNI), equal the AVX2
    /// digit kernel's bit for bit, and GGUF's scalar dequantization times the row in f64 to the
    /// f32 kernels' tolerance.
    #[test]
    fn pairs_match_the_avx2_kernel_and_dequantize_then_f64() {
        let kernels = [
            (DigitPairKernel::Bw, has_avx512bw()),
            (DigitPairKernel::Vnni, has_avx512_vnni()),
        ];
        for kernel in kernels
            .into_iter()
            .filter_map(|(kernel, present)| present.then_some(kernel))
        {
            pairs_match(kernel);
        }
    }

    fn pairs_match(kernel: DigitPairKernel) {
        let (rows, blocks) = (4 * PANEL, 5);
        let (panels, dense) = fixtures::q4_1_panels(rows, blocks);
        let cols = blocks * 32;
        for (_, x) in fixtures::activation_rows(cols) {
            let digits = ActivationDigits::new(&x).expect("finite");
            let sums = crate::simd::block_sums(&x, cols, 1, cols);
            for panel in [0, 1, 2] {
                let mut pair = [0f32; 2 * PANEL];
                panels.product_digits_pair(kernel, panel, &digits, &sums, &mut pair);
                for (half, got) in pair.chunks_exact(PANEL).enumerate() {
                    let mut one = [0f32; PANEL];
                    panels.product_digits_avx2(panel + half, &digits, &sums, &mut one);
                    assert_eq!(
                        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        one.map(f32::to_bits),
                        "{kernel:?}, panel {}",
                        panel + half
                    );
                    for (r, &value) in got.iter().enumerate() {
                        let row = (panel + half) * PANEL + r;
                        let terms = (0..cols).map(|k| f64::from(dense[row * cols + k]) * f64::from(x[k]));
                        let (exact, magnitude) = terms.fold((0.0, 0.0), |(e, m), t| (e + t, m + t.abs()));
                        let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                        let tolerance = 2e-6 * magnitude + 1e-8 * f64::from(scale);
                        assert!(
                            (f64::from(value) - exact).abs() <= tolerance,
                            "{kernel:?}, panel {} row {r}: {value} against {exact}",
                            panel + half
                        );
                    }
                }
            }
        }
    }
}
