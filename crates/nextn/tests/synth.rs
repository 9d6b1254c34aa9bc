//! `nextn synth`: the embedded Qwen vocabulary against the shared sources, the tensor plan against
//! the model inventory and llama-quantize's own files, and small synthesized models through the
//! loader, `nextn logits`, `nextn run` and `nextn verify`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

use nextn_engine::chat::{ChatMessage, ChatTemplate};
use nextn_gguf::{GgufFile, GgufWriter};
use nextn_model::config::Qwen35Config;
use nextn_model::inventory;
use nextn_model::synth::{self, FileType, RawVocab, SynthSpec, Vocab};
use nextn_model::{Model, NextnHead};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn qwen_raw() -> RawVocab {
    RawVocab::parse(&std::fs::read(repo().join("models/qwen35-vocab.bin")).unwrap()).unwrap()
}

fn nextn(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nextn"))
        .args(args)
        .output()
        .expect("run nextn")
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nextn-synth-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A small dense model: 4 trunk layers (one full attention) + MTP, a 512-token Qwen prefix vocab.
const TINY_DENSE: &[&str] = &[
    "synth",
    "--arch",
    "qwen35",
    "--hidden",
    "64",
    "--layers",
    "4",
    "--heads",
    "2",
    "--kv-heads",
    "1",
    "--head-dim",
    "32",
    "--ff",
    "96",
    "--ssm-k-heads",
    "2",
    "--ssm-v-heads",
    "4",
    "--ssm-head-dim",
    "16",
    "--vocab",
    "512",
    "--ctx",
    "2048",
];

fn standard_base64(text: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    } as u32;
    let digits: Vec<u32> = text.bytes().filter(|&c| c != b'=').map(val).collect();
    let mut out = Vec::new();
    for chunk in digits.chunks(4) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, &d)| acc | d << (18 - 6 * i));
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

#[test]
fn embedded_vocabulary_is_the_shared_tiktoken_file() {
    let Some(dir) = nextn_testdata::shared("tokenizers/qwen35") else {
        return;
    };
    let raw = qwen_raw();
    let text = std::fs::read_to_string(dir.join("qwen3_6.tiktoken")).unwrap();
    let mut n = 0;
    for line in text.lines().filter(|l| !l.is_empty()) {
        let (b64, rank) = line.split_once(' ').unwrap();
        let rank: usize = rank.parse().unwrap();
        assert_eq!(raw.bpe[rank], standard_base64(b64), "rank {rank}");
        n += 1;
    }
    assert_eq!(n, raw.bpe.len());
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("special_tokens_and_regex.json")).unwrap(),
    )
    .unwrap();
    let specials = json["special_tokens"].as_array().unwrap();
    assert_eq!(specials.len(), raw.specials.len());
    for (s, (id, _, text)) in specials.iter().zip(&raw.specials) {
        assert_eq!(s["id"].as_u64(), Some(*id as u64));
        assert_eq!(s["content"].as_str(), Some(text.as_str()));
    }
}

/// Tokens, token types and the reconstructed merges equal those of the real-vocabulary golden
/// fixture (made with llama.cpp's tooling), merge for merge and in the same order.
#[test]
fn vocabulary_matches_the_golden_fixture() {
    let Some(dir) = nextn_testdata::shared("golden/q35-dense-qwenvocab") else {
        return;
    };
    let v = Vocab::qwen(&qwen_raw(), 248_320).unwrap();
    let g = GgufFile::open(dir.join("q35-dense-qwenvocab-F32-embQ8_0.gguf")).unwrap();
    let strings = |k: &str| {
        g.get_array(k)
            .unwrap()
            .unwrap()
            .as_strings()
            .unwrap()
            .to_vec()
    };
    assert_eq!(v.tokens, strings("tokenizer.ggml.tokens"));
    assert_eq!(
        Some(v.token_types.clone()),
        g.get_array("tokenizer.ggml.token_type")
            .unwrap()
            .unwrap()
            .as_i32_vec()
    );
    let merges = strings("tokenizer.ggml.merges");
    assert_eq!(v.merges.len(), merges.len());
    let differing: Vec<_> = v
        .merges
        .iter()
        .zip(&merges)
        .filter(|(a, b)| a != b)
        .take(5)
        .collect();
    assert!(
        differing.is_empty(),
        "first differing merges (ours, golden): {differing:?}"
    );
    for (key, ours) in [
        ("tokenizer.ggml.eos_token_id", v.eos),
        ("tokenizer.ggml.bos_token_id", v.bos),
        ("tokenizer.ggml.padding_token_id", v.pad),
    ] {
        assert_eq!(g.get_u32(key).unwrap(), Some(ours), "{key}");
    }
}

