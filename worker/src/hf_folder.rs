//! Loading a Hugging Face model folder: `config.json` and `*.safetensors` (read with tch's
//! safetensors support), for Llama-family models.
//!
//! Hugging Face keeps Q and K rows in the "rotate half" layout; the model here applies the
//! interleaved rotary embedding that GGUF's layout needs, so the rows are permuted at load exactly
//! as llama.cpp's converter does (`permute` in `convert_hf_to_gguf.py`). Both files then run the
//! same forward pass.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;
use tch::{Device, Kind, Tensor};

use crate::config::ModelConfig;
use crate::error::WorkerError;
use crate::weights::{LayerWeights, ModelWeights};

fn unsupported(what: impl Into<String>) -> WorkerError {
    WorkerError::UnsupportedModel("Hugging Face folder".to_owned(), what.into())
}

fn read_json(path: &Path) -> Result<Value, WorkerError> {
    let text = std::fs::read_to_string(path).map_err(|e| unsupported(format!("{}: {e}", path.display())))?;
    serde_json::from_str(&text).map_err(|e| unsupported(format!("{}: {e}", path.display())))
}

fn number(config: &Value, key: &str) -> Result<u64, WorkerError> {
    config[key]
        .as_u64()
        .ok_or_else(|| unsupported(format!("config.json: `{key}` is missing or not a number")))
}

/// Hyper-parameters from `config.json`.
pub fn read_config(dir: &Path) -> Result<ModelConfig, WorkerError> {
    let config = read_json(&dir.join("config.json"))?;
    let architecture = config["architectures"][0].as_str().unwrap_or_default();
    if config["model_type"].as_str() != Some("llama") {
        return Err(unsupported(format!(
            "model_type {:?} ({architecture}); supported: llama",
            config["model_type"]
        )));
    }
    let rope_type = config["rope_parameters"]["rope_type"]
        .as_str()
        .or(config["rope_scaling"]["rope_type"].as_str());
    if rope_type.is_some_and(|kind| kind != "default") {
        return Err(unsupported(format!(
            "rope scaling {rope_type:?}; only unscaled rotary embeddings are supported"
        )));
    }
    let hidden_size = number(&config, "hidden_size")? as usize;
    let num_heads = number(&config, "num_attention_heads")? as usize;
    let model = ModelConfig {
        architecture: "llama".to_owned(),
        name: config["_name_or_path"].as_str().unwrap_or("hf-llama").to_owned(),
        vocab_size: number(&config, "vocab_size")? as usize,
        hidden_size,
        intermediate_size: number(&config, "intermediate_size")? as usize,
        num_layers: number(&config, "num_hidden_layers")? as usize,
        num_heads,
        num_kv_heads: config["num_key_value_heads"].as_u64().map_or(num_heads, |n| n as usize),
        head_dim: config["head_dim"]
            .as_u64()
            .map_or(hidden_size / num_heads.max(1), |n| n as usize),
        rms_norm_eps: config["rms_norm_eps"].as_f64().unwrap_or(1e-6),
        // Older configs have `rope_theta`; newer ones nest it in `rope_parameters`.
        rope_theta: config["rope_theta"]
            .as_f64()
            .or_else(|| config["rope_parameters"]["rope_theta"].as_f64())
            .unwrap_or(10_000.0),
        context_length: number(&config, "max_position_embeddings")? as usize,
    };
    model.validate()?;
    Ok(model)
}

/// End-of-sequence ids from `generation_config.json`, else `config.json` (a number or a list).
pub fn eos_token_ids(dir: &Path) -> Vec<u32> {
    let ids_of = |value: &Value| -> Vec<u32> {
        match value {
            Value::Number(n) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
            Value::Array(items) => items.iter().filter_map(Value::as_u64).map(|n| n as u32).collect(),
            _ => Vec::new(),
        }
    };
    for file in ["generation_config.json", "config.json"] {
        if let Ok(json) = read_json(&dir.join(file)) {
            let ids = ids_of(&json["eos_token_id"]);
            if !ids.is_empty() {
                return ids;
            }
        }
    }
    Vec::new()
}

/// llama.cpp's Q/K row permutation: rotate-half pairs → adjacent pairs.
fn permute_rotary_rows(weight: &Tensor, heads: i64) -> Result<Tensor, WorkerError> {
    let (rows, cols) = weight.size2()?;
    Ok(weight
        .f_reshape([heads, 2, rows / heads / 2, cols])?
        .f_transpose(1, 2)?
        .f_reshape([rows, cols])?)
}

pub fn load_weights(dir: &Path, config: &ModelConfig, device: Device, kind: Kind) -> Result<ModelWeights, WorkerError> {
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| unsupported(format!("{}: {e}", dir.display())))?
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(unsupported(format!("no *.safetensors in {}", dir.display())));
    }
    for file in files {
        tensors.extend(Tensor::read_safetensors(&file)?);
    }
    let mut take = |name: &str, shape: &[i64]| -> Result<Tensor, WorkerError> {
        let tensor = tensors
            .remove(name)
            .ok_or_else(|| unsupported(format!("tensor `{name}` is missing")))?;
        if tensor.size() != shape {
            return Err(unsupported(format!(
                "tensor `{name}` has shape {:?}, expected {shape:?}",
                tensor.size()
            )));
        }
        Ok(tensor.f_to_kind(kind)?.f_to_device(device)?)
    };
    let hidden = config.hidden_size as i64;
    let q_dim = (config.num_heads * config.head_dim) as i64;
    let kv_dim = config.kv_dim() as i64;
    let ffn = config.intermediate_size as i64;
    let vocab = config.vocab_size as i64;
    let token_embedding = take("model.embed_tokens.weight", &[vocab, hidden])?;
    let mut layers = Vec::with_capacity(config.num_layers);
    for i in 0..config.num_layers {
        let name = |t: &str| format!("model.layers.{i}.{t}.weight");
        let q = permute_rotary_rows(
            &take(&name("self_attn.q_proj"), &[q_dim, hidden])?,
            config.num_heads as i64,
        )?;
        let k = permute_rotary_rows(
            &take(&name("self_attn.k_proj"), &[kv_dim, hidden])?,
            config.num_kv_heads as i64,
        )?;
        let v = take(&name("self_attn.v_proj"), &[kv_dim, hidden])?;
        let gate = take(&name("mlp.gate_proj"), &[ffn, hidden])?;
        let up = take(&name("mlp.up_proj"), &[ffn, hidden])?;
        layers.push(LayerWeights {
            attn_norm: take(&name("input_layernorm"), &[hidden])?,
            qkv_proj: Tensor::f_cat(&[q, k, v], 0)?,
            o_proj: take(&name("self_attn.o_proj"), &[hidden, q_dim])?,
            ffn_norm: take(&name("post_attention_layernorm"), &[hidden])?,
            gate_up_proj: Tensor::f_cat(&[gate, up], 0)?,
            down_proj: take(&name("mlp.down_proj"), &[hidden, ffn])?,
        });
    }
    let output_norm = take("model.norm.weight", &[hidden])?;
    let lm_head = match take("lm_head.weight", &[vocab, hidden]) {
        Ok(head) => head,
        Err(_) => token_embedding.shallow_clone(),
    };
    Ok(ModelWeights {
        token_embedding,
        layers,
        output_norm,
        lm_head,
    })
}
