//! `nextn serve`: the OpenAI-compatible server (llama-server's flags where they exist).

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use nextn_engine::scheduler::{DraftPolicy, Engine, PrefixCacheConfig, SchedulerConfig};
use nextn_engine::speculative::forced::ForcedAcceptance;
use nextn_model::config::LayerKind;
use nextn_server::cors::CorsOrigins;
use nextn_server::image_url::AddressPolicy;
use nextn_server::{Loaded, ReasoningFormat, ServerConfig};
use serde_json::json;

use super::common::{self, ModelArgs, SamplingArgs, SpecArgs, VisionArgs};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    #[command(flatten)]
    pub vision: VisionArgs,
    /// Sampling for requests that do not set it (request fields override these)
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Most tokens a request generates when it does not say (-1: until end of generation or a
    /// full context)
    #[arg(short = 'n', long = "n-predict", visible_alias = "predict", default_value_t = -1, allow_negative_numbers = true, env = "LLAMA_ARG_N_PREDICT")]
    pub n_predict: i64,
    /// Address to listen on (loopback by default; use 0.0.0.0 to listen on every interface)
    #[arg(long, default_value = "127.0.0.1", env = "LLAMA_ARG_HOST")]
    pub host: String,
    /// Port to listen on (0: any free port, printed at start-up)
    #[arg(long, default_value_t = 8080, env = "LLAMA_ARG_PORT")]
    pub port: u16,
    /// Parallel sequences (slots), also -np; -c is shared equally among them
    #[arg(long = "parallel", default_value_t = 4, env = "LLAMA_ARG_N_PARALLEL")]
    pub parallel: usize,
    /// Most prompt tokens processed per step over all slots (a long prompt is split so that decoding
    /// slots keep moving)
    #[arg(
        short = 'b',
        long = "batch-size",
        default_value_t = 512,
        env = "LLAMA_ARG_BATCH"
    )]
    pub batch_size: usize,
    /// Draft only while at most N slots are busy, or `auto`: decide per step and slot from measured
    /// step costs and acceptance
    #[arg(long = "spec-max-drafting-slots", default_value = "auto")]
    pub max_drafting_slots: String,
    /// Require `Authorization: Bearer KEY` (repeatable for several keys)
    #[arg(long = "api-key", env = "LLAMA_API_KEY", value_delimiter = ',')]
    pub api_key: Vec<String>,
    /// Model name reported by /v1/models and accepted in requests (default: the file name)
    #[arg(short = 'a', long = "alias", env = "LLAMA_ARG_ALIAS")]
    pub alias: Option<String>,
    /// Where <think> blocks go: deepseek (reasoning_content; `auto` is the same) or none (left in content)
    #[arg(long = "reasoning-format", default_value = "auto", value_parser = ["auto", "deepseek", "none"], env = "LLAMA_ARG_REASONING_FORMAT")]
    pub reasoning_format: String,
    /// Requests that may wait for a free slot; more are answered 503
    #[arg(long = "max-queue", default_value_t = 256)]
    pub max_queue: usize,
    /// Largest request body in bytes (413 above)
    #[arg(long = "max-body-size", default_value_t = 16 << 20)]
    pub max_body_size: usize,
    /// Most images one request may carry, those of the stored conversation it continues
    /// included; a request with more is a 400 before any image is fetched or decoded (each image
    /// also counts its tokens against the context before it is decoded)
    #[arg(long = "max-images", value_name = "N", default_value_t = 128)]
    pub max_images: usize,
    /// Fetch http:// and https:// image URLs of image parts (chat image_url, Messages url
    /// sources, Responses input_image) before a request runs, from public addresses only (see
    /// --image-url-allow-private); without it only data URIs are read and an image URL is a 400
    #[arg(long = "allow-image-urls")]
    pub allow_image_urls: bool,
    /// Also fetch image URLs at addresses that are not public (loopback, private networks,
    /// link-local such as cloud metadata, CGNAT, ...; at every redirect too): all of them, or
    /// with =NET,... only those networks (such as =10.1.0.0/16,192.168.1.20). Anyone who can
    /// send a request can then make the server fetch from there (with --allow-image-urls)
    #[arg(long = "image-url-allow-private", value_name = "NET,...", num_args = 0..=1, require_equals = true, default_missing_value = "", requires = "allow_image_urls")]
    pub image_url_allow_private: Option<String>,
    /// Most image URLs one request may carry; a request with more is a 400 naming the first one
    /// over (with --allow-image-urls)
    #[arg(long = "image-urls-max", value_name = "N", default_value_t = nextn_server::image_url::DEFAULT_MAX_URLS, requires = "allow_image_urls")]
    pub image_urls_max: usize,
    /// Largest image body fetched from an image URL, in bytes: a larger Content-Length is
    /// refused before reading, a body without one is cut at this size (with --allow-image-urls)
    #[arg(long = "image-url-max-bytes", value_name = "N", default_value_t = nextn_server::image_url::DEFAULT_MAX_BYTES, requires = "allow_image_urls")]
    pub image_url_max_bytes: u64,
    /// Seconds one image URL's whole fetch may take: connecting, up to 5 redirects, headers and
    /// body (with --allow-image-urls)
    #[arg(long = "image-url-timeout", value_name = "SECS", default_value_t = nextn_server::image_url::DEFAULT_TIMEOUT.as_secs_f64(), requires = "allow_image_urls")]
    pub image_url_timeout: f64,
    /// Seconds a client has to send a whole request head (request line and headers), counted from
    /// the connection's opening or from the first byte of a later request on a kept-alive
    /// connection; slower connections are closed [default: 10]
    #[arg(long = "timeout-header-read", value_name = "SECS")]
    pub timeout_header_read: Option<f64>,
    /// Seconds a kept-alive connection may wait for its next request before it is closed (longer
    /// than the 60 s nginx and load balancers keep idle upstream connections, so that they close
    /// first)
    #[arg(long = "timeout-idle", value_name = "SECS", default_value_t = 75.0)]
    pub timeout_idle: f64,
    /// Seconds a response write may wait for a client that stopped reading before the connection
    /// is closed and its request cancelled (a stream the client keeps reading never times out)
    /// [default: 60]
    #[arg(long = "timeout-write", value_name = "SECS")]
    pub timeout_write: Option<f64>,
    /// llama-server's read/write timeout (-to): sets --timeout-header-read and --timeout-write
    /// where those are not given
    #[arg(long = "timeout", value_name = "SECS", env = "LLAMA_ARG_TIMEOUT")]
    pub timeout: Option<f64>,
    /// Most connections served at once; more wait in the listen backlog until one closes (lowered
    /// to fit the open-file limit, which is raised toward it where allowed)
    #[arg(long = "max-connections", value_name = "N", default_value_t = 1024)]
    pub max_connections: usize,
    /// Seconds running requests may take to finish after SIGTERM before they are cancelled
    #[arg(
        long = "shutdown-grace",
        visible_alias = "drain-timeout",
        default_value_t = 10.0
    )]
    pub shutdown_grace: f64,
    /// Do not log each finished request
    #[arg(long = "log-disable")]
    pub log_disable: bool,
    /// Prefix cache size in MiB, shared by all slots (0 disables it; default: a quarter of the
    /// available memory, at most 8192)
    #[arg(
        long = "cache-ram",
        visible_alias = "cram",
        env = "LLAMA_ARG_CACHE_RAM",
        allow_hyphen_values = true
    )]
    pub cache_ram: Option<i64>,
    /// During a long prefill, keep a prefix-cache snapshot every this many prompt tokens
    /// (0: only at the end of the last message and of each answer)
    #[arg(long = "cache-snapshot-every", default_value_t = 1024)]
    pub cache_snapshot_every: usize,
    /// Directory for slot files: POST /slots/{id}?action=save|restore writes and reads a slot's
    /// state there (created if missing; without it the actions answer 501)
    #[arg(long = "slot-save-path", value_name = "DIR")]
    pub slot_save_path: Option<std::path::PathBuf>,
    /// Continuous batching (-cb; always on)
    #[arg(long = "cont-batching", env = "LLAMA_ARG_CONT_BATCHING", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::SetTrue)]
    pub cont_batching: bool,
    /// Turn continuous batching off (-nocb; no effect: the generation loop always batches)
    #[arg(long = "no-cont-batching", env = "LLAMA_ARG_NO_CONT_BATCHING", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::SetTrue)]
    pub no_cont_batching: bool,
    /// One KV buffer shared by all slots (-kvu; no effect: each slot has its own KV, -c is split)
    #[arg(long = "kv-unified", env = "LLAMA_ARG_KV_UNIFIED", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::SetTrue)]
    pub kv_unified: bool,
    /// Per-slot KV buffers (-no-kvu; how this server always works)
    #[arg(long = "no-kv-unified", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::SetTrue)]
    pub no_kv_unified: bool,
    /// Serve /metrics (always on)
    #[arg(long = "metrics", env = "LLAMA_ARG_ENDPOINT_METRICS", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::SetTrue)]
    pub metrics: bool,
    /// Thinking budget for requests that do not set `thinking_budget_tokens`: -1 unlimited, 0 no
    /// thinking (also `enable_thinking: false` for chat requests that do not set it), N: after N
    /// tokens of reasoning the block is closed and the model answers
    #[arg(long = "reasoning-budget", env = "LLAMA_ARG_THINK_BUDGET", default_value_t = -1, allow_negative_numbers = true)]
    pub reasoning_budget: i64,
    /// Written before the closing tag when a reasoning budget runs out (e.g. "... let's answer
    /// now.")
    #[arg(long = "reasoning-budget-message", default_value = "")]
    pub reasoning_budget_message: String,
    /// Origins browsers may call from (CORS): `*`, or a comma-separated list of origins
    /// (scheme://host[:port]) and `localhost` (any localhost, 127.0.0.1 or [::1] origin); a
    /// listed request Origin is echoed alone, others get no CORS headers
    #[arg(
        long = "cors-origins",
        visible_alias = "cors-origin",
        default_value = "*",
        env = "LLAMA_ARG_CORS_ORIGINS"
    )]
    pub cors_origins: String,
    /// Allow credentials in CORS requests (the default; with `*` the Origin is echoed)
    #[arg(long = "cors-credentials", conflicts_with = "no_cors_credentials")]
    pub cors_credentials: bool,
    /// Do not allow credentials in CORS requests
    #[arg(long = "no-cors-credentials")]
    pub no_cors_credentials: bool,
    /// Measurement only: a request that sends its plain output as `forced_acceptance_reference`
    /// runs the speculative loop at these per-position acceptance rates (as `bench
    /// --force-acceptance`), so that the drafting policy can be load-tested at a real model's
    /// acceptance
    #[arg(long = "force-acceptance", value_delimiter = ',', value_name = "RATES")]
    pub force_acceptance: Vec<f64>,
}

