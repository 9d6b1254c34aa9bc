//! `nextn run -cnv` (or `--chat` without `-p`): an interactive chat on the terminal, as
//! llama-cli's default mode. Each line read from stdin is a user turn; the conversation is
//! rendered with the model's chat template and the answer streams to stdout. The conversation's
//! state stays between turns (the slot keeps it and the prefix cache keeps the state before each
//! answer), so a turn prefills only what is new.
//!
//! With a vision projector, images join the conversation as in llama-mtmd-cli's chat mode:
//! `--image` files go with the first user message, and a `/image PATH` line attaches a picture
//! to the next one (several lines, several pictures). Each image sits before its message's text.
//! The rendered conversation keeps every image at its place, and an image's rows are keyed by its
//! pixels, so later turns resume after it from the cache instead of encoding it again.

use std::io::{BufRead, IsTerminal, Write};
use std::path::Path;
use std::process::ExitCode;
use std::sync::mpsc;

use anyhow::{bail, Result};
use nextn_engine::chat::{final_header, ChatMessage};
use nextn_engine::media::{ImageInput, MultimodalPrompt, IMAGE_PLACEHOLDER};
use nextn_engine::sampler::SamplerConfig;
use nextn_engine::scheduler::{
    DraftPolicy, EngineRef, Event, PrefixCacheConfig, Request, Scheduler, SchedulerConfig,
};
use nextn_engine::speculative::SpecConfig;

use super::common::{self, Loaded};
use super::run::{progress_on_terminal, Args, Stdout};

/// A line that ends the conversation (besides end of input).
const EXIT: &[&str] = &["/exit", "/quit"];
/// A line that forgets the conversation so far (the system message stays).
const CLEAR: &str = "/clear";
/// `/image PATH`: a picture for the next user message.
const IMAGE: &str = "/image";

/// What a line of input asks for.
#[derive(Debug, PartialEq)]
enum Line<'a> {
    Exit,
    Clear,
    /// `/image` and the rest of the line (empty when no file was named).
    Image(&'a str),
    Message(&'a str),
    Empty,
}

fn parse_line(line: &str) -> Line<'_> {
    let line = line.trim();
    if EXIT.contains(&line) {
        return Line::Exit;
    }
    if line == CLEAR {
        return Line::Clear;
    }
    if line == IMAGE {
        return Line::Image("");
    }
    if let Some(rest) = line
        .strip_prefix(IMAGE)
        .and_then(|r| r.strip_prefix([' ', '\t']))
    {
        let rest = rest.trim();
        // A terminal's drag and drop quotes a path with spaces.
        let unquoted = ['\'', '"'].iter().find_map(|&q| {
            rest.strip_prefix(q)
                .and_then(|r| r.strip_suffix(q))
                .filter(|r| !r.is_empty())
        });
        return Line::Image(unquoted.unwrap_or(rest));
    }
    if line.is_empty() {
        Line::Empty
    } else {
        Line::Message(line)
    }
}

/// Reads and prepares an image file for the tower.
pub(super) fn load_image(tower: &nextn_vision::VisionTower, path: &Path) -> Result<ImageInput> {
    prepare_image(tower, path, &read_image(path)?)
}

/// The bytes of an image file.
pub(super) fn read_image(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))
}

/// Decodes and prepares the bytes of the image file `path` for the tower.
pub(super) fn prepare_image(
    tower: &nextn_vision::VisionTower,
    path: &Path,
    bytes: &[u8],
) -> Result<ImageInput> {
    let rgb = nextn_vision::decode_image(bytes, &path.display().to_string())?;
    Ok(ImageInput::new(tower, &rgb))
}

