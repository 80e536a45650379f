//! The worker process's life: handshake, model load, KV allocation, warm-up, `Ready`, then one
//! `Step` at a time until `Shutdown` or until the scheduler goes away.

use std::path::PathBuf;
use std::time::Instant;

use ipc_channel::ipc::{self, IpcReceiver, IpcSender};
use rivulet_gguf::GgufFile;
use rivulet_ipc::{
    Bootstrap, LoadProgress, ModelInfo, ReadyInfo, StepBuffer, StepCapacity, WorkerCommand, WorkerEvent,
};
use tch::{Device, Kind, Tensor};

use crate::attention::{AttentionPlan, SeqSlice};
use crate::config::ModelConfig;
use crate::device::{compute_kind, describe, select_device};
use crate::error::WorkerError;
use crate::hf_folder;
use crate::kv_cache::KvCache;
use crate::memory::KvBudget;
use crate::model::{ForwardInputs, LlamaModel};
use crate::sampler::sample;
use crate::step::{self, StepLimits};
use crate::step_view::StepView;
use crate::weights::ModelWeights;

#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub model_path: PathBuf,
    pub device: String,
    pub kv_cache_memory: KvBudget,
    pub block_size: usize,
    /// Caps the model's own context length when set.
    pub max_model_len: Option<usize>,
    pub threads: Option<usize>,
    /// f16 weight copies for one-token steps on the CPU (see [`crate::half_gemv`]).
    pub half_precision_gemv: bool,
}

pub struct Worker {
    model: LlamaModel,
    kv_cache: KvCache,
    ready: ReadyInfo,
    step_buffer: Option<StepBuffer>,
}

impl Worker {
    pub fn load(options: &WorkerOptions, report: &mut dyn FnMut(LoadProgress)) -> Result<Self, WorkerError> {
        if let Some(threads) = options.threads {
            tch::set_num_threads(threads as i32);
        }
        let device = select_device(&options.device)?;
        let kind = compute_kind(device);
        let path = &options.model_path;
        let (config, weights, eos_token_ids) = if path.is_dir() {
            let config = hf_folder::read_config(path)?;
            let weights = hf_folder::load_weights(path, &config, device, kind)?;
            (config, weights, hf_folder::eos_token_ids(path))
        } else {
            let file = GgufFile::open(path)?;
            let config = ModelConfig::from_gguf(&file)?;
            let weights = ModelWeights::load_reporting(&file, &config, device, kind, report)?;
            let eos = eos_token_ids(&file);
            (config, weights, eos)
        };
        let max_model_len = options
            .max_model_len
            .map_or(config.context_length, |cap| cap.min(config.context_length));
        let kv_cache = KvCache::allocate(
            &config,
            options.block_size,
            options.kv_cache_memory.resolve(device)?,
            max_model_len,
            device,
            kind,
        )?;
        let ready = ReadyInfo {
            model: ModelInfo {
                architecture: config.architecture.clone(),
                name: config.name.clone(),
                vocab_size: config.vocab_size as u32,
                hidden_size: config.hidden_size as u32,
                num_layers: config.num_layers as u32,
                num_heads: config.num_heads as u32,
                num_kv_heads: config.num_kv_heads as u32,
                head_dim: config.head_dim as u32,
                context_length: config.context_length as u32,
            },
            num_blocks: kv_cache.num_blocks as u32,
            block_size: kv_cache.block_size as u32,
            max_model_len: max_model_len as u32,
            eos_token_ids,
            device: describe(device),
        };
        let mut model = LlamaModel::new(config, weights, max_model_len, device, kind);
        if device == Device::Cpu && kind == Kind::Float {
            // The f16 copies are made from the dense weights, so before those move to oneDNN.
            if options.half_precision_gemv {
                model.enable_half_precision_gemv()?;
            }
            if tch::utils::has_mkldnn() {
                model.use_onednn_projections()?;
            }
        }
        Ok(Self {
            model,
            kv_cache,
            ready,
            step_buffer: None,
        })
    }

