//! Byte-for-byte comparison with llama.cpp's `llama-quantize` (no importance matrix).
//!
//! The golden fixtures in `../shared/golden` hold, next to an F32 model, files that
//! llama.cpp's `llama-quantize` (commit 34af94cd, 1 thread, no `--imatrix`) made from it; the
//! exact commands are in each fixture's `golden.json` ("commands"). Every tensor of those files
//! comes from the same-named F32 tensor, quantized row by row to the type the quantization mix
//! picked for it (Q4_K_M holds Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors, IQ4_XS holds IQ4_XS,
//! IQ4_NL, Q5_1 and Q6_K, ...). This test quantizes each F32 tensor with
//! [`formats::quantize`] to the type found in the file and requires identical bytes for every
//! type we quantize; a summary per type (tensors identical / differing, first differing
//! block) is printed either way, so `--nocapture` shows where a port drifts.

use nextn_gguf::{GgufFile, TensorInfo};
use nextn_quant::formats::{self, can_quantize};
use nextn_quant::GgmlType;
use std::collections::BTreeMap;
use std::path::Path;

/// The fixture directories and, in each, the F32 source and the files quantized from it.
const FIXTURES: &[(&str, &[&str])] = &[
    (
        "q35-dense-a",
        &["F16", "BF16", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS"],
    ),
    ("q35moe-a", &["Q8_0", "Q4_K_M"]),
];

#[derive(Default)]
struct TypeTally {
    identical: usize,
    differing: usize,
    bytes: usize,
    first_difference: Option<String>,
}

/// The F32 tensor's rows as f32 (the file is little-endian, as every GGUF we read).
fn f32_rows(file: &GgufFile, t: &TensorInfo) -> Vec<f32> {
    let mut out = vec![0.0f32; t.n_elements as usize];
    formats::dequantize(GgmlType::F32, file.tensor_data(t), &mut out)
        .unwrap_or_else(|e| panic!("{}: {e}", t.name));
    out
}

/// Quantizes `src` (rows of `row_len` values) to `ty`, one `formats::quantize` call per row
/// as `ggml_quantize_chunk` does (row-local quantizers make the split irrelevant, but the
/// call pattern of a converter is what is under test).
fn quantize_rows(ty: GgmlType, src: &[f32], row_len: usize) -> Vec<u8> {
    let row_bytes = ty.row_bytes(row_len as u64).expect("row of whole blocks") as usize;
    let n_rows = src.len() / row_len;
    let mut out = vec![0u8; row_bytes * n_rows];
    for (x, y) in src
        .chunks_exact(row_len)
        .zip(out.chunks_exact_mut(row_bytes))
    {
        formats::quantize(ty, x, y).unwrap_or_else(|e| panic!("{ty}: {e}"));
    }
    out
}

/// Compares one quantized file with the quantization of its F32 source; adds to `tally`.
fn compare_file(
    source: &GgufFile,
    path: &Path,
    tally: &mut BTreeMap<String, TypeTally>,
    skipped: &mut BTreeMap<String, usize>,
) {
    let file = GgufFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file_name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    for t in file.tensors() {
        if !can_quantize(t.ty) {
            *skipped.entry(t.ty.name().to_string()).or_default() += 1;
            continue;
        }
        let s = source
            .tensor(&t.name)
            .unwrap_or_else(|| panic!("{file_name}: {} missing from the F32 file", t.name));
        assert_eq!(s.ty, GgmlType::F32, "{}", t.name);
        assert_eq!(s.dims, t.dims, "{}", t.name);
        let row_len = t.dims[0] as usize;
        let got = quantize_rows(t.ty, &f32_rows(source, s), row_len);
        let want = file.tensor_data(t);
        assert_eq!(got.len(), want.len(), "{file_name}: {} size", t.name);
        let entry = tally.entry(t.ty.name().to_string()).or_default();
        entry.bytes += want.len();
        match got.iter().zip(want).position(|(a, b)| a != b) {
            None => entry.identical += 1,
            Some(i) => {
                entry.differing += 1;
                if entry.first_difference.is_none() {
                    let block_bytes = t.ty.type_size();
                    let row_bytes = got.len() / t.n_rows().max(1) as usize;
                    let b = i / block_bytes;
                    let blocks = &(b * block_bytes..(b + 1) * block_bytes);
                    let n_diff = got
                        .chunks_exact(block_bytes)
                        .zip(want.chunks_exact(block_bytes))
                        .filter(|(a, b)| a != b)
                        .count();
                    entry.first_difference = Some(format!(
                        "{file_name} {} (ne {:?}): row {}, block {} of the row, byte {} of the \
                         block; {n_diff} of {} blocks differ\n      got  {:02x?}\n      want {:02x?}",
                        t.name,
                        t.dims,
                        i / row_bytes,
                        (i % row_bytes) / block_bytes,
                        i % block_bytes,
                        got.len() / block_bytes,
                        &got[blocks.clone()],
                        &want[blocks.clone()],
                    ));
                }
            }
        }
    }
}

#[test]
fn quantize_matches_llama_quantize_byte_for_byte() {
    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    let mut tally: BTreeMap<String, TypeTally> = BTreeMap::new();
    let mut skipped: BTreeMap<String, usize> = BTreeMap::new();
    for (fixture, variants) in FIXTURES {
        let dir = golden.join(fixture);
        let source_path = dir.join(format!("{fixture}-F32.gguf"));
        let source = GgufFile::open(&source_path)
            .unwrap_or_else(|e| panic!("{}: {e}", source_path.display()));
        for variant in *variants {
            let path = dir.join(format!("{fixture}-{variant}.gguf"));
            compare_file(&source, &path, &mut tally, &mut skipped);
        }
    }

    let mut report = String::from("type     identical differing   bytes\n");
    for (ty, t) in &tally {
        report += &format!(
            "{ty:<8} {:>9} {:>9} {:>7}\n",
            t.identical, t.differing, t.bytes
        );
    }
    for (ty, n) in &skipped {
        report += &format!("{ty:<8} skipped: {n} tensors (no quantizer)\n");
    }
    let failures: Vec<String> = tally
        .iter()
        .filter_map(|(ty, t)| {
            t.first_difference
                .as_ref()
                .map(|d| format!("  {ty}: first difference in {d}"))
        })
        .collect();
    eprintln!("{report}{}", failures.join("\n"));
    assert!(
        failures.is_empty(),
        "tensors differ from llama-quantize:\n{}",
        failures.join("\n")
    );
    // Every type of the fixtures has a quantizer; a skipped type would hide a gap.
    assert!(skipped.is_empty(), "types without a quantizer: {skipped:?}");
}