pub fn chat(
    args: &Args,
    loaded: &Loaded,
    engine: EngineRef<'_>,
    first_images: Vec<ImageInput>,
    sampler: SamplerConfig,
    spec: SpecConfig,
    kwargs: &serde_json::Map<String, serde_json::Value>,
) -> Result<ExitCode> {
    let budget = common::available_memory().unwrap_or(8 << 30) / 4;
    let mut scheduler = Scheduler::new(
        engine,
        SchedulerConfig {
            n_slots: 1,
            n_ctx_slot: loaded.n_ctx,
            k_type: loaded.k_type,
            v_type: loaded.v_type,
            n_batch: args.batch_size.max(1),
            queue_capacity: 1,
            spec: engine.head.is_some().then_some(spec),
            policy: DraftPolicy::ALWAYS,
            calibrate: false,
            prefix_cache: Some(PrefixCacheConfig {
                budget_bytes: usize::try_from(budget).unwrap_or(usize::MAX),
                snapshot_every: 0,
            }),
        },
    );
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        let image = if engine.vision.is_some() {
            "; /image PATH attaches a picture to the next message"
        } else {
            ""
        };
        eprintln!("chat with the model: one line per turn{image}; /clear forgets the conversation; /exit or end of input (Ctrl-D) ends it");
    }
    let system: Vec<ChatMessage> = args
        .system_prompt
        .iter()
        .map(|s| ChatMessage::new("system", s))
        .collect();
    let mut messages = system.clone();
    // The images of the messages so far, in order, and those for the next user message.
    let mut images: Vec<ImageInput> = Vec::new();
    let mut pending = first_images;
    let mut compiler = None;
    let mut lines = std::io::stdin().lock().lines();
    loop {
        if interactive {
            eprint!("> ");
            let _ = std::io::stderr().flush();
        }
        let Some(line) = lines.next() else {
            break;
        };
        let line = line?;
        let user = match parse_line(&line) {
            Line::Exit => break,
            Line::Empty => continue,
            Line::Clear => {
                messages = system.clone();
                images.clear();
                pending.clear();
                eprintln!("conversation cleared");
                continue;
            }
            Line::Image(path) => {
                match (engine.vision, path) {
                    (None, _) => eprintln!("error: /image needs a vision projector: start with --mmproj FILE (an -hf model's is found beside it)"),
                    (Some(_), "") => eprintln!("error: /image needs a file: /image PATH"),
                    (Some(tower), path) => match load_image(tower, Path::new(path)) {
                        Ok(img) => {
                            pending.push(img);
                            eprintln!("{path}: image loaded ({} for the next message)", pending.len());
                        }
                        Err(e) => eprintln!("error: /image {path}: {e:#}"),
                    },
                }
                continue;
            }
            Line::Message(text) => text,
        };
        let content = IMAGE_PLACEHOLDER.repeat(pending.len()) + user;
        messages.push(ChatMessage::new("user", &content));
        let prompt = loaded.template.render(&messages, true, kwargs)?;
        let all_images: Vec<ImageInput> = images.iter().chain(&pending).cloned().collect();
        let MultimodalPrompt {
            tokens,
            images: prompt_images,
        } = match MultimodalPrompt::tokenize(&loaded.tokenizer, &prompt, true, all_images) {
            Ok(p) => p,
            Err(e) => {
                messages.pop();
                eprintln!("error: the message is not sent: {e}");
                continue;
            }
        };
        let grammar = common::with_reasoning_budget(
            &mut compiler,
            loaded,
            None,
            args.reasoning_budget,
            &args.reasoning_budget_message,
            &prompt,
        )?;
        let cache_points: Vec<usize> = final_header(&loaded.tokenizer, &tokens)
            .into_iter()
            .collect();
        let (events, received) = mpsc::channel();
        scheduler.submit(Request {
            prompt: tokens,
            sampler: sampler.clone(),
            n_predict: (args.n_predict >= 0).then_some(args.n_predict as usize),
            stop: args.stop.clone(),
            ignore_eos: args.ignore_eos,
            trace: false,
            grammar,
            logprobs: None,
            cache_prompt: true,
            cache_points,
            forced_acceptance: None,
            images: prompt_images,
            prompt_progress: progress_on_terminal(),
            sink: Box::new(Stdout::new(true, events)),
        });
        scheduler.run();
        let completion = loop {
            match received.try_recv() {
                Ok(Event::Done(c)) => break Some(c),
                Ok(Event::Failed { message, .. }) if !pending.is_empty() => {
                    // Most likely the pictures do not fit: the message goes without a trace.
                    eprintln!(
                        "error: {message} (the message and its {} image(s) are dropped)",
                        pending.len()
                    );
                    break None;
                }
                Ok(Event::Failed { message, .. }) => bail!("{message}"),
                Ok(_) => continue,
                Err(_) => bail!("generation ended without a result"),
            }
        };
        let Some(completion) = completion else {
            messages.pop();
            pending.clear();
            continue;
        };
        images.append(&mut pending);
        println!();
        let answer = loaded.tokenizer.decode(&completion.tokens);
        messages.push(ChatMessage::new("assistant", answer.trim_end()));
        let t = &completion.timings;
        let encoded = if t.images_encoded > 0 {
            format!(
                ", {} image(s) encoded in {:.1} ms",
                t.images_encoded, t.image_encode_ms
            )
        } else {
            String::new()
        };
        eprintln!(
            "[prompt {} tokens, {} of them from the previous turns{encoded}; {} tokens at {:.1} tok/s]",
            completion.prompt_tokens,
            t.cache_n,
            t.predicted_n,
            t.predicted_per_second()
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::{parse_line, Line};

    #[test]
    fn lines_are_commands_or_messages() {
        assert_eq!(parse_line("  /quit "), Line::Exit);
        assert_eq!(parse_line("/exit"), Line::Exit);
        assert_eq!(parse_line("/clear"), Line::Clear);
        assert_eq!(parse_line("/image"), Line::Image(""));
        assert_eq!(parse_line("/image  a b.png "), Line::Image("a b.png"));
        assert_eq!(
            parse_line("/image '/tmp/a b.png'"),
            Line::Image("/tmp/a b.png")
        );
        assert_eq!(parse_line("/image \"x.png\""), Line::Image("x.png"));
        assert_eq!(
            parse_line("/images of cats"),
            Line::Message("/images of cats")
        );
        assert_eq!(parse_line("   "), Line::Empty);
        assert_eq!(parse_line(" hi "), Line::Message("hi"));
    }
}
