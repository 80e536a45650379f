//! Every kernel against dequantize-then-matmul (the GGUF reader's scalar dequantization, which
//! mirrors llama.cpp's, and an f64 product) on random blocks of every supported format, odd
//! shapes, several batch sizes, and both code paths.

use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rivulet_gguf::GgmlType;
use rivulet_kernels::{Isa, WeightMatrix};

/// Byte offsets of the f16 scales in one block of `format` (random bytes there could be NaN).
fn scale_offsets(format: GgmlType) -> &'static [usize] {
    match format {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[],
    }
}

fn random_matrix(rng: &mut StdRng, format: GgmlType, rows: usize, cols: usize) -> WeightMatrix {
    let elements = rows * cols;
    let data: Vec<u8> = match format {
        GgmlType::F32 => (0..elements)
            .flat_map(|_| rng.random_range(-1.0f32..1.0).to_le_bytes())
            .collect(),
        GgmlType::F16 => (0..elements)
            .flat_map(|_| f16::from_f32(rng.random_range(-1.0..1.0)).to_le_bytes())
            .collect(),
        GgmlType::BF16 => (0..elements)
            .flat_map(|_| bf16::from_f32(rng.random_range(-1.0..1.0)).to_le_bytes())
            .collect(),
        _ => {
            let (block_elems, block_bytes) = format.block_layout();
            let blocks = elements / block_elems as usize;
            let mut data: Vec<u8> = (0..blocks * block_bytes as usize).map(|_| rng.random()).collect();
            for block in data.chunks_exact_mut(block_bytes as usize) {
                for &at in scale_offsets(format) {
                    let scale = f16::from_f32(rng.random_range(-0.05..0.05));
                    block[at..at + 2].copy_from_slice(&scale.to_le_bytes());
                }
            }
            data
        }
    };
    WeightMatrix::new(format, rows, cols, data).expect("a well-formed matrix")
}

