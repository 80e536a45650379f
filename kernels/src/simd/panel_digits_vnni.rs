//! One activation row times two 4-bit panels at once with AVX-512 VNNI: the digits scheme of
//! [`super::panel_digits_avx2`] (the row as three signed 8-bit digits per value, every integer
//! sum exact), with `vpdpbusd` multiplying four weights of a row by four digits and adding the
//! four products into a 32-bit sum in one instruction. Part of [`super`]'s `unsafe`, under its
//! invariants (its functions need AVX-512 VNNI and BW as well: [`has_avx512_vnni`]).
//!
//! Why: the AVX-512BW kernel ([`super::panel_digits_avx512`]) spends two instructions per
//! multiply (`vpmaddubsw`, then a 16-bit add) and joins its 16-bit sums into 32-bit ones per
//! block. `vpdpbusd` accumulates straight into 32-bit sums, so a block of two panels costs ~125
//! instructions instead of ~230 (~150 before one permute put each pair of column pairs in row
//! order: below); and this kernel fetches its weights into L2 far ahead
//! ([`super::panel_gemv::L2_PREFETCH_BLOCKS`], in reading order through
//! [`super::panel_gemv::PairAhead`]), which a step bound by memory needs more.
//! Measured on a Xeon (Emerald Rapids, 2 threads): one layer's projections kept in cache
//! (`PROJECTIONS_DISTINCT=1 cargo bench -p rivulet-kernels --bench projections -- 1 1 Q4_1`,
//! one thread, alternating with `RIVULET_KERNELS_NO_VNNI=1`) 3.01–3.78 ms per step against
//! 3.90–5.07; a one-token step (`rivulet-worker-bench`, batch 1 at context 256, four alternating
//! runs) 6.41–7.15 ms against 7.92–8.42, its 4-bit projections 3.4–3.9 ms against 4.8–5.1.
//!
//! Layout: the panels keep their one layout ([`super::panels`]): 16-bit word `r` of a 32-byte
//! column pair `p` holds row `r`'s values `(2p, 2p + 1)` once the nibbles are masked apart.
//! Pairs `2g` and `2g + 1` of a panel lie side by side, so one 64-byte load holds both, and one
//! `vpermw` interleaves their words ([`INTERLEAVE_PAIRS`]): each 32-bit word is then one row's
//! values `4g..4g + 4` (or `4g + 16..4g + 20` for the high nibbles), rows in order, what
//! `vpdpbusd` multiplies by the broadcast digits `D[4g..4g + 4]`
//! ([`super::panel_digits_avx2::DigitQuads`]). (The first version loaded each pair of both
//! panels as 256-bit halves of one vector and interleaved them with `vpunpcklwd`/`vpunpckhwd`,
//! which work within 128-bit lanes and left the rows to be put back in order per block: per
//! group of four columns four loads, two inserts and four unpacks where this takes two permutes
//! of a load each. On a Zen 4, one layer's projections kept in cache, `PROJECTIONS_BEST_ONLY=1
//! PROJECTIONS_DISTINCT=1 cargo bench -p rivulet-kernels --bench projections -- 1 1 Q4_1`:
//! 2.37–2.39 ms a step against 2.69–2.74, four alternating runs; from memory on two threads
//! both at the read rate.)
//!
//! The 32-bit sums are the BW kernel's (`Σ q·D` per digit, the leading two joined as
//! `256·ΣqD0 + ΣqD1`, exact below 2²⁴), and the scaling is the same arithmetic in the same
//! order, so the results equal the AVX2 digit kernel's bit for bit (a test in
//! [`super::panel_digits_avx512`] holds both pair kernels to it).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::panel_digits_avx2::{ActivationDigits, DIGITS};
#[cfg(target_arch = "x86_64")]
use super::panel_gemv::{prefetch_pair, PairAhead, L2_PREFETCH_BLOCKS, PREFETCH_BLOCKS};
use super::panels::{Kind, Panels, Q4_BLOCK, Q8_BLOCK, SCALES};
use super::{has_avx512bw, PANEL};

