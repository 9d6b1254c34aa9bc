//! What the model-running subcommands share: llama.cpp-style model/context/thread flags, finding
//! the bundled model, loading once and sizing the context; the sampling and speculative-decoding
//! argument groups; and choosing the trimmed draft vocabulary (shipped ranking, user ranking, or
//! BPE merge order) for `run`, `serve`, `logits --mtp` and `bench`.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use nextn_engine::chat::ChatTemplate;
use nextn_engine::grammar::{Constraint, GrammarCompiler, GrammarSource, ReasoningBudget};
use nextn_engine::sampler::SamplerConfig;
use nextn_engine::scheduler::EngineRef;
use nextn_engine::speculative::{DraftSampling, SpecConfig};
use nextn_engine::tokenizer::Tokenizer;
use nextn_gguf::GgufFile;
use nextn_model::config::LayerKind;
use nextn_model::draft_vocab::TokenRanking;
use nextn_model::placement::SequenceShape;
use nextn_model::{Blocks, KvType, Model, NextnHead, Placement, Qwen35Config, SequenceState};
use nextn_quant::kernels::ThreadPool;
use nextn_server::reasoning::{self, prompt_opens_thinking};
use nextn_vision::VisionTower;

/// Relative path of the model shipped in the repository.
pub const BUNDLED_MODEL: &str = "models/tiny-qwen35-mtp-Q8_0.gguf";

#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// GGUF model (first shard of a split model); defaults to the bundled tiny model
    #[arg(
        short = 'm',
        long = "model",
        value_name = "FILE",
        env = "LLAMA_ARG_MODEL"
    )]
    pub model: Option<PathBuf>,
    /// Threads for matrix products (default: all cores)
    #[arg(short = 't', long = "threads", env = "LLAMA_ARG_THREADS")]
    pub threads: Option<usize>,
    /// Context length (default: the model's trained length, capped to what fits in memory)
    #[arg(short = 'c', long = "ctx-size", env = "LLAMA_ARG_CTX_SIZE")]
    pub ctx_size: Option<usize>,
    /// KV cache type for K: f32, f16, q8_0 or q4_0 (llama.cpp's block layouts)
    #[arg(
        long = "cache-type-k",
        visible_alias = "ctk",
        default_value = "f16",
        env = "LLAMA_ARG_CACHE_TYPE_K"
    )]
    pub cache_type_k: String,
    /// KV cache type for V: f32, f16, q8_0 or q4_0 (llama.cpp's block layouts)
    #[arg(
        long = "cache-type-v",
        visible_alias = "ctv",
        default_value = "f16",
        env = "LLAMA_ARG_CACHE_TYPE_V"
    )]
    pub cache_type_v: String,
    /// Print load details to stderr
    #[arg(long)]
    pub verbose: bool,
    /// Model from the Hugging Face hub: ORG/NAME[:QUANT] (-hf; QUANT defaults to Q4_K_M), kept in
    /// the hub's standard cache
    #[arg(
        long = "hf-repo",
        value_name = "ORG/NAME[:QUANT]",
        env = "LLAMA_ARG_HF_REPO",
        conflicts_with = "model"
    )]
    pub hf_repo: Option<String>,
    /// The file of the -hf repository to use instead of choosing by QUANT (-hff)
    #[arg(
        long = "hf-file",
        value_name = "FILE",
        env = "LLAMA_ARG_HF_FILE",
        requires = "hf_repo"
    )]
    pub hf_file: Option<String>,
    /// Read the model into memory instead of mapping it
    #[arg(long = "no-mmap", env = "LLAMA_ARG_NO_MMAP", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::SetTrue)]
    pub no_mmap: bool,
    /// Lock the model's pages in memory, so that the OS never pages them out
    #[arg(long = "mlock", env = "LLAMA_ARG_MLOCK", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::SetTrue)]
    pub mlock: bool,
    /// Chat template to use instead of the model's: jinja source, or the built-in name `chatml`
    #[arg(
        long = "chat-template",
        env = "LLAMA_ARG_CHAT_TEMPLATE",
        value_name = "TEMPLATE",
        conflicts_with = "chat_template_file"
    )]
    pub chat_template: Option<String>,
    /// Read the chat template from FILE
    #[arg(
        long = "chat-template-file",
        env = "LLAMA_ARG_CHAT_TEMPLATE_FILE",
        value_name = "FILE"
    )]
    pub chat_template_file: Option<PathBuf>,
    /// Render chat prompts with the jinja template (always the case; accepted as llama.cpp takes it)
    #[arg(long = "jinja", env = "LLAMA_ARG_JINJA", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::SetTrue)]
    pub jinja: bool,
    #[command(flatten)]
    pub cpu_only: CpuOnlyArgs,
}

