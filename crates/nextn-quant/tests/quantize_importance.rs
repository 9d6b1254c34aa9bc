//! Byte-for-byte comparison with ggml's `ggml_quantize_chunk`, without and with an importance
//! matrix, on the rows of `tests/vectors/ggml`.
//!
//! The vectors come from `tests/vectors/ggml/gen_ggml_ref.c`, a small C program linked
//! against ggml-base as llama.cpp's CMake builds it (the library llama-quantize runs); its
//! header has the build and run commands, and `manifest.txt` names the llama.cpp commit.
//! To refresh them after a ggml change: build llama.cpp (`cmake -B build && cmake --build
//! build`), compile the program against `build/bin/libggml-base`, run it with this
//! directory as output, and run this test.
//!
//! The rows (16 x 512) include an all-zero row, a zero super-block, constants, tiny and
//! large magnitudes, sparse outliers, exact grid values and per-sub-block ranges; the
//! importance weights include zero columns and a zero 32-column block.

use nextn_quant::formats::{self, can_quantize, quantize_with_importance, uses_importance};
use nextn_quant::{GgmlType, QuantError};
use std::path::{Path, PathBuf};

const N_PER_ROW: usize = 512;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vectors/ggml")
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn read(name: &str) -> Vec<u8> {
    std::fs::read(dir().join(name)).unwrap_or_else(|e| panic!("tests/vectors/ggml/{name}: {e}"))
}

struct Case {
    ty: GgmlType,
    imatrix: bool,
    expected: Vec<u8>,
}

/// The manifest's cases; ggml's type names are lower case (`q4_K`, `iq4_xs`).
fn cases() -> Vec<Case> {
    let manifest = String::from_utf8(read("manifest.txt")).expect("manifest is UTF-8");
    let mut out = Vec::new();
    for line in manifest.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.len(), 3, "bad manifest line {line:?}");
        let ty = GgmlType::from_name(&f[0].to_uppercase())
            .unwrap_or_else(|| panic!("unknown type {}", f[0]));
        out.push(Case {
            ty,
            imatrix: f[1] == "imatrix",
            expected: read(f[2]),
        });
    }
    out
}

fn first_difference(ty: GgmlType, got: &[u8], want: &[u8]) -> Option<String> {
    let i = got.iter().zip(want).position(|(a, b)| a != b)?;
    let bs = ty.type_size();
    let row_bytes = got.len() / (got.len() * ty.block_size() / bs / N_PER_ROW).max(1);
    let b = i / bs;
    Some(format!(
        "{ty}: row {}, block {} of the row, byte {}\n  got  {:02x?}\n  want {:02x?}",
        i / row_bytes,
        (i % row_bytes) / bs,
        i % bs,
        &got[b * bs..(b + 1) * bs],
        &want[b * bs..(b + 1) * bs]
    ))
}

