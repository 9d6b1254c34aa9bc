//! `nextn`: Qwen3.5 / Qwen3.6 GGUF inference with MTP speculative decoding.

mod cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "nextn",
    version,
    about = "Qwen3.5/3.6 GGUF inference with built-in MTP (NextN) speculative decoding"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show a GGUF model: architecture, hyper-parameters, tensor types, tokenizer, NextN head.
    Inspect(cmd::inspect::Args),
    /// Check that a file is a qwen35/qwen35moe model with a complete NextN head
    /// (exit 0: usable; 1: valid GGUF but unusable for MTP; 2: not a valid GGUF).
    Verify(cmd::verify::Args),
    /// Generate text from a prompt.
    Run(cmd::run::Args),
    /// Print the model's logits for every position of a prompt (text lines, or one JSON object with --json).
    Logits(cmd::logits::Args),
    /// Plain vs MTP speculative decoding at several draft depths, with the cost model behind it.
    Bench(cmd::bench::Args),
    /// Write a random-weight Qwen3.5/3.6 GGUF with real shapes and the real tokenizer (presets 0.8b, 27b, 35b-a3b, ...).
    Synth(cmd::synth::Args),
    /// OpenAI-compatible HTTP server with continuous batching and MTP drafting per slot.
    Serve(cmd::serve::Args),
    /// Count token frequencies of text files with a model's tokenizer: the ranking for --spec-draft-vocab.
    VocabStats(cmd::vocab_stats::Args),
}

fn main() -> ExitCode {
    #[cfg(unix)]
    // SAFETY: called before any other thread exists; only resets a signal disposition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse_from(cmd::common::normalize_args(std::env::args()));
    let result = match cli.command {
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Verify(a) => cmd::verify::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::Logits(a) => cmd::logits::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Synth(a) => cmd::synth::run(a),
        Command::VocabStats(a) => cmd::vocab_stats::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