/// llama.cpp's flags about GPUs and compute buffers. `-ngl` and `-dev` choose the device; the
/// others change nothing here and are accepted so that llama.cpp command lines run, each one given
/// named on stderr.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct CpuOnlyArgs {
    /// Layers to offload to the GPU (-ngl), counted as llama.cpp counts them: 1 is the output
    /// layer, 2 adds the NextN block, each more one trunk layer from the last; 0 keeps the model
    /// on the CPU, the block count + 1 or more (99, all) puts everything there; absent, a
    /// hardware GPU gets everything that fits (--fit)
    #[arg(
        long = "n-gpu-layers",
        visible_alias = "gpu-layers",
        env = "LLAMA_ARG_N_GPU_LAYERS",
        value_name = "N",
        allow_hyphen_values = true
    )]
    pub n_gpu_layers: Option<String>,
    /// Run every layer's routed experts (MoE) on the CPU from host memory, the rest of each layer
    /// on the GPU; the NextN head's too, as llama.cpp counts it a layer (-cmoe)
    #[arg(long = "cpu-moe", env = "LLAMA_ARG_CPU_MOE", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::SetTrue)]
    pub cpu_moe: bool,
    /// Run the routed experts of the first N layers on the CPU, the NextN head the layer after
    /// the trunk's (-ncmoe)
    #[arg(long = "n-cpu-moe", env = "LLAMA_ARG_N_CPU_MOE", value_name = "N")]
    pub n_cpu_moe: Option<usize>,
    /// Put the tensors a regex matches on a side, llama.cpp's form: REGEX=CPU or REGEX=<device>
    /// (as --list-devices names it), several comma-separated or repeated, the first rule that
    /// matches a tensor deciding (-ot). Per tensor, routed experts (`ffn_*_exps`) move; whole
    /// layers move with -ngl
    #[arg(long = "override-tensor", value_name = "REGEX=SIDE", action = clap::ArgAction::Append)]
    pub override_tensor: Vec<String>,
    /// Fit the model to the device's memory when -ngl is not given (on, the default): the parts
    /// that do not fit run on the CPU (a MoE model's routed experts from the first layer on,
    /// then the trunk's first layers, then the NextN head); off: a model too large for the
    /// device is refused
    #[arg(long = "fit", env = "LLAMA_ARG_FIT", value_name = "on|off")]
    pub fit: Option<String>,
    /// Flash attention on|off|auto (-fa; no effect: attention runs in one CPU kernel either way)
    #[arg(long = "flash-attn", env = "LLAMA_ARG_FLASH_ATTN", value_name = "on|off|auto", num_args = 0..=1, default_missing_value = "on", value_parser = ["on", "off", "auto", "1", "0", "true", "false"])]
    pub flash_attn: Option<String>,
    /// Physical batch size (-ub; no effect: prompt rows are processed in -b chunks)
    #[arg(long = "ubatch-size", env = "LLAMA_ARG_UBATCH", value_name = "N")]
    pub ubatch_size: Option<usize>,
    /// Threads for prompt processing (-tb; no effect: prompts use the -t threads)
    #[arg(
        long = "threads-batch",
        env = "LLAMA_ARG_THREADS_BATCH",
        value_name = "N",
        allow_hyphen_values = true
    )]
    pub threads_batch: Option<i64>,
    /// The GPU to run on (-dev NAME as --list-devices names it, e.g. Vulkan0; `none` for the
    /// CPU). Without it a hardware GPU is used when there is one; a software one (lavapipe) only
    /// when named
    #[arg(long = "device", env = "LLAMA_ARG_DEVICE", value_name = "NAME")]
    pub device: Option<String>,
    /// How to split the model over GPUs (-sm; no effect)
    #[arg(
        long = "split-mode",
        env = "LLAMA_ARG_SPLIT_MODE",
        value_name = "none|layer|row"
    )]
    pub split_mode: Option<String>,
    /// Main GPU (-mg; no effect)
    #[arg(long = "main-gpu", env = "LLAMA_ARG_MAIN_GPU", value_name = "N")]
    pub main_gpu: Option<String>,
    /// Share of the model per GPU (-ts; no effect)
    #[arg(
        long = "tensor-split",
        env = "LLAMA_ARG_TENSOR_SPLIT",
        value_name = "LIST"
    )]
    pub tensor_split: Option<String>,
    /// GPU layers of the draft model (-ngld; no effect)
    #[arg(
        long = "n-gpu-layers-draft",
        visible_alias = "gpu-layers-draft",
        env = "LLAMA_ARG_N_GPU_LAYERS_DRAFT",
        value_name = "N",
        allow_hyphen_values = true
    )]
    pub n_gpu_layers_draft: Option<String>,
}

impl CpuOnlyArgs {
    /// One stderr line per flag given: it was accepted and changes nothing here.
    pub fn report(&self) {
        let given = [
            (
                "-ngld",
                self.n_gpu_layers_draft.as_deref(),
                "the NextN head runs where -ngl puts its block",
            ),
            (
                "-sm",
                self.split_mode.as_deref(),
                "the model runs on one device",
            ),
            ("-mg", self.main_gpu.as_deref(), "-dev names the one device"),
            (
                "-ts",
                self.tensor_split.as_deref(),
                "the model runs on one device",
            ),
            (
                "-fa",
                self.flash_attn.as_deref(),
                "attention runs in one CPU kernel either way",
            ),
        ];
        for (flag, value, why) in given {
            if let Some(v) = value {
                eprintln!("{flag} {v}: no effect ({why})");
            }
        }
        if let Some(n) = self.ubatch_size {
            eprintln!("-ub {n}: no effect (prompt rows are processed in -b chunks)");
        }
        if let Some(n) = self.threads_batch {
            eprintln!("-tb {n}: no effect (prompt processing uses the -t threads)");
        }
    }
}

/// llama.cpp's multi-letter single-dash flags and their long spellings (clap reads `-ngl` as `-n gl`
/// and `-hf` as `-h -f`, so they are rewritten before it sees them).
pub const LLAMA_SHORT_FLAGS: &[(&str, &str)] = &[
    ("-ctk", "--cache-type-k"),
    ("-ctv", "--cache-type-v"),
    ("-np", "--parallel"),
    ("-sys", "--system-prompt"),
    ("-jf", "--json-schema-file"),
    ("-cnv", "--conversation"),
    ("-no-cnv", "--no-conversation"),
    ("-hf", "--hf-repo"),
    ("-hfr", "--hf-repo"),
    ("-hff", "--hf-file"),
    ("-ngl", "--n-gpu-layers"),
    ("-ngld", "--n-gpu-layers-draft"),
    ("-cmoe", "--cpu-moe"),
    ("-ncmoe", "--n-cpu-moe"),
    ("-ot", "--override-tensor"),
    ("-fa", "--flash-attn"),
    ("-ub", "--ubatch-size"),
    ("-tb", "--threads-batch"),
    ("-cb", "--cont-batching"),
    ("-nocb", "--no-cont-batching"),
    ("-kvu", "--kv-unified"),
    ("-no-kvu", "--no-kv-unified"),
    ("-dev", "--device"),
    ("-sm", "--split-mode"),
    ("-mg", "--main-gpu"),
    ("-ts", "--tensor-split"),
    ("-cram", "--cache-ram"),
    ("-md", "--spec-draft-model"),
    ("-to", "--timeout"),
];

/// Accept llama.cpp's single-dash spellings by rewriting them before clap sees them. Only whole
/// arguments are rewritten, so a value such as a prompt `-p -fa` is left alone unless it stands
/// where a flag does.
pub fn normalize_args(args: impl Iterator<Item = String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for a in args {
        // The value of a flag that takes one is never a flag to rewrite (e.g. `-p -np`).
        let takes_value = out.last().is_some_and(|prev| {
            matches!(
                prev.as_str(),
                "-p" | "--prompt" | "-r" | "--reverse-prompt" | "--stop"
            )
        });
        let long = LLAMA_SHORT_FLAGS
            .iter()
            .find(|(short, _)| *short == a)
            .filter(|_| !takes_value)
            .map(|(_, long)| long.to_string());
        out.push(long.unwrap_or(a));
    }
    out
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
    pub fn new_sequence(&self) -> Result<SequenceState> {
        Ok(self
            .model
            .new_sequence(self.n_ctx, self.k_type, self.v_type)?)
    }

    /// What the generation loop runs on: this model, `head` for drafting (or none).
    pub fn engine<'a>(&'a self, head: Option<&'a NextnHead>) -> EngineRef<'a> {
        EngineRef {
            vision: None,
            model: &self.model,
            head,
            tokenizer: &self.tokenizer,
            pool: &self.pool,
        }
    }
}

