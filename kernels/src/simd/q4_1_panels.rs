//! Q4_1 weights rearranged at load for the packed path, so that a panel decodes straight into
//! the layout the FMA kernel reads. Part of [`super`]'s `unsafe`, under its invariants.
//!
//! Why: a step of 9+ rows decodes each 16-row panel once into L1 as `[k][16]` f32 for every
//! activation row to use. From GGUF's row-major blocks that took a decode into a row-major tile
//! and an 8×8 transpose of it — ~12 vector instructions per 8 weights, ~30% of a 32-row step's
//! projection time, while the FMA kernel itself runs near the machine's peak. Here the nibbles
//! of 16 rows at one column sit in 16 consecutive bytes, and the block's scales are f32 vectors
//! over the rows, so 8 weights cost one widening load (shared by two columns), one mask or shift,
//! one conversion, one FMA and one store.
//!
//! Layout, per panel of [`PANEL`] rows (a last partial panel is padded with zero rows), block
//! after block (32 columns each), [`PANEL_BLOCK_BYTES`] per block:
//! - `d` of the 16 rows as f32, then `m` of the 16 rows as f32 (128 bytes);
//! - for `j` in `0..16`, 16 bytes: byte `r` holds row `r`'s value `j` in its low nibble and its
//!   value `j + 16` in its high nibble (GGUF's pairing within a block).
//!
//! Each value decodes to `q·d + m` by the same FMA as the row-major decoder, so the packed path
//! multiplies exactly the values it did before.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{fits, has_avx2, PANEL};

/// Bytes of one 16-row, 32-column block of a panel: 32 f32 scales and 256 bytes of nibbles.
pub const PANEL_BLOCK_BYTES: usize = 2 * PANEL * 4 + 16 * PANEL;

/// Bytes of a Q4_1 block in GGUF: f16 `d`, f16 `m`, 16 bytes of nibbles.
const GGUF_BLOCK_BYTES: usize = 20;

/// A Q4_1 matrix's panels (see the module's layout).
#[derive(Debug, Clone)]
pub struct Q4_1Panels {
    bytes: Vec<u8>,
    blocks_per_row: usize,
}

impl Q4_1Panels {
    /// From `rows` GGUF Q4_1 rows of `blocks_per_row` blocks each, `row_bytes` apart in `data`.
    pub fn new(data: &[u8], rows: usize, blocks_per_row: usize, row_bytes: usize) -> Self {
        let panels = rows.div_ceil(PANEL);
        let mut bytes = vec![0u8; panels * blocks_per_row * PANEL_BLOCK_BYTES];
        for row in 0..rows {
            let (panel, r) = (row / PANEL, row % PANEL);
            for block in 0..blocks_per_row {
                let source = &data[row * row_bytes + block * GGUF_BLOCK_BYTES..][..GGUF_BLOCK_BYTES];
                let target = &mut bytes[(panel * blocks_per_row + block) * PANEL_BLOCK_BYTES..][..PANEL_BLOCK_BYTES];
                let half = |at: usize| half::f16::from_le_bytes([source[at], source[at + 1]]).to_f32();
                target[4 * r..4 * r + 4].copy_from_slice(&half(0).to_le_bytes());
                target[4 * (PANEL + r)..4 * (PANEL + r) + 4].copy_from_slice(&half(2).to_le_bytes());
                for (j, &byte) in source[4..].iter().enumerate() {
                    target[2 * PANEL * 4 + 16 * j + r] = byte;
                }
            }
        }
        Self { bytes, blocks_per_row }
    }

    /// Bytes the panels occupy.
    pub fn byte_len(&self) -> usize {
        self.bytes.len()
    }

    /// The bytes of blocks `blocks` of panel `panel` (for a prefetch).
    pub fn blocks(&self, panel: usize, blocks: std::ops::Range<usize>) -> &[u8] {
        let start = panel * self.blocks_per_row;
        &self.bytes[(start + blocks.start) * PANEL_BLOCK_BYTES..(start + blocks.end) * PANEL_BLOCK_BYTES]
    }

    /// Writes blocks `blocks` of panel `panel`, decoded, as `packed[k * PANEL + r]` (`k` counted
    /// from the first of those blocks' columns): the layout [`super::gemm_panel_avx2`] reads.
    pub fn decode_avx2(&self, panel: usize, blocks: std::ops::Range<usize>, packed: &mut [f32]) {
        assert!(has_avx2());
        assert!(blocks.start <= blocks.end && blocks.end <= self.blocks_per_row);
        let count = blocks.end - blocks.start;
        assert!(fits(packed.len(), count.checked_mul(32 * PANEL)));
        let source = self.blocks(panel, blocks);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 present; `source` holds `count` panel blocks and `packed` their
        // `count · 32 · PANEL` values (asserted above).
        unsafe {
            decode_blocks(source.as_ptr(), count, packed.as_mut_ptr())
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn decode_blocks(source: *const u8, count: usize, packed: *mut f32) {
    // SAFETY (whole body): `source` holds `count` blocks of PANEL_BLOCK_BYTES and `packed`
    // `count · 32 · PANEL` values (caller).
    unsafe {
        let low_nibble = _mm256_set1_epi32(0x0F);
        for block in 0..count {
            let base = source.add(block * PANEL_BLOCK_BYTES);
            let scales = base.cast::<f32>();
            // Rows 0..8 and 8..16: their `d` and `m`.
            let d = [_mm256_loadu_ps(scales), _mm256_loadu_ps(scales.add(8))];
            let m = [_mm256_loadu_ps(scales.add(16)), _mm256_loadu_ps(scales.add(24))];
            let nibbles = base.add(2 * PANEL * 4);
            let out = packed.add(block * 32 * PANEL);
            for j in 0..16 {
                for half in 0..2 {
                    // Row `8·half + i`'s byte in lane `i`: values j (low nibble) and j + 16 (high).
                    let bytes = _mm_loadl_epi64(nibbles.add(16 * j + 8 * half).cast());
                    let lanes = _mm256_cvtepu8_epi32(bytes);
                    let low = _mm256_cvtepi32_ps(_mm256_and_si256(lanes, low_nibble));
                    let high = _mm256_cvtepi32_ps(_mm256_srli_epi32(lanes, 4));
                    _mm256_storeu_ps(out.add(j * PANEL + 8 * half), _mm256_fmadd_ps(low, d[half], m[half]));
                    _mm256_storeu_ps(
                        out.add((j + 16) * PANEL + 8 * half),
                        _mm256_fmadd_ps(high, d[half], m[half]),
                    );
                }
            }
        }
    }
}
