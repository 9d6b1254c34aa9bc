//! Quality and consistency of the quantizers: ggml's own round-trip error bounds
//! (tests/test-quantize-fns.cpp), Q8_K block sums, degenerate inputs.

use nextn_quant::formats::{self, can_quantize, dequantize, quantize, Block, BlockQ8K};
use nextn_quant::GgmlType;

/// ggml's synthetic test data: `0.1 + amplitude * cos(i + offset)`.
fn ggml_test_data(offset: f32, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (0.1f64 + (2.0f32 * (i as f32 + offset).cos()) as f64) as f32)
        .collect()
}

/// ggml's `array_rmse`: sqrt of the summed squared error, divided by n (not by sqrt(n)).
fn ggml_rmse(a: &[f32], b: &[f32]) -> f32 {
    let sum: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum();
    sum.sqrt() as f32 / a.len() as f32
}

fn round_trip(ty: GgmlType, x: &[f32]) -> Vec<f32> {
    let bytes = ty.row_bytes(x.len() as u64).expect("whole blocks") as usize;
    let mut q = vec![0u8; bytes];
    quantize(ty, x, &mut q).unwrap_or_else(|e| panic!("{ty}: {e}"));
    let mut y = vec![0.0f32; x.len()];
    dequantize(ty, &q, &mut y).unwrap_or_else(|e| panic!("{ty}: {e}"));
    y
}

#[test]
fn round_trip_error_within_ggml_bounds() {
    // Same size, data and thresholds as ggml's test-quantize-fns.
    let x = ggml_test_data(0.0, 32 * 128);
    let mut report = Vec::new();
    for ty in GgmlType::all().filter(|&ty| can_quantize(ty)) {
        let bound = match ty {
            GgmlType::Q2_K => 0.0075,
            GgmlType::Q3_K => 0.0040,
            _ => 0.002,
        };
        let err = ggml_rmse(&x, &round_trip(ty, &x));
        report.push(format!("{ty}: {err:.6} (bound {bound})"));
        assert!(
            err < bound,
            "{ty}: round-trip error {err} not below {bound}\n{}",
            report.join("\n")
        );
    }
    println!("{}", report.join("\n"));
}

#[test]
fn more_bits_give_smaller_errors() {
    // A deterministic pseudo-random Gaussian-ish row (sum of uniforms).
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let x: Vec<f32> = (0..4096)
        .map(|_| (0..4).map(|_| uniform()).sum::<f32>())
        .collect();
    let rel = |ty| {
        let y = round_trip(ty, &x);
        let num: f64 = x
            .iter()
            .zip(&y)
            .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
            .sum();
        let den: f64 = x.iter().map(|&a| (a as f64).powi(2)).sum();
        (num / den).sqrt()
    };
    use GgmlType::*;
    let chain = [Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K];
    let errs: Vec<f64> = chain.iter().map(|&ty| rel(ty)).collect();
    for w in 0..chain.len() - 1 {
        assert!(
            errs[w] > errs[w + 1],
            "{:?} error {} not above {:?} error {}",
            chain[w],
            errs[w],
            chain[w + 1],
            errs[w + 1]
        );
    }
    // Rough expectations for a Gaussian row (relative RMS error).
    assert!(errs[2] < 0.12, "Q4_K {}", errs[2]);
    assert!(errs[4] < 0.03, "Q6_K {}", errs[4]);
    assert!(errs[5] < 0.01, "Q8_K {}", errs[5]);
}

#[test]
fn q8k_block_sums_match_the_codes() {
    let x = ggml_test_data(1.0, 4 * 256);
    let mut blocks = [BlockQ8K::default(); 4];
    formats::quantize_k::quantize_row_q8_k(&x, &mut blocks).unwrap();
    for (bi, b) in blocks.iter().enumerate() {
        for i in 0..16 {
            let sum: i32 = b.qs[16 * i..16 * i + 16].iter().map(|&q| q as i32).sum();
            assert_eq!(b.bsum(i) as i32, sum, "block {bi} group {i}");
        }
        // The element of largest magnitude maps to ±127 exactly.
        assert!(b.qs.iter().any(|&q| q == 127 || q == -127), "block {bi}");
        assert!(b.d() != 0.0);
    }
    // Byte view and typed view agree.
    let mut bytes = vec![0u8; 4 * BlockQ8K::BYTES];
    formats::quantize(GgmlType::Q8_K, &x, &mut bytes).unwrap();
    assert_eq!(formats::blocks_as_bytes(&blocks), &bytes[..]);
}

#[test]
fn zero_rows_quantize_to_zero_blocks_and_back() {
    let x = vec![0.0f32; 512];
    for ty in GgmlType::all().filter(|&ty| can_quantize(ty)) {
        let y = round_trip(ty, &x);
        assert!(y.iter().all(|&v| v == 0.0), "{ty}: {:?}", &y[..8]);
    }
}

#[test]
fn non_finite_inputs_do_not_panic() {
    let mut x = ggml_test_data(2.0, 512);
    x[3] = f32::NAN;
    x[300] = f32::INFINITY;
    x[301] = f32::NEG_INFINITY;
    x[400] = f32::MAX;
    x[401] = f32::MIN_POSITIVE / 4.0;
    for ty in GgmlType::all().filter(|&ty| can_quantize(ty)) {
        let _ = round_trip(ty, &x);
    }
}