/// `MemAvailable` of /proc/meminfo, in bytes.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The chat template: `--chat-template-file`, `--chat-template` (source or `chatml`), the file's, or
/// ChatML when the file has none.
fn chat_template(args: &ModelArgs, file: &GgufFile) -> Result<ChatTemplate> {
    if let Some(path) = &args.chat_template_file {
        let src = std::fs::read_to_string(path)
            .with_context(|| format!("--chat-template-file {}: cannot read it", path.display()))?;
        return ChatTemplate::new(&src).with_context(|| {
            format!(
                "--chat-template-file {}: the template does not parse",
                path.display()
            )
        });
    }
    match args.chat_template.as_deref() {
        Some("chatml") => return Ok(ChatTemplate::chatml()),
        Some(src) if src.contains("{%") || src.contains("{{") => {
            return ChatTemplate::new(src).context("--chat-template: the template does not parse")
        }
        Some(other) => bail!(
            "--chat-template {other}: not a template (no {{% or {{{{) and not a built-in name; built-in: chatml (Qwen's own template is in the model file)"
        ),
        None => {}
    }
    Ok(match file.get_str("tokenizer.chat_template")? {
        Some(src) => ChatTemplate::new(src).context("the file's chat template does not parse")?,
        None => ChatTemplate::chatml(),
    })
}

/// The model file: `-m`, `-hf` (fetched into the hub cache when needed), `NEXTN_MODEL`, or the
/// bundled model.
/// The vision tower: llama-mtmd-cli's and llama-server's flags.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct VisionArgs {
    /// Vision projector (mmproj GGUF) for image input; with -hf, the repository's mmproj file is
    /// used unless --no-mmproj
    #[arg(long = "mmproj", value_name = "FILE", env = "LLAMA_ARG_MMPROJ")]
    pub mmproj: Option<PathBuf>,
    /// Do not load a vision projector (not even the one beside an -hf model)
    #[arg(long = "no-mmproj", env = "LLAMA_ARG_NO_MMPROJ", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::SetTrue, conflicts_with = "mmproj")]
    pub no_mmproj: bool,
    /// Fewest tokens an image is resized to (default: the mmproj's)
    #[arg(long = "image-min-tokens", value_name = "N")]
    pub image_min_tokens: Option<u32>,
    /// Most tokens an image is resized to (default: the mmproj's)
    #[arg(long = "image-max-tokens", value_name = "N")]
    pub image_max_tokens: Option<u32>,
    /// Keep the vision tower on the CPU when the model runs on a device (by default it goes to
    /// the model's device when it fits beside the model and a sequence's caches)
    #[arg(long = "no-mmproj-offload", env = "LLAMA_ARG_NO_MMPROJ_OFFLOAD", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::SetTrue)]
    pub no_mmproj_offload: bool,
}

impl VisionArgs {
    /// The mmproj to load, if any: --mmproj, else the one beside an -hf model.
    pub fn path(&self, model: &ModelArgs) -> Result<Option<PathBuf>> {
        if self.no_mmproj {
            return Ok(None);
        }
        match (&self.mmproj, &model.hf_repo) {
            (Some(p), _) => Ok(Some(p.clone())),
            (None, Some(repo)) => super::hf::resolve_mmproj(repo),
            (None, None) => Ok(None),
        }
    }

    /// Loads the tower at `path` for `model`, checked against its width, on the CPU
    /// ([`place`](Self::place) moves it).
    pub fn load(&self, path: &Path, model: &Model) -> Result<VisionTower> {
        let mut tower =
            VisionTower::load(path).with_context(|| format!("--mmproj {}", path.display()))?;
        tower
            .check_text_model(model.config.n_embd)
            .with_context(|| format!("--mmproj {}", path.display()))?;
        tower
            .set_token_bounds(self.image_min_tokens, self.image_max_tokens)
            .context("--image-min-tokens / --image-max-tokens")?;
        Ok(tower)
    }

    /// One stderr line when --no-mmproj-offload was given and changes nothing (`why`).
    pub fn offload_flag_unused(&self, why: &str) {
        if self.no_mmproj_offload {
            eprintln!("--no-mmproj-offload: no effect ({why})");
        }
    }

    /// One stderr line per vision flag given when no tower is loaded (`why`).
    pub fn flags_unused(&self, why: &str) {
        self.offload_flag_unused(why);
        for (flag, given) in [
            ("--image-min-tokens", self.image_min_tokens.is_some()),
            ("--image-max-tokens", self.image_max_tokens.is_some()),
        ] {
            if given {
                eprintln!("{flag}: no effect ({why})");
            }
        }
    }

    /// Puts the tower on the model's device (after the model and its head took their share), unless
    /// `--no-mmproj-offload`, the model runs on the CPU, or the device cannot hold the tower
    /// beside the caches of a sequence at the context: then it stays on the CPU. Says which.
    pub fn place(&self, tower: &mut VisionTower, loaded: &Loaded) {
        let Some(device) = &loaded.model.device else {
            self.offload_flag_unused("the model runs on the CPU, and the tower with it");
            return;
        };
        let gpu = device.gpu();
        let name = &gpu.info.name;
        if self.no_mmproj_offload {
            eprintln!("vision tower: on the CPU (--no-mmproj-offload)");
            return;
        }
        let placed = tower
            .offload(gpu.clone())
            .map_err(anyhow::Error::from)
            .and_then(|()| {
                loaded
                    .model
                    .check_sequence(loaded.n_ctx, loaded.k_type, loaded.v_type)
                    .with_context(|| {
                        format!(
                            "no room left for a sequence's caches at context {}",
                            loaded.n_ctx
                        )
                    })
            });
        match placed {
            Ok(()) => eprintln!(
                "vision tower: on {name}, {:.1} MiB (its weights, and activations for images of up \
                 to {} tokens)",
                tower.device_bytes().unwrap_or(0) as f64 / (1 << 20) as f64,
                tower.config().max_tokens
            ),
            Err(e) => {
                tower.release_device();
                eprintln!("vision tower: on the CPU, as it does not fit on {name}: {e:#}");
            }
        }
    }
}

pub fn model_path(args: &ModelArgs) -> Result<PathBuf> {
    match &args.hf_repo {
        Some(repo) => super::hf::resolve(repo, args.hf_file.as_deref()),
        None => resolve_model_path(args.model.as_ref()),
    }
}