/// The command line's sampling settings as request fields.
fn request_defaults(args: &Args) -> Result<serde_json::Map<String, serde_json::Value>> {
    let s = args.sampling.config()?;
    // f32 settings as the decimal the user wrote (0.8, not 0.800000011920929).
    let f = |x: f32| json!(x.to_string().parse::<f64>().unwrap_or(f64::from(x)));
    let mut d = serde_json::Map::new();
    d.insert("temperature".into(), f(s.temperature));
    d.insert("top_k".into(), json!(s.top_k));
    d.insert("top_p".into(), f(s.top_p));
    d.insert("min_p".into(), f(s.min_p));
    d.insert("repeat_penalty".into(), f(s.repeat_penalty));
    d.insert("repeat_last_n".into(), json!(s.repeat_last_n));
    d.insert("presence_penalty".into(), f(s.presence_penalty));
    d.insert("frequency_penalty".into(), f(s.frequency_penalty));
    // A fixed --seed makes every request that sends none reproducible; without it each request
    // draws its own.
    if args.sampling.seed >= 0 {
        d.insert("seed".into(), json!(args.sampling.seed));
    }
    if !s.logit_bias.is_empty() {
        let bias: serde_json::Map<String, serde_json::Value> = s
            .logit_bias
            .iter()
            .map(|&(id, b)| {
                (
                    id.to_string(),
                    if b.is_finite() {
                        json!(b)
                    } else {
                        json!(false)
                    },
                )
            })
            .collect();
        d.insert("logit_bias".into(), serde_json::Value::Object(bias));
    }
    if args.n_predict >= 0 {
        d.insert("n_predict".into(), json!(args.n_predict));
    }
    Ok(d)
}

