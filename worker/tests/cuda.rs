//! libtorch's forward pass (the CUDA engine) on the real model: several prompts' prefill chunks in
//! one step give each prompt the next tokens it gets alone (on the CPU, in f32, always; on CUDA too
//! where a device exists), and the model in bf16 on the GPU gives the same greedy next tokens as f32
//! on the CPU; decode steps replayed from a CUDA graph give the eager steps' tokens; the paged
//! decode attention kernel agrees with the gathered path. The CUDA parts are skipped, saying so,
//! where no CUDA device exists.

use std::path::PathBuf;

use rivulet_gguf::GgufFile;
use rivulet_worker::attention::{AttentionPlan, SeqSlice};
use rivulet_worker::config::ModelConfig;
use rivulet_worker::cpu_model::HostStepInputs;
use rivulet_worker::decode_graphs::DecodeGraphs;
use rivulet_worker::device::compute_kind;
use rivulet_worker::kv_cache::KvCache;
use rivulet_worker::model::{ForwardInputs, LlamaModel};
use rivulet_worker::paged_attention::{PagedDecodeAttention, PagedKeys};
use rivulet_worker::weights::ModelWeights;
use tch::{Device, Kind, Tensor};

const BLOCK_SIZE: i64 = 16;
const MAX_BLOCKS: i64 = 8;

/// The GPU tests run one at a time: the test harness runs tests on parallel threads, and a CUDA
/// graph's capture (global mode) fails when another thread does CUDA work meanwhile. The worker
/// itself runs its steps on one thread.
static GPU: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds [`GPU`] for the rest of a test (a test that failed while holding it does not stop the
/// others); `None`, saying the test is skipped, on a machine without a CUDA device.
fn gpu_to_ourselves() -> Option<std::sync::MutexGuard<'static, ()>> {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device on this machine");
        return None;
    }
    Some(GPU.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
}

fn model_file() -> GgufFile {
    // RIVULET_TEST_MODEL: where the binary runs away from its checkout (bench/cuda.sh on a GPU machine).
    let path = std::env::var_os("RIVULET_TEST_MODEL").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        PathBuf::from,
    );
    GgufFile::open(&path).expect("model")
}

struct Engine {
    model: LlamaModel,
    cache: KvCache,
    device: Device,
}

impl Engine {
    fn load(file: &GgufFile, device: Device) -> Self {
        let config = ModelConfig::from_gguf(file).expect("config");
        let kind = compute_kind(device);
        let weights = ModelWeights::load(file, &config, device, kind).expect("weights");
        // On the GPU, room for the graph test's 130 sequences of MAX_BLOCKS blocks each.
        let cache_bytes = if device.is_cuda() { 512 << 20 } else { 64 << 20 };
        let cache = KvCache::allocate(&config, BLOCK_SIZE as usize, cache_bytes, 256, device, kind).expect("cache");
        let model = LlamaModel::new(config, weights, 256, device, kind);
        Self { model, cache, device }
    }

    /// One step holding each prompt whole as a prefill chunk (sequence `i` in blocks
    /// `i·MAX_BLOCKS..`): the greedy next token after every prefix of every prompt.
    fn prefill_step(&self, prompts: &[&[i64]]) -> Vec<Vec<i64>> {
        let seqs: Vec<SeqSlice> = prompts
            .iter()
            .scan(0, |first, prompt| {
                let seq = SeqSlice {
                    first_token: *first,
                    num_tokens: prompt.len() as i64,
                    context_len: prompt.len() as i64,
                };
                *first += prompt.len() as i64;
                Some(seq)
            })
            .collect();
        let ids: Vec<i64> = prompts.concat();
        let positions: Vec<i64> = prompts.iter().flat_map(|p| 0..p.len() as i64).collect();
        let slots: Vec<i64> = prompts
            .iter()
            .enumerate()
            .flat_map(|(i, p)| (0..p.len() as i64).map(move |j| i as i64 * MAX_BLOCKS * BLOCK_SIZE + j))
            .collect();
        let tokens = self.step(
            &seqs,
            &ids,
            &positions,
            &slots,
            &(0..ids.len() as i64).collect::<Vec<_>>(),
        );
        seqs.iter()
            .map(|s| tokens[s.first_token as usize..(s.first_token + s.num_tokens) as usize].to_vec())
            .collect()
    }

