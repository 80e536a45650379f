//! The GGUF container (versions 2 and 3), following llama.cpp's `gguf.cpp` reader: magic,
//! version, tensor and metadata counts, metadata key/values, tensor infos, then the aligned data
//! section.

use std::collections::BTreeMap;

use thiserror::Error;

use crate::dequant::GgmlType;

mod reader;
use reader::Reader;

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Upper bounds that stop a corrupt count from driving a huge allocation.
const MAX_TENSOR_DIMS: u32 = 4;

#[derive(Debug, Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("not a GGUF file (magic {0:?})")]
    BadMagic([u8; 4]),
    #[error("unsupported GGUF version {0} (2 and 3 are supported)")]
    UnsupportedVersion(u32),
    #[error("file truncated while reading {what} at byte {offset} (needs {needed} bytes, file has {len})")]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        len: u64,
    },
    #[error("invalid {what}: {detail}")]
    Invalid { what: String, detail: String },
    #[error("metadata key `{0}` is missing")]
    MissingKey(String),
    #[error("metadata key `{key}` has type {actual}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        actual: &'static str,
    },
    #[error("tensor `{0}` is missing")]
    MissingTensor(String),
    #[error("tensor `{name}` has type {ggml_type:?}, which cannot be dequantized (supported: {supported})")]
    UnsupportedType {
        name: String,
        ggml_type: GgmlType,
        supported: &'static str,
    },
}

/// A metadata value; arrays keep their element values.
#[derive(Debug, Clone, PartialEq)]
pub enum MetadataValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetadataValue>),
}

impl MetadataValue {
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::U8(_) => "u8",
            Self::I8(_) => "i8",
            Self::U16(_) => "u16",
            Self::I16(_) => "i16",
            Self::U32(_) => "u32",
            Self::I32(_) => "i32",
            Self::U64(_) => "u64",
            Self::I64(_) => "i64",
            Self::F32(_) => "f32",
            Self::F64(_) => "f64",
            Self::Bool(_) => "bool",
            Self::String(_) => "string",
            Self::Array(_) => "array",
        }
    }

    /// Any integer type that fits in u64 without loss.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: `dims[0]` is the fastest-varying (a row's length).
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the file.
    pub data_offset: u64,
    pub data_len: u64,
}

impl TensorInfo {
    pub fn element_count(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The shape in row-major (torch) order: the reverse of `dims`.
    pub fn torch_shape(&self) -> Vec<i64> {
        self.dims.iter().rev().map(|&d| d as i64).collect()
    }
}

/// A parsed GGUF file with its bytes.
pub struct GgufFile {
    pub version: u32,
    pub metadata: BTreeMap<String, MetadataValue>,
    pub tensors: Vec<TensorInfo>,
    bytes: Vec<u8>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

impl GgufFile {
    pub fn open(path: &std::path::Path) -> Result<Self, GgufError> {
        let bytes = std::fs::read(path).map_err(|source| GgufError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(bytes)
    }

    pub fn parse(bytes: Vec<u8>) -> Result<Self, GgufError> {
        let mut reader = Reader::new(&bytes);
        let magic: [u8; 4] = reader
            .take(4, "magic")?
            .try_into()
            .map_err(|_| invalid("magic", "short"))?;
        if &magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic(magic));
        }
        let version = reader.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let tensor_count = reader.u64("tensor count")?;
        let kv_count = reader.u64("metadata count")?;
        // Each entry takes at least 8+4 bytes (tensor) or 8+4 bytes (key/value): a cheap bound.
        reader.ensure_plausible_count(tensor_count, 12, "tensor count")?;
        reader.ensure_plausible_count(kv_count, 12, "metadata count")?;

        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key = reader.string("metadata key")?;
            let value_type = reader.u32(&format!("type of `{key}`"))?;
            let value = reader.value(value_type, &key)?;
            metadata.insert(key, value);
        }

        let mut raw_tensors = Vec::with_capacity(tensor_count as usize);
        for _ in 0..tensor_count {
            let name = reader.string("tensor name")?;
            let n_dims = reader.u32(&format!("dims of `{name}`"))?;
            if n_dims == 0 || n_dims > MAX_TENSOR_DIMS {
                return Err(invalid(
                    &format!("dims of tensor `{name}`"),
                    &format!("{n_dims} dimensions"),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(reader.u64(&format!("shape of `{name}`"))?);
            }
            let type_id = reader.u32(&format!("type of `{name}`"))?;
            let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| {
                invalid(
                    &format!("type of tensor `{name}`"),
                    &format!("unknown ggml type {type_id}"),
                )
            })?;
            let offset = reader.u64(&format!("offset of `{name}`"))?;
            raw_tensors.push((name, dims, ggml_type, offset));
        }

        let alignment = match metadata.get("general.alignment") {
            Some(value) => value
                .as_u64()
                .filter(|a| *a > 0 && a.is_power_of_two())
                .ok_or_else(|| invalid("general.alignment", &format!("{value:?} is not a power of two")))?,
            None => DEFAULT_ALIGNMENT,
        };
        let data_start = (reader.position() as u64).next_multiple_of(alignment);
        let file_len = bytes.len() as u64;
        let mut tensors = Vec::with_capacity(raw_tensors.len());
        for (name, dims, ggml_type, offset) in raw_tensors {
            let elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
            let elements = elements.ok_or_else(|| invalid(&format!("shape of tensor `{name}`"), "overflows"))?;
            let data_len = ggml_type.byte_len(elements).ok_or_else(|| {
                invalid(
                    &format!("shape of tensor `{name}`"),
                    &format!("{elements} elements is not a whole number of {ggml_type:?} blocks, or too many"),
                )
            })?;
            let data_offset = data_start
                .checked_add(offset)
                .ok_or_else(|| invalid(&format!("offset of tensor `{name}`"), "overflows"))?;
            if !offset.is_multiple_of(alignment) {
                return Err(invalid(
                    &format!("offset of tensor `{name}`"),
                    &format!("{offset} is not aligned to {alignment}"),
                ));
            }
            if data_offset.checked_add(data_len).is_none_or(|end| end > file_len) {
                return Err(GgufError::Truncated {
                    what: format!("data of tensor `{name}`"),
                    offset: data_offset,
                    needed: data_len,
                    len: file_len,
                });
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                data_offset,
                data_len,
            });
        }
        Ok(Self {
            version,
            metadata,
            tensors,
            bytes,
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw (possibly quantized) bytes of a tensor; bounds were checked at parse time.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.bytes[info.data_offset as usize..(info.data_offset + info.data_len) as usize]
    }

    /// Dequantizes a tensor to `f32`, in GGUF element order (row-major over [`TensorInfo::torch_shape`]).
    pub fn dequantize(&self, name: &str) -> Result<(TensorInfo, Vec<f32>), GgufError> {
        let info = self
            .tensor(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_owned()))?
            .clone();
        let values =
            crate::dequant::dequantize(info.ggml_type, self.tensor_bytes(&info), info.element_count() as usize)
                .map_err(|ggml_type| GgufError::UnsupportedType {
                    name: name.to_owned(),
                    ggml_type,
                    supported: crate::dequant::SUPPORTED_TYPES,
                })?;
        Ok((info, values))
    }

