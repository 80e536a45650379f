//! One activation row times a 4-bit panel ([`Panels`]) with AVX2 integer multiplies: the row split
//! into three signed 8-bit digits per value, each digit multiplied by the 4-bit weights with
//! `vpmaddubsw`. Part of [`super`]'s `unsafe`, under its invariants.
//!
//! Why: on a CPU without AVX-512 a one-token step is bound by the instructions that turn 4-bit
//! weights into f32 (a widening, a mask or shift and a conversion per 8 weights before each FMA),
//! not by memory. `vpmaddubsw` multiplies 32 unsigned bytes by 32 signed ones and adds adjacent
//! pairs, so the nibbles need only a mask and an interleave, and one instruction does 32
//! multiplies. llama.cpp rounds the activations to one 8-bit digit for this; Rivulet keeps f32's
//! precision instead, with three digits per value:
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
//! scale and offset apply as in [`super::panel_gemv_avx2`] (`d·Σ q·x + offset·Σ x`). Zen 3, one
//! thread, SmolLM2's projections for one token (`cargo bench -p rivulet-kernels --bench
//! projections -- 1 1 Q4_1`, alternating with `RIVULET_KERNELS_NO_DIGITS=1`): 7.4–7.6 ms per step
//! against 9.4–9.7.
//!
//! Layout of [`ActivationDigits`]: per block, per digit, one 32-byte vector of 16 words, word
//! `(D(x[j]), D(x[j + 16]))` for the even columns `j` in the first 128 bits and for the odd ones
//! in the last. A 32-byte load of the panel holds columns `2p` and `2p + 1` of 16 rows; after
//! the nibbles are interleaved, one in-lane byte shuffle of the digit vector gives each row's
//! (low nibble, high nibble) byte pair its (`D(x[j])`, `D(x[j + 16])`) pair for `vpmaddubsw`. The
//! vectors are aligned: unaligned, the kernel ran at half speed.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::panel_gemv::prefetch_ahead;
use super::panels::{Kind, Panels, Q4_BLOCK, SCALES};
use super::{has_avx2, PANEL};

/// Digits per activation value.
const DIGITS: usize = 3;

/// Pairs of nibble columns per 32-value block (one 32-byte panel load each).
const PAIRS: usize = 8;

/// One digit vector (see the module's layout), aligned so that a load never splits a cache line.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, align(32))]
struct DigitVector([u16; 16]);

/// One activation row as three 8-bit digits per value (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct ActivationDigits {
    /// `DIGITS` vectors per block.
    vectors: Vec<DigitVector>,
    /// Per block, `s1` and `s2`.
    scales: Vec<[f32; 2]>,
}

impl ActivationDigits {
    /// The digits of `x` (a whole number of 32-value blocks); `None` without AVX2, or where a
    /// value is not finite (the f32 kernels carry infinities and NaNs through as a product would).
    pub fn new(x: &[f32]) -> Option<Self> {
        if !has_avx2() || !x.len().is_multiple_of(32) || !x.iter().all(|v| v.is_finite()) {
            return None;
        }
        let blocks = x.len() / 32;
        let mut digits = Self {
            vectors: vec![DigitVector::default(); blocks * DIGITS],
            scales: vec![[0.0; 2]; blocks],
        };
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA are present (`has_avx2`).
        unsafe {
            digits.fill(x)
        };
        Some(digits)
    }

    /// Blocks of 32 values.
    pub fn blocks(&self) -> usize {
        self.scales.len()
    }

