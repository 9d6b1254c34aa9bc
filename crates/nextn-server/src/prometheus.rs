//! `/metrics` in the Prometheus text format with llama-server's `llamacpp:` names, so existing
//! dashboards keep working; metrics llama-server does not have use the `nextn:` prefix.

use std::fmt::Write;

use nextn_engine::scheduler::MetricsSnapshot;

use crate::conn::{ConnStats, Expiry};

enum Kind {
    Counter,
    Gauge,
}

fn family(out: &mut String, name: &str, kind: Kind, help: &str, samples: &[(String, f64)]) {
    let kind = match kind {
        Kind::Counter => "counter",
        Kind::Gauge => "gauge",
    };
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (labels, v) in samples {
        let _ = writeln!(out, "{name}{labels} {}", number(*v));
    }
}

/// Integers print without a fraction; everything else as Rust prints f64 (always finite here).
fn number(v: f64) -> String {
    if v.is_finite() && v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else if v.is_finite() {
        format!("{v}")
    } else {
        "0".to_string()
    }
}

pub fn render(m: &MetricsSnapshot, n_slots: usize, n_max: usize) -> String {
    let mut out = String::new();
    let one = |v: f64| vec![(String::new(), v)];
    let c = |out: &mut String, name: &str, help: &str, v: f64| {
        family(
            out,
            &format!("llamacpp:{name}"),
            Kind::Counter,
            help,
            &one(v),
        )
    };
    let g = |out: &mut String, name: &str, help: &str, v: f64| {
        family(out, &format!("llamacpp:{name}"), Kind::Gauge, help, &one(v))
    };
    c(
        &mut out,
        "prompt_tokens_total",
        "Number of prompt tokens processed.",
        m.prompt_tokens_total as f64,
    );
    c(
        &mut out,
        "prompt_seconds_total",
        "Prompt process time",
        m.prompt_seconds_total,
    );
    c(
        &mut out,
        "tokens_predicted_total",
        "Number of generation tokens processed.",
        m.tokens_predicted_total as f64,
    );
    c(
        &mut out,
        "tokens_predicted_seconds_total",
        "Predict process time",
        m.tokens_predicted_seconds_total,
    );
    c(
        &mut out,
        "n_decode_total",
        "Total number of llama_decode() calls",
        m.n_decode_total as f64,
    );
    g(
        &mut out,
        "n_tokens_max",
        "Largest observed n_tokens.",
        m.n_tokens_max as f64,
    );
    g(
        &mut out,
        "n_busy_slots_per_decode",
        "Average number of busy slots per llama_decode() call",
        m.busy_slots_per_decode(),
    );
    g(
        &mut out,
        "prompt_tokens_seconds",
        "Average prompt throughput in tokens/s.",
        m.prompt_tokens_per_second(),
    );
    g(
        &mut out,
        "predicted_tokens_seconds",
        "Average generation throughput in tokens/s.",
        m.predicted_tokens_per_second(),
    );
    g(
        &mut out,
        "requests_processing",
        "Number of requests processing.",
        m.requests_processing as f64,
    );
    g(
        &mut out,
        "requests_deferred",
        "Number of requests deferred.",
        m.requests_deferred as f64,
    );
    c(
        &mut out,
        "spec_decode_num_drafts_total",
        "Number of speculative verification steps that carried drafts.",
        m.spec_drafts_total as f64,
    );
    c(
        &mut out,
        "spec_decode_num_draft_tokens_total",
        "Number of draft tokens generated.",
        m.spec_draft_tokens_total as f64,
    );
    c(
        &mut out,
        "spec_decode_num_accepted_tokens_total",
        "Number of draft tokens accepted.",
        m.spec_accepted_tokens_total as f64,
    );
    let per_pos: Vec<(String, f64)> = (0..n_max.max(m.spec_accepted_per_pos_total.len()))
        .map(|i| {
            (
                format!("{{position=\"{i}\"}}"),
                m.spec_accepted_per_pos_total.get(i).copied().unwrap_or(0) as f64,
            )
        })
        .collect();
    family(
        &mut out,
        "llamacpp:spec_decode_num_accepted_tokens_per_pos_total",
        Kind::Counter,
        "Number of accepted draft tokens at each draft position.",
        &per_pos,
    );
    let n = |name: &str| format!("nextn:{name}");
    family(
        &mut out,
        &n("slots_total"),
        Kind::Gauge,
        "Parallel slots (-np).",
        &one(n_slots as f64),
    );
    family(
        &mut out,
        &n("prompt_tokens_cached_total"),
        Kind::Counter,
        "Prompt tokens resumed from the prefix cache instead of being processed.",
        &one(m.prompt_tokens_cached_total as f64),
    );
    family(
        &mut out,
        &n("cache_bytes"),
        Kind::Gauge,
        "Bytes held by the prefix cache (attention rows and snapshots).",
        &one(m.cache_bytes as f64),
    );
    family(
        &mut out,
        &n("cache_snapshots"),
        Kind::Gauge,
        "Snapshots held by the prefix cache.",
        &one(m.cache_snapshots as f64),
    );
    family(
        &mut out,
        &n("cache_snapshots_stored_total"),
        Kind::Counter,
        "Snapshots stored in the prefix cache.",
        &one(m.cache_snapshots_stored_total as f64),
    );
    family(
        &mut out,
        &n("cache_evictions_total"),
        Kind::Counter,
        "Prefix-cache entries evicted to stay within --cache-ram.",
        &one(m.cache_evictions_total as f64),
    );
    family(
        &mut out,
        &n("requests_finished_total"),
        Kind::Counter,
        "Requests that ran to completion.",
        &one(m.requests_finished_total as f64),
    );
    family(
        &mut out,
        &n("requests_cancelled_total"),
        Kind::Counter,
        "Requests cancelled (client gone, shutdown or failure).",
        &one(m.requests_cancelled_total as f64),
    );
    family(
        &mut out,
        &n("images_encoded_total"),
        Kind::Counter,
        "Images encoded by the vision tower (on the encoder thread, beside the generation loop).",
        &one(m.images_encoded_total as f64),
    );
    family(
        &mut out,
        &n("image_encode_seconds_total"),
        Kind::Counter,
        "Seconds the vision tower spent encoding images.",
        &one(m.image_encode_seconds_total),
    );
    family(
        &mut out,
        &n("image_encodes_cancelled_total"),
        Kind::Counter,
        "Image encodes skipped or stopped because their request went away.",
        &one(m.image_encodes_cancelled_total as f64),
    );
    family(
        &mut out,
        &n("step_drafting_slots"),
        Kind::Gauge,
        "Slots that drafted in the last step.",
        &one(m.last_step_drafting_slots as f64),
    );
    family(
        &mut out,
        &n("step_draft_tokens"),
        Kind::Gauge,
        "Draft tokens verified in the last step.",
        &one(m.last_step_draft_tokens as f64),
    );
    family(
        &mut out,
        &n("step_rows"),
        Kind::Gauge,
        "Rows in the last target forward pass.",
        &one(m.last_step_rows as f64),
    );
    let curve = |v: &[(usize, f64)]| -> Vec<(String, f64)> {
        v.iter()
            .map(|&(r, ms)| (format!("{{rows=\"{r}\"}}"), ms / 1000.0))
            .collect()
    };
    if !m.cost_target_ms.is_empty() {
        family(
            &mut out,
            &n("cost_target_pass_seconds"),
            Kind::Gauge,
            "Drafting policy's current estimate of a target pass over this many rows (one with logits).",
            &curve(&m.cost_target_ms),
        );
        family(
            &mut out,
            &n("cost_head_pass_seconds"),
            Kind::Gauge,
            "Drafting policy's current estimate of a head pass over this many rows (one with logits).",
            &curve(&m.cost_head_ms),
        );
        let acc: Vec<(String, f64)> = m
            .acceptance_estimate
            .iter()
            .enumerate()
            .map(|(i, &a)| (format!("{{position=\"{i}\"}}"), a))
            .collect();
        family(
            &mut out,
            &n("acceptance_estimate"),
            Kind::Gauge,
            "Drafting policy's server-wide estimate of acceptance at each draft position, given the earlier ones were accepted.",
            &acc,
        );
    }
    family(
        &mut out,
        &n("step_seconds"),
        Kind::Gauge,
        "Duration of the last target forward pass.",
        &one(m.last_step_ms / 1000.0),
    );
    out
}

