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
