//! The packed path: a panel of decoded weights transposed so that each column's 16 weights are
//! one run, then multiplied by every activation row in register blocks of 6 rows × 16 weights
//! (AVX2 + FMA). Steps too large for the row and panel GEMVs take it, and every step on a format
//! those do not decode (the K-quants, Q5_0/Q5_1, BF16, F32). Part of [`super`]'s `unsafe`, under
//! its invariants.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{fits, has_avx2, strided_len, PANEL};

/// Transposes a panel of decoded weights, `PANEL` rows of `len` values (row `r` at
/// `r * stride`), into `packed[k * PANEL + r]`, so that the kernel reads one contiguous run of
/// 16 weights per column `k`.
pub fn pack_panel_avx2(rows: &[f32], stride: usize, len: usize, packed: &mut [f32]) {
    assert!(has_avx2());
    assert!(len <= stride && fits(rows.len(), strided_len(PANEL, stride, len)));
    assert!(fits(packed.len(), len.checked_mul(PANEL)));
    let vector_len = len / 8 * 8;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 present; every 8×8 block read lies in `rows` (k + 8 <= len <= stride) and
    // every write in `packed` (asserted above).
    unsafe {
        for k in (0..vector_len).step_by(8) {
            for half in 0..2 {
                let src = rows.as_ptr().add(half * 8 * stride + k);
                let dst = packed.as_mut_ptr().add(k * PANEL + half * 8);
                transpose_8x8(src, stride, dst, PANEL);
            }
        }
    }
    for k in vector_len..len {
        for r in 0..PANEL {
            packed[k * PANEL + r] = rows[r * stride + k];
        }
    }
}

/// `dst[i * dst_stride + j] = src[j * src_stride + i]` for an 8×8 block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose_8x8(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
    // SAFETY (whole body): 8 rows of 8 values at `src` and at `dst` (caller).
    unsafe {
        let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * src_stride)));
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        let columns = [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ];
        for (i, column) in columns.into_iter().enumerate() {
            _mm256_storeu_ps(dst.add(i * dst_stride), column);
        }
    }
}

/// `c[b][j] += Σ_k x[b][k] · packed[k][j]` for `j < PANEL`, `k < len` and every activation row
/// `b < batch` (row `b` of `x` at `b * x_stride`); `c` is `[batch][PANEL]`.
///
/// The register block is 6 activation rows × 16 weight rows: 12 accumulators, and per column
/// two weight loads and six broadcasts for twelve FMAs, with no horizontal sums.
pub fn gemm_panel_avx2(packed: &[f32], len: usize, x: &[f32], x_stride: usize, batch: usize, c: &mut [f32]) {
    assert!(has_avx2());
    assert!(fits(packed.len(), len.checked_mul(PANEL)) && fits(c.len(), batch.checked_mul(PANEL)));
    assert!(batch == 0 || (len <= x_stride && fits(x.len(), strided_len(batch, x_stride, len))));
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 present; every read lies in `packed` / `x` and every write in `c` (asserted).
    unsafe {
        let (w, xp, cp) = (packed.as_ptr(), x.as_ptr(), c.as_mut_ptr());
        // Blocks of at most 6 rows, sized evenly (32 = 6+6+5+5+5+5, not 6·5+2): a block of one
        // or two rows has too few accumulators to hide the FMA latency and runs at half speed.
        let blocks = batch.div_ceil(6);
        let mut b = 0;
        for block in 0..blocks {
            let rows = (batch - b).div_ceil(blocks - block);
            let (xs, cs) = (xp.add(b * x_stride), cp.add(b * PANEL));
            match rows {
                1 => gemm_block::<1>(w, len, xs, x_stride, cs),
                2 => gemm_block::<2>(w, len, xs, x_stride, cs),
                3 => gemm_block::<3>(w, len, xs, x_stride, cs),
                4 => gemm_block::<4>(w, len, xs, x_stride, cs),
                5 => gemm_block::<5>(w, len, xs, x_stride, cs),
                _ => gemm_block::<6>(w, len, xs, x_stride, cs),
            }
            b += rows;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gemm_block<const M: usize>(w: *const f32, len: usize, x: *const f32, x_stride: usize, c: *mut f32) {
    // SAFETY (whole body): `w` holds `len · PANEL` values, each of the `M` rows of `x` `len`,
    // and `c` `M · PANEL` (caller).
    unsafe {
        let mut low: [__m256; M] = std::array::from_fn(|i| _mm256_loadu_ps(c.add(i * PANEL)));
        let mut high: [__m256; M] = std::array::from_fn(|i| _mm256_loadu_ps(c.add(i * PANEL + 8)));
        for k in 0..len {
            let w0 = _mm256_loadu_ps(w.add(k * PANEL));
            let w1 = _mm256_loadu_ps(w.add(k * PANEL + 8));
            for i in 0..M {
                let xv = _mm256_broadcast_ss(&*x.add(i * x_stride + k));
                low[i] = _mm256_fmadd_ps(w0, xv, low[i]);
                high[i] = _mm256_fmadd_ps(w1, xv, high[i]);
            }
        }
        for i in 0..M {
            _mm256_storeu_ps(c.add(i * PANEL), low[i]);
            _mm256_storeu_ps(c.add(i * PANEL + 8), high[i]);
        }
    }
}