fn parse_policy(s: &str) -> Result<DraftPolicy> {
    if s == "auto" {
        return Ok(DraftPolicy::Auto);
    }
    match s.parse::<usize>() {
        Ok(n) => Ok(DraftPolicy::MaxSlots(n)),
        Err(_) => bail!("--spec-max-drafting-slots {s}: expected a number of slots or `auto`"),
    }
}

const TIMEOUT_HEADER_READ_DEFAULT: f64 = 10.0;
const TIMEOUT_WRITE_DEFAULT: f64 = 60.0;

/// File descriptors kept for everything but connections: the model's files, the listener, the
/// runtime's own, slot files, standard streams.
const FDS_RESERVED: u64 = 64;

/// A timeout flag as a duration: a positive number of seconds, at most a year.
fn timeout(flag: &str, secs: f64) -> Result<Duration> {
    if !(secs > 0.0 && secs <= 365.0 * 86400.0) {
        bail!("{flag} {secs}: expected seconds, more than 0 and at most a year");
    }
    Ok(Duration::from_secs_f64(secs))
}

/// The connection limits the flags ask for: each timeout from its own flag, else from `-to`, else
/// its default; the cap fitted to the open-file limit.
pub fn limits(args: &Args) -> Result<nextn_server::conn::Limits> {
    let header_read = args
        .timeout_header_read
        .or(args.timeout)
        .unwrap_or(TIMEOUT_HEADER_READ_DEFAULT);
    let write = args
        .timeout_write
        .or(args.timeout)
        .unwrap_or(TIMEOUT_WRITE_DEFAULT);
    if args.max_connections == 0 {
        bail!("--max-connections 0: at least one connection is needed");
    }
    Ok(nextn_server::conn::Limits {
        header_read: timeout("--timeout-header-read", header_read)?,
        idle: timeout("--timeout-idle", args.timeout_idle)?,
        write_stall: timeout("--timeout-write", write)?,
        max_connections: fit_open_files(args.max_connections),
    })
}

