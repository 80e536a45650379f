//! The CUDA path: the model in bf16 on the GPU gives the same greedy next tokens as f32 on the
//! CPU. Skipped (and says so) where no CUDA device exists.

use std::path::PathBuf;

use rivulet_gguf::GgufFile;
use rivulet_worker::attention::{AttentionPlan, SeqSlice};
use rivulet_worker::config::ModelConfig;
use rivulet_worker::device::compute_kind;
use rivulet_worker::kv_cache::KvCache;
use rivulet_worker::model::{ForwardInputs, LlamaModel};
use rivulet_worker::weights::ModelWeights;
use tch::{Device, Kind, Tensor};

/// Greedy next token after each prefix of `prompt` (one prefill, logits at every position).
fn next_tokens(file: &GgufFile, device: Device, prompt: &[i64]) -> Vec<i64> {
    let _guard = tch::no_grad_guard();
    let config = ModelConfig::from_gguf(file).expect("config");
    let kind = compute_kind(device);
    let weights = ModelWeights::load(file, &config, device, kind).expect("weights");
    let cache = KvCache::allocate(&config, 16, 64 << 20, 256, device, kind).expect("cache");
    let model = LlamaModel::new(config.clone(), weights, 256, device, kind);
    let n = prompt.len() as i64;
    let ids = Tensor::from_slice(prompt).to_device(device);
    let positions = Tensor::arange(n, (Kind::Int64, device));
    let tables = Tensor::arange(n.div_euclid(16) + 1, (Kind::Int64, device)).unsqueeze(0);
    let seqs = [SeqSlice {
        first_token: 0,
        num_tokens: n,
        context_len: n,
    }];
    let plan = AttentionPlan::new(&seqs, &tables, 16, config.head_dim, device);
    let rows = Tensor::arange(n, (Kind::Int64, device));
    let inputs = ForwardInputs {
        input_ids: &ids,
        positions: &positions,
        slot_mapping: &positions,
        attention: &plan,
        logit_rows: &rows,
    };
    Vec::<i64>::try_from(model.forward(&inputs, &cache).argmax(-1, false).to_device(Device::Cpu)).expect("tokens")
}

#[test]
fn bf16_on_cuda_agrees_with_f32_on_cpu() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device on this machine");
        return;
    }
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let file = GgufFile::open(&model).expect("model");
    let prompt: Vec<i64> = vec![504, 3575, 282, 4649, 314, 30, 1073, 281, 253, 1345, 28, 2640];
    let cpu = next_tokens(&file, Device::Cpu, &prompt);
    let gpu = next_tokens(&file, Device::Cuda(0), &prompt);
    let agree = cpu.iter().zip(&gpu).filter(|(a, b)| a == b).count();
    // bf16 rounding may flip a near-tie; most positions must agree.
    assert!(agree * 10 >= cpu.len() * 8, "cpu {cpu:?} vs cuda {gpu:?}");
}
