//! `nextn bench -d N[,N...]` (llama-bench's `--n-depth`): the passes of the speculative loop at a
//! context of N tokens — plain decode, verify of r rows and the draft step — after a real
//! prefill of N tokens, so that the cost of attention over a long cache shows as it does to an
//! agent deep into a conversation. With `--depth-fill M` only M tokens are prefilled and the
//! attention caches are filled up to N with copies of them ([`fill_to_depth`]).

use std::io::IsTerminal;
use std::time::Instant;

use anyhow::{bail, Result};
use nextn_model::{LayerCache, LogitRows, NextnHead, SequenceState};
use serde_json::{json, Value};

use super::{median, time_draft_step};
use crate::cmd::common::Loaded;

/// Rows per prefill pass, as plain generation uses.
pub const PREFILL_BATCH: usize = 512;

/// Where a long prefill has got to, on stderr: nothing for the first two seconds, then on a
/// terminal one line rewritten after every pass, elsewhere (a log) a line every ten seconds.
pub struct PrefillProgress {
    what: String,
    total: usize,
    start: Instant,
    last_line: Option<Instant>,
    tty: bool,
}

impl PrefillProgress {
    pub fn new(what: impl Into<String>, total: usize) -> Self {
        PrefillProgress {
            what: what.into(),
            total,
            start: Instant::now(),
            last_line: None,
            tty: std::io::stderr().is_terminal(),
        }
    }

    /// `done` of the tokens are prefilled.
    pub fn update(&mut self, done: usize) {
        let elapsed = self.start.elapsed().as_secs_f64();
        if elapsed < 2.0 || done >= self.total {
            return;
        }
        let line = format!(
            "{}: {done}/{} tokens prefilled, {elapsed:.0} s, {:.1} tok/s",
            self.what,
            self.total,
            done as f64 / elapsed
        );
        if self.tty {
            eprint!("\r\x1b[2K{line}");
            self.last_line = Some(Instant::now());
        } else if self
            .last_line
            .is_none_or(|t| t.elapsed().as_secs_f64() >= 10.0)
        {
            eprintln!("{line}");
            self.last_line = Some(Instant::now());
        }
    }

    /// Clear a terminal's progress line.
    pub fn finish(self) {
        if self.tty && self.last_line.is_some() {
            eprint!("\r\x1b[2K");
        }
    }
}

/// `len` prompt tokens: the given prompt repeated (real text, so MoE routing looks like real
/// routing).
pub fn synthetic_prompt(prompt: &[u32], len: usize) -> Vec<u32> {
    prompt.iter().cycle().take(len).copied().collect()
}

/// A sequence prefilled with some tokens in generation-sized passes, and the head's cache over
/// the same positions, each fed the target's hidden state of the position before (as the
/// generation loop feeds it), so that every pass can be timed at that context.
pub struct Prefilled {
    pub state: SequenceState,
    pub head_cache: Option<LayerCache>,
    /// The target's final hidden state of the last position (the next draft step's input).
    pub h_last: Vec<f32>,
    /// Milliseconds the target's prefill took.
    pub prefill_ms: f64,
    /// Milliseconds the head's pass over the same rows took (0 without a head).
    pub head_ms: f64,
}

