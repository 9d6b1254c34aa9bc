//! `nextn`: Qwen3.5 / Qwen3.6 GGUF inference with MTP speculative decoding.

// Every unsafe operation sits in its own block with a SAFETY comment saying why it is sound,
// unsafe functions included.
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

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
    /// List the GPUs the device backend can use (as llama.cpp's --list-devices) and exit.
    #[arg(long = "list-devices")]
    list_devices: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Show a GGUF model: architecture, hyper-parameters, tensor types, tokenizer, NextN head.
    Inspect(cmd::inspect::Args),
    /// Check that a file is a qwen35/qwen35moe model with a complete NextN head that loads and runs
    /// (exit 0: usable; 1: valid GGUF but unusable, every problem listed; 2: not a valid GGUF).
    Verify(cmd::verify::Args),
    /// Generate text from a prompt.
    Run(cmd::run::Args),
    /// Print the model's logits for every position of a prompt (text lines, or one JSON object with --json).
    Logits(cmd::logits::Args),
    /// Plain vs MTP speculative decoding at several draft depths, with the cost model behind it.
    Bench(cmd::bench::Args),
    /// Write a random-weight Qwen3.5/3.6 GGUF with real shapes and the real tokenizer (presets 0.8b, 27b, 35b-a3b, ...).
    Synth(cmd::synth::Args),
    /// Re-quantize a model with llama-quantize's types, mixes and flags, the NextN block's type
    /// under control (--keep-nextn-type, --tensor-type).
    Quantize(cmd::quantize::Args),
    /// One file from the trunk of a model and the NextN (MTP) block of another file of the same model.
    Graft(cmd::graft::Args),
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
    if cli.list_devices {
        return cmd::common::list_devices();
    }
    let Some(command) = cli.command else {
        eprintln!("error: a command is needed (nextn --help lists them)");
        return ExitCode::from(2);
    };
    let result = match command {
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Verify(a) => cmd::verify::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::Logits(a) => cmd::logits::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Synth(a) => cmd::synth::run(a),
        Command::Quantize(a) => cmd::quantize::run(a),
        Command::Graft(a) => cmd::graft::run(a),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &str) -> Command {
        let args =
            std::iter::once("nextn".to_string()).chain(line.split_whitespace().map(str::to_string));
        match Cli::try_parse_from(cmd::common::normalize_args(args)) {
            Ok(Cli {
                command: Some(c), ..
            }) => c,
            Ok(_) => panic!("`{line}` names no command"),
            Err(e) => panic!("`{line}` was refused: {e}"),
        }
    }

    fn serve(line: &str) -> cmd::serve::Args {
        match parse(line) {
            Command::Serve(a) => a,
            _ => panic!("`{line}` is not serve"),
        }
    }

    fn run(line: &str) -> cmd::run::Args {
        match parse(line) {
            Command::Run(a) => a,
            _ => panic!("`{line}` is not run"),
        }
    }

    /// llama-server command lines as their users write them, with what each flag must mean.
    #[test]
    fn llama_server_command_lines_keep_their_meaning() {
        let a = serve(
            "serve -m q.gguf -ngl 99 -fa on -c 32768 -np 4 --jinja --host 0.0.0.0 --port 8081",
        );
        assert_eq!(
            a.model.model.as_deref(),
            Some(std::path::Path::new("q.gguf"))
        );
        assert_eq!(a.model.cpu_only.n_gpu_layers.as_deref(), Some("99"));
        assert_eq!(a.model.cpu_only.flash_attn.as_deref(), Some("on"));
        assert_eq!(a.model.ctx_size, Some(32768));
        assert_eq!(a.parallel, 4);
        assert!(a.model.jinja);
        assert_eq!((a.host.as_str(), a.port), ("0.0.0.0", 8081));

        let a = serve(
            "serve -m q.gguf --temp 0.6 --top-k 20 --top-p 0.95 --min-p 0 -n 4096 --metrics \
             --alias qwen -ctk f16 -ctv f32 -ub 512 -b 2048 -tb 8 -t 8 -cb -kvu -cram 4096 \
             --reasoning-budget 0 --no-mmap --mlock --chat-template-file t.jinja -s 42",
        );
        assert_eq!(a.sampling.temp, 0.6);
        assert_eq!(a.sampling.top_k, 20);
        assert_eq!(a.sampling.min_p, 0.0);
        assert_eq!(a.sampling.seed, 42);
        assert_eq!(a.n_predict, 4096);
        assert!(a.metrics && a.cont_batching && a.kv_unified);
        assert_eq!(a.alias.as_deref(), Some("qwen"));
        assert_eq!(
            (a.model.cache_type_k.as_str(), a.model.cache_type_v.as_str()),
            ("f16", "f32")
        );
        assert_eq!(a.model.cpu_only.ubatch_size, Some(512));
        assert_eq!(a.batch_size, 2048);
        assert_eq!(a.model.cpu_only.threads_batch, Some(8));
        assert_eq!(a.model.threads, Some(8));
        assert_eq!(a.cache_ram, Some(4096));
        assert_eq!(a.reasoning_budget, 0);
        assert!(a.model.no_mmap && a.model.mlock);
        assert_eq!(
            a.model.chat_template_file.as_deref(),
            Some(std::path::Path::new("t.jinja"))
        );

        let a =
            serve("serve -m q.gguf --cache-ram -1 -fa auto -nocb -no-kvu --slot-save-path /tmp/s");
        assert_eq!(a.cache_ram, Some(-1));
        assert_eq!(a.model.cpu_only.flash_attn.as_deref(), Some("auto"));
        assert!(a.no_cont_batching && a.no_kv_unified);
        // `-fa` alone means on, as in llama.cpp.
        let a = serve("serve -fa --port 9000");
        assert_eq!(a.model.cpu_only.flash_attn.as_deref(), Some("on"));
        assert_eq!(a.port, 9000);

        let r = run("run -m q.gguf -ngl 99 -fa on -p hello -n 64 --temp 0.7");
        assert_eq!(r.model.cpu_only.n_gpu_layers.as_deref(), Some("99"));
        assert_eq!(r.prompt.as_deref(), Some("hello"));
        assert_eq!(r.n_predict, 64);
        assert!(r.file.is_none());
        let r = run("run -m q.gguf -cnv -sys be-brief -p hi");
        assert!(r.chat);
        assert_eq!(r.system_prompt.as_deref(), Some("be-brief"));
        let r = run("run -m q.gguf -no-cnv -p hi --chat-template chatml");
        assert!(!r.chat && r.no_conversation);
        assert_eq!(r.model.chat_template.as_deref(), Some("chatml"));
        // A prompt that looks like a flag stays the prompt.
        let r = run("run -p -fa -n 1");
        assert_eq!(r.prompt.as_deref(), Some("-fa"));
        assert!(r.model.cpu_only.flash_attn.is_none());
    }

    /// The connection limits: defaults, llama-server's `-to` for both the header-read and the
    /// write timeout where those flags are not given, and values refused.
    #[test]
    fn connection_limits() {
        use std::time::Duration;
        let l = cmd::serve::limits(&serve("serve -m q.gguf")).unwrap();
        assert_eq!(l.header_read, Duration::from_secs(10));
        assert_eq!(l.idle, Duration::from_secs(75));
        assert_eq!(l.write_stall, Duration::from_secs(60));
        assert!(l.max_connections >= 1 && l.max_connections <= 1024);

        let a = serve(
            "serve -m q.gguf -to 30 --timeout-write 5 --timeout-idle 2.5 --max-connections 8",
        );
        assert_eq!(a.timeout, Some(30.0));
        let l = cmd::serve::limits(&a).unwrap();
        assert_eq!(l.header_read, Duration::from_secs(30));
        assert_eq!(l.write_stall, Duration::from_secs(5));
        assert_eq!(l.idle, Duration::from_millis(2500));
        assert_eq!(l.max_connections, 8);
        let l = cmd::serve::limits(&serve("serve --timeout 7 --timeout-header-read 3")).unwrap();
        assert_eq!(
            (l.header_read, l.write_stall),
            (Duration::from_secs(3), Duration::from_secs(7))
        );

        for line in [
            "serve -to 0",
            "serve --timeout-idle 0",
            "serve --timeout-header-read 1e300",
            "serve --timeout-write NaN",
            "serve --max-connections 0",
        ] {
            assert!(
                cmd::serve::limits(&serve(line)).is_err(),
                "`{line}` was accepted"
            );
        }
        // `-to` is a flag only where serve's flags are.
        assert!(Cli::try_parse_from(cmd::common::normalize_args(
            ["nextn", "run", "-to", "5"].map(String::from).into_iter()
        ))
        .is_err());
    }

    /// Image URLs are refused unless `--allow-image-urls`; its limits default to llama-server's
    /// and need the flag.
    #[test]
    fn image_url_flags() {
        use nextn_server::image_url::{AddressPolicy, ImageUrlLimits};
        use std::time::Duration;
        assert_eq!(
            cmd::serve::image_urls(&serve("serve -m q.gguf")).unwrap(),
            None
        );
        assert_eq!(
            cmd::serve::image_urls(&serve("serve --allow-image-urls")).unwrap(),
            Some(ImageUrlLimits {
                max_bytes: 10 << 20,
                timeout: Duration::from_secs(10),
                max_urls: 8,
                addresses: AddressPolicy::PublicOnly,
            })
        );
        let a = serve(
            "serve --allow-image-urls --image-url-max-bytes 4096 --image-url-timeout 2.5 --image-urls-max 2",
        );
        assert_eq!(
            cmd::serve::image_urls(&a).unwrap(),
            Some(ImageUrlLimits {
                max_bytes: 4096,
                timeout: Duration::from_millis(2500),
                max_urls: 2,
                addresses: AddressPolicy::PublicOnly,
            })
        );
        let all = serve("serve --allow-image-urls --image-url-allow-private");
        assert_eq!(
            cmd::serve::image_urls(&all).unwrap().unwrap().addresses,
            AddressPolicy::Any
        );
        let some =
            serve("serve --allow-image-urls --image-url-allow-private=127.0.0.1/32,fd00::/8");
        assert_eq!(
            cmd::serve::image_urls(&some).unwrap().unwrap().addresses,
            AddressPolicy::parse_allowed("127.0.0.1/32,fd00::/8").unwrap()
        );
        for line in [
            "serve --allow-image-urls --image-url-max-bytes 0",
            "serve --allow-image-urls --image-url-timeout 0",
            "serve --allow-image-urls --image-url-timeout NaN",
            "serve --allow-image-urls --image-urls-max 0",
            "serve --allow-image-urls --image-url-allow-private=10.0.0.0/33",
            "serve --allow-image-urls --image-url-allow-private=intranet",
        ] {
            assert!(
                cmd::serve::image_urls(&serve(line)).is_err(),
                "`{line}` was accepted"
            );
        }
        for line in [
            "serve --image-url-max-bytes 4096",
            "serve --image-url-timeout 5",
            "serve --image-urls-max 2",
            "serve --image-url-allow-private",
            "serve --image-url-allow-private=10.0.0.0/8",
        ] {
            let args = std::iter::once("nextn".to_string())
                .chain(line.split_whitespace().map(str::to_string));
            assert!(
                Cli::try_parse_from(cmd::common::normalize_args(args)).is_err(),
                "`{line}` was accepted without --allow-image-urls"
            );
        }
    }

    /// clap's own consistency checks of every subcommand's arguments (names, conflicts,
    /// requirements), which only debug builds run on their own.
    #[test]
    fn the_command_line_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn misspelled_values_are_refused() {
        for line in ["serve -fa maybe", "run -ngl", "serve --cache-ram lots"] {
            let args = std::iter::once("nextn".to_string())
                .chain(line.split_whitespace().map(str::to_string));
            assert!(
                Cli::try_parse_from(cmd::common::normalize_args(args)).is_err(),
                "`{line}` was accepted"
            );
        }
    }
}