/// The HTTP connection families: open connections, the cap, and those the server closed on a
/// timeout, by `reason` (`header_read`, `idle`, `write`).
pub fn render_connections(c: &ConnStats, max_connections: usize) -> String {
    let mut out = String::new();
    family(
        &mut out,
        "nextn:http_connections",
        Kind::Gauge,
        "Open HTTP connections.",
        &[(String::new(), c.open() as f64)],
    );
    family(
        &mut out,
        "nextn:http_connections_max",
        Kind::Gauge,
        "Most HTTP connections served at once (--max-connections); more wait in the listen backlog.",
        &[(String::new(), max_connections as f64)],
    );
    family(
        &mut out,
        "nextn:http_connections_accepted_total",
        Kind::Counter,
        "HTTP connections accepted.",
        &[(String::new(), c.accepted_total() as f64)],
    );
    let expired: Vec<(String, f64)> = Expiry::ALL
        .iter()
        .map(|&e| {
            (
                format!("{{reason=\"{}\"}}", e.label()),
                c.expired_total(e) as f64,
            )
        })
        .collect();
    family(
        &mut out,
        "nextn:http_connections_timed_out_total",
        Kind::Counter,
        "HTTP connections the server closed on a timeout: request head not read in time, idle keep-alive, client not reading.",
        &expired,
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_values() {
        let m = MetricsSnapshot {
            prompt_tokens_total: 12,
            tokens_predicted_total: 30,
            spec_drafts_total: 4,
            spec_draft_tokens_total: 10,
            spec_accepted_tokens_total: 7,
            spec_accepted_per_pos_total: vec![4, 2, 1],
            prompt_seconds_total: 0.5,
            ..Default::default()
        };
        let text = render(&m, 4, 3);
        for line in [
            "llamacpp:prompt_tokens_total 12",
            "llamacpp:prompt_seconds_total 0.5",
            "llamacpp:tokens_predicted_total 30",
            "llamacpp:spec_decode_num_drafts_total 4",
            "llamacpp:spec_decode_num_draft_tokens_total 10",
            "llamacpp:spec_decode_num_accepted_tokens_total 7",
            "llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"} 4",
            "llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position=\"2\"} 1",
            "# TYPE llamacpp:requests_processing gauge",
            "nextn:slots_total 4",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        let text = render_connections(&ConnStats::default(), 1024);
        for line in [
            "nextn:http_connections 0",
            "nextn:http_connections_max 1024",
            "# TYPE nextn:http_connections_accepted_total counter",
            "nextn:http_connections_timed_out_total{reason=\"header_read\"} 0",
            "nextn:http_connections_timed_out_total{reason=\"idle\"} 0",
            "nextn:http_connections_timed_out_total{reason=\"write\"} 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }
}
