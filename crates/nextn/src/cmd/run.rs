//! `nextn run`: generate text from a prompt (raw, or as a chat turn through the model's template).
//! One request through the generation loop (`nextn_engine::scheduler`), on one slot.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::mpsc;

use anyhow::{bail, Context, Result};
use nextn_engine::chat::ChatMessage;
use nextn_engine::scheduler::{
    DraftPolicy, Event, EventSink, PrefixCacheConfig, Request, Scheduler, SchedulerConfig,
};
use nextn_engine::slot_file::{write_atomically, SlotFileError};
use serde_json::json;

use super::common::{self, GrammarArgs, ModelArgs, SamplingArgs, SpecArgs, VisionArgs};
use nextn_engine::media::{MultimodalPrompt, PromptText, IMAGE_PLACEHOLDER, MEDIA_MARKER};
use nextn_engine::scheduler::EngineRef;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    #[command(flatten)]
    pub grammar: GrammarArgs,
    /// Prompt text
    #[arg(short = 'p', long = "prompt", allow_hyphen_values = true)]
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
    /// Treat the prompt as a user message and render it with the chat template; without -p, an
    /// interactive chat on the terminal (-cnv)
    #[arg(long, visible_alias = "conversation")]
    pub chat: bool,
    /// Plain text continuation (-no-cnv; the default)
    #[arg(long = "no-conversation", conflicts_with = "chat")]
    pub no_conversation: bool,
    /// System message for --chat
    #[arg(long = "system-prompt")]
    pub system_prompt: Option<String>,
    /// Extra chat template variables as JSON, e.g. '{"enable_thinking": false}'
    #[arg(long = "chat-template-kwargs")]
    pub chat_template_kwargs: Option<String>,
    /// At most this many tokens of reasoning (-1: no cap): then --reasoning-budget-message and
    /// `</think>` are forced and the model answers
    #[arg(long = "reasoning-budget", default_value_t = -1, allow_negative_numbers = true)]
    pub reasoning_budget: i64,
    /// Written before `</think>` when the reasoning budget runs out
    #[arg(long = "reasoning-budget-message", default_value = "")]
    pub reasoning_budget_message: String,
    /// Keep generating after end-of-generation tokens
    #[arg(long)]
    pub ignore_eos: bool,
    /// Stop when the output contains this text (repeatable)
    #[arg(short = 'r', long = "reverse-prompt", visible_alias = "stop")]
    pub stop: Vec<String>,
    /// Print one JSON object (text, tokens, timings) instead of streaming text
    #[arg(long)]
    pub json: bool,
    /// Keep the prompt's state in FILE after prefill, and resume from it when a later prompt
    /// starts with the same tokens
    #[arg(long = "prompt-cache", value_name = "FILE")]
    pub prompt_cache: Option<PathBuf>,
    /// Use --prompt-cache without updating the file
    #[arg(long = "prompt-cache-ro", requires = "prompt_cache")]
    pub prompt_cache_ro: bool,
    #[command(flatten)]
    pub vision: VisionArgs,
    /// Image file (PNG, JPEG, WebP, GIF) for the prompt, repeatable; each goes where the prompt
    /// has <__media__>, else all go before the prompt, as llama-mtmd-cli places them. In a chat
    /// (-cnv) they go with the first message, and `/image PATH` attaches more
    #[arg(long = "image", value_name = "FILE", conflicts_with_all = ["tokens", "prompt_cache"])]
    pub image: Vec<PathBuf>,
}

