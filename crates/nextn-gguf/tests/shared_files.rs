//! Every GGUF under ../shared and the committed gguf-py fixtures: opens, matches the
//! golden.json inventory, and rewrites byte for byte.

mod common;

use std::path::Path;

use nextn_gguf::{GgufFile, GgufWriter};

/// Open, check every tensor's data slice, rewrite and compare with the original bytes.
fn check_file(path: &Path) -> GgufFile {
    let f = GgufFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(f.shard_paths(), &[path.to_path_buf()]);
    for t in f.tensors() {
        let data = f.tensor_data(t);
        assert_eq!(
            data.len() as u64,
            t.n_bytes,
            "{}: tensor {}",
            path.display(),
            t.name
        );
        assert_eq!(t.file_offset % f.alignment(), 0, "{}", t.name);
        assert_eq!(f.tensor(&t.name), Some(t));
    }
    let original = std::fs::read(path).unwrap();
    assert_eq!(f.file_size(), original.len() as u64);
    let rewritten = GgufWriter::from_file(&f).to_bytes().unwrap();
    assert!(
        rewritten == original,
        "{}: rewrite differs (len {} vs {}, first difference at byte {:?})",
        path.display(),
        rewritten.len(),
        original.len(),
        rewritten.iter().zip(&original).position(|(a, b)| a != b)
    );
    // A canonical re-layout of a llama.cpp/gguf-py file is the same file: they pad with zeros.
    let mut canonical = GgufWriter::from_file(&f);
    canonical.discard_preserved_layout();
    assert!(
        canonical.to_bytes().unwrap() == original,
        "{}",
        path.display()
    );
    f
}

/// The `files` inventory of a golden.json: file name -> (tensor count, {name: (type, ne)}).
fn check_against_golden(dir: &Path) {
    let Ok(text) = std::fs::read_to_string(dir.join("golden.json")) else {
        return;
    };
    let golden: serde_json::Value = serde_json::from_str(&text).unwrap();
    let files = golden["files"].as_object().expect("golden.json has files");
    for (variant, entry) in files {
        let path = dir.join(entry["file"].as_str().unwrap());
        if !path.is_file() {
            continue;
        }
        let f = GgufFile::open(&path).unwrap();
        let tensors = entry["tensors"].as_object().unwrap();
        assert_eq!(f.tensors().len(), tensors.len(), "{variant}");
        assert_eq!(f.file_size(), entry["bytes"].as_u64().unwrap(), "{variant}");
        assert_eq!(
            f.get_u32("general.file_type").unwrap().map(u64::from),
            entry["general_file_type"].as_u64(),
            "{variant}"
        );
        for (name, spec) in tensors {
            let t = f
                .tensor(name)
                .unwrap_or_else(|| panic!("{variant}: no tensor {name}"));
            assert_eq!(t.ty.name(), spec[0].as_str().unwrap(), "{variant} {name}");
            let ne: Vec<u64> = spec[1]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            assert_eq!(t.dims, ne, "{variant} {name}");
        }
    }
}

#[test]
fn every_shared_gguf_opens_and_round_trips() {
    let Some(shared) = nextn_testdata::shared_dir() else {
        return;
    };
    let files = common::gguf_files_under(&shared);
    assert!(!files.is_empty(), "no .gguf under {}", shared.display());
    for path in &files {
        let f = check_file(path);
        assert!(!f.tensors().is_empty(), "{}", path.display());
        assert!(f.get_str("general.architecture").unwrap().is_some());
    }
    let mut dirs: Vec<_> = files.iter().filter_map(|p| p.parent()).collect();
    dirs.dedup();
    for dir in dirs {
        check_against_golden(dir);
    }
    println!("checked {} files", files.len());
}

