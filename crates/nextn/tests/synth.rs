//! `nextn synth`: the embedded Qwen vocabulary against the shared sources, and synthesized models
//! through the loader, `nextn run` and `nextn verify`.

use std::path::{Path, PathBuf};

use nextn_gguf::GgufFile;
use nextn_model::synth::{RawVocab, Vocab};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn shared() -> Option<PathBuf> {
    let p = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared"));
    if p.is_dir() {
        Some(p.to_path_buf())
    } else {
        println!("skipped: ../shared not found");
        None
    }
}

fn qwen_raw() -> RawVocab {
    RawVocab::parse(&std::fs::read(repo().join("models/qwen35-vocab.bin")).unwrap()).unwrap()
}

#[test]
fn vocabulary_matches_the_golden_fixture() {
    let Some(shared) = shared() else { return };
    let v = Vocab::qwen(&qwen_raw(), 248_320).unwrap();
    let g = GgufFile::open(shared.join("golden/q35-dense-qwenvocab/q35-dense-qwenvocab-F32-embQ8_0.gguf")).unwrap();
    let tokens = g.get_array("tokenizer.ggml.tokens").unwrap().unwrap().as_strings().unwrap();
    let types = g.get_array("tokenizer.ggml.token_type").unwrap().unwrap().as_i32_vec().unwrap();
    let merges = g.get_array("tokenizer.ggml.merges").unwrap().unwrap().as_strings().unwrap();
    assert_eq!(v.tokens, tokens);
    assert_eq!(v.token_types, types);
    println!("merges: ours {}, golden {}", v.merges.len(), merges.len());
    let ours: std::collections::HashSet<&String> = v.merges.iter().collect();
    let theirs: std::collections::HashSet<&String> = merges.iter().collect();
    let only_ours: Vec<_> = v.merges.iter().filter(|m| !theirs.contains(m)).collect();
    let only_theirs: Vec<_> = merges.iter().filter(|m| !ours.contains(m)).collect();
    println!("only ours {} {:?}", only_ours.len(), &only_ours[..only_ours.len().min(10)]);
    println!("only golden {} {:?}", only_theirs.len(), &only_theirs[..only_theirs.len().min(10)]);
    let same_order = v.merges.iter().zip(merges).filter(|(a, b)| a == b).count();
    println!("same position {same_order}");
}
