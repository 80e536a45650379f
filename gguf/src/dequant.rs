//! ggml tensor types and their dequantization to `f32`. Each function mirrors the llama.cpp
//! function named in its comment (`ggml-quants.c`), so a reader can check it line by line.

use half::{bf16, f16};

/// Types [`dequantize`] accepts, for error messages.
pub const SUPPORTED_TYPES: &str = "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K";

/// ggml's type ids (`enum ggml_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    I8,
    I16,
    I32,
    I64,
    F64,
    BF16,
}

impl GgmlType {
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            9 => Self::Q8_1,
            10 => Self::Q2K,
            11 => Self::Q3K,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            15 => Self::Q8K,
            24 => Self::I8,
            25 => Self::I16,
            26 => Self::I32,
            27 => Self::I64,
            28 => Self::F64,
            30 => Self::BF16,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block), from ggml's `type_traits`.
    pub fn block_layout(self) -> (u64, u64) {
        match self {
            Self::F32 | Self::I32 => (1, 4),
            Self::F16 | Self::BF16 | Self::I16 => (1, 2),
            Self::I8 => (1, 1),
            Self::I64 | Self::F64 => (1, 8),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Q8_1 => (32, 36),
            Self::Q2K => (256, 84),
            Self::Q3K => (256, 110),
            Self::Q4K => (256, 144),
            Self::Q5K => (256, 176),
            Self::Q6K => (256, 210),
            Self::Q8K => (256, 292),
        }
    }

    /// Bytes taken by `elements` values, or `None` if they are not whole blocks or the byte
    /// count overflows.
    pub fn byte_len(self, elements: u64) -> Option<u64> {
        let (block_elems, block_bytes) = self.block_layout();
        elements
            .is_multiple_of(block_elems)
            .then(|| (elements / block_elems).checked_mul(block_bytes))
            .flatten()
    }
}

/// Dequantizes `elements` values of type `ggml_type` from `data` (exactly their byte length).
/// Returns the type back as the error when it is not supported.
pub fn dequantize(ggml_type: GgmlType, data: &[u8], elements: usize) -> Result<Vec<f32>, GgmlType> {
    debug_assert_eq!(ggml_type.byte_len(elements as u64), Some(data.len() as u64));
    let mut out = Vec::with_capacity(elements);
    dequantize_append(ggml_type, data, &mut out)?;
    Ok(out)
}

/// Dequantizes the whole blocks in `data` onto the end of `out` (which a caller reuses across
/// calls, so a hot loop does not allocate). Returns the type back when it is not supported.
pub fn dequantize_append(ggml_type: GgmlType, data: &[u8], out: &mut Vec<f32>) -> Result<(), GgmlType> {
    match ggml_type {
        GgmlType::F32 => out.extend(
            data.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
        GgmlType::F16 => out.extend(data.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())),
        GgmlType::BF16 => out.extend(data.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())),
        GgmlType::Q4_0 => data
            .chunks_exact(18)
            .for_each(|block| dequantize_block_q4_0(block, out)),
        GgmlType::Q4_1 => data
            .chunks_exact(20)
            .for_each(|block| dequantize_block_q4_1(block, out)),
        GgmlType::Q5_0 => data
            .chunks_exact(22)
            .for_each(|block| dequantize_block_q5_0(block, out)),
        GgmlType::Q5_1 => data
            .chunks_exact(24)
            .for_each(|block| dequantize_block_q5_1(block, out)),
        GgmlType::Q8_0 => data
            .chunks_exact(34)
            .for_each(|block| dequantize_block_q8_0(block, out)),
        GgmlType::Q4K => data
            .chunks_exact(144)
            .for_each(|block| dequantize_block_q4_k(block, out)),
        GgmlType::Q5K => data
            .chunks_exact(176)
            .for_each(|block| dequantize_block_q5_k(block, out)),
        GgmlType::Q6K => data
            .chunks_exact(210)
            .for_each(|block| dequantize_block_q6_k(block, out)),
        other => return Err(other),
    }
    Ok(())
}

fn f16_at(block: &[u8], offset: usize) -> f32 {
    f16::from_le_bytes([block[offset], block[offset + 1]]).to_f32()
}

/// `dequantize_row_q4_0`: `{ f16 d; u8 qs[16] }`; low nibbles are elements 0..16, high 16..32,
/// each `(q - 8) * d`.
fn dequantize_block_q4_0(block: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(block, 0);
    let qs = &block[2..18];
    out.extend(qs.iter().map(|q| ((q & 0x0F) as i32 - 8) as f32 * d));
    out.extend(qs.iter().map(|q| ((q >> 4) as i32 - 8) as f32 * d));
}

/// `dequantize_row_q4_1`: `{ f16 d; f16 m; u8 qs[16] }`; low nibbles are elements 0..16, high
/// 16..32, each `q * d + m`.
fn dequantize_block_q4_1(block: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(block, 0);
    let m = f16_at(block, 2);
    let qs = &block[4..20];
    out.extend(qs.iter().map(|q| (q & 0x0F) as f32 * d + m));
    out.extend(qs.iter().map(|q| (q >> 4) as f32 * d + m));
}

/// The 5th bits of a Q5_0 / Q5_1 block: `u32 qh`, bit j belongs to element j.
fn q5_high_bits(block: &[u8], offset: usize) -> u32 {
    u32::from_le_bytes([block[offset], block[offset + 1], block[offset + 2], block[offset + 3]])
}

