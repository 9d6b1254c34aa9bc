//! `nextn inspect`: what a GGUF file holds, from metadata and tensor infos only.

use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use nextn_gguf::{GgufFile, MetadataValue};
use nextn_model::config::{Arch, LayerKind, Qwen35Config, RopeScaling};
use nextn_model::inventory;
use nextn_model::validate::validate;
use nextn_quant::formats;
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model file (the first shard of a split model)
    pub model: PathBuf,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
    /// List every tensor with its type and shape
    #[arg(long)]
    pub tensors: bool,
    /// Write tensor NAME dequantized to raw little-endian f32 (stdout unless -o)
    #[arg(long, value_name = "NAME")]
    pub dump: Option<String>,
    /// Output file for --dump
    #[arg(short = 'o', long, value_name = "FILE", requires = "dump")]
    pub output: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let file = GgufFile::open(&args.model)
        .with_context(|| format!("cannot read {}", args.model.display()))?;
    if let Some(name) = &args.dump {
        dump_tensor(&file, name, args.output.as_ref())?;
        return Ok(ExitCode::SUCCESS);
    }
    let report = build_report(&file, args.tensors);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_text(&report);
    }
    // Everything readable was shown; a file nextn cannot run is still a failure for scripts.
    let problems = report["problems"].as_array().cloned().unwrap_or_default();
    if !problems.is_empty() {
        for p in &problems {
            eprintln!(
                "{}: problem: {}",
                args.model.display(),
                p.as_str().unwrap_or("")
            );
        }
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

fn dump_tensor(file: &GgufFile, name: &str, output: Option<&PathBuf>) -> Result<()> {
    let Some(t) = file.tensor(name) else {
        bail!("no tensor named '{name}' in the file")
    };
    if !formats::can_dequantize(t.ty) {
        bail!(
            "tensor '{name}' has type {}, which nextn cannot dequantize",
            t.ty
        );
    }
    let data = file.tensor_data(t);
    let row_len = t.dims.first().copied().unwrap_or(1) as usize;
    let row_bytes = t.row_bytes() as usize;
    let mut sink: Box<dyn Write> = match output {
        Some(p) => Box::new(
            std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))?,
        ),
        None => Box::new(std::io::stdout().lock()),
    };
    let mut w = BufWriter::new(&mut sink);
    // Row by row, so dumping a multi-gigabyte embedding needs only one row of memory.
    let mut row = vec![0.0f32; row_len];
    let mut bytes = Vec::with_capacity(row_len * 4);
    for r in 0..t.n_rows() as usize {
        formats::dequantize(t.ty, &data[r * row_bytes..(r + 1) * row_bytes], &mut row)
            .with_context(|| format!("dequantizing row {r} of '{name}'"))?;
        bytes.clear();
        row.iter()
            .for_each(|v| bytes.extend_from_slice(&v.to_le_bytes()));
        w.write_all(&bytes)?;
    }
    w.flush()?;
    Ok(())
}

fn value_summary(v: &MetadataValue) -> Value {
    match v {
        MetadataValue::String(s) if s.len() > 200 => json!(format!("<string, {} bytes>", s.len())),
        MetadataValue::String(s) => json!(s),
        MetadataValue::Array(a) if a.len() > 16 => {
            json!(format!("<array of {} {}>", a.len(), a.element_type_name()))
        }
        MetadataValue::Array(a) => match (a.as_i64_vec(), a.as_f32_vec(), a.as_strings()) {
            (Some(v), _, _) => json!(v),
            (_, Some(v), _) => json!(v),
            (_, _, Some(v)) => json!(v),
            _ => json!(format!("<array of {} {}>", a.len(), a.element_type_name())),
        },
        other => {
            if let Some(b) = other.as_bool() {
                json!(b)
            } else if let Some(i) = other.as_i64() {
                json!(i)
            } else if let Some(u) = other.as_u64() {
                json!(u)
            } else if let Some(f) = other.as_f64() {
                json!(f)
            } else {
                json!(other.type_name())
            }
        }
    }
}

