//! Worker micro-benchmark, per engine (Rivulet's CPU kernels and libtorch's forward pass): the step time for decode batches of 1, 8, 32 and 64 sequences at
//! context 512 (or RIVULET_BENCH_BATCHES at RIVULET_BENCH_CONTEXT) and for one 512-token prefill, beside the machine's measured fp32 matmul
//! throughput, so the step can be read against its roofline.
//!
//! `cargo run --release -p rivulet-worker --bin rivulet-worker-bench -- [model.gguf] [threads]`
//!
//! RIVULET_BENCH_DEVICE=cuda:N times the libtorch engine on that GPU instead, in bf16 as the worker
//! runs it there, against the GPU's measured bf16 matmul rate and memory read bandwidth.
//!
//! The kernels' KV cache is filled with values before any step is timed: its pages are mapped
//! only when first written, and every read of a page never written lands on the kernel's one
//! shared zero page, always in cache, which made attention look ~2× cheaper than with a real
//! context. RIVULET_BENCH_PHASES=1 also prints where the kernels' decode steps spend their time
//! ([`rivulet_worker::step_phases`]).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use rivulet_gguf::GgufFile;
use rivulet_ipc::SeqSampling;
use rivulet_worker::attention::{AttentionPlan, SeqSlice};
use rivulet_worker::config::ModelConfig;
use rivulet_worker::cpu_model::{CpuModel, CpuWeights, HostStepInputs};
use rivulet_worker::kernel_sampling::{sample_rows, LogitBiasRow, RowRequest};
use rivulet_worker::kv_cache::{HostKvCache, KvCache};
use rivulet_worker::model::{ForwardInputs, LlamaModel};
use rivulet_worker::step_phases::{Phase, StepPhases};
use rivulet_worker::weights::ModelWeights;
use tch::{Device, Kind, Tensor};

const BLOCK_SIZE: i64 = 16;

/// Waits for the device's queued work (a no-op on the CPU, where every op has finished on return).
fn synchronize(device: Device) {
    if let Device::Cuda(index) = device {
        tch::Cuda::synchronize(index as i64);
    }
}