/// Load the model file. `drafting` says whether a NextN head will draft for it: the head's own KV
/// cache is then part of what a context costs (the load line and the automatic context size).
pub fn load(args: &ModelArgs, drafting: bool) -> Result<Loaded> {
    let path = model_path(args)?;
    let k_type = KvType::parse(&args.cache_type_k).with_context(|| {
        format!(
            "--cache-type-k {}: supported types are {}",
            args.cache_type_k,
            KvType::NAMES
        )
    })?;
    let v_type = KvType::parse(&args.cache_type_v).with_context(|| {
        format!(
            "--cache-type-v {}: supported types are {}",
            args.cache_type_v,
            KvType::NAMES
        )
    })?;
    args.cpu_only.report();
    let mut file =
        GgufFile::open(&path).with_context(|| format!("cannot read {}", path.display()))?;
    if args.no_mmap {
        file.read_into_memory()
            .with_context(|| format!("--no-mmap: cannot read {} into memory", path.display()))?;
    }
    if args.mlock {
        file.lock_in_memory().with_context(|| {
            format!(
                "--mlock: cannot lock {} in memory (the limit is `ulimit -l`)",
                path.display()
            )
        })?;
    }
    let file = Arc::new(file);
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
    // The configuration first: the context and the device's share of the model are decided
    // before the weights are bound (the layers on the device get no host copy for the CPU
    // kernels). A file whose metadata does not parse is refused here as the load refuses it.
    let cfg0 = nextn_model::validate::validate(&file)
        .map(|v| v.config)
        .map_err(nextn_model::ModelError::from)
        .with_context(|| format!("cannot load {}", path.display()))?;
    let cfg = &cfg0;
    for (flag, ty) in [("--cache-type-k", k_type), ("--cache-type-v", v_type)] {
        if !ty.fits_head_dim(cfg.head_dim) {
            bail!(
                "{flag} {}: the type stores each head in blocks of {} values, and this model's attention head dimension {} is not a multiple of that",
                ty.name(),
                ty.block_len(),
                cfg.head_dim
            );
        }
    }
    let row_bytes = |il: usize| {
        let width = cfg.n_head_kv.get(il).copied().unwrap_or(0) * cfg.head_dim;
        (k_type.row_bytes(width) + v_type.row_bytes(width)) as u64
    };
    // The NextN head keeps a cache of its own, one attention layer more, whenever it drafts; a
    // sidecar head (-md) has the trunk's attention shape, so the last attention layer's widths.
    let head_kv_per_token = if !drafting {
        0
    } else if cfg.n_head_kv.get(cfg.n_layer).is_some_and(|&h| h > 0) {
        row_bytes(cfg.n_layer)
    } else {
        cfg.layer_kinds
            .iter()
            .rposition(|k| *k == LayerKind::FullAttention)
            .map_or(0, row_bytes)
    };
    let kv_per_token: u64 = (cfg
        .layer_kinds
        .iter()
        .enumerate()
        .filter(|(_, k)| **k == LayerKind::FullAttention)
        .map(|(il, _)| row_bytes(il))
        .sum::<u64>()
        + head_kv_per_token)
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
    let blocks = Blocks::of(cfg);
    let seq = SequenceShape {
        n_ctx,
        k_type,
        v_type,
        drafting,
    };
    let placed = place_model(&args.cpu_only, &file, cfg, seq)?;
    let mut model = match &placed {
        Some(p) if p.placement != Placement::all_on_device() => {
            Model::load_for_placement(file.clone(), p.placement.clone(), &mut progress)
        }
        Some(_) => Model::load_for_device(file.clone(), &mut progress),
        None => Model::load_with_progress(file.clone(), &mut progress),
    }
    .with_context(|| format!("cannot load {}", path.display()))?;
    let mut placement_line = String::new();
    if let Some(Placed {
        gpu,
        mut placement,
        fitted,
    }) = placed
    {
        let name = gpu.info.name.clone();
        // With the placement fitted from estimates, a part the device refuses after all (its
        // kernels' layout, buffers the estimate does not see) makes the fitting choose again with
        // less room than this placement took: the next layer's routed experts, or the next layer,
        // go to the CPU.
        loop {
            let tried = model
                .offload_placed(gpu.clone(), placement.clone())
                .with_context(|| format!("cannot put {} on {name}", path.display()))
                .and_then(|()| {
                    // The caches of one sequence at full context, allocated once so that a
                    // context the device cannot hold is refused now, not at the first request.
                    model
                        .check_sequence(n_ctx, k_type, v_type)
                        .with_context(|| format!("context {n_ctx} on {name}"))
                });
            match tried {
                Ok(()) => break,
                Err(e) if fitted.is_some() && is_device_memory(&e) => {
                    let Some(next) = fitted.as_ref().and_then(|f| {
                        let took = f.costs.on_device(&placement, blocks);
                        Placement::fit(&f.costs, blocks, took.saturating_sub(1), &f.flagged)
                    }) else {
                        return Err(e);
                    };
                    model.device = None;
                    placement = next;
                    eprintln!("fit: {e:#}; trying {}", placement_flags(&placement, blocks));
                }
                Err(e) => return Err(e),
            }
        }
        placement_line = format!(
            ", {} ({}{})",
            placement.describe(blocks, &name),
            placement_flags(&placement, blocks),
            if fitted.is_some() {
                ", fitted to the device"
            } else {
                ""
            }
        );
    }
    let tokenizer =
        Tokenizer::from_gguf(&file).with_context(|| format!("tokenizer of {}", path.display()))?;
    let template = chat_template(args, &file)?;
    let threads = threads_or_all(args.threads)?;
    let pool = ThreadPool::new(threads);

    let mut device_line = String::new();
    if let Some(d) = &model.device {
        let info = d.gpu().info.clone();
        let dm = d.weight_bytes();
        device_line = format!(
            ", on {}: {:.1} MiB of weights{placement_line}{}",
            info,
            dm as f64 / (1 << 20) as f64,
            if info.software {
                " (a software device: its timings are not a GPU's)"
            } else {
                ""
            }
        );
    }
    // One line on what was loaded and what the context will cost.
    eprintln!(
        "loaded {} in {:.0} ms: {} ({} layers, {} full attention, n_embd {}, vocab {}){}, context {n_ctx}{ctx_note}, KV {}/{} {:.1} MiB at full context{}, {} threads{device_line}",
        path.display(),
        t0.elapsed().as_secs_f64() * 1e3,
        cfg.arch.name(),
        cfg.n_layer,
        cfg.n_full_attention(),
        cfg.n_embd,
        model.n_vocab,
        if cfg.n_nextn > 0 { " + NextN head" } else { "" },
        k_type.name(),
        v_type.name(),
        (kv_per_token * n_ctx as u64) as f64 / (1 << 20) as f64,
        if head_kv_per_token > 0 {
            format!(
                " (the NextN head's {:.1} MiB included)",
                (head_kv_per_token * n_ctx as u64) as f64 / (1 << 20) as f64
            )
        } else {
            String::new()
        },
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

/// `nextn --list-devices`: every adapter, one per line, as llama.cpp prints them.
pub fn list_devices() -> std::process::ExitCode {
    let devices = nextn_gpu::list_devices();
    println!("Available devices:");
    for d in &devices {
        println!("  {d}");
    }
    if devices.is_empty() {
        println!("  (none: no Vulkan, Metal or DX12 adapter; on Linux without a GPU, Mesa's lavapipe (Debian: mesa-vulkan-drivers) provides one)");
    }
    std::process::ExitCode::SUCCESS
}

/// A model's place on a device: the device, which parts it holds, and, when that was fitted to
/// its memory rather than asked for, what the fitting went by.
struct Placed {
    gpu: Arc<nextn_gpu::Gpu>,
    placement: Placement,
    fitted: Option<Fitted>,
}

/// What a fitted placement was chosen by: the estimated costs and the layers whose experts the
/// flags put on the CPU.
struct Fitted {
    costs: nextn_model::placement::DeviceCosts,
    flagged: Vec<usize>,
}

/// `-t N`: N threads (0 refused), or as many as the machine has when not given.
pub fn threads_or_all(threads: Option<usize>) -> Result<usize> {
    match threads {
        Some(0) => bail!("-t 0: at least one thread is needed"),
        Some(t) => Ok(t),
        None => Ok(std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)),
    }
}

/// Whether `e` says the device had no room for something.
fn is_device_memory(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<nextn_model::ModelError>(),
            Some(nextn_model::ModelError::DeviceMemory(_))
        )
    })
}

