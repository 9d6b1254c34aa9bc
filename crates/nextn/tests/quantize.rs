//! `nextn quantize` and `nextn graft` through the real binary.
//!
//! Byte identity: the quantized golden fixtures in ../shared/golden were made by llama.cpp's
//! llama-quantize (the commit in golden/README.txt) from the F32 files, one thread, no
//! importance matrix (each fixture's golden.json lists the commands). `nextn quantize` of the
//! same F32 file to the same type gives the same tensor types, order and bytes.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use nextn_gguf::GgufFile;

fn nextn(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nextn"))
        .args(args)
        .output()
        .expect("run nextn")
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nextn-quantize-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Tensors whose bytes differ between two files with the same tensor names (name, type).
fn differing_tensors(a: &Path, b: &Path) -> Vec<String> {
    let (fa, fb) = (GgufFile::open(a).expect("a"), GgufFile::open(b).expect("b"));
    let names_a: Vec<&str> = fa.tensors().iter().map(|t| t.name.as_str()).collect();
    let names_b: Vec<&str> = fb.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names_a,
        names_b,
        "tensor order of {} and {}",
        a.display(),
        b.display()
    );
    fa.tensors()
        .iter()
        .filter_map(|t| {
            let u = fb.tensor(&t.name).expect("same names");
            (t.ty != u.ty || fa.tensor_data(t) != fb.tensor_data(u))
                .then(|| format!("{} ({} vs {})", t.name, t.ty, u.ty))
        })
        .collect()
}

#[test]
fn quantize_gives_llama_quantize_bytes_on_the_fixtures() {
    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    let cases = [
        ("q35-dense-a", "F16"),
        ("q35-dense-a", "BF16"),
        ("q35-dense-a", "Q8_0"),
        ("q35-dense-a", "Q4_K_M"),
        ("q35-dense-a", "Q5_K_M"),
        ("q35-dense-a", "Q6_K"),
        ("q35-dense-a", "IQ4_XS"),
        ("q35moe-a", "Q8_0"),
        ("q35moe-a", "Q4_K_M"),
    ];
    let mut report = Vec::new();
    for (fixture, ty) in cases {
        let dir = golden.join(fixture);
        let src = dir.join(format!("{fixture}-F32.gguf"));
        let reference = dir.join(format!("{fixture}-{ty}.gguf"));
        let out = tmp(&format!("{fixture}-{ty}.gguf"));
        let o = nextn(&[
            "quantize",
            src.to_str().unwrap(),
            out.to_str().unwrap(),
            ty,
            "2",
        ]);
        if !o.status.success() {
            report.push(format!("{fixture} {ty}: failed: {}", stderr(&o)));
            continue;
        }
        let wrong = differing_tensors(&out, &reference);
        if !wrong.is_empty() {
            report.push(format!(
                "{fixture} {ty}: {} tensors differ: {}",
                wrong.len(),
                wrong.join(", ")
            ));
        }
    }
    assert!(report.is_empty(), "{}", report.join("\n"));
}