/// An f32 as JSON with its shortest decimal form (1e-6, not 9.99999997e-7).
fn f32_json(x: f32) -> Value {
    x.to_string()
        .parse::<f64>()
        .map(|v| json!(v))
        .unwrap_or(Value::Null)
}

fn hyper_parameters(cfg: &Qwen35Config, n_vocab: usize) -> Value {
    let full: Vec<usize> = cfg
        .layer_kinds
        .iter()
        .enumerate()
        .filter(|(_, k)| **k == LayerKind::FullAttention)
        .map(|(i, _)| i)
        .collect();
    let mut hp = json!({
        "n_vocab": n_vocab,
        "n_ctx_train": cfg.n_ctx_train,
        "n_embd": cfg.n_embd,
        "block_count": cfg.n_layer_all,
        "n_layer": cfg.n_layer,
        "nextn_predict_layers": cfg.n_nextn,
        "full_attention_layers": full,
        "n_full_attention": full.len(),
        "n_delta_net": cfg.n_layer - full.len(),
        "n_head": cfg.n_head.first(),
        "n_head_kv": cfg.n_head_kv.first(),
        "head_dim": cfg.head_dim,
        "n_rot": cfg.n_rot,
        "rope_sections": cfg.rope_sections,
        "rope_freq_base": f32_json(cfg.rope_freq_base),
        "rope_scaling": match cfg.rope_scaling {
            RopeScaling::None => json!("none"),
            RopeScaling::Linear { freq_scale } => json!({"linear": {"freq_scale": f32_json(freq_scale)}}),
        },
        "rms_eps": f32_json(cfg.rms_eps),
        "ssm_conv_kernel": cfg.conv_kernel,
        "ssm_state_size": cfg.ssm_head_dim,
        "ssm_group_count": cfg.ssm_k_heads,
        "ssm_time_step_rank": cfg.ssm_v_heads,
        "ssm_inner_size": cfg.ssm_inner,
    });
    let obj = hp.as_object_mut().expect("json object");
    match cfg.arch {
        Arch::Dense => {
            obj.insert("n_ff".into(), json!(cfg.n_ff.first()));
        }
        Arch::Moe => {
            obj.insert("n_expert".into(), json!(cfg.n_expert));
            obj.insert("n_expert_used".into(), json!(cfg.n_expert_used));
            obj.insert("n_ff_exp".into(), json!(cfg.n_ff_exp));
            obj.insert("n_ff_shexp".into(), json!(cfg.n_ff_shexp));
        }
    }
    hp
}

fn tokenizer_summary(file: &GgufFile) -> Value {
    let s = |k: &str| file.get(k).and_then(|v| v.as_str()).map(str::to_string);
    let id = |k: &str| file.get(k).and_then(|v| v.as_u64());
    let tokens = file
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.as_array())
        .and_then(|a| a.as_strings());
    let piece = |i: Option<u64>| {
        i.and_then(|i| tokens.and_then(|t| t.get(i as usize)))
            .cloned()
    };
    let n_merges = file
        .get("tokenizer.ggml.merges")
        .and_then(|v| v.as_array())
        .map(|a| a.len());
    let template = s("tokenizer.chat_template");
    json!({
        "model": s("tokenizer.ggml.model"),
        "pre": s("tokenizer.ggml.pre"),
        "n_tokens": tokens.map(|t| t.len()),
        "n_merges": n_merges,
        "bos_token_id": id("tokenizer.ggml.bos_token_id"),
        "bos_token": piece(id("tokenizer.ggml.bos_token_id")),
        "eos_token_id": id("tokenizer.ggml.eos_token_id"),
        "eos_token": piece(id("tokenizer.ggml.eos_token_id")),
        "padding_token_id": id("tokenizer.ggml.padding_token_id"),
        "add_bos_token": file.get("tokenizer.ggml.add_bos_token").and_then(|v| v.as_bool()),
        "chat_template": template.is_some(),
        "chat_template_bytes": template.map(|t| t.len()),
    })
}

