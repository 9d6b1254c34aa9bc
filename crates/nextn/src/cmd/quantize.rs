//! `nextn quantize IN OUT TYPE [NTHREADS]`: llama-quantize's command line and type mixes, with
//! the NextN block's type under the user's control (`--keep-nextn-type`).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use nextn_gguf::{GgmlType, GgufFile, SplitLimit};
use nextn_model::config::Qwen35Config;
use nextn_model::quantize::{self, FileType, MixOptions, Output};
use regex::Regex;

#[derive(clap::Args)]
pub struct Args {
    /// Source GGUF (F32, F16, BF16, or quantized with --allow-requantize; the first shard of a
    /// split model)
    pub input: PathBuf,
    /// Output GGUF (with --split-max-size: the shards' name without -0000k-of-0000N.gguf)
    pub output: PathBuf,
    /// File type, llama-quantize's names: F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K_S
    /// Q3_K_M Q3_K_L Q4_K_S Q4_K_M Q5_K_S Q5_K_M Q6_K IQ4_NL IQ4_XS
    #[arg(value_name = "TYPE")]
    pub file_type: String,
    /// Threads (llama-quantize's optional last argument; default: all cores)
    #[arg(value_name = "NTHREADS")]
    pub nthreads: Option<usize>,
    /// Threads (the same as NTHREADS)
    #[arg(
        short = 't',
        long = "threads",
        value_name = "N",
        conflicts_with = "nthreads"
    )]
    pub threads: Option<usize>,
    /// Tensors whose name matches the regular expression get TYPE (llama-quantize's flag;
    /// repeatable; the first matching pattern wins), e.g. 'attn_v=q8_0'
    #[arg(long = "tensor-type", value_name = "PATTERN=TYPE")]
    pub tensor_type: Vec<String>,
    /// A file of PATTERN=TYPE entries separated by spaces or newlines (llama-quantize's flag)
    #[arg(long = "tensor-type-file", value_name = "FILE")]
    pub tensor_type_file: Option<PathBuf>,
    /// Importance matrix from llama-imatrix (GGUF or the legacy .dat format) for the quantizers
    /// that take importance weights (llama-quantize's flag)
    #[arg(long, value_name = "FILE")]
    pub imatrix: Option<PathBuf>,
    /// Use the importance matrix only for tensors whose name contains this (repeatable)
    #[arg(
        long = "include-weights",
        value_name = "NAME",
        requires = "imatrix",
        conflicts_with = "exclude_weights"
    )]
    pub include_weights: Vec<String>,
    /// Do not use the importance matrix for tensors whose name contains this (repeatable)
    #[arg(long = "exclude-weights", value_name = "NAME", requires = "imatrix")]
    pub exclude_weights: Vec<String>,
    /// Every quantizable tensor of the NextN block (blk.N of the MTP head) gets TYPE, e.g. Q8_0
    /// (checked before the --tensor-type patterns)
    #[arg(long = "keep-nextn-type", value_name = "TYPE")]
    pub keep_nextn_type: Option<String>,
    /// Type of output.weight (llama-quantize's flag)
    #[arg(long = "output-tensor-type", value_name = "TYPE")]
    pub output_tensor_type: Option<String>,
    /// Type of token_embd.weight (llama-quantize's flag)
    #[arg(long = "token-embedding-type", value_name = "TYPE")]
    pub token_embedding_type: Option<String>,
    /// Leave output.weight in its source type (llama-quantize's flag)
    #[arg(long = "leave-output-tensor")]
    pub leave_output_tensor: bool,
    /// No mix: every quantizable tensor gets the file type's base type (llama-quantize's flag)
    #[arg(long)]
    pub pure: bool,
    /// Allow quantizing tensors that are already quantized (llama-quantize's flag)
    #[arg(long = "allow-requantize")]
    pub allow_requantize: bool,
    /// Print the type and size of every tensor and the total, and write nothing
    #[arg(long = "dry-run")]
    pub dry_run: bool,
    /// Write shards of at most this size (e.g. 4G, 500M; llama-gguf-split's flag and naming)
    #[arg(long = "split-max-size", value_name = "N(M|G)")]
    pub split_max_size: Option<String>,
}

/// A tensor type by ggml's name, any case (llama-quantize's `parse_ggml_type`).
fn tensor_type(flag: &str, s: &str) -> Result<GgmlType> {
    match GgmlType::from_name(s) {
        Some(t) => Ok(t),
        None => bail!("{flag} {s}: not a ggml tensor type (e.g. q8_0, q6_k, q4_k, f16)"),
    }
}