/// Refuses a prompt whose text and images (`files`, counted from their headers) leave no room in
/// a context of `n_ctx` tokens, before any image is decoded.
fn check_image_prompt(
    tower: &nextn_vision::VisionTower,
    text: &PromptText,
    files: &[(&Path, Vec<u8>)],
    n_ctx: usize,
) -> Result<()> {
    let mut image_rows = 0;
    for (path, bytes) in files {
        let (w, h) = nextn_vision::image_size(bytes, &path.display().to_string())
            .with_context(|| format!("--image {}", path.display()))?;
        let (nx, ny) = tower.token_grid_for_size(w, h);
        image_rows += nx * ny;
    }
    let n = text.n_text_tokens() + image_rows;
    if n >= n_ctx {
        bail!(
            "the prompt has {n} tokens ({image_rows} of them for {} image(s)), but the context holds {n_ctx} (-c; at least one more is needed to generate)",
            files.len()
        );
    }
    Ok(())
}

/// The prompt text with an image placeholder per `--image`: at each `<__media__>` when the
/// text has them (as many as images), else all before the text.
fn place_images(text: &str, n_images: usize) -> Result<String> {
    if n_images == 0 {
        return Ok(text.to_string());
    }
    let markers = text.matches(MEDIA_MARKER).count();
    if markers == 0 {
        return Ok(IMAGE_PLACEHOLDER.repeat(n_images) + text);
    }
    if markers != n_images {
        bail!("the prompt has {markers} {MEDIA_MARKER} markers but {n_images} --image files were given");
    }
    Ok(text.replace(MEDIA_MARKER, IMAGE_PLACEHOLDER))
}

/// Streams text to stdout as it comes, or (for one JSON object at the end) hands it back with
/// the end of the request. On a terminal, a prompt that takes more than two seconds shows how
/// far it has been processed on stderr until the answer begins.
pub(super) struct Stdout {
    pub streaming: bool,
    pub events: mpsc::Sender<Event>,
    /// A progress line is on the terminal.
    pub progress_drawn: bool,
}

/// The progress line for a prompt still being processed after two seconds.
fn progress_line(total: usize, cache: usize, processed: usize, time_ms: f64) -> Option<String> {
    if time_ms < 2000.0 || processed >= total {
        return None;
    }
    let cached = if cache > 0 {
        format!(", {cache} from the cache")
    } else {
        String::new()
    };
    Some(format!(
        "prompt: {processed}/{total} tokens ({}%{cached}), {:.0} s",
        // Rounded down: 100% only when it is done.
        100 * processed / total.max(1),
        time_ms / 1e3
    ))
}

/// Whether prompt progress can be shown: stderr is a terminal.
pub(super) fn progress_on_terminal() -> bool {
    std::io::stderr().is_terminal()
}

impl Stdout {
    pub fn new(streaming: bool, events: mpsc::Sender<Event>) -> Self {
        Stdout {
            streaming,
            events,
            progress_drawn: false,
        }
    }

    fn clear_progress(&mut self) {
        if std::mem::take(&mut self.progress_drawn) {
            eprint!("\r\x1b[2K");
        }
    }
}

impl EventSink for Stdout {
    fn send(&mut self, event: Event) -> bool {
        match event {
            Event::PromptProgress {
                total,
                cache,
                processed,
                time_ms,
            } => {
                match progress_line(total, cache, processed, time_ms) {
                    Some(line) => {
                        eprint!("\r\x1b[2K{line}");
                        self.progress_drawn = true;
                    }
                    None if processed >= total => self.clear_progress(),
                    None => {}
                }
                true
            }
            Event::Text(piece) if self.streaming => {
                self.clear_progress();
                let mut out = std::io::stdout().lock();
                // A closed pipe (e.g. `| head`) ends generation instead of failing.
                out.write_all(piece.as_bytes())
                    .and_then(|_| out.flush())
                    .is_ok()
            }
            Event::Started { .. } => true,
            event => {
                self.clear_progress();
                self.events.send(event).is_ok()
            }
        }
    }

    fn is_closed(&self) -> bool {
        false
    }
}