/// Where the model runs: `None` for the CPU alone, else the device and the part of the model it
/// holds. `-ngl N` splits as llama.cpp does (the output, then the NextN block, then the trunk's
/// layers from the last); without it the whole model goes to the device when it fits, and
/// otherwise as many parts as fit, in that order (llama.cpp's `--fit`, on by default).
fn place_model(
    args: &CpuOnlyArgs,
    file: &GgufFile,
    cfg: &Qwen35Config,
    seq: SequenceShape,
) -> Result<Option<Placed>> {
    let blocks = Blocks::of(cfg);
    let device = choose_device(args)?;
    let experts = host_expert_layers(
        args,
        file,
        cfg,
        device.as_ref().map(|(g, _)| g.info.name.as_str()),
    )?;
    let Some((gpu, ngl)) = device else {
        return Ok(None);
    };
    if let Some(n) = ngl {
        return Ok(Some(Placed {
            gpu,
            placement: Placement::from_gpu_layers(n, blocks).with_host_experts(experts),
            fitted: None,
        }));
    }
    // Experts placed by flag stay there; the rest goes to the device whole when it fits.
    let all = Placement::all_on_device().with_host_experts(experts.iter().copied());
    let fit = args.fit.as_deref().is_none_or(|f| f == "on");
    let (Some(limit), used) = gpu.memory_budget() else {
        return Ok(Some(Placed {
            gpu,
            placement: all,
            fitted: None,
        }));
    };
    let costs = nextn_model::placement::DeviceCosts::estimate(file, cfg, seq);
    // What other processes hold is not ours to take (where the driver says what is free), and
    // passes take buffers of their own beside the weights and caches: a thirty-second of the
    // device is left to them.
    let room = limit
        .saturating_sub(used)
        .min(gpu.info.free_bytes.unwrap_or(u64::MAX))
        .saturating_sub(limit / 32);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let whole = costs.on_device(&all, blocks);
    if !fit || whole <= room {
        return Ok(Some(Placed {
            gpu,
            placement: all,
            fitted: None,
        }));
    }
    let name = gpu.info.name.clone();
    match Placement::fit(&costs, blocks, room, &experts) {
        Some(placement) => {
            eprintln!(
                "fit: the model and one sequence's caches at context {} take about {:.0} MiB, {name} has {:.0} MiB: {} ({}; --fit off refuses instead, -ngl N and --n-cpu-moe N choose)",
                seq.n_ctx,
                mib(whole),
                mib(room),
                placement.describe(blocks, &name),
                placement_flags(&placement, blocks)
            );
            Ok(Some(Placed {
                gpu,
                placement,
                fitted: Some(Fitted {
                    costs,
                    flagged: experts,
                }),
            }))
        }
        None => {
            eprintln!(
                "fit: {name} has {:.0} MiB, under the {:.0} MiB of the output layer alone: running on the CPU",
                mib(room),
                mib(costs.output)
            );
            Ok(None)
        }
    }
}

/// The flags that ask for `placement`: `-ngl N`, with `--n-cpu-moe N` (or the layers whose
/// experts run on the CPU) when some do.
fn placement_flags(placement: &Placement, blocks: Blocks) -> String {
    let ngl = format!("-ngl {}", placement.gpu_layers(blocks));
    // The file's blocks on the device, the NextN block last, as llama.cpp numbers them.
    let on_device = blocks.trunk + usize::from(blocks.head && placement.head_on_device);
    let experts: Vec<usize> = (0..on_device)
        .filter(|&il| placement.experts_on_host(il))
        .collect();
    // The device's layers start at `first`: experts on the CPU in each of `first..=last` are
    // what `--n-cpu-moe last + 1` asks for.
    let first = placement.first_device_layer;
    match experts.last() {
        None => ngl,
        Some(&last) if experts.len() == last + 1 - first => {
            format!("{ngl} --n-cpu-moe {}", last + 1)
        }
        Some(_) => format!(
            "{ngl}, the routed experts of {} layers on the CPU",
            experts.len()
        ),
    }
}

