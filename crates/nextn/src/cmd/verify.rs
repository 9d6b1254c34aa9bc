//! `nextn verify`: is this file a qwen35/qwen35moe model whose NextN head we can draft with?
//! Exit 0 yes, 1 valid GGUF but unusable for MTP (the reason is printed), 2 not a valid GGUF.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use nextn_gguf::GgufFile;
use nextn_model::config::Qwen35Config;
use nextn_model::inventory;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model file (the first shard of a split model)
    pub model: PathBuf,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let file = match GgufFile::open(&args.model) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{}: not a valid GGUF file: {e}", args.model.display());
            return Ok(ExitCode::from(2));
        }
    };
    let unusable = |why: String| {
        eprintln!("{}: unusable for MTP: {why}", args.model.display());
        Ok(ExitCode::from(1))
    };
    let cfg = match Qwen35Config::from_gguf(&file) {
        Ok(c) => c,
        Err(e) => return unusable(e.to_string()),
    };
    let Some(block) = cfg.nextn_block() else {
        return unusable(format!(
            "{} file has no NextN head ({}.nextn_predict_layers is 0 or absent)",
            cfg.arch.name(),
            cfg.arch.name()
        ));
    };
    if cfg.n_nextn != 1 {
        return unusable(format!(
            "{} NextN layers; only one is supported (as in every Qwen3.5/3.6 checkpoint)",
            cfg.n_nextn
        ));
    }
    let n_vocab = inventory::n_vocab(&file);
    let sidecar = file.tensor("blk.0.attn_norm.weight").is_none();
    let mut expected = inventory::nextn_tensors(&cfg, &file, n_vocab);
    if sidecar {
        // An MTP-only file carries the embedding, final norm and head beside blk.N.
        let e = cfg.n_embd as u64;
        expected.push(inventory::ExpectedTensor {
            name: "token_embd.weight".into(),
            dims: vec![e, n_vocab as u64],
            required: true,
        });
    } else {
        expected.extend(inventory::trunk_tensors(&cfg, &file, n_vocab));
    }
    if n_vocab == 0 {
        return unusable("tensor 'token_embd.weight' is missing".into());
    }
    let problems = inventory::check(&file, &expected);
    if !problems.is_empty() {
        let list: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
        return unusable(list.join("; "));
    }
    println!(
        "{}: ok: {} {} with NextN head at blk.{block}{} ({} tensors checked)",
        args.model.display(),
        cfg.arch.name(),
        if sidecar { "MTP-only sidecar" } else { "model" },
        if file
            .tensor(&format!("blk.{block}.nextn.shared_head_head.weight"))
            .is_some()
        {
            ", own LM head"
        } else {
            ""
        },
        expected.len()
    );
    Ok(ExitCode::SUCCESS)
}