    /// One decode step after [`Self::prefill_step`]: each sequence's `next` token at the position
    /// after its prompt.
    fn decode_step(&self, prompt_lens: &[usize], next: &[i64]) -> Vec<i64> {
        let decode = DecodeLayout::after(prompt_lens);
        self.step(&decode.seqs, next, &decode.positions, &decode.slots, &decode.rows)
    }

    fn step(&self, seqs: &[SeqSlice], ids: &[i64], positions: &[i64], slots: &[i64], rows: &[i64]) -> Vec<i64> {
        let _guard = tch::no_grad_guard();
        let on_device = |values: &[i64]| Tensor::from_slice(values).to_device(self.device);
        let tables = Tensor::arange(seqs.len() as i64 * MAX_BLOCKS, (Kind::Int64, self.device))
            .view([seqs.len() as i64, MAX_BLOCKS]);
        let config = &self.model.config;
        let plan = AttentionPlan::new(seqs, &tables, BLOCK_SIZE, config.head_dim, self.device, self.model.kind);
        let (ids, positions, slots, rows) = (on_device(ids), on_device(positions), on_device(slots), on_device(rows));
        let inputs = ForwardInputs {
            input_ids: &ids,
            positions: &positions,
            slot_mapping: &slots,
            attention: &plan,
            logit_rows: &rows,
        };
        let logits = self.model.forward(&inputs, &self.cache);
        Vec::<i64>::try_from(logits.argmax(-1, false).to_device(Device::Cpu)).expect("tokens")
    }
}

/// A decode step's layout: sequence `i` (in blocks `i·MAX_BLOCKS..`) decodes one token at the
/// position after its `prompt_lens[i]` tokens, at row `i`.
struct DecodeLayout {
    seqs: Vec<SeqSlice>,
    positions: Vec<i64>,
    slots: Vec<i64>,
    rows: Vec<i64>,
}

impl DecodeLayout {
    fn after(prompt_lens: &[usize]) -> Self {
        let seqs = prompt_lens
            .iter()
            .enumerate()
            .map(|(i, &len)| SeqSlice {
                first_token: i as i64,
                num_tokens: 1,
                context_len: len as i64 + 1,
            })
            .collect();
        let positions: Vec<i64> = prompt_lens.iter().map(|&len| len as i64).collect();
        let slots = positions
            .iter()
            .enumerate()
            .map(|(i, p)| i as i64 * MAX_BLOCKS * BLOCK_SIZE + p)
            .collect();
        let rows = (0..prompt_lens.len() as i64).collect();
        Self {
            seqs,
            positions,
            slots,
            rows,
        }
    }
}

const PROMPT_A: &[i64] = &[504, 3575, 282, 4649, 314, 30, 1073, 281, 253, 1345, 28, 2640];
const PROMPT_B: &[i64] = &[1, 9690, 198, 2683, 359, 253, 5356, 5646];
const PROMPT_C: &[i64] = &[2683, 359, 2];

/// Prompts of unequal length in one step (padded together) against each alone, then one decode
/// step of all three against the single-sequence prefill that ends in the same token. In f32 the
/// tokens are the same; in bf16 the products of other batch shapes round differently, which may
/// flip a near-tie: at most `allowed_flips` of the 26 positions.
fn batched_steps_match_single_sequences(engine: &Engine, allowed_flips: usize) {
    let prompts = [PROMPT_A, PROMPT_B, PROMPT_C];
    let together = engine.prefill_step(&prompts);
    let mut flips = Vec::new();
    for (prompt, batched) in prompts.iter().zip(&together) {
        let alone = engine.prefill_step(&[prompt]).remove(0);
        assert_eq!(alone.len(), batched.len());
        flips.extend(alone.iter().zip(batched).filter(|(a, b)| a != b).map(|(a, b)| (*a, *b)));
    }
    let next: Vec<i64> = together.iter().map(|t| *t.last().expect("a token")).collect();
    let lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
    let decoded = engine.decode_step(&lens, &next);
    for ((prompt, &token), &after) in prompts.iter().zip(&next).zip(&decoded) {
        let extended = [*prompt, &[token]].concat();
        let alone = engine.prefill_step(&[&extended])[0].last().copied().expect("a token");
        if alone != after {
            flips.push((alone, after));
        }
    }
    assert!(flips.len() <= allowed_flips, "alone vs batched: {flips:?}");
}

