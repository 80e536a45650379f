//! Dequantization of the real model file against the `gguf` Python package's own dequantizer,
//! for one tensor of every type the default model uses.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use rivulet_gguf::{GgmlType, GgufFile};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs the reference script with `request` (the model path is added) and parses its answer.
fn reference(mut request: serde_json::Value) -> serde_json::Value {
    request["model"] = serde_json::Value::String(
        root()
            .join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
            .display()
            .to_string(),
    );
    let mut child = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("tests/python/hf_reference.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python (scripts/setup.sh --test installs it)");
    {
        use std::io::Write;
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(request.to_string().as_bytes())
            .expect("write");
    }
    let output = child.wait_with_output().expect("reference");
    assert!(output.status.success());
    serde_json::from_slice(&output.stdout).expect("json")
}

fn read_f32(path: &std::path::Path) -> Vec<f32> {
    let bytes = std::fs::read(path).expect("reference values");
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Random blocks whose f16 scale fields hold ordinary values (random bytes could be NaN).
fn random_blocks(ggml_type: GgmlType, blocks: usize, state: &mut u64) -> Vec<u8> {
    let mut next = || {
        *state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*state >> 33) as u32
    };
    let (_, block_bytes) = ggml_type.block_layout();
    let mut data: Vec<u8> = (0..blocks * block_bytes as usize).map(|_| next() as u8).collect();
    let scale_offsets: &[usize] = match ggml_type {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[],
    };
    for block in data.chunks_exact_mut(block_bytes as usize) {
        if ggml_type == GgmlType::BF16 {
            let value = (next() % 2000) as f32 / 250.0 - 4.0;
            block.copy_from_slice(&half::bf16::from_f32(value).to_le_bytes());
        }
        for &offset in scale_offsets {
            let value = (next() % 1000) as f32 / 10_000.0 - 0.05;
            block[offset..offset + 2].copy_from_slice(&half::f16::from_f32(value).to_le_bytes());
        }
    }
    data
}

#[test]
fn generated_blocks_of_every_supported_type_match_the_gguf_package() {
    let dir = std::env::temp_dir().join(format!("rivulet-dequant-raw-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut state = 7u64;
    let types = [
        (GgmlType::BF16, "BF16"),
        (GgmlType::Q4_0, "Q4_0"),
        (GgmlType::Q4_1, "Q4_1"),
        (GgmlType::Q5_0, "Q5_0"),
        (GgmlType::Q5_1, "Q5_1"),
        (GgmlType::Q8_0, "Q8_0"),
        (GgmlType::Q4K, "Q4_K"),
        (GgmlType::Q5K, "Q5_K"),
        (GgmlType::Q6K, "Q6_K"),
    ];
    for (ggml_type, name) in types {
        let blocks = 48;
        let data = random_blocks(ggml_type, blocks, &mut state);
        let (block_elements, _) = ggml_type.block_layout();
        let elements = blocks * block_elements as usize;
        let ours = rivulet_gguf::dequantize(ggml_type, &data, elements).expect("supported");
        let raw = dir.join(format!("{name}.raw"));
        let out = dir.join(format!("{name}.f32"));
        std::fs::write(&raw, &data).expect("write blocks");
        reference(serde_json::json!({
            "task": "dequantize_raw", "type": name, "path": raw.display().to_string(), "out": out.display().to_string()
        }));
        let expected = read_f32(&out);
        assert_eq!(ours.len(), expected.len(), "{name}");
        for (i, (a, b)) in ours.iter().zip(&expected).enumerate() {
            // Same f32 arithmetic up to operation order.
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "{name} element {i}: {a} vs {b}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn every_tensor_type_of_the_default_model_matches_the_gguf_package() {
    let model = root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let file = GgufFile::open(&model).expect("model file (scripts/setup.sh installs it)");
    let mut chosen = Vec::new();
    for wanted in [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4_1] {
        let tensor = file.tensors.iter().find(|t| t.ggml_type == wanted);
        let tensor = tensor.unwrap_or_else(|| panic!("the default model has a {wanted:?} tensor"));
        chosen.push(tensor.name.clone());
    }
    let out_dir = std::env::temp_dir().join(format!("rivulet-dequant-{}", std::process::id()));
    std::fs::create_dir_all(&out_dir).expect("temp dir");
    let answer = reference(serde_json::json!({
        "task": "dequantize", "tensors": chosen, "out_dir": out_dir.display().to_string()
    }));

    for expected_tensor in answer["tensors"].as_array().expect("tensors") {
        let name = expected_tensor["name"].as_str().expect("name");
        let expected = read_f32(std::path::Path::new(expected_tensor["path"].as_str().expect("path")));
        let (info, ours) = file.dequantize(name).expect("dequantize");
        let shape: Vec<i64> = serde_json::from_value(expected_tensor["shape"].clone()).expect("shape");
        assert_eq!(info.torch_shape(), shape, "shape of {name}");
        assert_eq!(ours.len(), expected.len(), "{name}");
        let worst = ours
            .iter()
            .zip(&expected)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        // Both compute in f32 from the same f16 scales; allow only rounding-order differences.
        assert!(
            worst <= 1e-6,
            "{name} ({:?}): max abs difference {worst}",
            info.ggml_type
        );
    }
    let _ = std::fs::remove_dir_all(out_dir);
}
