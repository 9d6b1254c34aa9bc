//! Split models: writing them like llama-gguf-split, opening them from the first shard, and
//! refusing inconsistent shard sets.

mod common;

use common::TempDir;
use nextn_gguf::{
    GgmlType, GgufError, GgufFile, GgufWriter, MetadataValue, SplitLimit, SPLIT_COUNT_KEY,
    SPLIT_NO_KEY, SPLIT_TENSORS_COUNT_KEY,
};

fn write_three_shards(dir: &TempDir) -> Vec<std::path::PathBuf> {
    let paths = common::rich_writer()
        .write_split(dir.path("model"), SplitLimit::MaxTensors(2))
        .unwrap();
    assert_eq!(paths.len(), 3);
    paths
}

/// Rewrites shard `path` after `edit` changed its writer.
fn rewrite_shard(path: &std::path::Path, edit: impl FnOnce(&mut GgufWriter)) {
    let bytes = std::fs::read(path).unwrap();
    let f = GgufFile::from_bytes(bytes).unwrap();
    let mut w = GgufWriter::from_file(&f);
    edit(&mut w);
    let out = w.to_bytes().unwrap();
    std::fs::write(path, out).unwrap();
}

fn open_err(path: &std::path::Path) -> GgufError {
    match GgufFile::open(path) {
        Ok(_) => panic!("{} opened", path.display()),
        Err(e) => e,
    }
}

#[test]
fn split_round_trip_matches_single_file() {
    let dir = TempDir::new("split");
    let paths = write_three_shards(&dir);
    assert_eq!(
        paths[1].file_name().unwrap().to_str().unwrap(),
        "model-00002-of-00003.gguf"
    );
    let single_writer = common::rich_writer();
    let single = GgufFile::from_bytes(single_writer.to_bytes().unwrap()).unwrap();

    let f = GgufFile::open(&paths[0]).unwrap();
    assert_eq!(f.shard_paths(), &paths[..]);
    assert_eq!(f.shard_count(), 3);
    assert_eq!(f.tensors().len(), single.tensors().len());
    for (a, b) in f.tensors().iter().zip(single.tensors()) {
        assert_eq!((&a.name, &a.dims, a.ty), (&b.name, &b.dims, b.ty));
        assert_eq!(f.tensor_data(a), single.tensor_data(b), "{}", a.name);
    }
    assert_eq!(
        f.tensors().iter().map(|t| t.shard).collect::<Vec<_>>(),
        [0, 0, 1, 1, 2, 2]
    );
    assert_eq!(f.get(SPLIT_NO_KEY), Some(&MetadataValue::U16(0)));
    assert_eq!(f.get(SPLIT_COUNT_KEY), Some(&MetadataValue::U16(3)));
    assert_eq!(f.get(SPLIT_TENSORS_COUNT_KEY), Some(&MetadataValue::I32(6)));
    assert_eq!(f.get_str("v.str").unwrap(), Some("text ✓"));
    // Later shards carry only the split keys.
    let second = f.shard_metadata(1).unwrap();
    assert_eq!(second.len(), 3);
    assert_eq!(second[0], (SPLIT_NO_KEY.to_owned(), MetadataValue::U16(1)));
    let total: u64 = paths
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    assert_eq!(f.file_size(), total);

    // Merging the shards back gives the unsplit file exactly.
    let merged = GgufWriter::from_file(&f).to_bytes().unwrap();
    assert!(merged == single_writer.to_bytes().unwrap());
}

#[test]
fn split_by_bytes() {
    let dir = TempDir::new("split-bytes");
    let mut w = GgufWriter::new();
    for i in 0..5u8 {
        w.add_tensor(format!("t{i}"), vec![8], GgmlType::F32, vec![i; 32])
            .unwrap();
    }
    let paths = w
        .write_split(dir.path("m"), SplitLimit::MaxBytes(64))
        .unwrap();
    assert_eq!(paths.len(), 3);
    let f = GgufFile::open(&paths[0]).unwrap();
    assert_eq!(
        f.tensors().iter().map(|t| t.shard).collect::<Vec<_>>(),
        [0, 0, 1, 1, 2]
    );
    assert_eq!(f.tensor_data_by_name("t4").unwrap(), &[4; 32]);
    // A limit below one tensor puts each tensor in its own shard.
    let paths = w
        .write_split(dir.path("n"), SplitLimit::MaxBytes(1))
        .unwrap();
    assert_eq!(paths.len(), 5);
    assert!(matches!(
        w.write_split(dir.path("z"), SplitLimit::MaxTensors(0)),
        Err(GgufError::BadSplit { .. })
    ));
}

#[test]
fn gguf_py_split_fixture() {
    let first = common::data_dir().join("gguf_py_split-00001-of-00003.gguf");
    let f = GgufFile::open(&first).unwrap();
    assert_eq!(f.tensors().len(), 5);
    assert_eq!(f.get_str("general.name").unwrap(), Some("split fixture"));
    for (i, t) in f.tensors().iter().enumerate() {
        assert_eq!(t.name, format!("t{i}"));
        assert_eq!(t.dims, vec![3, i as u64 + 1]);
        let data = f.tensor_data(t);
        assert!(data
            .chunks_exact(4)
            .all(|c| f32::from_le_bytes(c.try_into().unwrap()) == i as f32));
    }
    // Each shard on its own rewrites byte for byte.
    for p in f.shard_paths() {
        let bytes = std::fs::read(p).unwrap();
        let g = GgufFile::from_bytes(bytes.clone()).unwrap();
        assert!(GgufWriter::from_file(&g).to_bytes().unwrap() == bytes);
    }
}