/// The file's blocks (the trunk's layers, then the NextN block) whose routed experts `--cpu-moe`,
/// `--n-cpu-moe N` and `-ot REGEX=CPU` put on the CPU (the `-ot` rules first, in order, the
/// first that matches a tensor deciding; then the two flags, as llama.cpp appends them). Bad rules, a side that does not exist, a rule that moves
/// a tensor other than a routed expert, and the expert flags on a dense model are errors naming
/// the flag. `device`: the device's name, when one runs the model.
fn host_expert_layers(
    args: &CpuOnlyArgs,
    file: &GgufFile,
    cfg: &Qwen35Config,
    device: Option<&str>,
) -> Result<Vec<usize>> {
    let moe = cfg.n_expert > 0;
    for (flag, given) in [
        ("--cpu-moe", args.cpu_moe),
        ("--n-cpu-moe", args.n_cpu_moe.is_some()),
    ] {
        if given && !moe {
            bail!(
                "{flag}: this model has no routed experts (a dense {}); -ngl N splits it by layers",
                cfg.arch.name()
            );
        }
    }
    // (regex, on the CPU, the rule as given)
    let mut rules: Vec<(regex::Regex, bool, String)> = Vec::new();
    for given in &args.override_tensor {
        for rule in given.split(',').map(str::trim).filter(|r| !r.is_empty()) {
            let Some((pattern, side)) = rule.rsplit_once('=') else {
                bail!("-ot {rule}: expected REGEX=SIDE (SIDE: CPU or the device's name)");
            };
            let re = regex::Regex::new(pattern)
                .with_context(|| format!("-ot {rule}: the regex {pattern:?} does not compile"))?;
            let on_cpu = if side.eq_ignore_ascii_case("cpu") {
                true
            } else if device.is_some_and(|d| d.eq_ignore_ascii_case(side)) {
                false
            } else {
                bail!(
                    "-ot {rule}: no buffer type {side:?} here; the sides are CPU{}",
                    device.map(|d| format!(" and {d}")).unwrap_or_default()
                );
            };
            rules.push((re, on_cpu, rule.to_string()));
        }
    }
    let mut matched = vec![false; rules.len()];
    let mut layers = Vec::new();
    // The file's blocks, the NextN block last, as llama.cpp's flags match them: `--cpu-moe` and
    // a large enough `--n-cpu-moe` take the head's experts too.
    let blocks = cfg.nextn_block().map_or(cfg.n_layer, |n| n + 1);
    for il in 0..blocks {
        let prefix = format!("blk.{il}.");
        let mut side: Option<bool> = None;
        for t in file
            .tensors()
            .iter()
            .filter(|t| t.name.starts_with(&prefix))
        {
            let hit = rules.iter().position(|(re, _, _)| re.is_match(&t.name));
            let Some(r) = hit else { continue };
            matched[r] = true;
            let (_, on_cpu, rule) = &rules[r];
            if !nextn_model::placement::is_routed_expert(&t.name) {
                if *on_cpu {
                    bail!(
                        "-ot {rule}: it puts {} on the CPU; per tensor, routed experts (ffn_*_exps) move, whole layers move with -ngl",
                        t.name
                    );
                }
                continue;
            }
            if side.is_some_and(|s| s != *on_cpu) {
                bail!("-ot {rule}: the routed experts of layer {il} go to one side together");
            }
            side = Some(*on_cpu);
        }
        let by_flag = args.cpu_moe || args.n_cpu_moe.is_some_and(|n| il < n);
        if side.unwrap_or(by_flag) {
            layers.push(il);
        }
    }
    for (r, (_, _, rule)) in rules.iter().enumerate() {
        if !matched[r] {
            eprintln!("-ot {rule}: matches no tensor of this model's layers");
        }
    }
    if device.is_none() && (!layers.is_empty() || !rules.is_empty()) {
        eprintln!("--cpu-moe / --n-cpu-moe / -ot: no effect (the whole model runs on the CPU)");
        return Ok(Vec::new());
    }
    Ok(layers)
}

/// The device to run on and the `-ngl` asked for (`None`: not given, `auto` or `all`): `-dev NAME`
/// opens that device (`none`: the CPU); `-ngl 0` keeps the CPU; otherwise the first hardware GPU,
/// when there is one (like llama.cpp's Vulkan backend, a software device is used only when named).
fn choose_device(args: &CpuOnlyArgs) -> Result<Option<(Arc<nextn_gpu::Gpu>, Option<usize>)>> {
    let ngl = match args.n_gpu_layers.as_deref() {
        None | Some("auto") | Some("all") => None,
        Some(v) => Some(v.parse::<i64>().ok().filter(|&n| n >= 0).with_context(|| {
            format!("-ngl {v}: expected a number of layers (0 or more), `auto` or `all`")
        })?),
    };
    if let Some(f) = args.fit.as_deref() {
        if f != "on" && f != "off" {
            bail!("--fit {f}: expected on or off");
        }
    }
    let dev = args.device.as_deref().map(str::trim);
    if let Some(list) = dev {
        if list.contains(',') {
            bail!("-dev {list}: the model runs on one device; name one (nextn --list-devices)");
        }
    }
    if matches!(dev, Some(d) if d.eq_ignore_ascii_case("none")) || ngl == Some(0) {
        return Ok(None);
    }
    let name = match dev {
        Some(d) => d.to_string(),
        None => {
            let hardware = nextn_gpu::list_devices().into_iter().find(|d| !d.software);
            match (hardware, ngl) {
                (Some(d), _) => d.name,
                (None, None) => return Ok(None),
                (None, Some(n)) => {
                    eprintln!("-ngl {n}: no GPU found (nextn --list-devices); running on the CPU");
                    return Ok(None);
                }
            }
        }
    };
    let gpu =
        nextn_model::device::open_device(Some(&name)).with_context(|| format!("-dev {name}"))?;
    Ok(Some((gpu, ngl.map(|n| n as usize))))
}

#[derive(clap::Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Temperature (0 = greedy)
    #[arg(long = "temp", default_value_t = 0.8)]
    pub temp: f32,
    /// Top-k (0 = off)
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Top-p (1 = off)
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p (0 = off)
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty (1 = off)
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Tokens the penalties look back over
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
    #[arg(long = "presence-penalty", default_value_t = 0.0)]
    pub presence_penalty: f32,
    #[arg(long = "frequency-penalty", default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// RNG seed (-1: random)
    #[arg(short = 's', long = "seed", default_value_t = -1, allow_negative_numbers = true)]
    pub seed: i64,
    /// Add BIAS to a token's logit: TOKEN_ID+BIAS or TOKEN_ID-BIAS, e.g. 15043+1 (repeatable;
    /// TOKEN_ID-inf bans the token)
    #[arg(short = 'l', long = "logit-bias", value_name = "TOKEN_ID(+/-)BIAS")]
    pub logit_bias: Vec<String>,
}

/// Constrained decoding, with llama.cpp's flags.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct GrammarArgs {
    /// Constrain the output with a grammar: llama.cpp's GBNF, or llguidance's Lark syntax
    #[arg(long = "grammar", conflicts_with_all = ["grammar_file", "json_schema", "json_schema_file"])]
    pub grammar: Option<String>,
    /// Read the grammar from a file
    #[arg(long = "grammar-file", conflicts_with_all = ["json_schema", "json_schema_file"])]
    pub grammar_file: Option<PathBuf>,
    /// Constrain the output to JSON valid under this JSON Schema (`{}` for any JSON object)
    #[arg(short = 'j', long = "json-schema", conflicts_with = "json_schema_file")]
    pub json_schema: Option<String>,
    /// Read the JSON Schema from a file (also -jf)
    #[arg(long = "json-schema-file")]
    pub json_schema_file: Option<PathBuf>,
}

