//! The crate's only `unsafe` (here and in its children [`row_gemv`], [`packed_gemm`],
//! [`packed_gemm_avx512`], [`gemv_q4_1`], [`panels`], [`panel_gemv`], [`panel_gemv_avx2`],
//! [`panel_pair_gemv`], [`panel_digits_avx2`], [`panel_digits_avx512`], [`panel_digits_vnni`],
//! [`amx`], [`grouped_heads`] (and its `passes_avx512`), [`kv24`], [`prompt_scores`] and
//! [`decode`]): AVX2 + FMA +
//! F16C code paths, AVX-512 ones, an AMX one (with its own invariants, stated there), and the
//! output handle that lets parallel tasks write disjoint columns of one matrix.
//!
//! Invariants, checked where each function is entered from safe code:
//! - Every `#[target_feature]` function is called only after [`has_avx2`] (for `avx512f`
//!   functions, [`has_avx512`]; for `avx512bw` ones, [`has_avx512bw`] or [`has_amx`]; for
//!   `avx512vnni` ones, [`panel_digits_vnni::has_avx512_vnni`], and with `avx512vbmi`
//!   [`has_avx512_vnni_vbmi`]; for the attention loops' `avx512vbmi`,
//!   [`kv24::has_kv24_avx512`]) returned true (the safe wrappers check it), so the
//!   instructions exist on this CPU.
//! - Every pointer read or written lies inside a slice whose length was checked against the
//!   loop bounds before the loop (the `assert!`s at the top of each safe wrapper); loads and
//!   stores are unaligned (`loadu`/`storeu`), so no alignment is assumed.
//! - [`SharedOutput`]: each task writes only the columns (output rows of the weight matrix) it was
//!   given, so no element is written by two threads, and the borrow it was made from outlives the
//!   parallel region (it is created and dropped inside [`crate::matrix::WeightMatrix::matmul`]).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use std::marker::PhantomData;

mod amx;
mod decode;
mod gemv_q4_1;
mod grouped_heads;
mod kv24;
mod packed_gemm;
mod packed_gemm_avx512;
mod panel_digits_avx2;
mod panel_digits_avx512;
mod panel_digits_vnni;
mod panel_gemv;
mod panel_gemv_avx2;
mod panel_pair_gemv;
mod panels;
mod peak;
mod prompt_scores;
mod row_gemv;
pub use amx::{has_amx, SplitActivations, Tiles, AMX_PANELS};
pub use decode::{avx2_decodes, decode_avx2};
pub use gemv_q4_1::{gemv_q4_1_avx2, Q4_1Activations, GEMV_Q4_1_MAX_BATCH};
pub use grouped_heads::{score_keys, weighted_rows};
pub use packed_gemm::{gemm_panel_avx2, pack_panel_avx2};
pub use packed_gemm_avx512::packed_avx512_min_rows;
pub use panel_digits_avx2::ActivationDigits;
pub use panel_digits_avx512::{has_avx512bw, DigitPairKernel};
pub use panel_digits_vnni::has_avx512_vnni_vbmi;
pub use panel_gemv::{block_sums, PANEL_GEMV_ROWS};
pub use panel_pair_gemv::PANEL_PAIR_MIN_ROWS;
pub use panels::Panels;
pub use peak::fma_peak_gflops_on;
pub use prompt_scores::{prompt_scores_take, score_prompt_keys};
pub use row_gemv::{gemv_decodes, gemv_rows_avx2, GEMV_MAX_BATCH};

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

/// Whether one 4-bit row multiplies its 8-bit digits ([`panel_digits_avx2`], and on AVX-512BW
/// [`panel_digits_avx512`]);
/// `RIVULET_KERNELS_NO_DIGITS=1` keeps it on the f32 panel GEMV (to compare them).
pub fn digits_enabled() -> bool {
    use std::sync::OnceLock;
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var_os("RIVULET_KERNELS_NO_DIGITS").is_none())
}

