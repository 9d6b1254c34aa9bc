use super::*;

fn reparse(w: &GgufWriter) -> GgufFile {
    GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()
}

#[test]
fn empty_file_is_just_the_header() {
    let bytes = GgufWriter::new().to_bytes().unwrap();
    let mut expected = b"GGUF".to_vec();
    expected.extend_from_slice(&3u32.to_le_bytes());
    expected.extend_from_slice(&[0; 16]);
    assert_eq!(bytes, expected);
    // Even with a huge alignment: there is no data section to align.
    let mut w = GgufWriter::new();
    w.set_alignment(1 << 40);
    let bytes = w.to_bytes().unwrap();
    assert!(bytes.len() < 64);
    assert_eq!(reparse(&w).alignment(), 1 << 40);
}

#[test]
fn fresh_layout_is_aligned_and_zero_padded() {
    let mut w = GgufWriter::new();
    w.set_alignment(64);
    w.add_tensor("a", vec![3], GgmlType::F32, vec![0xAA; 12])
        .unwrap();
    w.add_tensor("b", vec![32, 2], GgmlType::Q8_0, vec![0xBB; 68])
        .unwrap();
    let bytes = w.to_bytes().unwrap();
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.get("general.alignment"), Some(&MetadataValue::U32(64)));
    let (a, b) = (f.tensor("a").unwrap(), f.tensor("b").unwrap());
    assert_eq!((a.offset, b.offset), (0, 64));
    assert_eq!(bytes.len() as u64, b.file_offset + 128);
    let gap = &bytes[(a.file_offset + 12) as usize..b.file_offset as usize];
    assert!(gap.iter().all(|&x| x == 0));
    assert_eq!(f.tensor_data(b), &[0xBB; 68][..]);
}

#[test]
fn add_tensor_checks() {
    let mut w = GgufWriter::new();
    let e = w
        .add_tensor("a", vec![4], GgmlType::F32, vec![0; 15])
        .unwrap_err();
    assert!(
        matches!(
            e,
            GgufError::TensorSizeMismatch {
                expected: 16,
                found: 15,
                ..
            }
        ),
        "{e}"
    );
    w.add_tensor("a", vec![4], GgmlType::F32, vec![0; 16])
        .unwrap();
    let e = w
        .add_tensor("a", vec![4], GgmlType::F32, vec![0; 16])
        .unwrap_err();
    assert!(matches!(e, GgufError::DuplicateTensor { .. }));
    let e = w
        .add_tensor("q", vec![31], GgmlType::Q4_0, vec![0; 18])
        .unwrap_err();
    assert!(matches!(e, GgufError::PartialBlock { .. }));
    let e = w
        .add_tensor("z", vec![], GgmlType::F32, vec![])
        .unwrap_err();
    assert!(matches!(e, GgufError::TensorDimCount { .. }));
    let e = w
        .add_tensor("z", vec![1; 5], GgmlType::F32, vec![0; 4])
        .unwrap_err();
    assert!(matches!(e, GgufError::TensorDimCount { n_dims: 5, .. }));
    let e = w
        .add_tensor("x".repeat(64), vec![1], GgmlType::F32, vec![0; 4])
        .unwrap_err();
    assert!(matches!(e, GgufError::TensorNameTooLong { .. }));
    assert_eq!(w.tensor_count(), 1);
    assert!(w.remove_tensor("a"));
    assert!(!w.remove_tensor("a"));
    assert_eq!(w.tensor_count(), 0);
}

#[test]
fn write_refuses_what_readers_refuse() {
    let mut w = GgufWriter::new();
    w.add_kv("k", MetadataValue::U8(1));
    w.add_kv("k", MetadataValue::U8(2));
    assert!(
        matches!(w.to_bytes(), Err(GgufError::DuplicateKey { ref key, offset: 38 }) if key == "k")
    );

    let mut w = GgufWriter::new();
    w.set_version(1);
    assert!(matches!(
        w.to_bytes(),
        Err(GgufError::UnsupportedWriteVersion { version: 1 })
    ));
    w.set_version(2);
    assert_eq!(reparse(&w).version(), 2);

    let mut w = GgufWriter::new();
    w.set_alignment(24);
    assert!(matches!(
        w.to_bytes(),
        Err(GgufError::BadAlignment { value: 24, .. })
    ));

    let mut deep = MetadataArray::U8(vec![1]);
    for _ in 0..MAX_ARRAY_DEPTH {
        deep = MetadataArray::Array(vec![deep]);
    }
    let mut w = GgufWriter::new();
    w.add_kv("deep", deep);
    assert!(matches!(
        w.to_bytes(),
        Err(GgufError::NestingTooDeep { .. })
    ));
}

