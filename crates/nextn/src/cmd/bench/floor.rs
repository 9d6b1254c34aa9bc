//! `nextn bench --floor`: the machine's streaming read bandwidth, and each pass of the cost model
//! (plain decode, verify of r rows, draft step) against its bandwidth floor: the bytes of weights
//! and cache the pass touches divided by that bandwidth. A pass at 100% runs at the floor, so the
//! percentage is comparable across machines. Also prefill throughput and time to first token on
//! synthetic prompts of a chosen length.

use std::hint::black_box;
use std::time::Instant;

use anyhow::Result;
use nextn_engine::sampler::argmax;
use nextn_model::pass_bytes::{self, PassBytes, PassShape};
use nextn_model::{LogitRows, NextnHead};
use serde_json::{json, Value};

use super::depth::{prefill, synthetic_prompt, PrefillProgress, PREFILL_BATCH};
use super::{median, time_draft_step};
use crate::cmd::common::Loaded;

#[derive(clap::Args, Clone, Debug)]
pub struct FloorArgs {
    /// Also measure streaming read bandwidth (1 thread and -t threads) and report every
    /// cost-model pass against its bandwidth floor (bytes touched ÷ bandwidth), plus prefill
    /// throughput (--floor-pp) and time to first token (--floor-ttft) on synthetic prompts
    #[arg(long)]
    pub floor: bool,
    /// Buffer read by the bandwidth measurement, MiB (keep it far above the last-level cache)
    #[arg(long = "floor-buffer-mib", default_value_t = 1024)]
    pub buffer_mib: usize,
    /// Passes over the buffer per thread count (the best is kept)
    #[arg(long = "floor-passes", default_value_t = 5)]
    pub passes: usize,
    /// Largest verify pass reported with --floor, in rows (at least --spec-draft-n-max + 1)
    #[arg(long = "floor-verify-rows", default_value_t = 4)]
    pub verify_rows: usize,
    /// Prompt length of the --floor prefill measurement (one pass of up to 512 rows at a time,
    /// like generation); 0 skips it
    #[arg(long = "floor-pp", default_value_t = 512)]
    pub pp: usize,
    /// Prompt length of the --floor time-to-first-token measurement (prefill plus the first
    /// greedy token); 0 skips it
    #[arg(long = "floor-ttft", default_value_t = 4096)]
    pub ttft: usize,
}

/// Wrapping sum of 64-bit words with eight independent accumulators, so the loop is limited by
/// loads, not by an add chain.
#[inline(always)]
fn sum_words_portable(buf: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut chunks = buf.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            acc[i] = acc[i].wrapping_add(c[i]);
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(0u64, |a, &b| a.wrapping_add(b));
    acc.iter().fold(tail, |a, &b| a.wrapping_add(b))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_words_avx2(buf: &[u64]) -> u64 {
    // The same loop compiled with 256-bit loads.
    sum_words_portable(buf)
}

fn sum_words(buf: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { sum_words_avx2(buf) };
    }
    sum_words_portable(buf)
}