/// Whether the VNNI digit kernel runs here: the AVX-512BW one does ([`has_avx512bw`]) and
/// `vpdpbusd` is present (detected once); `RIVULET_KERNELS_NO_VNNI=1` keeps to the BW kernel (to
/// compare them).
pub fn has_avx512_vnni() -> bool {
    use std::sync::OnceLock;
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        if std::env::var_os("RIVULET_KERNELS_NO_VNNI").is_some() {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        {
            has_avx512bw() && is_x86_feature_detected!("avx512vnni")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Groups of four columns per half block (pairs `2g` and `2g + 1` of the panel's column pairs).
const GROUPS: usize = 4;

/// `vpermw`'s indices for [`q4_digits_pair_vnni`]: word `2r` of the result from word `r` of a
/// 64-byte load (column pair `2g`'s row `r`), word `2r + 1` from word `16 + r` (pair `2g + 1`'s).
const INTERLEAVE_PAIRS: [u16; 32] = {
    let mut indices = [0u16; 32];
    let mut i = 0;
    while i < 32 {
        indices[i] = (i / 2 + 16 * (i % 2)) as u16;
        i += 1;
    }
    indices
};

/// The 16 rows of each of two 4-bit panels times one row's digits (see the module docs), called
/// through [`Panels::product_digits_pair`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
pub(super) unsafe fn q4_digits_pair_vnni(
    panels: [*const u8; 2],
    blocks: usize,
    digits: *const u8,
    scales: *const f32,
    sums: *const f32,
    out: *mut f32,
) {
    // SAFETY (whole body): each of `panels` holds `blocks` Q4 panel blocks, `digits`
    // `blocks · DIGITS` 32-byte lines of digits in order, `scales` `2 · blocks` and `sums`
    // `blocks` values, `out` `2 · PANEL` (caller).
    unsafe {
        let low_nibbles = _mm512_set1_epi8(0x0F);
        let interleave = _mm512_loadu_si512(INTERLEAVE_PAIRS.as_ptr().cast());
        let mut totals = [_mm512_setzero_ps(); 2];
        let mut far = PairAhead::new(L2_PREFETCH_BLOCKS, blocks);
        let mut near = PairAhead::new(PREFETCH_BLOCKS, blocks);
        for block in 0..blocks {
            let bases = panels.map(|panel| panel.add(block * Q4_BLOCK));
            prefetch_pair::<_MM_HINT_T1>(panels, far.advance(), Q4_BLOCK);
            prefetch_pair::<_MM_HINT_T0>(panels, near.advance(), Q4_BLOCK);
            let nibbles = bases.map(|base| base.add(2 * SCALES));
            let lines = digits.add(block * DIGITS * 32).cast::<i32>();
            // Per digit, per panel, per low/high nibbles: 32-bit sums (separate chains, so that
            // `vpdpbusd`'s latency stays hidden).
            let mut sums32 = [[[_mm512_setzero_si512(); 2]; 2]; DIGITS];
            for group in 0..GROUPS {
                // `[panel][nibbles]`: 32-bit word `r` = row `r`'s values `4g..4g + 4` (low
                // nibbles) or `4g + 16..4g + 20` (high), from column pairs `2g` and `2g + 1`,
                // which lie side by side (64 bytes).
                let mut quads = [[_mm512_setzero_si512(); 2]; 2];
                for (quads, nibbles) in quads.iter_mut().zip(nibbles) {
                    let both = _mm512_loadu_si512(nibbles.add(64 * group).cast());
                    let rows = _mm512_permutexvar_epi16(interleave, both);
                    quads[0] = _mm512_and_si512(rows, low_nibbles);
                    quads[1] = _mm512_and_si512(_mm512_srli_epi16::<4>(rows), low_nibbles);
                }
                for (digit, sums) in sums32.iter_mut().enumerate() {
                    let line = lines.add(8 * digit);
                    for nibbles in 0..2 {
                        // Digits `4g..4g + 4`, or `4g + 16..4g + 20` for the high nibbles.
                        let x = _mm512_set1_epi32(*line.add(group + GROUPS * nibbles));
                        for (sums, quads) in sums.iter_mut().zip(&quads) {
                            sums[nibbles] = _mm512_dpbusd_epi32(sums[nibbles], quads[nibbles], x);
                        }
                    }
                }
            }
            // (Plain loops: an `array::map` here was not inlined into this `target_feature`
            // function, and its call spilled every sum to the stack.)
            let mut digit_sums = [[_mm512_setzero_si512(); 2]; DIGITS];
            for (joined, sums) in digit_sums.iter_mut().zip(sums32) {
                for (joined, [low, high]) in joined.iter_mut().zip(sums) {
                    *joined = _mm512_add_epi32(low, high);
                }
            }
            let [first, second, third] = digit_sums;
            let s1 = _mm512_set1_ps(*scales.add(2 * block));
            let s2 = _mm512_set1_ps(*scales.add(2 * block + 1));
            let block_sum = _mm512_set1_ps(*sums.add(block));
            let panel_sums = first.into_iter().zip(second).zip(third);
            for ((total, base), ((first, second), third)) in totals.iter_mut().zip(bases).zip(panel_sums) {
                let leading = _mm512_add_epi32(_mm512_slli_epi32::<8>(first), second);
                let dot = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(third),
                    s2,
                    _mm512_mul_ps(_mm512_cvtepi32_ps(leading), s1),
                );
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(base.cast()));
                let offset = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(SCALES).cast()));
                *total = _mm512_fmadd_ps(d, dot, _mm512_fmadd_ps(offset, block_sum, *total));
            }
        }
        _mm512_storeu_ps(out, totals[0]);
        _mm512_storeu_ps(out.add(PANEL), totals[1]);
    }
}