/// The connection cap that fits the open-file limit: the soft limit is raised toward what the
/// cap needs (up to the hard limit, as servers commonly do at start), and the cap is lowered, with
/// a notice, when even that is not enough.
#[cfg(unix)]
// `rlim_t` is not `u64` on every Unix.
#[allow(clippy::unnecessary_cast)]
fn fit_open_files(max_connections: usize) -> usize {
    let want = max_connections as u64 + FDS_RESERVED;
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    let soft = unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return max_connections;
        }
        if (lim.rlim_cur as u64) < want {
            let raised = libc::rlimit {
                rlim_cur: want.min(lim.rlim_max as u64) as libc::rlim_t,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = raised.rlim_cur;
            }
        }
        lim.rlim_cur as u64
    };
    if soft >= want {
        return max_connections;
    }
    let fit = soft.saturating_sub(FDS_RESERVED).max(1) as usize;
    eprintln!(
        "--max-connections {max_connections}: the open-file limit is {soft}, so at most {fit} connections are served at once (raise it with ulimit -n)"
    );
    fit
}

#[cfg(not(unix))]
fn fit_open_files(max_connections: usize) -> usize {
    max_connections
}

/// The image-URL limits the flags ask for, with `--allow-image-urls`.
pub fn image_urls(args: &Args) -> Result<Option<nextn_server::image_url::ImageUrlLimits>> {
    if !args.allow_image_urls {
        return Ok(None);
    }
    if args.image_url_max_bytes == 0 {
        bail!("--image-url-max-bytes 0: expected a number of bytes, at least 1");
    }
    if args.image_urls_max == 0 {
        bail!("--image-urls-max 0: expected at least 1 (without --allow-image-urls no image URL is fetched)");
    }
    let addresses = match &args.image_url_allow_private {
        None => AddressPolicy::PublicOnly,
        Some(list) => AddressPolicy::parse_allowed(list)?,
    };
    Ok(Some(nextn_server::image_url::ImageUrlLimits {
        max_bytes: args.image_url_max_bytes,
        timeout: timeout("--image-url-timeout", args.image_url_timeout)?,
        max_urls: args.image_urls_max,
        addresses,
    }))
}