/// Whether this CPU also runs the AVX-512 paths ([`panel_gemv`]); detected once, and
/// `RIVULET_KERNELS_NO_AVX512=1` keeps to the AVX2 ones (to compare them).
pub fn has_avx512() -> bool {
    use std::sync::OnceLock;
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        if !has_avx2() || std::env::var_os("RIVULET_KERNELS_NO_AVX512").is_some() {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512f")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Whether this CPU is an AMD Zen 5 or later (CPUID family 1Ah and up): AVX-512 on full-width
/// units, four vector pipes beside two loads a cycle, so that decoding weights in registers
/// costs little beside the FMAs (see [`packed_avx512_min_rows`]). Detected once.
pub fn is_amd_zen5_or_later() -> bool {
    use std::sync::OnceLock;
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::__cpuid;
            // SAFETY: CPUID exists on every x86_64 CPU (leaves 0 and 1 always). Newer compilers
            // mark `__cpuid` safe; the block keeps the older ones this crate supports building.
            #[allow(unused_unsafe)]
            let (vendor, signature) = unsafe { (__cpuid(0), __cpuid(1)) };
            let amd = (vendor.ebx, vendor.edx, vendor.ecx) == (0x6874_7541, 0x6974_6E65, 0x444D_4163);
            let base = (signature.eax >> 8) & 0xF;
            let family = if base == 0xF {
                base + ((signature.eax >> 20) & 0xFF)
            } else {
                base
            };
            amd && family >= 0x1A
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Makes this thread's f32 arithmetic treat subnormal inputs and results as zero (x86's MXCSR
/// flags DAZ and FTZ; nothing elsewhere).
///
/// Why: a subnormal operand or result costs a microcode assist of ~100 cycles per instruction.
/// Serving, SiLU of a strongly negative gate gives values around 1e-30, which the Q4_1 GEMV's
/// exact `2^-24` rescaling ([`gemv_q4_1`]) turns subnormal: one decoding stream's step measured
/// 7.1 ms with them and 6.1 ms flushed. What is lost is below 2^-126 in magnitude: next to any
/// weight times a normal activation it is far under half an ulp of the sum, so no logit moves.
pub fn flush_subnormals_on_this_thread() {
    #[cfg(target_arch = "x86_64")]
    {
        // DAZ (bit 6) and FTZ (bit 15).
        const FLUSH: u32 = 0x8040;
        let mut csr = 0u32;
        // SAFETY: `stmxcsr` stores the 32-bit control register into `csr`, a live local;
        // `ldmxcsr` loads it back with two mode bits set (every x86_64 CPU has both), which
        // changes only how this thread rounds subnormals.
        unsafe {
            std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags));
            csr |= FLUSH;
            std::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack, readonly, preserves_flags));
        }
    }
}

/// Whether `needed` (a length computed with checked arithmetic) exists and is at most `len`: the
/// bounds asserts below use it so that no overflowing product can let one pass by wrapping.
fn fits(len: usize, needed: Option<usize>) -> bool {
    needed.is_some_and(|needed| needed <= len)
}

/// `(count - 1) · stride + last`: the length a slice needs for `count` runs of `last` values
/// `stride` apart (0 for no runs); `None` on overflow.
fn strided_len(count: usize, stride: usize, last: usize) -> Option<usize> {
    match count {
        0 => Some(0),
        _ => (count - 1).checked_mul(stride)?.checked_add(last),
    }
}

/// `len` values of `buffer` (whatever it held) starting on a cache line, growing it as needed.
/// Why: the heap hands a `Vec<f32>` out 16-byte aligned, so every 512-bit load or store of a
/// scratch buffer the batched kernels stream through (decoded weights, partial sums) touched two
/// cache lines, and a 256-bit one every other time: aligned, Zen 4's steps of 32 and 64 rows
/// and its 256-token prefills ran 1–5% faster (the thirty-third round). (Should `align_offset`
/// not answer, the slice starts at the buffer's start: unaligned, still correct.)
pub fn cache_aligned(buffer: &mut Vec<f32>, len: usize) -> &mut [f32] {
    const LINE: usize = 64 / size_of::<f32>();
    buffer.resize(len + LINE - 1, 0.0);
    let skip = buffer.as_ptr().align_offset(64).min(LINE - 1);
    &mut buffer[skip..skip + len]
}

/// The sum of a vector's eight lanes (the row paths' and the attention kernels' last step).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let pair = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
    _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)))
}

/// Asks for every cache line of `data` to be brought towards L1 (a hint; it changes no state a
/// program can observe).
pub fn prefetch<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    prefetch_lines::<_MM_HINT_T0, T>(data);
}