#[test]
fn batched_steps_match_single_sequences_on_cpu() {
    batched_steps_match_single_sequences(&Engine::load(&model_file(), Device::Cpu), 0);
}

#[test]
fn batched_steps_match_single_sequences_on_cuda() {
    let Some(_gpu) = gpu_to_ourselves() else {
        return;
    };
    batched_steps_match_single_sequences(&Engine::load(&model_file(), Device::Cuda(0)), 2);
}

#[test]
fn bf16_on_cuda_agrees_with_f32_on_cpu() {
    let Some(_gpu) = gpu_to_ourselves() else {
        return;
    };
    let file = model_file();
    let cpu = Engine::load(&file, Device::Cpu).prefill_step(&[PROMPT_A]).remove(0);
    let gpu = Engine::load(&file, Device::Cuda(0)).prefill_step(&[PROMPT_A]).remove(0);
    let agree = cpu.iter().zip(&gpu).filter(|(a, b)| a == b).count();
    // bf16 rounding may flip a near-tie; most positions must agree.
    assert!(agree * 10 >= cpu.len() * 8, "cpu {cpu:?} vs cuda {gpu:?}");
}

/// Decode steps through [`DecodeGraphs`] (the first captures, the next two replay, the last with
/// new inputs) give the tokens of the same steps run eagerly: three sequences (a power-of-two
/// bucket of 4), then 130 (a bucket of 192, past the power-of-two sizes), on the same graphs.
#[test]
fn decode_graph_replays_match_eager_steps() {
    let Some(_gpu) = gpu_to_ourselves() else {
        return;
    };
    if !rivulet_worker::cuda_graph::supported() {
        eprintln!("skipped: this build has no CUDA graph support");
        return;
    }
    let _guard = tch::no_grad_guard();
    let mut engine = Engine::load(&model_file(), Device::Cuda(0));
    let scratch = engine.cache.reserve_block(256).expect("a spare block");
    let mut graphs = DecodeGraphs::new(Device::Cuda(0), BLOCK_SIZE as usize, scratch).expect("graphs");
    let few = [PROMPT_A, PROMPT_B, PROMPT_C];
    let many: Vec<&[i64]> = few.iter().copied().cycle().take(130).collect();
    for prompts in [&few[..], &many[..]] {
        replays_match_eager_steps(&engine, &mut graphs, prompts);
    }
}

fn replays_match_eager_steps(engine: &Engine, graphs: &mut DecodeGraphs, prompts: &[&[i64]]) {
    let mut lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
    let mut next: Vec<i64> = engine
        .prefill_step(prompts)
        .iter()
        .map(|t| *t.last().expect("a token"))
        .collect();
    let tables: Vec<i64> = (0..prompts.len() as i64 * MAX_BLOCKS).collect();
    for round in 0..3 {
        let replays = if round == 0 { 2 } else { 1 };
        let mut through_graph = Vec::new();
        for _ in 0..replays {
            let decode = DecodeLayout::after(&lens);
            let step = HostStepInputs {
                input_ids: &next,
                positions: &decode.positions,
                slot_mapping: &decode.slots,
                seqs: &decode.seqs,
                block_tables: &tables,
                max_blocks: MAX_BLOCKS as usize,
                logit_rows: &decode.rows,
            };
            let logits = graphs
                .forward(&engine.model, &engine.cache, &step)
                .expect("a graph bucket");
            through_graph.push(Vec::<i64>::try_from(logits.argmax(-1, false).to_device(Device::Cpu)).expect("tokens"));
        }
        let eager = engine.decode_step(&lens, &next);
        for tokens in &through_graph {
            assert_eq!(tokens, &eager, "{} sequences, round {round}", prompts.len());
        }
        next = eager;
        lens.iter_mut().for_each(|len| *len += 1);
    }
}