#[test]
fn opening_a_later_shard_points_to_the_first() {
    let dir = TempDir::new("split-later");
    let paths = write_three_shards(&dir);
    let e = open_err(&paths[1]);
    assert!(
        matches!(
            e,
            GgufError::NotFirstShard {
                shard_no: 1,
                count: 3,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("-00001-of-00003.gguf"), "{e}");
}

#[test]
fn missing_shard() {
    let dir = TempDir::new("split-missing");
    let paths = write_three_shards(&dir);
    std::fs::remove_file(&paths[2]).unwrap();
    let e = open_err(&paths[0]);
    assert!(
        matches!(e, GgufError::MissingShard { index: 3, count: 3, ref path } if *path == paths[2]),
        "{e}"
    );
}

#[test]
fn disagreeing_split_count() {
    let dir = TempDir::new("split-count");
    let paths = write_three_shards(&dir);
    rewrite_shard(&paths[1], |w| {
        w.set_kv(SPLIT_COUNT_KEY, MetadataValue::U16(4))
    });
    let e = open_err(&paths[0]);
    assert!(
        matches!(
            e,
            GgufError::SplitCountMismatch {
                expected: 3,
                found: 4,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn wrong_split_no() {
    let dir = TempDir::new("split-no");
    let paths = write_three_shards(&dir);
    rewrite_shard(&paths[2], |w| w.set_kv(SPLIT_NO_KEY, MetadataValue::U16(1)));
    let e = open_err(&paths[0]);
    assert!(
        matches!(
            e,
            GgufError::SplitNoMismatch {
                expected: 2,
                found: 1,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn tensor_count_mismatch() {
    let dir = TempDir::new("split-tcount");
    let paths = write_three_shards(&dir);
    rewrite_shard(&paths[2], |w| {
        assert!(w.remove_tensor("w.bf16"));
    });
    let e = open_err(&paths[0]);
    assert!(
        matches!(
            e,
            GgufError::SplitTensorCount {
                expected: 6,
                found: 5,
                shards: 3
            }
        ),
        "{e}"
    );
}

#[test]
fn duplicate_tensor_across_shards() {
    let dir = TempDir::new("split-dup");
    let paths = write_three_shards(&dir);
    rewrite_shard(&paths[2], |w| {
        assert!(w.remove_tensor("w.bf16"));
        w.add_tensor("w.f16", vec![5], GgmlType::F16, vec![0u8; 10])
            .unwrap();
    });
    let e = open_err(&paths[0]);
    assert!(
        matches!(e, GgufError::DuplicateTensorAcrossShards { ref tensor, first_shard: 0, second_shard: 2 } if tensor == "w.f16"),
        "{e}"
    );
}

#[test]
fn split_metadata_without_usable_name() {
    let dir = TempDir::new("split-name");
    let paths = write_three_shards(&dir);
    let renamed = dir.path("renamed.gguf");
    std::fs::copy(&paths[0], &renamed).unwrap();
    assert!(matches!(
        open_err(&renamed),
        GgufError::UnnamedSplit { count: 3, .. }
    ));
    let wrong = dir.path("model-00001-of-00002.gguf");
    std::fs::copy(&paths[0], &wrong).unwrap();
    assert!(matches!(
        open_err(&wrong),
        GgufError::SplitNameMismatch {
            from_name: 2,
            from_metadata: 3,
            ..
        }
    ));
}

#[test]
fn shard_parse_errors_name_the_shard() {
    let dir = TempDir::new("split-corrupt");
    let paths = write_three_shards(&dir);
    std::fs::write(&paths[1], b"GGUF\x03\0\0").unwrap();
    let e = open_err(&paths[0]);
    assert!(
        matches!(e, GgufError::InFile { ref path, .. } if *path == paths[1]),
        "{e}"
    );
    assert!(matches!(e.kind(), GgufError::Truncated { .. }), "{e}");
    assert!(e.to_string().contains("model-00002-of-00003.gguf"), "{e}");
}

#[test]
fn unsplit_file_with_split_like_name_and_no_metadata_is_one_shard_set() {
    // Shards found by name alone (no split.* keys) are still opened together.
    let dir = TempDir::new("split-noname");
    for (i, name) in ["a", "b"].iter().enumerate() {
        let mut w = GgufWriter::new();
        w.add_tensor(*name, vec![4], GgmlType::F32, vec![i as u8; 16])
            .unwrap();
        w.write_file(dir.path(&format!("m-0000{}-of-00002.gguf", i + 1)))
            .unwrap();
    }
    let f = GgufFile::open(dir.path("m-00001-of-00002.gguf")).unwrap();
    assert_eq!(f.tensors().len(), 2);
    assert_eq!(f.tensor_data_by_name("b").unwrap(), &[1; 16]);
}