/// Whether the Q8_0 VNNI digit kernel runs here: the 4-bit one does ([`has_avx512_vnni`]) and
/// `vpermb` is present (AVX-512 VBMI; the standard library caches the CPU's answer).
pub fn has_avx512_vnni_vbmi() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_avx512_vnni() && is_x86_feature_detected!("avx512vbmi")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

impl Panels {
    /// `out[r] = Σ_k x[k] · w[panel · PANEL + r][k]` for `r < 2 · PANEL`: panels `panel` and
    /// `panel + 1`, or `panel` alone (`out`'s rows `0..PANEL`, the rest left as they were) where
    /// it is the last; `x` given as its digits; Q8_0 panels only.
    pub fn product_digits_q8_vnni(&self, panel: usize, x: &ActivationDigits, out: &mut [f32]) {
        assert!(has_avx512_vnni_vbmi() && self.kind() == Kind::Q8);
        let blocks = self.blocks_per_row();
        assert_eq!(x.blocks(), blocks);
        assert!(x.offset_quads.len() == blocks * DIGITS && x.scales.len() == blocks);
        assert!(out.len() >= 2 * PANEL);
        let first = self.blocks(panel, 0..blocks);
        let second = if panel + 1 < self.panel_count() {
            self.blocks(panel + 1, 0..blocks)
        } else {
            first
        };
        let mut sums = [0f32; 2 * PANEL];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F, BW, VNNI and VBMI present (`has_avx512_vnni_vbmi`); `first` and
        // `second` hold `blocks` Q8 blocks each, `x` `blocks` blocks of offset digits and scales,
        // `sums` `2 · PANEL` values (asserted).
        unsafe {
            q8_digits_pair_vnni(
                [first.as_ptr(), second.as_ptr()],
                blocks,
                x.offset_quads.as_ptr().cast(),
                x.scales.as_ptr().cast(),
                sums.as_mut_ptr(),
            );
        }
        let rows = if std::ptr::eq(first, second) { PANEL } else { 2 * PANEL };
        out[..rows].copy_from_slice(&sums[..rows]);
    }
}

/// `vpermb`'s indices for [`q8_digits_pair_vnni`]: byte `4r + c` of a line's result from its
/// byte `16c + r` (row `r`'s column `c` of four).
const TO_ROWS: [u8; 64] = {
    let mut indices = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        indices[i] = (16 * (i % 4) + i / 4) as u8;
        i += 1;
    }
    indices
};

