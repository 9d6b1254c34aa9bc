//! `nextn run`: generate text from a prompt (raw, or as a chat turn through the model's template).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use nextn_engine::chat::ChatMessage;
use nextn_engine::generate::{generate, GenerateParams};
use nextn_engine::sampler::{Sampler, SamplerConfig};
use nextn_engine::speculative::{generate_speculative, DraftSampling, SpecParams, SpecSequence};
use nextn_gguf::GgufFile;
use nextn_model::NextnHead;
use serde_json::json;
use std::sync::Arc;

use super::common::{self, ModelArgs};
use super::vocab_stats::DraftVocabArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Prompt text
    #[arg(short = 'p', long = "prompt")]
    pub prompt: Option<String>,
    /// Read the prompt from a file
    #[arg(short = 'f', long = "file", conflicts_with = "prompt")]
    pub file: Option<PathBuf>,
    /// The prompt as token ids, comma separated
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["prompt", "file", "chat"])]
    pub tokens: Vec<u32>,
    /// Tokens to generate (-1: until end of generation or a full context)
    #[arg(short = 'n', long = "n-predict", default_value_t = -1, allow_negative_numbers = true)]
    pub n_predict: i64,
    /// Prompt rows per prefill pass
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    pub batch_size: usize,
    /// Treat the prompt as a user message and render it with the chat template
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat
    #[arg(long = "system-prompt")]
    pub system_prompt: Option<String>,
    /// Extra chat template variables as JSON, e.g. '{"enable_thinking": false}'
    #[arg(long = "chat-template-kwargs")]
    pub chat_template_kwargs: Option<String>,
    /// Keep generating after end-of-generation tokens
    #[arg(long)]
    pub ignore_eos: bool,
    /// Stop when the output contains this text (repeatable)
    #[arg(short = 'r', long = "reverse-prompt", visible_alias = "stop")]
    pub stop: Vec<String>,
    /// Print one JSON object (text, tokens, timings) instead of streaming text
    #[arg(long)]
    pub json: bool,
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
    /// How drafts are chosen when sampling (temperature > 0): greedy (head's top-1, exact-match
    /// acceptance, same tokens as plain decoding for a seed) or sample (draw from the head, accept
    /// with min(1, p/q), resample the residual on rejection; accepts more)
    #[arg(long = "spec-draft-sampling", default_value = "sample", value_parser = ["greedy", "sample"])]
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

    pub fn params(&self) -> Result<SpecParams> {
        if !(0.0..=1.0).contains(&self.p_min) {
            bail!("--spec-draft-p-min {} must be between 0 and 1", self.p_min);
        }
        let draft_sampling = DraftSampling::parse(&self.draft_sampling).with_context(|| {
            format!(
                "--spec-draft-sampling {}: expected greedy or sample",
                self.draft_sampling
            )
        })?;
        Ok(SpecParams {
            n_max: self.n_max,
            n_min: self.n_min,
            p_min: self.p_min,
            draft_sampling,
            trace: false,
        })
    }

    /// Bind the NextN head from the model file or the sidecar (a clear error when there is none),
    /// restricted to the draft vocabulary when `--spec-draft-vocab` asks for one.
    pub fn load_head(&self, loaded: &common::Loaded) -> Result<NextnHead> {
        let mut head = self.load_full_head(loaded)?;
        self.draft_vocab.apply(loaded, &mut head)?;
        Ok(head)
    }

    fn load_full_head(&self, loaded: &common::Loaded) -> Result<NextnHead> {
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
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

pub fn prompt_text(prompt: &Option<String>, file: &Option<PathBuf>) -> Result<String> {
    match (prompt, file) {
        (Some(p), _) => Ok(p.clone()),
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("cannot read prompt file {}", f.display())),
        (None, None) => bail!("no prompt: give -p TEXT or -f FILE"),
    }
}

