//! The model's tokenizer, built with the `tokenizers` crate from GGUF metadata
//! (`tokenizer.ggml.*`), so that token ids equal Hugging Face's for the same model.
//!
//! Supported: `gpt2`-style byte-level BPE (`tokenizer.ggml.model = "gpt2"`). The pre-tokenizer
//! follows `tokenizer.ggml.pre` the way llama.cpp maps it: `smollm` splits digits one by one before
//! the GPT-2 byte-level split; `gpt2`/`default` use the byte-level split alone.

use std::path::Path;
use std::sync::OnceLock;

use rivulet_gguf::{GgufError, GgufFile};
use serde_json::{json, Value};
use thiserror::Error;
use tokenizers::Tokenizer;

use crate::byte_pieces::BytePieces;
use crate::chat_template::{ChatTemplate, ChatTemplateError};

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
    #[error("chat template: {0}")]
    ChatTemplate(#[from] ChatTemplateError),
}

/// The model's tokenizer plus the facts the scheduler needs about it.
pub struct ModelTokenizer {
    inner: Tokenizer,
    vocab_size: u32,
    chat_template: Option<ChatTemplate>,
    /// Built on first use (see [`Self::byte_pieces`]).
    byte_pieces: OnceLock<Option<BytePieces>>,
}

impl ModelTokenizer {
    /// From a GGUF file, or from a Hugging Face model folder (`tokenizer.json`,
    /// `tokenizer_config.json`).
    pub fn from_model_path(path: &Path) -> Result<Self, TokenizerError> {
        if path.is_dir() {
            Self::from_hf_folder(path)
        } else {
            Self::from_gguf(&GgufFile::open(path)?)
        }
    }

    pub fn from_hf_folder(dir: &Path) -> Result<Self, TokenizerError> {
        let inner = Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| TokenizerError::Build(format!("{}: {e}", dir.join("tokenizer.json").display())))?;
        let vocab_size = inner.get_vocab_size(true) as u32;
        let config: Value = match std::fs::read_to_string(dir.join("tokenizer_config.json")) {
            Ok(text) => {
                serde_json::from_str(&text).map_err(|e| TokenizerError::Build(format!("tokenizer_config.json: {e}")))?
            }
            Err(_) => Value::Null,
        };
        let token_text = |key: &str| match &config[key] {
            Value::String(text) => text.clone(),
            Value::Object(token) => token
                .get("content")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            _ => String::new(),
        };
        // Newer tokenizers keep the template in `chat_template.jinja`, older ones in the config.
        let template_file = std::fs::read_to_string(dir.join("chat_template.jinja")).ok();
        let template = template_file.or_else(|| match &config["chat_template"] {
            Value::String(template) => Some(template.clone()),
            // A list of named templates: the default one.
            Value::Array(named) => named
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .map(str::to_owned),
            _ => None,
        });
        let chat_template = template
            .map(|source| ChatTemplate::new(source, token_text("bos_token"), token_text("eos_token")))
            .transpose()?;
        Ok(Self {
            inner,
            vocab_size,
            chat_template,
            byte_pieces: OnceLock::new(),
        })
    }

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
        let token_text = |key: &str| {
            let id = file.get_u64(key).ok()? as usize;
            tokens.get(id).map(|t| (*t).to_owned())
        };
        let chat_template = match file.get_str("tokenizer.chat_template") {
            Ok(source) => Some(ChatTemplate::new(
                source.to_owned(),
                token_text("tokenizer.ggml.bos_token_id").unwrap_or_default(),
                token_text("tokenizer.ggml.eos_token_id").unwrap_or_default(),
            )?),
            Err(_) => None,
        };
        Ok(Self {
            inner,
            vocab_size: tokens.len() as u32,
            chat_template,
            byte_pieces: OnceLock::new(),
        })
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
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

    /// Each token's bytes, where the decoder is byte-level alone (see [`BytePieces`]); built on
    /// the first call (a decode of every token: call it once before serving).
    pub fn byte_pieces(&self) -> Option<&BytePieces> {
        self.byte_pieces.get_or_init(|| BytePieces::build(&self.inner)).as_ref()
    }

    /// Text of `ids`, without control tokens (EOS and the like).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// The vocabulary's own string for `id` (byte-level tokens as the tokenizer stores them,
    /// `Ġworld`), as Hugging Face's `convert_ids_to_tokens` gives it; `None` outside the vocabulary.
    pub fn token_string(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Text of `ids` with control tokens written out (`<|im_end|>`), for listings of tokens.
    pub fn decode_with_special(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, false)
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
