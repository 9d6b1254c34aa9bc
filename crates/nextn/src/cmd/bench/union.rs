//! `nextn bench --expert-union` (MoE files): how the cost of a verify pass, and so the MTP
//! speedup, depends on how many experts the rows of one pass share.
//!
//! A verify pass of r rows reads every expert any of its rows picked, once: between k (all rows
//! picked the same k experts) and r·k (no two rows share one). Random weights route at random,
//! so a synthesized file only ever shows the disjoint end; a trained model's consecutive tokens
//! share more. The routed experts are the only part of a pass that depends on the routing, so
//! each layer's expert products are timed on their own, with routings built to have each union
//! size, and the pass cost at union u is the measured verify pass with the expert part swapped:
//! `verify(u) = verify_measured + experts(u) − experts(u_measured)`.

use std::time::Instant;

use anyhow::{bail, Result};
use nextn_model::ffn::{Ffn, MoeFfn, Routing};
use nextn_model::pass_bytes;
use nextn_model::NextnHead;
use serde_json::{json, Value};

use super::depth::{prefill, time_passes};
use super::{median, speedup_at};
use crate::cmd::common::Loaded;

/// Experts for `rows` rows of `k` each with exactly `union` distinct ones: row 0 takes the first
/// k of `order`; the `union − k` new experts are spread as evenly as they go over the other
/// rows, each of which fills its remaining slots with row 0's experts.
pub fn routing_with_union(order: &[usize], rows: usize, k: usize, union: usize) -> Vec<Vec<usize>> {
    let extra = union.saturating_sub(k);
    let others = rows.saturating_sub(1).max(1);
    let mut next_new = k;
    (0..rows)
        .map(|i| {
            if i == 0 {
                return order[..k].to_vec();
            }
            let new = extra / others + usize::from(i - 1 < extra % others);
            let mut r: Vec<usize> = order[next_new..next_new + new].to_vec();
            next_new += new;
            r.extend_from_slice(&order[..k - new]);
            r
        })
        .collect()
}

/// A fixed pseudo-random permutation of `0..n` (xorshift; the seed picks the layer).
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.swap(i, (s % (i as u64 + 1)) as usize);
    }
    v
}

