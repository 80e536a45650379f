//! One row's sampling alone, on one thread: µs per row of SmolLM2's vocabulary (49 152) for the
//! settings clients send most, beside the greedy reading of the same rows.
//!
//! `cargo bench -p rivulet-kernels --bench sampling`
//!
//! The rows are synthetic but shaped like a language model's: logits normally spread (σ 2.5)
//! with, in half the rows, one token far ahead (a confident step) and, in the other half, twenty
//! within a unit of each other (an uncertain one).

use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rivulet_kernels::logits::summarize_row;
use rivulet_kernels::sampling::{draw, DrawParams};

const VOCAB: usize = 49_152;
const ROWS: usize = 64;
const REPEATS: usize = 5;

fn model_like_rows(rng: &mut StdRng) -> Vec<Vec<f32>> {
    (0..ROWS)
        .map(|r| {
            let mut row: Vec<f32> = (0..VOCAB)
                .map(|_| {
                    // Box–Muller.
                    let (u, v): (f64, f64) = (rng.random_range(1e-12..1.0), rng.random());
                    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * 2.5) as f32
                })
                .collect();
            if r % 2 == 0 {
                row[rng.random_range(0..VOCAB)] = 14.0;
            } else {
                for _ in 0..20 {
                    row[rng.random_range(0..VOCAB)] = 9.0 + rng.random::<f32>();
                }
            }
            row
        })
        .collect()
}

/// The best of `REPEATS` passes over every row, in µs per row.
fn time_per_row(rows: &[Vec<f32>], mut per_row: impl FnMut(usize, &[f32]) -> usize) -> f64 {
    let mut best = f64::INFINITY;
    let mut checksum = 0usize;
    for _ in 0..REPEATS {
        let started = Instant::now();
        for (i, row) in rows.iter().enumerate() {
            checksum = checksum.wrapping_add(per_row(i, row));
        }
        best = best.min(started.elapsed().as_secs_f64() * 1e6 / rows.len() as f64);
    }
    std::hint::black_box(checksum);
    best
}

fn main() {
    let rows = model_like_rows(&mut StdRng::seed_from_u64(3));
    let plain = DrawParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 0,
        draw_index: 0,
    };
    let settings = [
        ("temperature 1", plain),
        (
            "temperature 0.7, top-p 0.9, top-k 50",
            DrawParams {
                temperature: 0.7,
                top_p: 0.9,
                top_k: 50,
                ..plain
            },
        ),
        ("temperature 1, top-p 0.95", DrawParams { top_p: 0.95, ..plain }),
        ("temperature 1, top-k 40", DrawParams { top_k: 40, ..plain }),
        ("temperature 1, min-p 0.05", DrawParams { min_p: 0.05, ..plain }),
    ];
    println!("{:<40} {:>10}", "one row of 49 152 logits", "µs / row");
    let greedy = time_per_row(&rows, |_, row| summarize_row(row).argmax);
    println!("{:<40} {greedy:>10.1}", "greedy (argmax + log-normalizer)");
    let mut weights = Vec::new();
    for (name, params) in settings {
        let micros = time_per_row(&rows, |i, row| {
            draw(
                row,
                &DrawParams {
                    seed: i as i64,
                    ..params
                },
                &mut weights,
            )
        });
        println!("{name:<40} {micros:>10.1}");
    }
}
