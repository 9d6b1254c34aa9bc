//! Bit-exact comparison with the reference vectors of `tools/gen_quant_vectors.py`
//! (gguf-py's numpy dequantizers and quantizers; ggml's reference C quantizers for the
//! K-quants), plus the size and support errors. The quantizers gguf-py lacks (IQ4_NL,
//! IQ4_XS) are checked against ggml in `quantize_importance.rs` instead, on the vectors of
//! `tests/vectors/ggml`.

use nextn_quant::formats::{
    self, can_dequantize, can_quantize, check_supported, dequantize, quantize,
};
use nextn_quant::{GgmlType, QuantError};
use std::path::{Path, PathBuf};

struct Case {
    op: String,
    ty: GgmlType,
    n: usize,
    input: Vec<u8>,
    expected: Vec<u8>,
}

fn vectors_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vectors")
}

fn load_cases() -> Vec<Case> {
    let dir = vectors_dir();
    let manifest =
        std::fs::read_to_string(dir.join("manifest.txt")).expect("tests/vectors/manifest.txt");
    let mut cases = Vec::new();
    for line in manifest.lines() {
        let line = line.split('#').next().unwrap_or("");
        if line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.len(), 5, "bad manifest line {line:?}");
        let ty = GgmlType::from_name(f[1]).unwrap_or_else(|| panic!("unknown type {}", f[1]));
        cases.push(Case {
            op: f[0].to_string(),
            ty,
            n: f[2].parse().expect("element count"),
            input: std::fs::read(dir.join(f[3])).expect(f[3]),
            expected: std::fs::read(dir.join(f[4])).expect(f[4]),
        });
    }
    cases
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn manifest_covers_every_supported_type() {
    let cases = load_cases();
    for ty in GgmlType::all() {
        if can_dequantize(ty) {
            assert!(
                cases.iter().any(|c| c.op == "dequantize" && c.ty == ty),
                "no dequantize vectors for {ty}"
            );
        }
    }
    let ggml_manifest = std::fs::read_to_string(vectors_dir().join("ggml/manifest.txt"))
        .expect("tests/vectors/ggml/manifest.txt");
    // ggml names types in lower case (`q4_K`, `iq4_xs`).
    let in_ggml_vectors = |ty: GgmlType| {
        ggml_manifest
            .lines()
            .filter(|l| !l.starts_with('#'))
            .any(|l| l.split_whitespace().next() == Some(ty.name().to_lowercase().as_str()))
    };
    for ty in GgmlType::all().filter(|&ty| can_quantize(ty)) {
        assert!(
            cases.iter().any(|c| c.op == "quantize" && c.ty == ty) || in_ggml_vectors(ty),
            "no quantize vectors for {ty}"
        );
    }
}

