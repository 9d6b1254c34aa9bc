//! `nextn vocab-stats`: token frequencies of text files under a model's tokenizer, written as the
//! ranking a trimmed draft head (`--spec-draft-vocab N`) keeps the top of.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use nextn_engine::tokenizer::Tokenizer;
use nextn_gguf::GgufFile;
use nextn_model::draft_vocab::TokenRanking;

use super::common;

/// How many tokens each shipped/written binary ranking's header checks against the tokenizer.
const N_CHECKS: usize = 8;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model whose tokenizer is used (weights are not read); defaults to the bundled model
    #[arg(short = 'm', long = "model", value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// Text files to count; directories are walked recursively (files that are not UTF-8 are skipped)
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,
    /// Output ranking
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: PathBuf,
    /// Write only the N most frequent tokens
    #[arg(long, value_name = "N")]
    pub top: Option<usize>,
    /// Write the compact binary form (u32 ids, with token strings that identify the tokenizer)
    /// instead of text; only tokens seen at least once
    #[arg(long)]
    pub binary: bool,
    /// Skip files larger than this many bytes
    #[arg(long = "max-file-bytes", default_value_t = 8 << 20)]
    pub max_file_bytes: u64,
}

fn collect_files(p: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let meta =
        std::fs::symlink_metadata(p).with_context(|| format!("cannot read {}", p.display()))?;
    if meta.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(p)
            .with_context(|| format!("cannot list {}", p.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for e in entries {
            // Unreadable entries deep in a tree are skipped rather than failing the whole count.
            let _ = collect_files(&e, out);
        }
    } else if meta.is_file() {
        out.push(p.to_path_buf());
    }
    Ok(())
}

struct Counts {
    counts: Vec<u64>,
    files: usize,
    skipped: usize,
    bytes: u64,
}

fn count_files(tok: &Tokenizer, files: &[PathBuf], max_bytes: u64) -> Counts {
    let mut c = Counts {
        counts: vec![0; tok.vocab_size()],
        files: 0,
        skipped: 0,
        bytes: 0,
    };
    for f in files {
        let text = match std::fs::metadata(f) {
            Ok(m) if m.len() <= max_bytes => std::fs::read(f)
                .ok()
                .and_then(|b| String::from_utf8(b).ok()),
            _ => None,
        };
        let Some(text) = text else {
            c.skipped += 1;
            continue;
        };
        for id in tok.encode(&text, false) {
            if let Some(n) = c.counts.get_mut(id as usize) {
                *n += 1;
            }
        }
        c.files += 1;
        c.bytes += text.len() as u64;
    }
    c
}

pub fn run(args: Args) -> Result<ExitCode> {
    let path = common::resolve_model_path(args.model.as_ref())?;
    let file = GgufFile::open(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let tok =
        Tokenizer::from_gguf(&file).with_context(|| format!("tokenizer of {}", path.display()))?;
    let n_vocab = tok.vocab_size();
    let mut files = Vec::new();
    for p in &args.files {
        collect_files(p, &mut files)?;
    }
    if files.is_empty() {
        bail!("no files to count under {:?}", args.files);
    }
    let t0 = Instant::now();
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let chunk = files.len().div_ceil(threads);
    let parts: Vec<Counts> = std::thread::scope(|s| {
        let handles: Vec<_> = files
            .chunks(chunk)
            .map(|c| s.spawn(|| count_files(&tok, c, args.max_file_bytes)))
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    if parts.len() != files.chunks(chunk).count() {
        bail!("a counting thread failed");
    }
    let mut total = Counts {
        counts: vec![0; n_vocab],
        files: 0,
        skipped: 0,
        bytes: 0,
    };
    for p in parts {
        total
            .counts
            .iter_mut()
            .zip(&p.counts)
            .for_each(|(a, b)| *a += b);
        total.files += p.files;
        total.skipped += p.skipped;
        total.bytes += p.bytes;
    }
    if total.files == 0 {
        bail!(
            "none of the {} files could be read as UTF-8 text",
            files.len()
        );
    }
    let n_tokens: u64 = total.counts.iter().sum();
    let mut order: Vec<u32> = (0..n_vocab as u32).collect();
    order.sort_by(|&a, &b| {
        total.counts[b as usize]
            .cmp(&total.counts[a as usize])
            .then(a.cmp(&b))
    });
    let top = args.top.unwrap_or(n_vocab).min(n_vocab);
    order.truncate(top);
    let sources: Vec<String> = args.files.iter().map(|p| p.display().to_string()).collect();
    if args.binary {
        order.retain(|&id| total.counts[id as usize] > 0);
        let checks = order
            .iter()
            .take(N_CHECKS)
            .filter_map(|&id| tok.token_text(id).map(|t| (id, t.to_string())))
            .collect();
        let r = TokenRanking {
            ids: order.clone(),
            n_vocab: Some(n_vocab),
            checks,
            origin: args.output.display().to_string(),
        };
        std::fs::write(&args.output, r.to_binary(n_vocab))
            .with_context(|| format!("cannot write {}", args.output.display()))?;
    } else {
        let mut out = Vec::with_capacity(order.len() * 12 + 512);
        writeln!(
            out,
            "# nextn vocab-stats: token ids by descending count, from {} files ({} bytes, {} tokens; {} skipped) tokenized with {} (vocab {n_vocab})",
            total.files, total.bytes, n_tokens, total.skipped, path.display()
        )?;
        writeln!(out, "# sources: {}", sources.join(" "))?;
        writeln!(out, "# id count")?;
        for &id in &order {
            writeln!(out, "{id} {}", total.counts[id as usize])?;
        }
        std::fs::write(&args.output, out)
            .with_context(|| format!("cannot write {}", args.output.display()))?;
    }
    let seen = total.counts.iter().filter(|&&c| c > 0).count();
    eprintln!(
        "vocab-stats: {} files ({:.1} MiB, {} skipped), {n_tokens} tokens, {seen} of {n_vocab} ids seen, in {:.1} s; wrote {} ids to {}",
        total.files,
        total.bytes as f64 / (1 << 20) as f64,
        total.skipped,
        t0.elapsed().as_secs_f64(),
        order.len(),
        args.output.display()
    );
    Ok(ExitCode::SUCCESS)
}
