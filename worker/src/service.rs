//! The worker process's life: handshake, model load, KV allocation, warm-up, `Ready`, then one
//! `Step` at a time until `Shutdown` or until the scheduler goes away.

use std::path::PathBuf;
use std::time::Instant;

use ipc_channel::ipc::{self, IpcReceiver, IpcSender};
use rivulet_gguf::GgufFile;
use rivulet_ipc::{
    Bootstrap, LoadProgress, ModelInfo, ReadyInfo, SeqSampling, StepBuffer, StepCapacity, WorkerCommand, WorkerEvent,
};
use tch::{Device, Kind, Tensor};

use crate::attention::{AttentionPlan, SeqSlice};
use crate::config::ModelConfig;
use crate::cpu_model::{CpuModel, CpuWeights, HostStepInputs};
use crate::decode_graphs::{self, DecodeGraphs};
use crate::device::{compute_kind, describe, select_device};
use crate::error::{panic_message, WorkerError};
use crate::hf_folder;
use crate::kernel_sampling::{sample_rows, LogitBiasRow, RowRequest};
use crate::kv_cache::{HostKvCache, KvCache};
use crate::memory::KvBudget;
use crate::model::{ForwardInputs, LlamaModel};
use crate::prompt_logprobs;
use crate::sampler::sample;
use crate::step::{self, HostStep, StepLimits};
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
    /// f16 weight copies for one-token steps on the CPU (see [`crate::half_gemv`]); a libtorch
    /// feature, so it selects the libtorch engine on the CPU.
    pub half_precision_gemv: bool,
    /// On the CPU, run libtorch's forward pass instead of Rivulet's kernels (for comparison).
    pub libtorch_cpu: bool,
    /// CPU kernels: keep a copy of the weights arranged for steps of 9+ tokens
    /// ([`CpuWeights::add_panels`]).
    pub batch_weight_copy: bool,
    /// CUDA: decode steps through captured graphs ([`crate::decode_graphs`]).
    pub cuda_graphs: bool,
}

/// What runs the forward pass.
enum Engine {
    /// Rivulet's CPU kernels over the weights in their GGUF blocks ([`crate::cpu_model`]).
    Kernels { model: CpuModel, kv_cache: HostKvCache },
    /// libtorch: CUDA, or the CPU when asked; on CUDA, decode steps through graphs when enabled.
    Torch {
        model: LlamaModel,
        kv_cache: KvCache,
        graphs: Option<DecodeGraphs>,
    },
}

pub struct Worker {
    engine: Engine,
    ready: ReadyInfo,
    step_buffer: Option<StepBuffer>,
}

