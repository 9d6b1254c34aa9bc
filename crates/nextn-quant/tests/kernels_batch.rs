//! A row's result must not depend on its batch: not on which rows share it, on the row
//! count, on the thread count, or on how output rows are split among threads.

mod kernels_common;

use kernels_common::*;
use nextn_quant::kernels::{QMatrix, SimdLevel, ThreadPool};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Matrices big enough (over 64 KiB, more than 16 rows) that mul_rows really splits them
/// across threads.
fn shape(ty: nextn_quant::GgmlType) -> (usize, usize) {
    let cols = if ty.block_size() == 1 { 1003 } else { 2048 };
    (112, cols)
}

#[test]
fn row_results_independent_of_batch_and_threads() {
    let mut levels = simd_levels_under_test();
    levels.push(SimdLevel::Scalar);
    let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
    let mut rng = Rng::new(10);
    for &ty in all_types() {
        let (rows, cols) = shape(ty);
        let data = random_matrix(ty, rows, cols, &mut rng);
        let m = QMatrix::new(ty, rows, cols, &data).unwrap();
        // Row 8 duplicates row 0, so a batch can hold one row twice.
        let mut x = random_acts(8, cols, &mut rng);
        x.extend_from_within(..cols);
        let row = |i: usize| &x[i * cols..(i + 1) * cols];
        for &level in &levels {
            // Each activation row alone on one thread is the yardstick.
            let alone: Vec<Vec<u32>> = (0..9)
                .map(|i| {
                    let mut out = vec![0f32; rows];
                    m.mul_rows_with(level, row(i), 1, &mut out, &pools[0])
                        .unwrap();
                    bits(&out)
                })
                .collect();
            for pool in &pools {
                for n in 1..=8 {
                    // Batches with different companions: rows rotated by `n` and duplicates.
                    let members: Vec<usize> = (0..n).map(|k| (k * 5 + n) % 9).collect();
                    let batch: Vec<f32> = members
                        .iter()
                        .flat_map(|&i| row(i).iter().copied())
                        .collect();
                    let mut out = vec![0f32; n * rows];
                    m.mul_rows_with(level, &batch, n, &mut out, pool).unwrap();
                    for (k, &i) in members.iter().enumerate() {
                        assert_eq!(
                            bits(&out[k * rows..(k + 1) * rows]),
                            alone[i],
                            "{ty} {level}: activation row {i} at position {k} of {n}, {} threads",
                            pool.n_threads()
                        );
                    }
                }
            }
            // More than 8 rows go through several passes; still the same per row.
            let big: Vec<f32> = (0..11).flat_map(|k| row(k % 9).iter().copied()).collect();
            let mut out = vec![0f32; 11 * rows];
            m.mul_rows_with(level, &big, 11, &mut out, &pools[1])
                .unwrap();
            for k in 0..11 {
                assert_eq!(
                    bits(&out[k * rows..(k + 1) * rows]),
                    alone[k % 9],
                    "{ty} {level}: 11-row batch, row {k}"
                );
            }
        }
    }
}

/// A weight row's result must not depend on where the row falls in the split: the same
/// rows inside a small (single-task) and a large (multi-task) matrix agree.
#[test]
fn row_results_independent_of_split() {
    let mut levels = simd_levels_under_test();
    levels.push(SimdLevel::Scalar);
    let pool = ThreadPool::new(3);
    let mut rng = Rng::new(11);
    for &ty in all_types() {
        let (rows, cols) = shape(ty);
        let data = random_matrix(ty, rows, cols, &mut rng);
        let big = QMatrix::new(ty, rows, cols, &data).unwrap();
        let rb = big.row_bytes();
        // Rows 40..45 on their own: below every threading threshold.
        let small = QMatrix::new(ty, 5, cols, &data[40 * rb..45 * rb]).unwrap();
        let x = random_acts(3, cols, &mut rng);
        for &level in &levels {
            let mut out_big = vec![0f32; 3 * rows];
            let mut out_small = vec![0f32; 3 * 5];
            big.mul_rows_with(level, &x, 3, &mut out_big, &pool)
                .unwrap();
            small
                .mul_rows_with(level, &x, 3, &mut out_small, &pool)
                .unwrap();
            for i in 0..3 {
                assert_eq!(
                    bits(&out_big[i * rows + 40..i * rows + 45]),
                    bits(&out_small[i * 5..i * 5 + 5]),
                    "{ty} {level}"
                );
            }
        }
    }
}

/// A matrix too small to split by output rows, over many activation rows (a small model's
/// prefill): its passes go to different threads, and every row still gets the bits it gets
/// alone on one thread.
#[test]
fn passes_split_among_threads_on_small_matrices() {
    let mut levels = simd_levels_under_test();
    levels.push(SimdLevel::Scalar);
    let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
    let mut rng = Rng::new(12);
    for &ty in all_types() {
        let (rows, cols) = (48, 256);
        let data = random_matrix(ty, rows, cols, &mut rng);
        let m = QMatrix::new(ty, rows, cols, &data).unwrap();
        let n = 29;
        let x = random_acts(n, cols, &mut rng);
        for &level in &levels {
            let alone: Vec<u32> = (0..n)
                .flat_map(|i| {
                    let mut out = vec![0f32; rows];
                    m.mul_rows_with(level, &x[i * cols..(i + 1) * cols], 1, &mut out, &pools[0])
                        .unwrap();
                    bits(&out)
                })
                .collect();
            for pool in &pools {
                let mut out = vec![0f32; n * rows];
                m.mul_rows_with(level, &x, n, &mut out, pool).unwrap();
                assert_eq!(
                    bits(&out),
                    alone,
                    "{ty} {level}, {} threads",
                    pool.n_threads()
                );
            }
        }
    }
}