fn no_kwargs() -> serde_json::Map<String, serde_json::Value> {
    serde_json::Map::new()
}

#[test]
fn chat_template_renders_reasoning_and_tools() {
    let t = ChatTemplate::new(synth::vocab::QWEN35_CHAT_TEMPLATE).unwrap();
    let mut call = ChatMessage::new("assistant", "");
    call.tool_calls =
        Some(serde_json::json!([{"function": {"name": "add", "arguments": {"a": 1, "b": "two"}}}]));
    let msgs = vec![
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Sum?"),
        call,
        ChatMessage::new("tool", "3"),
    ];
    let out = t.render(&msgs, true, &no_kwargs()).unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSum?<|im_end|>\n\
         <|im_start|>assistant\n<think>\n\n</think>\n\n\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n\
         <parameter=b>\ntwo\n</parameter>\n</function>\n</tool_call><|im_end|>\n\
         <|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    );
    let msgs = vec![
        ChatMessage::new("user", "Hi"),
        ChatMessage::new("assistant", "<think>\nhm\n</think>\n\nHello"),
    ];
    let out = t.render(&msgs, false, &no_kwargs()).unwrap();
    assert_eq!(out, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\nHello<|im_end|>\n");
    let out = t
        .render(
            &msgs[..1],
            true,
            serde_json::json!({"enable_thinking": false})
                .as_object()
                .unwrap(),
        )
        .unwrap();
    assert!(
        out.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "{out}"
    );
}

/// The metadata of `spec` as a tensor-less GGUF, read back.
fn metadata_file(spec: &SynthSpec, vocab: &Vocab) -> GgufFile {
    let mut w = GgufWriter::new();
    for (k, v) in spec.metadata(FileType::Q4_K_M, vocab, 0) {
        w.add_kv(k, v);
    }
    GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()
}

/// Every preset's plan is exactly the inventory the loader derives from the written metadata.
#[test]
fn preset_plans_match_the_model_inventory() {
    let vocab = Vocab::qwen(&qwen_raw(), 248_320).unwrap();
    for name in synth::PRESETS {
        let spec = SynthSpec::preset(name).unwrap();
        let vocab = if spec.n_vocab == vocab.tokens.len() {
            vocab.clone()
        } else {
            Vocab::qwen(&qwen_raw(), spec.n_vocab).unwrap()
        };
        let f = metadata_file(&spec, &vocab);
        let cfg = Qwen35Config::from_metadata(&f).unwrap();
        assert_eq!(
            (cfg.n_embd, cfg.n_layer, cfg.n_nextn, cfg.head_dim),
            (spec.n_embd, spec.n_layer, 1, spec.head_dim),
            "{name}"
        );
        assert_eq!(
            (cfg.ssm_inner, cfg.conv_dim(), cfg.n_rot),
            (spec.value_dim(), spec.conv_dim(), spec.n_rot),
            "{name}"
        );
        assert_eq!(
            (
                cfg.n_expert,
                cfg.n_expert_used,
                cfg.n_ff_exp,
                cfg.n_ff_shexp
            ),
            (
                spec.n_expert,
                spec.n_expert_used,
                spec.n_ff_exp,
                spec.n_ff_shexp
            ),
            "{name}"
        );
        let mut expected = inventory::trunk_tensors(&cfg, &f, spec.n_vocab);
        expected.extend(inventory::nextn_tensors(&cfg, &f, spec.n_vocab));
        let plan = synth::plan(&spec, FileType::Q4_K_M);
        for x in &expected {
            match plan.iter().find(|t| t.name == x.name) {
                Some(t) => assert_eq!(t.dims, x.dims, "{name}: {}", x.name),
                None => assert!(
                    !x.required || (x.name == "output.weight"),
                    "{name}: {} missing",
                    x.name
                ),
            }
        }
        for t in &plan {
            assert!(
                expected.iter().any(|x| x.name == t.name),
                "{name}: unexpected {}",
                t.name
            );
        }
        assert_eq!(
            plan.iter().any(|t| t.name == "output.weight"),
            !spec.tied,
            "{name}"
        );
    }
    let p = synth::plan(&SynthSpec::preset("0.8b").unwrap(), FileType::Q4_K_M);
    assert_eq!(p.len(), 335);
    let emb = p.iter().find(|t| t.name == "token_embd.weight").unwrap();
    assert_eq!(emb.dims, vec![1024, 248_320]);
}

