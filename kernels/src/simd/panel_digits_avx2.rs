//! One activation row times a 4-bit panel ([`Panels`]) with AVX2 integer multiplies: the row split
//! into three signed 8-bit digits per value, each digit multiplied by the 4-bit weights with
//! `vpmaddubsw`. Part of [`super`]'s `unsafe`, under its invariants.
//!
//! Why: on a CPU without AVX-512 a one-token step is bound by the instructions that turn 4-bit
//! weights into f32 (a widening, a mask or shift and a conversion per 8 weights before each FMA),
//! not by memory. `vpmaddubsw` multiplies 32 unsigned bytes by 32 signed ones and adds adjacent
//! pairs, so the nibbles need only masks and a shift, and one instruction does 32 multiplies.
//! llama.cpp rounds the activations to one 8-bit digit for this; Rivulet keeps f32's precision
//! instead, with three digits per value:
//!
//! - per block of 32 values, `s0 = max|x| / 127`, `s1 = s0 / 256`, `s2 = s1 / 127`;
//! - `D0 = round(x / s0)`, `D1 = round((x − D0·s0) / s1)`, `D2 = round((x − D0·s0 − D1·s1) / s2)`
//!   (each quotient taken as a product with the scale's reciprocal, each rest by an FMA), each in
//!   `−127..=127`: a `D1` that would round to ±128 is held at ±127, and `s2`'s 127 steps still
//!   cover the larger rest;
//! - `x = D0·s0 + D1·s1 + D2·s2` to within `s2 / 2 = max|x| / (2·127·256·127) ≈ 2⁻²³·max|x|`,
//!   the size of f32's own rounding of the block's largest value.
//!
//! A weight row's block sum is then `Σ q·x = (256·ΣqD0 + ΣqD1)·s1 + ΣqD2·s2`, all three integer
//! sums exact (at most 32·15·127), the first two joined exactly in 32-bit integers; the GGUF
//! scale and offset apply as in [`super::panel_gemv_avx2`] (`d·Σ q·x + offset·Σ x`).
//!
//! The panel's 32-byte column pairs ([`super::panels`]) alternate columns `2p` and `2p + 1` byte
//! by byte, so once the low nibbles are masked out each 16-bit word holds one row's values
//! `(2p, 2p + 1)`, and the high nibbles' words its `(2p + 16, 2p + 17)`: `vpmaddubsw` against
//! the broadcast digit pair `(D(x[2p]), D(x[2p + 1]))` (or the `+ 16` one) gives 16 rows'
//! two-term sums with no shuffle. Layout of [`ActivationDigits`]: per block, per digit, 64 bytes,
//! 32-bit word `q < 16` holding `(D(x[2q]), D(x[2q + 1]))` twice, so that each pair is one
//! broadcast load. Per 32 bytes of nibbles (64 weights) the kernel runs 15 vector instructions
//! beside its loads (a mask, a shift and a mask, then six multiplies and six adds), where the
//! panels' earlier one-column-per-16-bytes layout took 21: an interleave of the nibbles and a
//! byte shuffle of each digit vector per pair.
//!
//! Measured: on Zen 3, one thread, SmolLM2's projections for one token (`cargo bench -p
//! rivulet-kernels --bench projections -- 1 1 Q4_1`, alternating with
//! `RIVULET_KERNELS_NO_DIGITS=1`), the first digit kernel took 7.4–7.6 ms per step against the
//! f32 GEMV's 9.4–9.7. On a Zen 4 running this AVX2 code (`RIVULET_KERNELS_NO_AVX512=1`), one
//! thread, one layer's matrices cycled so that they stay in cache (`PROJECTIONS_DISTINCT=1`),
//! six alternating runs: 3.68–4.01 ms with the pairs broadcast, 4.24–5.48 with the shuffles.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::panel_digits_vnni::has_avx512_vnni;
#[cfg(target_arch = "x86_64")]
use super::panel_gemv::prefetch_streamed;
use super::panels::{Kind, Panels, Q4_BLOCK, SCALES};
use super::{has_avx2, PANEL};

/// Digits per activation value.
pub(super) const DIGITS: usize = 3;

/// Pairs of nibble columns per 32-value block (one 32-byte panel load each).
pub(super) const PAIRS: usize = 8;

/// One digit of a block's 32 values as 16 broadcastable pairs (see the module's layout), on a
/// cache line of its own.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct DigitPairs([u8; 64]);