fn check(rng: &mut StdRng, format: GgmlType, rows: usize, cols: usize, batch: usize) {
    let matrix = random_matrix(rng, format, rows, cols);
    check_matrix(rng, &matrix, batch);
    // The same values through the panels (the AVX-512 products, and the AVX2 panel GEMV and
    // packed path's other decoder).
    let mut with_panels = matrix;
    with_panels.add_panels();
    if matches!(format, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0) && Isa::best() != Isa::Portable {
        assert!(with_panels.has_panels());
        assert!(with_panels.resident_bytes() > with_panels.byte_len());
    }
    check_matrix(rng, &with_panels, batch);
    // Panels alone (the worker lets the blocks go): the same rows read back, the same
    // products whichever path is asked for.
    let dense = with_panels.dequantize();
    let mut panels_only = with_panels;
    if panels_only.keep_only_panels() {
        assert_eq!(panels_only.resident_bytes(), panels_only.byte_len());
        assert!(panels_only
            .dequantize()
            .iter()
            .zip(&dense)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        check_matrix(rng, &panels_only, batch);
    }
}

/// `matrix · x` for a random `x` of `batch` rows, on every code path, against an f64 product of
/// the dequantized values.
fn check_matrix(rng: &mut StdRng, matrix: &WeightMatrix, batch: usize) {
    let (format, rows, cols) = (matrix.format(), matrix.rows(), matrix.cols());
    let dense = matrix.dequantize();
    let x: Vec<f32> = (0..batch * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
    for isa in Isa::available() {
        let mut out = vec![f32::NAN; batch * rows];
        matrix.matmul_on(isa, &x, batch, &mut out).expect("shapes match");
        for b in 0..batch {
            for r in 0..rows {
                let (mut exact, mut magnitude) = (0f64, 0f64);
                for k in 0..cols {
                    let term = dense[r * cols + k] as f64 * x[b * cols + k] as f64;
                    exact += term;
                    magnitude += term.abs();
                }
                let got = out[b * rows + r] as f64;
                // f32 summation in another order: a few ulps of the terms' magnitude.
                let tolerance = 2e-6 * magnitude + 1e-6;
                assert!(
                    (got - exact).abs() <= tolerance,
                    "{format:?} {isa:?} {rows}x{cols} batch {batch}: [{b}][{r}] = {got}, expected {exact}"
                );
            }
        }
    }
}

#[test]
fn every_format_matches_dequantize_then_matmul() {
    let mut rng = StdRng::seed_from_u64(15);
    let block_formats = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
    ];
    let k_formats = [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K];
    let dense_formats = [GgmlType::F32, GgmlType::F16, GgmlType::BF16];
    // 1–8 rows take the in-register path, more the packed one (AVX2).
    for batch in [1, 2, 3, 8, 13] {
        for &format in &block_formats {
            // 544 and 1056 cross the 512-value tile boundary mid-row; 7 and 13 rows leave partial strips.
            for (rows, cols) in [(1, 32), (7, 96), (13, 544), (9, 1056)] {
                check(&mut rng, format, rows, cols, batch);
            }
        }
        for &format in &k_formats {
            for (rows, cols) in [(3, 256), (6, 768)] {
                check(&mut rng, format, rows, cols, batch);
            }
        }
        for &format in &dense_formats {
            for (rows, cols) in [(5, 7), (4, 40), (11, 600)] {
                check(&mut rng, format, rows, cols, batch);
            }
        }
    }
}

#[test]
fn larger_batches_and_many_tasks() {
    let mut rng = StdRng::seed_from_u64(16);
    // Enough rows that the work splits into many tasks, and batches of odd size.
    check(&mut rng, GgmlType::Q4_1, 203, 576, 33);
    check(&mut rng, GgmlType::Q8_0, 130, 64, 17);
}

/// Batches the AVX-512 panel path sweeps in several tiles of activation rows (256 KiB of them a
/// tile: 112 rows of 576 values, 40 of 1536), the last tile partial and not a whole pass.
#[test]
fn batches_of_several_row_tiles() {
    let mut rng = StdRng::seed_from_u64(23);
    for format in [GgmlType::Q4_1, GgmlType::Q8_0] {
        check(&mut rng, format, 37, 1536, 85);
        check(&mut rng, format, 21, 576, 229);
    }
}

/// The tile path (AMX, where the CPU has it; 16+ rows): whole and partial tiles of activation
/// rows, an odd number of blocks per row, a last partial panel of weight rows, and tasks of
/// several groups of panels (300 rows are 19 panels, four a task on two threads). On a CPU
/// without AMX the same products run on the other paths.
#[test]
fn tile_sized_batches_match() {
    let mut rng = StdRng::seed_from_u64(19);
    for format in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        for batch in [16, 17, 32, 45] {
            for (rows, cols) in [(16, 32), (37, 544), (20, 1056), (300, 96)] {
                check(&mut rng, format, rows, cols, batch);
            }
        }
    }
}

/// Two 4-bit panels a pass (AVX-512, from four activation rows on): every pass size, a pair and
/// a last lone panel (37 rows), whole pairs only (64 rows), an odd number of blocks per row.
#[test]
fn panel_pairs_match() {
    let mut rng = StdRng::seed_from_u64(29);
    for format in [GgmlType::Q4_0, GgmlType::Q4_1] {
        for batch in [4, 5, 6, 7, 9] {
            for (rows, cols) in [(37, 96), (64, 544)] {
                check(&mut rng, format, rows, cols, batch);
            }
        }
    }
}

/// Pairs of panels decoded into L1 and multiplied in register tiles (AVX-512, from twelve
/// activation rows on): one tile and several (25 rows are tiles of 9, 8 and 8), a pair and a
/// last lone panel (37 rows), one tile of columns and several with a partial last one (96 and
/// 544 columns are 3 and 17 blocks, four blocks a tile).
#[test]
fn packed_register_tiles_match() {
    let mut rng = StdRng::seed_from_u64(31);
    for format in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        for batch in [12, 13, 25, 36] {
            for (rows, cols) in [(37, 96), (64, 544), (16, 160)] {
                check(&mut rng, format, rows, cols, batch);
            }
        }
    }
}

