//! The crate's only `unsafe`: AVX2 + FMA + F16C code paths, and the output handle that lets
//! parallel tasks write disjoint columns of one matrix.
//!
//! Invariants, checked where each function is entered from safe code:
//! - Every `#[target_feature]` function is called only after [`has_avx2`] returned true (the
//!   safe wrappers check it), so the instructions exist on this CPU.
//! - Every pointer read or written lies inside a slice whose length was checked against the
//!   loop bounds before the loop (the `assert!`s at the top of each safe wrapper); loads and
//!   stores are unaligned (`loadu`/`storeu`), so no alignment is assumed.
//! - [`SharedOutput`]: each task writes only the columns (output rows of the weight matrix) it was
//!   given, so no element is written by two threads, and the borrow it was made from outlives the
//!   parallel region (it is created and dropped inside [`crate::matrix::WeightMatrix::matmul`]).
//!
//! The decoders mirror llama.cpp's `dequantize_row_q4_0`, `dequantize_row_q4_1`,
//! `dequantize_row_q8_0` (`ggml-quants.c`): the same `q·d (+ m)` in f32, computed 8 at a time.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use std::marker::PhantomData;

use rivulet_gguf::GgmlType;

/// Whether this CPU runs the AVX2 paths (detected once; `RIVULET_KERNELS_PORTABLE=1` forces the
/// portable code, to test and measure it).
pub fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        if std::env::var_os("RIVULET_KERNELS_PORTABLE").is_some() {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

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
    assert!(out.len() % block_elems == 0 && out.len() % 8 == 0);
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
unsafe fn f16_scalar(bits: *const u8) -> f32 {
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

/// Batches up to this size take the fused row path ([`gemv_row_avx2`]).
pub const GEMV_MAX_BATCH: usize = 8;

/// Formats the fused row path decodes in registers.
pub fn gemv_decodes(format: GgmlType) -> bool {
    matches!(format, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 | GgmlType::F16)
}

/// `out[b] = Σ_k w[k] · x[b][k]` for one weight row `row` (`cols` values of `format`, whole
/// 32-value blocks) and `batch ≤ GEMV_MAX_BATCH` activation rows (row `b` at `b * x_stride`).
/// Each block is decoded into registers and used at once — nothing is stored — so a small batch
/// costs little more than reading the quantized bytes.
pub fn gemv_row_avx2(
    format: GgmlType,
    row: &[u8],
    cols: usize,
    x: &[f32],
    x_stride: usize,
    batch: usize,
    out: &mut [f32],
) {
    assert!(has_avx2() && gemv_decodes(format));
    assert!(cols % 32 == 0 && (1..=GEMV_MAX_BATCH).contains(&batch) && out.len() >= batch);
    let (block_elems, block_bytes) = format.block_layout();
    assert!(row.len() >= cols / block_elems as usize * block_bytes as usize);
    assert!(cols <= x_stride && x.len() >= (batch - 1) * x_stride + cols);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 present; `row` holds the row's blocks, `x` every activation row read, `out`
    // every result written (asserted above).
    unsafe {
        let sums = match batch {
            1 => gemv_row::<1>(format, row.as_ptr(), cols, x.as_ptr(), x_stride),
            2 => gemv_row::<2>(format, row.as_ptr(), cols, x.as_ptr(), x_stride),
            3 => gemv_row::<3>(format, row.as_ptr(), cols, x.as_ptr(), x_stride),
            4 => gemv_row::<4>(format, row.as_ptr(), cols, x.as_ptr(), x_stride),
            5 => gemv_row::<5>(format, row.as_ptr(), cols, x.as_ptr(), x_stride),
            6 => gemv_row::<6>(format, row.as_ptr(), cols, x.as_ptr(), x_stride),
            7 => gemv_row::<7>(format, row.as_ptr(), cols, x.as_ptr(), x_stride),
            _ => gemv_row::<8>(format, row.as_ptr(), cols, x.as_ptr(), x_stride),
        };
        out[..batch].copy_from_slice(&sums[..batch]);
    }
}

/// 32 values of block `block` of a row, decoded into four vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn decode_block32(format: GgmlType, row: *const u8, block: usize) -> [__m256; 4] {
    // SAFETY (whole body): block `block` lies in `row` (caller).
    unsafe {
        match format {
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let with_min = format == GgmlType::Q4_1;
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
            GgmlType::Q8_0 => {
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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_row<const B: usize>(
    format: GgmlType,
    row: *const u8,
    cols: usize,
    x: *const f32,
    x_stride: usize,
) -> [f32; GEMV_MAX_BATCH] {
    // SAFETY (whole body): `row` holds `cols / 32` blocks and each of the `B` activation rows
    // `cols` values (caller).
    unsafe {
        // Up to 4 rows, two accumulators per activation row (even and odd quarters of a block)
        // halve the FMA dependency chain; above, one each, so that all stay in 16 registers.
        let split = B <= 4;
        let mut even = [_mm256_setzero_ps(); B];
        let mut odd = [_mm256_setzero_ps(); B];
        for block in 0..cols / 32 {
            let w = decode_block32(format, row, block);
            for b in 0..B {
                let xs = x.add(b * x_stride + block * 32);
                even[b] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xs), even[b]);
                if split {
                    odd[b] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xs.add(8)), odd[b]);
                } else {
                    even[b] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xs.add(8)), even[b]);
                }
                even[b] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xs.add(16)), even[b]);
                if split {
                    odd[b] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xs.add(24)), odd[b]);
                } else {
                    even[b] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xs.add(24)), even[b]);
                }
            }
        }
        let mut sums = [0f32; GEMV_MAX_BATCH];
        for b in 0..B {
            sums[b] = hsum(_mm256_add_ps(even[b], odd[b]));
        }
        sums
    }
}

