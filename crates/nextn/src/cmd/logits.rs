//! `nextn logits`: the target's logits for every position of a prompt, as JSON lines, for
//! cross-checking against llama.cpp and reference implementations.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use nextn_model::LogitRows;
use serde_json::json;

use super::common::{self, ModelArgs};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text (tokenized with special tokens parsed)
    #[arg(short = 'p', long = "prompt")]
    pub prompt: Option<String>,
    /// Read the prompt from a file
    #[arg(short = 'f', long = "file", conflicts_with = "prompt")]
    pub file: Option<PathBuf>,
    /// Token ids instead of text, comma separated
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["prompt", "file"])]
    pub tokens: Vec<u32>,
    /// Entries of the top list per row
    #[arg(long = "top-k", visible_alias = "top", default_value_t = 10)]
    pub top_k: usize,
    /// Also print the full logits vector of each row
    #[arg(long)]
    pub full: bool,
    /// Also print each row's final-norm hidden vector
    #[arg(long)]
    pub hidden: bool,
    /// Print one JSON object {"positions": [...]} instead of one line of text per position
    #[arg(long)]
    pub json: bool,
    /// Print the NextN head's teacher-forced rows instead (row p: token p with the target's hidden
    /// state of p−1, zeros at p = 0; predicts token p+1 like target row p)
    #[arg(long)]
    pub mtp: bool,
    /// MTP-only sidecar GGUF for --mtp
    #[arg(
        long = "spec-draft-model",
        visible_alias = "model-draft",
        requires = "mtp"
    )]
    pub draft_model: Option<PathBuf>,
    #[command(flatten)]
    pub draft_vocab: super::common::DraftVocabArgs,
    /// Rows per forward pass (default: the whole prompt in one pass)
    #[arg(short = 'b', long = "batch-size")]
    pub batch_size: Option<usize>,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let loaded = common::load(&args.model, false)?;
    let tokens = if !args.tokens.is_empty() {
        args.tokens.clone()
    } else {
        let text = super::common::prompt_text(&args.prompt, &args.file)?;
        loaded.tokenizer.encode(&text, true)
    };
    if tokens.is_empty() {
        bail!("the prompt is empty: give -p TEXT, -f FILE or --tokens IDS");
    }
    if tokens.len() > loaded.n_ctx {
        bail!(
            "the prompt has {} tokens, more than the context length {} (-c)",
            tokens.len(),
            loaded.n_ctx
        );
    }
    let head = if args.mtp {
        let spec = super::common::SpecArgs {
            spec_type: "nextn".into(),
            n_max: 1,
            n_min: 0,
            p_min: 0.0,
            draft_sampling: "coupled".into(),
            draft_model: args.draft_model.clone(),
            draft_vocab: args.draft_vocab.clone(),
        };
        Some(spec.load_head(&loaded)?)
    } else {
        if args.draft_vocab.draft_vocab.is_some() {
            bail!("--spec-draft-vocab applies to the NextN head's rows: add --mtp");
        }
        None
    };
    let mut state = loaded.new_sequence()?;
    let mut head_cache = head
        .as_ref()
        .map(|h| h.new_cache(loaded.k_type, loaded.v_type, loaded.n_ctx))
        .transpose()?;
    let batch = args.batch_size.unwrap_or(tokens.len()).max(1);
    let e = loaded.model.config.n_embd;
    let mut prev_hidden = vec![0.0f32; e];
    let mut pos = 0;
    let mut positions = Vec::new();
    for chunk in tokens.chunks(batch) {
        let target_rows = if head.is_some() {
            LogitRows::None
        } else {
            LogitRows::All
        };
        let mut out = loaded
            .model
            .forward(chunk, &mut state, target_rows, &loaded.pool)
            .with_context(|| format!("forward pass at position {pos}"))?;
        if let (Some(head), Some(cache)) = (&head, head_cache.as_mut()) {
            let n = chunk.len();
            let mut hprev = prev_hidden.clone();
            hprev.extend_from_slice(&out.hidden[..(n - 1) * e]);
            prev_hidden = out.hidden[(n - 1) * e..].to_vec();
            out = head
                .forward(chunk, &hprev, pos, cache, LogitRows::All, &loaded.pool)
                .with_context(|| format!("NextN head at position {pos}"))?;
        }
        for (i, &tok) in chunk.iter().enumerate() {
            let row = out.logits_row(i);
            let hidden = &out.hidden[i * e..(i + 1) * e];
            let v = row_json(pos, tok, row, hidden, args.top_k, args.full, args.hidden);
            if args.json {
                positions.push(v);
            } else {
                let top: Vec<String> = v["top"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|t| format!("{}:{:.4}", t[0], t[1].as_f64().unwrap_or(f64::NAN)))
                    .collect();
                println!(
                    "pos {:>5} token {:>6} argmax {:>6} lse {:>9.4} |h| {:>8.4} top {}",
                    pos,
                    tok,
                    v["argmax"],
                    v["lse"].as_f64().unwrap_or(f64::NAN),
                    v["hidden_norm"].as_f64().unwrap_or(f64::NAN),
                    top.join(" ")
                );
            }
            pos += 1;
        }
    }
    if args.json {
        let source = if head.is_some() { "mtp" } else { "target" };
        println!(
            "{}",
            serde_json::to_string(
                &json!({"source": source, "tokens": tokens, "positions": positions})
            )?
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// One row's summary in the shape of the golden files: argmax, log-sum-exp, top list.
pub fn row_json(
    pos: usize,
    token: u32,
    row: &[f32],
    hidden: &[f32],
    top: usize,
    full: bool,
    with_hidden: bool,
) -> serde_json::Value {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max as f64
        + row
            .iter()
            .map(|&v| ((v - max) as f64).exp())
            .sum::<f64>()
            .ln();
    let mut order: Vec<u32> = (0..row.len() as u32).collect();
    let k = top.min(row.len());
    if k > 0 {
        order.select_nth_unstable_by(k - 1, |&a, &b| {
            row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b))
        });
        order.truncate(k);
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    }
    let top_list: Vec<(u32, f32)> = order.iter().map(|&i| (i, row[i as usize])).collect();
    let argmax = nextn_engine::sampler::argmax(row);
    let hidden_l2 = hidden
        .iter()
        .map(|&v| (v as f64) * (v as f64))
        .sum::<f64>()
        .sqrt();
    let mut v = json!({
        "pos": pos,
        "token": token,
        "argmax": argmax,
        "lse": lse,
        "top": top_list,
        "hidden_norm": hidden_l2,
    });
    if full {
        v.as_object_mut()
            .expect("json object")
            .insert("logits".into(), json!(row));
    }
    if with_hidden {
        v.as_object_mut()
            .expect("json object")
            .insert("hidden".into(), json!(hidden));
    }
    v
}
