//! Q4_0, Q4_1 and Q8_0 weights rearranged at load by panels of 16 rows, so that one load holds
//! whole columns of 16 rows (one Q8_0 column in 16 bytes, four 4-bit columns in 32). Part of
//! [`super`]'s `unsafe`, under its invariants.
//!
//! Why: a step of 9+ rows on AVX2 decodes each 16-row panel once into L1 as `[k][16]` f32 for
//! every activation row to use. From GGUF's row-major blocks that took a decode into a row-major
//! tile and an 8×8 transpose of it — ~12 vector instructions per 8 weights, ~30% of a 32-row
//! step's projection time, while the FMA kernel itself runs near the machine's peak. Here one
//! column's values of 16 rows sit in consecutive bytes and each block's scales are vectors over
//! the rows, so 8 weights cost one widening load, a mask or shift (4-bit formats), one
//! conversion, one multiply or FMA and one store. On AVX-512, steps of 12+ rows decode pairs of
//! panels into L1 the same way ([`super::packed_gemm_avx512`]). Steps of fewer rows multiply
//! straight from the panels, decoded in registers ([`super::panel_gemv`] on AVX-512,
//! [`super::panel_gemv_avx2`] up to 8 rows).
//!
//! Layout, per panel of [`PANEL`] rows (a last partial panel is padded with zero rows), block
//! after block (32 columns each):
//! - 4-bit (Q4_0, Q4_1): `d` of the 16 rows as f16, then the offset of the 16 rows as f16 (`m`,
//!   or `-8·d` for Q4_0, exact in f16: 8·d only moves the exponent); then for each pair of
//!   columns `(2p, 2p + 1)`, `p` in `0..8`, 32 bytes: byte `2r + c` holds row `r`'s value
//!   `j = 2p + c` in its low nibble and its value `j + 16` in its high nibble (GGUF's pairing
//!   within a block) ([`q4_byte`]). [`Q4_BLOCK`] bytes. The two columns of a pair alternate
//!   byte by byte so that, once the nibbles are masked apart, each 16-bit word holds one row's
//!   values `(2p, 2p + 1)` (or `(2p + 16, 2p + 17)`): the pairs `vpmaddubsw` multiplies and adds,
//!   against a broadcast pair of activation digits ([`super::panel_digits_avx2`]). The f32
//!   kernels widen 16 bits per row and take four columns from each 32-bit lane; the AMX path's
//!   tiles want the same interleaving.
//! - Q8_0: `d` of the 16 rows as f16, then for `k` in `0..32`, 16 bytes: row `r`'s signed value
//!   `k` in byte `r`. [`Q8_BLOCK`] bytes.
//!
//! The scales stay f16 as in the file (the panels take exactly the blocks' bytes, which a
//! one-token step streams) and convert exactly to f32 in the kernels. Each value decodes to
//! `q·d + offset` (4-bit) or `q·d` (Q8_0), the same arithmetic as the row-major decoder.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use rivulet_gguf::GgmlType;

use super::{fits, has_avx2, PANEL};

/// Where row `r`'s byte of column `j < 16` (values `j` and `j + 16`) sits among a 4-bit panel
/// block's nibble bytes (see the module's layout).
const fn q4_byte(j: usize, r: usize) -> usize {
    2 * PANEL * (j / 2) + 2 * r + j % 2
}

/// Bytes of one block's scale (or offset) for the 16 rows: 16 f16.
pub(super) const SCALES: usize = PANEL * 2;

/// Bytes of one 16-row, 32-column block of a 4-bit panel: `d` and the offset of 16 rows and 256
/// bytes of nibbles — as many bytes as GGUF's 16 Q4_1 blocks.
pub(super) const Q4_BLOCK: usize = 2 * SCALES + 16 * PANEL;

/// Bytes of one 16-row, 32-column block of a Q8_0 panel: `d` of 16 rows and 512 bytes — as many
/// bytes as GGUF's 16 blocks.
pub(super) const Q8_BLOCK: usize = SCALES + 32 * PANEL;

/// The kinds of panel (see the module's layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Q4,
    Q8,
}

/// A matrix's panels (see the module's layout).
#[derive(Debug, Clone)]
pub struct Panels {
    kind: Kind,
    bytes: Vec<u8>,
    blocks_per_row: usize,
}

fn f16_at(bytes: &[u8], at: usize) -> half::f16 {
    half::f16::from_le_bytes([bytes[at], bytes[at + 1]])
}