pub fn prefill(loaded: &Loaded, head: Option<&NextnHead>, tokens: &[u32]) -> Result<Prefilled> {
    let (model, pool) = (&loaded.model, &loaded.pool);
    let e = model.config.n_embd;
    if tokens.is_empty() {
        bail!("a context of 0 tokens cannot be prefilled");
    }
    let mut state = loaded.new_sequence()?;
    state.check_room(tokens.len() + 8)?;
    let mut head_cache = head
        .map(|h| h.new_cache(loaded.k_type, loaded.v_type, loaded.n_ctx))
        .transpose()?;
    let mut h_prev = vec![0.0f32; e];
    let (mut prefill_ms, mut head_ms) = (0.0, 0.0);
    let mut progress = PrefillProgress::new("prefill", tokens.len());
    for (c, chunk) in tokens.chunks(PREFILL_BATCH).enumerate() {
        progress.update(c * PREFILL_BATCH);
        let start = c * PREFILL_BATCH;
        let t = Instant::now();
        let out = model.forward(chunk, &mut state, LogitRows::None, pool)?;
        prefill_ms += t.elapsed().as_secs_f64() * 1e3;
        if let (Some(head), Some(cache)) = (head, head_cache.as_mut()) {
            // Row i of the head takes the hidden state of position start + i − 1.
            let mut teacher = h_prev.clone();
            teacher.extend_from_slice(&out.hidden[..(chunk.len() - 1) * e]);
            let t = Instant::now();
            head.forward(chunk, &teacher, start, cache, LogitRows::None, pool)?;
            head_ms += t.elapsed().as_secs_f64() * 1e3;
        }
        h_prev = out.hidden[(chunk.len() - 1) * e..chunk.len() * e].to_vec();
    }
    progress.finish();
    Ok(Prefilled {
        state,
        head_cache,
        h_last: h_prev,
        prefill_ms,
        head_ms,
    })
}

/// Grow a prefilled sequence (and the head's cache) to `depth` positions by appending copies
/// of its own attention rows, first positions first, without computing them: a pass's cost
/// depends on how many positions it attends to and their stored type, not on their values, so
/// this reaches depths that a real prefill on a small machine would take hours to.
/// The delta-net states stay those after the real prefill (their size does not depend on the
/// position).
pub fn fill_to_depth(at: &mut Prefilled, depth: usize) -> Result<()> {
    let base = at.state.n_past;
    if depth <= base {
        return Ok(());
    }
    at.state.check_room(depth - base + 8)?;
    let mut caches: Vec<&mut LayerCache> = at.state.layers.iter_mut().collect();
    caches.extend(at.head_cache.as_mut());
    for cache in caches {
        if let Some(rows) = cache.attention_rows(0, base) {
            let rows = rows?;
            let mut len = base;
            while len < depth {
                let take = (depth - len).min(base);
                cache.append_attention_rows(&rows.range(0, take))?;
                len += take;
            }
        }
    }
    at.state.n_past = depth;
    Ok(())
}

/// Median milliseconds of the passes at one context.
pub struct Costs {
    pub decode_ms: f64,
    /// Verify of 1, 2, ... rows.
    pub verify_ms: Vec<f64>,
    pub draft_ms: f64,
}