impl Worker {
    pub fn load(options: &WorkerOptions, report: &mut dyn FnMut(LoadProgress)) -> Result<Self, WorkerError> {
        let device = select_device(&options.device)?;
        let kernels = device == Device::Cpu && !options.half_precision_gemv && !options.libtorch_cpu;
        let threads = options
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        if kernels {
            // The kernels have their own threads, which sleep when idle; libtorch only samples,
            // on one thread, so that no OpenMP thread spins beside them.
            tch::set_num_threads(1);
        } else if let Some(threads) = options.threads {
            tch::set_num_threads(threads as i32);
        }
        let kind = compute_kind(device);
        let path = &options.model_path;
        let (config, weights, eos_token_ids) = if path.is_dir() {
            let config = hf_folder::read_config(path)?;
            let tensors = hf_folder::load_weights(path, &config, device, kind)?;
            let weights = if kernels {
                LoadedWeights::Kernels(CpuWeights::from_tensors(&tensors)?)
            } else {
                LoadedWeights::Torch(tensors)
            };
            (config, weights, hf_folder::eos_token_ids(path))
        } else {
            let file = GgufFile::open(path)?;
            let config = ModelConfig::from_gguf(&file)?;
            let weights = if kernels {
                let weights = CpuWeights::from_gguf(&file, &config)?;
                let bytes: u64 = file.tensors.iter().map(|t| t.data_len).sum();
                report(LoadProgress {
                    tensors_total: file.tensors.len() as u32,
                    tensors_loaded: file.tensors.len() as u32,
                    bytes_total: bytes,
                    bytes_loaded: bytes,
                });
                LoadedWeights::Kernels(weights)
            } else {
                LoadedWeights::Torch(ModelWeights::load_reporting(&file, &config, device, kind, report)?)
            };
            let eos = eos_token_ids(&file);
            (config, weights, eos)
        };
        let max_model_len = options
            .max_model_len
            .map_or(config.context_length, |cap| cap.min(config.context_length));
        let kv_memory = options.kv_cache_memory.resolve(device)?;
        let block_size = options.block_size;
        let engine = match weights {
            LoadedWeights::Kernels(mut weights) => {
                if options.batch_weight_copy {
                    let blocks = weights.resident_bytes();
                    let resident = weights.add_panels();
                    tracing::info!(
                        blocks_mb = blocks >> 20,
                        with_panels_mb = resident >> 20,
                        "weights arranged by panels (worker.batch_weight_copy)"
                    );
                }
                Engine::Kernels {
                    kv_cache: HostKvCache::allocate(&config, block_size, kv_memory, max_model_len)?,
                    model: CpuModel::new(config.clone(), weights, max_model_len, threads)?,
                }
            }
            LoadedWeights::Torch(weights) => {
                let mut kv_cache = KvCache::allocate(&config, block_size, kv_memory, max_model_len, device, kind)?;
                // The graphs' padding rows need a block of their own, taken from the scheduler's.
                let graphs = if options.cuda_graphs && device.is_cuda() && crate::cuda_graph::supported() {
                    kv_cache
                        .reserve_block(max_model_len)
                        .and_then(|scratch| DecodeGraphs::new(device, block_size, scratch))
                } else {
                    None
                };
                let mut model = LlamaModel::new(config.clone(), weights, max_model_len, device, kind);
                if device == Device::Cpu && kind == Kind::Float {
                    // The f16 copies are made from the dense weights, so before those move to oneDNN.
                    if options.half_precision_gemv {
                        model.enable_half_precision_gemv()?;
                    }
                    if tch::utils::has_mkldnn() {
                        model.use_onednn_projections()?;
                    }
                }
                Engine::Torch {
                    model,
                    kv_cache,
                    graphs,
                }
            }
        };
        let (num_blocks, block_size) = match &engine {
            Engine::Kernels { kv_cache, .. } => (kv_cache.num_blocks, kv_cache.block_size),
            Engine::Torch { kv_cache, .. } => (kv_cache.num_blocks, kv_cache.block_size),
        };
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
            num_blocks: num_blocks as u32,
            block_size: block_size as u32,
            max_model_len: max_model_len as u32,
            eos_token_ids,
            device: match &engine {
                Engine::Kernels { .. } => format!("{} (Rivulet kernels)", describe(device)),
                Engine::Torch { .. } => describe(device),
            },
        };
        crate::malloc_tuning::release_freed_memory();
        Ok(Self {
            engine,
            ready,
            step_buffer: None,
        })
    }

    pub fn ready_info(&self) -> &ReadyInfo {
        &self.ready
    }

    /// One small prefill and one decode through block 0, so that the first real step does not pay
    /// for lazy initialisation (libtorch's, the kernels' thread pool). Block 0's contents are
    /// overwritten by its next owner.
    pub fn warm_up(&mut self) -> Result<(), WorkerError> {
        let _guard = tch::no_grad_guard();
        for (first, count) in [(0i64, 2i64), (2, 1)] {
            let seqs = [SeqSlice {
                first_token: 0,
                num_tokens: count,
                context_len: first + count,
            }];
            let positions: Vec<i64> = (first..first + count).collect();
            match &mut self.engine {
                Engine::Kernels { model, kv_cache } => {
                    let step = HostStepInputs {
                        input_ids: &vec![0; count as usize],
                        positions: &positions,
                        slot_mapping: &positions,
                        seqs: &seqs,
                        block_tables: &[0],
                        max_blocks: 1,
                        logit_rows: &[count - 1],
                    };
                    let logits = model.forward(&step, kv_cache)?;
                    let vocab = model.config.vocab_size;
                    let row = RowRequest {
                        params: SeqSampling::GREEDY,
                        history: &[],
                        prompt_len: 0,
                        bias: LogitBiasRow::default(),
                    };
                    model.in_pool(|| sample_rows(&logits, vocab, &[row], 0));
                }
                Engine::Torch { model, kv_cache, .. } => {
                    let device = model.device;
                    // Three entries: the three tokens' blocks whatever the block size (block 0 each).
                    let table = Tensor::zeros([1, 3], (Kind::Int64, device));
                    let ids = Tensor::zeros([count], (Kind::Int64, device));
                    let positions = Tensor::from_slice(&positions).to_device(device);
                    let plan = AttentionPlan::new(
                        &seqs,
                        &table,
                        kv_cache.block_size as i64,
                        model.config.head_dim,
                        device,
                        model.kind,
                    );
                    let rows = Tensor::from_slice(&[count - 1]).to_device(device);
                    let inputs = ForwardInputs {
                        input_ids: &ids,
                        positions: &positions,
                        slot_mapping: &positions,
                        attention: &plan,
                        logit_rows: &rows,
                    };
                    let _ = model.forward(&inputs, kv_cache).argmax(-1, false);
                }
            }
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
        let (num_blocks, block_size) = match &self.engine {
            Engine::Kernels { kv_cache, .. } => (kv_cache.num_blocks, kv_cache.block_size),
            Engine::Torch { kv_cache, .. } => (kv_cache.num_blocks, kv_cache.block_size),
        };
        let limits = StepLimits {
            vocab_size: self.ready.model.vocab_size as i64,
            max_model_len: self.ready.max_model_len as i64,
            block_size: block_size as i64,
            num_blocks: num_blocks as i64,
        };
        let host = step::validate(buffer, &header, limits)?;
        let mut view = StepView::wrap(buffer, &header, host.history_len)?;
        let head_rows = host.head_rows();
        let layout = buffer.layout();
        let (tokens, seqs) = (header.num_tokens as usize, header.num_seqs as usize);
        let max_blocks = layout.capacity.max_blocks_per_seq as usize;
        let inputs = HostStepInputs {
            input_ids: &buffer.array(layout.input_ids)[..tokens],
            positions: &buffer.array(layout.positions)[..tokens],
            slot_mapping: &buffer.array(layout.slot_mapping)[..tokens],
            seqs: &host.seqs,
            block_tables: &buffer.array(layout.block_tables)[..seqs * max_blocks],
            max_blocks,
            logit_rows: &head_rows,
        };
        let sampled_rows = host.logit_rows.len();
        let (logits, device) = match &mut self.engine {
            Engine::Kernels { model, kv_cache } => {
                let logits = model.forward(&inputs, kv_cache)?;
                let vocab = model.config.vocab_size;
                if !host.prompt_rows.is_empty() {
                    let prompt_logits = &logits[sampled_rows * vocab..];
                    let scored = model.in_pool(|| prompt_logprobs::score_rows(prompt_logits, vocab, &host.prompt_rows));
                    prompt_logprobs::write_outputs(&mut view, &host.prompt_rows, &scored)?;
                }
                if host.sampled_seqs.is_empty() {
                    return Ok(());
                }
                // Every row straight from the logits ([`crate::kernel_sampling`]).
                let requests = step::row_requests(buffer, &host);
                let top = requests
                    .iter()
                    .map(|request| request.params.num_top_logprobs)
                    .max()
                    .unwrap_or(0) as usize;
                let sampled = model.in_pool(|| sample_rows(&logits, vocab, &requests, top));
                return step::write_outputs(&mut view, &host, &sampled.into_sampled()?);
            }
            Engine::Torch {
                model,
                kv_cache,
                graphs,
            } => {
                let through_graph = graphs
                    .as_mut()
                    .filter(|_| decode_graphs::is_plain_decode(&inputs))
                    .and_then(|graphs| graphs.forward(model, kv_cache, &inputs));
                let logits = match through_graph {
                    Some(logits) => logits,
                    None => eager_torch_step(model, kv_cache, &view, &host, &head_rows)?,
                };
                (logits, model.device)
            }
        };
        if !host.prompt_rows.is_empty() {
            let prompt_logits = logits
                .f_narrow(0, sampled_rows as i64, host.prompt_rows.len() as i64)?
                .f_to_device(Device::Cpu)?
                .f_to_kind(Kind::Float)?
                .f_contiguous()?;
            let vocab = prompt_logits.size()[1] as usize;
            let prompt_logits = Vec::<f32>::try_from(prompt_logits.f_view(-1)?)?;
            let scored = prompt_logprobs::score_rows(&prompt_logits, vocab, &host.prompt_rows);
            prompt_logprobs::write_outputs(&mut view, &host.prompt_rows, &scored)?;
        }
        if host.sampled_seqs.is_empty() {
            return Ok(());
        }
        let batch = step::sampling_batch(buffer, &view, &host, device)?;
        let sampled = sample(&logits.f_narrow(0, 0, sampled_rows as i64)?, &batch);
        step::write_outputs(&mut view, &host, &sampled)
    }
}

