//! `nextn bench` with a trimmed draft head: its draft step against the full one, the projected
//! speedup with it, and its acceptance next to the full head's.

use std::time::Instant;

use anyhow::{bail, Result};
use nextn_engine::speculative::SpecStats;
use nextn_model::NextnHead;
use serde_json::{json, Value};

use super::depth::prefill;
use super::{median, project, time_draft_step, Policy, RunKind};
use crate::cmd::common::Loaded;

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
    let mut at = prefill(loaded, Some(head), prompt)?;
    let Some(cache) = at.head_cache.as_mut() else {
        bail!("no head cache was made");
    };
    let h_last = &at.h_last;
    let (mut step, mut lm, mut kept) = (Vec::new(), Vec::new(), Vec::new());
    let mut kept_out = vec![0.0f32; head.draft_vocab_size()];
    for _ in 0..reps.max(1) {
        step.push(time_draft_step(
            loaded,
            head,
            cache,
            prompt[0],
            h_last,
            prompt.len(),
        )?);
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
    println!("projected speedup with the trimmed head (vocab {n}) at acceptance {acceptance:?}:");
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
    full: &[(RunKind, SpecStats, f64)],
    plain_tps: Option<f64>,
    mut run: impl FnMut(&NextnHead, RunKind) -> Result<(SpecStats, f64)>,
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
    let vs_plain =
        |tps: f64| plain_tps.map_or(String::new(), |p| format!(" ({:.3}x plain)", tps / p));
    let mut rows = Vec::new();
    for (kind, full_stats, full_tps) in full.iter().filter(|r| r.0.policy != Policy::Plain) {
        let (s, tps) = run(trimmed, *kind)?;
        let policy = kind.policy;
        let (k, mode) = (policy.label(), kind.mode_name());
        println!(
            "  n_max {k} {mode:>7} full head:    acceptance {:.3}, len {:.3}, {full_tps:8.1} tok/s{}, per position {}",
            full_stats.acceptance_rate(),
            full_stats.mean_accepted_len(),
            vs_plain(*full_tps),
            per_pos(full_stats)
        );
        println!(
            "  n_max {k} {mode:>7} trimmed head: acceptance {:.3}, len {:.3}, {tps:8.1} tok/s{}, per position {}",
            s.acceptance_rate(),
            s.mean_accepted_len(),
            vs_plain(tps),
            per_pos(&s)
        );
        rows.push(json!({
            "n_max": policy.n_max(),
            "policy": policy.kind(),
            "draft_sampling": mode,
            "full_acceptance": full_stats.acceptance_rate(),
            "trimmed_acceptance": s.acceptance_rate(),
            "full_mean_len": full_stats.mean_accepted_len(),
            "trimmed_mean_len": s.mean_accepted_len(),
            "full_decode_tok_s": full_tps,
            "trimmed_decode_tok_s": tps,
            "full_speedup": plain_tps.map(|p| full_tps / p),
            "trimmed_speedup": plain_tps.map(|p| tps / p),
        }));
    }
    Ok(json!(rows))
}