pub fn run(args: Args) -> Result<ExitCode> {
    let sampler = args.sampling.config()?;
    let spec = args.spec.config()?;
    let conversation =
        args.chat && args.prompt.is_none() && args.file.is_none() && args.tokens.is_empty();
    if conversation
        && (args.grammar.source()?.is_some() || args.prompt_cache.is_some() || args.json)
    {
        bail!("conversation mode (-cnv without -p) takes no --grammar, -j, --prompt-cache or --json: give -p for one answer");
    }
    let text = if args.tokens.is_empty() && !conversation {
        common::prompt_text(&args.prompt, &args.file)?
    } else {
        String::new()
    };
    let grammar = args.grammar.source()?;
    let mmproj = if conversation && args.image.is_empty() {
        // `/image` may come later: --mmproj, or the one beside an -hf model.
        args.vision.path(&args.model)?
    } else if args.image.is_empty() {
        // An explicit --mmproj is loaded (and checked) even without images.
        args.vision.mmproj.clone()
    } else {
        match args.vision.path(&args.model)? {
            Some(p) => Some(p),
            None => bail!("--image needs a vision projector: give --mmproj FILE (an -hf model's is found beside it)"),
        }
    };
    let loaded = common::load(&args.model, args.spec.enabled())?;
    let vision = mmproj
        .as_ref()
        .map(|p| args.vision.load(p, &loaded.model))
        .transpose()?;
    // Read now, decoded once the prompt is known to fit the context with them (their token
    // counts come from their headers).
    let image_files = match &vision {
        Some(_) => args
            .image
            .iter()
            .map(|p| {
                super::conversation::read_image(p)
                    .map(|bytes| (p.as_path(), bytes))
                    .with_context(|| format!("--image {}", p.display()))
            })
            .collect::<Result<Vec<_>>>()?,
        None => Vec::new(),
    };
    let prepare_images = |tower: &nextn_vision::VisionTower| {
        image_files
            .iter()
            .map(|(p, bytes)| {
                super::conversation::prepare_image(tower, p, bytes)
                    .with_context(|| format!("--image {}", p.display()))
            })
            .collect::<Result<Vec<_>>>()
    };
    let text = if conversation {
        text
    } else {
        place_images(&text, image_files.len())?
    };
    if let Some((id, _)) = sampler
        .logit_bias
        .iter()
        .find(|(id, _)| *id as usize >= loaded.model.n_vocab)
    {
        bail!(
            "--logit-bias: token id {id} is out of range: the vocabulary has {} tokens",
            loaded.model.n_vocab
        );
    }
    let mut compiler = None;
    let grammar = match &grammar {
        Some(g) => Some(common::constraint(&mut compiler, &loaded, g)?),
        None => None,
    };
    let head = if args.spec.enabled() {
        Some(args.spec.load_head(&loaded)?)
    } else {
        None
    };
    if vision.is_none() {
        args.vision.flags_unused("no vision projector is loaded");
    }
    let vision = vision.map(|mut tower| {
        args.vision.place(&mut tower, &loaded);
        std::sync::Arc::new(tower)
    });
    let mut kwargs = serde_json::Map::new();
    if let Some(k) = &args.chat_template_kwargs {
        let v: serde_json::Value =
            serde_json::from_str(k).context("--chat-template-kwargs is not valid JSON")?;
        match v {
            serde_json::Value::Object(m) => kwargs = m,
            _ => bail!("--chat-template-kwargs must be a JSON object"),
        }
    }
    if conversation {
        let images = match vision.as_deref() {
            Some(tower) => prepare_images(tower)?,
            None => Vec::new(),
        };
        let engine = EngineRef {
            vision: vision.as_ref(),
            ..loaded.engine(head.as_ref())
        };
        return super::conversation::chat(&args, &loaded, engine, images, sampler, spec, &kwargs);
    }
    let prompt = if args.chat {
        let mut messages = Vec::new();
        if let Some(s) = &args.system_prompt {
            messages.push(ChatMessage::new("system", s));
        }
        messages.push(ChatMessage::new("user", &text));
        loaded.template.render(&messages, true, &kwargs)?
    } else {
        text
    };
    let n_images = image_files.len();
    let MultimodalPrompt { tokens, images } = if args.tokens.is_empty() {
        let text = PromptText::tokenize(&loaded.tokenizer, &prompt, true, n_images)
            .with_context(|| format!("{n_images} --image file(s)"))?;
        let images = match vision.as_deref() {
            Some(tower) if n_images > 0 => {
                check_image_prompt(tower, &text, &image_files, loaded.n_ctx)?;
                prepare_images(tower)?
            }
            _ => Vec::new(),
        };
        text.with_images(images)
            .with_context(|| format!("{n_images} --image file(s)"))?
    } else {
        MultimodalPrompt {
            tokens: args.tokens.clone(),
            images: Vec::new(),
        }
    };
    let prompt_text = if args.tokens.is_empty() {
        prompt
    } else {
        loaded.tokenizer.decode(&tokens)
    };
    let grammar = common::with_reasoning_budget(
        &mut compiler,
        &loaded,
        grammar,
        args.reasoning_budget,
        &args.reasoning_budget_message,
        &prompt_text,
    )?;
    let mut scheduler = Scheduler::new(
        EngineRef {
            vision: vision.as_ref(),
            ..loaded.engine(head.as_ref())
        },
        SchedulerConfig {
            n_slots: 1,
            n_ctx_slot: loaded.n_ctx,
            k_type: loaded.k_type,
            v_type: loaded.v_type,
            n_batch: args.batch_size.max(1),
            queue_capacity: 1,
            spec: head.is_some().then_some(spec),
            policy: DraftPolicy::ALWAYS,
            calibrate: false,
            // One prompt: the cache holds what the file brings and the prompt's own state.
            prefix_cache: args.prompt_cache.as_ref().map(|_| PrefixCacheConfig {
                budget_bytes: usize::MAX,
                snapshot_every: 0,
            }),
        },
    );
    let cached = match &args.prompt_cache {
        Some(path) => load_prompt_cache(&mut scheduler, path)?,
        None => Vec::new(),
    };
    // The state just before the last prompt token: a later prompt that starts with this one,
    // or is this one again, resumes there (the last token's row gives the first output token).
    let cache_point = tokens.len().saturating_sub(1);
    let (events, received) = mpsc::channel();
    scheduler.submit(Request {
        prompt: tokens.clone(),
        sampler,
        n_predict: (args.n_predict >= 0).then_some(args.n_predict as usize),
        stop: args.stop.clone(),
        ignore_eos: args.ignore_eos,
        trace: false,
        grammar,
        logprobs: None,
        cache_prompt: args.prompt_cache.is_some(),
        cache_points: if cache_point > 0 {
            vec![cache_point]
        } else {
            Vec::new()
        },
        forced_acceptance: None,
        images,
        prompt_progress: progress_on_terminal(),
        sink: Box::new(Stdout::new(!args.json, events)),
    });
    scheduler.run();
    let mut text = String::new();
    let completion = loop {
        match received.try_recv() {
            Ok(Event::Text(piece)) => text.push_str(&piece),
            Ok(Event::Done(c)) => break c,
            Ok(Event::Failed { message, .. }) => bail!("{message}"),
            _ => bail!("generation ended without a result"),
        }
    };
    if let (Some(path), false) = (&args.prompt_cache, args.prompt_cache_ro) {
        save_prompt_cache(&mut scheduler, path, &tokens, cache_point, &cached)?;
    }
    let t = &completion.timings;
    if args.json {
        let mut timings = t.to_json();
        if head.is_some() {
            timings["draft_n"] = json!(completion.spec.draft_n);
            timings["draft_n_accepted"] = json!(completion.spec.draft_n_accepted);
        }
        let mut out = json!({
            "model": loaded.path.display().to_string(),
            "prompt_tokens": tokens,
            "text": text,
            "tokens": completion.tokens,
            "finish_reason": completion.finish.as_str(),
            "timings": timings,
        });
        if let Some(end) = completion.grammar_end {
            out["grammar_end"] = json!(end.describe());
        }
        if let Some(head) = &head {
            out["spec"] = completion.spec.to_json(completion.tokens.len());
            out["spec"]["draft_vocab"] = json!(head.draft_vocab_size());
            out["spec"]["n_vocab"] = json!(head.n_vocab());
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!();
    }
    if t.images_encoded > 0 {
        eprintln!(
            "images: {} encoded in {:.1} ms (part of the prompt time)",
            t.images_encoded, t.image_encode_ms
        );
    }
    if t.cache_n > 0 {
        eprintln!(
            "prompt cache: {} of {} prompt tokens resumed from the file",
            t.cache_n,
            tokens.len()
        );
    }
    eprintln!(
        "prompt {} tokens in {:.1} ms ({:.1} tok/s); generated {} tokens in {:.1} ms ({:.1} tok/s); finish: {}",
        t.prompt_n,
        t.prompt_ms,
        t.prompt_per_second(),
        t.predicted_n,
        t.predicted_ms,
        t.predicted_per_second(),
        match completion.grammar_end {
            Some(end) => format!("{} ({})", completion.finish.as_str(), end.describe()),
            None => completion.finish.as_str().to_string(),
        }
    );
    if head.is_some() {
        eprintln!("{}", completion.spec.summary());
    }
    Ok(ExitCode::SUCCESS)
}

/// Offer the file's state to the scheduler; a missing file is an empty cache. Returns the tokens
/// the file holds.
fn load_prompt_cache(scheduler: &mut Scheduler<'_>, path: &Path) -> Result<Vec<u32>> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => bail!(
            "--prompt-cache {}: cannot read the file: {e}",
            path.display()
        ),
    };
    match scheduler.load_prefix(&bytes) {
        Ok(tokens) => Ok(tokens),
        // Saved by a run without drafting: usable, but not for this one; it is replaced.
        Err(e @ SlotFileError::NoHeadState) => {
            eprintln!("prompt cache: {} is not used: {e}", path.display());
            Ok(Vec::new())
        }
        Err(e) => bail!(
            "--prompt-cache {}: {e} (delete the file to start a new cache)",
            path.display()
        ),
    }
}