impl Default for DigitPairs {
    fn default() -> Self {
        Self([0; 64])
    }
}

/// One digit of a block's 32 values in order, one byte each: what a VNNI kernel broadcasts four
/// at a time ([`super::panel_digits_vnni`]).
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, align(32))]
pub(super) struct DigitQuads([u8; 32]);

/// One activation row as three 8-bit digits per value (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct ActivationDigits {
    /// `DIGITS` per block.
    pub(super) pairs: Vec<DigitPairs>,
    /// The same digits in order, `DIGITS` per block; empty where no VNNI kernel reads them
    /// ([`super::panel_digits_vnni::has_avx512_vnni`]).
    pub(super) quads: Vec<DigitQuads>,
    /// And in order offset by 128 (`D + 128` as an unsigned byte), as `quads`.
    pub(super) offset_quads: Vec<DigitQuads>,
    /// Per block, `s1` and `s2`.
    pub(super) scales: Vec<[f32; 2]>,
}

impl ActivationDigits {
    /// The digits of `x` (a whole number of 32-value blocks); `None` without AVX2, or where a
    /// value is not finite (the f32 kernels carry infinities and NaNs through as a product would).
    pub fn new(x: &[f32]) -> Option<Self> {
        if !has_avx2() || !x.len().is_multiple_of(32) {
            return None;
        }
        let blocks = x.len() / 32;
        let in_order = if has_avx512_vnni() { blocks * DIGITS } else { 0 };
        let mut digits = Self {
            pairs: vec![DigitPairs::default(); blocks * DIGITS],
            quads: vec![DigitQuads::default(); in_order],
            offset_quads: vec![DigitQuads([128; 32]); in_order],
            scales: vec![[0.0; 2]; blocks],
        };
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA are present (`has_avx2`).
        let finite = unsafe { digits.fill(x) };
        #[cfg(not(target_arch = "x86_64"))]
        let finite = false;
        finite.then_some(digits)
    }

    /// Blocks of 32 values.
    pub fn blocks(&self) -> usize {
        self.scales.len()
    }

    /// Every block's digits and scales (AVX2 and FMA present); `false`, with the digits
    /// unfinished, at the first block holding a value that is not finite. (The check is part of
    /// the pass over each block: a separate scalar scan of the row cost as much as the digits.)
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn fill(&mut self, x: &[f32]) -> bool {
        let in_order = !self.quads.is_empty();
        for (index, ((block, pairs), scales)) in x
            .chunks_exact(32)
            .zip(self.pairs.chunks_exact_mut(DIGITS))
            .zip(&mut self.scales)
            .enumerate()
        {
            // SAFETY: AVX2 and FMA are enabled here; every load reads inside `block` (32 values)
            // and every store writes inside one of `pairs`' `DIGITS` 64-byte-aligned lines or
            // (indexed, so bounds-checked) one of `quads`' or `offset_quads`' 32-byte-aligned ones.
            unsafe {
                let values: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(block.as_ptr().add(8 * i)));
                if !all_finite(values) {
                    return false;
                }
                let largest = largest_magnitude(values);
                let s0 = largest / 127.0;
                let s1 = s0 / 256.0;
                let s2 = s1 / 127.0;
                // Below ~5e-32 `s2` flushes to zero on the kernels' threads and the last digit
                // adds nothing: an error under 1e-38.
                *scales = [s1, s2];
                if largest == 0.0 {
                    continue;
                }
                let mut rest = values;
                for (digit, (line, scale)) in pairs.iter_mut().zip([s0, s1, s2]).enumerate() {
                    let (step, inverse) = (_mm256_set1_ps(scale), _mm256_set1_ps(1.0 / scale));
                    let digits: [__m256i; 4] = std::array::from_fn(|i| {
                        // Nearest, ties to even (MXCSR's default), held to ±127.
                        let d = _mm256_cvtps_epi32(_mm256_mul_ps(rest[i], inverse));
                        let d = _mm256_max_epi32(_mm256_min_epi32(d, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
                        rest[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(d), step, rest[i]);
                        d
                    });
                    let line: *mut __m256i = (line as *mut DigitPairs).cast();
                    let bytes = digit_bytes(digits);
                    if in_order {
                        let at = index * DIGITS + digit;
                        _mm256_store_si256((&mut self.quads[at] as *mut DigitQuads).cast(), bytes);
                        let offset = _mm256_xor_si256(bytes, _mm256_set1_epi8(-128));
                        _mm256_store_si256((&mut self.offset_quads[at] as *mut DigitQuads).cast(), offset);
                    }
                    let [first, second] = broadcast_pairs(bytes);
                    _mm256_store_si256(line, first);
                    _mm256_store_si256(line.add(1), second);
                }
            }
        }
        true
    }
}

/// Whether none of 32 values is infinite or NaN (`v − v` is NaN exactly for those).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn all_finite(values: [__m256; 4]) -> bool {
    let [a, b, c, d] = values.map(|v| _mm256_sub_ps(v, v));
    let any = _mm256_or_ps(_mm256_or_ps(a, b), _mm256_or_ps(c, d));
    _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(any, any)) == 0
}