impl GrammarArgs {
    /// The grammar asked for, if any.
    pub fn source(&self) -> Result<Option<GrammarSource>> {
        let read = |p: &PathBuf| {
            std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))
        };
        let schema = |text: &str, what: &str| -> Result<GrammarSource> {
            let v: serde_json::Value =
                serde_json::from_str(text).with_context(|| format!("{what} is not valid JSON"))?;
            Ok(match v {
                serde_json::Value::Object(m) if m.is_empty() => GrammarSource::JsonObject,
                v => GrammarSource::JsonSchema(v),
            })
        };
        Ok(
            match (
                &self.grammar,
                &self.grammar_file,
                &self.json_schema,
                &self.json_schema_file,
            ) {
                (Some(g), ..) => Some(GrammarSource::Grammar(g.clone())),
                (_, Some(f), ..) => Some(GrammarSource::Grammar(read(f)?)),
                (_, _, Some(j), _) => Some(schema(j, "--json-schema")?),
                (_, _, _, Some(f)) => Some(schema(
                    &read(f)?,
                    &format!("--json-schema-file {}", f.display()),
                )?),
                _ => None,
            },
        )
    }
}

/// A compiled grammar for one request, with the flag it came from named in errors.
pub fn constraint(
    compiler: &mut Option<GrammarCompiler>,
    loaded: &Loaded,
    source: &GrammarSource,
) -> Result<Constraint> {
    let c = match compiler {
        Some(c) => c,
        None => compiler.insert(GrammarCompiler::new(
            &loaded.tokenizer,
            loaded.model.n_vocab,
        )?),
    };
    c.compile(source).context("--grammar / --json-schema")
}

/// `--reasoning-budget N` (`-1`: none) on a prompt whose rendered text is `prompt`: `grammar`
/// with a budget on the reasoning block the prompt opened or the model opens.
pub fn with_reasoning_budget(
    compiler: &mut Option<GrammarCompiler>,
    loaded: &Loaded,
    grammar: Option<Constraint>,
    budget: i64,
    message: &str,
    prompt: &str,
) -> Result<Option<Constraint>> {
    let budget = match budget {
        -1 => return Ok(grammar),
        n if n >= 0 => usize::try_from(n).unwrap_or(usize::MAX),
        n => bail!("--reasoning-budget {n}: -1 (no cap) or a token count"),
    };
    let budget = ReasoningBudget::from_tags(
        &loaded.tokenizer,
        budget,
        prompt_opens_thinking(prompt),
        reasoning::OPEN,
        reasoning::CLOSE,
        message,
    );
    Ok(Some(match grammar {
        Some(g) => g.with_reasoning_budget(budget),
        None => {
            let c = match compiler {
                Some(c) => c,
                None => compiler.insert(GrammarCompiler::new(
                    &loaded.tokenizer,
                    loaded.model.n_vocab,
                )?),
            };
            c.reasoning_budget_only(budget)
        }
    }))
}

#[derive(clap::Args, Clone, Debug)]
pub struct SpecArgs {
    /// Speculative decoding: none, or nextn / draft-mtp (synonyms) to draft with the model's MTP head
    #[arg(long = "spec-type", default_value = "none", value_parser = ["none", "nextn", "draft-mtp", "mtp"])]
    pub spec_type: String,
    /// Most tokens drafted per step
    #[arg(
        long = "spec-draft-n-max",
        visible_alias = "draft-max",
        default_value_t = 3
    )]
    pub n_max: usize,
    /// Drafts shorter than this are discarded
    #[arg(
        long = "spec-draft-n-min",
        visible_alias = "draft-min",
        default_value_t = 0
    )]
    pub n_min: usize,
    /// Stop drafting when the head's top-1 probability (full softmax) is below this
    #[arg(
        long = "spec-draft-p-min",
        visible_alias = "draft-p-min",
        default_value_t = 0.0
    )]
    pub p_min: f32,
    /// How drafts are chosen and verified when sampling (temperature > 0): coupled (alias greedy:
    /// the head's top-1, accepted when the target's own draw at that position equals it, so a
    /// seed gives the same tokens with or without drafting) or sample (draw drafts from the head,
    /// accept with min(1, p/q), resample the residual on rejection: same distribution, other
    /// tokens, accepts more)
    #[arg(long = "spec-draft-sampling", default_value = "coupled", value_parser = ["coupled", "greedy", "sample"])]
    pub draft_sampling: String,
    /// MTP-only sidecar GGUF holding the NextN head (when the model file has none)
    #[arg(long = "spec-draft-model", visible_alias = "model-draft")]
    pub draft_model: Option<PathBuf>,
    #[command(flatten)]
    pub draft_vocab: DraftVocabArgs,
}

impl SpecArgs {
    pub fn enabled(&self) -> bool {
        self.spec_type != "none"
    }

    pub fn config(&self) -> Result<SpecConfig> {
        if !(0.0..=1.0).contains(&self.p_min) {
            bail!("--spec-draft-p-min {} must be between 0 and 1", self.p_min);
        }
        let draft_sampling = DraftSampling::parse(&self.draft_sampling).with_context(|| {
            format!(
                "--spec-draft-sampling {}: expected coupled, greedy or sample",
                self.draft_sampling
            )
        })?;
        Ok(SpecConfig {
            n_max: self.n_max,
            n_min: self.n_min,
            p_min: self.p_min,
            draft_sampling,
            mask_drafts: true,
        })
    }

    /// Bind the NextN head from the model file or the sidecar (a clear error when there is none),
    /// restricted to the draft vocabulary when `--spec-draft-vocab` asks for one.
    pub fn load_head(&self, loaded: &Loaded) -> Result<NextnHead> {
        let mut head = self.load_full_head(loaded)?;
        self.draft_vocab.apply(loaded, &mut head)?;
        let trunk_on_device = loaded
            .model
            .placement()
            .is_some_and(|p| p.first_device_layer == 0);
        if head.device_drafts_stay() == Some(false) && trunk_on_device {
            eprintln!(
                "note: the token embedding table does not fit on the device beside the weights and a sequence's caches: it \
                 stays in host memory, and the NextN head's drafts come back to the host after each draft"
            );
        }
        Ok(head)
    }

    fn load_full_head(&self, loaded: &Loaded) -> Result<NextnHead> {
        match &self.draft_model {
            Some(p) => {
                let f = Arc::new(GgufFile::open(p).with_context(|| format!("cannot read MTP file {}", p.display()))?);
                NextnHead::load_from(&loaded.model, f).with_context(|| format!("{} has no usable NextN head", p.display()))
            }
            None => NextnHead::load(&loaded.model).with_context(|| {
                format!(
                    "--spec-type {} needs a NextN (MTP) head, and {} has none; give an MTP sidecar with -md FILE or use --spec-type none",
                    self.spec_type,
                    loaded.path.display()
                )
            }),
        }
    }
}