/// Median wall time of `runs` calls on `device`, after one warm-up call.
fn median_seconds(device: Device, runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    synchronize(device);
    let mut times: Vec<f64> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            synchronize(device);
            start.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// The machine's matmul rate in `kind` (1024³ on the CPU; 8192³ to fill a GPU) and memory read
/// bandwidth (summing a 512 MiB tensor, far larger than any cache, streams it once), measured
/// at the start and again just before and after every kind of step.
///
/// Why again: on the shared virtual machines this runs on, both rates swing by up to half from
/// one minute to the next (a 2-vCPU Xeon's sgemm measured 141–294 GFLOP/s within an hour), so
/// a step set against rates measured minutes before read 47% of its roofline in one run and
/// 106% in the next. Each kind of step is set against the mean of the rates measured on either
/// side of it. Not between its steps: a matmul after every step made a one-token step ~50%
/// slower on a 2-vCPU Xeon (libtorch's threads, and the caches, still busy with the matmul).
struct Probes {
    device: Device,
    a: Tensor,
    b: Tensor,
    values: Tensor,
    matmul_flops: f64,
    read_bytes: f64,
}

/// The rates of one measurement.
#[derive(Debug, Clone, Copy)]
struct Rates {
    gflops: f64,
    bandwidth: f64,
}

impl Probes {
    fn new(device: Device, kind: Kind) -> Self {
        let n = if device == Device::Cpu { 1024 } else { 8192 };
        Self {
            device,
            a: Tensor::randn([n, n], (kind, device)),
            b: Tensor::randn([n, n], (kind, device)),
            values: Tensor::ones([128 << 20], (Kind::Float, device)),
            matmul_flops: 2.0 * (n * n * n) as f64,
            read_bytes: (512 << 20) as f64,
        }
    }

    /// The median matmul rate (GFLOP/s) of `matmuls` and read bandwidth (GB/s) of `reads`.
    fn measure(&self, matmuls: usize, reads: usize) -> Rates {
        let matmul = median_seconds(self.device, matmuls, || {
            let _ = self.a.matmul(&self.b);
        });
        let read = median_seconds(self.device, reads, || {
            let _ = self.values.sum(Kind::Float);
        });
        Rates {
            gflops: self.matmul_flops / matmul / 1e9,
            bandwidth: self.read_bytes / read / 1e9,
        }
    }

    /// The median time of `runs` calls of `step` (after one untimed), and the mean of the rates
    /// measured just before and just after them.
    fn beside(&self, runs: usize, step: impl FnMut()) -> (f64, Rates) {
        let before = self.measure(5, 3);
        let seconds = median_seconds(self.device, runs, step);
        let after = self.measure(5, 3);
        let rates = Rates {
            gflops: (before.gflops + after.gflops) / 2.0,
            bandwidth: (before.bandwidth + after.bandwidth) / 2.0,
        };
        (seconds, rates)
    }
}

/// FLOPs of one token through the model (matmuls only; attention adds 4·context·hidden per layer).
fn flops_per_token(config: &ModelConfig, context: i64) -> f64 {
    flops_through_layers(config, context) + head_flops(config)
}

/// [`flops_per_token`] without the output head.
fn flops_through_layers(config: &ModelConfig, context: i64) -> f64 {
    let hidden = config.hidden_size as f64;
    let kv = config.kv_dim() as f64;
    let ffn = config.intermediate_size as f64;
    let per_layer = 2.0 * hidden * (hidden + 2.0 * kv) + 2.0 * hidden * hidden + 2.0 * 3.0 * hidden * ffn;
    let attention = 4.0 * context as f64 * hidden;
    config.num_layers as f64 * (per_layer + attention)
}

/// FLOPs of the output head for one row.
fn head_flops(config: &ModelConfig) -> f64 {
    2.0 * config.hidden_size as f64 * config.vocab_size as f64
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    // As the worker does (see `malloc_tuning`); RIVULET_BENCH_DEFAULT_MALLOC=1 measures without it.
    if std::env::var_os("RIVULET_BENCH_DEFAULT_MALLOC").is_none() {
        rivulet_worker::malloc_tuning::keep_freed_memory();
    }
    let model_path = PathBuf::from(
        args.get(1)
            .map_or("models/SmolLM2-135M-Instruct.Q4_1.gguf", String::as_str),
    );
    if let Some(threads) = args.get(2) {
        tch::set_num_threads(threads.parse().context("threads")?);
    }
    // RIVULET_BENCH_CONTEXT / RIVULET_BENCH_BATCHES narrow the run (e.g. for a profiler).
    let context: i64 = env_or("RIVULET_BENCH_CONTEXT", "512")
        .parse()
        .context("RIVULET_BENCH_CONTEXT")?;
    let batches: Vec<i64> = env_or("RIVULET_BENCH_BATCHES", "1,8,32,64")
        .split(',')
        .map(|b| b.trim().parse().context("RIVULET_BENCH_BATCHES"))
        .collect::<anyhow::Result<_>>()?;
    // RIVULET_BENCH_RUNS: timed decode steps per batch (more for a profiler; default 8).
    let decode_runs: usize = env_or("RIVULET_BENCH_RUNS", "8")
        .parse()
        .context("RIVULET_BENCH_RUNS")?;
    let device = rivulet_worker::device::select_device(&env_or("RIVULET_BENCH_DEVICE", "cpu"))?;
    let kind = rivulet_worker::device::compute_kind(device);
    let _guard = tch::no_grad_guard();
    let file = GgufFile::open(&model_path)?;
    let config = ModelConfig::from_gguf(&file)?;
    let max_batch = batches.iter().copied().max().unwrap_or(1);
    let blocks_per_seq = (context + 1 + BLOCK_SIZE - 1) / BLOCK_SIZE;
    let bytes =
        // At least one 1024-token sequence (the cache's own minimum for max_model_len 1024).
        (max_batch * blocks_per_seq).max(1024 / BLOCK_SIZE + 1) as usize
            * rivulet_worker::kv_cache::bytes_per_block(&config, 16, kind.elt_size_in_bytes());
    // RIVULET_BENCH_ENGINE: `kernels` (the worker's CPU default), `libtorch`, or `both` (default:
    // both, so that their ratio comes from one run). The kernels are CPU-only.
    let engines = if device == Device::Cpu {
        env_or("RIVULET_BENCH_ENGINE", "both")
    } else {
        "libtorch".to_owned()
    };
    let probes = Probes::new(device, kind);
    let Rates { gflops, bandwidth } = probes.measure(10, 5);
    println!(
        "device: {}, threads: {threads}, {kind:?} matmul: {gflops:.1} GFLOP/s, memory read: {bandwidth:.1} GB/s at the start (each kind of step is set against these rates measured again on either side of it)",
        rivulet_worker::device::describe(device),
        threads = tch::get_num_threads(),
    );
    // The FMA units' own peak, every thread at once: libtorch's sgemm can be far below it (MKL's
    // AVX2 kernel on AMD CPUs with AVX-512), and the kernels can exceed that "roofline".
    let fma_peak = if device == Device::Cpu {
        let threads = tch::get_num_threads().max(1) as usize;
        rivulet_kernels::fma_peak_gflops_on(threads, std::time::Duration::from_millis(300))
    } else {
        None
    };
    if let Some(peak) = fma_peak {
        println!("fp32 FMA peak (the kernels' widest vectors, every thread at once): {peak:.1} GFLOP/s");
    }
    println!("roofline = min(compute: GFLOP/s / FLOPs per token, bandwidth: tokens per step × GB/s / weight bytes)");
    let mut runs: Vec<(String, Box<dyn BenchEngine>, f64)> = Vec::new();
    if engines == "kernels" || engines == "both" {
        let threads = tch::get_num_threads() as usize;
        let mut weights = CpuWeights::from_gguf(&file, &config)?;
        // As the worker keeps them by default (`worker.batch_weight_copy`);
        // RIVULET_BENCH_NO_WEIGHT_COPY=1 measures the blocks alone.
        if std::env::var_os("RIVULET_BENCH_NO_WEIGHT_COPY").is_none() {
            weights.add_panels();
        }
        let weight_bytes = weights.projection_bytes() as f64;
        let model = CpuModel::new(config.clone(), weights, 2048, threads)?;
        let mut cache = HostKvCache::allocate(&config, BLOCK_SIZE as usize, bytes, 1024)?;
        fill_like_a_context(&mut cache);
        runs.push((
            "kernels".to_owned(),
            Box::new(KernelsBench {
                model,
                cache,
                phases: None,
            }),
            weight_bytes,
        ));
    }
    if engines == "libtorch" || engines == "both" {
        let weights = ModelWeights::load(&file, &config, device, kind)?;
        let cache = KvCache::allocate(&config, BLOCK_SIZE as usize, bytes, 1024, device, kind)?;
        let mut model = LlamaModel::new(config.clone(), weights, 2048, device, kind);
        // RIVULET_BENCH_HALF_GEMV=1: as with `worker.half_precision_gemv` (f16 weights for 1-token steps).
        let half_gemv = std::env::var_os("RIVULET_BENCH_HALF_GEMV").is_some();
        if half_gemv {
            model.enable_half_precision_gemv()?;
        }
        // As the libtorch engine does on the CPU; RIVULET_BENCH_DENSE=1 keeps MKL's sgemm.
        if device == Device::Cpu && std::env::var_os("RIVULET_BENCH_DENSE").is_none() && tch::utils::has_mkldnn() {
            model.use_onednn_projections()?;
        }
        // Every step reads every projection weight once: 2 FLOPs per weight per token.
        let weight_bytes = flops_per_token(&config, 0) / 2.0 * kind.elt_size_in_bytes() as f64;
        let name = if half_gemv { "libtorch (f16 GEMV)" } else { "libtorch" };
        runs.push((
            name.to_owned(),
            Box::new(TorchBench { model, cache, device }),
            weight_bytes,
        ));
    }
    println!(
        "{:<20} {:<22} {:>10} {:>12} {:>14} {:>12} {:>12} {:>11} {:>8}",
        "engine", "step", "ms/step", "tokens/s", "roofline tok/s", "of roofline", "of FMA peak", "GFLOP/s", "GB/s"
    );
    for (name, engine, weight_bytes) in &mut runs {
        // Each kind of step against the roofline of the rates measured on either side of it.
        // `step_flops`: the step's, all tokens together.
        let report = |step: &str, (seconds, rates): (f64, Rates), tokens: i64, step_flops: f64| {
            let flops = step_flops / tokens as f64;
            let compute_bound = rates.gflops * 1e9 / flops;
            let bandwidth_bound = tokens as f64 * rates.bandwidth * 1e9 / *weight_bytes;
            let roofline = compute_bound.min(bandwidth_bound);
            let rate = tokens as f64 / seconds;
            let of_peak = fma_peak.map_or("-".to_owned(), |peak| {
                format!("{:.0}%", 100.0 * rate * flops / (peak * 1e9))
            });
            println!(
                "{name:<20} {step:<22} {:>10.2} {rate:>12.1} {roofline:>14.1} {:>11.0}% {of_peak:>12} {:>11.1} {:>8.1}",
                seconds * 1e3,
                100.0 * rate / roofline,
                rates.gflops,
                rates.bandwidth,
            );
        };
        println!("{name}: weights read per step {:.1} MB", *weight_bytes / 1e6);
        let phases_wanted = std::env::var_os("RIVULET_BENCH_PHASES").is_some();
        for &batch in &batches {
            let measured = probes.beside(decode_runs, || engine.decode(batch, context, blocks_per_seq));
            let flops = batch as f64 * flops_per_token(&config, context);
            report(&format!("decode batch {batch} @{context}"), measured, batch, flops);
            if phases_wanted {
                if let Some(phases) = engine.decode_phases(batch, context, blocks_per_seq, decode_runs) {
                    print_phases(&phases);
                }
            }
        }
        // RIVULET_BENCH_NO_PREFILL=1 leaves the prefill out (e.g. to profile decode alone).
        if std::env::var_os("RIVULET_BENCH_NO_PREFILL").is_some() {
            continue;
        }
        let measured = probes.beside(4, || engine.prefill(context, blocks_per_seq));
        // A prefill's attention averages half the context; its head runs for one row only (until
        // the thirty-third round every token's head was counted, which put 256-token prefills
        // at 95–106% of the FMA peak instead of 74–85%).
        let flops = context as f64 * flops_through_layers(&config, context / 2) + head_flops(&config);
        report(&format!("prefill {context} tokens"), measured, context, flops);
    }
    Ok(())
}

/// Writes every key and value of the cache (see the module docs): small values that vary from
/// slot to slot, so that scores differ as a real context's do.
fn fill_like_a_context(cache: &mut HostKvCache) {
    use rivulet_kernels::kv_values::{pack_kv, KV_VALUE_BYTES};
    for layer in &mut cache.layers {
        for (i, key) in layer.keys.chunks_exact_mut(KV_VALUE_BYTES).enumerate() {
            key.copy_from_slice(&pack_kv(((i * 7919 % 2003) as f32 - 1001.0) * 1e-3));
        }
        for (i, value) in layer.values.chunks_exact_mut(KV_VALUE_BYTES).enumerate() {
            value.copy_from_slice(&pack_kv(((i * 104_729 % 1999) as f32 - 999.0) * 1e-3));
        }
    }
}

/// One line per phase of a decode step: mean µs and share of the step.
fn print_phases(phases: &StepPhases) {
    let step = phases.mean_step_seconds();
    let parts: Vec<String> = Phase::ALL
        .iter()
        .map(|&phase| {
            let seconds = phases.mean_seconds(phase);
            format!(
                "{} {:.0} µs ({:.0}%)",
                phase.name(),
                seconds * 1e6,
                100.0 * seconds / step
            )
        })
        .collect();
    println!("  phases of a step ({:.2} ms timed): {}", step * 1e3, parts.join(", "));
}

/// One engine's steps: `batch` sequences decoding at `context`, or one `context`-token prefill.
trait BenchEngine {
    fn decode(&mut self, batch: i64, context: i64, blocks_per_seq: i64);
    fn prefill(&mut self, context: i64, blocks_per_seq: i64);
    /// `runs` decode steps timed phase by phase, where the engine can tell.
    fn decode_phases(&mut self, _batch: i64, _context: i64, _blocks_per_seq: i64, _runs: usize) -> Option<StepPhases> {
        None
    }
}

struct KernelsBench {
    model: CpuModel,
    cache: HostKvCache,
    /// Where a step's time goes, while [`BenchEngine::decode_phases`] runs.
    phases: Option<StepPhases>,
}

impl KernelsBench {
    fn run(
        &mut self,
        ids: &[i64],
        positions: &[i64],
        slots: &[i64],
        seqs: &[SeqSlice],
        tables: &[i64],
        max_blocks: usize,
    ) {
        let rows: Vec<i64> = seqs.iter().map(|s| s.first_token + s.num_tokens - 1).collect();
        let step = HostStepInputs {
            input_ids: ids,
            positions,
            slot_mapping: slots,
            seqs,
            block_tables: tables,
            max_blocks,
            logit_rows: &rows,
        };
        let logits = match &mut self.phases {
            Some(phases) => self.model.forward_timed(&step, &mut self.cache, phases),
            None => self.model.forward(&step, &mut self.cache),
        }
        .expect("a well-formed step");
        let vocab = self.model.config.vocab_size;
        // Greedy rows (temperature 0, no penalty history), as the benchmarks serve them.
        let requests = vec![
            RowRequest {
                params: SeqSampling::GREEDY,
                history: &[],
                prompt_len: 0,
                bias: LogitBiasRow::default(),
            };
            rows.len()
        ];
        self.model.in_pool(|| sample_rows(&logits, vocab, &requests, 0));
    }
}

impl BenchEngine for KernelsBench {
    fn decode(&mut self, batch: i64, context: i64, blocks_per_seq: i64) {
        let seqs: Vec<SeqSlice> = (0..batch)
            .map(|i| SeqSlice {
                first_token: i,
                num_tokens: 1,
                context_len: context,
            })
            .collect();
        let tables: Vec<i64> = (0..batch * blocks_per_seq).collect();
        let slots: Vec<i64> = (0..batch)
            .map(|i| i * blocks_per_seq * BLOCK_SIZE + context - 1)
            .collect();
        let ids = vec![100; batch as usize];
        let positions = vec![context - 1; batch as usize];
        self.run(&ids, &positions, &slots, &seqs, &tables, blocks_per_seq as usize);
    }

    fn prefill(&mut self, context: i64, blocks_per_seq: i64) {
        let seqs = [SeqSlice {
            first_token: 0,
            num_tokens: context,
            context_len: context,
        }];
        let tables: Vec<i64> = (0..blocks_per_seq).collect();
        let positions: Vec<i64> = (0..context).collect();
        let ids = vec![100; context as usize];
        self.run(&ids, &positions, &positions, &seqs, &tables, blocks_per_seq as usize);
    }

    fn decode_phases(&mut self, batch: i64, context: i64, blocks_per_seq: i64, runs: usize) -> Option<StepPhases> {
        self.phases = Some(StepPhases::default());
        for _ in 0..runs {
            self.decode(batch, context, blocks_per_seq);
        }
        self.phases.take()
    }
}

struct TorchBench {
    model: LlamaModel,
    cache: KvCache,
    device: Device,
}

impl BenchEngine for TorchBench {
    fn decode(&mut self, batch: i64, context: i64, blocks_per_seq: i64) {
        let tables = Tensor::arange(batch * blocks_per_seq, (Kind::Int64, self.device)).view([batch, blocks_per_seq]);
        let seqs: Vec<SeqSlice> = (0..batch)
            .map(|i| SeqSlice {
                first_token: i,
                num_tokens: 1,
                context_len: context,
            })
            .collect();
        let ids = Tensor::full([batch], 100, (Kind::Int64, self.device));
        let positions = Tensor::full([batch], context - 1, (Kind::Int64, self.device));
        let slots = Tensor::arange(batch, (Kind::Int64, self.device)) * (blocks_per_seq * BLOCK_SIZE) + (context - 1);
        let rows = Tensor::arange(batch, (Kind::Int64, self.device));
        let plan = AttentionPlan::new(
            &seqs,
            &tables,
            BLOCK_SIZE,
            self.model.config.head_dim,
            self.device,
            self.model.kind,
        );
        let inputs = ForwardInputs {
            input_ids: &ids,
            positions: &positions,
            slot_mapping: &slots,
            attention: &plan,
            logit_rows: &rows,
        };
        let _ = self.model.forward(&inputs, &self.cache).argmax(-1, false);
    }

    fn prefill(&mut self, context: i64, blocks_per_seq: i64) {
        let tables = Tensor::arange(blocks_per_seq, (Kind::Int64, self.device)).unsqueeze(0);
        let seqs = [SeqSlice {
            first_token: 0,
            num_tokens: context,
            context_len: context,
        }];
        let ids = Tensor::full([context], 100, (Kind::Int64, self.device));
        let positions = Tensor::arange(context, (Kind::Int64, self.device));
        let rows = Tensor::from_slice(&[context - 1]).to_device(self.device);
        let plan = AttentionPlan::new(
            &seqs,
            &tables,
            BLOCK_SIZE,
            self.model.config.head_dim,
            self.device,
            self.model.kind,
        );
        let inputs = ForwardInputs {
            input_ids: &ids,
            positions: &positions,
            slot_mapping: &positions,
            attention: &plan,
            logit_rows: &rows,
        };
        let _ = self.model.forward(&inputs, &self.cache).argmax(-1, false);
    }
}