/// Time one decode step, verify passes of 1..=max_rows rows and one draft step from the state
/// `at` (left as it was), each `reps` times (the median kept).
pub fn time_passes(
    loaded: &Loaded,
    head: Option<&NextnHead>,
    at: &mut Prefilled,
    probe: &[u32],
    max_rows: usize,
    reps: usize,
) -> Result<Costs> {
    let (model, pool) = (&loaded.model, &loaded.pool);
    let reps = reps.max(1);
    let probe = synthetic_prompt(probe, max_rows.max(1));
    let mut verify_ms = Vec::new();
    for r in 1..=max_rows {
        let mut times = Vec::new();
        for _ in 0..reps {
            let t = Instant::now();
            model.forward_verify(&probe[..r], &mut at.state, pool)?;
            model.commit(&mut at.state, 0)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        verify_ms.push(median(times));
    }
    // Decode steps one after the other on a copy (the context grows by `reps` tokens), so the
    // cache grows as it does in generation rather than reallocating in every timed step.
    let mut times = Vec::new();
    let mut dec = at.state.try_clone()?;
    for i in 0..reps {
        let t = Instant::now();
        model.forward(
            &probe[i % probe.len()..][..1],
            &mut dec,
            LogitRows::Last,
            pool,
        )?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let decode_ms = median(times);
    let n_past = at.state.n_past;
    let draft_ms = match (head, at.head_cache.as_mut()) {
        (Some(head), Some(cache)) => {
            let times = (0..reps)
                .map(|_| time_draft_step(loaded, head, cache, probe[0], &at.h_last, n_past))
                .collect::<Result<Vec<f64>>>()?;
            median(times)
        }
        _ => f64::NAN,
    };
    Ok(Costs {
        decode_ms,
        verify_ms,
        draft_ms,
    })
}

/// The table of passes at every depth: prefill throughput to reach it, decode, verify of r rows
/// (and its ratio to decode) and the draft step. Returns one JSON object per depth.
/// What `bench -d` times: the depths, verify passes of up to `max_rows` rows, `reps` repetitions
/// of each pass, and with `fill_from` only that many positions computed (the rest copies).
pub struct DepthPlan<'a> {
    pub depths: &'a [usize],
    pub max_rows: usize,
    pub reps: usize,
    pub fill_from: Option<usize>,
}

pub fn run(
    loaded: &Loaded,
    head: Option<&NextnHead>,
    prompt: &[u32],
    plan: &DepthPlan<'_>,
    say: &dyn Fn(String),
) -> Result<Vec<Value>> {
    let &DepthPlan {
        depths,
        max_rows,
        reps,
        fill_from,
    } = plan;
    let verify_heads: String = (2..=max_rows)
        .map(|r| format!(" | {:>15}", format!("verify {r} rows")))
        .collect();
    say(format!(
        "{:>7} | {:>10} | {:>15} | {:>9} | {:>9}{verify_heads} | {:>15}",
        "depth", "prefill/s", "with head/s", "decode ms", "decode/s", "draft step"
    ));
    let mut out = Vec::new();
    for &depth in depths {
        if depth + max_rows + 8 > loaded.n_ctx {
            bail!(
                "depth {depth}: the context holds {} tokens; give a larger -c",
                loaded.n_ctx
            );
        }
        let t0 = Instant::now();
        let computed = fill_from.map_or(depth, |n| n.min(depth)).max(1);
        eprintln!("depth {depth}: prefilling {computed} tokens ...");
        let mut at = prefill(loaded, head, &synthetic_prompt(prompt, computed))?;
        eprintln!(
            "depth {depth}: prefilled in {:.1} s; timing passes",
            t0.elapsed().as_secs_f64()
        );
        let prefill_tps = computed as f64 * 1e3 / at.prefill_ms;
        // The prompt rows through the target and then the head, as `run` and `serve` take
        // them with `--spec-type nextn`; the share is the head's part of that time.
        let with_head = head.map(|_| {
            let tps = computed as f64 * 1e3 / (at.prefill_ms + at.head_ms);
            (tps, at.head_ms / (at.prefill_ms + at.head_ms))
        });
        if computed < depth {
            fill_to_depth(&mut at, depth)?;
            eprintln!(
                "depth {depth}: attention caches filled with copies of the {computed} computed positions"
            );
        }
        let c = time_passes(loaded, head, &mut at, prompt, max_rows, reps)?;
        let verify_cells: String = c.verify_ms[1..]
            .iter()
            .map(|v| format!(" | {:>15}", format!("{v:.2} ({:.2}x)", v / c.decode_ms)))
            .collect();
        let draft = if c.draft_ms.is_nan() {
            "-".to_string()
        } else {
            format!("{:.2} ({:.2}x)", c.draft_ms, c.draft_ms / c.decode_ms)
        };
        let with_head_cell = with_head.map_or("-".to_string(), |(tps, share)| {
            format!("{tps:.1} ({:.1} %)", share * 100.0)
        });
        say(format!(
            "{depth:>7} | {prefill_tps:>10.1} | {with_head_cell:>15} | {:>9.2} | {:>9.1}{verify_cells} | {draft:>15}",
            c.decode_ms,
            1e3 / c.decode_ms
        ));
        out.push(json!({
            "depth": depth,
            "computed_positions": computed,
            "prefill_tokens_per_s": prefill_tps,
            "prefill_with_head_tokens_per_s": with_head.map(|(tps, _)| tps),
            "head_share_of_prefill": with_head.map(|(_, share)| share),
            "decode_ms": c.decode_ms,
            "decode_tokens_per_s": 1e3 / c.decode_ms,
            "verify_ms": c.verify_ms,
            "draft_ms": (!c.draft_ms.is_nan()).then_some(c.draft_ms),
        }));
    }
    Ok(out)
}