/// `out[r][b] += Σ_k w[r][k] · x[b][k]` for the 4 weight rows in `w` (row `r` at `r * w_stride`)
/// and every activation row of `x` (row `b` at `b * x_stride`), over `k < len`. `out` is
/// `[4][batch]`.
pub fn dot_4xn_avx2(w: &[f32], w_stride: usize, x: &[f32], x_stride: usize, batch: usize, len: usize, out: &mut [f32]) {
    assert!(has_avx2());
    assert!(len <= w_stride && w.len() >= 3 * w_stride + len);
    assert!(batch == 0 || (len <= x_stride && x.len() >= (batch - 1) * x_stride + len));
    assert!(out.len() >= 4 * batch);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 present; every row read lies in `w` / `x` and every write in `out` (asserted).
    unsafe {
        let mut b = 0;
        while b + 3 <= batch {
            let sums = dot_4x3(w.as_ptr(), w_stride, x.as_ptr().add(b * x_stride), x_stride, len);
            for r in 0..4 {
                for c in 0..3 {
                    out[r * batch + b + c] += sums[r][c];
                }
            }
            b += 3;
        }
        while b + 2 <= batch {
            let sums = dot_4x2(w.as_ptr(), w_stride, x.as_ptr().add(b * x_stride), x_stride, len);
            for r in 0..4 {
                out[r * batch + b] += sums[r][0];
                out[r * batch + b + 1] += sums[r][1];
            }
            b += 2;
        }
        if b < batch {
            let sums = dot_4x1(w.as_ptr(), w_stride, x.as_ptr().add(b * x_stride), len);
            for r in 0..4 {
                out[r * batch + b] += sums[r];
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let pair = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
    _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)))
}

/// Four weight rows against three activation rows: 12 accumulators (more FMAs in flight than
/// the latency needs) and 7 loads per 12 FMAs; all 16 vector registers are in use.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_4x3(w: *const f32, w_stride: usize, x: *const f32, x_stride: usize, len: usize) -> [[f32; 3]; 4] {
    // SAFETY (whole body): rows `0..4` of `w` and `0..3` of `x` hold `len` values (caller).
    unsafe {
        let (w0, w1, w2, w3) = (w, w.add(w_stride), w.add(2 * w_stride), w.add(3 * w_stride));
        let (xa, xb, xc) = (x, x.add(x_stride), x.add(2 * x_stride));
        let zero = _mm256_setzero_ps();
        let (mut a0, mut a1, mut a2, mut a3) = (zero, zero, zero, zero);
        let (mut b0, mut b1, mut b2, mut b3) = (zero, zero, zero, zero);
        let (mut c0, mut c1, mut c2, mut c3) = (zero, zero, zero, zero);
        let mut k = 0;
        while k + 8 <= len {
            let va = _mm256_loadu_ps(xa.add(k));
            let vb = _mm256_loadu_ps(xb.add(k));
            let vc = _mm256_loadu_ps(xc.add(k));
            let r0 = _mm256_loadu_ps(w0.add(k));
            a0 = _mm256_fmadd_ps(r0, va, a0);
            b0 = _mm256_fmadd_ps(r0, vb, b0);
            c0 = _mm256_fmadd_ps(r0, vc, c0);
            let r1 = _mm256_loadu_ps(w1.add(k));
            a1 = _mm256_fmadd_ps(r1, va, a1);
            b1 = _mm256_fmadd_ps(r1, vb, b1);
            c1 = _mm256_fmadd_ps(r1, vc, c1);
            let r2 = _mm256_loadu_ps(w2.add(k));
            a2 = _mm256_fmadd_ps(r2, va, a2);
            b2 = _mm256_fmadd_ps(r2, vb, b2);
            c2 = _mm256_fmadd_ps(r2, vc, c2);
            let r3 = _mm256_loadu_ps(w3.add(k));
            a3 = _mm256_fmadd_ps(r3, va, a3);
            b3 = _mm256_fmadd_ps(r3, vb, b3);
            c3 = _mm256_fmadd_ps(r3, vc, c3);
            k += 8;
        }
        let mut sums = [
            [hsum(a0), hsum(b0), hsum(c0)],
            [hsum(a1), hsum(b1), hsum(c1)],
            [hsum(a2), hsum(b2), hsum(c2)],
            [hsum(a3), hsum(b3), hsum(c3)],
        ];
        for (r, row) in [w0, w1, w2, w3].into_iter().enumerate() {
            for t in k..len {
                sums[r][0] += *row.add(t) * *xa.add(t);
                sums[r][1] += *row.add(t) * *xb.add(t);
                sums[r][2] += *row.add(t) * *xc.add(t);
            }
        }
        sums
    }
}

