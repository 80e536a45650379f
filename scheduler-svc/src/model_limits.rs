//! What request validation needs to know about the served model, read by the scheduler itself
//! from the model file so that it can validate before any worker is ready (workers may attach
//! later). Every worker's `Ready` is checked against it.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use rivulet_gguf::{GgufError, GgufFile};
use rivulet_ipc::SUPPORTED_ARCHITECTURES;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelLimitsError {
    #[error("model file: {0}")]
    Gguf(#[from] GgufError),
    #[error("{path}: {problem}")]
    HfConfig { path: String, problem: String },
    #[error("the model's architecture `{0}` is not supported (supported: {supported})", supported = SUPPORTED_ARCHITECTURES.join(", "))]
    UnsupportedArchitecture(String),
    #[error("model.max_model_len: {cap} tokens is more than the model's context of {context} tokens")]
    CapPastContext { cap: u32, context: u32 },
}

#[derive(Debug)]
pub struct ModelLimits {
    pub vocab_size: u32,
    /// The model's context length, capped by `model.max_model_len`.
    pub max_model_len: u32,
    /// Tokens the largest KV cache among the live replicas holds (0: none seen yet).
    kv_capacity_tokens: AtomicUsize,
}

impl ModelLimits {
    pub fn read(model: &Path, vocab_size: u32, cap: Option<u32>) -> Result<Self, ModelLimitsError> {
        let supported = |architecture: &str| {
            if SUPPORTED_ARCHITECTURES.contains(&architecture) {
                Ok(())
            } else {
                Err(ModelLimitsError::UnsupportedArchitecture(architecture.to_owned()))
            }
        };
        let context_length = if model.is_dir() {
            let (model_type, context_length) = hf_config(model)?;
            supported(&model_type)?;
            context_length
        } else {
            let file = GgufFile::open(model)?;
            let architecture = file.get_str("general.architecture")?;
            supported(architecture)?;
            file.get_u64(&format!("{architecture}.context_length"))? as u32
        };
        // As vLLM refuses it: positions past the model's training were never learned.
        if let Some(cap) = cap.filter(|&cap| cap > context_length) {
            return Err(ModelLimitsError::CapPastContext {
                cap,
                context: context_length,
            });
        }
        Ok(Self::new(vocab_size, cap.unwrap_or(context_length)))
    }

    pub fn new(vocab_size: u32, max_model_len: u32) -> Self {
        Self {
            vocab_size,
            max_model_len,
            kv_capacity_tokens: AtomicUsize::new(0),
        }
    }

    /// The largest KV cache (in tokens) of the live replicas, if one was seen.
    pub fn kv_capacity_tokens(&self) -> Option<usize> {
        Some(self.kv_capacity_tokens.load(Ordering::Acquire)).filter(|&tokens| tokens > 0)
    }

    pub fn set_kv_capacity(&self, tokens: usize) {
        self.kv_capacity_tokens.store(tokens, Ordering::Release);
    }
}

/// (`model_type`, `max_position_embeddings`) of a Hugging Face folder.
fn hf_config(dir: &Path) -> Result<(String, u32), ModelLimitsError> {
    let path = dir.join("config.json");
    let problem = |problem: String| ModelLimitsError::HfConfig {
        path: path.display().to_string(),
        problem,
    };
    let text = std::fs::read_to_string(&path).map_err(|e| problem(e.to_string()))?;
    let config: serde_json::Value = serde_json::from_str(&text).map_err(|e| problem(e.to_string()))?;
    let model_type = config["model_type"].as_str().unwrap_or_default().to_owned();
    let context_length = config["max_position_embeddings"]
        .as_u64()
        .map(|n| n as u32)
        .ok_or_else(|| problem("no max_position_embeddings".to_owned()))?;
    Ok((model_type, context_length))
}