/// Median milliseconds of the routed and shared experts of every MoE layer for `rows` rows
/// whose routings have `union` distinct experts per layer.
fn time_experts(
    loaded: &Loaded,
    layers: &[&MoeFfn],
    rows: usize,
    union: usize,
    reps: usize,
) -> Result<f64> {
    let n_embd = loaded.model.config.n_embd;
    let x: Vec<f32> = (0..rows * n_embd)
        .map(|i| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * 0.1)
        .collect();
    let routings: Vec<Routing> = layers
        .iter()
        .enumerate()
        .map(|(il, f)| {
            let order = shuffled(f.gate.len(), il as u64 + 1);
            Routing::uniform(&routing_with_union(&order, rows, f.n_used, union))
        })
        .collect();
    let mut out = vec![0.0f32; rows * n_embd];
    let mut times = Vec::new();
    for _ in 0..reps.max(1) + 1 {
        let t = Instant::now();
        for (f, routing) in layers.iter().zip(&routings) {
            f.forward_routed(&x, rows, routing, &mut out, &loaded.pool)?;
        }
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    // The first repetition warms the caches and the pool; it is not counted.
    times.remove(0);
    Ok(median(times))
}

/// Time the passes at the prompt, then the expert products at every union size for 2..=max_rows
/// rows, and print the verify cost and the projected MTP speedup (at `acceptance`) per union.
pub fn run(
    loaded: &Loaded,
    head: Option<&NextnHead>,
    prompt: &[u32],
    max_rows: usize,
    reps: usize,
    acceptance: &[f64],
    say: &dyn Fn(String),
) -> Result<Value> {
    let layers: Vec<&MoeFfn> = loaded
        .model
        .layers
        .iter()
        .filter_map(|l| match &l.ffn {
            Ffn::Moe(f) => Some(f),
            Ffn::Dense(_) => None,
        })
        .collect();
    let Some(first) = layers.first() else {
        bail!(
            "--expert-union needs a mixture-of-experts model; {} is dense",
            loaded.path.display()
        );
    };
    let Some(head) = head else {
        bail!("--expert-union needs the model's NextN head (the draft step is part of the cost)");
    };
    let k = first.n_used;
    let n_expert = first.gate.len();
    let max_rows = max_rows.clamp(2, (n_expert / k).max(2));
    let mut at = prefill(loaded, Some(head), prompt)?;
    // The union each measured verify pass had, per layer (random weights: nearly disjoint).
    let mut measured_union = Vec::new();
    for r in 1..=max_rows {
        let probe = super::depth::synthetic_prompt(prompt, r);
        pass_bytes::reset_expert_usage(&loaded.model);
        loaded
            .model
            .forward_verify(&probe, &mut at.state, &loaded.pool)?;
        loaded.model.commit(&mut at.state, 0)?;
        let (distinct, _) = pass_bytes::expert_reads(&loaded.model.layers);
        measured_union.push(distinct as f64 / layers.len() as f64);
    }
    let costs = time_passes(loaded, Some(head), &mut at, prompt, max_rows, reps)?;
    say(format!(
        "expert union: {} MoE layers, {k} of {n_expert} experts per row; decode {:.2} ms, draft step {:.2} ms; acceptance {:?}",
        layers.len(),
        costs.decode_ms,
        costs.draft_ms,
        acceptance
    ));
    say(format!(
        "{:>4} | {:>14} | {:>10} | {:>9} | {:>8} | {:>12}",
        "rows", "union / layer", "experts ms", "verify ms", "x decode", "MTP n_max"
    ));
    let one_row = time_experts(loaded, &layers, 1, k, reps)?;
    let mut out = Vec::new();
    for r in 2..=max_rows {
        let measured_u = measured_union[r - 1];
        let verify_measured = costs.verify_ms[r - 1];
        // The expert part of the measured pass, at its (rounded) union.
        let at_measured = time_experts(loaded, &layers, r, measured_u.round() as usize, reps)?;
        let n = r - 1;
        for union in k..=r * k {
            let experts = time_experts(loaded, &layers, r, union, reps)?;
            let verify = verify_measured + experts - at_measured;
            let (_, speedup) = speedup_at(costs.decode_ms, verify, costs.draft_ms, acceptance, n);
            say(format!(
                "{r:>4} | {:>14} | {experts:>10.2} | {verify:>9.2} | {:>8.2} | {:>12}",
                format!("{union} ({:.2})", union as f64 / k as f64),
                verify / costs.decode_ms,
                format!("{n}: {speedup:.3}x")
            ));
            out.push(json!({
                "rows": r,
                "union": union,
                "experts_ms": experts,
                "verify_ms": verify,
                "verify_over_decode": verify / costs.decode_ms,
                "n_max": n,
                "projected_speedup": speedup,
            }));
        }
        say(format!(
            "     measured pass: {verify_measured:.2} ms at {measured_u:.1} experts per layer (random routing)"
        ));
    }
    Ok(json!({
        "moe_layers": layers.len(),
        "experts_per_row": k,
        "n_expert": n_expert,
        "decode_ms": costs.decode_ms,
        "draft_ms": costs.draft_ms,
        "verify_ms": costs.verify_ms,
        "measured_union_per_layer": measured_union,
        "experts_ms_one_row": one_row,
        "acceptance": acceptance,
        "curve": out,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routings_have_the_asked_union_and_k_distinct_experts_per_row() {
        let order = shuffled(256, 3);
        for rows in 1..=4 {
            for union in 8..=rows * 8 {
                let r = routing_with_union(&order, rows, 8, union);
                assert_eq!(r.len(), rows);
                for row in &r {
                    let mut d = row.clone();
                    d.sort_unstable();
                    d.dedup();
                    assert_eq!(d.len(), 8, "rows {rows}, union {union}: {row:?}");
                }
                assert_eq!(Routing::uniform(&r).distinct(), union, "rows {rows}");
            }
        }
    }
}