/// `dequantize_row_q5_0`: `{ f16 d; u32 qh; u8 qs[16] }`; element j (< 16) is the low nibble of
/// `qs[j]` plus bit j of `qh` as bit 4, element j + 16 the high nibble plus bit j + 16; `(q - 16) * d`.
fn dequantize_block_q5_0(block: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(block, 0);
    let qh = q5_high_bits(block, 2);
    let qs = &block[6..22];
    out.extend((0..16).map(|j| (((qs[j] & 0x0F) as u32 | (((qh >> j) & 1) << 4)) as i32 - 16) as f32 * d));
    out.extend((0..16).map(|j| (((qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4)) as i32 - 16) as f32 * d));
}

/// `dequantize_row_q5_1`: `{ f16 d; f16 m; u32 qh; u8 qs[16] }`, as Q5_0 but `q * d + m`.
fn dequantize_block_q5_1(block: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(block, 0);
    let m = f16_at(block, 2);
    let qh = q5_high_bits(block, 4);
    let qs = &block[8..24];
    out.extend((0..16).map(|j| ((qs[j] & 0x0F) as u32 | (((qh >> j) & 1) << 4)) as f32 * d + m));
    out.extend((0..16).map(|j| ((qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4)) as f32 * d + m));
}

/// `get_scale_min_k4`: the j-th 6-bit (scale, min) pair packed in a K-quant's 12 scale bytes.
fn scale_min_k4(j: usize, scales: &[u8]) -> (f32, f32) {
    if j < 4 {
        ((scales[j] & 63) as f32, (scales[j + 4] & 63) as f32)
    } else {
        let scale = (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4);
        let min = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
        (scale as f32, min as f32)
    }
}

/// `dequantize_row_q4_K`: `{ f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }`, 256 values in 8
/// sub-blocks of 32; each 64 values share 32 bytes, low nibbles first; `d·sc·q − dmin·m`.
fn dequantize_block_q4_k(block: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(block, 0);
    let dmin = f16_at(block, 2);
    let scales = &block[4..16];
    for (pair, qs) in block[16..144].chunks_exact(32).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * pair, scales);
        let (sc2, m2) = scale_min_k4(2 * pair + 1, scales);
        out.extend(qs.iter().map(|q| d * sc1 * (q & 0x0F) as f32 - dmin * m1));
        out.extend(qs.iter().map(|q| d * sc2 * (q >> 4) as f32 - dmin * m2));
    }
}

/// `dequantize_row_q5_K`: `{ f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] }`: Q4_K plus
/// a 5th bit per value from `qh` (bit 2·pair for the low nibbles, 2·pair + 1 for the high ones).
fn dequantize_block_q5_k(block: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(block, 0);
    let dmin = f16_at(block, 2);
    let scales = &block[4..16];
    let qh = &block[16..48];
    for (pair, qs) in block[48..176].chunks_exact(32).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * pair, scales);
        let (sc2, m2) = scale_min_k4(2 * pair + 1, scales);
        let (low_bit, high_bit) = (1u8 << (2 * pair), 1u8 << (2 * pair + 1));
        out.extend(qs.iter().zip(qh).map(|(q, h)| {
            let value = (q & 0x0F) + if h & low_bit != 0 { 16 } else { 0 };
            d * sc1 * value as f32 - dmin * m1
        }));
        out.extend(qs.iter().zip(qh).map(|(q, h)| {
            let value = (q >> 4) + if h & high_bit != 0 { 16 } else { 0 };
            d * sc2 * value as f32 - dmin * m2
        }));
    }
}

/// `dequantize_row_q6_K`: `{ u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }`, two halves of 128
/// values; value = 4 low bits from `ql` and 2 high bits from `qh`, minus 32, times `d·scale`.
fn dequantize_block_q6_k(block: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(block, 208);
    let mut half = [0f32; 128];
    for n in 0..2 {
        let ql = &block[n * 64..n * 64 + 64];
        let qh = &block[128 + n * 32..128 + n * 32 + 32];
        let scales = &block[192 + n * 8..192 + n * 8 + 8];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let scale = |i: usize| d * scales[i] as i8 as f32;
            half[l] = scale(is) * q1 as f32;
            half[l + 32] = scale(is + 2) * q2 as f32;
            half[l + 64] = scale(is + 4) * q3 as f32;
            half[l + 96] = scale(is + 6) * q4 as f32;
        }
        out.extend_from_slice(&half);
    }
}

/// `dequantize_row_q8_0`: `{ f16 d; i8 qs[32] }`, each `q * d`.
fn dequantize_block_q8_0(block: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(block, 0);
    out.extend(block[2..34].iter().map(|&q| q as i8 as f32 * d));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_block_matches_hand_computation() {
        let mut block = Vec::new();
        block.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
        block.extend_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        block.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
        let out = dequantize(GgmlType::Q4_1, &block, 32).expect("supported");
        assert_eq!(out[0], -1.0);
        assert_eq!(out[3], 3.0 * 0.5 - 1.0);
        assert_eq!(out[16], 15.0 * 0.5 - 1.0);
        assert_eq!(out[31], -1.0);
    }

    #[test]
    fn q8_0_and_q4_0_blocks_are_signed() {
        let mut q8 = f16::from_f32(2.0).to_le_bytes().to_vec();
        q8.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let out = dequantize(GgmlType::Q8_0, &q8, 32).expect("supported");
        assert_eq!(out[0], -32.0);
        assert_eq!(out[31], 30.0);

        let mut q4 = f16::from_f32(1.0).to_le_bytes().to_vec();
        q4.extend([0x0Fu8; 16]);
        let out = dequantize(GgmlType::Q4_0, &q4, 32).expect("supported");
        assert_eq!(out[0], 7.0);
        assert_eq!(out[16], -8.0);
    }

    #[test]
    fn unsupported_types_are_reported() {
        assert_eq!(dequantize(GgmlType::Q2K, &[0u8; 84], 256), Err(GgmlType::Q2K));
    }
}