#[test]
fn shared_model_metadata_reads_as_spec_types() {
    let Some(path) = nextn_testdata::shared("golden/q35-dense-a/q35-dense-a-Q4_K_M.gguf") else {
        return;
    };
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.get_str("general.architecture").unwrap(), Some("qwen35"));
    assert_eq!(f.get_u32("qwen35.embedding_length").unwrap(), Some(256));
    assert_eq!(f.get_u32("qwen35.block_count").unwrap(), Some(9));
    let sections = f
        .get_array("qwen35.rope.dimension_sections")
        .unwrap()
        .unwrap();
    assert_eq!(sections.element_type_name(), "i32");
    assert_eq!(sections.len(), 4);
    let tokens = f.get_array("tokenizer.ggml.tokens").unwrap().unwrap();
    assert_eq!(tokens.as_strings().map(|t| t.len()), Some(2000));
    assert!(f
        .get_f32("qwen35.attention.layer_norm_rms_epsilon")
        .unwrap()
        .is_some());
    assert!(f
        .get_bool("tokenizer.ggml.add_bos_token")
        .unwrap()
        .is_some());
    // Wrong-type requests name the key.
    let err = f.get_str("qwen35.block_count").unwrap_err();
    assert!(err.to_string().contains("qwen35.block_count"), "{err}");
}

#[test]
fn gguf_py_fixture_with_every_value_type() {
    use nextn_gguf::{GgmlType, GgufError, MetadataValue};
    let path = common::data_dir().join("gguf_py_all_types.gguf");
    let f = check_file(&path);
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.get_u32("t.u8").unwrap(), Some(200));
    assert!(matches!(
        f.get_u32("t.i8"),
        Err(GgufError::MetadataType { ref key, .. }) if key == "t.i8"
    ));
    assert_eq!(f.get_i64("t.i8").unwrap(), Some(-100));
    assert_eq!(f.get_u32("t.u16").unwrap(), Some(60000));
    assert_eq!(f.get_i32("t.i16").unwrap(), Some(-30000));
    assert_eq!(f.get_u64("t.u32").unwrap(), Some(4_000_000_000));
    assert_eq!(f.get_i64("t.i32").unwrap(), Some(-2_000_000_000));
    assert_eq!(f.get_f32("t.f32").unwrap(), Some(1.5));
    assert_eq!(f.get_bool("t.bool").unwrap(), Some(true));
    assert_eq!(f.get_str("t.str").unwrap(), Some("héllo ✓"));
    assert_eq!(f.get_u64("t.u64").unwrap(), Some((1u64 << 63) + 5));
    assert_eq!(f.get_i64("t.i64").unwrap(), Some(-(1i64 << 62)));
    assert_eq!(f.get("t.f64"), Some(&MetadataValue::F64(-2.25)));
    assert_eq!(f.get_f32("t.f64").unwrap(), Some(-2.25));
    let arr = |k: &str| f.get_array(k).unwrap().unwrap();
    assert_eq!(arr("t.arr.i32").as_i32_vec(), Some(vec![1, -2, 3]));
    assert_eq!(arr("t.arr.f32").as_f32_vec(), Some(vec![0.5, -1.0]));
    assert_eq!(arr("t.arr.str").as_strings().unwrap(), ["a", "", "ünï"]);
    assert_eq!(arr("t.arr.bool").as_bools().unwrap(), [true, false, true]);
    let nested = arr("t.arr.nested").as_arrays().unwrap();
    assert_eq!(nested[0].as_i32_vec(), Some(vec![1, 2]));
    assert_eq!(nested[1].as_i32_vec(), Some(vec![3]));
    let q8 = f.tensor("q8.d").unwrap();
    assert_eq!(
        (q8.ty, q8.dims.clone(), q8.n_bytes),
        (GgmlType::Q8_0, vec![32, 2], 68)
    );
    let a = f.tensor("f32.a").unwrap();
    assert_eq!(a.dims, vec![4, 3]);
    let values: Vec<f32> = f
        .tensor_data(a)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(values, (0..12).map(|i| i as f32).collect::<Vec<_>>());
}