fn nextn_summary(file: &GgufFile, cfg: &Qwen35Config, n_vocab: usize) -> Value {
    let Some(block) = cfg.nextn_block() else {
        return json!({"present": false});
    };
    let expected = inventory::nextn_tensors(cfg, file, n_vocab);
    let problems = inventory::check(file, &expected);
    let prefix = format!("blk.{block}.");
    let tensors: Vec<Value> = file
        .tensors()
        .iter()
        .filter(|t| t.name.starts_with(&prefix))
        .map(|t| json!({"name": t.name, "type": t.ty.name(), "dims": t.dims}))
        .collect();
    json!({
        "present": true,
        "block": block,
        "complete": problems.is_empty(),
        "problems": problems.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
        "sidecar": nextn_model::validate::is_sidecar(file),
        "own_embedding": file.tensor(&format!("blk.{block}.nextn.embed_tokens.weight")).is_some(),
        "own_lm_head": file.tensor(&format!("blk.{block}.nextn.shared_head_head.weight")).is_some(),
        "tensors": tensors,
    })
}

pub fn build_report(file: &GgufFile, list_tensors: bool) -> Value {
    let arch = file
        .get("general.architecture")
        .and_then(|v| v.as_str())
        .map(str::to_string);
    let mut by_type: BTreeMap<&str, (usize, u64, u64)> = BTreeMap::new();
    for t in file.tensors() {
        let e = by_type.entry(t.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.n_bytes;
        e.2 += t.n_elements;
    }
    let types: BTreeMap<&str, Value> = by_type
        .iter()
        .map(|(k, (n, b, el))| (*k, json!({"tensors": n, "bytes": b, "elements": el})))
        .collect();
    let unsupported: Vec<String> = file
        .tensors()
        .iter()
        .filter(|t| !formats::can_dequantize(t.ty))
        .map(|t| format!("unsupported tensor type {} in tensor {}", t.ty, t.name))
        .collect();
    let n_vocab = inventory::n_vocab(file);
    // The configuration alone (shown even when other checks fail), then the full validation.
    let (hp, nextn) = match Qwen35Config::from_gguf(file) {
        Ok(cfg) => (
            Some(hyper_parameters(&cfg, n_vocab)),
            Some(nextn_summary(file, &cfg, n_vocab)),
        ),
        Err(_) => (None, None),
    };
    let problems: Vec<String> = match validate(file) {
        Ok(_) => Vec::new(),
        Err(invalid) => invalid.0.iter().map(|p| p.to_string()).collect(),
    };
    let metadata: BTreeMap<&str, Value> = file
        .metadata()
        .iter()
        .filter(|(k, _)| !k.starts_with("tokenizer."))
        .map(|(k, v)| (k.as_str(), value_summary(v)))
        .collect();
    let mut report = json!({
        "file": file.shard_paths().first().map(|p| p.display().to_string()),
        "shards": file.shard_paths().iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "gguf_version": file.version(),
        "alignment": file.alignment(),
        "file_bytes": file.file_size(),
        "n_metadata": file.metadata().len(),
        "architecture": arch,
        "name": file.get("general.name").and_then(|v| v.as_str()),
        "hyper_parameters": hp,
        "problems": problems,
        "n_tensors": file.tensors().len(),
        "tensor_bytes": file.tensors().iter().map(|t| t.n_bytes).sum::<u64>(),
        "n_parameters": file.tensors().iter().map(|t| t.n_elements).sum::<u64>(),
        "types": types,
        "unsupported_tensors": unsupported,
        "tokenizer": tokenizer_summary(file),
        "nextn": nextn,
        "metadata": metadata,
    });
    if list_tensors {
        let list: Vec<Value> = file
            .tensors()
            .iter()
            .map(|t| json!({"name": t.name, "type": t.ty.name(), "dims": t.dims, "bytes": t.n_bytes, "shard": t.shard}))
            .collect();
        report
            .as_object_mut()
            .expect("json object")
            .insert("tensors".into(), json!(list));
    }
    report
}

fn human_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.2} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB", b / 1e3)
    } else {
        format!("{b} B")
    }
}

