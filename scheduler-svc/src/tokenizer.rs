//! The model's tokenizer, built with the `tokenizers` crate from GGUF metadata
//! (`tokenizer.ggml.*`), so that token ids equal Hugging Face's for the same model.
//!
//! Supported: `gpt2`-style byte-level BPE (`tokenizer.ggml.model = "gpt2"`). The pre-tokenizer
//! follows `tokenizer.ggml.pre` the way llama.cpp maps it: `smollm` splits digits one by one before
//! the GPT-2 byte-level split; `gpt2`/`default` use the byte-level split alone.

use rivulet_gguf::{GgufError, GgufFile};
use serde_json::{json, Value};
use thiserror::Error;
use tokenizers::Tokenizer;

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

#[derive(Debug, Error)]
pub enum TokenizerError {
    #[error("model file: {0}")]
    Gguf(#[from] GgufError),
    #[error("tokenizer model `{0}` is not supported (supported: gpt2 byte-level BPE)")]
    UnsupportedModel(String),
    #[error("building the tokenizer: {0}")]
    Build(String),
    #[error("tokenizing: {0}")]
    Encode(String),
}

/// The model's tokenizer plus the facts the scheduler needs about it.
pub struct ModelTokenizer {
    inner: Tokenizer,
    vocab_size: u32,
}

impl ModelTokenizer {
    pub fn from_gguf(file: &GgufFile) -> Result<Self, TokenizerError> {
        let model = file.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.to_owned()));
        }
        let pre = file.get_str("tokenizer.ggml.pre").unwrap_or("default");
        let tokens = file.get_string_array("tokenizer.ggml.tokens")?;
        let merges = file.get_string_array("tokenizer.ggml.merges")?;
        let token_types: Vec<i64> = match file.get_array("tokenizer.ggml.token_type") {
            Ok(types) => types.iter().map(|t| t.as_u64().map_or(1, |v| v as i64)).collect(),
            Err(_) => vec![1; tokens.len()],
        };
        let spec = tokenizer_json(&tokens, &merges, &token_types, pre);
        let inner =
            Tokenizer::from_bytes(spec.to_string().as_bytes()).map_err(|e| TokenizerError::Build(e.to_string()))?;
        Ok(Self {
            inner,
            vocab_size: tokens.len() as u32,
        })
    }

    pub fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    /// Token ids of `text`; special tokens written in the text (e.g. `<|im_start|>`) are matched.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`, without control tokens (EOS and the like).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }
}

fn pre_tokenizer(pre: &str) -> Value {
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    match pre {
        "smollm" => json!({
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level]
        }),
        _ => byte_level,
    }
}

/// A `tokenizer.json` document equivalent to Hugging Face's for a GPT-2-style BPE vocabulary.
fn tokenizer_json(tokens: &[&str], merges: &[&str], token_types: &[i64], pre: &str) -> Value {
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(id, token)| ((*token).to_owned(), json!(id)))
        .collect();
    let added_tokens: Vec<Value> = tokens
        .iter()
        .zip(token_types)
        .enumerate()
        .filter(|(_, (_, &kind))| kind == TOKEN_TYPE_CONTROL || kind == TOKEN_TYPE_USER_DEFINED)
        .map(|(id, (token, &kind))| {
            json!({
                "id": id, "content": token, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": kind == TOKEN_TYPE_CONTROL
            })
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer(pre),
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges
        }
    })
}