/// A libtorch step op by op: the step buffer's arrays copied to the device, then the forward pass.
fn eager_torch_step(
    model: &LlamaModel,
    kv_cache: &KvCache,
    view: &StepView<'_>,
    host: &HostStep,
    logit_rows: &[i64],
) -> Result<Tensor, WorkerError> {
    let device = model.device;
    let on_device = |t: &Tensor| -> Result<Tensor, WorkerError> { Ok(t.f_to_device(device)?) };
    let input_ids = on_device(&view.input_ids)?;
    let positions = on_device(&view.positions)?;
    let slot_mapping = on_device(&view.slot_mapping)?;
    let block_tables = on_device(&view.block_tables)?;
    let plan = AttentionPlan::new(
        &host.seqs,
        &block_tables,
        kv_cache.block_size as i64,
        model.config.head_dim,
        device,
        model.kind,
    );
    let rows = Tensor::f_from_slice(logit_rows)?.f_to_device(device)?;
    let inputs = ForwardInputs {
        input_ids: &input_ids,
        positions: &positions,
        slot_mapping: &slot_mapping,
        attention: &plan,
        logit_rows: &rows,
    };
    Ok(model.forward(&inputs, kv_cache))
}

/// Weights as loaded, before the engine is built around them.
enum LoadedWeights {
    Kernels(CpuWeights),
    Torch(ModelWeights),
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
    let budget = options.kv_cache_memory;
    let mut report = |progress| {
        // Progress is for show: a full channel or a gone scheduler shows up at `Ready`.
        let _ = events.send(WorkerEvent::LoadProgress(progress));
    };
    let mut worker = match Worker::load(options, &mut report).and_then(|mut w| w.warm_up().map(|()| w)) {
        Ok(worker) => worker,
        Err(error) => {
            let _ = events.send(WorkerEvent::Failed {
                message: error.to_string(),
                fatal: true,
                setting: refused_setting(&error, budget).map(str::to_owned),
            });
            return Err(error);
        }
    };
    tracing::info!(elapsed_ms = started.elapsed().as_millis() as u64, ready = ?worker.ready_info(), "worker ready");
    send(&events, WorkerEvent::Ready(worker.ready_info().clone()))?;
    command_loop(&mut worker, &commands, &events)
}