fn print_text(r: &Value) {
    let s = |v: &Value| match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    };
    println!("file          {}", s(&r["file"]));
    if r["shards"].as_array().map(|a| a.len()).unwrap_or(0) > 1 {
        println!(
            "shards        {}",
            r["shards"].as_array().map(|a| a.len()).unwrap_or(0)
        );
    }
    println!(
        "format        GGUF v{}, alignment {}, {} metadata keys, {}",
        r["gguf_version"],
        r["alignment"],
        r["n_metadata"],
        human_bytes(r["file_bytes"].as_u64().unwrap_or(0))
    );
    println!("architecture  {}", s(&r["architecture"]));
    println!("name          {}", s(&r["name"]));
    if let Some(hp) = r["hyper_parameters"].as_object() {
        println!("hyper-parameters:");
        for (k, v) in hp {
            println!("  {k:<22} {}", s(v));
        }
    }
    println!(
        "tensors       {} ({} parameters, {})",
        r["n_tensors"],
        r["n_parameters"],
        human_bytes(r["tensor_bytes"].as_u64().unwrap_or(0))
    );
    if let Some(types) = r["types"].as_object() {
        for (ty, v) in types {
            println!(
                "  {ty:<8} {:>5} tensors  {:>12}",
                v["tensors"],
                human_bytes(v["bytes"].as_u64().unwrap_or(0))
            );
        }
    }
    for u in r["unsupported_tensors"].as_array().into_iter().flatten() {
        println!("  warning: {}", s(u));
    }
    let t = &r["tokenizer"];
    println!(
        "tokenizer     {} / pre {}: {} tokens, {} merges, bos {} eos {} ({}), add_bos {}",
        s(&t["model"]),
        s(&t["pre"]),
        s(&t["n_tokens"]),
        s(&t["n_merges"]),
        s(&t["bos_token_id"]),
        s(&t["eos_token_id"]),
        s(&t["eos_token"]),
        s(&t["add_bos_token"])
    );
    match t["chat_template_bytes"].as_u64() {
        Some(n) => println!("chat template present ({n} bytes)"),
        None => println!("chat template absent (ChatML fallback)"),
    }
    let n = &r["nextn"];
    if n["present"].as_bool() == Some(true) {
        println!(
            "NextN head    blk.{}: {}{}, {} tensors",
            n["block"],
            if n["complete"].as_bool() == Some(true) {
                "complete"
            } else {
                "INCOMPLETE"
            },
            if n["sidecar"].as_bool() == Some(true) {
                " (MTP-only sidecar)"
            } else {
                ""
            },
            n["tensors"].as_array().map(|a| a.len()).unwrap_or(0)
        );
        for p in n["problems"].as_array().into_iter().flatten() {
            println!("  problem: {}", s(p));
        }
        for t in n["tensors"].as_array().into_iter().flatten() {
            println!("  {:<44} {:<6} {}", s(&t["name"]), s(&t["type"]), t["dims"]);
        }
    } else if !n.is_null() {
        println!("NextN head    none");
    }
    if let Some(problems) = r["problems"].as_array().filter(|p| !p.is_empty()) {
        println!(
            "problems      {} (nextn cannot run this file)",
            problems.len()
        );
        for p in problems {
            println!("  {}", s(p));
        }
    }
    if let Some(list) = r["tensors"].as_array() {
        println!("tensor list:");
        for t in list {
            println!(
                "  {:<44} {:<7} {:<22} {:>12}",
                s(&t["name"]),
                s(&t["type"]),
                t["dims"].to_string(),
                s(&t["bytes"])
            );
        }
    }
}
