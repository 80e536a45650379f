//! The GGUF reader on arbitrary bytes: header, metadata, tensor table, and the dequantization of
//! every tensor it accepts (truncated blocks included). It may refuse; it must never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rivulet_gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    if let Ok(file) = GgufFile::parse(data.to_vec()) {
        let names: Vec<String> = file.tensors.iter().map(|t| t.name.clone()).collect();
        for name in names {
            let _ = file.dequantize(&name);
        }
    }
});