/// llama-quantize's files (the golden fixtures): same tensors, same order, same type for each.
#[test]
fn quant_mix_and_order_match_llama_quantize() {
    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    let files = [
        ("q35-dense-a", "F32"),
        ("q35-dense-a", "F16"),
        ("q35-dense-a", "BF16"),
        ("q35-dense-a", "Q8_0"),
        ("q35-dense-a", "Q4_K_M"),
        ("q35-dense-a", "Q5_K_M"),
        ("q35-dense-a", "Q6_K"),
        ("q35moe-a", "F32"),
        ("q35moe-a", "Q8_0"),
        ("q35moe-a", "Q4_K_M"),
    ];
    for (fixture, ty) in files {
        let f = GgufFile::open(golden.join(format!("{fixture}/{fixture}-{ty}.gguf"))).unwrap();
        let cfg = Qwen35Config::from_metadata(&f).unwrap();
        let spec = SynthSpec::from_config(
            &cfg,
            inventory::n_vocab(&f),
            f.tensor("output.weight").is_none(),
        );
        let plan = synth::plan(&spec, FileType::parse(ty).unwrap());
        let mut ours: Vec<_> = plan
            .iter()
            .map(|t| (t.name.as_str(), t.dims.clone(), t.ty))
            .collect();
        let mut theirs: Vec<_> = f
            .tensors()
            .iter()
            .map(|t| (t.name.as_str(), t.dims.clone(), t.ty))
            .collect();
        if ty == "F32" {
            // Straight from the converter, in its own order; the others went through llama-quantize.
            ours.sort();
            theirs.sort();
        }
        assert_eq!(ours, theirs, "{fixture}-{ty}");
        assert_eq!(
            f.get_u32("general.file_type").unwrap(),
            Some(FileType::parse(ty).unwrap().llama_ftype())
        );
    }
}