#[test]
fn typed_rows_match_the_byte_entry_points() {
    let x = ggml_test_data(3.0, 512);
    let mut typed = [formats::BlockQ4K::default(); 2];
    formats::quantize_k::quantize_row_q4_k(&x, &mut typed).unwrap();
    let mut bytes = vec![0u8; 2 * 144];
    quantize(GgmlType::Q4_K, &x, &mut bytes).unwrap();
    assert_eq!(formats::blocks_as_bytes(&typed), &bytes[..]);

    let viewed: &[formats::BlockQ4K] = formats::blocks_from_bytes(&bytes).unwrap();
    let mut a = vec![0.0f32; 512];
    let mut b = vec![0.0f32; 512];
    formats::kquants::dequantize_row_q4_k(viewed, &mut a).unwrap();
    dequantize(GgmlType::Q4_K, &bytes, &mut b).unwrap();
    assert_eq!(a, b);
}

/// A deterministic Gaussian-ish row (sum of 4 uniforms), as `more_bits_give_smaller_errors`.
fn gaussian_ish(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    (0..n)
        .map(|_| (0..4).map(|_| uniform()).sum::<f32>())
        .collect()
}

fn quantize_weighted_round_trip(ty: GgmlType, x: &[f32], w: Option<&[f32]>) -> Vec<f32> {
    let bytes = ty.row_bytes(x.len() as u64).expect("whole blocks") as usize;
    let mut q = vec![0u8; bytes];
    formats::quantize_with_importance(ty, x, &mut q, w).unwrap_or_else(|e| panic!("{ty}: {e}"));
    let mut y = vec![0.0f32; x.len()];
    dequantize(ty, &q, &mut y).unwrap_or_else(|e| panic!("{ty}: {e}"));
    y
}

#[test]
fn importance_weights_lower_the_weighted_error() {
    // What an importance matrix is for: columns that matter (large weight) are reproduced
    // more faithfully, at the expense of the others. Over many rows, the error weighted by
    // the importance must then be lower than without weights, for every type that uses them.
    const ROW: usize = 1024;
    let x = gaussian_ish(ROW * 16, 0x9e37_79b9_7f4a_7c15);
    // One column in eight matters a thousand times more than the rest.
    let w: Vec<f32> = (0..ROW)
        .map(|i| if i % 8 == 3 { 1000.0 } else { 1.0 })
        .collect();
    let weighted_error = |y: &[f32]| -> f64 {
        x.iter()
            .zip(y)
            .enumerate()
            .map(|(i, (&a, &b))| w[i % ROW] as f64 * (a as f64 - b as f64).powi(2))
            .sum()
    };
    for ty in GgmlType::all().filter(|&t| formats::uses_importance(t)) {
        let plain = weighted_error(&quantize_weighted_round_trip(ty, &x, None));
        let with = weighted_error(&quantize_weighted_round_trip(ty, &x, Some(&w)));
        assert!(
            with < plain,
            "{ty}: weighted error {with} with importance, {plain} without"
        );
    }
}

#[test]
fn weighted_quantizers_handle_degenerate_rows() {
    let w: Vec<f32> = (0..512).map(|i| (i % 5) as f32).collect();
    let mut bad = ggml_test_data(2.0, 512);
    bad[3] = f32::NAN;
    bad[300] = f32::INFINITY;
    bad[301] = f32::NEG_INFINITY;
    bad[400] = f32::MAX;
    bad[401] = f32::MIN_POSITIVE / 4.0;
    for ty in GgmlType::all().filter(|&t| formats::uses_importance(t)) {
        // Zeros stay zeros, with any weights (zero weights included).
        let y = quantize_weighted_round_trip(ty, &[0.0; 512], Some(&w));
        assert!(y.iter().all(|&v| v == 0.0), "{ty}: {:?}", &y[..8]);
        let y = quantize_weighted_round_trip(ty, &[0.0; 512], Some(&[0.0; 512]));
        assert!(y.iter().all(|&v| v == 0.0), "{ty}");
        // Non-finite values and all-zero weights give some bytes, without panicking.
        let _ = quantize_weighted_round_trip(ty, &bad, Some(&w));
        let _ = quantize_weighted_round_trip(ty, &ggml_test_data(0.5, 512), Some(&[0.0; 512]));
    }
}

#[test]
fn iq4_errors_sit_between_q3_k_and_q5_k() {
    let x = gaussian_ish(4096, 0x2545_f491_4f6c_dd1d);
    let rel = |ty| {
        let y = round_trip(ty, &x);
        let num: f64 = x
            .iter()
            .zip(&y)
            .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
            .sum();
        let den: f64 = x.iter().map(|&a| (a as f64).powi(2)).sum();
        (num / den).sqrt()
    };
    use GgmlType::*;
    for ty in [IQ4_NL, IQ4_XS] {
        let e = rel(ty);
        assert!(rel(Q3_K) > e && e > rel(Q5_K), "{ty}: {e}");
    }
}