impl SamplingArgs {
    pub fn config(&self) -> Result<SamplerConfig> {
        let seed = if self.seed < 0 {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        } else {
            self.seed as u64
        };
        let cfg = SamplerConfig {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed,
            logit_bias: self
                .logit_bias
                .iter()
                .map(|b| parse_logit_bias(b))
                .collect::<Result<_>>()?,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// `TOKEN_ID+BIAS`, `TOKEN_ID-BIAS` (llama.cpp's `--logit-bias`); `-inf` bans the token.
fn parse_logit_bias(s: &str) -> Result<(u32, f32)> {
    let at = s
        .find(['+', '-'])
        .with_context(|| format!("--logit-bias {s}: expected TOKEN_ID+BIAS or TOKEN_ID-BIAS"))?;
    let id: u32 = s[..at]
        .trim()
        .parse()
        .with_context(|| format!("--logit-bias {s}: '{}' is not a token id", &s[..at]))?;
    let bias: f32 = s[at..]
        .trim()
        .parse()
        .with_context(|| format!("--logit-bias {s}: '{}' is not a number", &s[at..]))?;
    if bias.is_nan() || bias == f32::INFINITY {
        bail!("--logit-bias {s}: the bias must be a finite number or -inf");
    }
    Ok((id, bias))
}

pub fn prompt_text(prompt: &Option<String>, file: &Option<PathBuf>) -> Result<String> {
    match (prompt, file) {
        (Some(p), _) => Ok(p.clone()),
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("cannot read prompt file {}", f.display())),
        (None, None) => bail!("no prompt: give -p TEXT or -f FILE"),
    }
}

/// Ranking shipped for the Qwen3.5 / Qwen3.6 tokenizer (vocabulary 248,320), written by
/// `nextn vocab-stats --binary` from a mixed offline corpus of code and prose (see README).
const QWEN35_RANKING: &[u8] = include_bytes!("../../../../models/qwen35-token-ranking.bin");
const QWEN35_RANKING_NAME: &str = "models/qwen35-token-ranking.bin";

#[derive(clap::Args, Clone, Debug, Default)]
pub struct DraftVocabArgs {
    /// Trimmed draft head: the MTP head's LM head computes only the N most frequent tokens (plus
    /// the control tokens the model may emit); the target still verifies over the whole
    /// vocabulary, so output is unchanged and only acceptance can drop. Ranking: the file given
    /// with --spec-draft-vocab-file, else the one shipped for the Qwen3.5/3.6 tokenizer, else
    /// (other vocabularies) token id order, which for byte-level BPE is merge order (earlier
    /// merges joined more frequent pairs)
    #[arg(long = "spec-draft-vocab", value_name = "N")]
    pub draft_vocab: Option<usize>,
    /// Token ranking for --spec-draft-vocab, as written by `nextn vocab-stats`
    #[arg(
        long = "spec-draft-vocab-file",
        value_name = "FILE",
        requires = "draft_vocab"
    )]
    pub draft_vocab_file: Option<PathBuf>,
}

impl DraftVocabArgs {
    /// The draft token ids for this model, or `None` when no trimmed head was asked for.
    pub fn ids(&self, loaded: &Loaded) -> Result<Option<(Vec<u32>, String)>> {
        let Some(n) = self.draft_vocab else {
            return Ok(None);
        };
        let n_vocab = loaded.model.n_vocab;
        if n == 0 || n > n_vocab {
            bail!("--spec-draft-vocab {n} is out of range: it must be between 1 and the vocabulary size {n_vocab}");
        }
        let ranking = choose_ranking(&loaded.tokenizer, n_vocab, self.draft_vocab_file.as_deref())?;
        let always = always_drafted(&loaded.tokenizer, n_vocab);
        let ids = ranking
            .draft_vocab(n, n_vocab, &always)
            .with_context(|| format!("--spec-draft-vocab {n}"))?;
        Ok(Some((ids, ranking.origin)))
    }

    /// Restrict `head` to the draft vocabulary if one was asked for; says so on stderr.
    pub fn apply(&self, loaded: &Loaded, head: &mut NextnHead) -> Result<()> {
        if let Some((ids, origin)) = self.ids(loaded)? {
            head.restrict_vocab(&ids)
                .context("cannot build the trimmed draft head")?;
            let d = head.draft_vocab().map(|d| (d.len(), d.weight_bytes()));
            if let Some((len, bytes)) = d {
                eprintln!(
                    "draft vocabulary: {len} of {} tokens ({:.1} MiB of LM head rows), ranked by {origin}",
                    loaded.model.n_vocab,
                    bytes as f64 / (1 << 20) as f64
                );
            }
        }
        Ok(())
    }
}

/// The ranking for a model: the user's file, else the shipped Qwen3.5/3.6 one when the tokenizer
/// is that one (vocabulary size and a few token strings agree), else token id order.
pub fn choose_ranking(
    tok: &Tokenizer,
    n_vocab: usize,
    file: Option<&Path>,
) -> Result<TokenRanking> {
    if let Some(p) = file {
        let r = TokenRanking::read(p, n_vocab)?;
        if let Some(v) = r.n_vocab {
            if v != n_vocab {
                bail!(
                    "token ranking {} was built for a vocabulary of {v} tokens, but the model has {n_vocab}",
                    p.display()
                );
            }
        }
        if let Some((id, want)) = mismatched_check(&r, tok) {
            bail!(
                "token ranking {} was built with another tokenizer: token {id} is '{want}' there but '{}' here",
                p.display(),
                tok.token_text(id).unwrap_or("")
            );
        }
        return Ok(r);
    }
    if let Ok(r) = TokenRanking::parse(QWEN35_RANKING, QWEN35_RANKING_NAME, n_vocab) {
        if r.n_vocab == Some(n_vocab) && !r.checks.is_empty() && mismatched_check(&r, tok).is_none()
        {
            return Ok(r);
        }
    }
    Ok(TokenRanking::by_id(n_vocab))
}

fn mismatched_check<'r>(r: &'r TokenRanking, tok: &Tokenizer) -> Option<(u32, &'r str)> {
    r.checks
        .iter()
        .find(|(id, text)| tok.token_text(*id) != Some(text.as_str()))
        .map(|(id, text)| (*id, text.as_str()))
}

/// Tokens a draft vocabulary always keeps: end-of-generation and control tokens (turn markers),
/// and the reasoning / tool-call markers, which a corpus of plain text never shows.
pub fn always_drafted(tok: &Tokenizer, n_vocab: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = tok.eog_ids().to_vec();
    ids.extend(tok.eos());
    ids.extend(tok.eot());
    ids.extend((0..n_vocab as u32).filter(|&i| tok.is_control(i)));
    for t in ["<think>", "</think>", "<tool_call>", "</tool_call>"] {
        ids.extend(tok.token_id(t));
    }
    ids.retain(|&i| (i as usize) < n_vocab);
    ids.sort_unstable();
    ids.dedup();
    ids
}