/// Two Q8_0 panels' 16 rows times one row's digits. A block's 64-byte line `j` holds columns
/// `4j..4j + 4` of the 16 rows (16 bytes a column); `vpermb` turns it into 32-bit words of one
/// row's four columns, which `vpdpbusd` multiplies by four digits. `vpdpbusd` takes one side
/// unsigned: the digits go in offset by 128 (`D + 128`, in `1..=255`), and `128 · Σq` (summed by
/// one more `vpdpbusd` against ones) comes off again, so every sum stays exact. The three digit
/// sums are joined in f32, smallest first (`256·ΣqD0` can pass 2²⁴ with 8-bit weights).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi,f16c")]
unsafe fn q8_digits_pair_vnni(
    panels: [*const u8; 2],
    blocks: usize,
    digits: *const u8,
    scales: *const f32,
    out: *mut f32,
) {
    // SAFETY (whole body): each of `panels` holds `blocks` Q8 panel blocks, `digits`
    // `blocks · DIGITS` 32-byte lines of offset digits in order, `scales` `2 · blocks` values,
    // `out` `2 · PANEL` (caller).
    unsafe {
        let to_rows = _mm512_loadu_si512(TO_ROWS.as_ptr().cast());
        let ones = _mm512_set1_epi8(1);
        let mut totals = [_mm512_setzero_ps(); 2];
        let mut far = PairAhead::new(L2_PREFETCH_BLOCKS, blocks);
        let mut near = PairAhead::new(PREFETCH_BLOCKS, blocks);
        for block in 0..blocks {
            let lines = digits.add(block * DIGITS * 32).cast::<i32>();
            let bases = [panels[0].add(block * Q8_BLOCK), panels[1].add(block * Q8_BLOCK)];
            prefetch_pair::<_MM_HINT_T1>(panels, far.advance(), Q8_BLOCK);
            prefetch_pair::<_MM_HINT_T0>(panels, near.advance(), Q8_BLOCK);
            // Per panel: the three digit sums, then the weights' sum.
            let mut sums = [[_mm512_setzero_si512(); 4]; 2];
            for j in 0..8 {
                let x0 = _mm512_set1_epi32(*lines.add(j));
                let x1 = _mm512_set1_epi32(*lines.add(8 + j));
                let x2 = _mm512_set1_epi32(*lines.add(16 + j));
                for p in 0..2 {
                    let line = _mm512_loadu_si512(bases[p].add(SCALES + 64 * j).cast());
                    let w = _mm512_permutexvar_epi8(to_rows, line);
                    sums[p][0] = _mm512_dpbusd_epi32(sums[p][0], x0, w);
                    sums[p][1] = _mm512_dpbusd_epi32(sums[p][1], x1, w);
                    sums[p][2] = _mm512_dpbusd_epi32(sums[p][2], x2, w);
                    sums[p][3] = _mm512_dpbusd_epi32(sums[p][3], ones, w);
                }
            }
            let s1 = _mm512_set1_ps(*scales.add(2 * block));
            let s2 = _mm512_set1_ps(*scales.add(2 * block + 1));
            let s0 = _mm512_mul_ps(s1, _mm512_set1_ps(256.0));
            for p in 0..2 {
                let offsets = _mm512_slli_epi32::<7>(sums[p][3]);
                let exact0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[p][0], offsets));
                let exact1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[p][1], offsets));
                let exact2 = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[p][2], offsets));
                let dot = _mm512_fmadd_ps(exact0, s0, _mm512_fmadd_ps(exact1, s1, _mm512_mul_ps(exact2, s2)));
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(bases[p].cast()));
                totals[p] = _mm512_fmadd_ps(d, dot, totals[p]);
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

    /// Q8_0 panel pairs (and a last lone panel) against GGUF's scalar dequantization times the
    /// row in f64, to the f32 kernels' tolerance.
    #[test]
    fn q8_panels_match_dequantize_then_f64() {
        if !has_avx512_vnni_vbmi() {
            return;
        }
        let (rows, blocks) = (3 * PANEL, 5);
        let mut data = Vec::new();
        for i in 0..rows * blocks {
            data.extend(half::f16::from_f32(0.001 + 0.0003 * (i % 5) as f32).to_le_bytes());
            // Every signed value, the extremes included.
            data.extend((0..32).map(|k| ((i * 37 + k * 59) % 256) as u8));
        }
        let panels = Panels::new(rivulet_gguf::GgmlType::Q8_0, &data, rows, blocks, blocks * 34).expect("Q8_0 panels");
        let mut dense = Vec::new();
        rivulet_gguf::dequant::dequantize_append(rivulet_gguf::GgmlType::Q8_0, &data, &mut dense).expect("Q8_0");
        let cols = blocks * 32;
        for (_, x) in fixtures::activation_rows(cols) {
            let digits = ActivationDigits::new(&x).expect("finite");
            let mut got = [0f32; 4 * PANEL];
            panels.product_digits_q8_vnni(0, &digits, &mut got);
            panels.product_digits_q8_vnni(2, &digits, &mut got[2 * PANEL..]);
            let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (row, &value) in got[..rows].iter().enumerate() {
                let terms = (0..cols).map(|k| f64::from(dense[row * cols + k]) * f64::from(x[k]));
                let (exact, magnitude) = terms.fold((0.0, 0.0), |(e, m), t| (e + t, m + t.abs()));
                let tolerance = 2e-6 * magnitude + 1e-8 * f64::from(scale);
                assert!(
                    (f64::from(value) - exact).abs() <= tolerance,
                    "row {row}: {value} against {exact}"
                );
            }
        }
    }
}
