//! Loading a Llama-family model's tensors from GGUF into libtorch, dequantized at load time.
//!
//! Tensor names are llama.cpp's (`blk.N.attn_q.weight`, …). llama.cpp's converter permutes the
//! rows of Q and K so that rotary embedding pairs adjacent dimensions (its "NORM" rope); we keep
//! that layout and apply the matching interleaved rotary embedding ([`crate::rope`]), which gives
//! the same attention scores as Hugging Face's rotate-half on the unpermuted weights.

use std::cell::{Cell, RefCell};

use rivulet_gguf::GgufFile;
use rivulet_ipc::LoadProgress;
use tch::{Device, Kind, Tensor};

use crate::config::ModelConfig;
use crate::error::WorkerError;

pub struct LayerWeights {
    pub attn_norm: Tensor,
    /// Q, K and V projections stacked: `[q_dim + 2 * kv_dim, hidden]`, one matmul per layer.
    pub qkv_proj: Tensor,
    pub o_proj: Tensor,
    pub ffn_norm: Tensor,
    /// Gate and up projections stacked: `[2 * intermediate, hidden]`.
    pub gate_up_proj: Tensor,
    pub down_proj: Tensor,
}

pub struct ModelWeights {
    pub token_embedding: Tensor,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Tensor,
    /// The output head; the token embedding itself when the model ties them.
    pub lm_head: Tensor,
}

struct Loader<'a> {
    file: &'a GgufFile,
    device: Device,
    kind: Kind,
    progress: Cell<LoadProgress>,
    /// Told every few percent and at the end.
    report: RefCell<&'a mut dyn FnMut(LoadProgress)>,
}

impl Loader<'_> {
    fn load(&self, name: &str, expected: &[i64]) -> Result<Tensor, WorkerError> {
        let (info, values) = self.file.dequantize(name)?;
        let shape = info.torch_shape();
        if shape != expected {
            return Err(WorkerError::UnsupportedModel(
                name.to_owned(),
                format!("shape {shape:?}, expected {expected:?}"),
            ));
        }
        let tensor = Tensor::f_from_slice(&values)?.f_reshape(&shape)?;
        let tensor = tensor.f_to_kind(self.kind)?.f_to_device(self.device)?;
        self.loaded(info.data_len);
        Ok(tensor)
    }

    fn loaded(&self, bytes: u64) {
        let mut progress = self.progress.get();
        let before = progress.percent();
        progress.tensors_loaded += 1;
        progress.bytes_loaded += bytes;
        self.progress.set(progress);
        // The last report comes from `load_reporting` once every tensor is in.
        if progress.percent() / 5 != before / 5 {
            (self.report.borrow_mut())(progress);
        }
    }
}

impl ModelWeights {
    pub fn load(file: &GgufFile, config: &ModelConfig, device: Device, kind: Kind) -> Result<Self, WorkerError> {
        Self::load_reporting(file, config, device, kind, &mut |_| {})
    }

    /// Loads, telling `report` how far it got every 5% of the bytes.
    pub fn load_reporting(
        file: &GgufFile,
        config: &ModelConfig,
        device: Device,
        kind: Kind,
        report: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self, WorkerError> {
        let total = LoadProgress {
            tensors_total: file.tensors.len() as u32,
            bytes_total: file.tensors.iter().map(|t| t.data_len).sum(),
            ..LoadProgress::default()
        };
        let loader = Loader {
            file,
            device,
            kind,
            progress: Cell::new(total),
            report: RefCell::new(report),
        };
        let hidden = config.hidden_size as i64;
        let q_dim = (config.num_heads * config.head_dim) as i64;
        let kv_dim = config.kv_dim() as i64;
        let ffn = config.intermediate_size as i64;
        let vocab = config.vocab_size as i64;

        let token_embedding = loader.load("token_embd.weight", &[vocab, hidden])?;
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let name = |t: &str| format!("blk.{i}.{t}.weight");
            let q = loader.load(&name("attn_q"), &[q_dim, hidden])?;
            let k = loader.load(&name("attn_k"), &[kv_dim, hidden])?;
            let v = loader.load(&name("attn_v"), &[kv_dim, hidden])?;
            let gate = loader.load(&name("ffn_gate"), &[ffn, hidden])?;
            let up = loader.load(&name("ffn_up"), &[ffn, hidden])?;
            layers.push(LayerWeights {
                attn_norm: loader.load(&name("attn_norm"), &[hidden])?,
                qkv_proj: Tensor::f_cat(&[q, k, v], 0)?,
                o_proj: loader.load(&name("attn_output"), &[hidden, q_dim])?,
                ffn_norm: loader.load(&name("ffn_norm"), &[hidden])?,
                gate_up_proj: Tensor::f_cat(&[gate, up], 0)?,
                down_proj: loader.load(&name("ffn_down"), &[hidden, ffn])?,
            });
        }
        let output_norm = loader.load("output_norm.weight", &[hidden])?;
        let lm_head = match file.tensor("output.weight") {
            Some(_) => loader.load("output.weight", &[vocab, hidden])?,
            None => token_embedding.shallow_clone(),
        };
        // The file may hold tensors the model does not use (e.g. `rope_freqs`): what was loaded
        // is the whole.
        let mut done = loader.progress.get();
        done.tensors_total = done.tensors_loaded;
        done.bytes_total = done.bytes_loaded;
        (loader.report.borrow_mut())(done);
        Ok(Self {
            token_embedding,
            layers,
            output_norm,
            lm_head,
        })
    }
}