#[test]
fn quantize_matches_ggml_quantize_chunk_with_and_without_importance() {
    let rows = f32s(&read("rows.f32"));
    let imatrix = f32s(&read("imatrix.f32"));
    assert_eq!(imatrix.len(), N_PER_ROW);
    let cases = cases();
    let mut failures = Vec::new();
    for case in &cases {
        let mut got = vec![0u8; case.expected.len()];
        let importance = case.imatrix.then_some(imatrix.as_slice());
        // As llama-quantize calls it: the whole chunk at once, one weight per column.
        quantize_with_importance(case.ty, &rows, &mut got, importance)
            .unwrap_or_else(|e| panic!("{}: {e}", case.ty));
        if let Some(d) = first_difference(case.ty, &got, &case.expected) {
            failures.push(format!(
                "[{}] {d}",
                if case.imatrix { "imatrix" } else { "none" }
            ));
        }
        // Row by row gives the same bytes (what a converter that works per row does).
        let row_bytes = case.expected.len() / (rows.len() / N_PER_ROW);
        let mut per_row = vec![0u8; case.expected.len()];
        for (x, y) in rows
            .chunks_exact(N_PER_ROW)
            .zip(per_row.chunks_exact_mut(row_bytes))
        {
            quantize_with_importance(case.ty, x, y, importance)
                .unwrap_or_else(|e| panic!("{}: {e}", case.ty));
        }
        assert_eq!(per_row, got, "{} row by row", case.ty);
        if !case.imatrix {
            // Without weights this is plain `quantize`.
            let mut plain = vec![0u8; case.expected.len()];
            formats::quantize(case.ty, &rows, &mut plain).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(plain, got, "{}", case.ty);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Every type that uses weights is covered, with and without them.
    for ty in GgmlType::all().filter(|&t| uses_importance(t)) {
        for imatrix in [false, true] {
            assert!(
                cases.iter().any(|c| c.ty == ty && c.imatrix == imatrix),
                "no ggml vectors for {ty} (imatrix {imatrix})"
            );
        }
    }
}

#[test]
fn importance_changes_the_result_only_where_ggml_uses_it() {
    let rows = f32s(&read("rows.f32"));
    let imatrix = f32s(&read("imatrix.f32"));
    for ty in GgmlType::all().filter(|&t| can_quantize(t) && t.block_size() <= 256) {
        let n = ty.row_bytes(rows.len() as u64).unwrap_or(0) as usize;
        let (mut plain, mut weighted) = (vec![0u8; n], vec![0u8; n]);
        formats::quantize(ty, &rows, &mut plain).unwrap_or_else(|e| panic!("{ty}: {e}"));
        quantize_with_importance(ty, &rows, &mut weighted, Some(&imatrix))
            .unwrap_or_else(|e| panic!("{ty}: {e}"));
        assert_eq!(plain != weighted, uses_importance(ty), "{ty}");
    }
}

#[test]
fn importance_weights_must_describe_whole_rows() {
    let x = [0.5f32; 512];
    let mut dst = vec![0u8; GgmlType::Q4_K.type_size() * 2];
    // Not a whole number of blocks.
    let err =
        quantize_with_importance(GgmlType::Q4_K, &x, &mut dst, Some(&[1.0; 128])).unwrap_err();
    assert_eq!(
        err,
        QuantError::ImportanceShape {
            ty: GgmlType::Q4_K,
            weights: 128,
            n: 512,
            block: 256
        }
    );
    assert_eq!(
        err.to_string(),
        "Q4_K: 128 importance weights (one per column) do not split 512 elements into whole \
         rows of whole 256-element blocks"
    );
    // Rows that do not divide the source, and no weights at all.
    let mut q8 = vec![0u8; GgmlType::Q8_0.type_size() * 16];
    for w in [&[1.0f32; 96][..], &[]] {
        assert!(matches!(
            quantize_with_importance(GgmlType::Q8_0, &x, &mut q8, Some(w)),
            Err(QuantError::ImportanceShape { .. })
        ));
    }
    // The destination is checked as for `quantize`.
    assert!(matches!(
        quantize_with_importance(GgmlType::Q4_K, &x, &mut dst[1..], Some(&[1.0; 256])),
        Err(QuantError::SizeMismatch { .. })
    ));
    // A type without a quantizer is refused with or without weights.
    assert!(matches!(
        quantize_with_importance(GgmlType::IQ2_XXS, &x, &mut dst, Some(&[1.0; 256])),
        Err(QuantError::NoSuchOp { .. })
    ));
    // Several rows share the weights; empty input is fine.
    let mut two = vec![0u8; GgmlType::Q4_0.type_size() * 16];
    quantize_with_importance(GgmlType::Q4_0, &x, &mut two, Some(&[1.0; 256])).unwrap();
    quantize_with_importance(GgmlType::Q4_0, &[], &mut [], Some(&[1.0; 32])).unwrap();
}