/// Asks for every cache line of `data` to be brought into L2 (and not L1), as [`prefetch`].
pub fn prefetch_l2<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    prefetch_lines::<_MM_HINT_T1, T>(data);
}

#[cfg(target_arch = "x86_64")]
fn prefetch_lines<const HINT: i32, T>(data: &[T]) {
    let start = data.as_ptr().cast::<u8>();
    for offset in (0..std::mem::size_of_val(data)).step_by(64) {
        // SAFETY: `offset` lies inside the live slice `data`, and a prefetch neither faults nor
        // writes.
        unsafe { _mm_prefetch::<HINT>(start.add(offset).cast()) };
    }
}

/// Weight rows per panel: the rows of every [`Panels`] panel, and two AVX2 vectors of the packed
/// kernel ([`gemm_panel_avx2`]).
pub const PANEL: usize = 16;

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

/// The exponential race's pass over one chunk of a row (`crate::sampling`'s `race`): `flags[i]`
/// is 1 where token `first + i` may still beat a score of `bound`, `weights[i] > v_i · bound`
/// with `v_i` its race bits' top 24 bits over 2²⁴ (exact in f32), else 0; returns how many are 1.
/// Plain integer and f32 arithmetic that the compiler vectorizes, compiled for AVX2 where the CPU
/// has it (its 32-bit multiplies are one instruction; SSE2's are several).
pub fn race_survivors(key: u32, first: u32, weights: &[f32], bound: f32, flags: &mut [u8]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 present; the body is safe code.
        return unsafe { race_survivors_avx2(key, first, weights, bound, flags) };
    }
    race_survivors_plain(key, first, weights, bound, flags)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn race_survivors_avx2(key: u32, first: u32, weights: &[f32], bound: f32, flags: &mut [u8]) -> usize {
    race_survivors_plain(key, first, weights, bound, flags)
}

#[inline(always)]
fn race_survivors_plain(key: u32, first: u32, weights: &[f32], bound: f32, flags: &mut [u8]) -> usize {
    let flags = &mut flags[..weights.len()];
    for (i, (&weight, flag)) in weights.iter().zip(flags.iter_mut()).enumerate() {
        let bits = crate::sampling::race_bits(key, first.wrapping_add(i as u32));
        let v = (bits >> 8) as f32 * (1.0 / 16_777_216.0);
        *flag = u8::from(weight > v * bound);
    }
    flags.iter().map(|&flag| usize::from(flag)).sum()
}

/// `x[i] = eˣ⁽ⁱ⁾` in place. The AVX2 path is the Cephes polynomial (as in `avx_mathfun`'s
/// `exp256_ps`): within 2 ulp of libm over the range softmax and SiLU use, 8 at a time.
pub fn exp_in_place(x: &mut [f32]) {
    let vector_len = x.len() / 8 * 8;
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 present; `x` holds `vector_len` values.
        unsafe { exp_avx2(x.as_mut_ptr(), vector_len) };
        x[vector_len..].iter_mut().for_each(|v| *v = v.exp());
        return;
    }
    x.iter_mut().for_each(|v| *v = v.exp());
}

/// The loop in a `target_feature` function, so that the loads and stores inline (called from
/// plain code, each intrinsic was a function call).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_avx2(x: *mut f32, len: usize) {
    // SAFETY (whole body): `x` holds `len` values, a multiple of 8 (caller).
    unsafe {
        for i in (0..len).step_by(8) {
            _mm256_storeu_ps(x.add(i), exp256(_mm256_loadu_ps(x.add(i))));
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp256(x: __m256) -> __m256 {
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.336_55)), _mm256_set1_ps(88.376_26));
    // x = n·ln2 + r, |r| ≤ ln2/2; ln2 split in two for the subtraction's accuracy.
    let n = _mm256_floor_ps(_mm256_fmadd_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
        _mm256_set1_ps(0.5),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
    // 2ⁿ from the exponent bits.
    let pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    _mm256_mul_ps(y, _mm256_castsi256_ps(pow2))
}

