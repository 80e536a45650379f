//! Projection kernels alone: one decode step's worth of SmolLM2-shaped projections per format and
//! batch, as ms per step, GB/s of weights streamed and GFLOP/s, on each code path.
//!
//! `cargo bench -p rivulet-kernels --bench projections [-- threads [batches [formats]]]`, e.g.
//! `-- 2 1,32 Q4_1` (defaults: all cores, 1,8,32,64, Q4_1,Q4_0,Q8_0,F16).

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rivulet_gguf::GgmlType;
use rivulet_kernels::{Isa, WeightMatrix};

fn random_matrix(rng: &mut StdRng, format: GgmlType, rows: usize, cols: usize) -> WeightMatrix {
    let (block_elems, block_bytes) = format.block_layout();
    let blocks = rows * cols / block_elems as usize;
    let mut data: Vec<u8> = (0..blocks * block_bytes as usize).map(|_| rng.random()).collect();
    // Sane f16 scales at the front of each block (Q4_0/Q4_1/Q8_0 keep them there).
    for block in data.chunks_exact_mut(block_bytes as usize) {
        block[..2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        if format == GgmlType::Q4_1 {
            block[2..4].copy_from_slice(&half::f16::from_f32(-0.05).to_le_bytes());
        }
    }
    let mut matrix = WeightMatrix::new(format, rows, cols, data).expect("well-formed");
    // As the worker keeps them, unless PROJECTIONS_NO_PANELS=1 (to time the row-by-row decode).
    if std::env::var_os("PROJECTIONS_NO_PANELS").is_none() {
        matrix.add_panels();
    }
    matrix
}

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let batches: Vec<usize> = std::env::args()
        .nth(2)
        .map_or("1,8,32,64".to_owned(), |b| b)
        .split(',')
        .filter_map(|b| b.parse().ok())
        .collect();
    let formats = std::env::args()
        .nth(3)
        .unwrap_or_else(|| "Q4_1,Q4_0,Q8_0,F16".to_owned());
    // Each step runs inside this pool, as the worker runs one (see `run`).
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .start_handler(|_| rivulet_kernels::flush_subnormals_on_this_thread())
        .build()
        .expect("a thread pool");
    run(&pool, threads, &batches, &formats);
}

fn run(pool: &rayon::ThreadPool, threads: usize, batches: &[usize], formats: &str) {
    let mut rng = StdRng::seed_from_u64(1);
    // One SmolLM2-135M layer: QKV, O, gate+up, down.
    // PROJECTIONS_SHAPES=960x576,576x576 times those `rows`x`cols` matrices instead (one
    // projection's own rate, or a small one's fixed cost per call).
    let shapes: Vec<(usize, usize)> = std::env::var("PROJECTIONS_SHAPES").map_or_else(
        |_| vec![(960, 576), (576, 576), (3072, 576), (576, 1536)],
        |list| {
            list.split(',')
                .filter_map(|shape| shape.split_once('x'))
                .filter_map(|(rows, cols)| Some((rows.parse().ok()?, cols.parse().ok()?)))
                .collect()
        },
    );
    assert!(!shapes.is_empty(), "PROJECTIONS_SHAPES takes ROWSxCOLS[,ROWSxCOLS…]");
    let layers = 30;
    // PROJECTIONS_DISTINCT=n builds only n layers' matrices and cycles through them: with 1 the
    // weights stay in the caches, which separates the kernels' arithmetic from memory's share.
    let distinct = std::env::var("PROJECTIONS_DISTINCT")
        .ok()
        .and_then(|n| n.parse().ok())
        .filter(|&n: &usize| (1..=layers).contains(&n))
        .unwrap_or(layers);
    // Each layer has its own matrices, as a model does: a step streams every weight from memory
    // (one set reused 30 times would stay in the caches and flatter the small batches).
    println!(
        "threads {threads}; one step = {layers} layers of SmolLM2-135M projections (no head), {distinct} distinct"
    );
    // What the GFLOP/s column can be read against: the FMA units' peak, every thread at once.
    if let Some(peak) = rivulet_kernels::fma_peak_gflops_on(threads, Duration::from_millis(300)) {
        println!("fp32 FMA peak (the kernels' widest vectors, {threads} threads at once): {peak:.1} GFLOP/s");
    }
    println!(
        "{:<6} {:<9} {:>6} {:>10} {:>10} {:>10}",
        "format", "path", "batch", "ms/step", "GB/s", "GFLOP/s"
    );
    for format in [GgmlType::Q4_1, GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::F16] {
        if !formats.split(',').any(|f| f == format!("{format:?}")) {
            continue;
        }
        let matrices: Vec<Vec<WeightMatrix>> = (0..distinct)
            .map(|_| {
                shapes
                    .iter()
                    .map(|&(rows, cols)| random_matrix(&mut rng, format, rows, cols))
                    .collect()
            })
            .collect();
        let bytes: usize = matrices.iter().flatten().map(WeightMatrix::byte_len).sum::<usize>() * layers / distinct;
        let weights: usize = shapes.iter().map(|(r, c)| r * c).sum::<usize>() * layers;
        // PROJECTIONS_BEST_ONLY=1 skips the portable path (for a profiler).
        let paths = if std::env::var_os("PROJECTIONS_BEST_ONLY").is_some() {
            vec![Isa::best()]
        } else {
            Isa::available()
        };
        for &batch in batches {
            let inputs: Vec<Vec<f32>> = shapes
                .iter()
                .map(|&(_, cols)| (0..batch * cols).map(|_| rng.random_range(-1.0..1.0)).collect())
                .collect();
            let mut outputs: Vec<Vec<f32>> = shapes.iter().map(|&(rows, _)| vec![0.0; batch * rows]).collect();
            // A step runs as the worker runs one: inside the pool with its other threads kept
            // awake (`install_awake`), so a projection does not hand off to a sleeping thread.
            let mut step = |isa: Isa| {
                let start = Instant::now();
                rivulet_kernels::awake::install_awake(pool, || {
                    for layer in matrices.iter().cycle().take(layers) {
                        for ((m, x), out) in layer.iter().zip(&inputs).zip(outputs.iter_mut()) {
                            m.matmul_on(isa, x, batch, out).expect("shapes match");
                        }
                    }
                });
                start.elapsed().as_secs_f64()
            };
            // The portable path is for correctness and odd CPUs: one point of it past 8 rows
            // suffices.
            let timed: Vec<Isa> = paths
                .iter()
                .copied()
                .filter(|&isa| !(isa == Isa::Portable && batch > 8))
                .collect();
            // Rounds alternate the paths, so that the machine's noise falls on all of them alike;
            // each path's median round is reported.
            let rounds = if timed.contains(&Isa::Portable) { 5 } else { 15 };
            let mut times = vec![Vec::new(); timed.len()];
            timed.iter().for_each(|&isa| {
                step(isa);
            });
            for _ in 0..rounds {
                for (isa, times) in timed.iter().zip(&mut times) {
                    times.push(step(*isa));
                }
            }
            for (isa, mut times) in timed.iter().zip(times) {
                times.sort_by(f64::total_cmp);
                let seconds = times[times.len() / 2];
                println!(
                    "{:<6} {:<9} {batch:>6} {:>10.2} {:>10.1} {:>10.1}",
                    format!("{format:?}"),
                    format!("{isa:?}"),
                    seconds * 1e3,
                    bytes as f64 / seconds / 1e9,
                    2.0 * (weights * batch) as f64 / seconds / 1e9
                );
            }
        }
    }
}
