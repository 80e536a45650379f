//! Hyper-parameters of a Llama-family model, from GGUF metadata (`{arch}.*` keys, as llama.cpp
//! writes them).

use rivulet_gguf::GgufFile;

use crate::error::WorkerError;

/// Architectures whose tensors and forward pass are the Llama layout.
use rivulet_ipc::SUPPORTED_ARCHITECTURES as LLAMA_FAMILY;

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: String,
    pub name: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub context_length: usize,
}

impl ModelConfig {
    pub fn from_gguf(file: &GgufFile) -> Result<Self, WorkerError> {
        let architecture = file.get_str("general.architecture")?.to_owned();
        if !LLAMA_FAMILY.contains(&architecture.as_str()) {
            return Err(WorkerError::UnsupportedModel(
                architecture,
                format!("supported architectures: {}", LLAMA_FAMILY.join(", ")),
            ));
        }
        let key = |suffix: &str| format!("{architecture}.{suffix}");
        let hidden_size = file.get_u64(&key("embedding_length"))? as usize;
        let num_heads = file.get_u64(&key("attention.head_count"))? as usize;
        let num_kv_heads = match file.get_u64(&key("attention.head_count_kv")) {
            Ok(n) => n as usize,
            Err(_) => num_heads,
        };
        let vocab_size = file.get_array("tokenizer.ggml.tokens")?.len();
        let config = Self {
            name: file.get_str("general.name").unwrap_or("unnamed").to_owned(),
            vocab_size,
            hidden_size,
            intermediate_size: file.get_u64(&key("feed_forward_length"))? as usize,
            num_layers: file.get_u64(&key("block_count"))? as usize,
            num_heads,
            num_kv_heads,
            head_dim: match file.get_u64(&key("rope.dimension_count")) {
                Ok(d) => d as usize,
                Err(_) => hidden_size / num_heads.max(1),
            },
            rms_norm_eps: file.get_f64(&key("attention.layer_norm_rms_epsilon"))?,
            rope_theta: file.get_f64(&key("rope.freq_base")).unwrap_or(10_000.0),
            context_length: file.get_u64(&key("context_length"))? as usize,
            architecture,
        };
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), WorkerError> {
        let bad = |why: String| Err(WorkerError::UnsupportedModel(self.name.clone(), why));
        if self.num_heads == 0 || self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "{} heads cannot be grouped over {} KV heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim * self.num_heads != self.hidden_size || !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim {} × {} heads ≠ hidden size {}",
                self.head_dim, self.num_heads, self.hidden_size
            ));
        }
        if self.num_layers == 0 || self.vocab_size == 0 || self.context_length == 0 {
            return bad("zero layers, vocabulary or context".to_owned());
        }
        Ok(())
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}