    /// Every block's digits and scales (AVX2 and FMA present).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn fill(&mut self, x: &[f32]) {
        for ((block, vectors), scales) in x
            .chunks_exact(32)
            .zip(self.vectors.chunks_exact_mut(DIGITS))
            .zip(&mut self.scales)
        {
            // SAFETY: AVX2 and FMA are enabled here; every load reads inside `block` (32 values)
            // and every store writes one of `vectors`' `DIGITS` aligned vectors.
            unsafe {
                let values: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(block.as_ptr().add(8 * i)));
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
                for (vector, scale) in vectors.iter_mut().zip([s0, s1, s2]) {
                    let (step, inverse) = (_mm256_set1_ps(scale), _mm256_set1_ps(1.0 / scale));
                    let digits: [__m256i; 4] = std::array::from_fn(|i| {
                        // Nearest, ties to even (MXCSR's default), held to ±127.
                        let d = _mm256_cvtps_epi32(_mm256_mul_ps(rest[i], inverse));
                        let d = _mm256_max_epi32(_mm256_min_epi32(d, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
                        rest[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(d), step, rest[i]);
                        d
                    });
                    _mm256_store_si256((vector as *mut DigitVector).cast(), word_pairs(digits));
                }
            }
        }
    }
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

/// 32 digits (as 32-bit integers, in order) packed into a digit vector: bytes, then each even
/// column's (`j`, `j + 16`) pair as a word in the first 128 bits and each odd one's in the last
/// (see the module's layout).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn word_pairs(digits: [__m256i; 4]) -> __m256i {
    // The packs work within 128-bit halves: the bytes come out as digits 0-3, 8-11, 16-19,
    // 24-27, 4-7, 12-15, 20-23, 28-31, which the dword permutation puts back in order.
    let words = [
        _mm256_packs_epi32(digits[0], digits[1]),
        _mm256_packs_epi32(digits[2], digits[3]),
    ];
    let bytes = _mm256_packs_epi16(words[0], words[1]);
    let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // Each 128-bit half (digits 0-15, then 16-31) as its even digits, then its odd ones.
    let split = _mm256_shuffle_epi8(
        bytes,
        _mm256_setr_epi8(
            0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
        ),
    );
    // First half: even digits of 0-15 then of 16-31; last half: the odd ones.
    let split = _mm256_permute4x64_epi64::<0b11_01_10_00>(split);
    _mm256_unpacklo_epi8(split, _mm256_bsrli_epi128::<8>(split))
}

/// `vpshufb` controls: pair `p`'s word of each 128-bit half, eight times.
#[cfg(target_arch = "x86_64")]
static PAIR_SHUFFLES: [[u8; 32]; PAIRS] = {
    let mut controls = [[0u8; 32]; PAIRS];
    let mut pair = 0;
    while pair < PAIRS {
        let mut byte = 0;
        while byte < 32 {
            controls[pair][byte] = (2 * pair + byte % 2) as u8;
            byte += 1;
        }
        pair += 1;
    }
    controls
};

