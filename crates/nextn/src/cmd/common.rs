//! What every model-running subcommand shares: llama.cpp-style model/context/thread flags, finding the
//! bundled model, loading once, and sizing the context.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use nextn_engine::chat::ChatTemplate;
use nextn_engine::tokenizer::Tokenizer;
use nextn_gguf::GgufFile;
use nextn_model::config::LayerKind;
use nextn_model::{KvType, Model, SequenceState};
use nextn_quant::kernels::ThreadPool;

/// Relative path of the model shipped in the repository.
pub const BUNDLED_MODEL: &str = "models/tiny-qwen35-mtp-Q8_0.gguf";

#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// GGUF model (first shard of a split model); defaults to the bundled tiny model
    #[arg(short = 'm', long = "model", value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// Threads for matrix products (default: all cores)
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    /// Context length (default: the model's trained length, capped to what fits in memory)
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
    /// KV cache type for K: f16 or f32
    #[arg(long = "cache-type-k", visible_alias = "ctk", default_value = "f16")]
    pub cache_type_k: String,
    /// KV cache type for V: f16 or f32
    #[arg(long = "cache-type-v", visible_alias = "ctv", default_value = "f16")]
    pub cache_type_v: String,
    /// Print load details to stderr
    #[arg(long)]
    pub verbose: bool,
}

/// Accept llama.cpp's single-dash spellings `-ctk`, `-ctv`, `-np`, `-sys` by rewriting them before clap sees them.
pub fn normalize_args(args: impl Iterator<Item = String>) -> Vec<String> {
    args.map(|a| match a.as_str() {
        "-ctk" => "--cache-type-k".to_string(),
        "-ctv" => "--cache-type-v".to_string(),
        "-np" => "--parallel".to_string(),
        "-sys" => "--system-prompt".to_string(),
        "-cnv" => "--chat".to_string(),
        _ => a,
    })
    .collect()
}

pub fn resolve_model_path(arg: Option<&PathBuf>) -> Result<PathBuf> {
    if let Some(p) = arg {
        return Ok(p.clone());
    }
    if let Ok(p) = std::env::var("NEXTN_MODEL") {
        return Ok(PathBuf::from(p));
    }
    let candidates = [
        PathBuf::from(BUNDLED_MODEL),
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(BUNDLED_MODEL),
    ];
    for c in &candidates {
        if c.is_file() {
            return Ok(c.clone());
        }
    }
    bail!("no model given (-m FILE) and the bundled model {BUNDLED_MODEL} was not found")
}

pub struct Loaded {
    pub path: PathBuf,
    /// Bytes of the model file(s), all shards.
    pub file_bytes: u64,
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub pool: ThreadPool,
    pub n_ctx: usize,
    pub k_type: KvType,
    pub v_type: KvType,
}

impl Loaded {
    pub fn new_sequence(&self) -> SequenceState {
        self.model
            .new_sequence(self.n_ctx, self.k_type, self.v_type)
    }
}

fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

pub fn load(args: &ModelArgs) -> Result<Loaded> {
    let path = resolve_model_path(args.model.as_ref())?;
    let k_type = KvType::parse(&args.cache_type_k).with_context(|| {
        format!(
            "--cache-type-k {}: supported types are f16 and f32",
            args.cache_type_k
        )
    })?;
    let v_type = KvType::parse(&args.cache_type_v).with_context(|| {
        format!(
            "--cache-type-v {}: supported types are f16 and f32",
            args.cache_type_v
        )
    })?;
    let file =
        Arc::new(GgufFile::open(&path).with_context(|| format!("cannot read {}", path.display()))?);
    let t0 = std::time::Instant::now();
    let tty = std::io::stderr().is_terminal();
    let mut progress = |done: usize, total: usize| {
        if tty {
            let width = 30;
            let filled = width * done / total.max(1);
            eprint!(
                "\rloading {} [{}{}] {done}/{total} layers",
                path.display(),
                "#".repeat(filled),
                " ".repeat(width - filled)
            );
            if done == total {
                eprint!("\r\x1b[2K");
            }
        }
    };
    let model = Model::load_with_progress(file.clone(), &mut progress)
        .with_context(|| format!("cannot load {}", path.display()))?;
    let tokenizer =
        Tokenizer::from_gguf(&file).with_context(|| format!("tokenizer of {}", path.display()))?;
    let template = match file.get_str("tokenizer.chat_template")? {
        Some(src) => ChatTemplate::new(src).context("the file's chat template does not parse")?,
        None => ChatTemplate::chatml(),
    };
    let threads = match args.threads {
        Some(0) => bail!("-t 0: at least one thread is needed"),
        Some(t) => t,
        None => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    };
    let pool = ThreadPool::new(threads);

    let cfg = &model.config;
    let kv_per_token: u64 = cfg
        .layer_kinds
        .iter()
        .enumerate()
        .filter(|(_, k)| **k == LayerKind::FullAttention)
        .map(|(il, _)| {
            (cfg.n_head_kv[il] * cfg.head_dim) as u64 * (k_type.bytes() + v_type.bytes()) as u64
        })
        .sum::<u64>()
        .max(1);
    let (n_ctx, ctx_note) = match args.ctx_size {
        Some(0) | None => {
            let budget = available_memory().unwrap_or(8 << 30) / 2;
            let fit = (budget / kv_per_token) as usize;
            let n = cfg.n_ctx_train.min(fit).max(1);
            (
                n,
                if n < cfg.n_ctx_train {
                    " (capped to half the available memory)"
                } else {
                    " (trained length)"
                },
            )
        }
        Some(n) => (n, ""),
    };
    // One line on what was loaded and what the context will cost.
    eprintln!(
        "loaded {} in {:.0} ms: {} ({} layers, {} full attention, n_embd {}, vocab {}){}, context {n_ctx}{ctx_note}, KV {:?}/{:?} {:.1} MiB at full context, {} threads",
        path.display(),
        t0.elapsed().as_secs_f64() * 1e3,
        cfg.arch.name(),
        cfg.n_layer,
        cfg.n_full_attention(),
        cfg.n_embd,
        model.n_vocab,
        if cfg.n_nextn > 0 { " + NextN head" } else { "" },
        k_type,
        v_type,
        (kv_per_token * n_ctx as u64) as f64 / (1 << 20) as f64,
        threads,
    );
    Ok(Loaded {
        path,
        file_bytes: file.file_size(),
        model,
        tokenizer,
        template,
        pool,
        n_ctx,
        k_type,
        v_type,
    })
}
