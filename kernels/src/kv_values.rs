//! How the CPU KV cache stores each key and value: the upper three bytes of its f32 (sign,
//! exponent and the mantissa's 15 high bits), rounded to nearest, ties to even — 16 significant
//! bits, a relative error of at most 2⁻¹⁶ — little-endian, three bytes a value, rows packed
//! back to back (a 64-value head row is 192 bytes, three cache lines).
//!
//! Why: decoding a batch, attention reads every sequence's keys and values each step (377 MB
//! for 32 sequences at context 256 with f32 rows), and from 32 sequences it runs at the memory's
//! speed, a third of the step. Three bytes a value read a quarter less: on an Intel Xeon without
//! AMX, a 32-sequence step's attention over 30 layers 15.4–15.9 ms against f32's 21.1–22.0
//! (the forty-first round, a prototype of these loops). What it costs in exactness was measured
//! against transformers before it was built: the largest logprob deviation of the sampling
//! test's 8 greedy tokens and their top 5 2.1e-4 against f32's 2.4e-5 (the target is 1e-3;
//! f16 rows, 11 significant bits, gave 1.4e-3), the generation tests' greedy tokens unchanged.
//!
//! The SIMD loops that read these rows widen 8 or 16 values a load (`simd::kv24`) and may read
//! up to [`KV_READ_PAST`] bytes past a row's last value, so a cache holds [`KV_TAIL_BYTES`] more
//! than its values ([`kv_cache_bytes`]).

/// Bytes one key or value takes.
pub const KV_VALUE_BYTES: usize = 3;

/// Bytes past a row's last value that the attention loops may load (and ignore): a 64-byte load
/// for a row's last 16 values (48 bytes) reaches 16 past it.
pub const KV_READ_PAST: usize = 16;

/// Bytes a cache keeps after its last value, so that every row's loads stay inside it.
pub const KV_TAIL_BYTES: usize = 64;

/// Bytes a cache of `values` keys (or values) takes.
pub fn kv_cache_bytes(values: usize) -> usize {
    values * KV_VALUE_BYTES + KV_TAIL_BYTES
}

/// `x` rounded to 16 significant bits (nearest, ties to even) as its f32's upper three bytes. A
/// NaN stays a NaN (its payload may sit in the dropped byte); a value that rounds past the
/// largest finite one becomes an infinity, as rounding does.
pub fn pack_kv(x: f32) -> [u8; 3] {
    let bits = if x.is_nan() {
        0x7FC0_0000
    } else {
        let bits = x.to_bits();
        bits.wrapping_add(0x7F + ((bits >> 8) & 1))
    };
    let [_, b1, b2, b3] = bits.to_le_bytes();
    [b1, b2, b3]
}

/// The f32 whose upper three bytes `bytes` holds (its lowest byte zero).
pub fn unpack_kv(bytes: [u8; 3]) -> f32 {
    f32::from_bits(u32::from_le_bytes([0, bytes[0], bytes[1], bytes[2]]))
}

/// `destination` (`3 · source.len()` bytes) = each value of `source` packed.
pub fn pack_kv_row(source: &[f32], destination: &mut [u8]) {
    assert_eq!(destination.len(), source.len() * KV_VALUE_BYTES);
    for (x, bytes) in source.iter().zip(destination.chunks_exact_mut(KV_VALUE_BYTES)) {
        bytes.copy_from_slice(&pack_kv(*x));
    }
}

/// Value `index` of packed rows `bytes`.
pub fn kv_value(bytes: &[u8], index: usize) -> f32 {
    let at = index * KV_VALUE_BYTES;
    unpack_kv([bytes[at], bytes[at + 1], bytes[at + 2]])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_rounds_to_sixteen_significant_bits() {
        for x in [1.0f32, -2.5, 3.0e-20, 1.0e30, 0.0, -0.0, 0.1, -7.77e-3] {
            let back = unpack_kv(pack_kv(x));
            assert!((back - x).abs() <= x.abs() * 2f32.powi(-16), "{x} → {back}");
            assert_eq!(back.to_bits() & 0xFF, 0);
            assert_eq!(back.is_sign_negative(), x.is_sign_negative());
        }
        // Ties go to even: 1 + 2⁻¹⁶ (exactly half-way) rounds down to 1, 1 + 3·2⁻¹⁶ up.
        assert_eq!(unpack_kv(pack_kv(1.0 + 2f32.powi(-16))), 1.0);
        assert_eq!(
            unpack_kv(pack_kv(1.0 + 3.0 * 2f32.powi(-16))),
            1.0 + 4.0 * 2f32.powi(-16)
        );
        // Just above half-way rounds up.
        assert_eq!(
            unpack_kv(pack_kv(1.0 + 2f32.powi(-16) + 2f32.powi(-23))),
            1.0 + 2f32.powi(-15)
        );
        assert!(unpack_kv(pack_kv(f32::NAN)).is_nan());
        assert_eq!(unpack_kv(pack_kv(f32::INFINITY)), f32::INFINITY);
        assert_eq!(unpack_kv(pack_kv(f32::MAX)), f32::INFINITY);
    }

    #[test]
    fn rows_pack_value_by_value() {
        let row: Vec<f32> = (0..37).map(|i| i as f32 * 0.37 - 5.0).collect();
        let mut bytes = vec![0u8; row.len() * KV_VALUE_BYTES];
        pack_kv_row(&row, &mut bytes);
        for (i, x) in row.iter().enumerate() {
            assert_eq!(kv_value(&bytes, i), unpack_kv(pack_kv(*x)));
        }
    }
}