    pub fn ready_info(&self) -> &ReadyInfo {
        &self.ready
    }

    /// One small prefill and one decode through block 0, so that the first real step does not pay
    /// for libtorch's lazy initialisation. Block 0's contents are overwritten by its next owner.
    pub fn warm_up(&self) -> Result<(), WorkerError> {
        let _guard = tch::no_grad_guard();
        let device = self.model.device;
        let block_size = self.kv_cache.block_size as i64;
        let table = Tensor::zeros([1, 1], (Kind::Int64, device));
        for (first, count) in [(0i64, 2i64), (2, 1)] {
            let ids = Tensor::zeros([count], (Kind::Int64, device));
            let positions = Tensor::arange_start(first, first + count, (Kind::Int64, device));
            let seqs = [SeqSlice {
                first_token: 0,
                num_tokens: count,
                context_len: first + count,
            }];
            let plan = AttentionPlan::new(&seqs, &table, block_size, self.model.config.head_dim, device);
            let rows = Tensor::from_slice(&[count - 1]).to_device(device);
            let inputs = ForwardInputs {
                input_ids: &ids,
                positions: &positions,
                slot_mapping: &positions,
                attention: &plan,
                logit_rows: &rows,
            };
            let logits = self.model.forward(&inputs, &self.kv_cache);
            let _ = logits.argmax(-1, false);
        }
        Ok(())
    }

    pub fn attach_step_buffer(&mut self, os_id: &str, capacity: StepCapacity) -> Result<(), WorkerError> {
        self.step_buffer = Some(StepBuffer::open(os_id, capacity)?);
        Ok(())
    }

    /// Runs step `step` from the step buffer and writes its sampled tokens back into it.
    pub fn run_step(&mut self, step: u64) -> Result<(), WorkerError> {
        let _guard = tch::no_grad_guard();
        let buffer = self
            .step_buffer
            .as_ref()
            .ok_or_else(|| WorkerError::InvalidStep("no step buffer attached".to_owned()))?;
        let header = buffer.header_for_step(step)?;
        let limits = StepLimits {
            vocab_size: self.ready.model.vocab_size as i64,
            max_model_len: self.ready.max_model_len as i64,
            block_size: self.kv_cache.block_size as i64,
            num_blocks: self.kv_cache.num_blocks as i64,
        };
        let host = step::validate(buffer, &header, limits)?;
        let mut view = StepView::wrap(buffer, &header, host.history_len)?;
        let device = self.model.device;
        let on_device = |t: &Tensor| -> Result<Tensor, WorkerError> { Ok(t.f_to_device(device)?) };
        let input_ids = on_device(&view.input_ids)?;
        let positions = on_device(&view.positions)?;
        let slot_mapping = on_device(&view.slot_mapping)?;
        let block_tables = on_device(&view.block_tables)?;
        let block_size = self.kv_cache.block_size as i64;
        let plan = AttentionPlan::new(
            &host.seqs,
            &block_tables,
            block_size,
            self.model.config.head_dim,
            device,
        );
        // A step of prompt chunks that all end mid-prompt fills the cache and samples nothing;
        // the head still needs one row.
        let logit_rows = if host.logit_rows.is_empty() {
            vec![0]
        } else {
            host.logit_rows.clone()
        };
        let rows = Tensor::f_from_slice(&logit_rows)?.f_to_device(device)?;
        let inputs = ForwardInputs {
            input_ids: &input_ids,
            positions: &positions,
            slot_mapping: &slot_mapping,
            attention: &plan,
            logit_rows: &rows,
        };
        let logits = self.model.forward(&inputs, &self.kv_cache);
        if host.sampled_seqs.is_empty() {
            return Ok(());
        }
        let batch = step::sampling_batch(buffer, &view, &host, device)?;
        let sampled = sample(&logits, &batch);
        step::write_outputs(&mut view, &host, &sampled)
    }
}