/// The largest `|v|` of 32 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn largest_magnitude(values: [__m256; 4]) -> f32 {
    let sign = _mm256_set1_ps(-0.0);
    let [a, b, c, d] = values.map(|v| _mm256_andnot_ps(sign, v));
    let m = _mm256_max_ps(_mm256_max_ps(a, b), _mm256_max_ps(c, d));
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_movehdup_ps(m));
    _mm_cvtss_f32(m)
}

/// 32 digits (as 32-bit integers, in order) as 32 bytes in order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn digit_bytes(digits: [__m256i; 4]) -> __m256i {
    // The packs work within 128-bit halves: the bytes come out as digits 0-3, 8-11, 16-19,
    // 24-27, 4-7, 12-15, 20-23, 28-31, which the dword permutation puts back in order.
    let words = [
        _mm256_packs_epi32(digits[0], digits[1]),
        _mm256_packs_epi32(digits[2], digits[3]),
    ];
    let bytes = _mm256_packs_epi16(words[0], words[1]);
    _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// 32 digit bytes in order as 16 32-bit words, word `q` holding the bytes `(D[2q], D[2q + 1])`
/// twice (see the module's layout): words 0..8, then 8..16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn broadcast_pairs(bytes: __m256i) -> [__m256i; 2] {
    // Pairs 0-3 and 8-11 in the first 128 bits, 4-7 and 12-15 in the last, so that the
    // in-lane unpacks below give pairs 0-7 and then 8-15, each doubled.
    let bytes = _mm256_permute4x64_epi64::<0b11_01_10_00>(bytes);
    [_mm256_unpacklo_epi16(bytes, bytes), _mm256_unpackhi_epi16(bytes, bytes)]
}

impl Panels {
    /// `out[r] = Σ_k x[k] · w[panel · PANEL + r][k]` for `r < PANEL`, with `x` given as its
    /// digits and `sums` its [`super::block_sums`]; 4-bit panels only.
    pub fn product_digits_avx2(&self, panel: usize, x: &ActivationDigits, sums: &[f32], out: &mut [f32]) {
        assert!(has_avx2() && self.kind() == Kind::Q4);
        let blocks = self.blocks_per_row();
        assert_eq!(x.blocks(), blocks);
        assert!(x.pairs.len() == blocks * DIGITS && sums.len() >= blocks);
        assert!(out.len() >= PANEL);
        let source = self.blocks(panel, 0..blocks);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 present; `source` holds the panel's `blocks` Q4 blocks, `x` `blocks` blocks
        // of digit pairs and scales, `sums` `blocks` sums and `out` `PANEL` values (asserted).
        unsafe {
            q4_digits(
                source.as_ptr(),
                blocks,
                x.pairs.as_ptr().cast(),
                x.scales.as_ptr().cast(),
                sums.as_ptr(),
                out.as_mut_ptr(),
            );
        }
    }
}