pub fn run(args: Args) -> Result<ExitCode> {
    let sampler_cfg = args.sampling.config()?;
    let spec_params = args.spec.params()?;
    let text = if args.tokens.is_empty() {
        prompt_text(&args.prompt, &args.file)?
    } else {
        String::new()
    };
    let loaded = common::load(&args.model)?;
    let head = if args.spec.enabled() {
        Some(args.spec.load_head(&loaded)?)
    } else {
        None
    };
    let prompt = if args.chat {
        let mut kwargs = serde_json::Map::new();
        if let Some(k) = &args.chat_template_kwargs {
            let v: serde_json::Value =
                serde_json::from_str(k).context("--chat-template-kwargs is not valid JSON")?;
            match v {
                serde_json::Value::Object(m) => kwargs = m,
                _ => bail!("--chat-template-kwargs must be a JSON object"),
            }
        }
        let mut messages = Vec::new();
        if let Some(s) = &args.system_prompt {
            messages.push(ChatMessage::new("system", s));
        }
        messages.push(ChatMessage::new("user", &text));
        loaded.template.render(&messages, true, &kwargs)?
    } else {
        text
    };
    let tokens = if args.tokens.is_empty() {
        loaded.tokenizer.encode(&prompt, true)
    } else {
        args.tokens.clone()
    };
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= loaded.model.n_vocab) {
        bail!(
            "token id {bad} is out of range: the vocabulary has {} tokens",
            loaded.model.n_vocab
        );
    }
    let params = GenerateParams {
        n_predict: (args.n_predict >= 0).then_some(args.n_predict as usize),
        n_batch: args.batch_size.max(1),
        ignore_eos: args.ignore_eos,
        stop: args.stop.clone(),
    };
    let mut sampler = Sampler::new(sampler_cfg)?;
    let stdout = std::io::stdout();
    let streaming = !args.json;
    let on_text = |piece: &str| {
        if streaming {
            let mut out = stdout.lock();
            // A closed pipe (e.g. `| head`) ends generation instead of failing.
            out.write_all(piece.as_bytes())
                .and_then(|_| out.flush())
                .is_ok()
        } else {
            true
        }
    };
    let (generation, spec_stats) = match &head {
        Some(head) => {
            let mut seq = SpecSequence::new(
                &loaded.model,
                head,
                loaded.n_ctx,
                loaded.k_type,
                loaded.v_type,
            );
            let (g, s) = generate_speculative(
                &loaded.model,
                head,
                &loaded.tokenizer,
                &loaded.pool,
                &mut seq,
                &tokens,
                &params,
                &spec_params,
                &mut sampler,
                on_text,
            )?;
            (g, Some(s))
        }
        None => {
            let mut state = loaded.new_sequence();
            let g = generate(
                &loaded.model,
                &loaded.tokenizer,
                &loaded.pool,
                &mut state,
                &tokens,
                &params,
                &mut sampler,
                on_text,
            )?;
            (g, None)
        }
    };
    let t = &generation.timings;
    if args.json {
        let mut timings = t.to_json();
        if let Some(s) = &spec_stats {
            timings["draft_n"] = json!(s.draft_n);
            timings["draft_n_accepted"] = json!(s.draft_n_accepted);
        }
        let mut out = json!({
            "model": loaded.path.display().to_string(),
            "prompt_tokens": tokens,
            "text": generation.text,
            "tokens": generation.tokens,
            "finish_reason": generation.finish.as_str(),
            "timings": timings,
        });
        if let (Some(s), Some(head)) = (&spec_stats, &head) {
            out["spec"] = s.to_json(generation.tokens.len());
            out["spec"]["draft_vocab"] = json!(head.draft_vocab_size());
            out["spec"]["n_vocab"] = json!(head.n_vocab());
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!();
    }
    eprintln!(
        "prompt {} tokens in {:.1} ms ({:.1} tok/s); generated {} tokens in {:.1} ms ({:.1} tok/s); finish: {}",
        t.prompt_n,
        t.prompt_ms,
        t.prompt_per_second(),
        t.predicted_n,
        t.predicted_ms,
        t.predicted_per_second(),
        generation.finish.as_str()
    );
    if let Some(s) = &spec_stats {
        eprintln!("{}", s.summary());
    }
    Ok(ExitCode::SUCCESS)
}