impl Panels {
    /// From `rows` GGUF rows of `format` (`blocks_per_row` blocks each, `row_bytes` apart in
    /// `data`); `None` for a format without panels, or for a Q4_0 matrix whose offset `-8·d`
    /// does not fit an f16 (a scale above 8188, which no real file has).
    pub fn new(format: GgmlType, data: &[u8], rows: usize, blocks_per_row: usize, row_bytes: usize) -> Option<Self> {
        let (kind, gguf_block, panel_block) = match format {
            GgmlType::Q4_0 => (Kind::Q4, 18, Q4_BLOCK),
            GgmlType::Q4_1 => (Kind::Q4, 20, Q4_BLOCK),
            GgmlType::Q8_0 => (Kind::Q8, 34, Q8_BLOCK),
            _ => return None,
        };
        let panels = rows.div_ceil(PANEL);
        let mut bytes = vec![0u8; panels * blocks_per_row * panel_block];
        for row in 0..rows {
            let (panel, r) = (row / PANEL, row % PANEL);
            for block in 0..blocks_per_row {
                let source = &data[row * row_bytes + block * gguf_block..][..gguf_block];
                let target = &mut bytes[(panel * blocks_per_row + block) * panel_block..][..panel_block];
                let d = f16_at(source, 0);
                target[2 * r..2 * r + 2].copy_from_slice(&d.to_le_bytes());
                // After `d` (and Q4_1's `m`): 16 bytes of nibbles, or Q8_0's 32 bytes.
                let values = if format == GgmlType::Q4_1 {
                    &source[4..]
                } else {
                    &source[2..]
                };
                let offset = match format {
                    GgmlType::Q4_1 => Some(f16_at(source, 2)),
                    // Exact whenever it is finite: 8·d only moves the exponent.
                    GgmlType::Q4_0 => Some(half::f16::from_f32(-8.0 * d.to_f32())).filter(|o| o.is_finite()),
                    _ => None,
                };
                if let Some(offset) = offset {
                    target[SCALES + 2 * r..SCALES + 2 * r + 2].copy_from_slice(&offset.to_le_bytes());
                } else if kind == Kind::Q4 {
                    return None;
                }
                for (j, &byte) in values.iter().enumerate() {
                    match kind {
                        Kind::Q4 => target[2 * SCALES + q4_byte(j, r)] = byte,
                        Kind::Q8 => target[SCALES + PANEL * j + r] = byte,
                    }
                }
            }
        }
        Some(Self {
            kind,
            bytes,
            blocks_per_row,
        })
    }

    pub(super) fn block_bytes(&self) -> usize {
        match self.kind {
            Kind::Q4 => Q4_BLOCK,
            Kind::Q8 => Q8_BLOCK,
        }
    }

    pub(super) fn kind(&self) -> Kind {
        self.kind
    }

    pub(super) fn blocks_per_row(&self) -> usize {
        self.blocks_per_row
    }

    /// Panels (of [`PANEL`] rows, the last padded).
    pub(super) fn panel_count(&self) -> usize {
        self.bytes.len() / (self.blocks_per_row * self.block_bytes()).max(1)
    }

    /// Row `row`'s blocks back in GGUF's layout (`format` is the one the panels were made from):
    /// the same bytes, so a decoder gives the same values as from the file.
    pub fn row_blocks(&self, format: GgmlType, row: usize) -> Vec<u8> {
        let (panel, r) = (row / PANEL, row % PANEL);
        let mut bytes = Vec::with_capacity(self.blocks_per_row * 34);
        for block in 0..self.blocks_per_row {
            let source = self.blocks(panel, block..block + 1);
            bytes.extend_from_slice(&source[2 * r..2 * r + 2]);
            if format == GgmlType::Q4_1 {
                bytes.extend_from_slice(&source[SCALES + 2 * r..SCALES + 2 * r + 2]);
            }
            match self.kind {
                Kind::Q4 => bytes.extend((0..16).map(|j| source[2 * SCALES + q4_byte(j, r)])),
                Kind::Q8 => bytes.extend((0..32).map(|j| source[SCALES + PANEL * j + r])),
            }
        }
        bytes
    }

    /// Bytes the panels occupy.
    pub fn byte_len(&self) -> usize {
        self.bytes.len()
    }

