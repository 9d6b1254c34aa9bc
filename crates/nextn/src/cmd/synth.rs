//! `nextn synth`: write a random-weight Qwen3.5 / Qwen3.6 GGUF with real shapes and the real
//! tokenizer, for benchmarks and memory planning without downloads.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use nextn_gguf::{GgmlType, GgufFile};
use nextn_model::config::Arch;
use nextn_model::synth::{self, FileType, RawVocab, SynthSpec, Vocab, PRESETS};
use nextn_model::validate::validate;

/// The Qwen3.5 / Qwen3.6 vocabulary (tools/make_qwen35_vocab.py), so the binary needs no data files.
const QWEN35_VOCAB: &[u8] = include_bytes!("../../../../models/qwen35-vocab.bin");

#[derive(clap::Args)]
pub struct Args {
    /// Shape preset: 0.8b, 27b, 35b-a3b, 35b-a3b-small, tiny, tiny-moe (dimension options override it)
    #[arg(long)]
    pub preset: Option<String>,
    /// qwen35 (dense) or qwen35moe; without --preset the base shape is 0.8b resp. 35b-a3b-small
    #[arg(long)]
    pub arch: Option<String>,
    /// File type: F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K_M Q5_K_M Q6_K (llama-quantize's mixes)
    #[arg(long = "type", value_name = "TYPE")]
    pub file_type: String,
    /// Output GGUF file
    #[arg(
        short = 'o',
        long = "output",
        value_name = "FILE",
        required_unless_present = "dry_run"
    )]
    pub output: Option<PathBuf>,
    /// Random seed (same seed, same file)
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Threads for generating and quantizing (default: all cores)
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Print the tensor plan and the expected size; write nothing
    #[arg(long)]
    pub dry_run: bool,
    /// Also write a vision projector (mmproj, F16) of the released Qwen3.5 / Qwen3.6 tower's
    /// shape (27 blocks of width 1152, 16-pixel patches) projecting to this model's width, for
    /// `run --image` and `bench --image`
    #[arg(long, value_name = "FILE", conflicts_with = "dry_run")]
    pub mmproj: Option<PathBuf>,
    /// general.name (default: synth-qwen35-<preset>)
    #[arg(long)]
    pub name: Option<String>,
    /// Hidden size (n_embd)
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Trunk layers (the MTP block comes on top)
    #[arg(long)]
    pub layers: Option<usize>,
    /// Attention query heads
    #[arg(long)]
    pub heads: Option<usize>,
    /// Attention KV heads
    #[arg(long = "kv-heads")]
    pub kv_heads: Option<usize>,
    /// Attention head dim (q/k/v)
    #[arg(long = "head-dim")]
    pub head_dim: Option<usize>,
    /// Rotated dims per head (default: head-dim / 4, Qwen's partial rotary factor)
    #[arg(long = "rope-dim")]
    pub rope_dim: Option<usize>,
    /// Dense FFN width
    #[arg(long)]
    pub ff: Option<usize>,
    /// Gated-delta-net q/k heads
    #[arg(long = "ssm-k-heads")]
    pub ssm_k_heads: Option<usize>,
    /// Gated-delta-net v heads
    #[arg(long = "ssm-v-heads")]
    pub ssm_v_heads: Option<usize>,
    /// Gated-delta-net head dim (state size)
    #[arg(long = "ssm-head-dim")]
    pub ssm_head_dim: Option<usize>,
    /// Causal conv width
    #[arg(long = "conv-kernel")]
    pub conv_kernel: Option<usize>,
    /// Every N-th layer is full attention
    #[arg(long = "full-attention-interval")]
    pub full_attention_interval: Option<usize>,
    /// Routed experts (MoE)
    #[arg(long)]
    pub experts: Option<usize>,
    /// Experts used per token (MoE)
    #[arg(long = "experts-used")]
    pub experts_used: Option<usize>,
    /// Per-expert FFN width (MoE)
    #[arg(long = "expert-ff")]
    pub expert_ff: Option<usize>,
    /// Shared-expert FFN width (MoE; 0 = no shared expert)
    #[arg(long = "shared-ff")]
    pub shared_ff: Option<usize>,
    /// Vocabulary rows: >= 248077 for the full Qwen vocabulary (padded with unused tokens), fewer
    /// for a prefix of its BPE ranks plus <|endoftext|> <|im_start|> <|im_end|> (at least 259)
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Trained context length written to the file
    #[arg(long)]
    pub ctx: Option<usize>,
    /// No NextN (MTP) block
    #[arg(long = "no-mtp")]
    pub no_mtp: bool,
    /// Separate output.weight (LM head) instead of the tied embedding
    #[arg(long, conflicts_with = "tied")]
    pub untied: bool,
    /// Tied embedding as the LM head (no output.weight)
    #[arg(long)]
    pub tied: bool,
}

