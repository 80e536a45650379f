//! How tokens show in a logprobs listing, on the default model's tokenizer: the pieces of a text
//! join into its bytes even where a character spans tokens, offsets count its characters, and
//! special tokens are listed by their written form.

use std::path::PathBuf;

use rivulet_text::token_piece::{CharOffsets, TokenPiece};
use rivulet_text::tokenizer::ModelTokenizer;

fn tokenizer() -> ModelTokenizer {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    ModelTokenizer::from_model_path(&model).expect("model file (scripts/setup.sh installs it)")
}

#[test]
fn pieces_join_into_the_text_and_offsets_count_its_characters() {
    let tokenizer = tokenizer();
    for text in ["Unicode: naïve café, 東京, こんにちは 🙂🚀!", "plain words, 12 digits"] {
        let ids = tokenizer.encode(text).expect("encode");
        let pieces: Vec<TokenPiece> = ids.iter().map(|&id| TokenPiece::of(&tokenizer, id)).collect();
        if text.is_ascii() {
            assert!(pieces.iter().all(|piece| piece.text.as_bytes() == piece.bytes));
        } else {
            assert!(
                pieces.iter().any(|piece| piece.text.contains('\u{FFFD}')),
                "no character of {text:?} spans tokens"
            );
        }
        assert_eq!(
            pieces.iter().flat_map(|piece| piece.bytes.clone()).collect::<Vec<u8>>(),
            text.as_bytes()
        );
        let mut offsets = CharOffsets::default();
        for piece in &pieces {
            let at = offsets.offset();
            // A whole token sits at its offset in the text.
            if !piece.text.contains('\u{FFFD}') {
                let rest: String = text.chars().skip(at).collect();
                assert!(rest.starts_with(&piece.text), "{:?} at {at} of {text:?}", piece.text);
            }
            offsets.push(&piece.text_bytes);
        }
        assert_eq!(offsets.offset(), text.chars().count());
    }
}

#[test]
fn special_tokens_are_listed_by_name_and_add_no_text() {
    let tokenizer = tokenizer();
    let ids = tokenizer.encode("<|im_end|>").expect("encode");
    assert_eq!(ids.len(), 1);
    let piece = TokenPiece::of(&tokenizer, ids[0]);
    assert_eq!(piece.text, "<|im_end|>");
    assert_eq!(piece.bytes, b"<|im_end|>");
    assert!(piece.text_bytes.is_empty());
}
