//! Every SIMD path against the scalar reference, for every weight type and 1..8 rows.

mod kernels_common;

use kernels_common::*;
use nextn_quant::kernels::{QMatrix, SimdLevel, ThreadPool};

/// Relative tolerance on Σ|terms|: the integer parts are exact, only the f32 summation
/// order differs between paths.
const REL_TOL: f64 = 1e-5;

#[test]
fn simd_paths_match_reference() {
    let levels = simd_levels_under_test();
    let pool = ThreadPool::new(2);
    let mut rng = Rng::new(1);
    for &ty in all_types() {
        let (rows, cols) = (37, test_cols(ty));
        let data = random_matrix(ty, rows, cols, &mut rng);
        let m = QMatrix::new(ty, rows, cols, &data).unwrap();
        let x = random_acts(8, cols, &mut rng);
        let bounds = magnitude_bounds(ty, &data, rows, cols, &x, 8);
        let mut want = vec![0f32; 8 * rows];
        m.mul_rows_reference(&x, 8, &mut want).unwrap();
        for &level in &levels {
            for n in 1..=8 {
                let mut got = vec![0f32; n * rows];
                m.mul_rows_with(level, &x[..n * cols], n, &mut got, &pool)
                    .unwrap();
                for k in 0..n * rows {
                    let err = (got[k] as f64 - want[k] as f64).abs();
                    let tol = REL_TOL * bounds[k] + 1e-30;
                    assert!(
                        err <= tol,
                        "{ty} {level} n={n} row {} out {}: got {} want {} (err {err:e}, tol {tol:e})",
                        k / rows,
                        k % rows,
                        got[k],
                        want[k]
                    );
                }
            }
        }
    }
}

#[test]
fn scalar_level_is_the_reference_bit_for_bit() {
    let pool = ThreadPool::new(3);
    let mut rng = Rng::new(2);
    for &ty in all_types() {
        let (rows, cols) = (70, test_cols(ty));
        let data = random_matrix(ty, rows, cols, &mut rng);
        let m = QMatrix::new(ty, rows, cols, &data).unwrap();
        let x = random_acts(5, cols, &mut rng);
        let mut want = vec![0f32; 5 * rows];
        let mut got = vec![0f32; 5 * rows];
        m.mul_rows_reference(&x, 5, &mut want).unwrap();
        m.mul_rows_with(SimdLevel::Scalar, &x, 5, &mut got, &pool)
            .unwrap();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{ty}"
        );
    }
}

/// Results stay finite and sensible on real quantized data: mul_rows against an f64 dot
/// of the dequantized weights with the unquantized activations (so this also bounds the
/// error of the activation quantization, ~1%).
#[test]
fn quantized_products_are_close_to_float_products() {
    let pool = ThreadPool::new(2);
    let mut rng = Rng::new(3);
    let (rows, cols) = (24, 512);
    let w: Vec<f32> = (0..rows * cols).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let x: Vec<f32> = (0..2 * cols).map(|_| rng.uniform(-1.0, 1.0)).collect();
    for &ty in all_types() {
        if !nextn_quant::formats::can_quantize(ty) {
            eprintln!("skipped: formats cannot quantize {ty}");
            continue;
        }
        let rb = ty.row_bytes(cols as u64).unwrap() as usize;
        let mut data = vec![0u8; rows * rb];
        for r in 0..rows {
            nextn_quant::formats::quantize(
                ty,
                &w[r * cols..(r + 1) * cols],
                &mut data[r * rb..(r + 1) * rb],
            )
            .unwrap();
        }
        let wd = dequantize_matrix(ty, &data, rows, cols);
        let m = QMatrix::new(ty, rows, cols, &data).unwrap();
        let mut got = vec![0f32; 2 * rows];
        m.mul_rows(&x, 2, &mut got, &pool).unwrap();
        for i in 0..2 {
            for r in 0..rows {
                let mut exact = 0f64;
                let mut mag = 0f64;
                for j in 0..cols {
                    let t = wd[r * cols + j] as f64 * x[i * cols + j] as f64;
                    exact += t;
                    mag += t.abs();
                }
                let err = (got[i * rows + r] as f64 - exact).abs();
                assert!(
                    err <= 0.02 * mag,
                    "{ty} row {i}/{r}: got {} want {exact} (Σ|t| {mag})",
                    got[i * rows + r]
                );
            }
        }
    }
}