/// `out[i] = gate[i] / (1 + e^−gate[i]) · up[i]`, SwiGLU's `silu(gate) · up`, in one pass (AVX2
/// when present): the same operations in the same order as negating into `out`, then
/// [`exp_in_place`], then the division and product, so the result is bit for bit theirs. As
/// those three passes a 32-sequence step spent 851–915 µs here on an Intel Xeon, as one
/// 641–753 (`RIVULET_BENCH_PHASES=1`, four alternations).
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let len = out.len();
    assert!(gate.len() == len && up.len() == len);
    let vector_len = len / 8 * 8;
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 present; `gate`, `up` and `out` hold `len ≥ vector_len` values.
        unsafe { silu_mul_avx2(gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), vector_len) };
        silu_mul_portable(&gate[vector_len..], &up[vector_len..], &mut out[vector_len..]);
        return;
    }
    silu_mul_portable(gate, up, out);
}

fn silu_mul_portable(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(gate: *const f32, up: *const f32, out: *mut f32, len: usize) {
    // SAFETY (whole body): each pointer holds `len` values, a multiple of 8 (caller).
    unsafe {
        let (one, sign) = (_mm256_set1_ps(1.0), _mm256_set1_ps(-0.0));
        for i in (0..len).step_by(8) {
            let g = _mm256_loadu_ps(gate.add(i));
            let e = exp256(_mm256_xor_ps(g, sign));
            let silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
            _mm256_storeu_ps(out.add(i), _mm256_mul_ps(silu, _mm256_loadu_ps(up.add(i))));
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
        assert!(fits(out.len(), batch.checked_mul(columns)));
        Self {
            ptr: out.as_mut_ptr(),
            batch,
            columns,
            _borrow: PhantomData,
        }
    }

    /// Stores `values[i][j]` (`values` is `[batch_rows.len()][stride]`) at
    /// `out[batch_rows.start + i][first + j]` for `j < columns`. Callers pass only the columns
    /// their task owns (module invariant).
    pub fn store_rows(
        &self,
        batch_rows: std::ops::Range<usize>,
        first: usize,
        columns: usize,
        values: &[f32],
        stride: usize,
    ) {
        assert!(fits(self.columns, first.checked_add(columns)) && columns <= stride);
        assert!(batch_rows.start <= batch_rows.end && batch_rows.end <= self.batch);
        assert!(fits(values.len(), strided_len(batch_rows.len(), stride, columns)));
        for (i, b) in batch_rows.enumerate() {
            let src = &values[i * stride..i * stride + columns];
            let dst = self.ptr.wrapping_add(b * self.columns + first);
            // SAFETY: in bounds (asserted); no other task writes these columns. A whole panel's
            // row is copied with a constant length, which compiles to one inlined 64-byte move:
            // with the run-time length every row was a call into libc's `memmove`.
            unsafe {
                if columns == PANEL {
                    std::ptr::copy_nonoverlapping(src.as_ptr(), dst, PANEL)
                } else {
                    std::ptr::copy_nonoverlapping(src.as_ptr(), dst, columns)
                }
            };
        }
    }

    /// Stores `values[r][b]` (`values` is `[rows][batch]`) at `out[b][first + r]`.
    /// Callers pass only the columns their task owns (module invariant).
    pub fn store_columns(&self, first: usize, rows: usize, values: &[f32]) {
        assert!(fits(self.columns, first.checked_add(rows)) && fits(values.len(), rows.checked_mul(self.batch)));
        for r in 0..rows {
            for b in 0..self.batch {
                // SAFETY: in bounds (asserted); no other task writes column `first + r`.
                unsafe { *self.ptr.add(b * self.columns + first + r) = values[r * self.batch + b] };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::hint::black_box;

    /// On a thread that asked for it, a product below the normal range is zero and a subnormal
    /// operand counts as zero; normal arithmetic is untouched. (Elsewhere than x86-64 the call
    /// does nothing.)
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn flushing_zeroes_subnormals_only() {
        std::thread::spawn(|| {
            let tiny = black_box(f32::MIN_POSITIVE);
            assert!(tiny * black_box(0.5) > 0.0, "subnormals exist before");
            super::flush_subnormals_on_this_thread();
            assert_eq!(tiny * black_box(0.5), 0.0);
            assert_eq!(black_box(f32::from_bits(1)) * black_box(2f32.powi(100)), 0.0);
            assert_eq!(black_box(1.5f32) * black_box(3.0), 4.5);
        })
        .join()
        .expect("the flushing thread");
    }
}