/// Best streaming read bandwidth (bytes/s) over `passes` reads of `buf`, split evenly over
/// `threads` threads.
fn read_bandwidth(buf: &[u64], threads: usize, passes: usize) -> f64 {
    let threads = threads.max(1);
    let per = buf.len().div_ceil(threads);
    let mut best = f64::INFINITY;
    for _ in 0..passes.max(1) {
        let t = Instant::now();
        std::thread::scope(|s| {
            let handles: Vec<_> = buf
                .chunks(per)
                .map(|part| s.spawn(move || black_box(sum_words(part))))
                .collect();
            for h in handles {
                // A summing thread cannot panic; if one did, the pass still ends.
                let _ = h.join();
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::mem::size_of_val(buf) as f64 / best
}

/// Streaming read bandwidth in bytes/s with 1 thread and with `threads`.
pub fn measure_bandwidth(buffer_bytes: usize, passes: usize, threads: usize) -> (f64, f64) {
    let n = (buffer_bytes / 8).max(1 << 10);
    // Distinct values on every page: a zeroed allocation could map one shared zero page and be
    // read from cache.
    let buf: Vec<u64> = (0..n as u64).map(|i| i.wrapping_mul(0x9e37_79b9)).collect();
    let one = read_bandwidth(&buf, 1, passes);
    let many = if threads > 1 {
        read_bandwidth(&buf, threads, passes)
    } else {
        one
    };
    (one, many)
}

/// One timed pass kind with the bytes it touches.
struct PassFloor {
    name: String,
    ms: f64,
    bytes: PassBytes,
    /// Distinct experts read and expert weight passes (MoE only).
    experts: Option<(u64, u64)>,
}

impl PassFloor {
    fn floor_ms(&self, bandwidth: f64) -> f64 {
        self.bytes.total() as f64 / bandwidth * 1e3
    }

    fn to_json(&self, bandwidth: f64, decode_ms: f64) -> Value {
        let floor = self.floor_ms(bandwidth);
        json!({
            "pass": self.name,
            "ms": self.ms,
            "x_decode": self.ms / decode_ms,
            "bytes": self.bytes.total(),
            "bytes_by_kind": {
                "weights": self.bytes.weights,
                "experts": self.bytes.experts,
                "lm_head": self.bytes.lm_head,
                "embedding": self.bytes.embedding,
                "kv_cache": self.bytes.kv_cache,
                "recurrent_state": self.bytes.recurrent_state,
            },
            "floor_ms": floor,
            "pct_of_floor": 100.0 * floor / self.ms,
            "experts_distinct": self.experts.map(|e| e.0),
            "expert_weight_reads": self.experts.map(|e| e.1),
        })
    }
}

fn moe_counts(loaded: &Loaded) -> Option<(u64, u64)> {
    (loaded.model.config.n_expert > 0).then(|| pass_bytes::expert_reads(&loaded.model.layers))
}

/// Time and account decode, verify passes of 1..=max_rows rows and a draft step at the context
/// of `prompt`, each repeated `reps` times from the same state (median kept).
fn measure_passes(
    loaded: &Loaded,
    head: Option<&NextnHead>,
    prompt: &[u32],
    max_rows: usize,
    reps: usize,
) -> Result<Vec<PassFloor>> {
    let (model, pool) = (&loaded.model, &loaded.pool);
    let reps = reps.max(1);
    let mut at = prefill(loaded, head, prompt)?;
    let st = &mut at.state;
    let probe = synthetic_prompt(prompt, max_rows);
    let shape = |n_past, n_rows, logit_rows| PassShape {
        n_past,
        n_rows,
        logit_rows,
        k_type: loaded.k_type,
        v_type: loaded.v_type,
    };
    let mut passes = Vec::new();

    let mut times = Vec::new();
    for _ in 0..reps {
        let mut dec = st.clone();
        pass_bytes::reset_expert_usage(model);
        let t = Instant::now();
        model.forward(&probe[..1], &mut dec, LogitRows::Last, pool)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    passes.push(PassFloor {
        name: "plain decode".into(),
        ms: median(times),
        bytes: pass_bytes::trunk_pass_bytes(model, &shape(prompt.len(), 1, 1)),
        experts: moe_counts(loaded),
    });

    for r in 1..=max_rows {
        let mut times = Vec::new();
        for _ in 0..reps {
            pass_bytes::reset_expert_usage(model);
            let t = Instant::now();
            model.forward_verify(&probe[..r], st, pool)?;
            model.commit(st, 0)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        passes.push(PassFloor {
            name: format!("verify {r} row{}", if r == 1 { "" } else { "s" }),
            ms: median(times),
            bytes: pass_bytes::trunk_pass_bytes(model, &shape(prompt.len(), r, r)),
            experts: moe_counts(loaded),
        });
    }

    if let (Some(head), Some(cache)) = (head, at.head_cache.as_mut()) {
        let h_last = &at.h_last;
        let mut times = Vec::new();
        for _ in 0..reps {
            pass_bytes::reset_head_expert_usage(head);
            times.push(time_draft_step(
                loaded,
                head,
                cache,
                probe[0],
                h_last,
                prompt.len(),
            )?);
        }
        passes.push(PassFloor {
            name: "draft step (full vocab)".into(),
            ms: median(times),
            bytes: pass_bytes::head_pass_bytes(head, &shape(prompt.len(), 1, 1)),
            experts: (model.config.n_expert > 0)
                .then(|| pass_bytes::expert_reads(std::slice::from_ref(head.layer()))),
        });
    }
    Ok(passes)
}

/// Milliseconds to prefill `len` synthetic tokens and pick the first token greedily.
fn time_prefill(loaded: &Loaded, prompt: &[u32], len: usize, what: &str) -> Result<Option<f64>> {
    if len == 0 || len >= loaded.n_ctx {
        return Ok(None);
    }
    let tokens = synthetic_prompt(prompt, len);
    let mut st = loaded.new_sequence()?;
    let t = Instant::now();
    let chunks: Vec<&[u32]> = tokens.chunks(PREFILL_BATCH).collect();
    let mut logits = Vec::new();
    let mut progress = PrefillProgress::new(what, len);
    for (i, chunk) in chunks.iter().enumerate() {
        progress.update(i * PREFILL_BATCH);
        let rows = if i + 1 == chunks.len() {
            LogitRows::Last
        } else {
            LogitRows::None
        };
        logits = loaded
            .model
            .forward(chunk, &mut st, rows, &loaded.pool)?
            .logits;
    }
    progress.finish();
    black_box(argmax(&logits));
    Ok(Some(t.elapsed().as_secs_f64() * 1e3))
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// Run the floor report: print it and return it as JSON.
pub fn report(
    loaded: &Loaded,
    head: Option<&NextnHead>,
    prompt: &[u32],
    max_rows: usize,
    reps: usize,
    args: &FloorArgs,
) -> Result<Value> {
    let threads = loaded.pool.n_threads();
    let (bw1, bwn) = measure_bandwidth(args.buffer_mib << 20, args.passes, threads);
    let passes = measure_passes(loaded, head, prompt, max_rows.max(args.verify_rows), reps)?;
    let decode_ms = passes[0].ms;
    println!();
    println!(
        "bandwidth floor: streaming read {:.1} GB/s on 1 thread, {:.1} GB/s on {threads} ({} MiB buffer, best of {} passes); floors below use {:.1} GB/s",
        bw1 / 1e9,
        bwn / 1e9,
        args.buffer_mib,
        args.passes.max(1),
        bwn / 1e9
    );
    println!(
        "  % of floor = floor ms / measured ms (100% runs at the bandwidth floor); context {} tokens",
        prompt.len()
    );
    println!(
        "  {:<24} {:>9} {:>7} {:>12} {:>9} {:>10}",
        "pass", "ms", "x dec", "MiB touched", "floor ms", "% floor"
    );
    for p in &passes {
        let floor = p.floor_ms(bwn);
        println!(
            "  {:<24} {:>9.3} {:>7.2} {:>12.1} {:>9.3} {:>9.1}%",
            p.name,
            p.ms,
            p.ms / decode_ms,
            mib(p.bytes.total()),
            floor,
            100.0 * floor / p.ms
        );
    }
    let all_experts = pass_bytes::all_expert_bytes(&loaded.model);
    if all_experts > 0 {
        println!(
            "  routed experts: {:.1} MiB in all; streamed per pass (distinct experts / weight reads over all layers):",
            mib(all_experts)
        );
        for p in &passes {
            if let Some((distinct, reads)) = p.experts {
                println!(
                    "    {:<22} {:>9.1} MiB  {distinct} / {reads}",
                    p.name,
                    mib(p.bytes.experts)
                );
            }
        }
    }
    let pp_ms = time_prefill(loaded, prompt, args.pp, &format!("pp{}", args.pp))?;
    if let Some(ms) = pp_ms {
        println!(
            "  prefill pp{}: {:.1} tok/s ({:.0} ms)",
            args.pp,
            args.pp as f64 * 1e3 / ms,
            ms
        );
    } else if args.pp > 0 {
        println!(
            "  prefill pp{}: skipped (context {} too small)",
            args.pp, loaded.n_ctx
        );
    }
    let ttft_ms = time_prefill(loaded, prompt, args.ttft, "time to first token")?;
    if let Some(ms) = ttft_ms {
        println!(
            "  time to first token, {}-token prompt: {:.0} ms ({:.1} tok/s)",
            args.ttft,
            ms,
            args.ttft as f64 * 1e3 / ms
        );
    } else if args.ttft > 0 {
        println!(
            "  time to first token, {}-token prompt: skipped (context {} too small)",
            args.ttft, loaded.n_ctx
        );
    }
    Ok(json!({
        "bandwidth_1_thread_bytes_s": bw1,
        "bandwidth_bytes_s": bwn,
        "bandwidth_threads": threads,
        "buffer_bytes": (args.buffer_mib as u64) << 20,
        "context": prompt.len(),
        "passes": passes.iter().map(|p| p.to_json(bwn, decode_ms)).collect::<Vec<_>>(),
        "all_expert_bytes": all_experts,
        "prefill": pp_ms.map(|ms| json!({"tokens": args.pp, "ms": ms, "tok_s": args.pp as f64 * 1e3 / ms})),
        "ttft": ttft_ms.map(|ms| json!({"tokens": args.ttft, "ms": ms})),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_sum_matches_a_plain_fold() {
        let v: Vec<u64> = (0..1003u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a))
            .collect();
        let expect = v.iter().fold(0u64, |a, &b| a.wrapping_add(b));
        assert_eq!(sum_words(&v), expect);
        assert_eq!(sum_words_portable(&v), expect);
    }

    #[test]
    fn bandwidth_is_positive_and_finite() {
        let (one, two) = measure_bandwidth(8 << 20, 2, 2);
        assert!(one.is_finite() && one > 0.0);
        assert!(two.is_finite() && two > 0.0);
    }
}