/// The 16 rows of a 4-bit panel times one row's digits (see the module docs).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_digits(
    w: *const u8,
    blocks: usize,
    digits: *const u8,
    scales: *const f32,
    sums: *const f32,
    out: *mut f32,
) {
    // SAFETY (whole body): `w` holds `blocks` Q4 panel blocks, `digits` `blocks · DIGITS`
    // 64-byte lines of digit pairs, `scales` `2 · blocks` and `sums` `blocks` values, `out`
    // `PANEL` (caller).
    unsafe {
        let low_nibbles = _mm256_set1_epi8(0x0F);
        // `vpmaddwd` weights: (ΣqD1, ΣqD0) pairs into 256·ΣqD0 + ΣqD1, and (a, b) into a + b.
        let join = _mm256_set1_epi32(256 << 16 | 1);
        let add = _mm256_set1_epi16(1);
        let mut totals = [_mm256_setzero_ps(); 2];
        for block in 0..blocks {
            let base = w.add(block * Q4_BLOCK);
            prefetch_streamed(base, Q4_BLOCK);
            let nibbles = base.add(2 * SCALES);
            let lines = digits.add(block * DIGITS * 64);
            // Per digit, 16-bit sums of the 16 rows (word r: row r) over the low nibbles' columns
            // and over the high ones': each at most 8 · 2 · 15 · 127 in size.
            let mut sums16 = [[_mm256_setzero_si256(); 2]; DIGITS];
            for pair in 0..PAIRS {
                let bytes = _mm256_loadu_si256(nibbles.add(32 * pair).cast());
                // Word r: row r's values (2p, 2p + 1), then (2p + 16, 2p + 17).
                let nibble_words = [
                    _mm256_and_si256(bytes, low_nibbles),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), low_nibbles),
                ];
                for (digit, sums) in sums16.iter_mut().enumerate() {
                    let line = lines.add(64 * digit).cast::<i32>();
                    for (half, (sum, words)) in sums.iter_mut().zip(nibble_words).enumerate() {
                        let x = _mm256_set1_epi32(*line.add(pair + PAIRS * half));
                        *sum = _mm256_add_epi16(*sum, _mm256_maddubs_epi16(words, x));
                    }
                }
            }
            // 32-bit sums of rows 0..4 and 8..12 (`[0]`), 4..8 and 12..16 (`[1]`): the leading
            // digits joined, then the last digit's two halves added.
            let [first, second, third] = sums16;
            let mut leading = [_mm256_setzero_si256(); 2];
            for (a, b) in first.into_iter().zip(second) {
                leading[0] = _mm256_add_epi32(leading[0], _mm256_madd_epi16(_mm256_unpacklo_epi16(b, a), join));
                leading[1] = _mm256_add_epi32(leading[1], _mm256_madd_epi16(_mm256_unpackhi_epi16(b, a), join));
            }
            let last = [
                _mm256_madd_epi16(_mm256_unpacklo_epi16(third[0], third[1]), add),
                _mm256_madd_epi16(_mm256_unpackhi_epi16(third[0], third[1]), add),
            ];
            // Rows in order: 0..8, then 8..16.
            let in_order = |sums: [__m256i; 2]| {
                [
                    _mm256_permute2x128_si256::<0x20>(sums[0], sums[1]),
                    _mm256_permute2x128_si256::<0x31>(sums[0], sums[1]),
                ]
            };
            let (leading, last) = (in_order(leading), in_order(last));
            let s1 = _mm256_broadcast_ss(&*scales.add(2 * block));
            let s2 = _mm256_broadcast_ss(&*scales.add(2 * block + 1));
            let block_sum = _mm256_broadcast_ss(&*sums.add(block));
            for (half, total) in totals.iter_mut().enumerate() {
                let dot = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(last[half]),
                    s2,
                    _mm256_mul_ps(_mm256_cvtepi32_ps(leading[half]), s1),
                );
                let d = _mm256_cvtph_ps(_mm_loadu_si128(base.add(16 * half).cast()));
                let offset = _mm256_cvtph_ps(_mm_loadu_si128(base.add(SCALES + 16 * half).cast()));
                *total = _mm256_fmadd_ps(d, dot, _mm256_fmadd_ps(offset, block_sum, *total));
            }
        }
        _mm256_storeu_ps(out, totals[0]);
        _mm256_storeu_ps(out.add(8), totals[1]);
    }
}

/// Test data shared with [`super::panel_digits_avx512`]'s tests.
#[cfg(test)]
pub(super) mod fixtures {
    use super::Panels;

    /// `rows` rows of `blocks` Q4_1 blocks with scales and offsets that vary by row, as panels,
    /// and as GGUF's scalar dequantization gives them (row-major).
    pub fn q4_1_panels(rows: usize, blocks: usize) -> (Panels, Vec<f32>) {
        let mut data = Vec::new();
        for i in 0..rows * blocks {
            let scale = half::f16::from_f32(0.002 + 0.0001 * (i % 7) as f32);
            let minimum = half::f16::from_f32(-0.015 * (1.0 + (i % 3) as f32));
            data.extend(scale.to_le_bytes());
            data.extend(minimum.to_le_bytes());
            data.extend((0..16).map(|k| ((i * 31 + k * 17) % 256) as u8));
        }
        let panels = Panels::new(rivulet_gguf::GgmlType::Q4_1, &data, rows, blocks, blocks * 20).expect("Q4_1 panels");
        let mut dense = Vec::new();
        rivulet_gguf::dequant::dequantize_append(rivulet_gguf::GgmlType::Q4_1, &data, &mut dense).expect("Q4_1");
        (panels, dense)
    }

