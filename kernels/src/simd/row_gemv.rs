//! The fused row path: a few activation rows times GGUF's row-major blocks, each block decoded
//! into registers and used at once (AVX2 + FMA + F16C). Where a matrix has no panels, steps of up
//! to [`GEMV_MAX_BATCH`] tokens on the formats it decodes ([`gemv_decodes`]) take it (Q4_1 at one
//! or two tokens takes [`super::gemv_q4_1`] instead). Part of [`super`]'s `unsafe`, under its
//! invariants.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use rivulet_gguf::GgmlType;

#[cfg(target_arch = "x86_64")]
use super::{decode::f16_scalar, hsum};
use super::{fits, has_avx2, strided_len};

/// Batches up to this size take the fused row path ([`gemv_rows_avx2`]).
pub const GEMV_MAX_BATCH: usize = 8;

/// Formats the fused row path decodes in registers.
pub fn gemv_decodes(format: GgmlType) -> bool {
    matches!(format, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 | GgmlType::F16)
}

/// `out[r * batch + b] = Σ_k w_r[k] · x[b][k]` for `rows` weight rows (row `r` at
/// `r * row_bytes` in `data`, `cols` values of `format`, whole 32-value blocks) and
/// `batch ≤ GEMV_MAX_BATCH` activation rows (row `b` at `b * x_stride`). Each block is decoded
/// into registers and used at once — nothing is stored — so a small batch costs little more than
/// reading the quantized bytes.
#[allow(clippy::too_many_arguments)]
pub fn gemv_rows_avx2(
    format: GgmlType,
    data: &[u8],
    row_bytes: usize,
    rows: usize,
    cols: usize,
    x: &[f32],
    x_stride: usize,
    batch: usize,
    out: &mut [f32],
) {
    assert!(has_avx2() && gemv_decodes(format));
    assert!(cols.is_multiple_of(32) && (1..=GEMV_MAX_BATCH).contains(&batch));
    assert!(fits(out.len(), rows.checked_mul(batch)));
    let (block_elems, block_bytes) = format.block_layout();
    let row_len = cols / block_elems as usize * block_bytes as usize;
    assert!(row_bytes >= row_len && fits(data.len(), strided_len(rows, row_bytes, row_len)));
    assert!(cols <= x_stride && fits(x.len(), strided_len(batch, x_stride, cols)));
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 present; `data` holds every row's blocks, `x` every activation row read,
    // `out` every result written (asserted above).
    unsafe {
        let (w, x, out) = (data.as_ptr(), x.as_ptr(), out.as_mut_ptr());
        // One instantiation per format, so that no format test is left in the inner loop.
        match format {
            GgmlType::Q4_0 => gemv_all_rows::<TAG_Q4_0>(w, row_bytes, rows, cols, x, x_stride, batch, out),
            GgmlType::Q4_1 => gemv_all_rows::<TAG_Q4_1>(w, row_bytes, rows, cols, x, x_stride, batch, out),
            GgmlType::Q8_0 => gemv_all_rows::<TAG_Q8_0>(w, row_bytes, rows, cols, x, x_stride, batch, out),
            _ => gemv_all_rows::<TAG_F16>(w, row_bytes, rows, cols, x, x_stride, batch, out),
        }
    }
}

/// Formats of [`decode_block32`], as const generic tags.
const TAG_Q4_0: u8 = 0;
const TAG_Q4_1: u8 = 1;
const TAG_Q8_0: u8 = 2;
const TAG_F16: u8 = 3;

/// [`gemv_rows_avx2`]'s body for the format `F`, in groups of rows that suit the batch.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemv_all_rows<const F: u8>(
    w: *const u8,
    row_bytes: usize,
    rows: usize,
    cols: usize,
    x: *const f32,
    x_stride: usize,
    batch: usize,
    out: *mut f32,
) {
    // SAFETY (whole body): as for `gemv_rows`, for every group of rows (caller).
    unsafe {
        // One or two activation rows take two weight rows together: more independent
        // accumulators to hide the FMA latency (4 cycles on Zen 3). Four rows measured no better
        // (register spills).
        let mut row = 0;
        while row < rows {
            let w = w.add(row * row_bytes);
            let out = out.add(row * batch);
            row += match (rows - row, batch) {
                (2.., 1) => gemv_rows::<F, 2, 1>(w, row_bytes, cols, x, x_stride, out),
                (2.., 2) => gemv_rows::<F, 2, 2>(w, row_bytes, cols, x, x_stride, out),
                (_, 1) => gemv_rows::<F, 1, 1>(w, row_bytes, cols, x, x_stride, out),
                (_, 2) => gemv_rows::<F, 1, 2>(w, row_bytes, cols, x, x_stride, out),
                (_, 3) => gemv_rows::<F, 1, 3>(w, row_bytes, cols, x, x_stride, out),
                (_, 4) => gemv_rows::<F, 1, 4>(w, row_bytes, cols, x, x_stride, out),
                (_, 5) => gemv_rows::<F, 1, 5>(w, row_bytes, cols, x, x_stride, out),
                (_, 6) => gemv_rows::<F, 1, 6>(w, row_bytes, cols, x, x_stride, out),
                (_, 7) => gemv_rows::<F, 1, 7>(w, row_bytes, cols, x, x_stride, out),
                _ => gemv_rows::<F, 1, 8>(w, row_bytes, cols, x, x_stride, out),
            };
        }
    }
}