#[test]
fn dequantize_matches_gguf_py_bit_for_bit() {
    let mut failures = Vec::new();
    for case in load_cases().iter().filter(|c| c.op == "dequantize") {
        let expected = f32s(&case.expected);
        assert_eq!(expected.len(), case.n, "{}", case.ty);
        let mut got = vec![0.0f32; case.n];
        dequantize(case.ty, &case.input, &mut got).unwrap_or_else(|e| panic!("{}: {e}", case.ty));
        let block = case.ty.block_size();
        let bad: Vec<usize> = (0..case.n)
            .filter(|&i| got[i].to_bits() != expected[i].to_bits())
            .collect();
        if let Some(&i) = bad.first() {
            failures.push(format!(
                "{}: {} of {} differ; first at element {i} (block {}): got {:e} ({:#010x}), want {:e} ({:#010x})",
                case.ty,
                bad.len(),
                case.n,
                i / block,
                got[i],
                got[i].to_bits(),
                expected[i],
                expected[i].to_bits()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn quantize_matches_reference_bit_for_bit() {
    let mut failures = Vec::new();
    for case in load_cases().iter().filter(|c| c.op == "quantize") {
        let src = f32s(&case.input);
        assert_eq!(src.len(), case.n, "{}", case.ty);
        let mut got = vec![0u8; case.expected.len()];
        quantize(case.ty, &src, &mut got).unwrap_or_else(|e| panic!("{}: {e}", case.ty));
        if let Some(i) = (0..got.len()).find(|&i| got[i] != case.expected[i]) {
            let bytes = case.ty.type_size();
            let b = i / bytes;
            failures.push(format!(
                "{}: byte {i} (block {b}, offset {}) differs\n  got  {:02x?}\n  want {:02x?}",
                case.ty,
                i % bytes,
                &got[b * bytes..(b + 1) * bytes],
                &case.expected[b * bytes..(b + 1) * bytes]
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn partial_blocks_are_refused() {
    let mut dst = vec![0.0f32; 48];
    let err = dequantize(GgmlType::Q4_0, &[0u8; 18], &mut dst).unwrap_err();
    assert_eq!(
        err,
        QuantError::PartialBlock {
            ty: GgmlType::Q4_0,
            n: 48,
            block: 32
        }
    );
    assert_eq!(
        err.to_string(),
        "Q4_0: 48 elements is not a whole number of 32-element blocks"
    );

    let err = quantize(GgmlType::Q4_K, &[0.0f32; 300], &mut [0u8; 144]).unwrap_err();
    assert_eq!(
        err,
        QuantError::PartialBlock {
            ty: GgmlType::Q4_K,
            n: 300,
            block: 256
        }
    );
}

#[test]
fn mismatched_buffers_are_refused() {
    let mut dst = vec![0.0f32; 64];
    let err = dequantize(GgmlType::Q8_0, &[0u8; 34 * 2 + 1], &mut dst).unwrap_err();
    assert!(
        matches!(
            err,
            QuantError::SizeMismatch {
                expected: 68,
                got: 69,
                ..
            }
        ),
        "{err}"
    );
    let err = dequantize(GgmlType::F16, &[0u8; 6], &mut [0.0f32; 4]).unwrap_err();
    assert!(
        matches!(
            err,
            QuantError::SizeMismatch {
                expected: 8,
                got: 6,
                ..
            }
        ),
        "{err}"
    );

    let err = quantize(GgmlType::Q6_K, &[0.0f32; 256], &mut [0u8; 211]).unwrap_err();
    assert!(
        matches!(
            err,
            QuantError::SizeMismatch {
                expected: 210,
                got: 211,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("expected 210, got 211"), "{err}");

    // The typed row functions check their own lengths too.
    let blocks = [formats::BlockQ4K::default(); 2];
    let err = formats::kquants::dequantize_row_q4_k(&blocks, &mut [0.0f32; 256]).unwrap_err();
    assert!(
        matches!(
            err,
            QuantError::SizeMismatch {
                expected: 512,
                got: 256,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn unsupported_types_are_refused_with_the_tensor_name() {
    let err = check_supported(GgmlType::IQ2_XXS, "blk.0.ffn_up.weight").unwrap_err();
    assert_eq!(
        err.to_string(),
        "unsupported tensor type IQ2_XXS in tensor blk.0.ffn_up.weight"
    );
    assert_eq!(
        err,
        QuantError::UnsupportedTensorType {
            ty: GgmlType::IQ2_XXS,
            tensor: "blk.0.ffn_up.weight".into()
        }
    );
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::BF16,
        GgmlType::MXFP4,
        GgmlType::IQ4_XS,
    ] {
        assert_eq!(check_supported(ty, "t"), Ok(()), "{ty}");
    }
    for ty in [
        GgmlType::IQ1_S,
        GgmlType::TQ1_0,
        GgmlType::Q8_1,
        GgmlType::I32,
        GgmlType::NVFP4,
    ] {
        assert!(check_supported(ty, "t").is_err(), "{ty}");
        assert!(!can_dequantize(ty) && !can_quantize(ty), "{ty}");
    }

    let err = dequantize(GgmlType::IQ2_XXS, &[0u8; 66], &mut [0.0f32; 256]).unwrap_err();
    assert_eq!(
        err,
        QuantError::NoSuchOp {
            ty: GgmlType::IQ2_XXS,
            op: "dequantize"
        }
    );
    let err = quantize(GgmlType::IQ2_XXS, &[0.0f32; 256], &mut [0u8; 66]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "quantize is not available for tensor type IQ2_XXS"
    );
}

#[test]
fn supported_sets_are_as_documented() {
    use GgmlType::*;
    for ty in [
        F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ4_NL,
        IQ4_XS, MXFP4,
    ] {
        assert!(can_dequantize(ty), "{ty}");
    }
    for ty in [
        F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ4_NL,
        IQ4_XS, MXFP4,
    ] {
        assert!(can_quantize(ty), "{ty}");
    }
    assert!(!can_quantize(IQ2_XXS) && !can_quantize(IQ3_S) && !can_quantize(Q8_1));
    for ty in [
        Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS,
    ] {
        assert!(formats::uses_importance(ty), "{ty}");
    }
    for ty in [F32, F16, BF16, Q8_0, Q8_K, MXFP4] {
        assert!(!formats::uses_importance(ty), "{ty}");
    }
}

#[test]
fn empty_rows_are_fine() {
    dequantize(GgmlType::Q4_K, &[], &mut []).unwrap();
    quantize(GgmlType::Q8_0, &[], &mut []).unwrap();
}