fn tensor_types(path: &Path) -> Vec<(String, String)> {
    let o = nextn(&["inspect", "--json", "--tensors", path.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("inspect json");
    v["tensors"]
        .as_array()
        .expect("tensor list")
        .iter()
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_string(),
                t["type"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// `--tensor-type 'blk\.\d+\.nextn\..*=Q8_0'` changes exactly the NextN tensors it names (the
/// quantizable ones) to Q8_0, and `bench --check --check-against` reports the head's numbers
/// for the pinned file next to the unpinned one's.
#[test]
fn pinned_nextn_tensors_and_the_check_against_the_unpinned_file() {
    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    let src = golden.join("q35-dense-a/q35-dense-a-F32.gguf");
    let (plain, pinned) = (tmp("plain-q4.gguf"), tmp("pinned-q4.gguf"));
    for (out, extra) in [
        (&plain, vec![]),
        (&pinned, vec!["--tensor-type", r"blk\.\d+\.nextn\..*=Q8_0"]),
    ] {
        let mut args = vec![
            "quantize",
            src.to_str().unwrap(),
            out.to_str().unwrap(),
            "Q4_K_M",
        ];
        args.extend(extra);
        let o = nextn(&args);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let (a, b) = (tensor_types(&plain), tensor_types(&pinned));
    let changed: Vec<&str> = a
        .iter()
        .zip(&b)
        .filter(|(x, y)| x != y)
        .map(|(_, y)| y.0.as_str())
        .collect();
    assert_eq!(
        changed,
        ["blk.8.nextn.eh_proj.weight"],
        "only the matched 2-D tensor"
    );
    let pinned_type = &b
        .iter()
        .find(|t| t.0 == "blk.8.nextn.eh_proj.weight")
        .unwrap()
        .1;
    assert_eq!(pinned_type, "Q8_0");
    // Norm vectors match the pattern but are never quantized.
    assert!(b
        .iter()
        .any(|t| t.0 == "blk.8.nextn.enorm.weight" && t.1 == "F32"));

    let json = tmp("check.json");
    let o = nextn(&[
        "bench",
        "-m",
        pinned.to_str().unwrap(),
        "--check",
        "--check-against",
        plain.to_str().unwrap(),
        "-n",
        "8",
        "--spec-draft-n-max",
        "0,2",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let against = &report["check"]["against"];
    assert_eq!(against["n_max"], 2);
    for side in ["this", "other"] {
        for key in ["draft_top1", "acceptance"] {
            let x = against[side][key].as_f64().unwrap_or(-1.0);
            assert!((0.0..=1.0).contains(&x), "{side} {key} = {x}");
        }
    }
    assert!(String::from_utf8_lossy(&o.stdout).contains("check against"));
}

/// Plan and refusals: a dry run writes nothing and lists every tensor; an unknown type, a bad
/// pattern and requantizing without --allow-requantize are clear errors.
#[test]
fn quantize_dry_run_and_refusals() {
    let bundled = nextn_testdata::bundled_model();
    let m = bundled.to_str().unwrap();
    let out = tmp("never.gguf");
    let o = nextn(&[
        "quantize",
        m,
        out.to_str().unwrap(),
        "Q4_K_M",
        "--allow-requantize",
        "--dry-run",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!out.exists(), "a dry run writes nothing");
    let listing = String::from_utf8_lossy(&o.stdout);
    assert_eq!(listing.lines().filter(|l| l.starts_with('[')).count(), 123);
    assert!(listing.contains("Q8_0 -> Q6_K"), "{listing}");
    for (args, says) in [
        (vec!["Q9_K"], "type Q9_K"),
        (vec!["Q4_K_M", "--tensor-type", "attn_v"], "PATTERN=TYPE"),
        (
            vec!["Q4_K_M", "--tensor-type", "(=q8_0"],
            "bad regular expression",
        ),
        (
            vec!["Q4_K_M", "--tensor-type", "attn_v=q9"],
            "not a ggml tensor type",
        ),
        (vec!["Q4_K_M"], "--allow-requantize"),
    ] {
        let mut full = vec!["quantize", m, out.to_str().unwrap()];
        full.extend(args.iter().copied());
        let o = nextn(&full);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        assert!(stderr(&o).contains(says), "{args:?}: {}", stderr(&o));
        assert!(!out.exists());
    }
}

/// Multi-threaded and split output give the same tensors as one thread into one file.
#[test]
fn threads_and_split_output_do_not_change_the_bytes() {
    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    let src = golden.join("q35moe-a/q35moe-a-F32.gguf");
    let one = tmp("moe-1.gguf");
    let o = nextn(&[
        "quantize",
        src.to_str().unwrap(),
        one.to_str().unwrap(),
        "Q4_K_M",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let split = tmp("moe-split.gguf");
    let o = nextn(&[
        "quantize",
        src.to_str().unwrap(),
        split.to_str().unwrap(),
        "Q4_K_M",
        "-t",
        "2",
        "--split-max-size",
        "1M",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let first = tmp("moe-split-00001-of-00004.gguf");
    assert!(first.exists(), "{}", stderr(&o));
    assert!(differing_tensors(&one, &first).is_empty());
    let v = nextn(&["verify", first.to_str().unwrap()]);
    assert!(v.status.success(), "{}", stderr(&v));
}

/// A Q4_K_M body with the F32 fixture's NextN block: the trunk's logits are the Q4_K_M file's, the
/// head's are those of the Q4_K_M model drafting with the F32 file's head (`-md`), and the block's
/// tensors are the F32 file's bytes. A body without a head gets one; mismatched pairs are refused
/// naming the difference.
#[test]
fn graft_keeps_the_trunk_and_takes_the_head() {
    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    let dir = golden.join("q35-dense-a");
    let (q4, f32) = (
        dir.join("q35-dense-a-Q4_K_M.gguf"),
        dir.join("q35-dense-a-F32.gguf"),
    );
    let out = tmp("grafted.gguf");
    let o = nextn(&[
        "graft",
        q4.to_str().unwrap(),
        f32.to_str().unwrap(),
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(nextn(&["verify", out.to_str().unwrap()]).status.success());

    let logits = |args: &[&str]| -> serde_json::Value {
        let mut full = vec![
            "logits",
            "--tokens",
            "5,17,256,1000,3,77,12",
            "--json",
            "--full",
        ];
        full.extend(args);
        let o = nextn(&full);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["positions"].clone()
    };
    let (o, q) = (out.to_str().unwrap(), q4.to_str().unwrap());
    assert_eq!(logits(&["-m", o]), logits(&["-m", q]), "trunk logits");
    assert_eq!(
        logits(&["-m", o, "--mtp"]),
        logits(&["-m", q, "--mtp", "-md", f32.to_str().unwrap()]),
        "head logits"
    );
    let (g, s) = (GgufFile::open(&out).unwrap(), GgufFile::open(&f32).unwrap());
    for t in g.tensors().iter().filter(|t| t.name.starts_with("blk.8.")) {
        let theirs = s.tensor(&t.name).expect("head tensor in F32 file");
        assert_eq!(g.tensor_data(t), s.tensor_data(theirs), "{}", t.name);
    }

    // A body without a NextN block gets HEAD's, with the metadata for it; --head-type
    // re-quantizes the block's matrices.
    let headless = tmp("headless-q4.gguf");
    let body = GgufFile::open(&q4).unwrap();
    let mut w = nextn_gguf::GgufWriter::from_file(&body);
    for t in body
        .tensors()
        .iter()
        .filter(|t| t.name.starts_with("blk.8."))
    {
        w.remove_tensor(&t.name);
    }
    w.set_kv("qwen35.block_count", 8u32);
    w.set_kv("qwen35.nextn_predict_layers", 0u32);
    w.discard_preserved_layout();
    w.write_file(&headless).unwrap();
    let out2 = tmp("grafted-q8.gguf");
    let o = nextn(&[
        "graft",
        headless.to_str().unwrap(),
        f32.to_str().unwrap(),
        out2.to_str().unwrap(),
        "--head-type",
        "q8_0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v = nextn(&["verify", out2.to_str().unwrap()]);
    assert!(v.status.success(), "{}", stderr(&v));
    let types = tensor_types(&out2);
    assert!(types
        .iter()
        .any(|t| t.0 == "blk.8.nextn.eh_proj.weight" && t.1 == "Q8_0"));
    assert!(types
        .iter()
        .any(|t| t.0 == "blk.8.nextn.enorm.weight" && t.1 == "F32"));

    // The same shapes with one token spelled differently: another tokenizer.
    let retokenized = tmp("other-tokenizer.gguf");
    let src = GgufFile::open(&f32).unwrap();
    let mut tokens: Vec<String> = src
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.as_array())
        .and_then(|a| a.as_strings())
        .unwrap()
        .to_vec();
    tokens[100] = "<other>".into();
    let mut w = nextn_gguf::GgufWriter::from_file(&src);
    w.set_kv(
        "tokenizer.ggml.tokens",
        nextn_gguf::MetadataValue::Array(tokens.into()),
    );
    w.discard_preserved_layout();
    w.write_file(&retokenized).unwrap();
    for (head, says) in [
        (
            retokenized.clone(),
            "tokenizer (hash of tokens and merges) differs",
        ),
        (
            golden.join("q35moe-a/q35moe-a-F32.gguf"),
            "architecture differs",
        ),
        (
            golden.join("q35-dense-qwenvocab/q35-dense-qwenvocab-F32-embQ8_0.gguf"),
            "hidden size",
        ),
        (headless.clone(), "HEAD has no NextN block"),
    ] {
        let o = nextn(&[
            "graft",
            q,
            head.to_str().unwrap(),
            tmp("refused.gguf").to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(1));
        assert!(stderr(&o).contains(says), "{says}: {}", stderr(&o));
    }
}

/// FNV-1a 64, as tools/imatrix_reference.py hashes tensors.
fn fnv1a64(data: &[u8]) -> String {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for &b in data {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01B3);
    }
    format!("{h:016x}")
}

/// With an importance matrix from llama-imatrix (committed, GGUF format), `nextn quantize
/// --imatrix` gives llama-quantize's types and bytes for every tensor
/// (tests/data/imatrix_llamacpp.json, made by tools/imatrix_reference.py).
#[test]
fn imatrix_quantization_gives_llama_quantize_bytes() {
    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("imatrix_llamacpp.json")).unwrap())
            .unwrap();
    let src = golden.join("q35-dense-a/q35-dense-a-F32.gguf");
    let imatrix = data.join("imatrix-q35-dense-a.gguf");
    let files = reference["files"].as_object().unwrap();
    assert_eq!(files.len(), 5);
    let mut report = Vec::new();
    for (ty, tensors) in files {
        let out = tmp(&format!("imatrix-{ty}.gguf"));
        let o = nextn(&[
            "quantize",
            "--imatrix",
            imatrix.to_str().unwrap(),
            src.to_str().unwrap(),
            out.to_str().unwrap(),
            ty,
        ]);
        assert!(o.status.success(), "{ty}: {}", stderr(&o));
        let f = GgufFile::open(&out).unwrap();
        let tensors = tensors.as_object().unwrap();
        assert_eq!(f.tensors().len(), tensors.len(), "{ty}");
        for t in f.tensors() {
            let want = &tensors[&t.name];
            let got = (t.ty.name(), fnv1a64(f.tensor_data(t)));
            if want[0] != got.0 || want[1] != got.1.as_str() {
                report.push(format!(
                    "{ty} {}: ours {got:?}, llama-quantize {want}",
                    t.name
                ));
            }
        }
    }
    assert!(report.is_empty(), "{}", report.join("\n"));
}

/// `--keep-nextn-type` gives every quantizable tensor of the NextN block that type and leaves
/// the rest of the mix alone; `--output-tensor-type` and `--token-embedding-type` set those two.
#[test]
fn keep_nextn_type_and_the_output_and_embedding_types() {
    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    let src = golden.join("q35-dense-a/q35-dense-a-F32.gguf");
    let (plain, kept) = (tmp("keep-plain.gguf"), tmp("keep-q8.gguf"));
    let s = src.to_str().unwrap();
    let o = nextn(&["quantize", s, plain.to_str().unwrap(), "Q4_K_M"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = nextn(&[
        "quantize",
        s,
        kept.to_str().unwrap(),
        "Q4_K_M",
        "--keep-nextn-type",
        "q8_0",
        "--output-tensor-type",
        "q8_0",
        "--token-embedding-type",
        "q5_k",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (a, b) = (tensor_types(&plain), tensor_types(&kept));
    for ((name, before), (_, after)) in a.iter().zip(&b) {
        let want = if name == "output.weight" {
            "Q8_0".to_string()
        } else if name == "token_embd.weight" {
            "Q5_K".to_string()
        } else if name.starts_with("blk.8.") && before != "F32" {
            "Q8_0".to_string()
        } else {
            before.clone()
        };
        assert_eq!(after, &want, "{name} (was {before})");
    }
    assert!(
        b.iter()
            .filter(|t| t.0.starts_with("blk.8.") && t.1 == "Q8_0")
            .count()
            >= 7
    );
}

/// HEAD may be an MTP-only sidecar (the NextN block with the embedding, no trunk): the graft
/// equals the one made from the full file.
#[test]
fn graft_takes_the_head_of_a_sidecar() {
    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    let dir = golden.join("q35-dense-a");
    let (q4, f32) = (
        dir.join("q35-dense-a-Q4_K_M.gguf"),
        dir.join("q35-dense-a-F32.gguf"),
    );
    let full = GgufFile::open(&f32).unwrap();
    let mut w = nextn_gguf::GgufWriter::from_file(&full);
    for t in full.tensors() {
        let trunk = t.name.starts_with("blk.") && !t.name.starts_with("blk.8.");
        if trunk || t.name == "output.weight" {
            w.remove_tensor(&t.name);
        }
    }
    w.discard_preserved_layout();
    let sidecar = tmp("sidecar.gguf");
    w.write_file(&sidecar).unwrap();
    let v = nextn(&["verify", sidecar.to_str().unwrap()]);
    assert!(v.status.success(), "{}", stderr(&v));
    assert!(String::from_utf8_lossy(&v.stdout).contains("sidecar"));

    let (from_full, from_sidecar) = (tmp("g-full.gguf"), tmp("g-sidecar.gguf"));
    for (head, out) in [(&f32, &from_full), (&sidecar, &from_sidecar)] {
        let o = nextn(&[
            "graft",
            q4.to_str().unwrap(),
            head.to_str().unwrap(),
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    assert_eq!(
        std::fs::read(&from_full).unwrap(),
        std::fs::read(&from_sidecar).unwrap()
    );
}
