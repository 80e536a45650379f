//! Loads of the KV cache's three-byte values ([`crate::kv_values`]) widened to f32 vectors, for
//! the attention loops ([`super::grouped_heads`], [`super::prompt_scores`]). Part of
//! [`super`]'s `unsafe`, under its invariants: each load reads a whole vector's bytes from its
//! address on (64 for 16 values, 32 for 8), up to [`crate::kv_values::KV_READ_PAST`] past the
//! values it widens, which the callers' bounds checks include.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Whether the AVX-512 attention loops run here: they widen 16 values with one byte permute
/// (`vpermb`, AVX-512 VBMI; Intel since Ice Lake, AMD since Zen 4). Detected once; off where
/// [`super::has_avx512`] is.
pub fn has_kv24_avx512() -> bool {
    use std::sync::OnceLock;
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            super::has_avx512() && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vbmi")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// For `vpermb`: dword `i` of the result takes bytes `3i, 3i + 1, 3i + 2` as its upper three
/// (its lowest byte is zeroed by [`LOW_BYTES`]' mask).
#[cfg(target_arch = "x86_64")]
static SPREAD_16: [u8; 64] = {
    let mut index = [0u8; 64];
    let mut i = 0;
    while i < 16 {
        index[4 * i + 1] = (3 * i) as u8;
        index[4 * i + 2] = (3 * i + 1) as u8;
        index[4 * i + 3] = (3 * i + 2) as u8;
        i += 1;
    }
    index
};

/// Every byte but each dword's lowest.
#[cfg(target_arch = "x86_64")]
const LOW_BYTES: u64 = 0xEEEE_EEEE_EEEE_EEEE;

/// The 16 values whose bytes start at `at`, as f32 (reads 64 bytes).
///
/// # Safety
/// AVX-512F, BW and VBMI present ([`has_kv24_avx512`]); `at..at + 64` readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
#[inline]
pub(super) unsafe fn load16(at: *const u8) -> __m512 {
    // SAFETY: see above.
    unsafe {
        let bytes = _mm512_loadu_si512(at.cast());
        let spread = _mm512_loadu_si512(SPREAD_16.as_ptr().cast());
        _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi8(LOW_BYTES, spread, bytes))
    }
}

/// The 8 values whose bytes start at `at`, as f32 (reads 28 bytes): values 0–3 (bytes 0–11)
/// are loaded into the low 128-bit lane and values 4–7 (bytes 12–23) into the high one, then a
/// byte shuffle within each lane puts each value's three bytes above a zero byte. (One 32-byte
/// load and a dword permute across the lanes instead measured the same on an Intel Xeon; AMD's
/// cores cross lanes more slowly.)
///
/// # Safety
/// AVX2 present; `at..at + 28` readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn load8(at: *const u8) -> __m256 {
    // SAFETY: see above.
    unsafe {
        let low = _mm_loadu_si128(at.cast());
        let high = _mm_loadu_si128(at.add(12).cast());
        let lanes = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(low), high);
        let z = -128i8; // a shuffle index with its top bit set writes a zero byte
        let spread = _mm256_setr_epi8(
            z, 0, 1, 2, z, 3, 4, 5, z, 6, 7, 8, z, 9, 10, 11, //
            z, 0, 1, 2, z, 3, 4, 5, z, 6, 7, 8, z, 9, 10, 11,
        );
        _mm256_castsi256_ps(_mm256_shuffle_epi8(lanes, spread))
    }
}

/// Asks for the cache lines of row `row` (`dim` values) of packed rows `rows` with prefetch hint
/// `HINT`.
///
/// # Safety
/// The row lies inside `rows`' allocation (a prefetch never faults, but the address arithmetic
/// must stay in bounds).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn prefetch_packed_row<const HINT: i32>(rows: *const u8, row: usize, dim: usize) {
    // SAFETY (whole body): see above.
    unsafe {
        let (start, end) = (row * 3, (row + dim) * 3);
        let mut line = start & !63;
        while line < end {
            _mm_prefetch::<HINT>(rows.add(line).cast());
            line += 64;
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::kv_values::{kv_value, pack_kv_row};

    #[test]
    fn wide_loads_widen_each_value() {
        let values: Vec<f32> = (0..48)
            .map(|i| (i as f32 - 20.0) * 1.37e-2 + 1.0e-6 * i as f32)
            .collect();
        let mut bytes = vec![0u8; values.len() * 3 + 64];
        pack_kv_row(&values, &mut bytes[..values.len() * 3]);
        let expected: Vec<f32> = (0..values.len()).map(|i| kv_value(&bytes, i)).collect();
        for first in [0usize, 1, 8, 16, 31] {
            if super::super::has_avx2() {
                let mut got = [0f32; 8];
                // SAFETY: AVX2 present; 32 bytes from value `first` lie in `bytes`.
                unsafe { _mm256_storeu_ps(got.as_mut_ptr(), load8(bytes.as_ptr().add(3 * first))) };
                assert_eq!(got[..], expected[first..first + 8]);
            }
            if has_kv24_avx512() {
                let mut got = [0f32; 16];
                // SAFETY: AVX-512 with VBMI present; 64 bytes from value `first` lie in `bytes`.
                unsafe { _mm512_storeu_ps(got.as_mut_ptr(), load16(bytes.as_ptr().add(3 * first))) };
                assert_eq!(got[..], expected[first..first + 16]);
            }
        }
    }
}
