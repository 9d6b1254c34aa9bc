//! `nextn verify`: is this file a qwen35/qwen35moe model whose NextN head we can draft with?
//! Exit 0 yes, 1 valid GGUF but unusable (every problem is printed), 2 not a valid GGUF.
//!
//! "Yes" means `run` will work: the file passes the validation every load runs, and a dry load
//! binds every weight, builds the tokenizer and the chat template, and runs one token through
//! the trunk and the head with finite logits.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Result;
use nextn_engine::chat::ChatTemplate;
use nextn_engine::tokenizer::Tokenizer;
use nextn_gguf::GgufFile;
use nextn_model::validate::{validate, ValidModel};
use nextn_model::{KvType, LogitRows, Model, NextnHead};
use nextn_quant::kernels::ThreadPool;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model file (the first shard of a split model)
    pub model: PathBuf,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let path = args.model.display().to_string();
    let file = match GgufFile::open(&args.model) {
        Ok(f) => Arc::new(f),
        Err(e) => {
            eprintln!("{path}: not a valid GGUF file: {e}");
            return Ok(ExitCode::from(2));
        }
    };
    let unusable = |problems: Vec<String>| {
        for p in &problems {
            eprintln!("{path}: unusable: {p}");
        }
        Ok(ExitCode::from(1))
    };
    let valid = match validate(&file) {
        Ok(v) => v,
        Err(invalid) => return unusable(invalid.0.iter().map(|p| p.to_string()).collect()),
    };
    let cfg = &valid.config;
    let Some(block) = cfg.nextn_block() else {
        return unusable(vec![format!(
            "{} file has no NextN head ({}.nextn_predict_layers is 0 or absent)",
            cfg.arch.name(),
            cfg.arch.name()
        )]);
    };
    if cfg.n_nextn != 1 {
        return unusable(vec![format!(
            "{} NextN layers; only one is supported (as in every Qwen3.5/3.6 checkpoint)",
            cfg.n_nextn
        )]);
    }
    let dry_load = if valid.sidecar {
        // An MTP-only file has no trunk to run: its head is bound when a model loads it (-md).
        "validated; the head runs once it is loaded beside its model with -md".to_string()
    } else {
        match dry_run(&file, &valid) {
            Ok(()) => "dry load and one-token forward of trunk and head ok".to_string(),
            Err(problem) => return unusable(vec![problem]),
        }
    };
    println!(
        "{path}: ok: {} {} with NextN head at blk.{block}{} ({} tensors checked; {dry_load})",
        cfg.arch.name(),
        if valid.sidecar {
            "MTP-only sidecar"
        } else {
            "model"
        },
        if file
            .tensor(&format!("blk.{block}.nextn.shared_head_head.weight"))
            .is_some()
        {
            ", own LM head"
        } else {
            ""
        },
        valid.n_tensors_checked
    );
    Ok(ExitCode::SUCCESS)
}

/// Bind every weight, build the tokenizer and chat template, and run one token through the
/// trunk and the head: what `run` does first, so that a file passing here runs there.
fn dry_run(file: &Arc<GgufFile>, valid: &ValidModel) -> Result<(), String> {
    let model = Model::load(file.clone()).map_err(|e| format!("loading the model: {e}"))?;
    let head = NextnHead::load(&model).map_err(|e| format!("loading the NextN head: {e}"))?;
    let tokenizer =
        Tokenizer::from_gguf(file).map_err(|e| format!("building the tokenizer: {e}"))?;
    ChatTemplate::from_gguf(file).map_err(|e| format!("reading the chat template: {e}"))?;
    let token = tokenizer
        .encode("Hello", false)
        .first()
        .copied()
        .unwrap_or(0);
    let pool = ThreadPool::new(1);
    let mut state = model
        .new_sequence(8, KvType::F32, KvType::F32)
        .map_err(|e| format!("a sequence for the one-token forward: {e}"))?;
    let out = model
        .forward(&[token], &mut state, LogitRows::All, &pool)
        .map_err(|e| format!("one-token forward of the trunk: {e}"))?;
    if let Some(bad) = out.logits.iter().position(|x| !x.is_finite()) {
        return Err(format!(
            "the trunk's logits for one token are not finite (logit {bad} is {}): the weights are damaged",
            out.logits[bad]
        ));
    }
    let hidden_prev = vec![0.0f32; valid.config.n_embd];
    let mut cache = head
        .new_cache(KvType::F32, KvType::F32, 8)
        .map_err(|e| format!("the NextN head's cache: {e}"))?;
    let out = head
        .forward(&[token], &hidden_prev, 0, &mut cache, LogitRows::All, &pool)
        .map_err(|e| format!("one-token forward of the NextN head: {e}"))?;
    if let Some(bad) = out.logits.iter().position(|x| !x.is_finite()) {
        return Err(format!(
            "the NextN head's logits for one token are not finite (logit {bad} is {}): its weights are damaged",
            out.logits[bad]
        ));
    }
    Ok(())
}
