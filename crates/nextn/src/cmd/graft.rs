//! `nextn graft BODY HEAD OUT`: the trunk, tokenizer and metadata of BODY with the NextN (MTP)
//! block of HEAD, after checking that they belong together.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use nextn_gguf::{GgmlType, GgufFile};
use nextn_model::graft;

#[derive(clap::Args)]
pub struct Args {
    /// Model whose trunk, tokenizer and metadata are kept (its own NextN block, if any, is
    /// replaced)
    pub body: PathBuf,
    /// Model or MTP-only sidecar whose NextN block is taken
    pub head: PathBuf,
    /// Output GGUF
    pub output: PathBuf,
    /// Re-quantize the head's quantizable tensors to this ggml type on the way (e.g. q8_0)
    #[arg(long = "head-type", value_name = "TYPE")]
    pub head_type: Option<String>,
    /// Threads for --head-type (default: all cores)
    #[arg(short = 't', long = "threads", value_name = "N")]
    pub threads: Option<usize>,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let head_type = match &args.head_type {
        Some(s) => match GgmlType::from_name(s) {
            Some(t) => Some(t),
            None => bail!("--head-type {s}: not a ggml tensor type (e.g. q8_0, q6_k, f16)"),
        },
        None => None,
    };
    let body = GgufFile::open(&args.body)
        .with_context(|| format!("cannot read BODY {}", args.body.display()))?;
    let head = GgufFile::open(&args.head)
        .with_context(|| format!("cannot read HEAD {}", args.head.display()))?;
    let plan = graft::plan(&body, &head, head_type)?;
    let threads = super::common::threads_or_all(args.threads)?;
    graft::write(&body, &head, &plan, &args.output, threads)
        .with_context(|| format!("writing {}", args.output.display()))?;
    eprintln!(
        "wrote {}: {} tensors of {} and the NextN block blk.{} ({} tensors{}) of {}{}; tokenizer {:016x}",
        args.output.display(),
        plan.body_tensors.len(),
        args.body.display(),
        plan.block,
        plan.head_tensors.len(),
        head_type.map_or(String::new(), |t| format!(", quantizable ones as {}", t.name())),
        args.head.display(),
        if plan.replaced.is_empty() {
            String::new()
        } else {
            format!(", replacing BODY's own {}", plan.replaced.len())
        },
        plan.tokenizer_hash
    );
    eprintln!(
        "check it with: nextn verify {}, then nextn bench --check -m {} (the head's acceptance)",
        args.output.display(),
        args.output.display()
    );
    Ok(ExitCode::SUCCESS)
}