    pub fn get(&self, key: &str) -> Result<&MetadataValue, GgufError> {
        self.metadata
            .get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_owned()))
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let value = self.get(key)?;
        value.as_u64().ok_or(GgufError::WrongType {
            key: key.to_owned(),
            expected: "integer",
            actual: value.type_name(),
        })
    }

    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let value = self.get(key)?;
        value.as_f64().ok_or(GgufError::WrongType {
            key: key.to_owned(),
            expected: "number",
            actual: value.type_name(),
        })
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.get(key)? {
            MetadataValue::String(s) => Ok(s),
            other => Err(GgufError::WrongType {
                key: key.to_owned(),
                expected: "string",
                actual: other.type_name(),
            }),
        }
    }

    pub fn get_array(&self, key: &str) -> Result<&[MetadataValue], GgufError> {
        match self.get(key)? {
            MetadataValue::Array(items) => Ok(items),
            other => Err(GgufError::WrongType {
                key: key.to_owned(),
                expected: "array",
                actual: other.type_name(),
            }),
        }
    }

    /// A string array (e.g. `tokenizer.ggml.tokens`).
    pub fn get_string_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        self.get_array(key)?
            .iter()
            .map(|item| match item {
                MetadataValue::String(s) => Ok(s.as_str()),
                other => Err(GgufError::WrongType {
                    key: key.to_owned(),
                    expected: "string array",
                    actual: other.type_name(),
                }),
            })
            .collect()
    }
}

fn invalid(what: &str, detail: &str) -> GgufError {
    GgufError::Invalid {
        what: what.to_owned(),
        detail: detail.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal valid GGUF v3 file: one metadata string and one 2x2 F32 tensor.
    fn tiny_file() -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&1u64.to_le_bytes()); // tensors
        out.extend_from_slice(&1u64.to_le_bytes()); // metadata
        let key = b"general.name";
        out.extend_from_slice(&(key.len() as u64).to_le_bytes());
        out.extend_from_slice(key);
        out.extend_from_slice(&8u32.to_le_bytes());
        out.extend_from_slice(&4u64.to_le_bytes());
        out.extend_from_slice(b"tiny");
        let name = b"w";
        out.extend_from_slice(&(name.len() as u64).to_le_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(&2u32.to_le_bytes());
        out.extend_from_slice(&2u64.to_le_bytes());
        out.extend_from_slice(&2u64.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes()); // F32
        out.extend_from_slice(&0u64.to_le_bytes());
        while out.len() % 32 != 0 {
            out.push(0);
        }
        for v in [1.0f32, 2.0, 3.0, 4.0] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    #[test]
    fn parses_metadata_and_tensors() {
        let file = GgufFile::parse(tiny_file()).expect("parse");
        assert_eq!(file.get_str("general.name").expect("name"), "tiny");
        let (info, values) = file.dequantize("w").expect("dequantize");
        assert_eq!(info.torch_shape(), vec![2, 2]);
        assert_eq!(values, vec![1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let full = tiny_file();
        for len in 0..full.len() {
            let result = GgufFile::parse(full[..len].to_vec());
            assert!(result.is_err(), "a file cut at {len} bytes parsed");
        }
    }

    #[test]
    fn corrupt_counts_and_types_are_named() {
        let mut bad_count = tiny_file();
        bad_count[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        let err = GgufFile::parse(bad_count).expect_err("huge tensor count");
        assert!(err.to_string().contains("tensor count"), "{err}");

        let mut bad_magic = tiny_file();
        bad_magic[0] = b'X';
        assert!(matches!(GgufFile::parse(bad_magic), Err(GgufError::BadMagic(_))));

        let file = GgufFile::parse(tiny_file()).expect("parse");
        assert!(matches!(file.get_u64("general.name"), Err(GgufError::WrongType { .. })));
        assert!(matches!(file.dequantize("nope"), Err(GgufError::MissingTensor(_))));
    }

    #[test]
    fn a_tensor_whose_byte_length_overflows_is_refused() {
        // Found by the `gguf_parse` fuzz target: whole blocks × block bytes overflowed u64, so a
        // wrapped length passed the bounds check and dequantization then panicked.
        let input = include_bytes!("../tests/data/byte_len_overflow.gguf");
        assert!(GgufFile::parse(input.to_vec()).is_err());
    }
}