#[test]
fn tiny_dense_model_loads_runs_and_verifies() {
    let path = tmp("dense-q8.gguf");
    let p = path.to_str().unwrap();
    let mut args = TINY_DENSE.to_vec();
    args.extend(["--type", "Q8_0", "-o", p, "--seed", "3"]);
    let out = ok(&nextn(&args));
    assert!(out.contains("qwen35 Q8_0"), "{out}");

    let file = Arc::new(GgufFile::open(&path).unwrap());
    let model = Model::load(file.clone()).unwrap();
    assert_eq!(
        (model.n_vocab, model.config.n_layer, model.config.n_embd),
        (512, 4, 64)
    );
    NextnHead::load(&model).unwrap();

    ok(&nextn(&["verify", p]));

    let o = ok(&nextn(&[
        "logits",
        "-m",
        p,
        "-p",
        "The cat sat on the mat.",
        "--full",
        "--json",
        "-t",
        "1",
    ]));
    let v: serde_json::Value = serde_json::from_str(&o).unwrap();
    let rows = v["positions"].as_array().unwrap();
    assert!(rows.len() >= 4);
    for row in rows {
        let logits: Vec<f64> = row["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(logits.len(), 512);
        assert!(logits.iter().all(|x| x.is_finite()));
        let mean = logits.iter().sum::<f64>() / 512.0;
        let std = (logits.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 512.0).sqrt();
        assert!(
            std > 0.5 && std < 20.0,
            "logit std {std}: the distribution should be neither flat nor degenerate"
        );
    }

    let o = ok(&nextn(&[
        "run",
        "-m",
        p,
        "-p",
        "Hello",
        "-n",
        "8",
        "--temp",
        "0",
        "--json",
        "-t",
        "1",
        "--spec-type",
        "nextn",
    ]));
    let v: serde_json::Value = serde_json::from_str(&o).unwrap();
    assert_eq!(v["tokens"].as_array().unwrap().len(), 8, "{o}");
}

#[test]
fn tiny_moe_q4_k_m_with_fallbacks_loads_and_verifies() {
    let path = tmp("moe-q4km.gguf");
    let p = path.to_str().unwrap();
    // n_embd 64 is not a multiple of 256: K-quant tensors fall back like llama-quantize's.
    let out = ok(&nextn(&[
        "synth",
        "--preset",
        "tiny-moe",
        "--hidden",
        "64",
        "--head-dim",
        "32",
        "--ssm-head-dim",
        "16",
        "--expert-ff",
        "32",
        "--shared-ff",
        "64",
        "--vocab",
        "300",
        "--type",
        "Q4_K_M",
        "-o",
        p,
    ]));
    assert!(out.contains("qwen35moe Q4_K_M"), "{out}");
    let f = GgufFile::open(&path).unwrap();
    let ty = |n: &str| f.tensor(n).unwrap().ty.name();
    assert_eq!(ty("blk.0.ffn_gate_exps.weight"), "Q5_0");
    // ffn_down gets Q6_K at layers 2 and 4 of 5 (llama-quantize's use_more_bits), then Q6_K's fallback.
    assert_eq!(ty("blk.0.ffn_down_exps.weight"), "Q5_0");
    assert_eq!(ty("blk.2.ffn_down_exps.weight"), "Q8_0");
    assert_eq!(ty("blk.4.ffn_down_shexp.weight"), "Q8_0");
    assert_eq!(ty("blk.0.ffn_gate_inp.weight"), "F32");
    assert_eq!(ty("output.weight"), "Q8_0");
    ok(&nextn(&["verify", p]));
    let o = ok(&nextn(&[
        "logits", "-m", p, "-p", "abc", "--json", "-t", "1",
    ]));
    let v: serde_json::Value = serde_json::from_str(&o).unwrap();
    for row in v["positions"].as_array().unwrap() {
        assert!(row["lse"].as_f64().unwrap().is_finite());
    }
}

#[test]
fn same_seed_same_bytes_whatever_the_threads() {
    let (a, b, c) = (tmp("seed-a.gguf"), tmp("seed-b.gguf"), tmp("seed-c.gguf"));
    let run = |path: &Path, seed: &str, threads: &str| {
        let mut args = TINY_DENSE.to_vec();
        args.extend([
            "--type",
            "Q4_0",
            "-o",
            path.to_str().unwrap(),
            "--seed",
            seed,
            "-t",
            threads,
            "--no-mtp",
            "--untied",
        ]);
        ok(&nextn(&args));
        std::fs::read(path).unwrap()
    };
    let first = run(&a, "7", "1");
    assert_eq!(first, run(&b, "7", "2"));
    assert_ne!(first, run(&c, "8", "2"));
    let f = GgufFile::open(&a).unwrap();
    assert!(f.tensor("output.weight").is_some());
    assert!(
        f.tensor("blk.4.attn_norm.weight").is_none(),
        "--no-mtp: no NextN block"
    );
    assert_eq!(f.get_u32("qwen35.block_count").unwrap(), Some(4));
    // Without a NextN head the file is a valid model but unusable for MTP.
    assert_eq!(
        nextn(&["verify", a.to_str().unwrap()]).status.code(),
        Some(1)
    );
}

#[test]
fn bad_options_are_refused_with_the_option_named() {
    let o = nextn(&[
        "synth",
        "--preset",
        "tiny",
        "--kv-heads",
        "3",
        "--type",
        "Q8_0",
        "--dry-run",
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--kv-heads"));
    let o = nextn(&["synth", "--preset", "huge", "--type", "Q8_0", "--dry-run"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown preset"));
    let o = nextn(&[
        "synth",
        "--preset",
        "tiny",
        "--type",
        "IQ2_XXS",
        "--dry-run",
    ]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("--type IQ2_XXS"));
    let o = nextn(&[
        "synth",
        "--arch",
        "qwen35moe",
        "--preset",
        "0.8b",
        "--type",
        "F16",
        "--dry-run",
    ]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("does not match"));
    let dry = ok(&nextn(&[
        "synth",
        "--preset",
        "27b",
        "--type",
        "Q4_K_M",
        "--dry-run",
    ]));
    assert_eq!(dry.lines().count(), 866);
    assert!(dry.contains("output.weight"));
}
