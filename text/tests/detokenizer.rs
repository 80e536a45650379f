//! The byte path of incremental detokenization against the window path, on the default model's
//! tokenizer: the same delta after every token, for text, special tokens and tokens that split a
//! UTF-8 character.

use std::path::PathBuf;

use rivulet_text::detokenizer::IncrementalDetokenizer;
use rivulet_text::tokenizer::ModelTokenizer;

fn tokenizer() -> ModelTokenizer {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    ModelTokenizer::from_model_path(&model).expect("model file (scripts/setup.sh installs it)")
}

/// Pushes `ids` through both paths, asserting the same delta each time and the same tail.
fn assert_same_deltas(tokenizer: &ModelTokenizer, ids: &[u32]) -> String {
    let (mut bytes, mut window) = (IncrementalDetokenizer::default(), IncrementalDetokenizer::default());
    let mut text = String::new();
    for (at, &id) in ids.iter().enumerate() {
        let delta = bytes.push(tokenizer, id).expect("byte path");
        assert_eq!(
            delta,
            window.push_windowed(tokenizer, id).expect("window path"),
            "token {at} ({id}) of {ids:?}"
        );
        text += &delta;
    }
    let tail = bytes.flush(tokenizer).expect("flush");
    assert_eq!(tail, window.flush(tokenizer).expect("flush"), "tail of {ids:?}");
    text + &tail
}

#[test]
fn byte_path_emits_what_the_window_path_emits() {
    let tokenizer = tokenizer();
    assert!(
        tokenizer.byte_pieces().is_some(),
        "SmolLM2's decoder is byte-level alone"
    );
    for text in [
        "Hello, world! The year 2024 had 366 days; π ≈ 3.14159.",
        "Unicode: naïve café, 東京, Привет, مرحبا, 🙂🚀, e\u{301}",
        "<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|endoftext|>",
        "fn main() {\n    println!(\"{x:?}\");\n}\n",
    ] {
        let ids = tokenizer.encode(text).expect("encode");
        let decoded = assert_same_deltas(&tokenizer, &ids);
        assert_eq!(decoded, tokenizer.decode(&ids).expect("decode"));
    }
    // Random ids over the whole vocabulary (and past it): byte tokens that open, continue or
    // break UTF-8 characters, special tokens, unknown ids.
    let vocab = tokenizer.vocab_size();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..200 {
        let ids: Vec<u32> = (0..24)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let r = (state >> 33) as u32;
                // Half of them among the first 512 ids, where the single-byte tokens are.
                if r.is_multiple_of(2) {
                    r % 512
                } else {
                    r % (vocab + 8)
                }
            })
            .collect();
        assert_same_deltas(&tokenizer, &ids);
    }
}