/// Write the prompt's state at `cache_point` when it differs from what the file held.
fn save_prompt_cache(
    scheduler: &mut Scheduler<'_>,
    path: &Path,
    tokens: &[u32],
    cache_point: usize,
    cached: &[u32],
) -> Result<()> {
    let Some((bytes, kept)) = scheduler.save_prefix(tokens, cache_point) else {
        return Ok(());
    };
    if kept == cached {
        return Ok(());
    }
    write_atomically(path, &bytes)
        .with_context(|| format!("--prompt-cache {}: cannot write the file", path.display()))?;
    eprintln!(
        "prompt cache: saved the state after {} tokens to {} ({:.1} MiB)",
        kept.len(),
        path.display(),
        bytes.len() as f64 / (1024.0 * 1024.0)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::progress_line;

    /// Nothing for a prompt done within two seconds or finished; then where it stands.
    #[test]
    fn prompt_progress_line() {
        assert_eq!(progress_line(4096, 0, 512, 1500.0), None);
        assert_eq!(progress_line(4096, 0, 4096, 9000.0), None);
        assert_eq!(
            progress_line(720, 0, 719, 9000.0).as_deref(),
            Some("prompt: 719/720 tokens (99%), 9 s")
        );
        assert_eq!(
            progress_line(4096, 0, 1024, 2500.0).as_deref(),
            Some("prompt: 1024/4096 tokens (25%), 2 s")
        );
        assert_eq!(
            progress_line(4000, 1000, 3000, 12_400.0).as_deref(),
            Some("prompt: 3000/4000 tokens (75%, 1000 from the cache), 12 s")
        );
    }
}