/// Four weight rows against two activation rows: 8 accumulators, each weight and activation
/// vector loaded once per 8 FMAs. The accumulators are named, not an array, so that they stay
/// in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_4x2(w: *const f32, w_stride: usize, x: *const f32, x_stride: usize, len: usize) -> [[f32; 2]; 4] {
    // SAFETY (whole body): rows `0..4` of `w` and `0..2` of `x` hold `len` values (caller).
    unsafe {
        let (w0, w1, w2, w3) = (w, w.add(w_stride), w.add(2 * w_stride), w.add(3 * w_stride));
        let (xa, xb) = (x, x.add(x_stride));
        let zero = _mm256_setzero_ps();
        let (mut a0, mut a1, mut a2, mut a3) = (zero, zero, zero, zero);
        let (mut b0, mut b1, mut b2, mut b3) = (zero, zero, zero, zero);
        let mut k = 0;
        while k + 8 <= len {
            let va = _mm256_loadu_ps(xa.add(k));
            let vb = _mm256_loadu_ps(xb.add(k));
            let r0 = _mm256_loadu_ps(w0.add(k));
            a0 = _mm256_fmadd_ps(r0, va, a0);
            b0 = _mm256_fmadd_ps(r0, vb, b0);
            let r1 = _mm256_loadu_ps(w1.add(k));
            a1 = _mm256_fmadd_ps(r1, va, a1);
            b1 = _mm256_fmadd_ps(r1, vb, b1);
            let r2 = _mm256_loadu_ps(w2.add(k));
            a2 = _mm256_fmadd_ps(r2, va, a2);
            b2 = _mm256_fmadd_ps(r2, vb, b2);
            let r3 = _mm256_loadu_ps(w3.add(k));
            a3 = _mm256_fmadd_ps(r3, va, a3);
            b3 = _mm256_fmadd_ps(r3, vb, b3);
            k += 8;
        }
        let mut sums = [
            [hsum(a0), hsum(b0)],
            [hsum(a1), hsum(b1)],
            [hsum(a2), hsum(b2)],
            [hsum(a3), hsum(b3)],
        ];
        for (r, row) in [w0, w1, w2, w3].into_iter().enumerate() {
            for t in k..len {
                sums[r][0] += *row.add(t) * *xa.add(t);
                sums[r][1] += *row.add(t) * *xb.add(t);
            }
        }
        sums
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_4x1(w: *const f32, w_stride: usize, x: *const f32, len: usize) -> [f32; 4] {
    // SAFETY (whole body): rows `0..4` of `w` and `x` hold `len` values (caller).
    unsafe {
        let (w0, w1, w2, w3) = (w, w.add(w_stride), w.add(2 * w_stride), w.add(3 * w_stride));
        let zero = _mm256_setzero_ps();
        // Two accumulators per row hide the FMA latency when only one activation row streams.
        let (mut a0, mut a1, mut a2, mut a3) = (zero, zero, zero, zero);
        let (mut b0, mut b1, mut b2, mut b3) = (zero, zero, zero, zero);
        let mut k = 0;
        while k + 16 <= len {
            let va = _mm256_loadu_ps(x.add(k));
            let vb = _mm256_loadu_ps(x.add(k + 8));
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0.add(k)), va, a0);
            b0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0.add(k + 8)), vb, b0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1.add(k)), va, a1);
            b1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1.add(k + 8)), vb, b1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2.add(k)), va, a2);
            b2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2.add(k + 8)), vb, b2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3.add(k)), va, a3);
            b3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3.add(k + 8)), vb, b3);
            k += 16;
        }
        if k + 8 <= len {
            let va = _mm256_loadu_ps(x.add(k));
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0.add(k)), va, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1.add(k)), va, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2.add(k)), va, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3.add(k)), va, a3);
            k += 8;
        }
        let mut sums = [
            hsum(_mm256_add_ps(a0, b0)),
            hsum(_mm256_add_ps(a1, b1)),
            hsum(_mm256_add_ps(a2, b2)),
            hsum(_mm256_add_ps(a3, b3)),
        ];
        for (r, row) in [w0, w1, w2, w3].into_iter().enumerate() {
            for t in k..len {
                sums[r] += *row.add(t) * *x.add(t);
            }
        }
        sums
    }
}

