//! Our tokenizer (built from GGUF metadata) against Hugging Face's tokenizer for the same model
//! file, on a varied corpus.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use rivulet_gguf::GgufFile;
use rivulet_text::tokenizer::ModelTokenizer;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn corpus() -> Vec<String> {
    vec![
        "Hello, world!".to_owned(),
        "The year 2024 had 366 days; π ≈ 3.14159.".to_owned(),
        "fn main() {\n    let x: Vec<u32> = (0..10).collect();\n\tprintln!(\"{x:?}\");\n}\n".to_owned(),
        "def f(a, b):\n        return a ** 2 + b  # comment\n\n\n".to_owned(),
        "   leading spaces, trailing spaces   ".to_owned(),
        "multiple     spaces\tand\ttabs\r\nand CRLF".to_owned(),
        "Unicode: naïve café, 東京, Привет, مرحبا, 🙂🚀, e\u{301}".to_owned(),
        "<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n".to_owned(),
        "<|endoftext|>special tokens inside text<|im_end|>".to_owned(),
        "1234567890 0.5 -17 1e10 ١٢٣".to_owned(),
        "URLs: https://example.com/path?q=1&r=2#frag".to_owned(),
        "don't won't it's I'm you're we've they'll".to_owned(),
        "UPPER lower MiXeD CamelCaseIdentifier snake_case_name".to_owned(),
        String::new(),
        " ".to_owned(),
        "\n\n\n".to_owned(),
    ]
}

#[test]
fn token_ids_equal_hugging_face_on_a_varied_corpus() {
    let model = root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let file = GgufFile::open(&model).expect("model file (scripts/setup.sh installs it)");
    let tokenizer = ModelTokenizer::from_gguf(&file).expect("tokenizer");
    let texts = corpus();

    let request = serde_json::json!({"task": "tokenize", "model": model.display().to_string(), "texts": texts});
    let mut child = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("tests/python/hf_reference.py"))
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_VERBOSITY", "error")
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
    let expected: Vec<Vec<u32>> = serde_json::from_value(answer["ids"].clone()).expect("ids");

    for (text, expected) in texts.iter().zip(expected) {
        let ours = tokenizer.encode(text).expect("encode");
        assert_eq!(ours, expected, "token ids for {text:?}");
        // Decoding gives the text back (special tokens are skipped on decode).
        if !text.contains("<|") {
            assert_eq!(&tokenizer.decode(&ours).expect("decode"), text);
        }
    }
}