/// 32 values of block `block` of a row, decoded into four vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn decode_block32<const F: u8>(row: *const u8, block: usize) -> [__m256; 4] {
    // SAFETY (whole body): block `block` lies in `row` (caller).
    unsafe {
        match F {
            TAG_Q4_0 | TAG_Q4_1 => {
                let with_min = F == TAG_Q4_1;
                let (block_bytes, quants_at) = if with_min { (20, 4) } else { (18, 2) };
                let base = row.add(block * block_bytes);
                let d = f16_scalar(base);
                let offset = if with_min { f16_scalar(base.add(2)) } else { -8.0 * d };
                let (scale, offset) = (_mm256_set1_ps(d), _mm256_set1_ps(offset));
                let low_mask = _mm_set1_epi8(0x0F);
                let q = _mm_loadu_si128(base.add(quants_at).cast());
                let low = _mm_and_si128(q, low_mask);
                let high = _mm_and_si128(_mm_srli_epi16(q, 4), low_mask);
                let widen =
                    |bytes: __m128i| _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), scale, offset);
                [
                    widen(low),
                    widen(_mm_srli_si128(low, 8)),
                    widen(high),
                    widen(_mm_srli_si128(high, 8)),
                ]
            }
            TAG_Q8_0 => {
                let base = row.add(block * 34);
                let scale = _mm256_set1_ps(f16_scalar(base));
                let widen = |i: usize| {
                    let bytes = _mm_loadl_epi64(base.add(2 + 8 * i).cast());
                    _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale)
                };
                [widen(0), widen(1), widen(2), widen(3)]
            }
            _ => {
                // F16 (gemv_decodes was checked).
                let base = row.add(block * 64);
                let widen = |i: usize| _mm256_cvtph_ps(_mm_loadu_si128(base.add(16 * i).cast()));
                [widen(0), widen(1), widen(2), widen(3)]
            }
        }
    }
}

/// `R` weight rows × `B` activation rows; returns `R`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_rows<const F: u8, const R: usize, const B: usize>(
    rows: *const u8,
    row_bytes: usize,
    cols: usize,
    x: *const f32,
    x_stride: usize,
    out: *mut f32,
) -> usize {
    // SAFETY (whole body): `rows` holds `R` rows of `cols / 32` blocks `row_bytes` apart, each
    // of the `B` activation rows `cols` values, and `out` `R · B` results (caller).
    unsafe {
        // Up to 4 (row, activation row) pairs, two accumulators each (even and odd quarters of
        // a block) halve the FMA dependency chain; above, one each, so that all stay in 16
        // registers.
        let split = R * B <= 4;
        let mut even = [[_mm256_setzero_ps(); B]; R];
        let mut odd = [[_mm256_setzero_ps(); B]; R];
        let block_bytes = match F {
            TAG_Q4_0 => 18,
            TAG_Q4_1 => 20,
            TAG_Q8_0 => 34,
            _ => 64,
        };
        for block in 0..cols / 32 {
            for r in 0..R {
                // The hardware prefetcher alone left one- and two-row batches waiting on memory
                // (Q8_0 at batch 1 ~1.5x slower without this); 1 KiB ahead measured best of
                // 512/1024/2048. A hint only (it never faults), so it may point past the data.
                _mm_prefetch::<_MM_HINT_T0>(rows.wrapping_add(r * row_bytes + block * block_bytes + 1024).cast());
                let w = decode_block32::<F>(rows.add(r * row_bytes), block);
                for b in 0..B {
                    let xs = x.add(b * x_stride + block * 32);
                    let (even, odd) = (&mut even[r][b], &mut odd[r][b]);
                    *even = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xs), *even);
                    if split {
                        *odd = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xs.add(8)), *odd);
                    } else {
                        *even = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xs.add(8)), *even);
                    }
                    *even = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xs.add(16)), *even);
                    if split {
                        *odd = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xs.add(24)), *odd);
                    } else {
                        *even = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xs.add(24)), *even);
                    }
                }
            }
        }
        for r in 0..R {
            for b in 0..B {
                *out.add(r * B + b) = hsum(_mm256_add_ps(even[r][b], odd[r][b]));
            }
        }
        R
    }
}