fn parse_arch(s: &str) -> Result<Arch> {
    match s {
        "qwen35" => Ok(Arch::Dense),
        "qwen35moe" => Ok(Arch::Moe),
        other => bail!("--arch {other}: expected qwen35 or qwen35moe"),
    }
}

/// The preset (or the arch's default shape) with every given option applied.
pub fn build_spec(a: &Args) -> Result<SynthSpec> {
    let arch = a.arch.as_deref().map(parse_arch).transpose()?;
    let base = match (&a.preset, arch) {
        (Some(p), _) => p.clone(),
        (None, Some(Arch::Moe)) => "35b-a3b-small".into(),
        (None, Some(Arch::Dense)) => "0.8b".into(),
        (None, None) => bail!("give --preset NAME or --arch qwen35|qwen35moe"),
    };
    let Some(mut s) = SynthSpec::preset(&base) else {
        bail!("unknown preset '{base}' (presets: {})", PRESETS.join(", "))
    };
    if let Some(arch) = arch {
        if arch != s.arch {
            bail!(
                "--arch {} does not match preset {base} ({})",
                arch.name(),
                s.arch.name()
            );
        }
    }
    let set = |field: &mut usize, v: Option<usize>| {
        if let Some(v) = v {
            *field = v;
        }
    };
    set(&mut s.n_embd, a.hidden);
    set(&mut s.n_layer, a.layers);
    set(&mut s.n_head, a.heads);
    set(&mut s.n_head_kv, a.kv_heads);
    if let Some(hd) = a.head_dim {
        s.head_dim = hd;
        s.n_rot = (hd / 4).max(2) & !1;
    }
    set(&mut s.n_rot, a.rope_dim);
    set(&mut s.n_ff, a.ff);
    set(&mut s.ssm_k_heads, a.ssm_k_heads);
    set(&mut s.ssm_v_heads, a.ssm_v_heads);
    set(&mut s.ssm_head_dim, a.ssm_head_dim);
    set(&mut s.conv_kernel, a.conv_kernel);
    set(&mut s.full_attention_interval, a.full_attention_interval);
    set(&mut s.n_expert, a.experts);
    set(&mut s.n_expert_used, a.experts_used);
    set(&mut s.n_ff_exp, a.expert_ff);
    set(&mut s.n_ff_shexp, a.shared_ff);
    set(&mut s.n_vocab, a.vocab);
    set(&mut s.n_ctx_train, a.ctx);
    if a.no_mtp {
        s.n_nextn = 0;
    }
    if a.untied {
        s.tied = false;
    }
    if a.tied {
        s.tied = true;
    }
    if let Some(n) = &a.name {
        s.name = n.clone();
    }
    s.validate()?;
    Ok(s)
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn describe(s: &SynthSpec) -> String {
    let mut d = format!(
        "{} '{}': n_embd {}, {} layers{} (full attention every {}), heads {}/{} x {} (rope {}), GDN {}/{} heads x {}, ",
        s.arch.name(),
        s.name,
        s.n_embd,
        s.n_layer,
        if s.n_nextn > 0 { " + 1 MTP" } else { "" },
        s.full_attention_interval,
        s.n_head,
        s.n_head_kv,
        s.head_dim,
        s.n_rot,
        s.ssm_k_heads,
        s.ssm_v_heads,
        s.ssm_head_dim,
    );
    match s.arch {
        Arch::Dense => d += &format!("FFN {}", s.n_ff),
        Arch::Moe => {
            d += &format!(
                "{} experts top-{} x {}, shared {}",
                s.n_expert, s.n_expert_used, s.n_ff_exp, s.n_ff_shexp
            )
        }
    }
    d += &format!(
        ", vocab {}, {} head",
        s.n_vocab,
        if s.tied { "tied" } else { "untied" }
    );
    d
}

fn type_summary(tensors: &[synth::PlannedTensor]) -> String {
    let mut by_type: BTreeMap<GgmlType, (usize, u64)> = BTreeMap::new();
    for t in tensors {
        let e = by_type.entry(t.ty).or_default();
        e.0 += 1;
        e.1 += t.n_bytes();
    }
    by_type
        .iter()
        .map(|(ty, (n, b))| format!("{ty} x{n} ({:.2} GiB)", gib(*b)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The written file is what the loader expects: it passes the validation every load runs
/// (configuration, full tensor inventory, tokenizer).
fn check_inventory(path: &std::path::Path) -> Result<usize> {
    let f = GgufFile::open(path)?;
    let valid = validate(&f)
        .map_err(|e| anyhow::anyhow!("the written file does not pass the model's checks: {e}"))?;
    Ok(valid.n_tensors_checked)
}

pub fn run(args: Args) -> Result<ExitCode> {
    let Some(ftype) = FileType::parse(&args.file_type) else {
        let names: Vec<&str> = FileType::ALL.iter().map(|t| t.name()).collect();
        bail!(
            "--type {}: expected one of {}",
            args.file_type,
            names.join(" ")
        );
    };
    let spec = build_spec(&args)?;
    let tensors = synth::plan(&spec, ftype);
    let estimate = synth::estimated_bytes(&spec, ftype);
    eprintln!("{}", describe(&spec));
    eprintln!(
        "{} tensors, {:.3}e9 parameters, {} ~{:.2} GiB: {}",
        tensors.len(),
        spec.n_params() as f64 / 1e9,
        ftype.name(),
        gib(estimate),
        type_summary(&tensors)
    );
    if args.dry_run {
        for t in &tensors {
            println!(
                "{:<44} {:<8} {:>14} {:?}",
                t.name,
                t.ty.name(),
                t.n_bytes(),
                t.dims
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    let Some(output) = args.output.as_ref() else {
        bail!("-o FILE is required")
    };
    let threads = super::common::threads_or_all(args.threads)?;
    let raw = RawVocab::parse(QWEN35_VOCAB).context("embedded vocabulary")?;
    let vocab = Vocab::qwen(&raw, spec.n_vocab)?;
    let t0 = Instant::now();
    let tty = std::io::stderr().is_terminal();
    let mut last_report = Instant::now();
    let mut progress = |p: &synth::Progress| {
        let last = p.index + 1 == p.total;
        if last || last_report.elapsed().as_secs_f64() >= if tty { 0.5 } else { 10.0 } {
            last_report = Instant::now();
            let line = format!(
                "[{}/{}] {:.2}/{:.2} GiB, {:.0} s, {:.0} MiB/s, {}",
                p.index + 1,
                p.total,
                gib(p.bytes_done),
                gib(p.bytes_total),
                p.elapsed_s,
                p.bytes_done as f64 / (1 << 20) as f64 / p.elapsed_s.max(1e-9),
                p.tensor.name
            );
            if tty {
                eprint!("\r\x1b[2K{line}");
                if last {
                    eprintln!();
                }
            } else {
                eprintln!("{line}");
            }
        }
    };
    let summary = synth::synthesize(
        output,
        &spec,
        ftype,
        &vocab,
        args.seed,
        threads,
        &mut progress,
    )
    .with_context(|| format!("writing {}", output.display()))?;
    let secs = t0.elapsed().as_secs_f64();
    if let Some(path) = &args.mmproj {
        let t = Instant::now();
        let tower = nextn_vision::synth::TowerSpec {
            seed: args.seed,
            ..nextn_vision::synth::TowerSpec::qwen35(spec.n_embd)
        };
        nextn_vision::synth::write_mmproj(&tower, path)
            .with_context(|| format!("--mmproj: writing {}", path.display()))?;
        eprintln!(
            "wrote {}: a vision tower of {} blocks of width {} projecting to {}, {:.1} s",
            path.display(),
            tower.n_layer,
            tower.n_embd,
            tower.projection_dim,
            t.elapsed().as_secs_f64()
        );
    }
    let checked =
        check_inventory(output).with_context(|| format!("checking {}", output.display()))?;
    println!(
        "wrote {}: {} {}, {} tensors ({} checked against the model inventory), {} bytes ({:.2} GiB), {:.3}e9 parameters, seed {}, {:.1} s with {} threads",
        output.display(),
        spec.arch.name(),
        ftype.name(),
        summary.tensors.len(),
        checked,
        summary.file_bytes,
        gib(summary.file_bytes),
        summary.n_params as f64 / 1e9,
        args.seed,
        secs,
        threads
    );
    Ok(ExitCode::SUCCESS)
}