    /// The bytes of blocks `blocks` of panel `panel` (for a prefetch).
    pub fn blocks(&self, panel: usize, blocks: std::ops::Range<usize>) -> &[u8] {
        let start = panel * self.blocks_per_row;
        &self.bytes[(start + blocks.start) * self.block_bytes()..(start + blocks.end) * self.block_bytes()]
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
        // SAFETY: AVX2 present; `source` holds `count` panel blocks of this kind and `packed`
        // their `count · 32 · PANEL` values (asserted above).
        unsafe {
            match self.kind {
                Kind::Q4 => decode_q4(source.as_ptr(), count, packed.as_mut_ptr()),
                Kind::Q8 => decode_q8(source.as_ptr(), count, packed.as_mut_ptr()),
            }
        }
    }
}

/// The columns of pair `p`'s four nibbles in a row's 16 bits, lowest first (see the module's
/// layout).
pub(super) const fn nibble_columns(p: usize) -> [usize; 4] {
    [2 * p, 2 * p + 16, 2 * p + 1, 2 * p + 17]
}

/// The four nibbles of each 32-bit lane's low 16 bits (the lane's upper bits zero), lowest first
/// ([`nibble_columns`] names their columns).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) fn four_columns(lanes: __m256i) -> [__m256i; 4] {
    let low_nibble = _mm256_set1_epi32(0x0F);
    [
        _mm256_and_si256(lanes, low_nibble),
        _mm256_and_si256(_mm256_srli_epi32::<4>(lanes), low_nibble),
        _mm256_and_si256(_mm256_srli_epi32::<8>(lanes), low_nibble),
        _mm256_srli_epi32::<12>(lanes),
    ]
}

/// [`four_columns`] on 16 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) fn four_columns_512(lanes: __m512i) -> [__m512i; 4] {
    let low_nibble = _mm512_set1_epi32(0x0F);
    [
        _mm512_and_si512(lanes, low_nibble),
        _mm512_and_si512(_mm512_srli_epi32::<4>(lanes), low_nibble),
        _mm512_and_si512(_mm512_srli_epi32::<8>(lanes), low_nibble),
        _mm512_srli_epi32::<12>(lanes),
    ]
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_q4(source: *const u8, count: usize, packed: *mut f32) {
    // SAFETY (whole body): `source` holds `count` blocks of Q4_BLOCK and `packed`
    // `count · 32 · PANEL` values (caller).
    unsafe {
        for block in 0..count {
            let base = source.add(block * Q4_BLOCK);
            // Rows 0..8 and 8..16: their `d` and offset.
            let half = |at: usize| _mm256_cvtph_ps(_mm_loadu_si128(base.add(at).cast()));
            let d = [half(0), half(16)];
            let offset = [half(SCALES), half(SCALES + 16)];
            let nibbles = base.add(2 * SCALES);
            let out = packed.add(block * 32 * PANEL);
            for p in 0..8 {
                for (half, (d, offset)) in d.into_iter().zip(offset).enumerate() {
                    // Row `8·half + i`'s two bytes in lane `i`: columns 2p, 2p + 16, 2p + 1 and
                    // 2p + 17 in its four nibbles.
                    let lanes = _mm256_cvtepu16_epi32(_mm_loadu_si128(nibbles.add(2 * PANEL * p + 16 * half).cast()));
                    for (nibble, column) in four_columns(lanes).into_iter().zip(nibble_columns(p)) {
                        let value = _mm256_fmadd_ps(_mm256_cvtepi32_ps(nibble), d, offset);
                        _mm256_storeu_ps(out.add(column * PANEL + 8 * half), value);
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_q8(source: *const u8, count: usize, packed: *mut f32) {
    // SAFETY (whole body): `source` holds `count` blocks of Q8_BLOCK and `packed`
    // `count · 32 · PANEL` values (caller).
    unsafe {
        for block in 0..count {
            let base = source.add(block * Q8_BLOCK);
            let half = |at: usize| _mm256_cvtph_ps(_mm_loadu_si128(base.add(at).cast()));
            let d = [half(0), half(16)];
            let values = base.add(SCALES);
            let out = packed.add(block * 32 * PANEL);
            for k in 0..32 {
                for (half, d) in d.into_iter().enumerate() {
                    let bytes = _mm_loadl_epi64(values.add(PANEL * k + 8 * half).cast());
                    let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
                    _mm256_storeu_ps(out.add(k * PANEL + 8 * half), _mm256_mul_ps(q, d));
                }
            }
        }
    }
}