/// `Σ a[i]·b[i]` (AVX2 when present).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let len = a.len().min(b.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 present; both slices hold `len` values.
        return unsafe { dot_avx2(a.as_ptr(), b.as_ptr(), len) };
    }
    a[..len].iter().zip(&b[..len]).map(|(x, y)| x * y).sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: *const f32, b: *const f32, len: usize) -> f32 {
    // SAFETY (whole body): `a` and `b` hold `len` values (caller).
    unsafe {
        let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 16 <= len {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i + 8)), _mm256_loadu_ps(b.add(i + 8)), acc1);
            i += 16;
        }
        if i + 8 <= len {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), acc0);
            i += 8;
        }
        let mut sum = hsum(_mm256_add_ps(acc0, acc1));
        while i < len {
            sum += *a.add(i) * *b.add(i);
            i += 1;
        }
        sum
    }
}

/// `y[i] += alpha · x[i]` (AVX2 when present).
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    let len = x.len().min(y.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 present; `x` and `y` hold `len` values.
        unsafe { axpy_avx2(alpha, x.as_ptr(), y.as_mut_ptr(), len) };
        return;
    }
    for (yi, xi) in y[..len].iter_mut().zip(&x[..len]) {
        *yi += alpha * xi;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_avx2(alpha: f32, x: *const f32, y: *mut f32, len: usize) {
    // SAFETY (whole body): `x` and `y` hold `len` values (caller).
    unsafe {
        let a = _mm256_set1_ps(alpha);
        let mut i = 0;
        while i + 8 <= len {
            let updated = _mm256_fmadd_ps(a, _mm256_loadu_ps(x.add(i)), _mm256_loadu_ps(y.add(i)));
            _mm256_storeu_ps(y.add(i), updated);
            i += 8;
        }
        while i < len {
            *y.add(i) += alpha * *x.add(i);
            i += 1;
        }
    }
}

/// A `[batch][columns]` f32 matrix that parallel tasks fill, each its own range of columns.
pub struct SharedOutput<'a> {
    ptr: *mut f32,
    batch: usize,
    columns: usize,
    _borrow: PhantomData<&'a mut [f32]>,
}

// SAFETY: tasks write disjoint columns (module invariant), so sharing the pointer between threads
// never makes two writes to one element; the borrow keeps the memory alive.
unsafe impl Send for SharedOutput<'_> {}
unsafe impl Sync for SharedOutput<'_> {}

impl<'a> SharedOutput<'a> {
    pub fn new(out: &'a mut [f32], batch: usize, columns: usize) -> Self {
        assert!(out.len() >= batch * columns);
        Self {
            ptr: out.as_mut_ptr(),
            batch,
            columns,
            _borrow: PhantomData,
        }
    }

    /// Stores `values[r][b]` (`values` is `[rows][batch]`) at `out[b][first + r]`.
    /// Callers pass only the columns their task owns (module invariant).
    pub fn store_columns(&self, first: usize, rows: usize, values: &[f32]) {
        assert!(first + rows <= self.columns && values.len() >= rows * self.batch);
        for r in 0..rows {
            for b in 0..self.batch {
                // SAFETY: in bounds (asserted); no other task writes column `first + r`.
                unsafe { *self.ptr.add(b * self.columns + first + r) = values[r * self.batch + b] };
            }
        }
    }
}