    /// Rows of `cols` values (at least 128) shaped like a model's activations: a few values
    /// 100× the rest and a block of zeros, at three spreads (returned with each row).
    pub fn activation_rows(cols: usize) -> Vec<(f32, Vec<f32>)> {
        [1.0f32, 100.0, 1e-3]
            .into_iter()
            .map(|spread| {
                let mut x: Vec<f32> = (0..cols)
                    .map(|k| ((k * 7919 % 211) as f32 / 105.0 - 1.0) * spread)
                    .collect();
                x[5] *= 150.0;
                x[70] *= -90.0;
                x[96..128].fill(0.0);
                (spread, x)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Digits rebuild every value to within 2⁻²² of its block's largest, whatever the spread.
    #[test]
    fn digits_rebuild_each_value() {
        if !has_avx2() {
            return;
        }
        let mut x: Vec<f32> = (0..96).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
        x[3] = 75.5; // one outlier in the first block
        x[40..72].fill(0.0); // an all-zero block
        x[80] = 1e-30;
        let digits = ActivationDigits::new(&x).expect("finite");
        for (b, block) in x.chunks_exact(32).enumerate() {
            let [s1, s2] = digits.scales[b];
            let largest = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (k, &value) in block.iter().enumerate() {
                // Word k / 2 holds values k & !1 and k | 1, twice.
                let digit = |d: usize| {
                    let line = &digits.pairs[b * DIGITS + d].0;
                    let (at, twin) = (4 * (k / 2) + k % 2, 4 * (k / 2) + 2 + k % 2);
                    assert_eq!(line[at], line[twin]);
                    f64::from(line[at] as i8)
                };
                let rebuilt = (256.0 * digit(0) + digit(1)) * f64::from(s1) + digit(2) * f64::from(s2);
                let error = (rebuilt - f64::from(value)).abs();
                assert!(
                    error <= f64::from(largest) * 2f64.powi(-22),
                    "block {b} value {k}: {value} rebuilt as {rebuilt}"
                );
            }
        }
        assert!(ActivationDigits::new(&[f32::NAN; 32]).is_none());
        assert!(ActivationDigits::new(&[0.5, f32::INFINITY].repeat(16)).is_none());
        assert!(ActivationDigits::new(&[0.0; 31]).is_none());
        for (at, bad) in [(95, f32::NAN), (33, f32::NEG_INFINITY), (64, f32::INFINITY)] {
            let mut row = x.clone();
            row[at] = bad;
            assert!(ActivationDigits::new(&row).is_none(), "{bad} at {at}");
        }
    }

    /// A Q4_1 panel times rows shaped like a model's activations (a few values 100× the rest, a
    /// block of zeros) against GGUF's scalar dequantization and an f64 product, to the f32
    /// kernels' tolerance.
    #[test]
    fn products_match_dequantize_then_f64() {
        if !has_avx2() {
            return;
        }
        let blocks = 5;
        let (panels, dense) = fixtures::q4_1_panels(PANEL, blocks);
        let cols = blocks * 32;
        for (spread, x) in fixtures::activation_rows(cols) {
            let digits = ActivationDigits::new(&x).expect("finite");
            let sums = crate::simd::block_sums(&x, cols, 1, cols);
            let mut out = [0f32; PANEL];
            panels.product_digits_avx2(0, &digits, &sums, &mut out);
            for (r, &got) in out.iter().enumerate() {
                let terms = (0..cols).map(|k| f64::from(dense[r * cols + k]) * f64::from(x[k]));
                let (exact, magnitude) = terms.fold((0.0, 0.0), |(e, m), t| (e + t, m + t.abs()));
                let tolerance = 2e-6 * magnitude + 1e-6 * f64::from(spread);
                assert!(
                    (f64::from(got) - exact).abs() <= tolerance,
                    "spread {spread} row {r}: {got} against {exact}"
                );
            }
        }
    }
}
