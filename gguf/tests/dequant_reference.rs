//! Dequantization of the real model file against the `gguf` Python package's own dequantizer,
//! for one tensor of every type the default model uses.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use rivulet_gguf::{GgmlType, GgufFile};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
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
    let request = serde_json::json!({
        "task": "dequantize", "model": model.display().to_string(), "tensors": chosen, "out_dir": out_dir.display().to_string()
    });
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
    let answer: serde_json::Value = serde_json::from_slice(&output.stdout).expect("json");

    for reference in answer["tensors"].as_array().expect("tensors") {
        let name = reference["name"].as_str().expect("name");
        let bytes = std::fs::read(reference["path"].as_str().expect("path")).expect("reference values");
        let expected: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let (info, ours) = file.dequantize(name).expect("dequantize");
        let shape: Vec<i64> = serde_json::from_value(reference["shape"].clone()).expect("shape");
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