#[test]
fn set_kv_replaces_in_place() {
    let mut w = GgufWriter::new();
    w.add_kv("a", MetadataValue::U32(1));
    w.add_kv("b", MetadataValue::U32(2));
    w.set_kv("a", "now a string");
    w.set_kv("c", MetadataValue::Bool(true));
    let keys: Vec<_> = w.kvs().iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["a", "b", "c"]);
    let f = reparse(&w);
    assert_eq!(f.get_str("a").unwrap(), Some("now a string"));
    assert_eq!(w.remove_kv("b"), Some(MetadataValue::U32(2)));
    assert_eq!(w.get("b"), None);
}

#[test]
fn editing_a_parsed_file_relays_out_when_needed() {
    let mut w = GgufWriter::new();
    w.add_tensor("a", vec![4], GgmlType::F32, vec![1; 16])
        .unwrap();
    let f = reparse(&w);
    let mut w = GgufWriter::from_file(&f);
    w.add_tensor("b", vec![8], GgmlType::F32, vec![2; 32])
        .unwrap();
    w.set_alignment(128);
    let g = reparse(&w);
    assert_eq!(g.tensor("b").unwrap().offset, 128);
    assert_eq!(g.tensor_data_by_name("a").unwrap(), &[1; 16]);
    assert_eq!(g.tensor_data_by_name("b").unwrap(), &[2; 32]);
}

#[test]
fn write_file_errors_name_the_path() {
    let w = GgufWriter::new();
    let path = std::path::Path::new("/nonexistent-dir-for-nextn-gguf/x.gguf");
    let e = w.write_file(path).unwrap_err();
    assert!(
        matches!(e, GgufError::Io { path: ref p, .. } if p == path),
        "{e}"
    );
}

/// A deferred tensor's bytes come from the source while the file is written, in file and in
/// split form, and give the same file as adding the bytes up front; a source that writes the
/// wrong number of bytes, or none at all, is an error.
#[test]
fn deferred_tensors_are_written_from_the_source() {
    let data_of = |name: &str| -> Vec<u8> { vec![name.len() as u8; 32] };
    let mut eager = GgufWriter::new();
    let mut lazy = GgufWriter::new();
    for name in ["a", "bb", "ccc"] {
        eager
            .add_tensor(name, vec![8], GgmlType::F32, data_of(name))
            .unwrap();
        assert_eq!(
            lazy.add_tensor_deferred(name, vec![8], GgmlType::F32)
                .unwrap(),
            32
        );
    }
    let mut out = Vec::new();
    lazy.write_to_with(&mut out, &mut |name, w| w.write_all(&data_of(name)))
        .unwrap();
    assert_eq!(out, eager.to_bytes().unwrap());
    assert!(
        lazy.to_bytes().is_err(),
        "no source for the deferred tensors"
    );
    let short = lazy.write_to_with(&mut Vec::new(), &mut |_, w| w.write_all(&[0; 4]));
    assert!(short.unwrap_err().to_string().contains("produced 4 bytes"));

    let dir = std::env::temp_dir().join(format!("nextn-gguf-deferred-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let paths = lazy
        .write_split_with(dir.join("m"), SplitLimit::MaxTensors(2), &mut |name, w| {
            w.write_all(&data_of(name))
        })
        .unwrap();
    assert_eq!(paths.len(), 2);
    let f = GgufFile::open(&paths[0]).unwrap();
    assert_eq!(f.tensor_data_by_name("ccc").unwrap(), &data_of("ccc")[..]);
    std::fs::remove_dir_all(&dir).unwrap();
}
