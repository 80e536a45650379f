//! Whole blocks of a GGUF format decoded to f32 with AVX2 + FMA + F16C. Part of [`super`]'s
//! `unsafe`, under its invariants.
//!
//! The decoders mirror llama.cpp's `dequantize_row_q4_0`, `dequantize_row_q4_1`,
//! `dequantize_row_q8_0` (`ggml-quants.c`): the same `q·d (+ m)` in f32, computed 8 at a time.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use rivulet_gguf::GgmlType;

use super::has_avx2;

/// Formats the AVX2 decoder handles; the others go through the portable decoder.
pub fn avx2_decodes(format: GgmlType) -> bool {
    matches!(
        format,
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0
    )
}

/// Decodes `out.len()` values (whole blocks) of `format` from `data` into `out`.
/// Panics if `data` is shorter than those blocks; `format` must satisfy [`avx2_decodes`].
pub fn decode_avx2(format: GgmlType, data: &[u8], out: &mut [f32]) {
    assert!(has_avx2());
    let (block_elems, block_bytes) = format.block_layout();
    let (block_elems, block_bytes) = (block_elems as usize, block_bytes as usize);
    assert!(out.len().is_multiple_of(block_elems) && out.len().is_multiple_of(8));
    assert!(data.len() >= out.len() / block_elems * block_bytes);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2/FMA/F16C present (asserted); `data` holds every block read and `out` every
    // value written (asserted above).
    unsafe {
        decode_avx2_unchecked(format, data.as_ptr(), out.as_mut_ptr(), out.len())
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_scalar(bits: *const u8) -> f32 {
    // SAFETY: two readable bytes at `bits` (caller).
    let value = unsafe { u16::from_le_bytes([*bits, *bits.add(1)]) };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(value as i32)))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_avx2_unchecked(format: GgmlType, data: *const u8, out: *mut f32, count: usize) {
    // SAFETY (whole body): the caller checked that `data` holds `count` values of `format` and
    // `out` has room for `count` f32.
    unsafe {
        match format {
            GgmlType::F32 => std::ptr::copy_nonoverlapping(data, out.cast::<u8>(), count * 4),
            GgmlType::F16 => {
                for i in (0..count).step_by(8) {
                    let halves = _mm_loadu_si128(data.add(2 * i).cast());
                    _mm256_storeu_ps(out.add(i), _mm256_cvtph_ps(halves));
                }
            }
            GgmlType::BF16 => {
                for i in (0..count).step_by(8) {
                    let halves = _mm_loadu_si128(data.add(2 * i).cast());
                    let wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16);
                    _mm256_storeu_ps(out.add(i), _mm256_castsi256_ps(wide));
                }
            }
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let with_min = format == GgmlType::Q4_1;
                let (block_bytes, quants_at) = if with_min { (20, 4) } else { (18, 2) };
                let low_mask = _mm_set1_epi8(0x0F);
                for block in 0..count / 32 {
                    let base = data.add(block * block_bytes);
                    let d = f16_scalar(base);
                    // Q4_0 is `(q − 8)·d` = `q·d − 8d`; Q4_1 is `q·d + m`.
                    let offset = if with_min { f16_scalar(base.add(2)) } else { -8.0 * d };
                    let (scale, offset) = (_mm256_set1_ps(d), _mm256_set1_ps(offset));
                    let q = _mm_loadu_si128(base.add(quants_at).cast());
                    let low = _mm_and_si128(q, low_mask);
                    let high = _mm_and_si128(_mm_srli_epi16(q, 4), low_mask);
                    let dst = out.add(block * 32);
                    for (i, bytes) in [low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)]
                        .into_iter()
                        .enumerate()
                    {
                        let values = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
                        _mm256_storeu_ps(dst.add(8 * i), _mm256_fmadd_ps(values, scale, offset));
                    }
                }
            }
            GgmlType::Q8_0 => {
                for block in 0..count / 32 {
                    let base = data.add(block * 34);
                    let scale = _mm256_set1_ps(f16_scalar(base));
                    let dst = out.add(block * 32);
                    for i in 0..4 {
                        let bytes = _mm_loadl_epi64(base.add(2 + 8 * i).cast());
                        let values = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
                        _mm256_storeu_ps(dst.add(8 * i), _mm256_mul_ps(values, scale));
                    }
                }
            }
            _ => unreachable!("avx2_decodes was checked"),
        }
    }
}