/// End-of-sequence ids from the GGUF tokenizer metadata (EOS, end-of-turn, end-of-message).
fn eos_token_ids(file: &GgufFile) -> Vec<u32> {
    let mut ids: Vec<u32> = [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ]
    .iter()
    .filter_map(|key| file.get_u64(key).ok())
    .map(|id| id as u32)
    .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Connects to the scheduler's one-shot server `server_name`, then serves until told to stop.
pub fn serve(options: &WorkerOptions, server_name: &str) -> Result<(), WorkerError> {
    let bootstrap: IpcSender<Bootstrap> =
        IpcSender::connect(server_name.to_owned()).map_err(|e| WorkerError::Ipc(e.to_string()))?;
    let (command_tx, commands) = ipc::channel::<WorkerCommand>().map_err(|e| WorkerError::Ipc(e.to_string()))?;
    let (events, event_rx) = ipc::channel::<WorkerEvent>().map_err(|e| WorkerError::Ipc(e.to_string()))?;
    bootstrap
        .send(Bootstrap {
            commands: command_tx,
            events: event_rx,
        })
        .map_err(|e| WorkerError::Ipc(e.to_string()))?;

    let started = Instant::now();
    let mut report = |progress| {
        // Progress is for show: a full channel or a gone scheduler shows up at `Ready`.
        let _ = events.send(WorkerEvent::LoadProgress(progress));
    };
    let mut worker = match Worker::load(options, &mut report).and_then(|w| w.warm_up().map(|()| w)) {
        Ok(worker) => worker,
        Err(error) => {
            let _ = events.send(WorkerEvent::Failed {
                message: error.to_string(),
                fatal: true,
            });
            return Err(error);
        }
    };
    tracing::info!(elapsed_ms = started.elapsed().as_millis() as u64, ready = ?worker.ready_info(), "worker ready");
    send(&events, WorkerEvent::Ready(worker.ready_info().clone()))?;
    command_loop(&mut worker, &commands, &events)
}

fn command_loop(
    worker: &mut Worker,
    commands: &IpcReceiver<WorkerCommand>,
    events: &IpcSender<WorkerEvent>,
) -> Result<(), WorkerError> {
    loop {
        let command = match commands.recv() {
            Ok(command) => command,
            // The scheduler is gone: nothing left to serve.
            Err(error) => {
                tracing::info!(%error, "command channel closed; exiting");
                return Ok(());
            }
        };
        match command {
            WorkerCommand::AttachStepBuffer { os_id, capacity } => match worker.attach_step_buffer(&os_id, capacity) {
                Ok(()) => send(events, WorkerEvent::StepBufferAttached)?,
                Err(error) => send(
                    events,
                    WorkerEvent::Failed {
                        message: error.to_string(),
                        fatal: false,
                    },
                )?,
            },
            WorkerCommand::Step { step } => {
                let started = Instant::now();
                // libtorch reports some failures by panicking through tch; turn them into a reply.
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker.run_step(step)))
                    .unwrap_or_else(|panic| Err(WorkerError::InvalidStep(panic_message(&panic))));
                let event = match result {
                    Ok(()) => WorkerEvent::StepDone {
                        step,
                        forward_micros: started.elapsed().as_micros() as u64,
                    },
                    Err(error) => {
                        tracing::warn!(step, %error, "step failed");
                        WorkerEvent::Failed {
                            message: error.to_string(),
                            fatal: false,
                        }
                    }
                };
                send(events, event)?;
            }
            WorkerCommand::Shutdown => return Ok(()),
        }
    }
}

fn send(events: &IpcSender<WorkerEvent>, event: WorkerEvent) -> Result<(), WorkerError> {
    events.send(event).map_err(|e| WorkerError::Ipc(e.to_string()))
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "libtorch panicked".to_owned())
}