impl Panels {
    /// `out[r] = Σ_k x[k] · w[panel · PANEL + r][k]` for `r < PANEL`, with `x` given as its
    /// digits and `sums` its [`super::block_sums`]; 4-bit panels only.
    pub fn product_digits_avx2(&self, panel: usize, x: &ActivationDigits, sums: &[f32], out: &mut [f32]) {
        assert!(has_avx2() && self.kind() == Kind::Q4);
        let blocks = self.blocks_per_row();
        assert_eq!(x.blocks(), blocks);
        assert!(x.vectors.len() == blocks * DIGITS && sums.len() >= blocks);
        assert!(out.len() >= PANEL);
        let source = self.blocks(panel, 0..blocks);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 present; `source` holds the panel's `blocks` Q4 blocks, `x` `blocks` blocks
        // of digit vectors and scales, `sums` `blocks` sums and `out` `PANEL` values (asserted).
        unsafe {
            q4_digits(
                source.as_ptr(),
                blocks,
                x.vectors.as_ptr().cast(),
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
    // 32-byte-aligned vectors, `scales` `2 · blocks` and `sums` `blocks` values, `out` `PANEL`
    // (caller).
    unsafe {
        let low_nibbles = _mm256_set1_epi8(0x0F);
        // `vpmaddwd` weights that join (ΣqD1, ΣqD0) pairs into 256·ΣqD0 + ΣqD1.
        let join = _mm256_set1_epi32(256 << 16 | 1);
        let mut totals = [_mm256_setzero_ps(); 2];
        for block in 0..blocks {
            let base = w.add(block * Q4_BLOCK);
            prefetch_ahead(base, Q4_BLOCK);
            let nibbles = base.add(2 * SCALES);
            let vectors = digits.add(block * DIGITS * 32);
            let compact: [__m256i; DIGITS] =
                std::array::from_fn(|digit| _mm256_load_si256(vectors.add(32 * digit).cast()));
            // Per digit, rows 0..8 and 8..16: 16-bit sums, the first 128 bits over the even
            // columns and the last over the odd ones; each at most 8 · 2 · 15 · 127 in size.
            let mut sums16 = [[_mm256_setzero_si256(); 2]; DIGITS];
            for (pair, shuffle) in PAIR_SHUFFLES.iter().enumerate() {
                let bytes = _mm256_loadu_si256(nibbles.add(32 * pair).cast());
                let low = _mm256_and_si256(bytes, low_nibbles);
                let high = _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), low_nibbles);
                // Row r's (value j, value j + 16) byte pairs: rows 0..8, then rows 8..16.
                let rows = [_mm256_unpacklo_epi8(low, high), _mm256_unpackhi_epi8(low, high)];
                let control = _mm256_loadu_si256(shuffle.as_ptr().cast());
                for (sums, compact) in sums16.iter_mut().zip(compact) {
                    let x = _mm256_shuffle_epi8(compact, control);
                    for (sum, rows) in sums.iter_mut().zip(rows) {
                        *sum = _mm256_add_epi16(*sum, _mm256_maddubs_epi16(rows, x));
                    }
                }
            }
            let s1 = _mm256_broadcast_ss(&*scales.add(2 * block));
            let s2 = _mm256_broadcast_ss(&*scales.add(2 * block + 1));
            let block_sum = _mm256_broadcast_ss(&*sums.add(block));
            for (half, total) in totals.iter_mut().enumerate() {
                let [first, second, third] = [sums16[0][half], sums16[1][half], sums16[2][half]];
                // Rows 0..4 and 4..8 of this half as 256·ΣqD0 + ΣqD1, even columns in the first
                // 128 bits, odd ones in the last; then the two added per row.
                let joined_low = _mm256_madd_epi16(_mm256_unpacklo_epi16(second, first), join);
                let joined_high = _mm256_madd_epi16(_mm256_unpackhi_epi16(second, first), join);
                let leading = _mm256_add_epi32(
                    _mm256_permute2x128_si256::<0x20>(joined_low, joined_high),
                    _mm256_permute2x128_si256::<0x31>(joined_low, joined_high),
                );
                let last = _mm256_add_epi32(
                    _mm256_cvtepi16_epi32(_mm256_castsi256_si128(third)),
                    _mm256_cvtepi16_epi32(_mm256_extracti128_si256::<1>(third)),
                );
                let dot = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(last),
                    s2,
                    _mm256_mul_ps(_mm256_cvtepi32_ps(leading), s1),
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
                let (pair, half) = ((k % 16) / 2, k % 2);
                let byte = usize::from(k >= 16);
                let digit = |d: usize| {
                    let word = digits.vectors[b * DIGITS + d].0[8 * half + pair];
                    f64::from(word.to_le_bytes()[byte] as i8)
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
    }

    /// A Q4_1 panel times rows shaped like a model's activations (a few values 100× the rest, a
    /// block of zeros) against GGUF's scalar dequantization and an f64 product, to the f32
    /// kernels' tolerance.
    #[test]
    fn products_match_dequantize_then_f64() {
        if !has_avx2() {
            return;
        }
        let (rows, blocks) = (16, 5);
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
        let cols = blocks * 32;
        for spread in [1.0f32, 100.0, 1e-3] {
            let mut x: Vec<f32> = (0..cols)
                .map(|k| ((k * 7919 % 211) as f32 / 105.0 - 1.0) * spread)
                .collect();
            x[5] *= 150.0;
            x[70] *= -90.0;
            x[96..128].fill(0.0);
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