/// `500M`, `4G` (powers of 1000, as llama-gguf-split reads them), or a plain byte count.
fn size(s: &str) -> Result<u64> {
    let (digits, unit) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&s[..i], c.to_ascii_uppercase()),
        _ => (s, 'B'),
    };
    let n: u64 = digits
        .parse()
        .with_context(|| format!("--split-max-size {s}: expected a number with M or G"))?;
    let scale = match unit {
        'B' => 1,
        'K' => 1000,
        'M' => 1000 * 1000,
        'G' => 1000 * 1000 * 1000,
        other => bail!("--split-max-size {s}: unknown unit '{other}' (use M or G)"),
    };
    match n.checked_mul(scale) {
        Some(0) | None => bail!("--split-max-size {s}: must be a positive size"),
        Some(bytes) => Ok(bytes),
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

pub fn run(args: Args) -> Result<ExitCode> {
    let Some(ftype) = FileType::parse(&args.file_type) else {
        let names: Vec<&str> = FileType::ALL.iter().map(|t| t.name()).collect();
        bail!(
            "type {}: expected one of {}",
            args.file_type,
            names.join(" ")
        );
    };
    let file = GgufFile::open(&args.input)
        .with_context(|| format!("cannot read {}", args.input.display()))?;
    let cfg = Qwen35Config::from_gguf(&file)
        .with_context(|| format!("{} is not a qwen35/qwen35moe model", args.input.display()))?;

    let mut overrides = Vec::new();
    if let Some(t) = &args.keep_nextn_type {
        let ty = tensor_type("--keep-nextn-type", t)?;
        let Some(block) = cfg.nextn_block() else {
            bail!(
                "--keep-nextn-type: {} has no NextN block (nextn_predict_layers is 0)",
                args.input.display()
            );
        };
        let pattern = Regex::new(&format!(r"^blk\.{block}\."))?;
        overrides.push((pattern, ty));
    }
    let mut specs: Vec<(String, &str)> = args
        .tensor_type
        .iter()
        .map(|s| (s.clone(), "--tensor-type"))
        .collect();
    if let Some(path) = &args.tensor_type_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--tensor-type-file {}", path.display()))?;
        specs.extend(
            text.split_whitespace()
                .map(|s| (s.to_string(), "--tensor-type-file")),
        );
    }
    for (spec, flag) in &specs {
        // As llama-quantize: split at the first '=', and match names in lower case.
        let Some((pattern, ty)) = spec.split_once('=').filter(|(p, _)| !p.is_empty()) else {
            bail!("{flag} {spec}: expected PATTERN=TYPE, e.g. attn_v=q8_0");
        };
        let regex = Regex::new(&pattern.to_lowercase())
            .with_context(|| format!("{flag} {spec}: bad regular expression"))?;
        overrides.push((regex, tensor_type(flag, ty)?));
    }
    let importance = match &args.imatrix {
        Some(path) => {
            let mut m = quantize::Importance::load(path)?;
            if !args.exclude_weights.is_empty() {
                m.entries.retain(|name, _| {
                    !args
                        .exclude_weights
                        .iter()
                        .any(|x| name.contains(x.as_str()))
                });
            }
            if !args.include_weights.is_empty() {
                m.entries.retain(|name, _| {
                    args.include_weights
                        .iter()
                        .any(|x| name.contains(x.as_str()))
                });
            }
            eprintln!(
                "importance matrix {}: {} entries{}, {} chunks",
                path.display(),
                m.entries.len(),
                if m.datasets.is_empty() {
                    String::new()
                } else {
                    format!(" from {}", m.datasets.join(", "))
                },
                m.chunk_count
            );
            Some(m)
        }
        None => None,
    };
    let opts = MixOptions {
        overrides,
        output_type: args
            .output_tensor_type
            .as_deref()
            .map(|t| tensor_type("--output-tensor-type", t))
            .transpose()?,
        token_embedding_type: args
            .token_embedding_type
            .as_deref()
            .map(|t| tensor_type("--token-embedding-type", t))
            .transpose()?,
        pure: args.pure,
        leave_output: args.leave_output_tensor,
        has_imatrix: importance.as_ref().is_some_and(|m| !m.entries.is_empty()),
    };
    let plan = quantize::plan(&file, ftype, &opts, args.allow_requantize)?;

    if args.dry_run {
        for (i, t) in plan.tensors.iter().enumerate() {
            println!(
                "[{:>4}/{:>4}] {:<44} {:<20} {:>6} -> {:<6} {:>10.3} MiB -> {:>10.3} MiB",
                i + 1,
                plan.tensors.len(),
                t.name,
                format!("{:?}", t.dims),
                t.source.name(),
                t.target.name(),
                mib(t.source_bytes),
                mib(t.target_bytes)
            );
        }
        println!(
            "{}: {:.2} MiB -> {:.2} MiB as {} ({} tensors; nothing written)",
            args.input.display(),
            mib(plan.source_bytes()),
            mib(plan.target_bytes()),
            ftype.name(),
            plan.tensors.len()
        );
        return Ok(ExitCode::SUCCESS);
    }

    let threads = args.nthreads.or(args.threads).unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    if threads == 0 {
        bail!("threads: at least one is needed");
    }
    let output = match &args.split_max_size {
        Some(s) => Output::Split {
            stem: quantize::split_stem(&args.output),
            limit: SplitLimit::MaxBytes(size(s)?),
        },
        None => Output::File(args.output.clone()),
    };
    let t0 = Instant::now();
    let tty = std::io::stderr().is_terminal();
    let n_converted = plan.tensors.iter().filter(|t| t.source != t.target).count();
    let mut step = 0;
    let mut progress = |done: u64, total: u64, name: &str| {
        step += 1;
        if tty {
            let width = 30;
            let filled = (width as u64 * done / total.max(1)) as usize;
            eprint!(
                "\r\x1b[2Kquantizing [{}{}] {:>3}% {name}",
                "#".repeat(filled),
                " ".repeat(width - filled),
                100 * done / total.max(1)
            );
        } else {
            eprintln!("[{step:>4}/{n_converted:>4}] {name}");
        }
    };
    let paths = quantize::write(
        &file,
        &plan,
        &output,
        importance.as_ref(),
        threads,
        &mut progress,
    )
    .with_context(|| format!("writing {}", args.output.display()))?;
    if tty {
        eprint!("\r\x1b[2K");
    }
    let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    eprintln!(
        "wrote {}: {:.2} MiB -> {:.2} MiB as {}, {n_converted} of {} tensors converted, {threads} threads, {:.1} s",
        names.join(", "),
        mib(plan.source_bytes()),
        mib(plan.target_bytes()),
        ftype.name(),
        plan.tensors.len(),
        t0.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}