/// The paged decode kernel against the gathered path (libtorch's SDPA over a dense copy of each
/// sequence's blocks) on random bf16 queries and caches: contexts of one key, of whole and partial
/// blocks and of several of the kernel's 128-key tiles, blocks scattered through the cache; a
/// decode-only step and one whose decode rows sit between prefill chunks.
#[test]
fn paged_decode_kernel_matches_gathered_attention() {
    let Some(_gpu) = gpu_to_ourselves() else {
        return;
    };
    let _guard = tch::no_grad_guard();
    let device = Device::Cuda(0);
    let (heads, kv_heads, dim, width) = (9i64, 3i64, 64i64, 24i64);
    let kernel =
        PagedDecodeAttention::load(device, dim as usize, heads as usize, kv_heads as usize).expect("the kernel");
    tch::manual_seed(11);
    let contexts = [1i64, 16, 17, 100, 128, 129, 255, 256, 300, 384];
    let layout = PagedLayout {
        rows: contexts.len() as i64,
        width,
        spare_blocks: 5,
        block_size: BLOCK_SIZE,
        kv_heads,
        dim,
    };
    let RandomCache { keys, values, tables } = layout.random_cache(device);
    // Decode only, then the same decode rows with a 5-token prefill chunk before and after them.
    let decode = decode_only(&contexts);
    let mut mixed = vec![SeqSlice {
        first_token: 0,
        num_tokens: 5,
        context_len: 40,
    }];
    mixed.extend(decode.iter().map(|s| SeqSlice {
        first_token: s.first_token + 5,
        ..*s
    }));
    mixed.push(SeqSlice {
        first_token: 5 + contexts.len() as i64,
        num_tokens: 5,
        context_len: 5,
    });
    let mixed_tables = Tensor::cat(&[&tables.narrow(0, 0, 1), &tables, &tables.narrow(0, 1, 1)], 0);
    for (seqs, tables) in [(&decode, &tables), (&mixed, &mixed_tables)] {
        let tokens = seqs.iter().map(|s| s.num_tokens).sum::<i64>();
        let queries = Tensor::randn([tokens, heads, dim], (Kind::BFloat16, device));
        let plan = AttentionPlan::new(seqs, tables, BLOCK_SIZE, dim as usize, device, Kind::BFloat16);
        let gathered = plan.attend(&queries, &keys, &values, None).to_kind(Kind::Float);
        let paged = plan
            .attend(&queries, &keys, &values, Some(&kernel))
            .to_kind(Kind::Float);
        if seqs.len() == contexts.len() {
            // The kernel itself takes this layout (else `attend` would have gathered).
            let context = Tensor::from_slice(&contexts).to_device(device);
            let cache = PagedKeys {
                key_cache: &keys,
                value_cache: &values,
                tables,
                context: &context,
                block_size: BLOCK_SIZE,
            };
            let direct = kernel
                .attend(&queries, &cache, 1.0 / (dim as f64).sqrt())
                .expect("a launch")
                .expect("the kernel takes a decode step's layout");
            let direct = direct.to_kind(Kind::Float).view([tokens, heads * dim]);
            assert!(direct.equal(&paged), "the plan attends through the kernel");
        }
        assert_agrees(&paged, &gathered, &format!("{} sequences", seqs.len()));
    }
}

