//! The reference kernels against `formats::dequantize` (an independent implementation of
//! the block layouts): with activations that the vec_dot conversion represents exactly,
//! the quantized dot product must equal the f64 dot of the dequantized weights, up to
//! f32 rounding.

mod kernels_common;

use kernels_common::*;
use nextn_quant::kernels::{QMatrix, ThreadPool};
use nextn_quant::GgmlType;

/// Activations k·2^-4 with integer |k| <= 60 and one ±127 per 32 values: Q8_0/Q8_1/Q8_K
/// quantization reproduces them exactly (the scale is a power of two), as do F16 and
/// BF16; block sums stay below 2048 so Q8_1's f16 `s` is exact too.
fn representable_acts(n_rows: usize, cols: usize, rng: &mut Rng) -> Vec<f32> {
    let step = 1.0 / 16.0;
    let mut x = vec![0f32; n_rows * cols];
    for (j, v) in x.iter_mut().enumerate() {
        let k = if j % 32 == (j / 32) % 32 {
            127.0 * rng.sign()
        } else {
            rng.below(121) as f32 - 60.0
        };
        *v = k * step;
    }
    x
}

#[test]
fn reference_matches_dequantized_weights() {
    let pool = ThreadPool::new(2);
    let mut rng = Rng::new(20);
    for &ty in all_types() {
        let (rows, cols) = (19, test_cols(ty));
        let data = random_matrix(ty, rows, cols, &mut rng);
        let w = dequantize_matrix(ty, &data, rows, cols);
        let x = representable_acts(3, cols, &mut rng);
        let bounds = magnitude_bounds(ty, &data, rows, cols, &x, 3);
        let m = QMatrix::new(ty, rows, cols, &data).unwrap();
        let mut reference = vec![0f32; 3 * rows];
        let mut fast = vec![0f32; 3 * rows];
        m.mul_rows_reference(&x, 3, &mut reference).unwrap();
        m.mul_rows(&x, 3, &mut fast, &pool).unwrap();
        for i in 0..3 {
            for r in 0..rows {
                let exact: f64 = (0..cols)
                    .map(|j| w[r * cols + j] as f64 * x[i * cols + j] as f64)
                    .sum();
                let tol = 1e-5 * bounds[i * rows + r] + 1e-30;
                for (name, got) in [
                    ("reference", reference[i * rows + r]),
                    ("mul_rows", fast[i * rows + r]),
                ] {
                    assert!(
                        (got as f64 - exact).abs() <= tol,
                        "{ty} {name} row {i}/{r}: got {got} want {exact} (tol {tol:e})"
                    );
                }
            }
        }
    }
}

#[test]
fn shape_and_type_errors() {
    use nextn_quant::QuantError;
    let data = vec![0u8; 2 * 18];
    assert!(QMatrix::new(GgmlType::Q4_0, 1, 64, &data).is_ok());
    assert!(matches!(
        QMatrix::new(GgmlType::Q4_0, 2, 64, &data),
        Err(QuantError::SizeMismatch { .. })
    ));
    assert!(matches!(
        QMatrix::new(GgmlType::Q4_0, 1, 48, &data),
        Err(QuantError::PartialBlock { .. })
    ));
    assert!(matches!(
        QMatrix::new(GgmlType::IQ2_XXS, 1, 256, &data),
        Err(QuantError::NoSuchOp { .. })
    ));
    assert!(matches!(
        QMatrix::new(GgmlType::F32, usize::MAX / 2, 4, &data),
        Err(QuantError::ShapeTooLarge { .. })
    ));

    let m = QMatrix::new(GgmlType::Q4_0, 1, 64, &data).unwrap();
    let pool = ThreadPool::new(1);
    let mut out = vec![0f32; 2];
    assert!(matches!(
        m.mul_rows(&[0.0; 100], 2, &mut out, &pool),
        Err(QuantError::SizeMismatch { .. })
    ));
    assert!(matches!(
        m.mul_rows(&[0.0; 128], 2, &mut out[..1], &pool),
        Err(QuantError::SizeMismatch { .. })
    ));
    assert!(m.mul_rows(&[0.0; 128], 2, &mut out, &pool).is_ok());
    assert!(m.mul_rows(&[], 0, &mut [], &pool).is_ok());
    // A hand-built inconsistent matrix is refused, not read out of bounds.
    let bad = QMatrix {
        layout: nextn_quant::kernels::Layout::Ggml,
        ty: GgmlType::Q4_0,
        rows: 3,
        cols: 64,
        data: &data,
    };
    assert!(bad.mul_rows(&[0.0; 64], 1, &mut [0.0; 3], &pool).is_err());
    assert!(bad
        .mul_rows_reference(&[0.0; 64], 1, &mut [0.0; 3])
        .is_err());
}

#[test]
fn unsupported_simd_level_is_an_error() {
    use nextn_quant::kernels::SimdLevel;
    let data = vec![0u8; 18];
    let m = QMatrix::new(GgmlType::Q4_0, 1, 32, &data).unwrap();
    let pool = ThreadPool::new(1);
    for level in [SimdLevel::Avx2, SimdLevel::Avx512, SimdLevel::Neon] {
        let r = m.mul_rows_with(level, &[1.0; 32], 1, &mut [0.0], &pool);
        assert_eq!(r.is_ok(), level.is_supported(), "{level}");
    }
}
