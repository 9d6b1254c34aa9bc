//! `nextn run -cnv` (or `--chat` without `-p`): an interactive chat on the terminal, as
//! llama-cli's default mode. Each line read from stdin is a user turn; the conversation is
//! rendered with the model's chat template and the answer streams to stdout. The conversation's
//! state stays between turns (the slot keeps it and the prefix cache keeps the state before each
//! answer), so a turn prefills only what is new.

use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;
use std::sync::mpsc;

use anyhow::{bail, Result};
use nextn_engine::chat::{final_header, ChatMessage};
use nextn_engine::sampler::SamplerConfig;
use nextn_engine::scheduler::{
    DraftPolicy, EngineRef, Event, PrefixCacheConfig, Request, Scheduler, SchedulerConfig,
};
use nextn_engine::speculative::SpecConfig;

use super::common::{self, Loaded};
use super::run::{progress_on_terminal, Args, Stdout};

/// A line that ends the conversation (besides end of input).
const EXIT: &[&str] = &["/exit", "/quit"];

pub fn chat(
    args: &Args,
    loaded: &Loaded,
    engine: EngineRef<'_>,
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
        eprintln!("chat with the model: one line per turn; /exit or end of input (Ctrl-D) ends it");
    }
    let mut messages = Vec::new();
    if let Some(s) = &args.system_prompt {
        messages.push(ChatMessage::new("system", s));
    }
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
        let user = line.trim();
        if EXIT.contains(&user) {
            break;
        }
        if user.is_empty() {
            continue;
        }
        messages.push(ChatMessage::new("user", user));
        let prompt = loaded.template.render(&messages, true, kwargs)?;
        let tokens = loaded.tokenizer.encode(&prompt, true);
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
            images: Vec::new(),
            prompt_progress: progress_on_terminal(),
            sink: Box::new(Stdout::new(true, events)),
        });
        scheduler.run();
        let completion = loop {
            match received.try_recv() {
                Ok(Event::Done(c)) => break c,
                Ok(Event::Failed { message, .. }) => bail!("{message}"),
                Ok(_) => continue,
                Err(_) => bail!("generation ended without a result"),
            }
        };
        println!();
        let answer = loaded.tokenizer.decode(&completion.tokens);
        messages.push(ChatMessage::new("assistant", answer.trim_end()));
        let t = &completion.timings;
        eprintln!(
            "[prompt {} tokens, {} of them from the previous turns; {} tokens at {:.1} tok/s]",
            completion.prompt_tokens,
            t.cache_n,
            t.predicted_n,
            t.predicted_per_second()
        );
    }
    Ok(ExitCode::SUCCESS)
}