/// The configuration key a load failure is about: a KV budget too small for one sequence of the
/// context, or a device this machine does not have. Whether that ends the server is the
/// scheduler's call (it does for a replica whose worker never got ready: a start that cannot work).
fn refused_setting(error: &WorkerError, budget: KvBudget) -> Option<&'static str> {
    match (error, budget) {
        (WorkerError::KvBudgetTooSmall(_), KvBudget::Bytes(_)) => Some("worker.kv_cache_memory"),
        (WorkerError::KvBudgetTooSmall(_), KvBudget::FreeFraction(_)) => Some("worker.kv_cache_memory_fraction"),
        (WorkerError::Device(..), _) => Some("worker.device"),
        _ => None,
    }
}

/// Serves commands until the scheduler says `Shutdown` or goes away. Gone without a word (killed,
/// say), it cannot remove the step buffer it created: the worker removes it on its way out.
fn command_loop(
    worker: &mut Worker,
    commands: &IpcReceiver<WorkerCommand>,
    events: &IpcSender<WorkerEvent>,
) -> Result<(), WorkerError> {
    let served = serve_commands(worker, commands, events);
    if !matches!(served, Ok(Ending::Shutdown)) {
        if let Some(mut buffer) = worker.step_buffer.take() {
            buffer.remove_when_dropped();
        }
    }
    served.map(|_| ())
}

/// How [`serve_commands`] ended without an error.
enum Ending {
    /// The scheduler asked: it removes the step buffer itself.
    Shutdown,
    SchedulerGone,
}

fn serve_commands(
    worker: &mut Worker,
    commands: &IpcReceiver<WorkerCommand>,
    events: &IpcSender<WorkerEvent>,
) -> Result<Ending, WorkerError> {
    loop {
        let command = match commands.recv() {
            Ok(command) => command,
            // The scheduler is gone: nothing left to serve.
            Err(error) => {
                tracing::info!(%error, "command channel closed; exiting");
                return Ok(Ending::SchedulerGone);
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
                        setting: None,
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
                            setting: None,
                        }
                    }
                };
                send(events, event)?;
            }
            WorkerCommand::Shutdown => return Ok(Ending::Shutdown),
        }
    }
}

fn send(events: &IpcSender<WorkerEvent>, event: WorkerEvent) -> Result<(), WorkerError> {
    events.send(event).map_err(|e| WorkerError::Ipc(e.to_string()))
}