#[test]
fn bad_shapes_are_errors_not_panics() {
    let mut rng = StdRng::seed_from_u64(17);
    let matrix = random_matrix(&mut rng, GgmlType::Q4_1, 4, 64);
    let mut out = vec![0f32; 4];
    assert!(matrix.matmul(&[0.0; 63], 1, &mut out).is_err());
    assert!(matrix.matmul(&[0.0; 64], 1, &mut out[..3]).is_err());
    assert!(WeightMatrix::new(GgmlType::Q4_1, 4, 48, vec![0; 4 * 30]).is_err());
    assert!(WeightMatrix::new(GgmlType::Q4_1, 4, 64, vec![0; 159]).is_err());
    assert!(WeightMatrix::new(GgmlType::Q2K, 1, 256, vec![0; 84]).is_err());
}

#[test]
fn stacking_keeps_rows_in_order() {
    let mut rng = StdRng::seed_from_u64(18);
    let a = random_matrix(&mut rng, GgmlType::Q8_0, 3, 64);
    let b = random_matrix(&mut rng, GgmlType::Q8_0, 2, 64);
    let stacked = WeightMatrix::stack(&[a.clone(), b.clone()]).expect("same format");
    assert_eq!(stacked.rows(), 5);
    let mut expected = a.dequantize();
    expected.extend(b.dequantize());
    assert_eq!(stacked.dequantize(), expected);
    let other = random_matrix(&mut rng, GgmlType::Q4_0, 2, 64);
    assert!(WeightMatrix::stack(&[a, other]).is_none());
}

/// Two matrices filling one fused output side by side (as the worker's separate Q, K and V
/// projections do) give, on every path, the columns each gives alone, and leave the others.
#[test]
fn products_into_columns_of_a_wider_output() {
    let mut rng = StdRng::seed_from_u64(20);
    for batch in [3, 16, 21] {
        let mut left = random_matrix(&mut rng, GgmlType::Q4_1, 37, 64);
        let mut right = random_matrix(&mut rng, GgmlType::Q8_0, 20, 64);
        left.add_panels();
        right.add_panels();
        let x: Vec<f32> = (0..batch * 64).map(|_| rng.random_range(-2.0..2.0)).collect();
        let width = 37 + 20 + 5;
        for isa in Isa::available() {
            let mut fused = vec![7.0f32; batch * width];
            left.matmul_into_columns(isa, &x, batch, &mut fused, width, 0)
                .expect("fits");
            right
                .matmul_into_columns(isa, &x, batch, &mut fused, width, 37)
                .expect("fits");
            let (mut alone_left, mut alone_right) = (vec![0f32; batch * 37], vec![0f32; batch * 20]);
            left.matmul_on(isa, &x, batch, &mut alone_left).expect("fits");
            right.matmul_on(isa, &x, batch, &mut alone_right).expect("fits");
            for b in 0..batch {
                let row = &fused[b * width..(b + 1) * width];
                assert_eq!(&row[..37], &alone_left[b * 37..(b + 1) * 37], "{isa:?} batch {batch}");
                assert_eq!(
                    &row[37..57],
                    &alone_right[b * 20..(b + 1) * 20],
                    "{isa:?} batch {batch}"
                );
                assert!(
                    row[57..].iter().all(|&v| v == 7.0),
                    "{isa:?} batch {batch}: columns past both"
                );
            }
        }
    }
}

/// A matrix of empty rows gives zeros on every path, whatever the batch (tile-sized ones too).
#[test]
fn empty_rows_give_zeros() {
    for format in [GgmlType::Q4_1, GgmlType::Q8_0] {
        let mut matrix = WeightMatrix::new(format, 20, 0, Vec::new()).expect("empty rows are whole blocks");
        matrix.add_panels();
        for batch in [1, 16, 33] {
            for isa in Isa::available() {
                let mut out = vec![f32::NAN; batch * 20];
                matrix.matmul_on(isa, &[], batch, &mut out).expect("shapes match");
                assert!(out.iter().all(|&v| v == 0.0), "{format:?} {isa:?} batch {batch}");
            }
        }
    }
}