/// The kernel on shapes other than SmolLM2's — head sizes 32 and 128, groups of 1, 4, 8 and 4,
/// blocks of 1, 7, 16 and 32 tokens — and on contexts past what a table's blocks cover (the
/// kernel, like the gathered path, reads no further), against the gathered path.
#[test]
fn paged_decode_kernel_takes_other_shapes() {
    let Some(_gpu) = gpu_to_ourselves() else {
        return;
    };
    let _guard = tch::no_grad_guard();
    let device = Device::Cuda(0);
    tch::manual_seed(12);
    for (heads, kv_heads, dim, block_size) in [
        (8i64, 8i64, 128i64, 16i64),
        (16, 4, 128, 7),
        (8, 1, 32, 1),
        (12, 3, 64, 32),
    ] {
        let kernel = PagedDecodeAttention::load(device, dim as usize, heads as usize, kv_heads as usize)
            .unwrap_or_else(|error| panic!("{heads}/{kv_heads} heads of {dim}: {error}"));
        let width = 8i64;
        let contexts = [
            1,
            block_size,
            block_size + 1,
            3 * block_size + 2,
            width * block_size,
            width * block_size + 5,
        ];
        let n = contexts.len() as i64;
        let layout = PagedLayout {
            rows: n,
            width,
            spare_blocks: 3,
            block_size,
            kv_heads,
            dim,
        };
        let RandomCache { keys, values, tables } = layout.random_cache(device);
        let seqs = decode_only(&contexts);
        let queries = Tensor::randn([n, heads, dim], (Kind::BFloat16, device));
        let plan = AttentionPlan::new(&seqs, &tables, block_size, dim as usize, device, Kind::BFloat16);
        let gathered = plan.attend(&queries, &keys, &values, None).to_kind(Kind::Float);
        let context = Tensor::from_slice(&contexts).to_device(device);
        let cache = PagedKeys {
            key_cache: &keys,
            value_cache: &values,
            tables: &tables,
            context: &context,
            block_size,
        };
        let paged = kernel
            .attend(&queries, &cache, 1.0 / (dim as f64).sqrt())
            .expect("a launch")
            .expect("the kernel takes this layout")
            .to_kind(Kind::Float)
            .view([n, heads * dim]);
        assert_agrees(
            &paged,
            &gathered,
            &format!("{heads}/{kv_heads} heads of {dim}, blocks of {block_size}"),
        );
    }
}

/// A paged cache's shape for the kernel tests: `rows` tables of `width` blocks each, the blocks
/// (and `spare_blocks` more) of `block_size` slots of `kv_heads` heads of `dim`.
struct PagedLayout {
    rows: i64,
    width: i64,
    spare_blocks: i64,
    block_size: i64,
    kv_heads: i64,
    dim: i64,
}

struct RandomCache {
    keys: Tensor,
    values: Tensor,
    /// `[rows, width]`: distinct blocks scattered through the cache.
    tables: Tensor,
}

impl PagedLayout {
    /// Random bf16 keys and values, and tables naming distinct blocks in random order.
    fn random_cache(&self, device: Device) -> RandomCache {
        let pool = self.rows * self.width + self.spare_blocks;
        let shape = [pool * self.block_size, self.kv_heads, self.dim];
        let keys = Tensor::randn(shape, (Kind::BFloat16, device));
        let values = Tensor::randn(shape, (Kind::BFloat16, device));
        let tables = Tensor::randperm(pool, (Kind::Int64, device))
            .narrow(0, 0, self.rows * self.width)
            .view([self.rows, self.width]);
        RandomCache { keys, values, tables }
    }
}

/// One decode token per sequence, sequence `i` at row `i` with `contexts[i]` keys.
fn decode_only(contexts: &[i64]) -> Vec<SeqSlice> {
    contexts
        .iter()
        .enumerate()
        .map(|(i, &context)| SeqSlice {
            first_token: i as i64,
            num_tokens: 1,
            context_len: context,
        })
        .collect()
}

/// The kernel's attention against the gathered path's, within bf16's rounding: outputs of
/// magnitude ~1 are 2^-8 apart, and SDPA rounds its weights to bf16 too.
fn assert_agrees(paged: &Tensor, gathered: &Tensor, label: &str) {
    let difference = (paged - gathered).abs();
    let (max, mean) = (
        difference.max().double_value(&[]),
        difference.mean(Kind::Float).double_value(&[]),
    );
    eprintln!("{label}: max |difference| {max:.2e}, mean {mean:.2e}");
    assert!(max < 3e-2 && mean < 3e-3, "{label}: max {max}, mean {mean}");
}
