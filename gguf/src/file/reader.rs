//! Little-endian reads of the GGUF container's fields: integers, strings and metadata values.

use super::{invalid, GgufError, MetadataValue};

/// A cursor over the file's bytes whose every read is bounds-checked and names what it was
/// reading, so a truncated or corrupt file is an error, never a panic.
pub(super) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, pos: 0 }
    }

    /// Bytes read so far.
    pub(super) fn position(&self) -> usize {
        self.pos
    }

    pub(super) fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        let remaining = (self.bytes.len() - self.pos) as u64;
        if n > remaining {
            return Err(GgufError::Truncated {
                what: what.to_owned(),
                offset: self.pos as u64,
                needed: n,
                len: self.bytes.len() as u64,
            });
        }
        let slice = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(slice)
    }

    pub(super) fn ensure_plausible_count(&self, count: u64, min_entry_bytes: u64, what: &str) -> Result<(), GgufError> {
        let remaining = (self.bytes.len() - self.pos) as u64;
        if count.saturating_mul(min_entry_bytes) > remaining {
            return Err(invalid(
                what,
                &format!("{count} entries cannot fit in the {remaining} bytes left"),
            ));
        }
        Ok(())
    }

    pub(super) fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let slice = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(slice);
        Ok(out)
    }

    pub(super) fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub(super) fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    pub(super) fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let raw = self.take(len, what)?;
        String::from_utf8(raw.to_vec()).map_err(|e| invalid(what, &format!("not UTF-8: {e}")))
    }

    pub(super) fn value(&mut self, value_type: u32, key: &str) -> Result<MetadataValue, GgufError> {
        Ok(match value_type {
            0 => MetadataValue::U8(u8::from_le_bytes(self.array(key)?)),
            1 => MetadataValue::I8(i8::from_le_bytes(self.array(key)?)),
            2 => MetadataValue::U16(u16::from_le_bytes(self.array(key)?)),
            3 => MetadataValue::I16(i16::from_le_bytes(self.array(key)?)),
            4 => MetadataValue::U32(self.u32(key)?),
            5 => MetadataValue::I32(i32::from_le_bytes(self.array(key)?)),
            6 => MetadataValue::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match u8::from_le_bytes(self.array(key)?) {
                0 => MetadataValue::Bool(false),
                1 => MetadataValue::Bool(true),
                other => return Err(invalid(&format!("value of `{key}`"), &format!("bool byte {other}"))),
            },
            8 => MetadataValue::String(self.string(key)?),
            9 => {
                let item_type = self.u32(key)?;
                let len = self.u64(key)?;
                if item_type == 9 {
                    return Err(invalid(&format!("value of `{key}`"), "nested arrays are not supported"));
                }
                self.ensure_plausible_count(len, 1, &format!("length of array `{key}`"))?;
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.value(item_type, key)?);
                }
                MetadataValue::Array(items)
            }
            10 => MetadataValue::U64(self.u64(key)?),
            11 => MetadataValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => MetadataValue::F64(f64::from_le_bytes(self.array(key)?)),
            other => {
                return Err(invalid(
                    &format!("type of `{key}`"),
                    &format!("unknown value type {other}"),
                ))
            }
        })
    }
}