/// The model id `/v1/models` reports: `--alias`, else the file name.
fn model_id(path: &Path, alias: &Option<String>) -> String {
    alias.clone().unwrap_or_else(|| {
        path.file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default()
    })
}

pub fn run(args: Args) -> Result<ExitCode> {
    if args.parallel == 0 {
        bail!("--parallel 0: at least one slot is needed");
    }
    if !(args.shutdown_grace.is_finite() && args.shutdown_grace >= 0.0) {
        bail!("--shutdown-grace must be a number of seconds >= 0");
    }
    let limits = limits(&args)?;
    let policy = parse_policy(&args.max_drafting_slots)?;
    let spec_config = args.spec.config()?;
    let path = common::model_path(&args.model)?;
    let model_id = model_id(&path, &args.alias);
    let reasoning = if args.reasoning_format == "none" {
        ReasoningFormat::None
    } else {
        ReasoningFormat::Deepseek
    };
    let cfg = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        api_keys: args.api_key.clone(),
        model_id,
        reasoning,
        max_body_bytes: args.max_body_size,
        max_images: args.max_images,
        shutdown_grace: Duration::from_secs_f64(args.shutdown_grace),
        log_requests: !args.log_disable,
        debug_log: args.model.verbose,
        slot_save_path: args.slot_save_path.clone(),
        request_defaults: request_defaults(&args)?,
        model_path: path.display().to_string(),
        cors_origins: CorsOrigins::parse(&args.cors_origins)?,
        cors_credentials: !args.no_cors_credentials,
        forced_acceptance: if args.force_acceptance.is_empty() {
            None
        } else {
            if !args.spec.enabled() {
                bail!("--force-acceptance steers speculative decoding: it needs --spec-type nextn");
            }
            ForcedAcceptance::new(&args.force_acceptance, 0, Vec::new())
                .map_err(|e| anyhow::anyhow!("--force-acceptance: {e}"))?;
            Some(args.force_acceptance.clone())
        },
        limits,
        image_urls: image_urls(&args)?,
        reasoning_budget: match args.reasoning_budget {
            -1 => None,
            n if n >= 0 => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            n => bail!("--reasoning-budget {n}: -1 (unlimited), 0 (no thinking) or a token count"),
        },
        reasoning_budget_message: args.reasoning_budget_message.clone(),
        template_kwargs: match args.reasoning_budget {
            0 => serde_json::Map::from_iter([("enable_thinking".to_string(), false.into())]),
            _ => serde_json::Map::new(),
        },
    };
    if args.no_cont_batching {
        eprintln!(
            "--no-cont-batching: no effect (the generation loop always batches the busy slots)"
        );
    }
    if args.kv_unified {
        eprintln!(
            "--kv-unified: no effect (each slot has its own KV cache; -c is split among the slots)"
        );
    }
    if let Some(dir) = &cfg.slot_save_path {
        nextn_server::slots::check_save_dir(dir).map_err(anyhow::Error::msg)?;
    }
    // The -hf repository is resolved before the model path is pinned below.
    let mmproj = args.vision.path(&args.model)?;
    let vision_args = args.vision.clone();
    let mut model_args = args.model.clone();
    model_args.model = Some(path);
    model_args.hf_repo = None;
    model_args.hf_file = None;
    let n_slots = args.parallel;
    let spec_args = args.spec.clone();
    let n_batch = args.batch_size.max(1);
    let queue_capacity = args.max_queue;
    let (cache_ram, cache_snapshot_every) = (args.cache_ram, args.cache_snapshot_every);
    let ctx_given = model_args.ctx_size.filter(|&c| c > 0);
    let load = move || -> Result<Loaded, String> {
        let loaded =
            common::load(&model_args, spec_args.enabled()).map_err(|e| format!("{e:#}"))?;
        let vision = match &mmproj {
            Some(p) => Some(
                vision_args
                    .load(p, &loaded.model)
                    .map_err(|e| format!("{e:#}"))?,
            ),
            None => None,
        };
        let head = if spec_args.enabled() {
            Some(spec_args.load_head(&loaded).map_err(|e| format!("{e:#}"))?)
        } else {
            None
        };
        if vision.is_none() {
            vision_args.flags_unused("no vision projector is loaded");
        }
        let vision = vision.map(|mut tower| {
            vision_args.place(&mut tower, &loaded);
            Arc::new(tower)
        });
        let cfg = &loaded.model.config;
        let kv_per_token: usize = cfg
            .layer_kinds
            .iter()
            .enumerate()
            .filter(|(_, k)| **k == LayerKind::FullAttention)
            .map(|(il, _)| {
                let width = cfg.n_head_kv[il] * cfg.head_dim;
                loaded.k_type.row_bytes(width) + loaded.v_type.row_bytes(width)
            })
            .sum();
        // -c is shared among the slots (llama-server without --kv-unified); without it, each slot
        // gets the trained context, capped so that the KV of every slot fits in half the memory.
        let n_ctx_slot = match ctx_given {
            Some(c) => c / n_slots,
            None => {
                let budget = common::available_memory().unwrap_or(8 << 30) / 2;
                let fit = budget / (kv_per_token.max(1) as u64 * n_slots as u64);
                cfg.n_ctx_train.min(fit as usize).max(1)
            }
        };
        if n_ctx_slot < 2 {
            return Err(format!(
                "a context of {} tokens shared by {n_slots} slots leaves {n_ctx_slot} per slot; give a larger -c",
                loaded.n_ctx
            ));
        }
        let recurrent_bytes = loaded
            .model
            .new_sequence(1, loaded.k_type, loaded.v_type)
            .map_err(|e| format!("one sequence's caches: {e}"))?
            .bytes();
        let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
        let description = format!(
            "loaded {}: {} {} layers, n_embd {}, vocab {}, {:.1} MiB file mapped, {}\n\
             slots: {n_slots} x {n_ctx_slot} tokens; per slot up to {:.1} MiB KV ({} bytes/token) + {:.2} MiB recurrent state; all slots up to {:.1} MiB",
            loaded.path.display(),
            cfg.arch.name(),
            cfg.n_layer,
            cfg.n_embd,
            loaded.model.n_vocab,
            mib(loaded.model.file.file_size() as usize),
            match &head {
                Some(_) => format!("NextN head for drafting (n_max {}, drafting slots {})", spec_args.n_max, describe_policy(policy)),
                None if cfg.n_nextn > 0 => {
                    "no speculative decoding (the file has a NextN head: --spec-type nextn drafts with it)".to_string()
                }
                None => "no speculative decoding".to_string(),
            },
            mib(kv_per_token * n_ctx_slot),
            kv_per_token,
            mib(recurrent_bytes),
            mib((kv_per_token * n_ctx_slot + recurrent_bytes) * n_slots),
        );
        let description = match &mmproj {
            Some(p) => format!(
                "{description}\nvision: images through the tower of {}",
                p.display()
            ),
            None => description,
        };
        // llama-server's spelling: -1 is no limit, 0 turns the cache off.
        let budget_bytes = match cache_ram {
            Some(n) if n < 0 => usize::MAX,
            Some(n) => (n as usize).saturating_mul(1 << 20),
            None => {
                let mib = (common::available_memory().unwrap_or(0) / 4 / (1 << 20)).min(8192);
                (mib as usize).saturating_mul(1 << 20)
            }
        };
        let prefix_cache = (budget_bytes > 0).then_some(PrefixCacheConfig {
            budget_bytes,
            snapshot_every: cache_snapshot_every,
        });
        let scheduler = SchedulerConfig {
            n_slots,
            n_ctx_slot,
            k_type: loaded.k_type,
            v_type: loaded.v_type,
            n_batch,
            queue_capacity,
            spec: head.is_some().then_some(spec_config),
            policy,
            calibrate: true,
            prefix_cache,
        };
        let template = loaded.template;
        let engine = Engine {
            model: loaded.model,
            head,
            tokenizer: Arc::new(loaded.tokenizer),
            pool: loaded.pool,
            vision,
        };
        Ok(Loaded {
            engine,
            scheduler,
            template,
            description,
        })
    };
    match nextn_server::run(cfg, load) {
        Ok(()) => {
            eprintln!("server stopped");
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => bail!("{e}"),
    }
}

fn describe_policy(p: DraftPolicy) -> String {
    match p {
        DraftPolicy::Auto => "auto".into(),
        DraftPolicy::MaxSlots(n) => format!("at most {n}"),
    }
}
