//! `nextn run`: generate text from a prompt (raw, or as a chat turn through the model's template).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use nextn_engine::chat::ChatMessage;
use nextn_engine::generate::{generate, GenerateParams};
use nextn_engine::sampler::{Sampler, SamplerConfig};
use serde_json::json;

use super::common::{self, ModelArgs};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Prompt text
    #[arg(short = 'p', long = "prompt")]
    pub prompt: Option<String>,
    /// Read the prompt from a file
    #[arg(short = 'f', long = "file", conflicts_with = "prompt")]
    pub file: Option<PathBuf>,
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

impl SamplingArgs {
    pub fn config(&self) -> Result<SamplerConfig> {
        let seed = if self.seed < 0 {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
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
        (None, Some(f)) => std::fs::read_to_string(f).with_context(|| format!("cannot read prompt file {}", f.display())),
        (None, None) => bail!("no prompt: give -p TEXT or -f FILE"),
    }
}

pub fn run(args: Args) -> Result<ExitCode> {
    let sampler_cfg = args.sampling.config()?;
    let text = prompt_text(&args.prompt, &args.file)?;
    let loaded = common::load(&args.model)?;
    let prompt = if args.chat {
        let mut kwargs = serde_json::Map::new();
        if let Some(k) = &args.chat_template_kwargs {
            let v: serde_json::Value = serde_json::from_str(k).context("--chat-template-kwargs is not valid JSON")?;
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
    let tokens = loaded.tokenizer.encode(&prompt, true);
    let params = GenerateParams {
        n_predict: (args.n_predict >= 0).then_some(args.n_predict as usize),
        n_batch: args.batch_size.max(1),
        ignore_eos: args.ignore_eos,
        stop: args.stop.clone(),
    };
    let mut sampler = Sampler::new(sampler_cfg)?;
    let mut state = loaded.new_sequence();
    let stdout = std::io::stdout();
    let streaming = !args.json;
    let generation = generate(
        &loaded.model,
        &loaded.tokenizer,
        &loaded.pool,
        &mut state,
        &tokens,
        &params,
        &mut sampler,
        |piece| {
            if streaming {
                let mut out = stdout.lock();
                // A closed pipe (e.g. `| head`) ends generation instead of failing.
                out.write_all(piece.as_bytes()).and_then(|_| out.flush()).is_ok()
            } else {
                true
            }
        },
    )?;
    let t = &generation.timings;
    if args.json {
        let out = json!({
            "model": loaded.path.display().to_string(),
            "prompt_tokens": tokens,
            "text": generation.text,
            "tokens": generation.tokens,
            "finish_reason": generation.finish.as_str(),
            "timings": t.to_json(),
        });
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
    Ok(ExitCode::SUCCESS)
}
