//! `nextn vocab-stats`: token frequencies of text files under a model's tokenizer, written as the
//! ranking a trimmed draft head (`--spec-draft-vocab N`) keeps the top of; plus choosing the
//! draft vocabulary (shipped ranking, user ranking, or BPE merge order) for `run`, `serve`,
//! `logits --mtp` and `bench`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use nextn_engine::tokenizer::Tokenizer;
use nextn_gguf::GgufFile;
use nextn_model::draft_vocab::TokenRanking;
use nextn_model::NextnHead;

use super::common;

/// Ranking shipped for the Qwen3.5 / Qwen3.6 tokenizer (vocabulary 248,320), written by
/// `nextn vocab-stats --binary` from a mixed offline corpus of code and prose (see README).
const QWEN35_RANKING: &[u8] = include_bytes!("../../../../models/qwen35-token-ranking.bin");
const QWEN35_RANKING_NAME: &str = "models/qwen35-token-ranking.bin";

/// How many tokens each shipped/written binary ranking's header checks against the tokenizer.
const N_CHECKS: usize = 8;

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
    pub fn ids(&self, loaded: &common::Loaded) -> Result<Option<(Vec<u32>, String)>> {
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
    pub fn apply(&self, loaded: &common::Loaded, head: &mut NextnHead) -> Result<()> {
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

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model whose tokenizer is used (weights are not read); defaults to the bundled model
    #[arg(short = 'm', long = "model", value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// Text files to count; directories are walked recursively (files that are not UTF-8 are skipped)
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,
    /// Output ranking
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: PathBuf,
    /// Write only the N most frequent tokens
    #[arg(long, value_name = "N")]
    pub top: Option<usize>,
    /// Write the compact binary form (u32 ids, with token strings that identify the tokenizer)
    /// instead of text; only tokens seen at least once
    #[arg(long)]
    pub binary: bool,
    /// Skip files larger than this many bytes
    #[arg(long = "max-file-bytes", default_value_t = 8 << 20)]
    pub max_file_bytes: u64,
}

fn collect_files(p: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let meta =
        std::fs::symlink_metadata(p).with_context(|| format!("cannot read {}", p.display()))?;
    if meta.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(p)
            .with_context(|| format!("cannot list {}", p.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for e in entries {
            // Unreadable entries deep in a tree are skipped rather than failing the whole count.
            let _ = collect_files(&e, out);
        }
    } else if meta.is_file() {
        out.push(p.to_path_buf());
    }
    Ok(())
}

struct Counts {
    counts: Vec<u64>,
    files: usize,
    skipped: usize,
    bytes: u64,
}

fn count_files(tok: &Tokenizer, files: &[PathBuf], max_bytes: u64) -> Counts {
    let mut c = Counts {
        counts: vec![0; tok.vocab_size()],
        files: 0,
        skipped: 0,
        bytes: 0,
    };
    for f in files {
        let text = match std::fs::metadata(f) {
            Ok(m) if m.len() <= max_bytes => std::fs::read(f)
                .ok()
                .and_then(|b| String::from_utf8(b).ok()),
            _ => None,
        };
        let Some(text) = text else {
            c.skipped += 1;
            continue;
        };
        for id in tok.encode(&text, false) {
            if let Some(n) = c.counts.get_mut(id as usize) {
                *n += 1;
            }
        }
        c.files += 1;
        c.bytes += text.len() as u64;
    }
    c
}

pub fn run(args: Args) -> Result<ExitCode> {
    let path = common::resolve_model_path(args.model.as_ref())?;
    let file = GgufFile::open(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let tok =
        Tokenizer::from_gguf(&file).with_context(|| format!("tokenizer of {}", path.display()))?;
    let n_vocab = tok.vocab_size();
    let mut files = Vec::new();
    for p in &args.files {
        collect_files(p, &mut files)?;
    }
    if files.is_empty() {
        bail!("no files to count under {:?}", args.files);
    }
    let t0 = Instant::now();
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let chunk = files.len().div_ceil(threads);
    let parts: Vec<Counts> = std::thread::scope(|s| {
        let handles: Vec<_> = files
            .chunks(chunk)
            .map(|c| s.spawn(|| count_files(&tok, c, args.max_file_bytes)))
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    if parts.len() != files.chunks(chunk).count() {
        bail!("a counting thread failed");
    }
    let mut total = Counts {
        counts: vec![0; n_vocab],
        files: 0,
        skipped: 0,
        bytes: 0,
    };
    for p in parts {
        total
            .counts
            .iter_mut()
            .zip(&p.counts)
            .for_each(|(a, b)| *a += b);
        total.files += p.files;
        total.skipped += p.skipped;
        total.bytes += p.bytes;
    }
    if total.files == 0 {
        bail!(
            "none of the {} files could be read as UTF-8 text",
            files.len()
        );
    }
    let n_tokens: u64 = total.counts.iter().sum();
    let mut order: Vec<u32> = (0..n_vocab as u32).collect();
    order.sort_by(|&a, &b| {
        total.counts[b as usize]
            .cmp(&total.counts[a as usize])
            .then(a.cmp(&b))
    });
    let top = args.top.unwrap_or(n_vocab).min(n_vocab);
    order.truncate(top);
    let sources: Vec<String> = args.files.iter().map(|p| p.display().to_string()).collect();
    if args.binary {
        order.retain(|&id| total.counts[id as usize] > 0);
        let checks = order
            .iter()
            .take(N_CHECKS)
            .filter_map(|&id| tok.token_text(id).map(|t| (id, t.to_string())))
            .collect();
        let r = TokenRanking {
            ids: order.clone(),
            n_vocab: Some(n_vocab),
            checks,
            origin: args.output.display().to_string(),
        };
        std::fs::write(&args.output, r.to_binary(n_vocab))
            .with_context(|| format!("cannot write {}", args.output.display()))?;
    } else {
        let mut out = Vec::with_capacity(order.len() * 12 + 512);
        writeln!(
            out,
            "# nextn vocab-stats: token ids by descending count, from {} files ({} bytes, {} tokens; {} skipped) tokenized with {} (vocab {n_vocab})",
            total.files, total.bytes, n_tokens, total.skipped, path.display()
        )?;
        writeln!(out, "# sources: {}", sources.join(" "))?;
        writeln!(out, "# id count")?;
        for &id in &order {
            writeln!(out, "{id} {}", total.counts[id as usize])?;
        }
        std::fs::write(&args.output, out)
            .with_context(|| format!("cannot write {}", args.output.display()))?;
    }
    let seen = total.counts.iter().filter(|&&c| c > 0).count();
    eprintln!(
        "vocab-stats: {} files ({:.1} MiB, {} skipped), {n_tokens} tokens, {seen} of {n_vocab} ids seen, in {:.1} s; wrote {} ids to {}",
        total.files,
        total.bytes as f64 / (1 << 20) as f64,
        total.skipped,
        t0.elapsed().as_secs_f64(),
        order.len(),
        args.output.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// `nextn bench` with a trimmed draft head: its draft step against the full one, the projected
/// speedup with it, and its acceptance next to the full head's.
pub mod bench_report {
    use std::time::Instant;

    use anyhow::Result;
    use nextn_engine::speculative::SpecStats;
    use nextn_model::{LogitRows, NextnHead};
    use serde_json::{json, Value};

    use crate::cmd::common::Loaded;

    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    }

    /// Median times at the context of `prompt`: one draft step of `head` (one row, logits of the
    /// last), its LM-head part alone (full-vocabulary-shaped logits), and for a trimmed head the
    /// product over the kept rows alone (the rest of the LM-head part is the −∞ fill and scatter).
    pub fn draft_step_ms(
        loaded: &Loaded,
        head: &NextnHead,
        prompt: &[u32],
        reps: usize,
    ) -> Result<(f64, f64, f64)> {
        let pool = &loaded.pool;
        let model = &loaded.model;
        let e = model.config.n_embd;
        let mut st = loaded.new_sequence();
        let out = model.forward(prompt, &mut st, LogitRows::None, pool)?;
        let mut cache = head.new_cache(loaded.k_type, loaded.v_type);
        let mut teacher = vec![0.0f32; e];
        teacher.extend_from_slice(&out.hidden[..(prompt.len() - 1) * e]);
        head.forward(prompt, &teacher, 0, &mut cache, LogitRows::None, pool)?;
        let h_last = &out.hidden[(prompt.len() - 1) * e..];
        let (mut step, mut lm, mut kept) = (Vec::new(), Vec::new(), Vec::new());
        let mut kept_out = vec![0.0f32; head.draft_vocab_size()];
        for _ in 0..reps.max(1) {
            let t = Instant::now();
            head.forward(
                &prompt[..1],
                h_last,
                prompt.len(),
                &mut cache,
                LogitRows::Last,
                pool,
            )?;
            step.push(t.elapsed().as_secs_f64() * 1e3);
            NextnHead::truncate(&mut cache, prompt.len());
            let t = Instant::now();
            head.lm_head_logits(h_last, 1, pool)?;
            lm.push(t.elapsed().as_secs_f64() * 1e3);
            if let Some(d) = head.draft_vocab() {
                let t = Instant::now();
                d.forward_kept(h_last, 1, &mut kept_out, pool)?;
                kept.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        let kept_ms = if kept.is_empty() {
            f64::NAN
        } else {
            median(kept)
        };
        Ok((median(step), median(lm), kept_ms))
    }

    /// Speedup projected at per-position acceptance `acceptance` with `n` drafts per step.
    pub fn project(
        decode_ms: f64,
        verify_ms: &[f64],
        draft_ms: f64,
        acceptance: &[f64],
        n: usize,
    ) -> Option<(f64, f64)> {
        let a = |i: usize| {
            acceptance
                .get(i)
                .or(acceptance.last())
                .copied()
                .unwrap_or(0.0)
        };
        let tokens = 1.0 + (0..n).map(a).sum::<f64>();
        let verify = verify_ms.get(n)?;
        Some((tokens, tokens * decode_ms / (n as f64 * draft_ms + verify)))
    }

    /// Print the trimmed head's cost lines and projection; returns them as JSON.
    #[allow(clippy::too_many_arguments)]
    pub fn costs(
        loaded: &Loaded,
        trimmed: &NextnHead,
        prompt: &[u32],
        reps: usize,
        decode_ms: f64,
        verify_ms: &[f64],
        full_draft_ms: f64,
        acceptance: &[f64],
        max_n: usize,
    ) -> Result<Value> {
        let (ms, lm_ms, kept_ms) = draft_step_ms(loaded, trimmed, prompt, reps)?;
        let n = trimmed.draft_vocab_size();
        println!(
            "  draft step (vocab {n:>6})  {ms:8.3} ms  ({:.2}x decode; full vocab {:.2}x; its LM head {lm_ms:.3} ms = rows {kept_ms:.3} ms + -inf fill {:.3} ms)",
            ms / decode_ms,
            full_draft_ms / decode_ms,
            lm_ms - kept_ms
        );
        println!(
            "projected speedup with the trimmed head (vocab {n}) at acceptance {acceptance:?}:"
        );
        let mut proj = Vec::new();
        for k in 1..=max_n.max(1) {
            let Some((tokens, speedup)) = project(decode_ms, verify_ms, ms, acceptance, k) else {
                break;
            };
            println!("  n_max {k}: {tokens:.2} tokens/step, {speedup:.3}x");
            proj.push(json!({"n_max": k, "tokens_per_step": tokens, "speedup": speedup}));
        }
        Ok(json!({
            "draft_vocab": n,
            "draft_ms": ms,
            "draft_lm_head_ms": lm_ms,
            "draft_lm_rows_ms": kept_ms,
            "draft_x_decode": ms / decode_ms,
            "projections": proj,
        }))
    }

    /// Acceptance of the trimmed head next to the full head's at each depth; `run` does one
    /// measured pass with the trimmed head at depth `k` and returns its stats and decode tok/s.
    pub fn acceptance(
        trimmed: &NextnHead,
        full: &[(usize, String, SpecStats, f64)],
        mut run: impl FnMut(&NextnHead, usize, &str) -> Result<(SpecStats, f64)>,
    ) -> Result<Value> {
        let n = trimmed.draft_vocab_size();
        let per_pos = |s: &SpecStats| {
            s.accepted_per_pos
                .iter()
                .zip(&s.drafted_per_pos)
                .map(|(&a, &d)| format!("{:.2}", if d > 0 { a as f64 / d as f64 } else { 0.0 }))
                .collect::<Vec<_>>()
                .join(" ")
        };
        println!();
        println!(
            "acceptance cost of the trimmed draft head (vocab {n} of {}):",
            trimmed.n_vocab()
        );
        let mut rows = Vec::new();
        for (k, mode, full_stats, full_tps) in full.iter().filter(|r| r.0 > 0) {
            let (s, tps) = run(trimmed, *k, mode)?;
            println!(
                "  n_max {k} {mode:>6} full head:    acceptance {:.3}, len {:.3}, {full_tps:8.1} tok/s, per position {}",
                full_stats.acceptance_rate(),
                full_stats.mean_accepted_len(),
                per_pos(full_stats)
            );
            println!(
                "  n_max {k} {mode:>6} trimmed head: acceptance {:.3}, len {:.3}, {tps:8.1} tok/s, per position {}",
                s.acceptance_rate(),
                s.mean_accepted_len(),
                per_pos(&s)
            );
            rows.push(json!({
                "n_max": k,
                "draft_sampling": mode,
                "full_acceptance": full_stats.acceptance_rate(),
                "trimmed_acceptance": s.acceptance_rate(),
                "full_mean_len": full_stats.mean_accepted_len(),
                "trimmed_mean_len": s.mean_accepted_len(),
                "full_decode_tok_s": full_tps,
                "trimmed_decode_tok_s": tps,
            }));
        }
        Ok(json!(rows))
    }
}
